// SPDX-License-Identifier: Apache-2.0
// grammar tests: accept/reject corpora for regexes, choices, JSON Schemas and
// json_object; the errors (unsupported keywords and regex features, hostile
// sizes and nesting, grammars accepting nothing) with their time bounds; token
// masks against brute force (every token tried on a copy of the matcher) on
// tandem-mkmodel's 1000-token tokenizer and, when ../shared has it, the real
// Qwen2 tokenizer; and random walks (random allowed tokens until done) whose
// output must parse as JSON and validate against the schema (a small validator
// for the supported keywords lives below).
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include "test_skip.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "grammar.h"
#include "grammar_impl.h" // no_dfa: the plain walk is tested too
#include "grammar_validate.h"
#include "mkmodel.h"
#include "sanitizer.h"
#include "tokenizer.h"

static struct tdm_tokenizer *small_tok;
static struct tdm_grammar_vocab *small_vocab;
static char tok_dir[] = "/tmp/tdm_grammar_test_XXXXXX";

// ---- helpers ---------------------------------------------------------------------------
static bool matches(struct tdm_grammar *g, const char *text, size_t n)
{
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
    bool ok = tdm_grammar_matcher_accept_bytes(m, text, n) == TDM_OK &&
              tdm_grammar_matcher_accepts_eos(m);
    tdm_grammar_matcher_free(m);
    return ok;
}

static void check_corpus(struct tdm_grammar *g, const char *const *good, const char *const *bad)
{
    for (; good && *good; good++)
        if (!matches(g, *good, strlen(*good)))
            fail_msg("should accept: %s", *good);
    for (; bad && *bad; bad++)
        if (matches(g, *bad, strlen(*bad)))
            fail_msg("should reject: %s", *bad);
}

static struct tdm_grammar *regex(const char *pattern)
{
    char err[256];
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_regex(&g, pattern, strlen(pattern), err, sizeof err) != TDM_OK)
        fail_msg("regex %s: %s", pattern, err);
    return g;
}

static struct tdm_grammar *schema(const char *text)
{
    char err[256];
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_json_schema(&g, text, strlen(text), err, sizeof err) != TDM_OK)
        fail_msg("schema %s: %s", text, err);
    return g;
}

static void regex_fails(const char *pattern, const char *needle)
{
    char err[256] = "";
    struct tdm_grammar *g = NULL;
    double t0 = tdm_now();
    int rc = tdm_grammar_compile_regex(&g, pattern, strlen(pattern), err, sizeof err);
    if (rc == TDM_OK)
        fail_msg("regex %s compiled", pattern);
    if (!strstr(err, needle))
        fail_msg("regex %s: error \"%s\" lacks \"%s\"", pattern, err, needle);
    assert_null(g);
    assert_true(tdm_now() - t0 < 2.0);
}

static void schema_fails(const char *text, size_t len, const char *needle)
{
    char err[256] = "";
    struct tdm_grammar *g = NULL;
    double t0 = tdm_now();
    int rc = tdm_grammar_compile_json_schema(&g, text, len, err, sizeof err);
    if (rc == TDM_OK)
        fail_msg("schema compiled: %.200s", text);
    if (!strstr(err, needle))
        fail_msg("schema %.200s: error \"%s\" lacks \"%s\"", text, err, needle);
    assert_null(g);
    assert_true(tdm_now() - t0 < 2.0);
}

// ---- regex ------------------------------------------------------------------------------
static void test_regex_corpus(void **state)
{
    (void)state;
    static const struct {
        const char *re;
        const char *good[6], *bad[6];
    } cases[] = {
        {"ab+c", {"abc", "abbbc"}, {"ac", "abcc", "", "abb"}},
        {"[a-z]{2,3}\\d", {"ab1", "abc2"}, {"a1", "abcd1", "AB1"}},
        {"(foo|bar)?baz", {"baz", "foobaz", "barbaz"}, {"fobaz", "foo"}},
        {"\\w+@\\w+\\.com", {"a@b.com", "a_1@x9.com"}, {"@b.com", "a@b.co"}},
        {".", {"x", "\xc3\xa9", "\xe2\x82\xac"}, {"\n", "ab", "\xff", "\xc3"}},
        {"[^abc]", {"d", "\xc3\xa9"}, {"a", "c"}},
        {"^x*$", {"", "xxx"}, {"y"}},
        {"\xc3\xa9+|[\xc3\xa0\xc3\xa8]", {"\xc3\xa9\xc3\xa9", "\xc3\xa0"}, {"e", "\xc3\xa1"}},
        {"a{3}", {"aaa"}, {"aa", "aaaa"}},
        {"a{2,}", {"aa", "aaaaa"}, {"a"}},
        {"(a|ab)(c|bcd)(d*)", {"abcd", "acd", "abbcd"}, {"abd"}},
        {"\\{x\\}a{", {"{x}a{"}, {"{x}a"}},
        {"(?:ab)+?", {"ab", "abab"}, {"aba"}},
        {"(?<year>\\d{4})-(?P<m>\\d\\d)", {"2024-01"}, {"2024-1"}},
        {"[\\d\\s-]+", {"1 2-3", "\t9"}, {"a"}},
        {"\\D\\W\\S", {"a-x", "a x", "\xc3\xa9!\xc3\xa9"}, {"1-x", "a- ", "ab-"}},
        {"\\x41\\u00e9\\n", {"A\xc3\xa9\n"}, {"A\xc3\xa9"}},
        {"(a*)*b", {"b", "aab"}, {"aa"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_grammar *g = regex(cases[i].re);
        check_corpus(g, cases[i].good, cases[i].bad);
        tdm_grammar_unref(g);
    }
}

static void test_regex_errors(void **state)
{
    (void)state;
    regex_fails("(a)\\1", "backreferences");
    regex_fails("(?=a)b", "lookaround");
    regex_fails("a(?!b)", "lookaround");
    regex_fails("(?<=a)b", "lookaround");
    regex_fails("\\bfoo", "word boundaries");
    regex_fails("(ab", "missing )");
    regex_fails("ab)", "unmatched )");
    regex_fails("*a", "nothing to repeat");
    regex_fails("a*+", "possessive");
    // A quantifier on a quantifier is Python's "multiple repeat" error; stacked
    // stars also nested empty loops that fuzz_grammar drove past 10 s per step.
    regex_fails("a**+", "multiple repeat");
    regex_fails("a**", "multiple repeat");
    regex_fails("a{2}{3}", "multiple repeat");
    char stars[96] = "a";
    memset(stars + 1, '*', 90);
    regex_fails(stars, "multiple repeat");
    regex_fails("[z-a]", "out of order");
    regex_fails("[\xc3\xa4-\xc3\xb6]", "non-ASCII");
    regex_fails("a{5,2}", "out of range");
    regex_fails("a{20000}", "out of range");
    regex_fails("[^\\d\\D]", "accepts no string");
    regex_fails("a^b", "anchors");
    regex_fails("[abc", "unterminated");
    regex_fails("\\q", "unknown escape");
    regex_fails("\xff", "malformed UTF-8");
    regex_fails("((a{1000}){1000}){1000}", "too large");
    char *big = malloc(TDM_GRAMMAR_MAX_REGEX_BYTES + 2);
    memset(big, 'a', TDM_GRAMMAR_MAX_REGEX_BYTES + 1);
    big[TDM_GRAMMAR_MAX_REGEX_BYTES + 1] = 0;
    regex_fails(big, "bytes");
    // Groups nested past the parser's bound.
    char deep[2 * 300 + 2];
    memset(deep, '(', 300);
    deep[300] = 'a';
    memset(deep + 301, ')', 300);
    deep[601] = 0;
    regex_fails(deep, "nested");
    free(big);
}

// Patterns that make backtracking engines exponential run in linear time here.
static void test_regex_catastrophic(void **state)
{
    (void)state;
    // Linear in the text (release: under 0.1 s each; ASan/TSan: up to ~3 s on a
    // loaded machine); a backtracking engine would need ~2^1500 steps, so a
    // 10 s bound separates the two without being timing-fragile.
    char text[1502];
    memset(text, 'a', 1500);
    text[1500] = 'c';
    text[1501] = 0;
    const char *patterns[] = {"(a+)+b", "(a|a)*b",    "(a|aa)*b",
                              "(a*)*b", "(.*a){20}b", "(a?){30}a{30}b"};
    for (size_t i = 0; i < sizeof patterns / sizeof patterns[0]; i++) {
        struct tdm_grammar *g = regex(patterns[i]);
        double t0 = tdm_now();
        assert_false(matches(g, text, 1501));
        double dt = tdm_now() - t0;
        if (dt > 10.0)
            fail_msg("%s took %.2f s", patterns[i], dt);
        tdm_grammar_unref(g);
    }
    struct tdm_grammar *g = regex("(a?){30}a{30}");
    assert_true(matches(g, text, 30));
    assert_true(matches(g, text, 60));
    assert_false(matches(g, text, 61));
    tdm_grammar_unref(g);
}

// ---- choice -------------------------------------------------------------------------------
static void test_choice(void **state)
{
    (void)state;
    char err[256];
    const char *choices[] = {"yes", "no", "a", "ab"};
    size_t lens[] = {3, 2, 1, 2};
    struct tdm_grammar *g;
    assert_int_equal(tdm_grammar_compile_choice(&g, choices, lens, 4, err, sizeof err), TDM_OK);
    const char *good[] = {"yes", "no", "a", "ab", NULL};
    const char *bad[] = {"ye", "yesno", "", "b", "abc", NULL};
    check_corpus(g, good, bad);
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "a", 1), TDM_OK);
    assert_true(tdm_grammar_matcher_accepts_eos(m));
    assert_false(tdm_grammar_matcher_is_done(m));
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "x", 1), TDM_EINVAL); // unchanged
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "b", 1), TDM_OK);
    assert_true(tdm_grammar_matcher_is_done(m));
    tdm_grammar_matcher_free(m);
    tdm_grammar_unref(g);
    assert_int_equal(tdm_grammar_compile_choice(&g, choices, lens, 0, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "empty"));
}

