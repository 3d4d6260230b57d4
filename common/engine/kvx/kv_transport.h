// SPDX-License-Identifier: Apache-2.0
// kv_transport: KV transfer as a table of modes (issue 27). Each transport a
// (prefill, decode) pair can use -- nng (KV frames through host memory), CUDA
// IPC (copies into the decode worker's opened pool) and NCCL (grouped sends
// over the pair's communicator) -- is one struct tdm_kv_transport_ops filled
// once beside the kvx code it drives; a role picks the table for a transfer
// (the sender: tdm_kv_send_choose, tdm_kvx_choose over both sides, falling
// back when a mode cannot be offered; the receiver: tdm_kv_recv_offer, every
// mode it can receive by, then the table each KvData frame names) and then
// only calls the table, never kvx itself.
//
// The sender's steps per layer group are the same for every mode: lease our
// blocks of the group (the engine's kernels writing them are done), issue
// (nng: the frame with its payload; device modes: copies or sends on the
// table's stream), poll until complete (NCCL: the communicator polled for
// errors against the timeout and the job's stop), unlease, then the KvData
// frame saying the layers are in place. Everything the transport needs from
// the role -- the engine's lease, the network's frames, the job's stop --
// comes through struct tdm_kv_send_host, so each mode is tested over fakes.
//
// Memory-safety rule (docs/pd-protocol.md): a lease outlives every copy that
// reads it; a transfer offered the decode worker's pool ends with a closed
// frame only once no copy of it can still write (every event observed). A
// copy whose completion stays unknown keeps its lease and gets no closed
// frame: the decode worker keeps the blocks until this process is gone.
//
// Threads: a struct tdm_kv_transport is shared by a worker's job threads
// (its IPC cache, links and pairs lock themselves); a struct tdm_kv_send
// belongs to one job thread.
#ifndef TDM_KV_TRANSPORT_H
#define TDM_KV_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvx.h"

// ---- the worker-wide side ----------------------------------------------------------------
struct tdm_kv_transport;

struct tdm_kv_transport_config {
    enum tdm_kvx_role role;        // which side of the pairs this worker is
    enum tdm_kvx_mode setting;     // its --kv-transfer
    const struct tdm_kvx_ops *ops; // the device table, passed in (the CUDA module's from
                                   // tdm_backend_module_kvx, a fake in tests); NULL: none,
                                   // KV over nng only (a CPU worker never loads
                                   // libtandem-cuda.so for it)
    bool gpu;                      // ... as one device allocation at pool_base (CUDA IPC and
                                   // NCCL can reach it; with a table only)
    void *pool_base;               // its base (the device the calls run on)
    int elem_bytes;                // 2 (bf16) or 4 (f32)
    size_t block_bytes;            // one block of one layer's K (or V), bytes
    int num_layers;                // layers of our model
    int num_blocks;                // blocks of our pool (the receives' geometry)
    tdm_kvx_layer_fn own_layer;    // where our layer l K / V pool starts
    void *own_arg;
    double nccl_timeout; // communicator init, and each layer group's send; seconds > 0
};

// TDM_OK or TDM_ENOMEM. NCCL is possible when gpu, the table has its NCCL
// calls and the setting allows it. The config's table must outlive the object.
int tdm_kv_transport_new(struct tdm_kv_transport **out, const struct tdm_kv_transport_config *c);
void tdm_kv_transport_free(struct tdm_kv_transport *t); // accepts NULL; no transfer may be open
// Records one transfer with `peer` over m for /health (why may be NULL).
void tdm_kv_transport_note(struct tdm_kv_transport *t, const char *peer, enum tdm_kvx_mode m,
                           const char *why);
// The device table in use (NULL: nng only). For the receiver's own calls.
const struct tdm_kvx_ops *tdm_kv_transport_ops_table(const struct tdm_kv_transport *t);
// The /health members (tdm_kvx_pairs_json with our setting).
void tdm_kv_transport_health(struct tdm_kv_transport *t, char *buf, size_t len);
// Our --kv-transfer as the PrefillRequest carries it ("auto", "nng", ...).
const char *tdm_kv_transport_setting_name(const struct tdm_kv_transport *t);
// This node's identity (tdm_kvx_host_id), read once.
const char *tdm_kv_transport_host_id(const struct tdm_kv_transport *t);
// Whether NCCL is possible for this worker.
bool tdm_kv_transport_has_nccl(const struct tdm_kv_transport *t);

