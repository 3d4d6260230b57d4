// SPDX-License-Identifier: Apache-2.0
// Tests for kvx with a fake CUDA/NCCL table: the --kv-transfer choice over
// every combination of settings, devices, NCCL, hosts and IPC-open outcomes
// (against the rules stated in kvx.h, plus named cases with their messages);
// the IPC handle cache (one open per peer instance, close on instance or
// handle change, on failure, on eviction and on free); the NCCL link (id made
// by the decode side and joined by the prefill side, init deadline, async
// error, peer instance change, each aborting into an idle link that the next
// transfer rebuilds, destroy vs abort on free).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

// ---- the fake table ------------------------------------------------------------------------
struct fake {
    int opens, closes, fail_open;
    void *closed[16];
    uintptr_t next_ptr;
    int ids, inits, aborts, destroys, fail_id, fail_init;
    int last_rank;
    uint8_t last_id[TDM_KVX_NCCL_ID_BYTES];
    enum tdm_kvx_comm_state state; // what nccl_state reports
    int state_call_fails;
    void *aborted[16];
};

static int f_ipc_open(void *ctx, const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr,
                      char *err, size_t errlen)
{
    struct fake *f = ctx;
    if (f->fail_open) {
        snprintf(err, errlen, "invalid device context");
        return -1;
    }
    f->opens++;
    *dev_ptr = (void *)(f->next_ptr += 0x1000 + handle[0]); // distinct per open
    return 0;
}

static int f_ipc_close(void *ctx, void *dev_ptr)
{
    struct fake *f = ctx;
    f->closed[f->closes++ % 16] = dev_ptr;
    return 0;
}

static int f_unique_id(void *ctx, uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    struct fake *f = ctx;
    if (f->fail_id) {
        snprintf(err, errlen, "no network");
        return -1;
    }
    memset(id, 0xa0 + ++f->ids, TDM_KVX_NCCL_ID_BYTES);
    return 0;
}

static int f_init_start(void *ctx, const uint8_t id[TDM_KVX_NCCL_ID_BYTES], int rank, void **comm,
                        char *err, size_t errlen)
{
    struct fake *f = ctx;
    f->inits++;
    f->last_rank = rank;
    memcpy(f->last_id, id, TDM_KVX_NCCL_ID_BYTES);
    *comm = (void *)(uintptr_t)(0x100 * f->inits);
    if (f->fail_init) {
        snprintf(err, errlen, "unhandled system error");
        return -1;
    }
    return 0;
}

static int f_state(void *ctx, void *comm, enum tdm_kvx_comm_state *state, char *err, size_t errlen)
{
    struct fake *f = ctx;
    (void)comm;
    if (f->state_call_fails)
        return -1;
    *state = f->state;
    if (f->state == TDM_KVX_COMM_ERROR)
        snprintf(err, errlen, "remote process exited");
    return 0;
}

static int f_abort(void *ctx, void *comm)
{
    struct fake *f = ctx;
    f->aborted[f->aborts++ % 16] = comm;
    return 0;
}

static int f_destroy(void *ctx, void *comm)
{
    struct fake *f = ctx;
    (void)comm;
    f->destroys++;
    return 0;
}

// ---- the fake data path: host memory, copies that land late ---------------------------------
// copy_async queues a copy; it executes (memcpy) only when an event recorded
// after it is queried complete, which takes `event_delay` queries: a copy
// that completes late, as on a busy device.
struct fake_copy {
    void *dst;
    const void *src;
    size_t bytes;
};
static struct {
    struct fake_copy q[256];
    int nq, done;      // queued, executed
    int event_delay;   // queries before an event completes
    int queries;       // queries of the current event
    int fail_copy_at;  // copy_async call (1-based) that fails; 0 = none
    int fail_record;   // event_record fails
    int fail_query;    // event_query reports an error
    int calls, events_live;
} D;

static int f_copy_async(void *ctx, void *dst, const void *src, size_t bytes, char *err,
                        size_t errlen)
{
    (void)ctx;
    if (++D.calls == D.fail_copy_at) {
        snprintf(err, errlen, "invalid argument");
        return -1;
    }
    D.q[D.nq++] = (struct fake_copy){dst, src, bytes};
    return 0;
}

static int f_event_record(void *ctx, void **event, char *err, size_t errlen)
{
    (void)ctx;
    if (D.fail_record) {
        snprintf(err, errlen, "launch failure");
        return -1;
    }
    *event = (void *)(uintptr_t)(D.nq + 1); // completes the copies queued so far
    D.queries = 0;
    D.events_live++;
    return 0;
}

static int f_event_query(void *ctx, void *event)
{
    (void)ctx;
    if (D.fail_query)
        return -1;
    if (++D.queries <= D.event_delay)
        return 0;
    int upto = (int)(uintptr_t)event - 1;
    for (; D.done < upto; D.done++)
        memcpy(D.q[D.done].dst, D.q[D.done].src, D.q[D.done].bytes);
    return 1;
}

static void f_event_free(void *ctx, void *event)
{
    (void)ctx;
    (void)event;
    D.events_live--;
}

// The fake NCCL wire: a send queues its buffer, a receive takes the oldest
// one and copies it (both sides run in this one thread, the sender's group
// completed first, so its gathered bytes are in place).
static struct {
    const void *buf[64];
    size_t bytes[64];
    int head, tail;
    int groups_open, allocs, frees;
} W;

static int f_nccl_send(void *ctx, void *comm, const void *buf, size_t bytes, int peer, char *err,
                       size_t errlen)
{
    (void)ctx, (void)comm, (void)err, (void)errlen;
    assert_int_equal(peer, 0);
    W.buf[W.tail % 64] = buf;
    W.bytes[W.tail++ % 64] = bytes;
    return 0;
}

static int f_nccl_recv(void *ctx, void *comm, void *buf, size_t bytes, int peer, char *err,
                       size_t errlen)
{
    (void)ctx, (void)comm;
    assert_int_equal(peer, 1);
    if (W.head == W.tail || W.bytes[W.head % 64] != bytes) {
        snprintf(err, errlen, "fake: no matching send of %zu bytes", bytes);
        return -1;
    }
    memcpy(buf, W.buf[W.head++ % 64], bytes);
    return 0;
}

