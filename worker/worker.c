// SPDX-License-Identifier: Apache-2.0
// worker: the worker base's lifecycle and routes (see worker.h): listen at
// once, load (model beside the text side on a second thread), ready, drain,
// free; the routes health, metrics, models, version, tokenize, detokenize and
// the two generation routes (worker_generate.c), all answering 503 until the
// worker is ready and again once it drains.
// Invariants: an HTTP thread never touches the model or the KV cache, only the
// engine's queues; drain waits for every API handler (inflight) to return.
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "engine.h"
#include "grammar.h"
#include "backend_module.h"
#include "http.h"
#include "kv_transport.h"
#include "metrics.h"
#include "model.h"
#include "openai.h"
#include "openai_http.h"
#include "text.h"
#include "trace.h"
#include "worker_impl.h"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "0.0.0"
#endif

// ---- models ---------------------------------------------------------------------------------
static void handle_models(struct tdm_worker *s, struct tdm_http_conn *c)
{
    tdm_oai_http_models(c, s->text.served_name, s->max_model_len, s->created);
}

// ---- routing --------------------------------------------------------------------------------
// common/edge/http has already matched (method, path), checked the API key and read
// the body under --max-body-bytes (404/405/401/413 never get here).
static void on_health(struct tdm_http_conn *c, void *arg)
{
    struct tdm_worker *s = arg;
    int state = atomic_load(&s->state);
    tdm_worker_health_fn fn = atomic_load(&s->health_fn);
    if (state == STATE_READY && fn != NULL) {
        char details[4096] = "";
        fn(atomic_load(&s->health_arg), details, sizeof details);
        char *body = malloc(sizeof details + 32);
        if (body == NULL) {
            tdm_http_respond(c, 200, "application/json", "", 0);
            return;
        }
        snprintf(body, sizeof details + 32, "{\"status\":\"ok\"%s%s}", details[0] ? "," : "",
                 details);
        tdm_http_respond_json_owned(c, 200, body);
    } else if (state == STATE_READY)
        tdm_http_respond(c, 200, "application/json", "", 0);
    else
        tdm_oai_http_errorf(c, 503, NULL, "%s",
                                state == STATE_LOADING ? "The model is loading."
                                                       : "The server is draining.");
}

static void on_metrics(struct tdm_http_conn *c, void *arg)
{
    struct tdm_worker *s = arg;
    tdm_oai_http_metrics(c, atomic_load(&s->state) == STATE_LOADING ? NULL : s->reg);
}

static void on_version(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_version(c, TANDEM_VERSION);
}

enum api_route { ROUTE_MODELS, ROUTE_COMPLETIONS, ROUTE_CHAT, ROUTE_TOKENIZE, ROUTE_DETOKENIZE };

// The API routes: 503 while loading or draining, counted in inflight so that
// drain waits for their last writes.
static void on_api(struct tdm_worker *s, struct tdm_http_conn *c, enum api_route r)
{
    atomic_fetch_add(&s->inflight, 1);
    int state = atomic_load(&s->state);
    if (state != STATE_READY)
        tdm_oai_http_errorf(c, 503, NULL, "%s",
                                state == STATE_LOADING ? "The model is loading."
                                                       : "The server is shutting down.");
    else if (r == ROUTE_MODELS)
        handle_models(s, c);
    else if (r == ROUTE_COMPLETIONS)
        worker_handle_generate(s, c, TDM_OAI_COMPLETION);
    else if (r == ROUTE_CHAT)
        worker_handle_generate(s, c, TDM_OAI_CHAT);
    else if (r == ROUTE_TOKENIZE)
        tdm_oai_http_tokenize(c, &s->info, s->text.tok, s->text.chat, s->text.chat_err,
                              s->max_model_len);
    else
        tdm_oai_http_detokenize(c, &s->info, s->text.tok);
    if (atomic_fetch_sub(&s->inflight, 1) == 1) {
        pthread_mutex_lock(&s->mu);
        pthread_cond_broadcast(&s->idle_cv);
        pthread_mutex_unlock(&s->mu);
    }
}

