// SPDX-License-Identifier: Apache-2.0
// kvx: the control plane of GPU-to-GPU KV transfer (issue 10), everything
// about it that does not move bytes:
//   - the --kv-transfer choice per (prefill, decode) pair: a pure function of
//     both workers' settings, devices, hosts and whether the decode worker's
//     pool handle opened;
//   - a cache of opened CUDA IPC pool handles keyed by the decode worker's
//     name, dropped (closed) when its instance id changes;
//   - the NCCL communicator of one pair: the decode side makes the unique id
//     (sent to the prefill side over the nng control plane by the caller),
//     both sides start a non-blocking init, poll it against a deadline and
//     for asynchronous errors; an error, a timeout or a peer instance change
//     aborts the communicator and the next transfer builds a new one. A
//     failure is returned as TDM_ETRANSPORT / TDM_ETIMEDOUT so the caller can
//     retry the next prefill worker with the same blocks, then prefill locally.
// The CUDA and NCCL calls go through struct tdm_kvx_ops: the real table
// (tdm_kvx_cuda_table, in the CUDA backend module; the caller passes it in)
// calls cudart and NCCL; unit tests pass a fake. No CUDA or NCCL type appears
// here: handles and ids are bytes.
//
// Threads: the links table (tdm_kvx_links) locks its own map, so job threads
// take and give back links concurrently; a taken link, a push and an NCCL
// transfer belong to the one thread that uses them (a prefill job thread; a
// decode job thread and its NCCL receive thread in turn); the IPC handle cache
// is shared by a worker's job threads and locked by its owner (the transport
// table's ipc_mu, kv_send.c). None of these calls the engine. The roles do
// not call kvx themselves: they go through the transport table
// (kv_transport.h), one ops table per mode over these calls.
#ifndef TDM_KVX_H
#define TDM_KVX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// ---- the choice --------------------------------------------------------------------------
enum tdm_kvx_mode {
    TDM_KVX_AUTO = 0, // pick per pair: CUDA IPC, else NCCL, else nng
    TDM_KVX_NNG,      // KV frames through host memory over nng (today's path)
    TDM_KVX_CUDA_IPC, // same node: copy into the decode worker's pool through its IPC handle
    TDM_KVX_NCCL,     // GPUs anywhere: NCCL send/recv per layer group
};

// "auto", "nng", "cuda-ipc", "nccl" <-> the mode. parse returns 0, or -1 for
// anything else (the flag's error names the accepted values).
int tdm_kvx_mode_parse(const char *s, enum tdm_kvx_mode *out);
const char *tdm_kvx_mode_name(enum tdm_kvx_mode m);

// What one worker tells its peer about itself (carried in the control plane).
struct tdm_kvx_side {
    enum tdm_kvx_mode setting; // its --kv-transfer
    bool gpu;                  // its backend runs on a CUDA device (--device cuda)
    bool nccl;                 // has NCCL (the CUDA backend module loaded)
    const char *host_id;       // the node's identity (e.g. /proc/sys/kernel/random/boot_id);
                               // NULL or "" = unknown, never the same host as another
};

// Whether the decode worker's pool handle opened in the prefill process.
enum tdm_kvx_ipc_open {
    TDM_KVX_IPC_UNTRIED = 0, // not tried yet: CUDA IPC stays a candidate
    TDM_KVX_IPC_OPENED,
    TDM_KVX_IPC_FAILED,
};

// The transport for one (prefill, decode) pair. Each side allows its setting
// (auto allows all three); the pair gets the first of CUDA IPC, NCCL, nng that
// both allow and that is possible: CUDA IPC needs GPUs on both sides, the same
// non-empty host id and a handle that did not fail to open; NCCL needs GPUs
// and NCCL on both sides; nng is always possible (a CPU side included: the
// payload carries its dtype). Returns 0 with *out set, or -1 with why filled
// ("prefill wants cuda-ipc, decode wants nccl", "cuda-ipc needs both workers
// on one host: prefill on A, decode on B") when nothing both allow is possible.
int tdm_kvx_choose(const struct tdm_kvx_side *prefill, const struct tdm_kvx_side *decode,
                   enum tdm_kvx_ipc_open ipc_open, enum tdm_kvx_mode *out, char *why,
                   size_t whylen);