static int f_nccl_group(void *ctx, bool begin, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    W.groups_open += begin ? 1 : -1;
    return 0;
}

static int f_dev_alloc(void *ctx, size_t bytes, void **dev_ptr, char *err, size_t errlen)
{
    (void)ctx, (void)err, (void)errlen;
    *dev_ptr = calloc(1, bytes);
    W.allocs++;
    return 0;
}

static void f_dev_free(void *ctx, void *dev_ptr)
{
    (void)ctx;
    free(dev_ptr);
    W.frees++;
}

static struct fake F;
static const struct tdm_kvx_ops OPS = {
    .nccl_send = f_nccl_send,
    .nccl_recv = f_nccl_recv,
    .nccl_group = f_nccl_group,
    .dev_alloc = f_dev_alloc,
    .dev_free = f_dev_free,
    .copy_async = f_copy_async,
    .event_record = f_event_record,
    .event_query = f_event_query,
    .event_free = f_event_free,
    .ctx = &F,
    .ipc_open = f_ipc_open,
    .ipc_close = f_ipc_close,
    .nccl_unique_id = f_unique_id,
    .nccl_init_start = f_init_start,
    .nccl_state = f_state,
    .nccl_abort = f_abort,
    .nccl_destroy = f_destroy,
};

static int reset(void **state)
{
    (void)state;
    memset(&F, 0, sizeof F);
    memset(&D, 0, sizeof D);
    memset(&W, 0, sizeof W);
    F.next_ptr = 0x7f0000000000u;
    return 0;
}

// ---- the choice --------------------------------------------------------------------------
static void test_mode_names(void **state)
{
    (void)state;
    static const char *const names[] = {"auto", "nng", "cuda-ipc", "nccl"};
    for (int i = 0; i < 4; i++) {
        enum tdm_kvx_mode m;
        assert_int_equal(tdm_kvx_mode_parse(names[i], &m), 0);
        assert_string_equal(tdm_kvx_mode_name(m), names[i]);
    }
    enum tdm_kvx_mode m;
    assert_int_equal(tdm_kvx_mode_parse("ipc", &m), -1);
    assert_int_equal(tdm_kvx_mode_parse("", &m), -1);
    assert_int_equal(tdm_kvx_mode_parse(NULL, &m), -1);
    assert_string_equal(tdm_kvx_mode_name((enum tdm_kvx_mode)9), "?");
}

// Every combination, against the rules of kvx.h written out as a table.
static void test_choose_every_combination(void **state)
{
    (void)state;
    static const char *const hosts[][2] = {
        {"node-a", "node-a"}, {"node-a", "node-b"}, {NULL, NULL}, {"", ""}, {"node-a", NULL}};
    static const enum tdm_kvx_mode order[] = {TDM_KVX_CUDA_IPC, TDM_KVX_NCCL, TDM_KVX_NNG};
    int combos = 0, chosen[4] = {0}, refused = 0;
    for (int ps = 0; ps < 4; ps++)
        for (int ds = 0; ds < 4; ds++)
            for (int bits = 0; bits < 16; bits++)
                for (size_t h = 0; h < sizeof hosts / sizeof hosts[0]; h++)
                    for (int io = 0; io < 3; io++) {
                        struct tdm_kvx_side p = {.setting = (enum tdm_kvx_mode)ps,
                                                 .gpu = bits & 1,
                                                 .nccl = bits & 2,
                                                 .host_id = hosts[h][0]};
                        struct tdm_kvx_side d = {.setting = (enum tdm_kvx_mode)ds,
                                                 .gpu = bits & 4,
                                                 .nccl = bits & 8,
                                                 .host_id = hosts[h][1]};
                        bool same_host = h == 0;
                        bool possible[4] = {
                            [TDM_KVX_NNG] = true,
                            [TDM_KVX_CUDA_IPC] =
                                p.gpu && d.gpu && same_host && io != TDM_KVX_IPC_FAILED,
                            [TDM_KVX_NCCL] = p.gpu && d.gpu && p.nccl && d.nccl,
                        };
                        enum tdm_kvx_mode want = TDM_KVX_AUTO; // AUTO here: none
                        for (int k = 0; k < 3 && want == TDM_KVX_AUTO; k++) {
                            enum tdm_kvx_mode m = order[k];
                            bool allowed = (p.setting == TDM_KVX_AUTO || p.setting == m) &&
                                           (d.setting == TDM_KVX_AUTO || d.setting == m);
                            if (allowed && possible[m])
                                want = m;
                        }
                        enum tdm_kvx_mode got = TDM_KVX_AUTO;
                        char why[256] = "";
                        int rc = tdm_kvx_choose(&p, &d, (enum tdm_kvx_ipc_open)io, &got, why,
                                                sizeof why);
                        combos++;
                        if (want == TDM_KVX_AUTO) {
                            if (rc != -1 || why[0] == '\0')
                                fail_msg("p=%d d=%d bits=%d h=%zu io=%d: expected a refusal", ps,
                                         ds, bits, h, io);
                            refused++;
                        } else {
                            if (rc != 0 || got != want)
                                fail_msg("p=%d d=%d bits=%d h=%zu io=%d: got %s (rc %d), want %s",
                                         ps, ds, bits, h, io, tdm_kvx_mode_name(got), rc,
                                         tdm_kvx_mode_name(want));
                            chosen[got]++;
                        }
                    }
    assert_int_equal(combos, 4 * 4 * 16 * 5 * 3);
    // Every outcome happens somewhere.
    assert_true(chosen[TDM_KVX_NNG] > 0 && chosen[TDM_KVX_CUDA_IPC] > 0 &&
                chosen[TDM_KVX_NCCL] > 0 && refused > 0);
}

