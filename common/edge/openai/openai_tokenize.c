// SPDX-License-Identifier: Apache-2.0
// openai tokenizing steps both servers (decode worker and router) take the
// same way: /tokenize and /detokenize from request to body (parse, render the
// chat, encode or decode, build the body), and a generation request's prompts
// turned into token ids with their max_tokens. The servers only move bytes.
#include "openai.h"

#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "tokenizer.h"

// The final message's content (as the template sees it: a list's texts joined
// by newlines, null as ""), "" without messages.
static const char *final_content(const struct tdm_chat_msg *msgs, size_t n)
{
    return n > 0 && msgs[n - 1].content ? msgs[n - 1].content : "";
}

// The last occurrence of needle[0 .. n) in hay, or NULL (Python's rindex).
static const char *last_of(const char *hay, const char *needle, size_t n)
{
    size_t h = strlen(hay);
    for (size_t i = h >= n ? h - n + 1 : 0; i-- > 0;)
        if (memcmp(hay + i, needle, n) == 0)
            return hay + i;
    return NULL;
}

// Renders a chat (the request's conversation, tools and template kwargs)
// with the server's template chat, or the request's own template text
// (own: with chat's special tokens) and, with continue_final_message (final:
// the final message's content; NULL without it), cuts the prompt right after
// that content as HF's apply_chat_template does: its last occurrence, else
// that of the content stripped of whitespace where the template stripped it,
// else 400 in HF's words.
static int render_chat(const struct tdm_chat_template *chat, const char *chat_err, const char *own,
                       const char *conversation_json, const char *tools_json, const char *kwargs,
                       bool add_generation_prompt, const char *final, char **out,
                       struct tdm_oai_error *e)
{
    char err[256];
    struct tdm_chat_template *mine = NULL;
    if (own) {
        int rc = tdm_chat_template_new(&mine, own, NULL, err, sizeof err);
        if (rc == TDM_OK)
            rc = tdm_chat_template_copy_vars(mine, chat);
        if (rc != TDM_OK) {
            tdm_chat_template_free(mine);
            return tdm_oai_seterr(e, rc == TDM_ENOMEM ? 500 : 400, "chat_template", "%s",
                                  rc == TDM_ENOMEM ? "out of memory" : err);
        }
        chat = mine;
    }
    if (chat == NULL)
        return tdm_oai_seterr(e, 400, NULL, "This model has no usable chat template: %s",
                              chat_err ? chat_err : "");
    int rc = tdm_chat_render_json_kw(chat, conversation_json, tools_json, kwargs,
                                     add_generation_prompt, out, err, sizeof err);
    tdm_chat_template_free(mine);
    if (rc != TDM_OK)
        return tdm_oai_seterr(e, rc == TDM_ENOMEM ? 500 : 400, "messages", "%s", err);
    if (final == NULL)
        return TDM_OK;
    size_t n = strlen(final);
    const char *at = last_of(*out, final, n);
    if (at == NULL) {
        const char *s = final, *end = final + n; // Python's str.strip()
        while (s < end && (*s == ' ' || (*s >= '\t' && *s <= '\r')))
            s++;
        while (end > s && (end[-1] == ' ' || (end[-1] >= '\t' && end[-1] <= '\r')))
            end--;
        n = (size_t)(end - s);
        at = last_of(*out, s, n);
    }
    if (at == NULL) {
        free(*out);
        *out = NULL;
        return tdm_oai_seterr(e, 400, "continue_final_message",
                              "continue_final_message is set but the final message does not "
                              "appear in the chat after applying the chat template! This can "
                              "happen if the chat template deletes portions of the final message. "
                              "Please verify the chat template outputs the final message "
                              "unmodified.");
    }
    (*out)[at - *out + n] = '\0';
    return TDM_OK;
}

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
        rc = render_chat(chat, chat_err, rq.chat_template, rq.conversation_json,
                         rq.tools.tools_json, rq.chat_template_kwargs, rq.add_generation_prompt,
                         rq.continue_final_message ? final_content(rq.messages, rq.n_messages)
                                                   : NULL,
                         &rendered, e);
        if (rc != TDM_OK)
            goto out;
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

int tdm_oai_chat_prompt(const struct tdm_oai_request *req, const struct tdm_chat_template *chat,
                        const char *chat_err, char **out, struct tdm_oai_error *e)
{
    *out = NULL;
    // The conversation as vLLM hands it to the template: tool calls and tool
    // results included, and the tools when the request has them.
    return render_chat(
        chat, chat_err, req->chat_template, req->conversation_json, req->tools.tools_json,
        req->chat_template_kwargs, req->add_generation_prompt,
        req->continue_final_message ? final_content(req->messages, req->n_messages) : NULL, out, e);
}

