// SPDX-License-Identifier: Apache-2.0
// pd_attempt tests: the remote-prefill attempt's state machine over a fake
// transport (scripted arrivals on a fake clock: the PrefillResult, KvData
// layers, KV failures, a cancel, a dropped connection, a silent worker) and a
// fake engine (the result check, retire and commit are recorded). Each edge of
// pd_attempt.h is driven: commit after result then KV, and after KV that came
// first; unreachable (short dial window when not connected, no cancel sent);
// error result; KV failure before the result; timeout on the result; a worker
// silent to load queries; a connection down past the grace; a refused header;
// KV that stalls after the result; a cancel while waiting for KV (not
// counted); the retry edge (a second attempt on the same fakes starts clean);
// and the budget of listed workers (max_prefill_attempts). In-place writes
// (issue 10): a failed attempt whose worker may still write the reserved
// blocks returns only once that is known to be over (its closed frame, its
// restart, or its connection down for write_quarantine), whatever the cancel.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "pd_attempt.h"

// ---- fakes -------------------------------------------------------------------------------
enum ev_kind { EV_RESULT, EV_LAYERS, EV_KV_FAIL, EV_CANCEL, EV_DOWN, EV_UP, EV_CLOSED, EV_RESTART };

struct event {
    double at;
    enum ev_kind kind;
    int value; // EV_RESULT: error code; EV_LAYERS: layers imported
};

struct fake {
    double now;
    // transport
    bool connected, alive; // alive: answers load queries
    int send_rc;           // what send_prefill returns
    double send_timeout;   // what it was given
    int sends, probes, cancels;
    uint64_t cancel_instance;
    // engine
    int check_rc;
    int retires, commits;
    int layers_at_retire; // layers imported when the transfer was retired
    double retired_at;
    double commit_at;
    // the receive thread's record
    struct tdm_pd_attempt_view v;
    const struct event *script;
    size_t n_script, next;
};

static void apply_due(struct fake *f)
{
    while (f->next < f->n_script && f->script[f->next].at <= f->now) {
        const struct event *e = &f->script[f->next++];
        if (f->retires > 0 && e->kind != EV_CANCEL && e->kind != EV_CLOSED &&
            e->kind != EV_RESTART && e->kind != EV_DOWN && e->kind != EV_UP)
            continue; // a retired transfer takes no message but its closed frame
        switch (e->kind) {
        case EV_RESULT:
            f->v.has_result = true;
            f->v.result_error = e->value;
            f->v.peer_instance = 77;
            snprintf(f->v.result_message, sizeof f->v.result_message, "%s",
                     e->value ? "prefill failed" : "");
            break;
        case EV_LAYERS:
            if (f->v.layers_done == 0)
                f->v.t_first_frame = f->now;
            f->v.layers_done += e->value;
            f->v.bytes_done += 1000u * (size_t)e->value;
            f->v.t_kv_done = f->now;
            break;
        case EV_KV_FAIL:
            f->v.kv_failed = true;
            snprintf(f->v.kv_err, sizeof f->v.kv_err, "bad KvData");
            break;
        case EV_CANCEL:
            f->v.cancelled = f->v.stop = true;
            break;
        case EV_DOWN:
            f->connected = false;
            break;
        case EV_UP:
            f->connected = true;
            break;
        case EV_CLOSED: // the prefill worker: no copy in flight any more
            f->v.writes_open = false;
            break;
        case EV_RESTART: // a LoadReport from a new instance of the worker
            f->v.peer_restarted = true;
            break;
        }
    }
}

static double f_now(void *ctx)
{
    return ((struct fake *)ctx)->now;
}

static int f_send_prefill(void *ctx, double timeout_s, char *err, size_t errlen)
{
    struct fake *f = ctx;
    f->sends++;
    f->send_timeout = timeout_s;
    if (f->send_rc != TDM_OK)
        return tdm_seterr(err, errlen, f->send_rc, "connection refused");
    return TDM_OK;
}

