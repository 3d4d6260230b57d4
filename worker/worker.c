// SPDX-License-Identifier: Apache-2.0
// decode: the decode worker's server core (see decode.h). Two layers over
// common/http:
//   - routes (health, metrics, models, version, tokenize, detokenize);
//   - the generation path: parse, chat template, tokenize and context checks
//     (common/openai's tdm_oai_call) -> one engine request per choice -> read
//     the engine's output streams into the choices' assemblers (incremental
//     detokenizer, stop-string matcher) -> SSE chunks (common/openai's
//     tdm_oai_http_stream, with this file's engine pump) or one body.
// Invariants: an HTTP thread never touches the model or the KV cache, only the
// engine's queues; every engine request a handler submitted is aborted (if
// still running) and released before the handler returns, so a client that
// goes away never leaves KV blocks behind; a bad request is answered on its own
// thread and never reaches the engine.
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "chat.h"
#include "core.h"
#include "worker.h"
#include "worker_parts.h"
#include "engine.h"
#include "hf.h"
#include "http.h"
#include "hub.h"
#include "metrics.h"
#include "model.h"
#include "openai.h"
#include "openai_http.h"
#include "tokenizer.h"

#ifndef TANDEM_VERSION
#define TANDEM_VERSION "0.0.0"
#endif

#define MOD "decode"

enum server_state { STATE_LOADING = 0, STATE_READY, STATE_DRAINING };

struct tdm_worker {
    struct tdm_worker_config cfg;
    struct tdm_http_server *http;
    int port;
    _Atomic int state;
    _Atomic int inflight; // API handlers running (drain waits for 0)
    pthread_mutex_t mu;   // guards nothing but the drain wait's condvar
    pthread_cond_t idle_cv;

    // after load
    struct tdm_model *model;
    struct tdm_tokenizer *tok;
    struct tdm_chat_template *chat; // NULL when the model has no usable template
    char chat_err[256];             // why chat is unavailable
    struct tdm_generation_config gen;
    struct tdm_oai_model_info info;
    int32_t eos_ids[2 * TDM_MAX_EOS]; // config.json's and generation_config.json's
    int num_eos;
    struct tdm_metrics_registry *reg;
    struct tdm_metrics_vllm metrics;
    struct tdm_engine *engine;
    char served_name[TDM_WORKER_STR];
    char model_path[TDM_WORKER_STR]; // the folder --model names (a Hub id resolved to the cache)
    int max_model_len;
    int num_blocks;
    int64_t created;
};

// ---- generation -------------------------------------------------------------------------
// One call = the request's choices (common/openai: tokens -> text, stop
// strings, logprobs, finish) and one engine request per choice behind them;
// common/openai's openai_http writes the stream. A failure is answered by
// tdm_oai_error_from_err / tdm_oai_http_fail, as the router answers it (a full
// waiting queue and a draining server are 503 with Retry-After).
struct call {
    struct tdm_worker *s;
    struct tdm_http_conn *conn;
    struct tdm_oai_call oai;
    struct tdm_engine_request **reqs; // [oai.n_choices]; NULL once released
    bool client_gone;
};

// Consumes one engine chunk into choice i (common/openai's shared step). A
// stop string that completes aborts the engine request (counted as
// finished_reason "stop").
static int take_chunk(struct call *k, size_t i, const struct tdm_engine_chunk *c)
{
    const struct tdm_oai_gen_chunk g = {
        .tokens = c->tokens,
        .n = c->n > 0 ? (size_t)c->n : 0,
        .logprobs = c->logprobs,
        .top = c->top,
        .num_top = c->num_top,
        .finished = c->finished,
        .reason = c->reason,
        .stop_token = c->stop_token,
        .error = c->error,
        .message = c->message,
    };
    bool stopped = false;
    if (tdm_oai_call_take(&k->oai, i, &g, tdm_tok_eos_id(k->s->tok), &k->s->gen, &stopped) !=
        TDM_OK)
        return TDM_ENOMEM;
    if (stopped)
        tdm_engine_abort(k->s->engine, k->reqs[i], TDM_FINISH_STOP);
    return TDM_OK;
}

