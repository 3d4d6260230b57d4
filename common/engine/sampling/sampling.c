// SPDX-License-Identifier: Apache-2.0
// sampling: one request's next-token choice, in vLLM's (v1 sampler) order:
//
//   raw logits --> logprobs (log-softmax of the RAW logits, vLLM's default
//                  logprobs_mode "raw_logprobs"), computed from a copy
//   logit_bias    logits[t] += bias (clamped to [-100, 100] as vLLM's API does)
//   penalties     repetition over prompt+output tokens: l > 0 ? l / r : l * r;
//                 then l -= frequency * count + presence * (count > 0) over the
//                 OUTPUT tokens only
//   min_tokens    EOS ids and stop ids -> -inf while fewer than min_tokens tokens
//                 were generated (vLLM masks EOS here even with ignore_eos)
//   allowed_token_ids  every other token -> -inf
//   bad_words     a word's last token -> -inf where the output ends with the
//                 word's other tokens (the -inf masks commute with the rest)
//   temperature 0 -> greedy argmax (ties: lowest id); otherwise l / T, with T
//                 raised to 0.01 when smaller (vLLM's _MAX_TEMP guard)
//   min_p         keep p >= min_p * p_max
//   top_k         keep logits >= the k-th largest (ties at the boundary stay)
//   top_p         keep the smallest set, by probability, with mass >= p of the
//                 distribution left by min_p and top_k (renormalised)
//   draw          sample_draw.h's: integer weights, a key from (seed, output
//                 position), the same bits as the CUDA backend's device sampler
//
// On return the caller's logits hold the processed values before temperature.
// Everything vocab-sized is allocated in tdm_sampler_new; sampling allocates
// nothing. Top-k uses a k-sized insertion buffer in one pass (or quickselect for a
// large k) instead of sorting the vocabulary; top-p is a quickselect on integer
// mass. A sampled token depends only on the row, the filters, the seed and its
// position in the output (tdm_draw_key): no generator state. The passes over
// the whole row (argmax, maximum, candidate and top-k scans) are
// sampling_simd.c's, exact in AVX2 and in C alike; the weights are
// sample_draw.h's, the same bits on any IEEE machine. A
// sampler is used by one thread at a time; different samplers may run on
// different threads at once (the engine samples a step's rows in parallel).
#include "sampling.h"

#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "core.h"
#include "sample_draw.h"
#include "sampling_impl.h"

#define TDM_SAMPLING_MIN_TEMP 0.01f // vLLM's _MAX_TEMP: smaller temperatures overflow
#define TDM_LOGIT_BIAS_LIMIT 100.0f // OpenAI's range; vLLM clamps to it
#define TOPK_BUFFER_MAX 256         // up to this k, one pass with an insertion buffer

struct tdm_sampler {
    struct tdm_sampling_params p; // a copy; top_k 0 means off, temperature as used
    int vocab_size;
    bool greedy;
    bool bias_unique;  // no token twice in logit_bias (a device applies each once)
    uint64_t seed;     // the request's, or one the process chose (tdm_draw_key)
    float inv_t;       // 1 / temperature (sampled requests)
    int num_generated; // tokens recorded by tdm_sampler_sample
    int32_t *eos_ids;  // [num_eos]
    int num_eos;
    int32_t *masked_ids; // [num_masked] EOS and stop ids, masked before min_tokens
    int num_masked;
    uint64_t *seen;      // [words] bitmap of prompt+output tokens; NULL: no repetition penalty
    uint64_t *out_seen;  // [words] bitmap of output tokens; NULL: no presence/frequency
    uint32_t *out_count; // [vocab_size] occurrences in the output; with out_seen
    size_t words;        // ceil(vocab_size / 64)
    // The distinct tokens of seen and out_seen, ascending: a device draw's
    // adjustments (tdm_sampler_draw_prepare) walk them instead of both
    // bitmaps (V / 64 words each: ~5 us a row a step at Qwen2.5's vocabulary,
    // whatever the history). toks_lost: growing it ran out of memory once,
    // and the host samples this request's rows from then on.
    int32_t *toks;
    int n_toks, cap_toks;
    bool toks_lost;
    uint64_t *allow; // [words] allowed_token_ids' bitmap; NULL: every token
    bool device_allow; // the caller's device draws apply allow as the row's allow bitmap
    int32_t *lp_ids; // [n_lp_ids] logprob_token_ids, each once, in request order; NULL: none
    int n_lp_ids;
    // bad_words (copies): word i is bad_lens[i] ids of bad_ids after words
    // 0 .. i-1. The last bad_pre output tokens (the longest word's prefix)
    // in a ring, token number k (from 0) at bad_hist[k % bad_pre]; hist_n
    // counts the tokens recorded.
    int32_t *bad_ids;
    int32_t *bad_lens;
    int n_bad;
    int bad_pre;
    int32_t *bad_hist;
    uint64_t hist_n;
    float *raw;          // [vocab_size] raw logits copy; NULL unless logprobs >= 0
    int32_t *cand;       // [vocab_size] candidate ids; NULL when greedy
    float *weight;       // [vocab_size] top_k's scratch
    uint32_t *qw;        // [vocab_size] the candidates' weights (sample_draw.h)
    uint32_t *qsel;      // [vocab_size] top_p's scratch copy of qw
};

// ---- parameters ------------------------------------------------------------------

void tdm_sampling_params_default(struct tdm_sampling_params *p)
{
    memset(p, 0, sizeof *p);
    p->temperature = 1.0f;
    p->top_p = 1.0f;
    p->top_k = 0;
    p->min_p = 0.0f;
    p->repetition_penalty = 1.0f;
    p->logprobs = -1;
}

