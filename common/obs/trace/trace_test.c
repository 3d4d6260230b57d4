// SPDX-License-Identifier: Apache-2.0
// trace_test: W3C traceparent parsing and writing (valid, every malformed
// shape the spec names, version ff, all-zero ids, future versions), span
// parentage and sampling, the OTLP JSON encoding (read back with cJSON), and
// the exporter: spans reach a one-shot HTTP receiver on loopback as one POST
// to /v1/traces, a dead collector drops and counts them without slowing emit,
// and a full queue drops and counts.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core.h"
#include "metrics.h"
#include "trace.h"

#define TP_OK "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

// ---- traceparent -----------------------------------------------------------------------------
static void test_parse_valid(void **state)
{
    (void)state;
    struct tdm_trace_ctx c;
    assert_int_equal(tdm_trace_parse(TP_OK, "congo=t61rcWkgMzE", &c), TDM_OK);
    char hex[33];
    tdm_trace_hex(c.trace_id, 16, hex);
    assert_string_equal(hex, "4bf92f3577b34da6a3ce929d0e0e4736");
    tdm_trace_hex(c.span_id, 8, hex);
    assert_string_equal(hex, "00f067aa0ba902b7");
    assert_true(c.sampled);
    assert_string_equal(c.tracestate, "congo=t61rcWkgMzE");
    char out[TDM_TRACEPARENT_LEN + 1];
    tdm_trace_format(&c, out);
    assert_string_equal(out, TP_OK);

    // Not sampled: flags 00; other flag bits are ignored.
    assert_int_equal(
        tdm_trace_parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", NULL, &c),
        TDM_OK);
    assert_false(c.sampled);
    tdm_trace_format(&c, out);
    assert_string_equal(out + 53, "00");
    assert_int_equal(
        tdm_trace_parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-09", NULL, &c),
        TDM_OK);
    assert_true(c.sampled);
    // HTTP optional whitespace around the value.
    assert_int_equal(tdm_trace_parse("  " TP_OK " ", NULL, &c), TDM_OK);
    // A later version: the version-00 layout, more fields after a '-'.
    assert_int_equal(tdm_trace_parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-"
                                     "what-the-future-will-be-like",
                                     NULL, &c),
                     TDM_OK);
    assert_true(c.sampled);
}

static void test_parse_malformed(void **state)
{
    (void)state;
    static const char *bad[] = {
        "",
        "00",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",     // no flags
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0",   // short flags
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-", // v00 trailing
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", // v00 trailing
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  // version ff
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  // zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  // zero parent id
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  // upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00F067AA0BA902B7-01",  // upper case
        "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",  // not hex
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  // separator
        "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",  // separator
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7_01",  // separator
        "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  // version not hex
        "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x", // future, no '-'
        "00-4bf92f3577b34da6a3ce929d0e0e47-3600f067aa0ba902b7-01",  // fields shifted
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        struct tdm_trace_ctx c;
        if (tdm_trace_parse(bad[i], "a=b", &c) != TDM_EINVAL)
            fail_msg("accepted \"%s\"", bad[i]);
        // Ignored: a new trace starts, and the tracestate goes with the header.
        assert_false(tdm_trace_ctx_from_headers(bad[i], "a=b", &c));
        uint8_t zero[16] = {0};
        assert_memory_not_equal(c.trace_id, zero, 16);
        assert_memory_equal(c.span_id, zero, 8);
        assert_true(c.sampled);
        assert_string_equal(c.tracestate, "");
    }
    struct tdm_trace_ctx c;
    assert_int_equal(tdm_trace_parse(NULL, NULL, &c), TDM_EINVAL);
    // Two new traces differ.
    struct tdm_trace_ctx a, b;
    tdm_trace_ctx_new(&a);
    tdm_trace_ctx_new(&b);
    assert_memory_not_equal(a.trace_id, b.trace_id, 16);
}

static void test_tracestate_limits(void **state)
{
    (void)state;
    char big[TDM_TRACESTATE_MAX + 10];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    struct tdm_trace_ctx c;
    assert_int_equal(tdm_trace_parse(TP_OK, big, &c), TDM_OK); // the traceparent counts
    assert_string_equal(c.tracestate, "");
    assert_int_equal(tdm_trace_parse(TP_OK, "a=b\nc=d", &c), TDM_OK);
    assert_string_equal(c.tracestate, "");
}

