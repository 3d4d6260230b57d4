// SPDX-License-Identifier: Apache-2.0
// metrics: registry, lock-free series updates and the 0.0.4 text exposition.
//
// Layout: the registry keeps a singly linked list of families, a family a
// singly linked list of child series, both appended at the tail under the
// registry mutex and published with release stores, so render and child lookup
// walk them with acquire loads and no lock. Nothing is ever unlinked before
// tdm_metrics_registry_free. Each series pre-renders its sorted label pairs at
// creation so rendering only copies strings and formats numbers.
//
// Values are doubles kept as their IEEE bits in _Atomic uint64_t: a store for
// set, a compare-and-swap loop for add. Histogram buckets are non-cumulative
// atomic counts ([n_bounds + 1], the last one is +Inf); rendering accumulates
// them once, which makes `_count` equal the `+Inf` bucket and every bucket line
// monotone even while observations land. All atomics are relaxed: a metric
// needs no ordering with other memory, only no lost updates.
#include "metrics.h"

#include "core.h"

#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum family_kind { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM };

struct label_pair {
    char *name;
    char *value;
};

struct family;

// One exported series (or a labelled family's unexported root).
struct series {
    struct family *family;
    _Atomic(struct series *) next; // next child of the family, in creation order
    uint64_t hash;                 // of values, to skip most string compares on lookup
    char **values;                 // [family->n_label_names] for a child; NULL for the root
    // Sorted `name="value"` pairs, comma separated, no braces. For histograms the
    // pairs that sort before "le" are in labels_pre (each followed by ','), the
    // rest in labels_post (each preceded by ','), so `le` drops in between.
    char *labels;
    char *labels_pre;
    char *labels_post;
    _Atomic uint64_t value_bits; // counter or gauge value, double bits
    _Atomic uint64_t sum_bits;   // histogram sum, double bits
    _Atomic uint64_t *buckets;   // [n_bounds + 1] non-cumulative counts; histogram only
};

// The public handle types are a series each, so a handle converts to and from
// its series by the first-member rule.
struct tdm_metrics_counter {
    struct series s;
};
struct tdm_metrics_gauge {
    struct series s;
};
struct tdm_metrics_histogram {
    struct series s;
};

struct family {
    struct tdm_metrics_registry *reg;
    _Atomic(struct family *) next; // next family in registration order
    enum family_kind kind;
    char *name;                      // base name (a counter's without "_total")
    char *help;                      // escaped for the HELP line
    struct label_pair *const_labels; // [n_const_labels] registry's (unless opted out) + own
    size_t n_const_labels;
    char **label_names; // [n_label_names] variable label names
    size_t n_label_names;
    double *bounds; // [n_bounds] histogram upper bounds, strictly increasing
    size_t n_bounds;
    struct series *root;
    _Atomic(struct series *) children; // head of the child list
    struct series *children_tail;      // under reg->lock
};

struct tdm_metrics_registry {
    pthread_mutex_t lock; // registration and child creation
    struct label_pair *const_labels;
    size_t n_const_labels;
    _Atomic(struct family *) families;
    struct family *families_tail; // under lock
};

// ---- small helpers -----------------------------------------------------------------------

