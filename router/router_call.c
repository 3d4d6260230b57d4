// SPDX-License-Identifier: Apache-2.0
// router_call: one completions or chat call through the router. Tokenized and
// routed (control.h), each choice gets an upstream stream on the routed decode
// worker (GenerateRequest; with P/D a PrefillRequest first), read by the
// call's HTTP worker thread (pump) into common/edge/openai's assemblers, so text
// through the router equals text from the decode worker alone. Attempts run
// under one retry budget (retry.h); a decode worker lost mid-stream is
// replaced and the stream migrated with the tokens already sent.

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.h"
#include "core.h"
#include "http.h"
#include "kv_cache.h"
#include "metrics.h"
#include "openai.h"
#include "openai_http.h"
#include "pd_codec.h"
#include "retry.h"
#include "router_impl.h"
#include "router_stream.h"
#include "tokenizer.h"
#include "trace.h"
#include "transport.h"

#define MOD "router"
#define DECODE_ATTEMPTS 3 // routes per request in all (retry.h)
#define MAX_MIGRATIONS 2  // times one request's streams may move to another decode worker

// ---- one API call ------------------------------------------------------------------------------
// Choice i of the call: its assembler in k->oai and its upstream stream.
struct choice {
    struct tdm_oai_asm *a; // &k->oai.choices[i]: tokens -> text, stop strings, logprobs, finish
    struct rstream *st;    // registered upstream stream, NULL when not started
    bool upstream_done;    // the decode worker sent its finish (or was cancelled/lost)
    bool got_chunk;        // any chunk arrived (phase times, first token)
    double last_token_at;  // for the inter-token histogram
    int32_t *got;          // [n_got] every token received from upstream, in order: what a
    size_t n_got, cap_got; // migrated stream resumes after (resume_tokens)
    size_t upstream_base;  // n_got when the current upstream was asked (its first_index 0)
    bool gap;              // a chunk did not start where the tokens received end (lost
                           // in transit): the stream cannot go on from this upstream
    bool migrate;          // its decode worker was lost: continue it elsewhere (pump)
    Tandem__TokenChunk **spare; // [spare_cap] swapped with its stream's queue by pump, which
    size_t spare_cap;           // then reads the n_batch chunks in it (else empty)
    size_t n_batch;
    bool overflow; // the stream's queue had overflowed when pump took it
};

struct call {
    struct tdm_router_server *s;
    struct tdm_http_conn *conn;
    struct tdm_oai_call oai; // request, prompts, choices' assemblers (common/edge/openai)
    struct choice *choices;  // [oai.n_choices]
    bool client_gone;
    double arrival;
    struct tdm_router_route route;
    bool routed;
    char decode_url[300];
    char phases[512];        // the x-tandem-phases header value
    bool lost;               // the decode worker was lost mid-request
    bool busy;               // the decode worker refused it as busy (EBUSY) before any token
    char busy_why[256];      // its message
    bool never_fits;         // more sequences than the worker's waiting-queue bound (400)
    struct tdm_router_flow_ticket ticket; // flow control's admission (its token until routed)
    bool started;            // past start_with_retries: tokens may have reached the client
    int migrations;          // times its streams moved to another decode worker
    uint64_t lost_ids[MAX_MIGRATIONS]; // the decode workers its streams were lost on: a
                                       // migration avoids every one, not only the last
    char migrating_why[320];           // why the streams being migrated were lost (logged once)
    char gap_why[320];                 // the first gap of a choice's tokens (take_chunk)
    const char *session;
    pthread_cond_t cv; // signalled (under s->mu) when a chunk for this call arrives

    // The trace: llm_request (parent: the client's traceparent), and the
    // current attempt's span, the parent of the decode worker's spans. When
    // tracing is off a valid client traceparent is passed on unchanged.
    struct tdm_span span, attempt;
    int n_attempts;
    double first_token_at;       // first token of choice 0 arrived
    struct tdm_trace_ctx client; // valid when client_valid
    bool client_valid;
};

// Sends the choice's Cancel, waiting up to timeout_s for a connection (0: only
// into a connection that is up now).
static void send_cancel_within(struct call *k, struct choice *ch, double timeout_s)
{
    if (ch->st == NULL || ch->upstream_done)
        return;
    Tandem__Cancel m = TANDEM__CANCEL__INIT;
    m.request_id = ch->st->request_id;
    m.to_instance = ch->st->instance;
    char err[256];
    tdm_pd_send(k->s->outbox, k->decode_url, TDM_NET_CANCEL, &m.base, NULL, 0, timeout_s, err,
                sizeof err);
    ch->upstream_done = true;
}

static void send_cancel(struct call *k, struct choice *ch)
{
    send_cancel_within(k, ch, 0.2);
}

static void note_phases(struct call *k, const Tandem__TokenChunk *m)
{
    if (m->phases == NULL || k->phases[0])
        return;
    const Tandem__PhaseTimes *p = m->phases;
    snprintf(k->phases, sizeof k->phases,
             "decision=%s; decode=%s; prefill=%s; route=%.6f; queue=%.6f; prefill_s=%.6f; "
             "transfer=%.6f; transfer_exposed=%.6f; first_token=%.6f",
             tdm_router_decision_name(k->route.decision), k->route.decode.name,
             m->prefilled_by && m->prefilled_by[0] ? m->prefilled_by : "local",
             k->route.routed_at - k->arrival, p->queue, p->prefill, p->transfer_total, p->transfer,
             p->first_token);
    struct tdm_router_metrics *rm = k->s->rm;
    bool remote = m->prefilled_by && m->prefilled_by[0];
    if (rm && remote) {
        // The whole transfer (it overlaps the prefill) and the part the request
        // waited for, each under its own name (issue 14: the old metric timed
        // only the wait and read 0 for every request).
        tdm_metrics_histogram_observe(rm->kv_transfer, p->transfer_total);
        tdm_metrics_histogram_observe(rm->kv_transfer_exposed, p->transfer);
    }
    tdm_router_control_prefill_outcome(k->s->ctl, &k->route, remote);
}

