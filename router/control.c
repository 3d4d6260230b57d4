// SPDX-License-Identifier: Apache-2.0
// router control: wires the config store, the endpoint registry and the router
// metrics together and turns a prompt into a route (control.h). A route holds
// a reference to the config it was made with and in-flight counts on the
// endpoints it uses, so neither a reload nor a DNS change can pull them away
// mid-request; route_done gives both back. A route enters the registry once
// (tdm_router_endpoints_attempt_begin: the policy's pick runs there, on the
// copied snapshot) and route_done once (attempt_end: report and release).
#include "control.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config_impl.h"
#include "core.h"
#include "flow.h"
#include "retry.h"

#define MOD "router-control"

struct tdm_router_control {
    struct tdm_router_metrics metrics;
    bool has_metrics;
    struct tdm_router_config_store *store;
    struct tdm_router_endpoints *eps;
    struct tdm_router_flow *flow; // flow control's queues (used while the gate is on)
};

static struct tdm_router_metrics *mx(struct tdm_router_control *ctl)
{
    return ctl->has_metrics ? &ctl->metrics : NULL;
}

static void on_reload(const struct tdm_router_config *new_cfg,
                      const struct tdm_router_config *old_cfg, void *arg)
{
    (void)old_cfg;
    struct tdm_router_control *ctl = arg;
    if (tdm_router_endpoints_apply_config(ctl->eps, new_cfg) != TDM_OK)
        TDM_LOG_ERR(MOD, "applying the new endpoint list failed (out of memory)");
}

// ---- flow control ---------------------------------------------------------------------------
// The pool's saturation as llm-d's utilization detector computes it: the mean
// over the ready endpoints of max(queue / queueDepthThreshold, KV usage /
// kvCacheUtilThreshold); an endpoint without a fresh report counts 1, and a
// pool with no ready endpoint is saturated. The queue is the reported waiting
// requests plus those of the requests routed there since that report that
// the running batch cannot take (its reported running and bound): they wait
// there. A worker that does not tell its bound counts them all.
static double queue_projection(const struct tdm_router_endpoint_view *v)
{
    double sent = (double)v->unreported;
    if (v->load.max_running > 0) {
        double room = (double)v->load.max_running - (double)v->load.running;
        sent = sent > room ? sent - (room > 0 ? room : 0) : 0;
    }
    return (double)v->load.waiting + sent;
}

// Every endpoint's view (caller frees); NULL on ENOMEM.
static struct tdm_router_endpoint_view *list_endpoints(struct tdm_router_control *ctl, size_t *n)
{
    size_t cap = 32;
    struct tdm_router_endpoint_view *v = NULL;
    for (;;) {
        struct tdm_router_endpoint_view *nv = realloc(v, cap * sizeof *v);
        if (!nv) {
            free(v);
            return NULL;
        }
        v = nv;
        *n = tdm_router_endpoints_list(ctl->eps, v, cap);
        if (*n <= cap)
            return v;
        cap = *n;
    }
}

static double pool_saturation(void *arg)
{
    struct tdm_router_control *ctl = arg;
    struct tdm_router_config *cfg = tdm_router_config_store_get(ctl->store, NULL);
    double qd = cfg->flow.queue_depth_threshold, kv = cfg->flow.kv_cache_util_threshold;
    tdm_router_config_unref(cfg);
    size_t n = 0;
    struct tdm_router_endpoint_view *v = list_endpoints(ctl, &n);
    if (!v)
        return 1.0; // no room to look: hold requests rather than flood
    double sum = 0;
    size_t ready = 0;
    for (size_t i = 0; i < n; i++) {
        if (!tdm_router_endpoint_ready(&v[i]))
            continue;
        ready++;
        if (!v[i].has_load || v[i].load_stale) {
            sum += 1.0;
            continue;
        }
        double q = queue_projection(&v[i]) / qd;
        double k = v[i].load.kv_usage / kv;
        sum += q > k ? q : k;
    }
    free(v);
    double sat = ready ? sum / (double)ready : 1.0;
    if (mx(ctl))
        tdm_metrics_gauge_set(ctl->metrics.pool_saturation, sat);
    return sat;
}

