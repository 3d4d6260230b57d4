// SPDX-License-Identifier: Apache-2.0
// cpu_kernels_amx: the AMX path (Intel Advanced Matrix Extensions, Sapphire
// Rapids and later): BF16-weight matmuls through AMX-BF16 tiles
// (cpu_amx_body.h), everything else (Q8 and F32 weights, attention, the
// element-wise ops) from the AVX-512 table, whose features every AMX CPU has.
// The same GEMM body is also built over the software tile model
// (cpu_amx_emu.h), over the portable table (cpu_kernels_amx_fill(k, true)),
// so that tests prove its tiling, padding and accumulation order on every
// host; only the tests use that table (cpu_backend_use_amx_emu).
//
// The path is chosen for every n (decode included), never by batch size:
// the tile kernel and vdpbf16ps round differently, so a token's row must not
// change path with the batch it is in (docs/cpu-backend.md, Batch invariance).
//
// Activations: the AVX-512 conversion (vcvtne2ps2bf16: nearest even,
// denormals to zero) into xq, plus zeroed padding rows up to a multiple of
// 16 tokens where n > 16, so every A tile is whole (decode configures tiles
// of n rows instead); the emulated table converts with the
// same rounding in C. Linux hands a process the AMX tile state only on
// request (arch_prctl ARCH_REQ_XCOMP_PERM), made once by cpu_amx_available.
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cpu_amx_emu.h"
#include "cpu_avx512_math.h"
#include "cpu_impl.h"
#include "kv_cache.h"

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define CPU_AMX_REAL 1
#endif

// Rows [n, ceil(n / 16) * 16) of xq, up to the weight's k pairs rounded to
// 16, read as zeros: the padding tokens of the last A tile when n > 16 (a
// call of fewer tokens configures tiles of n rows). Only the call that
// converts the last token writes them.
static void zero_pad_tokens(const struct cpu_mm_args *a, int t1)
{
    if (t1 != a->n || a->n < 16)
        return;
    size_t kp16 = ((size_t)(a->w->cols + 1) / 2 + 15) / 16 * 16;
    for (int t = a->n; t < (a->n + 15) / 16 * 16; t++)
        memset((uint32_t *)a->xq + (size_t)t * a->xq_stride, 0, kp16 * sizeof(uint32_t));
}

// K chunks (32 k each) per pass of the two-token-tile GEMM (cpu_amx_body.h):
// the pass's two A tiles per chunk, 2 KiB, stay in L1 for the block's second
// panel pair.
#ifndef CPU_AMX_KPASS
#define CPU_AMX_KPASS 10
#endif

// Attention (cpu_amx_attn_body.h; bf16 pools): prefetches into L2 the key
// and value rows of KV head kvh at positions [p0, p1) of sequence sq (the
// next span's), block by block.
static void attn_prefetch_kv(const struct cpu_attn_job *j, const struct tdm_attn_seq *sq, int kvh,
                             int p0, int p1)
{
    const int bs = j->block_size;
    const size_t row = (size_t)j->head_dim * 2;
    for (int pos = p0; pos < p1;) {
        const int blk = sq->block_table[pos / bs], slot = pos % bs;
        const int run = bs - slot < p1 - pos ? bs - slot : p1 - pos;
        const uint16_t *base[2] = {tdm_kv_v_bf16(j->kv, j->layer, blk),
                                   tdm_kv_k_bf16(j->kv, j->layer, blk)};
        for (int kv = 0; kv < 2; kv++) {
            if (base[kv] == NULL)
                continue;
            const uint8_t *p = (const uint8_t *)base[kv] + ((size_t)kvh * bs + slot) * row;
            for (size_t b = 0; b < (size_t)run * row; b += 64)
                __builtin_prefetch(p + b, 0, 2);
        }
        pos += run;
    }
}

