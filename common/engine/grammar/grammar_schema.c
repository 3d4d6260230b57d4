// SPDX-License-Identifier: Apache-2.0
// grammar_schema: JSON Schema (and "any JSON object") into grammar rules.
// Output JSON has object properties in schema order (optional ones may be left
// out), as xgrammar and vLLM do by default, and 0..TDM_GRAMMAR_MAX_WS bytes of
// [ \t\n] at each structural place (xgrammar allows any amount; a bound keeps a
// model from emitting whitespace forever). Choices made and documented in
// docs/structured-outputs.md:
//   - additionalProperties absent or false: only the listed properties (as
//     xgrammar's strict mode); true or a schema: refused. An object schema with
//     no "properties" at all is any JSON object.
//   - integer/number bounds (minimum, maximum, exclusive*): grammar_range.c;
//     multipleOf is refused.
//   - oneOf is compiled as anyOf; allOf, not, if/then/else, patternProperties,
//     prefixItems and the other unlisted keywords are refused
//     with a message naming the keyword. Annotations (title, description,
//     default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly)
//     are ignored.
//   - $ref: "#", "#/$defs/NAME" and "#/definitions/NAME" (recursion allowed;
//     nesting is bounded at match time by TDM_GRAMMAR_MAX_STACK).
// Schema text is depth-checked (TDM_JSON_MAX_DEPTH) before cJSON parses it.
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

struct sc_ref {
    const cJSON *schema;
    int rule;
};

struct sc {
    struct gb b;
    const cJSON *root;
    int ws, value, string, number, integer, object_any, array_any, character, utf8;
    struct sc_ref *refs; // memo of $ref targets (and their rules)
    size_t n_refs, cap_refs;
    int depth;
};

static int schema_rule(struct sc *c, const cJSON *s, const char *path);

// ---- shared rules ----------------------------------------------------------------------
static void lit(struct sc *c, struct gb_seq *s, const char *text)
{
    gb_seq_lit(&c->b, s, text, strlen(text));
}

static void ws(struct sc *c, struct gb_seq *s)
{
    gb_seq_ref(&c->b, s, c->ws);
}

static void make_ws(struct sc *c)
{
    struct gb_seq one = {0};
    struct gr_class w = {0};
    gr_class_range(&w, ' ', ' ');
    gr_class_range(&w, '\t', '\n');
    gb_seq_class(&c->b, &one, &w);
    struct gb_seq rep = {0};
    gb_seq_repeat(&c->b, &rep, &one, 0, TDM_GRAMMAR_MAX_WS);
    c->ws = gb_rule_new(&c->b);
    gb_rule_add(&c->b, c->ws, &rep);
    gb_seq_free(&one);
    gb_seq_free(&rep);
}

// One character of a JSON string's text: unescaped (not '"', '\\', control),
// an escape, or a well-formed multi-byte UTF-8 character.
static void make_character(struct sc *c)
{
    struct gb *b = &c->b;
    c->utf8 = gb_utf8_multibyte(b);
    c->character = gb_rule_new(b);
    struct gb_seq alt = {0};
    struct gr_class plain = {0};
    gr_class_range(&plain, 0x20, 0x7f);
    plain.bits['"' >> 5] &= ~(1u << ('"' & 31));
    plain.bits['\\' >> 5] &= ~(1u << ('\\' & 31));
    gb_seq_class(b, &alt, &plain);
    gb_rule_add(b, c->character, &alt);
    alt.n = 0;
    struct gr_class esc = {0};
    const char *e = "\"\\/bfnrt";
    for (; *e; e++)
        gr_class_range(&esc, (unsigned char)*e, (unsigned char)*e);
    gb_seq_byte(b, &alt, '\\');
    gb_seq_class(b, &alt, &esc);
    gb_rule_add(b, c->character, &alt);
    alt.n = 0;
    struct gr_class hex = {0};
    gr_class_range(&hex, '0', '9');
    gr_class_range(&hex, 'a', 'f');
    gr_class_range(&hex, 'A', 'F');
    lit(c, &alt, "\\u");
    for (int i = 0; i < 4; i++)
        gb_seq_class(b, &alt, &hex);
    gb_rule_add(b, c->character, &alt);
    alt.n = 0;
    gb_seq_ref(b, &alt, c->utf8);
    gb_rule_add(b, c->character, &alt);
    gb_seq_free(&alt);
}

static int string_rule(struct sc *c, long min, long max)
{
    struct gb_seq s = {0}, ch = {0};
    gb_seq_byte(&c->b, &s, '"');
    gb_seq_ref(&c->b, &ch, c->character);
    gb_seq_repeat(&c->b, &s, &ch, min, max);
    gb_seq_byte(&c->b, &s, '"');
    int r = gb_rule_new(&c->b);
    gb_rule_add(&c->b, r, &s);
    gb_seq_free(&s);
    gb_seq_free(&ch);
    return r;
}

