// SPDX-License-Identifier: Apache-2.0
// chat_eval: runs a parsed chat template. Statements write to the render's output
// buffer (or to a capture buffer for macros, set blocks and filter blocks);
// expressions follow Python/Jinja2 semantics (chat_value.c). Scopes: the template's
// top level and the render variables share the global scope; a for loop and a macro
// call each get a child scope, so a `set` inside them does not leak out (namespace()
// objects exist to carry values out, as in Jinja2).
//
// Every loop iteration, node evaluation and byte scanned counts against the limits
// in chat_impl.h, so a hostile template or input ends with an error in bounded time.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat_impl.h"
#include "core.h"

static int eval(struct render *r, const struct node *nd, struct scope *sc, struct val *out);
static int exec(struct render *r, const struct node *nd, struct scope *sc);

// ---- scopes --------------------------------------------------------------------------

static int scope_new(struct render *r, struct scope *parent, struct scope **out)
{
    struct scope *s = chat_arena_alloc(&r->arena, sizeof *s);
    if (!s)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    s->parent = parent;
    *out = s;
    return TDM_OK;
}

static int scope_set(struct render *r, struct scope *sc, const char *name, struct val v)
{
    return chat_v_dict_set(r, &sc->vars, chat_v_strn(name, strlen(name)), v);
}

static int lookup(struct render *r, struct scope *sc, const char *name, size_t n, struct val *out)
{
    for (; sc; sc = sc->parent)
        if (chat_v_dict_get(&sc->vars, name, n, out))
            return TDM_OK;
    (void)r;
    if (chat_builtin_global(name, out) == TDM_OK)
        return TDM_OK;
    *out = chat_v_undef(name);
    return TDM_OK;
}

// ---- output --------------------------------------------------------------------------

static int emit(struct render *r, const char *s, size_t n)
{
    tdm_strbuf_add(r->out, s, n);
    if (r->out->failed)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    if (r->out->over)
        return chat_rerr(r, TDM_ECAPACITY, "output would exceed %zu bytes (limit)", r->out->limit);
    return TDM_OK;
}

// Runs body with output going to a string value.
static int capture(struct render *r, const struct node *body, struct scope *sc, struct val *out)
{
    struct tdm_strbuf buf = {.limit = CHAT_MAX_STRING};
    struct tdm_strbuf *saved = r->out;
    r->out = &buf;
    int rc = exec(r, body, sc);
    r->out = saved;
    if (rc == TDM_OK)
        rc = chat_sb_to_val(r, &buf, out);
    free(buf.p);
    return rc;
}

// ---- operators -----------------------------------------------------------------------

static bool is_num(struct val v)
{
    return v.kind == V_BOOL || v.kind == V_INT || v.kind == V_FLOAT;
}

static double as_f(struct val v)
{
    return v.kind == V_FLOAT ? v.u.f : v.kind == V_INT ? (double)v.u.i : (double)v.u.b;
}

static int64_t as_i(struct val v)
{
    return v.kind == V_INT ? v.u.i : (int64_t)v.u.b;
}

static int undefined_err(struct render *r, struct val v)
{
    return chat_rerr(r, TDM_EINVAL, "'%s' is undefined", v.u.undef_name ? v.u.undef_name : "value");
}

static int type_err(struct render *r, const char *op, struct val a, struct val b)
{
    if (a.kind == V_UNDEF)
        return undefined_err(r, a);
    if (b.kind == V_UNDEF)
        return undefined_err(r, b);
    return chat_rerr(r, TDM_EINVAL, "unsupported operand type(s) for %s: '%s' and '%s'", op,
                     chat_v_type_name(a), chat_v_type_name(b));
}

