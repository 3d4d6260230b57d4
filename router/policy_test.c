// SPDX-License-Identifier: Apache-2.0
// Tests of the routing policies on crafted snapshots: each policy's choice,
// least_loaded counting the requests sent since a report, random tie-breaking
// spreading over equal endpoints, the saturation filter with fail-open and
// stale load, health and role filtering, session affinity, the weighted-random
// distribution and the P/D decider's thresholds.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "policy.h"

#define MAXE 8

struct fixture {
    struct tdm_router_endpoint_view eps[MAXE];
    struct tdm_router_snapshot snap;
};

static struct tdm_router_config *cfg_of(const char *text)
{
    char err[512] = "";
    struct tdm_router_config *cfg = NULL;
    if (tdm_router_config_parse(&cfg, text, strlen(text), NULL, err, sizeof err))
        fail_msg("config: %s", err);
    return cfg;
}

// n endpoints of a role, healthy, fresh zero load, 10 request blocks.
static void setup(struct fixture *f, size_t n, enum tdm_router_role role)
{
    memset(f, 0, sizeof *f);
    for (size_t i = 0; i < n; i++) {
        struct tdm_router_endpoint_view *e = &f->eps[i];
        e->id = i + 1;
        snprintf(e->name, sizeof e->name, "10.0.0.%zu:8001", i + 1);
        snprintf(e->host, sizeof e->host, "10.0.0.%zu", i + 1);
        e->http_port = 8001;
        e->nng_port = 9001;
        e->role = role;
        e->healthy = true;
        e->has_load = true;
        e->load_age_seconds = 0.1;
    }
    f->snap.eps = f->eps;
    f->snap.n = n;
    f->snap.n_request_blocks = 10;
    f->snap.seed = 42;
}

static size_t pick_decode(const struct tdm_router_config *cfg, struct fixture *f,
                          const struct tdm_router_request *req)
{
    struct tdm_router_pick p = {0};
    struct tdm_router_request def = {.num_prompt_tokens = 100};
    assert_int_equal(tdm_router_policy_pick(cfg, &f->snap, req ? req : &def, &p), TDM_OK);
    return p.decode;
}

// Runs profile 0 over every endpoint of f with scores into sc[f->snap.n];
// returns the best candidate.
static size_t score_all(const struct tdm_router_config *cfg, struct fixture *f,
                        struct tdm_router_endpoint_score *sc)
{
    size_t ranked[MAXE], n = 0;
    assert_int_equal(
        tdm_router_policy_run_profile(cfg, 0, true, &f->snap, NULL, ranked, MAXE, &n, sc, NULL),
        TDM_OK);
    assert_int_equal(n, f->snap.n);
    return ranked[0];
}

static uint64_t mix(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
}

static void test_round_robin_cycles(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: round_robin\n");
    struct fixture f;
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    for (uint64_t s = 0; s < 9; s++) {
        f.snap.seq = s;
        f.snap.seed = mix(s + 1); // the seed must not matter
        assert_int_equal(pick_decode(cfg, &f, NULL), s % 3);
    }
    // An unhealthy endpoint leaves the cycle; the others keep alternating.
    f.eps[1].healthy = false;
    size_t a, b;
    f.snap.seq = 10;
    a = pick_decode(cfg, &f, NULL);
    f.snap.seq = 11;
    b = pick_decode(cfg, &f, NULL);
    assert_true(a != 1 && b != 1 && a != b);
    tdm_router_config_unref(cfg);
}

static void test_random_spreads(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: random\n");
    struct fixture f;
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    f.eps[2].load.waiting = 100; // load does not matter to random
    int count[3] = {0};
    for (uint64_t s = 0; s < 3000; s++) {
        f.snap.seed = mix(s * 7 + 3);
        count[pick_decode(cfg, &f, NULL)]++;
    }
    for (int i = 0; i < 3; i++)
        assert_true(count[i] > 850 && count[i] < 1150);
    // Same seed, same pick (replayable).
    f.snap.seed = 99;
    size_t x = pick_decode(cfg, &f, NULL);
    assert_int_equal(pick_decode(cfg, &f, NULL), x);
    tdm_router_config_unref(cfg);
}

