// SPDX-License-Identifier: Apache-2.0
// prefill: the prefill worker's P/D service (see prefill.h). One receive thread
// reads the inbox and dispatches; each PrefillRequest gets a job thread that
// owns its engine request from submit to release, so every exit path of that
// one function releases the KV. The receive thread only flips flags on jobs
// (pull arrived, cancelled) and signals; it never blocks on a peer.
//
// Invariants: a job is in the list from submit until its thread is about to
// free it; messages whose to_instance is not ours were meant for an earlier
// incarnation of this address and are dropped.
#include "prefill.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "decode.h"
#include "decode_parts.h"
#include "engine.h"
#include "kv_cache.h"
#include "metrics.h"
#include "model.h"
#include "pd_codec.h"
#include "transport.h"

#define MOD "prefill"

void tdm_prefill_config_default(struct tdm_prefill_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->nng_url, sizeof cfg->nng_url, "tcp://0.0.0.0:9200");
    cfg->hold_seconds = 30;
    cfg->layers_per_frame = 4;
    cfg->send_timeout = 5;
}

static int parse_double(const char *flag, const char *v, double lo, double *out, char *err,
                        size_t errlen)
{
    char *end = NULL;
    double x = v ? strtod(v, &end) : 0;
    if (v == NULL || end == v || *end != '\0' || !(x >= lo) || x > 1e9)
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: expected a number >= %g, got \"%s\"", flag,
                          lo, v ? v : "");
    *out = x;
    return TDM_OK;
}

int tdm_prefill_config_take_args(struct tdm_prefill_config *cfg, int *argc, char **argv, char *err,
                                 size_t errlen)
{
    int w = 1;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i];
        const char *names[] = {"--nng-url", "--kv-hold-seconds", "--layers-per-frame"};
        int which = -1;
        const char *val = NULL;
        for (int k = 0; k < 3; k++) {
            size_t n = strlen(names[k]);
            if (strncmp(a, names[k], n) == 0 && (a[n] == '\0' || a[n] == '=')) {
                which = k;
                if (a[n] == '=')
                    val = a + n + 1;
                else if (i + 1 < *argc)
                    val = argv[++i];
                else
                    return tdm_seterr(err, errlen, TDM_EINVAL, "%s: missing value", names[k]);
            }
        }
        if (which < 0) {
            argv[w++] = argv[i];
            continue;
        }
        double x = 0;
        int rc = TDM_OK;
        if (which == 0) {
            if (strlen(val) >= sizeof cfg->nng_url || strstr(val, "://") == NULL)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "--nng-url: expected tcp://HOST:PORT, got \"%s\"", val);
            snprintf(cfg->nng_url, sizeof cfg->nng_url, "%s", val);
        } else if (which == 1) {
            rc = parse_double("--kv-hold-seconds", val, 0.1, &x, err, errlen);
            cfg->hold_seconds = x;
        } else {
            rc = parse_double("--layers-per-frame", val, 1, &x, err, errlen);
            cfg->layers_per_frame = (int)x;
        }
        if (rc != TDM_OK)
            return rc;
    }
    argv[w] = NULL;
    *argc = w;
    return TDM_OK;
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
    double deadline; // wall-monotonic (tdm_now) time after which the job is abandoned
    // Set by the receive thread under svc->mu:
    bool pulled;
    bool cancelled;
    int first_block, num_blocks, layers_per_frame;
};

struct tdm_prefill_service {
    struct tdm_prefill_config cfg;
    struct tdm_decode_server *server;
    struct tdm_decode_parts parts;
    struct tdm_kv_config kvc;
    uint64_t instance;
    struct tdm_net_inbox *inbox;
    struct tdm_net_outbox *outbox;
    pthread_t rx_thread;
    atomic_bool stopping;

    pthread_mutex_t mu;
    pthread_cond_t cv; // broadcast on any job flag change and on job exit
    struct pjob *jobs;
    int num_jobs;

    struct tdm_metrics_counter *m_bytes, *m_blocks, *m_fail, *m_requests;
    struct tdm_metrics_histogram *m_seconds;
};

