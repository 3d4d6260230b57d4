// SPDX-License-Identifier: Apache-2.0
// Tests for the AMX bf16 path. On every host: the tile model's arithmetic on
// hand-computed values (pair order, single rounding, denormal flush, tile
// load/store shapes); the tile kernel on that model, through the backend,
// bit for bit against a per-element statement of the same arithmetic and
// within f32 accumulation error of a double product, on ragged shapes (rows,
// cols and tokens not multiples of 16/32/64, odd cols, more tokens than one
// 512-token pass); its batch and thread invariance and the fused argmax. On
// an AVX-512 host: the model's bf16 conversion against vcvtne2ps2bf16. On an
// AMX host only (else they exit 77 as separate ctests): the real TDPBF16PS
// against the model on crafted and random tiles, and the real tile kernel
// against the emulated one and the AVX-512 one, the real tile attention
// against the emulated one.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_skip.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cpu_amx_emu.h"
#include "cpu_backend.h"
#include "cpu_impl.h"
#include "kv_cache.h"
#include "sanitizer.h"
#define CPU_TEST_SEED 0x2545f4914f6cdd1dull
#include "cpu_test_util.h"

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#define HAVE_REAL_AMX 1
#endif

static const struct tdm_backend_ops *ops = &tdm_cpu_backend_ops;

// ---- helpers (frand, fill, make_backend: cpu_test_util.h) ---------------------------------
static float bf(uint16_t h)
{
    return cpu_bf16_to_f32(h);
}

static uint16_t bits16(float f) // f must be a bf16 value
{
    return (uint16_t)(cpu_f32_bits(f) >> 16);
}

static void prepare_bf16(struct tdm_backend *be, struct tdm_weight *w, const float *m, int rows,
                         int cols)
{
    struct tdm_weight_src src = {.data = m, .dtype = TDM_DTYPE_F32, .rows = rows};
    char err[256] = "";
    if (ops->prepare_weight(be, w, &src, 1, cols, TDM_W_BF16, err, sizeof err) != TDM_OK)
        fail_msg("prepare_weight: %s", err);
}

// ---- the tile model on hand-computed values ------------------------------------------------
static void config(struct cpu_amx_cfg *c, int rows, int colsb)
{
    memset(c, 0, sizeof *c);
    c->palette = 1;
    for (int t = 0; t < CPU_AMX_TILES; t++) {
        c->rows[t] = (uint8_t)rows;
        c->colsb[t] = (uint16_t)colsb;
    }
}

