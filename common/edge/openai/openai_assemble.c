// SPDX-License-Identifier: Apache-2.0
// openai response assembler: one choice's text pipeline, shared by the decode
// worker (tokens from its engine) and the router (tokens from a decode worker's
// stream). Token ids come in; logprob entries, token ids and detokenized text
// pass through the stop-string matcher into pending buffers; the finish reason
// and stop_reason are recorded; a stream chunk or the final body's choice is
// built from the pending state. Keeping one copy means a client sees the same
// bytes whether it talks to a decode worker directly or through the router.
#include "openai.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "tokenizer.h"

// ---- buffers ----------------------------------------------------------------------------

static void entry_clear(struct tdm_oai_token_logprob *it)
{
    free((char *)it->token);
    if (it->top) {
        for (int j = 0; j < it->num_top; j++)
            free((char *)it->top[j].token);
        free((void *)it->top);
    }
    memset(it, 0, sizeof *it);
}

static void lps_clear(struct tdm_oai_asm *a)
{
    for (size_t i = 0; i < a->n_lps; i++)
        entry_clear(&a->lps[i]);
    a->n_lps = 0;
}

// A token's own text for logprobs (ids the tokenizer does not know give "").
static char *token_text(const struct tdm_tokenizer *tok, int32_t id, size_t *len)
{
    char *t = NULL;
    if (tdm_tok_decode(tok, &id, 1, false, &t, len) != TDM_OK) {
        t = strdup("");
        *len = 0;
    }
    return t;
}

// One entry: the token's text, its logprob and its alternatives' (top may be
// NULL). On TDM_ENOMEM *it holds nothing.
static int entry_fill(const struct tdm_tokenizer *tok, struct tdm_oai_token_logprob *it, int32_t id,
                      float logprob, const struct tdm_token_logprob *top, int num_top)
{
    memset(it, 0, sizeof *it);
    it->id = id;
    it->logprob = logprob;
    it->token = token_text(tok, id, &it->token_len);
    if (it->token == NULL)
        return TDM_ENOMEM;
    if (num_top > 0 && top != NULL) {
        struct tdm_oai_top_logprob *t = calloc((size_t)num_top, sizeof *t);
        if (t == NULL) {
            entry_clear(it);
            return TDM_ENOMEM;
        }
        it->top = t;
        it->num_top = num_top;
        for (int j = 0; j < num_top; j++) {
            t[j].id = top[j].token;
            t[j].logprob = top[j].logprob;
            t[j].token = token_text(tok, top[j].token, &t[j].token_len);
            if (t[j].token == NULL) {
                entry_clear(it);
                return TDM_ENOMEM;
            }
        }
    }
    return TDM_OK;
}

static int lps_add(struct tdm_oai_asm *a, int32_t id, float logprob,
                   const struct tdm_token_logprob *top, int num_top)
{
    if (tdm_grow(&a->lps, &a->cap_lps, a->n_lps + 1, sizeof *a->lps, 16) != TDM_OK)
        return TDM_ENOMEM;
    if (entry_fill(a->tok, &a->lps[a->n_lps], id, logprob, top, num_top) != TDM_OK)
        return TDM_ENOMEM;
    a->n_lps++;
    return TDM_OK;
}

void tdm_oai_prompt_lp_free(struct tdm_oai_tokenized_prompt *p)
{
    for (size_t i = 0; p->plp && i < p->n; i++)
        entry_clear(&p->plp[i]);
    free(p->plp);
    free(p->plp_rank);
    p->plp = NULL;
    p->plp_rank = NULL;
}

