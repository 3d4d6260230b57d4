// SPDX-License-Identifier: Apache-2.0
// router: the request path of tandem-router (see router.h). HTTP worker threads
// parse, tokenize, route and then read their choices' upstream streams; the
// inbox's connection reader threads file incoming TokenChunks into those
// streams as they are read (by request id, hashed, checking the sender's
// instance id; no inbox thread between) and LoadReports into the endpoint
// registry (tdm_router_endpoints_on_report: load, liveness, instance id, KV
// events, all kept there); the poller thread sends LoadQuery to every
// endpoint with the endpoint's id as seq. A new instance id means the worker
// restarted: the registry clears its prefix index and streams bound to the
// old instance fail at their next liveness check.
//
// The OpenAI response shaping (detokenization, stop strings, logprobs, echo,
// usage, SSE) is the decode worker's own (common/openai's tdm_oai_call,
// common/openai's tdm_oai_http_stream) so that text through the router equals
// text from the decode worker alone; this file feeds it TokenChunks.
#include "router.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat.h"
#include "control.h"
#include "core.h"
#include "hf.h"
#include "http.h"
#include "metrics.h"
#include "openai.h"
#include "openai_front.h"
#include "openai_http.h"
#include "pd_codec.h"
#include "retry.h"
#include "router_stream.h"
#include "text.h"
#include "tokenizer.h"
#include "trace.h"
#include "transport.h"

#define MOD "router"
#define MAX_EPS 512
#define DECODE_ATTEMPTS 3   // routes per request in all (retry.h)
#define MAX_MIGRATIONS 2    // times one request's streams may move to another decode worker
#define STREAM_BUCKETS 1024 // buckets of the open-stream table (a power of two)

// ---- options --------------------------------------------------------------------------------
void tdm_router_opts_default(struct tdm_router_opts *o)
{
    memset(o, 0, sizeof *o);
    snprintf(o->host, sizeof o->host, "0.0.0.0");
    o->port = 8000;
    snprintf(o->nng_url, sizeof o->nng_url, "tcp://127.0.0.1:0");
    o->http_threads = 256;
    o->stream_interval = 1;
    o->max_body_bytes = 16u << 20;
    o->http_header_timeout = 10.0;
    o->http_body_timeout = 30.0;
    o->max_large_requests = 4;
    o->http_memory_budget_mib = 2048;
    snprintf(o->log_level, sizeof o->log_level, "info");
    o->watch = true;
    o->stream_migration = true;
    o->liveness_timeout = 1.0;
    o->load_interval = 0.2;
    o->drain_timeout = 30;
}

#define STR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct tdm_router_opts, n, TDM_FLAG_STR, field, .metavar = mv, .help = h,    \
                   .empty_ok = true)
#define NUM(n, k, field, lo, hi, mv, h)                                                            \
    TDM_FLAG_FIELD(struct tdm_router_opts, n, k, field, .min = lo, .max = hi, .metavar = mv,    \
                   .help = h)
#define OFF(field) offsetof(struct tdm_router_opts, field)
// Strings may be empty, as before the table (an empty --api-key means none).