int tdm_sampling_params_validate(const struct tdm_sampling_params *p, int vocab_size, char *err,
                                 size_t errlen)
{
    // Comparisons are written so that NaN fails them.
    if (vocab_size <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "vocab_size must be positive, got %d",
                          vocab_size);
    if (!(p->temperature >= 0.0f && p->temperature <= 2.0f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "temperature must be in [0, 2], got %g",
                          (double)p->temperature);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "top_p must be in (0, 1], got %g",
                          (double)p->top_p);
    if (p->top_k < -1)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "top_k must be 0 or -1 (disabled), or at least 1, got %d", p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "min_p must be in [0, 1], got %g",
                          (double)p->min_p);
    if (!(p->repetition_penalty > 0.0f && isfinite(p->repetition_penalty)))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "repetition_penalty must be a finite number greater than zero, got %g",
                          (double)p->repetition_penalty);
    if (!(p->presence_penalty >= -2.0f && p->presence_penalty <= 2.0f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "presence_penalty must be in [-2, 2], got %g",
                          (double)p->presence_penalty);
    if (!(p->frequency_penalty >= -2.0f && p->frequency_penalty <= 2.0f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "frequency_penalty must be in [-2, 2], got %g",
                          (double)p->frequency_penalty);
    if (p->min_tokens < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "min_tokens must be greater than or equal to 0, got %d", p->min_tokens);
    if (p->logprobs < -1 || p->logprobs > TDM_MAX_LOGPROBS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "logprobs must be in [0, %d] (or -1 for none), got %d", TDM_MAX_LOGPROBS,
                          p->logprobs);
    if (p->num_stop_token_ids < 0 || p->num_stop_token_ids > TDM_MAX_STOP_IDS)
        return tdm_seterr(err, errlen, TDM_EINVAL, "stop_token_ids may hold at most %d ids, got %d",
                          TDM_MAX_STOP_IDS, p->num_stop_token_ids);
    for (int i = 0; i < p->num_stop_token_ids; i++)
        if (p->stop_token_ids[i] < 0 || p->stop_token_ids[i] >= vocab_size)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "stop_token_ids[%d] = %d is outside the vocabulary [0, %d)", i,
                              (int)p->stop_token_ids[i], vocab_size);
    if (p->num_logit_bias < 0 || p->num_logit_bias > TDM_MAX_LOGIT_BIAS)
        return tdm_seterr(err, errlen, TDM_EINVAL, "logit_bias may hold at most %d entries, got %d",
                          TDM_MAX_LOGIT_BIAS, p->num_logit_bias);
    for (int i = 0; i < p->num_logit_bias; i++) {
        const struct tdm_logit_bias *b = &p->logit_bias[i];
        if (b->token < 0 || b->token >= vocab_size)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "logit_bias token %d is outside the vocabulary [0, %d)",
                              (int)b->token, vocab_size);
        if (!isfinite(b->bias))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "logit_bias for token %d must be a finite number", (int)b->token);
    }
    if (p->num_allowed_token_ids < 0 || (p->num_allowed_token_ids > 0 && !p->allowed_token_ids))
        return tdm_seterr(err, errlen, TDM_EINVAL, "allowed_token_ids: %d ids without their array",
                          p->num_allowed_token_ids);
    for (int i = 0; i < p->num_allowed_token_ids; i++)
        if (p->allowed_token_ids[i] < 0 || p->allowed_token_ids[i] >= vocab_size)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "allowed_token_ids contains out-of-vocab token id %d (vocabulary "
                              "[0, %d))",
                              (int)p->allowed_token_ids[i], vocab_size);
    if (p->num_logprob_token_ids < 0 || p->num_logprob_token_ids > TDM_MAX_LOGPROB_TOKEN_IDS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "Requested logprob_token_ids of length %d, which is greater than max "
                          "allowed: %d",
                          p->num_logprob_token_ids, TDM_MAX_LOGPROB_TOKEN_IDS);
    if (p->num_logprob_token_ids > 0 && (!p->logprob_token_ids || p->logprobs < 0))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "logprob_token_ids: %d ids without their array or with logprobs off",
                          p->num_logprob_token_ids);
    for (int i = 0; i < p->num_logprob_token_ids; i++)
        if (p->logprob_token_ids[i] < 0 || p->logprob_token_ids[i] >= vocab_size)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "token_id(s) [%d] in logprob_token_ids contain out-of-vocab token "
                              "ids. Vocabulary size: %d",
                              (int)p->logprob_token_ids[i], vocab_size);
    if (p->num_bad_words < 0 || p->num_bad_words > TDM_MAX_BAD_WORDS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "Too many bad words after tokenization: %d. The max number is %d.",
                          p->num_bad_words, TDM_MAX_BAD_WORDS);
    if (p->num_bad_words > 0 && (!p->bad_word_ids || !p->bad_word_lens))
        return tdm_seterr(err, errlen, TDM_EINVAL, "bad_words: %d words without their arrays",
                          p->num_bad_words);
    for (int i = 0, total = 0; i < p->num_bad_words; i++) {
        int len = p->bad_word_lens[i];
        if (len < 1)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "bad_words entries must tokenize to at least one token.");
        if (len > TDM_MAX_BAD_WORD_TOKENS - total)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "bad_words: more than %d tokens after tokenization",
                              TDM_MAX_BAD_WORD_TOKENS);
        for (int j = total; j < total + len; j++)
            if (p->bad_word_ids[j] < 0 || p->bad_word_ids[j] >= vocab_size)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "The model vocabulary size is %d, but the following tokens were "
                                  "specified as bad: [%d]. All token id values should be integers "
                                  "satisfying: 0 <= token_id <= %d.",
                                  vocab_size, (int)p->bad_word_ids[j], vocab_size - 1);
        total += len;
    }
    if ((unsigned)p->constraint >= TDM_CONSTRAINT_COUNT)
        return tdm_seterr(err, errlen, TDM_EINVAL, "unknown constraint kind %d",
                          (int)p->constraint);
    if (p->constraint != TDM_CONSTRAINT_NONE && p->constraint != TDM_CONSTRAINT_JSON_OBJECT &&
        !p->constraint_text)
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s constraint without its text",
                          tdm_constraint_kind_name(p->constraint));
    return TDM_OK;
}

// ---- seeds (the draw itself: sample_draw.h) ----------------------------------------------

// An unseeded request draws its seed from the kernel's entropy pool (getrandom),
// shared by the whole process; if that fails, from the clock and a counter.
static _Atomic bool process_seeded;
static _Atomic uint64_t process_stream;

void tdm_sampling_set_process_seed(uint64_t seed)
{
    atomic_store(&process_stream, seed);
    atomic_store(&process_seeded, true);
}

