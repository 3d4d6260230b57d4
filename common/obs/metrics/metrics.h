// SPDX-License-Identifier: Apache-2.0
// metrics: the Prometheus metrics registry every Tandem service exports from
// /metrics. A registry holds metric families (counters, gauges, histograms) in
// registration order; each family has a name, HELP text, constant labels (from
// the registry and/or the family) and optional variable label names whose
// children ("series") are created on first lookup and cached for the life of
// the registry. Rendering writes the text exposition format 0.0.4 exactly as
// Python's prometheus_client (which vLLM uses) lays it out: counters get the
// `_total` suffix on HELP, TYPE and sample lines, label pairs are sorted by name
// (`le` included), histograms write cumulative `_bucket{le=...}` lines ending in
// `le="+Inf"`, then `_sum` and `_count`.
//
// Threads: updates (inc, add, set, observe) are lock-free C11 atomics and never
// allocate, so the engine thread may call them per step or per token.
// Registration and child creation take the registry's mutex and allocate; child
// lookup of an existing child takes no lock. Rendering takes no lock either and
// may run on an HTTP thread while others update and register: it sees every
// family and child published before it reached it. A histogram's `_count`
// always equals its `+Inf` bucket in one rendering (both come from the same bucket
// reads); `_sum` may lag or lead by the observations in flight.
//
// Ownership: the registry owns every family and child; handles stay valid until
// tdm_metrics_registry_free. There is no unregistering. Every update function
// accepts NULL (a no-op), so a service may ignore a failed child lookup.
#ifndef TDM_METRICS_H
#define TDM_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h" // enum tdm_finish

struct tdm_metrics_registry;
struct tdm_metrics_counter;   // one series of a counter family (or the family's root)
struct tdm_metrics_gauge;     // one series of a gauge family (or the family's root)
struct tdm_metrics_histogram; // one series of a histogram family (or the family's root)

// A constant label pair. Both strings are copied at registration.
struct tdm_metrics_label {
    const char *name;  // [a-zA-Z_][a-zA-Z0-9_]*, not starting with "__", not "le"
    const char *value; // any UTF-8; escaped when rendered
};

// What a family is registered with; every string is copied.
struct tdm_metrics_opts {
    const char *name; // [a-zA-Z_:][a-zA-Z0-9_:]*; a counter's trailing "_total" is
                      // stripped (as prometheus_client does) and added back on output
    const char *help; // HELP text; backslash and newline are escaped on output
    const struct tdm_metrics_label *const_labels; // [n_const_labels] this family's constant labels
    size_t n_const_labels;
    const char *const *label_names; // [n_label_names] variable label names (e.g. "finished_reason")
    size_t n_label_names;
    bool no_registry_labels; // true: do not add the registry's constant labels to this family
                             // (vLLM's cache_config_info carries `engine` but no model_name)
};

// ---- registry -----------------------------------------------------------------------
// Creates an empty registry whose constant labels (copied; may be NULL/0) go on
// every family registered without no_registry_labels. Returns TDM_EINVAL for a
// bad or duplicate label name, TDM_ENOMEM.
int tdm_metrics_registry_new(struct tdm_metrics_registry **out,
                             const struct tdm_metrics_label *const_labels, size_t n_const_labels,
                             char *err, size_t errlen);
// Frees the registry and every handle it gave out. Accepts NULL. No other thread
// may use the registry or its handles any more.
void tdm_metrics_registry_free(struct tdm_metrics_registry *reg);

// ---- registration (slow path: locks, allocates) -------------------------------------
// Each returns the family's root handle in *out. For a family without variable
// labels the root is its only series; for one with variable labels the root is
// not exported (update children from tdm_metrics_*_labels instead).
// Errors: TDM_EINVAL for a bad name, bad or duplicate label name, or a name
// whose exported series (name, name_total, name_bucket, name_sum, name_count)
// collide with an already registered family; TDM_ENOMEM.
int tdm_metrics_counter_register(struct tdm_metrics_counter **out, struct tdm_metrics_registry *reg,
                                 const struct tdm_metrics_opts *opts, char *err, size_t errlen);
