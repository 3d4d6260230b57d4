// SPDX-License-Identifier: Apache-2.0
// chat_json: JSON text -> template values, and values -> JSON text the way HF's
// `tojson` filter writes it (Python json.dumps: ensure_ascii=False by default,
// separators ", " and ": " or "," with indent, keys in insertion order unless
// sort_keys). Our own parser rather than cJSON because Python keeps 1 and 1.0
// apart (json.dumps prints them differently) and cJSON does not.
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "core.h"

// ---- parse -------------------------------------------------------------------------

struct jp {
    struct render *r;
    const char *s;
    size_t n, i;
    const char *what;
};

static int jp_err(struct jp *p, const char *msg)
{
    return chat_rerr(p->r, TDM_EINVAL, "%s: invalid JSON at byte %zu: %s", p->what, p->i, msg);
}

static void jp_ws(struct jp *p)
{
    while (p->i < p->n &&
           (p->s[p->i] == ' ' || p->s[p->i] == '\t' || p->s[p->i] == '\n' || p->s[p->i] == '\r'))
        p->i++;
}

static int hex4(struct jp *p, uint32_t *v)
{
    if (p->i + 4 > p->n)
        return jp_err(p, "short \\u escape");
    *v = 0;
    for (int k = 0; k < 4; k++) {
        char c = p->s[p->i++];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return jp_err(p, "bad \\u escape");
        *v = *v * 16 + (uint32_t)d;
    }
    return TDM_OK;
}

static int jp_string(struct jp *p, struct val *out)
{
    p->i++; // opening quote
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    int rc = TDM_OK;
    while (true) {
        if (p->i >= p->n) {
            rc = jp_err(p, "unterminated string");
            goto done;
        }
        unsigned char c = (unsigned char)p->s[p->i];
        if (c == '"') {
            p->i++;
            break;
        }
        if (c < 0x20) {
            rc = jp_err(p, "control character in string");
            goto done;
        }
        if (c != '\\') {
            size_t start = p->i;
            while (p->i < p->n && p->s[p->i] != '"' && p->s[p->i] != '\\' &&
                   (unsigned char)p->s[p->i] >= 0x20)
                p->i++;
            tdm_strbuf_add(&b, p->s + start, p->i - start);
            continue;
        }
        if (++p->i >= p->n) {
            rc = jp_err(p, "unterminated escape");
            goto done;
        }
        char e = p->s[p->i++];
        uint32_t cp;
        switch (e) {
        case '"':
        case '\\':
        case '/':
            tdm_strbuf_addc(&b, e);
            break;
        case 'b':
            tdm_strbuf_addc(&b, '\b');
            break;
        case 'f':
            tdm_strbuf_addc(&b, '\f');
            break;
        case 'n':
            tdm_strbuf_addc(&b, '\n');
            break;
        case 'r':
            tdm_strbuf_addc(&b, '\r');
            break;
        case 't':
            tdm_strbuf_addc(&b, '\t');
            break;
        case 'u':
            if ((rc = hex4(p, &cp)) != TDM_OK)
                goto done;
            if (cp >= 0xD800 && cp < 0xDC00 && p->i + 6 <= p->n && p->s[p->i] == '\\' &&
                p->s[p->i + 1] == 'u') {
                uint32_t lo;
                size_t save = p->i;
                p->i += 2;
                if ((rc = hex4(p, &lo)) != TDM_OK)
                    goto done;
                if (lo >= 0xDC00 && lo < 0xE000)
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                else
                    p->i = save;
            }
            if (cp >= 0xD800 && cp < 0xE000) {
                rc = jp_err(p, "lone UTF-16 surrogate");
                goto done;
            }
            chat_utf8_put(&b, cp);
            break;
        default:
            rc = jp_err(p, "bad escape");
            goto done;
        }
    }
    rc = chat_sb_to_val(p->r, &b, out);
done:
    free(b.p);
    return rc;
}

static int jp_value(struct jp *p, struct val *out, int depth);

static int jp_number(struct jp *p, struct val *out)
{
    size_t start = p->i;
    bool is_float = false;
    if (p->s[p->i] == '-')
        p->i++;
    if (p->i >= p->n || p->s[p->i] < '0' || p->s[p->i] > '9')
        return jp_err(p, "bad number");
    while (p->i < p->n) {
        char c = p->s[p->i];
        if (c >= '0' && c <= '9') {
            p->i++;
        } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
            is_float = true;
            p->i++;
        } else {
            break;
        }
    }
    char buf[64];
    size_t len = p->i - start;
    if (len >= sizeof buf)
        return jp_err(p, "number too long");
    memcpy(buf, p->s + start, len);
    buf[len] = '\0';
    char *end;
    if (!is_float) {
        errno = 0;
        long long v = strtoll(buf, &end, 10);
        if (*end || errno == ERANGE)
            return jp_err(p, "integer out of range");
        *out = chat_v_int(v);
        return TDM_OK;
    }
    double d = strtod(buf, &end);
    if (*end)
        return jp_err(p, "bad number");
    *out = chat_v_float(d);
    return TDM_OK;
}

