// SPDX-License-Identifier: Apache-2.0
// router_impl: what the request path's files share (router.c: the server's
// lifecycle and plain routes; router_opts.c: flags; router_inbox.c: the
// inbox's frames, the open-stream table and the load poller; router_call.c:
// one API call, its attempts, retries and migrations). Not for other modules.
#ifndef TDM_ROUTER_IMPL_H
#define TDM_ROUTER_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "control.h"
#include "http.h"
#include "openai.h"
#include "pd_codec.h"
#include "router.h"
#include "text.h"
#include "trace.h"
#include "transport.h"

#define STREAM_BUCKETS 1024 // buckets of the open-stream table (a power of two)

// ---- server state ------------------------------------------------------------------------------
// One choice's upstream stream: chunks the inbox's connection readers
// received for it (on_tokens), read by its call's thread (pump) a batch at a time.
struct rstream {
    struct rstream *next; // in its bucket of s->streams
    char request_id[128];
    uint64_t ep_id;
    uint64_t instance; // the decode worker's instance (0 until known)
    double started;
    double heard;           // tdm_now() of its last chunk from the decode worker (under s->mu)
    pthread_cond_t *cv;     // the reading call's: signalled when the queue stops being empty
    Tandem__TokenChunk **q; // [qn] received, not yet read (under s->mu)
    size_t qn, qcap;
    bool overflow;
    // on_tokens calls past their unlock that have yet to signal cv: the
    // signal goes after the unlock (a thread woken while the waker still
    // holds s->mu would only block on it again: a futex round trip and a
    // context switch per chunk), so stream_unregister waits for them before
    // the call may destroy cv.
    atomic_int signalling;
};

struct tdm_router_server {
    struct tdm_router_opts o;
    uint64_t instance;
    struct tdm_http_server *http;
    struct tdm_metrics_registry *reg;
    struct tdm_router_control *ctl;
    struct tdm_router_metrics *rm; // the control plane's (may be NULL)
    struct tdm_net_inbox *inbox;
    struct tdm_net_outbox *outbox;
    struct tdm_net_outbox *poll_outbox; // LoadQuery only: never behind the calls' sends
    pthread_t poll_thread;
    bool poll_started;
    atomic_bool stopping;
    atomic_bool draining; // drain began: no new API requests, /health 503
    _Atomic int inflight; // API handlers running (the drain waits for 0)
    // The poller's last round (tdm_now()), and when it last found the router
    // itself had stalled (a gap longer than a round plus the liveness timeout:
    // SIGSTOP, a starved machine); worker liveness counts from no earlier.
    _Atomic double poll_tick, resumed_at;

    // text side (common/text)
    struct tdm_text text;
    char model_path[1024]; // the folder --model names (a Hub id resolved to the HF cache)
    struct tdm_oai_model_info info;
    int max_model_len;
    int32_t eos_ids[2 * TDM_MAX_EOS];
    int num_eos;
    int64_t created;

    pthread_mutex_t mu; // streams and their queues
    // Open streams by request id, hashed (a chunk finds its stream without
    // walking every open one under mu: 100 strcmp per chunk at 100 streams).
    struct rstream *streams[STREAM_BUCKETS];

    struct tdm_metrics_counter *m_requests_by; // {decision, endpoint}
    struct tdm_metrics_counter *m_lost;        // decode lost mid-stream
    struct tdm_metrics_counter *m_migrations;  // streams continued on another decode worker
    struct tdm_tracer *tracer;                 // NULL = tracing off
};

static inline void router_nng_url_of(const char *host, int port, char *out, size_t cap)
{
    if (strchr(host, ':'))
        snprintf(out, cap, "tcp://[%s]:%d", host, port);
    else
        snprintf(out, cap, "tcp://%s:%d", host, port);
}

// The endpoint's liveness now: instance, last report time, unanswered queries
// (all 0 when never heard of); one registry entry.
static inline void router_live_get(struct tdm_router_server *s, uint64_t id,
                                   struct tdm_router_liveness *live)
{
    tdm_router_endpoints_liveness(tdm_router_control_endpoints(s->ctl), id, live);
}

// ---- router_inbox.c ----------------------------------------------------------------------------
// The inbox's frame handler (on its connection reader threads): TokenChunks
// into their streams, LoadReports into the endpoint registry.
void router_on_frame(void *arg, const struct tdm_net_frame *f);
// The load poller thread: a LoadQuery to every endpoint each --load-interval.
void *router_poll_main(void *arg);
// Files st in the open-stream table (chunks for its request id reach it) /
// takes it out, waits for readers still signalling it and frees it (NULL: none).
void router_stream_register(struct tdm_router_server *s, struct rstream *st);
void router_stream_unregister(struct tdm_router_server *s, struct rstream *st);

// ---- router_call.c -----------------------------------------------------------------------------
// One completions or chat call on its HTTP worker thread, answered whole.
void router_handle_generate(struct tdm_router_server *s, struct tdm_http_conn *c,
                            enum tdm_oai_kind kind);

#endif
