// SPDX-License-Identifier: Apache-2.0
// router control: the control plane in one object for the request path. It
// owns the config store (hot reload), the endpoint registry (discovery, health,
// load, prefix index) and the router metrics, and turns a tokenized prompt into
// a route: the decode endpoint, the prefill endpoints (if P/D) in the order the
// decode worker tries them, the decision, and the config snapshot the request
// keeps for its whole life (a reload never changes a request in flight).
//
// Typical use by router_call.c:
//   tdm_router_control_new(&ctl, path, registry, ...); tdm_router_control_start(ctl, ...);
//   per request:  tdm_router_control_route(ctl, tokens, n, session, &r, ...)
//                 send GenerateRequest to r.decode with r.prefill[r.prefill_idx ..
//                   r.n_prefill) as its prefill targets: the decode worker tries
//                   them in order and prefills locally when all fail (the router
//                   does not retry prefill itself); the targets carry the load and
//                   liveness the send needs, as of the route
//                 first chunk: tdm_router_control_prefill_outcome(ctl, &r, remote?)
//                 decode failure: tdm_router_control_route_done_report(...ERROR),
//                   route again within the request's retry budget (retry.h)
//                 decode worker lost mid-stream: tdm_router_control_reroute
//                 tdm_router_control_route_done_report(ctl, &r, "success", SUCCESS)
// A route enters the endpoint registry's lock once and its end once (see
// endpoints.h: tdm_router_endpoints_attempt_begin / _end).
//   load reports: tdm_router_endpoints_on_report(tdm_router_control_endpoints(ctl), id, &rep, ...)
//   SIGHUP:       tdm_router_control_reload(ctl, ...) from a normal thread
//   GET /v1/router/config: tdm_router_control_config_json(ctl)
// Thread-safe: route/reroute/report/prefill_outcome/route_done may run on any thread.
#ifndef TDM_ROUTER_CONTROL_H
#define TDM_ROUTER_CONTROL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "endpoints.h"
#include "flow.h"
#include "policy.h"
#include "router_metrics.h"

struct tdm_router_control;

// An endpoint a request talks to (copied: valid after the registry changes).
struct tdm_router_target {
    uint64_t id;
    char name[TDM_ROUTER_NAME_MAX]; // "host:http_port"
    char host[TDM_ROUTER_NAME_MAX];
    int http_port;
    int nng_port;
    enum tdm_router_role role;
    uint64_t health_epoch; // changed since the last request => drop cached connections
    // As of the route (the snapshot it was picked on):
    uint64_t instance;           // the worker's instance id from its last report (0: none)
    double heard_at;             // tdm_now() when that report arrived (0: never)
    struct tdm_router_load load; // its load in that report (admission: waiting, max_waiting)
};

struct tdm_router_route {
    struct tdm_router_config *cfg;     // reference held until route_done
    enum tdm_router_decision decision; // DECODE_ONLY when no prefill endpoint could be held
    struct tdm_router_target decode;
    struct tdm_router_target prefill[TDM_ROUTER_MAX_PREFILL_CANDIDATES]; // ranked
    size_t n_prefill;     // end of the candidates the decode worker is given: at most
                          // prefill_idx + 1 + request.prefill_retries (0 when decode-only)
    size_t prefill_idx;   // the first candidate still registered (held by the route)
    int max_prefill_attempts; // GenerateRequest.max_prefill_attempts: 1 + request.prefill_retries
                              // when prefill-decode, 0 when decode-only
    size_t cached_tokens; // believed cached on the decode endpoint
    size_t uncached_tokens;
    double deadline;  // tdm_now() + request_deadline_seconds
    double routed_at; // tdm_now() when routed
    // private
    bool decode_held_, prefill_held_;
    uint64_t *block_hashes_; // [n_blocks_] prompt's full-block hashes
    size_t n_blocks_;
};

// Loads the config (must be valid), registers the router metrics on reg (may
// be NULL: no metrics), creates the endpoint registry. No threads yet.
int tdm_router_control_new(struct tdm_router_control **out, const char *config_path,
                           struct tdm_metrics_registry *reg, char *err, size_t errlen);
// Resolves DNS names and checks health once (blocking, bounded by the health
// timeout), then starts the discovery/health thread and, when watch is true,
// the config file watcher.
int tdm_router_control_start(struct tdm_router_control *ctl, bool watch, char *err, size_t errlen);
// Stops the threads and frees. Routes still held must be done first. NULL ok.
void tdm_router_control_free(struct tdm_router_control *ctl);

struct tdm_router_config_store *tdm_router_control_store(struct tdm_router_control *ctl);
struct tdm_router_endpoints *tdm_router_control_endpoints(struct tdm_router_control *ctl);
struct tdm_router_metrics *
tdm_router_control_metrics(struct tdm_router_control *ctl); // NULL if none

// Chooses where a request goes. tokens: the prompt's token ids (for prefix
// matching and the decider); session: the session header value or NULL.
// Picks on a snapshot, acquires the decode endpoint and the first prefill one
// and records the prompt's blocks in their prefix indexes, all in one registry
// entry; counts the decision metrics, logs the scores at DEBUG. TDM_EBUSY (err says which role)
// when no healthy decode endpoint exists (the route is then empty: no route_done needed, but
// harmless); TDM_ENOMEM.
int tdm_router_control_route(struct tdm_router_control *ctl, const int32_t *tokens, size_t n,
                             const char *session, struct tdm_router_route *route, char *err,
                             size_t errlen);
