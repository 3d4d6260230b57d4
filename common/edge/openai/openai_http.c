// SPDX-License-Identifier: Apache-2.0
// openai_http: what the decode worker and the router answer the same way, over
// common/edge/http's public respond and SSE calls: OpenAI errors, /tokenize,
// /detokenize, and a completions/chat call from its request (errors and
// echo-only answered here) to its stream. The stream is one loop: pump the caller's token source,
// write each choice's news as a chunk, stop at the first failed choice (an error event: the client
// already has a 200) or once all finished, then usage and [DONE]. A failed write means the client
// left; the loop returns at once so that the caller cancels what still generates. Chunks of one
// choice go out in order; choices interleave as their tokens arrive.
#include "openai_http.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "metrics.h"
#include "trace.h"

// The HTTP server counts a request's parse at the bound the request parser
// enforces (http.h's tdm_http_request_memory).
_Static_assert(TDM_HTTP_TREE_PER_BODY_BYTE == TDM_OAI_PARSE_BYTES_PER_BODY_BYTE &&
                   TDM_HTTP_TREE_SLACK == TDM_OAI_PARSE_SLACK,
               "the HTTP memory budget counts the parse bound openai_request enforces");

// ---- errors ----------------------------------------------------------------------------------
char *tdm_oai_http_error_body(int status, const char *message)
{
    return tdm_oai_error_body_from(status, NULL, NULL, message);
}

