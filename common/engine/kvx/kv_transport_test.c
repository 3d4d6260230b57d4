// SPDX-License-Identifier: Apache-2.0
// Tests for the KV transport table (kv_transport.h): each mode
// driven only through its table over a fake host (the role's lease, frames
// and stop) and a fake CUDA/NCCL table (host memory, copies that land late):
// nng frames with their payload; CUDA IPC copies into the decode worker's
// pool with in-place frames, the last one closing; NCCL's "post your
// receives" frame, grouped sends and the link handed back; the fallbacks
// (a handle that does not open, layouts that differ) with their reasons;
// a lease refused; the closed frame of an offered transfer on free. The
// receiver side against the sender's tables: the modes offered (the
// generic choice), each mode's frames through its table (nng's payload
// imported, CUDA IPC's and NCCL's layers counted) with their checks, NCCL's
// own receives (complete), the progress the role reads.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kv_transport.h"

// ---- the fake device table -----------------------------------------------------------------
static struct {
    int opens, fail_open, inits, aborts;
    enum tdm_kvx_comm_state state;
    void *q_dst[256];
    const void *q_src[256];
    size_t q_bytes[256];
    int nq, done, event_delay, queries, events_live;
    size_t sent_bytes;    // NCCL: bytes of every send
    const void *wire[64]; // NCCL: sends not yet received
    size_t wire_bytes[64];
    int head, tail;
    int sends, groups_open, allocs;
} F;

static uint8_t DST[2][2][8][16]; // the decode worker's pool: [layer][k/v][block][bytes]

static int f_ipc_open(void *ctx, const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr,
                      char *err, size_t errlen)
{
    (void)ctx, (void)handle;
    if (F.fail_open) {
        snprintf(err, errlen, "invalid device context");
        return -1;
    }
    F.opens++;
    *dev_ptr = DST;
    return 0;
}

static int f_ipc_close(void *ctx, void *dev_ptr)
{
    (void)ctx, (void)dev_ptr;
    return 0;
}

static int f_unique_id(void *ctx, uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    memset(id, 0xa5, TDM_KVX_NCCL_ID_BYTES);
    return 0;
}

static int f_init_start(void *ctx, const uint8_t id[TDM_KVX_NCCL_ID_BYTES], int rank, void **comm,
                        char *err, size_t errlen)
{
    (void)ctx, (void)id, (void)err, (void)errlen, (void)rank;
    *comm = (void *)(uintptr_t)(0x100 * ++F.inits);
    return 0;
}

static int f_state(void *ctx, void *comm, enum tdm_kvx_comm_state *state, char *err, size_t errlen)
{
    (void)ctx, (void)comm, (void)err, (void)errlen;
    *state = F.state;
    return 0;
}

static int f_abort(void *ctx, void *comm)
{
    (void)ctx, (void)comm;
    F.aborts++;
    return 0;
}

static int f_destroy(void *ctx, void *comm)
{
    (void)ctx, (void)comm;
    return 0;
}

static int f_copy_async(void *ctx, void *dst, const void *src, size_t bytes, char *err,
                        size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    F.q_dst[F.nq] = dst;
    F.q_src[F.nq] = src;
    F.q_bytes[F.nq++] = bytes;
    return 0;
}

static int f_event_record(void *ctx, void **event, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    *event = (void *)(uintptr_t)(F.nq + 1); // completes the copies queued so far
    F.queries = 0;
    F.events_live++;
    return 0;
}

static int f_event_query(void *ctx, void *event)
{
    (void)ctx;
    if (++F.queries <= F.event_delay)
        return 0;
    for (int upto = (int)(uintptr_t)event - 1; F.done < upto; F.done++)
        memcpy(F.q_dst[F.done], F.q_src[F.done], F.q_bytes[F.done]);
    return 1;
}

static void f_event_free(void *ctx, void *event)
{
    (void)ctx, (void)event;
    F.events_live--;
}

static int f_nccl_send(void *ctx, void *comm, const void *buf, size_t bytes, int peer, char *err,
                       size_t errlen)
{
    (void)ctx, (void)comm, (void)err, (void)errlen;
    assert_int_equal(peer, 0);
    F.sends++;
    F.sent_bytes += bytes;
    F.wire[F.tail % 64] = buf;
    F.wire_bytes[F.tail++ % 64] = bytes;
    return 0;
}

static int f_nccl_recv(void *ctx, void *comm, void *buf, size_t bytes, int peer, char *err,
                       size_t errlen)
{
    (void)ctx, (void)comm;
    assert_int_equal(peer, 1);
    if (F.head == F.tail || F.wire_bytes[F.head % 64] != bytes) {
        snprintf(err, errlen, "fake: no matching send of %zu bytes", bytes);
        return -1;
    }
    memcpy(buf, F.wire[F.head++ % 64], bytes); // the sends were issued (and kept) first
    return 0;
}

static int f_nccl_group(void *ctx, bool begin, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    F.groups_open += begin ? 1 : -1;
    return 0;
}

