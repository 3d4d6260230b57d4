// SPDX-License-Identifier: Apache-2.0
// openai responses: builds the JSON bodies vLLM sends (completions and chat,
// non-stream and stream chunks, usage chunk, logprobs in both formats,
// /v1/models, /tokenize, /detokenize, /version). Field order follows vLLM's
// pydantic models so byte-level diffs against vLLM stay readable. Text that may
// hold invalid UTF-8 (token pieces split inside a character) is repaired with
// U+FFFD before it enters a JSON string, as Python's decode(errors="replace").
#include "openai.h"
#include "openai_impl.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"

// vLLM writes logprobs below this (-inf after filtering) as -9999.0.
#define LOGPROB_FLOOR -9999.0

void tdm_oai_response_init(struct tdm_oai_response *r, enum tdm_oai_kind kind, const char *model,
                           const char *base_id)
{
    memset(r, 0, sizeof *r);
    r->kind = kind;
    r->model = model ? model : "";
    r->created = (int64_t)time(NULL);
    char hex[TDM_OAI_ID_HEX + 1];
    if (!base_id || !*base_id) {
        tdm_oai_random_hex(hex);
        base_id = hex;
    }
    snprintf(r->id, sizeof r->id, "%s%.80s", kind == TDM_OAI_CHAT ? "chatcmpl-" : "cmpl-", base_id);
}

// ---- small cJSON helpers (each returns false on ENOMEM) --------------------------------------
static bool add_text(cJSON *obj, const char *name, const char *s, size_t len)
{
    char *fixed = tdm_oai_utf8_dup(s ? s : "", s ? len : 0);
    if (!fixed)
        return false;
    bool ok = cJSON_AddStringToObject(obj, name, fixed) != NULL;
    free(fixed);
    return ok;
}

static bool add_logprob(cJSON *obj, const char *name, float lp)
{
    double v = isnan(lp) || lp < LOGPROB_FLOOR ? LOGPROB_FLOOR : (double)lp;
    return cJSON_AddNumberToObject(obj, name, v) != NULL;
}

static bool add_ids(cJSON *obj, const char *name, const int32_t *ids, size_t n)
{
    cJSON *arr = cJSON_AddArrayToObject(obj, name);
    if (!arr)
        return false;
    for (size_t i = 0; i < n; i++) {
        cJSON *num = cJSON_CreateNumber(ids[i]);
        if (!num || !cJSON_AddItemToArray(arr, num)) {
            cJSON_Delete(num);
            return false;
        }
    }
    return true;
}

static bool add_head(cJSON *root, const struct tdm_oai_response *r, const char *object)
{
    return cJSON_AddStringToObject(root, "id", r->id) &&
           cJSON_AddStringToObject(root, "object", object) &&
           cJSON_AddNumberToObject(root, "created", (double)r->created) &&
           cJSON_AddStringToObject(root, "model", r->model);
}

// Non-stream bodies carry vLLM's always-serialized nulls (prompt_tokens_details);
// stream chunks, serialized "exclude unset", do not.
static bool add_usage(cJSON *root, const struct tdm_oai_usage *u, bool full)
{
    cJSON *usage = cJSON_AddObjectToObject(root, "usage");
    return usage && cJSON_AddNumberToObject(usage, "prompt_tokens", u->prompt_tokens) &&
           cJSON_AddNumberToObject(usage, "total_tokens",
                                   (double)u->prompt_tokens + (double)u->completion_tokens) &&
           cJSON_AddNumberToObject(usage, "completion_tokens", u->completion_tokens) &&
           (!full || cJSON_AddNullToObject(usage, "prompt_tokens_details"));
}

static bool add_stop_reason(cJSON *obj, const struct tdm_oai_choice *c)
{
    if (c->stop_str)
        return add_text(obj, "stop_reason", c->stop_str, strlen(c->stop_str));
    if (c->stop_token >= 0)
        return cJSON_AddNumberToObject(obj, "stop_reason", c->stop_token) != NULL;
    return cJSON_AddNullToObject(obj, "stop_reason") != NULL;
}

static bool add_finish(cJSON *obj, enum tdm_finish f)
{
    const char *name = tdm_finish_name(f);
    return name ? cJSON_AddStringToObject(obj, "finish_reason", name) != NULL
                : cJSON_AddNullToObject(obj, "finish_reason") != NULL;
}