// ---- the emulated path (every host) ----------------------------------------------------------
// Tokens [t0, t1) to bf16 pairs as the AVX-512 conversion writes them: pairs
// up to a multiple of 16 (zero past cols), then the padding tokens.
static void emu_prep_x(const struct cpu_mm_args *a, int t0, int t1)
{
    if (a->w->type != TDM_W_BF16)
        return; // the portable kernels read f32 x for the other types
    int cols = a->w->cols, kp16 = ((cols + 1) / 2 + 15) / 16 * 16;
    for (int t = t0; t < t1; t++) {
        const float *x = a->x + (size_t)t * cols;
        uint32_t *d = (uint32_t *)a->xq + (size_t)t * a->xq_stride;
        for (int j = 0; j < kp16; j++) {
            uint32_t lo = 2 * j < cols ? cpu_amx_emu_f32_to_bf16(x[2 * j]) : 0;
            uint32_t hi = 2 * j + 1 < cols ? cpu_amx_emu_f32_to_bf16(x[2 * j + 1]) : 0;
            d[j] = lo | hi << 16;
        }
    }
    zero_pad_tokens(a, t1);
}

#define AMX_GEMM gemm_emu
#define AMX_ATTR
#define AMX_STATE struct cpu_amx_emu emu_
#define AMX_LOADCFG(cfg) cpu_amx_emu_loadconfig(&emu_, (cfg), CPU_AMX_ORDER_SDM)
#define AMX_ZERO(t) cpu_amx_emu_zero(&emu_, (t))
#define AMX_LOAD(t, p, s) cpu_amx_emu_load(&emu_, (t), (p), (s))
#define AMX_STORE(t, p, s) cpu_amx_emu_store(&emu_, (t), (p), (s))
#define AMX_DP(c, a, b) cpu_amx_emu_dpbf16ps(&emu_, (c), (a), (b))
#define AMX_RELEASE() ((void)emu_)
#include "cpu_amx_body.h"

// The scalar twins of the real path's attention helpers (amx_pack_q,
// amx_softmax, amx_transpose, amx_accum, amx_finish below), lane by lane the
// same operations.
// The online softmax's step over a row tile's scores sT ([t16 keys][16
// rows]; t16, t32: keys rounded to 16 and 32) of the span at s0: keys past
// a row's position prow[r] are masked out; m, l the running max and sum,
// corr the correction of what was accumulated so far; pT the weights in key
// pairs ([t32 / 2][16] bf16 pairs, zero past t16) as hi, and at pT +
// CPU_ATTN_SPAN / 2 * 16 as lo: hi = p rounded to bf16, lo = (p - hi)
// rounded (the difference is exact in f32).
static void emu_softmax(const float *sT, int t16, int t32, int s0, const int *prow, float scale,
                        float *m, float *l, float *corr, uint32_t *pT)
{
    for (int r = 0; r < 16; r++) {
        float mc = -INFINITY;
        for (int k = 0; k < t16; k++) {
            float s = sT[(size_t)k * 16 + r] * scale;
            if (s0 + k <= prow[r] && s > mc)
                mc = s;
        }
        float m_new = mc > m[r] ? mc : m[r];
        corr[r] = m[r] == -INFINITY ? 0.0f : cpu_amx_emu_exp(m[r] - m_new);
        float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int k = 0; k < t16; k += 2) {
            float p[2];
            for (int e = 0; e < 2; e++) {
                float s = sT[(size_t)(k + e) * 16 + r] * scale;
                p[e] = s0 + k + e <= prow[r] ? cpu_amx_emu_exp(s - m_new) : 0.0f;
                sum[(k + e) % 4] += p[e];
            }
            uint16_t hi[2], lo[2];
            for (int e = 0; e < 2; e++) {
                hi[e] = cpu_amx_emu_f32_to_bf16(p[e]);
                lo[e] = cpu_amx_emu_f32_to_bf16(p[e] - cpu_bf16_to_f32(hi[e]));
            }
            pT[(size_t)k / 2 * 16 + r] = (uint32_t)hi[0] | (uint32_t)hi[1] << 16;
            pT[(size_t)(CPU_ATTN_SPAN + k) / 2 * 16 + r] = (uint32_t)lo[0] | (uint32_t)lo[1] << 16;
        }
        for (int k = t16; k < t32; k += 2) {
            pT[(size_t)k / 2 * 16 + r] = 0;
            pT[(size_t)(CPU_ATTN_SPAN + k) / 2 * 16 + r] = 0;
        }
        float lc = l[r] * corr[r];
        float ls = (sum[0] + sum[1]) + (sum[2] + sum[3]);
        l[r] = lc + ls;
        m[r] = m_new;
    }
}

