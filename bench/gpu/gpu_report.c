// SPDX-License-Identifier: Apache-2.0
// gpu_report: parses the three JSON documents of bench/gpu/check.sh (probe,
// engine bench, P/D bench), computes each figure's ratio to the limit that
// bounds it and formats the summary with the goals of issues 9 and 10. cJSON
// stays inside this file; the header has plain C types only.
#include "gpu_report.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "bench_json.h"
#include "core.h"

// ---- goals (issues 9 and 10) -----------------------------------------------------------
#define GOAL_DECODE_B1_MS 1.0        // ms per token at batch 1, at most
#define GOAL_DECODE_B64_TOKS 20000.0 // tokens/s at batch 64, at least
#define GOAL_PREFILL_2048_UTIL 0.40  // of the bf16 GEMM peak, at least
#define GOAL_PD_EXPOSED 0.02         // exposed transfer / TTFT at 2048 tokens, at most
#define GOAL_IPC_UTIL 0.50           // IPC copy / device-to-device bandwidth, at least

// ---- JSON helpers --------------------------------------------------------------------
// A non-negative finite number at key (absent reads as 0), or false when present and bad.
static bool get_nonneg_opt(const cJSON *o, const char *key, double *out)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = 0;
    if (v == NULL)
        return true;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble) || v->valuedouble < 0)
        return false;
    *out = v->valuedouble;
    return true;
}

static bool get_int_pos(const cJSON *o, const char *key, int *out)
{
    double d;
    if (!tdm_bench_json_pos(o, key, &d) || d > 1e9 || d != floor(d))
        return false;
    *out = (int)d;
    return true;
}

static void get_str(const cJSON *o, const char *key, char *out, size_t outlen, const char *dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    snprintf(out, outlen, "%s", cJSON_IsString(v) ? v->valuestring : dflt);
}

#define BAD(what, key)                                                                             \
    tdm_seterr(err, errlen, TDM_EPROTO, "%s: %s missing or not a positive number", what, key)

// ---- parsers -------------------------------------------------------------------------
int tdm_gpu_report_parse_probe(struct tdm_gpu_probe *out, const char *json, char *err,
                               size_t errlen)
{
    int rc = TDM_EPROTO;
    struct tdm_gpu_probe p;
    memset(&p, 0, sizeof p);
    cJSON *root = tdm_bench_json_object(json, "probe", err, errlen);
    if (root == NULL)
        return TDM_EPROTO;
    const cJSON *dev = cJSON_GetObjectItemCaseSensitive(root, "device");
    if (!cJSON_IsObject(dev)) {
        tdm_seterr(err, errlen, TDM_EPROTO, "probe: device missing or not an object");
        goto fail_root;
    }
    get_str(dev, "name", p.device, sizeof p.device, "?");
    const cJSON *cc = cJSON_GetObjectItemCaseSensitive(dev, "cc");
    if (!cJSON_IsString(cc) || sscanf(cc->valuestring, "%d.%d", &p.cc_major, &p.cc_minor) != 2) {
        tdm_seterr(err, errlen, TDM_EPROTO, "probe: device.cc missing or not \"MAJOR.MINOR\"");
        goto fail_root;
    }
    if (!get_int_pos(dev, "sms", &p.sm_count)) {
        BAD("probe", "device.sms");
        goto fail_root;
    }
    if (!tdm_bench_json_pos(dev, "mem_bytes", &p.mem_bytes)) {
        BAD("probe", "device.mem_bytes");
        goto fail_root;
    }
    static const char *const keys[] = {"read_gbs", "copy_gbs", "d2d_gbs", "bf16_tflops"};
    double *vals[] = {&p.read_gbs, &p.copy_gbs, &p.d2d_gbs, &p.bf16_tflops};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
        if (!tdm_bench_json_pos(root, keys[i], vals[i])) {
            BAD("probe", keys[i]);
            goto fail_root;
        }
    }
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(root, "gemm");
    if (!cJSON_IsObject(g) || !get_int_pos(g, "m", &p.gemm_m) || !get_int_pos(g, "n", &p.gemm_n) ||
        !get_int_pos(g, "k", &p.gemm_k)) {
        BAD("probe", "gemm.m/n/k");
        goto fail_root;
    }
    *out = p;
    rc = TDM_OK;
