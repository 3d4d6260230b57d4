// SPDX-License-Identifier: Apache-2.0
// cuda_backend: struct tdm_backend_ops for NVIDIA GPUs, written against the
// thin device API of cuda_dev.h and the kernel launchers of cuda_kernels.h.
// This one file is compiled for two device APIs: with cuda_dev.c +
// cuda_kernels.cu into the CUDA backend module (TANDEM_CUDA=ON,
// libtandem-cuda.so, loaded as "cuda": backend_module.h), and with the
// emulated device API and kernels into libtandem-cuda-emu.so and
// tdm_model_cuda_emu (tests, which register it as "cuda"), so CI runs this
// host code end to end.
//
// Memory: weights bf16 row-major [rows][cols] in device memory (uploaded once;
// int8 weight-only is not implemented here and is refused at load); activations
// f32 from alloc (zero-filled device memory); the KV pool a struct
// tdm_kv_storage of this backend (bf16 by default, f32 with
// TANDEM_CUDA_KV_DTYPE=f32, which the emulator's exactness test uses).
//
// Per forward, begin_forward turns the batch's host block tables into device
// metadata once (flat KV slots of the new rows, block tables, the attention
// plan of cuda_kernels.h); kv_store and attention of every layer reuse it.
// The staging buffers grow to the largest batch seen and are then reused.
//
// Errors: ops return nothing (the ops table's contract), so the first failure
// (a launch, a GEMM, a staging copy) is kept in be->err and returned by the
// next download or sync; later ops still run but their output is garbage the
// caller never sees as success.
//
// Batch invariance: the kernels map each row by its own shape (cuda_kernels.h)
// and the GEMM's algorithm is fixed per weight shape and row class (cuda_dev.h:
// prompt rows have their own, matmul_runs), so a row's numbers do not depend
// on the rest of the batch. In the fast mode (set_batch_invariant off) decode
// GEMMs of up to 16 rows take Tandem's GEMV instead, whose rows are the same
// for every n <= 16 but not cuBLASLt's.
// docs/gpu-backend.md says what is and is not verified.
#include <stdbool.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cuda_backend.h"
#include "cuda_dev.h"
#include "cuda_kernels.h"

// Graphs kept at once (bucket sizes x sequence-length buckets); the least
// recently used is dropped beyond this.
#define TDM_CUDA_GRAPH_SLOTS 32

// A growable device buffer (staging, scratch).
struct dev_buf {
    void *p;
    size_t bytes;
};

struct tdm_backend {
    struct tdm_cuda_dev *dev;
    void *stream;
    enum tdm_cuk_kv_type kv_type; // element type of KV pools this backend makes
    // true (the default): every GEMM through tdm_cuda_dev_gemm_bf16 (cuBLASLt,
    // an algorithm per weight shape); false: GEMMs of up to
    // TDM_CUK_GEMV_MAX_N rows through tdm_cuk_gemv (set_batch_invariant).
    bool batch_invariant;
    struct dev_buf gemv_part;     // the GEMV's split partials: the largest weight's
                                  // tdm_cuk_gemv_part_bytes, device (fast mode only)
    struct dev_buf gemv_counts;   // its row tiles' arrival counts, int32, device; zero
                                  // between launches (each launch leaves them so)
    int err;                      // first failure since the last sync/download (TDM_OK if none)
    char errmsg[256];

    struct dev_buf am_ids;  // [n] int32 token ids of argmax_rows, device
    struct dev_buf
        am_part; // argmax_rows' per-chunk winners (tdm_cuk_argmax_scratch), sample_rows' scratch
    struct dev_buf sp;      // [n] struct tdm_draw_params of sample_rows, device
    // struct tdm_draw_adj entries, device: the adjustment lists kept between
    // a request's steps (tdm_draw_params.list; lists[L]: list L's region,
    // entries [at, at + cap), bound: the most entries it can hold after the
    // steps issued), lists_used entries in all, and past them the step's own
    // entries (sample_rows' adj). A list that outgrows its region moves to a
    // new one past the others (the old one is not reused: a list's regions
    // double, so what is left behind is less than what is used); sadj grows
    // by doubling, its lists copied over in stream order.
    struct dev_buf sadj;
    struct adj_list {
        int32_t at, cap, bound;
        bool loaded;
        uint64_t stamp; // the last sample_rows that named it
    } * lists;
    int n_lists;
    int32_t lists_used;
    uint64_t sample_calls;
    struct dev_buf list_n;   // [n_lists] int32 each list's entry count, device
    struct dev_buf lists_at; // [n] int32 each row's list region (list_bind), device
    int32_t *h_lists_at;     // its host twin
    int h_lists_cap;
    struct dev_buf smask;   // their structured-output masks, device
    // Rows asking logprobs: their indices, then their struct tdm_draw_logprobs
    // (device).
    struct dev_buf slp;
    struct dev_buf gpairs; // gather_ids' (row, chosen index) pairs, device
    // Two forwards may be in flight (issue 26 item 1: the host issues step
    // N + 1 while the device runs step N), each with an inflight slot:
    // - its pinned staging of the small host -> device copies (token ids,
    //   positions, the attention metadata, the draws' parameters,
    //   adjustments, masks and logprob rows; upload_async): each takes the
    //   next free bytes and is issued without a wait;
    // - the pinned landing of its chosen rows' ids and logprobs, copied there
    //   by results_issue, and the host list of its rows asking logprobs;
    // - an event recorded after those copies: the slot's staging is free and
    //   its results have landed once the device passed it.
    // results_issue ends the current slot's forward and moves on to the
    // other slot (waiting for its event if the host has not, before its
    // staging is written again); take_results waits for the oldest slot's
    // results. A full wait for the stream frees both (stream_idle).
    struct inflight {
        uint8_t *stage;
        size_t stage_cap, stage_used;
        bool fenced; // stage still read by copies before `event`
        uint8_t *land;
        size_t land_cap;
        int32_t *lp_rows;
        int lp_cap;
        int n, n_lp;  // results: rows, rows asking logprobs
        bool pending; // results issued, not taken
        bool landed;  // ... and known to have landed (a full wait since)
        size_t lp_at; // the logprobs' offset in land
        void *event;
    } fl[2];
    int fl_cur;  // the slot of the forward being issued
    int fl_head; // the oldest slot with pending results
    // Device buffers replaced by a growth, freed at the next full wait
    // (be_buf_grow).
    void **grave;
    int n_grave, cap_grave;
    // begin_forward's staging: host copies, and their device twins.
    int n_rows, n_seqs;                                  // of the staged forward
    int32_t *h_slots;                                    // [cap_rows] flat KV slot of each new row
    int32_t *h_bt;                                       // [cap_seqs][bt_stride]
    int32_t *h_row, *h_ntok, *h_start, *h_dec, *h_tiles; // plan inputs and outputs
    struct tdm_cuk_seq *h_seqs;
    int cap_rows, cap_seqs, cap_bt, cap_tiles;
    // The five arrays above go to the device in one copy: packed (16-byte
    // aligned pieces) in the staging, copied to d_meta; the m_* point into
    // d_meta.
    struct dev_buf d_meta, d_part_o, d_part_ml;
    // [cap][n_heads] int32 decode split counts (tdm_cuk_attn_args.part_done):
    // zeroed when it grows, and every launch leaves it zero. A growth while
    // a graph is being recorded zeroes it only in that graph (which is then
    // dropped): part_done_unset asks the next forward to zero it first.
    struct dev_buf d_part_done;
    bool part_done_unset;
    const int32_t *m_slots, *m_bt, *m_dec, *m_tiles;
    const struct tdm_cuk_seq *m_seqs;
    struct tdm_cuk_plan plan;
    int bt_stride;

    // CUDA graphs of decode steps, one per (rows, block-table width, splits,
    // KV storage); gen counts buffer moves, and a graph captured under an
    // older gen is stale (recaptured).
    struct graph_slot {
        int rows, bt_stride, splits;
        const struct tdm_kv_storage *kvs;
        void *graph;  // NULL until captured
        unsigned gen; // be->gen at capture
        unsigned long long last_use;
    } graphs[TDM_CUDA_GRAPH_SLOTS];
    unsigned gen;
    unsigned long long tick;
    int graph_cur;      // slot of the step between graph_begin and graph_end, -1 if none
    int graph_mode;     // 0 eager warm-up, 1 capturing, 2 replay
    unsigned graph_gen; // be->gen when the capture began
};

static void fail(struct tdm_backend *be, int code, const char *fmt, const char *detail)
{
    if (be->err != TDM_OK)
        return;
    be->err = code;
    snprintf(be->errmsg, sizeof be->errmsg, fmt, detail);
    TDM_LOG_ERR("cuda", "%s", be->errmsg);
}

static void launch_check(struct tdm_backend *be, int cuk_rc)
{
    if (cuk_rc != TDM_CUK_OK)
        fail(be, cuk_rc == TDM_CUK_EINVAL ? TDM_EINVAL : TDM_EBACKEND, "kernel: %s",
             tdm_cuk_errmsg());
}

// Grows b to at least bytes, by doubling (contents are not kept). The old
// buffer is freed when old is NULL (it must be idle), else handed back in
// *old. 1 when it grew, 0 when it was large enough, -1 when out of device
// memory.
static int dev_buf_grow(struct tdm_cuda_dev *dev, struct dev_buf *b, size_t bytes, void **old)
{
    if (b->bytes >= bytes)
        return 0;
    size_t want = b->bytes ? b->bytes : 4096;
    while (want < bytes)
        want *= 2;
    void *p = tdm_cuda_dev_alloc(dev, want);
    if (p == NULL)
        return -1;
    if (old)
        *old = b->p;
    else
        tdm_cuda_dev_free(dev, b->p);
    b->p = p;
    b->bytes = want;
    return 1;
}

static int stream_wait(struct tdm_backend *be, const char *what);
static void stream_idle(struct tdm_backend *be);

