// SPDX-License-Identifier: Apache-2.0
// chat: recognises a model's Jinja chat template and renders OpenAI messages with
// it natively, producing the same bytes as HF transformers' apply_chat_template.
//
// Recognition never guesses. The template text is canonicalised the way Jinja
// would read it under HF's settings (trim_blocks, lstrip_blocks, the '-' markers,
// the dropped final newline), whitespace inside tags that cannot matter is dropped
// and string literals are re-quoted; the result must equal the canonical form of
// one of the texts in chat_known.h. Anything else is TDM_EINVAL with a message.
//
// Rendering follows each template statement by statement; the comments quote the
// template step they implement. common/chat/ref/ checks the output byte for byte
// against Jinja2 running the real template texts.
#include "chat.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_known.h"
#include "core.h"

struct tdm_chat_template {
    enum tdm_chat_format format;
};

// ---- growable byte buffer ---------------------------------------------------------

struct strbuf {
    char *data; // [cap] bytes, NUL-terminated at len; heap
    size_t len;
    size_t cap;
    bool oom; // sticky: set on the first failed growth, checked once at the end
};

static void sb_reserve(struct strbuf *b, size_t extra)
{
    if (b->oom)
        return;
    if (b->len + extra + 1 <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra + 1)
        cap *= 2;
    char *p = realloc(b->data, cap);
    if (!p) {
        b->oom = true;
        return;
    }
    b->data = p;
    b->cap = cap;
}

