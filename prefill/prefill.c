// SPDX-License-Identifier: Apache-2.0
// prefill: the prefill worker's P/D service (see prefill.h). The frame
// handlers run on the inbox's reader threads; each PrefillRequest gets a job
// thread that owns its engine request from submit to release, so every exit path of that
// one function releases the KV, and that is also the request's sender: the
// engine's push hook (on the engine thread) only records which layers are final
// and wakes it; the job thread exports each layer group straight into its
// KvData frame while the engine computes the later layers, so the engine never
// waits on the network. The Cancel handler only flips the cancel flag and
// aborts; it never blocks on a peer. A handler never runs a job itself (its
// connection would go unread meanwhile): a job whose thread cannot be started
// is refused with TDM_EBUSY.
//
// Invariants: a job is in the list from submit until its thread is about to
// free it; messages whose to_instance is not ours were meant for an earlier
// incarnation of this address and are dropped; the engine frees a request's
// blocks only when no export copies from them (tdm_engine_export_layer).
#include "prefill.h"

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
#include "trace.h"
#include "transport.h"

#define MOD "prefill"

// The inbox default follows the router config's convention (nng port = HTTP
// port + 1000: 8002 -> 9002), so the defaults of both sides agree.
void tdm_prefill_config_default(struct tdm_prefill_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->nng_url, sizeof cfg->nng_url, "tcp://127.0.0.1:9002");
    cfg->hold_seconds = 30;
    cfg->layers_per_frame = 4;
    cfg->send_timeout = 5;
    cfg->nccl_timeout = 10;
}

void tdm_prefill_worker_config_default(struct tdm_worker_config *cfg)
{
    tdm_worker_config_default(cfg);
    // Its own port: a prefill and a decode worker on one host must not both
    // want 8001 (the decode worker keeps 8001, the seed's port-forward).
    cfg->port = TDM_PREFILL_DEFAULT_PORT;
    snprintf(cfg->trace_service_name, sizeof cfg->trace_service_name, "tandem-prefill");
}

static int set_nng_url(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_prefill_config *cfg = o;
    return tdm_pd_flag_url(cfg->nng_url, sizeof cfg->nng_url, v, false, err, errlen);
}

static const struct tdm_flag prefill_flags[] = {
    {.name = "nng-url", .kind = TDM_FLAG_FN, .fn = set_nng_url, .metavar = "URL",
     .help = "inbox for PrefillRequest/Cancel (default tcp://127.0.0.1:9002:\nloopback; give the pod "
             "address to serve other hosts)"},
    {.name = "kv-hold-seconds", .kind = TDM_FLAG_DOUBLE,
     .offset = offsetof(struct tdm_prefill_config, hold_seconds), .min = 0.1, .max = 1e9,
     .metavar = "S",
     .help = "release prefilled KV not all sent S seconds after the prefill\n(default 30)"},
    {.name = "layers-per-frame", .kind = TDM_FLAG_INT,
     .offset = offsetof(struct tdm_prefill_config, layers_per_frame), .min = 1, .max = 1e9,
     .metavar = "N", .help = "at most N layers per KvData frame (default 4)"},
};

static const struct tdm_flags prefill_table = {
    .usage = "usage: tandem-prefill --model DIR [--nng-url tcp://HOST:PORT] [--kv-hold-seconds S]\n"
             "                      [--layers-per-frame N] [tandem-decode flags...]\n",
    .flags = prefill_flags,
    .n = sizeof prefill_flags / sizeof prefill_flags[0],
    .footer = "Every other flag is tandem-decode's (--port for /health and /metrics, default "
              "8002\nfor the prefill worker, so it does not collide with a decode worker's "
              "8001).\n",
};

const struct tdm_flags *tdm_prefill_flags(void)
{
    return &prefill_table;
}

int tdm_prefill_config_take_args(struct tdm_prefill_config *cfg, int *argc, char **argv, char *err,
                                 size_t errlen)
{
    return tdm_flags_take(&prefill_table, cfg, argc, argv, err, errlen);
}

// ---- service -----------------------------------------------------------------------------
struct pjob {
    struct pjob *next;
    struct tdm_prefill_service *svc;
    uint64_t transfer_id;
    char request_id[64];
    char decode_url[256];
    uint64_t decode_instance;
    struct tdm_engine_request *req;
    double deadline;     // wall-monotonic (tdm_now) time after which the job is abandoned
    double hold_seconds; // KV whose frames are not all sent this long after the finish: released
    struct tdm_pd_push push; // the decode worker's block range and framing (checked)
    double t_submit;
    // Set by the Cancel handler under svc->mu:
    bool cancelled;
    // Set by the engine thread (push hook, finish callback) under mu; cv wakes
    // the job thread on a complete layer group and on the finish.
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int layers_ready; // layers whose KV of the whole prompt is final
    bool finished;    // the engine delivered the request's finish

    // The trace (job thread only): prefill_request, parent = the decode
    // worker's remote_prefill span (PrefillRequest.traceparent).
    struct tdm_span span;
    bool have_times; // the engine finish was read: times is valid
    struct tdm_engine_times times;

    // The KV transfer (issue 27), job thread only: its mode's table is chosen
    // before the first frame (kv_transport.h); host is how it reaches this
    // job's engine request and the decode worker. An offered transfer (the
    // decode worker named its device pool) ends with a closed frame on every
    // path (its memory-safety rule, docs/pd-protocol.md).
    struct tdm_kv_send_host host;
    struct tdm_kv_send *kv;
};

