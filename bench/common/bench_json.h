// SPDX-License-Identifier: Apache-2.0
// bench_json: what the benches' report readers share (tandem-gpu-report's
// gpu_report, tandem-bench-engine --peer's bench_peer): a JSON object parsed
// after the depth check every outside text gets, a positive number read from
// it, and a bounded text buffer appended to with printf formats. Bench code
// only; the readers' own headers keep plain C types.
#ifndef TDM_BENCH_JSON_H
#define TDM_BENCH_JSON_H

#include <stdbool.h>
#include <stddef.h>

#include <cjson/cJSON.h>

// json parsed as an object, or NULL with err set (TDM_EPROTO): "WHAT: not a
// JSON object", or the depth check's reason after "WHAT: " (what NULL: no
// prefix). json NULL reads as not an object. The caller deletes the result.
cJSON *tdm_bench_json_object(const char *json, const char *what, char *err, size_t errlen);

// A positive finite number at key, or false (out untouched).
bool tdm_bench_json_pos(const cJSON *o, const char *key, double *out);

// Text appended to buf[0 .. len): cut at len - 1, always NUL-terminated
// (len > 0).
struct tdm_bench_out {
    char *buf;
    size_t len, used;
};

void tdm_bench_put(struct tdm_bench_out *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
