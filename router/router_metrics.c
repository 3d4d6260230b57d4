// SPDX-License-Identifier: Apache-2.0
// router metrics: registers the router's series (names and the llm-d
// equivalents are listed in docs/router-config.md) and small helpers that look
// up a per-endpoint child and update it. Children are created on first use and
// kept by the registry, so a removed endpoint's series stay (its health gauge
// is set to 0 when it goes).
#include "router_metrics.h"

#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "core.h"

static size_t count_labels(const char *const *l)
{
    size_t n = 0;
    while (l && l[n])
        n++;
    return n;
}

static const char *const l_decision[] = {"decision_type", NULL};
static const char *const l_status[] = {"status", NULL};
static const char *const l_ep_role[] = {"endpoint", "role", NULL};
static const char *const l_ep_role_kind[] = {"endpoint", "role", "kind", NULL};
static const char *const l_ep_role_reason[] = {"endpoint", "role", "reason", NULL};
static const char *const l_role[] = {"role", NULL};
static const char *const l_result[] = {"result", NULL};
static const char *const l_priority[] = {"priority", NULL};
static const char *const l_priority_outcome[] = {"priority", "outcome", NULL};

// Flow control's time in queue (llm-d: 0.1 ms .. 60 s).
static const double *queue_buckets(size_t *n)
{
    static const double bounds[] = {0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1,
                                    0.5,    1,      5,     10,    30,   60};
    *n = sizeof bounds / sizeof *bounds;
    return bounds;
}

// tandem:router_scheduling_seconds: picks take microseconds.
static const double *sched_buckets(size_t *n)
{
    static const double bounds[] = {0.00001, 0.00005, 0.0001, 0.0005, 0.001,
                                    0.005,   0.01,    0.05,   0.1};
    *n = sizeof bounds / sizeof *bounds;
    return bounds;
}

enum family_kind { FAMILY_COUNTER, FAMILY_GAUGE, FAMILY_HISTOGRAM };

// One series family of the router, registered in table order (the order of
// the exposition).
struct family {
    enum family_kind kind;
    size_t field; // offsetof the family's pointer in struct tdm_router_metrics
    const char *name;
    const char *help;
    const char *const *labels;           // NULL-terminated; NULL: none
    const double *(*buckets)(size_t *n); // histograms: their bounds; else NULL
};

#define FIELD(f) offsetof(struct tdm_router_metrics, f)

