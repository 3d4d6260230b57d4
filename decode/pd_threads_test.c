// SPDX-License-Identifier: Apache-2.0
// pd_threads_test: a P/D request whose job thread cannot be started is
// refused, never run on the inbox's reader thread. That thread is the only
// reader of its peer's connection: a request run there (seconds to minutes)
// would hold back every later frame of that peer, its own Cancel included.
// A decode worker (P/D receiver) and a prefill worker (prefill service) run
// in this one process on the CPU backend with a tiny random model; the test
// plays the router (GenerateRequests to the decode inbox) and a decode worker
// (PrefillRequests to the prefill inbox) and reads the replies from its own
// inbox.
//
// Starting a job thread fails on demand: the test links with
// -Wl,--wrap=tdm_thread_start_detached, so every call from the statically
// linked roles (and the transport) goes through thread_fail_test.h and fails
// with TDM_EBUSY while tdm_test_thread_fails is above zero (pthread_create
// itself cannot be made to fail here: the core reuses waiting threads). The connections are made by a
// first request that succeeds, so the next thread asked for is the job thread
// of the refused request.
//   - decode: the GenerateRequest gets a final chunk with TDM_EBUSY, the
//     receiver lists no job afterwards, and the same request id then succeeds
//     on the same connection;
//   - prefill: the PrefillRequest gets an error result with TDM_EBUSY, the
//     engine request is gone (no job, nothing held, no KV referenced), the
//     failure is counted (reason "thread"), and the same transfer then
//     succeeds.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "thread_fail_test.h"
#include "engine.h"
#include "kv_cache.h"
#include "metrics.h"
#include "mkmodel.h"
#include "pd_codec.h"
#include "pd_receiver.h"
#include "prefill.h"
#include "tandem.pb-c.h"
#include "transport.h"
#include "worker.h"

// ---- the two workers and a router --------------------------------------------------------------
static char model_dir[] = "/tmp/pd_threads_test_XXXXXX";
static struct tdm_worker *dw, *pw;
static struct tdm_pd_receiver *rx;
static struct tdm_prefill_service *ps;
static struct tdm_net_inbox *router_in; // TokenChunks from rx, PrefillResults from ps
static struct tdm_net_outbox *router_out;
static const uint64_t router_instance = 0x5eed;

static struct tdm_worker *start_worker(void)
{
    struct tdm_worker_config c;
    tdm_worker_config_default(&c);
    snprintf(c.model, sizeof c.model, "%s", model_dir);
    snprintf(c.host, sizeof c.host, "127.0.0.1");
    snprintf(c.device, sizeof c.device, "cpu");
    c.port = 0;
    c.num_kv_blocks = 32;
    c.block_size = 16;
    c.enable_prefix_caching = false; // a finished request references no block
    c.max_num_seqs = 4;
    c.threads = 1;
    c.http_threads = 2;
    char err[512];
    struct tdm_worker *w = NULL;
    if (tdm_worker_new(&w, &c, err, sizeof err) != TDM_OK ||
        tdm_worker_load(w, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "worker: %s\n", err);
        tdm_worker_free(w);
        return NULL;
    }
    return w;
}

