// SPDX-License-Identifier: Apache-2.0
// openai_http: the OpenAI API over common/edge/http, as the decode worker and the
// router both answer it: OpenAI error answers (the body of the server's own
// errors too, as its error_body hook), /tokenize and /detokenize, and a
// completions or chat call (struct tdm_oai_call) from its request to its SSE
// stream or body. Where the tokens come from is the caller's pump; this module
// turns them into chunks. It sits above common/edge/http, which knows nothing of
// OpenAI. Functions run on the request's HTTP worker thread and use only that
// request's connection.
#ifndef TDM_OPENAI_HTTP_H
#define TDM_OPENAI_HTTP_H

#include <stdbool.h>

#include "http.h"
#include "openai.h"

// ---- errors ----------------------------------------------------------------------------------
// The tdm_http_config.error_body hook: the OpenAI error body for status and
// message (the type for status, param null). Heap JSON, NULL on ENOMEM.
char *tdm_oai_http_error_body(int status, const char *message);
// Answers the OpenAI error e (a 503, the server being overloaded, loading or
// draining, carries "Retry-After: 1"). TDM_ECLOSED when the client is gone,
// TDM_EINVAL when already answered.
int tdm_oai_http_error(struct tdm_http_conn *c, const struct tdm_oai_error *e);
// Answers the failure err with detail as every server does
// (tdm_oai_error_from_err, then tdm_oai_http_error).
int tdm_oai_http_fail(struct tdm_http_conn *c, int err, const char *detail);
// Same with the type for status and a printf-style message.
int tdm_oai_http_errorf(struct tdm_http_conn *c, int status, const char *param, const char *fmt,
                        ...) __attribute__((format(printf, 4, 5)));

// ---- the server front ------------------------------------------------------------------------
// Every Tandem server (the router, the decode and the prefill worker) answers
// the same OpenAI API on one civetweb server, set up from the same flags
// (openai_front.h) with the OpenAI error body: tdm_oai_front_serve builds it.
struct tdm_oai_route {
    const char *method, *path;
    tdm_http_handler_fn fn;
};
struct tdm_oai_front_routes {
    tdm_http_handler_fn health;               // GET /health and GET /ping
    tdm_http_handler_fn metrics;              // GET /metrics
    tdm_http_handler_fn version;              // GET /version
    tdm_http_handler_fn models;               // GET /v1/models
    tdm_http_handler_fn completions, chat;    // POST /v1/completions, /v1/chat/completions
    tdm_http_handler_fn tokenize, detokenize; // POST /tokenize, /detokenize
    const struct tdm_oai_route *extra;        // the server's own routes beside these
    size_t n_extra;
};
// The API's handlers of a server that names them on_health, on_metrics, ...
// on_detokenize (every Tandem server does): { TDM_OAI_FRONT_HANDLERS(on_) } or,
// with routes of its own, { TDM_OAI_FRONT_HANDLERS(on_), .extra = ..., .n_extra = ... }.
#define TDM_OAI_FRONT_HANDLERS(p)                                                                  \
    .health = p##health, .metrics = p##metrics, .version = p##version, .models = p##models,        \
    .completions = p##completions, .chat = p##chat, .tokenize = p##tokenize,                       \
    .detokenize = p##detokenize
// The HTTP settings the front's flags give (TDM_OAI_FRONT_HTTP).
struct tdm_oai_front_http {
    const char *host;
    int port;
    int threads; // worker threads = requests at once
    size_t max_body_bytes;
    double header_timeout_s, body_timeout_s;
    int max_conns_per_ip, max_large_requests, memory_budget_mib;
    const char *api_key; // "" = none
};
// The settings of an options struct o holding the front's flags
// (TDM_OAI_FRONT_FLAGS), with threads worker threads.
#define TDM_OAI_FRONT_HTTP(o, nthreads)                                                            \
    ((struct tdm_oai_front_http){.host = (o)->host,                                                \
                                 .port = (o)->port,                                                \
                                 .threads = (nthreads),                                            \
                                 .max_body_bytes = (o)->max_body_bytes,                            \
                                 .header_timeout_s = (o)->http_header_timeout,                     \
                                 .body_timeout_s = (o)->http_body_timeout,                         \
                                 .max_conns_per_ip = (o)->http_max_conns_per_ip,                   \
                                 .max_large_requests = (o)->max_large_requests,                    \
                                 .memory_budget_mib = (o)->http_memory_budget_mib,                 \
                                 .api_key = (o)->api_key})
// Creates the server with f's settings, registers r's routes (every handler
// gets arg) and starts it. TDM_OK with *out set, or the error with err filled
// and *out NULL (nothing left to free): a port in use names --port.
int tdm_oai_front_serve(struct tdm_http_server **out, const struct tdm_oai_front_http *f,
                        const struct tdm_oai_front_routes *r, void *arg, char *err, size_t errlen);

// ---- routes ----------------------------------------------------------------------------------
// POST /tokenize and /detokenize: the request body through tdm_oai_tokenize_run
// / tdm_oai_detokenize_run, answered with the body or the OpenAI error.
void tdm_oai_http_tokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                           const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                           const char *chat_err, int max_model_len);
void tdm_oai_http_detokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok);
// GET /v1/models: the one model the server serves. Its root is the served
// name (what vLLM shows for a Hub id), never the local folder it was loaded
// from: a path on the server is not the client's business (issue 11).
void tdm_oai_http_models(struct tdm_http_conn *c, const char *served_name, int max_model_len,
                         int64_t created);
