// SPDX-License-Identifier: Apache-2.0
// chat_value: the values a chat template computes with, and the Python semantics
// Jinja2 gives them: str() and repr() text (floats as Python's shortest repr),
// equality and ordering, truthiness. Values live in a per-render arena (chat_impl.h)
// whose byte cap stops string and list blow-up; every allocation goes through it.
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "core.h"

// ---- arena -------------------------------------------------------------------------

struct arena_chunk {
    struct arena_chunk *next;
    size_t size, used;
    _Alignas(16) unsigned char data[];
};

void *chat_arena_alloc(struct arena *a, size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (n == 0)
        n = 16;
    if (a->cap && (n > a->cap || a->used + n > a->cap))
        return NULL;
    struct arena_chunk *c = a->head;
    if (!c || c->size - c->used < n) {
        size_t size = n > 32768 ? n : 32768;
        c = malloc(sizeof *c + size);
        if (!c)
            return NULL;
        c->size = size;
        c->used = 0;
        c->next = a->head;
        a->head = c;
    }
    void *p = c->data + c->used;
    c->used += n;
    a->used += n;
    memset(p, 0, n);
    return p;
}

char *chat_arena_strndup(struct arena *a, const char *s, size_t n)
{
    char *p = chat_arena_alloc(a, n + 1);
    if (p && n)
        memcpy(p, s, n);
    return p;
}

void chat_arena_free(struct arena *a)
{
    struct arena_chunk *c = a->head;
    while (c) {
        struct arena_chunk *next = c->next;
        free(c);
        c = next;
    }
    a->head = NULL;
    a->used = 0;
}

// ---- errors and work accounting ------------------------------------------------------

int chat_rerr(struct render *r, int code, const char *fmt, ...)
{
    if (r->rc != TDM_OK)
        return r->rc; // keep the first error
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    r->rc = code;
    if (r->line > 0)
        tdm_seterr(r->err, r->errlen, code, "chat template line %d: %s", r->line, msg);
    else
        tdm_seterr(r->err, r->errlen, code, "chat template: %s", msg);
    return code;
}

bool chat_charge(struct render *r, uint64_t units)
{
    r->work += units;
    if (r->work > CHAT_MAX_WORK) {
        chat_rerr(r, TDM_ECAPACITY, "rendering took more than %llu steps (limit)",
                  (unsigned long long)CHAT_MAX_WORK);
        return false;
    }
    return true;
}

bool chat_stack_ok(struct render *r)
{
    uintptr_t here = (uintptr_t)__builtin_frame_address(0);
    size_t used = r->stack_base > here ? r->stack_base - here : here - r->stack_base;
    if (used > CHAT_MAX_STACK) {
        chat_rerr(r, TDM_ECAPACITY, "the template recursed past %u KiB of stack (limit)",
                  CHAT_MAX_STACK >> 10);
        return false;
    }
    return true;
}

// ---- constructors ------------------------------------------------------------------

struct val chat_v_undef(const char *name)
{
    return (struct val){.kind = V_UNDEF, .u.undef_name = name};
}
struct val chat_v_none(void)
{
    return (struct val){.kind = V_NONE};
}
struct val chat_v_bool(bool b)
{
    return (struct val){.kind = V_BOOL, .u.b = b};
}
struct val chat_v_int(int64_t i)
{
    return (struct val){.kind = V_INT, .u.i = i};
}
struct val chat_v_float(double f)
{
    return (struct val){.kind = V_FLOAT, .u.f = f};
}
struct val chat_v_strn(const char *s, size_t n)
{
    return (struct val){.kind = V_STR, .u.str = {s, n}};
}

int chat_v_str_copy(struct render *r, const char *s, size_t n, struct val *out)
{
    if (n > CHAT_MAX_STRING)
        return chat_rerr(r, TDM_ECAPACITY, "a string would exceed %u bytes (limit)",
                         CHAT_MAX_STRING);
    char *p = chat_arena_strndup(&r->arena, s, n);
    if (!p)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    if (!chat_charge(r, n / 16))
        return r->rc;
    *out = chat_v_strn(p, n);
    return TDM_OK;
}

