// SPDX-License-Identifier: Apache-2.0
// Tests of the endpoint registry: block hashes equal the KV cache's, DNS
// discovery through a fake resolver (addresses added, vanished ones drained
// after their in-flight requests), config reloads of the static list, load
// staleness, not up (never reported, link down), reports (liveness, restarts,
// KV event batches), the prefix index (routing records, KV events, LRU
// capacity), an attempt's two lock entries
// (what begin holds, records and hands back; what end reports and releases; a
// replaced attempt's report before the pick and release after the hold),
// least_loaded spreading a burst between two reports (requests held since a
// report count in the queue), passive health, and active health checks against
// a local HTTP server whose /health flips between 200 and 503 (and a silent
// listener: dead, or busy while load reports arrive).
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmocka.h>

#include "core.h"
#include "endpoints.h"
#include "http.h"
#include "kv_cache.h"
#include "policy.h"
#include "router_metrics.h"

static struct tdm_router_config *cfg_of(const char *text)
{
    char err[512] = "";
    struct tdm_router_config *cfg = NULL;
    if (tdm_router_config_parse(&cfg, text, strlen(text), NULL, err, sizeof err))
        fail_msg("config: %s", err);
    return cfg;
}

static struct tdm_router_endpoints *reg_of(struct tdm_router_config *cfg)
{
    char err[256];
    struct tdm_router_endpoints *reg = NULL;
    assert_int_equal(tdm_router_endpoints_new(&reg, cfg, NULL, err, sizeof err), TDM_OK);
    return reg;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static bool find(struct tdm_router_endpoints *reg, const char *name,
                 struct tdm_router_endpoint_view *v)
{
    return tdm_router_endpoints_find(reg, name, v) == TDM_OK;
}

// ---- block hashes ----------------------------------------------------------------------------

static void test_block_hashes_match_kv_cache(void **state)
{
    (void)state;
    struct tdm_kv_config kc = {.num_layers = 1,
                               .num_kv_heads = 1,
                               .head_dim = 4,
                               .block_size = 16,
                               .num_blocks = 32,
                               .enable_prefix_caching = true};
    char err[256];
    struct tdm_kv_cache *kv = NULL;
    assert_int_equal(tdm_kv_new(&kv, &kc, err, sizeof err), TDM_OK);
    int32_t tokens[16 * 5 + 7];
    for (size_t i = 0; i < sizeof tokens / sizeof *tokens; i++)
        tokens[i] = (int32_t)((i * 7919u + 13u) % 151643u);
    int n = (int)(sizeof tokens / sizeof *tokens);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    assert_int_equal(tdm_kv_reserve(kv, &seq, n), TDM_OK);
    tdm_kv_commit(kv, &seq, tokens, n);
    uint64_t h[8];
    size_t nb = tdm_router_block_hashes(tokens, (size_t)n, 16, 0, h, 8);
    assert_int_equal(nb, 5);
    for (size_t i = 0; i < nb; i++)
        assert_true(h[i] == seq.block_hashes[i]);
    // Chained: a different first block changes every later hash.
    int32_t t2[16 * 2];
    memcpy(t2, tokens, sizeof t2);
    t2[0] ^= 1;
    uint64_t h2[2];
    tdm_router_block_hashes(t2, 32, 16, 0, h2, 2);
    assert_true(h2[0] != h[0] && h2[1] != h[1]);
    // cap smaller than the block count: returns the count, writes cap.
    uint64_t one[1];
    assert_int_equal(tdm_router_block_hashes(tokens, (size_t)n, 16, 0, one, 1), 5);
    assert_true(one[0] == h[0]);
    assert_int_equal(tdm_router_block_hashes(tokens, 15, 16, 0, one, 1), 0);
    assert_int_equal(tdm_router_block_hashes(tokens, 15, 0, 0, one, 1), 0);
    // A request with a cache_salt: the worker's salted chain, from the same root.
    struct tdm_kv_seq salted;
    tdm_kv_seq_init(&salted);
    salted.root_hash = tdm_kv_salt_hash("tenant", 6);
    assert_int_equal(tdm_kv_reserve(kv, &salted, n), TDM_OK);
    tdm_kv_commit(kv, &salted, tokens, n);
    uint64_t hs[8];
    assert_int_equal(tdm_router_block_hashes(tokens, (size_t)n, 16, salted.root_hash, hs, 8), 5);
    for (size_t i = 0; i < nb; i++)
        assert_true(hs[i] == salted.block_hashes[i] && hs[i] != h[i]);
    tdm_kv_seq_release(kv, &salted);
    tdm_kv_seq_release(kv, &seq);
    tdm_kv_free(kv);
}

// ---- DNS discovery --------------------------------------------------------------------------

struct fake_dns {
    const char *name;
    const char *addrs[8];
    int n; // -1: fails to resolve
    atomic_int calls;
};

static int fake_resolve(const char *name, char (*addrs)[TDM_ROUTER_NAME_MAX], int cap, void *arg)
{
    struct fake_dns *d = arg;
    atomic_fetch_add(&d->calls, 1);
    if (strcmp(name, d->name) || d->n < 0)
        return -1;
    int n = 0;
    for (; n < d->n && n < cap; n++)
        snprintf(addrs[n], TDM_ROUTER_NAME_MAX, "%s", d->addrs[n]);
    return n;
}

static void test_dns_discovery(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("policy: round_robin\n"
               "endpoints:\n"
               "  decode: {http_port: 8001, nng_port: 9001, dns: [decode.svc]}\n"
               "  prefill: ['127.0.0.1:8101']\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct fake_dns d = {.name = "decode.svc", .addrs = {"10.1.0.1", "10.1.0.2"}, .n = 2};
    tdm_router_endpoints_set_resolver(reg, fake_resolve, &d);
    size_t total, healthy;
    tdm_router_endpoints_count(reg, true, &total, &healthy);
    assert_int_equal(total, 0); // not resolved yet
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    tdm_router_endpoints_count(reg, true, &total, &healthy);
    assert_int_equal(total, 2);
    assert_int_equal(healthy, 0); // discovered endpoints wait for their first check
    struct tdm_router_endpoint_view a, b;
    assert_true(find(reg, "10.1.0.1:8001", &a));
    assert_int_equal(a.nng_port, 9001);
    assert_int_equal(a.role, TDM_ROUTER_ROLE_DECODE);
    assert_string_equal(a.host, "10.1.0.1");
    tdm_router_endpoints_set_healthy(reg, a.id, true);

    // A new address appears, 10.1.0.1 vanishes while a request is in flight.
    d.addrs[0] = "10.1.0.3";
    assert_int_equal(tdm_router_endpoints_acquire(reg, a.id), TDM_OK);
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    tdm_router_endpoints_count(reg, true, &total, NULL);
    assert_int_equal(total, 2); // .2 and .3; .1 drains
    assert_true(find(reg, "10.1.0.3:8001", &b));
    assert_true(find(reg, "10.1.0.1:8001", &a));
    assert_true(a.draining);
    assert_int_equal(a.inflight, 1);
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_int_equal(snap.n, 3); // prefill + 2 decode, not the draining one
    for (size_t i = 0; i < snap.n; i++)
        assert_string_not_equal(snap.eps[i].name, "10.1.0.1:8001");
    tdm_router_snapshot_free(&snap);
    // Passive reports on the draining endpoint still land; the release removes it.
    tdm_router_endpoints_report(reg, a.id, TDM_ROUTER_OUTCOME_SUCCESS);
    tdm_router_endpoints_release(reg, a.id);
    assert_false(find(reg, "10.1.0.1:8001", &a));
    assert_int_equal(tdm_router_endpoints_acquire(reg, a.id), TDM_ENOTFOUND);

    // The name stops resolving: its endpoints are kept (a DNS hiccup).
    d.n = -1;
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    tdm_router_endpoints_count(reg, true, &total, NULL);
    assert_int_equal(total, 2);
    // It resolves to nothing (scaled to zero): all drain and, idle, go.
    d.n = 0;
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    tdm_router_endpoints_count(reg, true, &total, NULL);
    assert_int_equal(total, 0);
    // Back with an old address: a new id (state is not resurrected).
    d.n = 1;
    d.addrs[0] = "10.1.0.2";
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    assert_true(find(reg, "10.1.0.2:8001", &b));
    assert_true(b.id > a.id);

    // IPv6 addresses get bracketed names.
    d.n = 1;
    d.addrs[0] = "fd00::7";
    assert_int_equal(tdm_router_endpoints_refresh_dns(reg), TDM_OK);
    assert_true(find(reg, "[fd00::7]:8001", &b));
    assert_string_equal(b.host, "fd00::7");
    assert_true(atomic_load(&d.calls) >= 6);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

static void test_dns_background_thread(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("policy: round_robin\n"
               "endpoints:\n"
               "  decode: {dns: [decode.svc]}\n"
               "  dns_refresh_seconds: 0.1\n"
               "health: {interval_seconds: 30, timeout_seconds: 0.2}\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct fake_dns d = {.name = "decode.svc", .addrs = {"10.2.0.1"}, .n = 1};
    tdm_router_endpoints_set_resolver(reg, fake_resolve, &d);
    assert_int_equal(tdm_router_endpoints_start(reg), TDM_OK);
    size_t total = 0;
    for (int i = 0; i < 100 && total == 0; i++) {
        sleep_ms(20);
        tdm_router_endpoints_count(reg, true, &total, NULL);
    }
    assert_int_equal(total, 1);
    int before = atomic_load(&d.calls);
    sleep_ms(350);
    assert_true(atomic_load(&d.calls) >= before + 2); // re-resolved periodically
    tdm_router_endpoints_stop(reg);
    tdm_router_endpoints_stop(reg); // twice is fine
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

// ---- config reload of the static list
// -------------------------------------------------------------

static void test_apply_config(void **state)
{
    (void)state;
    struct tdm_router_config *c1 =
        cfg_of("policy: round_robin\nendpoints: {decode: ['10.0.0.1:8001', '10.0.0.2:8001']}\n");
    struct tdm_router_config *c2 =
        cfg_of("policy: random\nendpoints:\n  decode: ['10.0.0.2:8001']\n"
               "  prefill: [{host: 10.0.0.9, http_port: 8101, nng_port: 7000}]\n");
    struct tdm_router_endpoints *reg = reg_of(c1);
    struct tdm_router_endpoint_view v1, v2, v9;
    assert_true(find(reg, "10.0.0.1:8001", &v1));
    assert_true(v1.healthy); // present at creation: healthy at once
    assert_true(find(reg, "10.0.0.2:8001", &v2));
    tdm_router_endpoints_set_load(reg, v2.id, &(struct tdm_router_load){.running = 3});
    assert_int_equal(tdm_router_endpoints_apply_config(reg, c2), TDM_OK);
    assert_false(find(reg, "10.0.0.1:8001", &v1)); // idle: removed at once
    struct tdm_router_endpoint_view again;
    assert_true(find(reg, "10.0.0.2:8001", &again));
    assert_true(again.id == v2.id); // kept with its state
    assert_int_equal(again.load.running, 3);
    assert_true(find(reg, "10.0.0.9:8101", &v9));
    assert_int_equal(v9.nng_port, 7000);
    assert_int_equal(v9.role, TDM_ROUTER_ROLE_PREFILL);
    assert_false(v9.healthy); // added later: waits for a check
    size_t total, healthy;
    tdm_router_endpoints_count(reg, false, &total, &healthy);
    assert_int_equal(total, 1);
    assert_int_equal(healthy, 0);
    // list sees everything
    struct tdm_router_endpoint_view all[4];
    assert_int_equal(tdm_router_endpoints_list(reg, all, 4), 2);
    assert_int_equal(tdm_router_endpoints_list(reg, all, 1), 2);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(c1);
    tdm_router_config_unref(c2);
}

// ---- load, prefix index, passive health ---------------------------------------------------------

static void test_load_staleness(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\nload_stale_seconds: 0.1\n"
                                           "endpoints: {decode: ['10.0.0.1:8001']}\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_endpoint_view v;
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_false(v.has_load);
    assert_true(v.load_stale); // never reported = stale
    assert_true(v.load_age_seconds < 0);
    struct tdm_router_load l = {.running = 2, .waiting = 1, .kv_usage = 0.5};
    assert_int_equal(tdm_router_endpoints_set_load(reg, v.id, &l), TDM_OK);
    assert_int_equal(tdm_router_endpoints_set_load(reg, 999, &l), TDM_ENOTFOUND);
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_int_equal(snap.n, 1);
    assert_true(snap.eps[0].has_load);
    assert_false(snap.eps[0].load_stale);
    assert_int_equal(snap.eps[0].load.running, 2);
    assert_true(snap.eps[0].load.kv_usage == 0.5);
    uint64_t seq0 = snap.seq;
    tdm_router_snapshot_free(&snap);
    sleep_ms(150);
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_true(snap.eps[0].load_stale);
    assert_true(snap.eps[0].load_age_seconds >= 0.1);
    assert_true(snap.seq == seq0 + 1); // round robin position advances per snapshot
    tdm_router_snapshot_free(&snap);
    tdm_router_snapshot_free(NULL);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

// Not up = never reported while the poller's link is down: a new endpoint
// is not (its link not known down), a down link makes it so, a link up or a
// report ends it, and a link down after a report does not bring it back.
static void test_not_up(void **state)
{
    (void)state;
    assert_true(tdm_router_endpoint_not_up(0, true));
    assert_false(tdm_router_endpoint_not_up(0, false));
    assert_false(tdm_router_endpoint_not_up(12.5, true));
    struct tdm_router_config *cfg =
        cfg_of("policy: round_robin\nendpoints: {decode: ['10.0.0.1:8001']}\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_endpoint_view v;
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_false(v.not_up);
    tdm_router_endpoints_set_link_down(reg, v.id, true);
    tdm_router_endpoints_set_link_down(reg, 999, true); // unknown: ignored
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_true(v.not_up);
    assert_true(v.healthy); // nothing against its health
    tdm_router_endpoints_set_link_down(reg, v.id, false);
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_false(v.not_up);
    tdm_router_endpoints_set_link_down(reg, v.id, true);
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_true(snap.eps[0].not_up);
    tdm_router_snapshot_free(&snap);
    struct tdm_router_report rep = {.instance = 7};
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &rep, NULL, NULL), TDM_OK);
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_false(v.not_up); // heard from: its liveness judges it now
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

static int snapshot_match(struct tdm_router_endpoints *reg, const uint64_t *h, size_t n,
                          uint64_t id)
{
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, h, n, &snap), TDM_OK);
    int m = -1;
    for (size_t i = 0; i < snap.n; i++)
        if (snap.eps[i].id == id)
            m = snap.eps[i].prefix_match_blocks;
    assert_int_equal(snap.n_request_blocks, n);
    tdm_router_snapshot_free(&snap);
    return m;
}

// Reports: one lock records load, liveness, instance and KV events; a new
// instance is a restart (index cleared), a batch gap or a worker-side clear
// resyncs the index before the events apply.
static void test_on_report(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("policy: prefix_cache\nendpoints: {decode: ['10.0.0.1:8001']}\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_endpoint_view v;
    assert_true(find(reg, "10.0.0.1:8001", &v));
    struct tdm_router_liveness live = {7, 7, 7};
    assert_int_equal(tdm_router_endpoints_liveness(reg, v.id, &live), TDM_OK);
    assert_true(live.instance == 0 && live.heard_at == 0 && live.unanswered_since == 0); // never
    uint64_t h[4] = {101, 102, 103, 104};
    tdm_router_endpoints_record_prefix(reg, v.id, h, 2); // what the router routed there
    bool restarted = true, resynced = true;
    struct tdm_router_report r = {.instance = 0xA,
                                  .load = {.running = 1, .waiting = 2},
                                  .has_kv_events = true,
                                  .kv_batch = 5,
                                  .stored = &h[2],
                                  .n_stored = 1};
    double t0 = tdm_now();
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r, &restarted, &resynced), TDM_OK);
    assert_false(restarted);
    assert_false(resynced); // the first batch keeps what the router recorded itself
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 3);
    assert_int_equal(tdm_router_endpoints_liveness(reg, v.id, &live), TDM_OK);
    assert_true(live.instance == 0xA);
    assert_true(live.heard_at >= t0 && live.heard_at <= tdm_now());
    assert_true(find(reg, "10.0.0.1:8001", &v));
    assert_true(v.has_load && v.load.waiting == 2 && v.instance == 0xA);
    assert_true(v.heard_at == live.heard_at); // a view carries the same liveness
    // The next batch: applied on top.
    r.kv_batch = 6;
    r.stored = &h[3];
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r, &restarted, &resynced), TDM_OK);
    assert_false(restarted || resynced);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 4);
    // A gap (batch 8 after 6): the index is rebuilt from this batch alone.
    r.kv_batch = 8;
    r.stored = &h[0];
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r, &restarted, &resynced), TDM_OK);
    assert_false(restarted);
    assert_true(resynced);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 1);
    // The worker lost events itself.
    r.kv_batch = 9;
    r.kv_cleared = true;
    r.stored = NULL;
    r.n_stored = 0;
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r, &restarted, &resynced), TDM_OK);
    assert_true(resynced);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 0);
    // A new instance: a restart, whatever the batch says.
    tdm_router_endpoints_record_prefix(reg, v.id, h, 4);
    struct tdm_router_report r2 = {.instance = 0xB, .has_kv_events = true, .kv_batch = 1};
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r2, &restarted, &resynced), TDM_OK);
    assert_true(restarted);
    assert_false(resynced);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 0);
    assert_int_equal(tdm_router_endpoints_liveness(reg, v.id, &live), TDM_OK);
    assert_true(live.instance == 0xB);
    // Queries left unanswered: the second one's send time, until a report.
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 0);
    tdm_router_endpoints_note_query(reg, v.id, 50.0);
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 0); // asked once
    tdm_router_endpoints_note_query(reg, v.id, 50.2);
    tdm_router_endpoints_note_query(reg, v.id, 50.4);
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 50.2);
    assert_int_equal(tdm_router_endpoints_liveness(reg, v.id, &live), TDM_OK);
    assert_true(live.unanswered_since == 50.2 && live.instance == 0xB);
    assert_int_equal(tdm_router_endpoints_on_report(reg, v.id, &r2, NULL, NULL), TDM_OK);
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 0);
    tdm_router_endpoints_note_query(reg, v.id, 51.0);
    tdm_router_endpoints_note_query(reg, v.id, 51.2);
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 51.2);
    struct tdm_router_load ld = {.running = 1};
    assert_int_equal(tdm_router_endpoints_set_load(reg, v.id, &ld), TDM_OK);
    assert_true(tdm_router_endpoints_unanswered_since(reg, v.id) == 0);
    tdm_router_endpoints_note_query(reg, 999, 52.0); // unknown: nothing
    assert_true(tdm_router_endpoints_unanswered_since(reg, 999) == 0);
    // Unknown ids.
    assert_int_equal(tdm_router_endpoints_on_report(reg, 999, &r2, NULL, NULL), TDM_ENOTFOUND);
    assert_int_equal(tdm_router_endpoints_liveness(reg, 999, &live), TDM_ENOTFOUND);
    assert_true(live.instance == 0 && live.heard_at == 0 && live.unanswered_since == 0);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