fail_root:
    cJSON_Delete(root);
    return rc;
}

// Reads an array of {size_key, "seconds"[, "flops"]} objects into pts.
static int parse_points(const cJSON *root, const char *name, const char *size_key, bool flops,
                        struct tdm_gpu_point *pts, int *n, char *err, size_t errlen)
{
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, name);
    *n = 0;
    if (!cJSON_IsArray(arr))
        return tdm_seterr(err, errlen, TDM_EPROTO, "engine: %s missing or not an array", name);
    int count = cJSON_GetArraySize(arr);
    if (count > TDM_GPU_REPORT_MAX_POINTS)
        return tdm_seterr(err, errlen, TDM_EPROTO, "engine: %s has %d entries, at most %d", name,
                          count, TDM_GPU_REPORT_MAX_POINTS);
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        struct tdm_gpu_point *pt = &pts[*n];
        memset(pt, 0, sizeof *pt);
        if (!cJSON_IsObject(it) || !get_int_pos(it, size_key, &pt->size) ||
            !tdm_bench_json_pos(it, "seconds", &pt->seconds) ||
            (flops && !tdm_bench_json_pos(it, "flops", &pt->flops)))
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "engine: %s[%d] needs positive %s, seconds%s", name, *n, size_key,
                              flops ? " and flops" : "");
        (*n)++;
    }
    return TDM_OK;
}

int tdm_gpu_report_parse_engine(struct tdm_gpu_engine *out, const char *json, char *err,
                                size_t errlen)
{
    int rc = TDM_EPROTO;
    struct tdm_gpu_engine e;
    memset(&e, 0, sizeof e);
    cJSON *root = tdm_bench_json_object(json, "engine", err, errlen);
    if (root == NULL)
        return TDM_EPROTO;
    get_str(root, "device", e.device, sizeof e.device, "?");
    const cJSON *bi = cJSON_GetObjectItemCaseSensitive(root, "batch_invariant");
    e.batch_invariant = cJSON_IsBool(bi) ? cJSON_IsTrue(bi) : -1;
    if (bi != NULL && !cJSON_IsBool(bi)) {
        tdm_seterr(err, errlen, TDM_EPROTO, "engine: batch_invariant is not true or false");
        goto fail_root;
    }
    if (!tdm_bench_json_pos(root, "weight_bytes", &e.weight_bytes)) {
        BAD("engine", "weight_bytes");
        goto fail_root;
    }
    if (parse_points(root, "decode", "batch", false, e.decode, &e.n_decode, err, errlen) != TDM_OK)
        goto fail_root;
    if (parse_points(root, "prefill", "tokens", true, e.prefill, &e.n_prefill, err, errlen) !=
        TDM_OK)
        goto fail_root;
    *out = e;
    rc = TDM_OK;
fail_root:
    cJSON_Delete(root);
    return rc;
}