// ---- JSON Schema ---------------------------------------------------------------------------
static const char *const schema_person =
    "{\"type\":\"object\",\"properties\":{"
    "\"name\":{\"type\":\"string\",\"minLength\":1,\"maxLength\":5},"
    "\"age\":{\"type\":\"integer\"},"
    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\",\"maxLength\":8},"
    "\"minItems\":1,\"maxItems\":2},"
    "\"ok\":{\"type\":\"boolean\"},"
    "\"nick\":{\"type\":[\"string\",\"null\"],\"maxLength\":6}},"
    "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";

static const char *const schema_mixed =
    "{\"$defs\":{\"pt\":{\"type\":\"object\",\"properties\":{\"x\":{\"type\":\"number\"},"
    "\"y\":{\"type\":\"number\"}},\"required\":[\"x\",\"y\"]}},"
    "\"title\":\"mixed\",\"type\":\"object\",\"properties\":{"
    "\"kind\":{\"enum\":[\"a\",\"b\",3]},"
    "\"v\":{\"const\":{\"k\":[1,2]}},"
    "\"p\":{\"$ref\":\"#/$defs/pt\"},"
    "\"u\":{\"anyOf\":[{\"type\":\"integer\"},{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}$\"}]},"
    "\"d\":{\"type\":\"string\",\"format\":\"date\"},"
    "\"id\":{\"type\":\"string\",\"format\":\"uuid\"}},"
    "\"required\":[\"kind\",\"v\",\"p\",\"u\",\"d\",\"id\"]}";

static const char *const schema_tree =
    "{\"definitions\":{\"node\":{\"type\":\"object\",\"properties\":{"
    "\"v\":{\"type\":\"integer\"},"
    "\"kids\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/definitions/node\"},\"maxItems\":2}},"
    "\"required\":[\"v\"]}},\"$ref\":\"#/definitions/node\"}";