static int f_dev_alloc(void *ctx, size_t bytes, void **dev_ptr, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    *dev_ptr = calloc(1, bytes);
    F.allocs++;
    return 0;
}

static void f_dev_free(void *ctx, void *dev_ptr)
{
    (void)ctx;
    free(dev_ptr);
    F.allocs--;
}

static const struct tdm_kvx_ops OPS = {
    .ipc_open = f_ipc_open,
    .ipc_close = f_ipc_close,
    .nccl_unique_id = f_unique_id,
    .nccl_init_start = f_init_start,
    .nccl_state = f_state,
    .nccl_abort = f_abort,
    .nccl_destroy = f_destroy,
    .copy_async = f_copy_async,
    .event_record = f_event_record,
    .event_query = f_event_query,
    .event_free = f_event_free,
    .nccl_send = f_nccl_send,
    .nccl_recv = f_nccl_recv,
    .nccl_group = f_nccl_group,
    .dev_alloc = f_dev_alloc,
    .dev_free = f_dev_free,
};

// ---- our pool and the fake host --------------------------------------------------------------
enum { PL = 2, PB = 8, BB = 16, NBLK = 3 };
static uint8_t SRC[PL][2][PB][BB];
static const int OUR_IDS[NBLK] = {5, 6, 0};   // our blocks of the push range
static const int THEIR_IDS[NBLK] = {1, 2, 7}; // the decode worker's

static void *src_layer(void *arg, int layer, bool v)
{
    (void)arg;
    return SRC[layer][v];
}

static void *dst_layer(void *arg, int layer, bool v)
{
    (void)arg;
    return DST[layer][v];
}

static struct {
    struct tdm_kv_frame frames[16];
    char transport[16][16];
    int nframes, leases, unleases, fail_lease, fail_send;
    bool gone;
} H;

static int h_lease(void *ctx, int layers, int *src_blocks)
{
    (void)ctx;
    assert_true(layers >= 1 && layers <= PL);
    if (H.fail_lease)
        return TDM_EINVAL;
    H.leases++;
    memcpy(src_blocks, OUR_IDS, sizeof OUR_IDS);
    return TDM_OK;
}

static void h_unlease(void *ctx)
{
    (void)ctx;
    H.unleases++;
}

static int h_send(void *ctx, const struct tdm_kv_frame *f, char *err, size_t errlen)
{
    (void)ctx;
    if (H.fail_send)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "peer gone");
    assert_true(H.nframes < 16);
    snprintf(H.transport[H.nframes], sizeof H.transport[0], "%s", f->transport);
    H.frames[H.nframes] = *f;
    H.frames[H.nframes].transport = H.transport[H.nframes];
    H.nframes++;
    return TDM_OK;
}

static bool h_gone(void *ctx)
{
    (void)ctx;
    return H.gone;
}

static const struct tdm_kv_send_host HOST = {
    .lease = h_lease, .unlease = h_unlease, .send = h_send, .gone = h_gone};

static int reset(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    memset(&H, 0, sizeof H);
    F.state = TDM_KVX_COMM_READY;
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++)
            for (int b = 0; b < PB; b++)
                memset(SRC[l][v][b], 1 + l * 64 + v * 32 + b, BB);
    memset(DST, 0, sizeof DST);
    setenv("TANDEM_HOST_ID", "node-a", 1);
    return 0;
}

static struct tdm_kv_transport *transport_of(enum tdm_kvx_role role, const struct tdm_kvx_ops *ops,
                                             enum tdm_kvx_mode set)
{
    struct tdm_kv_transport_config c = {
        .role = role,
        .setting = set,
        .ops = ops,
        .gpu = ops != NULL,
        .pool_base = role == TDM_KVX_PREFILL ? (void *)SRC : (void *)DST,
        .elem_bytes = 2,
        .block_bytes = BB,
        .num_layers = PL,
        .num_blocks = PB,
        .own_layer = role == TDM_KVX_PREFILL ? src_layer : dst_layer,
        .nccl_timeout = 5};
    struct tdm_kv_transport *t = NULL;
    assert_int_equal(tdm_kv_transport_new(&t, &c), TDM_OK);
    return t;
}

static struct tdm_kv_transport *transport(const struct tdm_kvx_ops *ops, enum tdm_kvx_mode set)
{
    return transport_of(TDM_KVX_PREFILL, ops, set);
}

// The decode worker's side: its pool offered (or not), on `host`.
static struct tdm_kv_send_params params(bool offered, const char *host)
{
    struct tdm_kv_send_params p = {.peer = "tcp://decode:9001",
                                   .peer_instance = 7,
                                   .request_id = "r1",
                                   .peer_setting = "auto",
                                   .peer_host = host,
                                   .offered = offered,
                                   .dst_blocks = THEIR_IDS,
                                   .num_blocks = NBLK,
                                   .has_nccl_id = offered,
                                   .layers_per_group = 1,
                                   .payload_layer_bytes = 100};
    p.pool = (struct tdm_kvx_pool){.bytes = sizeof DST,
                                   .layer_stride = 2 * PB * BB,
                                   .v_offset = PB * BB,
                                   .block_bytes = BB,
                                   .num_layers = PL,
                                   .num_blocks = PB,
                                   .elem_bytes = 2,
                                   .gpu = true,
                                   .nccl = true};
    memset(p.nccl_id, 0x5a, sizeof p.nccl_id);
    return p;
}