static void test_prefix_index(void **state)
{
    (void)state;
    struct tdm_router_config *cfg =
        cfg_of("policy: prefix_cache\n"
               "prefix_index: {lru_capacity_per_server: 6, max_prefix_blocks_to_match: 5}\n"
               "endpoints: {decode: ['10.0.0.1:8001', '10.0.0.2:8001']}\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_endpoint_view a, b;
    assert_true(find(reg, "10.0.0.1:8001", &a));
    assert_true(find(reg, "10.0.0.2:8001", &b));
    int32_t tokens[16 * 8];
    for (int i = 0; i < 16 * 8; i++)
        tokens[i] = i;
    uint64_t h[8];
    assert_int_equal(tdm_router_block_hashes(tokens, 16 * 8, 16, 0, h, 8), 8);
    assert_int_equal(snapshot_match(reg, h, 4, a.id), 0);
    tdm_router_endpoints_record_prefix(reg, a.id, h, 4);
    assert_int_equal(snapshot_match(reg, h, 4, a.id), 4);
    assert_int_equal(snapshot_match(reg, h, 4, b.id), 0);
    assert_int_equal(snapshot_match(reg, h, 8, a.id), 4); // only the first 4 are there
    // A KV event evicts block 2: the match stops before it.
    assert_int_equal(tdm_router_endpoints_apply_kv_event(reg, a.id, NULL, 0, &h[2], 1), TDM_OK);
    assert_int_equal(snapshot_match(reg, h, 4, a.id), 2);
    // Stored events add blocks (exact index).
    assert_int_equal(tdm_router_endpoints_apply_kv_event(reg, b.id, h, 3, NULL, 0), TDM_OK);
    assert_int_equal(snapshot_match(reg, h, 4, b.id), 3);
    assert_int_equal(tdm_router_endpoints_apply_kv_event(reg, 999, h, 3, NULL, 0), TDM_ENOTFOUND);
    // Matching stops at max_prefix_blocks_to_match (5).
    tdm_router_endpoints_record_prefix(reg, b.id, h, 6);
    assert_int_equal(snapshot_match(reg, h, 8, b.id), 5);
    // Capacity 6: recording 8 blocks keeps the first 6 (deepest inserted first,
    // so the shared start is the most recent).
    tdm_router_endpoints_clear_prefix(reg, a.id);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 0);
    tdm_router_endpoints_record_prefix(reg, a.id, h, 8);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 6);
    assert_int_equal(snapshot_match(reg, h, 5, a.id), 5);
    // A different prompt pushes out the least recently routed blocks.
    uint64_t other[4] = {11, 12, 13, 14};
    tdm_router_endpoints_record_prefix(reg, a.id, other, 4);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 6);
    assert_int_equal(snapshot_match(reg, other, 4, a.id), 4);
    assert_int_equal(snapshot_match(reg, h, 5, a.id), 2);
    // Many blocks through a small index stay consistent (growth, eviction, rehash).
    struct tdm_router_config *big = cfg_of("policy: prefix_cache\n"
                                           "prefix_index: {lru_capacity_per_server: 1000}\n"
                                           "endpoints: {decode: ['10.0.0.1:8001']}\n");
    assert_int_equal(tdm_router_endpoints_apply_config(reg, big), TDM_OK);
    uint64_t many[700];
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 700; i++)
            many[i] = (uint64_t)(round * 700 + i + 1) * 0x9E3779B97F4A7C15ull;
        tdm_router_endpoints_record_prefix(reg, a.id, many, 700);
    }
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 1000);
    assert_int_equal(snapshot_match(reg, many, 5, a.id), 5); // the last round is there
    // Shrinking the capacity on reload evicts down to it.
    assert_int_equal(tdm_router_endpoints_apply_config(reg, cfg), TDM_OK);
    // (10.0.0.2 came back through cfg; a kept its id)
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 6);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(big);
    tdm_router_config_unref(cfg);
}

