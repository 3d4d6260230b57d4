// SPDX-License-Identifier: Apache-2.0
// sampling_impl.h: internals of the sampler that the tests check on their own.
#ifndef TDM_SAMPLING_IMPL_H
#define TDM_SAMPLING_IMPL_H

#include <stddef.h>
#include <stdint.h>

// Nucleus selection. Rearranges ids[0..n) and w[0..n) (unnormalised weights, >= 0)
// so that the first m entries are the smallest set, in the order (weight
// descending, id ascending), whose total weight reaches target; returns m (n when
// the whole set is needed). An entry is kept iff the weight strictly before it in
// that order is < target, which is vLLM's rule (cumsum of ascending probs <= 1-p
// is dropped). Expected O(n): quickselect on the mass, a sort only of the last
// small range.
size_t tdm_sampling_select_top_p(int32_t *ids, float *w, size_t n, double target);

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

#endif
