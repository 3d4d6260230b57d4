// SPDX-License-Identifier: Apache-2.0
// sampling: turns one row of logits into the next token for one request, the way
// vLLM does: logit bias, repetition/presence/frequency penalties, min_tokens
// (EOS and stop ids masked), temperature, then top-k, top-p and min-p filters,
// then a draw from the request's own RNG. Greedy when temperature == 0.
// A sampler holds all its scratch memory from creation, so sampling allocates
// nothing per token, and its draws depend only on its seed and its own history.
#ifndef TDM_SAMPLING_H
#define TDM_SAMPLING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h" // enum tdm_constraint_kind

#define TDM_MAX_STOP_IDS 32
#define TDM_MAX_LOGIT_BIAS 300
#define TDM_MAX_LOGPROBS 20
// vLLM's logprob_token_ids: at most this many ids a request (MAX_LOGPROB_TOKEN_IDS).
#define TDM_MAX_LOGPROB_TOKEN_IDS 128
// Entries a token's top list may hold: the top-N, or with logprob_token_ids the
// chosen token and the listed ids.
#define TDM_MAX_TOP_ENTRIES (1 + TDM_MAX_LOGPROB_TOKEN_IDS)
// bad_words after tokenization: vLLM's VLLM_MAX_NUM_BAD_WORDS token sequences
// a request, VLLM_MAX_BAD_WORDS_TOTAL_TOKENS tokens in all.
#define TDM_MAX_BAD_WORDS 128
#define TDM_MAX_BAD_WORD_TOKENS 1024
// Tokens tdm_sampler_draw_prepare_ahead looks ahead at most (a speculative
// step's drafts: spec.h's TDM_SPEC_MAX_TOKENS).
#define TDM_SAMPLER_MAX_AHEAD 16

struct tdm_logit_bias {
    int32_t token;
    float bias;        // added to the raw logit; OpenAI range [-100, 100]
};

struct tdm_sampling_params {
    float temperature;          // 0 = greedy; default 1
    float top_p;                // (0, 1]; default 1
    int top_k;                  // 0 or -1 = off
    float min_p;                // [0, 1]; default 0
    float repetition_penalty;   // > 0; 1 = off (HF/vLLM: divides positive logits, multiplies negative)
    float presence_penalty;     // [-2, 2]
    float frequency_penalty;    // [-2, 2]
    bool has_seed;
    uint64_t seed;
    int min_tokens;             // EOS/stop ids masked until this many tokens were generated
    bool ignore_eos;
    int32_t stop_token_ids[TDM_MAX_STOP_IDS];
    int num_stop_token_ids;
    struct tdm_logit_bias logit_bias[TDM_MAX_LOGIT_BIAS];
    int num_logit_bias;
    int logprobs;               // -1: none; 0..TDM_MAX_LOGPROBS: the chosen token's logprob + top-N
    // Structured output (docs/structured-outputs.md): the constraint's kind
    // (TDM_CONSTRAINT_NONE = unconstrained) and text, BORROWED: whoever fills
    // these keeps the text alive while the params (and copies of them) are in
    // use. The sampler ignores them; the engine compiles them at submit
    // (tdm_grammar_compile_cached) and masks every step's logits.
    enum tdm_constraint_kind constraint;
    const char *constraint_text;
    size_t constraint_len;
    // vLLM's allowed_token_ids: when num_allowed_token_ids > 0, only these
    // tokens may be drawn (every other logit is -inf before the draw; the
    // logprobs stay those of the raw logits). Duplicates are fine. BORROWED
    // as constraint_text is; the sampler keeps its own copy.
    const int32_t *allowed_token_ids;
    int num_allowed_token_ids;
    // vLLM's bad_words as token sequences (the HTTP front tokenizes each word
    // with and without a leading space, tdm_oai_bad_words_build): word i is
    // the bad_word_lens[i] ids that follow words 0 .. i-1 in bad_word_ids. A
    // word's last token is -inf wherever the output so far (not the prompt)
    // ends with its other tokens: a one-token word is never drawn. BORROWED.
    const int32_t *bad_word_ids;
    const int32_t *bad_word_lens;
    int num_bad_words;
    // vLLM's logprob_token_ids: when num_logprob_token_ids > 0 (logprobs >= 0
    // then), a token's top list is the chosen token and then these ids, each
    // once, in this order (tdm_sampling_top_entries of them), with their raw
    // logprobs, instead of the top-N. Its rows are sampled on the host.
    // BORROWED; the sampler keeps its own copy.
    const int32_t *logprob_token_ids;
    int num_logprob_token_ids;
};

// Entries of each token's top list under p: 1 + the distinct logprob_token_ids
// when there are any (the chosen token is listed once more when it is one of
// them: one length for every token), else max(logprobs, 0).
int tdm_sampling_top_entries(const struct tdm_sampling_params *p);