static void sb_addn(struct strbuf *b, const char *s, size_t n)
{
    sb_reserve(b, n);
    if (b->oom)
        return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void sb_add(struct strbuf *b, const char *s)
{
    sb_addn(b, s, strlen(s));
}

static void sb_addc(struct strbuf *b, char c)
{
    sb_addn(b, &c, 1);
}

// Hands the buffer to the caller (*out, heap) or frees it on OOM.
static int sb_finish(struct strbuf *b, char **out, char *err, size_t errlen)
{
    if (!b->oom && !b->data) { // nothing was appended: an empty string
        sb_reserve(b, 0);
        if (!b->oom)
            b->data[0] = '\0';
    }
    if (b->oom) {
        free(b->data);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory rendering the chat template");
    }
    *out = b->data;
    return TDM_OK;
}

// ---- template canonicalisation ------------------------------------------------------

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

static bool is_word(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// Operator characters that could fuse into another token if a space between two
// of them were dropped ("* *" vs "**", "/ /" vs "//", "< =" vs "<=").
static bool is_op(char c)
{
    return c != 0 && strchr("+-*/%=<>!~|", c) != NULL;
}

enum tag_kind { TAG_VAR, TAG_BLOCK, TAG_COMMENT };

// Writes a string literal starting at s[*i] (a quote) to out as a single-quoted
// canonical literal, decoding the escapes Jinja decodes that spell the same value
// two ways; advances *i past the closing quote. Returns false if unterminated.
static bool canon_string(const char *s, size_t n, size_t *i, struct strbuf *out)
{
    char q = s[*i];
    size_t j = *i + 1;
    sb_addc(out, '\'');
    for (; j < n && s[j] != q; j++) {
        char c = s[j];
        if (c == '\\' && j + 1 < n) {
            char e = s[++j];
            switch (e) {
            case 'n':
                c = '\n';
                break;
            case 't':
                c = '\t';
                break;
            case 'r':
                c = '\r';
                break;
            case '\\':
                c = '\\';
                break;
            case '\'':
                c = '\'';
                break;
            case '"':
                c = '"';
                break;
            default: // kept verbatim: \xNN, \uNNNN ... are rare; stricter, never looser
                sb_addc(out, '\\');
                sb_addc(out, '\\');
                c = e;
                break;
            }
        }
        switch (c) {
        case '\n':
            sb_add(out, "\\n");
            break;
        case '\t':
            sb_add(out, "\\t");
            break;
        case '\r':
            sb_add(out, "\\r");
            break;
        case '\\':
            sb_add(out, "\\\\");
            break;
        case '\'':
            sb_add(out, "\\'");
            break;
        default:
            sb_addc(out, c);
            break;
        }
    }
    if (j >= n)
        return false;
    sb_addc(out, '\'');
    *i = j + 1;
    return true;
}

// Canonical form of the inside of a tag: whitespace kept (as one space) only
// between two word characters or two operator characters, string literals
// re-quoted.
static bool canon_tag_body(const char *s, size_t n, struct strbuf *out)
{
    size_t i = 0;
    char prev = 0; // last byte written for this tag (0: none yet)
    bool pending_space = false;
    while (i < n) {
        char c = s[i];
        if (is_ws(c)) {
            pending_space = true;
            i++;
            continue;
        }
        if (pending_space && ((is_word(prev) && is_word(c)) || (is_op(prev) && is_op(c))))
            sb_addc(out, ' ');
        pending_space = false;
        if (c == '\'' || c == '"') {
            if (!canon_string(s, n, &i, out))
                return false;
            prev = '\'';
            continue;
        }
        sb_addc(out, c);
        prev = c;
        i++;
    }
    return true;
}

// Finds the end of a tag whose body starts at s[i]; returns the index of the closing
// delimiter ("}}", "%}" or "#}"), skipping string literals (not in comments), or n.
static size_t find_tag_end(const char *s, size_t n, size_t i, enum tag_kind kind)
{
    char close = kind == TAG_VAR ? '}' : kind == TAG_BLOCK ? '%' : '#';
    while (i + 1 < n) {
        char c = s[i];
        if (kind != TAG_COMMENT && (c == '\'' || c == '"')) {
            size_t j = i + 1;
            while (j < n && s[j] != c)
                j += s[j] == '\\' ? 2 : 1;
            i = j + 1;
            continue;
        }
        if (c == close && s[i + 1] == '}')
            return i;
        i++;
    }
    return n;
}

// Canonicalises a Jinja template as HF compiles it (trim_blocks=True,
// lstrip_blocks=True, keep_trailing_newline=False). Text between tags is kept
// exactly after whitespace control; tags become {{body}}, {%body%}, {#body#}.
// Returns TDM_OK, TDM_EINVAL (unterminated tag or string) or TDM_ENOMEM.
static int canon_template(const char *tmpl, char **out)
{
    size_t n = strlen(tmpl);
    if (n > 0 && tmpl[n - 1] == '\n') // keep_trailing_newline=False drops one
        n--;
    struct strbuf b = {0};
    struct strbuf text = {0}; // the literal text since the last tag
    bool strip_next_ws = false, trim_next_nl = false, seen_tag = false;
    int rc = TDM_OK;
    size_t i = 0;
    while (i <= n) {
        bool at_tag = i + 1 < n && tmpl[i] == '{' &&
                      (tmpl[i + 1] == '{' || tmpl[i + 1] == '%' || tmpl[i + 1] == '#');
        if (i < n && !at_tag) {
            sb_addc(&text, tmpl[i]);
            i++;
            continue;
        }
        // Flush the text before this tag (or the end), applying whitespace control.
        enum tag_kind kind = TAG_VAR;
        char lmark = 0;
        if (at_tag) {
            kind = tmpl[i + 1] == '{' ? TAG_VAR : tmpl[i + 1] == '%' ? TAG_BLOCK : TAG_COMMENT;
            if (i + 2 < n && (tmpl[i + 2] == '-' || tmpl[i + 2] == '+'))
                lmark = tmpl[i + 2];
        }
        size_t start = 0, end = text.len;
        const char *t = text.data ? text.data : "";
        if (strip_next_ws) {
            while (start < end && is_ws(t[start]))
                start++;
        } else if (trim_next_nl && start < end && t[start] == '\n') {
            start++;
        }
        if (at_tag && lmark == '-') {
            while (end > start && is_ws(t[end - 1]))
                end--;
        } else if (at_tag && kind != TAG_VAR && lmark != '+') {
            // lstrip_blocks: when only whitespace lies between the start of the line
            // and a block or comment tag, it goes. The line starts after the last
            // newline of this text, or at the text's start when the previous tag's
            // own match ended with a newline (or there was no previous tag).
            bool line_starting = !seen_tag || (start > 0 && t[start - 1] == '\n');
            size_t l = end;
            while (l > start && t[l - 1] != '\n')
                l--;
            bool found_nl = l > start;
            if (found_nl || line_starting) {
                size_t k = l;
                while (k < end && is_ws(t[k]))
                    k++;
                if (k == end)
                    end = l;
            }
        }
        if (end > start)
            sb_addn(&b, t + start, end - start);
        text.len = 0;
        strip_next_ws = trim_next_nl = false;
        if (!at_tag)
            break;

        size_t body = i + 2 + (lmark ? 1 : 0);
        size_t close = find_tag_end(tmpl, n, body, kind);
        if (close >= n) {
            rc = TDM_EINVAL;
            goto done;
        }
        size_t body_end = close;
        char rmark = 0;
        if (body_end > body && (tmpl[body_end - 1] == '-' || tmpl[body_end - 1] == '+')) {
            rmark = tmpl[body_end - 1];
            body_end--;
        }
        static const char open[3][3] = {"{{", "{%", "{#"};
        static const char shut[3][3] = {"}}", "%}", "#}"};
        sb_add(&b, open[kind]);
        if (kind == TAG_COMMENT)
            sb_addn(&b, tmpl + body, body_end - body);
        else if (!canon_tag_body(tmpl + body, body_end - body, &b)) {
            rc = TDM_EINVAL;
            goto done;
        }
        sb_add(&b, shut[kind]);
        if (rmark == '-')
            strip_next_ws = true;
        else if (kind != TAG_VAR && rmark != '+') // trim_blocks: first newline after %} / #}
            trim_next_nl = true;
        seen_tag = true;
        i = close + 2;
    }
done:
    free(text.data);
    if (rc != TDM_OK) {
        free(b.data);
        return rc;
    }
    return sb_finish(&b, out, NULL, 0);
}

// ---- recognition ----------------------------------------------------------------

static const struct {
    const char *text;
    enum tdm_chat_format format;
} known_templates[] = {
    {tdm_chat_tmpl_qwen25, TDM_CHAT_QWEN2},
    {tdm_chat_tmpl_llama3, TDM_CHAT_LLAMA3},
    {tdm_chat_tmpl_chatml, TDM_CHAT_CHATML},
    {tdm_chat_tmpl_chatml_ws, TDM_CHAT_CHATML},
};

// Copies up to ~60 bytes of text for an error message, newlines escaped, never
// cutting a UTF-8 sequence.
static void snippet(const char *text, char *dst, size_t dstlen)
{
    size_t o = 0;
    for (size_t i = 0; text[i] && i < 60; i++) {
        unsigned char c = (unsigned char)text[i];
        if (i >= 56 && c >= 0xC0)
            break; // don't start a multi-byte sequence this close to the cut
        const char *rep = c == '\n' ? "\\n" : c == '\t' ? "\\t" : NULL;
        size_t need = rep ? 2 : 1;
        if (o + need + 1 > dstlen)
            break;
        if (rep) {
            memcpy(dst + o, rep, 2);
        } else {
            dst[o] = (char)c;
        }
        o += need;
    }
    dst[o] = '\0';
}

static int recognise(const char *text, const char *what, enum tdm_chat_format *fmt, char *err,
                     size_t errlen)
{
    char *canon = NULL;
    int rc = canon_template(text, &canon);
    if (rc == TDM_ENOMEM)
        return tdm_seterr(err, errlen, rc, "out of memory reading the chat template");
    for (size_t k = 0; rc == TDM_OK && k < sizeof known_templates / sizeof known_templates[0];
         k++) {
        char *want = NULL;
        int krc = canon_template(known_templates[k].text, &want);
        if (krc != TDM_OK) {
            free(canon);
            return tdm_seterr(err, errlen, krc, "out of memory reading the chat template");
        }
        bool same = strcmp(canon, want) == 0;
        free(want);
        if (same) {
            free(canon);
            *fmt = known_templates[k].format;
            return TDM_OK;
        }
    }
    free(canon);
    char snip[160];
    snippet(text, snip, sizeof snip);
    return tdm_seterr(
        err, errlen, TDM_EINVAL,
        "%s: chat template not recognised (first 60 chars: %s); pass --chat-template "
        "FILE with a ChatML or Llama 3 template (or the name chatml, qwen2 or llama3)",
        what, snip);
}

int tdm_chat_template_new(struct tdm_chat_template **out, const char *template_text,
                          const char *override_path, char *err, size_t errlen)
{
    enum tdm_chat_format fmt;
    int rc;
    *out = NULL;
    if (override_path) {
        if (strcmp(override_path, "chatml") == 0) {
            fmt = TDM_CHAT_CHATML;
        } else if (strcmp(override_path, "qwen2") == 0) {
            fmt = TDM_CHAT_QWEN2;
        } else if (strcmp(override_path, "llama3") == 0) {
            fmt = TDM_CHAT_LLAMA3;
        } else {
            char *text = NULL;
            size_t len = 0;
            rc = tdm_read_file(override_path, &text, &len, err, errlen);
            if (rc != TDM_OK)
                return rc;
            if (strlen(text) != len) {
                free(text);
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s: chat template contains a NUL byte",
                                  override_path);
            }
            rc = recognise(text, override_path, &fmt, err, errlen);
            free(text);
            if (rc != TDM_OK)
                return rc;
        }
    } else if (!template_text) {
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "tokenizer_config.json has no chat_template; pass --chat-template FILE "
                          "(or the name chatml, qwen2 or llama3)");
    } else {
        rc = recognise(template_text, "tokenizer_config.json", &fmt, err, errlen);
        if (rc != TDM_OK)
            return rc;
    }
    struct tdm_chat_template *t = calloc(1, sizeof *t);
    if (!t)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    t->format = fmt;
    *out = t;
    return TDM_OK;
}

