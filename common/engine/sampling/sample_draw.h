// SPDX-License-Identifier: Apache-2.0
// sample_draw.h: the draw of a sampled token, written once for the CPU sampler
// (sampling.c) and the CUDA backend's device sampler (cuda_kernels.cuh), so
// that the same logits row gives the same token on both (issue 26 item 1).
//
// The token is a pure function of the row, the filters and a 64-bit key; every
// step that could round differently on two machines is pinned down:
//   key     tdm_draw_key(seed, position): a counter-based generator (two
//           splitmix64 finalizers), keyed by the request's seed and the index
//           of the token in its output. No state: a stream resumed elsewhere,
//           a speculative row and a device row all take the same key.
//   weight  q_i = floor(2^31 * exp((l_i - l_max) / T)) as an integer, from
//           tdm_draw_exp: range reduction and a polynomial in separately
//           rounded IEEE products and sums (no FMA contraction: the host files
//           that include this build with -ffp-contract=off, device code uses
//           __fmul_rn/__fadd_rn), so each q_i has the same bits everywhere.
//           Tokens below min_p (exp(...) < min_p, the best token having 1) and
//           outside top_k (l_i < the k-th largest finite logit) weigh 0.
//   top_p   with Q the sum of the weights, the kept tokens are those whose
//           value v has G(v) < top_p * Q, G(v) = the weight of the tokens with
//           q > v: the smallest set of the heaviest tokens reaching top_p of
//           the mass, a tie at the boundary kept whole. Integer sums are exact
//           in any order, so a device's parallel reductions give the same set.
//   draw    t = floor(key * Q' / 2^64) over the kept weight Q', and the token
//           is the first (ascending id) whose running sum of kept weights
//           exceeds t: token i with probability q_i / Q'.
// Weights are quantised to 2^-31 of the best token: a token more than ~21.5
// temperature-scaled nats below the best is never drawn (vLLM draws it with
// probability under 5e-10 of the best one's).
#ifndef TDM_SAMPLE_DRAW_H
#define TDM_SAMPLE_DRAW_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define TDM_DRAW_FN static __host__ __device__ __forceinline__
#else
#define TDM_DRAW_FN static inline
#endif

#if defined(__CUDA_ARCH__)
#define TDM_DRAW_MUL(a, b) __fmul_rn((a), (b))
#define TDM_DRAW_ADD(a, b) __fadd_rn((a), (b))
#define TDM_DRAW_SUB(a, b) __fsub_rn((a), (b))
#else
#define TDM_DRAW_MUL(a, b) ((a) * (b))
#define TDM_DRAW_ADD(a, b) ((a) + (b))
#define TDM_DRAW_SUB(a, b) ((a) - (b))
#endif

// The weight of the best token: exp(0) scaled.
#define TDM_DRAW_ONE 2147483648u

// What a row's draw needs besides its logits (the engine fills it from the
// request's sampler, tdm_sampler_draw_prepare): inv_t 0 means greedy (the
// first largest logit by `>`). Before the draw, the tokens of adj[adj_off ..
// adj_off + n_adj) (an array the caller passes beside the params) have their
// logits adjusted by tdm_draw_adjust: logit bias, penalties, min_tokens mask.
struct tdm_draw_params {
    float inv_t;   // 1 / temperature, or 0 for greedy
    float top_p;   // (0, 1]; 1 = off
    float min_p;   // [0, 1]; 0 = off
    int32_t top_k; // 0 = off
    uint64_t key;  // tdm_draw_key(seed, position)
    float repetition, frequency, presence; // the request's penalties
    int32_t adj_off, n_adj;                // its adjustments
    // Structured output: the tokens allowed, one bit each (token t: bit t % 32
    // of word t / 32) in mask words [mask_off, mask_off + n_mask_words) of an
    // array the caller passes beside the params; a token without its bit (or
    // past them) is -inf. n_mask_words 0: no mask.
    int32_t mask_off, n_mask_words;
    // Logprobs (OpenAI's `logprobs`): 0, or 1 with the drawn token's
    // log-softmax of the row as the model gave it (vLLM's raw_logprobs: before
    // the adjustments and the temperature; after the structured-output mask,
    // as the host applies it first) and the top_logprobs largest of them.
    int32_t logprobs, top_logprobs;
    // What one more output occurrence of a token adds to its entry (the
    // sampler's record(): SEEN for the repetition penalty, 1 to count for
    // the frequency and presence penalties; 0 and 0: nothing).
    uint32_t rec_flags, rec_count;
    // A device's adjustment list (a device backend that keeps a request's
    // adjustments between steps, issue 26 item 1): list > 0 names it (list
    // list - 1 of the caller's numbering); list_load 1: the row's n_adj
    // entries at adj_off replace the list's, 0: the list's entries as the
    // step before left them are the row's (adj_off and n_adj not read).
    // After the draw its token is recorded into the list
    // (tdm_draw_record with rec_flags, rec_count), so the next step's row
    // needs no upload. 0: the row's own entries only.
    int32_t list, list_load;
};

