// SPDX-License-Identifier: Apache-2.0
// Tests of the http module against a real server on 127.0.0.1 (ephemeral port),
// driven by raw sockets so every byte on the wire is checked: status lines,
// headers, Content-Length, OpenAI error bodies (404, 405, 413, 401, 500), SSE
// framing over chunked encoding and keep-alive after a stream, HTTP/1.0
// streams, chunked request bodies, the API key, and client-disconnect detection.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "core.h"
#include "http.h"
#include "openai.h"

// ---- raw client ------------------------------------------------------------------------------
static int connect_to(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static void send_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = send(fd, buf, len, MSG_NOSIGNAL);
        assert_true(n > 0);
        buf += n;
        len -= (size_t)n;
    }
}

// Reads one response: up to the end of its Content-Length body when it has
// one (civetweb may keep the connection open, e.g. draining a refused body),
// else until the peer closes. Heap, NUL-terminated.
static char *read_response(int fd, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        buf[n] = '\0';
        const char *end = strstr(buf, "\r\n\r\n");
        const char *cl = end ? strcasestr(buf, "\r\nContent-Length:") : NULL;
        if (end && cl && cl < end) {
            size_t want = (size_t)(end + 4 - buf) + strtoul(cl + 17, NULL, 10);
            if (n >= want)
                break;
        }
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

// Reads until the peer closes. Heap, NUL-terminated.
static char *read_to_eof(int fd, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (n + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t r = recv(fd, buf + n, cap - 1 - n, 0);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    if (len)
        *len = n;
    return buf;
}

static char *roundtrip(int port, const char *req)
{
    int fd = connect_to(port);
    send_all(fd, req, strlen(req));
    char *resp = read_response(fd, NULL);
    close(fd);
    return resp;
}

static int status_of(const char *resp)
{
    int st = 0;
    assert_int_equal(sscanf(resp, "HTTP/1.%*d %d", &st), 1);
    return st;
}

// Value of header name in resp (copied into out), or NULL when absent.
static const char *header_of(const char *resp, const char *name, char *out, size_t cap)
{
    const char *end = strstr(resp, "\r\n\r\n");
    size_t nl = strlen(name);
    for (const char *line = strstr(resp, "\r\n"); line && line < end;
         line = strstr(line + 2, "\r\n")) {
        const char *h = line + 2;
        if (strncasecmp(h, name, nl) == 0 && h[nl] == ':') {
            const char *v = h + nl + 1;
            while (*v == ' ')
                v++;
            size_t vl = (size_t)(strstr(v, "\r\n") - v);
            if (vl >= cap)
                vl = cap - 1;
            memcpy(out, v, vl);
            out[vl] = '\0';
            return out;
        }
    }
    return NULL;
}

static const char *body_of(const char *resp)
{
    const char *b = strstr(resp, "\r\n\r\n");
    if (!b)
        fail_msg("no end of headers in: %.200s", resp);
    return b ? b + 4 : "";
}

// Decodes a chunked body starting at p into out; returns the bytes after the last chunk.
static const char *dechunk(const char *p, char *out, size_t cap)
{
    size_t o = 0;
    for (;;) {
        char *end;
        unsigned long n = strtoul(p, &end, 16);
        assert_true(end != p);
        assert_memory_equal(end, "\r\n", 2);
        p = end + 2;
        if (n == 0) {
            assert_memory_equal(p, "\r\n", 2);
            out[o] = '\0';
            return p + 2;
        }
        assert_true(o + n < cap);
        memcpy(out + o, p, n);
        o += n;
        p += n;
        assert_memory_equal(p, "\r\n", 2);
        p += 2;
    }
}

static void assert_oai_error(const char *resp, int status, const char *type)
{
    assert_int_equal(status_of(resp), status);
    char ct[64];
    assert_non_null(header_of(resp, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, "application/json");
    char cl[32];
    assert_non_null(header_of(resp, "Content-Length", cl, sizeof cl));
    assert_int_equal(strtoul(cl, NULL, 10), strlen(body_of(resp)));
    cJSON *j = cJSON_Parse(body_of(resp));
    assert_non_null(j);
    const cJSON *e = cJSON_GetObjectItem(j, "error");
    assert_non_null(e);
    assert_string_equal(cJSON_GetObjectItem(e, "type")->valuestring, type);
    assert_int_equal(cJSON_GetObjectItem(e, "code")->valueint, status);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(e, "message")));
    assert_non_null(cJSON_GetObjectItem(e, "param"));
    cJSON_Delete(j);
}

// ---- handlers ---------------------------------------------------------------------------------
struct gone_probe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool finished;
    bool gone;
    int events;
};

