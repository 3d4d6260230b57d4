// SPDX-License-Identifier: Apache-2.0
// kv: the paged KV cache (see kv_cache.h and docs/kv-cache.md).
//
// Every block is in exactly one of three states:
//   FREE       refcount 0, no hash; in the free queue (FIFO).
//   EVICTABLE  refcount 0, hashed (in the prefix map); in the evictable queue,
//              least recently released first. Still found by tdm_kv_match_prefix.
//   USED       refcount > 0; in no queue. May or may not be hashed.
// Allocation takes the head of the free queue and only when that is empty evicts
// the head of the evictable queue (its hash leaves the map), so both the order
// and the result are deterministic.
//
// Prefix map: open addressing (linear probing, backward-shift delete) from the
// 64-bit chained block hash to block id. The hash only picks the slot: a hit is
// accepted only when the cached block's stored token ids and its parent link
// (parent block id + that block's generation) equal the query's, so a 64-bit
// collision costs at most a miss, never wrong KV. The generation of a block is
// bumped whenever it leaves the map, which invalidates every child link to it.
// A full block whose identity is already cached (two requests computed the same
// prompt at once) is not inserted again: it records the cached twin as its alias
// and takes a reference on it ("pins" it), so its successors link to the twin and
// the chain stays reachable from the root for as long as the sequence lives. The
// pin is dropped when the duplicate block is released.
//
// Not thread-safe: one engine thread owns the cache (house rule).
#include "kv_cache.h"
#include "kv_cache_impl.h"

#include "core.h"
#include "hf.h"

#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

_Static_assert(sizeof(struct tdm_kv_header) == 96, "kv header is 96 bytes on the wire");
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the kv transfer header is sent as raw little-endian bytes"
#endif

#define KV_ALIGN 64 // tdm_kv_k/v alignment promised to kernels (mmap gives a page)
_Static_assert(KV_ALIGN <= 4096, "pool arrays come from mmap: page-aligned");
#define KV_SLOT_EMPTY (-1)

enum kv_state { KV_FREE = 0, KV_EVICTABLE, KV_USED };

struct kv_block {
    int ref;        // sequences holding this block
    int state;      // enum kv_state
    int prev, next; // links in the free or evictable queue (-1 = none)
    bool hashed;    // in the prefix map (identity below is valid)
    uint64_t hash;  // chained hash when hashed
    int parent;     // canonical parent block when hashed (-1 = first block)
    uint32_t parent_gen;
    uint64_t root; // a first block's chain root (tdm_kv_seq.root_hash) when hashed
    uint32_t gen; // bumped each time the block leaves the map
    int alias;    // unhashed full block: pinned cached twin with identical content (-1 = none)
};

struct kv_queue {
    int head, tail, count;
};

struct kv_slot {
    uint64_t hash;
    int block; // KV_SLOT_EMPTY when unused
};

struct tdm_kv_cache {
    struct tdm_kv_config cfg;
    size_t block_floats;     // num_kv_heads * block_size * head_dim (one block, one layer, K or V)
    struct tdm_kv_storage *st; // the pool (owned)
    struct kv_block *blocks; // [num_blocks]
    int32_t *block_tokens;   // [num_blocks][block_size] token ids of hashed blocks
    struct kv_queue free_q;  // FREE blocks, allocation order
    struct kv_queue evict_q; // EVICTABLE blocks, least recently released first
    int num_used;            // blocks with ref > 0
    int num_hashed;          // blocks in the map
    struct kv_slot *slots;   // [slot_mask + 1] prefix map
    size_t slot_mask;
    uint64_t queries, hits; // prefix-cache counters, tokens
    tdm_kv_hash_fn hash_fn; // tdm_kv_block_hash unless a test swapped it
    char errmsg[256];       // detail of the last failure
    // KV events ring (tdm_kv_events_enable); ev == NULL when not recording.
    struct tdm_kv_event *ev;
    int ev_cap, ev_head, ev_count;
    bool ev_overflow;
};

// ---- hashing ----------------------------------------------------------------------
// Chained block hash: an xxHash64-style accumulation (multiply, rotate, multiply)
// of the parent hash and the block's token ids, two 32-bit ids per 64-bit lane,
// finished with the murmur3 fmix64 avalanche. Non-cryptographic on purpose: a
// collision is harmless because hits are verified against the stored tokens.
#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull

uint64_t tdm_kv_salt_hash(const char *salt, size_t len)
{
    if (salt == NULL || len == 0)
        return 0;
    // The salt's bytes as the block hash of their 32-bit words (the last one
    // zero-padded), its length mixed in: chained onto a constant so that no
    // salt's root is a block's hash.
    uint64_t h = 0x5A17C0DE5A17C0DEull;
    for (size_t i = 0; i < len; i += 64) {
        int32_t w[16] = {0};
        size_t n = len - i < 64 ? len - i : 64;
        memcpy(w, salt + i, n);
        h = tdm_kv_block_hash(h, w, (int)((n + 3) / 4));
    }
    h = tdm_fmix64(h ^ (uint64_t)len * P1);
    return h ? h : 1;
}

uint64_t tdm_kv_block_hash(uint64_t parent, const int32_t *tokens, int n)
{
    uint64_t acc = parent * P1 + P3;
    int i = 0;
    for (; i + 1 < n; i += 2) {
        uint64_t lane = (uint64_t)(uint32_t)tokens[i] | ((uint64_t)(uint32_t)tokens[i + 1] << 32);
        acc = tdm_rotl64(acc ^ tdm_rotl64(lane * P2, 31) * P1, 27) * P1 + P3;
    }
    if (i < n)
        acc = tdm_rotl64(acc ^ (uint64_t)(uint32_t)tokens[i] * P1, 23) * P2 + P3;
    acc ^= (uint64_t)n * P2;
    acc = tdm_fmix64(acc);
    // 0 means "not full yet" in tdm_kv_seq.block_hashes.
    return acc ? acc : 1;
}

// ---- small helpers -------------------------------------------------------------------

static void kv_err(struct tdm_kv_cache *kv, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void kv_err(struct tdm_kv_cache *kv, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kv->errmsg, sizeof kv->errmsg, fmt, ap);
    va_end(ap);
}

static void q_push_tail(struct tdm_kv_cache *kv, struct kv_queue *q, int b)
{
    struct kv_block *bl = &kv->blocks[b];
    bl->prev = q->tail;
    bl->next = -1;
    if (q->tail >= 0)
        kv->blocks[q->tail].next = b;
    else
        q->head = b;
    q->tail = b;
    q->count++;
}

static void q_remove(struct tdm_kv_cache *kv, struct kv_queue *q, int b)
{
    struct kv_block *bl = &kv->blocks[b];
    if (bl->prev >= 0)
        kv->blocks[bl->prev].next = bl->next;
    else
        q->head = bl->next;
    if (bl->next >= 0)
        kv->blocks[bl->next].prev = bl->prev;
    else
        q->tail = bl->prev;
    bl->prev = bl->next = -1;
    q->count--;
}

static int32_t *kv_tokens_of(const struct tdm_kv_cache *kv, int b)
{
    return kv->block_tokens + (size_t)b * (size_t)kv->cfg.block_size;
}

