// SPDX-License-Identifier: Apache-2.0
// spec: speculative decoding by n-gram prompt lookup (vLLM's "ngram" method):
// the configuration (vLLM's --speculative-config fields) and the proposer.
// The proposer looks for the most recent earlier occurrence of the request's
// last n tokens (n from prompt_lookup_max down to prompt_lookup_min) in its
// own prompt + output and proposes the tokens that followed it; the engine
// verifies them in one forward pass (docs/speculative-decoding.md). Pure
// functions over caller memory: no allocation, no state.
#ifndef TDM_SPEC_H
#define TDM_SPEC_H

#include <stddef.h>
#include <stdint.h>

#define TDM_SPEC_MAX_TOKENS 16 // num_speculative_tokens at most

struct tdm_spec_config {
    int num_speculative_tokens; // K: draft tokens per step at most; 0 = speculation off
    int prompt_lookup_max;      // longest n-gram matched (vLLM's prompt_lookup_max)
    int prompt_lookup_min;      // shortest n-gram matched (vLLM's prompt_lookup_min)
};

// Fills in vLLM's defaults for the lookup window (both unset (0): 5 and 5; one
// unset: the other's value) and checks the ranges: K in [1, 16], 1 <= min <=
// max <= 64. TDM_EINVAL with err naming the field. A config with K == 0 (off)
// is left as is and valid.
int tdm_spec_config_resolve(struct tdm_spec_config *c, char *err, size_t errlen);

// Proposes up to max_draft tokens continuing tokens[0..n) into draft[]: for n
// from c->prompt_lookup_max down to c->prompt_lookup_min, the most recent
// occurrence of the last n tokens that starts before them (overlap allowed);
// the max_draft tokens that followed it are the draft, copied forward as in
// LZ77: where the copy reaches tokens[n] it continues from the draft itself
// (a loop of period p < max_draft is proposed in full). Returns how many
// (max_draft, or 0 when nothing matched or max_draft <= 0). draft may be
// tokens + n (the engine writes drafts after the known tokens).
int tdm_spec_propose(const struct tdm_spec_config *c, const int32_t *tokens, int n,
                     int max_draft, int32_t *draft);

#endif
