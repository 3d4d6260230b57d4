// SPDX-License-Identifier: Apache-2.0
// The CUDA backend's kernels, op by op, against the CPU backend on the same
// inputs. Built twice from this file: cuda_ops_emu_test runs the kernels on
// the execution-model emulator (every CI run, label unit), cuda_ops_gpu_test
// on a GPU (label gpu; exit 77 = skipped where none is visible).
//
// Tolerances (absolute, on values of order 1; the emulator measures far less,
// see the printed maxima):
//   embed, kv_store, bf16 rounding: bitwise; a bf16 output (what feeds a
//     GEMM) is bitwise the kernel's f32 output rounded to nearest even; the
//     fused kernels (add + rmsnorm, rope + kv_store, rope + kv_store inside
//     the decode attention) are bitwise the separate ones;
//   rope: 1e-6 (both evaluate cos/sin of the same f32 angle in double);
//   rmsnorm, silu_mul, add: 1e-5 relative to the row's largest value (another
//     summation order; the GPU's expf is within 2 ulp);
//   attention: 2e-5 (another summation and exp order; with bf16 KV the CPU
//     side is given the same bf16-rounded K/V, so the tolerance is the same),
//     except the prefill with bf16 KV, on tensor cores with q and P rounded
//     to bf16: 1.5e-2 (MMA_TOL_CPU, derived there), and against a host
//     reference of its own arithmetic bitwise on the emulator (MMA_TOL_REF);
//   GEMM (bf16 in, f32 accumulate): 1e-4 relative to sum |w x|, against a
//     double-precision reference.
// Attention covers GQA groups 1, 2, 7, 8 and 12 (two decode blocks per KV
// head), head_dim 64 and 128, f32 and bf16
// KV, scattered (non-contiguous, permuted) block tables, a 37-token prefill
// (not a multiple of the 64-row tile or the 16-token block), chunked prefill
// at offsets 16 and 21, decodes at positions 5 and 300 (one and ten decode
// splits of 32) and a 1-token chunk, all in one launch; then batch invariance:
// a sequence attended alone gives bitwise the rows it got in the batch.
// test_decode_splits adds the decode kernel's split boundaries, GQA groups 1 to
// 12 and each sequence alone = in a batch, against the CPU backend too.
// test_prefill_mma: the tensor-core prefill at head_dim 16 to 128 (see
// run_prefill_mma_case), a prompt in ragged chunks = in one chunk, bitwise.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cpu_backend.h"
#include "cuda_dev.h"
#include "cuda_kernels.h"
#include "kv_cache.h"
#include "sample_draw.h"
#include "sampling.h"
#include "sanitizer.h"
#include "test_skip.h"
#ifndef TDM_CUDA_TEST_GPU
#include "emu/cuda_emu_api.h" // the launch log
#endif

// The real vocabulary's width in the device sampler's tests (Qwen2.5's 151 936
// columns: 149 chunks of TDM_CUK_ARGMAX_CHUNK, the last one partial) and a
// token in a middle chunk of it. Under AddressSanitizer the emulator runs a
// launch's threads one at a time, slowly: the two tests took 7.2 min of CI's
// ASan pass at the full width. There 20 000 columns (20 chunks, the last one
// partial) take every path the full width does: the chunk grid's first,
// middle and last chunks, every launch of the split path, every case and
// kind of row; only case 8's top_k 100 000 is cut to 0 there, as at the
// smaller widths (top_k 50 keeps the count walk). The release build's run of
// this test (CI's last step) keeps the full width, so whatever fails only at
// it still fails CI.
#if TDM_SANITIZE_ADDRESS && !defined(TDM_CUDA_TEST_GPU)
enum { SAMPLE_VOCAB = 20000, SAMPLE_MID = 9001 };
#else
enum { SAMPLE_VOCAB = 151936, SAMPLE_MID = 70001 };
#endif

static const struct tdm_backend_ops *cpu = &tdm_cpu_backend_ops;
static struct tdm_cuda_dev *dev;
static void *stream;

// ---- helpers -------------------------------------------------------------------------------
static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float frand(void) // uniform in [-1, 1)
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(rng_state >> 40) / (double)(1ull << 23) - 1.0);
}

static void fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand() * amp;
}

static uint16_t bf16_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float bf16_value(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float bf16_round(float f)
{
    return bf16_value(bf16_bits(f));
}

static void *to_dev(const void *host, size_t bytes)
{
    void *d = tdm_cuda_dev_alloc(dev, bytes);
    assert_non_null(d);
    assert_int_equal(tdm_cuda_dev_h2d(dev, d, host, bytes), TDM_OK);
    return d;
}

static void *dev_zeros(size_t bytes)
{
    void *d = tdm_cuda_dev_alloc(dev, bytes);
    assert_non_null(d);
    assert_int_equal(tdm_cuda_dev_memset(dev, d, 0, bytes), TDM_OK);
    return d;
}

// Scratch as a kernel may find it: what the last user left (here 0xA5 bytes),
// never zeroed for it.
static void *dev_garbage(size_t bytes)
{
    void *d = tdm_cuda_dev_alloc(dev, bytes);
    assert_non_null(d);
    assert_int_equal(tdm_cuda_dev_memset(dev, d, 0xA5, bytes), TDM_OK);
    return d;
}

static void from_dev(void *host, const void *d, size_t bytes)
{
    assert_int_equal(tdm_cuda_dev_sync(dev), TDM_OK);
    assert_int_equal(tdm_cuda_dev_d2h(dev, host, d, bytes), TDM_OK);
}

static void ok(int rc)
{
    if (rc != TDM_CUK_OK)
        fail_msg("launch failed: %s", tdm_cuk_errmsg());
}

static float max_abs(const float *x, size_t n)
{
    float m = 0.0f;
    for (size_t i = 0; i < n; i++)
        m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

// max |a - b|; fails (naming the first bad index) above tol.
static float check_close(const char *what, const float *a, const float *b, size_t n, float tol)
{
    float worst = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float e = fabsf(a[i] - b[i]);
        if (!(e <= tol))
            fail_msg("%s: element %zu: %.9g vs %.9g (tolerance %g)", what, i, a[i], b[i], tol);
        worst = e > worst ? e : worst;
    }
    return worst;
}

// The CPU reference computes attention in f32, as the CUDA kernels do: on an
// AMX host, whose best path runs attention on bf16 tiles (q, K, V and the
// softmax weights rounded; docs/cpu-backend.md), the reference takes the
// AVX-512 path (matmul activations rounded to bf16 as there, f32 attention).
// TANDEM_CPU_ISA, where set, still chooses.
static void cpu_reference_path(void)
{
    if (getenv("TANDEM_CPU_ISA") == NULL && tdm_cpu_isa_best() == TDM_CPU_ISA_AMX)
        setenv("TANDEM_CPU_ISA", "avx512", 1);
}

static struct tdm_backend *cpu_be(void)
{
    static struct tdm_backend *be;
    char err[256];
    if (be == NULL && cpu->create(&be, 1, 0, err, sizeof err) != TDM_OK)
        fail_msg("cpu backend: %s", err);
    return be;
}

// ---- element-wise and row-wise ops ----------------------------------------------------------
static void test_embed(void **state)
{
    (void)state;
    enum { ROWS = 37, COLS = 72, N = 6 };
    uint16_t table[ROWS * COLS];
    for (int i = 0; i < ROWS * COLS; i++)
        table[i] = bf16_bits(frand() * 2.0f);
    struct tdm_weight w;
    struct tdm_weight_src src = {.data = table, .dtype = TDM_DTYPE_BF16, .rows = ROWS};
    char err[256];
    assert_int_equal(cpu->prepare_weight(cpu_be(), &w, &src, 1, COLS, TDM_W_BF16, err, sizeof err),
                     TDM_OK);
    int32_t ids[N] = {0, 36, 5, 5, 17, 2};
    float want[N * COLS], got[N * COLS];
    cpu->embed(cpu_be(), &w, ids, N, want);

    uint16_t *d_table = to_dev(table, sizeof table);
    int32_t *d_ids = to_dev(ids, sizeof ids);
    float *d_out = dev_zeros(sizeof got);
    ok(tdm_cuk_embed(stream, d_table, ROWS, COLS, d_ids, N, d_out));
    from_dev(got, d_out, sizeof got);
    assert_memory_equal(got, want, sizeof got);

    // An id outside the table gives a zero row, never a read out of bounds.
    int32_t bad[2] = {ROWS, -1};
    assert_int_equal(tdm_cuda_dev_h2d(dev, d_ids, bad, sizeof bad), TDM_OK);
    ok(tdm_cuk_embed(stream, d_table, ROWS, COLS, d_ids, 2, d_out));
    from_dev(got, d_out, 2 * COLS * sizeof(float));
    for (int i = 0; i < 2 * COLS; i++)
        assert_true(got[i] == 0.0f);
    assert_int_equal(tdm_cuk_embed(stream, d_table, ROWS, COLS, d_ids, 0, d_out), TDM_CUK_EINVAL);

    cpu->release_weight(cpu_be(), &w);
    tdm_cuda_dev_free(dev, d_table);
    tdm_cuda_dev_free(dev, d_ids);
    tdm_cuda_dev_free(dev, d_out);
}

static void test_rmsnorm(void **state)
{
    (void)state;
    const int dims[] = {72, 896, 1000};
    enum { N = 5 };
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        int dim = dims[di];
        size_t count = (size_t)N * dim;
        float *x = malloc(count * sizeof *x), *wt = malloc((size_t)dim * sizeof *wt);
        float *want = malloc(count * sizeof *x), *got = malloc(count * sizeof *x);
        float *alone = malloc((size_t)dim * sizeof *x);
        fill(x, count, 3.0f);
        fill(wt, (size_t)dim, 1.5f);
        cpu->rmsnorm(cpu_be(), x, wt, 1e-6f, want, N, dim);
        float *d_x = to_dev(x, count * sizeof *x), *d_w = to_dev(wt, (size_t)dim * sizeof *wt);
        float *d_o = dev_zeros(count * sizeof *x);
        ok(tdm_cuk_add_rmsnorm(stream, d_x, NULL, d_w, 1e-6f, d_o, 0, N, dim));
        from_dev(got, d_o, count * sizeof *x);
        float e = check_close("rmsnorm", got, want, count, 1e-5f * max_abs(want, count));
        printf("rmsnorm dim %d: max error %g\n", dim, e);
        // Batch invariance: row 3 alone is bitwise row 3 of the batch.
        ok(tdm_cuk_add_rmsnorm(stream, d_x + 3 * dim, NULL, d_w, 1e-6f, d_o, 0, 1, dim));
        from_dev(alone, d_o, (size_t)dim * sizeof *x);
        assert_memory_equal(alone, got + 3 * dim, (size_t)dim * sizeof *x);
        // The GEMM input: bf16 out is the f32 out rounded to nearest even.
        uint16_t *bits = malloc(count * sizeof *bits);
        uint16_t *d_ob = dev_zeros(count * sizeof *bits);
        ok(tdm_cuk_add_rmsnorm(stream, d_x, NULL, d_w, 1e-6f, d_ob, 1, N, dim));
        from_dev(bits, d_ob, count * sizeof *bits);
        for (size_t i = 0; i < count; i++)
            assert_int_equal(bits[i], bf16_bits(got[i]));
        // The residual add fused: x + y, then the norm, is bitwise add then
        // rmsnorm, and x holds the sum after both.
        float *y = malloc(count * sizeof *y), *sum1 = malloc(count * sizeof *y);
        float *sum2 = malloc(count * sizeof *y), *fused = malloc(count * sizeof *y);
        fill(y, count, 2.0f);
        float *d_y = to_dev(y, count * sizeof *y), *d_x2 = to_dev(x, count * sizeof *x);
        ok(tdm_cuk_add(stream, d_x, d_y, count));
        ok(tdm_cuk_add_rmsnorm(stream, d_x, NULL, d_w, 1e-6f, d_o, 0, N, dim));
        from_dev(got, d_o, count * sizeof *x);
        from_dev(sum1, d_x, count * sizeof *x);
        ok(tdm_cuk_add_rmsnorm(stream, d_x2, d_y, d_w, 1e-6f, d_o, 0, N, dim));
        from_dev(fused, d_o, count * sizeof *x);
        from_dev(sum2, d_x2, count * sizeof *x);
        assert_memory_equal(fused, got, count * sizeof *x);
        assert_memory_equal(sum2, sum1, count * sizeof *x);
        // In place (out == x, f32).
        ok(tdm_cuk_add_rmsnorm(stream, d_x, NULL, d_w, 1e-6f, d_x, 0, N, dim));
        from_dev(alone, d_x, (size_t)dim * sizeof *x);
        assert_memory_equal(alone, got, (size_t)dim * sizeof *x);
        tdm_cuda_dev_free(dev, d_x), tdm_cuda_dev_free(dev, d_x2), tdm_cuda_dev_free(dev, d_y);
        tdm_cuda_dev_free(dev, d_w);
        tdm_cuda_dev_free(dev, d_o), tdm_cuda_dev_free(dev, d_ob);
        free(x), free(wt), free(want), free(got), free(alone), free(bits);
        free(y), free(sum1), free(sum2), free(fused);
    }
}

static void test_rope(void **state)
{
    (void)state;
    const int hds[] = {64, 128};
    enum { N = 6, HEADS = 3 + 1 };
    for (int hi = 0; hi < 2; hi++) {
        int hd = hds[hi];
        int stride = (3 + 2 * 1) * hd; // a qkv row: 3 q heads, k, v; rope rotates q and k
        size_t count = (size_t)N * stride;
        float *x = malloc(count * sizeof *x), *want = malloc(count * sizeof *x);
        float *got = malloc(count * sizeof *x), inv_freq[64];
        fill(x, count, 2.0f);
        memcpy(want, x, count * sizeof *x);
        for (int i = 0; i < hd / 2; i++)
            inv_freq[i] = (float)(1.0 / pow(1000000.0, (double)(2 * i) / hd));
        int32_t pos[N] = {0, 1, 17, 300, 4095, 32000};
        cpu->rope(cpu_be(), want, N, stride, HEADS, hd, pos, inv_freq);
        float *d_x = to_dev(x, count * sizeof *x), *d_f = to_dev(inv_freq, sizeof inv_freq);
        int32_t *d_pos = to_dev(pos, sizeof pos);
        ok(tdm_cuk_rope(stream, d_x, N, stride, HEADS, hd, d_pos, d_f));
        from_dev(got, d_x, count * sizeof *x);
        float e = check_close("rope", got, want, count, 1e-6f);
        printf("rope head_dim %d: max error %g\n", hd, e);
        // The v head (past HEADS) is untouched.
        for (int t = 0; t < N; t++)
            assert_memory_equal(got + (size_t)t * stride + HEADS * hd,
                                x + (size_t)t * stride + HEADS * hd, (size_t)hd * sizeof *x);
        assert_int_equal(tdm_cuk_rope(stream, d_x, N, stride, HEADS, 63, d_pos, d_f),
                         TDM_CUK_EINVAL);
        tdm_cuda_dev_free(dev, d_x);
        tdm_cuda_dev_free(dev, d_f);
        tdm_cuda_dev_free(dev, d_pos);
        free(x), free(want), free(got);
    }
}

