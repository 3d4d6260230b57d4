// SPDX-License-Identifier: Apache-2.0
// router flow_test: flow control's queues (flow.h) against a saturation the
// test sets: straight-through admission and the dispatch token, strict
// priority between bands, global-strict and round-robin fairness within one,
// the global and per-band limits, TTL, a client that leaves, and stop.
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "flow.h"

// ---- a pool whose saturation the test sets ------------------------------------------------
static _Atomic double g_sat;
static atomic_int g_queue_requests;
static _Atomic long long g_queue_bytes;

static double saturation(void *arg)
{
    (void)arg;
    return atomic_load(&g_sat);
}

static void queue_change(void *arg, int priority, int requests, long long bytes)
{
    (void)arg;
    (void)priority;
    atomic_fetch_add(&g_queue_requests, requests);
    atomic_fetch_add(&g_queue_bytes, bytes);
}

static struct tdm_router_flow *new_flow(void)
{
    atomic_store(&g_sat, 0.0);
    atomic_store(&g_queue_requests, 0);
    atomic_store(&g_queue_bytes, 0);
    struct tdm_router_flow_hooks h = {.saturation = saturation, .queue_change = queue_change};
    struct tdm_router_flow *f = NULL;
    assert_int_equal(tdm_router_flow_new(&f, &h), TDM_OK);
    return f;
}

static void config_init(struct tdm_router_flow_config *fc)
{
    memset(fc, 0, sizeof *fc);
    fc->enabled = true;
    fc->default_band.max_bytes = TDM_ROUTER_FLOW_BAND_MAX_BYTES;
    fc->default_band.fairness = TDM_ROUTER_GLOBAL_STRICT_FAIRNESS;
    fc->default_band.ordering = TDM_ROUTER_FCFS_ORDERING;
    fc->queue_depth_threshold = 5;
    fc->kv_cache_util_threshold = 0.8;
}

// ---- waiters on threads, recording the dispatch order --------------------------------------
struct waiter {
    struct tdm_router_flow *f;
    struct tdm_router_flow_ask ask;
    char name[16];
    struct tdm_router_flow_ticket t;
    pthread_t th;
    atomic_bool gone; // what ask.gone answers
};

static pthread_mutex_t order_mu = PTHREAD_MUTEX_INITIALIZER;
static char order[256];

static bool waiter_gone(void *arg)
{
    return atomic_load(&((struct waiter *)arg)->gone);
}

static void *waiter_main(void *arg)
{
    struct waiter *w = arg;
    tdm_router_flow_admit(w->f, &w->ask, &w->t);
    if (w->t.outcome == TDM_ROUTER_FLOW_DISPATCHED) {
        pthread_mutex_lock(&order_mu);
        if (order[0])
            strcat(order, " ");
        strcat(order, w->name);
        pthread_mutex_unlock(&order_mu);
        tdm_router_flow_routed(w->f, &w->t); // "routed": the next may go
    }
    return NULL;
}

static void start(struct waiter *w, struct tdm_router_flow *f,
                  const struct tdm_router_flow_config *fc, const char *name, int priority,
                  const char *flow, long long bytes, double ttl)
{
    memset(w, 0, sizeof *w);
    w->f = f;
    snprintf(w->name, sizeof w->name, "%s", name);
    w->ask = (struct tdm_router_flow_ask){.cfg = fc,
                                          .priority = priority,
                                          .fairness_id = flow,
                                          .bytes = bytes,
                                          .deadline = tdm_now() + ttl,
                                          .gone = waiter_gone,
                                          .gone_arg = w,
                                          .may_wait = true};
    size_t before = 0;
    struct tdm_router_flow_stats st;
    tdm_router_flow_stats(f, &st);
    before = st.queued;
    assert_int_equal(pthread_create(&w->th, NULL, waiter_main, w), 0);
    // Wait until it is queued (or done), so arrival order is the start order.
    for (int i = 0; i < 2000; i++) {
        tdm_router_flow_stats(f, &st);
        if (st.queued > before)
            return;
        tdm_sleep(0.001);
    }
}