static int str_concat(struct render *r, struct val a, struct val b, struct val *out)
{
    // markupsafe: Markup + str escapes the str, and the result is Markup.
    bool markup = a.markup || b.markup;
    if (!markup) {
        if ((uint64_t)a.u.str.n + b.u.str.n > CHAT_MAX_STRING)
            return chat_rerr(r, TDM_ECAPACITY, "a string would exceed %u bytes (limit)",
                             CHAT_MAX_STRING);
        char *p = chat_arena_alloc(&r->arena, a.u.str.n + b.u.str.n + 1);
        if (!p)
            return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                             CHAT_MAX_ARENA >> 20);
        if (a.u.str.n)
            memcpy(p, a.u.str.s, a.u.str.n);
        if (b.u.str.n)
            memcpy(p + a.u.str.n, b.u.str.s, b.u.str.n);
        if (!chat_charge(r, (a.u.str.n + b.u.str.n) / 16))
            return r->rc;
        *out = chat_v_strn(p, a.u.str.n + b.u.str.n);
        return TDM_OK;
    }
    struct tdm_strbuf buf = {.limit = CHAT_MAX_STRING};
    if (a.markup)
        tdm_strbuf_add(&buf, a.u.str.s, a.u.str.n);
    else
        chat_html_escape(&buf, a.u.str.s, a.u.str.n);
    if (b.markup)
        tdm_strbuf_add(&buf, b.u.str.s, b.u.str.n);
    else
        chat_html_escape(&buf, b.u.str.s, b.u.str.n);
    int rc = chat_sb_to_val(r, &buf, out);
    free(buf.p);
    out->markup = true;
    return rc;
}

static int repeat(struct render *r, struct val seq, int64_t times, struct val *out)
{
    if (times < 0)
        times = 0;
    if (seq.kind == V_STR) {
        if (seq.u.str.n && (uint64_t)times > CHAT_MAX_STRING / seq.u.str.n)
            return chat_rerr(r, TDM_ECAPACITY, "a string would exceed %u bytes (limit)",
                             CHAT_MAX_STRING);
        struct tdm_strbuf buf = {.limit = CHAT_MAX_STRING};
        for (int64_t k = 0; k < times; k++)
            tdm_strbuf_add(&buf, seq.u.str.s, seq.u.str.n);
        int rc = chat_sb_to_val(r, &buf, out);
        free(buf.p);
        out->markup = seq.markup;
        return rc;
    }
    size_t n = seq.u.list->n;
    if (n && (uint64_t)times > CHAT_MAX_ITERATIONS / n)
        return chat_rerr(r, TDM_ECAPACITY, "a list would exceed %d items (limit)",
                         CHAT_MAX_ITERATIONS);
    if (chat_v_list_new(r, n * (size_t)times, out) != TDM_OK)
        return r->rc;
    for (int64_t k = 0; k < times; k++)
        for (size_t i = 0; i < n; i++)
            if (chat_v_list_push(r, out->u.list, seq.u.list->items[i]) != TDM_OK)
                return r->rc;
    return TDM_OK;
}