// ---- the CUDA/NCCL calls -----------------------------------------------------------------
#define TDM_KVX_IPC_HANDLE_BYTES 64 // sizeof(cudaIpcMemHandle_t)
#define TDM_KVX_NCCL_ID_BYTES 128   // NCCL_UNIQUE_ID_BYTES

// State of a communicator, as ncclCommGetAsyncError reports it.
enum tdm_kvx_comm_state {
    TDM_KVX_COMM_PENDING = 0, // non-blocking init (or an operation) in progress
    TDM_KVX_COMM_READY,
    TDM_KVX_COMM_ERROR,
};

// Each returns 0 on success, -1 on failure (and may write a reason into err).
// `ctx` is the table's own state. A communicator is an opaque pointer.
struct tdm_kvx_ops {
    void *ctx;
    int (*ipc_open)(void *ctx, const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr,
                    char *err, size_t errlen);
    int (*ipc_close)(void *ctx, void *dev_ptr);
    int (*nccl_unique_id)(void *ctx, uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen);
    // Starts a non-blocking ncclCommInitRankConfig of 2 ranks.
    int (*nccl_init_start)(void *ctx, const uint8_t id[TDM_KVX_NCCL_ID_BYTES], int rank,
                           void **comm, char *err, size_t errlen);
    // ncclCommGetAsyncError: fills *state; -1 when the call itself failed.
    int (*nccl_state)(void *ctx, void *comm, enum tdm_kvx_comm_state *state, char *err,
                      size_t errlen);
    int (*nccl_abort)(void *ctx, void *comm);   // ncclCommAbort: never blocks on the peer
    int (*nccl_destroy)(void *ctx, void *comm); // ncclCommDestroy of a healthy communicator

    // The data path (optional for a control-plane-only table: NULL members
    // make tdm_kvx_push_new refuse). ipc_export: cudaIpcGetMemHandle of an
    // allocation's base (the decode worker's pool, once).
    int (*ipc_export)(void *ctx, void *dev_ptr, uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES],
                      char *err, size_t errlen);
    // cudaMemcpyAsync device to device on the table's own stream (never the
    // engine's: the copy overlaps the forward that computes later layers).
    int (*copy_async)(void *ctx, void *dst, const void *src, size_t bytes, char *err,
                      size_t errlen);
    // Records an event after the copies issued so far on that stream.
    int (*event_record)(void *ctx, void **event, char *err, size_t errlen);
    // cudaEventQuery: 1 complete, 0 pending, -1 failed (the copy's fate is then
    // unknown until the context is torn down: the caller treats it as pending
    // for the memory-safety rule and fails the transfer).
    int (*event_query)(void *ctx, void *event);
    void (*event_free)(void *ctx, void *event);
    // Grouped ncclSend / ncclRecv of one contiguous device buffer to/from the
    // other rank, enqueued on the table's stream (completion: event_record).
    int (*nccl_send)(void *ctx, void *comm, const void *buf, size_t bytes, int peer, char *err,
                     size_t errlen);
    int (*nccl_recv)(void *ctx, void *comm, void *buf, size_t bytes, int peer, char *err,
                     size_t errlen);
    // ncclGroupStart (begin) / ncclGroupEnd: the sends or receives of one
    // layer group between them go as one grouped operation (groups nest, so
    // nccl_send's own group inside is fine).
    int (*nccl_group)(void *ctx, bool begin, char *err, size_t errlen);
    // cudaMalloc / cudaFree of a device staging buffer (gather/scatter of
    // blocks that are not consecutive).
    int (*dev_alloc)(void *ctx, size_t bytes, void **dev_ptr, char *err, size_t errlen);
    void (*dev_free)(void *ctx, void *dev_ptr);
    // Makes the device that holds dev_ptr (the worker's KV pool) current on
    // the calling thread (cudaSetDevice is per thread: a job or receive
    // thread of a worker on cuda:1 would otherwise run on device 0). Optional.
    int (*use_device_of)(void *ctx, const void *dev_ptr, char *err, size_t errlen);
};

