// SPDX-License-Identifier: Apache-2.0
// router plugins, filters: drop candidates before scoring. The role and
// health filters restate what every profile run applies first anyway (llm-d
// configs list them); the utilization detector drops saturated endpoints and
// fails open (keeps all) when every candidate is saturated, as llm-d's does.
#include <stddef.h>

#include "plugins.h"

#define NO TDM_ROUTER_PARAM_NO_FIELD
#define FIELD(f) offsetof(struct tdm_router_plugin_params, f)

static bool keep_decode(const struct tdm_router_plugin_params *p,
                        const struct tdm_router_endpoint_view *e)
{
    (void)p;
    return tdm_router_role_can_decode(e->role);
}

static bool keep_prefill(const struct tdm_router_plugin_params *p,
                         const struct tdm_router_endpoint_view *e)
{
    (void)p;
    return tdm_router_role_can_prefill(e->role);
}

static bool keep_healthy(const struct tdm_router_plugin_params *p,
                         const struct tdm_router_endpoint_view *e)
{
    (void)p;
    return e->healthy;
}

bool tdm_router_policy_saturated(const struct tdm_router_plugin_params *p,
                                 const struct tdm_router_endpoint_view *ep)
{
    if (!ep->has_load || ep->load_stale)
        return true; // llm-d: metrics we cannot trust count as saturated
    double q_limit = p->utilization.queue_depth_threshold * (1.0 + p->utilization.headroom);
    double kv_limit = p->utilization.kv_cache_util_threshold * (1.0 + p->utilization.headroom);
    return ep->load.waiting > q_limit || ep->load.kv_usage > kv_limit;
}

static bool keep_unsaturated(const struct tdm_router_plugin_params *p,
                             const struct tdm_router_endpoint_view *e)
{
    return !tdm_router_policy_saturated(p, e);
}

const struct tdm_router_plugin_ops tdm_router_decode_filter_ops = {
    .name = "decode-filter",
    .kind = TDM_ROUTER_PLUGIN_FILTER,
    .keep = keep_decode,
};

const struct tdm_router_plugin_ops tdm_router_prefill_filter_ops = {
    .name = "prefill-filter",
    .kind = TDM_ROUTER_PLUGIN_FILTER,
    .keep = keep_prefill,
};

const struct tdm_router_plugin_ops tdm_router_health_filter_ops = {
    .name = "health-filter",
    .kind = TDM_ROUTER_PLUGIN_FILTER,
    .keep = keep_healthy,
};

static const struct tdm_router_param utilization_params[] = {
    {"queueDepthThreshold", TDM_ROUTER_PARAM_INT, FIELD(utilization.queue_depth_threshold), 0,
     1000000, 5, NULL, 0, NO, NULL},
    {"kvCacheUtilThreshold", TDM_ROUTER_PARAM_DOUBLE, FIELD(utilization.kv_cache_util_threshold), 0,
     1, 0.8, NULL, 0, NO, NULL},
    {"headroom", TDM_ROUTER_PARAM_DOUBLE, FIELD(utilization.headroom), 0, 10, 0, NULL, 0, NO, NULL},
};

const struct tdm_router_plugin_ops tdm_router_utilization_detector_ops = {
    .name = "utilization-detector",
    .kind = TDM_ROUTER_PLUGIN_FILTER,
    .params = utilization_params,
    .n_params = sizeof utilization_params / sizeof utilization_params[0],
    .keep = keep_unsaturated,
    .fail_open = true,
};