// Consumes one upstream chunk into the choice (router_stream.c), with the
// metrics it feeds: time to first token and inter-token latency.
static int take_chunk(struct call *k, struct choice *ch, const Tandem__TokenChunk *m)
{
    struct tdm_router_metrics *rm = k->s->rm;
    // A chunk begins where this upstream's tokens so far end; one that does
    // not says tokens were lost between the worker and here: none of it is
    // taken (the client would get a stream with a hole), and pump treats the
    // upstream as lost.
    size_t expected = ch->n_got - ch->upstream_base;
    if (m->first_index < 0 || (size_t)m->first_index != expected) {
        if (!ch->gap)
            snprintf(k->gap_why, sizeof k->gap_why,
                     "tokens were lost between decode worker %s and the router (a chunk began "
                     "at token %d of its stream, %zu had arrived)",
                     k->route.decode.name, (int)m->first_index, expected);
        ch->gap = true;
        return TDM_OK;
    }
    note_phases(k, m);
    double now = tdm_now();
    if (m->n_tokens > 0) {
        if (k->first_token_at == 0)
            k->first_token_at = now;
        if (!ch->got_chunk && rm)
            tdm_metrics_histogram_observe(rm->ttft, now - k->arrival);
        else if (rm && ch->last_token_at > 0)
            tdm_metrics_histogram_observe(rm->itl, (now - ch->last_token_at) / (double)m->n_tokens);
        ch->last_token_at = now;
    }
    ch->got_chunk = true;
    if (m->n_tokens > 0) {
        if (tdm_grow(&ch->got, &ch->cap_got, ch->n_got + m->n_tokens, sizeof *ch->got, 64) !=
            TDM_OK)
            return TDM_ENOMEM;
        memcpy(ch->got + ch->n_got, m->tokens, m->n_tokens * sizeof *ch->got);
        ch->n_got += m->n_tokens;
    }
    struct tdm_router_take r;
    if (tdm_router_take_chunk(&k->oai, (size_t)(ch->a - k->oai.choices), m,
                              tdm_tok_eos_id(k->s->text.tok), &k->s->text.gen, &r) != TDM_OK)
        return TDM_ENOMEM;
    if (r.stopped)
        send_cancel(k, ch); // the decode worker stops generating (and frees the KV)
    if (r.upstream_done)
        ch->upstream_done = true;
    // A worker that is loading or draining refused it before any token:
    // another decode worker can take it (handle_generate).
    if (r.refused)
        k->lost = true;
    // One whose queue was full (its report was stale when the call was
    // routed) or that had no thread for it: busy, not lost (start_with_retries).
    if (r.busy && !k->busy) {
        k->busy = true;
        snprintf(k->busy_why, sizeof k->busy_why, "%s", ch->a->message);
    }
    return TDM_OK;
}

// The decode worker of this call is alive (router_stream.c's verdict on its
// last load report and instance, read fresh: one registry entry).
static bool upstream_alive(struct call *k, const struct choice *ch, char *why, size_t cap)
{
    // The router itself was stopped (SIGSTOP, starved) and its poller has not
    // run since: the reports it did not read say nothing of the worker (the
    // fault suite's router SIGSTOP failed every stream here). No verdict until
    // the poller notes the stall; then silence counts from its return. The
    // facts are read after the tick, so none is older than it (read before,
    // a report the inbox processed meanwhile was missed: a live worker looked
    // silent after a short router stop).
    double now = tdm_now(), tick = atomic_load(&k->s->poll_tick);
    if (tick > 0 && now - tick > k->s->o.load_interval + k->s->o.liveness_timeout)
        return true;
    struct tdm_router_liveness live;
    router_live_get(k->s, k->route.decode.id, &live);
    pthread_mutex_lock(&k->s->mu);
    uint64_t st_inst = ch->st->instance;
    double heard = ch->st->heard;
    pthread_mutex_unlock(&k->s->mu);
    enum tdm_router_upstream v = tdm_router_upstream_check(
        now, ch->st->started, live.heard_at, k->s->o.liveness_timeout, live.instance, st_inst,
        atomic_load(&k->s->resumed_at), live.unanswered_since);
    // A stream whose tokens keep arriving is alive, whatever its worker's
    // load reports (late on a loaded host): busy is not dead.
    if (v == TDM_ROUTER_UPSTREAM_SILENT && now - heard <= k->s->o.liveness_timeout)
        v = TDM_ROUTER_UPSTREAM_ALIVE;
    switch (v) {
    case TDM_ROUTER_UPSTREAM_SILENT:
        snprintf(why, cap, "decode worker %s stopped answering", k->route.decode.name);
        return false;
    case TDM_ROUTER_UPSTREAM_RESTARTED:
        snprintf(why, cap, "decode worker %s restarted", k->route.decode.name);
        return false;
    default:
        return true;
    }
}

static int migrate_lost(struct call *k);

