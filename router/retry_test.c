// SPDX-License-Identifier: Apache-2.0
// Tests of the router's retry budget: one budget across both ways an attempt
// fails (3 routes in all, not 3 x 3), no retry once the client saw a token or
// when routing failed, and the failed decode endpoints kept for avoidance.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "retry.h"

static void test_one_budget_across_failure_kinds(void **state)
{
    (void)state;
    struct tdm_router_retry b;
    tdm_router_retry_init(&b, 3);
    // Unreachable, then lost, then unreachable: the third failure ends it.
    assert_true(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_UNREACHABLE, 1, false));
    assert_true(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_LOST, 2, false));
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_UNREACHABLE, 3, false));
    assert_int_equal(b.routes, 3);
    // Lost only: still 3 routes in all (the nested loops allowed 9).
    tdm_router_retry_init(&b, 3);
    int routes = 1;
    while (tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_LOST, 7, false))
        routes++;
    assert_int_equal(routes, 3);
    // A busy worker (no room in its queue now) is retried elsewhere within the
    // same budget and avoided on the next route (issue 11: busy is not dead).
    tdm_router_retry_init(&b, 3);
    assert_true(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_BUSY, 4, false));
    assert_int_equal(b.n_failed, 1);
    assert_true(b.failed[0] == 4);
    assert_true(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_BUSY, 5, false));
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_BUSY, 6, false));
}

static void test_no_retry_cases(void **state)
{
    (void)state;
    struct tdm_router_retry b;
    tdm_router_retry_init(&b, 3);
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_LOST, 1, true)); // tokens sent
    tdm_router_retry_init(&b, 3);
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_NO_ROUTE, 0, false));
    assert_int_equal(b.n_failed, 0); // nothing routed, nothing to avoid
    tdm_router_retry_init(&b, 3);
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_OK, 1, false));
    assert_int_equal(b.routes, 0); // success spends nothing
    tdm_router_retry_init(&b, 1);  // a budget of one route never retries
    assert_false(tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_UNREACHABLE, 1, false));
}

static void test_failed_endpoints_and_clamp(void **state)
{
    (void)state;
    struct tdm_router_retry b;
    tdm_router_retry_init(&b, 100);
    assert_int_equal(b.max_routes, TDM_ROUTER_RETRY_MAX_ROUTES);
    tdm_router_retry_init(&b, 0);
    assert_int_equal(b.max_routes, 1);
    tdm_router_retry_init(&b, 5);
    tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_LOST, 4, false);
    tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_UNREACHABLE, 4, false); // the same one again
    tdm_router_retry_next(&b, TDM_ROUTER_ATTEMPT_UNREACHABLE, 9, false);
    assert_int_equal(b.n_failed, 2);
    assert_true(b.failed[0] == 4 && b.failed[1] == 9);
    assert_int_equal(b.routes, 3);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_budget_across_failure_kinds),
        cmocka_unit_test(test_no_retry_cases),
        cmocka_unit_test(test_failed_endpoints_and_clamp),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
