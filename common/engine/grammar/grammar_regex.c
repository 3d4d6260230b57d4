// SPDX-License-Identifier: Apache-2.0
// grammar_regex: a regex into grammar rules (recursive descent over the
// pattern). Supported: literals (UTF-8), escapes (\d \w \s and negations, \n \t
// \r \f \v \0 \xHH \uHHHH, escaped punctuation), '.', classes with ranges and
// negation (ranges over ASCII; single non-ASCII characters may be listed),
// groups (capturing, (?:...), named (?<n>...) / (?P<n>...)), alternation,
// quantifiers ? * + {m} {m,} {m,n} (lazy forms match the same language), and
// '^' / '$' at the ends (the match is always the whole output). Refused with a
// message: backreferences, lookaround, \b, inline flags, non-ASCII ranges.
// \d \w \s are ASCII, '.' and negated classes match any well-formed UTF-8
// character (not '\n' for '.'). The automaton is simulated breadth first, so
// no pattern backtracks; sizes are bounded by TDM_GRAMMAR_MAX_REPEAT and the
// builder's element limit. In json_string mode the regex describes a JSON
// string's decoded contents: '"', '\\' and control characters are produced as
// their JSON escapes, '.' and negated classes produce no control characters.
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

struct rx {
    struct gb *b;
    const char *start, *p, *end;
    bool js;
    int depth;
    int utf8_rule; // lazily made multibyte-character rule
};

struct rx_class {
    struct gr_class ascii; // members below 0x80
    bool multibyte;        // every non-ASCII character
    uint32_t cps[64];      // listed non-ASCII code points
    int n_cps;
};

static int rx_fail(struct rx *r, const char *what)
{
    return gb_fail(r->b, TDM_EINVAL, "regex: %s at offset %zu", what, (size_t)(r->p - r->start));
}

static int utf8_rule(struct rx *r)
{
    if (r->utf8_rule < 0)
        r->utf8_rule = gb_utf8_multibyte(r->b);
    return r->utf8_rule;
}

// Decodes one UTF-8 character at r->p; -1 on malformed input.
static int64_t next_cp(struct rx *r)
{
    const unsigned char *s = (const unsigned char *)r->p;
    size_t left = (size_t)(r->end - r->p);
    unsigned c = s[0];
    int n = c < 0x80 ? 1 : c >= 0xF0 && c < 0xF5 ? 4 : c >= 0xE0 ? 3 : c >= 0xC2 ? 2 : 0;
    if (!n || (size_t)n > left)
        return -1;
    uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return -1;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    r->p += n;
    return cp;
}

// Appends the bytes for character cp (JSON-escaped in json_string mode).
static void emit_cp(struct rx *r, struct gb_seq *s, uint32_t cp)
{
    char buf[8];
    if (r->js && (cp == '"' || cp == '\\')) {
        buf[0] = '\\';
        buf[1] = (char)cp;
        gb_seq_lit(r->b, s, buf, 2);
        return;
    }
    if (r->js && cp < 0x20) {
        const char *e = cp == '\n' ? "\\n" : cp == '\t' ? "\\t" : cp == '\r' ? "\\r" : NULL;
        if (e) {
            gb_seq_lit(r->b, s, e, 2);
        } else {
            snprintf(buf, sizeof buf, "\\u%04x", (unsigned)cp);
            gb_seq_lit(r->b, s, buf, 6);
        }
        return;
    }
    gb_seq_lit(r->b, s, buf, (size_t)tdm_utf8_encode(cp, buf));
}

static void class_shorthand(struct rx_class *c, char e, bool *handled)
{
    struct gr_class set = {0};
    *handled = true;
    switch (e | 0x20) {
    case 'd':
        gr_class_range(&set, '0', '9');
        break;
    case 'w':
        gr_class_range(&set, '0', '9');
        gr_class_range(&set, 'a', 'z');
        gr_class_range(&set, 'A', 'Z');
        gr_class_range(&set, '_', '_');
        break;
    case 's':
        gr_class_range(&set, '\t', '\r');
        gr_class_range(&set, ' ', ' ');
        break;
    default:
        *handled = false;
        return;
    }
    if (e >= 'A' && e <= 'Z') { // \D \W \S: the ASCII complement and all non-ASCII
        for (int i = 0; i < 4; i++)
            c->ascii.bits[i] |= ~set.bits[i];
        c->multibyte = true;
    } else {
        for (int i = 0; i < 4; i++)
            c->ascii.bits[i] |= set.bits[i];
    }
}