static uint64_t entropy_seed(void)
{
    uint64_t seed;
    if (atomic_load(&process_seeded)) {
        // splitmix64: the stream advances by its constant, each draw is mixed.
        uint64_t x = atomic_fetch_add(&process_stream, 0x9E3779B97F4A7C15ull);
        return tdm_splitmix64(&x);
    }
    if (getrandom(&seed, sizeof seed, 0) == (ssize_t)sizeof seed)
        return seed;
    static _Atomic uint64_t counter;
    uint64_t x = (uint64_t)(tdm_wall_now() * 1e9) ^ (uint64_t)(uintptr_t)&seed;
    x ^= tdm_splitmix64(&x) + counter++;
    return x;
}

// ---- construction ----------------------------------------------------------------------

static bool in_bitmaps(const struct tdm_sampler *s, int32_t t)
{
    uint64_t bit = 1ull << (t & 63);
    return (s->seen && (s->seen[t >> 6] & bit)) || (s->out_seen && (s->out_seen[t >> 6] & bit));
}

// Adds t (not yet among them) to the sampler's distinct tokens, in order.
static void toks_insert(struct tdm_sampler *s, int32_t t)
{
    if (s->toks_lost)
        return;
    if (s->n_toks == s->cap_toks) {
        int cap = s->cap_toks ? 2 * s->cap_toks : 256;
        int32_t *grown = realloc(s->toks, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            s->toks_lost = true;
            return;
        }
        s->toks = grown;
        s->cap_toks = cap;
    }
    int lo = 0, hi = s->n_toks;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (s->toks[mid] < t)
            lo = mid + 1;
        else
            hi = mid;
    }
    memmove(s->toks + lo + 1, s->toks + lo, (size_t)(s->n_toks - lo) * sizeof *s->toks);
    s->toks[lo] = t;
    s->n_toks++;
}

// ids[0..n) without repeats, first occurrences in order, into out; returns
// their count (n <= TDM_MAX_LOGPROB_TOKEN_IDS: a quadratic scan is fine).
static int distinct_ids(const int32_t *ids, int n, int32_t *out)
{
    int m = 0;
    for (int i = 0; i < n; i++) {
        int j = 0;
        while (j < m && out[j] != ids[i])
            j++;
        if (j == m)
            out[m++] = ids[i];
    }
    return m;
}

int tdm_sampling_top_entries(const struct tdm_sampling_params *p)
{
    if (p->num_logprob_token_ids > 0 && p->logprob_token_ids) {
        int32_t tmp[TDM_MAX_LOGPROB_TOKEN_IDS];
        int n = p->num_logprob_token_ids < TDM_MAX_LOGPROB_TOKEN_IDS ? p->num_logprob_token_ids
                                                                     : TDM_MAX_LOGPROB_TOKEN_IDS;
        return 1 + distinct_ids(p->logprob_token_ids, n, tmp);
    }
    return p->logprobs > 0 ? p->logprobs : 0;
}

int tdm_sampler_new(struct tdm_sampler **out, const struct tdm_sampling_params *p, int vocab_size,
                    const int32_t *prompt, size_t n_prompt, const int32_t *eos_ids, int num_eos)
{
    *out = NULL;
    if (tdm_sampling_params_validate(p, vocab_size, NULL, 0) != TDM_OK || num_eos < 0 ||
        (num_eos > 0 && !eos_ids) || (n_prompt > 0 && !prompt))
        return TDM_EINVAL;
    for (int i = 0; i < num_eos; i++)
        if (eos_ids[i] < 0 || eos_ids[i] >= vocab_size)
            return TDM_EINVAL;
    for (size_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= vocab_size)
            return TDM_EINVAL;

    struct tdm_sampler *s = calloc(1, sizeof *s);
    if (!s)
        return TDM_ENOMEM;
    s->p = *p;
    s->vocab_size = vocab_size;
    s->words = ((size_t)vocab_size + 63) / 64;
    s->greedy = p->temperature == 0.0f;
    if (!s->greedy && s->p.temperature < TDM_SAMPLING_MIN_TEMP)
        s->p.temperature = TDM_SAMPLING_MIN_TEMP;
    if (s->p.top_k < 0 || s->p.top_k >= vocab_size)
        s->p.top_k = 0;
    s->bias_unique = true;
    for (int i = 0; i < s->p.num_logit_bias; i++)
        for (int j = 0; j < i; j++)
            s->bias_unique &= s->p.logit_bias[i].token != s->p.logit_bias[j].token;
    for (int i = 0; i < s->p.num_logit_bias; i++) {
        float b = s->p.logit_bias[i].bias;
        s->p.logit_bias[i].bias = b > TDM_LOGIT_BIAS_LIMIT    ? TDM_LOGIT_BIAS_LIMIT
                                  : b < -TDM_LOGIT_BIAS_LIMIT ? -TDM_LOGIT_BIAS_LIMIT
                                                              : b;
    }
    s->seed = p->has_seed ? p->seed : entropy_seed();
    s->inv_t = s->greedy ? 0.0f : 1.0f / s->p.temperature;

    size_t v = (size_t)vocab_size;
    s->num_eos = num_eos;
    s->eos_ids = malloc(sizeof(int32_t) * (size_t)(num_eos > 0 ? num_eos : 1));
    s->masked_ids = malloc(sizeof(int32_t) * (size_t)(num_eos + p->num_stop_token_ids + 1));
    if (!s->eos_ids || !s->masked_ids)
        goto fail;
    if (num_eos > 0)
        memcpy(s->eos_ids, eos_ids, sizeof(int32_t) * (size_t)num_eos);
    for (int i = 0; i < num_eos; i++)
        s->masked_ids[s->num_masked++] = eos_ids[i];
    for (int i = 0; i < p->num_stop_token_ids; i++)
        s->masked_ids[s->num_masked++] = p->stop_token_ids[i];

    if (p->repetition_penalty != 1.0f) {
        s->seen = calloc(s->words, sizeof(uint64_t));
        if (!s->seen)
            goto fail;
        for (size_t i = 0; i < n_prompt; i++)
            s->seen[prompt[i] >> 6] |= 1ull << (prompt[i] & 63);
    }
    if (p->presence_penalty != 0.0f || p->frequency_penalty != 0.0f) {
        s->out_seen = calloc(s->words, sizeof(uint64_t));
        s->out_count = calloc(v, sizeof(uint32_t));
        if (!s->out_seen || !s->out_count)
            goto fail;
    }
    if (s->seen) {
        // The prompt's distinct tokens in order (out_seen is empty yet).
        for (size_t wi = 0; wi < s->words; wi++)
            for (uint64_t bits = s->seen[wi]; bits; bits &= bits - 1)
                toks_insert(s, (int32_t)(wi * 64 + (size_t)__builtin_ctzll(bits)));
        if (s->toks_lost)
            goto fail;
    }
    if (p->num_allowed_token_ids > 0) {
        s->allow = calloc(s->words, sizeof(uint64_t));
        if (!s->allow)
            goto fail;
        for (int i = 0; i < p->num_allowed_token_ids; i++)
            s->allow[p->allowed_token_ids[i] >> 6] |= 1ull << (p->allowed_token_ids[i] & 63);
    }
    if (p->num_bad_words > 0) {
        int total = 0;
        for (int i = 0; i < p->num_bad_words; i++) {
            total += p->bad_word_lens[i];
            if (p->bad_word_lens[i] - 1 > s->bad_pre)
                s->bad_pre = p->bad_word_lens[i] - 1;
        }
        s->bad_ids = malloc((size_t)total * sizeof *s->bad_ids);
        s->bad_lens = malloc((size_t)p->num_bad_words * sizeof *s->bad_lens);
        s->bad_hist = malloc((size_t)(s->bad_pre > 0 ? s->bad_pre : 1) * sizeof *s->bad_hist);
        if (!s->bad_ids || !s->bad_lens || !s->bad_hist)
            goto fail;
        memcpy(s->bad_ids, p->bad_word_ids, (size_t)total * sizeof *s->bad_ids);
        memcpy(s->bad_lens, p->bad_word_lens, (size_t)p->num_bad_words * sizeof *s->bad_lens);
        s->n_bad = p->num_bad_words;
    }
    if (p->num_logprob_token_ids > 0) {
        s->lp_ids = malloc((size_t)p->num_logprob_token_ids * sizeof *s->lp_ids);
        if (!s->lp_ids)
            goto fail;
        s->n_lp_ids = distinct_ids(p->logprob_token_ids, p->num_logprob_token_ids, s->lp_ids);
    }
    // The copies are the sampler's: the borrowed arrays may go.
    s->p.allowed_token_ids = NULL;
    s->p.logprob_token_ids = NULL;
    s->p.bad_word_ids = s->p.bad_word_lens = NULL;
    if (p->logprobs >= 0) {
        s->raw = malloc(v * sizeof(float));
        if (!s->raw)
            goto fail;
    }
    if (!s->greedy) {
        s->cand = malloc(v * sizeof(int32_t));
        s->weight = malloc(v * sizeof(float));
        s->qw = malloc(v * sizeof(uint32_t));
        s->qsel = malloc(v * sizeof(uint32_t));
        if (!s->cand || !s->weight || !s->qw || !s->qsel)
            goto fail;
    }
    *out = s;
    return TDM_OK;
fail:
    tdm_sampler_free(s);
    return TDM_ENOMEM;
}