// vLLM's fallbacks (temperature 1, top_p 1, top_k off, min_p 0, penalties off, logprobs -1).
void tdm_sampling_params_default(struct tdm_sampling_params *p);
// Range checks with an OpenAI-style message naming the field in err
// ("temperature must be in [0, 2], got 3"). vocab_size bounds token ids.
int tdm_sampling_params_validate(const struct tdm_sampling_params *p, int vocab_size, char *err,
                                 size_t errlen);

struct tdm_token_logprob {
    int32_t token;
    float logprob;             // log-softmax of the raw logits (before temperature/filters, as vLLM)
};

struct tdm_sample_result {
    int32_t token;
    float logprob;             // of the chosen token
    int num_top;               // tdm_sampling_top_entries(params)
    struct tdm_token_logprob top[TDM_MAX_TOP_ENTRIES];
};

// Prompt logprobs (vLLM's prompt_logprobs; completions echo with logprobs):
// entry i is prompt token i given the tokens before it, from the raw logits
// (log-softmax, as tdm_token_logprob); entry 0 has none (vLLM's None) and
// holds zeros.
struct tdm_prompt_logprobs {
    int n;                               // prompt tokens
    int num_top;                         // top-N entries per position (0..TDM_MAX_LOGPROBS)
    const float *logprob;                // [n] the prompt token's logprob
    const int32_t *rank;                 // [n] its rank: 1 + the tokens more likely
    const struct tdm_token_logprob *top; // [n][num_top], by logprob, ties to the lower id
};

// The log-softmax of one raw logits row of vocab floats: token's logprob
// into res (token, logprob), the top k (0..TDM_MAX_LOGPROBS; by value, ties
// to the lower id, NaN skipped) into res->top / num_top, and when rank is not
// NULL token's rank (1 + the count of larger values). What a sampled token's
// logprobs are (tdm_sampler_sample), for any row.
void tdm_logprobs_of_row(const float *raw, int vocab, int32_t token, int k,
                         struct tdm_sample_result *res, int32_t *rank);

struct tdm_sampler;

// The process's seed for requests without one (vLLM's --seed): from this call
// on, each unseeded sampler created takes the next seed of a splitmix64 stream
// started at seed, so a server given the same requests in the same order
// samples the same outputs run after run. Without it (the default) each takes
// a seed from the kernel's entropy pool. A request's own "seed" always wins.
void tdm_sampling_set_process_seed(uint64_t seed);

// prompt: the prompt ids (the repetition penalty counts them, as vLLM does).
// eos_ids: the model's EOS ids (masked before min_tokens unless ignore_eos... see .c).
int tdm_sampler_new(struct tdm_sampler **out, const struct tdm_sampling_params *p, int vocab_size,
                    const int32_t *prompt, size_t n_prompt, const int32_t *eos_ids, int num_eos);
void tdm_sampler_free(struct tdm_sampler *s);

// Samples from logits[vocab_size] (modified in place), records the token in the
// sampler's history and returns it; fills *res when res != NULL.
int32_t tdm_sampler_sample(struct tdm_sampler *s, float *logits, struct tdm_sample_result *res);

// Speculative decoding's verification of a deterministic draft
// (docs/speculative-decoding.md). rows holds n_draft + 1 logits rows of
// vocab_size floats (modified in place): row j is the target model's
// distribution for the position of draft[j] (row n_draft: the one after the
// last draft). Samples row 0, 1, ... in order exactly as tdm_sampler_sample
// does (every filter and penalty, the history advancing),
// and stops after the first token that differs from its draft, is a stop
// token (tdm_sampler_is_stop), or comes from the last row. For a point-mass
// draft q = 1{draft} this is the rejection rule of speculative sampling:
// draft accepted with probability min(1, p/q) = p(draft), and a rejection's
// token is distributed as p without the draft, renormalized, i.e.
// norm(max(0, p - q)); and the tokens are exactly those of sampling the rows
// one step at a time (each row's draw is keyed by its position), so a seeded
// request's output does not depend on speculation. Writes the tokens to out[]
// (and res[] when not NULL) and returns how many: 1 .. n_draft + 1.
int tdm_sampler_verify(struct tdm_sampler *s, float *rows, const int32_t *draft, int n_draft,
                       int32_t *out, struct tdm_sample_result *res);

// True when token ends the request: an EOS id (unless ignore_eos) or a stop id,
// once min_tokens were generated.
bool tdm_sampler_is_stop(const struct tdm_sampler *s, int32_t token);
int tdm_sampler_num_generated(const struct tdm_sampler *s);
// The request's min_tokens (EOS and stop ids masked below it).
int tdm_sampler_min_tokens(const struct tdm_sampler *s);
// True when an EOS id drawn next would end the request: not ignore_eos, and
// min_tokens reached by then (the draw is not masked).
bool tdm_sampler_eos_ends(const struct tdm_sampler *s);

// True when the next token is the plain argmax of the raw logits: greedy, with
// no logit bias, no repetition/presence/frequency penalty, no EOS or stop id
// masked for min_tokens any more, no allowed_token_ids or bad_words, and no
// logprobs asked. The caller may then
// take the argmax elsewhere (the model's fused LM head: the logits row is never
// written) and record it with tdm_sampler_replay, which leaves the sampler
// exactly as tdm_sampler_sample would have.
bool tdm_sampler_plain_greedy(const struct tdm_sampler *s);