static const struct family families[] = {
    {FAMILY_COUNTER, FIELD(pd_decision), "tandem:router_pd_decision_total",
     "Routing decisions by type (llm-d: llm_d_epp_disagg_decision_total).", l_decision, NULL},
    {FAMILY_COUNTER, FIELD(requests), "tandem:router_requests_total",
     "Requests the router finished, by status (success, error, cancelled, "
     "no_endpoint).",
     l_status, NULL},
    {FAMILY_COUNTER, FIELD(endpoint_picks), "tandem:router_endpoint_picks_total",
     "Requests sent to an endpoint, by the role it was picked for (a pick whose "
     "send failed counts in tandem:router_endpoint_fallbacks_total instead).",
     l_ep_role, NULL},
    {FAMILY_COUNTER, FIELD(endpoint_fallbacks), "tandem:router_endpoint_fallbacks_total",
     "Requests routed to an endpoint that could not be sent there (no connection, "
     "or its control-plane handshake failed) and went to another endpoint or "
     "failed.",
     l_ep_role, NULL},
    {FAMILY_COUNTER, FIELD(upstream_errors), "tandem:router_upstream_errors_total",
     "Failed upstream calls by endpoint and kind (error, timeout).", l_ep_role_kind, NULL},
    {FAMILY_COUNTER, FIELD(retries), "tandem:router_retries_total",
     "Requests retried away from an endpoint after it failed.", l_ep_role, NULL},
    {FAMILY_COUNTER, FIELD(prefill_fallback), "tandem:router_prefill_fallback_total",
     "Remote prefill given up (retries exhausted): the decode worker prefilled "
     "locally.",
     NULL, NULL},
    {FAMILY_GAUGE, FIELD(endpoint_healthy), "tandem:router_endpoint_healthy",
     "1 when the endpoint passes health checks, else 0.", l_ep_role, NULL},
    {FAMILY_GAUGE, FIELD(endpoint_unhealthy), "tandem:router_endpoint_unhealthy_reason",
     "1 for why the endpoint is not healthy: auth (its nng inbox refuses the router's "
     "handshake: another TANDEM_INTERNAL_SECRET), starting (no check answered yet), "
     "health_check (its checks fail); all 0 while healthy.",
     l_ep_role_reason, NULL},
    {FAMILY_GAUGE, FIELD(ready_endpoints), "tandem:router_ready_endpoints",
     "Endpoints the router can pick, by role: healthy, up (heard from, or its control-plane "
     "link not down) and not draining.",
     l_role, NULL},
    {FAMILY_GAUGE, FIELD(inflight), "tandem:router_inflight_requests",
     "Requests the router is handling now.", NULL, NULL},
    {FAMILY_HISTOGRAM, FIELD(ttft), "tandem:router_time_to_first_token_seconds",
     "Router-side time to first token (request received to first token written).", NULL,
     tdm_metrics_buckets_ttft},
    {FAMILY_HISTOGRAM, FIELD(itl), "tandem:router_inter_token_latency_seconds",
     "Router-side time between streamed tokens.", NULL, tdm_metrics_buckets_itl},
    {FAMILY_HISTOGRAM, FIELD(e2e), "tandem:router_e2e_request_latency_seconds",
     "Router-side end-to-end request latency.", NULL, tdm_metrics_buckets_request_latency},
    {FAMILY_HISTOGRAM, FIELD(kv_transfer), "tandem:router_kv_transfer_seconds",
     "Whole KV transfer of a disaggregated request: first KV frame received to last "
     "layer installed on the decode worker (overlaps the prefill).",
     NULL, tdm_metrics_buckets_ttft},
    {FAMILY_HISTOGRAM, FIELD(kv_transfer_exposed), "tandem:router_kv_transfer_exposed_seconds",
     "The part of the KV transfer the request waited for: prefill result received to "
     "last layer installed (0 when every frame came first).",
     NULL, tdm_metrics_buckets_ttft},
    {FAMILY_HISTOGRAM, FIELD(routing), "tandem:router_scheduling_seconds",
     "Time to pick endpoints for a request (llm-d: "
     "llm_d_epp_scheduler_e2e_duration_seconds).",
     NULL, sched_buckets},
    {FAMILY_GAUGE, FIELD(pool_saturation), "tandem:router_flow_control_pool_saturation",
     "The pool's saturation as of the last flow-control decision: the mean over ready "
     "endpoints of max(queue / queueDepthThreshold, KV usage / kvCacheUtilThreshold); "
     ">= 1 holds requests (llm-d: inference_extension_flow_control_pool_saturation).",
     NULL, NULL},
    {FAMILY_GAUGE, FIELD(flow_queue_size), "tandem:router_flow_control_queue_size",
     "Requests waiting in the router's flow-control queue, by priority band (llm-d: "
     "inference_extension_flow_control_queue_size).",
     l_priority, NULL},
    {FAMILY_GAUGE, FIELD(flow_queue_bytes), "tandem:router_flow_control_queue_bytes",
     "Body bytes of the requests waiting in the flow-control queue, by priority band "
     "(llm-d: inference_extension_flow_control_queue_bytes).",
     l_priority, NULL},
    {FAMILY_HISTOGRAM, FIELD(flow_queue_duration),
     "tandem:router_flow_control_request_queue_duration_seconds",
     "Time a request spent in flow control, by priority and outcome (Dispatched, "
     "RejectedCapacity, EvictedTTL, EvictedContextCancelled, EvictedOther, Shed) (llm-d: "
     "inference_extension_flow_control_request_queue_duration_seconds).",
     l_priority_outcome, queue_buckets},
    {FAMILY_COUNTER, FIELD(config_reload), "tandem:router_config_reload_total",
     "Config reloads by result (success, failure: old config kept).", l_result, NULL},
    {FAMILY_GAUGE, FIELD(config_last_success),
     "tandem:router_config_last_reload_success_timestamp_seconds",
     "Unix time the active config was loaded.", NULL, NULL},
};