int tdm_oai_chat_echo(const struct tdm_oai_request *req, char **text)
{
    // vLLM: the final message's content when its role is the response's.
    size_t n = req->n_messages;
    const char *role = n > 0 ? req->messages[n - 1].role : NULL;
    bool same = role && strcmp(role, tdm_oai_response_role(req)) == 0;
    *text = strdup(same ? final_content(req->messages, n) : "");
    return *text ? TDM_OK : TDM_ENOMEM;
}

// p's echo text from its ids (ids the tokenizer rejects echo ""), replacing
// any text it had. TDM_OK or TDM_ENOMEM.
static int echo_text_of_ids(const struct tdm_tokenizer *tok, struct tdm_oai_tokenized_prompt *p)
{
    free(p->text);
    p->text = NULL;
    p->text_len = 0;
    if (tdm_tok_decode(tok, p->ids, p->n, false, &p->text, &p->text_len) == TDM_OK)
        return TDM_OK;
    p->text = strdup("");
    p->text_len = 0;
    return p->text ? TDM_OK : TDM_ENOMEM;
}

int tdm_oai_prompts_build(const struct tdm_oai_request *req, const struct tdm_oai_model_info *info,
                          const struct tdm_tokenizer *tok, const struct tdm_chat_template *chat,
                          const char *chat_err, struct tdm_oai_tokenized_prompt **out,
                          size_t *n_out, int *prompt_tokens, struct tdm_oai_error *e)
{
    const struct tdm_oai_request *rq = req;
    size_t np = rq->kind == TDM_OAI_CHAT ? 1 : rq->n_prompts;
    *out = calloc(np ? np : 1, sizeof **out);
    *n_out = 0;
    *prompt_tokens = 0;
    if (*out == NULL)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    *n_out = np;
    for (size_t i = 0; i < np; i++) {
        struct tdm_oai_tokenized_prompt *p = &(*out)[i];
        const char *text = NULL;
        bool from_ids = false; // a token-id prompt
        size_t text_len = 0;
        char *rendered = NULL;
        if (rq->kind == TDM_OAI_CHAT) {
            int rc = tdm_oai_chat_prompt(rq, chat, chat_err, &rendered, e);
            if (rc != TDM_OK)
                return rc;
            text = rendered;
            text_len = strlen(rendered);
        } else if (rq->prompts[i].text != NULL) {
            text = rq->prompts[i].text;
            text_len = rq->prompts[i].text_len;
        }
        if (text != NULL) {
            int rc = tdm_tok_encode(tok, text, text_len, rq->add_special_tokens, &p->ids, &p->n);
            if (rc == TDM_OK) {
                p->text = malloc(text_len + 1);
                if (p->text) {
                    memcpy(p->text, text, text_len);
                    p->text[text_len] = '\0';
                    p->text_len = text_len;
                }
            }
            free(rendered);
            if (rc != TDM_OK || p->text == NULL)
                return tdm_oai_seterr(e, 500, NULL, "tokenization failed: %s", tdm_strerror(rc));
        } else {
            p->n = rq->prompts[i].n_ids;
            p->ids = malloc((p->n ? p->n : 1) * sizeof *p->ids);
            if (p->ids == NULL)
                return tdm_oai_seterr(e, 500, NULL, "out of memory");
            memcpy(p->ids, rq->prompts[i].ids, p->n * sizeof *p->ids);
            from_ids = true;
        }
        // vLLM's left truncation: the last N tokens stay.
        bool cut = rq->truncate_prompt_tokens > 0 && p->n > (size_t)rq->truncate_prompt_tokens;
        if (cut) {
            size_t keep = (size_t)rq->truncate_prompt_tokens;
            memmove(p->ids, p->ids + (p->n - keep), keep * sizeof *p->ids);
            p->n = keep;
        }
        // An echo shows what the model saw: a token-id prompt's or a cut
        // prompt's text is that of its (kept) ids. A chat's echo is vLLM's:
        // the final message's content where its role is the response's.
        if (rq->echo && (from_ids || cut) && rq->kind != TDM_OAI_CHAT &&
            echo_text_of_ids(tok, p) != TDM_OK)
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
        if (rq->echo && rq->kind == TDM_OAI_CHAT) {
            free(p->text);
            p->text = NULL;
            if (tdm_oai_chat_echo(rq, &p->text) != TDM_OK)
                return tdm_oai_seterr(e, 500, NULL, "out of memory");
            p->text_len = strlen(p->text);
        }
        if (p->n == 0)
            return tdm_oai_seterr(e, 400, "prompt", "The decoder prompt cannot be empty");
        int rc = tdm_oai_request_max_tokens(rq, info, p->n, &p->max_tokens, e);
        if (rc != TDM_OK)
            return rc;
        *prompt_tokens += (int)p->n;
    }
    return TDM_OK;
}