static void queue_change(void *arg, int priority, int requests, long long bytes)
{
    struct tdm_router_control *ctl = arg;
    tdm_router_metrics_flow_queue(mx(ctl), priority, requests, bytes);
}

double tdm_router_control_saturation(struct tdm_router_control *ctl)
{
    return pool_saturation(ctl);
}

enum tdm_router_flow_outcome tdm_router_control_admit(struct tdm_router_control *ctl,
                                                      const struct tdm_router_admit_ask *ask,
                                                      struct tdm_router_flow_ticket *t)
{
    struct tdm_router_config *cfg = tdm_router_config_store_get(ctl->store, NULL);
    int priority = tdm_router_objective_priority(&cfg->flow, ask->objective);
    memset(t, 0, sizeof *t);
    if (!cfg->flow.enabled) {
        // llm-d without flow control: sheddable requests are dropped while
        // the pool is saturated; the others always pass.
        t->outcome = priority < 0 && pool_saturation(ctl) >= 1.0 ? TDM_ROUTER_FLOW_SHED
                                                                 : TDM_ROUTER_FLOW_DISPATCHED;
    } else {
        double deadline =
            ask->deadline > 0 ? ask->deadline : tdm_now() + cfg->request_deadline_seconds;
        if (cfg->flow.default_ttl > 0 && tdm_now() + cfg->flow.default_ttl < deadline)
            deadline = tdm_now() + cfg->flow.default_ttl;
        struct tdm_router_flow_ask fa = {.cfg = &cfg->flow,
                                         .priority = priority,
                                         .fairness_id = ask->fairness_id,
                                         .bytes = ask->bytes,
                                         .deadline = deadline,
                                         .gone = ask->gone,
                                         .gone_arg = ask->gone_arg,
                                         .may_wait = ask->may_wait};
        tdm_router_flow_admit(ctl->flow, &fa, t);
    }
    if (cfg->flow.enabled || t->outcome != TDM_ROUTER_FLOW_DISPATCHED)
        tdm_router_metrics_flow_outcome(mx(ctl), priority, t->outcome, t->waited);
    if (t->outcome != TDM_ROUTER_FLOW_DISPATCHED)
        TDM_LOG_INFO(MOD, "flow control: %s (priority %d, waited %.3fs)",
                     tdm_router_flow_outcome_name(t->outcome), priority, t->waited);
    tdm_router_config_unref(cfg);
    return t->outcome;
}

void tdm_router_control_admitted(struct tdm_router_control *ctl, struct tdm_router_flow_ticket *t)
{
    tdm_router_flow_routed(ctl->flow, t);
}

void tdm_router_control_load_changed(struct tdm_router_control *ctl)
{
    tdm_router_flow_kick(ctl->flow);
}

void tdm_router_control_stop_flow(struct tdm_router_control *ctl)
{
    tdm_router_flow_stop(ctl->flow);
}

int tdm_router_control_new(struct tdm_router_control **out, const char *config_path,
                           struct tdm_metrics_registry *reg, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_router_control *ctl = calloc(1, sizeof *ctl);
    if (!ctl)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    int rc;
    if (reg) {
        if ((rc = tdm_router_metrics_register(&ctl->metrics, reg, err, errlen)))
            goto fail_ctl;
        ctl->has_metrics = true;
    }
    if ((rc = tdm_router_config_store_new(&ctl->store, config_path, mx(ctl), err, errlen)))
        goto fail_ctl;
    struct tdm_router_config *cfg = tdm_router_config_store_get(ctl->store, NULL);
    rc = tdm_router_endpoints_new(&ctl->eps, cfg, mx(ctl), err, errlen);
    tdm_router_config_unref(cfg);
    if (rc)
        goto fail_store;
    struct tdm_router_flow_hooks hooks = {
        .saturation = pool_saturation, .queue_change = queue_change, .arg = ctl};
    if ((rc = tdm_router_flow_new(&ctl->flow, &hooks))) {
        tdm_seterr(err, errlen, rc, "out of memory");
        tdm_router_endpoints_free(ctl->eps);
        goto fail_store;
    }
    tdm_router_config_store_on_reload(ctl->store, on_reload, ctl);
    *out = ctl;
    return TDM_OK;

fail_store:
    tdm_router_config_store_free(ctl->store);
fail_ctl:
    free(ctl);
    return rc;
}

