// SPDX-License-Identifier: Apache-2.0
// worker_config: the worker base's flags and config file (tandem-decode and
// tandem-prefill take them all). One table (core's
// struct tdm_flag) maps each option name to its field and check, so the
// command line and the flat YAML file (vLLM's --config style: the same keys as
// the flags, "key: value") accept exactly the same things with the same checks
// and messages, and --help lists that table. Flags given on the command line
// override the file, as in vLLM.
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "backend_module.h"
#include "core.h"
#include "kvx.h"
#include "model.h"
#include "openai_front.h"
#include "sampling.h"
#include "trace.h"
#include "worker.h"

void tdm_worker_config_default(struct tdm_worker_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->host, sizeof cfg->host, "0.0.0.0");
    cfg->port = 8001;
    cfg->max_num_seqs = 64;
    cfg->max_num_batched_tokens = 512;
    cfg->block_size = 16;
    cfg->kv_cache_memory = (size_t)256 << 20;
    cfg->gpu_memory_utilization = 0.9;
    cfg->enable_prefix_caching = true;
    cfg->kv_cache_dtype = TDM_KV_BF16; // auto
    cfg->weight_cache = true;
    cfg->async_scheduling = true;
    cfg->max_waiting = 1024;
    cfg->stream_interval = 1;
    cfg->max_logprobs = TDM_MAX_LOGPROBS;
    cfg->drain_timeout = 30.0;
    snprintf(cfg->log_level, sizeof cfg->log_level, "info");
    cfg->max_body_bytes = (size_t)16 << 20;
    cfg->http_header_timeout = 10.0;
    cfg->http_body_timeout = 30.0;
    cfg->max_large_requests = 4;
    cfg->log_requests = true;
    cfg->http_memory_budget_mib = 2048;
    snprintf(cfg->trace_service_name, sizeof cfg->trace_service_name, "tandem-decode");
    cfg->kv_transfer = TDM_KVX_AUTO;
}

// ---- the flag table ---------------------------------------------------------------------------
// Flags whose check is more than a type and a range.
static int set_block_size(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    char *end;
    long x = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || x < 1 || x > 1024 || (x & (x - 1)) != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--block-size: expected a power of two in [1, 1024], got \"%s\"", v);
    cfg->block_size = (int)x;
    return TDM_OK;
}

static int set_kv_cache_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    char e[200];
    if (strncmp(v, "fp8", 3) == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--kv-cache-dtype %s: fp8 KV is not supported yet (the GPU kernels "
                          "read bf16 or f32 KV); supported: auto (bf16), bf16, f32",
                          v);
    if (tdm_kv_dtype_parse(v, &cfg->kv_cache_dtype, e, sizeof e) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--kv-cache-dtype: %s", e);
    return TDM_OK;
}

// --scheduling-policy: vLLM's fcfs (the default) or priority.
static int set_scheduling_policy(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    if (strcmp(v, "fcfs") == 0)
        cfg->priority_scheduling = false;
    else if (strcmp(v, "priority") == 0)
        cfg->priority_scheduling = true;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--scheduling-policy: unknown policy \"%.64s\" (fcfs or priority)", v);
    return TDM_OK;
}