// Pushes every layer, one group a layer, through the chosen table.
static void push_all(struct tdm_kv_send *s, size_t want_bytes_per_layer)
{
    const struct tdm_kv_transport_ops *ops = tdm_kv_send_ops(s);
    char err[256] = "";
    for (int l = 0; l < PL; l++) {
        size_t bytes = 0;
        double copy_s = -1;
        assert_int_equal(ops->push_layers(s, l, 1, &bytes, &copy_s, err, sizeof err), TDM_OK);
        assert_int_equal(bytes, want_bytes_per_layer);
        assert_true(ops->mode == TDM_KVX_NNG ? copy_s == 0 : copy_s >= 0);
        assert_int_equal(ops->poll(s), TDM_OK);
    }
}

// ---- the tests -----------------------------------------------------------------------------
// Without a device table: nng, each group one frame with its payload; the
// offered transfer ends with one closed frame on free, a plain one with none.
static void test_nng(void **state)
{
    (void)state;
    struct tdm_kv_transport *t = transport(NULL, TDM_KVX_AUTO);
    assert_false(tdm_kv_transport_has_nccl(t));
    for (int offered = 0; offered < 2; offered++) {
        memset(&H, 0, sizeof H);
        struct tdm_kv_send_params p = params(offered, "node-a");
        struct tdm_kv_send *s = NULL;
        assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
        assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
        assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nng_ops);
        push_all(s, 100);
        assert_int_equal(H.nframes, PL);
        for (int i = 0; i < PL; i++) {
            assert_true(H.frames[i].payload);
            assert_string_equal(H.frames[i].transport, "nng");
            assert_int_equal(H.frames[i].first_layer, i);
            assert_int_equal(H.frames[i].num_blocks, NBLK);
            assert_false(H.frames[i].closed);
        }
        assert_string_equal(H.frames[1].why, ""); // the reason rides on the first only
        assert_int_equal(H.leases, 0);            // the role exports the payload itself
        tdm_kv_send_free(s);
        assert_int_equal(H.nframes, PL + offered);
        if (offered) {
            assert_true(H.frames[PL].closed);
            assert_int_equal(H.frames[PL].num_layers, 0);
        }
    }
    // The offer as the PrefillRequest carries it: one block id per pushed block.
    struct tdm_kv_send_params p = params(true, "node-a");
    uint8_t wire[TDM_KVX_POOL_WIRE_BYTES];
    tdm_kvx_pool_encode(&p.pool, wire);
    struct tdm_kvx_pool back;
    char err[256];
    assert_int_equal(tdm_kv_send_check_offer(wire, sizeof wire, NBLK, NBLK, &back, err, sizeof err),
                     TDM_OK);
    assert_int_equal(back.num_blocks, PB);
    assert_int_equal(tdm_kv_send_check_offer(wire, sizeof wire, 2, NBLK, &back, err, sizeof err),
                     TDM_EPROTO);
    assert_string_equal(err, "kv_pool with 2 block ids for 3 blocks");
    assert_int_equal(tdm_kv_send_check_offer(wire, 7, NBLK, NBLK, &back, err, sizeof err),
                     TDM_EPROTO);
    tdm_kv_transport_note(t, "tcp://decode:9001", TDM_KVX_NNG, "cpu");
    char json[512];
    tdm_kv_transport_health(t, json, sizeof json);
    assert_non_null(strstr(json, "\"transport\":\"nng\",\"transfers\":1"));
    tdm_kv_transport_free(t);
}

// Same host: CUDA IPC. Each group's copies land in the decode worker's blocks
// before its in-place frame; the lease goes only then; the last frame closes,
// so free sends no other.
static void test_cuda_ipc(void **state)
{
    (void)state;
    struct tdm_kv_transport *t = transport(&OPS, TDM_KVX_AUTO);
    struct tdm_kv_send_params p = params(true, "node-a");
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
    F.event_delay = 3;
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_cuda_ipc_ops);
    assert_string_equal(tdm_kv_send_why(s), "same host, pool handle open");
    push_all(s, 2 * NBLK * BB);
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++)
            for (int i = 0; i < NBLK; i++)
                assert_memory_equal(DST[l][v][THEIR_IDS[i]], SRC[l][v][OUR_IDS[i]], BB);
    assert_int_equal(H.leases, 1 + PL); // the ids once, then each group
    assert_int_equal(H.unleases, H.leases);
    assert_int_equal(H.nframes, PL);
    assert_string_equal(H.frames[0].transport, "cuda-ipc");
    assert_false(H.frames[0].payload);
    assert_false(H.frames[0].closed);
    assert_true(H.frames[PL - 1].closed);
    tdm_kv_send_free(s);
    assert_int_equal(H.nframes, PL);
    assert_int_equal(F.events_live, 0);
    tdm_kv_transport_free(t);
}