static int setup(void **state)
{
    (void)state;
    char err[512];
    if (mkdtemp(model_dir) == NULL)
        return -1;
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    dw = start_worker();
    pw = start_worker();
    if (dw == NULL || pw == NULL)
        return -1;
    struct tdm_pd_receiver_config rc;
    tdm_pd_receiver_config_default(&rc);
    snprintf(rc.nng_url, sizeof rc.nng_url, "tcp://127.0.0.1:0");
    struct tdm_prefill_config pc;
    tdm_prefill_config_default(&pc);
    snprintf(pc.nng_url, sizeof pc.nng_url, "tcp://127.0.0.1:0");
    if (tdm_pd_receiver_new(&rx, dw, &rc, err, sizeof err) != TDM_OK ||
        tdm_prefill_service_new(&ps, pw, &pc, err, sizeof err) != TDM_OK ||
        tdm_net_inbox_new(&router_in, "tcp://127.0.0.1:0", err, sizeof err) != TDM_OK ||
        tdm_net_outbox_new(&router_out, 50, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    atomic_store(&tdm_test_thread_fails, 0);
    tdm_net_outbox_free(router_out);
    tdm_net_inbox_free(router_in);
    tdm_prefill_service_free(ps);
    tdm_pd_receiver_free(rx);
    tdm_worker_free(pw);
    tdm_worker_free(dw);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

static void prompt_of(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++)
        p[i] = 3 + (i * 37 + salt * 11) % 250;
}

static Tandem__SamplingParams greedy(void)
{
    Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.0f;
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    sp.ignore_eos = true;
    sp.logprobs = -1;
    return sp;
}

// Waits up to timeout_s for *count() to read 0 (jobs that end after their reply).
static bool drains(int (*count)(void), double timeout_s)
{
    double end = tdm_now() + timeout_s;
    while (count() != 0) {
        if (tdm_now() > end)
            return false;
        tdm_sleep(0.005);
    }
    return true;
}

static int rx_jobs(void)
{
    return tdm_pd_receiver_num_jobs(rx);
}

static int ps_jobs(void)
{
    return tdm_prefill_service_num_jobs(ps);
}

// ---- the decode worker: GenerateRequests from the router ---------------------------------------
static void send_generate(const char *id, int max_tokens)
{
    int32_t prompt[24];
    prompt_of(prompt, 24, 1);
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_net_inbox_url(router_in);
    me.instance = router_instance;
    Tandem__SamplingParams sp = greedy();
    g.request_id = (char *)id;
    g.reply_to = &me;
    g.to_instance = tdm_pd_receiver_instance(rx);
    g.prompt = prompt;
    g.n_prompt = 24;
    g.sampling = &sp;
    g.max_tokens = max_tokens;
    g.deadline_unix = (double)time(NULL) + 120;
    g.local_fallback = true; // no prefill targets: prefilled here
    char err[256];
    assert_int_equal(tdm_pd_send(router_out, tdm_pd_receiver_url(rx), TDM_NET_GENERATE, &g.base,
                                 NULL, 0, 5.0, err, sizeof err),
                     TDM_OK);
}

struct outcome {
    int n_tokens;
    int error;
    char message[256];
};

// The next frame of this type on the test's inbox (others are dropped), or
// a failed test after end. Caller frees the message.
static struct tdm_net_msg *next_frame(int type, double end)
{
    for (;;) {
        assert_true(tdm_now() < end);
        struct tdm_net_msg *msg = NULL;
        char err[256];
        if (tdm_net_inbox_recv(router_in, 0.1, &msg, err, sizeof err) != TDM_OK)
            continue;
        if (tdm_net_msg_frame(msg)->type == type)
            return msg;
        tdm_net_msg_free(msg);
    }
}

// Reads TokenChunks until id's final one.
static void collect_tokens(const char *id, struct outcome *o, double timeout_s)
{
    memset(o, 0, sizeof *o);
    double end = tdm_now() + timeout_s;
    for (;;) {
        struct tdm_net_msg *msg = next_frame(TDM_NET_TOKENS, end);
        const struct tdm_net_frame *f = tdm_net_msg_frame(msg);
        Tandem__TokenChunk *c = tandem__token_chunk__unpack(NULL, f->msg_len, f->msg);
        tdm_net_msg_free(msg);
        if (c == NULL)
            continue;
        bool mine = strcmp(c->request_id, id) == 0, fin = c->finished;
        if (mine) {
            o->n_tokens += (int)c->n_tokens;
            if (fin) {
                o->error = c->error;
                snprintf(o->message, sizeof o->message, "%s", c->message ? c->message : "");
            }
        }
        tandem__token_chunk__free_unpacked(c, NULL);
        if (mine && fin)
            return;
    }
}

static void test_generate_refused(void **state)
{
    (void)state;
    struct outcome o;
    // The router's connection to the decode inbox and the decode worker's to
    // the router's are made here (their threads started).
    send_generate("gen-first", 4);
    collect_tokens("gen-first", &o, 60);
    assert_int_equal(o.error, 0);
    assert_int_equal(o.n_tokens, 4);
    assert_true(drains(rx_jobs, 10));

    // No job thread: refused at once as busy (a 503 for the client), not run
    // on the reader thread (which would stream the tokens as if nothing happened).
    atomic_store(&tdm_test_thread_fails, 1);
    double t0 = tdm_now();
    send_generate("gen-busy", 4);
    collect_tokens("gen-busy", &o, 10);
    assert_int_equal(atomic_load(&tdm_test_thread_fails), 0); // the job thread's start failed
    assert_int_equal(o.error, TDM_EBUSY);
    assert_int_equal(o.n_tokens, 0);
    assert_non_null(strstr(o.message, "cannot start a thread"));
    assert_true(tdm_now() - t0 < 5);
    assert_int_equal(tdm_pd_receiver_num_jobs(rx), 0); // unlisted before the reply went out

    // The same id again, on the same connection: it was forgotten, so it is
    // no duplicate, and the reader thread serves it as usual.
    send_generate("gen-busy", 4);
    collect_tokens("gen-busy", &o, 60);
    assert_int_equal(o.error, 0);
    assert_int_equal(o.n_tokens, 4);
    assert_true(drains(rx_jobs, 10));
}

// ---- the prefill worker: PrefillRequests from a decode worker ----------------------------------
static void send_prefill(uint64_t transfer_id)
{
    int32_t prompt[40];
    prompt_of(prompt, 40, 2);
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(pw, &parts), TDM_OK);
    Tandem__PrefillRequest m = TANDEM__PREFILL_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_net_inbox_url(router_in);
    me.instance = router_instance;
    Tandem__SamplingParams sp = greedy();
    struct tdm_kv_header h;
    tdm_kv_header_fill(tdm_engine_kv(parts.engine), parts.served_name, &h);
    h.num_tokens = 40;
    m.request_id = "pf";
    m.transfer_id = transfer_id;
    m.reply_to = &me;
    m.to_instance = tdm_prefill_service_instance(ps);
    m.prompt = prompt;
    m.n_prompt = 40;
    m.sampling = &sp;
    m.deadline_unix = (double)time(NULL) + 120;
    m.model = (char *)parts.served_name;
    m.num_blocks = 0; // the result only: no KV pushed
    m.kv_header.data = (uint8_t *)&h;
    m.kv_header.len = sizeof h;
    char err[256];
    assert_int_equal(tdm_pd_send(router_out, tdm_prefill_service_url(ps), TDM_NET_PREFILL, &m.base,
                                 NULL, 0, 5.0, err, sizeof err),
                     TDM_OK);
}

// Reads frames until the PrefillResult of transfer_id; returns its error.
static int collect_result(uint64_t transfer_id, char *message, size_t len, double timeout_s)
{
    double end = tdm_now() + timeout_s;
    for (;;) {
        struct tdm_net_msg *msg = next_frame(TDM_NET_PREFILL_RESULT, end);
        const struct tdm_net_frame *f = tdm_net_msg_frame(msg);
        Tandem__PrefillResult *r = tandem__prefill_result__unpack(NULL, f->msg_len, f->msg);
        tdm_net_msg_free(msg);
        if (r == NULL)
            continue;
        bool mine = r->transfer_id == transfer_id;
        int error = r->error;
        if (mine)
            snprintf(message, len, "%s", r->message ? r->message : "");
        tandem__prefill_result__free_unpacked(r, NULL);
        if (mine)
            return error;
    }
}

// True once the prefill engine holds nothing: no request, no referenced block.
static bool engine_idle(double timeout_s)
{
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(pw, &parts), TDM_OK);
    double end = tdm_now() + timeout_s;
    for (;;) {
        struct tdm_engine_stats st;
        tdm_engine_get_stats(parts.engine, &st);
        if (st.num_running == 0 && st.num_waiting == 0 && st.num_held == 0 && st.kv_usage == 0)
            return true;
        if (tdm_now() > end)
            return false;
        tdm_sleep(0.005);
    }
}