static void test_emu_conversion_and_steps(void **state)
{
    (void)state;
    // bf16 rounding: nearest, ties to even; denormals to signed zero; NaN quiet.
    assert_int_equal(cpu_amx_emu_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(cpu_amx_emu_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80); // tie -> even (down)
    assert_int_equal(cpu_amx_emu_f32_to_bf16(1.0f + 0x3p-8f), 0x3f82); // tie -> even (up)
    assert_int_equal(cpu_amx_emu_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81); // above tie
    assert_int_equal(cpu_amx_emu_f32_to_bf16(-2.5f), 0xc020);
    assert_int_equal(cpu_amx_emu_f32_to_bf16(1e-40f), 0x0000);  // denormal
    assert_int_equal(cpu_amx_emu_f32_to_bf16(-1e-40f), 0x8000); // denormal, sign kept
    assert_int_equal(cpu_amx_emu_f32_to_bf16(FLT_MIN), 0x0080); // smallest normal stays
    assert_int_equal(cpu_amx_emu_f32_to_bf16(FLT_MAX), 0x7f80); // rounds to infinity
    assert_int_equal(cpu_amx_emu_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(cpu_amx_emu_f32_to_bf16(cpu_bits_f32(0x7f800001u)), 0x7fc0); // sNaN quieted

    // One FMA step rounds once: (1 + 2^-12)^2 - 1 = 2^-11 + 2^-24 exactly
    // (a product rounded first would give 2^-11).
    assert_true(cpu_amx_emu_fma(1.0f + 0x1p-12f, 1.0f + 0x1p-12f, -1.0f) == 0x1p-11f + 0x1p-24f);
    // DAZ on every input, FTZ on the result, FLT_MIN itself kept.
    assert_true(cpu_amx_emu_fma(1e-40f, 1e30f, 1.0f) == 1.0f);
    assert_true(cpu_amx_emu_fma(1.0f, 1.0f, 1e-40f) == 1.0f);
    assert_true(cpu_amx_emu_fma(0x1p-70f, 0x1p-70f, 0.0f) == 0.0f);
    assert_true(cpu_amx_emu_fma(0x1p-63f, 0x1p-63f, 0.0f) == FLT_MIN);
    assert_int_equal(cpu_f32_bits(cpu_amx_emu_fma(-0x1p-70f, 0x1p-70f, -0.0f)), 0x80000000u);
    assert_true(cpu_amx_emu_add(0x1p-100f, 1e-40f) == 0x1p-100f);
    assert_true(cpu_amx_emu_add(0x1.8p-126f, -0x1p-126f) == 0.0f); // 2^-127: denormal -> 0
    assert_true(cpu_amx_emu_add(FLT_MIN, -0x1p-127f) == FLT_MIN);  // a denormal input is 0
}

static void test_emu_dpbf16ps(void **state)
{
    (void)state;
    struct cpu_amx_emu e;
    struct cpu_amx_cfg c;
    // C 2x2 (8 bytes per row), A 2 x 2 pairs, B 2 pairs x 2 columns.
    config(&c, 2, 8);
    cpu_amx_emu_loadconfig(&e, &c, CPU_AMX_ORDER_SDM);
    uint16_t A[2][4] = {{bits16(1), bits16(2), bits16(3), bits16(4)},
                        {bits16(-1), bits16(0.5f), bits16(0.25f), bits16(8)}};
    uint16_t B[2][4] = {{bits16(5), bits16(6), bits16(7), bits16(8)},
                        {bits16(9), bits16(10), bits16(11), bits16(12)}};
    float C[2][2] = {{0.5f, 0}, {0, -100}};
    cpu_amx_emu_load(&e, 0, C, sizeof C[0]);
    cpu_amx_emu_load(&e, 1, A, sizeof A[0]);
    cpu_amx_emu_load(&e, 2, B, sizeof B[0]);
    cpu_amx_emu_dpbf16ps(&e, 0, 1, 2);
    float out[2][2];
    cpu_amx_emu_store(&e, 0, out, sizeof out[0]);
    // C[m][n] += sum_k A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1]
    assert_true(out[0][0] == 0.5f + (1 * 5 + 3 * 9) + (2 * 6 + 4 * 10));
    assert_true(out[0][1] == 0.0f + (1 * 7 + 3 * 11) + (2 * 8 + 4 * 12));
    assert_true(out[1][0] == 0.0f + (-1 * 5 + 0.25f * 9) + (0.5f * 6 + 8 * 10));
    assert_true(out[1][1] == -100.0f + (-1 * 7 + 0.25f * 11) + (0.5f * 8 + 8 * 12));

    // Order: C = 2^24, one pair (1, 1) . (1, 1). The SDM's partials give
    // 2^24 + (1 + 1) = 2^24 + 2; adding 1 twice to C rounds to even twice: 2^24.
    config(&c, 1, 4);
    float big = 0x1p24f;
    uint16_t one[2] = {0x3f80, 0x3f80};
    for (int order = 0; order < 2; order++) {
        cpu_amx_emu_loadconfig(&e, &c, (enum cpu_amx_order)order);
        cpu_amx_emu_load(&e, 0, &big, 4);
        cpu_amx_emu_load(&e, 1, one, 4);
        cpu_amx_emu_load(&e, 2, one, 4);
        cpu_amx_emu_dpbf16ps(&e, 0, 1, 2);
        float r;
        cpu_amx_emu_store(&e, 0, &r, 4);
        assert_true(r == (order == CPU_AMX_ORDER_SDM ? 0x1p24f + 2 : 0x1p24f));
    }

    // Denormals: a bf16 denormal input is zero (2^-133 * 2^100 would be
    // 2^-33); a product below FLT_MIN is flushed; a denormal C is read as 0.
    cpu_amx_emu_loadconfig(&e, &c, CPU_AMX_ORDER_SDM);
    uint16_t den[2] = {0x0001, 0x0000}, huge[2] = {bits16(0x1p100f), 0};
    float cden = 1e-40f, r;
    cpu_amx_emu_load(&e, 0, &cden, 4);
    cpu_amx_emu_load(&e, 1, den, 4);
    cpu_amx_emu_load(&e, 2, huge, 4);
    cpu_amx_emu_dpbf16ps(&e, 0, 1, 2);
    cpu_amx_emu_store(&e, 0, &r, 4);
    assert_true(r == 0.0f);
    uint16_t tiny[2] = {bits16(0x1p-70f), bits16(0x1p-60f)};
    cpu_amx_emu_zero(&e, 0);
    cpu_amx_emu_load(&e, 1, tiny, 4);
    cpu_amx_emu_load(&e, 2, tiny, 4);
    cpu_amx_emu_dpbf16ps(&e, 0, 1, 2);
    cpu_amx_emu_store(&e, 0, &r, 4);
    assert_true(r == 0x1p-120f); // 2^-140 flushed, 2^-120 kept

    // A load fills the configured rows and bytes and zeroes the rest; a store
    // writes only those.
    config(&c, 3, 8);
    cpu_amx_emu_loadconfig(&e, &c, CPU_AMX_ORDER_SDM);
    uint8_t src[16][64], dst[16][64];
    memset(src, 0xab, sizeof src);
    memset(dst, 0xcd, sizeof dst);
    cpu_amx_emu_load(&e, 5, src, 64);
    for (int row = 0; row < 16; row++)
        for (int b = 0; b < 64; b++)
            assert_int_equal(e.tile[5][row][b], row < 3 && b < 8 ? 0xab : 0);
    cpu_amx_emu_store(&e, 5, dst, 64);
    for (int row = 0; row < 16; row++)
        for (int b = 0; b < 64; b++)
            assert_int_equal(dst[row][b], row < 3 && b < 8 ? 0xab : 0xcd);
}

// ---- the tile kernel on the model ----------------------------------------------------------
// y[t][r] as the kernel must compute it: per 32-k chunk (16 pairs) in order,
// even and odd FMA chains from 0, then C += (even + odd); + bias in f32.
static float kernel_elem(const uint16_t *wr, const uint16_t *xr, int cols, const float *bias)
{
    int kp = (cols + 1) / 2;
    float acc = 0.0f;
    for (int c0 = 0; c0 < kp; c0 += 16) {
        float even = 0.0f, odd = 0.0f;
        for (int j = c0; j < c0 + 16 && j < kp; j++) {
            even = cpu_amx_emu_fma(bf(xr[2 * j]), bf(wr[2 * j]), even);
            if (2 * j + 1 < cols)
                odd = cpu_amx_emu_fma(bf(xr[2 * j + 1]), bf(wr[2 * j + 1]), odd);
        }
        acc = cpu_amx_emu_add(acc, cpu_amx_emu_add(even, odd));
    }
    return bias ? acc + *bias : acc;
}

static const int shapes[][2] = {{1, 1},   {15, 2},   {16, 31},  {17, 32}, {64, 33},
                                {65, 34}, {130, 63}, {200, 67}, {48, 96}, {33, 1000}};
static const int token_counts[] = {1, 5, 16, 17, 33, 47};

static void test_emu_kernel(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2);
    cpu_backend_use_amx_emu(be);
    const int NMAX = 47;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int rows = shapes[si][0], cols = shapes[si][1];
        float *wm = malloc(sizeof(float) * rows * cols), *bias = malloc(sizeof(float) * rows);
        float *x = malloc(sizeof(float) * NMAX * cols), *y = malloc(sizeof(float) * NMAX * rows);
        uint16_t *wb = malloc(2 * (size_t)rows * cols), *xb = malloc(2 * (size_t)NMAX * cols);
        assert_true(wm && bias && x && y && wb && xb);
        fill(wm, (size_t)rows * cols, 0.5f);
        fill(x, (size_t)NMAX * cols, 2.0f);
        fill(bias, rows, 1.0f);
        for (size_t i = 0; i < (size_t)rows * cols; i++)
            wb[i] = tdm_f32_to_bf16(wm[i]);
        for (size_t i = 0; i < (size_t)NMAX * cols; i++)
            xb[i] = cpu_amx_emu_f32_to_bf16(x[i]);
        struct tdm_weight w;
        prepare_bf16(be, &w, wm, rows, cols);
        for (size_t ni = 0; ni < sizeof token_counts / sizeof token_counts[0]; ni++) {
            int n = token_counts[ni];
            const float *bp = (si + ni) % 2 ? bias : NULL;
            ops->matmul(be, &w, bp, x, y, n);
            for (int t = 0; t < n; t++) {
                for (int r = 0; r < rows; r++) {
                    const uint16_t *wr = wb + (size_t)r * cols, *xr = xb + (size_t)t * cols;
                    float want = kernel_elem(wr, xr, cols, bp ? bp + r : NULL);
                    float got = y[(size_t)t * rows + r];
                    if (cpu_f32_bits(got) != cpu_f32_bits(want))
                        fail_msg("shape %dx%d n %d token %d row %d: %a, per-element %a", rows, cols,
                                 n, t, r, got, want);
                    // And within f32 accumulation error of the exact product.
                    double ref = bp ? bp[r] : 0, mag = 0;
                    for (int k = 0; k < cols; k++) {
                        double p = (double)bf(wr[k]) * bf(xr[k]);
                        ref += p;
                        mag += fabs(p);
                    }
                    if (fabs(got - ref) > (cols + 4) * 0x1p-24 * (mag + fabs(ref)) + 1e-30)
                        fail_msg("shape %dx%d token %d row %d: %g vs exact %g", rows, cols, t, r,
                                 got, ref);
                }
            }
        }
        ops->release_weight(be, &w);
        free(wm), free(bias), free(x), free(y), free(wb), free(xb);
    }
    ops->destroy(be);
}