const char *tdm_prefill_service_url(const struct tdm_prefill_service *p)
{
    return tdm_net_inbox_url(p->inbox);
}

uint64_t tdm_prefill_service_instance(const struct tdm_prefill_service *p)
{
    return p->instance;
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

static void fail_count(struct tdm_prefill_service *p, const char *reason)
{
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(p->m_fail, reason));
}

// Bytes of one layer's payload for nblocks blocks (K then V, f32).
static size_t layer_bytes(const struct tdm_kv_config *k, int nblocks)
{
    return 2u * (size_t)nblocks * (size_t)k->num_kv_heads * (size_t)k->block_size *
           (size_t)k->head_dim * sizeof(float);
}

struct export_arg {
    struct tdm_prefill_service *svc;
    struct pjob *job;
    int first_layer, num_layers;
};

// Fills a KvData payload: layer after layer, straight from the pinned blocks.
static int export_fill(void *arg, uint8_t *payload, size_t payload_len)
{
    struct export_arg *a = arg;
    size_t lb = layer_bytes(&a->svc->kvc, a->job->num_blocks);
    if (lb * (size_t)a->num_layers != payload_len)
        return TDM_EINVAL;
    for (int l = 0; l < a->num_layers; l++) {
        int rc = tdm_engine_export_layer(a->svc->parts.engine, a->job->req, a->first_layer + l,
                                         a->job->first_block, a->job->num_blocks,
                                         payload + (size_t)l * lb, lb);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

static void send_kv_error(struct tdm_prefill_service *p, struct pjob *job, int code,
                          const char *message)
{
    Tandem__KvData d = TANDEM__KV_DATA__INIT;
    d.transfer_id = job->transfer_id;
    d.to_instance = job->decode_instance;
    d.from_instance = p->instance;
    d.error = code ? code : TDM_EPROTO;
    d.message = (char *)message;
    char err[256];
    tdm_pd_send(p->outbox, job->decode_url, TDM_NET_KV_DATA, &d.base, NULL, 0, 1.0, err,
                sizeof err);
}

// Sends the pulled block range as KvData frames of layers_per_frame layers.
static int push_kv(struct tdm_prefill_service *p, struct pjob *job)
{
    int L = p->kvc.num_layers;
    int per = job->layers_per_frame;
    if (per < 1)
        per = 1;
    if (per > p->cfg.layers_per_frame)
        per = p->cfg.layers_per_frame;
    double t0 = tdm_now();
    size_t total = 0;
    char err[256];
    for (int l = 0; l < L; l += per) {
        int n = L - l < per ? L - l : per;
        struct export_arg a = {p, job, l, n};
        Tandem__KvData d = TANDEM__KV_DATA__INIT;
        d.transfer_id = job->transfer_id;
        d.to_instance = job->decode_instance;
        d.from_instance = p->instance;
        d.first_layer = l;
        d.num_layers = n;
        d.first_block = job->first_block;
        d.num_blocks = job->num_blocks;
        size_t bytes = layer_bytes(&p->kvc, job->num_blocks) * (size_t)n;
        int rc = tdm_pd_send_fill(p->outbox, job->decode_url, TDM_NET_KV_DATA, &d.base, bytes,
                                  export_fill, &a, p->cfg.send_timeout, err, sizeof err);
        if (rc != TDM_OK) {
            TDM_LOG_WARN(MOD, "req=%s transfer=%016llx layers %d..%d not sent: %s", job->request_id,
                         (unsigned long long)job->transfer_id, l, l + n - 1, err);
            fail_count(p, rc == TDM_EINVAL ? "export" : "send");
            if (rc == TDM_EINVAL)
                send_kv_error(p, job, rc, err);
            return rc;
        }
        total += bytes;
    }
    double dt = tdm_now() - t0;
    tdm_metrics_counter_add(p->m_bytes, (double)total);
    tdm_metrics_counter_add(p->m_blocks, (double)job->num_blocks);
    tdm_metrics_histogram_observe(p->m_seconds, dt);
    TDM_LOG_DEBUG(MOD, "req=%s transfer=%016llx sent blocks=%d bytes=%zu seconds=%.4f",
                  job->request_id, (unsigned long long)job->transfer_id, job->num_blocks, total,
                  dt);
    return TDM_OK;
}

static void *job_main(void *arg)
{
    struct pjob *job = arg;
    struct tdm_prefill_service *p = job->svc;
    struct tdm_engine *e = p->parts.engine;
    char err[256];
    double t_submit = tdm_now();

    // 1. Wait for the prefill (the engine samples the first token and holds the KV).
    struct tdm_engine_chunk c;
    memset(&c, 0, sizeof c);
    bool have_token = false;
    int32_t first_token = -1;
    float first_lp = 0;
    Tandem__TopLogprob top[TDM_MAX_LOGPROBS], *top_ptr[TDM_MAX_LOGPROBS];
    int num_top = 0;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        bool cancel = job->cancelled || atomic_load(&p->stopping) || tdm_now() > job->deadline;
        pthread_mutex_unlock(&p->mu);
        if (cancel)
            tdm_engine_abort(e, job->req, TDM_ENGINE_FINISH_ABORT);
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
            Tandem__TopLogprob init = TANDEM__TOP_LOGPROB__INIT;
            for (int i = 0; i < num_top && i < TDM_MAX_LOGPROBS; i++) {
                top[i] = init;
                top[i].token = c.top[i].token;
                top[i].logprob = c.top[i].logprob;
                top_ptr[i] = &top[i];
            }
        }
        if (c.finished)
            break;
    }
    double t_done = tdm_now();

    // 2. Report the first token (or the failure) to the decode worker.
    Tandem__PrefillResult r = TANDEM__PREFILL_RESULT__INIT;
    struct tdm_kv_header h;
    r.transfer_id = job->transfer_id;
    r.to_instance = job->decode_instance;
    r.from_instance = p->instance;
    bool ok = c.finished && c.kv_held && have_token;
    if (ok && tdm_engine_kv_header(e, job->req, p->parts.served_name, &h) != TDM_OK)
        ok = false;
    if (ok) {
        r.first_token = first_token;
        r.logprob = first_lp;
        r.n_top = (size_t)num_top;
        r.top = top_ptr;
        r.stopped = c.reason == TDM_ENGINE_FINISH_STOP;
        r.num_prompt_tokens = c.num_prompt_tokens;
        r.num_cached_tokens = c.num_cached_tokens;
        r.kv_header.data = (uint8_t *)&h;
        r.kv_header.len = sizeof h;
        r.prefill_seconds = t_done - t_submit;
    } else {
        r.error = c.finished && c.error ? c.error : TDM_ECLOSED;
        snprintf(err, sizeof err, "prefill %s: %s",
                 c.finished ? tdm_engine_finish_name(c.reason) : "did not finish",
                 c.message && c.message[0] ? c.message : "no KV held");
        r.message = err;
        fail_count(p, "prefill");
    }
    char serr[256];
    int src = tdm_pd_send(p->outbox, job->decode_url, TDM_NET_PREFILL_RESULT, &r.base, NULL, 0,
                          p->cfg.send_timeout, serr, sizeof serr);
    if (src != TDM_OK) {
        TDM_LOG_WARN(MOD, "req=%s result not delivered: %s", job->request_id, serr);
        fail_count(p, "send");
        ok = false;
    }

    // 3. Hold the KV until the pull, a cancel, the hold time or the deadline.
    if (ok) {
        double until = tdm_now() + p->cfg.hold_seconds;
        if (job->deadline < until)
            until = job->deadline;
        double down_since = 0;
        pthread_mutex_lock(&p->mu);
        while (!job->pulled && !job->cancelled && !atomic_load(&p->stopping) && tdm_now() < until) {
            // The decode worker gone (its connection down for 1 s): nobody will pull.
            pthread_mutex_unlock(&p->mu);
            bool up = tdm_net_connected(p->outbox, job->decode_url);
            pthread_mutex_lock(&p->mu);
            double now = tdm_now();
            if (up)
                down_since = 0;
            else if (down_since == 0)
                down_since = now;
            else if (now - down_since > 1.0)
                break;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&p->cv, &p->mu, &ts);
        }
        bool pulled = job->pulled && !job->cancelled;
        pthread_mutex_unlock(&p->mu);
        if (pulled && job->num_blocks > 0)
            push_kv(p, job);
        else if (!pulled) {
            // A decode worker that disconnected counts as hold_timeout too.
            fail_count(p, job->cancelled ? "cancelled" : "hold_timeout");
            TDM_LOG_INFO(MOD, "req=%s transfer=%016llx KV released unpulled (%s)", job->request_id,
                         (unsigned long long)job->transfer_id,
                         job->cancelled ? "cancelled"
                                        : "hold time, deadline, or decode worker gone");
        }
    }

    // 4. Always: hand the blocks back and forget the job.
    tdm_engine_release_kv(e, job->req); // EINVAL when nothing is held: fine
    tdm_engine_abort(e, job->req, TDM_ENGINE_FINISH_ABORT);
    tdm_engine_request_release(job->req);
    pthread_mutex_lock(&p->mu);
    job_unlink(p, job);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    free(job);
    return NULL;
}

