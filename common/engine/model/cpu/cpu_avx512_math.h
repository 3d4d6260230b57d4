// SPDX-License-Identifier: Apache-2.0
// cpu_avx512_math: AVX-512 helpers shared by the AVX-512 kernels
// (cpu_kernels_avx512.c) and the AMX kernels (cpu_kernels_amx.c), each
// compiled for CPU_AVX512_TARGET through a function attribute, so any caller
// whose target includes that list inlines it. cpu_amx_emu_exp is the scalar
// model of cpu_exp512, lane by lane, bit for bit.
#ifndef TDM_CPU_AVX512_MATH_H
#define TDM_CPU_AVX512_MATH_H

#if defined(__x86_64__)
#include <immintrin.h>

#define CPU_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma"

// exp(x) for x in [-87.3, 88] (clamped to it; a NaN becomes -87.33): 2^n *
// p(r), r = x - n ln2, degree-6 Taylor polynomial (|r| <= 0.35: error below 2
// ulp).
static inline __attribute__((always_inline, target(CPU_AVX512_TARGET))) __m512 cpu_exp512(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.33f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

#endif