static bool f_connected(void *ctx)
{
    return ((struct fake *)ctx)->connected;
}

static void f_send_probe(void *ctx)
{
    struct fake *f = ctx;
    f->probes++;
    if (f->alive && f->connected)
        f->v.prefill_heard = f->now; // the LoadReport comes back at once
}

static void f_send_cancel(void *ctx, uint64_t instance)
{
    struct fake *f = ctx;
    f->cancels++;
    f->cancel_instance = instance;
}

static void f_view(void *ctx, struct tdm_pd_attempt_view *v)
{
    struct fake *f = ctx;
    apply_due(f);
    *v = f->v;
}

static void f_wait(void *ctx, double seconds)
{
    struct fake *f = ctx;
    f->now += seconds;
}

static int f_check_result(void *ctx, char *err, size_t errlen)
{
    struct fake *f = ctx;
    if (f->check_rc != TDM_OK)
        return tdm_seterr(err, errlen, f->check_rc, "kv header: layers 2 != ours 24");
    return TDM_OK;
}

static void f_retire(void *ctx)
{
    struct fake *f = ctx;
    f->retires++;
    f->layers_at_retire = f->v.layers_done;
    f->retired_at = f->now;
}

static void f_commit(void *ctx, const struct tdm_pd_attempt *a)
{
    struct fake *f = ctx;
    assert_int_equal(a->state, TDM_PD_ATTEMPT_COMMITTED);
    assert_int_equal(f->retires, 1); // retired before the import is finished
    f->commits++;
    f->commit_at = f->now;
}

static const struct tdm_pd_attempt_ops ops = {
    .now = f_now,
    .send_prefill = f_send_prefill,
    .connected = f_connected,
    .send_probe = f_send_probe,
    .send_cancel = f_send_cancel,
    .view = f_view,
    .wait = f_wait,
    .check_result = f_check_result,
    .retire = f_retire,
    .commit = f_commit,
};

static struct tdm_pd_attempt_config config(void)
{
    struct tdm_pd_attempt_config c;
    memset(&c, 0, sizeof c);
    tdm_pd_attempt_config_default(&c);
    c.prefill_timeout = 5;
    c.transfer_timeout = 2;
    c.connect_grace = 1;
    c.prefill_liveness = 2;
    c.send_timeout = 2;
    c.num_layers = 4;
    return c;
}

static void fake_init(struct fake *f, const struct event *script, size_t n)
{
    memset(f, 0, sizeof *f);
    f->now = 100;
    f->connected = f->alive = true;
    f->script = script;
    f->n_script = n;
}

#define RUN(f, a, script)                                                                          \
    do {                                                                                           \
        struct tdm_pd_attempt_config c_ = config();                                               \
        fake_init(&(f), script, sizeof(script) / sizeof(script)[0]);                               \
        tdm_pd_attempt_run(&(a), &c_, &ops, &(f));                                                 \
    } while (0)

// ---- tests -------------------------------------------------------------------------------
static void test_commit(void **state)
{
    (void)state;
    static const struct event s[] = {
        {100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 2}, {100.3, EV_LAYERS, 2}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_COMMITTED);
    assert_int_equal(f.sends, 1);
    assert_true(f.send_timeout == 2); // connected: the full send timeout
    assert_int_equal(f.commits, 1);
    assert_int_equal(f.cancels, 0);
    assert_int_equal(f.layers_at_retire, 4);
    assert_true(a.t_sent == 100);
    assert_true(a.t_result >= 100.1 && a.t_result < 100.2);
    assert_true(f.commit_at >= 100.3 && f.commit_at < 100.4);
    assert_int_equal(a.last.bytes_done, 4000);
    assert_true(f.probes >= 1); // liveness probes while waiting
}