// ---- one transfer, sender side -----------------------------------------------------------
// One KvData frame as a transport asks the role to send it.
struct tdm_kv_frame {
    enum tdm_kvx_mode mode;      // the mode sending it
    const char *transport;       // KvData.transport: the mode's name
    const char *why;             // KvData.transport_why ("" after the first group)
    int first_layer, num_layers; // the layers it reports (0, 0: a control frame)
    int num_blocks;              // blocks of the push range it covers (0 in a control frame)
    bool payload;                // nng: the layers' KV exported into the frame
    bool closed;                 // no copy of this transfer will write any more
    double copy_seconds;         // device modes: issue to observed completion of the group
};

// What a transfer needs from the role; ctx is the role's job.
struct tdm_kv_send_host {
    void *ctx;
    // Leases our blocks of the push range for layers [0, layers) (waits for
    // the kernels writing them) into src_blocks [num_blocks]. TDM_OK or an error.
    int (*lease)(void *ctx, int layers, int *src_blocks);
    void (*unlease)(void *ctx);
    // Sends one KvData frame. TDM_OK or the network's error with err.
    int (*send)(void *ctx, const struct tdm_kv_frame *f, char *err, size_t errlen);
    // True when the job must stop waiting on a peer (cancel, shutdown, deadline).
    bool (*gone)(void *ctx);
};

// The decode worker's side of one transfer, from its PrefillRequest.
struct tdm_kv_send_params {
    const char *peer;         // its nng URL (the pair's key)
    uint64_t peer_instance;   // its instance id
    const char *request_id;   // for logs
    const char *peer_setting; // its --kv-transfer ("" or NULL = nng)
    const char *peer_host;    // its host id
    bool offered;             // it named its device pool (pool, dst_blocks valid)
    struct tdm_kvx_pool pool; // that pool
    const int *dst_blocks;    // [num_blocks] its physical ids (copied)
    int num_blocks;           // blocks of the push range
    bool has_nccl_id;         // it sent the pair's communicator id
    uint8_t nccl_id[TDM_KVX_NCCL_ID_BYTES];
    int layers_per_group;       // the most layers one group carries
    size_t payload_layer_bytes; // nng: bytes of one layer in a frame's payload
};

struct tdm_kv_send;
struct tdm_kv_recv;

// One mode's table. Sender: offer prepares the transfer over this mode (TDM_OK;
// TDM_EBUSY when it cannot be used and nothing was touched, so the caller
// chooses again without it; another error fails the transfer);
// push_layers moves layers [first, first + n) and sends their frame, filling
// *bytes (moved) and *copy_s (0 over nng); poll reports the issued group's
// state for the decode worker's blocks (TDM_OK: nothing this transfer issued
// can still write them; TDM_EBUSY pending; TDM_EBACKEND: a completion stays
// unknown, so the closed frame is never sent; over NCCL always TDM_OK, as the
// decode worker's own receives write its blocks and it waits for them
// itself); close frees the mode's state (the pair's communicator given back).
// Receiver (the decode worker's attempt): prepare readies this mode before
// the PrefillRequest goes out (CUDA IPC: our pool offered; NCCL: the pair's
// link taken, its communicator made or kept, the receives cut; TDM_EBUSY:
// not offered this time, nothing held); frame takes one KvData frame of this
// mode (nng: its payload imported into the reserved blocks through the
// host; CUDA IPC: the layers the sender copied into them counted; NCCL: the
// "post your receives", then the groups whose sends completed), checked
// against the transfer (TDM_EPROTO or the import's error with err: the
// transfer fails); complete runs the mode's own receives on a thread of the
// role's once the sender said it uses this mode (NCCL: init awaited, then
// each layer group's receives into the reserved blocks, progress reported;
// NULL for nng and CUDA IPC, whose frames are the whole transfer); abort
// ends the mode's state after the attempt (NULL: none): the receives'
// buffers are freed only when quiet (tdm_kv_recv_quiet), so a receive whose
// completion stayed unknown never has its memory freed under it.
struct tdm_kv_recv_frame;
struct tdm_kv_transport_ops {
    enum tdm_kvx_mode mode;
    const char *name; // tdm_kvx_mode_name(mode): the metrics label and the frame's transport
    bool in_place;    // its frames say the KV is in our blocks (the sender may write them until
                      // its closed frame); false: each frame carries its KV (nng)
    int (*offer)(struct tdm_kv_send *s, char *err, size_t errlen);
    int (*push_layers)(struct tdm_kv_send *s, int first, int n, size_t *bytes, double *copy_s,
                       char *err, size_t errlen);
    int (*poll)(struct tdm_kv_send *s);
    void (*close)(struct tdm_kv_send *s);
    int (*prepare)(struct tdm_kv_recv *r, char *err, size_t errlen);
    int (*frame)(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                 size_t errlen);
    int (*complete)(struct tdm_kv_recv *r, char *err, size_t errlen); // NULL: no receives
    void (*abort)(struct tdm_kv_recv *r);                             // NULL: nothing held
};

