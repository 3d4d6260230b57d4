// SPDX-License-Identifier: Apache-2.0
// router retry: a request's one retry budget. A request is routed at most
// max_routes times in all, whichever way its attempts failed: the decode
// worker could not be reached (send failed, or known dead), or it was lost or
// refused the request (loading, draining; or busy: its waiting queue full, no
// thread for it) before anything reached the client.
// No retry once the client saw a token (a retry would repeat or change text),
// and none when routing itself failed (no healthy endpoint: routing again
// fails the same way). The decode endpoints that failed the request are kept
// so that the next route avoids them while another endpoint can serve.
//
// Plain value type, no locking: one per request, on the HTTP thread's stack.
// Before this budget the router nested two loops of 3 (reach x lost), so one
// request could take 9 routes.
#ifndef TDM_ROUTER_RETRY_H
#define TDM_ROUTER_RETRY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Most routes one request may take (and failed endpoints it remembers).
#define TDM_ROUTER_RETRY_MAX_ROUTES 8

// How one attempt (route + send + wait for the first chunk) ended.
enum tdm_router_attempt_end {
    TDM_ROUTER_ATTEMPT_OK = 0,      // the first chunk arrived: the request streams
    TDM_ROUTER_ATTEMPT_NO_ROUTE,    // routing failed (no healthy decode endpoint)
    TDM_ROUTER_ATTEMPT_UNREACHABLE, // the GenerateRequest could not be delivered
    TDM_ROUTER_ATTEMPT_LOST,        // the worker died or refused before the first token
    TDM_ROUTER_ATTEMPT_BUSY,        // the worker's queue has no room for the request now:
                                    // overload, not death (no health penalty), try another
};

struct tdm_router_retry {
    int max_routes;                               // routes allowed in all, 1..MAX_ROUTES
    int routes;                                   // failed attempts so far
    uint64_t failed[TDM_ROUTER_RETRY_MAX_ROUTES]; // [n_failed] decode endpoints that failed
    size_t n_failed;
};

// A fresh budget of max_routes routes (clamped to 1..TDM_ROUTER_RETRY_MAX_ROUTES).
void tdm_router_retry_init(struct tdm_router_retry *b, int max_routes);

// Records a failed attempt on decode endpoint endpoint_id (0: none was routed)
// and says whether to route again: true only for UNREACHABLE, LOST or BUSY, when
// the client saw no token, and while the budget has routes left.
bool tdm_router_retry_next(struct tdm_router_retry *b, enum tdm_router_attempt_end end,
                           uint64_t endpoint_id, bool client_saw_tokens);

#endif
