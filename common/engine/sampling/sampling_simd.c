// SPDX-License-Identifier: Apache-2.0
// sampling_simd: the sampler's passes over a whole logits row (151 936 floats
// for Qwen2), in portable C and in AVX2, chosen once at run time from the CPU's
// features (TANDEM_CPU_ISA=portable forces plain C, as for the CPU backend).
// Every pass here is exact, so both paths return bitwise the same thing: an
// argmax is an index and its value (the first of the largest, by `>`, so ties
// keep the lowest index, -0 and +0 tie, NaN never wins), a scan returns
// indices. The one pass that rounds, the log-softmax's sum of exponentials,
// does the same operations on both paths (sample_draw.h's exp, lane by lane,
// and 8 partial sums in one order), so it too gives the same bits.
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "sample_draw.h"
#include "sampling_impl.h"

// ---- portable C ------------------------------------------------------------------------

static int32_t argmax_portable(const float *x, size_t n, float *max_out)
{
    int32_t best = 0;
    float bv = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        if (x[i] > bv) { // strict: ties keep the lowest index; NaN never wins
            bv = x[i];
            best = (int32_t)i;
        }
    }
    *max_out = bv;
    return best;
}

static size_t collect_ge_portable(const float *x, size_t n, float thr, int32_t *out)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (x[i] >= thr) // NaN fails
            out[m++] = (int32_t)i;
    return m;
}

static size_t next_above_portable(const float *x, size_t i, size_t n, float floor_v)
{
    while (i < n && !(x[i] > floor_v))
        i++;
    return i;
}

// The 8 partial sums added in their fixed tree.
static double sum_parts(const double part[8])
{
    return ((part[0] + part[1]) + (part[2] + part[3])) +
           ((part[4] + part[5]) + (part[6] + part[7]));
}

static double sum_exp_portable(const float *x, size_t n, float m)
{
    double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    bool nan = false;
    for (size_t i = 0; i < n; i++) {
        float t = x[i] - m;
        nan |= t != t;
        part[i % 8] += (double)tdm_draw_exp(t);
    }
    return nan ? (double)NAN : sum_parts(part);
}

// ---- AVX2 --------------------------------------------------------------------------------
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_AVX2_PATH 1
#include <immintrin.h>

// The target attribute per function (gcc and clang both take it; clang has
// no '#pragma GCC target').
#define AVX2_FN __attribute__((target("avx2")))

// Four vectors per iteration, 32 lanes: lane j keeps the first largest of the
// indices = j (mod 32) (compare > only, so a tie never replaces), and the
// lanes are merged by (value larger, or equal with a lower index). Lanes that
// saw nothing above -inf keep index 0 and -inf, which merge like the scalar
// loop's start.
AVX2_FN static int32_t argmax_avx2(const float *x, size_t n, float *max_out)
{
    int32_t best = 0;
    float bv = -INFINITY;
    size_t i = 0;
    if (n >= 32 && n <= (size_t)INT32_MAX) {
        __m256 v0 = _mm256_set1_ps(-INFINITY), v1 = v0, v2 = v0, v3 = v0;
        __m256i b0 = _mm256_setzero_si256(), b1 = b0, b2 = b0, b3 = b0;
        __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
        __m256i i2 = _mm256_add_epi32(i0, _mm256_set1_epi32(16));
        __m256i i3 = _mm256_add_epi32(i0, _mm256_set1_epi32(24));
        const __m256i step = _mm256_set1_epi32(32);
        for (; i + 32 <= n; i += 32) {
            __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
            __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
            __m256 g0 = _mm256_cmp_ps(x0, v0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(x1, v1, _CMP_GT_OQ);
            __m256 g2 = _mm256_cmp_ps(x2, v2, _CMP_GT_OQ), g3 = _mm256_cmp_ps(x3, v3, _CMP_GT_OQ);
            v0 = _mm256_blendv_ps(v0, x0, g0);
            v1 = _mm256_blendv_ps(v1, x1, g1);
            v2 = _mm256_blendv_ps(v2, x2, g2);
            v3 = _mm256_blendv_ps(v3, x3, g3);
            b0 = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(b0), _mm256_castsi256_ps(i0), g0));
            b1 = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(b1), _mm256_castsi256_ps(i1), g1));
            b2 = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(b2), _mm256_castsi256_ps(i2), g2));
            b3 = _mm256_castps_si256(
                _mm256_blendv_ps(_mm256_castsi256_ps(b3), _mm256_castsi256_ps(i3), g3));
            i0 = _mm256_add_epi32(i0, step);
            i1 = _mm256_add_epi32(i1, step);
            i2 = _mm256_add_epi32(i2, step);
            i3 = _mm256_add_epi32(i3, step);
        }
        float lv[32];
        int32_t li[32];
        _mm256_storeu_ps(lv, v0);
        _mm256_storeu_ps(lv + 8, v1);
        _mm256_storeu_ps(lv + 16, v2);
        _mm256_storeu_ps(lv + 24, v3);
        _mm256_storeu_si256((__m256i *)li, b0);
        _mm256_storeu_si256((__m256i *)(li + 8), b1);
        _mm256_storeu_si256((__m256i *)(li + 16), b2);
        _mm256_storeu_si256((__m256i *)(li + 24), b3);
        for (int j = 0; j < 32; j++) {
            if (lv[j] > bv || (lv[j] == bv && li[j] < best)) {
                bv = lv[j];
                best = li[j];
            }
        }
    }
    for (; i < n; i++) { // the tail's indices are above all the lanes'
        if (x[i] > bv) {
            bv = x[i];
            best = (int32_t)i;
        }
    }
    // bv is the value of a lane, i.e. x[best], sign of zero included (or -inf).
    *max_out = bv;
    return best;
}

