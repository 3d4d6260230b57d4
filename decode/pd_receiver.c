// SPDX-License-Identifier: Apache-2.0
// pd_receiver: the decode worker's P/D side (see pd_receiver.h). The frame
// handlers (run by the P/D service on the inbox's reader threads, one per peer
// connection) start a job thread per GenerateRequest, hand PrefillResults to
// their job, hand KvData frames to the attempt's KV receiver (kv_transport.h:
// the table of the mode the frame names imports an nng payload straight from
// the received message into the reserved blocks, or counts the layers CUDA
// IPC or NCCL put there; under the receiver lock, so a job that gives up
// cannot call import_done while a layer is being written; frames may come
// before the PrefillResult), and flip the cancel flag for Cancels. A handler never runs
// a request itself (it would stall every later frame of that peer, the
// request's Cancel included): when no job thread can be started the request
// is refused with TDM_EBUSY. A job thread owns its engine request(s) from
// submit to release: it reserves the prompt's blocks once (IMPORT_KV), then
// walks the attempts, listed prefill workers in order with the same reserved
// blocks, then local prefill.
//
// Invariants: nothing is sent to the router before an attempt succeeded (or the
// request ended), so retries are invisible; every engine request a job submits
// is released by the same job; a message whose to_instance, transfer id or
// from_instance does not match the job's current attempt is dropped, so a
// failed attempt's late frames and a peer's restart leave no state that could
// match new messages.
#include "pd_receiver.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "worker.h"
#include "engine.h"
#include "kv_cache.h"
#include "kv_transport.h"
#include "metrics.h"
#include "model.h"
#include "pd_codec.h"
#include "pd.h"
#include "pd_attempt.h"
#include "trace.h"
#include "transport.h"

#define MOD "pd"

// KV events per load report at most (the rest wait for the next report, 0.2 s
// later); bounded so a report stays a few KiB and coalescing stays cheap.
#define KV_EVENTS_PER_REPORT 512

void tdm_pd_receiver_config_default(struct tdm_pd_receiver_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->prefill_timeout = 60;
    cfg->transfer_timeout = 30;
    cfg->connect_grace = 1.0;
    cfg->prefill_liveness = 2.0;
    cfg->layers_per_frame = 4;
    cfg->send_timeout = 2;
    cfg->router_liveness = 30;
    cfg->write_quarantine = 2;
    cfg->nccl_timeout = 10;
}

static int set_nng_url(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_pd_receiver_config *cfg = o;
    return tdm_pd_flag_url(cfg->nng_url, sizeof cfg->nng_url, v, true, err, errlen); // "" = off
}

#define SECONDS(n, field, h)                                                                       \
    {.name = n, .kind = TDM_FLAG_DOUBLE, .offset = offsetof(struct tdm_pd_receiver_config, field), \
     .min = 1e-9, .max = 1e6, .metavar = "SECONDS", .help = h}

static const struct tdm_flag receiver_flags[] = {
    {.name = "nng-url", .kind = TDM_FLAG_FN, .fn = set_nng_url, .metavar = "URL",
     .help = "this worker's nng inbox, e.g. tcp://0.0.0.0:9300;\nenables P/D (default off)"},
    SECONDS("pd-prefill-timeout", prefill_timeout,
            "wait for a prefill worker's result (default 60)"),
    SECONDS("pd-transfer-timeout", transfer_timeout,
            "wait for the KV still missing after the prefill\nresult (default 30)"),
    // The prefill worker's spelling (one name per concept, issue 14); the
    // old --pd-layers-per-frame is kept as a hidden alias.
    {.name = "layers-per-frame", .kind = TDM_FLAG_INT,
     .offset = offsetof(struct tdm_pd_receiver_config, layers_per_frame), .min = 1, .max = 1e6,
     .metavar = "N", .help = "KV layers per frame asked of the prefill worker\n(default 4)"},
    {.name = "pd-layers-per-frame", .kind = TDM_FLAG_INT,
     .offset = offsetof(struct tdm_pd_receiver_config, layers_per_frame), .min = 1, .max = 1e6,
     .hidden = true},
    SECONDS("pd-prefill-liveness", prefill_liveness,
            "a prefill worker silent to load queries this\nlong counts as failed (default 2)"),
    SECONDS("pd-router-liveness", router_liveness,
            "a router connected but taking no byte of the\ntoken streams this long counts as "
            "gone: its\nstreams end (default 30)"),
};

static const struct tdm_flags receiver_table = {
    .usage = "Disaggregated prefill/decode (docs/pd-protocol.md; flags only, not --config keys):\n",
    .flags = receiver_flags,
    .n = sizeof receiver_flags / sizeof receiver_flags[0],
};

const struct tdm_flags *tdm_pd_receiver_flags(void)
{
    return &receiver_table;
}

int tdm_pd_receiver_take_args(struct tdm_pd_receiver_config *cfg, int *argc, char **argv, char *err,
                              size_t errlen)
{
    return tdm_flags_take(&receiver_table, cfg, argc, argv, err, errlen);
}

// ---- state -------------------------------------------------------------------------------
struct djob {
    struct djob *next;
    struct tdm_pd_receiver *rx;
    Tandem__GenerateRequest *gen; // owned (unpacked)
    char request_id[96];
    char router_url[256];
    uint64_t router_instance;
    struct tdm_sampling_params sampling;
    int n_resume;    // gen->prompt ends with this many resume_tokens (a migrated stream)
    double arrival;  // tdm_now() at receipt
    double deadline; // tdm_now() clock

    // Under rx->mu (shared with the frame handlers):
    bool cancelled;
    uint64_t transfer_id; // current remote attempt, 0 = none
    char prefill_url[256];
    Tandem__PrefillResult *result;  // owned once received
    struct tdm_engine_request *req; // current engine request (for cancel)
    bool importing;                 // KvData of transfer_id may be imported into req now
    struct tdm_kv_recv *kv;         // the attempt's receiver (kv_transport.h) while frames
                                    // may reach it: its tables take them (NULL after retire)
    uint64_t prefill_instance;      // KvData and an ok result must come from it; 0 = bound
                                    // to the first that does
    bool kv_failed;
    char kv_err[256];
    double prefill_heard; // tdm_now() of the prefill worker's last LoadReport for this attempt
    // In-place transfers (issue 10): the attempt offered our device pool, so the
    // prefill worker may write the reserved blocks itself until it says closed.
    bool offered;
    bool writes_closed;
    bool peer_restarted;  // a LoadReport of the attempt came from another instance
    uint64_t closing_tid; // a retired attempt whose closed frame is still awaited
    // A mode with receives of its own (NCCL) was offered: whether they may
    // still write the reserved blocks (set before the attempt starts, cleared
    // when the receive thread is quiet).
    bool receives_busy;
    bool blocks_unsafe; // a receive's completion stayed unknown: the reserved blocks are never
                        // handed on (the import request is kept, not ended)
    uint64_t version;   // bumped with every change above made by a frame handler

    // The trace (job thread only): the llm_request span, parent = the router's
    // attempt span from GenerateRequest.traceparent; not recording when off.
    struct tdm_span span;
    bool remote_prefilled;         // a prefill worker's KV was used
    bool finished;                 // the engine finish of the streamed request was read
    struct tdm_engine_times times; // of that request
    double t_first_sent;           // first token sent to the router
    int prompt_tokens, cached_tokens, completion_tokens;
};

struct tdm_pd_receiver {
    struct tdm_pd_receiver_config cfg;
    struct tdm_worker *server;
    struct tdm_worker_parts parts;
    struct tdm_kv_config kvc;
    struct tdm_pd_service net; // inbox, outbox, instance id, frame dispatch, stopping

    pthread_mutex_t mu;
    pthread_cond_t cv; // broadcast on any job change
    struct djob *jobs;
    int num_jobs;

    struct tdm_pd_metrics m;

    // GPU-to-GPU transfer (issue 10): --kv-transfer, this node's id, our device
    // pool exported once (kv_pool empty when there is none: host KV, a CPU
    // build, or --kv-transfer nng/nccl), the pairs behind /health, the counter.
    // The transport table's worker-wide side (kv_transport.h): the pairs
    // behind /health, one NCCL communicator per prefill worker.
    struct tdm_kv_transport *kvt;
    uint8_t kv_pool[TDM_KVX_POOL_WIRE_BYTES];
    size_t kv_pool_len;
    struct tdm_metrics_counter *transfers;

    // KV events of the load report being built (fill_load: one call at a time).
    struct tdm_kv_event kev[KV_EVENTS_PER_REPORT];
    uint64_t kev_stored[KV_EVENTS_PER_REPORT], kev_evicted[KV_EVENTS_PER_REPORT];
    uint64_t kev_batch;
};

const char *tdm_pd_receiver_url(const struct tdm_pd_receiver *r)
{
    return tdm_pd_service_url(&r->net);
}

uint64_t tdm_pd_receiver_instance(const struct tdm_pd_receiver *r)
{
    return r->net.instance;
}

int tdm_pd_receiver_num_jobs(struct tdm_pd_receiver *r)
{
    pthread_mutex_lock(&r->mu);
    int n = r->num_jobs;
    pthread_mutex_unlock(&r->mu);
    return n;
}

static void timed_wait(struct tdm_pd_receiver *rx, double seconds)
{
    tdm_cond_wait_for(&rx->cv, &rx->mu, seconds);
}

// True once j should end: cancelled, the service stopping or its deadline passed.
static bool job_stopped(struct djob *j)
{
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    bool stop = j->cancelled || atomic_load(&rx->net.stopping) || tdm_now() > j->deadline;
    pthread_mutex_unlock(&rx->mu);
    return stop;
}