static void test_choose_named_cases(void **state)
{
    (void)state;
    struct tdm_kvx_side gpu_a = {TDM_KVX_AUTO, true, true, "node-a"};
    struct tdm_kvx_side gpu_b = {TDM_KVX_AUTO, true, true, "node-b"};
    struct tdm_kvx_side cpu_a = {TDM_KVX_AUTO, false, false, "node-a"};
    enum tdm_kvx_mode m;
    char why[256];

    // Same node: CUDA IPC; its handle failed to open: NCCL; other node: NCCL.
    assert_int_equal(tdm_kvx_choose(&gpu_a, &gpu_a, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), 0);
    assert_int_equal(m, TDM_KVX_CUDA_IPC);
    assert_int_equal(tdm_kvx_choose(&gpu_a, &gpu_a, TDM_KVX_IPC_FAILED, &m, why, sizeof why), 0);
    assert_int_equal(m, TDM_KVX_NCCL);
    assert_int_equal(tdm_kvx_choose(&gpu_a, &gpu_b, TDM_KVX_IPC_OPENED, &m, why, sizeof why), 0);
    assert_int_equal(m, TDM_KVX_NCCL);
    // A CPU worker on either side: nng (dtype-tagged payload).
    assert_int_equal(tdm_kvx_choose(&cpu_a, &gpu_a, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), 0);
    assert_int_equal(m, TDM_KVX_NNG);
    // nng asked by one side wins over auto.
    struct tdm_kvx_side nng_a = gpu_a;
    nng_a.setting = TDM_KVX_NNG;
    assert_int_equal(tdm_kvx_choose(&gpu_a, &nng_a, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), 0);
    assert_int_equal(m, TDM_KVX_NNG);
    // Explicit cuda-ipc across nodes: refused, naming the hosts.
    struct tdm_kvx_side ipc_a = gpu_a;
    ipc_a.setting = TDM_KVX_CUDA_IPC;
    assert_int_equal(tdm_kvx_choose(&ipc_a, &gpu_b, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), -1);
    assert_string_equal(
        why, "cuda-ipc needs both workers on one host: prefill on node-a, decode on node-b");
    // Explicit settings that disagree.
    struct tdm_kvx_side nccl_b = gpu_b;
    nccl_b.setting = TDM_KVX_NCCL;
    assert_int_equal(tdm_kvx_choose(&ipc_a, &nccl_b, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), -1);
    assert_string_equal(why, "prefill wants cuda-ipc, decode wants nccl");
    // Explicit nccl with a CPU decode worker.
    struct tdm_kvx_side nccl_a = gpu_a;
    nccl_a.setting = TDM_KVX_NCCL;
    assert_int_equal(tdm_kvx_choose(&nccl_a, &cpu_a, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), -1);
    assert_string_equal(why, "nccl needs a GPU on both workers");
    // Unknown hosts are never the same host.
    struct tdm_kvx_side anon = {TDM_KVX_CUDA_IPC, true, true, NULL};
    assert_int_equal(tdm_kvx_choose(&anon, &anon, TDM_KVX_IPC_UNTRIED, &m, why, sizeof why), -1);
    assert_non_null(strstr(why, "(unknown)"));
}

// ---- the IPC handle cache ------------------------------------------------------------------
static void handle_of(uint8_t h[TDM_KVX_IPC_HANDLE_BYTES], uint8_t v)
{
    memset(h, v, TDM_KVX_IPC_HANDLE_BYTES);
}

static void test_ipc_cache(void **state)
{
    (void)state;
    struct tdm_kvx_ipc_cache *c;
    uint8_t h1[TDM_KVX_IPC_HANDLE_BYTES], h2[TDM_KVX_IPC_HANDLE_BYTES];
    handle_of(h1, 1);
    handle_of(h2, 2);
    char err[256];
    void *p1, *p2, *p3;
    assert_int_equal(tdm_kvx_ipc_cache_new(&c, &OPS, 2), TDM_OK);

    // One open per peer instance.
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d0:9001", 7, h1, &p1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d0:9001", 7, h1, &p2, err, sizeof err),
                     TDM_OK);
    assert_ptr_equal(p1, p2);
    assert_int_equal(F.opens, 1);
    assert_int_equal(tdm_kvx_ipc_cache_size(c), 1);

    // The peer restarted (new instance): the old mapping is closed, a new one opened.
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d0:9001", 8, h1, &p2, err, sizeof err),
                     TDM_OK);
    assert_ptr_not_equal(p1, p2);
    assert_int_equal(F.opens, 2);
    assert_int_equal(F.closes, 1);
    assert_ptr_equal(F.closed[0], p1);
    // A new handle under the same instance (the pool reallocated): same.
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d0:9001", 8, h2, &p3, err, sizeof err),
                     TDM_OK);
    assert_int_equal(F.closes, 2);
    assert_ptr_equal(F.closed[1], p2);

    // A failed open: TDM_EBACKEND naming the peer, nothing held for it.
    F.fail_open = 1;
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d1:9001", 1, h1, &p1, err, sizeof err),
                     TDM_EBACKEND);
    assert_non_null(strstr(err, "tcp://d1:9001"));
    assert_non_null(strstr(err, "invalid device context"));
    assert_null(p1);
    assert_int_equal(tdm_kvx_ipc_cache_size(c), 1);
    F.fail_open = 0;

    // Full: the least recently used peer is closed to make room.
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d1:9001", 1, h1, &p1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d1:9001", 1, h1, &p1, err, sizeof err),
                     TDM_OK); // d1 now more recent than d0
    int closes = F.closes;
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "tcp://d2:9001", 1, h1, &p2, err, sizeof err),
                     TDM_OK);
    assert_int_equal(F.closes, closes + 1);
    assert_ptr_equal(F.closed[closes % 16], p3); // d0's mapping
    assert_int_equal(tdm_kvx_ipc_cache_size(c), 2);

    // Drop closes; bad names are refused; free closes the rest.
    tdm_kvx_ipc_cache_drop(c, "tcp://d1:9001");
    tdm_kvx_ipc_cache_drop(c, "tcp://nobody:1");
    assert_int_equal(F.closes, closes + 2);
    assert_int_equal(tdm_kvx_ipc_cache_size(c), 1);
    assert_int_equal(tdm_kvx_ipc_cache_get(c, "", 1, h1, &p1, err, sizeof err), TDM_EINVAL);
    tdm_kvx_ipc_cache_free(c);
    assert_int_equal(F.closes, closes + 3);
    assert_int_equal(F.opens, F.closes); // every mapping closed exactly once
    tdm_kvx_ipc_cache_free(NULL);
    assert_int_equal(tdm_kvx_ipc_cache_new(&c, &OPS, 0), TDM_EINVAL);
}

