// SPDX-License-Identifier: Apache-2.0
// router flow: the flow control queues (flow.h). Every waiting request is one
// item on its handler thread's stack, linked in arrival order; the queue is at
// most the router's HTTP threads long (each waiter holds one), so the
// dispatch decision scans it: the highest priority present, then the band's
// fairness policy, then arrival order within the chosen flow.
#include "flow.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

#define FAIRNESS_MAX 128
// A waiter wakes at least this often to look at its client and its TTL, and
// to retry a dispatch (saturation also moves with time: reports age).
#define POLL_S 0.05
// Dispatch retries from polls at most this often (each costs a registry snapshot).
#define POLL_DISPATCH_S 0.01
// A token not given back within this long is taken as given back: a holder
// routes and sends in microseconds, but a send to a worker that stopped
// reading may block for its timeout, and the queue must not wait that long
// (the holder's late give-back is then ignored: token_gen).
#define TOKEN_MAX_S 0.25

enum item_state { QUEUED, DISPATCHED, EVICTED };

struct item {
    struct item *prev, *next; // f->head .. f->tail, arrival order
    int priority;
    enum tdm_router_plugin_type fairness; // its band's policy at its arrival
    char flow[FAIRNESS_MAX + 1];
    long long bytes;
    double enq_at;
    pthread_cond_t cv;
    enum item_state state;
    unsigned long long token_gen; // set when dispatched
};

// Round-robin cursor of one priority: the flow served last.
struct cursor {
    int priority;
    char last[FAIRNESS_MAX + 1];
};

struct tdm_router_flow {
    pthread_mutex_t mu;
    struct tdm_router_flow_hooks hooks;
    struct item *head, *tail;
    size_t n;
    long long bytes;
    atomic_size_t n_atomic; // n, read without the lock by kick
    bool token;
    double token_at;
    unsigned long long
        token_gen; // which holder has it (a late give-back of a lapsed one is ignored)
    bool stopping;
    double last_sat;    // -1: never computed
    double last_try_at; // the last dispatch attempt (polls are rate-limited)
    struct cursor *cursors;
    size_t n_cursors, cap_cursors;
};

const char *tdm_router_flow_outcome_name(enum tdm_router_flow_outcome o)
{
    static const char *const names[TDM_ROUTER_FLOW_OUTCOME_COUNT] = {
        [TDM_ROUTER_FLOW_DISPATCHED] = "Dispatched",
        [TDM_ROUTER_FLOW_REJECTED_CAPACITY] = "RejectedCapacity",
        [TDM_ROUTER_FLOW_EVICTED_TTL] = "EvictedTTL",
        [TDM_ROUTER_FLOW_EVICTED_CANCELLED] = "EvictedContextCancelled",
        [TDM_ROUTER_FLOW_EVICTED_OTHER] = "EvictedOther",
        [TDM_ROUTER_FLOW_SHED] = "Shed",
    };
    return (unsigned)o < TDM_ROUTER_FLOW_OUTCOME_COUNT ? names[o] : "unknown";
}

int tdm_router_flow_new(struct tdm_router_flow **out, const struct tdm_router_flow_hooks *hooks)
{
    *out = NULL;
    struct tdm_router_flow *f = calloc(1, sizeof *f);
    if (!f)
        return TDM_ENOMEM;
    if (pthread_mutex_init(&f->mu, NULL) != 0) {
        free(f);
        return TDM_ENOMEM;
    }
    f->hooks = *hooks;
    f->last_sat = -1;
    atomic_init(&f->n_atomic, 0);
    *out = f;
    return TDM_OK;
}

void tdm_router_flow_free(struct tdm_router_flow *f)
{
    if (!f)
        return;
    pthread_mutex_destroy(&f->mu);
    free(f->cursors);
    free(f);
}

static void unlink_item(struct tdm_router_flow *f, struct item *it, enum item_state st)
{
    if (it->prev)
        it->prev->next = it->next;
    else
        f->head = it->next;
    if (it->next)
        it->next->prev = it->prev;
    else
        f->tail = it->prev;
    it->prev = it->next = NULL;
    f->n--;
    f->bytes -= it->bytes;
    atomic_store(&f->n_atomic, f->n);
    it->state = st;
    if (f->hooks.queue_change)
        f->hooks.queue_change(f->hooks.arg, it->priority, -1, -it->bytes);
}