int chat_sb_to_val(struct render *r, struct tdm_strbuf *b, struct val *out)
{
    if (b->failed)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    if (b->over)
        return chat_rerr(r, TDM_ECAPACITY, "a string would exceed %u bytes (limit)",
                         CHAT_MAX_STRING);
    int rc = chat_v_str_copy(r, b->p ? b->p : "", b->len, out);
    b->len = 0;
    return rc;
}

static int grow(struct render *r, void **items, size_t elem, size_t *cap, size_t want)
{
    if (want <= *cap)
        return TDM_OK;
    size_t ncap = *cap ? *cap * 2 : 4;
    while (ncap < want)
        ncap *= 2;
    void *p = chat_arena_alloc(&r->arena, ncap * elem);
    if (!p)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    if (*cap)
        memcpy(p, *items, *cap * elem);
    *items = p;
    *cap = ncap;
    return TDM_OK;
}

int chat_v_list_new(struct render *r, size_t cap, struct val *out)
{
    struct vlist *l = chat_arena_alloc(&r->arena, sizeof *l);
    if (!l)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    if (cap && grow(r, (void **)&l->items, sizeof *l->items, &l->cap, cap) != TDM_OK)
        return r->rc;
    *out = (struct val){.kind = V_LIST, .u.list = l};
    return TDM_OK;
}

int chat_v_list_push(struct render *r, struct vlist *l, struct val v)
{
    if (grow(r, (void **)&l->items, sizeof *l->items, &l->cap, l->n + 1) != TDM_OK)
        return r->rc;
    l->items[l->n++] = v;
    return TDM_OK;
}

int chat_v_dict_new(struct render *r, struct val *out)
{
    struct vdict *d = chat_arena_alloc(&r->arena, sizeof *d);
    if (!d)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    *out = (struct val){.kind = V_DICT, .u.dict = d};
    return TDM_OK;
}

static size_t dict_index(const struct vdict *d, struct val key)
{
    for (size_t i = 0; i < d->n; i++)
        if (chat_v_equal(d->keys[i], key))
            return i;
    return SIZE_MAX;
}

int chat_v_dict_set(struct render *r, struct vdict *d, struct val key, struct val v)
{
    size_t i = dict_index(d, key);
    if (i != SIZE_MAX) {
        d->vals[i] = v;
        return TDM_OK;
    }
    size_t kcap = d->cap;
    if (grow(r, (void **)&d->keys, sizeof *d->keys, &kcap, d->n + 1) != TDM_OK ||
        grow(r, (void **)&d->vals, sizeof *d->vals, &d->cap, d->n + 1) != TDM_OK)
        return r->rc;
    d->keys[d->n] = key;
    d->vals[d->n] = v;
    d->n++;
    return TDM_OK;
}

bool chat_v_dict_get(const struct vdict *d, const char *key, size_t n, struct val *out)
{
    for (size_t i = 0; i < d->n; i++) {
        const struct val *k = &d->keys[i];
        if (k->kind == V_STR && k->u.str.n == n && memcmp(k->u.str.s, key, n) == 0) {
            *out = d->vals[i];
            return true;
        }
    }
    return false;
}

bool chat_v_dict_find(const struct vdict *d, struct val key, struct val *out)
{
    size_t i = dict_index(d, key);
    if (i == SIZE_MAX)
        return false;
    *out = d->vals[i];
    return true;
}

// ---- Python semantics ----------------------------------------------------------------

bool chat_v_truthy(struct val v)
{
    switch (v.kind) {
    case V_UNDEF:
    case V_NONE:
        return false;
    case V_BOOL:
        return v.u.b;
    case V_INT:
        return v.u.i != 0;
    case V_FLOAT:
        return v.u.f != 0;
    case V_STR:
        return v.u.str.n != 0;
    case V_LIST:
        return v.u.list->gen || v.u.list->n != 0;
    case V_DICT:
        return v.u.dict->n != 0;
    default:
        return true;
    }
}

static bool is_num(struct val v)
{
    return v.kind == V_BOOL || v.kind == V_INT || v.kind == V_FLOAT;
}

static double num_f(struct val v)
{
    return v.kind == V_FLOAT ? v.u.f : v.kind == V_INT ? (double)v.u.i : (double)v.u.b;
}

