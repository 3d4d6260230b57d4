// SPDX-License-Identifier: Apache-2.0
// Tests of the tool-call parsers (openai_toolparse.c): hermes, llama3_json and
// the forced required/named shapes, on whole outputs (vLLM's extract_tool_calls
// results: calls, content, the malformed-call fallback) and streamed with the
// text split at every byte position, in two cuts, byte by byte: the stream
// never shows part of a marker as content, never splits a UTF-8 character,
// sends each call's id/type/name first and its arguments in fragments that
// concatenate to the non-stream arguments, and ends with the same content.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "openai.h"
#include "openai_impl.h"

#define MAXC 8

struct expect_call {
    const char *name;
    const char *args;
};

struct streamed {
    char content[4096];
    size_t clen;
    int n; // calls seen (headers)
    char names[MAXC][128];
    char ids[MAXC][48];
    char args[MAXC][4096];
    size_t alen[MAXC];
};

// Collects what one feed/finish left pending, checking the delta invariants.
static void collect(struct tdm_oai_toolparse *p, struct streamed *s)
{
    size_t cl = 0, nd = 0;
    const char *c = tdm_oai_toolparse_content(p, &cl);
    assert_true(s->clen + cl < sizeof s->content);
    // Content chunks are whole UTF-8 (the response builder would turn a split
    // character into U+FFFD).
    char *fixed = tdm_oai_utf8_dup(c, cl);
    assert_non_null(fixed);
    assert_memory_equal(fixed, c, cl);
    free(fixed);
    memcpy(s->content + s->clen, c, cl);
    s->clen += cl;
    const struct tdm_oai_tool_delta *d = tdm_oai_toolparse_deltas(p, &nd);
    for (size_t i = 0; i < nd; i++) {
        int idx = d[i].index;
        assert_true(idx >= 0 && idx < MAXC);
        if (d[i].header) {
            assert_int_equal(idx, s->n); // calls open in order, header first
            assert_non_null(d[i].name);
            assert_memory_equal(d[i].id, "chatcmpl-tool-", 14);
            assert_int_equal(strlen(d[i].id), 14 + 32);
            snprintf(s->names[idx], sizeof s->names[idx], "%s", d[i].name);
            snprintf(s->ids[idx], sizeof s->ids[idx], "%s", d[i].id);
            s->n++;
        } else {
            assert_true(idx < s->n); // arguments only for a call already opened
        }
        char *fx = tdm_oai_utf8_dup(d[i].args, d[i].args_len);
        assert_non_null(fx);
        assert_memory_equal(fx, d[i].args, d[i].args_len);
        free(fx);
        assert_true(s->alen[idx] + d[i].args_len < sizeof s->args[idx]);
        memcpy(s->args[idx] + s->alen[idx], d[i].args, d[i].args_len);
        s->alen[idx] += d[i].args_len;
    }
    tdm_oai_toolparse_clear(p);
}

// Streams text in pieces cut at the given offsets (ascending, < len).
static void stream(enum tdm_oai_tool_format f, const char *name, bool parallel, const char *text,
                   const size_t *cuts, size_t n_cuts, struct streamed *s)
{
    memset(s, 0, sizeof *s);
    struct tdm_oai_toolparse *p = NULL;
    assert_int_equal(tdm_oai_toolparse_new(&p, f, name, parallel), TDM_OK);
    size_t len = strlen(text), at = 0;
    for (size_t i = 0; i <= n_cuts; i++) {
        size_t to = i < n_cuts ? cuts[i] : len;
        assert_int_equal(tdm_oai_toolparse_feed(p, text + at, to - at), TDM_OK);
        collect(p, s);
        at = to;
    }
    assert_int_equal(tdm_oai_toolparse_finish(p), TDM_OK);
    collect(p, s);
    s->content[s->clen] = '\0';
    for (int i = 0; i < s->n; i++)
        s->args[i][s->alen[i]] = '\0';
    tdm_oai_toolparse_free(p);
}