void tdm_sampler_free(struct tdm_sampler *s)
{
    if (!s)
        return;
    free(s->eos_ids);
    free(s->masked_ids);
    free(s->seen);
    free(s->out_seen);
    free(s->out_count);
    free(s->toks);
    free(s->allow);
    free(s->lp_ids);
    free(s->bad_ids);
    free(s->bad_lens);
    free(s->bad_hist);
    free(s->raw);
    free(s->cand);
    free(s->weight);
    free(s->qw);
    free(s->qsel);
    free(s);
}

// ---- top-p over integer weights ------------------------------------------------------------

uint32_t tdm_sampling_top_p_floor(uint32_t *q, size_t n, double bound)
{
    // Invariant: every value of [0, lo) is kept, every value of [hi, n) is
    // dropped, above = the weight of [0, lo) plus that of every dropped value
    // greater than those of [lo, hi) (none: dropped values are the smallest).
    // Three-way partition around a pivot v of [lo, hi): > v, == v, < v. v is
    // kept iff above + mass(> v) < bound; then the values below v are kept only
    // from the next smaller value on, whose G is above + mass(>= v).
    size_t lo = 0, hi = n;
    uint64_t above = 0;
    uint32_t floor_v = UINT32_MAX; // the smallest kept value so far
    while (lo < hi) {
        uint32_t a = q[lo], b = q[lo + (hi - lo) / 2], c = q[hi - 1];
        uint32_t v = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        size_t gt = lo, i = lo, lt = hi; // [lo, gt) > v, [gt, i) == v, [lt, hi) < v
        uint64_t m_gt = 0, m_eq = 0;
        while (i < lt) {
            uint32_t x = q[i];
            if (x > v) {
                q[i++] = q[gt];
                q[gt++] = x;
                m_gt += x;
            } else if (x < v) {
                q[i] = q[--lt];
                q[lt] = x;
            } else {
                m_eq += x;
                i++;
            }
        }
        if ((double)(above + m_gt) < bound) {
            floor_v = v; // v and everything above it are kept
            above += m_gt + m_eq;
            if (!((double)above < bound))
                break; // the next smaller value's G reaches the bound
            lo = lt;
        } else {
            hi = gt; // v is dropped: the floor is among the larger values
        }
    }
    return floor_v;
}

// Quickselect for the k-th largest of v[0..n) in place (k >= 1, k <= n).
static float select_kth(float *v, size_t n, size_t k)
{
    size_t lo = 0, hi = n, want = k - 1; // want: index in descending order
    while (hi - lo > 1) {
        float a = v[lo], b = v[lo + (hi - lo) / 2], c = v[hi - 1];
        float pivot = a > b ? (b > c ? b : (a > c ? c : a)) : (a > c ? a : (b > c ? c : b));
        // Three-way partition: > pivot, == pivot, < pivot.
        size_t lt = lo, i = lo, gt = hi;
        while (i < gt) {
            if (v[i] > pivot) {
                float t = v[i];
                v[i++] = v[lt];
                v[lt++] = t;
            } else if (v[i] < pivot) {
                float t = v[i];
                v[i] = v[--gt];
                v[gt] = t;
            } else {
                i++;
            }
        }
        if (want < lt)
            hi = lt;
        else if (want < gt)
            return pivot;
        else
            lo = gt;
    }
    return v[lo];
}

