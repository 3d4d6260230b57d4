// SPDX-License-Identifier: Apache-2.0
// cpu_kernels_avx512: the AVX-512 path (F/BW/VL/DQ + BF16 + VNNI, Zen 4 and
// Sapphire Rapids class). Compiled for that target through a pragma so the
// build needs no -march flag; cpu_backend.c only calls it after checking the
// CPU features.
//
// BF16 matmul: activations are rounded to bf16 (nearest even) once per call
// and paired as vdpbf16ps expects; W vectors hold one k pair of 16 rows, x is
// broadcast, so each accumulator lane is one output element summing its k
// pairs in order. A tile is up to 4 panels (64 rows) x 6 tokens = 24 zmm
// accumulators; decode (n = 1) is the same tile with one token, streaming the
// block's contiguous 256-byte k steps. Q8 weights use
// VNNI against activations quantized per token and 32-k block (tile_q8v); F32
// weights use FMA against f32 activations.
#include <immintrin.h>
#include <stdbool.h>
#include <math.h>
#include <string.h>

#include "cpu_avx512_math.h"
#include "cpu_impl.h"

#if defined(__x86_64__)

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma")

#define AI static inline __attribute__((always_inline))
#define TILE_T 6

AI __mmask16 lanes_mask(int n)
{
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

// ---- matmul ---------------------------------------------------------------------------------
// Q8: per token and 32-k block, q = round(x / s) with s = max|x| / 127, and
// the block's sum of q (for the +128 offset of the weights, see tile_q8v).
static void prep_q8(const struct cpu_mm_args *a, int t0, int t1)
{
    int cols = a->w->cols, kpad = cpu_q8_kpad(cols), nblk = kpad / CPU_Q8_BLOCK;
    for (int t = t0; t < t1; t++) {
        const float *x = a->x + (size_t)t * cols;
        uint8_t *row = (uint8_t *)(a->xq + (size_t)t * a->xq_stride);
        float *sx = (float *)(row + kpad);
        int32_t *xsum = (int32_t *)(row + kpad + 4 * (size_t)nblk);
        for (int b = 0; b < nblk; b++) {
            int k = b * CPU_Q8_BLOCK;
            __m512 lo = _mm512_maskz_loadu_ps(lanes_mask(cols - k), x + k);
            __m512 hi = _mm512_maskz_loadu_ps(lanes_mask(cols - k - 16 > 0 ? cols - k - 16 : 0),
                                              x + k + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            _mm_storeu_si128((__m128i *)(row + k), _mm512_cvtepi32_epi8(qlo));
            _mm_storeu_si128((__m128i *)(row + k + 16), _mm512_cvtepi32_epi8(qhi));
            sx[b] = amax / 127.0f;
            xsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
    }
}

static void mm_prep_x(const struct cpu_mm_args *a, int t0, int t1)
{
    if (a->w->type == TDM_W_Q8) {
        prep_q8(a, t0, t1);
        return;
    }
    int cols = a->w->cols;
    for (int t = t0; t < t1; t++) {
        const float *x = a->x + (size_t)t * cols;
        uint32_t *d = (uint32_t *)a->xq + (size_t)t * a->xq_stride;
        for (int k = 0; k < cols; k += 32) {
            __m512 lo = _mm512_maskz_loadu_ps(lanes_mask(cols - k), x + k);
            __m512 hi = _mm512_maskz_loadu_ps(lanes_mask(cols - k - 16 > 0 ? cols - k - 16 : 0),
                                              x + k + 16);
            __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
            _mm512_storeu_si512(d + k / 2, (__m512i)v);
        }
    }
}

// The G lines CPU_STREAM_PREFETCH bytes past a k step's weights, into L2:
// the stream runs on through the next block (blocks are contiguous), and a
// prefetch past the weight's end is harmless.
AI void stream_prefetch(const uint8_t *wj, const int G)
{
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
        if (g < G)
            _mm_prefetch((const char *)wj + CPU_STREAM_PREFETCH + g * 64, _MM_HINT_T1);
}

// Rows [row0, row0 + 16 G) x tokens [t0, t0 + T) of weight type WT.
AI void tile(const struct cpu_mm_args *a, const uint8_t *wb, const int G, const int T, int t0,
             int row0, const uint8_t *pf, int pf_lines, const int WT)
{
    const struct tdm_weight *w = a->w;
    __m512 acc[CPU_BLOCK_PANELS][TILE_T];
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
#pragma GCC unroll 6
        for (int t = 0; t < TILE_T; t++)
            if (g < G && t < T)
                acc[g][t] = _mm512_setzero_ps();
    if (WT == TDM_W_BF16) {
        const size_t js = (size_t)G * 64;
        const int kp = (w->cols + 1) / 2;
        const size_t xs = a->xq_stride;
        const uint32_t *xq = a->xq + (size_t)t0 * xs;
        for (int j = 0; j < kp; j++) {
            const uint8_t *wj = wb + j * js;
            if (pf) {
                for (int l = 0; l < pf_lines; l++)
                    _mm_prefetch((const char *)pf + ((size_t)j * pf_lines + l) * 64, _MM_HINT_T0);
            } else if (pf_lines < 0) {
                stream_prefetch(wj, G);
            }
            __m512bh wv[CPU_BLOCK_PANELS];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                if (g < G)
                    wv[g] = (__m512bh)_mm512_loadu_si512(wj + g * 64);
#pragma GCC unroll 6
            for (int t = 0; t < TILE_T; t++) {
                if (t < T) {
                    __m512bh xb = (__m512bh)_mm512_set1_epi32((int)xq[t * xs + j]);
#pragma GCC unroll 4
                    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                        if (g < G)
                            acc[g][t] = _mm512_dpbf16_ps(acc[g][t], wv[g], xb);
                }
            }
        }
    } else {
        const size_t step = 64;
        const size_t js = (size_t)G * step;
        const int cols = w->cols;
        const float *x = a->x + (size_t)t0 * cols;
        for (int k = 0; k < cols; k++) {
            const uint8_t *wk = wb + k * js;
            if (pf) {
                for (int l = 0; l < pf_lines; l++)
                    _mm_prefetch((const char *)pf + ((size_t)k * pf_lines + l) * 64, _MM_HINT_T0);
            }
            __m512 wv[CPU_BLOCK_PANELS];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++) {
                if (g < G)
                    wv[g] = _mm512_loadu_ps(wk + g * step);
            }
#pragma GCC unroll 6
            for (int t = 0; t < TILE_T; t++) {
                if (t < T) {
                    __m512 xb = _mm512_set1_ps(x[(size_t)t * cols + k]);
#pragma GCC unroll 4
                    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                        if (g < G)
                            acc[g][t] = _mm512_fmadd_ps(wv[g], xb, acc[g][t]);
                }
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++) {
        if (g >= G)
            continue;
        int r0 = row0 + g * 16;
        int nr = w->rows - r0;
        if (nr <= 0)
            continue;
        __mmask16 m = lanes_mask(nr);
        __m512 bv = a->bias ? _mm512_maskz_loadu_ps(m, a->bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 6
        for (int t = 0; t < TILE_T; t++) {
            if (t < T) {
                __m512 v = acc[g][t];
                if (a->bias)
                    v = _mm512_add_ps(v, bv);
                _mm512_mask_storeu_ps(cpu_mm_y(a, t0 + t, r0), m, v);
            }
        }
    }
}

// Q8 with VNNI: weights are stored as int8 q; flipping the top bit gives the
// unsigned q + 128 that vpdpbusd multiplies with the signed activations, so a
// 32-k block's exact integer dot is acc - 128 * sum(x_q). Each block is then
// scaled by its activation scale into an f32 accumulator, block by block in
// order; the integer part is exact, so only that f32 chain orders the result.
#define TILE_TQ 3
AI void tile_q8v(const struct cpu_mm_args *a, const uint8_t *wb, const int G, const int T, int t0,
                 int row0, const uint8_t *pf, int pf_lines)
{
    const struct tdm_weight *w = a->w;
    const int kpad = cpu_q8_kpad(w->cols), nblk = kpad / CPU_Q8_BLOCK;
    const size_t js = (size_t)G * 64;
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const uint8_t *xr[TILE_TQ];
    __m512 acc[CPU_BLOCK_PANELS][TILE_TQ];
#pragma GCC unroll 3
    for (int t = 0; t < TILE_TQ; t++) {
        xr[t] = t < T ? (const uint8_t *)(a->xq + (size_t)(t0 + t) * a->xq_stride) : NULL;
#pragma GCC unroll 4
        for (int g = 0; g < CPU_BLOCK_PANELS; g++)
            if (g < G && t < T)
                acc[g][t] = _mm512_setzero_ps();
    }
    for (int blk = 0; blk < nblk; blk++) {
        __m512i ai[CPU_BLOCK_PANELS][TILE_TQ];
#pragma GCC unroll 3
        for (int t = 0; t < TILE_TQ; t++)
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                if (g < G && t < T)
                    ai[g][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int qd = 0; qd < CPU_Q8_BLOCK / 4; qd++) {
            int j = blk * (CPU_Q8_BLOCK / 4) + qd;
            const uint8_t *wj = wb + j * js;
            if (pf) {
                for (int l = 0; l < pf_lines; l++)
                    _mm_prefetch((const char *)pf + ((size_t)j * pf_lines + l) * 64, _MM_HINT_T0);
            } else if (pf_lines < 0) {
                stream_prefetch(wj, G);
            }
            __m512i wv[CPU_BLOCK_PANELS];
#pragma GCC unroll 4
            for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                if (g < G)
                    wv[g] = _mm512_xor_si512(_mm512_loadu_si512(wj + g * 64), flip);
#pragma GCC unroll 3
            for (int t = 0; t < TILE_TQ; t++) {
                if (t < T) {
                    int32_t xv;
                    memcpy(&xv, xr[t] + 4 * (size_t)j, 4);
                    __m512i xb = _mm512_set1_epi32(xv);
#pragma GCC unroll 4
                    for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                        if (g < G)
                            ai[g][t] = _mm512_dpbusd_epi32(ai[g][t], wv[g], xb);
                }
            }
        }
#pragma GCC unroll 3
        for (int t = 0; t < TILE_TQ; t++) {
            if (t < T) {
                float sx;
                int32_t xsum;
                memcpy(&sx, xr[t] + kpad + 4 * (size_t)blk, 4);
                memcpy(&xsum, xr[t] + kpad + 4 * ((size_t)nblk + blk), 4);
                __m512i c = _mm512_set1_epi32(128 * xsum);
                __m512 sv = _mm512_set1_ps(sx);
#pragma GCC unroll 4
                for (int g = 0; g < CPU_BLOCK_PANELS; g++)
                    if (g < G)
                        acc[g][t] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(_mm512_sub_epi32(ai[g][t], c)), sv, acc[g][t]);
            }
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < CPU_BLOCK_PANELS; g++) {
        if (g >= G)
            continue;
        int r0 = row0 + g * 16;
        int nr = w->rows - r0;
        if (nr <= 0)
            continue;
        __mmask16 m = lanes_mask(nr);
        __m512 sc = _mm512_loadu_ps(w->scales + r0);
        __m512 bv = a->bias ? _mm512_maskz_loadu_ps(m, a->bias + r0) : _mm512_setzero_ps();
#pragma GCC unroll 3
        for (int t = 0; t < TILE_TQ; t++) {
            if (t < T) {
                __m512 v = _mm512_mul_ps(acc[g][t], sc);
                if (a->bias)
                    v = _mm512_add_ps(v, bv);
                _mm512_mask_storeu_ps(cpu_mm_y(a, t0 + t, r0), m, v);
            }
        }
    }
}

static void tile_q8(const struct cpu_mm_args *a, const uint8_t *wb, int G, int T, int t0, int row0,
                    const uint8_t *pf, int pf_lines)
{
    switch (G * 8 + T) {
    case 1 * 8 + 1:
        tile_q8v(a, wb, 1, 1, t0, row0, pf, pf_lines);
        break;
    case 1 * 8 + 2:
        tile_q8v(a, wb, 1, 2, t0, row0, pf, pf_lines);
        break;
    case 1 * 8 + 3:
        tile_q8v(a, wb, 1, 3, t0, row0, pf, pf_lines);
        break;
    case 2 * 8 + 1:
        tile_q8v(a, wb, 2, 1, t0, row0, pf, pf_lines);
        break;
    case 2 * 8 + 2:
        tile_q8v(a, wb, 2, 2, t0, row0, pf, pf_lines);
        break;
    case 2 * 8 + 3:
        tile_q8v(a, wb, 2, 3, t0, row0, pf, pf_lines);
        break;
    case 3 * 8 + 1:
        tile_q8v(a, wb, 3, 1, t0, row0, pf, pf_lines);
        break;
    case 3 * 8 + 2:
        tile_q8v(a, wb, 3, 2, t0, row0, pf, pf_lines);
        break;
    case 3 * 8 + 3:
        tile_q8v(a, wb, 3, 3, t0, row0, pf, pf_lines);
        break;
    case 4 * 8 + 1:
        tile_q8v(a, wb, 4, 1, t0, row0, pf, pf_lines);
        break;
    case 4 * 8 + 2:
        tile_q8v(a, wb, 4, 2, t0, row0, pf, pf_lines);
        break;
    default:
        tile_q8v(a, wb, 4, 3, t0, row0, pf, pf_lines);
        break;
    }
}

#define TILE_CASE(WT, g, t)                                                                        \
    case (g)*8 + (t):                                                                              \
        tile(a, wb, g, t, t0, row0, pf, pf_lines, WT);                                             \
        break;
#define TILE_CASES_G(WT, g)                                                                        \
    TILE_CASE(WT, g, 1)                                                                            \
    TILE_CASE(WT, g, 2)                                                                            \
    TILE_CASE(WT, g, 3) TILE_CASE(WT, g, 4) TILE_CASE(WT, g, 5) TILE_CASE(WT, g, 6)
#define TILE_DISPATCH(fname, WT)                                                                   \
    static void fname(const struct cpu_mm_args *a, const uint8_t *wb, int G, int T, int t0,        \
                      int row0, const uint8_t *pf, int pf_lines)                                   \
    {                                                                                              \
        switch (G * 8 + T) {                                                                       \
            TILE_CASES_G(WT, 1)                                                                    \
            TILE_CASES_G(WT, 2)                                                                    \
            TILE_CASES_G(WT, 3)                                                                    \
            TILE_CASES_G(WT, 4)                                                                    \
        default:                                                                                   \
            break;                                                                                 \
        }                                                                                          \
    }

TILE_DISPATCH(tile_bf16, TDM_W_BF16)
TILE_DISPATCH(tile_f32, TDM_W_F32)

// Tiles of a batch of at least PF_TILES tiles prefetch the chunk's next block,
// a quarter per tile over the first four, so the block is in L2 when its turn
// comes. With fewer tiles a block computes too briefly for a prefetch stream
// to keep pace (measured slower than leaving it to the hardware). There
// (decode, small batches) on an Intel CPU the first tile, which streams the
// block from memory, is told so by pf_lines < 0 (pf NULL): it prefetches
// CPU_STREAM_PREFETCH bytes ahead of its reads into L2 (cpu_impl.h: on Zen 4
// the hardware's prefetchers alone kept up, on Sapphire Rapids they did not).
// Only that tile: the others read the block from cache, and a prefetch per
// line there cost int8 prefill 13%.
#define PF_TILES 4

static void mm_blocks(const struct cpu_mm_args *a, int b0, int b1)
{
    const struct tdm_weight *w = a->w;
    void (*fn)(const struct cpu_mm_args *, const uint8_t *, int, int, int, int, const uint8_t *,
               int) = w->type == TDM_W_BF16 ? tile_bf16
                      : w->type == TDM_W_Q8 ? tile_q8
                                            : tile_f32;
    const int tt = w->type == TDM_W_Q8 ? TILE_TQ : TILE_T;
    const int steps = cpu_w_steps(w);
    const int ntiles = (a->n + tt - 1) / tt;
    const int pft = ntiles < PF_TILES ? ntiles : PF_TILES;
    for (int b = b0; b < b1; b++) {
        const uint8_t *wb = cpu_w_block(w, b);
        int G = cpu_w_block_panels(w, b);
        const uint8_t *next = NULL;
        size_t share = 0;
        int pf_lines = 0;
        if (ntiles >= PF_TILES && b + 1 < b1) {
            next = cpu_w_block(w, b + 1);
            size_t bytes = (size_t)steps * cpu_w_block_panels(w, b + 1) * 64;
            share = (bytes / (size_t)pft + 63) / 64 * 64;
            pf_lines = (int)((share / 64 + (size_t)steps - 1) / (size_t)steps);
        }
        // Tiles of balanced sizes (32 tokens: 6,6,5,5,5,5 rather than 6 x 5 + 2):
        // a narrow tile reuses each weight load for fewer tokens.
        for (int t0 = 0, ti = 0; t0 < a->n; ti++) {
            int T = (a->n - t0 + (ntiles - ti) - 1) / (ntiles - ti);
            const uint8_t *pf = next && ti < pft ? next + (size_t)ti * share : NULL;
            // A small batch's first tile streams the block (see PF_TILES).
            int lines = ntiles >= PF_TILES ? pf_lines : ti == 0 && a->stream_prefetch ? -1 : 0;
            fn(a, wb, G, T, t0, b * CPU_BLOCK_ROWS, pf, lines);
            t0 += T;
        }
    }
}

// ---- elementwise and attention --------------------------------------------------------------
static void silu_mul_row(const float *gate, const float *up, float *out, int inter)
{
    for (int i = 0; i < inter; i += 16) {
        __mmask16 m = lanes_mask(inter - i);
        __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
        __m512 u = _mm512_maskz_loadu_ps(m, up + i);
        __m512 e = cpu_exp512(_mm512_sub_ps(_mm512_setzero_ps(), g));
        __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(s, u));
    }
}

// Sums of 16 vectors, one lane each: lane j of the result = sum of v[j]'s
// lanes, through a fixed shuffle tree (quarters, halves, pairs, then a lane
// permutation), much cheaper than 16 separate horizontal sums.
AI __m512 transpose_sum16(__m512 v[16])
{
    __m512 u[8], w[4], x[2];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xdd));
        // w[i] quarter c holds 4 partials of v[4i + c].
#pragma GCC unroll 2
    for (int i = 0; i < 2; i++)
        x[i] =
            _mm512_add_ps(_mm512_unpacklo_ps(w[i], w[i + 2]), _mm512_unpackhi_ps(w[i], w[i + 2]));
    // x[0] quarter c: [v[c] 02, v[8+c] 02, v[c] 13, v[8+c] 13]; x[1] likewise for v[4+c], v[12+c].
    __m512 y = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(x[0]), _mm512_castps_pd(x[1]))));
    // y quarter c: [v[c], v[8+c], v[4+c], v[12+c]] -> lane j = sum of v[j].
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, y);
}

