// SPDX-License-Identifier: Apache-2.0
// bench_peer: parses bench/peer/llamacpp.sh's JSON (llama.cpp's llama-bench
// figures on this machine) and formats them beside Tandem's with the ratios
// tandem-bench-engine --peer prints. cJSON stays inside this file; the header
// has plain C types only.
#include "bench_peer.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core.h"

// ---- parsing ---------------------------------------------------------------------------
// A positive finite number at key, or false.
static bool get_pos(const cJSON *o, const char *key, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0)
        return false;
    *out = v->valuedouble;
    return true;
}

// The {"pp512": .., "tg128": ..} object at key; on failure err names the bad field.
static int get_figures(const cJSON *root, const char *key, struct tdm_bench_peer_figures *out,
                       char *err, size_t errlen)
{
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!cJSON_IsObject(o))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s missing or not an object", key);
    if (!get_pos(o, "pp512", &out->pp512))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s.pp512 missing or not a positive number",
                          key);
    if (!get_pos(o, "tg128", &out->tg128))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s.tg128 missing or not a positive number",
                          key);
    return TDM_OK;
}

int tdm_bench_peer_parse(struct tdm_bench_peer *out, const char *json, char *err, size_t errlen)
{
    char why[160];
    if (tdm_json_check_depth(json, strlen(json), TDM_JSON_MAX_DEPTH, why, sizeof why) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s", why);
    cJSON *root = cJSON_Parse(json);
    if (root == NULL || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return tdm_seterr(err, errlen, TDM_EPROTO, "not a JSON object");
    }
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
// Appends to buf at *off, never past buflen (the output is cut, still NUL-terminated).
static void put(char *buf, size_t buflen, size_t *off, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static void put(char *buf, size_t buflen, size_t *off, const char *fmt, ...)
{
    if (*off >= buflen)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf + *off, buflen - *off, fmt, ap);
    va_end(ap);
    if (n > 0)
        *off += (size_t)n < buflen - *off ? (size_t)n : buflen - *off;
}

// "0.43x tg128" or "not measured" (Tandem's figure is 0 when the run skipped it).
static void put_ratio(char *buf, size_t buflen, size_t *off, double tandem, double peer,
                      const char *test)
{
    if (tandem > 0)
        put(buf, buflen, off, "%.2fx %s", tandem / peer, test);
    else
        put(buf, buflen, off, "not measured");
}

void tdm_bench_peer_format(const struct tdm_bench_peer *p, const struct tdm_bench_peer_tandem *t,
                           char *buf, size_t buflen)
{
    size_t off = 0;
    if (buflen == 0)
        return;
    buf[0] = '\0';
    if (p == NULL) {
        put(buf, buflen, &off,
            "llama.cpp on this machine: no peer figures given (bench/peer/llamacpp.sh "
            "LLAMA_SRC measures them; then --peer build/peer/llamacpp.json)\n");
        return;
    }
    char threads[32] = "";
    if (p->threads > 0)
        snprintf(threads, sizeof threads, ", %d threads", p->threads);
    put(buf, buflen, &off,
        "llama.cpp %.12s on this machine (bench/peer/llamacpp.sh%s): bf16 %.1f tok/s decode "
        "(tg128), %.1f tok/s prefill-512 (pp512); Q8_0 %.1f / %.1f\n",
        p->commit, threads, p->bf16.tg128, p->bf16.pp512, p->q8_0.tg128, p->q8_0.pp512);
    put(buf, buflen, &off, "Tandem / llama.cpp, this run: bf16 decode b1 ");
    put_ratio(buf, buflen, &off, t->bf16_b1, p->bf16.tg128, "tg128");
    put(buf, buflen, &off, ", prefill-512 ");
    put_ratio(buf, buflen, &off, t->bf16_prefill512, p->bf16.pp512, "pp512");
    put(buf, buflen, &off, "; int8 vs Q8_0 decode b1 ");
    put_ratio(buf, buflen, &off, t->int8_b1, p->q8_0.tg128, "tg128");
    put(buf, buflen, &off, ", prefill-512 ");
    put_ratio(buf, buflen, &off, t->int8_prefill512, p->q8_0.pp512, "pp512");
    put(buf, buflen, &off, "\n");
}
