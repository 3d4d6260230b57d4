// SPDX-License-Identifier: Apache-2.0
// cpu_kernels_portable: the plain-C path, for any CPU and as the readable
// statement of what the SIMD paths compute. Activations stay f32 (no bf16
// rounding): every output element is a sequential sum over k in its own
// accumulator, so the code is batch invariant by construction.
#include <math.h>
#include <string.h>

#include "cpu_impl.h"

#define PANEL CPU_PANEL_ROWS

// One panel (16 rows) of a block for one token: acc[lane] over all k.
static void panel_dot(const struct cpu_mm_args *a, const uint8_t *wb, int G, int g, const float *x,
                      float acc[PANEL])
{
    const struct tdm_weight *w = a->w;
    for (int l = 0; l < PANEL; l++)
        acc[l] = 0.0f;
    if (w->type == TDM_W_BF16) {
        int full = w->cols / 2;
        for (int j = 0; j < full; j++) {
            const uint16_t *p = (const uint16_t *)(wb + ((size_t)j * G + g) * 64);
            float xe = x[2 * j], xo = x[2 * j + 1];
            for (int l = 0; l < PANEL; l++) {
                acc[l] = acc[l] + cpu_bf16_to_f32(p[2 * l]) * xe;
                acc[l] = acc[l] + cpu_bf16_to_f32(p[2 * l + 1]) * xo;
            }
        }
        if (w->cols & 1) {
            const uint16_t *p = (const uint16_t *)(wb + ((size_t)full * G + g) * 64);
            float xe = x[2 * full];
            for (int l = 0; l < PANEL; l++)
                acc[l] = acc[l] + cpu_bf16_to_f32(p[2 * l]) * xe;
        }
    } else if (w->type == TDM_W_Q8) {
        for (int k = 0; k < w->cols; k++) {
            const int8_t *p = (const int8_t *)(wb + ((size_t)(k / 4) * G + g) * 64) + k % 4;
            float xk = x[k];
            for (int l = 0; l < PANEL; l++)
                acc[l] = acc[l] + (float)p[4 * l] * xk;
        }
    } else {
        for (int k = 0; k < w->cols; k++) {
            const float *p = (const float *)(wb + ((size_t)k * G + g) * 64);
            float xk = x[k];
            for (int l = 0; l < PANEL; l++)
                acc[l] = acc[l] + p[l] * xk;
        }
    }
}

static void mm_blocks(const struct cpu_mm_args *a, int b0, int b1)
{
    const struct tdm_weight *w = a->w;
    for (int b = b0; b < b1; b++) {
        const uint8_t *wb = cpu_w_block(w, b);
        int G = cpu_w_block_panels(w, b);
        for (int g = 0; g < G; g++) {
            int r0 = b * CPU_BLOCK_ROWS + g * PANEL;
            int nr = w->rows - r0 < PANEL ? w->rows - r0 : PANEL;
            for (int t = 0; t < a->n; t++) {
                float acc[PANEL];
                panel_dot(a, wb, G, g, a->x + (size_t)t * w->cols, acc);
                float *y = cpu_mm_y(a, t, r0);
                for (int l = 0; l < nr; l++) {
                    float v = acc[l];
                    if (w->type == TDM_W_Q8)
                        v = v * w->scales[r0 + l];
                    if (a->bias)
                        v = v + a->bias[r0 + l];
                    y[l] = v;
                }
            }
        }
    }
}

static void silu_mul_row(const float *gate, const float *up, float *out, int inter)
{
    for (int i = 0; i < inter; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

static float attn_scores(const float *q, const float *k, int nk, int hd, float scale, float *s)
{
    float mx = -INFINITY;
    for (int j = 0; j < nk; j++) {
        const float *kr = k + (size_t)j * hd;
        float d = 0.0f;
        for (int i = 0; i < hd; i++)
            d += q[i] * kr[i];
        s[j] = d * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

static float attn_exp(float *s, int nk, float m)
{
    float sum = 0.0f;
    for (int j = 0; j < nk; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

static void attn_accum(float *acc, float corr, const float *p, const float *v, int nk, int hd)
{
    for (int i = 0; i < hd; i++) {
        float a = acc[i] * corr;
        for (int j = 0; j < nk; j++)
            a += p[j] * v[(size_t)j * hd + i];
        acc[i] = a;
    }
}

static float attn_scores_bf16(const float *q, const uint16_t *k, int nk, int hd, float scale,
                              float *s)
{
    float mx = -INFINITY;
    for (int j = 0; j < nk; j++) {
        const uint16_t *kr = k + (size_t)j * hd;
        float d = 0.0f;
        for (int i = 0; i < hd; i++)
            d += q[i] * cpu_bf16_to_f32(kr[i]);
        s[j] = d * scale;
        mx = s[j] > mx ? s[j] : mx;
    }
    return mx;
}

static void attn_accum_bf16(float *acc, float corr, const float *p, const uint16_t *v, int nk,
                            int hd)
{
    for (int i = 0; i < hd; i++) {
        float a = acc[i] * corr;
        for (int j = 0; j < nk; j++)
            a += p[j] * cpu_bf16_to_f32(v[(size_t)j * hd + i]);
        acc[i] = a;
    }
}

static void widen_bf16(const uint16_t *src, float *dst, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = cpu_bf16_to_f32(src[i]);
}

const struct cpu_kernels cpu_kernels_portable = {
    .name = "portable",
    .mm_prep_x = NULL,
    .mm_blocks = mm_blocks,
    .silu_mul_row = silu_mul_row,
    .attn_scores = attn_scores,
    .attn_exp = attn_exp,
    .attn_accum = attn_accum,
    .attn_scores_bf16 = attn_scores_bf16,
    .attn_accum_bf16 = attn_accum_bf16,
    .widen_bf16 = widen_bf16,
};
