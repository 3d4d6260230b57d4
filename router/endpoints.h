// SPDX-License-Identifier: Apache-2.0
// router endpoints: the thread-safe registry of prefill and decode workers the
// router can send to. Endpoints come from the config's static lists and from DNS
// names (getaddrinfo, re-resolved periodically: new addresses are added,
// vanished ones drain: no new requests, removed once their in-flight requests
// finish). Each endpoint carries:
//   - health: active checks (GET <health.path> on its HTTP port every interval,
//     with a timeout; failure_threshold consecutive failures mark it unhealthy,
//     success_threshold successes mark it healthy again) and passive reports
//     from the request path (errors and timeouts count as failures, successes
//     reset the count). health_epoch increments each time it turns healthy, so
//     the request path can drop connection state to a worker that restarted.
//   - load and liveness: running, waiting, KV usage as the worker last reported
//     it (over nng; tdm_router_endpoints_on_report) with the time it arrived and
//     the worker's instance id (a new one = a restart); load older than
//     load_stale_seconds = treated as saturated (as llm-d does), and the router
//     judges a stream's worker lost from the same time.
//   - in-flight requests tracked by the router (acquire/release), and of those
//     the ones held since the worker's last report (`unreported`): what its
//     load does not show yet. Load-aware scorers add them to the reported
//     queue (plugins.h, tdm_router_queue_estimate), so a burst between two
//     reports spreads and a worker that has not reported yet is judged by the
//     router's in-flight count alone instead of looking idle forever.
//   - an approximate prefix index: an LRU set of the chained block hashes of the
//     prompts routed there (capacity lru_capacity_per_server blocks), which KV
//     events (stored/evicted hashes) from the worker can also feed exactly.
//
// Block hash (tdm_router_block_hashes): identical to the decode worker's KV
// cache (common/engine/kv, kv_hash_block): for block i of block_size tokens,
//   h_i = H(h_{i-1}, tokens[i*bs .. (i+1)*bs)), h_{-1} = 0 (or, for a request
//   with a cache_salt, tdm_kv_salt_hash of it),
// H = an xxHash64-style accumulation of two 32-bit token ids per 64-bit lane
// (P1 0x9E3779B185EBCA87, P2 0xC2B2AE3D27D4EB4F, P3 0x165667B19E3779F9), length
// mixed in, murmur3 fmix64 finish, 0 mapped to 1. Only full blocks are hashed.
// So a KV event's hash is the same number the router computed for that prefix.
//
// Policies never see the registry: they get a snapshot (a plain array copied
// under the lock, prefix matches for the request already counted). The request
// path enters the lock twice per attempt: tdm_router_endpoints_attempt_begin
// copies the snapshot, runs the caller's pick on the copy, holds and records
// what was picked and hands the copy back (its views carry the load and
// liveness the attempt reads), and tdm_router_endpoints_attempt_end reports and
// releases; a stream's liveness check between them is one more entry each time
// (tdm_router_endpoints_liveness).
#ifndef TDM_ROUTER_ENDPOINTS_H
#define TDM_ROUTER_ENDPOINTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"

struct tdm_router_endpoints;
struct tdm_router_metrics;

// Load as a worker reports it.
struct tdm_router_load {
    int running;     // requests in the running batch (vllm:num_requests_running)
    int waiting;     // queued requests (vllm:num_requests_waiting)
    double kv_usage; // KV cache usage fraction, 0..1 (vllm:kv_cache_usage_perc)
    int max_waiting; // the worker's waiting-queue bound; 0 = not told (an older worker)
    int max_running; // the worker's running-batch bound; 0 = not told (an older worker)
};

// One endpoint as a policy sees it: a copy, valid as long as the snapshot.
// Startup grace: a worker that has not answered a health check yet is
// starting, not failing (the router usually probes before the workers listen).
// Its failed checks still take it out of routing, but they are logged at debug
// level; only when it has not answered for this long is that a warning.
#define TDM_ROUTER_STARTUP_GRACE_S 30.0

