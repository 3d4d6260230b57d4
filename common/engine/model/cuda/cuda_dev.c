// SPDX-License-Identifier: Apache-2.0
// cuda_dev: cuda_dev.h over the CUDA runtime and cuBLASLt (TANDEM_CUDA=ON).
//
// One stream per device; copies are cudaMemcpyAsync on it (h2d then waits for
// the stream so the caller may reuse its buffer at once; the backend's hot
// path uploads small per-step metadata only). The bf16 GEMM is one cuBLASLt
// matmul, D = op(A) B (+ bias epilogue), with the weight [rows][cols]
// row-major read as a column-major cols x rows matrix transposed:
//   A = W (k x m, ld k, transposed), B = x^T (k x n, ld k), D = y^T (m x n, ld m).
// The algorithm is picked once per weight shape, bias use and class (the
// heuristic is asked at a fixed n: TDM_GEMM_PLAN_N for decode rows,
// TDM_GEMM_PROMPT_PLAN_N for prompt rows) with split-K forced to 1 and no
// reduction scheme, and reused for every n: the k reduction of an output
// element then runs in the order of that one kernel configuration whatever n
// is. No M buckets within a class: a bucket chosen by the run's row count
// would make a prompt row's numbers depend on how many prompt rows share its
// step, which differs between a P/D prefill worker and direct serving.
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "core.h"
#include "cuda_dev.h"
#include "cuda_dev_held.h"

#define TDM_GEMM_MAX_SHAPES 64 // (weight shape, bias use, class) plans
#define TDM_GEMM_PLAN_N 64     // decode class: the rows of a big decode batch
// Prompt class: the rows of a full prefill chunk (engine's default token
// budget and the 2 048-token prefill figure), where the GEMMs are
// compute bound and want the largest tiles; shorter prompt runs reuse it.
#define TDM_GEMM_PROMPT_PLAN_N 2048
#define TDM_GEMM_WORKSPACE ((size_t)32 << 20)

struct gemm_plan {
    int rows, cols;
    bool bias;
    enum tdm_cuda_gemm_class cls;
    cublasLtMatmulAlgo_t algo;
};

struct tdm_cuda_dev {
    int ordinal;
    cudaStream_t stream;
    cublasLtHandle_t lt;
    void *workspace; // [TDM_GEMM_WORKSPACE] bytes, device
    struct gemm_plan plans[TDM_GEMM_MAX_SHAPES];
    int nplans;
    bool warned_fallback; // the fixed-algorithm fallback was logged once
    struct held_list held; // what tdm_cuda_dev_alloc handed out, and the workspace
    char name[256];
    char errmsg[256];
};

static int cuda_fail(struct tdm_cuda_dev *d, const char *what, cudaError_t e)
{
    snprintf(d->errmsg, sizeof d->errmsg, "%s: %s", what, cudaGetErrorString(e));
    return TDM_EBACKEND;
}

int tdm_cuda_dev_count(void)
{
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); // no driver / no device: not sticky
        return 0;
    }
    return n;
}

int tdm_cuda_dev_open(struct tdm_cuda_dev **out, int ordinal, char *err, size_t errlen)
{
    *out = NULL;
    int n = tdm_cuda_dev_count();
    if (ordinal < 0 || ordinal >= n)
        return tdm_seterr(err, errlen, TDM_EINVAL, "cuda: device %d requested, %d visible", ordinal,
                          n);
    struct tdm_cuda_dev *d = calloc(1, sizeof *d);
    if (d == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    d->ordinal = ordinal;
    held_init(&d->held);
    cudaError_t e = cudaSetDevice(ordinal);
    if (e != cudaSuccess)
        goto fail_cuda;
    struct cudaDeviceProp prop;
    if ((e = cudaGetDeviceProperties(&prop, ordinal)) != cudaSuccess)
        goto fail_cuda;
    snprintf(d->name, sizeof d->name, "%s", prop.name);
    if ((e = cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking)) != cudaSuccess)
        goto fail_cuda;
    if ((e = cudaMalloc(&d->workspace, TDM_GEMM_WORKSPACE)) != cudaSuccess)
        goto fail_cuda;
    if (!held_add(&d->held, d->workspace, TDM_GEMM_WORKSPACE)) {
        tdm_cuda_dev_close(d);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    }
    if (cublasLtCreate(&d->lt) != CUBLAS_STATUS_SUCCESS) {
        tdm_cuda_dev_close(d);
        return tdm_seterr(err, errlen, TDM_EBACKEND, "cuda: cublasLtCreate failed");
    }
    *out = d;
    return TDM_OK;

fail_cuda:
    tdm_seterr(err, errlen, TDM_EBACKEND, "cuda: device %d: %s", ordinal, cudaGetErrorString(e));
    tdm_cuda_dev_close(d);
    return TDM_EBACKEND;
}

