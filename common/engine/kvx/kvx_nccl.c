// SPDX-License-Identifier: Apache-2.0
// kvx_nccl: one transfer's layer groups over an NCCL communicator (see kvx.h):
// the prefill side's grouped ncclSend and the decode side's grouped ncclRecv
// of the reserved blocks, cut identically on both sides from the decode
// worker's block ids, with a device staging buffer where blocks are not
// consecutive. Like kvx_push, each group ends with one event and "quiet"
// means every event was observed complete, so no receive of this transfer can
// still write the decode worker's blocks.
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

struct tdm_kvx_nccl {
    const struct tdm_kvx_ops *ops;
    enum tdm_kvx_role role;
    struct tdm_kvx_pool geom;
    tdm_kvx_layer_fn own_layer;
    void *own_arg;
    int n;
    int *dst_blocks, *src_blocks; // [n]; src_blocks: the sender's (NULL on the receiver)
    int num_runs;                 // runs of consecutive decode block ids
    bool staged;                  // num_runs > TDM_KVX_NCCL_MAX_RUNS: one buffer per group
    uint8_t *staging;             // device; [max_group_layers][2][n][block_bytes] at most
    size_t staging_bytes;
    void *event; // the issued group's; NULL when none pending
    bool failed, unknown;
    int buffers;
    uint64_t bytes;
};

int tdm_kvx_nccl_new(struct tdm_kvx_nccl **out, const struct tdm_kvx_ops *ops,
                     enum tdm_kvx_role role, const struct tdm_kvx_pool *geom, const int *dst_blocks,
                     const int *src_blocks, int n, tdm_kvx_layer_fn own_layer, void *own_arg,
                     int max_group_layers, char *err, size_t errlen)
{
    *out = NULL;
    if (ops == NULL || ops->nccl_send == NULL || ops->nccl_recv == NULL ||
        ops->nccl_group == NULL || ops->copy_async == NULL || ops->event_record == NULL ||
        ops->event_query == NULL || ops->event_free == NULL || ops->nccl_state == NULL ||
        ops->dev_alloc == NULL || ops->dev_free == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: this build has no NCCL data path");
    bool sender = role == TDM_KVX_PREFILL;
    if (geom == NULL || own_layer == NULL || n < 1 || dst_blocks == NULL ||
        (sender && src_blocks == NULL) || max_group_layers < 1)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: bad NCCL transfer arguments");
    for (int i = 0; i < n; i++)
        if (dst_blocks[i] < 0 || (uint32_t)dst_blocks[i] >= geom->num_blocks ||
            (sender && src_blocks[i] < 0))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "kvx: block %d of the transfer (decode block %d) outside the "
                              "decode worker's pool of %u blocks",
                              i, dst_blocks[i], geom->num_blocks);
    struct tdm_kvx_nccl *x = calloc(1, sizeof *x);
    if (x == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "kvx: out of memory");
    x->dst_blocks = malloc(sizeof(int) * (size_t)n);
    x->src_blocks = sender ? malloc(sizeof(int) * (size_t)n) : NULL;
    if (x->dst_blocks == NULL || (sender && x->src_blocks == NULL)) {
        tdm_kvx_nccl_free(x);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "kvx: out of memory");
    }
    memcpy(x->dst_blocks, dst_blocks, sizeof(int) * (size_t)n);
    if (sender)
        memcpy(x->src_blocks, src_blocks, sizeof(int) * (size_t)n);
    x->ops = ops;
    x->role = role;
    x->geom = *geom;
    x->own_layer = own_layer;
    x->own_arg = own_arg;
    x->n = n;
    x->num_runs = 1;
    for (int i = 1; i < n; i++)
        if (dst_blocks[i] != dst_blocks[i - 1] + 1)
            x->num_runs++;
    x->staged = x->num_runs > TDM_KVX_NCCL_MAX_RUNS;
    // Staging: the whole group when staged; on the sender, the runs whose own
    // blocks are not consecutive (bounded by the same size).
    bool need = x->staged;
    for (int i = 1; sender && !need && i < n; i++)
        need = dst_blocks[i] == dst_blocks[i - 1] + 1 && src_blocks[i] != src_blocks[i - 1] + 1;
    if (need) {
        x->staging_bytes = (size_t)max_group_layers * 2 * (size_t)n * geom->block_bytes;
        char why[192] = "";
        void *buf = NULL;
        if (ops->dev_alloc(ops->ctx, x->staging_bytes, &buf, why, sizeof why) != 0) {
            tdm_kvx_nccl_free(x);
            return tdm_seterr(err, errlen, TDM_ENOMEM, "kvx: staging buffer of %zu bytes: %s",
                              (size_t)max_group_layers * 2 * (size_t)n * geom->block_bytes,
                              why[0] ? why : "?");
        }
        x->staging = buf;
    }
    *out = x;
    return TDM_OK;
}