static int hexval(char h)
{
    return h >= '0' && h <= '9'                     ? h - '0'
           : (h | 0x20) >= 'a' && (h | 0x20) <= 'f' ? (h | 0x20) - 'a' + 10
                                                    : -1;
}

// After a backslash (r->p at the escaped char): a single code point, or -1 with
// b->err set, or -2 when it was a shorthand class merged into c (c may be NULL
// only when shorthands are handled by the caller).
static int64_t escape_cp(struct rx *r, struct rx_class *c)
{
    if (r->p >= r->end) {
        rx_fail(r, "trailing backslash");
        return -1;
    }
    char e = *r->p++;
    bool handled = false;
    if (c) {
        class_shorthand(c, e, &handled);
        if (handled)
            return -2;
    }
    switch (e) {
    case 'n':
        return '\n';
    case 't':
        return '\t';
    case 'r':
        return '\r';
    case 'f':
        return '\f';
    case 'v':
        return '\v';
    case '0':
        return 0;
    case 'x':
    case 'u': {
        int n = e == 'x' ? 2 : 4;
        uint32_t v = 0;
        for (int i = 0; i < n; i++) {
            int h = r->p < r->end ? hexval(*r->p) : -1;
            if (h < 0) {
                rx_fail(r, e == 'x' ? "\\x needs two hex digits" : "\\u needs four hex digits");
                return -1;
            }
            v = v * 16 + (uint32_t)h;
            r->p++;
        }
        if (v >= 0xD800 && v <= 0xDFFF) {
            rx_fail(r, "\\u escape is a surrogate");
            return -1;
        }
        return v;
    }
    default:
        break;
    }
    if (e >= '1' && e <= '9') {
        rx_fail(r, "backreferences are not supported");
        return -1;
    }
    if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
        rx_fail(r, e == 'b' || e == 'B' ? "word boundaries (\\b, \\B) are not supported"
                                        : "unknown escape");
        return -1;
    }
    r->p -= 1;
    return next_cp(r); // escaped punctuation or a UTF-8 character
}

static void class_add_cp(struct rx *r, struct rx_class *c, uint32_t cp)
{
    if (cp < 0x80) {
        gr_class_range(&c->ascii, cp, cp);
        return;
    }
    if (c->n_cps == (int)(sizeof c->cps / sizeof c->cps[0])) {
        rx_fail(r, "too many non-ASCII characters in one class (64 at most)");
        return;
    }
    c->cps[c->n_cps++] = cp;
}

// Appends the class as one element, or a rule of alternatives when it holds
// non-ASCII members or (json_string) characters that need escapes.
static void emit_class(struct rx *r, struct gb_seq *s, const struct rx_class *c)
{
    struct gr_class plain = c->ascii;
    struct gr_class special = {0};
    if (r->js) {
        for (unsigned x = 0; x < 0x80; x++)
            if ((x < 0x20 || x == '"' || x == '\\') && gr_class_has(&plain, x)) {
                plain.bits[x >> 5] &= ~(1u << (x & 31));
                gr_class_range(&special, x, x);
            }
    }
    bool any_special = false;
    for (int i = 0; i < 8; i++)
        any_special |= special.bits[i] != 0;
    if (!c->multibyte && !c->n_cps && !any_special) {
        gb_seq_class(r->b, s, &plain);
        return;
    }
    int rule = gb_rule_new(r->b);
    struct gb_seq alt = {0};
    gb_seq_class(r->b, &alt, &plain);
    gb_rule_add(r->b, rule, &alt);
    for (unsigned x = 0; x < 0x80; x++)
        if (gr_class_has(&special, x)) {
            alt.n = 0;
            emit_cp(r, &alt, x);
            gb_rule_add(r->b, rule, &alt);
        }
    for (int i = 0; i < c->n_cps; i++) {
        alt.n = 0;
        emit_cp(r, &alt, c->cps[i]);
        gb_rule_add(r->b, rule, &alt);
    }
    if (c->multibyte) {
        alt.n = 0;
        gb_seq_ref(r->b, &alt, utf8_rule(r));
        gb_rule_add(r->b, rule, &alt);
    }
    gb_seq_free(&alt);
    gb_seq_ref(r->b, s, rule);
}

