// SPDX-License-Identifier: Apache-2.0
// worker_test: the worker base's lifecycle and route table (worker.c) over
// mkmodel's tiny model on 127.0.0.1, driven by raw sockets
// (common/edge/http/http_test_client): every API route 503 "loading" until ready
// (also after tdm_worker_load_unready), /metrics empty until then, 200 and a
// generation once ready, the role's /health details, 503 again once it
// drains; the route table's methods; what the load computes (the KV pool
// from --num-kv-blocks or --kv-cache-memory, the merged EOS ids, the device,
// tdm_worker_parts) and its errors (no --model, a missing folder, a
// --kv-cache-memory without room for one block).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "http_test_client.h"
#include "mkmodel.h"
#include "engine.h" // tdm_engine_phase_name
#include "worker.h"

static char model_dir[64]; // mkmodel's tiny model: vocab 512, eos 511 (config) + [511, 509]

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    strcpy(model_dir, "/tmp/tdm_worker_modelXXXXXX");
    if (mkdtemp(model_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_mkmodel_remove(model_dir);
    return 0;
}

// A small worker on an ephemeral loopback port: one compute thread, a few
// HTTP threads, no weight cache written under $HOME.
static void small_config(struct tdm_worker_config *cfg)
{
    tdm_worker_config_default(cfg);
    snprintf(cfg->model, sizeof cfg->model, "%s", model_dir);
    snprintf(cfg->host, sizeof cfg->host, "127.0.0.1");
    snprintf(cfg->device, sizeof cfg->device, "cpu");
    cfg->port = 0;
    cfg->threads = 1;
    cfg->http_threads = 4;
    cfg->max_num_seqs = 4;
    cfg->num_kv_blocks = 32;
    cfg->weight_cache = false;
}

static struct tdm_worker *new_worker(const struct tdm_worker_config *cfg)
{
    struct tdm_worker *s = NULL;
    char err[512];
    int rc = tdm_worker_new(&s, cfg, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("tdm_worker_new: %s", err);
    return s;
}

// One request on a new connection; the response (heap) and its status.
static char *request(struct tdm_worker *s, const char *method, const char *path, int *status)
{
    char req[256];
    snprintf(req, sizeof req, "%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", method,
             path);
    char *resp = roundtrip(tdm_worker_port(s), req);
    *status = status_of(resp);
    return resp;
}

// Asserts method path answers status with msg in the body (msg may be NULL).
static void expect(struct tdm_worker *s, const char *method, const char *path, int status,
                   const char *msg)
{
    int st;
    char *resp = request(s, method, path, &st);
    if (st != status || (msg && !strstr(body_of(resp), msg)))
        fail_msg("%s %s: want %d \"%s\", got %d: %s", method, path, status, msg ? msg : "", st,
                 resp);
    free(resp);
}

// The value of tandem:engine_thread_seconds_total's series for phase, -1
// where /metrics has none.
static double thread_seconds(struct tdm_worker *s, const char *phase)
{
    int st;
    char *resp = request(s, "GET", "/metrics", &st);
    char key[64];
    snprintf(key, sizeof key, "phase=\"%s\"} ", phase);
    double v = -1;
    for (const char *at = body_of(resp); (at = strstr(at, "tandem:engine_thread_seconds_total{"));
         at++) {
        const char *k = strstr(at, key), *eol = strchr(at, '\n');
        if (k && (!eol || k < eol)) {
            v = strtod(k + strlen(key), NULL);
            break;
        }
    }
    free(resp);
    return v;
}

// Every route of the table answers "loading" (or, for /metrics and
// /version, its loading-time answer).
static void expect_loading(struct tdm_worker *s)
{
    expect(s, "GET", "/health", 503, "The model is loading.");
    expect(s, "GET", "/ping", 503, "The model is loading.");
    expect(s, "GET", "/v1/models", 503, "The model is loading.");
    expect(s, "POST", "/v1/completions", 503, "The model is loading.");
    expect(s, "POST", "/v1/chat/completions", 503, "The model is loading.");
    expect(s, "POST", "/tokenize", 503, "The model is loading.");
    expect(s, "POST", "/detokenize", 503, "The model is loading.");
    expect(s, "GET", "/version", 200, "version");
    int st;
    char *resp = request(s, "GET", "/metrics", &st);
    assert_int_equal(st, 200);
    assert_string_equal(body_of(resp), ""); // no registry yet
    free(resp);
    assert_false(tdm_worker_ready(s));
}

static void health_details(void *arg, char *buf, size_t len)
{
    snprintf(buf, len, "\"role\":\"%s\"", (const char *)arg);
}

// new -> loaded but not ready -> ready -> draining, as a client sees it.
static void test_lifecycle(void **state)
{
    (void)state;
    struct tdm_worker_config cfg;
    small_config(&cfg);
    struct tdm_worker *s = new_worker(&cfg);
    assert_true(tdm_worker_port(s) > 0);
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(s, &parts), TDM_EBUSY);
    expect_loading(s);

    char err[512];
    int rc = tdm_worker_load_unready(s, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("load: %s", err);
    expect_loading(s); // a role opens its other listeners first
    assert_int_equal(tdm_worker_parts(s, &parts), TDM_OK);

    tdm_worker_set_ready(s);
    assert_true(tdm_worker_ready(s));
    int st;
    char *resp = request(s, "GET", "/health", &st);
    assert_int_equal(st, 200);
    assert_string_equal(body_of(resp), "");
    free(resp);
    expect(s, "GET", "/ping", 200, NULL);
    expect(s, "GET", "/v1/models", 200, tdm_worker_model_name(s));
    expect(s, "GET", "/metrics", 200, "vllm:cache_config_info");
    expect(s, "GET", "/metrics", 200, "num_gpu_blocks=\"32\"");
    expect(s, "GET", "/metrics", 200, "tandem:num_prompt_tokens_waiting");
    expect(s, "GET", "/metrics", 200, "# TYPE tandem:engine_steps_ahead_total counter");
    expect(s, "GET", "/metrics", 200, "# TYPE tandem:engine_list_rows_total counter");
    expect(s, "GET", "/metrics", 200, "tandem:engine_steps_ahead_total{");
    expect(s, "GET", "/metrics", 200, "tandem:engine_list_rows_total{");
    resp = post(tdm_worker_port(s), "/v1/completions",
                "{\"prompt\":\"hello\",\"max_tokens\":3,\"ignore_eos\":true}");
    assert_int_equal(status_of(resp), 200);
    assert_non_null(strstr(body_of(resp), "\"completion_tokens\":3"));
    free(resp);
    // The engine thread's phases: the forwards of those tokens counted (the
    // stats are published when the loop comes round after the last step),
    // and every phase has its series.
    expect(s, "GET", "/metrics", 200, "# TYPE tandem:engine_thread_seconds_total counter");
    double fwd = 0;
    for (int i = 0; i < 200 && (fwd = thread_seconds(s, "forward")) <= 0; i++)
        tdm_sleep(0.01);
    assert_true(fwd > 0);
    for (int p = 0; p < TDM_ENGINE_PHASES; p++)
        assert_true(thread_seconds(s, tdm_engine_phase_name(p)) >= 0);

    // A role's details join /health's body.
    tdm_worker_set_health_details(s, health_details, "decode");
    expect(s, "GET", "/health", 200, "{\"status\":\"ok\",\"role\":\"decode\"}");
    tdm_worker_set_health_details(s, NULL, NULL);

    assert_int_equal(tdm_worker_drain(s, 5.0), TDM_OK);
    assert_false(tdm_worker_ready(s));
    expect(s, "GET", "/health", 503, "The server is draining.");
    expect(s, "GET", "/v1/models", 503, "The server is shutting down.");
    expect(s, "POST", "/v1/completions", 503, "The server is shutting down.");
    expect(s, "GET", "/metrics", 200, "vllm:cache_config_info"); // still scraped while draining
    tdm_worker_free(s);
}

// The route table: each path under its method only; nothing else.
static void test_routes(void **state)
{
    (void)state;
    struct tdm_worker_config cfg;
    small_config(&cfg);
    struct tdm_worker *s = new_worker(&cfg);
    expect(s, "POST", "/health", 405, NULL);
    expect(s, "POST", "/metrics", 405, NULL);
    expect(s, "POST", "/v1/models", 405, NULL);
    expect(s, "GET", "/v1/completions", 405, NULL);
    expect(s, "GET", "/v1/chat/completions", 405, NULL);
    expect(s, "GET", "/tokenize", 405, NULL);
    expect(s, "GET", "/detokenize", 405, NULL);
    expect(s, "GET", "/v1/embeddings", 404, NULL);
    expect(s, "GET", "/", 404, NULL);
    tdm_worker_free(s);
}

// What the load computes: the pool, the EOS ids, the device and the parts.
static void test_load_results(void **state)
{
    (void)state;
    struct tdm_worker_config cfg;
    small_config(&cfg);
    cfg.block_size = 8;
    struct tdm_worker *s = new_worker(&cfg);
    char err[512];
    int rc = tdm_worker_load(s, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("load: %s", err);
    assert_true(tdm_worker_ready(s));
    assert_int_equal(tdm_worker_kv_capacity_tokens(s), 32 * 8); // --num-kv-blocks 32
    assert_string_equal(tdm_worker_device(s), "cpu");
    struct tdm_worker_parts p;
    assert_int_equal(tdm_worker_parts(s, &p), TDM_OK);
    assert_non_null(p.engine);
    assert_non_null(p.model);
    assert_non_null(p.reg);
    assert_null(p.tracer);
    assert_string_equal(p.served_name, tdm_worker_model_name(s));
    assert_int_equal(p.block_size, 8);
    assert_int_equal(p.vocab_size, 512);
    assert_int_equal(p.max_model_len, 4096); // the model's context
    // config.json's 511, then generation_config.json's [511, 509] less the repeat.
    assert_int_equal(p.num_eos, 2);
    assert_int_equal(p.eos_ids[0], 511);
    assert_int_equal(p.eos_ids[1], 509);
    tdm_worker_free(s);

    // Without --num-kv-blocks the pool is what --kv-cache-memory holds.
    small_config(&cfg);
    cfg.num_kv_blocks = 0;
    cfg.max_model_len = 256;
    s = new_worker(&cfg);
    rc = tdm_worker_load(s, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("load: %s", err);
    // tiny: 2 layers x K and V x 16 tokens x 2 KV heads x 16 dims x 2 bytes (bf16)
    size_t block_bytes = 2 * 2 * 16 * 2 * 16 * 2;
    assert_int_equal(tdm_worker_kv_capacity_tokens(s),
                     (int64_t)(cfg.kv_cache_memory / block_bytes) * 16);
    assert_int_equal(tdm_worker_parts(s, &p), TDM_OK);
    assert_int_equal(p.max_model_len, 256);
    tdm_worker_free(s);
}

// The load's errors leave the server answering "loading".
static void test_load_errors(void **state)
{
    (void)state;
    struct tdm_worker_config cfg;
    char err[512];
    struct tdm_worker *s = NULL;
    small_config(&cfg);
    cfg.model[0] = '\0';
    assert_int_equal(tdm_worker_new(&s, &cfg, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--model DIR is required");
    assert_null(s);

    small_config(&cfg);
    snprintf(cfg.model, sizeof cfg.model, "%s/missing", model_dir);
    s = new_worker(&cfg);
    assert_int_not_equal(tdm_worker_load(s, err, sizeof err), TDM_OK);
    assert_non_null(strstr(err, "missing"));
    expect(s, "GET", "/health", 503, "The model is loading.");
    tdm_worker_free(s);

    small_config(&cfg);
    cfg.num_kv_blocks = 0;
    cfg.kv_cache_memory = 1000;
    s = new_worker(&cfg);
    assert_int_equal(tdm_worker_load(s, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--kv-cache-memory 1000 bytes holds no KV block of 4096 bytes");
    assert_false(tdm_worker_ready(s));
    expect(s, "GET", "/health", 503, "The model is loading.");
    tdm_worker_free(s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lifecycle),
        cmocka_unit_test(test_routes),
        cmocka_unit_test(test_load_results),
        cmocka_unit_test(test_load_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
