// SPDX-License-Identifier: Apache-2.0
// kv_recv: the receiver side of the KV transport table (kv_transport.h): the
// decode worker's attempt offers every mode it can receive by before its
// PrefillRequest goes out, hands each KvData frame to the table of the mode
// that sent it, runs the receives of a mode that has its own (NCCL) on its
// receive thread, and ends the offered modes after the attempt. Each mode
// checks its frames against the transfer (layers in order, the push range,
// the payload's size) and keeps the transfer's progress: nng imports the
// payload through the role's host, CUDA IPC counts the layers the sender
// copied into our blocks, NCCL counts the sender's groups and its own
// receives (a layer is in place when both are done). Memory safety:
// tdm_kv_recv_quiet is true only when every receive's event was observed
// complete; a receive whose completion cannot be observed leaves it false for
// good and its buffers allocated.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kv_transport_impl.h"

#define MOD "kvx"

struct tdm_kv_recv {
    struct tdm_kv_transport *t;
    const struct tdm_kv_recv_host *host;
    struct tdm_kv_recv_params p; // p.dst_blocks points at dst_blocks below
    int *dst_blocks;             // [p.num_blocks] (offered only)
    bool offered[TDM_KVX_NCCL + 1]; // [enum tdm_kvx_mode] the modes offered (set before any
                                    // frame, read-only after)
    // The transfer's progress, under mu: frames (the role's reader thread),
    // the receives (its receive thread) and the role's reads meet here.
    pthread_mutex_t mu;
    const struct tdm_kv_transport_ops *mode; // the first frame's mode (nng before any)
    char why[160];                           // the first layers' transport_why
    int layers_framed;   // layers the frames said are in place: the next frame's first layer
    int layers_received; // NCCL: layers our own receives completed
    int layers_done;     // layers in place (what the role sees)
    bool go;             // NCCL: the sender said it sends over the communicator
    size_t bytes_done;
    double t_first_frame, t_kv_done;
    // NCCL: the pair's link while this attempt holds it, its communicator id,
    // the receives (the receive thread's after the offer).
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
                    const struct tdm_kv_recv_host *host, const struct tdm_kv_recv_params *p)
{
    *out = NULL;
    struct tdm_kv_recv *r = calloc(1, sizeof *r);
    if (r == NULL)
        return TDM_ENOMEM;
    r->t = t;
    r->host = host;
    r->p = *p;
    if (p->offered && p->dst_blocks != NULL && p->num_blocks > 0) {
        r->dst_blocks = malloc(sizeof(int) * (size_t)p->num_blocks);
        if (r->dst_blocks == NULL) {
            free(r);
            return TDM_ENOMEM;
        }
        memcpy(r->dst_blocks, p->dst_blocks, sizeof(int) * (size_t)p->num_blocks);
    }
    r->p.offered = r->dst_blocks != NULL;
    r->p.dst_blocks = r->dst_blocks;
    pthread_mutex_init(&r->mu, NULL);
    r->mode = &tdm_kv_transport_nng_ops;
    if (p->num_blocks < 1)
        r->layers_done = t->c.num_layers; // nothing to receive: complete
    *out = r;
    return TDM_OK;
}

void tdm_kv_recv_offer(struct tdm_kv_recv *r)
{
    for (int m = TDM_KVX_NNG; m <= TDM_KVX_NCCL; m++) {
        const struct tdm_kv_transport_ops *ops = tdm_kv_transport_of((enum tdm_kvx_mode)m);
        char err[256] = "";
        r->offered[m] = ops->prepare(r, err, sizeof err) == TDM_OK;
    }
}

bool tdm_kv_recv_offered(const struct tdm_kv_recv *r, enum tdm_kvx_mode m)
{
    return m >= TDM_KVX_NNG && m <= TDM_KVX_NCCL && r->offered[m];
}

bool tdm_kv_recv_receives(const struct tdm_kv_recv *r)
{
    for (int m = TDM_KVX_NNG; m <= TDM_KVX_NCCL; m++)
        if (r->offered[m] && tdm_kv_transport_of((enum tdm_kvx_mode)m)->complete != NULL)
            return true;
    return false;
}

int tdm_kv_recv_complete(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    int rc = TDM_OK;
    for (int m = TDM_KVX_NNG; m <= TDM_KVX_NCCL && rc == TDM_OK; m++) {
        const struct tdm_kv_transport_ops *ops = tdm_kv_transport_of((enum tdm_kvx_mode)m);
        if (r->offered[m] && ops->complete != NULL)
            rc = ops->complete(r, err, errlen);
    }
    return rc;
}