// A handle that does not open: chosen again without CUDA IPC (the decode
// worker on the same host without NCCL: nng), the reason kept; a lease
// refused fails the group as not exportable.
static void test_cuda_ipc_fallback(void **state)
{
    (void)state;
    struct tdm_kv_transport *t = transport(&OPS, TDM_KVX_AUTO);
    struct tdm_kv_send_params p = params(true, "node-a");
    p.pool.nccl = false;
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
    F.fail_open = 1;
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nng_ops);
    assert_non_null(strstr(tdm_kv_send_why(s), "cuda-ipc failed: "));
    assert_non_null(strstr(tdm_kv_send_why(s), "invalid device context"));
    tdm_kv_send_free(s);
    assert_true(H.frames[H.nframes - 1].closed);

    F.fail_open = 0;
    memset(&H, 0, sizeof H);
    assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    H.fail_lease = 1;
    size_t bytes;
    double copy_s;
    char err[256];
    const struct tdm_kv_transport_ops *ops = tdm_kv_send_ops(s);
    assert_int_equal(ops->push_layers(s, 0, 1, &bytes, &copy_s, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "not exportable"));
    tdm_kv_send_free(s);
    tdm_kv_transport_free(t);
}

// Another host, GPUs and NCCL on both: the "post your receives" frame, then
// each group's grouped sends and its in-place frame; the link goes back after
// the last group, so the pair's next transfer takes it and keeps the
// communicator (same id, same instance: no new init).
static void test_nccl(void **state)
{
    (void)state;
    struct tdm_kv_transport *t = transport(&OPS, TDM_KVX_AUTO);
    assert_true(tdm_kv_transport_has_nccl(t));
    struct tdm_kv_send_params p = params(true, "node-b");
    for (int round = 0; round < 2; round++) {
        memset(&H, 0, sizeof H);
        struct tdm_kv_send *s = NULL;
        assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
        assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
        assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nccl_ops);
        assert_string_equal(tdm_kv_send_why(s), "gpus on both, nccl");
        assert_int_equal(H.nframes, 1);
        assert_string_equal(H.frames[0].transport, "nccl");
        assert_int_equal(H.frames[0].num_layers, 0);
        assert_int_equal(H.frames[0].num_blocks, NBLK);
        push_all(s, 2 * NBLK * BB);
        assert_int_equal(H.nframes, 1 + PL);
        assert_true(H.frames[PL].closed);
        assert_int_equal(F.groups_open, 0);
        tdm_kv_send_free(s);
        assert_int_equal(H.nframes, 1 + PL);
    }
    assert_int_equal(F.inits, 1);
    assert_int_equal(F.sent_bytes, 2 * (size_t)PL * 2 * NBLK * BB);
    assert_int_equal(F.aborts, 0);
    tdm_kv_transport_free(t);
    assert_int_equal(F.allocs, 0);
}

// NCCL that cannot be used without touching the communicator (layouts
// differ) falls back to nng with its reason; a group whose sends fail after
// the join aborts the communicator and fails, its event still awaited before
// the lease goes.
static void test_nccl_failures(void **state)
{
    (void)state;
    struct tdm_kv_transport *t = transport(&OPS, TDM_KVX_AUTO);
    struct tdm_kv_send_params p = params(true, "node-b");
    p.pool.elem_bytes = 4;
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nng_ops);
    assert_non_null(strstr(tdm_kv_send_why(s), "nccl failed: KV layouts differ"));
    assert_int_equal(F.inits, 0);
    tdm_kv_send_free(s);

    p = params(true, "node-b");
    memset(&H, 0, sizeof H);
    assert_int_equal(tdm_kv_send_new(&s, t, &HOST, &p), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nccl_ops);
    F.state = TDM_KVX_COMM_ERROR; // an asynchronous error as the group is issued
    size_t bytes;
    double copy_s;
    char err[256];
    const struct tdm_kv_transport_ops *ops = tdm_kv_send_ops(s);
    F.event_delay = 2;
    assert_int_equal(ops->push_layers(s, 0, 1, &bytes, &copy_s, err, sizeof err), TDM_EBACKEND);
    assert_non_null(strstr(err, "NCCL error after the group"));
    assert_int_equal(F.aborts, 1);
    assert_int_equal(H.unleases, H.leases); // the event was still awaited
    tdm_kv_send_free(s);
    tdm_kv_transport_free(t);
}

// ---- the receiver side ---------------------------------------------------------------------
enum { LB = 2 * NBLK * BB, FIRST = 4 }; // one layer in an nng payload; the push range's start

static struct {
    int go;          // what wait_go answers
    int progressed;  // progress calls
    int imports;     // layers imported
    int fail_import; // refuse the import of layer fail_import - 1 (0: none)
} R;

