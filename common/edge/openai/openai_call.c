// SPDX-License-Identifier: Apache-2.0
// openai call: the state of one completions/chat call that the decode worker
// and the router keep the same way (see struct tdm_oai_call in openai.h). It
// goes from the request body to prompts as token ids and one response
// assembler per choice, and reads back what both servers report from the
// assemblers: done, the first failure, usage, the non-stream body and a
// choice's next stream chunk. Feeding tokens in is the server's (they come
// from an engine or from another worker); no I/O here.
#include "openai.h"

#include <stdlib.h>
#include <string.h>

#include "core.h"

int tdm_oai_call_init(struct tdm_oai_call *k, enum tdm_oai_kind kind, const char *json, size_t len,
                      const struct tdm_oai_model_info *info, const struct tdm_tokenizer *tok,
                      const struct tdm_chat_template *chat, const char *chat_err,
                      const char *base_id, struct tdm_oai_error *e)
{
    memset(k, 0, sizeof *k);
    int rc = tdm_oai_request_parse(&k->req, kind, json, len, info, e);
    if (rc != TDM_OK)
        return rc;
    tdm_oai_response_init(&k->resp, kind, info->served_name,
                          k->req.request_id ? k->req.request_id : base_id);
    if (kind == TDM_OAI_CHAT)
        k->resp.role = tdm_oai_response_role(&k->req);
    rc = tdm_oai_prompts_build(&k->req, info, tok, chat, chat_err, &k->prompts, &k->n_prompts,
                               &k->prompt_tokens, e);
    if (rc == TDM_OK)
        rc = tdm_oai_bad_words_build(&k->req, info, tok, e);
    if (rc != TDM_OK || k->req.echo_only)
        return rc;
    size_t n = (size_t)k->req.n, n_choices = k->n_prompts * n;
    k->choices = calloc(n_choices ? n_choices : 1, sizeof *k->choices);
    if (k->choices == NULL)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    k->n_choices = n_choices;
    for (size_t i = 0; i < k->n_choices; i++)
        if (tdm_oai_asm_init(&k->choices[i], &k->req, tok, (int)i, (int)(i / n)) != TDM_OK)
            return tdm_oai_seterr(e, 500, NULL, "out of memory");
    return TDM_OK;
}

void tdm_oai_call_fini(struct tdm_oai_call *k)
{
    for (size_t i = 0; i < k->n_choices; i++)
        tdm_oai_asm_fini(&k->choices[i]);
    free(k->choices);
    tdm_oai_prompts_free(k->prompts, k->n_prompts);
    tdm_oai_request_fini(&k->req);
    memset(k, 0, sizeof *k);
}

bool tdm_oai_call_done(const struct tdm_oai_call *k)
{
    for (size_t i = 0; i < k->n_choices; i++)
        if (!k->choices[i].done)
            return false;
    return true;
}

const struct tdm_oai_asm *tdm_oai_call_failed(const struct tdm_oai_call *k)
{
    for (size_t i = 0; i < k->n_choices; i++)
        if (k->choices[i].done && k->choices[i].finish == TDM_FINISH_ERROR)
            return &k->choices[i];
    return NULL;
}

void tdm_oai_call_usage(const struct tdm_oai_call *k, struct tdm_oai_usage *u)
{
    u->prompt_tokens = k->prompt_tokens;
    u->completion_tokens = 0;
    for (size_t i = 0; i < k->n_choices; i++)
        u->completion_tokens += k->choices[i].completion_tokens;
}

char *tdm_oai_call_body(const struct tdm_oai_call *k)
{
    const struct tdm_oai_asm **asms = calloc(k->n_choices ? k->n_choices : 1, sizeof *asms);
    if (asms == NULL)
        return NULL;
    for (size_t i = 0; i < k->n_choices; i++)
        asms[i] = &k->choices[i];
    struct tdm_oai_usage u;
    tdm_oai_call_usage(k, &u);
    char *body = tdm_oai_asm_body(&k->resp, k->req.echo, asms, k->n_choices, k->prompts, &u);
    free(asms);
    return body;
}

int tdm_oai_call_chunk(const struct tdm_oai_call *k, size_t i, char **json, bool *finish_now)
{
    const struct tdm_oai_asm *a = &k->choices[i];
    const struct tdm_oai_tokenized_prompt *p = &k->prompts[a->prompt_idx];
    // continuous_usage_stats: this choice's prompt and its tokens so far.
    struct tdm_oai_usage u = {(int)p->n, a->completion_tokens};
    return tdm_oai_asm_stream_chunk(a, &k->resp, p->ids, p->n,
                                    k->req.continuous_usage_stats ? &u : NULL, json, finish_now);
}

