// SPDX-License-Identifier: Apache-2.0
// worker_generate: the worker's OpenAI generation path (see worker.h): parse,
// chat template, tokenize and context checks (common/edge/openai's tdm_oai_call)
// -> one engine request per choice -> read the engine's output streams into
// the choices' assemblers (incremental detokenizer, stop-string matcher) ->
// SSE chunks (common/edge/openai's tdm_oai_http_stream, with this file's engine pump)
// or one body.
// Invariants: an HTTP thread never touches the model or the KV cache, only the
// engine's queues; every engine request a handler submitted is aborted (if
// still running) and released before the handler returns, so a client that
// goes away never leaves KV blocks behind; a bad request is answered on its own
// thread and never reaches the engine.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "engine.h"
#include "http.h"
#include "openai.h"
#include "openai_http.h"
#include "tokenizer.h"
#include "trace.h"
#include "worker_impl.h"

// ---- generation -------------------------------------------------------------------------
// One call = the request's choices (common/edge/openai: tokens -> text, stop
// strings, logprobs, finish) and one engine request per choice behind them;
// common/edge/openai's openai_http writes the stream. A failure is answered by
// tdm_oai_error_from_err / tdm_oai_http_fail, as the router answers it (a full
// waiting queue and a draining server are 503 with Retry-After).
struct call {
    struct tdm_worker *s;
    struct tdm_http_conn *conn;
    struct tdm_oai_call oai;
    struct tdm_engine_request **reqs; // [oai.n_choices]; NULL once released
    bool client_gone;
    bool finished0;                 // choice 0's engine finish was read: times0 is valid
    struct tdm_engine_times times0; // choice 0's phases, for the trace
};

// Consumes one engine chunk into choice i (common/edge/openai's shared step). A
// stop string that completes aborts the engine request (counted as
// finished_reason "stop").
static int take_chunk(struct call *k, size_t i, const struct tdm_engine_chunk *c)
{
    const struct tdm_oai_gen_chunk g = {
        .tokens = c->tokens,
        .n = c->n > 0 ? (size_t)c->n : 0,
        .logprobs = c->logprobs,
        .top = c->top,
        .num_top = c->num_top,
        .prompt_logprobs = c->prompt_logprobs,
        .finished = c->finished,
        .reason = c->reason,
        .stop_token = c->stop_token,
        .error = c->error,
        .message = c->message,
    };
    bool stopped = false;
    if (i == 0 && c->finished && !k->finished0) {
        k->finished0 = true;
        tdm_engine_request_times(k->reqs[0], &k->times0);
    }
    if (tdm_oai_call_take(&k->oai, i, &g, tdm_tok_eos_id(k->s->text.tok), &k->s->text.gen,
                          &stopped) != TDM_OK)
        return TDM_ENOMEM;
    if (stopped)
        tdm_engine_abort(k->s->engine, k->reqs[i], TDM_FINISH_STOP);
    return TDM_OK;
}

// Aborts what still runs and drops every handle (KV frees at the engine's next step).
static void release_all(struct call *k, enum tdm_finish why)
{
    for (size_t i = 0; k->reqs && i < k->oai.n_choices; i++) {
        if (k->reqs[i]) {
            if (!k->oai.choices[i].done)
                tdm_engine_abort(k->s->engine, k->reqs[i], why);
            tdm_engine_request_release(k->reqs[i]);
            k->reqs[i] = NULL;
        }
    }
}

static void call_fini(struct call *k)
{
    release_all(k, TDM_FINISH_ABORT);
    free(k->reqs);
    tdm_oai_call_fini(&k->oai);
}

// Submits one engine request per choice. On failure answers nothing; e is set.
static int submit_all(struct call *k, double arrival, struct tdm_oai_error *e)
{
    struct tdm_worker *s = k->s;
    const struct tdm_oai_request *rq = &k->oai.req;
    size_t n = (size_t)rq->n;
    k->reqs = calloc(k->oai.n_choices ? k->oai.n_choices : 1, sizeof *k->reqs);
    if (k->reqs == NULL)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    // The whole request is admitted against the waiting-queue bound before any
    // of it starts (n x prompts sequences), so a heavy request fails alone and
    // at once instead of filling the queue for everyone (issue 11, part 3).
    char aerr[256];
    int arc = tdm_engine_admit(s->engine, (int)k->oai.n_choices, aerr, sizeof aerr);
    if (arc != TDM_OK)
        return tdm_oai_error_from_err(e, arc, aerr);
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        const struct tdm_oai_tokenized_prompt *p = &k->oai.prompts[k->oai.choices[i].prompt_idx];
        struct tdm_engine_request_params ep;
        tdm_engine_request_params_default(&ep);
        char id[128];
        snprintf(id, sizeof id, "%s-%zu", k->oai.resp.id, i);
        ep.id = id;
        ep.prompt = p->ids;
        ep.n_prompt = (int)p->n;
        ep.sampling = rq->sampling;
        // vLLM gives the i-th of n sequences the seed + i, so choices differ but
        // each is reproducible.
        if (ep.sampling.has_seed)
            ep.sampling.seed += (uint64_t)(i % n);
        ep.max_tokens = p->max_tokens;
        ep.eos_ids = s->eos_ids;
        ep.num_eos = s->num_eos;
        ep.arrival_time = arrival;
        ep.params_n = rq->n;
        ep.priority = rq->priority;
        ep.cache_salt = rq->cache_salt;
        int plp = tdm_oai_call_prompt_lp(&k->oai, i);
        ep.want_prompt_logprobs = plp >= 0;
        ep.prompt_top_logprobs = plp >= 0 ? plp : 0;
        char err[512];
        int rc = tdm_engine_submit(s->engine, &ep, &k->reqs[i], err, sizeof err);
        if (rc != TDM_OK) {
            k->reqs[i] = NULL;
            release_all(k, TDM_FINISH_ABORT);
            // The engine's message for a full queue names --max-waiting; the
            // router answers the same failure with the same body.
            return tdm_oai_error_from_err(e, rc,
                                          rc == TDM_ECLOSED ? "The server is shutting down." : err);
        }
    }
    return TDM_OK;
}