// --dtype is the compute type as vLLM names it (Tandem computes bf16 weights
// against f32 activations: auto, bfloat16 and bf16 all mean that); the weight
// quantization is --quantization. "--dtype int8" is the old spelling of
// --quantization int8: still accepted, with a warning.
static int set_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    if (strcmp(v, "bf16") == 0 || strcmp(v, "bfloat16") == 0 || strcmp(v, "auto") == 0)
        return TDM_OK;
    // vLLM's half/float16 (GPUs without bf16): Tandem's kernels take bf16
    // weights, and a float16 checkpoint is converted at load. bf16 keeps
    // float32's range with fewer mantissa bits, so outputs differ slightly
    // from a float16 run.
    if (strcmp(v, "half") == 0 || strcmp(v, "float16") == 0 || strcmp(v, "fp16") == 0) {
        TDM_LOG_WARN("worker",
                     "--dtype %s: Tandem computes with bf16 weights (a float16 checkpoint is "
                     "converted at load); outputs differ slightly from a float16 run",
                     v);
        return TDM_OK;
    }
    if (strcmp(v, "float32") == 0 || strcmp(v, "float") == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--dtype %s: not supported: Tandem keeps weights in bf16 (activations "
                          "and accumulation are already f32); use auto or bfloat16, and "
                          "--kv-cache-dtype f32 for an f32 KV cache",
                          v);
    if (strcmp(v, "int8") == 0) {
        TDM_LOG_WARN("worker", "--dtype int8 is deprecated: it means --quantization int8");
        cfg->int8 = true;
        return TDM_OK;
    }
    return tdm_seterr(err, errlen, TDM_EINVAL,
                      "--dtype: expected auto, bfloat16, bf16, half or float16, got \"%s\" "
                      "(weight quantization is --quantization int8)",
                      v);
}

// --tensor-parallel-size and --pipeline-parallel-size (and -dp): 1 is what
// Tandem does; more is refused with how Tandem scales instead.
static int set_parallel(const char *flag, const char *v, char *err, size_t errlen)
{
    char *end;
    long n = strtol(v, &end, 10);
    if (*v == '\0' || *end != '\0' || n < 1)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected 1, got \"%s\"", flag, v);
    if (n > 1)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--%s %ld: not supported: each Tandem worker runs the whole model on "
                          "one device; it scales by adding workers (tandem up --decode N, or "
                          "more pods with llm-d.ai/role=decode|prefill) behind the router",
                          flag, n);
    return TDM_OK;
}

static int set_tensor_parallel(void *o, const char *v, char *err, size_t errlen)
{
    (void)o;
    return set_parallel("tensor-parallel-size", v, err, errlen);
}

static int set_pipeline_parallel(void *o, const char *v, char *err, size_t errlen)
{
    (void)o;
    return set_parallel("pipeline-parallel-size", v, err, errlen);
}

static int set_data_parallel(void *o, const char *v, char *err, size_t errlen)
{
    (void)o;
    return set_parallel("data-parallel-size", v, err, errlen);
}

static int set_seed(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    char *end;
    errno = 0;
    long long s = strtoll(v, &end, 10);
    if (*v == '\0' || *end != '\0' || errno != 0 || s < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--seed: expected a non-negative integer, got \"%s\"", v);
    cfg->has_seed = true;
    cfg->seed = (uint64_t)s;
    return TDM_OK;
}

static int set_trust_remote_code(void *o, const char *v, char *err, size_t errlen)
{
    (void)v;
    (void)err;
    (void)errlen;
    struct tdm_worker_config *cfg = o;
    cfg->trust_remote_code = true;
    TDM_LOG_INFO("worker", "--trust-remote-code: accepted; no remote code runs (Tandem runs the "
                           "Qwen2 architecture natively and never executes a model's Python)");
    return TDM_OK;
}

// --batch-invariant[=BOOL] and --no-batch-invariant[=BOOL] (vLLM's
// VLLM_BATCH_INVARIANT as a flag): the CUDA backend's GEMM mode, model.h's
// enum tdm_batch_invariance. Neither given: the model's default.
static int batch_invariant_flag(struct tdm_worker_config *cfg, const char *flag, bool negate,
                                const char *v, char *err, size_t errlen)
{
    enum tdm_batch_invariance b;
    int rc = tdm_batch_invariance_parse(flag, negate, v, &b, err, errlen);
    if (rc == TDM_OK)
        cfg->batch_invariant = b;
    return rc;
}

static int set_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return batch_invariant_flag(o, "batch-invariant", false, v, err, errlen);
}

static int set_no_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return batch_invariant_flag(o, "no-batch-invariant", true, v, err, errlen);
}

