// SPDX-License-Identifier: Apache-2.0
// Tests for the CPU backend, run on every SIMD path this machine supports:
// each op against a naive double-precision reference written here (stated
// tolerances below), matmul batch invariance (a token's output row is bitwise
// the same for n = 1, 7 and 64 wherever it sits in the batch) and thread
// invariance (1 vs 2 threads bitwise), odd shapes (rows not a multiple of 16 or
// 64, odd cols), and paged attention with several sequences, scattered block
// tables and GQA groups 1, 2 and 7, where a prompt split into prefill chunks
// must give the outputs of one piece.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_skip.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cpu_backend.h"
#include "cpu_impl.h"
#include "cpu_probe.h"
#include "cpu_test_util.h"
#include "kv_cache.h"
#include "sanitizer.h"

static const struct tdm_backend_ops *ops = &tdm_cpu_backend_ops;

// ---- helpers (frand, fill, bf16_round, make_backend: cpu_test_util.h) -------------------

// Runs body once per supported ISA on be.
#define FOR_EACH_ISA(be, isa)                                                                      \
    for (int isa = 0; isa < TDM_CPU_ISA_COUNT; isa++)                                              \
        if (tdm_cpu_isa_supported((enum tdm_cpu_isa)isa) &&                                        \
            tdm_cpu_backend_set_isa(be, (enum tdm_cpu_isa)isa) == TDM_OK)

// The weights exactly as the backend holds them, for the reference.
static void effective_weights(const float *w, int rows, int cols, enum tdm_wtype t,
                              enum tdm_dtype src, double *out)
{
    for (int r = 0; r < rows; r++) {
        // The checkpoint value first (a bf16 source is already rounded).
#define SRCV(k)                                                                                    \
    (src == TDM_DTYPE_BF16 ? bf16_round(w[(size_t)r * cols + (k)]) : w[(size_t)r * cols + (k)])
        float amax = 0;
        for (int k = 0; k < cols; k++)
            amax = fmaxf(amax, fabsf(SRCV(k)));
        for (int k = 0; k < cols; k++) {
            float v = SRCV(k);
            if (t == TDM_W_BF16) {
                out[(size_t)r * cols + k] = bf16_round(v);
            } else if (t == TDM_W_Q8) {
                float q = amax > 0 ? nearbyintf(v * (127.0f / amax)) : 0;
                out[(size_t)r * cols + k] = q * (double)(amax / 127.0f);
            } else {
                out[(size_t)r * cols + k] = v;
            }
        }
    }
}

// Prepares a weight from an f32 matrix given as two stacked parts of dtype dt
// (scratch: [rows * cols] bf16 for the bf16 copy; unused, may be NULL, for f32).
static void prepare(struct tdm_backend *be, struct tdm_weight *w, const float *m, int rows,
                    int cols, enum tdm_wtype t, enum tdm_dtype dt, uint16_t *scratch)
{
    const void *src = m;
    if (dt == TDM_DTYPE_BF16) {
        for (size_t i = 0; i < (size_t)rows * cols; i++)
            scratch[i] = tdm_f32_to_bf16(m[i]);
        src = scratch;
    }
    size_t esz = dt == TDM_DTYPE_BF16 ? 2 : 4;
    int r1 = rows / 3;
    struct tdm_weight_src parts[2] = {
        {.data = src, .dtype = dt, .rows = r1},
        {.data = (const uint8_t *)src + (size_t)r1 * cols * esz, .dtype = dt, .rows = rows - r1},
    };
    char err[256] = "";
    int rc = r1 > 0 ? ops->prepare_weight(be, w, parts, 2, cols, t, err, sizeof err)
                    : ops->prepare_weight(be, w, &parts[1], 1, cols, t, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("prepare_weight: %s", err);
    assert_int_equal(w->rows, rows);
    assert_int_equal(w->cols, cols);
}

// ---- matmul --------------------------------------------------------------------------------
static const int shapes[][2] = {{1, 1},    {5, 3},    {16, 32},  {77, 45},
                                {130, 96}, {200, 67}, {64, 128}, {33, 1000}};

static void check_matmul_accuracy(struct tdm_backend *be, enum tdm_wtype t, int isa)
{
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int rows = shapes[si][0], cols = shapes[si][1], n = 9;
        float *wm = malloc(sizeof(float) * rows * cols);
        double *we = malloc(sizeof(double) * rows * cols);
        uint16_t *scratch = malloc(2 * (size_t)rows * cols);
        float *x = malloc(sizeof(float) * n * cols), *bias = malloc(sizeof(float) * rows);
        float *y = malloc(sizeof(float) * n * rows);
        fill(wm, (size_t)rows * cols, 0.5f);
        fill(x, (size_t)n * cols, 2.0f);
        fill(bias, rows, 1.0f);
        struct tdm_weight w;
        prepare(be, &w, wm, rows, cols, t, t == TDM_W_F32 ? TDM_DTYPE_F32 : TDM_DTYPE_BF16,
                scratch);
        effective_weights(wm, rows, cols, t, t == TDM_W_F32 ? TDM_DTYPE_F32 : TDM_DTYPE_BF16, we);
        ops->matmul(be, &w, si % 2 ? bias : NULL, x, y, n);
        // AVX-512 rounds activations to bf16 (relative error 2^-9 per product)
        // or quantizes them to int8 per 32-k block (error <= max|x|/254 per
        // element); the f32-activation paths have accumulation error only.
        double tol = isa >= TDM_CPU_ISA_AVX512 && t == TDM_W_BF16 ? 4e-3
                     : isa >= TDM_CPU_ISA_AVX512 && t == TDM_W_Q8 ? 1e-2
                                                                  : 1e-5;
        for (int i = 0; i < n; i++) {
            for (int r = 0; r < rows; r++) {
                double ref = si % 2 ? bias[r] : 0, mag = 0;
                for (int k = 0; k < cols; k++) {
                    double p = we[(size_t)r * cols + k] * x[(size_t)i * cols + k];
                    ref += p;
                    mag += fabs(p);
                }
                double got = y[(size_t)i * rows + r];
                if (fabs(got - ref) > tol * mag + 1e-6)
                    fail_msg("isa %s type %d shape %dx%d token %d row %d: %g vs %g (mag %g)",
                             tdm_cpu_isa_name((enum tdm_cpu_isa)isa), (int)t, rows, cols, i, r, got,
                             ref, mag);
            }
        }
        ops->release_weight(be, &w);
        free(wm), free(we), free(scratch), free(x), free(bias), free(y);
    }
}

