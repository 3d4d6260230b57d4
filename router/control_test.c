// SPDX-License-Identifier: Apache-2.0
// Tests of the control plane as the request path uses it: routes (decision,
// held endpoints, prefix recording), the request.prefill_retries cap on the
// prefill targets and the attempt budget sent with them, the local-prefill
// fallback count, passive reports, the router metrics they move (rendered
// through the registry), no-endpoint errors, workers not up left out, a
// reload under a held route, the GET /v1/router/config body, and the registry
// entries a route, its end and a migration's reroute take (one each).
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "control.h"
#include "core.h"

struct env {
    char dir[256];
    char path[512];
    struct tdm_metrics_registry *mreg;
    struct tdm_router_control *ctl;
};

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

static void env_open(struct env *e, const char *text)
{
    memset(e, 0, sizeof *e);
    snprintf(e->dir, sizeof e->dir, "%s/router-ctl-XXXXXX", TANDEM_BINARY_DIR);
    assert_non_null(mkdtemp(e->dir));
    snprintf(e->path, sizeof e->path, "%s/router.yaml", e->dir);
    write_file(e->path, text);
    char err[512];
    assert_int_equal(tdm_metrics_registry_new(&e->mreg, NULL, 0, err, sizeof err), TDM_OK);
    int rc = tdm_router_control_new(&e->ctl, e->path, e->mreg, err, sizeof err);
    if (rc)
        fail_msg("control_new: %s", err);
}

static void env_close(struct env *e)
{
    tdm_router_control_free(e->ctl);
    tdm_metrics_registry_free(e->mreg);
    unlink(e->path);
    rmdir(e->dir);
}

static int inflight_of(struct env *e, uint64_t id)
{
    struct tdm_router_endpoint_view v;
    assert_int_equal(tdm_router_endpoints_get(tdm_router_control_endpoints(e->ctl), id, &v),
                     TDM_OK);
    return v.inflight;
}

static char *render(struct env *e)
{
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(e->mreg, &out, &len), TDM_OK);
    return out;
}

static void expect_line(const char *text, const char *line)
{
    if (!strstr(text, line))
        fail_msg("metrics lack '%s'", line);
}

// tandem:router_ready_endpoints{role} is n.
static void expect_ready(struct env *e, const char *role, int n)
{
    char line[128];
    snprintf(line, sizeof line, "tandem:router_ready_endpoints{role=\"%s\"} %d", role, n);
    char *m = render(e);
    expect_line(m, line);
    free(m);
}

static const char *pd_cfg = "policy: prefix_cache\n"
                            "pd_threshold_tokens: 32\n"
                            "request: {prefill_retries: 1, deadline_seconds: 30}\n"
                            "endpoints:\n"
                            "  prefill: ['10.0.0.1:8101', '10.0.0.2:8101', '10.0.0.3:8101']\n"
                            "  decode: ['10.0.1.1:8001', '10.0.1.2:8001']\n";