// 16 keys or values of row r at dim d: f32, or bf16 widened exactly by a
// 16-bit shift (bf16 is the top half of an f32).
AI __m512 kv_load(const void *base, bool bf16, size_t off, __mmask16 m)
{
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)base + off)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)base + off);
}

AI float scores_impl(const float *q, const void *k, bool bf16, int nk, const int hd, float scale,
                     float *s)
{
    __m512 acc[16];
#pragma GCC unroll 16
    for (int j = 0; j < 16; j++)
        acc[j] = _mm512_setzero_ps();
    for (int d = 0; d < hd; d += 16) {
        __mmask16 m = lanes_mask(hd - d);
        __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
        // Fully unrolled so that acc stays in registers.
#pragma GCC unroll 16
        for (int j = 0; j < 16; j++)
            if (j < nk)
                acc[j] = _mm512_fmadd_ps(qv, kv_load(k, bf16, (size_t)j * hd + d, m), acc[j]);
    }
    __mmask16 mk = lanes_mask(nk);
    __m512 sv = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
    _mm512_mask_storeu_ps(s, mk, sv);
    return _mm512_mask_reduce_max_ps(mk, sv);
}

// head_dim 64 (Qwen2.5, Llama 3.2 1B...) gets a copy with constant offsets and masks.
static float attn_scores(const float *q, const float *k, int nk, int hd, float scale, float *s)
{
    if (hd == 64)
        return scores_impl(q, k, false, nk, 64, scale, s);
    return scores_impl(q, k, false, nk, hd, scale, s);
}