static void test_matmul_accuracy(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    FOR_EACH_ISA(be, isa)
    {
        check_matmul_accuracy(be, TDM_W_F32, isa);
        check_matmul_accuracy(be, TDM_W_BF16, isa);
        check_matmul_accuracy(be, TDM_W_Q8, isa);
    }
    ops->destroy(be);
}

// Row i of y for x rows placed at different batch positions and batch sizes.
static void check_invariance(struct tdm_backend *be, struct tdm_backend *be1, enum tdm_wtype t,
                             int rows, int cols)
{
    const int N = 64;
    float *wm = malloc(sizeof(float) * rows * cols);
    uint16_t *scratch = malloc(2 * (size_t)rows * cols);
    float *x = malloc(sizeof(float) * N * cols), *bias = malloc(sizeof(float) * rows);
    float *y64 = malloc(sizeof(float) * N * rows), *y = malloc(sizeof(float) * N * rows);
    float *xb = malloc(sizeof(float) * 7 * cols);
    fill(wm, (size_t)rows * cols, 0.3f);
    fill(x, (size_t)N * cols, 3.0f);
    fill(bias, rows, 1.0f);
    struct tdm_weight w, w1;
    prepare(be, &w, wm, rows, cols, t, TDM_DTYPE_BF16, scratch);
    prepare(be1, &w1, wm, rows, cols, t, TDM_DTYPE_BF16, scratch);
    ops->matmul(be, &w, bias, x, y64, N);
    // 1 thread, whole batch.
    ops->matmul(be1, &w1, bias, x, y, N);
    assert_memory_equal(y, y64, sizeof(float) * N * rows);
    for (int i = 0; i < N; i += 5) {
        ops->matmul(be, &w, bias, x + (size_t)i * cols, y, 1);
        assert_memory_equal(y, y64 + (size_t)i * rows, sizeof(float) * rows);
        // Row i at position i % 7 of a batch of 7 other rows.
        int at = i % 7;
        for (int j = 0; j < 7; j++) {
            int src = j == at ? i : (i + 11 * j + 1) % N;
            memcpy(xb + (size_t)j * cols, x + (size_t)src * cols, sizeof(float) * cols);
        }
        ops->matmul(be, &w, bias, xb, y, 7);
        assert_memory_equal(y + (size_t)at * rows, y64 + (size_t)i * rows, sizeof(float) * rows);
    }
    // A sub-batch starting at an odd offset (tiles fall differently).
    ops->matmul(be, &w, bias, x + (size_t)3 * cols, y, N - 3);
    assert_memory_equal(y, y64 + (size_t)3 * rows, sizeof(float) * (N - 3) * rows);
    ops->release_weight(be, &w);
    ops->release_weight(be1, &w1);
    free(wm), free(scratch), free(x), free(bias), free(y64), free(y), free(xb);
}

static void test_matmul_batch_invariance(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2), *be1 = make_backend(ops, 1);
    FOR_EACH_ISA(be, isa)
    {
        assert_int_equal(tdm_cpu_backend_set_isa(be1, (enum tdm_cpu_isa)isa), TDM_OK);
        for (enum tdm_wtype t = TDM_W_F32; t <= TDM_W_Q8; t++) {
            check_invariance(be, be1, t, 200, 67);
            check_invariance(be, be1, t, 96, 130);
        }
    }
    ops->destroy(be);
    ops->destroy(be1);
}

static void test_prepare_errors(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 1);
    float m[4] = {1, 2, 3, 4};
    struct tdm_weight w;
    struct tdm_weight_src part = {.data = m, .dtype = TDM_DTYPE_F32, .rows = 2};
    char err[128] = "";
    assert_int_equal(ops->prepare_weight(be, &w, &part, 1, 0, TDM_W_BF16, err, sizeof err),
                     TDM_EINVAL);
    assert_true(strlen(err) > 0);
    part.rows = 0;
    assert_int_equal(ops->prepare_weight(be, &w, &part, 1, 2, TDM_W_BF16, err, sizeof err),
                     TDM_EINVAL);
    part.rows = 2;
    assert_int_equal(ops->prepare_weight(be, &w, &part, 1, 2, (enum tdm_wtype)9, err, sizeof err),
                     TDM_EINVAL);
    // F16 source converts exactly.
    uint16_t h[4] = {0x3c00, 0xc000, 0x3800, 0x0001}; // 1, -2, 0.5, 2^-24
    struct tdm_weight_src hp = {.data = h, .dtype = TDM_DTYPE_F16, .rows = 2};
    assert_int_equal(ops->prepare_weight(be, &w, &hp, 1, 2, TDM_W_F32, err, sizeof err), TDM_OK);
    float out[4];
    int32_t ids[2] = {0, 1};
    ops->embed(be, &w, ids, 2, out);
    assert_true(out[0] == 1.0f && out[1] == -2.0f && out[2] == 0.5f && out[3] == ldexpf(1, -24));
    ops->release_weight(be, &w);
    ops->destroy(be);

    setenv("TANDEM_CPU_ISA", "bogus", 1);
    struct tdm_backend *b2 = NULL;
    assert_int_equal(ops->create(&b2, 1, 0, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "bogus"));
    setenv("TANDEM_CPU_ISA", "portable", 1);
    assert_int_equal(ops->create(&b2, 1, 0, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_cpu_backend_isa(b2), TDM_CPU_ISA_PORTABLE);
    ops->destroy(b2);
    unsetenv("TANDEM_CPU_ISA");
}

