// SPDX-License-Identifier: Apache-2.0
// chat_test: the Jinja renderer on the templates Tandem ships names for (Qwen2.5,
// ChatML, Llama 3) and the real Qwen2.5 tokenizer_config.json, against expected
// prompt strings; HF's whitespace rules; load errors naming the construct and
// line; hostile templates and inputs ending with an error in bounded time; and
// OpenAI messages parsing with its errors. The byte-for-byte comparisons with
// Jinja2 itself are ref/render_ref.py and ref/template_corpus.py.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_skip.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include "chat.h"
#include "chat_known.h"
#include "core.h"

static const char chatml_text[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

static struct tdm_chat_template *make(const char *text, const char *override)
{
    struct tdm_chat_template *t = NULL;
    char err[256];
    int rc = tdm_chat_template_new(&t, text, override, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("template_new: %s", err);
    return t;
}

// Renders a messages JSON with t and compares with want.
static void expect_render(const struct tdm_chat_template *t, const char *json, bool gen,
                          const char *want)
{
    struct tdm_chat_msg *msgs = NULL;
    size_t n = 0;
    char err[256], *out = NULL;
    int rc = tdm_chat_msgs_parse(json, strlen(json), &msgs, &n, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("parse: %s", err);
    rc = tdm_chat_render(t, msgs, n, gen, &out, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("render: %s", err);
    assert_string_equal(out, want);
    free(out);
    tdm_chat_msgs_free(msgs, n);
}

static void expect_parse_error(const char *json, const char *needle)
{
    struct tdm_chat_msg *msgs = NULL;
    size_t n = 0;
    char err[256] = "";
    int rc = tdm_chat_msgs_parse(json, strlen(json), &msgs, &n, err, sizeof err);
    assert_int_equal(rc, TDM_EINVAL);
    assert_null(msgs);
    if (!strstr(err, needle))
        fail_msg("error '%s' does not contain '%s'", err, needle);
}

// ---- loading ---------------------------------------------------------------------

static const char qwen_hi[] =
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";

// Renders messages JSON (as given) with t; fails the test on error.
static char *render_raw(const struct tdm_chat_template *t, const char *msgs, const char *tools,
                        bool gen)
{
    char err[512], *out = NULL;
    int rc = tdm_chat_render_json(t, msgs, tools, gen, &out, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("render: %s", err);
    return out;
}

static void expect_render_error(const struct tdm_chat_template *t, const char *msgs, int code,
                                const char *needle)
{
    char err[512] = "", *out = NULL;
    int rc = tdm_chat_render_json(t, msgs, NULL, true, &out, err, sizeof err);
    if (rc != code)
        fail_msg("render gave %d (%s), want %d", rc, out ? out : err, code);
    assert_null(out);
    if (!strstr(err, needle))
        fail_msg("error '%s' does not contain '%s'", err, needle);
}

static void test_real_qwen25_config(void **state)
{
    (void)state;
    char *path = tdm_path_join(TANDEM_SHARED_DIR, "models/qwen2-tokenizer/tokenizer_config.json");
    char *text = NULL, err[256];
    size_t len;
    if (access(path, R_OK) != 0) {
        free(path);
        TDM_SKIP("the Qwen2.5 tokenizer_config.json in ../shared/models is absent");
    }
    assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
    cJSON *cfg = cJSON_ParseWithLength(text, len);
    assert_non_null(cfg);
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    assert_true(cJSON_IsString(ct));
    struct tdm_chat_template *t = make(ct->valuestring, NULL);
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true, qwen_hi);
    // With tools, the real template renders the tool block and tool calls via tojson.
    char *out = render_raw(
        t,
        "[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\",\"content\":null,"
        "\"tool_calls\":[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\","
        "\"arguments\":{\"city\":\"Paris\"}}}]},{\"role\":\"tool\",\"content\":\"21\"}]",
        "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"parameters\":{}}}]",
        true);
    assert_non_null(strstr(out, "<tools>\n{\"type\": \"function\", \"function\": {\"name\": "
                                "\"get_weather\", \"parameters\": {}}}\n</tools>"));
    assert_non_null(strstr(out, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
                                "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n"
                                "<|im_start|>user\n<tool_response>\n21\n</tool_response>"
                                "<|im_end|>\n<|im_start|>assistant\n"));
    free(out);
    tdm_chat_template_free(t);
    cJSON_Delete(cfg);
    free(text);
    free(path);
}

// The built-in names and the embedded texts render their formats.
// chat_template_kwargs: each member a variable of its JSON value, winning
// over the special tokens and add_generation_prompt (HF's template kwargs);
// anything but an object refused.
static void test_template_kwargs(void **state)
{
    (void)state;
    struct tdm_chat_template *t =
        make("{{ bos_token }}|{{ enable_thinking if enable_thinking is defined else 'unset' }}|"
             "{{ x[1] if x is defined }}|{{ add_generation_prompt }}|{{ messages | length }}",
             NULL);
    assert_int_equal(tdm_chat_template_set_tokens(t, "<b>", NULL, NULL), TDM_OK);
    char err[256], *out = NULL;
    assert_int_equal(tdm_chat_render_json_kw(t, "[]", NULL, NULL, false, &out, err, sizeof err),
                     TDM_OK);
    assert_string_equal(out, "<b>|unset||False|0");
    free(out);
    const char *kw = "{\"bos_token\":\"<B2>\",\"enable_thinking\":false,\"x\":[1,\"two\"],"
                     "\"add_generation_prompt\":true}";
    assert_int_equal(tdm_chat_render_json_kw(t, "[{\"role\":\"user\",\"content\":\"a\"}]", NULL, kw,
                                             false, &out, err, sizeof err),
                     TDM_OK);
    assert_string_equal(out, "<B2>|False|two|True|1");
    free(out);
    assert_int_equal(tdm_chat_render_json_kw(t, "[]", NULL, "[1]", false, &out, err, sizeof err),
                     TDM_EINVAL);
    assert_null(out);
    assert_non_null(strstr(err, "chat_template_kwargs must be an object"));
    tdm_chat_template_free(t);
}

// The real Llama 3.1 template reads date_string when given (vLLM users pass
// it in chat_template_kwargs) and defaults it otherwise.
static void test_template_kwargs_llama31(void **state)
{
    (void)state;
    char *path =
        tdm_path_join(TANDEM_SHARED_DIR, "chat-templates/meta-llama-Llama-3.1-8B-Instruct.jinja");
    char *text = NULL, err[256];
    size_t len;
    if (access(path, R_OK) != 0) {
        free(path);
        TDM_SKIP("the Llama 3.1 template in ../shared/chat-templates is absent");
    }
    assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
    free(path);
    struct tdm_chat_template *t = make(text, NULL);
    free(text);
    assert_int_equal(tdm_chat_template_set_tokens(t, "<|begin_of_text|>", NULL, NULL), TDM_OK);
    const char *msgs = "[{\"role\":\"user\",\"content\":\"Hi\"}]";
    char *out = NULL;
    assert_int_equal(tdm_chat_render_json_kw(t, msgs, NULL, "{\"date_string\":\"01 Jan 2030\"}",
                                             true, &out, err, sizeof err),
                     TDM_OK);
    assert_non_null(strstr(out, "Today Date: 01 Jan 2030\n"));
    free(out);
    assert_int_equal(tdm_chat_render_json_kw(t, msgs, NULL, NULL, true, &out, err, sizeof err),
                     TDM_OK);
    assert_non_null(strstr(out, "Today Date: 26 Jul 2024\n"));
    free(out);
    tdm_chat_template_free(t);
}

static void test_builtin_names(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(NULL, "qwen2");
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true, qwen_hi);
    tdm_chat_template_free(t);
    t = make(tdm_chat_tmpl_qwen25, NULL);
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true, qwen_hi);
    tdm_chat_template_free(t);
    t = make(NULL, "llama3"); // presets bos_token
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", false,
                  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    tdm_chat_template_free(t);
    // The Llama 3 text with no bos_token set: `bos_token + content` fails, as in Jinja2.
    t = make(tdm_chat_tmpl_llama3, NULL);
    expect_render_error(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", TDM_EINVAL,
                        "'bos_token' is undefined");
    assert_int_equal(tdm_chat_template_set_var(t, "bos_token", "<B>"), TDM_OK);
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", false,
                  "<B><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    assert_int_equal(tdm_chat_template_set_var(t, "bos_token", NULL), TDM_OK);
    expect_render_error(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", TDM_EINVAL,
                        "'bos_token' is undefined");
    tdm_chat_template_free(t);
    // The tokenizer's special tokens; NULL leaves a variable as it is (undefined here).
    t = make("{{ bos_token }}|{{ eos_token is defined }}|{{ pad_token }}", NULL);
    assert_int_equal(tdm_chat_template_set_tokens(t, "<b>", NULL, "<p>"), TDM_OK);
    char *vars = render_raw(t, "[]", NULL, false);
    assert_string_equal(vars, "<b>|False|<p>");
    free(vars);
    tdm_chat_template_free(t);
    t = make(tdm_chat_tmpl_chatml_ws, NULL);
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true,
                  "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    tdm_chat_template_free(t);
}

// HF's whitespace rules: trim_blocks, lstrip_blocks, '-' and '+' markers, the final
// newline dropped; and spellings Jinja reads the same way render the same.
static void test_whitespace_control(void **state)
{
    (void)state;
    static const struct {
        const char *tmpl, *want;
    } cases[] = {
        {"{% if true %}\nA\n{% endif %}\nB\n", "A\nB"}, // trim_blocks, final \n
        {"  {% if true %}A{% endif %}", "A"},           // lstrip_blocks at start
        {"x\n  {% if true %}A{% endif %}", "x\nA"},     // lstrip after a newline
        {"x  {% if true %}A{% endif %}", "x  A"},       // not at a line start
        {"  {{ 'A' }}", "  A"},                         // no lstrip for {{
        {"a  \n  {%- if true %}A{% endif %}", "aA"},    // '-' strips newlines too
        {"{% if true -%}  \n  A{% endif %}", "A"},
        {"  {%+ if true %}A{% endif %}", "  A"}, // '+' keeps lstrip off
        {"{% if true +%}\nA{% endif %}", "\nA"}, // '+' keeps trim off
        {"{{ 'a' }}\n{{ 'b' }}", "a\nb"},        // no trim after }}
        {"{# c #}\nA", "A"},                     // comments trim too
        {"{{- 'a' -}}  \n  {{ 'b' }}", "ab"},
        {"A\r\nB\r\n", "A\nB"}, // newlines normalised
        {"{% for x in [1,2] %}\n  {{ x }}\n{% endfor %}", "  1\n  2\n"},
        {"{% set x %}\n  v {{ 1 }}\n{% endset %}[{{ x }}]", "[  v 1\n]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_chat_template *t = make(cases[i].tmpl, NULL);
        char *out = render_raw(t, "[]", NULL, false);
        if (strcmp(out, cases[i].want) != 0)
            fail_msg("case %zu: got '%s', want '%s'", i, out, cases[i].want);
        free(out);
        tdm_chat_template_free(t);
    }
    static const char *variants[] = {
        "{%for message in messages%}{{ \"<|im_start|>\"+message['role'] + \"\\n\" + "
        "message[ 'content' ] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt "
        "%}{{'<|im_start|>assistant\\n'}}{% endif %}\n",
        " {% for message in messages %}\n{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}\n  {% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
    };
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; i++) {
        struct tdm_chat_template *t = make(variants[i], NULL);
        expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true,
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        tdm_chat_template_free(t);
    }
}

// Jinja semantics a template can lean on: namespaces, macros with defaults and
// call blocks, loop variables, filters as HF templates use them, markup escaping.
static void test_expressions(void **state)
{
    (void)state;
    static const struct {
        const char *tmpl, *want;
    } cases[] = {
        {"{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
         "{% endfor %}{{ ns.n }}",
         "2"},
        {"{% set x = 1 %}{% for m in messages %}{% set x = 5 %}{% endfor %}{{ x }}", "1"},
        {"{% macro f(a, b='d') %}[{{ a }}{{ b }}]{% endmacro %}{{ f(1) }}{{ f(2, b=3) }}",
         "[1d][23]"},
        {"{% macro w() %}<{{ caller() }}>{% endmacro %}{% call w() %}in{% endcall %}", "<in>"},
        {"{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}"
         "{% endfor %}",
         "1/2,2/2"},
        {"{% for m in messages if m.role == 'user' %}{{ m.content }}{% else %}none{% endfor %}",
         "a"},
        {"{% for m in [] %}x{% else %}empty{% endfor %}", "empty"},
        {"{{ messages | map(attribute='role') | join('|') }}", "user|assistant"},
        {"{{ messages | selectattr('role', 'equalto', 'assistant') | list | length }}", "1"},
        {"{{ {'b': 1, 'a': [1.5, none, true]} | tojson }}", "{\"b\": 1, \"a\": [1.5, null, true]}"},
        {"{{ {'b': 1, 'a': 2} | tojson(indent=2, sort_keys=true) }}",
         "{\n  \"a\": 2,\n  \"b\": 1\n}"},
        {"{{ 'héllo wörld'[1:4] }}|{{ 'abc'[::-1] }}|{{ [1,2,3][-1] }}", "éll|cba|3"},
        {"{{ ' x '.strip() }}|{{ 'a,b,,c'.split(',') }}|{{ 'Hi'.upper() }}",
         "x|['a', 'b', '', 'c']|HI"},
        {"{{ 'a<b' | safe + '<' }}|{{ '<' + 'x' }}", "a<b&lt;|<x"},
        {"{{ {(1, 2): 't'}[1, 2] }}|{{ 0[1, 2] | sum }}|{{ [1][] is defined }}", "t|0|False"},
        {"{{ x is defined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}",
         "FalseTrueTrueTrue"},
        {"{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 2 ** 10 }} {{ 1 / 4 }} {{ 1e20 }}",
         "3 -4 1 1024 0.25 1e+20"},
        {"{{ 'x' ~ 1 ~ none }}|{{ 1 if false else 2 }}|{{ 'yes' if 'ell' in 'hello' }}",
         "x1None|2|yes"},
        {"{% for k, v in {'a': 1, 'b': 2} | items %}{{ k }}={{ v }};{% endfor %}", "a=1;b=2;"},
        {"{% if messages: %}y{% else: %}n{% endif %}{% for m in []: %}{% else: %}e{% endfor %}",
         "ye"},
        {"{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}"
         "{% continue %}{% endif %}{{ i }}{% endfor %}",
         "02"},
        {"{{ '  line1\nline2' | indent(2) }}", "  line1\n  line2"},
        {"{{ messages[0].get('missing', 'dflt') }}{{ messages[0]['role'] | upper }}", "dfltUSER"},
    };
    const char *msgs = "[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"assistant\","
                       "\"content\":\"b\"}]";
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_chat_template *t = make(cases[i].tmpl, NULL);
        char *out = render_raw(t, msgs, NULL, false);
        if (strcmp(out, cases[i].want) != 0)
            fail_msg("case %zu: got '%s', want '%s'", i, out, cases[i].want);
        free(out);
        tdm_chat_template_free(t);
    }
    struct tdm_chat_template *t =
        make("{{ raise_exception('bad role ' ~ messages[0].role) }}", NULL);
    expect_render_error(t, "[{\"role\":\"user\",\"content\":\"a\"}]", TDM_EINVAL,
                        "raise_exception: bad role user");
    tdm_chat_template_free(t);
    t = make("{{ messages[0]['role'] }}", NULL); // Jinja fails on an empty list too
    expect_render_error(t, "[]", TDM_EINVAL, "is undefined");
    tdm_chat_template_free(t);
}

// A template the renderer cannot run is refused at load, naming the construct and line.
// 79 digits: the longest numeric literal the lexer takes.
#define D10 "1234567890"
#define D79 D10 D10 D10 D10 D10 D10 D10 "123456789"

static void test_load_errors(void **state)
{
    (void)state;
    static const struct {
        const char *tmpl, *needle;
    } cases[] = {
        {"a\n{% include 'x.jinja' %}", "line 2: unsupported or unexpected tag 'include'"},
        {"{% extends 'base' %}", "line 1: unsupported or unexpected tag 'extends'"},
        {"\n\n{{ x | frobnicate }}", "line 3: unknown filter 'frobnicate'"},
        {"{{ x is frob }}", "line 1: unknown test 'frob'"},
        {"{% if x %}\nA", "line 1: {% if %} is never closed (missing {% endif %})"},
        {"{% for x in y %}{% endif %}", "unexpected tag 'endif'"},
        {"{{ unterminated", "never closed"},
        {"{{ 'abc }}", "unterminated string literal"},
        {"{% for x in y recursive %}{% endfor %}", "recursive for loops are not supported"},
        {"{% break %}", "'break' outside a for loop"},
        {"{{ f(*args) }}", "*args and **kwargs in calls are not supported"},
        {"{{ a b }}", "expected '}}', got 'b'"},
        {"{# never closed", "unterminated comment"},
        {"{{ 1 + }}", "expected an expression"},
        {"{{ 01 }}", "expected '}}', got a number"}, // Jinja lexes 01 as 0, 1
        {"{% if a if b else c %}{% endif %}", "expected '%}', got 'if'"},
        // fuzz_chat_template: 79 digits and a '.' wrote one byte past the
        // lexer's buffer; longer literals were read as truncated numbers.
        {"{{ " D79 ".5 }}", "numeric literal longer than 79 characters"},
        {"{{ " D79 "9 }}", "numeric literal longer than 79 characters"},
        {"{{ 1." D79 " }}", "numeric literal longer than 79 characters"},
        {"{{ 1e" D79 " }}", "numeric literal longer than 79 characters"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_chat_template *t = NULL;
        char err[512] = "";
        if (tdm_chat_template_new(&t, cases[i].tmpl, NULL, err, sizeof err) != TDM_EINVAL)
            fail_msg("case %zu was accepted", i);
        assert_null(t);
        if (!strstr(err, cases[i].needle) || !strstr(err, "tokenizer_config.json: "))
            fail_msg("case %zu: error '%s' does not contain '%s'", i, err, cases[i].needle);
    }
}

static void test_missing_and_override(void **state)
{
    (void)state;
    struct tdm_chat_template *t = NULL;
    char err[512] = "";
    assert_int_equal(tdm_chat_template_new(&t, NULL, NULL, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "no chat_template"));

    t = make(NULL, "chatml");
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", false,
                  "<|im_start|>user\nHi<|im_end|>\n");
    tdm_chat_template_free(t);
    t = make("{% include 'broken' %}", "llama3"); // the override wins
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", false,
                  "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
    tdm_chat_template_free(t);

    char path[] = "/tmp/tdm_chat_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs("{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}\n", f);
    fclose(f);
    t = make(chatml_text, path);
    assert_int_equal(tdm_chat_template_set_var(t, "bos_token", "<s>"), TDM_OK);
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", false, "<s><user>Hi");
    tdm_chat_template_free(t);

    f = fopen(path, "w");
    fputs("ok\n{% macro m() %}\n{% import 'x' as y %}\n{% endmacro %}", f);
    fclose(f);
    t = NULL;
    assert_int_equal(tdm_chat_template_new(&t, NULL, path, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "line 3: unsupported or unexpected tag 'import'"));
    unlink(path);
    assert_int_equal(tdm_chat_template_new(&t, NULL, path, err, sizeof err), TDM_ENOTFOUND);
    assert_null(t);
}

// Renders run on HTTP worker threads with small stacks (civetweb: about 100 KiB):
// recursion stops at CHAT_MAX_STACK, long before such a stack overflows, while
// modest recursion (nested tool schemas) still renders.
static void *render_on_small_stack(void *arg)
{
    int *failures = arg;
    struct tdm_chat_template *t = NULL;
    char err[512], *out = NULL;
    // Each call level nests 8 blocks and a 24-deep expression: within the call-depth
    // limit (64) this would need several hundred KiB of stack without the guard.
    char rec[1024];
    size_t o = (size_t)snprintf(rec, sizeof rec, "{%% macro f(n) %%}");
    for (int k = 0; k < 8; k++)
        o += (size_t)snprintf(rec + o, sizeof rec - o, "{%% if true %%}");
    o += (size_t)snprintf(rec + o, sizeof rec - o, "{{ ");
    for (int k = 0; k < 24; k++)
        o += (size_t)snprintf(rec + o, sizeof rec - o, "'' ~ (");
    o += (size_t)snprintf(rec + o, sizeof rec - o, "f(n + 1)");
    for (int k = 0; k < 24; k++)
        rec[o++] = ')';
    o += (size_t)snprintf(rec + o, sizeof rec - o, " }}");
    for (int k = 0; k < 8; k++)
        o += (size_t)snprintf(rec + o, sizeof rec - o, "{%% endif %%}");
    snprintf(rec + o, sizeof rec - o, "{%% endmacro %%}{{ f(0) }}");
    if (tdm_chat_template_new(&t, rec, NULL, err, sizeof err) != TDM_OK ||
        tdm_chat_render_json(t, "[]", NULL, true, &out, err, sizeof err) != TDM_ECAPACITY ||
        !strstr(err, "of stack (limit)"))
        (*failures)++;
    tdm_chat_template_free(t);
    if (tdm_chat_template_new(&t,
                              "{% macro f(n) %}{% if n > 0 %}[{{ f(n - 1) }}]{% endif %}"
                              "{% endmacro %}{{ f(20) }}{{ messages | tojson }}",
                              NULL, err, sizeof err) != TDM_OK)
        (*failures)++;
    char deep[300];
    memset(deep, '[', 127);
    memset(deep + 127, ']', 127);
    deep[254] = '\0';
    int rc = tdm_chat_render_json(t, deep, NULL, true, &out, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "small stack: %s\n", err);
    if (rc != TDM_OK || strncmp(out, "[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]][[[", 43) != 0)
        (*failures)++;
    free(out);
    tdm_chat_template_free(t);
    return NULL;
}

static void test_small_stack(void **state)
{
    (void)state;
    pthread_attr_t attr;
    pthread_t th;
    int failures = 0;
    assert_int_equal(pthread_attr_init(&attr), 0);
    assert_int_equal(pthread_attr_setstacksize(&attr, 128 << 10), 0);
    assert_int_equal(pthread_create(&th, &attr, render_on_small_stack, &failures), 0);
    pthread_join(th, NULL);
    pthread_attr_destroy(&attr);
    assert_int_equal(failures, 0);
}

// A loaded template is immutable: threads rendering it at once get the same bytes.
struct render_job {
    const struct tdm_chat_template *t;
    const char *want;
    int bad;
};

static void *render_many(void *arg)
{
    struct render_job *job = arg;
    for (int i = 0; i < 300; i++) {
        char err[256], *out = NULL;
        if (tdm_chat_render_json(job->t,
                                 "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":"
                                 "\"user\",\"content\":\"Hi \u00e9\"}]",
                                 "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]", true,
                                 &out, err, sizeof err) != TDM_OK ||
            strcmp(out, job->want) != 0)
            job->bad++;
        free(out);
    }
    return NULL;
}

static void test_concurrent_renders(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(NULL, "qwen2");
    char *want = render_raw(t,
                            "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\","
                            "\"content\":\"Hi \u00e9\"}]",
                            "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]", true);
    assert_non_null(strstr(want, "{\"type\": \"function\", \"function\": {\"name\": \"f\"}}"));
    pthread_t th[4];
    struct render_job jobs[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct render_job){.t = t, .want = want};
        assert_int_equal(pthread_create(&th[i], NULL, render_many, &jobs[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(jobs[i].bad, 0);
    }
    free(want);
    tdm_chat_template_free(t);
}

// ---- hostile templates and inputs ----------------------------------------------------

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void test_hostile(void **state)
{
    (void)state;
    static const struct {
        const char *tmpl;
        int code;
        const char *needle;
    } cases[] = {
        {"{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", TDM_ECAPACITY,
         "of stack (limit)"},
        {"{% macro f(n) %}{% for i in [1] %}{{ f(n) }}{% endfor %}{% endmacro %}{{ f(0) }}",
         TDM_ECAPACITY, "(limit)"},
        {"{% for i in range(1000000) %}{% endfor %}", TDM_ECAPACITY, "range too big"},
        {"{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
         TDM_ECAPACITY, "loop iterations (limit)"},
        {"{{ 'x' * 1000000000 }}", TDM_ECAPACITY, "a string would exceed"},
        {"{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}"
         "{% set ns.s = ns.s + ns.s %}{% endfor %}",
         TDM_ECAPACITY, "a string would exceed"},
        {"{% for i in range(99999) %}{{ 'y' * 100000 }}{% endfor %}", TDM_ECAPACITY,
         "output would exceed"},
        {"{% set ns = namespace(l=[0]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}"
         "{% endfor %}",
         TDM_ECAPACITY, "(limit)"},
        {"{% set s = 'ab' * 4000000 %}{% for i in range(90000) %}{% if 'zz' in s %}{% endif %}"
         "{% endfor %}",
         TDM_ECAPACITY, "steps (limit)"},
        {"{{ messages[0].content.missing.deeper }}", TDM_EINVAL, "is undefined"},
        {"{{ 1 // 0 }}", TDM_EINVAL, "division or modulo by zero"},
        {"{{ 1 is ne }}", TDM_EINVAL, "test 'ne' takes 1 argument(s), got 0"},
        {"{{ [1] | tojson(ensure_asci=true) }}", TDM_EINVAL, "unexpected keyword argument"},
        {"{{ 'a' | indent(2, width=3) }}", TDM_EINVAL, "multiple values for argument 'width'"},
        {"{{ 'a' | trim(' ', 'x') }}", TDM_EINVAL, "takes 1 positional argument(s) but 2"},
        {"{{ 9223372036854775807 + 1 }}", TDM_EINVAL, "integer overflow"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_chat_template *t = make(cases[i].tmpl, NULL);
        char err[512] = "", *out = NULL;
        double t0 = now_s();
        int rc = tdm_chat_render_json(t, "[{\"role\":\"user\",\"content\":\"a\"}]", NULL, true,
                                      &out, err, sizeof err);
        double dt = now_s() - t0;
        if (rc != cases[i].code || !strstr(err, cases[i].needle))
            fail_msg("case %zu: rc %d err '%s', want %d '%s'", i, rc, err, cases[i].code,
                     cases[i].needle);
        assert_null(out);
        if (dt > 10.0)
            fail_msg("case %zu took %.1f s", i, dt);
        tdm_chat_template_free(t);
    }
    // Expressions and blocks nested past the parser's limit are refused at load.
    char deep[4200];
    size_t o = 0;
    o += (size_t)snprintf(deep + o, sizeof deep - o, "{{ ");
    for (int k = 0; k < 1000; k++)
        deep[o++] = '(';
    deep[o++] = '1';
    for (int k = 0; k < 1000; k++)
        deep[o++] = ')';
    snprintf(deep + o, sizeof deep - o, " }}");
    struct tdm_chat_template *t = NULL;
    char err[512];
    assert_int_equal(tdm_chat_template_new(&t, deep, NULL, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "nested more than"));
    o = 0;
    for (int k = 0; k < 500; k++)
        o += (size_t)snprintf(deep + o, sizeof deep - o, "{%%if 1%%}");
    assert_int_equal(tdm_chat_template_new(&t, deep, NULL, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "nested more than"));

    // Input: a million messages, and JSON nested 10 000 deep.
    t = make(tdm_chat_tmpl_chatml, NULL);
    size_t n = 1000000;
    char *big = malloc(n * 3 + 3);
    assert_non_null(big);
    o = 0;
    big[o++] = '[';
    for (size_t k = 0; k < n; k++) {
        memcpy(big + o, k ? ",{}" : "{}", k ? 3 : 2);
        o += k ? 3 : 2;
    }
    big[o++] = ']';
    big[o] = '\0';
    double t0 = now_s();
    char *out = NULL;
    int rc = tdm_chat_render_json(t, big, NULL, true, &out, err, sizeof err);
    assert_int_not_equal(rc, TDM_OK);
    assert_null(out);
    if (now_s() - t0 > 10.0)
        fail_msg("a million messages took %.1f s", now_s() - t0);
    free(big);
    char *nest = malloc(20002);
    assert_non_null(nest);
    memset(nest, '[', 10000);
    memset(nest + 10000, ']', 10000);
    nest[20000] = '\0';
    rc = tdm_chat_render_json(t, nest, NULL, true, &out, err, sizeof err);
    assert_int_equal(rc, TDM_EINVAL);
    assert_non_null(strstr(err, "nested deeper than"));
    free(nest);
    tdm_chat_template_free(t);
}

// ---- rendering --------------------------------------------------------------------

static void test_qwen2_render(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(NULL, "qwen2");
    expect_render(t, "[{\"role\":\"user\",\"content\":\"Hi\"}]", true,
                  "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                  "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    expect_render(t,
                  "[{\"role\":\"system\",\"content\":\"Be brief.\"},{\"role\":\"user\",\"content\":"
                  "\"2+2?\"},{\"role\":\"assistant\",\"content\":\"4\"},{\"role\":\"system\","
                  "\"content\":\"Now verbose.\"},{\"role\":\"user\",\"content\":\" why \"}]",
                  false,
                  "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                  "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>system\nNow verbose.<|im_end|>\n"
                  "<|im_start|>user\n why <|im_end|>\n");
    // Consecutive tool results share one user turn; a tool result ends the list.
    expect_render(
        t,
        "[{\"role\":\"user\",\"content\":\"w?\"},{\"role\":\"assistant\",\"content\":null},"
        "{\"role\":\"tool\",\"content\":\"a\"},{\"role\":\"tool\",\"content\":\"b\"},"
        "{\"role\":\"assistant\",\"content\":\"ok\"},{\"role\":\"tool\",\"content\":\"c\"}]",
        true,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\na\n</tool_response>\n"
        "<tool_response>\nb\n</tool_response><|im_end|>\n<|im_start|>assistant\nok"
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nc\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n");
    tdm_chat_template_free(t);
}

static void test_chatml_render(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(chatml_text, NULL);
    expect_render(t,
                  "[{\"role\":\"user\",\"content\":\"Hi\"},{\"role\":\"assistant\",\"content\":"
                  "\"Yo\"}]",
                  false, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n");
    expect_render(t, "[{\"role\":\"tool\",\"content\":\"r\"}]", true,
                  "<|im_start|>tool\nr<|im_end|>\n<|im_start|>assistant\n");
    tdm_chat_template_free(t);
}

static void test_llama3_render(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(NULL, "llama3");
    // trim strips Python whitespace, Unicode included (U+3000, U+00A0, U+0085).
    expect_render(
        t,
        "[{\"role\":\"system\",\"content\":\"  sys \\n\"},{\"role\":\"user\",\"content\":"
        "\"\\u3000\\u00a0hi there\\u0085\\t\"},{\"role\":\"assistant\",\"content\":\"\"}]",
        true,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nhi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n");
    tdm_chat_template_free(t);
}

static void test_render_errors(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(NULL, "qwen2");
    char err[256] = "", *out = NULL;
    assert_int_equal(tdm_chat_render(t, NULL, 0, true, &out, err, sizeof err), TDM_EINVAL);
    assert_null(out);
    struct tdm_chat_msg bad[] = {{.role = "user", .content = "x"},
                                 {.role = "developer", .content = "y"}};
    assert_int_equal(tdm_chat_render(t, bad, 2, true, &out, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "messages[1].role"));
    struct tdm_chat_msg nocontent[] = {{.role = "user", .content = NULL}};
    assert_int_equal(tdm_chat_render(t, nocontent, 1, true, &out, err, sizeof err), TDM_EINVAL);
    tdm_chat_template_free(t);
}

// ---- parsing -------------------------------------------------------------------------

static void test_parse_content_forms(void **state)
{
    (void)state;
    const char *json = "[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":\"a\"},"
                       "{\"type\":\"text\",\"text\":\"b\"}]},{\"role\":\"assistant\"},"
                       "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]},"
                       "{\"role\":\"user\",\"content\":[],\"name\":\"x\"}]";
    struct tdm_chat_msg *msgs = NULL;
    size_t n = 0;
    char err[256];
    assert_int_equal(tdm_chat_msgs_parse(json, strlen(json), &msgs, &n, err, sizeof err), TDM_OK);
    assert_int_equal(n, 4);
    assert_string_equal(msgs[0].role, "user");
    assert_string_equal(msgs[0].content, "a\nb");
    assert_string_equal(msgs[1].content, "");
    assert_string_equal(msgs[2].content, "");
    assert_string_equal(msgs[3].content, "");
    tdm_chat_msgs_free(msgs, n);
    tdm_chat_msgs_free(NULL, 0);
}

static void test_parse_errors(void **state)
{
    (void)state;
    expect_parse_error("[{\"role\":", "not valid JSON");
    expect_parse_error("{\"role\":\"user\"}", "must be an array");
    expect_parse_error("[]", "at least one message");
    expect_parse_error("[1]", "messages[0] must be an object");
    expect_parse_error("[{\"role\":\"user\",\"content\":\"a\"},{\"content\":\"b\"}]",
                       "messages[1].role is required");
    expect_parse_error("[{\"role\":5,\"content\":\"a\"}]", "messages[0].role must be a string");
    expect_parse_error("[{\"role\":\"wizard\",\"content\":\"a\"}]",
                       "messages[0].role 'wizard' is not supported");
    expect_parse_error(
        "[{\"role\":\"user\",\"content\":\"a\"},{\"role\":\"user\",\"content\":\"b\"},"
        "{\"role\":\"user\",\"content\":7}]",
        "messages[2].content must be a string or a list of text parts");
    expect_parse_error("[{\"role\":\"user\",\"content\":{\"text\":\"a\"}}]",
                       "messages[0].content must be a string or a list of text parts");
    expect_parse_error("[{\"role\":\"user\",\"content\":[{\"type\":\"image_url\",\"image_url\":"
                       "{\"url\":\"http://x\"}}]}]",
                       "content part type 'image_url' is not supported");
    expect_parse_error("[{\"role\":\"user\",\"content\":[\"plain\"]}]",
                       "messages[0].content[0] must be an object");
    expect_parse_error("[{\"role\":\"user\",\"content\":[{\"text\":\"a\"}]}]",
                       "messages[0].content[0].type must be a string");
    expect_parse_error("[{\"role\":\"user\",\"content\":[{\"type\":\"text\",\"text\":1}]}]",
                       "messages[0].content[0].text must be a string");
    expect_parse_error("[{\"role\":\"user\",\"content\":null}]",
                       "messages[0].content is required for role user");
    expect_parse_error("[{\"role\":\"tool\"}]", "messages[0].content is required for role tool");
    expect_parse_error(
        "[{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"1\"}]}]",
        "messages[0].tool_calls is not supported");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_real_qwen25_config),
        cmocka_unit_test(test_builtin_names),
        cmocka_unit_test(test_template_kwargs),
        cmocka_unit_test(test_template_kwargs_llama31),
        cmocka_unit_test(test_whitespace_control),
        cmocka_unit_test(test_expressions),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_missing_and_override),
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_concurrent_renders),
        cmocka_unit_test(test_small_stack),
        cmocka_unit_test(test_qwen2_render),
        cmocka_unit_test(test_chatml_render),
        cmocka_unit_test(test_llama3_render),
        cmocka_unit_test(test_render_errors),
        cmocka_unit_test(test_parse_content_forms),
        cmocka_unit_test(test_parse_errors),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, NULL, NULL));
}
