// SPDX-License-Identifier: Apache-2.0
// http: civetweb glue. One begin_request callback sees every request: it checks
// the API key, finds the route (404/405 otherwise), reads the body under the
// limit (413 otherwise), calls the handler and logs the outcome at DEBUG.
// Responses go out through civetweb's mg_response_header_* calls so civetweb
// keeps its keep-alive bookkeeping; SSE frames its own chunks so that one event
// is one write (civetweb's mg_send_chunk would make three). civetweb drains an
// unread request body itself before the next keep-alive request.
#include "http.h"

#include <civetweb.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "core.h"

#define MAX_EXTRA_HEADERS 16
#define DEFAULT_THREADS 64
#define DEFAULT_BODY_LIMIT (16u << 20)
#define DEFAULT_TIMEOUT_MS 600000

struct route {
    char *method;
    char *path;
    size_t prefix_len; // > 0: path ended in '*', match this many bytes
    tdm_http_handler_fn fn;
    void *arg;
};

struct tdm_http_server {
    struct mg_context *ctx;
    char *host;
    int port; // configured, then bound
    int num_threads;
    size_t max_body;
    char *api_key; // NULL = none
    char **exempt; // NULL-terminated
    int timeout_ms;
    tdm_http_error_body_fn error_body; // NULL = text/plain errors
    struct route *routes;
    size_t n_routes;
    bool started;
};

struct tdm_http_conn {
    struct mg_connection *mg;
    struct tdm_http_server *srv;
    const struct mg_request_info *ri;
    char *body; // NUL-terminated request body (heap) or NULL
    size_t body_len;
    int status;       // answered status, 0 = not yet
    bool sse;         // an event stream is open
    bool chunked;     // the stream uses chunked framing
    bool gone;        // a write failed
    size_t bytes_out; // body bytes written
    char *hdr_name[MAX_EXTRA_HEADERS];
    char *hdr_value[MAX_EXTRA_HEADERS];
    int n_hdr;
    char *frame; // SSE framing buffer, grown as needed
    size_t frame_cap;
};

// ---- status helpers ---------------------------------------------------------------------------
const char *tdm_http_reason(int status)
{
    switch (status) {
    case 200:
        return "OK";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 413:
        return "Payload Too Large";
    case 422:
        return "Unprocessable Entity";
    case 429:
        return "Too Many Requests";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    default:
        return "Unknown";
    }
}

// ---- server lifecycle --------------------------------------------------------------------------
static void free_strv(char **v)
{
    if (!v)
        return;
    for (char **p = v; *p; p++)
        free(*p);
    free(v);
}

int tdm_http_server_new(struct tdm_http_server **out, const struct tdm_http_config *cfg, char *err,
                        size_t errlen)
{
    static const char *const default_exempt[] = {"/health", "/metrics", "/ping", "/version", NULL};
    *out = NULL;
    if (!cfg)
        return tdm_seterr(err, errlen, TDM_EINVAL, "http: no config");
    if (cfg->port < 0 || cfg->port > 65535)
        return tdm_seterr(err, errlen, TDM_EINVAL, "http: port %d is outside [0, 65535]",
                          cfg->port);
    const char *host = cfg->host && *cfg->host ? cfg->host : "0.0.0.0";
    if (strlen(host) > 200 || strpbrk(host, ", \t"))
        return tdm_seterr(err, errlen, TDM_EINVAL, "http: bad host '%.60s'", host);
    struct tdm_http_server *s = calloc(1, sizeof *s);
    if (!s)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    s->host = strdup(host);
    s->port = cfg->port;
    s->num_threads = cfg->num_threads > 0 ? cfg->num_threads : DEFAULT_THREADS;
    s->max_body = cfg->max_body_bytes ? cfg->max_body_bytes : DEFAULT_BODY_LIMIT;
    s->timeout_ms = cfg->request_timeout_ms > 0 ? cfg->request_timeout_ms : DEFAULT_TIMEOUT_MS;
    s->error_body = cfg->error_body;
    if (cfg->api_key && *cfg->api_key && !(s->api_key = strdup(cfg->api_key)))
        goto fail;
    const char *const *ex = cfg->auth_exempt ? cfg->auth_exempt : default_exempt;
    size_t n = 0;
    while (ex[n])
        n++;
    s->exempt = calloc(n + 1, sizeof *s->exempt);
    if (!s->host || !s->exempt)
        goto fail;
    for (size_t i = 0; i < n; i++)
        if (!(s->exempt[i] = strdup(ex[i])))
            goto fail;
    *out = s;
    return TDM_OK;
fail:
    tdm_http_server_free(s);
    return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
}