int tdm_oai_http_error(struct tdm_http_conn *c, const struct tdm_oai_error *e)
{
    if (e->status == 503)
        tdm_http_add_header(c, "Retry-After", "1");
    char *body =
        tdm_oai_error_body_from(e->status, e->type[0] ? e->type : NULL, e->param, e->message);
    if (!body) {
        static const char fallback[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                                       "\"InternalServerError\",\"param\":null,\"code\":500}}";
        return tdm_http_respond(c, 500, "application/json", fallback, sizeof fallback - 1);
    }
    int rc = tdm_http_respond_json(c, e->status, body);
    free(body);
    return rc;
}

int tdm_oai_http_fail(struct tdm_http_conn *c, int err, const char *detail)
{
    struct tdm_oai_error e;
    tdm_oai_error_from_err(&e, err, detail);
    return tdm_oai_http_error(c, &e);
}

int tdm_oai_http_errorf(struct tdm_http_conn *c, int status, const char *param, const char *fmt,
                        ...)
{
    struct tdm_oai_error e;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    tdm_oai_seterr(&e, status, param, "%s", msg);
    return tdm_oai_http_error(c, &e);
}

// ---- the stream ------------------------------------------------------------------------------

// One SSE event from a heap JSON string (freed here): TDM_OK, TDM_ECLOSED when
// the client is gone, TDM_ENOMEM when json is NULL (a failed build).
static int sse_send(struct tdm_http_conn *c, char *json)
{
    if (json == NULL)
        return TDM_ENOMEM;
    int rc = tdm_http_sse_event(c, json, strlen(json));
    free(json);
    return rc == TDM_OK ? TDM_OK : TDM_ECLOSED;
}

static int echo_choice(struct tdm_http_conn *c, struct tdm_oai_call *k, size_t i);

// Writes choice i's pending text (and its finish once known), if any.
static int flush_choice(struct tdm_http_conn *c, struct tdm_oai_call *k, size_t i)
{
    // Echo with logprobs: the prompt's chunk waits for its logprobs, which
    // come with the first token; the choice's text waits for it.
    if (k->req.echo && !k->choices[i].echo_sent) {
        if (!tdm_oai_call_echo_ready(k, i))
            return TDM_OK;
        int rc = echo_choice(c, k, i);
        if (rc != TDM_OK)
            return rc;
    }
    // --stream-interval N: the first token goes out at once (time to first
    // token), later ones N at a time, the rest with the finish.
    const struct tdm_oai_asm *a = &k->choices[i];
    if (k->stream_interval > 1 && !a->done && a->tokens_sent > 0 &&
        a->completion_tokens - a->tokens_sent < k->stream_interval)
        return TDM_OK;
    char *json = NULL;
    bool finish_now = false;
    if (tdm_oai_call_chunk(k, i, &json, &finish_now) != TDM_OK)
        return TDM_ENOMEM;
    if (json == NULL)
        return TDM_OK;
    int rc = sse_send(c, json);
    if (rc == TDM_OK)
        tdm_oai_asm_sent(&k->choices[i], finish_now);
    return rc;
}

// Completions with echo: the prompt's chunk (the generated tokens'
// text_offset counts it).
static int echo_choice(struct tdm_http_conn *c, struct tdm_oai_call *k, size_t i)
{
    char *json = NULL;
    if (tdm_oai_call_echo_chunk(k, i, &json) != TDM_OK)
        return TDM_ENOMEM;
    k->choices[i].echo_sent = true; // also when the prompt's text is empty
    return json ? sse_send(c, json) : TDM_OK;
}

// Choice i's first chunk: chat names the answer's role (then, with echo, the
// final message's content); completions with echo send the prompt text now,
// unless its logprobs are asked for (flush_choice sends it with them).
static int open_choice(struct tdm_http_conn *c, struct tdm_oai_call *k, size_t i)
{
    if (k->req.kind == TDM_OAI_CHAT) {
        int rc = sse_send(c, tdm_oai_chat_role_chunk(&k->resp, k->choices[i].index));
        return rc == TDM_OK && k->req.echo ? echo_choice(c, k, i) : rc;
    }
    if (!k->req.echo || !tdm_oai_call_echo_ready(k, i))
        return TDM_OK;
    return echo_choice(c, k, i);
}

int tdm_oai_http_stream(struct tdm_http_conn *c, struct tdm_oai_call *k, tdm_oai_pump_fn pump,
                        void *arg, double probe_idle_s)
{
    if (tdm_http_sse_start(c) != TDM_OK)
        return TDM_ECLOSED;
    int rc = TDM_OK;
    for (size_t i = 0; i < k->n_choices && rc == TDM_OK; i++)
        rc = open_choice(c, k, i);
    double last_progress = tdm_now();
    while (rc == TDM_OK) {
        for (size_t i = 0; i < k->n_choices && rc == TDM_OK; i++)
            rc = flush_choice(c, k, i);
        if (rc != TDM_OK || tdm_oai_call_done(k) || tdm_oai_call_failed(k))
            break;
        int n = pump(arg);
        if (n < 0) {
            rc = TDM_ENOMEM;
            break;
        }
        double now = tdm_now();
        if (n > 0) {
            last_progress = now;
        } else if (tdm_http_client_gone(c)) {
            rc = TDM_ECLOSED;
        } else if (probe_idle_s > 0 && now - last_progress >= probe_idle_s) {
            // Nothing for a while (queued, or a long prefill): the comment
            // probes the client, so one that left is cancelled before its
            // request is even admitted.
            last_progress = now;
            if (tdm_http_sse_comment(c, "waiting") != TDM_OK)
                rc = TDM_ECLOSED;
        }
    }
    if (rc == TDM_ECLOSED)
        return TDM_ECLOSED;
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(k);
    struct tdm_oai_usage u;
    tdm_oai_call_usage(k, &u);
    struct tdm_oai_error e;
    if (bad)
        tdm_oai_error_from_err(&e, bad->error, bad->message);
    else if (rc == TDM_ENOMEM)
        tdm_oai_error_from_err(&e, TDM_ENOMEM, "out of memory");
    return tdm_oai_http_sse_finish(c, &k->resp, bad || rc == TDM_ENOMEM ? &e : NULL,
                                   k->req.include_usage ? &u : NULL);
}

int tdm_oai_http_collect(struct tdm_http_conn *c, struct tdm_oai_call *k, tdm_oai_pump_fn pump,
                         void *arg, void (*before_answer)(void *arg))
{
    // The client is probed every TDM_OAI_COLLECT_PROBE_S: one that left stops
    // the call's generation instead of letting it run to max_tokens for nobody.
    double next_probe = tdm_now() + TDM_OAI_COLLECT_PROBE_S;
    while (!tdm_oai_call_done(k)) {
        int n = pump(arg);
        if (n < 0) {
            tdm_oai_http_errorf(c, 500, NULL, "out of memory");
            return TDM_ENOMEM;
        }
        double now = tdm_now();
        if (now >= next_probe) {
            next_probe = now + TDM_OAI_COLLECT_PROBE_S;
            if (tdm_http_client_left(c))
                return TDM_ECLOSED;
        }
    }
    if (before_answer)
        before_answer(arg);
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(k);
    if (bad)
        tdm_oai_http_fail(c, bad->error, bad->message);
    else
        tdm_http_respond_json_owned(c, 200, tdm_oai_call_body(k));
    return tdm_http_client_gone(c) ? TDM_ECLOSED : TDM_OK;
}

int tdm_oai_http_sse_finish(struct tdm_http_conn *c, const struct tdm_oai_response *resp,
                            const struct tdm_oai_error *error, const struct tdm_oai_usage *usage)
{
    if (error) {
        char *body = tdm_oai_error_body(error);
        if (body) { // without one (out of memory) the stream still ends
            int rc = tdm_http_sse_event(c, body, strlen(body));
            free(body);
            if (rc != TDM_OK)
                return TDM_ECLOSED;
        }
        return tdm_http_sse_end(c, true) == TDM_OK ? TDM_OK : TDM_ECLOSED;
    }
    if (usage) {
        char *chunk = tdm_oai_usage_chunk(resp, usage);
        int rc = chunk ? tdm_http_sse_event(c, chunk, strlen(chunk)) : TDM_ENOMEM;
        free(chunk);
        if (rc != TDM_OK)
            return TDM_ECLOSED;
    }
    return tdm_http_sse_end(c, true) == TDM_OK ? TDM_OK : TDM_ECLOSED;
}

// completions with echo and max_tokens 0: every choice is its prompt's text
// with finish "length" and usage has no completion tokens, as one body or as a
// stream (chunks, the usage chunk when include_usage, [DONE]).
static void answer_echo_only(struct tdm_http_conn *c, const struct tdm_oai_call *k)
{
    size_t n = k->n_prompts * (size_t)k->req.n;
    struct tdm_oai_choice *oc = calloc(n ? n : 1, sizeof *oc);
    if (oc == NULL) {
        tdm_oai_http_errorf(c, 500, NULL, "out of memory");
        return;
    }
    for (size_t i = 0; i < n; i++) {
        const struct tdm_oai_tokenized_prompt *p = &k->prompts[i / (size_t)k->req.n];
        oc[i].index = (int)i;
        oc[i].text = p->text ? p->text : "";
        oc[i].text_len = p->text_len;
        oc[i].finish = TDM_FINISH_LENGTH;
        oc[i].stop_token = -1;
    }
    struct tdm_oai_usage u = {k->prompt_tokens, 0};
    if (!k->req.stream) {
        tdm_http_respond_json_owned(c, 200, tdm_oai_body(&k->resp, oc, n, &u));
    } else if (tdm_http_sse_start(c) == TDM_OK) {
        int rc = TDM_OK;
        for (size_t i = 0; i < n && rc == TDM_OK; i++)
            rc = sse_send(c, tdm_oai_chunk(&k->resp, &oc[i], 1, NULL));
        if (rc == TDM_OK && k->req.include_usage)
            rc = sse_send(c, tdm_oai_usage_chunk(&k->resp, &u));
        if (rc == TDM_OK)
            tdm_http_sse_end(c, true);
    }
    free(oc);
}

bool tdm_oai_http_call_start(struct tdm_http_conn *c, struct tdm_oai_call *k,
                             enum tdm_oai_kind kind, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                             const char *chat_err)
{
    size_t len = 0;
    const char *body = tdm_http_body(c, &len);
    struct tdm_oai_error e;
    if (tdm_oai_call_init(k, kind, body, len, info, tok, chat, chat_err,
                          tdm_http_header(c, "X-Request-Id"), &e) != TDM_OK) {
        tdm_oai_http_error(c, &e);
        return false;
    }
    if (k->req.echo_only) {
        answer_echo_only(c, k);
        return false;
    }
    return true;
}

int tdm_oai_front_serve(struct tdm_http_server **out, const struct tdm_oai_front_http *f,
                        const struct tdm_oai_front_routes *r, void *arg, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_http_config hc;
    memset(&hc, 0, sizeof hc);
    hc.host = f->host;
    hc.port = f->port;
    hc.num_threads = f->threads;
    hc.max_body_bytes = f->max_body_bytes;
    hc.header_timeout_ms = (int)(f->header_timeout_s * 1000.0);
    hc.body_timeout_ms = (int)(f->body_timeout_s * 1000.0);
    hc.max_conns_per_ip = f->max_conns_per_ip;
    hc.max_large_requests = f->max_large_requests;
    hc.memory_budget = (size_t)f->memory_budget_mib << 20;
    hc.api_key = f->api_key && f->api_key[0] ? f->api_key : NULL;
    hc.error_body = tdm_oai_http_error_body;
    const struct tdm_oai_route api[] = {
        {"GET", "/health", r->health},
        {"GET", "/ping", r->health},
        {"GET", "/metrics", r->metrics},
        {"GET", "/version", r->version},
        {"GET", "/v1/models", r->models},
        {"POST", "/v1/completions", r->completions},
        {"POST", "/v1/chat/completions", r->chat},
        {"POST", "/tokenize", r->tokenize},
        {"POST", "/detokenize", r->detokenize},
    };
    struct tdm_http_server *s;
    int rc = tdm_http_server_new(&s, &hc, err, errlen);
    if (rc != TDM_OK)
        return rc;
    size_t n_api = sizeof api / sizeof api[0];
    for (size_t i = 0; rc == TDM_OK && i < n_api + r->n_extra; i++) {
        const struct tdm_oai_route *rt = i < n_api ? &api[i] : &r->extra[i - n_api];
        rc = rt->fn ? tdm_http_route(s, rt->method, rt->path, rt->fn, arg)
                    : tdm_seterr(err, errlen, TDM_EINVAL, "no handler for %s %s", rt->method,
                                 rt->path);
    }
    if (rc == TDM_OK)
        rc = tdm_http_server_start(s, err, errlen);
    if (rc != TDM_OK) {
        tdm_http_server_free(s);
        return rc;
    }
    *out = s;
    return TDM_OK;
}

void tdm_oai_http_tokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                           const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                           const char *chat_err, int max_model_len)
{
    size_t len = 0;
    const char *body = tdm_http_body(c, &len);
    struct tdm_oai_error e;
    char *out = NULL;
    if (tdm_oai_tokenize_run(body, len, info, tok, chat, chat_err, max_model_len, &out, &e) !=
        TDM_OK)
        tdm_oai_http_error(c, &e);
    else
        tdm_http_respond_json_owned(c, 200, out);
}

