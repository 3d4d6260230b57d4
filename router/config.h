// SPDX-License-Identifier: Apache-2.0
// router config: the router's configuration as an immutable native struct,
// parsed from a YAML (or JSON) file in the llm-d EndpointPickerConfig style
// (apiVersion, kind, plugins, schedulingProfiles) plus Tandem's own sections
// for what llm-d configures elsewhere (endpoints and DNS discovery, health
// checks, request deadline and retries, the prefix index), or from a short form
// (`policy: round_robin`). docs/router-config.md is the format reference;
// deploy/config/ holds examples that the unit tests parse.
//
// A parsed config is never modified: readers take a reference
// (tdm_router_config_ref) and keep it as long as they need it, so a hot reload
// swaps the active pointer while in-flight requests keep the snapshot they
// started with. The config store (bottom of this file) owns the active config,
// watches the file (inotify on its directory, robust to the atomic rename and
// the symlink swap of a Kubernetes ConfigMap update), reloads on demand
// (SIGHUP), and keeps the old config when the new file is invalid.
#ifndef TDM_ROUTER_CONFIG_H
#define TDM_ROUTER_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tdm_router_metrics;

// ---- roles (the llm-d.ai/role label values Tandem uses) ---------------------------------
enum tdm_router_role {
    TDM_ROUTER_ROLE_NONE = 0,       // unlabelled: decode-filter keeps it, prefill-filter drops it
    TDM_ROUTER_ROLE_PREFILL,        // "prefill"
    TDM_ROUTER_ROLE_DECODE,         // "decode"
    TDM_ROUTER_ROLE_PREFILL_DECODE, // "prefill-decode" ("both" accepted as deprecated alias)
    TDM_ROUTER_ROLE_COUNT,
};
// "prefill", "decode", "prefill-decode", "" for NONE; NULL when out of range.
const char *tdm_router_role_name(enum tdm_router_role role);
// llm-d's decode-filter / prefill-filter semantics.
bool tdm_router_role_can_decode(enum tdm_router_role role);
bool tdm_router_role_can_prefill(enum tdm_router_role role);

// Longest endpoint name or host: "host:http_port" with room for an IPv6 literal.
#define TDM_ROUTER_NAME_MAX 128
// The apiVersion /v1/router/config shows for a file that names none: the one
// docs/router-config.md and deploy/config/pd-llm-d.yaml use (llm-d's
// EndpointPickerConfig); a file's own apiVersion is shown as written.
#define TDM_ROUTER_DEFAULT_API_VERSION "llm-d.ai/v1alpha1"

// Prefill endpoints the policy ranks for a route (request.prefill_retries < this).
#define TDM_ROUTER_MAX_PREFILL_CANDIDATES 8

// ---- plugins ---------------------------------------------------------------------------------
enum tdm_router_plugin_kind {
    TDM_ROUTER_PLUGIN_FILTER = 0,
    TDM_ROUTER_PLUGIN_SCORER,
    TDM_ROUTER_PLUGIN_PICKER,
    TDM_ROUTER_PLUGIN_DECIDER,
    TDM_ROUTER_PLUGIN_PROFILE_HANDLER,
    TDM_ROUTER_PLUGIN_PRODUCER,
    TDM_ROUTER_PLUGIN_FLOW_POLICY, // flow control's fairness and ordering policies (no
                                   // profile may list one; flowControl's bands name them)
};