// The real table (cudart + NCCL), inside the CUDA backend module
// (kvx_cuda_ops.c; cuda_module.c registers it). Binaries reach it through the
// module (tdm_backend_module_kvx, common/engine/model/backend_module.h) and hand it
// to the transport; nothing in common/engine/kvx loads a module.
const struct tdm_kvx_ops *tdm_kvx_cuda_table(void);

// ---- the decode worker's KV pool, as the prefill worker needs to address it ---------------
// One device allocation holds every layer's K and V pool; a block of layer l
// is at base + l * layer_stride (+ v_offset for V) + block * block_bytes.
struct tdm_kvx_pool {
    uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES]; // cudaIpcGetMemHandle of base
    uint64_t bytes;                           // size of the allocation
    uint64_t layer_stride;                    // bytes from layer l's K pool to layer l+1's
    uint64_t v_offset;                        // bytes from a layer's K pool to its V pool
    uint64_t block_bytes;                     // one block of one layer's K (or V)
    uint32_t num_layers, num_blocks;
    uint32_t elem_bytes;                      // 2 (bf16) or 4 (f32): both sides must agree
    bool gpu, nccl;                           // the decode worker's side (tdm_kvx_side)
};
#define TDM_KVX_POOL_WIRE_BYTES (TDM_KVX_IPC_HANDLE_BYTES + 4 * 8 + 3 * 4 + 4)
// Fixed little-endian encoding for PrefillRequest.kv_pool. decode returns
// TDM_OK or TDM_EPROTO with err (wrong length, zero sizes, a layer or block
// outside the allocation).
void tdm_kvx_pool_encode(const struct tdm_kvx_pool *p, uint8_t out[TDM_KVX_POOL_WIRE_BYTES]);
int tdm_kvx_pool_decode(struct tdm_kvx_pool *p, const uint8_t *in, size_t len, char *err,
                        size_t errlen);

// ---- the prefill side's device copies of one transfer ---------------------------------------
// Copies layer groups of the prompt's blocks from this worker's pool into the
// decode worker's opened pool, on the table's stream, one event per group.
// Runs of blocks consecutive on both sides go as one copy. The source layout is
// the same as the destination's (one block is block_bytes in both; checked by
// the caller against the pool's elem_bytes and geometry).
struct tdm_kvx_push;

// Where this worker's layer l K / V pool starts (device), for the source side.
typedef void *(*tdm_kvx_layer_fn)(void *arg, int layer, bool v);

// `dst_base` is the opened mapping of `dst`; dst_blocks / src_blocks [n]
// physical block ids (copied). TDM_OK, TDM_EINVAL (a table without the data
// path, an id outside a pool), TDM_ENOMEM.
int tdm_kvx_push_new(struct tdm_kvx_push **out, const struct tdm_kvx_ops *ops,
                     const struct tdm_kvx_pool *dst, void *dst_base, const int *dst_blocks,
                     tdm_kvx_layer_fn src_layer, void *src_arg, const int *src_blocks, int n,
                     char *err, size_t errlen);
