// SPDX-License-Identifier: Apache-2.0
// grammar_build: the rule builder every compiler writes into, the quantifier
// rules (x?, x*, x{m,n}), and gb_finish, which drops the alternatives that can
// never complete (a productivity fixed point) and flattens the rules into the
// immutable struct tdm_grammar. Errors are sticky in struct gb: a compiler
// keeps calling and checks b->err once; sizes are checked against
// TDM_GRAMMAR_MAX_ELEMENTS as they grow, so no input can make the build large.
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

void gb_init(struct gb *b)
{
    memset(b, 0, sizeof *b);
}

void gb_seq_free(struct gb_seq *s)
{
    free(s->v);
    memset(s, 0, sizeof *s);
}

void gb_fini(struct gb *b)
{
    for (size_t r = 0; r < b->n_rules; r++) {
        for (size_t a = 0; a < b->rules[r].n_alts; a++)
            gb_seq_free(&b->rules[r].alts[a]);
        free(b->rules[r].alts);
    }
    free(b->rules);
    free(b->classes);
    memset(b, 0, sizeof *b);
}

int gb_fail(struct gb *b, int code, const char *fmt, ...)
{
    if (b->err)
        return b->err;
    b->err = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(b->msg, sizeof b->msg, fmt, ap);
    va_end(ap);
    return code;
}

static bool grow(struct gb *b, void **p, size_t *cap, size_t need, size_t size)
{
    if (tdm_grow(p, cap, need, size, 8) != TDM_OK) {
        gb_fail(b, TDM_ENOMEM, "out of memory");
        return false;
    }
    return true;
}

int gb_rule_new(struct gb *b)
{
    if (b->err)
        return -1;
    if (b->n_rules >= TDM_GRAMMAR_MAX_ELEMENTS) {
        gb_fail(b, TDM_EINVAL, "grammar too large (over %u rules)", TDM_GRAMMAR_MAX_ELEMENTS);
        return -1;
    }
    if (!grow(b, (void **)&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules))
        return -1;
    memset(&b->rules[b->n_rules], 0, sizeof b->rules[0]);
    return (int)b->n_rules++;
}

static bool count_elements(struct gb *b, size_t n)
{
    b->n_elements += n;
    if (b->n_elements > TDM_GRAMMAR_MAX_ELEMENTS) {
        gb_fail(b, TDM_EINVAL, "grammar too large (over %u elements)", TDM_GRAMMAR_MAX_ELEMENTS);
        return false;
    }
    return true;
}

void gb_rule_add(struct gb *b, int rule, const struct gb_seq *alt)
{
    if (b->err || rule < 0)
        return;
    if (!count_elements(b, alt->n + 1))
        return;
    struct gb_rule *r = &b->rules[rule];
    if (!grow(b, (void **)&r->alts, &r->cap, r->n_alts + 1, sizeof *r->alts))
        return;
    struct gb_seq *c = &r->alts[r->n_alts];
    memset(c, 0, sizeof *c);
    if (alt->n) {
        c->v = malloc(alt->n * sizeof *c->v);
        if (!c->v) {
            gb_fail(b, TDM_ENOMEM, "out of memory");
            return;
        }
        memcpy(c->v, alt->v, alt->n * sizeof *c->v);
        c->n = c->cap = alt->n;
    }
    r->n_alts++;
}

static void seq_push(struct gb *b, struct gb_seq *s, uint8_t kind, int32_t arg)
{
    if (b->err)
        return;
    if (s->n >= TDM_GRAMMAR_MAX_ELEMENTS) {
        gb_fail(b, TDM_EINVAL, "grammar too large (over %u elements)", TDM_GRAMMAR_MAX_ELEMENTS);
        return;
    }
    if (!grow(b, (void **)&s->v, &s->cap, s->n + 1, sizeof *s->v))
        return;
    s->v[s->n].kind = kind;
    s->v[s->n].arg = arg;
    s->n++;
}

void gr_class_range(struct gr_class *c, unsigned lo, unsigned hi)
{
    for (unsigned x = lo; x <= hi && x < 256; x++)
        c->bits[x >> 5] |= 1u << (x & 31);
}

