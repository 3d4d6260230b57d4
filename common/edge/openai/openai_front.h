// SPDX-License-Identifier: Apache-2.0
// openai_front: the flags every OpenAI server front of Tandem takes (the
// router, the decode and the prefill worker), defined once so that their
// meaning, range, check and --help text cannot drift between the binaries.
//
// TDM_OAI_FRONT_FLAGS(T, port_help) expands to the entries of a static
// struct tdm_flag table (common/core/core.h) for the options struct T, which
// must have these fields (char arrays of any size, the rest as typed):
//   char served_model_name[], chat_template[], tool_call_parser[], host[],
//   api_key[], log_level[], otlp_traces_endpoint[], default_chat_template_kwargs[];
//   bool enable_auto_tool_choice, return_tokens_as_token_ids, trust_request_chat_template;
//   int port, max_model_len, max_logprobs,
//   stream_interval, http_max_conns_per_ip, max_large_requests, http_memory_budget_mib; size_t
//   max_body_bytes; double http_header_timeout, http_body_timeout, drain_timeout.
// port_help is --port's help (the default differs: 8000 on the router, 8001
// on a worker). What differs by role stays in the role's own table: --model
// (a worker also takes a Hub id), --http-threads (a worker sizes its pool from
// its queue bounds), --config (another file on each).
#ifndef TDM_OPENAI_FRONT_H
#define TDM_OPENAI_FRONT_H

#include <limits.h>
#include <stddef.h>

#include "core.h"
#include "openai.h" // tdm_oai_check_chat_template_kwargs
#include "trace.h"

#define TDM_OAI_FRONT_STR_(T, n, field, mv, h, ...)                                                \
    TDM_FLAG_FIELD(T, n, TDM_FLAG_STR, field, .metavar = mv, .help = h, __VA_ARGS__)
#define TDM_OAI_FRONT_NUM_(T, n, k, field, lo, hi, mv, h)                                          \
    TDM_FLAG_FIELD(T, n, k, field, .min = lo, .max = hi, .metavar = mv, .help = h)

