// SPDX-License-Identifier: Apache-2.0
// bench_peer: parses bench/peer/llamacpp.sh's JSON (llama.cpp's llama-bench
// figures on this machine) and formats them beside Tandem's with the ratios
// tandem-bench-engine --peer prints. cJSON stays inside this file; the header
// has plain C types only.
#include "bench_peer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_json.h"
#include "core.h"

// ---- parsing ---------------------------------------------------------------------------
// The {"pp512": .., "tg128": ..} object at key; on failure err names the bad field.
static int get_figures(const cJSON *root, const char *key, struct tdm_bench_peer_figures *out,
                       char *err, size_t errlen)
{
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!cJSON_IsObject(o))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s missing or not an object", key);
    if (!tdm_bench_json_pos(o, "pp512", &out->pp512))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s.pp512 missing or not a positive number",
                          key);
    if (!tdm_bench_json_pos(o, "tg128", &out->tg128))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s.tg128 missing or not a positive number",
                          key);
    return TDM_OK;
}

int tdm_bench_peer_parse(struct tdm_bench_peer *out, const char *json, char *err, size_t errlen)
{
    cJSON *root = tdm_bench_json_object(json, NULL, err, errlen);
    if (root == NULL)
        return TDM_EPROTO;
    int rc = TDM_EPROTO;
    struct tdm_bench_peer p;
    memset(&p, 0, sizeof p);
    const cJSON *commit = cJSON_GetObjectItemCaseSensitive(root, "commit");
    if (!cJSON_IsString(commit) || commit->valuestring[0] == '\0' ||
        strlen(commit->valuestring) >= sizeof p.commit) {
        tdm_seterr(err, errlen, TDM_EPROTO, "commit missing or not a string of 1 to %zu characters",
                   sizeof p.commit - 1);
        goto fail_root;
    }
    snprintf(p.commit, sizeof p.commit, "%s", commit->valuestring);
    const cJSON *threads = cJSON_GetObjectItemCaseSensitive(root, "threads");
    if (threads != NULL) {
        if (!cJSON_IsNumber(threads) || threads->valuedouble < 1 || threads->valuedouble > 1e6 ||
            threads->valuedouble != floor(threads->valuedouble)) {
            tdm_seterr(err, errlen, TDM_EPROTO, "threads not a positive integer");
            goto fail_root;
        }
        p.threads = (int)threads->valuedouble;
    }
    if (get_figures(root, "bf16", &p.bf16, err, errlen) != TDM_OK ||
        get_figures(root, "q8_0", &p.q8_0, err, errlen) != TDM_OK)
        goto fail_root;
    *out = p;
    rc = TDM_OK;
fail_root:
    cJSON_Delete(root);
    return rc;
}

int tdm_bench_peer_load(struct tdm_bench_peer *out, const char *path, char *err, size_t errlen)
{
    char *text = NULL;
    size_t len = 0;
    int rc = tdm_read_file(path, &text, &len, err, errlen); // err: "PATH: strerror"
    if (rc != TDM_OK)
        return rc;
    char why[256];
    rc = tdm_bench_peer_parse(out, text, why, sizeof why);
    if (rc != TDM_OK)
        tdm_seterr(err, errlen, rc, "%s: %s", path, why);
    free(text);
    return rc;
}

// ---- formatting ------------------------------------------------------------------------
// "0.43x tg128" or "not measured" (Tandem's figure is 0 when the run skipped it).
static void put_ratio(struct tdm_bench_out *o, double tandem, double peer, const char *test)
{
    if (tandem > 0)
        tdm_bench_put(o, "%.2fx %s", tandem / peer, test);
    else
        tdm_bench_put(o, "not measured");
}

void tdm_bench_peer_format(const struct tdm_bench_peer *p, const struct tdm_bench_peer_tandem *t,
                           char *buf, size_t buflen)
{
    struct tdm_bench_out o = {.buf = buf, .len = buflen, .used = 0};
    if (buflen == 0)
        return;
    buf[0] = '\0';
    if (p == NULL) {
        tdm_bench_put(&o,
                      "llama.cpp on this machine: no peer figures given (bench/peer/llamacpp.sh "
                      "LLAMA_SRC measures them; then --peer build/peer/llamacpp.json)\n");
        return;
    }
    char threads[32] = "";
    if (p->threads > 0)
        snprintf(threads, sizeof threads, ", %d threads", p->threads);
    tdm_bench_put(
        &o,
        "llama.cpp %.12s on this machine (bench/peer/llamacpp.sh%s): bf16 %.1f tok/s decode "
        "(tg128), %.1f tok/s prefill-512 (pp512); Q8_0 %.1f / %.1f\n",
        p->commit, threads, p->bf16.tg128, p->bf16.pp512, p->q8_0.tg128, p->q8_0.pp512);
    tdm_bench_put(&o, "Tandem / llama.cpp, this run: bf16 decode b1 ");
    put_ratio(&o, t->bf16_b1, p->bf16.tg128, "tg128");
    tdm_bench_put(&o, ", prefill-512 ");
    put_ratio(&o, t->bf16_prefill512, p->bf16.pp512, "pp512");
    tdm_bench_put(&o, "; int8 vs Q8_0 decode b1 ");
    put_ratio(&o, t->int8_b1, p->q8_0.tg128, "tg128");
    tdm_bench_put(&o, ", prefill-512 ");
    put_ratio(&o, t->int8_prefill512, p->q8_0.pp512, "pp512");
    tdm_bench_put(&o, "\n");
}
