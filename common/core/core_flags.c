// SPDX-License-Identifier: Apache-2.0
// core_flags: the one command-line parser every binary uses (see core.h). A
// table of struct tdm_flag maps each flag to a typed field by offset, so the
// parse, the range check, the message and the --help line of a flag come from
// one entry; config files set the same entries by name (tdm_flags_set), so a
// flag and its config key accept the same things. Nothing here exits or
// prints except tdm_flags_help and tdm_flags_main, which write what a main
// would write.
#include "core.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 64

// ---- values ---------------------------------------------------------------------------------
int tdm_parse_bytes(const char *text, size_t *out)
{
    static const struct {
        const char *suffix;
        double mul;
    } units[] = {
        {"", 1},
        {"B", 1},
        {"K", 1024.0},
        {"KiB", 1024.0},
        {"KB", 1e3},
        {"k", 1024.0},
        {"M", 1048576.0},
        {"MiB", 1048576.0},
        {"MB", 1e6},
        {"G", 1073741824.0},
        {"GiB", 1073741824.0},
        {"GB", 1e9},
        {"T", 1099511627776.0},
        {"TiB", 1099511627776.0},
        {"TB", 1e12},
    };
    if (text == NULL || *text < '0' || *text > '9')
        return TDM_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno != 0 || !isfinite(v) || v < 0)
        return TDM_EINVAL;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].suffix) == 0) {
            double b = v * units[i].mul;
            if (b >= 1.8e19 || b != floor(b))
                return TDM_EINVAL;
            *out = (size_t)b;
            return TDM_OK;
        }
    }
    return TDM_EINVAL;
}

int tdm_parse_bool(const char *v, bool *out)
{
    static const char *const yes[] = {"true", "True", "1", "yes"};
    static const char *const no[] = {"false", "False", "0", "no"};
    for (size_t i = 0; i < 4; i++) {
        if (strcmp(v, yes[i]) == 0) {
            *out = true;
            return TDM_OK;
        }
        if (strcmp(v, no[i]) == 0) {
            *out = false;
            return TDM_OK;
        }
    }
    return TDM_EINVAL;
}

// A number in [lo, hi]: the whole value parsed, finite.
static bool parse_number(const char *v, double lo, double hi, double *out)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0' || errno != 0 || !isfinite(x) || x < lo || x > hi)
        return false;
    *out = x;
    return true;
}

// ---- one flag -------------------------------------------------------------------------------
// "max_num_seqs" or "--max_num_seqs" to "max-num-seqs".
static void norm_name(char *buf, size_t cap, const char *name)
{
    if (strncmp(name, "--", 2) == 0)
        name += 2;
    size_t i = 0;
    for (; name[i] && i + 1 < cap; i++)
        buf[i] = name[i] == '_' ? '-' : name[i];
    buf[i] = '\0';
}

int tdm_parse_human_int(const char *s, long long *out, char *err, size_t errlen)
{
    size_t n = s ? strlen(s) : 0;
    size_t digits = strspn(s ? s : "", "0123456789");
    if (n == 0 || digits == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "not a number");
    char last = s[n - 1];
    const char *dec = strchr("kmg", last), *bin = strchr("KMG", last);
    if (!(dec || bin) || n == 1) { // a plain number
        if (digits != n || n > 18)
            return tdm_seterr(err, errlen, TDM_EINVAL, "not a whole number");
        *out = strtoll(s, NULL, 10);
        return TDM_OK;
    }
    // digits [. digits] suffix
    size_t frac = 0;
    if (s[digits] == '.') {
        frac = strspn(s + digits + 1, "0123456789");
        if (frac == 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "not a number");
    }
    size_t body = digits + (frac ? frac + 1 : 0);
    if (body != n - 1 || digits > 12)
        return tdm_seterr(err, errlen, TDM_EINVAL, "not a number");
    if (bin && frac)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "decimals are not allowed with binary suffixes like %c; did you mean "
                          "%.*s%c?",
                          last, (int)(n - 1), s, (char)(last - 'A' + 'a'));
    int e = dec ? 3 * (int)(dec - "kmg" + 1) : 10 * (int)(bin - "KMG" + 1);
    if (bin) {
        *out = strtoll(s, NULL, 10) << e;
        return TDM_OK;
    }
    // Decimal: int(float(number) * 10^e), as vLLM computes it, exactly for the
    // digits given (no binary float rounding of 25.6 * 1000).
    long long whole = strtoll(s, NULL, 10), f = 0, scale = 1;
    for (size_t i = 0; i < frac; i++) {
        if (scale < 1000000000000LL) {
            f = f * 10 + (s[digits + 1 + i] - '0');
            scale *= 10;
        }
    }
    long long p = 1;
    for (int i = 0; i < e; i++)
        p *= 10;
    *out = whole * p + f * p / scale;
    return TDM_OK;
}

