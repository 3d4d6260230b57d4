// SPDX-License-Identifier: Apache-2.0
// kv_send: the sender side of the KV transport table (kv_transport.h): the
// worker-wide transport (IPC handle cache, NCCL links, pairs for /health),
// the choice of a transfer's mode, and the three modes' tables. The device
// modes share one layer-group step (lease, issue, wait, unlease, frame);
// each fills in only how it issues, waits and counts. Invariant: a lease is
// dropped only when the mode says no copy of the group can still read it;
// otherwise it stays with the job (its blocks are never reused) and the
// error is logged once here.
#include "kv_transport.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kv_transport_impl.h"

#define MOD "kvx"

// ---- the worker-wide side ----------------------------------------------------------------
int tdm_kv_transport_new(struct tdm_kv_transport **out, const struct tdm_kv_transport_config *c)
{
    *out = NULL;
    struct tdm_kv_transport *t = calloc(1, sizeof *t);
    if (t == NULL)
        return TDM_ENOMEM;
    t->c = *c;
    t->gpu = t->c.ops != NULL && c->gpu;
    pthread_mutex_init(&t->ipc_mu, NULL);
    tdm_kvx_host_id(t->host_id, sizeof t->host_id);
    int rc = tdm_kvx_pairs_new(&t->pairs, 64);
    if (rc == TDM_OK && t->c.ops != NULL)
        rc = tdm_kvx_ipc_cache_new(&t->ipc, t->c.ops, 16);
    // NCCL where the table has its calls (a fake table in tests may not).
    bool calls = c->role == TDM_KVX_PREFILL ? t->c.ops && t->c.ops->nccl_send != NULL
                                            : t->c.ops && t->c.ops->nccl_recv != NULL;
    if (rc == TDM_OK && t->gpu && (c->setting == TDM_KVX_AUTO || c->setting == TDM_KVX_NCCL) &&
        calls && tdm_kvx_links_new(&t->links, t->c.ops, c->role, c->nccl_timeout, 64) == TDM_OK)
        t->nccl = true;
    if (rc != TDM_OK) {
        tdm_kv_transport_free(t);
        return rc;
    }
    *out = t;
    return TDM_OK;
}

void tdm_kv_transport_free(struct tdm_kv_transport *t)
{
    if (t == NULL)
        return;
    tdm_kvx_links_free(t->links);
    tdm_kvx_ipc_cache_free(t->ipc);
    tdm_kvx_pairs_free(t->pairs);
    pthread_mutex_destroy(&t->ipc_mu);
    free(t);
}

void tdm_kv_transport_note(struct tdm_kv_transport *t, const char *peer, enum tdm_kvx_mode m,
                           const char *why)
{
    tdm_kvx_pairs_note(t->pairs, peer, m, why);
}

void tdm_kv_transport_health(struct tdm_kv_transport *t, char *buf, size_t len)
{
    tdm_kvx_pairs_json(t->pairs, t->c.setting, buf, len);
}

const char *tdm_kv_transport_setting_name(const struct tdm_kv_transport *t)
{
    return tdm_kvx_mode_name(t->c.setting);
}

const char *tdm_kv_transport_host_id(const struct tdm_kv_transport *t)
{
    return t->host_id;
}

bool tdm_kv_transport_has_nccl(const struct tdm_kv_transport *t)
{
    return t->nccl;
}

const struct tdm_kvx_ops *tdm_kv_transport_ops_table(const struct tdm_kv_transport *t)
{
    return t->c.ops;
}

// ---- one transfer ------------------------------------------------------------------------
struct tdm_kv_send {
    struct tdm_kv_transport *t;
    const struct tdm_kv_send_host *host;
    struct tdm_kv_send_params p; // p.dst_blocks points at dst_blocks below
    int *dst_blocks;             // [p.num_blocks] the decode worker's physical ids
    int *src_blocks;             // [p.num_blocks] ours (leased per group)
    char peer_setting[16];       // copies of p's strings that come from the request
    char peer_host[96];
    const struct tdm_kv_transport_ops *ops; // the mode chosen last (nng until then)
    char why[160];
    bool ipc_failed; // CUDA IPC was chosen and could not be offered
    bool closed_sent;
    bool group_moved;          // the last device group completed (its frame was tried)
    struct tdm_kvx_push *dev;  // CUDA IPC: the copies
    struct tdm_kvx_link *link; // NCCL: the pair's link while this transfer holds it
    struct tdm_kvx_nccl *nx;   // NCCL: the sends
};

