// SPDX-License-Identifier: Apache-2.0
// grammar_range: regexes for JSON numbers within bounds (issue 28, item 2:
// minimum/maximum/exclusiveMinimum/exclusiveMaximum, the bounds zod writes for
// z.number().int()). An integer range is exact: the regex matches the canonical
// JSON text (no leading zeros, no "-0") of every integer in [lo, hi] and nothing
// else. A number range takes integral bounds: a value is sign, integer part and
// an optional fraction (no exponent: a bounded value has no need of one), and
// the regex matches exactly the values within the bounds, open or closed.
// Integer digits are capped (TDM_GRAMMAR_MAX_INT_DIGITS) where a side is
// unbounded, so every value parses to a finite double.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

struct rb {
    char *s;
    size_t n, cap;
    bool oom;
};

static void put(struct rb *b, const char *t)
{
    size_t k = strlen(t);
    if (b->oom)
        return;
    if (tdm_grow(&b->s, &b->cap, b->n + k + 1, 1, 256) != TDM_OK) {
        b->oom = true;
        return;
    }
    memcpy(b->s + b->n, t, k + 1);
    b->n += k;
}

static void putf(struct rb *b, const char *fmt, long long v)
{
    char t[64];
    snprintf(t, sizeof t, fmt, v);
    put(b, t);
}

// Same-length range lo..hi (decimal strings of n digits, lo <= hi), as an
// alternation without outer parentheses.
static void same_len(struct rb *b, const char *lo, const char *hi, size_t n)
{
    if (n == 0)
        return;
    if (n == 1) {
        char t[8];
        if (lo[0] == hi[0])
            snprintf(t, sizeof t, "%c", lo[0]);
        else
            snprintf(t, sizeof t, "[%c-%c]", lo[0], hi[0]);
        put(b, t);
        return;
    }
    if (lo[0] == hi[0]) {
        char t[2] = {lo[0], 0};
        put(b, t);
        put(b, "(");
        same_len(b, lo + 1, hi + 1, n - 1);
        put(b, ")");
        return;
    }
    bool lo_zeros = strspn(lo + 1, "0") == n - 1, hi_nines = strspn(hi + 1, "9") == n - 1;
    char first = lo_zeros ? lo[0] : (char)(lo[0] + 1);
    char last = hi_nines ? hi[0] : (char)(hi[0] - 1);
    bool alt = false;
    char nines[32], zeros[32];
    memset(nines, '9', n - 1);
    memset(zeros, '0', n - 1);
    nines[n - 1] = zeros[n - 1] = '\0';
    if (!lo_zeros) {
        char t[2] = {lo[0], 0};
        put(b, t);
        put(b, "(");
        same_len(b, lo + 1, nines, n - 1);
        put(b, ")");
        alt = true;
    }
    if (first <= last) {
        char t[64];
        if (first == last)
            snprintf(t, sizeof t, "%s%c[0-9]{%zu}", alt ? "|" : "", first, n - 1);
        else
            snprintf(t, sizeof t, "%s[%c-%c][0-9]{%zu}", alt ? "|" : "", first, last, n - 1);
        put(b, t);
        alt = true;
    }
    if (!hi_nines) {
        char t[3] = {'|', hi[0], 0};
        put(b, alt ? t : t + 1);
        put(b, "(");
        same_len(b, zeros, hi + 1, n - 1);
        put(b, ")");
    }
}

static int ndigits(unsigned long long v)
{
    int d = 1;
    while (v >= 10) {
        v /= 10;
        d++;
    }
    return d;
}

static unsigned long long pow10u(int e)
{
    unsigned long long p = 1;
    while (e-- > 0)
        p *= 10;
    return p;
}

// Non-negative integers in [a, b] (b < 0: unbounded above), canonical; an
// alternation. Nothing when a > b.
static void nonneg(struct rb *b, unsigned long long a, long long hi)
{
    bool any = false;
    int da = ndigits(a);
    int db = hi < 0 ? da : ndigits((unsigned long long)hi);
    for (int d = da; d <= db; d++) {
        unsigned long long lo_d = d == 1 ? 0 : pow10u(d - 1);
        unsigned long long hi_d = pow10u(d) - 1;
        unsigned long long x = a > lo_d ? a : lo_d;
        unsigned long long y =
            hi >= 0 && (unsigned long long)hi < hi_d ? (unsigned long long)hi : hi_d;
        if (x > y)
            continue;
        char xs[32], ys[32];
        snprintf(xs, sizeof xs, "%llu", x);
        snprintf(ys, sizeof ys, "%llu", y);
        put(b, any ? "|(" : "(");
        same_len(b, xs, ys, (size_t)d);
        put(b, ")");
        any = true;
    }
    if (hi < 0) { // and every longer one
        char t[64];
        snprintf(t, sizeof t, "%s[1-9][0-9]{%d,%d}", any ? "|" : "", da,
                 TDM_GRAMMAR_MAX_INT_DIGITS - 1);
        put(b, t);
        any = true;
    }
}

