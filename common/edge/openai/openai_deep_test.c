// SPDX-License-Identifier: Apache-2.0
// Deep input on a small stack (issue 29, part 1). A request arrives on a
// libcivetweb worker with TDM_HTTP_HANDLER_STACK_BYTES of stack left (http.h;
// http_test checks the real figure), and a regex of 90 nested groups or a JSON
// schema of 60 nested arrays used to overflow it, killing the server. Every
// test here runs on a thread that leaves no more stack than that
// (small_stack.h), in every build CI runs (release and ASan/UBSan, whose frames
// are about twice as large), and feeds each recursive parser or compiler a
// request can reach its input nested from 10 to 10 000 deep: the regex, JSON
// Schema (arrays, objects, $ref, patterns), GBNF and choice compilers through
// the OpenAI request parser, the chat template renderer over nested messages
// and tools, and the grammar matcher over rule chains as deep as its bound. Each
// is either served or refused with TDM_EINVAL; a stack overflow fails the test
// with a crash.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "chat.h"
#include "core.h"
#include "grammar.h"
#include "http.h"
#include "openai.h"
#include "small_stack.h"

static struct tdm_small_stack small;

static int setup(void **state)
{
    (void)state;
    return tdm_small_stack_start(&small, TDM_HTTP_HANDLER_STACK_BYTES) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tdm_small_stack_stop(&small);
    return 0;
}

static const int DEPTHS[] = {10, 90, 110, 127, 128, 129, 256, 257, 1000, 10000};
#define N_DEPTHS (sizeof DEPTHS / sizeof DEPTHS[0])

// ---- a growable string -------------------------------------------------------------------
struct str {
    char *p;
    size_t n, cap;
};

static void put(struct str *s, const char *t, size_t times)
{
    size_t len = strlen(t);
    for (size_t i = 0; i < times; i++) {
        if (s->n + len + 1 > s->cap) {
            s->cap = (s->n + len + 1) * 2;
            s->p = realloc(s->p, s->cap);
            assert_non_null(s->p);
        }
        memcpy(s->p + s->n, t, len);
        s->n += len;
        s->p[s->n] = '\0';
    }
}

// A JSON string literal's body: t with " and \ escaped.
static void put_escaped(struct str *s, const char *t)
{
    for (; *t; t++) {
        char c[3] = {*t, 0, 0};
        if (*t == '"' || *t == '\\')
            c[0] = '\\', c[1] = *t;
        put(s, c, 1);
    }
}

// ---- requests through the OpenAI parser --------------------------------------------------
static const struct tdm_oai_model_info model = {
    .served_name = "m", .vocab_size = 1000, .max_model_len = 100, .gen = NULL};

struct parse_job {
    const char *body;
    int rc, status;
    char message[512];
};

static void parse_on_small(void *arg)
{
    struct parse_job *j = arg;
    struct tdm_oai_request r;
    struct tdm_oai_error e;
    memset(&e, 0, sizeof e);
    j->rc = tdm_oai_request_parse(&r, TDM_OAI_COMPLETION, j->body, strlen(j->body), &model, &e);
    j->status = e.status;
    snprintf(j->message, sizeof j->message, "%s", e.message);
    if (j->rc == TDM_OK)
        tdm_oai_request_fini(&r);
}

// Parses body on the small stack: TDM_OK, or TDM_EINVAL with a 400 (anything
// else fails the test). want_ok: -1 either, 0 refused, 1 served; refusal must
// name need when it is set.
static void expect(const char *what, int depth, const char *body, int want_ok, const char *need)
{
    struct parse_job j = {.body = body};
    tdm_small_stack_run(&small, parse_on_small, &j);
    bool ok = j.rc == TDM_OK;
    if (!ok && (j.rc != TDM_EINVAL || j.status != 400)) {
        print_error("%s depth %d: rc %d status %d: %s\n", what, depth, j.rc, j.status, j.message);
        fail();
    }
    if ((want_ok == 1 && !ok) || (want_ok == 0 && ok) ||
        (!ok && need && !strstr(j.message, need))) {
        print_error("%s depth %d: %s (%s)\n", what, depth, ok ? "served" : "refused", j.message);
        fail();
    }
}

// The body {"prompt":"x","max_tokens":1,<field>:"<text>"} with text as a JSON string.
static char *body_with_string(const char *field, const char *text)
{
    struct str s = {0};
    put(&s, "{\"prompt\":\"x\",\"max_tokens\":1,", 1);
    put(&s, field, 1);
    put(&s, ":\"", 1);
    put_escaped(&s, text);
    put(&s, "\"}", 1);
    return s.p;
}

