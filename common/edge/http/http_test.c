// SPDX-License-Identifier: Apache-2.0
// Tests of the http module against a real server on 127.0.0.1 (ephemeral port),
// driven by raw sockets (http_test_client) so every byte on the wire is checked:
// status lines, headers, Content-Length, the server's own error bodies (404, 405,
// 413, 401, 500) through the error_body hook (the OpenAI one the roles install,
// and text/plain without a hook), SSE framing over chunked encoding and
// keep-alive after a stream, HTTP/1.0 streams, chunked request bodies, the API
// key, client-disconnect detection, and slow clients and odd request targets
// (header and body timeouts, OPTIONS *, absolute-form targets, a drained 413). The OpenAI routes over this server are
// tested in common/edge/openai/openai_http_test.c.

#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "core.h"
#include "http.h"
#include "small_stack.h"
#include "http_test_client.h"
#include "openai_http.h"

// ---- send() seen from the server's side ------------------------------------------------------
// civetweb writes with send(); this definition comes first in the lookup
// order, so its calls land here, are counted when they leave a socket bound to
// count_port (the server's accepted connections, never the test's clients),
// and go on to the next definition (libc, or a sanitizer's interceptor).
static _Atomic int count_port;
static _Atomic int server_sends;

ssize_t send(int fd, const void *buf, size_t len, int flags);
ssize_t send(int fd, const void *buf, size_t len, int flags)
{
    static ssize_t (*real)(int, const void *, size_t, int);
    if (real == NULL)
        *(void **)&real = dlsym(RTLD_NEXT, "send");
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    int port = atomic_load(&count_port);
    if (port && getsockname(fd, (struct sockaddr *)&a, &al) == 0 && a.sin_family == AF_INET &&
        ntohs(a.sin_port) == port)
        atomic_fetch_add(&server_sends, 1);
    return real(fd, buf, len, flags);
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

// The stack left to a handler on this civetweb (TDM_HTTP_HANDLER_STACK_BYTES).
static void h_stack(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    char out[64];
    int n = snprintf(out, sizeof out, "%zu", tdm_stack_room());
    tdm_http_respond(c, 200, NULL, out, (size_t)n);
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
struct fixture {
    struct tdm_http_server *srv;
    struct gone_probe probe;
    int port;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    pthread_mutex_init(&f->probe.mu, NULL);
    tdm_cond_init(&f->probe.cv);
    // The server's own errors get the OpenAI body every role installs.
    struct tdm_http_config cfg = {.host = "127.0.0.1",
                                  .port = 0,
                                  .num_threads = 8,
                                  .max_body_bytes = 1024,
                                  .error_body = tdm_oai_http_error_body};
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
    tdm_http_route(f->srv, "GET", "/stack", h_stack, NULL);
    tdm_http_route(f->srv, "GET", "/owned", h_owned, NULL);
    tdm_http_route(f->srv, "GET", "/files/*", h_prefix, NULL);
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

// Requests whose framing or identity is ambiguous (issue 29, part 5): each a
// 400 naming why, with Connection: close, and nothing after it answered
// (the smuggled second request inside a chunked body is never read).
static void test_ambiguous_requests(void **state)
{
    struct fixture *f = *state;
    static const struct {
        const char *req, *why;
    } cases[] = {
        {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: "
         "chunked\r\n\r\n2d\r\nGET /health HTTP/1.1\r\nHost: x\r\nX-Smuggled: 1\r\n\r\n\r\n0\r\n\r\n",
         "Transfer-Encoding may be sent once"},
        {"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
         NULL}, // civetweb refuses an unknown coding itself (its own 400 and close)
        {"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{\"a\":1234567}",
         "Content-Length must be a decimal number"},
        {"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nAuthorization: Bearer "
         "b\r\n\r\n",
         "Authorization may be sent once"},
        {"GET /health HTTP/1.1\r\n\r\n", "An HTTP/1.1 request must carry a Host header"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int fd = connect_to(f->port);
        send_all(fd, cases[i].req, strlen(cases[i].req));
        size_t len;
        char *r = read_response(fd, &len), v[64], more;
        // Then the server closes (EOF, not the client's receive timeout), so
        // no byte after the refused request is read as another.
        ssize_t eof = recv(fd, &more, 1, 0);
        close(fd);
        if (eof != 0) {
            print_error("case %zu: the connection stayed open after %s\n", i, r);
            fail();
        }
        if (status_of(r) != 400 || (cases[i].why && !strstr(r, cases[i].why)) ||
            strcmp(header_of(r, "Connection", v, sizeof v), "close") != 0 ||
            strstr(r, "\nHTTP/1.")) {
            print_error("case %zu: got %s\n", i, r);
            fail();
        }
        free(r);
    }
    // Still served: one Transfer-Encoding: chunked,
    // HTTP/1.0 without Host, a Content-Length with spaces around its digits.
    char *r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                                 "\r\nConnection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "hi");
    free(r);
    r = roundtrip(f->port, "GET /health HTTP/1.0\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    free(r);
    r = roundtrip(f->port,
                  "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length:  2 \r\nConnection: close\r\n\r\nok");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "ok");
    free(r);
}

// A handler has at least TDM_HTTP_HANDLER_STACK_BYTES of stack below it: the
// room the deep-stack tests and the fuzzers give each input (small_stack.h). A
// civetweb built with smaller worker stacks, or a library with a larger static
// TLS, fails here rather than in production.
static void test_handler_stack_room(void **state)
{
    struct fixture *f = *state;
    char *r = roundtrip(f->port, "GET /stack HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    size_t room = strtoull(body_of(r), NULL, 10);
    fprintf(stderr, "http_test: a handler has %zu bytes of stack (at least %u promised)\n", room,
            TDM_HTTP_HANDLER_STACK_BYTES);
    assert_true(room >= TDM_HTTP_HANDLER_STACK_BYTES);
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
    char hv[32];
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
    // A trailer section is read and dropped; a chunk extension is refused
    // with a message that names it (civetweb 1.15's chunk reader).
    r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           "Connection: close\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n"
                           "X-Checksum: 1\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "{\"a\":1}");
    free(r);
    r = roundtrip(f->port, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                           "Connection: close\r\n\r\n7;x=1\r\n{\"a\":1}\r\n0\r\n\r\n");
    assert_oai_error(r, 400, "BadRequestError");
    assert_non_null(strstr(body_of(r), "chunk extensions"));
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

// A response is one send (head and body together), an event stream's head
// one, each event one, the end one: civetweb's header calls wrote each header
// line with its own send (7 for /health: 7 TCP segments).
static void test_one_write_per_response(void **state)
{
    struct fixture *f = *state;
    atomic_store(&server_sends, 0);
    atomic_store(&count_port, f->port);
    char *r = roundtrip(f->port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    int plain = atomic_exchange(&server_sends, 0);
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "ok");
    char v[64];
    assert_string_equal(header_of(r, "Connection", v, sizeof v), "close");
    free(r);
    r = roundtrip(f->port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    int error = atomic_exchange(&server_sends, 0);
    assert_int_equal(status_of(r), 404);
    free(r);
    r = roundtrip(f->port, "GET /sse HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    int sse = atomic_exchange(&server_sends, 0);
    atomic_store(&count_port, 0);
    assert_int_equal(status_of(r), 200);
    free(r);
    assert_int_equal(plain, 1);
    assert_int_equal(error, 1);
    // Head, three events, a comment, [DONE], the last chunk.
    assert_int_equal(sse, 7);
}

// The Connection header tells what civetweb does after the response: HTTP/1.1
// keeps the connection unless the client said otherwise, 1.0 closes it unless
// the client asked for keep-alive (in any case, among other options).
static void test_connection_header(void **state)
{
    struct fixture *f = *state;
    static const struct {
        const char *req;
        const char *want;
    } cases[] = {
        {"GET /health HTTP/1.0\r\n\r\n", "close"},
        {"GET /health HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", "keep-alive"},
        {"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", "close"},
        {"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade,  keep-alive \r\n\r\n",
         "keep-alive"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        int fd = connect_to(f->port);
        send_all(fd, cases[i].req, strlen(cases[i].req));
        shutdown(fd, SHUT_WR);
        char *r = read_to_eof(fd, NULL);
        close(fd);
        char v[64];
        assert_int_equal(status_of(r), 200);
        assert_string_equal(header_of(r, "Connection", v, sizeof v), cases[i].want);
        free(r);
    }
    // Kept open: a second request on the same connection is answered.
    int fd = connect_to(f->port);
    const char *two = "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                      "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    send_all(fd, two, strlen(two));
    char *r = read_to_eof(fd, NULL);
    close(fd);
    char v[64];
    assert_string_equal(header_of(r, "Connection", v, sizeof v), "keep-alive");
    const char *second = strstr(r + 1, "HTTP/1.1 200");
    assert_non_null(second);
    assert_string_equal(body_of(second), "ok");
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
        if (!tdm_cond_wait_for(&f->probe.cv, &f->probe.mu, 6.0))
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
    struct tdm_http_config cfg = {.host = "127.0.0.1",
                                  .api_key = "sekret",
                                  .num_threads = 2,
                                  .error_body = tdm_oai_http_error_body};
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
    // The error says why and which option to change (issue 28, item 6).
    assert_non_null(strstr(err, "cannot listen"));
    assert_non_null(strstr(err, "Address already in use"));
    assert_non_null(strstr(err, "with --port"));
    tdm_http_server_free(s);
    dup.port_flag = "--metrics-port";
    assert_int_equal(tdm_http_server_new(&s, &dup, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_server_start(s, err, sizeof err), TDM_ETRANSPORT);
    assert_non_null(
        strstr(err, "Address already in use (choose another port with --metrics-port)"));
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

// Without an error_body hook the server's own errors are the message as text/plain.
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

// Slow clients and odd request targets (issue 11, parts 4 and 5), on a server
// of its own with short timeouts: headers not finished in 0.5 s -> civetweb's
// 400 and the connection closed; a body stalled past 1 s -> 408; "OPTIONS *"
// -> 204 with Allow; an absolute-form target -> served as its path on this
// port, 400 for another server (civetweb closed both in silence); an
// oversized body that the client sends anyway gets its 413 (read and dropped,
// not a reset).
static void test_slow_clients_and_targets(void **state)
{
    (void)state;
    struct tdm_http_config cfg = {.host = "127.0.0.1",
                                  .num_threads = 4,
                                  .max_body_bytes = 1024,
                                  .header_timeout_ms = 500,
                                  .body_timeout_ms = 1000,
                                  .error_body = tdm_oai_http_error_body};
    struct tdm_http_server *srv = NULL;
    char err[256];
    assert_int_equal(tdm_http_server_new(&srv, &cfg, err, sizeof err), TDM_OK);
    tdm_http_route(srv, "GET", "/health", h_health, NULL);
    tdm_http_route(srv, "POST", "/echo", h_echo, NULL);
    assert_int_equal(tdm_http_server_start(srv, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(srv);
    size_t len;

    int fd = connect_to(port);
    double t0 = now_s();
    send_all(fd, "POST /echo HTTP/1.1\r\n", 21);
    char *r = read_to_eof(fd, &len);
    double dt = now_s() - t0;
    // A head that stops coming is a 408 in the server's error format (civetweb
    // itself says 400 Malformed message: issue 29, part 5).
    assert_oai_error(r, 408, "BadRequestError");
    assert_non_null(strstr(r, "not received within 0.5 s"));
    assert_true(dt > 0.3 && dt < 3.0);
    free(r);
    close(fd);

    // A head over civetweb's 16 KiB (a long URL, a long header, 1 MB of
    // header): 431 at once, naming the limit; not a reset, not a 400.
    static char huge[(1 << 20) + 256];
    for (int k = 0; k < 3; k++) {
        size_t n = k == 2 ? (size_t)1 << 20 : 20000;
        int hl = k == 0 ? snprintf(huge, sizeof huge, "GET /")
                        : snprintf(huge, sizeof huge, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
        memset(huge + hl, 'a', n);
        snprintf(huge + hl + n, sizeof huge - hl - n, "%s",
                 k == 0 ? " HTTP/1.1\r\nHost: x\r\n\r\n" : "\r\n\r\n");
        fd = connect_to(port);
        t0 = now_s();
        // The server stops reading at its limit: the rest may not go through.
        for (size_t off = 0, left = strlen(huge); left > 0;) {
            ssize_t w = send(fd, huge + off, left, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w <= 0)
                break;
            off += (size_t)w;
            left -= (size_t)w;
        }
        r = read_to_eof(fd, &len);
        assert_oai_error(r, 431, "BadRequestError");
        assert_non_null(strstr(r, "over 16 KiB"));
        assert_true(now_s() - t0 < 0.4); // not the header timeout
        free(r);
        close(fd);
    }

    fd = connect_to(port);
    t0 = now_s();
    const char *stall = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc";
    send_all(fd, stall, strlen(stall));
    r = read_to_eof(fd, &len);
    dt = now_s() - t0;
    assert_oai_error(r, 408, "BadRequestError");
    assert_non_null(strstr(r, "not received within 1 s"));
    assert_true(dt > 0.8 && dt < 4.0);
    free(r);
    close(fd);

    r = roundtrip(port, "OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n");
    char v[64];
    assert_int_equal(status_of(r), 204);
    assert_string_equal(header_of(r, "Allow", v, sizeof v), "GET, POST");
    free(r);
    r = roundtrip(port, "GET http://elsewhere.example/health HTTP/1.1\r\nHost: x\r\n\r\n");
    assert_oai_error(r, 400, "BadRequestError");
    assert_non_null(strstr(r, "names another server"));
    free(r);
    char req[256];
    snprintf(req, sizeof req,
             "GET http://127.0.0.1:%d/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
             port);
    r = roundtrip(port, req);
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "ok");
    free(r);

    // 4 KiB against a 1 KiB limit, sent whole: the 413 arrives, and the
    // connection stays usable for the next request (the body was dropped).
    char big[4096 + 256];
    int hl = snprintf(big, sizeof big,
                      "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 4096\r\n\r\n");
    memset(big + hl, 'x', 4096);
    fd = connect_to(port);
    send_all(fd, big, (size_t)hl + 4096);
    r = read_response(fd, &len);
    assert_oai_error(r, 413, "RequestTooLargeError");
    free(r);
    close(fd);
    tdm_http_server_free(srv);
}

// A handler that holds its request until released (test_memory_budget).
struct hold {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool inside, release;
};

static void h_hold(struct tdm_http_conn *c, void *arg)
{
    struct hold *h = arg;
    pthread_mutex_lock(&h->mu);
    h->inside = true;
    pthread_cond_broadcast(&h->cv);
    while (!h->release)
        pthread_cond_wait(&h->cv, &h->mu);
    pthread_mutex_unlock(&h->mu);
    tdm_http_respond(c, 200, NULL, "held", 4);
}

struct hold_client {
    int port;
    char *req;
    char *resp;
};

static void *hold_client_run(void *arg)
{
    struct hold_client *hc = arg;
    hc->resp = roundtrip(hc->port, hc->req);
    return NULL;
}

// A request of n body bytes to path ("Content-Length", or chunked in 4 KiB
// chunks), "Connection: close"; heap.
static char *body_request(const char *path, size_t n, bool chunked)
{
    char *req = malloc(n + n / 1024 * 16 + 256);
    int hl = sprintf(req, "POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n", path);
    char *p = req + hl;
    if (!chunked) {
        p += sprintf(p, "Content-Length: %zu\r\n\r\n", n);
        memset(p, 'x', n);
        p[n] = '\0';
        return req;
    }
    p += sprintf(p, "Transfer-Encoding: chunked\r\n\r\n");
    for (size_t left = n; left;) {
        size_t k = left < 4096 ? left : 4096;
        p += sprintf(p, "%zx\r\n", k);
        memset(p, 'x', k);
        p += k;
        p += sprintf(p, "\r\n");
        left -= k;
    }
    strcpy(p, "0\r\n\r\n");
    return req;
}

// The memory budget (issue 29, part 3): a request counts its body and the
// parse its body may cost from when its size is known to its response's end;
// one over the whole budget is a 413, one that does not fit beside the
// requests in progress a 503 + Retry-After (a chunked body as it grows), a
// bodiless GET counts nothing, and the count goes back to 0.
static void test_memory_budget(void **state)
{
    (void)state;
    assert_int_equal(tdm_http_request_memory(0), TDM_HTTP_REQUEST_BASE);
    assert_int_equal(tdm_http_request_memory(1000),
                     1000 + 1000 * TDM_JSON_NODE_BYTES + TDM_HTTP_REQUEST_BASE);
    size_t mib = (size_t)1 << 20;
    assert_int_equal(tdm_http_request_memory(mib), mib + TDM_HTTP_TREE_PER_BODY_BYTE * mib +
                                                       TDM_HTTP_TREE_SLACK + TDM_HTTP_REQUEST_BASE);
    assert_true(tdm_http_request_memory(SIZE_MAX / 2) == SIZE_MAX);

    struct hold h = {.inside = false};
    pthread_mutex_init(&h.mu, NULL);
    tdm_cond_init(&h.cv);
    size_t held = 20000;
    struct tdm_http_config cfg = {.host = "127.0.0.1",
                                  .num_threads = 8,
                                  .max_body_bytes = 65536,
                                  .memory_budget =
                                      tdm_http_request_memory(held) + tdm_http_request_memory(1000),
                                  .error_body = tdm_oai_http_error_body};
    struct tdm_http_server *srv = NULL;
    char err[256];
    assert_int_equal(tdm_http_server_new(&srv, &cfg, err, sizeof err), TDM_OK);
    tdm_http_route(srv, "GET", "/health", h_health, NULL);
    tdm_http_route(srv, "POST", "/echo", h_echo, NULL);
    tdm_http_route(srv, "POST", "/hold", h_hold, &h);
    assert_int_equal(tdm_http_server_start(srv, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(srv);
    char v[64];

    // Over the whole budget (under the body limit): 413 naming the flag.
    char *req = body_request("/echo", 40000, false);
    char *r = roundtrip(port, req);
    assert_oai_error(r, 413, "RequestTooLargeError");
    assert_non_null(strstr(r, "--http-memory-budget"));
    free(r);
    free(req);

    struct hold_client hc = {.port = port, .req = body_request("/hold", held, false)};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, hold_client_run, &hc), 0);
    pthread_mutex_lock(&h.mu);
    while (!h.inside)
        pthread_cond_wait(&h.cv, &h.mu);
    pthread_mutex_unlock(&h.mu);
    assert_int_equal(tdm_http_memory_in_use(srv), tdm_http_request_memory(held));

    // Beside it: a second large body does not fit now (503 + Retry-After),
    // neither does a chunked one once it grows; a small one does, and a GET
    // counts nothing.
    for (int chunked = 0; chunked < 2; chunked++) {
        req = body_request("/echo", held, chunked);
        r = roundtrip(port, req);
        assert_oai_error(r, 503, "ServiceUnavailableError");
        assert_string_equal(header_of(r, "Retry-After", v, sizeof v), "1");
        assert_non_null(strstr(r, "memory budget"));
        free(r);
        free(req);
        // The refused request's count goes once its thread is done with it,
        // which may be after the client has the answer.
        for (int i = 0; i < 200 && tdm_http_memory_in_use(srv) != tdm_http_request_memory(held);
             i++)
            usleep(10000);
        assert_int_equal(tdm_http_memory_in_use(srv), tdm_http_request_memory(held));
    }
    req = body_request("/echo", 500, false);
    r = roundtrip(port, req);
    assert_int_equal(status_of(r), 200);
    assert_int_equal(strlen(body_of(r)), 500);
    free(r);
    free(req);
    r = roundtrip(port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    free(r);

    pthread_mutex_lock(&h.mu);
    h.release = true;
    pthread_cond_broadcast(&h.cv);
    pthread_mutex_unlock(&h.mu);
    pthread_join(th, NULL);
    assert_int_equal(status_of(hc.resp), 200);
    free(hc.resp);
    free(hc.req);
    // The count is returned once the handler's thread is done with the request.
    for (int i = 0; i < 200 && tdm_http_memory_in_use(srv); i++)
        usleep(10000);
    assert_int_equal(tdm_http_memory_in_use(srv), 0);
    for (int chunked = 0; chunked < 2; chunked++) {
        req = body_request("/echo", held, chunked);
        r = roundtrip(port, req);
        assert_int_equal(status_of(r), 200);
        free(r);
        free(req);
        for (int i = 0; i < 200 && tdm_http_memory_in_use(srv); i++)
            usleep(10000);
    }
    tdm_http_server_free(srv);
    pthread_mutex_destroy(&h.mu);
    pthread_cond_destroy(&h.cv);
}

static void test_error_body_fallback(void **state)
{
    (void)state;
    struct tdm_http_server *s;
    char err[256];
    struct tdm_http_config cfg = {.host = "127.0.0.1", .num_threads = 1};
    assert_int_equal(tdm_http_server_new(&s, &cfg, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(s, "GET", "/noresp", h_noresp, NULL), TDM_OK);
    assert_int_equal(tdm_http_server_start(s, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(s);
    char *r = roundtrip(port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 404);
    char v[64];
    assert_string_equal(header_of(r, "Content-Type", v, sizeof v), "text/plain; charset=utf-8");
    assert_string_equal(body_of(r), "The path /nope was not found");
    free(r);
    r = roundtrip(port, "GET /noresp HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 500);
    assert_string_equal(body_of(r), "The handler sent no response");
    free(r);
    tdm_http_server_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain_and_metrics),
        cmocka_unit_test(test_handler_stack_room),
        cmocka_unit_test(test_ambiguous_requests),
        cmocka_unit_test(test_not_found_and_method),
        cmocka_unit_test(test_body_and_limit),
        cmocka_unit_test(test_sse_framing_and_keep_alive),
        cmocka_unit_test(test_one_write_per_response),
        cmocka_unit_test(test_connection_header),
        cmocka_unit_test(test_client_disconnect_detected),
        cmocka_unit_test(test_api_key),
        cmocka_unit_test(test_lifecycle_and_errors),
    };
    const struct CMUnitTest alone[] = {
        cmocka_unit_test(test_error_body_fallback),
        cmocka_unit_test(test_slow_clients_and_targets),
        cmocka_unit_test(test_memory_budget),
    };
    return cmocka_run_group_tests(tests, setup, teardown) |
           cmocka_run_group_tests(alone, NULL, NULL);
}