// ---- logprobs ----------------------------------------------------------------------------------
// A token as the logprobs show it: its text (invalid UTF-8 repaired), or with
// return_tokens_as_token_ids vLLM's "token_id:<id>", which names tokens whose
// text is not valid UTF-8 on its own. Heap; NULL when out of memory.
static char *token_shown(const struct tdm_oai_choice *c, int32_t id, const char *text, size_t len)
{
    if (c->tokens_as_ids) {
        char *s = malloc(24);
        if (s)
            snprintf(s, 24, "token_id:%d", (int)id);
        return s;
    }
    return tdm_oai_utf8_dup(text ? text : "", text ? len : 0);
}

// Completions format: {"text_offset":[..],"token_logprobs":[..],"tokens":[..],
// "top_logprobs":[{token: logprob, ...}, ..]}. Offsets count code points, as
// Python's len() of the token strings vLLM accumulates.
static bool add_completion_logprobs(cJSON *obj, const struct tdm_oai_choice *c)
{
    cJSON *lp = cJSON_AddObjectToObject(obj, "logprobs");
    if (!lp)
        return false;
    cJSON *offsets = cJSON_AddArrayToObject(lp, "text_offset");
    cJSON *token_lps = cJSON_AddArrayToObject(lp, "token_logprobs");
    cJSON *tokens = cJSON_AddArrayToObject(lp, "tokens");
    cJSON *tops = cJSON_AddArrayToObject(lp, "top_logprobs");
    if (!offsets || !token_lps || !tokens || !tops)
        return false;
    // With echo the prompt's entries come first and the offsets run from 0
    // through both (vLLM's single list of prompt and output tokens).
    size_t offset = c->n_echo_logprobs > 0 ? 0 : c->text_offset;
    for (size_t i = 0; i < c->n_echo_logprobs + c->n_logprobs; i++) {
        bool echoed = i < c->n_echo_logprobs;
        const struct tdm_oai_token_logprob *t =
            echoed ? &c->echo_logprobs[i] : &c->logprobs[i - c->n_echo_logprobs];
        int num_top = echoed && t->num_top > c->echo_top ? c->echo_top : t->num_top;
        char *tok = token_shown(c, t->id, t->token, t->token_len);
        if (!tok)
            return false;
        double v = isnan(t->logprob) || t->logprob < LOGPROB_FLOOR ? LOGPROB_FLOOR : t->logprob;
        cJSON *o = cJSON_CreateNumber((double)offset);
        cJSON *l = t->no_logprob ? cJSON_CreateNull() : cJSON_CreateNumber(v);
        cJSON *s = cJSON_CreateString(tok);
        cJSON *top = t->no_logprob ? cJSON_CreateNull() : cJSON_CreateObject();
        bool ok = o && l && s && top;
        if (ok) {
            cJSON_AddItemToArray(offsets, o);
            cJSON_AddItemToArray(token_lps, l);
            cJSON_AddItemToArray(tokens, s);
            cJSON_AddItemToArray(tops, top);
        } else {
            cJSON_Delete(o);
            cJSON_Delete(l);
            cJSON_Delete(s);
            cJSON_Delete(top);
        }
        // The top dict holds the alternatives and the sampled token; pieces that
        // decode to the same text share a key (a Python dict keeps one).
        for (int k = 0; ok && !t->no_logprob && k <= num_top; k++) {
            const char *piece = k < num_top ? t->top[k].token : t->token;
            size_t plen = k < num_top ? t->top[k].token_len : t->token_len;
            float plp = k < num_top ? t->top[k].logprob : t->logprob;
            char *key = token_shown(c, k < num_top ? t->top[k].id : t->id, piece, plen);
            if (!key) {
                ok = false;
                break;
            }
            bool seen = cJSON_GetObjectItemCaseSensitive(top, key) != NULL;
            if (!(k == num_top && seen)) {
                double pv = isnan(plp) || plp < LOGPROB_FLOOR ? LOGPROB_FLOOR : plp;
                cJSON *num = cJSON_CreateNumber(pv);
                if (!num)
                    ok = false;
                else if (seen)
                    cJSON_ReplaceItemInObjectCaseSensitive(top, key, num);
                else
                    cJSON_AddItemToObject(top, key, num);
            }
            free(key);
        }
        offset += tdm_oai_utf8_chars(tok, strlen(tok));
        free(tok);
        if (!ok)
            return false;
    }
    return true;
}

