// SPDX-License-Identifier: Apache-2.0
// cpu_backend: the CPU implementation of struct tdm_backend_ops. This file
// holds the object, weight preparation (repacking into the panel layout of
// cpu_impl.h, bf16 rounding and int8 quantization), the parallel drivers and
// the small ops; the SIMD inner loops live in cpu_kernels_<isa>.c.
//
// Batch invariance: work is split only along output rows (matmul blocks),
// tokens and (sequence, head, token) attention tasks; every output element is
// computed by the same instruction sequence whatever n, the tile it falls in
// or the thread that computes it. Ops allocate nothing: matmul's activation
// scratch is sized in prepare_weight for CPU_MM_CHUNK_TOKENS tokens of the
// widest weight, and larger batches run in chunks of that many tokens.
#include <math.h>
#include <stdint.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core.h"
#include "cpu_impl.h"

// ---- ISA selection -------------------------------------------------------------------------
static const char *const isa_names[TDM_CPU_ISA_COUNT] = {"portable", "avx2", "avx512", "amx"};

const char *tdm_cpu_isa_name(enum tdm_cpu_isa isa)
{
    return (unsigned)isa < TDM_CPU_ISA_COUNT ? isa_names[isa] : NULL;
}

int tdm_cpu_isa_parse(const char *name, enum tdm_cpu_isa *out)
{
    for (int i = 0; i < TDM_CPU_ISA_COUNT; i++) {
        if (name && strcmp(name, isa_names[i]) == 0) {
            *out = (enum tdm_cpu_isa)i;
            return TDM_OK;
        }
    }
    return TDM_EINVAL;
}

int tdm_cpu_isa_supported(enum tdm_cpu_isa isa)
{
    switch (isa) {
    case TDM_CPU_ISA_PORTABLE:
        return 1;
#if defined(__x86_64__) || defined(__i386__)
    case TDM_CPU_ISA_AVX2:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case TDM_CPU_ISA_AVX512:
        __builtin_cpu_init();
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vnni") &&
               __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case TDM_CPU_ISA_AMX:
        // Every AMX CPU has the AVX-512 set the rest of the path uses.
        return tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512) && cpu_amx_available();
#endif
    default:
        return 0;
    }
}

enum tdm_cpu_isa tdm_cpu_isa_best(void)
{
    for (int i = TDM_CPU_ISA_COUNT - 1; i > 0; i--)
        if (tdm_cpu_isa_supported((enum tdm_cpu_isa)i))
            return (enum tdm_cpu_isa)i;
    return TDM_CPU_ISA_PORTABLE;
}