// An alternative "-(magnitudes)" or "(magnitudes)".
static void alt_part(struct rb *b, bool *any, bool neg, unsigned long long a, long long hi)
{
    put(b, *any ? "|" : "");
    put(b, neg ? "-(" : "(");
    nonneg(b, a, hi);
    put(b, ")");
    *any = true;
}

char *gr_int_range_regex(const struct gr_bounds *r)
{
    struct rb b = {0};
    bool any = false;
    long long lo = r->lo, hi = r->hi;
    // x < 0: "-" and |x| in [max(-hi, 1), -lo]
    if (!r->has_lo || lo < 0) {
        unsigned long long mlo = r->has_hi && hi < 0 ? (unsigned long long)-hi : 1;
        alt_part(&b, &any, true, mlo, r->has_lo ? -lo : -1);
    }
    // x >= 0: [max(lo, 0), hi]
    if (!r->has_hi || hi >= 0)
        alt_part(&b, &any, false, r->has_lo && lo > 0 ? (unsigned long long)lo : 0,
                 r->has_hi ? hi : -1);
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}

// Non-negative decimal values v with a <= v <= b (b < 0: unbounded), a_open /
// b_open excluding the bound itself, as "I(.F)?" texts; an alternation.
static void nonneg_number(struct rb *b, bool *any, bool neg, long long a, bool a_open, long long hi,
                          bool hi_open, int p)
{
    // Fractions: any, or of at most p digits (multipleOf 10^-p); a nonzero one
    // for an excluded integer bound (first nonzero digit at position j < p).
    char frac[64], nonzero_frac[900], zero_frac[32];
    if (p <= 0)
        p = TDM_GRAMMAR_MAX_FRAC_DIGITS;
    {
        snprintf(frac, sizeof frac, "(\\.[0-9]{1,%d})?", p);
        snprintf(zero_frac, sizeof zero_frac, "(\\.0{1,%d})?", p);
        int n = snprintf(nonzero_frac, sizeof nonzero_frac, "\\.(");
        for (int j = 0; j < p; j++)
            n += snprintf(nonzero_frac + n, sizeof nonzero_frac - (size_t)n,
                          "%s0{%d}[1-9][0-9]{0,%d}", j ? "|" : "", j, p - 1 - j);
        snprintf(nonzero_frac + n, sizeof nonzero_frac - (size_t)n, ")");
    }
    if (hi >= 0 && (a > hi || (a == hi && (a_open || hi_open))))
        return;
    const char *sign = neg ? "-" : "";
    put(b, *any ? "|" : "");
    *any = true;
    if (hi >= 0 && a == hi) { // exactly a: "a", "a.0", "a.00"...
        put(b, sign);
        putf(b, "%lld", a);
        put(b, zero_frac);
        return;
    }
    // I = a: any fraction, a nonzero one when a is excluded
    put(b, sign);
    putf(b, "%lld", a);
    put(b, a_open ? nonzero_frac : frac);
    // a < I < hi: any fraction
    if (hi < 0 || a + 1 <= hi - 1) {
        put(b, "|");
        put(b, sign);
        put(b, "(");
        nonneg(b, (unsigned long long)a + 1, hi < 0 ? -1 : hi - 1);
        put(b, ")");
        put(b, frac);
    }
    // I = hi: only a zero fraction, and not at all when hi is excluded
    if (hi >= 0 && !hi_open) {
        put(b, "|");
        put(b, sign);
        putf(b, "%lld", hi);
        put(b, zero_frac);
    }
}

char *gr_number_range_regex(const struct gr_bounds *r)
{
    struct rb b = {0};
    bool any = false;
    long long lo = r->lo, hi = r->hi;
    // x < 0: "-" m with m = -x in (0 or -hi, -lo]
    if (!r->has_lo || lo < 0) {
        bool m_lo_open = r->has_hi && hi < 0 ? r->hi_open : true;
        long long m_lo = r->has_hi && hi < 0 ? -hi : 0;
        nonneg_number(&b, &any, true, m_lo, m_lo_open, r->has_lo ? -lo : -1,
                      r->has_lo ? r->lo_open : false, r->frac_digits);
    }
    // x >= 0
    if (!r->has_hi || hi > 0 || (hi == 0 && !r->hi_open)) {
        long long a = r->has_lo && lo >= 0 ? lo : 0;
        bool a_open = r->has_lo && lo >= 0 ? r->lo_open : false;
        nonneg_number(&b, &any, false, a, a_open, r->has_hi ? hi : -1,
                      r->has_hi ? r->hi_open : false, r->frac_digits);
    }
    if (b.oom) {
        free(b.s);
        return NULL;
    }
    return b.s;
}
