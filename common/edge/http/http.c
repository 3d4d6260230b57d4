// SPDX-License-Identifier: Apache-2.0
// http: civetweb glue. One begin_request callback sees every request: it checks
// the API key, finds the route (404/405 otherwise), reads the body under the
// limit (413 otherwise), calls the handler and logs the outcome at DEBUG.
// A response's head is formatted here and goes out in the same write as its
// body (civetweb's mg_response_header_send writes each header line with its
// own send: 7 for a /health answer); the Connection header says what
// civetweb will do after the handler (keep_alive). SSE frames its own chunks
// so that one event is one write (civetweb's mg_send_chunk would make three).
// civetweb drains an unread request body itself before the next keep-alive
// request.
#include "http.h"

#include <arpa/inet.h>
#include <civetweb.h>
#include <dirent.h>
#include <errno.h>
#include <malloc.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "sanitizer.h"

#define MAX_EXTRA_HEADERS 16
#define DEFAULT_THREADS 64
#define DEFAULT_BODY_LIMIT (16u << 20)
#define DEFAULT_HEADER_TIMEOUT_MS 10000
#define DEFAULT_BODY_TIMEOUT_MS 30000
#define DEFAULT_LARGE_REQUESTS 4
// glibc's allocator statistics and trim (return_free_memory). A sanitizer
// build replaces malloc with its own, so glibc's arenas are never set up:
// mallinfo2 and malloc_trim would only run glibc's lazy initialisation, and
// from several HTTP threads at once that races (an ASan SEGV in int_mallinfo,
// seen in CI). They are left out there.
#if TDM_SANITIZE_ADDRESS || TDM_SANITIZE_THREAD || TDM_SANITIZE_MEMORY
#define GLIBC_MALLOC 0
#else
#define GLIBC_MALLOC 1
#endif
#define KEEP_ALIVE_TIMEOUT_MS 5000 // civetweb's wait for a kept-alive connection's next request
#define KEEP_ALIVE_TIMEOUT_TEXT "5000"
// Largest response body copied next to its head to go out in one write.
#define RESPOND_COPY_MAX (64u << 10)

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
    int header_timeout_ms;
    int body_timeout_ms;
    int max_conns_per_ip;   // <= 0: no cap
    int max_large_requests; // > 0
    tdm_http_error_body_fn error_body; // NULL = text/plain errors
    pthread_mutex_t mu;                // guards ips, n_large and mem_counted
    struct ip_count *ips;   // [n_ips] open connections per client address (with a cap only)
    size_t n_ips, cap_ips;
    int n_large; // large requests being handled
    char port_flag[48]; // named in a bind failure
    size_t mem_budget;  // memory_budget, > 0
    size_t mem_counted; // tdm_http_request_memory of the requests being handled (under mu)
    struct route *routes;
    size_t n_routes;
    bool started;
};

struct ip_count {
    char addr[48]; // mg_request_info.remote_addr
    int n;
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
    bool gone;        // a write failed, or a probe saw the client close (tdm_http_client_left)
    bool fd_looked;   // conn_socket looked for the socket (fd: what it found, -1 none)
    int fd;
    size_t bytes_out; // body bytes written
    char *hdr_name[MAX_EXTRA_HEADERS];
    char *hdr_value[MAX_EXTRA_HEADERS];
    int n_hdr;
    char *frame; // SSE framing buffer, grown as needed
    size_t frame_cap;
    bool large;      // holds one of max_large_requests
    size_t mem;      // counted against mem_budget (memory_take)
    bool mem_never;  // read_body's 413 was the memory budget (the request alone is over it)
    size_t mem_refused_len; // the body size memory_take refused
    bool mem_busy;          // read_body's 503 was the memory budget, not max_large_requests
    bool body_stall; // read_body's 408 was a stall (no data for a while), not its deadline
    bool must_close; // answered before its body was read: the connection closes
    bool drainable;  // ... unless the rest of the body can be read and dropped (drain_body)
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
    case 414:
        return "URI Too Long";
    case 431:
        return "Request Header Fields Too Large";
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
    s->header_timeout_ms =
        cfg->header_timeout_ms > 0 ? cfg->header_timeout_ms : DEFAULT_HEADER_TIMEOUT_MS;
    s->body_timeout_ms = cfg->body_timeout_ms > 0 ? cfg->body_timeout_ms : DEFAULT_BODY_TIMEOUT_MS;
    s->max_conns_per_ip = cfg->max_conns_per_ip > 0 ? cfg->max_conns_per_ip : 0;
    s->max_large_requests =
        cfg->max_large_requests > 0 ? cfg->max_large_requests : DEFAULT_LARGE_REQUESTS;
    snprintf(s->port_flag, sizeof s->port_flag, "%s",
             cfg->port_flag && *cfg->port_flag ? cfg->port_flag : "--port");
    s->mem_budget = cfg->memory_budget ? cfg->memory_budget : TDM_HTTP_DEFAULT_MEMORY_BUDGET;
    pthread_mutex_init(&s->mu, NULL);
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

// civetweb's own words for a failed bind ("cannot bind to 0.0.0.0:8001: 98
// (Address already in use)"), logged on the thread that runs mg_start2: kept so
// that tdm_http_server_start's error says the cause, not only "Failed to setup
// server ports" (issue 28, item 6).
static _Thread_local char bind_failure[200];

static int on_log_message(const struct mg_connection *conn, const char *message)
{
    (void)conn;
    if (strncmp(message, "cannot bind", 11) == 0 && !bind_failure[0])
        snprintf(bind_failure, sizeof bind_failure, "%s", message);
    TDM_LOG_WARN("http", "civetweb: %s", message);
    return 1; // handled: civetweb prints nothing itself
}

static int on_begin_request(struct mg_connection *mg);
static int on_init_connection(const struct mg_connection *mg, void **conn_data);
static int on_http_error(struct mg_connection *mg, int status, const char *msg);
static void on_connection_close(const struct mg_connection *mg);

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
    snprintf(timeout, sizeof timeout, "%d", s->header_timeout_ms);
    const char *options[] = {
        "listening_ports",
        ports,
        "num_threads",
        threads,
        "enable_keep_alive",
        "yes",
        "keep_alive_timeout_ms",
        KEEP_ALIVE_TIMEOUT_TEXT,
        "request_timeout_ms", // civetweb: the whole header read, and each read/write stall
        timeout,
        "enable_auth_domain_check", // an absolute-form target on this port is served as its path
        "no",
        "tcp_nodelay",
        "1", // SSE events must not wait for Nagle
        NULL,
    };
    struct mg_callbacks cb;
    memset(&cb, 0, sizeof cb);
    cb.begin_request = on_begin_request;
    cb.init_connection = on_init_connection;
    cb.connection_close = on_connection_close;
    cb.log_message = on_log_message;
    cb.http_error = on_http_error;
    char text[256] = "";
    unsigned code = 0;
    struct mg_error_data ed = {.code = &code, .text = text, .text_buffer_size = sizeof text};
    struct mg_init_data init = {.callbacks = &cb, .user_data = s, .configuration_options = options};
    bind_failure[0] = '\0';
    s->ctx = mg_start2(&init, &ed);
    if (!s->ctx) {
        // "cannot bind to H:P: 98 (Address already in use)": the part in parentheses.
        const char *why = strrchr(bind_failure, '(');
        if (why) {
            char cause[120];
            snprintf(cause, sizeof cause, "%s", why + 1);
            cause[strcspn(cause, ")")] = '\0';
            return tdm_seterr(err, errlen, TDM_ETRANSPORT,
                              "http: cannot listen on %s: %s (choose another port with %s)", ports,
                              cause, s->port_flag);
        }
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "http: cannot listen on %s: %s", ports,
                          text[0] ? text : "civetweb failed to start");
    }
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