static float attn_scores_bf16(const float *q, const uint16_t *k, int nk, int hd, float scale,
                              float *s)
{
    if (hd == 64)
        return scores_impl(q, k, true, nk, 64, scale, s);
    return scores_impl(q, k, true, nk, hd, scale, s);
}

static float attn_exp(float *s, int nk, float m)
{
    __mmask16 mk = lanes_mask(nk);
    __m512 v = _mm512_maskz_loadu_ps(mk, s);
    __m512 e = _mm512_maskz_mov_ps(mk, cpu_exp512(_mm512_sub_ps(v, _mm512_set1_ps(m))));
    _mm512_mask_storeu_ps(s, mk, e);
    return _mm512_reduce_add_ps(e);
}

// Up to 64 dims (4 vectors) stay in registers while the keys stream by.
AI void accum_impl(float *acc, float corr, const float *p, const void *v, bool bf16, int nk,
                   const int hd)
{
    __m512 c = _mm512_set1_ps(corr);
    for (int d0 = 0; d0 < hd; d0 += 64) {
        __mmask16 m[4];
        __m512 a[4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            int left = hd - d0 - 16 * i;
            m[i] = lanes_mask(left > 0 ? left : 0);
            a[i] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m[i], acc + d0 + 16 * i), c);
        }
        for (int j = 0; j < nk; j++) {
            __m512 pj = _mm512_set1_ps(p[j]);
            size_t off = (size_t)j * hd + d0;
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                a[i] = _mm512_fmadd_ps(pj, kv_load(v, bf16, off + 16 * i, m[i]), a[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++)
            _mm512_mask_storeu_ps(acc + d0 + 16 * i, m[i], a[i]);
    }
}