#undef FIELD

static int register_family(struct tdm_router_metrics *m, const struct family *f, char *err,
                           size_t errlen)
{
    struct tdm_metrics_opts o = {.name = f->name, .help = f->help};
    o.label_names = f->labels;
    o.n_label_names = count_labels(f->labels);
    void *field = (char *)m + f->field;
    switch (f->kind) {
    case FAMILY_COUNTER:
        return tdm_metrics_counter_register(field, m->reg, &o, err, errlen);
    case FAMILY_GAUGE:
        return tdm_metrics_gauge_register(field, m->reg, &o, err, errlen);
    case FAMILY_HISTOGRAM:
        break;
    }
    size_t nb;
    const double *b = f->buckets(&nb);
    return tdm_metrics_histogram_register(field, m->reg, &o, b, nb, err, errlen);
}

int tdm_router_metrics_register(struct tdm_router_metrics *m, struct tdm_metrics_registry *reg,
                                char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    m->reg = reg;
    if (!reg)
        return tdm_seterr(err, errlen, TDM_EINVAL, "router metrics: no registry");
    for (size_t i = 0; i < sizeof families / sizeof *families; i++) {
        int rc = register_family(m, &families[i], err, errlen);
        if (rc != TDM_OK)
            return rc;
    }
    // The children written on the hot path, and the request statuses shown
    // from the start.
    m->pd_decision_by[0] = tdm_metrics_counter_labels(m->pd_decision, "decode-only");
    m->pd_decision_by[1] = tdm_metrics_counter_labels(m->pd_decision, "prefill-decode");
    static const char *const statuses[] = {"success", "error", "cancelled", "no_endpoint"};
    for (size_t i = 0; i < 4; i++)
        (void)tdm_metrics_counter_labels(m->requests, statuses[i]);
    m->ready_prefill = tdm_metrics_gauge_labels(m->ready_endpoints, "prefill");
    m->ready_decode = tdm_metrics_gauge_labels(m->ready_endpoints, "decode");
    m->config_reload_success = tdm_metrics_counter_labels(m->config_reload, "success");
    m->config_reload_failure = tdm_metrics_counter_labels(m->config_reload, "failure");
    if (!m->pd_decision_by[0] || !m->pd_decision_by[1] || !m->ready_prefill || !m->ready_decode ||
        !m->config_reload_success || !m->config_reload_failure)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "router metrics: out of memory");
    return TDM_OK;
}

void tdm_router_metrics_flow_queue(struct tdm_router_metrics *m, int priority, int requests,
                                   long long bytes)
{
    if (!m)
        return;
    char p[16];
    snprintf(p, sizeof p, "%d", priority);
    tdm_metrics_gauge_add(tdm_metrics_gauge_labels(m->flow_queue_size, p), requests);
    tdm_metrics_gauge_add(tdm_metrics_gauge_labels(m->flow_queue_bytes, p), (double)bytes);
}

void tdm_router_metrics_flow_outcome(struct tdm_router_metrics *m, int priority,
                                     enum tdm_router_flow_outcome outcome, double waited)
{
    if (!m)
        return;
    char p[16];
    snprintf(p, sizeof p, "%d", priority);
    tdm_metrics_histogram_observe(
        tdm_metrics_histogram_labels(m->flow_queue_duration, p,
                                     tdm_router_flow_outcome_name(outcome)),
        waited);
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