struct tdm_router_endpoint_view {
    uint64_t id;                    // unique for the registry's life (never reused)
    char name[TDM_ROUTER_NAME_MAX]; // "host:http_port" ("[v6]:port"); metric label value
    char host[TDM_ROUTER_NAME_MAX]; // address to connect to (IP for DNS-discovered ones)
    int http_port;
    int nng_port;
    enum tdm_router_role role;
    bool healthy;                // passes checks (endpoints present at startup start healthy,
                                 // later ones join at their first good check)
    bool starting;               // never answered a check yet and added less than
                                 // TDM_ROUTER_STARTUP_GRACE_S ago: its state is unknown,
                                 // and failing checks are not logged as a failure
    bool draining;               // removed from config/DNS: takes no new requests
    bool busy;                   // its last active health check timed out while its load
                                 // reports stayed fresh: overloaded, not dead (not counted as
                                 // a failed check)
    const char *unhealthy_reason; // NULL when healthy, else "auth" (its nng inbox refuses
                                  // the router's handshake: another TANDEM_INTERNAL_SECRET),
                                  // "starting" (no check answered yet, within the grace) or
                                  // "health_check" (its checks fail); a static string
    uint64_t health_epoch;       // increments on every unhealthy -> healthy turn
    uint64_t instance;           // the worker's instance id from its last report (0: none)
    int inflight;                // router-tracked requests in flight
    int unreported;              // of those, held since the last report (all of them when
                                 // it never reported): a report resets it to 0, and it never
                                 // exceeds inflight (a finished request is in no queue)
    struct tdm_router_load load; // last report (zeros if none yet)
    bool has_load;               // a report arrived at least once
    bool load_stale;             // no report, or older than load_stale_seconds
    double load_age_seconds;     // seconds since the report (< 0: never)
    double heard_at;             // tdm_now() when the report arrived (0: never); liveness
    bool not_up;                 // tdm_router_endpoint_not_up: never reported and the load
                                 // poller's link to its inbox is down (not started yet,
                                 // restarting, a wrong nng port): no policy picks it, and
                                 // nothing counts against its health for that
    int prefix_match_blocks;     // leading request blocks this endpoint is believed to cache
};

// The one test of whether the router can route to a worker at all: false when
// it was never heard from (heard_at == 0: no load report) while the router's
// control-plane link to its inbox is down (link_down). Such a worker is no
// candidate (the view's not_up; policy.h) until the link is up or it reports,
// as llm-d's EPP routes only to endpoints it considers ready; one it has heard
// from and lost is judged by its health and liveness instead.
bool tdm_router_endpoint_not_up(double heard_at, bool link_down);

// Whether a policy may pick the endpoint (its role and the profile's filters
// aside): healthy, up (not the view's not_up) and not draining. The one
// predicate behind both the routing filter (policy.c) and the gauge
// tandem:router_ready_endpoints{role}, which counts the endpoints of each role
// for which it holds.
bool tdm_router_endpoint_ready(const struct tdm_router_endpoint_view *v);

// What a policy scores: endpoints in registry order (stable: by id).
struct tdm_router_snapshot {
    struct tdm_router_endpoint_view *eps; // [n]
    size_t n;
    size_t n_request_blocks; // full blocks in the request's prompt (prefix denominator)
    uint64_t seq;            // registry-wide pick sequence number (round robin position)
    uint64_t seed;           // per-snapshot random seed (random pickers, tie-breaking)
    double now;              // tdm_now() when taken
};
void tdm_router_snapshot_free(struct tdm_router_snapshot *snap); // frees eps; NULL ok

// ---- block hashes ----------------------------------------------------------------------------
// Writes the chained hashes of the full blocks of tokens[0..n) into out (at most
// cap); returns the number of full blocks (n / block_size) even when larger than
// cap (like snprintf). block_size <= 0 returns 0. root is the chain's root
// (h_{-1}): 0, or the request's cache_salt's (tdm_kv_salt_hash), as the
// workers hash that request's blocks.
size_t tdm_router_block_hashes(const int32_t *tokens, size_t n, int block_size, uint64_t root,
                               uint64_t *out, size_t cap);

// ---- registry --------------------------------------------------------------------------------
// A resolver for DNS names (tests inject a fake). Writes up to cap numeric
// addresses ("10.0.0.5", "fd00::5") into addrs (each TDM_ROUTER_NAME_MAX bytes)
// and returns how many (>= 0), or -1 when the name does not resolve (the
// endpoints of that name are then kept: a DNS hiccup must not empty the pool).
typedef int (*tdm_router_resolve_fn)(const char *name, char (*addrs)[TDM_ROUTER_NAME_MAX], int cap,
                                     void *arg);
// The default resolver: getaddrinfo (AF_UNSPEC, SOCK_STREAM), deduplicated.
int tdm_router_resolve_getaddrinfo(const char *name, char (*addrs)[TDM_ROUTER_NAME_MAX], int cap,
                                   void *arg);

// Creates the registry from cfg (static endpoints added at once; DNS names
// resolved on the first tdm_router_endpoints_refresh_dns). metrics may be NULL.
// Does not start threads.
int tdm_router_endpoints_new(struct tdm_router_endpoints **out, const struct tdm_router_config *cfg,
                             struct tdm_router_metrics *metrics, char *err, size_t errlen);
