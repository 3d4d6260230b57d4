// SPDX-License-Identifier: Apache-2.0
// chat: the public face of the chat-template renderer (chat.h). Loading lexes and
// parses the template once (chat_lex.c, chat_parse.c) into an AST kept with the
// template; rendering builds the variables HF's apply_chat_template passes
// (messages, tools, documents = none, add_generation_prompt, the special tokens)
// in a fresh arena and runs the AST (chat_eval.c). Also parses OpenAI messages.
#include "chat.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "chat_known.h"
#include "core.h"

#define CHAT_MAX_VARS 32

struct tdm_chat_template {
    struct arena arena; // the AST and its strings
    struct node *root;  // N_BODY
    struct {
        char *name, *value; // heap
    } vars[CHAT_MAX_VARS];  // set with tdm_chat_template_set_var
    size_t nvars;
};

// ---- small helpers ------------------------------------------------------------------

// Hands the buffer to the caller (*out, heap) or frees it on OOM.
static int sb_finish(struct tdm_strbuf *b, char **out, char *err, size_t errlen)
{
    if (!b->failed && !b->p) { // nothing was appended: an empty string
        tdm_strbuf_add(b, "", 0);
    }
    if (b->failed) {
        free(b->p);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory rendering the chat template");
    }
    *out = b->p;
    return TDM_OK;
}

static bool role_known(const char *role)
{
    return strcmp(role, "system") == 0 || strcmp(role, "user") == 0 ||
           strcmp(role, "assistant") == 0 || strcmp(role, "tool") == 0;
}

// ---- load -------------------------------------------------------------------------------

static int compile_now(struct tdm_chat_template *t, const char *text, const char *what, char *err,
                       size_t errlen)
{
    char detail[400] = "";
    struct token *toks = NULL;
    size_t ntoks = 0;
    int rc = chat_lex(&t->arena, text, &toks, &ntoks, detail, sizeof detail);
    if (rc == TDM_OK)
        rc = chat_parse(&t->arena, toks, ntoks, &t->root, detail, sizeof detail);
    free(toks);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "%s: %s", what, detail);
    return TDM_OK;
}

struct deep_compile {
    struct tdm_chat_template *t;
    const char *text, *what;
    char *err;
    size_t errlen;
    int rc;
};

static void compile_deep(void *arg)
{
    struct deep_compile *d = arg;
    d->rc = compile_now(d->t, d->text, d->what, d->err, d->errlen);
}

// The parser recurses per nesting level (CHAT_MAX_NEST): on a deep stack, as a
// render (templates may come from a router config reload on any thread).
static int compile(struct tdm_chat_template *t, const char *text, const char *what, char *err,
                   size_t errlen)
{
    struct deep_compile d = {t, text, what, err, errlen, TDM_ENOMEM};
    if (tdm_call_deep(compile_deep, &d) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EBUSY, "%s: no thread to parse the template on", what);
    return d.rc;
}

int tdm_chat_template_new(struct tdm_chat_template **out, const char *template_text,
                          const char *override_path, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_chat_template *t = calloc(1, sizeof *t);
    if (!t)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    int rc;
    if (override_path) {
        const char *builtin = strcmp(override_path, "chatml") == 0   ? tdm_chat_tmpl_chatml
                              : strcmp(override_path, "qwen2") == 0  ? tdm_chat_tmpl_qwen25
                              : strcmp(override_path, "llama3") == 0 ? tdm_chat_tmpl_llama3
                                                                     : NULL;
        if (builtin) {
            rc = compile(t, builtin, override_path, err, errlen);
            if (rc == TDM_OK && builtin == tdm_chat_tmpl_llama3)
                rc = tdm_chat_template_set_var(t, "bos_token", "<|begin_of_text|>");
        } else {
            char *text = NULL;
            size_t len = 0;
            rc = tdm_read_file(override_path, &text, &len, err, errlen);
            if (rc == TDM_OK && strlen(text) != len)
                rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s: chat template contains a NUL byte",
                                override_path);
            if (rc == TDM_OK)
                rc = compile(t, text, override_path, err, errlen);
            free(text);
        }
    } else if (!template_text) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL,
                        "tokenizer_config.json has no chat_template; pass --chat-template FILE "
                        "(or the name chatml, qwen2 or llama3)");
    } else {
        rc = compile(t, template_text, "tokenizer_config.json", err, errlen);
    }
    if (rc != TDM_OK) {
        tdm_chat_template_free(t);
        return rc;
    }
    *out = t;
    return TDM_OK;
}