// Wakes civetweb's listener while mg_stop waits for it: its poll wakes every
// 2 s (SOCKET_TIMEOUT_QUANTUM) or on a connection, so a connection now and
// then from here makes a stop take milliseconds instead of up to 2 s (every
// service's shutdown, every test that stops a server). The connection is
// closed at once; civetweb drops it unread.
struct stop_poke {
    struct sockaddr_storage addr;
    socklen_t len;
    atomic_bool done;
};

static void *stop_poke_main(void *arg)
{
    struct stop_poke *p = arg;
    while (!atomic_load(&p->done)) {
        int fd = socket(p->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0) {
            (void)connect(fd, (struct sockaddr *)&p->addr, p->len);
            close(fd);
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

// The loopback address of the bound listener: its own address, or 127.0.0.1
// / ::1 for the wildcard. false when there is none to reach (not started).
static bool stop_poke_addr(const struct tdm_http_server *s, struct stop_poke *p)
{
    if (s->port <= 0)
        return false;
    const char *host = s->host && *s->host ? s->host : "0.0.0.0";
    if (strcmp(host, "0.0.0.0") == 0)
        host = "127.0.0.1";
    else if (strcmp(host, "::") == 0)
        host = "::1";
    // The host is stored bare (the listener adds the brackets of an IPv6 one).
    struct sockaddr_in *a4 = (struct sockaddr_in *)&p->addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&p->addr;
    memset(&p->addr, 0, sizeof p->addr);
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons((uint16_t)s->port);
        p->len = sizeof *a4;
        return true;
    }
    if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons((uint16_t)s->port);
        p->len = sizeof *a6;
        return true;
    }
    return false; // a host name: the stop waits for the listener's own wake-up
}

void tdm_http_server_stop(struct tdm_http_server *s)
{
    if (!s || !s->ctx)
        return;
    struct stop_poke poke;
    pthread_t th;
    bool poking = s->started && stop_poke_addr(s, &poke);
    if (poking) {
        atomic_init(&poke.done, false);
        poking = pthread_create(&th, NULL, stop_poke_main, &poke) == 0;
    }
    mg_stop(s->ctx);
    if (poking) {
        atomic_store(&poke.done, true);
        pthread_join(th, NULL);
    }
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
    free(s->ips);
    pthread_mutex_destroy(&s->mu);
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

// The address of a socket as civetweb writes remote_addr (inet_ntop; an
// IPv4-mapped IPv6 peer of a dual-stack listener as its IPv4 form too), and its port.
static bool sock_addr(const struct sockaddr_storage *ss, char *out, size_t cap, int *port)
{
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        *port = ntohs(a->sin_port);
        return inet_ntop(AF_INET, &a->sin_addr, out, (socklen_t)cap) != NULL;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        *port = ntohs(a->sin6_port);
        return inet_ntop(AF_INET6, &a->sin6_addr, out, (socklen_t)cap) != NULL;
    }
    return false;
}

static bool same_addr(const char *sock, const char *civet)
{
    if (strcmp(sock, civet) == 0)
        return true;
    const char *mapped = "::ffff:"; // one side in the mapped form, the other not
    size_t ml = strlen(mapped);
    return (strncmp(sock, mapped, ml) == 0 && strcmp(sock + ml, civet) == 0) ||
           (strncmp(civet, mapped, ml) == 0 && strcmp(civet + ml, sock) == 0);
}

// The kernel socket of c's connection, which civetweb 1.15 does not hand out:
// the open socket of this process whose local port is the listener's and
// whose peer is the request's remote address and port (a TCP 4-tuple is
// unique, and the socket stays open while its handler runs). Looked up once
// (a scan of /proc/self/fd); -1 when none matches.
static int conn_socket(struct tdm_http_conn *c)
{
    if (c->fd_looked)
        return c->fd;
    c->fd_looked = true;
    c->fd = -1;
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int dfd = dirfd(d);
    for (struct dirent *e; c->fd < 0 && (e = readdir(d)) != NULL;) {
        char *end;
        long fd = strtol(e->d_name, &end, 10);
        if (*end != '\0' || end == e->d_name || fd == dfd || fd < 0 || fd > INT32_MAX)
            continue;
        struct sockaddr_storage local, peer;
        socklen_t ll = sizeof local, pl = sizeof peer;
        char laddr[INET6_ADDRSTRLEN], paddr[INET6_ADDRSTRLEN];
        int lport, pport;
        if (getsockname((int)fd, (struct sockaddr *)&local, &ll) != 0 ||
            getpeername((int)fd, (struct sockaddr *)&peer, &pl) != 0 ||
            !sock_addr(&local, laddr, sizeof laddr, &lport) ||
            !sock_addr(&peer, paddr, sizeof paddr, &pport))
            continue;
        if (lport == c->ri->server_port && pport == c->ri->remote_port &&
            same_addr(paddr, c->ri->remote_addr))
            c->fd = (int)fd;
    }
    closedir(d);
    return c->fd;
}

bool tdm_http_client_left(struct tdm_http_conn *c)
{
    if (c->gone)
        return true;
    int fd = conn_socket(c);
    if (fd < 0)
        return false;
    char b;
    ssize_t r = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
        c->gone = true; // end of stream (the client closed) or a reset
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

// Removes an extra header added before the response started.
static void drop_header(struct tdm_http_conn *c, const char *name)
{
    for (int i = 0; i < c->n_hdr; i++) {
        if (strcasecmp(c->hdr_name[i], name) == 0) {
            free(c->hdr_name[i]);
            free(c->hdr_value[i]);
            c->n_hdr--;
            c->hdr_name[i] = c->hdr_name[c->n_hdr];
            c->hdr_value[i] = c->hdr_value[c->n_hdr];
            i--;
        }
    }
}

// Writes all of buf (body bytes of it count in bytes_out); a short or
// failed write marks the client gone.
static int write_all(struct tdm_http_conn *c, const void *buf, size_t len, size_t body)
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
    c->bytes_out += body;
    return TDM_OK;
}

// Whether civetweb 1.15 keeps the connection open after this request, as its
// should_keep_alive decides with keep-alive enabled (this server's setting):
// a Connection header from the client decides (one of its comma-separated
// options, trimmed, cut at '=', a case-insensitive prefix of "keep-alive":
// civetweb compares only the option's length); without one, HTTP/1.1 keeps
// the connection and 1.0 closes it.
static bool keep_alive(const struct tdm_http_conn *c)
{
    const char *h = mg_get_header(c->mg, "Connection");
    if (h == NULL)
        return c->ri->http_version && strcmp(c->ri->http_version, "1.1") == 0;
    static const char want[] = "keep-alive";
    while (*h) {
        while (*h == ' ' || *h == '\t')
            h++;
        const char *end = strchr(h, ',');
        size_t len = end ? (size_t)(end - h) : strlen(h);
        const char *eq = memchr(h, '=', len);
        size_t opt = eq ? (size_t)(eq - h) : len;
        while (opt > 0 && (h[opt - 1] == ' ' || h[opt - 1] == '\t'))
            opt--;
        if (opt > 0 && opt <= sizeof want - 1 && strncasecmp(want, h, opt) == 0)
            return true;
        h += end ? len + 1 : len;
    }
    return false;
}

// The Date header's value for now (RFC 7231's IMF-fixdate), from gmtime_r:
// libcivetweb 1.15 fills a missing Date with gmtime(), not thread-safe across
// its worker threads.
static void http_date(char *out, size_t len)
{
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(out, len, "%a, %d %b %Y %H:%M:%S GMT", &tm);
}

// Formats the response head into c->frame with room for body_room more
// bytes after it; *head_len gets its length.
static int format_head(struct tdm_http_conn *c, int status, const char *content_type,
                       long long content_length, bool chunked, size_t body_room, size_t *head_len)
{
    char date[64];
    http_date(date, sizeof date);
    char length[48] = "";
    if (content_length >= 0)
        snprintf(length, sizeof length, "Content-Length: %lld\r\n", content_length);
    const char *v = c->ri->http_version;
    size_t need = 256 + strlen(content_type) + body_room;
    for (int i = 0; i < c->n_hdr; i++)
        need += strlen(c->hdr_name[i]) + strlen(c->hdr_value[i]) + 4;
    if (tdm_grow(&c->frame, &c->frame_cap, need, 1, 256) != TDM_OK)
        return TDM_ENOMEM;
    size_t o = (size_t)snprintf(c->frame, need,
                                "HTTP/%s %d %s\r\nDate: %s\r\nContent-Type: %s\r\n%s%s",
                                v && strcmp(v, "1.1") == 0 ? "1.1" : "1.0", status,
                                tdm_http_reason(status), date, content_type, length,
                                chunked ? "Transfer-Encoding: chunked\r\n" : "");
    // One Connection header: close when a handler or the server asked for it
    // (an added "Connection: close", a request answered before its body was
    // read), else what civetweb will do with the connection.
    bool close = c->must_close || !keep_alive(c);
    for (int i = 0; i < c->n_hdr; i++) {
        if (strcasecmp(c->hdr_name[i], "Connection") == 0) {
            close |= strcasecmp(c->hdr_value[i], "close") == 0;
            continue;
        }
        o += (size_t)snprintf(c->frame + o, need - o, "%s: %s\r\n", c->hdr_name[i],
                              c->hdr_value[i]);
    }
    o += (size_t)snprintf(c->frame + o, need - o, "Connection: %s\r\n\r\n",
                          close ? "close" : "keep-alive");
    *head_len = o;
    return TDM_OK;
}

int tdm_http_respond(struct tdm_http_conn *c, int status, const char *content_type,
                     const char *body, size_t len)
{
    if (c->status)
        return TDM_EINVAL;
    // A small body goes out with the head in one write; a large one after it
    // (not copied: /tokenize answers can be megabytes).
    bool together = len <= RESPOND_COPY_MAX;
    size_t head = 0;
    int rc = format_head(c, status, content_type ? content_type : "text/plain; charset=utf-8",
                         (long long)len, false, together ? len : 0, &head);
    if (rc != TDM_OK)
        return rc;
    c->status = status;
    if (!together) {
        rc = write_all(c, c->frame, head, 0);
        return rc == TDM_OK ? write_all(c, body, len, len) : rc;
    }
    if (len)
        memcpy(c->frame + head, body, len);
    return write_all(c, c->frame, head + len, len);
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
    size_t head = 0;
    int rc = format_head(c, 200, "text/event-stream; charset=utf-8", -1, c->chunked, 0, &head);
    if (rc != TDM_OK)
        return rc;
    c->status = 200;
    rc = write_all(c, c->frame, head, 0);
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
    if (tdm_grow(&c->frame, &c->frame_cap, need, 1, 256) != TDM_OK)
        return TDM_ENOMEM;
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
    return write_all(c, c->frame, o, o);
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
        rc = write_all(c, "0\r\n\r\n", 5, 5);
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

// One of max_large_requests, taken before a large body is read; false when
// all are taken.
static bool large_acquire(struct tdm_http_conn *c)
{
    struct tdm_http_server *s = c->srv;
    pthread_mutex_lock(&s->mu);
    bool ok = s->n_large < s->max_large_requests;
    if (ok)
        s->n_large++;
    pthread_mutex_unlock(&s->mu);
    c->large = ok;
    return ok;
}

static void large_release(struct tdm_http_conn *c)
{
    if (!c->large)
        return;
    pthread_mutex_lock(&c->srv->mu);
    c->srv->n_large--;
    pthread_mutex_unlock(&c->srv->mu);
    c->large = false;
}

size_t tdm_http_request_memory(size_t body_len)
{
    // Saturating: a declared length near SIZE_MAX must not wrap to a small count.
    if (body_len >
        (SIZE_MAX - TDM_HTTP_REQUEST_BASE - TDM_HTTP_TREE_SLACK) / (TDM_JSON_NODE_BYTES + 1))
        return SIZE_MAX;
    size_t tree = body_len * TDM_JSON_NODE_BYTES;
    size_t bound = body_len * TDM_HTTP_TREE_PER_BODY_BYTE + TDM_HTTP_TREE_SLACK;
    return body_len + (tree < bound ? tree : bound) + TDM_HTTP_REQUEST_BASE;
}

size_t tdm_http_memory_in_use(struct tdm_http_server *s)
{
    pthread_mutex_lock(&s->mu);
    size_t n = s->mem_counted;
    pthread_mutex_unlock(&s->mu);
    return n;
}

// Counts the request as using tdm_http_request_memory(body_len) (it grows as a
// chunked body does). 0; 413 (more than the whole budget: mem_never); 503 (it
// does not fit beside the requests being handled now: mem_busy).
static int memory_take(struct tdm_http_conn *c, size_t body_len)
{
    struct tdm_http_server *s = c->srv;
    size_t want = tdm_http_request_memory(body_len);
    if (want <= c->mem)
        return 0;
    c->mem_refused_len = body_len;
    if (want > s->mem_budget) {
        c->mem_never = true;
        return 413;
    }
    pthread_mutex_lock(&s->mu);
    bool ok = s->mem_counted - c->mem + want <= s->mem_budget;
    if (ok) {
        s->mem_counted = s->mem_counted - c->mem + want;
        c->mem = want;
    }
    pthread_mutex_unlock(&s->mu);
    c->mem_busy = !ok;
    return ok ? 0 : 503;
}

static void memory_release(struct tdm_http_conn *c)
{
    if (!c->mem)
        return;
    pthread_mutex_lock(&c->srv->mu);
    c->srv->mem_counted -= c->mem;
    pthread_mutex_unlock(&c->srv->mu);
    c->mem = 0;
}

// Reads the request body into c->body. Returns 0, 413 (over the limit, or
// over the whole memory budget), 503 (max_large_requests are being handled, or
// the memory budget is taken), 408 (not received within
// body_timeout_ms) or 400 (the client went away or sent a broken chunked
// body). civetweb's read waits up to header_timeout_ms for data and returns 0
// (or -1 for a chunked body) when it stalls that long: a read that long is a
// stall, a shorter one the end of the stream. It also returns only once it
// has all it was asked for, so a client trickling bytes would hold one large
// read for as long as it likes: reads start at one byte and double while they
// complete within 0.25 s (halve when slower), so the body's deadline is
// checked at least every ~0.5 s whatever the client's pace, and a fast client
// reaches 1 MiB reads after ~20 calls.
static int read_body(struct tdm_http_conn *c)
{
    long long declared = c->ri->content_length;
    size_t limit = c->srv->max_body;
    if (declared > 0 && (unsigned long long)declared > limit)
        return 413;
    if (declared == 0 || (declared < 0 && !method_has_body(c->ri->request_method)))
        return 0;
    int mst = memory_take(c, declared > 0 ? (size_t)declared : 0);
    if (mst)
        return mst;
    if (declared >= (long long)TDM_HTTP_LARGE_BODY && !large_acquire(c))
        return 503;
    double t0 = tdm_now();
    double body_s = c->srv->body_timeout_ms / 1000.0;
    double stall_s = 0.9 * c->srv->header_timeout_ms / 1000.0;
    size_t cap = declared > 0 ? (size_t)declared + 1 : 4096;
    c->body = malloc(cap);
    if (!c->body)
        return 500;
    size_t len = 0, want = 1;
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
        size_t room = cap - 1 - len;
        double r0 = tdm_now();
        int n = mg_read(c->mg, c->body + len, room < want ? room : want);
        double now = tdm_now();
        bool stalled = now - r0 >= stall_s;
        if (now - r0 > 0.25)
            want = want > 1 ? want / 2 : 1;
        else if (n > 0 && (size_t)n == want && want < ((size_t)1 << 20))
            want *= 2;
        if (n < 0) { // a chunked body: civetweb gives up on a stall itself
            c->body_stall = stalled && now - t0 < body_s;
            return stalled ? 408 : 400;
        }
        if (n == 0) {
            if (declared > 0 && len < (size_t)declared && stalled && now - t0 < body_s)
                continue; // a pause within the body's time: wait on
            if (declared > 0 && len < (size_t)declared)
                return stalled ? 408 : 400; // past the body's deadline
            break;
        }
        len += (size_t)n;
        if (len > limit)
            return 413;
        if (declared < 0 && (mst = memory_take(c, len)))
            return mst; // a chunked body, counted as it arrives
        if (!c->large && len >= TDM_HTTP_LARGE_BODY && !large_acquire(c))
            return 503; // a chunked body that turned out large
        if (now - t0 > body_s && (declared < 0 || len < (size_t)declared))
            return 408;
    }
    if (declared > 0 && len != (size_t)declared)
        return 400;
    c->body[len] = '\0';
    c->body_len = len;
    return 0;
}

// A body answered without being used (401/404/405/413/429/503) is read and
// dropped when it is at most this large, so a well-behaved client gets its
// answer rather than a reset while it is still sending; beyond it, or past
// body_timeout_ms, the connection is closed instead.
#define DRAIN_LIMIT ((size_t)64 << 20)

// Reads and drops the rest of the body (same adaptive reads and deadline as
// read_body). true when all of it was consumed.
static bool drain_body(struct tdm_http_conn *c)
{
    long long declared = c->ri->content_length;
    if (declared > 0 && (unsigned long long)declared > DRAIN_LIMIT)
        return false;
    double t0 = tdm_now();
    double body_s = c->srv->body_timeout_ms / 1000.0;
    char buf[16384];
    size_t want = 1, total = 0;
    while (total <= DRAIN_LIMIT && tdm_now() - t0 < body_s) {
        double r0 = tdm_now();
        int n = mg_read(c->mg, buf, want < sizeof buf ? want : sizeof buf);
        if (n < 0)
            return false;
        if (n == 0) // the end, or a stall of header_timeout_ms: either way done reading
            return tdm_now() - r0 < 0.9 * c->srv->header_timeout_ms / 1000.0;
        total += (size_t)n;
        if (tdm_now() - r0 > 0.25)
            want = want > 1 ? want / 2 : 1;
        else if ((size_t)n == want && want < sizeof buf)
            want *= 2;
    }
    return false;
}

// True when v is "chunked" (any case), with optional spaces or tabs around.
static bool te_is_chunked(const char *v)
{
    while (*v == ' ' || *v == '\t')
        v++;
    if (strncasecmp(v, "chunked", 7) != 0)
        return false;
    for (v += 7; *v == ' ' || *v == '\t'; v++)
        ;
    return *v == '\0';
}

// A request whose framing or identity is ambiguous is refused before its
// body is read, and its connection closed (RFC 9112 6.3, 3.2; the classic
// request-smuggling shapes, where a proxy in front and this server could split
// the stream differently): two Content-Length headers that differ, one that
// is not a decimal number ("12abc" was read as 12), Content-Length beside
// Transfer-Encoding, a Transfer-Encoding repeated or other than "chunked"
// ("identity" then "chunked": civetweb read the first and parsed the chunked
// body as a second request), two Authorization headers, and an HTTP/1.1
// request without Host.
static const char *framing_error(const struct mg_request_info *ri)
{
    const char *cl = NULL;
    int te = 0, auth = 0;
    bool te_other = false, host = false;
    for (int i = 0; i < ri->num_headers; i++) {
        const char *name = ri->http_headers[i].name, *value = ri->http_headers[i].value;
        if (!name || !value)
            continue;
        if (strcasecmp(name, "Content-Length") == 0) {
            if (cl && strcmp(cl, value) != 0)
                return "Conflicting Content-Length headers";
            const char *d = value;
            while (*d == ' ' || *d == '\t')
                d++;
            if (*d < '0' || *d > '9')
                return "Content-Length must be a decimal number";
            while (*d >= '0' && *d <= '9')
                d++;
            while (*d == ' ' || *d == '\t')
                d++;
            if (*d != '\0')
                return "Content-Length must be a decimal number";
            cl = value;
        } else if (strcasecmp(name, "Transfer-Encoding") == 0) {
            te++;
            te_other |= !te_is_chunked(value);
        } else if (strcasecmp(name, "Authorization") == 0) {
            auth++;
        } else if (strcasecmp(name, "Host") == 0) {
            host = true;
        }
    }
    if (te > 1)
        return "Transfer-Encoding may be sent once";
    if (te_other)
        return "Transfer-Encoding other than chunked is not accepted";
    if (cl && te)
        return "Content-Length and Transfer-Encoding together are not accepted";
    if (auth > 1)
        return "Authorization may be sent once";
    if (!host && ri->http_version && strcmp(ri->http_version, "1.1") == 0)
        return "An HTTP/1.1 request must carry a Host header";
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

// Markers in civetweb's per-connection data for max_conns_per_ip: not yet
// counted (set at accept: civetweb gives no client address before the first
// request), counted, counted and over the cap.
static char conn_uncounted, conn_counted, conn_over_cap;

// When civetweb began waiting for the head of the next request on this
// worker thread's connection, and how long it waits (the header timeout for
// a connection's first request, the keep-alive timeout for later ones): a
// head that failed before that time was cut by its size (on_http_error).
static _Thread_local double head_wait_start;
static _Thread_local bool head_wait_first;

static void head_wait_from(bool first)
{
    head_wait_start = tdm_now();
    head_wait_first = first;
}

static int on_init_connection(const struct mg_connection *mg, void **conn_data)
{
    head_wait_from(true);
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(mg));
    if (s != NULL && s->max_conns_per_ip > 0)
        *conn_data = &conn_uncounted;
    return 0;
}

// Counts the connection of a request against its client address, once per
// connection (at its first request). true when the connection is over the cap.
static bool count_connection(struct mg_connection *mg, const struct mg_request_info *ri)
{
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(mg));
    void *d = mg_get_user_connection_data(mg);
    if (d != &conn_uncounted)
        return d == &conn_over_cap;
    pthread_mutex_lock(&s->mu);
    struct ip_count *e = NULL;
    for (size_t i = 0; i < s->n_ips && !e; i++)
        if (strcmp(s->ips[i].addr, ri->remote_addr) == 0)
            e = &s->ips[i];
    if (e == NULL)
        tdm_grow(&s->ips, &s->cap_ips, s->n_ips + 1, sizeof *s->ips, 16); // checked below
    if (e == NULL && s->n_ips < s->cap_ips) {
        e = &s->ips[s->n_ips++];
        snprintf(e->addr, sizeof e->addr, "%s", ri->remote_addr);
        e->n = 0;
    }
    bool over = false;
    if (e) {
        e->n++;
        over = e->n > s->max_conns_per_ip;
        mg_set_user_connection_data(mg, over ? &conn_over_cap : &conn_counted);
    }
    pthread_mutex_unlock(&s->mu);
    return over;
}