// attn_accum for NG heads of a GQA group over a span of keys at once: acc[g]
// = acc[g] * corr[g] + sum_j p[g][j] * v[j], the span's value rows coming in
// nrun runs (run r: nv[r] rows at v[r], head_dim apart; f32, or bf16 widened
// exactly in registers), j counting on across runs. Each lane's FMAs go in
// attn_accum's order, so each head's result is bit for bit attn_accum's (or
// attn_accum_bf16's) over the runs with corr on the first and 1 after; the
// heads share every V load and give 4 * NG independent FMA chains, and the
// accumulators stay in registers across the whole span.
AI void accum_span_impl(float *acc, const float *corr, const float *p, int p_stride,
                        const void *const *v, const int *nv, int nrun, bool bf16, const int NG,
                        const int hd)
{
    for (int d0 = 0; d0 < hd; d0 += 64) {
        __mmask16 m[4];
        __m512 a[4][4];
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            int left = hd - d0 - 16 * i;
            m[i] = lanes_mask(left > 0 ? left : 0);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++) {
            __m512 c = _mm512_set1_ps(corr[g]);
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                a[g][i] = _mm512_mul_ps(
                    _mm512_maskz_loadu_ps(m[i], acc + (size_t)g * hd + d0 + 16 * i), c);
        }
        const float *pr = p;
        for (int r = 0; r < nrun; r++) {
            const void *vr = v[r];
            for (int j = 0; j < nv[r]; j++) {
                __m512 vv[4];
                size_t off = (size_t)j * hd + d0;
#pragma GCC unroll 4
                for (int i = 0; i < 4; i++)
                    vv[i] = kv_load(vr, bf16, off + 16 * i, m[i]);
#pragma GCC unroll 4
                for (int g = 0; g < NG; g++) {
                    __m512 pj = _mm512_set1_ps(pr[(size_t)g * p_stride + j]);
#pragma GCC unroll 4
                    for (int i = 0; i < 4; i++)
                        a[g][i] = _mm512_fmadd_ps(pj, vv[i], a[g][i]);
                }
            }
            pr += nv[r];
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; g++)
#pragma GCC unroll 4
            for (int i = 0; i < 4; i++)
                _mm512_mask_storeu_ps(acc + (size_t)g * hd + d0 + 16 * i, m[i], a[g][i]);
    }
}