// vT[d][k] = vrow[k][d] for keys k < nk (a multiple of 32) and dims d < hd,
// zero for d in [hd, hdp): the span's value rows transposed into the A tiles
// of O^T = V^T . P^T (vT rows CPU_ATTN_SPAN keys apart).
static void emu_transpose(uint16_t *vT, const uint16_t *const *vrow, int nk, int hd, int hdp)
{
    for (int k = 0; k < nk; k++)
        for (int d = 0; d < hdp; d++)
            vT[(size_t)d * CPU_ATTN_SPAN + k] = d < hd ? vrow[k][d] : 0;
}

// One row tile's q (qrow[i] NULL: a padding row, zeros) as hi + lo bf16 in
// dim pairs, qt[h][pp][i] = (x[2pp], x[2pp + 1]) of part h: hi = x rounded,
// lo = (x - hi) rounded (the difference is exact in f32); zeros from hd to
// hdp.
static void emu_pack_q(uint32_t *qt, const float *const *qrow, int hd, int hdp)
{
    for (int i = 0; i < 16; i++)
        for (int pp = 0; pp < hdp / 2; pp++) {
            uint32_t hi = 0, lo = 0;
            for (int e = 0; e < 2; e++) {
                const int d = 2 * pp + e;
                if (qrow[i] == NULL || d >= hd)
                    continue;
                uint16_t h = cpu_amx_emu_f32_to_bf16(qrow[i][d]);
                uint16_t l = cpu_amx_emu_f32_to_bf16(qrow[i][d] - cpu_bf16_to_f32(h));
                hi |= (uint32_t)h << (16 * e);
                lo |= (uint32_t)l << (16 * e);
            }
            qt[(size_t)pp * 16 + i] = hi;
            qt[((size_t)hdp / 2 + pp) * 16 + i] = lo;
        }
}

// orow[i][d] = acc[d][i] * (1 / l[i]) for dims d < hd, of the rows whose
// orow is not NULL.
static void emu_finish(float *const *orow, const float *acc, const float *l, int hd)
{
    for (int i = 0; i < 16; i++) {
        if (orow[i] == NULL)
            continue;
        float inv = 1.0f / l[i];
        for (int d = 0; d < hd; d++)
            orow[i][d] = acc[(size_t)d * 16 + i] * inv;
    }
}

// acc[d][r] = acc[d][r] * corr[r] + c[d][r] for dims d < nd, rows r < 16.
static void emu_accum(float *acc, const float *c, const float *corr, int nd)
{
    for (int d = 0; d < nd; d++)
        for (int r = 0; r < 16; r++) {
            float a = acc[(size_t)d * 16 + r] * corr[r];
            acc[(size_t)d * 16 + r] = a + c[(size_t)d * 16 + r];
        }
}

#define AMX_ATTN attn_emu
#define AMXV(name) emu_##name
#include "cpu_amx_attn_body.h"
#undef AMX_ATTN
#undef AMXV
#undef AMX_GEMM
#undef AMX_ATTR
#undef AMX_STATE
#undef AMX_LOADCFG
#undef AMX_ZERO
#undef AMX_LOAD
#undef AMX_STORE
#undef AMX_DP
#undef AMX_RELEASE