// Prepared weights copied out through weight_spans and adopted back (the
// packed-weight cache's path) give bitwise the same matmul; adopt refuses
// spans that do not fit the shape.
static void test_adopt_weight(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    const int rows = 130, cols = 67, n = 3;
    enum tdm_wtype types[3] = {TDM_W_BF16, TDM_W_Q8, TDM_W_F32};
    float *m = malloc((size_t)rows * cols * sizeof(float));
    uint16_t *scratch = malloc((size_t)rows * cols * sizeof(uint16_t));
    float x[3 * 67], y0[3 * 130], y1[3 * 130];
    assert_non_null(m);
    assert_non_null(scratch);
    fill(m, (size_t)rows * cols, 0.5f);
    fill(x, (size_t)n * cols, 1.0f);
    char err[256] = "";
    for (int t = 0; t < 3; t++) {
        struct tdm_weight w, a;
        prepare(be, &w, m, rows, cols, types[t], TDM_DTYPE_BF16, scratch);
        const void *ptr[2];
        size_t bytes[2];
        int nspans = ops->weight_spans(&w, ptr, bytes);
        assert_int_equal(nspans, types[t] == TDM_W_Q8 ? 2 : 1);
        void *copy[2] = {NULL, NULL};
        for (int i = 0; i < nspans; i++) {
            assert_int_equal(posix_memalign(&copy[i], 64, bytes[i]), 0);
            memcpy(copy[i], ptr[i], bytes[i]);
        }
        const void *cptr[2] = {copy[0], copy[1]};
        assert_int_equal(ops->adopt_weight(be, &a, types[t], rows, cols, cptr, bytes, nspans, err,
                                           sizeof err),
                         TDM_OK);
        assert_true(a.borrowed);
        assert_int_equal(a.nbytes, w.nbytes);
        ops->matmul(be, &w, NULL, x, y0, n);
        ops->matmul(be, &a, NULL, x, y1, n);
        assert_memory_equal(y0, y1, sizeof(float) * (size_t)n * rows);
        // Wrong sizes, counts, shapes and alignment are refused.
        size_t bad[2] = {bytes[0] - 64, bytes[1]};
        struct tdm_weight r;
        assert_int_equal(ops->adopt_weight(be, &r, types[t], rows, cols, cptr, bad, nspans, err,
                                           sizeof err),
                         TDM_EINVAL);
        assert_int_equal(ops->adopt_weight(be, &r, types[t], rows + 64, cols, cptr, bytes, nspans,
                                           err, sizeof err),
                         TDM_EINVAL);
        assert_int_equal(ops->adopt_weight(be, &r, types[t], rows, cols, cptr, bytes, 3 - nspans,
                                           err, sizeof err),
                         TDM_EINVAL);
        const void *odd[2] = {(const uint8_t *)copy[0] + 4, copy[1]};
        assert_int_equal(ops->adopt_weight(be, &r, types[t], rows, cols, odd, bytes, nspans, err,
                                           sizeof err),
                         TDM_EINVAL);
        ops->release_weight(be, &a); // frees nothing: the copies are ours
        for (int i = 0; i < nspans; i++)
            free(copy[i]);
        ops->release_weight(be, &w);
    }
    assert_true(ops->layout_version > 0);
    free(m);
    free(scratch);
    ops->destroy(be);
}

// ---- embed and element-wise ops ------------------------------------------------------------
static void test_embed(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    int rows = 70, cols = 33;
    float *wm = malloc(sizeof(float) * rows * cols);
    double *we = malloc(sizeof(double) * rows * cols);
    uint16_t *scratch = malloc(2 * (size_t)rows * cols);
    float out[4 * 33];
    fill(wm, (size_t)rows * cols, 1.0f);
    int32_t ids[4] = {0, 69, 17, 64};
    for (enum tdm_wtype t = TDM_W_F32; t <= TDM_W_Q8; t++) {
        struct tdm_weight w;
        prepare(be, &w, wm, rows, cols, t, TDM_DTYPE_F32, scratch);
        effective_weights(wm, rows, cols, t, TDM_DTYPE_F32, we);
        ops->embed(be, &w, ids, 4, out);
        for (int i = 0; i < 4; i++)
            for (int k = 0; k < cols; k++)
                assert_float_equal(out[i * cols + k], we[(size_t)ids[i] * cols + k], 1e-6);
        // An out-of-range id yields zeros, never an out-of-bounds read.
        int32_t bad = 70;
        ops->embed(be, &w, &bad, 1, out);
        assert_true(out[0] == 0.0f && out[cols - 1] == 0.0f);
        ops->release_weight(be, &w);
    }
    free(wm), free(we), free(scratch);
    ops->destroy(be);
}