int tdm_router_control_start(struct tdm_router_control *ctl, bool watch, char *err, size_t errlen)
{
    int rc = tdm_router_endpoints_refresh_dns(ctl->eps);
    if (rc)
        return tdm_seterr(err, errlen, rc, "resolving endpoints: %s", tdm_strerror(rc));
    tdm_router_endpoints_check_health(ctl->eps);
    if ((rc = tdm_router_endpoints_start(ctl->eps)))
        return tdm_seterr(err, errlen, rc, "cannot start the endpoint discovery thread");
    if (watch && (rc = tdm_router_config_store_watch(ctl->store, 0, err, errlen)))
        return rc;
    return TDM_OK;
}

void tdm_router_control_free(struct tdm_router_control *ctl)
{
    if (!ctl)
        return;
    // The store's watcher calls into the registry: stop it first.
    tdm_router_config_store_free(ctl->store);
    tdm_router_endpoints_free(ctl->eps);
    tdm_router_flow_free(ctl->flow);
    free(ctl);
}

struct tdm_router_config_store *tdm_router_control_store(struct tdm_router_control *ctl)
{
    return ctl->store;
}

struct tdm_router_endpoints *tdm_router_control_endpoints(struct tdm_router_control *ctl)
{
    return ctl->eps;
}

struct tdm_router_metrics *tdm_router_control_metrics(struct tdm_router_control *ctl)
{
    return mx(ctl);
}

static void to_target(const struct tdm_router_endpoint_view *v, struct tdm_router_target *t)
{
    t->id = v->id;
    memcpy(t->name, v->name, sizeof t->name);
    memcpy(t->host, v->host, sizeof t->host);
    t->http_port = v->http_port;
    t->nng_port = v->nng_port;
    t->role = v->role;
    t->health_epoch = v->health_epoch;
    t->instance = v->instance;
    t->heard_at = v->heard_at;
    t->load = v->load;
}

static void log_scores(const struct tdm_router_config *cfg, size_t profile, const char *what,
                       const struct tdm_router_snapshot *snap,
                       const struct tdm_router_endpoint_score *scores)
{
    char line[2048];
    tdm_router_policy_format_scores(cfg, profile, snap, scores, line, sizeof line);
    TDM_LOG_DEBUG(MOD, "%s scores: %s", what, line);
}

// The policy's pick on a snapshot with the avoided endpoints marked unhealthy;
// when that leaves no decode endpoint, the pick without avoidance.
static int pick_avoiding(const struct tdm_router_config *cfg, struct tdm_router_snapshot *snap,
                         const struct tdm_router_request *req, const uint64_t *avoid,
                         size_t n_avoid, struct tdm_router_pick *pick)
{
    size_t marked[TDM_ROUTER_RETRY_MAX_ROUTES], nm = 0;
    for (size_t a = 0; avoid && a < n_avoid; a++)
        for (size_t i = 0; i < snap->n && nm < TDM_ROUTER_RETRY_MAX_ROUTES; i++)
            if (snap->eps[i].id == avoid[a] && snap->eps[i].healthy) {
                snap->eps[i].healthy = false;
                marked[nm++] = i;
            }
    int rc = tdm_router_policy_pick(cfg, snap, req, pick);
    for (size_t m = 0; m < nm; m++)
        snap->eps[marked[m]].healthy = true;
    if (rc == TDM_EBUSY && nm > 0)
        rc = tdm_router_policy_pick(cfg, snap, req, pick);
    return rc;
}

