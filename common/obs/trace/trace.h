// SPDX-License-Identifier: Apache-2.0
// trace: per-request distributed traces. Three parts:
//
// 1. W3C Trace Context (https://www.w3.org/TR/trace-context/): parsing and
//    writing the `traceparent` header ("00-<32 hex trace id>-<16 hex parent
//    span id>-<2 hex flags>") and carrying `tracestate` through unchanged. A
//    header that breaks the format (wrong length or separators, upper-case or
//    non-hex digits, version ff, an all-zero trace or span id, a version-00
//    header with trailing bytes) is ignored as the spec says: the caller starts
//    a new trace, and the tracestate that came with it is dropped too.
// 2. Spans as plain value types (struct tdm_span): a name, ids, start/end on
//    tdm_now()'s monotonic clock, a few attributes and events in fixed arrays,
//    so building one allocates nothing and a request thread can fill it on the
//    stack.
// 3. The exporter (struct tdm_tracer): tdm_tracer_emit copies a finished span
//    into a bounded queue and returns at once; one exporter thread drains it
//    in batches (full batch or every flush interval) and POSTs them to
//    {endpoint}/v1/traces as OTLP/HTTP JSON (the protobuf JSON mapping:
//    resourceSpans/scopeSpans/spans, hex ids, times as decimal strings). A full
//    queue, a collector that is down, slow (short libcurl timeouts) or answers
//    non-2xx drops spans and counts them in tandem:otlp_spans_dropped_total;
//    the request path never waits for the network. tdm_tracer_free flushes
//    what is queued (each batch bounded by the timeout) before it returns.
//
// Sampling follows the parent (OpenTelemetry's default ParentBased sampler):
// a traceparent with the sampled flag off is propagated but records nothing; a
// request without one starts a sampled trace.
//
// Threads: the parsing and span functions touch only their arguments;
// tdm_tracer_emit may be called from any thread concurrently (a short mutex,
// no allocation, no I/O). A NULL tracer is valid everywhere and records
// nothing, so services keep one pointer that is NULL when tracing is off.
#ifndef TDM_TRACE_H
#define TDM_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// ---- W3C trace context ---------------------------------------------------------------------
#define TDM_TRACEPARENT_LEN 55 // "00-" 32 "-" 16 "-" 2
#define TDM_TRACESTATE_MAX 512 // longer tracestate values are dropped (the spec's minimum to keep)

// A position in a trace: what a traceparent header carries (and tracestate).
struct tdm_trace_ctx {
    uint8_t trace_id[16];
    uint8_t span_id[8];                      // the parent span for whoever continues this context
    bool sampled;                            // flags bit 0
    char tracestate[TDM_TRACESTATE_MAX + 1]; // "" = none
};

// Parses a traceparent header (and its tracestate, NULL = none) into out.
// TDM_OK, or TDM_EINVAL when traceparent is NULL or malformed (out then holds
// nothing useful: start a new trace). A tracestate longer than
// TDM_TRACESTATE_MAX or with bytes outside printable ASCII is dropped ("")
// while the traceparent still counts.
int tdm_trace_parse(const char *traceparent, const char *tracestate, struct tdm_trace_ctx *out);

// A new sampled trace: random trace id, all-zero span id (no parent), no tracestate.
void tdm_trace_ctx_new(struct tdm_trace_ctx *out);

// From a request's headers: tdm_trace_parse, else a new trace (tdm_trace_ctx_new).
// Returns true when the headers carried a valid traceparent.
bool tdm_trace_ctx_from_headers(const char *traceparent, const char *tracestate,
                                struct tdm_trace_ctx *out);

// Writes "00-<trace id>-<span id>-<flags>" (TDM_TRACEPARENT_LEN chars + NUL) into out.
void tdm_trace_format(const struct tdm_trace_ctx *ctx, char out[TDM_TRACEPARENT_LEN + 1]);

// Lower-case hex of n bytes into out (2n chars + NUL).
void tdm_trace_hex(const uint8_t *bytes, size_t n, char *out);

// 8 random bytes, never all zero (a valid span id).
void tdm_trace_new_span_id(uint8_t out[8]);

// ---- spans ---------------------------------------------------------------------------------
#define TDM_SPAN_NAME_MAX 48
#define TDM_SPAN_MAX_ATTRS 16
#define TDM_SPAN_ATTR_STR_MAX 96
#define TDM_SPAN_MAX_EVENTS 4

// OTLP's SpanKind numbers.
enum tdm_span_kind {
    TDM_SPAN_INTERNAL = 1,
    TDM_SPAN_SERVER = 2,
    TDM_SPAN_CLIENT = 3,
    TDM_SPAN_PRODUCER = 4,
    TDM_SPAN_CONSUMER = 5,
};

enum tdm_span_attr_type { TDM_SPAN_ATTR_STR = 0, TDM_SPAN_ATTR_INT, TDM_SPAN_ATTR_DOUBLE };

struct tdm_span_attr {
    const char *key; // static storage ("gen_ai.request.id"): not copied
    enum tdm_span_attr_type type;
    int64_t i;
    double d;
    char s[TDM_SPAN_ATTR_STR_MAX]; // truncated copy
};

struct tdm_span_event {
    const char *name; // static storage
    double t;         // tdm_now() clock
};