// Reads upstream chunks for every unfinished choice, waiting up to `wait`
// seconds when none had any: the connection reader that queues a chunk wakes
// this thread at once (on_tokens). Each choice's queue is taken whole in one
// turn of the lock and all of it is fed to the assembler, so the caller writes
// every ready token in one event. Checks liveness (of choices that got
// nothing this round: a stream whose tokens arrive is alive) and the deadline.
// Returns the number of chunks taken, -2 on ENOMEM.
static int pump(struct call *k, double wait)
{
    struct tdm_router_server *s = k->s;
    int progressed = 0;
    double until = tdm_now() + wait;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        bool any = false;
        for (size_t i = 0; i < k->oai.n_choices; i++) {
            struct choice *ch = &k->choices[i];
            if (!ch->a->done && ch->st && (ch->st->qn > 0 || ch->st->overflow))
                any = true;
        }
        double left = until - tdm_now();
        if (any || left <= 0)
            break;
        tdm_cond_wait_for(&k->cv, &s->mu, left);
    }
    // In the same turn of the lock, each stream's queue and its choice's
    // empty spare change places: ch->spare then holds the batch to read.
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        ch->overflow = false;
        if (ch->n_batch > 0 || ch->a->done || ch->st == NULL ||
            (ch->st->qn == 0 && !ch->st->overflow))
            continue; // (n_batch > 0: left by a pump that ran out of memory)
        struct rstream *st = ch->st;
        Tandem__TokenChunk **batch = st->q;
        size_t batch_cap = st->qcap;
        ch->n_batch = st->qn;
        ch->overflow = st->overflow;
        st->q = ch->spare;
        st->qcap = ch->spare_cap;
        st->qn = 0;
        ch->spare = batch;
        ch->spare_cap = batch_cap;
    }
    pthread_mutex_unlock(&s->mu);
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        Tandem__TokenChunk **batch = ch->spare;
        size_t n_batch = ch->n_batch;
        bool overflow = ch->overflow;
        ch->n_batch = 0;
        int rc = TDM_OK;
        for (size_t j = 0; j < n_batch; j++) {
            // After the finish, or a gap: dropped, as Cancel would.
            if (rc == TDM_OK && !ch->a->done && !ch->gap) {
                rc = take_chunk(k, ch, batch[j]);
                progressed++;
            }
            tandem__token_chunk__free_unpacked(batch[j], NULL);
        }
        if (rc != TDM_OK)
            return -2; // the later choices' batches are freed by call_fini
        if (ch->a->done || ch->st == NULL)
            continue;
        if (overflow && !ch->a->done) {
            tdm_oai_asm_fail(ch->a, TDM_ENOMEM, "router: stream queue overflow");
            send_cancel(k, ch);
        }
        if (ch->a->done)
            continue;
        char why[320];
        if (tdm_now() > k->route.deadline) {
            tdm_oai_asm_fail(ch->a, TDM_ETIMEDOUT, "the request's deadline passed");
            send_cancel(k, ch);
        } else if (atomic_load(&s->stopping)) {
            // Past the drain: the stream ends with an error event, not a cut.
            tdm_oai_asm_fail(ch->a, TDM_ECLOSED, "the router is shutting down");
            send_cancel(k, ch);
        } else if ((ch->gap && (k->started || ch->n_got == ch->upstream_base)) ||
                   (!ch->gap && n_batch == 0 && !upstream_alive(k, ch, why, sizeof why))) {
            // A gap after tokens were taken waits for the start (the stream then
            // moves with them, or fails); one before any is a lost attempt.
            if (ch->gap)
                snprintf(why, sizeof why, "%s", k->gap_why);
            // Silent is not always dead: a worker that was stopped (SIGSTOP, a
            // long GC-like stall) or cut off by a partition still holds the
            // request and resumes generating it for nobody until max_tokens,
            // KV and all (the fault suite found it). The Cancel is written into
            // the connection when one is up (timeout 0: a dead worker has none,
            // so the client's error event is not delayed) and is read as soon
            // as the worker hears again. A migrating stream cancels too.
            send_cancel_within(k, ch, 0.0);
            if (k->started && s->o.stream_migration && k->migrations < MAX_MIGRATIONS) {
                if (!k->migrating_why[0])
                    snprintf(k->migrating_why, sizeof k->migrating_why, "%s", why);
                ch->migrate = true;
            } else {
                tdm_oai_asm_fail(ch->a, TDM_ETRANSPORT, "%s", why);
                k->lost = true;
            }
        }
    }
    if (migrate_lost(k) < 0)
        return -2;
    return progressed;
}

// Cancels what still runs upstream and forgets the streams.
static void release_upstream(struct call *k)
{
    for (size_t i = 0; k->choices && i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        send_cancel(k, ch);
        router_stream_unregister(k->s, ch->st);
        ch->st = NULL;
    }
}

// The instance id to address a routed worker by, from its last report as of
// the route: only when that report is fresh (after a silence it may have
// restarted, and a message for the old instance would be dropped by the new
// one); else 0.
static uint64_t target_instance(const struct call *k, const struct tdm_router_target *t)
{
    return tdm_now() - t->heard_at > k->s->o.liveness_timeout ? 0 : t->instance;
}