static int regex_string_rule(struct sc *c, const char *pattern)
{
    struct gb_seq s = {0};
    gb_seq_byte(&c->b, &s, '"');
    gr_regex_compile(&c->b, &s, pattern, strlen(pattern), true);
    gb_seq_byte(&c->b, &s, '"');
    int r = gb_rule_new(&c->b);
    gb_rule_add(&c->b, r, &s);
    gb_seq_free(&s);
    return r;
}

static int regex_rule(struct sc *c, const char *pattern)
{
    struct gb_seq s = {0};
    gr_regex_compile(&c->b, &s, pattern, strlen(pattern), false);
    int r = gb_rule_new(&c->b);
    gb_rule_add(&c->b, r, &s);
    gb_seq_free(&s);
    return r;
}

// "{" ws ( "\"k\"" ws ":" ws value ( ws "," ws ... )* )? ws "}" with any keys.
static int any_object_rule(struct sc *c)
{
    struct gb *b = &c->b;
    struct gb_seq member = {0}, more = {0}, body = {0}, obj = {0};
    gb_seq_ref(b, &member, c->string);
    ws(c, &member);
    gb_seq_byte(b, &member, ':');
    ws(c, &member);
    gb_seq_ref(b, &member, c->value);
    ws(c, &more);
    gb_seq_byte(b, &more, ',');
    ws(c, &more);
    gb_seq_cat(b, &more, &member);
    gb_seq_cat(b, &body, &member);
    gb_seq_ref(b, &body, gb_star(b, &more));
    gb_seq_byte(b, &obj, '{');
    ws(c, &obj);
    gb_seq_ref(b, &obj, gb_opt(b, &body));
    ws(c, &obj);
    gb_seq_byte(b, &obj, '}');
    int r = gb_rule_new(b);
    gb_rule_add(b, r, &obj);
    gb_seq_free(&member);
    gb_seq_free(&more);
    gb_seq_free(&body);
    gb_seq_free(&obj);
    return r;
}

// "[" ws ( item ( ws "," ws item ){min-1,max-1} )? ws "]"
static int array_rule(struct sc *c, int item, long min, long max)
{
    struct gb *b = &c->b;
    if (min < 0 || min > TDM_GRAMMAR_MAX_REPEAT || max > TDM_GRAMMAR_MAX_REPEAT ||
        (max >= 0 && max < min)) {
        gb_fail(b, TDM_EINVAL, "array: minItems %ld / maxItems %ld out of range (0..%d)", min, max,
                TDM_GRAMMAR_MAX_REPEAT);
        return -1;
    }
    struct gb_seq more = {0}, body = {0}, arr = {0};
    ws(c, &more);
    gb_seq_byte(b, &more, ',');
    ws(c, &more);
    gb_seq_ref(b, &more, item);
    gb_seq_ref(b, &body, item);
    gb_seq_repeat(b, &body, &more, min > 0 ? min - 1 : 0, max < 0 ? -1 : max > 0 ? max - 1 : 0);
    gb_seq_byte(b, &arr, '[');
    ws(c, &arr);
    if (max != 0) {
        if (min == 0)
            gb_seq_ref(b, &arr, gb_opt(b, &body));
        else
            gb_seq_cat(b, &arr, &body);
        ws(c, &arr);
    }
    gb_seq_byte(b, &arr, ']');
    int r = gb_rule_new(b);
    gb_rule_add(b, r, &arr);
    gb_seq_free(&more);
    gb_seq_free(&body);
    gb_seq_free(&arr);
    return r;
}

static void make_shared(struct sc *c)
{
    struct gb *b = &c->b;
    make_ws(c);
    make_character(c);
    c->string = string_rule(c, 0, -1);
    // Finite values only (issue 28, item 2: "2E1111" parsed to Infinity and the
    // SDK's parse threw): at most 300 integer digits (< 1e300), and a number with
    // an exponent keeps 200 digits and a two-digit exponent (< 1e299).
    // Fractions of at most TDM_GRAMMAR_MAX_FRAC_DIGITS (20) digits.
    c->integer = regex_rule(c, "-?(0|[1-9][0-9]{0,299})");
    c->number = regex_rule(c, "-?(0|[1-9][0-9]{0,299})(\\.[0-9]{1,20})?|"
                              "-?(0|[1-9][0-9]{0,199})(\\.[0-9]{1,20})?[eE][+-]?[0-9]{1,2}");
    c->value = gb_rule_new(b); // filled below: it refers to object and array
    c->object_any = any_object_rule(c);
    c->array_any = array_rule(c, c->value, 0, -1);
    const int alts[] = {c->object_any, c->array_any, c->string, c->number};
    struct gb_seq s = {0};
    for (size_t i = 0; i < sizeof alts / sizeof alts[0]; i++) {
        s.n = 0;
        gb_seq_ref(b, &s, alts[i]);
        gb_rule_add(b, c->value, &s);
    }
    const char *words[] = {"true", "false", "null"};
    for (size_t i = 0; i < 3; i++) {
        s.n = 0;
        lit(c, &s, words[i]);
        gb_rule_add(b, c->value, &s);
    }
    gb_seq_free(&s);
}