int tdm_gpu_report_parse_pd(struct tdm_gpu_pd *out, const char *json, char *err, size_t errlen)
{
    int rc = TDM_EPROTO;
    struct tdm_gpu_pd d;
    memset(&d, 0, sizeof d);
    cJSON *root = tdm_bench_json_object(json, "pd", err, errlen);
    if (root == NULL)
        return TDM_EPROTO;
    get_str(root, "transport", d.transport, sizeof d.transport, "?");
    const cJSON *arr = cJSON_GetObjectItemCaseSensitive(root, "sizes");
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) < 1 ||
        cJSON_GetArraySize(arr) > TDM_GPU_REPORT_MAX_POINTS) {
        tdm_seterr(err, errlen, TDM_EPROTO, "pd: sizes missing, empty or longer than %d",
                   TDM_GPU_REPORT_MAX_POINTS);
        goto fail_root;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        struct tdm_gpu_pd_point *pt = &d.points[d.n];
        if (!cJSON_IsObject(it) || !get_int_pos(it, "tokens", &pt->tokens) ||
            !tdm_bench_json_pos(it, "ttft_direct_s", &pt->ttft_direct_s) ||
            !tdm_bench_json_pos(it, "ttft_pd_s", &pt->ttft_pd_s) ||
            !get_nonneg_opt(it, "transfer_s", &pt->transfer_s) ||
            !get_nonneg_opt(it, "kv_bytes", &pt->kv_bytes) ||
            !get_nonneg_opt(it, "kv_window_s", &pt->kv_window_s)) {
            tdm_seterr(err, errlen, TDM_EPROTO,
                       "pd: sizes[%d] needs positive tokens, ttft_direct_s, ttft_pd_s and "
                       "non-negative transfer_s, kv_bytes, kv_window_s",
                       d.n);
            goto fail_root;
        }
        d.n++;
    }
    *out = d;
    rc = TDM_OK;
fail_root:
    cJSON_Delete(root);
    return rc;
}

// ---- ratios --------------------------------------------------------------------------
double tdm_gpu_report_decode_bw_util(const struct tdm_gpu_probe *p, double weight_bytes,
                                     double step_s)
{
    if (p == NULL || p->read_gbs <= 0 || weight_bytes <= 0 || step_s <= 0)
        return 0;
    return weight_bytes / step_s / (p->read_gbs * 1e9);
}

double tdm_gpu_report_prefill_util(const struct tdm_gpu_probe *p, double flops, double seconds)
{
    if (p == NULL || p->bf16_tflops <= 0 || flops <= 0 || seconds <= 0)
        return 0;
    return flops / seconds / (p->bf16_tflops * 1e12);
}

double tdm_gpu_report_ipc_util(const struct tdm_gpu_probe *p, const struct tdm_gpu_pd_point *pt)
{
    if (p == NULL || pt == NULL || p->d2d_gbs <= 0 || pt->kv_bytes <= 0 || pt->kv_window_s <= 0)
        return 0;
    return 2 * pt->kv_bytes / pt->kv_window_s / (p->d2d_gbs * 1e9);
}

// ---- formatting ----------------------------------------------------------------------
// One goal line; returns 1 when missed.
static int goal(struct tdm_bench_out *o, const char *what, bool measured, double value,
                const char *unit, bool at_most, double bound)
{
    if (!measured) {
        tdm_bench_put(o, "  goal %-44s not measured\n", what);
        return 0;
    }
    bool met = at_most ? value <= bound : value >= bound;
    tdm_bench_put(o, "  goal %-44s %10.3f %-8s %s %g: %s\n", what, value, unit,
                  at_most ? "<=" : ">=", bound, met ? "met" : "MISSED");
    return met ? 0 : 1;
}

static const struct tdm_gpu_point *point(const struct tdm_gpu_point *pts, int n, int size)
{
    for (int i = 0; i < n; i++)
        if (pts[i].size == size)
            return &pts[i];
    return NULL;
}