// What the pick works with; it runs inside tdm_router_endpoints_attempt_begin,
// under the registry's lock, on the copied snapshot.
struct pick_args {
    const struct tdm_router_config *cfg;
    const struct tdm_router_request *req;
    const uint64_t *avoid; // [n_avoid] decode endpoints that failed the request
    size_t n_avoid;
    struct tdm_router_pick pick;
    struct tdm_router_endpoint_score *scores; // [2 * snap->n] at DEBUG level, else NULL
};

// tdm_router_pick_fn: the policy's pick (pick_avoiding); the decode endpoint
// and the first prefill candidate are the ones held.
static int pick_locked(void *arg, struct tdm_router_snapshot *snap, struct tdm_router_held *held)
{
    struct pick_args *a = arg;
    if (tdm_log_level >= TDM_LOG_LEVEL_DEBUG && snap->n) // the scores' log only
        a->scores = calloc(2 * snap->n, sizeof *a->scores);
    a->pick.decode_scores = a->scores;
    a->pick.prefill_scores = a->scores ? a->scores + snap->n : NULL;
    int rc = pick_avoiding(a->cfg, snap, a->req, a->avoid, a->n_avoid, &a->pick);
    if (rc)
        return rc;
    held->decode = a->pick.decode;
    if (a->pick.decision == TDM_ROUTER_DECISION_PREFILL_DECODE && a->pick.n_prefill > 0)
        held->prefill = a->pick.prefill[0];
    return TDM_OK;
}

// The route from the pick attempt_begin held (route->cfg already set): the
// decode target, the ranked prefill targets capped to the first (the held
// one) and at most prefill_retries more, and the decision.
static void fill_route(struct tdm_router_route *route, const struct tdm_router_snapshot *snap,
                       const struct tdm_router_pick *pick)
{
    route->decision = pick->decision;
    to_target(&snap->eps[pick->decode], &route->decode);
    route->decode_held_ = true;
    route->cached_tokens = pick->cached_tokens;
    route->uncached_tokens = pick->uncached_tokens;
    for (size_t i = 0; i < pick->n_prefill; i++)
        to_target(&snap->eps[pick->prefill[i]], &route->prefill[route->n_prefill++]);
    if (route->decision != TDM_ROUTER_DECISION_PREFILL_DECODE)
        return;
    if (route->n_prefill == 0) {
        route->decision = TDM_ROUTER_DECISION_DECODE_ONLY;
        return;
    }
    route->prefill_idx = 0;
    route->prefill_held_ = true;
    // The decode worker gets this one and at most prefill_retries more.
    size_t cap = route->prefill_idx + 1 + (size_t)route->cfg->prefill_retries;
    if (route->n_prefill > cap)
        route->n_prefill = cap;
    route->max_prefill_attempts = 1 + route->cfg->prefill_retries;
}

// The failed route's error: which role had nothing, and why.
static int route_error(struct tdm_router_control *ctl, int rc, const struct tdm_router_held *held,
                       char *err, size_t errlen)
{
    if (rc != TDM_EBUSY)
        return tdm_seterr(err, errlen, rc, "routing failed: %s", tdm_strerror(rc));
    char not_up[128] = "";
    if (held->n_decode_not_up)
        snprintf(not_up, sizeof not_up,
                 "; %zu not up yet (never reported, control-plane link down)",
                 held->n_decode_not_up);
    tdm_seterr(err, errlen, TDM_EBUSY,
               "no healthy decode endpoint (%zu configured, %zu healthy)%s%s", held->n_decode,
               held->n_decode_healthy, not_up,
               held->n_auth_failed ? "; some refuse the router's control-plane handshake: start "
                                     "them with this router's TANDEM_INTERNAL_SECRET"
                                   : "");
    tdm_router_metrics_request(mx(ctl), "no_endpoint");
    return TDM_EBUSY;
}