int tdm_http_route(struct tdm_http_server *s, const char *method, const char *path,
                   tdm_http_handler_fn fn, void *arg)
{
    if (!s || !method || !*method || !path || path[0] != '/' || !fn)
        return TDM_EINVAL;
    if (s->started)
        return TDM_EBUSY;
    for (size_t i = 0; i < s->n_routes; i++) {
        if (strcmp(s->routes[i].method, method) == 0 && strcmp(s->routes[i].path, path) == 0) {
            s->routes[i].fn = fn;
            s->routes[i].arg = arg;
            return TDM_OK;
        }
    }
    struct route *r = realloc(s->routes, (s->n_routes + 1) * sizeof *r);
    if (!r)
        return TDM_ENOMEM;
    s->routes = r;
    struct route *nr = &r[s->n_routes];
    nr->method = strdup(method);
    nr->path = strdup(path);
    if (!nr->method || !nr->path) {
        free(nr->method);
        free(nr->path);
        return TDM_ENOMEM;
    }
    size_t len = strlen(path);
    nr->prefix_len = path[len - 1] == '*' ? len - 1 : 0;
    nr->fn = fn;
    nr->arg = arg;
    s->n_routes++;
    return TDM_OK;
}

static int on_log_message(const struct mg_connection *conn, const char *message)
{
    (void)conn;
    TDM_LOG_WARN("http", "civetweb: %s", message);
    return 1; // handled: civetweb prints nothing itself
}

static int on_begin_request(struct mg_connection *mg);

static pthread_once_t library_once = PTHREAD_ONCE_INIT;
static void init_library(void)
{
    mg_init_library(0);
}

int tdm_http_server_start(struct tdm_http_server *s, char *err, size_t errlen)
{
    if (s->started)
        return tdm_seterr(err, errlen, TDM_EBUSY, "http: already started");
    pthread_once(&library_once, init_library);
    char ports[256], threads[16], timeout[16];
    if (strchr(s->host, ':'))
        snprintf(ports, sizeof ports, "[%s]:%d", s->host, s->port);
    else
        snprintf(ports, sizeof ports, "%s:%d", s->host, s->port);
    snprintf(threads, sizeof threads, "%d", s->num_threads);
    snprintf(timeout, sizeof timeout, "%d", s->timeout_ms);
    const char *options[] = {
        "listening_ports",
        ports,
        "num_threads",
        threads,
        "enable_keep_alive",
        "yes",
        "keep_alive_timeout_ms",
        "5000",
        "request_timeout_ms",
        timeout,
        "tcp_nodelay",
        "1", // SSE events must not wait for Nagle
        NULL,
    };
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.begin_request = on_begin_request;
    cb.log_message = on_log_message;
    char text[256] = "";
    unsigned code = 0;
    struct mg_error_data ed = {.code = &code, .text = text, .text_buffer_size = sizeof text};
    struct mg_init_data init = {.callbacks = &cb, .user_data = s, .configuration_options = options};
    s->ctx = mg_start2(&init, &ed);
    if (!s->ctx)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "http: cannot listen on %s: %s", ports,
                          text[0] ? text : "civetweb failed to start");
    struct mg_server_port bound[4];
    int n = mg_get_server_ports(s->ctx, 4, bound);
    if (n > 0)
        s->port = bound[0].port;
    s->started = true;
    TDM_LOG_INFO("http", "listening on %s port=%d threads=%d auth=%s", s->host, s->port,
                 s->num_threads, s->api_key ? "on" : "off");
    return TDM_OK;
}