static const struct tdm_flag router_flags[] = {
    STR("config", config, "FILE", "routing config (docs/router-config.md); hot reloaded"),
    STR("policy", policy, "NAME",
        "instead of --config: round_robin, random, least_loaded,\nprefix_cache or session_affinity "
        "over the workers below\n(the short form tandem up writes)"),
    STR("decode", decode_eps, "H:P[:N],...",
        "with --policy: decode workers (HTTP port P, nng port N,\ndefault P+1000)"),
    STR("prefill", prefill_eps, "H:P[:N],...", "with --policy: prefill workers (P/D on)"),
    NUM("pd-threshold", TDM_FLAG_INT, pd_threshold, 0, 100000000, "N",
        "with --policy and --prefill: uncached prompt tokens above\nwhich to prefill remotely "
        "(default 256)"),
    STR("model", model, "DIR", "model folder for the tokenizer, chat template, config.json"),
    STR("nng-url", nng_url, "URL", "the router's nng inbox (default tcp://127.0.0.1:0)"),
    NUM("http-threads", TDM_FLAG_INT, http_threads, 1, 4096, "N",
        "concurrent HTTP requests (default 256)"),
    NUM("liveness-timeout", TDM_FLAG_DOUBLE, liveness_timeout, 0.05, 3600, "S",
        "worker silent this long mid-stream = lost (default 1)"),
    NUM("load-interval", TDM_FLAG_DOUBLE, load_interval, 0.01, 60, "S",
        "load query period (default 0.2)"),
    {.name = "watch-config",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(watch),
     .help = "reload the config when its file changes (default)"},
    {.name = "no-watch-config",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(watch),
     .help = "reload only on SIGHUP"},
    {.name = "stream-migration",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(stream_migration),
     .help = "a stream whose decode worker is lost continues on another,\nwith the tokens "
             "already sent (default)"},
    {.name = "no-stream-migration",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(stream_migration),
     .help = "a lost decode worker ends its streams with an error event"},
    {.name = "debug-headers",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(debug_headers),
     .help = "answer with x-tandem-decode (the worker's address) and\nx-tandem-phases (phase "
             "times); off by default: internals\nare not told to clients"},
    TDM_OAI_FRONT_FLAGS(struct tdm_router_opts,
                        "HTTP listen port (default 8000; 0 = any free port)"),
};

static const struct tdm_flags router_table = {
    .usage = "usage: tandem-router --config FILE --model DIR [options]\n",
    .flags = router_flags,
    .n = sizeof router_flags / sizeof router_flags[0],
};

const struct tdm_flags *tdm_router_flags(void)
{
    return &router_table;
}

// Parses "HOST:PORT[:NNG],..." into eps (hosts point into buf, which is
// modified). IPv6 hosts in brackets: "[::1]:8001".
static int parse_eps(const char *flag, char *buf, struct tdm_router_short_endpoint *eps,
                     size_t cap, size_t *n, char *err, size_t errlen)
{
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*n == cap)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: more than %zu workers", flag, cap);
        char *host = tok, *rest;
        if (*tok == '[') {
            char *close = strchr(tok, ']');
            if (!close || close[1] != ':')
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s: bad address \"%s\"", flag, tok);
            host = tok + 1;
            *close = '\0';
            rest = close + 2;
        } else {
            char *colon = strchr(tok, ':');
            if (!colon)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "%s: \"%s\" is not HOST:PORT[:NNG_PORT]", flag, tok);
            *colon = '\0';
            rest = colon + 1;
        }
        char *end = NULL;
        long http = strtol(rest, &end, 10), nng = http + 1000;
        if (end && *end == ':')
            nng = strtol(end + 1, &end, 10);
        if (!*host || !end || *end || http < 1 || http > 65535 || nng < 1 || nng > 65535)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: bad ports in \"%s\"", flag, rest);
        eps[(*n)++] = (struct tdm_router_short_endpoint){host, (int)http, (int)nng};
    }
    return TDM_OK;
}