static uint64_t double_bits(double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static double bits_double(uint64_t u)
{
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

// Adds d to the double whose bits live in *bits, without losing concurrent adds.
static void atomic_add_double(_Atomic uint64_t *bits, double d)
{
    uint64_t old = atomic_load_explicit(bits, memory_order_relaxed);
    for (;;) {
        uint64_t next = double_bits(bits_double(old) + d);
        if (atomic_compare_exchange_weak_explicit(bits, &old, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            return;
    }
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static bool valid_metric_name(const char *s)
{
    if (!s || !*s)
        return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

static bool valid_label_name(const char *s)
{
    if (!s || !*s || (s[0] == '_' && s[1] == '_'))
        return false;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' ||
                  (i > 0 && c >= '0' && c <= '9');
        if (!ok)
            return false;
    }
    return true;
}

static void free_pairs(struct label_pair *pairs, size_t n)
{
    if (!pairs)
        return;
    for (size_t i = 0; i < n; i++) {
        free(pairs[i].name);
        free(pairs[i].value);
    }
    free(pairs);
}

// ---- growable text buffer ---------------------------------------------------------------

static bool text_reserve(struct tdm_strbuf *t, size_t more)
{
    return tdm_strbuf_reserve(t, more) == TDM_OK;
}

// Appended unchecked: the text fails for good on an allocation failure
// (t->failed), checked once at the end.
static void text_putn(struct tdm_strbuf *t, const char *s, size_t n)
{
    (void)tdm_strbuf_add(t, s, n);
}

static void text_put(struct tdm_strbuf *t, const char *s)
{
    text_putn(t, s, strlen(s));
}

static void text_putc(struct tdm_strbuf *t, char c)
{
    text_putn(t, &c, 1);
}

// Label values escape backslash, double quote and newline; HELP text escapes
// only backslash and newline (text format 0.0.4).
static void text_put_escaped(struct tdm_strbuf *t, const char *s, bool quote)
{
    for (; *s; s++) {
        if (*s == '\\')
            text_putn(t, "\\\\", 2);
        else if (*s == '\n')
            text_putn(t, "\\n", 2);
        else if (quote && *s == '"')
            text_putn(t, "\\\"", 2);
        else
            text_putc(t, *s);
    }
}

static void text_put_double(struct tdm_strbuf *t, double v)
{
    char num[32];
    size_t n = tdm_metrics_format_double(num, v);
    text_putn(t, num, n);
}

// ---- number formatting ------------------------------------------------------------------

// Finds the shortest decimal digits that read back as v (finite, nonzero):
// digits[] gets them without a dot, the return is their count, *exp10 the
// exponent of the first digit (v = d.ddd * 10^exp10).
static int shortest_digits(double v, char digits[24], int *exp10)
{
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, v);
        if (prec < 17 && strtod(buf, NULL) != v)
            continue;
        int nd = 0;
        const char *p = buf;
        if (*p == '-')
            p++;
        for (; *p && *p != 'e'; p++)
            if (*p >= '0' && *p <= '9')
                digits[nd++] = *p;
        digits[nd] = '\0';
        *exp10 = *p == 'e' ? atoi(p + 1) : 0;
        while (nd > 1 && digits[nd - 1] == '0')
            digits[--nd] = '\0';
        return nd;
    }
    return 0; // not reached: precision 17 always returns
}

// Lays out sign, digits and exponent in fixed or exponent notation. Exponent
// form when exp10 < -4 or exp10 >= exp_limit; py_style adds ".0" to whole
// numbers in fixed form as Python's repr does.
static size_t layout_digits(char dst[32], bool neg, const char *digits, int nd, int exp10,
                            int exp_limit, bool py_style)
{
    size_t n = 0;
    if (neg)
        dst[n++] = '-';
    if (exp10 < -4 || exp10 >= exp_limit) {
        dst[n++] = digits[0];
        if (nd > 1) {
            dst[n++] = '.';
            for (int i = 1; i < nd; i++)
                dst[n++] = digits[i];
        }
        n += (size_t)snprintf(dst + n, 32 - n, "e%c%02d", exp10 < 0 ? '-' : '+',
                              exp10 < 0 ? -exp10 : exp10);
        return n;
    }
    if (exp10 < 0) {
        dst[n++] = '0';
        dst[n++] = '.';
        for (int i = -1; i > exp10; i--)
            dst[n++] = '0';
        for (int i = 0; i < nd; i++)
            dst[n++] = digits[i];
    } else {
        for (int i = 0; i <= exp10; i++)
            dst[n++] = i < nd ? digits[i] : '0';
        if (nd > exp10 + 1) {
            dst[n++] = '.';
            for (int i = exp10 + 1; i < nd; i++)
                dst[n++] = digits[i];
        } else if (py_style) {
            dst[n++] = '.';
            dst[n++] = '0';
        }
    }
    dst[n] = '\0';
    return n;
}

size_t tdm_metrics_format_double(char dst[32], double v)
{
    if (isnan(v))
        return (size_t)snprintf(dst, 32, "NaN");
    if (isinf(v))
        return (size_t)snprintf(dst, 32, v > 0 ? "+Inf" : "-Inf");
    // Whole numbers an IEEE double holds exactly print as integers, so token
    // counters read "123456789" rather than Go's "1.23456789e+08".
    if (v == floor(v) && fabs(v) < 9007199254740992.0)
        return (size_t)snprintf(dst, 32, "%" PRId64, (int64_t)v);
    char digits[24];
    int exp10 = 0;
    int nd = shortest_digits(fabs(v), digits, &exp10);
    // Go's strconv 'g' with shortest precision switches to exponents at 1e6;
    // prometheus_client's floatToGoString copies that.
    return layout_digits(dst, v < 0, digits, nd, exp10, 6, false);
}

// Python's str(float), for vLLM's info labels (gpu_memory_utilization="0.9").
static size_t format_py_float(char dst[32], double v)
{
    if (isnan(v))
        return (size_t)snprintf(dst, 32, "nan");
    if (isinf(v))
        return (size_t)snprintf(dst, 32, v > 0 ? "inf" : "-inf");
    if (v == 0)
        return (size_t)snprintf(dst, 32, signbit(v) ? "-0.0" : "0.0");
    char digits[24];
    int exp10 = 0;
    int nd = shortest_digits(fabs(v), digits, &exp10);
    return layout_digits(dst, v < 0, digits, nd, exp10, 16, true);
}

// A histogram bound as prometheus_client's floatToGoString writes `le`: Python's
// repr, switched to an exponent once seven or more digits precede the dot
// ("2560.0", "0.001", "1e+06"). Label values are part of a series' identity, so
// matching vLLM byte for byte keeps queries such as {le="1.0"} working. The
// "e+0" prefix is Python's too (it would write "e+010" for 1e10).
static size_t format_le(char dst[32], double v)
{
    if (isinf(v))
        return (size_t)snprintf(dst, 32, v > 0 ? "+Inf" : "-Inf");
    if (isnan(v))
        return (size_t)snprintf(dst, 32, "NaN");
    char repr[32];
    size_t n = format_py_float(repr, v);
    const char *dot = strchr(repr, '.');
    size_t dotpos = dot ? (size_t)(dot - repr) : 0;
    if (!(v > 0) || !dot || dotpos <= 6 || strchr(repr, 'e')) {
        memcpy(dst, repr, n + 1);
        return n;
    }
    char mantissa[40];
    size_t m = 0;
    mantissa[m++] = repr[0];
    mantissa[m++] = '.';
    for (size_t i = 1; i < n; i++)
        if (i != dotpos)
            mantissa[m++] = repr[i];
    while (m > 0 && (mantissa[m - 1] == '0' || mantissa[m - 1] == '.'))
        m--;
    mantissa[m] = '\0';
    // At most 17 digits, a dot and "e+0NN": always fits in 32.
    char out[64];
    int len = snprintf(out, sizeof out, "%se+0%zu", mantissa, dotpos - 1);
    size_t k = len < 31 ? (size_t)len : 31;
    memcpy(dst, out, k);
    dst[k] = '\0';
    return k;
}

// ---- labels -----------------------------------------------------------------------------

static int cmp_pair(const void *a, const void *b)
{
    const struct label_pair *x = a, *y = b;
    return strcmp(x->name, y->name);
}

// Gives back a built string's unused capacity (kept as is if realloc fails).
static char *shrink(char *p, size_t len)
{
    char *q = realloc(p, len + 1);
    return q ? q : p;
}

static void put_pair(struct tdm_strbuf *t, const struct label_pair *p)
{
    text_put(t, p->name);
    text_putn(t, "=\"", 2);
    text_put_escaped(t, p->value, true);
    text_putc(t, '"');
}

// Pre-renders s's label strings from the family's constant labels and the
// child's values (NULL for a root). Returns TDM_OK or TDM_ENOMEM.
static int series_render_labels(struct series *s, const struct family *f, char *const *values)
{
    size_t n = f->n_const_labels + (values ? f->n_label_names : 0);
    struct label_pair *all = calloc(n ? n : 1, sizeof *all);
    struct tdm_strbuf full = {0}, pre = {0}, post = {0};
    if (!all)
        return TDM_ENOMEM;
    for (size_t i = 0; i < f->n_const_labels; i++)
        all[i] = f->const_labels[i];
    for (size_t i = 0; values && i < f->n_label_names; i++) {
        all[f->n_const_labels + i].name = f->label_names[i];
        all[f->n_const_labels + i].value = values[i];
    }
    // prometheus_client (and client_golang) write label pairs sorted by name.
    qsort(all, n, sizeof *all, cmp_pair);
    text_reserve(&full, 0);
    text_reserve(&pre, 0);
    text_reserve(&post, 0);
    for (size_t i = 0; i < n; i++) {
        if (i)
            text_putc(&full, ',');
        put_pair(&full, &all[i]);
        if (strcmp(all[i].name, "le") < 0) {
            put_pair(&pre, &all[i]);
            text_putc(&pre, ',');
        } else {
            text_putc(&post, ',');
            put_pair(&post, &all[i]);
        }
    }
    free(all);
    if (full.failed || pre.failed || post.failed) {
        free(full.p);
        free(pre.p);
        free(post.p);
        return TDM_ENOMEM;
    }
    s->labels = shrink(full.p, full.len);
    s->labels_pre = shrink(pre.p, pre.len);
    s->labels_post = shrink(post.p, post.len);
    return TDM_OK;
}

static void series_free(struct series *s)
{
    if (!s)
        return;
    if (s->values) {
        for (size_t i = 0; i < s->family->n_label_names; i++)
            free(s->values[i]);
        free(s->values);
    }
    free(s->labels);
    free(s->labels_pre);
    free(s->labels_post);
    free(s->buckets);
    free(s);
}

static uint64_t hash_values(const char *const *values, size_t n)
{
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (size_t i = 0; i < n; i++) {
        for (const unsigned char *p = (const unsigned char *)values[i]; *p; p++)
            h = (h ^ *p) * 1099511628211ull;
        h = (h ^ 0xff) * 1099511628211ull; // separator: ("a","b") != ("ab","")
    }
    return h;
}

// Makes a series for family f (values NULL: the root). The handle types are one
// struct series each, so allocating the kind's own type keeps the casts valid.
static struct series *series_new(struct family *f, const char *const *values)
{
    struct series *s;
    switch (f->kind) {
    case KIND_COUNTER:
        s = (struct series *)calloc(1, sizeof(struct tdm_metrics_counter));
        break;
    case KIND_GAUGE:
        s = (struct series *)calloc(1, sizeof(struct tdm_metrics_gauge));
        break;
    default:
        s = (struct series *)calloc(1, sizeof(struct tdm_metrics_histogram));
        break;
    }
    if (!s)
        return NULL;
    s->family = f;
    atomic_init(&s->next, NULL);
    atomic_init(&s->value_bits, double_bits(0.0));
    atomic_init(&s->sum_bits, double_bits(0.0));
    if (f->kind == KIND_HISTOGRAM) {
        s->buckets = calloc(f->n_bounds + 1, sizeof *s->buckets);
        if (!s->buckets)
            goto fail;
        for (size_t i = 0; i <= f->n_bounds; i++)
            atomic_init(&s->buckets[i], 0);
    }
    if (values) {
        s->values = calloc(f->n_label_names ? f->n_label_names : 1, sizeof *s->values);
        if (!s->values)
            goto fail;
        for (size_t i = 0; i < f->n_label_names; i++)
            if (!(s->values[i] = dup_str(values[i])))
                goto fail;
        s->hash = hash_values(values, f->n_label_names);
    }
    if (series_render_labels(s, f, s->values) != TDM_OK)
        goto fail;
    return s;
fail:
    series_free(s);
    return NULL;
}

// ---- registry -----------------------------------------------------------------------------

// Copies n pairs into *out after checking names (and no duplicates).
static int copy_pairs(struct label_pair **out, const struct tdm_metrics_label *in, size_t n,
                      char *err, size_t errlen)
{
    *out = NULL;
    if (n == 0)
        return TDM_OK;
    if (!in)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %zu labels given as NULL", n);
    struct label_pair *pairs = calloc(n, sizeof *pairs);
    if (!pairs)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
    for (size_t i = 0; i < n; i++) {
        if (!valid_label_name(in[i].name) || !in[i].value) {
            free_pairs(pairs, n);
            return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: bad label %s=%s",
                              in[i].name ? in[i].name : "(null)",
                              in[i].value ? in[i].value : "(null)");
        }
        pairs[i].name = dup_str(in[i].name);
        pairs[i].value = dup_str(in[i].value);
        if (!pairs[i].name || !pairs[i].value) {
            free_pairs(pairs, n);
            return tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
        }
    }
    *out = pairs;
    return TDM_OK;
}

int tdm_metrics_registry_new(struct tdm_metrics_registry **out,
                             const struct tdm_metrics_label *const_labels, size_t n_const_labels,
                             char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_metrics_registry *reg = calloc(1, sizeof *reg);
    if (!reg)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
    int rc = copy_pairs(&reg->const_labels, const_labels, n_const_labels, err, errlen);
    if (rc != TDM_OK)
        goto fail_reg;
    reg->n_const_labels = n_const_labels;
    for (size_t i = 0; i < n_const_labels; i++)
        for (size_t j = 0; j < i; j++)
            if (strcmp(const_labels[i].name, const_labels[j].name) == 0) {
                rc = tdm_seterr(err, errlen, TDM_EINVAL, "metrics: duplicate label %s",
                                const_labels[i].name);
                goto fail_pairs;
            }
    if (pthread_mutex_init(&reg->lock, NULL) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: cannot create mutex");
        goto fail_pairs;
    }
    atomic_init(&reg->families, NULL);
    *out = reg;
    return TDM_OK;
fail_pairs:
    free_pairs(reg->const_labels, reg->n_const_labels);
fail_reg:
    free(reg);
    return rc;
}

static void family_free(struct family *f)
{
    if (!f)
        return;
    struct series *s = atomic_load_explicit(&f->children, memory_order_relaxed);
    while (s) {
        struct series *next = atomic_load_explicit(&s->next, memory_order_relaxed);
        series_free(s);
        s = next;
    }
    series_free(f->root);
    free(f->name);
    free(f->help);
    free_pairs(f->const_labels, f->n_const_labels);
    if (f->label_names)
        for (size_t i = 0; i < f->n_label_names; i++)
            free(f->label_names[i]);
    free(f->label_names);
    free(f->bounds);
    free(f);
}

void tdm_metrics_registry_free(struct tdm_metrics_registry *reg)
{
    if (!reg)
        return;
    struct family *f = atomic_load_explicit(&reg->families, memory_order_relaxed);
    while (f) {
        struct family *next = atomic_load_explicit(&f->next, memory_order_relaxed);
        family_free(f);
        f = next;
    }
    free_pairs(reg->const_labels, reg->n_const_labels);
    pthread_mutex_destroy(&reg->lock);
    free(reg);
}

// The sample names a family exports (and reserves, as prometheus_client does).
// Returns how many were written to names[4][...].
static size_t family_series_names(enum family_kind kind, const char *base, char names[4][300])
{
    switch (kind) {
    case KIND_COUNTER:
        snprintf(names[0], 300, "%s", base);
        snprintf(names[1], 300, "%s_total", base);
        return 2;
    case KIND_GAUGE:
        snprintf(names[0], 300, "%s", base);
        return 1;
    default:
        snprintf(names[0], 300, "%s", base);
        snprintf(names[1], 300, "%s_bucket", base);
        snprintf(names[2], 300, "%s_sum", base);
        snprintf(names[3], 300, "%s_count", base);
        return 4;
    }
}

// Under reg->lock: TDM_OK when no registered family exports a name f would.
static int check_collision(const struct tdm_metrics_registry *reg, enum family_kind kind,
                           const char *base, char *err, size_t errlen)
{
    char mine[4][300], theirs[4][300];
    size_t n_mine = family_series_names(kind, base, mine);
    for (const struct family *g = atomic_load_explicit(&reg->families, memory_order_relaxed); g;
         g = atomic_load_explicit(&g->next, memory_order_relaxed)) {
        size_t n_theirs = family_series_names(g->kind, g->name, theirs);
        for (size_t i = 0; i < n_mine; i++)
            for (size_t j = 0; j < n_theirs; j++)
                if (strcmp(mine[i], theirs[j]) == 0)
                    return tdm_seterr(err, errlen, TDM_EINVAL,
                                      "metrics: %s collides with registered family %s", mine[i],
                                      g->name);
    }
    return TDM_OK;
}

static char *escape_help(const char *help)
{
    struct tdm_strbuf t = {0};
    text_reserve(&t, 0);
    text_put_escaped(&t, help ? help : "", false);
    if (t.failed) {
        free(t.p);
        return NULL;
    }
    return t.p;
}

// Label i of a family in the order registry const labels (n_reg of them), the family's const
// labels, then its variable label names.
static const char *family_label_name(const struct tdm_metrics_registry *reg,
                                     const struct tdm_metrics_opts *opts, size_t n_reg, size_t i)
{
    return i < n_reg                          ? reg->const_labels[i].name
           : i < n_reg + opts->n_const_labels ? opts->const_labels[i - n_reg].name
                                              : opts->label_names[i - n_reg - opts->n_const_labels];
}

// Every label name of the family must be valid ("le" is the histogram's own), unique, and a
// const label must have a value.
static int check_label_names(const struct tdm_metrics_registry *reg, enum family_kind kind,
                             const struct tdm_metrics_opts *opts, size_t n_reg, char *err,
                             size_t errlen)
{
    size_t n_all = n_reg + opts->n_const_labels + opts->n_label_names;
    for (size_t i = 0; i < n_all; i++) {
        const char *a = family_label_name(reg, opts, n_reg, i);
        if (!valid_label_name(a) || (kind == KIND_HISTOGRAM && strcmp(a, "le") == 0))
            return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %s: bad label name '%s'",
                              opts->name, a ? a : "(null)");
        if (i >= n_reg && i < n_reg + opts->n_const_labels && !opts->const_labels[i - n_reg].value)
            return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %s: label %s has no value",
                              opts->name, a);
        for (size_t j = 0; j < i; j++) {
            const char *b = family_label_name(reg, opts, n_reg, j);
            if (strcmp(a, b) == 0)
                return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %s: duplicate label '%s'",
                                  opts->name, a);
        }
    }
    return TDM_OK;
}