int tdm_http_server_port(const struct tdm_http_server *s)
{
    return s && s->started ? s->port : 0;
}

void tdm_http_server_stop(struct tdm_http_server *s)
{
    if (!s || !s->ctx)
        return;
    mg_stop(s->ctx);
    s->ctx = NULL;
    s->started = false;
}

void tdm_http_server_free(struct tdm_http_server *s)
{
    if (!s)
        return;
    tdm_http_server_stop(s);
    for (size_t i = 0; i < s->n_routes; i++) {
        free(s->routes[i].method);
        free(s->routes[i].path);
    }
    free(s->routes);
    free(s->host);
    free(s->api_key);
    free_strv(s->exempt);
    free(s);
}

// ---- request accessors --------------------------------------------------------------------------
const char *tdm_http_method(const struct tdm_http_conn *c)
{
    return c->ri->request_method;
}

const char *tdm_http_path(const struct tdm_http_conn *c)
{
    return c->ri->local_uri ? c->ri->local_uri : "/";
}

const char *tdm_http_query(const struct tdm_http_conn *c)
{
    return c->ri->query_string;
}

const char *tdm_http_header(const struct tdm_http_conn *c, const char *name)
{
    return mg_get_header(c->mg, name);
}

int tdm_http_status(const struct tdm_http_conn *c)
{
    return c->status;
}

const char *tdm_http_body(const struct tdm_http_conn *c, size_t *len)
{
    if (len)
        *len = c->body_len;
    return c->body ? c->body : "";
}

const char *tdm_http_remote_addr(const struct tdm_http_conn *c)
{
    return c->ri->remote_addr;
}

bool tdm_http_client_gone(const struct tdm_http_conn *c)
{
    return c->gone;
}

// ---- responses ----------------------------------------------------------------------------------
int tdm_http_add_header(struct tdm_http_conn *c, const char *name, const char *value)
{
    if (!name || !value || c->status)
        return TDM_EINVAL;
    if (c->n_hdr == MAX_EXTRA_HEADERS)
        return TDM_ECAPACITY;
    char *n = strdup(name), *v = strdup(value);
    if (!n || !v) {
        free(n);
        free(v);
        return TDM_ENOMEM;
    }
    c->hdr_name[c->n_hdr] = n;
    c->hdr_value[c->n_hdr] = v;
    c->n_hdr++;
    return TDM_OK;
}

// Writes all of buf; a short or failed write marks the client gone.
static int write_all(struct tdm_http_conn *c, const void *buf, size_t len)
{
    if (c->gone)
        return TDM_ECLOSED;
    if (len == 0)
        return TDM_OK;
    int n = mg_write(c->mg, buf, len);
    if (n < 0 || (size_t)n != len) {
        c->gone = true;
        return TDM_ECLOSED;
    }
    c->bytes_out += len;
    return TDM_OK;
}

static int send_headers(struct tdm_http_conn *c, int status, const char *content_type,
                        long long content_length, bool chunked)
{
    if (mg_response_header_start(c->mg, status) != 0)
        return TDM_ECLOSED;
    mg_response_header_add(c->mg, "Content-Type", content_type, -1);
    if (content_length >= 0) {
        char len[32];
        snprintf(len, sizeof len, "%lld", content_length);
        mg_response_header_add(c->mg, "Content-Length", len, -1);
    }
    if (chunked)
        mg_response_header_add(c->mg, "Transfer-Encoding", "chunked", -1);
    for (int i = 0; i < c->n_hdr; i++)
        mg_response_header_add(c->mg, c->hdr_name[i], c->hdr_value[i], -1);
    c->status = status;
    if (mg_response_header_send(c->mg) != 0) {
        c->gone = true;
        return TDM_ECLOSED;
    }
    return TDM_OK;
}

