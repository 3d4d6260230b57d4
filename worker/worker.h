// SPDX-License-Identifier: Apache-2.0
// worker: the base both worker roles run on, the decode worker
// (`tandem-decode`, decode/) and the prefill worker (`tandem-prefill`,
// prefill/). It loads a model folder (or a Hugging Face id, through the HF
// cache), the text side (common/text: tokenizer, chat template, generation
// config, served name), owns one engine (paged KV cache + continuous-batching
// scheduler on one engine thread) and serves vLLM's OpenAI-compatible HTTP API
// on it: /v1/completions, /v1/chat/completions (stream and non-stream),
// /v1/models, /health, /metrics, /tokenize, /detokenize, /version. Each HTTP
// worker thread parses a request, tokenizes it, submits one engine request per
// choice, reads the engine's output stream, detokenizes incrementally, applies
// stop strings and writes SSE chunks or one JSON body; a failed write (client
// gone) aborts its engine requests so their KV blocks free at once
// (worker_generate.c). A role adds its nng side on the same engine, model and
// metrics registry through tdm_worker_parts.
//
// Lifecycle: tdm_worker_new starts listening at once (/health answers 503
// "loading"), tdm_worker_load loads the model and makes the server ready,
// tdm_worker_drain stops accepting (health 503, new requests 503), lets
// running requests finish up to a timeout, and tdm_worker_free stops
// everything. docs/decode-worker.md describes the behaviour,
// docs/configuration.md every flag, docs/architecture.md where this sits.
#ifndef TDM_WORKER_H
#define TDM_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kv_cache.h" // enum tdm_kv_dtype, struct tdm_kv_device_pool
#include "kvx.h"      // enum tdm_kvx_role

struct tdm_kv_transport;
#include "spec.h"     // struct tdm_spec_config

// ---- configuration -------------------------------------------------------------------
#define TDM_WORKER_STR 1024 // room for one path or name in the config