// Chat format: {"content":[{"token","logprob","bytes":[..],"top_logprobs":[{"token",
// "logprob","bytes"}]}]}; bytes are the UTF-8 of the (repaired) token text.
static bool add_chat_token(cJSON *obj, const struct tdm_oai_choice *c, int32_t id,
                           const char *token, size_t len, float lp)
{
    char *tok = token_shown(c, id, token, len);
    if (!tok)
        return false;
    bool ok = cJSON_AddStringToObject(obj, "token", tok) && add_logprob(obj, "logprob", lp);
    cJSON *bytes = ok ? cJSON_AddArrayToObject(obj, "bytes") : NULL;
    ok = ok && bytes;
    for (const unsigned char *p = (const unsigned char *)tok; ok && *p; p++) {
        cJSON *b = cJSON_CreateNumber(*p);
        ok = b && cJSON_AddItemToArray(bytes, b);
    }
    free(tok);
    return ok;
}

static bool add_chat_logprobs(cJSON *obj, const struct tdm_oai_choice *c)
{
    cJSON *lp = cJSON_AddObjectToObject(obj, "logprobs");
    cJSON *content = lp ? cJSON_AddArrayToObject(lp, "content") : NULL;
    if (!content)
        return false;
    for (size_t i = 0; i < c->n_logprobs; i++) {
        const struct tdm_oai_token_logprob *t = &c->logprobs[i];
        cJSON *entry = cJSON_CreateObject();
        if (!entry || !cJSON_AddItemToArray(content, entry)) {
            cJSON_Delete(entry);
            return false;
        }
        if (!add_chat_token(entry, c, t->id, t->token, t->token_len, t->logprob))
            return false;
        cJSON *tops = cJSON_AddArrayToObject(entry, "top_logprobs");
        if (!tops)
            return false;
        for (int k = 0; k < t->num_top; k++) {
            // Each token once: with logprob_token_ids the chosen token leads
            // the list and may be one of the ids too (vLLM lists it once).
            int j = 0;
            while (j < k && t->top[j].id != t->top[k].id)
                j++;
            if (j < k)
                continue;
            cJSON *alt = cJSON_CreateObject();
            if (!alt || !cJSON_AddItemToArray(tops, alt)) {
                cJSON_Delete(alt);
                return false;
            }
            if (!add_chat_token(alt, c, t->top[k].id, t->top[k].token, t->top[k].token_len,
                                t->top[k].logprob))
                return false;
        }
    }
    return true;
}

// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"},
// ...}, ...]: per prompt token after the first, the token itself, then its
// top alternatives (ranks 1..N; the token is not repeated among them).
static bool add_prompt_logprob(cJSON *dict, int32_t id, float lp, int rank, const char *text,
                               size_t len)
{
    char key[16];
    snprintf(key, sizeof key, "%d", (int)id);
    if (cJSON_GetObjectItemCaseSensitive(dict, key) != NULL)
        return true;
    cJSON *o = cJSON_AddObjectToObject(dict, key);
    return o && add_logprob(o, "logprob", lp) && cJSON_AddNumberToObject(o, "rank", rank) &&
           add_text(o, "decoded_token", text, len);
}

static bool add_prompt_logprobs(cJSON *obj, const struct tdm_oai_choice *c)
{
    cJSON *arr = cJSON_AddArrayToObject(obj, "prompt_logprobs");
    if (!arr)
        return false;
    for (size_t i = 0; i < c->n_prompt_logprobs; i++) {
        const struct tdm_oai_token_logprob *t = &c->prompt_logprobs[i];
        cJSON *dict = t->no_logprob ? cJSON_CreateNull() : cJSON_CreateObject();
        if (!dict || !cJSON_AddItemToArray(arr, dict)) {
            cJSON_Delete(dict);
            return false;
        }
        if (t->no_logprob)
            continue;
        if (!add_prompt_logprob(dict, t->id, t->logprob, c->prompt_ranks[i], t->token,
                                t->token_len))
            return false;
        int num_top = t->num_top < c->prompt_top ? t->num_top : c->prompt_top;
        for (int k = 0; k < num_top; k++)
            if (!add_prompt_logprob(dict, t->top[k].id, t->top[k].logprob, k + 1, t->top[k].token,
                                    t->top[k].token_len))
                return false;
    }
    return true;
}