int tdm_oai_prompt_lp_set(struct tdm_oai_tokenized_prompt *p, const struct tdm_prompt_logprobs *pl,
                          const struct tdm_tokenizer *tok)
{
    if (p->plp != NULL || pl == NULL || (size_t)pl->n != p->n || pl->num_top < 0 ||
        pl->num_top > TDM_MAX_LOGPROBS)
        return TDM_OK; // kept the first; one not of this prompt is ignored
    p->plp = calloc(p->n ? p->n : 1, sizeof *p->plp);
    p->plp_rank = calloc(p->n ? p->n : 1, sizeof *p->plp_rank);
    if (p->plp == NULL || p->plp_rank == NULL) {
        tdm_oai_prompt_lp_free(p);
        return TDM_ENOMEM;
    }
    for (size_t i = 0; i < p->n; i++) {
        const struct tdm_token_logprob *top =
            i > 0 && pl->top ? pl->top + i * (size_t)pl->num_top : NULL;
        if (entry_fill(tok, &p->plp[i], p->ids[i], i > 0 ? pl->logprob[i] : 0.0f, top,
                       top ? pl->num_top : 0) != TDM_OK) {
            tdm_oai_prompt_lp_free(p);
            return TDM_ENOMEM;
        }
        p->plp[i].no_logprob = i == 0;
        p->plp_rank[i] = i > 0 ? pl->rank[i] : 0;
    }
    return TDM_OK;
}

// ---- UTF-8 cleaning ------------------------------------------------------------------------
// The same way the response writer cleans text: NUL and each maximal invalid
// subpart become one U+FFFD (Python's decode(errors="replace")). lo/hi bound
// the second byte of a lead byte c.
static void utf8_second_range(unsigned c, unsigned *lo, unsigned *hi)
{
    *lo = c == 0xE0 ? 0xA0 : c == 0xF0 ? 0x90 : 0x80;
    *hi = c == 0xED ? 0x9F : c == 0xF4 ? 0x8F : 0xBF;
}

// Bytes of the character at s when valid (and not NUL), else 0 with *skip the
// bytes one U+FFFD replaces.
static size_t utf8_char_len(const unsigned char *s, size_t n, size_t *skip)
{
    unsigned c = s[0];
    *skip = 1;
    if (c > 0 && c < 0x80)
        return 1;
    size_t need = c >= 0xC2 && c <= 0xDF   ? 2
                  : c >= 0xE0 && c <= 0xEF ? 3
                  : c >= 0xF0 && c <= 0xF4 ? 4
                                           : 0;
    if (need == 0)
        return 0;
    size_t i = 1;
    while (i < need && i < n) {
        unsigned lo = 0x80, hi = 0xBF;
        if (i == 1)
            utf8_second_range(c, &lo, &hi);
        if (s[i] < lo || s[i] > hi)
            break;
        i++;
    }
    if (i == need)
        return need;
    *skip = i;
    return 0;
}

// The detokenizer holds back an incomplete character, so an invalid byte in a
// delta is invalid for good: it becomes U+FFFD here, before the stop matcher,
// so stop strings see the text the client will see (as vLLM's Python str).
// Returns delta itself when it is clean, else the cleaned copy in scratch.
static const char *utf8_clean(const char *delta, size_t len, struct tdm_strbuf *scratch,
                              size_t *out_len)
{
    const unsigned char *u = (const unsigned char *)delta;
    size_t i = 0, skip;
    while (i < len) {
        size_t l = utf8_char_len(u + i, len - i, &skip);
        if (l == 0)
            break;
        i += l;
    }
    *out_len = len;
    if (i == len)
        return delta;
    scratch->len = 0;
    if (tdm_strbuf_add(scratch, delta, i) != TDM_OK)
        return NULL;
    while (i < len) {
        size_t l = utf8_char_len(u + i, len - i, &skip);
        if (tdm_strbuf_add(scratch, l ? delta + i : "\xEF\xBF\xBD", l ? l : 3) != TDM_OK)
            return NULL;
        i += l ? l : skip;
    }
    *out_len = scratch->len;
    return scratch->p;
}

// ---- the pipeline --------------------------------------------------------------------------

// Streamed chat whose output is parsed for tool calls (the non-stream body
// parses the whole text when it is built).
static enum tdm_oai_tool_format stream_tool_format(const struct tdm_oai_request *req)
{
    return req->kind == TDM_OAI_CHAT && req->stream ? tdm_oai_tool_format_of(&req->tools)
                                                    : TDM_OAI_TOOL_FORMAT_NONE;
}