AVX2_FN static size_t collect_ge_avx2(const float *x, size_t n, float thr, int32_t *out)
{
    size_t m = 0, i = 0;
    const __m256 t = _mm256_set1_ps(thr);
    for (; i + 8 <= n; i += 8) {
        unsigned bits =
            (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_GE_OQ));
        for (; bits; bits &= bits - 1)
            out[m++] = (int32_t)(i + (size_t)__builtin_ctz(bits));
    }
    for (; i < n; i++)
        if (x[i] >= thr)
            out[m++] = (int32_t)i;
    return m;
}

AVX2_FN static size_t next_above_avx2(const float *x, size_t i, size_t n, float floor_v)
{
    const __m256 f = _mm256_set1_ps(floor_v);
    for (; i + 8 <= n; i += 8) {
        unsigned bits =
            (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), f, _CMP_GT_OQ));
        if (bits)
            return i + (size_t)__builtin_ctz(bits);
    }
    return next_above_portable(x, i, n, floor_v);
}

// tdm_draw_exp on 8 lanes, operation for operation (no FMA: the module
// builds with -ffp-contract=off, and these are separate multiplies and adds).
AVX2_FN static __m256 exp_avx2(__m256 x)
{
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ); // else 0 (NaN too)
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504f));
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    __m256 n = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
    static const float c[7] = {
        1.38888889e-3f, 8.33333333e-3f, 4.16666667e-2f, 1.66666667e-1f, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(1.98412698e-4f);
    for (int k = 0; k < 7; k++)
        p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c[k]));
    // 2^n from its bits; n is a whole number (exact in the conversion) in
    // [-126, 0] where ok, anything elsewhere (masked below).
    __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(bits)), ok);
}

// sum_exp_portable's partial sums: lanes 0-3 of a block of 8 in one double
// vector, 4-7 in the other.
AVX2_FN static double sum_exp_avx2(const float *x, size_t n, float m)
{
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    __m256 nan = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 t = _mm256_sub_ps(_mm256_loadu_ps(x + i), vm);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(t, t, _CMP_UNORD_Q));
        __m256 e = exp_avx2(t);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
    double part[8];
    _mm256_storeu_pd(part, a0);
    _mm256_storeu_pd(part + 4, a1);
    bool any_nan = _mm256_movemask_ps(nan) != 0;
    for (; i < n; i++) {
        float t = x[i] - m;
        any_nan |= t != t;
        part[i % 8] += (double)tdm_draw_exp(t);
    }
    return any_nan ? (double)NAN : sum_parts(part);
}

#endif

// ---- dispatch ----------------------------------------------------------------------------

// -1: not chosen yet; else the enum tdm_sampling_simd in use. A race between
// two first calls chooses the same value twice.
static _Atomic int simd_choice = -1;

static bool avx2_supported(void)
{
#ifdef HAVE_AVX2_PATH
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
#else
    return false;
#endif
}

static enum tdm_sampling_simd simd(void)
{
    int c = atomic_load_explicit(&simd_choice, memory_order_relaxed);
    if (c < 0) {
        const char *force = getenv("TANDEM_CPU_ISA");
        bool portable = force && strcmp(force, "portable") == 0;
        c = !portable && avx2_supported() ? TDM_SAMPLING_SIMD_AVX2 : TDM_SAMPLING_SIMD_PORTABLE;
        atomic_store_explicit(&simd_choice, c, memory_order_relaxed);
    }
    return (enum tdm_sampling_simd)c;
}

enum tdm_sampling_simd tdm_sampling_simd_get(void)
{
    return simd();
}

int tdm_sampling_simd_set(enum tdm_sampling_simd s)
{
    if (s == TDM_SAMPLING_SIMD_AVX2 && !avx2_supported())
        return -1;
    if (s != TDM_SAMPLING_SIMD_PORTABLE && s != TDM_SAMPLING_SIMD_AVX2)
        return -1;
    atomic_store_explicit(&simd_choice, (int)s, memory_order_relaxed);
    return 0;
}

int32_t tdm_sampling_argmax(const float *x, size_t n, float *max_out)
{
    float m;
    int32_t r;
#ifdef HAVE_AVX2_PATH
    if (simd() == TDM_SAMPLING_SIMD_AVX2)
        r = argmax_avx2(x, n, &m);
    else
#endif
        r = argmax_portable(x, n, &m);
    if (max_out)
        *max_out = m;
    return r;
}

size_t tdm_sampling_collect_ge(const float *x, size_t n, float thr, int32_t *out)
{
#ifdef HAVE_AVX2_PATH
    if (simd() == TDM_SAMPLING_SIMD_AVX2)
        return collect_ge_avx2(x, n, thr, out);
#endif
    return collect_ge_portable(x, n, thr, out);
}

size_t tdm_sampling_next_above(const float *x, size_t i, size_t n, float floor_v)
{
#ifdef HAVE_AVX2_PATH
    if (simd() == TDM_SAMPLING_SIMD_AVX2)
        return next_above_avx2(x, i, n, floor_v);
#endif
    return next_above_portable(x, i, n, floor_v);
}

double tdm_sampling_sum_exp(const float *x, size_t n, float m)
{
#ifdef HAVE_AVX2_PATH
    if (simd() == TDM_SAMPLING_SIMD_AVX2)
        return sum_exp_avx2(x, n, m);
#endif
    return sum_exp_portable(x, n, m);
}