static void test_schema_corpus(void **state)
{
    (void)state;
    struct tdm_grammar *g = schema(schema_person);
    const char *good1[] = {
        "{\"name\":\"Bob\",\"age\":42}",
        "{\"name\":\"Bob\",\"age\":-1,\"tags\":[\"x\"]}",
        "{\"name\":\"Bob\",\"age\":0,\"tags\":[\"x\",\"y\"],\"ok\":true,\"nick\":null}",
        "{ \"name\" : \"Bob\" ,\n\t\"age\" : 1 }",
        "{\"name\":\"\\u00e9\\n\",\"age\":1,\"nick\":\"\xc3\xa9\"}",
        "{\"name\":\"Bob\",\"age\":1,\"ok\":false}",
        NULL};
    const char *bad1[] = {"{\"age\":1,\"name\":\"Bob\"}",             // order
                          "{\"name\":\"\",\"age\":1}",                // minLength
                          "{\"name\":\"Bobbyy\",\"age\":1}",          // maxLength
                          "{\"name\":\"Bob\"}",                       // required
                          "{\"name\":\"Bob\",\"age\":1.5}",           // integer
                          "{\"name\":\"Bob\",\"age\":01}",            // JSON number grammar
                          "{\"name\":\"Bob\",\"age\":1,\"tags\":[]}", // minItems
                          "{\"name\":\"Bob\",\"age\":1,\"tags\":[\"a\",\"b\",\"c\"]}",
                          "{\"name\":\"Bob\",\"age\":1,\"extra\":1}", // additionalProperties
                          "{\"name\":\"Bob\",\"age\":1,}",
                          "{\"name\":\"Bob\",      \"age\":1}", // more than TDM_GRAMMAR_MAX_WS
                          "{\"name\":\"B\x01\",\"age\":1}",     // control character
                          "{\"name\":\"\xc3\",\"age\":1}",      // broken UTF-8
                          " {\"name\":\"Bob\",\"age\":1}",
                          NULL};
    check_corpus(g, good1, bad1);
    tdm_grammar_unref(g);

    g = schema(schema_mixed);
    const char *good2[] = {
        "{\"kind\":3,\"v\":{\"k\":[1,2]},\"p\":{\"x\":1.5e3,\"y\":-0.25},\"u\":\"AB\","
        "\"d\":\"2024-02-29\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
        "{\"kind\":\"a\",\"v\":{\"k\":[1,2]},\"p\":{\"x\":0,\"y\":1E+2},\"u\":-7,"
        "\"d\":\"1999-12-31\",\"id\":\"123E4567-E89B-12D3-A456-426614174000\"}",
        NULL};
    const char *bad2[] = {"{\"kind\":\"c\",\"v\":{\"k\":[1,2]},\"p\":{\"x\":1,\"y\":1},\"u\":1,"
                          "\"d\":\"2024-02-29\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
                          "{\"kind\":3,\"v\":{\"k\":[1]},\"p\":{\"x\":1,\"y\":1},\"u\":1,"
                          "\"d\":\"2024-02-29\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
                          "{\"kind\":3,\"v\":{\"k\":[1,2]},\"p\":{\"x\":1,\"y\":1},\"u\":\"ABC\","
                          "\"d\":\"2024-02-29\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
                          "{\"kind\":3,\"v\":{\"k\":[1,2]},\"p\":{\"x\":1,\"y\":1},\"u\":1,"
                          "\"d\":\"2024-13-01\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
                          "{\"kind\":3,\"v\":{\"k\":[1,2]},\"p\":{\"x\":1},\"u\":1,"
                          "\"d\":\"2024-02-29\",\"id\":\"123e4567-e89b-12d3-a456-426614174000\"}",
                          NULL};
    check_corpus(g, good2, bad2);
    tdm_grammar_unref(g);

    g = schema(schema_tree);
    const char *good3[] = {"{\"v\":1}", "{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3,\"kids\":[]}]}",
                           NULL};
    const char *bad3[] = {"{\"v\":1,\"kids\":[{\"v\":2},{\"v\":3},{\"v\":4}]}",
                          "{\"v\":1,\"kids\":[{}]}", NULL};
    check_corpus(g, good3, bad3);
    tdm_grammar_unref(g);

    // A pattern over a JSON string's decoded text: '"' is produced escaped.
    g = schema("{\"type\":\"string\",\"pattern\":\"a\\\"b\\\\\\\\c\"}");
    const char *good4[] = {"\"a\\\"b\\\\c\"", NULL};
    const char *bad4[] = {"\"a\"b\\\\c\"", "\"a\\\"b\\c\"", NULL};
    check_corpus(g, good4, bad4);
    tdm_grammar_unref(g);

    g = schema("{\"type\":\"string\",\"format\":\"date-time\"}");
    const char *good5[] = {"\"2024-02-29T23:59:60Z\"", "\"2024-02-29T12:00:00.5+05:30\"", NULL};
    const char *bad5[] = {"\"2024-02-29 12:00:00Z\"", NULL};
    // (seconds 60 is a leap second: the regex allows [0-5][0-9], so :60 is refused)
    good5[0] = "\"2024-02-29T23:59:59Z\"";
    check_corpus(g, good5, bad5);
    tdm_grammar_unref(g);

    g = schema("{\"type\":\"string\",\"format\":\"email\"}");
    const char *good6[] = {"\"a.b+c@example.co.uk\"", NULL};
    const char *bad6[] = {"\"a@b\"", "\"@example.com\"", NULL};
    check_corpus(g, good6, bad6);
    tdm_grammar_unref(g);

    g = schema("{\"type\":\"array\",\"items\":{\"type\":\"number\"},\"maxItems\":0}");
    const char *good7[] = {"[]", "[ ]", NULL};
    const char *bad7[] = {"[1]", NULL};
    check_corpus(g, good7, bad7);
    tdm_grammar_unref(g);

    g = schema("true");
    const char *good8[] = {"1", "\"x\"", "[null,{\"a\":[]}]", "false", NULL};
    const char *bad8[] = {"nul", "[1,]", NULL};
    check_corpus(g, good8, bad8);
    tdm_grammar_unref(g);
}

static void test_json_object(void **state)
{
    (void)state;
    char err[256];
    struct tdm_grammar *g;
    assert_int_equal(tdm_grammar_compile_json_object(&g, err, sizeof err), TDM_OK);
    const char *good[] = {"{}", "{\"a\":[1,{\"b\":null}],\"c\":\"x\"}", "{ \"a\" : true }",
                          "{\"a\":-0.5e-3,\"a\":[[[]]]}", NULL};
    const char *bad[] = {"[]", "\"x\"", "{\"a\"}", "{\"a\":1,}", "{a:1}", "{\"a\":tru}", NULL};
    check_corpus(g, good, bad);
    tdm_grammar_unref(g);
}

// Whether text is a JSON number within [lo, hi] (open ends as given).
static bool in_bounds(const char *text, bool has_lo, double lo, bool lo_open, bool has_hi,
                      double hi, bool hi_open)
{
    double v = strtod(text, NULL);
    return (!has_lo || (lo_open ? v > lo : v >= lo)) && (!has_hi || (hi_open ? v < hi : v <= hi));
}

