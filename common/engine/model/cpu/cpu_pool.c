// SPDX-License-Identifier: Apache-2.0
// cpu_pool: the backend's persistent worker threads and a cheap fork/join.
// A run bumps a generation counter; workers spin on it briefly (ops of one
// forward step follow each other within microseconds) and then sleep on a
// futex, so an idle engine burns no CPU after ~100 us. The caller runs task 0
// itself and spins until the workers have checked in. The ops divide work by
// thread index or through an atomic task counter; which thread computes what
// never changes a result because every op splits work along independent
// outputs. Linux only (futex).
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "core.h"
#include "cpu_impl.h"

// Pause iterations before a worker sleeps (~65 cycles each on Zen: ~100 us).
#define POOL_SPIN 6000

struct cpu_worker {
    struct cpu_pool *pool;
    int tid;
    pthread_t thread;
};

struct cpu_pool {
    int nthreads;
    struct cpu_worker *workers; // [nthreads - 1]
    _Atomic uint32_t gen;       // bumped once per run (futex word)
    _Atomic int sleepers;       // workers in (or entering) futex wait
    _Atomic int pending;        // workers that have not finished this run
    _Atomic int stop;
    cpu_task_fn fn;
    void *arg;
};

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __asm__ __volatile__("pause");
#endif
}

static void futex_wait(_Atomic uint32_t *addr, uint32_t val)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, val, NULL, NULL, 0);
}

static void futex_wake_all(_Atomic uint32_t *addr)
{
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static void *worker_main(void *p)
{
    struct cpu_worker *w = p;
    struct cpu_pool *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen) {
            if (spins++ < POOL_SPIN) {
                cpu_relax();
                continue;
            }
            // Dekker with the runner: it bumps gen then reads sleepers; we bump
            // sleepers then re-read gen (inside the futex call).
            atomic_fetch_add(&pool->sleepers, 1);
            futex_wait(&pool->gen, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
            spins = 0;
        }
        seen = g;
        if (atomic_load_explicit(&pool->stop, memory_order_acquire))
            return NULL;
        pool->fn(pool->arg, w->tid, pool->nthreads);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_release);
    }
}

int cpu_pool_new(struct cpu_pool **out, int nthreads)
{
    if (nthreads < 1)
        nthreads = 1;
    struct cpu_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return TDM_ENOMEM;
    p->nthreads = nthreads;
    if (nthreads > 1) {
        p->workers = calloc((size_t)nthreads - 1, sizeof(*p->workers));
        if (!p->workers)
            goto fail_pool;
    }
    int started = 0;
    for (int i = 0; i < nthreads - 1; i++) {
        p->workers[i].pool = p;
        p->workers[i].tid = i + 1;
        if (pthread_create(&p->workers[i].thread, NULL, worker_main, &p->workers[i]) != 0)
            goto fail_threads;
        started++;
    }
    *out = p;
    return 0;

fail_threads:
    p->nthreads = started + 1;
    cpu_pool_free(p);
    return TDM_ENOMEM;
fail_pool:
    free(p);
    return TDM_ENOMEM;
}

void cpu_pool_free(struct cpu_pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, 1);
    atomic_fetch_add(&p->gen, 1);
    futex_wake_all(&p->gen);
    for (int i = 0; i < p->nthreads - 1; i++)
        pthread_join(p->workers[i].thread, NULL);
    free(p->workers);
    free(p);
}

int cpu_pool_size(const struct cpu_pool *p)
{
    return p->nthreads;
}

void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg)
{
    if (p->nthreads == 1) {
        fn(arg, 0, 1);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    atomic_store_explicit(&p->pending, p->nthreads - 1, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); // seq_cst: publishes fn/arg/pending
    if (atomic_load(&p->sleepers) > 0)
        futex_wake_all(&p->gen);
    fn(arg, 0, p->nthreads);
    int spins = 0;
    while (atomic_load_explicit(&p->pending, memory_order_acquire) > 0) {
        // A worker may have been descheduled on a busy machine: yield rather
        // than spin forever against it.
        if (++spins < POOL_SPIN)
            cpu_relax();
        else
            sched_yield();
    }
}