// A histogram's bucket bounds must be finite and increasing; a trailing +Inf is implicit, so
// *n_bounds drops it and the +Inf line is written once.
static int check_bounds(const char *name, const double *bounds, size_t *n_bounds, char *err,
                        size_t errlen)
{
    size_t n = *n_bounds;
    if (n && !bounds)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %s: bounds are NULL", name);
    if (n && isinf(bounds[n - 1]) && bounds[n - 1] > 0)
        n--;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(bounds[i]) || (i > 0 && !(bounds[i] > bounds[i - 1])))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "metrics: %s: bucket bound %zu is not finite and increasing", name,
                              i);
    }
    *n_bounds = n;
    return TDM_OK;
}

// Fills f (f->reg set) with copies of its name (name_len bytes of opts->name), help, labels and
// bounds, and its root series. Returns TDM_OK or TDM_ENOMEM, leaving what it built in f for
// family_free.
static int family_fill(struct family *f, const struct tdm_metrics_opts *opts, size_t name_len,
                       size_t n_reg, const double *bounds, size_t n_bounds)
{
    const struct tdm_metrics_registry *reg = f->reg;
    f->name = malloc(name_len + 1);
    f->help = escape_help(opts->help);
    if (!f->name || !f->help)
        return TDM_ENOMEM;
    memcpy(f->name, opts->name, name_len);
    f->name[name_len] = '\0';
    f->n_const_labels = n_reg + opts->n_const_labels;
    if (f->n_const_labels) {
        f->const_labels = calloc(f->n_const_labels, sizeof *f->const_labels);
        if (!f->const_labels)
            return TDM_ENOMEM;
        for (size_t i = 0; i < f->n_const_labels; i++) {
            const char *nm =
                i < n_reg ? reg->const_labels[i].name : opts->const_labels[i - n_reg].name;
            const char *val =
                i < n_reg ? reg->const_labels[i].value : opts->const_labels[i - n_reg].value;
            f->const_labels[i].name = dup_str(nm);
            f->const_labels[i].value = dup_str(val);
            if (!f->const_labels[i].name || !f->const_labels[i].value)
                return TDM_ENOMEM;
        }
    }
    if (opts->n_label_names) {
        f->label_names = calloc(opts->n_label_names, sizeof *f->label_names);
        if (!f->label_names)
            return TDM_ENOMEM;
        f->n_label_names = opts->n_label_names;
        for (size_t i = 0; i < opts->n_label_names; i++)
            if (!(f->label_names[i] = dup_str(opts->label_names[i])))
                return TDM_ENOMEM;
    }
    if (n_bounds) {
        f->bounds = malloc(n_bounds * sizeof *f->bounds);
        if (!f->bounds)
            return TDM_ENOMEM;
        memcpy(f->bounds, bounds, n_bounds * sizeof *f->bounds);
    }
    f->n_bounds = n_bounds;
    if (!(f->root = series_new(f, NULL)))
        return TDM_ENOMEM;
    return TDM_OK;
}