static void reply_error(struct tdm_prefill_service *p, const Tandem__PrefillRequest *m, int code,
                        const char *message)
{
    if (m->reply_to == NULL || m->reply_to->url == NULL || m->reply_to->url[0] == '\0')
        return;
    Tandem__PrefillResult r = TANDEM__PREFILL_RESULT__INIT;
    r.transfer_id = m->transfer_id;
    r.to_instance = m->reply_to->instance;
    r.from_instance = p->instance;
    r.error = code;
    r.message = (char *)message;
    char err[256];
    tdm_pd_send(p->outbox, m->reply_to->url, TDM_NET_PREFILL_RESULT, &r.base, NULL, 0, 1.0, err,
                sizeof err);
}

static void on_prefill(struct tdm_prefill_service *p, const struct tdm_net_frame *f)
{
    Tandem__PrefillRequest *m = tandem__prefill_request__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL) {
        TDM_LOG_WARN(MOD, "undecodable PrefillRequest dropped");
        return;
    }
    char err[512];
    if (m->to_instance != 0 && m->to_instance != p->instance) {
        // Meant for an earlier incarnation of this address: refuse it at once so
        // the decode worker moves on instead of waiting for a result.
        TDM_LOG_INFO(MOD, "req=%s for instance %016llx (not us) refused", m->request_id,
                     (unsigned long long)m->to_instance);
        reply_error(p, m, TDM_ENOTFOUND, "prefill worker restarted (stale instance id)");
        goto out;
    }
    if (m->reply_to == NULL || m->reply_to->url == NULL || m->reply_to->url[0] == '\0' ||
        strlen(m->reply_to->url) >= sizeof(((struct pjob *)0)->decode_url))
        goto out;
    tdm_metrics_counter_inc(p->m_requests);
    if (!tdm_decode_server_ready(p->server)) {
        reply_error(p, m, TDM_ECLOSED, "prefill worker is not ready (loading or draining)");
        goto out;
    }
    if (m->model[0] && strcmp(m->model, p->parts.served_name) != 0) {
        snprintf(err, sizeof err, "model \"%s\" is not served here (\"%s\")", m->model,
                 p->parts.served_name);
        reply_error(p, m, TDM_EINVAL, err);
        goto out;
    }
    struct tdm_engine_request_params ep;
    tdm_engine_request_params_default(&ep);
    if (tdm_pd_sampling_from_proto(m->sampling, &ep.sampling, err, sizeof err) != TDM_OK) {
        reply_error(p, m, TDM_EPROTO, err);
        goto out;
    }
    if (m->n_prompt == 0 || m->n_prompt > (size_t)INT32_MAX / 2 || m->n_eos_ids > 64) {
        reply_error(p, m, TDM_EINVAL, "empty or oversized prompt / eos list");
        goto out;
    }
    struct pjob *job = calloc(1, sizeof *job);
    if (job == NULL) {
        reply_error(p, m, TDM_ENOMEM, "out of memory");
        goto out;
    }
    job->svc = p;
    job->transfer_id = m->transfer_id;
    snprintf(job->request_id, sizeof job->request_id, "%s", m->request_id);
    snprintf(job->decode_url, sizeof job->decode_url, "%s", m->reply_to->url);
    job->decode_instance = m->reply_to->instance;
    double now = tdm_now();
    double wall = (double)time(NULL);
    job->deadline = m->deadline_unix > 0 ? now + (m->deadline_unix - wall) : now + 600;
    ep.id = m->request_id;
    ep.prompt = m->prompt;
    ep.n_prompt = (int)m->n_prompt;
    ep.kind = TDM_ENGINE_REQ_PREFILL_ONLY;
    ep.max_tokens = 1;
    if (m->n_eos_ids) {
        ep.eos_ids = m->eos_ids;
        ep.num_eos = (int)m->n_eos_ids;
    } else {
        ep.eos_ids = p->parts.eos_ids;
        ep.num_eos = p->parts.num_eos;
    }
    pthread_mutex_lock(&p->mu);
    bool dup = job_find(p, m->transfer_id) != NULL;
    pthread_mutex_unlock(&p->mu);
    int rc = dup ? TDM_EINVAL : tdm_engine_submit(p->parts.engine, &ep, &job->req, err, sizeof err);
    if (dup)
        snprintf(err, sizeof err, "transfer %016llx already in progress",
                 (unsigned long long)m->transfer_id);
    if (rc != TDM_OK) {
        free(job);
        reply_error(p, m, rc, err);
        fail_count(p, "submit");
        goto out;
    }
    pthread_mutex_lock(&p->mu);
    job->next = p->jobs;
    p->jobs = job;
    p->num_jobs++;
    pthread_mutex_unlock(&p->mu);
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&th, &attr, job_main, job) != 0) {
        // Run it inline rather than leak the request: slow, but correct.
        pthread_attr_destroy(&attr);
        job_main(job);
        goto out;
    }
    pthread_attr_destroy(&attr);