// ---- prefix map -----------------------------------------------------------------------

// Finds the cached block with this identity: hash, parent link (a first
// block: its chain root) and tokens. -1 if none.
static int map_find(const struct tdm_kv_cache *kv, uint64_t hash, int parent, uint32_t parent_gen,
                    uint64_t root, const int32_t *tokens)
{
    size_t bs_bytes = (size_t)kv->cfg.block_size * sizeof(int32_t);
    for (size_t i = hash & kv->slot_mask;; i = (i + 1) & kv->slot_mask) {
        const struct kv_slot *s = &kv->slots[i];
        if (s->block == KV_SLOT_EMPTY)
            return -1;
        if (s->hash != hash)
            continue;
        const struct kv_block *bl = &kv->blocks[s->block];
        if (bl->parent == parent &&
            (parent < 0 ? bl->root == root : bl->parent_gen == parent_gen) &&
            memcmp(kv_tokens_of(kv, s->block), tokens, bs_bytes) == 0)
            return s->block;
    }
}

// Inserts block b (identity already set in its kv_block / block_tokens).
// Records a KV event; a full ring is emptied and flagged (see kv_cache.h) since
// the consumer resynchronizes from scratch anyway.
static void ev_push(struct tdm_kv_cache *kv, int kind, uint64_t hash)
{
    if (!kv->ev)
        return;
    if (kv->ev_count == kv->ev_cap) {
        kv->ev_count = 0;
        kv->ev_head = 0;
        kv->ev_overflow = true;
    }
    int i = (kv->ev_head + kv->ev_count) % kv->ev_cap;
    kv->ev[i].hash = hash;
    kv->ev[i].kind = kind;
    kv->ev_count++;
}

static void map_insert(struct tdm_kv_cache *kv, int b)
{
    uint64_t hash = kv->blocks[b].hash;
    size_t i = hash & kv->slot_mask;
    while (kv->slots[i].block != KV_SLOT_EMPTY)
        i = (i + 1) & kv->slot_mask;
    kv->slots[i].hash = hash;
    kv->slots[i].block = b;
    kv->blocks[b].hashed = true;
    kv->num_hashed++;
    ev_push(kv, TDM_KV_EVENT_STORED, hash);
}

// Removes block b from the map (backward-shift deletion keeps probe chains
// intact without tombstones) and bumps its generation.
static void map_remove(struct tdm_kv_cache *kv, int b)
{
    struct kv_block *bl = &kv->blocks[b];
    ev_push(kv, TDM_KV_EVENT_EVICTED, bl->hash);
    size_t i = bl->hash & kv->slot_mask;
    while (kv->slots[i].block != b) {
        TDM_ASSERT(kv->slots[i].block != KV_SLOT_EMPTY);
        i = (i + 1) & kv->slot_mask;
    }
    size_t hole = i;
    for (size_t j = (hole + 1) & kv->slot_mask; kv->slots[j].block != KV_SLOT_EMPTY;
         j = (j + 1) & kv->slot_mask) {
        size_t home = kv->slots[j].hash & kv->slot_mask;
        // Move j into the hole unless its home lies cyclically in (hole, j].
        bool home_in_range = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!home_in_range) {
            kv->slots[hole] = kv->slots[j];
            hole = j;
        }
    }
    kv->slots[hole].block = KV_SLOT_EMPTY;
    kv->slots[hole].hash = 0;
    bl->hashed = false;
    bl->hash = 0;
    bl->parent = -1;
    bl->parent_gen = 0;
    bl->gen++;
    kv->num_hashed--;
}

// ---- element types --------------------------------------------------------------------

size_t tdm_kv_dtype_size(int dtype)
{
    return dtype == TDM_KV_F32 ? 4 : dtype == TDM_KV_BF16 ? 2 : 0;
}

const char *tdm_kv_dtype_name(int dtype)
{
    return dtype == TDM_KV_F32 ? "f32" : dtype == TDM_KV_BF16 ? "bf16" : "unknown";
}

int tdm_kv_dtype_parse(const char *s, enum tdm_kv_dtype *out, char *err, size_t errlen)
{
    if (s && (strcmp(s, "auto") == 0 || strcmp(s, "bf16") == 0 || strcmp(s, "bfloat16") == 0)) {
        *out = TDM_KV_BF16;
        return TDM_OK;
    }
    if (s && (strcmp(s, "f32") == 0 || strcmp(s, "float32") == 0)) {
        *out = TDM_KV_F32;
        return TDM_OK;
    }
    return tdm_seterr(err, errlen, TDM_EINVAL,
                      "kv cache dtype '%s': expected auto (bf16), bf16 or f32", s ? s : "");
}

void tdm_kv_convert(void *dst, int dst_dtype, const void *src, int src_dtype, size_t n)
{
    // dst or src may be unaligned (a KvData payload starts where its frame's
    // message ends): elements move through memcpy, which the compiler turns
    // into plain (unaligned) loads and stores.
    unsigned char *d = dst;
    const unsigned char *x = src;
    if (dst_dtype == src_dtype) {
        if (n)
            memcpy(dst, src, n * tdm_kv_dtype_size(src_dtype));
    } else if (dst_dtype == TDM_KV_F32 && src_dtype == TDM_KV_BF16) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, x + 2 * i, 2);
            float f = tdm_bf16_to_f32(h);
            memcpy(d + 4 * i, &f, 4);
        }
    } else if (dst_dtype == TDM_KV_BF16 && src_dtype == TDM_KV_F32) {
        for (size_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, x + 4 * i, 4);
            uint16_t h = tdm_f32_to_bf16(f);
            memcpy(d + 2 * i, &h, 2);
        }
    }
}

// ---- lifecycle ----------------------------------------------------------------------

size_t tdm_kv_block_bytes(const struct tdm_kv_config *cfg)
{
    if (!cfg || cfg->num_layers <= 0 || cfg->num_kv_heads <= 0 || cfg->block_size <= 0 ||
        cfg->head_dim <= 0 || tdm_kv_dtype_size(cfg->dtype) == 0)
        return 0;
    size_t r = 2 * tdm_kv_dtype_size(cfg->dtype);
    int dims[4] = {cfg->num_layers, cfg->num_kv_heads, cfg->block_size, cfg->head_dim};
    for (int i = 0; i < 4; i++) {
        if (r > SIZE_MAX / (size_t)dims[i])
            return 0;
        r *= (size_t)dims[i];
    }
    return r;
}