void tdm_worker_config_apply_process(const struct tdm_worker_config *cfg)
{
    if (cfg->has_seed)
        tdm_sampling_set_process_seed(cfg->seed);
}

static int set_quantization(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    if (strcmp(v, "int8") == 0)
        cfg->int8 = true;
    else if (strcmp(v, "none") == 0)
        cfg->int8 = false;
    else
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--quantization: expected int8 or none, got \"%s\"", v);
    return TDM_OK;
}

// --speculative-config: vLLM's JSON, method "ngram" (prompt lookup) only:
// {"method":"ngram","num_speculative_tokens":K,"prompt_lookup_max":N,
//  "prompt_lookup_min":M}. Unknown keys and methods are refused (vLLM's
// other methods need a draft model Tandem does not run).
static int set_speculative_config(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    struct tdm_spec_config sc = {0};
    cJSON *j = cJSON_Parse(v);
    int rc = TDM_OK;
    if (!cJSON_IsObject(j)) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "--speculative-config: expected a JSON object, "
                        "got \"%.80s\"", v);
        goto out;
    }
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(j, "method");
    if (!cJSON_IsString(method) || strcmp(method->valuestring, "ngram") != 0) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL,
                        "--speculative-config: method must be \"ngram\" (n-gram prompt lookup; "
                        "draft-model methods are not supported), got %s",
                        cJSON_IsString(method) ? method->valuestring : "none");
        goto out;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, j)
    {
        int *field = NULL;
        if (strcmp(it->string, "method") == 0)
            continue;
        if (strcmp(it->string, "num_speculative_tokens") == 0)
            field = &sc.num_speculative_tokens;
        else if (strcmp(it->string, "prompt_lookup_max") == 0)
            field = &sc.prompt_lookup_max;
        else if (strcmp(it->string, "prompt_lookup_min") == 0)
            field = &sc.prompt_lookup_min;
        if (!field) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL,
                            "--speculative-config: unknown key \"%s\" (known: method, "
                            "num_speculative_tokens, prompt_lookup_max, prompt_lookup_min)",
                            it->string);
            goto out;
        }
        if (!cJSON_IsNumber(it) || it->valuedouble != (double)(int)it->valuedouble ||
            it->valuedouble < 1) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL,
                            "--speculative-config: %s must be a positive integer", it->string);
            goto out;
        }
        *field = (int)it->valuedouble;
    }
    if (sc.num_speculative_tokens == 0) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL,
                        "--speculative-config: num_speculative_tokens is required");
        goto out;
    }
    char e[160];
    if (tdm_spec_config_resolve(&sc, e, sizeof e) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "--speculative-config: %s", e);
        goto out;
    }
    cfg->spec = sc;
out:
    cJSON_Delete(j);
    return rc;
}

// --config is applied before the other flags (tdm_worker_config_parse_args).
static int set_config_done(void *o, const char *v, char *err, size_t errlen)
{
    (void)o;
    (void)v;
    (void)err;
    (void)errlen;
    return TDM_OK;
}

