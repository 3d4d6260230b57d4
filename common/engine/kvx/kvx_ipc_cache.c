// SPDX-License-Identifier: Apache-2.0
// kvx_ipc_cache: the prefill side's opened CUDA IPC handles of decode
// workers' KV pools. Opening a handle maps the peer's allocation into this
// process (cudaIpcOpenMemHandle, milliseconds), so it is done once per peer
// instance; a new instance id or a different handle means the peer restarted
// or reallocated, and the old mapping is closed before the new one is opened
// (an old mapping of a freed allocation must never be written through).
// Entries: a small array, least recently used evicted when full.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

#define PEER_MAX 256

struct entry {
    char peer[PEER_MAX]; // the decode worker's name (its nng URL); "" = free slot
    uint64_t instance;
    uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES];
    void *dev_ptr; // the mapping ipc_open returned
    uint64_t used; // tick of the last get
};

struct tdm_kvx_ipc_cache {
    const struct tdm_kvx_ops *ops;
    int capacity;
    uint64_t tick;
    struct entry *entries; // [capacity]
};

int tdm_kvx_ipc_cache_new(struct tdm_kvx_ipc_cache **out, const struct tdm_kvx_ops *ops,
                          int capacity)
{
    *out = NULL;
    if (ops == NULL || ops->ipc_open == NULL || ops->ipc_close == NULL || capacity < 1 ||
        capacity > 4096)
        return TDM_EINVAL;
    struct tdm_kvx_ipc_cache *c = calloc(1, sizeof *c);
    if (c == NULL)
        return TDM_ENOMEM;
    c->entries = calloc((size_t)capacity, sizeof *c->entries);
    if (c->entries == NULL) {
        free(c);
        return TDM_ENOMEM;
    }
    c->ops = ops;
    c->capacity = capacity;
    *out = c;
    return TDM_OK;
}

static void close_entry(struct tdm_kvx_ipc_cache *c, struct entry *e)
{
    if (e->peer[0] != '\0' && e->dev_ptr != NULL)
        c->ops->ipc_close(c->ops->ctx, e->dev_ptr);
    memset(e, 0, sizeof *e);
}

void tdm_kvx_ipc_cache_free(struct tdm_kvx_ipc_cache *c)
{
    if (c == NULL)
        return;
    for (int i = 0; i < c->capacity; i++)
        close_entry(c, &c->entries[i]);
    free(c->entries);
    free(c);
}

static struct entry *lookup(struct tdm_kvx_ipc_cache *c, const char *peer)
{
    for (int i = 0; i < c->capacity; i++)
        if (c->entries[i].peer[0] != '\0' && strcmp(c->entries[i].peer, peer) == 0)
            return &c->entries[i];
    return NULL;
}

int tdm_kvx_ipc_cache_get(struct tdm_kvx_ipc_cache *c, const char *peer, uint64_t instance,
                          const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr, char *err,
                          size_t errlen)
{
    *dev_ptr = NULL;
    if (peer == NULL || peer[0] == '\0' || strlen(peer) >= PEER_MAX)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: peer name empty or longer than %d",
                          PEER_MAX - 1);
    struct entry *e = lookup(c, peer);
    if (e != NULL && e->instance == instance &&
        memcmp(e->handle, handle, TDM_KVX_IPC_HANDLE_BYTES) == 0) {
        e->used = ++c->tick;
        *dev_ptr = e->dev_ptr;
        return TDM_OK;
    }
    if (e != NULL) {
        close_entry(c, e); // the peer restarted or reallocated its pool
    } else {
        for (int i = 0; i < c->capacity && e == NULL; i++)
            if (c->entries[i].peer[0] == '\0')
                e = &c->entries[i];
        if (e == NULL) { // full: close the least recently used
            e = &c->entries[0];
            for (int i = 1; i < c->capacity; i++)
                if (c->entries[i].used < e->used)
                    e = &c->entries[i];
            close_entry(c, e);
        }
    }
    void *ptr = NULL;
    char why[192] = "";
    if (c->ops->ipc_open(c->ops->ctx, handle, &ptr, why, sizeof why) != 0 || ptr == NULL)
        return tdm_seterr(err, errlen, TDM_EBACKEND,
                          "kvx: cannot open the KV pool handle of %s (instance %llx): %s", peer,
                          (unsigned long long)instance, why[0] ? why : "no mapping");
    snprintf(e->peer, sizeof e->peer, "%s", peer);
    e->instance = instance;
    memcpy(e->handle, handle, TDM_KVX_IPC_HANDLE_BYTES);
    e->dev_ptr = ptr;
    e->used = ++c->tick;
    *dev_ptr = ptr;
    return TDM_OK;
}

void tdm_kvx_ipc_cache_drop(struct tdm_kvx_ipc_cache *c, const char *peer)
{
    struct entry *e = peer ? lookup(c, peer) : NULL;
    if (e != NULL)
        close_entry(c, e);
}

int tdm_kvx_ipc_cache_size(const struct tdm_kvx_ipc_cache *c)
{
    int n = 0;
    for (int i = 0; i < c->capacity; i++)
        n += c->entries[i].peer[0] != '\0';
    return n;
}