extern const struct tdm_kv_transport_ops tdm_kv_transport_nng_ops;
extern const struct tdm_kv_transport_ops tdm_kv_transport_cuda_ipc_ops;
extern const struct tdm_kv_transport_ops tdm_kv_transport_nccl_ops;

// A decode worker's device pool offer (PrefillRequest.kv_pool with its
// block ids): TDM_OK with *pool, or TDM_EPROTO with err (a descriptor that
// does not decode, block ids that do not match the push range's num_blocks).
int tdm_kv_send_check_offer(const uint8_t *wire, size_t len, size_t n_block_ids, int num_blocks,
                            struct tdm_kvx_pool *pool, char *err, size_t errlen);
// A transfer over nng until chosen. TDM_OK or TDM_ENOMEM. `host`, `t`, and
// p's peer and request_id must outlive it; the rest of p is copied (the
// strings from the request and the block ids included).
int tdm_kv_send_new(struct tdm_kv_send **out, struct tdm_kv_transport *t,
                    const struct tdm_kv_send_host *host, const struct tdm_kv_send_params *p);
// Chooses the transfer's table (tdm_kvx_choose over both sides; a mode whose
// offer fails is left out and the choice made again) and offers it. TDM_OK,
// or an error when nothing both sides allow works; tdm_kv_send_why says why
// either way.
int tdm_kv_send_choose(struct tdm_kv_send *s);
// The chosen table (nng before tdm_kv_send_choose).
const struct tdm_kv_transport_ops *tdm_kv_send_ops(const struct tdm_kv_send *s);
const char *tdm_kv_send_why(const struct tdm_kv_send *s);
// The closed frame went out another way (a refusal's reply).
void tdm_kv_send_mark_closed(struct tdm_kv_send *s);
// The last word of an offered transfer, then free: waits for the issued copies
// and sends the closed frame unless one went out or a copy's completion is
// unknown; then the mode's close. Call before the engine gets the KV back.
// Accepts NULL.
void tdm_kv_send_free(struct tdm_kv_send *s);

// The table of a mode (nng for TDM_KVX_AUTO).
const struct tdm_kv_transport_ops *tdm_kv_transport_of(enum tdm_kvx_mode m);
// The table of a mode by KvData.transport ("" or NULL: nng); NULL for a name
// no mode has.
const struct tdm_kv_transport_ops *tdm_kv_transport_by_name(const char *name);

// ---- one transfer, receiver side ---------------------------------------------------------
// The decode worker's attempt receives through the tables only: before its
// PrefillRequest it offers every mode it can receive by (tdm_kv_recv_offer:
// each table's prepare, nng always), hands each KvData frame of the transfer
// to the table the frame names (tdm_kv_recv_table(KvData.transport)->frame),
// runs the receives of a mode that has its own on a thread
// (tdm_kv_recv_complete) when tdm_kv_recv_receives says one was offered,
// reads how far the transfer got (tdm_kv_recv_progress), and after the
// attempt ends every offered mode (tdm_kv_recv_end).
//
// Threads and locks: frames come on the role's reader thread, in order, under
// the role's lock; the receives run on the role's receive thread; the role
// reads the progress under its lock. The progress is locked inside (taken
// after the role's lock); the host is never called with it held, except
// import_layer from a frame.
struct tdm_kv_recv_host {
    void *ctx;
    // Blocks until the transfer's first frame came (TDM_OK: the receives then
    // see whether it named their mode), the transfer ended without one
    // (TDM_ENOTFOUND), or the attempt is over (TDM_ECLOSED).
    int (*wait_go)(void *ctx);
    // Why the receives must stop now (NULL: go on).
    const char *(*stop)(void *ctx);
    // The receives moved more layers (tdm_kv_recv_progress says how far):
    // wakes whoever waits on the transfer.
    void (*progress)(void *ctx);
    // nng: imports one layer's KV from a frame's payload (`bytes`, the
    // transfer layout) into our reserved blocks of the push range. Called by
    // the frame op (the role's lock held). TDM_OK or the engine's error.
    int (*import_layer)(void *ctx, int layer, const uint8_t *kv, size_t bytes);
};

struct tdm_kv_recv_params {
    const char *peer;       // the prefill worker's nng URL (the pair's key)
    uint64_t peer_instance; // its instance id
    const char *request_id; // for logs
    bool offered;           // our device pool goes with the request (dst_blocks valid)
    const int *dst_blocks;  // [num_blocks] our reserved physical ids (copied); NULL unless offered
    int first_block;        // the push range: its first block in the request's table
    int num_blocks;         // its blocks (0: nothing to receive, the transfer is complete)
    int layers_per_group;   // the most layers one group carries
    size_t payload_layer_bytes; // nng: bytes of one layer in a frame's payload
};