static void attn_accum_span(float *acc, const float *corr, const float *p, int p_stride,
                            const void *const *v, const int *nv, int nrun, bool bf16, int nh,
                            int hd)
{
    for (int g0 = 0; g0 < nh; g0 += 4) {
        float *a = acc + (size_t)g0 * hd;
        const float *c = corr + g0, *pg = p + (size_t)g0 * p_stride;
        // bf16, NG and (for the common head_dim 64) hd as constants, so that
        // the accumulators are registers and the lane masks fold away.
#define ACCUM_SPAN(BF, NG)                                                                         \
    (hd == 64 ? accum_span_impl(a, c, pg, p_stride, v, nv, nrun, BF, NG, 64)                       \
              : accum_span_impl(a, c, pg, p_stride, v, nv, nrun, BF, NG, hd))
#define ACCUM_SPAN_NG(BF)                                                                          \
    switch (nh - g0 < 4 ? nh - g0 : 4) {                                                           \
    case 4:                                                                                        \
        ACCUM_SPAN(BF, 4);                                                                         \
        break;                                                                                     \
    case 3:                                                                                        \
        ACCUM_SPAN(BF, 3);                                                                         \
        break;                                                                                     \
    case 2:                                                                                        \
        ACCUM_SPAN(BF, 2);                                                                         \
        break;                                                                                     \
    default:                                                                                       \
        ACCUM_SPAN(BF, 1);                                                                         \
    }
        if (bf16) {
            ACCUM_SPAN_NG(true)
        } else {
            ACCUM_SPAN_NG(false)
        }
#undef ACCUM_SPAN_NG
#undef ACCUM_SPAN
    }
}