static int r_wait_go(void *ctx)
{
    (void)ctx;
    return R.go;
}

static const char *r_stop(void *ctx)
{
    (void)ctx;
    return NULL;
}

static void r_progress(void *ctx)
{
    (void)ctx;
    R.progressed++;
}

// The decode role's import: one layer in the transfer layout ([k/v][block]
// [BB]) into the reserved blocks of our pool.
static int r_import(void *ctx, int layer, const uint8_t *kv, size_t bytes)
{
    (void)ctx;
    assert_int_equal(bytes, LB);
    if (R.fail_import == layer + 1)
        return TDM_ENOMEM;
    R.imports++;
    for (int v = 0; v < 2; v++)
        for (int i = 0; i < NBLK; i++)
            memcpy(DST[layer][v][THEIR_IDS[i]], kv + ((size_t)v * NBLK + i) * BB, BB);
    return TDM_OK;
}

static const struct tdm_kv_recv_host RHOST = {
    .wait_go = r_wait_go, .stop = r_stop, .progress = r_progress, .import_layer = r_import};

// The attempt's receiver over t, our pool offered or not, its modes offered.
static struct tdm_kv_recv *receiver(struct tdm_kv_transport *t, bool offered)
{
    struct tdm_kv_recv_params p = {.peer = "tcp://prefill:9002",
                                   .peer_instance = 9,
                                   .request_id = "r1",
                                   .offered = offered,
                                   .dst_blocks = offered ? THEIR_IDS : NULL,
                                   .first_block = FIRST,
                                   .num_blocks = NBLK,
                                   .layers_per_group = 1,
                                   .payload_layer_bytes = LB};
    struct tdm_kv_recv *r = NULL;
    assert_int_equal(tdm_kv_recv_new(&r, t, &RHOST, &p), TDM_OK);
    tdm_kv_recv_offer(r);
    return r;
}

// One sender frame as the decode role hands it to the receiver: to the table
// its transport names; an nng frame's payload is its layers exported from
// our blocks in the transfer layout.
static int deliver_one(struct tdm_kv_recv *r, const struct tdm_kv_frame *sf, char *err,
                       size_t errlen)
{
    static uint8_t payload[PL * LB];
    struct tdm_kv_recv_frame f = {.first_layer = sf->first_layer,
                                  .num_layers = sf->num_layers,
                                  .first_block = FIRST,
                                  .num_blocks = sf->num_blocks,
                                  .why = sf->why};
    if (sf->payload) {
        for (int l = 0; l < sf->num_layers; l++)
            for (int v = 0; v < 2; v++)
                for (int i = 0; i < NBLK; i++)
                    memcpy(payload + (size_t)l * LB + ((size_t)v * NBLK + i) * BB,
                           SRC[sf->first_layer + l][v][OUR_IDS[i]], BB);
        f.payload = payload;
        f.payload_len = (size_t)sf->num_layers * LB;
    }
    const struct tdm_kv_transport_ops *mode = tdm_kv_recv_table(sf->transport, err, errlen);
    return mode ? mode->frame(r, &f, err, errlen) : TDM_EPROTO;
}

// Every frame the sender sent from `from` on (a bare closed frame is the role's own).
static void deliver(struct tdm_kv_recv *r, int from)
{
    char err[256] = "";
    for (int i = from; i < H.nframes; i++)
        if (H.frames[i].num_layers > 0 || !H.frames[i].closed)
            if (deliver_one(r, &H.frames[i], err, sizeof err) != TDM_OK)
                fail_msg("frame %d refused: %s", i, err);
}

static void assert_landed(void)
{
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++)
            for (int i = 0; i < NBLK; i++)
                assert_memory_equal(DST[l][v][THEIR_IDS[i]], SRC[l][v][OUR_IDS[i]], BB);
}

// A frame built by hand (the checks' cases).
static int frame(struct tdm_kv_recv *r, const char *transport, int first, int n, int first_block,
                 size_t payload_len, char *err, size_t errlen)
{
    static uint8_t payload[PL * LB + 1];
    struct tdm_kv_recv_frame f = {.first_layer = first,
                                  .num_layers = n,
                                  .first_block = first_block,
                                  .num_blocks = NBLK,
                                  .payload = payload_len ? payload : NULL,
                                  .payload_len = payload_len,
                                  .why = ""};
    const struct tdm_kv_transport_ops *mode = tdm_kv_recv_table(transport, err, errlen);
    return mode ? mode->frame(r, &f, err, errlen) : TDM_EPROTO;
}

