// SPDX-License-Identifier: Apache-2.0
// bench_json: see bench_json.h.
#include "bench_json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "core.h"

cJSON *tdm_bench_json_object(const char *json, const char *what, char *err, size_t errlen)
{
    const char *sep = what != NULL ? ": " : "";
    what = what != NULL ? what : "";
    char why[160];
    if (json != NULL &&
        tdm_json_check_depth(json, strlen(json), TDM_JSON_MAX_DEPTH, why, sizeof why) != TDM_OK) {
        tdm_seterr(err, errlen, TDM_EPROTO, "%s%s%s", what, sep, why);
        return NULL;
    }
    cJSON *root = json ? cJSON_Parse(json) : NULL;
    if (root == NULL || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        tdm_seterr(err, errlen, TDM_EPROTO, "%s%snot a JSON object", what, sep);
        return NULL;
    }
    return root;
}

bool tdm_bench_json_pos(const cJSON *o, const char *key, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble <= 0)
        return false;
    *out = v->valuedouble;
    return true;
}

void tdm_bench_put(struct tdm_bench_out *o, const char *fmt, ...)
{
    if (o->used >= o->len)
        return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(o->buf + o->used, o->len - o->used, fmt, ap);
    va_end(ap);
    if (n > 0)
        o->used = o->used + (size_t)n < o->len ? o->used + (size_t)n : o->len - 1;
}