// Reads engine output for every unfinished choice; blocks briefly when none
// had anything. Returns the number of choices that progressed, -2 on ENOMEM.
// (The call's token source for tdm_oai_http_stream.)
static int pump(void *arg)
{
    struct call *k = arg;
    int progressed = 0, active = 0;
    for (size_t i = 0; i < k->oai.n_choices; i++)
        active += !k->oai.choices[i].done;
    bool waited = false;
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct tdm_oai_asm *a = &k->oai.choices[i];
        if (a->done)
            continue;
        // With one choice block on its stream; with several poll them and block
        // a little on the first so the loop does not spin.
        double wait = 0;
        if (!waited) {
            wait = active == 1 ? 1.0 : 0.002;
            waited = true;
        }
        struct tdm_engine_chunk c;
        int rc = tdm_engine_stream_next(k->reqs[i], wait, &c);
        if (rc == TDM_ETIMEDOUT)
            continue;
        if (rc == TDM_ECLOSED) { // finish already taken (should not happen)
            a->done = true;
            continue;
        }
        if (take_chunk(k, i, &c) != TDM_OK)
            return -2;
        progressed++;
    }
    return progressed;
}

// The request's llm_request span (vLLM's name and attributes) with the engine
// phases of choice 0 as children; emitted once the call ended.
static void trace_call(struct call *k, struct tdm_span *span)
{
    if (!span->recording)
        return;
    tdm_oai_trace_attrs(span, &k->oai);
    if (k->finished0) {
        struct tdm_trace_phases ph = {k->times0.arrival, k->times0.first_scheduled,
                                      k->times0.first_token, k->times0.last_token, "prefill"};
        tdm_tracer_emit_phases(k->s->tracer, span, &ph);
        if (k->times0.first_token > 0)
            tdm_span_attr_double(span, "gen_ai.latency.time_to_first_token",
                                 k->times0.first_token - span->start);
    }
    span->end = tdm_now();
    tdm_span_attr_double(span, "gen_ai.latency.e2e", span->end - span->start);
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(&k->oai);
    if (bad)
        tdm_span_error(span, bad->message);
    else if (k->client_gone)
        tdm_span_error(span, "client disconnected");
    tdm_oai_http_trace_status(span, k->conn);
    tdm_tracer_emit(k->s->tracer, span);
}

void worker_handle_generate(struct tdm_worker *s, struct tdm_http_conn *c, enum tdm_oai_kind kind)
{
    double arrival = tdm_now();
    struct call k;
    memset(&k, 0, sizeof k);
    k.s = s;
    k.conn = c;
    // The client's traceparent continues here (a malformed one starts a new trace).
    struct tdm_span span = {.recording = false};
    if (s->tracer) {
        struct tdm_trace_ctx parent;
        tdm_oai_http_trace_ctx(c, &parent);
        tdm_span_begin(&span, s->tracer, &parent, "llm_request", TDM_SPAN_SERVER, arrival);
    }
    if (!tdm_oai_http_call_start(c, &k.oai, kind, &s->info, s->text.tok, s->text.chat,
                                 s->text.chat_err))
        goto out; // answered: an error, or echo only
    struct tdm_oai_error e;
    if (submit_all(&k, arrival, &e) != TDM_OK) {
        tdm_oai_http_error(c, &e);
        tdm_span_error(&span, e.message);
        goto out;
    }
    k.oai.stream_interval = s->cfg.stream_interval;
    // Streams probe the client after a second without tokens (queued, long prefill).
    if (k.oai.req.stream)
        k.client_gone = tdm_oai_http_stream(c, &k.oai, pump, &k, 1.0) == TDM_ECLOSED;
    else
        k.client_gone = tdm_oai_http_collect(c, &k.oai, pump, &k, NULL) == TDM_ECLOSED;
    // One line per request; finish=abort when the client went away.
    struct tdm_oai_usage u;
    tdm_oai_call_usage(&k.oai, &u);
    const char *finish = k.client_gone ? "abort" : "-";
    if (!k.client_gone && k.oai.n_choices && k.oai.choices[0].finish != TDM_FINISH_NONE)
        finish = tdm_finish_name(k.oai.choices[0].finish);
    if (s->cfg.log_requests)
        TDM_LOG_INFO(WORKER_MOD,
                     "req=%s done choices=%zu prompt_tokens=%d completion_tokens=%d finish=%s",
                     k.oai.resp.id, k.oai.n_choices, u.prompt_tokens, u.completion_tokens, finish);
out:
    trace_call(&k, &span);
    call_fini(&k);
}
