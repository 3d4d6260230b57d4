// SPDX-License-Identifier: Apache-2.0
// worker_config_test: the flag and config-file parser of the worker base
// (defaults, every value kind, suffixes, file/flag precedence, error
// messages with file:line). The server's lifecycle and routes are
// worker_test's; requests end to end the Python integration tests'
// (integration-tests/).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "backend_module.h"
#include "core.h"
#include "kvx.h"
#include "model.h" // enum tdm_batch_invariance
#include "worker.h"

static int parse(struct tdm_worker_config *c, char *err, size_t errlen, int argc, ...)
{
    char *argv[32];
    va_list ap;
    va_start(ap, argc);
    argv[0] = "tandem-decode";
    for (int i = 1; i < argc; i++)
        argv[i] = va_arg(ap, char *);
    va_end(ap);
    tdm_worker_config_default(c);
    return tdm_worker_config_parse_args(c, argc, argv, err, errlen);
}

static void test_defaults(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 3, "--model", "/m"), TDM_OK);
    assert_string_equal(c.model, "/m");
    assert_string_equal(c.host, "0.0.0.0");
    assert_int_equal(c.port, 8001);
    assert_int_equal(c.block_size, 16);
    assert_true(c.enable_prefix_caching);
    assert_int_equal(c.max_num_seqs, 64);
    assert_int_equal(c.max_num_batched_tokens, 512);
    assert_int_equal(c.kv_cache_memory, (size_t)256 << 20);
    assert_int_equal(c.kv_cache_dtype, TDM_KV_BF16); // auto
    assert_int_equal(c.max_waiting, 1024);
    assert_false(c.int8);
    assert_string_equal(c.api_key, "");
}

// --kv-transfer: auto by default; every name parses where the CUDA backend
// module loads; without it nng and auto only, and it says why for the device
// transports.
static void test_kv_transfer(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[1024];
    assert_int_equal(parse(&c, err, sizeof err, 3, "--model", "/m"), TDM_OK);
    assert_int_equal(c.kv_transfer, TDM_KVX_AUTO);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-transfer", "nng"),
                     TDM_OK);
    assert_int_equal(c.kv_transfer, TDM_KVX_NNG);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--kv-transfer=auto"), TDM_OK);
    assert_int_equal(c.kv_transfer, TDM_KVX_AUTO);
    const struct tdm_kvx_ops *table = NULL;
    bool cuda = tdm_backend_module_kvx(&table, err, sizeof err) == TDM_OK && table != NULL;
    const char *dev[] = {"cuda-ipc", "nccl"};
    enum tdm_kvx_mode want[] = {TDM_KVX_CUDA_IPC, TDM_KVX_NCCL};
    for (int i = 0; i < 2; i++) {
        int rc = parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-transfer", dev[i]);
        if (cuda) {
            assert_int_equal(rc, TDM_OK);
            assert_int_equal(c.kv_transfer, want[i]);
        } else {
            assert_int_equal(rc, TDM_EINVAL);
            char head[64];
            snprintf(head, sizeof head, "--kv-transfer %s needs the CUDA backend module (", dev[i]);
            assert_ptr_equal(strstr(err, head), err);
            assert_non_null(strstr(err, "(libtandem-cuda.so"));
            assert_non_null(strstr(err, "); without it KV moves over nng only: use nng or auto"));
        }
    }
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-transfer", "rdma"),
                     TDM_EINVAL);
    assert_string_equal(err, "--kv-transfer: expected nng, cuda-ipc, nccl or auto, got \"rdma\"");
}