int tdm_metrics_gauge_register(struct tdm_metrics_gauge **out, struct tdm_metrics_registry *reg,
                               const struct tdm_metrics_opts *opts, char *err, size_t errlen);
// bounds: [n_bounds] strictly increasing upper bounds (copied). A trailing +Inf
// is accepted and dropped (the +Inf bucket is always there); NaN, -Inf or an
// infinite bound before the end is TDM_EINVAL. n_bounds may be 0.
int tdm_metrics_histogram_register(struct tdm_metrics_histogram **out,
                                   struct tdm_metrics_registry *reg,
                                   const struct tdm_metrics_opts *opts, const double *bounds,
                                   size_t n_bounds, char *err, size_t errlen);
// An info-style metric: a gauge family, no variable labels, set to 1, whose
// labels carry the information (`vllm:cache_config_info{block_size="16",...} 1`).
// opts->label_names must be empty. Errors as tdm_metrics_gauge_register.
int tdm_metrics_info_register(struct tdm_metrics_gauge **out, struct tdm_metrics_registry *reg,
                              const struct tdm_metrics_opts *opts, char *err, size_t errlen);

// ---- children -----------------------------------------------------------------------
// Returns the child of a family with variable labels for these label values
// (in label_names order; copied on first use), creating it on first use. The
// lookup of an existing child is lock-free and allocation-free (a hash compare
// along the family's list), so calling it per request is fine; callers on the
// per-token path should keep the handle. Returns NULL when n_values differs from
// the family's label count, a value is NULL, family is NULL or is itself a child,
// or on ENOMEM.
struct tdm_metrics_counter *tdm_metrics_counter_labelsv(struct tdm_metrics_counter *family,
                                                        const char *const *values, size_t n_values);
struct tdm_metrics_gauge *tdm_metrics_gauge_labelsv(struct tdm_metrics_gauge *family,
                                                    const char *const *values, size_t n_values);
struct tdm_metrics_histogram *tdm_metrics_histogram_labelsv(struct tdm_metrics_histogram *family,
                                                            const char *const *values,
                                                            size_t n_values);
// Convenience: tdm_metrics_counter_labels(family, "stop") etc. The count of
// values is taken from the argument list, so a wrong count returns NULL.
#define TDM_METRICS_NARGS_(...) (sizeof((const char *[]){__VA_ARGS__}) / sizeof(const char *))
#define tdm_metrics_counter_labels(family, ...)                                                    \
    tdm_metrics_counter_labelsv((family), (const char *const[]){__VA_ARGS__},                      \
                                TDM_METRICS_NARGS_(__VA_ARGS__))
#define tdm_metrics_gauge_labels(family, ...)                                                      \
    tdm_metrics_gauge_labelsv((family), (const char *const[]){__VA_ARGS__},                        \
                              TDM_METRICS_NARGS_(__VA_ARGS__))
#define tdm_metrics_histogram_labels(family, ...)                                                  \
    tdm_metrics_histogram_labelsv((family), (const char *const[]){__VA_ARGS__},                    \
                                  TDM_METRICS_NARGS_(__VA_ARGS__))

// ---- hot path: lock-free, no allocation, NULL is a no-op -----------------------------
// Counters only go up: a negative or NaN amount is ignored.
void tdm_metrics_counter_inc(struct tdm_metrics_counter *c);
void tdm_metrics_counter_add(struct tdm_metrics_counter *c, double amount);
void tdm_metrics_gauge_set(struct tdm_metrics_gauge *g, double value);
void tdm_metrics_gauge_add(struct tdm_metrics_gauge *g, double delta);
void tdm_metrics_gauge_inc(struct tdm_metrics_gauge *g);
void tdm_metrics_gauge_dec(struct tdm_metrics_gauge *g);
// Counts value in the first bucket whose bound is >= value (+Inf for NaN) and
// adds it to the sum.
void tdm_metrics_histogram_observe(struct tdm_metrics_histogram *h, double value);