float tdm_sampling_kth_largest(const float *logits, size_t n, size_t k, float *scratch)
{
    if (k <= TOPK_BUFFER_MAX) {
        // One pass keeping the k largest in a descending buffer; after the first few
        // thousand entries almost every value fails the single comparison.
        float *buf = scratch;
        for (size_t i = 0; i < k; i++)
            buf[i] = -INFINITY;
        float floor_v = -INFINITY; // buf[k - 1], kept in a register
        for (size_t i = tdm_sampling_next_above(logits, 0, n, floor_v); i < n;
             i = tdm_sampling_next_above(logits, i + 1, n, floor_v)) {
            float l = logits[i]; // > floor_v: NaN is skipped
            size_t j = k - 1;
            while (j > 0 && buf[j - 1] < l) {
                buf[j] = buf[j - 1];
                j--;
            }
            buf[j] = l;
            floor_v = buf[k - 1];
        }
        return floor_v;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (logits[i] > -INFINITY) // drops -inf and NaN
            scratch[m++] = logits[i];
    if (m < k)
        return -INFINITY;
    return select_kth(scratch, m, k);
}

// ---- the per-token path -------------------------------------------------------------------

// The tokens the bad words ban from the next draw, the output being the
// recorded tokens then ahead[0 .. n_ahead): each word whose other tokens end
// it gives its last token (vLLM's rule: a word longer than the output plus
// one never does). Into ban[] (TDM_MAX_BAD_WORDS), each token once; returns
// how many.
static int bad_bans(const struct tdm_sampler *s, const int32_t *ahead, int n_ahead, int32_t *ban)
{
    int n = 0;
    const int32_t *word = s->bad_ids;
    for (int i = 0; i < s->n_bad; word += s->bad_lens[i++]) {
        int pre = s->bad_lens[i] - 1;
        if ((uint64_t)pre > s->hist_n + (uint64_t)n_ahead)
            continue;
        bool hit = true;
        for (int k = 1; k <= pre && hit; k++) { // the k-th output token from the end
            int32_t t =
                k <= n_ahead
                    ? ahead[n_ahead - k]
                    : s->bad_hist[(s->hist_n - (uint64_t)(k - n_ahead)) % (uint64_t)s->bad_pre];
            hit = t == word[pre - k];
        }
        for (int j = 0; j < n && hit; j++)
            hit = ban[j] != word[pre];
        if (hit)
            ban[n++] = word[pre];
    }
    return n;
}

static void apply_penalties(struct tdm_sampler *s, float *logits)
{
    const struct tdm_sampling_params *p = &s->p;
    for (int i = 0; i < p->num_logit_bias; i++)
        logits[p->logit_bias[i].token] += p->logit_bias[i].bias;
    if (s->seen) {
        float r = p->repetition_penalty;
        for (size_t wi = 0; wi < s->words; wi++) {
            for (uint64_t bits = s->seen[wi]; bits; bits &= bits - 1) {
                size_t t = wi * 64 + (size_t)__builtin_ctzll(bits);
                float l = logits[t];
                logits[t] = l > 0.0f ? l / r : l * r;
            }
        }
    }
    if (s->out_seen) {
        for (size_t wi = 0; wi < s->words; wi++) {
            for (uint64_t bits = s->out_seen[wi]; bits; bits &= bits - 1) {
                size_t t = wi * 64 + (size_t)__builtin_ctzll(bits);
                logits[t] -= p->frequency_penalty * (float)s->out_count[t] + p->presence_penalty;
            }
        }
    }
    if (s->num_generated < p->min_tokens)
        for (int i = 0; i < s->num_masked; i++)
            logits[s->masked_ids[i]] = -INFINITY;
    if (s->allow)
        for (size_t wi = 0; wi < s->words; wi++) {
            uint64_t out = ~s->allow[wi];
            if (wi == s->words - 1 && s->vocab_size % 64)
                out &= (1ull << (s->vocab_size % 64)) - 1;
            for (; out; out &= out - 1)
                logits[wi * 64 + (size_t)__builtin_ctzll(out)] = -INFINITY;
        }
    int32_t ban[TDM_MAX_BAD_WORDS];
    int n_ban = bad_bans(s, NULL, 0, ban);
    for (int i = 0; i < n_ban; i++)
        logits[ban[i]] = -INFINITY;
}

// Random path, sample_draw.h's draw: the candidates (top_k, or every token
// that can weigh > 0) in cand, their weights (min_p applied) in qw, the top_p
// floor, then the draw over the kept ones in ascending id. Returns -1 when the
// row has no finite maximum (the caller takes the argmax).
static int32_t sample_random(struct tdm_sampler *s, const float *logits)
{
    const struct tdm_sampling_params *p = &s->p;
    size_t v = (size_t)s->vocab_size, n = 0;
    float lmax = -INFINITY;
    if (p->top_k > 0) {
        // top_k: logits >= the k-th largest finite one (all of them when fewer);
        // the row's maximum is among those few.
        float thr = tdm_sampling_kth_largest(logits, v, (size_t)p->top_k, s->weight);
        n = tdm_sampling_collect_ge(logits, v, thr > -INFINITY ? thr : -FLT_MAX, s->cand);
        for (size_t j = 0; j < n; j++)
            lmax = fmaxf(lmax, logits[s->cand[j]]);
        if (!isfinite(lmax))
            return -1;
    } else {
        (void)tdm_sampling_argmax(logits, v, &lmax); // the first largest, as `>` finds it
        if (!isfinite(lmax))
            return -1;
        // A token 22 temperatures below the best weighs 0 (e^-22 * 2^31 < 1),
        // so the ones below need no weight: the same candidates in effect.
        n = tdm_sampling_collect_ge(logits, v, lmax - 22.0f * p->temperature, s->cand);
    }
    uint64_t total = 0;
    size_t kept = 0;
    for (size_t j = 0; j < n; j++) {
        int32_t id = s->cand[j];
        uint32_t q = tdm_draw_weight(logits[id], lmax, s->inv_t, p->min_p);
        if (q == 0)
            continue;
        s->cand[kept] = id;
        s->qw[kept++] = q;
        total += q;
    }
    if (kept == 0)
        return -1;
    uint32_t floor_q = 0;
    if (p->top_p < 1.0f) {
        memcpy(s->qsel, s->qw, kept * sizeof(uint32_t));
        floor_q = tdm_sampling_top_p_floor(s->qsel, kept, tdm_draw_top_p_mass(p->top_p, total));
        total = 0;
        for (size_t j = 0; j < kept; j++)
            total += s->qw[j] >= floor_q ? s->qw[j] : 0;
        if (total == 0)
            return -1;
    }
    uint64_t t = tdm_draw_target(tdm_draw_key(s->seed, (uint64_t)s->num_generated), total);
    uint64_t acc = 0;
    for (size_t j = 0; j < kept; j++) {
        if (s->qw[j] < floor_q)
            continue;
        acc += s->qw[j];
        if (acc > t)
            return s->cand[j];
    }
    return -1; // not reached: acc ends at total > t
}

void tdm_logprobs_of_row(const float *raw, int vocab, int32_t token, int k,
                         struct tdm_sample_result *res, int32_t *rank)
{
    size_t v = (size_t)vocab;
    // Pass 1: the maximum. Pass 2: the top k by value (ties to the lower id),
    // kept in a descending insertion buffer: the first k non-NaN values (-inf
    // included) fill it, then only values above its last entry enter. Pass 3:
    // the sum of exponentials.
    struct tdm_token_logprob *top = res->top;
    int filled = 0;
    float lmax;
    (void)tdm_sampling_argmax(raw, (size_t)v, &lmax);
    size_t i = 0;
    for (; i < (size_t)v && filled < k; i++) {
        float l = raw[i];
        if (l != l)
            continue;
        int j = filled++;
        while (j > 0 && top[j - 1].logprob < l) {
            top[j] = top[j - 1];
            j--;
        }
        top[j].token = (int32_t)i;
        top[j].logprob = l;
    }
    if (k > 0 && filled == k)
        for (i = tdm_sampling_next_above(raw, i, (size_t)v, top[k - 1].logprob); i < (size_t)v;
             i = tdm_sampling_next_above(raw, i + 1, (size_t)v, top[k - 1].logprob)) {
            float l = raw[i];
            int j = k - 1;
            while (j > 0 && top[j - 1].logprob < l) {
                top[j] = top[j - 1];
                j--;
            }
            top[j].token = (int32_t)i;
            top[j].logprob = l;
        }
    double lse = (double)lmax + log(tdm_sampling_sum_exp(raw, v, lmax));
    res->token = token;
    res->logprob = (float)((double)raw[token] - lse);
    res->num_top = filled;
    for (int j = 0; j < filled; j++)
        top[j].logprob = (float)((double)top[j].logprob - lse);
    if (rank) {
        // vLLM's rank: 1 + the tokens strictly more likely (NaN never is).
        const float t = raw[token];
        int32_t above = 0;
        for (size_t j = 0; j < v; j++)
            above += raw[j] > t;
        *rank = above + 1;
    }
}

// log-softmax of the raw logits: the chosen token's value and the top N, or
// with logprob_token_ids the chosen token and the listed ids (vLLM's order:
// the sampled token's column first, then the ids as asked).
static void fill_logprobs(const struct tdm_sampler *s, int32_t token, struct tdm_sample_result *res)
{
    if (!s->lp_ids) {
        tdm_logprobs_of_row(s->raw, s->vocab_size, token, s->p.logprobs, res, NULL);
        return;
    }
    size_t v = (size_t)s->vocab_size;
    float lmax;
    (void)tdm_sampling_argmax(s->raw, v, &lmax);
    double lse = (double)lmax + log(tdm_sampling_sum_exp(s->raw, v, lmax));
    res->token = token;
    res->logprob = (float)((double)s->raw[token] - lse);
    res->top[0] = (struct tdm_token_logprob){token, res->logprob};
    for (int i = 0; i < s->n_lp_ids; i++)
        res->top[1 + i] =
            (struct tdm_token_logprob){s->lp_ids[i], (float)((double)s->raw[s->lp_ids[i]] - lse)};
    res->num_top = 1 + s->n_lp_ids;
}

static void record(struct tdm_sampler *s, int32_t token)
{
    s->num_generated++;
    if (s->bad_pre > 0)
        s->bad_hist[s->hist_n % (uint64_t)s->bad_pre] = token;
    s->hist_n++;
    if ((s->seen || s->out_seen) && !in_bitmaps(s, token))
        toks_insert(s, token);
    if (s->seen)
        s->seen[token >> 6] |= 1ull << (token & 63);
    if (s->out_seen) {
        s->out_seen[token >> 6] |= 1ull << (token & 63);
        s->out_count[token]++;
    }
}

int32_t tdm_sampler_sample(struct tdm_sampler *s, float *logits, struct tdm_sample_result *res)
{
    if (s->raw)
        memcpy(s->raw, logits, sizeof(float) * (size_t)s->vocab_size);
    apply_penalties(s, logits);
    int32_t token = -1;
    if (!s->greedy)
        token = sample_random(s, logits);
    if (token < 0) // greedy, or nothing left to draw from (all -inf or NaN)
        token = tdm_sampling_argmax(logits, (size_t)s->vocab_size, NULL);
    if (res) {
        res->token = token;
        res->logprob = 0.0f;
        res->num_top = 0;
        if (s->raw)
            fill_logprobs(s, token, res);
    }
    record(s, token);
    return token;
}

int tdm_sampler_verify(struct tdm_sampler *s, float *rows, const int32_t *draft, int n_draft,
                       int32_t *out, struct tdm_sample_result *res)
{
    int n = 0;
    for (int j = 0; j <= n_draft; j++) {
        float *row = rows + (size_t)j * (size_t)s->vocab_size;
        int32_t tok = tdm_sampler_sample(s, row, res ? &res[n] : NULL);
        out[n++] = tok;
        if (j == n_draft || tok != draft[j] || tdm_sampler_is_stop(s, tok))
            break;
    }
    return n;
}

// Nothing but the raw logits decides the next token: no bias, penalty,
// min_tokens mask or logprobs.
static bool plain(const struct tdm_sampler *s)
{
    return s->p.num_logit_bias == 0 && s->seen == NULL && s->out_seen == NULL && s->raw == NULL &&
           s->allow == NULL && s->n_bad == 0 &&
           (s->num_generated >= s->p.min_tokens || s->num_masked == 0);
}

bool tdm_sampler_plain_greedy(const struct tdm_sampler *s)
{
    return s->greedy && plain(s);
}

// Tokens ahead of the history (tdm_sampler_draw_prepare_ahead): those
// recorded in the bitmaps once they are, ascending, each once (extra), and
// the whole list, for the counts.
struct ahead {
    const int32_t *tok;
    int n;
    int32_t extra[TDM_SAMPLER_MAX_AHEAD];
    int n_extra;
};

static bool in_extra(const struct ahead *a, int32_t t)
{
    for (int i = 0; i < a->n_extra; i++)
        if (a->extra[i] == t)
            return true;
    return false;
}

// Token t's entry: in adj[0..sorted) (the bitmaps' tokens and the extra ones
// ahead, ascending) when it is one of those, else in adj[sorted..*n) when
// `listed` (an earlier list entry made it), else a new one at *n; NULL when
// that entry was not written (past cap). *n counts every entry, written or
// not.
static struct tdm_draw_adj *adj_entry(const struct tdm_sampler *s, const struct ahead *ah,
                                      struct tdm_draw_adj *adj, int *n, int cap, int sorted,
                                      int32_t t, bool listed)
{
    if (in_bitmaps(s, t) || in_extra(ah, t)) {
        if (sorted > cap)
            return NULL;
        int lo = 0, hi = sorted;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (adj[mid].token < t)
                lo = mid + 1;
            else
                hi = mid;
        }
        return &adj[lo];
    }
    if (listed) {
        for (int i = sorted; i < *n && i < cap; i++)
            if (adj[i].token == t)
                return &adj[i];
        return NULL;
    }
    int k = (*n)++;
    if (k >= cap)
        return NULL;
    adj[k] = (struct tdm_draw_adj){.token = t};
    return &adj[k];
}

