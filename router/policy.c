// SPDX-License-Identifier: Apache-2.0
// router policy: the scheduling cycle of policy.h as pure functions. A profile
// run is a loop over the plugins the profile lists, calling each one's ops
// table (router/plugins/): filters in order, then every scorer weighted into a
// total, then the picker's ordering. It works in a fixed-size scratch on the
// stack for up to TDM_ROUTER_POLICY_MAX_EPS endpoints (more are ignored, with a
// warning). Random choices come from a splitmix64 stream seeded by the
// snapshot's seed and the profile, so the same snapshot replays the same pick.
#include "policy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "plugins/plugins.h"

#define MOD "router-policy"

const char *tdm_router_decision_name(enum tdm_router_decision d)
{
    switch (d) {
    case TDM_ROUTER_DECISION_DECODE_ONLY:
        return "decode-only";
    case TDM_ROUTER_DECISION_PREFILL_DECODE:
        return "prefill-decode";
    }
    return "unknown";
}

// ---- one profile (llm-d's scheduling cycle) ----------------------------------------------------

static bool role_fits(bool decode, enum tdm_router_role role)
{
    return decode ? tdm_router_role_can_decode(role) : tdm_router_role_can_prefill(role);
}

// One profile run's working set, on the stack.
struct run {
    const struct tdm_router_config *cfg;
    const struct tdm_router_profile *pr;
    const struct tdm_router_snapshot *snap;
    size_t cand[TDM_ROUTER_POLICY_MAX_EPS]; // snapshot indices still in the running
    size_t nc;
    double total[TDM_ROUTER_POLICY_MAX_EPS]; // [nc] weighted score sums
};

static const struct tdm_router_plugin *ref_plugin(const struct run *r, size_t i)
{
    return &r->cfg->plugins[r->pr->refs[i].plugin];
}

// Role, health and readiness first (an unhealthy endpoint, or one not up:
// never heard from with its control link down, is never picked:
// tdm_router_endpoint_ready), then the profile's filters in order.
static void run_filters(struct run *r, bool decode, size_t exclude, bool *fail_open)
{
    const struct tdm_router_snapshot *snap = r->snap;
    size_t n = snap->n < TDM_ROUTER_POLICY_MAX_EPS ? snap->n : TDM_ROUTER_POLICY_MAX_EPS;
    if (snap->n > TDM_ROUTER_POLICY_MAX_EPS)
        TDM_LOG_WARN(MOD, "%zu endpoints: only the first %d are considered", snap->n,
                     TDM_ROUTER_POLICY_MAX_EPS);
    r->nc = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_router_endpoint_view *e = &snap->eps[i];
        if (i != exclude && tdm_router_endpoint_ready(e) && role_fits(decode, e->role))
            r->cand[r->nc++] = i;
    }
    for (size_t f = 0; f < r->pr->n_refs && r->nc > 0; f++) {
        const struct tdm_router_plugin *pl = ref_plugin(r, f);
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(pl->type);
        if (ops->kind != TDM_ROUTER_PLUGIN_FILTER)
            continue;
        size_t keep[TDM_ROUTER_POLICY_MAX_EPS], nk = 0;
        for (size_t k = 0; k < r->nc; k++)
            if (ops->keep(&pl->params, &snap->eps[r->cand[k]]))
                keep[nk++] = r->cand[k];
        if (nk == 0 && ops->fail_open) {
            if (fail_open)
                *fail_open = true;
            continue;
        }
        memcpy(r->cand, keep, nk * sizeof *keep);
        r->nc = nk;
    }
}