// ---- reading back (atomic loads; 0 for NULL) ------------------------------------------
double tdm_metrics_counter_value(const struct tdm_metrics_counter *c);
double tdm_metrics_gauge_value(const struct tdm_metrics_gauge *g);
uint64_t tdm_metrics_histogram_count(const struct tdm_metrics_histogram *h);
double tdm_metrics_histogram_sum(const struct tdm_metrics_histogram *h);
// Cumulative count of observations <= bound number i (i == n_bounds: the +Inf
// bucket, equal to the count); 0 when i is out of range.
uint64_t tdm_metrics_histogram_bucket(const struct tdm_metrics_histogram *h, size_t i);

// ---- exposition ------------------------------------------------------------------------
// Content-Type of the rendered text.
#define TDM_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

// Renders the whole registry in the text format into a heap buffer, NUL-terminated
// (*out, caller frees; *len excludes the NUL). Returns TDM_ENOMEM or TDM_EINVAL.
int tdm_metrics_render(const struct tdm_metrics_registry *reg, char **out, size_t *len);
// Same, into a caller-kept buffer reused across scrapes: *buf (heap, may be NULL)
// of *cap bytes grows with realloc as needed; on success *len is the text length
// (NUL-terminated). On failure *buf/*cap stay valid for the caller to free.
int tdm_metrics_render_buf(const struct tdm_metrics_registry *reg, char **buf, size_t *cap,
                           size_t *len);

// Formats a sample value as the exposition writes it into dst[32]: "NaN", "+Inf",
// "-Inf", integers below 2^53 without exponent or fraction ("0", "1536"), other
// values as the shortest %g that reads back exactly ("0.001", "1.5e-07").
// Returns the length. (Bucket `le` values are written as prometheus_client does
// instead, "1.0", "2560.0", so series identities match vLLM's.)
size_t tdm_metrics_format_double(char dst[32], double value);

// ---- vLLM bucket sets (pointers to static arrays; *n gets the count) -----------------
// vllm:time_to_first_token_seconds: 0.001 ... 2560 (22 bounds).
const double *tdm_metrics_buckets_ttft(size_t *n);
// vllm:inter_token_latency_seconds and request_time_per_output_token: 0.01 ... 80 (19).
const double *tdm_metrics_buckets_itl(size_t *n);
// e2e, queue, inference, prefill and decode request times: 0.3 ... 7680 (21).
const double *tdm_metrics_buckets_request_latency(size_t *n);
// vllm:request_params_n: 1 2 5 10 20.
const double *tdm_metrics_buckets_params_n(size_t *n);
// vllm:iteration_tokens_total: 1 8 16 32 ... 16384 (13).
const double *tdm_metrics_buckets_iteration_tokens(size_t *n);

// vLLM's build_1_2_5_buckets(max_value): 1, 2, 5, 10, 20, 50, ... while <= max_value
// (empty for max_value < 1). Writes at most cap bounds to out and returns how many
// there are in all (like snprintf); TDM_METRICS_MAX_1_2_5 always suffices.
#define TDM_METRICS_MAX_1_2_5 64
size_t tdm_metrics_buckets_1_2_5(double *out, size_t cap, int64_t max_value);

// ---- the standard vLLM engine set -------------------------------------------------------

// Cache configuration shown by vllm:cache_config_info; values are written as
// Python's str() would (True/False, None, 0.9), as vLLM does.
struct tdm_metrics_cache_info {
    int64_t block_size;            // tokens per KV block
    int64_t num_gpu_blocks;        // KV blocks in the pool; < 0 writes "None"
    int64_t num_cpu_blocks;        // < 0 writes "None"
    double gpu_memory_utilization; // fraction of device memory for the engine (0.9)
    bool enable_prefix_caching;
    const char *cache_dtype;               // "auto" when NULL
    const struct tdm_metrics_label *extra; // [n_extra] more fields, written as given
    size_t n_extra;
};

struct tdm_metrics_vllm_config {
    const char *model_name; // served model name (label model_name); required
    const char *engine;     // engine index label; "0" when NULL
    int64_t max_model_len;  // top of the 1-2-5 token buckets
    struct tdm_metrics_cache_info cache;
};

