// SPDX-License-Identifier: Apache-2.0
// cpu_amx_emu: a software model of the Intel AMX tile instructions the bf16
// GEMM uses (LDTILECFG, TILEZERO, TILELOADD, TILESTORED, TDPBF16PS,
// TILERELEASE) and of VCVTNE2PS2BF16's rounding, so the tile kernel
// (cpu_amx_body.h) runs and is tested on any host, as the CUDA kernels run on
// their execution-model emulator. It models the architectural state the
// kernel relies on: 8 tiles of up to 16 rows x 64 bytes, each with the rows
// and bytes per row of the loaded configuration; a load fills the configured
// rows and columns and zeroes the rest, as the hardware does.
//
// Arithmetic of TDPBF16PS (Intel SDM, the TDPBF16PS pseudocode, 2023 and
// later editions; CPU_AMX_ORDER_SDM): for each row m and column n of the
// destination, two f32 partial sums start at 0; for k pairs 0..K-1 in order
// the even products go into one and the odd products into the other, each
// step one FP32 FMA rounded to nearest even; then the two partials are added
// and that sum is added to C[m][n]. Inputs are read with DAZ (bf16 and f32
// denormals are +-0) and every result is flushed to zero when it is denormal
// (FTZ); MXCSR is neither read nor written. The older description (the 2020
// ISA extensions reference and the intrinsics guide; CPU_AMX_ORDER_SEQUENTIAL)
// adds the even and then the odd product of each pair straight into C[m][n]
// instead. Which one the silicon follows bit for bit is what the real-AMX
// test (cpu_amx_test) reports on a machine with AMX; the kernel's correctness
// does not depend on it (the two differ by f32 summation order only).
//
// FTZ is applied to the rounded result (a result that rounds up to FLT_MIN is
// kept). The state is plain memory: one struct per emulated "core", never
// shared between threads.
#ifndef TDM_CPU_AMX_EMU_H
#define TDM_CPU_AMX_EMU_H

#include <stddef.h>
#include <stdint.h>

#define CPU_AMX_TILES 8
#define CPU_AMX_ROWS 16
#define CPU_AMX_COLSB 64

// The 64-byte LDTILECFG operand (palette 1).
struct cpu_amx_cfg {
    uint8_t palette;      // 1: 8 tiles of up to 16 rows x 64 bytes
    uint8_t start_row;    // 0 (restart row after an interrupted load/store)
    uint8_t reserved[14]; // 0
    uint16_t colsb[16];   // bytes per row of tile i (i < 8), 0 for an unused tile
    uint8_t rows[16];     // rows of tile i (i < 8)
};

enum cpu_amx_order {
    CPU_AMX_ORDER_SDM = 0,    // even/odd partials per instruction, then C += (even + odd)
    CPU_AMX_ORDER_SEQUENTIAL, // C += even product, C += odd product, pair by pair
};

struct cpu_amx_emu {
    struct cpu_amx_cfg cfg;
    enum cpu_amx_order order;
    uint8_t tile[CPU_AMX_TILES][CPU_AMX_ROWS][CPU_AMX_COLSB];
};

// LDTILECFG: takes the configuration and zeroes every tile. Order is the
// TDPBF16PS arithmetic the state follows (CPU_AMX_ORDER_SDM in the kernel).
void cpu_amx_emu_loadconfig(struct cpu_amx_emu *e, const struct cpu_amx_cfg *cfg,
                            enum cpu_amx_order order);
// TILEZERO t.
void cpu_amx_emu_zero(struct cpu_amx_emu *e, int t);
// TILELOADD t, [base + row * stride]: rows[t] rows of colsb[t] bytes.
void cpu_amx_emu_load(struct cpu_amx_emu *e, int t, const void *base, size_t stride);
// TILESTORED [base + row * stride], t.
void cpu_amx_emu_store(const struct cpu_amx_emu *e, int t, void *base, size_t stride);
// TDPBF16PS c, a, b (see the top of this file). The shapes must be the ones
// the hardware accepts (a.rows = c.rows, a.colsb = 4 * b.rows, b.colsb =
// c.colsb); anything else is a bug of the kernel and panics, where the CPU
// would raise #UD.
void cpu_amx_emu_dpbf16ps(struct cpu_amx_emu *e, int c, int a, int b);

// One step of the arithmetic above, exposed for the emulator's unit test:
// fma(a, b, acc) with DAZ on the three inputs, one rounding to nearest even,
// FTZ on the result.
float cpu_amx_emu_fma(float a, float b, float acc);
// x + y with DAZ and FTZ.
float cpu_amx_emu_add(float x, float y);
// VCVTNE2PS2BF16 on one element: round to nearest even, a denormal input
// becomes a zero of its sign, a NaN stays a quiet NaN.
uint16_t cpu_amx_emu_f32_to_bf16(float f);
// cpu_exp512 (cpu_avx512_math.h) on one lane, bit for bit: the same clamps,
// products, fused steps and scaling, each rounded as the vector instruction
// rounds it (MXCSR's default: nearest even, no DAZ or FTZ).
float cpu_amx_emu_exp(float x);

#endif