static void pause_briefly(void)
{
    tdm_sleep(1e-4); // a layer group's copy takes well under a millisecond
}

int tdm_kv_send_new(struct tdm_kv_send **out, struct tdm_kv_transport *t,
                    const struct tdm_kv_send_host *host, const struct tdm_kv_send_params *p)
{
    *out = NULL;
    struct tdm_kv_send *s = calloc(1, sizeof *s);
    if (s == NULL)
        return TDM_ENOMEM;
    s->t = t;
    s->host = host;
    s->p = *p;
    s->ops = &tdm_kv_transport_nng_ops;
    if (p->offered && p->num_blocks > 0) {
        s->dst_blocks = malloc(sizeof(int) * (size_t)p->num_blocks);
        if (s->dst_blocks == NULL) {
            free(s);
            return TDM_ENOMEM;
        }
        memcpy(s->dst_blocks, p->dst_blocks, sizeof(int) * (size_t)p->num_blocks);
    }
    s->p.dst_blocks = s->dst_blocks;
    snprintf(s->peer_setting, sizeof s->peer_setting, "%s", p->peer_setting ? p->peer_setting : "");
    snprintf(s->peer_host, sizeof s->peer_host, "%s", p->peer_host ? p->peer_host : "");
    s->p.peer_setting = s->peer_setting;
    s->p.peer_host = s->peer_host;
    *out = s;
    return TDM_OK;
}

int tdm_kv_send_check_offer(const uint8_t *wire, size_t len, size_t n_block_ids, int num_blocks,
                            struct tdm_kvx_pool *pool, char *err, size_t errlen)
{
    int rc = tdm_kvx_pool_decode(pool, wire, len, err, errlen);
    if (rc == TDM_OK && n_block_ids != (size_t)num_blocks)
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv_pool with %zu block ids for %d blocks",
                        n_block_ids, num_blocks);
    return rc;
}

const struct tdm_kv_transport_ops *tdm_kv_send_ops(const struct tdm_kv_send *s)
{
    return s->ops;
}

const char *tdm_kv_send_why(const struct tdm_kv_send *s)
{
    return s->why;
}

void tdm_kv_send_mark_closed(struct tdm_kv_send *s)
{
    s->closed_sent = true;
}

void tdm_kv_send_free(struct tdm_kv_send *s)
{
    if (s == NULL)
        return;
    if (s->p.offered && !s->closed_sent) {
        int q;
        while ((q = s->ops->poll(s)) == TDM_EBUSY)
            pause_briefly();
        struct tdm_kv_frame f = {
            .mode = s->ops->mode, .transport = s->ops->name, .why = "", .closed = true};
        char err[256];
        if (q == TDM_OK && s->host->send(s->host->ctx, &f, err, sizeof err) == TDM_OK)
            s->closed_sent = true;
    }
    s->ops->close(s);
    free(s->dst_blocks);
    free(s->src_blocks);
    free(s);
}

// Device-to-device needs the decode worker's pool to be laid out like ours.
static int same_layout(const struct tdm_kv_send *s, char *err, size_t errlen)
{
    const struct tdm_kv_transport_config *c = &s->t->c;
    const struct tdm_kvx_pool *pool = &s->p.pool;
    if (pool->elem_bytes != (uint32_t)c->elem_bytes || pool->block_bytes != c->block_bytes ||
        pool->num_layers != (uint32_t)c->num_layers)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "KV layouts differ (decode %u-byte elements, %llu-byte blocks; "
                          "prefill %d, %zu)",
                          pool->elem_bytes, (unsigned long long)pool->block_bytes, c->elem_bytes,
                          c->block_bytes);
    return TDM_OK;
}