// Every flag of the worker base (tandem-decode and tandem-prefill take them all); names follow
// vLLM's where vLLM has one. Strings are stored inline so a config outlives argv and the config
// file.
struct tdm_worker_config {
    char model[TDM_WORKER_STR];             // --model DIR or Hugging Face id (required)
    char revision[256];                     // --revision for a Hub id; "" = main
    char host[256];                         // --host; default "0.0.0.0"
    int port;                               // --port; default 8001; 0 = any free port
    char served_model_name[TDM_WORKER_STR]; // --served-model-name; "" = config.json's
                                            // _name_or_path, else the folder's name
    int max_model_len;                      // --max-model-len; 0 = the model's context
    int max_num_seqs;                       // --max-num-seqs; default 64
    int max_num_batched_tokens;             // --max-num-batched-tokens; default 512
    int block_size;                         // --block-size; default 16
    size_t kv_cache_memory;                 // --kv-cache-memory BYTES; default 256 MiB
    int num_kv_blocks;                      // --num-kv-blocks; 0 = from kv_cache_memory
    bool enable_prefix_caching;             // --[no-]enable-prefix-caching; default on
    enum tdm_kv_dtype kv_cache_dtype;       // --kv-cache-dtype auto|bf16|f32; default auto = bf16
    char api_key[256];                      // --api-key; "" = none
    int threads;                            // --threads (compute); 0 = one per core
    char device[32];                        // --device cpu|cuda|cuda:N; "" = auto
    double gpu_memory_utilization;          // --gpu-memory-utilization; default 0.9 (device only)
    bool enforce_eager;                     // --enforce-eager: no CUDA graphs
    int batch_invariant;                    // --[no-]batch-invariant: enum tdm_batch_invariance
                                            // (model.h); 0 = the model's default (on)
    bool int8;                              // --dtype int8 (default bf16)
    bool weight_cache;                      // --[no-]weight-cache; default on
    bool async_scheduling;                  // --[no-]async-scheduling; default on
    bool priority_scheduling;               // --scheduling-policy priority (default fcfs)
    char weight_cache_dir[TDM_WORKER_STR];  // --weight-cache-dir; "" = $TANDEM_CACHE/packed,
                                            // else ~/.cache/tandem/packed
    char chat_template[TDM_WORKER_STR];     // --chat-template FILE; "" = tokenizer's
    bool enable_auto_tool_choice;           // --enable-auto-tool-choice (vLLM's)
    bool return_tokens_as_token_ids;        // --return-tokens-as-token-ids (vLLM's)
    bool trust_request_chat_template;       // --trust-request-chat-template (vLLM's)
    int max_logprobs;                       // --max-logprobs (vLLM's; default 20)
    char default_chat_template_kwargs[TDM_WORKER_STR]; // --default-chat-template-kwargs JSON
                                                       // (vLLM's); "" = none
    char tool_call_parser[64];              // --tool-call-parser hermes|llama3_json; "" = none
    int max_waiting;                        // --max-waiting; default 1024
    int stream_interval;                    // --stream-interval N (vLLM's): after a stream's
                                            // first token, tokens go out N per event; default 1
    double drain_timeout;                   // --drain-timeout SECONDS; default 30
    char log_level[16];                     // --log-level err|warn|info|debug; default info
    size_t max_body_bytes;                  // --max-body-bytes; default 16 MiB
    int http_threads;                       // --http-threads; 0 = max_num_seqs + max_waiting,
                                            // clamped to [16, 512]
    double http_header_timeout;             // --http-header-timeout S; default 10
    double http_body_timeout;               // --http-body-timeout S; default 30
    int http_max_conns_per_ip;              // --http-max-conns-per-ip N; 0 = no cap (default)
    int max_large_requests;                 // --max-large-requests N: bodies over 1 MiB at
                                            // once; default 4
    int http_memory_budget_mib;             // --http-memory-budget MIB: requests in progress
                                            // counted at their body + parse; default 2048
    char otlp_traces_endpoint[TDM_WORKER_STR]; // --otlp-traces-endpoint URL (vLLM's flag): export
                                               // spans as OTLP/HTTP JSON to URL/v1/traces; "" =
                                               // $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off
    char trace_service_name[64]; // not a flag: service.name of the spans ("tandem-decode",
                                 // set by the role; $OTEL_SERVICE_NAME overrides)
    int kv_transfer;             // --kv-transfer nng|cuda-ipc|nccl|auto: enum
                                 // tdm_kvx_mode (common/engine/kvx/kvx.h);
                                 // default auto (P/D roles only)
    struct tdm_spec_config spec; // --speculative-config JSON (vLLM's; method "ngram" only);
                                 // num_speculative_tokens 0 = off (default)
    // vLLM flags a `vllm serve` line carries over (issue 28, item 5):
    bool has_seed;          // --seed N given: requests without a seed draw theirs from N's
    uint64_t seed;          // stream (tdm_sampling_set_process_seed); default: entropy
    bool log_requests;      // one INFO line per request; --disable-log-requests: off
    bool disable_log_stats; // --disable-log-stats: accepted (Tandem logs no periodic stats)
    bool trust_remote_code; // --trust-remote-code: accepted; no remote code ever runs
};

// Fills the defaults above.
void tdm_worker_config_default(struct tdm_worker_config *cfg);
// Applies the process-wide parts of cfg (--seed) before the engine starts.
void tdm_worker_config_apply_process(const struct tdm_worker_config *cfg);

// Sets one option by its flag name without the leading "--" ("max-num-seqs";
// '_' and '-' are interchangeable). value is the text after the flag, or for
// the boolean enable-prefix-caching "true"/"false" (NULL = true). TDM_EINVAL
// with err "--port: expected an integer in [0, 65535], got \"x\"" or "unknown
// option \"--foo\"".
int tdm_worker_config_set(struct tdm_worker_config *cfg, const char *name, const char *value,
                          char *err, size_t errlen);