// --policy: builds the short-form config tandem up writes, checks it with the
// parser, and writes it into a private folder that --config then names (the
// file is the router's as any config file: /v1/router/config shows it).
static int write_short_config(struct tdm_router_opts *o, char *err, size_t errlen)
{
    char dbuf[sizeof o->decode_eps], pbuf[sizeof o->prefill_eps];
    snprintf(dbuf, sizeof dbuf, "%s", o->decode_eps);
    snprintf(pbuf, sizeof pbuf, "%s", o->prefill_eps);
    struct tdm_router_short_endpoint dec[64], pre[64];
    size_t nd = 0, np = 0;
    int rc;
    if ((rc = parse_eps("--decode", dbuf, dec, 64, &nd, err, errlen)) ||
        (rc = parse_eps("--prefill", pbuf, pre, 64, &np, err, errlen)))
        return rc;
    if (nd == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy needs --decode HOST:PORT[,...]");
    char text[16384];
    if (tdm_router_config_short_text("Built from tandem-router --policy.", o->policy, "prefix",
                                     o->pd_threshold > 0 ? o->pd_threshold : 256, pre, np, dec, nd,
                                     text, sizeof text) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy: too many workers");
    struct tdm_router_config *cfg = NULL;
    char perr[512];
    if (tdm_router_config_parse(&cfg, text, strlen(text), NULL, perr, sizeof perr) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy: %s", perr);
    tdm_router_config_unref(cfg);
    const char *tmp = getenv("TMPDIR");
    snprintf(o->generated_dir, sizeof o->generated_dir, "%s/tandem-router-XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(o->generated_dir)) {
        o->generated_dir[0] = '\0';
        return tdm_seterr(err, errlen, TDM_EIO, "--policy: cannot create a folder: %s",
                          strerror(errno));
    }
    snprintf(o->config, sizeof o->config, "%s/router.yaml", o->generated_dir);
    FILE *f = fopen(o->config, "w");
    if (!f || fputs(text, f) == EOF || fclose(f) != 0) {
        if (f)
            fclose(f);
        return tdm_seterr(err, errlen, TDM_EIO, "--policy: cannot write %s", o->config);
    }
    return TDM_OK;
}

int tdm_router_opts_parse_args(struct tdm_router_opts *o, int argc, char **argv, char *err,
                               size_t errlen)
{
    int rc = tdm_flags_parse(&router_table, o, argc, argv, NULL, 0, NULL, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (o->config[0] && o->policy[0])
        return tdm_seterr(err, errlen, TDM_EINVAL, "give --config FILE or --policy NAME, not both");
    if (o->config[0] == '\0' && o->policy[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--config FILE (or --policy NAME --decode ...) is required");
    if (o->policy[0] && (rc = write_short_config(o, err, errlen)) != TDM_OK)
        return rc;
    if (o->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model DIR is required");
    enum tdm_oai_tool_parser tp;
    return tdm_oai_tool_parser_config(o->enable_auto_tool_choice, o->tool_call_parser, &tp, err,
                                      errlen);
}

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
    atomic_bool draining;      // drain began: no new API requests, /health 503
    _Atomic int inflight;      // API handlers running (the drain waits for 0)
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

int tdm_router_server_port(const struct tdm_router_server *s)
{
    return tdm_http_server_port(s->http);
}

const char *tdm_router_server_nng_url(const struct tdm_router_server *s)
{
    return tdm_net_inbox_url(s->inbox);
}

int tdm_router_server_reload(struct tdm_router_server *s, char *err, size_t errlen)
{
    return tdm_router_control_reload(s->ctl, err, errlen);
}

static void nng_url_of(const char *host, int port, char *out, size_t cap)
{
    if (strchr(host, ':'))
        snprintf(out, cap, "tcp://[%s]:%d", host, port);
    else
        snprintf(out, cap, "tcp://%s:%d", host, port);
}

// The endpoint's instance and last report time (0/0 when never heard of).
static void live_get(struct tdm_router_server *s, uint64_t id, uint64_t *instance, double *last)
{
    tdm_router_endpoints_liveness(tdm_router_control_endpoints(s->ctl), id, instance, last);
}

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
        pthread_cond_signal(wake); // one reader per call: wake only it
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
            .load = {r->running, r->waiting, r->kv_usage, r->max_waiting},
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

static void on_frame(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_router_server *s = arg;
    if (f->type == TDM_NET_TOKENS)
        on_tokens(s, f);
    else if (f->type == TDM_NET_LOAD_REPORT)
        on_load_report(s, f);
}

static void *poll_main(void *arg)
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
            nng_url_of(views[i].host, views[i].nng_port, url, sizeof url);
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
    bool migrate;          // its decode worker was lost: continue it elsewhere (pump)
    Tandem__TokenChunk **spare; // [spare_cap] swapped with its stream's queue by pump, which
    size_t spare_cap;           // then reads the n_batch chunks in it (else empty)
    size_t n_batch;
    bool overflow; // the stream's queue had overflowed when pump took it
};

struct call {
    struct tdm_router_server *s;
    struct tdm_http_conn *conn;
    struct tdm_oai_call oai; // request, prompts, choices' assemblers (common/openai)
    struct choice *choices;  // [oai.n_choices]
    bool client_gone;
    double arrival;
    struct tdm_router_route route;
    bool routed;
    char decode_url[300];
    char phases[512];  // the x-tandem-phases header value
    bool lost;         // the decode worker was lost mid-request
    bool busy;         // the decode worker refused it as busy (EBUSY) before any token
    char busy_why[256]; // its message
    bool never_fits;   // more sequences than the worker's waiting-queue bound (400)
    bool started;      // past start_with_retries: tokens may have reached the client
    int migrations;    // times its streams moved to another decode worker
    char migrating_why[256]; // why the streams being migrated were lost (logged once)
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
// last load report and instance).
static bool upstream_alive(struct call *k, const struct choice *ch, char *why, size_t cap)
{
    uint64_t inst = 0;
    double last = 0;
    live_get(k->s, k->route.decode.id, &inst, &last);
    pthread_mutex_lock(&k->s->mu);
    uint64_t st_inst = ch->st->instance;
    double heard = ch->st->heard;
    pthread_mutex_unlock(&k->s->mu);
    // The router itself was stopped (SIGSTOP, starved) and its poller has not
    // run since: the reports it did not read say nothing of the worker (the
    // fault suite's router SIGSTOP failed every stream here). No verdict until
    // the poller notes the stall; then silence counts from its return.
    double now = tdm_now(), tick = atomic_load(&k->s->poll_tick);
    if (tick > 0 && now - tick > k->s->o.load_interval + k->s->o.liveness_timeout)
        return true;
    double unanswered = tdm_router_endpoints_unanswered_since(
        tdm_router_control_endpoints(k->s->ctl), k->route.decode.id);
    enum tdm_router_upstream v =
        tdm_router_upstream_check(now, ch->st->started, last, k->s->o.liveness_timeout, inst,
                                  st_inst, atomic_load(&k->s->resumed_at), unanswered);
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
static void stream_unregister(struct tdm_router_server *s, struct rstream *st);

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
            if (rc == TDM_OK && !ch->a->done) { // after the finish: dropped, as Cancel would
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
        char why[256];
        if (tdm_now() > k->route.deadline) {
            tdm_oai_asm_fail(ch->a, TDM_ETIMEDOUT, "the request's deadline passed");
            send_cancel(k, ch);
        } else if (atomic_load(&s->stopping)) {
            // Past the drain: the stream ends with an error event, not a cut.
            tdm_oai_asm_fail(ch->a, TDM_ECLOSED, "the router is shutting down");
            send_cancel(k, ch);
        } else if (n_batch == 0 && !upstream_alive(k, ch, why, sizeof why)) {
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

static void stream_unregister(struct tdm_router_server *s, struct rstream *st)
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

// Cancels what still runs upstream and forgets the streams.
static void release_upstream(struct call *k)
{
    for (size_t i = 0; k->choices && i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        send_cancel(k, ch);
        stream_unregister(k->s, ch->st);
        ch->st = NULL;
    }
}

// Sends one GenerateRequest per choice to the routed decode worker.
// The decode worker's instance id to address, from its last report: only
// when that report is fresh (after a silence it may have restarted, and a
// message for the old instance would be dropped by the new one); else 0.
static uint64_t decode_instance(struct call *k)
{
    uint64_t inst = 0;
    double last = 0;
    live_get(k->s, k->route.decode.id, &inst, &last);
    return tdm_now() - last > k->s->o.liveness_timeout ? 0 : inst;
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
    pthread_mutex_lock(&s->mu);
    struct rstream **bucket = stream_bucket(s, st->request_id);
    st->next = *bucket;
    *bucket = st;
    pthread_mutex_unlock(&s->mu);
    ch->st = st;
    ch->upstream_done = false;

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
    if (resume && ch->n_got > 0) {
        g.n_resume_tokens = ch->n_got;
        g.resume_tokens = ch->got;
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
    int rc = tdm_pd_send(s->outbox, k->decode_url, TDM_NET_GENERATE, &g.base, NULL, 0, 1.0, err,
                         errlen);
    if (rc != TDM_OK)
        ch->upstream_done = true; // never arrived: nothing to cancel
    return rc;
}

// Sends one GenerateRequest per choice to the routed decode worker.
static int send_generates(struct call *k, char *err, size_t errlen)
{
    struct tdm_router_server *s = k->s;
    const struct tdm_router_route *r = &k->route;
    uint64_t dec_inst = decode_instance(k);
    Tandem__PrefillTarget targets[TDM_ROUTER_MAX_PREFILL_CANDIDATES];
    Tandem__PrefillTarget *target_ptr[TDM_ROUTER_MAX_PREFILL_CANDIDATES];
    char target_urls[TDM_ROUTER_MAX_PREFILL_CANDIDATES][300];
    size_t nt = 0;
    if (r->decision == TDM_ROUTER_DECISION_PREFILL_DECODE) {
        for (size_t i = r->prefill_idx; i < r->n_prefill && nt < TDM_ROUTER_MAX_PREFILL_CANDIDATES;
             i++) {
            Tandem__PrefillTarget init = TANDEM__PREFILL_TARGET__INIT;
            targets[nt] = init;
            nng_url_of(r->prefill[i].host, r->prefill[i].nng_port, target_urls[nt],
                       sizeof target_urls[nt]);
            targets[nt].url = target_urls[nt];
            double l2 = 0;
            live_get(s, r->prefill[i].id, &targets[nt].instance, &l2);
            if (tdm_now() - l2 > s->o.liveness_timeout)
                targets[nt].instance = 0;
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
    k->migrations++;
    char old_name[TDM_ROUTER_NAME_MAX], err[256];
    snprintf(old_name, sizeof old_name, "%s", k->route.decode.name);
    const struct tdm_oai_tokenized_prompt *p0 = &k->oai.prompts[0];
    uint64_t avoid = k->route.decode.id;
    struct tdm_router_route nr;
    memset(&nr, 0, sizeof nr);
    tdm_router_control_report(s->ctl, &k->route.decode, TDM_ROUTER_OUTCOME_ERROR);
    int rc = tdm_router_control_route_avoiding(s->ctl, p0->ids, p0->n, k->session, &avoid, 1, &nr,
                                               err, sizeof err);
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
    nr.deadline = k->route.deadline; // the request's deadline does not restart
    tdm_router_control_route_done(s->ctl, &k->route, "error");
    k->route = nr;
    nng_url_of(k->route.decode.host, k->route.decode.nng_port, k->decode_url,
               sizeof k->decode_url);
    uint64_t dec_inst = decode_instance(k);
    size_t moved = 0;
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct choice *ch = &k->choices[i];
        if (!ch->migrate)
            continue;
        ch->migrate = false;
        stream_unregister(s, ch->st);
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
    tdm_metrics_counter_inc(s->m_migrations);
    TDM_LOG_WARN(MOD, "req=%s %s: %zu stream(s) migrated to %s", k->oai.resp.id,
                 k->migrating_why, moved, k->route.decode.name);
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
    int rrc = tdm_router_control_route_avoiding(s->ctl, p0->ids, p0->n, session, b->failed,
                                                b->n_failed, &k->route, err, errlen);
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
    nng_url_of(k->route.decode.host, k->route.decode.nng_port, k->decode_url, sizeof k->decode_url);
    // Known dead (stale reports and no connection): do not wait for a send timeout.
    uint64_t inst = 0;
    double last = 0;
    live_get(s, k->route.decode.id, &inst, &last);
    if (last > 0 && tdm_now() - last > s->o.liveness_timeout &&
        !tdm_net_connected(s->outbox, k->decode_url)) {
        snprintf(err, errlen, "decode worker %s is not answering", k->route.decode.name);
        return TDM_ROUTER_ATTEMPT_UNREACHABLE;
    }
    // Admission of the whole request (n x prompts sequences) against the
    // worker's waiting-queue bound from its last report, before anything is
    // sent (issue 11): more than the bound can never fit (400, no retry);
    // more than the room left is overload, not death: another worker, else 503.
    struct tdm_router_endpoint_view v;
    if (tdm_router_endpoints_get(tdm_router_control_endpoints(s->ctl), k->route.decode.id, &v) ==
            TDM_OK &&
        v.load.max_waiting > 0) {
        int want = (int)k->oai.n_choices;
        if (want > v.load.max_waiting) {
            k->never_fits = true;
            snprintf(err, errlen,
                     "%d sequences (n x prompts) exceed the waiting-queue bound (--max-waiting "
                     "%d)",
                     want, v.load.max_waiting);
            return TDM_ROUTER_ATTEMPT_BUSY;
        }
        if (want > 1 && v.load.waiting + want > v.load.max_waiting) {
            snprintf(err, errlen,
                     "The server is overloaded: the waiting queue is full (--max-waiting %d). "
                     "Retry later.",
                     v.load.max_waiting);
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
    if (end != TDM_ROUTER_ATTEMPT_BUSY) // busy is not dead: no health penalty
        tdm_router_control_report(s->ctl, &k->route.decode, TDM_ROUTER_OUTCOME_ERROR);
    if (s->rm && retrying)
        tdm_router_metrics_retry(s->rm, k->route.decode.name, k->route.decode.role);
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

static void handle_generate(struct tdm_router_server *s, struct tdm_http_conn *c,
                            enum tdm_oai_kind kind)
{
    struct call k;
    memset(&k, 0, sizeof k);
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
        tdm_router_control_report(s->ctl, &k.route.decode, TDM_ROUTER_OUTCOME_ERROR);
    } else if (!bad) {
        tdm_router_control_report(s->ctl, &k.route.decode, TDM_ROUTER_OUTCOME_SUCCESS);
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
                     k.oai.resp.id, k.route.decode.name,
                     tdm_router_decision_name(k.route.decision), u.prompt_tokens,
                     u.completion_tokens);
    }
out:;
    const char *status = k.client_gone                 ? "cancelled"
                         : tdm_oai_call_failed(&k.oai) ? "error"
                                                       : "success";
    trace_call(&k, status);
    call_fini(&k);
    pthread_cond_destroy(&k.cv);
    if (k.routed)
        tdm_router_control_route_done(s->ctl, &k.route, status);
}

// ---- other routes ---------------------------------------------------------------------------
static void on_health(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    size_t total = 0, healthy = 0;
    tdm_router_endpoints_count(tdm_router_control_endpoints(s->ctl), true, &total, &healthy);
    if (atomic_load(&s->draining) || atomic_load(&s->stopping))
        tdm_oai_http_errorf(c, 503, NULL, "The server is draining.");
    else if (healthy > 0)
        tdm_http_respond(c, 200, "application/json", "", 0);
    else if (tdm_router_endpoints_count_auth_failed(tdm_router_control_endpoints(s->ctl)))
        tdm_oai_http_errorf(c, 503, NULL,
                            "no healthy decode worker (%zu configured; some refuse the router's "
                            "control-plane handshake: start them with this router's "
                            "TANDEM_INTERNAL_SECRET)",
                            total);
    else
        tdm_oai_http_errorf(c, 503, NULL, "no healthy decode worker (%zu configured)", total);
}

static void on_metrics(struct tdm_http_conn *c, void *arg)
{
    tdm_oai_http_metrics(c, ((struct tdm_router_server *)arg)->reg);
}

static void on_version(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_version(c, TANDEM_VERSION);
}

static void on_models(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_models(c, s->text.served_name, s->max_model_len, s->created);
}

static void on_router_config(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_http_respond_json_owned(c, 200, tdm_router_control_config_json(s->ctl));
}

// Admits a generation request unless the server drains; counted in inflight
// so that the drain can wait for it.
static void generate_counted(struct tdm_router_server *s, struct tdm_http_conn *c,
                             enum tdm_oai_kind kind)
{
    atomic_fetch_add(&s->inflight, 1);
    if (atomic_load(&s->draining))
        tdm_oai_http_fail(c, TDM_ECLOSED, "The server is draining.");
    else
        handle_generate(s, c, kind);
    atomic_fetch_sub(&s->inflight, 1);
}

static void on_completions(struct tdm_http_conn *c, void *arg)
{
    generate_counted(arg, c, TDM_OAI_COMPLETION);
}

static void on_chat(struct tdm_http_conn *c, void *arg)
{
    generate_counted(arg, c, TDM_OAI_CHAT);
}

int tdm_router_server_drain(struct tdm_router_server *s, double timeout_s)
{
    atomic_store(&s->draining, true);
    double deadline = tdm_now() + (timeout_s > 0 ? timeout_s : 0);
    int left = 0;
    while ((left = atomic_load(&s->inflight)) > 0 && tdm_now() < deadline) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (left > 0) {
        TDM_LOG_WARN(MOD, "drain: %d request(s) still open after %g s; ending them", left,
                     timeout_s);
        // The pumps see stopping and end their streams with an error event and
        // [DONE] (and cancel upstream) while the connections are still open;
        // the server stops only after that (or 2 s), never mid-event.
        atomic_store(&s->stopping, true);
        double end = tdm_now() + 2.0;
        while (atomic_load(&s->inflight) > 0 && tdm_now() < end) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    return left > 0 ? TDM_ETIMEDOUT : TDM_OK;
}

static void on_tokenize(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_tokenize(c, &s->info, s->text.tok, s->text.chat, s->text.chat_err,
                          s->max_model_len);
}

static void on_detokenize(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_detokenize(c, &s->info, s->text.tok);
}

// ---- lifecycle ---------------------------------------------------------------------------------
// The text side as the workers load it (common/text): a folder or an ORG/NAME
// Hub id (resolved through the HF cache), the same served name and template.
static int load_text_side(struct tdm_router_server *s, char *err, size_t errlen)
{
    int rc = tdm_text_resolve(s->o.model, NULL, s->model_path, sizeof s->model_path, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_text_config tc = {
        .model = s->o.model,
        .model_path = s->model_path,
        .served_model_name = s->o.served_model_name,
        .chat_template = s->o.chat_template,
        .log_module = MOD,
    };
    rc = tdm_text_load(&s->text, &tc, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_model_config mc;
    rc = tdm_hf_config_load(&mc, s->model_path, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_text_context_len(s->o.max_model_len, mc.max_position_embeddings, &s->max_model_len,
                                  err, errlen);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_oai_tool_parser_config(s->o.enable_auto_tool_choice, s->o.tool_call_parser,
                                    &s->info.tool_parser, err, errlen);
    if (rc != TDM_OK)
        return rc;
    s->info.served_name = s->text.served_name;
    s->info.vocab_size = mc.vocab_size;
    s->info.max_model_len = s->max_model_len;
    s->info.gen = &s->text.gen;
    return TDM_OK;
}

static int register_metrics(struct tdm_router_server *s, char *err, size_t errlen)
{
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    static const char *const labels[] = {"decision", "endpoint"};
    o.name = "tandem:router_requests_by_decision_total";
    o.help = "Requests sent upstream by P/D decision and decode endpoint.";
    o.label_names = labels;
    o.n_label_names = 2;
    int rc = tdm_metrics_counter_register(&s->m_requests_by, s->reg, &o, err, errlen);
    o.label_names = NULL;
    o.n_label_names = 0;
    o.name = "tandem:router_decode_lost_total";
    o.help = "Requests whose decode worker was lost mid-request (error sent to the client).";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&s->m_lost, s->reg, &o, err, errlen);
    o.name = "tandem:router_stream_migrations_total";
    o.help = "Requests whose streams continued on another decode worker after theirs was lost "
             "(--stream-migration).";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&s->m_migrations, s->reg, &o, err, errlen);
    return rc;
}

int tdm_router_server_new(struct tdm_router_server **out, const struct tdm_router_opts *o,
                          char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_router_server *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    s->o = *o;
    s->instance = tdm_net_new_instance_id();
    s->created = (int64_t)time(NULL);
    pthread_mutex_init(&s->mu, NULL);
    int rc = load_text_side(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_metrics_registry_new(&s->reg, NULL, 0, err, errlen);
    if (rc == TDM_OK)
        rc = register_metrics(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_router_control_new(&s->ctl, o->config, s->reg, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    s->rm = tdm_router_control_metrics(s->ctl);
    const char *otlp = tdm_tracer_endpoint_from_env(o->otlp_traces_endpoint);
    if (otlp) {
        struct tdm_tracer_config tc = {.endpoint = otlp,
                                       .service_name = tdm_tracer_service_name("tandem-router")};
        rc = tdm_tracer_new(&s->tracer, &tc, s->reg, err, errlen);
        if (rc != TDM_OK)
            goto fail;
    }
    rc = tdm_net_outbox_new(&s->outbox, 100, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_net_outbox_new(&s->poll_outbox, 100, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_net_inbox_new(&s->inbox, o->nng_url, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    // Frames are handled on the inbox's connection readers: a TokenChunk goes
    // from the socket into its stream's queue and wakes the request's thread,
    // with no inbox thread between (docs/pd-protocol.md, router overhead).
    tdm_net_inbox_handle_on_readers(s->inbox, on_frame, s);
    rc = tdm_router_control_start(s->ctl, o->watch, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    if (pthread_create(&s->poll_thread, NULL, poll_main, s) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "cannot start the load poller");
        goto fail;
    }
    s->poll_started = true;

    static const struct tdm_oai_route own[] = {
        {"GET", "/v1/router/config", on_router_config},
    };
    static const struct tdm_oai_front_routes routes = {
        .health = on_health,
        .metrics = on_metrics,
        .version = on_version,
        .models = on_models,
        .completions = on_completions,
        .chat = on_chat,
        .tokenize = on_tokenize,
        .detokenize = on_detokenize,
        .extra = own,
        .n_extra = sizeof own / sizeof own[0],
    };
    struct tdm_oai_front_http fh = TDM_OAI_FRONT_HTTP(o, o->http_threads);
    rc = tdm_oai_front_serve(&s->http, &fh, &routes, s, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    *out = s;
    return TDM_OK;
fail:
    tdm_router_server_free(s);
    return rc;
}

void tdm_router_server_free(struct tdm_router_server *s)
{
    if (s == NULL)
        return;
    atomic_store(&s->stopping, true);
    if (s->http) {
        tdm_http_server_stop(s->http); // handlers return; their calls cancel upstream
        tdm_http_server_free(s->http);
    }
    if (s->poll_started)
        pthread_join(s->poll_thread, NULL);
    if (s->inbox)
        tdm_net_inbox_close(s->inbox);
    tdm_router_control_free(s->ctl);
    tdm_tracer_free(s->tracer); // after the HTTP threads: their last spans are flushed
    tdm_net_inbox_free(s->inbox);
    tdm_net_outbox_free(s->outbox);
    tdm_net_outbox_free(s->poll_outbox);
    tdm_metrics_registry_free(s->reg);
    tdm_text_fini(&s->text);
    for (size_t b = 0; b < STREAM_BUCKETS; b++)
        while (s->streams[b])
            stream_unregister(s, s->streams[b]);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