// ---- an attempt's two entries ------------------------------------------------------------------
// A pick that takes the first healthy endpoint of each role the snapshot
// lists (decode, then prefill when want_prefill), or fails with TDM_EBUSY.
struct first_pick {
    bool want_prefill;
    int calls;
    uint64_t watch;     // an endpoint whose health the pick notes
    bool watch_healthy; // as the pick saw it
};

static int pick_first(void *arg, struct tdm_router_snapshot *snap, struct tdm_router_held *held)
{
    struct first_pick *p = arg;
    p->calls++;
    for (size_t i = 0; i < snap->n; i++) {
        const struct tdm_router_endpoint_view *v = &snap->eps[i];
        if (v->id == p->watch)
            p->watch_healthy = v->healthy;
        if (!v->healthy)
            continue;
        if (held->decode == SIZE_MAX && v->role == TDM_ROUTER_ROLE_DECODE)
            held->decode = i;
        if (p->want_prefill && held->prefill == SIZE_MAX && v->role == TDM_ROUTER_ROLE_PREFILL)
            held->prefill = i;
    }
    return held->decode == SIZE_MAX ? TDM_EBUSY : TDM_OK;
}

static int inflight(struct tdm_router_endpoints *reg, uint64_t id)
{
    struct tdm_router_endpoint_view v;
    assert_int_equal(tdm_router_endpoints_get(reg, id, &v), TDM_OK);
    return v.inflight;
}