// Token t masked (-inf) in a row's entries (adj_entry's arguments): its entry
// is an earlier one's where the logit bias or masked_ids[0 .. n_masked)
// names it.
static void mask_entry(const struct tdm_sampler *s, const struct ahead *ah,
                       struct tdm_draw_adj *adj, int *n, int cap, int sorted, int32_t t,
                       int n_masked)
{
    bool listed = false;
    for (int j = 0; j < s->p.num_logit_bias && !listed; j++)
        listed = s->p.logit_bias[j].token == t;
    for (int j = 0; j < n_masked && !listed; j++)
        listed = s->masked_ids[j] == t;
    struct tdm_draw_adj *a = adj_entry(s, ah, adj, n, cap, sorted, t, listed);
    if (a)
        a->flags |= TDM_DRAW_ADJ_MASKED;
}

// Token t's entry from the bitmaps and the tokens ahead, as record() would
// leave them: seen (the repetition penalty's history) and its output count.
static struct tdm_draw_adj ahead_entry(const struct tdm_sampler *s, const struct ahead *ah,
                                       int32_t t)
{
    uint64_t bit = 1ull << (t & 63);
    bool seen = s->seen && (s->seen[t >> 6] & bit);
    uint32_t count = s->out_seen && (s->out_seen[t >> 6] & bit) ? s->out_count[t] : 0;
    for (int i = 0; i < ah->n; i++)
        if (ah->tok[i] == t) {
            seen |= s->seen != NULL;
            count += s->out_seen != NULL;
        }
    return (struct tdm_draw_adj){.token = t, .flags = seen ? TDM_DRAW_ADJ_SEEN : 0, .count = count};
}