// Aborts what still runs and drops every handle (KV frees at the engine's next step).
static void release_all(struct call *k, enum tdm_finish why)
{
    for (size_t i = 0; k->reqs && i < k->oai.n_choices; i++) {
        if (k->reqs[i]) {
            if (!k->oai.choices[i].done)
                tdm_engine_abort(k->s->engine, k->reqs[i], why);
            tdm_engine_request_release(k->reqs[i]);
            k->reqs[i] = NULL;
        }
    }
}

static void call_fini(struct call *k)
{
    release_all(k, TDM_FINISH_ABORT);
    free(k->reqs);
    tdm_oai_call_fini(&k->oai);
}

// Submits one engine request per choice. On failure answers nothing; e is set.
static int submit_all(struct call *k, double arrival, struct tdm_oai_error *e)
{
    struct tdm_worker *s = k->s;
    const struct tdm_oai_request *rq = &k->oai.req;
    size_t n = (size_t)rq->n;
    k->reqs = calloc(k->oai.n_choices ? k->oai.n_choices : 1, sizeof *k->reqs);
    if (k->reqs == NULL)
        return tdm_oai_seterr(e, 500, NULL, "out of memory");
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        const struct tdm_oai_tokenized_prompt *p = &k->oai.prompts[k->oai.choices[i].prompt_idx];
        struct tdm_engine_request_params ep;
        tdm_engine_request_params_default(&ep);
        char id[128];
        snprintf(id, sizeof id, "%s-%zu", k->oai.resp.id, i);
        ep.id = id;
        ep.prompt = p->ids;
        ep.n_prompt = (int)p->n;
        ep.sampling = rq->sampling;
        // vLLM gives the i-th of n sequences the seed + i, so choices differ but
        // each is reproducible.
        if (ep.sampling.has_seed)
            ep.sampling.seed += (uint64_t)(i % n);
        ep.max_tokens = p->max_tokens;
        ep.eos_ids = s->eos_ids;
        ep.num_eos = s->num_eos;
        ep.arrival_time = arrival;
        ep.params_n = rq->n;
        char err[512];
        int rc = tdm_engine_submit(s->engine, &ep, &k->reqs[i], err, sizeof err);
        if (rc != TDM_OK) {
            k->reqs[i] = NULL;
            release_all(k, TDM_FINISH_ABORT);
            // The engine's message for a full queue names --max-waiting; the
            // router answers the same failure with the same body.
            return tdm_oai_error_from_err(e, rc,
                                          rc == TDM_ECLOSED ? "The server is shutting down." : err);
        }
    }
    return TDM_OK;
}

// Reads engine output for every unfinished choice; blocks briefly when none
// had anything. Returns the number of choices that progressed, -2 on ENOMEM.
// (The call's token source for tdm_oai_http_stream.)
static int pump(void *arg)
{
    struct call *k = arg;
    int progressed = 0, active = 0;
    for (size_t i = 0; i < k->oai.n_choices; i++)
        active += !k->oai.choices[i].done;
    bool waited = false;
    for (size_t i = 0; i < k->oai.n_choices; i++) {
        struct tdm_oai_asm *a = &k->oai.choices[i];
        if (a->done)
            continue;
        // With one choice block on its stream; with several poll them and block
        // a little on the first so the loop does not spin.
        double wait = 0;
        if (!waited) {
            wait = active == 1 ? 1.0 : 0.002;
            waited = true;
        }
        struct tdm_engine_chunk c;
        int rc = tdm_engine_stream_next(k->reqs[i], wait, &c);
        if (rc == TDM_ETIMEDOUT)
            continue;
        if (rc == TDM_ECLOSED) { // finish already taken (should not happen)
            a->done = true;
            continue;
        }
        if (take_chunk(k, i, &c) != TDM_OK)
            return -2;
        progressed++;
    }
    return progressed;
}