// Our block ids of the push range into s->src_blocks: the prompt's table is
// fixed from the final step on; leased (and dropped) here only to read it,
// each group leases again.
static int read_src_blocks(struct tdm_kv_send *s, char *err, size_t errlen)
{
    int n = s->p.num_blocks;
    free(s->src_blocks);
    s->src_blocks = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (s->src_blocks == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    if (n > 0 && s->host->lease(s->host->ctx, 1, s->src_blocks) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "the prompt's KV is not exportable");
    if (n > 0)
        s->host->unlease(s->host->ctx);
    return TDM_OK;
}

// ---- nng: KV frames through host memory ---------------------------------------------------
static int nng_offer(struct tdm_kv_send *s, char *err, size_t errlen)
{
    (void)s, (void)err, (void)errlen;
    return TDM_OK;
}

// One KvData frame whose payload the role exports from the engine's blocks.
static int nng_push_layers(struct tdm_kv_send *s, int first, int n, size_t *bytes, double *copy_s,
                           char *err, size_t errlen)
{
    struct tdm_kv_frame f = {.mode = TDM_KVX_NNG,
                             .transport = "nng",
                             .why = first == 0 ? s->why : "",
                             .first_layer = first,
                             .num_layers = n,
                             .num_blocks = s->p.num_blocks,
                             .payload = true};
    *bytes = s->p.payload_layer_bytes * (size_t)n;
    *copy_s = 0;
    return s->host->send(s->host->ctx, &f, err, errlen);
}

static int nng_poll(struct tdm_kv_send *s)
{
    (void)s;
    return TDM_OK; // no copy outlives its frame
}

static void nng_close(struct tdm_kv_send *s)
{
    (void)s;
}

const struct tdm_kv_transport_ops tdm_kv_transport_nng_ops = {
    .mode = TDM_KVX_NNG,
    .name = "nng",
    .in_place = false,
    .offer = nng_offer,
    .push_layers = nng_push_layers,
    .poll = nng_poll,
    .close = nng_close,
    .prepare = tdm_kv_nng_prepare,
    .frame = tdm_kv_nng_frame,
};

// ---- the device modes' layer group --------------------------------------------------------
// How a device mode issues a group, waits for it and counts what it moved.
struct device_mode {
    uint64_t (*bytes)(const struct tdm_kv_send *s);
    int (*issue)(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen);
    // Waits until the group is no longer pending (or its fate is given up on);
    // returns the last poll and may turn *rc into the reason it stopped.
    int (*wait)(struct tdm_kv_send *s, int first, int n, double t0, int *rc, char *err,
                size_t errlen);
    bool (*quiet)(const struct tdm_kv_send *s);
    int (*failed)(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen);
    const char *unknown; // the log line when a completion stays unknown
};

// Layers [first, first + n) straight into the decode worker's blocks: leased
// source blocks, the mode's copies, their completion awaited (even after a
// failed issue: the lease must outlive every copy reading our blocks), then a
// KvData frame without payload saying they are in place (the last closes).
static int device_group(struct tdm_kv_send *s, const struct device_mode *m, int first, int n,
                        size_t *bytes, double *copy_s, char *err, size_t errlen)
{
    uint64_t bytes0 = m->bytes(s);
    s->group_moved = false;
    *bytes = 0;
    *copy_s = 0;
    if (s->host->lease(s->host->ctx, first + n, s->src_blocks) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "layers %d..%d not exportable", first,
                          first + n - 1);
    // From the lease on (it waited for the engine's kernels writing these
    // layers): the copy's own time, issue to observed completion.
    double t0 = tdm_now();
    int rc = m->issue(s, first, n, err, errlen);
    int q = m->wait(s, first, n, t0, &rc, err, errlen);
    if (m->quiet(s))
        s->host->unlease(s->host->ctx);
    else // only this process's exit ends such a copy
        TDM_LOG_ERR(MOD, "req=%s %s: blocks stay leased", s->p.request_id, m->unknown);
    if (rc == TDM_OK && q != TDM_OK)
        rc = m->failed(s, first, n, err, errlen);
    if (rc != TDM_OK)
        return rc;
    // Issue to observed completion (polled every 0.1 ms: slightly long).
    *copy_s = tdm_now() - t0;
    *bytes = (size_t)(m->bytes(s) - bytes0);
    s->group_moved = true;
    struct tdm_kv_frame f = {.mode = s->ops->mode,
                             .transport = s->ops->name,
                             .why = first == 0 ? s->why : "",
                             .first_layer = first,
                             .num_layers = n,
                             .num_blocks = s->p.num_blocks,
                             .closed = first + n == s->t->c.num_layers,
                             .copy_seconds = *copy_s};
    rc = s->host->send(s->host->ctx, &f, err, errlen);
    if (rc == TDM_OK && f.closed)
        s->closed_sent = true;
    return rc;
}

// ---- CUDA IPC: copies into the decode worker's opened pool --------------------------------
// Opens the decode worker's pool handle (cached per peer instance) and
// prepares the copies. Any failure: TDM_EBUSY (choose again without it).
static int ipc_offer(struct tdm_kv_send *s, char *err, size_t errlen)
{
    struct tdm_kv_transport *t = s->t;
    int rc = same_layout(s, err, errlen);
    void *base = NULL;
    if (rc == TDM_OK) {
        pthread_mutex_lock(&t->ipc_mu);
        rc = tdm_kvx_ipc_cache_get(t->ipc, s->p.peer, s->p.peer_instance, s->p.pool.handle, &base,
                                   err, errlen);
        pthread_mutex_unlock(&t->ipc_mu);
    }
    if (rc == TDM_OK)
        rc = read_src_blocks(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_kvx_push_new(&s->dev, t->c.ops, &s->p.pool, base, s->dst_blocks, t->c.own_layer,
                              t->c.own_arg, s->src_blocks, s->p.num_blocks, err, errlen);
    if (rc == TDM_OK) {
        snprintf(s->why, sizeof s->why, "same host, pool handle open");
        return TDM_OK;
    }
    TDM_LOG_WARN(MOD, "req=%s cuda-ipc to %s not possible: %s", s->p.request_id, s->p.peer, err);
    snprintf(s->why, sizeof s->why, "cuda-ipc failed: %.140s", err);
    tdm_kvx_push_free(s->dev);
    s->dev = NULL;
    s->ipc_failed = true;
    return TDM_EBUSY;
}

static uint64_t ipc_bytes(const struct tdm_kv_send *s)
{
    return tdm_kvx_push_bytes(s->dev);
}

static int ipc_issue(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen)
{
    return tdm_kvx_push_layers(s->dev, first, n, err, errlen);
}

static int ipc_wait(struct tdm_kv_send *s, int first, int n, double t0, int *rc, char *err,
                    size_t errlen)
{
    (void)first, (void)n, (void)t0, (void)rc, (void)err, (void)errlen;
    int q;
    while ((q = tdm_kvx_push_poll(s->dev)) == TDM_EBUSY)
        pause_briefly();
    return q;
}

static bool ipc_quiet(const struct tdm_kv_send *s)
{
    return tdm_kvx_push_quiet(s->dev);
}

static int ipc_failed(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen)
{
    (void)s;
    return tdm_seterr(err, errlen, TDM_EBACKEND, "device copy of layers %d..%d failed", first,
                      first + n - 1);
}

static const struct device_mode ipc_device = {
    .bytes = ipc_bytes,
    .issue = ipc_issue,
    .wait = ipc_wait,
    .quiet = ipc_quiet,
    .failed = ipc_failed,
    .unknown = "a device copy's completion is unknown",
};

static int ipc_push_layers(struct tdm_kv_send *s, int first, int n, size_t *bytes, double *copy_s,
                           char *err, size_t errlen)
{
    return device_group(s, &ipc_device, first, n, bytes, copy_s, err, errlen);
}

static int ipc_poll(struct tdm_kv_send *s)
{
    int q = tdm_kvx_push_poll(s->dev);
    if (q == TDM_EBUSY)
        return q;
    return tdm_kvx_push_quiet(s->dev) ? TDM_OK : TDM_EBACKEND;
}

static void ipc_close(struct tdm_kv_send *s)
{
    tdm_kvx_push_free(s->dev);
    s->dev = NULL;
}

const struct tdm_kv_transport_ops tdm_kv_transport_cuda_ipc_ops = {
    .mode = TDM_KVX_CUDA_IPC,
    .name = "cuda-ipc",
    .in_place = true,
    .offer = ipc_offer,
    .push_layers = ipc_push_layers,
    .poll = ipc_poll,
    .close = ipc_close,
    .prepare = tdm_kv_ipc_prepare,
    .frame = tdm_kv_ipc_frame,
};

// ---- NCCL: grouped sends over the pair's communicator -------------------------------------
// Takes the pair's link; our previous transfer of the pair may still be
// handing it back. TDM_OK or TDM_EBUSY.
static int nccl_take_link(struct tdm_kv_send *s, char *err, size_t errlen)
{
    double until = tdm_now() + s->t->c.nccl_timeout;
    while ((s->link = tdm_kvx_links_take(s->t->links, s->p.peer)) == NULL) {
        if (s->host->gone(s->host->ctx) || tdm_now() > until)
            return tdm_seterr(err, errlen, TDM_EBUSY,
                              "the pair's communicator stayed busy with another transfer");
        pause_briefly();
    }
    return TDM_OK;
}

// Joins the decode worker's communicator when its id (or the decode instance)
// is not the one the link holds, and waits for init: the link's own deadline
// bounds an init; a ready communicator that reports an operation in progress
// gets nccl_timeout too.
static int nccl_join(struct tdm_kv_send *s, char *err, size_t errlen)
{
    uint8_t held[TDM_KVX_NCCL_ID_BYTES];
    int rc = TDM_OK;
    if (!tdm_kvx_link_id(s->link, held) || memcmp(held, s->p.nccl_id, sizeof held) != 0 ||
        tdm_kvx_link_instance(s->link) != s->p.peer_instance)
        rc = tdm_kvx_link_join(s->link, s->p.peer_instance, tdm_now(), s->p.nccl_id, err, errlen);
    double give_up = tdm_now() + s->t->c.nccl_timeout;
    while (rc == TDM_OK) {
        rc = tdm_kvx_link_poll(s->link, tdm_now(), err, errlen);
        if (rc != TDM_EBUSY)
            break;
        bool gone = s->host->gone(s->host->ctx);
        if (gone || tdm_now() > give_up) {
            tdm_kvx_link_abort(s->link);
            rc = tdm_seterr(err, errlen, TDM_ETIMEDOUT, "%s",
                            gone ? "cancelled during NCCL init"
                                 : "NCCL communicator not ready in time");
            break;
        }
        rc = TDM_OK;
        pause_briefly();
    }
    return rc;
}

// The NCCL side of a transfer: takes the pair's link, joins and waits for
// init, prepares the sends and tells the decode worker to post its receives
// (a KvData "nccl" frame without layers). Any failure after the link was
// taken aborts the communicator and fails the transfer (the decode worker
// moves on; the next transfer builds a new communicator): TDM_ETRANSPORT.
// Nothing joined or awaited (layouts differ, the link stayed busy): TDM_EBUSY,
// as the decode worker's receive thread waits for our "nccl" frame, and a
// first frame of another transport ends it, so the caller chooses again.
static int nccl_offer(struct tdm_kv_send *s, char *err, size_t errlen)
{
    struct tdm_kv_transport *t = s->t;
    int rc = same_layout(s, err, errlen);
    if (rc == TDM_OK)
        rc = nccl_take_link(s, err, errlen);
    bool touched = rc == TDM_OK; // from here a failure leaves the communicator in doubt
    if (rc == TDM_OK)
        rc = nccl_join(s, err, errlen);
    if (rc == TDM_OK)
        rc = read_src_blocks(s, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_kvx_nccl_new(&s->nx, t->c.ops, TDM_KVX_PREFILL, &s->p.pool, s->dst_blocks,
                              s->src_blocks, s->p.num_blocks, t->c.own_layer, t->c.own_arg,
                              s->p.layers_per_group, err, errlen);
    if (rc == TDM_OK) {
        struct tdm_kv_frame f = {.mode = TDM_KVX_NCCL,
                                 .transport = "nccl",
                                 .why = "",
                                 .num_blocks = s->p.num_blocks}; // "post your receives"
        rc = s->host->send(s->host->ctx, &f, err, errlen);
    }
    if (rc == TDM_OK) {
        snprintf(s->why, sizeof s->why, "%s",
                 s->ipc_failed ? "cuda-ipc failed, nccl" : "gpus on both, nccl");
        return TDM_OK;
    }
    TDM_LOG_WARN(MOD, "req=%s nccl to %s failed: %s", s->p.request_id, s->p.peer, err);
    snprintf(s->why, sizeof s->why, "nccl failed: %.140s", err);
    tdm_kvx_nccl_free(s->nx);
    s->nx = NULL;
    if (!touched) {
        tdm_kvx_links_give(t->links, s->link);
        s->link = NULL;
        return TDM_EBUSY;
    }
    // Joined or waited: the communicator's state is in doubt on both sides.
    // Aborted here, and the transfer fails so the decode worker aborts its
    // end too (a KvData error) and moves on; the next transfer rebuilds.
    tdm_kvx_link_abort(s->link);
    return TDM_ETRANSPORT;
}

static uint64_t nccl_bytes(const struct tdm_kv_send *s)
{
    return tdm_kvx_nccl_bytes(s->nx);
}

static int nccl_issue(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen)
{
    int rc = tdm_kvx_link_ready_for(s->link, s->p.peer_instance)
                 ? tdm_kvx_nccl_layers(s->nx, tdm_kvx_link_comm(s->link), first, n, err, errlen)
                 : tdm_seterr(err, errlen, TDM_ETRANSPORT, "the NCCL communicator is gone");
    if (rc != TDM_OK)
        tdm_kvx_link_abort(s->link);
    return rc;
}

// The group's event awaited while the communicator is polled for errors
// against nccl_timeout and the job's stop; on any failure the communicator
// is aborted (its kernels end) and the event still awaited, at most
// nccl_timeout more.
static int nccl_wait(struct tdm_kv_send *s, int first, int n, double t0, int *rc, char *err,
                     size_t errlen)
{
    bool aborted = *rc != TDM_OK;
    double give_up = 0; // after an abort: the aborted kernels end within moments
    int q;
    while ((q = tdm_kvx_nccl_poll(s->nx)) == TDM_EBUSY) {
        double now = tdm_now();
        if (!aborted) {
            char why[256] = "";
            int lrc = tdm_kvx_link_poll(s->link, now, why, sizeof why);
            const char *stop = lrc != TDM_OK && lrc != TDM_EBUSY ? why
                               : now - t0 > s->t->c.nccl_timeout ? "send timed out"
                               : s->host->gone(s->host->ctx)     ? "cancelled"
                                                                 : NULL;
            if (stop != NULL) {
                *rc = tdm_seterr(err, errlen, TDM_ETRANSPORT, "NCCL send of layers %d..%d: %s",
                                 first, first + n - 1, stop);
                tdm_kvx_link_abort(s->link);
                aborted = true;
                give_up = now + s->t->c.nccl_timeout;
            }
        } else if (give_up > 0 && now > give_up) {
            break; // its fate unknown: the lease stays
        }
        pause_briefly();
    }
    return q;
}

static bool nccl_quiet(const struct tdm_kv_send *s)
{
    return tdm_kvx_nccl_quiet(s->nx);
}

static int nccl_failed(struct tdm_kv_send *s, int first, int n, char *err, size_t errlen)
{
    tdm_kvx_link_abort(s->link);
    return tdm_seterr(err, errlen, TDM_ETRANSPORT, "NCCL send of layers %d..%d failed", first,
                      first + n - 1);
}

static const struct device_mode nccl_device = {
    .bytes = nccl_bytes,
    .issue = nccl_issue,
    .wait = nccl_wait,
    .quiet = nccl_quiet,
    .failed = nccl_failed,
    .unknown = "an NCCL send's completion is unknown",
};

// The frame says the layers are in place: the decode worker's receive
// completed too, it counts its own. After the last group the pair's next
// transfer may have the link.
static int nccl_push_layers(struct tdm_kv_send *s, int first, int n, size_t *bytes, double *copy_s,
                            char *err, size_t errlen)
{
    int rc = device_group(s, &nccl_device, first, n, bytes, copy_s, err, errlen);
    if (s->group_moved && first + n == s->t->c.num_layers) {
        tdm_kvx_links_give(s->t->links, s->link);
        s->link = NULL;
    }
    return rc;
}

static int nccl_poll(struct tdm_kv_send *s)
{
    (void)s;
    return TDM_OK; // the decode worker's receives write its blocks; it awaits them itself
}

static void nccl_close(struct tdm_kv_send *s)
{
    tdm_kvx_nccl_free(s->nx);
    s->nx = NULL;
    tdm_kvx_links_give(s->t->links, s->link);
    s->link = NULL;
}

const struct tdm_kv_transport_ops tdm_kv_transport_nccl_ops = {
    .mode = TDM_KVX_NCCL,
    .name = "nccl",
    .in_place = true,
    .offer = nccl_offer,
    .push_layers = nccl_push_layers,
    .poll = nccl_poll,
    .close = nccl_close,
    .prepare = tdm_kv_nccl_prepare,
    .frame = tdm_kv_nccl_frame,
    .complete = tdm_kv_nccl_complete,
    .abort = tdm_kv_nccl_abort,
};

// ---- the choice --------------------------------------------------------------------------
const struct tdm_kv_transport_ops *tdm_kv_transport_of(enum tdm_kvx_mode m)
{
    return m == TDM_KVX_CUDA_IPC ? &tdm_kv_transport_cuda_ipc_ops
           : m == TDM_KVX_NCCL   ? &tdm_kv_transport_nccl_ops
                                 : &tdm_kv_transport_nng_ops;
}

const struct tdm_kv_transport_ops *tdm_kv_transport_by_name(const char *name)
{
    if (name == NULL || name[0] == '\0')
        return &tdm_kv_transport_nng_ops;
    enum tdm_kvx_mode m;
    if (tdm_kvx_mode_parse(name, &m) != 0 || m == TDM_KVX_AUTO)
        return NULL;
    return tdm_kv_transport_of(m);
}

// Why not CUDA IPC (the first candidate) when another mode was chosen: the
// settings, else what the choice restricted to it says.
static void why_not_ipc(struct tdm_kv_send *s, const struct tdm_kvx_side *pre,
                        const struct tdm_kvx_side *dec, enum tdm_kvx_ipc_open ipc)
{
    struct tdm_kvx_side pi = *pre, di = *dec;
    pi.setting = di.setting = TDM_KVX_CUDA_IPC;
    enum tdm_kvx_mode m;
    if (pre->setting != TDM_KVX_AUTO && pre->setting != TDM_KVX_CUDA_IPC)
        snprintf(s->why, sizeof s->why, "prefill --kv-transfer %s",
                 tdm_kvx_mode_name(pre->setting));
    else if (dec->setting != TDM_KVX_AUTO && dec->setting != TDM_KVX_CUDA_IPC)
        snprintf(s->why, sizeof s->why, "decode --kv-transfer %s", tdm_kvx_mode_name(dec->setting));
    else if (ipc == TDM_KVX_IPC_UNTRIED &&
             tdm_kvx_choose(&pi, &di, ipc, &m, s->why, sizeof s->why) == 0)
        snprintf(s->why, sizeof s->why, "cuda-ipc not chosen");
}

// A mode whose offer fails without touching anything is left out and the
// choice made again: CUDA IPC (a handle that does not open, a layout that
// differs) falls back to NCCL or nng, NCCL (a busy link) to nng.
int tdm_kv_send_choose(struct tdm_kv_send *s)
{
    struct tdm_kv_transport *t = s->t;
    enum tdm_kvx_mode dset = TDM_KVX_NNG;
    if (s->p.peer_setting[0] && tdm_kvx_mode_parse(s->p.peer_setting, &dset) != 0)
        dset = TDM_KVX_NNG;
    // NCCL is possible when the decode worker sent a communicator id with
    // its pool (it holds the pair's link for this transfer).
    struct tdm_kvx_side pre = {t->c.setting, t->gpu, t->nccl, t->host_id};
    struct tdm_kvx_side dec = {dset, s->p.offered && s->p.pool.gpu,
                               s->p.offered && s->p.pool.nccl && s->p.has_nccl_id, s->p.peer_host};
    enum tdm_kvx_ipc_open ipc = TDM_KVX_IPC_UNTRIED;
    // The device copies and NCCL calls run on this job thread: our device first.
    char derr[192] = "";
    if (t->gpu && t->c.ops->use_device_of != NULL &&
        t->c.ops->use_device_of(t->c.ops->ctx, t->c.pool_base, derr, sizeof derr) != 0) {
        TDM_LOG_WARN(MOD, "req=%s %s: KV over nng", s->p.request_id, derr);
        pre.gpu = pre.nccl = false;
    }
    bool nccl_tried = false;
    for (int round = 0; round < 3; round++) {
        enum tdm_kvx_mode m;
        if (tdm_kvx_choose(&pre, &dec, ipc, &m, s->why, sizeof s->why) != 0)
            return TDM_EINVAL;
        s->ops = tdm_kv_transport_of(m);
        if (m == TDM_KVX_NNG && !nccl_tried)
            why_not_ipc(s, &pre, &dec, ipc);
        char err[256] = "";
        int rc = s->ops->offer(s, err, sizeof err);
        if (rc != TDM_EBUSY)
            return rc;
        if (m == TDM_KVX_NCCL) {
            dec.nccl = false; // s->why says why
            nccl_tried = true;
        } else {
            ipc = TDM_KVX_IPC_FAILED;
        }
    }
    return TDM_EINVAL;
}