// Bitwise: n = 64 against each token alone, in a batch of 7 at varying
// positions, a sub-batch at an odd offset, 1 vs 2 threads, a 600-token call
// (two 512-token passes), and the fused argmax against matmul's rows.
static void check_invariance(struct tdm_backend *be, struct tdm_backend *be1, int rows, int cols)
{
    const int N = 600;
    float *wm = malloc(sizeof(float) * rows * cols), *bias = malloc(sizeof(float) * rows);
    float *x = malloc(sizeof(float) * N * cols), *xb = malloc(sizeof(float) * 7 * cols);
    float *yN = malloc(sizeof(float) * N * rows), *y = malloc(sizeof(float) * N * rows);
    int32_t *ids = malloc(sizeof(int32_t) * N);
    assert_true(wm && bias && x && xb && yN && y && ids);
    fill(wm, (size_t)rows * cols, 0.3f);
    fill(x, (size_t)N * cols, 3.0f);
    fill(bias, rows, 1.0f);
    struct tdm_weight w, w1;
    prepare_bf16(be, &w, wm, rows, cols);
    prepare_bf16(be1, &w1, wm, rows, cols);
    ops->matmul(be, &w, bias, x, yN, N);
    ops->matmul(be1, &w1, bias, x, y, 64);
    assert_memory_equal(y, yN, sizeof(float) * 64 * rows);
    ops->matmul(be, &w, bias, x, y, 64);
    assert_memory_equal(y, yN, sizeof(float) * 64 * rows);
    for (int i = 0; i < N; i += 37) {
        ops->matmul(be, &w, bias, x + (size_t)i * cols, y, 1);
        assert_memory_equal(y, yN + (size_t)i * rows, sizeof(float) * rows);
        int at = i % 7;
        for (int j = 0; j < 7; j++) {
            int src = j == at ? i : (i + 11 * j + 1) % N;
            memcpy(xb + (size_t)j * cols, x + (size_t)src * cols, sizeof(float) * cols);
        }
        ops->matmul(be, &w, bias, xb, y, 7);
        assert_memory_equal(y + (size_t)at * rows, yN + (size_t)i * rows, sizeof(float) * rows);
    }
    ops->matmul(be, &w, bias, x + (size_t)3 * cols, y, 61);
    assert_memory_equal(y, yN + (size_t)3 * rows, sizeof(float) * 61 * rows);
    assert_int_equal(ops->matmul_argmax(be, &w, bias, x, N, ids), TDM_OK);
    for (int t = 0; t < N; t++) {
        const float *row = yN + (size_t)t * rows;
        int best = 0;
        for (int r = 1; r < rows; r++)
            best = row[r] > row[best] ? r : best;
        assert_int_equal(ids[t], best);
    }
    ops->release_weight(be, &w);
    ops->release_weight(be1, &w1);
    free(wm), free(bias), free(x), free(xb), free(yN), free(y), free(ids);
}