static int64_t num_i(struct val v)
{
    return v.kind == V_INT ? v.u.i : (int64_t)v.u.b;
}

bool chat_v_equal(struct val a, struct val b)
{
    if (is_num(a) && is_num(b)) {
        if (a.kind == V_FLOAT || b.kind == V_FLOAT)
            return num_f(a) == num_f(b);
        return num_i(a) == num_i(b);
    }
    if (a.kind != b.kind)
        return false;
    switch (a.kind) {
    case V_UNDEF:
    case V_NONE:
        return true;
    case V_STR:
        return a.u.str.n == b.u.str.n && memcmp(a.u.str.s, b.u.str.s, a.u.str.n) == 0;
    case V_LIST:
        if (a.u.list->gen || b.u.list->gen || a.u.list->view || b.u.list->view)
            return a.u.list == b.u.list;
        if (a.u.list->n != b.u.list->n || a.u.list->tuple != b.u.list->tuple)
            return false;
        for (size_t i = 0; i < a.u.list->n; i++)
            if (!chat_v_equal(a.u.list->items[i], b.u.list->items[i]))
                return false;
        return true;
    case V_DICT:
        if (a.u.dict->n != b.u.dict->n)
            return false;
        for (size_t i = 0; i < a.u.dict->n; i++) {
            struct val o;
            if (!chat_v_dict_find(b.u.dict, a.u.dict->keys[i], &o) ||
                !chat_v_equal(a.u.dict->vals[i], o))
                return false;
        }
        return true;
    case V_NS:
        return a.u.dict == b.u.dict;
    case V_MACRO:
        return a.u.macro == b.u.macro;
    case V_FUNC:
        return a.u.func == b.u.func;
    default:
        return false;
    }
}

const char *chat_v_type_name(struct val v)
{
    switch (v.kind) {
    case V_UNDEF:
        return "Undefined";
    case V_NONE:
        return "NoneType";
    case V_BOOL:
        return "bool";
    case V_INT:
        return "int";
    case V_FLOAT:
        return "float";
    case V_STR:
        return "str";
    case V_LIST:
        return v.u.list->gen     ? "generator"
               : v.u.list->view  ? "dict_view"
               : v.u.list->tuple ? "tuple"
                                 : "list";
    case V_DICT:
        return "dict";
    case V_NS:
        return "Namespace";
    case V_MACRO:
        return "Macro";
    case V_FUNC:
        return "function";
    case V_METHOD:
        return "builtin_function_or_method";
    case V_LOOP:
        return "LoopContext";
    }
    return "?";
}

int chat_v_compare(struct render *r, struct val a, struct val b, int *cmp)
{
    if (is_num(a) && is_num(b)) {
        if (a.kind == V_FLOAT || b.kind == V_FLOAT) {
            double x = num_f(a), y = num_f(b);
            *cmp = x < y ? -1 : x > y ? 1 : 0;
        } else {
            int64_t x = num_i(a), y = num_i(b);
            *cmp = x < y ? -1 : x > y ? 1 : 0;
        }
        return TDM_OK;
    }
    if (a.kind == V_STR && b.kind == V_STR) {
        size_t n = a.u.str.n < b.u.str.n ? a.u.str.n : b.u.str.n;
        int c = n ? memcmp(a.u.str.s, b.u.str.s, n) : 0;
        if (c == 0)
            c = a.u.str.n < b.u.str.n ? -1 : a.u.str.n > b.u.str.n ? 1 : 0;
        *cmp = c < 0 ? -1 : c > 0;
        return TDM_OK;
    }
    if (a.kind == V_LIST && b.kind == V_LIST) {
        size_t n = a.u.list->n < b.u.list->n ? a.u.list->n : b.u.list->n;
        for (size_t i = 0; i < n; i++) {
            if (chat_v_equal(a.u.list->items[i], b.u.list->items[i]))
                continue;
            return chat_v_compare(r, a.u.list->items[i], b.u.list->items[i], cmp);
        }
        *cmp = a.u.list->n < b.u.list->n ? -1 : a.u.list->n > b.u.list->n;
        return TDM_OK;
    }
    if (a.kind == V_UNDEF || b.kind == V_UNDEF)
        return chat_rerr(r, TDM_EINVAL, "'%s' is undefined",
                         (a.kind == V_UNDEF ? a : b).u.undef_name
                             ? (a.kind == V_UNDEF ? a : b).u.undef_name
                             : "value");
    return chat_rerr(r, TDM_EINVAL, "'<' not supported between instances of '%s' and '%s'",
                     chat_v_type_name(a), chat_v_type_name(b));
}