static void join_all(struct waiter *w, size_t n)
{
    for (size_t i = 0; i < n; i++)
        pthread_join(w[i].th, NULL);
}

static void reset_order(void)
{
    pthread_mutex_lock(&order_mu);
    order[0] = '\0';
    pthread_mutex_unlock(&order_mu);
}

// ---- tests -----------------------------------------------------------------------------------
// Unsaturated and empty: straight through, holding the token until routed; a
// second arrival meanwhile waits for the token, then goes.
static void test_straight_through_and_token(void **state)
{
    (void)state;
    struct tdm_router_flow *f = new_flow();
    struct tdm_router_flow_config fc;
    config_init(&fc);
    struct tdm_router_flow_ask ask = {.cfg = &fc, .deadline = tdm_now() + 10, .may_wait = false};
    struct tdm_router_flow_ticket t1;
    tdm_router_flow_admit(f, &ask, &t1); // straight through: no wait needed
    assert_int_equal(t1.outcome, TDM_ROUTER_FLOW_DISPATCHED);
    assert_false(t1.queued);
    struct tdm_router_flow_ticket t2;
    tdm_router_flow_admit(f, &ask, &t2); // the token is held: it would wait, and may not
    assert_int_equal(t2.outcome, TDM_ROUTER_FLOW_REJECTED_CAPACITY);
    assert_false(t2.queued);
    reset_order();
    struct waiter w;
    start(&w, f, &fc, "b", 0, NULL, 10, 10);
    tdm_sleep(0.1);
    struct tdm_router_flow_stats st;
    tdm_router_flow_stats(f, &st);
    assert_int_equal(st.queued, 1); // the token is held: b waits
    assert_int_equal(atomic_load(&g_queue_requests), 1);
    assert_int_equal(atomic_load(&g_queue_bytes), 10);
    tdm_router_flow_routed(f, &t1);
    tdm_router_flow_routed(f, &t1); // idempotent
    join_all(&w, 1);
    assert_int_equal(w.t.outcome, TDM_ROUTER_FLOW_DISPATCHED);
    assert_true(w.t.queued);
    assert_string_equal(order, "b");
    assert_int_equal(atomic_load(&g_queue_requests), 0);
    assert_int_equal(atomic_load(&g_queue_bytes), 0);
    tdm_router_flow_free(f);
}

// Saturated: everything waits; when room comes, the highest band goes first,
// arrival order within it (global-strict over flows x and y).
static void test_priority_then_arrival(void **state)
{
    (void)state;
    struct tdm_router_flow *f = new_flow();
    struct tdm_router_flow_config fc;
    config_init(&fc);
    atomic_store(&g_sat, 1.0);
    reset_order();
    struct waiter w[6];
    start(&w[0], f, &fc, "lo1", 0, "x", 1, 30);
    start(&w[1], f, &fc, "hi1", 10, "y", 1, 30);
    start(&w[2], f, &fc, "lo2", 0, "y", 1, 30);
    start(&w[3], f, &fc, "neg", -5, "x", 1, 30);
    start(&w[4], f, &fc, "hi2", 10, "x", 1, 30);
    start(&w[5], f, &fc, "lo3", 0, "x", 1, 30);
    tdm_sleep(0.15);
    assert_string_equal(order, ""); // saturated: nobody goes, polls or not
    atomic_store(&g_sat, 0.5);
    tdm_router_flow_kick(f);
    join_all(w, 6);
    assert_string_equal(order, "hi1 hi2 lo1 lo2 lo3 neg");
    tdm_router_flow_free(f);
}