static void on_models(struct tdm_http_conn *c, void *arg)
{
    on_api(arg, c, ROUTE_MODELS);
}
static void on_completions(struct tdm_http_conn *c, void *arg)
{
    on_api(arg, c, ROUTE_COMPLETIONS);
}
static void on_chat(struct tdm_http_conn *c, void *arg)
{
    on_api(arg, c, ROUTE_CHAT);
}
static void on_tokenize(struct tdm_http_conn *c, void *arg)
{
    on_api(arg, c, ROUTE_TOKENIZE);
}
static void on_detokenize(struct tdm_http_conn *c, void *arg)
{
    on_api(arg, c, ROUTE_DETOKENIZE);
}

// ---- lifecycle ---------------------------------------------------------------------------------
int tdm_worker_new(struct tdm_worker **out, const struct tdm_worker_config *cfg, char *err,
                   size_t errlen)
{
    *out = NULL;
    if (cfg->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model DIR is required");
    enum tdm_oai_tool_parser tool_parser;
    int prc = tdm_oai_tool_parser_config(cfg->enable_auto_tool_choice, cfg->tool_call_parser,
                                         &tool_parser, err, errlen);
    if (prc != TDM_OK)
        return prc;
    tdm_worker_config_apply_process(cfg);
    struct tdm_worker *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    s->cfg = *cfg;
    s->info.tool_parser = tool_parser;
    s->info.return_tokens_as_token_ids = cfg->return_tokens_as_token_ids;
    s->info.default_chat_template_kwargs =
        cfg->default_chat_template_kwargs[0] ? cfg->default_chat_template_kwargs : NULL;
    s->info.trust_request_chat_template = cfg->trust_request_chat_template;
    s->info.limit_logprobs = true;
    s->info.max_logprobs = cfg->max_logprobs;
    atomic_init(&s->state, STATE_LOADING);
    atomic_init(&s->inflight, 0);
    pthread_mutex_init(&s->mu, NULL);
    tdm_cond_init(&s->idle_cv);
    s->created = (int64_t)time(NULL);

    int threads = cfg->http_threads;
    if (threads <= 0) {
        long t = (long)cfg->max_num_seqs + cfg->max_waiting;
        threads = t < 16 ? 16 : t > 512 ? 512 : (int)t;
    }
    static const struct tdm_oai_front_routes routes = {TDM_OAI_FRONT_HANDLERS(on_)};
    struct tdm_oai_front_http fh = TDM_OAI_FRONT_HTTP(cfg, threads);
    int rc = tdm_oai_front_serve(&s->http, &fh, &routes, s, err, errlen);
    if (rc != TDM_OK) {
        pthread_cond_destroy(&s->idle_cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return rc;
    }
    s->port = tdm_http_server_port(s->http);
    *out = s;
    return TDM_OK;
}

// The text side of loading (common/text); runs on its own thread beside the
// model load to shorten the cold start.
struct text_load {
    struct tdm_worker *s;
    int rc;
    char err[512];
};

static void *load_text_side(void *arg)
{
    struct text_load *t = arg;
    const struct tdm_worker_config *cfg = &t->s->cfg;
    struct tdm_text_config tc = {
        .model = cfg->model,
        .model_path = t->s->model_path,
        .served_model_name = cfg->served_model_name,
        .chat_template = cfg->chat_template,
        .log_module = WORKER_MOD,
    };
    t->rc = tdm_text_load(&t->s->text, &tc, t->err, sizeof t->err);
    return NULL;
}

// The EOS ids requests stop at: config.json's, then generation_config.json's
// not already listed (and inside the vocabulary).
static void merge_eos_ids(struct tdm_worker *s, const struct tdm_model_config *mc)
{
    for (int i = 0; i < mc->num_eos_token_ids; i++)
        s->eos_ids[s->num_eos++] = mc->eos_token_ids[i];
    for (int i = 0; i < s->text.gen.num_eos_token_ids; i++) {
        bool dup = false;
        for (int j = 0; j < s->num_eos; j++)
            dup |= s->eos_ids[j] == s->text.gen.eos_token_ids[i];
        if (!dup && s->text.gen.eos_token_ids[i] >= 0 &&
            s->text.gen.eos_token_ids[i] < mc->vocab_size)
            s->eos_ids[s->num_eos++] = s->text.gen.eos_token_ids[i];
    }
}

// The KV pool size into s->num_blocks: --num-kv-blocks, else what a device
// backend's --gpu-memory-utilization allows, else what --kv-cache-memory
// holds. Computed here (as the engine would) because
// vllm:cache_config_info must carry num_gpu_blocks when it is registered.
static int kv_pool_blocks(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(s->model, &kc);
    kc.block_size = cfg->block_size;
    kc.num_blocks = 1;
    kc.dtype = cfg->kv_cache_dtype;
    size_t bb = tdm_kv_block_bytes(&kc);
    int nb = cfg->num_kv_blocks;
    if (nb == 0) {
        // A device backend sizes its pool from --gpu-memory-utilization.
        int dev_blocks = 0;
        int rc = tdm_model_kv_capacity(s->model, &kc, cfg->gpu_memory_utilization, &dev_blocks, err,
                                       errlen);
        if (rc == TDM_OK)
            nb = dev_blocks;
        else if (rc != TDM_ENOTFOUND)
            return rc;
    }
    if (nb == 0) {
        size_t x = bb ? cfg->kv_cache_memory / bb : 0;
        if (x < 1)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--kv-cache-memory %zu bytes holds no KV block of %zu bytes",
                              cfg->kv_cache_memory, bb);
        nb = x > (size_t)(INT32_MAX / cfg->block_size) ? INT32_MAX / cfg->block_size : (int)x;
    }
    s->num_blocks = nb;
    return TDM_OK;
}

// The model options the worker's flags ask for.
static void model_opts_from_config(const struct tdm_worker_config *cfg, struct tdm_model_opts *mo)
{
    tdm_model_opts_default(mo);
    mo->weights = cfg->int8 ? TDM_WEIGHTS_INT8 : TDM_WEIGHTS_BF16;
    mo->num_threads = cfg->threads;
    mo->max_batch_tokens = cfg->max_num_batched_tokens;
    mo->max_batch_seqs = cfg->max_num_seqs;
    mo->enforce_eager = cfg->enforce_eager;
    mo->batch_invariant = (enum tdm_batch_invariance)cfg->batch_invariant;
    mo->weight_cache_dir = !cfg->weight_cache         ? NULL
                           : cfg->weight_cache_dir[0] ? cfg->weight_cache_dir
                                                      : "auto";
    mo->weight_cache_background = true; // /health 200 does not wait for the entry
}

// s->device_desc for the device mo names ("cuda:0", "cpu", or why auto chose
// the CPU).
static void describe_device(struct tdm_worker *s, const struct tdm_model_opts *mo)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    bool chosen = cfg->device[0] == '\0' || strcmp(cfg->device, "auto") == 0;
    const char *note = chosen ? tdm_model_device_auto_note() : "";
    if (strcmp(mo->backend, "cpu") != 0)
        snprintf(s->device_desc, sizeof s->device_desc, "%s:%d", mo->backend, mo->device);
    else if (note[0])
        snprintf(s->device_desc, sizeof s->device_desc, "cpu (--device auto: %s)", note);
    else
        snprintf(s->device_desc, sizeof s->device_desc, "cpu");
}