struct tdm_prefill_service {
    struct tdm_prefill_config cfg;
    struct tdm_worker *server;
    struct tdm_worker_parts parts;
    struct tdm_kv_config kvc;
    struct tdm_pd_service net; // inbox, outbox, instance id, frame dispatch, stopping

    pthread_mutex_t mu;
    pthread_cond_t cv; // broadcast on job exit
    struct pjob *jobs;
    int num_jobs;

    struct tdm_pd_metrics m;

    // GPU-to-GPU transfer (issue 10): the transport table's worker-wide side
    // (IPC handle cache, NCCL links, the pairs behind /health).
    struct tdm_kv_transport *kvt;
    struct tdm_metrics_counter *transfers; // tandem:kv_transfers_total{transport}
    struct tdm_metrics_counter *copy_seconds; // tandem:kv_copy_seconds_total (CUDA IPC)
};

const char *tdm_prefill_service_url(const struct tdm_prefill_service *p)
{
    return tdm_pd_service_url(&p->net);
}

uint64_t tdm_prefill_service_instance(const struct tdm_prefill_service *p)
{
    return p->net.instance;
}

int tdm_prefill_service_num_jobs(struct tdm_prefill_service *p)
{
    pthread_mutex_lock(&p->mu);
    int n = p->num_jobs;
    pthread_mutex_unlock(&p->mu);
    return n;
}

static struct pjob *job_find(struct tdm_prefill_service *p, uint64_t transfer_id)
{
    for (struct pjob *j = p->jobs; j; j = j->next)
        if (j->transfer_id == transfer_id)
            return j;
    return NULL;
}

static void job_unlink(struct tdm_prefill_service *p, struct pjob *job)
{
    for (struct pjob **pp = &p->jobs; *pp; pp = &(*pp)->next) {
        if (*pp == job) {
            *pp = job->next;
            p->num_jobs--;
            break;
        }
    }
}