static bool add_logprobs(cJSON *obj, enum tdm_oai_kind kind, const struct tdm_oai_choice *c)
{
    if (!c->has_logprobs)
        return cJSON_AddNullToObject(obj, "logprobs") != NULL;
    return kind == TDM_OAI_CHAT ? add_chat_logprobs(obj, c) : add_completion_logprobs(obj, c);
}

// ---- tool calls --------------------------------------------------------------------------------
// message.tool_calls: [{"id","type":"function","function":{"name","arguments"}}].
static bool add_tool_calls(cJSON *msg, const struct tdm_oai_choice *c)
{
    cJSON *arr = cJSON_AddArrayToObject(msg, "tool_calls");
    if (!arr)
        return false;
    for (size_t i = 0; i < c->n_tool_calls; i++) {
        const struct tdm_oai_tool_call *t = &c->tool_calls[i];
        cJSON *o = cJSON_CreateObject(), *fn = NULL;
        if (!o || !cJSON_AddItemToArray(arr, o)) {
            cJSON_Delete(o);
            return false;
        }
        if (!cJSON_AddStringToObject(o, "id", t->id) ||
            !cJSON_AddStringToObject(o, "type", "function") ||
            !(fn = cJSON_AddObjectToObject(o, "function")) ||
            !add_text(fn, "name", t->name, strlen(t->name)) ||
            !add_text(fn, "arguments", t->arguments, strlen(t->arguments)))
            return false;
    }
    return true;
}

// delta.tool_calls: [{"index","id","type","function":{"name","arguments"}}] for a
// call's first entry, [{"index","function":{"arguments"}}] after it.
static bool add_tool_deltas(cJSON *delta, const struct tdm_oai_choice *c)
{
    cJSON *arr = cJSON_AddArrayToObject(delta, "tool_calls");
    if (!arr)
        return false;
    for (size_t i = 0; i < c->n_tool_deltas; i++) {
        const struct tdm_oai_tool_delta *t = &c->tool_deltas[i];
        cJSON *o = cJSON_CreateObject(), *fn = NULL;
        if (!o || !cJSON_AddItemToArray(arr, o)) {
            cJSON_Delete(o);
            return false;
        }
        if (!cJSON_AddNumberToObject(o, "index", t->index))
            return false;
        if (t->header &&
            (!cJSON_AddStringToObject(o, "id", t->id) ||
             !cJSON_AddStringToObject(o, "type", "function")))
            return false;
        if (!(fn = cJSON_AddObjectToObject(o, "function")))
            return false;
        if (t->header && !add_text(fn, "name", t->name, strlen(t->name)))
            return false;
        if (!add_text(fn, "arguments", t->args, t->args_len))
            return false;
    }
    return true;
}

// ---- bodies and chunks
// ---------------------------------------------------------------------------
static bool add_choice(cJSON *choices, enum tdm_oai_kind kind, const char *role, bool stream,
                       const struct tdm_oai_choice *c)
{
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddItemToArray(choices, o)) {
        cJSON_Delete(o);
        return false;
    }
    if (!cJSON_AddNumberToObject(o, "index", c->index))
        return false;
    if (kind == TDM_OAI_COMPLETION) {
        if (!add_text(o, "text", c->text, c->text_len))
            return false;
    } else {
        cJSON *msg = cJSON_AddObjectToObject(o, stream ? "delta" : "message");
        if (!msg)
            return false;
        if (!stream && !cJSON_AddStringToObject(msg, "role", role ? role : "assistant"))
            return false;
        if (c->content_null) {
            // Only tool calls: null in a message, no "content" in a delta.
            if (!stream && !cJSON_AddNullToObject(msg, "content"))
                return false;
        } else if (!add_text(msg, "content", c->text, c->text_len)) {
            return false;
        }
        if (!stream && !add_tool_calls(msg, c))
            return false;
        if (stream && c->n_tool_deltas > 0 && !add_tool_deltas(msg, c))
            return false;
    }
    if (!add_logprobs(o, kind, c))
        return false;
    bool finish_ok = c->finish_tool_calls && c->finish != TDM_FINISH_NONE
                         ? cJSON_AddStringToObject(o, "finish_reason", "tool_calls") != NULL
                         : add_finish(o, c->finish);
    if (!finish_ok || !add_stop_reason(o, c))
        return false;
    if (c->token_ids && !add_ids(o, "token_ids", c->token_ids, c->n_token_ids))
        return false;
    if (kind == TDM_OAI_COMPLETION && c->prompt_logprobs && !add_prompt_logprobs(o, c))
        return false;
    if (c->prompt_token_ids &&
        !add_ids(o, "prompt_token_ids", c->prompt_token_ids, c->n_prompt_token_ids))
        return false;
    return true;
}