static void test_silu_add_bf16(void **state)
{
    (void)state;
    enum { N = 4, INTER = 300, COUNT = 1001 };
    float gu[N * 2 * INTER], want[N * INTER], got[N * INTER];
    fill(gu, N * 2 * INTER, 6.0f);
    cpu->silu_mul(cpu_be(), gu, want, N, INTER);
    float *d_gu = to_dev(gu, sizeof gu), *d_o = dev_zeros(sizeof got);
    ok(tdm_cuk_silu_mul(stream, d_gu, d_o, 0, N, INTER));
    from_dev(got, d_o, sizeof got);
    printf("silu_mul: max error %g\n",
           check_close("silu_mul", got, want, N * INTER, 1e-5f * max_abs(want, N * INTER)));
    uint16_t act[N * INTER];
    ok(tdm_cuk_silu_mul(stream, d_gu, d_o, 1, N, INTER));
    from_dev(act, d_o, sizeof act);
    for (int i = 0; i < N * INTER; i++)
        assert_int_equal(act[i], bf16_bits(got[i]));

    float x[COUNT], y[COUNT], sum[COUNT];
    fill(x, COUNT, 4.0f);
    fill(y, COUNT, 4.0f);
    memcpy(want, x, sizeof x);
    cpu->add(cpu_be(), want, y, COUNT);
    float *d_x = to_dev(x, sizeof x), *d_y = to_dev(y, sizeof y);
    ok(tdm_cuk_add(stream, d_x, d_y, COUNT));
    from_dev(sum, d_x, sizeof sum);
    assert_memory_equal(sum, want, sizeof sum); // one rounded f32 add: exact everywhere
    tdm_cuda_dev_free(dev, d_gu), tdm_cuda_dev_free(dev, d_o);
    tdm_cuda_dev_free(dev, d_x), tdm_cuda_dev_free(dev, d_y);
}

// ---- GEMM ------------------------------------------------------------------------------------
// Each class's algorithm (cuda_dev.h) against a double reference, and its
// row 4 alone bitwise its row in the batch of 5 (on a GPU: cuBLASLt's
// algorithm of that class, fixed per weight shape, at n = 5 and 1, x offset
// by 4 rows).
static void gemm_class(enum tdm_cuda_gemm_class cls)
{
    enum { ROWS = 70, COLS = 67, N = 5 };
    uint16_t w[ROWS * COLS];
    float x[N * COLS], bias[ROWS], y[N * ROWS], y1[ROWS];
    for (int i = 0; i < ROWS * COLS; i++)
        w[i] = bf16_bits(frand());
    fill(x, N * COLS, 2.0f);
    fill(bias, ROWS, 1.0f);
    uint16_t *d_w = to_dev(w, sizeof w);
    uint16_t xb[N * COLS];
    for (int i = 0; i < N * COLS; i++)
        xb[i] = bf16_bits(x[i]); // the bf16 input the producing kernel writes
    float *d_b = to_dev(bias, sizeof bias);
    uint16_t *d_xb = to_dev(xb, sizeof xb);
    float *d_y = dev_zeros(sizeof y);
    assert_int_equal(tdm_cuda_dev_gemm_bf16(dev, d_w, ROWS, COLS, d_xb, N, d_b, d_y, cls), TDM_OK);
    from_dev(y, d_y, sizeof y);
    float worst = 0.0f;
    for (int t = 0; t < N; t++)
        for (int r = 0; r < ROWS; r++) {
            double ref = bias[r], mag = fabs(bias[r]);
            for (int k = 0; k < COLS; k++) {
                double p = (double)bf16_value(w[r * COLS + k]) * bf16_round(x[t * COLS + k]);
                ref += p;
                mag += fabs(p);
            }
            float e = (float)fabs(y[t * ROWS + r] - ref);
            if (e > 1e-4 * mag)
                fail_msg("gemm: y[%d][%d] = %.9g, reference %.9g", t, r, y[t * ROWS + r], ref);
            worst = e > worst ? e : worst;
        }
    printf("gemm (%s class): max error %g\n", cls == TDM_CUDA_GEMM_PROMPT ? "prompt" : "decode",
           worst);
    // Batch invariance: token 4 alone gives its row bitwise.
    assert_int_equal(
        tdm_cuda_dev_gemm_bf16(dev, d_w, ROWS, COLS, d_xb + 4 * COLS, 1, d_b, d_y, cls), TDM_OK);
    from_dev(y1, d_y, sizeof y1);
    assert_memory_equal(y1, y + 4 * ROWS, sizeof y1);
    tdm_cuda_dev_free(dev, d_w), tdm_cuda_dev_free(dev, d_b);
    tdm_cuda_dev_free(dev, d_xb), tdm_cuda_dev_free(dev, d_y);
}

static void test_gemm(void **state)
{
    (void)state;
    gemm_class(TDM_CUDA_GEMM_DECODE);
    gemm_class(TDM_CUDA_GEMM_PROMPT);
}

// ---- small-batch GEMM (tdm_cuk_gemv) ---------------------------------------------------------
// Against a double-precision reference, on ragged shapes (rows not a multiple
// of the 16-row tile, columns not a multiple of the 256-column span nor of a
// warp's 32 columns; the 0.5B model's K of 896 and 4864), with and without
// bias, at n = 1 .. 16 (one mma half and two); and each row of every batch
// bitwise the row computed alone (shapes of 264 CTAs or more, which the
// emulator runs slowly: n = 3 and 16, rows 0, 2 and 15 alone); row 15 alone
// is the last row of x's allocation, so a kernel that loads the decode rows
// past n (the mma's padding columns) reads outside it (ASan). Tolerance: 2e-5
// of sum |w x| + |bias| per element. The kernel's f32 sum of a (row, x row)
// rounds once per mma (16 products added to the running sum: 2 per span of
// the split), then at each of the 7 adds of the 8 warps' sums, the splits'
// and the bias: at K = 4864 at most (2 * 19 + 7 + 18 + 1) * 2^-24 = 3.8e-6
// of it (the emulator's mma rounds exactly once; a GPU's tensor cores add
// the 16 products in their own order and precision, which the margin covers).
struct gemv_case {
    int rows, cols;
    bool bias;
    bool big; // n = 3 and 16 only
};

static void test_gemv(void **state)
{
    (void)state;
    enum { N = TDM_CUK_GEMV_MAX_N };
    static const struct gemv_case cases[] = {
        {37, 896, true, false},   // 3.5 spans: 4 splits of one span, the last half full
        {23, 4864, false, false}, // 19 spans in 19 splits
        {21, 264, true, false},   // one full span and 8 columns: 2 splits
        {300, 136, false, false}, // less than a span, one split; warp 4 has 8 columns
        {1, 8, true, false},
        {900, 4864, true, true},  // the down GEMM's K: 5 splits of 4 spans, the last of 3
        {4500, 896, false, true}, // 282 tiles: one split of 3.5 spans
    };
    bool saw_one = false, saw_many = false;
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        int rows = cases[ci].rows, cols = cases[ci].cols;
        struct tdm_cuk_gemv_shape g = tdm_cuk_gemv_split(rows, cols);
        saw_one |= g.splits == 1;
        saw_many |= g.splits > 1;
        size_t nw = (size_t)rows * cols, nx = (size_t)N * cols, ny = (size_t)N * rows;
        uint16_t *w = malloc(nw * sizeof *w), *xb = malloc(nx * sizeof *xb);
        float *bias = malloc((size_t)rows * sizeof *bias), *y = malloc(ny * sizeof *y);
        float *alone = malloc(ny * sizeof *alone);
        assert_true(w && xb && bias && y && alone);
        for (size_t i = 0; i < nw; i++)
            w[i] = bf16_bits(frand());
        for (size_t i = 0; i < nx; i++)
            xb[i] = bf16_bits(frand() * 2.0f);
        fill(bias, (size_t)rows, 1.0f);
        const float *b = cases[ci].bias ? bias : NULL;
        uint16_t *d_w = to_dev(w, nw * sizeof *w), *d_x = to_dev(xb, nx * sizeof *xb);
        float *d_b = to_dev(bias, (size_t)rows * sizeof *bias), *d_y = dev_zeros(ny * sizeof *y);
        size_t pb = tdm_cuk_gemv_part_bytes(rows, cols), cb = tdm_cuk_gemv_count_bytes(rows, cols);
        assert_true((pb == 0) == (g.splits == 1) && (cb == 0) == (g.splits == 1));
        float *d_part = pb ? dev_zeros(pb) : NULL;
        int32_t *d_counts = cb ? dev_zeros(cb) : NULL;
        // Each row alone (n = 1).
        bool have_alone[N];
        for (int m = 0; m < N; m++) {
            have_alone[m] = !cases[ci].big || m == 0 || m == 2 || m == N - 1;
            if (!have_alone[m])
                continue;
            ok(tdm_cuk_gemv(stream, d_w, rows, cols, d_x + (size_t)m * cols, 1, b ? d_b : NULL, d_y,
                            d_part, d_counts));
            from_dev(alone + (size_t)m * rows, d_y, (size_t)rows * sizeof *y);
        }
        double *ref = malloc(ny * sizeof *ref), *mag = malloc(ny * sizeof *mag);
        assert_true(ref && mag);
        for (int m = 0; m < N; m++)
            for (int r = 0; r < rows; r++) {
                double sum = b ? b[r] : 0.0, abs_sum = b ? fabs(b[r]) : 0.0;
                for (int k = 0; k < cols; k++) {
                    double p = (double)bf16_value(w[(size_t)r * cols + k]) *
                               bf16_value(xb[(size_t)m * cols + k]);
                    sum += p;
                    abs_sum += fabs(p);
                }
                ref[(size_t)m * rows + r] = sum;
                mag[(size_t)m * rows + r] = abs_sum;
            }
        float worst = 0.0f;
        for (int n = 1; n <= N; n++) {
            if (cases[ci].big && n != 3 && n != N)
                continue;
            ok(tdm_cuk_gemv(stream, d_w, rows, cols, d_x, n, b ? d_b : NULL, d_y, d_part,
                            d_counts));
            from_dev(y, d_y, (size_t)n * rows * sizeof *y);
            for (size_t i = 0; i < (size_t)n * rows; i++) {
                double e = fabs(y[i] - ref[i]);
                if (!(e <= 2e-5 * mag[i]))
                    fail_msg("gemv %dx%d n %d: y[%zu][%zu] = %.9g, reference %.9g "
                             "(tolerance %.3g)",
                             rows, cols, n, i / rows, i % rows, y[i], ref[i], 2e-5 * mag[i]);
                worst = e / mag[i] > worst ? (float)(e / mag[i]) : worst;
            }
            // Batch invariance: every row as computed alone, bitwise.
            for (int m = 0; m < n; m++)
                if (have_alone[m] && memcmp(y + (size_t)m * rows, alone + (size_t)m * rows,
                                            (size_t)rows * sizeof *y) != 0)
                    fail_msg("gemv %dx%d: row %d of a batch of %d differs from the row alone", rows,
                             cols, m, n);
        }
        if (cb) { // each launch leaves the arrival counts zero for the next
            int32_t *counts = malloc(cb);
            from_dev(counts, d_counts, cb);
            for (size_t i = 0; i < cb / sizeof *counts; i++)
                assert_int_equal(counts[i], 0);
            free(counts);
        }
        printf("gemv %4d x %4d%s: %d tiles x %d splits of %d spans; n %s = rows alone; max "
               "error %.2g of sum |w x|\n",
               rows, cols, b ? " + bias" : "", g.tiles, g.splits, g.spans_per_split,
               cases[ci].big ? "3, 16" : "1..16", worst);
        tdm_cuda_dev_free(dev, d_w), tdm_cuda_dev_free(dev, d_x), tdm_cuda_dev_free(dev, d_b);
        tdm_cuda_dev_free(dev, d_y), tdm_cuda_dev_free(dev, d_part);
        tdm_cuda_dev_free(dev, d_counts);
        free(w), free(xb), free(bias), free(y), free(alone), free(ref), free(mag);
    }
    assert_true(saw_one && saw_many);
    // Shapes it does not serve.
    uint16_t *p16 = dev_zeros(4096);
    float *pf = dev_zeros(4096);
    assert_int_equal(tdm_cuk_gemv(stream, p16, 4, 16, p16, 17, NULL, pf, NULL, NULL),
                     TDM_CUK_EINVAL); // n > 16
    assert_int_equal(tdm_cuk_gemv(stream, p16, 4, 12, p16, 1, NULL, pf, NULL, NULL),
                     TDM_CUK_EINVAL); // columns not a multiple of 8
    assert_int_equal(tdm_cuk_gemv(stream, p16 + 1, 4, 16, p16, 1, NULL, pf, NULL, NULL),
                     TDM_CUK_EINVAL); // unaligned weight
    assert_int_equal(tdm_cuk_gemv(stream, p16, 4, 4096, p16, 1, NULL, pf, NULL, NULL),
                     TDM_CUK_EINVAL); // 16 splits and no scratch
    tdm_cuda_dev_free(dev, p16), tdm_cuda_dev_free(dev, pf);
}

// The GEMV's grid for the Qwen2.5-0.5B GEMMs at batch 1: at least an H200's
// 132 SMs each (issue 26 item 3), from the launch log of real launches of
// the four layer GEMMs (zero weights), and the split rule for the LM head
// (151 936 x 896: 9 496 CTAs, 272 MB of weights the emulator is not given).
static void test_gemv_ctas(void **state)
{
    (void)state;
    static const struct {
        const char *what;
        int rows, cols;
        int splits; // the split rule's choice
    } shapes[] = {
        {"qkv", 1152, 896, 4},  {"o", 896, 896, 4},          {"gate_up", 9728, 896, 1},
        {"down", 896, 4864, 5}, {"lm_head", 151936, 896, 1},
    };
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
        int rows = shapes[i].rows, cols = shapes[i].cols;
        struct tdm_cuk_gemv_shape g = tdm_cuk_gemv_split(rows, cols);
        long long ctas = (long long)g.tiles * g.splits;
        printf("0.5B %-8s %6d x %4d: %5d tiles x %d splits of %d spans = %lld CTAs\n",
               shapes[i].what, rows, cols, g.tiles, g.splits, g.spans_per_split, ctas);
        assert_int_equal(g.splits, shapes[i].splits);
        assert_true(ctas >= 132);
        if (rows > 10000)
            continue;
        uint16_t *d_w = dev_zeros((size_t)rows * cols * sizeof(uint16_t));
        uint16_t *d_x = dev_zeros((size_t)cols * sizeof(uint16_t));
        float *d_y = dev_zeros((size_t)rows * sizeof(float));
        size_t pb = tdm_cuk_gemv_part_bytes(rows, cols), cb = tdm_cuk_gemv_count_bytes(rows, cols);
        void *d_part = pb ? dev_zeros(pb) : NULL, *d_counts = cb ? dev_zeros(cb) : NULL;
#ifndef TDM_CUDA_TEST_GPU
        tdm_emu_launch_log(1);
#endif
        ok(tdm_cuk_gemv(stream, d_w, rows, cols, d_x, 1, NULL, d_y, d_part, d_counts));
        assert_int_equal(tdm_cuda_dev_sync(dev), TDM_OK);
#ifndef TDM_CUDA_TEST_GPU
        struct tdm_emu_launch l[2];
        size_t nl = tdm_emu_launches(l, 2);
        tdm_emu_launch_log(0);
        assert_int_equal(nl, 1);
        assert_int_equal(l[0].ctas, (unsigned long long)ctas);
#endif
        tdm_cuda_dev_free(dev, d_w), tdm_cuda_dev_free(dev, d_x), tdm_cuda_dev_free(dev, d_y);
        tdm_cuda_dev_free(dev, d_part), tdm_cuda_dev_free(dev, d_counts);
    }
}

// ---- KV store and attention -------------------------------------------------------------------
#define BS 16
#define NUM_BLOCKS 48
#define BT_STRIDE 19