// Builds and links a family; on success *out_root is its root series.
static int family_register(struct series **out_root, struct tdm_metrics_registry *reg,
                           enum family_kind kind, const struct tdm_metrics_opts *opts,
                           const double *bounds, size_t n_bounds, char *err, size_t errlen)
{
    *out_root = NULL;
    if (!reg || !opts)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: NULL registry or options");
    if (!valid_metric_name(opts->name))
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: bad metric name '%s'",
                          opts->name ? opts->name : "(null)");
    size_t name_len = strlen(opts->name);
    if (name_len > 200)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: metric name too long (%zu)", name_len);
    if (kind == KIND_COUNTER && name_len > 6 && strcmp(opts->name + name_len - 6, "_total") == 0)
        name_len -= 6;
    if ((opts->n_label_names && !opts->label_names) ||
        (opts->n_const_labels && !opts->const_labels))
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: %s: label array is NULL", opts->name);
    size_t n_reg = opts->no_registry_labels ? 0 : reg->n_const_labels;
    int rc = check_label_names(reg, kind, opts, n_reg, err, errlen);
    if (rc == TDM_OK && kind == KIND_HISTOGRAM)
        rc = check_bounds(opts->name, bounds, &n_bounds, err, errlen);
    if (rc != TDM_OK)
        return rc;

    struct family *f = calloc(1, sizeof *f);
    if (!f)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
    f->reg = reg;
    f->kind = kind;
    atomic_init(&f->next, NULL);
    atomic_init(&f->children, NULL);
    if ((rc = family_fill(f, opts, name_len, n_reg, bounds, n_bounds)) != TDM_OK) {
        tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
        goto fail;
    }

    pthread_mutex_lock(&reg->lock);
    rc = check_collision(reg, kind, f->name, err, errlen);
    if (rc != TDM_OK) {
        pthread_mutex_unlock(&reg->lock);
        goto fail;
    }
    if (reg->families_tail)
        atomic_store_explicit(&reg->families_tail->next, f, memory_order_release);
    else
        atomic_store_explicit(&reg->families, f, memory_order_release);
    reg->families_tail = f;
    pthread_mutex_unlock(&reg->lock);
    *out_root = f->root;
    return TDM_OK;
