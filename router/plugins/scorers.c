// SPDX-License-Identifier: Apache-2.0
// router plugins, scorers: each gives a candidate a score in [0, 1]; a
// profile's total is the weighted sum (policy.c). Load scores come from the
// workers' reports, the queue scores (queue-scorer, load-aware-scorer) adding
// the requests the router sent since the report (tdm_router_queue_estimate);
// the active-request score from the router's in-flight count; the prefix score
// from the router's prefix index (the snapshot's prefix_match_blocks); the
// session score from the session header: the endpoint an llm-d style token
// (base64 of its name) names, else the candidate a rendezvous hash of the
// session picks, so a session stays on one endpoint while it exists and only a
// removed endpoint's sessions move.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "plugins.h"

#define NO TDM_ROUTER_PARAM_NO_FIELD
#define FIELD(f) offsetof(struct tdm_router_plugin_params, f)
#define N(a) (sizeof(a) / sizeof(a)[0])

static const struct tdm_router_endpoint_view *cand_ep(const struct tdm_router_score_ctx *ctx,
                                                      size_t k)
{
    return &ctx->snap->eps[ctx->cand[k]];
}

// Min-max normalised "less is better" score of v among candidates.
static double minmax_low(double v, double lo, double hi)
{
    return hi > lo ? (hi - v) / (hi - lo) : 1.0;
}

// ---- load ------------------------------------------------------------------------------------
static double score_queue(const struct tdm_router_score_ctx *ctx,
                          const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    return minmax_low(tdm_router_queue_estimate(cand_ep(ctx, k)), ctx->lo_waiting, ctx->hi_waiting);
}

static double score_kv_util(const struct tdm_router_score_ctx *ctx,
                            const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    return 1.0 - fmin(1.0, fmax(0.0, cand_ep(ctx, k)->load.kv_usage));
}

static double score_running(const struct tdm_router_score_ctx *ctx,
                            const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    return minmax_low(cand_ep(ctx, k)->load.running, ctx->lo_running, ctx->hi_running);
}

// llm-d's load-aware scorer: 0.5 at an empty queue falling to 0 at threshold.
static double score_load_aware(const struct tdm_router_score_ctx *ctx,
                               const struct tdm_router_plugin_params *p, size_t k)
{
    double waiting = tdm_router_queue_estimate(cand_ep(ctx, k));
    if (waiting <= 0)
        return 0.5;
    return 0.5 * (1.0 - fmin(1.0, waiting / (double)p->load_aware.threshold));
}

static double score_active(const struct tdm_router_score_ctx *ctx,
                           const struct tdm_router_plugin_params *p, size_t k)
{
    return 1.0 - fmin(1.0, (double)cand_ep(ctx, k)->inflight /
                               (double)p->active_request.max_busy_requests);
}

// ---- prefix ----------------------------------------------------------------------------------
static double score_prefix(const struct tdm_router_score_ctx *ctx,
                           const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    size_t denom = ctx->snap->n_request_blocks;
    if (denom > (size_t)ctx->max_prefix_blocks)
        denom = (size_t)ctx->max_prefix_blocks;
    return denom ? fmin(1.0, (double)cand_ep(ctx, k)->prefix_match_blocks / (double)denom) : 0.0;
}

// ---- session affinity -------------------------------------------------------------------------
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

// FNV-1a of the session and the endpoint name, murmur-finished: rendezvous
// (highest random weight) hashing.
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

// The candidate the session sticks to: the one its token names, else rendezvous.
static void prepare_session(struct tdm_router_score_ctx *ctx)
{
    ctx->session_target = SIZE_MAX;
    const char *session = ctx->req ? ctx->req->session : NULL;
    if (!session || !*session)
        return;
    char named[TDM_ROUTER_NAME_MAX + 4];
    bool decoded = b64_decode(session, named, sizeof named);
    for (size_t k = 0; k < ctx->nc; k++) {
        const char *nm = cand_ep(ctx, k)->name;
        if ((decoded && !strcmp(named, nm)) || !strcmp(session, nm)) {
            ctx->session_target = ctx->cand[k];
            return;
        }
    }
    uint64_t best = 0;
    for (size_t k = 0; k < ctx->nc; k++) {
        uint64_t h = rendezvous(session, cand_ep(ctx, k)->name);
        if (ctx->session_target == SIZE_MAX || h > best) {
            best = h;
            ctx->session_target = ctx->cand[k];
        }
    }
}

static double score_session(const struct tdm_router_score_ctx *ctx,
                            const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    return ctx->cand[k] == ctx->session_target ? 1.0 : 0.0;
}

