// SPDX-License-Identifier: Apache-2.0
// kvx_push: the prefill side's device-to-device copies of one transfer (CUDA
// IPC): each layer group's blocks go from this worker's pool straight into the
// decode worker's opened pool with copy_async on the table's stream, then an
// event; the caller polls the event and only then tells the decode worker
// "layers a..b in place". Runs of blocks consecutive on both sides are one
// copy each (the engine hands out blocks mostly in order, so a prompt is a few
// large copies, not one per 16-token block).
//
// Invariant for the decode worker's memory safety: tdm_kvx_push_quiet is true
// only when every event this push recorded was observed complete, so "quiet"
// means no copy of this transfer can still land in the decode worker's blocks.
// Also the wire format of struct tdm_kvx_pool (PrefillRequest.kv_pool).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

// ---- pool descriptor -----------------------------------------------------------------------
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 3; i >= 0; i--)
        v = v << 8 | p[i];
    return v;
}

void tdm_kvx_pool_encode(const struct tdm_kvx_pool *p, uint8_t out[TDM_KVX_POOL_WIRE_BYTES])
{
    uint8_t *o = out;
    memcpy(o, p->handle, TDM_KVX_IPC_HANDLE_BYTES);
    o += TDM_KVX_IPC_HANDLE_BYTES;
    put64(o, p->bytes);
    put64(o + 8, p->layer_stride);
    put64(o + 16, p->v_offset);
    put64(o + 24, p->block_bytes);
    o += 32;
    put32(o, p->num_layers);
    put32(o + 4, p->num_blocks);
    put32(o + 8, p->elem_bytes);
    put32(o + 12, (p->gpu ? 1u : 0u) | (p->nccl ? 2u : 0u));
}

int tdm_kvx_pool_decode(struct tdm_kvx_pool *p, const uint8_t *in, size_t len, char *err,
                        size_t errlen)
{
    memset(p, 0, sizeof *p);
    if (in == NULL || len != TDM_KVX_POOL_WIRE_BYTES)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv_pool: %zu bytes, expected %d", len,
                          TDM_KVX_POOL_WIRE_BYTES);
    const uint8_t *i = in;
    memcpy(p->handle, i, TDM_KVX_IPC_HANDLE_BYTES);
    i += TDM_KVX_IPC_HANDLE_BYTES;
    p->bytes = get64(i);
    p->layer_stride = get64(i + 8);
    p->v_offset = get64(i + 16);
    p->block_bytes = get64(i + 24);
    i += 32;
    p->num_layers = get32(i);
    p->num_blocks = get32(i + 4);
    p->elem_bytes = get32(i + 8);
    uint32_t flags = get32(i + 12);
    p->gpu = flags & 1u;
    p->nccl = flags & 2u;
    // The last block of the last layer's V must lie inside the allocation
    // (each term bounded first, so the sums cannot wrap).
    bool ok = p->num_layers > 0 && p->num_blocks > 0 && p->block_bytes > 0 &&
              (p->elem_bytes == 2 || p->elem_bytes == 4) &&
              p->block_bytes <= p->bytes / p->num_blocks &&
              p->v_offset >= p->block_bytes * p->num_blocks && p->v_offset <= p->bytes &&
              p->layer_stride <= p->bytes / p->num_layers;
    if (ok) {
        uint64_t last = (uint64_t)(p->num_layers - 1) * p->layer_stride;
        uint64_t pool = p->block_bytes * p->num_blocks;
        ok = last <= p->bytes - p->v_offset && pool <= p->bytes - p->v_offset - last;
    }
    if (!ok)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "kv_pool: inconsistent geometry (layers %u, blocks %u of %llu bytes, "
                          "elem %u, allocation %llu bytes)",
                          p->num_layers, p->num_blocks, (unsigned long long)p->block_bytes,
                          p->elem_bytes, (unsigned long long)p->bytes);
    return TDM_OK;
}

// ---- push ----------------------------------------------------------------------------------
struct tdm_kvx_push {
    const struct tdm_kvx_ops *ops;
    struct tdm_kvx_pool dst;
    uint8_t *dst_base;
    tdm_kvx_layer_fn src_layer;
    void *src_arg;
    int n;
    int *dst_blocks, *src_blocks; // [n]
    void *event;                  // the issued group's; NULL when none pending
    bool failed;                  // a copy or event failed: nothing more is issued
    bool unknown;                 // issued copies whose completion cannot be observed
    int copies;
    uint64_t bytes;
};

