// SPDX-License-Identifier: Apache-2.0
// router policy: picks the decode endpoint, decides whether the prompt is
// prefilled remotely (P/D) and if so ranks prefill endpoints, all as pure
// functions of (config, snapshot, request). Nothing here locks, allocates
// during the pick, or keeps state: round robin uses the snapshot's sequence
// number and every random choice derives from the snapshot's seed, so a test
// can replay a decision exactly.
//
// Per profile (llm-d's scheduling cycle): candidates are the snapshot's
// endpoints whose role fits the profile (decode profile: role can decode;
// prefill profile: role can prefill), healthy ones that are up only
// (tdm_router_endpoint_ready; not the view's not_up: never heard from, control
// link down; when none is left, none is picked), then the profile's filters in
// order (utilization-detector drops saturated endpoints, stale load counting
// as saturated, and keeps all when it would drop all: fail-open), then every
// scorer gives each candidate a score in [0, 1] (the queue scorers count the
// requests the router sent since the endpoint's last report: endpoints.h,
// `unreported`), the total is the weighted sum, and the picker chooses:
// max-score (ties broken uniformly at random: llm-d-router#2515), random,
// weighted-random, or round-robin.
//
// P/D decider (after the decode pick): uncached = prompt tokens minus the
// tokens the chosen decode endpoint is believed to cache; remote prefill when
// pd_mode is PREFIX and uncached > pd_threshold_tokens, or pd_mode is ALWAYS,
// and a healthy prefill endpoint exists. Prefill endpoints come back in retry
// order (the picked one first, then the others by descending score).
#ifndef TDM_ROUTER_POLICY_H
#define TDM_ROUTER_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "endpoints.h"

// What the policy knows of a request (all borrowed for the call).
struct tdm_router_request {
    size_t num_prompt_tokens; // prompt length in tokens
    const char *session;      // the session header's value, NULL when absent
    bool decode_only;         // prefilled on the decode worker whatever the pd_mode (prompt
                              // logprobs): no prefill pick
    uint64_t hash_root;       // the block hashes' chain root: 0, or tdm_kv_salt_hash of the
                              // request's cache_salt (what the workers cache it under)
};

enum tdm_router_decision {
    TDM_ROUTER_DECISION_DECODE_ONLY = 0, // the decode worker prefills locally
    TDM_ROUTER_DECISION_PREFILL_DECODE,  // remote prefill, KV transferred to decode
};
// "decode-only" / "prefill-decode" (llm_d_epp_disagg_decision_total's decision_type).
const char *tdm_router_decision_name(enum tdm_router_decision d);

// Scores of one endpoint in one profile, for debug logs.
struct tdm_router_endpoint_score {
    size_t ep;                                   // index into the snapshot
    double total;                                // weighted sum
    double scores[TDM_ROUTER_PLUGIN_TYPE_COUNT]; // per scorer type (NaN = not used)
    bool filtered;                               // dropped by a filter (or role/health)
};

struct tdm_router_pick {
    size_t decode; // snapshot index; SIZE_MAX = none available
    enum tdm_router_decision decision;
    size_t prefill[TDM_ROUTER_MAX_PREFILL_CANDIDATES]; // snapshot indices, retry order
    size_t n_prefill;                                  // 0 when decode-only
    size_t cached_tokens;   // tokens the decode endpoint is believed to cache
    size_t uncached_tokens; // num_prompt_tokens - cached_tokens
    bool fail_open;         // a saturation filter let everything through
    // Debug: scores of every snapshot endpoint in the decode / prefill profile.
    // Caller storage: set these to arrays of snap->n entries (or NULL to skip).
    struct tdm_router_endpoint_score *decode_scores;
    struct tdm_router_endpoint_score *prefill_scores;
};

// Runs the decode profile, the decider and (if disaggregating) the prefill
// profile. pick->decode_scores/prefill_scores must be set (or NULL) by the
// caller before the call. Returns TDM_OK with pick->decode set, or TDM_EBUSY
// when no healthy decode-capable endpoint exists (decode = SIZE_MAX).
int tdm_router_policy_pick(const struct tdm_router_config *cfg,
                           const struct tdm_router_snapshot *snap,
                           const struct tdm_router_request *req, struct tdm_router_pick *pick);

// Runs one profile alone (for tests and the request path's retries): fills
// ranked[0..*n_ranked) with snapshot indices best first (at most cap), scores
// as above (may be NULL). decode selects the role filter. Returns TDM_EBUSY
// when no candidate is left.
int tdm_router_policy_run_profile(const struct tdm_router_config *cfg, size_t profile, bool decode,
                                  const struct tdm_router_snapshot *snap,
                                  const struct tdm_router_request *req, size_t *ranked, size_t cap,
                                  size_t *n_ranked, struct tdm_router_endpoint_score *scores,
                                  bool *fail_open);

// Whether an endpoint counts as saturated under a utilization-detector's
// parameters (stale or missing load counts as saturated).
bool tdm_router_policy_saturated(const struct tdm_router_plugin_params *p,
                                 const struct tdm_router_endpoint_view *ep);

// Session affinity: the header value the router returns so the client's next
// request sticks to this endpoint (llm-d: base64 of the endpoint name). Writes
// a NUL-terminated string into buf; returns its length (0 when cap is too small).
size_t tdm_router_session_token(const char *endpoint_name, char *buf, size_t cap);

// One line "ep=a total=.. queue-scorer=.. ..." per candidate, for DEBUG logs,
// into buf (truncated to cap). Returns the length written.
size_t tdm_router_policy_format_scores(const struct tdm_router_config *cfg, size_t profile,
                                       const struct tdm_router_snapshot *snap,
                                       const struct tdm_router_endpoint_score *scores, char *buf,
                                       size_t cap);

#endif