static int jp_value(struct jp *p, struct val *out, int depth)
{
    if (depth > CHAT_MAX_JSON_DEPTH)
        return chat_rerr(p->r, TDM_EINVAL, "%s: JSON nested deeper than %d (limit)", p->what,
                         CHAT_MAX_JSON_DEPTH);
    if (!chat_charge(p->r, 1) || !chat_stack_ok(p->r))
        return p->r->rc;
    jp_ws(p);
    if (p->i >= p->n)
        return jp_err(p, "unexpected end");
    char c = p->s[p->i];
    int rc;
    if (c == '"')
        return jp_string(p, out);
    if (c == '{') {
        p->i++;
        if ((rc = chat_v_dict_new(p->r, out)) != TDM_OK)
            return rc;
        jp_ws(p);
        if (p->i < p->n && p->s[p->i] == '}') {
            p->i++;
            return TDM_OK;
        }
        while (true) {
            jp_ws(p);
            if (p->i >= p->n || p->s[p->i] != '"')
                return jp_err(p, "expected a key");
            struct val k, v;
            if ((rc = jp_string(p, &k)) != TDM_OK)
                return rc;
            jp_ws(p);
            if (p->i >= p->n || p->s[p->i] != ':')
                return jp_err(p, "expected ':'");
            p->i++;
            if ((rc = jp_value(p, &v, depth + 1)) != TDM_OK)
                return rc;
            if ((rc = chat_v_dict_set(p->r, out->u.dict, k, v)) != TDM_OK)
                return rc;
            jp_ws(p);
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                continue;
            }
            if (p->i < p->n && p->s[p->i] == '}') {
                p->i++;
                return TDM_OK;
            }
            return jp_err(p, "expected ',' or '}'");
        }
    }
    if (c == '[') {
        p->i++;
        if ((rc = chat_v_list_new(p->r, 0, out)) != TDM_OK)
            return rc;
        jp_ws(p);
        if (p->i < p->n && p->s[p->i] == ']') {
            p->i++;
            return TDM_OK;
        }
        while (true) {
            struct val v;
            if ((rc = jp_value(p, &v, depth + 1)) != TDM_OK)
                return rc;
            if ((rc = chat_v_list_push(p->r, out->u.list, v)) != TDM_OK)
                return rc;
            jp_ws(p);
            if (p->i < p->n && p->s[p->i] == ',') {
                p->i++;
                continue;
            }
            if (p->i < p->n && p->s[p->i] == ']') {
                p->i++;
                return TDM_OK;
            }
            return jp_err(p, "expected ',' or ']'");
        }
    }
    static const struct {
        const char *word;
        int kind;
    } words[] = {{"true", 1}, {"false", 0}, {"null", 2}};
    for (size_t k = 0; k < 3; k++) {
        size_t wn = strlen(words[k].word);
        if (p->n - p->i >= wn && memcmp(p->s + p->i, words[k].word, wn) == 0) {
            p->i += wn;
            *out = words[k].kind == 2 ? chat_v_none() : chat_v_bool(words[k].kind == 1);
            return TDM_OK;
        }
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return jp_number(p, out);
    return jp_err(p, "unexpected character");
}

int chat_json_to_val(struct render *r, const char *text, size_t len, const char *what,
                     struct val *out)
{
    struct jp p = {.r = r, .s = text, .n = len, .what = what};
    int rc = jp_value(&p, out, 0);
    if (rc != TDM_OK)
        return rc;
    jp_ws(&p);
    if (p.i != p.n)
        return jp_err(&p, "trailing characters");
    return TDM_OK;
}

// ---- dump --------------------------------------------------------------------------

static void newline_indent(struct tdm_strbuf *b, const struct tojson_opts *o, int level)
{
    tdm_strbuf_addc(b, '\n');
    for (int k = 0; k < level; k++) {
        if (o->indent_str)
            tdm_strbuf_adds(b, o->indent_str);
        else
            for (int s = 0; s < o->indent; s++)
                tdm_strbuf_addc(b, ' ');
    }
}

static bool indenting(const struct tojson_opts *o)
{
    return o->indent >= 0 || o->indent_str;
}

// Python json turns non-string keys into strings: True -> "true", 1 -> "1".
static int key_text(struct render *r, struct val k, struct tdm_strbuf *b)
{
    char num[64];
    switch (k.kind) {
    case V_STR:
        tdm_strbuf_add(b, k.u.str.s, k.u.str.n);
        return TDM_OK;
    case V_BOOL:
        tdm_strbuf_adds(b, k.u.b ? "true" : "false");
        return TDM_OK;
    case V_NONE:
        tdm_strbuf_adds(b, "null");
        return TDM_OK;
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)k.u.i);
        tdm_strbuf_adds(b, num);
        return TDM_OK;
    case V_FLOAT:
        chat_py_float_repr(k.u.f, num, sizeof num);
        tdm_strbuf_adds(b, num);
        return TDM_OK;
    default:
        return chat_rerr(r, TDM_EINVAL,
                         "tojson: keys must be str, int, float, bool or None, not %s",
                         chat_v_type_name(k));
    }
}