static void test_emu_batch_invariance(void **state)
{
    (void)state;
    struct tdm_backend *be = make_backend(ops, 2), *be1 = make_backend(ops, 1);
    cpu_backend_use_amx_emu(be);
    cpu_backend_use_amx_emu(be1);
    check_invariance(be, be1, 70, 67);
    check_invariance(be, be1, 300, 33);
    ops->destroy(be);
    ops->destroy(be1);
}

// ---- the model's conversion against vcvtne2ps2bf16 (AVX-512 hosts) --------------------------
// The emulated table's xq (bf16 pairs, zero padding) must be the AVX-512
// conversion's, bit for bit, including denormal, NaN, infinite and
// halfway inputs: the emulated kernel then sees what the real one sees.
static void test_hw_avx512_prep(void **state)
{
    (void)state;
    if (!tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512))
        TDM_SKIP("this CPU has no AVX-512 BF16");
    struct tdm_backend *be = make_backend(ops, 1);
    const int rows = 20, cols = 77, n = 9;
    float *wm = malloc(sizeof(float) * rows * cols), *x = malloc(sizeof(float) * n * cols);
    assert_true(wm && x);
    fill(wm, (size_t)rows * cols, 1.0f);
    fill(x, (size_t)n * cols, 4.0f);
    const float special[] = {1e-40f,    -1e-40f, 1.0f + 0x1p-8f, 1.0f + 0x3p-8f, INFINITY,
                             -INFINITY, NAN,     FLT_MAX,        -0.0f,          FLT_MIN};
    for (size_t i = 0; i < sizeof special / sizeof special[0]; i++)
        x[i * 7] = special[i];
    struct tdm_weight w;
    prepare_bf16(be, &w, wm, rows, cols);
    size_t xs = be->xq_stride, kp16 = ((size_t)(cols + 1) / 2 + 15) / 16 * 16;
    uint32_t *ref = malloc(sizeof(uint32_t) * n * xs);
    assert_non_null(ref);
    struct cpu_mm_args a = {.w = &w, .x = x, .xq = be->xq, .xq_stride = xs, .n = n};
    assert_int_equal(tdm_cpu_backend_set_isa(be, TDM_CPU_ISA_AVX512), TDM_OK);
    be->k->mm_prep_x(&a, 0, n);
    memcpy(ref, be->xq, sizeof(uint32_t) * n * xs);
    cpu_backend_use_amx_emu(be);
    memset(be->xq, 0x5a, sizeof(uint32_t) * n * xs);
    be->k->mm_prep_x(&a, 0, n);
    for (int t = 0; t < n; t++)
        for (size_t j = 0; j < kp16; j++)
            if (be->xq[t * xs + j] != ref[t * xs + j])
                fail_msg("token %d pair %zu: emulated %08x, vcvtne2ps2bf16 %08x", t, j,
                         be->xq[t * xs + j], ref[t * xs + j]);
    ops->release_weight(be, &w);
    free(wm), free(x), free(ref);
    ops->destroy(be);
}

