// SPDX-License-Identifier: Apache-2.0
// router metrics: registers the router's series (names and the llm-d
// equivalents are listed in docs/router-config.md) and small helpers that look
// up a per-endpoint child and update it. Children are created on first use and
// kept by the registry, so a removed endpoint's series stay (its health gauge
// is set to 0 when it goes).
#include "router_metrics.h"

#include <string.h>

#include "core.h"

#define REG_COUNTER(field, nm, hl, labels)                                                         \
    do {                                                                                           \
        struct tdm_metrics_opts o = {.name = (nm), .help = (hl)};                                  \
        o.label_names = (labels);                                                                  \
        o.n_label_names = count_labels(labels);                                                    \
        if ((rc = tdm_metrics_counter_register(&m->field, reg, &o, err, errlen)))                  \
            return rc;                                                                             \
    } while (0)

static size_t count_labels(const char *const *l)
{
    size_t n = 0;
    while (l && l[n])
        n++;
    return n;
}

int tdm_router_metrics_register(struct tdm_router_metrics *m, struct tdm_metrics_registry *reg,
                                char *err, size_t errlen)
{
    static const char *const l_decision[] = {"decision_type", NULL};
    static const char *const l_status[] = {"status", NULL};
    static const char *const l_ep_role[] = {"endpoint", "role", NULL};
    static const char *const l_ep_role_kind[] = {"endpoint", "role", "kind", NULL};
    static const char *const l_ep_role_reason[] = {"endpoint", "role", "reason", NULL};
    static const char *const l_role[] = {"role", NULL};
    static const char *const l_result[] = {"result", NULL};
    int rc;
    memset(m, 0, sizeof *m);
    m->reg = reg;
    if (!reg)
        return tdm_seterr(err, errlen, TDM_EINVAL, "router metrics: no registry");

    REG_COUNTER(pd_decision, "tandem:router_pd_decision_total",
                "Routing decisions by type (llm-d: llm_d_epp_disagg_decision_total).", l_decision);
    m->pd_decision_by[0] = tdm_metrics_counter_labels(m->pd_decision, "decode-only");
    m->pd_decision_by[1] = tdm_metrics_counter_labels(m->pd_decision, "prefill-decode");
    REG_COUNTER(requests, "tandem:router_requests_total",
                "Requests the router finished, by status (success, error, cancelled, "
                "no_endpoint).",
                l_status);
    static const char *const statuses[] = {"success", "error", "cancelled", "no_endpoint"};
    for (size_t i = 0; i < 4; i++)
        (void)tdm_metrics_counter_labels(m->requests, statuses[i]);
    REG_COUNTER(endpoint_picks, "tandem:router_endpoint_picks_total",
                "Requests sent to an endpoint, by the role it was picked for (a pick whose "
                "send failed counts in tandem:router_endpoint_fallbacks_total instead).",
                l_ep_role);
    REG_COUNTER(endpoint_fallbacks, "tandem:router_endpoint_fallbacks_total",
                "Requests routed to an endpoint that could not be sent there (no connection, "
                "or its control-plane handshake failed) and went to another endpoint or "
                "failed.",
                l_ep_role);
    REG_COUNTER(upstream_errors, "tandem:router_upstream_errors_total",
                "Failed upstream calls by endpoint and kind (error, timeout).", l_ep_role_kind);
    REG_COUNTER(retries, "tandem:router_retries_total",
                "Requests retried away from an endpoint after it failed.", l_ep_role);
    REG_COUNTER(prefill_fallback, "tandem:router_prefill_fallback_total",
                "Remote prefill given up (retries exhausted): the decode worker prefilled "
                "locally.",
                NULL);

    struct tdm_metrics_opts go = {.name = "tandem:router_endpoint_healthy",
                                  .help = "1 when the endpoint passes health checks, else 0.",
                                  .label_names = l_ep_role,
                                  .n_label_names = 2};
    if ((rc = tdm_metrics_gauge_register(&m->endpoint_healthy, reg, &go, err, errlen)))
        return rc;
    go = (struct tdm_metrics_opts){
        .name = "tandem:router_endpoint_unhealthy_reason",
        .help = "1 for why the endpoint is not healthy: auth (its nng inbox refuses the router's "
                "handshake: another TANDEM_INTERNAL_SECRET), starting (no check answered yet), "
                "health_check (its checks fail); all 0 while healthy.",
        .label_names = l_ep_role_reason,
        .n_label_names = 3};
    if ((rc = tdm_metrics_gauge_register(&m->endpoint_unhealthy, reg, &go, err, errlen)))
        return rc;
    go = (struct tdm_metrics_opts){.name = "tandem:router_ready_endpoints",
                                   .help = "Healthy endpoints that take new requests, by role.",
                                   .label_names = l_role,
                                   .n_label_names = 1};
    if ((rc = tdm_metrics_gauge_register(&m->ready_endpoints, reg, &go, err, errlen)))
        return rc;
    m->ready_prefill = tdm_metrics_gauge_labels(m->ready_endpoints, "prefill");
    m->ready_decode = tdm_metrics_gauge_labels(m->ready_endpoints, "decode");
    go = (struct tdm_metrics_opts){.name = "tandem:router_inflight_requests",
                                   .help = "Requests the router is handling now."};
    if ((rc = tdm_metrics_gauge_register(&m->inflight, reg, &go, err, errlen)))
        return rc;

    size_t nb;
    const double *b = tdm_metrics_buckets_ttft(&nb);
    struct tdm_metrics_opts ho = {.name = "tandem:router_time_to_first_token_seconds",
                                  .help = "Router-side time to first token (request received to "
                                          "first token written)."};
    if ((rc = tdm_metrics_histogram_register(&m->ttft, reg, &ho, b, nb, err, errlen)))
        return rc;
    b = tdm_metrics_buckets_itl(&nb);
    ho = (struct tdm_metrics_opts){.name = "tandem:router_inter_token_latency_seconds",
                                   .help = "Router-side time between streamed tokens."};
    if ((rc = tdm_metrics_histogram_register(&m->itl, reg, &ho, b, nb, err, errlen)))
        return rc;
    b = tdm_metrics_buckets_request_latency(&nb);
    ho = (struct tdm_metrics_opts){.name = "tandem:router_e2e_request_latency_seconds",
                                   .help = "Router-side end-to-end request latency."};
    if ((rc = tdm_metrics_histogram_register(&m->e2e, reg, &ho, b, nb, err, errlen)))
        return rc;
    b = tdm_metrics_buckets_ttft(&nb);
    ho = (struct tdm_metrics_opts){.name = "tandem:router_kv_transfer_seconds",
                                   .help = "Whole KV transfer of a disaggregated request: first "
                                           "KV frame received to last layer installed on the "
                                           "decode worker (overlaps the prefill)."};
    if ((rc = tdm_metrics_histogram_register(&m->kv_transfer, reg, &ho, b, nb, err, errlen)))
        return rc;
    ho = (struct tdm_metrics_opts){.name = "tandem:router_kv_transfer_exposed_seconds",
                                   .help = "The part of the KV transfer the request waited for: "
                                           "prefill result received to last layer installed "
                                           "(0 when every frame came first)."};
    if ((rc = tdm_metrics_histogram_register(&m->kv_transfer_exposed, reg, &ho, b, nb, err,
                                             errlen)))
        return rc;
    static const double sched_bounds[] = {0.00001, 0.00005, 0.0001, 0.0005, 0.001,
                                          0.005,   0.01,    0.05,   0.1};
    ho = (struct tdm_metrics_opts){.name = "tandem:router_scheduling_seconds",
                                   .help = "Time to pick endpoints for a request (llm-d: "
                                           "llm_d_epp_scheduler_e2e_duration_seconds)."};
    if ((rc = tdm_metrics_histogram_register(&m->routing, reg, &ho, sched_bounds,
                                             sizeof sched_bounds / sizeof *sched_bounds, err,
                                             errlen)))
        return rc;

    REG_COUNTER(config_reload, "tandem:router_config_reload_total",
                "Config reloads by result (success, failure: old config kept).", l_result);
    m->config_reload_success = tdm_metrics_counter_labels(m->config_reload, "success");
    m->config_reload_failure = tdm_metrics_counter_labels(m->config_reload, "failure");
    go = (struct tdm_metrics_opts){.name =
                                       "tandem:router_config_last_reload_success_timestamp_seconds",
                                   .help = "Unix time the active config was loaded."};
    if ((rc = tdm_metrics_gauge_register(&m->config_last_success, reg, &go, err, errlen)))
        return rc;
    if (!m->pd_decision_by[0] || !m->pd_decision_by[1] || !m->ready_prefill || !m->ready_decode ||
        !m->config_reload_success || !m->config_reload_failure)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "router metrics: out of memory");
    return TDM_OK;
}

