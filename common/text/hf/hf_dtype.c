// SPDX-License-Identifier: Apache-2.0
// hf_dtype: element types of safetensors tensors and the scalar conversions
// between bf16 / f16 and f32. Conversions work on bit patterns (memcpy, never
// pointer casts) so they are exact and free of aliasing UB: f32 -> bf16/f16
// rounds to nearest, ties to even; NaN stays NaN (quiet, sign kept, top payload
// bits kept); f16 subnormals, zeros and infinities convert exactly both ways.
#include "hf.h"

#include <string.h>

size_t tdm_dtype_size(enum tdm_dtype dt)
{
    switch (dt) {
    case TDM_DTYPE_F32:
        return 4;
    case TDM_DTYPE_F16:
    case TDM_DTYPE_BF16:
        return 2;
    }
    return 0;
}

const char *tdm_dtype_name(enum tdm_dtype dt)
{
    switch (dt) {
    case TDM_DTYPE_F32:
        return "F32";
    case TDM_DTYPE_F16:
        return "F16";
    case TDM_DTYPE_BF16:
        return "BF16";
    }
    return "?";
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

// ---- bf16: the top 16 bits of an f32 ----------------------------------------------

float tdm_bf16_to_f32(uint16_t h)
{
    return bits_f32((uint32_t)h << 16);
}

uint16_t tdm_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: truncating could clear every mantissa bit left (-> inf), so force
        // the quiet bit; sign and the top payload bits survive.
        return (uint16_t)((u >> 16) | 0x0040u);
    }
    // Round to nearest even: add 0x7fff plus the lowest kept bit. A carry out of
    // the mantissa correctly bumps the exponent (and max finite rounds to inf).
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

// ---- f16: 1 sign, 5 exponent (bias 15), 10 mantissa bits ---------------------------

float tdm_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    if (exp == 0x1f) // inf or NaN: payload moves to the top of the f32 mantissa
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        if (man == 0)
            return bits_f32(sign);
        // Subnormal: value = man * 2^-24; normalise so the leading 1 is implicit.
        int e = -1;
        do {
            e++;
            man <<= 1;
        } while ((man & 0x400u) == 0);
        man &= 0x3ffu;
        // man had e + 1 shifts, so the value is 1.frac * 2^(-15 - e); bias 127.
        return bits_f32(sign | ((uint32_t)(127 - 15 - e) << 23) | (man << 13));
    }
    return bits_f32(sign | ((exp + 127 - 15) << 23) | (man << 13));
}

uint16_t tdm_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t exp = (u >> 23) & 0xffu;
    uint32_t man = u & 0x7fffffu;

    if (exp == 0xff) {
        if (man == 0)
            return sign | 0x7c00u; // inf
        // NaN: keep the top payload bits and force the quiet bit so it stays NaN.
        return (uint16_t)(sign | 0x7c00u | 0x200u | (man >> 13));
    }
    int e = (int)exp - 127 + 15; // biased f16 exponent
    if (e >= 0x1f)
        return sign | 0x7c00u; // too large: inf
    if (e <= 0) {
        // Result is subnormal (or zero): value = m * 2^-24 with m = round(x * 2^24).
        if (e < -10)
            return sign;                 // below half the smallest subnormal: rounds to zero
        uint32_t full = man | 0x800000u; // implicit 1, value = full * 2^(exp-150)
        int shift = 14 - e;              // m = full * 2^(exp - 126): bits to drop
        uint32_t kept = full >> shift;
        uint32_t rem = full & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (kept & 1u)))
            kept++; // may carry into the smallest normal, which is still right
        return (uint16_t)(sign | kept);
    }
    uint32_t kept = ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (kept & 1u)))
        kept++; // a carry may move into the exponent, up to inf: correct rounding
    return (uint16_t)(sign | kept);
}