// ---- text ----------------------------------------------------------------------------

// Python's repr(float): the shortest digits that round-trip, fixed notation for
// decimal exponents in (-4, 16], scientific with a two-digit exponent otherwise.
void chat_py_float_repr(double f, char *buf, size_t n)
{
    if (isnan(f)) {
        snprintf(buf, n, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, n, f < 0 ? "-inf" : "inf");
        return;
    }
    char tmp[40];
    int prec;
    for (prec = 1; prec <= 17; prec++) {
        snprintf(tmp, sizeof tmp, "%.*e", prec - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    // tmp: [-]d[.ddd]e[+-]XX
    bool neg = tmp[0] == '-';
    const char *p = tmp + neg;
    char digits[24];
    size_t nd = 0;
    for (; *p && *p != 'e'; p++)
        if (*p != '.')
            digits[nd++] = *p;
    digits[nd] = '\0';
    int exp10 = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        digits[--nd] = '\0';
    int decpt = exp10 + 1;
    char out[64];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int k = 0; k < -decpt; k++)
                out[o++] = '0';
            memcpy(out + o, digits, nd);
            o += nd;
        } else if ((size_t)decpt >= nd) {
            memcpy(out + o, digits, nd);
            o += nd;
            for (size_t k = nd; k < (size_t)decpt; k++)
                out[o++] = '0';
            out[o++] = '.';
            out[o++] = '0';
        } else {
            memcpy(out + o, digits, (size_t)decpt);
            o += (size_t)decpt;
            out[o++] = '.';
            memcpy(out + o, digits + decpt, nd - (size_t)decpt);
            o += nd - (size_t)decpt;
        }
        out[o] = '\0';
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            memcpy(out + o, digits + 1, nd - 1);
            o += nd - 1;
        }
        out[o] = '\0';
        snprintf(out + o, sizeof out - o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    snprintf(buf, n, "%s", out);
}

size_t chat_utf8_len(const char *s, size_t n)
{
    size_t count = 0;
    uint32_t cp;
    for (size_t i = 0; i < n; i += tdm_utf8_next(s, n, i, &cp))
        count++;
    return count;
}

void chat_utf8_put(struct tdm_strbuf *b, uint32_t cp)
{
    char buf[4];
    tdm_strbuf_add(b, buf, (size_t)tdm_utf8_encode(cp, buf));
}

// Python's str.isspace() for one code point.
bool chat_py_isspace(uint32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// markupsafe.escape: & < > " ' become entities.
void chat_html_escape(struct tdm_strbuf *b, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        switch (s[i]) {
        case '&':
            tdm_strbuf_adds(b, "&amp;");
            break;
        case '<':
            tdm_strbuf_adds(b, "&lt;");
            break;
        case '>':
            tdm_strbuf_adds(b, "&gt;");
            break;
        case '"':
            tdm_strbuf_adds(b, "&#34;");
            break;
        case '\'':
            tdm_strbuf_adds(b, "&#39;");
            break;
        default:
            tdm_strbuf_addc(b, s[i]);
        }
    }
}

static void str_repr(struct tdm_strbuf *b, const char *s, size_t n)
{
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = has_sq && !has_dq ? '"' : '\'';
    tdm_strbuf_addc(b, q);
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_next(s, n, i, &cp);
        char esc[12];
        if (cp == (uint32_t)q || cp == '\\') {
            tdm_strbuf_addc(b, '\\');
            tdm_strbuf_addc(b, (char)cp);
        } else if (cp == '\n') {
            tdm_strbuf_adds(b, "\\n");
        } else if (cp == '\r') {
            tdm_strbuf_adds(b, "\\r");
        } else if (cp == '\t') {
            tdm_strbuf_adds(b, "\\t");
        } else if (cp < 0x20 || (cp >= 0x7F && cp <= 0xA0) || cp == 0xAD) {
            snprintf(esc, sizeof esc, "\\x%02x", cp);
            tdm_strbuf_adds(b, esc);
        } else if ((cp >= 0x2028 && cp <= 0x202F && cp != 0x202F) || cp == 0x2060 || cp == 0xFEFF ||
                   (cp >= 0x200B && cp <= 0x200F)) {
            snprintf(esc, sizeof esc, "\\u%04x", cp);
            tdm_strbuf_adds(b, esc);
        } else {
            tdm_strbuf_add(b, s + i, len);
        }
        i += len;
    }
    tdm_strbuf_addc(b, q);
}