void tdm_oai_http_detokenize(struct tdm_http_conn *c, const struct tdm_oai_model_info *info,
                             const struct tdm_tokenizer *tok)
{
    size_t len = 0;
    const char *body = tdm_http_body(c, &len);
    struct tdm_oai_error e;
    char *out = NULL;
    if (tdm_oai_detokenize_run(body, len, info, tok, &out, &e) != TDM_OK)
        tdm_oai_http_error(c, &e);
    else
        tdm_http_respond_json_owned(c, 200, out);
}

void tdm_oai_http_models(struct tdm_http_conn *c, const char *served_name, int max_model_len,
                         int64_t created)
{
    struct tdm_oai_model_card card = {
        .id = served_name,
        .root = served_name,
        .parent = NULL,
        .max_model_len = max_model_len,
        .created = created,
        .owned_by = NULL,
    };
    tdm_http_respond_json_owned(c, 200, tdm_oai_models_body(&card, 1));
}

void tdm_oai_http_metrics(struct tdm_http_conn *c, struct tdm_metrics_registry *reg)
{
    if (reg == NULL) {
        tdm_http_respond(c, 200, TDM_METRICS_CONTENT_TYPE, "", 0);
        return;
    }
    char *text = NULL;
    size_t len = 0;
    if (tdm_metrics_render(reg, &text, &len) != TDM_OK) {
        tdm_oai_http_errorf(c, 500, NULL, "metrics rendering failed");
        return;
    }
    tdm_http_respond(c, 200, TDM_METRICS_CONTENT_TYPE, text, len);
    free(text);
}

