// SPDX-License-Identifier: Apache-2.0
// router plugins: every plugin type (filter, scorer, picker, P/D decider,
// profile handler, producer, flow control policy) as one ops table: its registered name, its kind,
// its parameter table and the function its kind calls. One table drives the
// whole life of a parameter: config.c parses and validates a plugin's
// `parameters` mapping by walking the table (unknown keys, types and ranges
// come from it), fills defaults from it, writes the /v1/router/config view
// from it, and policy.c runs a profile by calling the ops of the plugins the
// profile lists. Adding a plugin = one ops table in the file of its kind
// (filters.c, scorers.c, pickers.c, deciders.c) and one line in plugins.c.
//
// Internal to router/ (config.c, policy.c and the tests); nothing here locks or
// allocates except params_fini freeing strings the parser stored.
#ifndef TDM_ROUTER_PLUGINS_H
#define TDM_ROUTER_PLUGINS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "endpoints.h"
#include "policy.h"

// ---- parameter tables ---------------------------------------------------------------------------
enum tdm_router_param_type {
    TDM_ROUTER_PARAM_INT,    // int field; an integer in [min, max]
    TDM_ROUTER_PARAM_DOUBLE, // double field; a number in [min, max]
    TDM_ROUTER_PARAM_STRING, // char * field (heap, freed by params_fini); non-empty
    TDM_ROUTER_PARAM_BOOL,   // true/false, accepted only where (0 or 1) is in [min, max]
};

// Parsed and validated but not shown in the view: an alias of a shown key, or
// a key whose only accepted value is what the router always does.
#define TDM_ROUTER_PARAM_HIDDEN 1u
// Strings: lower-cased after parsing (HTTP header names).
#define TDM_ROUTER_PARAM_LOWER 2u

#define TDM_ROUTER_PARAM_NO_FIELD SIZE_MAX

struct tdm_router_param {
    const char *key; // YAML key; "a.b" is key b of the mapping under key a
    enum tdm_router_param_type type;
    size_t offset;       // offsetof(struct tdm_router_plugin_params, field), or
                         // TDM_ROUTER_PARAM_NO_FIELD (validated only: nothing to store)
    double min, max;     // accepted range (numbers; bools: false = 0, true = 1)
    double def;          // default of a number field
    const char *def_str; // strings: the value the view shows while unset (NULL: omitted)
    unsigned flags;      // TDM_ROUTER_PARAM_*
    size_t given_offset; // TDM_ROUTER_PARAM_NO_FIELD, or offsetof a bool set when the key is given
    const char
        *range_note; // the error for an out-of-range value (NULL: "V is out of range [a, b]")
};

// Endpoints one profile run considers (more are ignored, with a warning: a
// router with thousands of workers needs a different data structure anyway).
#define TDM_ROUTER_POLICY_MAX_EPS 256

// ---- what the ops see ------------------------------------------------------------------------
// One profile run's candidates and the values several scorers share.
struct tdm_router_score_ctx {
    const struct tdm_router_snapshot *snap;
    const struct tdm_router_request *req; // may be NULL
    const size_t *cand;                   // [nc] snapshot indices that passed the filters
    const struct tdm_router_endpoint_view *decode; // the prefill profile: the decode endpoint
                                                   // already picked; NULL in the decode profile
    size_t nc;
    double lo_waiting, hi_waiting, lo_running, hi_running; // over the candidates (waiting:
                                                           // tdm_router_queue_estimate)
    int max_prefix_blocks; // cfg->max_prefix_blocks_to_match (prefix score denominator cap)
    size_t session_target; // set by session-affinity's prepare; SIZE_MAX = none
};

// The queue a load-aware scorer judges an endpoint by: the waiting requests of
// its last report plus the requests the router sent it since that report and
// still has in flight (view.unreported). Without any report the reported queue
// is 0, so the router's in-flight count alone. A request the worker has not
// reported is counted as waiting: it enters the worker's queue first. Stale
// load gets the same sum (the utilization-detector still counts it saturated).
static inline double tdm_router_queue_estimate(const struct tdm_router_endpoint_view *e)
{
    return (double)e->load.waiting + (double)e->unreported;
}