static int arith(struct render *r, const char *op, struct val a, struct val b, struct val *out)
{
    if (op[0] == '~') {
        struct tdm_strbuf buf = {.limit = CHAT_MAX_STRING};
        int rc = chat_v_to_text(r, a, &buf);
        if (rc == TDM_OK)
            rc = chat_v_to_text(r, b, &buf);
        if (rc == TDM_OK)
            rc = chat_sb_to_val(r, &buf, out);
        free(buf.p);
        return rc;
    }
    if (op[0] == '+' && a.kind == V_STR && b.kind == V_STR)
        return str_concat(r, a, b, out);
    if (op[0] == '+' && a.kind == V_LIST && b.kind == V_LIST) {
        if (a.u.list->tuple != b.u.list->tuple || a.u.list->gen || b.u.list->gen ||
            a.u.list->view || b.u.list->view)
            return type_err(r, "+", a, b);
        if (chat_v_list_new(r, a.u.list->n + b.u.list->n, out) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < a.u.list->n; i++)
            chat_v_list_push(r, out->u.list, a.u.list->items[i]);
        for (size_t i = 0; i < b.u.list->n; i++)
            chat_v_list_push(r, out->u.list, b.u.list->items[i]);
        out->u.list->tuple = a.u.list->tuple;
        if (!chat_charge(r, out->u.list->n))
            return r->rc;
        return r->rc;
    }
    if (op[0] == '*' && op[1] == 0 && !(a.kind == V_LIST && (a.u.list->gen || a.u.list->view)) &&
        !(b.kind == V_LIST && (b.u.list->gen || b.u.list->view))) {
        if ((a.kind == V_STR || a.kind == V_LIST) && (b.kind == V_INT || b.kind == V_BOOL))
            return repeat(r, a, as_i(b), out);
        if ((b.kind == V_STR || b.kind == V_LIST) && (a.kind == V_INT || a.kind == V_BOOL))
            return repeat(r, b, as_i(a), out);
    }
    if (!is_num(a) || !is_num(b)) {
        if (op[0] == '%' && a.kind == V_STR)
            return chat_rerr(r, TDM_EINVAL,
                             "printf-style string formatting ('%%') is not supported");
        return type_err(r, op, a, b);
    }
    bool fl = a.kind == V_FLOAT || b.kind == V_FLOAT;
    if (strcmp(op, "/") == 0) {
        if (as_f(b) == 0)
            return chat_rerr(r, TDM_EINVAL, "division by zero");
        *out = chat_v_float(as_f(a) / as_f(b));
        return TDM_OK;
    }
    if (fl) {
        double x = as_f(a), y = as_f(b), z;
        if (op[0] == '+')
            z = x + y;
        else if (op[0] == '-')
            z = x - y;
        else if (strcmp(op, "*") == 0)
            z = x * y;
        else if (strcmp(op, "**") == 0)
            z = pow(x, y);
        else {
            if (y == 0)
                return chat_rerr(r, TDM_EINVAL, "float division by zero");
            z = strcmp(op, "//") == 0 ? floor(x / y) : x - y * floor(x / y);
        }
        *out = chat_v_float(z);
        return TDM_OK;
    }
    int64_t x = as_i(a), y = as_i(b), z;
    bool ovf = false;
    if (op[0] == '+')
        ovf = __builtin_add_overflow(x, y, &z);
    else if (op[0] == '-')
        ovf = __builtin_sub_overflow(x, y, &z);
    else if (strcmp(op, "*") == 0)
        ovf = __builtin_mul_overflow(x, y, &z);
    else if (strcmp(op, "**") == 0) {
        if (y < 0) {
            *out = chat_v_float(pow((double)x, (double)y));
            return TDM_OK;
        }
        z = 1;
        for (int64_t k = 0; k < y && !ovf; k++) {
            ovf = __builtin_mul_overflow(z, x, &z);
            if (!chat_charge(r, 1))
                return r->rc;
        }
    } else {
        if (y == 0)
            return chat_rerr(r, TDM_EINVAL, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1)
            ovf = true;
        else {
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            z = strcmp(op, "//") == 0 ? q : m;
        }
    }
    if (ovf)
        return chat_rerr(r, TDM_EINVAL, "integer overflow in '%s'", op);
    *out = chat_v_int(z);
    return TDM_OK;
}

static int contains(struct render *r, struct val hay, struct val needle, bool *out)
{
    if (hay.kind == V_STR && !chat_charge(r, hay.u.str.n / 4))
        return r->rc;
    if (hay.kind == V_LIST && !chat_charge(r, hay.u.list->n))
        return r->rc;
    if (needle.kind == V_UNDEF && hay.kind == V_STR)
        return undefined_err(r, needle);
    return chat_v_contains(r, hay, needle, out);
}

static int compare_op(struct render *r, const char *op, struct val a, struct val b, bool *res)
{
    if (strcmp(op, "==") == 0) {
        *res = chat_v_equal(a, b);
        return TDM_OK;
    }
    if (strcmp(op, "!=") == 0) {
        *res = !chat_v_equal(a, b);
        return TDM_OK;
    }
    if (strcmp(op, "in") == 0)
        return contains(r, b, a, res);
    if (strcmp(op, "notin") == 0) {
        int rc = contains(r, b, a, res);
        *res = !*res;
        return rc;
    }
    int cmp;
    if (chat_v_compare(r, a, b, &cmp) != TDM_OK)
        return r->rc;
    if (strcmp(op, "<") == 0)
        *res = cmp < 0;
    else if (strcmp(op, "<=") == 0)
        *res = cmp <= 0;
    else if (strcmp(op, ">") == 0)
        *res = cmp > 0;
    else
        *res = cmp >= 0;
    return TDM_OK;
}