// ---- real AMX (hosts with AMX only) ----------------------------------------------------------
#ifdef HAVE_REAL_AMX
__attribute__((target("amx-tile,amx-bf16"))) static void
real_dpbf16ps(const struct cpu_amx_cfg *cfg, float *c, const void *a, const void *b)
{
    _tile_loadconfig(cfg);
    _tile_loadd(0, c, 64);
    _tile_loadd(1, a, 64);
    _tile_loadd(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    _tile_stored(0, c, 64);
    _tile_release();
}
#endif

// The real TDPBF16PS against the model (CPU_AMX_ORDER_SDM) bit for bit, on
// the crafted cases above and on random full tiles, with a C that starts
// large so that the order of the additions shows in the bits. The message
// says which of the two described orders the silicon matched.
static void test_hw_amx_dpbf16ps(void **state)
{
    (void)state;
#ifdef HAVE_REAL_AMX
    if (!tdm_cpu_isa_supported(TDM_CPU_ISA_AMX))
        TDM_SKIP("this CPU (or kernel) has no AMX-BF16");
    struct cpu_amx_cfg cfg;
    config(&cfg, 16, 64);
    _Alignas(64) uint16_t A[16][32], B[16][32];
    _Alignas(64) float C0[16][16], Creal[16][16], Cemu[2][16][16];
    for (int trial = 0; trial < 64; trial++) {
        for (int m = 0; m < 16; m++)
            for (int j = 0; j < 32; j++) {
                float va = frand() * (trial % 4 == 0 ? 1e-36f : 4.0f);
                A[m][j] = cpu_amx_emu_f32_to_bf16(va);
                B[m][j] = cpu_amx_emu_f32_to_bf16(frand() * 2.0f);
            }
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 16; n++)
                C0[m][n] = trial % 2 ? frand() * 0x1p20f : 0.0f;
        if (trial == 1) { // the 2^24 + 1 + 1 case of test_emu_dpbf16ps
            memset(A, 0, sizeof A);
            memset(B, 0, sizeof B);
            A[0][0] = A[0][1] = B[0][0] = B[0][1] = 0x3f80;
            C0[0][0] = 0x1p24f;
        }
        memcpy(Creal, C0, sizeof C0);
        real_dpbf16ps(&cfg, &Creal[0][0], A, B);
        for (int order = 0; order < 2; order++) {
            struct cpu_amx_emu e;
            cpu_amx_emu_loadconfig(&e, &cfg, (enum cpu_amx_order)order);
            cpu_amx_emu_load(&e, 0, C0, 64);
            cpu_amx_emu_load(&e, 1, A, 64);
            cpu_amx_emu_load(&e, 2, B, 64);
            cpu_amx_emu_dpbf16ps(&e, 0, 1, 2);
            cpu_amx_emu_store(&e, 0, Cemu[order], 64);
        }
        int diff[2] = {0, 0};
        for (int order = 0; order < 2; order++)
            for (int m = 0; m < 16; m++)
                for (int n = 0; n < 16; n++)
                    diff[order] += cpu_f32_bits(Creal[m][n]) != cpu_f32_bits(Cemu[order][m][n]);
        if (diff[0] != 0)
            fail_msg("trial %d: TDPBF16PS differs from the model (SDM order) in %d of 256 "
                     "elements, from the sequential order in %d",
                     trial, diff[0], diff[1]);
    }
#else
    TDM_SKIP("AMX is tested on x86-64 Linux only");
#endif
}