// Reads a flat YAML file of "key: value" lines (keys as flags without "--";
// '#' comments, blank lines, single or double quotes around a value) into cfg.
// TDM_EINVAL with "FILE:LINE: ..." for a bad line, TDM_ENOTFOUND/TDM_EIO.
int tdm_worker_config_load_file(struct tdm_worker_config *cfg, const char *path, char *err,
                                size_t errlen);

// Parses argv (argv[0] skipped): --config FILE is applied first, then the other
// flags override it. Returns TDM_OK, 1 when --help was given (nothing else is
// checked), or TDM_EINVAL with a one-line message in err (unknown flag, missing
// or bad value, --model missing).
int tdm_worker_config_parse_args(struct tdm_worker_config *cfg, int argc, char **argv, char *err,
                                 size_t errlen);

// The flag table (core's struct tdm_flags): --help is tdm_flags_help of it.
// Byte sizes ("2GiB", "512MiB") parse with core's tdm_parse_bytes.
struct tdm_flags;
const struct tdm_flags *tdm_worker_flags(void);

// ---- the server --------------------------------------------------------------------------
struct tdm_worker;

// Validates cfg and starts the HTTP server on cfg->host:cfg->port; until
// tdm_worker_load succeeds, /health answers 503 and every API route 503.
// TDM_EINVAL (bad config, err says which) or TDM_ETRANSPORT (cannot listen).
int tdm_worker_new(struct tdm_worker **out, const struct tdm_worker_config *cfg, char *err,
                   size_t errlen);
// Loads tokenizer, chat template, generation config and model, creates the
// metrics registry and the engine, then marks the server ready. Errors: the
// failing module's code and message.
int tdm_worker_load(struct tdm_worker *s, char *err, size_t errlen);
// The same load without the last step: /health stays 503 until
// tdm_worker_set_ready. For a main that must open more listeners first
// (the P/D nng inbox), so that a worker is never reported healthy before every
// port it advertises accepts connections.
int tdm_worker_load_unready(struct tdm_worker *s, char *err, size_t errlen);
void tdm_worker_set_ready(struct tdm_worker *s);
// The bound port (the real one when cfg->port was 0).
int tdm_worker_port(const struct tdm_worker *s);
// The served model name and the KV capacity in tokens (after load).
const char *tdm_worker_model_name(const struct tdm_worker *s);
// Where the model computes, for the startup line: "cpu", "cuda:0", or "cpu
// (--device auto: no CUDA backend: libtandem-cuda.so not found ...)".
const char *tdm_worker_device(const struct tdm_worker *s);
int64_t tdm_worker_kv_capacity_tokens(const struct tdm_worker *s);
// Stops accepting (health 503, new API requests 503) and lets running requests
// finish for up to timeout_s seconds (< 0: no limit); the rest are aborted and
// their streams end. Returns once every in-flight HTTP request has returned
// (or after a further 5 s grace). TDM_OK or TDM_ETIMEDOUT (some were aborted).
int tdm_worker_drain(struct tdm_worker *s, double timeout_s);
// Stops the HTTP server, the engine and frees everything. Accepts NULL.
void tdm_worker_free(struct tdm_worker *s);

// ---- for the roles -------------------------------------------------------------------------
// A narrow window into a loaded worker for its role's nng side (the decode
// worker's P/D receiver, the prefill worker's service), which run on the same
// engine, model and metrics registry as the HTTP path instead of loading their own.
struct tdm_engine;
struct tdm_model;
struct tdm_metrics_registry;
struct tdm_tracer;

// Borrowed pointers, valid until tdm_worker_free.
struct tdm_worker_parts {
    struct tdm_engine *engine;
    struct tdm_model *model;
    struct tdm_metrics_registry *reg; // for the role's own tandem:* metrics
    struct tdm_tracer *tracer;        // span exporter (common/obs/trace); NULL = tracing off
    const char *served_name;
    const int32_t *eos_ids; // [num_eos] config.json's and generation_config.json's
    int num_eos;
    int max_model_len;
    int block_size;
    int vocab_size;
};