static const struct tdm_flag *find_flag(const struct tdm_flags *t, const char *norm)
{
    for (size_t i = 0; i < t->n; i++)
        if (strcmp(t->flags[i].name, norm) == 0)
            return &t->flags[i];
    return NULL;
}

// Whether the flag is complete without a value ("--enable-x", "--json").
static bool takes_no_value(const struct tdm_flag *f)
{
    return f->kind == TDM_FLAG_BOOL || f->kind == TDM_FLAG_NOT ||
           (f->kind == TDM_FLAG_FN && f->no_value);
}

static int apply(const struct tdm_flag *f, void *opts, const char *v, char *err, size_t errlen)
{
    char *field = (char *)opts + f->offset;
    const char *n = f->name;
    double x = 0;
    if (v == NULL && !takes_no_value(f))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: missing value", n);
    switch (f->kind) {
    case TDM_FLAG_STR:
    case TDM_FLAG_PTR:
        if (*v == '\0' && !f->empty_ok)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected a non-empty value", n);
        if (f->kind == TDM_FLAG_STR && strlen(v) >= f->size)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: value longer than %zu bytes", n,
                              f->size - 1);
        if (f->check) {
            int rc = f->check(v, err, errlen);
            if (rc != TDM_OK)
                return rc;
        }
        if (f->kind == TDM_FLAG_PTR)
            memcpy(field, &v, sizeof v);
        else
            memcpy(field, v, strlen(v) + 1);
        return TDM_OK;
    case TDM_FLAG_INT: {
        char *end;
        errno = 0;
        long i = strtol(v, &end, 10);
        if (*v == '\0' || *end != '\0' || errno != 0 || (double)i < f->min || (double)i > f->max)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--%s: expected an integer in [%ld, %ld], got \"%s\"", n,
                              (long)f->min, (long)f->max, v);
        int iv = (int)i;
        memcpy(field, &iv, sizeof iv);
        return TDM_OK;
    }
    case TDM_FLAG_HINT: {
        long long i = 0;
        char why[160] = "";
        if (tdm_parse_human_int(v, &i, why, sizeof why) != TDM_OK || (double)i < f->min ||
            (double)i > f->max)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--%s: expected an integer in [%ld, %ld] (4096, 4k = 4000, 4K = "
                              "4096), got \"%s\"%s%s",
                              n, (long)f->min, (long)f->max, v, why[0] ? ": " : "", why);
        int iv = (int)i;
        memcpy(field, &iv, sizeof iv);
        return TDM_OK;
    }
    case TDM_FLAG_DOUBLE:
    case TDM_FLAG_FLOAT:
        if (!parse_number(v, f->min, f->max, &x))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--%s: expected a number in [%g, %g], got \"%s\"", n, f->min, f->max,
                              v);
        if (f->kind == TDM_FLAG_DOUBLE) {
            memcpy(field, &x, sizeof x);
        } else {
            float fv = (float)x;
            memcpy(field, &fv, sizeof fv);
        }
        return TDM_OK;
    case TDM_FLAG_BYTES: {
        size_t b = 0;
        if (tdm_parse_bytes(v, &b) != TDM_OK || (double)b < f->min || (double)b > f->max)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--%s: expected a byte size like 2GiB or 512MiB in [%.0f, %.0f], "
                              "got \"%s\"",
                              n, f->min, f->max, v);
        memcpy(field, &b, sizeof b);
        return TDM_OK;
    }
    case TDM_FLAG_BOOL:
    case TDM_FLAG_NOT: {
        bool b = true;
        if (v != NULL && tdm_parse_bool(v, &b) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected true or false, got \"%s\"",
                              n, v);
        if (f->kind == TDM_FLAG_NOT)
            b = !b;
        memcpy(field, &b, sizeof b);
        return TDM_OK;
    }
    case TDM_FLAG_FN:
        return f->fn(opts, v, err, errlen);
    }
    return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: bad flag table entry", n);
}

int tdm_flags_set(const struct tdm_flags *t, void *opts, const char *name, const char *value,
                  char *err, size_t errlen)
{
    char norm[NAME_MAX_LEN];
    norm_name(norm, sizeof norm, name);
    const struct tdm_flag *f = find_flag(t, norm);
    if (f == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option \"--%s\"", norm);
    return apply(f, opts, value, err, errlen);
}

// ---- argv -----------------------------------------------------------------------------------
static bool is_help(const char *a)
{
    return strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0;
}