int tdm_kvx_push_new(struct tdm_kvx_push **out, const struct tdm_kvx_ops *ops,
                     const struct tdm_kvx_pool *dst, void *dst_base, const int *dst_blocks,
                     tdm_kvx_layer_fn src_layer, void *src_arg, const int *src_blocks, int n,
                     char *err, size_t errlen)
{
    *out = NULL;
    if (ops == NULL || ops->copy_async == NULL || ops->event_record == NULL ||
        ops->event_query == NULL || ops->event_free == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: this build has no device copy path");
    if (dst == NULL || dst_base == NULL || src_layer == NULL || n < 0 ||
        (n > 0 && (dst_blocks == NULL || src_blocks == NULL)))
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: bad push arguments");
    for (int i = 0; i < n; i++)
        if (dst_blocks[i] < 0 || (uint32_t)dst_blocks[i] >= dst->num_blocks || src_blocks[i] < 0)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "kvx: block %d of the push (decode block %d) outside the decode "
                              "worker's pool of %u blocks",
                              i, dst_blocks[i], dst->num_blocks);
    struct tdm_kvx_push *p = calloc(1, sizeof *p);
    if (p == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "kvx: out of memory");
    p->dst_blocks = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    p->src_blocks = malloc(sizeof(int) * (size_t)(n > 0 ? n : 1));
    if (p->dst_blocks == NULL || p->src_blocks == NULL) {
        tdm_kvx_push_free(p);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "kvx: out of memory");
    }
    if (n > 0) {
        memcpy(p->dst_blocks, dst_blocks, sizeof(int) * (size_t)n);
        memcpy(p->src_blocks, src_blocks, sizeof(int) * (size_t)n);
    }
    p->ops = ops;
    p->dst = *dst;
    p->dst_base = dst_base;
    p->src_layer = src_layer;
    p->src_arg = src_arg;
    p->n = n;
    *out = p;
    return TDM_OK;
}

// Copies one layer's K or V blocks, a run of consecutive ids at a time.
static int copy_pool(struct tdm_kvx_push *p, int layer, bool v, char *err, size_t errlen)
{
    uint8_t *src = p->src_layer(p->src_arg, layer, v);
    if (src == NULL)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: no source pool for layer %d", layer);
    uint8_t *dst = p->dst_base + (uint64_t)layer * p->dst.layer_stride + (v ? p->dst.v_offset : 0);
    uint64_t bb = p->dst.block_bytes;
    for (int i = 0; i < p->n;) {
        int run = 1;
        while (i + run < p->n && p->dst_blocks[i + run] == p->dst_blocks[i] + run &&
               p->src_blocks[i + run] == p->src_blocks[i] + run)
            run++;
        char why[192] = "";
        if (p->ops->copy_async(p->ops->ctx, dst + (uint64_t)p->dst_blocks[i] * bb,
                               src + (uint64_t)p->src_blocks[i] * bb, (size_t)run * bb, why,
                               sizeof why) != 0)
            return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: copy of layer %d failed: %s",
                              layer, why[0] ? why : "?");
        p->copies++;
        p->bytes += (uint64_t)run * bb;
        i += run;
    }
    return TDM_OK;
}

int tdm_kvx_push_layers(struct tdm_kvx_push *p, int first, int count, char *err, size_t errlen)
{
    if (p->failed)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: the push already failed");
    if (p->event != NULL || first < 0 || count < 1 || (uint32_t)(first + count) > p->dst.num_layers)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kvx: layers %d+%d out of order or range",
                          first, count);
    for (int l = first; l < first + count; l++) {
        int rc = copy_pool(p, l, false, err, errlen);
        if (rc == TDM_OK)
            rc = copy_pool(p, l, true, err, errlen);
        if (rc != TDM_OK) {
            // Copies of this group already issued may still run: an event
            // after them tells when they are done; without one their fate is
            // unknown and the push never turns quiet.
            p->failed = true;
            char why[192] = "";
            if (p->ops->event_record(p->ops->ctx, &p->event, why, sizeof why) != 0) {
                p->event = NULL;
                p->unknown = true;
            }
            return rc;
        }
    }
    char why[192] = "";
    if (p->ops->event_record(p->ops->ctx, &p->event, why, sizeof why) != 0) {
        p->event = NULL;
        p->failed = p->unknown = true;
        return tdm_seterr(err, errlen, TDM_EBACKEND, "kvx: event record failed: %s",
                          why[0] ? why : "?");
    }
    return TDM_OK;
}

int tdm_kvx_push_poll(struct tdm_kvx_push *p)
{
    if (p == NULL)
        return TDM_OK; // nothing issued
    if (p->event == NULL)
        return p->failed ? TDM_EBACKEND : TDM_OK;
    int q = p->ops->event_query(p->ops->ctx, p->event);
    if (q == 0)
        return TDM_EBUSY;
    p->ops->event_free(p->ops->ctx, p->event);
    p->event = NULL;
    if (q < 0) {
        p->failed = p->unknown = true;
        return TDM_EBACKEND;
    }
    return p->failed ? TDM_EBACKEND : TDM_OK;
}

bool tdm_kvx_push_quiet(const struct tdm_kvx_push *p)
{
    return p == NULL || (p->event == NULL && !p->unknown);
}

int tdm_kvx_push_copies(const struct tdm_kvx_push *p)
{
    return p->copies;
}

uint64_t tdm_kvx_push_bytes(const struct tdm_kvx_push *p)
{
    return p->bytes;
}

void tdm_kvx_push_free(struct tdm_kvx_push *p)
{
    if (p == NULL)
        return;
    if (p->event != NULL)
        p->ops->event_free(p->ops->ctx, p->event);
    free(p->dst_blocks);
    free(p->src_blocks);
    free(p);
}
