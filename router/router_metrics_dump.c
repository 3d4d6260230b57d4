// SPDX-License-Identifier: Apache-2.0
// router_metrics_dump: registers the router metrics, touches every family
// (so each renders at least one series), and prints the exposition text for
// `promtool check metrics` (router_metrics_promtool test).
#include <stdio.h>
#include <stdlib.h>

#include "core.h"
#include "router_metrics.h"

int main(void)
{
    char err[256];
    struct tdm_metrics_registry *reg = NULL;
    struct tdm_router_metrics m;
    if (tdm_metrics_registry_new(&reg, NULL, 0, err, sizeof err) ||
        tdm_router_metrics_register(&m, reg, err, sizeof err)) {
        fprintf(stderr, "router_metrics_dump: %s\n", err);
        return 1;
    }
    tdm_router_metrics_pick(&m, "10.0.0.1:8001", TDM_ROUTER_ROLE_DECODE);
    tdm_router_metrics_pick(&m, "10.0.0.2:8001", TDM_ROUTER_ROLE_PREFILL);
    tdm_router_metrics_upstream_error(&m, "10.0.0.2:8001", TDM_ROUTER_ROLE_PREFILL, true);
    tdm_router_metrics_upstream_error(&m, "10.0.0.1:8001", TDM_ROUTER_ROLE_DECODE, false);
    tdm_router_metrics_retry(&m, "10.0.0.2:8001", TDM_ROUTER_ROLE_PREFILL);
    tdm_router_metrics_decision(&m, TDM_ROUTER_DECISION_PREFILL_DECODE);
    tdm_router_metrics_request(&m, "success");
    tdm_router_metrics_endpoint_health(&m, "[fd00::1]:8001", TDM_ROUTER_ROLE_PREFILL_DECODE, true,
                                       NULL);
    tdm_router_metrics_endpoint_health(&m, "10.0.0.3:8001", TDM_ROUTER_ROLE_DECODE, false, "auth");
    tdm_router_metrics_fallback(&m, "10.0.0.3:8001", TDM_ROUTER_ROLE_DECODE);
    tdm_router_metrics_config_reload(&m, true, tdm_wall_now());
    tdm_router_metrics_config_reload(&m, false, tdm_wall_now());
    tdm_metrics_counter_inc(m.prefill_fallback);
    tdm_metrics_gauge_set(m.ready_decode, 2);
    tdm_metrics_histogram_observe(m.ttft, 0.12);
    tdm_metrics_histogram_observe(m.itl, 0.02);
    tdm_metrics_histogram_observe(m.e2e, 1.5);
    tdm_metrics_histogram_observe(m.kv_transfer, 0.004);
    tdm_metrics_histogram_observe(m.routing, 0.00002);
    char *out = NULL;
    size_t len = 0;
    if (tdm_metrics_render(reg, &out, &len)) {
        fprintf(stderr, "router_metrics_dump: render failed\n");
        return 1;
    }
    fwrite(out, 1, len, stdout);
    free(out);
    tdm_metrics_registry_free(reg);
    return 0;
}