int tdm_cpu_isa_default(enum tdm_cpu_isa *out, char *err, size_t errlen)
{
    // The best path this CPU has, AMX included (its hardware tests,
    // cpu_amx_test.test_hw_*, pass on Sapphire Rapids: docs/cpu-backend.md).
    enum tdm_cpu_isa isa = tdm_cpu_isa_best();
    const char *force = getenv("TANDEM_CPU_ISA");
    if (force && *force) {
        if (tdm_cpu_isa_parse(force, &isa) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_CPU_ISA=%s: expected portable, avx2, avx512 or amx", force);
        if (!tdm_cpu_isa_supported(isa))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_CPU_ISA=%s: this CPU does not support it", force);
    }
    *out = isa;
    return TDM_OK;
}

const char *tdm_cpu_isa_matmul_path(enum tdm_cpu_isa isa, enum tdm_wtype type)
{
    switch (isa) {
    case TDM_CPU_ISA_AMX:
        return type == TDM_W_BF16 ? "amx-bf16 tiles"
               : type == TDM_W_Q8 ? "avx512 vnni"
                                  : "avx512 fma";
    case TDM_CPU_ISA_AVX512:
        return type == TDM_W_BF16 ? "avx512 vdpbf16ps"
               : type == TDM_W_Q8 ? "avx512 vnni"
                                  : "avx512 fma";
    case TDM_CPU_ISA_AVX2:
        return "avx2 fma";
    default:
        return "portable C";
    }
}

static const struct cpu_kernels *isa_kernels(struct tdm_backend *be, enum tdm_cpu_isa isa)
{
    switch (isa) {
#if defined(__x86_64__)
    case TDM_CPU_ISA_AMX:
        cpu_kernels_amx_fill(&be->k_amx, false);
        return &be->k_amx;
    case TDM_CPU_ISA_AVX2:
        return &cpu_kernels_avx2;
    case TDM_CPU_ISA_AVX512:
        return &cpu_kernels_avx512;
#endif
    default:
        return &cpu_kernels_portable;
    }
}

int tdm_cpu_backend_set_isa(struct tdm_backend *be, enum tdm_cpu_isa isa)
{
    if ((unsigned)isa >= TDM_CPU_ISA_COUNT || !tdm_cpu_isa_supported(isa))
        return TDM_EINVAL;
    be->isa = isa;
    be->k = isa_kernels(be, isa);
    return TDM_OK;
}

void cpu_backend_use_amx_emu(struct tdm_backend *be)
{
    cpu_kernels_amx_fill(&be->k_amx, true);
    be->k = &be->k_amx;
}

enum tdm_cpu_isa tdm_cpu_backend_isa(const struct tdm_backend *be)
{
    return be->isa;
}

int tdm_cpu_backend_num_threads(const struct tdm_backend *be)
{
    return be->nthreads;
}

// ---- create / destroy / memory ----------------------------------------------------------------
static void *alloc_aligned(size_t bytes)
{
    // Large buffers (weights) get 2 MiB alignment and transparent huge pages:
    // streaming ~1 GB of weights per token through 4 KiB pages costs TLB misses.
    size_t align = bytes >= (4u << 20) ? (2u << 20) : 64;
    size_t rounded = (bytes + align - 1) / align * align;
    void *p = NULL;
    if (rounded == 0)
        rounded = align;
    if (posix_memalign(&p, align, rounded) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    if (align > 64)
        madvise(p, rounded, MADV_HUGEPAGE);
#endif
    return p;
}

// Whether the CPU is Intel's (cpu_impl.h, CPU_STREAM_PREFETCH).
static bool cpu_is_intel(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    return __builtin_cpu_is("intel");
#else
    return false;
#endif
}

static int cpu_create(struct tdm_backend **out, int num_threads, int device, char *err,
                      size_t errlen)
{
    (void)device;
    enum tdm_cpu_isa isa;
    int rc = tdm_cpu_isa_default(&isa, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (num_threads < 0 || num_threads > 1024)
        return tdm_seterr(err, errlen, TDM_EINVAL, "cpu backend: num_threads=%d out of range",
                          num_threads);
    if (num_threads == 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        num_threads = online > 0 ? (int)(online < 1024 ? online : 1024) : 1;
    }
    struct tdm_backend *be = calloc(1, sizeof(*be));
    if (!be)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cpu backend: out of memory");
    be->isa = isa;
    be->k = isa_kernels(be, isa);
    be->nthreads = num_threads;
    be->stream_prefetch = cpu_is_intel();
    if (cpu_pool_new(&be->pool, num_threads) != TDM_OK) {
        free(be);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cpu backend: cannot start %d threads",
                          num_threads);
    }
    TDM_LOG_INFO("cpu", "backend isa=%s threads=%d", tdm_cpu_isa_name(isa), num_threads);
    *out = be;
    return TDM_OK;
}

static void cpu_destroy(struct tdm_backend *be)
{
    if (!be)
        return;
    cpu_pool_free(be->pool);
    free(be->xq);
    free(be->am_tiles);
    free(be->am_best);
    free(be->am_idx);
    free(be->sm_tiles);
    free(be->attn_scratch);
    free(be->rope_cs);
    free(be->rope_pos);
    free(be->rope_inv);
    free(be);
}

static void *cpu_alloc(struct tdm_backend *be, size_t bytes)
{
    (void)be;
    return alloc_aligned(bytes);
}

static void cpu_release(struct tdm_backend *be, void *p)
{
    (void)be;
    free(p);
}

// ---- weights ---------------------------------------------------------------------------------
// IEEE half to float (exact), local so weight preparation needs no hf code.
static float f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    int exp = (h >> 10) & 0x1f;
    uint32_t mant = h & 0x3ff;
    float f;
    if (exp == 0) {
        f = ldexpf((float)mant, -24); // zero or subnormal
    } else if (exp == 31) {
        f = mant ? NAN : INFINITY;
    } else {
        uint32_t u = ((uint32_t)(exp - 15 + 127) << 23) | (mant << 13);
        memcpy(&f, &u, 4);
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
}

static float src_elem(const struct tdm_weight_src *s, size_t i)
{
    switch (s->dtype) {
    case TDM_DTYPE_F32: {
        float f;
        memcpy(&f, (const uint8_t *)s->data + 4 * i, 4);
        return f;
    }
    case TDM_DTYPE_F16: {
        uint16_t h;
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        return f16_to_f32(h);
    }
    default: {
        uint16_t h;
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        return cpu_bf16_to_f32(h);
    }
    }
}

static uint16_t src_elem_bf16(const struct tdm_weight_src *s, size_t i)
{
    if (s->dtype == TDM_DTYPE_BF16) {
        uint16_t h;
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        return h;
    }
    return tdm_f32_to_bf16(src_elem(s, i));
}

// Byte offset of element (r, k) in the packed layout.
static size_t packed_offset(const struct tdm_weight *w, int r, int k)
{
    int b = r / CPU_BLOCK_ROWS;
    int g = (r % CPU_BLOCK_ROWS) / CPU_PANEL_ROWS;
    int lane = r % CPU_PANEL_ROWS;
    int G = cpu_w_block_panels(w, b);
    size_t base = (size_t)(cpu_w_block(w, b) - (const uint8_t *)w->data);
    switch (w->type) {
    case TDM_W_BF16:
        return base + ((size_t)(k / 2) * G + g) * 64 + (size_t)lane * 4 + (size_t)(k % 2) * 2;
    case TDM_W_Q8:
        return base + ((size_t)(k / 4) * G + g) * 64 + (size_t)lane * 4 + (size_t)(k % 4);
    default:
        return base + ((size_t)k * G + g) * 64 + (size_t)lane * 4;
    }
}

// Packs checkpoint row pr of part s as row r of w (see cpu_impl.h for the layout).
static void prepare_row(struct tdm_weight *w, const struct tdm_weight_src *s, int pr, int r,
                        int cols, enum tdm_wtype want)
{
    size_t src0 = (size_t)pr * cols;
    // Row r's element k sits at base + k_step * stride (+ 2 for the odd
    // element of a bf16 pair); see cpu_impl.h.
    uint8_t *base = (uint8_t *)w->data + packed_offset(w, r, 0);
    size_t stride = (size_t)cpu_w_block_panels(w, r / CPU_BLOCK_ROWS) * cpu_w_step_bytes(want);
    if (want == TDM_W_BF16) {
        for (int k = 0; k < cols; k++) {
            uint16_t h = src_elem_bf16(s, src0 + k);
            memcpy(base + (size_t)(k / 2) * stride + (size_t)(k % 2) * 2, &h, 2);
        }
    } else if (want == TDM_W_F32) {
        for (int k = 0; k < cols; k++) {
            float f = src_elem(s, src0 + k);
            memcpy(base + (size_t)k * stride, &f, 4);
        }
    } else {
        // Symmetric per-row int8: scale = max|w| / 127, q = round(w / scale).
        float amax = 0.0f;
        for (int k = 0; k < cols; k++) {
            float a = fabsf(src_elem(s, src0 + k));
            if (a > amax)
                amax = a;
        }
        float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        w->scales[r] = amax / 127.0f;
        for (int k = 0; k < cols; k++) {
            float q = nearbyintf(src_elem(s, src0 + k) * inv);
            q = q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q;
            base[(size_t)(k / 4) * stride + (size_t)(k % 4)] = (uint8_t)(int8_t)q;
        }
    }
}

struct prep_job {
    struct tdm_weight *w;
    const struct tdm_weight_src *parts;
    int nparts;
    int cols;
    enum tdm_wtype want;
};

static void split_range(int total, int tid, int nthreads, int *lo, int *hi)
{
    *lo = (int)((long long)total * tid / nthreads);
    *hi = (int)((long long)total * (tid + 1) / nthreads);
}

// Blocks are independent, so the pool's threads zero and pack disjoint block
// ranges (the repacking of a 1 GB model is most of a cold start, and first
// touching the pages in parallel spreads the page faults too).
static void prep_task(void *arg, int tid, int nthreads)
{
    struct prep_job *j = arg;
    int b0, b1;
    split_range(cpu_w_blocks(j->w), tid, nthreads, &b0, &b1);
    if (b0 >= b1)
        return;
    uint8_t *lo = (uint8_t *)cpu_w_block(j->w, b0), *hi = (uint8_t *)cpu_w_block(j->w, b1);
    memset(lo, 0, (size_t)(hi - lo)); // padding lanes and steps must read as zero
    int r0 = b0 * CPU_BLOCK_ROWS;
    int r1 = b1 * CPU_BLOCK_ROWS < j->w->rows ? b1 * CPU_BLOCK_ROWS : j->w->rows;
    int p = 0, first = 0; // part p holds rows [first, first + parts[p].rows)
    for (int r = r0; r < r1; r++) {
        while (r >= first + j->parts[p].rows)
            first += j->parts[p++].rows;
        prepare_row(j->w, &j->parts[p], r - first, r, j->cols, j->want);
    }
}

// Bytes of w's packed data (every block allocated full: the last block is
// laid out with its own G, but a full allocation keeps the offset arithmetic
// trivially in bounds) and of its Q8 scales (0 for other types).
static size_t weight_data_bytes(const struct tdm_weight *w)
{
    return (size_t)cpu_w_blocks(w) * cpu_w_steps(w) * CPU_BLOCK_PANELS * cpu_w_step_bytes(w->type);
}

static size_t weight_scale_bytes(const struct tdm_weight *w)
{
    return w->type == TDM_W_Q8 ? (size_t)cpu_w_blocks(w) * CPU_BLOCK_ROWS * sizeof(float) : 0;
}

static int check_geometry(enum tdm_wtype want, long long rows, int cols, char *err, size_t errlen)
{
    if (want != TDM_W_F32 && want != TDM_W_BF16 && want != TDM_W_Q8)
        return tdm_seterr(err, errlen, TDM_EINVAL, "prepare_weight: unknown type %d", (int)want);
    if (rows < 1 || cols < 1 || rows > (1 << 30) || (long long)cols * rows > (1ll << 40))
        return tdm_seterr(err, errlen, TDM_EINVAL, "prepare_weight: %lld x %d out of range",
                          rows, cols);
    return TDM_OK;
}

// The activation scratch of the AVX-512 path must hold the widest weight:
// bf16 pairs, or int8 + a scale and a sum per 32 k.
static int grow_scratch(struct tdm_backend *be, int cols)
{
    size_t xs_bf16 = ((size_t)(cols + 1) / 2 + 15) / 16 * 16;
    size_t xs_q8 =
        ((size_t)cpu_q8_kpad(cols) / 4 + 2 * (size_t)cpu_q8_kpad(cols) / CPU_Q8_BLOCK + 15) / 16 *
        16;
    size_t xs = xs_bf16 > xs_q8 ? xs_bf16 : xs_q8;
    if (xs > be->xq_stride) {
        uint32_t *xq = alloc_aligned(CPU_MM_CHUNK_TOKENS * xs * sizeof(uint32_t));
        if (!xq)
            return TDM_ENOMEM;
        free(be->xq);
        be->xq = xq;
        be->xq_stride = xs;
    }
    return TDM_OK;
}

static int cpu_prepare_weight(struct tdm_backend *be, struct tdm_weight *w,
                              const struct tdm_weight_src *parts, int nparts, int cols,
                              enum tdm_wtype want, char *err, size_t errlen)
{
    memset(w, 0, sizeof(*w));
    if (nparts < 1 || !parts || cols < 1)
        return tdm_seterr(err, errlen, TDM_EINVAL, "prepare_weight: nparts=%d cols=%d", nparts,
                          cols);
    long long rows = 0;
    for (int i = 0; i < nparts; i++) {
        if (parts[i].rows < 1 || !parts[i].data)
            return tdm_seterr(err, errlen, TDM_EINVAL, "prepare_weight: part %d has %d rows", i,
                              parts[i].rows);
        if (parts[i].dtype != TDM_DTYPE_F32 && parts[i].dtype != TDM_DTYPE_F16 &&
            parts[i].dtype != TDM_DTYPE_BF16)
            return tdm_seterr(err, errlen, TDM_EINVAL, "prepare_weight: part %d dtype %d", i,
                              (int)parts[i].dtype);
        rows += parts[i].rows;
    }
    int rc = check_geometry(want, rows, cols, err, errlen);
    if (rc != TDM_OK)
        return rc;
    w->type = want;
    w->rows = (int)rows;
    w->cols = cols;
    size_t data_bytes = weight_data_bytes(w);
    w->data = alloc_aligned(data_bytes); // zeroed block by block in prep_task
    if (!w->data)
        goto fail_oom;
    if (want == TDM_W_Q8) {
        w->scales = alloc_aligned(weight_scale_bytes(w));
        if (!w->scales)
            goto fail_oom;
        memset(w->scales, 0, weight_scale_bytes(w));
    }
    if (grow_scratch(be, cols) != TDM_OK)
        goto fail_oom;
    struct prep_job job = {.w = w, .parts = parts, .nparts = nparts, .cols = cols, .want = want};
    cpu_pool_run(be->pool, prep_task, &job);
    w->nbytes = data_bytes + (w->scales ? (size_t)w->rows * sizeof(float) : 0);
    return TDM_OK;

fail_oom:
    free(w->data);
    free(w->scales);
    memset(w, 0, sizeof(*w));
    return tdm_seterr(err, errlen, TDM_ENOMEM, "prepare_weight: out of memory for %lld x %d", rows,
                      cols);
}

static int cpu_weight_spans(const struct tdm_weight *w, const void *ptr[2], size_t bytes[2])
{
    ptr[0] = w->data;
    bytes[0] = weight_data_bytes(w);
    if (w->type != TDM_W_Q8)
        return 1;
    ptr[1] = w->scales;
    bytes[1] = weight_scale_bytes(w);
    return 2;
}

static int cpu_adopt_weight(struct tdm_backend *be, struct tdm_weight *w, enum tdm_wtype type,
                            int rows, int cols, const void *const ptr[2], const size_t bytes[2],
                            int nspans, char *err, size_t errlen)
{
    memset(w, 0, sizeof(*w));
    int rc = check_geometry(type, rows, cols, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_weight g = {.type = type, .rows = rows, .cols = cols};
    int want_spans = type == TDM_W_Q8 ? 2 : 1;
    size_t want_bytes[2] = {weight_data_bytes(&g), weight_scale_bytes(&g)};
    if (nspans != want_spans)
        return tdm_seterr(err, errlen, TDM_EINVAL, "adopt_weight: %d spans, %d x %d wants %d",
                          nspans, rows, cols, want_spans);
    for (int i = 0; i < nspans; i++) {
        if (bytes[i] != want_bytes[i])
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "adopt_weight: span %d has %zu bytes, %d x %d wants %zu", i,
                              bytes[i], rows, cols, want_bytes[i]);
        if (ptr[i] == NULL || (uintptr_t)ptr[i] % 64 != 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "adopt_weight: span %d not 64-byte aligned",
                              i);
    }
    if (grow_scratch(be, cols) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "adopt_weight: out of memory for scratch");
    *w = g;
    w->data = (void *)ptr[0];
    w->scales = type == TDM_W_Q8 ? (float *)ptr[1] : NULL;
    w->nbytes = want_bytes[0] + (w->scales ? (size_t)rows * sizeof(float) : 0);
    w->borrowed = true;
    return TDM_OK;
}

static void cpu_release_weight(struct tdm_backend *be, struct tdm_weight *w)
{
    (void)be;
    if (!w)
        return;
    if (!w->borrowed) {
        free(w->data);
        free(w->scales);
    }
    memset(w, 0, sizeof(*w));
}

// ---- matmul -------------------------------------------------------------------------------------
struct mm_job {
    struct tdm_backend *be;
    struct cpu_mm_args a;
    int chunk;        // row blocks per task
    _Atomic int next; // next task
};


static void mm_prep_task(void *arg, int tid, int nthreads)
{
    struct mm_job *j = arg;
    int t0, t1;
    split_range(j->a.n, tid, nthreads, &t0, &t1);
    if (t1 > t0)
        j->be->k->mm_prep_x(&j->a, t0, t1);
}

// Threads take chunks of row blocks as they come: on a shared machine a
// descheduled thread does not hold up the others. Which thread computes a
// block never changes its bits.
static void mm_task(void *arg, int tid, int nthreads)
{
    (void)tid;
    (void)nthreads;
    struct mm_job *j = arg;
    int nb = cpu_w_blocks(j->a.w);
    for (;;) {
        int b0 = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed) * j->chunk;
        if (b0 >= nb)
            return;
        int b1 = b0 + j->chunk < nb ? b0 + j->chunk : nb;
        j->be->k->mm_blocks(&j->a, b0, b1);
    }
}

// A job over tokens [t0, t0 + nc) of x (its output and chunk size are the
// caller's).
static void mm_job_init(struct mm_job *j, struct tdm_backend *be, const struct tdm_weight *w,
                        const float *bias, const float *x, int t0, int nc)
{
    *j = (struct mm_job){.be = be,
                         .a = {.w = w,
                               .bias = bias,
                               .x = x + (size_t)t0 * w->cols,
                               .xq = be->xq,
                               .xq_stride = be->xq_stride,
                               .n = nc,
                               .stream_prefetch = be->stream_prefetch}};
    atomic_init(&j->next, 0);
}

// The activations of a chunk of tokens in the weight's input format (bf16
// pairs, Q8 blocks), before its row blocks are multiplied.
static void mm_prep(struct tdm_backend *be, struct mm_job *j)
{
    const struct tdm_weight *w = j->a.w;
    if (be->k->mm_prep_x && w->type != TDM_W_F32) {
        // A decode step's vector is converted faster than a fork/join.
        if ((size_t)j->a.n * w->cols < 65536)
            be->k->mm_prep_x(&j->a, 0, j->a.n);
        else
            cpu_pool_run(be->pool, mm_prep_task, j);
    }
}

// ---- fused argmax (the LM head of greedy rows) ----------------------------------------------
// Each task multiplies CPU_ARGMAX_CHUNK_BLOCKS row blocks for the chunk's
// tokens into its thread's tile, then folds the tile into that thread's best
// value and index per token: the full [n][rows] output is never written. A
// thread takes chunks in increasing row order, so `>` keeps its lowest index
// among equal values; threads merge by value, then lowest index: the result is
// the first largest by `>` over the whole row, as the sampler's argmax finds it
// (NaN never wins; row 0 when nothing is above -inf), from the same bits as
// cpu_matmul's (which thread computes a block never changes them).
static float row_max(const struct tdm_backend *be, const float *x, int n)
{
    if (be->k->row_max)
        return be->k->row_max(x, n);
    float m = -INFINITY;
    for (int i = 0; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

static void mm_argmax_task(void *arg, int tid, int nthreads)
{
    (void)nthreads;
    struct mm_job *j = arg;
    struct tdm_backend *be = j->be;
    const struct tdm_weight *w = j->a.w;
    int nb = cpu_w_blocks(w), n = j->a.n;
    float *tile = be->am_tiles + (size_t)tid * CPU_ARGMAX_CHUNK_ROWS * CPU_MM_CHUNK_TOKENS;
    float *best = be->am_best + (size_t)tid * CPU_MM_CHUNK_TOKENS;
    int32_t *idx = be->am_idx + (size_t)tid * CPU_MM_CHUNK_TOKENS;
    for (int t = 0; t < n; t++) {
        best[t] = -INFINITY;
        idx[t] = -1;
    }
    struct cpu_mm_args a = j->a;
    a.y = tile;
    a.y_stride = CPU_ARGMAX_CHUNK_ROWS;
    for (;;) {
        int b0 = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed) * j->chunk;
        if (b0 >= nb)
            return;
        int b1 = b0 + j->chunk < nb ? b0 + j->chunk : nb;
        a.y_row0 = b0 * CPU_BLOCK_ROWS;
        be->k->mm_blocks(&a, b0, b1);
        int r1 = b1 * CPU_BLOCK_ROWS < w->rows ? b1 * CPU_BLOCK_ROWS : w->rows;
        for (int t = 0; t < n; t++) {
            const float *row = tile + (size_t)t * CPU_ARGMAX_CHUNK_ROWS - a.y_row0;
            // The chunk's largest first (vectorised); its first index only
            // when it beats the best so far, which is rare after a few chunks.
            float cm = row_max(be, row + a.y_row0, r1 - a.y_row0);
            if (cm > best[t]) {
                int r = a.y_row0;
                while (!(row[r] == cm))
                    r++;
                best[t] = cm;
                idx[t] = r;
            }
        }
    }
}

static int cpu_matmul_argmax(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                             const float *x, int n, int32_t *ids)
{
    if (be->am_tiles == NULL) {
        size_t nt = (size_t)be->nthreads;
        be->am_tiles =
            alloc_aligned(nt * CPU_ARGMAX_CHUNK_ROWS * CPU_MM_CHUNK_TOKENS * sizeof(float));
        be->am_best = malloc(nt * CPU_MM_CHUNK_TOKENS * sizeof(float));
        be->am_idx = malloc(nt * CPU_MM_CHUNK_TOKENS * sizeof(int32_t));
        if (!be->am_tiles || !be->am_best || !be->am_idx) {
            free(be->am_tiles), free(be->am_best), free(be->am_idx);
            be->am_tiles = be->am_best = NULL;
            be->am_idx = NULL;
            return TDM_ENOMEM;
        }
    }
    for (int t0 = 0; t0 < n; t0 += CPU_MM_CHUNK_TOKENS) {
        int nc = n - t0 < CPU_MM_CHUNK_TOKENS ? n - t0 : CPU_MM_CHUNK_TOKENS;
        struct mm_job j;
        mm_job_init(&j, be, w, bias, x, t0, nc);
        j.chunk = CPU_ARGMAX_CHUNK_BLOCKS;
        mm_prep(be, &j);
        cpu_pool_run(be->pool, mm_argmax_task, &j);
        for (int t = 0; t < nc; t++) {
            float bv = -INFINITY;
            int32_t bi = -1;
            for (int th = 0; th < be->nthreads; th++) {
                float v = be->am_best[(size_t)th * CPU_MM_CHUNK_TOKENS + t];
                int32_t i = be->am_idx[(size_t)th * CPU_MM_CHUNK_TOKENS + t];
                if (i >= 0 && (v > bv || (v == bv && i < bi) || bi < 0)) {
                    bv = v;
                    bi = i;
                }
            }
            ids[t0 + t] = bi < 0 ? 0 : bi;
        }
    }
    return TDM_OK;
}

static void cpu_matmul(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                       const void *xv, float *y, int n)
{
    const float *x = xv; // the CPU's matmul-input format is f32
    for (int t0 = 0; t0 < n; t0 += CPU_MM_CHUNK_TOKENS) {
        int nc = n - t0 < CPU_MM_CHUNK_TOKENS ? n - t0 : CPU_MM_CHUNK_TOKENS;
        struct mm_job j;
        mm_job_init(&j, be, w, bias, x, t0, nc);
        j.a.y = y + (size_t)t0 * w->rows;
        // Decode of a large weight: chunks of ~1/4 of a thread's share keep
        // the weight streams long yet balance a loaded machine. Small weights
        // and batches: one contiguous chunk per thread (a small weight's
        // stream is short already; a batch prefetches each next block while
        // the one before computes).
        int nb = cpu_w_blocks(w);
        j.chunk =
            nc == 1 && nb >= 64 ? nb / (be->nthreads * 4) : (nb + be->nthreads - 1) / be->nthreads;
        if (j.chunk < 1)
            j.chunk = 1;
        mm_prep(be, &j);
        cpu_pool_run(be->pool, mm_task, &j);
    }
}

// ---- matmul fused with SwiGLU (the MLP's gate and up projection) -----------------------------
// Each task multiplies one block of gate rows and the matching block of up
// rows for the chunk's tokens into its thread's two tiles (128 KiB each at
// 512 tokens, in L2), then writes silu(gate) * up of them: the product
// [n][2 * inter] (20 MB at 512 tokens of Qwen2.5-0.5B) is never stored to
// memory and read back. Bits: each tile element is cpu_matmul's (which task
// computes a block never changes them) and silu_mul_row is element-wise, so
// out is what matmul then silu_mul give.
#define CPU_SILU_TILE ((size_t)CPU_MM_CHUNK_TOKENS * CPU_BLOCK_ROWS)

struct silu_job {
    struct mm_job mm;
    float *out; // [n][inter], the chunk's first token
    int inter;
};

static void mm_silu_task(void *arg, int tid, int nthreads)
{
    (void)nthreads;
    struct silu_job *j = arg;
    struct tdm_backend *be = j->mm.be;
    int nb = j->inter / CPU_BLOCK_ROWS; // gate blocks; up block b is nb + b
    float *gt = be->sm_tiles + (size_t)tid * 2 * CPU_SILU_TILE, *ut = gt + CPU_SILU_TILE;
    struct cpu_mm_args g = j->mm.a, u = j->mm.a;
    g.y = gt;
    u.y = ut;
    g.y_stride = u.y_stride = CPU_BLOCK_ROWS;
    for (;;) {
        int b = atomic_fetch_add_explicit(&j->mm.next, 1, memory_order_relaxed);
        if (b >= nb)
            return;
        g.y_row0 = b * CPU_BLOCK_ROWS;
        u.y_row0 = (nb + b) * CPU_BLOCK_ROWS;
        be->k->mm_blocks(&g, b, b + 1);
        be->k->mm_blocks(&u, nb + b, nb + b + 1);
        for (int t = 0; t < g.n; t++)
            be->k->silu_mul_row(gt + (size_t)t * CPU_BLOCK_ROWS, ut + (size_t)t * CPU_BLOCK_ROWS,
                                j->out + (size_t)t * j->inter + g.y_row0, CPU_BLOCK_ROWS);
    }
}

static bool cpu_matmul_silu_mul(struct tdm_backend *be, const struct tdm_weight *w, const void *xv,
                                void *outv, int n)
{
    // Whole blocks of gate rows only (then up's blocks start at a block too).
    if (n < CPU_SILU_FUSE_MIN_TOKENS || w->rows % (2 * CPU_BLOCK_ROWS) != 0)
        return false;
    if (be->sm_tiles == NULL &&
        !(be->sm_tiles = alloc_aligned((size_t)be->nthreads * 2 * CPU_SILU_TILE * sizeof(float))))
        return false; // the two ops need no more memory
    const float *x = xv;
    int inter = w->rows / 2;
    for (int t0 = 0; t0 < n; t0 += CPU_MM_CHUNK_TOKENS) {
        int nc = n - t0 < CPU_MM_CHUNK_TOKENS ? n - t0 : CPU_MM_CHUNK_TOKENS;
        struct silu_job j = {.out = (float *)outv + (size_t)t0 * inter, .inter = inter};
        mm_job_init(&j.mm, be, w, NULL, x, t0, nc);
        mm_prep(be, &j.mm);
        cpu_pool_run(be->pool, mm_silu_task, &j);
    }
    return true;
}

// ---- embed
// ---------------------------------------------------------------------------------------
static void cpu_embed(struct tdm_backend *be, const struct tdm_weight *w, const int32_t *ids, int n,
                      float *out)
{
    (void)be;
    const uint8_t *d = w->data;
    for (int i = 0; i < n; i++) {
        float *o = out + (size_t)i * w->cols;
        int r = ids[i];
        if (r < 0 || r >= w->rows) {
            // Token ids are validated by the model; never read out of bounds.
            TDM_LOG_ERR("cpu", "embed: token id %d outside [0, %d)", r, w->rows);
            memset(o, 0, sizeof(float) * (size_t)w->cols);
            continue;
        }
        for (int k = 0; k < w->cols; k++) {
            size_t off = packed_offset(w, r, k);
            if (w->type == TDM_W_BF16) {
                uint16_t h;
                memcpy(&h, d + off, 2);
                o[k] = cpu_bf16_to_f32(h);
            } else if (w->type == TDM_W_Q8) {
                o[k] = (float)(int8_t)d[off] * w->scales[r];
            } else {
                memcpy(&o[k], d + off, 4);
            }
        }
    }
}

// ---- row-wise ops
// --------------------------------------------------------------------------------
struct rows_job {
    const float *x;
    const float *y;
    const float *weight;
    float *out;
    float eps;
    int n, dim;
    const struct cpu_kernels *k;
};

// Fixed-order sum of squares: 8 interleaved partial sums, combined pairwise.
static float sum_squares(const float *x, int dim)
{
    float s[8] = {0};
    int i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int l = 0; l < 8; l++)
            s[l] += x[i + l] * x[i + l];
    for (int l = 0; i < dim; i++, l++)
        s[l] += x[i] * x[i];
    return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

static void rmsnorm_row(const float *x, const float *weight, float eps, float *o, int dim)
{
    float inv = 1.0f / sqrtf(sum_squares(x, dim) / (float)dim + eps);
    for (int i = 0; i < dim; i++)
        o[i] = x[i] * inv * weight[i];
}

static void rmsnorm_task(void *arg, int tid, int nthreads)
{
    struct rows_job *j = arg;
    int t0, t1;
    split_range(j->n, tid, nthreads, &t0, &t1);
    for (int t = t0; t < t1; t++)
        rmsnorm_row(j->x + (size_t)t * j->dim, j->weight, j->eps, j->out + (size_t)t * j->dim,
                    j->dim);
}

// add_rmsnorm: x += y row by row, then the row's rmsnorm, while the row is
// in L1 (one pass and one fork/join instead of two); the same operations as
// add then rmsnorm, so the same bits.
struct add_norm_job {
    float *x;
    const float *y, *weight;
    float *out;
    float eps;
    int n, dim;
};

static void add_rmsnorm_task(void *arg, int tid, int nthreads)
{
    struct add_norm_job *j = arg;
    int t0, t1;
    split_range(j->n, tid, nthreads, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        float *x = j->x + (size_t)t * j->dim;
        const float *y = j->y + (size_t)t * j->dim;
        for (int i = 0; i < j->dim; i++)
            x[i] += y[i];
        rmsnorm_row(x, j->weight, j->eps, j->out + (size_t)t * j->dim, j->dim);
    }
}

static void cpu_add_rmsnorm(struct tdm_backend *be, float *x, const float *y, const float *weight,
                            float eps, void *outv, int n, int dim)
{
    struct add_norm_job j = {
        .x = x, .y = y, .weight = weight, .out = outv, .eps = eps, .n = n, .dim = dim};
    if ((size_t)n * dim < 32768)
        add_rmsnorm_task(&j, 0, 1);
    else
        cpu_pool_run(be->pool, add_rmsnorm_task, &j);
}

static void cpu_rmsnorm(struct tdm_backend *be, const float *x, const float *weight, float eps,
                        void *outv, int n, int dim)
{
    float *out = outv;
    struct rows_job j = {.x = x, .weight = weight, .out = out, .eps = eps, .n = n, .dim = dim};
    if ((size_t)n * dim < 32768)
        rmsnorm_task(&j, 0, 1);
    else
        cpu_pool_run(be->pool, rmsnorm_task, &j);
}

// The cos and sin of one position's angles: HF computes the angle in f32
// (pos * inv_freq) and its cos/sin; we take that f32 angle and evaluate
// cos/sin in double, rounded once. cs: [half] cos, then [half] sin.
static void rope_angles(float *cs, int half, int32_t pos, const float *inv_freq)
{
    for (int i = 0; i < half; i++) {
        float ang = (float)pos * inv_freq[i];
        cs[i] = (float)cos((double)ang);
        cs[half + i] = (float)sin((double)ang);
    }
}

static void rope_row(float *x, int n_heads, int head_dim, const float *cs)
{
    int half = head_dim / 2;
    const float *c = cs, *s = cs + half;
    for (int h = 0; h < n_heads; h++) {
        float *v = x + (size_t)h * head_dim;
        for (int i = 0; i < half; i++) {
            float x1 = v[i], x2 = v[i + half];
            v[i] = x1 * c[i] - x2 * s[i];
            v[i + half] = x2 * c[i] + x1 * s[i];
        }
    }
}

struct rope_job {
    float *x;
    int n, row_stride, n_heads, head_dim;
    const int32_t *pos;
    const float *inv_freq;
    float *cs; // [n][head_dim] cos/sin per token; NULL: computed per row on the stack
    bool fill; // compute the table's rows (a new table) before using them
};

// Half head_dims rope_task's stack row holds; a wider head takes the table.
#define CPU_ROPE_LOCAL_HALF 512

static void rope_task(void *arg, int tid, int nthreads)
{
    struct rope_job *j = arg;
    int t0, t1, half = j->head_dim / 2;
    split_range(j->n, tid, nthreads, &t0, &t1);
    float local[2 * CPU_ROPE_LOCAL_HALF]; // without a table: half <= this (cpu_rope)
    for (int t = t0; t < t1; t++) {
        float *cs = j->cs ? j->cs + (size_t)t * 2 * half : local;
        if (!j->cs || j->fill)
            rope_angles(cs, half, j->pos[t], j->inv_freq);
        rope_row(j->x + (size_t)t * j->row_stride, j->n_heads, j->head_dim, cs);
    }
}

// The table of the call's positions: the last one when the positions and
// inv_freq values are the same (*fill false), else the buffers grown and
// marked for filling (*fill true); NULL when they cannot grow (the caller
// then computes the angles per row).
static float *rope_table(struct tdm_backend *be, const int32_t *pos, int n, int half,
                         const float *inv_freq, bool *fill)
{
    *fill = false;
    if (be->rope_n == n && be->rope_half == half &&
        memcmp(be->rope_pos, pos, sizeof(int32_t) * (size_t)n) == 0 &&
        memcmp(be->rope_inv, inv_freq, sizeof(float) * (size_t)half) == 0)
        return be->rope_cs;
    be->rope_n = be->rope_half = 0;
    if ((size_t)n > be->rope_cap || (size_t)half > be->rope_half_cap) {
        size_t cap = (size_t)n > be->rope_cap ? (size_t)n : be->rope_cap;
        size_t hcap = (size_t)half > be->rope_half_cap ? (size_t)half : be->rope_half_cap;
        float *cs = malloc(sizeof(float) * cap * 2 * hcap);
        int32_t *p = malloc(sizeof(int32_t) * cap);
        float *inv = malloc(sizeof(float) * hcap);
        if (!cs || !p || !inv) {
            free(cs), free(p), free(inv);
            return NULL;
        }
        free(be->rope_cs), free(be->rope_pos), free(be->rope_inv);
        be->rope_cs = cs, be->rope_pos = p, be->rope_inv = inv;
        be->rope_cap = cap, be->rope_half_cap = hcap;
    }
    memcpy(be->rope_pos, pos, sizeof(int32_t) * (size_t)n);
    memcpy(be->rope_inv, inv_freq, sizeof(float) * (size_t)half);
    be->rope_n = n, be->rope_half = half;
    *fill = true;
    return be->rope_cs;
}

static void cpu_rope(struct tdm_backend *be, float *x, int n, int row_stride, int n_heads,
                     int head_dim, const int32_t *pos, const float *inv_freq)
{
    struct rope_job j = {.x = x,
                         .n = n,
                         .row_stride = row_stride,
                         .n_heads = n_heads,
                         .head_dim = head_dim,
                         .pos = pos,
                         .inv_freq = inv_freq};
    // The layers of a forward rotate the same positions: their angles are
    // computed once (the table), the same values as per call. A head wider
    // than rope_task's stack row always takes the table.
    const bool wide = head_dim / 2 > CPU_ROPE_LOCAL_HALF;
    if (n >= 4 || wide)
        j.cs = rope_table(be, pos, n, head_dim / 2, inv_freq, &j.fill);
    if (wide && !j.cs) {
        TDM_LOG_ERR("cpu", "rope: out of memory for the cos/sin table of head_dim %d", head_dim);
        return;
    }
    if (n < 4)
        rope_task(&j, 0, 1);
    else
        cpu_pool_run(be->pool, rope_task, &j);
}

static void silu_task(void *arg, int tid, int nthreads)
{
    struct rows_job *j = arg;
    int t0, t1;
    split_range(j->n, tid, nthreads, &t0, &t1);
    for (int t = t0; t < t1; t++) {
        const float *gu = j->x + (size_t)t * 2 * j->dim;
        j->k->silu_mul_row(gu, gu + j->dim, j->out + (size_t)t * j->dim, j->dim);
    }
}

static void cpu_silu_mul(struct tdm_backend *be, const float *gate_up, void *outv, int n, int inter)
{
    float *out = outv;
    struct rows_job j = {.x = gate_up, .out = out, .n = n, .dim = inter, .k = be->k};
    if (n == 1) {
        // One decode row costs less than a fork/join.
        be->k->silu_mul_row(gate_up, gate_up + inter, out, inter);
    } else {
        cpu_pool_run(be->pool, silu_task, &j);
    }
}

struct add_job {
    float *x;
    const float *y;
    size_t count;
};

static void add_task(void *arg, int tid, int nthreads)
{
    struct add_job *j = arg;
    size_t lo = j->count * (size_t)tid / (size_t)nthreads;
    size_t hi = j->count * (size_t)(tid + 1) / (size_t)nthreads;
    for (size_t i = lo; i < hi; i++)
        j->x[i] += j->y[i];
}

static void cpu_add(struct tdm_backend *be, float *x, const float *y, size_t count)
{
    struct add_job j = {.x = x, .y = y, .count = count};
    if (count < 65536)
        add_task(&j, 0, 1);
    else
        cpu_pool_run(be->pool, add_task, &j);
}

// ---- KV cache and attention
// ------------------------------------------------------------------------
// The KV pool is f32 or bf16 (tdm_kv_dtype); bf16 rows are rounded to nearest
// even on the way in (tdm_f32_to_bf16, as the CUDA backend's KV store).
static void cpu_kv_store(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                         const struct tdm_attn_seq *seqs, int n_seqs, const float *k,
                         const float *v, int stride)
{
    (void)be;
    const struct tdm_kv_config *c = tdm_kv_config(kv);
    int bs = c->block_size, hd = c->head_dim;
    bool bf16 = tdm_kv_dtype(kv) == TDM_KV_BF16;
    for (int s = 0; s < n_seqs; s++) {
        for (int i = 0; i < seqs[s].n_tokens; i++) {
            int pos = seqs[s].start_pos + i;
            int blk = seqs[s].block_table[pos / bs];
            int slot = pos % bs;
            const float *kr = k + (size_t)(seqs[s].row + i) * stride;
            const float *vr = v + (size_t)(seqs[s].row + i) * stride;
            void *kb = bf16 ? (void *)tdm_kv_k_bf16(kv, layer, blk) : (void *)tdm_kv_k(kv, layer, blk);
            void *vb = bf16 ? (void *)tdm_kv_v_bf16(kv, layer, blk) : (void *)tdm_kv_v(kv, layer, blk);
            if (!kb || !vb) {
                // The model builds block tables from the kv module; never write
                // through a bad one.
                TDM_LOG_ERR("cpu", "kv_store: layer %d block %d out of range", layer, blk);
                continue;
            }
            for (int h = 0; h < c->num_kv_heads; h++) {
                size_t off = ((size_t)h * bs + slot) * hd;
                if (bf16) {
                    tdm_kv_convert((uint16_t *)kb + off, TDM_KV_BF16, kr + (size_t)h * hd,
                                   TDM_KV_F32, (size_t)hd);
                    tdm_kv_convert((uint16_t *)vb + off, TDM_KV_BF16, vr + (size_t)h * hd,
                                   TDM_KV_F32, (size_t)hd);
                } else {
                    memcpy((float *)kb + off, kr + (size_t)h * hd, sizeof(float) * (size_t)hd);
                    memcpy((float *)vb + off, vr + (size_t)h * hd, sizeof(float) * (size_t)hd);
                }
            }
        }
    }
}

// Largest head_dim whose bf16 key chunk is widened into a stack buffer once
// per group; a larger one uses the scores kernel that widens as it reads.
#define ATTN_WIDEN_MAX_HD 256
// A span's chunks are scored one by one, then rescaled, exponentiated and
// accumulated together, the accumulators staying in registers for the whole
// span.

// attn_query's steps, inlined into it: its hot loop stays one function.
#define ATTN_INLINE static inline __attribute__((always_inline))

// The next chunk's keys and values, prefetched a share after each head.
struct attn_prefetch {
    const uint8_t *k, *v; // NULL: nothing to prefetch
    size_t len;           // bytes of each
    size_t share;         // bytes per head, whole lines
};

// Block blk's keys and values of layer j->layer in the pool's dtype; false
// when blk is out of range.
ATTN_INLINE bool attn_block(const struct cpu_attn_job *j, int blk, const void **kb, const void **vb)
{
    if (j->bf16)
        *kb = tdm_kv_k_bf16(j->kv, j->layer, blk), *vb = tdm_kv_v_bf16(j->kv, j->layer, blk);
    else
        *kb = tdm_kv_k(j->kv, j->layer, blk), *vb = tdm_kv_v(j->kv, j->layer, blk);
    return *kb && *vb;
}

// The chunk that starts at position pos, split over nh heads' shares.
ATTN_INLINE struct attn_prefetch attn_prefetch_at(const struct cpu_attn_job *j,
                                                  const struct tdm_attn_seq *sq, int pos, int kvh,
                                                  int nh)
{
    struct attn_prefetch pf = {NULL, NULL, 0, 0};
    int bs = j->block_size, hd = j->head_dim;
    int nblk = sq->block_table[pos / bs], nslot = pos % bs;
    int nn = bs - nslot < CPU_ATTN_CHUNK ? bs - nslot : CPU_ATTN_CHUNK;
    size_t es = j->bf16 ? 2 : 4, noff = ((size_t)kvh * bs + nslot) * hd * es;
    const uint8_t *nk_p = j->bf16 ? (const uint8_t *)tdm_kv_k_bf16(j->kv, j->layer, nblk)
                                  : (const uint8_t *)tdm_kv_k(j->kv, j->layer, nblk);
    const uint8_t *nv_p = j->bf16 ? (const uint8_t *)tdm_kv_v_bf16(j->kv, j->layer, nblk)
                                  : (const uint8_t *)tdm_kv_v(j->kv, j->layer, nblk);
    if (nk_p && nv_p) {
        pf.k = nk_p + noff, pf.v = nv_p + noff;
        pf.len = (size_t)nn * hd * es;
        pf.share = (pf.len / 64 + (size_t)nh - 1) / (size_t)nh * 64;
    }
    return pf;
}

// Scores one chunk of nk keys (kb + off) for the nh query heads q into
// s[g][n..n+nk), raising each head's span max mc[g]; kw: the widening buffer.
ATTN_INLINE void attn_score_chunk(const struct cpu_attn_job *j, const float *q, const void *kb,
                                  size_t off, int nk, int nh, bool widened, float *kw,
                                  float (*s)[CPU_ATTN_SPAN], int n, float *mc,
                                  const struct attn_prefetch *pf)
{
    int hd = j->head_dim;
    // A bf16 key chunk is widened once for the whole group (exactly:
    // the f32 kernel then computes what the bf16 kernel would, bit
    // for bit), so the group's heads do not each widen it again.
    const float *kc = (const float *)kb + off;
    if (widened) {
        j->k->widen_bf16((const uint16_t *)kb + off, kw, (size_t)nk * hd);
        kc = kw;
    }
    // Head by head: the heads are independent, so the CPU overlaps
    // one head's dependency chain with the next's.
    for (int g = 0; g < nh; g++) {
        float mx = j->bf16 && !widened
                       ? j->k->attn_scores_bf16(q + (size_t)g * hd, (const uint16_t *)kb + off, nk,
                                                hd, j->scale, s[g] + n)
                       : j->k->attn_scores(q + (size_t)g * hd, kc, nk, hd, j->scale, s[g] + n);
        mc[g] = mx > mc[g] ? mx : mc[g];
        size_t b1 = (size_t)(g + 1) * pf->share < pf->len ? (size_t)(g + 1) * pf->share : pf->len;
        for (size_t b = (size_t)g * pf->share; b < b1; b += 64) {
            __builtin_prefetch(pf->k + b);
            __builtin_prefetch(pf->v + b);
        }
    }
}

// The online softmax's step over a span of n scores: each head's new max,
// the correction corr[g] of what it accumulated so far, its scores
// exponentiated in place and its running sum l[g].
ATTN_INLINE void attn_span_softmax(const struct cpu_attn_job *j, float (*s)[CPU_ATTN_SPAN], int n,
                                   int nh, const float *mc, float *m, float *l, float *corr)
{
    for (int g = 0; g < nh; g++) {
        float m_new = mc[g] > m[g] ? mc[g] : m[g];
        corr[g] = m[g] == -INFINITY ? 0.0f : expf(m[g] - m_new);
        // The span's sum in a fixed order: chunk sums of 16, in turn.
        float sum = 0.0f;
        for (int o = 0; o < n; o += CPU_ATTN_CHUNK)
            sum += j->k->attn_exp(s[g] + o, n - o < CPU_ATTN_CHUNK ? n - o : CPU_ATTN_CHUNK, m_new);
        l[g] = l[g] * corr[g] + sum;
        m[g] = m_new;
    }
}

// acc = acc * corr + the span's weights times its value rows, run by run.
ATTN_INLINE void attn_span_accum(const struct cpu_attn_job *j, float *acc, const float *corr,
                                 float (*s)[CPU_ATTN_SPAN], const void *const *vrun,
                                 const int *nrun_keys, int nrun, int nh)
{
    int hd = j->head_dim;
    if (j->k->attn_accum_span) {
        j->k->attn_accum_span(acc, corr, &s[0][0], CPU_ATTN_SPAN, vrun, nrun_keys, nrun, j->bf16,
                              nh, hd);
        return;
    }
    for (int g = 0; g < nh; g++)
        for (int r = 0, o = 0; r < nrun; o += nrun_keys[r], r++) {
            float c = r == 0 ? corr[g] : 1.0f;
            if (j->bf16)
                j->k->attn_accum_bf16(acc + (size_t)g * hd, c, s[g] + o, (const uint16_t *)vrun[r],
                                      nrun_keys[r], hd);
            else
                j->k->attn_accum(acc + (size_t)g * hd, c, s[g] + o, (const float *)vrun[r],
                                 nrun_keys[r], hd);
        }
}

// One query row, heads h0..h0+nh-1 (all on KV head kvh): online softmax over
// positions 0..p in spans of CPU_ATTN_SPAN aligned positions, each scored in
// chunks of at most CPU_ATTN_CHUNK that never cross a block or a span, so the
// chunking (and each head's result) depends on p only, never on how the
// prompt was split into steps or which heads share the pass.
static void attn_query(const struct cpu_attn_job *j, const struct tdm_attn_seq *sq, int i, int kvh,
                       int h0, int nh)
{
    int hd = j->head_dim, bs = j->block_size;
    int p = sq->start_pos + i;
    const float *q = j->q + (size_t)(sq->row + i) * j->q_stride + (size_t)h0 * hd;
    float *acc = j->out + (size_t)(sq->row + i) * j->n_heads * hd + (size_t)h0 * hd;
    float s[CPU_ATTN_MAX_GROUP][CPU_ATTN_SPAN];
    float m[CPU_ATTN_MAX_GROUP], l[CPU_ATTN_MAX_GROUP];
    // The span's value rows, run by run (a run never crosses a block).
    const void *vrun[CPU_ATTN_SPAN];
    int nrun_keys[CPU_ATTN_SPAN];
    // One bf16 key chunk widened: 16 KiB of stack at most.
    float kw[CPU_ATTN_CHUNK * ATTN_WIDEN_MAX_HD] __attribute__((aligned(64)));
    bool widened = j->bf16 && hd <= ATTN_WIDEN_MAX_HD;
    for (int g = 0; g < nh; g++)
        m[g] = -INFINITY, l[g] = 0.0f;
    memset(acc, 0, sizeof(float) * (size_t)hd * nh);
    for (int pos = 0; pos <= p;) {
        int span_end = (pos / CPU_ATTN_SPAN + 1) * CPU_ATTN_SPAN;
        if (span_end > p + 1)
            span_end = p + 1;
        float mc[CPU_ATTN_MAX_GROUP], corr[CPU_ATTN_MAX_GROUP];
        for (int g = 0; g < nh; g++)
            mc[g] = -INFINITY;
        int n = 0, nrun = 0;
        while (pos < span_end) {
            int blk = sq->block_table[pos / bs];
            int slot = pos % bs;
            int nk = bs - slot;
            if (nk > CPU_ATTN_CHUNK)
                nk = CPU_ATTN_CHUNK;
            if (nk > span_end - pos)
                nk = span_end - pos;
            size_t off = ((size_t)kvh * bs + slot) * hd;
            const void *kb, *vb;
            if (!attn_block(j, blk, &kb, &vb)) {
                TDM_LOG_ERR("cpu", "attention: layer %d block %d out of range", j->layer, blk);
                memset(acc, 0, sizeof(float) * (size_t)hd * nh);
                return;
            }
            // The next chunk's keys and values (another block, usually another
            // page, which the hardware prefetcher does not cross to) are
            // prefetched while this chunk is scored, a share after each head:
            // all 64 lines at once filled the core's miss buffers and stalled
            // it on the prefetches themselves, with nothing computing meanwhile.
            struct attn_prefetch pf = {NULL, NULL, 0, 0};
            if (pos + nk <= p)
                pf = attn_prefetch_at(j, sq, pos + nk, kvh, nh);
            attn_score_chunk(j, q, kb, off, nk, nh, widened, kw, s, n, mc, &pf);
            vrun[nrun] = j->bf16 ? (const void *)((const uint16_t *)vb + off)
                                 : (const void *)((const float *)vb + off);
            nrun_keys[nrun++] = nk;
            n += nk;
            pos += nk;
        }
        attn_span_softmax(j, s, n, nh, mc, m, l, corr);
        attn_span_accum(j, acc, corr, s, vrun, nrun_keys, nrun, nh);
    }
    for (int g = 0; g < nh; g++) {
        float inv = 1.0f / l[g];
        for (int d = 0; d < hd; d++)
            acc[(size_t)g * hd + d] *= inv;
    }
}

// Tasks of a sequence: (head unit, token chunk), a head unit being up to
// CPU_ATTN_MAX_GROUP query heads of one KV head.
static int attn_units(const struct cpu_attn_job *j)
{
    int group = j->n_heads / j->n_kv_heads;
    return j->n_kv_heads * ((group + CPU_ATTN_MAX_GROUP - 1) / CPU_ATTN_MAX_GROUP);
}

static void attn_task(void *arg, int tid, int nthreads)
{
    (void)nthreads;
    struct cpu_attn_job *j = arg;
    int total = j->task_start[j->n_seqs];
    int group = j->n_heads / j->n_kv_heads;
    int nsub = (group + CPU_ATTN_MAX_GROUP - 1) / CPU_ATTN_MAX_GROUP;
    for (;;) {
        int t = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (t >= total)
            return;
        int s = 0;
        while (j->task_start[s + 1] <= t)
            s++;
        const struct tdm_attn_seq *sq = &j->seqs[s];
        int local = t - j->task_start[s];
        int chunks = (sq->n_tokens + CPU_ATTN_TASK_TOKENS - 1) / CPU_ATTN_TASK_TOKENS;
        int unit = local / chunks;
        int c = local % chunks;
        int kvh = unit / nsub;
        int h0 = kvh * group + (unit % nsub) * CPU_ATTN_MAX_GROUP;
        int nh = kvh * group + group - h0 < CPU_ATTN_MAX_GROUP ? kvh * group + group - h0
                                                               : CPU_ATTN_MAX_GROUP;
        int i1 = (c + 1) * CPU_ATTN_TASK_TOKENS < sq->n_tokens ? (c + 1) * CPU_ATTN_TASK_TOKENS
                                                               : sq->n_tokens;
        if (j->tile_scratch) {
            j->k->attn_tile(j, sq, c * CPU_ATTN_TASK_TOKENS, i1, kvh, h0, nh,
                            j->tile_scratch + (size_t)tid * cpu_attn_tile_scratch(j->head_dim));
            continue;
        }
        for (int i = c * CPU_ATTN_TASK_TOKENS; i < i1; i++)
            attn_query(j, sq, i, kvh, h0, nh);
    }
}

// Sequences per attention call whose task table lives on the stack; larger
// batches run in groups of this many.
#define ATTN_MAX_SEQS 256

static void cpu_attention(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                          const struct tdm_attn_seq *seqs, int n_seqs, const float *q, int q_stride,
                          void *outv, int n_heads, int n_kv_heads, int head_dim, float scale)
{
    float *out = outv;
    if (n_kv_heads < 1 || n_heads % n_kv_heads != 0 || head_dim < 2) {
        TDM_LOG_ERR("cpu", "attention: bad heads %d/%d or head_dim %d", n_heads, n_kv_heads,
                    head_dim);
        return;
    }
    // The tile kernel's scratch (the AMX path, bf16 pools), grown on use;
    // without it the per-query kernels run, as they do for an f32 pool (the
    // choice of f32 attention) and a head_dim above the tiles' limit.
    uint8_t *tile_scratch = NULL;
    if (be->k->attn_tile && head_dim <= CPU_ATTN_TILE_MAX_HD && tdm_kv_dtype(kv) == TDM_KV_BF16) {
        size_t need = (size_t)be->nthreads * cpu_attn_tile_scratch(head_dim);
        if (need > be->attn_scratch_bytes) {
            uint8_t *p = alloc_aligned(need);
            if (p) {
                free(be->attn_scratch);
                be->attn_scratch = p, be->attn_scratch_bytes = need;
            }
        }
        if (need <= be->attn_scratch_bytes)
            tile_scratch = be->attn_scratch;
        else
            TDM_LOG_ERR("cpu", "attention: no memory for the tile kernel's scratch (%zu bytes)",
                        need);
    }
    int task_start[ATTN_MAX_SEQS + 1];
    for (int s0 = 0; s0 < n_seqs; s0 += ATTN_MAX_SEQS) {
        int ns = n_seqs - s0 < ATTN_MAX_SEQS ? n_seqs - s0 : ATTN_MAX_SEQS;
        struct cpu_attn_job j = {.kv = kv,
                                 .k = be->k,
                                 .layer = layer,
                                 .seqs = seqs + s0,
                                 .n_seqs = ns,
                                 .q = q,
                                 .q_stride = q_stride,
                                 .out = out,
                                 .n_heads = n_heads,
                                 .n_kv_heads = n_kv_heads,
                                 .head_dim = head_dim,
                                 .scale = scale,
                                 .block_size = tdm_kv_config(kv)->block_size,
                                 .bf16 = tdm_kv_dtype(kv) == TDM_KV_BF16,
                                 .task_start = task_start,
                                 .tile_scratch = tile_scratch};
        atomic_init(&j.next, 0);
        int units = attn_units(&j);
        task_start[0] = 0;
        for (int s = 0; s < ns; s++) {
            int chunks = (seqs[s0 + s].n_tokens + CPU_ATTN_TASK_TOKENS - 1) / CPU_ATTN_TASK_TOKENS;
            task_start[s + 1] = task_start[s] + chunks * units;
        }
        if (task_start[ns] == 1)
            attn_task(&j, 0, 1);
        else
            cpu_pool_run(be->pool, attn_task, &j);
    }
}

// Backend memory is host memory: the copies are memcpy, nothing to stage.
static int cpu_upload(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memcpy(dst, src, bytes);
    return TDM_OK;
}

static int cpu_copy(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    (void)be;
    if (bytes)
        memmove(dst, src, bytes);
    return TDM_OK;
}

// The compute threads between forwards (the engine samples its rows on them).
static void cpu_host_parallel(struct tdm_backend *be, void (*fn)(void *arg, int tid, int nthreads),
                              void *arg)
{
    cpu_pool_run(be->pool, fn, arg);
}

const struct tdm_backend_ops tdm_cpu_backend_ops = {
    .name = "cpu",
    .host_memory = true,
    .upload = cpu_upload,
    .download = cpu_upload,
    .copy = cpu_copy,
    .create = cpu_create,
    .destroy = cpu_destroy,
    .prepare_weight = cpu_prepare_weight,
    .release_weight = cpu_release_weight,
    .layout_version = CPU_LAYOUT_VERSION,
    .weight_spans = cpu_weight_spans,
    .adopt_weight = cpu_adopt_weight,
    .alloc = cpu_alloc,
    .release = cpu_release,
    .matmul = cpu_matmul,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .add_rmsnorm = cpu_add_rmsnorm,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .silu_mul = cpu_silu_mul,
    .matmul_silu_mul = cpu_matmul_silu_mul,
    .add = cpu_add,
    .host_parallel = cpu_host_parallel,
    .matmul_argmax = cpu_matmul_argmax,
};
