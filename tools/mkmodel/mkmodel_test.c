// SPDX-License-Identifier: Apache-2.0
// Tests for mkmodel: the folder it writes parses with the project's own readers
// (config.json through hf, the tokenizer through the tokenizer module, the chat
// template through chat), the tokenizer has exactly vocab_size tokens with the
// special tokens last and round-trips text, weights are deterministic in the
// seed, and bad shapes are refused with a message.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "chat.h"
#include "core.h"
#include "hf.h"
#include "mkmodel.h"
#include "openai.h"
#include "tokenizer.h"

static void check_tokenizer(const char *dir, int vocab)
{
    char err[256];
    struct tdm_tokenizer *tok = NULL;
    int rc = tdm_tok_load(&tok, dir, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "tokenizer: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    assert_int_equal(tdm_tok_vocab_size(tok), vocab);
    assert_int_equal(tdm_tok_piece_to_id(tok, "<|endoftext|>"), vocab - 3);
    assert_int_equal(tdm_tok_piece_to_id(tok, "<|im_start|>"), vocab - 2);
    assert_int_equal(tdm_tok_piece_to_id(tok, "<|im_end|>"), vocab - 1);
    assert_true(tdm_tok_is_special(tok, vocab - 1));
    assert_int_equal(tdm_tok_eos_id(tok), vocab - 1);

    static const char text[] = "<|im_start|>user\nThe quick brown fox, 42 times! Ünïcödé ok?"
                               "<|im_end|>\n";
    int32_t *ids;
    size_t n;
    assert_int_equal(tdm_tok_encode(tok, text, strlen(text), false, &ids, &n), TDM_OK);
    assert_true(n > 0 && n < strlen(text));
    assert_int_equal(ids[0], vocab - 2);
    for (size_t i = 0; i < n; i++)
        assert_true(ids[i] >= 0 && ids[i] < vocab);
    char *back;
    size_t len;
    assert_int_equal(tdm_tok_decode(tok, ids, n, false, &back, &len), TDM_OK);
    assert_string_equal(back, text);
    free(back);
    free(ids);

    struct tdm_chat_template *t = NULL;
    assert_int_equal(tdm_chat_template_new(&t, tdm_tok_chat_template(tok), NULL, err, sizeof err),
                     TDM_OK);
    struct tdm_chat_msg msg = {.role = "user", .content = "hi"};
    char *prompt = NULL;
    assert_int_equal(tdm_chat_render(t, &msg, 1, true, &prompt, err, sizeof err), TDM_OK);
    assert_string_equal(prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(prompt);
    // With tools: the Hermes convention (issue 28, item 3), rendered as
    // python3-jinja2 renders this template (checked when it was written).
    const char *msgs =
        "[{\"role\":\"system\",\"content\":\"S\"},{\"role\":\"user\",\"content\":\"w?\"},"
        "{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[{\"id\":\"c1\",\"type\":"
        "\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":{\"city\":"
        "\"Paris\"}}}]},{\"role\":\"tool\",\"tool_call_id\":\"c1\",\"content\":\"sunny\"}]";
    const char *tools = "[{\"type\":\"function\",\"function\":{\"name\":\"get_weather\"}}]";
    assert_int_equal(tdm_chat_render_json(t, msgs, tools, true, &prompt, err, sizeof err), TDM_OK);
    assert_string_equal(
        prompt,
        "<|im_start|>system\nS\n\n# Tools\n\nThese functions are available; call any of them "
        "when it helps the user. Their signatures, in <tools></tools> tags:\n<tools>\n"
        "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"}}\n</tools>\n\n"
        "To call one, write its name and a JSON object of arguments in <tool_call></tool_call> "
        "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\nw?<|im_end|>\n<|im_start|>assistant\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n");
    free(prompt);
    enum tdm_oai_tool_parser tp;
    assert_int_equal(tdm_oai_tool_parser_for_model(dir, &tp, err, sizeof err), TDM_OK);
    assert_int_equal(tp, TDM_OAI_TOOL_PARSER_HERMES);
    tdm_chat_template_free(t);
    tdm_tok_free(tok);
}

static void test_tiny_folder(void **state)
{
    (void)state;
    char dir[] = "/tmp/tdm_mkmodel_testXXXXXX";
    char err[256];
    struct tdm_mkmodel_spec s;
    assert_non_null(mkdtemp(dir));
    assert_int_equal(tdm_mkmodel_preset(&s, "tiny"), TDM_OK);
    assert_int_equal(tdm_mkmodel_write(&s, dir, err, sizeof err), TDM_OK);

    struct tdm_model_config c;
    assert_int_equal(tdm_hf_config_load(&c, dir, err, sizeof err), TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_QWEN2);
    assert_int_equal(c.hidden_size, 64);
    assert_int_equal(c.num_key_value_heads, 2);
    assert_int_equal(c.vocab_size, 512);
    assert_true(c.tie_word_embeddings);
    assert_true(c.attention_bias);
    assert_int_equal(c.num_eos_token_ids, 1);
    assert_int_equal(c.eos_token_ids[0], 511);

    struct tdm_generation_config gc;
    assert_int_equal(tdm_hf_generation_config_load(&gc, dir, err, sizeof err), TDM_OK);
    assert_int_equal(gc.num_eos_token_ids, 2);

    struct tdm_safetensors *st;
    assert_int_equal(tdm_st_open(&st, dir, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_st_count(st), 1 + 2 * 12 + 1); // embed, 12 per layer, final norm
    assert_null(tdm_st_find(st, "lm_head.weight"));
    const struct tdm_tensor *t;
    assert_int_equal(tdm_st_get(st, "model.layers.1.self_attn.q_proj.weight", 2,
                                (int64_t[]){64, 64}, &t, err, sizeof err),
                     TDM_OK);
    assert_int_equal(t->dtype, TDM_DTYPE_BF16);
    tdm_st_free(st);
    check_tokenizer(dir, 512);
    tdm_mkmodel_remove(dir);
}

static void test_llama_and_seed(void **state)
{
    (void)state;
    char a[] = "/tmp/tdm_mkmodel_aXXXXXX", b[] = "/tmp/tdm_mkmodel_bXXXXXX";
    char err[256];
    struct tdm_mkmodel_spec s;
    assert_non_null(mkdtemp(a));
    assert_non_null(mkdtemp(b));
    tdm_mkmodel_preset(&s, "tiny");
    s.arch = TDM_ARCH_LLAMA;
    s.tie_word_embeddings = false;
    s.rope_llama3 = true;
    s.head_dim = 32;
    s.vocab_size = 1000;
    s.dtype = TDM_DTYPE_F32;
    s.seed = 5;
    assert_int_equal(tdm_mkmodel_write(&s, a, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_mkmodel_write(&s, b, err, sizeof err), TDM_OK);

    struct tdm_model_config c;
    assert_int_equal(tdm_hf_config_load(&c, a, err, sizeof err), TDM_OK);
    assert_int_equal(c.arch, TDM_ARCH_LLAMA);
    assert_int_equal(c.head_dim, 32);
    assert_false(c.attention_bias);
    assert_false(c.tie_word_embeddings);
    assert_int_equal(c.rope_scaling.type, TDM_ROPE_LLAMA3);
    assert_int_equal(c.rope_scaling.original_max_position_embeddings, 8192);

    // Same seed: identical bytes; another seed: different weights.
    char pa[128], pb[128];
    char *da, *db;
    size_t la, lb;
    snprintf(pa, sizeof pa, "%s/model.safetensors", a);
    snprintf(pb, sizeof pb, "%s/model.safetensors", b);
    assert_int_equal(tdm_read_file(pa, &da, &la, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_read_file(pb, &db, &lb, err, sizeof err), TDM_OK);
    assert_int_equal(la, lb);
    assert_memory_equal(da, db, la);
    free(db);
    s.seed = 6;
    assert_int_equal(tdm_mkmodel_write(&s, b, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_read_file(pb, &db, &lb, err, sizeof err), TDM_OK);
    assert_int_equal(la, lb);
    assert_memory_not_equal(da, db, la);
    free(da);
    free(db);
    check_tokenizer(a, 1000);
    tdm_mkmodel_remove(a);
    tdm_mkmodel_remove(b);
}

static void test_tokenizer_sizes(void **state)
{
    (void)state;
    static const int sizes[] = {259, 300, 4000};
    char err[256];
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        char dir[] = "/tmp/tdm_mkmodel_tokXXXXXX";
        assert_non_null(mkdtemp(dir));
        assert_int_equal(tdm_mkmodel_write_tokenizer(sizes[i], dir, err, sizeof err), TDM_OK);
        check_tokenizer(dir, sizes[i]);
        tdm_mkmodel_remove(dir);
    }
    assert_int_equal(tdm_mkmodel_write_tokenizer(258, "/tmp", err, sizeof err), TDM_EINVAL);
}

static void test_validation(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_OK);
    s.num_kv_heads = 3;
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "num_kv_heads=3"));
    tdm_mkmodel_preset(&s, "tiny");
    s.vocab_size = 100;
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_EINVAL);
    tdm_mkmodel_preset(&s, "tiny");
    s.head_dim = 7;
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_mkmodel_preset(&s, "no-such-preset"), TDM_EINVAL);
    assert_int_equal(tdm_mkmodel_preset(&s, "qwen2.5-0.5b"), TDM_OK);
    assert_int_equal(s.vocab_size, 151936);
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_OK);
    // "demo" is tandem up's default model (its shapes and seed define the
    // cached demo folder: changing them changes every demo's weights).
    assert_int_equal(tdm_mkmodel_preset(&s, "demo"), TDM_OK);
    assert_int_equal(s.hidden_size, 256);
    assert_int_equal(s.num_layers, 4);
    assert_int_equal(s.vocab_size, 4096);
    assert_true(s.seed == 20261202);
    assert_int_equal(tdm_mkmodel_validate(&s, err, sizeof err), TDM_OK);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tiny_folder),
        cmocka_unit_test(test_llama_and_seed),
        cmocka_unit_test(test_tokenizer_sizes),
        cmocka_unit_test(test_validation),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