static void emu_mm_blocks(const struct cpu_mm_args *a, int b0, int b1)
{
    if (a->w->type == TDM_W_BF16)
        gemm_emu(a, b0, b1);
    else
        cpu_kernels_portable.mm_blocks(a, b0, b1);
}

// ---- the real path (x86-64 Linux with AMX-TILE and AMX-BF16)
// -------------------------------------
#ifdef CPU_AMX_REAL

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

bool cpu_amx_available(void)
{
    // 0: not asked yet, 1: usable, 2: not. Two threads asking at once both
    // make the (idempotent) request.
    static atomic_int state;
    int s = atomic_load_explicit(&state, memory_order_acquire);
    if (s == 0) {
        unsigned eax, ebx, ecx, edx;
        bool cpu = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 24 & 1) && // AMX-TILE
                   (edx >> 22 & 1);                                                      // AMX-BF16
        // The kernel refuses (EINVAL) where it has no AMX support (before 5.16).
        bool os = cpu && syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
        s = os ? 1 : 2;
        atomic_store_explicit(&state, s, memory_order_release);
    }
    return s == 1;
}

#define AMX_GEMM gemm_amx
#define AMX_ATTR __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma")))
#define AMX_STATE
#define AMX_LOADCFG(cfg) _tile_loadconfig(cfg)
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, s) _tile_loadd(t, p, s)
#define AMX_STORE(t, p, s) _tile_stored(t, p, s)
#define AMX_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_RELEASE() _tile_release()
#include "cpu_amx_body.h"

#define AMXV_ATTR                                                                                  \
    static inline __attribute__((always_inline, target("amx-tile,amx-bf16," CPU_AVX512_TARGET)))

// x0 (words 0-15) and x1 (words 16-31) as two bf16 each: *hi = x rounded
// (vcvtne2ps2bf16), *lo = (x - hi) rounded, hi widened back by a shift (the
// difference is exact in f32).
AMXV_ATTR void amx_split_bf16(__m512 x0, __m512 x1, __m512i *hi, __m512i *lo)
{
    __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
    __m512 r0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16)));
    __m512 r1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_slli_epi32(
                                      _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16)));
    *hi = h;
    *lo = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
}

// emu_softmax's operations, 16 rows a vector.
AMXV_ATTR void amx_softmax(const float *sT, int t16, int t32, int s0, const int *prow, float scale,
                           float *m, float *l, float *corr, uint32_t *pT)
{
    const __m512i pr = _mm512_loadu_si512(prow);
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 mc = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < t16; k++) {
        __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sT + (size_t)k * 16), vs);
        __mmask16 ok = _mm512_cmp_epi32_mask(_mm512_set1_epi32(s0 + k), pr, _MM_CMPINT_LE);
        mc = _mm512_mask_max_ps(mc, ok, s, mc); // s > mc ? s : mc
    }
    const __m512 vm = _mm512_loadu_ps(m);
    const __m512 m_new = _mm512_max_ps(mc, vm); // mc > m ? mc : m
    __mmask16 seen = _mm512_cmp_ps_mask(vm, _mm512_set1_ps(-INFINITY), _CMP_NEQ_UQ);
    const __m512 c = _mm512_maskz_mov_ps(seen, cpu_exp512(_mm512_sub_ps(vm, m_new)));
    _mm512_storeu_ps(corr, c);
    // Word 2r: row r's even key, word 2r + 1: its odd key.
    const __m512i inter =
        _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 sum[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                     _mm512_setzero_ps()};
    for (int k = 0; k < t16; k += 2) {
        __m512 p[2];
        for (int e = 0; e < 2; e++) {
            __m512 s = _mm512_mul_ps(_mm512_loadu_ps(sT + (size_t)(k + e) * 16), vs);
            __mmask16 ok = _mm512_cmp_epi32_mask(_mm512_set1_epi32(s0 + k + e), pr, _MM_CMPINT_LE);
            p[e] = _mm512_maskz_mov_ps(ok, cpu_exp512(_mm512_sub_ps(s, m_new)));
            sum[(k + e) % 4] = _mm512_add_ps(sum[(k + e) % 4], p[e]);
        }
        __m512i h, lo;
        amx_split_bf16(p[0], p[1], &h, &lo);
        _mm512_storeu_si512(pT + (size_t)k / 2 * 16, _mm512_permutexvar_epi16(inter, h));
        _mm512_storeu_si512(pT + (size_t)(CPU_ATTN_SPAN + k) / 2 * 16,
                            _mm512_permutexvar_epi16(inter, lo));
    }
    for (int k = t16; k < t32; k += 2) {
        _mm512_storeu_si512(pT + (size_t)k / 2 * 16, _mm512_setzero_si512());
        _mm512_storeu_si512(pT + (size_t)(CPU_ATTN_SPAN + k) / 2 * 16, _mm512_setzero_si512());
    }
    __m512 lc = _mm512_mul_ps(_mm512_loadu_ps(l), c);
    __m512 ls = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]), _mm512_add_ps(sum[2], sum[3]));
    _mm512_storeu_ps(l, _mm512_add_ps(lc, ls));
    _mm512_storeu_ps(m, m_new);
}