// ---- spans -----------------------------------------------------------------------------------
static void test_span_parentage(void **state)
{
    (void)state;
    struct tdm_tracer *fake = (struct tdm_tracer *)(uintptr_t)1; // only compared with NULL
    struct tdm_trace_ctx in;
    assert_int_equal(tdm_trace_parse(TP_OK, "k=v", &in), TDM_OK);
    struct tdm_span root, child;
    tdm_span_begin(&root, fake, &in, "llm_request", TDM_SPAN_SERVER, 1.0);
    assert_true(root.recording);
    assert_memory_equal(root.trace_id, in.trace_id, 16);
    assert_memory_equal(root.parent_id, in.span_id, 8);
    assert_memory_not_equal(root.span_id, in.span_id, 8);
    tdm_span_begin_child(&child, &root, "queue", TDM_SPAN_INTERNAL, 1.5);
    assert_memory_equal(child.trace_id, in.trace_id, 16);
    assert_memory_equal(child.parent_id, root.span_id, 8);
    assert_string_equal(child.tracestate, "k=v");
    struct tdm_trace_ctx out;
    tdm_span_ctx(&child, &out);
    char tp[TDM_TRACEPARENT_LEN + 1], sid[17], want[TDM_TRACEPARENT_LEN + 1];
    tdm_trace_format(&out, tp);
    tdm_trace_hex(child.span_id, 8, sid);
    snprintf(want, sizeof want, "00-4bf92f3577b34da6a3ce929d0e0e4736-%s-01", sid);
    assert_string_equal(tp, want);

    // No tracer, or a parent that is not sampled: nothing records, and the
    // propagated context keeps the sampled flag off.
    tdm_span_begin(&root, NULL, &in, "x", TDM_SPAN_SERVER, 1.0);
    assert_false(root.recording);
    in.sampled = false;
    tdm_span_begin(&root, fake, &in, "x", TDM_SPAN_SERVER, 1.0);
    assert_false(root.recording);
    tdm_span_attr_int(&root, "k", 1);
    assert_int_equal(root.n_attrs, 0);
}

// ---- OTLP JSON -------------------------------------------------------------------------------
static const cJSON *attr_value(const cJSON *attrs, const char *key)
{
    const cJSON *a;
    cJSON_ArrayForEach(a, attrs)
    {
        const cJSON *k = cJSON_GetObjectItem(a, "key");
        if (cJSON_IsString(k) && strcmp(k->valuestring, key) == 0)
            return cJSON_GetObjectItem(a, "value");
    }
    return NULL;
}

static void fill_spans(struct tdm_span sp[2])
{
    struct tdm_tracer *fake = (struct tdm_tracer *)(uintptr_t)1;
    struct tdm_trace_ctx in;
    assert_int_equal(tdm_trace_parse(TP_OK, NULL, &in), TDM_OK);
    memset(in.span_id, 0, 8); // make the first one a root
    tdm_span_begin(&sp[0], fake, &in, "llm_request", TDM_SPAN_SERVER, 100.0);
    tdm_span_attr_str(&sp[0], "gen_ai.request.id", "cmpl-\"1\"\\\n\xc3\xa9");
    tdm_span_attr_int(&sp[0], "gen_ai.usage.prompt_tokens", 1234567890123LL);
    tdm_span_attr_double(&sp[0], "gen_ai.latency.e2e", 0.25);
    tdm_span_event(&sp[0], "first_token", 100.125);
    sp[0].end = 100.25;
    tdm_span_begin_child(&sp[1], &sp[0], "queue", TDM_SPAN_INTERNAL, 100.0);
    sp[1].end = 100.001;
    tdm_span_error(&sp[1], "boom");
}

