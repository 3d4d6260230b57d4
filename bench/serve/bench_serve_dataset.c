// SPDX-License-Identifier: Apache-2.0
// bench_serve datasets. The random dataset follows vLLM's: lengths drawn around
// --input-len/--output-len by --range-ratio, token ids drawn from the vocabulary
// without special tokens, then decode -> re-encode -> trim or extend until the
// text encodes to the drawn length, so the server really sees input_len tokens
// (random ids rarely survive a decode/encode round trip unchanged: neighbouring
// pieces merge, split bytes become U+FFFD). Text prompts (not token-id prompts)
// are sent because that is what vLLM's bench sends and it exercises the
// server's tokenizer, as real traffic does. The file dataset reads one prompt
// per line or JSON lines with a "prompt" field.
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_serve_impl.h"
#include "core.h"
#include "tokenizer.h"

#define RANDOM_PROMPT_ROUNDS 16

void tdm_bench_dataset_fini(struct tdm_bench_dataset *ds)
{
    if (!ds)
        return;
    for (size_t i = 0; i < ds->n; i++)
        free(ds->prompts[i].text);
    free(ds->prompts);
    ds->prompts = NULL;
    ds->n = 0;
}

// Uniform integer in [floor(len*(1-r)), ceil(len*(1+r))], at least 1 (vLLM's bounds).
static int sample_len(struct tdm_rng *rng, int len, double r)
{
    int lo = (int)floor(len * (1.0 - r));
    int hi = (int)ceil(len * (1.0 + r));
    if (lo < 1)
        lo = 1;
    if (hi < lo)
        hi = lo;
    return lo + (int)(tdm_rng_next(rng) % (uint64_t)(hi - lo + 1));
}

// A token whose text holds a NUL byte would cut the prompt short once it is
// written into the JSON body (C strings): such tokens are never drawn.
static bool decodes_to_nul(const struct tdm_tokenizer *tok, int32_t id)
{
    char *t = NULL;
    size_t len = 0;
    if (tdm_tok_decode(tok, &id, 1, false, &t, &len) != TDM_OK)
        return true;
    bool nul = memchr(t, '\0', len) != NULL;
    free(t);
    return nul;
}

static void fill_random(int32_t *ids, size_t n, const int32_t *allowed, size_t n_allowed,
                        struct tdm_rng *rng)
{
    for (size_t i = 0; i < n; i++)
        ids[i] = allowed[tdm_rng_next(rng) % n_allowed];
}

// Tokens that are a space and a plain ASCII word (" the", " cat") and encode
// back to themselves: a run of them is its own pre-token after any prefix that
// does not end in whitespace, so appending them adds exactly one token each.
// They close the gap when a random prompt's re-encoding misses its length.
struct stable_tokens {
    int32_t *ids;
    size_t n;
};

static bool is_stable(const struct tdm_tokenizer *tok, int32_t id)
{
    char *t = NULL;
    size_t len = 0;
    if (tdm_tok_decode(tok, &id, 1, false, &t, &len) != TDM_OK)
        return false;
    bool ok = len >= 3 && t[0] == ' ';
    for (size_t i = 1; ok && i < len; i++)
        ok = (t[i] >= 'a' && t[i] <= 'z') || (t[i] >= 'A' && t[i] <= 'Z');
    if (ok) {
        int32_t *enc = NULL;
        size_t m = 0;
        ok = tdm_tok_encode(tok, t, len, false, &enc, &m) == TDM_OK && m == 1 && enc[0] == id;
        free(enc);
    }
    free(t);
    return ok;
}