// A picker's input: totals per candidate and the profile's random stream.
struct tdm_router_pick_ctx {
    const struct tdm_router_snapshot *snap;
    const double *total; // [nc] weighted score sums
    size_t nc;           // <= TDM_ROUTER_POLICY_MAX_EPS
    uint64_t *rng;       // splitmix64 state: the same snapshot replays the same order
};

struct tdm_router_plugin_ops {
    const char *name; // registered type name ("queue-scorer")
    enum tdm_router_plugin_kind kind;
    const struct tdm_router_param *params; // [n_params], in parse and view order
    size_t n_params;
    // Filters: keep e? When fail_open and the filter would drop every
    // candidate, it keeps them all (queue somewhere rather than reject).
    bool (*keep)(const struct tdm_router_plugin_params *p,
                 const struct tdm_router_endpoint_view *e);
    bool fail_open;
    // Scorers: prepare (may be NULL) runs once per profile run before score;
    // score gives candidate ctx->cand[k] a value in [0, 1].
    void (*prepare)(struct tdm_router_score_ctx *ctx);
    double (*score)(const struct tdm_router_score_ctx *ctx,
                    const struct tdm_router_plugin_params *p, size_t k);
    // Pickers: order[0..nc) holds 0..nc-1 on entry and the ranking (best
    // first, indices into the candidates) on return.
    void (*pick)(const struct tdm_router_pick_ctx *ctx, size_t *order);
    // Deciders: the P/D mode these parameters give (*threshold: uncached
    // prompt tokens above which to prefill remotely, for PREFIX).
    enum tdm_router_pd_mode (*decide)(const struct tdm_router_plugin_params *p, int *threshold);
};

// The ops table of a type; NULL when out of range.
const struct tdm_router_plugin_ops *tdm_router_plugin_ops_of(enum tdm_router_plugin_type type);
// The type registered under name (deprecated llm-d aliases included), or -1.
int tdm_router_plugin_lookup(const char *name);
// Sets every field the type's table names to its default (others zero).
void tdm_router_plugin_params_init(struct tdm_router_plugin_params *p,
                                   enum tdm_router_plugin_type type);
// Frees the strings the parser stored in the fields the type's table names
// (an alias shares its key's field, so each is freed once).
void tdm_router_plugin_params_fini(struct tdm_router_plugin_params *p,
                                   enum tdm_router_plugin_type type);

// The prefix index's parameter table (prefix-cache-scorer and
// approx-prefix-cache-producer share it).
#define TDM_ROUTER_N_PREFIX_INDEX_PARAMS 5
extern const struct tdm_router_param
    tdm_router_prefix_index_params[TDM_ROUTER_N_PREFIX_INDEX_PARAMS];

// splitmix64: the pickers' and tie-breaking random stream.
uint64_t tdm_router_splitmix64(uint64_t *s);

// The ops tables, one per type, defined in the file of their kind.
extern const struct tdm_router_plugin_ops tdm_router_decode_filter_ops,
    tdm_router_prefill_filter_ops, tdm_router_health_filter_ops,
    tdm_router_utilization_detector_ops;
extern const struct tdm_router_plugin_ops tdm_router_queue_scorer_ops,
    tdm_router_kv_cache_util_scorer_ops, tdm_router_running_scorer_ops,
    tdm_router_prefix_cache_scorer_ops, tdm_router_load_aware_scorer_ops,
    tdm_router_session_affinity_scorer_ops, tdm_router_active_request_scorer_ops,
    tdm_router_colocation_scorer_ops;
extern const struct tdm_router_plugin_ops tdm_router_max_score_picker_ops,
    tdm_router_random_picker_ops, tdm_router_weighted_random_picker_ops,
    tdm_router_round_robin_picker_ops;
extern const struct tdm_router_plugin_ops tdm_router_prefix_pd_decider_ops,
    tdm_router_always_disagg_decider_ops, tdm_router_single_profile_handler_ops,
    tdm_router_disagg_profile_handler_ops, tdm_router_approx_prefix_producer_ops;
extern const struct tdm_router_plugin_ops tdm_router_global_strict_fairness_ops,
    tdm_router_round_robin_fairness_ops, tdm_router_fcfs_ordering_ops;

#endif