// True when the next token is sample_draw.h's draw over the raw logits alone
// (the same conditions as tdm_sampler_plain_greedy, sampled requests too), and
// then *d holds what that draw needs (inv_t 0 for greedy; the key of the next
// output position). A device may then draw the token from its logits row
// (the CUDA backend's sample_rows) and the caller records it with
// tdm_sampler_replay: the same token the sampler would have drawn from the
// same row, and the sampler left as tdm_sampler_sample would have left it.
struct tdm_draw_params;
bool tdm_sampler_draw_params(const struct tdm_sampler *s, struct tdm_draw_params *d);

// The same for any request (-1 for a logit bias naming a token twice, and for
// allowed_token_ids, whose mask is not a few entries: the host samples it):
// *d, and in adj[0..cap) the adjustments of its logits that
// tdm_sampler_sample would make before the draw (logit bias, penalties over
// the history, the min_tokens mask, the bad words' last tokens the output
// now leads to; one entry a token, each token once, in no required order); returns how many there
// are (d->n_adj). When that is more than cap, adj holds only the first cap: call again with room
// for all. A request asking logprobs asks them of the device too (d->logprobs).
struct tdm_draw_adj;
int tdm_sampler_draw_prepare(const struct tdm_sampler *s, struct tdm_draw_params *d,
                             struct tdm_draw_adj *adj, int cap);
// tdm_sampler_draw_prepare for the draw n_ahead tokens later, as if
// ahead[0..n_ahead) had been recorded first (tdm_sampler_replay), s itself
// unchanged: a speculative step's row after its drafts (row j: the first j
// drafts ahead). The same entries, in the same order, as preparing after the
// replay would give.
int tdm_sampler_draw_prepare_ahead(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                   struct tdm_draw_adj *adj, int cap, const int32_t *ahead,
                                   int n_ahead);
// The draw one token later, that token not known yet (async scheduling: a
// device holds it, chosen row prev_row of the forward before): the key and
// min_tokens as tdm_sampler_draw_prepare_ahead with one token ahead, the
// history as recorded, and, when the sampler has a repetition, presence or
// frequency penalty, one last entry TDM_DRAW_ADJ_PENDING (sample_draw.h)
// naming prev_row and what one more occurrence of its token adds. Resolved
// with that token (tdm_draw_resolve_pending), the entries are those of
// tdm_sampler_draw_prepare after the token's tdm_sampler_replay, in another
// order. -1 where tdm_sampler_draw_prepare gives -1, where a bad word of two
// tokens or more may follow that token (which tokens it bans is not known
// yet), or prev_row < 0.
int tdm_sampler_draw_prepare_pending(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                     struct tdm_draw_adj *adj, int cap, int prev_row);
// allowed_token_ids as a bitmap over the vocabulary (bit t of word t / 64),
// NULL without them. A caller whose device draws apply it as each row's
// allow bitmap says so with tdm_sampler_set_device_allow(s, true): the draw
// functions then prepare such rows (those not asking logprobs) instead of
// refusing them. A draw that cannot take an allow bitmap (a speculative
// verification's) must not be prepared for a sampler with allow bits.
const uint64_t *tdm_sampler_allow_bits(const struct tdm_sampler *s);
void tdm_sampler_set_device_allow(struct tdm_sampler *s, bool on);
// Whether tdm_sampler_draw_prepare_pending can prepare this sampler's next
// draw before the token before it is known: its rows are drawable on a device
// and no bad word of two tokens or more may ban after that token. The engine
// asks it before issuing a step ahead (instead of building the step and
// finding the draw refused).
bool tdm_sampler_draw_ahead_ok(const struct tdm_sampler *s);
// The parameters of the draw n_pending (0 or 1) tokens after the history,
// as tdm_sampler_draw_prepare(_pending) gives them, without its entries
// (n_adj 0): a row whose entries a device keeps from the step before
// (tdm_draw_params.list), in O(1) instead of O(the entries). 0, or -1 where
// tdm_sampler_draw_prepare gives -1 and where the entries change otherwise
// than by the drawn token's record (a bad word of two tokens or more: its
// ban follows the last tokens): prepare the row whole then.
int tdm_sampler_draw_list_params(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                 int n_pending);
// *res for a token a device drew with the logprobs it computed (lp): what
// tdm_sampler_sample's res holds for the same row, the logprobs within the
// rounding of a sum of exponentials in another order.
struct tdm_draw_logprobs;
void tdm_sampler_draw_logprobs(const struct tdm_draw_logprobs *lp, int32_t token,
                               struct tdm_sample_result *res);

// Records tokens as if this sampler had sampled them (a stream resumed on
// another worker, issue 11 part 6; a token a device drew): each joins the
// history (penalties, min_tokens) and advances the output position, which
// keys the next draw (sample_draw.h), so the next token is the one an
// uninterrupted run would draw.
void tdm_sampler_replay(struct tdm_sampler *s, const int32_t *tokens, size_t n);

#endif