// Issues the copies of layers [first, first + count) and records their event.
// Groups must come in layer order, one at a time (the previous one complete).
// TDM_OK or TDM_EBACKEND with err (nothing more may be issued).
int tdm_kvx_push_layers(struct tdm_kvx_push *p, int first, int count, char *err, size_t errlen);
// The issued group's state: TDM_OK complete (or nothing issued, p NULL
// included), TDM_EBUSY pending, TDM_EBACKEND failed.
int tdm_kvx_push_poll(struct tdm_kvx_push *p);
// True when no copy this push issued can still write (every event observed
// complete; true for NULL). A failed event query leaves this false for good:
// only the process's death ends such a copy.
bool tdm_kvx_push_quiet(const struct tdm_kvx_push *p);
// Copies issued (for tests) and bytes copied so far.
int tdm_kvx_push_copies(const struct tdm_kvx_push *p);
uint64_t tdm_kvx_push_bytes(const struct tdm_kvx_push *p);
// Frees (events included). The caller waited for tdm_kvx_push_quiet or
// accepts that a pending copy outlives it. Accepts NULL.
void tdm_kvx_push_free(struct tdm_kvx_push *p);

// The two ends of a (prefill, decode) pair's NCCL communicator.
enum tdm_kvx_role {
    TDM_KVX_DECODE = 0,  // makes the unique id, rank 0 (receives)
    TDM_KVX_PREFILL = 1, // joins with the id it was sent, rank 1 (sends)
};

// ---- the NCCL send or receive of one transfer ------------------------------------------------
// One transfer's layer groups over a ready communicator (kvx_link), on the
// table's stream: the prefill side (TDM_KVX_PREFILL, rank 1) sends, the decode
// side (TDM_KVX_DECODE, rank 0) receives into its reserved blocks. Both sides
// cut a layer's K (then V) blocks the same way, from the decode worker's block
// ids alone (the sender has them from the PrefillRequest): one buffer per run
// of consecutive decode blocks, as grouped ncclSend/ncclRecv, when there are
// at most TDM_KVX_NCCL_MAX_RUNS runs; the receiver writes them straight into
// its blocks and the sender sends straight from its own when its blocks of
// that run are consecutive too, else gathers them into a device staging
// buffer first. More runs than that: the whole group is one buffer, gathered
// on the sender and scattered on the receiver through staging buffers.
// Invariant (the decode worker's memory safety): tdm_kvx_nccl_quiet is true
// only when every group's event was observed complete; after ncclCommAbort
// the caller still polls until quiet (the aborted kernels end, their event
// completes), and a failed event query leaves it false for good.
#define TDM_KVX_NCCL_MAX_RUNS 8
struct tdm_kvx_nccl;

// role: which side this is. geom: the decode worker's pool (block_bytes,
// num_layers, num_blocks). dst_blocks [n]: the decode worker's physical ids;
// src_blocks [n]: ours (sender only, NULL on the receiver). own_layer: where
// this worker's layer l K/V pool starts. max_group_layers: the most layers a
// group will carry (sizes the staging buffer). TDM_OK, TDM_EINVAL (a table
// without send/recv, an id outside a pool), TDM_ENOMEM.
int tdm_kvx_nccl_new(struct tdm_kvx_nccl **out, const struct tdm_kvx_ops *ops,
                     enum tdm_kvx_role role, const struct tdm_kvx_pool *geom, const int *dst_blocks,
                     const int *src_blocks, int n, tdm_kvx_layer_fn own_layer, void *own_arg,
                     int max_group_layers, char *err, size_t errlen);
// Issues layers [first, first + count) as one grouped operation on comm and
// records their event. Groups in layer order, the previous one complete.
// TDM_OK or TDM_EBACKEND with err (nothing more may be issued).
int tdm_kvx_nccl_layers(struct tdm_kvx_nccl *x, void *comm, int first, int count, char *err,
                        size_t errlen);
// TDM_OK complete (or nothing issued; NULL included), TDM_EBUSY, TDM_EBACKEND.
int tdm_kvx_nccl_poll(struct tdm_kvx_nccl *x);
bool tdm_kvx_nccl_quiet(const struct tdm_kvx_nccl *x); // true for NULL
// Buffers per layer group sent or received so far (for tests), device bytes moved.
int tdm_kvx_nccl_buffers(const struct tdm_kvx_nccl *x);
uint64_t tdm_kvx_nccl_bytes(const struct tdm_kvx_nccl *x);
// Whether this transfer goes through staging buffers (more runs than the limit).
bool tdm_kvx_nccl_staged(const struct tdm_kvx_nccl *x);
// Frees; a staging buffer that an unobserved operation may still use is left
// allocated (leaked) rather than freed under it. Accepts NULL.
void tdm_kvx_nccl_free(struct tdm_kvx_nccl *x);