static char *build(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices, size_t n,
                   const struct tdm_oai_usage *usage, bool stream)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    char *out = NULL;
    const char *object = r->kind == TDM_OAI_CHAT
                             ? (stream ? "chat.completion.chunk" : "chat.completion")
                             : "text_completion";
    if (!add_head(root, r, object))
        goto done;
    cJSON *arr = cJSON_AddArrayToObject(root, "choices");
    if (!arr)
        goto done;
    for (size_t i = 0; i < n; i++)
        if (!add_choice(arr, r->kind, r->role, stream, &choices[i]))
            goto done;
    if (usage && !add_usage(root, usage, !stream))
        goto done;
    if (!stream && !cJSON_AddNullToObject(root, "system_fingerprint"))
        goto done;
    // Chat: vLLM's prompt_logprobs belong to the response (its one prompt),
    // from the first choice that has them.
    for (size_t i = 0; r->kind == TDM_OAI_CHAT && !stream && i < n; i++) {
        if (choices[i].prompt_logprobs) {
            if (!add_prompt_logprobs(root, &choices[i]))
                goto done;
            break;
        }
    }
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

char *tdm_oai_body(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices, size_t n,
                   const struct tdm_oai_usage *usage)
{
    struct tdm_oai_usage zero = {0, 0};
    return build(r, choices, n, usage ? usage : &zero, false);
}

char *tdm_oai_chunk_tree(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices,
                         size_t n, const struct tdm_oai_usage *usage)
{
    return build(r, choices, n, usage, true);
}

// ---- stream chunks written directly --------------------------------------------------------
// Every streamed token goes through a chunk, and a cJSON tree per chunk was
// ~15 allocations plus the print (7% of the router's CPU at 10 streams). The
// common chunk (choices with text or content only: no logprobs, token ids or
// tool deltas) is written straight into one buffer, byte for byte what build()
// prints (openai_test compares the two over random chunks); any other goes
// through build().

// Direct writers (stream chunks, /tokenize): the bytes cJSON_PrintUnformatted
// would print. Pieces are appended unchecked: the buffer fails for good on an
// allocation failure, checked once at the end (b->failed).
static void out_int(struct tdm_strbuf *b, long long v)
{
    char num[24];
    int n = snprintf(num, sizeof num, "%lld", v);
    tdm_strbuf_add(b, num, (size_t)n);
}

// Text that may hold invalid UTF-8, repaired as add_text repairs it.
static void out_text(struct tdm_strbuf *b, const char *s, size_t len)
{
    char *fixed = tdm_oai_utf8_dup(s ? s : "", s ? len : 0);
    if (fixed == NULL) {
        b->failed = true;
        return;
    }
    tdm_strbuf_add_json_string(b, fixed, strlen(fixed), false);
    free(fixed);
}

#define OUT_LIT(b, lit) tdm_strbuf_add(b, lit, sizeof lit - 1)

static bool chunk_is_plain(const struct tdm_oai_choice *c)
{
    return !c->has_logprobs && !c->token_ids && !c->prompt_token_ids && c->n_tool_deltas == 0 &&
           !c->prompt_logprobs && !c->content_null;
}

