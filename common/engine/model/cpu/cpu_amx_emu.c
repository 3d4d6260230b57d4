// SPDX-License-Identifier: Apache-2.0
// cpu_amx_emu: the software model of the AMX tile instructions (see
// cpu_amx_emu.h for the semantics it follows and why it exists). Plain C11:
// the f32 arithmetic is SSE's on x86-64 (FLT_EVAL_METHOD 0) and fmaf is the
// C library's correctly rounded fused multiply-add, so one step rounds once,
// as the hardware's FMA does.
#include "cpu_amx_emu.h"

#include <math.h>
#include <string.h>

#include "core.h"
#include "cpu_impl.h"

// Denormal (input DAZ, output FTZ) -> zero of the same sign.
static float flush(float f)
{
    uint32_t u = cpu_f32_bits(f);
    if ((u & 0x7f800000u) == 0)
        return cpu_bits_f32(u & 0x80000000u);
    return f;
}

float cpu_amx_emu_fma(float a, float b, float acc)
{
    return flush(fmaf(flush(a), flush(b), flush(acc)));
}

float cpu_amx_emu_add(float x, float y)
{
    return flush(flush(x) + flush(y));
}

uint16_t cpu_amx_emu_f32_to_bf16(float f)
{
    uint32_t u = cpu_f32_bits(f);
    if ((u & 0x7f800000u) == 0) // zero or denormal: a zero of its sign
        return (uint16_t)((u >> 16) & 0x8000u);
    if ((u & 0x7fffffffu) > 0x7f800000u) // NaN: quieted
        return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u); // nearest even (infinity stays infinity)
    return (uint16_t)(u >> 16);
}

float cpu_amx_emu_exp(float x)
{
    // vmaxps/vminps return the second operand when either is NaN, as fmaxf
    // and fminf return the number.
    x = fmaxf(x, -87.33f);
    x = fminf(x, 88.0f);
    float n = nearbyintf(x * 1.44269504f);
    float r = fmaf(-n, 0.693359375f, x);
    r = fmaf(-n, -2.12194440e-4f, r);
    float p = 1.0f / 720;
    p = fmaf(p, r, 1.0f / 120);
    p = fmaf(p, r, 1.0f / 24);
    p = fmaf(p, r, 1.0f / 6);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    return ldexpf(p, (int)n);
}

void cpu_amx_emu_loadconfig(struct cpu_amx_emu *e, const struct cpu_amx_cfg *cfg,
                            enum cpu_amx_order order)
{
    TDM_ASSERT(cfg->palette == 1);
    for (int t = 0; t < CPU_AMX_TILES; t++)
        TDM_ASSERT(cfg->rows[t] <= CPU_AMX_ROWS && cfg->colsb[t] <= CPU_AMX_COLSB);
    e->cfg = *cfg;
    e->order = order;
    memset(e->tile, 0, sizeof e->tile);
}

static void check_tile(const struct cpu_amx_emu *e, int t)
{
    TDM_ASSERT(t >= 0 && t < CPU_AMX_TILES && e->cfg.palette == 1 && e->cfg.rows[t] > 0 &&
               e->cfg.colsb[t] > 0);
}

void cpu_amx_emu_zero(struct cpu_amx_emu *e, int t)
{
    check_tile(e, t);
    memset(e->tile[t], 0, sizeof e->tile[t]);
}

void cpu_amx_emu_load(struct cpu_amx_emu *e, int t, const void *base, size_t stride)
{
    check_tile(e, t);
    memset(e->tile[t], 0, sizeof e->tile[t]);
    for (int r = 0; r < e->cfg.rows[t]; r++)
        memcpy(e->tile[t][r], (const uint8_t *)base + (size_t)r * stride, e->cfg.colsb[t]);
}

void cpu_amx_emu_store(const struct cpu_amx_emu *e, int t, void *base, size_t stride)
{
    check_tile(e, t);
    for (int r = 0; r < e->cfg.rows[t]; r++)
        memcpy((uint8_t *)base + (size_t)r * stride, e->tile[t][r], e->cfg.colsb[t]);
}

static float tile_bf16(const struct cpu_amx_emu *e, int t, int row, int idx)
{
    uint16_t h;
    memcpy(&h, &e->tile[t][row][2 * idx], 2);
    return cpu_bits_f32((uint32_t)h << 16);
}

static float tile_f32(const struct cpu_amx_emu *e, int t, int row, int idx)
{
    float f;
    memcpy(&f, &e->tile[t][row][4 * idx], 4);
    return f;
}

void cpu_amx_emu_dpbf16ps(struct cpu_amx_emu *e, int c, int a, int b)
{
    check_tile(e, c);
    check_tile(e, a);
    check_tile(e, b);
    const struct cpu_amx_cfg *g = &e->cfg;
    TDM_ASSERT(g->rows[a] == g->rows[c] && g->colsb[a] == 4 * g->rows[b] &&
               g->colsb[b] == g->colsb[c] && g->colsb[c] % 4 == 0 && g->colsb[a] % 4 == 0);
    const int M = g->rows[c], K = g->colsb[a] / 4, N = g->colsb[c] / 4;
    for (int m = 0; m < M; m++) {
        float out[CPU_AMX_COLSB / 4];
        for (int n = 0; n < N; n++) {
            float acc = tile_f32(e, c, m, n);
            if (e->order == CPU_AMX_ORDER_SDM) {
                float even = 0.0f, odd = 0.0f;
                for (int k = 0; k < K; k++) {
                    even =
                        cpu_amx_emu_fma(tile_bf16(e, a, m, 2 * k), tile_bf16(e, b, k, 2 * n), even);
                    odd = cpu_amx_emu_fma(tile_bf16(e, a, m, 2 * k + 1),
                                          tile_bf16(e, b, k, 2 * n + 1), odd);
                }
                acc = cpu_amx_emu_add(acc, cpu_amx_emu_add(even, odd));
            } else {
                for (int k = 0; k < K; k++) {
                    acc =
                        cpu_amx_emu_fma(tile_bf16(e, a, m, 2 * k), tile_bf16(e, b, k, 2 * n), acc);
                    acc = cpu_amx_emu_fma(tile_bf16(e, a, m, 2 * k + 1),
                                          tile_bf16(e, b, k, 2 * n + 1), acc);
                }
            }
            out[n] = acc;
        }
        // The row is written whole and the bytes past colsb zeroed, as the
        // hardware's write_row_and_zero does.
        memset(e->tile[c][m], 0, CPU_AMX_COLSB);
        memcpy(e->tile[c][m], out, (size_t)N * 4);
    }
}