// ---- CUDA IPC handle cache (prefill side) --------------------------------------------------
struct tdm_kvx_ipc_cache;

// A cache of at most `capacity` opened handles (>= 1). Returns TDM_OK or
// TDM_ENOMEM/TDM_EINVAL. The cache keeps `ops` (it must outlive the cache).
int tdm_kvx_ipc_cache_new(struct tdm_kvx_ipc_cache **out, const struct tdm_kvx_ops *ops,
                          int capacity);
// Closes every open handle, then frees. Accepts NULL.
void tdm_kvx_ipc_cache_free(struct tdm_kvx_ipc_cache *c);

// The device address of `peer`'s KV pool. Opens the handle on the first use,
// and again (after closing the old mapping) when `instance` or the handle
// differs from the cached one: a restarted decode worker's pool is a new
// allocation. When full, the least recently used entry is closed first.
// Returns TDM_OK, TDM_EINVAL (empty peer name), or TDM_EBACKEND with err set
// when the open fails (the caller then chooses again with TDM_KVX_IPC_FAILED).
int tdm_kvx_ipc_cache_get(struct tdm_kvx_ipc_cache *c, const char *peer, uint64_t instance,
                          const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr, char *err,
                          size_t errlen);
// Closes and forgets peer's entry (the peer left or failed). No-op when absent.
void tdm_kvx_ipc_cache_drop(struct tdm_kvx_ipc_cache *c, const char *peer);
// Entries held (for tests and /health details).
int tdm_kvx_ipc_cache_size(const struct tdm_kvx_ipc_cache *c);

// ---- NCCL communicator of one (prefill, decode) pair -------------------------------------
struct tdm_kvx_link;

enum tdm_kvx_link_state {
    TDM_KVX_LINK_IDLE = 0, // no communicator: the next transfer builds one
    TDM_KVX_LINK_INIT,     // non-blocking init in progress
    TDM_KVX_LINK_READY,
};

// A link for `role` with an init deadline of `init_timeout_s` seconds (> 0).
int tdm_kvx_link_new(struct tdm_kvx_link **out, const struct tdm_kvx_ops *ops,
                     enum tdm_kvx_role role, double init_timeout_s);
// Aborts a communicator still initialising, destroys a ready one. Accepts NULL.
void tdm_kvx_link_free(struct tdm_kvx_link *l);