// ---- engine-thread callbacks: cheap, never block ------------------------------------------
// The push hook: layer `layer` of the final chunk is in the cache. Wakes the job
// thread when a frame's worth of layers (or the last layers) is final.
static void job_on_layer(void *ctx, struct tdm_engine_request *r, int layer)
{
    (void)r;
    struct pjob *job = ctx;
    int done = layer + 1;
    pthread_mutex_lock(&job->mu);
    job->layers_ready = done;
    if (done % job->push.layers_per_frame == 0 || done == job->svc->kvc.num_layers)
        pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

static void job_on_output(void *ctx, const struct tdm_engine_output *o)
{
    struct pjob *job = ctx;
    if (!o->finished)
        return;
    pthread_mutex_lock(&job->mu);
    job->finished = true;
    pthread_cond_signal(&job->cv);
    pthread_mutex_unlock(&job->mu);
}

// ---- the job thread: pushes frames, reports the result, releases ---------------------------
struct export_arg {
    struct tdm_prefill_service *svc;
    struct pjob *job;
    int first_layer, num_layers;
};

// Bytes of one layer of job's push: its blocks in the dtype the decode worker
// asked for (its pool's; ours is converted on export when they differ).
static size_t push_layer_bytes(const struct tdm_prefill_service *p, const struct pjob *job)
{
    struct tdm_kv_config k = p->kvc;
    k.dtype = job->push.dtype;
    return tdm_pd_layer_bytes(&k, job->push.num_blocks);
}

// Fills a KvData payload: layer after layer, straight from the engine's blocks
// (final layers only: the engine refuses the others).
static int export_fill(void *arg, uint8_t *payload, size_t payload_len)
{
    struct export_arg *a = arg;
    size_t lb = push_layer_bytes(a->svc, a->job);
    if (lb * (size_t)a->num_layers != payload_len)
        return TDM_EINVAL;
    for (int l = 0; l < a->num_layers; l++) {
        int rc = tdm_engine_export_layer_as(a->svc->parts.engine, a->job->req, a->first_layer + l,
                                            a->job->push.first_block, a->job->push.num_blocks,
                                            a->job->push.dtype, payload + (size_t)l * lb, lb);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

// ---- the transport's host: this job's engine request and decode worker --------------------
// Leases our blocks of the push range for layers [0, layers) (kv_transport.h).
static int host_lease(void *ctx, int layers, int *src_blocks)
{
    struct pjob *job = ctx;
    return tdm_engine_export_lease(job->svc->parts.engine, job->req, layers, job->push.first_block,
                                   job->push.num_blocks, src_blocks);
}

static void host_unlease(void *ctx)
{
    struct pjob *job = ctx;
    tdm_engine_export_unlease(job->svc->parts.engine, job->req);
}

// One KvData frame of the job as its transport asks: layers first_layer..+n
// of the push range (over nng with their payload written in place by
// export_fill), a device group in place, "post your receives", or closed.
static int host_send(void *ctx, const struct tdm_kv_frame *f, char *err, size_t errlen)
{
    struct pjob *job = ctx;
    struct tdm_prefill_service *p = job->svc;
    Tandem__KvData d = TANDEM__KV_DATA__INIT;
    d.transfer_id = job->transfer_id;
    d.to_instance = job->decode_instance;
    d.from_instance = p->net.instance;
    d.first_layer = f->first_layer;
    d.num_layers = f->num_layers;
    if (f->num_blocks > 0) {
        d.first_block = job->push.first_block;
        d.num_blocks = f->num_blocks;
    }
    d.transport = (char *)f->transport;
    d.transport_why = (char *)f->why;
    d.closed = f->closed;
    d.copy_seconds = f->copy_seconds;
    if (!f->payload)
        return tdm_pd_send(p->net.outbox, job->decode_url, TDM_NET_KV_DATA, &d.base, NULL, 0,
                           p->cfg.send_timeout, err, errlen);
    struct export_arg a = {p, job, f->first_layer, f->num_layers};
    size_t bytes = push_layer_bytes(p, job) * (size_t)f->num_layers;
    return tdm_pd_send_fill(p->net.outbox, job->decode_url, TDM_NET_KV_DATA, &d.base, bytes,
                            export_fill, &a, p->cfg.send_timeout, err, errlen);
}

// True when the job must stop waiting on a peer: cancel, shutdown, deadline.
static bool job_gone(void *ctx)
{
    struct pjob *job = ctx;
    struct tdm_prefill_service *p = job->svc;
    pthread_mutex_lock(&p->mu);
    bool cancelled = job->cancelled;
    pthread_mutex_unlock(&p->mu);
    return cancelled || atomic_load(&p->net.stopping) || tdm_now() > job->deadline;
}

// Picks the transfer's mode before its first frame (kv_transport.h), counts it
// per transport and notes it for /health. TDM_OK, or an error with err set
// (nothing both sides allow works: the push fails and the decode worker moves on).
static int start_transfer(struct tdm_prefill_service *p, struct pjob *job, char *err, size_t errlen)
{
    int rc = tdm_kv_send_choose(job->kv);
    const char *why = tdm_kv_send_why(job->kv);
    if (rc != TDM_OK) {
        snprintf(err, errlen, "no KV transport: %s", why);
        return rc;
    }
    const struct tdm_kv_transport_ops *t = tdm_kv_send_ops(job->kv);
    tdm_kv_transport_note(p->kvt, job->decode_url, t->mode, why);
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(p->transfers, t->name));
    TDM_LOG_DEBUG(MOD, "req=%s transfer to %s over %s (%s)", job->request_id, job->decode_url,
                  t->name, why);
    return TDM_OK;
}

// Tells the decode worker the push failed, so it moves on at once (best effort).
static void send_kv_error(struct tdm_prefill_service *p, struct pjob *job, int code,
                          const char *message)
{
    Tandem__KvData d = TANDEM__KV_DATA__INIT;
    d.transfer_id = job->transfer_id;
    d.to_instance = job->decode_instance;
    d.from_instance = p->net.instance;
    d.error = code ? code : TDM_EPROTO;
    d.message = (char *)message;
    char err[256];
    tdm_pd_send(p->net.outbox, job->decode_url, TDM_NET_KV_DATA, &d.base, NULL, 0, 1.0, err,
                sizeof err);
}

// Reads the finished request's outcome and sends the PrefillResult (an error
// one when the prefill failed or the push already did). Returns true when the
// result reported success.
static bool send_result(struct tdm_prefill_service *p, struct pjob *job, bool push_failed,
                        const char *push_err)
{
    struct tdm_engine *e = p->parts.engine;
    struct tdm_engine_chunk c;
    memset(&c, 0, sizeof c);
    bool have_token = false;
    int32_t first_token = -1;
    float first_lp = 0;
    Tandem__TopLogprob top[TDM_MAX_TOP_ENTRIES], *top_ptr[TDM_MAX_TOP_ENTRIES];
    int num_top = 0;
    // The finish callback ran just before the stream publishes it: the wait is short.
    for (int tries = 0; tries < 100; tries++) {
        int rc = tdm_engine_stream_next(job->req, 0.1, &c);
        if (rc == TDM_ETIMEDOUT)
            continue;
        if (rc != TDM_OK)
            break;
        if (c.n > 0 && !have_token) {
            have_token = true;
            first_token = c.tokens[0];
            first_lp = c.logprobs ? c.logprobs[0] : 0;
            num_top = c.top ? c.num_top : 0;
            if (num_top > TDM_MAX_TOP_ENTRIES)
                num_top = TDM_MAX_TOP_ENTRIES;
            Tandem__TopLogprob init = TANDEM__TOP_LOGPROB__INIT;
            for (int i = 0; i < num_top; i++) {
                top[i] = init;
                top[i].token = c.top[i].token;
                top[i].logprob = c.top[i].logprob;
                top_ptr[i] = &top[i];
            }
        }
        if (c.finished) {
            job->have_times = true;
            tdm_engine_request_times(job->req, &job->times);
            tdm_span_attr_int(&job->span, "gen_ai.usage.prompt_tokens", c.num_prompt_tokens);
            tdm_span_attr_int(&job->span, "tandem.cached_tokens", c.num_cached_tokens);
            break;
        }
    }
    Tandem__PrefillResult r = TANDEM__PREFILL_RESULT__INIT;
    struct tdm_kv_header h;
    char err[256];
    r.transfer_id = job->transfer_id;
    r.to_instance = job->decode_instance;
    r.from_instance = p->net.instance;
    bool ok = c.finished && c.kv_held && have_token && !push_failed;
    if (ok && tdm_engine_kv_header(e, job->req, p->parts.served_name, &h) != TDM_OK)
        ok = false;
    h.dtype = (int32_t)job->push.dtype; // the payload sent: the dtype asked for
    if (ok) {
        r.first_token = first_token;
        r.logprob = first_lp;
        r.n_top = (size_t)num_top;
        r.top = top_ptr;
        r.stopped = c.reason == TDM_FINISH_STOP;
        r.num_prompt_tokens = c.num_prompt_tokens;
        r.num_cached_tokens = c.num_cached_tokens;
        r.kv_header.data = (uint8_t *)&h;
        r.kv_header.len = sizeof h;
        r.prefill_seconds = tdm_now() - job->t_submit;
    } else {
        r.error = c.finished && c.error ? c.error : push_failed ? TDM_ETRANSPORT : TDM_ECLOSED;
        if (push_failed)
            snprintf(err, sizeof err, "KV push failed: %s", push_err);
        else
            snprintf(err, sizeof err, "prefill %s: %s",
                     c.finished ? tdm_finish_name(c.reason) : "did not finish",
                     c.message && c.message[0] ? c.message : "no KV held");
        r.message = err;
        if (!push_failed)
            tdm_pd_metrics_fail(&p->m, "prefill");
        tdm_span_error(&job->span, err);
    }
    char serr[256];
    int src = tdm_pd_send(p->net.outbox, job->decode_url, TDM_NET_PREFILL_RESULT, &r.base, NULL, 0,
                          p->cfg.send_timeout, serr, sizeof serr);
    if (src != TDM_OK) {
        TDM_LOG_WARN(MOD, "req=%s result not delivered: %s", job->request_id, serr);
        tdm_pd_metrics_fail(&p->m, "send");
        ok = false;
    }
    return ok;
}

// Layers [first, first + n) over the transfer's mode (chosen before the first
// group); *bytes what it moved, counted per group at once: the decode worker
// may be done with the request before this job gets to its end. In place:
// the device bytes copied (the pool's dtype), not the f32 payload size.
static int push_group(struct tdm_prefill_service *p, struct pjob *job, int first, int n,
                      size_t *bytes, char *err, size_t errlen)
{
    int rc = first == 0 ? start_transfer(p, job, err, errlen) : TDM_OK;
    double copy_s = 0;
    if (rc == TDM_OK)
        rc = tdm_kv_send_ops(job->kv)->push_layers(job->kv, first, n, bytes, &copy_s, err, errlen);
    if (copy_s > 0)
        tdm_metrics_counter_add(p->copy_seconds, copy_s);
    if (rc == TDM_OK)
        tdm_metrics_counter_add(p->m.bytes, (double)*bytes);
    return rc;
}

// A layer group that could not be sent: logged, counted, the decode worker
// told where it waits on us, the prefill aborted.
static void push_stopped(struct tdm_prefill_service *p, struct pjob *job, int rc, int first, int n,
                         const char *err)
{
    pthread_mutex_lock(&p->mu);
    bool cancelled = job->cancelled;
    pthread_mutex_unlock(&p->mu);
    TDM_LOG_WARN(MOD, "req=%s transfer=%016llx layers %d..%d not sent: %s", job->request_id,
                 (unsigned long long)job->transfer_id, first, first + n - 1, err);
    tdm_pd_metrics_fail(&p->m, cancelled ? "cancelled" : rc == TDM_EINVAL ? "export" : "send");
    // Over NCCL the decode worker's receives wait on this transfer: it is
    // told at once, as for a refused export.
    if ((rc == TDM_EINVAL || tdm_kv_send_ops(job->kv)->mode == TDM_KVX_NCCL) && !cancelled)
        send_kv_error(p, job, rc, err);
    tdm_engine_abort(p->parts.engine, job->req, TDM_FINISH_ABORT);
}

// The trace: queue and prefill compute from the engine, the KV push from the
// first frame to the last one sent.
static void trace_job(struct tdm_prefill_service *p, struct pjob *job, double t_first_frame,
                      double t_last_frame, int sent, size_t bytes, const char *err)
{
    int L = p->kvc.num_layers;
    bool pushing = job->push.num_blocks > 0;
    if (job->span.recording) {
        struct tdm_tracer *t = p->parts.tracer;
        double now = tdm_now();
        if (job->have_times) {
            struct tdm_trace_phases ph = {job->times.arrival, job->times.first_scheduled,
                                          job->times.first_token, 0, "prefill"};
            tdm_tracer_emit_phases(t, &job->span, &ph);
        }
        if (t_first_frame > 0) {
            struct tdm_span kv;
            tdm_span_begin_child(&kv, &job->span, "kv_push", TDM_SPAN_PRODUCER, t_first_frame);
            kv.end = t_last_frame > 0 ? t_last_frame : now;
            tdm_span_attr_int(&kv, "tandem.kv.layers", sent);
            tdm_span_attr_int(&kv, "tandem.kv.bytes", (int64_t)bytes);
            if (pushing && sent < L)
                tdm_span_error(&kv, err[0] ? err : "push stopped");
            tdm_tracer_emit(t, &kv);
        }
        job->span.end = now;
        tdm_tracer_emit(t, &job->span);
    }
}

// One PrefillRequest from submit to release. Frames go out as the push hook
// reports layer groups final (while the engine computes the later layers); the
// result goes out as soon as the first token is sampled, between two frames at
// the latest; the blocks stay pinned until the last frame was sent or the push
// was given up, and are released on every path.
static void job_end(struct pjob *job, bool pushed, double t_first_frame, size_t bytes);

static void *job_main(void *arg)
{
    struct pjob *job = arg;
    struct tdm_prefill_service *p = job->svc;
    struct tdm_engine *e = p->parts.engine;
    int L = p->kvc.num_layers;
    int per = job->push.layers_per_frame;
    bool pushing = job->push.num_blocks > 0;
    int sent = 0;             // layers sent
    bool push_failed = false; // no more frames (failed, cancelled, prefill failed)
    bool result_sent = false; // the PrefillResult went out (ok or not)
    bool aborted = false;
    double t_finish = 0, t_first_frame = 0, t_last_frame = 0;
    size_t bytes = 0;
    char err[256] = "";

    for (;;) {
        // Done (result out, every frame sent or the push given up): release the
        // KV now, not after another wait for a wake-up nobody sends (the
        // traces showed every prefill holding its blocks 0.1 s too long).
        if (result_sent && (!pushing || push_failed || sent == L))
            break;
        pthread_mutex_lock(&job->mu);
        int want = sent + per < L ? sent + per : L;
        bool frame_ready = pushing && !push_failed && sent < L && job->layers_ready >= want;
        if (!frame_ready && !(job->finished && !result_sent)) {
            tdm_cond_wait_for(&job->cv, &job->mu, 0.1);
            frame_ready = pushing && !push_failed && sent < L && job->layers_ready >= want;
        }
        bool finished = job->finished;
        pthread_mutex_unlock(&job->mu);

        // Cancel, shutdown, deadline or a hold past its time: abort (releases
        // held KV too; running exports finish first, later ones are refused).
        pthread_mutex_lock(&p->mu);
        bool cancelled = job->cancelled;
        pthread_mutex_unlock(&p->mu);
        double now = tdm_now();
        bool hold_over = result_sent && now > t_finish + job->hold_seconds;
        if ((cancelled || atomic_load(&p->net.stopping) || now > job->deadline || hold_over) &&
            !aborted) {
            tdm_engine_abort(e, job->req, TDM_FINISH_ABORT);
            aborted = true;
            if (pushing && !push_failed && sent < L) {
                // A decode worker that gave up or went away counts as hold_timeout too.
                tdm_pd_metrics_fail(&p->m, cancelled ? "cancelled" : "hold_timeout");
                TDM_LOG_INFO(MOD, "req=%s transfer=%016llx push stopped after %d of %d layers (%s)",
                             job->request_id, (unsigned long long)job->transfer_id, sent, L,
                             cancelled ? "cancelled" : "shutdown, deadline or hold time");
                snprintf(err, sizeof err, "%s", cancelled ? "cancelled" : "hold time or deadline");
            }
            push_failed = true;
        }

        // The first token first: the decode worker finishes its import with it.
        if (finished && !result_sent) {
            bool ok = send_result(p, job, push_failed, err);
            result_sent = true;
            t_finish = tdm_now();
            if (!ok)
                push_failed = true; // the decode worker moves on at the error result
            continue;
        }
        if (frame_ready && !push_failed) {
            int n = want - sent;
            size_t fb = 0;
            if (t_first_frame == 0)
                t_first_frame = tdm_now();
            int rc = push_group(p, job, sent, n, &fb, err, sizeof err);
            if (rc == TDM_OK) {
                sent += n;
                bytes += fb;
                t_last_frame = tdm_now();
                continue;
            }
            push_stopped(p, job, rc, sent, n, err);
            push_failed = true;
            aborted = true; // nobody can use this prefill any more: stop computing it
            continue;
        }
        if (result_sent && (!pushing || push_failed || sent == L))
            break;
    }
    trace_job(p, job, t_first_frame, t_last_frame, sent, bytes, err);
    job_end(job, pushing && sent == L, t_first_frame, bytes);
    return NULL;
}

// The end of every job: a complete push counted (blocks, seconds from the
// first frame), then always the blocks handed back and the job forgotten.
static void job_end(struct pjob *job, bool pushed, double t_first_frame, size_t bytes)
{
    struct tdm_prefill_service *p = job->svc;
    struct tdm_engine *e = p->parts.engine;
    if (pushed) {
        double dt = tdm_now() - t_first_frame;
        tdm_metrics_counter_add(p->m.blocks, (double)job->push.num_blocks);
        tdm_metrics_histogram_observe(p->m.seconds, dt);
        TDM_LOG_DEBUG(MOD, "req=%s transfer=%016llx sent blocks=%d bytes=%zu seconds=%.4f",
                      job->request_id, (unsigned long long)job->transfer_id, job->push.num_blocks,
                      bytes, dt);
    }
    tdm_kv_send_free(job->kv); // closed frame before the KV goes back: no copy reads it
    // The handle is dropped and the job unlisted in one hold of p->mu: the
    // Cancel handler and tdm_prefill_service_free abort listed jobs' requests
    // under it, and must never see a handle already released (the engine may
    // have dropped its reference at the finish: that would free it).
    pthread_mutex_lock(&p->mu);
    tdm_engine_release_kv(e, job->req); // EINVAL when nothing is held: fine
    tdm_engine_abort(e, job->req, TDM_FINISH_ABORT);
    tdm_engine_request_release(job->req);
    job_unlink(p, job);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    pthread_cond_destroy(&job->cv);
    pthread_mutex_destroy(&job->mu);
    free(job);
}

static void reply_error(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m, int code,
                        const char *message)
{
    if (m->reply_to == NULL || m->reply_to->url == NULL || m->reply_to->url[0] == '\0')
        return;
    Tandem__PrefillResult r = TANDEM__PREFILL_RESULT__INIT;
    r.transfer_id = m->transfer_id;
    r.to_instance = m->reply_to->instance;
    r.from_instance = p->net.instance;
    r.error = code;
    r.message = (char *)message;
    char err[256];
    tdm_pd_send(p->net.outbox, m->reply_to->url, TDM_NET_PREFILL_RESULT, &r.base, NULL, 0, 1.0, err,
                sizeof err);
    if (m->kv_pool.len > 0) {
        // Refused before any copy: the decode worker may reuse the blocks at once.
        Tandem__KvData d = TANDEM__KV_DATA__INIT;
        d.transfer_id = m->transfer_id;
        d.to_instance = m->reply_to->instance;
        d.from_instance = p->net.instance;
        d.closed = true;
        tdm_pd_send(p->net.outbox, m->reply_to->url, TDM_NET_KV_DATA, &d.base, NULL, 0, 1.0, err,
                    sizeof err);
    }
}

// A submitted job whose thread could not be started. Never run inline: this
// reader thread is the only one reading the decode worker's connection, so
// its later frames (this transfer's Cancel too) would wait for the whole
// prefill and push. The engine request is aborted (any KV it got goes back)
// and its finish awaited, at most one engine step, so no engine callback can
// reach the job once it is freed; the decode worker gets an error result
// (TDM_EBUSY: it moves on to its next prefill worker or prefills locally) and
// the job ends as any other.
static void job_refuse_unstarted(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m,
                                 struct pjob *job)
{
    const char *why = "cannot start a thread for the request (out of threads); try again";
    TDM_LOG_WARN(MOD, "req=%s transfer=%016llx refused: cannot start a job thread", job->request_id,
                 (unsigned long long)job->transfer_id);
    tdm_engine_abort(p->parts.engine, job->req, TDM_FINISH_ABORT);
    pthread_mutex_lock(&job->mu);
    while (!job->finished)
        tdm_cond_wait_for(&job->cv, &job->mu, 0.1);
    pthread_mutex_unlock(&job->mu);
    reply_error(p, m, TDM_EBUSY, why); // with the closed frame of an offered pool
    tdm_kv_send_mark_closed(job->kv);
    tdm_pd_metrics_fail(&p->m, "thread");
    if (job->span.recording) {
        tdm_span_error(&job->span, why);
        job->span.end = tdm_now();
        tdm_tracer_emit(p->parts.tracer, &job->span);
    }
    job_end(job, false, 0, 0);
}

// Checks a PrefillRequest before anything is computed: ours (instance, model),
// ready, a reply address, sane sampling, prompt and push target. False when
// it was refused (answered with an error result where a reply address exists).
static bool prefill_accept(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m,
                           struct tdm_engine_request_params *ep, struct tdm_pd_push *push)
{
    char err[512];
    if (m->to_instance != 0 && m->to_instance != p->net.instance) {
        // Meant for an earlier incarnation of this address: refuse it at once so
        // the decode worker moves on instead of waiting for a result.
        TDM_LOG_INFO(MOD, "req=%s for instance %016llx (not us) refused", m->request_id,
                     (unsigned long long)m->to_instance);
        reply_error(p, m, TDM_ENOTFOUND, "prefill worker restarted (stale instance id)");
        return false;
    }
    if (m->reply_to == NULL || m->reply_to->url == NULL || m->reply_to->url[0] == '\0' ||
        strlen(m->reply_to->url) >= sizeof(((struct pjob *)0)->decode_url))
        return false;
    tdm_metrics_counter_inc(p->m.requests);
    if (!tdm_worker_ready(p->server)) {
        reply_error(p, m, TDM_ECLOSED, "prefill worker is not ready (loading or draining)");
        return false;
    }
    if (m->model[0] && strcmp(m->model, p->parts.served_name) != 0) {
        snprintf(err, sizeof err, "model \"%s\" is not served here (\"%s\")", m->model,
                 p->parts.served_name);
        reply_error(p, m, TDM_EINVAL, err);
        return false;
    }
    tdm_engine_request_params_default(ep);
    if (tdm_pd_sampling_from_proto(m->sampling, &ep->sampling, err, sizeof err) != TDM_OK) {
        reply_error(p, m, TDM_EPROTO, err);
        return false;
    }
    if (m->n_prompt == 0 || m->n_prompt > (size_t)INT32_MAX / 2 || m->n_eos_ids > 64) {
        reply_error(p, m, TDM_EINVAL, "empty or oversized prompt / eos list");
        return false;
    }
    // The push target: the decode worker's geometry must be ours, its range
    // inside the prompt; refused before anything is computed.
    if (tdm_pd_push_from_proto(m, &p->kvc, p->parts.served_name, p->cfg.layers_per_frame, push, err,
                               sizeof err) != TDM_OK) {
        TDM_LOG_WARN(MOD, "req=%s refused: %s", m->request_id, err);
        reply_error(p, m, TDM_EPROTO, err);
        return false;
    }
    // A device pool offer: its descriptor and one block id per pushed block.
    struct tdm_kvx_pool pool;
    if (m->kv_pool.len > 0 &&
        tdm_kv_send_check_offer(m->kv_pool.data, m->kv_pool.len, m->n_block_ids, push->num_blocks,
                                &pool, err, sizeof err) != TDM_OK) {
        TDM_LOG_WARN(MOD, "req=%s refused: %s", m->request_id, err);
        reply_error(p, m, TDM_EPROTO, err);
        return false;
    }
    return true;
}

// The job's KV transfer (kv_transport.h) from the PrefillRequest: the
// decode worker's settings and, with a device pool offer (checked by
// prefill_accept), the pool, its block ids and the pair's communicator id.
static int prefill_transfer_new(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m,
                                struct pjob *job)
{
    char err[256];
    job->host = (struct tdm_kv_send_host){.ctx = job,
                                          .lease = host_lease,
                                          .unlease = host_unlease,
                                          .send = host_send,
                                          .gone = job_gone};
    struct tdm_kv_send_params sp = {
        .peer = job->decode_url,
        .peer_instance = job->decode_instance,
        .request_id = job->request_id,
        .peer_setting = m->kv_transfer ? m->kv_transfer : "",
        .peer_host = m->host_id ? m->host_id : "",
        .num_blocks = job->push.num_blocks,
        .layers_per_group = job->push.layers_per_frame,
        .payload_layer_bytes = push_layer_bytes(p, job),
    };
    if (m->kv_pool.len > 0 && job->push.num_blocks > 0) {
        tdm_kv_send_check_offer(m->kv_pool.data, m->kv_pool.len, m->n_block_ids,
                                job->push.num_blocks, &sp.pool, err, sizeof err);
        sp.offered = true;
        sp.dst_blocks = (const int *)m->block_ids; // int32_t is int here
        if (m->nccl_id.len == TDM_KVX_NCCL_ID_BYTES) {
            sp.has_nccl_id = true;
            memcpy(sp.nccl_id, m->nccl_id.data, TDM_KVX_NCCL_ID_BYTES);
        }
    }
    return tdm_kv_send_new(&job->kv, p->kvt, &job->host, &sp);
}
_Static_assert(sizeof(int32_t) == sizeof(int), "block ids are passed as int");

// Submits an accepted PrefillRequest as a PREFILL_ONLY engine request with the
// push hook and starts its job thread (the job is listed before the submit, so
// a Cancel that follows at once finds it).
static void prefill_start(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m,
                          struct tdm_engine_request_params *ep, const struct tdm_pd_push *push)
{
    char err[512];
    struct pjob *job = calloc(1, sizeof *job);
    if (job == NULL) {
        reply_error(p, m, TDM_ENOMEM, "out of memory");
        return;
    }
    pthread_mutex_init(&job->mu, NULL);
    tdm_cond_init(&job->cv);
    job->svc = p;
    job->transfer_id = m->transfer_id;
    job->push = *push;
    snprintf(job->request_id, sizeof job->request_id, "%s", m->request_id);
    snprintf(job->decode_url, sizeof job->decode_url, "%s", m->reply_to->url);
    job->decode_instance = m->reply_to->instance;
    if (prefill_transfer_new(p, m, job) != TDM_OK) {
        pthread_cond_destroy(&job->cv);
        pthread_mutex_destroy(&job->mu);
        free(job);
        reply_error(p, m, TDM_ENOMEM, "out of memory");
        return;
    }
    double now = tdm_now();
    double wall = (double)time(NULL);
    job->deadline = m->deadline_unix > 0 ? now + (m->deadline_unix - wall) : now + 600;
    job->hold_seconds = p->cfg.hold_seconds;
    if (m->hold_seconds > 0 && m->hold_seconds < job->hold_seconds)
        job->hold_seconds = m->hold_seconds;
    job->t_submit = now;
    if (p->parts.tracer) {
        struct tdm_trace_ctx parent;
        tdm_trace_ctx_from_headers(m->traceparent && m->traceparent[0] ? m->traceparent : NULL,
                                   m->tracestate, &parent);
        tdm_span_begin(&job->span, p->parts.tracer, &parent, "prefill_request", TDM_SPAN_SERVER,
                       now);
        tdm_span_attr_str(&job->span, "gen_ai.request.id", m->request_id);
        tdm_span_attr_str(&job->span, "gen_ai.response.model", p->parts.served_name);
        tdm_span_attr_int(&job->span, "tandem.kv.blocks", push->num_blocks);
    }
    ep->id = m->request_id;
    ep->prompt = m->prompt;
    ep->n_prompt = (int)m->n_prompt;
    ep->kind = TDM_ENGINE_REQ_PREFILL_ONLY;
    ep->max_tokens = 1;
    ep->priority = tdm_engine_get_config(p->parts.engine)->priority_scheduling ? m->priority : 0;
    ep->cache_salt = m->cache_salt;
    ep->on_output = job_on_output;
    ep->ctx = job;
    if (push->num_blocks > 0) {
        ep->on_layer = job_on_layer;
        ep->layer_ctx = job;
    }
    if (m->n_eos_ids) {
        ep->eos_ids = m->eos_ids;
        ep->num_eos = (int)m->n_eos_ids;
    } else {
        ep->eos_ids = p->parts.eos_ids;
        ep->num_eos = p->parts.num_eos;
    }
    // Listed before submit: a Cancel that follows the request at once finds it.
    pthread_mutex_lock(&p->mu);
    bool dup = job_find(p, m->transfer_id) != NULL;
    int rc = TDM_EINVAL;
    if (dup) {
        snprintf(err, sizeof err, "transfer %016llx already in progress",
                 (unsigned long long)m->transfer_id);
    } else {
        rc = tdm_engine_submit(p->parts.engine, ep, &job->req, err, sizeof err);
        if (rc == TDM_OK) {
            job->next = p->jobs;
            p->jobs = job;
            p->num_jobs++;
        }
    }
    pthread_mutex_unlock(&p->mu);
    if (rc != TDM_OK) {
        pthread_cond_destroy(&job->cv);
        pthread_mutex_destroy(&job->mu);
        tdm_kv_send_mark_closed(job->kv); // reply_error sends the closed frame
        tdm_kv_send_free(job->kv);
        free(job);
        reply_error(p, m, rc, err);
        tdm_pd_metrics_fail(&p->m, "submit");
        return;
    }
    if (tdm_thread_start_detached(job_main, job) != TDM_OK)
        job_refuse_unstarted(p, m, job);
}

static void on_prefill(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_prefill_service *p = arg;
    Tandem__PrefillRequest *m = tandem__prefill_request__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL) {
        TDM_LOG_WARN(MOD, "undecodable PrefillRequest dropped");
        return;
    }
    struct tdm_engine_request_params ep;
    struct tdm_pd_push push;
    if (prefill_accept(p, m, &ep, &push))
        prefill_start(p, m, &ep, &push);
    tandem__prefill_request__free_unpacked(m, NULL);
}

static void on_cancel(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_prefill_service *p = arg;
    Tandem__Cancel *m = tandem__cancel__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL)
        return;
    if (m->to_instance == p->net.instance || m->to_instance == 0) {
        pthread_mutex_lock(&p->mu);
        struct pjob *job = job_find(p, m->transfer_id);
        if (job) {
            job->cancelled = true;
            tdm_engine_abort(p->parts.engine, job->req, TDM_FINISH_ABORT);
            pthread_cond_broadcast(&p->cv);
        }
        pthread_mutex_unlock(&p->mu);
    }
    tandem__cancel__free_unpacked(m, NULL);
}

