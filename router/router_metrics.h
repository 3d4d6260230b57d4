// SPDX-License-Identifier: Apache-2.0
// router metrics: the router's own Prometheus series on a tdm_metrics registry.
// Names are under `tandem:router_`; docs/router-config.md maps each to its
// llm-d EPP equivalent (e.g. tandem:router_pd_decision_total{decision_type} is
// llm_d_epp_disagg_decision_total{decision_type}). The control plane updates
// health, endpoint and reload series itself; the request path (router.c)
// updates the request ones through these handles and the helpers below.
// Every update is lock-free (metrics.h); the per-endpoint helpers look a child
// up by label (lock-free once created).
#ifndef TDM_ROUTER_METRICS_H
#define TDM_ROUTER_METRICS_H

#include <stddef.h>

#include "flow.h"
#include "metrics.h"
#include "policy.h"

struct tdm_router_metrics {
    struct tdm_metrics_registry *reg; // borrowed

    // tandem:router_pd_decision_total{decision_type="prefill-decode|decode-only"}
    struct tdm_metrics_counter *pd_decision;
    struct tdm_metrics_counter *pd_decision_by[2]; // [enum tdm_router_decision]
    // tandem:router_requests_total{status="success|error|cancelled|no_endpoint"}
    struct tdm_metrics_counter *requests;
    // tandem:router_endpoint_picks_total{endpoint,role}: requests sent to an endpoint
    struct tdm_metrics_counter *endpoint_picks;
    // tandem:router_endpoint_fallbacks_total{endpoint,role}: routed there, not sendable
    struct tdm_metrics_counter *endpoint_fallbacks;
    // tandem:router_upstream_errors_total{endpoint,role,kind="error|timeout"}
    struct tdm_metrics_counter *upstream_errors;
    // tandem:router_retries_total{endpoint,role}: a request retried away from endpoint
    struct tdm_metrics_counter *retries;
    // tandem:router_prefill_fallback_total: remote prefill given up -> local prefill
    struct tdm_metrics_counter *prefill_fallback;
    // tandem:router_endpoint_healthy{endpoint,role} 1/0
    struct tdm_metrics_gauge *endpoint_healthy;
    // tandem:router_endpoint_unhealthy_reason{endpoint,role,reason="auth|starting|health_check"}
    struct tdm_metrics_gauge *endpoint_unhealthy;
    // tandem:router_ready_endpoints{role="prefill|decode"} the endpoints a policy can
    // pick: healthy, up, not draining (endpoints.h, tdm_router_endpoint_ready)
    struct tdm_metrics_gauge *ready_endpoints;
    struct tdm_metrics_gauge *ready_prefill;
    struct tdm_metrics_gauge *ready_decode;
    // tandem:router_inflight_requests
    struct tdm_metrics_gauge *inflight;
    // histograms (seconds, vLLM buckets): router-side TTFT, inter-token, end-to-end,
    // KV transfer as seen by the request (prefill start -> decode's first token)
    struct tdm_metrics_histogram *ttft;        // tandem:router_time_to_first_token_seconds
    struct tdm_metrics_histogram *itl;         // tandem:router_inter_token_latency_seconds
    struct tdm_metrics_histogram *e2e;         // tandem:router_e2e_request_latency_seconds
    struct tdm_metrics_histogram *kv_transfer; // tandem:router_kv_transfer_seconds (whole)
    struct tdm_metrics_histogram *kv_transfer_exposed; // tandem:router_kv_transfer_exposed_seconds
    struct tdm_metrics_histogram *routing;     // tandem:router_scheduling_seconds (pick time)
    // flow control (router/flow.h): the pool's saturation, the queue by priority band
    // (requests, bytes), time in queue by priority and outcome
    struct tdm_metrics_gauge *pool_saturation;         // tandem:router_flow_control_pool_saturation
    struct tdm_metrics_gauge *flow_queue_size;         // ..._queue_size{priority}
    struct tdm_metrics_gauge *flow_queue_bytes;        // ..._queue_bytes{priority}
    struct tdm_metrics_histogram *flow_queue_duration; // ..._request_queue_duration_seconds
                                                       //   {priority,outcome}
    // tandem:router_config_reload_total{result="success|failure"}
    struct tdm_metrics_counter *config_reload;
    struct tdm_metrics_counter *config_reload_success;
    struct tdm_metrics_counter *config_reload_failure;
    // tandem:router_config_last_reload_success_timestamp_seconds (wall clock)
    struct tdm_metrics_gauge *config_last_success;
};

// Registers every family on reg (which must not hold these names) and fills
// *m. TDM_EINVAL/TDM_ENOMEM with err; some families may be registered on error.
int tdm_router_metrics_register(struct tdm_router_metrics *m, struct tdm_metrics_registry *reg,
                                char *err, size_t errlen);

// Helpers for the per-endpoint families (NULL m is a no-op).
void tdm_router_metrics_pick(struct tdm_router_metrics *m, const char *endpoint,
                             enum tdm_router_role role);
void tdm_router_metrics_fallback(struct tdm_router_metrics *m, const char *endpoint,
                                 enum tdm_router_role role);
void tdm_router_metrics_upstream_error(struct tdm_router_metrics *m, const char *endpoint,
                                       enum tdm_router_role role, bool timeout);
void tdm_router_metrics_retry(struct tdm_router_metrics *m, const char *endpoint,
                              enum tdm_router_role role);
void tdm_router_metrics_decision(struct tdm_router_metrics *m, enum tdm_router_decision d);
// status: "success", "error", "cancelled", "no_endpoint".
void tdm_router_metrics_request(struct tdm_router_metrics *m, const char *status);
void tdm_router_metrics_endpoint_health(struct tdm_router_metrics *m, const char *endpoint,
                                        enum tdm_router_role role, bool healthy,
                                        const char *reason); // reason: NULL when healthy
void tdm_router_metrics_config_reload(struct tdm_router_metrics *m, bool success, double wall_time);
// Flow control: a request entered (+1, +bytes) or left (-1, -bytes) a band's queue;
// a request's admission ended with outcome after waited seconds.
void tdm_router_metrics_flow_queue(struct tdm_router_metrics *m, int priority, int requests,
                                   long long bytes);
void tdm_router_metrics_flow_outcome(struct tdm_router_metrics *m, int priority,
                                     enum tdm_router_flow_outcome outcome, double waited);

#endif