fail:
    family_free(f);
    return rc;
}

int tdm_metrics_counter_register(struct tdm_metrics_counter **out, struct tdm_metrics_registry *reg,
                                 const struct tdm_metrics_opts *opts, char *err, size_t errlen)
{
    struct series *s;
    int rc = family_register(&s, reg, KIND_COUNTER, opts, NULL, 0, err, errlen);
    *out = (struct tdm_metrics_counter *)s;
    return rc;
}

int tdm_metrics_gauge_register(struct tdm_metrics_gauge **out, struct tdm_metrics_registry *reg,
                               const struct tdm_metrics_opts *opts, char *err, size_t errlen)
{
    struct series *s;
    int rc = family_register(&s, reg, KIND_GAUGE, opts, NULL, 0, err, errlen);
    *out = (struct tdm_metrics_gauge *)s;
    return rc;
}

int tdm_metrics_histogram_register(struct tdm_metrics_histogram **out,
                                   struct tdm_metrics_registry *reg,
                                   const struct tdm_metrics_opts *opts, const double *bounds,
                                   size_t n_bounds, char *err, size_t errlen)
{
    struct series *s;
    int rc = family_register(&s, reg, KIND_HISTOGRAM, opts, bounds, n_bounds, err, errlen);
    *out = (struct tdm_metrics_histogram *)s;
    return rc;
}

int tdm_metrics_info_register(struct tdm_metrics_gauge **out, struct tdm_metrics_registry *reg,
                              const struct tdm_metrics_opts *opts, char *err, size_t errlen)
{
    *out = NULL;
    if (opts && opts->n_label_names)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "metrics: info metric %s cannot have variable labels",
                          opts->name ? opts->name : "(null)");
    int rc = tdm_metrics_gauge_register(out, reg, opts, err, errlen);
    if (rc == TDM_OK)
        tdm_metrics_gauge_set(*out, 1.0);
    return rc;
}

// ---- children -----------------------------------------------------------------------------

static struct series *find_child(struct family *f, const char *const *values, uint64_t hash)
{
    for (struct series *s = atomic_load_explicit(&f->children, memory_order_acquire); s;
         s = atomic_load_explicit(&s->next, memory_order_acquire)) {
        if (s->hash != hash)
            continue;
        size_t i = 0;
        while (i < f->n_label_names && strcmp(s->values[i], values[i]) == 0)
            i++;
        if (i == f->n_label_names)
            return s;
    }
    return NULL;
}

static struct series *series_labels(struct series *root, const char *const *values, size_t n_values)
{
    if (!root || root->values || !root->family->n_label_names ||
        n_values != root->family->n_label_names || !values)
        return NULL;
    for (size_t i = 0; i < n_values; i++)
        if (!values[i])
            return NULL;
    struct family *f = root->family;
    uint64_t hash = hash_values(values, n_values);
    struct series *s = find_child(f, values, hash);
    if (s)
        return s;
    pthread_mutex_lock(&f->reg->lock);
    s = find_child(f, values, hash); // another thread may have made it meanwhile
    if (!s && (s = series_new(f, values))) {
        if (f->children_tail)
            atomic_store_explicit(&f->children_tail->next, s, memory_order_release);
        else
            atomic_store_explicit(&f->children, s, memory_order_release);
        f->children_tail = s;
    }
    pthread_mutex_unlock(&f->reg->lock);
    return s;
}

struct tdm_metrics_counter *tdm_metrics_counter_labelsv(struct tdm_metrics_counter *family,
                                                        const char *const *values, size_t n_values)
{
    return (struct tdm_metrics_counter *)series_labels(family ? &family->s : NULL, values,
                                                       n_values);
}

struct tdm_metrics_gauge *tdm_metrics_gauge_labelsv(struct tdm_metrics_gauge *family,
                                                    const char *const *values, size_t n_values)
{
    return (struct tdm_metrics_gauge *)series_labels(family ? &family->s : NULL, values, n_values);
}

struct tdm_metrics_histogram *tdm_metrics_histogram_labelsv(struct tdm_metrics_histogram *family,
                                                            const char *const *values,
                                                            size_t n_values)
{
    return (struct tdm_metrics_histogram *)series_labels(family ? &family->s : NULL, values,
                                                         n_values);
}

// ---- hot path -----------------------------------------------------------------------------

void tdm_metrics_counter_inc(struct tdm_metrics_counter *c)
{
    if (c)
        atomic_add_double(&c->s.value_bits, 1.0);
}

void tdm_metrics_counter_add(struct tdm_metrics_counter *c, double amount)
{
    // `!(amount > 0)` also rejects NaN; adding 0 is a no-op anyway.
    if (c && amount > 0)
        atomic_add_double(&c->s.value_bits, amount);
}

void tdm_metrics_gauge_set(struct tdm_metrics_gauge *g, double value)
{
    if (g)
        atomic_store_explicit(&g->s.value_bits, double_bits(value), memory_order_relaxed);
}

void tdm_metrics_gauge_add(struct tdm_metrics_gauge *g, double delta)
{
    if (g)
        atomic_add_double(&g->s.value_bits, delta);
}

void tdm_metrics_gauge_inc(struct tdm_metrics_gauge *g)
{
    tdm_metrics_gauge_add(g, 1.0);
}

void tdm_metrics_gauge_dec(struct tdm_metrics_gauge *g)
{
    tdm_metrics_gauge_add(g, -1.0);
}

