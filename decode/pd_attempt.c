// SPDX-License-Identifier: Apache-2.0
// pd_attempt: the remote-prefill attempt's state machine (see pd_attempt.h).
// One function per state; each returns the next state. The waits poll the
// caller's view (ops->view) and sleep in ops->wait between polls, so the same
// code runs on the receiver's condition variable and on a test's fake clock.
#include "pd_attempt.h"

#include <stdio.h>
#include <string.h>

#include "core.h"

const char *tdm_pd_attempt_why_name(enum tdm_pd_attempt_why why)
{
    switch (why) {
    case TDM_PD_WHY_UNREACHABLE:
        return "unreachable";
    case TDM_PD_WHY_PREFILL_ERROR:
        return "prefill_error";
    case TDM_PD_WHY_TRANSFER:
        return "transfer";
    case TDM_PD_WHY_DISCONNECTED:
        return "disconnected";
    case TDM_PD_WHY_TIMEOUT:
        return "timeout";
    case TDM_PD_WHY_HEADER:
        return "header";
    default:
        return "none";
    }
}

void tdm_pd_attempt_config_default(struct tdm_pd_attempt_config *cfg)
{
    cfg->probe_interval = 0.25;
    cfg->poll = 0.05;
    cfg->dial_timeout = 0.5;
    cfg->write_quarantine = 2.0;
}

size_t tdm_pd_attempt_budget(size_t n_listed, int max_attempts)
{
    return max_attempts > 0 && (size_t)max_attempts < n_listed ? (size_t)max_attempts : n_listed;
}

// ---- waiting -----------------------------------------------------------------------------
enum wait_end { WAIT_MET = 0, WAIT_STOPPED, WAIT_TIMEOUT, WAIT_DISCONNECTED };

typedef bool (*wait_pred)(const struct tdm_pd_attempt_view *v,
                          const struct tdm_pd_attempt_config *);

static bool result_or_kv_failed(const struct tdm_pd_attempt_view *v,
                                const struct tdm_pd_attempt_config *cfg)
{
    (void)cfg;
    return v->has_result || v->kv_failed;
}

static bool kv_complete(const struct tdm_pd_attempt_view *v,
                        const struct tdm_pd_attempt_config *cfg)
{
    return v->kv_failed || v->layers_done >= cfg->num_layers;
}

// Waits until pred holds on a fresh view (a->last), the job stops, `until`
// passes, or the worker is silent for prefill_liveness or disconnected for
// connect_grace (both measured from this wait's start).
static enum wait_end wait_for(struct tdm_pd_attempt *a, const struct tdm_pd_attempt_config *cfg,
                              const struct tdm_pd_attempt_ops *ops, void *ctx, wait_pred pred,
                              double until)
{
    double since = ops->now(ctx), down_since = 0, last_probe = -1e300;
    for (;;) {
        ops->view(ctx, &a->last);
        if (pred(&a->last, cfg))
            return WAIT_MET;
        double now = ops->now(ctx);
        if (a->last.stop)
            return WAIT_STOPPED;
        if (now > until)
            return WAIT_TIMEOUT;
        // A connected but hung worker (stopped, wedged) answers no load query.
        double heard = a->last.prefill_heard > since ? a->last.prefill_heard : since;
        if (now - heard > cfg->prefill_liveness)
            return WAIT_DISCONNECTED;
        if (now - last_probe >= cfg->probe_interval) {
            ops->send_probe(ctx);
            last_probe = now;
        }
        if (ops->connected(ctx))
            down_since = 0;
        else if (down_since == 0)
            down_since = now;
        else if (now - down_since > cfg->connect_grace)
            return WAIT_DISCONNECTED;
        ops->wait(ctx, cfg->poll);
    }
}

// Memory safety (see pd_attempt.h): returns once no in-place copy of this
// attempt can land in the reserved blocks: the worker said closed, a restart
// of it was seen, or its connection stayed down for write_quarantine. Neither
// the job's stop nor any timeout ends this wait: freeing the blocks earlier
// could let a late copy overwrite another request's KV.
static void drain_writes(struct tdm_pd_attempt *a, const struct tdm_pd_attempt_config *cfg,
                         const struct tdm_pd_attempt_ops *ops, void *ctx)
{
    double down_since = -1, last_probe = -1e300;
    for (;;) {
        ops->view(ctx, &a->last);
        double now = ops->now(ctx);
        if (!a->last.writes_open) {
            a->t_drained = now;
            return;
        }
        if (a->last.peer_restarted) {
            a->writes_abandoned = true;
            a->t_drained = now;
            return;
        }
        if (ops->connected(ctx))
            down_since = -1;
        else if (down_since < 0)
            down_since = now;
        else if (now - down_since >= cfg->write_quarantine) {
            a->writes_abandoned = true;
            a->t_drained = now;
            return;
        }
        if (now - last_probe >= cfg->probe_interval) {
            ops->send_probe(ctx); // a restarted worker answers with its new instance
            last_probe = now;
        }
        ops->wait(ctx, cfg->poll);
    }
}