// ---- schema keywords --------------------------------------------------------------------
static const char *const annotations[] = {
    "title",      "description", "default",   "examples", "$schema",     "$id", "$comment",
    "deprecated", "readOnly",    "writeOnly", "$defs",    "definitions", NULL};

static bool in_list(const char *k, const char *const *list)
{
    for (; *list; list++)
        if (!strcmp(k, *list))
            return true;
    return false;
}

static int fail(struct sc *c, const char *path, const char *fmt, const char *arg)
{
    char what[240];
    snprintf(what, sizeof what, fmt, arg);
    return gb_fail(&c->b, TDM_EINVAL, "json schema %s: %s", path, what);
}

static bool get_count(struct sc *c, const cJSON *s, const char *key, const char *path, long *v)
{
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(s, key);
    if (!n)
        return false;
    if (!cJSON_IsNumber(n) || n->valuedouble < 0 || n->valuedouble > TDM_GRAMMAR_MAX_REPEAT ||
        n->valuedouble != (double)(long)n->valuedouble) {
        fail(c, path, "%s must be an integer in 0..10000", key);
        return false;
    }
    *v = (long)n->valuedouble;
    return true;
}

// The literal JSON text of v as one alternative of rule r.
static void add_literal_alt(struct sc *c, int r, const cJSON *v, const char *path)
{
    char *text = cJSON_PrintUnformatted(v);
    if (!text) {
        gb_fail(&c->b, TDM_ENOMEM, "json schema %s: out of memory", path);
        return;
    }
    struct gb_seq s = {0};
    lit(c, &s, text);
    gb_rule_add(&c->b, r, &s);
    gb_seq_free(&s);
    cJSON_free(text);
}

static int format_rule(struct sc *c, const char *format, const char *path)
{
#define DATE "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
#define TIME                                                                                       \
    "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,9})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9]" \
    ")"
    static const struct {
        const char *name, *regex;
    } formats[] = {
        {"date", DATE},
        {"time", TIME},
        {"date-time", DATE "T" TIME},
        {"uuid", "[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"},
        {"email",
         "[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9-]{1,63}(\\.[a-zA-Z0-9-]{1,63})*\\.[a-zA-Z]{2,24}"},
        {"uri", "[a-zA-Z][a-zA-Z0-9+.-]{0,31}:[A-Za-z0-9._~:/?#@!$&'()*+,;=%-]{1,2000}"},
        {"ipv4", "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])(\\.(25[0-5]|2[0-4][0-9]|1[0-9]{2}|"
                 "[1-9]?[0-9])){3}"},
    };
#undef DATE
#undef TIME
    for (size_t i = 0; i < sizeof formats / sizeof formats[0]; i++)
        if (!strcmp(format, formats[i].name))
            return regex_string_rule(c, formats[i].regex);
    fail(c, path,
         "format \"%s\" is not supported (date, time, date-time, uuid, email, ipv4, uri are)",
         format);
    return -1;
}

static int string_schema(struct sc *c, const cJSON *s, const char *path)
{
    long min = 0, max = -1;
    get_count(c, s, "minLength", path, &min);
    get_count(c, s, "maxLength", path, &max);
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(s, "pattern");
    const cJSON *format = cJSON_GetObjectItemCaseSensitive(s, "format");
    if (c->b.err)
        return -1;
    if (max >= 0 && max < min)
        return fail(c, path, "maxLength is below minLength%s", ""), -1;
    if ((pattern || format) && (min != 0 || max != -1))
        return fail(c, path, "%s with minLength/maxLength is not supported",
                    pattern ? "pattern" : "format"),
               -1;
    // A pattern beside a format (zod writes both for z.email(), z.ipv4(),
    // z.uuid(), z.iso.date()...): the pattern constrains, the format is read as
    // the annotation JSON Schema 2020-12 makes it by default.
    if (pattern && format && !cJSON_IsString(format))
        return fail(c, path, "format must be a string%s", ""), -1;
    if (pattern) {
        if (!cJSON_IsString(pattern))
            return fail(c, path, "pattern must be a string%s", ""), -1;
        return regex_string_rule(c, pattern->valuestring);
    }
    if (format) {
        if (!cJSON_IsString(format))
            return fail(c, path, "format must be a string%s", ""), -1;
        return format_rule(c, format->valuestring, path);
    }
    if (min == 0 && max == -1)
        return c->string;
    return string_rule(c, min, max);
}

static int array_schema(struct sc *c, const cJSON *s, const char *path)
{
    long min = 0, max = -1;
    get_count(c, s, "minItems", path, &min);
    get_count(c, s, "maxItems", path, &max);
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    if (c->b.err)
        return -1;
    int item = c->value;
    if (items) {
        char sub[512];
        snprintf(sub, sizeof sub, "%s/items", path);
        item = schema_rule(c, items, sub);
    }
    if (item < 0)
        return -1;
    return array_rule(c, item, min, max);
}