void tdm_kv_recv_withdraw(struct tdm_kv_recv *r)
{
    for (int m = TDM_KVX_NNG; m <= TDM_KVX_NCCL; m++) {
        const struct tdm_kv_transport_ops *ops = tdm_kv_transport_of((enum tdm_kvx_mode)m);
        if (!r->offered[m] || ops->complete == NULL)
            continue;
        if (ops->abort != NULL)
            ops->abort(r);
        r->offered[m] = false;
    }
}

void tdm_kv_recv_end(struct tdm_kv_recv *r)
{
    for (int m = TDM_KVX_NNG; m <= TDM_KVX_NCCL; m++) {
        const struct tdm_kv_transport_ops *ops = tdm_kv_transport_of((enum tdm_kvx_mode)m);
        if (r->offered[m] && ops->abort != NULL)
            ops->abort(r);
    }
}

const struct tdm_kv_transport_ops *tdm_kv_recv_table(const char *transport, char *err,
                                                     size_t errlen)
{
    const struct tdm_kv_transport_ops *ops = tdm_kv_transport_by_name(transport);
    if (ops == NULL) {
        // The peer's bytes: at most 32 of them, printable, in the message.
        char name[33];
        size_t n = 0;
        for (; transport[n] && n < sizeof name - 1; n++)
            name[n] = transport[n] >= 0x20 && transport[n] < 0x7f ? transport[n] : '?';
        name[n] = '\0';
        tdm_seterr(err, errlen, TDM_EPROTO,
                   "KvData over transport \"%s%s\", which this worker does not know (it "
                   "receives by nng, cuda-ipc, nccl): refused",
                   name, transport[n] ? "..." : "");
    }
    return ops;
}

void tdm_kv_recv_progress(struct tdm_kv_recv *r, struct tdm_kv_recv_progress *p)
{
    pthread_mutex_lock(&r->mu);
    p->mode = r->mode;
    snprintf(p->why, sizeof p->why, "%s", r->why);
    p->layers_done = r->layers_done;
    p->bytes_done = r->bytes_done;
    p->t_first_frame = r->t_first_frame;
    p->t_kv_done = r->t_kv_done;
    pthread_mutex_unlock(&r->mu);
}

bool tdm_kv_recv_nccl_id(const struct tdm_kv_recv *r, uint8_t id[TDM_KVX_NCCL_ID_BYTES])
{
    if (r == NULL || !r->has_id || !r->offered[TDM_KVX_NCCL])
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
    pthread_mutex_destroy(&r->mu);
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

// ---- the frames ----------------------------------------------------------------------------
// The first layers of the transfer came over `mode` (caller holds r->mu).
static void first_layers_locked(struct tdm_kv_recv *r, const struct tdm_kv_transport_ops *mode,
                                const struct tdm_kv_recv_frame *f)
{
    r->mode = mode;
    snprintf(r->why, sizeof r->why, "%s", f->why ? f->why : "");
}

// An in-place frame's layers and blocks against the transfer (caller holds r->mu).
static int check_in_place(const struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                          size_t errlen)
{
    if (f->first_block != r->p.first_block || f->num_blocks != r->p.num_blocks ||
        f->first_layer != r->layers_framed || f->num_layers < 1 ||
        f->first_layer + f->num_layers > r->t->c.num_layers || f->payload_len != 0)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "bad in-place KvData: layers %d+%d blocks %d+%d (expected layer %d)",
                          f->first_layer, f->num_layers, f->first_block, f->num_blocks,
                          r->layers_framed);
    return TDM_OK;
}

// ---- nng: each frame carries its layers' KV ------------------------------------------------
int tdm_kv_nng_prepare(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    (void)r, (void)err, (void)errlen;
    return TDM_OK; // always possible
}

