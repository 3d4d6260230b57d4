// SPDX-License-Identifier: Apache-2.0
// chat_lex: splits a chat template into text and tag tokens exactly as Jinja2's
// lexer does under HF's settings: newlines normalised to "\n" and one trailing
// newline dropped (keep_trailing_newline=False); trim_blocks (the first newline
// after %} or #} goes); lstrip_blocks (spaces and tabs before {% or {# on their own
// line go, where "line start" means what Jinja means: after a newline in the text,
// or right after a tag whose end match ended in a newline); '-' strips all
// whitespace on that side; '+' turns lstrip/trim off for that tag. Inside tags it
// yields names, numbers, decoded string literals and operators.
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "core.h"

struct lexer {
    struct arena *a;
    const char *s;
    size_t n, i;
    int line;
    struct token *toks;
    size_t ntoks, cap;
    char *err;
    size_t errlen;
};

static int lex_err(struct lexer *L, const char *fmt, const char *arg)
{
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    return tdm_seterr(L->err, L->errlen, TDM_EINVAL, "chat template line %d: %s", L->line, msg);
}

static int push(struct lexer *L, struct token t)
{
    if (tdm_grow(&L->toks, &L->cap, L->ntoks + 1, sizeof *L->toks, 256) != TDM_OK)
        return tdm_seterr(L->err, L->errlen, TDM_ENOMEM, "out of memory");
    t.line = t.line ? t.line : L->line;
    L->toks[L->ntoks++] = t;
    return TDM_OK;
}

static void advance(struct lexer *L, size_t to)
{
    for (; L->i < to; L->i++)
        if (L->s[L->i] == '\n')
            L->line++;
}

// Skips whitespace as Python's regex \s (Unicode) from L->i.
static void skip_ws(struct lexer *L)
{
    size_t j = L->i;
    while (j < L->n) {
        uint32_t cp;
        size_t len = tdm_utf8_next(L->s, L->n, j, &cp);
        if (!chat_py_isspace(cp))
            break;
        j += len;
    }
    advance(L, j);
}

// Length of text without its trailing Unicode whitespace (Python's str.rstrip()).
static size_t rstrip_len(const char *s, size_t n)
{
    size_t end = 0, i = 0;
    while (i < n) {
        uint32_t cp;
        size_t len = tdm_utf8_next(s, n, i, &cp);
        i += len;
        if (!chat_py_isspace(cp))
            end = i;
    }
    return end;
}