// cJSON prints a number whose value fits an int with %d and others with
// %1.15g, which for the integers here (timestamps, token counts) gives the
// digits %lld gives.
static char *chunk_direct(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices,
                          size_t n, const struct tdm_oai_usage *usage)
{
    bool chat = r->kind == TDM_OAI_CHAT;
    struct tdm_strbuf b = {0};
    // One allocation for the usual chunk (escapes may need one more).
    size_t guess = 256 + strlen(r->id) + strlen(r->model);
    for (size_t i = 0; i < n; i++)
        guess += 128 + choices[i].text_len + (choices[i].stop_str ? strlen(choices[i].stop_str) : 0);
    tdm_strbuf_reserve(&b, guess);
    OUT_LIT(&b, "{\"id\":");
    tdm_strbuf_add_json_string(&b, r->id, strlen(r->id), false);
    if (chat)
        OUT_LIT(&b, ",\"object\":\"chat.completion.chunk\",\"created\":");
    else
        OUT_LIT(&b, ",\"object\":\"text_completion\",\"created\":");
    out_int(&b, (long long)r->created);
    OUT_LIT(&b, ",\"model\":");
    tdm_strbuf_add_json_string(&b, r->model, strlen(r->model), false);
    OUT_LIT(&b, ",\"choices\":[");
    for (size_t i = 0; i < n; i++) {
        const struct tdm_oai_choice *c = &choices[i];
        if (i)
            OUT_LIT(&b, ",");
        OUT_LIT(&b, "{\"index\":");
        out_int(&b, c->index);
        if (chat)
            OUT_LIT(&b, ",\"delta\":{\"content\":");
        else
            OUT_LIT(&b, ",\"text\":");
        out_text(&b, c->text, c->text_len);
        if (chat)
            OUT_LIT(&b, "}");
        OUT_LIT(&b, ",\"logprobs\":null,\"finish_reason\":");
        const char *fin = c->finish_tool_calls && c->finish != TDM_FINISH_NONE
                              ? "tool_calls"
                              : tdm_finish_name(c->finish);
        if (fin)
            tdm_strbuf_add_json_string(&b, fin, strlen(fin), false);
        else
            OUT_LIT(&b, "null");
        OUT_LIT(&b, ",\"stop_reason\":");
        if (c->stop_str)
            out_text(&b, c->stop_str, strlen(c->stop_str));
        else if (c->stop_token >= 0)
            out_int(&b, c->stop_token);
        else
            OUT_LIT(&b, "null");
        OUT_LIT(&b, "}");
    }
    OUT_LIT(&b, "]");
    if (usage) {
        OUT_LIT(&b, ",\"usage\":{\"prompt_tokens\":");
        out_int(&b, usage->prompt_tokens);
        OUT_LIT(&b, ",\"total_tokens\":");
        out_int(&b, (long long)usage->prompt_tokens + usage->completion_tokens);
        OUT_LIT(&b, ",\"completion_tokens\":");
        out_int(&b, usage->completion_tokens);
        OUT_LIT(&b, "}");
    }
    OUT_LIT(&b, "}");
    if (b.failed) {
        tdm_strbuf_fini(&b);
        return NULL;
    }
    return b.p;
}

char *tdm_oai_chunk(const struct tdm_oai_response *r, const struct tdm_oai_choice *choices,
                    size_t n, const struct tdm_oai_usage *usage)
{
    for (size_t i = 0; i < n; i++)
        if (!chunk_is_plain(&choices[i]))
            return build(r, choices, n, usage, true);
    return chunk_direct(r, choices, n, usage);
}

char *tdm_oai_chat_role_chunk(const struct tdm_oai_response *r, int index)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    char *out = NULL;
    if (!add_head(root, r, "chat.completion.chunk"))
        goto done;
    cJSON *arr = cJSON_AddArrayToObject(root, "choices");
    cJSON *c = cJSON_CreateObject();
    if (!arr || !c || !cJSON_AddItemToArray(arr, c)) {
        cJSON_Delete(c);
        goto done;
    }
    cJSON *delta;
    if (!cJSON_AddNumberToObject(c, "index", index) ||
        !(delta = cJSON_AddObjectToObject(c, "delta")) ||
        !cJSON_AddStringToObject(delta, "role", r->role ? r->role : "assistant") ||
        !cJSON_AddStringToObject(delta, "content", "") || !cJSON_AddNullToObject(c, "logprobs") ||
        !cJSON_AddNullToObject(c, "finish_reason"))
        goto done;
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

char *tdm_oai_usage_chunk(const struct tdm_oai_response *r, const struct tdm_oai_usage *usage)
{
    struct tdm_oai_usage zero = {0, 0};
    return build(r, NULL, 0, usage ? usage : &zero, true);
}