static void uncount_connection(struct tdm_http_server *s, const char *addr)
{
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->n_ips; i++) {
        if (strcmp(s->ips[i].addr, addr) == 0) {
            if (--s->ips[i].n <= 0)
                s->ips[i] = s->ips[--s->n_ips];
            break;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

// The request targets civetweb 1.15 reads and then closes the connection on
// without calling begin_request (its process_new_connection): "*" and an
// absolute-form URI for another host:port. 1 = "*", 2 = absolute.
static int unserved_target(const struct mg_request_info *ri)
{
    const char *u = ri->request_uri, *v = ri->http_version;
    if (u == NULL || ri->local_uri != NULL || ri->request_method == NULL || v == NULL ||
        (strcmp(v, "1.0") != 0 && strcmp(v, "1.1") != 0))
        return 0;
    if (strcmp(u, "*") == 0)
        return 1;
    for (const unsigned char *p = (const unsigned char *)u; *p; p++)
        if (*p < 33)
            return 0; // civetweb answered 400 "Invalid URI" itself
    static const char *const schemes[] = {"http://", "https://", "ws://", "wss://"};
    for (size_t i = 0; i < sizeof schemes / sizeof *schemes; i++) {
        size_t n = strlen(schemes[i]);
        if (strncasecmp(u, schemes[i], n) != 0)
            continue;
        const char *host_end = strchr(u + n, '/');
        if (host_end == NULL)
            return 0;
        const char *colon = strchr(u + n, ':');
        if (colon == NULL)
            return 2;
        char *port_end = NULL;
        unsigned long port = strtoul(colon + 1, &port_end, 10);
        return port_end == host_end && port > 0 && port <= 65535 ? 2 : 0;
    }
    return 0;
}

// Writes a whole response on a connection civetweb is closing (status line,
// Date from gmtime_r, the given headers, body).
static void write_raw(struct mg_connection *mg, int status, const char *headers,
                      const char *content_type, const char *body)
{
    char date[64];
    http_date(date, sizeof date);
    size_t blen = body ? strlen(body) : 0;
    mg_printf(mg,
              "HTTP/1.1 %d %s\r\nDate: %s\r\n%s%s%s%sContent-Length: %zu\r\n"
              "Connection: close\r\n\r\n",
              status, tdm_http_reason(status), date, headers, content_type ? "Content-Type: " : "",
              content_type ? content_type : "", content_type ? "\r\n" : "", blen);
    if (blen)
        mg_write(mg, body, blen);
}

// civetweb 1.15 answers every request whose head it cannot read with "400
// Malformed message" in text/plain: one over its 16 KiB buffer (a long URL
// or header, for which HTTP has 414 and 431) and one whose head did not
// arrive within the timeout (408) alike, and reads neither. Told apart here
// by the time the head took; answered in the server's error format
// (issue 29, part 5). Other errors stay civetweb's (it answers 1 for them).
static int on_http_error(struct mg_connection *mg, int status, const char *msg)
{
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(mg));
    if (s == NULL || status != 400 || msg == NULL || strcmp(msg, "Malformed message") != 0)
        return 1;
    double limit = (head_wait_first ? s->header_timeout_ms : KEEP_ALIVE_TIMEOUT_MS) / 1000.0;
    bool timed_out = tdm_now() - head_wait_start >= limit * 0.9;
    char text[200];
    if (timed_out)
        snprintf(text, sizeof text, "The request's line and headers were not received within %g s",
                 limit);
    else
        snprintf(text, sizeof text,
                 "The request line and headers are over %d KiB, this server's limit: shorten "
                 "the URL or the headers",
                 TDM_HTTP_MAX_HEAD_BYTES / 1024);
    status = timed_out ? 408 : 431;
    char *body = s->error_body ? s->error_body(status, text) : NULL;
    write_raw(mg, status, "", body ? "application/json" : "text/plain; charset=utf-8",
              body ? body : text);
    free(body);
    return 0;
}

// connection_close: releases the connection's count, and answers the
// requests civetweb would close on in silence (unserved_target).
static void on_connection_close(const struct mg_connection *cmg)
{
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(cmg));
    const struct mg_request_info *ri = mg_get_request_info(cmg);
    if (s == NULL || ri == NULL)
        return;
    void *d = mg_get_user_connection_data(cmg);
    if (d == &conn_counted || d == &conn_over_cap)
        uncount_connection(s, ri->remote_addr);
    // civetweb passes the connection const, but its socket is still open and
    // this thread owns it: the answer is written before civetweb closes it.
    struct mg_connection *mg = (struct mg_connection *)cmg;
    int kind = unserved_target(ri);
    if (kind == 1 && strcmp(ri->request_method, "OPTIONS") == 0) {
        write_raw(mg, 204, "Allow: GET, POST\r\n", NULL, NULL);
    } else if (kind != 0) {
        char msg[300];
        snprintf(msg, sizeof msg,
                 kind == 1 ? "The request target * is only valid for OPTIONS"
                           : "The absolute-form target %.200s names another server; send the "
                             "path (origin-form)",
                 ri->request_uri);
        char *body = s->error_body ? s->error_body(400, msg) : NULL;
        write_raw(mg, 400, "", body ? "application/json" : "text/plain; charset=utf-8",
                  body ? body : msg);
        free(body);
    }
}