// Forgets j's engine request (a cancel no longer reaches it) and releases it.
static void job_release(struct djob *j, struct tdm_engine_request *req)
{
    pthread_mutex_lock(&j->rx->mu);
    j->req = NULL;
    pthread_mutex_unlock(&j->rx->mu);
    tdm_engine_request_release(req);
}

// ---- messages to the router --------------------------------------------------------------
struct phases {
    double queue, prefill, transfer; // transfer: the exposed part (what the request waited for)
    double transfer_total;           // first KV frame received -> last layer installed
    const char *prefilled_by; // "" = local
};

// The wire's repeated TopLogprob of src[total]: the messages and the
// pointers to them (both heap; freed by the caller). TDM_OK / TDM_ENOMEM
// (nothing allocated).
static int wire_tops(const struct tdm_token_logprob *src, size_t total, Tandem__TopLogprob **tops,
                     Tandem__TopLogprob ***ptrs)
{
    *tops = calloc(total, sizeof **tops);
    *ptrs = calloc(total, sizeof **ptrs);
    if (*tops == NULL || *ptrs == NULL) {
        free(*tops);
        free(*ptrs);
        *tops = NULL;
        *ptrs = NULL;
        return TDM_ENOMEM;
    }
    Tandem__TopLogprob init = TANDEM__TOP_LOGPROB__INIT;
    for (size_t i = 0; i < total; i++) {
        (*tops)[i] = init;
        (*tops)[i].token = src[i].token;
        (*tops)[i].logprob = src[i].logprob;
        (*ptrs)[i] = &(*tops)[i];
    }
    return TDM_OK;
}

// Sends one chunk (TDM_OK, or the transport's error with err). TDM_EBUSY:
// the router is connected but took none of it within send_timeout (its
// reader is behind): nothing of it went out, so it may be sent again
// (router_slow).
static int send_chunk(struct djob *j, const struct tdm_engine_chunk *c, const struct phases *ph,
                      const Tandem__PrefillResult *first, char *err, size_t errlen)
{
    struct tdm_pd_receiver *rx = j->rx;
    Tandem__TokenChunk m = TANDEM__TOKEN_CHUNK__INIT;
    Tandem__PhaseTimes pt = TANDEM__PHASE_TIMES__INIT;
    m.request_id = j->request_id;
    m.to_instance = j->router_instance;
    m.from_instance = rx->net.instance;
    m.first_index = c->first_index;
    m.n_tokens = (size_t)c->n;
    m.tokens = (int32_t *)c->tokens;
    float *lps = NULL;
    Tandem__TopLogprob *tops = NULL, **top_ptr = NULL;
    int nt = c->top ? c->num_top : 0;
    if (c->logprobs && c->n > 0) {
        lps = malloc((size_t)c->n * sizeof *lps);
        if (lps == NULL)
            return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        memcpy(lps, c->logprobs, (size_t)c->n * sizeof *lps);
        // Output 0 of an imported request was sampled by the prefill worker: its
        // logprobs are the ones it reported (the replay here has no logits).
        if (first && c->first_index == 0)
            lps[0] = first->logprob;
        m.n_logprobs = (size_t)c->n;
        m.logprobs = lps;
    }
    if (nt > 0 && c->n > 0) {
        size_t total = (size_t)c->n * (size_t)nt;
        if (wire_tops(c->top, total, &tops, &top_ptr) != TDM_OK) {
            free(lps);
            return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        }
        // Output 0 of an imported request: the prefill worker's alternatives.
        for (size_t i = 0; first && c->first_index == 0 && i < (size_t)nt && i < first->n_top;
             i++) {
            tops[i].token = first->top[i]->token;
            tops[i].logprob = first->top[i]->logprob;
        }
        m.num_top = nt;
        m.n_top = total;
        m.top = top_ptr;
    }
    m.finished = c->finished;
    m.finish = c->finished ? tdm_pd_finish_to_proto(c->reason) : TANDEM__FINISH_REASON__FINISH_NONE;
    m.stop_token = c->stop_token;
    m.error = c->error;
    m.message = (char *)(c->message ? c->message : "");
    m.prompt_tokens = c->num_prompt_tokens;
    m.cached_tokens = c->num_cached_tokens;
    // Prompt logprobs with the first chunk (views of the engine's arrays;
    // the tops as pointers, the wire's repeated message).
    const struct tdm_prompt_logprobs *pl = c->prompt_logprobs;
    Tandem__TopLogprob *ptops = NULL, **ptop_ptr = NULL;
    if (pl && pl->n > 0) {
        size_t total = (size_t)pl->n * (size_t)pl->num_top;
        if (total > 0 && wire_tops(pl->top, total, &ptops, &ptop_ptr) != TDM_OK) {
            free(lps);
            free(tops);
            free(top_ptr);
            return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        }
        m.n_prompt_logprobs = (size_t)pl->n;
        m.prompt_logprobs = (float *)pl->logprob;
        m.n_prompt_ranks = (size_t)pl->n;
        m.prompt_ranks = (int32_t *)pl->rank;
        m.prompt_num_top = pl->num_top;
        m.n_prompt_top = total;
        m.prompt_top = ptop_ptr;
    }
    if (ph) {
        pt.queue = ph->queue;
        pt.prefill = ph->prefill;
        pt.transfer = ph->transfer;
        pt.transfer_total = ph->transfer_total;
        pt.first_token = tdm_now() - j->arrival;
        m.phases = &pt;
        m.prefilled_by = (char *)ph->prefilled_by;
    }
    int rc = tdm_pd_send(rx->net.outbox, j->router_url, TDM_NET_TOKENS, &m.base, NULL, 0,
                         rx->cfg.send_timeout, err, errlen);
    free(lps);
    free(tops);
    free(top_ptr);
    free(ptops);
    free(ptop_ptr);
    return rc;
}

// After a send to the router failed with rc: true when it is worth sending
// again, the router being slow rather than gone. Slow is connected with its
// reader behind (TDM_EBUSY: nothing of the frame went out); gone is no
// connection within send_timeout, a connection that failed, or one that took
// no byte for router_liveness (the outbox's stall limit drops it then, and
// the send fails otherwise). A job that is stopping (the router's cancel,
// the deadline, shutdown) does not wait for a slow router.
static bool router_slow(struct djob *j, int rc)
{
    return rc == TDM_EBUSY && !job_stopped(j);
}

// A final chunk without tokens (error, abort, or a finish decided here). From
// a job thread (wait_slow) a slow router is waited for, as for tokens; a
// frame handler sends once (its connection's reader must not wait).
static void send_finish(struct djob *j, bool wait_slow, enum tdm_finish reason, int error,
                        const char *message)
{
    struct tdm_engine_chunk c;
    memset(&c, 0, sizeof c);
    c.finished = true;
    c.reason = reason;
    c.stop_token = -1;
    c.error = error;
    c.message = message;
    c.num_prompt_tokens = (int)j->gen->n_prompt;
    char err[256];
    int rc;
    while ((rc = send_chunk(j, &c, NULL, NULL, err, sizeof err)) != TDM_OK && wait_slow &&
           router_slow(j, rc)) {
    }
    if (rc != TDM_OK)
        TDM_LOG_WARN(MOD, "req=%s the router did not get the request's end: %s", j->request_id,
                     err);
}

// ---- the token stream to the router ------------------------------------------------------
// At most this many tokens go in one TokenChunk: after a stall of the router
// the tokens generated meanwhile go out in frames of this size, so one send
// packs at most 256 tokens (and their top logprobs).
#define CHUNK_MAX_TOKENS 256

// Appends the engine's next chunk c to *pend, the part of the stream read
// from the engine and not sent yet (*have: pend holds something). The
// engine's arrays are append-only and never move (tdm_engine_stream_next), so
// c's tokens, logprobs and top logprobs follow pend's in memory; the finish
// and the counts come with c.
static void chunk_append(struct tdm_engine_chunk *pend, bool *have,
                         const struct tdm_engine_chunk *c)
{
    if (!*have) {
        *pend = *c;
        *have = true;
        return;
    }
    TDM_ASSERT(c->first_index == pend->first_index + pend->n);
    int n = pend->n + c->n;
    *pend = *c;
    pend->first_index = c->first_index - (n - c->n);
    pend->n = n;
    pend->tokens = c->tokens - (n - c->n);
    if (c->logprobs)
        pend->logprobs = c->logprobs - (n - c->n);
    if (c->top)
        pend->top = c->top - (size_t)(n - c->n) * (size_t)c->num_top;
}

// Drops the first k tokens of *pend (they were sent).
static void chunk_advance(struct tdm_engine_chunk *pend, int k)
{
    pend->first_index += k;
    pend->n -= k;
    pend->tokens += k;
    if (pend->logprobs)
        pend->logprobs += k;
    if (pend->top)
        pend->top += (size_t)k * (size_t)pend->num_top;
}

// The engine's finish of the streamed request was read (c): the job's record
// of it, for the trace.
static void note_finish(struct djob *j, struct tdm_engine_request *req,
                        const struct tdm_engine_chunk *c)
{
    j->finished = true;
    tdm_engine_request_times(req, &j->times);
    j->prompt_tokens = c->num_prompt_tokens;
    j->cached_tokens = c->num_cached_tokens;
    j->completion_tokens = c->first_index + c->n;
    // An abort is the router's cancel (a stop string, the client gone):
    // not this worker's failure.
    tdm_span_attr_str(&j->span, "tandem.finish_reason", tdm_finish_name(c->reason));
    if (c->reason == TDM_FINISH_ERROR)
        tdm_span_error(&j->span,
                       c->message && c->message[0] ? c->message : tdm_finish_name(c->reason));
}

