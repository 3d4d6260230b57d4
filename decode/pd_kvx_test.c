// SPDX-License-Identifier: Apache-2.0
// pd_kvx_test: KV from a prefill worker straight into a decode worker's
// blocks (CUDA IPC, issue 10), the whole control flow without a GPU. A decode
// worker (P/D receiver) and a prefill worker (prefill service) run in this one
// process on the CUDA backend over the execution-model emulator (their KV
// pools are "device" allocations, each one slab), with a fake struct
// tdm_kvx_ops: the pool handle is the slab's address, opening it returns that
// address (one process), copies are memcpy and land only when their event is
// observed complete, and the test can hold events pending (a copy that
// completes late). A fake router sends GenerateRequests to the decode inbox
// and reads the TokenChunks.
//   - a pool handle that does not open: the pair falls back to nng (the why
//     in /health), output unchanged;
//   - equivalence: greedy and seeded requests prefilled remotely over the
//     in-place path give exactly the tokens of the decode worker alone, the
//     KV went as device copies (no payload), the pair reports cuda-ipc in the
//     pair table (/health) and tandem:kv_transfers_total{transport="cuda-ipc"};
//   - memory safety: a request cancelled while its copy is still pending
//     keeps its reserved blocks until the copy's completion is known; a new
//     request that needs those blocks does not get them before the copy
//     landed, and runs after.
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
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "backend.h"
#include "core.h"
#include "cuda_backend.h"
#include "engine.h"
#include "kvx.h"
#include "metrics.h"
#include "mkmodel.h"
#include "pd_codec.h"
#include "pd_receiver.h"
#include "pd.h"
#include "prefill.h"
#include "tandem.pb-c.h"
#include "transport.h"
#include "worker.h"

// ---- the fake device table -----------------------------------------------------------------
struct pending_copy {
    void *dst;
    const void *src;
    size_t bytes;
};
static struct {
    pthread_mutex_t mu;
    struct pending_copy q[4096];
    int nq, done;
    atomic_bool hold;         // events stay pending while set
    atomic_bool pending_seen; // an event was queried while held
    atomic_bool fail_open;    // ipc_open fails (a handle from another node, a driver error)
    int exports, opens, closes, copies;
    uint64_t bytes;
    double t_landed; // tdm_now() when the last held copies landed
} X = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int x_ipc_export(void *ctx, void *dev_ptr, uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES],
                        char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    memset(handle, 0, TDM_KVX_IPC_HANDLE_BYTES);
    memcpy(handle, &dev_ptr, sizeof dev_ptr);
    pthread_mutex_lock(&X.mu);
    X.exports++;
    pthread_mutex_unlock(&X.mu);
    return 0;
}

static int x_ipc_open(void *ctx, const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr,
                      char *err, size_t errlen)
{
    (void)ctx;
    if (atomic_load(&X.fail_open)) {
        snprintf(err, errlen, "invalid device context");
        return -1;
    }
    memcpy(dev_ptr, handle, sizeof *dev_ptr);
    pthread_mutex_lock(&X.mu);
    X.opens++;
    pthread_mutex_unlock(&X.mu);
    return 0;
}

static int x_ipc_close(void *ctx, void *dev_ptr)
{
    (void)ctx, (void)dev_ptr;
    pthread_mutex_lock(&X.mu);
    X.closes++;
    pthread_mutex_unlock(&X.mu);
    return 0;
}

static int x_copy_async(void *ctx, void *dst, const void *src, size_t bytes, char *err,
                        size_t errlen)
{
    (void)ctx;
    pthread_mutex_lock(&X.mu);
    int rc = 0;
    if (X.nq == (int)(sizeof X.q / sizeof X.q[0])) {
        snprintf(err, errlen, "fake copy queue full");
        rc = -1;
    } else {
        X.q[X.nq++] = (struct pending_copy){dst, src, bytes};
        X.copies++;
        X.bytes += bytes;
    }
    pthread_mutex_unlock(&X.mu);
    return rc;
}

static int x_event_record(void *ctx, void **event, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    pthread_mutex_lock(&X.mu);
    *event = (void *)(uintptr_t)(X.nq + 1);
    pthread_mutex_unlock(&X.mu);
    return 0;
}

