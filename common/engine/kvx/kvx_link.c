// SPDX-License-Identifier: Apache-2.0
// kvx_link: the NCCL communicator of one (prefill, decode) pair and its
// lifecycle. Built lazily: the decode side makes the unique id and starts a
// non-blocking init as rank 0; the prefill side joins as rank 1 with the id
// it was sent over nng. Both poll ncclCommGetAsyncError until ready, against
// a deadline. Invariant: any error, a passed deadline or a peer instance
// change aborts the communicator (ncclCommAbort, which never waits for the
// peer) and leaves the link idle, so a restarted or wedged peer can never
// block this worker (the failure vLLM and llm-d users report most: vllm#49238,
// #28108); the transfer fails into the caller's retry-then-local-prefill path
// and the next transfer builds a new communicator.
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

struct tdm_kvx_link {
    const struct tdm_kvx_ops *ops;
    enum tdm_kvx_role role;
    double init_timeout_s;
    enum tdm_kvx_link_state state;
    void *comm;        // the communicator; NULL when idle
    uint64_t instance; // the peer instance the communicator was made with
    double deadline;   // init must be ready by then (monotonic seconds)
    _Atomic uint64_t aborts;           // read by tdm_kvx_links_aborts from other threads
    uint8_t id[TDM_KVX_NCCL_ID_BYTES]; // the current communicator's id
};

int tdm_kvx_link_new(struct tdm_kvx_link **out, const struct tdm_kvx_ops *ops,
                     enum tdm_kvx_role role, double init_timeout_s)
{
    *out = NULL;
    if (ops == NULL || ops->nccl_unique_id == NULL || ops->nccl_init_start == NULL ||
        ops->nccl_state == NULL || ops->nccl_abort == NULL || ops->nccl_destroy == NULL ||
        (role != TDM_KVX_DECODE && role != TDM_KVX_PREFILL) || !(init_timeout_s > 0))
        return TDM_EINVAL;
    struct tdm_kvx_link *l = calloc(1, sizeof *l);
    if (l == NULL)
        return TDM_ENOMEM;
    l->ops = ops;
    l->role = role;
    l->init_timeout_s = init_timeout_s;
    *out = l;
    return TDM_OK;
}

void tdm_kvx_link_abort(struct tdm_kvx_link *l)
{
    if (l->comm != NULL) {
        l->ops->nccl_abort(l->ops->ctx, l->comm);
        l->aborts++;
    }
    l->comm = NULL;
    l->state = TDM_KVX_LINK_IDLE;
}

void tdm_kvx_link_free(struct tdm_kvx_link *l)
{
    if (l == NULL)
        return;
    if (l->state == TDM_KVX_LINK_READY && l->comm != NULL)
        l->ops->nccl_destroy(l->ops->ctx, l->comm);
    else if (l->comm != NULL)
        l->ops->nccl_abort(l->ops->ctx, l->comm); // an init in progress cannot be destroyed
    free(l);
}

static int start(struct tdm_kvx_link *l, uint64_t instance, double now,
                 const uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    tdm_kvx_link_abort(l);
    char why[192] = "";
    void *comm = NULL;
    int rank = l->role == TDM_KVX_DECODE ? 0 : 1;
    if (l->ops->nccl_init_start(l->ops->ctx, id, rank, &comm, why, sizeof why) != 0) {
        if (comm != NULL) { // a half-made communicator is aborted, never leaked
            l->ops->nccl_abort(l->ops->ctx, comm);
            l->aborts++;
        }
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "kvx: NCCL init as rank %d failed: %s", rank,
                          why[0] ? why : "?");
    }
    l->comm = comm;
    memcpy(l->id, id, TDM_KVX_NCCL_ID_BYTES);
    l->instance = instance;
    l->deadline = now + l->init_timeout_s;
    l->state = TDM_KVX_LINK_INIT;
    return TDM_OK;
}