void gb_seq_class(struct gb *b, struct gb_seq *s, const struct gr_class *c)
{
    if (b->err)
        return;
    // Classes repeat a lot (digits, string characters): share equal ones.
    size_t i;
    for (i = 0; i < b->n_classes; i++)
        if (!memcmp(&b->classes[i], c, sizeof *c))
            break;
    if (i == b->n_classes) {
        if (!grow(b, (void **)&b->classes, &b->cap_classes, b->n_classes + 1, sizeof *c))
            return;
        b->classes[b->n_classes++] = *c;
    }
    seq_push(b, s, EL_CLASS, (int32_t)i);
}

void gb_seq_byte(struct gb *b, struct gb_seq *s, uint8_t byte)
{
    struct gr_class c = {0};
    gr_class_range(&c, byte, byte);
    gb_seq_class(b, s, &c);
}

void gb_seq_lit(struct gb *b, struct gb_seq *s, const char *bytes, size_t n)
{
    for (size_t i = 0; i < n && !b->err; i++)
        gb_seq_byte(b, s, (uint8_t)bytes[i]);
}

void gb_seq_ref(struct gb *b, struct gb_seq *s, int rule)
{
    if (rule < 0) {
        gb_fail(b, TDM_EINVAL, "internal: reference to no rule");
        return;
    }
    seq_push(b, s, EL_REF, rule);
}

void gb_seq_cat(struct gb *b, struct gb_seq *s, const struct gb_seq *t)
{
    for (size_t i = 0; i < t->n && !b->err; i++)
        seq_push(b, s, t->v[i].kind, t->v[i].arg);
}

int gb_opt(struct gb *b, const struct gb_seq *x)
{
    int r = gb_rule_new(b);
    struct gb_seq empty = {0};
    gb_rule_add(b, r, x);
    gb_rule_add(b, r, &empty);
    return b->err ? -1 : r;
}

int gb_star(struct gb *b, const struct gb_seq *x)
{
    // R ::= x R | ε  (the trailing R is a tail call: constant stack depth)
    int r = gb_rule_new(b);
    struct gb_seq alt = {0}, empty = {0};
    gb_seq_cat(b, &alt, x);
    gb_seq_ref(b, &alt, r);
    gb_rule_add(b, r, &alt);
    gb_rule_add(b, r, &empty);
    gb_seq_free(&alt);
    return b->err ? -1 : r;
}

void gb_seq_repeat(struct gb *b, struct gb_seq *s, const struct gb_seq *x, long min, long max)
{
    if (min < 0 || min > TDM_GRAMMAR_MAX_REPEAT || max > TDM_GRAMMAR_MAX_REPEAT ||
        (max >= 0 && max < min)) {
        gb_fail(b, TDM_EINVAL, "repetition {%ld,%ld} out of range (0 <= min <= max <= %d)", min,
                max, TDM_GRAMMAR_MAX_REPEAT);
        return;
    }
    for (long i = 0; i < min && !b->err; i++)
        gb_seq_cat(b, s, x);
    if (max < 0) {
        gb_seq_ref(b, s, gb_star(b, x));
        return;
    }
    if (max == min)
        return;
    // (x (x (x)?)?)? built inside out: O_1 ::= x | ε, O_k ::= x O_{k-1} | ε.
    int inner = -1;
    for (long k = 0; k < max - min && !b->err; k++) {
        struct gb_seq alt = {0};
        gb_seq_cat(b, &alt, x);
        if (inner >= 0)
            gb_seq_ref(b, &alt, inner);
        inner = gb_opt(b, &alt);
        gb_seq_free(&alt);
    }
    if (!b->err)
        gb_seq_ref(b, s, inner);
}

