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
    uint32_t *slots; // [cap_slots] 1 + index into names by name hash (0: empty)
    size_t cap_slots;
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

static uint64_t name_hash(const char *name, size_t len)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < len; i++)
        h = (h ^ (unsigned char)name[i]) * 1099511628211ull;
    return h;
}

// Keeps slots at most half full: a grammar of 60 000 rules names each in O(1)
// (a linear search made a 1 MB grammar take seconds per compile).
static bool slots_grow(struct gbnf *c)
{
    if (2 * (c->n_names + 1) <= c->cap_slots)
        return true;
    size_t cap = c->cap_slots ? 2 * c->cap_slots : 64;
    uint32_t *slots = calloc(cap, sizeof *slots);
    if (!slots)
        return false;
    for (size_t i = 0; i < c->n_names; i++) {
        size_t k = name_hash(c->names[i].name, c->names[i].len) & (cap - 1);
        while (slots[k])
            k = (k + 1) & (cap - 1);
        slots[k] = (uint32_t)i + 1;
    }
    free(c->slots);
    c->slots = slots;
    c->cap_slots = cap;
    return true;
}

static int name_rule(struct gbnf *c, const char *name, size_t len, bool define)
{
    if (!slots_grow(c)) {
        gb_fail(&c->b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    size_t k = name_hash(name, len) & (c->cap_slots - 1);
    for (; c->slots[k]; k = (k + 1) & (c->cap_slots - 1)) {
        struct gbnf_name *nm = &c->names[c->slots[k] - 1];
        if (nm->len == len && !memcmp(nm->name, name, len)) {
            if (define) {
                if (nm->defined) {
                    gf_fail(c, "rule defined twice");
                    return -1;
                }
                nm->defined = true;
            }
            return nm->rule;
        }
    }
    if (tdm_grow(&c->names, &c->cap_names, c->n_names + 1, sizeof *c->names, 16) != TDM_OK) {
        gb_fail(&c->b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    int r = gb_rule_new(&c->b);
    c->slots[k] = (uint32_t)c->n_names + 1;
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
// through a pushing edge would grow the stack without consuming input: the
// pushing edge r -> x closes such a cycle exactly when x reaches r, that is
// when both are in one strongly connected component of the first-position
// graph. The components come from Tarjan's algorithm run with an explicit
// stack: a chain of rules as long as the text allows is no recursion here,
// and the check is linear in rules and edges.
struct first_graph {
    size_t *start; // [n + 1] edges of rule r: to[start[r] .. start[r + 1])
    int *to;
};

// The number of first-position edges of rule r; their targets go to to[] unless NULL.
static size_t first_edges(const struct gb *b, const uint8_t *nullable, size_t r, int *to)
{
    size_t k = 0;
    const struct gb_rule *rule = &b->rules[r];
    for (size_t a = 0; a < rule->n_alts; a++)
        for (size_t i = 0; i < rule->alts[a].n; i++) {
            const struct gr_el *e = &rule->alts[a].v[i];
            if (e->kind != EL_REF)
                break;
            if (to)
                to[k] = e->arg;
            k++;
            if (!nullable[e->arg])
                break;
        }
    return k;
}

// comp[r]: rule r's component (rules of one component share a number).
static int components(const struct gb *b, const uint8_t *nullable, int *comp)
{
    size_t n = b->n_rules;
    struct first_graph g = {calloc(n + 1, sizeof *g.start), NULL};
    int *index = malloc((n ? n : 1) * sizeof *index), *low = malloc((n ? n : 1) * sizeof *low);
    int *stack = malloc((n ? n : 1) * sizeof *stack), *call = malloc((n ? n : 1) * sizeof *call);
    size_t *edge = malloc((n ? n : 1) * sizeof *edge);
    uint8_t *on = calloc(n ? n : 1, 1);
    int rc = TDM_ENOMEM;
    if (!g.start || !index || !low || !stack || !call || !edge || !on)
        goto out;
    for (size_t r = 0; r < n; r++)
        g.start[r + 1] = g.start[r] + first_edges(b, nullable, r, NULL);
    g.to = malloc((g.start[n] ? g.start[n] : 1) * sizeof *g.to);
    if (!g.to)
        goto out;
    for (size_t r = 0; r < n; r++)
        first_edges(b, nullable, r, g.to + g.start[r]);
    for (size_t r = 0; r < n; r++)
        index[r] = -1;
    int next = 0, n_comp = 0;
    size_t sp = 0, cp = 0; // Tarjan's stack; the explicit call stack
    for (size_t root = 0; root < n; root++) {
        if (index[root] >= 0)
            continue;
        call[cp++] = (int)root;
        index[root] = low[root] = next++;
        edge[root] = g.start[root];
        stack[sp++] = (int)root, on[root] = 1;
        while (cp) {
            int v = call[cp - 1];
            if (edge[v] < g.start[v + 1]) {
                int w = g.to[edge[v]++];
                if (index[w] < 0) {
                    index[w] = low[w] = next++;
                    edge[w] = g.start[w];
                    stack[sp++] = w, on[w] = 1;
                    call[cp++] = w;
                } else if (on[w] && index[w] < low[v]) {
                    low[v] = index[w];
                }
                continue;
            }
            cp--;
            if (cp && low[v] < low[call[cp - 1]])
                low[call[cp - 1]] = low[v];
            if (low[v] == index[v]) {
                int w;
                do {
                    w = stack[--sp];
                    on[w] = 0;
                    comp[w] = n_comp;
                } while (w != v);
                n_comp++;
            }
        }
    }
    rc = TDM_OK;
out:
    free(g.start), free(g.to), free(index), free(low), free(stack), free(call), free(edge);
    free(on);
    return rc;
}

static int check_left_recursion(struct gbnf *c)
{
    struct gb *b = &c->b;
    size_t n = b->n_rules;
    uint8_t *nullable = calloc(n ? n : 1, 1);
    int *comp = malloc((n ? n : 1) * sizeof *comp);
    if (!nullable || !comp) {
        free(nullable), free(comp);
        return gb_fail(b, TDM_ENOMEM, "out of memory");
    }
    if (gb_mark_rules(b, false, nullable) != TDM_OK || components(b, nullable, comp) != TDM_OK) {
        free(nullable), free(comp);
        return gb_fail(b, TDM_ENOMEM, "out of memory");
    }
    for (size_t r = 0; r < n && !b->err; r++)
        for (size_t a = 0; a < b->rules[r].n_alts && !b->err; a++) {
            const struct gb_seq *s = &b->rules[r].alts[a];
            for (size_t i = 0; i < s->n; i++) {
                const struct gr_el *e = &s->v[i];
                if (e->kind != EL_REF)
                    break;
                // A pushing edge r -> e->arg that closes a cycle (e->arg reaches r).
                if (i + 1 < s->n && comp[e->arg] == comp[r]) {
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
                if (!nullable[e->arg])
                    break;
            }
        }
    free(nullable);
    free(comp);
    return b->err;
}

int gr_compile_gbnf(struct tdm_grammar **out, const char *text, size_t len, char *err,
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
    free(c.slots);
    gb_fini(&c.b);
    return rc;
}
