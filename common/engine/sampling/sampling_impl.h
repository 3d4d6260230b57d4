// SPDX-License-Identifier: Apache-2.0
// sampling_impl.h: internals of the sampler that the tests check on their own.
#ifndef TDM_SAMPLING_IMPL_H
#define TDM_SAMPLING_IMPL_H

#include <stddef.h>
#include <stdint.h>

// Nucleus selection over integer weights (sample_draw.h): the smallest value v
// of q[0..n) (weights > 0) whose G(v), the total weight of the values > v, is
// < bound; a token is kept iff its weight is >= that floor. This is vLLM's rule
// (a token goes when the mass before it reaches p) with a tie at the boundary
// kept whole. Rearranges q; expected O(n) (three-way quickselect on the mass).
// UINT32_MAX when nothing is kept (bound <= 0).
uint32_t tdm_sampling_top_p_floor(uint32_t *q, size_t n, double bound);

// The k-th largest finite value of logits[0..n) (k >= 1, k <= n), using scratch[n]
// floats when k is large; -INFINITY when fewer than k values are > -inf.
float tdm_sampling_kth_largest(const float *logits, size_t n, size_t k, float *scratch);

// ---- full-row passes (sampling_simd.c) ----------------------------------------------
// Portable C and AVX2 give bitwise the same results (all of these are exact).

enum tdm_sampling_simd {
    TDM_SAMPLING_SIMD_PORTABLE = 0,
    TDM_SAMPLING_SIMD_AVX2,
};
// The path in use: AVX2 when the CPU has it, unless TANDEM_CPU_ISA=portable.
enum tdm_sampling_simd tdm_sampling_simd_get(void);
// Forces a path for the whole process (tests and benches); -1 when the CPU
// cannot run it, 0 on success.
int tdm_sampling_simd_set(enum tdm_sampling_simd s);

// The index of the first largest of x[0..n) by `>` (ties: the lowest index; NaN
// never wins; 0 when nothing is above -inf), and in *max_out (when not NULL)
// x[that index], or -inf when nothing is above -inf.
int32_t tdm_sampling_argmax(const float *x, size_t n, float *max_out);
// Writes to out[] the indices i (ascending) with x[i] >= thr (NaN never) and
// returns how many. out holds n.
size_t tdm_sampling_collect_ge(const float *x, size_t n, float thr, int32_t *out);
// The first index j in [i, n) with x[j] > floor_v (NaN never), or n.
size_t tdm_sampling_next_above(const float *x, size_t i, size_t n, float floor_v);
// The sum of exp(x[i] - m) over x[0..n) (the log-softmax's denominator), each
// term by sample_draw.h's tdm_draw_exp (~2 ulp; 0 below -87) widened to
// double, in 8 partial sums by i mod 8 added in a fixed tree: the same bits on
// both paths. NaN when some x[i] - m is NaN (a NaN logit, +inf with m +inf,
// m -inf), as a device's logprobs are.
double tdm_sampling_sum_exp(const float *x, size_t n, float m);

#endif