// ---- /v1/models, /version, /tokenize, /detokenize ----------------------------------------------
char *tdm_oai_models_body(const struct tdm_oai_model_card *cards, size_t n)
{
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return NULL;
    char *out = NULL;
    cJSON *data;
    if (!cJSON_AddStringToObject(root, "object", "list") ||
        !(data = cJSON_AddArrayToObject(root, "data")))
        goto done;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_oai_model_card *m = &cards[i];
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToArray(data, o)) {
            cJSON_Delete(o);
            goto done;
        }
        char hex[TDM_OAI_ID_HEX + 1], perm_id[48];
        tdm_oai_random_hex(hex);
        snprintf(perm_id, sizeof perm_id, "modelperm-%s", hex);
        cJSON *perms, *perm;
        if (!cJSON_AddStringToObject(o, "id", m->id ? m->id : "") ||
            !cJSON_AddStringToObject(o, "object", "model") ||
            !cJSON_AddNumberToObject(o, "created", (double)m->created) ||
            !cJSON_AddStringToObject(o, "owned_by", m->owned_by ? m->owned_by : "vllm") ||
            !cJSON_AddStringToObject(o, "root", m->root ? m->root : (m->id ? m->id : "")) ||
            !(m->parent ? cJSON_AddStringToObject(o, "parent", m->parent)
                        : cJSON_AddNullToObject(o, "parent")) ||
            !cJSON_AddNumberToObject(o, "max_model_len", m->max_model_len) ||
            !(perms = cJSON_AddArrayToObject(o, "permission")) || !(perm = cJSON_CreateObject()))
            goto done;
        cJSON_AddItemToArray(perms, perm);
        if (!cJSON_AddStringToObject(perm, "id", perm_id) ||
            !cJSON_AddStringToObject(perm, "object", "model_permission") ||
            !cJSON_AddNumberToObject(perm, "created", (double)m->created) ||
            !cJSON_AddBoolToObject(perm, "allow_create_engine", 0) ||
            !cJSON_AddBoolToObject(perm, "allow_sampling", 1) ||
            !cJSON_AddBoolToObject(perm, "allow_logprobs", 1) ||
            !cJSON_AddBoolToObject(perm, "allow_search_indices", 0) ||
            !cJSON_AddBoolToObject(perm, "allow_view", 1) ||
            !cJSON_AddBoolToObject(perm, "allow_fine_tuning", 0) ||
            !cJSON_AddStringToObject(perm, "organization", "*") ||
            !cJSON_AddNullToObject(perm, "group") || !cJSON_AddBoolToObject(perm, "is_blocking", 0))
            goto done;
    }
    out = cJSON_PrintUnformatted(root);
done:
    cJSON_Delete(root);
    return out;
}

char *tdm_oai_version_body(const char *version)
{
    cJSON *root = cJSON_CreateObject();
    char *out = NULL;
    if (root && cJSON_AddStringToObject(root, "version", version ? version : ""))
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

// The /tokenize body is written directly, not through a cJSON tree: a 10 MB
// prompt is ~2.7 M tokens, and one cJSON node per id (80 bytes with malloc's
// overhead) made a single call allocate ~360 MB. Written here it costs the
// output itself (~6 bytes a token) plus the id array, with the direct writers
// above (out_int, out_text).
char *tdm_oai_tokenize_body(const int32_t *ids, size_t n, int max_model_len,
                            const char *const *token_strs)
{
    struct tdm_strbuf b = {0};
    tdm_strbuf_reserve(&b, 64 + n * 7); // ids of up to 6 digits and a comma: one allocation
    tdm_strbuf_add(&b, "{\"count\":", 9);
    out_int(&b, (long long)n);
    tdm_strbuf_add(&b, ",\"max_model_len\":", 17);
    out_int(&b, max_model_len);
    tdm_strbuf_add(&b, ",\"tokens\":[", 11);
    for (size_t i = 0; i < n; i++) {
        if (i)
            tdm_strbuf_add(&b, ",", 1);
        out_int(&b, ids[i]);
    }
    tdm_strbuf_add(&b, "],\"token_strs\":", 15);
    if (token_strs) {
        tdm_strbuf_add(&b, "[", 1);
        for (size_t i = 0; i < n && !b.failed; i++) {
            const char *s = token_strs[i] ? token_strs[i] : "";
            if (i)
                tdm_strbuf_add(&b, ",", 1);
            out_text(&b, s, strlen(s));
        }
        tdm_strbuf_add(&b, "]", 1);
    } else {
        tdm_strbuf_add(&b, "null", 4);
    }
    tdm_strbuf_add(&b, "}", 1);
    if (b.failed) {
        free(b.p);
        return NULL;
    }
    return b.p;
}

char *tdm_oai_detokenize_body(const char *text, size_t len)
{
    cJSON *root = cJSON_CreateObject();
    char *out = NULL;
    if (root && add_text(root, "prompt", text, len))
        out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}