// Gathers (sender) or scatters (receiver) blocks [i, i + len) of one layer's
// K or V pool to/from the staging area at `stage`, one copy per run of
// consecutive own block ids.
static int stage_copy(struct tdm_kvx_nccl *x, uint8_t *pool, const int *own, int i, int len,
                      uint8_t *stage, char *err, size_t errlen)
{
    uint64_t bb = x->geom.block_bytes;
    bool sender = x->role == TDM_KVX_PREFILL;
    if (pool == NULL)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: no KV pool for a layer");
    for (int k = 0; k < len;) {
        int run = 1;
        while (k + run < len && own[i + k + run] == own[i + k] + run)
            run++;
        uint8_t *blocks = pool + (uint64_t)own[i + k] * bb;
        uint8_t *s = stage + (uint64_t)k * bb;
        char why[192] = "";
        if (x->ops->copy_async(x->ops->ctx, sender ? s : blocks, sender ? blocks : s,
                               (size_t)run * bb, why, sizeof why) != 0)
            return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: staging copy failed: %s",
                              why[0] ? why : "?");
        k += run;
    }
    return TDM_OK;
}

static int xfer(struct tdm_kvx_nccl *x, void *comm, void *buf, size_t bytes, char *err,
                size_t errlen)
{
    char why[192] = "";
    bool sender = x->role == TDM_KVX_PREFILL;
    int peer = sender ? 0 : 1;
    int rc = sender ? x->ops->nccl_send(x->ops->ctx, comm, buf, bytes, peer, why, sizeof why)
                    : x->ops->nccl_recv(x->ops->ctx, comm, buf, bytes, peer, why, sizeof why);
    if (rc != 0)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: %s: %s", sender ? "send" : "recv",
                          why[0] ? why : "?");
    x->buffers++;
    x->bytes += bytes;
    return TDM_OK;
}

// One group's operations, between ncclGroupStart and ncclGroupEnd.
static int issue(struct tdm_kvx_nccl *x, void *comm, int first, int count, char *err, size_t errlen)
{
    bool sender = x->role == TDM_KVX_PREFILL;
    const int *own = sender ? x->src_blocks : x->dst_blocks;
    uint64_t bb = x->geom.block_bytes;
    size_t pool_bytes = (size_t)x->n * bb;
    int rc = TDM_OK;
    if (x->staged) {
        // Sender: gather every layer's K and V, then one send. Receiver: one
        // receive, then the scatter (after the group, on the same stream).
        if (sender)
            for (int l = 0; l < count && rc == TDM_OK; l++)
                for (int v = 0; v < 2 && rc == TDM_OK; v++)
                    rc = stage_copy(x, x->own_layer(x->own_arg, first + l, v), own, 0, x->n,
                                    x->staging + ((size_t)l * 2 + (size_t)v) * pool_bytes, err,
                                    errlen);
        if (rc == TDM_OK)
            rc = xfer(x, comm, x->staging, (size_t)count * 2 * pool_bytes, err, errlen);
        return rc;
    }
    for (int l = 0; l < count && rc == TDM_OK; l++) {
        for (int v = 0; v < 2 && rc == TDM_OK; v++) {
            uint8_t *pool = x->own_layer(x->own_arg, first + l, v);
            if (pool == NULL)
                return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: no pool for layer %d",
                                  first + l);
            uint8_t *stage = x->staging + ((size_t)l * 2 + (size_t)v) * pool_bytes;
            for (int i = 0; i < x->n && rc == TDM_OK;) {
                int run = 1;
                while (i + run < x->n && x->dst_blocks[i + run] == x->dst_blocks[i] + run)
                    run++;
                bool direct = true;
                for (int k = 1; k < run && direct; k++)
                    direct = own[i + k] == own[i] + k;
                uint8_t *buf = pool + (uint64_t)own[i] * bb;
                if (!direct) { // only on the sender: the receiver's run is its own ids
                    buf = stage + (uint64_t)i * bb;
                    rc = stage_copy(x, pool, own, i, run, buf, err, errlen);
                }
                if (rc == TDM_OK)
                    rc = xfer(x, comm, buf, (size_t)run * bb, err, errlen);
                i += run;
            }
        }
    }
    return rc;
}