int tdm_kvx_link_create(struct tdm_kvx_link *l, uint64_t instance, double now,
                        uint8_t id_out[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    if (l->role != TDM_KVX_DECODE)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: only the decode side makes the id");
    tdm_kvx_link_abort(l);
    char why[192] = "";
    if (l->ops->nccl_unique_id(l->ops->ctx, id_out, why, sizeof why) != 0)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "kvx: ncclGetUniqueId failed: %s",
                          why[0] ? why : "?");
    return start(l, instance, now, id_out, err, errlen);
}

int tdm_kvx_link_join(struct tdm_kvx_link *l, uint64_t instance, double now,
                      const uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    if (l->role != TDM_KVX_PREFILL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: only the prefill side joins");
    return start(l, instance, now, id, err, errlen);
}

int tdm_kvx_link_poll(struct tdm_kvx_link *l, double now, char *err, size_t errlen)
{
    if (l->state == TDM_KVX_LINK_IDLE)
        return tdm_seterr(err, errlen, TDM_ECLOSED, "kvx: no communicator");
    enum tdm_kvx_comm_state st = TDM_KVX_COMM_ERROR;
    char why[192] = "";
    if (l->ops->nccl_state(l->ops->ctx, l->comm, &st, why, sizeof why) != 0 ||
        st == TDM_KVX_COMM_ERROR) {
        tdm_kvx_link_abort(l);
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "kvx: NCCL communicator error: %s",
                          why[0] ? why : "?");
    }
    if (st == TDM_KVX_COMM_READY) {
        l->state = TDM_KVX_LINK_READY;
        return TDM_OK;
    }
    // Pending: an operation on a ready communicator is the caller's deadline to
    // keep (it aborts); init has the link's own.
    if (l->state == TDM_KVX_LINK_INIT && now >= l->deadline) {
        tdm_kvx_link_abort(l);
        return tdm_seterr(err, errlen, TDM_ETIMEDOUT, "kvx: NCCL init not ready after %.1f s",
                          l->init_timeout_s);
    }
    return TDM_EBUSY;
}

bool tdm_kvx_link_ready_for(struct tdm_kvx_link *l, uint64_t instance)
{
    if (l->state != TDM_KVX_LINK_IDLE && l->instance != instance) {
        tdm_kvx_link_abort(l); // the peer restarted: its end of the communicator is gone
        return false;
    }
    return l->state == TDM_KVX_LINK_READY;
}

enum tdm_kvx_link_state tdm_kvx_link_state(const struct tdm_kvx_link *l)
{
    return l->state;
}

uint64_t tdm_kvx_link_aborts(const struct tdm_kvx_link *l)
{
    return l->aborts;
}

void *tdm_kvx_link_comm(const struct tdm_kvx_link *l)
{
    return l->state == TDM_KVX_LINK_READY ? l->comm : NULL;
}

uint64_t tdm_kvx_link_instance(const struct tdm_kvx_link *l)
{
    return l->state == TDM_KVX_LINK_IDLE ? 0 : l->instance;
}

bool tdm_kvx_link_id(const struct tdm_kvx_link *l, uint8_t id[TDM_KVX_NCCL_ID_BYTES])
{
    if (l->state == TDM_KVX_LINK_IDLE)
        return false;
    memcpy(id, l->id, TDM_KVX_NCCL_ID_BYTES);
    return true;
}

void tdm_kvx_link_extend(struct tdm_kvx_link *l, double now)
{
    if (l->state == TDM_KVX_LINK_INIT)
        l->deadline = now + l->init_timeout_s;
}

// ---- one link per peer ---------------------------------------------------------------------
struct links_entry {
    char peer[256]; // "" = free
    struct tdm_kvx_link *link;
    bool taken;
    uint64_t used;
};