static void test_least_loaded_picks_least(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\n");
    struct fixture f;
    setup(&f, 4, TDM_ROUTER_ROLE_DECODE);
    int waiting[4] = {3, 2, 0, 5}, running[4] = {4, 1, 2, 8};
    double kv[4] = {0.5, 0.3, 0.2, 0.9};
    for (int i = 0; i < 4; i++) {
        f.eps[i].load.waiting = waiting[i];
        f.eps[i].load.running = running[i];
        f.eps[i].load.kv_usage = kv[i];
    }
    for (uint64_t s = 0; s < 50; s++) {
        f.snap.seed = mix(s);
        f.snap.seq = s;
        assert_int_equal(pick_decode(cfg, &f, NULL), 2);
    }
    // Now endpoint 1 is the least loaded everywhere.
    f.eps[2].load.waiting = 6;
    f.eps[2].load.running = 9;
    f.eps[1].load.waiting = 0;
    assert_int_equal(pick_decode(cfg, &f, NULL), 1);
    tdm_router_config_unref(cfg);
}

// least_loaded judges a worker by its reported queue plus the requests the
// router sent it since that report (view.unreported), so a worker that has not
// reported yet is judged by the router's in-flight count alone.
static void test_least_loaded_counts_unreported(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\n");
    struct fixture f;
    setup(&f, 2, TDM_ROUTER_ROLE_DECODE);
    // 0 reported idle, but the router has sent it 2 since; 1 just joined: no
    // report, nothing in flight. Reported load alone is a tie (random).
    f.eps[0].inflight = f.eps[0].unreported = 2;
    f.eps[1].has_load = false;
    f.eps[1].load_stale = true;
    f.eps[1].load_age_seconds = -1;
    for (uint64_t s = 0; s < 64; s++) {
        f.snap.seed = mix(s + 5);
        assert_int_equal(pick_decode(cfg, &f, NULL), 1);
    }
    // Without a report its in-flight count is its whole queue: 3 sent, none
    // reported, is more than 0's reported 1.
    f.eps[0].inflight = 4; // sent before its report: in its load already
    f.eps[0].unreported = 0;
    f.eps[0].load.waiting = 1;
    f.eps[1].inflight = f.eps[1].unreported = 3;
    for (uint64_t s = 0; s < 16; s++) {
        f.snap.seed = mix(s + 77);
        assert_int_equal(pick_decode(cfg, &f, NULL), 0);
    }
    // The sum: 0 reported 1 waiting + 1 unreported = 2 < 3.
    f.eps[0].unreported = 1;
    assert_int_equal(pick_decode(cfg, &f, NULL), 0);
    f.eps[0].unreported = 3; // 4 > 3
    assert_int_equal(pick_decode(cfg, &f, NULL), 1);
    // Scores: queue-scorer normalises the sums, load-aware-scorer reads the sum.
    struct tdm_router_config *sc_cfg =
        cfg_of("plugins:\n- type: queue-scorer\n"
               "- {type: load-aware-scorer, parameters: {threshold: 8}}\n"
               "schedulingProfiles:\n- name: d\n  plugins:\n"
               "  - {pluginRef: queue-scorer}\n  - {pluginRef: load-aware-scorer}\n");
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].load.waiting = 2; // 2 + 0
    f.eps[1].unreported = 4;   // 0 + 4
    f.eps[1].inflight = 4;
    f.eps[2].load.waiting = 1; // 1 + 5
    f.eps[2].unreported = 5;
    f.eps[2].inflight = 7;
    struct tdm_router_endpoint_score sc[3];
    assert_int_equal(score_all(sc_cfg, &f, sc), 0);
    assert_true(fabs(sc[0].scores[TDM_ROUTER_QUEUE_SCORER] - 1.0) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_QUEUE_SCORER] - 0.5) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_QUEUE_SCORER] - 0.0) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_LOAD_AWARE_SCORER] - 0.25) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_LOAD_AWARE_SCORER] - 0.125) < 1e-9);
    tdm_router_config_unref(sc_cfg);
    tdm_router_config_unref(cfg);
}