static void run_collect(struct call *k)
{
    while (!tdm_oai_call_done(&k->oai)) {
        if (pump(k) < 0) {
            tdm_oai_http_errorf(k->conn, 500, NULL, "out of memory");
            return;
        }
    }
    const struct tdm_oai_asm *bad = tdm_oai_call_failed(&k->oai);
    if (bad) {
        tdm_oai_http_fail(k->conn, bad->error, bad->message);
        return;
    }
    tdm_http_respond_json_owned(k->conn, 200, tdm_oai_call_body(&k->oai));
    k->client_gone = tdm_http_client_gone(k->conn);
}

static void handle_generate(struct tdm_worker *s, struct tdm_http_conn *c,
                            enum tdm_oai_kind kind)
{
    double arrival = tdm_now();
    struct call k;
    memset(&k, 0, sizeof k);
    k.s = s;
    k.conn = c;
    if (!tdm_oai_http_call_start(c, &k.oai, kind, &s->info, s->tok, s->chat, s->chat_err))
        goto out; // answered: an error, or echo only
    struct tdm_oai_error e;
    if (submit_all(&k, arrival, &e) != TDM_OK) {
        tdm_oai_http_error(c, &e);
        goto out;
    }
    // Streams probe the client after a second without tokens (queued, long prefill).
    if (k.oai.req.stream)
        k.client_gone = tdm_oai_http_stream(c, &k.oai, pump, &k, 1.0) == TDM_ECLOSED;
    else
        run_collect(&k);
    // One line per request; finish=abort when the client went away.
    struct tdm_oai_usage u;
    tdm_oai_call_usage(&k.oai, &u);
    const char *finish = k.client_gone ? "abort" : "-";
    if (!k.client_gone && k.oai.n_choices && k.oai.choices[0].finish != TDM_FINISH_NONE)
        finish = tdm_finish_name(k.oai.choices[0].finish);
    TDM_LOG_INFO(MOD, "req=%s done choices=%zu prompt_tokens=%d completion_tokens=%d finish=%s",
                 k.oai.resp.id, k.oai.n_choices, u.prompt_tokens, u.completion_tokens, finish);
out:
    call_fini(&k);
}

// ---- models ---------------------------------------------------------------------------------
static void handle_models(struct tdm_worker *s, struct tdm_http_conn *c)
{
    struct tdm_oai_model_card card = {
        .id = s->served_name,
        .root = s->cfg.model,
        .parent = NULL,
        .max_model_len = s->max_model_len,
        .created = s->created,
        .owned_by = NULL,
    };
    tdm_http_respond_json_owned(c, 200, tdm_oai_models_body(&card, 1));
}

// ---- routing --------------------------------------------------------------------------------
// common/http has already matched (method, path), checked the API key and read
// the body under --max-body-bytes (404/405/401/413 never get here).
static void on_health(struct tdm_http_conn *c, void *arg)
{
    struct tdm_worker *s = arg;
    int state = atomic_load(&s->state);
    if (state == STATE_READY)
        tdm_http_respond(c, 200, "application/json", "", 0);
    else
        tdm_oai_http_errorf(c, 503, NULL, "%s",
                            state == STATE_LOADING ? "The model is loading."
                                                   : "The server is draining.");
}

static void on_metrics(struct tdm_http_conn *c, void *arg)
{
    struct tdm_worker *s = arg;
    if (atomic_load(&s->state) == STATE_LOADING || s->reg == NULL) {
        tdm_http_respond(c, 200, TDM_METRICS_CONTENT_TYPE, "", 0);
        return;
    }
    char *text = NULL;
    size_t len = 0;
    if (tdm_metrics_render(s->reg, &text, &len) != TDM_OK) {
        tdm_oai_http_errorf(c, 500, NULL, "metrics rendering failed");
        return;
    }
    tdm_http_respond(c, 200, TDM_METRICS_CONTENT_TYPE, text, len);
    free(text);
}