// Decode side: aborts any communicator, makes a new unique id (copied into
// id_out for the caller to send) and starts init as rank 0 for peer
// `instance`; `now` is the monotonic time (tdm_now()). TDM_OK or TDM_ETRANSPORT.
int tdm_kvx_link_create(struct tdm_kvx_link *l, uint64_t instance, double now,
                        uint8_t id_out[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen);
// Prefill side: aborts any communicator and starts init as rank 1 with the id
// the decode side sent. TDM_OK or TDM_ETRANSPORT.
int tdm_kvx_link_join(struct tdm_kvx_link *l, uint64_t instance, double now,
                      const uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen);

// Polls the communicator (call before each layer group and while waiting for
// init): TDM_OK ready; TDM_EBUSY still initialising; TDM_ETIMEDOUT init passed
// its deadline, or TDM_ETRANSPORT an asynchronous error: the communicator is
// aborted, the link is idle and err says why; TDM_ECLOSED idle (nothing to poll).
int tdm_kvx_link_poll(struct tdm_kvx_link *l, double now, char *err, size_t errlen);

// Whether the link is ready for the peer's current `instance`. A different
// instance (the peer restarted) aborts the communicator and returns false, so
// the transfer fails over and the next one builds a new communicator.
bool tdm_kvx_link_ready_for(struct tdm_kvx_link *l, uint64_t instance);

// Aborts the communicator (a transfer failed or passed its deadline; the
// caller's cancel path). The link is idle afterwards.
void tdm_kvx_link_abort(struct tdm_kvx_link *l);

enum tdm_kvx_link_state tdm_kvx_link_state(const struct tdm_kvx_link *l);
// Communicators this link has aborted.
uint64_t tdm_kvx_link_aborts(const struct tdm_kvx_link *l);
// The ready communicator (for tdm_kvx_nccl_layers); NULL unless ready.
void *tdm_kvx_link_comm(const struct tdm_kvx_link *l);
// The peer instance the communicator was made for (0 when idle).
uint64_t tdm_kvx_link_instance(const struct tdm_kvx_link *l);

// The id the current communicator was made or joined with: true and id
// copied, or false when idle. The decode side sends it again for a transfer
// that reuses the communicator; the prefill side joins anew when it differs.
bool tdm_kvx_link_id(const struct tdm_kvx_link *l, uint8_t id[TDM_KVX_NCCL_ID_BYTES]);
// Decode side: the init deadline counts from `now` (the prefill worker said it
// joins only now: it joins when its first layer group is ready, not when the
// request was sent).
void tdm_kvx_link_extend(struct tdm_kvx_link *l, double now);

// A worker's links, one per peer (keyed by its nng URL), each used by one
// transfer at a time: NCCL matches a pair's sends and receives in order, so two
// transfers of one pair at once would interleave. Locked inside.
struct tdm_kvx_links;
int tdm_kvx_links_new(struct tdm_kvx_links **out, const struct tdm_kvx_ops *ops,
                      enum tdm_kvx_role role, double init_timeout_s, int capacity);
void tdm_kvx_links_free(struct tdm_kvx_links *t); // accepts NULL; no link may be taken
// Takes peer's link for one transfer (made on first use; when the table is
// full the least recently used link nobody holds is freed). NULL when another
// transfer holds it or every entry is held: that transfer does not use NCCL.
struct tdm_kvx_link *tdm_kvx_links_take(struct tdm_kvx_links *t, const char *peer);
// Hands a taken link back (its communicator stays for the next transfer).
void tdm_kvx_links_give(struct tdm_kvx_links *t, struct tdm_kvx_link *l);
// Communicators aborted by every link so far (freed links included).
uint64_t tdm_kvx_links_aborts(struct tdm_kvx_links *t);

// ---- the pairs a worker transferred with (for /health and metrics) ---------------------
// The transport each (this worker, peer) pair got last, why, and how many
// transfers went each way. Locked inside (the job threads write, /health reads).
struct tdm_kvx_pairs;
int tdm_kvx_pairs_new(struct tdm_kvx_pairs **out, int capacity);
void tdm_kvx_pairs_free(struct tdm_kvx_pairs *ps); // accepts NULL
// Records one transfer with `peer` over m (why: the choice's reason, may be NULL).
void tdm_kvx_pairs_note(struct tdm_kvx_pairs *ps, const char *peer, enum tdm_kvx_mode m,
                        const char *why);
// The pair's last transport; -1 when the peer is unknown.
int tdm_kvx_pairs_get(struct tdm_kvx_pairs *ps, const char *peer, enum tdm_kvx_mode *m);
// JSON members for /health: "kv_transfer":{"setting":"auto","pairs":[{"peer":...,
// "transport":...,"transfers":N,"why":...}]} (truncated to len, always valid JSON
// when len >= 64).
void tdm_kvx_pairs_json(struct tdm_kvx_pairs *ps, enum tdm_kvx_mode setting, char *buf,
                        size_t len);

// This node's identity for the same-host test: $TANDEM_HOST_ID, else
// /proc/sys/kernel/random/boot_id (shared by every container of a node), else "".
void tdm_kvx_host_id(char *buf, size_t len);

#endif