static uint64_t request_entries(struct tdm_router_endpoints *reg)
{
    struct tdm_router_lock_entries e;
    tdm_router_endpoints_lock_entries(reg, &e);
    return e.request;
}

// attempt_begin holds the picked decode and prefill endpoints, records the
// prompt's blocks on both and hands back the snapshot with their load and
// liveness; attempt_end reports and releases; one lock entry each. A replaced
// attempt (prev: a migration) is reported before the pick, so its failure is
// in the snapshot, and released after the new hold; when the pick fails it is
// reported, not released, nothing is held, and held says why.
static void test_attempt_entries(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: round_robin\n"
                                           "health: {failure_threshold: 1}\n"
                                           "endpoints:\n"
                                           "  decode: ['10.0.0.1:8001', '10.0.0.2:8001']\n"
                                           "  prefill: ['10.0.0.9:8101']\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_endpoint_view a, b, p;
    assert_true(find(reg, "10.0.0.1:8001", &a));
    assert_true(find(reg, "10.0.0.2:8001", &b));
    assert_true(find(reg, "10.0.0.9:8101", &p));
    struct tdm_router_report rep = {.instance = 0xA, .load = {.waiting = 3, .max_waiting = 8}};
    assert_int_equal(tdm_router_endpoints_on_report(reg, a.id, &rep, NULL, NULL), TDM_OK);
    uint64_t h[3] = {11, 12, 13};

    uint64_t e0 = request_entries(reg);
    struct first_pick fp = {.want_prefill = true};
    struct tdm_router_snapshot snap;
    struct tdm_router_held held;
    assert_int_equal(
        tdm_router_endpoints_attempt_begin(reg, h, 3, pick_first, &fp, NULL, &snap, &held), TDM_OK);
    assert_int_equal(request_entries(reg) - e0, 1);
    assert_int_equal(fp.calls, 1);
    assert_true(snap.eps[held.decode].id == a.id && snap.eps[held.prefill].id == p.id);
    // The views carry what the attempt reads: load for admission, liveness.
    const struct tdm_router_endpoint_view *dv = &snap.eps[held.decode];
    assert_true(dv->instance == 0xA && dv->heard_at > 0);
    assert_int_equal(dv->load.waiting, 3);
    assert_int_equal(dv->load.max_waiting, 8);
    assert_true(snap.eps[held.prefill].heard_at == 0); // never reported
    tdm_router_snapshot_free(&snap);
    assert_int_equal(inflight(reg, a.id), 1);
    assert_int_equal(inflight(reg, p.id), 1);
    assert_int_equal(inflight(reg, b.id), 0);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, a.id), 3);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, p.id), 3);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, b.id), 0);

    // A migration: A reported failed before the pick (threshold 1: unhealthy
    // in the snapshot, so B is picked), then released after B is held.
    struct tdm_router_give_back prev = {
        .report = a.id, .outcome = TDM_ROUTER_OUTCOME_ERROR, .release = {a.id, p.id}};
    struct first_pick fp2 = {.watch = a.id, .watch_healthy = true};
    e0 = request_entries(reg);
    assert_int_equal(
        tdm_router_endpoints_attempt_begin(reg, h, 1, pick_first, &fp2, &prev, &snap, &held),
        TDM_OK);
    assert_int_equal(request_entries(reg) - e0, 1);
    assert_false(fp2.watch_healthy);
    assert_true(snap.eps[held.decode].id == b.id);
    assert_true(held.prefill == SIZE_MAX);
    tdm_router_snapshot_free(&snap);
    assert_int_equal(inflight(reg, a.id), 0);
    assert_int_equal(inflight(reg, p.id), 0);
    assert_int_equal(inflight(reg, b.id), 1);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, b.id), 1);

    // Another migration finds nothing (B fails too): B reported, still held.
    prev = (struct tdm_router_give_back){
        .report = b.id, .outcome = TDM_ROUTER_OUTCOME_ERROR, .release = {b.id, 0}};
    e0 = request_entries(reg);
    assert_int_equal(
        tdm_router_endpoints_attempt_begin(reg, h, 3, pick_first, &fp2, &prev, &snap, &held),
        TDM_EBUSY);
    assert_int_equal(request_entries(reg) - e0, 1);
    tdm_router_snapshot_free(&snap);
    assert_true(held.decode == SIZE_MAX && held.prefill == SIZE_MAX);
    assert_int_equal(held.n_decode, 2);
    assert_int_equal(held.n_decode_healthy, 0);
    assert_int_equal(held.n_auth_failed, 0);
    assert_true(find(reg, "10.0.0.2:8001", &b));
    assert_false(b.healthy);
    assert_int_equal(b.inflight, 1);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, b.id), 1); // nothing recorded

    // The end: a report (passive success) and the release, one entry.
    tdm_router_endpoints_set_healthy(reg, b.id, true);
    struct tdm_router_give_back end = {
        .report = b.id, .outcome = TDM_ROUTER_OUTCOME_SUCCESS, .release = {b.id, 0}};
    e0 = request_entries(reg);
    tdm_router_endpoints_attempt_end(reg, &end);
    assert_int_equal(request_entries(reg) - e0, 1);
    assert_int_equal(inflight(reg, b.id), 0);
    // Liveness checks are counted apart.
    struct tdm_router_lock_entries l0, l1;
    tdm_router_endpoints_lock_entries(reg, &l0);
    struct tdm_router_liveness live;
    assert_int_equal(tdm_router_endpoints_liveness(reg, a.id, &live), TDM_OK);
    tdm_router_endpoints_lock_entries(reg, &l1);
    assert_true(l1.liveness == l0.liveness + 1 && l1.request == l0.request);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
}