// A CPU decode worker: only nng is offered and nothing receives on its own.
// The sender's frames through nng's table land their payload in the reserved
// blocks (the role's import), progress counted: the mode, why, layers,
// bytes, first frame and last layer times. Then the checks: a frame out of
// order, a payload of the wrong size, a failed import, in-place frames for a
// transfer that offered no pool or communicator, a frame for no mode.
static void test_nng_receive(void **state)
{
    (void)state;
    memset(&R, 0, sizeof R);
    struct tdm_kv_transport *dt = transport_of(TDM_KVX_DECODE, NULL, TDM_KVX_AUTO);
    struct tdm_kv_transport *pt = transport(NULL, TDM_KVX_AUTO);
    struct tdm_kv_recv *r = receiver(dt, false);
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_NNG));
    assert_false(tdm_kv_recv_offered(r, TDM_KVX_CUDA_IPC));
    assert_false(tdm_kv_recv_offered(r, TDM_KVX_NCCL));
    assert_false(tdm_kv_recv_receives(r));
    uint8_t id[TDM_KVX_NCCL_ID_BYTES];
    assert_false(tdm_kv_recv_nccl_id(r, id));
    struct tdm_kv_recv_progress p;
    tdm_kv_recv_progress(r, &p);
    assert_ptr_equal(p.mode, &tdm_kv_transport_nng_ops);
    assert_int_equal(p.layers_done, 0);
    assert_true(p.t_first_frame == 0);

    struct tdm_kv_send_params sp = params(false, "node-a");
    sp.payload_layer_bytes = LB;
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, pt, &HOST, &sp), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    push_all(s, LB);
    deliver(r, 0);
    assert_landed();
    assert_int_equal(R.imports, PL);
    tdm_kv_recv_progress(r, &p);
    assert_ptr_equal(p.mode, &tdm_kv_transport_nng_ops);
    assert_string_equal(p.why, tdm_kv_send_why(s));
    assert_int_equal(p.layers_done, PL);
    assert_int_equal(p.bytes_done, (size_t)PL * LB);
    assert_true(p.t_first_frame > 0 && p.t_kv_done >= p.t_first_frame);
    assert_int_equal(R.progressed, 0);
    tdm_kv_send_free(s);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    char err[256];
    r = receiver(dt, false);
    assert_int_equal(frame(r, "nng", 1, 1, FIRST, LB, err, sizeof err), TDM_EPROTO);
    assert_string_equal(err, "bad KvData: layers 1+1 blocks 4+3 payload 96 (expected layer 0, "
                             "blocks 4+3, 96 bytes a layer)");
    assert_int_equal(frame(r, "", 0, 1, FIRST, LB + 1, err, sizeof err), TDM_EPROTO);
    assert_int_equal(frame(r, "nng", 0, 1, FIRST + 1, LB, err, sizeof err), TDM_EPROTO);
    assert_int_equal(frame(r, "nng", 0, PL + 1, FIRST, LB * (PL + 1), err, sizeof err), TDM_EPROTO);
    R.fail_import = 2; // layer 1
    assert_int_equal(frame(r, "nng", 0, 2, FIRST, 2 * LB, err, sizeof err), TDM_ENOMEM);
    assert_string_equal(err, "import of layer 1 failed: out of memory");
    tdm_kv_recv_progress(r, &p);
    assert_int_equal(p.layers_done, 0); // the frame failed: nothing counted
    assert_true(p.t_first_frame == 0);
    R.fail_import = 0;
    assert_int_equal(frame(r, "cuda-ipc", 0, 1, FIRST, 0, err, sizeof err), TDM_EPROTO);
    assert_string_equal(err, "in-place KvData for a transfer offered no pool");
    assert_int_equal(frame(r, "nccl", 0, 0, FIRST, 0, err, sizeof err), TDM_EPROTO);
    assert_string_equal(err, "in-place KvData for a transfer offered no NCCL communicator");
    assert_ptr_equal(tdm_kv_recv_table(NULL, err, sizeof err), &tdm_kv_transport_nng_ops);
    assert_ptr_equal(tdm_kv_recv_table("", err, sizeof err), &tdm_kv_transport_nng_ops);
    assert_ptr_equal(tdm_kv_recv_table("nccl", err, sizeof err), &tdm_kv_transport_nccl_ops);
    // A transport no mode has is refused, whatever the frame holds: a good
    // nng frame's layers and payload under another name are not imported.
    int imported = R.imports;
    assert_null(tdm_kv_recv_table("carrier-pigeon", err, sizeof err));
    assert_string_equal(err, "KvData over transport \"carrier-pigeon\", which this worker does "
                             "not know (it receives by nng, cuda-ipc, nccl): refused");
    assert_int_equal(frame(r, "carrier-pigeon", 0, 1, FIRST, LB, err, sizeof err), TDM_EPROTO);
    assert_int_equal(R.imports, imported);
    assert_null(tdm_kv_recv_table("auto", err, sizeof err)); // a setting, not a transport
    assert_null(
        tdm_kv_recv_table("nng\n2026-12-01 INFO forged log line and more", err, sizeof err));
    assert_string_equal(err, "KvData over transport \"nng?2026-12-01 INFO forged log l...\", "
                             "which this worker does not know (it receives by nng, cuda-ipc, "
                             "nccl): refused");
    tdm_kv_recv_progress(r, &p);
    assert_int_equal(p.layers_done, 0);
    assert_false(tdm_kv_transport_nng_ops.in_place);
    assert_true(tdm_kv_transport_cuda_ipc_ops.in_place && tdm_kv_transport_nccl_ops.in_place);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    // No blocks to receive: complete from the start.
    struct tdm_kv_recv_params np = {.peer = "tcp://prefill:9002", .request_id = "r2"};
    assert_int_equal(tdm_kv_recv_new(&r, dt, &RHOST, &np), TDM_OK);
    tdm_kv_recv_offer(r);
    tdm_kv_recv_progress(r, &p);
    assert_int_equal(p.layers_done, PL);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);
    tdm_kv_transport_free(dt);
    tdm_kv_transport_free(pt);
}