// Streams an engine request's outputs to the router until it finishes.
// Backpressure from the router slows the stream and never ends it: while the
// router is slow (router_slow), the tokens it has not taken stay where the
// engine wrote them, in the request's own arrays (allocated at submit for its
// max_tokens: a stalled router costs no memory the request would not use
// anyway, and nothing is queued here), the engine keeps decoding, and each
// send again carries every token not sent yet (at most CHUNK_MAX_TOKENS a
// frame), in order, none twice (a failed send wrote nothing the router reads).
// A router that is gone ends the stream: the engine request is aborted (its
// KV freed at the engine's next step), no more tokens go out, and the finish
// is an error saying why (ETRANSPORT), for a router that reads again after
// all: never "abort", which reads like its own cancel. Cancel, deadline and
// shutdown abort the request; then a send that fails stops the tokens and
// only the finish is tried. Releases nothing: the caller owns the handle.
static void stream_to_router(struct djob *j, struct tdm_engine_request *req,
                             const struct phases *ph, const Tandem__PrefillResult *first)
{
    struct tdm_pd_receiver *rx = j->rx;
    struct tdm_engine_chunk pend; // read from the engine, not sent yet
    bool have = false, sent_first = false, aborted = false, stalled = false;
    bool quiet = false;  // no more tokens go out, only the finish
    char gone[320] = ""; // why the router counts as gone ("": it does not)
    char err[256];
    for (;;) {
        if (!aborted && (quiet || job_stopped(j))) {
            tdm_engine_abort(rx->parts.engine, req, TDM_FINISH_ABORT);
            aborted = true;
        }
        struct tdm_engine_chunk c;
        int rc = tdm_engine_stream_next(req, have ? 0 : 0.1, &c);
        if (rc == TDM_OK)
            chunk_append(&pend, &have, &c);
        else if (rc != TDM_ETIMEDOUT && !have)
            return;
        if (!have)
            continue;
        if (pend.finished && pend.reason == TDM_FINISH_ABORT && tdm_now() > j->deadline)
            pend.message = "the request's deadline passed";
        if (quiet) {
            if (!pend.finished) {
                have = false; // nobody takes them
                continue;
            }
            note_finish(j, req, &pend);
            struct tdm_engine_chunk fin = pend;
            chunk_advance(&fin, fin.n); // the finish alone: the tokens before it did not go
            if (gone[0]) {
                fin.reason = TDM_FINISH_ERROR;
                fin.error = TDM_ETRANSPORT;
                fin.message = gone;
            }
            send_chunk(j, &fin, NULL, NULL, err, sizeof err);
            return;
        }
        struct tdm_engine_chunk piece = pend;
        if (piece.n > CHUNK_MAX_TOKENS) {
            piece.n = CHUNK_MAX_TOKENS;
            piece.finished = false;
        }
        rc = send_chunk(j, &piece, sent_first ? NULL : ph, first, err, sizeof err);
        if (rc == TDM_OK) {
            sent_first = true;
            if (piece.n > 0 && j->t_first_sent == 0)
                j->t_first_sent = tdm_now();
            if (piece.finished) {
                note_finish(j, req, &pend);
                return;
            }
            chunk_advance(&pend, piece.n);
            have = pend.n > 0 || pend.finished;
            continue;
        }
        if (router_slow(j, rc)) {
            if (!stalled)
                TDM_LOG_INFO(MOD, "req=%s the router is slow to read: the stream waits (%s)",
                             j->request_id, err);
            stalled = true;
            continue; // again, with what the engine made meanwhile
        }
        quiet = true;
        if (!job_stopped(j)) {
            snprintf(gone, sizeof gone, "router unreachable: %s", err);
            TDM_LOG_WARN(MOD, "req=%s %s; request aborted", j->request_id, gone);
        }
    }
}

// Streams a request prefilled on this engine (its phases: queue time only) to
// the router, then releases it.
static void stream_local(struct djob *j, struct tdm_engine_request *req)
{
    struct phases ph = {tdm_now() - j->arrival, 0, 0, 0, ""};
    stream_to_router(j, req, &ph, NULL);
    job_release(j, req);
}

static void fill_params(struct djob *j, struct tdm_engine_request_params *ep)
{
    struct tdm_pd_receiver *rx = j->rx;
    tdm_engine_request_params_default(ep);
    ep->id = j->request_id;
    ep->prompt = j->gen->prompt;
    ep->n_prompt = (int)j->gen->n_prompt;
    ep->n_resume = j->n_resume;
    ep->sampling = j->sampling;
    ep->max_tokens = j->gen->max_tokens > 0 ? j->gen->max_tokens - j->n_resume : 0;
    ep->want_prompt_logprobs = j->gen->want_prompt_logprobs;
    ep->prompt_top_logprobs = j->gen->prompt_top_logprobs;
    ep->priority = j->gen->priority;
    ep->cache_salt = j->gen->cache_salt;
    if (j->gen->n_eos_ids) {
        ep->eos_ids = j->gen->eos_ids;
        ep->num_eos = (int)j->gen->n_eos_ids;
    } else {
        ep->eos_ids = rx->parts.eos_ids;
        ep->num_eos = rx->parts.num_eos;
    }
}

// Local prefill: a plain GENERATE request on this engine.
static void run_local(struct djob *j)
{
    struct tdm_pd_receiver *rx = j->rx;
    struct tdm_engine_request_params ep;
    fill_params(j, &ep);
    ep.arrival_time = j->arrival;
    char err[512];
    struct tdm_engine_request *req = NULL;
    int rc = tdm_engine_submit(rx->parts.engine, &ep, &req, err, sizeof err);
    if (rc != TDM_OK) {
        send_finish(j, true, TDM_FINISH_ERROR, rc, err);
        return;
    }
    pthread_mutex_lock(&rx->mu);
    j->req = req;
    bool cancelled = j->cancelled;
    pthread_mutex_unlock(&rx->mu);
    if (cancelled)
        tdm_engine_abort(rx->parts.engine, req, TDM_FINISH_ABORT);
    stream_local(j, req);
}

// ---- one remote attempt (the state machine is pd_attempt.c) ------------------------------
// The machine's ops over this receiver: its outbox, its lock and condition
// variable, its engine. The frame handlers fill the job's attempt fields;
// view copies them under rx->mu, and wait returns early when they changed
// since (j->version), so a wake-up between the two is not lost.
struct remote {
    struct djob *j;
    const Tandem__PrefillTarget *t;
    struct tdm_engine_request *req;
    int first_block, num_blocks;
    uint64_t tid;               // this attempt's transfer id
    uint64_t seen;              // j->version at the last view
    Tandem__PrefillResult *res; // taken from the job by check_result or retire; owned
    struct tdm_span span;       // remote_prefill: the parent of the prefill worker's spans
    bool offered;               // our device pool and block ids go with the request
    int32_t *block_ids;         // [num_blocks] the reserved range's physical ids (offered)
    // The attempt's receiver (kv_transport.h: every mode offered, the frames
    // handed to their tables, the transfer's progress), the NCCL
    // communicator id it offers, the receive thread of a mode with receives
    // of its own.
    struct tdm_kv_recv_host host;
    struct tdm_kv_recv *kv;
    bool has_nccl_id;
    uint8_t nccl_id[TDM_KVX_NCCL_ID_BYTES];
    pthread_t recv_thread;
    bool recv_started;
};

static double remote_now(void *ctx)
{
    (void)ctx;
    return tdm_now();
}

static int remote_send_prefill(void *ctx, double timeout_s, char *err, size_t errlen)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    Tandem__PrefillRequest pr = TANDEM__PREFILL_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_pd_service_url(&rx->net);
    me.instance = rx->net.instance;
    struct tdm_pd_sampling_msg sm;
    tdm_pd_sampling_to_proto(&j->sampling, &sm);
    pr.request_id = j->request_id;
    pr.transfer_id = x->tid;
    pr.reply_to = &me;
    pr.to_instance = x->t->instance;
    pr.n_prompt = j->gen->n_prompt;
    pr.prompt = j->gen->prompt;
    pr.sampling = &sm.msg;
    pr.n_eos_ids = j->gen->n_eos_ids;
    pr.eos_ids = j->gen->eos_ids;
    pr.deadline_unix = j->gen->deadline_unix;
    pr.priority = j->gen->priority;
    pr.cache_salt = j->gen->cache_salt;
    pr.model = (char *)rx->parts.served_name;
    pr.hold_seconds = rx->cfg.transfer_timeout;
    char tp[TDM_TRACEPARENT_LEN + 1];
    struct tdm_trace_ctx tc;
    if (x->span.recording) {
        tdm_span_ctx(&x->span, &tc);
        tdm_trace_format(&tc, tp);
        pr.traceparent = tp;
        pr.tracestate = tc.tracestate;
    }
    struct tdm_pd_push push = {x->first_block, x->num_blocks, rx->cfg.layers_per_frame,
                               rx->kvc.dtype};
    struct tdm_kv_header kvh;
    tdm_pd_push_to_proto(&pr, &push, &rx->kvc, rx->parts.served_name, &kvh);
    pr.kv_transfer = (char *)tdm_kv_transport_setting_name(rx->kvt);
    pr.host_id = (char *)tdm_kv_transport_host_id(rx->kvt);
    if (x->offered) {
        pr.kv_pool.data = rx->kv_pool;
        pr.kv_pool.len = rx->kv_pool_len;
        pr.n_block_ids = (size_t)x->num_blocks;
        pr.block_ids = x->block_ids;
        if (x->has_nccl_id) {
            pr.nccl_id.data = x->nccl_id;
            pr.nccl_id.len = sizeof x->nccl_id;
        }
    }
    int rc = tdm_pd_send(rx->net.outbox, x->t->url, TDM_NET_PREFILL, &pr.base, NULL, 0, timeout_s,
                         err, errlen);
    if (rc != TDM_OK && x->offered) {
        // Never delivered (a failed write drops the partial frame with the
        // connection): nobody can write the blocks.
        pthread_mutex_lock(&rx->mu);
        j->writes_closed = true;
        pthread_mutex_unlock(&rx->mu);
    }
    return rc;
}