// The load this worker reports to a load query (router or decode worker).
static void fill_load(void *arg, struct tdm_pd_load *load)
{
    struct tdm_prefill_service *p = arg;
    struct tdm_engine_stats st;
    tdm_engine_get_stats(p->parts.engine, &st);
    tdm_pd_service_load(&p->net, &st, "prefill", p->parts.served_name, load);
    load->held = st.num_held;
}

static const struct tdm_pd_metric_names metric_names = {
    .bytes = {"tandem:kv_transfer_bytes_total", "KV bytes sent to decode workers."},
    .blocks = {"tandem:kv_transfer_blocks_total", "KV blocks sent to decode workers."},
    .requests = {"tandem:pd_prefill_requests_total",
                 "PrefillRequests received from decode workers."},
    .failures = {"tandem:kv_transfer_failures_total",
                 "Prefill/transfer failures by reason (prefill, send, export, submit, thread, "
                 "cancelled, hold_timeout)."},
    .seconds = {"tandem:kv_transfer_seconds",
                "Seconds from a request's first KvData frame to its last (frames go out as the "
                "final chunk's layers finish, so this overlaps the prefill)."},
};

static void health_details(void *arg, char *buf, size_t len)
{
    struct tdm_prefill_service *p = arg;
    tdm_kv_transport_health(p->kvt, buf, len);
}

