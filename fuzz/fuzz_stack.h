// SPDX-License-Identifier: Apache-2.0
// Every fuzzer runs each input the way a server runs a request's bytes: on a
// thread that leaves it no more stack than a libcivetweb worker leaves a
// handler (TDM_HTTP_HANDLER_STACK_BYTES, http.h), not on the fuzzer's 8 MB main
// thread. A recursion that overflows a worker's stack then crashes the fuzzer
// as it would crash a server (issue 29: 10 M executions on the main thread
// found neither of two remote crashes). A fuzzer defines
//   static int fuzz_one(const uint8_t *data, size_t size)
// and TDM_FUZZ_ON_HTTP_STACK(fuzz_one) makes it LLVMFuzzerTestOneInput.
#ifndef TDM_FUZZ_STACK_H
#define TDM_FUZZ_STACK_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "http.h"
#include "small_stack.h"

struct fuzz_input {
    int (*one)(const uint8_t *, size_t);
    const uint8_t *data;
    size_t size;
    int rc;
};

static void fuzz_input_run(void *arg)
{
    struct fuzz_input *in = arg;
    in->rc = in->one(in->data, in->size);
}

static inline int fuzz_on_http_stack(int (*one)(const uint8_t *, size_t), const uint8_t *data,
                                     size_t size)
{
    static struct tdm_small_stack s;
    static int started;
    if (!started) {
        if (!tdm_small_stack_start(&s, TDM_HTTP_HANDLER_STACK_BYTES)) {
            fprintf(stderr, "fuzz: cannot start the small-stack thread\n");
            abort();
        }
        started = 1;
    }
    struct fuzz_input in = {one, data, size, 0};
    tdm_small_stack_run(&s, fuzz_input_run, &in);
    return in.rc;
}

#define TDM_FUZZ_ON_HTTP_STACK(one)                                                                \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);                                  \
    int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)                                   \
    {                                                                                              \
        return fuzz_on_http_stack(one, data, size);                                                \
    }

#endif
