// SPDX-License-Identifier: Apache-2.0
// kv: the paged KV cache. A pool of fixed-size blocks (block_size tokens each,
// 16 by default) holds keys and values for every layer; each sequence owns a
// block table mapping its positions to blocks. Blocks carry reference counts so
// that full blocks can be shared by prefix: a full block is keyed by a chained
// hash of (parent block hash, its token ids); once no sequence references it it
// stays cached (evictable, LRU) until its memory is needed. The usage fraction
// counts blocks referenced by sequences, so it returns to 0 when all finish.
// Export/import copy a sequence's KV as contiguous bytes per layer for transfer.
//
// Not thread-safe: one engine thread owns the cache and every seq on it.
// docs/kv-cache.md describes the block states, hashing, eviction and the
// transfer format.
//
// Storage, per layer, K and V apart:
//   k[layer] : [num_blocks][num_kv_heads][block_size][head_dim]
//   v[layer] : [num_blocks][num_kv_heads][block_size][head_dim]
// so one head's keys inside a block are contiguous rows of head_dim. Where the
// pool lives is the storage's business (struct tdm_kv_storage below): by
// default host memory, f32, page-aligned mmap, zero until written (the CPU
// backend's); a backend with its own memory (CUDA: device memory, bf16)
// provides a storage, and the cache keeps the bookkeeping either way.
#ifndef TDM_KV_CACHE_H
#define TDM_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// Element type of a pool and of its transfer payload (the kv header's dtype
// field on the wire: keep the numbers).
enum tdm_kv_dtype { TDM_KV_F32 = 0, TDM_KV_BF16 = 1 };
// Bytes of one element (4, 2); 0 for a value that is no enum tdm_kv_dtype.
size_t tdm_kv_dtype_size(int dtype);
// "f32", "bf16"; "unknown" otherwise.
const char *tdm_kv_dtype_name(int dtype);
// vLLM's --kv-cache-dtype: "auto" (bf16: half the memory and transfer bytes of
// f32), "bf16"/"bfloat16", "f32"/"float32" (exact-reference runs). TDM_EINVAL
// with err listing the choices otherwise (fp8 is not implemented).
int tdm_kv_dtype_parse(const char *s, enum tdm_kv_dtype *out, char *err, size_t errlen);
// Converts n elements from src_dtype to dst_dtype (known dtypes; no overlap):
// bf16 -> f32 is exact, f32 -> bf16 rounds to nearest even (tdm_f32_to_bf16,
// as the CUDA backend's KV), equal dtypes copy. dst and src need no alignment
// (frame payloads sit at any byte offset).
void tdm_kv_convert(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n);

struct tdm_kv_config {
    int num_layers;
    int num_kv_heads;
    int head_dim;
    int block_size;            // tokens per block (16)
    int num_blocks;            // pool size
    bool enable_prefix_caching;
    enum tdm_kv_dtype dtype;   // element type (a zeroed config is f32); a cache on a
                               // backend's storage takes the storage's
};

// The chained block hash: the key of a full block given its parent block's hash
// (0 for the first block) and its n token ids; never 0 (0 marks "not full yet"
// in tdm_kv_seq.block_hashes). This is the stable hash the router's prefix index
// (router/endpoints.c) and the KV events rely on to agree with every worker's
// cache: changing it changes what the router and the workers call a block, so
// kv_cache_test pins known values. Non-cryptographic on purpose: a collision
// is harmless because cache hits are verified against the stored tokens.
uint64_t tdm_kv_block_hash(uint64_t parent, const int32_t *tokens, int n);

// The chain's root for a request's cache_salt (vLLM's): the first block's
// parent hash in place of 0, so salted blocks hash apart from unsalted ones
// and from other salts' (the router hashes with the same root). Never 0;
// len 0 (no salt) gives 0.
uint64_t tdm_kv_salt_hash(const char *salt, size_t len);

// Bytes one block takes across all layers (K and V), in cfg's dtype (0 for a
// bad geometry or dtype).
size_t tdm_kv_block_bytes(const struct tdm_kv_config *cfg);