static void test_rmsnorm_silu_add(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    int n = 40, dim = 899, inter = 1001;
    float *x = malloc(sizeof(float) * n * dim), *wt = malloc(sizeof(float) * dim);
    float *o = malloc(sizeof(float) * n * dim), *gu = malloc(sizeof(float) * n * 2 * inter);
    float *s = malloc(sizeof(float) * n * inter), *a = malloc(sizeof(float) * n * dim);
    FOR_EACH_ISA(be, isa)
    {
        fill(x, (size_t)n * dim, 4.0f);
        fill(wt, dim, 1.5f);
        ops->rmsnorm(be, x, wt, 1e-6f, o, n, dim);
        for (int t = 0; t < n; t++) {
            double ss = 0;
            for (int i = 0; i < dim; i++)
                ss += (double)x[t * dim + i] * x[t * dim + i];
            double inv = 1.0 / sqrt(ss / dim + 1e-6);
            for (int i = 0; i < dim; i++) {
                double ref = x[t * dim + i] * inv * wt[i];
                assert_float_equal(o[t * dim + i], ref, 1e-5 * (fabs(ref) + 1e-3));
            }
        }
        // In place gives the same bits; one row alone gives the same bits.
        memcpy(a, x, sizeof(float) * n * dim);
        ops->rmsnorm(be, a, wt, 1e-6f, a, n, dim);
        assert_memory_equal(a, o, sizeof(float) * n * dim);
        ops->rmsnorm(be, x + 5 * dim, wt, 1e-6f, a, 1, dim);
        assert_memory_equal(a, o + 5 * dim, sizeof(float) * dim);

        fill(gu, (size_t)n * 2 * inter, 12.0f);
        gu[0] = -100.0f, gu[1] = 100.0f; // saturating exp
        ops->silu_mul(be, gu, s, n, inter);
        for (int t = 0; t < n; t++) {
            for (int i = 0; i < inter; i++) {
                double g = gu[(size_t)t * 2 * inter + i], u = gu[(size_t)t * 2 * inter + inter + i];
                double ref = g / (1 + exp(-g)) * u;
                assert_float_equal(s[(size_t)t * inter + i], ref, 2e-6 * fabs(ref) + 1e-30);
            }
        }
        ops->silu_mul(be, gu + 7 * 2 * inter, a, 1, inter);
        assert_memory_equal(a, s + 7 * inter, sizeof(float) * inter);

        size_t cnt = (size_t)n * dim;
        memcpy(a, x, sizeof(float) * cnt);
        ops->add(be, a, o, cnt);
        for (size_t i = 0; i < cnt; i++)
            assert_true(a[i] == x[i] + o[i]);

        // add_rmsnorm is add then rmsnorm, bit for bit (x and out), for a
        // batch run on the pool (n * dim >= 32768) and a single row.
        assert_non_null(ops->add_rmsnorm);
        float *b = malloc(sizeof(float) * cnt), *ob = malloc(sizeof(float) * cnt);
        assert_true(b && ob);
        const int row_counts[2] = {n, 1};
        for (int c = 0; c < 2; c++) {
            const int rows = row_counts[c];
            size_t rc = (size_t)rows * dim;
            memcpy(b, x, sizeof(float) * rc);
            memcpy(a, x, sizeof(float) * rc);
            ops->add_rmsnorm(be, b, o, wt, 1e-6f, ob, rows, dim);
            ops->add(be, a, o, rc);
            ops->rmsnorm(be, a, wt, 1e-6f, s, rows, dim);
            assert_memory_equal(b, a, sizeof(float) * rc);
            assert_memory_equal(ob, s, sizeof(float) * rc);
        }
        free(b), free(ob);
    }
    free(x), free(wt), free(o), free(gu), free(s), free(a);
    ops->destroy(be);
}

// matmul_silu_mul against matmul then silu_mul, bit for bit, on every path
// (the emulated AMX kernel too) and weight type: batches past the token chunk
// and with a ragged last token tile, a cols count that pads; below the fusing
// batch, or when inter is not whole blocks, it declines and writes nothing.
static void check_silu_fused(struct tdm_backend *be, const char *path, enum tdm_wtype t)
{
    static const int cases[][3] = {{64, 128, 45}, {77, 192, 96}, {600, 64, 33}, {300, 80, 16}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int n = cases[c][0], inter = cases[c][1], cols = cases[c][2];
        float *m = malloc(sizeof(float) * 2 * inter * cols), *x = malloc(sizeof(float) * n * cols);
        float *gu = malloc(sizeof(float) * n * 2 * inter),
              *want = malloc(sizeof(float) * n * inter);
        float *got = malloc(sizeof(float) * n * inter);
        fill(m, (size_t)2 * inter * cols, 0.5f);
        fill(x, (size_t)n * cols, 2.0f);
        struct tdm_weight w;
        prepare(be, &w, m, 2 * inter, cols, t, TDM_DTYPE_F32, NULL);
        ops->matmul(be, &w, NULL, x, gu, n);
        ops->silu_mul(be, gu, want, n, inter);
        for (int i = 0; i < n * inter; i++)
            got[i] = -12345.0f;
        bool fused = ops->matmul_silu_mul(be, &w, x, got, n);
        if (inter % CPU_BLOCK_ROWS != 0) {
            assert_false(fused);
            for (int i = 0; i < n * inter; i++)
                assert_true(got[i] == -12345.0f);
        } else {
            assert_true(fused);
            if (memcmp(got, want, sizeof(float) * n * inter) != 0)
                fail_msg("%s type %d: n %d inter %d cols %d: fused != matmul + silu_mul", path,
                         (int)t, n, inter, cols);
        }
        // Below the fusing batch the caller runs the two ops.
        assert_false(ops->matmul_silu_mul(be, &w, x, got, CPU_SILU_FUSE_MIN_TOKENS - 1));
        ops->release_weight(be, &w);
        free(m), free(x), free(gu), free(want), free(got);
    }
}