static char *nested_groups(int depth, const char *open, const char *inner)
{
    struct str s = {0};
    put(&s, open, (size_t)depth);
    put(&s, inner, 1);
    put(&s, ")", (size_t)depth);
    return s.p;
}

static void test_regex_groups(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_DEPTHS; i++) {
        int d = DEPTHS[i];
        int want = d <= 256 ? 1 : 0;
        char *rx = nested_groups(d, "(", "a");
        char *b1 = body_with_string("\"guided_regex\"", rx);
        expect("guided_regex", d, b1, want, "nested deeper than 256");
        // structured_outputs.regex, and the non-capturing and named forms.
        struct str s = {0};
        put(&s, "{\"regex\":\"", 1);
        put_escaped(&s, rx);
        put(&s, "\"}", 1);
        char *b2 = malloc(s.n + 64);
        snprintf(b2, s.n + 64, "{\"prompt\":\"x\",\"structured_outputs\":%s}", s.p);
        expect("structured_outputs.regex", d, b2, want, "nested deeper than 256");
        char *nc = nested_groups(d, "(?:", "b|c");
        char *b3 = body_with_string("\"guided_regex\"", nc);
        expect("(?: groups", d, b3, want, "nested deeper than 256");
        // A json_schema string pattern (a JSON string's decoded contents).
        struct str sc = {0};
        put(&sc, "{\"type\":\"string\",\"pattern\":\"", 1);
        put_escaped(&sc, rx);
        put(&sc, "\"}", 1);
        char *b4 = body_with_string("\"guided_json\"", sc.p);
        expect("json_schema pattern", d, b4, want, "nested deeper than 256");
        free(rx), free(b1), free(s.p), free(b2), free(nc), free(b3), free(sc.p), free(b4);
    }
}

// A schema nested depth levels: kind 0 arrays ({"type":"array","items":...}),
// 1 objects ({"type":"object","properties":{"a":...}}), 2 anyOf lists.
static char *nested_schema(int depth, int kind)
{
    static const char *const open[] = {
        "{\"type\":\"array\",\"items\":", "{\"type\":\"object\",\"properties\":{\"a\":",
        "{\"anyOf\":[{\"type\":\"null\"},"};
    static const char *const close[] = {"}", "}}", "]}"};
    struct str s = {0};
    put(&s, open[kind], (size_t)depth);
    put(&s, "{\"type\":\"integer\"}", 1);
    put(&s, close[kind], (size_t)depth);
    return s.p;
}

static void test_schema_nesting(void **state)
{
    (void)state;
    for (int kind = 0; kind < 3; kind++)
        for (size_t i = 0; i < N_DEPTHS; i++) {
            int d = DEPTHS[i];
            char *schema = nested_schema(d, kind);
            // As a string (guided_json): only the schema's own depth check applies.
            char *b1 = body_with_string("\"guided_json\"", schema);
            int levels = kind == 0 ? d + 1 : 2 * d + 1; // JSON nesting of the schema text
            expect("guided_json (string)", d, b1, levels <= 128 ? 1 : 0, "deeper than 128");
            // As JSON inside response_format: the body's depth check comes first.
            size_t n = strlen(schema) + 200;
            char *b2 = malloc(n);
            snprintf(b2, n,
                     "{\"prompt\":\"x\",\"response_format\":{\"type\":\"json_schema\","
                     "\"json_schema\":{\"name\":\"n\",\"schema\":%s}}}",
                     schema);
            expect("response_format json_schema", d, b2, -1, "deeper than 128");
            free(schema), free(b1), free(b2);
        }
    // $ref chains: a definition referring to the next, 10 000 long (no JSON
    // nesting at all; the compiler follows references as it nests).
    for (size_t i = 0; i < N_DEPTHS; i++) {
        int d = DEPTHS[i];
        struct str s = {0};
        put(&s, "{\"$ref\":\"#/$defs/d0\",\"$defs\":{", 1);
        for (int k = 0; k < d; k++) {
            char def[96];
            snprintf(def, sizeof def,
                     "\"d%d\":{\"type\":\"array\",\"items\":{\"$ref\":\"#/$defs/d%d\"}},", k,
                     k + 1);
            put(&s, def, 1);
        }
        char last[64];
        snprintf(last, sizeof last, "\"d%d\":{\"type\":\"integer\"}}}", d);
        put(&s, last, 1);
        char *b = body_with_string("\"guided_json\"", s.p);
        expect("$ref chain", d, b, -1, NULL);
        free(s.p), free(b);
    }
}

