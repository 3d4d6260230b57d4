// SPDX-License-Identifier: Apache-2.0
// router retry: the retry budget of retry.h.
#include "retry.h"

void tdm_router_retry_init(struct tdm_router_retry *b, int max_routes)
{
    if (max_routes < 1)
        max_routes = 1;
    if (max_routes > TDM_ROUTER_RETRY_MAX_ROUTES)
        max_routes = TDM_ROUTER_RETRY_MAX_ROUTES;
    *b = (struct tdm_router_retry){.max_routes = max_routes};
}

bool tdm_router_retry_next(struct tdm_router_retry *b, enum tdm_router_attempt_end end,
                           uint64_t endpoint_id, bool client_saw_tokens)
{
    if (end == TDM_ROUTER_ATTEMPT_OK)
        return false;
    b->routes++;
    bool known = false;
    for (size_t i = 0; i < b->n_failed; i++)
        known |= b->failed[i] == endpoint_id;
    if (endpoint_id != 0 && !known && b->n_failed < TDM_ROUTER_RETRY_MAX_ROUTES)
        b->failed[b->n_failed++] = endpoint_id;
    if (end != TDM_ROUTER_ATTEMPT_UNREACHABLE && end != TDM_ROUTER_ATTEMPT_LOST &&
        end != TDM_ROUTER_ATTEMPT_BUSY)
        return false;
    return !client_saw_tokens && b->routes < b->max_routes;
}