static void test_matmul_silu_fused(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    static const enum tdm_wtype types[] = {TDM_W_F32, TDM_W_BF16, TDM_W_Q8};
    FOR_EACH_ISA(be, isa)
    {
        for (int i = 0; i < 3; i++)
            check_silu_fused(be, tdm_cpu_isa_name((enum tdm_cpu_isa)isa), types[i]);
    }
    cpu_backend_use_amx_emu(be);
    check_silu_fused(be, "amx (emulated)", TDM_W_BF16);
    ops->destroy(be);
}

static void test_rope(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    int n = 9, heads = 3, hd = 64, stride = heads * hd + 10;
    float inv_freq[32];
    for (int i = 0; i < hd / 2; i++)
        inv_freq[i] = (float)(1.0 / pow(1000000.0, 2.0 * i / hd));
    int32_t pos[9] = {0, 1, 2, 17, 100, 1000, 4095, 30000, 131071};
    float *x = malloc(sizeof(float) * n * stride), *x0 = malloc(sizeof(float) * n * stride);
    fill(x0, (size_t)n * stride, 2.0f);
    memcpy(x, x0, sizeof(float) * n * stride);
    ops->rope(be, x, n, stride, heads, hd, pos, inv_freq);
    for (int t = 0; t < n; t++) {
        for (int h = 0; h < heads; h++) {
            const float *a = x0 + t * stride + h * hd;
            const float *b = x + t * stride + h * hd;
            for (int i = 0; i < hd / 2; i++) {
                double ang = (double)(float)((float)pos[t] * inv_freq[i]);
                double c = cos(ang), s = sin(ang);
                assert_float_equal(b[i], a[i] * c - a[i + hd / 2] * s, 2e-6);
                assert_float_equal(b[i + hd / 2], a[i + hd / 2] * c + a[i] * s, 2e-6);
            }
        }
        // Untouched padding after the heads.
        for (int i = heads * hd; i < stride; i++)
            assert_true(x[t * stride + i] == x0[t * stride + i]);
    }
    // The backend keeps the last call's cos/sin while the positions and
    // inv_freq stay (a forward's layers): a second call with them, a call
    // with a position changed (in the same buffer) and one with another
    // inv_freq value each give the bits of a fresh backend's first call.
    float *y = malloc(sizeof(float) * n * stride), *z = malloc(sizeof(float) * n * stride);
    assert_true(y && z);
    for (int round = 0; round < 3; round++) {
        if (round == 1)
            pos[4] = 101;
        if (round == 2)
            inv_freq[5] *= 1.5f;
        memcpy(y, x0, sizeof(float) * n * stride);
        ops->rope(be, y, n, stride, heads, hd, pos, inv_freq);
        struct tdm_backend *fresh = make_backend(ops, 1);
        memcpy(z, x0, sizeof(float) * n * stride);
        ops->rope(fresh, z, n, stride, heads, hd, pos, inv_freq);
        ops->destroy(fresh);
        assert_memory_equal(y, z, sizeof(float) * n * stride);
        if (round == 0)
            assert_memory_equal(y, x, sizeof(float) * n * stride);
        else
            assert_memory_not_equal(y, x, sizeof(float) * n * stride);
    }
    free(y), free(z);
    free(x), free(x0);
    // A head wider than the per-row stack buffer (half 1024 > 512): one
    // token and five, against the same reference.
    for (int nn = 1; nn <= 5; nn += 4) {
        int whd = 2048, wst = whd;
        float *wf = malloc(sizeof(float) * whd / 2), *w0 = malloc(sizeof(float) * nn * wst),
              *w = malloc(sizeof(float) * nn * wst);
        assert_true(wf && w0 && w);
        for (int i = 0; i < whd / 2; i++)
            wf[i] = (float)(1.0 / pow(1000000.0, 2.0 * i / whd));
        fill(w0, (size_t)nn * wst, 2.0f);
        memcpy(w, w0, sizeof(float) * nn * wst);
        ops->rope(be, w, nn, wst, 1, whd, pos, wf);
        for (int t = 0; t < nn; t++)
            for (int i = 0; i < whd / 2; i++) {
                double ang = (double)(float)((float)pos[t] * wf[i]);
                double c = cos(ang), s = sin(ang);
                const float *a = w0 + t * wst, *b = w + t * wst;
                assert_float_equal(b[i], a[i] * c - a[i + whd / 2] * s, 2e-6);
                assert_float_equal(b[i + whd / 2], a[i + whd / 2] * c + a[i] * s, 2e-6);
            }
        free(wf), free(w0), free(w);
    }
    ops->destroy(be);
}

// ---- attention ----------------------------------------------------------------------------------
struct attn_case {
    int n_heads, n_kv_heads, head_dim, block_size;
};