// libcivetweb 1.15 gives a begin_request callback no way to close its
// connection: after a negative return it keeps the connection whenever the
// request's body is consumed or all in its buffer (a request without a body,
// or a small one that came with its head) and the client's Connection header
// allows it, which it reads from the request info mg_get_request_info
// returns. So a request that must close (answered before its body was read,
// or refused for ambiguous framing: "12abc" read as 12, a chunked body
// behind "Transfer-Encoding: identity", whose unread bytes civetweb would
// parse as the next request) gets its Connection header set to "close" there,
// a slot added when the client sent none (the table has MG_MAX_HEADERS).
static void force_close(const struct mg_request_info *cri)
{
    struct mg_request_info *ri = (struct mg_request_info *)cri;
    bool found = false;
    for (int i = 0; i < ri->num_headers; i++)
        if (ri->http_headers[i].name && strcasecmp(ri->http_headers[i].name, "Connection") == 0) {
            ri->http_headers[i].value = "close";
            found = true;
        }
    if (!found && ri->num_headers < MG_MAX_HEADERS) {
        ri->http_headers[ri->num_headers].name = "Connection";
        ri->http_headers[ri->num_headers].value = "close";
        ri->num_headers++;
    }
}

// A large request's memory (body, parse trees, response) goes back to the
// system rather than staying in this thread's malloc arena; so does any
// request's that left the arenas holding more than TDM_HTTP_TRIM_FREE bytes
// free, whatever its body size (issue 29, part 3: sixteen 0.92 MB bodies left
// a router 1.33 GB above its baseline). Not under a sanitizer (GLIBC_MALLOC).
static void return_free_memory(bool large)
{
#if GLIBC_MALLOC
    if (large || mallinfo2().fordblks > TDM_HTTP_TRIM_FREE)
        malloc_trim(0);
#else
    (void)large;
#endif
}