void tdm_chat_template_free(struct tdm_chat_template *t)
{
    free(t);
}

enum tdm_chat_format tdm_chat_template_format(const struct tdm_chat_template *t)
{
    return t->format;
}

// ---- rendering ---------------------------------------------------------------------

static const char qwen_default_system[] =
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.";
static const char llama3_bos[] = "<|begin_of_text|>";

static bool role_is(const struct tdm_chat_msg *m, const char *role)
{
    return strcmp(m->role, role) == 0;
}

static bool role_known(const char *role)
{
    return strcmp(role, "system") == 0 || strcmp(role, "user") == 0 ||
           strcmp(role, "assistant") == 0 || strcmp(role, "tool") == 0;
}

// Python's str.isspace() for one code point (what Jinja's trim filter strips).
static bool py_isspace(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Decodes the UTF-8 code point at s[i] (of n); returns its length, 0 if invalid.
static size_t utf8_at(const unsigned char *s, size_t n, size_t i, uint32_t *cp)
{
    unsigned char c = s[i];
    size_t len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xE0) == 0xC0) {
        len = 2;
        v = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3;
        v = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4;
        v = c & 0x07;
    } else {
        return 0;
    }
    if (i + len > n)
        return 0;
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (s[i + k] & 0x3F);
    }
    *cp = v;
    return len;
}

