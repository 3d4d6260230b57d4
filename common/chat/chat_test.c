// SPDX-License-Identifier: Apache-2.0
// chat_test: template recognition (real Qwen2.5 text, spelling variants that Jinja
// reads the same way, near misses that must be rejected), rendering against
// expected strings for each format, and OpenAI messages parsing with its errors.
// The byte-for-byte comparison with Jinja2 itself is ref/render_ref.py.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

// ---- recognition ----------------------------------------------------------------

static void test_real_qwen25_config(void **state)
{
    (void)state;
    char *path = tdm_path_join(TANDEM_SHARED_DIR, "models/qwen2-tokenizer/tokenizer_config.json");
    char *text = NULL, err[256];
    size_t len;
    if (access(path, R_OK) != 0) {
        free(path);
        skip();
    }
    assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
    cJSON *cfg = cJSON_ParseWithLength(text, len);
    assert_non_null(cfg);
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    assert_true(cJSON_IsString(ct));
    struct tdm_chat_template *t = make(ct->valuestring, NULL);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_QWEN2);
    tdm_chat_template_free(t);
    cJSON_Delete(cfg);
    free(text);
    free(path);
}

static void test_known_texts(void **state)
{
    (void)state;
    struct tdm_chat_template *t = make(tdm_chat_tmpl_llama3, NULL);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_LLAMA3);
    tdm_chat_template_free(t);
    t = make(tdm_chat_tmpl_qwen25, NULL);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_QWEN2);
    tdm_chat_template_free(t);
    t = make(chatml_text, NULL);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_CHATML);
    tdm_chat_template_free(t);
    t = make(tdm_chat_tmpl_chatml_ws, NULL);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_CHATML);
    tdm_chat_template_free(t);
}

// Spellings Jinja reads identically: spaces inside tags, quote style, a trailing
// newline, a newline after a block tag (trim_blocks), indentation before a block
// tag (lstrip_blocks).
static void test_equivalent_spellings(void **state)
{
    (void)state;
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
        assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_CHATML);
        tdm_chat_template_free(t);
    }
}

// Templates that render differently must not be recognised.
static void test_near_misses_rejected(void **state)
{
    (void)state;
    static const char *misses[] = {
        // no newline after <|im_end|>
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
        // trims the content
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] | trim + '<|im_end|>' + '\\n'}}{% endfor %}{% if "
        "add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        // literal text between tags is output: a leading newline
        "\n{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
        // a newline after }} is output (trim_blocks only applies to %})
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}\n{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
        // a space inside a literal
        "{% for message in messages %}{{'<|im_start|> ' + message['role'] + '\\n' + "
        "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}",
        "{{ unterminated",
        "",
    };
    for (size_t i = 0; i < sizeof misses / sizeof misses[0]; i++) {
        struct tdm_chat_template *t = NULL;
        char err[512] = "";
        if (tdm_chat_template_new(&t, misses[i], NULL, err, sizeof err) != TDM_EINVAL)
            fail_msg("near miss %zu was recognised", i);
        assert_null(t);
        assert_non_null(strstr(err, "chat template not recognised (first 60 chars: "));
        assert_non_null(strstr(err, "--chat-template FILE"));
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
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_CHATML);
    tdm_chat_template_free(t);
    t = make("{{ garbage }}", "llama3"); // the override wins
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_LLAMA3);
    tdm_chat_template_free(t);
    t = make(NULL, "qwen2");
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_QWEN2);
    tdm_chat_template_free(t);

    char path[] = "/tmp/tdm_chat_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(tdm_chat_tmpl_llama3, f);
    fputs("\n", f);
    fclose(f);
    t = make(chatml_text, path);
    assert_int_equal(tdm_chat_template_format(t), TDM_CHAT_LLAMA3);
    tdm_chat_template_free(t);

    f = fopen(path, "w");
    fputs("{{ messages }}", f);
    fclose(f);
    t = NULL;
    assert_int_equal(tdm_chat_template_new(&t, NULL, path, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "first 60 chars: {{ messages }}"));
    unlink(path);
    assert_int_equal(tdm_chat_template_new(&t, NULL, path, err, sizeof err), TDM_ENOTFOUND);
    assert_null(t);
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
    struct tdm_chat_template *t = make(tdm_chat_tmpl_llama3, NULL);
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
        cmocka_unit_test(test_real_qwen25_config),   cmocka_unit_test(test_known_texts),
        cmocka_unit_test(test_equivalent_spellings), cmocka_unit_test(test_near_misses_rejected),
        cmocka_unit_test(test_missing_and_override), cmocka_unit_test(test_qwen2_render),
        cmocka_unit_test(test_chatml_render),        cmocka_unit_test(test_llama3_render),
        cmocka_unit_test(test_render_errors),        cmocka_unit_test(test_parse_content_forms),
        cmocka_unit_test(test_parse_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