// The real tile kernel against the emulated one (the model is exact where
// test_hw_amx_dpbf16ps passes, so bit for bit) and against the AVX-512 table
// (same bf16 activations, another f32 summation order: within 2 (cols + 4) *
// 2^-24 of sum |w x|), on the ragged shapes, through the backend.
static void test_hw_amx_kernel(void **state)
{
    (void)state;
    if (!tdm_cpu_isa_supported(TDM_CPU_ISA_AMX))
        TDM_SKIP("this CPU (or kernel) has no AMX-BF16");
    struct tdm_backend *be = make_backend(ops, 2);
    const int N = 47;
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        int rows = shapes[si][0], cols = shapes[si][1];
        float *wm = malloc(sizeof(float) * rows * cols), *bias = malloc(sizeof(float) * rows);
        float *x = malloc(sizeof(float) * N * cols);
        float *ya = malloc(sizeof(float) * N * rows), *ye = malloc(sizeof(float) * N * rows);
        float *yv = malloc(sizeof(float) * N * rows);
        assert_true(wm && bias && x && ya && ye && yv);
        fill(wm, (size_t)rows * cols, 0.5f);
        fill(x, (size_t)N * cols, 2.0f);
        fill(bias, rows, 1.0f);
        struct tdm_weight w;
        prepare_bf16(be, &w, wm, rows, cols);
        for (size_t ni = 0; ni < sizeof token_counts / sizeof token_counts[0]; ni++) {
            int n = token_counts[ni];
            const float *bp = ni % 2 ? bias : NULL;
            assert_int_equal(tdm_cpu_backend_set_isa(be, TDM_CPU_ISA_AMX), TDM_OK);
            ops->matmul(be, &w, bp, x, ya, n);
            assert_int_equal(tdm_cpu_backend_set_isa(be, TDM_CPU_ISA_AVX512), TDM_OK);
            ops->matmul(be, &w, bp, x, yv, n);
            cpu_backend_use_amx_emu(be);
            ops->matmul(be, &w, bp, x, ye, n);
            int differ = 0;
            for (size_t i = 0; i < (size_t)n * rows; i++)
                differ += cpu_f32_bits(ya[i]) != cpu_f32_bits(ye[i]);
            if (differ)
                fail_msg("shape %dx%d n %d: real AMX differs from the emulated kernel in %d of "
                         "%zu elements",
                         rows, cols, n, differ, (size_t)n * rows);
            for (int t = 0; t < n; t++)
                for (int r = 0; r < rows; r++) {
                    double mag = bp ? fabs(bp[r]) : 0;
                    for (int k = 0; k < cols; k++)
                        mag += fabs((double)wm[(size_t)r * cols + k] * x[(size_t)t * cols + k]);
                    double d = fabs((double)ya[(size_t)t * rows + r] - yv[(size_t)t * rows + r]);
                    if (d > 2 * (cols + 4) * 0x1p-24 * 1.02 * mag + 1e-30)
                        fail_msg("shape %dx%d token %d row %d: AMX %g, AVX-512 %g", rows, cols, t,
                                 r, ya[(size_t)t * rows + r], yv[(size_t)t * rows + r]);
                }
        }
        ops->release_weight(be, &w);
        free(wm), free(bias), free(x), free(ya), free(ye), free(yv);
    }
    ops->destroy(be);
}