// Handles of the standard set, all with constant labels model_name and engine
// (cache_config_info: engine and the cache fields, no model_name, as vLLM).
struct tdm_metrics_vllm {
    // gauges
    struct tdm_metrics_gauge *num_requests_running;
    struct tdm_metrics_gauge *num_requests_waiting;
    struct tdm_metrics_gauge *kv_cache_usage_perc; // fraction, 1 = full
    // counters (exported with _total)
    struct tdm_metrics_counter *prefix_cache_queries; // tokens queried
    struct tdm_metrics_counter *prefix_cache_hits;    // tokens hit
    struct tdm_metrics_counter *num_preemptions;
    struct tdm_metrics_counter *prompt_tokens;
    struct tdm_metrics_counter *generation_tokens;
    struct tdm_metrics_counter *request_success; // family, label finished_reason
    struct tdm_metrics_counter *request_success_by_reason[TDM_FINISH_COUNT]; // by enum tdm_finish
                                                                       // (core); [NONE] unused
    // histograms of counts (1-2-5 buckets up to max_model_len unless noted)
    struct tdm_metrics_histogram *request_prompt_tokens;
    struct tdm_metrics_histogram *request_generation_tokens;
    struct tdm_metrics_histogram *iteration_tokens_total; // tokens per engine step
    struct tdm_metrics_histogram *request_max_num_generation_tokens;
    struct tdm_metrics_histogram *request_params_n;
    struct tdm_metrics_histogram *request_params_max_tokens;
    // histograms of seconds
    struct tdm_metrics_histogram *time_to_first_token_seconds;
    struct tdm_metrics_histogram *inter_token_latency_seconds;
    struct tdm_metrics_histogram *request_time_per_output_token_seconds;
    struct tdm_metrics_histogram *e2e_request_latency_seconds;
    struct tdm_metrics_histogram *request_queue_time_seconds;
    struct tdm_metrics_histogram *request_inference_time_seconds;
    struct tdm_metrics_histogram *request_prefill_time_seconds;
    struct tdm_metrics_histogram *request_decode_time_seconds;
    // info
    struct tdm_metrics_gauge *cache_config_info;
};

// Registers the standard set on reg (in vLLM's order) and fills *out. The
// registry must not already hold these names nor constant labels model_name or
// engine. On error some families may already be registered; the registry stays
// usable (free it). Errors: TDM_EINVAL (missing model_name, bad extra label),
// TDM_ENOMEM.
int tdm_metrics_vllm_register(struct tdm_metrics_vllm *out, struct tdm_metrics_registry *reg,
                              const struct tdm_metrics_vllm_config *cfg, char *err, size_t errlen);

// vLLM's speculative decoding counters, registered (as vLLM does) only when
// speculation is on, with the same constant labels model_name and engine.
// Counted per verification step of a request that carried drafts
// (docs/speculative-decoding.md): drafts +1, draft_tokens += drafts proposed,
// accepted_tokens += the leading drafts the target sampled too, and
// accepted_per_pos[i] += 1 when the draft at position i was accepted.
#define TDM_METRICS_SPEC_MAX_POS 16
struct tdm_metrics_spec {
    struct tdm_metrics_counter *num_drafts;          // vllm:spec_decode_num_drafts
    struct tdm_metrics_counter *num_draft_tokens;    // vllm:spec_decode_num_draft_tokens
    struct tdm_metrics_counter *num_accepted_tokens; // vllm:spec_decode_num_accepted_tokens
    struct tdm_metrics_counter *per_pos; // vllm:spec_decode_num_accepted_tokens_per_pos,
                                         // family with label position
    struct tdm_metrics_counter *accepted_per_pos[TDM_METRICS_SPEC_MAX_POS]; // its children
    int num_positions; // num_spec_tokens: children "0" .. num_positions-1 exist
};
// Registers the four families on reg with children position="0" .. K-1
// (K = num_spec_tokens in [1, TDM_METRICS_SPEC_MAX_POS]). TDM_EINVAL (no
// model_name, K out of range), TDM_ENOMEM, or the registry's error.
int tdm_metrics_spec_register(struct tdm_metrics_spec *out, struct tdm_metrics_registry *reg,
                              const char *model_name, const char *engine, int num_spec_tokens,
                              char *err, size_t errlen);

#endif