// ---- the NCCL link -------------------------------------------------------------------------
static void test_link_handshake(void **state)
{
    (void)state;
    struct tdm_kvx_link *dec, *pre;
    uint8_t id[TDM_KVX_NCCL_ID_BYTES];
    char err[256];
    assert_int_equal(tdm_kvx_link_new(&dec, &OPS, TDM_KVX_DECODE, 5.0), TDM_OK);
    assert_int_equal(tdm_kvx_link_new(&pre, &OPS, TDM_KVX_PREFILL, 5.0), TDM_OK);
    assert_int_equal(tdm_kvx_link_poll(dec, 0, err, sizeof err), TDM_ECLOSED);
    assert_false(tdm_kvx_link_ready_for(dec, 1));

    // Decode makes the id and starts as rank 0; prefill joins as rank 1 with it.
    assert_int_equal(tdm_kvx_link_create(dec, 0xbeef, 100.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(F.ids, 1);
    assert_int_equal(F.last_rank, 0);
    assert_int_equal(tdm_kvx_link_state(dec), TDM_KVX_LINK_INIT);
    assert_int_equal(tdm_kvx_link_join(pre, 0xd00d, 100.1, id, err, sizeof err), TDM_OK);
    assert_int_equal(F.last_rank, 1);
    assert_memory_equal(F.last_id, id, TDM_KVX_NCCL_ID_BYTES);
    assert_int_equal(F.ids, 1); // the prefill side makes none
    // The roles cannot be swapped.
    assert_int_equal(tdm_kvx_link_create(pre, 1, 0, id, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_kvx_link_join(dec, 1, 0, id, err, sizeof err), TDM_EINVAL);

    // Pending until ready; ready for its peer instance.
    F.state = TDM_KVX_COMM_PENDING;
    assert_int_equal(tdm_kvx_link_poll(dec, 101.0, err, sizeof err), TDM_EBUSY);
    assert_false(tdm_kvx_link_ready_for(dec, 0xbeef));
    F.state = TDM_KVX_COMM_READY;
    assert_int_equal(tdm_kvx_link_poll(dec, 102.0, err, sizeof err), TDM_OK);
    assert_true(tdm_kvx_link_ready_for(dec, 0xbeef));
    // An operation pending on a ready communicator is not an init timeout.
    F.state = TDM_KVX_COMM_PENDING;
    assert_int_equal(tdm_kvx_link_poll(dec, 500.0, err, sizeof err), TDM_EBUSY);
    assert_int_equal(tdm_kvx_link_state(dec), TDM_KVX_LINK_READY);
    assert_int_equal(F.aborts, 0);

    // Freeing a ready link destroys its communicator; one still initialising is aborted.
    tdm_kvx_link_free(dec);
    assert_int_equal(F.destroys, 1);
    tdm_kvx_link_free(pre);
    assert_int_equal(F.aborts, 1);
    tdm_kvx_link_free(NULL);
    assert_int_equal(tdm_kvx_link_new(&dec, &OPS, TDM_KVX_DECODE, 0), TDM_EINVAL);
}

static void test_link_failures(void **state)
{
    (void)state;
    struct tdm_kvx_link *l;
    uint8_t id[TDM_KVX_NCCL_ID_BYTES];
    char err[256];
    assert_int_equal(tdm_kvx_link_new(&l, &OPS, TDM_KVX_DECODE, 2.0), TDM_OK);

    // Init past its deadline: aborted, idle, ETIMEDOUT.
    F.state = TDM_KVX_COMM_PENDING;
    assert_int_equal(tdm_kvx_link_create(l, 1, 10.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kvx_link_poll(l, 11.9, err, sizeof err), TDM_EBUSY);
    assert_int_equal(tdm_kvx_link_poll(l, 12.0, err, sizeof err), TDM_ETIMEDOUT);
    assert_non_null(strstr(err, "not ready after 2.0 s"));
    assert_int_equal(tdm_kvx_link_state(l), TDM_KVX_LINK_IDLE);
    assert_int_equal(F.aborts, 1);
    assert_int_equal(tdm_kvx_link_aborts(l), 1);
    assert_int_equal(tdm_kvx_link_poll(l, 13.0, err, sizeof err), TDM_ECLOSED);

    // The next transfer rebuilds: a new id, a new communicator, ready.
    assert_int_equal(tdm_kvx_link_create(l, 1, 20.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(F.ids, 2);
    F.state = TDM_KVX_COMM_READY;
    assert_int_equal(tdm_kvx_link_poll(l, 20.5, err, sizeof err), TDM_OK);

    // An asynchronous error (the peer died mid-transfer): aborted, ETRANSPORT with NCCL's reason.
    F.state = TDM_KVX_COMM_ERROR;
    assert_int_equal(tdm_kvx_link_poll(l, 21.0, err, sizeof err), TDM_ETRANSPORT);
    assert_non_null(strstr(err, "remote process exited"));
    assert_int_equal(tdm_kvx_link_state(l), TDM_KVX_LINK_IDLE);
    assert_int_equal(F.aborts, 2);

    // ncclCommGetAsyncError itself failing counts as an error too.
    F.state = TDM_KVX_COMM_READY;
    assert_int_equal(tdm_kvx_link_create(l, 1, 30.0, id, err, sizeof err), TDM_OK);
    F.state_call_fails = 1;
    assert_int_equal(tdm_kvx_link_poll(l, 30.1, err, sizeof err), TDM_ETRANSPORT);
    assert_int_equal(F.aborts, 3);
    F.state_call_fails = 0;

    // The peer restarted (a new instance id): the communicator is aborted at
    // once, not used, and the next create builds one for the new instance.
    assert_int_equal(tdm_kvx_link_create(l, 1, 40.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kvx_link_poll(l, 40.1, err, sizeof err), TDM_OK);
    assert_false(tdm_kvx_link_ready_for(l, 2));
    assert_int_equal(F.aborts, 4);
    assert_int_equal(tdm_kvx_link_state(l), TDM_KVX_LINK_IDLE);
    assert_int_equal(tdm_kvx_link_create(l, 2, 41.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kvx_link_poll(l, 41.1, err, sizeof err), TDM_OK);
    assert_true(tdm_kvx_link_ready_for(l, 2));

    // Creating while a communicator exists aborts the old one first.
    assert_int_equal(tdm_kvx_link_create(l, 2, 50.0, id, err, sizeof err), TDM_OK);
    assert_int_equal(F.aborts, 5);

    // An explicit abort (a transfer passed its deadline, or was cancelled).
    tdm_kvx_link_abort(l);
    assert_int_equal(F.aborts, 6);
    tdm_kvx_link_abort(l); // idle: nothing to abort
    assert_int_equal(F.aborts, 6);

    // Init and id failures: ETRANSPORT, a half-made communicator aborted, idle.
    F.fail_init = 1;
    assert_int_equal(tdm_kvx_link_create(l, 3, 60.0, id, err, sizeof err), TDM_ETRANSPORT);
    assert_non_null(strstr(err, "unhandled system error"));
    assert_int_equal(F.aborts, 7);
    assert_int_equal(tdm_kvx_link_state(l), TDM_KVX_LINK_IDLE);
    F.fail_init = 0;
    F.fail_id = 1;
    assert_int_equal(tdm_kvx_link_create(l, 3, 61.0, id, err, sizeof err), TDM_ETRANSPORT);
    assert_non_null(strstr(err, "ncclGetUniqueId"));
    F.fail_id = 0;
    tdm_kvx_link_free(l);
    assert_int_equal(F.destroys, 0); // never freed while ready in this test
}

// ---- data path ------------------------------------------------------------------------------
static void test_pool_wire(void **state)
{
    (void)state;
    struct tdm_kvx_pool p = {.bytes = 2 * 3 * 8 * 64, .layer_stride = 2 * 8 * 64,
                             .v_offset = 8 * 64, .block_bytes = 64, .num_layers = 3,
                             .num_blocks = 8, .elem_bytes = 2, .gpu = true, .nccl = false};
    for (int i = 0; i < TDM_KVX_IPC_HANDLE_BYTES; i++)
        p.handle[i] = (uint8_t)(i * 7);
    uint8_t w[TDM_KVX_POOL_WIRE_BYTES];
    tdm_kvx_pool_encode(&p, w);
    struct tdm_kvx_pool q;
    char err[256];
    assert_int_equal(tdm_kvx_pool_decode(&q, w, sizeof w, err, sizeof err), TDM_OK);
    assert_memory_equal(q.handle, p.handle, TDM_KVX_IPC_HANDLE_BYTES);
    assert_int_equal(q.bytes, p.bytes);
    assert_int_equal(q.layer_stride, p.layer_stride);
    assert_int_equal(q.v_offset, p.v_offset);
    assert_int_equal(q.block_bytes, 64);
    assert_int_equal(q.num_layers, 3);
    assert_int_equal(q.num_blocks, 8);
    assert_int_equal(q.elem_bytes, 2);
    assert_true(q.gpu);
    assert_false(q.nccl);
    assert_int_equal(tdm_kvx_pool_decode(&q, w, sizeof w - 1, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "expected"));
    // A pool that claims more than its allocation is refused (a peer could
    // otherwise make us write past the mapping).
    p.num_blocks = 9;
    tdm_kvx_pool_encode(&p, w);
    assert_int_equal(tdm_kvx_pool_decode(&q, w, sizeof w, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "inconsistent geometry"));
    p.num_blocks = 8;
    p.elem_bytes = 3;
    tdm_kvx_pool_encode(&p, w);
    assert_int_equal(tdm_kvx_pool_decode(&q, w, sizeof w, err, sizeof err), TDM_EPROTO);
    p.elem_bytes = 2;
    p.bytes = UINT64_MAX;
    p.layer_stride = UINT64_MAX / 2;
    tdm_kvx_pool_encode(&p, w);
    assert_int_equal(tdm_kvx_pool_decode(&q, w, sizeof w, err, sizeof err), TDM_EPROTO);
}

// Source and destination pools in host memory, 2 layers x 8 blocks of 16
// bytes, K then V per layer.
enum { PL = 2, PB = 8, BB = 16 };
static uint8_t SRC[PL][2][PB][BB], DST[PL][2][PB][BB];

static void *src_layer(void *arg, int layer, bool v)
{
    (void)arg;
    return SRC[layer][v];
}

static struct tdm_kvx_pool host_pool(void)
{
    struct tdm_kvx_pool p = {.bytes = sizeof DST, .layer_stride = 2 * PB * BB,
                             .v_offset = PB * BB, .block_bytes = BB, .num_layers = PL,
                             .num_blocks = PB, .elem_bytes = 2, .gpu = true};
    return p;
}

static void fill_src(void)
{
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++)
            for (int b = 0; b < PB; b++)
                memset(SRC[l][v][b], 1 + l * 64 + v * 32 + b, BB);
    memset(DST, 0, sizeof DST);
}

// Layer groups land in the decode worker's blocks (other ids than ours),
// runs consecutive on both sides coalesce, and the push is quiet only once
// the late event was observed complete.
static void test_push_copies(void **state)
{
    (void)state;
    fill_src();
    struct tdm_kvx_pool pool = host_pool();
    int src_ids[5] = {0, 1, 2, 6, 3}, dst_ids[5] = {4, 5, 6, 1, 7};
    struct tdm_kvx_push *p = NULL;
    char err[256];
    assert_int_equal(tdm_kvx_push_new(&p, &OPS, &pool, DST, dst_ids, src_layer, NULL, src_ids, 5,
                                      err, sizeof err),
                     TDM_OK);
    assert_true(tdm_kvx_push_quiet(p));
    D.event_delay = 3;
    assert_int_equal(tdm_kvx_push_layers(p, 0, 1, err, sizeof err), TDM_OK);
    // runs: {0,1,2}->{4,5,6}, {6}->{1}, {3}->{7}: 3 copies each for K and V
    assert_int_equal(tdm_kvx_push_copies(p), 6);
    assert_int_equal(tdm_kvx_push_bytes(p), 2 * 5 * BB);
    assert_false(tdm_kvx_push_quiet(p));
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdm_kvx_push_poll(p), TDM_EBUSY);
    assert_int_equal(DST[0][0][4][0], 0); // not landed yet
    // the next group may not be issued before this one completed
    assert_int_equal(tdm_kvx_push_layers(p, 1, 1, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_kvx_push_poll(p), TDM_OK);
    assert_true(tdm_kvx_push_quiet(p));
    for (int i = 0; i < 5; i++) {
        assert_memory_equal(DST[0][0][dst_ids[i]], SRC[0][0][src_ids[i]], BB);
        assert_memory_equal(DST[0][1][dst_ids[i]], SRC[0][1][src_ids[i]], BB);
        assert_int_equal(DST[1][0][dst_ids[i]][0], 0); // layer 1 not yet
    }
    assert_int_equal(DST[0][0][0][0], 0); // untouched blocks stay untouched
    assert_int_equal(tdm_kvx_push_layers(p, 1, 1, err, sizeof err), TDM_OK);
    while (tdm_kvx_push_poll(p) == TDM_EBUSY)
        ;
    for (int i = 0; i < 5; i++)
        assert_memory_equal(DST[1][1][dst_ids[i]], SRC[1][1][src_ids[i]], BB);
    assert_int_equal(tdm_kvx_push_layers(p, 2, 1, err, sizeof err), TDM_EINVAL); // past the last
    tdm_kvx_push_free(p);
    assert_int_equal(D.events_live, 0);

    // A block id outside the decode worker's pool is refused before any copy.
    int bad[1] = {PB};
    assert_int_equal(tdm_kvx_push_new(&p, &OPS, &pool, DST, bad, src_layer, NULL, src_ids, 1, err,
                                      sizeof err),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "outside the decode worker's pool"));
    // A table without the data path (control plane only) cannot push.
    struct tdm_kvx_ops ctl = OPS;
    ctl.copy_async = NULL;
    assert_int_equal(tdm_kvx_push_new(&p, &ctl, &pool, DST, dst_ids, src_layer, NULL, src_ids, 5,
                                      err, sizeof err),
                     TDM_EINVAL);
}

// Failures: copies issued before a failed one are awaited (an event after
// them) before the push is quiet; a push whose event could not be recorded or
// queried never turns quiet (its copies' fate is unknown).
static void test_push_failures(void **state)
{
    (void)state;
    fill_src();
    struct tdm_kvx_pool pool = host_pool();
    int ids[2] = {0, 2};
    struct tdm_kvx_push *p = NULL;
    char err[256];
    D.fail_copy_at = 3; // K's two runs go, V's first fails
    D.event_delay = 2;
    assert_int_equal(tdm_kvx_push_new(&p, &OPS, &pool, DST, ids, src_layer, NULL, ids, 2, err,
                                      sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_push_layers(p, 0, 1, err, sizeof err), TDM_EBACKEND);
    assert_non_null(strstr(err, "invalid argument"));
    assert_false(tdm_kvx_push_quiet(p));
    assert_int_equal(tdm_kvx_push_poll(p), TDM_EBUSY);
    assert_int_equal(tdm_kvx_push_poll(p), TDM_EBUSY);
    assert_int_equal(tdm_kvx_push_poll(p), TDM_EBACKEND); // complete, but the push failed
    assert_true(tdm_kvx_push_quiet(p));
    assert_memory_equal(DST[0][0][2], SRC[0][0][2], BB); // the issued copy did land
    assert_int_equal(tdm_kvx_push_layers(p, 0, 1, err, sizeof err), TDM_EBACKEND);
    tdm_kvx_push_free(p);

    memset(&D, 0, sizeof D);
    D.fail_record = 1;
    assert_int_equal(tdm_kvx_push_new(&p, &OPS, &pool, DST, ids, src_layer, NULL, ids, 2, err,
                                      sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_push_layers(p, 0, 1, err, sizeof err), TDM_EBACKEND);
    assert_int_equal(tdm_kvx_push_poll(p), TDM_EBACKEND);
    assert_false(tdm_kvx_push_quiet(p));
    tdm_kvx_push_free(p);

    memset(&D, 0, sizeof D);
    D.fail_query = 1;
    assert_int_equal(tdm_kvx_push_new(&p, &OPS, &pool, DST, ids, src_layer, NULL, ids, 2, err,
                                      sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_push_layers(p, 0, 1, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kvx_push_poll(p), TDM_EBACKEND);
    assert_false(tdm_kvx_push_quiet(p));
    tdm_kvx_push_free(p);
}

static void test_pairs_and_host_id(void **state)
{
    (void)state;
    struct tdm_kvx_pairs *ps = NULL;
    assert_int_equal(tdm_kvx_pairs_new(&ps, 2), TDM_OK);
    char buf[1024];
    tdm_kvx_pairs_json(ps, TDM_KVX_AUTO, buf, sizeof buf);
    assert_string_equal(buf, "\"kv_transfer\":{\"setting\":\"auto\",\"pairs\":[]}");
    tdm_kvx_pairs_note(ps, "tcp://a:1", TDM_KVX_NNG, "this worker's KV is in host memory");
    tdm_kvx_pairs_note(ps, "tcp://b:2", TDM_KVX_CUDA_IPC, "same \"host\"");
    tdm_kvx_pairs_note(ps, "tcp://b:2", TDM_KVX_CUDA_IPC, "same host");
    enum tdm_kvx_mode m;
    assert_int_equal(tdm_kvx_pairs_get(ps, "tcp://b:2", &m), 0);
    assert_int_equal(m, TDM_KVX_CUDA_IPC);
    assert_int_equal(tdm_kvx_pairs_get(ps, "tcp://c:3", &m), -1);
    tdm_kvx_pairs_json(ps, TDM_KVX_AUTO, buf, sizeof buf);
    assert_non_null(strstr(buf, "{\"peer\":\"tcp://a:1\",\"transport\":\"nng\",\"transfers\":1,"));
    assert_non_null(strstr(buf, "\"peer\":\"tcp://b:2\",\"transport\":\"cuda-ipc\",\"transfers\":2,"
                                "\"why\":\"same host\"}"));
    // a third peer evicts the least recently used (a)
    tdm_kvx_pairs_note(ps, "tcp://c:3", TDM_KVX_NNG, "x \"quoted\"");
    assert_int_equal(tdm_kvx_pairs_get(ps, "tcp://a:1", &m), -1);
    tdm_kvx_pairs_json(ps, TDM_KVX_NNG, buf, sizeof buf);
    assert_non_null(strstr(buf, "x \\\"quoted\\\""));
    // truncated output stays valid: whole pairs or none
    char small[100];
    tdm_kvx_pairs_json(ps, TDM_KVX_NNG, small, sizeof small);
    assert_string_equal(small, "\"kv_transfer\":{\"setting\":\"nng\",\"pairs\":[]}");
    tdm_kvx_pairs_free(ps);

    char host[96];
    setenv("TANDEM_HOST_ID", "node-7", 1);
    tdm_kvx_host_id(host, sizeof host);
    assert_string_equal(host, "node-7");
    unsetenv("TANDEM_HOST_ID");
    tdm_kvx_host_id(host, sizeof host); // the boot id where /proc has one
    assert_null(strchr(host, '\n'));
}

// ---- NCCL transfer (kvx_nccl) ------------------------------------------------------------
enum { NB = 20 };
static uint8_t NSRC[PL][2][NB][BB], NDST[PL][2][NB][BB];

static void *nsrc_layer(void *arg, int layer, bool v)
{
    (void)arg;
    return NSRC[layer][v];
}

static void *ndst_layer(void *arg, int layer, bool v)
{
    (void)arg;
    return NDST[layer][v];
}

// One transfer, sender then receiver per layer group, checked block by block.
static void nccl_roundtrip(const int *src_ids, const int *dst_ids, int n, bool staged,
                           int buffers_per_layer)
{
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++)
            for (int b = 0; b < NB; b++)
                memset(NSRC[l][v][b], 1 + l * 64 + v * 32 + b, BB);
    memset(NDST, 0, sizeof NDST);
    struct tdm_kvx_pool geom = {.block_bytes = BB, .num_layers = PL, .num_blocks = NB};
    struct tdm_kvx_nccl *tx = NULL, *rx = NULL;
    char err[256];
    assert_int_equal(tdm_kvx_nccl_new(&tx, &OPS, TDM_KVX_PREFILL, &geom, dst_ids, src_ids, n,
                                      nsrc_layer, NULL, 1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_nccl_new(&rx, &OPS, TDM_KVX_DECODE, &geom, dst_ids, NULL, n,
                                      ndst_layer, NULL, 1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_nccl_staged(tx), staged);
    assert_int_equal(tdm_kvx_nccl_staged(rx), staged);
    void *comm = (void *)0x100;
    F.state = TDM_KVX_COMM_READY;
    for (int l = 0; l < PL; l++) {
        D.event_delay = 2;
        assert_int_equal(tdm_kvx_nccl_layers(tx, comm, l, 1, err, sizeof err), TDM_OK);
        assert_int_equal(W.groups_open, 0);
        assert_false(tdm_kvx_nccl_quiet(tx));
        assert_int_equal(tdm_kvx_nccl_poll(tx), TDM_EBUSY);
        while (tdm_kvx_nccl_poll(tx) == TDM_EBUSY)
            ;
        assert_int_equal(tdm_kvx_nccl_layers(rx, comm, l, 1, err, sizeof err), TDM_OK);
        assert_false(tdm_kvx_nccl_quiet(rx)); // a receive is not in place before its event
        while (tdm_kvx_nccl_poll(rx) == TDM_EBUSY)
            ;
        assert_true(tdm_kvx_nccl_quiet(rx));
        assert_int_equal(W.head, W.tail); // every send received
    }
    assert_int_equal(tdm_kvx_nccl_buffers(tx), PL * buffers_per_layer);
    assert_int_equal(tdm_kvx_nccl_buffers(rx), PL * buffers_per_layer);
    assert_int_equal(tdm_kvx_nccl_bytes(rx), (uint64_t)PL * 2 * (uint64_t)n * BB);
    for (int l = 0; l < PL; l++)
        for (int v = 0; v < 2; v++) {
            for (int i = 0; i < n; i++)
                assert_memory_equal(NDST[l][v][dst_ids[i]], NSRC[l][v][src_ids[i]], BB);
            for (int b = 0; b < NB; b++) { // blocks not in the transfer stay untouched
                bool in = false;
                for (int i = 0; i < n; i++)
                    in = in || dst_ids[i] == b;
                if (!in)
                    assert_int_equal(NDST[l][v][b][0], 0);
            }
        }
    assert_int_equal(tdm_kvx_nccl_layers(tx, comm, PL, 1, err, sizeof err), TDM_EINVAL);
    tdm_kvx_nccl_free(tx);
    tdm_kvx_nccl_free(rx);
    assert_int_equal(W.allocs, W.frees);
    assert_int_equal(D.events_live, 0);
}

// Direct: one buffer per run of consecutive decode blocks (received in place;
// sent in place where the prefill's blocks of the run are consecutive too,
// else gathered); staged: more runs than TDM_KVX_NCCL_MAX_RUNS, one buffer a
// group through staging on both sides. A failed receive aborts nothing by
// itself but is never quiet before its event; a failed event query never is.
static void test_nccl_transfer(void **state)
{
    (void)state;
    int src_a[5] = {0, 1, 2, 7, 5}, dst_a[5] = {3, 4, 5, 10, 11};
    nccl_roundtrip(src_a, dst_a, 5, false, 2 * 2); // K and V: 2 runs each
    assert_int_equal(W.allocs, 1);                 // the gather of {7,5}
    reset(NULL);
    int src_b[9], dst_b[9];
    for (int i = 0; i < 9; i++)
        src_b[i] = 19 - i, dst_b[i] = 2 * i; // 9 runs of one block
    nccl_roundtrip(src_b, dst_b, 9, true, 1);
    assert_int_equal(W.allocs, 2); // a staging buffer on each side
    reset(NULL);
    int src_c[3] = {0, 1, 2}, dst_c[3] = {4, 5, 6};
    nccl_roundtrip(src_c, dst_c, 3, false, 2); // contiguous both sides: no staging at all
    assert_int_equal(W.allocs, 0);

    // Failures: a receive with no matching send; an event query error.
    reset(NULL);
    struct tdm_kvx_pool geom = {.block_bytes = BB, .num_layers = PL, .num_blocks = NB};
    struct tdm_kvx_nccl *rx = NULL;
    char err[256];
    F.state = TDM_KVX_COMM_READY;
    assert_int_equal(tdm_kvx_nccl_new(&rx, &OPS, TDM_KVX_DECODE, &geom, dst_c, NULL, 3, ndst_layer,
                                      NULL, 1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_nccl_layers(rx, (void *)0x100, 0, 1, err, sizeof err), TDM_EBACKEND);
    assert_non_null(strstr(err, "no matching send"));
    assert_int_equal(W.groups_open, 0); // the group is closed on the failure path too
    D.fail_query = 1;
    assert_int_equal(tdm_kvx_nccl_poll(rx), TDM_EBACKEND);
    assert_false(tdm_kvx_nccl_quiet(rx)); // fate unknown for good
    tdm_kvx_nccl_free(rx);
    // A communicator error reported after the group fails it.
    reset(NULL);
    F.state = TDM_KVX_COMM_ERROR;
    struct tdm_kvx_nccl *tx = NULL;
    assert_int_equal(tdm_kvx_nccl_new(&tx, &OPS, TDM_KVX_PREFILL, &geom, dst_c, src_c, 3,
                                      nsrc_layer, NULL, 1, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_kvx_nccl_layers(tx, (void *)0x100, 0, 1, err, sizeof err), TDM_EBACKEND);
    assert_non_null(strstr(err, "remote process exited"));
    while (tdm_kvx_nccl_poll(tx) == TDM_EBUSY)
        ;
    assert_true(tdm_kvx_nccl_quiet(tx)); // its event still observed
    tdm_kvx_nccl_free(tx);
    // A table without send/recv cannot make one; ids outside the pool are refused.
    struct tdm_kvx_ops ctl = OPS;
    ctl.nccl_recv = NULL;
    assert_int_equal(tdm_kvx_nccl_new(&tx, &ctl, TDM_KVX_PREFILL, &geom, dst_c, src_c, 3,
                                      nsrc_layer, NULL, 1, err, sizeof err),
                     TDM_EINVAL);
    int bad[1] = {NB};
    assert_int_equal(tdm_kvx_nccl_new(&tx, &OPS, TDM_KVX_PREFILL, &geom, bad, src_c, 1, nsrc_layer,
                                      NULL, 1, err, sizeof err),
                     TDM_EINVAL);
}

// One link per peer, one transfer at a time; the least recently used free
// link is freed for a new peer when the table is full.
static void test_links(void **state)
{
    (void)state;
    struct tdm_kvx_links *t = NULL;
    assert_int_equal(tdm_kvx_links_new(&t, &OPS, TDM_KVX_DECODE, 5, 2), TDM_OK);
    struct tdm_kvx_link *a = tdm_kvx_links_take(t, "tcp://a:1");
    assert_non_null(a);
    assert_null(tdm_kvx_links_take(t, "tcp://a:1")); // busy with a transfer
    uint8_t id[TDM_KVX_NCCL_ID_BYTES], again[TDM_KVX_NCCL_ID_BYTES];
    char err[256];
    assert_false(tdm_kvx_link_id(a, id));
    assert_int_equal(tdm_kvx_link_create(a, 7, 0, id, err, sizeof err), TDM_OK);
    assert_true(tdm_kvx_link_id(a, again));
    assert_memory_equal(id, again, sizeof id);
    assert_int_equal(tdm_kvx_link_instance(a), 7);
    tdm_kvx_links_give(t, a);
    assert_ptr_equal(tdm_kvx_links_take(t, "tcp://a:1"), a); // the same communicator
    struct tdm_kvx_link *b = tdm_kvx_links_take(t, "tcp://b:1");
    assert_non_null(b);
    assert_null(tdm_kvx_links_take(t, "tcp://c:1")); // full, every link held
    tdm_kvx_links_give(t, a);
    struct tdm_kvx_link *c = tdm_kvx_links_take(t, "tcp://c:1"); // a's entry freed for c
    assert_non_null(c);
    assert_int_equal(F.aborts, 1); // a's initialising communicator aborted when freed
    assert_int_equal(tdm_kvx_links_aborts(t), 1);
    // Init deadline from the go: extend moves it.
    assert_int_equal(tdm_kvx_link_create(c, 9, 0, id, err, sizeof err), TDM_OK);
    F.state = TDM_KVX_COMM_PENDING;
    tdm_kvx_link_extend(c, 100);
    assert_int_equal(tdm_kvx_link_poll(c, 104, err, sizeof err), TDM_EBUSY);
    assert_int_equal(tdm_kvx_link_poll(c, 105.5, err, sizeof err), TDM_ETIMEDOUT);
    tdm_kvx_links_give(t, b);
    tdm_kvx_links_give(t, c);
    tdm_kvx_links_free(t);
    assert_int_equal(tdm_kvx_links_new(&t, &OPS, TDM_KVX_DECODE, 5, 0), TDM_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_mode_names, reset),
        cmocka_unit_test_setup(test_choose_every_combination, reset),
        cmocka_unit_test_setup(test_choose_named_cases, reset),
        cmocka_unit_test_setup(test_ipc_cache, reset),
        cmocka_unit_test_setup(test_link_handshake, reset),
        cmocka_unit_test_setup(test_link_failures, reset),
        cmocka_unit_test_setup(test_pool_wire, reset),
        cmocka_unit_test_setup(test_push_copies, reset),
        cmocka_unit_test_setup(test_push_failures, reset),
        cmocka_unit_test_setup(test_pairs_and_host_id, reset),
        cmocka_unit_test_setup(test_nccl_transfer, reset),
        cmocka_unit_test_setup(test_links, reset),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
