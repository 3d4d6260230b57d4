// SPDX-License-Identifier: Apache-2.0
// text: tokenizer, chat template, generation config and served name of a
// model folder (see text.h). The rules live here once so that a worker and the
// router serving the same --model answer the same name, template and stops.
#include "text.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "chat.h"
#include "core.h"
#include "hub.h"
#include "tokenizer.h"

int tdm_text_resolve(const char *model, const char *revision, char *path, size_t pathlen, char *err,
                     size_t errlen)
{
    return tdm_hub_resolve_model(model, revision && revision[0] ? revision : NULL, NULL, path,
                                 pathlen, err, errlen);
}

// config.json's _name_or_path into out; false when absent or unreadable.
static bool name_or_path(char *out, size_t outlen, const char *model_path)
{
    char *path = tdm_path_join(model_path, "config.json");
    char *text = NULL;
    size_t len = 0;
    char err[64];
    bool found = false;
    if (path && tdm_read_file(path, &text, &len, err, sizeof err) == TDM_OK) {
        cJSON *j = tdm_json_check_depth(text, len, TDM_JSON_MAX_DEPTH, NULL, 0)
                       ? NULL
                       : cJSON_ParseWithLength(text, len);
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(j, "_name_or_path");
        if (cJSON_IsString(n) && n->valuestring[0]) {
            snprintf(out, outlen, "%s", n->valuestring);
            found = true;
        }
        cJSON_Delete(j);
    }
    free(text);
    free(path);
    return found;
}

void tdm_text_served_name(char *out, size_t outlen, const char *model, const char *model_path,
                          const char *served_model_name)
{
    if (served_model_name && served_model_name[0]) {
        snprintf(out, outlen, "%s", served_model_name);
        return;
    }
    struct stat st;
    if (stat(model, &st) != 0 || !S_ISDIR(st.st_mode)) { // a Hub id
        snprintf(out, outlen, "%s", model);
        return;
    }
    if (name_or_path(out, outlen, model_path))
        return;
    char dir[TDM_TEXT_NAME_MAX];
    snprintf(dir, sizeof dir, "%s", model_path);
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        dir[--n] = '\0';
    const char *base = strrchr(dir, '/');
    snprintf(out, outlen, "%s", base && base[1] ? base + 1 : dir);
}

int tdm_text_load(struct tdm_text *t, const struct tdm_text_config *cfg, char *err, size_t errlen)
{
    memset(t, 0, sizeof *t);
    int rc = tdm_tok_load(&t->tok, cfg->model_path, err, errlen);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_hf_generation_config_load(&t->gen, cfg->model_path, err, errlen);
    if (rc != TDM_OK)
        goto fail;
    const char *tmpl = tdm_tok_chat_template(t->tok);
    if (cfg->chat_template && cfg->chat_template[0]) {
        // An explicit template must work.
        rc = tdm_chat_template_new(&t->chat, tmpl, cfg->chat_template, err, errlen);
        if (rc != TDM_OK)
            goto fail;
    } else if (tmpl == NULL) {
        snprintf(t->chat_err, sizeof t->chat_err,
                 "tokenizer_config.json has no chat_template (use --chat-template)");
    } else if (tdm_chat_template_new(&t->chat, tmpl, NULL, t->chat_err, sizeof t->chat_err) !=
               TDM_OK) {
        t->chat = NULL;
        TDM_LOG_WARN(cfg->log_module ? cfg->log_module : "text", "chat endpoint disabled: %s",
                     t->chat_err);
    }
    // HF hands the template the tokenizer's special tokens (bos_token, eos_token).
    if (t->chat && (rc = tdm_chat_template_set_tokens(
                        t->chat, tdm_tok_id_to_piece(t->tok, tdm_tok_bos_id(t->tok)),
                        tdm_tok_id_to_piece(t->tok, tdm_tok_eos_id(t->tok)),
                        tdm_tok_id_to_piece(t->tok, tdm_tok_pad_id(t->tok)))) != TDM_OK) {
        tdm_seterr(err, errlen, rc, "chat template: setting special tokens failed");
        goto fail;
    }
    tdm_text_served_name(t->served_name, sizeof t->served_name, cfg->model, cfg->model_path,
                         cfg->served_model_name);
    return TDM_OK;
fail:
    tdm_text_fini(t);
    return rc;
}

void tdm_text_fini(struct tdm_text *t)
{
    tdm_chat_template_free(t->chat);
    tdm_tok_free(t->tok);
    t->chat = NULL;
    t->tok = NULL;
}

int tdm_text_context_len(int requested, int max_position_embeddings, int *out, char *err,
                         size_t errlen)
{
    if (requested > max_position_embeddings)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--max-model-len %d exceeds the model's max_position_embeddings %d",
                          requested, max_position_embeddings);
    *out = requested ? requested : max_position_embeddings;
    return TDM_OK;
}