int tdm_oai_asm_init(struct tdm_oai_asm *a, const struct tdm_oai_request *req,
                     const struct tdm_tokenizer *tok, int index, int prompt_idx)
{
    memset(a, 0, sizeof *a);
    a->req = req;
    a->tok = tok;
    a->index = index;
    a->prompt_idx = prompt_idx;
    a->stop_token = -1;
    if (tdm_detok_new(&a->detok, tok, req->skip_special_tokens) != TDM_OK)
        return TDM_ENOMEM;
    if (tdm_oai_stop_new(&a->stop, (const char *const *)req->stop, req->n_stop,
                         req->include_stop_str_in_output) != TDM_OK)
        return TDM_ENOMEM;
    enum tdm_oai_tool_format tf = stream_tool_format(req);
    if (tf != TDM_OAI_TOOL_FORMAT_NONE &&
        tdm_oai_toolparse_new(&a->tools, tf, req->tools.choice_name,
                              req->tools.parallel_tool_calls) != TDM_OK)
        return TDM_ENOMEM;
    return TDM_OK;
}

void tdm_oai_asm_fini(struct tdm_oai_asm *a)
{
    tdm_detok_free(a->detok);
    tdm_oai_stop_free(a->stop);
    tdm_oai_toolparse_free(a->tools);
    tdm_strbuf_fini(&a->text);
    tdm_strbuf_fini(&a->clean);
    lps_clear(a);
    free(a->lps);
    free(a->ids);
    memset(a, 0, sizeof *a);
}

void tdm_oai_asm_reset_finish(struct tdm_oai_asm *a)
{
    a->done = false;
    a->finish = TDM_FINISH_NONE;
    a->error = 0;
    a->message[0] = '\0';
}

// Generated text (past the stop matcher) into the pending text; with a tool
// parser, through it: the pending text is its content, its deltas wait in it.
static int add_generated(struct tdm_oai_asm *a, const char *s, size_t n, bool end)
{
    if (a->tools == NULL)
        return n > 0 ? tdm_strbuf_add(&a->text, s, n) : TDM_OK;
    if (tdm_oai_toolparse_feed(a->tools, s, n) != TDM_OK ||
        (end && tdm_oai_toolparse_finish(a->tools) != TDM_OK))
        return TDM_ENOMEM;
    size_t cl = 0;
    const char *c = tdm_oai_toolparse_content(a->tools, &cl);
    if (cl > 0 && tdm_strbuf_add(&a->text, c, cl) != TDM_OK)
        return TDM_ENOMEM;
    tdm_oai_toolparse_clear_content(a->tools);
    return TDM_OK;
}

// Runs detokenized text through the stop matcher into the pending text.
static int feed_text(struct tdm_oai_asm *a, const char *delta, size_t len, bool *stopped)
{
    delta = utf8_clean(delta, len, &a->clean, &len);
    if (delta == NULL)
        return TDM_ENOMEM;
    const char *emit = NULL;
    size_t emit_len = 0;
    // vLLM looks for stop strings only once more than min_tokens tokens exist.
    bool may_match = a->completion_tokens > a->req->sampling.min_tokens;
    int idx = tdm_oai_stop_feed_ex(a->stop, delta, len, may_match, &emit, &emit_len);
    if (idx == -2)
        return TDM_ENOMEM;
    if (add_generated(a, emit, emit_len, idx >= 0) != TDM_OK)
        return TDM_ENOMEM;
    if (idx >= 0) {
        // A stop string completed: the choice ends here; the caller stops the
        // generator (counted as finish_reason "stop").
        a->done = true;
        a->finish = TDM_FINISH_STOP;
        a->stop_str = a->req->stop[idx];
        a->stop_token = -1;
        *stopped = true;
    }
    return TDM_OK;
}