// dtype: the pool's. For bf16 the reference reads K/V rounded to bf16 (what
// the pool holds), and the result must equal, bit for bit, an f32 pool fed
// those rounded rows: kv_store rounds to nearest even and the kernels widen
// exactly, then compute as in f32. tiles: the path runs attention on AMX
// tiles (cpu_amx_attn_body.h) for a bf16 pool, which carries q and the
// softmax weights p as two bf16 each (~16 bits; measured worst 5.6e-6 here,
// the f32 kernels' tolerance holds), and the f32 pool (per-query f32
// kernels there) is not expected to give the same bits. With q or p in one
// bf16 the worst was 1.8e-3 to 3.8e-3: this tolerance fails.
static void run_attention_case(struct tdm_backend *be, struct tdm_backend *be1,
                               const struct attn_case *c, const char *path, bool tiles,
                               enum tdm_kv_dtype dtype)
{
    tiles = tiles && dtype == TDM_KV_BF16;
    const int n_seqs = 3, lens[3] = {1, 37, 150}, layers = 2, layer = 1;
    int nblocks_total = 0;
    for (int s = 0; s < n_seqs; s++)
        nblocks_total += (lens[s] + c->block_size - 1) / c->block_size;
    struct tdm_kv_config cfg = {.num_layers = layers,
                                .num_kv_heads = c->n_kv_heads,
                                .head_dim = c->head_dim,
                                .block_size = c->block_size,
                                .num_blocks = nblocks_total + 3,
                                .dtype = dtype};
    struct tdm_kv_cache *kv = NULL;
    char err[256] = "";
    if (tdm_kv_new(&kv, &cfg, err, sizeof err) != TDM_OK)
        fail_msg("kv: %s", err);
    // Scattered block tables: blocks handed out from the end, interleaved.
    int tables[3][64], next = cfg.num_blocks - 1;
    for (int b = 0; b < 64; b++)
        for (int s = 0; s < n_seqs; s++)
            if (b * c->block_size < lens[s])
                tables[s][b] = next--;
    int total = 0;
    for (int s = 0; s < n_seqs; s++)
        total += lens[s];
    int qd = c->n_heads * c->head_dim, kvd = c->n_kv_heads * c->head_dim;
    int qkv_stride = qd + 2 * kvd;
    float *qkv = malloc(sizeof(float) * total * qkv_stride);
    float *out1 = malloc(sizeof(float) * total * qd), *out2 = malloc(sizeof(float) * total * qd);
    fill(qkv, (size_t)total * qkv_stride, 1.5f);
    // ref: qkv with K and V as the pool holds them.
    float *ref_qkv = malloc(sizeof(float) * total * qkv_stride);
    memcpy(ref_qkv, qkv, sizeof(float) * total * qkv_stride);
    if (dtype == TDM_KV_BF16)
        for (int t = 0; t < total; t++)
            for (int e = qd; e < qkv_stride; e++)
                ref_qkv[(size_t)t * qkv_stride + e] =
                    tdm_bf16_to_f32(tdm_f32_to_bf16(ref_qkv[(size_t)t * qkv_stride + e]));

    // One piece: every sequence's whole prompt in one step.
    struct tdm_attn_seq seqs[3];
    int row = 0;
    for (int s = 0; s < n_seqs; s++) {
        seqs[s] = (struct tdm_attn_seq){
            .row = row, .n_tokens = lens[s], .start_pos = 0, .block_table = tables[s]};
        row += lens[s];
    }
    float scale = 1.0f / sqrtf((float)c->head_dim);
    ops->kv_store(be, kv, layer, seqs, n_seqs, qkv + qd, qkv + qd + kvd, qkv_stride);
    ops->attention(be, kv, layer, seqs, n_seqs, qkv, qkv_stride, out1, c->n_heads, c->n_kv_heads,
                   c->head_dim, scale);
    if (dtype == TDM_KV_BF16 && !tiles) {
        struct tdm_kv_config fc = cfg;
        fc.dtype = TDM_KV_F32;
        struct tdm_kv_cache *fkv = NULL;
        assert_int_equal(tdm_kv_new(&fkv, &fc, err, sizeof err), TDM_OK);
        ops->kv_store(be, fkv, layer, seqs, n_seqs, ref_qkv + qd, ref_qkv + qd + kvd, qkv_stride);
        ops->attention(be, fkv, layer, seqs, n_seqs, qkv, qkv_stride, out2, c->n_heads,
                       c->n_kv_heads, c->head_dim, scale);
        assert_memory_equal(out1, out2, sizeof(float) * total * qd);
        tdm_kv_free(fkv);
    }

    // Reference in double from the source rows (not the cache).
    int group = c->n_heads / c->n_kv_heads;
    double *sc = malloc(sizeof(double) * 160); // > every len: the longest crosses a span (128)
    for (int s = 0; s < n_seqs; s++) {
        for (int i = 0; i < lens[s]; i++) {
            const float *q = ref_qkv + (size_t)(seqs[s].row + i) * qkv_stride;
            for (int h = 0; h < c->n_heads; h++) {
                int kh = h / group;
                double mx = -1e300, sum = 0;
                for (int p = 0; p <= i; p++) {
                    const float *k = ref_qkv + (size_t)(seqs[s].row + p) * qkv_stride + qd;
                    double d = 0;
                    for (int e = 0; e < c->head_dim; e++)
                        d += (double)q[h * c->head_dim + e] * k[kh * c->head_dim + e];
                    sc[p] = d * scale;
                    mx = fmax(mx, sc[p]);
                }
                for (int p = 0; p <= i; p++)
                    sum += (sc[p] = exp(sc[p] - mx));
                for (int e = 0; e < c->head_dim; e++) {
                    double ref = 0;
                    for (int p = 0; p <= i; p++)
                        ref += sc[p] * ref_qkv[(size_t)(seqs[s].row + p) * qkv_stride + qd +
                                               kvd + kh * c->head_dim + e];
                    ref /= sum;
                    double got = out1[(size_t)(seqs[s].row + i) * qd + h * c->head_dim + e];
                    if (fabs(got - ref) > 2e-5 * (1 + fabs(ref)))
                        fail_msg("path %s kv %s heads %d/%d hd %d bs %d seq %d tok %d head %d dim "
                                 "%d: %g vs %g",
                                 path, tdm_kv_dtype_name(dtype), c->n_heads, c->n_kv_heads,
                                 c->head_dim, c->block_size, s, i, h, e, got, ref);
                }
            }
        }
    }