// The GPU-to-GPU side of the service: --kv-transfer, this node's id, whether
// our KV pool is one device allocation (then CUDA IPC can read it), the IPC
// handle cache, the pair table behind /health and the per-transport counter.
static int prefill_kvx_init(struct tdm_prefill_service *p, struct tdm_worker *server, char *err,
                            size_t errlen)
{
    struct tdm_kv_device_pool own;
    int rc = tdm_worker_kv_transport_new(server, TDM_KVX_PREFILL, p->cfg.kvx_ops,
                                         p->cfg.nccl_timeout, &p->kvt, &own);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "prefill: out of memory");
    static const char *const transport[] = {"transport"};
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    o.name = "tandem:kv_transfers_total";
    o.help = "KV transfers started, by transport (nng, cuda-ipc, nccl).";
    o.label_names = transport;
    o.n_label_names = 1;
    rc = tdm_metrics_counter_register(&p->transfers, p->parts.reg, &o, err, errlen);
    if (rc != TDM_OK)
        return rc;
    o.name = "tandem:kv_copy_seconds_total";
    o.help =
        "Seconds of device-to-device KV moves (CUDA IPC copies, NCCL sends), issue to observed "
        "completion, "
        "summed over layer groups (KV bytes / this = the copy bandwidth).";
    o.label_names = NULL;
    o.n_label_names = 0;
    rc = tdm_metrics_counter_register(&p->copy_seconds, p->parts.reg, &o, err, errlen);
    if (rc != TDM_OK)
        return rc;
    tdm_worker_set_health_details(server, health_details, p);
    return TDM_OK;
}