int tdm_oai_asm_token(struct tdm_oai_asm *a, int32_t id, float logprob,
                      const struct tdm_token_logprob *top, int num_top, bool ended_by_it,
                      bool *stopped)
{
    const struct tdm_oai_request *rq = a->req;
    if (a->done)
        return TDM_OK;
    a->completion_tokens++;
    if (rq->echo_prompt_only)
        return TDM_OK; // generated for the prompt's logprobs only
    if (rq->logprobs && lps_add(a, id, logprob, top, num_top) != TDM_OK)
        return TDM_ENOMEM;
    if (rq->return_token_ids) {
        if (tdm_grow(&a->ids, &a->cap_ids, a->n_ids + 1, sizeof *a->ids, 64) != TDM_OK)
            return TDM_ENOMEM;
        a->ids[a->n_ids++] = id;
    }
    // The EOS/stop token that ended the request adds no text (vLLM), unless
    // the caller asked for stop strings in the output.
    if (ended_by_it && !rq->include_stop_str_in_output)
        return TDM_OK;
    const char *delta = NULL;
    size_t dlen = 0;
    // Ids beyond the tokenizer (a model vocab padded past it) decode to nothing.
    if (tdm_detok_push(a->detok, id, &delta, &dlen) != TDM_OK)
        dlen = 0;
    if (dlen > 0 && feed_text(a, delta, dlen, stopped) != TDM_OK)
        return TDM_ENOMEM;
    return TDM_OK;
}

int tdm_oai_asm_finish(struct tdm_oai_asm *a, enum tdm_finish finish, int32_t stop_token,
                       int error, const char *message, bool *stopped)
{
    if (a->done)
        return TDM_OK;
    const char *delta = NULL;
    size_t dlen = 0;
    if (tdm_detok_flush(a->detok, &delta, &dlen) == TDM_OK && dlen > 0 &&
        feed_text(a, delta, dlen, stopped) != TDM_OK)
        return TDM_ENOMEM;
    if (a->done)
        return TDM_OK;
    const char *emit = NULL;
    size_t elen = 0;
    tdm_oai_stop_flush(a->stop, &emit, &elen);
    if (add_generated(a, emit, elen, true) != TDM_OK)
        return TDM_ENOMEM;
    a->done = true;
    a->finish = finish;
    a->stop_token = stop_token;
    if (finish == TDM_FINISH_ERROR) {
        a->error = error;
        snprintf(a->message, sizeof a->message, "%s",
                 message && *message ? message : tdm_strerror(error));
    }
    return TDM_OK;
}

void tdm_oai_asm_fail(struct tdm_oai_asm *a, int error, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(a->message, sizeof a->message, fmt, ap);
    va_end(ap);
    a->done = true;
    a->finish = TDM_FINISH_ERROR;
    a->error = error;
}

int tdm_oai_asm_add_text(struct tdm_oai_asm *a, const char *text, size_t len)
{
    return tdm_strbuf_add(&a->text, text ? text : "", text ? len : 0);
}

// ---- output ---------------------------------------------------------------------------------

void tdm_oai_asm_choice(const struct tdm_oai_asm *a, bool with_finish, const int32_t *prompt_ids,
                        size_t n_prompt_ids, struct tdm_oai_choice *oc)
{
    memset(oc, 0, sizeof *oc);
    oc->index = a->index;
    oc->text = a->text.p ? a->text.p : "";
    oc->text_len = a->text.len;
    oc->finish = with_finish ? a->finish : TDM_FINISH_NONE;
    oc->stop_str = with_finish ? a->stop_str : NULL;
    oc->stop_token = with_finish ? a->stop_token : -1;
    if (a->tools) {
        oc->tool_deltas = tdm_oai_toolparse_deltas(a->tools, &oc->n_tool_deltas);
        oc->content_null = a->text.len == 0 && oc->n_tool_deltas > 0;
        oc->finish_tool_calls = with_finish && a->req->tools.choice == TDM_OAI_TOOL_CHOICE_AUTO &&
                                tdm_oai_toolparse_calls(a->tools) > 0;
    }
    oc->has_logprobs = a->req->logprobs;
    oc->tokens_as_ids = a->req->return_tokens_as_token_ids;
    oc->logprobs = a->lps;
    oc->n_logprobs = a->n_lps;
    oc->text_offset = a->chars_sent;
    if (a->req->return_token_ids) {
        static const int32_t none[1] = {0}; // [] in the chunk, not an omitted field
        oc->token_ids = a->ids ? a->ids : none;
        oc->n_token_ids = a->n_ids;
        if (!a->first_sent) {
            oc->prompt_token_ids = prompt_ids;
            oc->n_prompt_token_ids = n_prompt_ids;
        }
    }
}

