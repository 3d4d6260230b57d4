// SPDX-License-Identifier: Apache-2.0
// kv_recv: the receiver side of the KV transport table (kv_transport.h): the
// decode worker's attempt prepares a mode before its PrefillRequest goes out,
// completes the mode's own receives once the prefill worker said it uses it,
// and aborts it after the attempt. Only NCCL receives anything itself (nng
// frames carry the KV, CUDA IPC frames say it is in place: the role imports
// or counts them). Memory safety: tdm_kv_recv_quiet is true only when every
// receive's event was observed complete; a receive whose completion cannot
// be observed leaves it false for good and its buffers allocated.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kv_transport_impl.h"

#define MOD "kvx"

struct tdm_kv_recv {
    struct tdm_kv_transport *t;
    const struct tdm_kv_transport_ops *ops;
    const struct tdm_kv_recv_host *host;
    struct tdm_kv_recv_params p; // p.dst_blocks points at dst_blocks below
    int *dst_blocks;             // [p.num_blocks]
    // NCCL: the pair's link while this attempt holds it, its communicator id,
    // the receives.
    struct tdm_kvx_link *link;
    bool has_id;
    uint8_t nccl_id[TDM_KVX_NCCL_ID_BYTES];
    struct tdm_kvx_nccl *nx;
};

static void pause_briefly(void)
{
    tdm_sleep(1e-4); // 0.1 ms: a layer group's receive takes well under a millisecond
}

int tdm_kv_recv_new(struct tdm_kv_recv **out, struct tdm_kv_transport *t,
                    const struct tdm_kv_transport_ops *ops, const struct tdm_kv_recv_host *host,
                    const struct tdm_kv_recv_params *p)
{
    *out = NULL;
    struct tdm_kv_recv *r = calloc(1, sizeof *r);
    if (r == NULL)
        return TDM_ENOMEM;
    r->t = t;
    r->ops = ops;
    r->host = host;
    r->p = *p;
    if (p->num_blocks > 0) {
        r->dst_blocks = malloc(sizeof(int) * (size_t)p->num_blocks);
        if (r->dst_blocks == NULL) {
            free(r);
            return TDM_ENOMEM;
        }
        memcpy(r->dst_blocks, p->dst_blocks, sizeof(int) * (size_t)p->num_blocks);
    }
    r->p.dst_blocks = r->dst_blocks;
    *out = r;
    return TDM_OK;
}

const struct tdm_kv_transport_ops *tdm_kv_recv_ops(const struct tdm_kv_recv *r)
{
    return r->ops;
}

bool tdm_kv_recv_nccl_id(const struct tdm_kv_recv *r, uint8_t id[TDM_KVX_NCCL_ID_BYTES])
{
    if (r == NULL || !r->has_id)
        return false;
    memcpy(id, r->nccl_id, TDM_KVX_NCCL_ID_BYTES);
    return true;
}

bool tdm_kv_recv_quiet(const struct tdm_kv_recv *r)
{
    return r == NULL || tdm_kvx_nccl_quiet(r->nx);
}

void tdm_kv_recv_free(struct tdm_kv_recv *r)
{
    if (r == NULL)
        return;
    free(r->dst_blocks);
    free(r);
}

bool tdm_kv_transport_last_ipc(struct tdm_kv_transport *t, const char *peer)
{
    enum tdm_kvx_mode last;
    return tdm_kvx_pairs_get(t->pairs, peer, &last) == 0 && last == TDM_KVX_CUDA_IPC;
}

size_t tdm_kv_transport_offer_pool(struct tdm_kv_transport *t, struct tdm_kvx_pool pool,
                                   uint8_t out[TDM_KVX_POOL_WIRE_BYTES])
{
    const struct tdm_kvx_ops *ops = t->c.ops;
    enum tdm_kvx_mode set = t->c.setting;
    bool ipc_ok =
        (set == TDM_KVX_AUTO || set == TDM_KVX_CUDA_IPC) && ops != NULL && ops->ipc_export != NULL;
    if (!t->gpu || (!ipc_ok && !t->nccl))
        return 0;
    pool.gpu = true;
    pool.nccl = t->nccl;
    char why[192] = "";
    bool exported =
        ipc_ok && ops->ipc_export(ops->ctx, t->c.pool_base, pool.handle, why, sizeof why) == 0;
    if (ipc_ok && !exported)
        TDM_LOG_WARN(MOD, "KV pool not exported for CUDA IPC (KV comes over %s): %s",
                     t->nccl ? "NCCL or nng" : "nng", why);
    if (!exported && !t->nccl)
        return 0;
    tdm_kvx_pool_encode(&pool, out);
    return TDM_KVX_POOL_WIRE_BYTES;
}