static void test_prefix_cache_picks_longest(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: prefix_cache\n");
    struct fixture f;
    setup(&f, 4, TDM_ROUTER_ROLE_DECODE);
    int match[4] = {2, 0, 9, 5};
    for (int i = 0; i < 4; i++)
        f.eps[i].prefix_match_blocks = match[i];
    for (uint64_t s = 0; s < 50; s++) {
        f.snap.seed = mix(s);
        assert_int_equal(pick_decode(cfg, &f, NULL), 2);
    }
    // A much busier holder loses to an idle one with a shorter prefix only when
    // the prefix gain is small: 9 vs 5 blocks of 10 = 1.2 points of prefix
    // (weight 3) against 1 point of queue (weight 1): still the holder.
    f.eps[2].load.waiting = 10;
    assert_int_equal(pick_decode(cfg, &f, NULL), 2);
    tdm_router_config_unref(cfg);
}

static void test_session_affinity_sticks(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: session_affinity\n");
    struct fixture f;
    setup(&f, 4, TDM_ROUTER_ROLE_DECODE);
    char tok[256];
    assert_true(tdm_router_session_token(f.eps[3].name, tok, sizeof tok) > 0);
    struct tdm_router_request req = {.num_prompt_tokens = 10, .session = tok};
    f.eps[3].load.waiting = 4; // busier, still sticky
    for (uint64_t s = 0; s < 30; s++) {
        f.snap.seed = mix(s);
        f.snap.seq = s;
        assert_int_equal(pick_decode(cfg, &f, &req), 3);
    }
    // The raw name works too.
    req.session = f.eps[1].name;
    assert_int_equal(pick_decode(cfg, &f, &req), 1);
    // Opaque session ids hash onto an endpoint and stay there.
    size_t seen[4] = {0};
    for (int u = 0; u < 40; u++) {
        char sid[32];
        snprintf(sid, sizeof sid, "user-%d", u);
        req.session = sid;
        f.snap.seed = 1;
        size_t first = pick_decode(cfg, &f, &req);
        for (uint64_t s = 2; s < 6; s++) {
            f.snap.seed = mix(s);
            assert_int_equal(pick_decode(cfg, &f, &req), first);
        }
        seen[first]++;
        // Removing another endpoint does not move the session (rendezvous).
        size_t other = (first + 1) % 4;
        f.eps[other].healthy = false;
        assert_int_equal(pick_decode(cfg, &f, &req), first);
        f.eps[other].healthy = true;
    }
    int used = 0;
    for (int i = 0; i < 4; i++)
        used += seen[i] > 0;
    assert_true(used >= 3);
    // The sticky endpoint down: the session moves to a healthy one.
    f.eps[3].healthy = false;
    req.session = tok;
    assert_int_not_equal(pick_decode(cfg, &f, &req), 3);
    // Token round trip and a too-small buffer.
    char small[4];
    assert_int_equal(tdm_router_session_token("10.0.0.1:8001", small, sizeof small), 0);
    assert_int_equal(tdm_router_session_token("ab", tok, sizeof tok), 4);
    assert_string_equal(tok, "YWI=");
    tdm_router_config_unref(cfg);
}

static void test_ties_spread_randomly(void **state)
{
    (void)state;
    // max-score-picker over identical endpoints: every pick is a tie.
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\n");
    struct fixture f;
    setup(&f, 4, TDM_ROUTER_ROLE_DECODE);
    int count[4] = {0};
    uint64_t seed = 12345;
    for (int i = 0; i < 4000; i++) {
        seed = mix(seed + 0x9E3779B97F4A7C15ull);
        f.snap.seed = seed;
        count[pick_decode(cfg, &f, NULL)]++;
    }
    for (int i = 0; i < 4; i++)
        if (count[i] < 850 || count[i] > 1150)
            fail_msg("endpoint %d got %d of 4000 tied picks", i, count[i]);
    // Only the tied best share: a worse endpoint is never picked.
    f.eps[0].load.waiting = 1;
    for (int i = 0; i < 200; i++) {
        f.snap.seed = mix((uint64_t)i);
        assert_int_not_equal(pick_decode(cfg, &f, NULL), 0);
    }
    tdm_router_config_unref(cfg);
}

