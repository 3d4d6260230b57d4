// SPDX-License-Identifier: Apache-2.0
// router: tandem-router's server (see router.h): its lifecycle (text side,
// metrics, control plane, nng inbox and poller, the OpenAI front) and the
// routes other than generation. The request path is router_call.c, the nng
// side router_inbox.c, the flags router_opts.c (router_impl.h ties them).
//
// The OpenAI response shaping (detokenization, stop strings, logprobs, echo,
// usage, SSE) is the decode worker's own (common/edge/openai's tdm_oai_call,
// common/edge/openai's tdm_oai_http_stream) so that text through the router equals
// text from the decode worker alone.
#include "router.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "control.h"
#include "core.h"
#include "http.h"
#include "metrics.h"
#include "openai_http.h"
#include "router_impl.h"
#include "text.h"
#include "trace.h"
#include "transport.h"

#define MOD "router"

int tdm_router_server_port(const struct tdm_router_server *s)
{
    return tdm_http_server_port(s->http);
}

const char *tdm_router_server_nng_url(const struct tdm_router_server *s)
{
    return tdm_net_inbox_url(s->inbox);
}

int tdm_router_server_reload(struct tdm_router_server *s, char *err, size_t errlen)
{
    return tdm_router_control_reload(s->ctl, err, errlen);
}

// ---- other routes ---------------------------------------------------------------------------
static void on_health(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    size_t total = 0, healthy = 0;
    tdm_router_endpoints_count(tdm_router_control_endpoints(s->ctl), true, &total, &healthy);
    if (atomic_load(&s->draining) || atomic_load(&s->stopping))
        tdm_oai_http_errorf(c, 503, NULL, "The server is draining.");
    else if (healthy > 0)
        tdm_http_respond(c, 200, "application/json", "", 0);
    else if (tdm_router_endpoints_count_auth_failed(tdm_router_control_endpoints(s->ctl)))
        tdm_oai_http_errorf(c, 503, NULL,
                            "no healthy decode worker (%zu configured; some refuse the router's "
                            "control-plane handshake: start them with this router's "
                            "TANDEM_INTERNAL_SECRET)",
                            total);
    else
        tdm_oai_http_errorf(c, 503, NULL, "no healthy decode worker (%zu configured)", total);
}

static void on_metrics(struct tdm_http_conn *c, void *arg)
{
    tdm_oai_http_metrics(c, ((struct tdm_router_server *)arg)->reg);
}

static void on_version(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_version(c, TANDEM_VERSION);
}

static void on_models(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_models(c, s->text.served_name, s->max_model_len, s->created);
}

static void on_router_config(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_http_respond_json_owned(c, 200, tdm_router_control_config_json(s->ctl));
}

// Admits a generation request unless the server drains; counted in inflight
// so that the drain can wait for it.
static void generate_counted(struct tdm_router_server *s, struct tdm_http_conn *c,
                             enum tdm_oai_kind kind)
{
    atomic_fetch_add(&s->inflight, 1);
    if (atomic_load(&s->draining))
        tdm_oai_http_fail(c, TDM_ECLOSED, "The server is draining.");
    else
        router_handle_generate(s, c, kind);
    atomic_fetch_sub(&s->inflight, 1);
}

static void on_completions(struct tdm_http_conn *c, void *arg)
{
    generate_counted(arg, c, TDM_OAI_COMPLETION);
}

static void on_chat(struct tdm_http_conn *c, void *arg)
{
    generate_counted(arg, c, TDM_OAI_CHAT);
}

