// SPDX-License-Identifier: Apache-2.0
// trace_export: OTLP/HTTP JSON encoding and the exporter thread (trace.h).
//
// The encoding follows the OTLP protobuf JSON mapping
// (opentelemetry-proto's ExportTraceServiceRequest): camelCase field names,
// trace and span ids as lower-case hex (not base64, an OTLP exception), 64-bit
// integers (times, intValue) as decimal strings, enums (kind, status code) as
// integers. Strings are escaped; bytes outside ASCII become '?', so a
// non-UTF-8 request id can never make the body invalid JSON.
//
// The queue is a ring of span copies guarded by one mutex that the request
// threads hold only for a memcpy; the exporter takes up to a batch under the
// lock into its own array and encodes and POSTs outside it. Lock order: mu only.
#include <curl/curl.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "metrics.h"
#include "trace.h"

#define MOD "trace"

// ---- a growable text buffer ----------------------------------------------------------------
// Appended unchecked: the buffer fails for good on an allocation failure
// (b->failed), checked once per batch.
static void sb_put(struct tdm_strbuf *b, const char *s, size_t n)
{
    (void)tdm_strbuf_add(b, s, n);
}

static void sb_puts(struct tdm_strbuf *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static void sb_printf(struct tdm_strbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(struct tdm_strbuf *b, const char *fmt, ...)
{
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        sb_put(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

// A JSON string literal.
static void sb_str(struct tdm_strbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            char e[2] = {'\\', (char)*c};
            sb_put(b, e, 2);
        } else if (*c < 0x20) {
            sb_printf(b, "\\u%04x", *c);
        } else if (*c >= 0x80) {
            sb_put(b, "?", 1);
        } else {
            sb_put(b, (const char *)c, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static void sb_hex(struct tdm_strbuf *b, const uint8_t *bytes, size_t n)
{
    char h[33];
    tdm_trace_hex(bytes, n, h);
    sb_put(b, "\"", 1);
    sb_put(b, h, 2 * n);
    sb_put(b, "\"", 1);
}

// tdm_now() seconds to Unix nanoseconds as a JSON string.
static void sb_nanos(struct tdm_strbuf *b, double t, double wall_offset)
{
    // Whole seconds of the offset apart, so the sum keeps nanosecond digits.
    double whole = floor(wall_offset);
    double rest = (t + (wall_offset - whole)) * 1e9;
    int64_t ns = (int64_t)whole * 1000000000LL + (int64_t)llround(rest);
    sb_printf(b, "\"%lld\"", (long long)(ns > 0 ? ns : 0));
}

// ---- OTLP JSON -----------------------------------------------------------------------------
static void encode_attr(struct tdm_strbuf *b, const struct tdm_span_attr *a)
{
    sb_puts(b, "{\"key\":");
    sb_str(b, a->key ? a->key : "");
    sb_puts(b, ",\"value\":{");
    switch (a->type) {
    case TDM_SPAN_ATTR_INT:
        sb_printf(b, "\"intValue\":\"%lld\"", (long long)a->i);
        break;
    case TDM_SPAN_ATTR_DOUBLE:
        // JSON has no NaN or infinities.
        sb_printf(b, "\"doubleValue\":%.17g", a->d == a->d && a->d - a->d == 0 ? a->d : 0.0);
        break;
    default:
        sb_puts(b, "\"stringValue\":");
        sb_str(b, a->s);
        break;
    }
    sb_puts(b, "}}");
}

static void encode_span(struct tdm_strbuf *b, const struct tdm_span *sp, double wall_offset)
{
    static const uint8_t zero[8];
    sb_puts(b, "{\"traceId\":");
    sb_hex(b, sp->trace_id, 16);
    sb_puts(b, ",\"spanId\":");
    sb_hex(b, sp->span_id, 8);
    if (memcmp(sp->parent_id, zero, 8) != 0) {
        sb_puts(b, ",\"parentSpanId\":");
        sb_hex(b, sp->parent_id, 8);
    }
    if (sp->tracestate[0]) {
        sb_puts(b, ",\"traceState\":");
        sb_str(b, sp->tracestate);
    }
    sb_puts(b, ",\"name\":");
    sb_str(b, sp->name);
    sb_printf(b, ",\"kind\":%d,\"startTimeUnixNano\":", (int)sp->kind);
    sb_nanos(b, sp->start, wall_offset);
    sb_puts(b, ",\"endTimeUnixNano\":");
    sb_nanos(b, sp->end >= sp->start ? sp->end : sp->start, wall_offset);
    sb_puts(b, ",\"attributes\":[");
    for (int i = 0; i < sp->n_attrs && i < TDM_SPAN_MAX_ATTRS; i++) {
        if (i)
            sb_put(b, ",", 1);
        encode_attr(b, &sp->attrs[i]);
    }
    sb_puts(b, "],\"events\":[");
    for (int i = 0; i < sp->n_events && i < TDM_SPAN_MAX_EVENTS; i++) {
        if (i)
            sb_put(b, ",", 1);
        sb_puts(b, "{\"timeUnixNano\":");
        sb_nanos(b, sp->events[i].t, wall_offset);
        sb_puts(b, ",\"name\":");
        sb_str(b, sp->events[i].name ? sp->events[i].name : "");
        sb_put(b, "}", 1);
    }
    sb_printf(b, "],\"status\":{\"code\":%d", sp->status);
    if (sp->status_message[0]) {
        sb_puts(b, ",\"message\":");
        sb_str(b, sp->status_message);
    }
    sb_puts(b, "}}");
}

int tdm_trace_encode_otlp(const struct tdm_span *spans, size_t n, const char *service_name,
                          double wall_offset, char **out, size_t *len)
{
    struct tdm_strbuf b = {0};
    sb_puts(&b, "{\"resourceSpans\":[{\"resource\":{\"attributes\":[{\"key\":\"service.name\","
                "\"value\":{\"stringValue\":");
    sb_str(&b, service_name ? service_name : "tandem");
    sb_puts(&b, "}}]},\"scopeSpans\":[{\"scope\":{\"name\":\"tandem\"},\"spans\":[");
    for (size_t i = 0; i < n; i++) {
        if (i)
            sb_put(&b, ",", 1);
        encode_span(&b, &spans[i], wall_offset);
    }
    sb_puts(&b, "]}]}]}");
    if (b.failed) {
        free(b.p);
        *out = NULL;
        *len = 0;
        return TDM_ENOMEM;
    }
    *out = b.p;
    *len = b.len;
    return TDM_OK;
}

double tdm_trace_wall_offset(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9 - tdm_now();
}

// ---- the exporter --------------------------------------------------------------------------
struct tdm_tracer {
    char url[1024]; // {endpoint}/v1/traces
    char service_name[128];
    int cap, batch; // queue bound, spans per POST
    double flush_interval, timeout;

    pthread_mutex_t mu;
    pthread_cond_t cv;     // signalled when a batch is full and on stop
    struct tdm_span *ring; // [cap]
    int head, count;       // under mu
    bool stopping;         // under mu
    pthread_t thread;
    bool started;

    struct tdm_span *out; // [batch] the exporter thread's copy
    _Atomic uint64_t dropped, exported;
    struct tdm_metrics_counter *m_dropped, *m_exported;
    double last_warn; // exporter thread only
    uint64_t failed_since_warn;
};

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static CURLcode g_curl_rc;
static void curl_init_once(void)
{
    g_curl_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

static size_t discard_body(char *p, size_t size, size_t nmemb, void *ud)
{
    (void)p;
    (void)ud;
    return size * nmemb;
}

static void count_dropped(struct tdm_tracer *t, uint64_t n)
{
    atomic_fetch_add(&t->dropped, n);
    tdm_metrics_counter_add(t->m_dropped, (double)n);
}

// One POST of n spans; false when the collector did not take them.
static bool post_batch(struct tdm_tracer *t, CURL *h, const struct tdm_span *spans, int n,
                       char *why, size_t whylen)
{
    char *body = NULL;
    size_t len = 0;
    if (tdm_trace_encode_otlp(spans, (size_t)n, t->service_name, tdm_trace_wall_offset(), &body,
                              &len) != TDM_OK) {
        snprintf(why, whylen, "out of memory");
        return false;
    }
    struct curl_slist *hdr = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(h, CURLOPT_URL, t->url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdr);
    curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(h, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(t->timeout * 1000));
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS,
                     (long)(t->timeout * 500) > 0 ? (long)(t->timeout * 500) : 1L);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, discard_body);
    CURLcode rc = curl_easy_perform(h);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_slist_free_all(hdr);
    free(body);
    if (rc != CURLE_OK) {
        snprintf(why, whylen, "%s", curl_easy_strerror(rc));
        return false;
    }
    if (status < 200 || status >= 300) {
        snprintf(why, whylen, "HTTP %ld", status);
        return false;
    }
    return true;
}

static void *exporter_main(void *arg)
{
    struct tdm_tracer *t = arg;
    CURL *h = curl_easy_init();
    for (;;) {
        pthread_mutex_lock(&t->mu);
        double until = tdm_now() + t->flush_interval;
        while (!t->stopping && t->count < t->batch && tdm_now() < until)
            tdm_cond_wait_for(&t->cv, &t->mu, until - tdm_now());
        int n = t->count < t->batch ? t->count : t->batch;
        for (int i = 0; i < n; i++)
            t->out[i] = t->ring[(t->head + i) % t->cap];
        t->head = (t->head + n) % t->cap;
        t->count -= n;
        bool stop = t->stopping && t->count == 0;
        bool stopping_now = t->stopping;
        pthread_mutex_unlock(&t->mu);
        if (n > 0) {
            char why[256] = "";
            bool ok = h != NULL && post_batch(t, h, t->out, n, why, sizeof why);
            if (h == NULL)
                snprintf(why, sizeof why, "curl_easy_init failed");
            if (ok) {
                atomic_fetch_add(&t->exported, (uint64_t)n);
                tdm_metrics_counter_add(t->m_exported, (double)n);
            } else {
                count_dropped(t, (uint64_t)n);
                t->failed_since_warn += (uint64_t)n;
                double now = tdm_now();
                if (t->last_warn == 0 || now - t->last_warn > 30) {
                    TDM_LOG_WARN(MOD, "OTLP export to %s failed (%s): %llu spans dropped", t->url,
                                 why, (unsigned long long)t->failed_since_warn);
                    t->last_warn = now;
                    t->failed_since_warn = 0;
                }
                if (stopping_now) {
                    // Shutting down and the collector fails: drop the rest now
                    // rather than wait a timeout per batch.
                    pthread_mutex_lock(&t->mu);
                    uint64_t rest = (uint64_t)t->count;
                    t->head = (t->head + t->count) % t->cap;
                    t->count = 0;
                    pthread_mutex_unlock(&t->mu);
                    count_dropped(t, rest);
                    stop = true;
                }
            }
        }
        if (stop)
            break;
    }
    if (h)
        curl_easy_cleanup(h);
    return NULL;
}

int tdm_trace_check_endpoint(const char *url, char *err, size_t errlen)
{
    const char *ep = url ? url : "";
    size_t skip = strncmp(ep, "http://", 7) == 0 ? 7 : strncmp(ep, "https://", 8) == 0 ? 8 : 0;
    if (skip == 0 || ep[skip] == '\0' || ep[skip] == '/')
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--otlp-traces-endpoint: expected an http:// or https:// URL, got "
                          "\"%.200s\"",
                          ep);
    if (strlen(ep) > 1000)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--otlp-traces-endpoint: URL too long");
    return TDM_OK;
}

int tdm_tracer_new(struct tdm_tracer **out, const struct tdm_tracer_config *cfg,
                   struct tdm_metrics_registry *reg, char *err, size_t errlen)
{
    *out = NULL;
    const char *ep = cfg->endpoint ? cfg->endpoint : "";
    int crc = tdm_trace_check_endpoint(ep, err, errlen);
    if (crc != TDM_OK)
        return crc;
    size_t el = strlen(ep);
    while (el > 0 && ep[el - 1] == '/')
        el--;
    static const char suffix[] = "/v1/traces";
    size_t sl = sizeof suffix - 1;
    bool has_suffix = el >= sl && memcmp(ep + el - sl, suffix, sl) == 0;
    if (el + sl + 1 > sizeof((struct tdm_tracer *)0)->url)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--otlp-traces-endpoint: URL too long");
    pthread_once(&g_curl_once, curl_init_once);
    if (g_curl_rc != CURLE_OK)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "curl_global_init failed");
    struct tdm_tracer *t = calloc(1, sizeof *t);
    if (t == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    snprintf(t->url, sizeof t->url, "%.*s%s", (int)el, ep, has_suffix ? "" : suffix);
    snprintf(t->service_name, sizeof t->service_name, "%s",
             cfg->service_name ? cfg->service_name : "tandem");
    t->cap = cfg->queue_spans > 0 ? cfg->queue_spans : 2048;
    t->batch = cfg->batch_spans > 0 ? cfg->batch_spans : 128;
    if (t->batch > t->cap)
        t->batch = t->cap;
    t->flush_interval = cfg->flush_interval > 0 ? cfg->flush_interval : 1.0;
    t->timeout = cfg->timeout > 0 ? cfg->timeout : 1.0;
    int rc = TDM_OK;
    if (reg) {
        struct tdm_metrics_opts o = {
            .name = "tandem:otlp_spans_dropped_total",
            .help = "Trace spans dropped: the export queue was full or the OTLP collector did "
                    "not take them."};
        rc = tdm_metrics_counter_register(&t->m_dropped, reg, &o, err, errlen);
        o.name = "tandem:otlp_spans_exported_total";
        o.help = "Trace spans the OTLP collector accepted.";
        if (rc == TDM_OK)
            rc = tdm_metrics_counter_register(&t->m_exported, reg, &o, err, errlen);
        if (rc != TDM_OK) {
            free(t);
            return rc;
        }
    }
    t->ring = calloc((size_t)t->cap, sizeof *t->ring);
    t->out = calloc((size_t)t->batch, sizeof *t->out);
    if (t->ring == NULL || t->out == NULL) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory for %d spans", t->cap);
        goto fail_alloc;
    }
    pthread_mutex_init(&t->mu, NULL);
    tdm_cond_init(&t->cv);
    if (pthread_create(&t->thread, NULL, exporter_main, t) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "cannot start the OTLP exporter thread");
        goto fail_thread;
    }
    t->started = true;
    TDM_LOG_INFO(MOD, "exporting spans to %s service.name=%s queue=%d batch=%d", t->url,
                 t->service_name, t->cap, t->batch);
    *out = t;
    return TDM_OK;
fail_thread:
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
fail_alloc:
    free(t->ring);
    free(t->out);
    free(t);
    return rc;
}

void tdm_tracer_emit(struct tdm_tracer *t, const struct tdm_span *sp)
{
    if (t == NULL || sp == NULL || !sp->recording)
        return;
    pthread_mutex_lock(&t->mu);
    if (t->count >= t->cap || t->stopping) {
        pthread_mutex_unlock(&t->mu);
        count_dropped(t, 1);
        return;
    }
    t->ring[(t->head + t->count) % t->cap] = *sp;
    t->count++;
    if (t->count == t->batch)
        pthread_cond_signal(&t->cv);
    pthread_mutex_unlock(&t->mu);
}

void tdm_tracer_free(struct tdm_tracer *t)
{
    if (t == NULL)
        return;
    if (t->started) {
        pthread_mutex_lock(&t->mu);
        t->stopping = true;
        pthread_cond_signal(&t->cv);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->thread, NULL);
    }
    pthread_cond_destroy(&t->cv);
    pthread_mutex_destroy(&t->mu);
    free(t->ring);
    free(t->out);
    free(t);
}

uint64_t tdm_tracer_dropped(const struct tdm_tracer *t)
{
    return t ? atomic_load(&((struct tdm_tracer *)t)->dropped) : 0;
}

uint64_t tdm_tracer_exported(const struct tdm_tracer *t)
{
    return t ? atomic_load(&((struct tdm_tracer *)t)->exported) : 0;
}

const char *tdm_tracer_endpoint_from_env(const char *flag)
{
    if (flag && flag[0])
        return flag;
    const char *e = getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    return e && e[0] ? e : NULL;
}

const char *tdm_tracer_service_name(const char *fallback)
{
    const char *e = getenv("OTEL_SERVICE_NAME");
    return e && e[0] ? e : fallback;
}

// ---- engine phases -------------------------------------------------------------------------
static void emit_phase(struct tdm_tracer *t, const struct tdm_span *parent, const char *name,
                       double a, double b)
{
    if (a <= 0 || b <= 0 || b < a)
        return;
    struct tdm_span sp;
    tdm_span_begin_child(&sp, parent, name, TDM_SPAN_INTERNAL, a);
    sp.end = b;
    tdm_tracer_emit(t, &sp);
}

void tdm_tracer_emit_phases(struct tdm_tracer *t, struct tdm_span *parent,
                            const struct tdm_trace_phases *p)
{
    if (t == NULL || !parent->recording)
        return;
    emit_phase(t, parent, "queue", p->arrival, p->scheduled);
    if (p->arrival > 0 && p->scheduled >= p->arrival)
        tdm_span_attr_double(parent, "gen_ai.latency.time_in_queue", p->scheduled - p->arrival);
    if (p->prefill_name) {
        emit_phase(t, parent, p->prefill_name, p->scheduled, p->first_token);
        if (p->scheduled > 0 && p->first_token >= p->scheduled)
            tdm_span_attr_double(parent, "gen_ai.latency.time_in_model_prefill",
                                 p->first_token - p->scheduled);
    }
    emit_phase(t, parent, "decode", p->first_token, p->last_token);
    if (p->first_token > 0 && p->last_token >= p->first_token)
        tdm_span_attr_double(parent, "gen_ai.latency.time_in_model_decode",
                             p->last_token - p->first_token);
    if (p->first_token > 0)
        tdm_span_event(parent, "first_token", p->first_token);
}