// Checks cfg; TDM_OK or TDM_EINVAL with the field named.
static int check_config(const struct tdm_kv_config *cfg, char *err, size_t errlen)
{
    const struct {
        const char *name;
        int value;
    } fields[] = {{"num_layers", cfg->num_layers},
                  {"num_kv_heads", cfg->num_kv_heads},
                  {"head_dim", cfg->head_dim},
                  {"block_size", cfg->block_size},
                  {"num_blocks", cfg->num_blocks}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value <= 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "kv config: %s=%d must be > 0",
                              fields[i].name, fields[i].value);
    if ((int64_t)cfg->num_blocks * cfg->block_size > INT_MAX)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "kv config: num_blocks=%d * block_size=%d tokens exceeds %d",
                          cfg->num_blocks, cfg->block_size, INT_MAX);
    if (tdm_kv_dtype_size(cfg->dtype) == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv config: dtype=%d is not f32 (0) or bf16 (1)",
                          (int)cfg->dtype);
    if (cfg->num_blocks > INT_MAX / 4)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv config: num_blocks=%d is too large",
                          cfg->num_blocks);
    size_t block_bytes = tdm_kv_block_bytes(cfg);
    if (block_bytes == 0 || block_bytes > SIZE_MAX / (size_t)cfg->num_blocks)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "kv config: pool size (%d blocks x %d layers x %d heads x %d tokens x "
                          "%d dims x 2 x %zu bytes) overflows size_t",
                          cfg->num_blocks, cfg->num_layers, cfg->num_kv_heads, cfg->block_size,
                          cfg->head_dim, tdm_kv_dtype_size(cfg->dtype));
    return TDM_OK;
}

// ---- host storage (the default) ---------------------------------------------------------
struct host_storage {
    struct tdm_kv_storage base;
    int num_layers;
    size_t layer_bytes; // bytes of one k[layer] or v[layer] mapping
    void **k;           // [num_layers] -> [num_blocks][num_kv_heads][block_size][head_dim]
    void **v;           // same shape as k; elements of base.dtype
};

static void host_free(struct tdm_kv_storage *st)
{
    struct host_storage *h = (struct host_storage *)st;
    if (!h)
        return;
    for (int l = 0; l < h->num_layers; l++) {
        if (h->k && h->k[l])
            munmap(h->k[l], h->layer_bytes);
        if (h->v && h->v[l])
            munmap(h->v[l], h->layer_bytes);
    }
    free(h->k);
    free(h->v);
    free(h);
}

static void *host_layer_k(struct tdm_kv_storage *st, int layer)
{
    return ((struct host_storage *)st)->k[layer];
}

static void *host_layer_v(struct tdm_kv_storage *st, int layer)
{
    return ((struct host_storage *)st)->v[layer];
}

// export_blocks / import_blocks stay NULL: the cache addresses a host pool itself.
static const struct tdm_kv_storage_ops host_ops = {
    .free = host_free,
    .layer_k = host_layer_k,
    .layer_v = host_layer_v,
};

// One layer's K or V pool: an anonymous mapping, page-aligned (so 64-byte
// aligned) and zero-filled by the kernel on first touch, so a kernel reading
// past a sequence's last token sees finite numbers, and creating a multi-GB
// pool does not touch every page up front (a memset of 3 GB took ~10 s on a
// loaded host). Huge pages where the kernel has them (THP in madvise mode,
// Debian's default): attention reads one block of one KV head at a time
// (4 KiB in f32: a page each), spread over the pool, so with 4 KiB pages
// nearly every chunk was a TLB miss at long context. NULL when it fails.
static void *pool_map(size_t bytes)
{
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p;
}

static int host_storage_new(struct host_storage **out, const struct tdm_kv_config *cfg)
{
    struct host_storage *h = calloc(1, sizeof *h);
    if (!h)
        return TDM_ENOMEM;
    h->base.ops = &host_ops;
    h->base.host = true;
    h->base.dtype = cfg->dtype;
    h->layer_bytes = (size_t)cfg->num_kv_heads * (size_t)cfg->block_size * (size_t)cfg->head_dim *
                     tdm_kv_dtype_size(cfg->dtype) * (size_t)cfg->num_blocks;
    h->k = calloc((size_t)cfg->num_layers, sizeof *h->k);
    h->v = calloc((size_t)cfg->num_layers, sizeof *h->v);
    if (!h->k || !h->v)
        goto fail;
    h->num_layers = cfg->num_layers;
    for (int l = 0; l < cfg->num_layers; l++) {
        if ((h->k[l] = pool_map(h->layer_bytes)) == NULL ||
            (h->v[l] = pool_map(h->layer_bytes)) == NULL)
            goto fail;
    }
    *out = h;
    return TDM_OK;
fail:
    host_free(&h->base);
    return TDM_ENOMEM;
}