static bool metric_has(struct tdm_worker *w, const char *line)
{
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(w, &parts), TDM_OK);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(parts.reg, &text, &len), TDM_OK);
    bool found = strstr(text, line) != NULL;
    free(text);
    return found;
}

static void test_prefill_refused(void **state)
{
    (void)state;
    char message[256];
    // The connections both ways, as in the decode test.
    send_prefill(1);
    assert_int_equal(collect_result(1, message, sizeof message, 60), 0);
    assert_true(drains(ps_jobs, 10));
    assert_true(engine_idle(10));

    atomic_store(&tdm_test_thread_fails, 1);
    double t0 = tdm_now();
    send_prefill(2);
    assert_int_equal(collect_result(2, message, sizeof message, 10), TDM_EBUSY);
    assert_int_equal(atomic_load(&tdm_test_thread_fails), 0);
    assert_non_null(strstr(message, "cannot start a thread"));
    assert_true(tdm_now() - t0 < 5);
    // The submitted engine request was aborted and the job forgotten.
    assert_true(drains(ps_jobs, 10));
    assert_true(engine_idle(10));
    assert_true(metric_has(pw, "tandem:kv_transfer_failures_total{reason=\"thread\"} 1"));

    // The same transfer id again: not "already in progress", served as usual.
    send_prefill(2);
    assert_int_equal(collect_result(2, message, sizeof message, 60), 0);
    assert_true(drains(ps_jobs, 10));
    assert_true(engine_idle(10));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_generate_refused),
        cmocka_unit_test(test_prefill_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