void tdm_chat_template_free(struct tdm_chat_template *t)
{
    if (!t)
        return;
    for (size_t i = 0; i < t->nvars; i++) {
        free(t->vars[i].name);
        free(t->vars[i].value);
    }
    chat_arena_free(&t->arena);
    free(t);
}

int tdm_chat_template_set_var(struct tdm_chat_template *t, const char *name, const char *value)
{
    size_t i;
    for (i = 0; i < t->nvars; i++)
        if (strcmp(t->vars[i].name, name) == 0)
            break;
    if (!value) {
        if (i < t->nvars) {
            free(t->vars[i].name);
            free(t->vars[i].value);
            t->vars[i] = t->vars[--t->nvars];
        }
        return TDM_OK;
    }
    char *v = strdup(value);
    if (!v)
        return TDM_ENOMEM;
    if (i < t->nvars) {
        free(t->vars[i].value);
        t->vars[i].value = v;
        return TDM_OK;
    }
    if (t->nvars == CHAT_MAX_VARS) {
        free(v);
        return TDM_ECAPACITY;
    }
    char *nm = strdup(name);
    if (!nm) {
        free(v);
        return TDM_ENOMEM;
    }
    t->vars[t->nvars].name = nm;
    t->vars[t->nvars].value = v;
    t->nvars++;
    return TDM_OK;
}

int tdm_chat_template_copy_vars(struct tdm_chat_template *dst, const struct tdm_chat_template *src)
{
    int rc = TDM_OK;
    for (size_t i = 0; src && i < src->nvars && rc == TDM_OK; i++)
        rc = tdm_chat_template_set_var(dst, src->vars[i].name, src->vars[i].value);
    return rc;
}

int tdm_chat_template_set_tokens(struct tdm_chat_template *t, const char *bos_token,
                                 const char *eos_token, const char *pad_token)
{
    int rc = bos_token ? tdm_chat_template_set_var(t, "bos_token", bos_token) : TDM_OK;
    if (rc == TDM_OK && eos_token)
        rc = tdm_chat_template_set_var(t, "eos_token", eos_token);
    if (rc == TDM_OK && pad_token)
        rc = tdm_chat_template_set_var(t, "pad_token", pad_token);
    return rc;
}

// ---- render -----------------------------------------------------------------------------

static int render_json_now(const struct tdm_chat_template *t, const char *messages_json,
                           const char *tools_json, const char *kwargs_json,
                           bool add_generation_prompt, char **out, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_strbuf prompt = {.limit = CHAT_MAX_OUTPUT};
    struct render r = {
        .arena = {.cap = CHAT_MAX_ARENA}, .out = &prompt, .err = err, .errlen = errlen};
    struct val messages, tools = chat_v_none();
    r.stack_base = (uintptr_t)__builtin_frame_address(0);
    r.globals = chat_arena_alloc(&r.arena, sizeof *r.globals);
    int rc = r.globals ? TDM_OK : chat_rerr(&r, TDM_ENOMEM, "out of memory");
    if (rc == TDM_OK)
        rc = chat_json_to_val(&r, messages_json, strlen(messages_json), "messages", &messages);
    if (rc == TDM_OK && tools_json)
        rc = chat_json_to_val(&r, tools_json, strlen(tools_json), "tools", &tools);
#define SETV(name, v) chat_v_dict_set(&r, &r.globals->vars, chat_v_strn(name, strlen(name)), v)
    for (size_t i = 0; i < t->nvars && rc == TDM_OK; i++)
        rc = SETV(t->vars[i].name, chat_v_strn(t->vars[i].value, strlen(t->vars[i].value)));
    if (rc == TDM_OK)
        rc = SETV("messages", messages);
    if (rc == TDM_OK)
        rc = SETV("tools", tools);
    if (rc == TDM_OK)
        rc = SETV("documents", chat_v_none());
    if (rc == TDM_OK)
        rc = SETV("add_generation_prompt", chat_v_bool(add_generation_prompt));
    // The request's chat_template_kwargs last: as HF's template kwargs, they
    // win over the special tokens and the defaults above.
    struct val kw;
    if (rc == TDM_OK && kwargs_json)
        rc = chat_json_to_val(&r, kwargs_json, strlen(kwargs_json), "chat_template_kwargs", &kw);
    if (rc == TDM_OK && kwargs_json && kw.kind != V_DICT)
        rc = chat_rerr(&r, TDM_EINVAL, "chat_template_kwargs must be an object");
    for (size_t i = 0; rc == TDM_OK && kwargs_json && i < kw.u.dict->n; i++)
        rc = chat_v_dict_set(&r, &r.globals->vars, kw.u.dict->keys[i], kw.u.dict->vals[i]);
#undef SETV
    if (rc == TDM_OK)
        rc = chat_eval_render(&r, t->root);
    chat_arena_free(&r.arena);
    if (rc != TDM_OK) {
        free(prompt.p);
        return rc;
    }
    return sb_finish(&prompt, out, err, errlen);
}