// --device: checked at parse time, so a GPU asked for and not visible (or a
// build without CUDA) is a startup error naming the flag.
static int set_device(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    struct tdm_model_opts probe;
    tdm_model_opts_default(&probe);
    int rc = tdm_model_opts_set_device(&probe, v, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (strlen(v) >= sizeof cfg->device)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--device %s: too long", v);
    snprintf(cfg->device, sizeof cfg->device, "%s", v);
    return TDM_OK;
}

// True (err filled) when the CUDA backend module, which holds the device KV
// transfer table, cannot serve device transport m here.
static bool kvx_table_missing(enum tdm_kvx_mode m, char *err, size_t errlen)
{
    const struct tdm_kvx_ops *ops;
    char why[1024];
    if (tdm_backend_module_kvx(&ops, why, sizeof why) != TDM_OK) {
        snprintf(err, errlen,
                 "--kv-transfer %s needs the CUDA backend module (%s); without it KV moves over "
                 "nng only: use nng or auto",
                 tdm_kvx_mode_name(m), why);
        return true;
    }
    if (ops == NULL) {
        snprintf(err, errlen, "--kv-transfer %s: the CUDA backend module has no device transfer",
                 tdm_kvx_mode_name(m));
        return true;
    }
    return false;
}

// --kv-transfer: how KV moves between a prefill and a decode worker (issue
// 10). A CPU build has only nng: asking for a device transport there is a
// startup error rather than a silent nng.
static int set_kv_transfer(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    enum tdm_kvx_mode m;
    if (tdm_kvx_mode_parse(v, &m) != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--kv-transfer: expected nng, cuda-ipc, nccl or auto, got \"%s\"", v);
    if (m != TDM_KVX_AUTO && m != TDM_KVX_NNG && kvx_table_missing(m, err, errlen))
        return TDM_EINVAL;
    cfg->kv_transfer = (int)m;
    return TDM_OK;
}

static int set_gpu_memory_utilization(void *o, const char *v, char *err, size_t errlen)
{
    struct tdm_worker_config *cfg = o;
    char *end;
    double x = strtod(v, &end);
    if (*v == '\0' || *end != '\0' || !(x > 0.0 && x <= 1.0))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--gpu-memory-utilization: expected a fraction in (0, 1], got \"%s\"", v);
    cfg->gpu_memory_utilization = x;
    return TDM_OK;
}

#define STR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct tdm_worker_config, n, TDM_FLAG_STR, field, .metavar = mv, .help = h)
#define INT(n, field, lo, hi, mv, h)                                                               \
    TDM_FLAG_FIELD(struct tdm_worker_config, n, TDM_FLAG_INT, field, .min = lo, .max = hi,      \
                   .metavar = mv, .help = h)
#define OFF(field) offsetof(struct tdm_worker_config, field)
// --NAME and --no-NAME for a bool field (help_on, help_off: each one's help).
#define BOOL_PAIR(n, field, help_on, help_off)                                                     \
    {.name = n, .kind = TDM_FLAG_BOOL, .offset = OFF(field), .help = help_on},                     \
    {                                                                                              \
        .name = "no-" n, .kind = TDM_FLAG_NOT, .offset = OFF(field), .help = help_off              \
    }