// The checks before routing, in order: the per-address connection cap, ambiguous framing, the
// API key. Returns true when one of them answered the request.
static bool refuse_early(struct tdm_http_conn *c, const char *path, bool has_body)
{
    const struct tdm_http_server *s = c->srv;
    const struct mg_request_info *ri = c->ri;
    if (s->max_conns_per_ip > 0 && count_connection(c->mg, ri)) {
        char msg[160];
        snprintf(msg, sizeof msg, "Too many connections from %.60s (the limit is %d)",
                 ri->remote_addr, s->max_conns_per_ip);
        c->must_close = true;
        c->drainable = true;
        tdm_http_add_header(c, "Connection", "close");
        tdm_http_respond_error(c, 429, msg);
        return true;
    }
    if (has_body)
        tdm_http_add_header(c, "Connection", "close"); // dropped once the body is read

    const char *framing = framing_error(ri);
    if (framing) {
        if (!has_body)
            tdm_http_add_header(c, "Connection", "close");
        c->must_close = true;
        tdm_http_respond_error(c, 400, framing);
        return true;
    }
    if (s->api_key && !path_exempt(s, path) && !authorized(c)) {
        tdm_http_add_header(c, "WWW-Authenticate", "Bearer");
        c->drainable = true;
        tdm_http_respond_error(c, 401,
                               "Unauthorized: a valid API key is required (Authorization: Bearer "
                               "<key>)");
        return true;
    }
    return false;
}