// Same host, our pool offered: CUDA IPC offered (NCCL not, by the setting).
// The sender's copies land in our pool and each in-place frame through CUDA
// IPC's table counts its layers and the bytes copied; the last layer's frame
// completes the transfer. Then: a frame again for layers already in place,
// one with a payload, one for another block range.
static void test_cuda_ipc_receive(void **state)
{
    (void)state;
    memset(&R, 0, sizeof R);
    struct tdm_kv_transport *dt = transport_of(TDM_KVX_DECODE, &OPS, TDM_KVX_CUDA_IPC);
    struct tdm_kv_transport *pt = transport(&OPS, TDM_KVX_AUTO);
    struct tdm_kv_recv *r = receiver(dt, true);
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_NNG));
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_CUDA_IPC));
    assert_false(tdm_kv_recv_offered(r, TDM_KVX_NCCL));
    assert_false(tdm_kv_recv_receives(r));

    struct tdm_kv_send_params sp = params(true, "node-a");
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, pt, &HOST, &sp), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_cuda_ipc_ops);
    push_all(s, 2 * NBLK * BB);
    assert_landed();
    struct tdm_kv_recv_progress p;
    char err[256] = "";
    for (int i = 0; i < H.nframes; i++) {
        assert_int_equal(deliver_one(r, &H.frames[i], err, sizeof err), TDM_OK);
        tdm_kv_recv_progress(r, &p);
        assert_int_equal(p.layers_done, i + 1);
        assert_int_equal(p.bytes_done, (size_t)(i + 1) * 2 * NBLK * BB);
        assert_true(p.t_first_frame > 0);
        assert_true(i + 1 < PL ? p.t_kv_done == 0 : p.t_kv_done >= p.t_first_frame);
    }
    assert_ptr_equal(p.mode, &tdm_kv_transport_cuda_ipc_ops);
    assert_string_equal(p.why, "same host, pool handle open");
    assert_int_equal(R.imports, 0);
    assert_int_equal(deliver_one(r, &H.frames[0], err, sizeof err), TDM_EPROTO);
    assert_string_equal(err, "bad in-place KvData: layers 0+1 blocks 4+3 (expected layer 2)");
    tdm_kv_send_free(s);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    r = receiver(dt, true);
    assert_int_equal(frame(r, "cuda-ipc", 0, 1, FIRST, 8, err, sizeof err), TDM_EPROTO);
    assert_int_equal(frame(r, "cuda-ipc", 0, 1, FIRST + 1, 0, err, sizeof err), TDM_EPROTO);
    assert_int_equal(frame(r, "cuda-ipc", 0, 0, FIRST, 0, err, sizeof err), TDM_EPROTO);
    assert_int_equal(frame(r, "cuda-ipc", 0, 1, FIRST, 0, err, sizeof err), TDM_OK);
    tdm_kv_recv_progress(r, &p);
    assert_int_equal(p.layers_done, 1);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);
    tdm_kv_transport_free(dt);
    tdm_kv_transport_free(pt);
}