// One span. Fill with tdm_span_begin, add attributes and events, set end (or
// tdm_span_end), then tdm_tracer_emit it. `recording` false (tracing off or
// the trace not sampled): every function below is a cheap no-op.
struct tdm_span {
    bool recording;
    uint8_t trace_id[16];
    uint8_t span_id[8];
    uint8_t parent_id[8]; // all zero = a root span
    bool sampled;
    char tracestate[TDM_TRACESTATE_MAX + 1];
    char name[TDM_SPAN_NAME_MAX];
    enum tdm_span_kind kind;
    double start, end; // tdm_now() clock (converted to Unix nanoseconds on export)
    int status;        // 0 unset, 1 ok, 2 error (OTLP StatusCode)
    char status_message[128];
    int n_attrs;
    struct tdm_span_attr attrs[TDM_SPAN_MAX_ATTRS]; // [n_attrs]; more are dropped
    int n_events;
    struct tdm_span_event events[TDM_SPAN_MAX_EVENTS]; // [n_events]; more are dropped
};

struct tdm_tracer;

// Starts span sp as a child of the context parent (its span id becomes sp's
// parent; an all-zero one makes sp a root) at time start (tdm_now() clock).
// sp records only when t is non-NULL and parent is sampled.
void tdm_span_begin(struct tdm_span *sp, const struct tdm_tracer *t,
                    const struct tdm_trace_ctx *parent, const char *name, enum tdm_span_kind kind,
                    double start);
// Starts sp as a child of the span parent (same trace, same recording state).
void tdm_span_begin_child(struct tdm_span *sp, const struct tdm_span *parent, const char *name,
                          enum tdm_span_kind kind, double start);
// The context a span's children (local or in another service) continue: its
// trace, its span id as their parent, its sampled flag and tracestate.
void tdm_span_ctx(const struct tdm_span *sp, struct tdm_trace_ctx *out);

void tdm_span_attr_str(struct tdm_span *sp, const char *key, const char *value);
void tdm_span_attr_int(struct tdm_span *sp, const char *key, int64_t value);
void tdm_span_attr_double(struct tdm_span *sp, const char *key, double value);
void tdm_span_event(struct tdm_span *sp, const char *name, double t);
// Marks the span failed with a message (truncated), status ERROR.
void tdm_span_error(struct tdm_span *sp, const char *message);

// The phases of one engine request (vLLM's: queue = arrival -> first
// scheduled, prefill = first scheduled -> first token, decode = first -> last
// token) as children of parent, each emitted to t; a phase with an end at 0 is
// skipped, and so is prefill when prefill_name is NULL (its KV came from
// elsewhere). Sets vLLM's latency attributes on parent
// (gen_ai.latency.time_in_queue, gen_ai.latency.time_in_model_prefill,
// gen_ai.latency.time_in_model_decode) and a first_token event.
struct tdm_trace_phases {
    double arrival, scheduled, first_token, last_token; // tdm_now() clock, 0 = did not happen
    const char *prefill_name;                           // "prefill", or NULL: skip
};
void tdm_tracer_emit_phases(struct tdm_tracer *t, struct tdm_span *parent,
                            const struct tdm_trace_phases *p);

// ---- OTLP JSON -----------------------------------------------------------------------------
// Encodes spans [n] as one OTLP ExportTraceServiceRequest in JSON: one
// resourceSpans with service.name = service_name, one scopeSpans (scope
// "tandem"). Times convert from the tdm_now() clock to Unix nanoseconds by
// wall_offset (Unix seconds minus tdm_now() seconds, tdm_trace_wall_offset()).
// *out is malloc'd (the caller frees) with its length in *len. TDM_ENOMEM.
int tdm_trace_encode_otlp(const struct tdm_span *spans, size_t n, const char *service_name,
                          double wall_offset, char **out, size_t *len);
// Unix time minus tdm_now() right now, in seconds.
double tdm_trace_wall_offset(void);

// ---- the exporter --------------------------------------------------------------------------
struct tdm_metrics_registry;

struct tdm_tracer_config {
    const char *endpoint;     // "http://host:4318": spans go to {endpoint}/v1/traces (an
                              // endpoint already ending in /v1/traces is used as is)
    const char *service_name; // resource service.name, e.g. "tandem-router"
    int queue_spans;          // queue bound; 0 = 2048
    int batch_spans;          // spans per POST at most; 0 = 128
    double flush_interval;    // seconds between exports of a partial batch; 0 = 1.0
    double timeout;           // libcurl timeout per POST in seconds (connect: half); 0 = 1.0
};

// Starts the exporter thread. reg (may be NULL) gets tandem:otlp_spans_dropped_total
// and tandem:otlp_spans_exported_total. TDM_EINVAL (err says why: an endpoint
// that is not http:// or https://), TDM_ENOMEM, or the registry's error.
int tdm_tracer_new(struct tdm_tracer **out, const struct tdm_tracer_config *cfg,
                   struct tdm_metrics_registry *reg, char *err, size_t errlen);
// Queues a copy of sp if it records; drops it (counted) when the queue is
// full. Never blocks on I/O. Accepts a NULL tracer.
void tdm_tracer_emit(struct tdm_tracer *t, const struct tdm_span *sp);
// Exports what is queued now and stops the thread (each POST bounded by the
// timeout; after a failed one the rest is dropped and counted), then frees.
// Accepts NULL.
void tdm_tracer_free(struct tdm_tracer *t);

// Counters (for tests and logs).
uint64_t tdm_tracer_dropped(const struct tdm_tracer *t);
uint64_t tdm_tracer_exported(const struct tdm_tracer *t);

// Checks an --otlp-traces-endpoint value (http:// or https://, a host, at
// most 1000 bytes). TDM_EINVAL with err "--otlp-traces-endpoint: expected an
// http:// or https:// URL, got \"x\"".
int tdm_trace_check_endpoint(const char *url, char *err, size_t errlen);
// The endpoint a service uses: flag (non-empty) else the environment's
// OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else NULL (tracing off).
const char *tdm_tracer_endpoint_from_env(const char *flag);
// The service name: OTEL_SERVICE_NAME when set, else fallback.
const char *tdm_tracer_service_name(const char *fallback);

#endif
