// SPDX-License-Identifier: Apache-2.0
// router flow: llm-d's EPP flow control layer for the router. While the pool
// is saturated (the utilization detector's mean saturation >= 1), requests
// wait here, in priority bands, instead of piling into the workers' own
// queues; as capacity frees up they are dispatched one at a time: the highest
// band first, within a band by its fairness policy (global-strict: arrival
// order over all flows; round-robin: the band's flows, sorted by fairness id,
// take turns), within a flow first come first served. A band's or the
// global limit (requests, bytes) refuses a request that would exceed it
// (RejectedCapacity; nothing queued is displaced), and a request leaves
// unserved when its TTL passes (EvictedTTL), its client goes
// (EvictedContextCancelled) or the router stops (EvictedOther).
//
// Dispatch is closed-loop: one admitted request at a time holds the dispatch
// token from its admission until it is routed and sent to its worker
// (tdm_router_flow_routed), so the next decision sees the load that request
// added (the endpoint registry counts a routed request as unreported queue at
// once), and a worker receives dispatched requests in dispatch order. A request that finds the
// queue empty and the pool unsaturated passes straight through, holding the
// token the same way.
//
// Used by control.c (tdm_router_control_admit). Thread-safe; admit blocks its
// caller (an HTTP handler thread) while the request waits.
#ifndef TDM_ROUTER_FLOW_H
#define TDM_ROUTER_FLOW_H

#include <stdbool.h>
#include <stddef.h>

#include "config.h"

enum tdm_router_flow_outcome {
    TDM_ROUTER_FLOW_DISPATCHED = 0,    // go ahead: route it (then tdm_router_flow_routed)
    TDM_ROUTER_FLOW_REJECTED_CAPACITY, // a limit would be exceeded: 429
    TDM_ROUTER_FLOW_EVICTED_TTL,       // waited past its TTL (or the request deadline): 503
    TDM_ROUTER_FLOW_EVICTED_CANCELLED, // the client left while it waited
    TDM_ROUTER_FLOW_EVICTED_OTHER,     // the router is stopping: 503
    TDM_ROUTER_FLOW_SHED, // no flow control: sheddable (priority < 0) while saturated: 429
    TDM_ROUTER_FLOW_OUTCOME_COUNT,
};
// llm-d's outcome label ("Dispatched", "RejectedCapacity", "EvictedTTL",
// "EvictedContextCancelled", "EvictedOther"; Tandem's "Shed").
const char *tdm_router_flow_outcome_name(enum tdm_router_flow_outcome o);

struct tdm_router_flow_hooks {
    // The pool's saturation now (1 = saturated). Called with the flow's lock
    // held: it may take the endpoint registry's lock, never the flow's.
    double (*saturation)(void *arg);
    // A request entered (+1, +bytes) or left (-1, -bytes) the queue of a
    // priority; may be NULL. Called with the flow's lock held.
    void (*queue_change)(void *arg, int priority, int requests, long long bytes);
    void *arg;
};

struct tdm_router_flow;
int tdm_router_flow_new(struct tdm_router_flow **out, const struct tdm_router_flow_hooks *hooks);
// Every waiter must have left (tdm_router_flow_stop, then the handlers ended).
void tdm_router_flow_free(struct tdm_router_flow *f);

struct tdm_router_flow_ask {
    const struct tdm_router_flow_config *cfg; // limits and the band's policies (the request's
                                              // config snapshot)
    int priority;
    const char *fairness_id; // NULL or "": "default-flow"
    long long bytes;         // the request body's size (the byte limits count these)
    double deadline;         // tdm_now() time it leaves the queue unserved (EvictedTTL)
    bool (*gone)(void *arg); // may be NULL: the client left? (asked without the lock)
    void *gone_arg;
    bool may_wait; // false: refused (RejectedCapacity) where it would have to wait
                   // (the caller has no thread to spare for a waiter)
};

struct tdm_router_flow_ticket {
    enum tdm_router_flow_outcome outcome;
    bool queued;   // it waited in a queue (else it passed straight through, or was refused)
    double waited; // seconds between arrival and leaving the queue
    bool token_;   // private: holds the dispatch token
    unsigned long long token_gen_;
};

// Admits a request: returns at once when it passes straight through or is
// refused, else waits until dispatched or evicted. t->outcome says which;
// when DISPATCHED, call tdm_router_flow_routed once the request is routed (or
// its routing failed).
void tdm_router_flow_admit(struct tdm_router_flow *f, const struct tdm_router_flow_ask *ask,
                           struct tdm_router_flow_ticket *t);
// Gives the dispatch token back and dispatches the next request if the pool
// has room. Idempotent; NULL f or a ticket without the token is a no-op.
void tdm_router_flow_routed(struct tdm_router_flow *f, struct tdm_router_flow_ticket *t);
// The load may have changed (a report arrived, a request ended): dispatch if
// the pool has room. Cheap when nothing waits.
void tdm_router_flow_kick(struct tdm_router_flow *f);
// Evicts every waiting request (EvictedOther) and refuses new ones.
void tdm_router_flow_stop(struct tdm_router_flow *f);

struct tdm_router_flow_stats {
    size_t queued;     // waiting requests
    long long bytes;   // their bytes
    double saturation; // as of the last dispatch decision (-1: none yet)
    bool token_held;
};
void tdm_router_flow_stats(struct tdm_router_flow *f, struct tdm_router_flow_stats *st);

#endif