static void test_encode_otlp(void **state)
{
    (void)state;
    struct tdm_span sp[2];
    fill_spans(sp);
    char *body = NULL;
    size_t len = 0;
    // wall offset 1.7e9: tdm_now() 100 s is Unix 1700000100 s.
    assert_int_equal(tdm_trace_encode_otlp(sp, 2, "tandem-router", 1.7e9, &body, &len), TDM_OK);
    assert_int_equal(strlen(body), len);
    cJSON *j = cJSON_Parse(body);
    assert_non_null(j);
    const cJSON *rs = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "resourceSpans"), 0);
    assert_non_null(rs);
    const cJSON *svc = attr_value(
        cJSON_GetObjectItem(cJSON_GetObjectItem(rs, "resource"), "attributes"), "service.name");
    assert_string_equal(cJSON_GetObjectItem(svc, "stringValue")->valuestring, "tandem-router");
    const cJSON *ss = cJSON_GetArrayItem(cJSON_GetObjectItem(rs, "scopeSpans"), 0);
    assert_string_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(ss, "scope"), "name")->valuestring,
                        "tandem");
    const cJSON *spans = cJSON_GetObjectItem(ss, "spans");
    assert_int_equal(cJSON_GetArraySize(spans), 2);
    const cJSON *s0 = cJSON_GetArrayItem(spans, 0), *s1 = cJSON_GetArrayItem(spans, 1);
    assert_string_equal(cJSON_GetObjectItem(s0, "traceId")->valuestring,
                        "4bf92f3577b34da6a3ce929d0e0e4736");
    char sid[17];
    tdm_trace_hex(sp[0].span_id, 8, sid);
    assert_string_equal(cJSON_GetObjectItem(s0, "spanId")->valuestring, sid);
    assert_null(cJSON_GetObjectItem(s0, "parentSpanId")); // root
    assert_string_equal(cJSON_GetObjectItem(s1, "parentSpanId")->valuestring, sid);
    assert_string_equal(cJSON_GetObjectItem(s0, "name")->valuestring, "llm_request");
    assert_int_equal(cJSON_GetObjectItem(s0, "kind")->valueint, 2);
    assert_int_equal(cJSON_GetObjectItem(s1, "kind")->valueint, 1);
    // 64-bit nanoseconds as strings.
    assert_string_equal(cJSON_GetObjectItem(s0, "startTimeUnixNano")->valuestring,
                        "1700000100000000000");
    assert_string_equal(cJSON_GetObjectItem(s0, "endTimeUnixNano")->valuestring,
                        "1700000100250000000");
    const cJSON *attrs = cJSON_GetObjectItem(s0, "attributes");
    assert_string_equal(
        cJSON_GetObjectItem(attr_value(attrs, "gen_ai.request.id"), "stringValue")->valuestring,
        "cmpl-\"1\"\\\n??");
    assert_string_equal(
        cJSON_GetObjectItem(attr_value(attrs, "gen_ai.usage.prompt_tokens"), "intValue")
            ->valuestring,
        "1234567890123");
    assert_true(
        cJSON_GetObjectItem(attr_value(attrs, "gen_ai.latency.e2e"), "doubleValue")->valuedouble ==
        0.25);
    const cJSON *ev = cJSON_GetArrayItem(cJSON_GetObjectItem(s0, "events"), 0);
    assert_string_equal(cJSON_GetObjectItem(ev, "name")->valuestring, "first_token");
    assert_string_equal(cJSON_GetObjectItem(ev, "timeUnixNano")->valuestring,
                        "1700000100125000000");
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(s0, "status"), "code")->valueint, 0);
    const cJSON *st1 = cJSON_GetObjectItem(s1, "status");
    assert_int_equal(cJSON_GetObjectItem(st1, "code")->valueint, 2);
    assert_string_equal(cJSON_GetObjectItem(st1, "message")->valuestring, "boom");
    cJSON_Delete(j);
    free(body);
}

// ---- the exporter ----------------------------------------------------------------------------
// A one-shot HTTP receiver: accepts one connection, reads one request (headers
// and the Content-Length body), answers 200 and keeps what it read.
struct receiver {
    int fd, port;
    char req[1 << 16];
    size_t len;
};