static const struct tdm_flag decode_flags[] = {
    STR("model", model, "DIR|ORG/NAME",
        "model folder, or a Hugging Face id fetched into\nthe HF cache (required; see "
        "docs/models.md)"),
    STR("revision", revision, "REV", "branch, tag or commit of a Hub id (default main)"),
    TDM_OAI_FRONT_FLAGS(struct tdm_worker_config, "listen port (default 8001; 0 = any free port)"),
    INT("max-num-seqs", max_num_seqs, 1, 65536, "N", "running requests at most (default 64)"),
    INT("max-num-batched-tokens", max_num_batched_tokens, 1, 1 << 20, "N",
        "tokens per engine step (default 512)"),
    {.name = "block-size",
     .kind = TDM_FLAG_FN,
     .fn = set_block_size,
     .metavar = "N",
     .help = "KV tokens per block (default 16)"},
    {.name = "kv-cache-memory",
     .kind = TDM_FLAG_BYTES,
     .offset = OFF(kv_cache_memory),
     .min = 1,
     .max = 1.8e19,
     .metavar = "BYTES",
     .help = "KV pool size, e.g. 2GiB (default 256MiB)"},
    INT("num-kv-blocks", num_kv_blocks, 1, INT_MAX / 1024, "N",
        "KV pool size in blocks (overrides the above)"),
    INT("num-gpu-blocks-override", num_kv_blocks, 1, INT_MAX / 1024, "N",
        "vLLM's name for --num-kv-blocks"),
    {.name = "kv-cache-dtype",
     .kind = TDM_FLAG_FN,
     .fn = set_kv_cache_dtype,
     .metavar = "auto|bf16|f32",
     .help = "KV cache element type (default auto = bf16: half the\nmemory and P/D transfer "
             "bytes of f32; f32 for exact-\nreference runs; the CUDA backend keeps\n"
             "TANDEM_CUDA_KV_DTYPE)"},
    {.name = "speculative-config",
     .kind = TDM_FLAG_FN,
     .fn = set_speculative_config,
     .metavar = "JSON",
     .help = "speculative decoding (vLLM's): '{\"method\":\"ngram\",\n"
             "\"num_speculative_tokens\":K,\"prompt_lookup_max\":N,\n\"prompt_lookup_min\":M}' "
             "(n-gram prompt lookup;\ndefault off)"},
    BOOL_PAIR("enable-prefix-caching", enable_prefix_caching,
              "reuse cached prompt prefixes (default)", "turn prefix caching off"),
    INT("threads", threads, 0, 1024, "N", "compute threads (default: one per core)"),
    {.name = "device",
     .kind = TDM_FLAG_FN,
     .fn = set_device,
     .metavar = "cpu|cuda|cuda:N",
     .help = "where the model computes (default: cuda when the CUDA\nbackend module "
             "libtandem-cuda.so loads and a GPU is\nvisible, else cpu; cuda-emu[:N] runs the "
             "CUDA backend\non its CPU emulator, for checks)"},
    BOOL_PAIR("weight-cache", weight_cache,
              "map the packed weights from the cache folder when an\nentry for this checkpoint "
              "exists, else write one\n(CPU, checkpoints >= 64 MiB; default on)",
              "pack the checkpoint at every start, write no cache"),
    STR("weight-cache-dir", weight_cache_dir, "DIR",
        "packed-weight cache folder (default $TANDEM_CACHE/packed,\nelse ~/.cache/tandem/packed)"),
    {.name = "enforce-eager",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(enforce_eager),
     .help = "no CUDA graphs for decode steps (default: graphs\nper padded batch size 1, 2, 4, "
             "... on cuda)"},
    {.name = "scheduling-policy",
     .kind = TDM_FLAG_FN,
     .fn = set_scheduling_policy,
     .metavar = "fcfs|priority",
     .help = "fcfs (default): requests start in arrival order, and\na priority other than 0 is "
             "refused (400); priority:\nthe waiting ones start by (priority, arrival),\nlowest "
             "first, and a preemption takes the running\nrequest of the highest (vLLM's flag)"},
    BOOL_PAIR("async-scheduling", async_scheduling,
              "on a device (cuda), issue the next decode step\nbefore this one's tokens reach the "
              "host, from the\ntokens chosen on the device (vLLM's flag; default on;\nrows with "
              "drafts wait)",
              "every decode step waits for its tokens before the\nnext is scheduled"),
    {.name = "batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_batch_invariant,
     .no_value = true,
     .help = "a request's numbers do not depend on the batch it\nruns in (vLLM's "
             "VLLM_BATCH_INVARIANT; the default for\nnow): every CUDA GEMM on cuBLASLt, one "
             "algorithm\nper weight shape"},
    {.name = "no-batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_no_batch_invariant,
     .no_value = true,
     .help = "on cuda: GEMMs of steps of up to 16 rows (decode)\non Tandem's split-K GEMV; a "
             "row's numbers then\ndiffer between steps of <= 16 rows and larger ones"},
    {.name = "kv-transfer",
     .kind = TDM_FLAG_FN,
     .fn = set_kv_transfer,
     .metavar = "nng|cuda-ipc|nccl|auto",
     .help =
         "P/D: how KV moves between prefill and decode workers\n(default auto: CUDA IPC on one "
         "host, else NCCL\nbetween GPUs, else nng; chosen per pair; a CPU build\nhas nng only)"},
    {.name = "gpu-memory-utilization",
     .kind = TDM_FLAG_FN,
     .fn = set_gpu_memory_utilization,
     .metavar = "F",
     .help = "on a GPU: the KV pool gets F of the device's memory\nminus what is already in use "
             "(default 0.9);\n--kv-cache-memory sizes CPU pools only"},
    {.name = "dtype",
     .kind = TDM_FLAG_FN,
     .fn = set_dtype,
     .metavar = "auto|bfloat16",
     .help = "compute type (default auto: bf16 weights, f32 activations);\n"
             "'int8' is the old spelling of --quantization int8"},
    {.name = "quantization",
     .kind = TDM_FLAG_FN,
     .fn = set_quantization,
     .metavar = "int8|none",
     .help = "weight quantization: int8 = per-row int8 at load (default none)"},
    INT("max-waiting", max_waiting, 0, 1 << 20, "N",
        "waiting-queue bound; beyond it 503 (default 1024)"),
    INT("http-threads", http_threads, 0, 4096, "N",
        "HTTP worker threads (default max-num-seqs +\nmax-waiting, clamped to [16, 512])"),
    {.name = "seed",
     .kind = TDM_FLAG_FN,
     .fn = set_seed,
     .metavar = "N",
     .help = "requests without a seed draw theirs from N's stream:\nthe same requests in the "
             "same order sample the same\noutputs (default: a fresh seed each)"},
    {.name = "tensor-parallel-size",
     .kind = TDM_FLAG_FN,
     .fn = set_tensor_parallel,
     .metavar = "1",
     .help = "vLLM's; 1 only (Tandem scales by adding workers)"},
    {.name = "pipeline-parallel-size",
     .kind = TDM_FLAG_FN,
     .fn = set_pipeline_parallel,
     .metavar = "1",
     .help = "vLLM's; 1 only"},
    {.name = "data-parallel-size",
     .kind = TDM_FLAG_FN,
     .fn = set_data_parallel,
     .metavar = "1",
     .help = "vLLM's; 1 only (N workers behind the router instead)"},
    {.name = "trust-remote-code",
     .kind = TDM_FLAG_FN,
     .fn = set_trust_remote_code,
     .no_value = true,
     .help = "vLLM's; accepted: no remote code ever runs"},
    {.name = "disable-log-requests",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(log_requests),
     .help = "no INFO line per request"},
    {.name = "disable-log-stats",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(disable_log_stats),
     .help = "vLLM's; accepted (Tandem logs no periodic stats:\nthey are on /metrics)"},
    {.name = "config",
     .kind = TDM_FLAG_FN,
     .fn = set_config_done,
     .metavar = "FILE",
     .help = "flat YAML 'key: value' file with these keys"},
};

