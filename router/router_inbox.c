// SPDX-License-Identifier: Apache-2.0
// router_inbox: the router's side of nng. The inbox's connection reader threads
// file incoming TokenChunks into their streams as they are read (by request
// id, hashed, checking the sender's instance id) and LoadReports into the
// endpoint registry (tdm_router_endpoints_on_report); the poller thread sends
// LoadQuery to every endpoint with the endpoint's id as seq and notices when
// the router itself stalled. A new instance id means the worker restarted: the
// registry clears its prefix index and streams bound to the old instance fail
// at their next liveness check.

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "pd_codec.h"
#include "router_impl.h"
#include "transport.h"

#define MOD "router"
#define MAX_EPS 512

// ---- inbox and poller threads ------------------------------------------------------------------
// The bucket of request id `id` (FNV-1a).
static struct rstream **stream_bucket(struct tdm_router_server *s, const char *id)
{
    uint32_t h = 2166136261u;
    for (const unsigned char *c = (const unsigned char *)id; *c; c++)
        h = (h ^ *c) * 16777619u;
    return &s->streams[h & (STREAM_BUCKETS - 1)];
}

// The open stream of request id `id`, or NULL (under s->mu).
static struct rstream *stream_find(struct tdm_router_server *s, const char *id)
{
    for (struct rstream *st = *stream_bucket(s, id); st; st = st->next)
        if (strcmp(st->request_id, id) == 0)
            return st;
    return NULL;
}

static void on_tokens(struct tdm_router_server *s, const struct tdm_net_frame *f)
{
    Tandem__TokenChunk *m = tandem__token_chunk__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL)
        return;
    if (m->to_instance != s->instance) {
        tandem__token_chunk__free_unpacked(m, NULL);
        return;
    }
    pthread_cond_t *wake = NULL;
    pthread_mutex_lock(&s->mu);
    struct rstream *st = stream_find(s, m->request_id);
    if (st && st->instance == 0)
        st->instance = m->from_instance;
    if (st && st->instance == m->from_instance) {
        st->heard = tdm_now();
        // Chunks already waiting mean the reader was woken for them and
        // takes this one with them (pump takes a queue whole).
        bool was_empty = st->qn == 0 && !st->overflow;
        if (st->qn == st->qcap && st->qcap < 1u << 19) // at most 2^19 chunks queued
            tdm_grow(&st->q, &st->qcap, st->qn + 1, sizeof *st->q, 16); // checked below
        if (st->qn < st->qcap) {
            st->q[st->qn++] = m;
            m = NULL;
        } else {
            st->overflow = true;
        }
        if (was_empty) {
            wake = st->cv;
            atomic_fetch_add(&st->signalling, 1);
        }
    }
    pthread_mutex_unlock(&s->mu);
    if (wake) {
        pthread_cond_signal(wake);            // one reader per call: wake only it
        atomic_fetch_sub(&st->signalling, 1); // the last touch of st (stream_unregister)
    }
    if (m)
        tandem__token_chunk__free_unpacked(m, NULL);
}

// A LoadReport answers the poller's LoadQuery, whose seq was the endpoint id.
static void on_load_report(struct tdm_router_server *s, const struct tdm_net_frame *f)
{
    Tandem__LoadReport *r = tandem__load_report__unpack(NULL, f->msg_len, f->msg);
    if (r == NULL)
        return;
    uint64_t ep_id = r->seq;
    if (r->to_instance == s->instance && ep_id != 0) {
        const Tandem__KvEvents *kev = r->kv_events;
        struct tdm_router_report rep = {
            .instance = r->instance,
            .load = {r->running, r->waiting, r->kv_usage, r->max_waiting, r->max_running},
            .has_kv_events = kev != NULL,
            .kv_batch = kev ? kev->batch : 0,
            .kv_cleared = kev && kev->cleared,
            .stored = kev ? kev->stored : NULL,
            .n_stored = kev ? kev->n_stored : 0,
            .evicted = kev ? kev->evicted : NULL,
            .n_evicted = kev ? kev->n_evicted : 0,
        };
        bool restarted = false, resynced = false;
        tdm_router_endpoints_on_report(tdm_router_control_endpoints(s->ctl), ep_id, &rep,
                                       &restarted, &resynced);
        tdm_router_control_load_changed(s->ctl); // flow control: requests may go
        // Streams of an old instance fail at their next liveness check.
        if (restarted)
            TDM_LOG_INFO(MOD, "endpoint id=%llu restarted (new instance %016llx)",
                         (unsigned long long)ep_id, (unsigned long long)r->instance);
        if (resynced)
            TDM_LOG_INFO(MOD, "endpoint id=%llu: KV events lost, prefix index rebuilt",
                         (unsigned long long)ep_id);
    }
    tandem__load_report__free_unpacked(r, NULL);
}

