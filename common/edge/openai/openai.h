// SPDX-License-Identifier: Apache-2.0
// openai: the OpenAI-compatible wire format as vLLM speaks it, with no I/O.
// Parses and validates /v1/completions, /v1/chat/completions, /tokenize and
// /detokenize bodies into plain structs (sampling values resolved against the
// model's generation_config.json the way vLLM does), builds every response body
// (non-stream, SSE chunks, usage chunk, logprobs in both formats, /v1/models,
// /version, errors) as heap JSON strings, and matches stop strings over a stream
// of text deltas without ever emitting part of a stop string.
// Bad input never crashes: it becomes a struct tdm_oai_error (HTTP status, type,
// param, message worded as vLLM words it). Field list and shapes: docs/api.md.
#ifndef TDM_OPENAI_H
#define TDM_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "chat.h"
#include "core.h" // enum tdm_finish
#include "hf.h"
#include "sampling.h"

#include "openai_tools.h" // tools, tool_choice and the tool-call parsers

#define TDM_OAI_MAX_STOP 16 // stop strings per request
#define TDM_OAI_MAX_N                                                                              \
    128                   // vLLM's VLLM_MAX_N_SEQUENCES default is larger; ours is a
                          // per-request cap on parallel sequences
// Sequences one request may ask for (n x prompts): checked while parsing,
// before any prompt is copied or tokenized, so a body of a million tiny prompts
// costs its JSON tree and no more (issue 29 part 3: `"prompt": ["a"] * 1e6`
// made the router peak at 1.2 GB before the worker's bound refused it). A
// worker's --max-waiting (1024 by default) bounds it further at routing.
#define TDM_OAI_MAX_SEQUENCES 4096
// A body whose JSON parse tree (TDM_JSON_NODE_BYTES a value, counted before
// parsing) would exceed this many bytes per body byte, plus the slack, is
// refused (400): the parse of any body under the size limit stays within ~20x
// its size (issue 29, part 3).
#define TDM_OAI_PARSE_BYTES_PER_BODY_BYTE 20
#define TDM_OAI_PARSE_SLACK ((size_t)1 << 20)
#define TDM_OAI_ID_HEX 32 // random 128-bit ids are 32 lowercase hex digits

// ---- errors ---------------------------------------------------------------------------
// What the server sends back for a rejected request. type is the OpenAI SDK's
// class name for the status ("BadRequestError", "NotFoundError", ...); param is
// the offending field ("" = null in the body).
struct tdm_oai_error {
    int status; // HTTP status: 400, 401, 404, 405, 413, 500, 503 ...
    char type[40];
    char param[64];
    char message[512];
};