static void h_health(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_http_respond(c, 200, "text/plain; charset=utf-8", "ok", 2);
}

static void h_busy(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_http_respond_errorf(c, 503, NULL, "queue full (%d waiting)", 7);
}

static void h_owned(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    const char *q = tdm_http_query(c);
    tdm_http_respond_json_owned(c, 200, q && strcmp(q, "null") == 0 ? NULL : strdup("{\"a\":1}"));
}

static void h_metrics(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    const char *m = "# TYPE x counter\nx_total 1\n";
    tdm_http_respond(c, 200, "text/plain; version=0.0.4; charset=utf-8", m, strlen(m));
}

static void h_echo(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    size_t len;
    const char *body = tdm_http_body(c, &len);
    tdm_http_add_header(c, "X-Request-Id", "r-1");
    const char *h = tdm_http_header(c, "x-test");
    tdm_http_add_header(c, "X-Echo-Test", h ? h : "none");
    tdm_http_respond(c, 200, "application/json", body, len);
}

static void h_sse(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    // No cmocka asserts here (another thread): a failed write shows up as
    // missing bytes on the client side.
    if (tdm_http_sse_start(c) != TDM_OK)
        return;
    for (int i = 0; i < 3; i++) {
        char ev[64];
        int n = snprintf(ev, sizeof ev, "{\"i\":%d}", i);
        if (tdm_http_sse_event(c, ev, (size_t)n) != TDM_OK)
            return;
    }
    if (tdm_http_sse_comment(c, "keep-alive") == TDM_OK)
        tdm_http_sse_end(c, true);
}

