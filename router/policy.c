// SPDX-License-Identifier: Apache-2.0
// router policy: the scheduling cycle of policy.h as pure functions. Each
// profile run works in a fixed-size scratch on the stack for up to
// POLICY_MAX_EPS endpoints (more are ignored beyond that, with a warning once
// per snapshot size: a router with thousands of workers needs a different
// data structure anyway). Random choices come from a splitmix64 stream seeded
// by the snapshot's seed and the profile, so the same snapshot replays the same
// pick, while consecutive snapshots spread ties uniformly (llm-d-router#2515:
// deterministic tie-breaking sent bursts to one pod).
#include "policy.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define MOD "router-policy"
#define POLICY_MAX_EPS 256

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

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform double in [0, 1).
static double rand01(uint64_t *s)
{
    return (double)(splitmix64(s) >> 11) * (1.0 / 9007199254740992.0);
}

bool tdm_router_policy_saturated(const struct tdm_router_plugin_params *p,
                                 const struct tdm_router_endpoint_view *ep)
{
    if (!ep->has_load || ep->load_stale)
        return true; // llm-d: metrics we cannot trust count as saturated
    double q_limit = p->queue_depth_threshold * (1.0 + p->headroom);
    double kv_limit = p->kv_cache_util_threshold * (1.0 + p->headroom);
    return ep->load.waiting > q_limit || ep->load.kv_usage > kv_limit;
}

// ---- session tokens (base64 of the endpoint name, as llm-d) -----------------------------------

static const char b64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

size_t tdm_router_session_token(const char *endpoint_name, char *buf, size_t cap)
{
    size_t n = strlen(endpoint_name), need = (n + 2) / 3 * 4;
    if (cap < need + 1) {
        if (cap)
            buf[0] = '\0';
        return 0;
    }
    const unsigned char *s = (const unsigned char *)endpoint_name;
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)s[i] << 16;
        if (i + 1 < n)
            v |= (uint32_t)s[i + 1] << 8;
        if (i + 2 < n)
            v |= s[i + 2];
        buf[o++] = b64[(v >> 18) & 63];
        buf[o++] = b64[(v >> 12) & 63];
        buf[o++] = i + 1 < n ? b64[(v >> 6) & 63] : '=';
        buf[o++] = i + 2 < n ? b64[v & 63] : '=';
    }
    buf[o] = '\0';
    return o;
}

static int b64_val(char c)
{
    const char *p = c ? strchr(b64, c) : NULL;
    return p ? (int)(p - b64) : -1;
}

// Decodes standard base64 into out (NUL-terminated); false when s is not base64.
static bool b64_decode(const char *s, char *out, size_t cap)
{
    size_t n = strlen(s), o = 0;
    if (n == 0 || n % 4 || n / 4 * 3 >= cap)
        return false;
    for (size_t i = 0; i < n; i += 4) {
        int v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = s[i + k] == '=' && i + 4 == n && k >= 2 ? 0 : b64_val(s[i + k]);
            if (v[k] < 0)
                return false;
        }
        uint32_t w =
            (uint32_t)v[0] << 18 | (uint32_t)v[1] << 12 | (uint32_t)v[2] << 6 | (uint32_t)v[3];
        out[o++] = (char)(w >> 16);
        if (s[i + 2] != '=')
            out[o++] = (char)(w >> 8 & 0xff);
        if (s[i + 3] != '=')
            out[o++] = (char)(w & 0xff);
    }
    out[o] = '\0';
    return strlen(out) == o; // no embedded NUL
}

// FNV-1a of the session and the endpoint name: rendezvous (highest random
// weight) hashing, so a session maps to the same endpoint while it exists and
// only the sessions of a removed endpoint move.
static uint64_t rendezvous(const char *session, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *p = session; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    h = (h ^ 0xff) * 0x100000001b3ull;
    for (const char *p = name; *p; p++)
        h = (h ^ (unsigned char)*p) * 0x100000001b3ull;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    return h;
}

// ---- one profile
// ----------------------------------------------------------------------------------

static bool role_fits(bool decode, enum tdm_router_role role)
{
    return decode ? tdm_router_role_can_decode(role) : tdm_router_role_can_prefill(role);
}