int tdm_gpu_report_format_invariance(const struct tdm_gpu_engine *inv,
                                     const struct tdm_gpu_engine *fast, char *buf, size_t buflen)
{
    struct tdm_bench_out o = {.buf = buf, .len = buflen, .used = 0};
    if (buflen == 0)
        return -1;
    buf[0] = '\0';
    tdm_bench_put(&o, "batch invariance (issue 26 item 3): decode step with --batch-invariant / "
                      "--no-batch-invariant\n");
    if (inv == NULL || fast == NULL) {
        tdm_bench_put(&o, "  not measured (see the engine and engine_fast steps above)\n");
        return -1;
    }
    tdm_bench_put(&o, "  %-14s %14s %10s %8s\n", "decode batch", "invariant ms", "fast ms", "cost");
    for (int i = 0; i < inv->n_decode; i++) {
        const struct tdm_gpu_point *a = &inv->decode[i];
        const struct tdm_gpu_point *b = point(fast->decode, fast->n_decode, a->size);
        if (b != NULL)
            tdm_bench_put(&o, "  %-14d %14.3f %10.3f %+7.1f%%\n", a->size, a->seconds * 1e3,
                          b->seconds * 1e3, (a->seconds / b->seconds - 1) * 100);
    }
    const struct tdm_gpu_point *i1 = point(inv->decode, inv->n_decode, 1);
    const struct tdm_gpu_point *i64 = point(inv->decode, inv->n_decode, 64);
    const struct tdm_gpu_point *f1 = point(fast->decode, fast->n_decode, 1);
    const struct tdm_gpu_point *f64 = point(fast->decode, fast->n_decode, 64);
    if (i1 == NULL || i64 == NULL || f1 == NULL || f64 == NULL) {
        tdm_bench_put(&o, "  rule: not judged (batch 1 or 64 missing from a run)\n");
        return -1;
    }
    double c1 = i1->seconds / f1->seconds - 1, c64 = i64->seconds / f64->seconds - 1;
    bool keep = c1 <= TDM_GPU_REPORT_INVARIANCE_MAX && c64 <= TDM_GPU_REPORT_INVARIANCE_MAX;
    tdm_bench_put(
        &o,
        "  rule: invariance costs %+.1f%% at batch 1 and %+.1f%% at batch 64 (it stays the "
        "default only if <= %.0f%% at both): %s\n",
        c1 * 100, c64 * 100, TDM_GPU_REPORT_INVARIANCE_MAX * 100,
        keep ? "keep --batch-invariant the default"
             : "make --no-batch-invariant the default (opt-in invariance, as vLLM's)");
    return keep ? 0 : 1;
}