// Registers a new upstream stream for choice i and sends its GenerateRequest
// to k->decode_url: the prompt, the sampling (the i-th of n gets seed + i, as
// vLLM), the prefill targets, and for a migrated stream (ch->n_got > 0 and
// resume) the tokens the client already has, prefilled locally.
static int send_choice(struct call *k, size_t i, uint64_t dec_inst, Tandem__PrefillTarget **targets,
                       size_t nt, bool resume, char *err, size_t errlen)
{
    struct tdm_router_server *s = k->s;
    struct tdm_oai_request *rq = &k->oai.req;
    size_t n = (size_t)rq->n;
    const struct tdm_router_route *r = &k->route;
    double left = r->deadline - tdm_now();
    struct choice *ch = &k->choices[i];
    const struct tdm_oai_tokenized_prompt *p = &k->oai.prompts[ch->a->prompt_idx];
    struct rstream *st = calloc(1, sizeof *st);
    if (st == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    snprintf(st->request_id, sizeof st->request_id, "%.48s-%zu-%016llx", k->oai.resp.id, i,
             (unsigned long long)tdm_net_new_instance_id());
    st->ep_id = r->decode.id;
    st->cv = &k->cv;
    st->instance = dec_inst;
    st->started = tdm_now();
    router_stream_register(s, st);
    ch->st = st;
    ch->upstream_done = false;
    ch->upstream_base = ch->n_got;
    ch->gap = false;

    struct tdm_sampling_params sp = rq->sampling;
    if (sp.has_seed)
        sp.seed += (uint64_t)(i % n); // vLLM: the i-th of n gets seed + i
    struct tdm_pd_sampling_msg sm;
    tdm_pd_sampling_to_proto(&sp, &sm);
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_net_inbox_url(s->inbox);
    me.instance = s->instance;
    g.request_id = st->request_id;
    g.reply_to = &me;
    g.to_instance = dec_inst;
    g.n_prompt = p->n;
    g.prompt = p->ids;
    g.sampling = &sm.msg;
    g.max_tokens = p->max_tokens;
    g.deadline_unix = (double)time(NULL) + (left > 0 ? left : 0);
    g.arrival_unix = (double)time(NULL);
    g.priority = k->oai.req.priority;
    g.cache_salt = k->oai.req.cache_salt ? k->oai.req.cache_salt : "";
    int plp = tdm_oai_call_prompt_lp(&k->oai, i);
    if (resume && ch->n_got > 0) {
        g.n_resume_tokens = ch->n_got;
        g.resume_tokens = ch->got;
    } else if (plp >= 0) {
        // Prompt logprobs: every prompt row's logits, computed where the
        // request decodes (a prefill worker sends only the first token's).
        g.want_prompt_logprobs = true;
        g.prompt_top_logprobs = plp;
    } else {
        g.n_prefill = nt;
        g.prefill = targets;
        g.local_fallback = true;
        // The list is already capped; the budget says so to the decode worker too.
        g.max_prefill_attempts = nt ? r->max_prefill_attempts : 0;
    }
    // The attempt span is the decode worker's parent; without tracing here the
    // client's own context goes on unchanged.
    char tp[TDM_TRACEPARENT_LEN + 1] = "";
    struct tdm_trace_ctx tc;
    if (k->attempt.recording)
        tdm_span_ctx(&k->attempt, &tc);
    else if (k->client_valid)
        tc = k->client;
    if (k->attempt.recording || k->client_valid) {
        tdm_trace_format(&tc, tp);
        g.traceparent = tp;
        g.tracestate = tc.tracestate;
    }
    int rc =
        tdm_pd_send(s->outbox, k->decode_url, TDM_NET_GENERATE, &g.base, NULL, 0, 1.0, err, errlen);
    if (rc != TDM_OK)
        ch->upstream_done = true; // never arrived: nothing to cancel
    return rc;
}

// The call as the routing policy sees it: its first prompt's length, the
// session, whether it is prefilled on its decode worker whatever the pd_mode
// (a choice asks prompt logprobs: a prefill worker computes only the last
// row's logits; the route is then decode-only, and counted so), and its
// cache_salt's chain root (the block hashes its workers cache it under).
static struct tdm_router_request route_ask(const struct call *k, const char *session)
{
    struct tdm_router_request q = {
        .num_prompt_tokens = k->oai.prompts[0].n,
        .session = session,
        .hash_root = k->oai.req.cache_salt
                         ? tdm_kv_salt_hash(k->oai.req.cache_salt, strlen(k->oai.req.cache_salt))
                         : 0};
    for (size_t i = 0; i < k->oai.n_choices && !q.decode_only; i++)
        q.decode_only = tdm_oai_call_prompt_lp(&k->oai, i) >= 0;
    return q;
}

// Sends one GenerateRequest per choice to the routed decode worker.
static int send_generates(struct call *k, char *err, size_t errlen)
{
    const struct tdm_router_route *r = &k->route;
    uint64_t dec_inst = target_instance(k, &r->decode);
    Tandem__PrefillTarget targets[TDM_ROUTER_MAX_PREFILL_CANDIDATES];
    Tandem__PrefillTarget *target_ptr[TDM_ROUTER_MAX_PREFILL_CANDIDATES];
    char target_urls[TDM_ROUTER_MAX_PREFILL_CANDIDATES][300];
    size_t nt = 0;
    if (r->decision == TDM_ROUTER_DECISION_PREFILL_DECODE) {
        for (size_t i = r->prefill_idx; i < r->n_prefill && nt < TDM_ROUTER_MAX_PREFILL_CANDIDATES;
             i++) {
            Tandem__PrefillTarget init = TANDEM__PREFILL_TARGET__INIT;
            targets[nt] = init;
            router_nng_url_of(r->prefill[i].host, r->prefill[i].nng_port, target_urls[nt],
                              sizeof target_urls[nt]);
            targets[nt].url = target_urls[nt];
            targets[nt].instance = target_instance(k, &r->prefill[i]);
            target_ptr[nt] = &targets[nt];
            nt++;
        }
    }
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        int rc = send_choice(k, i, dec_inst, target_ptr, nt, false, err, errlen);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

// Stream migration (issue 11, part 6; --stream-migration): the choices whose
// decode worker was lost (ch->migrate, set by pump) continue on another one,
// routed avoiding the lost worker. Each is sent with the tokens it already
// received as resume_tokens: the new worker computes prompt + those and its
// sampler replays them (history and RNG draws), so with batch-invariant
// output the client's stream goes on with exactly the tokens the lost worker
// would have sent; the assembler (stop strings, logprobs, usage) just keeps
// going. With nowhere to go, the choices fail as without migration. -2 on ENOMEM.
static int migrate_lost(struct call *k)
{
    struct tdm_router_server *s = k->s;
    size_t n_lost = 0;
    for (size_t i = 0; i < k->oai.n_choices; i++)
        n_lost += k->choices[i].migrate;
    if (n_lost == 0)
        return 0;
    // The call's choices share one decode worker: the ones whose liveness
    // check has not failed yet (checked a moment earlier) move with the rest.
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        if (!ch->migrate && !ch->a->done && !ch->upstream_done) {
            ch->migrate = true;
            send_cancel_within(k, ch, 0.0); // as its lost sibling's
            ch->upstream_done = true;
        }
    }
    k->lost_ids[k->migrations++] = k->route.decode.id;
    char old_name[TDM_ROUTER_NAME_MAX], err[256];
    snprintf(old_name, sizeof old_name, "%s", k->route.decode.name);
    const struct tdm_oai_tokenized_prompt *p0 = &k->oai.prompts[0];
    struct tdm_router_route nr;
    memset(&nr, 0, sizeof nr);
    double deadline = k->route.deadline; // the request's deadline does not restart
    // The lost worker reported, the new route held, the old one released: one
    // registry entry.
    struct tdm_router_request ask = route_ask(k, k->session);
    int rc = tdm_router_control_reroute(s->ctl, &k->route, p0->ids, &ask, k->lost_ids,
                                        (size_t)k->migrations, &nr, err, sizeof err);
    if (rc != TDM_OK) {
        for (size_t i = 0; i < k->oai.n_choices; i++) {
            struct choice *ch = &k->choices[i];
            if (!ch->migrate)
                continue;
            ch->migrate = false;
            tdm_oai_asm_fail(ch->a, TDM_ETRANSPORT,
                             "decode worker %s was lost and no other can continue the stream: %s",
                             old_name, err);
        }
        k->lost = true;
        return 0;
    }
    nr.deadline = deadline;
    k->route = nr;
    router_nng_url_of(k->route.decode.host, k->route.decode.nng_port, k->decode_url,
                      sizeof k->decode_url);
    uint64_t dec_inst = target_instance(k, &k->route.decode);
    size_t moved = 0;
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        if (!ch->migrate)
            continue;
        ch->migrate = false;
        router_stream_unregister(s, ch->st);
        ch->st = NULL;
        rc = send_choice(k, i, dec_inst, NULL, 0, true, err, sizeof err);
        if (rc == TDM_ENOMEM)
            return -2;
        if (rc != TDM_OK) {
            tdm_oai_asm_fail(ch->a, TDM_ETRANSPORT, "stream migration to %s failed: %s",
                             k->route.decode.name, err);
            k->lost = true;
            continue;
        }
        moved++;
    }
    if (moved > 0) // a move that took no stream is no migration
        tdm_metrics_counter_inc(s->m_migrations);
    TDM_LOG_WARN(MOD, "req=%s %s: %zu stream(s) migrated to %s", k->oai.resp.id, k->migrating_why,
                 moved, k->route.decode.name);
    k->migrating_why[0] = '\0';
    return 0;
}