struct tdm_kv_cache;

// ---- storage --------------------------------------------------------------------------
// The pool's memory, provided by a compute backend (tdm_model_kv_new picks the
// model's). A storage object embeds struct tdm_kv_storage as its first member;
// the cache calls ops only with layer in [0, num_layers) and block ids in
// [0, num_blocks) it has checked.
struct tdm_kv_storage;
// A device pool's one allocation: layer l's K pool at base + l * layer_stride,
// its V pool v_offset bytes further; each [num_blocks][heads][block_size][head_dim].
struct tdm_kv_device_pool {
    void *base;          // device address of the allocation
    size_t bytes;        // its size
    size_t layer_stride; // bytes from layer l's K pool to layer l+1's
    size_t v_offset;     // bytes from a layer's K pool to its V pool
    size_t block_bytes;  // one block of one layer's K (or V)
    int elem_bytes;      // 2 (bf16) or 4 (f32)
};
struct tdm_kv_storage_ops {
    // Frees the pool and the storage object.
    void (*free)(struct tdm_kv_storage *st);
    // Base of layer's K or V pool in the storage's memory (layout above, of the
    // storage's element type): what a backend's kernels address.
    void *(*layer_k)(struct tdm_kv_storage *st, int layer);
    void *(*layer_v)(struct tdm_kv_storage *st, int layer);
    // Copies blocks[0..nblocks) of `layer` into host k_out/v_out, each
    // [nblocks][num_kv_heads][block_size][head_dim] f32 (the transfer layout),
    // or writes such host data into those blocks. TDM_OK or TDM_EBACKEND.
    // Used for a storage that is not host memory (the cache converts to and
    // from the payload's dtype); NULL in a host storage. Both may run on any
    // thread while the owner computes: they are ordered after every write
    // issued before the layer's last mark_layer, and after every write of an
    // op that returned with its work done (a forward, an import) — not after
    // writes the owner issued since, which they do not wait for.
    int (*export_blocks)(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                         float *k_out, float *v_out);
    int (*import_blocks)(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                         const float *k_in, const float *v_in);
    // Optional (NULL: not addressable from another process, e.g. the host
    // pool): the whole pool as one device allocation, for a GPU-to-GPU KV
    // transfer (CUDA IPC export of base; issue 10). TDM_OK or TDM_EINVAL.
    int (*device_pool)(struct tdm_kv_storage *st, struct tdm_kv_device_pool *out);
    // Optional (NULL: writes are done when the op that makes them returns, as
    // in host memory). mark_layer: the owner's thread (the forward's) has issued
    // the writes of layer's KV that another thread is about to read; an
    // export_blocks of the layer, or wait_layer, from then on is ordered after
    // them, without waiting for what the owner issues later (the layers above).
    // wait_layer: returns once the writes before layer's last mark are done (a
    // peer's copy out of the pool, on a stream of its own, may start).
    // TDM_OK or TDM_EBACKEND.
    int (*mark_layer)(struct tdm_kv_storage *st, int layer);
    int (*wait_layer)(struct tdm_kv_storage *st, int layer);
};
struct tdm_kv_storage {
    const struct tdm_kv_storage_ops *ops;
    bool host;               // the pool is host memory the cache may address
    enum tdm_kv_dtype dtype; // element type of the pool
};

// TDM_EINVAL (err names the field) for a size <= 0, an unknown dtype or a pool
// whose byte or token count overflows; TDM_ENOMEM when the pool cannot be
// allocated. The pool is host memory of cfg->dtype (the default storage).
int tdm_kv_new(struct tdm_kv_cache **out, const struct tdm_kv_config *cfg, char *err, size_t errlen);
// The same on a storage the caller made for cfg; the cache takes st on
// success only (and frees it in tdm_kv_free). The cache's dtype is st->dtype
// (what the storage holds), whatever cfg->dtype says.
int tdm_kv_new_with_storage(struct tdm_kv_cache **out, const struct tdm_kv_config *cfg,
                            struct tdm_kv_storage *st, char *err, size_t errlen);