static const struct tdm_flags decode_table = {
    .usage = "usage: tandem-decode --model DIR [options]\n"
             "Serves an OpenAI-compatible API (vLLM's shapes) on one model.\n",
    .flags = decode_flags,
    .n = sizeof decode_flags / sizeof decode_flags[0],
    .footer = "  --help                        this text\n",
};

const struct tdm_flags *tdm_worker_flags(void)
{
    return &decode_table;
}

int tdm_worker_config_set(struct tdm_worker_config *cfg, const char *name, const char *value,
                          char *err, size_t errlen)
{
    return tdm_flags_set(&decode_table, cfg, name, value, err, errlen);
}

// "max_num_seqs" to "max-num-seqs" (config keys).
static void norm_name(char *buf, size_t cap, const char *name)
{
    size_t i = 0;
    for (; name[i] && i + 1 < cap; i++)
        buf[i] = name[i] == '_' ? '-' : name[i];
    buf[i] = '\0';
}

// ---- the config file -----------------------------------------------------------------------
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = '\0';
    return s;
}

int tdm_worker_config_load_file(struct tdm_worker_config *cfg, const char *path, char *err,
                                size_t errlen)
{
    char *text = NULL;
    size_t len = 0;
    int rc = tdm_read_file(path, &text, &len, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (strlen(text) != len) {
        free(text);
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: contains a NUL byte", path);
    }
    int lineno = 0;
    rc = TDM_OK;
    char *p = text;
    while (p != NULL && rc == TDM_OK) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        lineno++;
        char *line = p;
        p = nl ? nl + 1 : NULL;
        // A '#' starts a comment unless it is inside quotes.
        char quote = 0;
        for (char *c = line; *c; c++) {
            if (quote) {
                if (*c == quote)
                    quote = 0;
            } else if (*c == '"' || *c == '\'') {
                quote = *c;
            } else if (*c == '#' && (c == line || c[-1] == ' ' || c[-1] == '\t')) {
                *c = '\0';
                break;
            }
        }
        line = trim(line);
        if (*line == '\0' || strcmp(line, "---") == 0)
            continue;
        char *colon = strchr(line, ':');
        if (colon == NULL) {
            rc =
                tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: expected \"key: value\"", path, lineno);
            break;
        }
        *colon = '\0';
        char *key = trim(line);
        char *val = trim(colon + 1);
        size_t vl = strlen(val);
        if (vl >= 2 && (val[0] == '"' || val[0] == '\'') && val[vl - 1] == val[0]) {
            val[vl - 1] = '\0';
            val++;
        }
        if (*key == '\0') {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: empty key", path, lineno);
            break;
        }
        char n[64];
        norm_name(n, sizeof n, key);
        if (strcmp(n, "config") == 0) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: config files do not nest", path,
                            lineno);
            break;
        }
        char detail[384];
        if (tdm_worker_config_set(cfg, key, val, detail, sizeof detail) != TDM_OK)
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: %s", path, lineno, detail);
    }
    free(text);
    return rc;
}