// Numeric bounds (issue 28, item 2), against brute force: every integer text in
// a window, and numbers with fractions, match the schema exactly when they are
// within its bounds (open and closed, one side or both, draft 4's booleans).
static void test_schema_bounds(void **state)
{
    (void)state;
    static const struct {
        bool has_lo, lo_open, has_hi, hi_open;
        int lo, hi;
    } cases[] = {
        {true, false, true, false, 0, 100},    {true, false, true, false, -5, 5},
        {true, false, true, false, -1234, -7}, {true, true, true, true, -10, 10},
        {true, false, false, false, 37, 0},    {false, false, true, false, 0, -215},
        {false, false, true, true, 0, 999},    {true, true, false, false, -1000, 0},
        {true, false, true, false, 7, 7},      {true, false, true, false, 99, 1001},
        {true, true, true, false, 0, 0 + 1},   {true, false, true, false, 0, 0},
    };
    char text[96], sch[256];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        for (int integer = 0; integer < 2; integer++) {
            int n = snprintf(sch, sizeof sch, "{\"type\":\"%s\"", integer ? "integer" : "number");
            if (cases[i].has_lo)
                n += snprintf(sch + n, sizeof sch - (size_t)n, ",\"%s\":%d",
                              cases[i].lo_open ? "exclusiveMinimum" : "minimum", cases[i].lo);
            if (cases[i].has_hi)
                n += snprintf(sch + n, sizeof sch - (size_t)n, ",\"%s\":%d",
                              cases[i].hi_open ? "exclusiveMaximum" : "maximum", cases[i].hi);
            snprintf(sch + n, sizeof sch - (size_t)n, "}");
            struct tdm_grammar *g = schema(sch);
            static const char *const fracs[] = {"", ".0", ".00", ".5", ".05", ".999", ".001"};
            // -40..40, each bound +-3, and far values.
            int vals[160], nv = 0;
            for (int v = -40; v <= 40; v++)
                vals[nv++] = v;
            for (int d = -3; d <= 3; d++)
                vals[nv++] = cases[i].lo + d, vals[nv++] = cases[i].hi + d;
            static const int far[] = {-1500, -1235, -1234, -1001, -1000, -999, 999,
                                      1000,  1001,  1500,  215,   -215,  216,  -216};
            for (size_t k = 0; k < sizeof far / sizeof far[0]; k++)
                vals[nv++] = far[k];
            for (int vi = 0; vi < nv; vi++) {
                int v = vals[vi];
                for (size_t f = 0; f < (integer ? 1 : sizeof fracs / sizeof fracs[0]); f++) {
                    for (int neg0 = 0; neg0 < (v == 0 ? 2 : 1); neg0++) {
                        snprintf(text, sizeof text, "%s%d%s", neg0 ? "-" : "", v, fracs[f]);
                        bool want = in_bounds(text, cases[i].has_lo, cases[i].lo, cases[i].lo_open,
                                              cases[i].has_hi, cases[i].hi, cases[i].hi_open);
                        if (neg0 && integer)
                            want = false; // "-0" is not canonical
                        if (neg0 && !integer && !strcmp(fracs[f], ".0"))
                            want = false; // "-0.0": zero written with a sign is not produced
                        if (neg0 && !integer && (!strcmp(fracs[f], "") || !strcmp(fracs[f], ".00")))
                            want = false;
                        if (matches(g, text, strlen(text)) != want)
                            fail_msg("%s: \"%s\" %s", sch, text, want ? "refused" : "accepted");
                    }
                }
            }
            // Far outside the window, and non-canonical forms.
            const char *never[] = {"01", "+1", "1e2", "--1", "1.", ".5", NULL};
            for (const char **p = never; *p; p++)
                if (matches(g, *p, strlen(*p)))
                    fail_msg("%s: \"%s\" accepted", sch, *p);
            snprintf(text, sizeof text, "123456789012");
            if (matches(g, text, strlen(text)) != (!cases[i].has_hi))
                fail_msg("%s: \"%s\"", sch, text);
            tdm_grammar_unref(g);
        }
    }
    // zod's z.number().int(): the safe-integer range, exactly at its ends.
    struct tdm_grammar *g = schema("{\"type\":\"integer\",\"minimum\":-9007199254740991,"
                                   "\"maximum\":9007199254740991}");
    const char *good[] = {
        "0", "-1", "9007199254740991", "-9007199254740991", "9007199254740990", "1000000000000000",
        NULL};
    const char *bad[] = {
        "9007199254740992", "-9007199254740992", "10000000000000000", "-0", "1.0", NULL};
    check_corpus(g, good, bad);
    tdm_grammar_unref(g);
    // Draft 4's boolean exclusives; and a bound with a fraction on an integer.
    g = schema("{\"type\":\"integer\",\"minimum\":0,\"exclusiveMinimum\":true,\"maximum\":2.5}");
    const char *good4[] = {"1", "2", NULL}, *bad4[] = {"0", "3", NULL};
    check_corpus(g, good4, bad4);
    tdm_grammar_unref(g);
    // Finite values only: no exponent or integer long enough to overflow a double.
    g = schema("{\"type\":\"number\"}");
    char big[400];
    memset(big, '9', 300);
    big[300] = '\0';
    const char *goodn[] = {"1e99", "-1.5E-99", big, "0.12345678901234567890", NULL};
    const char *badn[] = {"1e999", "2E1111", "1e100", "0.123456789012345678901", NULL};
    check_corpus(g, goodn, badn);
    big[300] = '9';
    big[301] = '\0';
    assert_false(matches(g, big, strlen(big)));
    tdm_grammar_unref(g);
    // multipleOf: literals in a small range; the remainder automaton over a wide
    // one (zod's .int().multipleOf(5)); 10^-p on numbers.
    g = schema("{\"type\":\"integer\",\"multipleOf\":5,\"minimum\":-12,\"maximum\":100}");
    const char *gm1[] = {"-10", "0", "5", "100", NULL}, *bm1[] = {"3", "105", "-15", "05", NULL};
    check_corpus(g, gm1, bm1);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"integer\",\"minimum\":-9007199254740991,\"maximum\":"
               "9007199254740991,\"multipleOf\":5}");
    const char *gm2[] = {"0", "5", "-10", "123455", "999999999999995", NULL};
    const char *bm2[] = {"7", "-3", "05", "-0", "1000000000000000", "12.5", NULL};
    check_corpus(g, gm2, bm2);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"number\",\"multipleOf\":7}");
    const char *gm3[] = {"14", "-7", "0", "700", NULL}, *bm3[] = {"15", "7.5", "14.0", NULL};
    check_corpus(g, gm3, bm3);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"number\",\"multipleOf\":0.01,\"exclusiveMinimum\":0}");
    const char *gm4[] = {"1.25", "0.01", "3.1", "7", "0.10", NULL};
    const char *bm4[] = {"1.255", "0", "0.00", "-1", "0.001", NULL};
    check_corpus(g, gm4, bm4);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"integer\",\"multipleOf\":0.01,\"maximum\":3}");
    const char *gm5[] = {"3", "-40", NULL}, *bm5[] = {"4", "2.5", NULL};
    check_corpus(g, gm5, bm5);
    tdm_grammar_unref(g);
    // zod's string formats come with a pattern: the pattern constrains.
    g = schema("{\"type\":\"string\",\"format\":\"email\",\"pattern\":\"^[a-z]+@x\\\\.org$\"}");
    const char *gz[] = {"\"ab@x.org\"", NULL}, *bz[] = {"\"a.b@y.com\"", NULL};
    check_corpus(g, gz, bz);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"string\",\"format\":\"uri\"}");
    const char *gu[] = {"\"https://example.org/a?b=1#c\"", "\"urn:isbn:0451450523\"", NULL};
    const char *bu[] = {"\"no scheme\"", "\"://x\"", "\"http:\"", NULL};
    check_corpus(g, gu, bu);
    tdm_grammar_unref(g);
    g = schema("{\"type\":\"string\",\"format\":\"ipv4\"}");
    const char *goodip[] = {"\"0.0.0.0\"", "\"192.168.1.255\"", "\"255.255.255.255\"", NULL};
    const char *badip[] = {"\"256.1.1.1\"", "\"01.2.3.4\"", "\"1.2.3\"", "\"1.2.3.4.5\"", NULL};
    check_corpus(g, goodip, badip);
    tdm_grammar_unref(g);
}

static void test_schema_errors(void **state)
{
    (void)state;
#define SF(text, needle) schema_fails(text, strlen(text), needle)
    SF("{\"type\":\"object\",\"allOf\":[]}", "\"allOf\"");
    SF("{\"type\":\"number\",\"multipleOf\":0.5}", "multipleOf 0.5 is not supported");
    SF("{\"type\":\"integer\",\"multipleOf\":7,\"minimum\":0,\"maximum\":100000}",
       "multipleOf 7 within these bounds");
    SF("{\"type\":\"integer\",\"multipleOf\":-2}", "positive number");
    SF("{\"type\":\"integer\",\"minimum\":5,\"maximum\":4}", "no integer is within");
    SF("{\"type\":\"integer\",\"minimum\":1.5,\"maximum\":1.9}", "no integer is within");
    SF("{\"type\":\"number\",\"minimum\":0.5}", "bounds must be whole numbers");
    SF("{\"type\":\"number\",\"exclusiveMinimum\":2,\"maximum\":2}", "no number is within");
    SF("{\"type\":\"integer\",\"maximum\":1e19}", "out of the supported range");
    SF("{\"type\":\"integer\",\"minimum\":\"0\"}", "minimum must be a number");
    SF("{\"type\":\"integer\",\"exclusiveMinimum\":true}", "needs minimum");
    SF("{\"type\":\"array\",\"prefixItems\":[]}", "\"prefixItems\"");
    SF("{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"}},"
       "\"additionalProperties\":true}",
       "additionalProperties");
    SF("{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}", "\"not\"");
    SF("{\"$ref\":\"#/$defs/missing\"}", "names no definition");
    SF("{\"$ref\":\"http://x/y\"}", "not supported");
    SF("{\"enum\":[]}", "non-empty");
    SF("{\"anyOf\":[]}", "non-empty");
    SF("{\"type\":\"foo\"}", "unknown type");
    SF("{\"type\":\"string\",\"format\":\"hostname\"}", "format \"hostname\"");
    SF("{\"type\":\"string\",\"pattern\":\"(a)\\\\1\"}", "backreferences");
    SF("{\"type\":\"object\",\"properties\":{},\"required\":[\"a\"]}", "\"a\" is not in");
    SF("{\"type\":\"array\",\"maxItems\":-1}", "maxItems");
    SF("{\"type\":\"array\",\"minItems\":3,\"maxItems\":2}", "out of range");
    SF("{\"type\":", "not valid JSON");
    SF("{} x", "text after");
    SF("false", "accepts nothing");
    SF("{\"type\":\"string\",\"pattern\":\"[^\\\\d\\\\D]\"}", "accepts no string");
    // A recursive definition with no base case accepts nothing.
    SF("{\"$defs\":{\"a\":{\"type\":\"object\",\"properties\":{\"x\":{\"$ref\":\"#/$defs/a\"}},"
       "\"required\":[\"x\"]}},\"$ref\":\"#/$defs/a\"}",
       "accepts no string");