// Every scorer of the profile, weighted, into r->total.
static void run_scorers(struct run *r, const struct tdm_router_request *req, size_t decode,
                        struct tdm_router_endpoint_score *scores)
{
    struct tdm_router_score_ctx ctx = {
        .snap = r->snap,
        .req = req,
        .cand = r->cand,
        .nc = r->nc,
        .decode = decode < r->snap->n ? &r->snap->eps[decode] : NULL,
        .lo_waiting = INFINITY,
        .hi_waiting = -INFINITY,
        .lo_running = INFINITY,
        .hi_running = -INFINITY,
        .max_prefix_blocks = r->cfg->max_prefix_blocks_to_match,
        .session_target = SIZE_MAX,
    };
    for (size_t k = 0; k < r->nc; k++) {
        const struct tdm_router_endpoint_view *e = &r->snap->eps[r->cand[k]];
        ctx.lo_waiting = fmin(ctx.lo_waiting, tdm_router_queue_estimate(e));
        ctx.hi_waiting = fmax(ctx.hi_waiting, tdm_router_queue_estimate(e));
        ctx.lo_running = fmin(ctx.lo_running, e->load.running);
        ctx.hi_running = fmax(ctx.hi_running, e->load.running);
        r->total[k] = 0.0;
    }
    for (size_t i = 0; i < r->pr->n_refs; i++) {
        const struct tdm_router_plugin *pl = ref_plugin(r, i);
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(pl->type);
        if (ops->kind != TDM_ROUTER_PLUGIN_SCORER)
            continue;
        if (ops->prepare)
            ops->prepare(&ctx);
        double w = r->pr->refs[i].weight;
        for (size_t k = 0; k < r->nc; k++) {
            double s = ops->score(&ctx, &pl->params, k);
            r->total[k] += w * s;
            if (scores)
                scores[r->cand[k]].scores[pl->type] = s;
        }
    }
    for (size_t k = 0; scores && k < r->nc; k++) {
        scores[r->cand[k]].filtered = false;
        scores[r->cand[k]].total = r->total[k];
    }
}

static int run_profile(const struct tdm_router_config *cfg, size_t profile, bool decode,
                       const struct tdm_router_snapshot *snap, const struct tdm_router_request *req,
                       size_t exclude, size_t *ranked, size_t cap, size_t *n_ranked,
                       struct tdm_router_endpoint_score *scores, bool *fail_open)
{
    *n_ranked = 0;
    if (fail_open)
        *fail_open = false;
    if (profile >= cfg->n_profiles)
        return TDM_EINVAL;
    struct run r = {.cfg = cfg, .pr = &cfg->profiles[profile], .snap = snap};
    for (size_t i = 0; scores && i < snap->n; i++) {
        scores[i].ep = i;
        scores[i].total = NAN;
        scores[i].filtered = true;
        for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++)
            scores[i].scores[t] = NAN;
    }
    run_filters(&r, decode, exclude, fail_open);
    if (r.nc == 0)
        return TDM_EBUSY;
    run_scorers(&r, req, decode ? SIZE_MAX : exclude, scores);

    // The picker orders the candidates: the first is the pick, the rest the retry order.
    uint64_t rng =
        snap->seed ^ (decode ? 0x6465636f6465ull : 0x70726566696c6cull) ^ ((uint64_t)profile << 48);
    const struct tdm_router_plugin_ops *picker =
        r.pr->picker < r.pr->n_refs ? tdm_router_plugin_ops_of(ref_plugin(&r, r.pr->picker)->type)
                                    : &tdm_router_max_score_picker_ops;
    size_t order[TDM_ROUTER_POLICY_MAX_EPS];
    for (size_t k = 0; k < r.nc; k++)
        order[k] = k;
    struct tdm_router_pick_ctx pctx = {.snap = snap, .total = r.total, .nc = r.nc, .rng = &rng};
    picker->pick(&pctx, order);
    size_t m = r.nc < cap ? r.nc : cap;
    for (size_t k = 0; k < m; k++)
        ranked[k] = r.cand[order[k]];
    *n_ranked = m;
    return TDM_OK;
}

int tdm_router_policy_run_profile(const struct tdm_router_config *cfg, size_t profile, bool decode,
                                  const struct tdm_router_snapshot *snap,
                                  const struct tdm_router_request *req, size_t *ranked, size_t cap,
                                  size_t *n_ranked, struct tdm_router_endpoint_score *scores,
                                  bool *fail_open)
{
    return run_profile(cfg, profile, decode, snap, req, SIZE_MAX, ranked, cap, n_ranked, scores,
                       fail_open);
}