// Whether a device can draw for s: a repeated bias token adds twice, a lost
// token list cannot say the history's tokens, allowed_token_ids would be an
// entry for nearly every token (unless the caller's draws take it as the
// row's allow bitmap, and no logprobs are asked: vLLM's come from the row
// before that mask, a device's after it), and logprob_token_ids are not among
// the device's logprobs.
static bool drawable(const struct tdm_sampler *s)
{
    return s->bias_unique && !s->toks_lost && s->lp_ids == NULL &&
           (s->allow == NULL || (s->device_allow && s->p.logprobs < 0));
}

void tdm_sampler_set_device_allow(struct tdm_sampler *s, bool on)
{
    s->device_allow = on;
}

const uint64_t *tdm_sampler_allow_bits(const struct tdm_sampler *s)
{
    return s->allow;
}

// A draw's parameters at output index `generated`, without its entries.
static void draw_params(const struct tdm_sampler *s, struct tdm_draw_params *d, uint64_t generated)
{
    const struct tdm_sampling_params *p = &s->p;
    *d = (struct tdm_draw_params){.inv_t = s->inv_t,
                                  .top_p = p->top_p,
                                  .min_p = p->min_p,
                                  .top_k = p->top_k,
                                  .key = tdm_draw_key(s->seed, generated),
                                  .repetition = p->repetition_penalty,
                                  .frequency = p->frequency_penalty,
                                  .presence = p->presence_penalty,
                                  .logprobs = p->logprobs >= 0,
                                  .top_logprobs = p->logprobs > 0 ? p->logprobs : 0,
                                  .rec_flags = s->seen ? TDM_DRAW_ADJ_SEEN : 0u,
                                  .rec_count = s->out_seen != NULL};
}