// The session header the active config routes by: the decode profile's
// session-affinity-scorer headerName, else request.session_header (NULL: none).
static const char *session_header_of(const struct tdm_router_config *cfg)
{
    if (cfg == NULL)
        return NULL;
    if (cfg->decode_profile < cfg->n_profiles) {
        const struct tdm_router_profile *pr = &cfg->profiles[cfg->decode_profile];
        for (size_t i = 0; i < pr->n_refs; i++) {
            const struct tdm_router_plugin *pl = &cfg->plugins[pr->refs[i].plugin];
            if (pl->type == TDM_ROUTER_SESSION_AFFINITY_SCORER &&
                pl->params.session_affinity.header_name)
                return pl->params.session_affinity.header_name;
        }
    }
    return cfg->session_header;
}

// The request's session header value (the connection's; NULL when absent).
static const char *request_session(struct call *k)
{
    struct tdm_router_config *cfg =
        tdm_router_config_store_get(tdm_router_control_store(k->s->ctl), NULL);
    const char *sh = session_header_of(cfg);
    const char *session = sh ? tdm_http_header(k->conn, sh) : NULL;
    tdm_router_config_unref(cfg);
    return session;
}

// ---- attempts under one retry budget (retry.h) ------------------------------------------------
// Routes the call, avoiding the decode endpoints that already failed it, and
// sends its GenerateRequests. NO_ROUTE or UNREACHABLE set err; OK and
// UNREACHABLE leave the call routed (abandon_route gives an UNREACHABLE back).
static enum tdm_router_attempt_end start_attempt(struct call *k, const struct tdm_router_retry *b,
                                                 const char *session, char *err, size_t errlen)
{
    struct tdm_router_server *s = k->s;
    const struct tdm_oai_tokenized_prompt *p0 = &k->oai.prompts[0];
    memset(&k->route, 0, sizeof k->route);
    k->n_attempts++;
    struct tdm_span route;
    tdm_span_begin_child(&route, &k->span, "route", TDM_SPAN_INTERNAL, tdm_now());
    tdm_span_attr_int(&route, "tandem.attempt", k->n_attempts);
    struct tdm_router_request ask = route_ask(k, session);
    int rrc = tdm_router_control_route_avoiding(s->ctl, p0->ids, &ask, b->failed, b->n_failed,
                                                &k->route, err, errlen);
    route.end = tdm_now();
    if (rrc != TDM_OK) {
        tdm_span_error(&route, err);
        tdm_tracer_emit(s->tracer, &route);
        return TDM_ROUTER_ATTEMPT_NO_ROUTE;
    }
    tdm_span_attr_str(&route, "tandem.route.decision", tdm_router_decision_name(k->route.decision));
    tdm_span_attr_str(&route, "tandem.decode.endpoint", k->route.decode.name);
    tdm_tracer_emit(s->tracer, &route);
    k->routed = true;
    router_nng_url_of(k->route.decode.host, k->route.decode.nng_port, k->decode_url,
                      sizeof k->decode_url);
    // Known dead, so no send timeout to wait for: stale reports and no
    // connection, or not up (never heard from while the load poller's own
    // dials to it fail: a worker not started yet, a wrong nng port). A worker
    // not up is no candidate (policy.h), so that is only a link that went down
    // since the poller's last round. Its liveness and load are the route's
    // (the snapshot it was picked on): no registry entry here.
    double last = k->route.decode.heard_at;
    bool stale = last > 0 && tdm_now() - last > s->o.liveness_timeout &&
                 !tdm_net_connected(s->outbox, k->decode_url);
    bool never_up = tdm_router_endpoint_not_up(
        last, tdm_net_link_state(s->poll_outbox, k->decode_url, NULL, 0) == TDM_NET_LINK_DOWN);
    if (stale || never_up) {
        snprintf(err, errlen, "decode worker %s is not answering", k->route.decode.name);
        return TDM_ROUTER_ATTEMPT_UNREACHABLE;
    }
    // Admission of the whole request (n x prompts sequences) against the
    // worker's waiting-queue bound from its last report, before anything is
    // sent (issue 11): more than the bound can never fit (400, no retry);
    // more than the room left is overload, not death: another worker, else 503.
    const struct tdm_router_load *load = &k->route.decode.load;
    if (load->max_waiting > 0) {
        int want = (int)k->oai.n_choices;
        if (want > load->max_waiting) {
            k->never_fits = true;
            snprintf(err, errlen,
                     "%d sequences (n x prompts) exceed the waiting-queue bound (--max-waiting "
                     "%d)",
                     want, load->max_waiting);
            return TDM_ROUTER_ATTEMPT_BUSY;
        }
        if (want > 1 && load->waiting + want > load->max_waiting) {
            snprintf(err, errlen,
                     "The server is overloaded: the waiting queue is full (--max-waiting %d). "
                     "Retry later.",
                     load->max_waiting);
            return TDM_ROUTER_ATTEMPT_BUSY;
        }
    }
    tdm_span_begin_child(&k->attempt, &k->span, "attempt", TDM_SPAN_CLIENT, tdm_now());
    tdm_span_attr_int(&k->attempt, "tandem.attempt", k->n_attempts);
    tdm_span_attr_str(&k->attempt, "tandem.decode.endpoint", k->route.decode.name);
    tdm_span_attr_str(&k->attempt, "tandem.route.decision",
                      tdm_router_decision_name(k->route.decision));
    if (send_generates(k, err, errlen) != TDM_OK)
        return TDM_ROUTER_ATTEMPT_UNREACHABLE;
    tdm_router_control_route_sent(s->ctl, &k->route);
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(
        s->m_requests_by, tdm_router_decision_name(k->route.decision), k->route.decode.name));
    return TDM_ROUTER_ATTEMPT_OK;
}

