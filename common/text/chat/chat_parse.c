// SPDX-License-Identifier: Apache-2.0
// chat_parse: tokens -> AST, following Jinja2's parser (jinja2/parser.py) for the
// subset chat templates use: if/elif/else, for (targets, else, inline if), set
// (expression, namespace attribute, block form), macro, call blocks, filter blocks,
// break/continue, HF's generation block; expressions with Jinja's precedence
// (inline if < or < and < not < comparisons/in < + - < ~ < * / // % < ** < unary <
// postfix and filters/tests). Anything else, an unknown filter or test among them,
// is refused here at load with the construct's name and line, so a template is
// never half rendered.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "core.h"

struct parser {
    struct arena *a;
    const struct token *t;
    size_t n, i;
    char *err;
    size_t errlen;
    int depth;
    int loops; // enclosing for loops (break/continue are only valid inside one)
    int rc;
};

static int perr(struct parser *p, int line, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int perr(struct parser *p, int line, const char *fmt, ...)
{
    if (p->rc != TDM_OK)
        return p->rc;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    p->rc = TDM_EINVAL;
    tdm_seterr(p->err, p->errlen, TDM_EINVAL, "chat template line %d: %s", line, msg);
    return TDM_EINVAL;
}

static const struct token *cur(struct parser *p)
{
    return &p->t[p->i < p->n ? p->i : p->n - 1];
}

static const struct token *peek_at(struct parser *p, size_t k)
{
    return &p->t[p->i + k < p->n ? p->i + k : p->n - 1];
}

static void next(struct parser *p)
{
    if (p->i < p->n - 1)
        p->i++;
}

static bool tok_name(const struct token *t, const char *name)
{
    return t->kind == T_NAME && t->n == strlen(name) && memcmp(t->s, name, t->n) == 0;
}

static bool tok_op(const struct token *t, const char *op)
{
    return t->kind == T_OP && strcmp(t->op, op) == 0;
}

// Describes a token for an error message.
static const char *describe(const struct token *t, char *buf, size_t n)
{
    switch (t->kind) {
    case T_EOF:
        return "end of template";
    case T_DATA:
        return "template text";
    case T_VAR_BEGIN:
        return "'{{'";
    case T_VAR_END:
        return "'}}'";
    case T_BLOCK_BEGIN:
        return "'{%'";
    case T_BLOCK_END:
        return "'%}'";
    case T_NAME:
        snprintf(buf, n, "'%.*s'", (int)(t->n > 40 ? 40 : t->n), t->s);
        return buf;
    case T_STRING:
        return "a string";
    case T_INT:
    case T_FLOAT:
        return "a number";
    case T_OP:
        snprintf(buf, n, "'%s'", t->op);
        return buf;
    }
    return "?";
}

static int unexpected(struct parser *p, const char *wanted)
{
    char buf[64];
    return perr(p, cur(p)->line, "expected %s, got %s", wanted, describe(cur(p), buf, sizeof buf));
}

static int expect_op(struct parser *p, const char *op)
{
    if (!tok_op(cur(p), op)) {
        char w[16];
        snprintf(w, sizeof w, "'%s'", op);
        return unexpected(p, w);
    }
    next(p);
    return TDM_OK;
}

static int expect_kind(struct parser *p, enum tok_kind k, const char *what)
{
    if (cur(p)->kind != k)
        return unexpected(p, what);
    next(p);
    return TDM_OK;
}

static struct node *mk(struct parser *p, enum node_kind kind, int line)
{
    struct node *nd = chat_arena_alloc(p->a, sizeof *nd);
    if (!nd) {
        if (p->rc == TDM_OK) {
            p->rc = TDM_ENOMEM;
            tdm_seterr(p->err, p->errlen, TDM_ENOMEM, "out of memory");
        }
        return NULL;
    }
    nd->kind = kind;
    nd->line = line;
    return nd;
}

static const char *name_dup(struct parser *p, const struct token *t)
{
    char *s = chat_arena_strndup(p->a, t->s, t->n);
    if (!s && p->rc == TDM_OK) {
        p->rc = TDM_ENOMEM;
        tdm_seterr(p->err, p->errlen, TDM_ENOMEM, "out of memory");
    }
    return s;
}

// ---- child lists -----------------------------------------------------------------------

struct kids {
    struct node **v;
    const char **names;
    size_t n, cap;
};

static int kids_push(struct parser *p, struct kids *k, struct node *nd, const char *name)
{
    if (k->n == k->cap) {
        size_t cap = k->cap ? k->cap * 2 : 8;
        struct node **v = realloc(k->v, cap * sizeof *v);
        if (v)
            k->v = v;
        const char **nm = v ? realloc(k->names, cap * sizeof *nm) : NULL;
        if (nm)
            k->names = nm;
        if (!v || !nm)
            return perr(p, 0, "out of memory");
        k->cap = cap;
    }
    k->v[k->n] = nd;
    k->names[k->n] = name;
    k->n++;
    return TDM_OK;
}

// Moves the list into the arena as nd->kids (and nd->names when with_names).
static int kids_finish(struct parser *p, struct kids *k, struct node *nd, bool with_names)
{
    int rc = TDM_OK;
    if (k->n) {
        nd->kids = chat_arena_alloc(p->a, k->n * sizeof *nd->kids);
        if (nd->kids)
            memcpy(nd->kids, k->v, k->n * sizeof *nd->kids);
        if (with_names) {
            nd->names = chat_arena_alloc(p->a, k->n * sizeof *nd->names);
            if (nd->names)
                memcpy(nd->names, k->names, k->n * sizeof *nd->names);
            nd->nnames = k->n;
        }
        if (!nd->kids || (with_names && !nd->names))
            rc = perr(p, nd->line, "out of memory");
        nd->nkids = k->n;
    }
    free(k->v);
    free(k->names);
    *k = (struct kids){0};
    return rc;
}

// ---- expressions ---------------------------------------------------------------------

static struct node *parse_expr(struct parser *p);
static struct node *parse_or(struct parser *p);
static struct node *parse_unary(struct parser *p, bool with_filter);
static struct node *parse_primary(struct parser *p);
static struct node *parse_postfix(struct parser *p, struct node *nd);

static bool enter(struct parser *p)
{
    if (++p->depth > CHAT_MAX_NEST) {
        perr(p, cur(p)->line, "nested more than %d levels deep (limit)", CHAT_MAX_NEST);
        return false;
    }
    return true;
}

static struct node *bin(struct parser *p, const char *op, struct node *l, struct node *r, int line)
{
    if (!l || !r)
        return NULL;
    struct node *nd = mk(p, N_BINARY, line);
    if (nd) {
        nd->s = op;
        nd->a = l;
        nd->b = r;
    }
    return nd;
}

// Call arguments after '(' up to ')': positional, then name=value.
static int parse_args(struct parser *p, struct node *nd)
{
    struct kids k = {0};
    if (expect_op(p, "(") != TDM_OK)
        return p->rc;
    while (!tok_op(cur(p), ")")) {
        if (tok_op(cur(p), "*") || tok_op(cur(p), "**")) {
            perr(p, cur(p)->line, "*args and **kwargs in calls are not supported");
            break;
        }
        const char *kw = NULL;
        if (cur(p)->kind == T_NAME && tok_op(peek_at(p, 1), "=")) {
            kw = name_dup(p, cur(p));
            next(p);
            next(p);
        }
        struct node *arg = parse_expr(p);
        if (!arg || kids_push(p, &k, arg, kw) != TDM_OK)
            break;
        if (tok_op(cur(p), ","))
            next(p);
        else if (!tok_op(cur(p), ")")) {
            unexpected(p, "',' or ')'");
            break;
        }
    }
    if (p->rc == TDM_OK)
        next(p); // ')'
    int rc = kids_finish(p, &k, nd, true);
    return p->rc != TDM_OK ? p->rc : rc;
}

static struct node *parse_filter(struct parser *p, struct node *input)
{
    // after '|'
    const struct token *t = cur(p);
    if (t->kind != T_NAME) {
        unexpected(p, "a filter name");
        return NULL;
    }
    struct node *nd = mk(p, N_FILTER, t->line);
    if (!nd)
        return NULL;
    nd->s = name_dup(p, t);
    nd->a = input;
    nd->builtin = nd->s ? chat_builtin_filter_index(nd->s) : -1;
    if (nd->s && nd->builtin < 0) {
        perr(p, t->line, "unknown filter '%s'", nd->s);
        return NULL;
    }
    next(p);
    if (tok_op(cur(p), "(") && parse_args(p, nd) != TDM_OK)
        return NULL;
    return nd;
}

static struct node *parse_test(struct parser *p, struct node *input)
{
    // after 'is'
    int line = cur(p)->line;
    bool neg = false;
    if (tok_name(cur(p), "not")) {
        neg = true;
        next(p);
    }
    const struct token *t = cur(p);
    if (t->kind != T_NAME) {
        unexpected(p, "a test name");
        return NULL;
    }
    struct node *nd = mk(p, N_TEST, line);
    if (!nd)
        return NULL;
    nd->s = name_dup(p, t);
    nd->a = input;
    nd->neg = neg;
    nd->builtin = nd->s ? chat_builtin_test_index(nd->s) : -1;
    if (nd->s && nd->builtin < 0) {
        perr(p, t->line, "unknown test '%s'", nd->s);
        return NULL;
    }
    next(p);
    const struct token *c = cur(p);
    if (tok_op(c, "(")) {
        if (parse_args(p, nd) != TDM_OK)
            return NULL;
    } else if ((c->kind == T_NAME || c->kind == T_STRING || c->kind == T_INT ||
                c->kind == T_FLOAT || tok_op(c, "[") || tok_op(c, "{")) &&
               !tok_name(c, "else") && !tok_name(c, "or") && !tok_name(c, "and")) {
        if (tok_name(c, "is")) {
            perr(p, c->line, "you cannot chain multiple tests with is");
            return NULL;
        }
        struct node *arg = parse_postfix(p, parse_primary(p));
        if (!arg)
            return NULL;
        struct kids k = {0};
        if (kids_push(p, &k, arg, NULL) != TDM_OK || kids_finish(p, &k, nd, true) != TDM_OK)
            return NULL;
    }
    return nd;
}

static struct node *parse_filter_expr(struct parser *p, struct node *nd)
{
    while (nd) {
        if (tok_op(cur(p), "|")) {
            next(p);
            nd = parse_filter(p, nd);
        } else if (tok_name(cur(p), "is")) {
            next(p);
            nd = parse_test(p, nd);
        } else if (tok_op(cur(p), "(")) {
            struct node *call = mk(p, N_CALL, cur(p)->line);
            if (!call)
                return NULL;
            call->a = nd;
            if (parse_args(p, call) != TDM_OK)
                return NULL;
            nd = call;
        } else {
            break;
        }
    }
    return nd;
}

static struct node *parse_subscript(struct parser *p, struct node *obj, int line)
{
    // after '['
    struct node *parts[3] = {NULL, NULL, NULL};
    int nparts = 0;
    bool slice = false;
    while (true) {
        if (!tok_op(cur(p), ":") && !tok_op(cur(p), "]")) {
            parts[nparts] = parse_expr(p);
            if (!parts[nparts])
                return NULL;
        }
        if (tok_op(cur(p), ":") && nparts < 2) {
            slice = true;
            nparts++;
            next(p);
            continue;
        }
        break;
    }
    if (!slice && parts[0] && tok_op(cur(p), ",")) {
        // a[1, 2]: the key is a tuple (Jinja's parse_subscript)
        struct node *tup = mk(p, N_TUPLE, line);
        struct kids k = {0};
        if (!tup || kids_push(p, &k, parts[0], NULL) != TDM_OK)
            return NULL;
        while (tok_op(cur(p), ",") && p->rc == TDM_OK) {
            next(p);
            struct node *item = parse_expr(p);
            if (!item || kids_push(p, &k, item, NULL) != TDM_OK)
                break;
        }
        if (kids_finish(p, &k, tup, false) != TDM_OK || p->rc != TDM_OK)
            return NULL;
        parts[0] = tup;
    }
    if (expect_op(p, "]") != TDM_OK)
        return NULL;
    struct node *nd = mk(p, slice ? N_SLICE : N_GETITEM, line);
    if (!nd)
        return NULL;
    nd->a = obj;
    if (slice) {
        nd->b = parts[0];
        nd->c = parts[1];
        nd->d = parts[2];
    } else {
        // a[] is a[()] in Jinja: an empty tuple key
        nd->b = parts[0] ? parts[0] : mk(p, N_TUPLE, line);
        if (!nd->b)
            return NULL;
    }
    return nd;
}

static struct node *parse_postfix(struct parser *p, struct node *nd)
{
    while (nd) {
        const struct token *t = cur(p);
        if (tok_op(t, ".")) {
            next(p);
            const struct token *a = cur(p);
            if (a->kind == T_NAME) {
                struct node *g = mk(p, N_GETATTR, a->line);
                if (!g)
                    return NULL;
                g->a = nd;
                g->s = name_dup(p, a);
                g->sn = a->n;
                nd = g;
            } else if (a->kind == T_INT) {
                struct node *g = mk(p, N_GETITEM, a->line), *k = mk(p, N_CONST, a->line);
                if (!g || !k)
                    return NULL;
                k->v = chat_v_int(a->i);
                g->a = nd;
                g->b = k;
                nd = g;
            } else {
                unexpected(p, "an attribute name");
                return NULL;
            }
            next(p);
        } else if (tok_op(t, "[")) {
            next(p);
            nd = parse_subscript(p, nd, t->line);
        } else if (tok_op(t, "(")) {
            struct node *call = mk(p, N_CALL, t->line);
            if (!call)
                return NULL;
            call->a = nd;
            if (parse_args(p, call) != TDM_OK)
                return NULL;
            nd = call;
        } else {
            break;
        }
    }
    return nd;
}

// Items of a literal up to the closing op (after the opening one).
static struct node *parse_seq(struct parser *p, enum node_kind kind, const char *close, int line)
{
    struct node *nd = mk(p, kind, line);
    if (!nd)
        return NULL;
    struct kids k = {0};
    while (!tok_op(cur(p), close) && p->rc == TDM_OK) {
        struct node *item = parse_expr(p);
        if (!item || kids_push(p, &k, item, NULL) != TDM_OK)
            break;
        if (kind == N_DICT) {
            if (expect_op(p, ":") != TDM_OK)
                break;
            item = parse_expr(p);
            if (!item || kids_push(p, &k, item, NULL) != TDM_OK)
                break;
        }
        if (tok_op(cur(p), ","))
            next(p);
        else if (!tok_op(cur(p), close)) {
            char w[24];
            snprintf(w, sizeof w, "',' or '%s'", close);
            unexpected(p, w);
        }
    }
    if (p->rc == TDM_OK)
        next(p);
    if (kids_finish(p, &k, nd, false) != TDM_OK || p->rc != TDM_OK)
        return NULL;
    return nd;
}

static struct node *parse_primary(struct parser *p)
{
    const struct token *t = cur(p);
    struct node *nd;
    switch (t->kind) {
    case T_NAME:
        nd = mk(p, N_CONST, t->line);
        if (!nd)
            return NULL;
        if (tok_name(t, "true") || tok_name(t, "True")) {
            nd->v = chat_v_bool(true);
        } else if (tok_name(t, "false") || tok_name(t, "False")) {
            nd->v = chat_v_bool(false);
        } else if (tok_name(t, "none") || tok_name(t, "None")) {
            nd->v = chat_v_none();
        } else {
            nd->kind = N_NAME;
            nd->s = name_dup(p, t);
            nd->sn = t->n;
        }
        next(p);
        return nd;
    case T_STRING: {
        // Adjacent literals concatenate.
        struct tdm_strbuf b = {0};
        while (cur(p)->kind == T_STRING) {
            tdm_strbuf_add(&b, cur(p)->s, cur(p)->n);
            next(p);
        }
        nd = mk(p, N_CONST, t->line);
        char *s = nd ? chat_arena_strndup(p->a, b.p ? b.p : "", b.len) : NULL;
        if (nd && (b.failed || !s)) {
            perr(p, t->line, "out of memory");
            nd = NULL;
        } else if (nd) {
            nd->v = chat_v_strn(s, b.len);
        }
        free(b.p);
        return nd;
    }
    case T_INT:
    case T_FLOAT:
        nd = mk(p, N_CONST, t->line);
        if (nd)
            nd->v = t->kind == T_INT ? chat_v_int(t->i) : chat_v_float(t->f);
        next(p);
        return nd;
    case T_OP:
        if (tok_op(t, "(")) {
            next(p);
            if (tok_op(cur(p), ")")) {
                next(p);
                return mk(p, N_TUPLE, t->line);
            }
            struct node *first = parse_expr(p);
            if (!first)
                return NULL;
            if (tok_op(cur(p), ")")) {
                next(p);
                return first;
            }
            if (!tok_op(cur(p), ",")) {
                unexpected(p, "',' or ')'");
                return NULL;
            }
            next(p);
            struct node *tup = parse_seq(p, N_TUPLE, ")", t->line);
            if (!tup)
                return NULL;
            // prepend first
            struct node **kids = chat_arena_alloc(p->a, (tup->nkids + 1) * sizeof *kids);
            if (!kids) {
                perr(p, t->line, "out of memory");
                return NULL;
            }
            kids[0] = first;
            if (tup->nkids)
                memcpy(kids + 1, tup->kids, tup->nkids * sizeof *kids);
            tup->kids = kids;
            tup->nkids++;
            return tup;
        }
        if (tok_op(t, "[")) {
            next(p);
            return parse_seq(p, N_LIST, "]", t->line);
        }
        if (tok_op(t, "{")) {
            next(p);
            return parse_seq(p, N_DICT, "}", t->line);
        }
        break;
    default:
        break;
    }
    unexpected(p, "an expression");
    return NULL;
}

static struct node *parse_unary(struct parser *p, bool with_filter)
{
    if (!enter(p))
        return NULL;
    const struct token *t = cur(p);
    struct node *nd;
    if (tok_op(t, "-") || tok_op(t, "+")) {
        next(p);
        nd = mk(p, N_UNARY, t->line);
        if (nd) {
            nd->s = t->op[0] == '-' ? "-" : "+";
            nd->a = parse_unary(p, false);
            if (!nd->a)
                nd = NULL;
        }
    } else {
        nd = parse_primary(p);
    }
    nd = parse_postfix(p, nd);
    if (with_filter)
        nd = parse_filter_expr(p, nd);
    p->depth--;
    return nd;
}

static struct node *parse_pow(struct parser *p)
{
    struct node *l = parse_unary(p, true);
    while (l && tok_op(cur(p), "**")) {
        int line = cur(p)->line;
        next(p);
        l = bin(p, "**", l, parse_unary(p, true), line);
    }
    return l;
}

static struct node *parse_math2(struct parser *p)
{
    struct node *l = parse_pow(p);
    while (l) {
        const struct token *t = cur(p);
        const char *op = tok_op(t, "*")    ? "*"
                         : tok_op(t, "/")  ? "/"
                         : tok_op(t, "//") ? "//"
                         : tok_op(t, "%")  ? "%"
                                           : NULL;
        if (!op)
            break;
        next(p);
        l = bin(p, op, l, parse_pow(p), t->line);
    }
    return l;
}

static struct node *parse_concat(struct parser *p)
{
    struct node *l = parse_math2(p);
    while (l && tok_op(cur(p), "~")) {
        int line = cur(p)->line;
        next(p);
        l = bin(p, "~", l, parse_math2(p), line);
    }
    return l;
}

static struct node *parse_math1(struct parser *p)
{
    struct node *l = parse_concat(p);
    while (l) {
        const struct token *t = cur(p);
        const char *op = tok_op(t, "+") ? "+" : tok_op(t, "-") ? "-" : NULL;
        if (!op)
            break;
        next(p);
        l = bin(p, op, l, parse_concat(p), t->line);
    }
    return l;
}

static struct node *parse_compare(struct parser *p)
{
    int line = cur(p)->line;
    struct node *first = parse_math1(p);
    if (!first)
        return NULL;
    struct kids k = {0};
    while (p->rc == TDM_OK) {
        const struct token *t = cur(p);
        const char *op = NULL;
        static const char *const cmp_ops[] = {"==", "!=", "<", "<=", ">", ">="};
        for (size_t i = 0; i < 6; i++)
            if (tok_op(t, cmp_ops[i]))
                op = cmp_ops[i];
        if (op) {
            next(p);
        } else if (tok_name(t, "in")) {
            op = "in";
            next(p);
        } else if (tok_name(t, "not") && tok_name(peek_at(p, 1), "in")) {
            op = "notin";
            next(p);
            next(p);
        } else {
            break;
        }
        struct node *operand = parse_math1(p);
        if (!operand || kids_push(p, &k, operand, op) != TDM_OK)
            break;
    }
    if (k.n == 0 || p->rc != TDM_OK) {
        free(k.v);
        free(k.names);
        return p->rc == TDM_OK ? first : NULL;
    }
    struct node *nd = mk(p, N_COMPARE, line);
    if (!nd) {
        free(k.v);
        free(k.names);
        return NULL;
    }
    nd->a = first;
    if (kids_finish(p, &k, nd, true) != TDM_OK)
        return NULL;
    return nd;
}

static struct node *parse_not(struct parser *p)
{
    if (tok_name(cur(p), "not")) {
        if (!enter(p))
            return NULL;
        struct node *nd = mk(p, N_UNARY, cur(p)->line);
        next(p);
        if (nd) {
            nd->s = "not";
            nd->a = parse_not(p);
            if (!nd->a)
                nd = NULL;
        }
        p->depth--;
        return nd;
    }
    return parse_compare(p);
}

static struct node *parse_and(struct parser *p)
{
    struct node *l = parse_not(p);
    while (l && tok_name(cur(p), "and")) {
        int line = cur(p)->line;
        next(p);
        l = bin(p, "and", l, parse_not(p), line);
    }
    return l;
}

static struct node *parse_or(struct parser *p)
{
    struct node *l = parse_and(p);
    while (l && tok_name(cur(p), "or")) {
        int line = cur(p)->line;
        next(p);
        l = bin(p, "or", l, parse_and(p), line);
    }
    return l;
}

// Jinja's parse_expression (with_condexpr): a if b else c.
static struct node *parse_expr(struct parser *p)
{
    if (!enter(p))
        return NULL;
    struct node *nd = parse_or(p);
    while (nd && tok_name(cur(p), "if")) {
        struct node *c = mk(p, N_COND, cur(p)->line);
        next(p);
        if (!c)
            return NULL;
        c->a = nd;
        c->b = parse_or(p);
        if (!c->b)
            return NULL;
        if (tok_name(cur(p), "else")) {
            next(p);
            c->c = parse_expr(p);
            if (!c->c)
                return NULL;
        }
        nd = c;
    }
    p->depth--;
    return nd;
}

// Jinja's parse_tuple: "a, b" without parentheses is a tuple (in {{ }}, if, for
// and set); condexpr false leaves a trailing "if" to the statement (if tests and
// for iterables do not take inline ifs).
static struct node *parse_tuple(struct parser *p, bool condexpr)
{
    int line = cur(p)->line;
    struct node *first = condexpr ? parse_expr(p) : parse_or(p);
    if (!first || !tok_op(cur(p), ","))
        return first;
    struct node *tup = mk(p, N_TUPLE, line);
    struct kids k = {0};
    if (!tup || kids_push(p, &k, first, NULL) != TDM_OK)
        return NULL;
    while (tok_op(cur(p), ",") && p->rc == TDM_OK) {
        next(p);
        const struct token *t = cur(p);
        if (t->kind == T_VAR_END || t->kind == T_BLOCK_END || tok_op(t, ")") ||
            tok_name(t, "recursive"))
            break;
        struct node *item = condexpr ? parse_expr(p) : parse_or(p);
        if (!item || kids_push(p, &k, item, NULL) != TDM_OK)
            break;
    }
    if (kids_finish(p, &k, tup, false) != TDM_OK || p->rc != TDM_OK)
        return NULL;
    return tup;
}

// ---- statements ----------------------------------------------------------------------

static struct node *parse_body(struct parser *p, const char *const *ends, const char **which,
                               int open_line, const char *open_tag);

static int end_block(struct parser *p)
{
    return expect_kind(p, T_BLOCK_END, "'%}'");
}

// The '%}' that opens a body; Jinja allows a colon before it for Python
// compatibility ({% if x: %}, {% else: %}).
static int open_body(struct parser *p)
{
    if (tok_op(cur(p), ":"))
        next(p);
    return end_block(p);
}

// Consumes 'else' (the body stopped at it) and the '%}' opening the else body.
static int close_tag_body(struct parser *p)
{
    next(p);
    return open_body(p);
}

// Consumes the end tag's name (the caller's body stopped at it) and its '%}'.
static int close_tag(struct parser *p)
{
    next(p);
    return end_block(p);
}

static struct node *parse_if(struct parser *p, int line)
{
    // after 'if' / 'elif'
    struct node *nd = mk(p, N_IF, line);
    if (!nd)
        return NULL;
    nd->a = parse_tuple(p, false);
    if (!nd->a || open_body(p) != TDM_OK)
        return NULL;
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    const char *which = NULL;
    nd->b = parse_body(p, ends, &which, line, "if");
    if (!nd->b)
        return NULL;
    if (strcmp(which, "elif") == 0) {
        int eline = cur(p)->line;
        next(p);
        nd->c = parse_if(p, eline);
        if (!nd->c)
            return NULL;
    } else if (strcmp(which, "else") == 0) {
        if (close_tag_body(p) != TDM_OK)
            return NULL;
        static const char *const ends2[] = {"endif", NULL};
        nd->c = parse_body(p, ends2, &which, line, "if");
        if (!nd->c || close_tag(p) != TDM_OK)
            return NULL;
    } else if (close_tag(p) != TDM_OK) {
        return NULL;
    }
    return nd;
}

static int parse_targets(struct parser *p, struct node *nd, bool allow_attr)
{
    struct kids k = {0};
    while (true) {
        const struct token *t = cur(p);
        if (t->kind != T_NAME) {
            unexpected(p, "a variable name");
            break;
        }
        if (allow_attr && tok_op(peek_at(p, 1), ".")) {
            // set ns.attr = ...
            struct node *g = mk(p, N_GETATTR, t->line), *base = mk(p, N_NAME, t->line);
            if (!g || !base)
                break;
            base->s = name_dup(p, t);
            base->sn = t->n;
            next(p);
            next(p);
            if (cur(p)->kind != T_NAME) {
                unexpected(p, "an attribute name");
                break;
            }
            g->a = base;
            g->s = name_dup(p, cur(p));
            g->sn = cur(p)->n;
            next(p);
            nd->a = g;
            break;
        }
        if (kids_push(p, &k, NULL, name_dup(p, t)) != TDM_OK)
            break;
        next(p);
        if (!tok_op(cur(p), ","))
            break;
        next(p);
    }
    if (p->rc != TDM_OK) {
        free(k.v);
        free(k.names);
        return p->rc;
    }
    if (k.n) {
        nd->names = chat_arena_alloc(p->a, k.n * sizeof *nd->names);
        if (!nd->names) {
            free(k.v);
            free(k.names);
            return perr(p, nd->line, "out of memory");
        }
        memcpy(nd->names, k.names, k.n * sizeof *nd->names);
        nd->nnames = k.n;
    }
    free(k.v);
    free(k.names);
    return TDM_OK;
}

static struct node *parse_for(struct parser *p, int line)
{
    struct node *nd = mk(p, N_FOR, line);
    if (!nd || parse_targets(p, nd, false) != TDM_OK)
        return NULL;
    if (!tok_name(cur(p), "in")) {
        unexpected(p, "'in'");
        return NULL;
    }
    next(p);
    nd->a = parse_tuple(p, false); // no inline if here: 'if' starts the loop filter
    if (!nd->a)
        return NULL;
    if (tok_name(cur(p), "if")) {
        next(p);
        nd->d = parse_expr(p);
        if (!nd->d)
            return NULL;
    }
    if (tok_name(cur(p), "recursive")) {
        perr(p, cur(p)->line, "recursive for loops are not supported");
        return NULL;
    }
    if (open_body(p) != TDM_OK)
        return NULL;
    static const char *const ends[] = {"else", "endfor", NULL};
    const char *which = NULL;
    p->loops++;
    nd->b = parse_body(p, ends, &which, line, "for");
    p->loops--;
    if (!nd->b)
        return NULL;
    if (strcmp(which, "else") == 0) {
        if (close_tag_body(p) != TDM_OK)
            return NULL;
        static const char *const ends2[] = {"endfor", NULL};
        nd->c = parse_body(p, ends2, &which, line, "for");
        if (!nd->c)
            return NULL;
    }
    if (close_tag(p) != TDM_OK)
        return NULL;
    return nd;
}

// A filter chain for {% filter %} and {% set x | f %}: name(args) | name ...; the
// innermost filter's input is NULL (the block's text).
static struct node *parse_filter_chain(struct parser *p)
{
    struct node *nd = NULL;
    do {
        if (nd)
            next(p); // '|'
        nd = parse_filter(p, nd);
        if (!nd)
            return NULL;
    } while (tok_op(cur(p), "|"));
    return nd;
}

static struct node *parse_set(struct parser *p, int line)
{
    struct node *nd = mk(p, N_SET, line);
    if (!nd || parse_targets(p, nd, true) != TDM_OK)
        return NULL;
    if (tok_op(cur(p), "=")) {
        next(p);
        nd->b = parse_tuple(p, true); // set a = 1, 2 makes a tuple
        if (!nd->b || end_block(p) != TDM_OK)
            return NULL;
        return nd;
    }
    // Block form: {% set name %}...{% endset %}
    if (nd->a || nd->nnames != 1) {
        perr(p, line, "a block set takes exactly one plain variable name");
        return NULL;
    }
    nd->kind = N_SET_BLOCK;
    nd->s = nd->names[0];
    if (tok_op(cur(p), "|")) {
        next(p);
        nd->d = parse_filter_chain(p);
        if (!nd->d)
            return NULL;
    }
    if (open_body(p) != TDM_OK)
        return NULL;
    static const char *const ends[] = {"endset", NULL};
    const char *which;
    nd->b = parse_body(p, ends, &which, line, "set");
    if (!nd->b || close_tag(p) != TDM_OK)
        return NULL;
    return nd;
}

// Parameters "(a, b=default)" for macros and call blocks: names + defaults in kids.
static int parse_params(struct parser *p, struct node *nd)
{
    struct kids k = {0};
    if (expect_op(p, "(") != TDM_OK)
        return p->rc;
    while (!tok_op(cur(p), ")") && p->rc == TDM_OK) {
        if (cur(p)->kind != T_NAME) {
            unexpected(p, "a parameter name");
            break;
        }
        const char *name = name_dup(p, cur(p));
        next(p);
        struct node *def = NULL;
        if (tok_op(cur(p), "=")) {
            next(p);
            def = parse_expr(p);
            if (!def)
                break;
        }
        if (kids_push(p, &k, def, name) != TDM_OK)
            break;
        if (tok_op(cur(p), ","))
            next(p);
        else if (!tok_op(cur(p), ")"))
            unexpected(p, "',' or ')'");
    }
    if (p->rc == TDM_OK)
        next(p);
    int rc = kids_finish(p, &k, nd, true);
    return p->rc != TDM_OK ? p->rc : rc;
}

static struct node *parse_statement(struct parser *p)
{
    next(p); // '{%'
    const struct token *t = cur(p);
    int line = t->line;
    char buf[64];
    if (t->kind != T_NAME) {
        unexpected(p, "a tag name");
        return NULL;
    }
    if (tok_name(t, "if")) {
        next(p);
        return parse_if(p, line);
    }
    if (tok_name(t, "for")) {
        next(p);
        return parse_for(p, line);
    }
    if (tok_name(t, "set")) {
        next(p);
        return parse_set(p, line);
    }
    if (tok_name(t, "macro")) {
        next(p);
        struct node *nd = mk(p, N_MACRO, line);
        if (!nd)
            return NULL;
        if (cur(p)->kind != T_NAME) {
            unexpected(p, "a macro name");
            return NULL;
        }
        nd->s = name_dup(p, cur(p));
        next(p);
        if (parse_params(p, nd) != TDM_OK || open_body(p) != TDM_OK)
            return NULL;
        static const char *const ends[] = {"endmacro", NULL};
        const char *which;
        int loops = p->loops;
        p->loops = 0;
        nd->b = parse_body(p, ends, &which, line, "macro");
        p->loops = loops;
        if (!nd->b || close_tag(p) != TDM_OK)
            return NULL;
        return nd;
    }
    if (tok_name(t, "call")) {
        next(p);
        struct node *nd = mk(p, N_CALL_BLOCK, line);
        if (!nd)
            return NULL;
        if (tok_op(cur(p), "(") && parse_params(p, nd) != TDM_OK)
            return NULL;
        nd->a = parse_expr(p);
        if (!nd->a)
            return NULL;
        if (nd->a->kind != N_CALL) {
            perr(p, line, "{%% call %%} needs a macro call");
            return NULL;
        }
        if (open_body(p) != TDM_OK)
            return NULL;
        static const char *const ends[] = {"endcall", NULL};
        const char *which;
        nd->b = parse_body(p, ends, &which, line, "call");
        if (!nd->b || close_tag(p) != TDM_OK)
            return NULL;
        return nd;
    }
    if (tok_name(t, "filter")) {
        next(p);
        struct node *nd = mk(p, N_FILTER_BLOCK, line);
        if (!nd)
            return NULL;
        nd->d = parse_filter_chain(p);
        if (!nd->d || open_body(p) != TDM_OK)
            return NULL;
        static const char *const ends[] = {"endfilter", NULL};
        const char *which;
        nd->b = parse_body(p, ends, &which, line, "filter");
        if (!nd->b || close_tag(p) != TDM_OK)
            return NULL;
        return nd;
    }
    if (tok_name(t, "generation")) {
        // HF's AssistantTracker: marks assistant text for masks; renders its body.
        next(p);
        if (open_body(p) != TDM_OK)
            return NULL;
        static const char *const ends[] = {"endgeneration", NULL};
        const char *which;
        struct node *nd = parse_body(p, ends, &which, line, "generation");
        if (!nd || close_tag(p) != TDM_OK)
            return NULL;
        return nd;
    }
    if (tok_name(t, "break") || tok_name(t, "continue")) {
        bool brk = tok_name(t, "break");
        if (p->loops == 0) {
            perr(p, line, "'%s' outside a for loop", brk ? "break" : "continue");
            return NULL;
        }
        next(p);
        if (end_block(p) != TDM_OK)
            return NULL;
        return mk(p, brk ? N_BREAK : N_CONTINUE, line);
    }
    perr(p, line, "unsupported or unexpected tag %s", describe(t, buf, sizeof buf));
    return NULL;
}

static struct node *parse_body(struct parser *p, const char *const *ends, const char **which,
                               int open_line, const char *open_tag)
{
    if (!enter(p))
        return NULL;
    struct node *body = mk(p, N_BODY, cur(p)->line);
    struct kids k = {0};
    while (body && p->rc == TDM_OK) {
        const struct token *t = cur(p);
        struct node *nd = NULL;
        if (t->kind == T_EOF) {
            if (ends) {
                const char *end_tag = ends[0];
                for (size_t i = 0; ends[i]; i++)
                    if (strncmp(ends[i], "end", 3) == 0)
                        end_tag = ends[i];
                perr(p, open_line, "{%% %s %%} is never closed (missing {%% %s %%})", open_tag,
                     end_tag);
            }
            break;
        }
        if (t->kind == T_DATA) {
            nd = mk(p, N_TEXT, t->line);
            if (nd) {
                nd->s = t->s;
                nd->sn = t->n;
            }
            next(p);
        } else if (t->kind == T_VAR_BEGIN) {
            next(p);
            nd = mk(p, N_OUTPUT, t->line);
            if (nd) {
                nd->a = parse_tuple(p, true);
                if (!nd->a || expect_kind(p, T_VAR_END, "'}}'") != TDM_OK)
                    nd = NULL;
            }
        } else if (t->kind == T_BLOCK_BEGIN) {
            const struct token *name = peek_at(p, 1);
            bool is_end = false;
            for (size_t i = 0; ends && ends[i]; i++) {
                if (tok_name(name, ends[i])) {
                    *which = ends[i];
                    is_end = true;
                }
            }
            if (is_end) {
                next(p); // leave the parser on the end tag's name
                break;
            }
            if (name->kind == T_NAME &&
                (tok_name(name, "endif") || tok_name(name, "endfor") || tok_name(name, "elif") ||
                 tok_name(name, "else") || tok_name(name, "endmacro") || tok_name(name, "endset") ||
                 tok_name(name, "endcall") || tok_name(name, "endfilter"))) {
                char buf[64];
                perr(p, name->line, "unexpected tag %s", describe(name, buf, sizeof buf));
                break;
            }
            nd = parse_statement(p);
        } else {
            char buf[64];
            perr(p, t->line, "unexpected %s", describe(t, buf, sizeof buf));
        }
        if (!nd || kids_push(p, &k, nd, NULL) != TDM_OK)
            break;
    }
    if (p->rc != TDM_OK || !body) {
        free(k.v);
        free(k.names);
        return NULL;
    }
    if (kids_finish(p, &k, body, false) != TDM_OK)
        return NULL;
    p->depth--;
    return body;
}

int chat_parse(struct arena *a, const struct token *toks, size_t ntoks, struct node **root,
               char *err, size_t errlen)
{
    struct parser p = {.a = a, .t = toks, .n = ntoks, .err = err, .errlen = errlen};
    *root = parse_body(&p, NULL, NULL, 0, NULL);
    if (!*root && p.rc == TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "chat template: parse error");
    return p.rc;
}