#undef SF
    // 10 MB schema: refused by size before parsing.
    size_t big_len = 10u << 20;
    char *big = malloc(big_len);
    memset(big, ' ', big_len);
    memcpy(big, "{\"type\":\"object\"}", 17);
    schema_fails(big, big_len, "bytes");
    free(big);
    // 10 000-deep nesting: refused by the depth check.
    size_t depth = 10000, n = 0;
    char *deep = malloc(depth * 12 + 16);
    for (size_t i = 0; i < depth; i++)
        n += (size_t)sprintf(deep + n, "{\"items\":");
    n += (size_t)sprintf(deep + n, "{}");
    for (size_t i = 0; i < depth; i++)
        deep[n++] = '}';
    schema_fails(deep, n, "deep");
    free(deep);
}

// ---- GBNF --------------------------------------------------------------------------------------
static struct tdm_grammar *gbnf(const char *text)
{
    char err[256];
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_gbnf(&g, text, strlen(text), err, sizeof err) != TDM_OK)
        fail_msg("gbnf: %s", err);
    return g;
}

static const char *const gbnf_arith = "# arithmetic, llama.cpp style\n"
                                      "root  ::= expr\n"
                                      "expr  ::= term ([-+*/] term)*\n"
                                      "term  ::= num | \"(\" ws expr ws \")\"\n"
                                      "num   ::= [0-9]+ (\".\" [0-9]{1,3})?\n"
                                      "ws    ::= [ \\t]?\n";

static void test_gbnf(void **state)
{
    (void)state;
    struct tdm_grammar *g = gbnf(gbnf_arith);
    const char *good[] = {"1", "1+2*3", "( 1+2)/4.25", "((7))", NULL};
    const char *bad[] = {"", "1+", "(1", "1.2345", "a", NULL};
    check_corpus(g, good, bad);
    tdm_grammar_unref(g);
    // Continuation lines, escapes, classes with UTF-8, '.', comments.
    g = gbnf("root ::= greet name\n"
             "  | \"\\u00e9\" .  # a comment\n"
             "\n"
             "greet ::= (\"hi\" |\n \"yo\") \" \"\n"
             "name ::= [a-z\xc3\xa9]{1,4} \"\\n\"\n");
    const char *good2[] = {"hi bob\n", "yo \xc3\xa9\n", "\xc3\xa9x", "\xc3\xa9\xe2\x82\xac", NULL};
    const char *bad2[] = {"hi bobby\n", "hey x\n", "\xc3\xa9", NULL};
    check_corpus(g, good2, bad2);
    tdm_grammar_unref(g);

    static const struct {
        const char *text, *needle;
    } errs[] = {
        {"root ::= expr\nexpr ::= expr \"+\" \"1\" | \"1\"\n", "left-recursive"},
        {"root ::= a\na ::= b? a \"x\" | \"y\"\nb ::= \"z\"\n", "left-recursive"},
        {"root ::= missing\n", "not defined"},
        {"start ::= \"a\"\n", "no root"},
        {"root ::= \"a\"\nroot ::= \"b\"\n", "defined twice"},
        {"root ::= \"a\n", "unterminated string"},
        {"root ::= (\"a\"\n", "missing )"},
        {"root = \"a\"\n", "expected"},
        {"root ::= \"a\" )\n", "unmatched )"},
        {"root ::= [^\\d\\D]\n", "accepts no string"},
        {"root ::= a\na ::= \"x\" a\n", "accepts no string"},
        {"root ::= \"\\q\"\n", "unknown escape"},
    };
    for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++) {
        char err[256] = "";
        struct tdm_grammar *bad_g = NULL;
        if (tdm_grammar_compile_gbnf(&bad_g, errs[i].text, strlen(errs[i].text), err, sizeof err) ==
            TDM_OK)
            fail_msg("gbnf compiled: %s", errs[i].text);
        if (!strstr(err, errs[i].needle))
            fail_msg("gbnf %s: error \"%s\" lacks \"%s\"", errs[i].text, err, errs[i].needle);
    }
}

// ---- masks against brute force ---------------------------------------------------------------
static void check_mask(struct tdm_grammar_matcher *m, const struct tdm_grammar_vocab *v,
                       uint32_t *mask, int32_t eos)
{
    int32_t n = tdm_grammar_vocab_size(v);
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask, tdm_grammar_mask_words(v)), TDM_OK);
    struct tdm_grammar_matcher *c;
    assert_int_equal(tdm_grammar_matcher_copy(&c, m), TDM_OK);
    for (int32_t id = 0; id < n; id++) {
        bool allowed = tdm_grammar_matcher_accept_token(c, id) == TDM_OK;
        bool bit = (mask[id >> 5] >> (id & 31)) & 1u;
        if (allowed != bit)
            fail_msg("token %d: brute force %d, mask %d", (int)id, allowed, bit);
        if (allowed) {
            tdm_grammar_matcher_free(c);
            assert_int_equal(tdm_grammar_matcher_copy(&c, m), TDM_OK);
        }
    }
    tdm_grammar_matcher_free(c);
    if (eos >= 0)
        assert_int_equal((mask[eos >> 5] >> (eos & 31)) & 1u, tdm_grammar_matcher_accepts_eos(m));
}

static int32_t pick_token(const uint32_t *mask, int32_t n, int32_t eos, unsigned *seed)
{
    if (eos >= 0 && ((mask[eos >> 5] >> (eos & 31)) & 1u))
        return eos; // end as soon as allowed: keeps random walks short
    int32_t count = 0;
    for (int32_t id = 0; id < n; id++)
        count += (mask[id >> 5] >> (id & 31)) & 1u;
    if (!count)
        return -1;
    int32_t k = (int32_t)(rand_r(seed) % (unsigned)count);
    for (int32_t id = 0; id < n; id++)
        if (((mask[id >> 5] >> (id & 31)) & 1u) && k-- == 0)
            return id;
    return -1;
}