// A backend buffer grown: the old one may still be read by work in flight
// (a forward issued before, whose results are not taken), so it is freed
// once the host has waited for the whole stream (stream_idle) rather than
// now; growth is by doubling, so what waits is less than what is held. Its
// first `keep` bytes are copied to the new one, in stream order (after the
// work issued before, which reads and writes the old one).
static int be_buf_grow_keep(struct tdm_backend *be, struct dev_buf *b, size_t bytes, size_t keep)
{
    void *old = NULL;
    int g = dev_buf_grow(be->dev, b, bytes, &old);
    if (old == NULL)
        return g;
    if (keep > 0 && tdm_cuda_dev_d2d(be->dev, b->p, old, keep) != TDM_OK)
        fail(be, TDM_EBACKEND, "grow: %s", tdm_cuda_dev_errmsg(be->dev));
    if (be->n_grave == be->cap_grave) {
        int cap = be->cap_grave ? 2 * be->cap_grave : 8;
        void **grown = realloc(be->grave, (size_t)cap * sizeof *grown);
        if (grown == NULL) { // no room to defer it: wait, then free it now
            (void)stream_wait(be, "grow: %s");
            tdm_cuda_dev_free(be->dev, old);
            return g;
        }
        be->grave = grown;
        be->cap_grave = cap;
    }
    be->grave[be->n_grave++] = old;
    return g;
}

static int be_buf_grow(struct tdm_backend *be, struct dev_buf *b, size_t bytes)
{
    return be_buf_grow_keep(be, b, bytes, 0);
}

// A backend buffer: growing it marks graphs that used the old one stale.
// TDM_OK or TDM_ENOMEM.
static int buf_reserve(struct tdm_backend *be, struct dev_buf *b, size_t bytes)
{
    int g = be_buf_grow(be, b, bytes);
    if (g > 0)
        be->gen++;
    return g < 0 ? TDM_ENOMEM : TDM_OK;
}

static void buf_free(struct tdm_backend *be, struct dev_buf *b)
{
    tdm_cuda_dev_free(be->dev, b->p);
    b->p = NULL;
    b->bytes = 0;
}

// ---- create / destroy / memory ----------------------------------------------------------------
static int cuda_create(struct tdm_backend **out, int num_threads, int device, char *err,
                       size_t errlen)
{
    (void)num_threads; // host threads are not the CUDA backend's compute
    *out = NULL;
    struct tdm_backend *be = calloc(1, sizeof *be);
    if (be == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda backend: out of memory");
    int rc = tdm_cuda_dev_open(&be->dev, device, err, errlen);
    if (rc != TDM_OK) {
        free(be);
        return rc;
    }
    be->stream = tdm_cuda_dev_stream(be->dev);
    be->graph_cur = -1;
    for (int i = 0; i < 2; i++) {
        if (tdm_cuda_dev_event_new(be->dev, &be->fl[i].event) != TDM_OK) {
            tdm_seterr(err, errlen, TDM_EBACKEND, "cuda backend: %s", tdm_cuda_dev_errmsg(be->dev));
            for (int j = 0; j < i; j++)
                tdm_cuda_dev_event_free(be->dev, be->fl[j].event);
            tdm_cuda_dev_close(be->dev);
            free(be);
            return TDM_EBACKEND;
        }
    }
    be->kv_type = TDM_CUK_KV_BF16;
    be->batch_invariant = true;
    const char *kvd = getenv("TANDEM_CUDA_KV_DTYPE");
    if (kvd && *kvd) {
        if (strcmp(kvd, "f32") == 0) {
            be->kv_type = TDM_CUK_KV_F32;
        } else if (strcmp(kvd, "bf16") != 0) {
            tdm_cuda_dev_close(be->dev);
            free(be);
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_CUDA_KV_DTYPE=%s: expected bf16 or f32", kvd);
        }
    }
    TDM_LOG_INFO("cuda", "backend device=%d name=\"%s\" kv=%s", device, tdm_cuda_dev_name(be->dev),
                 be->kv_type == TDM_CUK_KV_F32 ? "f32" : "bf16");
    *out = be;
    return TDM_OK;
}

static void cuda_destroy(struct tdm_backend *be)
{
    if (be == NULL)
        return;
    // Work in flight may still use the buffers, the staging and the landings.
    (void)tdm_cuda_dev_sync(be->dev);
    stream_idle(be);
    free(be->grave);
    buf_free(be, &be->am_ids);
    buf_free(be, &be->am_part);
    buf_free(be, &be->gemv_part);
    buf_free(be, &be->gemv_counts);
    buf_free(be, &be->sp);
    buf_free(be, &be->sadj);
    buf_free(be, &be->list_n);
    buf_free(be, &be->lists_at);
    free(be->lists);
    free(be->h_lists_at);
    buf_free(be, &be->smask);
    buf_free(be, &be->slp);
    buf_free(be, &be->gpairs);
    for (int i = 0; i < 2; i++) {
        free(be->fl[i].lp_rows);
        tdm_cuda_dev_host_free(be->dev, be->fl[i].stage);
        tdm_cuda_dev_host_free(be->dev, be->fl[i].land);
        tdm_cuda_dev_event_free(be->dev, be->fl[i].event);
    }
    for (int i = 0; i < TDM_CUDA_GRAPH_SLOTS; i++)
        tdm_cuda_dev_graph_free(be->dev, be->graphs[i].graph);
    buf_free(be, &be->d_meta);
    buf_free(be, &be->d_part_o);
    buf_free(be, &be->d_part_ml);
    buf_free(be, &be->d_part_done);
    free(be->h_slots);
    free(be->h_bt);
    free(be->h_row);
    free(be->h_ntok);
    free(be->h_start);
    free(be->h_dec);
    free(be->h_tiles);
    free(be->h_seqs);
    tdm_cuda_dev_close(be->dev);
    free(be);
}

static void cuda_set_batch_invariant(struct tdm_backend *be, bool on)
{
    be->batch_invariant = on;
    TDM_LOG_INFO("cuda", "batch_invariant=%s: %s", on ? "on" : "off",
                 on ? "every GEMM on cuBLASLt, one algorithm per weight shape and row class"
                    : "decode GEMMs of up to 16 rows on Tandem's split-K GEMV, the rest on "
                      "cuBLASLt");
}

static void *cuda_alloc(struct tdm_backend *be, size_t bytes)
{
    void *p = tdm_cuda_dev_alloc(be->dev, bytes);
    if (p && tdm_cuda_dev_memset(be->dev, p, 0, bytes) != TDM_OK) {
        tdm_cuda_dev_free(be->dev, p);
        return NULL;
    }
    return p;
}

static void cuda_release(struct tdm_backend *be, void *p)
{
    tdm_cuda_dev_free(be->dev, p);
}

// Returns and clears the sticky error.
static int take_err(struct tdm_backend *be)
{
    int rc = be->err;
    be->err = TDM_OK;
    return rc;
}

// ---- host <-> device copies --------------------------------------------------------------------
// Uploads up to this size go through the pinned staging without a wait;
// larger ones (weights) wait for their copy.
#define TDM_CUDA_STAGE_MAX ((size_t)4 << 20)

// The host waited for everything issued on the stream: both slots' staging
// is free and their pending results have landed.
// The device passed slot f's event: its staging is free and its pending
// results have landed.
static void slot_idle(struct inflight *f)
{
    f->stage_used = 0;
    f->fenced = false;
    f->landed = f->pending;
}

static void stream_idle(struct tdm_backend *be)
{
    for (int i = 0; i < be->n_grave; i++)
        tdm_cuda_dev_free(be->dev, be->grave[i]);
    be->n_grave = 0;
    slot_idle(&be->fl[0]);
    slot_idle(&be->fl[1]);
}

// Waits for the stream (the copies and kernels issued so far).
static int stream_wait(struct tdm_backend *be, const char *what)
{
    if (tdm_cuda_dev_sync(be->dev) != TDM_OK) {
        fail(be, TDM_EBACKEND, what, tdm_cuda_dev_errmsg(be->dev));
        return be->err;
    }
    stream_idle(be);
    return be->err;
}

// The host waits for slot f's event: the copies from its staging and into
// its landing are done.
static int slot_wait(struct tdm_backend *be, struct inflight *f)
{
    if (tdm_cuda_dev_event_sync(be->dev, f->event) != TDM_OK) {
        fail(be, TDM_EBACKEND, "wait: %s", tdm_cuda_dev_errmsg(be->dev));
        return be->err;
    }
    slot_idle(f);
    return be->err;
}

// Pinned room for a copy of `bytes` (16-byte aligned) in the current slot's
// staging, NULL (be->err set) when the host is out of pinned memory or the
// stream failed. Staging still read by the slot's last forward: the host
// waits for its event first. Full staging: the host waits for the stream,
// after which all of it is free, and grows it when one copy needs more.
static void *stage_take(struct tdm_backend *be, size_t bytes)
{
    struct inflight *f = &be->fl[be->fl_cur];
    size_t need = (bytes + 15) / 16 * 16;
    if (f->fenced && slot_wait(be, f) != TDM_OK)
        return NULL;
    if (f->stage_used + need > f->stage_cap) {
        if (f->stage_used > 0 && stream_wait(be, "upload: %s") != TDM_OK)
            return NULL;
        if (need > f->stage_cap) {
            size_t want = f->stage_cap ? f->stage_cap : (size_t)64 << 10;
            while (want < need)
                want *= 2;
            uint8_t *p = tdm_cuda_dev_host_alloc(be->dev, want);
            if (p == NULL) {
                fail(be, TDM_ENOMEM, "upload: %s", "out of pinned host memory for the staging");
                return NULL;
            }
            tdm_cuda_dev_host_free(be->dev, f->stage);
            f->stage = p;
            f->stage_cap = want;
        }
    }
    void *r = f->stage + f->stage_used;
    f->stage_used += need;
    return r;
}

// dst (device) = `bytes` the caller wrote at staged (stage_take's), in
// stream order, without waiting; what names the op in an error.
static int stage_send(struct tdm_backend *be, void *dst, const void *staged, size_t bytes,
                      const char *what)
{
    if (tdm_cuda_dev_h2d_async(be->dev, dst, staged, bytes) != TDM_OK)
        fail(be, TDM_EBACKEND, what, tdm_cuda_dev_errmsg(be->dev));
    return be->err;
}

// dst (device) = src (any host memory, free for reuse on return), in stream
// order, without waiting: src is copied to the staging first.
static int upload_async(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes == 0 || be->err != TDM_OK)
        return be->err;
    void *s = stage_take(be, bytes);
    if (s == NULL)
        return be->err;
    memcpy(s, src, bytes);
    return stage_send(be, dst, s, bytes, "upload: %s");
}