    // Several pieces: prefill chunks of 7 tokens, then decode-sized steps,
    // each step with all sequences that still have tokens.
    memset(out2, 0, sizeof(float) * total * qd);
    float *step_qkv = malloc(sizeof(float) * total * qkv_stride);
    float *step_out = malloc(sizeof(float) * total * qd);
    int done[3] = {0, 0, 0};
    for (int step = 0;; step++) {
        struct tdm_attn_seq ss[3];
        int ns = 0, r = 0;
        for (int s = 0; s < n_seqs; s++) {
            int left = lens[s] - done[s];
            if (left == 0)
                continue;
            int take = step < 3 ? (left < 7 ? left : 7) : 1;
            for (int i = 0; i < take; i++)
                memcpy(step_qkv + (size_t)(r + i) * qkv_stride,
                       qkv + (size_t)(seqs[s].row + done[s] + i) * qkv_stride,
                       sizeof(float) * qkv_stride);
            ss[ns++] = (struct tdm_attn_seq){
                .row = r, .n_tokens = take, .start_pos = done[s], .block_table = tables[s]};
            r += take;
        }
        if (ns == 0)
            break;
        ops->kv_store(be, kv, layer, ss, ns, step_qkv + qd, step_qkv + qd + kvd, qkv_stride);
        ops->attention(be, kv, layer, ss, ns, step_qkv, qkv_stride, step_out, c->n_heads,
                       c->n_kv_heads, c->head_dim, scale);
        for (int k = 0, s = 0; s < n_seqs; s++) {
            if (lens[s] == done[s])
                continue;
            memcpy(out2 + (size_t)(seqs[s].row + done[s]) * qd, step_out + (size_t)ss[k].row * qd,
                   sizeof(float) * ss[k].n_tokens * qd);
            done[s] += ss[k].n_tokens;
            k++;
        }
    }
    // Each query depends only on its position and the cache: bitwise equal.
    assert_memory_equal(out1, out2, sizeof(float) * total * qd);
    // And not on the number of threads (the cache now holds the same K/V).
    ops->attention(be1, kv, layer, seqs, n_seqs, qkv, qkv_stride, out2, c->n_heads, c->n_kv_heads,
                   c->head_dim, scale);
    assert_memory_equal(out1, out2, sizeof(float) * total * qd);
    free(step_qkv), free(step_out), free(sc), free(qkv), free(out1), free(out2), free(ref_qkv);
    tdm_kv_free(kv);
}

static void test_attention(void **state)
{
    (void)state;
    static const struct attn_case cases[] = {
        {4, 4, 64, 16},  // group 1
        {4, 2, 18, 5},   // group 2, head_dim not a multiple of 8, odd block size
        {14, 2, 64, 16}, // Qwen2.5-0.5B: group 7
        {7, 1, 128, 32}, // group 7, head_dim 128
        {2, 1, 2, 3},    // smallest head_dim
        {10, 2, 40, 16}, // group 5: heads in a four and a one
        {12, 1, 80, 16}, // group 12: a unit of 8 heads (4 + 4) and one of 4
    };
    struct tdm_backend *be = make_backend(ops, 2), *be1 = make_backend(ops, 1);
    FOR_EACH_ISA(be, isa)
    {
        assert_int_equal(tdm_cpu_backend_set_isa(be1, (enum tdm_cpu_isa)isa), TDM_OK);
        const char *name = tdm_cpu_isa_name((enum tdm_cpu_isa)isa);
        bool tiles = isa == TDM_CPU_ISA_AMX;
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            run_attention_case(be, be1, &cases[i], name, tiles, TDM_KV_F32);
            run_attention_case(be, be1, &cases[i], name, tiles, TDM_KV_BF16);
        }
    }
    // The tile kernel on the software tile model, on every host. Under
    // AddressSanitizer (where the model's TDPBF16PS runs ~25x slower: 3 min
    // for every case) only the cases whose head_dim pads to whole tiles (18,
    // 2, 40, 80: keys copied, block sizes 5 and 3 among them); the release
    // build's run (CI's last step) takes them all.
    cpu_backend_use_amx_emu(be);
    cpu_backend_use_amx_emu(be1);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (TDM_SANITIZE_ADDRESS && cases[i].head_dim % 32 == 0)
            continue;
        run_attention_case(be, be1, &cases[i], "amx-emu", true, TDM_KV_F32);
        run_attention_case(be, be1, &cases[i], "amx-emu", true, TDM_KV_BF16);
    }
    ops->destroy(be);
    ops->destroy(be1);
}