// ---- cache lifetime ---------------------------------------------------------------------
int tdm_kv_new(struct tdm_kv_cache **out, const struct tdm_kv_config *cfg, char *err, size_t errlen)
{
    if (!out || !cfg)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv: NULL argument");
    *out = NULL;
    int rc = check_config(cfg, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct host_storage *h;
    if (host_storage_new(&h, cfg) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_ENOMEM,
                          "kv: out of memory allocating %d blocks of %zu bytes", cfg->num_blocks,
                          tdm_kv_block_bytes(cfg));
    rc = tdm_kv_new_with_storage(out, cfg, &h->base, err, errlen);
    if (rc != TDM_OK)
        host_free(&h->base);
    return rc;
}

int tdm_kv_new_with_storage(struct tdm_kv_cache **out, const struct tdm_kv_config *cfg,
                            struct tdm_kv_storage *st, char *err, size_t errlen)
{
    if (!out || !cfg || !st || !st->ops)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv: NULL argument");
    *out = NULL;
    if (!st->host && (!st->ops->export_blocks || !st->ops->import_blocks))
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv: a device storage needs export/import");
    struct tdm_kv_config own = *cfg;
    own.dtype = st->dtype; // the pool holds what the storage holds
    cfg = &own;
    int rc = check_config(cfg, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct tdm_kv_cache *kv = calloc(1, sizeof *kv);
    if (!kv)
        goto fail;
    kv->cfg = *cfg;
    kv->hash_fn = tdm_kv_block_hash;
    kv->block_floats = (size_t)cfg->num_kv_heads * (size_t)cfg->block_size * (size_t)cfg->head_dim;
    kv->blocks = calloc((size_t)cfg->num_blocks, sizeof *kv->blocks);
    kv->block_tokens = calloc((size_t)cfg->num_blocks * (size_t)cfg->block_size, sizeof(int32_t));
    size_t nslots = 16;
    while (nslots < 2 * (size_t)cfg->num_blocks)
        nslots *= 2;
    kv->slots = malloc(nslots * sizeof *kv->slots);
    if (!kv->blocks || !kv->block_tokens || !kv->slots)
        goto fail_kv;
    kv->slot_mask = nslots - 1;
    for (size_t i = 0; i < nslots; i++) {
        kv->slots[i].hash = 0;
        kv->slots[i].block = KV_SLOT_EMPTY;
    }
    kv->free_q = (struct kv_queue){-1, -1, 0};
    kv->evict_q = (struct kv_queue){-1, -1, 0};
    for (int b = 0; b < cfg->num_blocks; b++) {
        kv->blocks[b].state = KV_FREE;
        kv->blocks[b].parent = -1;
        kv->blocks[b].alias = -1;
        q_push_tail(kv, &kv->free_q, b);
    }
    kv->st = st; // taken only now that nothing can fail
    *out = kv;
    return TDM_OK;

fail_kv:
    tdm_kv_free(kv);
fail:
    return tdm_seterr(err, errlen, TDM_ENOMEM, "kv: out of memory for the tables of %d blocks",
                      cfg->num_blocks);
}

void tdm_kv_free(struct tdm_kv_cache *kv)
{
    if (!kv)
        return;
    if (kv->st)
        kv->st->ops->free(kv->st);
    free(kv->blocks);
    free(kv->block_tokens);
    free(kv->slots);
    free(kv->ev);
    free(kv);
}

const struct tdm_kv_config *tdm_kv_config(const struct tdm_kv_cache *kv)
{
    return kv ? &kv->cfg : NULL;
}

void *tdm_kv_storage_layer(void *storage, int layer, bool v)
{
    struct tdm_kv_storage *st = storage;
    return v ? st->ops->layer_v(st, layer) : st->ops->layer_k(st, layer);
}

int tdm_kv_mark_layer(struct tdm_kv_cache *kv, int layer)
{
    if (kv == NULL || layer < 0 || layer >= kv->cfg.num_layers)
        return TDM_EINVAL;
    return kv->st->ops->mark_layer ? kv->st->ops->mark_layer(kv->st, layer) : TDM_OK;
}

int tdm_kv_wait_layer(struct tdm_kv_cache *kv, int layer)
{
    if (kv == NULL || layer < 0 || layer >= kv->cfg.num_layers)
        return TDM_EINVAL;
    return kv->st->ops->wait_layer ? kv->st->ops->wait_layer(kv->st, layer) : TDM_OK;
}

struct tdm_kv_storage *tdm_kv_storage(struct tdm_kv_cache *kv)
{
    return kv ? kv->st : NULL;
}

const char *tdm_kv_errmsg(const struct tdm_kv_cache *kv)
{
    return kv ? kv->errmsg : "kv: NULL cache";
}

enum tdm_kv_dtype tdm_kv_dtype(const struct tdm_kv_cache *kv)
{
    return kv ? kv->cfg.dtype : TDM_KV_F32;
}

// Start of block `block` of layer's K (v false) or V pool when the pool is host
// memory of dtype and the indices are in range; NULL otherwise.
static void *host_block(struct tdm_kv_cache *kv, int layer, int block, bool v, int dtype)
{
    if (!kv || !kv->st->host || (int)kv->cfg.dtype != dtype || layer < 0 ||
        layer >= kv->cfg.num_layers || block < 0 || block >= kv->cfg.num_blocks)
        return NULL;
    void *base = v ? kv->st->ops->layer_v(kv->st, layer) : kv->st->ops->layer_k(kv->st, layer);
    return (uint8_t *)base + (size_t)block * kv->block_floats * tdm_kv_dtype_size(dtype);
}

float *tdm_kv_k(struct tdm_kv_cache *kv, int layer, int block)
{
    return host_block(kv, layer, block, false, TDM_KV_F32);
}

float *tdm_kv_v(struct tdm_kv_cache *kv, int layer, int block)
{
    return host_block(kv, layer, block, true, TDM_KV_F32);
}

uint16_t *tdm_kv_k_bf16(struct tdm_kv_cache *kv, int layer, int block)
{
    return host_block(kv, layer, block, false, TDM_KV_BF16);
}

uint16_t *tdm_kv_v_bf16(struct tdm_kv_cache *kv, int layer, int block)
{
    return host_block(kv, layer, block, true, TDM_KV_BF16);
}

// ---- sequences ------------------------------------------------------------------------

void tdm_kv_seq_init(struct tdm_kv_seq *seq)
{
    if (seq)
        memset(seq, 0, sizeof *seq);
}

// Grows seq's arrays to hold at least need blocks; the contents stay.
static int seq_grow(struct tdm_kv_seq *seq, int need)
{
    if (need <= seq->cap_blocks)
        return TDM_OK;
    int cap = seq->cap_blocks ? seq->cap_blocks : 8;
    while (cap < need)
        cap = cap > INT_MAX / 2 ? need : cap * 2;
    int *table = realloc(seq->block_table, (size_t)cap * sizeof *table);
    if (!table)
        return TDM_ENOMEM;
    seq->block_table = table;
    uint64_t *hashes = realloc(seq->block_hashes, (size_t)cap * sizeof *hashes);
    if (!hashes)
        return TDM_ENOMEM; // block_table is larger but still valid; cap unchanged
    seq->block_hashes = hashes;
    seq->cap_blocks = cap;
    return TDM_OK;
}

static void block_decref(struct tdm_kv_cache *kv, int b)
{
    struct kv_block *bl = &kv->blocks[b];
    TDM_ASSERT(bl->state == KV_USED && bl->ref > 0);
    if (--bl->ref > 0)
        return;
    kv->num_used--;
    int twin = bl->alias;
    bl->alias = -1;
    if (bl->hashed && kv->cfg.enable_prefix_caching) {
        bl->state = KV_EVICTABLE;
        q_push_tail(kv, &kv->evict_q, b);
    } else {
        if (bl->hashed)
            map_remove(kv, b);
        bl->state = KV_FREE;
        q_push_tail(kv, &kv->free_q, b);
    }
    if (twin >= 0)
        block_decref(kv, twin); // a twin is hashed, so it has no alias: depth 1
}

void tdm_kv_seq_release(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq)
{
    if (!seq)
        return;
    if (kv && seq->block_table) {
        // Last block first: within one sequence the tail is the least likely to
        // be shared, so it should be evicted before the prefix it hangs off.
        for (int i = seq->num_blocks - 1; i >= 0; i--) {
            int b = seq->block_table[i];
            if (b >= 0 && b < kv->cfg.num_blocks && kv->blocks[b].ref > 0)
                block_decref(kv, b);
        }
    }
    free(seq->block_table);
    free(seq->block_hashes);
    uint64_t root = seq->root_hash;
    tdm_kv_seq_init(seq);
    seq->root_hash = root;
}

// Takes a reference on a cached block found by the prefix map.
static void block_incref(struct tdm_kv_cache *kv, int b)
{
    struct kv_block *bl = &kv->blocks[b];
    if (bl->state == KV_EVICTABLE) {
        q_remove(kv, &kv->evict_q, b);
        bl->state = KV_USED;
        kv->num_used++;
    }
    TDM_ASSERT(bl->state == KV_USED);
    bl->ref++;
}

int tdm_kv_match_prefix(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens,
                        int n)
{
    if (!kv || !seq || !tokens || n <= 0 || seq->num_blocks != 0 || seq->num_tokens != 0 ||
        !kv->cfg.enable_prefix_caching)
        return 0;
    int bs = kv->cfg.block_size;
    // At most (n - 1) tokens may come from the cache so that one is computed.
    int max_blocks = (n - 1) / bs;
    kv->queries += (uint64_t)n;
    uint64_t parent_hash = seq->root_hash;
    int parent = -1;
    uint32_t parent_gen = 0;
    int m = 0;
    for (; m < max_blocks; m++) {
        const int32_t *blk = tokens + (size_t)m * (size_t)bs;
        uint64_t h = kv->hash_fn(parent_hash, blk, bs);
        int b = map_find(kv, h, parent, parent_gen, seq->root_hash, blk);
        if (b < 0)
            break;
        if (seq_grow(seq, m + 1) != TDM_OK)
            break; // out of memory: a shorter match is still correct
        block_incref(kv, b);
        seq->block_table[m] = b;
        seq->block_hashes[m] = h;
        seq->num_blocks = m + 1;
        parent_hash = h;
        parent = b;
        parent_gen = kv->blocks[b].gen;
    }
    int matched = m * bs;
    seq->num_tokens = matched;
    seq->num_cached_tokens = matched;
    kv->hits += (uint64_t)matched;
    return matched;
}

int tdm_kv_reserve(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int total_tokens)
{
    if (!kv || !seq)
        return TDM_EINVAL;
    if (total_tokens < 0) {
        kv_err(kv, "kv reserve: total_tokens=%d < 0", total_tokens);
        return TDM_EINVAL;
    }
    int bs = kv->cfg.block_size;
    int need_blocks = (int)(((int64_t)total_tokens + bs - 1) / bs);
    int add = need_blocks - seq->num_blocks;
    if (add <= 0)
        return TDM_OK;
    int avail = kv->free_q.count + kv->evict_q.count;
    if (add > avail) {
        kv_err(kv, "kv reserve: %d tokens need %d more blocks, %d available of %d", total_tokens,
               add, avail, kv->cfg.num_blocks);
        return TDM_ECAPACITY;
    }
    if (seq_grow(seq, need_blocks) != TDM_OK) {
        kv_err(kv, "kv reserve: out of memory growing a block table to %d entries", need_blocks);
        return TDM_ENOMEM;
    }
    for (int i = seq->num_blocks; i < need_blocks; i++) {
        int b;
        if (kv->free_q.count > 0) {
            b = kv->free_q.head;
            q_remove(kv, &kv->free_q, b);
        } else {
            b = kv->evict_q.head;
            q_remove(kv, &kv->evict_q, b);
            map_remove(kv, b);
        }
        struct kv_block *bl = &kv->blocks[b];
        bl->state = KV_USED;
        bl->ref = 1;
        bl->alias = -1;
        kv->num_used++;
        seq->block_table[i] = b;
        seq->block_hashes[i] = 0;
    }
    seq->num_blocks = need_blocks;
    return TDM_OK;
}

int tdm_kv_trim(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int total_tokens)
{
    if (!kv || !seq || total_tokens < seq->num_tokens) {
        if (kv)
            kv_err(kv, "kv trim: total_tokens=%d below the %d committed", total_tokens,
                   seq ? seq->num_tokens : 0);
        return TDM_EINVAL;
    }
    int bs = kv->cfg.block_size;
    int keep = (int)(((int64_t)total_tokens + bs - 1) / bs);
    for (int i = seq->num_blocks - 1; i >= keep; i--) {
        block_decref(kv, seq->block_table[i]);
        seq->block_hashes[i] = 0;
    }
    if (keep < seq->num_blocks)
        seq->num_blocks = keep;
    return TDM_OK;
}

// The cached block whose content equals seq's first (i + 1) blocks, with its
// generation: the block itself when hashed, else its pinned twin. False only
// for a block that is not full or was committed with prefix caching off.
static bool seq_canonical(const struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int i,
                          int *id, uint32_t *gen)
{
    int b = seq->block_table[i];
    const struct kv_block *bl = &kv->blocks[b];
    if (!bl->hashed && bl->alias >= 0)
        b = bl->alias;
    if (!kv->blocks[b].hashed)
        return false;
    *id = b;
    *gen = kv->blocks[b].gen;
    return true;
}

// Gives the full block i of seq its identity in the prefix map, linked to the
// canonical block (parent, parent_gen) of i - 1, or pins the cached twin when
// that identity is already there.
static void seq_publish_block(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                              const int32_t *tokens, int i, int parent, uint32_t parent_gen)
{
    int bs = kv->cfg.block_size;
    int b = seq->block_table[i];
    struct kv_block *bl = &kv->blocks[b];
    if (bl->hashed || bl->alias >= 0)
        return; // a prefix hit, or published by an earlier commit
    const int32_t *blk = tokens + (size_t)i * (size_t)bs;
    int twin = map_find(kv, seq->block_hashes[i], parent, parent_gen, seq->root_hash, blk);
    if (twin >= 0) {
        block_incref(kv, twin);
        bl->alias = twin;
        return;
    }
    bl->hash = seq->block_hashes[i];
    bl->parent = parent;
    bl->parent_gen = parent_gen;
    bl->root = parent < 0 ? seq->root_hash : 0;
    memcpy(kv_tokens_of(kv, b), blk, (size_t)bs * sizeof(int32_t));
    map_insert(kv, b);
}

// Publishes the newly full blocks [from, to) of seq, each linked to the
// canonical block before it.
static void seq_publish(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens,
                        int from, int to)
{
    int parent = -1;
    uint32_t parent_gen = 0;
    if (from > 0 && !seq_canonical(kv, seq, from - 1, &parent, &parent_gen))
        return; // the chain is not cached: later blocks could never be reached
    for (int i = from; i < to; i++) {
        seq_publish_block(kv, seq, tokens, i, parent, parent_gen);
        if (!seq_canonical(kv, seq, i, &parent, &parent_gen))
            return;
    }
}

void tdm_kv_commit(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens,
                   int total_tokens)
{
    if (!kv || !seq)
        return;
    int bs = kv->cfg.block_size;
    if (total_tokens < seq->num_tokens || total_tokens > seq->num_blocks * bs ||
        (!tokens && total_tokens > 0)) {
        kv_err(kv, "kv commit: total_tokens=%d outside [%d, %d] (committed, reserved)",
               total_tokens, seq->num_tokens, seq->num_blocks * bs);
        TDM_LOG_ERR("kv", "%s", kv->errmsg);
        return;
    }
    int old_full = seq->num_tokens / bs;
    int new_full = total_tokens / bs;
    uint64_t h = old_full > 0 ? seq->block_hashes[old_full - 1] : seq->root_hash;
    for (int i = old_full; i < new_full; i++) {
        h = kv->hash_fn(h, tokens + (size_t)i * (size_t)bs, bs);
        seq->block_hashes[i] = h;
    }
    if (kv->cfg.enable_prefix_caching && new_full > old_full)
        seq_publish(kv, seq, tokens, old_full, new_full);
    seq->num_tokens = total_tokens;
}

// ---- accounting -------------------------------------------------------------------------

int tdm_kv_num_free_blocks(const struct tdm_kv_cache *kv)
{
    return kv ? kv->free_q.count + kv->evict_q.count : 0;
}

int tdm_kv_num_referenced_blocks(const struct tdm_kv_cache *kv)
{
    return kv ? kv->num_used : 0;
}

int tdm_kv_block_refcount(const struct tdm_kv_cache *kv, int block)
{
    if (!kv || block < 0 || block >= kv->cfg.num_blocks)
        return -1;
    return kv->blocks[block].ref;
}

void tdm_kv_set_hash_fn(struct tdm_kv_cache *kv, tdm_kv_hash_fn fn)
{
    if (kv)
        kv->hash_fn = fn ? fn : tdm_kv_block_hash;
}

int tdm_kv_num_evictable_blocks(const struct tdm_kv_cache *kv)
{
    return kv ? kv->evict_q.count : 0;
}

float tdm_kv_usage(const struct tdm_kv_cache *kv)
{
    if (!kv)
        return 0.0f;
    return (float)kv->num_used / (float)kv->cfg.num_blocks;
}

void tdm_kv_prefix_stats(const struct tdm_kv_cache *kv, uint64_t *queries, uint64_t *hits)
{
    if (queries)
        *queries = kv ? kv->queries : 0;
    if (hits)
        *hits = kv ? kv->hits : 0;
}

void tdm_kv_reset_prefix_cache(struct tdm_kv_cache *kv)
{
    if (!kv)
        return;
    while (kv->evict_q.count > 0) {
        int b = kv->evict_q.head;
        q_remove(kv, &kv->evict_q, b);
        map_remove(kv, b);
        kv->blocks[b].state = KV_FREE;
        q_push_tail(kv, &kv->free_q, b);
    }
}

static int check_queue(const struct tdm_kv_cache *kv, const struct kv_queue *q, int state,
                       const char *name, char *seen, char *err, size_t errlen)
{
    int n = 0, prev = -1;
    for (int b = q->head; b >= 0; b = kv->blocks[b].next) {
        if (b >= kv->cfg.num_blocks)
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv check: %s queue holds id %d", name, b);
        if (seen[b])
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d is queued twice", b);
        seen[b] = 1;
        const struct kv_block *bl = &kv->blocks[b];
        if (bl->state != state)
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "kv check: block %d in %s queue has state %d", b, name, bl->state);
        if (bl->ref != 0)
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d in %s queue has ref %d",
                              b, name, bl->ref);
        if (bl->prev != prev)
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d in %s queue: bad prev",
                              b, name);
        if (bl->hashed != (state == KV_EVICTABLE))
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d in %s queue: hashed=%d",
                              b, name, bl->hashed);
        prev = b;
        n++;
    }
    if (prev != q->tail || n != q->count)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "kv check: %s queue walks %d blocks to %d, counts %d ending at %d", name,
                          n, prev, q->count, q->tail);
    return TDM_OK;
}