// GET /metrics: reg's Prometheus text; an empty 200 while reg is NULL (a
// worker still loading). 500 when rendering fails.
struct tdm_metrics_registry;
void tdm_oai_http_metrics(struct tdm_http_conn *c, struct tdm_metrics_registry *reg);
// GET /version: {"version": version}.
void tdm_oai_http_version(struct tdm_http_conn *c, const char *version);

// ---- one completions or chat call -------------------------------------------------------------
// Starts a completions (kind TDM_OAI_COMPLETION) or chat call from the request
// body and its X-Request-Id header (the response id when the body has no
// request_id): tdm_oai_call_init into k. Answers by itself a rejected request
// (its OpenAI error) and completions with echo and max_tokens 0 (each choice
// its prompt's text, finish "length", as one body or a stream). Returns true
// when the call's choices are to be generated, false when the request was
// answered here. Free k with tdm_oai_call_fini either way.
bool tdm_oai_http_call_start(struct tdm_http_conn *c, struct tdm_oai_call *k,
                             enum tdm_oai_kind kind, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                             const char *chat_err);
// Moves the tokens that arrived into the call's choices (tdm_oai_asm_token,
// _finish, _fail), waiting a little when none did, and stops the generator of
// a choice that a stop string ended. Returns how many choices progressed (0:
// nothing in the wait), or a negative value on ENOMEM.
typedef int (*tdm_oai_pump_fn)(void *arg);
// Streams a call whose generators run: starts the SSE response (headers added
// before go out with it), writes each choice's opening chunk (chat: the
// assistant role; completions with echo: the prompt text), then pumps and
// writes each choice's news (tdm_oai_call_chunk; k->stream_interval tokens at a
// time after the first when it is above 1) until every choice finished or
// one failed, and ends with tdm_oai_http_sse_finish (the failed choice's
// error, tdm_oai_error_from_err of its code and message, as an error event, or
// the usage chunk when include_usage; [DONE]).
// probe_idle_s > 0: after that long without progress an SSE comment probes the
// client, so one that left is noticed while nothing is generated; 0: never.
// TDM_OK, or TDM_ECLOSED when the client is gone (the caller stops what still
// runs).
int tdm_oai_http_stream(struct tdm_http_conn *c, struct tdm_oai_call *k, tdm_oai_pump_fn pump,
                        void *arg, double probe_idle_s);
// Runs a call that is not streamed to its end: pumps until every choice
// finished, probing the client every TDM_OAI_COLLECT_PROBE_S seconds without
// writing (tdm_http_client_left); one that left ends the call unanswered
// (TDM_ECLOSED: the caller stops what still runs). Then before_answer(arg) (NULL: none; e.g.
// headers that need the finished call), and the answer: the call's body, or the first failed
// choice's error (tdm_oai_http_fail). TDM_OK once answered (TDM_ECLOSED when
// the client was gone by then), TDM_ENOMEM when a pump ran out of memory
// (answered 500).
#define TDM_OAI_COLLECT_PROBE_S 0.25
int tdm_oai_http_collect(struct tdm_http_conn *c, struct tdm_oai_call *k, tdm_oai_pump_fn pump,
                         void *arg, void (*before_answer)(void *arg));
// Ends an OpenAI stream. With error: that error's body as an event (the client
// already has a 200; the body is the one a request not yet answered would get)
// then [DONE]; otherwise the usage chunk when usage != NULL (a failure there
// ends nothing more) then [DONE]. TDM_OK, or TDM_ECLOSED when the client is
// gone (or the usage chunk could not be built).
int tdm_oai_http_sse_finish(struct tdm_http_conn *c, const struct tdm_oai_response *resp,
                            const struct tdm_oai_error *error, const struct tdm_oai_usage *usage);

// ---- tracing (common/obs/trace, docs/observability.md) ------------------------------------------
struct tdm_span;
struct tdm_trace_ctx;
// The request's W3C trace context from its traceparent and tracestate headers;
// a missing or malformed traceparent starts a new trace (tracestate dropped).
// True when the client sent a valid one.
bool tdm_oai_http_trace_ctx(const struct tdm_http_conn *c, struct tdm_trace_ctx *out);
// The attributes vLLM puts on its llm_request span, from a call: gen_ai.request.id,
// gen_ai.response.model, gen_ai.request.max_tokens (prompt 0's resolved value),
// gen_ai.request.n, gen_ai.request.temperature, gen_ai.request.top_p, and the
// usage so far (gen_ai.usage.prompt_tokens, gen_ai.usage.completion_tokens),
// and choice 0's finish (tandem.finish_reason: stop, length, abort, error).
void tdm_oai_trace_attrs(struct tdm_span *sp, const struct tdm_oai_call *k);
// The answer's status as http.response.status_code (OpenTelemetry's HTTP
// convention: a server span is an error for 5xx only; 4xx is the client's).
void tdm_oai_http_trace_status(struct tdm_span *sp, const struct tdm_http_conn *c);

#endif