static const char *role_label(enum tdm_router_role role)
{
    const char *r = tdm_router_role_name(role);
    return r && *r ? r : "none";
}

void tdm_router_metrics_pick(struct tdm_router_metrics *m, const char *endpoint,
                             enum tdm_router_role role)
{
    if (m && endpoint)
        tdm_metrics_counter_inc(
            tdm_metrics_counter_labels(m->endpoint_picks, endpoint, role_label(role)));
}

void tdm_router_metrics_fallback(struct tdm_router_metrics *m, const char *endpoint,
                                 enum tdm_router_role role)
{
    if (m && endpoint)
        tdm_metrics_counter_inc(
            tdm_metrics_counter_labels(m->endpoint_fallbacks, endpoint, role_label(role)));
}

void tdm_router_metrics_upstream_error(struct tdm_router_metrics *m, const char *endpoint,
                                       enum tdm_router_role role, bool timeout)
{
    if (m && endpoint)
        tdm_metrics_counter_inc(tdm_metrics_counter_labels(
            m->upstream_errors, endpoint, role_label(role), timeout ? "timeout" : "error"));
}

void tdm_router_metrics_retry(struct tdm_router_metrics *m, const char *endpoint,
                              enum tdm_router_role role)
{
    if (m && endpoint)
        tdm_metrics_counter_inc(tdm_metrics_counter_labels(m->retries, endpoint, role_label(role)));
}