// Jinja's `| trim` (Python str.strip()): appends content without leading and
// trailing Unicode whitespace. Invalid UTF-8 bytes count as non-space.
static void sb_add_trimmed(struct strbuf *b, const char *content)
{
    const unsigned char *s = (const unsigned char *)content;
    size_t n = strlen(content), start = 0, end = 0;
    bool seen = false;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = utf8_at(s, n, i, &cp);
        bool space = len > 0 && py_isspace(cp);
        if (len == 0)
            len = 1;
        if (!space) {
            if (!seen)
                start = i;
            seen = true;
            end = i + len;
        }
        i += len;
    }
    if (seen)
        sb_addn(b, content + start, end - start);
}

static void chatml_turn(struct strbuf *b, const char *role, const char *content)
{
    sb_add(b, "<|im_start|>");
    sb_add(b, role);
    sb_addc(b, '\n');
    sb_add(b, content);
    sb_add(b, "<|im_end|>\n");
}

static void render_qwen2(struct strbuf *b, const struct tdm_chat_msg *msgs, size_t n, bool gen)
{
    // {%- if messages[0]['role'] == 'system' %} ... {%- else %} default system
    if (role_is(&msgs[0], "system"))
        chatml_turn(b, "system", msgs[0].content);
    else
        chatml_turn(b, "system", qwen_default_system);
    for (size_t i = 0; i < n; i++) {
        const struct tdm_chat_msg *m = &msgs[i];
        if (role_is(m, "user") || (role_is(m, "system") && i != 0) || role_is(m, "assistant")) {
            // user, a later system, or an assistant without tool_calls: a plain turn.
            chatml_turn(b, m->role, m->content);
        } else if (role_is(m, "tool")) {
            // Consecutive tool results share one user turn of <tool_response> blocks.
            if (i == 0 || !role_is(&msgs[i - 1], "tool"))
                sb_add(b, "<|im_start|>user");
            sb_add(b, "\n<tool_response>\n");
            sb_add(b, m->content);
            sb_add(b, "\n</tool_response>");
            if (i + 1 == n || !role_is(&msgs[i + 1], "tool"))
                sb_add(b, "<|im_end|>\n");
        }
        // The first system message was rendered above, before the loop.
    }
    if (gen)
        sb_add(b, "<|im_start|>assistant\n");
}