int tdm_oai_call_echo_chunk(struct tdm_oai_call *k, size_t i, char **json)
{
    struct tdm_oai_asm *a = &k->choices[i];
    const struct tdm_oai_tokenized_prompt *p = &k->prompts[a->prompt_idx];
    *json = NULL;
    if (p->text == NULL || p->text_len == 0)
        return TDM_OK;
    // The prompt alone: tokens the choice already holds (the router reads its
    // first tokens before the stream starts) follow in its next chunk.
    static const int32_t none[1] = {0}; // token_ids [] (not an omitted field)
    struct tdm_oai_choice oc;
    memset(&oc, 0, sizeof oc);
    oc.index = a->index;
    oc.text = p->text;
    oc.text_len = p->text_len;
    oc.stop_token = -1;
    if (k->req.kind == TDM_OAI_CHAT) {
        // vLLM's chat echo: a content delta alone, no logprobs or ids.
        *json = tdm_oai_chunk(&k->resp, &oc, 1, NULL);
        a->echo_sent = true;
        return *json ? TDM_OK : TDM_ENOMEM;
    }
    oc.has_logprobs = k->req.logprobs;
    oc.tokens_as_ids = k->req.return_tokens_as_token_ids;
    oc.text_offset = a->chars_sent;
    tdm_oai_prompt_lp_choice(&k->req, p, true, &oc);
    oc.prompt_logprobs = NULL; // a non-stream field
    if (k->req.return_token_ids) {
        oc.token_ids = none;
        if (!a->first_sent) {
            oc.prompt_token_ids = p->ids;
            oc.n_prompt_token_ids = p->n;
        }
    }
    struct tdm_oai_usage u = {(int)p->n, a->completion_tokens};
    *json = tdm_oai_chunk(&k->resp, &oc, 1, k->req.continuous_usage_stats ? &u : NULL);
    if (*json == NULL)
        return TDM_ENOMEM;
    a->chars_sent += tdm_oai_utf8_chars(p->text, p->text_len);
    a->first_sent = true;
    a->echo_sent = true;
    return TDM_OK;
}

int tdm_oai_call_prompt_lp(const struct tdm_oai_call *k, size_t i)
{
    const struct tdm_oai_request *rq = &k->req;
    if (i % (size_t)rq->n != 0)
        return -1;
    int top = rq->prompt_logprobs;
    if (rq->echo && rq->logprobs && rq->kind == TDM_OAI_COMPLETION && rq->top_logprobs > top)
        top = rq->top_logprobs;
    return top;
}

bool tdm_oai_call_echo_ready(const struct tdm_oai_call *k, size_t i)
{
    const struct tdm_oai_asm *a = &k->choices[i];
    if (!(k->req.echo && k->req.logprobs && k->req.kind == TDM_OAI_COMPLETION))
        return true;
    size_t owner = (size_t)a->prompt_idx * (size_t)k->req.n;
    return k->prompts[a->prompt_idx].plp != NULL || k->choices[owner].done;
}

int tdm_oai_call_take(struct tdm_oai_call *k, size_t i, const struct tdm_oai_gen_chunk *c,
                      int32_t tok_eos, const struct tdm_generation_config *gen, bool *stopped)
{
    struct tdm_oai_asm *a = &k->choices[i];
    *stopped = false;
    if (c->prompt_logprobs &&
        tdm_oai_prompt_lp_set(&k->prompts[a->prompt_idx], c->prompt_logprobs, a->tok) != TDM_OK)
        return TDM_ENOMEM;
    for (size_t t = 0; t < c->n && !a->done; t++) {
        int32_t id = c->tokens[t];
        // The EOS or stop id that ended the choice is its last token.
        bool ended_by_it = c->finished && c->reason == TDM_FINISH_STOP && c->stop_token >= 0 &&
                           t == c->n - 1 && id == c->stop_token;
        if (tdm_oai_asm_token(a, id, c->logprobs ? c->logprobs[t] : 0.0f,
                              c->top ? c->top + t * (size_t)c->num_top : NULL,
                              c->top ? c->num_top : 0, ended_by_it, stopped) != TDM_OK)
            return TDM_ENOMEM;
    }
    if (a->done || !c->finished)
        return TDM_OK;
    int32_t stop_token = c->reason == TDM_FINISH_STOP && c->stop_token >= 0 &&
                                 tdm_oai_is_stop_id(&k->req.sampling, tok_eos, gen, c->stop_token)
                             ? c->stop_token
                             : -1;
    return tdm_oai_asm_finish(a, c->reason, stop_token, c->error, c->message, stopped);
}