static bool remote_connected(void *ctx)
{
    struct remote *x = ctx;
    return tdm_net_connected(x->j->rx->net.outbox, x->t->url);
}

static void remote_send_probe(void *ctx)
{
    struct remote *x = ctx;
    struct tdm_pd_receiver *rx = x->j->rx;
    Tandem__LoadQuery q = TANDEM__LOAD_QUERY__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_pd_service_url(&rx->net);
    me.instance = rx->net.instance;
    q.reply_to = &me;
    q.seq = x->tid; // echoed back: finds this attempt
    char err[256];
    tdm_pd_send(rx->net.outbox, x->t->url, TDM_NET_LOAD_QUERY, &q.base, NULL, 0, 0, err,
                sizeof err);
}

static void remote_send_cancel(void *ctx, uint64_t instance)
{
    struct remote *x = ctx;
    Tandem__Cancel m = TANDEM__CANCEL__INIT;
    m.request_id = x->j->request_id;
    m.transfer_id = x->tid;
    m.to_instance = instance;
    char err[256];
    tdm_pd_send(x->j->rx->net.outbox, x->t->url, TDM_NET_CANCEL, &m.base, NULL, 0, 0.2, err,
                sizeof err);
}

static void remote_view(void *ctx, struct tdm_pd_attempt_view *v)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    memset(v, 0, sizeof *v);
    pthread_mutex_lock(&rx->mu);
    x->seen = j->version;
    v->cancelled = j->cancelled;
    v->stop = j->cancelled || atomic_load(&rx->net.stopping) || tdm_now() > j->deadline;
    const Tandem__PrefillResult *r = x->res ? x->res : j->result;
    v->has_result = r != NULL;
    v->result_error = r ? r->error : 0;
    snprintf(v->result_message, sizeof v->result_message, "%s", r && r->message ? r->message : "");
    v->peer_instance = r ? r->from_instance : j->prefill_instance;
    v->kv_failed = j->kv_failed;
    snprintf(v->kv_err, sizeof v->kv_err, "%s", j->kv_err);
    struct tdm_kv_recv_progress p;
    tdm_kv_recv_progress(x->kv, &p);
    v->layers_done = p.layers_done;
    v->bytes_done = p.bytes_done;
    v->t_first_frame = p.t_first_frame;
    v->t_kv_done = p.t_kv_done;
    v->prefill_heard = j->prefill_heard;
    v->writes_open = j->offered && (!j->writes_closed || j->receives_busy);
    v->peer_restarted = j->peer_restarted;
    pthread_mutex_unlock(&rx->mu);
}

static void remote_wait(void *ctx, double seconds)
{
    struct remote *x = ctx;
    struct tdm_pd_receiver *rx = x->j->rx;
    pthread_mutex_lock(&rx->mu);
    if (x->j->version == x->seen)
        timed_wait(rx, seconds);
    pthread_mutex_unlock(&rx->mu);
}

// Takes the job's result into x->res (caller holds rx->mu).
static void take_result_locked(struct remote *x)
{
    if (x->res == NULL) {
        x->res = x->j->result;
        x->j->result = NULL;
    }
}

static int remote_check_result(void *ctx, char *err, size_t errlen)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    take_result_locked(x);
    pthread_mutex_unlock(&rx->mu);
    const Tandem__PrefillResult *res = x->res;
    int vocab = tdm_model_config(rx->parts.model)->vocab_size;
    int rc = tdm_pd_kv_header_check(res->kv_header.data, res->kv_header.len, &rx->kvc,
                                    rx->parts.served_name, (int)j->gen->n_prompt, err, errlen);
    if (rc == TDM_OK && (res->first_token < 0 || res->first_token >= vocab))
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "first token %d outside the vocabulary",
                        (int)res->first_token);
    return rc;
}

// Ends the attempt: from here on no KvData touches the reserved blocks (the
// KvData handler imports under rx->mu) and no message of this transfer id is
// accepted.
static void remote_retire(void *ctx)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    pthread_mutex_lock(&j->rx->mu);
    take_result_locked(x);
    j->importing = false;
    j->kv = NULL;
    if (j->offered && !j->writes_closed)
        j->closing_tid = j->transfer_id; // its closed frame is still taken
    j->transfer_id = 0;
    pthread_mutex_unlock(&j->rx->mu);
}

static void remote_commit(void *ctx, const struct tdm_pd_attempt *a)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    const struct tdm_pd_attempt_view *v = &a->last;
    double prefill_s = a->t_result - a->t_sent;
    // The exposed transfer: result -> last layer installed (0 when every frame
    // came before the result).
    double exposed =
        x->num_blocks > 0 && v->t_kv_done > a->t_result ? v->t_kv_done - a->t_result : 0;
    if (x->num_blocks > 0) {
        tdm_metrics_counter_add(rx->m.bytes, (double)v->bytes_done);
        tdm_metrics_counter_add(rx->m.blocks, (double)x->num_blocks);
        tdm_metrics_histogram_observe(rx->m.seconds, v->t_kv_done - v->t_first_frame);
    }
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(rx->m.requests, "remote"));
    if (x->num_blocks > 0) {
        struct tdm_kv_recv_progress p;
        tdm_kv_recv_progress(x->kv, &p);
        tdm_kv_transport_note(rx->kvt, x->t->url, p.mode->mode, p.why);
        tdm_metrics_counter_inc(tdm_metrics_counter_labels(rx->transfers, p.mode->name));
    }
    TDM_LOG_DEBUG(MOD, "req=%s KV from %s: blocks=%d bytes=%zu prefill=%.4f exposed=%.4f",
                  j->request_id, x->t->url, x->num_blocks, v->bytes_done, prefill_s, exposed);
    tdm_engine_import_done(rx->parts.engine, x->req, x->res->first_token, true);
    j->remote_prefilled = true;
    if (x->span.recording) {
        // The remote prefill ends with its result; the KV stream overlaps it,
        // and what the request waited for after the result is the wait.
        struct tdm_tracer *t = rx->parts.tracer;
        x->span.end = a->t_result;
        tdm_span_attr_int(&x->span, "tandem.kv.blocks", x->num_blocks);
        tdm_span_attr_int(&x->span, "tandem.kv.bytes", (int64_t)v->bytes_done);
        tdm_tracer_emit(t, &x->span);
        x->span.recording = false; // emitted
        struct tdm_span kv;
        if (x->num_blocks > 0 && v->t_first_frame > 0) {
            tdm_span_begin_child(&kv, &j->span, "kv_transfer", TDM_SPAN_INTERNAL, v->t_first_frame);
            kv.end = v->t_kv_done;
            tdm_span_attr_int(&kv, "tandem.kv.bytes", (int64_t)v->bytes_done);
            tdm_tracer_emit(t, &kv);
        }
        tdm_span_begin_child(&kv, &j->span, "kv_transfer_wait", TDM_SPAN_INTERNAL, a->t_result);
        kv.end = a->t_result + exposed;
        tdm_tracer_emit(t, &kv);
    }
    double total = x->num_blocks > 0 && v->t_first_frame > 0 ? v->t_kv_done - v->t_first_frame : 0;
    struct phases ph = {x->res->queue_seconds, prefill_s, exposed, total, x->t->url};
    stream_to_router(j, x->req, &ph, x->res);
}

static const struct tdm_pd_attempt_ops remote_ops = {
    .now = remote_now,
    .send_prefill = remote_send_prefill,
    .connected = remote_connected,
    .send_probe = remote_send_probe,
    .send_cancel = remote_send_cancel,
    .view = remote_view,
    .wait = remote_wait,
    .check_result = remote_check_result,
    .retire = remote_retire,
    .commit = remote_commit,
};

// Logs and counts a failed attempt the way each state fails.
static void remote_failed(const struct remote *x, const struct tdm_pd_attempt *a)
{
    struct tdm_pd_receiver *rx = x->j->rx;
    const char *id = x->j->request_id, *url = x->t->url;
    if (!a->counted)
        return; // cancelled: nothing failed
    if (a->why == TDM_PD_WHY_UNREACHABLE)
        TDM_LOG_WARN(MOD, "req=%s prefill %s unreachable: %s", id, url, a->detail);
    else if (a->why == TDM_PD_WHY_HEADER)
        TDM_LOG_WARN(MOD, "req=%s prefill %s refused: %s", id, url, a->detail);
    else if (a->failed_in == TDM_PD_ATTEMPT_AWAIT_KV)
        TDM_LOG_WARN(MOD, "req=%s KV from %s not installed: %s", id, url, a->detail);
    else
        TDM_LOG_WARN(MOD, "req=%s prefill %s failed (%s): %s", id, url,
                     tdm_pd_attempt_why_name(a->why), a->detail);
    tdm_pd_metrics_fail(&rx->m, tdm_pd_attempt_why_name(a->why));
}