static int cuda_upload(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    if (bytes <= TDM_CUDA_STAGE_MAX)
        return upload_async(be, dst, src, bytes);
    if (tdm_cuda_dev_h2d(be->dev, dst, src, bytes) != TDM_OK)
        fail(be, TDM_EBACKEND, "upload: %s", tdm_cuda_dev_errmsg(be->dev));
    else
        stream_idle(be); // the copy waited for the stream
    return be->err;
}

static int cuda_download(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    if (tdm_cuda_dev_d2h(be->dev, dst, src, bytes) != TDM_OK)
        fail(be, TDM_EBACKEND, "download: %s", tdm_cuda_dev_errmsg(be->dev));
    else
        stream_idle(be);
    return take_err(be);
}

// The current slot, free for a forward's results; NULL (be->err set, what
// naming the op) when its last results were not taken: the model takes each
// forward's results before a third is issued.
static struct inflight *results_slot(struct tdm_backend *be, const char *what)
{
    struct inflight *f = &be->fl[be->fl_cur];
    if (f->pending) {
        fail(be, TDM_EINVAL, what, "a third forward in flight");
        return NULL;
    }
    return f;
}

// Ends the current slot's forward: its n chosen rows' ids (device ids) and,
// for its n_lp rows asking logprobs (listed in the slot's lp_rows), theirs
// (device lp) are copied to the slot's landing without a wait, the slot's
// event is recorded after them, and the next forward takes the other slot.
// take_results brings them to the caller. TDM_OK or the step's first error.
static int results_issue(struct tdm_backend *be, int n, const int32_t *ids, int n_lp,
                         const struct tdm_draw_logprobs *lp)
{
    struct inflight *f = results_slot(be, "results: %s");
    if (f == NULL)
        return take_err(be);
    size_t ids_bytes = ((size_t)n * sizeof(int32_t) + 15) / 16 * 16;
    size_t total = ids_bytes + (size_t)n_lp * sizeof *lp;
    if (total > f->land_cap) { // nothing lands in it now: its last results were taken
        uint8_t *p = tdm_cuda_dev_host_alloc(be->dev, total);
        if (p == NULL) {
            fail(be, TDM_ENOMEM, "download: %s", "out of pinned host memory for the results");
            return take_err(be);
        }
        tdm_cuda_dev_host_free(be->dev, f->land);
        f->land = p;
        f->land_cap = total;
    }
    if (be->err == TDM_OK &&
        (tdm_cuda_dev_d2h_async(be->dev, f->land, ids, (size_t)n * sizeof(int32_t)) != TDM_OK ||
         (n_lp > 0 && tdm_cuda_dev_d2h_async(be->dev, f->land + ids_bytes, lp,
                                             (size_t)n_lp * sizeof *lp) != TDM_OK) ||
         tdm_cuda_dev_event_record(be->dev, f->event) != TDM_OK))
        fail(be, TDM_EBACKEND, "download: %s", tdm_cuda_dev_errmsg(be->dev));
    if (be->err != TDM_OK) {
        // Nothing may still land in the landing when a later step grows it.
        (void)tdm_cuda_dev_sync(be->dev);
        stream_idle(be);
        return take_err(be);
    }
    f->n = n;
    f->n_lp = n_lp;
    f->lp_at = ids_bytes;
    f->pending = true;
    f->landed = false;
    f->fenced = true;
    if (!be->fl[be->fl_cur ^ 1].pending)
        be->fl_head = be->fl_cur;
    be->fl_cur ^= 1;
    return TDM_OK;
}

// The oldest pending results (argmax_rows, sample_rows), once landed: ids[n]
// and lp[i] of each row i that asked logprobs.
static int cuda_take_results(struct tdm_backend *be, int32_t *ids, struct tdm_draw_logprobs *lp)
{
    struct inflight *f = &be->fl[be->fl_head];
    if (!f->pending) {
        fail(be, TDM_EINVAL, "take_results: %s", "no results issued");
        return take_err(be);
    }
    if (!f->landed && slot_wait(be, f) != TDM_OK) {
        f->pending = false;
        return take_err(be);
    }
    f->pending = f->landed = false;
    be->fl_head ^= 1;
    memcpy(ids, f->land, (size_t)f->n * sizeof(int32_t));
    const struct tdm_draw_logprobs *dl = (const void *)(f->land + f->lp_at);
    for (int j = 0; j < f->n_lp; j++)
        lp[f->lp_rows[j]] = dl[j];
    return take_err(be);
}

static int cuda_copy(struct tdm_backend *be, void *dst, const void *src, size_t bytes)
{
    if (tdm_cuda_dev_d2d(be->dev, dst, src, bytes) != TDM_OK)
        fail(be, TDM_EBACKEND, "copy: %s", tdm_cuda_dev_errmsg(be->dev));
    return be->err;
}

static int cuda_sync(struct tdm_backend *be)
{
    (void)stream_wait(be, "sync: %s");
    return take_err(be);
}

// ---- weights -----------------------------------------------------------------------------------
static uint16_t src_bf16(const struct tdm_weight_src *s, size_t i)
{
    uint16_t h;
    switch (s->dtype) {
    case TDM_DTYPE_BF16:
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        return h;
    case TDM_DTYPE_F16:
        memcpy(&h, (const uint8_t *)s->data + 2 * i, 2);
        return tdm_f32_to_bf16(tdm_f16_to_f32(h));
    default: {
        float f;
        memcpy(&f, (const uint8_t *)s->data + 4 * i, 4);
        return tdm_f32_to_bf16(f);
    }
    }
}

// The GEMV's scratch (fast mode) grown to a (rows, cols) weight's: split
// partials, and arrival counts that start at zero. At load, never while a
// graph is captured (a memset there would only be recorded). TDM_OK or
// TDM_ENOMEM.
static int gemv_scratch_reserve(struct tdm_backend *be, int rows, int cols)
{
    if (buf_reserve(be, &be->gemv_part, tdm_cuk_gemv_part_bytes(rows, cols)) != TDM_OK)
        return TDM_ENOMEM;
    int g = be_buf_grow(be, &be->gemv_counts, tdm_cuk_gemv_count_bytes(rows, cols));
    if (g < 0)
        return TDM_ENOMEM;
    if (g > 0) {
        be->gen++;
        if (tdm_cuda_dev_memset(be->dev, be->gemv_counts.p, 0, be->gemv_counts.bytes) != TDM_OK)
            return TDM_ENOMEM;
    }
    return TDM_OK;
}

static int cuda_prepare_weight(struct tdm_backend *be, struct tdm_weight *w,
                               const struct tdm_weight_src *parts, int nparts, int cols,
                               enum tdm_wtype want, char *err, size_t errlen)
{
    memset(w, 0, sizeof *w);
    if (want != TDM_W_BF16)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "cuda backend: only bf16 weights are supported (int8 weight-only is "
                          "CPU-only for now)");
    int rows = 0;
    for (int i = 0; i < nparts; i++)
        rows += parts[i].rows;
    if (rows <= 0 || cols <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "cuda backend: weight %d x %d", rows, cols);
    size_t n = (size_t)rows * (size_t)cols;
    uint16_t *host = malloc(n * sizeof *host);
    if (host == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda backend: out of host memory");
    size_t off = 0;
    for (int p = 0; p < nparts; p++) {
        size_t cnt = (size_t)parts[p].rows * (size_t)cols;
        for (size_t i = 0; i < cnt; i++)
            host[off + i] = src_bf16(&parts[p], i);
        off += cnt;
    }
    void *d = tdm_cuda_dev_alloc(be->dev, n * sizeof *host);
    int rc = TDM_OK;
    if (d == NULL)
        rc = tdm_seterr(err, errlen, TDM_ENOMEM,
                        "cuda backend: out of device memory for a %d x %d weight", rows, cols);
    else if (tdm_cuda_dev_h2d(be->dev, d, host, n * sizeof *host) != TDM_OK)
        rc = tdm_seterr(err, errlen, TDM_EBACKEND, "cuda backend: weight upload: %s",
                        tdm_cuda_dev_errmsg(be->dev));
    free(host);
    if (rc != TDM_OK) {
        tdm_cuda_dev_free(be->dev, d);
        return rc;
    }
    if (!be->batch_invariant && cols % 8 == 0 && gemv_scratch_reserve(be, rows, cols) != TDM_OK) {
        tdm_cuda_dev_free(be->dev, d);
        return tdm_seterr(err, errlen, TDM_ENOMEM,
                          "cuda backend: out of device memory for the GEMV's scratch");
    }
    w->type = TDM_W_BF16;
    w->rows = rows;
    w->cols = cols;
    w->data = d;
    w->nbytes = n * sizeof(uint16_t);
    return TDM_OK;
}

static void cuda_release_weight(struct tdm_backend *be, struct tdm_weight *w)
{
    tdm_cuda_dev_free(be->dev, w->data);
    w->data = NULL;
}

// ---- compute ops ------------------------------------------------------------------------------
// x is bf16 already (this backend's matmul-input format): the op that made it
// wrote bf16, so a GEMM is one launch. Fast mode (batch_invariant off): decode
// runs of up to TDM_CUK_GEMV_MAX_N rows on the GEMV (a weight whose columns
// are not a multiple of 8 stays on cuBLASLt), longer ones on cuBLASLt; prompt
// rows always on cuBLASLt's prompt algorithm, so a prompt row's numbers do
// not depend on its chunk's length in either mode.
static void gemm_rows(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                      const uint16_t *x, float *y, int n, enum tdm_gemm_class cls)
{
    if (cls == TDM_GEMM_DECODE && !be->batch_invariant && n <= TDM_CUK_GEMV_MAX_N &&
        w->cols % 8 == 0) {
        if (tdm_cuk_gemv_part_bytes(w->rows, w->cols) > be->gemv_part.bytes ||
            tdm_cuk_gemv_count_bytes(w->rows, w->cols) > be->gemv_counts.bytes) {
            fail(be, TDM_EINVAL, "matmul: %s",
                 "the GEMV's scratch was not sized for this weight (set_batch_invariant after "
                 "prepare_weight)");
            return;
        }
        launch_check(be, tdm_cuk_gemv(be->stream, w->data, w->rows, w->cols, x, n, bias, y,
                                      be->gemv_part.p, be->gemv_counts.p));
        return;
    }
    enum tdm_cuda_gemm_class dc =
        cls == TDM_GEMM_PROMPT ? TDM_CUDA_GEMM_PROMPT : TDM_CUDA_GEMM_DECODE;
    if (tdm_cuda_dev_gemm_bf16(be->dev, w->data, w->rows, w->cols, x, n, bias, y, dc) != TDM_OK)
        fail(be, TDM_EBACKEND, "matmul: %s", tdm_cuda_dev_errmsg(be->dev));
}