// tdm_router_control_route for a retry: the decode endpoints in avoid[0..n_avoid)
// (those that already failed the request) are not picked while another
// healthy decode endpoint exists; when none does, they may be. A request
// with decode_only is prefilled on its decode worker whatever the pd_mode
// (prompt logprobs need every prompt row's logits there): no prefill pick,
// decision decode-only.
// req: the request as the policy sees it (num_prompt_tokens = the tokens'
// count, session, decode_only, hash_root).
int tdm_router_control_route_avoiding(struct tdm_router_control *ctl, const int32_t *tokens,
                                      const struct tdm_router_request *req, const uint64_t *avoid,
                                      size_t n_avoid, struct tdm_router_route *route, char *err,
                                      size_t errlen);
// route_avoiding in place of old, whose decode worker was lost (a stream
// migration), in the same registry entry: old's decode endpoint is reported
// failed (as tdm_router_control_report) before the pick, and on success old is
// done ("error": its endpoints released after the new ones are held, old
// zeroed). On failure old stays held (reported) and *route is empty.
int tdm_router_control_reroute(struct tdm_router_control *ctl, struct tdm_router_route *old,
                               const int32_t *tokens, const struct tdm_router_request *req,
                               const uint64_t *avoid, size_t n_avoid,
                               struct tdm_router_route *route, char *err, size_t errlen);

// ---- flow control (docs/router-config.md, "Flow control") --------------------------------------
// Before a request is routed: with the flowControl gate on, it waits while the
// pool is saturated (router/flow.h) and may be refused (RejectedCapacity) or
// evicted (EvictedTTL, EvictedContextCancelled, EvictedOther); with it off,
// only a request of negative priority is refused (SHED) while the pool is
// saturated. Its priority is the objective's (config `objectives`; 0 when
// none). On DISPATCHED the caller routes and sends it and then calls
// tdm_router_control_admitted (whatever the outcome).
struct tdm_router_admit_ask {
    const char *objective;   // x-gateway-inference-objective, or NULL
    const char *fairness_id; // x-gateway-inference-fairness-id, or NULL ("default-flow")
    long long bytes;         // the request body's size
    double deadline;         // tdm_now() time past which it may not wait (the request's deadline)
    bool (*gone)(void *arg); // the client left? (may be NULL)
    void *gone_arg;
    bool may_wait; // false: refused where it would have to wait (no thread to spare)
};
enum tdm_router_flow_outcome tdm_router_control_admit(struct tdm_router_control *ctl,
                                                      const struct tdm_router_admit_ask *ask,
                                                      struct tdm_router_flow_ticket *t);
void tdm_router_control_admitted(struct tdm_router_control *ctl, struct tdm_router_flow_ticket *t);
// A load report arrived: waiting requests may go.
void tdm_router_control_load_changed(struct tdm_router_control *ctl);
// Shutdown: evicts the waiting requests (EvictedOther) and refuses new ones.
void tdm_router_control_stop_flow(struct tdm_router_control *ctl);
// The pool's saturation now (mean over ready endpoints; 1 = saturated).
double tdm_router_control_saturation(struct tdm_router_control *ctl);

// The route's request was sent to its decode worker: counts the picks
// (tandem:router_endpoint_picks_total, decode and prefill endpoint). Or it
// could not be sent there (no connection, a failed handshake): counts a
// fallback (tandem:router_endpoint_fallbacks_total) instead; the request then
// goes elsewhere or fails, so a pick is only counted where a request went.
void tdm_router_control_route_sent(struct tdm_router_control *ctl,
                                   const struct tdm_router_route *r);
void tdm_router_control_route_unsent(struct tdm_router_control *ctl,
                                     const struct tdm_router_route *r);

// The first chunk said who prefilled: remote (a prefill worker) or not (the
// decode worker itself). A PREFILL_DECODE route prefilled locally counts
// tandem:router_prefill_fallback_total.
void tdm_router_control_prefill_outcome(struct tdm_router_control *ctl,
                                        const struct tdm_router_route *r, bool remote);
// Passive health + upstream error metrics for one endpoint of the route.
void tdm_router_control_report(struct tdm_router_control *ctl, const struct tdm_router_target *t,
                               enum tdm_router_outcome outcome);
// Releases the endpoints and the config reference; counts the request with
// status ("success", "error", "cancelled"). Safe on a zeroed or failed route.
void tdm_router_control_route_done(struct tdm_router_control *ctl, struct tdm_router_route *r,
                                   const char *status);
// route_done with tdm_router_control_report(ctl, &r->decode, outcome) first,
// in the same registry entry (nothing is reported for a zeroed route).
void tdm_router_control_route_done_report(struct tdm_router_control *ctl,
                                          struct tdm_router_route *r, const char *status,
                                          enum tdm_router_outcome outcome);

// SIGHUP: reloads the config file now (see tdm_router_config_store_reload).
int tdm_router_control_reload(struct tdm_router_control *ctl, char *err, size_t errlen);
// GET /v1/router/config body (heap JSON with the endpoints and their state
// under "endpoints_state"); NULL on ENOMEM.
char *tdm_router_control_config_json(struct tdm_router_control *ctl);

#endif
