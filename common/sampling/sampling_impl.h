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

#endif