static void test_route_decode_only_and_prefix(void **state)
{
    (void)state;
    struct env e;
    env_open(&e, pd_cfg);
    int32_t tokens[64];
    for (int i = 0; i < 64; i++)
        tokens[i] = 1000 + i;
    char err[256];
    struct tdm_router_route r;
    // 20 tokens <= 32: decode-only.
    assert_int_equal(tdm_router_control_route(e.ctl, tokens, 20, NULL, &r, err, sizeof err), 0);
    assert_int_equal(r.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    assert_int_equal(r.n_prefill, 0);
    assert_int_equal(r.max_prefill_attempts, 0);
    assert_int_equal(r.decode.role, TDM_ROUTER_ROLE_DECODE);
    assert_int_equal(r.decode.nng_port, 9001);
    assert_int_equal(inflight_of(&e, r.decode.id), 1);
    assert_true(r.deadline > r.routed_at + 29.0);
    assert_non_null(r.cfg);
    uint64_t did = r.decode.id, first_decode = did;
    tdm_router_control_route_sent(e.ctl, &r);
    tdm_router_control_route_done(e.ctl, &r, "success");
    assert_int_equal(inflight_of(&e, did), 0);
    assert_null(r.cfg);
    tdm_router_control_route_done(e.ctl, &r, "success"); // harmless twice

    // 64 tokens, cold: prefill-decode. The blocks are recorded on both.
    assert_int_equal(tdm_router_control_route(e.ctl, tokens, 64, NULL, &r, err, sizeof err), 0);
    assert_int_equal(r.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
    // 3 prefill endpoints ranked, prefill_retries 1: the decode worker gets 2.
    assert_int_equal(r.n_prefill, 2);
    assert_int_equal(r.prefill_idx, 0);
    assert_int_equal(r.max_prefill_attempts, 2); // sent as GenerateRequest.max_prefill_attempts
    assert_int_equal(r.prefill[r.prefill_idx].role, TDM_ROUTER_ROLE_PREFILL);
    assert_int_equal(inflight_of(&e, r.prefill[0].id), 1);
    assert_int_equal(inflight_of(&e, r.prefill[1].id), 0); // only the one in use is held
    did = r.decode.id;
    uint64_t pid = r.prefill[0].id;
    tdm_router_control_route_sent(e.ctl, &r);
    tdm_router_control_route_done(e.ctl, &r, "success");
    assert_int_equal(inflight_of(&e, pid), 0);
    // The same prompt again: the decode endpoint that has it wins and 48 of 64
    // tokens are cached there (one token always left to compute... 4 blocks of
    // 16 = 64 -> 63 cached), so 1 uncached token <= 32: local prefill.
    assert_int_equal(tdm_router_control_route(e.ctl, tokens, 64, NULL, &r, err, sizeof err), 0);
    assert_true(r.decode.id == did);
    assert_int_equal(r.cached_tokens, 63);
    assert_int_equal(r.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    // This one could not be sent there (issue 28, item 1): a fallback, not a pick.
    tdm_router_control_route_unsent(e.ctl, &r);
    tdm_router_control_route_done(e.ctl, &r, "success");

    char *m = render(&e);
    expect_line(m, "tandem:router_pd_decision_total{decision_type=\"decode-only\"} 2");
    expect_line(m, "tandem:router_pd_decision_total{decision_type=\"prefill-decode\"} 1");
    expect_line(m, "tandem:router_requests_total{status=\"success\"} 3");
    expect_line(m, "tandem:router_ready_endpoints{role=\"decode\"} 2");
    expect_line(m, "tandem:router_ready_endpoints{role=\"prefill\"} 3");
    expect_line(m, "tandem:router_inflight_requests 0");
    expect_line(m, "tandem:router_scheduling_seconds_count 3");
    char line[256];
    struct tdm_router_endpoint_view v;
    assert_int_equal(tdm_router_endpoints_get(tdm_router_control_endpoints(e.ctl), did, &v), 0);
    snprintf(line, sizeof line,
             "tandem:router_endpoint_picks_total{endpoint=\"%s\",role=\"decode\"} %d", v.name,
             first_decode == did ? 2 : 1);
    expect_line(m, line);
    snprintf(line, sizeof line,
             "tandem:router_endpoint_fallbacks_total{endpoint=\"%s\",role=\"decode\"} 1", v.name);
    expect_line(m, line);
    assert_int_equal(tdm_router_endpoints_get(tdm_router_control_endpoints(e.ctl), pid, &v), 0);
    snprintf(line, sizeof line,
             "tandem:router_endpoint_picks_total{endpoint=\"%s\",role=\"prefill\"} 1", v.name);
    expect_line(m, line);
    free(m);
    env_close(&e);
}

// request.prefill_retries caps the prefill endpoints a route hands the decode
// worker and sets its attempt budget, 1 + prefill_retries (it tries them in
// order, then prefills locally); a local prefill of a
// P/D route counts as a fallback.
static void test_prefill_retries_cap_and_fallback(void **state)
{
    (void)state;
    int32_t tokens[100];
    char err[256];
    for (int retries = 0; retries <= 3; retries++) {
        char text[512];
        snprintf(text, sizeof text,
                 "policy: least_loaded\npd_mode: always\nrequest: {prefill_retries: %d}\n"
                 "endpoints:\n"
                 "  prefill: ['10.0.0.1:8101', '10.0.0.2:8101', '10.0.0.3:8101']\n"
                 "  decode: ['10.0.1.1:8001']\n",
                 retries);
        struct env e;
        env_open(&e, text);
        for (int i = 0; i < 100; i++)
            tokens[i] = 7 * i + retries;
        struct tdm_router_route r;
        assert_int_equal(tdm_router_control_route(e.ctl, tokens, 100, NULL, &r, err, sizeof err),
                         0);
        assert_int_equal(r.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
        size_t want = retries + 1 < 3 ? (size_t)retries + 1 : 3; // 3 prefill endpoints exist
        assert_int_equal(r.n_prefill - r.prefill_idx, want);
        // The decode worker's attempt budget (GenerateRequest.max_prefill_attempts).
        assert_int_equal(r.max_prefill_attempts, retries + 1);
        for (size_t i = r.prefill_idx; i < r.n_prefill; i++)
            for (size_t j = r.prefill_idx; j < i; j++)
                assert_true(r.prefill[i].id != r.prefill[j].id);
        // Only the first is held.
        assert_int_equal(inflight_of(&e, r.prefill[r.prefill_idx].id), 1);
        if (r.n_prefill - r.prefill_idx > 1)
            assert_int_equal(inflight_of(&e, r.prefill[r.prefill_idx + 1].id), 0);
        // Remote prefill happened: no fallback. Then a local one: one fallback.
        tdm_router_control_prefill_outcome(e.ctl, &r, true);
        char *m = render(&e);
        expect_line(m, "tandem:router_prefill_fallback_total 0");
        free(m);
        tdm_router_control_prefill_outcome(e.ctl, &r, false);
        m = render(&e);
        expect_line(m, "tandem:router_prefill_fallback_total 1");
        free(m);
        tdm_router_control_route_done(e.ctl, &r, "success");
        env_close(&e);
    }
    // A decode-only route never counts a fallback.
    struct env e;
    env_open(&e, pd_cfg);
    struct tdm_router_route r;
    assert_int_equal(tdm_router_control_route(e.ctl, tokens, 10, NULL, &r, err, sizeof err), 0);
    assert_int_equal(r.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    tdm_router_control_prefill_outcome(e.ctl, &r, false);
    char *m = render(&e);
    expect_line(m, "tandem:router_prefill_fallback_total 0");
    free(m);
    tdm_router_control_route_done(e.ctl, &r, "success");
    env_close(&e);
}

// Opens e on a config of two decode endpoints, 10.0.1.1 (a) and 10.0.1.2 (b),
// round robin, with `extra` config lines before them ("" for none); returns
// the registry.
static struct tdm_router_endpoints *two_decodes(struct env *e, const char *extra,
                                                struct tdm_router_endpoint_view *a,
                                                struct tdm_router_endpoint_view *b)
{
    char text[512];
    snprintf(text, sizeof text,
             "policy: round_robin\n%sendpoints: {decode: ['10.0.1.1:8001', '10.0.1.2:8001']}\n",
             extra);
    env_open(e, text);
    struct tdm_router_endpoints *eps = tdm_router_control_endpoints(e->ctl);
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.1:8001", a), TDM_OK);
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.2:8001", b), TDM_OK);
    return eps;
}

// A retry's route avoids the decode endpoints that failed the request, unless
// no other healthy one is left.
static void test_route_avoiding(void **state)
{
    (void)state;
    struct env e;
    struct tdm_router_endpoint_view a, b;
    struct tdm_router_endpoints *eps = two_decodes(&e, "", &a, &b);
    int32_t t[4] = {1, 2, 3, 4};
    char err[256];
    struct tdm_router_route r;
    for (int i = 0; i < 4; i++) { // round robin alone would alternate
        assert_int_equal(tdm_router_control_route_avoiding(
                             e.ctl, t, &(struct tdm_router_request){.num_prompt_tokens = 4}, &a.id,
                             1, &r, err, sizeof err),
                         TDM_OK);
        assert_true(r.decode.id == b.id);
        tdm_router_control_route_done(e.ctl, &r, "success");
    }
    uint64_t both[2] = {a.id, b.id};
    assert_int_equal(tdm_router_control_route_avoiding(
                         e.ctl, t, &(struct tdm_router_request){.num_prompt_tokens = 4}, both, 2,
                         &r, err, sizeof err),
                     TDM_OK);
    tdm_router_control_route_done(e.ctl, &r, "success");
    // Avoidance never makes an unhealthy endpoint pickable.
    tdm_router_endpoints_set_healthy(eps, b.id, false);
    assert_int_equal(tdm_router_control_route_avoiding(
                         e.ctl, t, &(struct tdm_router_request){.num_prompt_tokens = 4}, &a.id, 1,
                         &r, err, sizeof err),
                     TDM_OK);
    assert_true(r.decode.id == a.id);
    tdm_router_control_route_done(e.ctl, &r, "success");
    env_close(&e);
}

static uint64_t request_entries(struct env *e)
{
    struct tdm_router_lock_entries n;
    tdm_router_endpoints_lock_entries(tdm_router_control_endpoints(e->ctl), &n);
    return n.request;
}

// A route takes the registry's lock once (pick, hold, record; the targets
// carry load and liveness), its end once (report, release). A reroute (a
// migration) is one entry too: the lost endpoint reported failed before the
// pick, the new one held, the old released and done; when nothing is left,
// the old route stays held (reported) until its own end.
static void test_entries_and_reroute(void **state)
{
    (void)state;
    struct env e;
    struct tdm_router_endpoint_view a, b;
    struct tdm_router_endpoints *eps = two_decodes(&e, "health: {failure_threshold: 1}\n", &a, &b);
    struct tdm_router_report rep = {.instance = 0xA, .load = {.waiting = 2, .max_waiting = 4}};
    assert_int_equal(tdm_router_endpoints_on_report(eps, a.id, &rep, NULL, NULL), TDM_OK);
    int32_t t[32] = {0};
    char err[256];
    struct tdm_router_route r, nr;
    uint64_t e0 = request_entries(&e);
    assert_int_equal(tdm_router_control_route(e.ctl, t, 32, NULL, &r, err, sizeof err), TDM_OK);
    assert_int_equal(request_entries(&e) - e0, 1);
    assert_true(r.decode.id == a.id); // round robin's first pick
    assert_true(r.decode.instance == 0xA && r.decode.heard_at > 0);
    assert_int_equal(r.decode.load.max_waiting, 4);
    assert_int_equal(inflight_of(&e, a.id), 1);

    // Migration: A is reported (threshold 1: out of the pick), B held, A done.
    e0 = request_entries(&e);
    assert_int_equal(tdm_router_control_reroute(
                         e.ctl, &r, t, &(struct tdm_router_request){.num_prompt_tokens = 32}, &a.id,
                         1, &nr, err, sizeof err),
                     TDM_OK);
    assert_int_equal(request_entries(&e) - e0, 1);
    assert_null(r.cfg); // old done
    assert_true(nr.decode.id == b.id);
    assert_int_equal(inflight_of(&e, a.id), 0);
    assert_int_equal(inflight_of(&e, b.id), 1);
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.1:8001", &a), TDM_OK);
    assert_false(a.healthy);
    char *m = render(&e);
    char line[256];
    snprintf(
        line, sizeof line,
        "tandem:router_upstream_errors_total{endpoint=\"%s\",kind=\"error\",role=\"decode\"} 1",
        a.name);
    expect_line(m, line);
    expect_line(m, "tandem:router_requests_total{status=\"error\"} 1");
    expect_line(m, "tandem:router_inflight_requests 1");
    free(m);

    // B lost too, nothing left: B reported, still held, the new route empty.
    e0 = request_entries(&e);
    uint64_t both[2] = {a.id, b.id};
    assert_int_equal(tdm_router_control_reroute(
                         e.ctl, &nr, t, &(struct tdm_router_request){.num_prompt_tokens = 32}, both,
                         2, &r, err, sizeof err),
                     TDM_EBUSY);
    assert_int_equal(request_entries(&e) - e0, 1);
    assert_null(r.cfg);
    assert_non_null(nr.cfg);
    assert_int_equal(inflight_of(&e, b.id), 1);
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.2:8001", &b), TDM_OK);
    assert_false(b.healthy);

    // Its end: the report and the release in one entry.
    e0 = request_entries(&e);
    tdm_router_control_route_done_report(e.ctl, &nr, "error", TDM_ROUTER_OUTCOME_ERROR);
    assert_int_equal(request_entries(&e) - e0, 1);
    assert_null(nr.cfg);
    assert_int_equal(inflight_of(&e, b.id), 0);
    m = render(&e);
    snprintf(
        line, sizeof line,
        "tandem:router_upstream_errors_total{endpoint=\"%s\",kind=\"error\",role=\"decode\"} 2",
        b.name);
    expect_line(m, line);
    expect_line(m, "tandem:router_requests_total{status=\"error\"} 2");
    expect_line(m, "tandem:router_inflight_requests 0");
    free(m);
    // Nothing held, nothing reported: no entry.
    e0 = request_entries(&e);
    tdm_router_control_route_done_report(e.ctl, &nr, "error", TDM_ROUTER_OUTCOME_ERROR);
    tdm_router_control_route_done(e.ctl, &r, "error");
    assert_int_equal(request_entries(&e) - e0, 0);
    env_close(&e);
}

// The pool's saturation (flow control): per endpoint max(queue / 5, KV /
// 0.8), meaned. Requests routed since a report count as queue beyond the
// room its running batch has (max_running - running); a worker that does not
// tell its bound has every one counted. No fresh report: 1.
static void test_saturation(void **state)
{
    (void)state;
    struct env e;
    struct tdm_router_endpoint_view a, b;
    struct tdm_router_endpoints *eps = two_decodes(&e, "", &a, &b);
    struct tdm_router_report ra = {.instance = 0xA, .load = {.running = 2, .max_running = 8}};
    struct tdm_router_report rb = {.instance = 0xB, .load = {.waiting = 1, .kv_usage = 0.4}};
    assert_int_equal(tdm_router_endpoints_on_report(eps, a.id, &ra, NULL, NULL), TDM_OK);
    assert_int_equal(tdm_router_endpoints_on_report(eps, b.id, &rb, NULL, NULL), TDM_OK);
    // A: 0; B: max(1/5, 0.4/0.8) = 0.5.
    assert_true(fabs(tdm_router_control_saturation(e.ctl) - 0.25) < 1e-9);
    int32_t t[4] = {1, 2, 3, 4};
    char err[256];
    struct tdm_router_route r[16];
    int nr = 0;
    for (int i = 0; i < 16; i++) { // round robin: 8 on each
        assert_int_equal(tdm_router_control_route(e.ctl, t, 4, NULL, &r[nr++], err, sizeof err),
                         TDM_OK);
    }
    // A: 8 sent, room 6: 2 wait -> 0.4; B (no bound told): 1 + 8 = 9 -> 1.8.
    assert_true(fabs(tdm_router_control_saturation(e.ctl) - (0.4 + 1.8) / 2) < 1e-9);
    for (int i = 0; i < nr; i++)
        tdm_router_control_route_done(e.ctl, &r[i], "success");
    // A report resets what was sent since: A = 0, B = 0.5 again.
    assert_int_equal(tdm_router_endpoints_on_report(eps, a.id, &ra, NULL, NULL), TDM_OK);
    assert_int_equal(tdm_router_endpoints_on_report(eps, b.id, &rb, NULL, NULL), TDM_OK);
    assert_true(fabs(tdm_router_control_saturation(e.ctl) - 0.25) < 1e-9);
    env_close(&e);
}

static void test_no_endpoint(void **state)
{
    (void)state;
    struct env e;
    env_open(&e, "policy: round_robin\nendpoints: {decode: ['10.0.1.1:8001']}\n");
    struct tdm_router_endpoints *eps = tdm_router_control_endpoints(e.ctl);
    struct tdm_router_endpoint_view v;
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.1:8001", &v), TDM_OK);
    tdm_router_endpoints_set_healthy(eps, v.id, false);
    char err[256];
    struct tdm_router_route r;
    int32_t t[4] = {1, 2, 3, 4};
    assert_int_equal(tdm_router_control_route(e.ctl, t, 4, NULL, &r, err, sizeof err), TDM_EBUSY);
    assert_string_equal(err, "no healthy decode endpoint (1 configured, 0 healthy)");
    assert_null(r.cfg);
    tdm_router_control_route_done(e.ctl, &r, "error"); // a failed route: no-op
    char *m = render(&e);
    expect_line(m, "tandem:router_requests_total{status=\"no_endpoint\"} 1");
    expect_line(m, "tandem:router_requests_total{status=\"error\"} 0");
    free(m);
    // Session affinity through the control path: a token names the endpoint.
    tdm_router_endpoints_set_healthy(eps, v.id, true);
    assert_int_equal(tdm_router_control_route(e.ctl, NULL, 0, "x", &r, err, sizeof err), TDM_OK);
    tdm_router_control_route_done(e.ctl, &r, "cancelled");
    env_close(&e);
}

// Routes n times (each done at once); how many went to endpoint id.
static int routes_to(struct env *e, uint64_t id, int n)
{
    int32_t t[4] = {1, 2, 3, 4};
    char err[256];
    int hits = 0;
    for (int i = 0; i < n; i++) {
        struct tdm_router_route r;
        if (tdm_router_control_route(e->ctl, t, 4, NULL, &r, err, sizeof err) != TDM_OK)
            fail_msg("route %d: %s", i, err);
        hits += r.decode.id == id;
        tdm_router_control_route_done(e->ctl, &r, "success");
    }
    return hits;
}

static cJSON *state_of(cJSON *config, const char *name)
{
    cJSON *st = cJSON_GetObjectItem(config, "endpoints_state");
    for (int i = 0; i < cJSON_GetArraySize(st); i++) {
        cJSON *x = cJSON_GetArrayItem(st, i);
        if (!strcmp(cJSON_GetObjectItem(x, "name")->valuestring, name))
            return x;
    }
    fail_msg("no endpoints_state for %s", name);
    return NULL;
}

// A decode worker never heard from whose control link is down (not started
// yet, restarting, a wrong nng port) is no candidate: round robin over two
// would take it every other route. Healthy as far as its checks go, it stays
// so (nothing is charged to it), and GET /v1/router/config says why it is
// left out, and tandem:router_ready_endpoints does not count it (it counts
// what a policy can pick). Its link up, or its first report, makes it a
// candidate at once; when only such workers are left, the route fails as with
// none (EBUSY, counted no_endpoint) and says why.
static void test_not_up_excluded(void **state)
{
    (void)state;
    struct env e;
    struct tdm_router_endpoint_view a, b;
    struct tdm_router_endpoints *eps = two_decodes(&e, "", &a, &b);
    struct tdm_router_load ld = {.running = 1};
    assert_int_equal(tdm_router_endpoints_set_load(eps, b.id, &ld), TDM_OK);
    assert_int_equal(routes_to(&e, a.id, 2), 1); // both are candidates
    expect_ready(&e, "decode", 2);
    tdm_router_endpoints_set_link_down(eps, a.id, true);
    assert_int_equal(routes_to(&e, a.id, 8), 0);
    expect_ready(&e, "decode", 1);
    assert_int_equal(tdm_router_endpoints_get(eps, a.id, &a), TDM_OK);
    assert_true(a.not_up && a.healthy);
    char *json = tdm_router_control_config_json(e.ctl);
    cJSON *o = cJSON_Parse(json);
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(state_of(o, "10.0.1.1:8001"), "not_up")));
    assert_true(cJSON_IsTrue(cJSON_GetObjectItem(state_of(o, "10.0.1.1:8001"), "healthy")));
    assert_true(cJSON_IsFalse(cJSON_GetObjectItem(state_of(o, "10.0.1.2:8001"), "not_up")));
    cJSON_Delete(o);
    free(json);
    // A link down says nothing against one the router has heard from.
    tdm_router_endpoints_set_link_down(eps, b.id, true);
    assert_int_equal(routes_to(&e, b.id, 2), 2);
    expect_ready(&e, "decode", 1);
    // Only a worker not up left: no route, saying why; nothing held.
    tdm_router_endpoints_set_healthy(eps, b.id, false);
    int32_t t[4] = {1, 2, 3, 4};
    char err[256];
    struct tdm_router_route r;
    assert_int_equal(tdm_router_control_route(e.ctl, t, 4, NULL, &r, err, sizeof err), TDM_EBUSY);
    assert_string_equal(err, "no healthy decode endpoint (2 configured, 1 healthy); 1 not up yet "
                             "(never reported, control-plane link down)");
    assert_null(r.cfg);
    assert_int_equal(inflight_of(&e, a.id), 0);
    char *m = render(&e);
    expect_line(m, "tandem:router_requests_total{status=\"no_endpoint\"} 1");
    expect_line(m, "tandem:router_ready_endpoints{role=\"decode\"} 0");
    free(m);
    // Its link up: a candidate at once.
    tdm_router_endpoints_set_healthy(eps, b.id, true);
    tdm_router_endpoints_set_link_down(eps, a.id, false);
    assert_int_equal(routes_to(&e, a.id, 2), 1);
    expect_ready(&e, "decode", 2);
    // Down again, then its first report: a candidate at once, link or not.
    tdm_router_endpoints_set_link_down(eps, a.id, true);
    assert_int_equal(routes_to(&e, a.id, 2), 0);
    expect_ready(&e, "decode", 1);
    struct tdm_router_report rep = {.instance = 0xA};
    assert_int_equal(tdm_router_endpoints_on_report(eps, a.id, &rep, NULL, NULL), TDM_OK);
    assert_int_equal(routes_to(&e, a.id, 2), 1);
    expect_ready(&e, "decode", 2);
    assert_int_equal(tdm_router_endpoints_get(eps, a.id, &a), TDM_OK);
    assert_true(!a.not_up && a.healthy);
    env_close(&e);
}

// Prefill workers not up are no candidates either: the decode worker is not
// sent to them, the ready gauge does not count them; with none left the route
// is decode-only.
static void test_not_up_prefill_excluded(void **state)
{
    (void)state;
    struct env e;
    env_open(&e, pd_cfg);
    struct tdm_router_endpoints *eps = tdm_router_control_endpoints(e.ctl);
    const char *names[3] = {"10.0.0.1:8101", "10.0.0.2:8101", "10.0.0.3:8101"};
    uint64_t ids[3];
    for (int i = 0; i < 3; i++) {
        struct tdm_router_endpoint_view v;
        assert_int_equal(tdm_router_endpoints_find(eps, names[i], &v), TDM_OK);
        ids[i] = v.id;
    }
    int32_t tokens[64];
    for (int i = 0; i < 64; i++)
        tokens[i] = 1000 + i;
    char err[256];
    struct tdm_router_route r;
    expect_ready(&e, "prefill", 3);
    tdm_router_endpoints_set_link_down(eps, ids[0], true);
    tdm_router_endpoints_set_link_down(eps, ids[1], true);
    expect_ready(&e, "prefill", 1);
    expect_ready(&e, "decode", 2);
    for (int k = 0; k < 4; k++) {
        tokens[0] = 5000 + k; // a cold prompt each time: prefill-decode
        assert_int_equal(tdm_router_control_route(e.ctl, tokens, 64, NULL, &r, err, sizeof err),
                         TDM_OK);
        assert_int_equal(r.decision, TDM_ROUTER_DECISION_PREFILL_DECODE);
        assert_int_equal(r.n_prefill, 1); // 2 with the ones not up
        assert_true(r.prefill[0].id == ids[2]);
        tdm_router_control_route_done(e.ctl, &r, "success");
    }
    tdm_router_endpoints_set_link_down(eps, ids[2], true);
    expect_ready(&e, "prefill", 0);
    tokens[0] = 6000;
    assert_int_equal(tdm_router_control_route(e.ctl, tokens, 64, NULL, &r, err, sizeof err),
                     TDM_OK);
    assert_int_equal(r.decision, TDM_ROUTER_DECISION_DECODE_ONLY);
    assert_int_equal(r.n_prefill, 0);
    tdm_router_control_route_done(e.ctl, &r, "success");
    env_close(&e);
}

static void test_reload_under_held_route_and_json(void **state)
{
    (void)state;
    struct env e;
    env_open(&e, "policy: round_robin\nendpoints: {decode: ['10.0.1.1:8001', '10.0.1.2:8001']}\n");
    char err[256];
    struct tdm_router_route r;
    int32_t t[8] = {0};
    assert_int_equal(tdm_router_control_route(e.ctl, t, 8, NULL, &r, err, sizeof err), TDM_OK);
    uint64_t held = r.decode.id;
    // The new config drops the held endpoint and adds another.
    write_file(e.path, "policy: least_loaded\n"
                       "endpoints: {decode: ['10.0.1.2:8001', '10.0.1.3:8001']}\n");
    assert_int_equal(tdm_router_control_reload(e.ctl, err, sizeof err), TDM_OK);
    assert_string_equal(r.cfg->short_policy, "round_robin"); // the request keeps its config
    struct tdm_router_endpoints *eps = tdm_router_control_endpoints(e.ctl);
    struct tdm_router_endpoint_view v;
    // Round robin's first pick is the first endpoint, 10.0.1.1: now draining
    // until the route is done.
    assert_int_equal(tdm_router_endpoints_get(eps, held, &v), TDM_OK);
    assert_string_equal(v.name, "10.0.1.1:8001");
    assert_true(v.draining);
    char *json = tdm_router_control_config_json(e.ctl);
    assert_non_null(json);
    cJSON *o = cJSON_Parse(json);
    assert_non_null(o);
    assert_string_equal(cJSON_GetObjectItem(o, "policy")->valuestring, "least_loaded");
    cJSON *st = cJSON_GetObjectItem(o, "endpoints_state");
    assert_true(cJSON_GetArraySize(st) >= 2);
    bool saw1 = false, saw3 = false;
    for (int i = 0; i < cJSON_GetArraySize(st); i++) {
        cJSON *x = cJSON_GetArrayItem(st, i);
        if (!strcmp(cJSON_GetObjectItem(x, "name")->valuestring, "10.0.1.3:8001")) {
            saw3 = true;
            assert_false(cJSON_IsTrue(cJSON_GetObjectItem(x, "healthy"))); // not checked yet
            assert_true(cJSON_IsNull(cJSON_GetObjectItem(x, "load")));
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(x, "unreported")) == 0);
        }
        if (!strcmp(cJSON_GetObjectItem(x, "name")->valuestring, "10.0.1.1:8001")) {
            // The held route, sent since no report: in flight and unreported.
            saw1 = true;
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(x, "inflight")) == 1);
            assert_true(cJSON_GetNumberValue(cJSON_GetObjectItem(x, "unreported")) == 1);
        }
    }
    assert_true(saw1 && saw3);
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "reloads"), "success")->valueint,
                     1);
    cJSON_Delete(o);
    free(json);
    tdm_router_control_route_done(e.ctl, &r, "success");
    assert_int_equal(tdm_router_endpoints_find(eps, "10.0.1.1:8001", &v), TDM_ENOTFOUND);
    // A bad reload keeps the config and counts the failure in the metrics.
    write_file(e.path, "policy: least_loaded\nendpoints: {decode: 5}\n");
    assert_int_equal(tdm_router_control_reload(e.ctl, err, sizeof err), TDM_EINVAL);
    char *m = render(&e);
    expect_line(m, "tandem:router_config_reload_total{result=\"failure\"} 1");
    expect_line(m, "tandem:router_config_reload_total{result=\"success\"} 1");
    assert_non_null(strstr(m, "tandem:router_config_last_reload_success_timestamp_seconds 1"));
    free(m);
    env_close(&e);
}