static void parse_class(struct rx *r, struct gb_seq *s)
{
    struct rx_class c = {0};
    bool negate = false;
    if (r->p < r->end && *r->p == '^') {
        negate = true;
        r->p++;
    }
    bool first = true;
    while (!r->b->err) {
        if (r->p >= r->end) {
            rx_fail(r, "unterminated character class");
            return;
        }
        if (*r->p == ']' && !first) {
            r->p++;
            break;
        }
        first = false;
        if (r->p + 1 < r->end && r->p[0] == '[' && r->p[1] == ':') {
            rx_fail(r, "POSIX classes ([:alpha:]) are not supported");
            return;
        }
        int64_t lo;
        if (*r->p == '\\') {
            r->p++;
            lo = escape_cp(r, &c);
            if (lo == -2)
                continue;
        } else {
            lo = next_cp(r);
            if (lo < 0)
                rx_fail(r, "malformed UTF-8");
        }
        if (lo < 0)
            return;
        if (r->p + 1 < r->end && r->p[0] == '-' && r->p[1] != ']') {
            r->p++;
            int64_t hi;
            if (*r->p == '\\') {
                r->p++;
                hi = escape_cp(r, NULL);
            } else {
                hi = next_cp(r);
                if (hi < 0)
                    rx_fail(r, "malformed UTF-8");
            }
            if (hi < 0)
                return;
            if (hi < lo) {
                rx_fail(r, "character range out of order");
                return;
            }
            if (hi >= 0x80) {
                if (lo == hi) {
                    class_add_cp(r, &c, (uint32_t)lo);
                    continue;
                }
                rx_fail(r, "ranges over non-ASCII characters are not supported");
                return;
            }
            gr_class_range(&c.ascii, (unsigned)lo, (unsigned)hi);
            continue;
        }
        class_add_cp(r, &c, (uint32_t)lo);
    }
    if (r->b->err)
        return;
    if (negate) {
        if (c.n_cps) {
            rx_fail(r, "negated classes with non-ASCII members are not supported");
            return;
        }
        for (int i = 0; i < 4; i++)
            c.ascii.bits[i] = ~c.ascii.bits[i];
        for (int i = 4; i < 8; i++)
            c.ascii.bits[i] = 0;
        c.multibyte = !c.multibyte;
        if (r->js) { // a negated class produces no control characters in a JSON string
            for (unsigned x = 0; x < 0x20; x++)
                c.ascii.bits[x >> 5] &= ~(1u << (x & 31));
        }
    }
    emit_class(r, s, &c);
}

static void parse_alt(struct rx *r, struct gb_seq *out);