static void cuda_matmul(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                        const void *x, float *y, int n)
{
    gemm_rows(be, w, bias, x, y, n, TDM_GEMM_DECODE);
}

// One GEMM a run, x and y offset by its first row: a step of prompt and
// decode rows costs a launch more per GEMM than one call would.
static void cuda_matmul_runs(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                             const void *x, float *y, const struct tdm_row_run *runs, int n_runs)
{
    for (int i = 0; i < n_runs; i++)
        gemm_rows(be, w, bias, (const uint16_t *)x + (size_t)runs[i].row * (size_t)w->cols,
                  y + (size_t)runs[i].row * (size_t)w->rows, runs[i].n, runs[i].cls);
}

// Greedy rows: their argmax on the device, and only the ids to the host (4
// bytes a row instead of the vocabulary's logits: 39 MB a step at 64 rows of
// 151 936). After the head GEMM, on the engine's thread, outside any capture.
static int cuda_argmax_rows(struct tdm_backend *be, const float *x, int n, int cols)
{
    if (buf_reserve(be, &be->am_ids, (size_t)n * sizeof(int32_t)) != TDM_OK ||
        buf_reserve(be, &be->am_part, tdm_cuk_argmax_scratch(n, cols) + 16) != TDM_OK) {
        fail(be, TDM_ENOMEM, "argmax: %s", "out of device memory for the ids");
        return take_err(be);
    }
    launch_check(be, tdm_cuk_argmax_rows(be->stream, x, n, cols, be->am_ids.p, be->am_part.p));
    if (be->err != TDM_OK)
        return take_err(be);
    return results_issue(be, n, be->am_ids.p, 0, NULL);
}

// Grows a host array to n elements of size sz; false when out of memory.
static bool grow(void **p, int *cap, int n, size_t sz)
{
    if (n <= *cap)
        return true;
    void *q = realloc(*p, (size_t)n * sz);
    if (q == NULL)
        return false;
    *p = q;
    *cap = n;
    return true;
}

// Sampled rows (issue 26 item 1): drawn on the device by the CPU sampler's
// draw, and only the ids to the host, as the greedy rows' argmax.
// Slot f's list of the rows asking logprobs, for n rows.
static int32_t *lp_rows_reserve(struct inflight *f, int n)
{
    return grow((void **)&f->lp_rows, &f->lp_cap, n, sizeof *f->lp_rows) ? f->lp_rows : NULL;
}

// Lists (tdm_draw_params.list) a backend keeps at most: ids 0 .. 2^20 - 1.
#define TDM_CUDA_MAX_LISTS (1 << 20)

// sadj holding at least `entries` entries, the lists' regions kept.
static int arena_reserve(struct tdm_backend *be, int64_t entries)
{
    size_t sz = sizeof(struct tdm_draw_adj);
    if (entries > INT32_MAX) {
        fail(be, TDM_ENOMEM, "sample: %s", "adjustment lists past 2^31 entries");
        return be->err;
    }
    if (be_buf_grow_keep(be, &be->sadj, (size_t)entries * sz + 16, (size_t)be->lists_used * sz) < 0)
        fail(be, TDM_ENOMEM, "sample: %s", "out of device memory for the adjustments");
    return be->err;
}

// List `id` known to the host table and to list_n on the device.
static int lists_reserve(struct tdm_backend *be, int id)
{
    if (id < be->n_lists)
        return be->err;
    if (id >= TDM_CUDA_MAX_LISTS) {
        fail(be, TDM_EINVAL, "sample: %s", "an adjustment list past the 2^20 a backend keeps");
        return be->err;
    }
    int cap = be->n_lists ? be->n_lists : 64;
    while (cap <= id)
        cap *= 2;
    struct adj_list *grown = realloc(be->lists, (size_t)cap * sizeof *grown);
    if (grown == NULL) {
        fail(be, TDM_ENOMEM, "sample: %s", "out of memory for the adjustment lists");
        return be->err;
    }
    memset(grown + be->n_lists, 0, (size_t)(cap - be->n_lists) * sizeof *grown);
    be->lists = grown;
    if (be_buf_grow_keep(be, &be->list_n, (size_t)cap * sizeof(int32_t),
                         (size_t)be->n_lists * sizeof(int32_t)) < 0) {
        fail(be, TDM_ENOMEM, "sample: %s", "out of device memory for the adjustment lists");
        return be->err;
    }
    be->n_lists = cap;
    return be->err;
}

// The lists a draw's rows name: each one's region, moved to a larger one
// (its entries copied in stream order) when the entries it may hold once
// this draw's token is recorded outgrow it; at[i] = row i's region, -1
// without a list; *any: some row has one. The step's own n_adj entries then
// go at *step_at, past every list. TDM_OK or be's error.
static int lists_plan(struct tdm_backend *be, const struct tdm_draw_params *params, int n,
                      int n_adj, int32_t *at, int32_t *step_at, bool *any)
{
    size_t sz = sizeof(struct tdm_draw_adj);
    be->sample_calls++;
    *any = false;
    for (int i = 0; i < n; i++) {
        const struct tdm_draw_params *d = &params[i];
        at[i] = -1;
        if (d->list <= 0)
            continue;
        if (lists_reserve(be, d->list - 1) != TDM_OK)
            return be->err;
        struct adj_list *l = &be->lists[d->list - 1];
        if (l->stamp == be->sample_calls) {
            fail(be, TDM_EINVAL, "sample: %s", "two rows of one adjustment list in a draw");
            return be->err;
        }
        if (!d->list_load && !l->loaded) {
            fail(be, TDM_EINVAL, "sample: %s", "an adjustment list read before it was loaded");
            return be->err;
        }
        l->stamp = be->sample_calls;
        int64_t bound = (d->list_load ? (int64_t)d->n_adj : (int64_t)l->bound) +
                        ((d->rec_flags | d->rec_count) != 0);
        if (bound > l->cap) {
            int64_t cap = l->cap > 0 ? 2 * (int64_t)l->cap : 256;
            while (cap < bound)
                cap *= 2;
            if (arena_reserve(be, be->lists_used + cap) != TDM_OK)
                return be->err;
            if (!d->list_load && l->cap > 0 &&
                tdm_cuda_dev_d2d(be->dev, (char *)be->sadj.p + (size_t)be->lists_used * sz,
                                 (char *)be->sadj.p + (size_t)l->at * sz,
                                 (size_t)l->cap * sz) != TDM_OK) {
                fail(be, TDM_EBACKEND, "sample: %s", tdm_cuda_dev_errmsg(be->dev));
                return be->err;
            }
            l->at = be->lists_used;
            l->cap = (int32_t)cap;
            be->lists_used += (int32_t)cap;
        }
        l->bound = (int32_t)bound;
        l->loaded = true;
        at[i] = l->at;
        *any = true;
    }
    *step_at = be->lists_used;
    return arena_reserve(be, (int64_t)be->lists_used + n_adj);
}