static int text_or_repr(struct render *r, struct val v, struct tdm_strbuf *b, bool repr)
{
    char num[64];
    if (!chat_charge(r, 1) || !chat_stack_ok(r))
        return r->rc;
    switch (v.kind) {
    case V_UNDEF:
        if (repr) // repr(jinja2.Undefined()), e.g. inside a printed dict
            tdm_strbuf_adds(b, "Undefined");
        return TDM_OK;
    case V_NONE:
        tdm_strbuf_adds(b, "None");
        return TDM_OK;
    case V_BOOL:
        tdm_strbuf_adds(b, v.u.b ? "True" : "False");
        return TDM_OK;
    case V_INT:
        snprintf(num, sizeof num, "%lld", (long long)v.u.i);
        tdm_strbuf_adds(b, num);
        return TDM_OK;
    case V_FLOAT:
        chat_py_float_repr(v.u.f, num, sizeof num);
        tdm_strbuf_adds(b, num);
        return TDM_OK;
    case V_STR:
        if (repr)
            str_repr(b, v.u.str.s, v.u.str.n);
        else
            tdm_strbuf_add(b, v.u.str.s, v.u.str.n);
        return TDM_OK;
    case V_LIST: {
        struct vlist *l = v.u.list;
        if (l->gen || l->view) // Python prints an address or a view type here
            return chat_rerr(r, TDM_EINVAL, "cannot convert a %s to text", chat_v_type_name(v));
        tdm_strbuf_addc(b, l->tuple ? '(' : '[');
        for (size_t i = 0; i < l->n; i++) {
            if (i)
                tdm_strbuf_adds(b, ", ");
            if (text_or_repr(r, l->items[i], b, true) != TDM_OK)
                return r->rc;
        }
        if (l->tuple && l->n == 1)
            tdm_strbuf_addc(b, ',');
        tdm_strbuf_addc(b, l->tuple ? ')' : ']');
        return TDM_OK;
    }
    case V_DICT: {
        struct vdict *d = v.u.dict;
        tdm_strbuf_addc(b, '{');
        for (size_t i = 0; i < d->n; i++) {
            if (i)
                tdm_strbuf_adds(b, ", ");
            if (text_or_repr(r, d->keys[i], b, true) != TDM_OK)
                return r->rc;
            tdm_strbuf_adds(b, ": ");
            if (text_or_repr(r, d->vals[i], b, true) != TDM_OK)
                return r->rc;
        }
        tdm_strbuf_addc(b, '}');
        return TDM_OK;
    }
    default:
        // Python would print an object address here: no byte-identical text exists.
        return chat_rerr(r, TDM_EINVAL, "cannot convert a %s to text", chat_v_type_name(v));
    }
}

int chat_v_to_text(struct render *r, struct val v, struct tdm_strbuf *b)
{
    int rc = text_or_repr(r, v, b, false);
    if (rc == TDM_OK && b->failed)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    if (rc == TDM_OK && b->over)
        return chat_rerr(r, TDM_ECAPACITY, "output would exceed %zu bytes (limit)", b->limit);
    return rc;
}

int chat_v_repr(struct render *r, struct val v, struct tdm_strbuf *b)
{
    return text_or_repr(r, v, b, true);
}

int chat_v_stringify(struct render *r, struct val v, struct val *out)
{
    if (v.kind == V_STR) {
        *out = v;
        return TDM_OK;
    }
    struct tdm_strbuf b = {.limit = CHAT_MAX_STRING};
    int rc = chat_v_to_text(r, v, &b);
    if (rc == TDM_OK)
        rc = chat_sb_to_val(r, &b, out);
    free(b.p);
    return rc;
}