void tdm_cuda_dev_close(struct tdm_cuda_dev *d)
{
    if (d == NULL)
        return;
    if (d->lt)
        cublasLtDestroy(d->lt);
    if (d->workspace)
        cudaFree(d->workspace);
    if (d->stream)
        cudaStreamDestroy(d->stream);
    held_fini(&d->held);
    free(d);
}

const char *tdm_cuda_dev_name(const struct tdm_cuda_dev *d)
{
    return d->name;
}

void *tdm_cuda_dev_stream(struct tdm_cuda_dev *d)
{
    return (void *)d->stream;
}

int tdm_cuda_dev_bind(struct tdm_cuda_dev *d)
{
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == d->ordinal)
        return TDM_OK;
    cudaError_t e = cudaSetDevice(d->ordinal);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaSetDevice", e);
}

int tdm_cuda_dev_mem_info(struct tdm_cuda_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaMemGetInfo(free_bytes, total_bytes);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaMemGetInfo", e);
}

void *tdm_cuda_dev_alloc(struct tdm_cuda_dev *d, size_t bytes)
{
    void *p = NULL;
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1);
    if (e != cudaSuccess) {
        cuda_fail(d, "cudaMalloc", e);
        return NULL;
    }
    if (!held_add(&d->held, p, bytes)) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

void tdm_cuda_dev_free(struct tdm_cuda_dev *d, void *p)
{
    if (p) {
        held_remove(&d->held, p);
        tdm_cuda_dev_bind(d);
        cudaFree(p);
    }
}

size_t tdm_cuda_dev_held(struct tdm_cuda_dev *d)
{
    return held_total(&d->held);
}

static int copy(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes,
                enum cudaMemcpyKind kind, int wait)
{
    if (bytes == 0)
        return TDM_OK;
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, d->stream);
    if (e == cudaSuccess && wait)
        e = cudaStreamSynchronize(d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaMemcpyAsync", e);
}

int tdm_cuda_dev_h2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy(d, dst, src, bytes, cudaMemcpyHostToDevice, 1);
}

int tdm_cuda_dev_d2h(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy(d, dst, src, bytes, cudaMemcpyDeviceToHost, 1);
}

int tdm_cuda_dev_d2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy(d, dst, src, bytes, cudaMemcpyDeviceToDevice, 0);
}

int tdm_cuda_dev_memset(struct tdm_cuda_dev *d, void *dst, int byte, size_t bytes)
{
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaMemsetAsync(dst, byte, bytes, d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaMemsetAsync", e);
}

void *tdm_cuda_dev_host_alloc(struct tdm_cuda_dev *d, size_t bytes)
{
    void *p = NULL;
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cuda_fail(d, "cudaHostAlloc", e);
        return NULL;
    }
    return p;
}

void tdm_cuda_dev_host_free(struct tdm_cuda_dev *d, void *p)
{
    if (p) {
        tdm_cuda_dev_bind(d);
        cudaFreeHost(p);
    }
}

// A copy issued while the stream captures would become part of the graph,
// replayed with whatever the pinned memory holds then: refused, as h2d is.
static int copy_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes,
                      enum cudaMemcpyKind kind)
{
    if (bytes == 0)
        return TDM_OK;
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    cudaError_t e = cudaStreamIsCapturing(d->stream, &st);
    if (e == cudaSuccess && st != cudaStreamCaptureStatusNone)
        e = cudaErrorStreamCaptureUnsupported;
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, bytes, kind, d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaMemcpyAsync", e);
}

int tdm_cuda_dev_h2d_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy_async(d, dst, src, bytes, cudaMemcpyHostToDevice);
}

int tdm_cuda_dev_d2h_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy_async(d, dst, src, bytes, cudaMemcpyDeviceToHost);
}

