// SPDX-License-Identifier: Apache-2.0
// Tests for config.json / generation_config.json parsing: the real Qwen2.5-0.5B
// files from shared/ (skipped when absent), inline Llama 2 and Llama 3 configs,
// every validation error (code and message), and the vLLM-style resolution of
// sampling defaults.
#include "hf.h"

#include "core.h"

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_skip.h"

#define QWEN_DIR TANDEM_SHARED_DIR "/models/qwen2-tokenizer"

static bool have_dir(const char *dir)
{
    struct stat sb;
    return stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode);
}

static int parse(struct tdm_model_config *cfg, const char *json, char *err, size_t errlen)
{
    return tdm_hf_config_parse(cfg, json, strlen(json), err, errlen);
}

// ---- real file -----------------------------------------------------------------------

static void test_qwen_real(void **state)
{
    (void)state;
    if (!have_dir(QWEN_DIR))
        TDM_SKIP("%s is absent (../shared)", QWEN_DIR);
    struct tdm_model_config cfg;
    char err[256] = "";
    assert_int_equal(tdm_hf_config_load(&cfg, QWEN_DIR, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.arch, TDM_ARCH_QWEN2);
    assert_string_equal(cfg.architecture, "Qwen2ForCausalLM");
    assert_int_equal(cfg.hidden_size, 896);
    assert_int_equal(cfg.intermediate_size, 4864);
    assert_int_equal(cfg.num_hidden_layers, 24);
    assert_int_equal(cfg.num_attention_heads, 14);
    assert_int_equal(cfg.num_key_value_heads, 2);
    assert_int_equal(cfg.head_dim, 64);
    assert_int_equal(cfg.vocab_size, 151936);
    assert_int_equal(cfg.max_position_embeddings, 32768);
    assert_true(cfg.rms_norm_eps == 1e-6f);
    assert_true(cfg.rope_theta == 1000000.0);
    assert_int_equal(cfg.rope_scaling.type, TDM_ROPE_DEFAULT);
    assert_true(cfg.tie_word_embeddings);
    assert_true(cfg.attention_bias);
    assert_false(cfg.use_sliding_window);
    assert_int_equal(cfg.sliding_window, 0); // use_sliding_window false: no window
    assert_int_equal(cfg.max_window_layers, 21);
    assert_int_equal(cfg.bos_token_id, 151643);
    assert_int_equal(cfg.num_eos_token_ids, 1);
    assert_int_equal(cfg.eos_token_ids[0], 151645);
    assert_int_equal(cfg.torch_dtype, TDM_DTYPE_F32);
}

static void test_qwen_generation_real(void **state)
{
    (void)state;
    if (!have_dir(QWEN_DIR))
        TDM_SKIP("%s is absent (../shared)", QWEN_DIR);
    struct tdm_generation_config gc;
    char err[256] = "";
    assert_int_equal(tdm_hf_generation_config_load(&gc, QWEN_DIR, err, sizeof(err)), TDM_OK);
    assert_true(gc.do_sample);
    assert_true(gc.has_temperature);
    assert_true(gc.temperature == 0.7f);
    assert_true(gc.has_top_p);
    assert_true(gc.top_p == 0.8f);
    assert_true(gc.has_top_k);
    assert_int_equal(gc.top_k, 20);
    assert_true(gc.has_repetition_penalty);
    assert_true(gc.repetition_penalty == 1.1f);
    assert_false(gc.has_min_p);
    assert_false(gc.has_max_new_tokens);
    assert_int_equal(gc.num_eos_token_ids, 2);
    assert_int_equal(gc.eos_token_ids[0], 151645);
    assert_int_equal(gc.eos_token_ids[1], 151643);
    assert_int_equal(gc.pad_token_id, 151643);
    assert_int_equal(gc.bos_token_id, 151643);
}

// ---- inline Llama configs ---------------------------------------------------------------

static const char *llama2_7b =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"bos_token_id\": 1, \"eos_token_id\": 2,"
    " \"hidden_act\": \"silu\", \"hidden_size\": 4096, \"initializer_range\": 0.02,"
    " \"intermediate_size\": 11008, \"max_position_embeddings\": 4096, \"model_type\": \"llama\","
    " \"num_attention_heads\": 32, \"num_hidden_layers\": 32, \"num_key_value_heads\": 32,"
    " \"pretraining_tp\": 1, \"rms_norm_eps\": 1e-05, \"rope_scaling\": null,"
    " \"tie_word_embeddings\": false, \"torch_dtype\": \"float16\","
    " \"transformers_version\": \"4.31.0.dev0\", \"use_cache\": true, \"vocab_size\": 32000}";

static const char *llama31_8b =
    "{\"architectures\": [\"LlamaForCausalLM\"], \"attention_bias\": false,"
    " \"attention_dropout\": 0.0, \"bos_token_id\": 128000,"
    " \"eos_token_id\": [128001, 128008, 128009], \"hidden_act\": \"silu\","
    " \"hidden_size\": 4096, \"initializer_range\": 0.02, \"intermediate_size\": 14336,"
    " \"max_position_embeddings\": 131072, \"mlp_bias\": false, \"model_type\": \"llama\","
    " \"num_attention_heads\": 32, \"num_hidden_layers\": 32, \"num_key_value_heads\": 8,"
    " \"pretraining_tp\": 1, \"rms_norm_eps\": 1e-05,"
    " \"rope_scaling\": {\"factor\": 8.0, \"low_freq_factor\": 1.0, \"high_freq_factor\": 4.0,"
    " \"original_max_position_embeddings\": 8192, \"rope_type\": \"llama3\"},"
    " \"rope_theta\": 500000.0, \"tie_word_embeddings\": false, \"torch_dtype\": \"bfloat16\","
    " \"transformers_version\": \"4.43.0.dev0\", \"use_cache\": true, \"vocab_size\": 128256}";

static void test_llama2(void **state)
{
    (void)state;
    struct tdm_model_config cfg;
    char err[256] = "";
    assert_int_equal(parse(&cfg, llama2_7b, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.arch, TDM_ARCH_LLAMA);
    assert_string_equal(cfg.architecture, "LlamaForCausalLM");
    assert_int_equal(cfg.hidden_size, 4096);
    assert_int_equal(cfg.intermediate_size, 11008);
    assert_int_equal(cfg.num_hidden_layers, 32);
    assert_int_equal(cfg.num_attention_heads, 32);
    assert_int_equal(cfg.num_key_value_heads, 32);
    assert_int_equal(cfg.head_dim, 128);
    assert_int_equal(cfg.vocab_size, 32000);
    assert_int_equal(cfg.max_position_embeddings, 4096);
    assert_true(cfg.rms_norm_eps == 1e-5f);
    assert_true(cfg.rope_theta == 10000.0); // default
    assert_int_equal(cfg.rope_scaling.type, TDM_ROPE_DEFAULT);
    assert_false(cfg.tie_word_embeddings);
    assert_false(cfg.attention_bias);
    assert_false(cfg.use_sliding_window);
    assert_int_equal(cfg.sliding_window, 0);
    assert_int_equal(cfg.max_window_layers, 0);
    assert_int_equal(cfg.bos_token_id, 1);
    assert_int_equal(cfg.num_eos_token_ids, 1);
    assert_int_equal(cfg.eos_token_ids[0], 2);
    assert_int_equal(cfg.torch_dtype, TDM_DTYPE_F16);
}

static void test_llama3(void **state)
{
    (void)state;
    struct tdm_model_config cfg;
    char err[256] = "";
    assert_int_equal(parse(&cfg, llama31_8b, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.arch, TDM_ARCH_LLAMA);
    assert_int_equal(cfg.num_key_value_heads, 8);
    assert_int_equal(cfg.head_dim, 128);
    assert_int_equal(cfg.vocab_size, 128256);
    assert_true(cfg.rope_theta == 500000.0);
    assert_int_equal(cfg.rope_scaling.type, TDM_ROPE_LLAMA3);
    assert_true(cfg.rope_scaling.factor == 8.0f);
    assert_true(cfg.rope_scaling.low_freq_factor == 1.0f);
    assert_true(cfg.rope_scaling.high_freq_factor == 4.0f);
    assert_int_equal(cfg.rope_scaling.original_max_position_embeddings, 8192);
    assert_int_equal(cfg.bos_token_id, 128000);
    assert_int_equal(cfg.num_eos_token_ids, 3);
    assert_int_equal(cfg.eos_token_ids[0], 128001);
    assert_int_equal(cfg.eos_token_ids[1], 128008);
    assert_int_equal(cfg.eos_token_ids[2], 128009);
    assert_int_equal(cfg.torch_dtype, TDM_DTYPE_BF16);
    assert_false(cfg.attention_bias);
}

// Llama 3.2 1B style: "type" instead of "rope_type", explicit head_dim, tied embeddings,
// "dtype" (transformers >= 4.56) instead of torch_dtype, attention_bias true.
static void test_llama_variants(void **state)
{
    (void)state;
    struct tdm_model_config cfg;
    char err[256] = "";
    const char *j =
        "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":2048,\"intermediate_size\":8192,"
        "\"num_hidden_layers\":16,\"num_attention_heads\":32,\"num_key_value_heads\":8,"
        "\"head_dim\":64,\"vocab_size\":128256,\"rope_theta\":500000.0,"
        "\"rope_scaling\":{\"type\":\"llama3\",\"factor\":32.0,\"low_freq_factor\":1.0,"
        "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192},"
        "\"tie_word_embeddings\":true,\"attention_bias\":true,\"dtype\":\"float32\","
        "\"torch_dtype\":\"bfloat16\",\"bos_token_id\":null,\"eos_token_id\":null}";
    assert_int_equal(parse(&cfg, j, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.head_dim, 64);
    assert_true(cfg.tie_word_embeddings);
    assert_true(cfg.attention_bias);
    assert_int_equal(cfg.torch_dtype, TDM_DTYPE_F32); // "dtype" wins
    assert_int_equal(cfg.rope_scaling.type, TDM_ROPE_LLAMA3);
    assert_true(cfg.rope_scaling.factor == 32.0f);
    assert_int_equal(cfg.bos_token_id, -1);
    assert_int_equal(cfg.num_eos_token_ids, 0);
    assert_int_equal(cfg.max_position_embeddings, 2048); // LlamaConfig default

    // head_dim given and hidden_size not divisible by heads: fine (head_dim wins).
    const char *j2 = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":100,"
                     "\"intermediate_size\":8,\"num_hidden_layers\":1,\"num_attention_heads\":3,"
                     "\"head_dim\":32,\"vocab_size\":10}";
    assert_int_equal(parse(&cfg, j2, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.head_dim, 32);
    assert_int_equal(cfg.num_key_value_heads, 3);

    // rope_parameters (transformers v5 layout) with rope_theta inside.
    const char *j3 = "{\"architectures\":[\"LlamaForCausalLM\"],\"hidden_size\":64,"
                     "\"intermediate_size\":8,\"num_hidden_layers\":1,\"num_attention_heads\":2,"
                     "\"vocab_size\":10,\"rope_parameters\":{\"rope_type\":\"default\","
                     "\"rope_theta\":250000.0}}";
    assert_int_equal(parse(&cfg, j3, err, sizeof(err)), TDM_OK);
    assert_true(cfg.rope_theta == 250000.0);
    assert_int_equal(cfg.rope_scaling.type, TDM_ROPE_DEFAULT);
}

// No architectures: model_type decides. Qwen2 defaults: sliding window, bias, eps.
static void test_model_type_only(void **state)
{
    (void)state;
    struct tdm_model_config cfg;
    char err[256] = "";
    const char *q = "{\"model_type\":\"qwen2\",\"hidden_size\":64,\"intermediate_size\":128,"
                    "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                    "\"use_sliding_window\":true,\"sliding_window\":4096}";
    assert_int_equal(parse(&cfg, q, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.arch, TDM_ARCH_QWEN2);
    assert_string_equal(cfg.architecture, "Qwen2ForCausalLM");
    assert_true(cfg.attention_bias);
    assert_false(cfg.tie_word_embeddings); // Qwen2Config default
    assert_true(cfg.use_sliding_window);
    assert_int_equal(cfg.sliding_window, 4096);
    assert_int_equal(cfg.max_window_layers, 28);
    assert_int_equal(cfg.max_position_embeddings, 32768);
    assert_int_equal(cfg.num_key_value_heads, 4);
    assert_int_equal(cfg.head_dim, 16);
    assert_true(cfg.rms_norm_eps == 1e-6f);
    assert_true(cfg.rope_theta == 10000.0);
    assert_int_equal(cfg.torch_dtype, TDM_DTYPE_BF16);
    assert_int_equal(cfg.bos_token_id, -1);

    const char *l = "{\"model_type\":\"llama\",\"hidden_size\":64,\"intermediate_size\":128,"
                    "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"vocab_size\":100,"
                    "\"architectures\":null}";
    assert_int_equal(parse(&cfg, l, err, sizeof(err)), TDM_OK);
    assert_int_equal(cfg.arch, TDM_ARCH_LLAMA);
    assert_string_equal(cfg.architecture, "LlamaForCausalLM");
    assert_false(cfg.attention_bias);
}

// ---- errors --------------------------------------------------------------------------------

// A small valid Llama config with one field replaced: FIELD is the key, VALUE the
// JSON text to put there (or NULL to drop the key).
static char *llama_with(const char *key, const char *value)
{
    static const char *keys[] = {"architectures",     "hidden_size",         "intermediate_size",
                                 "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "vocab_size",        "rms_norm_eps"};
    static const char *vals[] = {
        "[\"LlamaForCausalLM\"]", "896", "4864", "2", "14", "2", "1000", "1e-6"};
    size_t cap = 4096, at = 0;
    char *s = malloc(cap);
    at += (size_t)snprintf(s + at, cap - at, "{");
    bool used = false;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        const char *v = vals[i];
        if (strcmp(keys[i], key) == 0) {
            used = true;
            v = value;
        }
        if (v)
            at += (size_t)snprintf(s + at, cap - at, "%s\"%s\":%s", at > 1 ? "," : "", keys[i], v);
    }
    if (!used && value)
        at += (size_t)snprintf(s + at, cap - at, ",\"%s\":%s", key, value);
    snprintf(s + at, cap - at, "}");
    return s;
}

static void expect_error(const char *key, const char *value, int code, const char *msg)
{
    char *json = llama_with(key, value);
    struct tdm_model_config cfg;
    char err[512] = "";
    int rc = parse(&cfg, json, err, sizeof(err));
    if (rc != code || !strstr(err, msg)) {
        print_error("json: %s\n rc=%d (want %d) err=\"%s\" (want substring \"%s\")\n", json, rc,
                    code, err, msg);
        free(json);
        fail();
    }
    free(json);
}

static void test_config_errors(void **state)
{
    (void)state;
    // the base is valid
    char *base = llama_with("", NULL);
    struct tdm_model_config cfg;
    char err[512] = "";
    assert_int_equal(parse(&cfg, base, err, sizeof(err)), TDM_OK);
    free(base);

    expect_error("num_key_value_heads", "3", TDM_EINVAL,
                 "config.json: num_key_value_heads=3 does not divide num_attention_heads=14");
    expect_error("num_key_value_heads", "28", TDM_EINVAL, "does not divide");
    expect_error("hidden_size", NULL, TDM_EINVAL,
                 "config.json: missing required field \"hidden_size\"");
    expect_error("intermediate_size", NULL, TDM_EINVAL,
                 "missing required field \"intermediate_size\"");
    expect_error("num_hidden_layers", NULL, TDM_EINVAL,
                 "missing required field \"num_hidden_layers\"");
    expect_error("num_attention_heads", NULL, TDM_EINVAL,
                 "missing required field \"num_attention_heads\"");
    expect_error("vocab_size", NULL, TDM_EINVAL, "missing required field \"vocab_size\"");
    expect_error("vocab_size", "null", TDM_EINVAL, "missing required field \"vocab_size\"");
    expect_error("hidden_size", "\"896\"", TDM_EINVAL,
                 "config.json: hidden_size must be a positive integer, got \"896\"");
    expect_error("hidden_size", "0", TDM_EINVAL, "hidden_size must be a positive integer, got 0");
    expect_error("hidden_size", "-896", TDM_EINVAL,
                 "hidden_size must be a positive integer, got -896");
    expect_error("hidden_size", "896.5", TDM_EINVAL,
                 "hidden_size must be a positive integer, got 896.5");
    expect_error("hidden_size", "1e12", TDM_EINVAL, "hidden_size must be a positive integer");
    expect_error("hidden_size", "true", TDM_EINVAL,
                 "hidden_size must be a positive integer, got true");
    expect_error("num_hidden_layers", "[2]", TDM_EINVAL,
                 "num_hidden_layers must be a positive integer, got [2]");
    expect_error("intermediate_size", "-1", TDM_EINVAL,
                 "intermediate_size must be a positive integer");
    expect_error("vocab_size", "0", TDM_EINVAL, "vocab_size must be a positive integer");
    expect_error("num_key_value_heads", "0", TDM_EINVAL,
                 "num_key_value_heads must be a positive integer");
    expect_error("num_attention_heads", "0", TDM_EINVAL,
                 "num_attention_heads must be a positive integer");
    expect_error("max_position_embeddings", "-5", TDM_EINVAL,
                 "max_position_embeddings must be a positive integer");
    expect_error("head_dim", "63", TDM_EINVAL, "config.json: head_dim=63 must be even");
    expect_error("head_dim", "0", TDM_EINVAL, "head_dim must be a positive integer");
    expect_error("hidden_size", "900", TDM_EINVAL,
                 "config.json: hidden_size=900 is not divisible by num_attention_heads=14");
    // 14 heads x 896/14 = 64: odd head_dim through division
    expect_error("hidden_size", "14 , \"head_dim\": null", TDM_EINVAL, "head_dim=1 must be even");
    expect_error("architectures", "[\"MistralForCausalLM\"]", TDM_EINVAL,
                 "config.json: unsupported architecture \"MistralForCausalLM\"");
    expect_error("architectures", "\"LlamaForCausalLM\"", TDM_EINVAL,
                 "architectures must be a list of strings, got \"LlamaForCausalLM\"");
    expect_error("architectures", "[3]", TDM_EINVAL, "architectures must be a list of strings");
    expect_error("architectures", NULL, TDM_EINVAL, "missing required field \"architectures\"");
    expect_error("architectures", "[], \"model_type\": \"mistral\"", TDM_EINVAL,
                 "unsupported model_type \"mistral\"");
    expect_error("rms_norm_eps", "0", TDM_EINVAL, "rms_norm_eps must be a positive number, got 0");
    expect_error("rms_norm_eps", "\"1e-6\"", TDM_EINVAL, "rms_norm_eps must be a positive number");
    expect_error("rope_theta", "-1", TDM_EINVAL, "rope_theta must be a positive number");
    expect_error("rope_scaling", "{\"type\":\"linear\",\"factor\":2.0}", TDM_EINVAL,
                 "config.json: unsupported rope scaling type \"linear\"");
    expect_error("rope_scaling", "{\"rope_type\":\"yarn\",\"factor\":4.0}", TDM_EINVAL,
                 "unsupported rope scaling type \"yarn\"");
    expect_error("rope_scaling", "{\"rope_type\":\"dynamic\",\"factor\":2.0}", TDM_EINVAL,
                 "unsupported rope scaling type \"dynamic\"");
    expect_error("rope_scaling", "{\"factor\":2.0}", TDM_EINVAL,
                 "rope_scaling has no \"rope_type\"");
    expect_error("rope_scaling", "[1]", TDM_EINVAL, "rope_scaling must be an object or null");
    expect_error("rope_scaling",
                 "{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":1.0,"
                 "\"high_freq_factor\":4.0}",
                 TDM_EINVAL, "rope_scaling.original_max_position_embeddings");
    expect_error("rope_scaling",
                 "{\"rope_type\":\"llama3\",\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,"
                 "\"original_max_position_embeddings\":8192}",
                 TDM_EINVAL, "missing required field \"rope_scaling.factor\"");
    expect_error("rope_scaling",
                 "{\"rope_type\":\"llama3\",\"factor\":8.0,\"low_freq_factor\":4.0,"
                 "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}",
                 TDM_EINVAL, "high_freq_factor=4 must be greater than low_freq_factor=4");
    expect_error("rope_scaling",
                 "{\"rope_type\":\"llama3\",\"factor\":-8.0,\"low_freq_factor\":1.0,"
                 "\"high_freq_factor\":4.0,\"original_max_position_embeddings\":8192}",
                 TDM_EINVAL, "rope_scaling.factor must be a positive number");
    expect_error("tie_word_embeddings", "1", TDM_EINVAL,
                 "tie_word_embeddings must be true or false, got 1");
    expect_error("attention_bias", "\"yes\"", TDM_EINVAL, "attention_bias must be true or false");
    expect_error("mlp_bias", "true", TDM_EINVAL, "mlp_bias=true is not supported");
    expect_error("hidden_act", "\"gelu\"", TDM_EINVAL, "unsupported hidden_act \"gelu\"");
    expect_error("use_sliding_window", "true", TDM_EINVAL,
                 "missing required field \"sliding_window\"");
    expect_error("use_sliding_window", "true, \"sliding_window\": -4", TDM_EINVAL,
                 "sliding_window must be a positive integer");
    expect_error("max_window_layers", "-1", TDM_EINVAL,
                 "max_window_layers must be a non-negative integer");
    expect_error("eos_token_id", "\"</s>\"", TDM_EINVAL,
                 "eos_token_id must be a non-negative integer or a list of them");
    expect_error("eos_token_id", "[1, -2]", TDM_EINVAL,
                 "eos_token_id must be a non-negative integer");
    expect_error("eos_token_id", "[1,2,3,4,5,6,7,8,9]", TDM_EINVAL,
                 "eos_token_id lists more than 8 ids");
    expect_error("eos_token_id", "1000", TDM_EINVAL,
                 "eos_token_id=1000 is not below vocab_size=1000");
    expect_error("bos_token_id", "5000", TDM_EINVAL,
                 "bos_token_id=5000 is not below vocab_size=1000");
    expect_error("torch_dtype", "\"int8\"", TDM_EINVAL, "unsupported torch_dtype \"int8\"");
    expect_error("dtype", "\"float64\"", TDM_EINVAL, "unsupported dtype \"float64\"");
    expect_error("torch_dtype", "16", TDM_EINVAL, "torch_dtype must be a string, got 16");
}

static void test_config_bad_json(void **state)
{
    (void)state;
    struct tdm_model_config cfg;
    char err[256] = "";
    assert_int_equal(parse(&cfg, "{\"hidden_size\": 896,", err, sizeof(err)), TDM_EPROTO);
    assert_non_null(strstr(err, "config.json: not valid JSON"));
    assert_int_equal(parse(&cfg, "[1,2]", err, sizeof(err)), TDM_EPROTO);
    assert_non_null(strstr(err, "config.json: top level is not a JSON object"));
    assert_int_equal(parse(&cfg, "", err, sizeof(err)), TDM_EPROTO);
    assert_int_equal(parse(&cfg, "{} {}", err, sizeof(err)), TDM_EPROTO);
    assert_non_null(strstr(err, "trailing data"));
    // nesting past TDM_JSON_MAX_DEPTH is refused before cJSON recurses into it
    char deep[4096] = "{\"a\":";
    size_t at = strlen(deep);
    memset(deep + at, '[', 3000);
    memset(deep + at + 3000, ']', 3000 - 2000); // unbalanced on purpose: never parsed
    assert_int_equal(parse(&cfg, deep, err, sizeof(err)), TDM_EPROTO);
    assert_non_null(strstr(err, "config.json: JSON nests deeper than 128 levels"));
    // length is honoured: the text after len is not read
    const char *t = "{\"model_type\":\"llama\"}garbage";
    assert_int_equal(tdm_hf_config_parse(&cfg, t, 22, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, "missing required field \"hidden_size\""));
    // missing file
    assert_int_equal(tdm_hf_config_load(&cfg, "/nonexistent-tandem-dir", err, sizeof(err)),
                     TDM_ENOTFOUND);
    assert_non_null(strstr(err, "/nonexistent-tandem-dir/config.json"));
}

// ---- generation_config -----------------------------------------------------------------------

static void test_generation_parse(void **state)
{
    (void)state;
    struct tdm_generation_config gc;
    char err[256] = "";
    const char *j = "{\"bos_token_id\": 128000, \"do_sample\": true,"
                    " \"eos_token_id\": [128001, 128008, 128009], \"temperature\": 0.6,"
                    " \"top_p\": 0.9, \"min_p\": 0.05, \"max_new_tokens\": 256,"
                    " \"pad_token_id\": null, \"transformers_version\": \"4.43.0.dev0\"}";
    assert_int_equal(tdm_hf_generation_config_parse(&gc, j, strlen(j), err, sizeof(err)), TDM_OK);
    assert_true(gc.has_temperature && gc.temperature == 0.6f);
    assert_true(gc.has_top_p && gc.top_p == 0.9f);
    assert_false(gc.has_top_k);
    assert_true(gc.has_min_p && gc.min_p == 0.05f);
    assert_false(gc.has_repetition_penalty);
    assert_true(gc.has_max_new_tokens && gc.max_new_tokens == 256);
    assert_true(gc.do_sample);
    assert_int_equal(gc.num_eos_token_ids, 3);
    assert_int_equal(gc.eos_token_ids[2], 128009);
    assert_int_equal(gc.pad_token_id, -1);
    assert_int_equal(gc.bos_token_id, 128000);

    const char *e = "{\"eos_token_id\": 2}";
    assert_int_equal(tdm_hf_generation_config_parse(&gc, e, strlen(e), err, sizeof(err)), TDM_OK);
    assert_false(gc.has_temperature || gc.has_top_p || gc.has_top_k || gc.has_min_p ||
                 gc.has_repetition_penalty || gc.has_max_new_tokens || gc.do_sample);
    assert_int_equal(gc.num_eos_token_ids, 1);
    assert_int_equal(gc.eos_token_ids[0], 2);

    static const struct {
        const char *json, *msg;
        int code;
    } bad[] = {
        {"{\"temperature\": -0.5}",
         "generation_config.json: temperature must be a non-negative number, got -0.5", TDM_EINVAL},
        {"{\"temperature\": \"hot\"}", "temperature must be a non-negative number", TDM_EINVAL},
        {"{\"top_p\": 0}", "top_p must be a number in (0, 1], got 0", TDM_EINVAL},
        {"{\"top_p\": 1.5}", "top_p must be a number in (0, 1]", TDM_EINVAL},
        {"{\"top_k\": -2}", "top_k must be an integer >= -1, got -2", TDM_EINVAL},
        {"{\"top_k\": 2.5}", "top_k must be an integer >= -1", TDM_EINVAL},
        {"{\"min_p\": 2}", "min_p must be a number in [0, 1]", TDM_EINVAL},
        {"{\"repetition_penalty\": 0}", "repetition_penalty must be a positive number", TDM_EINVAL},
        {"{\"max_new_tokens\": 0}", "max_new_tokens must be a positive integer, got 0", TDM_EINVAL},
        {"{\"do_sample\": \"yes\"}", "do_sample must be true or false", TDM_EINVAL},
        {"{\"eos_token_id\": [1, \"x\"]}", "eos_token_id must be a non-negative integer or a list",
         TDM_EINVAL},
        {"{\"pad_token_id\": -1}", "pad_token_id must be a non-negative integer", TDM_EINVAL},
        {"{\"temperature\": 0.5", "generation_config.json: not valid JSON", TDM_EPROTO},
        {"7", "generation_config.json: top level is not a JSON object", TDM_EPROTO},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int rc =
            tdm_hf_generation_config_parse(&gc, bad[i].json, strlen(bad[i].json), err, sizeof(err));
        if (rc != bad[i].code || !strstr(err, bad[i].msg)) {
            print_error("%s: rc=%d err=\"%s\" want \"%s\"\n", bad[i].json, rc, err, bad[i].msg);
            fail();
        }
        assert_false(gc.has_temperature); // cleared on failure
    }
}

static void test_generation_missing_file(void **state)
{
    (void)state;
    char dir[] = "/tmp/tdm_hf_gen_XXXXXX";
    assert_non_null(mkdtemp(dir));
    struct tdm_generation_config gc;
    char err[256] = "stale";
    gc.has_temperature = true;
    assert_int_equal(tdm_hf_generation_config_load(&gc, dir, err, sizeof(err)), TDM_OK);
    assert_false(gc.has_temperature || gc.has_top_p || gc.has_top_k || gc.has_min_p ||
                 gc.has_repetition_penalty || gc.has_max_new_tokens);
    assert_int_equal(gc.num_eos_token_ids, 0);
    assert_int_equal(gc.pad_token_id, -1);
    assert_int_equal(gc.bos_token_id, -1);
    // a broken file is an error, not "missing"
    char path[128];
    snprintf(path, sizeof(path), "%s/generation_config.json", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("{\"top_k\": \"twenty\"}", f);
    fclose(f);
    assert_int_equal(tdm_hf_generation_config_load(&gc, dir, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, "top_k must be an integer >= -1, got \"twenty\""));
    unlink(path);
    rmdir(dir);
}

static void test_sampling_resolve(void **state)
{
    (void)state;
    struct tdm_sampling_resolved r;
    // nothing anywhere: vLLM fallbacks
    tdm_hf_sampling_resolve(NULL, NULL, 0, &r);
    assert_true(r.temperature == 1.0f && r.top_p == 1.0f && r.min_p == 0.0f &&
                r.repetition_penalty == 1.0f);
    assert_int_equal(r.top_k, 0);
    assert_int_equal(r.max_tokens, -1);

    struct tdm_generation_config gc;
    char err[128];
    const char *j = "{\"temperature\":0.7,\"top_p\":0.8,\"top_k\":20,\"repetition_penalty\":1.1,"
                    "\"max_new_tokens\":100}";
    assert_int_equal(tdm_hf_generation_config_parse(&gc, j, strlen(j), err, sizeof(err)), TDM_OK);
    // file values fill what the request leaves out
    float temp = 0.0f;
    int top_k = -1, max_tokens = 500;
    struct tdm_sampling_request req = {
        .temperature = &temp, .top_k = &top_k, .max_tokens = &max_tokens};
    tdm_hf_sampling_resolve(&gc, &req, 4000, &r);
    assert_true(r.temperature == 0.0f); // request wins, even 0
    assert_true(r.top_p == 0.8f);
    assert_int_equal(r.top_k, 0); // request -1 = off
    assert_true(r.repetition_penalty == 1.1f);
    assert_true(r.min_p == 0.0f);
    assert_int_equal(r.max_tokens, 100); // min(500, file 100, limit 4000)
    tdm_hf_sampling_resolve(&gc, NULL, 50, &r);
    assert_int_equal(r.top_k, 20);
    assert_true(r.temperature == 0.7f);
    assert_int_equal(r.max_tokens, 50); // context limit
    // a file top_k of 50 is transformers' default: vLLM drops it
    const char *k50 = "{\"top_k\":50}";
    assert_int_equal(tdm_hf_generation_config_parse(&gc, k50, strlen(k50), err, sizeof(err)),
                     TDM_OK);
    tdm_hf_sampling_resolve(&gc, NULL, 0, &r);
    assert_int_equal(r.top_k, 0);
    top_k = 50;
    req = (struct tdm_sampling_request){.top_k = &top_k};
    tdm_hf_sampling_resolve(&gc, &req, 0, &r);
    assert_int_equal(r.top_k, 50); // but a request's 50 stands
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen_real),        cmocka_unit_test(test_qwen_generation_real),
        cmocka_unit_test(test_llama2),           cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_llama_variants),   cmocka_unit_test(test_model_type_only),
        cmocka_unit_test(test_config_errors),    cmocka_unit_test(test_config_bad_json),
        cmocka_unit_test(test_generation_parse), cmocka_unit_test(test_generation_missing_file),
        cmocka_unit_test(test_sampling_resolve),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, NULL, NULL));
}