int gb_utf8_multibyte(struct gb *b)
{
    // Well-formed UTF-8 (RFC 3629 table 3-7) of 2..4 bytes.
    static const struct {
        uint8_t lo[4], hi[4];
        int n;
    } forms[] = {
        {{0xC2, 0x80}, {0xDF, 0xBF}, 2},
        {{0xE0, 0xA0, 0x80}, {0xE0, 0xBF, 0xBF}, 3},
        {{0xE1, 0x80, 0x80}, {0xEC, 0xBF, 0xBF}, 3},
        {{0xED, 0x80, 0x80}, {0xED, 0x9F, 0xBF}, 3},
        {{0xEE, 0x80, 0x80}, {0xEF, 0xBF, 0xBF}, 3},
        {{0xF0, 0x90, 0x80, 0x80}, {0xF0, 0xBF, 0xBF, 0xBF}, 4},
        {{0xF1, 0x80, 0x80, 0x80}, {0xF3, 0xBF, 0xBF, 0xBF}, 4},
        {{0xF4, 0x80, 0x80, 0x80}, {0xF4, 0x8F, 0xBF, 0xBF}, 4},
    };
    int r = gb_rule_new(b);
    for (size_t f = 0; f < sizeof forms / sizeof forms[0] && !b->err; f++) {
        struct gb_seq alt = {0};
        for (int i = 0; i < forms[f].n; i++) {
            struct gr_class c = {0};
            gr_class_range(&c, forms[f].lo[i], forms[f].hi[i]);
            gb_seq_class(b, &alt, &c);
        }
        gb_rule_add(b, r, &alt);
        gb_seq_free(&alt);
    }
    return b->err ? -1 : r;
}

// ---- finish ---------------------------------------------------------------------------
static bool class_empty(const struct gr_class *c)
{
    for (int i = 0; i < 8; i++)
        if (c->bits[i])
            return false;
    return true;
}

static bool alt_productive(const struct gb *b, const struct gb_seq *a, const uint8_t *prod)
{
    for (size_t i = 0; i < a->n; i++) {
        if (a->v[i].kind == EL_CLASS && class_empty(&b->classes[a->v[i].arg]))
            return false;
        if (a->v[i].kind == EL_REF && !prod[a->v[i].arg])
            return false;
    }
    return true;
}

int gb_mark_rules(const struct gb *b, bool classes_pass, uint8_t *mark)
{
    size_t n_rules = b->n_rules, n_alts = 0, n_refs = 0;
    for (size_t r = 0; r < n_rules; r++) {
        n_alts += b->rules[r].n_alts;
        for (size_t a = 0; a < b->rules[r].n_alts; a++)
            for (size_t i = 0; i < b->rules[r].alts[a].n; i++)
                n_refs += b->rules[r].alts[a].v[i].kind == EL_REF;
    }
    // waiting[k]: references of alternative k to rules not yet marked (SIZE_MAX:
    // never passes); alt_rule[k] its rule; users[ref_first[r] ..] the
    // alternatives referring to rule r, once per reference.
    size_t *waiting = malloc((n_alts ? n_alts : 1) * sizeof *waiting);
    size_t *alt_rule = malloc((n_alts ? n_alts : 1) * sizeof *alt_rule);
    size_t *ref_first = calloc(n_rules + 1, sizeof *ref_first);
    size_t *users = malloc((n_refs ? n_refs : 1) * sizeof *users);
    size_t *queue = malloc((n_rules ? n_rules : 1) * sizeof *queue);
    int rc = TDM_ENOMEM;
    if (!waiting || !alt_rule || !ref_first || !users || !queue)
        goto out;
    size_t k = 0, head = 0, tail = 0;
    for (size_t r = 0; r < n_rules; r++)
        for (size_t a = 0; a < b->rules[r].n_alts; a++, k++) {
            const struct gb_seq *sq = &b->rules[r].alts[a];
            alt_rule[k] = r;
            waiting[k] = 0;
            for (size_t i = 0; i < sq->n; i++) {
                const struct gr_el *e = &sq->v[i];
                if (e->kind == EL_REF) {
                    ref_first[e->arg + 1]++;
                    if (waiting[k] != SIZE_MAX)
                        waiting[k]++;
                } else if (!classes_pass ||
                           (e->kind == EL_CLASS && class_empty(&b->classes[e->arg]))) {
                    waiting[k] = SIZE_MAX;
                }
            }
            if (waiting[k] == 0 && !mark[r])
                mark[r] = 1, queue[tail++] = r;
        }
    for (size_t r = 0; r < n_rules; r++)
        ref_first[r + 1] += ref_first[r];
    size_t *fill = calloc(n_rules + 1, sizeof *fill);
    if (!fill)
        goto out;
    k = 0;
    for (size_t r = 0; r < n_rules; r++)
        for (size_t a = 0; a < b->rules[r].n_alts; a++, k++)
            for (size_t i = 0; i < b->rules[r].alts[a].n; i++) {
                const struct gr_el *e = &b->rules[r].alts[a].v[i];
                if (e->kind == EL_REF)
                    users[ref_first[e->arg] + fill[e->arg]++] = k;
            }
    free(fill);
    while (head < tail) {
        size_t r = queue[head++];
        for (size_t u = ref_first[r]; u < ref_first[r + 1]; u++) {
            size_t alt = users[u];
            if (waiting[alt] == SIZE_MAX || waiting[alt] == 0)
                continue;
            if (--waiting[alt] == 0 && !mark[alt_rule[alt]]) {
                mark[alt_rule[alt]] = 1;
                queue[tail++] = alt_rule[alt];
            }
        }
    }
    rc = TDM_OK;
out:
    free(waiting), free(alt_rule), free(ref_first), free(users), free(queue);
    return rc;
}

