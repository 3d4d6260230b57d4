// SPDX-License-Identifier: Apache-2.0
// http: a small HTTP/1.1 server over civetweb for the OpenAI-compatible API.
// Routes are exact (method, path) pairs (a path ending in '*' matches by
// prefix); the request body is read up front under a size limit (413 with an
// OpenAI error body when over); unknown paths get 404 and known paths with the
// wrong method 405, both with OpenAI error bodies; an optional API key is
// checked (Authorization: Bearer, 401) except on exempt paths. Responses are
// JSON or plain text with a Content-Length, or Server-Sent Events over chunked
// transfer encoding (keep-alive stays usable after the stream ends). A failed
// write marks the client gone, so a streaming handler can abort its request.
// This module is the HTTP server and nothing else: the body of an error the
// server answers by itself (401/404/405/413/500) comes from the error_body
// hook the role installs (common/edge/openai's tdm_oai_http_error_body), and the
// OpenAI routes and stream loop live in common/edge/openai (openai_http.h).
// Slow and greedy clients are bounded (issue 11): headers within
// header_timeout_ms, the body within body_timeout_ms, at most max_conns_per_ip
// connections per client address, at most max_large_requests large bodies at
// once; a request refused before its body was read closes its connection, so
// no thread waits on the rest of it. "OPTIONS *" is answered 204 with Allow and
// an absolute-form target (GET http://host/path) for this server's port is
// served as its path, for any other host:port answered 400. Ambiguous framing
// or identity is a 400 before the body is read, and the connection closes:
// differing or non-numeric Content-Length, Content-Length with
// Transfer-Encoding, a repeated or non-chunked Transfer-Encoding, two
// Authorization headers, HTTP/1.1 without Host.
// Each request runs on one of num_threads civetweb worker threads, from the
// handler call to its return; a connection handle is used by that thread only.
// civetweb types never appear here.
#ifndef TDM_HTTP_H
#define TDM_HTTP_H

// Stack a handler may count on: libcivetweb (Debian's 1.15) starts its workers
// with 100 KiB stacks, and glibc places each thread's static TLS (every loaded
// library's) and civetweb its own frames there before a handler runs (76-78
// KiB were left, release and ASan builds, Debian bookworm). A handler keeps to this
// much; whatever recurses per level of a request's bytes runs on a deep stack
// instead (core.h's tdm_call_deep). http_test checks a real handler has at
// least this; the deep-stack tests and the fuzzers run their inputs with no
// more (common/core/small_stack.h).
#define TDM_HTTP_HANDLER_STACK_BYTES (48u << 10)

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tdm_http_server;
struct tdm_http_conn; // one request being handled (opaque)

// Builds the body of an error the server answers by itself (status 401, 404,
// 405, 413, 400 for an unreadable body, 500 for a handler that sent nothing or
// out of memory): a heap NUL-terminated JSON string the server frees, or NULL
// on ENOMEM. Called on the request's worker thread.
typedef char *(*tdm_http_error_body_fn)(int status, const char *message);

struct tdm_http_config {
    const char *host;                  // address to bind: "127.0.0.1", "0.0.0.0"; NULL = "0.0.0.0"
    int port;                          // 0 = an ephemeral port (see tdm_http_server_port)
    const char *port_flag;             // the option that sets port, named when it cannot be
                                       // bound; NULL = "--port"
    int num_threads;                   // worker threads = concurrent requests (streams hold one
                                       // each); <= 0 = 64
    size_t max_body_bytes;             // request body limit; 0 = 16 MiB
    const char *api_key;               // NULL or "" = no key required
    const char *const *auth_exempt;    // NULL-terminated exact paths served without the key;
                                       // NULL = {"/health", "/metrics", "/ping", "/version"}
    int header_timeout_ms;   // time a client has to send a request's headers, from its first
                             // byte; past it civetweb answers 400 and closes. Also the longest
                             // one read or write of the connection may stall. <= 0 = 10000
    int body_timeout_ms;     // time to receive the whole body once the headers are in;
                             // past it 408 and the connection closed. <= 0 = 30000
    int max_conns_per_ip;    // open connections one client address may hold (a connection
                             // counts from its first request: civetweb names the client no
                             // sooner); a request on one beyond it gets 429 and the
                             // connection is closed. <= 0 = no cap
    int max_large_requests;  // requests with a body over TDM_HTTP_LARGE_BODY handled at once;
                             // beyond it 503 + Retry-After before the body is read. <= 0 = 4
    size_t memory_budget;    // bytes the requests being handled may be counted as using
                             // (tdm_http_request_memory each, from when the body's size is
                             // known to the response's end); a request that does not fit
                             // now gets 503 + Retry-After, one that never could 413.
                             // 0 = TDM_HTTP_DEFAULT_MEMORY_BUDGET
    tdm_http_error_body_fn error_body; // JSON body of the server's own errors; NULL = the
                                       // message as text/plain
};

// A body at least this large is a large request: counted against
// max_large_requests, and the allocator's free memory is returned to the
// system (malloc_trim) after its response, so a burst of large requests does
// not leave the process at its peak size.
#define TDM_HTTP_LARGE_BODY ((size_t)1 << 20)
// The request line and headers together (civetweb's buffer, its
// max_request_size default): a longer head is answered 431.
#define TDM_HTTP_MAX_HEAD_BYTES 16384
// The memory a request with a body is counted as using against the server's
// memory_budget (issue 29, part 3): its body, the JSON tree a front may build
// from it (TDM_JSON_NODE_BYTES a value, a value at least one body byte, and no
// more than TDM_HTTP_TREE_PER_BODY_BYTE x the body + TDM_HTTP_TREE_SLACK: the
// OpenAI front refuses a denser body before parsing it), and
// TDM_HTTP_REQUEST_BASE for the rest (tokens, the response). A request without
// a body (GET /health, /metrics) counts nothing, so a full budget never hides
// the server's health.
#define TDM_HTTP_TREE_PER_BODY_BYTE 20
#define TDM_HTTP_TREE_SLACK ((size_t)1 << 20)
#define TDM_HTTP_REQUEST_BASE ((size_t)64 << 10)
#define TDM_HTTP_DEFAULT_MEMORY_BUDGET ((size_t)2 << 30)
size_t tdm_http_request_memory(size_t body_len);
// The bytes counted against memory_budget now (requests being handled).
size_t tdm_http_memory_in_use(struct tdm_http_server *s);