// Round-robin fairness: the band's flows (sorted by id) take turns, each
// flow in arrival order; the default band stays global-strict.
static void test_round_robin_fairness(void **state)
{
    (void)state;
    struct tdm_router_flow *f = new_flow();
    struct tdm_router_flow_config fc;
    config_init(&fc);
    fc.n_bands = 1;
    fc.bands[0] = fc.default_band;
    fc.bands[0].priority = 1;
    fc.bands[0].fairness = TDM_ROUTER_ROUND_ROBIN_FAIRNESS;
    atomic_store(&g_sat, 1.0);
    reset_order();
    struct waiter w[7];
    start(&w[0], f, &fc, "b1", 1, "bob", 1, 30);
    start(&w[1], f, &fc, "b2", 1, "bob", 1, 30);
    start(&w[2], f, &fc, "b3", 1, "bob", 1, 30);
    start(&w[3], f, &fc, "a1", 1, "alice", 1, 30);
    start(&w[4], f, &fc, "c1", 1, "carol", 1, 30);
    start(&w[5], f, &fc, "a2", 1, "alice", 1, 30);
    start(&w[6], f, &fc, "d1", 1, NULL, 1, 30); // "default-flow"
    atomic_store(&g_sat, 0.0);
    tdm_router_flow_kick(f);
    join_all(w, 7);
    // alice < bob < carol < default-flow, then around again.
    assert_string_equal(order, "a1 b1 c1 d1 a2 b2 b3");
    tdm_router_flow_free(f);
}

// The global limit, then a band's request and byte limits: refused at once
// (RejectedCapacity), nothing queued displaced; bands are counted apart.
static void test_capacity(void **state)
{
    (void)state;
    struct tdm_router_flow *f = new_flow();
    struct tdm_router_flow_config fc;
    config_init(&fc);
    fc.max_requests = 3;
    fc.n_bands = 1;
    fc.bands[0] = fc.default_band;
    fc.bands[0].priority = 7;
    fc.bands[0].max_requests = 1;
    fc.default_band.max_bytes = 100;
    atomic_store(&g_sat, 2.0);
    reset_order();
    struct waiter w[3];
    start(&w[0], f, &fc, "p7", 7, NULL, 1, 30);
    start(&w[1], f, &fc, "d60", 0, NULL, 60, 30);
    struct tdm_router_flow_ticket t;
    struct tdm_router_flow_ask ask = {
        .cfg = &fc, .priority = 7, .bytes = 1, .deadline = tdm_now() + 5, .may_wait = true};
    tdm_router_flow_admit(f, &ask, &t); // band 7 holds 1 already
    assert_int_equal(t.outcome, TDM_ROUTER_FLOW_REJECTED_CAPACITY);
    assert_false(t.queued);
    ask.priority = 0;
    ask.bytes = 41; // 60 + 41 > 100 bytes in the default band
    tdm_router_flow_admit(f, &ask, &t);
    assert_int_equal(t.outcome, TDM_ROUTER_FLOW_REJECTED_CAPACITY);
    start(&w[2], f, &fc, "d40", 0, NULL, 40, 30); // 100: fits
    ask.bytes = 0;
    ask.priority = 3; // another band, but 3 requests wait: the global limit
    tdm_router_flow_admit(f, &ask, &t);
    assert_int_equal(t.outcome, TDM_ROUTER_FLOW_REJECTED_CAPACITY);
    struct tdm_router_flow_stats st;
    tdm_router_flow_stats(f, &st);
    assert_int_equal(st.queued, 3);
    assert_int_equal(st.bytes, 101);
    atomic_store(&g_sat, 0.0);
    tdm_router_flow_kick(f);
    join_all(w, 3);
    assert_string_equal(order, "p7 d60 d40");
    tdm_router_flow_free(f);
}