static void test_kv_before_result(void **state)
{
    (void)state;
    static const struct event s[] = {{100.05, EV_LAYERS, 4}, {100.2, EV_RESULT, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_COMMITTED);
    assert_true(a.last.t_kv_done < a.t_result); // nothing exposed after the result
    assert_true(f.commit_at < 100.3);           // no wait for KV once the result came
}

static void test_unreachable(void **state)
{
    (void)state;
    static const struct event s[] = {{0, EV_UP, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    struct tdm_pd_attempt_config c = config();
    fake_init(&f, s, 0);
    f.connected = false;
    f.send_rc = TDM_ETRANSPORT;
    assert_int_equal(tdm_pd_attempt_run(&a, &c, &ops, &f), TDM_PD_ATTEMPT_FAILED);
    assert_true(f.send_timeout == 0.5); // not connected: the short dial window
    assert_int_equal(a.why, TDM_PD_WHY_UNREACHABLE);
    assert_string_equal(tdm_pd_attempt_why_name(a.why), "unreachable");
    assert_int_equal(a.failed_in, TDM_PD_ATTEMPT_SEND);
    assert_true(a.counted);
    assert_string_equal(a.detail, "connection refused");
    assert_int_equal(f.retires, 1);
    assert_int_equal(f.cancels, 0); // nothing reached it: nothing to cancel
    assert_int_equal(f.commits, 0);
}

static void test_error_result(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_RESULT, TDM_EBUSY}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_FAILED);
    assert_int_equal(a.why, TDM_PD_WHY_PREFILL_ERROR);
    assert_string_equal(tdm_pd_attempt_why_name(a.why), "prefill_error");
    assert_int_equal(a.failed_in, TDM_PD_ATTEMPT_AWAIT_RESULT);
    assert_string_equal(a.detail, "prefill failed");
    assert_int_equal(f.cancels, 1);
    assert_int_equal(f.cancel_instance, 77); // the result's sender
    assert_true(f.now < 100.2);              // at once, not at a timeout
}

static void test_kv_failure_first(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_KV_FAIL, 0}, {100.2, EV_RESULT, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.why, TDM_PD_WHY_TRANSFER);
    assert_int_equal(a.failed_in, TDM_PD_ATTEMPT_AWAIT_RESULT);
    assert_string_equal(a.detail, "bad KvData");
    assert_int_equal(f.cancels, 1);
    assert_int_equal(f.commits, 0);
}

static void test_result_timeout(void **state)
{
    (void)state;
    static const struct event s[] = {{200, EV_RESULT, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.why, TDM_PD_WHY_TIMEOUT);
    assert_true(a.counted);
    assert_true(f.now > 105 && f.now < 105.2); // prefill_timeout after the send
    assert_int_equal(f.cancels, 1);
    assert_true(f.probes >= 15 && f.probes <= 21); // every 0.25 s (one poll late at most)
}

static void test_silent_worker(void **state)
{
    (void)state;
    static const struct event s[] = {{200, EV_RESULT, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    struct tdm_pd_attempt_config c = config();
    fake_init(&f, s, 1);
    f.alive = false; // connected but answers no load query
    tdm_pd_attempt_run(&a, &c, &ops, &f);
    assert_int_equal(a.why, TDM_PD_WHY_DISCONNECTED);
    assert_string_equal(a.detail, "disconnected");
    assert_true(f.now > 102 && f.now < 102.2); // prefill_liveness
    assert_int_equal(f.cancels, 1);
}

static void test_connection_down(void **state)
{
    (void)state;
    static const struct event s[] = {{100.5, EV_DOWN, 0}, {200, EV_RESULT, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.why, TDM_PD_WHY_DISCONNECTED);
    assert_true(f.now > 101.5 && f.now < 101.7); // down at 100.5 + connect_grace
}

static void test_header_refused(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 4}};
    struct fake f;
    struct tdm_pd_attempt a;
    struct tdm_pd_attempt_config c = config();
    fake_init(&f, s, 2);
    f.check_rc = TDM_EPROTO;
    tdm_pd_attempt_run(&a, &c, &ops, &f);
    assert_int_equal(a.why, TDM_PD_WHY_HEADER);
    assert_string_equal(tdm_pd_attempt_why_name(a.why), "header");
    assert_true(a.counted);
    assert_string_equal(a.detail, "kv header: layers 2 != ours 24");
    assert_int_equal(f.retires, 1);
    assert_int_equal(f.cancels, 1);
    assert_int_equal(f.commits, 0);
}

static void test_kv_stalls(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 1}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.why, TDM_PD_WHY_TRANSFER);
    assert_int_equal(a.failed_in, TDM_PD_ATTEMPT_AWAIT_KV);
    assert_string_equal(a.detail, "transfer timed out after 1 of 4 layers");
    assert_true(f.now > 102.1 && f.now < 102.3); // transfer_timeout after the result
    assert_int_equal(f.cancels, 1);
    assert_int_equal(f.commits, 0);
}

