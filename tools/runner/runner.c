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

// One tdm_gen_run call: the requests, their run state and the step's batch,
// all allocated once before the step loop.
struct gen_loop {
    struct tdm_model *m;
    struct tdm_kv_cache *kv;
    struct tdm_gen_request *reqs;
    int n_reqs;
    const struct tdm_gen_opts *opts;
    struct tdm_gen_stats *stats;
    int chunk;      // prompt tokens of one request per step
    int budget_max; // tokens per step
    int vocab;
    int max_seqs; // sequences per step
    const int32_t *eos_ids;
    int num_eos;
    int32_t cfg_eos[TDM_MAX_EOS]; // the model's, where opts gives none
    struct req_run *runs;         // [n_reqs]
    struct tdm_batch_seq *batch;  // [max_seqs]
    int *batch_req;               // [max_seqs] the request of each batch entry
    float *logits;                // [max_seqs][vocab] f32, host
    double t0;                    // start of the step loop
    char *err;
    size_t errlen;
};

// Checks every request against the model and resets its outputs.
static int gen_validate(const struct tdm_model_config *c, struct tdm_gen_request *reqs, int n_reqs,
                        char *err, size_t errlen)
{
    int vocab = c->vocab_size;
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
    return TDM_OK;
}

// The step's buffers and each request's history, sampler and grammar state.
// On failure gen_cleanup frees what was allocated.
static int gen_setup(struct gen_loop *g)
{
    g->runs = calloc((size_t)g->n_reqs, sizeof *g->runs);
    g->batch = calloc((size_t)g->max_seqs, sizeof *g->batch);
    g->batch_req = calloc((size_t)g->max_seqs, sizeof *g->batch_req);
    g->logits = malloc((size_t)g->max_seqs * (size_t)g->vocab * sizeof(float));
    if (!g->runs || !g->batch || !g->batch_req || !g->logits)
        return tdm_seterr(g->err, g->errlen, TDM_ENOMEM, "runner: out of memory");
    for (int i = 0; i < g->n_reqs; i++) {
        struct tdm_gen_request *q = &g->reqs[i];
        struct req_run *r = &g->runs[i];
        int rc;
        tdm_kv_seq_init(&r->seq);
        r->hist = malloc(((size_t)q->n_prompt + (size_t)q->max_tokens) * sizeof(int32_t));
        if (r->hist == NULL ||
            tdm_sampler_new(&r->sampler, &q->params, g->vocab, q->prompt, (size_t)q->n_prompt,
                            g->eos_ids, g->num_eos) != TDM_OK)
            return tdm_seterr(g->err, g->errlen, TDM_ENOMEM, "runner: out of memory");
        memcpy(r->hist, q->prompt, (size_t)q->n_prompt * sizeof(int32_t));
        if (q->params.constraint != TDM_CONSTRAINT_NONE &&
            (rc = grammar_setup(r, q, i, g->opts->grammar_vocab, g->eos_ids, g->num_eos, g->err,
                                g->errlen)) != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

// Fills the step's batch: each running request in order gets its decode
// token or its next prompt chunk while the step has rows and token budget;
// waiting requests whose join_step has come start (matching the prefix cache
// first). Sets *nb and whether any entry prefills.
static int gen_schedule(struct gen_loop *g, int step, int *nb_out, bool *has_prefill)
{
    int nb = 0, budget = g->budget_max;
    *has_prefill = false;
    for (int i = 0; i < g->n_reqs && nb < g->max_seqs && budget > 0; i++) {
        struct tdm_gen_request *q = &g->reqs[i];
        struct req_run *r = &g->runs[i];
        if (r->state == REQ_DONE || q->join_step > step)
            continue;
        if (r->state == REQ_WAITING) {
            r->state = REQ_RUNNING;
            if (q->use_prefix_cache)
                q->num_cached_tokens = tdm_kv_match_prefix(g->kv, &r->seq, q->prompt, q->n_prompt);
            r->computed = r->seq.num_tokens;
        }
        int take;
        enum tdm_logits_mode lm;
        if (r->computed < q->n_prompt) {
            take = q->n_prompt - r->computed;
            if (take > g->chunk)
                take = g->chunk;
            if (take > budget)
                take = budget;
            lm = r->computed + take == q->n_prompt ? TDM_LOGITS_LAST : TDM_LOGITS_NONE;
            *has_prefill = true;
        } else {
            take = 1;
            lm = TDM_LOGITS_LAST;
        }
        int rc = tdm_kv_reserve(g->kv, &r->seq, r->computed + take);
        if (rc != TDM_OK)
            return tdm_seterr(g->err, g->errlen, rc,
                              "runner: request %d: no KV blocks for %d tokens", i,
                              r->computed + take);
        g->batch[nb] = (struct tdm_batch_seq){.tokens = r->hist + r->computed,
                                              .n_tokens = take,
                                              .start_pos = r->computed,
                                              .block_table = r->seq.block_table,
                                              .prompt_len = q->n_prompt,
                                              .logits = lm};
        g->batch_req[nb++] = i;
        budget -= take;
    }
    *nb_out = nb;
    return TDM_OK;
}

// Request i's grammar mask, applied to its logits row.
static int gen_mask(struct gen_loop *g, struct req_run *r, int i, float *lrow)
{
    double tm = tdm_now();
    const struct tdm_grammar_vocab *gv = g->opts->grammar_vocab;
    int mrc = tdm_grammar_matcher_fill_mask(r->gm, r->gmask, tdm_grammar_mask_words(gv));
    if (mrc != TDM_OK) {
        // As the engine: no mask, no unconstrained draw.
        char msg[160];
        int code = tdm_grammar_mask_error(mrc, msg, sizeof msg);
        return tdm_seterr(g->err, g->errlen, code, "runner: request %d: %s", i, msg);
    }
    tdm_grammar_mask_apply(r->gmask, tdm_grammar_vocab_size(gv), lrow, g->vocab, r->gend, r->n_gend,
                           tdm_grammar_matcher_accepts_eos(r->gm));
    g->stats->num_masks++;
    g->stats->mask_s += tdm_now() - tm;
    return TDM_OK;
}

// The grammar follows request i's token tok (which did not stop it); sets
// *complete where the grammar ended the request without an ending id.
static int gen_follow_grammar(struct gen_loop *g, struct req_run *r, int i, int32_t tok,
                              bool *complete)
{
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
            int rc = tdm_grammar_accept_error(arc, tok, msg, sizeof msg);
            return tdm_seterr(g->err, g->errlen, rc, "runner: request %d: %s", i, msg);
        }
        *complete = true;
    } else if (tdm_grammar_matcher_is_done(r->gm) && !tdm_sampler_eos_ends(r->sampler)) {
        *complete = true;
    }
    return TDM_OK;
}

// Samples request i's next token from its logits row lrow (masked first when
// constrained), records it and finishes the request when it ends (*done + 1).
static int gen_sample(struct gen_loop *g, int i, float *lrow, int *done)
{
    struct tdm_gen_request *q = &g->reqs[i];
    struct req_run *r = &g->runs[i];
    int rc;
    if (q->logits_out != NULL)
        memcpy(q->logits_out + (size_t)q->n_out * (size_t)g->vocab, lrow,
               (size_t)g->vocab * sizeof(float));
    if (r->gm != NULL && (rc = gen_mask(g, r, i, lrow)) != TDM_OK)
        return rc;
    int32_t tok = tdm_sampler_sample(r->sampler, lrow, NULL);
    r->hist[q->n_prompt + q->n_out] = tok;
    q->out_ids[q->n_out++] = tok;
    double now = tdm_now() - g->t0;
    if (q->n_out == 1)
        q->first_token_s = now;
    q->finish_s = now;
    g->stats->generated_tokens++;
    bool stop = tdm_sampler_is_stop(r->sampler, tok);
    bool complete = false; // the grammar ended it without an ending id
    if (r->gm != NULL && !stop && (rc = gen_follow_grammar(g, r, i, tok, &complete)) != TDM_OK)
        return rc;
    if (stop || complete || q->n_out == q->max_tokens) {
        q->stopped = stop || complete;
        finish(g->kv, r);
        (*done)++;
    }
    return TDM_OK;
}

// One step: schedule, forward, then commit each entry's KV and sample the
// entries that asked for logits; *done counts the finished requests.
static int gen_step(struct gen_loop *g, int step, int *done)
{
    struct tdm_gen_stats *stats = g->stats;
    int nb = 0, rc;
    bool has_prefill = false;
    if ((rc = gen_schedule(g, step, &nb, &has_prefill)) != TDM_OK)
        return rc;
    if (nb == 0)
        return TDM_OK; // every remaining request joins at a later step

    double ts = tdm_now();
    rc = tdm_model_forward(g->m, g->kv, g->batch, nb, g->logits);
    if (rc != TDM_OK)
        return tdm_seterr(g->err, g->errlen, rc, "runner: forward failed at step %d", step);
    int row = 0;
    for (int b = 0; b < nb; b++) {
        int i = g->batch_req[b];
        struct tdm_gen_request *q = &g->reqs[i];
        struct req_run *r = &g->runs[i];
        r->computed += g->batch[b].n_tokens;
        if (g->batch[b].logits == TDM_LOGITS_NONE) {
            tdm_kv_commit(g->kv, &r->seq, r->hist, r->computed);
            stats->prefill_tokens += g->batch[b].n_tokens;
            continue;
        }
        if (r->computed <= q->n_prompt)
            stats->prefill_tokens += g->batch[b].n_tokens;
        else
            stats->decode_tokens += 1;
        tdm_kv_commit(g->kv, &r->seq, r->hist, r->computed);
        float *lrow = g->logits + (size_t)row * (size_t)g->vocab;
        row++;
        if ((rc = gen_sample(g, i, lrow, done)) != TDM_OK)
            return rc;
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
    return TDM_OK;
}

// Releases every request's KV and frees the run state and step buffers.
static void gen_cleanup(struct gen_loop *g)
{
    if (g->runs != NULL) {
        for (int i = 0; i < g->n_reqs; i++) {
            finish(g->kv, &g->runs[i]);
            tdm_sampler_free(g->runs[i].sampler);
            tdm_grammar_matcher_free(g->runs[i].gm);
            free(g->runs[i].gmask);
            free(g->runs[i].hist);
        }
    }
    free(g->runs);
    free(g->batch);
    free(g->batch_req);
    free(g->logits);
}

int tdm_gen_run(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_gen_request *reqs,
                int n_reqs, const struct tdm_gen_opts *opts, struct tdm_gen_stats *stats, char *err,
                size_t errlen)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    const struct tdm_model_opts *mo = tdm_model_opts(m);
    struct tdm_gen_opts defaults;
    struct tdm_gen_stats st_local;
    int rc;

    if (opts == NULL) {
        tdm_gen_opts_default(&defaults);
        opts = &defaults;
    }
    if (stats == NULL)
        stats = &st_local;
    memset(stats, 0, sizeof *stats);
    if (n_reqs <= 0 || reqs == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "runner: no requests");
    struct gen_loop g = {
        .m = m,
        .kv = kv,
        .reqs = reqs,
        .n_reqs = n_reqs,
        .opts = opts,
        .stats = stats,
        .chunk = opts->chunk > 0 ? opts->chunk : 256,
        .budget_max = opts->max_step_tokens > 0 && opts->max_step_tokens < mo->max_batch_tokens
                          ? opts->max_step_tokens
                          : mo->max_batch_tokens,
        .vocab = c->vocab_size,
        .max_seqs = mo->max_batch_seqs,
        .eos_ids = opts->eos_ids,
        .num_eos = opts->num_eos,
        .err = err,
        .errlen = errlen,
    };
    if (g.eos_ids == NULL) {
        for (int i = 0; i < c->num_eos_token_ids; i++)
            g.cfg_eos[i] = c->eos_token_ids[i];
        g.eos_ids = g.cfg_eos;
        g.num_eos = c->num_eos_token_ids;
    }
    if ((rc = gen_validate(c, reqs, n_reqs, err, errlen)) != TDM_OK)
        return rc;
    if ((rc = gen_setup(&g)) == TDM_OK) {
        g.t0 = tdm_now();
        int done = 0;
        for (int step = 0; done < n_reqs && rc == TDM_OK; step++)
            rc = gen_step(&g, step, &done);
    }
    gen_cleanup(&g);
    return rc;
}
