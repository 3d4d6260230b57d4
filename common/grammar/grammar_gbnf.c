// SPDX-License-Identifier: Apache-2.0
// grammar_gbnf: llama.cpp's GBNF into grammar rules. Syntax: rules
// `name ::= body` (names [A-Za-z0-9_-]+, start rule `root`), bodies of
// "strings" (escapes \n \t \r \\ \" \[ \] \xHH \uHHHH \UHHHHHHHH), [classes]
// and '.' (the regex compiler's syntax and limits: ASCII ranges, UTF-8
// members), rule names, ( groups ), |, and ? * + {m} {m,} {m,n}; `#` comments.
// A rule ends where the next line starts `name ::=` (so alternatives may go on
// continuation lines). Refused with a message: an undefined or doubly defined
// rule, no root, and left recursion through a pushing (non-tail) reference,
// which a stack machine cannot run (`expr ::= expr "+" term`); rewrite it as
// repetition (`expr ::= term ("+" term)*`).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

struct gbnf_name {
    const char *name;
    size_t len;
    int rule;
    bool defined;
};

struct gbnf {
    struct gb b;
    const char *start, *p, *end;
    struct gbnf_name *names;
    size_t n_names, cap_names;
    int depth;
};

static int gf_fail(struct gbnf *c, const char *what)
{
    int line = 1;
    for (const char *q = c->start; q < c->p && q < c->end; q++)
        line += *q == '\n';
    return gb_fail(&c->b, TDM_EINVAL, "gbnf line %d: %s", line, what);
}

static bool name_char(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           ch == '-' || ch == '_';
}