// ---- the attempt's receiver --------------------------------------------------------------
// The receiver's host (kv_transport.h): waits until the prefill worker's first
// frame of the transfer came (TDM_OK), the transfer ended without one
// (TDM_ENOTFOUND), or the attempt is over (TDM_ECLOSED: retired, cancelled,
// stopping, failed).
static int recv_wait_go(void *ctx)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    int w;
    for (;;) {
        if (j->transfer_id != x->tid || j->cancelled || atomic_load(&rx->net.stopping) ||
            j->kv_failed) {
            w = TDM_ECLOSED;
            break;
        }
        struct tdm_kv_recv_progress p;
        tdm_kv_recv_progress(x->kv, &p);
        if (p.t_first_frame > 0) {
            w = TDM_OK;
            break;
        }
        if (j->writes_closed) {
            w = TDM_ENOTFOUND; // the transfer ended first
            break;
        }
        timed_wait(rx, 0.05);
    }
    pthread_mutex_unlock(&rx->mu);
    return w;
}

// Why the receives must stop now (NULL: go on): the attempt retired or its
// job stopped, or the prefill worker restarted (its end of the transfer is gone).
static const char *recv_stop(void *ctx)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    const char *why = j->transfer_id != x->tid                         ? "attempt ended"
                      : j->cancelled || atomic_load(&rx->net.stopping) ? "cancelled"
                      : j->peer_restarted                              ? "prefill worker restarted"
                      : j->kv_failed                                   ? "transfer failed"
                                                                       : NULL;
    pthread_mutex_unlock(&rx->mu);
    return why;
}

// The receives moved more layers: the attempt's wait wakes (remote_view reads them).
static void recv_progress(void *ctx)
{
    struct remote *x = ctx;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    if (j->transfer_id == x->tid) {
        j->version++;
        pthread_cond_broadcast(&rx->cv);
    }
    pthread_mutex_unlock(&rx->mu);
}

// One layer of a frame's payload into the reserved blocks (on the reader
// thread, under rx->mu: a job that gives up cannot end the import meanwhile).
static int recv_import(void *ctx, int layer, const uint8_t *kv, size_t bytes)
{
    struct remote *x = ctx;
    return tdm_engine_import_layer(x->j->rx->parts.engine, x->req, layer, x->first_block,
                                   x->num_blocks, kv, bytes);
}

// The receive thread of an attempt that offered a mode with receives of its
// own (tdm_kv_recv_complete: NCCL's init once the prefill worker says it
// sends, then each layer group into the reserved blocks). Any error, a
// timeout, the attempt's end or a prefill restart fails the transfer into
// the retry/local path. Memory safety: receives_busy is cleared only when
// every receive's event was observed complete (after an abort too); a
// receive whose completion cannot be observed leaves it set for good.
static void *recv_main(void *arg)
{
    struct remote *x = arg;
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    char err[256] = "";
    int rc = tdm_kv_recv_complete(x->kv, err, sizeof err);
    bool quiet = tdm_kv_recv_quiet(x->kv);
    pthread_mutex_lock(&rx->mu);
    if (rc != TDM_OK && rc != TDM_ENOTFOUND && j->transfer_id == x->tid && !j->kv_failed) {
        j->kv_failed = true;
        snprintf(j->kv_err, sizeof j->kv_err, "%s", err);
    }
    j->receives_busy = !quiet;
    j->version++;
    pthread_cond_broadcast(&rx->cv);
    pthread_mutex_unlock(&rx->mu);
    return NULL;
}

// The attempt's receiver: every mode this worker can receive by offered
// (tdm_kv_recv_offer: nng always; CUDA IPC and NCCL with our pool), and the
// receive thread started when one of them receives on its own. Called after
// the attempt's fields are set (the receive thread reads them), before the
// PrefillRequest goes out.
static void recv_offer(struct remote *x)
{
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    tdm_kv_recv_offer(x->kv);
    x->has_nccl_id = tdm_kv_recv_nccl_id(x->kv, x->nccl_id);
    if (!tdm_kv_recv_receives(x->kv))
        return;
    pthread_mutex_lock(&rx->mu);
    j->receives_busy = true;
    pthread_mutex_unlock(&rx->mu);
    x->recv_started = pthread_create(&x->recv_thread, NULL, recv_main, x) == 0;
    if (x->recv_started)
        return;
    TDM_LOG_WARN(MOD, "req=%s receives of their own (NCCL) not offered to %s: no receive thread",
                 j->request_id, x->t->url);
    pthread_mutex_lock(&rx->mu);
    j->receives_busy = false;
    pthread_mutex_unlock(&rx->mu);
    tdm_kv_recv_withdraw(x->kv);
    x->has_nccl_id = false;
}

// After the attempt: the receive thread is over (so no receive of it can
// land in the blocks the next candidate or local prefill gets), the offered
// modes end (tdm_kv_recv_end). False when a receive's completion stayed
// unknown.
static bool recv_end(struct remote *x)
{
    struct tdm_pd_receiver *rx = x->j->rx;
    bool quiet = true;
    if (x->recv_started) {
        pthread_join(x->recv_thread, NULL);
        quiet = tdm_kv_recv_quiet(x->kv);
    }
    pthread_mutex_lock(&rx->mu);
    x->j->kv = NULL; // retired already: no frame reaches it
    pthread_mutex_unlock(&rx->mu);
    tdm_kv_recv_end(x->kv);
    tdm_kv_recv_free(x->kv);
    x->kv = NULL;
    return quiet;
}

// Readies one attempt on x: our device pool offered with the request when
// in-place writes are allowed here (its block ids read once per attempt: the
// reserved range is fixed), the attempt's receiver made, the job's attempt
// fields set. False (nothing sent, not counted) when the receiver cannot be
// made.
static bool remote_begin(struct remote *x)
{
    struct djob *j = x->j;
    struct tdm_pd_receiver *rx = j->rx;
    int n = x->num_blocks;
    if (rx->kv_pool_len > 0 && n > 0) {
        x->block_ids = malloc(sizeof(int32_t) * (size_t)n);
        int *ids = (int *)x->block_ids; // int32_t is int here (static assert below)
        x->offered =
            x->block_ids != NULL &&
            tdm_engine_import_block_ids(rx->parts.engine, x->req, x->first_block, n, ids) == TDM_OK;
    }
    x->host = (struct tdm_kv_recv_host){.ctx = x,
                                        .wait_go = recv_wait_go,
                                        .stop = recv_stop,
                                        .progress = recv_progress,
                                        .import_layer = recv_import};
    struct tdm_kv_recv_params p = {.peer = x->t->url,
                                   .peer_instance = x->t->instance,
                                   .request_id = j->request_id,
                                   .offered = x->offered,
                                   .dst_blocks = x->offered ? (const int *)x->block_ids : NULL,
                                   .first_block = x->first_block,
                                   .num_blocks = n,
                                   .layers_per_group = rx->cfg.layers_per_frame,
                                   .payload_layer_bytes = tdm_pd_layer_bytes(&rx->kvc, n)};
    if (tdm_kv_recv_new(&x->kv, rx->kvt, &x->host, &p) != TDM_OK) {
        TDM_LOG_WARN(MOD, "req=%s prefill %s not asked: out of memory", j->request_id, x->t->url);
        return false;
    }
    pthread_mutex_lock(&rx->mu);
    j->offered = x->offered;
    j->receives_busy = false;
    j->writes_closed = false;
    j->peer_restarted = false;
    j->closing_tid = 0;
    j->transfer_id = x->tid;
    snprintf(j->prefill_url, sizeof j->prefill_url, "%s", x->t->url);
    j->result = NULL;
    j->kv_failed = false;
    j->kv_err[0] = '\0';
    j->kv = x->kv;
    j->importing = n > 0;
    j->prefill_instance = x->t->instance; // 0: bound to whoever answers first
    j->prefill_heard = 0;
    pthread_mutex_unlock(&rx->mu);
    return true;
}

// One listed prefill worker: asks it to prefill and push the reserved block
// range [first_block, first_block + num_blocks) of req, hands the frames to
// the attempt's receiver as they come (the reader thread does; a receive
// thread runs a mode's own receives), and on success finishes the import
// with the first token and streams the request to the router (true). On
// failure the blocks stay reserved for the next candidate: the attempt's
// transfer id is retired, so its late frames are dropped.
static bool try_remote(struct djob *j, const Tandem__PrefillTarget *t,
                       struct tdm_engine_request *req, int first_block, int num_blocks)
{
    struct tdm_pd_receiver *rx = j->rx;
    if (t == NULL || t->url == NULL || t->url[0] == '\0' || strlen(t->url) >= sizeof j->prefill_url)
        return false;
    struct remote x = {.j = j,
                       .t = t,
                       .req = req,
                       .first_block = first_block,
                       .num_blocks = num_blocks,
                       .tid = tdm_net_new_instance_id()};
    if (!remote_begin(&x)) {
        free(x.block_ids);
        return false;
    }