static void add_phase_header(struct call *k)
{
    bool debug = k->s->o.debug_headers; // the worker's address and timings are opt-in
    if (debug && k->phases[0])
        tdm_http_add_header(k->conn, "x-tandem-phases", k->phases);
    if (!k->routed)
        return;
    if (debug)
        tdm_http_add_header(k->conn, "x-tandem-decode", k->route.decode.name);
    // Session affinity: the token that brings the client's next request back here.
    const char *sh = session_header_of(k->route.cfg);
    char token[2 * TDM_ROUTER_NAME_MAX];
    if (sh && tdm_router_session_token(k->route.decode.name, token, sizeof token) > 0)
        tdm_http_add_header(k->conn, sh, token);
}

// The call's token source for tdm_oai_http_stream.
static int stream_pump(void *arg)
{
    return pump(arg, 0.1);
}

static void run_stream(struct call *k)
{
    // Wait for the first chunk of choice 0 before the headers go out, so an
    // upstream failure before any token is a plain HTTP error and the phase
    // times make it into the response header.
    while (!k->choices[0].got_chunk && !k->choices[0].a->done) {
        if (pump(k, 0.1) < 0) {
            tdm_oai_http_errorf(k->conn, 500, NULL, "out of memory");
            return;
        }
        if (tdm_http_client_gone(k->conn)) {
            k->client_gone = true;
            return;
        }
    }
    const struct tdm_oai_asm *bad0 = tdm_oai_call_failed(&k->oai);
    if (bad0 && bad0->completion_tokens == 0 && tdm_oai_call_done(&k->oai)) {
        tdm_oai_http_fail(k->conn, bad0->error, bad0->message);
        return;
    }
    add_phase_header(k);
    k->oai.stream_interval = k->s->o.stream_interval;
    k->client_gone = tdm_oai_http_stream(k->conn, &k->oai, stream_pump, k, 0) == TDM_ECLOSED;
}

static void phase_header_hook(void *arg)
{
    add_phase_header(arg);
}

static void run_collect(struct call *k)
{
    k->client_gone =
        tdm_oai_http_collect(k->conn, &k->oai, stream_pump, k, phase_header_hook) == TDM_ECLOSED;
}

static void call_fini(struct call *k)
{
    tdm_router_control_admitted(k->s->ctl, &k->ticket); // never routed: the token goes back
    release_upstream(k);
    for (size_t i = 0; k->choices && i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        for (size_t j = 0; j < ch->n_batch; j++) // taken by a pump that ran out of memory
            tandem__token_chunk__free_unpacked(ch->spare[j], NULL);
        free(ch->got);
        free(ch->spare);
    }
    free(k->choices);
    tdm_oai_call_fini(&k->oai);
}

// Waits for choice 0's first chunk (or its end): until then nothing reached
// the client, so a decode worker lost in that window is replaced
// transparently. -2 on ENOMEM, else 0 (k->client_gone says if the client left).
static int await_first_chunk(struct call *k)
{
    while (!k->choices[0].got_chunk && !k->choices[0].a->done && !k->client_gone) {
        if (pump(k, 0.1) < 0)
            return -2;
        k->client_gone = tdm_http_client_gone(k->conn);
    }
    return 0;
}

// The one place a failed attempt is given up: its upstream streams cancelled
// and forgotten, the choices' finish state reset, the decode endpoint reported
// (passive health; tandem:router_upstream_errors_total), the loss and the
// retry counted, the route released.
static void abandon_route(struct call *k, enum tdm_router_attempt_end end, bool retrying,
                          const char *why)
{
    struct tdm_router_server *s = k->s;
    if (k->attempt.recording) {
        k->attempt.end = tdm_now();
        tdm_span_error(&k->attempt, why);
        tdm_tracer_emit(s->tracer, &k->attempt);
        k->attempt.recording = false;
    }
    release_upstream(k);
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        tdm_oai_asm_reset_finish(ch->a);
        ch->got_chunk = false;
        ch->n_got = 0;
        ch->upstream_done = true;
    }
    k->lost = k->busy = false;
    k->phases[0] = '\0';
    if (end == TDM_ROUTER_ATTEMPT_LOST)
        tdm_metrics_counter_inc(s->m_lost);
    if (end == TDM_ROUTER_ATTEMPT_UNREACHABLE) // never sent there: a fallback, not a pick
        tdm_router_control_route_unsent(s->ctl, &k->route);
    if (s->rm && retrying)
        tdm_router_metrics_retry(s->rm, k->route.decode.name, k->route.decode.role);
    if (end != TDM_ROUTER_ATTEMPT_BUSY) // busy is not dead: no health penalty
        tdm_router_control_route_done_report(s->ctl, &k->route, "error", TDM_ROUTER_OUTCOME_ERROR);
    else
        tdm_router_control_route_done(s->ctl, &k->route, "error");
    k->routed = false;
}