int tdm_kv_check(const struct tdm_kv_cache *kv, char *err, size_t errlen)
{
    if (!kv)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv check: NULL cache");
    int nb = kv->cfg.num_blocks;
    char *seen = calloc((size_t)nb, 1);
    int *evict_pos = calloc((size_t)nb, sizeof *evict_pos);
    if (!seen || !evict_pos) {
        free(seen);
        free(evict_pos);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "kv check: out of memory");
    }
    int rc = check_queue(kv, &kv->free_q, KV_FREE, "free", seen, err, errlen);
    if (rc == TDM_OK)
        rc = check_queue(kv, &kv->evict_q, KV_EVICTABLE, "evictable", seen, err, errlen);
    if (rc == TDM_OK) {
        int pos = 0;
        for (int b = kv->evict_q.head; b >= 0; b = kv->blocks[b].next)
            evict_pos[b] = pos++;
    }
    int used = 0, hashed = 0;
    for (int b = 0; rc == TDM_OK && b < nb; b++) {
        const struct kv_block *bl = &kv->blocks[b];
        if (!seen[b]) {
            if (bl->state != KV_USED || bl->ref <= 0)
                rc = tdm_seterr(err, errlen, TDM_EPROTO,
                                "kv check: block %d is in no queue but state %d ref %d", b,
                                bl->state, bl->ref);
            used++;
        }
        if (rc == TDM_OK && bl->alias != -1) {
            if (bl->alias < 0 || bl->alias >= nb || bl->alias == b)
                rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d has alias %d", b,
                                bl->alias);
            else if (bl->hashed || bl->state != KV_USED || !kv->blocks[bl->alias].hashed ||
                     kv->blocks[bl->alias].ref <= 0)
                rc =
                    tdm_seterr(err, errlen, TDM_EPROTO,
                               "kv check: block %d aliases block %d but is hashed or unreferenced, "
                               "or the twin is not a pinned cached block",
                               b, bl->alias);
        }
        if (rc == TDM_OK && bl->hashed) {
            hashed++;
            if (!kv->cfg.enable_prefix_caching)
                rc = tdm_seterr(err, errlen, TDM_EPROTO,
                                "kv check: block %d hashed with prefix caching off", b);
            else if (bl->hash == 0)
                rc =
                    tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d hashed with hash 0", b);
            else if (bl->parent < -1 || bl->parent >= nb || bl->parent == b)
                rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d has parent %d", b,
                                bl->parent);
            else if (map_find(kv, bl->hash, bl->parent, bl->parent_gen, bl->root,
                              kv_tokens_of(kv, b)) != b)
                rc = tdm_seterr(
                    err, errlen, TDM_EPROTO,
                    "kv check: hashed block %d is not what the map finds for its identity", b);
            // No orphans: a cached block's parent is cached with the same generation,
            // referenced whenever the child is, and (both evictable) evicted after it.
            else if (bl->parent >= 0) {
                const struct kv_block *pb = &kv->blocks[bl->parent];
                if (!pb->hashed || pb->gen != bl->parent_gen)
                    rc = tdm_seterr(
                        err, errlen, TDM_EPROTO,
                        "kv check: block %d is an orphan (parent %d gen %u, link gen %u)", b,
                        bl->parent, pb->gen, bl->parent_gen);
                else if (bl->ref > 0 && pb->ref == 0)
                    rc = tdm_seterr(err, errlen, TDM_EPROTO,
                                    "kv check: block %d is referenced but its parent %d is not", b,
                                    bl->parent);
                else if (bl->state == KV_EVICTABLE && pb->state == KV_EVICTABLE &&
                         evict_pos[bl->parent] < evict_pos[b])
                    rc = tdm_seterr(err, errlen, TDM_EPROTO,
                                    "kv check: parent %d would be evicted before its child %d",
                                    bl->parent, b);
            }
        }
    }
    if (rc == TDM_OK && used != kv->num_used)
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: %d referenced blocks, counter says %d",
                        used, kv->num_used);
    if (rc == TDM_OK && hashed != kv->num_hashed)
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: %d hashed blocks, counter says %d",
                        hashed, kv->num_hashed);
    // Map -> blocks: every occupied slot names a distinct hashed block with that hash,
    // reachable from its home slot without crossing an empty one.
    size_t nslots = kv->slot_mask + 1, entries = 0;
    memset(seen, 0, (size_t)nb);
    for (size_t i = 0; rc == TDM_OK && i < nslots; i++) {
        const struct kv_slot *s = &kv->slots[i];
        if (s->block == KV_SLOT_EMPTY)
            continue;
        entries++;
        if (s->block < 0 || s->block >= nb) {
            rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: slot %zu holds id %d", i, s->block);
            break;
        }
        if (seen[s->block]++)
            rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: block %d is in the map twice",
                            s->block);
        else if (!kv->blocks[s->block].hashed || kv->blocks[s->block].hash != s->hash)
            rc =
                tdm_seterr(err, errlen, TDM_EPROTO,
                           "kv check: slot %zu names block %d which is not hashed so", i, s->block);
        for (size_t j = s->hash & kv->slot_mask; rc == TDM_OK && j != i;
             j = (j + 1) & kv->slot_mask)
            if (kv->slots[j].block == KV_SLOT_EMPTY)
                rc = tdm_seterr(err, errlen, TDM_EPROTO,
                                "kv check: slot %zu unreachable from its home slot", i);
    }
    if (rc == TDM_OK && entries != (size_t)kv->num_hashed)
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "kv check: map has %zu entries, %d hashed blocks",
                        entries, kv->num_hashed);
    free(seen);
    free(evict_pos);
    return rc;
}