int tdm_router_server_drain(struct tdm_router_server *s, double timeout_s)
{
    atomic_store(&s->draining, true);
    double deadline = tdm_now() + (timeout_s > 0 ? timeout_s : 0);
    int left = 0;
    while ((left = atomic_load(&s->inflight)) > 0 && tdm_now() < deadline) {
        struct timespec ts = {0, 20 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (left > 0) {
        TDM_LOG_WARN(MOD, "drain: %d request(s) still open after %g s; ending them", left,
                     timeout_s);
        // The pumps see stopping and end their streams with an error event and
        // [DONE] (and cancel upstream) while the connections are still open;
        // the server stops only after that (or 2 s), never mid-event.
        // Requests still waiting in flow control leave with a 503.
        atomic_store(&s->stopping, true);
        tdm_router_control_stop_flow(s->ctl);
        double end = tdm_now() + 2.0;
        while (atomic_load(&s->inflight) > 0 && tdm_now() < end) {
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    return left > 0 ? TDM_ETIMEDOUT : TDM_OK;
}

static void on_tokenize(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_tokenize(c, &s->info, s->text.tok, s->text.chat, s->text.chat_err,
                          s->max_model_len);
}

static void on_detokenize(struct tdm_http_conn *c, void *arg)
{
    struct tdm_router_server *s = arg;
    tdm_oai_http_detokenize(c, &s->info, s->text.tok);
}

// ---- lifecycle ---------------------------------------------------------------------------------
// The text side as the workers load it (common/text): a folder or an ORG/NAME
// Hub id (resolved through the HF cache), the same served name and template.
static int load_text_side(struct tdm_router_server *s, char *err, size_t errlen)
{
    int rc = tdm_text_resolve(s->o.model, NULL, s->model_path, sizeof s->model_path, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_text_config tc = {
        .model = s->o.model,
        .model_path = s->model_path,
        .served_model_name = s->o.served_model_name,
        .chat_template = s->o.chat_template,
        .log_module = MOD,
    };
    rc = tdm_text_load(&s->text, &tc, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_model_config mc;
    rc = tdm_hf_config_load(&mc, s->model_path, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_text_context_len(s->o.max_model_len, mc.max_position_embeddings, &s->max_model_len,
                                  err, errlen);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_oai_tool_parser_config(s->o.enable_auto_tool_choice, s->o.tool_call_parser,
                                    &s->info.tool_parser, err, errlen);
    if (rc != TDM_OK)
        return rc;
    s->info.return_tokens_as_token_ids = s->o.return_tokens_as_token_ids;
    s->info.default_chat_template_kwargs =
        s->o.default_chat_template_kwargs[0] ? s->o.default_chat_template_kwargs : NULL;
    s->info.trust_request_chat_template = s->o.trust_request_chat_template;
    s->info.limit_logprobs = true;
    s->info.max_logprobs = s->o.max_logprobs;
    s->info.served_name = s->text.served_name;
    s->info.vocab_size = mc.vocab_size;
    s->info.max_model_len = s->max_model_len;
    s->info.gen = &s->text.gen;
    return TDM_OK;
}

static int register_metrics(struct tdm_router_server *s, char *err, size_t errlen)
{
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    static const char *const labels[] = {"decision", "endpoint"};
    o.name = "tandem:router_requests_by_decision_total";
    o.help = "Requests sent upstream by P/D decision and decode endpoint.";
    o.label_names = labels;
    o.n_label_names = 2;
    int rc = tdm_metrics_counter_register(&s->m_requests_by, s->reg, &o, err, errlen);
    o.label_names = NULL;
    o.n_label_names = 0;
    o.name = "tandem:router_decode_lost_total";
    o.help = "Requests whose decode worker was lost mid-request (error sent to the client).";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&s->m_lost, s->reg, &o, err, errlen);
    o.name = "tandem:router_stream_migrations_total";
    o.help = "Times a request's streams continued on another decode worker after theirs was "
             "lost (--stream-migration; at most 2 per request).";
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&s->m_migrations, s->reg, &o, err, errlen);
    return rc;
}

int tdm_router_server_new(struct tdm_router_server **out, const struct tdm_router_opts *o,
                          char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_router_server *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    s->o = *o;
    s->instance = tdm_net_new_instance_id();
    s->created = (int64_t)time(NULL);
    pthread_mutex_init(&s->mu, NULL);
    int rc = load_text_side(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_metrics_registry_new(&s->reg, NULL, 0, err, errlen);
    if (rc == TDM_OK)
        rc = register_metrics(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_router_control_new(&s->ctl, o->config, s->reg, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    s->rm = tdm_router_control_metrics(s->ctl);
    const char *otlp = tdm_tracer_endpoint_from_env(o->otlp_traces_endpoint);
    if (otlp) {
        struct tdm_tracer_config tc = {.endpoint = otlp,
                                       .service_name = tdm_tracer_service_name("tandem-router")};
        rc = tdm_tracer_new(&s->tracer, &tc, s->reg, err, errlen);
        if (rc != TDM_OK)
            goto fail;
    }
    rc = tdm_net_outbox_new(&s->outbox, 100, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_net_outbox_new(&s->poll_outbox, 100, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_net_inbox_new(&s->inbox, o->nng_url, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    // Frames are handled on the inbox's connection readers: a TokenChunk goes
    // from the socket into its stream's queue and wakes the request's thread,
    // with no inbox thread between (docs/pd-protocol.md, router overhead).
    tdm_net_inbox_handle_on_readers(s->inbox, router_on_frame, s);
    rc = tdm_router_control_start(s->ctl, o->watch, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    if (pthread_create(&s->poll_thread, NULL, router_poll_main, s) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "cannot start the load poller");
        goto fail;
    }
    s->poll_started = true;

    static const struct tdm_oai_route own[] = {
        {"GET", "/v1/router/config", on_router_config},
    };
    static const struct tdm_oai_front_routes routes = {
        TDM_OAI_FRONT_HANDLERS(on_),
        .extra = own,
        .n_extra = sizeof own / sizeof own[0],
    };
    struct tdm_oai_front_http fh = TDM_OAI_FRONT_HTTP(o, o->http_threads);
    rc = tdm_oai_front_serve(&s->http, &fh, &routes, s, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    *out = s;
    return TDM_OK;
fail:
    tdm_router_server_free(s);
    return rc;
}

void tdm_router_server_free(struct tdm_router_server *s)
{
    if (s == NULL)
        return;
    atomic_store(&s->stopping, true);
    if (s->ctl)
        tdm_router_control_stop_flow(s->ctl); // waiting requests leave (503)
    if (s->http) {
        tdm_http_server_stop(s->http); // handlers return; their calls cancel upstream
        tdm_http_server_free(s->http);
    }
    if (s->poll_started)
        pthread_join(s->poll_thread, NULL);
    if (s->inbox)
        tdm_net_inbox_close(s->inbox);
    tdm_router_control_free(s->ctl);
    tdm_tracer_free(s->tracer); // after the HTTP threads: their last spans are flushed
    tdm_net_inbox_free(s->inbox);
    tdm_net_outbox_free(s->outbox);
    tdm_net_outbox_free(s->poll_outbox);
    tdm_metrics_registry_free(s->reg);
    tdm_text_fini(&s->text);
    for (size_t b = 0; b < STREAM_BUCKETS; b++)
        while (s->streams[b])
            router_stream_unregister(s, s->streams[b]);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