struct tdm_kvx_links {
    pthread_mutex_t mu;
    const struct tdm_kvx_ops *ops;
    enum tdm_kvx_role role;
    double init_timeout_s;
    int capacity;
    uint64_t tick, aborts_freed;
    struct links_entry *e; // [capacity]
};

int tdm_kvx_links_new(struct tdm_kvx_links **out, const struct tdm_kvx_ops *ops,
                      enum tdm_kvx_role role, double init_timeout_s, int capacity)
{
    *out = NULL;
    struct tdm_kvx_link *probe = NULL; // checks the table and arguments once
    int rc = tdm_kvx_link_new(&probe, ops, role, init_timeout_s);
    if (rc != TDM_OK)
        return rc;
    tdm_kvx_link_free(probe);
    if (capacity < 1)
        return TDM_EINVAL;
    struct tdm_kvx_links *t = calloc(1, sizeof *t);
    if (t == NULL || (t->e = calloc((size_t)capacity, sizeof *t->e)) == NULL) {
        free(t);
        return TDM_ENOMEM;
    }
    pthread_mutex_init(&t->mu, NULL);
    t->ops = ops;
    t->role = role;
    t->init_timeout_s = init_timeout_s;
    t->capacity = capacity;
    *out = t;
    return TDM_OK;
}

void tdm_kvx_links_free(struct tdm_kvx_links *t)
{
    if (t == NULL)
        return;
    for (int i = 0; i < t->capacity; i++)
        tdm_kvx_link_free(t->e[i].link);
    pthread_mutex_destroy(&t->mu);
    free(t->e);
    free(t);
}

struct tdm_kvx_link *tdm_kvx_links_take(struct tdm_kvx_links *t, const char *peer)
{
    if (peer == NULL || peer[0] == '\0' || strlen(peer) >= sizeof t->e[0].peer)
        return NULL;
    struct tdm_kvx_link *l = NULL;
    pthread_mutex_lock(&t->mu);
    struct links_entry *hit = NULL, *spare = NULL;
    for (int i = 0; i < t->capacity && hit == NULL; i++) {
        struct links_entry *e = &t->e[i];
        if (e->peer[0] && strcmp(e->peer, peer) == 0)
            hit = e;
        else if (!e->taken && (spare == NULL || e->used < spare->used))
            spare = e; // a free entry has used 0: the least recent
    }
    if (hit == NULL && spare != NULL) {
        if (spare->link != NULL) {
            if (tdm_kvx_link_state(spare->link) == TDM_KVX_LINK_INIT)
                tdm_kvx_link_abort(spare->link); // counted; a ready one is destroyed
            t->aborts_freed += tdm_kvx_link_aborts(spare->link);
            tdm_kvx_link_free(spare->link); // an idle peer's communicator goes
            spare->link = NULL;
        }
        if (tdm_kvx_link_new(&spare->link, t->ops, t->role, t->init_timeout_s) == TDM_OK) {
            snprintf(spare->peer, sizeof spare->peer, "%s", peer);
            hit = spare;
        } else {
            spare->peer[0] = '\0';
        }
    }
    if (hit != NULL && !hit->taken) {
        hit->taken = true;
        hit->used = ++t->tick;
        l = hit->link;
    }
    pthread_mutex_unlock(&t->mu);
    return l;
}

void tdm_kvx_links_give(struct tdm_kvx_links *t, struct tdm_kvx_link *l)
{
    if (l == NULL)
        return;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->capacity; i++)
        if (t->e[i].link == l)
            t->e[i].taken = false;
    pthread_mutex_unlock(&t->mu);
}

uint64_t tdm_kvx_links_aborts(struct tdm_kvx_links *t)
{
    pthread_mutex_lock(&t->mu);
    uint64_t n = t->aborts_freed;
    for (int i = 0; i < t->capacity; i++)
        if (t->e[i].link != NULL)
            n += tdm_kvx_link_aborts(t->e[i].link);
    pthread_mutex_unlock(&t->mu);
    return n;
}