static void *receiver_main(void *arg)
{
    struct receiver *r = arg;
    int c = accept(r->fd, NULL, NULL);
    if (c < 0)
        return NULL;
    for (;;) {
        ssize_t n = read(c, r->req + r->len, sizeof r->req - 1 - r->len);
        if (n <= 0)
            break;
        r->len += (size_t)n;
        r->req[r->len] = '\0';
        char *end = strstr(r->req, "\r\n\r\n");
        char *cl = strcasestr(r->req, "content-length:");
        if (end && cl && r->len >= (size_t)(end + 4 - r->req) + strtoul(cl + 15, NULL, 10))
            break;
    }
    const char ok[] = "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
                      "Connection: close\r\n\r\n{}";
    ssize_t w = write(c, ok, sizeof ok - 1);
    (void)w;
    close(c);
    return NULL;
}

static void receiver_start(struct receiver *r, pthread_t *th)
{
    memset(r, 0, sizeof *r);
    r->fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(r->fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(r->fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t al = sizeof a;
    getsockname(r->fd, (struct sockaddr *)&a, &al);
    r->port = ntohs(a.sin_port);
    assert_int_equal(listen(r->fd, 4), 0);
    assert_int_equal(pthread_create(th, NULL, receiver_main, r), 0);
}

static void test_export_to_receiver(void **state)
{
    (void)state;
    struct receiver r;
    pthread_t th;
    receiver_start(&r, &th);
    struct tdm_metrics_registry *reg = NULL;
    char err[256];
    assert_int_equal(tdm_metrics_registry_new(&reg, NULL, 0, err, sizeof err), TDM_OK);
    char ep[64];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d/", r.port); // trailing '/' tolerated
    struct tdm_tracer_config cfg = {
        .endpoint = ep, .service_name = "tandem-test", .flush_interval = 30};
    struct tdm_tracer *t = NULL;
    assert_int_equal(tdm_tracer_new(&t, &cfg, reg, err, sizeof err), TDM_OK);
    struct tdm_span sp[2];
    fill_spans(sp);
    sp[0].recording = sp[1].recording = true;
    // The span checks tracer != NULL only at begin; emit takes any recording span.
    tdm_tracer_emit(t, &sp[0]);
    tdm_tracer_emit(t, &sp[1]);
    tdm_tracer_free(t); // flushes: one POST with both, long before the 30 s interval
    pthread_join(th, NULL);
    close(r.fd);
    assert_non_null(strstr(r.req, "POST /v1/traces HTTP/1.1"));
    assert_non_null(strcasestr(r.req, "content-type: application/json"));
    char *body = strstr(r.req, "\r\n\r\n");
    assert_non_null(body);
    cJSON *j = cJSON_Parse(body + 4);
    assert_non_null(j);
    const cJSON *spans = cJSON_GetObjectItem(
        cJSON_GetArrayItem(
            cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "resourceSpans"), 0),
                                "scopeSpans"),
            0),
        "spans");
    assert_int_equal(cJSON_GetArraySize(spans), 2);
    cJSON_Delete(j);
    char *text = NULL;
    size_t tl = 0;
    assert_int_equal(tdm_metrics_render(reg, &text, &tl), TDM_OK);
    assert_non_null(strstr(text, "tandem:otlp_spans_exported_total 2"));
    assert_non_null(strstr(text, "tandem:otlp_spans_dropped_total 0"));
    free(text);
    tdm_metrics_registry_free(reg);
}

static void test_export_collector_down(void **state)
{
    (void)state;
    // A port nobody listens on: bind one, close it.
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t al = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &al);
    close(fd);
    char ep[64], err[256];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", ntohs(a.sin_port));
    struct tdm_tracer_config cfg = {.endpoint = ep,
                                    .queue_spans = 64,
                                    .batch_spans = 8,
                                    .flush_interval = 0.05,
                                    .timeout = 0.2};
    struct tdm_tracer *t = NULL;
    assert_int_equal(tdm_tracer_new(&t, &cfg, NULL, err, sizeof err), TDM_OK);
    struct tdm_span sp[2];
    fill_spans(sp);
    double t0 = tdm_now();
    for (int i = 0; i < 1000; i++)
        tdm_tracer_emit(t, &sp[i % 2]);
    double emit_s = tdm_now() - t0;
    // Every span is accounted for as dropped (queue full or POST refused), none
    // exported, and emitting never waited for the network.
    for (int i = 0; i < 250 && tdm_tracer_dropped(t) < 1000; i++)
        usleep(20000);
    assert_int_equal(tdm_tracer_dropped(t), 1000);
    assert_int_equal(tdm_tracer_exported(t), 0);
    assert_true(emit_s < 0.5);
    t0 = tdm_now();
    tdm_tracer_free(t);
    assert_true(tdm_now() - t0 < 1.0); // shutdown does not hang on a dead collector
}

