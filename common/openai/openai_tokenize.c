// SPDX-License-Identifier: Apache-2.0
// openai /tokenize and /detokenize: the whole request -> body step both
// servers (decode worker and router) serve the same way: parse, render the
// chat (messages form), encode or decode with the model's tokenizer, build the
// body. The servers only move bytes over HTTP.
#include "openai.h"

#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "tokenizer.h"

int tdm_oai_tokenize_run(const char *json, size_t len, const struct tdm_oai_model_info *info,
                         const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                         const char *chat_err, int max_model_len, char **body,
                         struct tdm_oai_error *e)
{
    *body = NULL;
    struct tdm_oai_tokenize_request rq;
    int rc = tdm_oai_tokenize_parse(&rq, json, len, info, e);
    if (rc != TDM_OK)
        return rc;
    char *rendered = NULL;
    const char *text = rq.prompt;
    size_t text_len = rq.prompt_len;
    int32_t *ids = NULL;
    size_t n = 0;
    char **strs = NULL;
    if (rq.messages != NULL) {
        char err[256];
        if (chat == NULL) {
            rc = tdm_oai_seterr(e, 400, NULL, "This model has no usable chat template: %s",
                                chat_err ? chat_err : "");
            goto out;
        }
        if (tdm_chat_render(chat, rq.messages, rq.n_messages, rq.add_generation_prompt, &rendered,
                            err, sizeof err) != TDM_OK) {
            rc = tdm_oai_seterr(e, 400, "messages", "%s", err);
            goto out;
        }
        text = rendered;
        text_len = strlen(rendered);
    }
    if (tdm_tok_encode(tok, text ? text : "", text ? text_len : 0, rq.add_special_tokens, &ids,
                       &n) != TDM_OK) {
        rc = tdm_oai_seterr(e, 500, NULL, "tokenization failed");
        goto out;
    }
    if (rq.return_token_strs) {
        strs = calloc(n ? n : 1, sizeof *strs);
        if (strs == NULL) {
            rc = tdm_oai_seterr(e, 500, NULL, "out of memory");
            goto out;
        }
        for (size_t i = 0; i < n; i++) {
            const char *piece = tdm_tok_id_to_piece(tok, ids[i]);
            strs[i] = (char *)(piece ? piece : "");
        }
    }
    *body = tdm_oai_tokenize_body(ids, n, max_model_len, (const char *const *)strs);
    rc = TDM_OK;
out:
    free(strs);
    free(ids);
    free(rendered);
    tdm_oai_tokenize_fini(&rq);
    return rc;
}

int tdm_oai_detokenize_run(const char *json, size_t len, const struct tdm_oai_model_info *info,
                           const struct tdm_tokenizer *tok, char **body, struct tdm_oai_error *e)
{
    *body = NULL;
    struct tdm_oai_detokenize_request rq;
    int rc = tdm_oai_detokenize_parse(&rq, json, len, info, e);
    if (rc != TDM_OK)
        return rc;
    char *text = NULL;
    size_t tl = 0;
    rc = tdm_tok_decode(tok, rq.tokens, rq.n_tokens, false, &text, &tl);
    if (rc != TDM_OK)
        rc = tdm_oai_seterr(e, rc == TDM_EINVAL ? 400 : 500, "tokens",
                            "Token ids are not in the vocabulary.");
    else
        *body = tdm_oai_detokenize_body(text, tl);
    free(text);
    tdm_oai_detokenize_fini(&rq);
    return rc;
}