// ---- argv ------------------------------------------------------------------------------------
int tdm_worker_config_parse_args(struct tdm_worker_config *cfg, int argc, char **argv, char *err,
                                 size_t errlen)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
            return 1;
    // The file first, so that flags override it whatever their order.
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0 || strncmp(a, "--config=", 9) == 0) {
            const char *path = a[8] == '=' ? a + 9 : (i + 1 < argc ? argv[i + 1] : NULL);
            if (path == NULL || *path == '\0')
                return tdm_seterr(err, errlen, TDM_EINVAL, "--config: expected a file");
            int rc = tdm_worker_config_load_file(cfg, path, err, errlen);
            if (rc != TDM_OK)
                return TDM_EINVAL;
        }
    }
    // The model may come as vllm serve takes it, a positional argument
    // ("tandem-decode MODEL --port 8001"; a leading "serve" is skipped, so a
    // `vllm serve` line works with only its first word changed).
    char *rest[2];
    int n_rest = 0;
    int rc = tdm_flags_parse(&decode_table, cfg, argc, argv, rest, 2, &n_rest, err, errlen);
    if (rc != TDM_OK)
        return rc;
    const char *pos = n_rest == 2 && strcmp(rest[0], "serve") == 0 ? rest[1]
                      : n_rest == 1                                ? rest[0]
                                                                   : NULL;
    if (n_rest == 2 && !pos)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "unexpected argument \"%.200s\" (the model is the one positional "
                          "argument)",
                          rest[1]);
    if (pos) {
        if (cfg->model[0] && strcmp(cfg->model, pos) != 0)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "the model is given twice: \"%.200s\" and --model \"%.200s\"", pos,
                              cfg->model);
        if (strlen(pos) >= sizeof cfg->model)
            return tdm_seterr(err, errlen, TDM_EINVAL, "the model \"%.60s...\" is too long", pos);
        snprintf(cfg->model, sizeof cfg->model, "%s", pos);
    }
    if (cfg->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "no model: give it as --model DIR|ORG/NAME or as the first argument "
                          "(as vllm serve MODEL)");
    return TDM_OK;
}