// The route for method and path, or NULL after answering 405 (a known path) or 404.
static const struct route *route_or_refuse(struct tdm_http_conn *c, const char *method,
                                           const char *path)
{
    bool known;
    char allow[128];
    const struct route *r = find_route(c->srv, method, path, &known, allow, sizeof allow);
    if (r)
        return r;
    char msg[400];
    c->drainable = true;
    if (known) {
        tdm_http_add_header(c, "Allow", allow);
        snprintf(msg, sizeof msg, "Method %.16s is not allowed for %.200s (allowed: %.120s)",
                 method, path, allow);
        tdm_http_respond_error(c, 405, msg);
    } else {
        snprintf(msg, sizeof msg, "The path %.200s was not found", path);
        tdm_http_respond_error(c, 404, msg);
    }
    return NULL;
}

// Answers a body that read_body did not read, by its status (nonzero): which limit refused it
// or why the read failed.
static void respond_body_error(struct tdm_http_conn *c, int body_status)
{
    const struct tdm_http_server *s = c->srv;
    if (body_status == 413) {
        c->drainable = true;
        char msg[300];
        if (c->mem_never)
            snprintf(msg, sizeof msg,
                     "The request body is too large for this server's memory budget: a body "
                     "of %zu bytes counts as %.1f MiB (the body and its parse), over the whole "
                     "%.0f MiB (--http-memory-budget)",
                     c->mem_refused_len, tdm_http_request_memory(c->mem_refused_len) / 1048576.0,
                     s->mem_budget / 1048576.0);
        else
            snprintf(msg, sizeof msg, "The request body is larger than the limit of %zu bytes",
                     s->max_body);
        tdm_http_respond_error(c, 413, msg);
    } else if (body_status == 408) {
        // Which limit ended it: a chunked body's read gives up after a stall
        // of about the header timeout, before the body's own deadline (a 4
        // GiB chunk header was answered after 20 s with "within 30 s").
        char msg[200];
        if (c->body_stall)
            snprintf(msg, sizeof msg,
                     "No part of the request body arrived for %.0f s (the limit on a "
                     "stalled read, --http-header-timeout)",
                     s->header_timeout_ms / 1000.0);
        else
            snprintf(msg, sizeof msg,
                     "The request body was not received within %.0f s (--http-body-timeout)",
                     s->body_timeout_ms / 1000.0);
        tdm_http_respond_error(c, 408, msg);
    } else if (body_status == 503) {
        c->drainable = true;
        char msg[300];
        if (c->mem_busy)
            snprintf(msg, sizeof msg,
                     "The server's requests in progress use its memory budget (%.0f MiB, "
                     "--http-memory-budget); retry later",
                     s->mem_budget / 1048576.0);
        else
            snprintf(msg, sizeof msg,
                     "The server is handling %d requests with bodies over %zu bytes; retry later",
                     s->max_large_requests, TDM_HTTP_LARGE_BODY);
        tdm_http_add_header(c, "Retry-After", "1");
        tdm_http_respond_error(c, 503, msg);
    } else {
        // civetweb 1.15 (Debian bookworm's) refuses a chunk extension
        // ("1a;name=value"), valid HTTP/1.1 that clients do not send in
        // practice; later civetweb skips it. Trailers are read and dropped.
        tdm_http_respond_error(c, body_status,
                               body_status == 500 ? "out of memory"
                               : c->ri->content_length < 0
                                   ? "The chunked request body could not be read: the client "
                                     "went away or its chunk framing is malformed (chunk "
                                     "extensions, \"size;name=value\", are not supported)"
                                   : "The request body could not be read");
    }
}