// What a row asking logprobs gets back with its token (a device's draw): the
// fields of the CPU sampler's tdm_sample_result (sampling.h), top entries by
// descending logprob with ties to the lower id, NaN logits never among them.
#define TDM_DRAW_MAX_LOGPROBS 20
struct tdm_draw_logprobs {
    float logprob; // the drawn token's
    int32_t num_top;
    int32_t top_token[TDM_DRAW_MAX_LOGPROBS];
    float top_logprob[TDM_DRAW_MAX_LOGPROBS];
};

// One token's adjustment, in vLLM's order (sampling.c's head comment).
#define TDM_DRAW_ADJ_BIAS 1u   // + bias
#define TDM_DRAW_ADJ_SEEN 2u   // in the prompt or the output: the repetition penalty
#define TDM_DRAW_ADJ_MASKED 4u // an EOS or stop id before min_tokens: -inf
// A pending token (async scheduling, tdm_sampler_draw_prepare_pending): the
// entry's token field is not a token but the index of a chosen row of the
// previous forward, whose chosen id t is the token before this row's draw,
// not yet on the host; flags (SEEN) and count say what one more output
// occurrence of t adds. Only a row's last entry; resolved before the draw by
// tdm_draw_resolve_pending, once t is known (on the device, from where the
// previous forward left its ids).
#define TDM_DRAW_ADJ_PENDING 8u
struct tdm_draw_adj {
    int32_t token;
    uint32_t flags; // TDM_DRAW_ADJ_*
    uint32_t count; // times in the output (> 0: the frequency and presence penalties)
    float bias;
};

// A token t recorded into a list of entries (unique tokens) as the sampler's
// record() does, flags OR'd into t's entry and count added to it, found its
// index among adj[0 .. *n_adj) or -1; without one, a new last entry (*n_adj
// grows: the caller has room for it) unless flags and count are both 0. The
// same entries, in another order, as preparing the row after t
// (tdm_sampler_draw_prepare) where the list was the row's before.
TDM_DRAW_FN void tdm_draw_record(struct tdm_draw_adj *adj, int32_t *n_adj, int32_t token,
                                 uint32_t flags, uint32_t count, int32_t found)
{
    if (flags == 0 && count == 0)
        return;
    if (found >= 0) {
        adj[found].flags |= flags;
        adj[found].count += count;
        return;
    }
    struct tdm_draw_adj *e = &adj[*n_adj];
    e->token = token;
    e->flags = flags;
    e->count = count;
    e->bias = 0.0f;
    *n_adj += 1;
}

// A row's last entry, PENDING, resolved to token t: entries of a row are
// unique tokens (the draw applies them in parallel), so the pending entry
// goes (*n_adj - 1) and t is recorded (tdm_draw_record) with its SEEN and
// count among the others: merged into t's entry, or the pending entry
// becomes t's. adj: the row's entries, *n_adj of them; found: the index of
// t's entry among the first *n_adj - 1, or -1 (a device finds it in
// parallel; tdm_draw_resolve_pending searches it). Nothing when the last
// entry is not PENDING. The same entries as preparing the row after t was
// recorded (tdm_sampler_draw_prepare), in another order.
TDM_DRAW_FN void tdm_draw_merge_pending(struct tdm_draw_adj *adj, int32_t *n_adj, int32_t token,
                                        int32_t found)
{
    if (*n_adj <= 0 || !(adj[*n_adj - 1].flags & TDM_DRAW_ADJ_PENDING))
        return;
    struct tdm_draw_adj p = adj[*n_adj - 1];
    *n_adj -= 1;
    tdm_draw_record(adj, n_adj, token, p.flags & ~TDM_DRAW_ADJ_PENDING, p.count, found);
}