static int dump(struct render *r, struct val v, const struct tojson_opts *o, struct tdm_strbuf *b,
                int level)
{
    char num[64];
    if (level > CHAT_MAX_JSON_DEPTH)
        return chat_rerr(r, TDM_EINVAL, "tojson: nested deeper than %d (limit)",
                         CHAT_MAX_JSON_DEPTH);
    if (!chat_charge(r, 1) || !chat_stack_ok(r))
        return r->rc;
    switch (v.kind) {
    case V_NONE:
        tdm_strbuf_adds(b, "null");
        return TDM_OK;
    case V_BOOL:
        tdm_strbuf_adds(b, v.u.b ? "true" : "false");
        return TDM_OK;
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.u.i);
        tdm_strbuf_adds(b, num);
        return TDM_OK;
    case V_FLOAT:
        if (isnan(v.u.f))
            tdm_strbuf_adds(b, "NaN");
        else if (isinf(v.u.f))
            tdm_strbuf_adds(b, v.u.f < 0 ? "-Infinity" : "Infinity");
        else {
            chat_py_float_repr(v.u.f, num, sizeof num);
            tdm_strbuf_adds(b, num);
        }
        return TDM_OK;
    case V_STR:
        tdm_strbuf_add_json_string(b, v.u.str.s, v.u.str.n, o->ensure_ascii);
        return TDM_OK;
    case V_LIST: {
        struct vlist *l = v.u.list;
        if (l->gen || l->view)
            return chat_rerr(r, TDM_EINVAL, "tojson: Object of type %s is not JSON serializable",
                             chat_v_type_name(v));
        if (l->n == 0) {
            tdm_strbuf_adds(b, "[]");
            return TDM_OK;
        }
        tdm_strbuf_addc(b, '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                tdm_strbuf_adds(b, o->item_sep);
            if (indenting(o))
                newline_indent(b, o, level + 1);
            if (dump(r, l->items[i], o, b, level + 1) != TDM_OK)
                return r->rc;
        }
        if (indenting(o))
            newline_indent(b, o, level);
        tdm_strbuf_addc(b, ']');
        return TDM_OK;
    }
    case V_DICT: {
        struct vdict *d = v.u.dict;
        if (d->n == 0) {
            tdm_strbuf_adds(b, "{}");
            return TDM_OK;
        }
        // Key order: insertion order, or sorted (heap, so deep nesting stays cheap
        // on the stack).
        size_t *order = NULL;
        if (o->sort_keys) {
            order = malloc(d->n * sizeof *order);
            if (!order)
                return chat_rerr(r, TDM_ENOMEM, "out of memory");
            for (size_t i = 0; i < d->n; i++)
                order[i] = i;
        }
        int rc = TDM_OK;
        if (order) { // insertion sort: dicts in templates are small
            for (size_t i = 1; i < d->n && rc == TDM_OK; i++) {
                size_t k = order[i], j = i;
                while (j > 0) {
                    int cmp = 0;
                    if ((rc = chat_v_compare(r, d->keys[order[j - 1]], d->keys[k], &cmp)) != TDM_OK)
                        break;
                    if (cmp <= 0)
                        break;
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = k;
            }
        }
        if (rc == TDM_OK)
            tdm_strbuf_addc(b, '{');
        for (size_t i = 0; i < d->n && rc == TDM_OK; i++) {
            if (i)
                tdm_strbuf_adds(b, o->item_sep);
            if (indenting(o))
                newline_indent(b, o, level + 1);
            struct tdm_strbuf kb = {0};
            size_t k = order ? order[i] : i;
            rc = key_text(r, d->keys[k], &kb);
            if (rc == TDM_OK)
                tdm_strbuf_add_json_string(b, kb.p ? kb.p : "", kb.len, o->ensure_ascii);
            free(kb.p);
            if (rc == TDM_OK) {
                tdm_strbuf_adds(b, o->key_sep);
                rc = dump(r, d->vals[k], o, b, level + 1);
            }
        }
        free(order);
        if (rc != TDM_OK)
            return rc;
        if (indenting(o))
            newline_indent(b, o, level);
        tdm_strbuf_addc(b, '}');
        return TDM_OK;
    }
    default:
        return chat_rerr(r, TDM_EINVAL, "tojson: Object of type %s is not JSON serializable",
                         chat_v_type_name(v));
    }
}

int chat_val_to_json(struct render *r, struct val v, const struct tojson_opts *o,
                     struct tdm_strbuf *b)
{
    int rc = dump(r, v, o, b, 0);
    if (rc == TDM_OK && b->failed)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    if (rc == TDM_OK && b->over)
        return chat_rerr(r, TDM_ECAPACITY, "a string would exceed %u bytes (limit)",
                         CHAT_MAX_STRING);
    return rc;
}