static void check_streamed(const struct streamed *s, const char *content,
                           const struct expect_call *calls, int n_calls, const char *text,
                           size_t cut)
{
    if (strcmp(s->content, content) != 0 || s->n != n_calls) {
        print_error("text '%s' cut at %zu: content '%s' (want '%s'), %d calls (want %d)\n", text,
                    cut, s->content, content, s->n, n_calls);
        fail();
    }
    for (int i = 0; i < n_calls; i++) {
        if (strcmp(s->names[i], calls[i].name) != 0 || strcmp(s->args[i], calls[i].args) != 0) {
            print_error("text '%s' cut at %zu: call %d %s(%s), want %s(%s)\n", text, cut, i,
                        s->names[i], s->args[i], calls[i].name, calls[i].args);
            fail();
        }
    }
}

// The whole output (non-stream) and the stream at every split agree with the
// expectation. content NULL: the message content is null (stream: "").
static void check(enum tdm_oai_tool_format f, const char *name, bool parallel, const char *text,
                  const char *content, const struct expect_call *calls, int n_calls)
{
    struct tdm_oai_tool_call *got = NULL;
    size_t n_got = 0;
    char *got_content = NULL;
    assert_int_equal(
        tdm_oai_tools_extract(f, name, parallel, text, strlen(text), &got, &n_got, &got_content),
        TDM_OK);
    if (content == NULL)
        assert_null(got_content);
    else
        assert_string_equal(got_content, content);
    assert_int_equal(n_got, n_calls);
    for (int i = 0; i < n_calls; i++) {
        assert_string_equal(got[i].name, calls[i].name);
        assert_string_equal(got[i].arguments, calls[i].args);
        assert_memory_equal(got[i].id, "chatcmpl-tool-", 14);
        for (int j = 0; j < i; j++)
            assert_string_not_equal(got[i].id, got[j].id);
    }
    tdm_oai_tool_calls_free(got, n_got);
    free(got_content);

    const char *sc = content ? content : "";
    size_t len = strlen(text);
    struct streamed s;
    stream(f, name, parallel, text, NULL, 0, &s);
    check_streamed(&s, sc, calls, n_calls, text, 0);
    for (size_t k = 1; k < len; k++) { // two pieces, cut at every byte
        stream(f, name, parallel, text, &k, 1, &s);
        check_streamed(&s, sc, calls, n_calls, text, k);
    }
    size_t *all = malloc(len * sizeof *all); // byte by byte
    assert_non_null(all);
    for (size_t k = 0; k + 1 < len; k++)
        all[k] = k + 1;
    stream(f, name, parallel, text, all, len ? len - 1 : 0, &s);
    check_streamed(&s, sc, calls, n_calls, text, (size_t)-1);
    free(all);
}

// A malformed output: non-stream keeps the whole text as content; a stream
// that never sent a header shows the whole text as content too.
static void check_malformed(enum tdm_oai_tool_format f, const char *text, bool stream_is_content)
{
    struct tdm_oai_tool_call *got = NULL;
    size_t n_got = 9;
    char *content = NULL;
    assert_int_equal(
        tdm_oai_tools_extract(f, NULL, true, text, strlen(text), &got, &n_got, &content), TDM_OK);
    assert_int_equal(n_got, 0);
    assert_null(got);
    assert_string_equal(content, text);
    free(content);
    if (!stream_is_content)
        return;
    size_t len = strlen(text);
    struct streamed s;
    for (size_t k = 1; k < len; k++) {
        stream(f, NULL, true, text, &k, 1, &s);
        check_streamed(&s, text, NULL, 0, text, k);
    }
}

#define H TDM_OAI_TOOL_FORMAT_HERMES
#define L TDM_OAI_TOOL_FORMAT_LLAMA3_JSON
#define R TDM_OAI_TOOL_FORMAT_REQUIRED
#define N TDM_OAI_TOOL_FORMAT_NAMED