// One prompt of exactly target tokens (see the file comment); *text is heap.
// Each round decodes the ids and re-encodes the text; on a miss it keeps what
// the tokenizer made of it minus the last token (which may have merged across
// the boundary) and fills the rest with stable tokens, which converges in a
// round or two. *actual is the length the text really encodes to; only a
// tokenizer without stable tokens can leave it off target.
static int random_prompt(const struct tdm_tokenizer *tok, const int32_t *allowed, size_t n_allowed,
                         const struct stable_tokens *stable, int target, struct tdm_rng *rng,
                         char **text, int *actual)
{
    int32_t *ids = malloc((size_t)target * sizeof(int32_t));
    if (!ids)
        return TDM_ENOMEM;
    fill_random(ids, (size_t)target, allowed, n_allowed, rng);
    char *cur = NULL;
    int cur_len = -1;
    int rc = TDM_OK;
    for (int round = 0; round < RANDOM_PROMPT_ROUNDS; round++) {
        char *t = NULL;
        size_t tlen = 0;
        rc = tdm_tok_decode(tok, ids, (size_t)target, false, &t, &tlen);
        if (rc)
            goto fail;
        int32_t *enc = NULL;
        size_t m = 0;
        rc = tdm_tok_encode(tok, t, tlen, false, &enc, &m);
        if (rc) {
            free(t);
            goto fail;
        }
        free(cur);
        cur = t;
        cur_len = (int)m;
        if (m == (size_t)target) {
            free(enc);
            break;
        }
        size_t keep = m < (size_t)target ? m : (size_t)target;
        if (stable->n) {
            // The last kept token may have merged across the boundary, and a
            // prefix ending in whitespace would merge with a stable token's space.
            if (keep > 0)
                keep--;
            while (keep > 0) {
                char *piece = NULL;
                size_t pl = 0;
                bool ws = tdm_tok_decode(tok, &enc[keep - 1], 1, false, &piece, &pl) != TDM_OK ||
                          pl == 0 || strchr(" \t\r\n", piece[pl - 1]) != NULL;
                free(piece);
                if (!ws)
                    break;
                keep--;
            }
            if (round >= RANDOM_PROMPT_ROUNDS / 2)
                keep = 0; // a prefix that will not settle: stable tokens only
            memcpy(ids, enc, keep * sizeof(int32_t));
            for (size_t k = keep; k < (size_t)target; k++)
                ids[k] = stable->ids[tdm_rng_next(rng) % stable->n];
        } else {
            memcpy(ids, enc, keep * sizeof(int32_t));
            fill_random(ids + keep, (size_t)target - keep, allowed, n_allowed, rng);
        }
        free(enc);
    }
    free(ids);
    *text = cur;
    *actual = cur_len;
    return TDM_OK;
fail:
    free(cur);
    free(ids);
    return rc;
}

int tdm_bench_dataset_random(struct tdm_bench_dataset *out, const struct tdm_tokenizer *tok,
                             int num_prompts, int input_len, int output_len, double range_ratio,
                             uint64_t seed, char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (!tok)
        return tdm_seterr(err, errlen, TDM_EINVAL, "the random dataset needs --tokenizer");
    if (num_prompts < 1 || input_len < 1 || output_len < 1)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "random dataset: num_prompts, input_len and output_len must be >= 1");
    if (!(range_ratio >= 0.0 && range_ratio < 1.0))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--range-ratio must be in [0, 1), got %g",
                          range_ratio);
    int vocab = tdm_tok_vocab_size(tok);
    int32_t *allowed = malloc((size_t)(vocab > 0 ? vocab : 1) * sizeof(int32_t));
    if (!allowed)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    size_t n_allowed = 0;
    for (int32_t id = 0; id < vocab; id++)
        if (tdm_tok_id_to_piece(tok, id) && !tdm_tok_is_special(tok, id) && !decodes_to_nul(tok, id))
            allowed[n_allowed++] = id;
    struct stable_tokens stable = {malloc((n_allowed ? n_allowed : 1) * sizeof(int32_t)), 0};
    int rc = TDM_OK;
    if (!stable.ids) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_allowed;
    }
    for (size_t i = 0; i < n_allowed; i++)
        if (is_stable(tok, allowed[i]))
            stable.ids[stable.n++] = allowed[i];
    if (n_allowed == 0) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "the tokenizer has no non-special tokens");
        goto fail_allowed;
    }
    out->prompts = calloc((size_t)num_prompts, sizeof(*out->prompts));
    if (!out->prompts) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_allowed;
    }
    struct tdm_rng rng;
    tdm_rng_seed(&rng, seed);
    for (int i = 0; i < num_prompts; i++) {
        struct tdm_bench_prompt *p = &out->prompts[i];
        int in_len = sample_len(&rng, input_len, range_ratio);
        p->output_len = sample_len(&rng, output_len, range_ratio);
        rc = random_prompt(tok, allowed, n_allowed, &stable, in_len, &rng, &p->text,
                           &p->input_len);
        if (rc) {
            tdm_seterr(err, errlen, rc, "random prompt %d: %s", i, tdm_strerror(rc));
            goto fail_prompts;
        }
        out->n++;
    }
    free(stable.ids);
    free(allowed);
    return TDM_OK;
fail_prompts:
    tdm_bench_dataset_fini(out);
fail_allowed:
    free(stable.ids);
    free(allowed);
    return rc;
}