static void parse_atom(struct rx *r, struct gb_seq *s)
{
    char ch = *r->p;
    if (ch == '(') {
        r->p++;
        if (r->p < r->end && *r->p == '?') {
            if (r->p + 1 < r->end && r->p[1] == ':') {
                r->p += 2;
            } else if (r->p + 2 < r->end && ((r->p[1] == '<' && r->p[2] != '=' && r->p[2] != '!') ||
                                             (r->p[1] == 'P' && r->p[2] == '<'))) {
                const char *gt = memchr(r->p, '>', (size_t)(r->end - r->p));
                if (!gt) {
                    rx_fail(r, "unterminated group name");
                    return;
                }
                r->p = gt + 1;
            } else {
                rx_fail(r, "lookaround, inline flags and other (? groups are not supported");
                return;
            }
        }
        if (++r->depth > 256) {
            rx_fail(r, "groups nested deeper than 256");
            return;
        }
        parse_alt(r, s);
        r->depth--;
        if (r->b->err)
            return;
        if (r->p >= r->end || *r->p != ')') {
            rx_fail(r, "missing )");
            return;
        }
        r->p++;
        return;
    }
    if (ch == '[') {
        r->p++;
        parse_class(r, s);
        return;
    }
    if (ch == '.') {
        r->p++;
        struct rx_class c = {0};
        if (r->js)
            gr_class_range(&c.ascii, 0x20, 0x7f);
        else {
            gr_class_range(&c.ascii, 0, 0x7f);
            c.ascii.bits[0] &= ~(1u << '\n');
        }
        c.multibyte = true;
        emit_class(r, s, &c);
        return;
    }
    if (ch == '*' || ch == '+' || ch == '?') {
        rx_fail(r, "nothing to repeat");
        return;
    }
    if (ch == '^' || ch == '$') {
        rx_fail(r, "anchors are supported only at the start and end of the pattern");
        return;
    }
    int64_t cp;
    if (ch == '\\') {
        r->p++;
        struct rx_class c = {0};
        cp = escape_cp(r, &c);
        if (cp == -2) {
            emit_class(r, s, &c);
            return;
        }
    } else {
        cp = next_cp(r);
        if (cp < 0)
            rx_fail(r, "malformed UTF-8");
    }
    if (cp >= 0)
        emit_cp(r, s, (uint32_t)cp);
}

// {m}, {m,}, {m,n} at r->p ('{'); false (r->p unchanged) when it is a literal brace.
static bool parse_braces(struct rx *r, long *min, long *max)
{
    const char *q = r->p + 1;
    long a = 0, b;
    int digits = 0;
    while (q < r->end && *q >= '0' && *q <= '9' && digits < 9) {
        a = a * 10 + (*q++ - '0');
        digits++;
    }
    if (!digits)
        return false;
    b = a;
    if (q < r->end && *q == ',') {
        q++;
        b = -1;
        int d2 = 0;
        long v = 0;
        while (q < r->end && *q >= '0' && *q <= '9' && d2 < 9) {
            v = v * 10 + (*q++ - '0');
            d2++;
        }
        if (d2)
            b = v;
    }
    if (q >= r->end || *q != '}')
        return false;
    r->p = q + 1;
    *min = a;
    *max = b;
    return true;
}

static void parse_repeat(struct rx *r, struct gb_seq *out)
{
    struct gb_seq x = {0};
    parse_atom(r, &x);
    while (!r->b->err && r->p < r->end) {
        char q = *r->p;
        long min, max;
        if (q == '?' || q == '*' || q == '+') {
            r->p++;
            min = q == '+' ? 1 : 0;
            max = q == '?' ? 1 : -1;
        } else if (q == '{' && parse_braces(r, &min, &max)) {
        } else {
            break;
        }
        if (r->p < r->end && *r->p == '?')
            r->p++; // lazy: the same language
        else if (r->p < r->end && *r->p == '+') {
            rx_fail(r, "possessive quantifiers are not supported");
            break;
        }
        struct gb_seq y = {0};
        gb_seq_repeat(r->b, &y, &x, min, max);
        gb_seq_free(&x);
        x = y;
        // As Python's re: a quantifier on a quantifier ("a**", "a{2}+") is an
        // error; stacked stars would also nest empty loops (fuzz_grammar found
        // 90 of them taking the matcher's expansion past 10 s).
        if (r->p < r->end && (*r->p == '*' || *r->p == '+' || *r->p == '?' || *r->p == '{')) {
            const char *save = r->p;
            long m2, n2;
            bool brace = *r->p == '{' && parse_braces(r, &m2, &n2);
            r->p = save;
            if (*r->p != '{' || brace) {
                rx_fail(r, "multiple repeat (a quantifier on a quantifier)");
                break;
            }
        }
    }
    gb_seq_cat(r->b, out, &x);
    gb_seq_free(&x);
}