// ---- tables ------------------------------------------------------------------------------------
const struct tdm_router_plugin_ops tdm_router_queue_scorer_ops = {
    .name = "queue-scorer", .kind = TDM_ROUTER_PLUGIN_SCORER, .score = score_queue};

const struct tdm_router_plugin_ops tdm_router_kv_cache_util_scorer_ops = {
    .name = "kv-cache-utilization-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .score = score_kv_util};

const struct tdm_router_plugin_ops tdm_router_running_scorer_ops = {
    .name = "running-requests-size-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .score = score_running};

// The prefix index parameters; the approx-prefix-cache-producer takes the same
// (config.c copies them to the config's prefix_index).
const struct tdm_router_param tdm_router_prefix_index_params[TDM_ROUTER_N_PREFIX_INDEX_PARAMS] = {
    {"blockSizeTokens", TDM_ROUTER_PARAM_INT, FIELD(prefix_index.block_size_tokens), 1, 4096, 16,
     NULL, 0, NO, NULL},
    // llm-d's older prefix-cache-scorer spelled it blockSize.
    {"blockSize", TDM_ROUTER_PARAM_INT, FIELD(prefix_index.block_size_tokens), 1, 4096, 16, NULL,
     TDM_ROUTER_PARAM_HIDDEN, NO, NULL},
    {"maxPrefixBlocksToMatch", TDM_ROUTER_PARAM_INT, FIELD(prefix_index.max_prefix_blocks_to_match),
     1, 1000000, 256, NULL, 0, NO, NULL},
    {"lruCapacityPerServer", TDM_ROUTER_PARAM_INT, FIELD(prefix_index.lru_capacity_per_server), 1,
     100000000, 31250, NULL, 0, NO, NULL},
    // The router has no metrics scrape to tune from: only false is accepted.
    {"autoTune", TDM_ROUTER_PARAM_BOOL, NO, 0, 0, 0, NULL, TDM_ROUTER_PARAM_HIDDEN, NO,
     "not supported: set blockSizeTokens to the workers' block size"},
};

const struct tdm_router_plugin_ops tdm_router_prefix_cache_scorer_ops = {
    .name = "prefix-cache-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .params = tdm_router_prefix_index_params,
    .n_params = TDM_ROUTER_N_PREFIX_INDEX_PARAMS,
    .score = score_prefix,
};

static const struct tdm_router_param load_aware_params[] = {
    {"threshold", TDM_ROUTER_PARAM_INT, FIELD(load_aware.threshold), 1, 1000000, 128, NULL, 0, NO,
     NULL},
};

const struct tdm_router_plugin_ops tdm_router_load_aware_scorer_ops = {
    .name = "load-aware-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .params = load_aware_params,
    .n_params = N(load_aware_params),
    .score = score_load_aware,
};

static const struct tdm_router_param session_params[] = {
    {"headerName", TDM_ROUTER_PARAM_STRING, FIELD(session_affinity.header_name), 0, 0, 0,
     "x-session-token", TDM_ROUTER_PARAM_LOWER, NO, NULL},
};

const struct tdm_router_plugin_ops tdm_router_session_affinity_scorer_ops = {
    .name = "session-affinity-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .params = session_params,
    .n_params = N(session_params),
    .prepare = prepare_session,
    .score = score_session,
};

static const struct tdm_router_param active_params[] = {
    {"maxBusyRequests", TDM_ROUTER_PARAM_INT, FIELD(active_request.max_busy_requests), 1, 1000000,
     64, NULL, 0, NO, NULL},
};

const struct tdm_router_plugin_ops tdm_router_active_request_scorer_ops = {
    .name = "active-request-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .params = active_params,
    .n_params = N(active_params),
    .score = score_active,
};

// ---- colocation ------------------------------------------------------------------------------
// A prefill endpoint at the address of the decode endpoint already picked: the
// prefill container of the decode worker's own pod (overlays/gpu-one-pod: one
// GPU, KV over CUDA IPC instead of NCCL). 1 there, 0 elsewhere; 0 for every
// candidate of the decode profile (no decode endpoint picked yet).
static double score_colocation(const struct tdm_router_score_ctx *ctx,
                               const struct tdm_router_plugin_params *p, size_t k)
{
    (void)p;
    return ctx->decode && !strcmp(cand_ep(ctx, k)->host, ctx->decode->host) ? 1.0 : 0.0;
}

const struct tdm_router_plugin_ops tdm_router_colocation_scorer_ops = {
    .name = "colocation-scorer",
    .kind = TDM_ROUTER_PLUGIN_SCORER,
    .score = score_colocation,
};