void router_on_frame(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_router_server *s = arg;
    if (f->type == TDM_NET_TOKENS)
        on_tokens(s, f);
    else if (f->type == TDM_NET_LOAD_REPORT)
        on_load_report(s, f);
}

void *router_poll_main(void *arg)
{
    struct tdm_router_server *s = arg;
    struct tdm_router_endpoint_view *views = calloc(MAX_EPS, sizeof *views);
    if (views == NULL)
        return NULL;
    while (!atomic_load(&s->stopping)) {
        double now = tdm_now(), prev = atomic_load(&s->poll_tick);
        if (prev > 0 && now - prev > s->o.load_interval + s->o.liveness_timeout) {
            atomic_store(&s->resumed_at, now); // before the tick: see upstream_alive
            TDM_LOG_WARN(MOD,
                         "the router itself stalled for %.1f s: worker liveness counted from now",
                         now - prev);
        }
        atomic_store(&s->poll_tick, now);
        size_t n = tdm_router_endpoints_list(tdm_router_control_endpoints(s->ctl), views, MAX_EPS);
        if (n > MAX_EPS)
            n = MAX_EPS;
        for (size_t i = 0; i < n; i++) {
            Tandem__LoadQuery q = TANDEM__LOAD_QUERY__INIT;
            Tandem__Peer me = TANDEM__PEER__INIT;
            me.url = (char *)tdm_net_inbox_url(s->inbox);
            me.instance = s->instance;
            q.reply_to = &me;
            q.seq = views[i].id; // echoed back as LoadReport.seq: the report's endpoint
            char url[300], err[256];
            router_nng_url_of(views[i].host, views[i].nng_port, url, sizeof url);
            tdm_pd_send(s->poll_outbox, url, TDM_NET_LOAD_QUERY, &q.base, NULL, 0, 0, err,
                        sizeof err);
            // Its inbox refusing our handshake (another secret) takes it out of
            // routing with reason "auth"; a link that comes up or goes down
            // (refused: a dead worker) says nothing against the secret.
            char why[200];
            enum tdm_net_link link = tdm_net_link_state(s->poll_outbox, url, why, sizeof why);
            if (link != TDM_NET_LINK_UNKNOWN)
                tdm_router_endpoints_set_auth(
                    tdm_router_control_endpoints(s->ctl), views[i].id, link == TDM_NET_LINK_AUTH,
                    link == TDM_NET_LINK_AUTH ? why
                    : link == TDM_NET_LINK_UP ? "the handshake passes"
                                              : "its inbox is not reachable");
            // Its link down before it ever reported: not up, no candidate
            // (endpoints.h, tdm_router_endpoint_not_up); unknown = not dialed yet.
            if (link != TDM_NET_LINK_UNKNOWN)
                tdm_router_endpoints_set_link_down(tdm_router_control_endpoints(s->ctl),
                                                   views[i].id, link == TDM_NET_LINK_DOWN);
            // Asked, delivered or not (a dead worker's connection is refused):
            // what liveness counts is that the router was running to ask.
            tdm_router_endpoints_note_query(tdm_router_control_endpoints(s->ctl), views[i].id,
                                            tdm_now());
        }
        struct timespec ts = {
            (time_t)s->o.load_interval,
            (long)((s->o.load_interval - (double)(time_t)s->o.load_interval) * 1e9)};
        nanosleep(&ts, NULL);
    }
    free(views);
    return NULL;
}

void router_stream_register(struct tdm_router_server *s, struct rstream *st)
{
    pthread_mutex_lock(&s->mu);
    struct rstream **bucket = stream_bucket(s, st->request_id);
    st->next = *bucket;
    *bucket = st;
    pthread_mutex_unlock(&s->mu);
}

void router_stream_unregister(struct tdm_router_server *s, struct rstream *st)
{
    if (st == NULL)
        return;
    pthread_mutex_lock(&s->mu);
    for (struct rstream **pp = stream_bucket(s, st->request_id); *pp; pp = &(*pp)->next) {
        if (*pp == st) {
            *pp = st->next;
            break;
        }
    }
    pthread_mutex_unlock(&s->mu);
    while (atomic_load(&st->signalling) > 0) // an on_tokens between unlock and signal
        sched_yield();
    for (size_t i = 0; i < st->qn; i++)
        tandem__token_chunk__free_unpacked(st->q[i], NULL);
    free(st->q);
    free(st);
}