// After the answer: drains what may be drained, logs the request, releases its memory and
// finishes c. Returns on_begin_request's result: -1 to close the connection, else the status.
static int finish_request(struct tdm_http_conn *c, const char *method, const char *path,
                          bool has_body, double t0)
{
    const struct mg_request_info *ri = c->ri;
    // The answer already said "Connection: close"; once the body is dropped
    // civetweb may keep the connection (the client closes it), except one
    // over the per-address cap, which closes either way.
    if (c->must_close && c->drainable && has_body && drain_body(c) && c->status != 429)
        c->must_close = false;
    TDM_LOG_DEBUG("http", "%s %s status=%d in=%zu out=%zu ms=%.2f%s", method, path, c->status,
                  c->body_len, c->bytes_out, (tdm_now() - t0) * 1e3, c->gone ? " client_gone" : "");
    bool large =
        c->large || c->body_len >= TDM_HTTP_LARGE_BODY || c->bytes_out >= TDM_HTTP_LARGE_BODY;
    large_release(c);
    memory_release(c);
    int status = c->status ? c->status : 500;
    bool must_close = c->must_close;
    conn_fini(c);
    return_free_memory(large);
    if (must_close)
        force_close(ri);
    head_wait_from(false);
    return must_close ? -1 : status;
}