// The model and, on a second thread meanwhile, the text side (s->text); both
// are done when this returns, whatever it returns.
static int load_model_and_text(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    struct text_load tl = {.s = s, .rc = TDM_OK};
    pthread_t th;
    bool threaded = pthread_create(&th, NULL, load_text_side, &tl) == 0;
    if (!threaded)
        load_text_side(&tl);

    struct tdm_model_opts mo;
    model_opts_from_config(cfg, &mo);
    int rc = tdm_model_opts_set_device(&mo, cfg->device, err, errlen);
    if (rc == TDM_OK)
        describe_device(s, &mo);
    if (rc == TDM_OK && strcmp(mo.backend, "cpu") == 0 &&
        cfg->batch_invariant == TDM_BATCH_INVARIANT_OFF)
        TDM_LOG_WARN("worker", "--no-batch-invariant: no effect on the CPU backend, whose GEMMs "
                               "are batch invariant at full speed");
    if (rc == TDM_OK)
        rc = tdm_model_load(&s->model, s->model_path, &mo, err, errlen);
    if (threaded)
        pthread_join(th, NULL);
    if (rc != TDM_OK)
        return rc;
    const struct tdm_model_load_info *li = tdm_model_load_info(s->model);
    TDM_LOG_INFO("worker", "model loaded load_s=%.3f checkpoint_bytes=%zu weight_cache=%s",
                 li->seconds, li->checkpoint_bytes, tdm_weight_cache_use_name(li->weight_cache));
    if (tl.rc != TDM_OK)
        return tdm_seterr(err, errlen, tl.rc, "%s", tl.err);
    return TDM_OK;
}