void tdm_metrics_histogram_observe(struct tdm_metrics_histogram *h, double value)
{
    if (!h)
        return;
    const struct family *f = h->s.family;
    // First bound >= value; NaN compares false everywhere and lands in +Inf.
    size_t lo = 0, hi = f->n_bounds;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (value <= f->bounds[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&h->s.buckets[lo], 1, memory_order_relaxed);
    atomic_add_double(&h->s.sum_bits, value);
}

// ---- reading back -------------------------------------------------------------------------

double tdm_metrics_counter_value(const struct tdm_metrics_counter *c)
{
    return c ? bits_double(atomic_load_explicit(&c->s.value_bits, memory_order_relaxed)) : 0.0;
}

double tdm_metrics_gauge_value(const struct tdm_metrics_gauge *g)
{
    return g ? bits_double(atomic_load_explicit(&g->s.value_bits, memory_order_relaxed)) : 0.0;
}

uint64_t tdm_metrics_histogram_bucket(const struct tdm_metrics_histogram *h, size_t i)
{
    if (!h || i > h->s.family->n_bounds)
        return 0;
    uint64_t cum = 0;
    for (size_t k = 0; k <= i; k++)
        cum += atomic_load_explicit(&h->s.buckets[k], memory_order_relaxed);
    return cum;
}

uint64_t tdm_metrics_histogram_count(const struct tdm_metrics_histogram *h)
{
    return h ? tdm_metrics_histogram_bucket(h, h->s.family->n_bounds) : 0;
}

double tdm_metrics_histogram_sum(const struct tdm_metrics_histogram *h)
{
    return h ? bits_double(atomic_load_explicit(&h->s.sum_bits, memory_order_relaxed)) : 0.0;
}

// ---- exposition ---------------------------------------------------------------------------

// `name{labels} value\n`, braces only when there are labels.
static void put_sample(struct tdm_strbuf *t, const char *name, const char *suffix, const char *labels,
                       double value)
{
    text_put(t, name);
    text_put(t, suffix);
    if (labels[0]) {
        text_putc(t, '{');
        text_put(t, labels);
        text_putc(t, '}');
    }
    text_putc(t, ' ');
    text_put_double(t, value);
    text_putc(t, '\n');
}

static void render_histogram_series(struct tdm_strbuf *t, const struct family *f, const struct series *s)
{
    uint64_t cum = 0;
    char le[32];
    for (size_t i = 0; i <= f->n_bounds; i++) {
        cum += atomic_load_explicit(&s->buckets[i], memory_order_relaxed);
        if (i < f->n_bounds)
            format_le(le, f->bounds[i]);
        else
            snprintf(le, sizeof le, "+Inf");
        text_put(t, f->name);
        text_put(t, "_bucket{");
        text_put(t, s->labels_pre);
        text_put(t, "le=\"");
        text_put(t, le);
        text_putc(t, '"');
        text_put(t, s->labels_post);
        text_put(t, "} ");
        text_put_double(t, (double)cum);
        text_putc(t, '\n');
    }
    // prometheus_client order: buckets, _count, _sum.
    put_sample(t, f->name, "_count", s->labels, (double)cum);
    put_sample(t, f->name, "_sum", s->labels,
               bits_double(atomic_load_explicit(&s->sum_bits, memory_order_relaxed)));
}

static void render_series(struct tdm_strbuf *t, const struct family *f, const struct series *s)
{
    double v = bits_double(atomic_load_explicit(&s->value_bits, memory_order_relaxed));
    switch (f->kind) {
    case KIND_COUNTER:
        put_sample(t, f->name, "_total", s->labels, v);
        break;
    case KIND_GAUGE:
        put_sample(t, f->name, "", s->labels, v);
        break;
    case KIND_HISTOGRAM:
        render_histogram_series(t, f, s);
        break;
    }
}

static void render_family(struct tdm_strbuf *t, const struct family *f)
{
    static const char *const type_names[] = {"counter", "gauge", "histogram"};
    const char *suffix = f->kind == KIND_COUNTER ? "_total" : "";
    text_put(t, "# HELP ");
    text_put(t, f->name);
    text_put(t, suffix);
    text_putc(t, ' ');
    text_put(t, f->help);
    text_put(t, "\n# TYPE ");
    text_put(t, f->name);
    text_put(t, suffix);
    text_putc(t, ' ');
    text_put(t, type_names[f->kind]);
    text_putc(t, '\n');
    if (f->n_label_names == 0) {
        render_series(t, f, f->root);
        return;
    }
    for (const struct series *s = atomic_load_explicit(&f->children, memory_order_acquire); s;
         s = atomic_load_explicit(&s->next, memory_order_acquire))
        render_series(t, f, s);
}

int tdm_metrics_render_buf(const struct tdm_metrics_registry *reg, char **buf, size_t *cap,
                           size_t *len)
{
    if (!reg || !buf || !cap || !len)
        return TDM_EINVAL;
    struct tdm_strbuf t = {.p = *buf, .len = 0, .cap = *buf ? *cap : 0};
    if (!text_reserve(&t, 32768)) { // the vLLM set renders to about 33 KB
        *buf = t.p;
        *cap = t.cap;
        return TDM_ENOMEM;
    }
    t.p[0] = '\0';
    for (const struct family *f = atomic_load_explicit(
             &((struct tdm_metrics_registry *)reg)->families, memory_order_acquire);
         f; f = atomic_load_explicit(&((struct family *)f)->next, memory_order_acquire))
        render_family(&t, f);
    *buf = t.p;
    *cap = t.cap;
    if (t.failed)
        return TDM_ENOMEM;
    *len = t.len;
    return TDM_OK;
}

int tdm_metrics_render(const struct tdm_metrics_registry *reg, char **out, size_t *len)
{
    if (!out || !len)
        return TDM_EINVAL;
    *out = NULL;
    *len = 0;
    char *buf = NULL;
    size_t cap = 0;
    int rc = tdm_metrics_render_buf(reg, &buf, &cap, len);
    if (rc != TDM_OK) {
        free(buf);
        return rc;
    }
    *out = buf;
    return TDM_OK;
}

// ---- vLLM bucket sets ---------------------------------------------------------------------

static const double buckets_ttft[] = {0.001, 0.005, 0.01, 0.02,  0.04,  0.06,  0.08, 0.1,
                                      0.25,  0.5,   0.75, 1.0,   2.5,   5.0,   7.5,  10.0,
                                      20.0,  40.0,  80.0, 160.0, 640.0, 2560.0};
static const double buckets_itl[] = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                     0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
static const double buckets_request_latency[] = {0.3,  0.5,   0.8,   1.0,   1.5,   2.0,    2.5,
                                                 5.0,  10.0,  15.0,  20.0,  30.0,  40.0,   50.0,
                                                 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
static const double buckets_params_n[] = {1, 2, 5, 10, 20};
static const double buckets_iteration_tokens[] = {1,   8,    16,   32,   64,   128,  256,
                                                  512, 1024, 2048, 4096, 8192, 16384};

#define RETURN_BUCKETS(arr)                                                                        \
    do {                                                                                           \
        if (n)                                                                                     \
            *n = sizeof(arr) / sizeof(arr[0]);                                                     \
        return arr;                                                                                \
    } while (0)

const double *tdm_metrics_buckets_ttft(size_t *n)
{
    RETURN_BUCKETS(buckets_ttft);
}

const double *tdm_metrics_buckets_itl(size_t *n)
{
    RETURN_BUCKETS(buckets_itl);
}

const double *tdm_metrics_buckets_request_latency(size_t *n)
{
    RETURN_BUCKETS(buckets_request_latency);
}

const double *tdm_metrics_buckets_params_n(size_t *n)
{
    RETURN_BUCKETS(buckets_params_n);
}

const double *tdm_metrics_buckets_iteration_tokens(size_t *n)
{
    RETURN_BUCKETS(buckets_iteration_tokens);
}

size_t tdm_metrics_buckets_1_2_5(double *out, size_t cap, int64_t max_value)
{
    static const int mantissa[] = {1, 2, 5};
    size_t n = 0;
    // Same walk as vLLM's build_buckets([1, 2, 5], max_value): m * 10^e in
    // order, stopping at the first value above max_value. Integer math, so the
    // bounds are exact; 10^18 * 5 would overflow, but INT64_MAX < 5e18 ends it.
    for (int64_t pow10 = 1;; pow10 *= 10) {
        for (int i = 0; i < 3; i++) {
            if (pow10 > max_value / mantissa[i])
                return n;
            if (out && n < cap)
                out[n] = (double)(pow10 * mantissa[i]);
            n++;
        }
        if (pow10 > INT64_MAX / 10)
            return n;
    }
}

// ---- the standard vLLM engine set ---------------------------------------------------------

struct vllm_ctx {
    struct tdm_metrics_registry *reg;
    struct tdm_metrics_label labels[2]; // model_name, engine
    char *err;
    size_t errlen;
    int rc; // first failure; later registrations are skipped
};

static struct tdm_metrics_opts vllm_opts(struct vllm_ctx *c, const char *name, const char *help)
{
    return (struct tdm_metrics_opts){
        .name = name, .help = help, .const_labels = c->labels, .n_const_labels = 2};
}

static void vllm_gauge(struct vllm_ctx *c, struct tdm_metrics_gauge **out, const char *name,
                       const char *help)
{
    struct tdm_metrics_opts o = vllm_opts(c, name, help);
    if (c->rc == TDM_OK)
        c->rc = tdm_metrics_gauge_register(out, c->reg, &o, c->err, c->errlen);
}

static void vllm_counter(struct vllm_ctx *c, struct tdm_metrics_counter **out, const char *name,
                         const char *help)
{
    struct tdm_metrics_opts o = vllm_opts(c, name, help);
    if (c->rc == TDM_OK)
        c->rc = tdm_metrics_counter_register(out, c->reg, &o, c->err, c->errlen);
}

static void vllm_histogram(struct vllm_ctx *c, struct tdm_metrics_histogram **out, const char *name,
                           const char *help, const double *bounds, size_t n_bounds)
{
    struct tdm_metrics_opts o = vllm_opts(c, name, help);
    if (c->rc == TDM_OK)
        c->rc =
            tdm_metrics_histogram_register(out, c->reg, &o, bounds, n_bounds, c->err, c->errlen);
}

// vllm:cache_config_info: vLLM writes each CacheConfig field with Python's str().
static int vllm_cache_info(struct vllm_ctx *c, struct tdm_metrics_gauge **out,
                           const struct tdm_metrics_cache_info *ci)
{
    enum { N_FIXED = 7 };
    char block_size[24], gpu_blocks[24], cpu_blocks[24], util[32];
    snprintf(block_size, sizeof block_size, "%" PRId64, ci->block_size);
    if (ci->num_gpu_blocks < 0)
        snprintf(gpu_blocks, sizeof gpu_blocks, "None");
    else
        snprintf(gpu_blocks, sizeof gpu_blocks, "%" PRId64, ci->num_gpu_blocks);
    if (ci->num_cpu_blocks < 0)
        snprintf(cpu_blocks, sizeof cpu_blocks, "None");
    else
        snprintf(cpu_blocks, sizeof cpu_blocks, "%" PRId64, ci->num_cpu_blocks);
    format_py_float(util, ci->gpu_memory_utilization);
    if (ci->n_extra && !ci->extra)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "metrics: cache info extra is NULL");
    size_t n = N_FIXED + ci->n_extra;
    struct tdm_metrics_label *labels = calloc(n, sizeof *labels);
    if (!labels)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "metrics: out of memory");
    labels[0] = (struct tdm_metrics_label){"block_size", block_size};
    labels[1] =
        (struct tdm_metrics_label){"cache_dtype", ci->cache_dtype ? ci->cache_dtype : "auto"};
    labels[2] = (struct tdm_metrics_label){"enable_prefix_caching",
                                           ci->enable_prefix_caching ? "True" : "False"};
    labels[3] = (struct tdm_metrics_label){"engine", c->labels[1].value};
    labels[4] = (struct tdm_metrics_label){"gpu_memory_utilization", util};
    labels[5] = (struct tdm_metrics_label){"num_cpu_blocks", cpu_blocks};
    labels[6] = (struct tdm_metrics_label){"num_gpu_blocks", gpu_blocks};
    for (size_t i = 0; i < ci->n_extra; i++)
        labels[N_FIXED + i] = ci->extra[i];
    struct tdm_metrics_opts o = {
        .name = "vllm:cache_config_info",
        .help = "Information of the LLMEngine CacheConfig",
        .const_labels = labels,
        .n_const_labels = n,
        .no_registry_labels = true,
    };
    int rc = tdm_metrics_info_register(out, c->reg, &o, c->err, c->errlen);
    free(labels);
    return rc;
}