struct deep_render {
    const struct tdm_chat_template *t;
    const char *messages_json, *tools_json, *kwargs_json;
    bool add_generation_prompt;
    char **out;
    char *err;
    size_t errlen;
    int rc;
};

static void render_deep(void *arg)
{
    struct deep_render *d = arg;
    d->rc = render_json_now(d->t, d->messages_json, d->tools_json, d->kwargs_json,
                            d->add_generation_prompt, d->out, d->err, d->errlen);
}

// A render runs on a deep stack (core.h's tdm_call_deep): the evaluator, the
// JSON conversion and tojson recurse per level of the template and of the
// request's messages and tools, within CHAT_MAX_STACK, which an HTTP worker's
// ~100 KiB stack (part of it spent before the handler) could not hold.
int tdm_chat_render_json_kw(const struct tdm_chat_template *t, const char *messages_json,
                            const char *tools_json, const char *kwargs_json,
                            bool add_generation_prompt, char **out, char *err, size_t errlen)
{
    *out = NULL;
    struct deep_render d = {.t = t,
                            .messages_json = messages_json,
                            .tools_json = tools_json,
                            .kwargs_json = kwargs_json,
                            .add_generation_prompt = add_generation_prompt,
                            .out = out,
                            .err = err,
                            .errlen = errlen,
                            .rc = TDM_ENOMEM};
    if (tdm_call_deep(render_deep, &d) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EBUSY, "chat template: no thread to render on");
    return d.rc;
}

int tdm_chat_render_json(const struct tdm_chat_template *t, const char *messages_json,
                         const char *tools_json, bool add_generation_prompt, char **out, char *err,
                         size_t errlen)
{
    return tdm_chat_render_json_kw(t, messages_json, tools_json, NULL, add_generation_prompt, out,
                                   err, errlen);
}

int tdm_chat_render(const struct tdm_chat_template *t, const struct tdm_chat_msg *msgs, size_t n,
                    bool add_generation_prompt, char **out, char *err, size_t errlen)
{
    *out = NULL;
    for (size_t i = 0; i < n; i++) {
        if (!msgs[i].role || !role_known(msgs[i].role))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].role must be system, user, assistant or tool", i);
        if (!msgs[i].content)
            return tdm_seterr(err, errlen, TDM_EINVAL, "messages[%zu].content is missing", i);
    }
    cJSON *arr = cJSON_CreateArray();
    for (size_t i = 0; arr && i < n; i++) {
        cJSON *m = cJSON_CreateObject();
        if (!m || !cJSON_AddItemToArray(arr, m) ||
            !cJSON_AddStringToObject(m, "role", msgs[i].role) ||
            !cJSON_AddStringToObject(m, "content", msgs[i].content)) {
            cJSON_Delete(arr);
            arr = NULL;
        }
    }
    char *json = arr ? cJSON_PrintUnformatted(arr) : NULL;
    cJSON_Delete(arr);
    if (!json)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    int rc = tdm_chat_render_json(t, json, NULL, add_generation_prompt, out, err, errlen);
    free(json);
    return rc;
}

// ---- OpenAI messages parsing ---------------------------------------------------------

// Joins the text parts of a content list with "\n" (vLLM's string content format);
// *out is heap.
static int join_text_parts(const cJSON *parts, size_t idx, char **out, char *err, size_t errlen)
{
    struct tdm_strbuf b = {0};
    size_t j = 0, ntext = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, parts)
    {
        if (!cJSON_IsObject(part)) {
            free(b.p);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu] must be an object", idx, j);
        }
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        if (!cJSON_IsString(type)) {
            free(b.p);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu].type must be a string", idx, j);
        }
        if (strcmp(type->valuestring, "text") != 0) {
            int rc = tdm_seterr(err, errlen, TDM_EINVAL,
                                "messages[%zu].content[%zu]: content part type '%.40s' is not "
                                "supported (only text)",
                                idx, j, type->valuestring);
            free(b.p);
            return rc;
        }
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(text)) {
            free(b.p);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu].text must be a string", idx, j);
        }
        if (ntext++ > 0)
            tdm_strbuf_addc(&b, '\n');
        tdm_strbuf_adds(&b, text->valuestring);
        j++;
    }
    return sb_finish(&b, out, err, errlen);
}