enum tdm_router_plugin_type {
    // filters
    TDM_ROUTER_DECODE_FILTER = 0,    // "decode-filter"
    TDM_ROUTER_PREFILL_FILTER,       // "prefill-filter"
    TDM_ROUTER_HEALTH_FILTER,        // "health-filter" (Tandem; always applied first anyway)
    TDM_ROUTER_UTILIZATION_DETECTOR, // "utilization-detector": saturation filter, fail-open
    // scorers (each returns a score in [0, 1] per endpoint)
    TDM_ROUTER_QUEUE_SCORER,         // "queue-scorer": min-max normalised waiting, short = 1
    TDM_ROUTER_KV_CACHE_UTIL_SCORER, // "kv-cache-utilization-scorer": 1 - kv usage
    TDM_ROUTER_RUNNING_SCORER,       // "running-requests-size-scorer": min-max normalised running
    TDM_ROUTER_PREFIX_CACHE_SCORER,  // "prefix-cache-scorer": matched blocks / prompt blocks
    TDM_ROUTER_LOAD_AWARE_SCORER,    // "load-aware-scorer": 0.5 at empty queue -> 0 at threshold
    TDM_ROUTER_SESSION_AFFINITY_SCORER, // "session-affinity-scorer"
    TDM_ROUTER_ACTIVE_REQUEST_SCORER, // "active-request-scorer": router-tracked in-flight requests
    TDM_ROUTER_COLOCATION_SCORER,     // "colocation-scorer" (Tandem): a prefill endpoint on the
                                      // chosen decode endpoint's host (one pod: CUDA IPC)
    // pickers
    TDM_ROUTER_MAX_SCORE_PICKER,       // "max-score-picker": highest total, random among ties
    TDM_ROUTER_RANDOM_PICKER,          // "random-picker"
    TDM_ROUTER_WEIGHTED_RANDOM_PICKER, // "weighted-random-picker": probability ~ total score
    TDM_ROUTER_ROUND_ROBIN_PICKER,     // "round-robin-picker" (Tandem)
    // P/D deciders
    TDM_ROUTER_PREFIX_PD_DECIDER,     // "prefix-based-pd-decider" (nonCachedTokens)
    TDM_ROUTER_ALWAYS_DISAGG_DECIDER, // "always-disagg-pd-decider"
    // profile handlers
    TDM_ROUTER_SINGLE_PROFILE_HANDLER, // "single-profile-handler"
    TDM_ROUTER_DISAGG_PROFILE_HANDLER, // "disagg-profile-handler" ("pd-profile-handler" deprecated)
    // producers
    TDM_ROUTER_APPROX_PREFIX_PRODUCER, // "approx-prefix-cache-producer": sets the prefix index
    // flow control policies (a priority band's fairnessPolicyRef / orderingPolicyRef)
    TDM_ROUTER_GLOBAL_STRICT_FAIRNESS, // "global-strict-fairness-policy": one order per band
    TDM_ROUTER_ROUND_ROBIN_FAIRNESS,   // "round-robin-fairness-policy": flows take turns
    TDM_ROUTER_FCFS_ORDERING,          // "fcfs-ordering-policy": arrival order within a flow
    TDM_ROUTER_PLUGIN_TYPE_COUNT,
};
// The registered type name ("queue-scorer"); NULL when out of range.
const char *tdm_router_plugin_type_name(enum tdm_router_plugin_type type);
enum tdm_router_plugin_kind tdm_router_plugin_type_kind(enum tdm_router_plugin_type type);

// Parameters: the storage the plugin tables (router/plugins/) point into, one
// member per plugin type that takes parameters (a plugin only uses its type's
// member: the members overlap). A type's table names its fields with their
// keys, ranges and defaults (docs/router-config.md lists them).
struct tdm_router_prefix_index_params { // prefix-cache-scorer, approx-prefix-cache-producer
    int block_size_tokens;              // blockSizeTokens (16); must equal the workers' block size
    int max_prefix_blocks_to_match;     // maxPrefixBlocksToMatch (256)
    int lru_capacity_per_server;        // lruCapacityPerServer (31250 blocks)
};