// TTL, a client that leaves, and stop: each leaves the queue unserved, with
// its outcome, and the others keep their place.
static void test_evictions(void **state)
{
    (void)state;
    struct tdm_router_flow *f = new_flow();
    struct tdm_router_flow_config fc;
    config_init(&fc);
    atomic_store(&g_sat, 1.0);
    reset_order();
    struct waiter w[3];
    double t0 = tdm_now();
    start(&w[0], f, &fc, "ttl", 0, NULL, 1, 0.2);
    start(&w[1], f, &fc, "gone", 0, NULL, 1, 30);
    start(&w[2], f, &fc, "stay", 0, NULL, 1, 30);
    atomic_store(&w[1].gone, true);
    pthread_join(w[0].th, NULL);
    pthread_join(w[1].th, NULL);
    assert_int_equal(w[0].t.outcome, TDM_ROUTER_FLOW_EVICTED_TTL);
    assert_true(w[0].t.waited >= 0.19);
    assert_true(tdm_now() - t0 < 5);
    assert_int_equal(w[1].t.outcome, TDM_ROUTER_FLOW_EVICTED_CANCELLED);
    struct tdm_router_flow_stats st;
    tdm_router_flow_stats(f, &st);
    assert_int_equal(st.queued, 1);
    tdm_router_flow_stop(f);
    pthread_join(w[2].th, NULL);
    assert_int_equal(w[2].t.outcome, TDM_ROUTER_FLOW_EVICTED_OTHER);
    struct tdm_router_flow_ticket t;
    struct tdm_router_flow_ask ask = {.cfg = &fc, .deadline = tdm_now() + 5, .may_wait = true};
    atomic_store(&g_sat, 0.0);
    tdm_router_flow_admit(f, &ask, &t); // stopped: refused even with room
    assert_int_equal(t.outcome, TDM_ROUTER_FLOW_EVICTED_OTHER);
    assert_string_equal(order, "");
    assert_int_equal(atomic_load(&g_queue_requests), 0);
    assert_string_equal(tdm_router_flow_outcome_name(TDM_ROUTER_FLOW_EVICTED_CANCELLED),
                        "EvictedContextCancelled");
    tdm_router_flow_free(f);
}

// Closed loop: with room for exactly two more (the test's saturation counts
// the dispatched ones), two of five go and three stay until room comes.
static atomic_int g_sent;
static double counting_saturation(void *arg)
{
    (void)arg;
    return atomic_load(&g_sent) >= 2 ? 1.0 : 0.0;
}

static void *routing_waiter(void *arg)
{
    struct waiter *w = arg;
    tdm_router_flow_admit(w->f, &w->ask, &w->t);
    if (w->t.outcome == TDM_ROUTER_FLOW_DISPATCHED) {
        atomic_fetch_add(&g_sent, 1); // routed: its load counts before the token goes back
        tdm_router_flow_routed(w->f, &w->t);
    }
    return NULL;
}

static void test_closed_loop(void **state)
{
    (void)state;
    atomic_store(&g_sent, 0);
    struct tdm_router_flow_hooks h = {.saturation = counting_saturation};
    struct tdm_router_flow *f = NULL;
    assert_int_equal(tdm_router_flow_new(&f, &h), TDM_OK);
    struct tdm_router_flow_config fc;
    config_init(&fc);
    struct waiter w[5];
    for (int i = 0; i < 5; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].f = f;
        w[i].ask =
            (struct tdm_router_flow_ask){.cfg = &fc, .deadline = tdm_now() + 30, .may_wait = true};
        assert_int_equal(pthread_create(&w[i].th, NULL, routing_waiter, &w[i]), 0);
    }
    struct tdm_router_flow_stats st;
    for (int i = 0; i < 5000;
         i++) { // until all five arrived (a loaded machine starts threads late)
        tdm_router_flow_stats(f, &st);
        if (st.queued == 3 && atomic_load(&g_sent) == 2)
            break;
        tdm_sleep(0.001);
    }
    tdm_sleep(0.1); // polls retry meanwhile: still no room
    assert_int_equal(atomic_load(&g_sent), 2);
    tdm_router_flow_stats(f, &st);
    assert_int_equal(st.queued, 3);
    atomic_store(&g_sent, -10); // room again
    tdm_router_flow_kick(f);
    join_all(w, 5);
    assert_int_equal(atomic_load(&g_sent), -7);
    tdm_router_flow_free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_straight_through_and_token),
        cmocka_unit_test(test_priority_then_arrival),
        cmocka_unit_test(test_round_robin_fairness),
        cmocka_unit_test(test_capacity),
        cmocka_unit_test(test_evictions),
        cmocka_unit_test(test_closed_loop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