// Sequences' block tables (BT_STRIDE entries each in bt) taken in turn from
// perm, a permutation of the pool, and their rows one after another in
// aseqs; returns the rows.
static int attn_tables(int n_seqs, const int *start, const int *ntok, const int *perm, int *bt,
                       struct tdm_attn_seq *aseqs)
{
    int next = 0, rows = 0;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (start[s] + ntok[s] + BS - 1) / BS;
        assert_true(nb <= BT_STRIDE && next + nb <= NUM_BLOCKS);
        for (int b = 0; b < BT_STRIDE; b++)
            bt[s * BT_STRIDE + b] = b < nb ? perm[next + b] : 0;
        next += nb;
        aseqs[s] = (struct tdm_attn_seq){.row = rows,
                                         .n_tokens = ntok[s],
                                         .start_pos = start[s],
                                         .block_table = bt + s * BT_STRIDE};
        rows += ntok[s];
    }
    return rows;
}
// Tolerance against the CPU backend (f32 throughout): the kernel rounds q and
// P = e^(s - m) to bf16 (relative error <= 2^-9 each). With q and K uniform in
// [-1, 1), a score moves by about 2^-9 sum_d |q_d k_d| / sqrt(head_dim) =
// 2^-9 sqrt(head_dim) / 4 (0.0055 at head_dim 128), a weight by that plus
// 2^-9 relative, and the output, a convex combination of V (|v - out| <= 2),
// by at most twice the sum: 1.5e-2 absolute (the printed maxima are ~10x
// below).
#define MMA_TOL_CPU 1.5e-2f

#define NSEQ 6

// n_tokens and start_pos of the batch's sequences (see the file comment).
static const int seq_start[NSEQ] = {0, 21, 300, 5, 16, 40};
static const int seq_ntok[NSEQ] = {37, 19, 1, 1, 33, 1};

struct attn_case {
    int n_heads, n_kv_heads, hd;
    enum tdm_cuk_kv_type kv_type;
};

// The CPU's KV pool of the case's shape: num_layers layers of num_blocks
// blocks of block_size tokens (uninitialised: each test fills what it reads).
static struct tdm_kv_cache *attn_pool(const struct attn_case *c, int num_layers, int block_size,
                                      int num_blocks)
{
    struct tdm_kv_config cfg = {.num_layers = num_layers,
                                .num_kv_heads = c->n_kv_heads,
                                .head_dim = c->hd,
                                .block_size = block_size,
                                .num_blocks = num_blocks};
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    if (tdm_kv_new(&kv, &cfg, err, sizeof err) != TDM_OK)
        fail_msg("tdm_kv_new: %s", err);
    return kv;
}

// Runs attention for sequences sel[0..ns) of the batch on the device; rows of
// the selected sequences are packed from row 0; out_host gets [rows][q_dim].
static void dev_attention(const struct attn_case *c, const float *qkv_host, int qkv_dim,
                          const int *bt, const int *sel, int ns, void *d_kc, void *d_vc,
                          void *out_host, int out_bf16, int *rows_out)
{
    size_t out_elem = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    int32_t row[NSEQ], ntok[NSEQ], start[NSEQ], dec[NSEQ], tiles[2 * 32];
    int32_t bts[NSEQ * BT_STRIDE];
    struct tdm_cuk_seq seqs[NSEQ];
    int total = 0;
    for (int i = 0; i < ns; i++) {
        int s = sel[i];
        row[i] = total;
        ntok[i] = seq_ntok[s];
        start[i] = seq_start[s];
        memcpy(bts + i * BT_STRIDE, bt + s * BT_STRIDE, BT_STRIDE * sizeof(int32_t));
        total += seq_ntok[s];
    }
    // q rows of the selected sequences, packed.
    int q_dim = c->n_heads * c->hd;
    float *q = malloc((size_t)total * qkv_dim * sizeof *q);
    int r = 0, src_row = 0;
    for (int s = 0, i = 0; s < NSEQ; s++) {
        if (i < ns && sel[i] == s) {
            memcpy(q + (size_t)r * qkv_dim, qkv_host + (size_t)src_row * qkv_dim,
                   (size_t)seq_ntok[s] * qkv_dim * sizeof *q);
            r += seq_ntok[s];
            i++;
        }
        src_row += seq_ntok[s];
    }
    struct tdm_cuk_plan plan;
    ok(tdm_cuk_attn_plan(row, ntok, start, ns, c->n_heads, c->hd, seqs, dec, tiles, 32, &plan));
    struct tdm_cuk_attn_args a = {
        .kv_type = c->kv_type,
        .q = to_dev(q, (size_t)total * qkv_dim * sizeof *q),
        .q_stride = qkv_dim,
        .out = dev_zeros((size_t)total * q_dim * out_elem),
        .out_bf16 = out_bf16,
        .k_cache = d_kc,
        .v_cache = d_vc,
        .seqs = to_dev(seqs, (size_t)ns * sizeof seqs[0]),
        .block_tables = to_dev(bts, (size_t)ns * BT_STRIDE * sizeof(int32_t)),
        .bt_stride = BT_STRIDE,
        .decode_seqs = plan.n_decode ? to_dev(dec, (size_t)plan.n_decode * sizeof(int32_t)) : NULL,
        .n_decode = plan.n_decode,
        .max_splits = plan.max_splits,
        .part_o = plan.part_floats ? dev_zeros(plan.part_floats * sizeof(float)) : NULL,
        .part_ml =
            plan.part_floats ? dev_zeros(plan.part_floats / c->hd * 2 * sizeof(float)) : NULL,
        .part_done = plan.part_counts ? dev_zeros(plan.part_counts * sizeof(int32_t)) : NULL,
        .prefill_tiles =
            plan.n_tiles ? to_dev(tiles, (size_t)plan.n_tiles * 2 * sizeof(int32_t)) : NULL,
        .n_tiles = plan.n_tiles,
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->hd,
        .block_size = BS,
        .scale = 1.0f / sqrtf((float)c->hd),
    };
    ok(tdm_cuk_attention(stream, &a));
    from_dev(out_host, a.out, (size_t)total * q_dim * out_elem);
    *rows_out = total;
    tdm_cuda_dev_free(dev, (void *)a.q), tdm_cuda_dev_free(dev, a.out);
    tdm_cuda_dev_free(dev, (void *)a.seqs), tdm_cuda_dev_free(dev, (void *)a.block_tables);
    tdm_cuda_dev_free(dev, (void *)a.decode_seqs), tdm_cuda_dev_free(dev, a.part_o);
    tdm_cuda_dev_free(dev, a.part_ml), tdm_cuda_dev_free(dev, (void *)a.prefill_tiles);
    tdm_cuda_dev_free(dev, a.part_done);
    free(q);
}

static void run_attention_case(const struct attn_case *c)
{
    const int layer = 1;
    int q_dim = c->n_heads * c->hd, kv_dim = c->n_kv_heads * c->hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    bool bf16 = c->kv_type == TDM_CUK_KV_BF16;
    struct tdm_kv_cache *kv = attn_pool(c, 2, BS, NUM_BLOCKS);
    size_t layer_floats = (size_t)NUM_BLOCKS * kv_dim * BS;
    // Old KV everywhere (what earlier steps stored), rounded to bf16 for the
    // bf16 case so both sides attend over identical numbers.
    for (int l = 0; l < 2; l++) {
        fill(tdm_kv_k(kv, l, 0), layer_floats, 1.0f);
        fill(tdm_kv_v(kv, l, 0), layer_floats, 1.0f);
        for (size_t i = 0; bf16 && i < layer_floats; i++) {
            tdm_kv_k(kv, l, 0)[i] = bf16_round(tdm_kv_k(kv, l, 0)[i]);
            tdm_kv_v(kv, l, 0)[i] = bf16_round(tdm_kv_v(kv, l, 0)[i]);
        }
    }
    // Scattered block tables: a permutation of the pool.
    int perm[NUM_BLOCKS], bt[NSEQ * BT_STRIDE];
    for (int i = 0; i < NUM_BLOCKS; i++)
        perm[i] = i;
    for (int i = NUM_BLOCKS - 1; i > 0; i--) {
        int j = (int)((frand() + 1.0f) * 0.5f * (float)(i + 1)) % (i + 1);
        int t = perm[i];
        perm[i] = perm[j], perm[j] = t;
    }
    struct tdm_attn_seq aseqs[NSEQ];
    int rows = attn_tables(NSEQ, seq_start, seq_ntok, perm, bt, aseqs);
    float *qkv = malloc((size_t)rows * qkv_dim * sizeof *qkv);
    fill(qkv, (size_t)rows * qkv_dim, 1.0f);
    for (int r = 0; bf16 && r < rows; r++)
        for (int i = q_dim; i < qkv_dim; i++)
            qkv[(size_t)r * qkv_dim + i] = bf16_round(qkv[(size_t)r * qkv_dim + i]);

    // Device pool of the layer before the CPU writes the new tokens.
    size_t elem = bf16 ? 2 : 4;
    void *hk = malloc(layer_floats * elem), *hv = malloc(layer_floats * elem);
    for (size_t i = 0; i < layer_floats; i++) {
        float k = tdm_kv_k(kv, layer, 0)[i], v = tdm_kv_v(kv, layer, 0)[i];
        if (bf16) {
            ((uint16_t *)hk)[i] = bf16_bits(k);
            ((uint16_t *)hv)[i] = bf16_bits(v);
        } else {
            ((float *)hk)[i] = k;
            ((float *)hv)[i] = v;
        }
    }
    void *d_kc = to_dev(hk, layer_floats * elem), *d_vc = to_dev(hv, layer_floats * elem);

    // CPU: store, attend.
    float *want = malloc((size_t)rows * q_dim * sizeof *want);
    float *got = malloc((size_t)rows * q_dim * sizeof *got);
    cpu->kv_store(cpu_be(), kv, layer, aseqs, NSEQ, qkv + q_dim, qkv + q_dim + kv_dim, qkv_dim);
    cpu->attention(cpu_be(), kv, layer, aseqs, NSEQ, qkv, qkv_dim, want, c->n_heads, c->n_kv_heads,
                   c->hd, 1.0f / sqrtf((float)c->hd));

    // Device: store through flat slots, then the same pool must hold the same KV.
    int32_t *slots = malloc((size_t)rows * sizeof *slots);
    for (int s = 0; s < NSEQ; s++)
        for (int i = 0; i < seq_ntok[s]; i++) {
            int pos = seq_start[s] + i;
            slots[aseqs[s].row + i] = bt[s * BT_STRIDE + pos / BS] * BS + pos % BS;
        }
    float *d_qkv = to_dev(qkv, (size_t)rows * qkv_dim * sizeof *qkv);
    int32_t *d_slots = to_dev(slots, (size_t)rows * sizeof *slots);
    ok(tdm_cuk_kv_store(stream, c->kv_type, d_qkv + q_dim, d_qkv + q_dim + kv_dim, qkv_dim, d_slots,
                        rows, d_kc, d_vc, c->n_kv_heads, c->hd, BS));
    from_dev(hk, d_kc, layer_floats * elem);
    from_dev(hv, d_vc, layer_floats * elem);
    for (size_t i = 0; i < layer_floats; i++) {
        float k = bf16 ? bf16_value(((uint16_t *)hk)[i]) : ((float *)hk)[i];
        float v = bf16 ? bf16_value(((uint16_t *)hv)[i]) : ((float *)hv)[i];
        if (k != tdm_kv_k(kv, layer, 0)[i] || v != tdm_kv_v(kv, layer, 0)[i])
            fail_msg("kv_store: pool element %zu differs", i);
    }

    int all[NSEQ] = {0, 1, 2, 3, 4, 5}, n_rows;
    dev_attention(c, qkv, qkv_dim, bt, all, NSEQ, d_kc, d_vc, got, 0, &n_rows);
    assert_int_equal(n_rows, rows);
    // Prefill rows with bf16 KV ran on tensor cores (q and P in bf16).
    float e = 0.0f, e_mma = 0.0f;
    for (int s = 0; s < NSEQ; s++) {
        bool mma = bf16 && seq_ntok[s] > 1;
        size_t at = (size_t)aseqs[s].row * q_dim, n = (size_t)seq_ntok[s] * q_dim;
        float es = check_close(mma ? "attention (tensor cores)" : "attention", got + at, want + at,
                               n, mma ? MMA_TOL_CPU : 2e-5f);
        if (mma)
            e_mma = es > e_mma ? es : e_mma;
        else
            e = es > e ? es : e;
    }
    printf("attention heads %d/%d head_dim %d kv %s: max error %g", c->n_heads, c->n_kv_heads,
           c->hd, bf16 ? "bf16" : "f32", e);
    if (bf16)
        printf(", prefill on tensor cores %g", e_mma);
    printf("\n");
    // The o GEMM's input: every output (prefill, one split, several) rounded.
    uint16_t *obits = malloc((size_t)rows * q_dim * sizeof *obits);
    dev_attention(c, qkv, qkv_dim, bt, all, NSEQ, d_kc, d_vc, obits, 1, &n_rows);
    for (size_t i = 0; i < (size_t)rows * q_dim; i++)
        assert_int_equal(obits[i], bf16_bits(got[i]));
    free(obits);

    // Batch invariance: each of a prefill, a ten-split decode and a short
    // decode, alone, gives bitwise its rows of the batch.
    const int alone[3] = {0, 2, 3};
    for (int i = 0; i < 3; i++) {
        int s = alone[i], n1;
        float *one = malloc((size_t)seq_ntok[s] * q_dim * sizeof *one);
        dev_attention(c, qkv, qkv_dim, bt, &s, 1, d_kc, d_vc, one, 0, &n1);
        assert_int_equal(n1, seq_ntok[s]);
        assert_memory_equal(one, got + (size_t)aseqs[s].row * q_dim,
                            (size_t)seq_ntok[s] * q_dim * sizeof *one);
        free(one);
    }

    tdm_cuda_dev_free(dev, d_kc), tdm_cuda_dev_free(dev, d_vc);
    tdm_cuda_dev_free(dev, d_qkv), tdm_cuda_dev_free(dev, d_slots);
    free(slots), free(want), free(got), free(qkv), free(hk), free(hv);
    tdm_kv_free(kv);
}