void tdm_router_metrics_decision(struct tdm_router_metrics *m, enum tdm_router_decision d)
{
    if (m && (d == TDM_ROUTER_DECISION_DECODE_ONLY || d == TDM_ROUTER_DECISION_PREFILL_DECODE))
        tdm_metrics_counter_inc(m->pd_decision_by[d]);
}

void tdm_router_metrics_request(struct tdm_router_metrics *m, const char *status)
{
    if (m && status)
        tdm_metrics_counter_inc(tdm_metrics_counter_labels(m->requests, status));
}

void tdm_router_metrics_endpoint_health(struct tdm_router_metrics *m, const char *endpoint,
                                        enum tdm_router_role role, bool healthy, const char *reason)
{
    if (!m || !endpoint)
        return;
    const char *r = role_label(role);
    tdm_metrics_gauge_set(tdm_metrics_gauge_labels(m->endpoint_healthy, endpoint, r),
                          healthy ? 1.0 : 0.0);
    static const char *const reasons[] = {"auth", "starting", "health_check"};
    for (size_t i = 0; i < sizeof reasons / sizeof *reasons; i++)
        tdm_metrics_gauge_set(
            tdm_metrics_gauge_labels(m->endpoint_unhealthy, endpoint, r, reasons[i]),
            !healthy && reason && !strcmp(reason, reasons[i]) ? 1.0 : 0.0);
}

void tdm_router_metrics_config_reload(struct tdm_router_metrics *m, bool success, double wall_time)
{
    if (!m)
        return;
    tdm_metrics_counter_inc(success ? m->config_reload_success : m->config_reload_failure);
    if (success)
        tdm_metrics_gauge_set(m->config_last_success, wall_time);
}