static int on_begin_request(struct mg_connection *mg)
{
    const struct mg_request_info *ri = mg_get_request_info(mg);
    struct tdm_http_server *s = mg_get_user_data(mg_get_context(mg));
    struct tdm_http_conn c = {.mg = mg, .srv = s, .ri = ri};
    double t0 = tdm_now();
    const char *method = ri->request_method ? ri->request_method : "";
    const char *path = tdm_http_path(&c);
    // A request with a body that is answered before the body is read closes
    // its connection: civetweb would otherwise read and discard the rest (a
    // thread held for as long as the client keeps sending).
    bool has_body = ri->content_length > 0 || (ri->content_length < 0 && method_has_body(method));
    if (has_body)
        c.must_close = true;
    if (refuse_early(&c, path, has_body))
        return finish_request(&c, method, path, has_body, t0);
    const struct route *r = route_or_refuse(&c, method, path);
    if (!r)
        return finish_request(&c, method, path, has_body, t0);
    int body_status = read_body(&c);
    if (body_status == 0 && has_body) {
        // The body is in: the connection may be kept alive again.
        c.must_close = false;
        drop_header(&c, "Connection");
    }
    if (body_status) {
        respond_body_error(&c, body_status);
        return finish_request(&c, method, path, has_body, t0);
    }
    r->fn(&c, r->arg);
    if (!c.status)
        tdm_http_respond_error(&c, 500, "The handler sent no response");
    else if (c.sse)
        tdm_http_sse_end(&c, false); // a handler that forgot to end still gets valid framing
    return finish_request(&c, method, path, has_body, t0);
}
