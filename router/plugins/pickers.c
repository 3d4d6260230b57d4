// SPDX-License-Identifier: Apache-2.0
// router plugins, pickers: order a profile's candidates by their totals; the
// first is the pick, the rest the retry order (the prefill candidates a decode
// worker may try). Random choices come from the profile run's splitmix64
// stream (pick_ctx.rng), so a snapshot replays the same order while
// consecutive snapshots spread ties uniformly (llm-d-router#2515: deterministic
// tie-breaking sent bursts to one pod).
//
// maxNumOfEndpoints: llm-d's pickers hand the gateway that many endpoints. The
// router sends a request to one decode endpoint per route (a retry routes
// again) and bounds prefill candidates with request.prefill_retries, so only 1
// is accepted: a config that asks for more fails with a message saying so,
// rather than parsing a knob that would do nothing.
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "plugins.h"

#define NO TDM_ROUTER_PARAM_NO_FIELD

// Uniform double in [0, 1).
static double rand01(uint64_t *s)
{
    return (double)(tdm_router_splitmix64(s) >> 11) * (1.0 / 9007199254740992.0);
}

static void swap(size_t *order, size_t a, size_t b)
{
    size_t t = order[a];
    order[a] = order[b];
    order[b] = t;
}

// Descending total, ties in random order (insertion sort on a random key; the
// candidates are few).
static void pick_max_score(const struct tdm_router_pick_ctx *ctx, size_t *order)
{
    size_t nc = ctx->nc;
    uint64_t key[TDM_ROUTER_POLICY_MAX_EPS];
    for (size_t k = 0; k < nc; k++)
        key[k] = tdm_router_splitmix64(ctx->rng);
    for (size_t a = 1; a < nc; a++) {
        size_t v = order[a], b = a;
        while (b > 0) {
            size_t u = order[b - 1];
            double d = ctx->total[v] - ctx->total[u];
            bool before = d > 1e-9 || (fabs(d) <= 1e-9 && key[v] < key[u]);
            if (!before)
                break;
            order[b] = u;
            b--;
        }
        order[b] = v;
    }
}

// Fisher-Yates.
static void pick_random(const struct tdm_router_pick_ctx *ctx, size_t *order)
{
    for (size_t k = ctx->nc; k > 1; k--)
        swap(order, k - 1, (size_t)(tdm_router_splitmix64(ctx->rng) % k));
}

// Draws without replacement, probability proportional to the total (uniform
// when every total is 0).
static void pick_weighted_random(const struct tdm_router_pick_ctx *ctx, size_t *order)
{
    size_t nc = ctx->nc;
    const double *total = ctx->total;
    double wsum = 0.0;
    for (size_t k = 0; k < nc; k++)
        wsum += fmax(0.0, total[k]);
    for (size_t m = 0; m < nc; m++) {
        size_t pick = m;
        if (wsum > 0) {
            double x = rand01(ctx->rng) * wsum;
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
            pick = m + (size_t)(tdm_router_splitmix64(ctx->rng) % (nc - m));
        }
        swap(order, m, pick);
        wsum -= fmax(0.0, total[order[m]]);
        if (wsum < 1e-12)
            wsum = 0.0;
    }
}

// Rotates over the candidates, one step per snapshot (the registry's pick
// sequence number).
static void pick_round_robin(const struct tdm_router_pick_ctx *ctx, size_t *order)
{
    size_t start = (size_t)(ctx->snap->seq % ctx->nc);
    for (size_t k = 0; k < ctx->nc; k++)
        order[k] = (start + k) % ctx->nc;
}

static const struct tdm_router_param picker_params[] = {
    {"maxNumOfEndpoints", TDM_ROUTER_PARAM_INT, NO, 1, 1, 1, NULL, TDM_ROUTER_PARAM_HIDDEN, NO,
     "only 1 is supported: the router sends a request to one endpoint per profile "
     "(request.prefill_retries bounds the prefill workers a decode worker may try)"},
};

#define PICKER(sym, nm, fn)                                                                        \
    const struct tdm_router_plugin_ops sym = {                                                     \
        .name = nm,                                                                                \
        .kind = TDM_ROUTER_PLUGIN_PICKER,                                                          \
        .params = picker_params,                                                                   \
        .n_params = sizeof picker_params / sizeof picker_params[0],                                \
        .pick = fn,                                                                                \
    }

PICKER(tdm_router_max_score_picker_ops, "max-score-picker", pick_max_score);
PICKER(tdm_router_random_picker_ops, "random-picker", pick_random);
PICKER(tdm_router_weighted_random_picker_ops, "weighted-random-picker", pick_weighted_random);
PICKER(tdm_router_round_robin_picker_ops, "round-robin-picker", pick_round_robin);