// route_avoiding and reroute: one entry into the registry (attempt_begin),
// which applies prev (reroute's old route) around the new hold.
static int route_with(struct tdm_router_control *ctl, const int32_t *tokens,
                      const struct tdm_router_request *ask, const uint64_t *avoid, size_t n_avoid,
                      const struct tdm_router_give_back *prev, struct tdm_router_route *route,
                      char *err, size_t errlen)
{
    memset(route, 0, sizeof *route);
    double t0 = tdm_now();
    struct tdm_router_config *cfg = tdm_router_config_store_get(ctl->store, NULL);
    size_t bs = (size_t)cfg->block_size_tokens;
    size_t n = ask->num_prompt_tokens;
    size_t nb = tokens ? n / bs : 0;
    uint64_t *hashes = NULL;
    if (nb && !(hashes = malloc(nb * sizeof *hashes))) {
        tdm_router_config_unref(cfg);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    }
    tdm_router_block_hashes(tokens, n, (int)bs, ask->hash_root, hashes, nb);

    struct pick_args pa = {.cfg = cfg, .req = ask, .avoid = avoid, .n_avoid = n_avoid};
    struct tdm_router_snapshot snap = {0};
    struct tdm_router_held held;
    int rc = tdm_router_endpoints_attempt_begin(ctl->eps, hashes, nb, pick_locked, &pa, prev, &snap,
                                                &held);
    if (rc) {
        route_error(ctl, rc, &held, err, errlen);
        free(pa.scores);
        tdm_router_snapshot_free(&snap);
        free(hashes);
        tdm_router_config_unref(cfg);
        memset(route, 0, sizeof *route);
        return rc;
    }
    route->cfg = cfg;
    route->block_hashes_ = hashes;
    route->n_blocks_ = nb;
    fill_route(route, &snap, &pa.pick);
    tdm_router_metrics_decision(mx(ctl), route->decision);
    if (mx(ctl)) {
        tdm_metrics_gauge_inc(ctl->metrics.inflight);
        tdm_metrics_histogram_observe(ctl->metrics.routing, tdm_now() - t0);
    }
    route->routed_at = tdm_now();
    route->deadline = route->routed_at + route->cfg->request_deadline_seconds;
    if (pa.scores) {
        log_scores(cfg, cfg->decode_profile, "decode", &snap, pa.pick.decode_scores);
        if (pa.pick.n_prefill)
            log_scores(cfg, cfg->prefill_profile, "prefill", &snap, pa.pick.prefill_scores);
    }
    TDM_LOG_DEBUG(MOD, "route decision=%s decode=%s prefill=%s prompt=%zu cached=%zu%s",
                  tdm_router_decision_name(route->decision), route->decode.name,
                  route->prefill_held_ ? route->prefill[route->prefill_idx].name : "-", n,
                  route->cached_tokens, pa.pick.fail_open ? " fail_open=1" : "");
    free(pa.scores);
    tdm_router_snapshot_free(&snap);
    return TDM_OK;
}

int tdm_router_control_route(struct tdm_router_control *ctl, const int32_t *tokens, size_t n,
                             const char *session, struct tdm_router_route *route, char *err,
                             size_t errlen)
{
    struct tdm_router_request req = {.num_prompt_tokens = n, .session = session};
    return route_with(ctl, tokens, &req, NULL, 0, NULL, route, err, errlen);
}

int tdm_router_control_route_avoiding(struct tdm_router_control *ctl, const int32_t *tokens,
                                      const struct tdm_router_request *req, const uint64_t *avoid,
                                      size_t n_avoid, struct tdm_router_route *route, char *err,
                                      size_t errlen)
{
    return route_with(ctl, tokens, req, avoid, n_avoid, NULL, route, err, errlen);
}