static void test_start_checks_health(void **state)
{
    (void)state;
    struct env e;
    // Nothing listens on port 1: the first check marks it down (threshold 1).
    env_open(&e, "policy: round_robin\n"
                 "health: {interval_seconds: 5, timeout_seconds: 0.2, failure_threshold: 1}\n"
                 "endpoints: {decode: ['127.0.0.1:1']}\n");
    char err[256];
    assert_int_equal(tdm_router_control_start(e.ctl, true, err, sizeof err), TDM_OK);
    struct tdm_router_endpoint_view v;
    assert_int_equal(
        tdm_router_endpoints_find(tdm_router_control_endpoints(e.ctl), "127.0.0.1:1", &v), 0);
    assert_false(v.healthy);
    assert_non_null(tdm_router_control_store(e.ctl));
    assert_non_null(tdm_router_control_metrics(e.ctl));
    env_close(&e);
    // Without a registry there are no metrics, and everything still works.
    char dir[256], path[512];
    snprintf(dir, sizeof dir, "%s/router-ctl2-XXXXXX", TANDEM_BINARY_DIR);
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/r.yaml", dir);
    write_file(path, "policy: random\nendpoints: {decode: ['10.0.0.1:8001']}\n");
    struct tdm_router_control *ctl = NULL;
    assert_int_equal(tdm_router_control_new(&ctl, path, NULL, err, sizeof err), TDM_OK);
    assert_null(tdm_router_control_metrics(ctl));
    struct tdm_router_route r;
    assert_int_equal(tdm_router_control_route(ctl, NULL, 0, NULL, &r, err, sizeof err), TDM_OK);
    tdm_router_control_route_done(ctl, &r, "success");
    tdm_router_control_free(ctl);
    tdm_router_control_free(NULL);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    tdm_log_level = TDM_LOG_LEVEL_ERR;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_route_decode_only_and_prefix),
        cmocka_unit_test(test_prefill_retries_cap_and_fallback),
        cmocka_unit_test(test_route_avoiding),
        cmocka_unit_test(test_entries_and_reroute),
        cmocka_unit_test(test_saturation),
        cmocka_unit_test(test_no_endpoint),
        cmocka_unit_test(test_not_up_excluded),
        cmocka_unit_test(test_not_up_prefill_excluded),
        cmocka_unit_test(test_reload_under_held_route_and_json),
        cmocka_unit_test(test_start_checks_health),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