// Both ends through their tables: the decode side offers its modes (NCCL's
// communicator id goes with the request), the prefill side chooses NCCL with
// that id and sends every group; the decode side takes the sender's frames
// through NCCL's table ("post your receives", then each group: not in place
// before our receive), and its receives (complete) land them in its reserved
// blocks, reporting progress, and are quiet after. Then: the first frame was
// nng's, or the prefill worker chose another way (nothing received); a pair
// whose last transfer went over CUDA IPC (not offered); an attempt that ended
// before the go (the communicator aborted); the receives withdrawn (no
// thread): not offered, the link back for the next attempt.
static void test_nccl_receive(void **state)
{
    (void)state;
    memset(&R, 0, sizeof R);
    struct tdm_kv_transport *dt = transport_of(TDM_KVX_DECODE, &OPS, TDM_KVX_AUTO);
    struct tdm_kv_transport *pt = transport(&OPS, TDM_KVX_AUTO);
    assert_true(tdm_kv_transport_has_nccl(dt));
    uint8_t wire[TDM_KVX_POOL_WIRE_BYTES];
    struct tdm_kvx_pool geom = {.bytes = sizeof DST,
                                .layer_stride = 2 * PB * BB,
                                .v_offset = PB * BB,
                                .block_bytes = BB,
                                .num_layers = PL,
                                .num_blocks = PB,
                                .elem_bytes = 2};
    assert_int_equal(tdm_kv_transport_offer_pool(dt, geom, wire), TDM_KVX_POOL_WIRE_BYTES);
    struct tdm_kv_recv *r = receiver(dt, true);
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_NCCL));
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_CUDA_IPC));
    assert_true(tdm_kv_recv_receives(r));
    struct tdm_kv_send_params p = params(true, "node-b");
    assert_true(tdm_kv_recv_nccl_id(r, p.nccl_id));
    struct tdm_kv_send *s = NULL;
    assert_int_equal(tdm_kv_send_new(&s, pt, &HOST, &p), TDM_OK);
    assert_int_equal(tdm_kv_send_choose(s), TDM_OK);
    assert_ptr_equal(tdm_kv_send_ops(s), &tdm_kv_transport_nccl_ops);
    push_all(s, 2 * NBLK * BB);
    deliver(r, 0);
    struct tdm_kv_recv_progress pr;
    tdm_kv_recv_progress(r, &pr);
    assert_ptr_equal(pr.mode, &tdm_kv_transport_nccl_ops);
    assert_string_equal(pr.why, "gpus on both, nccl");
    assert_true(pr.t_first_frame > 0);
    assert_int_equal(pr.layers_done, 0); // sent, not yet received here
    assert_true(pr.t_kv_done == 0);
    R.go = TDM_OK;
    char err[256] = "";
    assert_int_equal(tdm_kv_recv_complete(r, err, sizeof err), TDM_OK);
    assert_int_equal(R.progressed, PL);
    tdm_kv_recv_progress(r, &pr);
    assert_int_equal(pr.layers_done, PL);
    assert_int_equal(pr.bytes_done, (size_t)PL * 2 * NBLK * BB);
    assert_true(pr.t_kv_done >= pr.t_first_frame);
    assert_landed();
    assert_true(tdm_kv_recv_quiet(r));
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);
    tdm_kv_send_free(s);

    // The first frame was nng's: the receives see it was not theirs.
    r = receiver(dt, true);
    assert_int_equal(frame(r, "nng", 0, 1, FIRST, LB, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kv_recv_complete(r, err, sizeof err), TDM_ENOTFOUND);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    r = receiver(dt, true);
    R.go = TDM_ENOTFOUND;
    assert_int_equal(tdm_kv_recv_complete(r, err, sizeof err), TDM_ENOTFOUND);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    tdm_kv_transport_note(dt, "tcp://prefill:9002", TDM_KVX_CUDA_IPC, "same host");
    r = receiver(dt, true);
    assert_false(tdm_kv_recv_offered(r, TDM_KVX_NCCL));
    assert_false(tdm_kv_recv_receives(r));
    assert_false(tdm_kv_recv_nccl_id(r, p.nccl_id));
    assert_int_equal(frame(r, "nccl", 0, 0, FIRST, 0, err, sizeof err), TDM_EPROTO);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    tdm_kv_transport_note(dt, "tcp://prefill:9002", TDM_KVX_NCCL, "");
    r = receiver(dt, true);
    int aborts = F.aborts;
    R.go = TDM_ECLOSED;
    assert_int_equal(tdm_kv_recv_complete(r, err, sizeof err), TDM_ECLOSED);
    assert_int_equal(F.aborts, aborts + 1);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);

    r = receiver(dt, true);
    tdm_kv_recv_withdraw(r);
    assert_false(tdm_kv_recv_offered(r, TDM_KVX_NCCL));
    assert_true(tdm_kv_recv_offered(r, TDM_KVX_CUDA_IPC));
    assert_false(tdm_kv_recv_receives(r));
    assert_false(tdm_kv_recv_nccl_id(r, p.nccl_id));
    struct tdm_kv_recv *again = receiver(dt, true); // the link went back
    assert_true(tdm_kv_recv_offered(again, TDM_KVX_NCCL));
    tdm_kv_recv_end(again);
    tdm_kv_recv_free(again);
    tdm_kv_recv_end(r);
    tdm_kv_recv_free(r);
    tdm_kv_transport_free(dt);
    tdm_kv_transport_free(pt);
    assert_ptr_equal(tdm_kv_transport_by_name("cuda-ipc"), &tdm_kv_transport_cuda_ipc_ops);
    assert_ptr_equal(tdm_kv_transport_by_name(""), &tdm_kv_transport_nng_ops);
    assert_null(tdm_kv_transport_by_name("carrier-pigeon"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_nng, reset),
        cmocka_unit_test_setup(test_cuda_ipc, reset),
        cmocka_unit_test_setup(test_cuda_ipc_fallback, reset),
        cmocka_unit_test_setup(test_nccl, reset),
        cmocka_unit_test_setup(test_nccl_failures, reset),
        cmocka_unit_test_setup(test_nng_receive, reset),
        cmocka_unit_test_setup(test_cuda_ipc_receive, reset),
        cmocka_unit_test_setup(test_nccl_receive, reset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