// The real tile attention (cpu_amx_attn_body.h) against its model on the
// emulated tiles with the scalar twins of its AVX-512 helpers: bit for bit
// (bf16 pools: an f32 pool runs the per-query f32 kernels), head_dim 64 in
// place (whole 16-key chunks per block) and padded or copied shapes, prompts past one span (128),
// GQA groups 1, 7 and 12 (a unit of 8 heads and one of 4), prefill in one piece and then a decode
// step of every sequence.
static void test_hw_amx_attention(void **state)
{
    (void)state;
    if (!tdm_cpu_isa_supported(TDM_CPU_ISA_AMX))
        TDM_SKIP("this CPU (or kernel) has no AMX-BF16");
    static const int cases[][4] = {
        // heads, kv heads, head_dim, block size
        {14, 2, 64, 16}, {4, 4, 64, 32}, {7, 1, 128, 16}, {12, 1, 40, 16}, {4, 2, 18, 5},
    };
    // Under AddressSanitizer the model's side of 300 tokens took 100 s; 150
    // still crosses a span (the release build's run takes 300).
    const int n_seqs = 3, lens[3] = {1, 37, TDM_SANITIZE_ADDRESS ? 150 : 300};
    struct tdm_backend *be = make_backend(ops, 2);
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const int nh = cases[ci][0], nkv = cases[ci][1], hd = cases[ci][2], bs = cases[ci][3];
        int nblocks = 0;
        for (int s = 0; s < n_seqs; s++)
            nblocks += (lens[s] + 1 + bs - 1) / bs;
        struct tdm_kv_config cfg = {.num_layers = 1,
                                    .num_kv_heads = nkv,
                                    .head_dim = hd,
                                    .block_size = bs,
                                    .num_blocks = nblocks,
                                    .dtype = TDM_KV_BF16};
        struct tdm_kv_cache *kv = NULL;
        char err[256] = "";
        if (tdm_kv_new(&kv, &cfg, err, sizeof err) != TDM_OK)
            fail_msg("kv: %s", err);
        int tables[3][64], next = nblocks - 1; // handed out from the end, interleaved
        for (int b = 0; b < 64; b++)
            for (int s = 0; s < n_seqs; s++)
                if (b * bs < lens[s] + 1)
                    tables[s][b] = next--;
        const int qd = nh * hd, kvd = nkv * hd, stride = qd + 2 * kvd;
        const int total = lens[0] + lens[1] + lens[2];
        float *qkv = malloc(sizeof(float) * (size_t)(total + n_seqs) * stride);
        // Outputs of the decode step land in rows total + s.
        const size_t out_n = (size_t)(total + n_seqs) * qd;
        float *o_real = malloc(sizeof(float) * out_n), *o_emu = malloc(sizeof(float) * out_n);
        assert_true(qkv && o_real && o_emu);
        fill(qkv, (size_t)(total + n_seqs) * stride, 1.5f);
        struct tdm_attn_seq seqs[3], dec[3];
        for (int s = 0, row = 0; s < n_seqs; row += lens[s], s++) {
            seqs[s] = (struct tdm_attn_seq){
                .row = row, .n_tokens = lens[s], .start_pos = 0, .block_table = tables[s]};
            dec[s] = (struct tdm_attn_seq){
                .row = total + s, .n_tokens = 1, .start_pos = lens[s], .block_table = tables[s]};
        }
        const float scale = 1.0f / sqrtf((float)hd);
        ops->kv_store(be, kv, 0, seqs, n_seqs, qkv + qd, qkv + qd + kvd, stride);
        ops->kv_store(be, kv, 0, dec, n_seqs, qkv + qd, qkv + qd + kvd, stride);
        for (int step = 0; step < 2; step++) {
            const struct tdm_attn_seq *ss = step ? dec : seqs;
            for (int path = 0; path < 2; path++) {
                float *o = path ? o_emu : o_real;
                if (path)
                    cpu_backend_use_amx_emu(be);
                else
                    assert_int_equal(tdm_cpu_backend_set_isa(be, TDM_CPU_ISA_AMX), TDM_OK);
                memset(o, 0, sizeof(float) * out_n);
                ops->attention(be, kv, 0, ss, n_seqs, qkv, stride, o, nh, nkv, hd, scale);
            }
            size_t i0 = step ? (size_t)total * qd : 0;
            size_t n = step ? (size_t)n_seqs * qd : (size_t)total * qd;
            int differ = 0;
            for (size_t i = i0; i < i0 + n; i++)
                differ += cpu_f32_bits(o_real[i]) != cpu_f32_bits(o_emu[i]);
            if (differ)
                fail_msg("heads %d/%d hd %d bs %d, %s: real tiles differ from the "
                         "model in %d of %zu outputs",
                         nh, nkv, hd, bs, step ? "decode" : "prefill", differ, n);
        }
        free(qkv), free(o_real), free(o_emu);
        tdm_kv_free(kv);
    }
    ops->destroy(be);
}

