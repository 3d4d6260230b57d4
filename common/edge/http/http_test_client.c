// SPDX-License-Identifier: Apache-2.0
// http_test_client: the raw-socket HTTP client the tests of common/edge/http and
// common/edge/openai (openai_http_test) share, so that every byte on the wire is
// checked: one request per connection, the response read whole (Content-Length,
// chunked, or to EOF), its status, headers and body picked out, chunked bodies
// and SSE events split. Test code only: asserts with cmocka.
#include "http_test_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
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
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

int connect_to(int port)
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

void send_all(int fd, const char *buf, size_t len)
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
char *read_response(int fd, size_t *len)
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
char *read_to_eof(int fd, size_t *len)
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

char *roundtrip(int port, const char *req)
{
    int fd = connect_to(port);
    send_all(fd, req, strlen(req));
    char *resp = read_response(fd, NULL);
    close(fd);
    return resp;
}

int status_of(const char *resp)
{
    int st = 0;
    assert_int_equal(sscanf(resp, "HTTP/1.%*d %d", &st), 1);
    return st;
}

// Value of header name in resp (copied into out), or NULL when absent.
const char *header_of(const char *resp, const char *name, char *out, size_t cap)
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

const char *body_of(const char *resp)
{
    const char *b = strstr(resp, "\r\n\r\n");
    if (!b)
        fail_msg("no end of headers in: %.200s", resp);
    return b ? b + 4 : "";
}

// Decodes a chunked body starting at p into out; returns the bytes after the last chunk.
const char *dechunk(const char *p, char *out, size_t cap)
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

void assert_oai_error(const char *resp, int status, const char *type)
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

char *post(int port, const char *path, const char *json)
{
    char req[1024];
    snprintf(req, sizeof req,
             "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
             "%zu\r\nConnection: close\r\n\r\n%s",
             path, strlen(json), json);
    return roundtrip(port, req);
}

// Splits a dechunked SSE body into its events: data payloads, comments kept
// as ": text". Returns the count.
int sse_events(char *body, char **ev, int max)
{
    int n = 0;
    for (char *p = body; *p;) {
        char *end = strstr(p, "\n\n");
        assert_non_null(end);
        assert_true(n < max);
        *end = '\0';
        ev[n++] = strncmp(p, "data: ", 6) == 0 ? p + 6 : p;
        p = end + 2;
    }
    return n;
}