// attn_accum_span (where an ISA has it) gives each head exactly what
// attn_accum (attn_accum_bf16 for a bf16 span) gives it alone over the same
// runs, corr on the first and 1 on the others, for every group size, run
// layout and head_dim (masked tails included): attention's results must not
// depend on how many heads share a pass.
static void test_attn_accum_span(void **state)
{
    (void)state;
    static const int hds[] = {2, 18, 40, 64, 80, 128, 200};
    // Runs of value rows: one whole chunk, several chunks, short runs.
    static const int layouts[][5] = {{16}, {1}, {16, 16, 16}, {5, 16, 3}, {7, 1, 16, 16, 2}};
    static const int nruns[] = {1, 1, 3, 3, 5};
    enum { MAXH = 8, MAXD = 200, MAXK = 64 };
    float acc0[MAXH * MAXD], acc1[MAXH * MAXD], acc2[MAXH * MAXD], v[MAXK * MAXD];
    uint16_t vb[MAXK * MAXD];
    float p[MAXH][MAXK], corr[MAXH];
    struct tdm_backend *be = make_backend(ops, 1);
    int checked = 0;
    FOR_EACH_ISA(be, isa)
    {
        const struct cpu_kernels *k = be->k;
        if (!k->attn_accum_span)
            continue;
        for (size_t h = 0; h < sizeof hds / sizeof hds[0]; h++)
            for (size_t L = 0; L < sizeof nruns / sizeof nruns[0]; L++)
                for (int bf = 0; bf < 2; bf++)
                    for (int nh = 1; nh <= MAXH; nh++) {
                        int hd = hds[h], nrun = nruns[L], total = 0;
                        for (int r = 0; r < nrun; r++)
                            total += layouts[L][r];
                        fill(acc0, (size_t)nh * hd, 3.0f);
                        fill(v, (size_t)total * hd, 2.0f);
                        for (int e = 0; e < total * hd; e++)
                            vb[e] = tdm_f32_to_bf16(v[e]);
                        fill(&p[0][0], sizeof p / sizeof p[0][0], 1.0f);
                        fill(corr, MAXH, 1.0f);
                        // Runs in reverse memory order: each run is its own
                        // pointer, not a slice of one array read straight on.
                        const void *runs[5];
                        for (int r = 0, o = total; r < nrun; r++) {
                            o -= layouts[L][r];
                            runs[r] = bf ? (const void *)(vb + (size_t)o * hd)
                                         : (const void *)(v + (size_t)o * hd);
                        }
                        memcpy(acc1, acc0, sizeof(float) * nh * hd);
                        memcpy(acc2, acc0, sizeof(float) * nh * hd);
                        k->attn_accum_span(acc1, corr, &p[0][0], MAXK, runs, layouts[L], nrun,
                                           bf, nh, hd);
                        for (int g = 0; g < nh; g++)
                            for (int r = 0, o = 0; r < nrun; o += layouts[L][r], r++) {
                                float c = r == 0 ? corr[g] : 1.0f;
                                if (bf)
                                    k->attn_accum_bf16(acc2 + (size_t)g * hd, c, p[g] + o,
                                                       runs[r], layouts[L][r], hd);
                                else
                                    k->attn_accum(acc2 + (size_t)g * hd, c, p[g] + o, runs[r],
                                                  layouts[L][r], hd);
                            }
                        if (memcmp(acc1, acc2, sizeof(float) * nh * hd) != 0)
                            fail_msg("isa %s: %s span of %d heads, layout %zu, head_dim %d "
                                     "differs",
                                     tdm_cpu_isa_name((enum tdm_cpu_isa)isa), bf ? "bf16" : "f32",
                                     nh, L, hd);
                        checked++;
                    }
    }
    ops->destroy(be);
    // Where no ISA here has the kernel there is nothing to compare.
    if (checked == 0)
        TDM_SKIP("no ISA of this CPU has attn_accum_span (AVX-512)");
}

// A block id outside the pool is logged and skipped, never dereferenced:
// the query rows whose context needs it get zeros, the others stay finite. For a bf16 pool on the
// amx path (and its tile model) the tile kernel zeroes every row of the task that reaches the bad
// block (here all six tokens, one task).
static void check_attention_bad_block(struct tdm_backend *be, enum tdm_kv_dtype dtype, bool tiles)
{
    struct tdm_kv_config cfg = {.num_layers = 1,
                                .num_kv_heads = 1,
                                .head_dim = 4,
                                .block_size = 4,
                                .num_blocks = 2,
                                .dtype = dtype};
    struct tdm_kv_cache *kv = NULL;
    char err[128];
    assert_int_equal(tdm_kv_new(&kv, &cfg, err, sizeof err), TDM_OK);
    int table[2] = {0, 7};
    float qkv[6 * 12], out[6 * 8];
    fill(qkv, 6 * 12, 1.0f);
    memset(out, 0x7f, sizeof out);
    struct tdm_attn_seq seq = {.row = 0, .n_tokens = 6, .start_pos = 0, .block_table = table};
    ops->kv_store(be, kv, 0, &seq, 1, qkv + 8, qkv + 10, 12);
    ops->attention(be, kv, 0, &seq, 1, qkv, 12, out, 2, 1, 4, 0.5f);
    // Tokens 0..3 live in block 0 and are fine; 4 and 5 need block 7: zeros.
    for (int i = 0; i < 4 * 8; i++)
        assert_true(tiles ? out[i] == 0.0f : isfinite(out[i]));
    for (int i = 4 * 8; i < 6 * 8; i++)
        assert_true(out[i] == 0.0f);
    tdm_kv_free(kv);
}

static void test_attention_bad_block(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    FOR_EACH_ISA(be, isa)
    {
        check_attention_bad_block(be, TDM_KV_F32, false);
        check_attention_bad_block(be, TDM_KV_BF16, isa == TDM_CPU_ISA_AMX);
    }
    cpu_backend_use_amx_emu(be);
    check_attention_bad_block(be, TDM_KV_BF16, true);
    ops->destroy(be);
}

// The probes measure something plausible (bytes/s and FLOP/s well above 0).
static void test_probes(void **state)
{
    (void)state;
    double bw = tdm_cpu_probe_read_bw((size_t)16 << 20, 1, 1);
    assert_true(bw > 1e8);
    assert_true(tdm_cpu_probe_read_bw(0, 1, 1) == 0);
    if (tdm_cpu_isa_supported(TDM_CPU_ISA_AVX2))
        assert_true(tdm_cpu_probe_fma_peak(1) > 1e8);
    if (tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512))
        assert_true(tdm_cpu_probe_bf16_peak(1) > 1e8);
    else
        assert_true(tdm_cpu_probe_bf16_peak(1) == 0);
}

int main(int argc, char **argv)
{
    tdm_test_filters(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_accuracy),  cmocka_unit_test(test_matmul_batch_invariance),
        cmocka_unit_test(test_prepare_errors),   cmocka_unit_test(test_embed),
        cmocka_unit_test(test_rmsnorm_silu_add), cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention),        cmocka_unit_test(test_attention_bad_block),
        cmocka_unit_test(test_attn_accum_span),  cmocka_unit_test(test_matmul_silu_fused),
        cmocka_unit_test(test_probes),           cmocka_unit_test(test_adopt_weight),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, NULL, NULL));
}