// Fills e (status, the type for that status, param (NULL = none), message) and
// returns TDM_EINVAL for 4xx statuses and TDM_EPROTO otherwise (a convenience for
// `return tdm_oai_seterr(...)`).
int tdm_oai_seterr(struct tdm_oai_error *e, int status, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
// The type name for an HTTP status: 400 BadRequestError, 401 AuthenticationError,
// 403 PermissionDeniedError, 404 NotFoundError, 405 MethodNotAllowedError,
// 413 RequestTooLargeError, 422 UnprocessableEntityError, 429 RateLimitError,
// 501 NotImplementedError, 503 ServiceUnavailableError, 504 TimeoutError, other
// 4xx BadRequestError, other 5xx InternalServerError. Static string.
const char *tdm_oai_error_type(int status);
// The HTTP status for an enum tdm_err, the one mapping every server uses (the
// table in docs/api.md): OK 200, EINVAL 400, ENOTFOUND 404, EBUSY (a full
// waiting queue: 503 as vLLM answers it, not 429), ECAPACITY and ECLOSED 503,
// ETIMEDOUT 504, EPROTO and ETRANSPORT 502, ENOMEM, EBACKEND, EIO and anything
// else 500.
int tdm_oai_status_for_err(int err);
// One failure as every server answers it, direct or routed, streamed or not:
// e gets tdm_oai_status_for_err(err), the type for that status, param none, and
// the message: for EBUSY "The server is overloaded: <detail>. Retry later.",
// otherwise detail (NULL = tdm_strerror(err)); err TDM_OK (a failure that
// carries no code) is 500. Returns as tdm_oai_seterr.
int tdm_oai_error_from_err(struct tdm_oai_error *e, int err, const char *detail);
// vLLM's nested error body {"error":{"message","type","param","code"}}, code =
// status as an integer, param null when empty. Heap string (caller frees); NULL
// on ENOMEM.
char *tdm_oai_error_body(const struct tdm_oai_error *e);
// Same from parts (type NULL = the type for status; param NULL = null).
char *tdm_oai_error_body_from(int status, const char *type, const char *param, const char *message);

// ---- ids ------------------------------------------------------------------------------
// Writes 32 random lowercase hex digits (128 bits from getrandom) and a NUL.
void tdm_oai_random_hex(char out[TDM_OAI_ID_HEX + 1]);

// ---- model facts the parser needs ------------------------------------------------------
struct tdm_oai_model_info {
    const char *served_name; // the served model name; NULL accepts any "model"
    int vocab_size;          // bounds token ids (prompt, logit_bias, stop_token_ids)
    int max_model_len;       // context length (tokens)
    const struct tdm_generation_config *gen; // generation_config.json defaults; may be NULL
    enum tdm_oai_tool_parser tool_parser; // --enable-auto-tool-choice --tool-call-parser:
                                          // the parser of tool_choice "auto" (NONE: refused)
    bool return_tokens_as_token_ids;      // --return-tokens-as-token-ids: the requests' default
    // --default-chat-template-kwargs: a JSON object (checked at startup) under
    // every chat request's chat_template_kwargs; NULL: none.
    const char *default_chat_template_kwargs;
    // --max-logprobs (vLLM's): with limit_logprobs, the most logprobs and
    // prompt_logprobs a request may ask (0..TDM_MAX_LOGPROBS); without, 20.
    bool limit_logprobs;
    int max_logprobs;
    // --trust-request-chat-template: a chat request may bring its own
    // chat_template (else vLLM's 400).
    bool trust_request_chat_template;
};

// ---- completions and chat requests -------------------------------------------------------
enum tdm_oai_kind { TDM_OAI_COMPLETION = 0, TDM_OAI_CHAT };

// One prompt of a completions request: text or token ids (exactly one is set).
struct tdm_oai_prompt {
    char *text; // NUL-terminated UTF-8, or NULL when given as ids
    size_t text_len;
    int32_t *ids; // or NULL when given as text
    size_t n_ids;
};

struct tdm_oai_request {
    enum tdm_oai_kind kind;
    char *model; // as sent; NULL when absent (the served model is meant)

    // completions: prompt as a string, [string], [int] or [[int]] (one entry each)
    struct tdm_oai_prompt *prompts;
    size_t n_prompts;

    // chat: the messages, parsed (tdm_chat_msgs_parse) and as compact JSON text
    struct tdm_chat_msg *messages;
    size_t n_messages;
    char *messages_json;
    char *conversation_json; // the messages as the template sees them (vLLM's conversation:
                             // tool_calls arguments parsed, tool_call_id; openai_tools.h)
    struct tdm_oai_tool_request tools; // tools, tool_choice, parallel_tool_calls
    bool add_generation_prompt;  // default true
    bool continue_final_message; // default false; exclusive with add_generation_prompt
    char *chat_template;         // chat: the request's own template text (heap; only with
                                 // --trust-request-chat-template), NULL when absent
    char *chat_template_kwargs;  // chat: the template's extra variables, compact JSON object
                                 // (the server's defaults under the request's; heap), NULL
                                 // when none

    bool add_special_tokens; // completions default true, chat default false (vLLM)
    int max_tokens;          // the request's max_tokens / max_completion_tokens;
                             // completions default 16; chat -1 = not given
    bool echo_only;          // completions echo with max_tokens 0: return the prompt
                             // only, generate nothing
    bool echo_prompt_only;   // the same with logprobs or prompt_logprobs: as vLLM, one
                             // token is generated (max_tokens 1) for the prompt's
                             // logprobs and counted in usage, but not returned
    int truncate_prompt_tokens; // keep only the prompt's last N tokens (vLLM's left
                                // truncation); -1 in the body is max_model_len; 0 = none
    int n;                   // choices per prompt, 1..TDM_OAI_MAX_N
    bool stream;
    bool include_usage;           // stream_options.include_usage
    bool continuous_usage_stats;  // stream_options.continuous_usage_stats
    bool echo;                    // completions: prepend the prompt text
    bool logprobs;                // return logprobs of generated tokens
    int top_logprobs;             // completions: the logprobs int; chat: top_logprobs
    int prompt_logprobs;          // vLLM's prompt_logprobs (top N per prompt token,
                                  // non-stream only; completions per choice, chat in the
                                  // response), -1 when absent; with echo and
                                  // logprobs the echoed prompt's entries come from the same
                                  // computation (tdm_oai_call_prompt_lp)
    char *stop[TDM_OAI_MAX_STOP]; // stop strings (heap, non-empty)
    size_t n_stop;
    bool include_stop_str_in_output;
    bool skip_special_tokens;           // default true
    bool spaces_between_special_tokens; // default true (accepted; byte-level BPE decode is
                                        // unaffected by it)
    bool return_token_ids;              // add prompt_token_ids / token_ids to choices
    bool return_tokens_as_token_ids;    // logprobs name tokens "token_id:<id>" (the request's
                                        // field, else the server's flag)
    char *user;                         // NULL when absent
    char *request_id;                   // the body's request_id, NULL when absent
    char *cache_salt; // vLLM's cache_salt (non-empty), NULL when absent: prefix-cache hits
                      // only between requests of the same salt
    int priority;                       // 0 default; the engine orders by it (priority
                                        // scheduling) or refuses one other than 0 (fcfs)

    // Sampling with generation_config.json defaults applied (tdm_hf_sampling_resolve);
    // logprobs = top_logprobs when logprobs is on, else -1. Token ids are checked
    // against vocab_size. max_tokens is resolved separately, once the prompt
    // length is known (tdm_oai_request_max_tokens).
    struct tdm_sampling_params sampling;
    // vLLM's allowed_token_ids (heap; sampling.allowed_token_ids points here),
    // NULL when absent.
    int32_t *allowed_token_ids;
    size_t n_allowed_token_ids;
    // vLLM's logprob_token_ids (heap; sampling.logprob_token_ids points here),
    // NULL when absent.
    int32_t *logprob_token_ids;
    // vLLM's bad_words (heap, non-empty strings; none when absent), and once
    // the prompts' tokenizer made them token sequences (tdm_oai_bad_words_build)
    // those (heap; sampling.bad_word_ids / bad_word_lens point here).
    char **bad_words;
    size_t n_bad_words;
    int32_t *bad_word_ids;
    int32_t *bad_word_lens;

    // Structured output (response_format, structured_outputs, guided_*): the
    // constraint's text (heap, owned; sampling.constraint_text points here) and
    // the field it came from; kind is sampling.constraint.
    char *constraint_text;
    size_t constraint_len;
    char constraint_param[48];
};

// Parses a completions (kind COMPLETION) or chat (kind CHAT) JSON body of len
// bytes. On success fills *req (free with tdm_oai_request_fini) and returns
// TDM_OK. On failure returns TDM_EINVAL (4xx: e filled, e.g. 400 "temperature
// must be in [0, 2], got 3.0." param "temperature", or 404 for an unknown model)
// or TDM_ENOMEM (e: 500), leaving *req empty. Unknown fields are ignored; a null
// value counts as absent. Fields vLLM supports but Tandem does not (tools,
// suffix, use_beam_search, prompt_logprobs, ...) are 400 "... is not
// supported" unless set to their no-op value. A structured-output constraint
// (response_format, structured_outputs, guided_*: at most one) is compiled
// here to validate it (tdm_oai_request_set_constraint).
int tdm_oai_request_parse(struct tdm_oai_request *req, enum tdm_oai_kind kind, const char *json,
                          size_t len, const struct tdm_oai_model_info *model,
                          struct tdm_oai_error *e);
void tdm_oai_request_fini(struct tdm_oai_request *req);

// Attaches a structured-output constraint to a parsed request (what parsing
// does for response_format / structured_outputs / guided_*; also the entry
// point for features that force a shape, such as tool_choice): compiles (kind,
// text) through the grammar cache to validate it, keeps a copy of text and
// points req->sampling.constraint* at it, so that the constraint travels with
// the sampling params (engine, P/D wire). param names the field in errors.
// TDM_OK; TDM_EINVAL with e 400 when the request already has a constraint
// ("You can only use one kind of structured outputs constraint ...") or the
// grammar engine refuses the text (its message); TDM_ENOMEM with e 500.
int tdm_oai_request_set_constraint(struct tdm_oai_request *req, enum tdm_constraint_kind kind,
                                   const char *text, size_t len, const char *param,
                                   struct tdm_oai_error *e);

// Once the server has tokenized the prompt (prompt_len tokens): checks it fits
// the context and resolves max_tokens as vLLM does (the request's value, else
// max_model_len - prompt_len, bounded by generation_config max_new_tokens and
// by the room left). Checks min_tokens <= max_tokens. Returns TDM_OK with
// *max_tokens >= 1 (0 for echo_only), or TDM_EINVAL with e 400 in vLLM's words:
// "This model's maximum context length is 32768 tokens. However, your request
// has 40000 input tokens. Please reduce the length of the input messages." or
// "'max_tokens' or 'max_completion_tokens' is too large: 32000. This model's
// maximum context length is 32768 tokens and your request has 1000 input tokens
// (32000 > 32768 - 1000)." (param max_tokens).
int tdm_oai_request_max_tokens(const struct tdm_oai_request *req,
                               const struct tdm_oai_model_info *model, size_t prompt_len,
                               int *max_tokens, struct tdm_oai_error *e);

// ---- prompts of a request, tokenized ----------------------------------------------------
// One prompt of a completions request (or the rendered chat) as token ids.
struct tdm_oai_tokenized_prompt {
    int32_t *ids; // [n] heap
    size_t n;
    char *text; // the prompt text for echo (heap; NULL when not needed)
    size_t text_len;
    int max_tokens; // resolved against the context left (tdm_oai_request_max_tokens)
    // Prompt logprobs once a generator brought them (tdm_oai_call_take): [n]
    // entries, entry 0 without a logprob (vLLM's None), each with its top
    // alternatives, and each token's rank; NULL until then.
    struct tdm_oai_token_logprob *plp;
    int32_t *plp_rank;
};
struct tdm_tokenizer;
// Tokenizes the request's prompts (completions: one per prompt) or renders and
// tokenizes the chat (one; chat NULL means the model has none, chat_err says
// why). *out gets the array (n_out entries) even on failure, partly filled:
// free it with tdm_oai_prompts_free either way. *prompt_tokens is the sum of
// the prompts' lengths (usage counts each prompt once). TDM_OK, or an error
// code with e filled (4xx/5xx as vLLM words them).
int tdm_oai_prompts_build(const struct tdm_oai_request *req, const struct tdm_oai_model_info *info,
                          const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                          const char *chat_err, struct tdm_oai_tokenized_prompt **out,
                          size_t *n_out, int *prompt_tokens, struct tdm_oai_error *e);
void tdm_oai_prompts_free(struct tdm_oai_tokenized_prompt *p, size_t n); // NULL is fine
// The request's bad_words as the token sequences its sampling params forbid
// (vLLM's SamplingParams.update_from_tokenizer): each word with its leading
// whitespace stripped, tokenized without special tokens, and again after one
// space when that gives another first token and as many tokens (the word
// inside a text). Errors as vLLM's: a word of no tokens, more than
// TDM_MAX_BAD_WORDS sequences or TDM_MAX_BAD_WORD_TOKENS tokens, an id
// outside the model's vocabulary. TDM_OK (nothing to do without bad_words),
// or an error code with e filled.
int tdm_oai_bad_words_build(struct tdm_oai_request *req, const struct tdm_oai_model_info *info,
                            const struct tdm_tokenizer *tok, struct tdm_oai_error *e);
// A chat request's prompt text: its conversation (tool calls and results
// included) and its tools rendered with chat (NULL: the model has none, chat_err
// says why). *out heap. TDM_OK, or an error code with e (400 on "messages" when
// the template raises, 500 out of memory).
// --default-chat-template-kwargs' check: a JSON object that a request's
// chat_template_kwargs may hold (the flag's table check). TDM_EINVAL with err.
int tdm_oai_check_chat_template_kwargs(const char *value, char *err, size_t errlen);
// The role of a chat's answer, as vLLM's get_chat_request_role: "assistant"
// with add_generation_prompt, else the final message's role (the answer
// continues it).
const char *tdm_oai_response_role(const struct tdm_oai_request *req);
// A chat's echo (vLLM's chat echo): the final message's content (a list's
// texts joined by newlines) where its role is the answer's, else "". *text
// heap. TDM_OK or TDM_ENOMEM.
int tdm_oai_chat_echo(const struct tdm_oai_request *req, char **text);
int tdm_oai_chat_prompt(const struct tdm_oai_request *req, const struct tdm_chat_template *chat,
                        const char *chat_err, char **out, struct tdm_oai_error *e);

// ---- /tokenize and /detokenize --------------------------------------------------------
struct tdm_oai_tokenize_request {
    char *model;  // NULL when absent
    char *prompt; // set for the completions form, else NULL
    size_t prompt_len;
    struct tdm_chat_msg *messages; // set for the chat form, else NULL
    size_t n_messages;
    bool add_special_tokens;     // default true (prompt form), false (messages form)
    bool add_generation_prompt;  // default true
    bool continue_final_message; // default false
    bool return_token_strs;      // default false
    char *chat_template;         // chat form: as tdm_oai_request's
    char *chat_template_kwargs;  // chat form: as tdm_oai_request's
    char *conversation_json;     // chat form: the messages as the template sees them
    struct tdm_oai_tool_request tools; // chat form: the tools rendered (tool_choice unused)
};
int tdm_oai_tokenize_parse(struct tdm_oai_tokenize_request *req, const char *json, size_t len,
                           const struct tdm_oai_model_info *model, struct tdm_oai_error *e);
void tdm_oai_tokenize_fini(struct tdm_oai_tokenize_request *req);
// {"count","max_model_len","tokens":[...],"token_strs":[...]|null}; token_strs
// NULL gives null. Heap string; NULL on ENOMEM.
char *tdm_oai_tokenize_body(const int32_t *ids, size_t n, int max_model_len,
                            const char *const *token_strs);

struct tdm_oai_detokenize_request {
    char *model;     // NULL when absent
    int32_t *tokens; // checked against vocab_size
    size_t n_tokens;
};
int tdm_oai_detokenize_parse(struct tdm_oai_detokenize_request *req, const char *json, size_t len,
                             const struct tdm_oai_model_info *model, struct tdm_oai_error *e);
void tdm_oai_detokenize_fini(struct tdm_oai_detokenize_request *req);
// {"prompt": text}; invalid UTF-8 in text becomes U+FFFD. Heap string.
char *tdm_oai_detokenize_body(const char *text, size_t len);

// The whole /tokenize request: parse json, render the chat (messages form; chat
// NULL means the model has none, chat_err says why), encode with tok, build the
// body. TDM_OK with *body (heap; NULL on ENOMEM: answer 500), else an error
// code with e filled (4xx/5xx as vLLM words it).
struct tdm_tokenizer;
int tdm_oai_tokenize_run(const char *json, size_t len, const struct tdm_oai_model_info *info,
                         const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                         const char *chat_err, int max_model_len, char **body,
                         struct tdm_oai_error *e);
// The whole /detokenize request, the same way (ids outside the vocabulary: 400
// on "tokens").
int tdm_oai_detokenize_run(const char *json, size_t len, const struct tdm_oai_model_info *info,
                           const struct tdm_tokenizer *tok, char **body, struct tdm_oai_error *e);

// ---- response building -------------------------------------------------------------------
// Identity shared by every body and chunk of one response: same id and created.
struct tdm_oai_response {
    enum tdm_oai_kind kind;
    char id[96];       // "cmpl-<base>" or "chatcmpl-<base>"
    int64_t created;   // Unix seconds
    const char *model; // borrowed; the served model name
    const char *role;  // chat: the answer's role (borrowed; NULL: "assistant")
};
// base_id: the request's id (request_id field or X-Request-Id header; at most 80
// bytes are used), or NULL for 32 random hex digits.
void tdm_oai_response_init(struct tdm_oai_response *r, enum tdm_oai_kind kind, const char *model,
                           const char *base_id);


// One alternative's logprob at a position.
struct tdm_oai_top_logprob {
    int32_t id;
    const char *token; // the token's text (bytes; invalid UTF-8 becomes U+FFFD)
    size_t token_len;
    float logprob; // -inf is written as -9999.0, as vLLM does
};
// One generated token with its logprob and alternatives.
struct tdm_oai_token_logprob {
    int32_t id;
    const char *token;
    size_t token_len;
    float logprob;
    int num_top; // entries in top (the request's top_logprobs)
    const struct tdm_oai_top_logprob *top;
    bool no_logprob; // an echoed prompt's first token: null logprob and top_logprobs
};

// One choice of a body or chunk. All pointers are borrowed.
struct tdm_oai_choice {
    int index;
    const char *text; // full text (non-stream) or this chunk's delta; invalid UTF-8
    size_t text_len;  // becomes U+FFFD
    enum tdm_finish finish;
    const char *stop_str; // stop_reason: the matched stop string, else NULL
    int32_t stop_token;   // stop_reason: the matched stop token id, else -1
    bool has_logprobs;    // logprobs object (else null)
    bool tokens_as_ids;   // return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    const struct tdm_oai_token_logprob *logprobs;
    size_t n_logprobs;
    size_t text_offset;       // completions logprobs: code points of text before this
                              // choice's first token (echoed prompt + earlier chunks)
    // completions echo with logprobs: the prompt's entries (top cut to
    // echo_top) before `logprobs`, offsets from 0 through both (vLLM's one
    // list of prompt + output tokens)
    const struct tdm_oai_token_logprob *echo_logprobs;
    size_t n_echo_logprobs;
    int echo_top;
    // vLLM's prompt_logprobs field (non-stream): [n_prompt_logprobs] entries
    // with their ranks, top cut to prompt_top; NULL omits the field. Chat
    // writes the first such choice's at the response's top level.
    const struct tdm_oai_token_logprob *prompt_logprobs;
    const int32_t *prompt_ranks;
    size_t n_prompt_logprobs;
    int prompt_top;
    const int32_t *token_ids; // return_token_ids: this choice's ids (NULL: field omitted)
    size_t n_token_ids;
    const int32_t *prompt_token_ids; // return_token_ids: non-stream choices, first stream chunk
    size_t n_prompt_token_ids;
    // chat with tool calls: message.tool_calls (non-stream) or delta.tool_calls (stream)
    const struct tdm_oai_tool_call *tool_calls;   // [n_tool_calls] non-stream
    size_t n_tool_calls;
    const struct tdm_oai_tool_delta *tool_deltas; // [n_tool_deltas] stream
    size_t n_tool_deltas;
    bool content_null;      // message.content null (only tool calls); stream: no "content"
    bool finish_tool_calls; // finish_reason "tool_calls" instead of finish's
};
struct tdm_oai_usage {
    int prompt_tokens;
    int completion_tokens; // total_tokens = the sum
};

// Non-stream body: completions {"id","object":"text_completion","created","model",
// "choices":[{"index","text","logprobs","finish_reason","stop_reason"}],"usage"}
// or chat {"object":"chat.completion", choices [{"index","message":{"role":
// "assistant","content",...},"logprobs","finish_reason","stop_reason"}]}.
// Heap string (caller frees); NULL on ENOMEM.
char *tdm_oai_body(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices, size_t n,
                   const struct tdm_oai_usage *usage);
// One stream chunk (the JSON only; the http module frames it as an SSE event):
// completions "text_completion" choices with "text"; chat "chat.completion.chunk"
// choices with "delta":{"content":...}. usage NULL omits the field (pass it for
// continuous_usage_stats).
char *tdm_oai_chunk(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices,
                    size_t n, const struct tdm_oai_usage *usage);
// Chat only: the first chunk of a choice, delta {"role":"assistant","content":""}.
char *tdm_oai_chat_role_chunk(const struct tdm_oai_response *r, int index);
// The final usage-only chunk: "choices":[] and "usage" (stream_options.include_usage).
char *tdm_oai_usage_chunk(const struct tdm_oai_response *r, const struct tdm_oai_usage *usage);

// ---- /v1/models and /version --------------------------------------------------------------
struct tdm_oai_model_card {
    const char *id;     // served name
    const char *root;   // model path or HF id (NULL: = id)
    const char *parent; // NULL gives null
    int max_model_len;
    int64_t created;      // Unix seconds
    const char *owned_by; // NULL gives "vllm" (clients match on it)
};
char *tdm_oai_models_body(const struct tdm_oai_model_card *cards, size_t n);
char *tdm_oai_version_body(const char *version);

// ---- stop strings over a stream ------------------------------------------------------------
// Feeds generated text delta by delta. Each call hands back the text safe to send
// now: everything except a tail that could still become a stop string (and an
// incomplete UTF-8 character at the very end). When a stop string completes, the
// text before it (or through it, with include_stop_str_in_output) is handed back
// and the matcher is done: later feeds hand back nothing. When several stop
// strings complete in one feed, the one that ends first wins (then the longer).
// Memory grows to the longest delta plus the longest stop string, then stays.
struct tdm_oai_stop;
// stops: n non-empty strings (copied). n may be 0 (then every feed passes through).
int tdm_oai_stop_new(struct tdm_oai_stop **out, const char *const *stops, size_t n,
                     bool include_stop_str_in_output);
void tdm_oai_stop_free(struct tdm_oai_stop *s);
// *emit points into the matcher (valid until the next call). Returns the index of
// the matched stop string, or -1 while none matched (and after the match: -1 and
// nothing emitted). TDM-style errors: -2 on ENOMEM (nothing emitted).
int tdm_oai_stop_feed(struct tdm_oai_stop *s, const char *delta, size_t len, const char **emit,
                      size_t *emit_len);
// tdm_oai_stop_feed with may_match false holds back and emits the same way but
// matches nothing: vLLM evaluates stop strings only once more than min_tokens
// tokens were generated (then a stop string must end inside the new delta).
int tdm_oai_stop_feed_ex(struct tdm_oai_stop *s, const char *delta, size_t len, bool may_match,
                         const char **emit, size_t *emit_len);
// At the end of generation without a match: hands back the held tail.
void tdm_oai_stop_flush(struct tdm_oai_stop *s, const char **emit, size_t *emit_len);
bool tdm_oai_stop_done(const struct tdm_oai_stop *s);

// ---- response assembler: one choice's text pipeline ----------------------------------------
// What both servers (decode's engine loop and the router's upstream stream) do
// with the tokens of one choice: logprobs and token ids kept for the next
// chunk, detokenize, invalid UTF-8 to U+FFFD, stop strings (after min_tokens), finish reason and
// stop_reason, then the choice of a chunk or of the final body. The caller owns
// the generator: when a stop string completes, tdm_oai_asm_token / _finish
// report it and the caller stops (aborts or cancels) what produces the tokens.
// Fields are public so servers read the state (done, finish, error, counts)
// and mark an echoed prompt as sent. Allocation: grows the pending buffers to the
// longest run between two chunks, then reuses them (cleared after each send).
struct tdm_tokenizer;
struct tdm_detok;

struct tdm_oai_asm {
    int index;      // choice index in the response (prompt_idx * n + i)
    int prompt_idx; // which prompt the choice continues
    const struct tdm_oai_request *req; // borrowed: stop strings, logprobs, min_tokens...
    const struct tdm_tokenizer *tok;   // borrowed
    struct tdm_detok *detok;
    struct tdm_oai_stop *stop;
    bool done;       // finish known; later tokens are ignored
    bool reported;   // stream: the finish chunk was written
    enum tdm_finish finish;
    const char *stop_str; // the matched stop string (owned by req)
    int32_t stop_token;   // stop_reason as a token id, else -1
    int completion_tokens;
    int error;         // finish ERROR: the error code
    char message[256]; // finish ERROR: the message
    struct tdm_strbuf text; // non-stream: all text; stream: not yet sent
    struct tdm_oai_token_logprob *lps; // [n_lps] likewise; token strings owned here
    size_t n_lps, cap_lps;
    int32_t *ids; // [n_ids] likewise (return_token_ids)
    size_t n_ids, cap_ids;
    size_t chars_sent; // stream: code points already sent (text_offset)
    int tokens_sent;   // stream: completion_tokens when the last chunk went out
    bool first_sent;   // stream: prompt_token_ids went out
    bool echo_sent;    // stream with echo: the prompt's chunk went out
    struct tdm_strbuf clean; // scratch for the UTF-8 cleaning
    struct tdm_oai_toolparse *tools; // stream with tool parsing: text goes through it (text
                                     // then holds its content), its deltas wait for the chunk
};

// a is caller storage (zeroed or not). TDM_ENOMEM leaves a safe to _fini.
int tdm_oai_asm_init(struct tdm_oai_asm *a, const struct tdm_oai_request *req,
                     const struct tdm_tokenizer *tok, int index, int prompt_idx);
void tdm_oai_asm_fini(struct tdm_oai_asm *a); // a zeroed a is fine
// Forgets the finish of a failed attempt (a retry on another worker): tokens,
// text and counts stay as they are.
void tdm_oai_asm_reset_finish(struct tdm_oai_asm *a);
// One generated token with its logprob and top alternatives (top may be NULL).
// ended_by_it: this is the EOS/stop token that ended the request (it adds no
// text unless include_stop_str_in_output). *stopped is set true when a stop
// string completed here (the choice is done, finish stop). TDM_OK / TDM_ENOMEM.
int tdm_oai_asm_token(struct tdm_oai_asm *a, int32_t id, float logprob,
                      const struct tdm_token_logprob *top, int num_top, bool ended_by_it,
                      bool *stopped);
// The generator finished the choice: flushes held text, then (unless a stop
// string matched on the way) records finish, stop_token (-1 for none) and for
// TDM_FINISH_ERROR error and message (NULL or "": tdm_strerror(error)).
int tdm_oai_asm_finish(struct tdm_oai_asm *a, enum tdm_finish finish, int32_t stop_token,
                       int error, const char *message, bool *stopped);
// Ends the choice with an error the server itself saw (timeout, lost upstream).
void tdm_oai_asm_fail(struct tdm_oai_asm *a, int error, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
// Appends text to the pending text as is (an echoed prompt).
int tdm_oai_asm_add_text(struct tdm_oai_asm *a, const char *text, size_t len);
// The choice as it stands (pointers borrowed from a): pending text, logprobs and
// ids; with_finish adds finish and stop_reason. prompt_ids go out with
// return_token_ids until the first stream chunk was sent.
void tdm_oai_asm_choice(const struct tdm_oai_asm *a, bool with_finish, const int32_t *prompt_ids,
                        size_t n_prompt_ids, struct tdm_oai_choice *oc);
// Non-stream: the choice of the final body (with finish). With echo the
// prompt text comes first, joined with the generated text into *joined
// (caller's storage, zeroed before; free with tdm_strbuf_fini after the
// body is built) and text_offset counts the prompt. TDM_ENOMEM.
int tdm_oai_asm_body_choice(const struct tdm_oai_asm *a, bool echo, const char *prompt_text,
                            size_t prompt_text_len, const int32_t *prompt_ids,
                            size_t n_prompt_ids, struct tdm_strbuf *joined,
                            struct tdm_oai_choice *oc);
// A prompt's logprobs as a generator brings them (with its first tokens):
// copied into p->plp / plp_rank with each token's text (entry 0 marked
// no_logprob). Only the first set is kept; one whose length is not the
// prompt's is ignored. TDM_OK / TDM_ENOMEM. _free drops them (prompts_free
// does).
int tdm_oai_prompt_lp_set(struct tdm_oai_tokenized_prompt *p, const struct tdm_prompt_logprobs *pl,
                          const struct tdm_tokenizer *tok);
void tdm_oai_prompt_lp_free(struct tdm_oai_tokenized_prompt *p);
// Points oc's echo entries (echo with logprobs) and prompt_logprobs field at
// p's prompt logprobs, as rq asks (nothing when p has none).
void tdm_oai_prompt_lp_choice(const struct tdm_oai_request *rq,
                              const struct tdm_oai_tokenized_prompt *p, bool echo,
                              struct tdm_oai_choice *oc);
// The non-stream body of n finished choices: choices[i] continues
// prompts[choices[i]->prompt_idx]; with echo each text starts with its prompt.
// Heap string; NULL on ENOMEM.
struct tdm_oai_tokenized_prompt;
char *tdm_oai_asm_body(const struct tdm_oai_response *r, bool echo,
                       const struct tdm_oai_asm *const *choices, size_t n,
                       const struct tdm_oai_tokenized_prompt *prompts,
                       const struct tdm_oai_usage *usage);
// Stream: the next chunk of the choice into *json (heap, caller frees), or
// *json NULL when there is nothing to send (no new text and no finish to
// report; an error finish is the caller's error event). usage for
// continuous_usage_stats (NULL omits it). *finish_now says whether it carries
// the finish. TDM_ENOMEM. After the chunk went out call tdm_oai_asm_sent.
int tdm_oai_asm_stream_chunk(const struct tdm_oai_asm *a, const struct tdm_oai_response *r,
                             const int32_t *prompt_ids, size_t n_prompt_ids,
                             const struct tdm_oai_usage *usage, char **json, bool *finish_now);
void tdm_oai_asm_sent(struct tdm_oai_asm *a, bool finish_now);
// stop_reason of a request ended by token id: the id when it was one of the
// request's stop_token_ids, or one of generation_config.json's eos ids other
// than the tokenizer's EOS (vLLM adds those to stop_token_ids); false for EOS.
bool tdm_oai_is_stop_id(const struct tdm_sampling_params *sp, int32_t tok_eos,
                        const struct tdm_generation_config *gen, int32_t id);

// ---- one call: request, prompts and choices --------------------------------------------------
// What a server holds for one completions/chat call, the same in the decode
// worker (tokens from its engine) and the router (tokens from a decode worker's
// stream): the parsed request, the response's identity, the prompts as token
// ids and one assembler per choice. Where tokens come from stays with the
// server: it feeds choices[i] (tdm_oai_asm_token, _finish, _fail) and stops its
// generator when they report a stop string. The streaming loop over HTTP is
// tdm_oai_http_stream (openai_http.h).
struct tdm_oai_call {
    struct tdm_oai_request req;
    struct tdm_oai_response resp;
    struct tdm_oai_tokenized_prompt *prompts; // [n_prompts] heap
    size_t n_prompts;
    int prompt_tokens;           // usage: each prompt counted once
    struct tdm_oai_asm *choices; // [n_choices] heap: choice i continues prompt i / req.n;
    size_t n_choices;            // none for req.echo_only
    int stream_interval;         // stream: after a choice's first token, its tokens go out
                                 // this many at a time (and the rest at its finish), as
                                 // vLLM's --stream-interval; 0 or 1 = each as it comes.
                                 // Set by the server before tdm_oai_http_stream.
};
// Parses a completions or chat body, names the response (id from the body's
// request_id, else base_id (an X-Request-Id header; NULL = random), model
// info->served_name), tokenizes the prompts (tdm_oai_prompts_build) and, unless
// req.echo_only, sets up n_prompts * req.n choices. k is caller storage: free it
// with tdm_oai_call_fini whatever this returns. TDM_OK, or an error code with e
// filled (4xx/5xx as vLLM words it; 500 "out of memory").
int tdm_oai_call_init(struct tdm_oai_call *k, enum tdm_oai_kind kind, const char *json, size_t len,
                      const struct tdm_oai_model_info *info, const struct tdm_tokenizer *tok,
                      const struct tdm_chat_template *chat, const char *chat_err,
                      const char *base_id, struct tdm_oai_error *e);
void tdm_oai_call_fini(struct tdm_oai_call *k); // a zeroed k is fine
// True once every choice finished (an error finish counts).
bool tdm_oai_call_done(const struct tdm_oai_call *k);
// The first choice that finished with an error (its message is the client's), or NULL.
const struct tdm_oai_asm *tdm_oai_call_failed(const struct tdm_oai_call *k);
// The call's usage: prompt_tokens and all choices' completion tokens.
void tdm_oai_call_usage(const struct tdm_oai_call *k, struct tdm_oai_usage *u);
// Non-stream: the body of the finished choices with usage (echo as the request
// asks). Heap string; NULL on ENOMEM.
char *tdm_oai_call_body(const struct tdm_oai_call *k);
// Stream: choice i's next chunk as tdm_oai_asm_stream_chunk makes it (with
// continuous_usage_stats, usage is that choice's prompt and tokens so far).
// After the chunk went out call tdm_oai_asm_sent(&k->choices[i], *finish_now).
int tdm_oai_call_chunk(const struct tdm_oai_call *k, size_t i, char **json, bool *finish_now);
// One piece of a choice's generator output, in the generator's own terms (the
// engine's stream in the decode worker, a TokenChunk in the router): new
// tokens with their logprobs, and its finish once finished.
struct tdm_oai_gen_chunk {
    const int32_t *tokens;               // [n]
    size_t n;
    const float *logprobs;               // [n] or NULL (not asked for)
    const struct tdm_token_logprob *top; // [n][num_top] or NULL
    int num_top;                         // <= TDM_MAX_LOGPROBS
    // The prompt's logprobs (with the choice's first tokens) when the server
    // asked for them (tdm_oai_call_prompt_lp), else NULL
    const struct tdm_prompt_logprobs *prompt_logprobs;
    bool finished;                       // the generator is done with this choice
    enum tdm_finish reason;              // finished: why (not NONE)
    int32_t stop_token;                  // finished by a stop token id: that id, else -1
    int error;                           // reason ERROR: the code
    const char *message;                 // reason ERROR: the message (NULL = tdm_strerror)
};
// Feeds chunk c into choice i (the step the decode worker and the router
// share): every token into the assembler (the last one marked as the stop
// token when it ended the choice), then, when finished, the finish with the
// stop token named (stop_reason) only as vLLM names it: one of the request's
// stop_token_ids or generation_config's eos ids, never the tokenizer's own EOS
// tok_eos (tdm_oai_is_stop_id). *stopped: a stop string ended the choice here,
// so the caller stops its generator. Tokens after the choice is done are
// ignored. TDM_OK / TDM_ENOMEM.
int tdm_oai_call_take(struct tdm_oai_call *k, size_t i, const struct tdm_oai_gen_chunk *c,
                      int32_t tok_eos, const struct tdm_generation_config *gen, bool *stopped);
// The prompt logprobs choice i's generator must bring (their top count), or
// -1 for none: asked of the first choice of each prompt only, when the
// request has prompt_logprobs or echo with logprobs (the top count is the
// larger of the two asks).
int tdm_oai_call_prompt_lp(const struct tdm_oai_call *k, size_t i);
// Stream, completions with echo and logprobs: whether choice i's echo chunk
// may go now (its prompt's logprobs came, or the choice that brings them
// ended without them).
bool tdm_oai_call_echo_ready(const struct tdm_oai_call *k, size_t i);
// Stream, completions with echo: choice i's first chunk, its prompt's text alone
// (no logprobs entries, token_ids [] and prompt_token_ids with return_token_ids,
// usage as in tdm_oai_call_chunk), sent before any generated text of the
// choice. *json NULL when the prompt text is empty. The choice counts it as
// sent (text_offset moves past the prompt; prompt_token_ids went out) once
// built: a stream that cannot write it ends there. TDM_OK / TDM_ENOMEM.
int tdm_oai_call_echo_chunk(struct tdm_oai_call *k, size_t i, char **json);

// ---- helpers ------------------------------------------------------------------------------
// Python len() of UTF-8 text: code points (each invalid byte counts one, as its
// U+FFFD would).
size_t tdm_oai_utf8_chars(const char *s, size_t len);

#endif