int gb_finish(struct gb *b, int root, struct tdm_grammar **out, char *err, size_t errlen)
{
    *out = NULL;
    if (b->err)
        return tdm_seterr(err, errlen, b->err, "%s", b->msg);
    uint8_t *prod = calloc(b->n_rules ? b->n_rules : 1, 1);
    struct tdm_grammar *g = calloc(1, sizeof *g);
    if (!prod || !g)
        goto fail_nomem;
    // Productive rules: some alternative whose every element can match.
    if (gb_mark_rules(b, true, prod) != TDM_OK)
        goto fail_nomem;
    if (root < 0 || !prod[root]) {
        free(prod);
        free(g);
        return tdm_seterr(err, errlen, TDM_EINVAL, "the grammar accepts no string");
    }
    size_t n_alts = 0, n_els = 0;
    for (size_t r = 0; r < b->n_rules; r++)
        for (size_t a = 0; a < b->rules[r].n_alts; a++)
            if (alt_productive(b, &b->rules[r].alts[a], prod)) {
                n_alts++;
                n_els += b->rules[r].alts[a].n + 1;
            }
    atomic_init(&g->refs, 1);
    g->els = malloc(n_els * sizeof *g->els);
    g->alt_start = malloc((n_alts ? n_alts : 1) * sizeof *g->alt_start);
    g->rule_first = malloc((b->n_rules + 1) * sizeof *g->rule_first);
    g->classes = malloc((b->n_classes ? b->n_classes : 1) * sizeof *g->classes);
    if (!g->els || !g->alt_start || !g->rule_first || !g->classes)
        goto fail_nomem;
    size_t ai = 0, ei = 0;
    for (size_t r = 0; r < b->n_rules; r++) {
        g->rule_first[r] = (int32_t)ai;
        for (size_t a = 0; a < b->rules[r].n_alts; a++) {
            const struct gb_seq *s = &b->rules[r].alts[a];
            if (!alt_productive(b, s, prod))
                continue;
            g->alt_start[ai++] = (int32_t)ei;
            if (s->n)
                memcpy(&g->els[ei], s->v, s->n * sizeof *s->v);
            ei += s->n;
            g->els[ei].kind = EL_END;
            g->els[ei].arg = 0;
            ei++;
        }
    }
    g->rule_first[b->n_rules] = (int32_t)ai;
    if (b->n_classes)
        memcpy(g->classes, b->classes, b->n_classes * sizeof *g->classes);
    g->n_els = n_els;
    g->n_rules = (int32_t)b->n_rules;
    g->n_classes = b->n_classes;
    g->root = root;
    free(prod);
    *out = g;
    return TDM_OK;
fail_nomem:
    free(prod);
    tdm_grammar_unref(g);
    return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
}

struct tdm_grammar *tdm_grammar_ref(struct tdm_grammar *g)
{
    atomic_fetch_add(&g->refs, 1);
    return g;
}

void tdm_grammar_unref(struct tdm_grammar *g)
{
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1)
        return;
    free(g->els);
    free(g->alt_start);
    free(g->rule_first);
    free(g->classes);
    free(g);
}