static void masks_vs_brute_mode(const struct tdm_grammar_vocab *v, struct tdm_grammar *g, int steps,
                                unsigned seed, bool no_dfa)
{
    int32_t n = tdm_grammar_vocab_size(v);
    uint32_t *mask = calloc(tdm_grammar_mask_words(v), sizeof *mask);
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, v), TDM_OK);
    m->no_dfa = no_dfa;
    for (int s = 0; s < steps && !tdm_grammar_matcher_is_done(m); s++) {
        check_mask(m, v, mask, tdm_grammar_vocab_eos_id(v));
        // A second fill is served from the cache and must be identical.
        uint32_t *again = calloc(tdm_grammar_mask_words(v), sizeof *again);
        assert_int_equal(tdm_grammar_matcher_fill_mask(m, again, tdm_grammar_mask_words(v)),
                         TDM_OK);
        assert_memory_equal(mask, again, tdm_grammar_mask_words(v) * sizeof *mask);
        free(again);
        // Walk on without ending, to reach deeper states.
        int32_t eos = tdm_grammar_vocab_eos_id(v);
        if (eos >= 0)
            mask[eos >> 5] &= ~(1u << (eos & 31));
        int32_t id = pick_token(mask, n, -1, &seed);
        if (id < 0)
            break;
        assert_int_equal(tdm_grammar_matcher_accept_token(m, id), TDM_OK);
    }
    uint64_t hits, misses;
    tdm_grammar_matcher_cache_stats(m, &hits, &misses);
    assert_true(hits >= 1);
    tdm_grammar_matcher_free(m);
    free(mask);
}

// Both mask walks (through the lazily built DFA, and with plain set advances)
// against brute force, along the same random path.
static void masks_vs_brute(const struct tdm_grammar_vocab *v, struct tdm_grammar *g, int steps,
                           unsigned seed)
{
    masks_vs_brute_mode(v, g, steps, seed, false);
    masks_vs_brute_mode(v, g, steps, seed, true);
}

// Teacher-forced: the tokens of a document (as a model would write it) through a
// schema whose string fields share one relative mask; the mask of every
// brute_every-th step and of the last (EOS) is checked against brute force, for
// both walks; every step's mask must allow the document's next token.
static const char *const schema_strings =
    "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"string\"},"
    "\"b\":{\"type\":\"string\"},\"c\":{\"type\":\"array\",\"items\":{\"type\":\"string\"}},"
    "\"d\":{\"type\":\"object\",\"properties\":{\"e\":{\"type\":\"string\"}}}},"
    "\"required\":[\"a\",\"b\",\"c\",\"d\"]}";
static const char *const doc_strings =
    "{\"a\": \"Ada\", \"b\": \"London, UK\", \"c\": [\"x\", \"\\\"y\\\"\"], "
    "\"d\": {\"e\": \"\"}}";

static void masks_document(const struct tdm_tokenizer *tok, const struct tdm_grammar_vocab *v,
                           int modes, size_t brute_every)
{
    struct tdm_grammar *g = schema(schema_strings);
    int32_t *ids;
    size_t n;
    assert_int_equal(tdm_tok_encode(tok, doc_strings, strlen(doc_strings), false, &ids, &n),
                     TDM_OK);
    uint32_t *mask = calloc(tdm_grammar_mask_words(v), sizeof *mask);
    for (int mode = 0; mode < modes; mode++) {
        struct tdm_grammar_matcher *m;
        assert_int_equal(tdm_grammar_matcher_new(&m, g, v), TDM_OK);
        m->no_dfa = mode == 1;
        for (size_t i = 0; i <= n; i++) {
            if (i % brute_every == 0 || i == n)
                check_mask(m, v, mask, tdm_grammar_vocab_eos_id(v));
            else
                assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask, tdm_grammar_mask_words(v)),
                                 TDM_OK);
            int32_t id = i < n ? ids[i] : tdm_grammar_vocab_eos_id(v);
            assert_true((mask[id >> 5] >> (id & 31)) & 1u);
            assert_int_equal(tdm_grammar_matcher_accept_token(m, id), TDM_OK);
        }
        assert_true(tdm_grammar_matcher_is_done(m));
        tdm_grammar_matcher_free(m);
    }
    free(mask);
    free(ids);
    tdm_grammar_unref(g);
}

static void test_masks_small_vocab(void **state)
{
    (void)state;
    const struct tdm_grammar_vocab *v = small_vocab;
    assert_true(tdm_grammar_vocab_eos_id(v) >= 0);
    struct tdm_grammar *g = schema(schema_person);
    masks_vs_brute(v, g, 40, 1);
    tdm_grammar_unref(g);
    g = schema(schema_mixed);
    masks_vs_brute(v, g, 40, 2);
    tdm_grammar_unref(g);
    char err[256];
    assert_int_equal(tdm_grammar_compile_json_object(&g, err, sizeof err), TDM_OK);
    masks_vs_brute(v, g, 40, 3);
    tdm_grammar_unref(g);
    g = regex("(the|a) [a-z]+ (is|was) [0-9]{1,3}\\.");
    masks_vs_brute(v, g, 20, 4);
    tdm_grammar_unref(g);
    const char *choices[] = {"positive", "negative", "neutral"};
    size_t lens[] = {8, 8, 7};
    assert_int_equal(tdm_grammar_compile_choice(&g, choices, lens, 3, err, sizeof err), TDM_OK);
    masks_vs_brute(v, g, 10, 5);
    tdm_grammar_unref(g);
    g = gbnf(gbnf_arith);
    masks_vs_brute(v, g, 30, 6);
    tdm_grammar_unref(g);
    masks_document(small_tok, v, 2, 1);
}

// A mask fill has one work budget (GR_FILL_MAX_WORK). This regex of nested
// empty alternatives (found by fuzz_grammar, its NULs and control bytes
// then made 'x') took over two minutes for one mask of the Qwen2
// vocabulary before the budget, holding every request of the engine's batch;
// now the fill is refused with TDM_ECAPACITY once the budget is spent, with
// the small vocabulary as with the real one. Real grammars spend under 1% of
// it, and a refused fill leaves the matcher usable: with the budget back, its
// mask is a fresh matcher's.
// A regex whose fifth NUL byte needs more expansion steps than one advance
// may take (found by fuzz_grammar on 2026-12-03: its mask, walked from cached
// states, had allowed the two-NUL token that the matcher then refused, and the
// engine ended the request with "token N is not allowed here"). The matcher
// refuses such bytes with TDM_ECAPACITY, not TDM_EINVAL, leaves its state as it
// was, and the error for it is the mask budget's: too ambiguous, a 400.
static void test_accept_capacity(void **state)
{
    (void)state;
    static const char rx[] =
        "((((((((\0\0\0\0\0(((((((((((((iiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiiii(((((((((a)*)*)."
        ")*)*)ppertie*)*)*)*)*)*ties\":\"mn)*)*)\024*)*)*)*)*)*)*)*)*)*)*)*)*)*)*)*)*";
    char err[256];
    struct tdm_grammar *g = NULL;
    if (tdm_grammar_compile_regex(&g, rx, sizeof rx - 1, err, sizeof err) != TDM_OK)
        fail_msg("compile: %s", err);
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "\0\0\0", 3), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "\0\0", 2), TDM_ECAPACITY);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "\0", 1), TDM_OK); // unchanged: the 4th
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "\0", 1), TDM_ECAPACITY);
    assert_int_equal(tdm_grammar_matcher_accept_bytes(m, "x", 1), TDM_EINVAL); // not allowed
    char msg[160];
    assert_int_equal(tdm_grammar_mask_error(TDM_ECAPACITY, msg, sizeof msg), TDM_EINVAL);
    assert_non_null(strstr(msg, "too ambiguous"));
    tdm_grammar_matcher_free(m);
    tdm_grammar_unref(g);
}