static struct cursor *cursor_of(struct tdm_router_flow *f, int priority)
{
    for (size_t i = 0; i < f->n_cursors; i++)
        if (f->cursors[i].priority == priority)
            return &f->cursors[i];
    if (f->n_cursors == f->cap_cursors) {
        size_t cap = f->cap_cursors ? 2 * f->cap_cursors : 8;
        struct cursor *c = realloc(f->cursors, cap * sizeof *c);
        if (!c)
            return NULL; // no cursor: the band is served in arrival order this time
        f->cursors = c;
        f->cap_cursors = cap;
    }
    struct cursor *c = &f->cursors[f->n_cursors++];
    c->priority = priority;
    c->last[0] = '\0';
    return c;
}

// The next request to dispatch: the highest priority waiting; in its band the
// oldest item's fairness policy decides (a reload may have changed it since
// younger ones arrived); global-strict takes the oldest, round-robin the
// oldest of the flow after the one served last (flows sorted by id, wrapping).
static struct item *pick_locked(struct tdm_router_flow *f)
{
    struct item *best = NULL; // oldest of the highest priority
    for (struct item *it = f->head; it; it = it->next)
        if (!best || it->priority > best->priority)
            best = it;
    if (!best || best->fairness != TDM_ROUTER_ROUND_ROBIN_FAIRNESS)
        return best;
    struct cursor *c = cursor_of(f, best->priority);
    if (!c)
        return best;
    struct item *next = NULL, *first = NULL; // oldest of the flow after last / smallest flow
    for (struct item *it = f->head; it; it = it->next) {
        if (it->priority != best->priority)
            continue;
        if (!first || strcmp(it->flow, first->flow) < 0)
            first = it;
        if (strcmp(it->flow, c->last) > 0 && (!next || strcmp(it->flow, next->flow) < 0))
            next = it;
    }
    struct item *pick = next ? next : first;
    snprintf(c->last, sizeof c->last, "%s", pick->flow);
    return pick;
}

static bool token_free(const struct tdm_router_flow *f, double now)
{
    return !f->token || now - f->token_at > TOKEN_MAX_S;
}

// One dispatch decision: when the token is free and the pool has room, the
// next request goes. poll: from a waiter's periodic wake (rate-limited).
static void dispatch_locked(struct tdm_router_flow *f, bool poll)
{
    double now = tdm_now();
    if (f->stopping || !f->head || !token_free(f, now))
        return;
    if (poll && now - f->last_try_at < POLL_DISPATCH_S)
        return;
    f->last_try_at = now;
    double sat = f->hooks.saturation(f->hooks.arg);
    f->last_sat = sat;
    if (sat >= 1.0)
        return;
    struct item *it = pick_locked(f);
    unlink_item(f, it, DISPATCHED);
    f->token = true;
    f->token_at = now;
    it->token_gen = ++f->token_gen;
    pthread_cond_signal(&it->cv);
}

// Would one more request of this size in band b exceed a limit?
static bool over_capacity(const struct tdm_router_flow *f, const struct tdm_router_flow_ask *ask)
{
    const struct tdm_router_flow_config *fc = ask->cfg;
    if (fc->max_requests > 0 && (long long)f->n + 1 > fc->max_requests)
        return true;
    if (fc->max_bytes > 0 && f->bytes + ask->bytes > fc->max_bytes)
        return true;
    const struct tdm_router_flow_band *b = tdm_router_flow_band_of(fc, ask->priority);
    long long n = 0, bytes = 0;
    for (const struct item *it = f->head; it; it = it->next)
        if (it->priority == ask->priority)
            n++, bytes += it->bytes;
    if (b->max_requests > 0 && n + 1 > b->max_requests)
        return true;
    return b->max_bytes > 0 && bytes + ask->bytes > b->max_bytes;
}