int tdm_http_respond(struct tdm_http_conn *c, int status, const char *content_type,
                     const char *body, size_t len)
{
    if (c->status)
        return TDM_EINVAL;
    int rc = send_headers(c, status, content_type ? content_type : "text/plain; charset=utf-8",
                          (long long)len, false);
    if (rc != TDM_OK)
        return rc;
    return write_all(c, body, len);
}

int tdm_http_respond_json(struct tdm_http_conn *c, int status, const char *json)
{
    return tdm_http_respond(c, status, "application/json", json, json ? strlen(json) : 0);
}

int tdm_http_respond_json_owned(struct tdm_http_conn *c, int status, char *json)
{
    if (json == NULL)
        return tdm_http_respond_error(c, 500, "out of memory");
    int rc = tdm_http_respond_json(c, status, json);
    free(json);
    return rc;
}

int tdm_http_respond_error(struct tdm_http_conn *c, int status, const char *message)
{
    if (message == NULL)
        message = "";
    char *body = c->srv->error_body ? c->srv->error_body(status, message) : NULL;
    if (body == NULL)
        return tdm_http_respond(c, status, NULL, message, strlen(message));
    int rc = tdm_http_respond_json(c, status, body);
    free(body);
    return rc;
}

// ---- server-sent events
// ---------------------------------------------------------------------------
int tdm_http_sse_start(struct tdm_http_conn *c)
{
    if (c->status)
        return TDM_EINVAL;
    c->chunked = strcmp(c->ri->http_version ? c->ri->http_version : "1.0", "1.0") != 0;
    tdm_http_add_header(c, "Cache-Control", "no-cache");
    int rc = send_headers(c, 200, "text/event-stream; charset=utf-8", -1, c->chunked);
    c->sse = rc == TDM_OK;
    return rc;
}

// Writes prefix + payload + suffix as one chunk (or raw when not chunked), in
// one write so an event never reaches the client half-framed.
static int write_frame(struct tdm_http_conn *c, const char *prefix, const char *payload, size_t len,
                       const char *suffix)
{
    if (!c->sse)
        return TDM_EINVAL;
    if (c->gone)
        return TDM_ECLOSED;
    size_t plen = strlen(prefix), slen = strlen(suffix);
    size_t body = plen + len + slen;
    size_t need = body + 32;
    if (need > c->frame_cap) {
        size_t cap = c->frame_cap ? c->frame_cap : 256;
        while (cap < need)
            cap *= 2;
        char *f = realloc(c->frame, cap);
        if (!f)
            return TDM_ENOMEM;
        c->frame = f;
        c->frame_cap = cap;
    }
    size_t o = 0;
    if (c->chunked)
        o += (size_t)snprintf(c->frame, 32, "%zx\r\n", body);
    memcpy(c->frame + o, prefix, plen);
    o += plen;
    memcpy(c->frame + o, payload, len);
    o += len;
    memcpy(c->frame + o, suffix, slen);
    o += slen;
    if (c->chunked) {
        memcpy(c->frame + o, "\r\n", 2);
        o += 2;
    }
    return write_all(c, c->frame, o);
}

int tdm_http_sse_event(struct tdm_http_conn *c, const char *json, size_t len)
{
    return write_frame(c, "data: ", json ? json : "", json ? len : 0, "\n\n");
}

int tdm_http_sse_comment(struct tdm_http_conn *c, const char *text)
{
    return write_frame(c, ": ", text ? text : "", text ? strlen(text) : 0, "\n\n");
}