// Stops the threads, frees everything. NULL is fine.
void tdm_router_endpoints_free(struct tdm_router_endpoints *reg);

// Replaces the resolver (before start; NULL restores getaddrinfo).
void tdm_router_endpoints_set_resolver(struct tdm_router_endpoints *reg, tdm_router_resolve_fn fn,
                                       void *arg);

// Applies a new config (hot reload): static endpoints no longer listed drain,
// new ones are added, DNS names are re-resolved now, health/LRU settings take
// effect at the next check. Existing endpoints keep their state.
int tdm_router_endpoints_apply_config(struct tdm_router_endpoints *reg,
                                      const struct tdm_router_config *cfg);

// Resolves every DNS name of the current config once now: adds new addresses,
// drains vanished ones. Returns TDM_OK (names that failed to resolve are logged
// and keep their endpoints).
int tdm_router_endpoints_refresh_dns(struct tdm_router_endpoints *reg);

// Runs one round of active health checks on every endpoint now (blocking; at
// most timeout per endpoint, checks run in parallel). For tests and startup.
// A check that times out on an endpoint whose load report is younger than
// load_stale_seconds marks it busy and is not counted as a failure (overload
// is not death); refusals and error statuses count as before.
void tdm_router_endpoints_check_health(struct tdm_router_endpoints *reg);

// Starts the background thread: DNS every dns_refresh_seconds, health checks
// every health.interval_seconds, removal of drained endpoints. TDM_ENOMEM if the
// thread cannot start.
int tdm_router_endpoints_start(struct tdm_router_endpoints *reg);
// Stops the thread (also done by free). Safe to call twice.
void tdm_router_endpoints_stop(struct tdm_router_endpoints *reg);

// Copies every endpoint that is not draining into *snap (heap; free with
// tdm_router_snapshot_free), counting for each how many leading request blocks
// (block_hashes[0..n_blocks), at most max_prefix_blocks_to_match) its prefix
// index holds. block_hashes may be NULL with n_blocks 0. TDM_ENOMEM.
int tdm_router_endpoints_snapshot(struct tdm_router_endpoints *reg, const uint64_t *block_hashes,
                                  size_t n_blocks, struct tdm_router_snapshot *snap);

// Looks an endpoint up by id or by name ("host:http_port"); copies it into *out.
// TDM_ENOTFOUND when unknown or already removed.
int tdm_router_endpoints_get(struct tdm_router_endpoints *reg, uint64_t id,
                             struct tdm_router_endpoint_view *out);
int tdm_router_endpoints_find(struct tdm_router_endpoints *reg, const char *name,
                              struct tdm_router_endpoint_view *out);
// Number of endpoints (not draining) and of those healthy, per role filter:
// role_can_decode (decode = true) or role_can_prefill (decode = false).
void tdm_router_endpoints_count(struct tdm_router_endpoints *reg, bool decode, size_t *total,
                                size_t *healthy);
// Endpoints (not draining, any role) whose nng inbox refuses the router's
// handshake (tdm_router_endpoints_set_auth): named in "no healthy" errors.
size_t tdm_router_endpoints_count_auth_failed(struct tdm_router_endpoints *reg);

// ---- an attempt's two entries (the request path) ------------------------------------------------
// How a request went on an endpoint, for passive health (tdm_router_endpoints_report).
enum tdm_router_outcome {
    TDM_ROUTER_OUTCOME_SUCCESS = 0, // a response came back (resets the failure count)
    TDM_ROUTER_OUTCOME_ERROR,       // connection refused/reset, 5xx, protocol error
    TDM_ROUTER_OUTCOME_TIMEOUT,     // no answer within the deadline
};

// The endpoints an attempt holds, as indices into the snapshot it was picked on.
struct tdm_router_held {
    size_t decode;  // the decode endpoint (SIZE_MAX: none picked)
    size_t prefill; // the prefill endpoint in use (SIZE_MAX: none, decode-only)
    // When the pick found nothing (TDM_EBUSY), for the error: decode-capable
    // endpoints not draining, how many of those are healthy, and endpoints (not
    // draining, any role) refusing the router's handshake; as
    // tdm_router_endpoints_count and _count_auth_failed; and of the healthy
    // decode-capable ones, those not up (the view's not_up).
    size_t n_decode, n_decode_healthy, n_auth_failed, n_decode_not_up;
};