int tdm_cuda_dev_sync(struct tdm_cuda_dev *d)
{
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaStreamSynchronize(d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaStreamSynchronize", e);
}

// ---- GEMM ------------------------------------------------------------------------------------
struct gemm_descs {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
};

static void gemm_descs_free(struct gemm_descs *g)
{
    if (g->op)
        cublasLtMatmulDescDestroy(g->op);
    if (g->a)
        cublasLtMatrixLayoutDestroy(g->a);
    if (g->b)
        cublasLtMatrixLayoutDestroy(g->b);
    if (g->c)
        cublasLtMatrixLayoutDestroy(g->c);
}

static int gemm_descs_make(struct gemm_descs *g, int rows, int cols, int n, const float *bias)
{
    memset(g, 0, sizeof *g);
    cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
    if (cublasLtMatmulDescCreate(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) ||
        cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta) ||
        cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb))
        return TDM_EBACKEND;
    if (bias) {
        cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bt = CUDA_R_32F;
        if (cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi,
                                           sizeof epi) ||
            cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt,
                                           sizeof bt) ||
            cublasLtMatmulDescSetAttribute(g->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                           sizeof bias))
            return TDM_EBACKEND;
    }
    if (cublasLtMatrixLayoutCreate(&g->a, CUDA_R_16BF, (uint64_t)cols, (uint64_t)rows, cols) ||
        cublasLtMatrixLayoutCreate(&g->b, CUDA_R_16BF, (uint64_t)cols, (uint64_t)n, cols) ||
        cublasLtMatrixLayoutCreate(&g->c, CUDA_R_32F, (uint64_t)rows, (uint64_t)n, rows))
        return TDM_EBACKEND;
    return TDM_OK;
}

// The alignment (a power of two, at most cuBLASLt's default of 256) that a
// buffer of rows of row_bytes keeps at every row offset: buffers start
// 256-byte aligned, and a class's run may start at any row of the step.
static uint32_t row_alignment(size_t row_bytes)
{
    uint32_t a = 256;
    while (a > 1 && row_bytes % a != 0)
        a /= 2;
    return a;
}

// The algorithm of a weight shape (with or without the bias epilogue) for
// class cls: chosen at the class's n, split-K 1, among the algorithms that
// take x and y at any row offset (for rows of 128 bf16 / 64 f32 or a multiple,
// the 0.5B model's shapes among them, that is cuBLASLt's default of 256 bytes:
// the decode class's algorithm is the one chosen before there were classes).
static const cublasLtMatmulAlgo_t *gemm_plan(struct tdm_cuda_dev *d, int rows, int cols,
                                             const float *bias, enum tdm_cuda_gemm_class cls)
{
    for (int i = 0; i < d->nplans; i++)
        if (d->plans[i].rows == rows && d->plans[i].cols == cols &&
            d->plans[i].bias == (bias != NULL) && d->plans[i].cls == cls)
            return &d->plans[i].algo;
    if (d->nplans == TDM_GEMM_MAX_SHAPES) {
        snprintf(d->errmsg, sizeof d->errmsg, "gemm: more than %d weight shapes and classes",
                 TDM_GEMM_MAX_SHAPES);
        return NULL;
    }
    struct gemm_descs g;
    const cublasLtMatmulAlgo_t *res = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    int plan_n = cls == TDM_CUDA_GEMM_PROMPT ? TDM_GEMM_PROMPT_PLAN_N : TDM_GEMM_PLAN_N;
    if (gemm_descs_make(&g, rows, cols, plan_n, bias) != TDM_OK)
        goto out;
    size_t ws = TDM_GEMM_WORKSPACE;
    uint32_t align_x = row_alignment((size_t)cols * sizeof(uint16_t));
    uint32_t align_y = row_alignment((size_t)rows * sizeof(float));
    if (cublasLtMatmulPreferenceCreate(&pref) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                             sizeof ws) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                             &align_x, sizeof align_x) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                             &align_y, sizeof align_y) ||
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                             &align_y, sizeof align_y))
        goto out;
    cublasLtMatmulHeuristicResult_t heur[8];
    int found = 0;
    if (cublasLtMatmulAlgoGetHeuristic(d->lt, g.op, g.a, g.b, g.c, g.c, pref, 8, heur, &found) ||
        found == 0)
        goto out;
    struct gemm_plan *p = &d->plans[d->nplans];
    p->rows = rows;
    p->cols = cols;
    p->bias = bias != NULL;
    p->cls = cls;
    p->algo = heur[0].algo;
    int splitk = 1;
    cublasLtReductionScheme_t red = CUBLASLT_REDUCTION_SCHEME_NONE;
    (void)cublasLtMatmulAlgoConfigSetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                               sizeof splitk);
    (void)cublasLtMatmulAlgoConfigSetAttribute(&p->algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                               &red, sizeof red);
    d->nplans++;
    res = &p->algo;
out:
    if (res == NULL)
        snprintf(d->errmsg, sizeof d->errmsg,
                 "gemm: no cuBLASLt algorithm for a %d x %d bf16 weight (%s rows)", rows, cols,
                 cls == TDM_CUDA_GEMM_PROMPT ? "prompt" : "decode");
    if (pref)
        cublasLtMatmulPreferenceDestroy(pref);
    gemm_descs_free(&g);
    return res;
}

