// SPDX-License-Identifier: Apache-2.0
// tandem-gpu-probe: the limits of one GPU, measured in the same run as the
// benchmarks that are divided by them (bench/gpu/check.sh), printed as one
// JSON object on stdout:
//   read_gbs     a streaming read kernel (16-byte loads, grid-stride, every
//                byte read once per pass): HBM read bandwidth, bytes read / s
//   copy_gbs     a copy kernel: (bytes read + bytes written) / s
//   d2d_gbs      cudaMemcpyAsync device-to-device: (bytes read + written) / s,
//                the bound a same-GPU CUDA IPC copy of KV blocks is compared to
//   bf16_tflops  one large cuBLASLt GEMM, bf16 A/B/D, f32 accumulate
//                (CUBLAS_COMPUTE_32F), algorithm from the heuristic: 2*M*N*K / s
// Each figure is the best of several timed repetitions (CUDA events around a
// batch of launches), as the CPU probes keep their best. The buffers (1 GiB by
// default) are far larger than any L2, so the bandwidths are HBM's.
// Exit 77 with "no GPU visible" on stderr when there is no device, 1 on a CUDA
// error (named), 2 for bad usage.
//   tandem-gpu-probe [--device N] [--mib N] [--gemm N] [--reps N]
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <cuda_bf16.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ---- errors: every failing call is named, then the probe exits ---------------------------
static void die_cuda(cudaError_t e, const char *what, int line)
{
    fprintf(stderr, "tandem-gpu-probe: %s (line %d): %s\n", what, line, cudaGetErrorString(e));
    exit(1);
}
static void die_lt(cublasStatus_t s, const char *what, int line)
{
    fprintf(stderr, "tandem-gpu-probe: %s (line %d): cublas status %d\n", what, line, (int)s);
    exit(1);
}
#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            die_cuda(e_, #call, __LINE__);                                                         \
    } while (0)
#define LT(call)                                                                                   \
    do {                                                                                           \
        cublasStatus_t s_ = (call);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                           \
            die_lt(s_, #call, __LINE__);                                                           \
    } while (0)

// ---- kernels --------------------------------------------------------------------------------
// Reads n16 16-byte words; the XOR of everything read is stored only when it
// equals a value no input produces, so the loads cannot be optimised away.
__global__ void probe_read(const int4 *__restrict__ src, size_t n16, int4 *__restrict__ sink)
{
    int4 acc = make_int4(0, 0, 0, 0);
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride) {
        int4 v = __ldcs(src + i); // streaming: do not keep in L2
        acc.x ^= v.x;
        acc.y ^= v.y;
        acc.z ^= v.z;
        acc.w ^= v.w;
    }
    if (acc.x == 0x7a11d00d && acc.y == 0x5eed && acc.z == -1 && acc.w == 0x1234567)
        *sink = acc;
}

__global__ void probe_copy(const int4 *__restrict__ src, int4 *__restrict__ dst, size_t n16)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride)
        __stcs(dst + i, __ldcs(src + i));
}

// Deterministic bf16 values in [-1, 1): a GEMM of zeros runs faster than real data.
__global__ void probe_fill_bf16(__nv_bfloat16 *x, size_t n, uint32_t seed)
{
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        uint32_t h = (uint32_t)i * 2654435761u ^ seed;
        h ^= h >> 15;
        h *= 2246822519u;
        h ^= h >> 13;
        x[i] = __float2bfloat16((float)(h & 0xffff) / 32768.0f - 1.0f);
    }
}

// ---- timing ---------------------------------------------------------------------------------
struct timer {
    cudaEvent_t start, stop;
    cudaStream_t stream;
};

static void timer_begin(struct timer *t)
{
    CK(cudaEventRecord(t->start, t->stream));
}

// Seconds since timer_begin, after everything queued on the stream finished.
static double timer_end(struct timer *t)
{
    float ms = 0;
    CK(cudaEventRecord(t->stop, t->stream));
    CK(cudaEventSynchronize(t->stop));
    CK(cudaEventElapsedTime(&ms, t->start, t->stop));
    return ms / 1e3;
}

enum what { READ, COPY, MEMCPY };

// Best bytes/s over `reps` repetitions of `iters` back-to-back operations.
static double best_bandwidth(struct timer *t, enum what w, const void *src, void *dst, size_t bytes,
                             int *sink, int grid, int reps, int iters)
{
    size_t n16 = bytes / 16;
    double moved = w == READ ? (double)bytes : 2.0 * (double)bytes;
    double best = 0;
    for (int r = 0; r <= reps; r++) { // r == 0 warms up
        timer_begin(t);
        for (int i = 0; i < iters; i++) {
            if (w == READ)
                probe_read<<<grid, 512, 0, t->stream>>>((const int4 *)src, n16, (int4 *)sink);
            else if (w == COPY)
                probe_copy<<<grid, 512, 0, t->stream>>>((const int4 *)src, (int4 *)dst, n16);
            else
                CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, t->stream));
        }
        CK(cudaGetLastError());
        double s = timer_end(t);
        double bw = moved * iters / s;
        if (r > 0 && bw > best)
            best = bw;
    }
    return best;
}