static const char *util_cfg = "plugins:\n"
                              "- type: decode-filter\n"
                              "- type: utilization-detector\n"
                              "  parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}\n"
                              "- type: queue-scorer\n"
                              "schedulingProfiles:\n"
                              "- name: decode\n"
                              "  plugins:\n"
                              "  - pluginRef: decode-filter\n"
                              "  - pluginRef: utilization-detector\n"
                              "  - pluginRef: queue-scorer\n";

static void test_saturation_filter_fail_open_and_stale(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of(util_cfg);
    struct fixture f;
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].load.waiting = 6;     // saturated by queue
    f.eps[1].load.kv_usage = 0.95; // saturated by KV
    f.eps[2].load.waiting = 4;     // busy but under the limits
    for (uint64_t s = 0; s < 20; s++) {
        f.snap.seed = mix(s);
        struct tdm_router_pick p = {0};
        struct tdm_router_request req = {.num_prompt_tokens = 10};
        assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
        assert_int_equal(p.decode, 2);
        assert_false(p.fail_open);
    }
    // All saturated: fail open, the queue scorer then picks the shortest queue.
    f.eps[2].load.waiting = 7;
    struct tdm_router_pick p = {0};
    struct tdm_router_request req = {.num_prompt_tokens = 10};
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_true(p.fail_open);
    assert_int_equal(p.decode, 1); // waiting 0
    // Stale load counts as saturated even when it looked idle.
    setup(&f, 2, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].load.waiting = 3;
    f.eps[1].load_stale = true; // reported 0 waiting, but long ago
    for (uint64_t s = 0; s < 20; s++) {
        f.snap.seed = mix(s);
        assert_int_equal(pick_decode(cfg, &f, NULL), 0);
    }
    f.eps[1].load_stale = false;
    f.eps[1].has_load = false; // never reported
    assert_int_equal(pick_decode(cfg, &f, NULL), 0);
    // ... while 0's queue with what the router sent since its report (3 + 2)
    // is longer than 1's (0): the filter drops 1 before any scorer counts.
    f.eps[0].unreported = f.eps[0].inflight = 2;
    f.eps[1].inflight = f.eps[1].unreported = 0;
    assert_int_equal(pick_decode(cfg, &f, NULL), 0);
    // tdm_router_policy_saturated directly
    struct tdm_router_plugin_params par = {
        .utilization = {.queue_depth_threshold = 5, .kv_cache_util_threshold = 0.8}};
    struct tdm_router_endpoint_view v = {.has_load = true, .load = {.waiting = 5}};
    assert_false(tdm_router_policy_saturated(&par, &v));
    v.load.waiting = 6;
    assert_true(tdm_router_policy_saturated(&par, &v));
    par.utilization.headroom = 0.5; // limits 7.5 and 1.2
    assert_false(tdm_router_policy_saturated(&par, &v));
    tdm_router_config_unref(cfg);
}

static void test_health_and_roles(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\n");
    struct fixture f;
    setup(&f, 4, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].role = TDM_ROUTER_ROLE_PREFILL; // never a decode pick
    f.eps[1].healthy = false;
    f.eps[2].draining = true;
    for (uint64_t s = 0; s < 20; s++) {
        f.snap.seed = mix(s);
        assert_int_equal(pick_decode(cfg, &f, NULL), 3);
    }
    f.eps[3].healthy = false;
    struct tdm_router_pick p = {0};
    struct tdm_router_request req = {.num_prompt_tokens = 10};
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_EBUSY);
    assert_true(p.decode == SIZE_MAX);
    // Unlabelled endpoints decode (llm-d's decode-filter keeps them).
    f.eps[3].healthy = true;
    f.eps[3].role = TDM_ROUTER_ROLE_NONE;
    assert_int_equal(pick_decode(cfg, &f, NULL), 3);
    tdm_router_config_unref(cfg);
}

