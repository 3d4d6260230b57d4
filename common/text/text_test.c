// SPDX-License-Identifier: Apache-2.0
// text tests: the served-name rules in order (the flag, a Hub id as given,
// config.json's _name_or_path, the folder's name without trailing slashes);
// a folder loads its tokenizer and ChatML template from mkmodel's tokenizer
// files, and the template sees the tokenizer's bos/eos/pad tokens as HF passes
// them; a tokenizer without a chat template leaves chat off with the message
// the chat endpoint returns; an explicit template file that does not exist is
// an error that leaves nothing to free; a local folder resolves to itself;
// --max-model-len is checked against max_position_embeddings.
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
#include "core.h"
#include "mkmodel.h"
#include "text.h"
#include "tokenizer.h"

static void write_text(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_dir(const char *dir)
{
    static const char *const files[] = {"tokenizer.json", "tokenizer_config.json", "config.json",
                                        "special.jinja"};
    char path[512];
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, files[i]);
        unlink(path);
    }
    rmdir(dir);
}

static void make_dir(char *dir, size_t len)
{
    snprintf(dir, len, "/tmp/tdm_text_test_XXXXXX");
    assert_non_null(mkdtemp(dir));
    char err[256];
    assert_int_equal(tdm_mkmodel_write_tokenizer(512, dir, err, sizeof err), TDM_OK);
}

static void test_served_name(void **state)
{
    (void)state;
    char dir[64], name[TDM_TEXT_NAME_MAX];
    make_dir(dir, sizeof dir);
    tdm_text_served_name(name, sizeof name, dir, dir, "my-model");
    assert_string_equal(name, "my-model");
    // Not a folder: a Hub id, served under the id itself (its cache path aside).
    tdm_text_served_name(name, sizeof name, "Qwen/Qwen2.5-0.5B-Instruct",
                         "/cache/models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/abc", NULL);
    assert_string_equal(name, "Qwen/Qwen2.5-0.5B-Instruct");
    // A folder: its name (trailing slashes ignored) ...
    char slashed[80];
    snprintf(slashed, sizeof slashed, "%s//", dir);
    tdm_text_served_name(name, sizeof name, slashed, slashed, "");
    assert_string_equal(name, strrchr(dir, '/') + 1);
    // ... unless config.json names it.
    write_text(dir, "config.json", "{\"_name_or_path\": \"org/base\"}");
    tdm_text_served_name(name, sizeof name, dir, dir, NULL);
    assert_string_equal(name, "org/base");
    write_text(dir, "config.json", "{\"_name_or_path\": \"\"}");
    tdm_text_served_name(name, sizeof name, dir, dir, NULL);
    assert_string_equal(name, strrchr(dir, '/') + 1);
    remove_dir(dir);
}

static void test_load(void **state)
{
    (void)state;
    char dir[64], err[512];
    make_dir(dir, sizeof dir);
    struct tdm_text t;
    struct tdm_text_config cfg = {.model = dir, .model_path = dir, .log_module = "test"};
    assert_int_equal(tdm_text_load(&t, &cfg, err, sizeof err), TDM_OK);
    assert_non_null(t.tok);
    assert_non_null(t.chat); // mkmodel writes a ChatML template
    assert_string_equal(t.chat_err, "");
    assert_string_equal(t.served_name, strrchr(dir, '/') + 1);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(t.tok, "hi", 2, false, &ids, &n), TDM_OK);
    assert_true(n > 0);
    free(ids);
    tdm_text_fini(&t);
    tdm_text_fini(&t); // idempotent

    // The template sees the tokenizer's special tokens (bos_token, eos_token, pad_token).
    write_text(dir, "special.jinja", "[{{ bos_token }}|{{ eos_token }}|{{ pad_token }}]");
    char tmpl[128];
    snprintf(tmpl, sizeof tmpl, "%s/special.jinja", dir);
    cfg.chat_template = tmpl;
    assert_int_equal(tdm_text_load(&t, &cfg, err, sizeof err), TDM_OK);
    assert_non_null(t.chat);
    const char *bos = tdm_tok_id_to_piece(t.tok, tdm_tok_bos_id(t.tok));
    const char *eos = tdm_tok_id_to_piece(t.tok, tdm_tok_eos_id(t.tok));
    const char *pad = tdm_tok_id_to_piece(t.tok, tdm_tok_pad_id(t.tok));
    assert_non_null(eos);
    char want[256];
    snprintf(want, sizeof want, "[%s|%s|%s]", bos ? bos : "", eos, pad ? pad : "");
    struct tdm_chat_msg msg = {.role = "user", .content = "hi"};
    char *out = NULL;
    assert_int_equal(tdm_chat_render(t.chat, &msg, 1, false, &out, err, sizeof err), TDM_OK);
    assert_string_equal(out, want);
    free(out);
    tdm_text_fini(&t);

    // An explicit template that cannot be read is an error.
    cfg.chat_template = "/nonexistent/template.jinja";
    assert_int_not_equal(tdm_text_load(&t, &cfg, err, sizeof err), TDM_OK);
    assert_null(t.tok);
    assert_null(t.chat);
    remove_dir(dir);
}

static void test_no_template(void **state)
{
    (void)state;
    char dir[64], err[512], path[128];
    make_dir(dir, sizeof dir);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    cJSON_DeleteItemFromObject(j, "chat_template");
    char *out = cJSON_Print(j);
    write_text(dir, "tokenizer_config.json", out);
    free(out);
    cJSON_Delete(j);
    struct tdm_text t;
    struct tdm_text_config cfg = {.model = dir, .model_path = dir, .served_model_name = "x"};
    assert_int_equal(tdm_text_load(&t, &cfg, err, sizeof err), TDM_OK);
    assert_null(t.chat);
    assert_string_equal(t.chat_err,
                        "tokenizer_config.json has no chat_template (use --chat-template)");
    assert_string_equal(t.served_name, "x");
    tdm_text_fini(&t);
    remove_dir(dir);
}

static void test_resolve_and_context(void **state)
{
    (void)state;
    char dir[64], path[1024], err[256];
    make_dir(dir, sizeof dir);
    assert_int_equal(tdm_text_resolve(dir, NULL, path, sizeof path, err, sizeof err), TDM_OK);
    assert_string_equal(path, dir);
    remove_dir(dir);

    int n = 0;
    assert_int_equal(tdm_text_context_len(0, 4096, &n, err, sizeof err), TDM_OK);
    assert_int_equal(n, 4096);
    assert_int_equal(tdm_text_context_len(1024, 4096, &n, err, sizeof err), TDM_OK);
    assert_int_equal(n, 1024);
    assert_int_equal(tdm_text_context_len(8192, 4096, &n, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err,
                        "--max-model-len 8192 exceeds the model's max_position_embeddings 4096");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_served_name),
        cmocka_unit_test(test_load),
        cmocka_unit_test(test_no_template),
        cmocka_unit_test(test_resolve_and_context),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