// The router's policy (as control.c runs it) on the snapshot: the decode pick.
static int pick_policy(void *arg, struct tdm_router_snapshot *snap, struct tdm_router_held *held)
{
    const struct tdm_router_config *cfg = arg;
    struct tdm_router_request req = {.num_prompt_tokens = 8};
    struct tdm_router_pick pick = {0};
    int rc = tdm_router_policy_pick(cfg, snap, &req, &pick);
    held->decode = pick.decode;
    return rc;
}

// One attempt through the registry: the decode endpoint it holds.
static uint64_t route_one(struct tdm_router_endpoints *reg, struct tdm_router_config *cfg)
{
    struct tdm_router_snapshot snap;
    struct tdm_router_held held;
    assert_int_equal(
        tdm_router_endpoints_attempt_begin(reg, NULL, 0, pick_policy, cfg, NULL, &snap, &held),
        TDM_OK);
    uint64_t id = snap.eps[held.decode].id;
    tdm_router_snapshot_free(&snap);
    return id;
}

static int unreported(struct tdm_router_endpoints *reg, uint64_t id)
{
    struct tdm_router_endpoint_view v;
    assert_int_equal(tdm_router_endpoints_get(reg, id, &v), TDM_OK);
    return v.unreported;
}

// least_loaded between two load reports: every request held since a report
// counts in that endpoint's queue, so a burst spreads instead of herding onto
// the endpoint whose report was lowest; a report resets the count; a finished
// request leaves it; an endpoint that never reported is judged by its
// in-flight requests alone, so it takes requests at once.
static void test_unreported_requests_spread_a_burst(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: least_loaded\n"
                                           "endpoints:\n"
                                           "  decode: ['10.0.0.1:8001', '10.0.0.2:8001']\n");
    struct tdm_router_endpoints *reg = reg_of(cfg);
    tdm_router_endpoints_set_seed(reg, 7);
    struct tdm_router_endpoint_view a, b;
    assert_true(find(reg, "10.0.0.1:8001", &a));
    assert_true(find(reg, "10.0.0.2:8001", &b));
    assert_int_equal(a.unreported, 0);
    assert_int_equal(tdm_router_endpoints_set_load(reg, a.id, &(struct tdm_router_load){0}),
                     TDM_OK);
    assert_int_equal(
        tdm_router_endpoints_set_load(reg, b.id, &(struct tdm_router_load){.waiting = 2}), TDM_OK);
    // 8 requests before the next reports: a takes two (0, 1 < 2), then they
    // alternate (ties at random), ending level: a 0 + 5, b 2 + 3.
    uint64_t got[8];
    int on_a = 0;
    for (int i = 0; i < 8; i++) {
        got[i] = route_one(reg, cfg);
        on_a += got[i] == a.id;
    }
    assert_true(got[0] == a.id && got[1] == a.id);
    assert_int_equal(on_a, 5);
    assert_int_equal(unreported(reg, a.id), 5);
    assert_int_equal(unreported(reg, b.id), 3);
    // A finished request is in no queue: the count stays within the in-flight ones.
    for (int i = 0; i < 3; i++)
        tdm_router_endpoints_release(reg, a.id);
    assert_int_equal(inflight(reg, a.id), 2);
    assert_int_equal(unreported(reg, a.id), 2);
    // a's report shows its 2 requests (waiting 2): nothing unreported there;
    // b still has 2 + 3, so a takes the next one.
    struct tdm_router_report rep = {.instance = 1, .load = {.waiting = 2}};
    assert_int_equal(tdm_router_endpoints_on_report(reg, a.id, &rep, NULL, NULL), TDM_OK);
    assert_int_equal(unreported(reg, a.id), 0);
    assert_int_equal(inflight(reg, a.id), 2);
    assert_int_equal(unreported(reg, b.id), 3);
    assert_true(route_one(reg, cfg) == a.id);
    assert_int_equal(unreported(reg, a.id), 1);
    // b reports its queue drained: the next ones go there until the sums meet.
    assert_int_equal(tdm_router_endpoints_set_load(reg, b.id, &(struct tdm_router_load){0}),
                     TDM_OK);
    assert_int_equal(unreported(reg, b.id), 0);
    assert_true(route_one(reg, cfg) == b.id); // 0 < 2 + 1
    assert_true(route_one(reg, cfg) == b.id); // 1 < 3
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);

    // An endpoint that has not reported yet, beside one with requests in
    // flight since its report: it takes the next request, every time.
    cfg = cfg_of("policy: least_loaded\nload_stale_seconds: 30\n"
                 "endpoints:\n"
                 "  decode: ['10.0.0.1:8001', '10.0.0.2:8001']\n");
    for (uint64_t seed = 1; seed <= 16; seed++) {
        reg = reg_of(cfg);
        tdm_router_endpoints_set_seed(reg, seed);
        assert_true(find(reg, "10.0.0.1:8001", &a));
        assert_true(find(reg, "10.0.0.2:8001", &b));
        assert_int_equal(tdm_router_endpoints_set_load(reg, a.id, &(struct tdm_router_load){0}),
                         TDM_OK);
        assert_int_equal(tdm_router_endpoints_acquire(reg, a.id), TDM_OK);
        assert_true(find(reg, "10.0.0.2:8001", &b));
        assert_false(b.has_load);
        assert_true(b.load_stale); // never reported: stale, as before
        assert_true(route_one(reg, cfg) == b.id);
        // Without a report its queue is the router's in-flight count: 1 each, a
        // tie, then the other one (2 against 1).
        assert_int_equal(unreported(reg, b.id), 1);
        uint64_t x = route_one(reg, cfg), y = route_one(reg, cfg);
        assert_true(x != y);
        tdm_router_endpoints_free(reg);
    }
    tdm_router_config_unref(cfg);
}