void tdm_kv_free(struct tdm_kv_cache *kv);
const struct tdm_kv_config *tdm_kv_config(const struct tdm_kv_cache *kv);
// The cache's storage (never NULL for a live cache).
struct tdm_kv_storage *tdm_kv_storage(struct tdm_kv_cache *kv);
// The storage's mark_layer / wait_layer (above) for `layer`; TDM_OK at once
// for a storage without them, TDM_EINVAL for a layer out of range.
int tdm_kv_mark_layer(struct tdm_kv_cache *kv, int layer);
int tdm_kv_wait_layer(struct tdm_kv_cache *kv, int layer);
// Where layer `layer`'s K (v false) or V pool of `storage` (a struct
// tdm_kv_storage *) starts: the source/destination callback of GPU KV
// transfer (tdm_kvx_layer_fn).
void *tdm_kv_storage_layer(void *storage, int layer, bool v);

// Pointers to one block of one layer: [num_kv_heads][block_size][head_dim] f32;
// NULL for a layer or block out of range, or when the pool is not host f32.
float *tdm_kv_k(struct tdm_kv_cache *kv, int layer, int block);
float *tdm_kv_v(struct tdm_kv_cache *kv, int layer, int block);
// The same for a host bf16 pool (NULL unless the pool is host bf16).
uint16_t *tdm_kv_k_bf16(struct tdm_kv_cache *kv, int layer, int block);
uint16_t *tdm_kv_v_bf16(struct tdm_kv_cache *kv, int layer, int block);
// The cache's element type (the pool's; the payload of export/import below).
enum tdm_kv_dtype tdm_kv_dtype(const struct tdm_kv_cache *kv);

// A sequence's view of the cache. Caller storage: init before use, release after.
struct tdm_kv_seq {
    int *block_table;          // [cap_blocks] block ids, positions p -> block_table[p / block_size]
    int num_blocks;            // blocks in the table
    int cap_blocks;
    int num_tokens;            // tokens whose KV is computed and committed
    int num_cached_tokens;     // of those, how many came from the prefix cache
    uint64_t *block_hashes;    // [cap_blocks] chained hash of each full block (0 = not full yet)
    // The chain's root (the first block's parent hash): 0, or the request's
    // cache salt's (tdm_kv_salt_hash). Blocks of different roots never match,
    // not even on a hash collision: a first block's identity includes it.
    uint64_t root_hash;
};
void tdm_kv_seq_init(struct tdm_kv_seq *seq); // root_hash 0
// Drops the sequence's references; full hashed blocks stay cached (evictable,
// the sequence's last block first in eviction order). Frees the arrays and
// re-inits seq keeping its root_hash, so releasing twice or releasing an
// empty seq is harmless and a preempted request keeps its salt.
void tdm_kv_seq_release(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq);

// On an empty seq: finds the longest run of cached full blocks matching tokens
// (never all n tokens: at least one token is left to compute, so the caller gets
// logits), takes references, sets num_tokens = num_cached_tokens = the match.
// Counts queries (n) and hits (the match) in tokens. Returns the match length,
// a multiple of block_size; 0 without counting when seq is not empty or prefix
// caching is off.
int tdm_kv_match_prefix(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens,
                        int n);

// Makes the block table cover total_tokens positions, taking free blocks (evicting
// LRU cached ones when needed). All or nothing: TDM_ECAPACITY leaves seq unchanged
// (tdm_kv_errmsg says how many blocks were missing). Never shrinks the table.
// TDM_EINVAL for total_tokens < 0, TDM_ENOMEM if the table cannot grow.
int tdm_kv_reserve(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int total_tokens);

// Gives back the blocks past the first ceil(total_tokens / block_size): the
// tail a speculative step reserved for draft tokens that were rejected
// (docs/speculative-decoding.md). total_tokens must be >= seq->num_tokens (the
// committed tokens stay), so the blocks dropped were never hashed and go back
// to the free list. TDM_EINVAL (nothing changes) otherwise.
int tdm_kv_trim(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int total_tokens);

