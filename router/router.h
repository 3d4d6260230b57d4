// SPDX-License-Identifier: Apache-2.0
// router: the request path of `tandem-router`. It serves the OpenAI HTTP
// surface (common/edge/http + common/edge/openai: /v1/completions, /v1/chat/completions,
// /v1/models, /tokenize, /detokenize, /health, /metrics, /version and
// GET /v1/router/config), tokenizes and applies the chat template itself (for
// prefix-aware routing and the P/D decision), asks the control plane
// (control.h) for a route, and sends one GenerateRequest per choice over nng to
// the chosen decode worker, listing the chosen prefill workers when the decider
// disaggregates. Token chunks come back to the router's inbox and are
// detokenized, stop-string matched and written as SSE or one JSON body.
//
// Failure handling: a decode worker that cannot be reached before any token is
// replaced by another route (up to 3 attempts); one that stops answering load
// queries (liveness_timeout) or comes back with a new instance id mid-stream
// is lost: its streams continue on another decode worker with the tokens
// already sent (stream_migration, default on; at most 2 moves, each avoiding
// every worker lost so far), else end with an SSE error event; a client that
// disconnects (seen when a write to it fails), a stop
// string, or the request deadline sends Cancel to the decode worker (which
// cancels its prefill worker), so KV is freed on both. Load reports arrive over
// nng (LoadQuery every load_interval) and feed the endpoint registry.
// docs/pd-protocol.md describes the protocol.
#ifndef TDM_ROUTER_H
#define TDM_ROUTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tdm_router_opts {
    char config[1024];           // --config FILE: routing config (docs/router-config.md); or:
    char policy[64];             // --policy NAME: the short form without a file, with
    char decode_eps[2048];       // --decode HOST:PORT[:NNG],... and
    char prefill_eps[2048];      // --prefill HOST:PORT[:NNG],... (nng port default PORT+1000)
    int pd_threshold;            // --pd-threshold N (default 256), with --prefill
    char generated_dir[512];     // the private folder holding the generated config ("" = none)
    char model[1024];            // --model DIR (required): tokenizer, chat template, config.json
    char served_model_name[256]; // --served-model-name; "" = config.json's _name_or_path or DIR
    char chat_template[1024];    // --chat-template FILE; "" = the tokenizer's
    bool enable_auto_tool_choice; // --enable-auto-tool-choice (vLLM's)
    bool return_tokens_as_token_ids; // --return-tokens-as-token-ids (vLLM's)
    char default_chat_template_kwargs[1024]; // --default-chat-template-kwargs JSON; "" = none
    bool trust_request_chat_template;        // --trust-request-chat-template (vLLM's)
    int max_logprobs;                        // --max-logprobs (vLLM's; default 20)
    char tool_call_parser[64];    // --tool-call-parser hermes|llama3_json; "" = none
    char host[256];              // --host; default 0.0.0.0
    int port;                    // --port; default 8000; 0 = any free port
    char nng_url[256];           // --nng-url: the router's inbox; default tcp://127.0.0.1:0
    char api_key[256];           // --api-key; "" = none
    int http_threads;            // --http-threads; default 256 (one per open stream)
    size_t max_body_bytes;       // --max-body-bytes; default 16 MiB
    double http_header_timeout;  // --http-header-timeout S; default 10
    double http_body_timeout;    // --http-body-timeout S; default 30
    int http_max_conns_per_ip;   // --http-max-conns-per-ip N; 0 = no cap (default)
    int max_large_requests;      // --max-large-requests N: bodies over 1 MiB at once; default 4
    int http_memory_budget_mib;  // --http-memory-budget MIB; default 2048 (as on the workers)
    int max_model_len;           // --max-model-len; 0 = config.json's max_position_embeddings
    char log_level[16];          // --log-level; default info
    bool watch;                  // --[no-]watch-config: reload on file change; default on
    double liveness_timeout;     // --liveness-timeout S: a worker silent this long mid-stream
                                 // is lost; default 1.0
    double load_interval;        // --load-interval S: LoadQuery period; default 0.2
    bool stream_migration;       // --[no-]stream-migration: a stream whose decode worker is
                                 // lost continues on another with the tokens sent so far;
                                 // default on
    int stream_interval;         // --stream-interval N (vLLM's): after a stream's first
                                 // token, tokens go out N per event; default 1
    bool debug_headers;          // --debug-headers: x-tandem-decode and x-tandem-phases on
                                 // responses (which worker, the phase times); default off
    double drain_timeout;        // --drain-timeout S: on SIGTERM, how long open requests may
                                 // finish before the rest end with an error event; default 30
    char otlp_traces_endpoint[1024]; // --otlp-traces-endpoint URL (vLLM's flag): per-request
                                     // spans as OTLP/HTTP JSON to URL/v1/traces; "" =
                                     // $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else off
};
void tdm_router_opts_default(struct tdm_router_opts *o);
// Parses argv (argv[0] skipped) through the flag table. TDM_OK, 1 for --help,
// TDM_EINVAL with a one-line err (a bad flag, --config or --model missing).
int tdm_router_opts_parse_args(struct tdm_router_opts *o, int argc, char **argv, char *err,
                               size_t errlen);
// The flag table (core's struct tdm_flags): --help is tdm_flags_help of it.
struct tdm_flags;
const struct tdm_flags *tdm_router_flags(void);

struct tdm_router_server;

// Drains the server: /health turns 503 and new API requests get 503 "The
// server is draining." (Retry-After), while requests already admitted go on;
// returns once none is left (TDM_OK) or after timeout_s (TDM_ETIMEDOUT). Free
// the server after it: requests still open then end with an error event.
int tdm_router_server_drain(struct tdm_router_server *s, double timeout_s);

// Loads the tokenizer side and the routing config, starts the control plane
// (discovery, health, config watch), the nng inbox and the load poller, then
// the HTTP server. Errors: the failing part's code and message.
int tdm_router_server_new(struct tdm_router_server **out, const struct tdm_router_opts *o,
                          char *err, size_t errlen);
int tdm_router_server_port(const struct tdm_router_server *s);
const char *tdm_router_server_nng_url(const struct tdm_router_server *s);
// SIGHUP: reload the routing config now.
int tdm_router_server_reload(struct tdm_router_server *s, char *err, size_t errlen);
// Stops HTTP (open streams are cancelled upstream), the poller, the inbox and
// the control plane; frees. Accepts NULL.
void tdm_router_server_free(struct tdm_router_server *s);

#endif
