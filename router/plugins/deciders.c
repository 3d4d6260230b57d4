// SPDX-License-Identifier: Apache-2.0
// router plugins, the top-level ones: P/D deciders (whether a prompt is
// prefilled remotely), profile handlers (which profiles pick the decode and the
// prefill endpoint, and which decider runs) and the prefix index producer.
// They are not listed in profiles; config.c resolves them once per parse into
// the config's decode_profile / prefill_profile / pd_mode / prefix_index.
#include <stddef.h>

#include "plugins.h"

#define NO TDM_ROUTER_PARAM_NO_FIELD
#define FIELD(f) offsetof(struct tdm_router_plugin_params, f)
#define N(a) (sizeof(a) / sizeof(a)[0])

// llm-d: nonCachedTokens 0 disables the decider (decode-only).
static enum tdm_router_pd_mode decide_prefix(const struct tdm_router_plugin_params *p,
                                             int *threshold)
{
    *threshold = p->prefix_decider.non_cached_tokens;
    return *threshold > 0 ? TDM_ROUTER_PD_PREFIX : TDM_ROUTER_PD_NEVER;
}

static enum tdm_router_pd_mode decide_always(const struct tdm_router_plugin_params *p,
                                             int *threshold)
{
    (void)p;
    *threshold = 0;
    return TDM_ROUTER_PD_ALWAYS;
}

static const struct tdm_router_param prefix_decider_params[] = {
    {"nonCachedTokens", TDM_ROUTER_PARAM_INT, FIELD(prefix_decider.non_cached_tokens), 0, 100000000,
     0, NULL, 0, NO, NULL},
};

const struct tdm_router_plugin_ops tdm_router_prefix_pd_decider_ops = {
    .name = "prefix-based-pd-decider",
    .kind = TDM_ROUTER_PLUGIN_DECIDER,
    .params = prefix_decider_params,
    .n_params = N(prefix_decider_params),
    .decide = decide_prefix,
};

const struct tdm_router_plugin_ops tdm_router_always_disagg_decider_ops = {
    .name = "always-disagg-pd-decider",
    .kind = TDM_ROUTER_PLUGIN_DECIDER,
    .decide = decide_always,
};

const struct tdm_router_plugin_ops tdm_router_single_profile_handler_ops = {
    .name = "single-profile-handler",
    .kind = TDM_ROUTER_PLUGIN_PROFILE_HANDLER,
};

// The deprecated pd-profile-handler spellings are hidden from the view:
// decodeProfile and prefillProfile are aliases (the same fields as
// profiles.decode / profiles.prefill), `threshold` makes the handler a prefix
// decider of its own, hashBlockSize sets the prefix index block size unless a
// producer or scorer sets it (config.c apply_plugin_globals).
static const struct tdm_router_param disagg_handler_params[] = {
    {"profiles.decode", TDM_ROUTER_PARAM_STRING, FIELD(disagg_handler.decode_profile), 0, 0, 0,
     "decode", 0, NO, NULL},
    {"profiles.prefill", TDM_ROUTER_PARAM_STRING, FIELD(disagg_handler.prefill_profile), 0, 0, 0,
     "prefill", 0, NO, NULL},
    {"deciders.prefill", TDM_ROUTER_PARAM_STRING, FIELD(disagg_handler.prefill_decider), 0, 0, 0,
     NULL, 0, NO, NULL},
    {"decodeProfile", TDM_ROUTER_PARAM_STRING, FIELD(disagg_handler.decode_profile), 0, 0, 0, NULL,
     TDM_ROUTER_PARAM_HIDDEN, NO, NULL},
    {"prefillProfile", TDM_ROUTER_PARAM_STRING, FIELD(disagg_handler.prefill_profile), 0, 0, 0,
     NULL, TDM_ROUTER_PARAM_HIDDEN, NO, NULL},
    {"threshold", TDM_ROUTER_PARAM_INT, FIELD(disagg_handler.threshold), 0, 100000000, 0, NULL,
     TDM_ROUTER_PARAM_HIDDEN, FIELD(disagg_handler.threshold_set), NULL},
    {"hashBlockSize", TDM_ROUTER_PARAM_INT, FIELD(disagg_handler.hash_block_size), 1, 4096, 16,
     NULL, TDM_ROUTER_PARAM_HIDDEN, NO, NULL},
};

const struct tdm_router_plugin_ops tdm_router_disagg_profile_handler_ops = {
    .name = "disagg-profile-handler",
    .kind = TDM_ROUTER_PLUGIN_PROFILE_HANDLER,
    .params = disagg_handler_params,
    .n_params = N(disagg_handler_params),
};

const struct tdm_router_plugin_ops tdm_router_approx_prefix_producer_ops = {
    .name = "approx-prefix-cache-producer",
    .kind = TDM_ROUTER_PLUGIN_PRODUCER,
    .params = tdm_router_prefix_index_params,
    .n_params = TDM_ROUTER_N_PREFIX_INDEX_PARAMS,
};