static void test_passive_health(void **state)
{
    (void)state;
    struct tdm_router_config *cfg = cfg_of("policy: round_robin\n"
                                           "health: {failure_threshold: 2}\n"
                                           "endpoints: {decode: ['10.0.0.1:8001']}\n");
    struct tdm_metrics_registry *mreg = NULL;
    struct tdm_router_metrics m;
    char err[256];
    assert_int_equal(tdm_metrics_registry_new(&mreg, NULL, 0, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_router_metrics_register(&m, mreg, err, sizeof err), TDM_OK);
    struct tdm_router_endpoints *reg = NULL;
    assert_int_equal(tdm_router_endpoints_new(&reg, cfg, &m, err, sizeof err), TDM_OK);
    struct tdm_router_endpoint_view v;
    assert_true(find(reg, "10.0.0.1:8001", &v));
    struct tdm_metrics_gauge *hg = tdm_metrics_gauge_labels(m.endpoint_healthy, v.name, "decode");
    assert_true(tdm_metrics_gauge_value(hg) == 1.0);
    assert_true(tdm_metrics_gauge_value(m.ready_decode) == 1.0);
    tdm_router_endpoints_report(reg, v.id, TDM_ROUTER_OUTCOME_ERROR);
    tdm_router_endpoints_report(reg, v.id, TDM_ROUTER_OUTCOME_SUCCESS); // resets the count
    tdm_router_endpoints_report(reg, v.id, TDM_ROUTER_OUTCOME_TIMEOUT);
    assert_true(find(reg, v.name, &v));
    assert_true(v.healthy);
    tdm_router_endpoints_report(reg, v.id, TDM_ROUTER_OUTCOME_ERROR);
    assert_true(find(reg, v.name, &v));
    assert_false(v.healthy);
    // Never answered an active check and just added: starting (its failures
    // are not logged as one), though it is out of routing all the same.
    assert_true(v.starting);
    assert_true(tdm_metrics_gauge_value(hg) == 0.0);
    assert_true(tdm_metrics_gauge_value(m.ready_decode) == 0.0);
    // A passive success does not revive it; only an active check (or the test hook) does.
    tdm_router_endpoints_report(reg, v.id, TDM_ROUTER_OUTCOME_SUCCESS);
    assert_true(find(reg, v.name, &v));
    assert_false(v.healthy);
    uint64_t epoch = v.health_epoch;
    tdm_router_endpoints_set_healthy(reg, v.id, true);
    assert_true(find(reg, v.name, &v));
    assert_true(v.healthy);
    assert_true(v.health_epoch == epoch + 1);
    assert_true(tdm_metrics_gauge_value(m.ready_decode) == 1.0);
    tdm_router_endpoints_report(reg, 12345, TDM_ROUTER_OUTCOME_ERROR); // unknown id: ignored
    tdm_router_endpoints_free(reg);
    tdm_metrics_registry_free(mreg);
    tdm_router_config_unref(cfg);
}

// ---- active health checks against a real HTTP server
// ----------------------------------------------

static atomic_int health_status = 200;
static atomic_int health_hits = 0;

static void health_handler(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    atomic_fetch_add(&health_hits, 1);
    int st = atomic_load(&health_status);
    tdm_http_respond(c, st, "text/plain", st == 200 ? "" : "draining", st == 200 ? 0 : 8);
}

static void test_active_health_checks(void **state)
{
    (void)state;
    char err[256];
    struct tdm_http_config hc = {.host = "127.0.0.1", .port = 0, .num_threads = 4};
    struct tdm_http_server *srv = NULL;
    assert_int_equal(tdm_http_server_new(&srv, &hc, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(srv, "GET", "/health", health_handler, NULL), TDM_OK);
    assert_int_equal(tdm_http_server_start(srv, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(srv);

    // A second endpoint on a port nobody listens on: refused -> fails.
    char text[512];
    snprintf(text, sizeof text,
             "policy: round_robin\n"
             "health: {interval_seconds: 0.1, timeout_seconds: 0.1, failure_threshold: 2,"
             " success_threshold: 2}\n"
             "endpoints: {decode: ['127.0.0.1:%d', '127.0.0.1:1']}\n",
             port);
    struct tdm_router_config *cfg = cfg_of(text);
    struct tdm_router_endpoints *reg = reg_of(cfg);
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", port);
    struct tdm_router_endpoint_view v, dead;
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_true(v.healthy);
    assert_false(v.starting); // answered: its state is known
    assert_true(atomic_load(&health_hits) >= 1);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, "127.0.0.1:1", &dead));
    assert_false(dead.healthy); // two refused connects
    assert_true(dead.starting); // but never answered yet: starting, not reported as failed

    // 503: unhealthy after failure_threshold checks.
    atomic_store(&health_status, 503);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_true(v.healthy);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_false(v.healthy);
    assert_false(v.starting); // it answered before: this is a failure
    uint64_t epoch = v.health_epoch;
    // The prefix index of a worker that went away is cleared when it returns.
    uint64_t hh[2] = {1, 2};
    tdm_router_endpoints_record_prefix(reg, v.id, hh, 2);
    // 200 again: healthy after success_threshold (2) checks, new epoch.
    atomic_store(&health_status, 200);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_false(v.healthy);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_true(v.healthy);
    assert_true(v.health_epoch == epoch + 1);
    assert_int_equal(tdm_router_endpoints_prefix_size(reg, v.id), 0);

    // An endpoint added later (a reload) joins at its first good check, while
    // a failed one needs success_threshold (2) checks.
    struct tdm_http_server *srv2 = NULL;
    assert_int_equal(tdm_http_server_new(&srv2, &hc, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(srv2, "GET", "/health", health_handler, NULL), TDM_OK);
    assert_int_equal(tdm_http_server_start(srv2, err, sizeof err), TDM_OK);
    snprintf(text, sizeof text,
             "policy: round_robin\n"
             "health: {interval_seconds: 0.1, timeout_seconds: 0.1, failure_threshold: 2,"
             " success_threshold: 2}\n"
             "endpoints: {decode: ['127.0.0.1:%d', '127.0.0.1:1', '127.0.0.1:%d']}\n",
             port, tdm_http_server_port(srv2));
    struct tdm_router_config *cfg2 = cfg_of(text);
    assert_int_equal(tdm_router_endpoints_apply_config(reg, cfg2), TDM_OK);
    char name2[64];
    snprintf(name2, sizeof name2, "127.0.0.1:%d", tdm_http_server_port(srv2));
    struct tdm_router_endpoint_view v2;
    assert_true(find(reg, name2, &v2));
    assert_false(v2.healthy);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name2, &v2));
    assert_true(v2.healthy);
    tdm_http_server_free(srv2);
    tdm_router_config_unref(cfg2);

    // The background thread flips it within a few intervals.
    assert_int_equal(tdm_router_endpoints_start(reg), TDM_OK);
    atomic_store(&health_status, 503);
    bool flipped = false;
    for (int i = 0; i < 100 && !flipped; i++) {
        sleep_ms(20);
        flipped = find(reg, name, &v) && !v.healthy;
    }
    assert_true(flipped);
    atomic_store(&health_status, 200);
    flipped = false;
    for (int i = 0; i < 100 && !flipped; i++) {
        sleep_ms(20);
        flipped = find(reg, name, &v) && v.healthy;
    }
    assert_true(flipped);

    // A server that stops answering: timeout counts as a failure.
    tdm_router_endpoints_stop(reg);
    tdm_http_server_stop(srv);
    tdm_router_endpoints_check_health(reg);
    tdm_router_endpoints_check_health(reg);
    assert_true(find(reg, name, &v));
    assert_false(v.healthy);
    tdm_router_endpoints_free(reg);
    tdm_http_server_free(srv);
    tdm_router_config_unref(cfg);
}

// An endpoint whose nng inbox refuses the router's handshake (issue 28, item
// 1: a worker started by hand with another TANDEM_INTERNAL_SECRET) is not
// healthy, with reason "auth", though its HTTP checks pass; the reason shows
// in the view and the metrics, the count names it; once the handshake
// passes, its next good check brings it back.
static void test_auth_failure_unhealthy(void **state)
{
    (void)state;
    char err[256];
    struct tdm_http_config hc = {.host = "127.0.0.1", .port = 0, .num_threads = 2};
    struct tdm_http_server *srv = NULL;
    assert_int_equal(tdm_http_server_new(&srv, &hc, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(srv, "GET", "/health", health_handler, NULL), TDM_OK);
    assert_int_equal(tdm_http_server_start(srv, err, sizeof err), TDM_OK);
    atomic_store(&health_status, 200);
    char text[512];
    snprintf(text, sizeof text,
             "policy: round_robin\n"
             "health: {interval_seconds: 0.5, timeout_seconds: 0.5, failure_threshold: 2,"
             " success_threshold: 2}\n"
             "endpoints: {decode: ['127.0.0.1:%d']}\n",
             tdm_http_server_port(srv));
    struct tdm_router_config *cfg = cfg_of(text);
    struct tdm_metrics_registry *mreg = NULL;
    struct tdm_router_metrics m;
    assert_int_equal(tdm_metrics_registry_new(&mreg, NULL, 0, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_router_metrics_register(&m, mreg, err, sizeof err), TDM_OK);
    struct tdm_router_endpoints *reg = NULL;
    assert_int_equal(tdm_router_endpoints_new(&reg, cfg, &m, err, sizeof err), TDM_OK);
    struct tdm_router_endpoint_view v;
    tdm_router_endpoints_check_health(reg);
    assert_int_equal(tdm_router_endpoints_list(reg, &v, 1), 1);
    assert_true(v.healthy);
    assert_null(v.unhealthy_reason);
    struct tdm_metrics_gauge *auth =
        tdm_metrics_gauge_labels(m.endpoint_unhealthy, v.name, "decode", "auth");
    struct tdm_metrics_gauge *hg = tdm_metrics_gauge_labels(m.endpoint_healthy, v.name, "decode");

    tdm_router_endpoints_set_auth(reg, v.id, true, "the peer refused the proof");
    assert_int_equal(tdm_router_endpoints_list(reg, &v, 1), 1);
    assert_false(v.healthy);
    assert_string_equal(v.unhealthy_reason, "auth");
    assert_true(tdm_metrics_gauge_value(auth) == 1.0);
    assert_true(tdm_metrics_gauge_value(hg) == 0.0);
    assert_true(tdm_metrics_gauge_value(m.ready_decode) == 0.0);
    assert_int_equal(tdm_router_endpoints_count_auth_failed(reg), 1);
    // Its HTTP checks pass, and still it stays out.
    for (int i = 0; i < 3; i++)
        tdm_router_endpoints_check_health(reg);
    assert_int_equal(tdm_router_endpoints_list(reg, &v, 1), 1);
    assert_false(v.healthy);
    assert_string_equal(v.unhealthy_reason, "auth");
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_int_equal(snap.n, 1);
    assert_false(snap.eps[0].healthy); // the policies never pick it
    tdm_router_snapshot_free(&snap);

    // The handshake passes again: back at its next good check.
    tdm_router_endpoints_set_auth(reg, v.id, false, NULL);
    assert_int_equal(tdm_router_endpoints_count_auth_failed(reg), 0);
    tdm_router_endpoints_check_health(reg);
    assert_int_equal(tdm_router_endpoints_list(reg, &v, 1), 1);
    assert_true(v.healthy);
    assert_null(v.unhealthy_reason);
    assert_true(tdm_metrics_gauge_value(auth) == 0.0);
    assert_true(tdm_metrics_gauge_value(hg) == 1.0);
    // A failing check now is the other reason.
    atomic_store(&health_status, 503);
    tdm_router_endpoints_check_health(reg);
    tdm_router_endpoints_check_health(reg);
    assert_int_equal(tdm_router_endpoints_list(reg, &v, 1), 1);
    assert_string_equal(v.unhealthy_reason, "health_check");
    assert_true(tdm_metrics_gauge_value(tdm_metrics_gauge_labels(m.endpoint_unhealthy, v.name,
                                                                 "decode", "health_check")) == 1.0);
    assert_true(tdm_metrics_gauge_value(auth) == 0.0);
    atomic_store(&health_status, 200);
    tdm_router_endpoints_free(reg);
    tdm_metrics_registry_free(mreg);
    tdm_http_server_free(srv);
    tdm_router_config_unref(cfg);
}

// A bound, listening socket on loopback whose backlog accepts the connect;
// nobody reads. Returns the fd, its port in *port.
static int silent_listener(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
    assert_int_equal(listen(fd, 8), 0);
    socklen_t sl = sizeof sa;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
    *port = ntohs(sa.sin_port);
    return fd;
}

// A listener that accepts and never answers: the check must give up at the timeout.
static void test_health_timeout(void **state)
{
    (void)state;
    int port;
    int fd = silent_listener(&port);
    char text[512];
    snprintf(text, sizeof text,
             "policy: round_robin\n"
             "health: {interval_seconds: 1, timeout_seconds: 0.2, failure_threshold: 1}\n"
             "endpoints: {decode: ['127.0.0.1:%d']}\n",
             port);
    struct tdm_router_config *cfg = cfg_of(text);
    struct tdm_router_endpoints *reg = reg_of(cfg);
    double t0 = tdm_now();
    tdm_router_endpoints_check_health(reg);
    double dt = tdm_now() - t0;
    assert_true(dt >= 0.15 && dt < 1.0);
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_false(snap.eps[0].healthy);
    tdm_router_snapshot_free(&snap);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
    close(fd);
}

// Busy is not dead (issue 11, part 3): the same silent listener, but the
// endpoint's nng load reports keep arriving; its timed-out checks mark it busy
// and never unhealthy. Once the reports go stale, a timeout counts again.
static void test_health_timeout_busy(void **state)
{
    (void)state;
    int port;
    int fd = silent_listener(&port);
    char text[512];
    snprintf(text, sizeof text,
             "policy: round_robin\n"
             "health: {interval_seconds: 1, timeout_seconds: 0.1, failure_threshold: 1}\n"
             "load_stale_seconds: 2\n"
             "endpoints: {decode: ['127.0.0.1:%d']}\n",
             port);
    // The reports' staleness bound (2 s) leaves each round's 0.1 s check
    // room on a loaded machine (0.5 s failed at a load average of 34).
    struct tdm_router_config *cfg = cfg_of(text);
    struct tdm_router_endpoints *reg = reg_of(cfg);
    struct tdm_router_snapshot snap;
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    uint64_t id = snap.eps[0].id;
    tdm_router_snapshot_free(&snap);
    struct tdm_router_report r = {.instance = 0xB, .load = {.running = 64, .waiting = 900}};
    for (int round = 0; round < 3; round++) {
        assert_int_equal(tdm_router_endpoints_on_report(reg, id, &r, NULL, NULL), TDM_OK);
        tdm_router_endpoints_check_health(reg);
        assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
        assert_true(snap.eps[0].healthy);
        assert_true(snap.eps[0].busy);
        tdm_router_snapshot_free(&snap);
    }
    sleep_ms(2100); // the reports stop: silence is death again
    tdm_router_endpoints_check_health(reg);
    assert_int_equal(tdm_router_endpoints_snapshot(reg, NULL, 0, &snap), TDM_OK);
    assert_false(snap.eps[0].healthy);
    assert_false(snap.eps[0].busy);
    tdm_router_snapshot_free(&snap);
    tdm_router_endpoints_free(reg);
    tdm_router_config_unref(cfg);
    close(fd);
}

// getaddrinfo resolver on a literal and on a name that cannot exist.
static void test_default_resolver(void **state)
{
    (void)state;
    char addrs[4][TDM_ROUTER_NAME_MAX];
    assert_int_equal(tdm_router_resolve_getaddrinfo("127.0.0.1", addrs, 4, NULL), 1);
    assert_string_equal(addrs[0], "127.0.0.1");
    assert_int_equal(tdm_router_resolve_getaddrinfo("no-such-host.invalid", addrs, 4, NULL), -1);
}

int main(void)
{
    tdm_log_level = TDM_LOG_LEVEL_ERR;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_block_hashes_match_kv_cache),
        cmocka_unit_test(test_dns_discovery),
        cmocka_unit_test(test_dns_background_thread),
        cmocka_unit_test(test_apply_config),
        cmocka_unit_test(test_load_staleness),
        cmocka_unit_test(test_not_up),
        cmocka_unit_test(test_prefix_index),
        cmocka_unit_test(test_on_report),
        cmocka_unit_test(test_health_timeout_busy),
        cmocka_unit_test(test_attempt_entries),
        cmocka_unit_test(test_unreported_requests_spread_a_burst),
        cmocka_unit_test(test_passive_health),
        cmocka_unit_test(test_active_health_checks),
        cmocka_unit_test(test_auth_failure_unhealthy),
        cmocka_unit_test(test_health_timeout),
        cmocka_unit_test(test_default_resolver),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