static void test_hermes(void **state)
{
    (void)state;
    struct expect_call paris[] = {{"get_weather", "{\"city\": \"Paris\"}"}};
    // Qwen2.5's own format: only a call, content null.
    check(H, NULL, true,
          "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
          "</tool_call>",
          NULL, paris, 1);
    // Text before is content; two calls; whitespace between and after dropped.
    struct expect_call two[] = {
        {"get_weather", "{\"city\": \"Paris\"}"},
        {"get_time", "{\"tz\": [1, 2.5e3, -0, true, null, \"\\u00e9\\\"\"]}"}};
    check(H, NULL, true,
          "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
          "\"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": "
          "{\"tz\": [1, 2.5e3, -0, true, null, \"\\u00e9\\\"\"]}}\n</tool_call>\n",
          "Let me check.\n", two, 2);
    // Without parallel_tool_calls only the first call is kept.
    check(H, NULL, false,
          "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"
          "<tool_call>{\"name\": \"x\", \"arguments\": {}}</tool_call>",
          NULL, paris, 1);
    // Text after a call is content; arguments before the name; unicode split anywhere.
    struct expect_call uni[] = {{"søk", "{\"q\": \"日本 é 🙂\", \"n\": {\"deep\": [[]]}}"}};
    check(H, NULL, true,
          "<tool_call>{\"arguments\": {\"q\": \"日本 é 🙂\", \"n\": {\"deep\": [[]]}}, "
          "\"name\": "
          "\"søk\", \"extra\": 1}</tool_call>\nDone 👍",
          "\nDone 👍", uni, 1);
    // The output ended before </tool_call> (EOS, a stop string): still a call (vLLM).
    struct expect_call empty[] = {{"f", "{}"}};
    check(H, NULL, true, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n", NULL, empty, 1);
    // No call: everything is content, including things that look like markers.
    check(H, NULL, true, "Use <tool_ or </tool_call> or <tool_call but not quite, ok <",
          "Use <tool_ or </tool_call> or <tool_call but not quite, ok <", NULL, 0);
    check(H, NULL, true, "", "", NULL, 0);
    check(H, NULL, true, "plain ünïcödé", "plain ünïcödé", NULL, 0);
}

static void test_hermes_malformed(void **state)
{
    (void)state;
    // Not JSON from the start: content, streamed or not.
    check_malformed(H, "<tool_call>\nnot json\n</tool_call> and more", true);
    check_malformed(H, "Hi <tool_call>[1, 2]</tool_call>", true);
    check_malformed(H, "<tool_call>{\"arguments\": {}}</tool_call>", true); // no name
    check_malformed(H, "<tool_call>{\"name\": 7, \"arguments\": {}}</tool_call>", true);
    check_malformed(
        H, "<tool_call>{\"name\": \"f\", \"name\": \"g\", \"arguments\": {}}</tool_call>", false);
    // Truncated (max_tokens) before the name: content.
    check_malformed(H, "<tool_call>\n{\"na", true);
    // Broken after the name went out: non-stream falls back to content; the
    // stream closed the call it had opened.
    const char *late = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": }}</tool_call>";
    check_malformed(H, late, false);
    struct streamed s;
    size_t cut = strlen("<tool_call>{\"name\": \"f\", \"arguments\": {\"a\"");
    stream(H, NULL, true, late, &cut, 1, &s);
    assert_int_equal(s.n, 1);
    assert_string_equal(s.names[0], "f");
    assert_string_equal(s.content, "");
    stream(H, NULL, true, late, NULL, 0, &s); // seen whole, it is content
    assert_int_equal(s.n, 0);
    assert_string_equal(s.content, late);
    // One good call and one bad: non-stream is all content (vLLM's fallback).
    check_malformed(H,
                    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"
                    "<tool_call>oops</tool_call>",
                    false);
    // Garbage after the object inside the markers.
    check_malformed(H, "<tool_call>{\"name\": \"f\", \"arguments\": {}} x</tool_call>", false);
}

static void test_llama3_json(void **state)
{
    (void)state;
    struct expect_call one[] = {{"get_weather", "{\"city\": \"Paris\"}"}};
    check(L, NULL, true, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", NULL,
          one, 1);
    check(L, NULL, true,
          "<|python_tag|>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}", NULL,
          one, 1);
    struct expect_call two[] = {{"a", "{}"}, {"b", "{\"x\": [1, {\"y\": \"}\"}]}"}};
    check(L, NULL, true,
          "  {\"name\": \"a\", \"parameters\": {}} ; {\"name\": \"b\", \"parameters\": {\"x\": [1, "
          "{\"y\": \"}\"}]}};",
          NULL, two, 2);
    check(L, NULL, false,
          "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}; {\"name\": \"z\", "
          "\"parameters\": {}}",
          NULL, one, 1);
    // Text after the calls is content (vLLM drops it).
    check(L, NULL, true,
          "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}\nThat is all.",
          "That is all.", one, 1);
    // Not a call: content.
    check(L, NULL, true, "The answer is {42}.", "The answer is {42}.", NULL, 0);
    check(L, NULL, true, "<|python", "<|python", NULL, 0);
    check(L, NULL, true, "  \n", "  \n", NULL, 0);
    check_malformed(L, "{\"name\": \"f\"}", false); // no parameters
    check_malformed(L, "{\"name\": \"f\", \"parameters\": {}, \"arguments\": {}}", false);
    check_malformed(L, "{\"parameters\": {\"a\": tru", true);
    check_malformed(L, "{not json at all", true);
}

static void test_forced(void **state)
{
    (void)state;
    struct expect_call two[] = {{"f", "{\"a\": 1}"}, {"g", "{}"}};
    check(R, NULL, true,
          "[{\"name\": \"f\", \"parameters\": {\"a\": 1}}, {\"name\": \"g\", \"parameters\": {}}]",
          NULL, two, 2);
    check(R, NULL, false,
          "[{\"name\": \"f\", \"parameters\": {\"a\": 1}},{\"name\": \"g\", \"parameters\": {}}]",
          NULL, two, 1);
    check_malformed(R, "nope", true);
    check_malformed(R, "[{\"name\": \"f\", \"parameters\": {}}] tail", false);
    struct expect_call named[] = {{"get_weather", "{\"city\": \"Paris\", \"u\": \"°C\"}"}};
    check(N, "get_weather", true, "{\"city\": \"Paris\", \"u\": \"°C\"}", NULL, named, 1);
}

// Random outputs built from the pieces tool calls are made of, fed in random
// cuts (fixed seed): whenever the whole text parses into calls, the stream
// gives the same calls and content; otherwise it must still end cleanly.
static void test_random_splits(void **state)
{
    (void)state;
    static const char *const pieces[] = {
        "<tool_call>",
        "</tool_call>",
        "\n",
        " ",
        "{",
        "}",
        "[",
        "]",
        ",",
        ":",
        ";",
        "\"",
        "\"name\"",
        "\"arguments\"",
        "\"parameters\"",
        "\"f\"",
        "\"x\\\"y\"",
        "1",
        "-2.5e3",
        "true",
        "null",
        "é",
        "日本",
        "<tool",
        "_call>",
        "<|python_tag|>",
        "hi",
        "\\u00e9",
        "{\"name\": \"f\", \"arguments\": {\"a\": [1, {\"b\": \"c\"}]}}",
        "{\"name\": \"g\", \"parameters\": {}}",
    };
    const size_t np = sizeof pieces / sizeof pieces[0];
    const enum tdm_oai_tool_format fmts[] = {H, L, R};
    srand(12345);
    int parsed = 0;
    for (int iter = 0; iter < 3000; iter++) {
        char text[512] = "";
        size_t len = 0;
        int n = 1 + rand() % 12;
        for (int k = 0; k < n; k++) {
            const char *p = pieces[rand() % np];
            if (len + strlen(p) + 1 >= sizeof text)
                break;
            strcat(text, p);
            len += strlen(p);
        }
        enum tdm_oai_tool_format f = fmts[iter % 3];
        size_t cuts[8] = {0}, nc = 0;
        for (size_t k = 1; k < len && nc < 8; k += 1 + (size_t)rand() % 9)
            cuts[nc++] = k;
        struct tdm_oai_tool_call *got = NULL;
        size_t n_got = 0;
        char *content = NULL;
        assert_int_equal(tdm_oai_tools_extract(f, NULL, true, text, len, &got, &n_got, &content),
                         TDM_OK);
        struct streamed s;
        stream(f, NULL, true, text, cuts, nc, &s);
        if (n_got > 0) {
            parsed++;
            struct expect_call want[MAXC];
            assert_true(n_got <= MAXC);
            for (size_t k = 0; k < n_got; k++)
                want[k] = (struct expect_call){got[k].name, got[k].arguments};
            check_streamed(&s, content ? content : "", want, (int)n_got, text, cuts[0]);
        } else {
            assert_string_equal(content, text);
        }
        tdm_oai_tool_calls_free(got, n_got);
        free(content);
    }
    assert_true(parsed > 50); // the generator does produce calls
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hermes),        cmocka_unit_test(test_hermes_malformed),
        cmocka_unit_test(test_llama3_json),   cmocka_unit_test(test_forced),
        cmocka_unit_test(test_random_splits),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