// tdm_sampler_draw_prepare_ahead, the draw's key and the min_tokens count
// n_pending tokens further still (tokens not known yet, not in the history).
static int prepare(const struct tdm_sampler *s, struct tdm_draw_params *d, struct tdm_draw_adj *adj,
                   int cap, const int32_t *ahead, int n_ahead, int n_pending)
{
    const struct tdm_sampling_params *p = &s->p;
    if (!drawable(s) || n_ahead < 0 || n_ahead > TDM_SAMPLER_MAX_AHEAD ||
        (n_pending > 0 && s->bad_pre > 0))
        return -1;
    // What record() would do with each token ahead: the tokens it would add
    // to a bitmap that has none of them yet, ascending, each once.
    struct ahead ah = {.tok = ahead, .n = n_ahead};
    for (int i = 0; i < n_ahead; i++) {
        int32_t t = ahead[i];
        if (t < 0 || t >= s->vocab_size)
            return -1;
        if ((s->seen || s->out_seen) && !in_bitmaps(s, t) && !in_extra(&ah, t)) {
            int k = ah.n_extra++;
            while (k > 0 && ah.extra[k - 1] > t) {
                ah.extra[k] = ah.extra[k - 1];
                k--;
            }
            ah.extra[k] = t;
        }
    }
    uint64_t generated = (uint64_t)s->num_generated + (uint64_t)n_ahead + (uint64_t)n_pending;
    draw_params(s, d, generated);
    // The tokens of the bitmaps (the sampler's distinct tokens) and the extra
    // ones ahead in ascending order, then those of the bias and mask lists
    // not among them: apply_penalties' operations, token by token.
    int n = 0, e = 0;
    for (int i = 0; i <= s->n_toks; i++) {
        int32_t t = i < s->n_toks ? s->toks[i] : INT32_MAX;
        for (; e < ah.n_extra && ah.extra[e] < t; e++) {
            if (n < cap)
                adj[n] = ahead_entry(s, &ah, ah.extra[e]);
            n++;
        }
        if (i < s->n_toks) {
            if (n < cap)
                adj[n] = ahead_entry(s, &ah, t);
            n++;
        }
    }
    int sorted = n;
    for (int i = 0; i < p->num_logit_bias; i++) { // unique tokens (bias_unique)
        struct tdm_draw_adj *a =
            adj_entry(s, &ah, adj, &n, cap, sorted, p->logit_bias[i].token, false);
        if (a) {
            a->flags |= TDM_DRAW_ADJ_BIAS;
            a->bias = p->logit_bias[i].bias;
        }
    }
    // The min_tokens masks, then the bad words' bans (unique tokens).
    int n_masked = generated < (uint64_t)p->min_tokens ? s->num_masked : 0;
    for (int i = 0; i < n_masked; i++)
        mask_entry(s, &ah, adj, &n, cap, sorted, s->masked_ids[i], i);
    int32_t ban[TDM_MAX_BAD_WORDS];
    int n_ban = bad_bans(s, ahead, n_ahead, ban);
    for (int i = 0; i < n_ban; i++)
        mask_entry(s, &ah, adj, &n, cap, sorted, ban[i], n_masked);
    d->n_adj = n;
    return n;
}

int tdm_sampler_draw_prepare_ahead(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                   struct tdm_draw_adj *adj, int cap, const int32_t *ahead,
                                   int n_ahead)
{
    return prepare(s, d, adj, cap, ahead, n_ahead, 0);
}

int tdm_sampler_draw_prepare(const struct tdm_sampler *s, struct tdm_draw_params *d,
                             struct tdm_draw_adj *adj, int cap)
{
    return prepare(s, d, adj, cap, NULL, 0, 0);
}

int tdm_sampler_draw_prepare_pending(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                     struct tdm_draw_adj *adj, int cap, int prev_row)
{
    if (prev_row < 0)
        return -1;
    int n = prepare(s, d, adj, cap, NULL, 0, 1);
    if (n < 0 || (s->seen == NULL && s->out_seen == NULL))
        return n; // no penalty: the token before changes nothing
    // What record() does with the pending token: the repetition penalty's
    // history and one output occurrence.
    if (n < cap)
        adj[n] = (struct tdm_draw_adj){
            .token = prev_row, .flags = TDM_DRAW_ADJ_PENDING | d->rec_flags, .count = d->rec_count};
    d->n_adj = ++n;
    return n;
}

_Static_assert(TDM_DRAW_MAX_LOGPROBS == TDM_MAX_LOGPROBS,
               "a device's logprobs (sample_draw.h) hold what a request may ask");

void tdm_sampler_draw_logprobs(const struct tdm_draw_logprobs *lp, int32_t token,
                               struct tdm_sample_result *res)
{
    res->token = token;
    res->logprob = lp->logprob;
    res->num_top = lp->num_top;
    for (int j = 0; j < lp->num_top; j++)
        res->top[j] =
            (struct tdm_token_logprob){.token = lp->top_token[j], .logprob = lp->top_logprob[j]};
}

bool tdm_sampler_draw_ahead_ok(const struct tdm_sampler *s)
{
    return drawable(s) && s->bad_pre == 0;
}

int tdm_sampler_draw_list_params(const struct tdm_sampler *s, struct tdm_draw_params *d,
                                 int n_pending)
{
    if (!drawable(s) || n_pending < 0 || n_pending > 1 || s->bad_pre > 0)
        return -1;
    draw_params(s, d, (uint64_t)s->num_generated + (uint64_t)n_pending);
    return 0;
}

bool tdm_sampler_draw_params(const struct tdm_sampler *s, struct tdm_draw_params *d)
{
    return plain(s) && tdm_sampler_draw_prepare(s, d, NULL, 0) == 0;
}

bool tdm_sampler_eos_ends(const struct tdm_sampler *s)
{
    return !s->p.ignore_eos && s->num_eos > 0 && s->num_generated >= s->p.min_tokens;
}

bool tdm_sampler_is_stop(const struct tdm_sampler *s, int32_t token)
{
    if (s->num_generated < s->p.min_tokens)
        return false;
    if (!s->p.ignore_eos)
        for (int i = 0; i < s->num_eos; i++)
            if (s->eos_ids[i] == token)
                return true;
    for (int i = 0; i < s->p.num_stop_token_ids; i++)
        if (s->p.stop_token_ids[i] == token)
            return true;
    return false;
}

int tdm_sampler_num_generated(const struct tdm_sampler *s)
{
    return s->num_generated;
}

int tdm_sampler_min_tokens(const struct tdm_sampler *s)
{
    return s->p.min_tokens;
}

void tdm_sampler_replay(struct tdm_sampler *s, const int32_t *tokens, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] >= 0 && tokens[i] < s->vocab_size)
            record(s, tokens[i]);
        else
            s->num_generated++;
    }
}