static void test_gbnf_nesting(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_DEPTHS; i++) {
        int d = DEPTHS[i];
        struct str s = {0};
        put(&s, "root ::= ", 1);
        put(&s, "(", (size_t)d);
        put(&s, "\"a\"", 1);
        put(&s, ")", (size_t)d);
        char *b = body_with_string("\"guided_grammar\"", s.p);
        expect("gbnf groups", d, b, d <= 256 ? 1 : 0, "nested deeper than 256");
        free(s.p), free(b);
    }
}

// GBNF rule chains as long as the text limit allows: r_i ::= r_{i+1} "x" (a
// pushing edge per rule, each checked for left recursion) and r_i ::= r_{i+1}
// (tail references, expanded by the matcher). The left-recursion check once
// recursed per rule on the caller's stack (and searched the chain again per
// rule, quadratic); the matcher's expansion recurses per tail reference up to
// its bound, on the engine's deep threads.
static char *rule_chain(int n, bool pushing)
{
    struct str s = {0};
    for (int i = 0; i < n; i++) {
        char rule[64];
        if (i == 0)
            snprintf(rule, sizeof rule, "root ::= r1%s\n", pushing ? " \"x\"" : "");
        else
            snprintf(rule, sizeof rule, "r%d ::= r%d%s\n", i, i + 1, pushing ? " \"x\"" : "");
        put(&s, rule, 1);
    }
    char last[32];
    snprintf(last, sizeof last, "r%d ::= \"a\"\n", n);
    put(&s, last, 1);
    return s.p;
}

struct match_job {
    struct tdm_grammar *g;
    const char *bytes;
    int rc;
};

// Straight from the small stack: the matcher's entry points hand the work to
// a deep stack themselves (a request's thread makes the matcher at submit).
static void match_on_small(void *arg)
{
    struct match_job *j = arg;
    struct tdm_grammar_matcher *m;
    j->rc = tdm_grammar_matcher_new(&m, j->g, NULL);
    if (j->rc != TDM_OK)
        return;
    j->rc = tdm_grammar_matcher_accept_bytes(m, j->bytes, strlen(j->bytes));
    tdm_grammar_matcher_free(m);
}

struct compile_job {
    const char *text;
    struct tdm_grammar *g;
    int rc;
    char err[256];
};

static void compile_on_small(void *arg)
{
    struct compile_job *j = arg;
    j->rc = tdm_grammar_compile_gbnf(&j->g, j->text, strlen(j->text), j->err, sizeof j->err);
}

static void test_gbnf_rule_chains(void **state)
{
    (void)state;
    // 25 000 tail references: more than a matcher step may expand, refused
    // as the request is parsed (a decode worker died of it at submit before).
    char *long_tail = rule_chain(25000, false);
    struct compile_job lt = {.text = long_tail};
    tdm_small_stack_run(&small, compile_on_small, &lt);
    assert_int_equal(lt.rc, TDM_EINVAL);
    assert_non_null(strstr(lt.err, "too ambiguous at its start"));
    free(long_tail);
    for (int pushing = 0; pushing < 2; pushing++) {
        // 1 000 tail references: near the most one step expands (1 024 distinct
        // references; each level is a C frame of the expansion); 40 000
        // pushing rules: ~0.9 MB, near the GBNF limit.
        int n = pushing ? 40000 : 1000;
        char *text = rule_chain(n, pushing);
        assert_true(strlen(text) <= TDM_GRAMMAR_MAX_GBNF_BYTES);
        struct compile_job c = {.text = text};
        double t0 = tdm_now();
        tdm_small_stack_run(&small, compile_on_small, &c);
        if (c.rc != TDM_OK) {
            print_error("rule chain of %d (%s): %s\n", n, pushing ? "pushing" : "tail", c.err);
            fail();
        }
        print_message("rule chain of %d (%s) compiled in %.2f s\n", n, pushing ? "pushing" : "tail",
                      tdm_now() - t0);
        struct match_job m = {.g = c.g, .bytes = "a"};
        tdm_small_stack_run(&small, match_on_small, &m);
        // The tail chain reaches its "a" 1 000 references down; the pushing
        // chain needs 40 000 frames pushed before its "a": over the matcher's
        // stack bound (TDM_GRAMMAR_MAX_STACK), refused without harm.
        assert_int_equal(m.rc, pushing ? TDM_EINVAL : TDM_OK);
        tdm_grammar_unref(c.g);
        free(text);
    }
    // A left-recursive rule at the end of a long chain is still found.
    char *text = rule_chain(40000, true);
    char *last = strstr(text, "r40000 ::= \"a\"");
    assert_non_null(last);
    memcpy(last, "r40000 ::= r1 ", 14);
    struct compile_job c = {.text = text};
    tdm_small_stack_run(&small, compile_on_small, &c);
    assert_int_equal(c.rc, TDM_EINVAL);
    assert_non_null(strstr(c.err, "left-recursive"));
    free(text);
}