static void test_weighted_random(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("plugins:\n- type: kv-cache-utilization-scorer\n- type: weighted-random-picker\n"
               "schedulingProfiles:\n- name: d\n  plugins:\n"
               "  - {pluginRef: kv-cache-utilization-scorer}\n"
               "  - {pluginRef: weighted-random-picker}\n");
    struct fixture f;
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].load.kv_usage = 0.0;  // score 1
    f.eps[1].load.kv_usage = 0.75; // score 0.25
    f.eps[2].load.kv_usage = 1.0;  // score 0: never
    int count[3] = {0};
    for (uint64_t s = 0; s < 5000; s++) {
        f.snap.seed = mix(s + 17);
        count[pick_decode(cfg, &f, NULL)]++;
    }
    assert_int_equal(count[2], 0);
    double ratio = (double)count[0] / (double)count[1];
    if (ratio < 3.4 || ratio > 4.7)
        fail_msg("weighted-random ratio %.2f, expected ~4 (%d vs %d)", ratio, count[0], count[1]);
    // The ranked list still holds everyone (retry order).
    size_t ranked[3], n = 0;
    assert_int_equal(
        tdm_router_policy_run_profile(cfg, 0, true, &f.snap, NULL, ranked, 3, &n, NULL, NULL),
        TDM_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ranked[2], 2);
    tdm_router_config_unref(cfg);
}

static void test_scorer_values(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("plugins:\n"
               "- type: queue-scorer\n- type: running-requests-size-scorer\n"
               "- type: kv-cache-utilization-scorer\n- type: prefix-cache-scorer\n"
               "- {type: load-aware-scorer, parameters: {threshold: 10}}\n"
               "- {type: active-request-scorer, parameters: {maxBusyRequests: 4}}\n"
               "schedulingProfiles:\n- name: d\n  plugins:\n"
               "  - {pluginRef: queue-scorer}\n  - {pluginRef: running-requests-size-scorer}\n"
               "  - {pluginRef: kv-cache-utilization-scorer, weight: 2}\n"
               "  - {pluginRef: prefix-cache-scorer}\n  - {pluginRef: load-aware-scorer}\n"
               "  - {pluginRef: active-request-scorer}\n");
    struct fixture f;
    setup(&f, 3, TDM_ROUTER_ROLE_DECODE);
    f.eps[0].load = (struct tdm_router_load){.running = 2, .waiting = 0, .kv_usage = 0.25};
    f.eps[1].load = (struct tdm_router_load){.running = 6, .waiting = 5, .kv_usage = 0.5};
    f.eps[2].load = (struct tdm_router_load){.running = 4, .waiting = 10, .kv_usage = 1.0};
    f.eps[1].prefix_match_blocks = 5;
    f.eps[2].inflight = 2;
    struct tdm_router_endpoint_score sc[3];
    size_t best = score_all(cfg, &f, sc);
    assert_true(fabs(sc[0].scores[TDM_ROUTER_QUEUE_SCORER] - 1.0) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_QUEUE_SCORER] - 0.5) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_QUEUE_SCORER] - 0.0) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_RUNNING_SCORER] - 0.0) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_RUNNING_SCORER] - 0.5) < 1e-9);
    assert_true(fabs(sc[0].scores[TDM_ROUTER_KV_CACHE_UTIL_SCORER] - 0.75) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_PREFIX_CACHE_SCORER] - 0.5) < 1e-9);
    assert_true(fabs(sc[0].scores[TDM_ROUTER_LOAD_AWARE_SCORER] - 0.5) < 1e-9);
    assert_true(fabs(sc[1].scores[TDM_ROUTER_LOAD_AWARE_SCORER] - 0.25) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_LOAD_AWARE_SCORER] - 0.0) < 1e-9);
    assert_true(fabs(sc[2].scores[TDM_ROUTER_ACTIVE_REQUEST_SCORER] - 0.5) < 1e-9);
    // total = sum of weight * score (kv weighted 2)
    double t0 = 1.0 + 1.0 + 2 * 0.75 + 0.0 + 0.5 + 1.0;
    assert_true(fabs(sc[0].total - t0) < 1e-9);
    assert_int_equal(best, 0);
    assert_true(isnan(sc[0].scores[TDM_ROUTER_SESSION_AFFINITY_SCORER]));
    char line[1024];
    size_t len = tdm_router_policy_format_scores(cfg, 0, &f.snap, sc, line, sizeof line);
    assert_true(len > 0);
    assert_non_null(strstr(line, "10.0.0.1:8001 total=5.000 queue-scorer=1.000"));
    // Truncation never overruns.
    assert_int_equal(tdm_router_policy_format_scores(cfg, 0, &f.snap, sc, line, 10), 9);
    tdm_router_config_unref(cfg);
}