int tdm_oai_asm_body_choice(const struct tdm_oai_asm *a, bool echo, const char *prompt_text,
                            size_t prompt_text_len, const int32_t *prompt_ids,
                            size_t n_prompt_ids, struct tdm_strbuf *joined,
                            struct tdm_oai_choice *oc)
{
    tdm_oai_asm_choice(a, true, prompt_ids, n_prompt_ids, oc);
    if (!echo)
        return TDM_OK;
    // Echo: the prompt text, then the completion; offsets start after it.
    int rc = tdm_strbuf_add(joined, prompt_text ? prompt_text : "", prompt_text ? prompt_text_len : 0);
    if (rc == TDM_OK)
        rc = tdm_strbuf_add(joined, a->text.p ? a->text.p : "", a->text.len);
    oc->text = joined->p ? joined->p : "";
    oc->text_len = joined->len;
    oc->text_offset = tdm_oai_utf8_chars(prompt_text ? prompt_text : "",
                                         prompt_text ? prompt_text_len : 0);
    return rc;
}

void tdm_oai_prompt_lp_choice(const struct tdm_oai_request *rq,
                              const struct tdm_oai_tokenized_prompt *p, bool echo,
                              struct tdm_oai_choice *oc)
{
    if (p->plp == NULL)
        return;
    if (echo && rq->logprobs) {
        oc->echo_logprobs = p->plp;
        oc->n_echo_logprobs = p->n;
        oc->echo_top = rq->top_logprobs;
    }
    if (rq->prompt_logprobs >= 0) {
        oc->prompt_logprobs = p->plp;
        oc->prompt_ranks = p->plp_rank;
        oc->n_prompt_logprobs = p->n;
        oc->prompt_top = rq->prompt_logprobs;
    }
}

char *tdm_oai_asm_body(const struct tdm_oai_response *r, bool echo,
                       const struct tdm_oai_asm *const *choices, size_t n,
                       const struct tdm_oai_tokenized_prompt *prompts,
                       const struct tdm_oai_usage *usage)
{
    struct tdm_oai_choice *oc = calloc(n ? n : 1, sizeof *oc);
    struct tdm_strbuf *joined = calloc(n ? n : 1, sizeof *joined);
    // Chat with tool parsing: each choice's calls and content (vLLM's
    // extract_tool_calls over the whole text).
    struct tdm_oai_tool_call **calls = calloc(n ? n : 1, sizeof *calls);
    size_t *n_calls = calloc(n ? n : 1, sizeof *n_calls);
    char **content = calloc(n ? n : 1, sizeof *content);
    char *body = NULL;
    if (oc == NULL || joined == NULL || calls == NULL || n_calls == NULL || content == NULL)
        goto out;
    bool oom = false;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_oai_tokenized_prompt *p = &prompts[choices[i]->prompt_idx];
        const struct tdm_oai_request *rq = choices[i]->req;
        bool echo_prompt = echo && rq->kind == TDM_OAI_COMPLETION; // chat's: below
        if (tdm_oai_asm_body_choice(choices[i], echo_prompt, p->text, p->text_len, p->ids, p->n,
                                    &joined[i], &oc[i]) != TDM_OK)
            oom = true;
        tdm_oai_prompt_lp_choice(rq, p, echo_prompt, &oc[i]);
        enum tdm_oai_tool_format tf = rq->kind == TDM_OAI_CHAT
                                          ? tdm_oai_tool_format_of(&rq->tools)
                                          : TDM_OAI_TOOL_FORMAT_NONE;
        if (tf == TDM_OAI_TOOL_FORMAT_NONE || choices[i]->finish == TDM_FINISH_ERROR)
            continue;
        if (tdm_oai_tools_extract(tf, rq->tools.choice_name, rq->tools.parallel_tool_calls,
                                  oc[i].text, oc[i].text_len, &calls[i], &n_calls[i],
                                  &content[i]) != TDM_OK) {
            oom = true;
            continue;
        }
        oc[i].tool_calls = calls[i];
        oc[i].n_tool_calls = n_calls[i];
        oc[i].text = content[i] ? content[i] : "";
        oc[i].text_len = content[i] ? strlen(content[i]) : 0;
        oc[i].content_null = content[i] == NULL;
        oc[i].finish_tool_calls = rq->tools.choice == TDM_OAI_TOOL_CHOICE_AUTO && n_calls[i] > 0;
    }
    // vLLM's chat echo: the final message's content before the answer's
    // content (after tool parsing; tdm_oai_chat_echo).
    for (size_t i = 0; echo && i < n; i++) {
        const struct tdm_oai_tokenized_prompt *p = &prompts[choices[i]->prompt_idx];
        if (choices[i]->req->kind != TDM_OAI_CHAT || p->text == NULL || p->text_len == 0)
            continue;
        tdm_strbuf_fini(&joined[i]);
        const char *t = oc[i].text ? oc[i].text : "";
        if (tdm_strbuf_add(&joined[i], p->text, p->text_len) != TDM_OK ||
            tdm_strbuf_add(&joined[i], t, oc[i].content_null ? 0 : oc[i].text_len) != TDM_OK)
            oom = true;
        oc[i].text = joined[i].p ? joined[i].p : "";
        oc[i].text_len = joined[i].len;
        oc[i].content_null = false;
    }
    if (!oom)
        body = tdm_oai_body(r, oc, n, usage);