// ---- export / import -------------------------------------------------------------------

void tdm_kv_header_fill(const struct tdm_kv_cache *kv, const char *model, struct tdm_kv_header *h)
{
    if (!h)
        return;
    memset(h, 0, sizeof *h);
    h->magic = TDM_KV_MAGIC;
    h->version = 1;
    if (model)
        strncpy(h->model, model, sizeof h->model - 1);
    if (kv) {
        h->num_layers = kv->cfg.num_layers;
        h->num_kv_heads = kv->cfg.num_kv_heads;
        h->head_dim = kv->cfg.head_dim;
        h->block_size = kv->cfg.block_size;
        h->dtype = kv->cfg.dtype;
    }
}

int tdm_kv_header_check(const struct tdm_kv_cache *kv, const char *model,
                        const struct tdm_kv_header *h, char *err, size_t errlen)
{
    if (!kv || !h)
        return tdm_seterr(err, errlen, TDM_EINVAL, "kv header: NULL argument");
    if (h->magic != TDM_KV_MAGIC)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: magic 0x%08x != 0x%08x", h->magic,
                          TDM_KV_MAGIC);
    if (h->version != 1)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: version %u != 1", h->version);
    if (memchr(h->model, 0, sizeof h->model) == NULL)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: model name is not NUL-terminated");
    char want[sizeof h->model] = {0};
    if (model)
        strncpy(want, model, sizeof want - 1);
    if (strcmp(h->model, want) != 0)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: model \"%s\" != \"%s\"", h->model,
                          want);
    const struct {
        const char *name;
        int32_t got, want;
    } geo[] = {{"num_layers", h->num_layers, kv->cfg.num_layers},
               {"num_kv_heads", h->num_kv_heads, kv->cfg.num_kv_heads},
               {"head_dim", h->head_dim, kv->cfg.head_dim},
               {"block_size", h->block_size, kv->cfg.block_size}};
    for (size_t i = 0; i < sizeof geo / sizeof geo[0]; i++)
        if (geo[i].got != geo[i].want)
            return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: %s %d != %d", geo[i].name,
                              geo[i].got, geo[i].want);
    if (tdm_kv_dtype_size(h->dtype) == 0)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: dtype %d is not f32 (0) or bf16 (1)",
                          h->dtype);
    if (h->first_block < 0 || h->num_blocks < 0 || h->num_tokens < 0)
        return tdm_seterr(
            err, errlen, TDM_EPROTO,
            "kv header: negative range (first_block %d, num_blocks %d, num_tokens %d)",
            h->first_block, h->num_blocks, h->num_tokens);
    int64_t end_block = (int64_t)h->first_block + h->num_blocks;
    if (end_block > kv->cfg.num_blocks)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "kv header: blocks [%d, %lld) exceed the pool of %d blocks",
                          h->first_block, (long long)end_block, kv->cfg.num_blocks);
    if ((int64_t)h->num_tokens > end_block * kv->cfg.block_size)
        return tdm_seterr(
            err, errlen, TDM_EPROTO, "kv header: num_tokens %d > %lld tokens in blocks [0, %lld)",
            h->num_tokens, (long long)(end_block * kv->cfg.block_size), (long long)end_block);
    if (h->reserved[0] != 0 || h->reserved[1] != 0)
        return tdm_seterr(err, errlen, TDM_EPROTO, "kv header: reserved fields are not zero");
    return TDM_OK;
}