// The caller's pick on the copied snapshot: sets held->decode (and
// held->prefill, or SIZE_MAX) and returns TDM_OK, or returns an error
// (TDM_EBUSY: nothing to pick). It runs under the registry's lock, so it must
// be quick and must not call the registry (a policy over the copy: no I/O, no
// lock); it may change the copy's views (an avoided endpoint marked unhealthy).
typedef int (*tdm_router_pick_fn)(void *arg, struct tdm_router_snapshot *snap,
                                  struct tdm_router_held *held);

// What an attempt gives back at its end.
struct tdm_router_give_back {
    uint64_t report;                 // endpoint to report on first (0: no report)
    enum tdm_router_outcome outcome; // its outcome, as tdm_router_endpoints_report
    uint64_t release[2];             // endpoints to release, as tdm_router_endpoints_release
                                     // (0: none): the held decode and prefill endpoints
};

// An attempt's first entry, all under one lock: prev's report (when prev is
// not NULL: the attempt this one replaces); the snapshot of
// tdm_router_endpoints_snapshot; pick(arg, snap, held); then the picked
// endpoints acquired (in-flight + 1) with block_hashes recorded in their
// prefix indexes (decode first, as tdm_router_endpoints_record_prefix); then
// prev's releases. *snap is the caller's (free with tdm_router_snapshot_free)
// after TDM_OK and after a failed pick: its views are what the attempt reads
// of its endpoints (admission load, instance ids, heard_at). On failure
// nothing is held or recorded and prev is reported but not released; the
// pick's error is returned (TDM_EBUSY with held's counts set), or TDM_ENOMEM.
int tdm_router_endpoints_attempt_begin(struct tdm_router_endpoints *reg,
                                       const uint64_t *block_hashes, size_t n_blocks,
                                       tdm_router_pick_fn pick, void *arg,
                                       const struct tdm_router_give_back *prev,
                                       struct tdm_router_snapshot *snap,
                                       struct tdm_router_held *held);
// An attempt's last entry, under one lock: end's report, then its releases.
void tdm_router_endpoints_attempt_end(struct tdm_router_endpoints *reg,
                                      const struct tdm_router_give_back *end);

// How many times the registry's lock was entered, by who (counted under the
// lock, so exact; for tests that count a request's entries). request: the
// request path's calls (attempt_begin, attempt_end) and the single-step calls
// it could make instead (snapshot, get, find, count, count_auth_failed,
// acquire, release, report, record_prefix, unanswered_since); liveness:
// tdm_router_endpoints_liveness (a stream's check: once per wait that heard
// nothing, so timing decides how many); other: everything else (reports, the
// load poller, health checks, DNS, reloads, listings, test setters, this).
struct tdm_router_lock_entries {
    uint64_t request, liveness, other;
};
void tdm_router_endpoints_lock_entries(struct tdm_router_endpoints *reg,
                                       struct tdm_router_lock_entries *out);

// ---- one step each (thread-safe, no allocation) --------------------------------------------
// A request starts using the endpoint: in-flight + 1 (a draining endpoint is
// not removed while in-flight > 0). TDM_ENOTFOUND if the id is gone.
int tdm_router_endpoints_acquire(struct tdm_router_endpoints *reg, uint64_t id);
// The request is done with it: in-flight - 1.
void tdm_router_endpoints_release(struct tdm_router_endpoints *reg, uint64_t id);

// Passive health: errors and timeouts count toward failure_threshold exactly as
// failed active checks do; a success resets the count (it does not by itself
// revive an unhealthy endpoint: the active check does that).
void tdm_router_endpoints_report(struct tdm_router_endpoints *reg, uint64_t id,
                                 enum tdm_router_outcome outcome);

// A worker's LoadReport as the router received it (arrays borrowed for the call).
struct tdm_router_report {
    uint64_t instance;           // the worker process's instance id (0 = not given)
    struct tdm_router_load load; // its load
    bool has_kv_events;          // the report carried KV events (decode workers)
    uint64_t kv_batch;           // their batch number (consecutive unless one was lost)
    bool kv_cleared;             // the worker lost events itself (overflow): index untrusted
    const uint64_t *stored;      // [n_stored] block hashes now cached
    size_t n_stored;
    const uint64_t *evicted; // [n_evicted] block hashes no longer cached
    size_t n_evicted;
};

// Records a worker's report under one lock: the load and the time it arrived
// (the endpoint's single "last heard" time, load staleness and liveness alike),
// the instance id, and the KV events. A different instance id than the last
// report's means the worker restarted: its prefix index is cleared (*restarted
// = true). KV events after a gap in batch numbers (a lost report) or with
// kv_cleared clear the index before they apply, as the index can no longer be
// trusted; the first report's events apply on top of what the router recorded
// itself (*resynced = true when the index was cleared for lost events).
// restarted/resynced may be NULL. TDM_ENOTFOUND for an unknown id.
int tdm_router_endpoints_on_report(struct tdm_router_endpoints *reg, uint64_t id,
                                   const struct tdm_router_report *r, bool *restarted,
                                   bool *resynced);