static int x_event_query(void *ctx, void *event)
{
    (void)ctx;
    if (atomic_load(&X.hold)) {
        atomic_store(&X.pending_seen, true);
        return 0;
    }
    pthread_mutex_lock(&X.mu);
    int upto = (int)(uintptr_t)event - 1;
    if (X.done < upto)
        X.t_landed = tdm_now();
    for (; X.done < upto; X.done++)
        memcpy(X.q[X.done].dst, X.q[X.done].src, X.q[X.done].bytes);
    pthread_mutex_unlock(&X.mu);
    return 1;
}

static void x_event_free(void *ctx, void *event)
{
    (void)ctx, (void)event;
}

static const struct tdm_kvx_ops FAKE = {
    .ipc_open = x_ipc_open,
    .ipc_close = x_ipc_close,
    .ipc_export = x_ipc_export,
    .copy_async = x_copy_async,
    .event_record = x_event_record,
    .event_query = x_event_query,
    .event_free = x_event_free,
};

// ---- the two workers and a router --------------------------------------------------------------
enum { NUM_BLOCKS = 16, BLOCK = 16 };
static char model_dir[] = "/tmp/pd_kvx_test_XXXXXX";
static struct tdm_worker *dw, *pw;
static struct tdm_pd_receiver *rx;
static struct tdm_prefill_service *ps;
static struct tdm_net_inbox *router_in;
static struct tdm_net_outbox *router_out;
static uint64_t router_instance = 0x5eed;