static void test_flags(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 23, "--model", "/m", "--port=0", "--host",
                           "127.0.0.1", "--kv-cache-memory", "2GiB", "--no-enable-prefix-caching",
                           "--max_num_seqs", "8", "--dtype", "int8", "--api-key", "k",
                           "--served-model-name", "Qwen/Qwen2.5-0.5B-Instruct", "--drain-timeout",
                           "2.5", "--block-size", "32", "--max-waiting", "0"),
                     TDM_OK);
    assert_int_equal(c.port, 0);
    assert_string_equal(c.host, "127.0.0.1");
    assert_int_equal(c.kv_cache_memory, (size_t)2 << 30);
    assert_false(c.enable_prefix_caching);
    assert_int_equal(c.max_num_seqs, 8);
    assert_true(c.int8);
    assert_string_equal(c.api_key, "k");
    assert_string_equal(c.served_model_name, "Qwen/Qwen2.5-0.5B-Instruct");
    assert_true(c.drain_timeout == 2.5);
    assert_int_equal(c.block_size, 32);
    assert_int_equal(c.max_waiting, 0);
}

// vLLM's tool flags land in the config; tdm_worker_new refuses a bad pair
// before loading anything.
static void test_tool_flags(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 6, "--model", "/nonexistent-model",
                           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
                     TDM_OK);
    assert_true(c.enable_auto_tool_choice);
    assert_string_equal(c.tool_call_parser, "hermes");
    struct tdm_worker *w = NULL;
    snprintf(c.tool_call_parser, sizeof c.tool_call_parser, "%s", "granite");
    assert_int_equal(tdm_worker_new(&w, &c, err, sizeof err), TDM_EINVAL);
    assert_null(w);
    assert_non_null(strstr(err, "unknown parser \"granite\""));
    c.tool_call_parser[0] = '\0';
    assert_int_equal(tdm_worker_new(&w, &c, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "requires --tool-call-parser"));
}