// Splits argv[*i] ("--name" or "--name=value") into the normalized name and an
// inline value (NULL when none). False when it is not a flag.
static bool split_flag(const char *a, char *norm, size_t cap, const char **inline_value)
{
    if (strncmp(a, "--", 2) != 0 || a[2] == '\0')
        return false;
    const char *eq = strchr(a, '=');
    size_t nl = eq ? (size_t)(eq - a) : strlen(a);
    char name[NAME_MAX_LEN];
    if (nl >= sizeof name)
        nl = sizeof name - 1;
    memcpy(name, a, nl);
    name[nl] = '\0';
    norm_name(norm, cap, name);
    *inline_value = eq ? eq + 1 : NULL;
    return true;
}

// Applies argv[*i] (and its value, advancing *i) when t knows it. Returns
// TDM_OK, TDM_ENOTFOUND when t does not know the flag, TDM_EINVAL on a bad value.
static int take_one(const struct tdm_flags *t, void *opts, int argc, char **argv, int *i, char *err,
                    size_t errlen)
{
    char norm[NAME_MAX_LEN];
    const char *v = NULL;
    if (!split_flag(argv[*i], norm, sizeof norm, &v))
        return TDM_ENOTFOUND;
    const struct tdm_flag *f = find_flag(t, norm);
    if (f == NULL)
        return TDM_ENOTFOUND;
    if (v == NULL && !takes_no_value(f)) {
        if (*i + 1 >= argc)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: missing value", f->name);
        v = argv[++*i];
    }
    return apply(f, opts, v, err, errlen);
}

int tdm_flags_parse(const struct tdm_flags *t, void *opts, int argc, char **argv, char **rest,
                    int max_rest, int *n_rest, char *err, size_t errlen)
{
    if (n_rest)
        *n_rest = 0;
    for (int i = 1; i < argc; i++)
        if (is_help(argv[i]))
            return 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int rc = take_one(t, opts, argc, argv, &i, err, errlen);
        if (rc == TDM_OK)
            continue;
        if (rc != TDM_ENOTFOUND)
            return TDM_EINVAL;
        if (strncmp(a, "--", 2) == 0) {
            char norm[NAME_MAX_LEN];
            const char *v;
            split_flag(a, norm, sizeof norm, &v);
            return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option \"--%s\"", norm);
        }
        if (rest == NULL || n_rest == NULL || *n_rest >= max_rest)
            return tdm_seterr(err, errlen, TDM_EINVAL, "unexpected argument \"%s\"", a);
        rest[(*n_rest)++] = argv[i];
    }
    return TDM_OK;
}

int tdm_flags_take(const struct tdm_flags *t, void *opts, int *argc, char **argv, char *err,
                   size_t errlen)
{
    int w = 1;
    for (int i = 1; i < *argc; i++) {
        int start = i;
        int rc = take_one(t, opts, *argc, argv, &i, err, errlen);
        if (rc == TDM_ENOTFOUND) {
            argv[w++] = argv[start];
            continue;
        }
        if (rc != TDM_OK)
            return TDM_EINVAL;
    }
    argv[w] = NULL;
    *argc = w;
    return TDM_OK;
}

// ---- help -----------------------------------------------------------------------------------
void tdm_flags_help(const struct tdm_flags *t, FILE *f)
{
    enum { HELP_COLUMN = 32 };
    if (t->usage)
        fputs(t->usage, f);
    for (size_t i = 0; i < t->n; i++) {
        const struct tdm_flag *fl = &t->flags[i];
        if (fl->hidden)
            continue;
        int col = fprintf(f, "  --%s%s%s", fl->name, fl->metavar ? " " : "",
                          fl->metavar ? fl->metavar : "");
        const char *h = fl->help ? fl->help : "";
        // Each line of the help: the first beside the flag (or below when the
        // flag is too wide), the rest indented to the help column.
        if (col >= HELP_COLUMN && *h) {
            fputc('\n', f);
            col = 0;
        }
        for (bool first = true; first || *h; first = false) {
            const char *nl = strchr(h, '\n');
            int len = nl ? (int)(nl - h) : (int)strlen(h);
            if (!first)
                col = 0;
            if (len > 0)
                fprintf(f, "%*s%.*s", HELP_COLUMN - col, "", len, h);
            fputc('\n', f);
            h = nl ? nl + 1 : h + len;
        }
    }
    if (t->footer)
        fputs(t->footer, f);
}

bool tdm_flags_main(const struct tdm_flags *t, void *opts, int argc, char **argv, char **rest,
                    int max_rest, int *n_rest, const char *prog, int *exit_code)
{
    char err[512];
    int rc = tdm_flags_parse(t, opts, argc, argv, rest, max_rest, n_rest, err, sizeof err);
    if (rc == TDM_OK)
        return false;
    if (rc == 1) {
        tdm_flags_help(t, stdout);
        *exit_code = 0;
    } else {
        fprintf(stderr, "%s: %s (see --help)\n", prog, err);
        *exit_code = 2;
    }
    return true;
}