// Makes our KV pool's device current on the calling thread (the CUDA
// runtime's current device is per thread).
static int use_our_device(const struct tdm_kv_transport *t, char *err, size_t errlen)
{
    const struct tdm_kvx_ops *o = t->c.ops;
    char why[192] = "";
    if (o->use_device_of != NULL && o->use_device_of(o->ctx, t->c.pool_base, why, sizeof why) != 0)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "%s", why);
    return TDM_OK;
}

// ---- nng and CUDA IPC: the frames are the transfer --------------------------------------
int tdm_kv_frames_prepare(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    (void)r, (void)err, (void)errlen;
    return TDM_OK;
}

int tdm_kv_frames_complete(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    (void)r, (void)err, (void)errlen;
    return TDM_OK;
}

void tdm_kv_frames_abort(struct tdm_kv_recv *r)
{
    (void)r;
}

// ---- NCCL: the receives of one attempt ----------------------------------------------------
// Takes the pair's link (busy with another transfer of the pair: not offered
// this time), keeps its communicator when it is ready for this prefill
// instance, else makes a new one (a new unique id; the old communicator
// aborted), and cuts the receives. TDM_EBUSY when NCCL is not offered.
int tdm_kv_nccl_prepare(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    struct tdm_kv_transport *t = r->t;
    if (!t->nccl || r->p.num_blocks < 1 || tdm_kv_transport_last_ipc(t, r->p.peer))
        return TDM_EBUSY;
    r->link = tdm_kvx_links_take(t->links, r->p.peer);
    if (r->link == NULL)
        return TDM_EBUSY;
    int rc = use_our_device(t, err, errlen); // the init starts on this thread
    if (rc == TDM_OK && (!tdm_kvx_link_ready_for(r->link, r->p.peer_instance) ||
                         !tdm_kvx_link_id(r->link, r->nccl_id)))
        rc = tdm_kvx_link_create(r->link, r->p.peer_instance, tdm_now(), r->nccl_id, err, errlen);
    struct tdm_kvx_pool geom = {.block_bytes = t->c.block_bytes,
                                .num_layers = (uint32_t)t->c.num_layers,
                                .num_blocks = (uint32_t)t->c.num_blocks};
    if (rc == TDM_OK)
        rc = tdm_kvx_nccl_new(&r->nx, t->c.ops, TDM_KVX_DECODE, &geom, r->dst_blocks, NULL,
                              r->p.num_blocks, t->c.own_layer, t->c.own_arg, r->p.layers_per_group,
                              err, errlen);
    if (rc == TDM_OK) {
        r->has_id = true;
        return TDM_OK;
    }
    TDM_LOG_WARN(MOD, "req=%s NCCL not offered to %s: %s", r->p.request_id, r->p.peer, err);
    tdm_kvx_nccl_free(r->nx);
    r->nx = NULL;
    tdm_kvx_links_give(t->links, r->link);
    r->link = NULL;
    return TDM_EBUSY;
}

// Waits for the communicator's init (nccl_timeout from the sender's go).
static int nccl_await_init(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    int rc;
    tdm_kvx_link_extend(r->link, tdm_now());
    while ((rc = tdm_kvx_link_poll(r->link, tdm_now(), err, errlen)) == TDM_EBUSY) {
        const char *stop = r->host->stop(r->host->ctx);
        if (stop != NULL) {
            tdm_kvx_link_abort(r->link);
            return tdm_seterr(err, errlen, TDM_ECLOSED, "NCCL init: %s", stop);
        }
        pause_briefly();
    }
    return rc;
}