// Best FLOP/s of D = A^T B (bf16 in and out, f32 accumulate), m = n = k = size.
static double best_gemm(struct timer *t, int size, int reps, int iters)
{
    const size_t elems = (size_t)size * size;
    const size_t ws_bytes = (size_t)64 << 20;
    __nv_bfloat16 *a, *b, *d;
    void *ws;
    CK(cudaMalloc((void **)&a, elems * sizeof *a));
    CK(cudaMalloc((void **)&b, elems * sizeof *b));
    CK(cudaMalloc((void **)&d, elems * sizeof *d));
    CK(cudaMalloc(&ws, ws_bytes));
    probe_fill_bf16<<<1024, 256, 0, t->stream>>>(a, elems, 1u);
    probe_fill_bf16<<<1024, 256, 0, t->stream>>>(b, elems, 2u);
    CK(cudaGetLastError());

    cublasLtHandle_t lt;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasOperation_t trans = CUBLAS_OP_T, notrans = CUBLAS_OP_N;
    LT(cublasLtCreate(&lt));
    LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    // "TN": A stored k x m (a weight matrix row-major), B k x n, D m x n, column-major.
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &notrans, sizeof notrans));
    LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, size, size, size));
    LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, size, size, size));
    LT(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, size, size, size));
    LT(cublasLtMatmulPreferenceCreate(&pref));
    LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &ws_bytes, sizeof ws_bytes));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    LT(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found < 1) {
        fprintf(stderr, "tandem-gpu-probe: cuBLASLt found no bf16 GEMM algorithm\n");
        exit(1);
    }
    const float alpha = 1.0f, beta = 0.0f;
    double best = 0;
    for (int r = 0; r <= reps; r++) {
        timer_begin(t);
        for (int i = 0; i < iters; i++)
            LT(cublasLtMatmul(lt, op, &alpha, a, la, b, lb, &beta, d, ld, d, ld, &heur.algo, ws,
                              ws_bytes, t->stream));
        double s = timer_end(t);
        double flops = 2.0 * size * (double)size * size * iters / s;
        if (r > 0 && flops > best)
            best = flops;
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatmulDescDestroy(op);
    cublasLtDestroy(lt);
    CK(cudaFree(ws));
    CK(cudaFree(d));
    CK(cudaFree(b));
    CK(cudaFree(a));
    return best;
}

static int arg_int(const char *s, int lo, int hi, const char *flag)
{
    char *end;
    long v = strtol(s, &end, 10);
    if (*s == '\0' || *end != '\0' || v < lo || v > hi) {
        fprintf(stderr, "tandem-gpu-probe: %s must be an integer in [%d, %d]\n", flag, lo, hi);
        exit(2);
    }
    return (int)v;
}

int main(int argc, char **argv)
{
    int device = 0, mib = 1024, gemm = 8192, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            device = arg_int(argv[++i], 0, 1023, "--device");
        else if (strcmp(argv[i], "--mib") == 0 && i + 1 < argc)
            mib = arg_int(argv[++i], 16, 1 << 20, "--mib");
        else if (strcmp(argv[i], "--gemm") == 0 && i + 1 < argc)
            gemm = arg_int(argv[++i], 256, 32768, "--gemm");
        else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc)
            reps = arg_int(argv[++i], 1, 100, "--reps");
        else {
            fprintf(stderr,
                    "usage: tandem-gpu-probe [--device N] [--mib N] [--gemm N] [--reps N]\n");
            return 2;
        }
    }
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        fprintf(stderr, "tandem-gpu-probe: no GPU visible\n");
        return 77;
    }
    if (device >= count) {
        fprintf(stderr, "tandem-gpu-probe: --device %d: only %d GPU(s) visible\n", device, count);
        return 2;
    }
    CK(cudaSetDevice(device));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, device));

    struct timer t;
    CK(cudaStreamCreate(&t.stream));
    CK(cudaEventCreate(&t.start));
    CK(cudaEventCreate(&t.stop));
    size_t bytes = (size_t)mib << 20;
    void *src, *dst;
    int *sink;
    CK(cudaMalloc(&src, bytes));
    CK(cudaMalloc(&dst, bytes));
    CK(cudaMalloc((void **)&sink, 16));
    CK(cudaMemsetAsync(src, 0x5a, bytes, t.stream));
    int grid = prop.multiProcessorCount * 4; // 4 blocks of 512 per SM: full occupancy of loads

    double read = best_bandwidth(&t, READ, src, dst, bytes, sink, grid, reps, 10);
    double copy = best_bandwidth(&t, COPY, src, dst, bytes, sink, grid, reps, 10);
    double d2d = best_bandwidth(&t, MEMCPY, src, dst, bytes, sink, grid, reps, 10);
    CK(cudaFree(sink));
    CK(cudaFree(dst));
    CK(cudaFree(src));
    double flops = best_gemm(&t, gemm, reps, 10);

    printf("{\"device\": {\"name\": \"%s\", \"cc\": \"%d.%d\", \"sms\": %d, \"mem_bytes\": %zu, "
           "\"index\": %d},\n",
           prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.totalGlobalMem,
           device);
    printf(" \"buffer_bytes\": %zu, \"reps\": %d,\n", bytes, reps);
    printf(" \"read_gbs\": %.1f, \"copy_gbs\": %.1f, \"d2d_gbs\": %.1f,\n", read / 1e9, copy / 1e9,
           d2d / 1e9);
    printf(" \"gemm\": {\"m\": %d, \"n\": %d, \"k\": %d, \"dtype\": \"bf16\", \"accumulate\": "
           "\"f32\"},\n",
           gemm, gemm, gemm);
    printf(" \"bf16_tflops\": %.1f}\n", flops / 1e12);
    CK(cudaEventDestroy(t.stop));
    CK(cudaEventDestroy(t.start));
    CK(cudaStreamDestroy(t.stream));
    return 0;
}
