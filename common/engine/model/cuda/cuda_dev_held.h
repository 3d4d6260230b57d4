// SPDX-License-Identifier: Apache-2.0
// cuda_dev_held (internal to cuda_dev.c and emu/cuda_dev_emu.c): the device
// memory this process holds through tdm_cuda_dev_alloc, by allocation.
// cudaMemGetInfo is device-wide (every process's memory), so the KV pool's
// budget needs this process's own figure (tdm_cuda_dev_held). Allocations are
// few (a few hundred weight tensors, buffers, the pool) and freed at shutdown,
// so a list searched on free is enough. Thread safe.
#ifndef TDM_CUDA_DEV_HELD_H
#define TDM_CUDA_DEV_HELD_H

#include <pthread.h>
#include <stdlib.h>

struct held_list {
    pthread_mutex_t mu;
    void **ptr;
    size_t *bytes;
    size_t n, cap;
    size_t total;
};

static inline void held_init(struct held_list *h)
{
    pthread_mutex_init(&h->mu, NULL);
    h->ptr = NULL;
    h->bytes = NULL;
    h->n = h->cap = h->total = 0;
}

static inline void held_fini(struct held_list *h)
{
    free(h->ptr);
    free(h->bytes);
    pthread_mutex_destroy(&h->mu);
}

// Records p (bytes long); false when out of host memory (the caller frees p).
static inline bool held_add(struct held_list *h, void *p, size_t bytes)
{
    pthread_mutex_lock(&h->mu);
    if (h->n == h->cap) {
        size_t cap = h->cap ? 2 * h->cap : 64;
        void **np = realloc(h->ptr, cap * sizeof *np);
        if (np)
            h->ptr = np;
        size_t *nb = np ? realloc(h->bytes, cap * sizeof *nb) : NULL;
        if (!nb) {
            pthread_mutex_unlock(&h->mu);
            return false;
        }
        h->bytes = nb;
        h->cap = cap;
    }
    h->ptr[h->n] = p;
    h->bytes[h->n++] = bytes;
    h->total += bytes;
    pthread_mutex_unlock(&h->mu);
    return true;
}

static inline void held_remove(struct held_list *h, void *p)
{
    pthread_mutex_lock(&h->mu);
    for (size_t i = h->n; i-- > 0;)
        if (h->ptr[i] == p) {
            h->total -= h->bytes[i];
            h->ptr[i] = h->ptr[h->n - 1];
            h->bytes[i] = h->bytes[--h->n];
            break;
        }
    pthread_mutex_unlock(&h->mu);
}

static inline size_t held_total(struct held_list *h)
{
    pthread_mutex_lock(&h->mu);
    size_t t = h->total;
    pthread_mutex_unlock(&h->mu);
    return t;
}

#endif