static void test_cancel_during_kv(void **state)
{
    (void)state;
    static const struct event s[] = {
        {100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 2}, {100.5, EV_CANCEL, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_FAILED);
    assert_false(a.counted); // the router cancelled: no failure to count
    assert_string_equal(a.detail, "cancelled after 2 of 4 layers");
    assert_true(f.now < 100.6);
    assert_int_equal(f.cancels, 1); // the prefill worker still frees its KV
    assert_int_equal(f.commits, 0);
}

// ---- in-place writes (CUDA IPC) ------------------------------------------------------------
#define RUN_OFFERED(f, a, script)                                                                  \
    do {                                                                                           \
        struct tdm_pd_attempt_config c_ = config();                                               \
        fake_init(&(f), script, sizeof(script) / sizeof(script)[0]);                               \
        (f).v.writes_open = true; /* our pool went with the request */                             \
        tdm_pd_attempt_run(&(a), &c_, &ops, &(f));                                                 \
    } while (0)

// Cancelled with a copy still in flight: retired and the worker cancelled at
// once, but the attempt (and so the free or reuse of its blocks) ends only
// when the worker's closed frame came, 4 s later.
static void test_cancel_waits_for_closed(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_RESULT, 0},
                                     {100.2, EV_LAYERS, 1},
                                     {100.5, EV_CANCEL, 0},
                                     {104.5, EV_CLOSED, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN_OFFERED(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_FAILED);
    assert_false(a.counted);
    assert_true(f.retired_at >= 100.5 && f.retired_at < 100.6); // frames refused at once
    assert_int_equal(f.cancels, 1);
    assert_true(f.now >= 104.5);     // returned only after the closed frame
    assert_true(a.t_drained >= 104.5);
    assert_false(a.writes_abandoned);
    assert_true(f.probes > 4); // still asking, so a restart would be seen
}

// Every failure edge drains, not only cancel: a result timeout and an error
// result while writes may be in flight.
static void test_failures_wait_for_closed(void **state)
{
    (void)state;
    static const struct event err[] = {{100.1, EV_RESULT, 5}, {100.9, EV_CLOSED, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN_OFFERED(f, a, err);
    assert_int_equal(a.why, TDM_PD_WHY_PREFILL_ERROR);
    assert_true(f.retired_at < 100.2);
    assert_true(a.t_drained >= 100.9);
    static const struct event stall[] = {
        {100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 2}, {103.0, EV_CLOSED, 0}};
    RUN_OFFERED(f, a, stall);
    assert_int_equal(a.why, TDM_PD_WHY_TRANSFER); // transfer_timeout 2 s after the result
    assert_true(f.retired_at >= 102.1 && f.retired_at < 102.3);
    assert_true(a.t_drained >= 103.0);
}

// A worker that never says closed: its restart (a new instance answering the
// probe) or its connection down for write_quarantine ends the wait; a worker
// that stays connected and silent keeps the blocks.
static void test_dead_worker_ends_wait(void **state)
{
    (void)state;
    static const struct event restart[] = {{100.1, EV_CANCEL, 0}, {101.0, EV_RESTART, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN_OFFERED(f, a, restart);
    assert_true(a.writes_abandoned);
    assert_true(f.now >= 101.0 && f.now < 101.2);
    static const struct event down[] = {{100.1, EV_CANCEL, 0}, {100.5, EV_DOWN, 0}};
    RUN_OFFERED(f, a, down);
    assert_true(a.writes_abandoned);
    assert_true(f.now >= 102.5 && f.now < 102.7); // down at 100.5 + quarantine 2
    // Down, then back (a reconnect of the same process): the wait goes on.
    static const struct event flap[] = {{100.1, EV_CANCEL, 0},
                                        {100.5, EV_DOWN, 0},
                                        {101.0, EV_UP, 0},
                                        {110.0, EV_CLOSED, 0}};
    RUN_OFFERED(f, a, flap);
    assert_false(a.writes_abandoned);
    assert_true(f.now >= 110.0);
}

// Without an offer (KV over nng) or after a commit nothing is awaited.
static void test_no_wait_without_writes(void **state)
{
    (void)state;
    static const struct event s[] = {{100.1, EV_RESULT, 0}, {100.5, EV_CANCEL, 0}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, s);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_FAILED);
    assert_true(f.now < 100.6);
    static const struct event ok[] = {{100.1, EV_RESULT, 0}, {100.2, EV_LAYERS, 4}};
    RUN_OFFERED(f, a, ok); // every layer in place: the last frame said closed too
    assert_int_equal(a.state, TDM_PD_ATTEMPT_COMMITTED);
    assert_true(f.now < 100.3);
}

static void test_retry_starts_clean(void **state)
{
    (void)state;
    // A failed attempt leaves the record of the next one untouched.
    static const struct event bad[] = {{100.1, EV_RESULT, TDM_EBUSY}};
    static const struct event good[] = {{100.1, EV_RESULT, 0}, {100.1, EV_LAYERS, 4}};
    struct fake f;
    struct tdm_pd_attempt a;
    RUN(f, a, bad);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_FAILED);
    RUN(f, a, good);
    assert_int_equal(a.state, TDM_PD_ATTEMPT_COMMITTED);
    assert_int_equal(a.why, TDM_PD_WHY_NONE);
    assert_string_equal(a.detail, "");
}

static void test_budget(void **state)
{
    (void)state;
    assert_int_equal(tdm_pd_attempt_budget(3, 0), 3); // 0: every one listed
    assert_int_equal(tdm_pd_attempt_budget(3, 2), 2);
    assert_int_equal(tdm_pd_attempt_budget(3, 1), 1);
    assert_int_equal(tdm_pd_attempt_budget(2, 8), 2);
    assert_int_equal(tdm_pd_attempt_budget(0, 2), 0);
    assert_int_equal(tdm_pd_attempt_budget(3, -1), 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_commit),
        cmocka_unit_test(test_kv_before_result),
        cmocka_unit_test(test_unreachable),
        cmocka_unit_test(test_error_result),
        cmocka_unit_test(test_kv_failure_first),
        cmocka_unit_test(test_result_timeout),
        cmocka_unit_test(test_silent_worker),
        cmocka_unit_test(test_connection_down),
        cmocka_unit_test(test_header_refused),
        cmocka_unit_test(test_kv_stalls),
        cmocka_unit_test(test_cancel_during_kv),
        cmocka_unit_test(test_retry_starts_clean),
        cmocka_unit_test(test_budget),
        cmocka_unit_test(test_cancel_waits_for_closed),
        cmocka_unit_test(test_failures_wait_for_closed),
        cmocka_unit_test(test_dead_worker_ends_wait),
        cmocka_unit_test(test_no_wait_without_writes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