int tdm_gpu_report_format(const struct tdm_gpu_probe *probe, const struct tdm_gpu_engine *engine,
                          const struct tdm_gpu_pd *pd, char *buf, size_t buflen)
{
    struct tdm_bench_out o = {.buf = buf, .len = buflen, .used = 0};
    if (buflen == 0)
        return 0;
    buf[0] = '\0';
    int missed = 0;
    tdm_bench_put(&o, "device  %s (sm_%d%d, %d SMs, %.1f GiB)\n", probe->device, probe->cc_major,
                  probe->cc_minor, probe->sm_count, probe->mem_bytes / (1024.0 * 1024 * 1024));
    tdm_bench_put(
        &o,
        "probe   read %.0f GB/s, copy kernel %.0f GB/s, cudaMemcpy d2d %.0f GB/s (read+write), "
        "bf16 GEMM %dx%dx%d %.1f TFLOP/s\n",
        probe->read_gbs, probe->copy_gbs, probe->d2d_gbs, probe->gemm_m, probe->gemm_n,
        probe->gemm_k, probe->bf16_tflops);

    if (engine == NULL) {
        tdm_bench_put(&o, "engine  not measured (see the engine step above)\n");
    } else {
        tdm_bench_put(
            &o, "engine  device %s, weights %.0f MB (one read at the probed bandwidth: %.3f ms)\n",
            engine->device, engine->weight_bytes / 1e6,
            engine->weight_bytes / (probe->read_gbs * 1e9) * 1e3);
        tdm_bench_put(&o, "  %-14s %10s %12s %14s\n", "decode batch", "step ms", "tokens/s",
                      "weight-read/bw");
        for (int i = 0; i < engine->n_decode; i++) {
            const struct tdm_gpu_point *p = &engine->decode[i];
            tdm_bench_put(&o, "  %-14d %10.3f %12.0f %14.3f\n", p->size, p->seconds * 1e3,
                          p->size / p->seconds,
                          tdm_gpu_report_decode_bw_util(probe, engine->weight_bytes, p->seconds));
        }
        tdm_bench_put(&o, "  %-14s %10s %12s %14s\n", "prefill tokens", "ms", "tokens/s",
                      "TFLOP/s / peak");
        for (int i = 0; i < engine->n_prefill; i++) {
            const struct tdm_gpu_point *p = &engine->prefill[i];
            tdm_bench_put(&o, "  %-14d %10.3f %12.0f %14.3f\n", p->size, p->seconds * 1e3,
                          p->size / p->seconds,
                          tdm_gpu_report_prefill_util(probe, p->flops, p->seconds));
        }
    }
    // Figures from another device (the CPU backend) are shown, never judged as the GPU's.
    bool on_gpu = engine != NULL && strncmp(engine->device, "cuda", 4) == 0;
    if (engine != NULL && !on_gpu)
        tdm_bench_put(&o, "  (ran on %s, not a GPU: the decode and prefill goals are not judged)\n",
                      engine->device);
    const struct tdm_gpu_point *b1 = on_gpu ? point(engine->decode, engine->n_decode, 1) : NULL;
    const struct tdm_gpu_point *b64 = on_gpu ? point(engine->decode, engine->n_decode, 64) : NULL;
    const struct tdm_gpu_point *p2k =
        on_gpu ? point(engine->prefill, engine->n_prefill, 2048) : NULL;

    const struct tdm_gpu_pd_point *pd2k = NULL, *pdmax = NULL;
    if (pd == NULL) {
        tdm_bench_put(&o, "pd      not measured (see the P/D step above)\n");
    } else {
        // The goals are issue 10's for CUDA IPC; another transport's figures are shown only.
        bool ipc = strcmp(pd->transport, "cuda-ipc") == 0;
        tdm_bench_put(&o, "pd      one GPU, --kv-transfer %s%s\n", pd->transport,
                      ipc ? "" : " (the P/D goals are for cuda-ipc: not judged)");
        tdm_bench_put(&o, "  %-8s %12s %10s %12s %12s %10s\n", "tokens", "TTFT direct", "TTFT P/D",
                      "exposed ms", "exposed/TTFT", "KV/d2d bw");
        for (int i = 0; i < pd->n; i++) {
            const struct tdm_gpu_pd_point *p = &pd->points[i];
            tdm_bench_put(&o, "  %-8d %10.1fms %8.1fms %12.3f %12.4f %10.3f\n", p->tokens,
                          p->ttft_direct_s * 1e3, p->ttft_pd_s * 1e3, p->transfer_s * 1e3,
                          p->transfer_s / p->ttft_pd_s, tdm_gpu_report_ipc_util(probe, p));
            if (ipc && p->tokens == 2048)
                pd2k = p;
            if (ipc && p->kv_bytes > 0 && p->kv_window_s > 0 &&
                (pdmax == NULL || p->tokens > pdmax->tokens))
                pdmax = p;
        }
    }

    tdm_bench_put(&o, "goals (issues 9 and 10)\n");
    missed += goal(&o, "decode batch 1, ms per token", b1 != NULL, b1 ? b1->seconds * 1e3 : 0, "ms",
                   true, GOAL_DECODE_B1_MS);
    missed += goal(&o, "decode batch 64, tokens/s", b64 != NULL, b64 ? 64 / b64->seconds : 0,
                   "tok/s", false, GOAL_DECODE_B64_TOKS);
    missed += goal(&o, "prefill 2048, fraction of bf16 peak", p2k != NULL,
                   p2k ? tdm_gpu_report_prefill_util(probe, p2k->flops, p2k->seconds) : 0, "",
                   false, GOAL_PREFILL_2048_UTIL);
    missed += goal(&o, "P/D 2048, exposed transfer / TTFT", pd2k != NULL,
                   pd2k ? pd2k->transfer_s / pd2k->ttft_pd_s : 0, "", true, GOAL_PD_EXPOSED);
    missed += goal(&o, "P/D KV copy bandwidth / d2d bandwidth", pdmax != NULL,
                   pdmax ? tdm_gpu_report_ipc_util(probe, pdmax) : 0, "", false, GOAL_IPC_UTIL);
    return missed;
}