static int msgs_parse(const char *json, size_t len, bool tool_calls, struct tdm_chat_msg **msgs,
                      size_t *n, char *err, size_t errlen)
{
    *msgs = NULL;
    *n = 0;
    int rc;
    char depth_err[96];
    if (tdm_json_check_depth(json, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err))
        return tdm_seterr(err, errlen, TDM_EINVAL, "messages: %s", depth_err);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return tdm_seterr(err, errlen, TDM_EINVAL, "messages is not valid JSON");
    if (!cJSON_IsArray(root)) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "messages must be an array");
        goto fail_root;
    }
    size_t count = (size_t)cJSON_GetArraySize(root);
    if (count == 0) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "messages must contain at least one message");
        goto fail_root;
    }
    struct tdm_chat_msg *out = calloc(count, sizeof *out);
    if (!out) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_root;
    }
    size_t i = 0;
    const cJSON *m;
    cJSON_ArrayForEach(m, root)
    {
        if (!cJSON_IsObject(m)) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "messages[%zu] must be an object", i);
            goto fail_msgs;
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(m, "role");
        if (!role) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "messages[%zu].role is required", i);
            goto fail_msgs;
        }
        if (!cJSON_IsString(role)) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "messages[%zu].role must be a string", i);
            goto fail_msgs;
        }
        if (!role_known(role->valuestring)) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL,
                            "messages[%zu].role '%.40s' is not supported (expected system, user, "
                            "assistant or tool)",
                            i, role->valuestring);
            goto fail_msgs;
        }
        bool assistant = strcmp(role->valuestring, "assistant") == 0;
        const cJSON *calls = cJSON_GetObjectItemCaseSensitive(m, "tool_calls");
        if (!tool_calls && assistant && calls && !cJSON_IsNull(calls) &&
            !(cJSON_IsArray(calls) && cJSON_GetArraySize(calls) == 0)) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL,
                            "messages[%zu].tool_calls is not supported (no tool calling)", i);
            goto fail_msgs;
        }
        out[i].role = strdup(role->valuestring);
        if (!out[i].role) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto fail_msgs;
        }
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(m, "content");
        if (cJSON_IsString(content)) {
            out[i].content = strdup(content->valuestring);
        } else if (!content || cJSON_IsNull(content)) {
            // vLLM turns a missing content into an empty text (assistant turns that
            // only carried tool calls); OpenAI requires it for the other roles.
            if (!assistant) {
                rc = tdm_seterr(err, errlen, TDM_EINVAL,
                                "messages[%zu].content is required for role %s", i,
                                role->valuestring);
                goto fail_msgs;
            }
            out[i].content = strdup("");
        } else if (cJSON_IsArray(content)) {
            rc = join_text_parts(content, i, &out[i].content, err, errlen);
            if (rc != TDM_OK)
                goto fail_msgs;
        } else {
            rc = tdm_seterr(err, errlen, TDM_EINVAL,
                            "messages[%zu].content must be a string or a list of text parts", i);
            goto fail_msgs;
        }
        if (!out[i].content) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto fail_msgs;
        }
        i++;
    }
    cJSON_Delete(root);
    *msgs = out;
    *n = count;
    return TDM_OK;

fail_msgs:
    tdm_chat_msgs_free(out, count);
fail_root:
    cJSON_Delete(root);
    return rc;
}

int tdm_chat_msgs_parse(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                        char *err, size_t errlen)
{
    return msgs_parse(json, len, false, msgs, n, err, errlen);
}

int tdm_chat_msgs_parse_calls(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                              char *err, size_t errlen)
{
    return msgs_parse(json, len, true, msgs, n, err, errlen);
}

void tdm_chat_msgs_free(struct tdm_chat_msg *msgs, size_t n)
{
    if (!msgs)
        return;
    for (size_t i = 0; i < n; i++) {
        free(msgs[i].role);
        free(msgs[i].content);
    }
    free(msgs);
}