// Routes and starts the call, retrying within one budget of DECODE_ATTEMPTS
// routes. Returns true when the call streams (or its decode worker was lost
// or refused it as busy past the budget: the normal path then reports the
// worker's error), false when the call was answered here or the client left.
static bool start_with_retries(struct call *k)
{
    struct tdm_router_retry budget;
    tdm_router_retry_init(&budget, DECODE_ATTEMPTS);
    const char *session = request_session(k);
    k->session = session;
    for (;;) {
        char err[512];
        enum tdm_router_attempt_end end = start_attempt(k, &budget, session, err, sizeof err);
        // Routed and sent (its load counts on its endpoint, and it reached the
        // worker ahead of the next one), or not: flow control may dispatch the
        // next request.
        tdm_router_control_admitted(k->s->ctl, &k->ticket);
        uint64_t busy_ep = end == TDM_ROUTER_ATTEMPT_BUSY ? k->route.decode.id : 0;
        if (end == TDM_ROUTER_ATTEMPT_BUSY) {
            // Nothing was sent and the worker is fine: release the route
            // without a health penalty (busy is not dead).
            tdm_router_control_route_done(k->s->ctl, &k->route, "error");
            k->routed = false;
            if (k->never_fits) { // no worker could ever take it: the client's error
                tdm_oai_http_errorf(k->conn, 400, "n", "%s", err);
                return false;
            }
        }
        if (end == TDM_ROUTER_ATTEMPT_OK) {
            if (await_first_chunk(k) < 0) {
                tdm_oai_http_errorf(k->conn, 500, NULL, "out of memory");
                return false;
            }
            if (k->client_gone)
                return false;
            if (k->busy) {
                end = TDM_ROUTER_ATTEMPT_BUSY;
                snprintf(err, sizeof err, "%s", k->busy_why);
            } else if (!k->lost) {
                return true;
            } else {
                end = TDM_ROUTER_ATTEMPT_LOST;
                snprintf(err, sizeof err, "lost before the first token");
            }
        }
        uint64_t ep = k->routed ? k->route.decode.id : busy_ep; // avoided on the next route
        bool again = tdm_router_retry_next(&budget, end, ep, !tdm_router_call_retryable(&k->oai));
        if (end == TDM_ROUTER_ATTEMPT_LOST && !again)
            return true;
        if (end == TDM_ROUTER_ATTEMPT_BUSY && k->routed) {
            // Refused by the worker after the send, nothing reached the client:
            // another worker, else the worker's own answer (503) is the client's.
            if (!again)
                return true;
            TDM_LOG_INFO(MOD, "req=%s decode %s busy (%s), rerouting", k->oai.resp.id,
                         k->route.decode.name, err);
            abandon_route(k, end, again, err);
        } else if (end != TDM_ROUTER_ATTEMPT_NO_ROUTE && end != TDM_ROUTER_ATTEMPT_BUSY) {
            TDM_LOG_WARN(MOD, "req=%s decode %s unusable (%s)%s", k->oai.resp.id,
                         k->route.decode.name, err, again ? ", rerouting" : "");
            abandon_route(k, end, again, err);
        }
        if (!again) {
            struct tdm_oai_error e;
            tdm_oai_seterr(&e, 503, NULL, "%s", err);
            tdm_oai_http_error(k->conn, &e);
            return false;
        }
    }
}

// ---- flow control -----------------------------------------------------------------------------
static bool client_left(void *arg)
{
    return tdm_http_client_left(arg);
}

// Flow control's admission (control.h): waits while the pool is saturated
// (flowControl gate), or refuses a sheddable request. False when the call was
// answered here (429, 503: llm-d's statuses and messages, and its
// x-llm-d-request-dropped-reason header) or the client left while it waited.
// A waiting request holds its HTTP thread: it may wait only while the API
// handlers leave a reserve of threads free (max(2, --http-threads / 16)) for
// /health, /metrics and the calls that free the pool; past it, 429.
static bool admit(struct call *k)
{
    struct tdm_router_server *s = k->s;
    int reserve = s->o.http_threads / 16 > 2 ? s->o.http_threads / 16 : 2;
    size_t body = 0;
    (void)tdm_http_body(k->conn, &body);
    struct tdm_router_admit_ask ask = {
        .objective = tdm_http_header(k->conn, "x-gateway-inference-objective"),
        .fairness_id = tdm_http_header(k->conn, "x-gateway-inference-fairness-id"),
        .bytes = (long long)body,
        .deadline = 0, // the config's request.deadline_seconds from now
        .gone = client_left,
        .gone_arg = k->conn,
        .may_wait = atomic_load(&s->inflight) <= s->o.http_threads - reserve};
    struct tdm_span q;
    tdm_span_begin_child(&q, &k->span, "flow_control", TDM_SPAN_INTERNAL, tdm_now());
    enum tdm_router_flow_outcome o = tdm_router_control_admit(s->ctl, &ask, &k->ticket);
    q.end = tdm_now();
    tdm_span_attr_str(&q, "tandem.flow_control.outcome", tdm_router_flow_outcome_name(o));
    if (o != TDM_ROUTER_FLOW_DISPATCHED)
        tdm_span_error(&q, tdm_router_flow_outcome_name(o));
    if (k->ticket.queued || o != TDM_ROUTER_FLOW_DISPATCHED)
        tdm_tracer_emit(s->tracer, &q);
    switch (o) {
    case TDM_ROUTER_FLOW_DISPATCHED:
        return true;
    case TDM_ROUTER_FLOW_EVICTED_CANCELLED:
        k->client_gone = true;
        return false;
    case TDM_ROUTER_FLOW_REJECTED_CAPACITY:
        tdm_http_add_header(k->conn, "x-llm-d-request-dropped-reason", "rejected-saturated");
        tdm_http_add_header(k->conn, "Retry-After", "1");
        tdm_oai_http_errorf(k->conn, 429, NULL, "request rejected pre-queue: queue at capacity");
        return false;
    case TDM_ROUTER_FLOW_SHED:
        tdm_http_add_header(k->conn, "Retry-After", "1");
        tdm_oai_http_errorf(k->conn, 429, NULL, "system saturated, sheddable request dropped");
        return false;
    case TDM_ROUTER_FLOW_EVICTED_TTL:
        tdm_http_add_header(k->conn, "x-llm-d-request-dropped-reason", "rejected-ttl-expired");
        tdm_oai_http_errorf(k->conn, 503, NULL,
                            "request timed out in queue: request evicted from queue: request TTL "
                            "expired");
        return false;
    default:
        tdm_oai_http_errorf(k->conn, 503, NULL, "The server is shutting down.");
        return false;
    }
}