struct tdm_router_plugin_params {
    union {
        struct {                            // utilization-detector
            int queue_depth_threshold;      // queueDepthThreshold (5): waiting > this = saturated
            double kv_cache_util_threshold; // kvCacheUtilThreshold (0.8): kv usage > this
            double headroom;                // headroom (0): added to both limits as a fraction
        } utilization;
        struct {           // load-aware-scorer
            int threshold; // threshold (128): waiting at which the score reaches 0
        } load_aware;
        struct {                   // active-request-scorer
            int max_busy_requests; // maxBusyRequests (64): in-flight count scored 0
        } active_request;
        struct {               // session-affinity-scorer
            char *header_name; // headerName ("x-session-token"), lower case; NULL = default
        } session_affinity;
        struct {                   // prefix-based-pd-decider
            int non_cached_tokens; // nonCachedTokens (0 = never disaggregate, as llm-d)
        } prefix_decider;
        struct tdm_router_prefix_index_params prefix_index;
        struct { // disagg-profile-handler: names of the profiles and of the decider
            char *decode_profile;  // profiles.decode (NULL = "decode")
            char *prefill_profile; // profiles.prefill (NULL = "prefill")
            char *prefill_decider; // deciders.prefill (NULL: the only decider plugin, if
                                   // exactly one exists; none = always disaggregate)
            int threshold;         // deprecated `threshold`: a prefix decider of its own
            bool threshold_set;    // ... was given
            int hash_block_size;   // deprecated hashBlockSize (0 = not given)
        } disagg_handler;
    };
};

struct tdm_router_plugin {
    char *name; // unique; defaults to the type name
    enum tdm_router_plugin_type type;
    struct tdm_router_plugin_params params;
};

// One plugin used by a profile. Weight only matters for scorers (default 1).
struct tdm_router_profile_ref {
    size_t plugin; // index into tdm_router_config.plugins
    double weight;
};

struct tdm_router_profile {
    char *name;
    struct tdm_router_profile_ref *refs; // [n_refs] in file order
    size_t n_refs;
    // Derived at parse time (indices into refs; SIZE_MAX = none):
    size_t picker; // the profile's picker (max-score-picker if none listed)
};

// ---- endpoints (Tandem section) ------------------------------------------------------------
// A statically listed endpoint.
struct tdm_router_static_endpoint {
    char *host;    // IP address or host name to connect to, as written
    int http_port; // HTTP (OpenAI API, /health)
    int nng_port;  // nng (requests, KV transfer, load reports)
    enum tdm_router_role role;
};

// A DNS name (a Kubernetes headless Service) re-resolved every
// dns_refresh_seconds; every address it resolves to is one endpoint.
struct tdm_router_dns_endpoint {
    char *name;
    int http_port;
    int nng_port;
    enum tdm_router_role role;
};

struct tdm_router_health_config {
    double interval_seconds; // active check period per endpoint (2)
    double timeout_seconds;  // one GET /health (1)
    int failure_threshold;   // consecutive failures (active or passive) -> unhealthy (3)
    int success_threshold;   // consecutive successful checks -> healthy again (1)
    char *path;              // "/health"
};

// ---- flow control (llm-d's EPP flow control layer) ----------------------------------------
// With the flowControl feature gate the router holds requests in priority
// bands while the pool is saturated and dispatches them, highest band first,
// as capacity frees up (router/flow.h). Without it, only requests of negative
// priority (sheddable) are refused while the pool is saturated.
struct tdm_router_flow_band {
    int priority;                         // higher = more important (llm-d's sense)
    long long max_requests;               // queued requests in the band (0 = no limit)
    long long max_bytes;                  // queued request bytes in the band (llm-d: 1 GB)
    enum tdm_router_plugin_type fairness; // GLOBAL_STRICT or ROUND_ROBIN _FAIRNESS
    enum tdm_router_plugin_type ordering; // FCFS_ORDERING
};
#define TDM_ROUTER_FLOW_BAND_MAX_BYTES 1000000000LL // a band's maxBytes when 0 or omitted
#define TDM_ROUTER_FLOW_MAX_BANDS 64

// An InferenceObjective as the router knows it: the name a request gives in
// the x-gateway-inference-objective header, and its priority.
struct tdm_router_objective {
    char *name;
    int priority;
};