static int cuda_sample_rows(struct tdm_backend *be, float *x, int n, int cols,
                            const struct tdm_draw_params *params, const struct tdm_draw_adj *adj,
                            int n_adj, const uint32_t *masks, size_t mask_words)
{
    size_t adj_bytes = (size_t)n_adj * sizeof *adj, mask_bytes = mask_words * sizeof *masks;
    int n_lp = 0;
    struct inflight *f = results_slot(be, "sample: %s");
    if (f == NULL)
        return take_err(be);
    int32_t *lp_rows = lp_rows_reserve(f, n);
    if (lp_rows == NULL) {
        fail(be, TDM_ENOMEM, "sample: %s", "out of memory for the logprobs' staging");
        return take_err(be);
    }
    if (!grow((void **)&be->h_lists_at, &be->h_lists_cap, n, sizeof *be->h_lists_at)) {
        fail(be, TDM_ENOMEM, "sample: %s", "out of memory for the lists' staging");
        return take_err(be);
    }
    bool any_pending = false;
    for (int i = 0; i < n; i++) {
        const struct tdm_draw_params *d = &params[i];
        if (d->logprobs)
            lp_rows[n_lp++] = i;
        // A list row read from its list has no entries of its own here.
        any_pending |= (d->list <= 0 || d->list_load) && d->n_adj > 0 &&
                       (adj[d->adj_off + d->n_adj - 1].flags & TDM_DRAW_ADJ_PENDING);
    }
    // The previous forward's chosen ids, before am_ids may move (a moved
    // buffer lives until the next full wait).
    const int32_t *prev_ids = be->am_ids.p;
    if (any_pending && prev_ids == NULL) {
        fail(be, TDM_EINVAL, "sample: %s", "a pending token without chosen ids on the device");
        return take_err(be);
    }
    int32_t step_at = 0;
    bool any_list = false;
    if (lists_plan(be, params, n, n_adj, be->h_lists_at, &step_at, &any_list) != TDM_OK)
        return take_err(be);
    size_t rows_bytes = ((size_t)n_lp * sizeof(int32_t) + 15) / 16 * 16;
    size_t lp_bytes = (size_t)n_lp * sizeof(struct tdm_draw_logprobs);
    if (buf_reserve(be, &be->am_ids, (size_t)n * sizeof(int32_t)) != TDM_OK ||
        buf_reserve(be, &be->sp, (size_t)n * sizeof *params) != TDM_OK ||
        buf_reserve(be, &be->lists_at, (size_t)n * sizeof(int32_t)) != TDM_OK ||
        buf_reserve(be, &be->smask, mask_bytes + 16) != TDM_OK ||
        buf_reserve(be, &be->slp, rows_bytes + lp_bytes + 16) != TDM_OK ||
        buf_reserve(be, &be->am_part, tdm_cuk_sample_scratch(n, n_lp, cols) + 16) != TDM_OK) {
        fail(be, TDM_ENOMEM, "sample: %s", "out of device memory for the parameters");
        return take_err(be);
    }
    int32_t *d_lp_rows = be->slp.p;
    struct tdm_draw_logprobs *d_lp = (void *)((char *)be->slp.p + rows_bytes);
    struct tdm_draw_adj *arena = be->sadj.p;
    // The inputs through the staging (the params' entries moved past the
    // lists, where the step's go), the draw, and the ids and logprobs back
    // in the step's one wait.
    struct tdm_draw_params *sp = stage_take(be, (size_t)n * sizeof *params);
    if (sp == NULL)
        return take_err(be);
    memcpy(sp, params, (size_t)n * sizeof *params);
    for (int i = 0; i < n; i++)
        sp[i].adj_off += step_at;
    if (stage_send(be, be->sp.p, sp, (size_t)n * sizeof *params, "upload: %s") != TDM_OK ||
        upload_async(be, arena + step_at, adj, adj_bytes) != TDM_OK ||
        (any_list &&
         upload_async(be, be->lists_at.p, be->h_lists_at, (size_t)n * sizeof(int32_t)) != TDM_OK) ||
        upload_async(be, be->smask.p, masks, mask_bytes) != TDM_OK ||
        upload_async(be, d_lp_rows, lp_rows, (size_t)n_lp * sizeof(int32_t)) != TDM_OK)
        return take_err(be);
    // The rows' lists bound (loaded from their entries, or as the step
    // before left them); then pending tokens (async scheduling) merged into
    // their rows' entries from the previous forward's ids, which this draw
    // overwrites only after; after the draw, its tokens recorded into the
    // lists.
    if (any_list)
        launch_check(
            be, tdm_cuk_list_bind(be->stream, be->sp.p, arena, be->lists_at.p, be->list_n.p, n));
    if (any_pending)
        launch_check(be, tdm_cuk_resolve_pending(be->stream, be->sp.p, arena, prev_ids, n));
    launch_check(be,
                 tdm_cuk_sample_rows(be->stream, x, n, cols, be->sp.p, params, arena, be->smask.p,
                                     be->am_ids.p, d_lp_rows, n_lp, d_lp, be->am_part.p));
    if (any_list)
        launch_check(
            be, tdm_cuk_list_record(be->stream, be->sp.p, arena, be->am_ids.p, be->list_n.p, n));
    if (be->err != TDM_OK)
        return take_err(be);
    return results_issue(be, n, be->am_ids.p, n_lp, d_lp);
}

// The rows of a forward whose token is a chosen token of the forward before:
// ids[pairs[2i]] = that forward's chosen id pairs[2i + 1], on the device,
// where its argmax or draw left the ids (am_ids: the next draw overwrites
// them only after this gather, in stream order). Outside a capture.
static int cuda_gather_ids(struct tdm_backend *be, int32_t *ids, const int32_t *pairs, int n)
{
    if (n <= 0)
        return be->err;
    if (be->am_ids.p == NULL) {
        fail(be, TDM_EINVAL, "gather_ids: %s", "no chosen ids on the device");
        return be->err;
    }
    if (buf_reserve(be, &be->gpairs, (size_t)n * 2 * sizeof(int32_t)) != TDM_OK) {
        fail(be, TDM_ENOMEM, "gather_ids: %s", "out of device memory for the pairs");
        return be->err;
    }
    if (upload_async(be, be->gpairs.p, pairs, (size_t)n * 2 * sizeof(int32_t)) != TDM_OK)
        return be->err;
    launch_check(be, tdm_cuk_gather_ids(be->stream, ids, be->am_ids.p, be->gpairs.p, n));
    return be->err;
}

static void cuda_embed(struct tdm_backend *be, const struct tdm_weight *w, const int32_t *ids,
                       int n, float *out)
{
    launch_check(be, tdm_cuk_embed(be->stream, w->data, w->rows, w->cols, ids, n, out));
}

static void cuda_rmsnorm(struct tdm_backend *be, const float *x, const float *weight, float eps,
                         void *out, int n, int dim)
{
    // No y: the kernel only reads x.
    launch_check(be,
                 tdm_cuk_add_rmsnorm(be->stream, (float *)x, NULL, weight, eps, out, 1, n, dim));
}

static void cuda_add_rmsnorm(struct tdm_backend *be, float *x, const float *y, const float *weight,
                             float eps, void *out, int n, int dim)
{
    launch_check(be, tdm_cuk_add_rmsnorm(be->stream, x, y, weight, eps, out, 1, n, dim));
}

static void cuda_rope(struct tdm_backend *be, float *x, int n, int row_stride, int n_heads,
                      int head_dim, const int32_t *pos, const float *inv_freq)
{
    launch_check(be, tdm_cuk_rope(be->stream, x, n, row_stride, n_heads, head_dim, pos, inv_freq));
}

static void cuda_silu_mul(struct tdm_backend *be, const float *gate_up, void *out, int n, int inter)
{
    launch_check(be, tdm_cuk_silu_mul(be->stream, gate_up, out, 1, n, inter));
}

static void cuda_add(struct tdm_backend *be, float *x, const float *y, size_t count)
{
    launch_check(be, tdm_cuk_add(be->stream, x, y, count));
}

// ---- KV storage ---------------------------------------------------------------------------------
struct cuda_kv_storage {
    struct tdm_kv_storage base;
    struct tdm_backend *be;
    enum tdm_cuk_kv_type type;
    int num_layers;
    size_t block_elems;       // num_kv_heads * block_size * head_dim
    size_t elem_bytes;        // 2 (bf16) or 4 (f32)
    void *slab;               // the one allocation: [num_layers][2 (K, V)][layer_bytes], device
    size_t layer_bytes;       // num_blocks * block_elems * elem_bytes
    void **k, **v;            // [num_layers] -> into slab: [num_blocks][heads][block_size][head_dim]
    // Exports and imports: P/D calls them from job and receive threads while
    // the engine computes on the device stream (and may be capturing a decode
    // graph there), so they run on a side stream of their own, ordered after
    // the engine's writes by the per-layer events, never queued behind the
    // engine's later layers. stage_mu serialises them (the side, the buffers).
    pthread_mutex_t stage_mu;
    struct tdm_cuda_side *side; // made on the first export or import
    void **layer_ev;            // [num_layers] recorded by mark_layer on the device stream
    struct dev_buf d_blocks;    // [nblocks] int32 block ids of one export/import, device
    struct dev_buf d_staging;   // [2][nblocks][block_elems] f32 (K then V), device
};

static void kvs_free(struct tdm_kv_storage *st)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    if (s == NULL)
        return;
    if (s->slab)
        tdm_cuda_dev_free(s->be->dev, s->slab);
    free(s->k);
    free(s->v);
    s->be->gen++; // graphs that addressed this pool are stale
    tdm_cuda_side_free(s->side); // waits for its copies
    for (int l = 0; s->layer_ev && l < s->num_layers; l++)
        tdm_cuda_dev_event_free(s->be->dev, s->layer_ev[l]);
    free(s->layer_ev);
    tdm_cuda_dev_free(s->be->dev, s->d_blocks.p);
    tdm_cuda_dev_free(s->be->dev, s->d_staging.p);
    pthread_mutex_destroy(&s->stage_mu);
    free(s);
}

static void *kvs_layer_k(struct tdm_kv_storage *st, int layer)
{
    return ((struct cuda_kv_storage *)st)->k[layer];
}

static void *kvs_layer_v(struct tdm_kv_storage *st, int layer)
{
    return ((struct cuda_kv_storage *)st)->v[layer];
}

// Export/import, on the storage's side stream: the block ids go to the device,
// a kernel gathers the blocks of K and of V into (or scatters them from) an
// f32 staging buffer in the transfer layout, and one copy moves it through
// the side's pinned host buffer. An export first waits (on the device) for the
// layer's last mark, so a prefill job sends layer l while the engine's stream
// still computes the layers above it (issue 25, item 4): the old export ran on
// the engine's stream and so waited for every kernel the engine had issued by
// then, which on a GPU running behind the host was the whole prefill.
// A storage buffer (not the backend's): growing it must not mark graphs stale
// (nor touch be->gen from a job thread). Idle when grown: its last user synced
// the side.
static int stage_reserve(struct cuda_kv_storage *s, struct dev_buf *b, size_t bytes)
{
    return dev_buf_grow(s->be->dev, b, bytes, NULL) < 0 ? TDM_ENOMEM : TDM_OK;
}

static int side_fail(struct cuda_kv_storage *s, const char *what)
{
    TDM_LOG_ERR("cuda", "kv %s: %s", what,
                s->side ? tdm_cuda_side_errmsg(s->side) : "no side stream");
    return TDM_EBACKEND;
}

// The side, the block ids on the device and room for `bytes` of staging on
// both sides; returns the pinned host buffer (ids after the staging bytes).
static int kvs_stage(struct cuda_kv_storage *s, const int *blocks, int nblocks, size_t bytes,
                     void **host)
{
    if (s->side == NULL) {
        char err[160];
        if (tdm_cuda_side_new(s->be->dev, &s->side, err, sizeof err) != TDM_OK) {
            TDM_LOG_ERR("cuda", "kv export/import: %s", err);
            return TDM_EBACKEND;
        }
    }
    size_t ids = (size_t)nblocks * sizeof(int32_t);
    if (stage_reserve(s, &s->d_blocks, ids) != TDM_OK ||
        stage_reserve(s, &s->d_staging, bytes) != TDM_OK)
        return TDM_ENOMEM;
    uint8_t *h = tdm_cuda_side_host(s->side, bytes + ids);
    if (h == NULL)
        return side_fail(s, "pinned host buffer");
    memcpy(h + bytes, blocks, ids); // int is int32_t here
    if (tdm_cuda_side_h2d(s->side, s->d_blocks.p, h + bytes, ids) != TDM_OK)
        return side_fail(s, "block ids");
    *host = h;
    return TDM_OK;
}