// 2 prefill + 2 decode endpoints.
static void setup_pd(struct fixture *f)
{
    setup(f, 4, TDM_ROUTER_ROLE_PREFILL);
    f->eps[2].role = TDM_ROUTER_ROLE_DECODE;
    f->eps[3].role = TDM_ROUTER_ROLE_DECODE;
}

static void test_pd_decider(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: prefix_cache\npd_threshold_tokens: 256\n");
    struct fixture f;
    setup_pd(&f);
    f.snap.n_request_blocks = 18;
    struct tdm_router_pick p = {0};
    struct tdm_router_request req = {.num_prompt_tokens = 200};
    // 200 uncached <= 256: decode-only
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    assert_int_equal(p.n_prefill, 0);
    assert_true(p.decode == 2 || p.decode == 3);
    assert_string_equal(tdm_router_decision_name(p.decision), "decode-only");
    // 300 uncached > 256: remote prefill, both prefill endpoints in retry order
    req.num_prompt_tokens = 300;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    assert_string_equal(tdm_router_decision_name(p.decision), "prefill-decode");
    assert_int_equal(p.n_prefill, 2);
    assert_true((p.prefill[0] == 0 && p.prefill[1] == 1) ||
                (p.prefill[0] == 1 && p.prefill[1] == 0));
    assert_int_equal(p.uncached_tokens, 300);
    // Exactly at the threshold: not longer, so local.
    req.num_prompt_tokens = 256;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    // 300 tokens of which decode endpoint 3 caches 4 blocks (64): 236 uncached -> local,
    // and prefix_cache routes to it.
    req.num_prompt_tokens = 300;
    f.eps[3].prefix_match_blocks = 4;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decode, 3);
    assert_int_equal(p.cached_tokens, 64);
    assert_int_equal(p.uncached_tokens, 236);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    // The prefill endpoints' own scores order the retry list: endpoint 1 holds more.
    f.eps[3].prefix_match_blocks = 0;
    f.eps[1].prefix_match_blocks = 6;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    assert_int_equal(p.prefill[0], 1);
    assert_int_equal(p.prefill[1], 0);
    // A fully cached prompt still leaves one token for the decode worker.
    f.eps[2].prefix_match_blocks = 18;
    f.eps[3].prefix_match_blocks = 18;
    req.num_prompt_tokens = 288;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.cached_tokens, 287);
    assert_int_equal(p.uncached_tokens, 1);
    // No healthy prefill endpoint: decode-only.
    f.eps[2].prefix_match_blocks = f.eps[3].prefix_match_blocks = 0;
    f.eps[0].healthy = f.eps[1].healthy = false;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    tdm_router_config_unref(cfg);

    // always / never
    cfg = cfg_of("policy: round_robin\npd_mode: always\n");
    setup_pd(&f);
    req.num_prompt_tokens = 1;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    // A request prefilled where it decodes (prompt logprobs): decode-only
    // even under always, with no prefill pick.
    req.decode_only = true;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    assert_int_equal(p.n_prefill, 0);
    req.decode_only = false;
    tdm_router_config_unref(cfg);
    cfg = cfg_of("policy: round_robin\npd_mode: never\n");
    req.num_prompt_tokens = 100000;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    tdm_router_config_unref(cfg);

    // A prefill-decode worker is never its own remote prefill.
    cfg = cfg_of("policy: round_robin\npd_mode: always\n");
    setup(&f, 1, TDM_ROUTER_ROLE_PREFILL_DECODE);
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decode, 0);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    setup(&f, 2, TDM_ROUTER_ROLE_PREFILL_DECODE);
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    assert_int_equal(p.n_prefill, 1);
    assert_int_not_equal(p.prefill[0], p.decode);
    tdm_router_config_unref(cfg);

    // llm-d config: decider threshold from nonCachedTokens.
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/deploy/config/pd-llm-d.yaml", TANDEM_SOURCE_DIR);
    assert_int_equal(tdm_router_config_load(&cfg, path, err, sizeof err), TDM_OK);
    setup_pd(&f);
    req.num_prompt_tokens = 257;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    req.num_prompt_tokens = 256;
    assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
    assert_int_equal(p.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    tdm_router_config_unref(cfg);
}

