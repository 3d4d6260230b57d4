// SPDX-License-Identifier: Apache-2.0
// runner: a small generation loop over the model, the paged KV cache and the
// sampler, shared by tandem-generate, the model tests and the engine bench. It
// is deliberately plain (not the serving scheduler, common/engine): every step
// takes each active request in order, gives a prefilling request the next chunk
// of its prompt (at most `chunk` tokens, within the step's token budget) and a
// decoding request its last sampled token, runs one tdm_model_forward and
// samples a token for every request whose prompt is complete. Requests may join
// at a later step (join_step) so that prefill and decode mix in one batch.
// A request whose params carry a structured-output constraint (params.constraint,
// docs/structured-outputs.md) samples under the grammar's token mask, compiled
// through the process-wide grammar cache as on a worker and applied as the
// engine applies it (tdm_grammar_mask_apply): the same tokens as the engine for
// a seeded request, ending on a sampled EOS once the grammar is complete.
// Ownership: the runner reads requests' prompts and writes their outputs into
// caller storage; it allocates its scratch (logits rows, batch arrays, token
// histories) once per tdm_gen_run call, never per step.
#ifndef TDM_RUNNER_H
#define TDM_RUNNER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_cache.h"
#include "model.h"
#include "sampling.h"

struct tdm_grammar_vocab;

struct tdm_gen_request {
    // In.
    const int32_t *prompt; // [n_prompt] token ids, n_prompt >= 1
    int n_prompt;
    int max_tokens;                    // tokens to generate (stops earlier on EOS/stop ids)
    struct tdm_sampling_params params; // temperature 0 = greedy
    int join_step;                     // first step in which the request takes part (0 = at once)
    bool use_prefix_cache;             // look up the prompt in the KV prefix cache first
    float *logits_out;                 // optional [max_tokens][vocab]: the raw logits each
                                       // generated token was sampled from
    // Out.
    int32_t *out_ids;      // [max_tokens] caller storage, generated tokens
    int n_out;             // tokens generated
    int num_cached_tokens; // prompt tokens that came from the prefix cache
    bool stopped;          // ended on an EOS/stop id (else on max_tokens)
    double first_token_s;  // seconds from the run's start to the first token
    double finish_s;       // seconds from the run's start to the last token
};

struct tdm_gen_opts {
    int chunk;              // max prompt tokens per request per step (default 256)
    int max_step_tokens;    // token budget of one step (default: model's max_batch_tokens)
    const int32_t *eos_ids; // the model's EOS ids (NULL: config.json's)
    int num_eos;
    // The tokenizer's trie (tdm_grammar_vocab_from_tokenizer), borrowed; needed
    // by constrained requests (params.constraint), NULL when there are none.
    const struct tdm_grammar_vocab *grammar_vocab;
};
void tdm_gen_opts_default(struct tdm_gen_opts *o);

// Phase timings of one run. A step that carries any prompt token counts as prefill.
struct tdm_gen_stats {
    int steps;
    int prefill_steps, decode_steps;
    long prefill_tokens; // prompt tokens computed (prefix hits excluded)
    long decode_tokens;  // tokens fed in decode rows
    long generated_tokens;
    double prefill_s, decode_s; // wall time of forward + sampling per phase
    long num_masks;             // structured-output masks computed
    double mask_s;              // time filling and applying them (inside the phases)
};

// Runs the requests to completion. Each request keeps its KV sequence until it
// finishes, then releases it (full blocks stay in the prefix cache when the
// cache was created with enable_prefix_caching). TDM_ECAPACITY when the cache
// cannot hold a request (all requests are released first); TDM_EINVAL for a bad
// request (err says which; a constraint the grammar engine refuses carries its
// message, as the HTTP 400 does). stats may be NULL.
int tdm_gen_run(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_gen_request *reqs,
                int n_reqs, const struct tdm_gen_opts *opts, struct tdm_gen_stats *stats, char *err,
                size_t errlen);

#endif