size_t tdm_kv_layer_bytes_as(const struct tdm_kv_cache *kv, int nblocks, int dtype)
{
    if (!kv || nblocks < 0 || nblocks > kv->cfg.num_blocks)
        return 0;
    return 2 * (size_t)nblocks * kv->block_floats * tdm_kv_dtype_size(dtype);
}

size_t tdm_kv_layer_bytes(const struct tdm_kv_cache *kv, int nblocks)
{
    return kv ? tdm_kv_layer_bytes_as(kv, nblocks, kv->cfg.dtype) : 0;
}

// Validates a layer transfer against seq's table; returns TDM_OK or TDM_EINVAL
// with the detail in kv->errmsg.
static int check_transfer(struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int layer,
                          int first_block, int nblocks, int dtype, const void *buf, size_t len,
                          const char *what)
{
    if (tdm_kv_dtype_size(dtype) == 0) {
        kv_err(kv, "kv %s: dtype %d is not f32 (0) or bf16 (1)", what, dtype);
        return TDM_EINVAL;
    }
    if (!seq) {
        kv_err(kv, "kv %s: NULL sequence", what);
        return TDM_EINVAL;
    }
    if (layer < 0 || layer >= kv->cfg.num_layers) {
        kv_err(kv, "kv %s: layer %d outside [0, %d)", what, layer, kv->cfg.num_layers);
        return TDM_EINVAL;
    }
    if (first_block < 0 || nblocks < 0 || (int64_t)first_block + nblocks > seq->num_blocks) {
        kv_err(kv, "kv %s: blocks [%d, %lld) outside the sequence's %d blocks", what, first_block,
               (long long)first_block + nblocks, seq->num_blocks);
        return TDM_EINVAL;
    }
    size_t want = tdm_kv_layer_bytes_as(kv, nblocks, dtype);
    if (len != want) {
        kv_err(kv, "kv %s: buffer is %zu bytes, %d blocks of layer %d take %zu", what, len, nblocks,
               layer, want);
        return TDM_EINVAL;
    }
    if (want > 0 && !buf) {
        kv_err(kv, "kv %s: NULL buffer", what);
        return TDM_EINVAL;
    }
    for (int i = first_block; i < first_block + nblocks; i++) {
        int b = seq->block_table[i];
        if (b < 0 || b >= kv->cfg.num_blocks || kv->blocks[b].ref <= 0) {
            kv_err(kv, "kv %s: table entry %d holds block %d, not a referenced block", what, i, b);
            return TDM_EINVAL;
        }
    }
    return TDM_OK;
}