// colocation-scorer: two pods, each a decode and a prefill endpoint at one
// address (overlays/gpu-one-pod). Whichever decode endpoint is picked, the
// prefill endpoint of its own pod comes first, even when it is the busier
// one; without the scorer the less loaded prefill endpoint would. In the
// decode profile it scores every candidate 0.
static void test_colocation_scorer(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of(
        "plugins:\n- {type: prefill-filter}\n- {type: decode-filter}\n- {type: queue-scorer}\n"
        "- {type: colocation-scorer}\n- {type: always-disagg-pd-decider}\n"
        "- {type: disagg-profile-handler}\nschedulingProfiles:\n"
        "- {name: decode, plugins: [{pluginRef: decode-filter}, {pluginRef: colocation-scorer}, "
        "{pluginRef: queue-scorer}]}\n"
        "- {name: prefill, plugins: [{pluginRef: prefill-filter}, {pluginRef: queue-scorer}, "
        "{pluginRef: colocation-scorer, weight: 4}]}\n");
    struct fixture f;
    setup_pd(&f);                                                       // 0, 1 prefill; 2, 3 decode
    snprintf(f.eps[2].host, sizeof f.eps[2].host, "%s", f.eps[1].host); // pod B: 1 and 2
    snprintf(f.eps[3].host, sizeof f.eps[3].host, "%s", f.eps[0].host); // pod A: 0 and 3
    f.eps[0].load.waiting = 3; // pod A's prefill is the busier one
    struct tdm_router_request req = {.num_prompt_tokens = 64};
    int seen[2] = {0, 0};
    for (int i = 0; i < 40; i++) {
        f.snap.seed = (uint64_t)i * 7919u;
        f.eps[2].load.waiting = i % 2; // the decode pick alternates
        f.eps[3].load.waiting = 1 - i % 2;
        struct tdm_router_pick p = {0};
        assert_int_equal(tdm_router_policy_pick(cfg, &f.snap, &req, &p), TDM_OK);
        assert_int_equal(p.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
        assert_int_equal(p.n_prefill, 2);
        assert_string_equal(f.eps[p.prefill[0]].host, f.eps[p.decode].host);
        seen[p.decode - 2]++;
    }
    assert_true(seen[0] > 0 && seen[1] > 0);
    // The decode profile: 0 for all (no decode endpoint yet).
    struct tdm_router_endpoint_score sc[MAXE];
    size_t ranked[MAXE], n = 0;
    assert_int_equal(tdm_router_policy_run_profile(cfg, cfg->decode_profile, true, &f.snap, &req,
                                                   ranked, MAXE, &n, sc, NULL),
                     TDM_OK);
    assert_true(sc[2].scores[TDM_ROUTER_COLOCATION_SCORER] == 0.0);
    assert_true(sc[3].scores[TDM_ROUTER_COLOCATION_SCORER] == 0.0);
    tdm_router_config_unref(cfg);
}

int main(void)
{
    tdm_log_level = TDM_LOG_LEVEL_ERR;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_robin_cycles),
        cmocka_unit_test(test_random_spreads),
        cmocka_unit_test(test_least_loaded_picks_least),
        cmocka_unit_test(test_least_loaded_counts_unreported),
        cmocka_unit_test(test_prefix_cache_picks_longest),
        cmocka_unit_test(test_session_affinity_sticks),
        cmocka_unit_test(test_ties_spread_randomly),
        cmocka_unit_test(test_saturation_filter_fail_open_and_stale),
        cmocka_unit_test(test_health_and_roles),
        cmocka_unit_test(test_weighted_random),
        cmocka_unit_test(test_scorer_values),
        cmocka_unit_test(test_pd_decider),
        cmocka_unit_test(test_colocation_scorer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