static int name_rule(struct gbnf *c, const char *name, size_t len, bool define)
{
    for (size_t i = 0; i < c->n_names; i++)
        if (c->names[i].len == len && !memcmp(c->names[i].name, name, len)) {
            if (define) {
                if (c->names[i].defined) {
                    gf_fail(c, "rule defined twice");
                    return -1;
                }
                c->names[i].defined = true;
            }
            return c->names[i].rule;
        }
    if (tdm_grow(&c->names, &c->cap_names, c->n_names + 1, sizeof *c->names, 16) != TDM_OK) {
        gb_fail(&c->b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    int r = gb_rule_new(&c->b);
    c->names[c->n_names++] = (struct gbnf_name){name, len, r, define};
    return r;
}

// Skips spaces, tabs and comments; newlines too when nested or when the next
// line does not start a new rule.
static void skip_space(struct gbnf *c, bool nested)
{
    for (;;) {
        while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\r'))
            c->p++;
        if (c->p < c->end && *c->p == '#') {
            while (c->p < c->end && *c->p != '\n')
                c->p++;
            continue;
        }
        if (c->p >= c->end || *c->p != '\n')
            return;
        if (!nested) {
            // Look past blank lines and comments: a new rule or the end stops here.
            const char *q = c->p;
            for (;;) {
                while (q < c->end && (*q == ' ' || *q == '\t' || *q == '\r' || *q == '\n'))
                    q++;
                if (q < c->end && *q == '#') {
                    while (q < c->end && *q != '\n')
                        q++;
                    continue;
                }
                break;
            }
            if (q >= c->end)
                return;
            const char *n = q;
            while (n < c->end && name_char(*n))
                n++;
            while (n < c->end && (*n == ' ' || *n == '\t'))
                n++;
            if (n > q && c->end - n >= 3 && !memcmp(n, "::=", 3))
                return;
        }
        c->p++;
    }
}

static int64_t hex_escape(struct gbnf *c, int digits)
{
    uint32_t v = 0;
    for (int i = 0; i < digits; i++) {
        char h = c->p < c->end ? *c->p : 0;
        int d = h >= '0' && h <= '9'                     ? h - '0'
                : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10
                                                         : -1;
        if (d < 0) {
            gf_fail(c, "bad hex escape");
            return -1;
        }
        v = v * 16 + (uint32_t)d;
        c->p++;
    }
    if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
        gf_fail(c, "escape is not a Unicode scalar value");
        return -1;
    }
    return v;
}

static void emit_utf8(struct gbnf *c, struct gb_seq *s, uint32_t cp)
{
    char buf[4];
    gb_seq_lit(&c->b, s, buf, (size_t)tdm_utf8_encode(cp, buf));
}

static void parse_string(struct gbnf *c, struct gb_seq *s)
{
    c->p++; // opening quote
    while (!c->b.err) {
        if (c->p >= c->end || *c->p == '\n') {
            gf_fail(c, "unterminated string");
            return;
        }
        char ch = *c->p++;
        if (ch == '"')
            return;
        if (ch != '\\') {
            gb_seq_byte(&c->b, s, (uint8_t)ch);
            continue;
        }
        if (c->p >= c->end) {
            gf_fail(c, "unterminated string");
            return;
        }
        char e = *c->p++;
        int64_t cp;
        switch (e) {
        case 'n':
            cp = '\n';
            break;
        case 't':
            cp = '\t';
            break;
        case 'r':
            cp = '\r';
            break;
        case '\\':
        case '"':
        case '[':
        case ']':
            cp = e;
            break;
        case 'x':
            cp = hex_escape(c, 2);
            break;
        case 'u':
            cp = hex_escape(c, 4);
            break;
        case 'U':
            cp = hex_escape(c, 8);
            break;
        default:
            gf_fail(c, "unknown escape in string");
            return;
        }
        if (cp < 0)
            return;
        emit_utf8(c, s, (uint32_t)cp);
    }
}

static void parse_alternates(struct gbnf *c, int rule, bool nested);

static bool parse_braces(struct gbnf *c, long *min, long *max)
{
    const char *q = c->p + 1;
    long a = 0, b2 = -1;
    int d = 0;
    while (q < c->end && *q == ' ')
        q++;
    while (q < c->end && *q >= '0' && *q <= '9' && d < 9)
        a = a * 10 + (*q++ - '0'), d++;
    if (!d)
        return false;
    while (q < c->end && *q == ' ')
        q++;
    if (q < c->end && *q == ',') {
        q++;
        while (q < c->end && *q == ' ')
            q++;
        int d2 = 0;
        long v = 0;
        while (q < c->end && *q >= '0' && *q <= '9' && d2 < 9)
            v = v * 10 + (*q++ - '0'), d2++;
        b2 = d2 ? v : -1;
    } else {
        b2 = a;
    }
    while (q < c->end && *q == ' ')
        q++;
    if (q >= c->end || *q != '}')
        return false;
    c->p = q + 1;
    *min = a;
    *max = b2;
    return true;
}

// One sequence (elements with quantifiers) into s.
static void parse_sequence(struct gbnf *c, struct gb_seq *s, bool nested)
{
    struct gb *b = &c->b;
    while (!b->err) {
        skip_space(c, nested);
        if (c->p >= c->end || *c->p == '|' || *c->p == ')' || *c->p == '\n')
            return;
        struct gb_seq x = {0};
        char ch = *c->p;
        if (ch == '"') {
            parse_string(c, &x);
        } else if (ch == '[' || ch == '.') {
            gr_regex_piece(b, &x, c->start, &c->p, c->end);
        } else if (ch == '(') {
            c->p++;
            if (++c->depth > 256) {
                gf_fail(c, "groups nested deeper than 256");
                gb_seq_free(&x);
                return;
            }
            int r = gb_rule_new(b);
            parse_alternates(c, r, true);
            c->depth--;
            if (!b->err && (c->p >= c->end || *c->p != ')'))
                gf_fail(c, "missing )");
            c->p++;
            gb_seq_ref(b, &x, r);
        } else if (name_char(ch)) {
            const char *n = c->p;
            while (c->p < c->end && name_char(*c->p))
                c->p++;
            gb_seq_ref(b, &x, name_rule(c, n, (size_t)(c->p - n), false));
        } else {
            gf_fail(c, "unexpected character");
            return;
        }
        // Quantifiers.
        while (!b->err && c->p < c->end) {
            long min, max;
            char q = *c->p;
            if (q == '?' || q == '*' || q == '+') {
                c->p++;
                min = q == '+';
                max = q == '?' ? 1 : -1;
            } else if (q == '{' && parse_braces(c, &min, &max)) {
            } else {
                break;
            }
            struct gb_seq y = {0};
            gb_seq_repeat(b, &y, &x, min, max);
            gb_seq_free(&x);
            x = y;
        }
        gb_seq_cat(b, s, &x);
        gb_seq_free(&x);
    }
}

static void parse_alternates(struct gbnf *c, int rule, bool nested)
{
    for (;;) {
        struct gb_seq s = {0};
        parse_sequence(c, &s, nested);
        gb_rule_add(&c->b, rule, &s);
        gb_seq_free(&s);
        if (c->b.err || c->p >= c->end || *c->p != '|')
            return;
        c->p++;
    }
}

// ---- left recursion -----------------------------------------------------------------------
// Edges A -> B where B can come first in A (after nullable elements only); an
// edge is "pushing" when B is not the last element of its alternative. A cycle
// through a pushing edge would grow the stack without consuming input.
static bool reaches(const struct gb *b, const uint8_t *nullable, int from, int to, uint8_t *seen)
{
    if (from == to)
        return true;
    if (seen[from])
        return false;
    seen[from] = 1;
    const struct gb_rule *r = &b->rules[from];
    for (size_t a = 0; a < r->n_alts; a++)
        for (size_t i = 0; i < r->alts[a].n; i++) {
            const struct gr_el *e = &r->alts[a].v[i];
            if (e->kind != EL_REF)
                break;
            if (reaches(b, nullable, e->arg, to, seen))
                return true;
            if (!nullable[e->arg])
                break;
        }
    return false;
}

static int check_left_recursion(struct gbnf *c)
{
    struct gb *b = &c->b;
    size_t n = b->n_rules;
    uint8_t *nullable = calloc(n ? n : 1, 1), *seen = calloc(n ? n : 1, 1);
    if (!nullable || !seen) {
        free(nullable), free(seen);
        return gb_fail(b, TDM_ENOMEM, "out of memory");
    }
    for (bool changed = true; changed;) {
        changed = false;
        for (size_t r = 0; r < n; r++) {
            if (nullable[r])
                continue;
            for (size_t a = 0; a < b->rules[r].n_alts && !nullable[r]; a++) {
                bool all = true;
                for (size_t i = 0; i < b->rules[r].alts[a].n && all; i++) {
                    const struct gr_el *e = &b->rules[r].alts[a].v[i];
                    all = e->kind == EL_REF && nullable[e->arg];
                }
                if (all)
                    nullable[r] = 1, changed = true;
            }
        }
    }
    for (size_t r = 0; r < n && !b->err; r++)
        for (size_t a = 0; a < b->rules[r].n_alts && !b->err; a++) {
            const struct gb_seq *s = &b->rules[r].alts[a];
            for (size_t i = 0; i < s->n; i++) {
                const struct gr_el *e = &s->v[i];
                if (e->kind != EL_REF)
                    break;
                if (i + 1 < s->n) { // pushing edge r -> e->arg
                    memset(seen, 0, n);
                    if (reaches(b, nullable, e->arg, (int)r, seen)) {
                        const char *name = "(a group)";
                        size_t len = strlen(name);
                        for (size_t k = 0; k < c->n_names; k++)
                            if (c->names[k].rule == (int)r)
                                name = c->names[k].name, len = c->names[k].len;
                        gb_fail(b, TDM_EINVAL,
                                "gbnf: rule %.*s is left-recursive (rewrite it with * or +)",
                                (int)(len > 64 ? 64 : len), name);
                        break;
                    }
                }
                if (!nullable[e->arg])
                    break;
            }
        }
    free(nullable);
    free(seen);
    return b->err;
}

int tdm_grammar_compile_gbnf(struct tdm_grammar **out, const char *text, size_t len, char *err,
                             size_t errlen)
{
    *out = NULL;
    if (len > TDM_GRAMMAR_MAX_GBNF_BYTES)
        return tdm_seterr(err, errlen, TDM_EINVAL, "gbnf: %zu bytes (at most %u)", len,
                          TDM_GRAMMAR_MAX_GBNF_BYTES);
    struct gbnf c = {.start = text, .p = text, .end = text + len};
    gb_init(&c.b);
    while (!c.b.err) {
        skip_space(&c, true);
        if (c.p >= c.end)
            break;
        const char *n = c.p;
        while (c.p < c.end && name_char(*c.p))
            c.p++;
        size_t nlen = (size_t)(c.p - n);
        while (c.p < c.end && (*c.p == ' ' || *c.p == '\t'))
            c.p++;
        if (!nlen || c.end - c.p < 3 || memcmp(c.p, "::=", 3)) {
            gf_fail(&c, "expected `name ::=`");
            break;
        }
        c.p += 3;
        int r = name_rule(&c, n, nlen, true);
        if (r < 0)
            break;
        parse_alternates(&c, r, false);
        if (!c.b.err && c.p < c.end && *c.p == ')')
            gf_fail(&c, "unmatched )");
    }
    int root = -1;
    for (size_t i = 0; i < c.n_names && !c.b.err; i++) {
        if (!c.names[i].defined) {
            gb_fail(&c.b, TDM_EINVAL, "gbnf: rule %.*s is used but not defined",
                    (int)(c.names[i].len > 64 ? 64 : c.names[i].len), c.names[i].name);
            break;
        }
        if (c.names[i].len == 4 && !memcmp(c.names[i].name, "root", 4))
            root = c.names[i].rule;
    }
    if (!c.b.err && root < 0)
        gb_fail(&c.b, TDM_EINVAL, "gbnf: no root rule");
    if (!c.b.err)
        check_left_recursion(&c);
    int rc = gb_finish(&c.b, root, out, err, errlen);
    free(c.names);
    gb_fini(&c.b);
    return rc;
}
