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
// The OpenAI routes both servers share (tokenize, detokenize, a completions or
// chat call from its body to its SSE stream) sit on top (http_oai.c).
// Each request runs on one of num_threads civetweb worker threads, from the
// handler call to its return; a connection handle is used by that thread only.
// civetweb types never appear here.
#ifndef TDM_HTTP_H
#define TDM_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "openai.h"

struct tdm_http_config {
    const char *host;               // address to bind: "127.0.0.1", "0.0.0.0"; NULL = "0.0.0.0"
    int port;                       // 0 = an ephemeral port (see tdm_http_server_port)
    int num_threads;                // worker threads = concurrent requests (streams hold one
                                    // each); <= 0 = 64
    size_t max_body_bytes;          // request body limit; 0 = 16 MiB
    const char *api_key;            // NULL or "" = no key required
    const char *const *auth_exempt; // NULL-terminated exact paths served without the key;
                                    // NULL = {"/health", "/metrics", "/ping", "/version"}
    int request_timeout_ms;         // socket read/write timeout; <= 0 = 600000
};

struct tdm_http_server;
struct tdm_http_conn; // one request being handled (opaque)

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
// An OpenAI error body {"error":{"message","type","param","code"}}; type NULL = the
// type for status, param NULL = null. A 503 (queue full, draining, loading)
// carries "Retry-After: 1".
int tdm_http_respond_error(struct tdm_http_conn *c, int status, const char *type, const char *param,
                           const char *message);
int tdm_http_respond_oai_error(struct tdm_http_conn *c, const struct tdm_oai_error *e);
// tdm_http_respond_error with the type for status and a printf-style message.
int tdm_http_respond_errorf(struct tdm_http_conn *c, int status, const char *param,
                            const char *fmt, ...) __attribute__((format(printf, 4, 5)));

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
// Ends an OpenAI stream. With error_message: an error event (500 with that
// message) then [DONE]; otherwise the usage chunk when usage != NULL (a failure
// there ends nothing more) then [DONE]. TDM_OK, or TDM_ECLOSED when the client
// is gone (or the usage chunk could not be built).
int tdm_http_sse_finish_oai(struct tdm_http_conn *c, const struct tdm_oai_response *resp,
                            const char *error_message, const struct tdm_oai_usage *usage);
// True once a write to this client failed.
bool tdm_http_client_gone(const struct tdm_http_conn *c);

// ---- OpenAI routes (http_oai.c) --------------------------------------------------------------
// What the decode worker and the router answer the same way, over common/openai:
// /tokenize and /detokenize, and a completions/chat call (struct tdm_oai_call)
// from its request to its stream; where the tokens come from is the caller's
// pump.

// POST /tokenize and /detokenize: the request body through tdm_oai_tokenize_run
// / tdm_oai_detokenize_run, answered with the body or the OpenAI error.
void tdm_http_oai_tokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                           const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                           const char *chat_err, int max_model_len);
void tdm_http_oai_detokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok);
// Starts a completions (kind TDM_OAI_COMPLETION) or chat call from the request
// body and its X-Request-Id header (the response id when the body has no
// request_id): tdm_oai_call_init into k. Answers by itself a rejected request
// (its OpenAI error) and completions with echo and max_tokens 0 (each choice
// its prompt's text, finish "length", as one body or a stream). Returns true
// when the call's choices are to be generated, false when the request was
// answered here. Free k with tdm_oai_call_fini either way.
bool tdm_http_oai_call_start(struct tdm_http_conn *c, struct tdm_oai_call *k,
                             enum tdm_oai_kind kind, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                             const char *chat_err);
// Moves the tokens that arrived into the call's choices (tdm_oai_asm_token,
// _finish, _fail), waiting a little when none did, and stops the generator of
// a choice that a stop string ended. Returns how many choices progressed (0:
// nothing in the wait), or a negative value on ENOMEM.
typedef int (*tdm_http_oai_pump_fn)(void *arg);
// Streams a call whose generators run: starts the SSE response (headers added
// before go out with it), writes each choice's opening chunk (chat: the
// assistant role; completions with echo: the prompt text), then pumps and
// writes each choice's news (tdm_oai_call_chunk) until every choice finished or
// one failed, and ends with tdm_http_sse_finish_oai (the failed choice's
// message as an error event, or the usage chunk when include_usage; [DONE]).
// probe_idle_s > 0: after that long without progress an SSE comment probes the
// client, so one that left is noticed while nothing is generated; 0: never.
// TDM_OK, or TDM_ECLOSED when the client is gone (the caller stops what still
// runs).
int tdm_http_oai_stream(struct tdm_http_conn *c, struct tdm_oai_call *k, tdm_http_oai_pump_fn pump,
                        void *arg, double probe_idle_s);

// ---- errors ----------------------------------------------------------------------------------
// The HTTP status for an enum tdm_err (the one mapping every server uses): OK 200,
// EINVAL 400, ENOTFOUND 404, EBUSY 429, ECAPACITY/ECLOSED 503, ETIMEDOUT 504,
// EPROTO/ETRANSPORT 502, ENOMEM/EBACKEND/EIO and anything else 500.
int tdm_http_status_for_err(int err);
// The reason phrase for a status ("Not Found"), "Unknown" for others.
const char *tdm_http_reason(int status);

#endif