// The metrics registry and the worker's series: the vLLM set (its
// cache_config_info carries s->num_blocks), the tracer's, the prefill
// backlog, the async scheduling counters and, when speculating, vLLM's
// speculative decoding counters.
static int register_metrics(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    int rc = tdm_metrics_registry_new(&s->reg, NULL, 0, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_metrics_vllm_config mcfg;
    memset(&mcfg, 0, sizeof mcfg);
    mcfg.model_name = s->text.served_name;
    mcfg.engine = "0";
    mcfg.max_model_len = s->max_model_len;
    mcfg.cache.block_size = cfg->block_size;
    mcfg.cache.num_gpu_blocks = s->num_blocks;
    mcfg.cache.num_cpu_blocks = -1;
    mcfg.cache.gpu_memory_utilization = cfg->gpu_memory_utilization;
    mcfg.cache.enable_prefix_caching = cfg->enable_prefix_caching;
    mcfg.cache.cache_dtype = tdm_kv_dtype_name(cfg->kv_cache_dtype);
    rc = tdm_metrics_vllm_register(&s->metrics, s->reg, &mcfg, err, errlen);
    if (rc != TDM_OK)
        return rc;
    const char *otlp = tdm_tracer_endpoint_from_env(cfg->otlp_traces_endpoint);
    if (otlp) {
        struct tdm_tracer_config tc = {
            .endpoint = otlp,
            .service_name = tdm_tracer_service_name(
                cfg->trace_service_name[0] ? cfg->trace_service_name : "tandem-worker")};
        rc = tdm_tracer_new(&s->tracer, &tc, s->reg, err, errlen);
        if (rc != TDM_OK)
            return rc;
    }
    // The prefill backlog in tokens (the prefill role's autoscaling signal,
    // docs/kubernetes.md), with the vLLM set's constant labels.
    const struct tdm_metrics_label pl[2] = {{"model_name", s->text.served_name},
                                            {"engine", "0"}};
    const struct tdm_metrics_opts po = {
        .name = "tandem:num_prompt_tokens_waiting",
        .help = "Prompt tokens not yet prefilled, of the waiting and running requests.",
        .const_labels = pl,
        .n_const_labels = 2,
    };
    rc = tdm_metrics_gauge_register(&s->prompt_tokens_waiting, s->reg, &po, err, errlen);
    if (rc != TDM_OK)
        return rc;
    // The engine's async scheduling at work (0 where the backend's forwards
    // end at issue, the CPU's): steps issued ahead, rows read from device lists.
    struct tdm_metrics_opts co = po;
    co.name = "tandem:engine_steps_ahead_total";
    co.help = "Engine steps issued while the step before them was still on the device.";
    rc = tdm_metrics_counter_register(&s->steps_ahead, s->reg, &co, err, errlen);
    if (rc != TDM_OK)
        return rc;
    co.name = "tandem:engine_list_rows_total";
    co.help = "Sampled rows whose penalty entries the device kept from the step before.";
    rc = tdm_metrics_counter_register(&s->list_rows, s->reg, &co, err, errlen);
    if (rc != TDM_OK)
        return rc;
    // The engine thread's time by phase: the host's share of a step
    // (docs/metrics.md).
    static const char *const phase_label[] = {"phase"};
    co.name = "tandem:engine_thread_seconds_total";
    co.help = "Engine thread wall time by phase (schedule, prepare, forward, wait, finish, "
              "other, idle).";
    co.label_names = phase_label;
    co.n_label_names = 1;
    rc = tdm_metrics_counter_register(&s->thread_seconds, s->reg, &co, err, errlen);
    if (rc != TDM_OK)
        return rc;
    // vLLM registers its speculative decoding counters only when speculating.
    if (cfg->spec.num_speculative_tokens > 0)
        return tdm_metrics_spec_register(&s->spec_metrics, s->reg, s->text.served_name, "0",
                                         cfg->spec.num_speculative_tokens, err, errlen);
    return TDM_OK;
}

// The structured outputs' vocabulary trie and the engine over the loaded
// model, its pool s->num_blocks blocks.
static int start_engine(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    // Structured outputs: the vocabulary's token trie, once per tokenizer
    // (~70 ms for Qwen2's 151 665 tokens). Without it the server still serves,
    // and a constrained request is a 400.
    if (s->text.tok) {
        char gerr[256] = "";
        if (tdm_grammar_vocab_from_tokenizer(&s->gvocab, s->text.tok, -1, gerr, sizeof gerr) !=
            TDM_OK)
            TDM_LOG_WARN(WORKER_MOD, "structured outputs disabled: %s", gerr);
    }
    struct tdm_engine_config ec;
    tdm_engine_config_default(&ec);
    ec.grammar_vocab = s->gvocab;
    ec.block_size = cfg->block_size;
    ec.num_blocks = s->num_blocks;
    ec.enable_prefix_caching = cfg->enable_prefix_caching;
    ec.kv_dtype = cfg->kv_cache_dtype;
    ec.max_num_batched_tokens = cfg->max_num_batched_tokens;
    ec.max_num_seqs = cfg->max_num_seqs;
    ec.max_model_len = s->max_model_len;
    ec.max_waiting = cfg->max_waiting;
    ec.metrics = &s->metrics;
    ec.prompt_tokens_waiting = s->prompt_tokens_waiting;
    ec.steps_ahead = s->steps_ahead;
    ec.thread_seconds = s->thread_seconds;
    ec.list_rows = s->list_rows;
    ec.spec = cfg->spec;
    ec.sync_scheduling = !cfg->async_scheduling;
    ec.priority_scheduling = cfg->priority_scheduling;
    ec.spec_metrics = cfg->spec.num_speculative_tokens > 0 ? &s->spec_metrics : NULL;
    // KV events for the router's exact prefix index (read by the P/D receiver's
    // load reports); with prefix caching off there are no cached blocks to report.
    ec.kv_event_capacity = cfg->enable_prefix_caching ? 8192 : 0;
    return tdm_engine_new(&s->engine, s->model, &ec, err, errlen);
}

int tdm_worker_load_unready(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    // A local folder is used as it is; an ORG/NAME id comes from the HF cache,
    // downloaded first when missing (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply).
    int rc = tdm_text_resolve(cfg->model, cfg->revision, s->model_path, sizeof s->model_path, err,
                              errlen);
    if (rc == TDM_OK)
        rc = load_model_and_text(s, err, errlen);
    if (rc != TDM_OK)
        return rc;
    const struct tdm_model_config *mc = tdm_model_config(s->model);
    rc = tdm_text_context_len(cfg->max_model_len, mc->max_position_embeddings, &s->max_model_len,
                              err, errlen);
    if (rc != TDM_OK)
        return rc;
    merge_eos_ids(s, mc);
    rc = kv_pool_blocks(s, err, errlen);
    if (rc == TDM_OK)
        rc = register_metrics(s, err, errlen);
    if (rc == TDM_OK)
        rc = start_engine(s, err, errlen);
    if (rc != TDM_OK)
        return rc;
    s->max_model_len = tdm_engine_get_config(s->engine)->max_model_len;

    s->info.served_name = s->text.served_name;
    s->info.vocab_size = mc->vocab_size;
    s->info.max_model_len = s->max_model_len;
    s->info.gen = &s->text.gen;
    return TDM_OK;
}

void tdm_worker_set_ready(struct tdm_worker *s)
{
    atomic_store(&s->state, STATE_READY);
}

int tdm_worker_load(struct tdm_worker *s, char *err, size_t errlen)
{
    int rc = tdm_worker_load_unready(s, err, errlen);
    if (rc == TDM_OK)
        tdm_worker_set_ready(s);
    return rc;
}

int tdm_worker_port(const struct tdm_worker *s)
{
    return s->port;
}

const char *tdm_worker_model_name(const struct tdm_worker *s)
{
    return s->text.served_name;
}

const char *tdm_worker_device(const struct tdm_worker *s)
{
    return s->device_desc[0] ? s->device_desc : "cpu";
}

int64_t tdm_worker_kv_capacity_tokens(const struct tdm_worker *s)
{
    return (int64_t)s->num_blocks * s->cfg.block_size;
}

int tdm_worker_drain(struct tdm_worker *s, double timeout_s)
{
    atomic_store(&s->state, STATE_DRAINING);
    int rc = TDM_OK;
    if (s->engine)
        rc = tdm_engine_drain(s->engine, timeout_s);
    // Handlers write their last chunks after the engine finished them.
    double deadline = tdm_now() + 5.0;
    pthread_mutex_lock(&s->mu);
    while (atomic_load(&s->inflight) > 0 && tdm_now() < deadline) {
        tdm_cond_wait_for(&s->idle_cv, &s->mu, 0.05);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

void tdm_worker_free(struct tdm_worker *s)
{
    if (s == NULL)
        return;
    atomic_store(&s->state, STATE_DRAINING);
    // Engine first: it aborts whatever still runs so that handlers waiting on
    // their streams return, then civetweb joins its threads.
    if (s->engine)
        tdm_engine_drain(s->engine, 0);
    tdm_http_server_stop(s->http);
    tdm_engine_free(s->engine);
    tdm_grammar_vocab_free(s->gvocab); // after the engine: it borrows it
    tdm_tracer_free(s->tracer); // after the engine: the last spans are queued, then flushed
    tdm_model_free(s->model);
    tdm_text_fini(&s->text);
    tdm_metrics_registry_free(s->reg);
    tdm_http_server_free(s->http);
    pthread_cond_destroy(&s->idle_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

// ---- for the roles (worker.h) ----------------------------------------------------------------
int tdm_worker_kv_transport_new(struct tdm_worker *s, enum tdm_kvx_role role,
                                const struct tdm_kvx_ops *table, double nccl_timeout,
                                struct tdm_kv_transport **out, struct tdm_kv_device_pool *dp)
{
    struct tdm_kv_cache *kv = tdm_engine_kv(s->engine);
    struct tdm_kv_storage *st = tdm_kv_storage(kv);
    memset(dp, 0, sizeof *dp);
    bool device = st->ops->device_pool != NULL;
    if (table == NULL && device)
        tdm_backend_module_kvx(&table, NULL, 0);
    struct tdm_kv_transport_config tc = {
        .role = role,
        .setting = (enum tdm_kvx_mode)s->cfg.kv_transfer,
        .ops = table,
        .num_layers = tdm_kv_config(kv)->num_layers,
        .num_blocks = tdm_kv_config(kv)->num_blocks,
        .own_layer = tdm_kv_storage_layer, // a send's source, a receive's destination
        .own_arg = st,
        .nccl_timeout = nccl_timeout,
    };
    tc.gpu = device && st->ops->device_pool(st, dp) == TDM_OK;
    tc.pool_base = dp->base;
    tc.elem_bytes = dp->elem_bytes;
    tc.block_bytes = dp->block_bytes;
    return tdm_kv_transport_new(out, &tc);
}

int tdm_worker_parts(struct tdm_worker *s, struct tdm_worker_parts *out)
{
    if (s->engine == NULL)
        return TDM_EBUSY;
    out->engine = s->engine;
    out->model = s->model;
    out->reg = s->reg;
    out->tracer = s->tracer;
    out->served_name = s->text.served_name;
    out->eos_ids = s->eos_ids;
    out->num_eos = s->num_eos;
    out->max_model_len = s->max_model_len;
    out->block_size = s->cfg.block_size;
    out->vocab_size = s->info.vocab_size;
    return TDM_OK;
}

const struct tdm_worker_config *tdm_worker_get_config(const struct tdm_worker *s)
{
    return &s->cfg;
}

void tdm_worker_set_health_details(struct tdm_worker *s, tdm_worker_health_fn fn, void *arg)
{
    atomic_store(&s->health_arg, arg);
    atomic_store(&s->health_fn, fn);
}

bool tdm_worker_ready(const struct tdm_worker *s)
{
    return atomic_load(&s->state) == STATE_READY;
}