// ---- states ------------------------------------------------------------------------------
static enum tdm_pd_attempt_state fail(struct tdm_pd_attempt *a, enum tdm_pd_attempt_why why,
                                      bool counted, const char *detail)
{
    a->failed_in = a->state;
    a->why = why;
    a->counted = counted;
    snprintf(a->detail, sizeof a->detail, "%s", detail);
    return TDM_PD_ATTEMPT_FAILED;
}

static enum tdm_pd_attempt_state on_send(struct tdm_pd_attempt *a,
                                         const struct tdm_pd_attempt_config *cfg,
                                         const struct tdm_pd_attempt_ops *ops, void *ctx)
{
    a->t_sent = ops->now(ctx);
    double timeout = cfg->send_timeout;
    if (!ops->connected(ctx) && timeout > cfg->dial_timeout)
        timeout = cfg->dial_timeout;
    char err[256];
    if (ops->send_prefill(ctx, timeout, err, sizeof err) != TDM_OK) {
        ops->retire(ctx);
        return fail(a, TDM_PD_WHY_UNREACHABLE, true, err);
    }
    return TDM_PD_ATTEMPT_AWAIT_RESULT;
}

static enum tdm_pd_attempt_state on_await_result(struct tdm_pd_attempt *a,
                                                 const struct tdm_pd_attempt_config *cfg,
                                                 const struct tdm_pd_attempt_ops *ops, void *ctx)
{
    enum wait_end end =
        wait_for(a, cfg, ops, ctx, result_or_kv_failed, a->t_sent + cfg->prefill_timeout);
    const struct tdm_pd_attempt_view *v = &a->last;
    bool error = v->has_result && v->result_error != 0;
    if (end != WAIT_MET || error || v->kv_failed) {
        ops->retire(ctx);
        enum tdm_pd_attempt_why why = error                      ? TDM_PD_WHY_PREFILL_ERROR
                                      : v->kv_failed             ? TDM_PD_WHY_TRANSFER
                                      : end == WAIT_DISCONNECTED ? TDM_PD_WHY_DISCONNECTED
                                                                 : TDM_PD_WHY_TIMEOUT;
        enum tdm_pd_attempt_state next = fail(a, why, !v->cancelled,
                                              error          ? v->result_message
                                              : v->kv_failed ? v->kv_err
                                                             : tdm_pd_attempt_why_name(why));
        ops->send_cancel(ctx, v->peer_instance);
        return next;
    }
    a->t_result = ops->now(ctx);
    char err[256];
    if (ops->check_result(ctx, err, sizeof err) != TDM_OK) {
        ops->retire(ctx);
        ops->send_cancel(ctx, v->peer_instance);
        return fail(a, TDM_PD_WHY_HEADER, true, err);
    }
    return TDM_PD_ATTEMPT_AWAIT_KV;
}

static enum tdm_pd_attempt_state on_await_kv(struct tdm_pd_attempt *a,
                                             const struct tdm_pd_attempt_config *cfg,
                                             const struct tdm_pd_attempt_ops *ops, void *ctx)
{
    enum wait_end end =
        wait_for(a, cfg, ops, ctx, kv_complete, a->t_result + cfg->transfer_timeout);
    ops->retire(ctx); // from here no frame touches the reserved blocks
    const struct tdm_pd_attempt_view *v = &a->last;
    if (end == WAIT_MET && !v->kv_failed)
        return TDM_PD_ATTEMPT_COMMITTED;
    char detail[256];
    if (v->kv_failed)
        snprintf(detail, sizeof detail, "%s", v->kv_err);
    else
        snprintf(detail, sizeof detail, "%s after %d of %d layers",
                 v->cancelled               ? "cancelled"
                 : end == WAIT_DISCONNECTED ? "prefill worker disconnected"
                                            : "transfer timed out",
                 v->layers_done, cfg->num_layers);
    enum tdm_pd_attempt_state next = fail(a, TDM_PD_WHY_TRANSFER, !v->cancelled, detail);
    ops->send_cancel(ctx, v->peer_instance);
    return next;
}

enum tdm_pd_attempt_state tdm_pd_attempt_run(struct tdm_pd_attempt *a,
                                             const struct tdm_pd_attempt_config *cfg,
                                             const struct tdm_pd_attempt_ops *ops, void *ctx)
{
    memset(a, 0, sizeof *a);
    a->state = TDM_PD_ATTEMPT_SEND;
    for (;;) {
        enum tdm_pd_attempt_state next;
        switch (a->state) {
        case TDM_PD_ATTEMPT_SEND:
            next = on_send(a, cfg, ops, ctx);
            break;
        case TDM_PD_ATTEMPT_AWAIT_RESULT:
            next = on_await_result(a, cfg, ops, ctx);
            break;
        case TDM_PD_ATTEMPT_AWAIT_KV:
            next = on_await_kv(a, cfg, ops, ctx);
            break;
        default:
            return a->state;
        }
        if (next == TDM_PD_ATTEMPT_FAILED)
            drain_writes(a, cfg, ops, ctx); // retired and cancelled: wait out in-place copies
        a->state = next;
        if (next == TDM_PD_ATTEMPT_COMMITTED)
            ops->commit(ctx, a);
    }
}
