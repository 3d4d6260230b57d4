// SPDX-License-Identifier: Apache-2.0
// cpu_kernels_avx2: the AVX2 + FMA path (x86-64 without AVX-512 BF16).
// Compiled for that target through a pragma, called only after the CPU check.
// Weights are widened to f32 in registers (bf16: shift / mask of the k pair,
// int8: sign extension), activations stay f32. Each ymm lane is one output
// element accumulating its k in order with FMA; a tile is 4 panels x 1 token
// (decode) or 1 panel x up to 4 tokens, both giving the same per-lane chain.
#include <immintrin.h>
#include <stdbool.h>
#include <math.h>
#include <string.h>

#include "cpu_impl.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#define AI static inline __attribute__((always_inline))
#define TILE_T 4

AI __m256 exp_ps(__m256 x)
{
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.33f));
    x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Lane mask for the first n (< 8) floats.
AI __m256i tail_mask(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// ---- matmul ----------------------------------------------------------------------------------
// Panels [g0, g0 + NG) of a block with G panels, tokens [t0, t0 + T).
AI void tile(const struct cpu_mm_args *a, const uint8_t *wb, int G, int g0, const int NG,
             const int T, int t0, int row0, const int WT)
{
    const struct tdm_weight *w = a->w;
    const int cols = w->cols;
    const float *x = a->x + (size_t)t0 * cols;
    __m256 acc[CPU_BLOCK_PANELS][2][TILE_T];
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++)
#pragma GCC unroll 4
            for (int t = 0; t < TILE_T; t++)
                if (g < NG && t < T)
                    acc[g][h][t] = _mm256_setzero_ps();
    if (WT == TDM_W_BF16) {
        const size_t js = (size_t)G * 64;
        const int full = cols / 2;
        const __m256i hi_mask = _mm256_set1_epi32((int)0xffff0000u);
        for (int j = 0; j <= full; j++) {
            // j == full is the zero-padded last pair of an odd cols: only its
            // even element exists.
            if (j == full && !(cols & 1))
                break;
            const uint8_t *wj = wb + j * js + (size_t)g0 * 64;
            __m256 we[CPU_BLOCK_PANELS][2], wo[CPU_BLOCK_PANELS][2];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++) {
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    if (g < NG) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(wj + g * 64 + h * 32));
                        we[g][h] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                        wo[g][h] = _mm256_castsi256_ps(_mm256_and_si256(v, hi_mask));
                    }
                }
            }
#pragma GCC unroll 4
            for (int t = 0; t < TILE_T; t++) {
                if (t < T) {
                    __m256 xe = _mm256_broadcast_ss(x + (size_t)t * cols + 2 * j);
#pragma GCC unroll 4
                    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++)
                            if (g < NG)
                                acc[g][h][t] = _mm256_fmadd_ps(we[g][h], xe, acc[g][h][t]);
                    if (j < full) {
                        __m256 xo = _mm256_broadcast_ss(x + (size_t)t * cols + 2 * j + 1);
#pragma GCC unroll 4
                        for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                            for (int h = 0; h < 2; h++)
                                if (g < NG)
                                    acc[g][h][t] = _mm256_fmadd_ps(wo[g][h], xo, acc[g][h][t]);
                    }
                }
            }
        }
    } else if (WT == TDM_W_Q8) {
        // A quad step holds k = 4q..4q+3 in the bytes of each lane; byte i is
        // sign-extended by shifting it to the top and back.
        const size_t js = (size_t)G * 64;
        const int nq = (cols + 3) / 4;
        for (int q = 0; q < nq; q++) {
            const uint8_t *wq = wb + q * js + (size_t)g0 * 64;
            __m256i v[CPU_BLOCK_PANELS][2];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    if (g < NG)
                        v[g][h] = _mm256_loadu_si256((const __m256i *)(wq + g * 64 + h * 32));
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++) {
                int k = 4 * q + i;
                if (k >= cols)
                    break;
                __m256 wv[CPU_BLOCK_PANELS][2];
#pragma GCC unroll 4
                for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++)
                        if (g < NG)
                            wv[g][h] = _mm256_cvtepi32_ps(
                                _mm256_srai_epi32(_mm256_slli_epi32(v[g][h], 24 - 8 * i), 24));
#pragma GCC unroll 4
                for (int t = 0; t < TILE_T; t++) {
                    if (t < T) {
                        __m256 xb = _mm256_broadcast_ss(x + (size_t)t * cols + k);
#pragma GCC unroll 4
                        for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                            for (int h = 0; h < 2; h++)
                                if (g < NG)
                                    acc[g][h][t] = _mm256_fmadd_ps(wv[g][h], xb, acc[g][h][t]);
                    }
                }
            }
        }
    } else {
        const size_t js = (size_t)G * 64;
        for (int k = 0; k < cols; k++) {
            const uint8_t *wk = wb + k * js + (size_t)g0 * 64;
            __m256 wv[CPU_BLOCK_PANELS][2];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++)
                    if (g < NG)
                        wv[g][h] = _mm256_loadu_ps((const float *)(wk + g * 64) + h * 8);
#pragma GCC unroll 4
            for (int t = 0; t < TILE_T; t++) {
                if (t < T) {
                    __m256 xb = _mm256_broadcast_ss(x + (size_t)t * cols + k);
#pragma GCC unroll 4
                    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 2
                        for (int h = 0; h < 2; h++)
                            if (g < NG)
                                acc[g][h][t] = _mm256_fmadd_ps(wv[g][h], xb, acc[g][h][t]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            if (g >= NG)
                continue;
            int r0 = row0 + (g0 + g) * 16 + h * 8;
            int nr = w->rows - r0;
            if (nr <= 0)
                continue;
            __m256 sc = WT == TDM_W_Q8 ? _mm256_loadu_ps(w->scales + r0) : _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int t = 0; t < TILE_T; t++) {
                if (t >= T)
                    continue;
                __m256 v = acc[g][h][t];
                if (WT == TDM_W_Q8)
                    v = _mm256_mul_ps(v, sc);
                float *y = cpu_mm_y(a, t0 + t, r0);
                if (nr >= 8) {
                    if (a->bias)
                        v = _mm256_add_ps(v, _mm256_loadu_ps(a->bias + r0));
                    _mm256_storeu_ps(y, v);
                } else {
                    float tmp[8];
                    _mm256_storeu_ps(tmp, v);
                    for (int l = 0; l < nr; l++)
                        y[l] = a->bias ? tmp[l] + a->bias[r0 + l] : tmp[l];
                }
            }
        }
    }
}

