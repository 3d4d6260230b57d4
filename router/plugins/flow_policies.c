// SPDX-License-Identifier: Apache-2.0
// router plugins, flow control policies: the fairness and ordering policies a
// priority band of flowControl names (fairnessPolicyRef, orderingPolicyRef).
// They take no parameters; router/flow.c implements what each type means
// (global-strict: one arrival order over the band's flows; round-robin: the
// band's flows, sorted by fairness id, take turns; fcfs: arrival order
// within a flow). Declaring one under `plugins` only gives it a name to refer to.
#include "plugins.h"

const struct tdm_router_plugin_ops tdm_router_global_strict_fairness_ops = {
    .name = "global-strict-fairness-policy",
    .kind = TDM_ROUTER_PLUGIN_FLOW_POLICY,
};

const struct tdm_router_plugin_ops tdm_router_round_robin_fairness_ops = {
    .name = "round-robin-fairness-policy",
    .kind = TDM_ROUTER_PLUGIN_FLOW_POLICY,
};

const struct tdm_router_plugin_ops tdm_router_fcfs_ordering_ops = {
    .name = "fcfs-ordering-policy",
    .kind = TDM_ROUTER_PLUGIN_FLOW_POLICY,
};
