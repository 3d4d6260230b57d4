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

#include <stdbool.h>
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
int tdm_spec_propose(const struct tdm_spec_config *c, const int32_t *tokens, int n, int max_draft,
                     int32_t *draft);

// Adaptive off, per request: after every TDM_SPEC_WINDOW verifications, a
// request that accepted fewer than TDM_SPEC_MIN_ACCEPT_RATE of the draft
// tokens it proposed stops proposing for `backoff` decode steps
// (TDM_SPEC_BACKOFF_MIN, doubling up to TDM_SPEC_BACKOFF_MAX while acceptance
// stays low; back to the minimum after a good window). Each draft token makes
// the verification step dearer (on the CPU at batch 1 with the 0.5B shape,
// ~0.14 of a decode step per draft token: a 5-token step costs 1.56 decode
// steps, docs/speculative-decoding.md) and each accepted one saves a step, so
// below ~14% acceptance speculation loses; the threshold leaves a margin. A
// paused request pays only the proposer's scan.
#define TDM_SPEC_WINDOW 8
#define TDM_SPEC_MIN_ACCEPT_RATE 0.25
#define TDM_SPEC_BACKOFF_MIN 16
#define TDM_SPEC_BACKOFF_MAX 1024
struct tdm_spec_adapt {
    int pause;        // decode steps left without proposing
    int backoff;      // the next pause's length
    int win_drafts;   // verifications in the current window
    int win_proposed; // draft tokens proposed in it
    int win_accepted; // draft tokens accepted in it
};
void tdm_spec_adapt_init(struct tdm_spec_adapt *a);
// At a decode step: true when the request may propose now (a paused step is
// counted down instead).
bool tdm_spec_adapt_step(struct tdm_spec_adapt *a);
// After a verification of `proposed` draft tokens of which `accepted` were
// accepted. Returns true when it closed a bad window and started a pause.
bool tdm_spec_adapt_update(struct tdm_spec_adapt *a, int proposed, int accepted);

#endif
