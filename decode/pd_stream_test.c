// SPDX-License-Identifier: Apache-2.0
// pd_stream_test: the decode worker's token stream back to the router under
// backpressure. A router that is slow to read (stopped, starved, behind on
// its inbox) must slow a stream down, never end it; only a router that is
// gone -- its connection closed, or connected but taking no byte for
// --pd-router-liveness -- may end it, and then the request is aborted (its
// KV freed) and the router, should it read again, gets an error finish, not
// an "abort" that reads like a cancellation (pd_faults once saw a stream end
// "done" after 3 521 tokens with a finish_reason other than "length").
//
// A decode worker (P/D receiver) runs in this process on the CPU backend with
// a tiny random model. The test sends GenerateRequests from its own outbox
// and plays the router's inbox with a plain Unix-domain socket (ipc://) that
// reads only when told to: a stream socket's sender blocks after ~16 KiB of
// small frames the peer has not read (about 280 TokenChunks), so a stopped
// reader fills the decode worker's connection within a few hundred tokens,
// where TCP on loopback would buffer megabytes first.
//   - slow router: stops reading until the decode worker's sends have been
//     blocked for many send timeouts, then reads: every token arrives, in
//     order, the finish is "length";
//   - gone router: the router's end closes mid-stream: the request is
//     aborted and its KV freed within a couple of send timeouts;
//   - stalled past the liveness bound: the request is aborted and its KV
//     freed; a finish that reaches the router afterwards is an error.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "engine.h"
#include "mkmodel.h"
#include "pd_codec.h"
#include "pd_receiver.h"
#include "tandem.pb-c.h"
#include "transport.h"
#include "worker.h"

#define SEND_TIMEOUT 0.2 // the decode worker's send timeout in these tests (default 2)
#define MAX_TOKENS 1500  // far more TokenChunks than a stopped reader's socket holds
#define PROMPT 24

static char model_dir[] = "/tmp/pd_stream_test_XXXXXX";
static struct tdm_worker *dw;      // per test
static struct tdm_net_outbox *out; // GenerateRequests to the decode worker
static struct tdm_pd_receiver *rx; // per test, with dw: its config varies
static const uint64_t router_instance = 0x5eed;

