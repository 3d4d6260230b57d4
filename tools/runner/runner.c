// SPDX-License-Identifier: Apache-2.0
// runner: the plain generation loop (see runner.h). Invariants per request:
// hist holds prompt + generated ids; `computed` tokens of hist have their KV
// written and committed; a prefilling request has computed < n_prompt, a
// decoding one has computed == n_prompt + n_out - 1 and feeds hist[computed].
// A constrained request's matcher follows every token it generates except the
// one that ends it; its mask is filled and applied on the sampling step (this
// loop is plain: no mask thread as in the engine).
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar.h"
#include "runner.h"

enum req_state { REQ_WAITING = 0, REQ_RUNNING, REQ_DONE };

struct req_run {
    enum req_state state;
    struct tdm_kv_seq seq;
    struct tdm_sampler *sampler;
    int32_t *hist; // [n_prompt + max_tokens]
    int computed;
    // Structured output (NULL gm: unconstrained).
    struct tdm_grammar_matcher *gm;
    uint32_t *gmask;                              // [mask words of the vocab]
    int32_t gend[TDM_MAX_EOS + TDM_MAX_STOP_IDS]; // ids that end it: EOS, stop ids
    int n_gend;
};

void tdm_gen_opts_default(struct tdm_gen_opts *o)
{
    memset(o, 0, sizeof *o);
    o->chunk = 256;
}

// A constrained request's matcher (its grammar from the process-wide cache, as
// a worker compiles a request's constraint), mask buffer and ending ids.
static int grammar_setup(struct req_run *r, const struct tdm_gen_request *q, int i,
                         const struct tdm_grammar_vocab *v, const int32_t *eos_ids, int num_eos,
                         char *err, size_t errlen)
{
    const struct tdm_sampling_params *p = &q->params;
    if (v == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "runner: request %d has a %s constraint but no grammar vocabulary "
                          "(the tokenizer's) was given",
                          i, tdm_constraint_kind_name(p->constraint));
    struct tdm_grammar *g = NULL;
    char gerr[256] = "";
    int rc = tdm_grammar_compile_cached(&g, p->constraint, p->constraint_text, p->constraint_len,
                                        gerr, sizeof gerr);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "%s", gerr);
    rc = tdm_grammar_matcher_new(&r->gm, g, v);
    tdm_grammar_unref(g); // the matcher holds its own
    r->gmask = malloc(tdm_grammar_mask_words(v) * sizeof *r->gmask);
    if (rc != TDM_OK || r->gmask == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "runner: out of memory");
    for (int k = 0; k < num_eos && k < TDM_MAX_EOS; k++)
        r->gend[r->n_gend++] = eos_ids[k];
    for (int k = 0; k < p->num_stop_token_ids; k++)
        r->gend[r->n_gend++] = p->stop_token_ids[k];
    return TDM_OK;
}

static void finish(struct tdm_kv_cache *kv, struct req_run *r)
{
    if (r->state == REQ_RUNNING)
        tdm_kv_seq_release(kv, &r->seq);
    r->state = REQ_DONE;
}