// A collector that accepts connections and never answers: each POST gives up
// at the timeout, emit never waits, and shutdown is bounded by one timeout
// (the rest is dropped once a POST failed while stopping).
static void test_export_collector_hangs(void **state)
{
    (void)state;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t al = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &al);
    assert_int_equal(listen(fd, 16), 0); // the kernel completes handshakes; nobody reads
    char ep[64], err[256];
    snprintf(ep, sizeof ep, "http://127.0.0.1:%d", ntohs(a.sin_port));
    struct tdm_tracer_config cfg = {.endpoint = ep,
                                    .queue_spans = 64,
                                    .batch_spans = 8,
                                    .flush_interval = 0.05,
                                    .timeout = 0.3};
    struct tdm_tracer *t = NULL;
    assert_int_equal(tdm_tracer_new(&t, &cfg, NULL, err, sizeof err), TDM_OK);
    struct tdm_span sp[2];
    fill_spans(sp);
    double worst = 0;
    for (int i = 0; i < 2000; i++) {
        double t0 = tdm_now();
        tdm_tracer_emit(t, &sp[i % 2]);
        double dt = tdm_now() - t0;
        worst = dt > worst ? dt : worst;
        if (i % 100 == 0)
            usleep(10000); // 0.2 s in all: the exporter is inside a POST meanwhile
    }
    print_message("emit: worst %.1f us with the collector hanging\n", worst * 1e6);
    assert_true(worst < 0.05);
    assert_true(tdm_tracer_dropped(t) > 0);
    double t0 = tdm_now();
    tdm_tracer_free(t);
    double free_s = tdm_now() - t0;
    print_message("shutdown with the collector hanging: %.2f s\n", free_s);
    assert_true(free_s < 1.0); // at most the POST in flight and one more
    close(fd);
}

static void test_export_counts(void **state)
{
    (void)state;
    char err[256];
    struct tdm_tracer_config cfg = {.endpoint = "http://127.0.0.1:9",
                                    .queue_spans = 4,
                                    .batch_spans = 4,
                                    .flush_interval = 60,
                                    .timeout = 0.2};
    struct tdm_tracer *t = NULL;
    assert_int_equal(tdm_tracer_new(&t, &cfg, NULL, err, sizeof err), TDM_OK);
    struct tdm_span sp[2];
    fill_spans(sp);
    for (int i = 0; i < 100; i++)
        tdm_tracer_emit(t, &sp[0]);
    // Before free: the queue held at most 4 (+ a batch of 4 taken by the
    // exporter), so at least 92 were dropped at emit.
    uint64_t dropped_at_emit = tdm_tracer_dropped(t);
    assert_true(dropped_at_emit >= 92);
    // The exporter's own failures add up to the rest once it gave up.
    for (int i = 0; i < 100 && tdm_tracer_dropped(t) < 100; i++)
        usleep(20000);
    assert_int_equal(tdm_tracer_dropped(t), 100);
    assert_int_equal(tdm_tracer_exported(t), 0);
    tdm_tracer_free(t);

    // Bad endpoints are startup errors naming the flag.
    cfg.endpoint = "localhost:4318";
    assert_int_equal(tdm_tracer_new(&t, &cfg, NULL, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "--otlp-traces-endpoint"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_valid),           cmocka_unit_test(test_parse_malformed),
        cmocka_unit_test(test_tracestate_limits),     cmocka_unit_test(test_span_parentage),
        cmocka_unit_test(test_encode_otlp),           cmocka_unit_test(test_export_to_receiver),
        cmocka_unit_test(test_export_collector_down), cmocka_unit_test(test_export_collector_hangs),
        cmocka_unit_test(test_export_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
