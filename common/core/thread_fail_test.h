// SPDX-License-Identifier: Apache-2.0
// For tests linked with -Wl,--wrap=tdm_thread_start_detached: the next
// tdm_test_thread_fails calls of tdm_thread_start_detached fail with
// TDM_EBUSY (as when no thread can be created: pthread_create itself cannot
// be made to fail on demand), every later one goes through. Include it in one
// source file of the test binary.
#ifndef TDM_THREAD_FAIL_TEST_H
#define TDM_THREAD_FAIL_TEST_H

#include <stdatomic.h>

#include "core.h"

static atomic_int tdm_test_thread_fails; // calls still to fail

int __real_tdm_thread_start_detached(void *(*fn)(void *), void *arg);
int __wrap_tdm_thread_start_detached(void *(*fn)(void *), void *arg);
int __wrap_tdm_thread_start_detached(void *(*fn)(void *), void *arg)
{
    int left = atomic_load(&tdm_test_thread_fails);
    while (left > 0)
        if (atomic_compare_exchange_weak(&tdm_test_thread_fails, &left, left - 1))
            return TDM_EBUSY;
    return __real_tdm_thread_start_detached(fn, arg);
}

#endif