int tdm_prefill_service_new(struct tdm_prefill_service **out, struct tdm_worker *server,
                            const struct tdm_prefill_config *cfg, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_prefill_service *p = calloc(1, sizeof *p);
    if (p == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "prefill: out of memory");
    p->cfg = *cfg;
    p->server = server;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int rc = tdm_worker_parts(server, &p->parts);
    if (rc != TDM_OK) {
        tdm_seterr(err, errlen, rc, "prefill: the server is not loaded");
        goto fail;
    }
    tdm_model_kv_config(p->parts.model, &p->kvc);
    p->kvc.block_size = p->parts.block_size;
    p->kvc.dtype = tdm_engine_kv_dtype(p->parts.engine);
    rc = tdm_pd_metrics_register(&p->m, p->parts.reg, &metric_names, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    rc = prefill_kvx_init(p, server, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    struct tdm_pd_service_config net = {
        .url = cfg->nng_url,
        .module = MOD,
        .on = {[TDM_NET_PREFILL] = on_prefill, [TDM_NET_CANCEL] = on_cancel},
        .fill_load = fill_load,
        .arg = p,
    };
    rc = tdm_pd_service_init(&p->net, &net, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    *out = p;
    return TDM_OK;
fail:
    tdm_worker_set_health_details(server, NULL, NULL);
    tdm_kv_transport_free(p->kvt);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    return rc;
}

void tdm_prefill_service_free(struct tdm_prefill_service *p)
{
    if (p == NULL)
        return;
    tdm_pd_service_stop(&p->net);
    // Job threads see stopping, abort and release; wait for them to leave.
    pthread_mutex_lock(&p->mu);
    for (struct pjob *j = p->jobs; j; j = j->next)
        tdm_engine_abort(p->parts.engine, j->req, TDM_FINISH_ABORT);
    pthread_cond_broadcast(&p->cv);
    while (p->num_jobs > 0)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    tdm_pd_service_fini(&p->net);
    tdm_worker_set_health_details(p->server, NULL, NULL);
    tdm_kv_transport_free(p->kvt);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