int tdm_metrics_vllm_register(struct tdm_metrics_vllm *out, struct tdm_metrics_registry *reg,
                              const struct tdm_metrics_vllm_config *cfg, char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (!reg || !cfg || !cfg->model_name)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: vLLM set needs a model_name");
    struct vllm_ctx c = {
        .reg = reg,
        .labels = {{"model_name", cfg->model_name}, {"engine", cfg->engine ? cfg->engine : "0"}},
        .err = err,
        .errlen = errlen,
        .rc = TDM_OK,
    };
    double tok[TDM_METRICS_MAX_1_2_5];
    size_t n_tok = tdm_metrics_buckets_1_2_5(tok, TDM_METRICS_MAX_1_2_5, cfg->max_model_len);
    size_t n_ttft, n_itl, n_lat, n_n, n_it;
    const double *ttft = tdm_metrics_buckets_ttft(&n_ttft);
    const double *itl = tdm_metrics_buckets_itl(&n_itl);
    const double *lat = tdm_metrics_buckets_request_latency(&n_lat);
    const double *params_n = tdm_metrics_buckets_params_n(&n_n);
    const double *iter = tdm_metrics_buckets_iteration_tokens(&n_it);

    // Order and HELP texts as vLLM's PrometheusStatLogger registers them.
    vllm_gauge(&c, &out->num_requests_running, "vllm:num_requests_running",
               "Number of requests in model execution batches.");
    vllm_gauge(&c, &out->num_requests_waiting, "vllm:num_requests_waiting",
               "Number of requests waiting to be processed.");
    vllm_gauge(&c, &out->kv_cache_usage_perc, "vllm:kv_cache_usage_perc",
               "KV-cache usage. 1 means 100 percent usage.");
    vllm_counter(&c, &out->prefix_cache_queries, "vllm:prefix_cache_queries",
                 "Prefix cache queries, in terms of number of queried tokens.");
    vllm_counter(&c, &out->prefix_cache_hits, "vllm:prefix_cache_hits",
                 "Prefix cache hits, in terms of number of cached tokens.");
    vllm_counter(&c, &out->num_preemptions, "vllm:num_preemptions",
                 "Cumulative number of preemption from the engine.");
    vllm_counter(&c, &out->prompt_tokens, "vllm:prompt_tokens",
                 "Number of prefill tokens processed.");
    vllm_counter(&c, &out->generation_tokens, "vllm:generation_tokens",
                 "Number of generation tokens processed.");
    if (c.rc == TDM_OK) {
        static const char *const reason_label[] = {"finished_reason"};
        struct tdm_metrics_opts o =
            vllm_opts(&c, "vllm:request_success", "Count of successfully processed requests.");
        o.label_names = reason_label;
        o.n_label_names = 1;
        c.rc = tdm_metrics_counter_register(&out->request_success, reg, &o, err, errlen);
        for (int r = TDM_FINISH_STOP; c.rc == TDM_OK && r < TDM_FINISH_COUNT; r++) {
            out->request_success_by_reason[r] =
                tdm_metrics_counter_labels(out->request_success, tdm_finish_name(r));
            if (!out->request_success_by_reason[r])
                c.rc = tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
        }
    }
    vllm_histogram(&c, &out->request_prompt_tokens, "vllm:request_prompt_tokens",
                   "Number of prefill tokens processed.", tok, n_tok);
    vllm_histogram(&c, &out->request_generation_tokens, "vllm:request_generation_tokens",
                   "Number of generation tokens processed.", tok, n_tok);
    vllm_histogram(&c, &out->iteration_tokens_total, "vllm:iteration_tokens_total",
                   "Histogram of number of tokens per engine_step.", iter, n_it);
    vllm_histogram(&c, &out->request_max_num_generation_tokens,
                   "vllm:request_max_num_generation_tokens",
                   "Histogram of maximum number of requested generation tokens.", tok, n_tok);
    vllm_histogram(&c, &out->request_params_n, "vllm:request_params_n",
                   "Histogram of the n request parameter.", params_n, n_n);
    vllm_histogram(&c, &out->request_params_max_tokens, "vllm:request_params_max_tokens",
                   "Histogram of the max_tokens request parameter.", tok, n_tok);
    vllm_histogram(&c, &out->time_to_first_token_seconds, "vllm:time_to_first_token_seconds",
                   "Histogram of time to first token in seconds.", ttft, n_ttft);
    vllm_histogram(&c, &out->inter_token_latency_seconds, "vllm:inter_token_latency_seconds",
                   "Histogram of inter-token latency in seconds.", itl, n_itl);
    vllm_histogram(&c, &out->request_time_per_output_token_seconds,
                   "vllm:request_time_per_output_token_seconds",
                   "Histogram of time_per_output_token_seconds per request.", itl, n_itl);
    vllm_histogram(&c, &out->e2e_request_latency_seconds, "vllm:e2e_request_latency_seconds",
                   "Histogram of e2e request latency in seconds.", lat, n_lat);
    vllm_histogram(&c, &out->request_queue_time_seconds, "vllm:request_queue_time_seconds",
                   "Histogram of time spent in WAITING phase for request.", lat, n_lat);
    vllm_histogram(&c, &out->request_inference_time_seconds, "vllm:request_inference_time_seconds",
                   "Histogram of time spent in RUNNING phase for request.", lat, n_lat);
    vllm_histogram(&c, &out->request_prefill_time_seconds, "vllm:request_prefill_time_seconds",
                   "Histogram of time spent in PREFILL phase for request.", lat, n_lat);
    vllm_histogram(&c, &out->request_decode_time_seconds, "vllm:request_decode_time_seconds",
                   "Histogram of time spent in DECODE phase for request.", lat, n_lat);
    if (c.rc == TDM_OK)
        c.rc = vllm_cache_info(&c, &out->cache_config_info, &cfg->cache);
    return c.rc;
}