static void parse_concat(struct rx *r, struct gb_seq *out)
{
    while (!r->b->err && r->p < r->end && *r->p != '|' && *r->p != ')') {
        if (*r->p == '$' && r->p + 1 == r->end && r->depth == 0) {
            r->p++;
            break;
        }
        parse_repeat(r, out);
    }
}

static void parse_alt(struct rx *r, struct gb_seq *out)
{
    struct gb_seq first = {0};
    parse_concat(r, &first);
    if (r->b->err || r->p >= r->end || *r->p != '|') {
        gb_seq_cat(r->b, out, &first);
        gb_seq_free(&first);
        return;
    }
    int rule = gb_rule_new(r->b);
    gb_rule_add(r->b, rule, &first);
    gb_seq_free(&first);
    while (!r->b->err && r->p < r->end && *r->p == '|') {
        r->p++;
        struct gb_seq alt = {0};
        parse_concat(r, &alt);
        gb_rule_add(r->b, rule, &alt);
        gb_seq_free(&alt);
    }
    gb_seq_ref(r->b, out, rule);
}

int gr_regex_piece(struct gb *b, struct gb_seq *seq, const char *start, const char **p,
                   const char *end)
{
    struct rx r = {.b = b, .start = start, .p = *p, .end = end, .utf8_rule = -1};
    if (r.p < r.end && *r.p == '[') {
        r.p++;
        parse_class(&r, seq);
    } else if (r.p < r.end && *r.p == '.') {
        parse_atom(&r, seq);
    } else {
        return gb_fail(b, TDM_EINVAL, "internal: not a class");
    }
    *p = r.p;
    return b->err;
}

int gr_regex_compile(struct gb *b, struct gb_seq *seq, const char *pat, size_t len,
                     bool json_string)
{
    if (len > TDM_GRAMMAR_MAX_REGEX_BYTES)
        return gb_fail(b, TDM_EINVAL, "regex: %zu bytes (at most %u)", len,
                       TDM_GRAMMAR_MAX_REGEX_BYTES);
    struct rx r = {
        .b = b, .start = pat, .p = pat, .end = pat + len, .js = json_string, .utf8_rule = -1};
    if (r.p < r.end && *r.p == '^')
        r.p++;
    parse_alt(&r, seq);
    if (!b->err && r.p < r.end)
        rx_fail(&r, *r.p == ')' ? "unmatched )" : "unexpected character");
    return b->err;
}

int gr_compile_regex(struct tdm_grammar **out, const char *pattern, size_t len, char *err,
                     size_t errlen)
{
    struct gb b;
    gb_init(&b);
    int root = gb_rule_new(&b);
    struct gb_seq s = {0};
    gr_regex_compile(&b, &s, pattern, len, false);
    gb_rule_add(&b, root, &s);
    gb_seq_free(&s);
    int rc = gb_finish(&b, root, out, err, errlen);
    gb_fini(&b);
    return rc;
}

int tdm_grammar_compile_choice(struct tdm_grammar **out, const char *const *choices,
                               const size_t *lens, size_t n, char *err, size_t errlen)
{
    *out = NULL;
    if (n == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "choice: the list is empty");
    struct gb b;
    gb_init(&b);
    int root = gb_rule_new(&b);
    for (size_t i = 0; i < n && !b.err; i++) {
        if (lens[i] > TDM_GRAMMAR_MAX_REGEX_BYTES) {
            gb_fail(&b, TDM_EINVAL, "choice %zu: %zu bytes (at most %u)", i, lens[i],
                    TDM_GRAMMAR_MAX_REGEX_BYTES);
            break;
        }
        struct gb_seq s = {0};
        gb_seq_lit(&b, &s, choices[i], lens[i]);
        gb_rule_add(&b, root, &s);
        gb_seq_free(&s);
    }
    int rc = gb_finish(&b, root, out, err, errlen);
    gb_fini(&b);
    return rc;
}