#define TILE_DISPATCH(fname, WT)                                                                   \
    static void fname(const struct cpu_mm_args *a, const uint8_t *wb, int G, int T, int t0,        \
                      int row0)                                                                    \
    {                                                                                              \
        if (T == 1) {                                                                              \
            switch (G) {                                                                           \
            case 1:                                                                                \
                tile(a, wb, G, 0, 1, 1, t0, row0, WT);                                             \
                break;                                                                             \
            case 2:                                                                                \
                tile(a, wb, G, 0, 2, 1, t0, row0, WT);                                             \
                break;                                                                             \
            case 3:                                                                                \
                tile(a, wb, G, 0, 3, 1, t0, row0, WT);                                             \
                break;                                                                             \
            default:                                                                               \
                tile(a, wb, G, 0, 4, 1, t0, row0, WT);                                             \
                break;                                                                             \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (int g = 0; g < G; g++) {                                                              \
            switch (T) {                                                                           \
            case 2:                                                                                \
                tile(a, wb, G, g, 1, 2, t0, row0, WT);                                             \
                break;                                                                             \
            case 3:                                                                                \
                tile(a, wb, G, g, 1, 3, t0, row0, WT);                                             \
                break;                                                                             \
            default:                                                                               \
                tile(a, wb, G, g, 1, 4, t0, row0, WT);                                             \
                break;                                                                             \
            }                                                                                      \
        }                                                                                          \
    }

TILE_DISPATCH(tile_bf16, TDM_W_BF16)
TILE_DISPATCH(tile_q8, TDM_W_Q8)
TILE_DISPATCH(tile_f32, TDM_W_F32)

static void mm_blocks(const struct cpu_mm_args *a, int b0, int b1)
{
    const struct tdm_weight *w = a->w;
    void (*fn)(const struct cpu_mm_args *, const uint8_t *, int, int, int, int) =
        w->type == TDM_W_BF16 ? tile_bf16
        : w->type == TDM_W_Q8 ? tile_q8
                              : tile_f32;
    for (int b = b0; b < b1; b++) {
        const uint8_t *wb = cpu_w_block(w, b);
        int G = cpu_w_block_panels(w, b);
        for (int t0 = 0; t0 < a->n; t0 += TILE_T) {
            int T = a->n - t0 < TILE_T ? a->n - t0 : TILE_T;
            fn(a, wb, G, T, t0, b * CPU_BLOCK_ROWS);
        }
    }
}

// ---- elementwise and attention ------------------------------------------------------------------
static void silu_mul_row(const float *gate, const float *up, float *out, int inter)
{
    int i = 0;
    for (; i + 8 <= inter; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    if (i < inter) {
        __m256i m = tail_mask(inter - i);
        __m256 g = _mm256_maskload_ps(gate + i, m);
        __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(s, _mm256_maskload_ps(up + i, m)));
    }
}

AI float hsum(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// 8 keys or values at off: f32, or bf16 widened exactly by a 16-bit shift
// (bf16 is the top half of an f32); n < 8 lanes for a tail (the rest 0).
AI __m256 kv_load8(const void *base, bool bf16, size_t off, int n)
{
    if (bf16) {
        const uint16_t *p = (const uint16_t *)base + off;
        __m128i h;
        if (n >= 8) {
            h = _mm_loadu_si128((const __m128i *)p);
        } else {
            uint16_t t[8] = {0};
            memcpy(t, p, sizeof(uint16_t) * (size_t)n);
            h = _mm_loadu_si128((const __m128i *)t);
        }
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    const float *p = (const float *)base + off;
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail_mask(n));
}

AI float scores_impl(const float *q, const void *k, bool bf16, int nk, int hd, float scale,
                     float *s)
{
    float mx = -INFINITY;
    int full = hd & ~7;
    __m256i m = tail_mask(hd - full);
    for (int j = 0; j < nk; j++) {
        size_t row = (size_t)j * hd;
        __m256 acc = _mm256_setzero_ps();
        for (int d = 0; d < full; d += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv_load8(k, bf16, row + d, 8), acc);
        if (full < hd)
            acc = _mm256_fmadd_ps(_mm256_maskload_ps(q + full, m),
                                  kv_load8(k, bf16, row + full, hd - full), acc);
        s[j] = hsum(acc) * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

static float attn_scores(const float *q, const float *k, int nk, int hd, float scale, float *s)
{
    return scores_impl(q, k, false, nk, hd, scale, s);
}

static float attn_scores_bf16(const float *q, const uint16_t *k, int nk, int hd, float scale,
                              float *s)
{
    return scores_impl(q, k, true, nk, hd, scale, s);
}

static float attn_exp(float *s, int nk, float m)
{
    __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (int j = 0; j < nk; j += 8) {
        if (nk - j >= 8) {
            __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
            _mm256_storeu_ps(s + j, e);
            sum = _mm256_add_ps(sum, e);
        } else {
            __m256i mk = tail_mask(nk - j);
            __m256 v = _mm256_maskload_ps(s + j, mk);
            __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(v, mv)), _mm256_castsi256_ps(mk));
            _mm256_maskstore_ps(s + j, mk, e);
            sum = _mm256_add_ps(sum, e);
        }
    }
    return hsum(sum);
}

AI void accum_impl(float *acc, float corr, const float *p, const void *v, bool bf16, int nk,
                   int hd)
{
    __m256 c = _mm256_set1_ps(corr);
    for (int d = 0; d < hd; d += 8) {
        int n = hd - d < 8 ? hd - d : 8;
        __m256i m = n == 8 ? _mm256_set1_epi32(-1) : tail_mask(n);
        __m256 a = _mm256_mul_ps(_mm256_maskload_ps(acc + d, m), c);
        for (int j = 0; j < nk; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), kv_load8(v, bf16, (size_t)j * hd + d, n), a);
        _mm256_maskstore_ps(acc + d, m, a);
    }
}

static void widen_bf16(const uint16_t *src, float *dst, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, kv_load8(src, true, i, 8));
    for (; i < n; i++)
        dst[i] = cpu_bf16_to_f32(src[i]);
}

static void attn_accum(float *acc, float corr, const float *p, const float *v, int nk, int hd)
{
    accum_impl(acc, corr, p, v, false, nk, hd);
}

static void attn_accum_bf16(float *acc, float corr, const float *p, const uint16_t *v, int nk,
                            int hd)
{
    accum_impl(acc, corr, p, v, true, nk, hd);
}

// _mm256_max_ps(x, m) is m when x is NaN: `>` semantics.
static float row_max(const float *x, int n)
{
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
    }
    m0 = _mm256_max_ps(m1, m0);
    float lanes[8];
    _mm256_storeu_ps(lanes, m0);
    float m = -INFINITY;
    for (int l = 0; l < 8; l++)
        m = lanes[l] > m ? lanes[l] : m;
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

#pragma GCC pop_options

const struct cpu_kernels cpu_kernels_avx2 = {
    .name = "avx2",
    .mm_prep_x = NULL,
    .mm_blocks = mm_blocks,
    .silu_mul_row = silu_mul_row,
    .attn_scores = attn_scores,
    .attn_exp = attn_exp,
    .attn_accum = attn_accum,
    .attn_scores_bf16 = attn_scores_bf16,
    .attn_accum_bf16 = attn_accum_bf16,
    .widen_bf16 = widen_bf16,
    .row_max = row_max,
};

#endif