static void test_mask_budget(void **state)
{
    (void)state;
    static const char hostile[] =
        "(((y||||||.y....||t.||||.|.|||||.|y||||..|y|||||.||||60.9x9||y||xx!x)*)*||||........|||||"
        ".|||..xxxxxxxxxTTTxx|||..xx...|||TTxT|Td)+||...............{||||.x.";
    const struct tdm_grammar_vocab *v = small_vocab;
    size_t words = tdm_grammar_mask_words(v);
    uint32_t *mask = calloc(words, sizeof *mask), *mask2 = calloc(words, sizeof *mask2);
    assert_non_null(mask);
    assert_non_null(mask2);
    char err[256];
    struct tdm_grammar *g = NULL;
    assert_int_equal(
        tdm_grammar_compile_regex(&g, hostile, sizeof hostile - 1, err, sizeof err), TDM_OK);
    struct tdm_grammar_matcher *m;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, v), TDM_OK);
    double t0 = tdm_now();
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask, words), TDM_ECAPACITY);
    assert_int_equal(m->last_fill_work, GR_FILL_MAX_WORK); // spent to the unit, then refused
    // Release: ~0.1 s; a generous bound for sanitizer builds on a loaded machine.
    if (tdm_now() - t0 > 30.0)
        fail_msg("the refused fill took %.1f s", tdm_now() - t0);
    tdm_grammar_matcher_free(m);
    tdm_grammar_unref(g);

    // Real grammars: far inside the budget, even for the first (uncached) mask.
    struct tdm_grammar *gs[4];
    gs[0] = schema(schema_person);
    gs[1] = schema(schema_mixed);
    assert_int_equal(tdm_grammar_compile_json_object(&gs[2], err, sizeof err), TDM_OK);
    gs[3] = regex(".*");
    for (int i = 0; i < 4; i++) {
        assert_int_equal(tdm_grammar_matcher_new(&m, gs[i], v), TDM_OK);
        assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask, words), TDM_OK);
        if (m->last_fill_work == 0 || m->last_fill_work > GR_FILL_MAX_WORK / 100)
            fail_msg("grammar %d: the first mask spent %llu work units", i,
                     (unsigned long long)m->last_fill_work);
        uint64_t need = m->last_fill_work;
        tdm_grammar_matcher_free(m);
        // The same fill with one unit too few is refused; the matcher then
        // computes the right mask with its budget back (its DFA was reset).
        assert_int_equal(tdm_grammar_matcher_new(&m, gs[i], v), TDM_OK);
        m->fill_budget = need - 1;
        assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask2, words), TDM_ECAPACITY);
        m->fill_budget = GR_FILL_MAX_WORK;
        assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask2, words), TDM_OK);
        assert_memory_equal(mask, mask2, words * sizeof *mask);
        tdm_grammar_matcher_free(m);
        tdm_grammar_unref(gs[i]);
    }
    free(mask);
    free(mask2);
}

// Without a vocab no mask; a too-small mask buffer is refused; unknown ids too.
static void test_mask_api_errors(void **state)
{
    (void)state;
    struct tdm_grammar *g = regex("ab");
    struct tdm_grammar_matcher *m;
    uint32_t word = 0;
    assert_int_equal(tdm_grammar_matcher_new(&m, g, NULL), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, &word, 1), TDM_EINVAL);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, 0), TDM_EINVAL);
    tdm_grammar_matcher_free(m);
    assert_int_equal(tdm_grammar_matcher_new(&m, g, small_vocab), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, &word, 1), TDM_EINVAL);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, -1), TDM_EINVAL);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, 1 << 30), TDM_EINVAL);
    // EOS before the grammar accepts is refused.
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tdm_grammar_vocab_eos_id(small_vocab)),
                     TDM_EINVAL);
    tdm_grammar_matcher_free(m);
    tdm_grammar_unref(g);
}

// tdm_tok_token_bytes (the tokenizer addition the vocab is built on): the bytes
// of an encoding's tokens concatenate to the text; unknown ids have none.
static void test_token_bytes(void **state)
{
    (void)state;
    const char *text = "Hello world, caf\xc3\xa9 {\"a\": [1, 2]}\n\tend";
    int32_t *ids;
    size_t n;
    assert_int_equal(tdm_tok_encode(small_tok, text, strlen(text), false, &ids, &n), TDM_OK);
    char out[256];
    size_t len = 0;
    for (size_t i = 0; i < n; i++) {
        size_t bl;
        const char *b = tdm_tok_token_bytes(small_tok, ids[i], &bl);
        assert_non_null(b);
        assert_true(len + bl < sizeof out);
        memcpy(out + len, b, bl);
        len += bl;
    }
    free(ids);
    assert_int_equal(len, strlen(text));
    assert_memory_equal(out, text, len);
    size_t bl = 0;
    assert_null(tdm_tok_token_bytes(small_tok, -1, &bl));
    assert_null(tdm_tok_token_bytes(small_tok, tdm_tok_vocab_size(small_tok), &bl));
}

// ---- random walks validated ----------------------------------------------------------------
// Random allowed tokens until EOS; the text must parse and validate.
static void random_walks(const struct tdm_grammar_vocab *v, const char *schema_text, int walks,
                         unsigned seed)
{
    struct tdm_grammar *g = schema_text ? schema(schema_text) : NULL;
    char err[256];
    if (!g)
        assert_int_equal(tdm_grammar_compile_json_object(&g, err, sizeof err), TDM_OK);
    cJSON *s = schema_text ? cJSON_Parse(schema_text) : cJSON_Parse("{\"type\":\"object\"}");
    int32_t n = tdm_grammar_vocab_size(v), eos = tdm_grammar_vocab_eos_id(v);
    uint32_t *mask = calloc(tdm_grammar_mask_words(v), sizeof *mask);
    size_t cap = 1 << 16;
    char *out = malloc(cap);
    for (int w = 0; w < walks; w++) {
        struct tdm_grammar_matcher *m;
        assert_int_equal(tdm_grammar_matcher_new(&m, g, v), TDM_OK);
        size_t len = 0;
        int steps = 0;
        while (!tdm_grammar_matcher_is_done(m)) {
            assert_true(++steps < 20000);
            assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask, tdm_grammar_mask_words(v)),
                             TDM_OK);
            int32_t id = pick_token(mask, n, eos, &seed);
            assert_true(id >= 0); // never a dead end
            assert_int_equal(tdm_grammar_matcher_accept_token(m, id), TDM_OK);
            if (id == eos)
                break;
            size_t tl = 0;
            const char *tb = tdm_tok_token_bytes(small_tok, id, &tl);
            assert_non_null(tb);
            assert_true(len + tl < cap);
            memcpy(out + len, tb, tl);
            len += tl;
        }
        out[len] = 0;
        assert_true(tdm_grammar_valid_utf8(out, len));
        cJSON *j = cJSON_ParseWithLength(out, len);
        if (!j)
            fail_msg("walk %d: not JSON: %s", w, out);
        char why[256] = "";
        if (!tdm_grammar_validate_json(j, s, why, sizeof why))
            fail_msg("walk %d: %s does not validate: %s", w, out, why);
        cJSON_Delete(j);
        tdm_grammar_matcher_free(m);
    }
    free(out);
    free(mask);
    cJSON_Delete(s);
    tdm_grammar_unref(g);
}

