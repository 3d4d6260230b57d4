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
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>

#include "cpu_amx_emu.h"
#include "cpu_impl.h"

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
        return;
    }
    *k = cpu_kernels_avx512;
    k->name = "amx";
    k->mm_prep_x = amx_prep_x;
    k->mm_blocks = amx_mm_blocks;
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
}

#endif