int tdm_http_sse_end(struct tdm_http_conn *c, bool done)
{
    if (!c->sse)
        return TDM_EINVAL;
    int rc = TDM_OK;
    if (done)
        rc = write_frame(c, "data: [DONE]", "", 0, "\n\n");
    if (rc == TDM_OK && c->chunked)
        rc = write_all(c, "0\r\n\r\n", 5);
    c->sse = false;
    return rc;
}

// ---- dispatch
// ---------------------------------------------------------------------------------------
static bool path_exempt(const struct tdm_http_server *s, const char *path)
{
    for (char **p = s->exempt; *p; p++)
        if (strcmp(*p, path) == 0)
            return true;
    return false;
}

// Constant-time comparison, so response timing does not reveal key prefixes.
static bool key_matches(const char *want, const char *got, size_t got_len)
{
    size_t want_len = strlen(want);
    unsigned diff = (unsigned)(want_len ^ got_len);
    for (size_t i = 0; i < want_len; i++)
        diff |= (unsigned char)want[i] ^ (unsigned char)(i < got_len ? got[i] : 0);
    return diff == 0;
}

static bool authorized(const struct tdm_http_conn *c)
{
    const char *h = mg_get_header(c->mg, "Authorization");
    if (!h)
        return false;
    while (*h == ' ')
        h++;
    if (strncasecmp(h, "Bearer ", 7) != 0)
        return false;
    h += 7;
    while (*h == ' ')
        h++;
    size_t len = strlen(h);
    while (len > 0 && (h[len - 1] == ' ' || h[len - 1] == '\t'))
        len--;
    return key_matches(c->srv->api_key, h, len);
}

static const struct route *find_route(const struct tdm_http_server *s, const char *method,
                                      const char *path, bool *path_known, char *allow,
                                      size_t allow_len)
{
    *path_known = false;
    allow[0] = '\0';
    const struct route *prefix_hit = NULL;
    for (size_t i = 0; i < s->n_routes; i++) {
        const struct route *r = &s->routes[i];
        bool match =
            r->prefix_len ? strncmp(path, r->path, r->prefix_len) == 0 : strcmp(path, r->path) == 0;
        if (!match)
            continue;
        *path_known = true;
        if (strcmp(r->method, method) == 0) {
            if (!r->prefix_len)
                return r;
            if (!prefix_hit)
                prefix_hit = r;
        } else if (strlen(allow) + strlen(r->method) + 3 < allow_len) {
            if (allow[0])
                strcat(allow, ", ");
            strcat(allow, r->method);
        }
    }
    return prefix_hit;
}

static bool method_has_body(const char *m)
{
    return strcmp(m, "POST") == 0 || strcmp(m, "PUT") == 0 || strcmp(m, "PATCH") == 0;
}

// Reads the request body into c->body. Returns 0, 413 (over the limit) or 400
// (the read failed: the client went away or sent a broken chunked body).
static int read_body(struct tdm_http_conn *c)
{
    long long declared = c->ri->content_length;
    size_t limit = c->srv->max_body;
    if (declared > 0 && (unsigned long long)declared > limit)
        return 413;
    if (declared == 0 || (declared < 0 && !method_has_body(c->ri->request_method)))
        return 0;
    size_t cap = declared > 0 ? (size_t)declared + 1 : 4096;
    c->body = malloc(cap);
    if (!c->body)
        return 500;
    size_t len = 0;
    for (;;) {
        if (len + 1 == cap) {
            if (declared > 0)
                break;
            if (cap > limit + 1) {
                return 413;
            }
            size_t ncap = cap * 2 > limit + 2 ? limit + 2 : cap * 2;
            char *b = realloc(c->body, ncap);
            if (!b)
                return 500;
            c->body = b;
            cap = ncap;
        }
        int n = mg_read(c->mg, c->body + len, cap - 1 - len);
        if (n < 0)
            return 400;
        if (n == 0)
            break;
        len += (size_t)n;
        if (len > limit)
            return 413;
    }
    if (declared > 0 && len != (size_t)declared)
        return 400;
    c->body[len] = '\0';
    c->body_len = len;
    return 0;
}

