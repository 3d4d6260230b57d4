// SPDX-License-Identifier: Apache-2.0
// chat: renders OpenAI-style messages into a prompt string with the model's own
// Hugging Face chat template (a Jinja2 template), producing the same bytes as
// transformers' apply_chat_template (Jinja2 with trim_blocks, lstrip_blocks,
// loopcontrols, HF's tojson, raise_exception and strftime_now). The renderer covers
// the Jinja2 subset HF templates use (docs/chat-templates.md lists it); a template
// outside it is refused at load with the construct and its line.
//
// A loaded template is immutable: any number of threads may render with it at once.
// Each render allocates its own memory and is bounded in output size, loop
// iterations, call depth and work (docs/chat-templates.md, "Limits").
#ifndef TDM_CHAT_H
#define TDM_CHAT_H

#include <stdbool.h>
#include <stddef.h>

struct tdm_chat_msg {
    char *role;    // "system", "user", "assistant", "tool"
    char *content; // text; a list of text parts is joined
};

struct tdm_chat_template;

// template_text: the chat_template from tokenizer_config.json (may be NULL);
// override_path: a --chat-template value (may be NULL; wins when given): a file
// holding a template, or one of the built-in names "chatml", "qwen2", "llama3".
// Errors: TDM_EINVAL with "WHERE: chat template line N: what" for a template the
// renderer cannot run; TDM_ENOTFOUND/TDM_EIO when the file cannot be read.
int tdm_chat_template_new(struct tdm_chat_template **out, const char *template_text,
                          const char *override_path, char *err, size_t errlen);
void tdm_chat_template_free(struct tdm_chat_template *t);

// Sets a string variable every render sees, such as "bos_token" and "eos_token"
// from tokenizer_config.json (HF passes the tokenizer's special tokens). value NULL
// removes it (the template then sees it undefined, as HF does for a null token).
// Not thread-safe against concurrent renders: call before sharing the template.
// The built-in "llama3" name presets bos_token "<|begin_of_text|>".
int tdm_chat_template_set_var(struct tdm_chat_template *t, const char *name, const char *value);

// Sets every variable src has (its special tokens) on dst: a template a
// request brought (vLLM's chat_template with --trust-request-chat-template)
// sees the server's. src NULL: nothing. TDM_OK, TDM_ENOMEM, TDM_ECAPACITY.
int tdm_chat_template_copy_vars(struct tdm_chat_template *dst, const struct tdm_chat_template *src);

// Sets bos_token, eos_token and pad_token (HF passes the tokenizer's special
// tokens to the template); a NULL leaves that variable as it is. Callers pass the
// tokenizer's tokens: tdm_tok_id_to_piece(tok, tdm_tok_bos_id(tok)), and the same
// for eos and pad.
int tdm_chat_template_set_tokens(struct tdm_chat_template *t, const char *bos_token,
                                 const char *eos_token, const char *pad_token);

// Renders msgs ({role, content} only); *out is heap (caller frees). TDM_EINVAL
// (with err) for an unknown role, a missing content, or when the template raises
// (raise_exception) or fails (an undefined value used, a type error) as Jinja2
// would; TDM_ECAPACITY when a limit is hit.
int tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs, size_t n,
                    bool add_generation_prompt, char **out, char *err, size_t errlen);

// Renders the conversation exactly as given: messages_json is a JSON array of
// message objects passed to the template as they are (assistant "tool_calls",
// "tool_call_id", "name", null content...), tools_json a JSON array of tool
// definitions or NULL (the template then sees tools = none, as HF passes it).
// Same errors as tdm_chat_render, plus TDM_EINVAL for invalid JSON.
int tdm_chat_render_json(const struct tdm_chat_template *t, const char *messages_json,
                         const char *tools_json, bool add_generation_prompt, char **out, char *err,
                         size_t errlen);
// The same with extra template variables (vLLM's chat_template_kwargs, such as
// {"enable_thinking": false}): kwargs_json is a JSON object (or NULL: none)
// whose members the template sees as variables of their JSON values, set
// after the special tokens, messages, tools, documents and
// add_generation_prompt (so they win over them, as HF's template kwargs do;
// a caller that must keep some of those refuses them first).
int tdm_chat_render_json_kw(const struct tdm_chat_template *t, const char *messages_json,
                            const char *tools_json, const char *kwargs_json,
                            bool add_generation_prompt, char **out, char *err, size_t errlen);

// Parses an OpenAI "messages" JSON array (content as a string, null, or a list of
// {"type":"text","text":...} parts). *msgs is heap; free with tdm_chat_msgs_free.
int tdm_chat_msgs_parse(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                        char *err, size_t errlen);
// The same, accepting assistant "tool_calls" (left out of the {role, content}
// form: the caller renders them with tdm_chat_render_json, as common/edge/openai
// does); tdm_chat_msgs_parse refuses them so that tdm_chat_render never drops them.
int tdm_chat_msgs_parse_calls(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                              char *err, size_t errlen);
void tdm_chat_msgs_free(struct tdm_chat_msg *msgs, size_t n);

#endif