static int kvs_export_locked(struct cuda_kv_storage *s, int layer, const int *blocks,
                             int nblocks, float *k_out, float *v_out)
{
    size_t bytes = (size_t)nblocks * s->block_elems * sizeof(float);
    void *host = NULL;
    int rc = kvs_stage(s, blocks, nblocks, 2 * bytes, &host);
    if (rc != TDM_OK)
        return rc;
    void *stream = tdm_cuda_side_stream(s->side);
    float *kst = s->d_staging.p, *vst = kst + (size_t)nblocks * s->block_elems;
    if (s->layer_ev && s->layer_ev[layer] &&
        tdm_cuda_side_wait_event(s->side, s->layer_ev[layer]) != TDM_OK)
        return side_fail(s, "export wait");
    if (tdm_cuk_kv_gather(stream, s->type, s->k[layer], s->d_blocks.p, nblocks, s->block_elems,
                          kst) != TDM_CUK_OK ||
        tdm_cuk_kv_gather(stream, s->type, s->v[layer], s->d_blocks.p, nblocks, s->block_elems,
                          vst) != TDM_CUK_OK) {
        TDM_LOG_ERR("cuda", "kv export: %s", tdm_cuk_errmsg());
        return TDM_EBACKEND;
    }
    if (tdm_cuda_side_d2h(s->side, host, kst, 2 * bytes) != TDM_OK ||
        tdm_cuda_side_sync(s->side) != TDM_OK)
        return side_fail(s, "export copy");
    memcpy(k_out, host, bytes);
    memcpy(v_out, (uint8_t *)host + bytes, bytes);
    return TDM_OK;
}

static int kvs_import_locked(struct cuda_kv_storage *s, int layer, const int *blocks,
                             int nblocks, const float *k_in, const float *v_in)
{
    // The blocks are the importing sequence's alone, and no forward reads them
    // before the import returns: nothing on the engine's stream to wait for.
    size_t bytes = (size_t)nblocks * s->block_elems * sizeof(float);
    void *host = NULL;
    int rc = kvs_stage(s, blocks, nblocks, 2 * bytes, &host);
    if (rc != TDM_OK)
        return rc;
    void *stream = tdm_cuda_side_stream(s->side);
    float *kst = s->d_staging.p, *vst = kst + (size_t)nblocks * s->block_elems;
    memcpy(host, k_in, bytes);
    memcpy((uint8_t *)host + bytes, v_in, bytes);
    if (tdm_cuda_side_h2d(s->side, kst, host, 2 * bytes) != TDM_OK)
        return side_fail(s, "import copy");
    if (tdm_cuk_kv_scatter(stream, s->type, s->k[layer], s->d_blocks.p, nblocks, s->block_elems,
                           kst) != TDM_CUK_OK ||
        tdm_cuk_kv_scatter(stream, s->type, s->v[layer], s->d_blocks.p, nblocks, s->block_elems,
                           vst) != TDM_CUK_OK) {
        TDM_LOG_ERR("cuda", "kv import: %s", tdm_cuk_errmsg());
        tdm_cuda_side_sync(s->side); // the copy into staging is done before anyone reuses it
        return TDM_EBACKEND;
    }
    return tdm_cuda_side_sync(s->side) == TDM_OK ? TDM_OK : side_fail(s, "import");
}

static int kvs_export(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                      float *k_out, float *v_out)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    pthread_mutex_lock(&s->stage_mu);
    int rc = kvs_export_locked(s, layer, blocks, nblocks, k_out, v_out);
    pthread_mutex_unlock(&s->stage_mu);
    return rc;
}

static int kvs_import(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                      const float *k_in, const float *v_in)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    pthread_mutex_lock(&s->stage_mu);
    int rc = kvs_import_locked(s, layer, blocks, nblocks, k_in, v_in);
    pthread_mutex_unlock(&s->stage_mu);
    return rc;
}

// The engine's thread, in a forward with a push hook, after layer's KV
// stores were issued: the layer's event marks them. The events are made with
// the storage (layer_ev), so this only records (no allocation per layer).
static int kvs_mark_layer(struct tdm_kv_storage *st, int layer)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    if (s->layer_ev == NULL || s->layer_ev[layer] == NULL)
        return tdm_cuda_dev_sync(s->be->dev); // no event: everything issued is done
    if (tdm_cuda_dev_event_record(s->be->dev, s->layer_ev[layer]) != TDM_OK) {
        TDM_LOG_ERR("cuda", "kv mark layer %d: %s", layer, tdm_cuda_dev_errmsg(s->be->dev));
        return TDM_EBACKEND;
    }
    return TDM_OK;
}

// Any thread (a prefill job before its CUDA IPC or NCCL copies): the host
// waits for the writes before the layer's last mark, not for the layers the
// engine issued since.
static int kvs_wait_layer(struct tdm_kv_storage *st, int layer)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    if (s->layer_ev == NULL || s->layer_ev[layer] == NULL)
        return TDM_OK; // marks synced the stream
    pthread_mutex_lock(&s->stage_mu);
    int rc = TDM_OK;
    if (s->side == NULL) {
        char err[160];
        rc = tdm_cuda_side_new(s->be->dev, &s->side, err, sizeof err);
        if (rc != TDM_OK)
            TDM_LOG_ERR("cuda", "kv wait: %s", err);
    }
    if (rc == TDM_OK && tdm_cuda_side_event_sync(s->side, s->layer_ev[layer]) != TDM_OK)
        rc = side_fail(s, "wait layer");
    pthread_mutex_unlock(&s->stage_mu);
    return rc;
}

// The pool as one allocation (K and V of every layer in the slab), so one
// CUDA IPC handle exposes it whole to a prefill worker (issue 10).
static int kvs_device_pool(struct tdm_kv_storage *st, struct tdm_kv_device_pool *out)
{
    struct cuda_kv_storage *s = (struct cuda_kv_storage *)st;
    if (s->slab == NULL)
        return TDM_EINVAL;
    out->base = s->slab;
    out->bytes = 2 * s->layer_bytes * (size_t)s->num_layers;
    out->layer_stride = 2 * s->layer_bytes;
    out->v_offset = s->layer_bytes;
    out->block_bytes = s->block_elems * s->elem_bytes;
    out->elem_bytes = (int)s->elem_bytes;
    return TDM_OK;
}

static const struct tdm_kv_storage_ops kvs_ops = {
    .free = kvs_free,
    .layer_k = kvs_layer_k,
    .layer_v = kvs_layer_v,
    .export_blocks = kvs_export,
    .import_blocks = kvs_import,
    .device_pool = kvs_device_pool,
    .mark_layer = kvs_mark_layer,
    .wait_layer = kvs_wait_layer,
};

#define GIB(x) ((double)(x) / 1073741824.0)

int tdm_cuda_kv_budget(size_t total_b, size_t free_b, size_t held_b, double utilization,
                       size_t block_bytes, int block_size, int *num_blocks, char *err,
                       size_t errlen)
{
    double budget = utilization * (double)total_b - (double)held_b - (double)TDM_CUDA_KV_HEADROOM;
    if (budget < (double)block_bytes)
        return tdm_seterr(err, errlen, TDM_ECAPACITY,
                          "--gpu-memory-utilization %.2f of %.1f GiB leaves no room for one KV "
                          "block of %zu bytes (this instance already holds %.2f GiB, %.2f GiB "
                          "kept free)",
                          utilization, GIB(total_b), block_bytes, GIB(held_b),
                          GIB(TDM_CUDA_KV_HEADROOM));
    if (budget + (double)TDM_CUDA_KV_HEADROOM > (double)free_b)
        return tdm_seterr(err, errlen, TDM_ECAPACITY,
                          "--gpu-memory-utilization %.2f of %.1f GiB gives this instance a KV "
                          "pool of %.2f GiB (+%.2f GiB kept free), but the device has %.2f GiB "
                          "free: other processes hold %.2f GiB; lower --gpu-memory-utilization "
                          "here or there",
                          utilization, GIB(total_b), GIB(budget),
                          GIB(TDM_CUDA_KV_HEADROOM), GIB(free_b),
                          GIB(total_b > free_b + held_b ? total_b - free_b - held_b : 0));
    double nb = budget / (double)block_bytes;
    *num_blocks = nb > (double)(INT32_MAX / block_size) ? INT32_MAX / block_size : (int)nb;
    return TDM_OK;
}

static int cuda_kv_capacity(struct tdm_backend *be, const struct tdm_kv_config *cfg,
                            double utilization, int *num_blocks, char *err, size_t errlen)
{
    size_t free_b, total_b;
    if (tdm_cuda_dev_mem_info(be->dev, &free_b, &total_b) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EBACKEND, "cuda kv: %s", tdm_cuda_dev_errmsg(be->dev));
    size_t elem = be->kv_type == TDM_CUK_KV_F32 ? 4 : 2;
    size_t block = 2 * elem * (size_t)cfg->num_layers * (size_t)cfg->num_kv_heads *
                   (size_t)cfg->block_size * (size_t)cfg->head_dim;
    return tdm_cuda_kv_budget(total_b, free_b, tdm_cuda_dev_held(be->dev), utilization, block,
                              cfg->block_size, num_blocks, err, errlen);
}