int tdm_cuda_dev_gemm_bf16(struct tdm_cuda_dev *d, const uint16_t *w, int rows, int cols,
                           const uint16_t *x, int n, const float *bias, float *y,
                           enum tdm_cuda_gemm_class cls)
{
    if (rows <= 0 || cols <= 0 || n <= 0) {
        snprintf(d->errmsg, sizeof d->errmsg, "gemm: %d x %d weight, n %d", rows, cols, n);
        return TDM_EINVAL;
    }
    const cublasLtMatmulAlgo_t *algo = gemm_plan(d, rows, cols, bias, cls);
    if (algo == NULL)
        return TDM_EBACKEND;
    struct gemm_descs g;
    int rc = gemm_descs_make(&g, rows, cols, n, bias);
    if (rc == TDM_OK) {
        const float one = 1.0f, zero = 0.0f;
        cublasStatus_t st = cublasLtMatmul(d->lt, g.op, &one, w, g.a, x, g.b, &zero, y, g.c, y, g.c,
                                           algo, d->workspace, TDM_GEMM_WORKSPACE, d->stream);
        if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) {
            // The shape's algorithm refuses this n: let cuBLASLt choose for
            // this call (correct, but this shape's rows may then depend on n).
            if (!d->warned_fallback) {
                d->warned_fallback = true;
                TDM_LOG_WARN("cuda",
                             "gemm %d x %d: the fixed %s algorithm refused n=%d; cuBLASLt "
                             "chooses for such calls (batch invariance not guaranteed for them)",
                             rows, cols, cls == TDM_CUDA_GEMM_PROMPT ? "prompt" : "decode", n);
            }
            st = cublasLtMatmul(d->lt, g.op, &one, w, g.a, x, g.b, &zero, y, g.c, y, g.c, NULL,
                                d->workspace, TDM_GEMM_WORKSPACE, d->stream);
        }
        if (st != CUBLAS_STATUS_SUCCESS) {
            snprintf(d->errmsg, sizeof d->errmsg, "gemm: cublasLtMatmul %d x %d, n %d: status %d",
                     rows, cols, n, (int)st);
            rc = TDM_EBACKEND;
        }
    } else {
        snprintf(d->errmsg, sizeof d->errmsg, "gemm: cuBLASLt descriptors for %d x %d, n %d", rows,
                 cols, n);
    }
    gemm_descs_free(&g);
    return rc;
}

// ---- graphs ----------------------------------------------------------------------------------
int tdm_cuda_dev_capture_begin(struct tdm_cuda_dev *d)
{
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    // Relaxed: cuBLASLt may query its own state while the stream records.
    cudaError_t e = cudaStreamBeginCapture(d->stream, cudaStreamCaptureModeRelaxed);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaStreamBeginCapture", e);
}

int tdm_cuda_dev_capture_end(struct tdm_cuda_dev *d, void **graph)
{
    *graph = NULL;
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(d->stream, &g);
    if (e != cudaSuccess)
        return cuda_fail(d, "cudaStreamEndCapture", e);
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return cuda_fail(d, "cudaGraphInstantiate", e);
    *graph = (void *)exec;
    return TDM_OK;
}

int tdm_cuda_dev_graph_launch(struct tdm_cuda_dev *d, void *graph)
{
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaGraphLaunch", e);
}

void tdm_cuda_dev_graph_free(struct tdm_cuda_dev *d, void *graph)
{
    (void)d;
    if (graph)
        cudaGraphExecDestroy((cudaGraphExec_t)graph);
}

const char *tdm_cuda_dev_errmsg(const struct tdm_cuda_dev *d)
{
    return d->errmsg;
}

// ---- events and side streams ----------------------------------------------------------------
int tdm_cuda_dev_event_new(struct tdm_cuda_dev *d, void **event)
{
    *event = NULL;
    if (tdm_cuda_dev_bind(d) != TDM_OK)
        return TDM_EBACKEND;
    cudaEvent_t ev = NULL;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e != cudaSuccess)
        return cuda_fail(d, "cudaEventCreateWithFlags", e);
    *event = (void *)ev;
    return TDM_OK;
}

void tdm_cuda_dev_event_free(struct tdm_cuda_dev *d, void *event)
{
    (void)d;
    if (event)
        cudaEventDestroy((cudaEvent_t)event);
}