// The 16 x 16 transpose of 32-bit elements: x[i] dword j -> x[j] dword i.
AMXV_ATTR void amx_transpose16_epi32(__m512i x[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]);
    }
    // u[4i + c], 128-bit lane L: rows 4i..4i+3 of column 4L + c.
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88);
        __m512i v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
        __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        x[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
        x[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
        x[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
        x[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
    }
}

// emu_transpose, 32 keys x 32 dims at a time: key pairs interleaved into
// dwords (vpermt2w), then two 16 x 16 dword transposes.
AMXV_ATTR void amx_transpose(uint16_t *vT, const uint16_t *const *vrow, int nk, int hd, int hdp)
{
    // Words 2d, 2d + 1: dim d of the even and of the odd key (lo: d < 16).
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                        8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int d0 = 0; d0 < hdp; d0 += 32) {
        const __mmask32 m = hd - d0 >= 32 ? (__mmask32)0xffffffffu
                            : hd > d0     ? (__mmask32)((1u << (hd - d0)) - 1u)
                                          : 0;
        for (int k0 = 0; k0 < nk; k0 += 32) {
            __m512i a[16], b[16];
            for (int p = 0; p < 16; p++) {
                __m512i e = _mm512_maskz_loadu_epi16(m, vrow[k0 + 2 * p] + d0);
                __m512i o = _mm512_maskz_loadu_epi16(m, vrow[k0 + 2 * p + 1] + d0);
                a[p] = _mm512_permutex2var_epi16(e, lo, o);
                b[p] = _mm512_permutex2var_epi16(e, hi, o);
            }
            amx_transpose16_epi32(a);
            amx_transpose16_epi32(b);
            for (int d = 0; d < 16; d++) {
                _mm512_storeu_si512(vT + (size_t)(d0 + d) * CPU_ATTN_SPAN + k0, a[d]);
                _mm512_storeu_si512(vT + (size_t)(d0 + 16 + d) * CPU_ATTN_SPAN + k0, b[d]);
            }
        }
    }
}

AMXV_ATTR __mmask16 amx_lanes(int n)
{
    return n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

// emu_pack_q, 32 dims of the 16 rows at a time: each row's hi and lo pairs
// converted in registers, then two 16 x 16 dword transposes.
AMXV_ATTR void amx_pack_q(uint32_t *qt, const float *const *qrow, int hd, int hdp)
{
    for (int d0 = 0; d0 < hdp; d0 += 32) {
        const __mmask16 m0 = amx_lanes(hd - d0), m1 = amx_lanes(hd - d0 - 16);
        __m512i hi[16], lo[16];
        for (int i = 0; i < 16; i++) {
            if (qrow[i] == NULL) {
                hi[i] = lo[i] = _mm512_setzero_si512();
                continue;
            }
            __m512 x0 = _mm512_maskz_loadu_ps(m0, qrow[i] + d0);
            __m512 x1 = _mm512_maskz_loadu_ps(m1, qrow[i] + d0 + 16);
            amx_split_bf16(x0, x1, &hi[i], &lo[i]);
        }
        amx_transpose16_epi32(hi);
        amx_transpose16_epi32(lo);
        for (int pp = 0; pp < 16; pp++) {
            _mm512_storeu_si512(qt + (size_t)(d0 / 2 + pp) * 16, hi[pp]);
            _mm512_storeu_si512(qt + ((size_t)hdp / 2 + d0 / 2 + pp) * 16, lo[pp]);
        }
    }
}

// emu_finish, 16 dims of the 16 rows at a time (a dword transpose).
AMXV_ATTR void amx_finish(float *const *orow, const float *acc, const float *l, int hd)
{
    _Alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_loadu_ps(l)));
    for (int d0 = 0; d0 < hd; d0 += 16) {
        __m512i x[16];
        for (int i = 0; i < 16; i++)
            x[i] = _mm512_loadu_si512(acc + (size_t)(d0 + i) * 16);
        amx_transpose16_epi32(x);
        const __mmask16 m = amx_lanes(hd - d0);
        for (int i = 0; i < 16; i++)
            if (orow[i] != NULL)
                _mm512_mask_storeu_ps(
                    orow[i] + d0, m,
                    _mm512_mul_ps(_mm512_castsi512_ps(x[i]), _mm512_set1_ps(inv[i])));
    }
}