// Declares that KV for tokens[0..total_tokens) is now written; blocks that became
// full get their chained hash and enter the prefix cache. tokens is the whole
// sequence (prompt + generated) so far. total_tokens must lie in
// [seq->num_tokens, seq->num_blocks * block_size]; otherwise nothing changes and
// the error is logged (tdm_kv_errmsg). A full block whose content is already
// cached (two requests computed it at once) stays out of the map and pins its
// cached twin until released, so later blocks still chain onto the cached prefix.
void tdm_kv_commit(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens,
                   int total_tokens);

// Blocks a new sequence could get now (free + evictable).
int tdm_kv_num_free_blocks(const struct tdm_kv_cache *kv);
// Blocks referenced by at least one sequence / num_blocks, in [0, 1].
float tdm_kv_usage(const struct tdm_kv_cache *kv);
// Counters: prefix-cache queries and hits, in tokens, since creation.
void tdm_kv_prefix_stats(const struct tdm_kv_cache *kv, uint64_t *queries, uint64_t *hits);
// Self-check for tests: every block is free, cached or referenced exactly as the
// refcounts say, the map and the blocks' hashes agree, no cached block outlives
// its parent; returns TDM_OK or TDM_EPROTO with the first inconsistency in err.
// O(num_blocks): not for the serving path.
int tdm_kv_check(const struct tdm_kv_cache *kv, char *err, size_t errlen);
int tdm_kv_num_referenced_blocks(const struct tdm_kv_cache *kv);
// Cached blocks no sequence references (prefix-cache hits possible, reused LRU).
int tdm_kv_num_evictable_blocks(const struct tdm_kv_cache *kv);
// Sequences referencing block (0 when free or only cached; -1 for a bad id).
int tdm_kv_block_refcount(const struct tdm_kv_cache *kv, int block);
// Evicts every unreferenced cached block (drops their hashes); referenced
// blocks stay. For benchmarks and tests that need a cold cache.
void tdm_kv_reset_prefix_cache(struct tdm_kv_cache *kv);
// ---- KV events (exact prefix-aware routing) ------------------------------------------
// When enabled, the cache records an event each time a full block's chained hash
// enters the prefix map (STORED: tdm_kv_commit published it, including blocks
// written by tdm_kv_import_layer) and each time one leaves it (EVICTED: reused by
// tdm_kv_reserve, freed with prefix caching off, tdm_kv_reset_prefix_cache). A
// decode worker forwards them to the router, whose prefix index for that worker
// then holds exactly the hashes this map holds. Recording is a store into a
// fixed ring (no allocation per event). When the ring is full the recorded
// events are discarded and the overflow flag is set: the consumer must then drop
// everything it knows about this cache and apply only the events that follow
// (blocks cached before the overflow and still cached are then unknown to it
// until stored again: an index that misses entries only routes less well).
enum tdm_kv_event_kind { TDM_KV_EVENT_STORED = 1, TDM_KV_EVENT_EVICTED = 2 };
struct tdm_kv_event {
    uint64_t hash; // chained block hash (tdm_kv_block_hash)
    int kind;      // enum tdm_kv_event_kind
};
// Starts recording into a ring of capacity events (allocated once here; a second
// call with events pending keeps them only if capacity is unchanged). capacity 0
// stops recording and frees the ring. TDM_EINVAL for capacity < 0, TDM_ENOMEM.
int tdm_kv_events_enable(struct tdm_kv_cache *kv, int capacity);
// Moves up to cap of the oldest recorded events into out (oldest first) and
// returns how many. *overflow (may be NULL) says whether the ring overflowed
// since the previous take (the flag is cleared by this call). 0 when recording
// is off.
int tdm_kv_events_take(struct tdm_kv_cache *kv, struct tdm_kv_event *out, int cap,
                       bool *overflow);
// Events recorded and not yet taken.
int tdm_kv_events_pending(const struct tdm_kv_cache *kv);

// The detail of the last failed call on kv (reserve, export, import), "" if none.
// Valid until the next call on kv.
const char *tdm_kv_errmsg(const struct tdm_kv_cache *kv);

// ---- export / import for transfer ------------------------------------------------------
#define TDM_KV_MAGIC 0x31564b54u   // "TKV1"

