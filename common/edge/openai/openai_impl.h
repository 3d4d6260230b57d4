// SPDX-License-Identifier: Apache-2.0
// openai internals shared by the request parser and the response builders:
// Python-style float formatting for error messages and UTF-8 repair for text
// that goes into JSON strings.
#ifndef TDM_OPENAI_IMPL_H
#define TDM_OPENAI_IMPL_H

#include <stddef.h>

#include "openai.h"

struct cJSON;

// Formats v as Python's repr(float) would for ordinary values: the shortest
// digits that read back to the same double, with ".0" added to integral values
// ("3.0", "0.7", "1e-05" is written "1e-05"). out must hold 32 bytes.
void tdm_oai_fmt_float(char out[32], double v);

// Copies len bytes of s into a heap NUL-terminated string, replacing each
// invalid UTF-8 sequence (and NUL bytes, which cJSON strings cannot carry) with
// U+FFFD, the way Python's decode(errors="replace") does. NULL on ENOMEM.
char *tdm_oai_utf8_dup(const char *s, size_t len);

// tdm_oai_chunk through the cJSON tree whatever the choices hold (the
// reference its direct writer is tested against).
char *tdm_oai_chunk_tree(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices,
                         size_t n, const struct tdm_oai_usage *usage);

// Length of the valid UTF-8 sequence starting at s (1..4), or 0 when s[0..len)
// does not start with one (invalid or truncated).
size_t tdm_oai_utf8_seq_len(const unsigned char *s, size_t len);

// ---- tools (openai_tools.c) -----------------------------------------------------------
// The tool fields of a chat body (root): tools, tool_choice, parallel_tool_calls,
// resolved against the server's parser (m->tool_parser; m may be NULL).
// tools_only (/tokenize): only `tools` is read (to render). *t is filled (free
// with tdm_oai_tool_request_fini whatever this returns). TDM_OK, or TDM_EINVAL /
// TDM_ENOMEM with e (400 naming the field / 500).
int tdm_oai_tools_parse(const struct cJSON *root, const struct tdm_oai_model_info *m,
                        bool tools_only, struct tdm_oai_tool_request *t, struct tdm_oai_error *e);
// tool_choice "required" or a named function: the JSON Schema of the forced
// call (tdm_oai_tool_constraint_schema) becomes the request's constraint
// (tdm_oai_request_set_constraint, param "tool_choice"), so the sampler makes
// the output parse. Nothing for none/auto. TDM_OK, or an error code with e
// (400: the grammar engine refuses a tool's parameters, or the request has
// another constraint).
int tdm_oai_tools_force(struct tdm_oai_request *r, struct tdm_oai_error *e);
// The messages as the chat template sees them (vLLM's conversation): for each
// message {"role", "content": msgs[i].content (one string)}, an assistant's
// "tool_calls" with each function.arguments parsed from its JSON string, a tool
// message's "tool_call_id", a string "name". messages is the body's array and
// msgs its tdm_chat_msgs_parse form (n entries). *out heap compact JSON.
// TDM_OK, or TDM_EINVAL (400 on "messages") / TDM_ENOMEM with e.
int tdm_oai_conversation_json(const struct cJSON *messages, const struct tdm_chat_msg *msgs,
                              size_t n, char **out, struct tdm_oai_error *e);

#endif