static struct tdm_worker *start_worker(void)
{
    struct tdm_worker_config c;
    tdm_worker_config_default(&c);
    snprintf(c.model, sizeof c.model, "%s", model_dir);
    snprintf(c.host, sizeof c.host, "127.0.0.1");
    c.port = 0;
    snprintf(c.device, sizeof c.device, "cuda");
    c.enforce_eager = true; // the emulator captures one graph at a time process-wide
    c.num_kv_blocks = NUM_BLOCKS;
    c.block_size = BLOCK;
    c.enable_prefix_caching = false; // every request transfers its whole prompt
    c.max_num_seqs = 4;
    c.threads = 1;
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
    if (tdm_backend_register(&tdm_cuda_emu_backend_ops) != TDM_OK || mkdtemp(model_dir) == NULL)
        return -1;
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    s.num_layers = 4; // with one layer per frame: four frames a transfer
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
    rc.layers_per_frame = 1;
    rc.kvx_ops = &FAKE;
    // Not a liveness test: under ASan on a loaded machine the emulated kernels
    // of both engines (one grid at a time) can keep a worker's threads from
    // answering a load query for seconds.
    rc.prefill_liveness = 60;
    rc.connect_grace = 30;
    rc.prefill_timeout = 280; // the emulated kernels under ASan are slow
    rc.transfer_timeout = 280;
    struct tdm_prefill_config pc;
    tdm_prefill_config_default(&pc);
    snprintf(pc.nng_url, sizeof pc.nng_url, "tcp://127.0.0.1:0");
    pc.kvx_ops = &FAKE;
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
    atomic_store(&X.hold, false); // a failed test must not leave a prefill job polling
    tdm_net_outbox_free(router_out);
    tdm_net_inbox_free(router_in);
    tdm_prefill_service_free(ps);
    tdm_pd_receiver_free(rx);
    tdm_worker_free(pw);
    tdm_worker_free(dw);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

static void send_generate(const char *id, const int32_t *prompt, int n, int max_tokens, bool seeded,
                          bool remote)
{
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_net_inbox_url(router_in);
    me.instance = router_instance;
    Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
    sp.temperature = seeded ? 0.9f : 0.0f;
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    sp.has_seed = seeded;
    sp.seed = 1234;
    sp.ignore_eos = true;
    sp.logprobs = -1;
    Tandem__PrefillTarget t = TANDEM__PREFILL_TARGET__INIT, *tp = &t;
    t.url = (char *)tdm_prefill_service_url(ps);
    t.instance = tdm_prefill_service_instance(ps);
    g.request_id = (char *)id;
    g.reply_to = &me;
    g.to_instance = tdm_pd_receiver_instance(rx);
    g.prompt = (int32_t *)prompt;
    g.n_prompt = (size_t)n;
    g.sampling = &sp;
    g.max_tokens = max_tokens;
    g.deadline_unix = (double)time(NULL) + 120;
    g.n_prefill = remote ? 1 : 0;
    g.prefill = remote ? &tp : NULL;
    char err[256];
    assert_int_equal(tdm_pd_send(router_out, tdm_pd_receiver_url(rx), TDM_NET_GENERATE, &g.base,
                                 NULL, 0, 5.0, err, sizeof err),
                     TDM_OK);
}

static void send_cancel(const char *id)
{
    Tandem__Cancel m = TANDEM__CANCEL__INIT;
    m.request_id = (char *)id;
    m.to_instance = tdm_pd_receiver_instance(rx);
    char err[256];
    assert_int_equal(tdm_pd_send(router_out, tdm_pd_receiver_url(rx), TDM_NET_CANCEL, &m.base,
                                 NULL, 0, 5.0, err, sizeof err),
                     TDM_OK);
}

// Reads the request's chunks until it finishes; returns the number of tokens.
struct outcome {
    int32_t tokens[256];
    int n;
    int error;
    char prefilled_by[256];
    char message[256];
};

static void collect(const char *id, struct outcome *o, double timeout_s)
{
    memset(o, 0, sizeof *o);
    double end = tdm_now() + timeout_s;
    for (;;) {
        assert_true(tdm_now() < end);
        struct tdm_net_msg *msg = NULL;
        char err[256];
        if (tdm_net_inbox_recv(router_in, 0.2, &msg, err, sizeof err) != TDM_OK)
            continue;
        const struct tdm_net_frame *f = tdm_net_msg_frame(msg);
        Tandem__TokenChunk *c = f->type == TDM_NET_TOKENS
                                    ? tandem__token_chunk__unpack(NULL, f->msg_len, f->msg)
                                    : NULL;
        tdm_net_msg_free(msg);
        if (c == NULL)
            continue;
        bool mine = strcmp(c->request_id, id) == 0, fin = c->finished;
        if (mine) {
            for (size_t i = 0; i < c->n_tokens && o->n < 256; i++)
                o->tokens[o->n++] = c->tokens[i];
            if (c->prefilled_by && c->prefilled_by[0])
                snprintf(o->prefilled_by, sizeof o->prefilled_by, "%s", c->prefilled_by);
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

static void prompt_of(int32_t *p, int n, int salt)
{
    for (int i = 0; i < n; i++)
        p[i] = 3 + (i * 37 + salt * 11) % 250;
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

static double metric_value(struct tdm_worker *w, const char *name)
{
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(w, &parts), TDM_OK);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(parts.reg, &text, &len), TDM_OK);
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *at = strstr(text, key);
    double v = at ? strtod(at + strlen(key), NULL) : -1;
    free(text);
    return v;
}

// GET /health of a worker: the body (empty string when none).
static void get_health(struct tdm_worker *w, char *body, size_t len)
{
    body[0] = '\0';
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)tdm_worker_port(w))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    const char *req = "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    assert_true(write(fd, req, strlen(req)) == (ssize_t)strlen(req));
    char buf[8192];
    size_t got = 0;
    ssize_t n;
    while (got + 1 < sizeof buf && (n = read(fd, buf + got, sizeof buf - 1 - got)) > 0)
        got += (size_t)n;
    buf[got] = '\0';
    close(fd);
    assert_non_null(strstr(buf, " 200 "));
    const char *b = strstr(buf, "\r\n\r\n");
    snprintf(body, len, "%s", b ? b + 4 : "");
}

// ---- tests ---------------------------------------------------------------------------------------
static double nng_bytes; // the prefill worker's bytes counter after the nng transfer
// The pool handle does not open in the prefill worker: the pair chooses again
// without CUDA IPC and the KV comes over nng, output unchanged.
static void test_ipc_open_fails(void **state)
{
    (void)state;
    int32_t prompt[40];
    prompt_of(prompt, 40, 3);
    struct outcome local, remote;
    send_generate("nf-local", prompt, 40, 8, false, false);
    collect("nf-local", &local, 280);
    atomic_store(&X.fail_open, true);
    send_generate("nf-remote", prompt, 40, 8, false, true);
    collect("nf-remote", &remote, 280);
    atomic_store(&X.fail_open, false);
    nng_bytes = metric_value(pw, "tandem:kv_transfer_bytes_total");
    assert_true(nng_bytes > 0);
    assert_int_equal(remote.error, 0);
    assert_string_equal(remote.prefilled_by, tdm_prefill_service_url(ps));
    assert_int_equal(remote.n, 8);
    assert_memory_equal(local.tokens, remote.tokens, sizeof(int32_t) * 8);
    pthread_mutex_lock(&X.mu);
    assert_int_equal(X.copies, 0);
    assert_int_equal(X.opens, 0);
    pthread_mutex_unlock(&X.mu);
    assert_true(metric_has(pw, "tandem:kv_transfers_total{transport=\"nng\"} 1"));
    assert_true(metric_has(dw, "tandem:kv_transfers_total{transport=\"nng\"} 1"));
    char body[4096];
    get_health(pw, body, sizeof body);
    assert_non_null(strstr(body, "\"transport\":\"nng\",\"transfers\":1,\"why\":\"cuda-ipc failed: "));
    assert_non_null(strstr(body, "invalid device context"));
    get_health(dw, body, sizeof body);
    assert_non_null(strstr(body, "\"transport\":\"nng\",\"transfers\":1,\"why\":\"cuda-ipc failed: "));
}

static void test_equivalence(void **state)
{
    (void)state;
    int32_t prompt[40];
    for (int seeded = 0; seeded < 2; seeded++) {
        prompt_of(prompt, 40, seeded);
        struct outcome local, remote;
        send_generate(seeded ? "local-s" : "local-g", prompt, 40, 12, seeded, false);
        collect(seeded ? "local-s" : "local-g", &local, 280);
        pthread_mutex_lock(&X.mu);
        int copies0 = X.copies;
        pthread_mutex_unlock(&X.mu);
        send_generate(seeded ? "remote-s" : "remote-g", prompt, 40, 12, seeded, true);
        collect(seeded ? "remote-s" : "remote-g", &remote, 280);
        assert_int_equal(local.error, 0);
        assert_int_equal(remote.error, 0);
        assert_string_equal(local.prefilled_by, "");
        assert_string_equal(remote.prefilled_by, tdm_prefill_service_url(ps)); // not a fallback
        assert_int_equal(local.n, 12);
        assert_int_equal(remote.n, 12);
        assert_memory_equal(local.tokens, remote.tokens, sizeof(int32_t) * 12);
        pthread_mutex_lock(&X.mu);
        // 3 blocks (40 tokens), consecutive on both sides: one copy per layer for K and one for V
        assert_true(X.copies - copies0 >= 2 * 4);
        assert_int_equal(X.done, X.nq); // every copy landed
        pthread_mutex_unlock(&X.mu);
    }
    pthread_mutex_lock(&X.mu);
    assert_int_equal(X.exports, 1); // the decode pool's handle, once
    assert_int_equal(X.opens, 1);   // opened once for this decode instance
    pthread_mutex_unlock(&X.mu);
    assert_true(metric_has(pw, "tandem:kv_transfers_total{transport=\"cuda-ipc\"} 2"));
    assert_true(metric_has(dw, "tandem:kv_transfers_total{transport=\"cuda-ipc\"} 2"));
    assert_true(metric_has(dw, "tandem:kv_transfers_total{transport=\"nng\"} 1")); // the test before
    // The prefill worker counts the device bytes it copied (bf16 pool), and their copy time.
    pthread_mutex_lock(&X.mu);
    double copied = (double)X.bytes;
    pthread_mutex_unlock(&X.mu);
    assert_true(metric_value(pw, "tandem:kv_transfer_bytes_total") == nng_bytes + copied);
    assert_true(metric_value(pw, "tandem:kv_copy_seconds_total") > 0);
    // Both workers report the pair in /health.
    char body[4096];
    get_health(dw, body, sizeof body);
    assert_non_null(strstr(body, "\"status\":\"ok\",\"kv_transfer\":{\"setting\":\"auto\""));
    char pair[512];
    snprintf(pair, sizeof pair, "{\"peer\":\"%s\",\"transport\":\"cuda-ipc\",\"transfers\":3,",
             tdm_prefill_service_url(ps));
    assert_non_null(strstr(body, pair));
    get_health(pw, body, sizeof body);
    snprintf(pair, sizeof pair, "{\"peer\":\"%s\",\"transport\":\"cuda-ipc\",\"transfers\":3,"
             "\"why\":\"same host, pool handle open\"}",
             tdm_pd_receiver_url(rx));
    assert_non_null(strstr(body, pair));
}

struct gen_arg {
    struct tdm_engine *e;
    int32_t prompt[NUM_BLOCKS * BLOCK];
    int n;
    atomic_bool started; // its first token came
    double t_first;
};

static void *run_big(void *arg)
{
    struct gen_arg *g = arg;
    struct tdm_engine_request_params ep;
    tdm_engine_request_params_default(&ep);
    ep.id = "big";
    ep.prompt = g->prompt;
    ep.n_prompt = g->n;
    ep.max_tokens = 2;
    ep.sampling.ignore_eos = true;
    struct tdm_engine_request *r = NULL;
    char err[256];
    if (tdm_engine_submit(g->e, &ep, &r, err, sizeof err) != TDM_OK)
        return NULL;
    struct tdm_engine_chunk c;
    for (;;) {
        int rc = tdm_engine_stream_next(r, 0.05, &c);
        if (rc == TDM_ETIMEDOUT)
            continue;
        if (rc != TDM_OK)
            break;
        if (c.n > 0 && !atomic_load(&g->started)) {
            g->t_first = tdm_now();
            atomic_store(&g->started, true);
        }
        if (c.finished)
            break;
    }
    tdm_engine_request_release(r);
    return NULL;
}

static void test_cancel_waits_for_late_copy(void **state)
{
    (void)state;
    struct tdm_worker_parts dparts;
    assert_int_equal(tdm_worker_parts(dw, &dparts), TDM_OK);
    struct tdm_engine_stats st;
    int32_t prompt[40];
    prompt_of(prompt, 40, 7);
    atomic_store(&X.pending_seen, false);
    atomic_store(&X.hold, true); // the copies will land late
    send_generate("held", prompt, 40, 64, false, true);
    double end = tdm_now() + 280;
    while (!atomic_load(&X.pending_seen))
        assert_true(tdm_now() < end), usleep(1000);
    send_cancel("held");
    usleep(300 * 1000); // the decode job retired, cancelled, and waits

    // The reserved blocks are still the import's: not freed on cancel.
    tdm_engine_get_stats(dparts.engine, &st);
    assert_int_equal(st.num_importing, 1);
    int reserved = NUM_BLOCKS - st.num_free_blocks;
    assert_true(reserved >= 3);
    // A request that needs every block cannot get them while the copy may land.
    struct gen_arg *g = calloc(1, sizeof *g);
    assert_non_null(g);
    g->e = dparts.engine;
    g->n = (NUM_BLOCKS - 1) * BLOCK;
    prompt_of(g->prompt, g->n, 9);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, run_big, g), 0);
    usleep(500 * 1000);
    // Asserted once the thread is joined (a failure here must not leave it running).
    bool started_early = atomic_load(&g->started);
    tdm_engine_get_stats(dparts.engine, &st);
    int importing_while_held = st.num_importing;

    // The copy completes: it lands, the prefill worker says closed, and only
    // then do the blocks go back and the big request runs.
    double t_release = tdm_now();
    atomic_store(&X.hold, false);
    struct outcome o;
    collect("held", &o, 280); // its finish: after the blocks went back
    assert_true(o.error == 0 || strstr(o.message, "cancel") != NULL);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_false(started_early);
    assert_int_equal(importing_while_held, 1);
    assert_true(atomic_load(&g->started));
    pthread_mutex_lock(&X.mu);
    double landed = X.t_landed;
    assert_int_equal(X.done, X.nq);
    pthread_mutex_unlock(&X.mu);
    assert_true(landed >= t_release);
    assert_true(g->t_first > landed); // the blocks were reused only after the copy landed
    free(g);
    tdm_engine_get_stats(dparts.engine, &st);
    assert_int_equal(st.num_importing, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ipc_open_fails),
        cmocka_unit_test(test_equivalence),
        cmocka_unit_test(test_cancel_waits_for_late_copy),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