#define TDM_OAI_FRONT_FLAGS(T, port_help)                                                          \
    TDM_OAI_FRONT_STR_(T, "served-model-name", served_model_name, "NAME",                          \
                       "model name in the API and metrics\n(default: config.json "                 \
                       "_name_or_path, else the\nfolder name)",                                    \
                       .empty_ok = false),                                                         \
        TDM_OAI_FRONT_STR_(T, "chat-template", chat_template, "FILE",                              \
                           "chat template overriding the tokenizer's", .empty_ok = false),         \
        TDM_FLAG_FIELD(T, "enable-auto-tool-choice", TDM_FLAG_BOOL, enable_auto_tool_choice,       \
                       .help = "tool_choice \"auto\": parse tool calls out of the\noutput "        \
                               "(needs --tool-call-parser)"),                                      \
        TDM_OAI_FRONT_STR_(T, "tool-call-parser", tool_call_parser, "NAME",                        \
                           "hermes (Qwen2.5, Hermes) or llama3_json (Llama 3.x)",                  \
                           .empty_ok = false),                                                     \
        TDM_FLAG_FIELD(T, "return-tokens-as-token-ids", TDM_FLAG_BOOL, return_tokens_as_token_ids, \
                       .help = "logprobs name tokens \"token_id:<id>\" (a\nrequest's "             \
                               "return_tokens_as_token_ids\ndefault)"),                            \
        TDM_OAI_FRONT_STR_(T, "default-chat-template-kwargs", default_chat_template_kwargs,        \
                           "JSON",                                                                 \
                           "chat template variables under every chat\nrequest's "                  \
                           "chat_template_kwargs, e.g.\n'{\"enable_thinking\": false}'",           \
                           .check = tdm_oai_check_chat_template_kwargs),                           \
        TDM_OAI_FRONT_NUM_(T, "max-logprobs", TDM_FLAG_INT, max_logprobs, 0, 20, "N",              \
                           "the most logprobs and prompt_logprobs a request\nmay ask (default "    \
                           "20, the most there is room for)"),                                     \
        TDM_FLAG_FIELD(T, "trust-request-chat-template", TDM_FLAG_BOOL,                            \
                       trust_request_chat_template,                                                \
                       .help = "a chat request may bring its own chat_template\n(else 400)"),      \
        TDM_OAI_FRONT_STR_(T, "host", host, "ADDR", "HTTP listen address (default 0.0.0.0)",       \
                           .empty_ok = false),                                                     \
        TDM_OAI_FRONT_NUM_(T, "port", TDM_FLAG_INT, port, 0, 65535, "N", port_help),               \
        TDM_OAI_FRONT_STR_(T, "api-key", api_key, "KEY",                                           \
                           "require 'Authorization: Bearer KEY' on /v1/*\n(\"\" = none)",          \
                           .empty_ok = true),                                                      \
        TDM_OAI_FRONT_NUM_(T, "max-model-len", TDM_FLAG_HINT, max_model_len, 0, INT_MAX / 2, "N",  \
                           "context length (default 0 = the model's);\nvLLM's suffixes: 4k = "     \
                           "4000, 32K = 32768"),                                                   \
        TDM_OAI_FRONT_NUM_(T, "stream-interval", TDM_FLAG_INT, stream_interval, 1, 1 << 20, "N",   \
                           "streams: after the first token, send tokens N per event\n(fewer, "     \
                           "larger events; default 1 = each as it comes)"),                        \
        TDM_OAI_FRONT_NUM_(T, "max-body-bytes", TDM_FLAG_BYTES, max_body_bytes, 1024, 1e12,        \
                           "BYTES", "request body limit; beyond it 413 (default 16MiB)"),          \
        TDM_OAI_FRONT_NUM_(T, "http-header-timeout", TDM_FLAG_DOUBLE, http_header_timeout, 0.1,    \
                           3600, "SECONDS",                                                        \
                           "time to send a request's headers; also the\nlongest read/write "       \
                           "stall (default 10)"),                                                  \
        TDM_OAI_FRONT_NUM_(T, "http-body-timeout", TDM_FLAG_DOUBLE, http_body_timeout, 0.1, 86400, \
                           "SECONDS",                                                              \
                           "time to send a request's body; beyond it 408\n(default 30)"),          \
        TDM_OAI_FRONT_NUM_(T, "http-max-conns-per-ip", TDM_FLAG_INT, http_max_conns_per_ip, 0,     \
                           1 << 20, "N",                                                           \
                           "open connections per client address; beyond\nit 429 (default 0 = "     \
                           "no cap)"),                                                             \
        TDM_OAI_FRONT_NUM_(T, "max-large-requests", TDM_FLAG_INT, max_large_requests, 1, 1 << 20,  \
                           "N",                                                                    \
                           "requests with bodies over 1 MiB at once;\nbeyond it 503 + "            \
                           "Retry-After (default 4)"),                                             \
        TDM_OAI_FRONT_NUM_(T, "http-memory-budget", TDM_FLAG_INT, http_memory_budget_mib, 1,       \
                           1 << 22, "MIB",                                                         \
                           "memory the requests in progress may count (each\n~21 x its body + "    \
                           "1 MiB); beyond it 503\n+ Retry-After, 413 for one over it alone "      \
                           "(default 2048)"),                                                      \
        TDM_OAI_FRONT_NUM_(T, "drain-timeout", TDM_FLAG_DOUBLE, drain_timeout, 0, 86400,           \
                           "SECONDS",                                                              \
                           "on SIGTERM, open requests may finish this long\n(default 30)"),        \
        TDM_OAI_FRONT_STR_(T, "log-level", log_level, "err|warn|info|debug", "(default info)",     \
                           .check = tdm_log_check_level_name),                                     \
        TDM_OAI_FRONT_STR_(T, "otlp-traces-endpoint", otlp_traces_endpoint, "URL",                 \
                           "export per-request trace spans as OTLP/HTTP JSON\nto URL/v1/traces "   \
                           "(default $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,\nelse off; "             \
                           "docs/observability.md)",                                               \
                           .check = tdm_trace_check_endpoint)

#endif