// Min-max normalised "less is better" score of value among candidates.
static double minmax_low(double v, double lo, double hi)
{
    return hi > lo ? (hi - v) / (hi - lo) : 1.0;
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
    const struct tdm_router_profile *pr = &cfg->profiles[profile];
    size_t n = snap->n < POLICY_MAX_EPS ? snap->n : POLICY_MAX_EPS;
    if (snap->n > POLICY_MAX_EPS)
        TDM_LOG_WARN(MOD, "%zu endpoints: only the first %d are considered", snap->n,
                     POLICY_MAX_EPS);
    size_t cand[POLICY_MAX_EPS], nc = 0;
    double total[POLICY_MAX_EPS];

    if (scores)
        for (size_t i = 0; i < snap->n; i++) {
            scores[i].ep = i;
            scores[i].total = NAN;
            scores[i].filtered = true;
            for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++)
                scores[i].scores[t] = NAN;
        }
    // Role and health first: an unhealthy endpoint is never picked.
    for (size_t i = 0; i < n; i++) {
        const struct tdm_router_endpoint_view *e = &snap->eps[i];
        if (i != exclude && e->healthy && !e->draining && role_fits(decode, e->role))
            cand[nc++] = i;
    }
    // Filters in profile order.
    for (size_t r = 0; r < pr->n_refs && nc > 0; r++) {
        const struct tdm_router_plugin *pl = &cfg->plugins[pr->refs[r].plugin];
        if (tdm_router_plugin_type_kind(pl->type) != TDM_ROUTER_PLUGIN_FILTER)
            continue;
        size_t keep[POLICY_MAX_EPS], nk = 0;
        for (size_t k = 0; k < nc; k++) {
            const struct tdm_router_endpoint_view *e = &snap->eps[cand[k]];
            bool ok = true;
            switch (pl->type) {
            case TDM_ROUTER_DECODE_FILTER:
                ok = tdm_router_role_can_decode(e->role);
                break;
            case TDM_ROUTER_PREFILL_FILTER:
                ok = tdm_router_role_can_prefill(e->role);
                break;
            case TDM_ROUTER_HEALTH_FILTER:
                ok = e->healthy;
                break;
            case TDM_ROUTER_UTILIZATION_DETECTOR:
                ok = !tdm_router_policy_saturated(&pl->params, e);
                break;
            default:
                break;
            }
            if (ok)
                keep[nk++] = cand[k];
        }
        if (nk == 0 && pl->type == TDM_ROUTER_UTILIZATION_DETECTOR) {
            // Fail open: all saturated means queue somewhere rather than reject.
            if (fail_open)
                *fail_open = true;
            continue;
        }
        memcpy(cand, keep, nk * sizeof *keep);
        nc = nk;
    }
    if (nc == 0)
        return TDM_EBUSY;

    // Scorers: the weighted sum of scores in [0, 1].
    double lo_w = INFINITY, hi_w = -INFINITY, lo_r = INFINITY, hi_r = -INFINITY;
    for (size_t k = 0; k < nc; k++) {
        const struct tdm_router_endpoint_view *e = &snap->eps[cand[k]];
        lo_w = fmin(lo_w, e->load.waiting);
        hi_w = fmax(hi_w, e->load.waiting);
        lo_r = fmin(lo_r, e->load.running);
        hi_r = fmax(hi_r, e->load.running);
        total[k] = 0.0;
    }
    // Session affinity target: the endpoint the token names, else rendezvous.
    size_t session_target = SIZE_MAX;
    bool has_session_scorer = false;
    for (size_t r = 0; r < pr->n_refs; r++)
        has_session_scorer |=
            cfg->plugins[pr->refs[r].plugin].type == TDM_ROUTER_SESSION_AFFINITY_SCORER;
    if (has_session_scorer && req && req->session && *req->session) {
        char named[TDM_ROUTER_NAME_MAX + 4];
        bool decoded = b64_decode(req->session, named, sizeof named);
        for (size_t k = 0; k < nc && session_target == SIZE_MAX; k++) {
            const char *nm = snap->eps[cand[k]].name;
            if ((decoded && !strcmp(named, nm)) || !strcmp(req->session, nm))
                session_target = cand[k];
        }
        if (session_target == SIZE_MAX) {
            uint64_t best = 0;
            for (size_t k = 0; k < nc; k++) {
                uint64_t h = rendezvous(req->session, snap->eps[cand[k]].name);
                if (session_target == SIZE_MAX || h > best) {
                    best = h;
                    session_target = cand[k];
                }
            }
        }
    }
    for (size_t r = 0; r < pr->n_refs; r++) {
        const struct tdm_router_plugin *pl = &cfg->plugins[pr->refs[r].plugin];
        if (tdm_router_plugin_type_kind(pl->type) != TDM_ROUTER_PLUGIN_SCORER)
            continue;
        double w = pr->refs[r].weight;
        for (size_t k = 0; k < nc; k++) {
            const struct tdm_router_endpoint_view *e = &snap->eps[cand[k]];
            double s = 0.0;
            switch (pl->type) {
            case TDM_ROUTER_QUEUE_SCORER:
                s = minmax_low(e->load.waiting, lo_w, hi_w);
                break;
            case TDM_ROUTER_KV_CACHE_UTIL_SCORER:
                s = 1.0 - fmin(1.0, fmax(0.0, e->load.kv_usage));
                break;
            case TDM_ROUTER_RUNNING_SCORER:
                s = minmax_low(e->load.running, lo_r, hi_r);
                break;
            case TDM_ROUTER_PREFIX_CACHE_SCORER: {
                size_t denom = snap->n_request_blocks;
                if (denom > (size_t)cfg->max_prefix_blocks_to_match)
                    denom = (size_t)cfg->max_prefix_blocks_to_match;
                s = denom ? fmin(1.0, (double)e->prefix_match_blocks / (double)denom) : 0.0;
                break;
            }
            case TDM_ROUTER_LOAD_AWARE_SCORER:
                s = e->load.waiting <= 0
                        ? 0.5
                        : 0.5 * (1.0 - fmin(1.0, (double)e->load.waiting /
                                                     (double)pl->params.load_threshold));
                break;
            case TDM_ROUTER_SESSION_AFFINITY_SCORER:
                s = cand[k] == session_target ? 1.0 : 0.0;
                break;
            case TDM_ROUTER_ACTIVE_REQUEST_SCORER:
                s = 1.0 - fmin(1.0, (double)e->inflight / (double)pl->params.max_busy_requests);
                break;
            default:
                break;
            }
            total[k] += w * s;
            if (scores)
                scores[cand[k]].scores[pl->type] = s;
        }
    }
    if (scores)
        for (size_t k = 0; k < nc; k++) {
            scores[cand[k]].filtered = false;
            scores[cand[k]].total = total[k];
        }

    // Picker: order the candidates (the first is the pick, the rest the retry order).
    uint64_t rng =
        snap->seed ^ (decode ? 0x6465636f6465ull : 0x70726566696c6cull) ^ ((uint64_t)profile << 48);
    enum tdm_router_plugin_type picker = pr->picker < pr->n_refs
                                             ? cfg->plugins[pr->refs[pr->picker].plugin].type
                                             : TDM_ROUTER_MAX_SCORE_PICKER;
    size_t order[POLICY_MAX_EPS];
    for (size_t k = 0; k < nc; k++)
        order[k] = k;
    switch (picker) {
    case TDM_ROUTER_ROUND_ROBIN_PICKER: {
        size_t start = (size_t)(snap->seq % nc);
        for (size_t k = 0; k < nc; k++)
            order[k] = (start + k) % nc;
        break;
    }
    case TDM_ROUTER_RANDOM_PICKER:
        for (size_t k = nc; k > 1; k--) { // Fisher-Yates
            size_t j = (size_t)(splitmix64(&rng) % k);
            size_t t = order[k - 1];
            order[k - 1] = order[j];
            order[j] = t;
        }
        break;
    case TDM_ROUTER_WEIGHTED_RANDOM_PICKER: {
        // Draw without replacement, probability proportional to the total
        // (uniform when every total is 0).
        double wsum = 0.0;
        for (size_t k = 0; k < nc; k++)
            wsum += fmax(0.0, total[k]);
        for (size_t m = 0; m < nc; m++) {
            size_t pick = m;
            if (wsum > 0) {
                double x = rand01(&rng) * wsum;
                for (size_t k = m; k < nc; k++) {
                    double wk = fmax(0.0, total[order[k]]);
                    pick = k;
                    if (x < wk)
                        break;
                    x -= wk;
                }
                // Rounding may walk past the last positive weight.
                while (pick > m && fmax(0.0, total[order[pick]]) <= 0.0)
                    pick--;
            } else {
                pick = m + (size_t)(splitmix64(&rng) % (nc - m));
            }
            size_t t = order[m];
            order[m] = order[pick];
            order[pick] = t;
            wsum -= fmax(0.0, total[order[m]]);
            if (wsum < 1e-12)
                wsum = 0.0;
        }
        break;
    }
    default: {
        // max-score: descending total, ties in random order (insertion sort on a
        // random key; nc is small).
        uint64_t key[POLICY_MAX_EPS];
        for (size_t k = 0; k < nc; k++)
            key[k] = splitmix64(&rng);
        for (size_t a = 1; a < nc; a++) {
            size_t v = order[a], b = a;
            while (b > 0) {
                size_t u = order[b - 1];
                double d = total[v] - total[u];
                bool before = d > 1e-9 || (fabs(d) <= 1e-9 && key[v] < key[u]);
                if (!before)
                    break;
                order[b] = u;
                b--;
            }
            order[b] = v;
        }
        break;
    }
    }
    size_t m = nc < cap ? nc : cap;
    for (size_t k = 0; k < m; k++)
        ranked[k] = cand[order[k]];
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
    if (cfg->prefill_profile != SIZE_MAX && prompt > 0) {
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