static int cuda_kv_storage_new(struct tdm_backend *be, const struct tdm_kv_config *cfg,
                               struct tdm_kv_storage **out, char *err, size_t errlen)
{
    *out = NULL;
    if (cfg->num_layers <= 0 || cfg->num_kv_heads <= 0 || cfg->block_size <= 0 ||
        cfg->head_dim <= 0 || cfg->num_blocks <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "cuda kv: bad geometry");
    struct cuda_kv_storage *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda kv: out of memory");
    s->base.ops = &kvs_ops;
    s->base.host = false;
    s->base.dtype = be->kv_type == TDM_CUK_KV_F32 ? TDM_KV_F32 : TDM_KV_BF16;
    pthread_mutex_init(&s->stage_mu, NULL);
    s->be = be;
    s->type = be->kv_type;
    s->elem_bytes = s->type == TDM_CUK_KV_F32 ? 4 : 2;
    s->block_elems = (size_t)cfg->num_kv_heads * (size_t)cfg->block_size * (size_t)cfg->head_dim;
    size_t layer_bytes = s->block_elems * s->elem_bytes * (size_t)cfg->num_blocks;
    s->k = calloc((size_t)cfg->num_layers, sizeof *s->k);
    s->v = calloc((size_t)cfg->num_layers, sizeof *s->v);
    if (!s->k || !s->v) {
        kvs_free(&s->base);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda kv: out of memory");
    }
    s->num_layers = cfg->num_layers;
    s->layer_bytes = layer_bytes;
    // One zeroed allocation (a kernel reading past a sequence's last token
    // sees finite numbers), sliced per layer: one IPC handle covers the pool.
    s->slab = cuda_alloc(be, 2 * layer_bytes * (size_t)cfg->num_layers);
    if (s->slab == NULL) {
        kvs_free(&s->base);
        return tdm_seterr(err, errlen, TDM_ENOMEM,
                          "cuda kv: out of device memory for %d blocks (%zu bytes a layer)",
                          cfg->num_blocks, 2 * layer_bytes);
    }
    for (int l = 0; l < cfg->num_layers; l++) {
        s->k[l] = (char *)s->slab + 2 * layer_bytes * (size_t)l;
        s->v[l] = (char *)s->k[l] + layer_bytes;
    }
    // One event per layer for mark_layer. Without them (the driver refused)
    // a mark syncs the device stream: slower, never wrong.
    s->layer_ev = calloc((size_t)cfg->num_layers, sizeof *s->layer_ev);
    for (int l = 0; s->layer_ev && l < cfg->num_layers; l++)
        if (tdm_cuda_dev_event_new(be->dev, &s->layer_ev[l]) != TDM_OK) {
            TDM_LOG_WARN("cuda", "cuda kv: no per-layer events (%s); KV marks sync the stream",
                         tdm_cuda_dev_errmsg(be->dev));
            for (int j = 0; j < l; j++)
                tdm_cuda_dev_event_free(be->dev, s->layer_ev[j]);
            free(s->layer_ev);
            s->layer_ev = NULL;
            break;
        }
    *out = &s->base;
    return TDM_OK;
}

// ---- attention ---------------------------------------------------------------------------------
// Stages the attention metadata of a forward. fixed_bt_stride / fixed_splits
// (0 = as the batch needs) give a graph step its bucket's fixed shapes.
static int stage_forward(struct tdm_backend *be, struct tdm_kv_cache *kv,
                         const struct tdm_attn_seq *seqs, int n_seqs, int fixed_bt_stride,
                         int fixed_splits)
{
    // Every forward (eager or a graph's) starts here, on whatever thread runs
    // it: the engine's, a prefill job's, a test's. Its kernels go to the
    // calling thread's current device, so that is made this backend's first.
    if (tdm_cuda_dev_bind(be->dev) != TDM_OK) {
        fail(be, TDM_EBACKEND, "begin_forward: %s", tdm_cuda_dev_errmsg(be->dev));
        return take_err(be);
    }
    if (be->part_done_unset) {
        if (tdm_cuda_dev_memset(be->dev, be->d_part_done.p, 0, be->d_part_done.bytes) != TDM_OK) {
            fail(be, TDM_EBACKEND, "begin_forward: %s", tdm_cuda_dev_errmsg(be->dev));
            return take_err(be);
        }
        be->part_done_unset = false;
    }
    const struct tdm_kv_config *c = tdm_kv_config(kv);
    if (tdm_kv_storage(kv)->ops != &kvs_ops) {
        fail(be, TDM_EINVAL, "begin_forward: %s",
             "the KV cache is not in this backend's memory (create it with tdm_model_kv_new)");
        return take_err(be);
    }
    int bs = c->block_size, rows = 0, bt_stride = 1, tiles = 0;
    for (int s = 0; s < n_seqs; s++) {
        int nb = (seqs[s].start_pos + seqs[s].n_tokens + bs - 1) / bs;
        bt_stride = nb > bt_stride ? nb : bt_stride;
        rows += seqs[s].n_tokens;
        tiles += (seqs[s].n_tokens + TDM_CUK_PREFILL_BQ - 1) / TDM_CUK_PREFILL_BQ;
    }
    if (fixed_bt_stride > 0)
        bt_stride = fixed_bt_stride;
    bool ok = grow((void **)&be->h_slots, &be->cap_rows, rows, sizeof(int32_t)) &&
              grow((void **)&be->h_bt, &be->cap_bt, n_seqs * bt_stride, sizeof(int32_t)) &&
              grow((void **)&be->h_tiles, &be->cap_tiles, 2 * tiles, sizeof(int32_t));
    if (ok && n_seqs > be->cap_seqs) {
        // Five arrays of one capacity: the capacity moves only when all grew.
        int c1 = be->cap_seqs, c2 = c1, c3 = c1, c4 = c1, c5 = c1;
        ok = grow((void **)&be->h_row, &c1, n_seqs, sizeof(int32_t)) &&
             grow((void **)&be->h_ntok, &c2, n_seqs, sizeof(int32_t)) &&
             grow((void **)&be->h_start, &c3, n_seqs, sizeof(int32_t)) &&
             grow((void **)&be->h_dec, &c4, n_seqs, sizeof(int32_t)) &&
             grow((void **)&be->h_seqs, &c5, n_seqs, sizeof(struct tdm_cuk_seq));
        if (ok)
            be->cap_seqs = n_seqs;
    }
    if (!ok) {
        fail(be, TDM_ENOMEM, "begin_forward: %s", "out of host memory");
        return take_err(be);
    }
    for (int s = 0; s < n_seqs; s++) {
        const struct tdm_attn_seq *q = &seqs[s];
        int nb = (q->start_pos + q->n_tokens + bs - 1) / bs;
        for (int b = 0; b < bt_stride; b++)
            be->h_bt[s * bt_stride + b] = b < nb ? q->block_table[b] : 0;
        for (int i = 0; i < q->n_tokens; i++) {
            int pos = q->start_pos + i;
            be->h_slots[q->row + i] = q->pad ? -1 : q->block_table[pos / bs] * bs + pos % bs;
        }
        be->h_row[s] = q->row;
        be->h_ntok[s] = q->n_tokens;
        be->h_start[s] = q->start_pos;
    }
    if (tdm_cuk_attn_plan(be->h_row, be->h_ntok, be->h_start, n_seqs, 1, 1, be->h_seqs, be->h_dec,
                          be->h_tiles, tiles, &be->plan) != TDM_CUK_OK) {
        fail(be, TDM_EINVAL, "begin_forward: %s", tdm_cuk_errmsg());
        return take_err(be);
    }
    if (fixed_splits > 0 && fixed_splits >= be->plan.max_splits)
        be->plan.max_splits = fixed_splits;
    // One packed copy: slots, block tables, seqs, decode list, tiles.
    const void *src[5] = {be->h_slots, be->h_bt, be->h_seqs, be->h_dec, be->h_tiles};
    size_t len[5] = {(size_t)rows * sizeof(int32_t), (size_t)n_seqs * bt_stride * sizeof(int32_t),
                     (size_t)n_seqs * sizeof(struct tdm_cuk_seq),
                     (size_t)be->plan.n_decode * sizeof(int32_t),
                     (size_t)be->plan.n_tiles * 2 * sizeof(int32_t)};
    size_t off[5], total = 0;
    for (int i = 0; i < 5; i++) {
        off[i] = total;
        total += (len[i] + 15) / 16 * 16;
    }
    if (buf_reserve(be, &be->d_meta, total) != TDM_OK) {
        fail(be, TDM_ENOMEM, "begin_forward: %s", "out of device memory for attention metadata");
        return take_err(be);
    }
    uint8_t *h = stage_take(be, total);
    if (h == NULL)
        return take_err(be);
    for (int i = 0; i < 5; i++)
        if (len[i])
            memcpy(h + off[i], src[i], len[i]);
    if (stage_send(be, be->d_meta.p, h, total, "begin_forward: %s") != TDM_OK)
        return take_err(be);
    const uint8_t *base = be->d_meta.p;
    be->m_slots = (const int32_t *)(base + off[0]);
    be->m_bt = (const int32_t *)(base + off[1]);
    be->m_seqs = (const struct tdm_cuk_seq *)(base + off[2]);
    be->m_dec = (const int32_t *)(base + off[3]);
    be->m_tiles = (const int32_t *)(base + off[4]);
    be->n_rows = rows;
    be->n_seqs = n_seqs;
    be->bt_stride = bt_stride;
    return be->err;
}

static int cuda_begin_forward(struct tdm_backend *be, struct tdm_kv_cache *kv,
                              const struct tdm_attn_seq *seqs, int n_seqs)
{
    return stage_forward(be, kv, seqs, n_seqs, 0, 0);
}

// ---- CUDA graphs -------------------------------------------------------------------------------
static int pow2_at_least(int x)
{
    int p = 1;
    while (p < x)
        p *= 2;
    return p;
}

static void graph_drop(struct tdm_backend *be, struct graph_slot *g)
{
    tdm_cuda_dev_graph_free(be->dev, g->graph);
    memset(g, 0, sizeof *g);
}