// Python slicing of a list or a string (by code point). Where Python raises a
// TypeError (an index that is not an integer or None, an object that cannot be
// sliced) the result is undefined, as Jinja's getitem makes it; slicing an
// undefined value and a zero step (ValueError) are errors, as there.
static int do_slice(struct render *r, struct val obj, struct val vs, struct val ve, struct val vt,
                    struct val *out)
{
    if (obj.kind == V_UNDEF)
        return undefined_err(r, obj);
    for (int k = 0; k < 3; k++) {
        struct val v = k == 0 ? vs : k == 1 ? ve : vt;
        if (v.kind != V_NONE && v.kind != V_UNDEF && v.kind != V_INT && v.kind != V_BOOL) {
            *out = chat_v_undef(NULL);
            return TDM_OK;
        }
    }
    int64_t step = vt.kind == V_INT || vt.kind == V_BOOL ? as_i(vt) : 1;
    bool sliceable = obj.kind == V_STR ||
                     (obj.kind == V_LIST && !obj.u.list->gen && !obj.u.list->view);
    if (step == 0 && sliceable)
        return chat_rerr(r, TDM_EINVAL, "slice step cannot be zero");
    size_t *offs = NULL; // str: byte offset of each code point, plus the end
    int64_t len;
    if (obj.kind == V_LIST && (obj.u.list->gen || obj.u.list->view)) {
        *out = chat_v_undef(NULL);
        return TDM_OK;
    } else if (obj.kind == V_LIST) {
        len = (int64_t)obj.u.list->n;
    } else if (obj.kind == V_STR) {
        len = (int64_t)chat_utf8_len(obj.u.str.s, obj.u.str.n);
        offs = malloc(((size_t)len + 1) * sizeof *offs);
        if (!offs)
            return chat_rerr(r, TDM_ENOMEM, "out of memory");
        size_t i = 0, k = 0;
        uint32_t cp;
        while (i < obj.u.str.n) {
            offs[k++] = i;
            i += tdm_utf8_next(obj.u.str.s, obj.u.str.n, i, &cp);
        }
        offs[k] = obj.u.str.n;
    } else {
        *out = chat_v_undef(NULL);
        return TDM_OK;
    }
    int64_t start, stop;
    bool has_s = vs.kind == V_INT || vs.kind == V_BOOL,
         has_e = ve.kind == V_INT || ve.kind == V_BOOL;
    if (step > 0) {
        start = has_s ? as_i(vs) : 0;
        stop = has_e ? as_i(ve) : len;
        if (start < 0)
            start = start + len < 0 ? 0 : start + len;
        if (start > len)
            start = len;
        if (stop < 0)
            stop = stop + len < 0 ? 0 : stop + len;
        if (stop > len)
            stop = len;
    } else {
        start = has_s ? as_i(vs) : len - 1;
        stop = has_e ? as_i(ve) : -1 - len;
        if (start < 0)
            start = start + len < 0 ? -1 : start + len;
        if (start >= len)
            start = len - 1;
        if (stop < 0)
            stop = stop + len < 0 ? -1 : stop + len;
        if (stop >= len)
            stop = len - 1;
    }
    int rc = TDM_OK;
    if (obj.kind == V_LIST) {
        if ((rc = chat_v_list_new(r, 0, out)) == TDM_OK) {
            out->u.list->tuple = obj.u.list->tuple;
            for (int64_t i = start; (step > 0 ? i < stop : i > stop) && rc == TDM_OK; i += step)
                rc = chat_v_list_push(r, out->u.list, obj.u.list->items[i]);
        }
        return rc;
    }
    struct tdm_strbuf buf = {.limit = CHAT_MAX_STRING};
    if (step == 1 && start < stop)
        tdm_strbuf_add(&buf, obj.u.str.s + offs[start], offs[stop] - offs[start]);
    else
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
            tdm_strbuf_add(&buf, obj.u.str.s + offs[i], offs[i + 1] - offs[i]);
    free(offs);
    rc = chat_sb_to_val(r, &buf, out);
    free(buf.p);
    return rc;
}

// ---- calls ---------------------------------------------------------------------------