// A backend takes the best path the CPU has, amx where it has AMX (and the
// kernel grants the tile state); asking for amx works exactly there.
static void test_default_path(void **state)
{
    (void)state;
    char err[256];
    enum tdm_cpu_isa isa;
    unsetenv("TANDEM_CPU_ISA");
    assert_int_equal(tdm_cpu_isa_default(&isa, err, sizeof err), TDM_OK);
    assert_int_equal(isa, tdm_cpu_isa_best());
    assert_int_equal(isa == TDM_CPU_ISA_AMX, tdm_cpu_isa_supported(TDM_CPU_ISA_AMX));
    setenv("TANDEM_CPU_ISA", "amx", 1);
    int rc = tdm_cpu_isa_default(&isa, err, sizeof err);
    unsetenv("TANDEM_CPU_ISA");
    if (tdm_cpu_isa_supported(TDM_CPU_ISA_AMX)) {
        assert_int_equal(rc, TDM_OK);
        assert_int_equal(isa, TDM_CPU_ISA_AMX);
    } else {
        assert_int_equal(rc, TDM_EINVAL);
        assert_string_equal(err, "TANDEM_CPU_ISA=amx: this CPU does not support it");
    }
}

int main(int argc, char **argv)
{
    tdm_test_filters(argc, argv);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_path),
        cmocka_unit_test(test_emu_conversion_and_steps),
        cmocka_unit_test(test_emu_dpbf16ps),
        cmocka_unit_test(test_emu_kernel),
        cmocka_unit_test(test_emu_batch_invariance),
        cmocka_unit_test(test_hw_avx512_prep),
        cmocka_unit_test(test_hw_amx_dpbf16ps),
        cmocka_unit_test(test_hw_amx_kernel),
        cmocka_unit_test(test_hw_amx_attention),
    };
    return tdm_test_exit(tdm_run_group_tests(tests, NULL, NULL));
}