// `vllm serve` lines from vLLM's and Qwen's docs, with "vllm" replaced by
// tandem-decode (issue 28, item 5): each is accepted, or refused with a message
// saying why (what it does not support and what to do instead).
static void test_vllm_command_lines(void **state)
{
    (void)state;
    static const struct {
        const char *line;
        const char *refusal; // NULL: accepted
    } lines[] = {
        {"vllm serve Qwen/Qwen2.5-7B-Instruct", NULL},
        {"vllm serve facebook/opt-125m --host 0.0.0.0 --port 8080", NULL},
        {"vllm serve mistralai/Mistral-7B-v0.1 --gpu-memory-utilization 0.95 --max-model-len 8192",
         NULL},
        {"vllm serve meta-llama/Llama-2-7b-hf --enable-prefix-caching", NULL},
        {"vllm serve Qwen/Qwen2.5-7B-Instruct --scheduling-policy priority", NULL},
        {"vllm serve Qwen/Qwen2.5-7B-Instruct --enable-auto-tool-choice --tool-call-parser hermes",
         NULL},
        {"vllm serve Qwen/Qwen2.5-7B-Instruct --trust-remote-code --dtype half --max-model-len 32K "
         "--seed 0 --disable-log-requests --disable-log-stats",
         NULL},
        {"vllm serve Qwen/Qwen2.5-7B-Instruct --api-key token-abc123 --max-model-len 4k "
         "--tensor-parallel-size 1 --pipeline-parallel-size 1 --max-num-seqs 16",
         NULL},
        {"vllm serve Qwen/Qwen2.5-VL-72B-Instruct --host 0.0.0.0 --port 8000 "
         "--tensor-parallel-size 4",
         "--tensor-parallel-size 4: not supported: each Tandem worker runs the whole model on one "
         "device; it scales by adding workers"},
        {"vllm serve meta-llama/Llama-2-70b-hf --pipeline-parallel-size 2",
         "--pipeline-parallel-size 2: not supported"},
        {"vllm serve TheBloke/Llama-2-13B-AWQ --quantization awq",
         "--quantization: expected int8 or none, got \"awq\""},
        {"vllm serve Qwen/Qwen2.5-0.5B-Instruct --kv-cache-dtype fp8 --max-model-len 16384",
         "--kv-cache-dtype fp8: fp8 KV is not supported yet"},
        {"vllm serve Qwen/Qwen2.5-0.5B-Instruct --dtype float32",
         "--dtype float32: not supported: Tandem keeps weights in bf16"},
        {"vllm serve Qwen/Qwen2.5-0.5B-Instruct --max-model-len 25.6K", "did you mean 25.6k?"},
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; i++) {
        char buf[512], *argv[32];
        snprintf(buf, sizeof buf, "%s", lines[i].line);
        int argc = 0;
        for (char *w = strtok(buf, " "); w && argc < 32; w = strtok(NULL, " "))
            argv[argc++] = w;
        argv[0] = "tandem-decode"; // "vllm" -> the worker; "serve" stays
        struct tdm_worker_config c;
        char err[512] = "";
        tdm_worker_config_default(&c);
        int rc = tdm_worker_config_parse_args(&c, argc, argv, err, sizeof err);
        if (lines[i].refusal ? rc != TDM_EINVAL || !strstr(err, lines[i].refusal) : rc != TDM_OK)
            fail_msg("%s\n  rc %d: %s", lines[i].line, rc, err);
        if (!lines[i].refusal)
            assert_string_equal(c.model, argv[2]); // the positional model
    }
    // What the accepted flags did.
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 10, "/m", "--max-model-len", "32K", "--seed", "7",
                           "--disable-log-requests", "--trust-remote-code", "--dtype", "half"),
                     TDM_OK);
    assert_string_equal(c.model, "/m");
    assert_int_equal(c.max_model_len, 32768);
    assert_true(c.has_seed && c.seed == 7 && !c.log_requests && c.trust_remote_code);
    assert_int_equal(parse(&c, err, sizeof err, 4, "/m", "--max-model-len", "4k"), TDM_OK);
    assert_int_equal(c.max_model_len, 4000);
    assert_true(c.log_requests && !c.has_seed);
    // The model once: as the argument or --model, not two different ones.
    assert_int_equal(parse(&c, err, sizeof err, 4, "/m", "--model", "/m"), TDM_OK);
    assert_int_equal(parse(&c, err, sizeof err, 4, "/a", "--model", "/b"), TDM_EINVAL);
    assert_non_null(strstr(err, "given twice"));
    assert_int_equal(parse(&c, err, sizeof err, 3, "/a", "/b"), TDM_EINVAL);
    assert_non_null(strstr(err, "unexpected argument \"/b\""));
    assert_int_equal(parse(&c, err, sizeof err, 3, "--seed", "-1"), TDM_EINVAL);
}