// A request whose body length is ambiguous is refused before its body is
// read: two Content-Length headers that differ, or Content-Length beside
// Transfer-Encoding (RFC 9112 6.3: the classic request-smuggling shapes, where
// a proxy in front and this server could split the stream differently).
static const char *framing_error(const struct mg_request_info *ri)
{
    const char *cl = NULL;
    bool te = false;
    for (int i = 0; i < ri->num_headers; i++) {
        const char *name = ri->http_headers[i].name, *value = ri->http_headers[i].value;
        if (!name || !value)
            continue;
        if (strcasecmp(name, "Content-Length") == 0) {
            if (cl && strcmp(cl, value) != 0)
                return "Conflicting Content-Length headers";
            cl = value;
        } else if (strcasecmp(name, "Transfer-Encoding") == 0) {
            te = true;
        }
    }
    if (cl && te)
        return "Content-Length and Transfer-Encoding together are not accepted";
    return NULL;
}

static void conn_fini(struct tdm_http_conn *c)
{
    free(c->body);
    free(c->frame);
    for (int i = 0; i < c->n_hdr; i++) {
        free(c->hdr_name[i]);
        free(c->hdr_value[i]);
    }
}

static int on_begin_request(struct mg_connection *mg)
{
    const struct mg_request_info *ri = mg_get_request_info(mg);
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(mg));
    struct tdm_http_conn c = {.mg = mg, .srv = s, .ri = ri};
    double t0 = tdm_now();
    const char *method = ri->request_method ? ri->request_method : "";
    const char *path = tdm_http_path(&c);

    if (s->api_key && !path_exempt(s, path) && !authorized(&c)) {
        tdm_http_add_header(&c, "WWW-Authenticate", "Bearer");
        tdm_http_respond_error(&c, 401,
                               "Unauthorized: a valid API key is required (Authorization: Bearer "
                               "<key>)");
        goto done;
    }
    bool known;
    char allow[128];
    const struct route *r = find_route(s, method, path, &known, allow, sizeof allow);
    if (!r) {
        char msg[400];
        if (known) {
            tdm_http_add_header(&c, "Allow", allow);
            snprintf(msg, sizeof msg, "Method %.16s is not allowed for %.200s (allowed: %.120s)",
                     method, path, allow);
            tdm_http_respond_error(&c, 405, msg);
        } else {
            snprintf(msg, sizeof msg, "The path %.200s was not found", path);
            tdm_http_respond_error(&c, 404, msg);
        }
        goto done;
    }
    const char *framing = framing_error(ri);
    if (framing) {
        tdm_http_add_header(&c, "Connection", "close");
        tdm_http_respond_error(&c, 400, framing);
        goto done;
    }
    int body_status = read_body(&c);
    if (body_status == 413) {
        char msg[160];
        snprintf(msg, sizeof msg, "The request body is larger than the limit of %zu bytes",
                 s->max_body);
        tdm_http_respond_error(&c, 413, msg);
        goto done;
    }
    if (body_status) {
        tdm_http_respond_error(&c, body_status,
                               body_status == 500 ? "out of memory"
                                                  : "The request body could not be read");
        goto done;
    }
    r->fn(&c, r->arg);
    if (!c.status)
        tdm_http_respond_error(&c, 500, "The handler sent no response");
    else if (c.sse)
        tdm_http_sse_end(&c, false); // a handler that forgot to end still gets valid framing
done:
    TDM_LOG_DEBUG("http", "%s %s status=%d in=%zu out=%zu ms=%.2f%s", method, path, c.status,
                  c.body_len, c.bytes_out, (tdm_now() - t0) * 1e3, c.gone ? " client_gone" : "");
    int status = c.status ? c.status : 500;
    conn_fini(&c);
    return status;
}