// Free bytes the allocator's arenas may keep after a request before they are
// returned to the system (malloc_trim), whatever the request's size.
#define TDM_HTTP_TRIM_FREE ((size_t)8 << 20)

// A route handler. It must answer (respond or SSE) before returning; when it
// returns without answering, the server sends a 500 error body.
typedef void (*tdm_http_handler_fn)(struct tdm_http_conn *c, void *arg);

// Creates a stopped server (cfg copied, strings included). TDM_EINVAL for a bad
// config, TDM_ENOMEM.
int tdm_http_server_new(struct tdm_http_server **out, const struct tdm_http_config *cfg, char *err,
                        size_t errlen);
// Registers a handler for method ("GET", "POST", ...) and path ("/v1/models";
// "/debug/*" matches by prefix). Only before start. A second registration of the
// same pair replaces the first. TDM_EINVAL, TDM_EBUSY after start, TDM_ENOMEM.
int tdm_http_route(struct tdm_http_server *s, const char *method, const char *path,
                   tdm_http_handler_fn fn, void *arg);
// Binds and starts the worker threads. TDM_ETRANSPORT (with err) when the
// address cannot be bound.
int tdm_http_server_start(struct tdm_http_server *s, char *err, size_t errlen);
// The bound port (the real one when cfg.port was 0); 0 when not started.
int tdm_http_server_port(const struct tdm_http_server *s);
// Stops accepting and waits for every running handler to return (a streaming
// handler must notice shutdown itself). Safe to call twice.
void tdm_http_server_stop(struct tdm_http_server *s);
// Stops if needed, then frees; NULL is fine.
void tdm_http_server_free(struct tdm_http_server *s);

// ---- the request ------------------------------------------------------------------------
const char *tdm_http_method(const struct tdm_http_conn *c);
const char *tdm_http_path(const struct tdm_http_conn *c);  // without the query string
const char *tdm_http_query(const struct tdm_http_conn *c); // after '?', or NULL
// A request header (case-insensitive name), or NULL.
const char *tdm_http_header(const struct tdm_http_conn *c, const char *name);
// The body (NUL-terminated, owned by the connection; "" when none) and its length.
const char *tdm_http_body(const struct tdm_http_conn *c, size_t *len);
const char *tdm_http_remote_addr(const struct tdm_http_conn *c);
// The status answered so far (200 once a stream started), 0 before any answer.
int tdm_http_status(const struct tdm_http_conn *c);

// ---- answering ----------------------------------------------------------------------------
// Adds a response header to the next respond/SSE start (copied; up to 16).
int tdm_http_add_header(struct tdm_http_conn *c, const char *name, const char *value);
// Sends a whole response with Content-Length. TDM_ECLOSED when the client is gone
// (the write failed), TDM_EINVAL when already answered.
int tdm_http_respond(struct tdm_http_conn *c, int status, const char *content_type,
                     const char *body, size_t len);
// application/json; json NUL-terminated.
int tdm_http_respond_json(struct tdm_http_conn *c, int status, const char *json);
// Same, taking ownership of a heap json (freed here); NULL (a failed build) is
// answered with a 500 "out of memory" error body.
int tdm_http_respond_json_owned(struct tdm_http_conn *c, int status, char *json);
// An error the server answers itself: the config's error_body for status and
// message (application/json), or the message as text/plain without one. Adds
// no header (a caller wanting Retry-After adds it first).
int tdm_http_respond_error(struct tdm_http_conn *c, int status, const char *message);

// Server-Sent Events: 200 with Content-Type text/event-stream, Cache-Control
// no-cache, no Content-Length, chunked (HTTP/1.1; HTTP/1.0 clients get the raw
// stream and a closed connection). Each event is written as one chunk.
int tdm_http_sse_start(struct tdm_http_conn *c);
// Writes "data: <json>\n\n". TDM_ECLOSED when the client is gone (then every
// later write fails fast too), TDM_EINVAL when the stream was not started.
int tdm_http_sse_event(struct tdm_http_conn *c, const char *json, size_t len);
// Writes the comment line ": <text>\n\n" (a keep-alive; also probes the client).
int tdm_http_sse_comment(struct tdm_http_conn *c, const char *text);
// Ends the stream: "data: [DONE]\n\n" when done is true, then the last chunk.
int tdm_http_sse_end(struct tdm_http_conn *c, bool done);
// True once a write to this client failed (or tdm_http_client_left saw it leave).
bool tdm_http_client_gone(const struct tdm_http_conn *c);
// Probes the client without writing (for a request whose answer is not begun:
// a non-streamed generation): true when it closed its side of the connection
// or reset it, as nginx and uvicorn take a client's end of stream for its
// abort; false while it waits, or when its socket cannot be found. Its first
// call finds the connection's socket (a scan of this process's open files,
// a millisecond among thousands); later ones are one non-blocking peek.
bool tdm_http_client_left(struct tdm_http_conn *c);

// ---- status --------------------------------------------------------------------------------
// The reason phrase for a status ("Not Found"), "Unknown" for others.
const char *tdm_http_reason(int status);

#endif