static void test_bad_flags(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 3, "--port", "x"), TDM_EINVAL);
    assert_string_equal(err, "--port: expected an integer in [0, 65535], got \"x\"");
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--bogus"), TDM_EINVAL);
    assert_non_null(strstr(err, "--bogus"));
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--port"), TDM_EINVAL);
    assert_int_equal(parse(&c, err, sizeof err, 2, "--port=1"), TDM_EINVAL);
    assert_non_null(strstr(err, "no model: give it as --model DIR|ORG/NAME or as the first"));
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--dtype", "fp8"), TDM_EINVAL);
    assert_non_null(strstr(err, "--quantization int8"));
    // vLLM's split (issue 14): --quantization int8 quantizes, --dtype bfloat16 does not.
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--quantization", "int8"),
                     TDM_OK);
    assert_true(c.int8);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--dtype", "bfloat16"), TDM_OK);
    assert_false(c.int8);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--quantization", "awq"),
                     TDM_EINVAL);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--block-size", "12"),
                     TDM_EINVAL);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-memory", "2QB"),
                     TDM_EINVAL);
    // --kv-cache-dtype: vLLM's flag; auto is bf16, f32 the exact reference.
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-dtype", "f32"),
                     TDM_OK);
    assert_int_equal(c.kv_cache_dtype, TDM_KV_F32);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-dtype", "auto"),
                     TDM_OK);
    assert_int_equal(c.kv_cache_dtype, TDM_KV_BF16);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-dtype", "bf16"),
                     TDM_OK);
    assert_int_equal(c.kv_cache_dtype, TDM_KV_BF16);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-dtype", "fp8"),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "--kv-cache-dtype fp8: fp8 KV is not supported yet"));
    assert_non_null(strstr(err, "supported: auto (bf16), bf16, f32"));
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--kv-cache-dtype", "int4"),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "--kv-cache-dtype: kv cache dtype 'int4': expected auto (bf16)"));
    // --speculative-config: vLLM's JSON, method ngram only, every key checked.
    assert_int_equal(c.spec.num_speculative_tokens, 0); // off by default
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--speculative-config",
                           "{\"method\":\"ngram\",\"num_speculative_tokens\":4,"
                           "\"prompt_lookup_max\":3,\"prompt_lookup_min\":2}"),
                     TDM_OK);
    assert_int_equal(c.spec.num_speculative_tokens, 4);
    assert_int_equal(c.spec.prompt_lookup_max, 3);
    assert_int_equal(c.spec.prompt_lookup_min, 2);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--speculative-config",
                           "{\"method\":\"ngram\",\"num_speculative_tokens\":3}"),
                     TDM_OK);
    assert_int_equal(c.spec.prompt_lookup_max, 5); // vLLM's default window
    assert_int_equal(c.spec.prompt_lookup_min, 5);
    static const char *const bad[][2] = {
        {"{\"method\":\"eagle\",\"num_speculative_tokens\":3}", "method must be \"ngram\""},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":3,\"model\":\"x\"}",
         "unknown key \"model\""},
        {"{\"method\":\"ngram\"}", "num_speculative_tokens is required"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2.5}", "positive integer"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":99}", "[1, 16]"},
        {"{\"method\":\"ngram\",\"num_speculative_tokens\":2,\"prompt_lookup_max\":1,"
         "\"prompt_lookup_min\":3}",
         "prompt_lookup_max"},
        {"ngram", "expected a JSON object"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(
            parse(&c, err, sizeof err, 5, "--model", "/m", "--speculative-config", bad[i][0]),
            TDM_EINVAL);
        if (!strstr(err, "--speculative-config: ") || !strstr(err, bad[i][1]))
            fail_msg("%s: got \"%s\"", bad[i][0], err);
    }
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "stray"), TDM_EINVAL);
    assert_int_equal(parse(&c, err, sizeof err, 2, "--help"), 1);
}