static void test_attention(void **state)
{
    (void)state;
    const struct attn_case cases[] = {
        {2, 2, 64, TDM_CUK_KV_F32},  {4, 2, 128, TDM_CUK_KV_F32}, {7, 1, 64, TDM_CUK_KV_F32},
        {8, 1, 128, TDM_CUK_KV_F32}, {4, 2, 64, TDM_CUK_KV_BF16}, {14, 2, 128, TDM_CUK_KV_BF16},
        {12, 1, 64, TDM_CUK_KV_F32}, // a group of 12: two decode blocks (8 + 4) per KV head
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_attention_case(&cases[i]);
}

// ---- prefill attention on tensor cores (bf16 KV) ---------------------------------------------

// Against mma_reference, which repeats the kernel's arithmetic: bitwise on the
// emulator (its mma is specified: the 16 exact products added to c in double,
// rounded once); on a GPU the mma's internal order may move a score's last
// bit, which can flip the bf16 rounding of one P, moving an output by at most
// 2^-8 of |V| <= 1.
#ifdef TDM_CUDA_TEST_GPU
#define MMA_TOL_REF (1.0f / 256.0f)
#else
#define MMA_TOL_REF 0.0f
#endif

// One query row at position pos (bf16 KV, values read from the f32 pool that
// holds them exactly), as attn_prefill_mma_kernel computes it: q rounded to
// bf16; per key tile of TDM_CUK_PREFILL_MMA_BK from position 0, each score the
// f32 sum over 16-dim steps of (acc + 16 products, in double, rounded), times
// scale; the running max m, corr = e^(m_old - m), P rounded to bf16; l kept as
// four partial sums (a lane's columns 2t, 2t + 1 of every 8-key tile),
// combined (l0 + l1) + (l2 + l3) at the end; O scaled by corr, then per 16 keys
// (O + 16 products in double, rounded).
static void mma_reference(const float *q, int pos, struct tdm_kv_cache *kv, int layer,
                          const int *bt, int kvh, int n_kv_heads, int hd, float scale, float *out)
{
    enum { BK = TDM_CUK_PREFILL_MMA_BK };
    float qb[128], o[128], m = -INFINITY, lq[4] = {0, 0, 0, 0};
    for (int d = 0; d < hd; d++) {
        qb[d] = bf16_round(q[d]);
        o[d] = 0.0f;
    }
    for (int k0 = 0; k0 <= pos; k0 += BK) {
        float sc[BK], p[BK], mx = m;
        const float *vr[BK];
        for (int j = 0; j < BK; j++) {
            int key = k0 + j;
            sc[j] = -INFINITY;
            vr[j] = NULL;
            if (key > pos)
                continue;
            size_t off = (((size_t)bt[key / BS] * n_kv_heads + kvh) * BS + key % BS) * hd;
            const float *kr = tdm_kv_k(kv, layer, 0) + off;
            vr[j] = tdm_kv_v(kv, layer, 0) + off;
            float acc = 0.0f;
            for (int d0 = 0; d0 < hd; d0 += 16) {
                double a = acc;
                for (int d = d0; d < d0 + 16; d++)
                    a += (double)qb[d] * kr[d];
                acc = (float)a;
            }
            sc[j] = acc * scale;
            mx = fmaxf(mx, sc[j]);
        }
        float corr = mx == -INFINITY ? 1.0f : expf(m - mx);
        m = mx;
        for (int j = 0; j < BK; j++)
            p[j] = sc[j] == -INFINITY ? 0.0f : bf16_round(expf(sc[j] - m));
        for (int t = 0; t < 4; t++) {
            float ps = 0.0f;
            for (int nt = 0; nt < BK / 8; nt++)
                for (int e = 0; e < 2; e++)
                    ps += p[nt * 8 + 2 * t + e];
            lq[t] = lq[t] * corr + ps;
        }
        for (int d = 0; d < hd; d++)
            o[d] *= corr;
        for (int kb = 0; kb < BK; kb += 16)
            for (int d = 0; d < hd; d++) {
                double a = o[d];
                for (int j = kb; j < kb + 16; j++)
                    if (vr[j] != NULL)
                        a += (double)p[j] * vr[j][d];
                o[d] = (float)a;
            }
    }
    float l = (lq[0] + lq[1]) + (lq[2] + lq[3]);
    for (int d = 0; d < hd; d++)
        out[d] = o[d] / l;
}

// Prefill-only attention of ns sequences (rows packed from q's row 0, each
// sequence its own block table bts + i * BT_STRIDE) into out_host (f32).
static void dev_prefill(const struct attn_case *c, const float *q, int q_rows, int ns,
                        const int32_t *ntok, const int32_t *start, const int32_t *bts, void *d_kc,
                        void *d_vc, float *out_host)
{
    int32_t row[8], dec[8], tiles[2 * 32];
    struct tdm_cuk_seq seqs[8];
    int q_dim = c->n_heads * c->hd, total = 0;
    assert_true(ns <= 8);
    for (int i = 0; i < ns; i++) {
        row[i] = total;
        total += ntok[i];
    }
    assert_true(total <= q_rows);
    struct tdm_cuk_plan plan;
    ok(tdm_cuk_attn_plan(row, ntok, start, ns, c->n_heads, c->hd, seqs, dec, tiles, 32, &plan));
    assert_int_equal(plan.n_decode, 0);
    struct tdm_cuk_attn_args a = {
        .kv_type = c->kv_type,
        .q = to_dev(q, (size_t)total * q_dim * sizeof *q),
        .q_stride = q_dim,
        .out = dev_zeros((size_t)total * q_dim * sizeof(float)),
        .k_cache = d_kc,
        .v_cache = d_vc,
        .seqs = to_dev(seqs, (size_t)ns * sizeof seqs[0]),
        .block_tables = to_dev(bts, (size_t)ns * BT_STRIDE * sizeof(int32_t)),
        .bt_stride = BT_STRIDE,
        .prefill_tiles = to_dev(tiles, (size_t)plan.n_tiles * 2 * sizeof(int32_t)),
        .n_tiles = plan.n_tiles,
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->hd,
        .block_size = BS,
        .scale = 1.0f / sqrtf((float)c->hd),
    };
    ok(tdm_cuk_attention(stream, &a));
    from_dev(out_host, a.out, (size_t)total * q_dim * sizeof(float));
    tdm_cuda_dev_free(dev, (void *)a.q), tdm_cuda_dev_free(dev, a.out);
    tdm_cuda_dev_free(dev, (void *)a.seqs), tdm_cuda_dev_free(dev, (void *)a.block_tables);
    tdm_cuda_dev_free(dev, (void *)a.prefill_tiles);
}

#define PM_SEQS 5
// 129 tokens: three query tiles, the last of one row (position 128, the first
// key of the third key tile); 15 and 17 (at offset 21) inside one tile; 37 at
// offset 49: a query tile across the key tiles' boundary at 64, its first
// warp's last row at position 64; 2 tokens, the shortest prefill.
static const int32_t pm_start[PM_SEQS] = {0, 0, 21, 49, 0};
static const int32_t pm_ntok[PM_SEQS] = {129, 15, 17, 37, 2};

static void run_prefill_mma_case(const struct attn_case *c)
{
    const int layer = 0;
    int q_dim = c->n_heads * c->hd, kv_dim = c->n_kv_heads * c->hd;
    float scale = 1.0f / sqrtf((float)c->hd);
    struct tdm_kv_cache *kv = attn_pool(c, 1, BS, NUM_BLOCKS);
    // The whole pool holds bf16 values (every position the sequences will
    // see is "already stored"): the CPU side attends over the same numbers.
    size_t layer_floats = (size_t)NUM_BLOCKS * kv_dim * BS;
    float *kf = tdm_kv_k(kv, layer, 0), *vf = tdm_kv_v(kv, layer, 0);
    uint16_t *hk = malloc(layer_floats * 2), *hv = malloc(layer_floats * 2);
    for (size_t i = 0; i < layer_floats; i++) {
        kf[i] = bf16_round(frand());
        vf[i] = bf16_round(frand());
        hk[i] = bf16_bits(kf[i]);
        hv[i] = bf16_bits(vf[i]);
    }
    void *d_kc = to_dev(hk, layer_floats * 2), *d_vc = to_dev(hv, layer_floats * 2);
    int perm[NUM_BLOCKS], bt[PM_SEQS * BT_STRIDE];
    for (int i = 0; i < NUM_BLOCKS; i++)
        perm[i] = (i * 29 + 7) % NUM_BLOCKS; // scattered: 29 is prime to 48
    struct tdm_attn_seq aseqs[PM_SEQS];
    int rows = attn_tables(PM_SEQS, pm_start, pm_ntok, perm, bt, aseqs);
    float *q = malloc((size_t)rows * q_dim * sizeof *q);
    fill(q, (size_t)rows * q_dim, 1.0f);
    float *want = malloc((size_t)rows * q_dim * sizeof *want);
    float *got = malloc((size_t)rows * q_dim * sizeof *got);
    float *part = malloc((size_t)rows * q_dim * sizeof *part);
    float ref[128];
    cpu->attention(cpu_be(), kv, layer, aseqs, PM_SEQS, q, q_dim, want, c->n_heads, c->n_kv_heads,
                   c->hd, scale);
    dev_prefill(c, q, rows, PM_SEQS, pm_ntok, pm_start, bt, d_kc, d_vc, got);
    float e_cpu =
        check_close("prefill (tensor cores) vs cpu", got, want, (size_t)rows * q_dim, MMA_TOL_CPU);
    float e_ref = 0.0f;
    for (int s = 0; s < PM_SEQS; s++)
        for (int i = 0; i < pm_ntok[s]; i++)
            for (int h = 0; h < c->n_heads; h++) {
                size_t at = (size_t)(aseqs[s].row + i) * q_dim + (size_t)h * c->hd;
                mma_reference(q + at, pm_start[s] + i, kv, layer, bt + s * BT_STRIDE,
                              h / (c->n_heads / c->n_kv_heads), c->n_kv_heads, c->hd, scale, ref);
                float e = check_close("prefill (tensor cores) vs its reference", got + at, ref,
                                      (size_t)c->hd, MMA_TOL_REF);
                e_ref = e > e_ref ? e : e_ref;
            }
    printf("prefill on tensor cores heads %d/%d head_dim %d: max error %g vs cpu (f32), %g vs "
           "the bf16 reference\n",
           c->n_heads, c->n_kv_heads, c->hd, e_cpu, e_ref);

    // The 129-token prompt in three ragged chunks (37, 15, 77 tokens at
    // positions 0, 37, 52), as three sequences of one launch and the last
    // alone: bitwise its rows of the one-chunk run.
    int32_t ch_start[3] = {0, 37, 52}, ch_ntok[3] = {37, 15, 77}, ch_bt[3 * BT_STRIDE];
    for (int i = 0; i < 3; i++)
        memcpy(ch_bt + i * BT_STRIDE, bt, BT_STRIDE * sizeof(int32_t));
    dev_prefill(c, q, rows, 3, ch_ntok, ch_start, ch_bt, d_kc, d_vc, part);
    assert_memory_equal(part, got, (size_t)pm_ntok[0] * q_dim * sizeof *part);
    dev_prefill(c, q + (size_t)52 * q_dim, rows, 1, &ch_ntok[2], &ch_start[2], bt, d_kc, d_vc,
                part);
    assert_memory_equal(part, got + (size_t)52 * q_dim, (size_t)77 * q_dim * sizeof *part);
    // Alone = in the batch: the sequence at offset 49.
    dev_prefill(c, q + (size_t)aseqs[3].row * q_dim, rows, 1, &pm_ntok[3], &pm_start[3],
                bt + 3 * BT_STRIDE, d_kc, d_vc, part);
    assert_memory_equal(part, got + (size_t)aseqs[3].row * q_dim,
                        (size_t)pm_ntok[3] * q_dim * sizeof *part);

    tdm_cuda_dev_free(dev, d_kc), tdm_cuda_dev_free(dev, d_vc);
    free(q), free(want), free(got), free(part), free(hk), free(hv);
    tdm_kv_free(kv);
}

// GQA groups 1, 2 and 7; head_dim 16 and 32 (the tiny models), 64 and 128.
static void test_prefill_mma(void **state)
{
    (void)state;
    const struct attn_case cases[] = {
        {2, 1, 16, TDM_CUK_KV_BF16},
        {7, 1, 32, TDM_CUK_KV_BF16},
        {7, 1, 64, TDM_CUK_KV_BF16},
        {2, 2, 128, TDM_CUK_KV_BF16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_prefill_mma_case(&cases[i]);
}

// RoPE and the KV store fused: rope_kv_store is bitwise rope then kv_store
// (the qkv rows and the pool), and a decode-only batch's attention with
// inv_freq (RoPE of the query and the new token's store inside the decode
// kernel) is bitwise rope_kv_store then attention: the outputs (f32 and bf16),
// the pool, and the qkv rows it leaves un-rotated. Positions 0 and 5 (one
// split of 32), 255 (the new token closes the eighth split), 256 (opens the
// ninth, alone in it), 300 and 700 (10 and 22 splits), and a padding row (slot
// -1: nothing stored); one launch each time (no combine launch); each
// sequence alone is bitwise its row of the batch.
#define FZ_SEQS 7
#define FZ_BS 16
#define FZ_BLOCKS 128
#define FZ_BT 48
#define FZ_MAX_SEQS 16 // of one fz_attend call

// How fz_attend stores the new rows and attends: rope_kv_store then attention
// (the reference of the fused path), the fused decode (RoPE and the store
// inside the kernel), or kv_store then attention with no RoPE (what the CPU
// backend's attention is compared with).
enum fz_mode { FZ_SEPARATE, FZ_FUSED, FZ_PLAIN };

struct fz_run {
    void *k, *v; // device pools (FZ_BLOCKS blocks)
    float *qkv;  // device qkv rows of the selected sequences
    void *out;   // device output
};

static void fz_attend(const struct attn_case *c, const int *start, const int32_t *bt_all,
                      const int32_t *slots_all, const int *sel, int ns, const float *qkv_host,
                      int qkv_dim, const float *d_freq, enum fz_mode mode, int out_bf16, void *kc,
                      void *vc, void *out_host, float *qkv_after)
{
    int32_t row[FZ_MAX_SEQS], ntok[FZ_MAX_SEQS], st[FZ_MAX_SEQS], dec[FZ_MAX_SEQS], tiles[2];
    int32_t slots[FZ_MAX_SEQS], bts[FZ_MAX_SEQS * FZ_BT], pos[FZ_MAX_SEQS];
    struct tdm_cuk_seq seqs[FZ_MAX_SEQS];
    assert_true(ns <= FZ_MAX_SEQS);
    float *q = malloc((size_t)ns * qkv_dim * sizeof *q);
    for (int i = 0; i < ns; i++) {
        row[i] = i;
        ntok[i] = 1;
        st[i] = pos[i] = start[sel[i]];
        slots[i] = slots_all[sel[i]];
        memcpy(bts + i * FZ_BT, bt_all + sel[i] * FZ_BT, FZ_BT * sizeof(int32_t));
        memcpy(q + (size_t)i * qkv_dim, qkv_host + (size_t)sel[i] * qkv_dim,
               (size_t)qkv_dim * sizeof *q);
    }
    struct tdm_cuk_plan plan;
    ok(tdm_cuk_attn_plan(row, ntok, st, ns, c->n_heads, c->hd, seqs, dec, tiles, 1, &plan));
    assert_int_equal(plan.n_tiles, 0);
    int q_dim = c->n_heads * c->hd;
    size_t out_elem = out_bf16 ? sizeof(uint16_t) : sizeof(float);
    float *d_q = to_dev(q, (size_t)ns * qkv_dim * sizeof *q);
    int32_t *d_slots = to_dev(slots, (size_t)ns * sizeof *slots);
    int32_t *d_pos = to_dev(pos, (size_t)ns * sizeof *pos);
    int kv_dim = c->n_kv_heads * c->hd;
    if (mode == FZ_SEPARATE)
        ok(tdm_cuk_rope_kv_store(stream, c->kv_type, d_q, qkv_dim, c->n_heads, c->n_kv_heads, c->hd,
                                 d_pos, d_freq, d_slots, ns, kc, vc, FZ_BS));
    if (mode == FZ_PLAIN)
        ok(tdm_cuk_kv_store(stream, c->kv_type, d_q + q_dim, d_q + q_dim + kv_dim, qkv_dim, d_slots,
                            ns, kc, vc, c->n_kv_heads, c->hd, FZ_BS));
    struct tdm_cuk_attn_args a = {
        .kv_type = c->kv_type,
        .q = d_q,
        .q_stride = qkv_dim,
        .out = dev_zeros((size_t)ns * q_dim * out_elem),
        .out_bf16 = out_bf16,
        .inv_freq = mode == FZ_FUSED ? d_freq : NULL,
        .slots = d_slots,
        .k_cache = kc,
        .v_cache = vc,
        .seqs = to_dev(seqs, (size_t)ns * sizeof seqs[0]),
        .block_tables = to_dev(bts, (size_t)ns * FZ_BT * sizeof(int32_t)),
        .bt_stride = FZ_BT,
        .decode_seqs = to_dev(dec, (size_t)ns * sizeof(int32_t)),
        .n_decode = plan.n_decode,
        .max_splits = plan.max_splits,
        .part_o = dev_zeros(plan.part_floats * sizeof(float)),
        .part_ml = dev_zeros(plan.part_floats / c->hd * 2 * sizeof(float)),
        .part_done = dev_zeros(plan.part_counts * sizeof(int32_t)),
        .n_heads = c->n_heads,
        .n_kv_heads = c->n_kv_heads,
        .head_dim = c->hd,
        .block_size = FZ_BS,
        .scale = 1.0f / sqrtf((float)c->hd),
    };
#ifndef TDM_CUDA_TEST_GPU
    tdm_emu_launch_log(1);
#endif
    ok(tdm_cuk_attention(stream, &a));
#ifndef TDM_CUDA_TEST_GPU
    // One launch per decode batch, however many splits (the last block of a
    // sequence's splits merges them).
    assert_int_equal(tdm_emu_launches(NULL, 0), 1);
    tdm_emu_launch_log(0);
#endif
    from_dev(out_host, a.out, (size_t)ns * q_dim * out_elem);
    // The split counts are left zero for the next launch.
    int32_t *done = malloc(plan.part_counts * sizeof *done);
    from_dev(done, a.part_done, plan.part_counts * sizeof *done);
    for (size_t i = 0; i < plan.part_counts; i++)
        assert_int_equal(done[i], 0);
    free(done);
    if (qkv_after)
        from_dev(qkv_after, d_q, (size_t)ns * qkv_dim * sizeof *q);
    tdm_cuda_dev_free(dev, d_q), tdm_cuda_dev_free(dev, d_slots), tdm_cuda_dev_free(dev, d_pos);
    tdm_cuda_dev_free(dev, a.out), tdm_cuda_dev_free(dev, (void *)a.seqs);
    tdm_cuda_dev_free(dev, (void *)a.block_tables), tdm_cuda_dev_free(dev, (void *)a.decode_seqs);
    tdm_cuda_dev_free(dev, a.part_o), tdm_cuda_dev_free(dev, a.part_ml);
    tdm_cuda_dev_free(dev, a.part_done);
    free(q);
}

static void run_fused_case(const struct attn_case *c)
{
    const int start[FZ_SEQS] = {0, 5, 255, 256, 300, 700, 0};
    bool bf16 = c->kv_type == TDM_CUK_KV_BF16;
    int q_dim = c->n_heads * c->hd, kv_dim = c->n_kv_heads * c->hd, qkv_dim = q_dim + 2 * kv_dim;
    size_t elem = bf16 ? 2 : 4, pool_elems = (size_t)FZ_BLOCKS * kv_dim * FZ_BS;
    // Old KV (random) and each sequence's own blocks (disjoint and scattered:
    // a new token's block is its sequence's alone), the last one's padding.
    void *pool_k = malloc(pool_elems * elem), *pool_v = malloc(pool_elems * elem);
    for (size_t i = 0; i < pool_elems; i++) {
        float k = frand(), v = frand();
        if (bf16) {
            ((uint16_t *)pool_k)[i] = bf16_bits(k);
            ((uint16_t *)pool_v)[i] = bf16_bits(v);
        } else {
            ((float *)pool_k)[i] = k;
            ((float *)pool_v)[i] = v;
        }
    }
    int32_t bt[FZ_SEQS * FZ_BT], slots[FZ_SEQS];
    int next = 0;
    for (int s = 0; s < FZ_SEQS; s++) {
        assert_true(next + start[s] / FZ_BS + 1 <= FZ_BLOCKS);
        int nb = start[s] / FZ_BS + 1;
        for (int b = 0; b < FZ_BT; b++)
            bt[s * FZ_BT + b] = b < nb ? (next + b) * 37 % FZ_BLOCKS : 0;
        slots[s] =
            s == FZ_SEQS - 1 ? -1 : bt[s * FZ_BT + start[s] / FZ_BS] * FZ_BS + start[s] % FZ_BS;
        next += nb;
    }
    float *qkv = malloc((size_t)FZ_SEQS * qkv_dim * sizeof *qkv), inv_freq[64];
    fill(qkv, (size_t)FZ_SEQS * qkv_dim, 2.0f);
    for (int i = 0; i < c->hd / 2; i++)
        inv_freq[i] = (float)(1.0 / pow(1000000.0, (double)(2 * i) / c->hd));
    float *d_freq = to_dev(inv_freq, sizeof inv_freq);
    size_t out_f = (size_t)FZ_SEQS * q_dim;
    float *ref = malloc(out_f * sizeof *ref), *got = malloc(out_f * sizeof *got);
    float *qkv_ref = malloc((size_t)FZ_SEQS * qkv_dim * sizeof *qkv);
    float *qkv_got = malloc((size_t)FZ_SEQS * qkv_dim * sizeof *qkv);
    uint16_t *bits = malloc(out_f * sizeof *bits);
    void *kref = to_dev(pool_k, pool_elems * elem), *vref = to_dev(pool_v, pool_elems * elem);
    void *kf = to_dev(pool_k, pool_elems * elem), *vf = to_dev(pool_v, pool_elems * elem);
    void *ks = to_dev(pool_k, pool_elems * elem), *vs = to_dev(pool_v, pool_elems * elem);
    int all[FZ_SEQS];
    for (int s = 0; s < FZ_SEQS; s++)
        all[s] = s;

    // Separate kernels: rope, kv_store.
    float *d_q = to_dev(qkv, (size_t)FZ_SEQS * qkv_dim * sizeof *qkv);
    int32_t pos[FZ_SEQS];
    memcpy(pos, start, sizeof pos);
    int32_t *d_pos = to_dev(pos, sizeof pos), *d_slots = to_dev(slots, sizeof slots);
    ok(tdm_cuk_rope(stream, d_q, FZ_SEQS, qkv_dim, c->n_heads + c->n_kv_heads, c->hd, d_pos,
                    d_freq));
    ok(tdm_cuk_kv_store(stream, c->kv_type, d_q + q_dim, d_q + q_dim + kv_dim, qkv_dim, d_slots,
                        FZ_SEQS, ks, vs, c->n_kv_heads, c->hd, FZ_BS));
    float *qkv_sep = malloc((size_t)FZ_SEQS * qkv_dim * sizeof *qkv);
    from_dev(qkv_sep, d_q, (size_t)FZ_SEQS * qkv_dim * sizeof *qkv);

    // rope_kv_store then attention (the reference), then the fused decode.
    fz_attend(c, start, bt, slots, all, FZ_SEQS, qkv, qkv_dim, d_freq, FZ_SEPARATE, 0, kref, vref,
              ref, qkv_ref);
    assert_memory_equal(qkv_ref, qkv_sep, (size_t)FZ_SEQS * qkv_dim * sizeof *qkv);
    fz_attend(c, start, bt, slots, all, FZ_SEQS, qkv, qkv_dim, d_freq, FZ_FUSED, 0, kf, vf, got,
              qkv_got);
    assert_memory_equal(got, ref, out_f * sizeof *ref);
    assert_memory_equal(qkv_got, qkv, (size_t)FZ_SEQS * qkv_dim * sizeof *qkv); // not rotated
    void *h1 = malloc(pool_elems * elem), *h2 = malloc(pool_elems * elem);
    void *h3 = malloc(pool_elems * elem);
    for (int kvi = 0; kvi < 2; kvi++) {
        from_dev(h1, kvi ? vref : kref, pool_elems * elem);
        from_dev(h2, kvi ? vf : kf, pool_elems * elem);
        from_dev(h3, kvi ? vs : ks, pool_elems * elem);
        assert_memory_equal(h1, h3, pool_elems * elem);
        assert_memory_equal(h2, h1, pool_elems * elem);
        // The padding row stored nothing: only the six new rows changed.
        const uint8_t *a = h1, *b = kvi ? pool_v : pool_k;
        size_t changed = 0;
        for (size_t i = 0; i < pool_elems; i++)
            changed += memcmp(a + i * elem, b + i * elem, elem) != 0;
        assert_true(changed > 0 && changed <= (size_t)(FZ_SEQS - 1) * kv_dim);
    }
    fz_attend(c, start, bt, slots, all, FZ_SEQS, qkv, qkv_dim, d_freq, FZ_FUSED, 1, kf, vf, bits,
              NULL);
    for (size_t i = 0; i < out_f; i++)
        assert_int_equal(bits[i], bf16_bits(ref[i]));
    // Alone: one split, either side of a split boundary, 22 splits.
    const int alone[4] = {1, 2, 3, 5};
    for (int i = 0; i < 4; i++) {
        fz_attend(c, start, bt, slots, &alone[i], 1, qkv, qkv_dim, d_freq, FZ_FUSED, 0, kf, vf, got,
                  NULL);
        assert_memory_equal(got, ref + (size_t)alone[i] * q_dim, (size_t)q_dim * sizeof *got);
    }
    printf("fused rope + store + decode attention, heads %d/%d head_dim %d kv %s: bitwise\n",
           c->n_heads, c->n_kv_heads, c->hd, bf16 ? "bf16" : "f32");
    tdm_cuda_dev_free(dev, kref), tdm_cuda_dev_free(dev, vref), tdm_cuda_dev_free(dev, kf);
    tdm_cuda_dev_free(dev, vf), tdm_cuda_dev_free(dev, ks), tdm_cuda_dev_free(dev, vs);
    tdm_cuda_dev_free(dev, d_freq), tdm_cuda_dev_free(dev, d_q), tdm_cuda_dev_free(dev, d_pos);
    tdm_cuda_dev_free(dev, d_slots);
    free(pool_k), free(pool_v), free(qkv), free(ref), free(got), free(qkv_ref), free(qkv_got);
    free(qkv_sep), free(bits), free(h1), free(h2), free(h3);
}

static void test_rope_store_fused(void **state)
{
    (void)state;
    const struct attn_case cases[] = {
        {7, 1, 64, TDM_CUK_KV_F32},
        {14, 2, 64, TDM_CUK_KV_BF16},
        {12, 1, 128, TDM_CUK_KV_F32}, // two decode blocks per KV head store the same row
        {4, 2, 16, TDM_CUK_KV_BF16},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_fused_case(&cases[i]);
    // RoPE inside attention serves decode-only batches.
    struct tdm_cuk_attn_args a = {.kv_type = TDM_CUK_KV_F32,
                                  .n_heads = 4,
                                  .n_kv_heads = 2,
                                  .head_dim = 64,
                                  .block_size = 16,
                                  .n_tiles = 1,
                                  .inv_freq = (const float *)&a,
                                  .slots = (const int32_t *)&a};
    assert_int_equal(tdm_cuk_attention(stream, &a), TDM_CUK_EINVAL);
    assert_non_null(strstr(tdm_cuk_errmsg(), "decode-only"));
    assert_int_equal(tdm_cuk_rope_kv_store(stream, TDM_CUK_KV_F32, NULL, 10, 2, 1, 4, NULL, NULL,
                                           NULL, 1, NULL, NULL, 16),
                     TDM_CUK_EINVAL);
}

// The decode kernel's split paths (issue 26 item 2), per sequence, in one
// batch: contexts of 1, 31, 32, 33, 40, 63, 64, 65 and 97 tokens (ending one
// before, at and one after split boundaries; a last split of one key, where
// most warps have none; a split of 8 keys; 4 splits), GQA groups 1 to 12 (a
// group of 9 to 12 runs as two blocks per KV head) with head_dim 64 and bf16
// KV (the product's) and with head_dim 128 and f32 KV, and the other two
// pairings at groups 1, 7, 9 and 12. Against the CPU backend's attention
// (2e-5, as test_attention); the sequences of 1, 32, 33 and 97 tokens alone
// are bitwise their rows of the batch; and at head_dim 64 with bf16 KV the
// fused decode (RoPE and the store inside, the new row read back from shared
// memory at several row positions of a split) is bitwise rope_kv_store then
// attention, pool included (test_rope_store_fused runs it alone). fz_attend
// checks the split counts are left zero after every launch. Sized for the
// emulator under ASan, where every shuffle is two fiber switches.
#define DS_SEQS 9
#define DS_BLOCKS 32

static void run_decode_splits_case(const struct attn_case *c, bool check_fused)
{
    static const int len[DS_SEQS] = {1, 31, 32, 33, 40, 63, 64, 65, 97};
    static const int alone[4] = {0, 2, 3, 8};
    const int layer = 0;
    bool bf16 = c->kv_type == TDM_CUK_KV_BF16;
    int q_dim = c->n_heads * c->hd, kv_dim = c->n_kv_heads * c->hd, qkv_dim = q_dim + 2 * kv_dim;
    size_t elem = bf16 ? 2 : 4, pool_elems = (size_t)DS_BLOCKS * kv_dim * FZ_BS;
    struct tdm_kv_cache *kv = attn_pool(c, 1, FZ_BS, DS_BLOCKS);
    // Old KV (bf16-exact for a bf16 pool: both sides attend over the same
    // numbers), the device pool a copy of the CPU's.
    float *hk = tdm_kv_k(kv, layer, 0), *hv = tdm_kv_v(kv, layer, 0);
    fill(hk, pool_elems, 1.0f);
    fill(hv, pool_elems, 1.0f);
    void *pool_k = malloc(pool_elems * elem), *pool_v = malloc(pool_elems * elem);
    for (size_t i = 0; i < pool_elems; i++) {
        if (bf16) {
            hk[i] = bf16_round(hk[i]);
            hv[i] = bf16_round(hv[i]);
            ((uint16_t *)pool_k)[i] = bf16_bits(hk[i]);
            ((uint16_t *)pool_v)[i] = bf16_bits(hv[i]);
        } else {
            ((float *)pool_k)[i] = hk[i];
            ((float *)pool_v)[i] = hv[i];
        }
    }
    // Each sequence's blocks: its own, scattered over the pool.
    int32_t bt[DS_SEQS * FZ_BT], slots[DS_SEQS];
    int start[DS_SEQS], next = 0, all[DS_SEQS];
    struct tdm_attn_seq aseqs[DS_SEQS];
    for (int s = 0; s < DS_SEQS; s++) {
        int nb = (len[s] + FZ_BS - 1) / FZ_BS;
        assert_true(nb <= FZ_BT && next + nb <= DS_BLOCKS);
        for (int b = 0; b < FZ_BT; b++)
            bt[s * FZ_BT + b] = b < nb ? (next + b) * 37 % DS_BLOCKS : 0;
        next += nb;
        start[s] = len[s] - 1;
        slots[s] = bt[s * FZ_BT + start[s] / FZ_BS] * FZ_BS + start[s] % FZ_BS;
        all[s] = s;
        aseqs[s] = (struct tdm_attn_seq){
            .row = s, .n_tokens = 1, .start_pos = start[s], .block_table = bt + s * FZ_BT};
    }
    float *qkv = malloc((size_t)DS_SEQS * qkv_dim * sizeof *qkv), inv_freq[64];
    fill(qkv, (size_t)DS_SEQS * qkv_dim, 2.0f);
    for (int r = 0; bf16 && r < DS_SEQS; r++)
        for (int i = q_dim; i < qkv_dim; i++)
            qkv[(size_t)r * qkv_dim + i] = bf16_round(qkv[(size_t)r * qkv_dim + i]);
    for (int i = 0; i < c->hd / 2; i++)
        inv_freq[i] = (float)(1.0 / pow(1000000.0, (double)(2 * i) / c->hd));
    float *d_freq = to_dev(inv_freq, sizeof inv_freq);
    size_t out_f = (size_t)DS_SEQS * q_dim;
    float *want = malloc(out_f * sizeof *want), *got = malloc(out_f * sizeof *got);
    float *fused = malloc(out_f * sizeof *fused), *one = malloc((size_t)q_dim * sizeof *one);

    // CPU: store the new rows, attend.
    cpu->kv_store(cpu_be(), kv, layer, aseqs, DS_SEQS, qkv + q_dim, qkv + q_dim + kv_dim, qkv_dim);
    cpu->attention(cpu_be(), kv, layer, aseqs, DS_SEQS, qkv, qkv_dim, want, c->n_heads,
                   c->n_kv_heads, c->hd, 1.0f / sqrtf((float)c->hd));
    // The device, the same batch: within the tolerance; each sequence alone: bitwise its row.
    void *kp = to_dev(pool_k, pool_elems * elem), *vp = to_dev(pool_v, pool_elems * elem);
    fz_attend(c, start, bt, slots, all, DS_SEQS, qkv, qkv_dim, d_freq, FZ_PLAIN, 0, kp, vp, got,
              NULL);
    float e = check_close("decode splits", got, want, out_f, 2e-5f);
    for (int i = 0; i < 4; i++) {
        int s = alone[i];
        fz_attend(c, start, bt, slots, &s, 1, qkv, qkv_dim, d_freq, FZ_PLAIN, 0, kp, vp, one, NULL);
        if (memcmp(one, got + (size_t)s * q_dim, (size_t)q_dim * sizeof *one) != 0)
            fail_msg("decode of %d tokens alone differs from its row in the batch", len[s]);
    }
    printf("decode splits, heads %d/%d head_dim %d kv %s: max error %g; alone: bitwise\n",
           c->n_heads, c->n_kv_heads, c->hd, bf16 ? "bf16" : "f32", e);
    // Fused = rope_kv_store then attention, bitwise: outputs and pools.
    if (check_fused) {
        void *kr = to_dev(pool_k, pool_elems * elem), *vr = to_dev(pool_v, pool_elems * elem);
        void *kf = to_dev(pool_k, pool_elems * elem), *vf = to_dev(pool_v, pool_elems * elem);
        fz_attend(c, start, bt, slots, all, DS_SEQS, qkv, qkv_dim, d_freq, FZ_SEPARATE, 0, kr, vr,
                  got, NULL);
        fz_attend(c, start, bt, slots, all, DS_SEQS, qkv, qkv_dim, d_freq, FZ_FUSED, 0, kf, vf,
                  fused, NULL);
        assert_memory_equal(fused, got, out_f * sizeof *got);
        void *h1 = malloc(pool_elems * elem), *h2 = malloc(pool_elems * elem);
        for (int kvi = 0; kvi < 2; kvi++) {
            from_dev(h1, kvi ? vr : kr, pool_elems * elem);
            from_dev(h2, kvi ? vf : kf, pool_elems * elem);
            assert_memory_equal(h1, h2, pool_elems * elem);
        }
        printf("  fused = rope_kv_store then attention: bitwise\n");
        tdm_cuda_dev_free(dev, kr), tdm_cuda_dev_free(dev, vr), tdm_cuda_dev_free(dev, kf);
        tdm_cuda_dev_free(dev, vf);
        free(h1), free(h2);
    }
    tdm_cuda_dev_free(dev, kp), tdm_cuda_dev_free(dev, vp), tdm_cuda_dev_free(dev, d_freq);
    free(pool_k), free(pool_v), free(qkv), free(want), free(got), free(fused), free(one);
    tdm_kv_free(kv);
}

static void test_decode_splits(void **state)
{
    (void)state;
    for (int group = 1; group <= 12; group++) {
        struct attn_case product = {2 * group, 2, 64, TDM_CUK_KV_BF16};
        struct attn_case wide = {2 * group, 2, 128, TDM_CUK_KV_F32};
        run_decode_splits_case(&product, true);
        run_decode_splits_case(&wide, false);
        if (group == 1 || group == 7 || group == 9 || group == 12) {
            struct attn_case narrow_f32 = {2 * group, 2, 64, TDM_CUK_KV_F32};
            struct attn_case wide_bf16 = {2 * group, 2, 128, TDM_CUK_KV_BF16};
            run_decode_splits_case(&narrow_f32, false);
            run_decode_splits_case(&wide_bf16, false);
        }
    }
}

// Export/import kernels: blocks in list order, widened exactly from bf16 and
// rounded to nearest even into it; other blocks untouched.
// The device argmax of greedy rows: the first largest by `>` (the sampler's
// rule): ties keep the lowest index, NaN never wins, a row with nothing above
// -inf gives 0; widths below, at and above one CTA's 256 threads, at and
// past a chunk (1024 columns: one launch, then a merge), ties across chunks
// and the real vocabulary (149 CTAs at batch 1); each row alone equals its row
// in the batch.
static void test_argmax_rows(void **state)
{
    (void)state;
    const int widths[] = {1, 255, 256, 1000, 1024, 1025, 2049, 151936};
    enum { N = 8 };
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
        int cols = widths[wi];
        size_t count = (size_t)N * cols;
        float *x = malloc(count * sizeof *x);
        assert_non_null(x);
        fill(x, count, 3.0f);
        int32_t want[N], got[N], alone;
        if (cols > 300) {
            // Row 1: a tie between a late and an earlier maximum (the earlier wins).
            x[1 * (size_t)cols + 700 % cols] = 50.0f;
            x[1 * (size_t)cols + 299] = 50.0f;
            // Row 2: NaN everywhere but one finite value near the end.
            for (int c = 0; c < cols; c++)
                x[2 * (size_t)cols + c] = NAN;
            x[2 * (size_t)cols + cols - 2] = -5.0f;
            // Row 3: nothing above -inf, a NaN among them.
            for (int c = 0; c < cols; c++)
                x[3 * (size_t)cols + c] = -INFINITY;
            x[3 * (size_t)cols + 17] = NAN;
            // Row 4: +inf once, late.
            x[4 * (size_t)cols + cols - 1] = INFINITY;
        }
        if (cols > 2048) {
            // Ties across chunks: the first chunk's index wins.
            x[6 * (size_t)cols + 1030] = 60.0f;
            x[6 * (size_t)cols + cols - 3] = 60.0f;
            x[7 * (size_t)cols + 5] = 60.0f;
            x[7 * (size_t)cols + 1030] = 60.0f;
        }
        for (int r = 0; r < N; r++) {
            const float *row = x + (size_t)r * cols;
            int32_t b = 0;
            float bv = -INFINITY;
            for (int c = 0; c < cols; c++)
                if (row[c] > bv) {
                    bv = row[c];
                    b = c;
                }
            want[r] = b;
        }
        if (cols > 2048) {
            assert_int_equal(want[6], 1030);
            assert_int_equal(want[7], 5);
        }
        if (cols > 300) {
            assert_int_equal(want[1], 299);
            assert_int_equal(want[2], cols - 2);
            assert_int_equal(want[3], 0);
            assert_int_equal(want[4], cols - 1);
        }
        float *d_x = to_dev(x, count * sizeof *x);
        int32_t *d_ids = dev_zeros(sizeof got);
        size_t sb = tdm_cuk_argmax_scratch(N, cols);
        assert_true(sb == 0 || cols > TDM_CUK_ARGMAX_CHUNK);
        void *d_scratch = sb ? dev_zeros(sb) : NULL;
        ok(tdm_cuk_argmax_rows(stream, d_x, N, cols, d_ids, d_scratch));
        from_dev(got, d_ids, sizeof got);
        assert_memory_equal(got, want, sizeof want);
#ifndef TDM_CUDA_TEST_GPU
        tdm_emu_launch_log(1);
#endif
        ok(tdm_cuk_argmax_rows(stream, d_x + 5 * (size_t)cols, 1, cols, d_ids, d_scratch));
        from_dev(&alone, d_ids, sizeof alone);
        assert_int_equal(alone, want[5]);
#ifndef TDM_CUDA_TEST_GPU
        // Batch 1 over the real vocabulary fills an H200's 132 SMs (149 CTAs).
        struct tdm_emu_launch l[2];
        size_t nl = tdm_emu_launches(l, 2);
        tdm_emu_launch_log(0);
        int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
        assert_int_equal(nl, chunks > 1 ? 2 : 1);
        assert_int_equal(l[0].ctas, (unsigned long long)chunks);
        if (cols == 151936)
            assert_true(l[0].ctas >= 132);
#endif
        tdm_cuda_dev_free(dev, d_x);
        tdm_cuda_dev_free(dev, d_ids);
        tdm_cuda_dev_free(dev, d_scratch);
        free(x);
    }
    assert_int_equal(tdm_cuk_argmax_rows(stream, NULL, 0, 10, NULL, NULL), TDM_CUK_EINVAL);
    assert_int_equal(
        tdm_cuk_argmax_rows(stream, (const float *)&state, 1, 5000, (int32_t *)&state, NULL),
        TDM_CUK_EINVAL); // several chunks and no scratch
}

// Device sampling (issue 26 item 1): the kernel's token = the CPU sampler's
// from the same row, for every kind of row and filter, several output
// positions, each row alone = in the batch; the kernel's launches: one CTA a
// row.
struct sample_case {
    float temperature, top_p, min_p;
    int top_k;
    float repetition, frequency, presence, bias;
    int min_tokens;
};

static void sample_row_fill(float *row, int cols, int kind)
{
    fill(row, (size_t)cols, kind == 5 ? 30.0f : 8.0f);
    switch (kind) {
    case 1: // ties: 9 distinct values
        for (int c = 0; c < cols; c++)
            row[c] = floorf(row[c]);
        break;
    case 2: // NaN and -inf among them
        for (int c = 0; c < cols; c += 5)
            row[c] = c % 2 ? -INFINITY : NAN;
        break;
    case 3: // nothing above -inf
        for (int c = 0; c < cols; c++)
            row[c] = -INFINITY;
        row[cols / 2] = NAN;
        break;
    case 4: // +inf once
        row[cols - 1] = INFINITY;
        break;
    case 6: // ties that a chunk's top_k slots hold: 32 distinct values
        for (int c = 0; c < cols; c++)
            row[c] = floorf(row[c] * 4.0f) / 4.0f;
        break;
    default:
        break;
    }
}

// A device's logprobs vs the CPU sampler's for the same row: the same count
// and top ids (exact comparisons of the same floats), each logprob within
// 2e-6 relative (a sum of 151 936 exponentials in another order; expf's last
// bits), both NaN where the row's sum is.
static double lp_max_rel; // the largest difference seen, relative

static void lp_close(float on_dev, float on_cpu, const char *what, int cols, int row, int j)
{
    if (on_dev == on_dev && on_cpu == on_cpu && isfinite(on_cpu))
        lp_max_rel = fmax(lp_max_rel, fabs((double)on_dev - on_cpu) / fmax(1.0, fabs(on_cpu)));
    bool same = (on_dev != on_dev && on_cpu != on_cpu) || on_dev == on_cpu ||
                fabsf(on_dev - on_cpu) <= 2e-6f * fmaxf(1.0f, fabsf(on_cpu));
    if (!same)
        fail_msg("cols %d row %d %s %d: device %.9g, CPU %.9g", cols, row, what, j, on_dev, on_cpu);
}

static void sample_lp_check(const struct tdm_draw_logprobs *got,
                            const struct tdm_sample_result *want, int k, int cols, int row)
{
    if (got->num_top != want->num_top)
        fail_msg("cols %d row %d: %d top logprobs on the device, %d on the CPU (%d asked)", cols,
                 row, got->num_top, want->num_top, k);
    lp_close(got->logprob, want->logprob, "token", cols, row, want->token);
    for (int j = 0; j < want->num_top; j++) {
        if (got->top_token[j] != want->top[j].token)
            fail_msg("cols %d row %d top %d: device token %d, CPU %d", cols, row, j,
                     got->top_token[j], want->top[j].token);
        lp_close(got->top_logprob[j], want->top[j].logprob, "top", cols, row, j);
    }
}

static void test_sample_rows(void **state)
{
    (void)state;
    // Filters, then the adjustments a device applies first: Qwen2.5's
    // generation_config (T 0.7, top_k 20, top_p 0.8, repetition 1.1), the
    // OpenAI penalties, logit bias, min_tokens over EOS and a stop id.
    static const struct sample_case cases[] = {
        {0.0f, 1.0f, 0.0f, 0, 1.0f, 0, 0, 0, 0},
        {1.0f, 1.0f, 0.0f, 0, 1.0f, 0, 0, 0, 0},
        {0.7f, 0.8f, 0.0f, 20, 1.1f, 0, 0, 0, 0},
        {0.7f, 0.9f, 0.0f, 0, 1.0f, 0.5f, 0.3f, 0, 0},
        {1.3f, 1.0f, 0.1f, 0, 1.0f, 0, 0, 4.0f, 0},
        {0.05f, 0.5f, 0.0f, 3, 1.5f, 0, 0, 0, 3},
        {1.0f, 0.3f, 0.02f, 50, 1.0f, 0, 0, 0, 0},
        {0.9f, 1.0f, 0.0f, 1, 1.0f, 0, 0, 0, 0},
        {1.0f, 0.999f, 0.0f, 100000, 1.2f, -0.4f, 0.6f, -2.0f, 2},
        {0.6f, 0.05f, 0.5f, 0, 1.0f, 0, 0, 0, 0},
        {0.0f, 1.0f, 0.0f, 0, 1.3f, 0.2f, 0, 1.0f, 1},
    };
    enum { NC = sizeof cases / sizeof cases[0], KINDS = 7 };
    const int widths[] = {1, 7, 1000, 4099, SAMPLE_VOCAB};
    for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
        int cols = widths[wi];
        // Every case on every kind of row at the smaller widths; at the real
        // vocabulary (the emulator runs each thread in turn) 11 rows, every
        // case and every kind among them at each position.
        int n = cols > 5000 ? NC : NC * KINDS;
        size_t count = (size_t)n * cols;
        float *x = malloc(count * sizeof *x), *work = malloc((size_t)cols * sizeof *work);
        struct tdm_draw_params *dp = malloc((size_t)n * sizeof *dp);
        int32_t *want = malloc((size_t)n * sizeof *want), *got = malloc((size_t)n * sizeof *got);
        // Rows asking logprobs: the CPU sampler's result, the device's, and
        // the asking rows' indices.
        struct tdm_sample_result *want_lp = malloc((size_t)n * sizeof *want_lp);
        struct tdm_draw_logprobs *got_lp = malloc((size_t)n * sizeof *got_lp);
        int32_t *lp_rows = malloc((size_t)n * sizeof *lp_rows);
        assert_true(want_lp && got_lp && lp_rows);
        int adj_room = cols + 40, words = (cols + 31) / 32;
        struct tdm_draw_adj *adj = malloc((size_t)n * adj_room * sizeof *adj);
        uint32_t *masks = malloc((size_t)n * words * sizeof *masks);
        assert_true(x && work && dp && want && got && adj && masks);
        int n_adj = 0, n_words = 0;
        for (int pos = 0; pos < 3; pos++) {
            int n_lp = 0;
            for (int r = 0; r < n; r++) {
                const struct sample_case *sc = &cases[(r + pos) % NC];
                float *row = x + (size_t)r * cols;
                sample_row_fill(row, cols, cols > 5000 ? r % KINDS : (r / NC) % KINDS);
                struct tdm_sampling_params p;
                tdm_sampling_params_default(&p);
                p.temperature = sc->temperature;
                p.top_p = sc->top_p;
                p.min_p = sc->min_p;
                p.top_k = sc->top_k < cols ? sc->top_k : 0;
                p.repetition_penalty = sc->repetition;
                p.frequency_penalty = sc->frequency;
                p.presence_penalty = sc->presence;
                p.min_tokens = sc->min_tokens;
                p.stop_token_ids[0] = cols - 1;
                p.num_stop_token_ids = 1;
                if (sc->bias != 0.0f) {
                    p.logit_bias[0] = (struct tdm_logit_bias){.token = cols / 3, .bias = sc->bias};
                    p.logit_bias[1] = (struct tdm_logit_bias){.token = 0, .bias = -sc->bias};
                    p.num_logit_bias = cols > 1 ? 2 : 1;
                }
                p.has_seed = true;
                p.seed = 7000u + (uint64_t)r * 31u + (uint64_t)wi;
                // Every other row asks logprobs (0, 1, 5 or 20 top entries),
                // one in three of them with a structured-output mask.
                static const int lp_asks[] = {0, 1, 5, 20};
                if ((r + pos) % 2 == 0)
                    p.logprobs = lp_asks[(r / 2 + pos) % 4];
                int32_t prompt[12], hist[3], eos = 0;
                for (int i = 0; i < 12; i++)
                    prompt[i] = (r * 13 + i * 7) % cols;
                for (int i = 0; i < 3; i++)
                    hist[i] = (r + 5 * i) % cols;
                struct tdm_sampler *s = NULL;
                assert_int_equal(tdm_sampler_new(&s, &p, cols, prompt, 12, &eos, 1), TDM_OK);
                tdm_sampler_replay(s, hist, (size_t)pos);
                int k = tdm_sampler_draw_prepare(s, &dp[r], adj + n_adj, adj_room);
                assert_true(k >= 0 && k <= adj_room);
                dp[r].adj_off = n_adj;
                n_adj += k;
                memcpy(work, row, (size_t)cols * sizeof *work);
                if ((r + pos) % 3 == 1) {
                    // Structured output: about 3 tokens of 5 allowed, token r
                    // always; the CPU masks the row (tdm_grammar_mask_apply's
                    // effect), then samples.
                    uint32_t *mk = masks + n_words;
                    for (int w = 0; w < words; w++)
                        mk[w] = (uint32_t)((frand() + 1.0) * 2147483647.0) |
                                (uint32_t)((frand() + 1.0) * 2147483647.0);
                    mk[(r % cols) / 32] |= 1u << ((r % cols) % 32);
                    for (int c = 0; c < cols; c++)
                        if (!((mk[c / 32] >> (c % 32)) & 1u))
                            work[c] = -INFINITY;
                    dp[r].mask_off = n_words;
                    dp[r].n_mask_words = words;
                    n_words += words;
                }
                want[r] = tdm_sampler_sample(s, work, &want_lp[r]);
                assert_int_equal(dp[r].logprobs, p.logprobs >= 0);
                if (p.logprobs >= 0)
                    lp_rows[n_lp++] = r;
                tdm_sampler_free(s);
            }
            float *d_x = to_dev(x, count * sizeof *x);
            struct tdm_draw_params *d_p = to_dev(dp, (size_t)n * sizeof *dp);
            struct tdm_draw_adj *d_adj = to_dev(adj, (size_t)(n_adj + 1) * sizeof *adj);
            uint32_t *d_masks = to_dev(masks, (size_t)(n_words + 1) * sizeof *masks);
            int32_t *d_ids = dev_zeros((size_t)n * sizeof *got);
            int32_t *d_lp_rows = to_dev(lp_rows, (size_t)(n_lp + 1) * sizeof *lp_rows);
            struct tdm_draw_logprobs *d_lp = dev_zeros((size_t)(n_lp + 1) * sizeof *d_lp);
            void *d_scratch = dev_garbage(tdm_cuk_sample_scratch(n, n_lp, cols));
#ifndef TDM_CUDA_TEST_GPU
            tdm_emu_launch_log(1);
#endif
            ok(tdm_cuk_sample_rows(stream, d_x, n, cols, d_p, dp, d_adj, d_masks, d_ids, d_lp_rows,
                                   n_lp, d_lp, d_scratch));
#ifndef TDM_CUDA_TEST_GPU
            // A CTA per 1 024 columns of each row (149 a row at the real
            // vocabulary: more than an H200's 132 SMs at batch 1), then one a
            // row; with a sampled row of top_k 0 or > KMAX (the split path)
            // every later one a CTA per chunk again: 4 top_k passes when such
            // a row has top_k > 0, the weights, 4 top_p passes (the last
            // draws) when one has top_p < 1; the logprobs' per chunk of an
            // asking row first and per asking row last.
            struct tdm_emu_launch l[16];
            int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
            bool split = false, walk_k = false, walk_p = false;
            for (int r = 0; r < n; r++) {
                if (dp[r].inv_t == 0.0f || (dp[r].top_k > 0 && dp[r].top_k <= TDM_CUK_SAMPLE_KMAX))
                    continue;
                split = true;
                walk_k |= dp[r].top_k > 0;
                walk_p |= dp[r].top_p < 1.0f;
            }
            assert_true(n_lp > 0 && split && walk_p);
            assert_true(walk_k || cols <= 50); // top_k 50 and 100 000 are cut to 0 below them
            size_t nl = tdm_emu_launches(l, 16), want_nl = 4 + 4 * walk_k + split + 4 * walk_p;
            assert_int_equal(nl, want_nl);
            assert_int_equal(l[0].ctas, (unsigned long long)n_lp * chunks);
            assert_int_equal(l[2].ctas, (unsigned long long)n);
            for (size_t j = 1; j + 1 < nl; j++)
                if (j != 2)
                    assert_int_equal(l[j].ctas, (unsigned long long)n * chunks);
            assert_int_equal(l[nl - 1].ctas, (unsigned long long)n_lp);
            tdm_emu_launch_log(0);
#endif
            from_dev(got, d_ids, (size_t)n * sizeof *got);
            from_dev(got_lp, d_lp, (size_t)n_lp * sizeof *got_lp);
            for (int r = 0; r < n; r++)
                if (got[r] != want[r])
                    fail_msg("cols %d pos %d row %d (T=%g k=%d p=%g min_p=%g): device %d, CPU %d",
                             cols, pos, r, dp[r].inv_t == 0 ? 0.0 : 1.0 / dp[r].inv_t, dp[r].top_k,
                             dp[r].top_p, dp[r].min_p, got[r], want[r]);
            for (int j = 0; j < n_lp; j++)
                sample_lp_check(&got_lp[j], &want_lp[lp_rows[j]], dp[lp_rows[j]].top_logprobs, cols,
                                lp_rows[j]);
            // A row alone (the last one, its logits again) = in the batch; at
            // position 2 (top_k 0, top_p 1) without the host's params (every
            // launch runs).
            int last = n - 1;
            assert_int_equal(
                tdm_cuda_dev_h2d(dev, d_x, x + (size_t)last * cols, (size_t)cols * sizeof *x),
                TDM_OK);
            int32_t zero = 0;
            assert_int_equal(tdm_cuda_dev_h2d(dev, d_lp_rows, &zero, sizeof zero), TDM_OK);
            int alone_lp = dp[last].logprobs ? 1 : 0;
            assert_true(pos != 2 || (dp[last].inv_t > 0.0f && dp[last].top_k == 0));
            ok(tdm_cuk_sample_rows(stream, d_x, 1, cols, d_p + last, pos == 2 ? NULL : dp + last,
                                   d_adj, d_masks, d_ids, d_lp_rows, alone_lp, d_lp, d_scratch));
            int32_t alone;
            from_dev(&alone, d_ids, sizeof alone);
            assert_int_equal(alone, want[last]);
            if (alone_lp) {
                struct tdm_draw_logprobs one;
                const struct tdm_draw_logprobs *in_batch = &got_lp[n_lp - 1];
                from_dev(&one, d_lp, sizeof one);
                assert_int_equal(one.num_top, in_batch->num_top);
                assert_memory_equal(&one.logprob, &in_batch->logprob, sizeof one.logprob);
                assert_memory_equal(one.top_token, in_batch->top_token,
                                    (size_t)one.num_top * sizeof *one.top_token);
                assert_memory_equal(one.top_logprob, in_batch->top_logprob,
                                    (size_t)one.num_top * sizeof *one.top_logprob);
            }
            tdm_cuda_dev_free(dev, d_lp_rows);
            tdm_cuda_dev_free(dev, d_lp);
            tdm_cuda_dev_free(dev, d_x);
            tdm_cuda_dev_free(dev, d_p);
            tdm_cuda_dev_free(dev, d_adj);
            tdm_cuda_dev_free(dev, d_ids);
            tdm_cuda_dev_free(dev, d_scratch);
            tdm_cuda_dev_free(dev, d_masks);
            n_adj = n_words = 0;
        }
        free(x), free(work), free(dp), free(want), free(got), free(adj), free(masks);
        free(want_lp), free(got_lp), free(lp_rows);
    }
    assert_int_equal(
        tdm_cuk_sample_rows(stream, NULL, 0, 10, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL),
        TDM_CUK_EINVAL);
    assert_int_equal(tdm_cuk_sample_rows(stream, (float *)&state, 1, 10, NULL, NULL, NULL, NULL,
                                         NULL, NULL, 0, NULL, NULL),
                     TDM_CUK_EINVAL); // no scratch
    assert_int_equal(tdm_cuk_sample_rows(stream, (float *)&state, 1, 10, NULL, NULL, NULL, NULL,
                                         NULL, NULL, 1, NULL, (void *)&state),
                     TDM_CUK_EINVAL); // logprobs asked, nowhere to put them
    print_message("sample_rows logprobs: max difference %.3g relative to the CPU sampler's\n",
                  lp_max_rel);
}

// Boundaries of the definition, on three tokens at ids at[0..2], every other
// logit -inf, T 1, a flavour a row:
//   0. top_p's bound met exactly: weights 2^31 (logit 0, at[1]) and twice 2^30
//      (the logit whose draw_exp is exactly 0.5), top_p 0.5: the bound is
//      2^31, the mass heavier than the 2^30 tokens, so they are dropped (vLLM
//      drops a token whose preceding mass reaches p): every draw is at[1];
//   1. top_p's floor between two weights 64 apart (logits -0.7 and the float
//      below it: the same top 24 bits), top_p 0.6: the lighter one dropped
//      (every other such row with a key that would draw it if kept);
//   2. the draw's target equal to a running sum (three weights 2^31, top_p 1,
//      keys set to give targets 2^31, 2^32 and 0): the token is the first
//      whose running sum exceeds it, at[1], at[2] and at[0].
// In one chunk, then at the real vocabulary with the tokens in the first, a
// middle and the last chunk (the split path's walks and chunk pick), once
// with top_k 100 (its count walk too). The CPU sampler agrees on flavours 0
// and 1 (it takes its key from the seed).
static void test_sample_rows_boundary(void **state)
{
    (void)state;
    enum { N = 15 }; // 6 of them at the real vocabulary (slow under ASan's emulator)
    const float half = -0.693147182f, a = -0.7f, b = nextafterf(a, -INFINITY);
    assert_true(tdm_draw_weight(half, 0.0f, 1.0f, 0.0f) == TDM_DRAW_ONE / 2);
    uint32_t qa = tdm_draw_weight(a, 0.0f, 1.0f, 0.0f), qb = tdm_draw_weight(b, 0.0f, 1.0f, 0.0f);
    assert_true(qb < qa && qa >> 8 == qb >> 8);
    const uint64_t keys[3] = {0x5555555555555556ull, 0xAAAAAAAAAAAAAAABull, 0};
    const int widths[] = {40, SAMPLE_VOCAB, SAMPLE_VOCAB};
    for (int wi = 0; wi < 3; wi++) {
        int cols = widths[wi], at[3] = {0, cols > 40 ? SAMPLE_MID : 1, cols > 40 ? cols - 1 : 2};
        int n = cols > 40 ? 6 : N;
        float *x = malloc((size_t)N * cols * sizeof *x),
              *work = malloc((size_t)cols * sizeof *work);
        assert_true(x && work);
        struct tdm_draw_params dp[N];
        int32_t got[N], want[N];
        for (int r = 0; r < n; r++) {
            int flavour = r % 3;
            float *row = x + (size_t)r * cols;
            for (int c = 0; c < cols; c++)
                row[c] = -INFINITY;
            const float three[3][3] = {{half, 0.0f, half}, {a, 0.0f, b}, {0.0f, 0.0f, 0.0f}};
            for (int j = 0; j < 3; j++)
                row[at[j]] = three[flavour][j];
            struct tdm_sampling_params p;
            tdm_sampling_params_default(&p);
            p.top_p = flavour == 0 ? 0.5f : flavour == 1 ? 0.6f : 1.0f;
            p.top_k = wi == 2 ? 100 : 0;
            p.has_seed = true;
            p.seed = (uint64_t)r + 100u * (uint64_t)wi;
            struct tdm_sampler *s = NULL;
            assert_int_equal(tdm_sampler_new(&s, &p, cols, NULL, 0, NULL, 0), TDM_OK);
            assert_true(tdm_sampler_draw_params(s, &dp[r]));
            memcpy(work, row, (size_t)cols * sizeof *work);
            want[r] = tdm_sampler_sample(s, work, NULL);
            if (flavour == 0)
                assert_int_equal(want[r], at[1]);
            else if (flavour == 1)
                assert_true(want[r] == at[0] || want[r] == at[1]);
            if (flavour == 1 && r % 2 == 0) {
                // A key high enough that the lighter token, kept, would be drawn.
                dp[r].key = 0xF000000000000000ull;
                want[r] = at[1];
            } else if (flavour == 2) {
                dp[r].key = keys[(r / 3 + wi) % 3];
                want[r] = at[(r / 3 + wi + 1) % 3];
            }
            tdm_sampler_free(s);
        }
        float *d_x = to_dev(x, (size_t)n * cols * sizeof *x);
        struct tdm_draw_params *d_p = to_dev(dp, (size_t)n * sizeof *dp);
        int32_t *d_ids = dev_zeros(sizeof got);
        void *d_scratch = dev_garbage(tdm_cuk_sample_scratch(n, 0, cols));
        ok(tdm_cuk_sample_rows(stream, d_x, n, cols, d_p, dp, NULL, NULL, d_ids, NULL, 0, NULL,
                               d_scratch));
        from_dev(got, d_ids, (size_t)n * sizeof *got);
        for (int r = 0; r < n; r++)
            if (got[r] != want[r])
                fail_msg("cols %d top_k %d row %d: device %d, want %d", cols, dp[r].top_k, r,
                         got[r], want[r]);
        tdm_cuda_dev_free(dev, d_scratch);
        tdm_cuda_dev_free(dev, d_x);
        tdm_cuda_dev_free(dev, d_p);
        tdm_cuda_dev_free(dev, d_ids);
        free(x), free(work);
    }
}

static void test_kv_gather_scatter(void **state)
{
    (void)state;
    enum { NB = 6, BE = 40 };
    uint16_t pool[NB * BE], back[NB * BE];
    for (int i = 0; i < NB * BE; i++)
        pool[i] = bf16_bits(frand());
    int32_t list[3] = {4, 1, 3};
    float out[3 * BE], in[2 * BE];
    uint16_t *d_pool = to_dev(pool, sizeof pool);
    int32_t *d_list = to_dev(list, sizeof list);
    float *d_buf = dev_zeros(sizeof out);
    ok(tdm_cuk_kv_gather(stream, TDM_CUK_KV_BF16, d_pool, d_list, 3, BE, d_buf));
    from_dev(out, d_buf, sizeof out);
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < BE; i++)
            assert_true(out[b * BE + i] == bf16_value(pool[list[b] * BE + i]));
    fill(in, 2 * BE, 3.0f);
    // f32 -> bf16: round to nearest even, ties, specials.
    const float specials[8] = {1.0f,
                               -2.5f,
                               1.00390625f /* tie: 1 + 2^-8, to even */,
                               1.01171875f /* tie: to odd+1 */,
                               INFINITY,
                               -INFINITY,
                               NAN,
                               3.4e38f};
    memcpy(in, specials, sizeof specials);
    int32_t list2[2] = {5, 0};
    assert_int_equal(tdm_cuda_dev_h2d(dev, d_list, list2, sizeof list2), TDM_OK);
    assert_int_equal(tdm_cuda_dev_h2d(dev, d_buf, in, sizeof in), TDM_OK);
    ok(tdm_cuk_kv_scatter(stream, TDM_CUK_KV_BF16, d_pool, d_list, 2, BE, d_buf));
    from_dev(back, d_pool, sizeof back);
    for (int i = 0; i < NB * BE; i++) {
        int blk = i / BE;
        uint16_t want = blk == 5   ? bf16_bits(in[i % BE])
                        : blk == 0 ? bf16_bits(in[BE + i % BE])
                                   : pool[i];
        assert_int_equal(back[i], want);
    }
    assert_int_equal(back[5 * BE + 2], 0x3f80); // 1 + 2^-8 rounds down to even 1.0
    assert_int_equal(back[5 * BE + 3], 0x3f82); // 1 + 2^-7 + 2^-8 rounds up to even
    assert_int_equal(tdm_cuk_kv_gather(stream, TDM_CUK_KV_BF16, d_pool, d_list, 0, BE, d_buf),
                     TDM_CUK_EINVAL);
    tdm_cuda_dev_free(dev, d_pool), tdm_cuda_dev_free(dev, d_list), tdm_cuda_dev_free(dev, d_buf);
}

// A drawn row's pending token (sample_draw.h's TDM_DRAW_ADJ_PENDING) resolved
// on the device (tdm_cuk_resolve_pending) from the previous forward's ids:
// each row's entries and n_adj as the host's tdm_draw_resolve_pending leaves
// them: merged into an entry past the block's threads (index 250 of 300),
// at index 0 (with a bias and a mask kept), a new token, a row of the pending
// entry alone; rows without one (three entries, or none) untouched.
static void test_resolve_pending(void **state)
{
    (void)state;
    enum { ROWS = 6, BIG = 300, TOTAL = 2 * (BIG + 1) + 3 + 1 + 3 };
    static struct tdm_draw_adj adj[TOTAL], want[TOTAL], got[TOTAL];
    struct tdm_draw_params params[ROWS], wantp[ROWS], gotp[ROWS];
    const int32_t prev[4] = {7 * 250, 5, 42, 11};
    int at = 0;
    for (int r = 0; r < ROWS; r++) {
        params[r] = (struct tdm_draw_params){.adj_off = at};
        int n = r < 2 ? BIG : r == 2 ? 3 : r == 3 ? 0 : r == 4 ? 0 : 2;
        for (int i = 0; i < n; i++)
            adj[at++] = (struct tdm_draw_adj){.token = r == 5 && i == 0 ? 11 : 7 * i,
                                              .flags = r == 5 && i == 0
                                                           ? TDM_DRAW_ADJ_BIAS | TDM_DRAW_ADJ_MASKED
                                                           : TDM_DRAW_ADJ_SEEN,
                                              .count = (uint32_t)(i % 3),
                                              .bias = 0.5f};
        if (r != 2 && r != 3) // row 2: none; row 3: no entries at all
            adj[at++] = (struct tdm_draw_adj){.token = r == 0   ? 0
                                                       : r == 1 ? 1
                                                       : r == 4 ? 2
                                                                : 3,
                                              .flags = TDM_DRAW_ADJ_PENDING | TDM_DRAW_ADJ_SEEN,
                                              .count = 1};
        params[r].n_adj = at - params[r].adj_off;
    }
    assert_int_equal(at, TOTAL);
    memcpy(want, adj, sizeof adj);
    memcpy(wantp, params, sizeof params);
    for (int r = 0; r < ROWS; r++) {
        struct tdm_draw_adj *a = want + wantp[r].adj_off;
        int32_t n = wantp[r].n_adj;
        if (n > 0 && (a[n - 1].flags & TDM_DRAW_ADJ_PENDING))
            tdm_draw_resolve_pending(a, &wantp[r].n_adj, prev[a[n - 1].token]);
    }
    assert_int_equal(wantp[0].n_adj, BIG); // merged
    assert_int_equal(want[250].count, 250 % 3 + 1);
    assert_int_equal(wantp[1].n_adj, BIG + 1); // new
    assert_int_equal(want[wantp[1].adj_off + BIG].token, 5);
    assert_int_equal(wantp[4].n_adj, 1);
    assert_int_equal(wantp[5].n_adj, 2);
    assert_int_equal(want[wantp[5].adj_off].flags,
                     TDM_DRAW_ADJ_BIAS | TDM_DRAW_ADJ_MASKED | TDM_DRAW_ADJ_SEEN);
    struct tdm_draw_params *d_params = to_dev(params, sizeof params);
    struct tdm_draw_adj *d_adj = to_dev(adj, sizeof adj);
    int32_t *d_prev = to_dev(prev, sizeof prev);
    ok(tdm_cuk_resolve_pending(stream, d_params, d_adj, d_prev, ROWS));
    from_dev(gotp, d_params, sizeof gotp);
    from_dev(got, d_adj, sizeof got);
    assert_memory_equal(gotp, wantp, sizeof gotp);
    for (int r = 0; r < ROWS; r++)
        assert_memory_equal(got + wantp[r].adj_off, want + wantp[r].adj_off,
                            (size_t)wantp[r].n_adj * sizeof *got);
    assert_int_equal(tdm_cuk_resolve_pending(stream, d_params, d_adj, d_prev, -1), TDM_CUK_EINVAL);
    ok(tdm_cuk_resolve_pending(stream, d_params, d_adj, d_prev, 0));
    tdm_cuda_dev_free(dev, d_params), tdm_cuda_dev_free(dev, d_adj), tdm_cuda_dev_free(dev, d_prev);
}

// Device lists (tdm_draw_params.list): list_bind loads a list_load row's
// entries into its list's region (300 of them: past the block's threads)
// and points the row there; a row reading its list gets the list's count;
// a row without a list is left alone. list_record then records each list
// row's drawn token by the host's rule (tdm_draw_record): merged into an
// entry, appended, appended to an empty list, nothing for a row without a
// list, and nothing when the row records nothing (rec 0 and 0).
static void test_list_kernels(void **state)
{
    (void)state;
    enum { ROWS = 5, BIG = 300, ARENA = 2048, STEP = 1500 };
    static struct tdm_draw_adj arena[ARENA], want[ARENA], got[ARENA];
    struct tdm_draw_params params[ROWS], wantp[ROWS], gotp[ROWS];
    int32_t list_n[8] = {0}, want_n[8], got_n[8];
    const int32_t at[ROWS] = {0, 512, -1, 1024, 1280};
    const int32_t ids[ROWS] = {7 * 120, 9, 3, 77, 5};
    memset(arena, 0, sizeof arena);
    for (int i = 0; i < BIG; i++) // row 0's entries, in the step's part
        arena[STEP + i] =
            (struct tdm_draw_adj){.token = 7 * i,
                                  .flags = i % 2 ? TDM_DRAW_ADJ_SEEN : TDM_DRAW_ADJ_BIAS,
                                  .count = 1,
                                  .bias = 0.25f};
    for (int i = 0; i < 5; i++) // list 2 as a step before left it
        arena[512 + i] = (struct tdm_draw_adj){.token = 100 + i, .flags = TDM_DRAW_ADJ_SEEN};
    list_n[1] = 5;
    for (int i = 0; i < 3; i++) // list 5 (row 4): read, records nothing
        arena[1280 + i] = (struct tdm_draw_adj){.token = 5 + i, .count = 2};
    list_n[4] = 3;
    params[0] = (struct tdm_draw_params){
        .adj_off = STEP, .n_adj = BIG, .list = 1, .list_load = 1, .rec_flags = TDM_DRAW_ADJ_SEEN};
    params[1] = (struct tdm_draw_params){.adj_off = 9, .n_adj = 77, .list = 2, .rec_count = 1};
    params[2] = (struct tdm_draw_params){.adj_off = STEP, .n_adj = 4};
    params[3] = (struct tdm_draw_params){
        .adj_off = STEP + BIG, .n_adj = 0, .list = 4, .list_load = 1, .rec_count = 1};
    params[4] = (struct tdm_draw_params){.list = 5};
    memcpy(want, arena, sizeof arena);
    memcpy(wantp, params, sizeof params);
    memcpy(want_n, list_n, sizeof list_n);
    for (int r = 0; r < ROWS; r++) {
        struct tdm_draw_params *d = &wantp[r];
        if (d->list <= 0)
            continue;
        if (d->list_load) {
            memcpy(want + at[r], want + d->adj_off, (size_t)d->n_adj * sizeof *want);
            want_n[d->list - 1] = d->n_adj;
        } else {
            d->n_adj = want_n[d->list - 1];
        }
        d->adj_off = at[r];
    }
    struct tdm_draw_params *d_params = to_dev(params, sizeof params);
    struct tdm_draw_adj *d_arena = to_dev(arena, sizeof arena);
    int32_t *d_at = to_dev(at, sizeof at), *d_n = to_dev(list_n, sizeof list_n);
    int32_t *d_ids = to_dev(ids, sizeof ids);
    ok(tdm_cuk_list_bind(stream, d_params, d_arena, d_at, d_n, ROWS));
    from_dev(gotp, d_params, sizeof gotp);
    from_dev(got, d_arena, sizeof got);
    from_dev(got_n, d_n, sizeof got_n);
    assert_memory_equal(gotp, wantp, sizeof gotp);
    assert_memory_equal(got, want, sizeof got);
    assert_memory_equal(got_n, want_n, sizeof got_n);
    for (int r = 0; r < ROWS; r++) {
        const struct tdm_draw_params *d = &wantp[r];
        if (d->list <= 0)
            continue;
        struct tdm_draw_adj *a = want + d->adj_off;
        int32_t n = d->n_adj, found = -1;
        for (int i = 0; i < n; i++)
            found = a[i].token == ids[r] ? i : found;
        tdm_draw_record(a, &n, ids[r], d->rec_flags, d->rec_count, found);
        want_n[d->list - 1] = n;
    }
    assert_int_equal(want[120].flags, TDM_DRAW_ADJ_BIAS | TDM_DRAW_ADJ_SEEN); // merged
    assert_int_equal(want_n[0], BIG);
    assert_int_equal(want_n[1], 6); // appended
    assert_int_equal(want[512 + 5].token, 9);
    assert_int_equal(want_n[3], 1); // appended to an empty list
    assert_int_equal(want_n[4], 3); // nothing recorded
    ok(tdm_cuk_list_record(stream, d_params, d_arena, d_ids, d_n, ROWS));
    from_dev(got, d_arena, sizeof got);
    from_dev(got_n, d_n, sizeof got_n);
    assert_memory_equal(got, want, sizeof got);
    assert_memory_equal(got_n, want_n, sizeof got_n);
    assert_int_equal(tdm_cuk_list_bind(stream, d_params, d_arena, d_at, d_n, -1), TDM_CUK_EINVAL);
    assert_int_equal(tdm_cuk_list_record(stream, d_params, d_arena, d_ids, NULL, 1),
                     TDM_CUK_EINVAL);
    ok(tdm_cuk_list_record(stream, d_params, d_arena, d_ids, d_n, 0));
    tdm_cuda_dev_free(dev, d_params), tdm_cuda_dev_free(dev, d_arena);
    tdm_cuda_dev_free(dev, d_at), tdm_cuda_dev_free(dev, d_n), tdm_cuda_dev_free(dev, d_ids);
}

static void test_attention_errors(void **state)
{
    (void)state;
    struct tdm_cuk_attn_args a = {.kv_type = TDM_CUK_KV_F32,
                                  .n_heads = 4,
                                  .n_kv_heads = 2,
                                  .head_dim = 96,
                                  .block_size = 16,
                                  .n_tiles = 1};
    assert_int_equal(tdm_cuk_attention(stream, &a), TDM_CUK_EINVAL);
    assert_non_null(strstr(tdm_cuk_errmsg(), "head_dim 96"));
    a.head_dim = 64;
    a.n_kv_heads = 3;
    assert_int_equal(tdm_cuk_attention(stream, &a), TDM_CUK_EINVAL);
    a.n_kv_heads = 2;
    a.kv_type = 7;
    assert_int_equal(tdm_cuk_attention(stream, &a), TDM_CUK_EINVAL);

    int32_t row[1] = {0}, ntok[1] = {0}, start[1] = {0}, dec[1], tiles[2];
    struct tdm_cuk_seq seqs[1];
    struct tdm_cuk_plan plan;
    assert_int_equal(tdm_cuk_attn_plan(row, ntok, start, 1, 4, 64, seqs, dec, tiles, 1, &plan),
                     TDM_CUK_EINVAL);
    ntok[0] = TDM_CUK_PREFILL_BQ + 1; // two tiles into room for one
    assert_int_equal(tdm_cuk_attn_plan(row, ntok, start, 1, 4, 64, seqs, dec, tiles, 1, &plan),
                     TDM_CUK_EINVAL);
    assert_int_equal(tdm_cuk_decode_splits(TDM_CUK_DECODE_PART), 1);
    assert_int_equal(tdm_cuk_decode_splits(TDM_CUK_DECODE_PART + 1), 2);
    assert_int_equal(tdm_cuk_decode_splits(1), 1);
}

static int group_setup(void **state)
{
    (void)state;
    char err[256];
    if (tdm_cuda_dev_open(&dev, 0, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "cuda_ops_test: %s\n", err);
        return -1;
    }
    stream = tdm_cuda_dev_stream(dev);
    printf("device: %s\n", tdm_cuda_dev_name(dev));
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    tdm_cuda_dev_close(dev);
    return 0;
}

int main(int argc, char **argv)
{
    tdm_test_filters(argc, argv);
    cpu_reference_path();
#ifdef TDM_CUDA_TEST_GPU
    if (tdm_cuda_dev_count() <= 0) {
        printf("cuda_ops_gpu_test: no GPU visible; skipped\n");
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_embed),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_silu_add_bf16),
        cmocka_unit_test(test_gemm),
        cmocka_unit_test(test_gemv),
        cmocka_unit_test(test_gemv_ctas),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_errors),
        cmocka_unit_test(test_prefill_mma),
        cmocka_unit_test(test_rope_store_fused),
        cmocka_unit_test(test_decode_splits),
        cmocka_unit_test(test_kv_gather_scatter),
        cmocka_unit_test(test_argmax_rows),
        cmocka_unit_test(test_sample_rows),
        cmocka_unit_test(test_sample_rows_boundary),
        cmocka_unit_test(test_resolve_pending),
        cmocka_unit_test(test_list_kernels),
    };
    return tdm_test_exit(tdm_run_group_tests(tests, group_setup, group_teardown));
}
