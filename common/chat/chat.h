// SPDX-License-Identifier: Apache-2.0
// chat: renders OpenAI-style messages into a prompt string the way the model's
// Jinja chat template would. Tandem does not run Jinja: it recognises the known
// templates (Qwen2.5 ChatML with its default system prompt, generic ChatML,
// Llama 3) from the template text and renders them natively, byte for byte.
#ifndef TDM_CHAT_H
#define TDM_CHAT_H

#include <stdbool.h>
#include <stddef.h>

enum tdm_chat_format {
    TDM_CHAT_QWEN2 = 0,   // ChatML + Qwen2.5 default system prompt (tool-aware template)
    TDM_CHAT_CHATML,      // ChatML without a default system prompt
    TDM_CHAT_LLAMA3,      // <|start_header_id|>role<|end_header_id|>\n\ncontent<|eot_id|>
};

struct tdm_chat_msg {
    char *role;     // "system", "user", "assistant", "tool"
    char *content;  // text; a list of text parts is joined
};

struct tdm_chat_template;

// template_text: the chat_template from tokenizer_config.json (may be NULL);
// override_path: a --chat-template file (may be NULL; wins when given). An
// unrecognised template is TDM_EINVAL with a message naming the problem.
int tdm_chat_template_new(struct tdm_chat_template **out, const char *template_text,
                          const char *override_path, char *err, size_t errlen);
void tdm_chat_template_free(struct tdm_chat_template *t);
enum tdm_chat_format tdm_chat_template_format(const struct tdm_chat_template *t);

// Renders msgs; *out is heap (caller frees). TDM_EINVAL (with err) for roles or
// orders the template rejects.
int tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs, size_t n,
                    bool add_generation_prompt, char **out, char *err, size_t errlen);

// Parses an OpenAI "messages" JSON array (content as a string, null, or a list of
// {"type":"text","text":...} parts). *msgs is heap; free with tdm_chat_msgs_free.
int tdm_chat_msgs_parse(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                        char *err, size_t errlen);
void tdm_chat_msgs_free(struct tdm_chat_msg *msgs, size_t n);

#endif