// The frame's layers imported straight from its payload into the reserved blocks.
int tdm_kv_nng_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                     size_t errlen)
{
    size_t lb = r->p.payload_layer_bytes;
    int L = r->t->c.num_layers;
    pthread_mutex_lock(&r->mu);
    int rc = TDM_OK;
    if (f->first_block != r->p.first_block || f->num_blocks != r->p.num_blocks ||
        f->first_layer != r->layers_framed || f->num_layers < 1 ||
        f->first_layer + f->num_layers > L || f->payload_len != lb * (size_t)f->num_layers)
        rc = tdm_seterr(err, errlen, TDM_EPROTO,
                        "bad KvData: layers %d+%d blocks %d+%d payload %zu (expected layer %d, "
                        "blocks %d+%d, %zu bytes a layer)",
                        f->first_layer, f->num_layers, f->first_block, f->num_blocks,
                        f->payload_len, r->layers_framed, r->p.first_block, r->p.num_blocks, lb);
    for (int l = 0; rc == TDM_OK && l < f->num_layers; l++) {
        int irc = r->host->import_layer(r->host->ctx, f->first_layer + l,
                                        f->payload + (size_t)l * lb, lb);
        if (irc != TDM_OK)
            rc = tdm_seterr(err, errlen, irc, "import of layer %d failed: %s", f->first_layer + l,
                            tdm_strerror(irc));
    }
    if (rc == TDM_OK) {
        if (r->layers_framed == 0) {
            r->t_first_frame = tdm_now();
            first_layers_locked(r, &tdm_kv_transport_nng_ops, f);
        }
        r->layers_framed += f->num_layers;
        r->layers_done = r->layers_framed;
        r->bytes_done += f->payload_len;
        if (r->layers_done >= L)
            r->t_kv_done = tdm_now();
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

// ---- CUDA IPC: the sender copies into our pool, its frames say where it got ----------------
int tdm_kv_ipc_prepare(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    (void)err, (void)errlen;
    return r->p.offered ? TDM_OK : TDM_EBUSY; // our pool's handle goes with the request
}

// Layers the sender copied into our blocks; the bytes are its copies' (K and
// V of each block of each layer).
int tdm_kv_ipc_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                     size_t errlen)
{
    int L = r->t->c.num_layers;
    pthread_mutex_lock(&r->mu);
    int rc =
        r->offered[TDM_KVX_CUDA_IPC]
            ? check_in_place(r, f, err, errlen)
            : tdm_seterr(err, errlen, TDM_EPROTO, "in-place KvData for a transfer offered no pool");
    if (rc == TDM_OK) {
        if (r->layers_framed == 0) {
            r->t_first_frame = tdm_now();
            first_layers_locked(r, &tdm_kv_transport_cuda_ipc_ops, f);
        }
        r->layers_framed += f->num_layers;
        r->layers_done = r->layers_framed;
        r->bytes_done += (size_t)f->num_layers * 2 * (size_t)f->num_blocks * r->t->c.block_bytes;
        if (r->layers_done >= L)
            r->t_kv_done = tdm_now();
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

// ---- NCCL: the receives of one attempt ----------------------------------------------------
// With our pool offered: takes the pair's link (busy with another transfer
// of the pair: not offered this time), keeps its communicator when it is
// ready for this prefill instance, else makes a new one (a new unique id; the
// old communicator aborted), and cuts the receives. TDM_EBUSY when NCCL is
// not offered.
int tdm_kv_nccl_prepare(struct tdm_kv_recv *r, char *err, size_t errlen)
{
    struct tdm_kv_transport *t = r->t;
    if (!t->nccl || !r->p.offered || r->p.num_blocks < 1 || tdm_kv_transport_last_ipc(t, r->p.peer))
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

// Over NCCL a layer is in place once the sender's frame for it came (its
// send completed) and our receive completed (caller holds r->mu).
static void nccl_count_locked(struct tdm_kv_recv *r)
{
    int L = r->t->c.num_layers;
    bool nccl = r->mode == &tdm_kv_transport_nccl_ops; // else another mode's frames came
    r->layers_done =
        nccl && r->layers_received < r->layers_framed ? r->layers_received : r->layers_framed;
    if (nccl && r->t_kv_done == 0 && r->layers_framed >= L && r->layers_received >= L)
        r->t_kv_done = tdm_now();
}

// First "post your receives" (no layers: the sends follow over the
// communicator, our receive thread goes), then a frame per group whose
// sends completed.
int tdm_kv_nccl_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                      size_t errlen)
{
    pthread_mutex_lock(&r->mu);
    int rc = TDM_OK;
    if (!r->offered[TDM_KVX_NCCL]) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO,
                        "in-place KvData for a transfer offered no NCCL communicator");
    } else if (f->num_layers == 0 && r->layers_framed == 0) {
        r->go = true;
        r->mode = &tdm_kv_transport_nccl_ops;
        r->t_first_frame = tdm_now();
    } else if ((rc = check_in_place(r, f, err, errlen)) == TDM_OK) {
        if (r->layers_framed == 0)
            first_layers_locked(r, &tdm_kv_transport_nccl_ops, f);
        r->layers_framed += f->num_layers;
        nccl_count_locked(r);
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

// Whether the sender said it sends over the communicator.
static bool nccl_go(struct tdm_kv_recv *r)
{
    pthread_mutex_lock(&r->mu);
    bool go = r->go;
    pthread_mutex_unlock(&r->mu);
    return go;
}

// n more layers received into our blocks; bytes: the receives' total.
static void nccl_received(struct tdm_kv_recv *r, int n, uint64_t bytes)
{
    pthread_mutex_lock(&r->mu);
    r->layers_received += n;
    r->bytes_done = (size_t)bytes;
    nccl_count_locked(r);
    pthread_mutex_unlock(&r->mu);
    r->host->progress(r->host->ctx);
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
    if (go == TDM_OK && !nccl_go(r))
        go = TDM_ENOTFOUND; // the first frame was of another mode
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
            nccl_received(r, n, tdm_kvx_nccl_bytes(r->nx));
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