static void widen_bf16(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = lanes_mask(n - i < 16 ? (int)(n - i) : 16);
        _mm512_mask_storeu_ps(dst + i, m, kv_load(src, true, i, m));
    }
}

static void attn_accum(float *acc, float corr, const float *p, const float *v, int nk, int hd)
{
    if (hd == 64)
        accum_impl(acc, corr, p, v, false, nk, 64);
    else
        accum_impl(acc, corr, p, v, false, nk, hd);
}

static void attn_accum_bf16(float *acc, float corr, const float *p, const uint16_t *v, int nk,
                            int hd)
{
    if (hd == 64)
        accum_impl(acc, corr, p, v, true, nk, 64);
    else
        accum_impl(acc, corr, p, v, true, nk, hd);
}

// _mm512_max_ps(x, m) is m when x is NaN: `>` semantics.
static float row_max(const float *x, int n)
{
    __m512 m0 = _mm512_set1_ps(-INFINITY);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
    float lanes[16];
    _mm512_storeu_ps(lanes, m0);
    float m = -INFINITY;
    for (int l = 0; l < 16; l++)
        m = lanes[l] > m ? lanes[l] : m;
    for (; i < n; i++)
        m = x[i] > m ? x[i] : m;
    return m;
}

#pragma GCC pop_options

const struct cpu_kernels cpu_kernels_avx512 = {
    .name = "avx512",
    .mm_prep_x = mm_prep_x,
    .mm_blocks = mm_blocks,
    .silu_mul_row = silu_mul_row,
    .attn_scores = attn_scores,
    .attn_exp = attn_exp,
    .attn_accum = attn_accum,
    .attn_scores_bf16 = attn_scores_bf16,
    .attn_accum_bf16 = attn_accum_bf16,
    .attn_accum_span = attn_accum_span,
    .widen_bf16 = widen_bf16,
    .row_max = row_max,
};

#endif