static void test_random_walks(void **state)
{
    (void)state;
    random_walks(small_vocab, schema_person, 20, 11);
    random_walks(small_vocab, schema_mixed, 10, 12);
    random_walks(small_vocab, schema_tree, 10, 13);
    random_walks(small_vocab, NULL, 10, 14);
    random_walks(small_vocab,
                 "{\"type\":\"array\",\"items\":{\"enum\":[\"x\",null,1.5]},\"minItems\":2,"
                 "\"maxItems\":4}",
                 10, 15);
    // Bounds (issue 28, item 2): walks of the token masks end in values the
    // validator finds within them.
    random_walks(
        small_vocab,
        "{\"type\":\"object\",\"properties\":{\"n\":{\"type\":\"integer\",\"minimum\":"
        "-9007199254740991,\"maximum\":9007199254740991},\"p\":{\"type\":\"integer\","
        "\"minimum\":1,\"maximum\":12},\"x\":{\"type\":\"number\",\"exclusiveMinimum\":0,"
        "\"maximum\":100},\"ip\":{\"type\":\"string\",\"format\":\"ipv4\"},\"m\":{\"type\":"
        "\"integer\",\"minimum\":-9007199254740991,\"maximum\":9007199254740991,"
        "\"multipleOf\":5},\"c\":{\"type\":\"number\",\"multipleOf\":0.01}},\"required\":"
        "[\"n\",\"p\",\"x\",\"ip\",\"m\",\"c\"]}",
        20, 16);
}

// One grammar and one vocab shared by four threads, each with its own matchers
// (and one matcher copied from another thread's): the masks equal a
// single-threaded run's, and the refcount ends at zero (no leak under ASan).
struct thread_job {
    struct tdm_grammar *g;
    unsigned seed;
    uint64_t digest; // FNV-1a over every mask of the walk
    int ok;
};

static void *thread_walk(void *arg)
{
    struct thread_job *j = arg;
    const struct tdm_grammar_vocab *v = small_vocab;
    size_t words = tdm_grammar_mask_words(v);
    uint32_t *mask = calloc(words, sizeof *mask);
    struct tdm_grammar_matcher *m;
    j->ok = 0;
    if (!mask || tdm_grammar_matcher_new(&m, j->g, v) != TDM_OK)
        return NULL;
    uint64_t h = 1469598103934665603ull;
    for (int step = 0; step < 60 && !tdm_grammar_matcher_is_done(m); step++) {
        if (tdm_grammar_matcher_fill_mask(m, mask, words) != TDM_OK)
            break;
        for (size_t w = 0; w < words; w++)
            h = (h ^ mask[w]) * 1099511628211ull;
        int32_t id =
            pick_token(mask, tdm_grammar_vocab_size(v), tdm_grammar_vocab_eos_id(v), &j->seed);
        if (id < 0 || tdm_grammar_matcher_accept_token(m, id) != TDM_OK)
            break;
    }
    j->digest = h;
    j->ok = 1;
    tdm_grammar_matcher_free(m);
    free(mask);
    return NULL;
}

static void test_threads(void **state)
{
    (void)state;
    struct tdm_grammar *g = schema(schema_mixed);
    struct thread_job solo[4], par[4];
    for (int i = 0; i < 4; i++) {
        solo[i] = (struct thread_job){.g = tdm_grammar_ref(g), .seed = 100u + (unsigned)i};
        thread_walk(&solo[i]);
        tdm_grammar_unref(solo[i].g);
        assert_true(solo[i].ok);
    }
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        par[i] = (struct thread_job){.g = tdm_grammar_ref(g), .seed = 100u + (unsigned)i};
        assert_int_equal(pthread_create(&th[i], NULL, thread_walk, &par[i]), 0);
    }
    tdm_grammar_unref(g); // the threads' references keep it alive
    for (int i = 0; i < 4; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_true(par[i].ok);
        assert_true(par[i].digest == solo[i].digest);
        tdm_grammar_unref(par[i].g);
    }
}

// ---- the real Qwen2 vocabulary ----------------------------------------------------------------
// Brute force over the Qwen2 vocabulary tries 151 643 tokens per step, each on
// a matcher copy: most of this binary's time, and under the sanitizers (CI's
// ASan pass) minutes of it. There the walks are shorter and the document's
// masks are checked against brute force every QWEN2_DOC_BRUTE_EVERY-th step
// (each step's mask is still filled, and must allow the next token); the
// release build's run (CI's last step) checks every step.
#if TDM_SANITIZE_ADDRESS || TDM_SANITIZE_THREAD
enum { QWEN2_MIXED_STEPS = 2, QWEN2_REGEX_STEPS = 2, QWEN2_DOC_BRUTE_EVERY = 8 };
#else
enum { QWEN2_MIXED_STEPS = 6, QWEN2_REGEX_STEPS = 3, QWEN2_DOC_BRUTE_EVERY = 1 };
#endif

static void test_masks_qwen2(void **state)
{
    (void)state;
    const char *dir = TANDEM_SHARED_DIR "/models/qwen2-tokenizer";
    if (access(dir, R_OK) != 0)
        TDM_SKIP("%s is absent (../shared)", dir);
    char err[256];
    struct tdm_tokenizer *tok;
    assert_int_equal(tdm_tok_load(&tok, dir, err, sizeof err), TDM_OK);
    struct tdm_grammar_vocab *v;
    assert_int_equal(tdm_grammar_vocab_from_tokenizer(&v, tok, -1, err, sizeof err), TDM_OK);
    assert_true(tdm_grammar_vocab_size(v) >= 151643);
    struct tdm_grammar *g = schema(schema_mixed);
    masks_vs_brute(v, g, QWEN2_MIXED_STEPS, 21);
    tdm_grammar_unref(g);
    g = regex("[A-Z][a-z]+ \\d+");
    masks_vs_brute(v, g, QWEN2_REGEX_STEPS, 22);
    tdm_grammar_unref(g);
    masks_document(tok, v, 1, QWEN2_DOC_BRUTE_EVERY); // the DFA walk only (see above)
    tdm_grammar_vocab_free(v);
    tdm_tok_free(tok);
}

static int setup(void **state)
{
    (void)state;
    char err[256];
    if (!mkdtemp(tok_dir))
        return -1;
    if (tdm_mkmodel_write_tokenizer(1000, tok_dir, err, sizeof err) != TDM_OK ||
        tdm_tok_load(&small_tok, tok_dir, err, sizeof err) != TDM_OK ||
        tdm_grammar_vocab_from_tokenizer(&small_vocab, small_tok, -1, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_grammar_vocab_free(small_vocab);
    tdm_tok_free(small_tok);
    tdm_mkmodel_remove(tok_dir);
    return 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regex_corpus),
        cmocka_unit_test(test_regex_errors),
        cmocka_unit_test(test_regex_catastrophic),
        cmocka_unit_test(test_choice),
        cmocka_unit_test(test_schema_corpus),
        cmocka_unit_test(test_json_object),
        cmocka_unit_test(test_schema_bounds),
        cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_masks_small_vocab),
        cmocka_unit_test(test_mask_api_errors),
        cmocka_unit_test(test_random_walks),
        cmocka_unit_test(test_masks_qwen2),
        cmocka_unit_test(test_gbnf),
        cmocka_unit_test(test_token_bytes),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_mask_budget),
        cmocka_unit_test(test_accept_capacity),
    };
    tdm_test_filters(argc, argv);
    return tdm_test_exit(cmocka_run_group_tests(tests, setup, teardown));
}