void tdm_oai_prompts_free(struct tdm_oai_tokenized_prompt *p, size_t n)
{
    for (size_t i = 0; p && i < n; i++) {
        tdm_oai_prompt_lp_free(&p[i]);
        free(p[i].ids);
        free(p[i].text);
    }
    free(p);
}

int tdm_oai_bad_words_build(struct tdm_oai_request *req, const struct tdm_oai_model_info *info,
                            const struct tdm_tokenizer *tok, struct tdm_oai_error *e)
{
    if (req->n_bad_words == 0)
        return TDM_OK;
    free(req->bad_word_ids);
    free(req->bad_word_lens);
    req->bad_word_ids = malloc(TDM_MAX_BAD_WORD_TOKENS * sizeof *req->bad_word_ids);
    req->bad_word_lens = malloc(TDM_MAX_BAD_WORDS * sizeof *req->bad_word_lens);
    if (!req->bad_word_ids || !req->bad_word_lens)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    int n_words = 0, total = 0, rc = TDM_OK;
    char *spaced = NULL;
    int32_t *ids = NULL;
    for (size_t w = 0; w < req->n_bad_words && rc == TDM_OK; w++) {
        const char *word = req->bad_words[w];
        while (*word == ' ' || (*word >= '\t' && *word <= '\r')) // Python's lstrip(), ASCII
            word++;
        size_t len = strlen(word);
        free(spaced);
        spaced = malloc(len + 2);
        if (!spaced) {
            rc = tdm_oai_seterr(e, 500, NULL, "out of memory");
            break;
        }
        spaced[0] = ' ';
        memcpy(spaced + 1, word, len + 1);
        for (int prefix = 0; prefix < 2; prefix++) {
            size_t n = 0;
            free(ids);
            ids = NULL;
            if (tdm_tok_encode(tok, prefix ? spaced : word, prefix ? len + 1 : len, false, &ids,
                               &n) != TDM_OK) {
                rc = tdm_oai_seterr(e, 500, NULL, "tokenization failed");
                break;
            }
            if (n == 0) {
                if (!prefix) {
                    rc = tdm_oai_seterr(e, 400, "bad_words",
                                        "bad_words entries must tokenize to at least one token.");
                    break;
                }
                continue;
            }
            // The spaced form only where it is another word: another first
            // token, and as many tokens as the word alone.
            if (prefix) {
                const int32_t *last = req->bad_word_ids + total - req->bad_word_lens[n_words - 1];
                if (ids[0] == last[0] || (int)n != req->bad_word_lens[n_words - 1])
                    continue;
            }
            if (n_words == TDM_MAX_BAD_WORDS) {
                rc = tdm_oai_seterr(
                    e, 400, "bad_words",
                    "Too many bad words after tokenization: %d. The max number is %d.", n_words + 1,
                    TDM_MAX_BAD_WORDS);
                break;
            }
            if (n > (size_t)(TDM_MAX_BAD_WORD_TOKENS - total)) {
                rc = tdm_oai_seterr(e, 400, "bad_words",
                                    "bad_words hold more than %d tokens after tokenization",
                                    TDM_MAX_BAD_WORD_TOKENS);
                break;
            }
            for (size_t i = 0; i < n && rc == TDM_OK; i++)
                if (ids[i] < 0 || (info && info->vocab_size > 0 && ids[i] >= info->vocab_size))
                    rc = tdm_oai_seterr(
                        e, 400, "bad_words",
                        "The model vocabulary size is %d, but the following tokens were "
                        "specified as bad: [%d]. All token id values should be integers "
                        "satisfying: 0 <= token_id <= %d.",
                        info->vocab_size, (int)ids[i], info->vocab_size - 1);
            if (rc != TDM_OK)
                break;
            memcpy(req->bad_word_ids + total, ids, n * sizeof *ids);
            req->bad_word_lens[n_words++] = (int32_t)n;
            total += (int)n;
        }
    }
    free(spaced);
    free(ids);
    if (rc != TDM_OK)
        return rc;
    req->sampling.bad_word_ids = req->bad_word_ids;
    req->sampling.bad_word_lens = req->bad_word_lens;
    req->sampling.num_bad_words = n_words;
    return TDM_OK;
}
