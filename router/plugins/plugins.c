// SPDX-License-Identifier: Apache-2.0
// router plugins: the registry of ops tables by type (plugins.h), the type
// names and kinds the config and the logs use, and parameter defaults and
// cleanup driven by each type's parameter table.
#include "plugins.h"

#include <stdlib.h>
#include <string.h>

static const struct tdm_router_plugin_ops *const registry[TDM_ROUTER_PLUGIN_TYPE_COUNT] = {
    [TDM_ROUTER_DECODE_FILTER] = &tdm_router_decode_filter_ops,
    [TDM_ROUTER_PREFILL_FILTER] = &tdm_router_prefill_filter_ops,
    [TDM_ROUTER_HEALTH_FILTER] = &tdm_router_health_filter_ops,
    [TDM_ROUTER_UTILIZATION_DETECTOR] = &tdm_router_utilization_detector_ops,
    [TDM_ROUTER_QUEUE_SCORER] = &tdm_router_queue_scorer_ops,
    [TDM_ROUTER_KV_CACHE_UTIL_SCORER] = &tdm_router_kv_cache_util_scorer_ops,
    [TDM_ROUTER_RUNNING_SCORER] = &tdm_router_running_scorer_ops,
    [TDM_ROUTER_PREFIX_CACHE_SCORER] = &tdm_router_prefix_cache_scorer_ops,
    [TDM_ROUTER_LOAD_AWARE_SCORER] = &tdm_router_load_aware_scorer_ops,
    [TDM_ROUTER_SESSION_AFFINITY_SCORER] = &tdm_router_session_affinity_scorer_ops,
    [TDM_ROUTER_ACTIVE_REQUEST_SCORER] = &tdm_router_active_request_scorer_ops,
    [TDM_ROUTER_COLOCATION_SCORER] = &tdm_router_colocation_scorer_ops,
    [TDM_ROUTER_MAX_SCORE_PICKER] = &tdm_router_max_score_picker_ops,
    [TDM_ROUTER_RANDOM_PICKER] = &tdm_router_random_picker_ops,
    [TDM_ROUTER_WEIGHTED_RANDOM_PICKER] = &tdm_router_weighted_random_picker_ops,
    [TDM_ROUTER_ROUND_ROBIN_PICKER] = &tdm_router_round_robin_picker_ops,
    [TDM_ROUTER_PREFIX_PD_DECIDER] = &tdm_router_prefix_pd_decider_ops,
    [TDM_ROUTER_ALWAYS_DISAGG_DECIDER] = &tdm_router_always_disagg_decider_ops,
    [TDM_ROUTER_SINGLE_PROFILE_HANDLER] = &tdm_router_single_profile_handler_ops,
    [TDM_ROUTER_DISAGG_PROFILE_HANDLER] = &tdm_router_disagg_profile_handler_ops,
    [TDM_ROUTER_APPROX_PREFIX_PRODUCER] = &tdm_router_approx_prefix_producer_ops,
    [TDM_ROUTER_GLOBAL_STRICT_FAIRNESS] = &tdm_router_global_strict_fairness_ops,
    [TDM_ROUTER_ROUND_ROBIN_FAIRNESS] = &tdm_router_round_robin_fairness_ops,
    [TDM_ROUTER_FCFS_ORDERING] = &tdm_router_fcfs_ordering_ops,
};

const struct tdm_router_plugin_ops *tdm_router_plugin_ops_of(enum tdm_router_plugin_type type)
{
    if ((int)type < 0 || type >= TDM_ROUTER_PLUGIN_TYPE_COUNT)
        return NULL;
    return registry[type];
}

const char *tdm_router_plugin_type_name(enum tdm_router_plugin_type type)
{
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(type);
    return ops ? ops->name : NULL;
}

enum tdm_router_plugin_kind tdm_router_plugin_type_kind(enum tdm_router_plugin_type type)
{
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(type);
    return ops ? ops->kind : TDM_ROUTER_PLUGIN_FILTER;
}

int tdm_router_plugin_lookup(const char *name)
{
    for (int i = 0; i < TDM_ROUTER_PLUGIN_TYPE_COUNT; i++)
        if (strcmp(registry[i]->name, name) == 0)
            return i;
    // Deprecated llm-d name.
    if (strcmp(name, "pd-profile-handler") == 0)
        return TDM_ROUTER_DISAGG_PROFILE_HANDLER;
    return -1;
}

void tdm_router_plugin_params_init(struct tdm_router_plugin_params *p,
                                   enum tdm_router_plugin_type type)
{
    memset(p, 0, sizeof *p);
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(type);
    for (size_t i = 0; ops && i < ops->n_params; i++) {
        const struct tdm_router_param *d = &ops->params[i];
        if (d->offset == TDM_ROUTER_PARAM_NO_FIELD || (d->flags & TDM_ROUTER_PARAM_HIDDEN))
            continue; // aliases share the field of the key they alias
        char *f = (char *)p + d->offset;
        if (d->type == TDM_ROUTER_PARAM_INT)
            *(int *)(void *)f = (int)d->def;
        else if (d->type == TDM_ROUTER_PARAM_DOUBLE)
            *(double *)(void *)f = d->def;
    }
}

void tdm_router_plugin_params_fini(struct tdm_router_plugin_params *p,
                                   enum tdm_router_plugin_type type)
{
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(type);
    for (size_t i = 0; ops && i < ops->n_params; i++) {
        const struct tdm_router_param *d = &ops->params[i];
        if (d->type == TDM_ROUTER_PARAM_STRING && d->offset != TDM_ROUTER_PARAM_NO_FIELD &&
            !(d->flags & TDM_ROUTER_PARAM_HIDDEN)) {
            char **f = (char **)(void *)((char *)p + d->offset);
            free(*f);
            *f = NULL;
        }
    }
}

uint64_t tdm_router_splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