int tdm_kvx_nccl_layers(struct tdm_kvx_nccl *x, void *comm, int first, int count, char *err,
                        size_t errlen)
{
    if (x->failed)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: the NCCL transfer already failed");
    if (x->event != NULL || comm == NULL || first < 0 || count < 1 ||
        (uint32_t)(first + count) > x->geom.num_layers ||
        (x->staging != NULL &&
         (size_t)count * 2 * (size_t)x->n * x->geom.block_bytes > x->staging_bytes))
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: layers %d+%d out of order or range", first,
                          count);
    char why[192] = "";
    int rc = TDM_OK;
    if (x->ops->nccl_group(x->ops->ctx, true, why, sizeof why) != 0)
        rc = tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: ncclGroupStart: %s", why);
    if (rc == TDM_OK) {
        rc = issue(x, comm, first, count, err, errlen);
        // The group is closed on every path (an open group would swallow the
        // next transfer's operations).
        if (x->ops->nccl_group(x->ops->ctx, false, why, sizeof why) != 0 && rc == TDM_OK)
            rc = tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: ncclGroupEnd: %s", why);
    }
    // A non-blocking communicator may still be enqueuing the group's kernels
    // when ncclGroupEnd returns (ncclInProgress): NCCL asks that its state
    // leave "in progress" before the stream is used, or the event could be
    // recorded ahead of the kernels. Enqueuing is host work of microseconds;
    // past the bound the group's fate is unknown.
    enum tdm_kvx_comm_state st = TDM_KVX_COMM_PENDING;
    double give_up = tdm_now() + 10;
    while (rc == TDM_OK && st == TDM_KVX_COMM_PENDING) {
        if (x->ops->nccl_state(x->ops->ctx, comm, &st, why, sizeof why) != 0 ||
            st == TDM_KVX_COMM_ERROR)
            rc = tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: NCCL error after the group: %s",
                            why[0] ? why : "?");
        else if (st == TDM_KVX_COMM_PENDING && tdm_now() > give_up) {
            x->unknown = true;
            rc =
                tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: NCCL group still enqueuing after 10 s");
        } else if (st == TDM_KVX_COMM_PENDING) {
            tdm_sleep(1e-4);
        }
    }
    // The scatter follows the receive on the same stream.
    if (rc == TDM_OK && x->staged && x->role == TDM_KVX_DECODE) {
        size_t pool_bytes = (size_t)x->n * x->geom.block_bytes;
        for (int l = 0; l < count && rc == TDM_OK; l++)
            for (int v = 0; v < 2 && rc == TDM_OK; v++)
                rc = stage_copy(x, x->own_layer(x->own_arg, first + l, v), x->dst_blocks, 0, x->n,
                                x->staging + ((size_t)l * 2 + (size_t)v) * pool_bytes, err, errlen);
    }
    if (rc != TDM_OK)
        x->failed = true;
    // An event after whatever was issued, also after a failure: it tells
    // when those operations are over.
    if (x->ops->event_record(x->ops->ctx, &x->event, why, sizeof why) != 0) {
        x->event = NULL;
        x->failed = x->unknown = true;
        if (rc == TDM_OK)
            rc = tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: event record failed: %s",
                            why[0] ? why : "?");
    }
    return rc;
}

int tdm_kvx_nccl_poll(struct tdm_kvx_nccl *x)
{
    if (x == NULL)
        return TDM_OK;
    if (x->event == NULL)
        return x->failed ? TDM_EBACKEND : TDM_OK;
    int q = x->ops->event_query(x->ops->ctx, x->event);
    if (q == 0)
        return TDM_EBUSY;
    x->ops->event_free(x->ops->ctx, x->event);
    x->event = NULL;
    if (q < 0)
        x->failed = x->unknown = true;
    return x->failed ? TDM_EBACKEND : TDM_OK;
}

bool tdm_kvx_nccl_quiet(const struct tdm_kvx_nccl *x)
{
    return x == NULL || (x->event == NULL && !x->unknown);
}

int tdm_kvx_nccl_buffers(const struct tdm_kvx_nccl *x)
{
    return x->buffers;
}

uint64_t tdm_kvx_nccl_bytes(const struct tdm_kvx_nccl *x)
{
    return x->bytes;
}

bool tdm_kvx_nccl_staged(const struct tdm_kvx_nccl *x)
{
    return x->staged;
}

void tdm_kvx_nccl_free(struct tdm_kvx_nccl *x)
{
    if (x == NULL)
        return;
    bool quiet = tdm_kvx_nccl_quiet(x);
    if (x->event != NULL)
        x->ops->event_free(x->ops->ctx, x->event);
    if (x->staging != NULL && quiet)
        x->ops->dev_free(x->ops->ctx, x->staging);
    free(x->dst_blocks);
    free(x->src_blocks);
    free(x);
}