// What route r gives back: its held endpoints, and a report on its decode
// endpoint when report is set (the upstream error metric is counted here).
static struct tdm_router_give_back route_end_of(struct tdm_router_control *ctl,
                                                const struct tdm_router_route *r, bool report,
                                                enum tdm_router_outcome outcome)
{
    struct tdm_router_give_back end = {0};
    if (report && r->decode.id) {
        end.report = r->decode.id;
        end.outcome = outcome;
        if (outcome != TDM_ROUTER_OUTCOME_SUCCESS)
            tdm_router_metrics_upstream_error(mx(ctl), r->decode.name, r->decode.role,
                                              outcome == TDM_ROUTER_OUTCOME_TIMEOUT);
    }
    if (r->cfg && r->decode_held_)
        end.release[0] = r->decode.id;
    if (r->cfg && r->prefill_held_)
        end.release[1] = r->prefill[r->prefill_idx].id;
    return end;
}

// route_done's part outside the registry: the request's status, the in-flight
// gauge, the config reference; zeroes the route.
static void route_finish(struct tdm_router_control *ctl, struct tdm_router_route *r,
                         const char *status)
{
    tdm_router_metrics_request(mx(ctl), status ? status : "success");
    if (mx(ctl))
        tdm_metrics_gauge_dec(ctl->metrics.inflight);
    tdm_router_config_unref(r->cfg);
    free(r->block_hashes_);
    memset(r, 0, sizeof *r);
}

int tdm_router_control_reroute(struct tdm_router_control *ctl, struct tdm_router_route *old,
                               const int32_t *tokens, const struct tdm_router_request *req,
                               const uint64_t *avoid, size_t n_avoid,
                               struct tdm_router_route *route, char *err, size_t errlen)
{
    struct tdm_router_give_back prev = route_end_of(ctl, old, true, TDM_ROUTER_OUTCOME_ERROR);
    int rc = route_with(ctl, tokens, req, avoid, n_avoid, &prev, route, err, errlen);
    if (rc == TDM_OK && old->cfg)
        route_finish(ctl, old, "error"); // its endpoints went back in attempt_begin
    return rc;
}

void tdm_router_control_route_sent(struct tdm_router_control *ctl, const struct tdm_router_route *r)
{
    if (!r || !r->decode_held_)
        return;
    tdm_router_metrics_pick(mx(ctl), r->decode.name, TDM_ROUTER_ROLE_DECODE);
    if (r->prefill_held_)
        tdm_router_metrics_pick(mx(ctl), r->prefill[r->prefill_idx].name, TDM_ROUTER_ROLE_PREFILL);
}

void tdm_router_control_route_unsent(struct tdm_router_control *ctl,
                                     const struct tdm_router_route *r)
{
    if (r && r->decode_held_)
        tdm_router_metrics_fallback(mx(ctl), r->decode.name, TDM_ROUTER_ROLE_DECODE);
}

void tdm_router_control_prefill_outcome(struct tdm_router_control *ctl,
                                        const struct tdm_router_route *r, bool remote)
{
    if (r->decision != TDM_ROUTER_DECISION_PREFILL_DECODE || remote || !mx(ctl))
        return;
    // Every prefill candidate failed: the decode worker prefilled locally.
    tdm_metrics_counter_inc(ctl->metrics.prefill_fallback);
    TDM_LOG_INFO(MOD, "remote prefill given up: local prefill on %s", r->decode.name);
}

void tdm_router_control_report(struct tdm_router_control *ctl, const struct tdm_router_target *t,
                               enum tdm_router_outcome outcome)
{
    if (!t || !t->id)
        return;
    tdm_router_endpoints_report(ctl->eps, t->id, outcome);
    if (outcome != TDM_ROUTER_OUTCOME_SUCCESS)
        tdm_router_metrics_upstream_error(mx(ctl), t->name, t->role,
                                          outcome == TDM_ROUTER_OUTCOME_TIMEOUT);
}

// route_done and route_done_report: one registry entry (attempt_end) when
// the route holds endpoints or reports, none otherwise.
static void route_done_with(struct tdm_router_control *ctl, struct tdm_router_route *r,
                            const char *status, bool report, enum tdm_router_outcome outcome)
{
    if (!r)
        return;
    struct tdm_router_give_back end = route_end_of(ctl, r, report, outcome);
    if (end.report || end.release[0] || end.release[1])
        tdm_router_endpoints_attempt_end(ctl->eps, &end);
    if (!r->cfg) {
        memset(r, 0, sizeof *r);
        return;
    }
    route_finish(ctl, r, status);
    tdm_router_flow_kick(ctl->flow); // its endpoints have room again
}