static int setup(void **state)
{
    (void)state;
    char err[512];
    tdm_net_set_secret(NULL, 0, err, sizeof err); // the fake router speaks no handshake
    if (mkdtemp(model_dir) == NULL)
        return -1;
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    if (tdm_net_outbox_new(&out, 50, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_net_outbox_free(out);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

// A decode worker and its P/D receiver with the short send timeout and the
// given liveness bound (a worker per test: a receiver registers its metrics
// in the worker's registry once).
static int worker_start(double router_liveness)
{
    struct tdm_worker_config c;
    tdm_worker_config_default(&c);
    snprintf(c.model, sizeof c.model, "%s", model_dir);
    snprintf(c.host, sizeof c.host, "127.0.0.1");
    snprintf(c.device, sizeof c.device, "cpu");
    c.port = 0;
    c.num_kv_blocks = 256; // 96 blocks for a whole stream
    c.block_size = 16;
    c.enable_prefix_caching = false; // a finished request references no block
    c.max_num_seqs = 4;
    c.threads = 1;
    c.http_threads = 2;
    struct tdm_pd_receiver_config rc;
    tdm_pd_receiver_config_default(&rc);
    snprintf(rc.nng_url, sizeof rc.nng_url, "tcp://127.0.0.1:0");
    rc.send_timeout = SEND_TIMEOUT;
    rc.router_liveness = router_liveness;
    char err[512];
    if (tdm_worker_new(&dw, &c, err, sizeof err) != TDM_OK ||
        tdm_worker_load(dw, err, sizeof err) != TDM_OK ||
        tdm_pd_receiver_new(&rx, dw, &rc, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "worker: %s\n", err);
        return -1;
    }
    return 0;
}

static int worker_patient(void **state)
{
    (void)state;
    return worker_start(30);
}

static int worker_impatient(void **state) // gives up on a silent router after 1 s
{
    (void)state;
    return worker_start(1.0);
}

static int worker_stop(void **state)
{
    (void)state;
    tdm_pd_receiver_free(rx);
    tdm_worker_free(dw);
    rx = NULL;
    dw = NULL;
    return 0;
}

// ---- the fake router: a Unix-domain listener that reads when told ------------------------------
#define MAX_CONNS 8
struct conn {
    int fd;
    uint8_t *buf; // bytes read and not yet cut into frames
    size_t len, cap;
};

struct router {
    char path[108];
    char url[128];
    int lfd;
    struct conn c[MAX_CONNS];
    int n;
    // What came for the request (frames of other ids are ignored).
    int tokens;    // tokens received, in order
    int chunks;    // TokenChunks with tokens
    int max_chunk; // most tokens in one TokenChunk
    bool out_of_order;
    bool finished;
    int finish; // Tandem__FinishReason
    int error;
    char message[256];
};

static void router_open(struct router *r)
{
    memset(r, 0, sizeof *r);
    static int seq;
    snprintf(r->path, sizeof r->path, "/tmp/pd_stream_test.%d.%d", (int)getpid(), seq++);
    snprintf(r->url, sizeof r->url, "ipc://%s", r->path);
    unlink(r->path);
    r->lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(r->lfd >= 0);
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    snprintf(a.sun_path, sizeof a.sun_path, "%s", r->path);
    assert_int_equal(bind(r->lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(r->lfd, 8), 0);
}

// Closes every connection and the listener: the router is gone.
static void router_close(struct router *r)
{
    for (int i = 0; i < r->n; i++) {
        close(r->c[i].fd);
        free(r->c[i].buf);
    }
    r->n = 0;
    if (r->lfd >= 0)
        close(r->lfd);
    r->lfd = -1;
    unlink(r->path);
}

// Accepts the connections waiting on the listener (not reading them).
static void router_accept(struct router *r)
{
    while (r->lfd >= 0 && r->n < MAX_CONNS) {
        struct pollfd p = {.fd = r->lfd, .events = POLLIN};
        if (poll(&p, 1, 0) != 1)
            return;
        int fd = accept(r->lfd, NULL, NULL);
        if (fd < 0)
            return;
        r->c[r->n++] = (struct conn){.fd = fd};
    }
}

// Bytes the decode worker wrote that the router has not read, over every connection.
static size_t router_unread(struct router *r)
{
    size_t n = 0;
    for (int i = 0; i < r->n; i++) {
        int q = 0;
        if (ioctl(r->c[i].fd, FIONREAD, &q) == 0)
            n += (size_t)q;
    }
    return n;
}

static void take_chunk(struct router *r, const char *id, const struct tdm_net_frame *f)
{
    if (f->type != TDM_NET_TOKENS)
        return;
    Tandem__TokenChunk *m = tandem__token_chunk__unpack(NULL, f->msg_len, f->msg);
    assert_non_null(m);
    if (strcmp(m->request_id, id) == 0 && !r->finished) {
        if (m->n_tokens > 0) {
            if ((int)m->first_index != r->tokens)
                r->out_of_order = true;
            r->tokens += (int)m->n_tokens;
            r->chunks++;
            if ((int)m->n_tokens > r->max_chunk)
                r->max_chunk = (int)m->n_tokens;
        }
        if (m->finished) {
            r->finished = true;
            r->finish = m->finish;
            r->error = m->error;
            snprintf(r->message, sizeof r->message, "%s", m->message ? m->message : "");
        }
    }
    tandem__token_chunk__free_unpacked(m, NULL);
}

// Reads every connection (new ones too) until id's finish came or timeout_s
// passed; whole frames are taken, a connection's partial frame at its end is
// dropped with it (as the real inbox does).
static void router_read(struct router *r, const char *id, double timeout_s)
{
    double end = tdm_now() + timeout_s;
    while (!r->finished && tdm_now() < end) {
        router_accept(r);
        bool any = false;
        for (int i = 0; i < r->n; i++) {
            struct conn *c = &r->c[i];
            if (c->fd < 0)
                continue;
            if (c->cap - c->len < 65536) {
                c->cap = c->cap * 2 + 65536;
                c->buf = realloc(c->buf, c->cap);
                assert_non_null(c->buf);
            }
            struct pollfd p = {.fd = c->fd, .events = POLLIN};
            if (poll(&p, 1, 0) != 1)
                continue;
            ssize_t got = read(c->fd, c->buf + c->len, c->cap - c->len);
            if (got <= 0) { // the decode worker closed it
                close(c->fd);
                c->fd = -1;
                continue;
            }
            any = true;
            c->len += (size_t)got;
            size_t at = 0;
            while (c->len - at >= TDM_NET_HEADER_BYTES) {
                uint32_t ml, pl;
                memcpy(&ml, c->buf + at + 8, 4);
                memcpy(&pl, c->buf + at + 12, 4);
                size_t size = TDM_NET_HEADER_BYTES + (size_t)ml + pl;
                if (c->len - at < size)
                    break;
                struct tdm_net_frame f;
                char err[128];
                assert_int_equal(tdm_net_frame_parse(c->buf + at, size, &f, err, sizeof err),
                                 TDM_OK);
                take_chunk(r, id, &f);
                at += size;
            }
            memmove(c->buf, c->buf + at, c->len - at);
            c->len -= at;
        }
        if (!any)
            tdm_sleep(0.005);
    }
}

// What the router got, for the test's log.
static void router_print(const struct router *r)
{
    print_message("router: %d tokens in %d chunks (largest %d)%s; %s finish %d, error %d \"%s\"\n",
                  r->tokens, r->chunks, r->max_chunk, r->out_of_order ? ", OUT OF ORDER" : "",
                  r->finished ? "" : "no", r->finish, r->error, r->message);
}

// Waits (without reading) until the decode worker has written nothing for
// hold_s: its sends are blocked (or it gave up). Fails when that does not
// happen within 60 s: the stream did not fill the connection.
static void router_wait_stalled(struct router *r, double hold_s)
{
    double start = tdm_now(), still = tdm_now();
    size_t last = 0;
    for (;;) {
        router_accept(r);
        size_t n = router_unread(r);
        if (n != last || r->n == 0) {
            last = n;
            still = tdm_now();
        } else if (tdm_now() - still >= hold_s) {
            return;
        }
        if (tdm_now() - start > 60)
            fail_msg("the stream never filled the router's connection (%zu bytes unread)", n);
        tdm_sleep(0.01);
    }
}

// ---- the decode worker's side -------------------------------------------------------------------
static void send_generate(const char *id, const char *reply_to, int max_tokens)
{
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = 3 + (i * 37 + 11) % 250;
    Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.0f;
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    sp.ignore_eos = true;
    sp.logprobs = -1;
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)reply_to;
    me.instance = router_instance;
    g.request_id = (char *)id;
    g.reply_to = &me;
    g.to_instance = tdm_pd_receiver_instance(rx);
    g.prompt = prompt;
    g.n_prompt = PROMPT;
    g.sampling = &sp;
    g.max_tokens = max_tokens;
    g.deadline_unix = (double)time(NULL) + 300;
    g.local_fallback = true; // no prefill targets: prefilled here
    char err[256];
    assert_int_equal(tdm_pd_send(out, tdm_pd_receiver_url(rx), TDM_NET_GENERATE, &g.base, NULL, 0,
                                 5.0, err, sizeof err),
                     TDM_OK);
}

// True once the receiver lists no job and the engine runs nothing and holds
// no KV block, within timeout_s.
static bool worker_idle(double timeout_s)
{
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(dw, &parts), TDM_OK);
    double end = tdm_now() + timeout_s;
    for (;;) {
        struct tdm_engine_stats st;
        tdm_engine_get_stats(parts.engine, &st);
        if (tdm_pd_receiver_num_jobs(rx) == 0 && st.num_running == 0 && st.num_waiting == 0 &&
            st.kv_usage == 0)
            return true;
        if (tdm_now() > end)
            return false;
        tdm_sleep(0.01);
    }
}

// ---- the cases ----------------------------------------------------------------------------------
// A router that stops reading for many send timeouts, then reads again: the
// stream slows down and completes, every token in order, finish "length".
// The tokens generated meanwhile come in fewer, larger chunks (at most 256
// tokens each).
static void test_slow_router(void **state)
{
    (void)state;
    struct router r;
    router_open(&r);
    send_generate("slow-1", r.url, MAX_TOKENS);
    router_wait_stalled(&r, 10 * SEND_TIMEOUT); // blocked for 10 send timeouts
    router_read(&r, "slow-1", 60);
    router_print(&r);
    assert_true(r.finished);
    assert_string_equal(r.message, "");
    assert_int_equal(r.error, 0);
    assert_int_equal(r.finish, TANDEM__FINISH_REASON__FINISH_LENGTH);
    assert_false(r.out_of_order);
    assert_int_equal(r.tokens, MAX_TOKENS);
    assert_true(r.max_chunk > 1 && r.max_chunk <= 256);
    assert_true(worker_idle(10));
    router_close(&r);
}

// The router's end of the connection closes mid-stream (a router killed):
// the request ends on the decode worker and its KV is freed at once.
static void test_gone_router(void **state)
{
    (void)state;
    struct router r;
    router_open(&r);
    send_generate("gone-1", r.url, MAX_TOKENS);
    router_wait_stalled(&r, 2 * SEND_TIMEOUT);
    double t0 = tdm_now();
    router_close(&r);
    assert_true(worker_idle(4 * SEND_TIMEOUT + 2));
    assert_true(tdm_now() - t0 < 4 * SEND_TIMEOUT + 2);
}

// A router connected but reading nothing for longer than --pd-router-liveness
// counts as gone: the request is aborted and its KV freed; a finish that
// reaches the router afterwards says why, as an error (never "abort").
static void test_router_silent_past_liveness(void **state)
{
    (void)state;
    const double liveness = 1.0; // worker_impatient's
    struct router r;
    router_open(&r);
    send_generate("silent-1", r.url, MAX_TOKENS);
    router_wait_stalled(&r, 2 * SEND_TIMEOUT);
    assert_true(worker_idle(liveness + 4 * SEND_TIMEOUT + 3));
    router_read(&r, "silent-1", 1.0);
    router_print(&r);
    assert_true(r.tokens < MAX_TOKENS);
    assert_false(r.out_of_order);
    if (r.finished) {
        assert_int_equal(r.finish, TANDEM__FINISH_REASON__FINISH_ERROR);
        assert_int_equal(r.error, TDM_ETRANSPORT);
        assert_non_null(strstr(r.message, "router"));
    }
    router_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_slow_router, worker_patient, worker_stop),
        cmocka_unit_test_setup_teardown(test_gone_router, worker_patient, worker_stop),
        cmocka_unit_test_setup_teardown(test_router_silent_past_liveness, worker_impatient,
                                        worker_stop),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