static void on_version(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_http_respond_json_owned(c, 200, tdm_oai_version_body(TANDEM_VERSION));
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
        handle_generate(s, c, TDM_OAI_COMPLETION);
    else if (r == ROUTE_CHAT)
        handle_generate(s, c, TDM_OAI_CHAT);
    else if (r == ROUTE_TOKENIZE)
        tdm_oai_http_tokenize(c, &s->info, s->tok, s->chat, s->chat_err, s->max_model_len);
    else
        tdm_oai_http_detokenize(c, &s->info, s->tok);
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
int tdm_worker_new(struct tdm_worker **out, const struct tdm_worker_config *cfg,
                          char *err, size_t errlen)
{
    *out = NULL;
    if (cfg->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model DIR is required");
    struct tdm_worker *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    s->cfg = *cfg;
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
    struct tdm_http_config hc;
    memset(&hc, 0, sizeof hc);
    hc.host = cfg->host;
    hc.port = cfg->port;
    hc.num_threads = threads;
    hc.max_body_bytes = cfg->max_body_bytes;
    hc.api_key = cfg->api_key[0] ? cfg->api_key : NULL;
    hc.error_body = tdm_oai_http_error_body;
    static const struct {
        const char *method, *path;
        tdm_http_handler_fn fn;
    } routes[] = {
        {"GET", "/health", on_health},
        {"GET", "/ping", on_health},
        {"GET", "/metrics", on_metrics},
        {"GET", "/version", on_version},
        {"GET", "/v1/models", on_models},
        {"POST", "/v1/completions", on_completions},
        {"POST", "/v1/chat/completions", on_chat},
        {"POST", "/tokenize", on_tokenize},
        {"POST", "/detokenize", on_detokenize},
    };
    int rc = tdm_http_server_new(&s->http, &hc, err, errlen);
    for (size_t i = 0; rc == TDM_OK && i < sizeof routes / sizeof routes[0]; i++)
        rc = tdm_http_route(s->http, routes[i].method, routes[i].path, routes[i].fn, s);
    if (rc == TDM_OK)
        rc = tdm_http_server_start(s->http, err, errlen);
    if (rc != TDM_OK) {
        tdm_http_server_free(s->http);
        pthread_cond_destroy(&s->idle_cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return rc;
    }
    s->port = tdm_http_server_port(s->http);
    *out = s;
    return TDM_OK;
}

// Served name: the flag, else the Hub id as given (as vLLM names a model by its
// --model), else config.json's _name_or_path, else the folder name.
static void resolve_served_name(struct tdm_worker *s)
{
    if (s->cfg.served_model_name[0]) {
        snprintf(s->served_name, sizeof s->served_name, "%s", s->cfg.served_model_name);
        return;
    }
    struct stat st;
    if (stat(s->cfg.model, &st) != 0 || !S_ISDIR(st.st_mode)) { // a Hub id
        snprintf(s->served_name, sizeof s->served_name, "%s", s->cfg.model);
        return;
    }
    char *path = tdm_path_join(s->model_path, "config.json");
    char *text = NULL;
    size_t len = 0;
    char err[64];
    if (path && tdm_read_file(path, &text, &len, err, sizeof err) == TDM_OK) {
        cJSON *j = tdm_json_check_depth(text, len, TDM_JSON_MAX_DEPTH, NULL, 0)
                       ? NULL
                       : cJSON_ParseWithLength(text, len);
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(j, "_name_or_path");
        if (cJSON_IsString(n) && n->valuestring[0])
            snprintf(s->served_name, sizeof s->served_name, "%s", n->valuestring);
        cJSON_Delete(j);
    }
    free(text);
    free(path);
    if (s->served_name[0])
        return;
    char dir[TDM_WORKER_STR];
    snprintf(dir, sizeof dir, "%s", s->model_path);
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        dir[--n] = '\0';
    const char *base = strrchr(dir, '/');
    snprintf(s->served_name, sizeof s->served_name, "%s", base && base[1] ? base + 1 : dir);
}

// The text side of loading (tokenizer, generation_config.json, chat template);
// runs on its own thread beside the model load to shorten the cold start.
struct text_load {
    struct tdm_worker *s;
    int rc;
    char err[512];
};

static void *load_text_side(void *arg)
{
    struct text_load *t = arg;
    struct tdm_worker *s = t->s;
    const struct tdm_worker_config *cfg = &s->cfg;
    t->rc = tdm_tok_load(&s->tok, s->model_path, t->err, sizeof t->err);
    if (t->rc != TDM_OK)
        return NULL;
    t->rc = tdm_hf_generation_config_load(&s->gen, s->model_path, t->err, sizeof t->err);
    if (t->rc != TDM_OK)
        return NULL;
    const char *tmpl = tdm_tok_chat_template(s->tok);
    if (cfg->chat_template[0]) {
        // An explicit template must work.
        t->rc = tdm_chat_template_new(&s->chat, tmpl, cfg->chat_template, t->err, sizeof t->err);
    } else if (tmpl == NULL) {
        snprintf(s->chat_err, sizeof s->chat_err,
                 "tokenizer_config.json has no chat_template (use --chat-template)");
    } else if (tdm_chat_template_new(&s->chat, tmpl, NULL, s->chat_err, sizeof s->chat_err) !=
               TDM_OK) {
        s->chat = NULL;
        TDM_LOG_WARN(MOD, "chat endpoint disabled: %s", s->chat_err);
    }
    // HF hands the template the tokenizer's special tokens (bos_token, eos_token).
    if (s->chat && t->rc == TDM_OK &&
        (t->rc = tdm_chat_template_set_tokens(
             s->chat, tdm_tok_id_to_piece(s->tok, tdm_tok_bos_id(s->tok)),
             tdm_tok_id_to_piece(s->tok, tdm_tok_eos_id(s->tok)),
             tdm_tok_id_to_piece(s->tok, tdm_tok_pad_id(s->tok)))) != TDM_OK)
        snprintf(t->err, sizeof t->err, "chat template: setting special tokens failed");
    return NULL;
}

int tdm_worker_load_unready(struct tdm_worker *s, char *err, size_t errlen)
{
    const struct tdm_worker_config *cfg = &s->cfg;
    // A local folder is used as it is; an ORG/NAME id comes from the HF cache,
    // downloaded first when missing (HF_HOME, HF_TOKEN, HF_HUB_OFFLINE apply).
    int hrc = tdm_hub_resolve_model(cfg->model, cfg->revision[0] ? cfg->revision : NULL, NULL,
                                    s->model_path, sizeof s->model_path, err, errlen);
    if (hrc != TDM_OK)
        return hrc;
    struct text_load tl = {.s = s, .rc = TDM_OK};
    pthread_t th;
    bool threaded = pthread_create(&th, NULL, load_text_side, &tl) == 0;
    if (!threaded)
        load_text_side(&tl);

    struct tdm_model_opts mo;
    tdm_model_opts_default(&mo);
    mo.weights = cfg->int8 ? TDM_WEIGHTS_INT8 : TDM_WEIGHTS_BF16;
    mo.num_threads = cfg->threads;
    mo.max_batch_tokens = cfg->max_num_batched_tokens;
    mo.max_batch_seqs = cfg->max_num_seqs;
    mo.enforce_eager = cfg->enforce_eager;
    int rc = tdm_model_opts_set_device(&mo, cfg->device, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_model_load(&s->model, s->model_path, &mo, err, errlen);
    if (threaded)
        pthread_join(th, NULL);
    if (rc != TDM_OK)
        return rc;
    if (tl.rc != TDM_OK)
        return tdm_seterr(err, errlen, tl.rc, "%s", tl.err);
    const struct tdm_model_config *mc = tdm_model_config(s->model);
    if (cfg->max_model_len > mc->max_position_embeddings)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--max-model-len %d exceeds the model's max_position_embeddings %d",
                          cfg->max_model_len, mc->max_position_embeddings);
    s->max_model_len = cfg->max_model_len ? cfg->max_model_len : mc->max_position_embeddings;
    for (int i = 0; i < mc->num_eos_token_ids; i++)
        s->eos_ids[s->num_eos++] = mc->eos_token_ids[i];
    for (int i = 0; i < s->gen.num_eos_token_ids; i++) {
        bool dup = false;
        for (int j = 0; j < s->num_eos; j++)
            dup |= s->eos_ids[j] == s->gen.eos_token_ids[i];
        if (!dup && s->gen.eos_token_ids[i] >= 0 && s->gen.eos_token_ids[i] < mc->vocab_size)
            s->eos_ids[s->num_eos++] = s->gen.eos_token_ids[i];
    }
    resolve_served_name(s);

    // The pool size is computed here (as the engine would) because
    // vllm:cache_config_info must carry num_gpu_blocks when it is registered.
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(s->model, &kc);
    kc.block_size = cfg->block_size;
    kc.num_blocks = 1;
    size_t bb = tdm_kv_block_bytes(&kc);
    int nb = cfg->num_kv_blocks;
    if (nb == 0) {
        // A device backend sizes its pool from --gpu-memory-utilization.
        int dev_blocks = 0;
        rc = tdm_model_kv_capacity(s->model, &kc, cfg->gpu_memory_utilization, &dev_blocks, err,
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

    rc = tdm_metrics_registry_new(&s->reg, NULL, 0, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_metrics_vllm_config mcfg;
    memset(&mcfg, 0, sizeof mcfg);
    mcfg.model_name = s->served_name;
    mcfg.engine = "0";
    mcfg.max_model_len = s->max_model_len;
    mcfg.cache.block_size = cfg->block_size;
    mcfg.cache.num_gpu_blocks = nb;
    mcfg.cache.num_cpu_blocks = -1;
    mcfg.cache.gpu_memory_utilization = cfg->gpu_memory_utilization;
    mcfg.cache.enable_prefix_caching = cfg->enable_prefix_caching;
    rc = tdm_metrics_vllm_register(&s->metrics, s->reg, &mcfg, err, errlen);
    if (rc != TDM_OK)
        return rc;

    struct tdm_engine_config ec;
    tdm_engine_config_default(&ec);
    ec.block_size = cfg->block_size;
    ec.num_blocks = nb;
    ec.enable_prefix_caching = cfg->enable_prefix_caching;
    ec.max_num_batched_tokens = cfg->max_num_batched_tokens;
    ec.max_num_seqs = cfg->max_num_seqs;
    ec.max_model_len = s->max_model_len;
    ec.max_waiting = cfg->max_waiting;
    ec.metrics = &s->metrics;
    // KV events for the router's exact prefix index (read by the P/D receiver's
    // load reports); with prefix caching off there are no cached blocks to report.
    ec.kv_event_capacity = cfg->enable_prefix_caching ? 8192 : 0;
    rc = tdm_engine_new(&s->engine, s->model, &ec, err, errlen);
    if (rc != TDM_OK)
        return rc;
    s->max_model_len = tdm_engine_get_config(s->engine)->max_model_len;

    s->info.served_name = s->served_name;
    s->info.vocab_size = mc->vocab_size;
    s->info.max_model_len = s->max_model_len;
    s->info.gen = &s->gen;
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
    return s->served_name;
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
    tdm_model_free(s->model);
    tdm_chat_template_free(s->chat);
    tdm_tok_free(s->tok);
    tdm_metrics_registry_free(s->reg);
    tdm_http_server_free(s->http);
    pthread_cond_destroy(&s->idle_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

// ---- P/D hook (decode_parts.h) -------------------------------------------------------------
int tdm_worker_parts(struct tdm_worker *s, struct tdm_worker_parts *out)
{
    if (s->engine == NULL)
        return TDM_EBUSY;
    out->engine = s->engine;
    out->model = s->model;
    out->reg = s->reg;
    out->served_name = s->served_name;
    out->eos_ids = s->eos_ids;
    out->num_eos = s->num_eos;
    out->max_model_len = s->max_model_len;
    out->block_size = s->cfg.block_size;
    out->vocab_size = s->info.vocab_size;
    return TDM_OK;
}

bool tdm_worker_ready(const struct tdm_worker *s)
{
    return atomic_load(&s->state) == STATE_READY;
}
