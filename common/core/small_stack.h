// SPDX-License-Identifier: Apache-2.0
// small_stack: tests and fuzzers run code the way an HTTP request runs it, on a
// thread with no more stack than a libcivetweb worker leaves its handler
// (TDM_HTTP_HANDLER_STACK_BYTES in http.h; http_test checks the real figure),
// so a recursion that would overflow a worker's stack crashes the test or the
// fuzzer too, not only a server. Header-only, for tests and fuzzers (not part
// of a library):
//   tdm_stack_room()            bytes of stack left below the caller's frame
//   tdm_small_stack_start(s, room)
//                               a thread that runs each call with exactly
//                               room bytes of stack below it
//   tdm_small_stack_run(s, fn, arg)
//                               fn(arg) there, waiting for it
//   tdm_small_stack_stop(s)     ends the thread
#ifndef TDM_SMALL_STACK_H
#define TDM_SMALL_STACK_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE // pthread_getattr_np
#endif
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

// Bytes of stack between the caller's frame and the lowest address of its
// thread's stack (glibc: the static TLS sits above, outside this room); 0 when
// unknown.
static __attribute__((noinline, unused)) size_t tdm_stack_room(void)
{
    pthread_attr_t a;
    void *lo = NULL;
    size_t size = 0;
    if (pthread_getattr_np(pthread_self(), &a) != 0)
        return 0;
    pthread_attr_getstack(&a, &lo, &size);
    pthread_attr_destroy(&a);
    uintptr_t here = (uintptr_t)__builtin_frame_address(0);
    return here > (uintptr_t)lo ? (size_t)(here - (uintptr_t)lo) : 0;
}

struct tdm_small_stack {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    size_t room;
    void (*fn)(void *);
    void *arg;
    bool busy, quit, started, ok;
};

static __attribute__((noinline, unused)) void tdm_small_stack_loop_(struct tdm_small_stack *s)
{
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->busy && !s->quit)
            pthread_cond_wait(&s->cv, &s->mu);
        if (s->quit)
            break;
        pthread_mutex_unlock(&s->mu);
        s->fn(s->arg);
        pthread_mutex_lock(&s->mu);
        s->busy = false;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
}

static __attribute__((unused)) void *tdm_small_stack_main_(void *arg)
{
    struct tdm_small_stack *s = arg;
    size_t room = tdm_stack_room();
    // What this frame and the loop's take is small against the pad: 4 KiB of
    // slack keeps the call's room at most s->room, never more.
    size_t pad = room > s->room + 4096 ? room - s->room - 4096 : 1;
    char burn[pad];
    volatile char *touch = burn;
    touch[0] = 1;
    touch[pad - 1] = 1;
    pthread_mutex_lock(&s->mu);
    s->started = true;
    s->ok = room > s->room + 4096;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    tdm_small_stack_loop_(s);
    __asm__ volatile("" : : "r"(touch) : "memory"); // burn stays live until here
    return NULL;
}

// Starts the thread (stack: room plus 256 KiB, the surplus spent before any
// call). True on success.
static inline bool tdm_small_stack_start(struct tdm_small_stack *s, size_t room)
{
    memset(s, 0, sizeof *s);
    s->room = room;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_attr_t a;
    if (pthread_attr_init(&a) != 0)
        return false;
    pthread_attr_setstacksize(&a, room + (256u << 10));
    int rc = pthread_create(&s->th, &a, tdm_small_stack_main_, s);
    pthread_attr_destroy(&a);
    if (rc != 0)
        return false;
    pthread_mutex_lock(&s->mu);
    while (!s->started)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return s->ok;
}

static inline void tdm_small_stack_run(struct tdm_small_stack *s, void (*fn)(void *), void *arg)
{
    pthread_mutex_lock(&s->mu);
    s->fn = fn;
    s->arg = arg;
    s->busy = true;
    pthread_cond_broadcast(&s->cv);
    while (s->busy)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static inline void tdm_small_stack_stop(struct tdm_small_stack *s)
{
    pthread_mutex_lock(&s->mu);
    s->quit = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->th, NULL);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
}

#endif