struct tdm_router_flow_config {
    bool enabled;           // featureGates lists flowControl
    long long max_requests; // queued requests over all bands (0 = no limit)
    long long max_bytes;    // queued request bytes over all bands (0 = no limit)
    double default_ttl;     // seconds a request may wait (0 = until request.deadline_seconds)
    struct tdm_router_flow_band bands[TDM_ROUTER_FLOW_MAX_BANDS]; // [n_bands], priorities unique
    size_t n_bands;
    struct tdm_router_flow_band default_band; // for priorities no band lists
    // Saturation: the utilization detector's thresholds (saturationDetector.pluginRef,
    // else its defaults). An endpoint's saturation is max(queue / queue_depth,
    // kv usage / kv_util); the pool's is their mean (1 when it has none).
    int queue_depth_threshold;               // 5
    double kv_cache_util_threshold;          // 0.8
    struct tdm_router_objective *objectives; // [n_objectives] (Tandem: no CRDs)
    size_t n_objectives;
};
// The band a priority falls in (the default band when none lists it).
const struct tdm_router_flow_band *tdm_router_flow_band_of(const struct tdm_router_flow_config *fc,
                                                           int priority);
// The priority of an objective name (0 when name is NULL or not listed, as llm-d).
int tdm_router_objective_priority(const struct tdm_router_flow_config *fc, const char *name);

// ---- the whole config ----------------------------------------------------------------------
enum tdm_router_pd_mode {
    TDM_ROUTER_PD_NEVER = 0, // decode-only always (no decider, or nonCachedTokens 0)
    TDM_ROUTER_PD_PREFIX,    // remote prefill when uncached tokens > pd_threshold_tokens
    TDM_ROUTER_PD_ALWAYS,    // remote prefill whenever a prefill endpoint is available
};

struct tdm_router_config {
    // Where it came from.
    char *source_path;  // file path, or NULL when parsed from text
    char *api_version;  // "llm-d.ai/v1alpha1" etc.; NULL in the short form
    char *short_policy; // "round_robin" etc. when the short form was used, else NULL

    struct tdm_router_plugin *plugins; // [n_plugins] (the short form expands into these)
    size_t n_plugins;
    struct tdm_router_profile *profiles; // [n_profiles]
    size_t n_profiles;
    size_t decode_profile;  // index of the profile that picks the decode endpoint
    size_t prefill_profile; // index of the prefill profile; SIZE_MAX when P/D is off

    // P/D decision (from the decider plugin, or pd_* keys of the short form).
    enum tdm_router_pd_mode pd_mode;
    int pd_threshold_tokens; // uncached prompt tokens above which to prefill remotely

    // Endpoints and discovery.
    struct tdm_router_static_endpoint *static_endpoints; // [n_static]
    size_t n_static;
    struct tdm_router_dns_endpoint *dns_endpoints; // [n_dns]
    size_t n_dns;
    double dns_refresh_seconds; // 10
    struct tdm_router_health_config health;
    double load_stale_seconds; // load older than this = saturated (2, as llm-d)

    // Requests.
    double request_deadline_seconds; // whole request, router side (600)
    int prefill_retries;             // prefill endpoints the decode worker is given beyond
                                     // the first, tried in turn before local prefill (1)
    char *session_header;            // header the session policy reads ("x-session-token")

    // Prefix index (approximate, router-side).
    int block_size_tokens;          // 16
    int max_prefix_blocks_to_match; // 256
    int lru_capacity_per_server;    // 31250

    // Flow control and saturation (featureGates, flowControl, saturationDetector,
    // objectives).
    struct tdm_router_flow_config flow;

    // Private: reference count and the original text.
    _Atomic int refs_;
    char *text_;
};

// Parses YAML or JSON text (path, if not NULL, is only used in messages and kept
// as source_path). *out has one reference. TDM_EINVAL with err naming the key
// path and the problem, e.g. "schedulingProfiles[1].plugins[0].pluginRef: no
// plugin named 'queue'" or "line 4: mapping values are not allowed here";
// TDM_ENOMEM.
int tdm_router_config_parse(struct tdm_router_config **out, const char *text, size_t len,
                            const char *path, char *err, size_t errlen);
// Reads and parses a file. TDM_ENOTFOUND / TDM_EIO when it cannot be read.
int tdm_router_config_load(struct tdm_router_config **out, const char *path, char *err,
                           size_t errlen);