// A decode step's graph: its key is the padded row count, the block-table
// width and split count rounded up to powers of two (so a sequence growing
// past one needs a new graph only log-many times), and the KV pool.
static int cuda_graph_begin(struct tdm_backend *be, struct tdm_kv_cache *kv,
                            const struct tdm_attn_seq *seqs, int n_seqs, bool *replay)
{
    *replay = false;
    be->graph_cur = -1;
    const struct tdm_kv_config *c = tdm_kv_config(kv);
    int max_len = 1;
    for (int s = 0; s < n_seqs; s++) {
        if (seqs[s].n_tokens != 1) {
            fail(be, TDM_EINVAL, "graph_begin: %s", "a graph step decodes one token per sequence");
            return take_err(be);
        }
        max_len = seqs[s].start_pos + 1 > max_len ? seqs[s].start_pos + 1 : max_len;
    }
    int bt_stride = pow2_at_least((max_len + c->block_size - 1) / c->block_size);
    int splits = pow2_at_least(tdm_cuk_decode_splits(max_len));
    int rc = stage_forward(be, kv, seqs, n_seqs, bt_stride, splits);
    if (rc != TDM_OK)
        return rc;
    const struct tdm_kv_storage *kvs = tdm_kv_storage(kv);
    int slot = -1, lru = 0;
    for (int i = 0; i < TDM_CUDA_GRAPH_SLOTS; i++) {
        struct graph_slot *g = &be->graphs[i];
        if (g->rows == n_seqs && g->bt_stride == bt_stride && g->splits == splits &&
            g->kvs == kvs) {
            slot = i;
            break;
        }
        if (g->last_use < be->graphs[lru].last_use)
            lru = i;
    }
    if (slot < 0) {
        // First sight of this bucket: run eagerly, which sizes every buffer
        // the graph will use, and capture next time.
        slot = lru;
        graph_drop(be, &be->graphs[slot]);
        struct graph_slot *g = &be->graphs[slot];
        g->rows = n_seqs;
        g->bt_stride = bt_stride;
        g->splits = splits;
        g->kvs = kvs;
        be->graph_mode = 0;
    } else if (be->graphs[slot].graph != NULL && be->graphs[slot].gen == be->gen) {
        be->graph_mode = 2;
        *replay = true;
    } else {
        tdm_cuda_dev_graph_free(be->dev, be->graphs[slot].graph);
        be->graphs[slot].graph = NULL;
        if (tdm_cuda_dev_capture_begin(be->dev) != TDM_OK) {
            fail(be, TDM_EBACKEND, "graph capture: %s", tdm_cuda_dev_errmsg(be->dev));
            return take_err(be);
        }
        be->graph_mode = 1;
        be->graph_gen = be->gen;
    }
    be->graphs[slot].last_use = ++be->tick;
    be->graph_cur = slot;
    return TDM_OK;
}

static int cuda_graph_end(struct tdm_backend *be)
{
    if (be->graph_cur < 0) {
        fail(be, TDM_EINVAL, "graph_end: %s", "no graph_begin");
        return take_err(be);
    }
    struct graph_slot *g = &be->graphs[be->graph_cur];
    be->graph_cur = -1;
    if (be->graph_mode == 0)
        return be->err;
    if (be->graph_mode == 1) {
        void *graph = NULL;
        if (tdm_cuda_dev_capture_end(be->dev, &graph) != TDM_OK) {
            fail(be, TDM_EBACKEND, "graph capture: %s", tdm_cuda_dev_errmsg(be->dev));
            return take_err(be);
        }
        if (be->gen != be->graph_gen || be->err != TDM_OK) {
            // A buffer moved (or an op failed) while recording: the graph
            // must not run; the step failed and the next one recaptures.
            tdm_cuda_dev_graph_free(be->dev, graph);
            fail(be, TDM_EBACKEND, "graph capture: %s", "a buffer moved while recording");
            return take_err(be);
        }
        g->graph = graph;
        g->gen = be->gen;
    }
    if (tdm_cuda_dev_graph_launch(be->dev, g->graph) != TDM_OK)
        fail(be, TDM_EBACKEND, "graph launch: %s", tdm_cuda_dev_errmsg(be->dev));
    return be->err;
}

// The staged forward's cache, in this backend's memory: NULL (the backend's
// error set, naming op) when kv is another storage or the batch is not the
// one begin_forward staged.
static struct cuda_kv_storage *staged_storage(struct tdm_backend *be, struct tdm_kv_cache *kv,
                                              int n_seqs, const char *op)
{
    struct tdm_kv_storage *st = tdm_kv_storage(kv);
    if (st->ops != &kvs_ops || n_seqs != be->n_seqs) {
        fail(be, TDM_EINVAL, "%s: no begin_forward for this batch and cache", op);
        return NULL;
    }
    return (struct cuda_kv_storage *)st;
}

static void cuda_kv_store(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                          const struct tdm_attn_seq *seqs, int n_seqs, const float *k,
                          const float *v, int stride)
{
    (void)seqs;
    struct cuda_kv_storage *s = staged_storage(be, kv, n_seqs, "kv_store");
    if (s == NULL)
        return;
    const struct tdm_kv_config *c = tdm_kv_config(kv);
    launch_check(be, tdm_cuk_kv_store(be->stream, s->type, k, v, stride, be->m_slots, be->n_rows,
                                      s->k[layer], s->v[layer], c->num_kv_heads, c->head_dim,
                                      c->block_size));
}

// Attention of the staged batch over s (bf16 out); with inv_freq, a
// decode-only batch's RoPE and KV store run inside the decode kernel.
static void attend(struct tdm_backend *be, struct cuda_kv_storage *s, int block_size, int layer,
                   const float *q, int q_stride, void *out, int n_heads, int n_kv_heads,
                   int head_dim, float scale, const float *inv_freq)
{
    const struct tdm_cuk_plan *p = &be->plan;
    size_t part = (size_t)p->n_decode * (size_t)n_heads * (size_t)p->max_splits;
    size_t counts = (size_t)p->n_decode * (size_t)n_heads * sizeof(int32_t) + 4;
    int grew = be_buf_grow(be, &be->d_part_done, counts);
    if (grew > 0) {
        be->gen++;
        if (tdm_cuda_dev_memset(be->dev, be->d_part_done.p, 0, be->d_part_done.bytes) != TDM_OK) {
            fail(be, TDM_EBACKEND, "attention: %s", tdm_cuda_dev_errmsg(be->dev));
            return;
        }
        be->part_done_unset = be->graph_cur >= 0 && be->graph_mode == 1;
    }
    if (grew < 0 || buf_reserve(be, &be->d_part_o, part * (size_t)head_dim * sizeof(float) + 4) ||
        buf_reserve(be, &be->d_part_ml, part * 2 * sizeof(float) + 4)) {
        fail(be, TDM_ENOMEM, "attention: %s", "out of device memory for decode splits");
        return;
    }
    struct tdm_cuk_attn_args a = {
        .kv_type = s->type,
        .q = q,
        .q_stride = q_stride,
        .out = out,
        .out_bf16 = 1,
        .inv_freq = inv_freq,
        .slots = be->m_slots,
        .k_cache = s->k[layer],
        .v_cache = s->v[layer],
        .seqs = be->m_seqs,
        .block_tables = be->m_bt,
        .bt_stride = be->bt_stride,
        .decode_seqs = be->m_dec,
        .n_decode = p->n_decode,
        .max_splits = p->max_splits,
        .part_o = be->d_part_o.p,
        .part_ml = be->d_part_ml.p,
        .part_done = be->d_part_done.p,
        .prefill_tiles = be->m_tiles,
        .n_tiles = p->n_tiles,
        .n_heads = n_heads,
        .n_kv_heads = n_kv_heads,
        .head_dim = head_dim,
        .block_size = block_size,
        .scale = scale,
    };
    launch_check(be, tdm_cuk_attention(be->stream, &a));
}

static void cuda_attention(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                           const struct tdm_attn_seq *seqs, int n_seqs, const float *q,
                           int q_stride, void *out, int n_heads, int n_kv_heads, int head_dim,
                           float scale)
{
    (void)seqs;
    struct cuda_kv_storage *s = staged_storage(be, kv, n_seqs, "attention");
    if (s != NULL)
        attend(be, s, tdm_kv_config(kv)->block_size, layer, q, q_stride, out, n_heads, n_kv_heads,
               head_dim, scale, NULL);
}

// A decode-only batch: one launch (RoPE, the KV store and the merge of a
// sequence's splits inside the decode kernel). Else RoPE and the store in one
// launch, then attention.
static void cuda_rope_store_attention(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                                      const struct tdm_attn_seq *seqs, int n_seqs, float *qkv,
                                      int qkv_stride, const int32_t *pos, const float *inv_freq,
                                      void *out, int n_heads, int n_kv_heads, int head_dim,
                                      float scale)
{
    (void)seqs;
    struct cuda_kv_storage *s = staged_storage(be, kv, n_seqs, "attention");
    if (s == NULL)
        return;
    int bs = tdm_kv_config(kv)->block_size;
    if (be->plan.n_tiles == 0) {
        attend(be, s, bs, layer, qkv, qkv_stride, out, n_heads, n_kv_heads, head_dim, scale,
               inv_freq);
        return;
    }
    launch_check(be, tdm_cuk_rope_kv_store(be->stream, s->type, qkv, qkv_stride, n_heads,
                                           n_kv_heads, head_dim, pos, inv_freq, be->m_slots,
                                           be->n_rows, s->k[layer], s->v[layer], bs));
    attend(be, s, bs, layer, qkv, qkv_stride, out, n_heads, n_kv_heads, head_dim, scale, NULL);
}

const struct tdm_backend_ops TDM_CUDA_BACKEND_OPS = {
    .name = "cuda",
    .host_memory = false,
    .device_count = tdm_cuda_dev_count,
    .create = cuda_create,
    .destroy = cuda_destroy,
    .set_batch_invariant = cuda_set_batch_invariant,
    .prepare_weight = cuda_prepare_weight,
    .release_weight = cuda_release_weight,
    .alloc = cuda_alloc,
    .release = cuda_release,
    .upload = cuda_upload,
    .download = cuda_download,
    .copy = cuda_copy,
    .sync = cuda_sync,
    .kv_capacity = cuda_kv_capacity,
    .kv_storage_new = cuda_kv_storage_new,
    .begin_forward = cuda_begin_forward,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .matmul = cuda_matmul,
    .matmul_runs = cuda_matmul_runs,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .add_rmsnorm = cuda_add_rmsnorm,
    .rope_store_attention = cuda_rope_store_attention,
    .rope = cuda_rope,
    .kv_store = cuda_kv_store,
    .attention = cuda_attention,
    .silu_mul = cuda_silu_mul,
    .add = cuda_add,
    .argmax_rows = cuda_argmax_rows,
    .sample_rows = cuda_sample_rows,
    .take_results = cuda_take_results,
    .gather_ids = cuda_gather_ids,
};