out:
    tandem__prefill_request__free_unpacked(m, NULL);
}

static void on_pull(struct tdm_prefill_service *p, const struct tdm_net_frame *f)
{
    Tandem__KvPull *m = tandem__kv_pull__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL)
        return;
    if (m->to_instance == p->instance || m->to_instance == 0) {
        pthread_mutex_lock(&p->mu);
        struct pjob *job = job_find(p, m->transfer_id);
        if (job && !job->pulled) {
            job->pulled = true;
            job->first_block = m->first_block;
            job->num_blocks = m->num_blocks;
            job->layers_per_frame = m->layers_per_frame;
            pthread_cond_broadcast(&p->cv);
        }
        pthread_mutex_unlock(&p->mu);
    }
    tandem__kv_pull__free_unpacked(m, NULL);
}

static void on_cancel(struct tdm_prefill_service *p, const struct tdm_net_frame *f)
{
    Tandem__Cancel *m = tandem__cancel__unpack(NULL, f->msg_len, f->msg);
    if (m == NULL)
        return;
    if (m->to_instance == p->instance || m->to_instance == 0) {
        pthread_mutex_lock(&p->mu);
        struct pjob *job = job_find(p, m->transfer_id);
        if (job) {
            job->cancelled = true;
            tdm_engine_abort(p->parts.engine, job->req, TDM_ENGINE_FINISH_ABORT);
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
    load->instance = p->instance;
    load->role = "prefill";
    load->model = p->parts.served_name;
    load->running = st.num_running;
    load->waiting = st.num_waiting;
    load->kv_usage = st.kv_usage;
    load->free_blocks = st.num_free_blocks;
    load->total_blocks = st.num_total_blocks;
    load->block_size = st.block_size;
    load->held = st.num_held;
    load->url = tdm_net_inbox_url(p->inbox);
}

static void on_frame(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_prefill_service *p = arg;
    switch (f->type) {
    case TDM_NET_PREFILL:
        on_prefill(p, f);
        break;
    case TDM_NET_KV_PULL:
        on_pull(p, f);
        break;
    case TDM_NET_CANCEL:
        on_cancel(p, f);
        break;
    case TDM_NET_LOAD_QUERY:
        tdm_pd_answer_load_query(p->outbox, f, fill_load, p);
        break;
    default:
        TDM_LOG_DEBUG(MOD, "ignored %s frame", tdm_net_type_name(f->type));
    }
}

static void *rx_main(void *arg)
{
    struct tdm_prefill_service *p = arg;
    tdm_net_inbox_serve(p->inbox, &p->stopping, on_frame, p, MOD);
    return NULL;
}

static int register_metrics(struct tdm_prefill_service *p, char *err, size_t errlen)
{
    struct tdm_metrics_registry *reg = p->parts.reg;
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    o.name = "tandem:kv_transfer_bytes_total";
    o.help = "KV bytes sent to decode workers.";
    int rc = tdm_metrics_counter_register(&p->m_bytes, reg, &o, err, errlen);
    o.name = "tandem:kv_transfer_blocks_total";
    o.help = "KV blocks sent to decode workers.";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&p->m_blocks, reg, &o, err, errlen);
    o.name = "tandem:pd_prefill_requests_total";
    o.help = "PrefillRequests received from decode workers.";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&p->m_requests, reg, &o, err, errlen);
    static const char *const reason[] = {"reason"};
    o.name = "tandem:kv_transfer_failures_total";
    o.help = "Prefill/transfer failures by reason (prefill, send, export, submit, cancelled, "
             "hold_timeout).";
    o.label_names = reason;
    o.n_label_names = 1;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&p->m_fail, reg, &o, err, errlen);
    o.label_names = NULL;
    o.n_label_names = 0;
    static const double bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                    0.1,    0.25,  0.5,    1,     2.5,  5,     10};
    o.name = "tandem:kv_transfer_seconds";
    o.help = "Seconds to send one request's pulled KV (first frame to last).";
    if (rc == TDM_OK)
        rc = tdm_metrics_histogram_register(&p->m_seconds, reg, &o, bounds,
                                            sizeof bounds / sizeof bounds[0], err, errlen);
    return rc;
}

