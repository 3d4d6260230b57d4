// SPDX-License-Identifier: Apache-2.0
// kv internals exposed to the unit tests only: swapping the block hash function
// lets a test force 64-bit collisions and prove that a colliding block is never
// returned as a prefix hit (hits are verified against stored token ids and the
// parent link, the hash only picks the map slot).
#ifndef TDM_KV_CACHE_IMPL_H
#define TDM_KV_CACHE_IMPL_H

#include "kv_cache.h"

typedef uint64_t (*tdm_kv_hash_fn)(uint64_t parent_hash, const int32_t *tokens, int n);

// Replaces the chained block hash (NULL restores the default). Call on an empty
// cache only: hashes already stored would not be recomputed. The function must
// never return 0 (0 marks "not full yet" in block_hashes).
void tdm_kv_set_hash_fn(struct tdm_kv_cache *kv, tdm_kv_hash_fn fn);

#endif