int tdm_router_policy_pick(const struct tdm_router_config *cfg,
                           const struct tdm_router_snapshot *snap,
                           const struct tdm_router_request *req, struct tdm_router_pick *pick)
{
    struct tdm_router_endpoint_score *ds = pick->decode_scores, *ps = pick->prefill_scores;
    memset(pick, 0, sizeof *pick);
    pick->decode_scores = ds;
    pick->prefill_scores = ps;
    pick->decode = SIZE_MAX;
    pick->decision = TDM_ROUTER_DECISION_DECODE_ONLY;
    size_t ranked[1], nr = 0;
    bool fo = false;
    int rc =
        run_profile(cfg, cfg->decode_profile, true, snap, req, SIZE_MAX, ranked, 1, &nr, ds, &fo);
    pick->fail_open = fo;
    if (rc)
        return rc;
    pick->decode = ranked[0];
    size_t prompt = req ? req->num_prompt_tokens : 0;
    size_t cached =
        (size_t)snap->eps[pick->decode].prefix_match_blocks * (size_t)cfg->block_size_tokens;
    // The decode worker always computes at least the last prompt token itself.
    if (cached >= prompt)
        cached = prompt ? prompt - 1 : 0;
    pick->cached_tokens = cached;
    pick->uncached_tokens = prompt - cached;

    bool disagg = false;
    if (cfg->prefill_profile != SIZE_MAX && prompt > 0 && !(req && req->decode_only)) {
        if (cfg->pd_mode == TDM_ROUTER_PD_ALWAYS)
            disagg = true;
        else if (cfg->pd_mode == TDM_ROUTER_PD_PREFIX)
            disagg = pick->uncached_tokens > (size_t)cfg->pd_threshold_tokens;
    }
    if (!disagg)
        return TDM_OK;
    // The decode endpoint itself (a prefill-decode worker) is no remote prefill.
    size_t pr[TDM_ROUTER_MAX_PREFILL_CANDIDATES], np = 0;
    bool pfo = false;
    rc = run_profile(cfg, cfg->prefill_profile, false, snap, req, pick->decode, pr,
                     TDM_ROUTER_MAX_PREFILL_CANDIDATES, &np, ps, &pfo);
    if (rc || np == 0)
        return TDM_OK; // no prefill endpoint: the decode worker prefills locally
    pick->fail_open |= pfo;
    memcpy(pick->prefill, pr, np * sizeof *pr);
    pick->n_prefill = np;
    pick->decision = TDM_ROUTER_DECISION_PREFILL_DECODE;
    return TDM_OK;
}

size_t tdm_router_policy_format_scores(const struct tdm_router_config *cfg, size_t profile,
                                       const struct tdm_router_snapshot *snap,
                                       const struct tdm_router_endpoint_score *scores, char *buf,
                                       size_t cap)
{
    size_t o = 0;
    if (!cap)
        return 0;
    buf[0] = '\0';
    if (!scores || profile >= cfg->n_profiles)
        return 0;
    const struct tdm_router_profile *pr = &cfg->profiles[profile];
    for (size_t i = 0; i < snap->n && o < cap; i++) {
        const struct tdm_router_endpoint_score *s = &scores[i];
        int w = s->filtered
                    ? snprintf(buf + o, cap - o, "%s%s filtered", o ? "; " : "", snap->eps[i].name)
                    : snprintf(buf + o, cap - o, "%s%s total=%.3f", o ? "; " : "",
                               snap->eps[i].name, s->total);
        if (w < 0)
            break;
        o += (size_t)w;
        for (size_t r = 0; !s->filtered && r < pr->n_refs && o < cap; r++) {
            enum tdm_router_plugin_type t = cfg->plugins[pr->refs[r].plugin].type;
            if (tdm_router_plugin_type_kind(t) != TDM_ROUTER_PLUGIN_SCORER || isnan(s->scores[t]))
                continue;
            w = snprintf(buf + o, cap - o, " %s=%.3f", tdm_router_plugin_type_name(t),
                         s->scores[t]);
            if (w < 0)
                break;
            o += (size_t)w;
        }
    }
    if (o >= cap)
        o = cap - 1;
    return o;
}