static void h_slow_sse(struct tdm_http_conn *c, void *arg)
{
    struct gone_probe *p = arg;
    tdm_http_sse_start(c);
    int events = 0;
    double t0 = tdm_now();
    while (tdm_now() - t0 < 5.0) {
        char ev[4096];
        memset(ev, 'x', sizeof ev);
        if (tdm_http_sse_event(c, ev, sizeof ev) != TDM_OK)
            break;
        events++;
        struct timespec ts = {0, 2000000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&p->mu);
    p->gone = tdm_http_client_gone(c);
    p->events = events;
    p->finished = true;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    tdm_http_sse_end(c, true);
}

static void h_noresp(struct tdm_http_conn *c, void *arg)
{
    (void)c;
    (void)arg;
}

static void h_prefix(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    char out[256];
    int n = snprintf(out, sizeof out, "%s?%s", tdm_http_path(c),
                     tdm_http_query(c) ? tdm_http_query(c) : "");
    tdm_http_respond(c, 200, NULL, out, (size_t)n);
}

// A miniature completions endpoint over both modules: parse, then either an
// OpenAI error or a stream of chunks built by the openai builders.
static void h_completions(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    static const struct tdm_oai_model_info info = {
        .served_name = "qwen", .vocab_size = 100, .max_model_len = 64};
    size_t len;
    const char *body = tdm_http_body(c, &len);
    struct tdm_oai_request req;
    struct tdm_oai_error e;
    if (tdm_oai_request_parse(&req, TDM_OAI_COMPLETION, body, len, &info, &e) != TDM_OK) {
        tdm_http_respond_oai_error(c, &e);
        return;
    }
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", req.request_id);
    static const char *const words[] = {" Paris", " is", " nice", "."};
    if (!req.stream) {
        struct tdm_oai_choice ch = {
            .text = " Paris", .text_len = 6, .finish = TDM_OAI_FINISH_LENGTH, .stop_token = -1};
        struct tdm_oai_usage u = {3, 1};
        char *json = tdm_oai_body(&r, &ch, 1, &u);
        tdm_http_respond_json(c, 200, json);
        free(json);
        tdm_oai_request_fini(&req);
        return;
    }
    tdm_http_sse_start(c);
    for (int i = 0; i < 4; i++) {
        struct tdm_oai_choice ch = {.text = words[i],
                                    .text_len = strlen(words[i]),
                                    .finish = i == 3 ? TDM_OAI_FINISH_STOP : TDM_OAI_FINISH_NONE,
                                    .stop_token = -1};
        char *json = tdm_oai_chunk(&r, &ch, 1, NULL);
        tdm_http_sse_event(c, json, strlen(json));
        free(json);
    }
    if (req.include_usage) {
        struct tdm_oai_usage u = {3, 4};
        char *json = tdm_oai_usage_chunk(&r, &u);
        tdm_http_sse_event(c, json, strlen(json));
        free(json);
    }
    tdm_http_sse_end(c, true);
    tdm_oai_request_fini(&req);
}

struct fixture {
    struct tdm_http_server *srv;
    struct gone_probe probe;
    int port;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    pthread_mutex_init(&f->probe.mu, NULL);
    pthread_cond_init(&f->probe.cv, NULL);
    struct tdm_http_config cfg = {
        .host = "127.0.0.1", .port = 0, .num_threads = 8, .max_body_bytes = 1024};
    char err[256];
    if (tdm_http_server_new(&f->srv, &cfg, err, sizeof err) != TDM_OK)
        return -1;
    tdm_http_route(f->srv, "GET", "/health", h_health, NULL);
    tdm_http_route(f->srv, "GET", "/metrics", h_metrics, NULL);
    tdm_http_route(f->srv, "POST", "/echo", h_echo, NULL);
    tdm_http_route(f->srv, "PUT", "/echo", h_echo, NULL);
    tdm_http_route(f->srv, "GET", "/sse", h_sse, NULL);
    tdm_http_route(f->srv, "GET", "/slow-sse", h_slow_sse, &f->probe);
    tdm_http_route(f->srv, "GET", "/noresp", h_noresp, NULL);
    tdm_http_route(f->srv, "GET", "/busy", h_busy, NULL);
    tdm_http_route(f->srv, "GET", "/owned", h_owned, NULL);
    tdm_http_route(f->srv, "GET", "/files/*", h_prefix, NULL);
    tdm_http_route(f->srv, "POST", "/v1/completions", h_completions, NULL);
    if (tdm_http_server_port(f->srv) != 0)
        return -1;
    if (tdm_http_server_start(f->srv, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    f->port = tdm_http_server_port(f->srv);
    *state = f;
    return f->port > 0 ? 0 : -1;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    tdm_http_server_free(f->srv);
    pthread_mutex_destroy(&f->probe.mu);
    pthread_cond_destroy(&f->probe.cv);
    free(f);
    return 0;
}

// ---- tests ------------------------------------------------------------------------------------
static void test_plain_and_metrics(void **state)
{
    struct fixture *f = *state;
    char *r = roundtrip(f->port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    char v[128];
    assert_string_equal(header_of(r, "Content-Length", v, sizeof v), "2");
    assert_string_equal(body_of(r), "ok");
    free(r);
    r = roundtrip(f->port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(header_of(r, "Content-Type", v, sizeof v),
                        "text/plain; version=0.0.4; charset=utf-8");
    assert_string_equal(body_of(r), "# TYPE x counter\nx_total 1\n");
    free(r);
}

static void test_not_found_and_method(void **state)
{
    struct fixture *f = *state;
    char *r = roundtrip(f->port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 404, "NotFoundError");
    assert_non_null(strstr(body_of(r), "/nope"));
    free(r);
    r = roundtrip(f->port, "GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 405, "MethodNotAllowedError");
    char v[64];
    assert_string_equal(header_of(r, "Allow", v, sizeof v), "POST, PUT");
    free(r);
    r = roundtrip(f->port, "GET /noresp HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 500, "InternalServerError");
    free(r);
    // Every 503 error carries Retry-After; errorf formats the message.
    r = roundtrip(f->port, "GET /busy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 503);
    char hv[32];
    assert_non_null(header_of(r, "Retry-After", hv, sizeof hv));
    assert_string_equal(hv, "1");
    assert_non_null(strstr(body_of(r), "queue full (7 waiting)"));
    free(r);
    r = roundtrip(f->port, "GET /owned HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "{\"a\":1}");
    assert_null(header_of(r, "Retry-After", hv, sizeof hv));
    free(r);
    r = roundtrip(f->port, "GET /owned?null HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 500, "InternalServerError");
    free(r);
    r = roundtrip(f->port,
                  "GET /files/a/b.txt?x=1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "/files/a/b.txt?x=1");
    free(r);
}

static void test_body_and_limit(void **state)
{
    struct fixture *f = *state;
    char *r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nX-Test: yes\r\nContent-Length: "
                                 "11\r\nConnection: close\r\n\r\n{\"a\":[1,2]}");
    assert_int_equal(status_of(r), 200);
    char v[64];
    assert_string_equal(header_of(r, "X-Request-Id", v, sizeof v), "r-1");
    assert_string_equal(header_of(r, "X-Echo-Test", v, sizeof v), "yes");
    assert_string_equal(body_of(r), "{\"a\":[1,2]}");
    free(r);

    // Declared over the limit: refused before reading.
    r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nConnection: "
                           "close\r\n\r\n");
    assert_oai_error(r, 413, "RequestTooLargeError");
    assert_non_null(strstr(body_of(r), "1024 bytes"));
    free(r);

    // Chunked request bodies: under and over the limit.
    r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           "Connection: close\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "{\"a\":1}");
    free(r);
    char big[4096];
    int n = snprintf(big, sizeof big,
                     "PUT /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nConnection: "
                     "close\r\n\r\n");
    for (int i = 0; i < 3; i++) {
        n += snprintf(big + n, sizeof big - (size_t)n, "200\r\n");
        memset(big + n, 'a', 512);
        n += 512;
        n += snprintf(big + n, sizeof big - (size_t)n, "\r\n");
    }
    snprintf(big + n, sizeof big - (size_t)n, "0\r\n\r\n");
    r = roundtrip(f->port, big);
    assert_oai_error(r, 413, "RequestTooLargeError");
    free(r);

    // No body at all on a POST.
    r = roundtrip(
        f->port,
        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "");
    free(r);
}

static void test_sse_framing_and_keep_alive(void **state)
{
    struct fixture *f = *state;
    int fd = connect_to(f->port);
    const char *req = "GET /sse HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: "
                      "x\r\nConnection: close\r\n\r\n";
    send_all(fd, req, strlen(req));
    char *r = read_to_eof(fd, NULL);
    close(fd);
    assert_int_equal(status_of(r), 200);
    char v[128];
    assert_string_equal(header_of(r, "Content-Type", v, sizeof v),
                        "text/event-stream; charset=utf-8");
    assert_string_equal(header_of(r, "Transfer-Encoding", v, sizeof v), "chunked");
    assert_string_equal(header_of(r, "Cache-Control", v, sizeof v), "no-cache");
    assert_null(header_of(r, "Content-Length", v, sizeof v));
    char events[1024];
    const char *rest = dechunk(body_of(r), events, sizeof events);
    assert_string_equal(events, "data: {\"i\":0}\n\ndata: {\"i\":1}\n\ndata: {\"i\":2}\n\n"
                                ": keep-alive\n\ndata: [DONE]\n\n");
    // The same connection serves the next request after the stream.
    assert_int_equal(status_of(rest), 200);
    assert_string_equal(body_of(rest), "ok");
    free(r);

    // HTTP/1.0: no chunked framing, the stream ends when the connection closes.
    r = roundtrip(f->port, "GET /sse HTTP/1.0\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_null(header_of(r, "Transfer-Encoding", v, sizeof v));
    assert_string_equal(body_of(r), "data: {\"i\":0}\n\ndata: {\"i\":1}\n\ndata: {\"i\":2}\n\n"
                                    ": keep-alive\n\ndata: [DONE]\n\n");
    free(r);
}

static void test_client_disconnect_detected(void **state)
{
    struct fixture *f = *state;
    int fd = connect_to(f->port);
    const char *req = "GET /slow-sse HTTP/1.1\r\nHost: x\r\n\r\n";
    send_all(fd, req, strlen(req));
    // Read the stream for a while (so it really flows), then hang up.
    char buf[8192];
    size_t total = 0;
    double t_read = tdm_now();
    while (tdm_now() - t_read < 0.1) {
        ssize_t got = recv(fd, buf, sizeof buf, 0);
        if (got <= 0)
            break;
        total += (size_t)got;
    }
    assert_true(total > 3 * 4096);
    close(fd);
    double t0 = tdm_now();
    pthread_mutex_lock(&f->probe.mu);
    while (!f->probe.finished) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 6;
        if (pthread_cond_timedwait(&f->probe.cv, &f->probe.mu, &ts) != 0)
            break;
    }
    bool finished = f->probe.finished, gone = f->probe.gone;
    int events = f->probe.events;
    pthread_mutex_unlock(&f->probe.mu);
    assert_true(finished);
    assert_true(gone);
    assert_true(events >= 3);
    assert_true(tdm_now() - t0 < 4.0); // detected, not the 5 s handler timeout
    print_message("disconnect detected after %d events, %.0f ms\n", events, (tdm_now() - t0) * 1e3);
}

static void test_api_key(void **state)
{
    (void)state;
    struct tdm_http_server *s;
    struct tdm_http_config cfg = {.host = "127.0.0.1", .api_key = "sekret", .num_threads = 2};
    char err[256];
    assert_int_equal(tdm_http_server_new(&s, &cfg, err, sizeof err), TDM_OK);
    tdm_http_route(s, "GET", "/health", h_health, NULL);
    tdm_http_route(s, "GET", "/v1/models", h_health, NULL);
    assert_int_equal(tdm_http_server_start(s, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(s);
    char *r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 401, "AuthenticationError");
    char v[64];
    assert_string_equal(header_of(r, "WWW-Authenticate", v, sizeof v), "Bearer");
    free(r);
    r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekreT\r\n"
                        "Connection: close\r\n\r\n");
    assert_oai_error(r, 401, "AuthenticationError");
    free(r);
    r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekre\r\n"
                        "Connection: close\r\n\r\n");
    assert_oai_error(r, 401, "AuthenticationError");
    free(r);
    r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Basic sekret\r\n"
                        "Connection: close\r\n\r\n");
    assert_oai_error(r, 401, "AuthenticationError");
    free(r);
    r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: bearer sekret\r\n"
                        "Connection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    free(r);
    // Unknown paths are behind the key too (no path probing without it).
    r = roundtrip(port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 401);
    free(r);
    r = roundtrip(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    free(r);
    tdm_http_server_free(s);
}

static void test_lifecycle_and_errors(void **state)
{
    struct fixture *f = *state;
    struct tdm_http_server *s;
    char err[256];
    struct tdm_http_config bad = {.port = 70000};
    assert_int_equal(tdm_http_server_new(&s, &bad, err, sizeof err), TDM_EINVAL);
    assert_null(s);
    // The fixture's port is taken: binding it again fails cleanly.
    struct tdm_http_config dup = {.host = "127.0.0.1", .port = f->port, .num_threads = 1};
    assert_int_equal(tdm_http_server_new(&s, &dup, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_server_start(s, err, sizeof err), TDM_ETRANSPORT);
    assert_non_null(strstr(err, "cannot listen"));
    tdm_http_server_free(s);
    // Routes only before start; stop twice is fine.
    assert_int_equal(tdm_http_route(f->srv, "GET", "/late", h_health, NULL), TDM_EBUSY);
    assert_int_equal(tdm_http_route(NULL, "GET", "/x", h_health, NULL), TDM_EINVAL);
    struct tdm_http_config ok = {.host = "127.0.0.1", .num_threads = 1};
    assert_int_equal(tdm_http_server_new(&s, &ok, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(s, "GET", "relative", h_health, NULL), TDM_EINVAL);
    assert_int_equal(tdm_http_server_start(s, err, sizeof err), TDM_OK);
    tdm_http_server_stop(s);
    tdm_http_server_stop(s);
    assert_int_equal(tdm_http_server_port(s), 0);
    tdm_http_server_free(s);
    tdm_http_server_free(NULL);
}

static char *post(int port, const char *path, const char *json)
{
    char req[1024];
    snprintf(req, sizeof req,
             "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
             "%zu\r\nConnection: close\r\n\r\n%s",
             path, strlen(json), json);
    return roundtrip(port, req);
}

static void test_openai_over_http(void **state)
{
    struct fixture *f = *state;
    // Validation errors reach the client as vLLM's error bodies.
    char *r = post(f->port, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":5}");
    assert_oai_error(r, 400, "BadRequestError");
    cJSON *j = cJSON_Parse(body_of(r));
    const cJSON *err = cJSON_GetObjectItem(j, "error");
    assert_string_equal(cJSON_GetObjectItem(err, "message")->valuestring,
                        "temperature must be in [0, 2], got 5.0.");
    assert_string_equal(cJSON_GetObjectItem(err, "param")->valuestring, "temperature");
    cJSON_Delete(j);
    free(r);
    r = post(f->port, "/v1/completions", "{\"model\":\"gpt-4\",\"prompt\":\"x\"}");
    assert_oai_error(r, 404, "NotFoundError");
    free(r);

    r = post(f->port, "/v1/completions", "{\"prompt\":\"x\",\"request_id\":\"abc\"}");
    assert_int_equal(status_of(r), 200);
    j = cJSON_Parse(body_of(r));
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-abc");
    cJSON_Delete(j);
    free(r);

    // A stream: every event is one JSON chunk, same id throughout, then usage, then [DONE].
    r = post(f->port, "/v1/completions",
             "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    assert_int_equal(status_of(r), 200);
    char events[8192];
    dechunk(body_of(r), events, sizeof events);
    char text[64] = "", id[96] = "";
    int n_events = 0;
    bool done = false, usage = false;
    for (char *ev = events; *ev;) {
        assert_memory_equal(ev, "data: ", 6);
        char *end = strstr(ev, "\n\n");
        assert_non_null(end);
        *end = '\0';
        const char *data = ev + 6;
        if (strcmp(data, "[DONE]") == 0) {
            done = true;
            assert_string_equal(end + 2, "");
        } else {
            assert_false(done);
            cJSON *c = cJSON_Parse(data);
            assert_non_null(c);
            const char *cid = cJSON_GetObjectItem(c, "id")->valuestring;
            if (!id[0])
                snprintf(id, sizeof id, "%s", cid);
            assert_string_equal(cid, id);
            const cJSON *choices = cJSON_GetObjectItem(c, "choices");
            if (cJSON_GetArraySize(choices) == 0) {
                usage = true;
                assert_int_equal(
                    cJSON_GetObjectItem(cJSON_GetObjectItem(c, "usage"), "total_tokens")->valueint,
                    7);
            } else {
                strcat(text,
                       cJSON_GetObjectItem(cJSON_GetArrayItem(choices, 0), "text")->valuestring);
            }
            cJSON_Delete(c);
            n_events++;
        }
        ev = end + 2;
    }
    assert_true(done && usage);
    assert_int_equal(n_events, 5);
    assert_string_equal(text, " Paris is nice.");
    free(r);
}

static void test_status_mapping(void **state)
{
    (void)state;
    assert_int_equal(tdm_http_status_for_err(TDM_OK), 200);
    assert_int_equal(tdm_http_status_for_err(TDM_EINVAL), 400);
    assert_int_equal(tdm_http_status_for_err(TDM_ENOTFOUND), 404);
    assert_int_equal(tdm_http_status_for_err(TDM_EBUSY), 429);
    assert_int_equal(tdm_http_status_for_err(TDM_ECAPACITY), 503);
    assert_int_equal(tdm_http_status_for_err(TDM_ECLOSED), 503);
    assert_int_equal(tdm_http_status_for_err(TDM_ETIMEDOUT), 504);
    assert_int_equal(tdm_http_status_for_err(TDM_EPROTO), 502);
    assert_int_equal(tdm_http_status_for_err(TDM_ETRANSPORT), 502);
    assert_int_equal(tdm_http_status_for_err(TDM_ENOMEM), 500);
    assert_int_equal(tdm_http_status_for_err(TDM_EBACKEND), 500);
    assert_int_equal(tdm_http_status_for_err(TDM_EIO), 500);
    assert_int_equal(tdm_http_status_for_err(999), 500);
    assert_string_equal(tdm_http_reason(413), "Payload Too Large");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_and_metrics),
        cmocka_unit_test(test_not_found_and_method),
        cmocka_unit_test(test_body_and_limit),
        cmocka_unit_test(test_sse_framing_and_keep_alive),
        cmocka_unit_test(test_client_disconnect_detected),
        cmocka_unit_test(test_api_key),
        cmocka_unit_test(test_lifecycle_and_errors),
        cmocka_unit_test(test_openai_over_http),
        cmocka_unit_test(test_status_mapping),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