// --device: checked at parse time; asking for a GPU that is not there (or a
// build without CUDA) is a startup error naming the flag.
static void test_device(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--device", "cpu"), TDM_OK);
    assert_string_equal(c.device, "cpu");
    assert_int_equal(parse(&c, err, sizeof err, 3, "--model", "/m"), TDM_OK);
    assert_string_equal(c.device, "");
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--device", "tpu"), TDM_EINVAL);
    assert_string_equal(err, "--device tpu: expected cpu, cuda or cuda:N");
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--device", "cuda:x"),
                     TDM_EINVAL);
    // Here: no CUDA backend in the default build, or no GPU visible in a CUDA build.
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--device", "cuda:63"),
                     TDM_EINVAL);
    assert_true(strstr(err, "no CUDA backend") != NULL || strstr(err, "visible") != NULL);

    // The GPU memory flags (vLLM's names).
    assert_true(c.gpu_memory_utilization == 0.9);
    assert_false(c.enforce_eager);
    assert_true(c.async_scheduling);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--no-async-scheduling"),
                     TDM_OK);
    assert_false(c.async_scheduling);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--async-scheduling"), TDM_OK);
    assert_true(c.async_scheduling);
    // vLLM's --scheduling-policy: fcfs (the default) or priority.
    assert_false(c.priority_scheduling);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--scheduling-policy=priority"),
                     TDM_OK);
    assert_true(c.priority_scheduling);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--scheduling-policy", "fcfs"),
                     TDM_OK);
    assert_false(c.priority_scheduling);
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--scheduling-policy", "lifo"),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "--scheduling-policy: unknown policy \"lifo\" (fcfs or priority)"));
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--enforce-eager"), TDM_OK);
    assert_true(c.enforce_eager);
    // The GEMM mode: neither flag is the model's default; the value forms
    // the config file uses too.
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_DEFAULT);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--no-batch-invariant"),
                     TDM_OK);
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_OFF);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--batch-invariant"), TDM_OK);
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_ON);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--batch-invariant=false"),
                     TDM_OK);
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_OFF);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--no-batch-invariant=no"),
                     TDM_OK);
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_ON);
    assert_int_equal(parse(&c, err, sizeof err, 4, "--model", "/m", "--batch-invariant=maybe"),
                     TDM_EINVAL);
    assert_string_equal(err, "--batch-invariant: expected true or false, got \"maybe\"");
    assert_int_equal(tdm_worker_config_set(&c, "no_batch_invariant", NULL, err, sizeof err),
                     TDM_OK);
    assert_int_equal(c.batch_invariant, TDM_BATCH_INVARIANT_OFF);
    assert_int_equal(parse(&c, err, sizeof err, 7, "--model", "/m", "--gpu-memory-utilization",
                           "0.5", "--num-gpu-blocks-override", "100"),
                     TDM_OK);
    assert_true(c.gpu_memory_utilization == 0.5);
    assert_int_equal(c.num_kv_blocks, 100);
    assert_int_equal(
        parse(&c, err, sizeof err, 5, "--model", "/m", "--gpu-memory-utilization", "1.5"),
        TDM_EINVAL);
    assert_string_equal(err,
                        "--gpu-memory-utilization: expected a fraction in (0, 1], got \"1.5\"");
    assert_int_equal(
        parse(&c, err, sizeof err, 5, "--model", "/m", "--num-gpu-blocks-override", "0"),
        TDM_EINVAL);
}

static void test_bytes(void **state)
{
    (void)state;
    size_t b;
    assert_int_equal(tdm_parse_bytes("1024", &b), TDM_OK);
    assert_int_equal(b, 1024);
    assert_int_equal(tdm_parse_bytes("512MiB", &b), TDM_OK);
    assert_int_equal(b, (size_t)512 << 20);
    assert_int_equal(tdm_parse_bytes("2G", &b), TDM_OK);
    assert_int_equal(b, (size_t)2 << 30);
    assert_int_equal(tdm_parse_bytes("1.5GB", &b), TDM_OK);
    assert_int_equal(b, (size_t)1500000000);
    assert_int_equal(tdm_parse_bytes("-1", &b), TDM_EINVAL);
    assert_int_equal(tdm_parse_bytes("GiB", &b), TDM_EINVAL);
    assert_int_equal(tdm_parse_bytes("1.5", &b), TDM_EINVAL);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_config_file(void **state)
{
    (void)state;
    char path[] = "/tmp/decode_config_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    write_file(path, "# tandem-decode config\n"
                     "model: /models/q  # trailing comment\n"
                     "port: 9000\n"
                     "\n"
                     "served_model_name: \"Qwen/Qwen2.5-0.5B-Instruct\"\n"
                     "enable-prefix-caching: false\n"
                     "kv-cache-memory: '1GiB'\n"
                     "api-key: 'a#b'\n");
    struct tdm_worker_config c;
    char err[512];
    // A flag overrides the file even when it comes first.
    assert_int_equal(parse(&c, err, sizeof err, 5, "--port", "7000", "--config", path), TDM_OK);
    assert_string_equal(c.model, "/models/q");
    assert_int_equal(c.port, 7000);
    assert_string_equal(c.served_model_name, "Qwen/Qwen2.5-0.5B-Instruct");
    assert_false(c.enable_prefix_caching);
    assert_int_equal(c.kv_cache_memory, (size_t)1 << 30);
    assert_string_equal(c.api_key, "a#b");

    write_file(path, "model: /m\nport: 99999\n");
    assert_int_equal(parse(&c, err, sizeof err, 3, "--config", path), TDM_EINVAL);
    assert_non_null(strstr(err, ":2: --port: expected an integer"));
    write_file(path, "model /m\n");
    assert_int_equal(parse(&c, err, sizeof err, 3, "--config", path), TDM_EINVAL);
    assert_non_null(strstr(err, ":1: expected \"key: value\""));
    write_file(path, "model: /m\nwhat: 1\n");
    assert_int_equal(parse(&c, err, sizeof err, 3, "--config", path), TDM_EINVAL);
    assert_non_null(strstr(err, ":2: unknown option \"--what\""));
    unlink(path);
    assert_int_equal(parse(&c, err, sizeof err, 3, "--config", path), TDM_EINVAL);
}