int tdm_prefill_service_new(struct tdm_prefill_service **out, struct tdm_decode_server *server,
                            const struct tdm_prefill_config *cfg, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_prefill_service *p = calloc(1, sizeof *p);
    if (p == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "prefill: out of memory");
    p->cfg = *cfg;
    p->server = server;
    p->instance = tdm_net_new_instance_id();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    int rc = tdm_decode_server_parts(server, &p->parts);
    if (rc != TDM_OK) {
        tdm_seterr(err, errlen, rc, "prefill: the server is not loaded");
        goto fail;
    }
    tdm_model_kv_config(p->parts.model, &p->kvc);
    p->kvc.block_size = p->parts.block_size;
    rc = register_metrics(p, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    rc = tdm_net_outbox_new(&p->outbox, 100, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    rc = tdm_net_inbox_new(&p->inbox, cfg->nng_url, err, errlen);
    if (rc != TDM_OK)
        goto fail_outbox;
    if (pthread_create(&p->rx_thread, NULL, rx_main, p) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "prefill: cannot start the receive thread");
        goto fail_inbox;
    }
    *out = p;
    return TDM_OK;
fail_inbox:
    tdm_net_inbox_free(p->inbox);
fail_outbox:
    tdm_net_outbox_free(p->outbox);
fail:
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
    return rc;
}

void tdm_prefill_service_free(struct tdm_prefill_service *p)
{
    if (p == NULL)
        return;
    atomic_store(&p->stopping, true);
    tdm_net_inbox_close(p->inbox);
    pthread_join(p->rx_thread, NULL);
    // Job threads see stopping, abort and release; wait for them to leave.
    pthread_mutex_lock(&p->mu);
    for (struct pjob *j = p->jobs; j; j = j->next)
        tdm_engine_abort(p->parts.engine, j->req, TDM_ENGINE_FINISH_ABORT);
    pthread_cond_broadcast(&p->cv);
    while (p->num_jobs > 0)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    tdm_net_inbox_free(p->inbox);
    tdm_net_outbox_free(p->outbox);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