void tdm_router_control_route_done(struct tdm_router_control *ctl, struct tdm_router_route *r,
                                   const char *status)
{
    route_done_with(ctl, r, status, false, TDM_ROUTER_OUTCOME_SUCCESS);
}

void tdm_router_control_route_done_report(struct tdm_router_control *ctl,
                                          struct tdm_router_route *r, const char *status,
                                          enum tdm_router_outcome outcome)
{
    route_done_with(ctl, r, status, true, outcome);
}

int tdm_router_control_reload(struct tdm_router_control *ctl, char *err, size_t errlen)
{
    return tdm_router_config_store_reload(ctl->store, err, errlen);
}

char *tdm_router_control_config_json(struct tdm_router_control *ctl)
{
    cJSON *o = tdm_router_config_store_json_object_(ctl->store);
    if (!o)
        return NULL;
    size_t n = 0;
    struct tdm_router_endpoint_view *v = list_endpoints(ctl, &n);
    if (!v) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON *arr = cJSON_AddArrayToObject(o, "endpoints_state");
    for (size_t i = 0; arr && i < n; i++) {
        cJSON *e = cJSON_CreateObject();
        if (!e)
            break;
        cJSON_AddItemToArray(arr, e);
        cJSON_AddStringToObject(e, "name", v[i].name);
        cJSON_AddStringToObject(
            e, "role",
            v[i].role == TDM_ROUTER_ROLE_NONE ? "none" : tdm_router_role_name(v[i].role));
        cJSON_AddNumberToObject(e, "nng_port", v[i].nng_port);
        cJSON_AddBoolToObject(e, "healthy", v[i].healthy);
        if (v[i].unhealthy_reason)
            cJSON_AddStringToObject(e, "unhealthy_reason", v[i].unhealthy_reason);
        else
            cJSON_AddNullToObject(e, "unhealthy_reason");
        cJSON_AddBoolToObject(e, "not_up", v[i].not_up); // healthy or not: no candidate
        cJSON_AddBoolToObject(e, "draining", v[i].draining);
        cJSON_AddBoolToObject(e, "busy", v[i].busy);
        cJSON_AddNumberToObject(e, "inflight", v[i].inflight);
        cJSON_AddNumberToObject(e, "unreported", v[i].unreported);
        cJSON_AddNumberToObject(e, "health_epoch", (double)v[i].health_epoch);
        if (v[i].has_load) {
            cJSON *l = cJSON_AddObjectToObject(e, "load");
            if (l) {
                cJSON_AddNumberToObject(l, "running", v[i].load.running);
                cJSON_AddNumberToObject(l, "waiting", v[i].load.waiting);
                cJSON_AddNumberToObject(l, "max_running", v[i].load.max_running);
                cJSON_AddNumberToObject(l, "kv_usage", v[i].load.kv_usage);
                cJSON_AddNumberToObject(l, "age_seconds", v[i].load_age_seconds);
                cJSON_AddBoolToObject(l, "stale", v[i].load_stale);
            }
        } else {
            cJSON_AddNullToObject(e, "load");
        }
        cJSON_AddNumberToObject(e, "prefix_blocks",
                                (double)tdm_router_endpoints_prefix_size(ctl->eps, v[i].id));
    }
    free(v);
    struct tdm_router_flow_stats fs;
    tdm_router_flow_stats(ctl->flow, &fs);
    cJSON *fl = cJSON_AddObjectToObject(o, "flow_control_state");
    if (fl) {
        cJSON_AddNumberToObject(fl, "queued", (double)fs.queued);
        cJSON_AddNumberToObject(fl, "queued_bytes", (double)fs.bytes);
        cJSON_AddNumberToObject(fl, "pool_saturation", pool_saturation(ctl));
    }
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}