    struct tdm_pd_attempt_config ac;
    tdm_pd_attempt_config_default(&ac);
    ac.prefill_timeout = rx->cfg.prefill_timeout;
    ac.transfer_timeout = rx->cfg.transfer_timeout;
    ac.connect_grace = rx->cfg.connect_grace;
    ac.prefill_liveness = rx->cfg.prefill_liveness;
    ac.send_timeout = rx->cfg.send_timeout;
    ac.num_layers = rx->kvc.num_layers;
    tdm_span_begin_child(&x.span, &j->span, "remote_prefill", TDM_SPAN_CLIENT, tdm_now());
    tdm_span_attr_str(&x.span, "tandem.prefill.endpoint", t->url);
    ac.write_quarantine = rx->cfg.write_quarantine;
    recv_offer(&x); // after the attempt's fields: the receive thread reads them
    struct tdm_pd_attempt a;
    bool ok = tdm_pd_attempt_run(&a, &ac, &remote_ops, &x) == TDM_PD_ATTEMPT_COMMITTED;
    if (!recv_end(&x)) {
        // A receive into the reserved blocks may still land: they are never
        // handed on (the job keeps its engine request; see job_main).
        pthread_mutex_lock(&rx->mu);
        j->blocks_unsafe = true;
        pthread_mutex_unlock(&rx->mu);
    }
    if (!ok)
        remote_failed(&x, &a);
    if (x.span.recording) { // not committed: emitted here, failed or cancelled
        x.span.end = tdm_now();
        tdm_span_error(&x.span, a.counted ? a.detail : "cancelled");
        tdm_tracer_emit(rx->parts.tracer, &x.span);
    }
    if (x.res)
        tandem__prefill_result__free_unpacked(x.res, NULL);
    free(x.block_ids);
    pthread_mutex_lock(&rx->mu);
    j->offered = false; // drained (tdm_pd_attempt_run) or complete
    j->closing_tid = 0;
    pthread_mutex_unlock(&rx->mu);
    return ok;
}
_Static_assert(sizeof(int32_t) == sizeof(int), "block ids are passed as int");

enum reserve { RESERVE_OK = 0, RESERVE_DONE, RESERVE_STOPPED };

// Ends an IMPORT_KV request that will never get its KV (every prefill worker
// failed, cancel, deadline): aborted, its import window closed, its finish
// drained without telling the router, released.
static void end_import(struct djob *j, struct tdm_engine_request *req)
{
    struct tdm_pd_receiver *rx = j->rx;
    struct tdm_engine *e = rx->parts.engine;
    tdm_engine_abort(e, req, TDM_FINISH_ABORT);
    // Reserved (now or meanwhile): the abort waits for import_done.
    for (;;) {
        int wrc = tdm_engine_import_wait(req, 0.1, NULL, NULL);
        if (wrc == TDM_OK)
            tdm_engine_import_done(e, req, -1, false);
        if (wrc != TDM_ETIMEDOUT)
            break;
    }
    struct tdm_engine_chunk c;
    while (tdm_engine_stream_next(req, 1.0, &c) != TDM_ECLOSED)
        if (c.finished)
            break;
    job_release(j, req);
}

// Reserves the prompt's blocks on this engine before any prefill worker is
// asked (an IMPORT_KV request whose first token comes later), so the request
// can name the block range it lacks. RESERVE_OK with *out and the range;
// RESERVE_DONE when the request already ended and the router was told (this
// engine cannot take it: local prefill would fail the same way);
// RESERVE_STOPPED when it was cancelled, passed its deadline or the service
// stops (nothing sent to the router yet).
static enum reserve reserve_blocks(struct djob *j, struct tdm_engine_request **out,
                                   int *first_block, int *num_blocks)
{
    struct tdm_pd_receiver *rx = j->rx;
    struct tdm_engine *e = rx->parts.engine;
    char err[512];
    *out = NULL;
    struct tdm_engine_request_params ep;
    fill_params(j, &ep);
    ep.kind = TDM_ENGINE_REQ_IMPORT_KV;
    ep.arrival_time = j->arrival;
    struct tdm_engine_request *req = NULL;
    int rc = tdm_engine_submit(e, &ep, &req, err, sizeof err);
    if (rc != TDM_OK) {
        send_finish(j, true, TDM_FINISH_ERROR, rc, err);
        return RESERVE_DONE;
    }
    pthread_mutex_lock(&rx->mu);
    j->req = req;
    pthread_mutex_unlock(&rx->mu);
    bool stop = false;
    for (;;) {
        rc = tdm_engine_import_wait(req, 0.1, first_block, num_blocks);
        stop = job_stopped(j);
        if (rc != TDM_ETIMEDOUT || stop)
            break;
    }
    if (rc == TDM_OK && !stop) {
        *out = req;
        return RESERVE_OK;
    }
    if (rc == TDM_ECLOSED && !stop) {
        // Finished before its blocks were reserved (too long for the pool):
        // the engine's finish says why.
        stream_local(j, req);
        return RESERVE_DONE;
    }
    end_import(j, req);
    return RESERVE_STOPPED;
}

static void job_free(struct djob *j)
{
    if (j->result)
        tandem__prefill_result__free_unpacked(j->result, NULL);
    tandem__generate_request__free_unpacked(j->gen, NULL);
    free(j);
}

// Ends and emits the job's llm_request span: vLLM's attributes, the engine
// phases of the request that streamed (prefill among them when it was local)
// and the first token sent.
static void trace_job(struct djob *j)
{
    struct tdm_span *sp = &j->span;
    if (!sp->recording)
        return;
    struct tdm_tracer *t = j->rx->parts.tracer;
    tdm_span_attr_str(sp, "gen_ai.request.id", j->request_id);
    tdm_span_attr_str(sp, "gen_ai.response.model", j->rx->parts.served_name);
    tdm_span_attr_int(sp, "gen_ai.request.max_tokens", j->gen->max_tokens);
    tdm_span_attr_int(sp, "gen_ai.usage.prompt_tokens",
                      j->prompt_tokens ? j->prompt_tokens : (int64_t)j->gen->n_prompt);
    tdm_span_attr_int(sp, "gen_ai.usage.completion_tokens", j->completion_tokens);
    tdm_span_attr_int(sp, "tandem.cached_tokens", j->cached_tokens);
    tdm_span_attr_str(sp, "tandem.prefill", j->remote_prefilled ? "remote" : "local");
    if (j->finished) {
        struct tdm_trace_phases ph = {j->times.arrival, j->times.first_scheduled,
                                      j->times.first_token, j->times.last_token,
                                      j->remote_prefilled ? NULL : "prefill"};
        tdm_tracer_emit_phases(t, sp, &ph);
    }
    if (j->t_first_sent > 0)
        tdm_span_attr_double(sp, "gen_ai.latency.time_to_first_token",
                             j->t_first_sent - j->arrival);
    sp->end = tdm_now();
    tdm_span_attr_double(sp, "gen_ai.latency.e2e", sp->end - j->arrival);
    tdm_tracer_emit(t, sp);
}

// Takes j out of rx->jobs and wakes tdm_pd_receiver_free, which waits for the
// list to empty. After this nothing else can reach j.
static void job_unlist(struct djob *j)
{
    struct tdm_pd_receiver *rx = j->rx;
    pthread_mutex_lock(&rx->mu);
    for (struct djob **pp = &rx->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == j) {
            *pp = j->next;
            rx->num_jobs--;
            break;
        }
    }
    pthread_cond_broadcast(&rx->cv);
    pthread_mutex_unlock(&rx->mu);
}

static void *job_main(void *arg)
{
    struct djob *j = arg;
    struct tdm_pd_receiver *rx = j->rx;
    bool done = false;
    if (j->gen->n_prefill > 0) {
        struct tdm_engine_request *req = NULL;
        int first_block = 0, num_blocks = 0;
        enum reserve rv = reserve_blocks(j, &req, &first_block, &num_blocks);
        done = rv == RESERVE_DONE;
        size_t budget = tdm_pd_attempt_budget(j->gen->n_prefill, j->gen->max_prefill_attempts);
        for (size_t i = 0; rv == RESERVE_OK && i < budget && !done; i++) {
            if (job_stopped(j) || j->blocks_unsafe)
                break;
            done = try_remote(j, j->gen->prefill[i], req, first_block, num_blocks);
        }
        pthread_mutex_lock(&rx->mu);
        bool unsafe = j->blocks_unsafe;
        pthread_mutex_unlock(&rx->mu);
        if (rv == RESERVE_OK && done) {
            job_release(j, req);
        } else if (rv == RESERVE_OK && unsafe) {
            // Never ended, so its blocks are never reused (leaked on purpose:
            // only a broken device context gets here).
            pthread_mutex_lock(&rx->mu);
            j->req = NULL;
            pthread_mutex_unlock(&rx->mu);
        } else if (rv == RESERVE_OK) {
            end_import(j, req); // every listed worker failed: the blocks go back
        }
    }
    if (!done) {
        pthread_mutex_lock(&rx->mu);
        bool cancelled = j->cancelled || atomic_load(&rx->net.stopping);
        pthread_mutex_unlock(&rx->mu);
        if (cancelled)
            send_finish(j, true, TDM_FINISH_ABORT, 0, "cancelled");
        else if (tdm_now() > j->deadline)
            send_finish(j, true, TDM_FINISH_ERROR, TDM_ETIMEDOUT, "the request's deadline passed");
        else if (j->gen->n_prefill == 0 || j->gen->local_fallback) {
            tdm_metrics_counter_inc(tdm_metrics_counter_labels(
                rx->m.requests, j->gen->n_prefill ? "fallback" : "local"));
            run_local(j);
        } else
            send_finish(j, true, TDM_FINISH_ERROR, TDM_ETRANSPORT,
                        "every listed prefill worker failed");
    }
    // Traced while still listed: trace_job reads rx, which
    // tdm_pd_receiver_free frees once the list is empty.
    trace_job(j);
    job_unlist(j);
    job_free(j);
    return NULL;
}

// ---- receive thread ----------------------------------------------------------------------
// A GenerateRequest refused before any job thread: the router is told, the
// span ends failed, the job is freed.
static void refuse(struct djob *j, int code, const char *message)
{
    send_finish(j, false, TDM_FINISH_ERROR, code, message);
    tdm_span_error(&j->span, message);
    trace_job(j);
    job_free(j);
}