static bool is_name_start(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static bool is_digit(char c)
{
    return c >= '0' && c <= '9';
}

// Decodes a Python string literal body (unicode-escape, as Jinja does).
static int lex_string(struct lexer *L, struct token *t)
{
    char q = L->s[L->i];
    size_t j = L->i + 1;
    struct tdm_strbuf b = {0};
    int rc = TDM_OK;
    while (j < L->n && L->s[j] != q) {
        char c = L->s[j];
        if (c != '\\' || j + 1 >= L->n) {
            tdm_strbuf_addc(&b, c);
            j++;
            continue;
        }
        char e = L->s[j + 1];
        j += 2;
        uint32_t cp = 0;
        int hex = 0;
        switch (e) {
        case '\n':
            break; // line continuation
        case '\\':
        case '\'':
        case '"':
            tdm_strbuf_addc(&b, e);
            break;
        case 'a':
            tdm_strbuf_addc(&b, '\a');
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
        case 'v':
            tdm_strbuf_addc(&b, '\v');
            break;
        case 'x':
            hex = 2;
            break;
        case 'u':
            hex = 4;
            break;
        case 'U':
            hex = 8;
            break;
        case 'N':
            rc = lex_err(L, "%s", "\\N{...} escapes in string literals are not supported");
            goto done;
        default:
            if (e >= '0' && e <= '7') {
                cp = (uint32_t)(e - '0');
                for (int k = 0; k < 2 && j < L->n && L->s[j] >= '0' && L->s[j] <= '7'; k++)
                    cp = cp * 8 + (uint32_t)(L->s[j++] - '0');
                chat_utf8_put(&b, cp);
            } else {
                tdm_strbuf_addc(&b, '\\');
                tdm_strbuf_addc(&b, e);
            }
        }
        if (hex) {
            for (int k = 0; k < hex; k++, j++) {
                char h = j < L->n ? L->s[j] : 0;
                int d = is_digit(h)            ? h - '0'
                        : h >= 'a' && h <= 'f' ? h - 'a' + 10
                        : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                               : -1;
                if (d < 0) {
                    rc = lex_err(L, "%s", "truncated \\x/\\u escape in a string literal");
                    goto done;
                }
                cp = cp * 16 + (uint32_t)d;
            }
            if (cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) {
                rc = lex_err(L, "%s", "invalid code point escape in a string literal");
                goto done;
            }
            chat_utf8_put(&b, cp);
        }
    }
    if (j >= L->n) {
        rc = lex_err(L, "%s", "unterminated string literal");
        goto done;
    }
    if (b.failed) {
        rc = tdm_seterr(L->err, L->errlen, TDM_ENOMEM, "out of memory");
        goto done;
    }
    t->kind = T_STRING;
    t->n = b.len;
    t->s = chat_arena_strndup(L->a, b.p ? b.p : "", b.len);
    if (!t->s)
        rc = tdm_seterr(L->err, L->errlen, TDM_ENOMEM, "out of memory");
    advance(L, j + 1);
done:
    free(b.p);
    return rc;
}

static int lex_number(struct lexer *L, struct token *t)
{
    size_t j = L->i;
    char buf[80];
    size_t o = 0;
    bool is_float = false, too_long = false;
    // Appends to buf; a literal that does not fit is refused below rather
    // than read as a different (truncated) number.
#define PUT(c) (o < sizeof buf - 1 ? (void)(buf[o++] = (c)) : (void)(too_long = true))
    // Jinja's integer rule is [1-9](_?\d)* | 0(_?0)*: "01" is two tokens, 0 and 1,
    // unless a '.' or exponent makes it a float (floats may start with zeros).
    size_t digits_end = j;
    while (digits_end < L->n && (is_digit(L->s[digits_end]) || L->s[digits_end] == '_'))
        digits_end++;
    bool float_follows =
        digits_end < L->n &&
        (L->s[digits_end] == 'e' || L->s[digits_end] == 'E' ||
         (L->s[digits_end] == '.' && digits_end + 1 < L->n && is_digit(L->s[digits_end + 1])));
    if (L->s[j] == '0' && !float_follows) {
        while (j < L->n &&
               (L->s[j] == '0' || (L->s[j] == '_' && j + 1 < L->n && L->s[j + 1] == '0')))
            j++;
        t->kind = T_INT;
        t->i = 0;
        advance(L, j);
        return TDM_OK;
    }
    while (j < L->n && (is_digit(L->s[j]) || L->s[j] == '_')) {
        if (L->s[j] != '_')
            PUT(L->s[j]);
        j++;
    }
    if (j + 1 < L->n && L->s[j] == '.' && is_digit(L->s[j + 1]) &&
        !(L->i > 0 && L->s[L->i - 1] == '.')) {
        is_float = true;
        PUT('.');
        j++;
        while (j < L->n && (is_digit(L->s[j]) || L->s[j] == '_')) {
            if (L->s[j] != '_')
                PUT(L->s[j]);
            j++;
        }
    }
    if (j < L->n && (L->s[j] == 'e' || L->s[j] == 'E')) {
        size_t k = j + 1;
        if (k < L->n && (L->s[k] == '+' || L->s[k] == '-'))
            k++;
        if (k < L->n && is_digit(L->s[k])) {
            is_float = true;
            for (size_t m = j; m < k; m++)
                PUT(L->s[m]);
            j = k;
            while (j < L->n && is_digit(L->s[j])) {
                PUT(L->s[j]);
                j++;
            }
        }
    }
#undef PUT
    buf[o] = '\0';
    if (too_long)
        return lex_err(L, "numeric literal longer than %s characters", "79");
    _Static_assert(sizeof buf == 80, "the message above names the limit");
    if (is_float) {
        t->kind = T_FLOAT;
        t->f = strtod(buf, NULL);
    } else {
        t->kind = T_INT;
        char *end;
        errno = 0;
        long long v = strtoll(buf, &end, 10);
        if (errno == ERANGE)
            return lex_err(L, "integer literal %s is too large", buf);
        t->i = v;
    }
    advance(L, j);
    return TDM_OK;
}

static const char *const ops[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/",
                                  "*",  "%",  "~",  "[",  "]",  "(",  ")", "{", "}",
                                  ">",  "<",  "=",  ".",  ":",  "|",  ",", ";"};

// Lexes the inside of a {{ }} or {% %} tag up to and including its end.
// Sets *line_starting to whether the end match ended with a newline.
static int lex_tag(struct lexer *L, bool block, bool *line_starting)
{
    int depth = 0; // brackets open: an end delimiter inside them is not the end
    int start_line = L->line;
    while (true) {
        skip_ws(L);
        if (L->i >= L->n) {
            L->line = start_line;
            return lex_err(L, "unexpected end of template: tag opened here is never closed (%s)",
                           block ? "missing '%}'" : "missing '}}'");
        }
        const char *p = L->s + L->i;
        size_t left = L->n - L->i;
        char close = block ? '%' : '}';
        if (depth == 0) {
            bool minus = left >= 3 && p[0] == '-' && p[1] == close && p[2] == '}';
            bool plus = block && left >= 3 && p[0] == '+' && p[1] == '%' && p[2] == '}';
            bool plain = left >= 2 && p[0] == close && p[1] == '}';
            if (minus || plus || plain) {
                if (push(L, (struct token){.kind = block ? T_BLOCK_END : T_VAR_END}) != TDM_OK)
                    return TDM_ENOMEM;
                advance(L, L->i + (plain ? 2 : 3));
                size_t before = L->i;
                if (minus)
                    skip_ws(L);
                else if (plain && block && L->i < L->n && L->s[L->i] == '\n')
                    advance(L, L->i + 1); // trim_blocks
                *line_starting = L->i > before ? L->s[L->i - 1] == '\n' : false;
                return TDM_OK;
            }
        }
        struct token t = {.line = L->line};
        int rc;
        if (is_name_start(*p)) {
            size_t j = L->i;
            while (j < L->n && (is_name_start(L->s[j]) || is_digit(L->s[j])))
                j++;
            t.kind = T_NAME;
            t.s = L->s + L->i;
            t.n = j - L->i;
            advance(L, j);
        } else if (is_digit(*p)) {
            if ((rc = lex_number(L, &t)) != TDM_OK)
                return rc;
        } else if (*p == '\'' || *p == '"') {
            if ((rc = lex_string(L, &t)) != TDM_OK)
                return rc;
        } else {
            size_t k;
            for (k = 0; k < sizeof ops / sizeof ops[0]; k++) {
                size_t on = strlen(ops[k]);
                if (left >= on && memcmp(p, ops[k], on) == 0)
                    break;
            }
            if (k == sizeof ops / sizeof ops[0]) {
                char ch[8];
                snprintf(ch, sizeof ch, "%c", *p);
                return lex_err(L, "unexpected character '%s' inside a tag", ch);
            }
            t.kind = T_OP;
            memcpy(t.op, ops[k], strlen(ops[k]) + 1);
            if (t.op[1] == 0 && (t.op[0] == '(' || t.op[0] == '[' || t.op[0] == '{'))
                depth++;
            else if (t.op[1] == 0 && (t.op[0] == ')' || t.op[0] == ']' || t.op[0] == '}'))
                depth = depth > 0 ? depth - 1 : 0;
            advance(L, L->i + strlen(ops[k]));
        }
        if (push(L, t) != TDM_OK)
            return TDM_ENOMEM;
    }
}

int chat_lex(struct arena *a, const char *src, struct token **toks, size_t *ntoks, char *err,
             size_t errlen)
{
    *toks = NULL;
    *ntoks = 0;
    // Newlines to "\n", then keep_trailing_newline=False.
    size_t srclen = strlen(src);
    char *norm = chat_arena_alloc(a, srclen + 1);
    if (!norm)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < srclen; i++) {
        if (src[i] == '\r') {
            norm[n++] = '\n';
            if (i + 1 < srclen && src[i + 1] == '\n')
                i++;
        } else {
            norm[n++] = src[i];
        }
    }
    if (n > 0 && norm[n - 1] == '\n')
        n--;
    norm[n] = '\0';

    struct lexer L = {.a = a, .s = norm, .n = n, .line = 1, .err = err, .errlen = errlen};
    bool line_starting = true;
    int rc = TDM_OK;
    while (L.i < L.n) {
        // Next tag start.
        size_t j = L.i;
        while (j + 1 < L.n &&
               !(L.s[j] == '{' && (L.s[j + 1] == '{' || L.s[j + 1] == '%' || L.s[j + 1] == '#')))
            j++;
        bool at_tag = j + 1 < L.n;
        if (!at_tag)
            j = L.n;
        size_t tstart = L.i, tend = j;
        char kind = at_tag ? L.s[j + 1] : 0;
        char sign =
            at_tag && j + 2 < L.n && (L.s[j + 2] == '-' || L.s[j + 2] == '+') ? L.s[j + 2] : 0;
        if (sign == '-') {
            tend = tstart + rstrip_len(L.s + tstart, tend - tstart);
        } else if (at_tag && sign != '+' && kind != '{') {
            // lstrip_blocks
            size_t lpos = tend;
            while (lpos > tstart && L.s[lpos - 1] != '\n')
                lpos--;
            bool found_nl = lpos > tstart;
            if (found_nl || line_starting) {
                size_t k = lpos;
                while (k < tend && (L.s[k] == ' ' || L.s[k] == '\t'))
                    k++;
                if (k == tend)
                    tend = lpos;
            }
        }
        if (tend > tstart) {
            struct token t = {
                .kind = T_DATA, .s = L.s + tstart, .n = tend - tstart, .line = L.line};
            if ((rc = push(&L, t)) != TDM_OK)
                goto fail;
        }
        advance(&L, j);
        if (!at_tag)
            break;
        advance(&L, j + 2 + (sign ? 1 : 0));
        if (kind == '#') {
            size_t k = L.i;
            while (k + 1 < L.n && !(L.s[k] == '#' && L.s[k + 1] == '}'))
                k++;
            if (k + 1 >= L.n) {
                rc = lex_err(&L, "%s", "unterminated comment (missing '#}')");
                goto fail;
            }
            bool minus = k > L.i && L.s[k - 1] == '-';
            bool plus = k > L.i && L.s[k - 1] == '+';
            advance(&L, k + 2);
            size_t before = L.i;
            if (minus)
                skip_ws(&L);
            else if (!plus && L.i < L.n && L.s[L.i] == '\n')
                advance(&L, L.i + 1);
            line_starting = L.i > before ? L.s[L.i - 1] == '\n' : false;
            continue;
        }
        bool block = kind == '%';
        if ((rc = push(&L, (struct token){.kind = block ? T_BLOCK_BEGIN : T_VAR_BEGIN})) != TDM_OK)
            goto fail;
        if ((rc = lex_tag(&L, block, &line_starting)) != TDM_OK)
            goto fail;
    }
    if ((rc = push(&L, (struct token){.kind = T_EOF})) != TDM_OK)
        goto fail;
    *toks = L.toks;
    *ntoks = L.ntoks;
    return TDM_OK;
fail:
    free(L.toks);
    return rc;
}