// Fills *out after tdm_worker_load succeeded; TDM_EBUSY before.
int tdm_worker_parts(struct tdm_worker *s, struct tdm_worker_parts *out);
// The config the worker runs with (borrowed, valid until tdm_worker_free).
const struct tdm_worker_config *tdm_worker_get_config(const struct tdm_worker *s);
// The KV transport of a P/D role on this worker's engine (after
// tdm_worker_load): the role's side of the pairs, the worker's --kv-transfer,
// the device table (table: a test's; NULL: the CUDA module's when the KV pool
// lives on a device, else none, and none where the module cannot load: KV
// then moves over nng; a CPU worker never loads libtandem-cuda.so for it),
// the pool's geometry and nccl_timeout. *dp is the pool when it is one device
// allocation (CUDA IPC and NCCL can reach it), zeroed otherwise. TDM_OK or
// TDM_ENOMEM.
int tdm_worker_kv_transport_new(struct tdm_worker *s, enum tdm_kvx_role role,
                                const struct tdm_kvx_ops *table, double nccl_timeout,
                                struct tdm_kv_transport **out, struct tdm_kv_device_pool *dp);
// A role's details for /health: fn writes one JSON object's members (without
// braces, e.g. "\"kv_transfer\":{...}") into buf; /health then answers 200 with
// {"status":"ok",<members>} instead of an empty body. fn runs on an HTTP
// thread and must lock what it reads. Set once, before the role starts; arg
// must outlive the server (or call with fn NULL before freeing it).
typedef void (*tdm_worker_health_fn)(void *arg, char *buf, size_t len);
void tdm_worker_set_health_details(struct tdm_worker *s, tdm_worker_health_fn fn, void *arg);
// True while the server accepts new requests (loaded, not draining).
bool tdm_worker_ready(const struct tdm_worker *s);

// ---- a role's main ---------------------------------------------------------------------
// What a worker role adds to the worker base's command line (worker_main.c).
struct tdm_worker_role {
    const char *name;              // "decode", "prefill": the log role; "tandem-NAME: " on errors
    const struct tdm_flags *flags; // its own flags, listed by --help after the worker's
    void *cfg;                     // its config, defaulted by the caller; take_args fills it
    // Takes the role's flags out of argv (before the worker parses the rest).
    int (*take_args)(void *cfg, int *argc, char **argv, char *err, size_t errlen);
    // The worker's defaults for this role (NULL: tdm_worker_config_default).
    void (*worker_defaults)(struct tdm_worker_config *cfg);
    // After the load, before ready: starts the role's side on s (*svc may stay
    // NULL: nothing to run). TDM_OK, or an error with err set (the process exits 1).
    int (*start)(void **svc, struct tdm_worker *s, void *cfg, char *err, size_t errlen);
    // Its words in the ready line ("nng=URL instance=ID"); NULL: none.
    void (*describe)(void *svc, char *buf, size_t cap);
    // Stops and frees svc: before the worker's drain when stop_before_drain
    // (prefill: its jobs abort and release their KV), else after it (decode:
    // the streams it serves run out first).
    void (*stop)(void *svc);
    bool stop_before_drain;
};

// The main of a worker role: parses argv (the role's flags, then the
// worker's; --help prints both), blocks SIGTERM/SIGINT in every thread, starts
// the server (503 while loading), loads the model (the modules' startup lines
// at debug only unless --log-level says otherwise), starts the role, sets
// ready and logs one line ("ready model=... kv_capacity_tokens=...
// listening=http://HOST:PORT startup_s=... device=..."); on the first signal
// stops the role and drains (--drain-timeout), a second one ends the process
// at once. Returns the exit status: 0, 1 when the start failed, 2 on a bad flag.
int tdm_worker_main(int argc, char **argv, const struct tdm_worker_role *role);

#endif