static void on_generate(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_receiver *rx = arg;
    Tandem__GenerateRequest *g = tandem__generate_request__unpack(NULL, f->msg_len, f->msg);
    if (g == NULL) {
        TDM_LOG_WARN(MOD, "undecodable GenerateRequest dropped");
        return;
    }
    if ((g->to_instance != 0 && g->to_instance != rx->net.instance) || g->reply_to == NULL ||
        g->reply_to->url == NULL || g->reply_to->url[0] == '\0' ||
        strlen(g->reply_to->url) >= sizeof(((struct djob *)0)->router_url)) {
        tandem__generate_request__free_unpacked(g, NULL);
        return;
    }
    struct djob *j = calloc(1, sizeof *j);
    if (j == NULL) {
        tandem__generate_request__free_unpacked(g, NULL);
        return;
    }
    j->rx = rx;
    j->gen = g;
    snprintf(j->request_id, sizeof j->request_id, "%s", g->request_id);
    snprintf(j->router_url, sizeof j->router_url, "%s", g->reply_to->url);
    j->router_instance = g->reply_to->instance;
    j->arrival = tdm_now();
    if (rx->parts.tracer) {
        // The router's attempt span is the parent; a missing or malformed one
        // starts a new trace, as on the HTTP side.
        struct tdm_trace_ctx parent;
        tdm_trace_ctx_from_headers(g->traceparent && g->traceparent[0] ? g->traceparent : NULL,
                                   g->tracestate, &parent);
        tdm_span_begin(&j->span, rx->parts.tracer, &parent, "llm_request", TDM_SPAN_SERVER,
                       j->arrival);
    }
    double left = g->deadline_unix > 0 ? g->deadline_unix - (double)time(NULL) : 600;
    j->deadline = j->arrival + (left > 0 ? left : 0);
    char err[256];
    if (!tdm_worker_ready(rx->server)) {
        refuse(j, TDM_ECLOSED, "decode worker is not ready (loading or draining)");
        return;
    }
    if (tdm_pd_sampling_from_proto(g->sampling, &j->sampling, err, sizeof err) != TDM_OK ||
        g->n_prompt == 0 || g->n_eos_ids > 64) {
        refuse(j, TDM_EINVAL, g->n_prompt == 0 ? "empty prompt" : err);
        return;
    }
    if (g->want_prompt_logprobs && (g->n_prefill > 0 || g->n_resume_tokens > 0)) {
        refuse(j, TDM_EINVAL,
               "prompt logprobs with prefill targets or resume_tokens (such a request is "
               "prefilled here, from its prompt alone)");
        return;
    }
    if (g->n_resume_tokens > 0) {
        // A migrated stream: computed here from prompt + the tokens the client
        // has, as one prompt whose tail the sampler replays (fill_params).
        const char *why = NULL;
        if (g->n_prefill > 0)
            why = "resume_tokens with prefill targets (a resumed stream is prefilled locally)";
        else if (g->max_tokens > 0 && (size_t)g->max_tokens <= g->n_resume_tokens)
            why = "resume_tokens leave nothing to generate within max_tokens";
        int32_t *joined = why ? NULL : malloc((g->n_prompt + g->n_resume_tokens) * sizeof *joined);
        if (joined == NULL) {
            send_finish(j, false, TDM_FINISH_ERROR, why ? TDM_EINVAL : TDM_ENOMEM,
                        why ? why : "out of memory");
            job_free(j);
            return;
        }
        memcpy(joined, g->prompt, g->n_prompt * sizeof *joined);
        memcpy(joined + g->n_prompt, g->resume_tokens, g->n_resume_tokens * sizeof *joined);
        free(g->prompt); // protobuf-c's default allocator is malloc: free_unpacked frees joined
        g->prompt = joined;
        g->n_prompt += g->n_resume_tokens;
        j->n_resume = (int)g->n_resume_tokens;
    }
    pthread_mutex_lock(&rx->mu);
    for (struct djob *o = rx->jobs; o; o = o->next) {
        if (strcmp(o->request_id, j->request_id) == 0 && o->router_instance == j->router_instance) {
            pthread_mutex_unlock(&rx->mu);
            refuse(j, TDM_EINVAL, "duplicate request id");
            return;
        }
    }
    j->next = rx->jobs;
    rx->jobs = j;
    rx->num_jobs++;
    pthread_mutex_unlock(&rx->mu);
    if (tdm_thread_start_detached(job_main, j) != TDM_OK) {
        // Never run inline: this is the connection's only reader, so every
        // later frame of the router (this request's Cancel too) would wait
        // for the whole request. Refused instead; the client may retry (503).
        job_unlist(j);
        TDM_LOG_WARN(MOD, "req=%s refused: cannot start a job thread", j->request_id);
        refuse(j, TDM_EBUSY, "cannot start a thread for the request (out of threads); try again");
    }
}

// The job whose current attempt is transfer tid, for a message addressed to this
// instance (caller holds rx->mu); NULL for any other.
static struct djob *find_attempt(struct tdm_pd_receiver *rx, uint64_t to_instance, uint64_t tid)
{
    if (to_instance != rx->net.instance)
        return NULL;
    for (struct djob *j = rx->jobs; j; j = j->next)
        if (j->transfer_id == tid && tid != 0)
            return j;
    return NULL;
}

static void on_result(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_receiver *rx = arg;
    Tandem__PrefillResult *r = tandem__prefill_result__unpack(NULL, f->msg_len, f->msg);
    if (r == NULL)
        return;
    pthread_mutex_lock(&rx->mu);
    struct djob *j = find_attempt(rx, r->to_instance, r->transfer_id);
    // An error result is taken from any instance (it only makes the job move
    // on: a restarted worker refuses a request for its predecessor); an ok one
    // only from the instance that sends this transfer's KV.
    if (j && j->result == NULL && r->error == 0 && j->prefill_instance != 0 &&
        r->from_instance != j->prefill_instance)
        j = NULL;
    if (j && j->result == NULL) {
        if (r->error == 0 && j->prefill_instance == 0)
            j->prefill_instance = r->from_instance;
        j->result = r;
        j->version++;
        r = NULL;
        pthread_cond_broadcast(&rx->cv);
    }
    pthread_mutex_unlock(&rx->mu);
    if (r)
        tandem__prefill_result__free_unpacked(r, NULL);
}

// The closed frame of a retired attempt whose copies were awaited (caller
// holds rx->mu): the job it belongs to, or NULL.
static struct djob *find_closing(struct tdm_pd_receiver *rx, const Tandem__KvData *d)
{
    if (!d->closed || d->to_instance != rx->net.instance || d->transfer_id == 0)
        return NULL;
    for (struct djob *o = rx->jobs; o; o = o->next)
        if (o->closing_tid == d->transfer_id &&
            (o->prefill_instance == 0 || o->prefill_instance == d->from_instance))
            return o;
    return NULL;
}

// KvData from a prefill worker: checked against the job's current attempt
// (instance, sender, state), then handed to the table of the transport it
// names (kv_transport.h), which checks it against the transfer and lands or
// counts its layers in the attempt's receiver. Under rx->mu, so a job that
// gives up cannot end the import while a layer is being written.
static void on_kv_data(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_receiver *rx = arg;
    Tandem__KvData *d = tandem__kv_data__unpack(NULL, f->msg_len, f->msg);
    if (d == NULL)
        return;
    pthread_mutex_lock(&rx->mu);
    struct djob *j = find_attempt(rx, d->to_instance, d->transfer_id);
    if (j == NULL && (j = find_closing(rx, d)) != NULL) {
        j->writes_closed = true;
        j->closing_tid = 0;
        goto signal;
    }
    if (j == NULL)
        goto out;
    if (d->closed && (j->prefill_instance == 0 || d->from_instance == j->prefill_instance))
        j->writes_closed = true; // also for a frame refused below
    if (!j->importing || j->kv_failed)
        goto signal;
    if (j->prefill_instance == 0)
        j->prefill_instance = d->from_instance; // the attempt's sender from now on
    if (d->from_instance != j->prefill_instance)
        goto out;
    if (d->error == 0 && d->num_layers == 0 && d->closed)
        goto signal; // a bare closed frame: nothing to import
    char err[sizeof j->kv_err];
    const struct tdm_kv_transport_ops *mode = tdm_kv_recv_table(d->transport, err, sizeof err);
    struct tdm_kv_recv_frame kf = {.first_layer = d->first_layer,
                                   .num_layers = d->num_layers,
                                   .first_block = d->first_block,
                                   .num_blocks = d->num_blocks,
                                   .payload = f->payload,
                                   .payload_len = f->payload_len,
                                   .why = d->transport_why};
    if (d->error != 0) {
        j->kv_failed = true;
        snprintf(j->kv_err, sizeof j->kv_err, "prefill worker: %s", d->message);
    } else if (mode == NULL) {
        // No table can check it: the transfer fails (the attempt cancels the
        // prefill worker's job and moves on). Whether it writes in place is
        // unknown too, so it says nothing about writes closed.
        j->kv_failed = true;
        snprintf(j->kv_err, sizeof j->kv_err, "%s", err);
    } else {
        if (!mode->in_place)
            j->writes_closed = true; // KV in the payload: this transfer writes nothing in place
        if (mode->frame(j->kv, &kf, err, sizeof err) != TDM_OK) {
            j->kv_failed = true;
            snprintf(j->kv_err, sizeof j->kv_err, "%s", err);
        }
    }
signal:
    j->version++;
    pthread_cond_broadcast(&rx->cv);
out:
    pthread_mutex_unlock(&rx->mu);
    tandem__kv_data__free_unpacked(d, NULL);
}