int chat_eval_macro_call(struct render *r, struct val macro, const struct val *args,
                         const char *const *names, size_t nargs, struct val *caller,
                         struct val *out)
{
    const struct node *m = macro.u.macro;
    if (r->call_depth >= CHAT_MAX_CALL_DEPTH)
        return chat_rerr(r, TDM_ECAPACITY, "macro calls nested deeper than %d (limit)",
                         CHAT_MAX_CALL_DEPTH);
    struct scope *sc = NULL;
    if (scope_new(r, macro.closure, &sc) != TDM_OK)
        return r->rc;
    const char *mname = m->kind == N_MACRO ? m->s : "caller";
    size_t npos = 0;
    for (size_t i = 0; i < nargs; i++) {
        if (names && names[i]) {
            size_t k;
            for (k = 0; k < m->nnames; k++)
                if (strcmp(m->names[k], names[i]) == 0)
                    break;
            if (k == m->nnames)
                return chat_rerr(r, TDM_EINVAL, "macro '%s' takes no keyword argument '%s'", mname,
                                 names[i]);
            if (scope_set(r, sc, m->names[k], args[i]) != TDM_OK)
                return r->rc;
        } else {
            if (npos >= m->nnames)
                return chat_rerr(r, TDM_EINVAL, "macro '%s' takes not more than %zu argument(s)",
                                 mname, m->nnames);
            if (scope_set(r, sc, m->names[npos], args[i]) != TDM_OK)
                return r->rc;
            npos++;
        }
    }
    int line = r->line;
    for (size_t k = 0; k < m->nnames; k++) {
        struct val have;
        if (chat_v_dict_get(&sc->vars, m->names[k], strlen(m->names[k]), &have))
            continue;
        struct val def = chat_v_undef(m->names[k]);
        if (m->kids && m->kids[k] && eval(r, m->kids[k], sc, &def) != TDM_OK)
            return r->rc;
        if (scope_set(r, sc, m->names[k], def) != TDM_OK)
            return r->rc;
    }
    if (caller && scope_set(r, sc, "caller", *caller) != TDM_OK)
        return r->rc;
    r->call_depth++;
    int rc = capture(r, m->b, sc, out);
    r->call_depth--;
    r->line = line;
    r->loop_ctl = 0;
    return rc;
}

static int call_value(struct render *r, struct val fn, const struct val *args,
                      const char *const *names, size_t nargs, struct val *caller, struct val *out)
{
    if (fn.kind == V_MACRO)
        return chat_eval_macro_call(r, fn, args, names, nargs, caller, out);
    if (caller)
        return chat_rerr(r, TDM_EINVAL, "{%% call %%} needs a macro");
    if (fn.kind == V_FUNC || fn.kind == V_METHOD)
        return chat_builtin_call(r, fn, args, names, nargs, out);
    if (fn.kind == V_UNDEF)
        return chat_rerr(r, TDM_EINVAL, "'%s' is undefined (called as a function)",
                         fn.u.undef_name ? fn.u.undef_name : "value");
    return chat_rerr(r, TDM_EINVAL, "'%s' object is not callable", chat_v_type_name(fn));
}

// Evaluates nd->kids as call arguments into a heap array (caller frees).
static int eval_args(struct render *r, const struct node *nd, struct scope *sc, struct val **args)
{
    *args = NULL;
    if (!nd->nkids)
        return TDM_OK;
    *args = calloc(nd->nkids, sizeof **args);
    if (!*args)
        return chat_rerr(r, TDM_ENOMEM, "out of memory");
    for (size_t i = 0; i < nd->nkids; i++)
        if (eval(r, nd->kids[i], sc, &(*args)[i]) != TDM_OK)
            return r->rc;
    return TDM_OK;
}

static int eval_call(struct render *r, const struct node *nd, struct scope *sc, struct val *caller,
                     struct val *out)
{
    struct val fn, *args = NULL;
    int rc = eval(r, nd->a, sc, &fn);
    if (rc == TDM_OK)
        rc = eval_args(r, nd, sc, &args);
    if (rc == TDM_OK)
        rc = call_value(r, fn, args, nd->names, nd->nkids, caller, out);
    free(args);
    return rc;
}

// N_FILTER: input is nd->a's value, or *block (filter blocks, set blocks) at the bottom.
static int eval_filter(struct render *r, const struct node *nd, struct scope *sc,
                       const struct val *block, struct val *out)
{
    struct val in, *args = NULL;
    int rc;
    if (nd->a && nd->a->kind == N_FILTER && block)
        rc = eval_filter(r, nd->a, sc, block, &in);
    else if (nd->a)
        rc = eval(r, nd->a, sc, &in);
    else {
        in = block ? *block : chat_v_undef(NULL);
        rc = TDM_OK;
    }
    if (rc == TDM_OK)
        rc = eval_args(r, nd, sc, &args);
    if (rc == TDM_OK)
        rc = chat_builtin_filter(r, nd->builtin, in, args, nd->names, nd->nkids, out);
    free(args);
    return rc;
}

// ---- expressions ---------------------------------------------------------------------

// a[start:stop:step]; a missing part is None.
static int eval_slice(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a, s = chat_v_none(), e = chat_v_none(), t = chat_v_none();
    int rc;
    if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK ||
        (nd->b && (rc = eval(r, nd->b, sc, &s)) != TDM_OK) ||
        (nd->c && (rc = eval(r, nd->c, sc, &e)) != TDM_OK) ||
        (nd->d && (rc = eval(r, nd->d, sc, &t)) != TDM_OK))
        return rc;
    return do_slice(r, a, s, e, t, out);
}