// Properties in schema order; see the file comment for optional ones.
static int object_schema(struct sc *c, const cJSON *s, const char *path)
{
    struct gb *b = &c->b;
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *required = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (extra && !cJSON_IsFalse(extra) && !(cJSON_IsTrue(extra) && !props))
        return fail(c, path, "additionalProperties other than false is not supported%s", ""), -1;
    if (required && !cJSON_IsArray(required))
        return fail(c, path, "required must be an array%s", ""), -1;
    if (props && !cJSON_IsObject(props))
        return fail(c, path, "properties must be an object%s", ""), -1;
    if (!props) {
        if (required && cJSON_GetArraySize(required) > 0)
            return fail(c, path, "required names properties that are not listed%s", ""), -1;
        return c->object_any;
    }
    int n = cJSON_GetArraySize(props);
    // Each required name must be a listed property.
    const cJSON *rq;
    cJSON_ArrayForEach(rq, required)
    {
        if (!cJSON_IsString(rq))
            return fail(c, path, "required holds a non-string%s", ""), -1;
        if (!cJSON_GetObjectItemCaseSensitive(props, rq->valuestring))
            return fail(c, path, "required property \"%s\" is not in properties", rq->valuestring),
                   -1;
    }
    int *member = malloc(((size_t)n + 1) * sizeof *member);
    bool *req = calloc((size_t)n + 1, sizeof *req);
    int *after = malloc(((size_t)n + 1) * sizeof *after); // R_i: rest, something emitted
    int *first = malloc(((size_t)n + 1) * sizeof *first); // S_i: rest, nothing emitted yet
    if (!member || !req || !after || !first) {
        free(member), free(req), free(after), free(first);
        gb_fail(b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    int i = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, props)
    {
        char sub[512];
        snprintf(sub, sizeof sub, "%s/properties/%.200s", path, p->string);
        int value = schema_rule(c, p, sub);
        cJSON *key = cJSON_CreateString(p->string);
        char *key_text = key ? cJSON_PrintUnformatted(key) : NULL;
        struct gb_seq m = {0};
        if (key_text)
            lit(c, &m, key_text);
        else
            gb_fail(b, TDM_ENOMEM, "out of memory");
        cJSON_free(key_text);
        cJSON_Delete(key);
        ws(c, &m);
        gb_seq_byte(b, &m, ':');
        ws(c, &m);
        if (value >= 0)
            gb_seq_ref(b, &m, value);
        member[i] = gb_rule_new(b);
        gb_rule_add(b, member[i], &m);
        gb_seq_free(&m);
        cJSON_ArrayForEach(rq, required)
        {
            if (!strcmp(rq->valuestring, p->string))
                req[i] = true;
        }
        i++;
    }
    // Built from the end: R_n = S_n = ε.
    struct gb_seq empty = {0}, alt = {0};
    after[n] = gb_rule_new(b);
    gb_rule_add(b, after[n], &empty);
    first[n] = after[n];
    for (i = n - 1; i >= 0 && !b->err; i--) {
        after[i] = gb_rule_new(b);
        alt.n = 0;
        ws(c, &alt);
        gb_seq_byte(b, &alt, ',');
        ws(c, &alt);
        gb_seq_ref(b, &alt, member[i]);
        gb_seq_ref(b, &alt, after[i + 1]);
        gb_rule_add(b, after[i], &alt);
        if (!req[i]) {
            alt.n = 0;
            gb_seq_ref(b, &alt, after[i + 1]);
            gb_rule_add(b, after[i], &alt);
        }
        first[i] = gb_rule_new(b);
        alt.n = 0;
        gb_seq_ref(b, &alt, member[i]);
        gb_seq_ref(b, &alt, after[i + 1]);
        gb_rule_add(b, first[i], &alt);
        if (!req[i]) {
            alt.n = 0;
            gb_seq_ref(b, &alt, first[i + 1]);
            gb_rule_add(b, first[i], &alt);
        }
    }
    alt.n = 0;
    gb_seq_byte(b, &alt, '{');
    ws(c, &alt);
    gb_seq_ref(b, &alt, first[0]);
    ws(c, &alt);
    gb_seq_byte(b, &alt, '}');
    int r = gb_rule_new(b);
    gb_rule_add(b, r, &alt);
    gb_seq_free(&alt);
    free(member), free(req), free(after), free(first);
    return b->err ? -1 : r;
}

// One bound: minimum/maximum (a number), or exclusiveMinimum/exclusiveMaximum
// as a number (draft 6+) or as draft 4's boolean that makes the other one
// exclusive. Keeps the stricter of two. false when the schema is refused.
static bool read_bound(struct sc *c, const cJSON *s, const char *path, bool upper, bool *has,
                       double *v, bool *open)
{
    const char *inc = upper ? "maximum" : "minimum";
    const char *exc = upper ? "exclusiveMaximum" : "exclusiveMinimum";
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(s, inc);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(s, exc);
    char msg[160];
    *has = false;
    *open = false;
    if (a) {
        if (!cJSON_IsNumber(a))
            return fail(c, path, "%s must be a number", inc), false;
        *has = true;
        *v = a->valuedouble;
    }
    if (cJSON_IsBool(e)) {
        if (cJSON_IsTrue(e)) {
            if (!a) {
                snprintf(msg, sizeof msg, "%s true needs %s", exc, inc);
                return fail(c, path, "%s", msg), false;
            }
            *open = true;
        }
    } else if (e) {
        if (!cJSON_IsNumber(e))
            return fail(c, path, "%s must be a number", exc), false;
        double x = e->valuedouble;
        if (!*has || (upper ? x <= *v : x >= *v)) {
            *has = true;
            *v = x;
            *open = true;
        }
    }
    if (*has && !(*v >= -(double)TDM_GRAMMAR_MAX_BOUND && *v <= (double)TDM_GRAMMAR_MAX_BOUND)) {
        snprintf(msg, sizeof msg, "%s %g is out of the supported range (|bound| <= 1e18)",
                 e && *open ? exc : inc, *v);
        return fail(c, path, "%s", msg), false;
    }
    return true;
}

// Multiples of k within [lo, hi] as literal alternatives (a small range).
static int multiples_literal_rule(struct sc *c, long long k, long long lo, long long hi)
{
    int r = gb_rule_new(&c->b);
    long long first = lo % k == 0 ? lo : lo >= 0 ? lo + (k - lo % k) : lo - lo % k;
    struct gb_seq s = {0};
    char t[32];
    for (long long x = first; x <= hi && !c->b.err; x += k) {
        s.n = 0;
        snprintf(t, sizeof t, "%lld", x);
        lit(c, &s, t);
        gb_rule_add(&c->b, r, &s);
    }
    gb_seq_free(&s);
    return r;
}

// Multiples of k of up to TDM_GRAMMAR_MULTIPLE_DIGITS digits, either sign: the
// remainder automaton as rules R[l][m] (l digits may follow, m = the value so
// far mod k).
static int multiples_dfa_rule(struct sc *c, int k)
{
    struct gb *b = &c->b;
    const int L = TDM_GRAMMAR_MULTIPLE_DIGITS;
    int *R = malloc(sizeof *R * (size_t)L * (size_t)k);
    if (!R) {
        gb_fail(b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    for (int i = 0; i < L * k; i++)
        R[i] = gb_rule_new(b);
    struct gb_seq s = {0};
    char d[2] = {0};
    for (int l = 0; l < L && !b->err; l++)
        for (int m = 0; m < k; m++) {
            int rule = R[l * k + m];
            if (m == 0) {
                s.n = 0;
                gb_rule_add(b, rule, &s); // the number may end here
            }
            for (int dig = 0; l > 0 && dig <= 9; dig++) {
                s.n = 0;
                d[0] = (char)('0' + dig);
                lit(c, &s, d);
                gb_seq_ref(b, &s, R[(l - 1) * k + (m * 10 + dig) % k]);
                gb_rule_add(b, rule, &s);
            }
        }
    // number ::= "0" | "-"? [1-9] R[L-1][digit mod k]
    int top = gb_rule_new(b);
    s.n = 0;
    lit(c, &s, "0");
    gb_rule_add(b, top, &s);
    for (int neg = 0; neg < 2; neg++)
        for (int dig = 1; dig <= 9; dig++) {
            s.n = 0;
            if (neg)
                lit(c, &s, "-");
            d[0] = (char)('0' + dig);
            lit(c, &s, d);
            gb_seq_ref(b, &s, R[(L - 1) * k + dig % k]);
            gb_rule_add(b, top, &s);
        }
    gb_seq_free(&s);
    free(R);
    return b->err ? -1 : top;
}

// integer and number with bounds and multipleOf (issue 28, item 2): exact
// integer ranges (zod's z.number().int() writes +-(2^53 - 1)); numbers with
// integral bounds; multipleOf a whole k (as literals when at most 1000
// multiples are in bounds, else the remainder automaton over values of up to
// 15 digits when the bounds allow every one of them), or 0.1, 0.01, ... 1e-9 on
// a number (that many fraction digits at most).
static int numeric_schema(struct sc *c, const cJSON *s, const char *path, bool integer)
{
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(s, "multipleOf");
    long long step = 0;  // a whole multipleOf
    int frac_digits = 0; // multipleOf 10^-p on a number
    char msg[220];
    if (mo) {
        if (!cJSON_IsNumber(mo) || !(mo->valuedouble > 0))
            return fail(c, path, "%s", "multipleOf must be a positive number"), -1;
        double m = mo->valuedouble;
        int p = (int)lround(-log10(m));
        if (m == floor(m) && m <= 1e6) {
            step = (long long)m;
        } else if (p >= 1 && p <= 9 && fabs(m - pow(10, -p)) <= 1e-12 * m) {
            if (!integer) // every integer is a multiple of 0.1
                frac_digits = p;
        } else {
            snprintf(msg, sizeof msg,
                     "multipleOf %g is not supported (whole numbers up to 1e6, and 0.1, 0.01, "
                     "... 1e-9 on numbers, are)",
                     m);
            return fail(c, path, "%s", msg), -1;
        }
        if (step > 1)
            integer = true; // a number that is a multiple of a whole k is an integer
    }
    struct gr_bounds r = {0};
    double lo = 0, hi = 0;
    if (!read_bound(c, s, path, false, &r.has_lo, &lo, &r.lo_open) ||
        !read_bound(c, s, path, true, &r.has_hi, &hi, &r.hi_open))
        return -1;
    r.frac_digits = frac_digits;
    if (!r.has_lo && !r.has_hi && step <= 1 && !frac_digits)
        return integer ? c->integer : c->number;
    if (integer) { // to closed integer bounds
        if (r.has_lo) {
            double L = ceil(lo);
            r.lo = (long long)L + (r.lo_open && L == lo ? 1 : 0);
        }
        if (r.has_hi) {
            double H = floor(hi);
            r.hi = (long long)H - (r.hi_open && H == hi ? 1 : 0);
        }
        r.lo_open = r.hi_open = false;
        if (r.has_lo && r.has_hi && r.lo > r.hi)
            return fail(c, path, "%s", "no integer is within minimum/maximum"), -1;
        if (step > 1) {
            const long long wide = TDM_GRAMMAR_MULTIPLE_SPAN;
            if (r.has_lo && r.has_hi && (r.hi - r.lo) / step <= 1000)
                return multiples_literal_rule(c, step, r.lo, r.hi);
            if ((!r.has_lo || r.lo <= -wide) && (!r.has_hi || r.hi >= wide) && step <= 1000)
                return multiples_dfa_rule(c, (int)step);
            snprintf(msg, sizeof msg,
                     "multipleOf %lld within these bounds is not supported (at most 1000 "
                     "multiples in bounds, or bounds beyond +-(10^15 - 1) with multipleOf <= 1000, "
                     "are)",
                     step);
            return fail(c, path, "%s", msg), -1;
        }
    } else {
        if ((r.has_lo && lo != floor(lo)) || (r.has_hi && hi != floor(hi))) {
            snprintf(msg, sizeof msg,
                     "a number's bounds must be whole numbers (got %g..%g); an integer's may be "
                     "any",
                     r.has_lo ? lo : -INFINITY, r.has_hi ? hi : INFINITY);
            return fail(c, path, "%s", msg), -1;
        }
        r.lo = (long long)lo;
        r.hi = (long long)hi;
        if (r.has_lo && r.has_hi && (r.lo > r.hi || (r.lo == r.hi && (r.lo_open || r.hi_open))))
            return fail(c, path, "%s", "no number is within minimum/maximum"), -1;
    }
    char *re = integer ? gr_int_range_regex(&r) : gr_number_range_regex(&r);
    if (!re) {
        gb_fail(&c->b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    int rule = regex_rule(c, re);
    free(re);
    return rule;
}

static int type_rule(struct sc *c, const cJSON *s, const char *type, const char *path)
{
    if (!strcmp(type, "string"))
        return string_schema(c, s, path);
    if (!strcmp(type, "integer"))
        return numeric_schema(c, s, path, true);
    if (!strcmp(type, "number"))
        return numeric_schema(c, s, path, false);
    if (!strcmp(type, "object"))
        return object_schema(c, s, path);
    if (!strcmp(type, "array"))
        return array_schema(c, s, path);
    struct gb_seq t = {0};
    if (!strcmp(type, "boolean")) {
        int r = gb_rule_new(&c->b);
        lit(c, &t, "true");
        gb_rule_add(&c->b, r, &t);
        t.n = 0;
        lit(c, &t, "false");
        gb_rule_add(&c->b, r, &t);
        gb_seq_free(&t);
        return r;
    }
    if (!strcmp(type, "null")) {
        int r = gb_rule_new(&c->b);
        lit(c, &t, "null");
        gb_rule_add(&c->b, r, &t);
        gb_seq_free(&t);
        return r;
    }
    fail(c, path, "unknown type \"%s\"", type);
    return -1;
}

static const cJSON *resolve_ref(struct sc *c, const char *ref, const char *path)
{
    if (!strcmp(ref, "#"))
        return c->root;
    const char *name = NULL, *where = NULL;
    if (!strncmp(ref, "#/$defs/", 8))
        name = ref + 8, where = "$defs";
    else if (!strncmp(ref, "#/definitions/", 14))
        name = ref + 14, where = "definitions";
    if (!name || strchr(name, '/') || strchr(name, '~')) {
        fail(c, path, "$ref \"%s\" is not supported (#, #/$defs/NAME, #/definitions/NAME are)",
             ref);
        return NULL;
    }
    const cJSON *defs = cJSON_GetObjectItemCaseSensitive(c->root, where);
    const cJSON *t = defs ? cJSON_GetObjectItemCaseSensitive(defs, name) : NULL;
    if (!t)
        fail(c, path, "$ref \"%s\" names no definition", ref);
    return t;
}

static int ref_rule(struct sc *c, const cJSON *target, const char *path)
{
    for (size_t i = 0; i < c->n_refs; i++)
        if (c->refs[i].schema == target)
            return c->refs[i].rule;
    if (tdm_grow(&c->refs, &c->cap_refs, c->n_refs + 1, sizeof *c->refs, 8) != TDM_OK) {
        gb_fail(&c->b, TDM_ENOMEM, "out of memory");
        return -1;
    }
    // The rule exists before its body so that recursive references find it.
    int r = gb_rule_new(&c->b);
    c->refs[c->n_refs].schema = target;
    c->refs[c->n_refs].rule = r;
    c->n_refs++;
    int body = schema_rule(c, target, path);
    struct gb_seq s = {0};
    if (body >= 0)
        gb_seq_ref(&c->b, &s, body);
    gb_rule_add(&c->b, r, &s);
    gb_seq_free(&s);
    return c->b.err ? -1 : r;
}

static const char *const known[] = {"type",
                                    "properties",
                                    "required",
                                    "additionalProperties",
                                    "items",
                                    "minItems",
                                    "maxItems",
                                    "minLength",
                                    "maxLength",
                                    "pattern",
                                    "format",
                                    "enum",
                                    "const",
                                    "anyOf",
                                    "oneOf",
                                    "$ref",
                                    "minimum",
                                    "maximum",
                                    "exclusiveMinimum",
                                    "exclusiveMaximum",
                                    "multipleOf",
                                    NULL};

// "enum": one alternative per listed literal.
static int enum_rule(struct sc *c, const cJSON *en, const char *path)
{
    if (!cJSON_IsArray(en) || cJSON_GetArraySize(en) == 0)
        return fail(c, path, "enum must be a non-empty array%s", ""), -1;
    int r = gb_rule_new(&c->b);
    const cJSON *v;
    cJSON_ArrayForEach(v, en) add_literal_alt(c, r, v, path);
    return r;
}

// "anyOf" or "oneOf" (compiled alike): one alternative per subschema.
static int any_of_rule(struct sc *c, const cJSON *any, const char *path)
{
    struct gb *b = &c->b;
    if (!cJSON_IsArray(any) || cJSON_GetArraySize(any) == 0)
        return fail(c, path, "anyOf/oneOf must be a non-empty array%s", ""), -1;
    int r = gb_rule_new(b);
    int i = 0;
    const cJSON *v;
    cJSON_ArrayForEach(v, any)
    {
        char sub[512];
        snprintf(sub, sizeof sub, "%s/anyOf/%d", path, i++);
        int alt_rule = schema_rule(c, v, sub);
        struct gb_seq seq = {0};
        if (alt_rule >= 0)
            gb_seq_ref(b, &seq, alt_rule);
        gb_rule_add(b, r, &seq);
        gb_seq_free(&seq);
    }
    return r;
}

// "type": [names]: one alternative per named type.
static int type_list_rule(struct sc *c, const cJSON *s, const cJSON *types, const char *path)
{
    struct gb *b = &c->b;
    int r = gb_rule_new(b);
    const cJSON *t;
    cJSON_ArrayForEach(t, types)
    {
        if (!cJSON_IsString(t)) {
            fail(c, path, "type must name types%s", "");
            return r;
        }
        struct gb_seq seq = {0};
        gb_seq_ref(b, &seq, type_rule(c, s, t->valuestring, path));
        gb_rule_add(b, r, &seq);
        gb_seq_free(&seq);
    }
    return r;
}

// No type: infer from the keywords present, else any value.
static int inferred_rule(struct sc *c, const cJSON *s, const char *path)
{
    if (cJSON_GetObjectItemCaseSensitive(s, "properties") ||
        cJSON_GetObjectItemCaseSensitive(s, "required") ||
        cJSON_GetObjectItemCaseSensitive(s, "additionalProperties"))
        return object_schema(c, s, path);
    if (cJSON_GetObjectItemCaseSensitive(s, "items") ||
        cJSON_GetObjectItemCaseSensitive(s, "minItems") ||
        cJSON_GetObjectItemCaseSensitive(s, "maxItems"))
        return array_schema(c, s, path);
    if (cJSON_GetObjectItemCaseSensitive(s, "pattern") ||
        cJSON_GetObjectItemCaseSensitive(s, "format") ||
        cJSON_GetObjectItemCaseSensitive(s, "minLength") ||
        cJSON_GetObjectItemCaseSensitive(s, "maxLength"))
        return string_schema(c, s, path);
    if (cJSON_GetObjectItemCaseSensitive(s, "minimum") ||
        cJSON_GetObjectItemCaseSensitive(s, "maximum") ||
        cJSON_GetObjectItemCaseSensitive(s, "exclusiveMinimum") ||
        cJSON_GetObjectItemCaseSensitive(s, "exclusiveMaximum") ||
        cJSON_GetObjectItemCaseSensitive(s, "multipleOf"))
        return numeric_schema(c, s, path, false);
    return c->value;
}

// The rule for an object schema whose keywords are all known. The first keyword present of
// $ref, const, enum, anyOf/oneOf and type decides; the rest beside it are not checked.
static int keyword_rule(struct sc *c, const cJSON *s, const char *path)
{
    const cJSON *ref = cJSON_GetObjectItemCaseSensitive(s, "$ref");
    const cJSON *en = cJSON_GetObjectItemCaseSensitive(s, "enum");
    const cJSON *cn = cJSON_GetObjectItemCaseSensitive(s, "const");
    const cJSON *any = cJSON_GetObjectItemCaseSensitive(s, "anyOf");
    if (!any)
        any = cJSON_GetObjectItemCaseSensitive(s, "oneOf");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (ref) {
        if (!cJSON_IsString(ref))
            return fail(c, path, "$ref must be a string%s", ""), -1;
        const cJSON *t = resolve_ref(c, ref->valuestring, path);
        return t ? ref_rule(c, t, ref->valuestring) : -1;
    }
    if (cn) {
        int r = gb_rule_new(&c->b);
        add_literal_alt(c, r, cn, path);
        return r;
    }
    if (en)
        return enum_rule(c, en, path);
    if (any)
        return any_of_rule(c, any, path);
    if (cJSON_IsString(type))
        return type_rule(c, s, type->valuestring, path);
    if (cJSON_IsArray(type))
        return type_list_rule(c, s, type, path);
    if (type)
        return fail(c, path, "type must be a string or an array%s", ""), -1;
    return inferred_rule(c, s, path);
}

static int schema_rule(struct sc *c, const cJSON *s, const char *path)
{
    struct gb *b = &c->b;
    if (b->err)
        return -1;
    if (cJSON_IsTrue(s))
        return c->value;
    if (cJSON_IsFalse(s))
        return fail(c, path, "false schema accepts nothing%s", ""), -1;
    if (!cJSON_IsObject(s))
        return fail(c, path, "a schema must be an object or a boolean%s", ""), -1;
    if (++c->depth > TDM_JSON_MAX_DEPTH)
        return fail(c, path, "schema nested too deeply%s", ""), -1;
    int r = -1;
    bool all_known = true;
    const cJSON *k;
    cJSON_ArrayForEach(k, s)
    {
        if (!in_list(k->string, known) && !in_list(k->string, annotations)) {
            fail(c, path, "keyword \"%s\" is not supported", k->string);
            all_known = false;
            break;
        }
    }
    if (all_known)
        r = keyword_rule(c, s, path);
    c->depth--;
    return b->err ? -1 : r;
}

// ---- entry points -----------------------------------------------------------------------
static int compile_root(const cJSON *schema, struct tdm_grammar **out, char *err, size_t errlen)
{
    struct sc c = {0};
    gb_init(&c.b);
    c.root = schema;
    make_shared(&c);
    int body = schema ? schema_rule(&c, schema, "#") : c.object_any;
    // root ::= body (no whitespace before or after the value)
    int root = gb_rule_new(&c.b);
    struct gb_seq s = {0};
    if (body >= 0)
        gb_seq_ref(&c.b, &s, body);
    gb_rule_add(&c.b, root, &s);
    gb_seq_free(&s);
    int rc = gb_finish(&c.b, root, out, err, errlen);
    free(c.refs);
    gb_fini(&c.b);
    return rc;
}

int gr_compile_json_schema(struct tdm_grammar **out, const char *schema, size_t len, char *err,
                           size_t errlen)
{
    *out = NULL;
    if (len > TDM_GRAMMAR_MAX_SCHEMA_BYTES)
        return tdm_seterr(err, errlen, TDM_EINVAL, "json schema: %zu bytes (at most %u)", len,
                          TDM_GRAMMAR_MAX_SCHEMA_BYTES);
    char depth_err[96];
    if (tdm_json_check_depth(schema, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err))
        return tdm_seterr(err, errlen, TDM_EINVAL, "json schema: %s", depth_err);
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(schema, len, &end, false);
    if (!root) {
        size_t at = (end && end >= schema && end <= schema + len) ? (size_t)(end - schema) : 0;
        return tdm_seterr(err, errlen, TDM_EINVAL, "json schema: not valid JSON (near byte %zu)",
                          at);
    }
    for (const char *p = end; p && p < schema + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            cJSON_Delete(root);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "json schema: text after the schema (byte %zu)",
                              (size_t)(p - schema));
        }
    int rc = compile_root(root, out, err, errlen);
    cJSON_Delete(root);
    return rc;
}

int gr_compile_json_object(struct tdm_grammar **out, char *err, size_t errlen)
{
    *out = NULL;
    return compile_root(NULL, out, err, errlen);
}