AMXV_ATTR void amx_accum(float *acc, const float *c, const float *corr, int nd)
{
    const __m512 vc = _mm512_loadu_ps(corr);
    for (int d = 0; d < nd; d++) {
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + (size_t)d * 16), vc);
        _mm512_storeu_ps(acc + (size_t)d * 16,
                         _mm512_add_ps(a, _mm512_loadu_ps(c + (size_t)d * 16)));
    }
}

#undef AMX_ATTR
#define AMX_ATTR __attribute__((target("amx-tile,amx-bf16," CPU_AVX512_TARGET)))
#define AMX_ATTN attn_amx
#define AMXV(name) amx_##name
#include "cpu_amx_attn_body.h"

static void amx_prep_x(const struct cpu_mm_args *a, int t0, int t1)
{
    cpu_kernels_avx512.mm_prep_x(a, t0, t1);
    if (a->w->type == TDM_W_BF16)
        zero_pad_tokens(a, t1);
}

static void amx_mm_blocks(const struct cpu_mm_args *a, int b0, int b1)
{
    if (a->w->type == TDM_W_BF16)
        gemm_amx(a, b0, b1);
    else
        cpu_kernels_avx512.mm_blocks(a, b0, b1);
}

void cpu_kernels_amx_fill(struct cpu_kernels *k, bool emulated)
{
    if (emulated) {
        *k = cpu_kernels_portable;
        k->name = "amx-emu";
        k->mm_prep_x = emu_prep_x;
        k->mm_blocks = emu_mm_blocks;
        k->attn_tile = attn_emu;
        return;
    }
    *k = cpu_kernels_avx512;
    k->name = "amx";
    k->mm_prep_x = amx_prep_x;
    k->mm_blocks = amx_mm_blocks;
    k->attn_tile = attn_amx;
}

#else

bool cpu_amx_available(void)
{
    return false;
}

void cpu_kernels_amx_fill(struct cpu_kernels *k, bool emulated)
{
    (void)emulated; // only the emulated path exists here
    *k = cpu_kernels_portable;
    k->name = "amx-emu";
    k->mm_prep_x = emu_prep_x;
    k->mm_blocks = emu_mm_blocks;
    k->attn_tile = attn_emu;
}

#endif