out:
    for (size_t i = 0; joined && i < n; i++)
        tdm_strbuf_fini(&joined[i]);
    for (size_t i = 0; calls && n_calls && i < n; i++)
        tdm_oai_tool_calls_free(calls[i], n_calls[i]);
    for (size_t i = 0; content && i < n; i++)
        free(content[i]);
    free(content);
    free(n_calls);
    free(calls);
    free(joined);
    free(oc);
    return body;
}

int tdm_oai_asm_stream_chunk(const struct tdm_oai_asm *a, const struct tdm_oai_response *r,
                             const int32_t *prompt_ids, size_t n_prompt_ids,
                             const struct tdm_oai_usage *usage, char **json, bool *finish_now)
{
    *json = NULL;
    *finish_now = a->done && !a->reported;
    size_t n_deltas = 0;
    if (a->tools)
        tdm_oai_toolparse_deltas(a->tools, &n_deltas);
    if (a->text.len == 0 && n_deltas == 0 && !*finish_now)
        return TDM_OK;
    if (*finish_now && a->finish == TDM_FINISH_ERROR) {
        if (a->text.len == 0 && n_deltas == 0)
            return TDM_OK; // reported as an error event by the caller
        // The text of the tokens that came before the error goes out first,
        // without a finish (it arrived with the error, or in the same pump).
        *finish_now = false;
    }
    struct tdm_oai_choice oc;
    tdm_oai_asm_choice(a, *finish_now, prompt_ids, n_prompt_ids, &oc);
    *json = tdm_oai_chunk(r, &oc, 1, usage);
    return *json ? TDM_OK : TDM_ENOMEM;
}

void tdm_oai_asm_sent(struct tdm_oai_asm *a, bool finish_now)
{
    a->chars_sent += tdm_oai_utf8_chars(a->text.p ? a->text.p : "", a->text.len);
    a->tokens_sent = a->completion_tokens;
    a->text.len = 0;
    lps_clear(a);
    a->n_ids = 0;
    if (a->tools)
        tdm_oai_toolparse_clear(a->tools);
    a->first_sent = true;
    if (finish_now)
        a->reported = true;
}

bool tdm_oai_is_stop_id(const struct tdm_sampling_params *sp, int32_t tok_eos,
                        const struct tdm_generation_config *gen, int32_t id)
{
    for (int i = 0; i < sp->num_stop_token_ids; i++)
        if (sp->stop_token_ids[i] == id)
            return true;
    if (id == tok_eos)
        return false;
    for (int i = 0; gen && i < gen->num_eos_token_ids; i++)
        if (gen->eos_token_ids[i] == id)
            return true;
    return false;
}