int tdm_metrics_spec_register(struct tdm_metrics_spec *out, struct tdm_metrics_registry *reg,
                              const char *model_name, const char *engine, int num_spec_tokens,
                              char *err, size_t errlen)
{
    memset(out, 0, sizeof *out);
    if (!reg || !model_name)
        return tdm_seterr(err, errlen, TDM_EINVAL, "metrics: spec decode set needs a model_name");
    if (num_spec_tokens < 1 || num_spec_tokens > TDM_METRICS_SPEC_MAX_POS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "metrics: num_spec_tokens must be in [1, %d], got %d",
                          TDM_METRICS_SPEC_MAX_POS, num_spec_tokens);
    struct vllm_ctx c = {
        .reg = reg,
        .labels = {{"model_name", model_name}, {"engine", engine ? engine : "0"}},
        .err = err,
        .errlen = errlen,
        .rc = TDM_OK,
    };
    // Names and HELP texts as vLLM's SpecDecodingProm.
    vllm_counter(&c, &out->num_drafts, "vllm:spec_decode_num_drafts",
                 "Number of spec decoding drafts.");
    vllm_counter(&c, &out->num_draft_tokens, "vllm:spec_decode_num_draft_tokens",
                 "Number of draft tokens.");
    vllm_counter(&c, &out->num_accepted_tokens, "vllm:spec_decode_num_accepted_tokens",
                 "Number of accepted tokens.");
    if (c.rc == TDM_OK) {
        static const char *const pos_label[] = {"position"};
        struct tdm_metrics_opts o = vllm_opts(&c, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                              "Accepted tokens per draft position.");
        o.label_names = pos_label;
        o.n_label_names = 1;
        c.rc = tdm_metrics_counter_register(&out->per_pos, reg, &o, err, errlen);
        for (int i = 0; c.rc == TDM_OK && i < num_spec_tokens; i++) {
            char pos[8];
            snprintf(pos, sizeof pos, "%d", i);
            out->accepted_per_pos[i] = tdm_metrics_counter_labels(out->per_pos, pos);
            if (!out->accepted_per_pos[i])
                c.rc = tdm_seterr(err, errlen, TDM_ENOMEM, "metrics: out of memory");
        }
    }
    if (c.rc == TDM_OK)
        out->num_positions = num_spec_tokens;
    return c.rc;
}