// --otlp-traces-endpoint (vLLM's flag), on the command line and as a config
// key; a URL that is not http(s) is an error naming the flag.
static void test_otlp_endpoint(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[512];
    assert_int_equal(parse(&c, err, sizeof err, 3, "--model", "/m"), TDM_OK);
    assert_string_equal(c.otlp_traces_endpoint, "");
    assert_string_equal(c.trace_service_name, "tandem-decode");
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--otlp-traces-endpoint",
                           "https://otel.example:4318/v1/traces"),
                     TDM_OK);
    assert_string_equal(c.otlp_traces_endpoint, "https://otel.example:4318/v1/traces");
    assert_int_equal(tdm_worker_config_set(&c, "otlp_traces_endpoint", "http://c:4318", err,
                                           sizeof err),
                     TDM_OK);
    assert_string_equal(c.otlp_traces_endpoint, "http://c:4318");
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--otlp-traces-endpoint",
                           "grpc://c:4317"),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "--otlp-traces-endpoint: expected an http:// or https:// URL"));
    assert_int_equal(parse(&c, err, sizeof err, 5, "--model", "/m", "--otlp-traces-endpoint",
                           "http://"),
                     TDM_EINVAL);
}

// The flags every OpenAI front takes (common/edge/openai/openai_front.h) mean the
// same on the router: router/opts_test.c checks the same cases, word for word
// (issue 27, part B: the two copies had drifted).
static void test_front_flags(void **state)
{
    (void)state;
    struct tdm_worker_config c;
    char err[256];
    assert_int_equal(
        parse(&c, err, sizeof err, 6, "/m", "--max-body-bytes", "1TB", "--log-level", "DEBUG"),
        TDM_OK);
    assert_int_equal(c.max_body_bytes, (size_t)1000000000000ull);
    assert_string_equal(c.log_level, "DEBUG");
    static const char *const bad[][3] = {
        {"--max-body-bytes", "2TB",
         "--max-body-bytes: expected a byte size like 2GiB or 512MiB in [1024, 1000000000000], "
         "got \"2TB\""},
        {"--drain-timeout", "100000",
         "--drain-timeout: expected a number in [0, 86400], got \"100000\""},
        {"--log-level", "loud", "--log-level: expected err, warn, info or debug, got \"loud\""},
        {"--served-model-name", "", "--served-model-name: expected a non-empty value"},
        {"--otlp-traces-endpoint", "collector:4318",
         "--otlp-traces-endpoint: expected an http:// or https:// URL, got \"collector:4318\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(parse(&c, err, sizeof err, 4, "/m", bad[i][0], bad[i][1]), TDM_EINVAL);
        assert_string_equal(err, bad[i][2]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_front_flags),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_flags),
        cmocka_unit_test(test_otlp_endpoint),
        cmocka_unit_test(test_kv_transfer),
        cmocka_unit_test(test_bad_flags),
        cmocka_unit_test(test_device),
        cmocka_unit_test(test_bytes),
        cmocka_unit_test(test_config_file),
        cmocka_unit_test(test_tool_flags),
        cmocka_unit_test(test_vllm_command_lines),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