static void render_chatml(struct strbuf *b, const struct tdm_chat_msg *msgs, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++)
        chatml_turn(b, msgs[i].role, msgs[i].content);
    if (gen)
        sb_add(b, "<|im_start|>assistant\n");
}

static void render_llama3(struct strbuf *b, const struct tdm_chat_msg *msgs, size_t n, bool gen)
{
    for (size_t i = 0; i < n; i++) {
        if (i == 0) // {% if loop.index0 == 0 %}{% set content = bos_token + content %}
            sb_add(b, llama3_bos);
        sb_add(b, "<|start_header_id|>");
        sb_add(b, msgs[i].role);
        sb_add(b, "<|end_header_id|>\n\n");
        sb_add_trimmed(b, msgs[i].content);
        sb_add(b, "<|eot_id|>");
    }
    if (gen)
        sb_add(b, "<|start_header_id|>assistant<|end_header_id|>\n\n");
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
    // The Qwen2.5 template reads messages[0]['role'] unconditionally: Jinja fails on
    // an empty list, so we do too. The other two render just the generation prompt.
    if (n == 0 && t->format == TDM_CHAT_QWEN2)
        return tdm_seterr(err, errlen, TDM_EINVAL, "messages must not be empty");
    struct strbuf b = {0};
    switch (t->format) {
    case TDM_CHAT_QWEN2:
        render_qwen2(&b, msgs, n, add_generation_prompt);
        break;
    case TDM_CHAT_CHATML:
        render_chatml(&b, msgs, n, add_generation_prompt);
        break;
    case TDM_CHAT_LLAMA3:
        render_llama3(&b, msgs, n, add_generation_prompt);
        break;
    }
    return sb_finish(&b, out, err, errlen);
}

// ---- OpenAI messages parsing ---------------------------------------------------------

// Joins the text parts of a content list with "\n" (vLLM's string content format);
// *out is heap.
static int join_text_parts(const cJSON *parts, size_t idx, char **out, char *err, size_t errlen)
{
    struct strbuf b = {0};
    size_t j = 0, ntext = 0;
    const cJSON *part;
    cJSON_ArrayForEach(part, parts)
    {
        if (!cJSON_IsObject(part)) {
            free(b.data);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu] must be an object", idx, j);
        }
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        if (!cJSON_IsString(type)) {
            free(b.data);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu].type must be a string", idx, j);
        }
        if (strcmp(type->valuestring, "text") != 0) {
            int rc = tdm_seterr(err, errlen, TDM_EINVAL,
                                "messages[%zu].content[%zu]: content part type '%.40s' is not "
                                "supported (only text)",
                                idx, j, type->valuestring);
            free(b.data);
            return rc;
        }
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(text)) {
            free(b.data);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "messages[%zu].content[%zu].text must be a string", idx, j);
        }
        if (ntext++ > 0)
            sb_addc(&b, '\n');
        sb_add(&b, text->valuestring);
        j++;
    }
    return sb_finish(&b, out, err, errlen);
}

int tdm_chat_msgs_parse(const char *json, size_t len, struct tdm_chat_msg **msgs, size_t *n,
                        char *err, size_t errlen)
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
        if (assistant && calls && !cJSON_IsNull(calls) &&
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