int tdm_cuda_dev_event_record(struct tdm_cuda_dev *d, void *event)
{
    // Per layer on the engine's thread, which the forward bound already.
    cudaError_t e = cudaEventRecord((cudaEvent_t)event, d->stream);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaEventRecord", e);
}

int tdm_cuda_dev_event_sync(struct tdm_cuda_dev *d, void *event)
{
    cudaError_t e = cudaEventSynchronize((cudaEvent_t)event);
    return e == cudaSuccess ? TDM_OK : cuda_fail(d, "cudaEventSynchronize", e);
}

struct tdm_cuda_side {
    struct tdm_cuda_dev *d;
    cudaStream_t stream;
    void *host; // pinned (cudaHostAlloc)
    size_t host_bytes;
    char errmsg[256];
};

static int side_fail(struct tdm_cuda_side *s, const char *what, cudaError_t e)
{
    snprintf(s->errmsg, sizeof s->errmsg, "%s: %s", what, cudaGetErrorString(e));
    return TDM_EBACKEND;
}

static int side_bind(struct tdm_cuda_side *s)
{
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur == s->d->ordinal)
        return TDM_OK;
    cudaError_t e = cudaSetDevice(s->d->ordinal);
    return e == cudaSuccess ? TDM_OK : side_fail(s, "cudaSetDevice", e);
}

int tdm_cuda_side_new(struct tdm_cuda_dev *d, struct tdm_cuda_side **out, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_cuda_side *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    s->d = d;
    cudaError_t e = cudaSuccess;
    if (side_bind(s) != TDM_OK ||
        (e = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking)) != cudaSuccess) {
        if (e != cudaSuccess)
            side_fail(s, "cudaStreamCreateWithFlags", e);
        int rc = tdm_seterr(err, errlen, TDM_EBACKEND, "cuda: side stream: %s", s->errmsg);
        free(s);
        return rc;
    }
    *out = s;
    return TDM_OK;
}

void tdm_cuda_side_free(struct tdm_cuda_side *s)
{
    if (s == NULL)
        return;
    side_bind(s);
    cudaStreamSynchronize(s->stream);
    cudaStreamDestroy(s->stream);
    if (s->host)
        cudaFreeHost(s->host);
    free(s);
}

void *tdm_cuda_side_stream(struct tdm_cuda_side *s)
{
    return (void *)s->stream;
}

void *tdm_cuda_side_host(struct tdm_cuda_side *s, size_t bytes)
{
    if (bytes <= s->host_bytes)
        return s->host;
    if (side_bind(s) != TDM_OK)
        return NULL;
    if (s->host)
        cudaFreeHost(s->host);
    s->host = NULL;
    s->host_bytes = 0;
    // Grown by half again, so a prompt a little longer than the last does not
    // pin anew (cudaHostAlloc costs about a millisecond per few MiB).
    size_t want = bytes + bytes / 2;
    cudaError_t e = cudaHostAlloc(&s->host, want, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        side_fail(s, "cudaHostAlloc", e);
        s->host = NULL;
        return NULL;
    }
    s->host_bytes = want;
    return s->host;
}

static int side_copy(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes,
                     enum cudaMemcpyKind kind)
{
    if (side_bind(s) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, kind, s->stream);
    return e == cudaSuccess ? TDM_OK : side_fail(s, "cudaMemcpyAsync", e);
}

int tdm_cuda_side_h2d(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes)
{
    return side_copy(s, dst, src, bytes, cudaMemcpyHostToDevice);
}

int tdm_cuda_side_d2h(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes)
{
    return side_copy(s, dst, src, bytes, cudaMemcpyDeviceToHost);
}

int tdm_cuda_side_wait_event(struct tdm_cuda_side *s, void *event)
{
    if (side_bind(s) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaStreamWaitEvent(s->stream, (cudaEvent_t)event, 0);
    return e == cudaSuccess ? TDM_OK : side_fail(s, "cudaStreamWaitEvent", e);
}

int tdm_cuda_side_event_sync(struct tdm_cuda_side *s, void *event)
{
    if (side_bind(s) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaEventSynchronize((cudaEvent_t)event);
    return e == cudaSuccess ? TDM_OK : side_fail(s, "cudaEventSynchronize", e);
}

int tdm_cuda_side_sync(struct tdm_cuda_side *s)
{
    if (side_bind(s) != TDM_OK)
        return TDM_EBACKEND;
    cudaError_t e = cudaStreamSynchronize(s->stream);
    return e == cudaSuccess ? TDM_OK : side_fail(s, "cudaStreamSynchronize", e);
}

const char *tdm_cuda_side_errmsg(const struct tdm_cuda_side *s)
{
    return s->errmsg;
}