// "a is [not] test(args)": *out is the test's result, false when it failed.
static int eval_test(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a;
    struct val *args = NULL;
    bool res = false;
    int rc;
    if ((rc = eval(r, nd->a, sc, &a)) == TDM_OK && (rc = eval_args(r, nd, sc, &args)) == TDM_OK)
        rc = chat_builtin_test(r, nd->builtin, a, args, nd->nkids, &res);
    free(args);
    *out = chat_v_bool(res != nd->neg);
    return rc;
}

// "not a", "-a", "+a".
static int eval_unary(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a;
    int rc;
    if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK)
        return rc;
    if (nd->s[0] == 'n') {
        *out = chat_v_bool(!chat_v_truthy(a));
    } else if (a.kind == V_FLOAT) {
        *out = chat_v_float(nd->s[0] == '-' ? -a.u.f : a.u.f);
    } else if (a.kind == V_INT || a.kind == V_BOOL) {
        int64_t i = as_i(a);
        if (nd->s[0] == '-' && i == INT64_MIN)
            return chat_rerr(r, TDM_EINVAL, "integer overflow in unary '-'");
        *out = chat_v_int(nd->s[0] == '-' ? -i : i);
    } else if (a.kind == V_UNDEF) {
        return undefined_err(r, a);
    } else {
        return chat_rerr(r, TDM_EINVAL, "bad operand type for unary %s: '%s'", nd->s,
                         chat_v_type_name(a));
    }
    return TDM_OK;
}

// "and" and "or" short-circuit to an operand, as Python's; the rest are arithmetic.
static int eval_binary(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a, b;
    int rc;
    if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK)
        return rc;
    if (strcmp(nd->s, "and") == 0) {
        if (!chat_v_truthy(a)) {
            *out = a;
            return TDM_OK;
        }
        return eval(r, nd->b, sc, out);
    }
    if (strcmp(nd->s, "or") == 0) {
        if (chat_v_truthy(a)) {
            *out = a;
            return TDM_OK;
        }
        return eval(r, nd->b, sc, out);
    }
    if ((rc = eval(r, nd->b, sc, &b)) != TDM_OK)
        return rc;
    return arith(r, nd->s, a, b, out);
}

// A chain "a < b <= c": each comparison on its neighbours, stopping at the first false.
static int eval_compare(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a, b;
    int rc;
    if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK)
        return rc;
    bool res = true;
    for (size_t i = 0; i < nd->nkids && res; i++) {
        if ((rc = eval(r, nd->kids[i], sc, &b)) != TDM_OK)
            return rc;
        if ((rc = compare_op(r, nd->names[i], a, b, &res)) != TDM_OK)
            return rc;
        a = b;
    }
    *out = chat_v_bool(res);
    return TDM_OK;
}