// Copies blocks of a layer between the pool and a payload buffer (K of every
// block, then V) of dtype: out = true reads the pool. A host pool is addressed
// here; another storage goes through its f32 ops, with an f32 staging buffer
// when the payload is bf16. TDM_OK, TDM_ENOMEM or TDM_EBACKEND.
static int copy_blocks(struct tdm_kv_cache *kv, int layer, const int *blocks, int nblocks,
                       int dtype, void *buf, bool out)
{
    size_t bf = kv->block_floats, pe = tdm_kv_dtype_size(dtype);
    uint8_t *kbuf = buf, *vbuf = kbuf + (size_t)nblocks * bf * pe;
    if (kv->st->host) {
        int pd = kv->cfg.dtype;
        size_t se = tdm_kv_dtype_size(pd);
        uint8_t *kp = kv->st->ops->layer_k(kv->st, layer), *vp = kv->st->ops->layer_v(kv->st, layer);
        for (int i = 0; i < nblocks; i++) {
            size_t po = (size_t)blocks[i] * bf * se, bo = (size_t)i * bf * pe;
            if (out) {
                tdm_kv_convert(kbuf + bo, dtype, kp + po, pd, bf);
                tdm_kv_convert(vbuf + bo, dtype, vp + po, pd, bf);
            } else {
                tdm_kv_convert(kp + po, pd, kbuf + bo, dtype, bf);
                tdm_kv_convert(vp + po, pd, vbuf + bo, dtype, bf);
            }
        }
        return TDM_OK;
    }
    float *stage = NULL, *kf = (float *)kbuf, *vf = (float *)vbuf;
    size_t n = (size_t)nblocks * bf;
    // The storage takes f32 arrays: staged when the payload is another dtype
    // or not float-aligned (a frame's payload may start anywhere).
    bool aligned = (uintptr_t)kbuf % _Alignof(float) == 0 && (uintptr_t)vbuf % _Alignof(float) == 0;
    if (dtype != TDM_KV_F32 || !aligned) {
        stage = malloc(2 * n * sizeof(float));
        if (!stage)
            return TDM_ENOMEM;
        kf = stage;
        vf = stage + n;
        if (!out) {
            tdm_kv_convert(kf, TDM_KV_F32, kbuf, dtype, n);
            tdm_kv_convert(vf, TDM_KV_F32, vbuf, dtype, n);
        }
    }
    int rc = out ? kv->st->ops->export_blocks(kv->st, layer, blocks, nblocks, kf, vf)
                 : kv->st->ops->import_blocks(kv->st, layer, blocks, nblocks, kf, vf);
    rc = rc == TDM_OK ? TDM_OK : TDM_EBACKEND;
    if (stage && out) {
        tdm_kv_convert(kbuf, dtype, kf, TDM_KV_F32, n);
        tdm_kv_convert(vbuf, dtype, vf, TDM_KV_F32, n);
    }
    free(stage);
    return rc;
}

int tdm_kv_read_blocks(struct tdm_kv_cache *kv, int layer, const int *blocks, int nblocks,
                       int dtype, void *dst)
{
    if (!kv || tdm_kv_dtype_size(dtype) == 0 || layer < 0 ||
        layer >= kv->cfg.num_layers || nblocks < 0 || (nblocks > 0 && (!blocks || !dst)))
        return TDM_EINVAL;
    for (int i = 0; i < nblocks; i++)
        if (blocks[i] < 0 || blocks[i] >= kv->cfg.num_blocks)
            return TDM_EINVAL;
    return copy_blocks(kv, layer, blocks, nblocks, dtype, dst, true);
}

int tdm_kv_export_layer_as(struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int layer,
                           int first_block, int nblocks, int dtype, void *dst, size_t dst_len)
{
    if (!kv)
        return TDM_EINVAL;
    int rc = check_transfer(kv, seq, layer, first_block, nblocks, dtype, dst, dst_len, "export");
    if (rc != TDM_OK)
        return rc;
    if (nblocks == 0)
        return TDM_OK;
    rc = copy_blocks(kv, layer, seq->block_table + first_block, nblocks, dtype, dst, true);
    if (rc != TDM_OK)
        kv_err(kv, "kv export: the storage failed to copy %d blocks of layer %d", nblocks, layer);
    return rc;
}

int tdm_kv_export_layer(struct tdm_kv_cache *kv, const struct tdm_kv_seq *seq, int layer,
                        int first_block, int nblocks, void *dst, size_t dst_len)
{
    return tdm_kv_export_layer_as(kv, seq, layer, first_block, nblocks, tdm_kv_dtype(kv), dst,
                                  dst_len);
}

int tdm_kv_import_layer_as(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int layer,
                           int first_block, int nblocks, int dtype, const void *src,
                           size_t src_len)
{
    if (!kv)
        return TDM_EINVAL;
    int rc = check_transfer(kv, seq, layer, first_block, nblocks, dtype, src, src_len, "import");
    if (rc != TDM_OK)
        return rc;
    // Writing into a block another sequence or the prefix cache relies on would
    // change their KV: only blocks this sequence alone owns and has not cached.
    for (int i = first_block; i < first_block + nblocks; i++) {
        const struct kv_block *bl = &kv->blocks[seq->block_table[i]];
        if (bl->ref != 1 || bl->hashed) {
            kv_err(kv,
                   "kv import: table entry %d (block %d) is shared or prefix-cached; import only "
                   "past the cached prefix",
                   i, seq->block_table[i]);
            return TDM_EINVAL;
        }
    }
    if (nblocks == 0)
        return TDM_OK;
    rc = copy_blocks(kv, layer, seq->block_table + first_block, nblocks, dtype, (void *)src, false);
    if (rc != TDM_OK)
        kv_err(kv, "kv import: the storage failed to copy %d blocks of layer %d", nblocks, layer);
    return rc;
}

int tdm_kv_import_layer(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, int layer, int first_block,
                        int nblocks, const void *src, size_t src_len)
{
    return tdm_kv_import_layer_as(kv, seq, layer, first_block, nblocks, tdm_kv_dtype(kv), src,
                                  src_len);
}

// ---- KV events --------------------------------------------------------------------------
int tdm_kv_events_enable(struct tdm_kv_cache *kv, int capacity)
{
    if (!kv || capacity < 0)
        return TDM_EINVAL;
    if (capacity == kv->ev_cap && kv->ev)
        return TDM_OK;
    struct tdm_kv_event *ev = NULL;
    if (capacity > 0) {
        ev = calloc((size_t)capacity, sizeof *ev);
        if (!ev)
            return TDM_ENOMEM;
    }
    free(kv->ev);
    kv->ev = ev;
    kv->ev_cap = capacity;
    kv->ev_head = kv->ev_count = 0;
    kv->ev_overflow = false;
    return TDM_OK;
}

int tdm_kv_events_take(struct tdm_kv_cache *kv, struct tdm_kv_event *out, int cap,
                       bool *overflow)
{
    if (overflow)
        *overflow = false;
    if (!kv || !kv->ev)
        return 0;
    if (overflow)
        *overflow = kv->ev_overflow;
    kv->ev_overflow = false;
    int n = 0;
    while (out && n < cap && kv->ev_count > 0) {
        out[n++] = kv->ev[kv->ev_head];
        kv->ev_head = (kv->ev_head + 1) % kv->ev_cap;
        kv->ev_count--;
    }
    return n;
}

int tdm_kv_events_pending(const struct tdm_kv_cache *kv)
{
    return kv && kv->ev ? kv->ev_count : 0;
}