// Fixed-layout header sent before KV payloads (little-endian, 96 bytes: the
// struct's own bytes on a little-endian host, which is all Tandem builds for).
struct tdm_kv_header {
    uint32_t magic;            // TDM_KV_MAGIC
    uint32_t version;          // 1
    char model[48];            // served model name / id, NUL-padded
    int32_t num_layers;
    int32_t num_kv_heads;
    int32_t head_dim;
    int32_t block_size;
    int32_t dtype;             // enum tdm_kv_dtype of the payload: 0 = f32, 1 = bf16
    int32_t num_tokens;        // tokens of KV the payload covers
    int32_t first_block;       // index into the sequence's block table
    int32_t num_blocks;
    uint32_t reserved[2];      // zero in version 1; pads the header to 96 bytes
};
void tdm_kv_header_fill(const struct tdm_kv_cache *kv, const char *model, struct tdm_kv_header *h);
// Sets num_tokens, first_block and num_blocks to 0 (the caller fills them); the
// model name is truncated to 47 bytes.
// TDM_EPROTO with "kv header: head_dim 64 != 128" (received != ours) when h does
// not fit this cache/model: magic, version, model, geometry, an unknown dtype
// (a known one other than ours is fine: import converts), a negative or
// out-of-pool block range, num_tokens beyond the range's end, reserved != 0.
int tdm_kv_header_check(const struct tdm_kv_cache *kv, const char *model,
                        const struct tdm_kv_header *h, char *err, size_t errlen);

// Bytes of one layer's payload for nblocks blocks: K then V, each
// [nblocks][num_kv_heads][block_size][head_dim] of the cache's dtype (_as: of
// dtype). 0 for nblocks < 0 or > num_blocks, or an unknown dtype.
size_t tdm_kv_layer_bytes(const struct tdm_kv_cache *kv, int nblocks);
size_t tdm_kv_layer_bytes_as(const struct tdm_kv_cache *kv, int nblocks, int dtype);
// Copies layer `layer` of seq's blocks [first_block, first_block+nblocks) into dst.
// dst_len must equal tdm_kv_layer_bytes(kv, nblocks); TDM_EINVAL (detail in
// tdm_kv_errmsg) for a bad layer, range or length, TDM_EBACKEND when the
// storage's copy failed. The payload is of the cache's dtype; _as writes dtype
// (TDM_EINVAL for an unknown one), converting (tdm_kv_convert) when it differs.
int tdm_kv_export_layer(struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int layer,
                        int first_block, int nblocks, void *dst, size_t dst_len);
int tdm_kv_export_layer_as(struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int layer,
                           int first_block, int nblocks, int dtype, void *dst, size_t dst_len);
// The copy of export without its checks, for a thread other than the cache's
// owner: reads only the pool (no refcounts, no error text), so the caller must
// hold the blocks (referenced, nothing writing them). A device pool goes
// through its storage's export_blocks, which is safe from any thread (the
// CUDA storage copies on a stream of its own under its own lock: a GPU
// prefill worker sending over nng while its engine computes the layers
// above; see mark_layer for what it is ordered after). TDM_EINVAL for an
// unknown dtype. dst holds
// tdm_kv_layer_bytes_as(kv, nblocks, dtype) bytes.
int tdm_kv_read_blocks(struct tdm_kv_cache *kv, int layer, const int *blocks, int nblocks,
                       int dtype, void *dst);
// Writes such a payload into seq's blocks (which tdm_kv_reserve must have made).
// Same checks as export, and TDM_EINVAL for a block that is shared or in the
// prefix cache (import only past the cached prefix), so a transfer can never
// change KV another sequence relies on. Commit afterwards as usual. _as reads a
// payload of dtype (a peer's, from its kv header) and converts it on import.
int tdm_kv_import_layer(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int layer,
                        int first_block, int nblocks, const void *src, size_t src_len);
int tdm_kv_import_layer_as(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int layer,
                           int first_block, int nblocks, int dtype, const void *src,
                           size_t src_len);

#endif