// Takes/drops a reference (thread-safe); the last unref frees. NULL is fine.
struct tdm_router_config *tdm_router_config_ref(struct tdm_router_config *cfg);
void tdm_router_config_unref(struct tdm_router_config *cfg);

// The config as JSON (the normalised form: every plugin with its effective
// parameters, profiles, endpoints, timings), heap string the caller frees;
// NULL on ENOMEM. loaded_at (wall seconds, 0 = omit) is written as
// "loaded_at" (RFC 3339) and "loaded_at_unix".
char *tdm_router_config_to_json(const struct tdm_router_config *cfg, double loaded_at);

// ---- the short form, written for a config-free start ------------------------------------------
// One worker of a short-form config.
struct tdm_router_short_endpoint {
    const char *host; // address, IPv6 literals bare or bracketed
    int http_port, nng_port;
};
// The short-form config text (docs/router-config.md) for policy and these
// workers, as `tandem up` writes it and `tandem-router --policy` builds it:
// pd_mode never without prefill workers, else pd_mode and the threshold;
// health checks every second (local workers answer at once). comment, when
// not NULL, is the first line's text after "# ". TDM_OK, or TDM_ECAPACITY when
// buf is too small.
int tdm_router_config_short_text(const char *comment, const char *policy, const char *pd_mode,
                                 int pd_threshold, const struct tdm_router_short_endpoint *prefill,
                                 size_t n_prefill, const struct tdm_router_short_endpoint *decode,
                                 size_t n_decode, char *buf, size_t cap);

// Index of the plugin named name, or SIZE_MAX.
size_t tdm_router_config_find_plugin(const struct tdm_router_config *cfg, const char *name);

// ---- the config store: active config + hot reload ------------------------------------------
struct tdm_router_config_store;

// Called (on the reloading thread) after a new config became active; the old
// one is still referenced by old (valid during the call only).
typedef void (*tdm_router_config_reload_fn)(const struct tdm_router_config *new_cfg,
                                            const struct tdm_router_config *old_cfg, void *arg);

// Loads path (must be valid: the first config has no fallback). metrics may be
// NULL; when set, reloads are counted there. Does not watch yet.
int tdm_router_config_store_new(struct tdm_router_config_store **out, const char *path,
                                struct tdm_router_metrics *metrics, char *err, size_t errlen);
// Stops watching and frees (references held elsewhere stay valid). NULL is fine.
void tdm_router_config_store_free(struct tdm_router_config_store *st);

// Sets the callback run after every successful reload (before watching starts).
void tdm_router_config_store_on_reload(struct tdm_router_config_store *st,
                                       tdm_router_config_reload_fn fn, void *arg);

// The active config with one reference taken (caller unrefs); never NULL.
// *loaded_at (may be NULL) gets its load time (wall seconds).
struct tdm_router_config *tdm_router_config_store_get(struct tdm_router_config_store *st,
                                                      double *loaded_at);

// Re-reads the file now (what SIGHUP calls; safe from any thread, not from a
// signal handler: set a flag there and call this from a normal thread). Returns
// TDM_OK when the new config is active or the file is unchanged (same bytes: no
// swap, not counted), else the error (old config kept; one WARN line;
// failure counted) with err filled.
int tdm_router_config_store_reload(struct tdm_router_config_store *st, char *err, size_t errlen);

// Starts a thread watching the file's directory with inotify (so a rename over
// the file or a ConfigMap's ..data symlink swap is seen); each change is
// debounced (debounce_ms, <= 0 = 100) and then reloaded as above. TDM_EIO when
// inotify cannot be set up.
int tdm_router_config_store_watch(struct tdm_router_config_store *st, int debounce_ms, char *err,
                                  size_t errlen);

// The active config as JSON for GET /v1/router/config: the normalised config
// plus "loaded_at", "loaded_at_unix", "source", "reloads" {success, failure} and
// "last_error" (or null). Heap string; NULL on ENOMEM.
char *tdm_router_config_store_json(struct tdm_router_config_store *st);

// Reload counters since creation (for tests and the JSON).
void tdm_router_config_store_counts(struct tdm_router_config_store *st, uint64_t *success,
                                    uint64_t *failure);

#endif
