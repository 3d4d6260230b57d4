// SPDX-License-Identifier: Apache-2.0
// gpu_report: the CPU half of bench/gpu/check.sh. It reads the JSON that
// tandem-gpu-probe (the GPU's limits), tandem-bench-engine --json (the whole
// forward on the GPU) and bench/pd/bench_pd.py --json (P/D on one GPU) write,
// relates each figure to the limit that bounds it, and formats the one summary
// check.sh prints. Kept apart from the CUDA probe so that all of its logic
// (parsing, ratio math, goals, formatting) is tested on every CI run, on a
// machine without a GPU.
//
// The ratios (docs/gpu.md, "The check script"):
//   decode B   weight-read utilisation = weight_bytes / step_seconds / read_bw:
//              the fraction of the probed HBM read bandwidth one decode step
//              would use just to stream the weights once (1.0 = bandwidth bound)
//   prefill N  tensor utilisation = prefill FLOP/s / probed bf16 GEMM FLOP/s
//   P/D        exposed transfer / TTFT; IPC copy bandwidth / probed cudaMemcpy
//              device-to-device bandwidth (both count bytes read + written)
// and the goals of issues 9 and 10: decode b1 <= 1.0 ms/token, b64 >= 20 000
// tokens/s, prefill-2048 >= 40 % of the bf16 peak, exposed transfer <= 2 % of
// TTFT at 2048 tokens, IPC >= 50 % of device-to-device. With a second engine
// run without batch invariance: the cost of invariance per decode batch and
// issue 26 item 3's rule for the default.
//
// Every value type here is caller storage; nothing allocates beyond the call.
#ifndef TDM_GPU_REPORT_H
#define TDM_GPU_REPORT_H

#include <stdbool.h>
#include <stddef.h>

#define TDM_GPU_REPORT_MAX_POINTS 16

// What tandem-gpu-probe measured (its JSON, bench/gpu/gpu_probe.cu).
struct tdm_gpu_probe {
    char device[128];       // e.g. "NVIDIA H200"
    int cc_major, cc_minor; // compute capability
    int sm_count;
    double mem_bytes;           // device memory, bytes
    double read_gbs;            // streaming read kernel, GB/s (1e9 bytes), bytes read
    double copy_gbs;            // copy kernel, GB/s, bytes read + bytes written
    double d2d_gbs;             // cudaMemcpy device-to-device, GB/s, bytes read + written
    double bf16_tflops;         // cuBLASLt bf16 GEMM, f32 accumulate, TFLOP/s (1e12)
    int gemm_m, gemm_n, gemm_k; // the GEMM's shape
};

// One decode batch size or prefill chunk of tandem-bench-engine --json.
struct tdm_gpu_point {
    int size;       // batch size (decode) or tokens (prefill)
    double seconds; // one decode step / one prefill of `size` tokens
    double flops;   // prefill only: FLOPs of that prefill (0 for decode)
};

struct tdm_gpu_engine {
    char device[32];     // "cuda", "cuda:0", "cpu" as the bench reported it
    int batch_invariant; // the bench's "batch_invariant": 1 true, 0 false, -1 absent
    double weight_bytes; // bytes one forward streams for the weights
    int n_decode, n_prefill;
    struct tdm_gpu_point decode[TDM_GPU_REPORT_MAX_POINTS];
    struct tdm_gpu_point prefill[TDM_GPU_REPORT_MAX_POINTS];
};

// One prompt size of bench_pd.py --json (medians over its repetitions).
struct tdm_gpu_pd_point {
    int tokens;
    double ttft_direct_s; // decode worker alone (local prefill)
    double ttft_pd_s;     // through the router, prefill worker -> decode worker
    double transfer_s;    // exposed KV transfer (not hidden by compute)
    double kv_bytes;      // KV bytes one request moved
    double kv_window_s;   // seconds the KV took to move: over cuda-ipc the prefill worker's
                          // summed device copy time (tandem:kv_copy_seconds_total), else the
                          // decode side's first layer group in -> last installed
};

struct tdm_gpu_pd {
    char transport[32]; // the --kv-transfer the run used ("cuda-ipc", "nng", ...)
    int n;
    struct tdm_gpu_pd_point points[TDM_GPU_REPORT_MAX_POINTS];
};

// Each parser reads one document from `json` (NUL-terminated). Returns TDM_OK,
// or TDM_EPROTO with err naming the missing or bad field ("probe: read_gbs
// missing or not a positive number"). `out` is fully written on TDM_OK only.
int tdm_gpu_report_parse_probe(struct tdm_gpu_probe *out, const char *json, char *err,
                               size_t errlen);
int tdm_gpu_report_parse_engine(struct tdm_gpu_engine *out, const char *json, char *err,
                                size_t errlen);
int tdm_gpu_report_parse_pd(struct tdm_gpu_pd *out, const char *json, char *err, size_t errlen);

// The ratios, each 0 when an input is missing or not positive.
// Fraction of the probed read bandwidth a decode step spends on the weights.
double tdm_gpu_report_decode_bw_util(const struct tdm_gpu_probe *p, double weight_bytes,
                                     double step_s);
// Fraction of the probed bf16 GEMM peak a prefill reaches.
double tdm_gpu_report_prefill_util(const struct tdm_gpu_probe *p, double flops, double seconds);
// KV copy bandwidth (bytes read + written: 2 * kv_bytes / kv_window_s) over
// the probed device-to-device bandwidth.
double tdm_gpu_report_ipc_util(const struct tdm_gpu_probe *p, const struct tdm_gpu_pd_point *pt);

// The cost of batch invariance (issue 26 item 3), from two engine runs on the
// same GPU: `inv` with --batch-invariant (every GEMM on cuBLASLt), `fast` with
// --no-batch-invariant (GEMMs of up to 16 rows on the GEMV). Per decode batch
// both measured: the two step times and the cost inv / fast - 1; then the
// rule: invariance stays the default only if its cost is at most
// TDM_GPU_REPORT_INVARIANCE_MAX at batch 1 and at batch 64. Formats into buf
// (NUL-terminated when buflen > 0); returns 0 when the rule keeps invariance
// the default, 1 when it says to make --no-batch-invariant the default, -1
// when batch 1 or 64 was not measured in both runs.
#define TDM_GPU_REPORT_INVARIANCE_MAX 0.10
int tdm_gpu_report_format_invariance(const struct tdm_gpu_engine *inv,
                                     const struct tdm_gpu_engine *fast, char *buf, size_t buflen);

// Formats the summary into buf (always NUL-terminated when buflen > 0).
// `engine` and `pd` may be NULL (their steps failed or were skipped): the
// summary says so. Each goal line ends in "met", "MISSED" or "not measured".
// Returns the number of goals missed (0 when none was measured or all met).
int tdm_gpu_report_format(const struct tdm_gpu_probe *probe, const struct tdm_gpu_engine *engine,
                          const struct tdm_gpu_pd *pd, char *buf, size_t buflen);

#endif