// Layers [first, first + n) as grouped receives into the reserved blocks;
// the group's event awaited while the communicator is polled. Any error, a
// timeout or the attempt's stop aborts the communicator (its kernels end; the
// event then completes), awaited at most nccl_timeout more.
static int nccl_group(struct tdm_kv_recv *r, int first, int n, char *err, size_t errlen)
{
    double timeout = r->t->c.nccl_timeout;
    double t0 = tdm_now();
    int rc = tdm_kvx_nccl_layers(r->nx, tdm_kvx_link_comm(r->link), first, n, err, errlen);
    bool aborted = rc != TDM_OK;
    if (aborted)
        tdm_kvx_link_abort(r->link);
    double give_up = aborted ? t0 + timeout : 0;
    int q;
    while ((q = tdm_kvx_nccl_poll(r->nx)) == TDM_EBUSY) {
        double now = tdm_now();
        if (!aborted) {
            char why[256] = "";
            int lrc = tdm_kvx_link_poll(r->link, now, why, sizeof why);
            const char *stop = lrc != TDM_OK && lrc != TDM_EBUSY ? why
                               : now - t0 > timeout              ? "receive timed out"
                                                                 : r->host->stop(r->host->ctx);
            if (stop != NULL) {
                rc = tdm_seterr(err, errlen, TDM_ETRANSPORT, "NCCL receive of layers %d..%d: %s",
                                first, first + n - 1, stop);
                tdm_kvx_link_abort(r->link);
                aborted = true;
                give_up = now + timeout;
            }
        } else if (now > give_up) {
            break; // not observed: never quiet
        }
        pause_briefly();
    }
    if (rc == TDM_OK && q != TDM_OK) {
        tdm_kvx_link_abort(r->link);
        rc = tdm_seterr(err, errlen, TDM_ETRANSPORT, "NCCL receive of layers %d..%d failed", first,
                        first + n - 1);
    }
    return rc;
}

// Once the prefill worker says it sends over the communicator: init, then
// each layer group's receives, progress reported. The link goes back at the
// end (the pair's next transfer may use it). TDM_OK, TDM_ENOTFOUND (the KV
// came another way: nothing received), or the error that fails the transfer.
int tdm_kv_nccl_complete(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    int L = r->t->c.num_layers, per = r->p.layers_per_group;
    int go = r->host->wait_go(r->host->ctx);
    if (go == TDM_OK && use_our_device(r->t, err, errlen) != TDM_OK)
        go = TDM_ECLOSED; // aborted below; the transfer fails over
    int rc = TDM_OK;
    if (go == TDM_ECLOSED) {
        // The transfer failed or ended before any send: whatever state the
        // peer's end is in (an init that timed out, an abort), this end is
        // rebuilt by the next transfer rather than trusted.
        tdm_kvx_link_abort(r->link);
        rc = tdm_seterr(err, errlen, TDM_ECLOSED, "ended before the NCCL sends");
    }
    if (go == TDM_OK)
        rc = nccl_await_init(r, err, errlen);
    for (int first = 0; go == TDM_OK && rc == TDM_OK && first < L; first += per) {
        int n = first + per <= L ? per : L - first;
        rc = nccl_group(r, first, n, err, errlen);
        if (rc == TDM_OK)
            r->host->progress(r->host->ctx, n, tdm_kvx_nccl_bytes(r->nx));
    }
    if (!tdm_kvx_nccl_quiet(r->nx))
        TDM_LOG_ERR(MOD, "req=%s an NCCL receive's completion is unknown: its blocks stay reserved",
                    r->p.request_id);
    tdm_kvx_links_give(r->t->links, r->link); // the pair's next transfer may use it now
    r->link = NULL;
    return go == TDM_ENOTFOUND ? TDM_ENOTFOUND : rc;
}

void tdm_kv_nccl_abort(struct tdm_kv_recv *r)
{
    if (tdm_kvx_nccl_quiet(r->nx)) {
        tdm_kvx_nccl_free(r->nx); // else its staging buffer must not be freed under it
        r->nx = NULL;
    }
    tdm_kvx_links_give(r->t->links, r->link); // prepared, never completed
    r->link = NULL;
}