// Parses one non-blank line (NUL-terminated, no newline) into p.
static int file_line(struct tdm_bench_prompt *p, const char *line, const char *path, int lineno,
                     const struct tdm_tokenizer *tok, int output_len, char *err, size_t errlen)
{
    p->output_len = output_len;
    const char *s = line;
    while (*s == ' ' || *s == '\t')
        s++;
    if (*s == '{') {
        cJSON *obj = tdm_json_check_depth(s, strlen(s), TDM_JSON_MAX_DEPTH, NULL, 0)
                         ? NULL
                         : cJSON_Parse(s);
        const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(obj, "prompt");
        if (!cJSON_IsObject(obj) || !cJSON_IsString(prompt)) {
            cJSON_Delete(obj);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "%s:%d: a line starting with '{' must be a JSON object with a "
                              "string \"prompt\"",
                              path, lineno);
        }
        const cJSON *ol = cJSON_GetObjectItemCaseSensitive(obj, "output_len");
        if (ol) {
            if (!cJSON_IsNumber(ol) || ol->valuedouble < 1 || ol->valuedouble > 1e7 ||
                ol->valuedouble != floor(ol->valuedouble)) {
                cJSON_Delete(obj);
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "%s:%d: \"output_len\" must be a positive integer", path, lineno);
            }
            p->output_len = (int)ol->valuedouble;
        }
        p->text = strdup(prompt->valuestring);
        cJSON_Delete(obj);
    } else {
        p->text = strdup(line);
    }
    if (!p->text)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    p->input_len = -1;
    if (tok) {
        int32_t *ids = NULL;
        size_t n = 0;
        int rc = tdm_tok_encode(tok, p->text, strlen(p->text), false, &ids, &n);
        if (rc)
            return tdm_seterr(err, errlen, rc, "%s:%d: tokenizing: %s", path, lineno,
                              tdm_strerror(rc));
        free(ids);
        p->input_len = (int)n;
    }
    return TDM_OK;
}

int tdm_bench_dataset_file(struct tdm_bench_dataset *out, const char *path,
                           const struct tdm_tokenizer *tok, int num_prompts, int output_len,
                           char *err, size_t errlen)
{
    memset(out, 0, sizeof(*out));
    if (num_prompts < 1 || output_len < 1)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "file dataset: num_prompts and output_len must be >= 1");
    char *buf = NULL;
    size_t len = 0;
    int rc = tdm_read_file(path, &buf, &len, err, errlen);
    if (rc)
        return rc;
    if (strlen(buf) != len) {
        // A NUL would cut a prompt short without anyone noticing.
        free(buf);
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: the file contains a NUL byte", path);
    }
    // The distinct lines first; prompts then cycle through them.
    struct tdm_bench_prompt *lines = NULL;
    size_t n_lines = 0, cap = 0;
    int lineno = 0;
    char *save = NULL;
    // Split by hand rather than strtok so that line numbers count blank lines.
    for (char *line = buf; line && *line; line = save) {
        char *nl = strchr(line, '\n');
        save = nl ? nl + 1 : NULL;
        if (nl)
            *nl = '\0';
        lineno++;
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r')
            line[--l] = '\0';
        if (strspn(line, " \t") == l)
            continue;
        if (tdm_grow(&lines, &cap, n_lines + 1, sizeof *lines, 64) != TDM_OK) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto fail_lines;
        }
        memset(&lines[n_lines], 0, sizeof(lines[n_lines]));
        rc = file_line(&lines[n_lines], line, path, lineno, tok, output_len, err, errlen);
        if (rc) {
            free(lines[n_lines].text);
            goto fail_lines;
        }
        n_lines++;
    }
    if (n_lines == 0) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s: no prompts in the file", path);
        goto fail_lines;
    }
    out->prompts = calloc((size_t)num_prompts, sizeof(*out->prompts));
    if (!out->prompts) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_lines;
    }
    for (int i = 0; i < num_prompts; i++) {
        const struct tdm_bench_prompt *src = &lines[(size_t)i % n_lines];
        struct tdm_bench_prompt *p = &out->prompts[i];
        *p = *src;
        p->text = strdup(src->text);
        if (!p->text) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            tdm_bench_dataset_fini(out);
            goto fail_lines;
        }
        out->n++;
    }
    rc = TDM_OK;
fail_lines:
    for (size_t i = 0; i < n_lines; i++)
        free(lines[i].text);
    free(lines);
    free(buf);
    return rc;
}