// A list or tuple display.
static int eval_list(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a;
    int rc;
    if ((rc = chat_v_list_new(r, nd->nkids, out)) != TDM_OK)
        return rc;
    out->u.list->tuple = nd->kind == N_TUPLE;
    for (size_t i = 0; i < nd->nkids; i++) {
        if ((rc = eval(r, nd->kids[i], sc, &a)) != TDM_OK ||
            (rc = chat_v_list_push(r, out->u.list, a)) != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

// A dict display: kids are key, value, key, value...; keys must be hashable.
static int eval_dict(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    struct val a, b;
    int rc;
    if ((rc = chat_v_dict_new(r, out)) != TDM_OK)
        return rc;
    for (size_t i = 0; i + 1 < nd->nkids; i += 2) {
        if ((rc = eval(r, nd->kids[i], sc, &a)) != TDM_OK ||
            (rc = eval(r, nd->kids[i + 1], sc, &b)) != TDM_OK)
            return rc;
        if (a.kind == V_LIST && !a.u.list->tuple)
            return chat_rerr(r, TDM_EINVAL, "unhashable type: 'list'");
        if (a.kind == V_DICT)
            return chat_rerr(r, TDM_EINVAL, "unhashable type: 'dict'");
        if ((rc = chat_v_dict_set(r, out->u.dict, a, b)) != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

static int eval(struct render *r, const struct node *nd, struct scope *sc, struct val *out)
{
    if (!chat_charge(r, 1) || !chat_stack_ok(r))
        return r->rc;
    struct val a, b;
    int rc;
    switch (nd->kind) {
    case N_CONST:
        *out = nd->v;
        return TDM_OK;
    case N_NAME:
        return lookup(r, sc, nd->s, nd->sn, out);
    case N_GETATTR:
        if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK)
            return rc;
        return chat_get_attr(r, a, nd->s, nd->sn, out);
    case N_GETITEM:
        if ((rc = eval(r, nd->a, sc, &a)) != TDM_OK || (rc = eval(r, nd->b, sc, &b)) != TDM_OK)
            return rc;
        return chat_get_item(r, a, b, out);
    case N_SLICE:
        return eval_slice(r, nd, sc, out);
    case N_CALL:
        return eval_call(r, nd, sc, NULL, out);
    case N_FILTER:
        return eval_filter(r, nd, sc, NULL, out);
    case N_TEST:
        return eval_test(r, nd, sc, out);
    case N_UNARY:
        return eval_unary(r, nd, sc, out);
    case N_BINARY:
        return eval_binary(r, nd, sc, out);
    case N_COMPARE:
        return eval_compare(r, nd, sc, out);
    case N_COND:
        if ((rc = eval(r, nd->b, sc, &a)) != TDM_OK)
            return rc;
        if (chat_v_truthy(a))
            return eval(r, nd->a, sc, out);
        if (nd->c)
            return eval(r, nd->c, sc, out);
        *out = chat_v_undef(NULL);
        return TDM_OK;
    case N_LIST:
    case N_TUPLE:
        return eval_list(r, nd, sc, out);
    case N_DICT:
        return eval_dict(r, nd, sc, out);
    default:
        return chat_rerr(r, TDM_EINVAL, "internal: statement node used as an expression");
    }
}

// ---- statements ----------------------------------------------------------------------

static int assign_targets(struct render *r, struct scope *sc, const char *const *names, size_t n,
                          struct val v)
{
    if (n == 1)
        return scope_set(r, sc, names[0], v);
    struct val items;
    if (chat_v_iterate(r, v, &items) != TDM_OK)
        return r->rc;
    if (items.u.list->n != n)
        return chat_rerr(r, TDM_EINVAL, "cannot unpack %zu values into %zu names", items.u.list->n,
                         n);
    for (size_t i = 0; i < n; i++)
        if (scope_set(r, sc, names[i], items.u.list->items[i]) != TDM_OK)
            return r->rc;
    return TDM_OK;
}

static int exec_for(struct render *r, const struct node *nd, struct scope *sc)
{
    struct val seq, items;
    if (eval(r, nd->a, sc, &seq) != TDM_OK || chat_v_iterate(r, seq, &items) != TDM_OK)
        return r->rc;
    struct scope *ls = NULL;
    if (scope_new(r, sc, &ls) != TDM_OK)
        return r->rc;
    const char *const *targets = nd->names;
    if (nd->d) { // {% for x in xs if cond %}: filter first, so loop.length counts the kept
        struct val kept;
        if (chat_v_list_new(r, 0, &kept) != TDM_OK)
            return r->rc;
        for (size_t i = 0; i < items.u.list->n; i++) {
            struct val c;
            if (++r->iterations > CHAT_MAX_ITERATIONS)
                return chat_rerr(r, TDM_ECAPACITY, "more than %d loop iterations (limit)",
                                 CHAT_MAX_ITERATIONS);
            if (assign_targets(r, ls, targets, nd->nnames, items.u.list->items[i]) != TDM_OK ||
                eval(r, nd->d, ls, &c) != TDM_OK)
                return r->rc;
            if (chat_v_truthy(c) &&
                chat_v_list_push(r, kept.u.list, items.u.list->items[i]) != TDM_OK)
                return r->rc;
        }
        items = kept;
    }
    size_t n = items.u.list->n;
    if (n == 0)
        return nd->c ? exec(r, nd->c, sc) : TDM_OK;
    struct loopinfo *li = chat_arena_alloc(&r->arena, sizeof *li);
    if (!li)
        return chat_rerr(r, TDM_ECAPACITY, "rendering needs more than %u MiB of values (limit)",
                         CHAT_MAX_ARENA >> 20);
    li->length = (int64_t)n;
    struct val loopv = {.kind = V_LOOP, .u.loop = li};
    for (size_t i = 0; i < n; i++) {
        if (++r->iterations > CHAT_MAX_ITERATIONS)
            return chat_rerr(r, TDM_ECAPACITY, "more than %d loop iterations (limit)",
                             CHAT_MAX_ITERATIONS);
        li->index0 = (int64_t)i;
        li->prev = i > 0 ? items.u.list->items[i - 1] : chat_v_undef("previtem");
        li->next = i + 1 < n ? items.u.list->items[i + 1] : chat_v_undef("nextitem");
        if (assign_targets(r, ls, targets, nd->nnames, items.u.list->items[i]) != TDM_OK ||
            scope_set(r, ls, "loop", loopv) != TDM_OK)
            return r->rc;
        if (exec(r, nd->b, ls) != TDM_OK)
            return r->rc;
        int ctl = r->loop_ctl;
        r->loop_ctl = 0;
        if (ctl == 1)
            break;
    }
    return TDM_OK;
}

static int exec(struct render *r, const struct node *nd, struct scope *sc)
{
    struct val v;
    int rc;
    if (!chat_charge(r, 1) || !chat_stack_ok(r))
        return r->rc;
    if (nd->kind != N_BODY)
        r->line = nd->line;
    switch (nd->kind) {
    case N_BODY:
        for (size_t i = 0; i < nd->nkids; i++) {
            if ((rc = exec(r, nd->kids[i], sc)) != TDM_OK)
                return rc;
            if (r->loop_ctl)
                break;
        }
        return TDM_OK;
    case N_TEXT:
        return emit(r, nd->s, nd->sn);
    case N_OUTPUT: {
        if ((rc = eval(r, nd->a, sc, &v)) != TDM_OK)
            return rc;
        if (v.kind == V_STR)
            return emit(r, v.u.str.s, v.u.str.n);
        rc = chat_v_to_text(r, v, r->out);
        return rc;
    }
    case N_IF:
        if ((rc = eval(r, nd->a, sc, &v)) != TDM_OK)
            return rc;
        if (chat_v_truthy(v))
            return exec(r, nd->b, sc);
        return nd->c ? exec(r, nd->c, sc) : TDM_OK;
    case N_FOR:
        return exec_for(r, nd, sc);
    case N_SET:
        if ((rc = eval(r, nd->b, sc, &v)) != TDM_OK)
            return rc;
        if (nd->a) { // ns.attr = v
            struct val ns;
            if ((rc = eval(r, nd->a->a, sc, &ns)) != TDM_OK)
                return rc;
            if (ns.kind != V_NS)
                return chat_rerr(r, TDM_EINVAL,
                                 "cannot assign attribute on non-namespace object '%s'",
                                 nd->a->a->s);
            return chat_v_dict_set(r, ns.u.dict, chat_v_strn(nd->a->s, nd->a->sn), v);
        }
        return assign_targets(r, sc, nd->names, nd->nnames, v);
    case N_SET_BLOCK:
        if ((rc = capture(r, nd->b, sc, &v)) != TDM_OK)
            return rc;
        if (nd->d && (rc = eval_filter(r, nd->d, sc, &v, &v)) != TDM_OK)
            return rc;
        return scope_set(r, sc, nd->s, v);
    case N_MACRO:
        v = (struct val){.kind = V_MACRO, .u.macro = nd, .closure = sc};
        return scope_set(r, sc, nd->s, v);
    case N_CALL_BLOCK: {
        struct val caller = {.kind = V_MACRO, .u.macro = nd, .closure = sc};
        if ((rc = eval_call(r, nd->a, sc, &caller, &v)) != TDM_OK)
            return rc;
        return chat_v_to_text(r, v, r->out);
    }
    case N_FILTER_BLOCK:
        if ((rc = capture(r, nd->b, sc, &v)) != TDM_OK ||
            (rc = eval_filter(r, nd->d, sc, &v, &v)) != TDM_OK)
            return rc;
        return chat_v_to_text(r, v, r->out);
    case N_BREAK:
        r->loop_ctl = 1;
        return TDM_OK;
    case N_CONTINUE:
        r->loop_ctl = 2;
        return TDM_OK;
    default:
        return chat_rerr(r, TDM_EINVAL, "internal: expression node used as a statement");
    }
}

int chat_eval_render(struct render *r, const struct node *root)
{
    int rc = exec(r, root, r->globals);
    if (rc == TDM_OK && r->rc != TDM_OK)
        rc = r->rc;
    return rc;
}