// What a stream's liveness check reads of its decode worker, in one lock entry.
struct tdm_router_liveness {
    uint64_t instance;       // the instance id of its last report (0: none yet)
    double heard_at;         // when that report arrived (tdm_now(); 0: never)
    double unanswered_since; // as tdm_router_endpoints_unanswered_since (0: fewer than two)
};
// The endpoint's liveness now. TDM_ENOTFOUND (all 0) for an unknown or removed id.
int tdm_router_endpoints_liveness(struct tdm_router_endpoints *reg, uint64_t id,
                                  struct tdm_router_liveness *out);

// The load poller sent endpoint id a LoadQuery at `now` (tdm_now()). The
// registry keeps when the first two queries since the endpoint's last report
// (or set_load) were sent; a report clears them.
void tdm_router_endpoints_note_query(struct tdm_router_endpoints *reg, uint64_t id, double now);
// When the second query the endpoint has not answered was sent (0: it left
// fewer than two unanswered, or the id is unknown). A worker counts as silent
// only once such a query is older than the liveness timeout: the router must
// have asked twice, the second time after any stall of its own that kept the
// first unanswered or unread, so a router that was late never condemns a
// worker by its own silence (issue 29, part 6).
double tdm_router_endpoints_unanswered_since(struct tdm_router_endpoints *reg, uint64_t id);

// Load alone (timestamped now), as on_report without instance or KV events.
// TDM_ENOTFOUND for an unknown id.
int tdm_router_endpoints_set_load(struct tdm_router_endpoints *reg, uint64_t id,
                                  const struct tdm_router_load *load);

// Approximate index: the request's block hashes were routed to id (they will be
// cached there); inserted/refreshed in its LRU.
void tdm_router_endpoints_record_prefix(struct tdm_router_endpoints *reg, uint64_t id,
                                        const uint64_t *block_hashes, size_t n_blocks);
// KV events from the worker: blocks stored (inserted) and evicted (removed).
int tdm_router_endpoints_apply_kv_event(struct tdm_router_endpoints *reg, uint64_t id,
                                        const uint64_t *stored, size_t n_stored,
                                        const uint64_t *evicted, size_t n_evicted);
// Forgets the endpoint's whole index (a worker restart: its cache is empty).
void tdm_router_endpoints_clear_prefix(struct tdm_router_endpoints *reg, uint64_t id);

// Every endpoint (draining ones too) into out[0..cap); returns the count (may
// exceed cap). For GET /v1/router/config and tests.
size_t tdm_router_endpoints_list(struct tdm_router_endpoints *reg,
                                 struct tdm_router_endpoint_view *out, size_t cap);
// Blocks in the endpoint's prefix index (0 for an unknown id).
size_t tdm_router_endpoints_prefix_size(struct tdm_router_endpoints *reg, uint64_t id);
// Seeds the generator of snapshot seeds (tests replay decisions with it).
void tdm_router_endpoints_set_seed(struct tdm_router_endpoints *reg, uint64_t seed);

// The router's control-plane link to the endpoint's nng inbox (the load
// poller's outbox, tdm_net_link_state): failed = its handshake fails (another
// TANDEM_INTERNAL_SECRET, none, or not a Tandem inbox). Such an endpoint is
// unhealthy at once, with reason "auth", whatever its HTTP checks say (they
// pass: its HTTP port answers), and the router logs one ERROR for it naming
// the variable to set; failed = false (the handshake passes again, or the
// inbox is not reachable at all) lets its next good check bring it back.
// why: the transport's reason, or what changed.
void tdm_router_endpoints_set_auth(struct tdm_router_endpoints *reg, uint64_t id, bool failed,
                                   const char *why);

// The load poller's link to the endpoint's inbox (its outbox,
// tdm_net_link_state): down = not connected (refused, unreachable, lost).
// With no report from it yet, a down link makes the endpoint not up (the
// view's not_up: no candidate) until the link is up or a report arrives; the
// poller sets it every round, so it lags the link by at most one load interval.
// An endpoint starts with its link not known down.
void tdm_router_endpoints_set_link_down(struct tdm_router_endpoints *reg, uint64_t id, bool down);

// For tests: marks an endpoint healthy/unhealthy directly.
void tdm_router_endpoints_set_healthy(struct tdm_router_endpoints *reg, uint64_t id, bool healthy);

#endif