// tdm_draw_merge_pending with t's entry searched among the row's others.
TDM_DRAW_FN void tdm_draw_resolve_pending(struct tdm_draw_adj *adj, int32_t *n_adj, int32_t token)
{
    int32_t found = -1;
    for (int32_t i = 0; i + 1 < *n_adj && found < 0; i++)
        if (adj[i].token == token)
            found = i;
    tdm_draw_merge_pending(adj, n_adj, token, found);
}

TDM_DRAW_FN uint64_t tdm_draw_mix(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ull;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

TDM_DRAW_FN uint64_t tdm_draw_key(uint64_t seed, uint64_t position)
{
    return tdm_draw_mix(tdm_draw_mix(seed) + 0x9E3779B97F4A7C15ull * (position + 1));
}

#if defined(__CUDA_ARCH__)
#define TDM_DRAW_DIV(a, b) __fdiv_rn((a), (b))
#else
#define TDM_DRAW_DIV(a, b) ((a) / (b))
#endif

// A token's logit after its adjustment: bias, repetition (positive logits
// divided, others multiplied), frequency * count + presence subtracted, then
// the min_tokens mask; every operation rounded on its own.
TDM_DRAW_FN float tdm_draw_adjust(float l, const struct tdm_draw_params *d,
                                  const struct tdm_draw_adj *a)
{
    if (a->flags & TDM_DRAW_ADJ_BIAS)
        l = TDM_DRAW_ADD(l, a->bias);
    if (a->flags & TDM_DRAW_ADJ_SEEN)
        l = l > 0.0f ? TDM_DRAW_DIV(l, d->repetition) : TDM_DRAW_MUL(l, d->repetition);
    if (a->count > 0)
        l = TDM_DRAW_SUB(l, TDM_DRAW_ADD(TDM_DRAW_MUL(d->frequency, (float)a->count), d->presence));
    if (a->flags & TDM_DRAW_ADJ_MASKED)
        l = -INFINITY;
    return l;
}

// exp(x) for x <= 0 within ~2 ulp; 0 below -87 (and for NaN); the same bits
// on every IEEE machine (see the head comment).
TDM_DRAW_FN float tdm_draw_exp(float x)
{
    if (!(x >= -87.0f))
        return 0.0f;
    // x = n ln2 + r, |r| <= ln2 / 2; n by the 1.5 * 2^23 rounding trick.
    float t = TDM_DRAW_MUL(x, 1.44269504f);
    float n = TDM_DRAW_SUB(TDM_DRAW_ADD(t, 12582912.0f), 12582912.0f);
    float r = TDM_DRAW_SUB(x, TDM_DRAW_MUL(n, 0.693359375f)); // ln2's high 9 bits: exact
    r = TDM_DRAW_SUB(r, TDM_DRAW_MUL(n, -2.12194440e-4f));
    float p = 1.98412698e-4f; // e^r by its Taylor polynomial to r^7, Horner
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 1.38888889e-3f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 8.33333333e-3f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 4.16666667e-2f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 1.66666667e-1f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 0.5f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 1.0f);
    p = TDM_DRAW_ADD(TDM_DRAW_MUL(p, r), 1.0f);
    // 2^n for n in [-126, 0]: built from its bits.
    uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return TDM_DRAW_MUL(p, scale);
}

// A token's integer weight in [0, TDM_DRAW_ONE] (see the head comment); l_max
// is the row's largest logit (finite), inv_t > 0.
TDM_DRAW_FN uint32_t tdm_draw_weight(float l, float l_max, float inv_t, float min_p)
{
    float w = tdm_draw_exp(TDM_DRAW_MUL(TDM_DRAW_SUB(l, l_max), inv_t));
    if (!(w >= min_p))
        return 0;
    return (uint32_t)TDM_DRAW_MUL(w, 2147483648.0f);
}

// top_p's bound on G(v) (kept iff G(v) < this): top_p * Q in double, exact
// inputs (Q < 2^53), one rounding.
TDM_DRAW_FN double tdm_draw_top_p_mass(float top_p, uint64_t total)
{
    return (double)top_p * (double)total;
}

// The draw's target in [0, total): the high half of key * total.
TDM_DRAW_FN uint64_t tdm_draw_target(uint64_t key, uint64_t total)
{
#if defined(__CUDA_ARCH__)
    return __umul64hi(key, total);
#else
    return (uint64_t)(((unsigned __int128)key * total) >> 64);
#endif
}

#endif