static void on_cancel(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_receiver *rx = arg;
    Tandem__Cancel *m = tandem__cancel__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL)
        return;
    pthread_mutex_lock(&rx->mu);
    if (m->to_instance == rx->net.instance || m->to_instance == 0) {
        for (struct djob *j = rx->jobs; j; j = j->next) {
            if (strcmp(j->request_id, m->request_id) == 0) {
                j->cancelled = true;
                j->version++;
                if (j->req)
                    tdm_engine_abort(rx->parts.engine, j->req, TDM_FINISH_ABORT);
            }
        }
        pthread_cond_broadcast(&rx->cv);
    }
    pthread_mutex_unlock(&rx->mu);
    tandem__cancel__free_unpacked(m, NULL);
}

// A prefill worker's answer to the liveness probe of an attempt (seq = transfer id).
static void on_load_report(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_receiver *rx = arg;
    Tandem__LoadReport *r = tandem__load_report__unpack(NULL, f->msg_len, f->msg);
    if (r == NULL)
        return;
    pthread_mutex_lock(&rx->mu);
    struct djob *j = find_attempt(rx, r->to_instance, r->seq);
    for (struct djob *o = rx->jobs; o && j == NULL && r->to_instance == rx->net.instance; o = o->next)
        if (o->closing_tid != 0 && o->closing_tid == r->seq)
            j = o; // a retired attempt awaiting its closed frame
    if (j) {
        j->prefill_heard = tdm_now();
        if (j->prefill_instance != 0 && r->instance != 0 && r->instance != j->prefill_instance)
            j->peer_restarted = true; // the old process, and its copies, are gone
        j->version++;
    }
    pthread_mutex_unlock(&rx->mu);
    tandem__load_report__free_unpacked(r, NULL);
}

// Takes the engine's pending KV events for a load report and keeps each hash's
// last event only (newest first), so the router may apply the stored and the
// evicted list in either order. Every report gets the next batch number: a
// report that never arrives shows up as a gap and the router resyncs.
static void fill_kv_events(struct tdm_pd_receiver *rx, struct tdm_pd_load *load)
{
    if (tdm_engine_get_config(rx->parts.engine)->kv_event_capacity <= 0)
        return;
    bool overflow = false;
    int n = tdm_engine_take_kv_events(rx->parts.engine, rx->kev, KV_EVENTS_PER_REPORT, &overflow);
    size_t ns = 0, ne = 0;
    for (int i = n - 1; i >= 0; i--) {
        bool later = false;
        for (int j = i + 1; j < n && !later; j++)
            later = rx->kev[j].hash == rx->kev[i].hash;
        if (later)
            continue;
        if (rx->kev[i].kind == TDM_KV_EVENT_STORED)
            rx->kev_stored[ns++] = rx->kev[i].hash;
        else
            rx->kev_evicted[ne++] = rx->kev[i].hash;
    }
    load->has_kv_events = true;
    load->kv_cleared = overflow;
    load->kv_batch = ++rx->kev_batch;
    load->kv_stored = rx->kev_stored;
    load->n_kv_stored = ns;
    load->kv_evicted = rx->kev_evicted;
    load->n_kv_evicted = ne;
}

// The load this worker reports to a router's liveness/load query.
static void fill_load(void *arg, struct tdm_pd_load *load)
{
    struct tdm_pd_receiver *rx = arg;
    struct tdm_engine_stats st;
    tdm_engine_get_stats(rx->parts.engine, &st);
    tdm_pd_service_load(&rx->net, &st, "decode", rx->parts.served_name, load);
    load->held = st.num_importing;
    fill_kv_events(rx, load);
}

static const struct tdm_pd_metric_names metric_names = {
    .bytes = {"tandem:kv_received_bytes_total",
              "KV bytes received from prefill workers and installed."},
    .blocks = {"tandem:kv_received_blocks_total",
               "KV blocks received from prefill workers and installed."},
    .requests = {"tandem:pd_requests_total",
                 "Router requests by where the prompt was prefilled (remote, local, fallback)."},
    .requests_label = "prefill",
    .failures = {"tandem:pd_prefill_failures_total",
                 "Remote prefill attempts that failed, by reason."},
    .seconds = {"tandem:kv_receive_seconds",
                "Seconds from the first KvData frame received to the last layer installed."},
};

static void health_details(void *arg, char *buf, size_t len)
{
    struct tdm_pd_receiver *rx = arg;
    tdm_kv_transport_health(rx->kvt, buf, len);
}

// --kv-transfer on the decode side: when CUDA IPC is allowed and our KV pool
// is one device allocation, its IPC handle is made once here and offered with
// every PrefillRequest (with the reserved block ids); otherwise KV comes over nng.
static int receiver_kvx_init(struct tdm_pd_receiver *rx, struct tdm_worker *server, char *err,
                             size_t errlen)
{
    int num_blocks = tdm_kv_config(tdm_engine_kv(rx->parts.engine))->num_blocks;
    struct tdm_kv_device_pool dp;
    int rc = tdm_worker_kv_transport_new(server, TDM_KVX_DECODE, rx->cfg.kvx_ops,
                                         rx->cfg.nccl_timeout, &rx->kvt, &dp);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "pd: out of memory");
    // The pool descriptor: its geometry serves NCCL too (the handle only IPC).
    struct tdm_kvx_pool pool = {
        .bytes = dp.bytes,
        .layer_stride = dp.layer_stride,
        .v_offset = dp.v_offset,
        .block_bytes = dp.block_bytes,
        .num_layers = (uint32_t)rx->kvc.num_layers,
        .num_blocks = (uint32_t)num_blocks,
        .elem_bytes = (uint32_t)dp.elem_bytes,
    };
    rx->kv_pool_len = tdm_kv_transport_offer_pool(rx->kvt, pool, rx->kv_pool);
    static const char *const transport[] = {"transport"};
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    o.name = "tandem:kv_transfers_total";
    o.help = "KV transfers received and installed, by transport (nng, cuda-ipc, nccl).";
    o.label_names = transport;
    o.n_label_names = 1;
    rc = tdm_metrics_counter_register(&rx->transfers, rx->parts.reg, &o, err, errlen);
    if (rc != TDM_OK)
        return rc;
    tdm_worker_set_health_details(server, health_details, rx);
    return TDM_OK;
}

int tdm_pd_receiver_new(struct tdm_pd_receiver **out, struct tdm_worker *server,
                        const struct tdm_pd_receiver_config *cfg, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_pd_receiver *rx = calloc(1, sizeof *rx);
    if (rx == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "pd: out of memory");
    rx->cfg = *cfg;
    rx->server = server;
    pthread_mutex_init(&rx->mu, NULL);
    tdm_cond_init(&rx->cv);
    int rc = tdm_worker_parts(server, &rx->parts);
    if (rc != TDM_OK) {
        tdm_seterr(err, errlen, rc, "pd: the server is not loaded");
        goto fail;
    }
    tdm_model_kv_config(rx->parts.model, &rx->kvc);
    rx->kvc.block_size = rx->parts.block_size;
    // Our pool's dtype: what the PrefillRequest's kv header asks the prefill
    // worker to send (it converts when its pool differs).
    rx->kvc.dtype = tdm_engine_kv_dtype(rx->parts.engine);
    rc = tdm_pd_metrics_register(&rx->m, rx->parts.reg, &metric_names, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    rc = receiver_kvx_init(rx, server, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    struct tdm_pd_service_config net = {
        .url = cfg->nng_url,
        .module = MOD,
        .on =
            {
                [TDM_NET_GENERATE] = on_generate,
                [TDM_NET_PREFILL_RESULT] = on_result,
                [TDM_NET_KV_DATA] = on_kv_data,
                [TDM_NET_CANCEL] = on_cancel,
                [TDM_NET_LOAD_REPORT] = on_load_report,
            },
        .fill_load = fill_load,
        .arg = rx,
        // A router that stops reading slows its streams; one that takes no
        // byte for router_liveness is gone (stream_to_router).
        .stall_s = cfg->router_liveness,
    };
    rc = tdm_pd_service_init(&rx->net, &net, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    *out = rx;
    return TDM_OK;
fail:
    tdm_worker_set_health_details(server, NULL, NULL);
    tdm_kv_transport_free(rx->kvt);
    pthread_cond_destroy(&rx->cv);
    pthread_mutex_destroy(&rx->mu);
    free(rx);
    return rc;
}

void tdm_pd_receiver_free(struct tdm_pd_receiver *rx)
{
    if (rx == NULL)
        return;
    tdm_pd_service_stop(&rx->net);
    pthread_mutex_lock(&rx->mu);
    for (struct djob *j = rx->jobs; j; j = j->next) {
        j->cancelled = true;
        j->version++;
        if (j->req)
            tdm_engine_abort(rx->parts.engine, j->req, TDM_FINISH_ABORT);
    }
    pthread_cond_broadcast(&rx->cv);
    while (rx->num_jobs > 0)
        pthread_cond_wait(&rx->cv, &rx->mu);
    pthread_mutex_unlock(&rx->mu);
    tdm_pd_service_fini(&rx->net);
    tdm_worker_set_health_details(rx->server, NULL, NULL);
    tdm_kv_transport_free(rx->kvt);
    pthread_cond_destroy(&rx->cv);
    pthread_mutex_destroy(&rx->mu);
    free(rx);
}