int tdm_gen_run(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_gen_request *reqs,
                int n_reqs, const struct tdm_gen_opts *opts, struct tdm_gen_stats *stats, char *err,
                size_t errlen)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    const struct tdm_model_opts *mo = tdm_model_opts(m);
    struct tdm_gen_opts defaults;
    struct tdm_gen_stats st_local;
    int rc = TDM_OK;

    if (opts == NULL) {
        tdm_gen_opts_default(&defaults);
        opts = &defaults;
    }
    if (stats == NULL)
        stats = &st_local;
    memset(stats, 0, sizeof *stats);
    if (n_reqs <= 0 || reqs == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "runner: no requests");
    int chunk = opts->chunk > 0 ? opts->chunk : 256;
    int budget_max = opts->max_step_tokens > 0 && opts->max_step_tokens < mo->max_batch_tokens
                         ? opts->max_step_tokens
                         : mo->max_batch_tokens;
    const int32_t *eos_ids = opts->eos_ids;
    int num_eos = opts->num_eos;
    int32_t cfg_eos[TDM_MAX_EOS];
    if (eos_ids == NULL) {
        for (int i = 0; i < c->num_eos_token_ids; i++)
            cfg_eos[i] = c->eos_token_ids[i];
        eos_ids = cfg_eos;
        num_eos = c->num_eos_token_ids;
    }
    int vocab = c->vocab_size;
    int max_seqs = mo->max_batch_seqs;

    for (int i = 0; i < n_reqs; i++) {
        struct tdm_gen_request *q = &reqs[i];
        if (q->prompt == NULL || q->n_prompt <= 0 || q->max_tokens <= 0 || q->out_ids == NULL)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "runner: request %d needs a prompt, max_tokens >= 1 and out_ids", i);
        if ((long)q->n_prompt + q->max_tokens > c->max_position_embeddings)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "runner: request %d: %d prompt + %d new tokens exceed the context "
                              "of %d",
                              i, q->n_prompt, q->max_tokens, c->max_position_embeddings);
        for (int k = 0; k < q->n_prompt; k++)
            if (q->prompt[k] < 0 || q->prompt[k] >= vocab)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "runner: request %d: token id %d outside the vocabulary (%d)", i,
                                  (int)q->prompt[k], vocab);
        int vrc = tdm_sampling_params_validate(&q->params, vocab, err, errlen);
        if (vrc != TDM_OK)
            return vrc;
        q->n_out = 0;
        q->num_cached_tokens = 0;
        q->stopped = false;
        q->first_token_s = q->finish_s = 0;
    }

    struct req_run *runs = calloc((size_t)n_reqs, sizeof *runs);
    struct tdm_batch_seq *batch = calloc((size_t)max_seqs, sizeof *batch);
    int *batch_req = calloc((size_t)max_seqs, sizeof *batch_req);
    float *logits = malloc((size_t)max_seqs * (size_t)vocab * sizeof(float));
    if (!runs || !batch || !batch_req || !logits) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "runner: out of memory");
        goto out;
    }
    for (int i = 0; i < n_reqs; i++) {
        struct tdm_gen_request *q = &reqs[i];
        struct req_run *r = &runs[i];
        tdm_kv_seq_init(&r->seq);
        r->hist = malloc(((size_t)q->n_prompt + (size_t)q->max_tokens) * sizeof(int32_t));
        if (r->hist == NULL || tdm_sampler_new(&r->sampler, &q->params, vocab, q->prompt,
                                               (size_t)q->n_prompt, eos_ids, num_eos) != TDM_OK) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "runner: out of memory");
            goto out;
        }
        memcpy(r->hist, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
        if (q->params.constraint != TDM_CONSTRAINT_NONE &&
            (rc = grammar_setup(r, q, i, opts->grammar_vocab, eos_ids, num_eos, err, errlen)) !=
                TDM_OK)
            goto out;
    }

    double t0 = tdm_now();
    int done = 0;
    for (int step = 0; done < n_reqs; step++) {
        int nb = 0, budget = budget_max;
        bool has_prefill = false;
        for (int i = 0; i < n_reqs && nb < max_seqs && budget > 0; i++) {
            struct tdm_gen_request *q = &reqs[i];
            struct req_run *r = &runs[i];
            if (r->state == REQ_DONE || q->join_step > step)
                continue;
            if (r->state == REQ_WAITING) {
                r->state = REQ_RUNNING;
                if (q->use_prefix_cache)
                    q->num_cached_tokens = tdm_kv_match_prefix(kv, &r->seq, q->prompt, q->n_prompt);
                r->computed = r->seq.num_tokens;
            }
            int take;
            enum tdm_logits_mode lm;
            if (r->computed < q->n_prompt) {
                take = q->n_prompt - r->computed;
                if (take > chunk)
                    take = chunk;
                if (take > budget)
                    take = budget;
                lm = r->computed + take == q->n_prompt ? TDM_LOGITS_LAST : TDM_LOGITS_NONE;
                has_prefill = true;
            } else {
                take = 1;
                lm = TDM_LOGITS_LAST;
            }
            rc = tdm_kv_reserve(kv, &r->seq, r->computed + take);
            if (rc != TDM_OK) {
                rc = tdm_seterr(err, errlen, rc, "runner: request %d: no KV blocks for %d tokens",
                                i, r->computed + take);
                goto out;
            }
            batch[nb] = (struct tdm_batch_seq){.tokens = r->hist + r->computed,
                                               .n_tokens = take,
                                               .start_pos = r->computed,
                                               .block_table = r->seq.block_table,
                                               .logits = lm};
            batch_req[nb++] = i;
            budget -= take;
        }
        if (nb == 0)
            continue; // every remaining request joins at a later step

        double ts = tdm_now();
        rc = tdm_model_forward(m, kv, batch, nb, logits);
        if (rc != TDM_OK) {
            rc = tdm_seterr(err, errlen, rc, "runner: forward failed at step %d", step);
            goto out;
        }
        int row = 0;
        for (int b = 0; b < nb; b++) {
            int i = batch_req[b];
            struct tdm_gen_request *q = &reqs[i];
            struct req_run *r = &runs[i];
            r->computed += batch[b].n_tokens;
            if (batch[b].logits == TDM_LOGITS_NONE) {
                tdm_kv_commit(kv, &r->seq, r->hist, r->computed);
                stats->prefill_tokens += batch[b].n_tokens;
                continue;
            }
            if (r->computed <= q->n_prompt)
                stats->prefill_tokens += batch[b].n_tokens;
            else
                stats->decode_tokens += 1;
            tdm_kv_commit(kv, &r->seq, r->hist, r->computed);
            float *lrow = logits + (size_t)row * (size_t)vocab;
            row++;
            if (q->logits_out != NULL)
                memcpy(q->logits_out + (size_t)q->n_out * (size_t)vocab, lrow,
                       (size_t)vocab * sizeof(float));
            if (r->gm != NULL) {
                double tm = tdm_now();
                const struct tdm_grammar_vocab *gv = opts->grammar_vocab;
                int mrc =
                    tdm_grammar_matcher_fill_mask(r->gm, r->gmask, tdm_grammar_mask_words(gv));
                if (mrc != TDM_OK) {
                    // As the engine: no mask, no unconstrained draw.
                    char msg[160];
                    int code = tdm_grammar_mask_error(mrc, msg, sizeof msg);
                    rc = tdm_seterr(err, errlen, code, "runner: request %d: %s", i, msg);
                    goto out;
                }
                tdm_grammar_mask_apply(r->gmask, tdm_grammar_vocab_size(gv), lrow, vocab, r->gend,
                                       r->n_gend, tdm_grammar_matcher_accepts_eos(r->gm));
                stats->num_masks++;
                stats->mask_s += tdm_now() - tm;
            }
            int32_t tok = tdm_sampler_sample(r->sampler, lrow, NULL);
            r->hist[q->n_prompt + q->n_out] = tok;
            q->out_ids[q->n_out++] = tok;
            double now = tdm_now() - t0;
            if (q->n_out == 1)
                q->first_token_s = now;
            q->finish_s = now;
            stats->generated_tokens++;
            bool stop = tdm_sampler_is_stop(r->sampler, tok);
            bool complete = false; // the grammar ended it without an ending id
            if (r->gm != NULL && !stop) {
                // As the engine: the grammar follows every token that does not
                // end the request; a refused one is an ending id drawn where the
                // output is complete (ignore_eos) or the fallback draw when the
                // mask left nothing (min_tokens). Where only an ending id can
                // follow, the next step samples it, unless that draw could not
                // end the request.
                int arc = tdm_grammar_matcher_accept_token(r->gm, tok);
                if (arc != TDM_OK) {
                    if (!tdm_grammar_matcher_accepts_eos(r->gm)) {
                        char msg[160];
                        rc = tdm_grammar_accept_error(arc, tok, msg, sizeof msg);
                        rc = tdm_seterr(err, errlen, rc, "runner: request %d: %s", i, msg);
                        goto out;
                    }
                    complete = true;
                } else if (tdm_grammar_matcher_is_done(r->gm) &&
                           !tdm_sampler_eos_ends(r->sampler)) {
                    complete = true;
                }
            }
            if (stop || complete || q->n_out == q->max_tokens) {
                q->stopped = stop || complete;
                finish(kv, r);
                done++;
            }
        }
        double dt = tdm_now() - ts;
        stats->steps++;
        if (has_prefill) {
            stats->prefill_steps++;
            stats->prefill_s += dt;
        } else {
            stats->decode_steps++;
            stats->decode_s += dt;
        }
    }

out:
    if (runs != NULL) {
        for (int i = 0; i < n_reqs; i++) {
            finish(kv, &runs[i]);
            tdm_sampler_free(runs[i].sampler);
            tdm_grammar_matcher_free(runs[i].gm);
            free(runs[i].gmask);
            free(runs[i].hist);
        }
    }
    free(runs);
    free(batch);
    free(batch_req);
    free(logits);
    return rc;
}