// ---- chat templates --------------------------------------------------------------------------
struct render_job {
    const struct tdm_chat_template *t;
    const char *messages, *tools;
    char *out;
    int rc;
    char err[256];
};

static void render_on_small(void *arg)
{
    struct render_job *j = arg;
    j->rc = tdm_chat_render_json(j->t, j->messages, j->tools, true, &j->out, j->err, sizeof j->err);
}

struct template_job {
    const char *text;
    struct tdm_chat_template *t;
    int rc;
    char err[256];
};

static void template_on_small(void *arg)
{
    struct template_job *j = arg;
    j->rc = tdm_chat_template_new(&j->t, j->text, NULL, j->err, sizeof j->err);
}

static struct tdm_chat_template *template_small(const char *text)
{
    struct template_job j = {.text = text};
    tdm_small_stack_run(&small, template_on_small, &j);
    if (j.rc != TDM_OK) {
        print_error("template: %s\n", j.err);
        fail();
    }
    return j.t;
}

// Messages and tools nested to the JSON limit, through tojson, equality,
// comparison and string conversion; a template nested to the parser's limit.
static void test_chat_nesting(void **state)
{
    (void)state;
    struct tdm_chat_template *t = template_small(
        "{% for m in messages %}{{ m.content | tojson }}{{ m.content == m.content }}"
        "{{ m.content | string | length }}{% endfor %}{{ tools | tojson(indent=2) }}");
    for (size_t i = 0; i < N_DEPTHS; i++) {
        int d = DEPTHS[i];
        struct str msgs = {0}, tools = {0};
        // depth counts the outer array and message object: content nests d - 2.
        int inner = d > 2 ? d - 2 : 1;
        put(&msgs, "[{\"role\":\"user\",\"content\":", 1);
        put(&msgs, "[", (size_t)inner);
        put(&msgs, "1", 1);
        put(&msgs, "]", (size_t)inner);
        put(&msgs, "}]", 1);
        put(&tools, "[", (size_t)d);
        put(&tools, "]", (size_t)d);
        struct render_job j = {.t = t, .messages = msgs.p, .tools = tools.p};
        tdm_small_stack_run(&small, render_on_small, &j);
        if (j.rc != TDM_OK && j.rc != TDM_EINVAL && j.rc != TDM_ECAPACITY) {
            print_error("chat depth %d: rc %d %s\n", d, j.rc, j.err);
            fail();
        }
        if (d <= 128)
            assert_int_equal(j.rc, TDM_OK);
        free(j.out), free(msgs.p), free(tools.p);
    }
    tdm_chat_template_free(t);
    // Template nesting: expressions and blocks at the parser's limit and past it.
    for (size_t i = 0; i < N_DEPTHS; i++) {
        int d = DEPTHS[i];
        struct str s = {0};
        put(&s, "{{ ", 1);
        put(&s, "(", (size_t)d);
        put(&s, "1", 1);
        put(&s, ")", (size_t)d);
        put(&s, " }}", 1);
        put(&s, "{% if true %}", (size_t)d);
        put(&s, "{% endif %}", (size_t)d);
        struct template_job j = {.text = s.p};
        tdm_small_stack_run(&small, template_on_small, &j);
        if (j.rc == TDM_OK) {
            struct render_job r = {.t = j.t, .messages = "[]"};
            tdm_small_stack_run(&small, render_on_small, &r);
            free(r.out);
            tdm_chat_template_free(j.t);
        } else {
            assert_int_equal(j.rc, TDM_EINVAL);
        }
        free(s.p);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_regex_groups), cmocka_unit_test(test_schema_nesting),
        cmocka_unit_test(test_gbnf_nesting), cmocka_unit_test(test_gbnf_rule_chains),
        cmocka_unit_test(test_chat_nesting),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