// Ends and emits the call's spans: the open attempt (it served the request,
// or failed it past the retry budget) and llm_request with vLLM's attributes.
static void trace_call(struct call *k, const char *status)
{
    if (!k->span.recording)
        return;
    struct tdm_router_server *s = k->s;
    double now = tdm_now();
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(&k->oai);
    if (k->attempt.recording) {
        k->attempt.end = now;
        if (bad)
            tdm_span_error(&k->attempt, bad->message);
        tdm_tracer_emit(s->tracer, &k->attempt);
        k->attempt.recording = false;
    }
    tdm_oai_trace_attrs(&k->span, &k->oai);
    tdm_span_attr_int(&k->span, "tandem.attempts", k->n_attempts);
    tdm_span_attr_str(&k->span, "tandem.status", status);
    if (k->first_token_at > 0) {
        tdm_span_event(&k->span, "first_token", k->first_token_at);
        tdm_span_attr_double(&k->span, "gen_ai.latency.time_to_first_token",
                             k->first_token_at - k->arrival);
    }
    k->span.end = now;
    tdm_span_attr_double(&k->span, "gen_ai.latency.e2e", now - k->arrival);
    if (bad)
        tdm_span_error(&k->span, bad->message);
    else if (k->client_gone)
        tdm_span_error(&k->span, "client disconnected");
    tdm_oai_http_trace_status(&k->span, k->conn);
    tdm_tracer_emit(s->tracer, &k->span);
}

void router_handle_generate(struct tdm_router_server *s, struct tdm_http_conn *c,
                            enum tdm_oai_kind kind)
{
    struct call k;
    memset(&k, 0, sizeof k);
    // The decode endpoint's passive report, made with the route's release.
    bool report = false;
    enum tdm_router_outcome outcome = TDM_ROUTER_OUTCOME_SUCCESS;
    k.s = s;
    k.conn = c;
    k.arrival = tdm_now();
    tdm_cond_init(&k.cv);
    // The client's trace continues here (a malformed traceparent starts a new one).
    if (s->tracer) {
        k.client_valid = tdm_oai_http_trace_ctx(c, &k.client);
        tdm_span_begin(&k.span, s->tracer, &k.client, "llm_request", TDM_SPAN_SERVER, k.arrival);
    } else { // only passed on
        k.client_valid = tdm_trace_parse(tdm_http_header(c, "traceparent"),
                                         tdm_http_header(c, "tracestate"), &k.client) == TDM_OK;
    }
    bool started = tdm_oai_http_call_start(c, &k.oai, kind, &s->info, s->text.tok, s->text.chat,
                                           s->text.chat_err);
    struct tdm_span pre;
    tdm_span_begin_child(&pre, &k.span, "preprocess", TDM_SPAN_INTERNAL, k.arrival);
    pre.end = tdm_now(); // parse, chat template, tokenize
    tdm_tracer_emit(s->tracer, &pre);
    if (!started)
        goto out; // answered: an error, or echo only
    k.choices = calloc(k.oai.n_choices, sizeof *k.choices);
    if (k.choices == NULL) {
        tdm_oai_http_errorf(c, 500, NULL, "out of memory");
        goto out;
    }
    for (size_t i = 0; i < k.oai.n_choices; i++) {
        k.choices[i].a = &k.oai.choices[i];
        k.choices[i].upstream_done = true;
    }
    if (!admit(&k))
        goto out;
    if (!start_with_retries(&k))
        goto out;
    k.started = true;
    if (k.oai.req.stream)
        run_stream(&k);
    else
        run_collect(&k);
    if (k.client_gone)
        TDM_LOG_INFO(MOD, "req=%s client disconnected, cancelled upstream", k.oai.resp.id);
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(&k.oai);
    if (k.lost) {
        tdm_metrics_counter_inc(k.s->m_lost);
        // Counted once, by the report (tandem:router_upstream_errors_total).
        report = true;
        outcome = TDM_ROUTER_OUTCOME_ERROR;
    } else if (!bad) {
        report = true;
    }
    if (s->rm)
        tdm_metrics_histogram_observe(s->rm->e2e, tdm_now() - k.arrival);
    struct tdm_oai_usage u;
    tdm_oai_call_usage(&k.oai, &u);
    if (k.phases[0]) {
        // The phases already name the decision and the decode worker: one k=v
        // each, log style (the header's "; " separators become spaces).
        char kv[sizeof k.phases];
        size_t j = 0;
        for (size_t i = 0; k.phases[i] && j + 1 < sizeof kv; i++)
            if (!(k.phases[i] == ';' && k.phases[i + 1] == ' '))
                kv[j++] = k.phases[i];
        kv[j] = '\0';
        TDM_LOG_INFO(MOD, "req=%s done prompt_tokens=%d completion_tokens=%d %s", k.oai.resp.id,
                     u.prompt_tokens, u.completion_tokens, kv);
    } else {
        TDM_LOG_INFO(MOD, "req=%s done decode=%s decision=%s prompt_tokens=%d completion_tokens=%d",
                     k.oai.resp.id, k.route.decode.name, tdm_router_decision_name(k.route.decision),
                     u.prompt_tokens, u.completion_tokens);
    }
out:;
    const char *status = k.client_gone                 ? "cancelled"
                         : tdm_oai_call_failed(&k.oai) ? "error"
                                                       : "success";
    trace_call(&k, status);
    call_fini(&k);
    pthread_cond_destroy(&k.cv);
    if (k.routed && report)
        tdm_router_control_route_done_report(s->ctl, &k.route, status, outcome);
    else if (k.routed)
        tdm_router_control_route_done(s->ctl, &k.route, status);
}