// One KvData frame of the transfer, as the role hands it over: of this
// attempt, from its sender, without error (the role handles those).
struct tdm_kv_recv_frame {
    int first_layer, num_layers; // the layers it reports (0, 0: NCCL's "post your receives")
    int first_block, num_blocks; // the push range it says it covers
    const uint8_t *payload;      // nng: [num_layers][payload_layer_bytes] the layers' KV
    size_t payload_len;          // bytes at payload (0 for the in-place modes)
    const char *why;             // KvData.transport_why (the first group's says why the mode)
};

// How far one transfer got, read by the role (tdm_kv_recv_progress).
struct tdm_kv_recv_progress {
    const struct tdm_kv_transport_ops *mode; // how the KV comes: its first frame's (nng before)
    char why[160];                           // the first layers' KvData.transport_why
    int layers_done;                         // layers in place (NCCL: sent and received); all
                                             // of them for a transfer of no blocks
    size_t bytes_done;                       // KV bytes imported, copied or received so far
    double t_first_frame;                    // tdm_now() of its first frame; 0: none yet
    double t_kv_done;                        // tdm_now() when the last layer was in place; 0
};

// The attempt's receiver (nothing offered yet). TDM_OK or TDM_ENOMEM. host
// and t must outlive it; p is copied.
int tdm_kv_recv_new(struct tdm_kv_recv **out, struct tdm_kv_transport *t,
                    const struct tdm_kv_recv_host *host, const struct tdm_kv_recv_params *p);
// The receiver's side of the choice: every table's prepare, in mode order
// (nng, CUDA IPC, NCCL); a mode whose prepare fails is not offered this time
// (nng always is). Before the PrefillRequest goes out.
void tdm_kv_recv_offer(struct tdm_kv_recv *r);
// Whether mode m was offered.
bool tdm_kv_recv_offered(const struct tdm_kv_recv *r, enum tdm_kvx_mode m);
// Whether an offered mode has receives of its own: then the role runs
// tdm_kv_recv_complete on a thread while the attempt runs.
bool tdm_kv_recv_receives(const struct tdm_kv_recv *r);
// The offered modes' receives (their complete), on the role's receive
// thread. TDM_OK, TDM_ENOTFOUND (the KV came another way: nothing received),
// or the error that fails the transfer, with err.
int tdm_kv_recv_complete(struct tdm_kv_recv *r, char *err, size_t errlen);
// Takes back the modes with receives of their own (the role could not start
// their thread): ended (their abort) and no longer offered.
void tdm_kv_recv_withdraw(struct tdm_kv_recv *r);
// The table a KvData frame goes to, by its transport ("" or NULL: nng's, as
// an earlier prefill worker sends it). NULL for a name no mode has, with err
// (TDM_EPROTO: 'KvData over transport "x", which this worker does not know
// ...'): the frame is refused and the transfer fails, since no table here
// can check it -- taken as nng's it could be imported as if it were one, or
// declare writes closed while its sender still writes our blocks in place.
const struct tdm_kv_transport_ops *tdm_kv_recv_table(const char *transport, char *err,
                                                     size_t errlen);
// A copy of the transfer's progress.
void tdm_kv_recv_progress(struct tdm_kv_recv *r, struct tdm_kv_recv_progress *p);
// NCCL: the communicator id to send with the PrefillRequest (after the
// offer). False when NCCL is not offered.
bool tdm_kv_recv_nccl_id(const struct tdm_kv_recv *r, uint8_t id[TDM_KVX_NCCL_ID_BYTES]);
// True when no receive of this transfer can still write our blocks.
bool tdm_kv_recv_quiet(const struct tdm_kv_recv *r);
// After the attempt (its receive thread joined): every offered mode's abort.
void tdm_kv_recv_end(struct tdm_kv_recv *r);
// Frees (after tdm_kv_recv_end). Accepts NULL.
void tdm_kv_recv_free(struct tdm_kv_recv *r);
// The transfer the pair made last went over CUDA IPC (then NCCL is not offered:
// each offer starts an init of our rank).
bool tdm_kv_transport_last_ipc(struct tdm_kv_transport *t, const char *peer);
// Our KV pool's descriptor for PrefillRequest.kv_pool (decode side): its
// CUDA IPC handle exported once when CUDA IPC is allowed, the geometry for
// NCCL. 0 bytes when neither can be offered (host KV, no table, the setting).
// pool: our pool's geometry (handle, gpu and nccl are filled here).
size_t tdm_kv_transport_offer_pool(struct tdm_kv_transport *t, struct tdm_kvx_pool pool,
                                   uint8_t out[TDM_KVX_POOL_WIRE_BYTES]);

#endif
