// SPDX-License-Identifier: Apache-2.0
// text: the text side of a served model, loaded the same way by the workers
// (worker/) and the router (router/router.c): the tokenizer, the chat
// template (the tokenizer's own or a --chat-template file), the generation
// config and the name the model is served under. A model is named by a local
// folder or a Hugging Face id (ORG/NAME), which tdm_text_resolve turns into
// the folder in the HF cache (downloading it when missing; HF_HOME, HF_TOKEN
// and HF_HUB_OFFLINE apply), so every service accepts both.
//
// Ownership: tdm_text_load fills caller storage; the tokenizer and the chat
// template are owned by it until tdm_text_fini. Everything is read-only after
// load and may be used from any thread.
#ifndef TDM_TEXT_H
#define TDM_TEXT_H

#include <stddef.h>

#include "hf.h"

struct tdm_tokenizer;
struct tdm_chat_template;

#define TDM_TEXT_NAME_MAX 1024 // room for a served name

struct tdm_text_config {
    const char *model;             // --model as given: a folder or an ORG/NAME id
    const char *model_path;        // the folder it names (tdm_text_resolve)
    const char *served_model_name; // --served-model-name; NULL or "" = derived (below)
    const char *chat_template;     // --chat-template FILE; NULL or "" = the tokenizer's
    const char *log_module;        // log module of the "chat endpoint disabled" warning
};

struct tdm_text {
    struct tdm_tokenizer *tok;        // owned
    struct tdm_chat_template *chat;   // owned; NULL when the model has no usable template
    char chat_err[256];               // why chat is NULL (the chat endpoint's 400 message)
    struct tdm_generation_config gen; // generation_config.json (defaults when absent)
    char served_name[TDM_TEXT_NAME_MAX];
};

// A local folder is used as it is (copied into path); an ORG/NAME id resolves
// to its snapshot in the HF cache, downloaded first when missing. revision
// NULL or "" = main. Errors as tdm_hub_resolve_model.
int tdm_text_resolve(const char *model, const char *revision, char *path, size_t pathlen, char *err,
                     size_t errlen);

// Loads tokenizer.json, generation_config.json and the chat template from
// cfg->model_path (the template is given the tokenizer's bos, eos and pad
// tokens, as HF does) and derives the served name. An explicit chat template that
// fails is an error; the tokenizer's own that fails (or none) only disables
// chat (t->chat NULL, t->chat_err says why, logged at WARN for a bad one).
// On error nothing is left to free. Errors: the failing module's code and message.
int tdm_text_load(struct tdm_text *t, const struct tdm_text_config *cfg, char *err, size_t errlen);
// Frees what load took. Accepts a zeroed struct.
void tdm_text_fini(struct tdm_text *t);

// The served name: served_model_name when given, else the Hub id as given
// (vLLM names a model by its --model), else config.json's _name_or_path in
// model_path, else the folder's last path component.
void tdm_text_served_name(char *out, size_t outlen, const char *model, const char *model_path,
                          const char *served_model_name);

// The context length served: requested (--max-model-len; 0 = the model's)
// within max_position_embeddings. TDM_EINVAL "--max-model-len N exceeds the
// model's max_position_embeddings M".
int tdm_text_context_len(int requested, int max_position_embeddings, int *out, char *err,
                         size_t errlen);

#endif