void tdm_oai_http_version(struct tdm_http_conn *c, const char *version)
{
    tdm_http_respond_json_owned(c, 200, tdm_oai_version_body(version));
}

// ---- tracing -------------------------------------------------------------------------------
bool tdm_oai_http_trace_ctx(const struct tdm_http_conn *c, struct tdm_trace_ctx *out)
{
    return tdm_trace_ctx_from_headers(tdm_http_header(c, "traceparent"),
                                      tdm_http_header(c, "tracestate"), out);
}

void tdm_oai_http_trace_status(struct tdm_span *sp, const struct tdm_http_conn *c)
{
    int status = tdm_http_status(c);
    if (!sp->recording || status == 0)
        return;
    tdm_span_attr_int(sp, "http.response.status_code", status);
    if (status >= 500 && sp->status != 2) {
        char msg[32];
        snprintf(msg, sizeof msg, "HTTP %d", status);
        tdm_span_error(sp, msg);
    }
}

void tdm_oai_trace_attrs(struct tdm_span *sp, const struct tdm_oai_call *k)
{
    if (!sp->recording)
        return;
    tdm_span_attr_str(sp, "gen_ai.request.id", k->resp.id);
    if (k->resp.model)
        tdm_span_attr_str(sp, "gen_ai.response.model", k->resp.model);
    if (k->n_prompts > 0)
        tdm_span_attr_int(sp, "gen_ai.request.max_tokens", k->prompts[0].max_tokens);
    tdm_span_attr_int(sp, "gen_ai.request.n", k->req.n);
    tdm_span_attr_double(sp, "gen_ai.request.temperature", k->req.sampling.temperature);
    tdm_span_attr_double(sp, "gen_ai.request.top_p", k->req.sampling.top_p);
    struct tdm_oai_usage u;
    tdm_oai_call_usage(k, &u);
    tdm_span_attr_int(sp, "gen_ai.usage.prompt_tokens", u.prompt_tokens);
    tdm_span_attr_int(sp, "gen_ai.usage.completion_tokens", u.completion_tokens);
    if (k->n_choices > 0 && k->choices[0].finish != TDM_FINISH_NONE)
        tdm_span_attr_str(sp, "tandem.finish_reason", tdm_finish_name(k->choices[0].finish));
}