void tdm_router_flow_admit(struct tdm_router_flow *f, const struct tdm_router_flow_ask *ask,
                           struct tdm_router_flow_ticket *t)
{
    memset(t, 0, sizeof *t);
    double arrival = tdm_now();
    pthread_mutex_lock(&f->mu);
    if (f->stopping) {
        pthread_mutex_unlock(&f->mu);
        t->outcome = TDM_ROUTER_FLOW_EVICTED_OTHER;
        return;
    }
    // Straight through: nobody waits, the token is free and the pool has room.
    if (!f->head && token_free(f, arrival)) {
        double sat = f->hooks.saturation(f->hooks.arg);
        f->last_sat = sat;
        if (sat < 1.0) {
            f->token = true;
            f->token_at = arrival;
            t->token_ = true;
            t->token_gen_ = ++f->token_gen;
            pthread_mutex_unlock(&f->mu);
            t->outcome = TDM_ROUTER_FLOW_DISPATCHED;
            return;
        }
    }
    if (!ask->may_wait || over_capacity(f, ask)) {
        pthread_mutex_unlock(&f->mu);
        t->outcome = TDM_ROUTER_FLOW_REJECTED_CAPACITY;
        return;
    }
    struct item it;
    memset(&it, 0, sizeof it);
    if (tdm_cond_init(&it.cv) != TDM_OK) {
        pthread_mutex_unlock(&f->mu);
        t->outcome = TDM_ROUTER_FLOW_EVICTED_OTHER;
        return;
    }
    it.priority = ask->priority;
    it.fairness = tdm_router_flow_band_of(ask->cfg, ask->priority)->fairness;
    snprintf(it.flow, sizeof it.flow, "%s",
             ask->fairness_id && ask->fairness_id[0] ? ask->fairness_id : "default-flow");
    it.bytes = ask->bytes;
    it.enq_at = arrival;
    it.state = QUEUED;
    it.prev = f->tail;
    if (f->tail)
        f->tail->next = &it;
    else
        f->head = &it;
    f->tail = &it;
    f->n++;
    f->bytes += it.bytes;
    atomic_store(&f->n_atomic, f->n);
    if (f->hooks.queue_change)
        f->hooks.queue_change(f->hooks.arg, it.priority, 1, it.bytes);
    t->queued = true;
    dispatch_locked(f, false);
    enum tdm_router_flow_outcome out = TDM_ROUTER_FLOW_DISPATCHED;
    while (it.state == QUEUED) {
        double now = tdm_now();
        if (f->stopping) {
            unlink_item(f, &it, EVICTED);
            out = TDM_ROUTER_FLOW_EVICTED_OTHER;
            break;
        }
        if (now >= ask->deadline) {
            unlink_item(f, &it, EVICTED);
            out = TDM_ROUTER_FLOW_EVICTED_TTL;
            break;
        }
        double until = now + POLL_S < ask->deadline ? now + POLL_S : ask->deadline;
        tdm_cond_wait_until(&it.cv, &f->mu, until);
        if (it.state != QUEUED)
            break;
        if (ask->gone) { // a socket peek: not under the lock
            pthread_mutex_unlock(&f->mu);
            bool gone = ask->gone(ask->gone_arg);
            pthread_mutex_lock(&f->mu);
            if (gone && it.state == QUEUED) {
                unlink_item(f, &it, EVICTED);
                out = TDM_ROUTER_FLOW_EVICTED_CANCELLED;
                break;
            }
        }
        if (it.state == QUEUED)
            dispatch_locked(f, true);
    }
    if (it.state == DISPATCHED && out == TDM_ROUTER_FLOW_DISPATCHED) {
        t->token_ = true; // dispatch_locked handed it the token
        t->token_gen_ = it.token_gen;
    }
    pthread_mutex_unlock(&f->mu);
    pthread_cond_destroy(&it.cv);
    t->outcome = out;
    t->waited = tdm_now() - arrival;
}

void tdm_router_flow_routed(struct tdm_router_flow *f, struct tdm_router_flow_ticket *t)
{
    if (!f || !t || !t->token_)
        return;
    t->token_ = false;
    pthread_mutex_lock(&f->mu);
    if (f->token_gen == t->token_gen_)
        f->token = false;
    dispatch_locked(f, false);
    pthread_mutex_unlock(&f->mu);
}

void tdm_router_flow_kick(struct tdm_router_flow *f)
{
    if (!f || atomic_load(&f->n_atomic) == 0)
        return;
    pthread_mutex_lock(&f->mu);
    dispatch_locked(f, false);
    pthread_mutex_unlock(&f->mu);
}

void tdm_router_flow_stop(struct tdm_router_flow *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stopping = true;
    for (struct item *it = f->head; it; it = it->next)
        pthread_cond_signal(&it->cv);
    pthread_mutex_unlock(&f->mu);
}

void tdm_router_flow_stats(struct tdm_router_flow *f, struct tdm_router_flow_stats *st)
{
    memset(st, 0, sizeof *st);
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    st->queued = f->n;
    st->bytes = f->bytes;
    st->saturation = f->last_sat;
    st->token_held = f->token && !token_free(f, tdm_now());
    pthread_mutex_unlock(&f->mu);
}
