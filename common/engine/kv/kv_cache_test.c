// SPDX-License-Identifier: Apache-2.0
// Tests for kv: config validation, block accounting, all-or-nothing reserve,
// prefix caching (sharing, partial blocks, the last-token rule, chained hashes,
// twins of concurrently computed prompts), LRU eviction and rescue, usage, a
// seeded random workload that checks consistency and KV content after every
// step (also with a hash that collides on purpose), and export/import.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kv_cache.h"
#include "kv_cache_impl.h"

// ---- helpers ---------------------------------------------------------------------------

// Reference bf16 conversions written out here (not the module's helper): round
// to nearest even on the bits, widen by a shift.
static uint16_t f32_to_bf16_ref(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t lower = u & 0xffffu, upper = u >> 16;
    if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u)))
        upper++;
    return (uint16_t)upper;
}

static float bf16_to_f32_ref(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static struct tdm_kv_cache *make_cache(int layers, int heads, int head_dim, int bs, int nblocks,
                                       bool prefix)
{
    struct tdm_kv_config cfg = {.num_layers = layers,
                                .num_kv_heads = heads,
                                .head_dim = head_dim,
                                .block_size = bs,
                                .num_blocks = nblocks,
                                .enable_prefix_caching = prefix};
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    int rc = tdm_kv_new(&kv, &cfg, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("tdm_kv_new: %s", err);
    return kv;
}

static void assert_consistent(const struct tdm_kv_cache *kv)
{
    char err[256] = "";
    int rc = tdm_kv_check(kv, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("tdm_kv_check: %s", err);
    int nb = tdm_kv_config(kv)->num_blocks;
    assert_int_equal(tdm_kv_num_referenced_blocks(kv) + tdm_kv_num_free_blocks(kv), nb);
}

// Reserves and commits a whole prompt on a fresh seq (after an optional match).
static int admit(struct tdm_kv_cache *kv, struct tdm_kv_seq *seq, const int32_t *tokens, int n,
                 bool match)
{
    tdm_kv_seq_init(seq);
    int m = match ? tdm_kv_match_prefix(kv, seq, tokens, n) : 0;
    int rc = tdm_kv_reserve(kv, seq, n);
    if (rc != TDM_OK)
        return rc;
    tdm_kv_commit(kv, seq, tokens, n);
    (void)m;
    return TDM_OK;
}

static void seq_tokens(int32_t *out, int n, int32_t base)
{
    for (int i = 0; i < n; i++)
        out[i] = base + i;
}

// ---- config and storage ----------------------------------------------------------------

static void test_config_validation(void **state)
{
    (void)state;
    struct tdm_kv_config good = {2, 2, 8, 16, 10, true, TDM_KV_F32};
    const char *names[] = {"num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks"};
    for (int f = 0; f < 5; f++) {
        for (int bad = -1; bad <= 0; bad++) {
            struct tdm_kv_config c = good;
            int *fields[] = {&c.num_layers, &c.num_kv_heads, &c.head_dim, &c.block_size,
                             &c.num_blocks};
            *fields[f] = bad;
            struct tdm_kv_cache *kv = (struct tdm_kv_cache *)&c; // must be reset to NULL
            char err[256] = "";
            assert_int_equal(tdm_kv_new(&kv, &c, err, sizeof err), TDM_EINVAL);
            assert_null(kv);
            assert_non_null(strstr(err, names[f]));
        }
    }
    struct tdm_kv_config huge = {INT_MAX, INT_MAX, INT_MAX, 1, 1, false, TDM_KV_F32};
    struct tdm_kv_cache *kv = NULL;
    char err[256] = "";
    assert_int_equal(tdm_kv_new(&kv, &huge, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "overflows"));
    struct tdm_kv_config tokens = {1, 1, 1, 1 << 16, 1 << 16, false, TDM_KV_F32};
    assert_int_equal(tdm_kv_new(&kv, &tokens, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "exceeds"));
    assert_int_equal(tdm_kv_new(&kv, NULL, err, sizeof err), TDM_EINVAL);

    assert_int_equal(tdm_kv_block_bytes(&good), (size_t)2 * 2 * 2 * 16 * 8 * 4);
    assert_int_equal(tdm_kv_block_bytes(&huge), 0);
    tdm_kv_free(NULL);
}

static void test_pointers(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(3, 2, 8, 4, 5, false);
    size_t block_floats = 2 * 4 * 8;
    // Host memory: marks and waits have nothing to order (done at once).
    assert_int_equal(tdm_kv_mark_layer(kv, 2), TDM_OK);
    assert_int_equal(tdm_kv_wait_layer(kv, 0), TDM_OK);
    assert_int_equal(tdm_kv_wait_layer(kv, 3), TDM_EINVAL);
    for (int l = 0; l < 3; l++) {
        for (int b = 0; b < 5; b++) {
            float *k = tdm_kv_k(kv, l, b), *v = tdm_kv_v(kv, l, b);
            assert_non_null(k);
            assert_non_null(v);
            assert_int_equal((uintptr_t)k % 64, 0);
            assert_int_equal((uintptr_t)v % 64, 0);
            assert_true(k != v);
            if (b > 0)
                assert_ptr_equal(k, tdm_kv_k(kv, l, b - 1) + block_floats);
            for (size_t i = 0; i < block_floats; i++) { // ASan catches an undersized pool
                assert_true(k[i] == 0.0f && v[i] == 0.0f);
                k[i] = (float)(l * 1000 + b);
                v[i] = -(float)(l * 1000 + b);
            }
        }
    }
    assert_true(tdm_kv_k(kv, 1, 2)[0] == 1002.0f);
    assert_null(tdm_kv_k(kv, -1, 0));
    assert_null(tdm_kv_k(kv, 3, 0));
    assert_null(tdm_kv_v(kv, 0, 5));
    assert_null(tdm_kv_v(kv, 0, -1));
    assert_null(tdm_kv_k(NULL, 0, 0));
    assert_int_equal(tdm_kv_config(kv)->num_layers, 3);
    tdm_kv_free(kv);
}

// ---- accounting ------------------------------------------------------------------------

static void test_accounting(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 4, 4, 10, false);
    struct tdm_kv_seq a, b;
    tdm_kv_seq_init(&a);
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 10);
    assert_int_equal(tdm_kv_reserve(kv, &a, 9), TDM_OK); // 3 blocks
    assert_int_equal(a.num_blocks, 3);
    assert_true(a.cap_blocks >= 3);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 7);
    assert_int_equal(tdm_kv_reserve(kv, &a, 12), TDM_OK); // still 3
    assert_int_equal(tdm_kv_num_free_blocks(kv), 7);
    assert_int_equal(tdm_kv_reserve(kv, &a, 5), TDM_OK); // never shrinks
    assert_int_equal(a.num_blocks, 3);
    assert_int_equal(tdm_kv_reserve(kv, &b, 1), TDM_OK);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 4);
    // Deterministic allocation order: 0, 1, 2 then 3.
    assert_int_equal(a.block_table[0], 0);
    assert_int_equal(a.block_table[2], 2);
    assert_int_equal(b.block_table[0], 3);
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdm_kv_block_refcount(kv, a.block_table[i]), 1);
    assert_consistent(kv);
    // Grow a across many reallocations.
    assert_int_equal(tdm_kv_reserve(kv, &a, 36), TDM_OK);
    assert_int_equal(a.num_blocks, 9);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 0);
    assert_consistent(kv);
    tdm_kv_seq_release(kv, &a);
    assert_null(a.block_table);
    assert_int_equal(a.num_blocks, 0);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 9);
    tdm_kv_seq_release(kv, &a); // twice: safe
    struct tdm_kv_seq empty;
    tdm_kv_seq_init(&empty);
    tdm_kv_seq_release(kv, &empty);
    tdm_kv_seq_release(kv, &b);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 10);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 0);
    assert_int_equal(tdm_kv_block_refcount(kv, 0), 0);
    assert_int_equal(tdm_kv_block_refcount(kv, 10), -1);
    assert_consistent(kv);
    assert_int_equal(tdm_kv_reserve(kv, &a, -1), TDM_EINVAL);
    tdm_kv_free(kv);
}

static void test_reserve_all_or_nothing(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 4, 4, 5, true);
    struct tdm_kv_seq a, b;
    int32_t toks[64];
    seq_tokens(toks, 64, 100);
    assert_int_equal(admit(kv, &a, toks, 12, true), TDM_OK); // 3 blocks
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_reserve(kv, &b, 4), TDM_OK);
    int *table = b.block_table;
    int cap = b.cap_blocks;
    assert_int_equal(tdm_kv_reserve(kv, &b, 13), TDM_ECAPACITY); // needs 3 more, 1 free
    assert_non_null(strstr(tdm_kv_errmsg(kv), "available"));
    assert_int_equal(b.num_blocks, 1);
    assert_ptr_equal(b.block_table, table);
    assert_int_equal(b.cap_blocks, cap);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 1);
    assert_consistent(kv);
    // Released a's hashed blocks become evictable and count as free again.
    tdm_kv_seq_release(kv, &a);
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 3);
    assert_int_equal(tdm_kv_reserve(kv, &b, 20), TDM_OK); // all 5 blocks
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 0);
    assert_int_equal(tdm_kv_reserve(kv, &b, 21), TDM_ECAPACITY);
    assert_consistent(kv);
    tdm_kv_seq_release(kv, &b);
    tdm_kv_free(kv);
}

static void test_usage(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 4, 4, 10, true);
    struct tdm_kv_seq s[3];
    int32_t toks[40];
    assert_true(tdm_kv_usage(kv) == 0.0f);
    for (int i = 0; i < 3; i++) {
        seq_tokens(toks, 40, 1000 * (i + 1));
        assert_int_equal(admit(kv, &s[i], toks, 8, true), TDM_OK);
        assert_float_equal(tdm_kv_usage(kv), 0.2f * (float)(i + 1), 1e-6);
    }
    for (int i = 0; i < 3; i++)
        tdm_kv_seq_release(kv, &s[i]);
    assert_true(tdm_kv_usage(kv) == 0.0f); // cached-but-unreferenced counts as free
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 6);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 10);
    tdm_kv_reset_prefix_cache(kv);
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 0);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

// ---- prefix caching ------------------------------------------------------------------------

static void test_prefix_hit(void **state)
{
    int bs = (int)(intptr_t)*state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, bs, 64, true);
    int n = 2 * bs + bs / 2 + 1; // two full blocks and a partial one
    int32_t toks[128];
    seq_tokens(toks, 128, 7);
    struct tdm_kv_seq a, b;
    assert_int_equal(admit(kv, &a, toks, n, true), TDM_OK);
    assert_int_equal(a.num_cached_tokens, 0);
    assert_int_not_equal(a.block_hashes[0], 0);
    assert_int_not_equal(a.block_hashes[1], 0);
    if (n % bs)
        assert_int_equal(a.block_hashes[a.num_blocks - 1], 0);

    tdm_kv_seq_init(&b);
    int m = tdm_kv_match_prefix(kv, &b, toks, n);
    assert_int_equal(m, 2 * bs);
    assert_int_equal(b.num_tokens, 2 * bs);
    assert_int_equal(b.num_cached_tokens, 2 * bs);
    assert_int_equal(b.num_blocks, 2);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(b.block_table[i], a.block_table[i]);
        assert_int_equal(b.block_hashes[i], a.block_hashes[i]);
        assert_int_equal(tdm_kv_block_refcount(kv, a.block_table[i]), 2);
    }
    assert_int_equal(tdm_kv_reserve(kv, &b, n), TDM_OK);
    assert_int_not_equal(b.block_table[2], a.block_table[2]); // partial blocks are never shared
    tdm_kv_commit(kv, &b, toks, n);
    uint64_t q, h;
    tdm_kv_prefix_stats(kv, &q, &h);
    assert_int_equal(q, (uint64_t)(2 * n));
    assert_int_equal(h, (uint64_t)(2 * bs));
    assert_consistent(kv);

    // A third request whose prompt ends inside block 2 still only shares 0 and 1.
    struct tdm_kv_seq c;
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, 2 * bs + 1), 2 * bs);
    // A non-empty seq is not matched again.
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, n), 0);
    tdm_kv_seq_release(kv, &c);

    // Whole prompt cached (exact multiple of block_size): the last block is left to compute.
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, 2 * bs), bs);
    tdm_kv_seq_release(kv, &c);
    // Shorter than one block: nothing to share.
    if (bs > 1) {
        tdm_kv_seq_init(&c);
        assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, bs - 1), 0);
        assert_int_equal(c.num_blocks, 0);
        tdm_kv_seq_release(kv, &c);
    }

    tdm_kv_seq_release(kv, &a);
    for (int i = 0; i < 2; i++)
        assert_int_equal(tdm_kv_block_refcount(kv, b.block_table[i]), 1);
    tdm_kv_seq_release(kv, &b);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 0);
    assert_consistent(kv);
    // Cached, unreferenced blocks are still found.
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, n), 2 * bs);
    assert_consistent(kv);
    tdm_kv_seq_release(kv, &c);
    tdm_kv_free(kv);
}

static void test_chained_hash(void **state)
{
    int bs = (int)(intptr_t)*state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, bs, 64, true);
    int32_t x[32], y[32], z[32], w[32];
    seq_tokens(x, bs, 100);
    seq_tokens(y, bs, 200);
    seq_tokens(z, bs, 300);
    seq_tokens(w, bs, 400);
    int32_t xy[65], zy[65], xw[65];
    memcpy(xy, x, (size_t)bs * 4);
    memcpy(xy + bs, y, (size_t)bs * 4);
    memcpy(zy, z, (size_t)bs * 4);
    memcpy(zy + bs, y, (size_t)bs * 4);
    memcpy(xw, x, (size_t)bs * 4);
    memcpy(xw + bs, w, (size_t)bs * 4);
    xy[2 * bs] = zy[2 * bs] = xw[2 * bs] = 1;
    struct tdm_kv_seq a, b;
    assert_int_equal(admit(kv, &a, xy, 2 * bs + 1, true), TDM_OK);
    tdm_kv_seq_init(&b);
    // Block y is cached, but under parent x: no hit for z|y.
    assert_int_equal(tdm_kv_match_prefix(kv, &b, zy, 2 * bs + 1), 0);
    assert_int_equal(tdm_kv_reserve(kv, &b, 2 * bs + 1), TDM_OK);
    tdm_kv_commit(kv, &b, zy, 2 * bs + 1);
    assert_int_not_equal(b.block_hashes[1], a.block_hashes[1]);
    assert_int_not_equal(b.block_table[1], a.block_table[1]);
    tdm_kv_seq_release(kv, &b);
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_match_prefix(kv, &b, xw, 2 * bs + 1), bs);
    assert_int_equal(b.block_table[0], a.block_table[0]);
    tdm_kv_seq_release(kv, &b);
    tdm_kv_seq_release(kv, &a);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

// Two requests with the same prompt computed concurrently (no hit for either):
// the second one's blocks are twins, and its own continuation still chains onto
// the cached prefix.
static void test_twins(void **state)
{
    (void)state;
    int bs = 4;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, bs, 16, true);
    int32_t toks[32];
    seq_tokens(toks, 32, 50);
    struct tdm_kv_seq a, b, c;
    tdm_kv_seq_init(&a);
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_reserve(kv, &a, 8), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &b, 8), TDM_OK);
    tdm_kv_commit(kv, &a, toks, 8);
    tdm_kv_commit(kv, &b, toks, 8);
    assert_int_equal(b.block_hashes[1], a.block_hashes[1]);
    assert_consistent(kv);
    assert_int_equal(tdm_kv_reserve(kv, &b, 12), TDM_OK);
    tdm_kv_commit(kv, &b, toks, 12);
    assert_consistent(kv);
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, 13), 12);
    assert_int_equal(c.block_table[0], a.block_table[0]);
    assert_int_equal(c.block_table[1], a.block_table[1]);
    assert_int_equal(c.block_table[2], b.block_table[2]);
    tdm_kv_seq_release(kv, &c);

    // b pins the twins: they outlive a and survive a cache reset, so b's chain
    // stays reachable and its next block links onto it.
    assert_int_equal(tdm_kv_block_refcount(kv, a.block_table[0]), 2);
    int a0 = a.block_table[0], a1 = a.block_table[1];
    tdm_kv_seq_release(kv, &a);
    tdm_kv_reset_prefix_cache(kv);
    assert_int_equal(tdm_kv_block_refcount(kv, a0), 1);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 5); // b's 3 + 2 pinned twins
    assert_int_equal(tdm_kv_reserve(kv, &b, 16), TDM_OK);
    tdm_kv_commit(kv, &b, toks, 16);
    assert_consistent(kv);
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, toks, 17), 16);
    assert_int_equal(c.block_table[0], a0);
    assert_int_equal(c.block_table[1], a1);
    assert_int_equal(c.block_table[2], b.block_table[2]);
    assert_int_equal(c.block_table[3], b.block_table[3]);
    tdm_kv_seq_release(kv, &c);
    tdm_kv_seq_release(kv, &b);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 0);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

static void test_lru_eviction(void **state)
{
    (void)state;
    int bs = 4;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, bs, 4, true);
    int32_t p[4][5];
    struct tdm_kv_seq s;
    for (int i = 0; i < 4; i++) {
        seq_tokens(p[i], 5, 100 * (i + 1));
        assert_int_equal(admit(kv, &s, p[i], 4, true), TDM_OK);
        assert_int_equal(s.block_table[0], i);
        tdm_kv_seq_release(kv, &s);
    }
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 4);
    // A hit rescues p[0]'s block: it leaves the evictable queue...
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_match_prefix(kv, &s, p[0], 5), 4);
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 3);
    assert_true(tdm_kv_usage(kv) == 0.25f);
    assert_consistent(kv);
    // ...and comes back as the most recently used.
    tdm_kv_seq_release(kv, &s);
    struct tdm_kv_seq n;
    tdm_kv_seq_init(&n);
    assert_int_equal(tdm_kv_reserve(kv, &n, 4), TDM_OK);
    assert_int_equal(n.block_table[0], 1); // p[1] was least recently released
    assert_consistent(kv);
    struct tdm_kv_seq q;
    tdm_kv_seq_init(&q);
    assert_int_equal(tdm_kv_match_prefix(kv, &q, p[1], 5), 0);
    for (int i = 0; i < 4; i++) {
        tdm_kv_seq_release(kv, &q);
        tdm_kv_seq_init(&q);
        assert_int_equal(tdm_kv_match_prefix(kv, &q, p[i], 5), i == 1 ? 0 : 4);
    }
    tdm_kv_seq_release(kv, &q);
    assert_int_equal(tdm_kv_reserve(kv, &n, 8), TDM_OK);
    // The loop released p0, p2, p3 in that order: p0 is now the oldest.
    assert_int_equal(n.block_table[1], 0);
    tdm_kv_seq_release(kv, &n);
    assert_consistent(kv);
    tdm_kv_free(kv);

    // Within one sequence the tail is evicted before the prefix it hangs off.
    kv = make_cache(1, 1, 2, bs, 2, true);
    int32_t t[9];
    seq_tokens(t, 9, 1);
    assert_int_equal(admit(kv, &s, t, 8, true), TDM_OK);
    int last = s.block_table[1];
    tdm_kv_seq_release(kv, &s);
    tdm_kv_seq_init(&n);
    assert_int_equal(tdm_kv_reserve(kv, &n, 1), TDM_OK);
    assert_int_equal(n.block_table[0], last);
    tdm_kv_seq_init(&q);
    assert_int_equal(tdm_kv_match_prefix(kv, &q, t, 9), 4);
    tdm_kv_seq_release(kv, &q);
    tdm_kv_seq_release(kv, &n);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

static void test_prefix_disabled(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, 4, 8, false);
    int32_t toks[16];
    seq_tokens(toks, 16, 3);
    struct tdm_kv_seq a, b;
    assert_int_equal(admit(kv, &a, toks, 9, true), TDM_OK);
    assert_int_not_equal(a.block_hashes[0], 0); // hashes are still computed
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_match_prefix(kv, &b, toks, 9), 0);
    tdm_kv_seq_release(kv, &a);
    assert_int_equal(tdm_kv_num_evictable_blocks(kv), 0);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 8);
    uint64_t q = 1, h = 1;
    tdm_kv_prefix_stats(kv, &q, &h);
    assert_int_equal(q, 0);
    assert_int_equal(h, 0);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

static void test_commit_bad_input(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, 4, 8, true);
    int32_t toks[16];
    seq_tokens(toks, 16, 3);
    struct tdm_kv_seq a;
    tdm_kv_seq_init(&a);
    assert_int_equal(tdm_kv_reserve(kv, &a, 8), TDM_OK);
    int saved = tdm_log_level;
    tdm_log_level = -1;             // the rejected commits log an error; keep the test output clean
    tdm_kv_commit(kv, &a, toks, 9); // beyond the reservation
    assert_int_equal(a.num_tokens, 0);
    assert_int_equal(a.block_hashes[0], 0);
    tdm_kv_commit(kv, &a, NULL, 4);
    assert_int_equal(a.num_tokens, 0);
    tdm_kv_commit(kv, &a, toks, 6);
    assert_int_equal(a.num_tokens, 6);
    tdm_kv_commit(kv, &a, toks, 5); // going backwards
    tdm_log_level = saved;
    assert_int_equal(a.num_tokens, 6);
    assert_non_null(strstr(tdm_kv_errmsg(kv), "commit"));
    tdm_kv_commit(kv, &a, toks, 8);
    assert_int_not_equal(a.block_hashes[1], 0);
    tdm_kv_seq_release(kv, &a);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

// ---- random workload -------------------------------------------------------------------

struct wl_param {
    int block_size;
    int num_blocks;
    int ops;
    bool prefix;
    tdm_kv_hash_fn hash;
};

static uint64_t rng_state;
static uint32_t rnd(uint32_t n)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (uint32_t)((rng_state >> 11) % n);
}

// A value that identifies tokens[0..p] (exact in a float: 24 bits).
static float fingerprint(const int32_t *tokens, int p, uint32_t salt)
{
    uint64_t h = 1469598103934665603ull ^ salt;
    for (int i = 0; i <= p; i++)
        h = (h ^ (uint32_t)tokens[i]) * 1099511628211ull;
    return (float)(uint32_t)((h ^ (h >> 29)) & 0xFFFFFF);
}

#define WL_MAX_SEQS 8
#define WL_CAP 160

struct wl_seq {
    bool live;
    struct tdm_kv_seq kv;
    int32_t tokens[WL_CAP];
    int n;
};

// Writes the KV of positions [from, to) as the model would: slot p % bs of block p / bs.
static void wl_write(struct tdm_kv_cache *kv, struct wl_seq *s, int from, int to)
{
    int bs = tdm_kv_config(kv)->block_size, hd = tdm_kv_config(kv)->head_dim;
    for (int p = from; p < to; p++) {
        int b = s->kv.block_table[p / bs];
        tdm_kv_k(kv, 0, b)[(p % bs) * hd] = fingerprint(s->tokens, p, 1);
        tdm_kv_v(kv, 0, b)[(p % bs) * hd] = fingerprint(s->tokens, p, 2);
    }
}

// A prefix hit must hold exactly this sequence's KV.
static void wl_verify(struct tdm_kv_cache *kv, struct wl_seq *s, int upto)
{
    int bs = tdm_kv_config(kv)->block_size, hd = tdm_kv_config(kv)->head_dim;
    for (int p = 0; p < upto; p++) {
        int b = s->kv.block_table[p / bs];
        if (tdm_kv_k(kv, 0, b)[(p % bs) * hd] != fingerprint(s->tokens, p, 1) ||
            tdm_kv_v(kv, 0, b)[(p % bs) * hd] != fingerprint(s->tokens, p, 2))
            fail_msg("prefix hit returned wrong KV at position %d (block %d)", p, b);
    }
}

static void test_random_workload(void **state)
{
    const struct wl_param *wp = *state;
    int bs = wp->block_size;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, bs, wp->num_blocks, wp->prefix);
    if (wp->hash)
        tdm_kv_set_hash_fn(kv, wp->hash);
    rng_state = 0x9E3779B97F4A7C15ull ^ (uint64_t)bs;
    // Shared roots from a tiny vocabulary so that equal blocks recur under
    // different parents.
    int32_t roots[4][48];
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 48; i++)
            roots[r][i] = (int32_t)rnd(r == 3 ? 3 : 6);
    static struct wl_seq seqs[WL_MAX_SEQS];
    memset(seqs, 0, sizeof seqs);
    int hits_seen = 0, ecap = 0;
    for (int op = 0; op < wp->ops; op++) {
        uint32_t kind = rnd(10);
        struct wl_seq *s = &seqs[rnd(WL_MAX_SEQS)];
        if (!s->live && kind < 8) { // admit
            int r = (int)rnd(4), cut = (int)rnd(49), extra = 1 + (int)rnd(24);
            memcpy(s->tokens, roots[r], (size_t)cut * sizeof(int32_t));
            for (int i = 0; i < extra; i++)
                s->tokens[cut + i] = (int32_t)rnd(6);
            s->n = cut + extra;
            tdm_kv_seq_init(&s->kv);
            int m = tdm_kv_match_prefix(kv, &s->kv, s->tokens, s->n);
            assert_true(m >= 0 && m < s->n && m % bs == 0);
            assert_int_equal(s->kv.num_tokens, m);
            if (m > 0)
                hits_seen++;
            wl_verify(kv, s, m);
            int rc = tdm_kv_reserve(kv, &s->kv, s->n);
            if (rc == TDM_ECAPACITY) {
                ecap++;
                tdm_kv_seq_release(kv, &s->kv);
            } else {
                assert_int_equal(rc, TDM_OK);
                wl_write(kv, s, m, s->n);
                tdm_kv_commit(kv, &s->kv, s->tokens, s->n);
                s->live = true;
            }
        } else if (s->live && kind < 7) { // extend (decode or a chunk)
            int k = 1 + (int)rnd((uint32_t)(2 * bs + 1));
            if (s->n + k <= WL_CAP) {
                int rc = tdm_kv_reserve(kv, &s->kv, s->n + k);
                if (rc == TDM_ECAPACITY) { // preempted
                    ecap++;
                    tdm_kv_seq_release(kv, &s->kv);
                    s->live = false;
                } else {
                    assert_int_equal(rc, TDM_OK);
                    for (int i = 0; i < k; i++)
                        s->tokens[s->n + i] = (int32_t)rnd(6);
                    int old = s->n;
                    s->n += k;
                    wl_write(kv, s, old, s->n);
                    tdm_kv_commit(kv, &s->kv, s->tokens, s->n);
                }
            }
        } else if (s->live) { // finish
            wl_verify(kv, s, s->n);
            tdm_kv_seq_release(kv, &s->kv);
            s->live = false;
        } else if (kind == 9 && rnd(50) == 0) {
            tdm_kv_reset_prefix_cache(kv);
        }
        assert_consistent(kv);
        for (int i = 0; i < WL_MAX_SEQS; i++)
            for (int j = 0; seqs[i].live && j < seqs[i].kv.num_blocks; j++)
                assert_true(tdm_kv_block_refcount(kv, seqs[i].kv.block_table[j]) > 0);
    }
    for (int i = 0; i < WL_MAX_SEQS; i++) {
        if (seqs[i].live)
            wl_verify(kv, &seqs[i], seqs[i].n);
        tdm_kv_seq_release(kv, &seqs[i].kv);
        seqs[i].live = false;
    }
    assert_consistent(kv);
    assert_true(tdm_kv_usage(kv) == 0.0f);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 0);
    assert_int_equal(tdm_kv_num_free_blocks(kv), wp->num_blocks);
    uint64_t q, h;
    tdm_kv_prefix_stats(kv, &q, &h);
    if (wp->prefix) {
        assert_true(hits_seen > 0 && h > 0 && h < q);
    } else {
        assert_int_equal(tdm_kv_num_evictable_blocks(kv), 0);
        assert_int_equal(h, 0);
    }
    assert_true(ecap > 0); // the pool was under pressure: eviction paths ran
    tdm_kv_free(kv);
}

// Forces 64-bit collisions: every block of the same first-token parity collides.
static uint64_t colliding_hash(uint64_t parent, const int32_t *tokens, int n)
{
    (void)parent;
    (void)n;
    return 1 + (uint64_t)(tokens[0] & 1);
}

static void test_forced_collisions(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 2, 4, 16, true);
    tdm_kv_set_hash_fn(kv, colliding_hash);
    int32_t a_t[9] = {2, 4, 6, 8, 2, 4, 6, 8, 0}, b_t[9] = {0, 0, 0, 0, 2, 4, 6, 8, 0};
    struct tdm_kv_seq a, b;
    assert_int_equal(admit(kv, &a, a_t, 9, true), TDM_OK);
    tdm_kv_seq_init(&b);
    // Same hashes for both blocks, different content: no hit.
    assert_int_equal(tdm_kv_match_prefix(kv, &b, b_t, 9), 0);
    assert_int_equal(tdm_kv_reserve(kv, &b, 9), TDM_OK);
    tdm_kv_commit(kv, &b, b_t, 9);
    assert_int_equal(b.block_hashes[0], a.block_hashes[0]);
    assert_consistent(kv);
    struct tdm_kv_seq c;
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_match_prefix(kv, &c, b_t, 9), 8);
    assert_int_equal(c.block_table[0], b.block_table[0]);
    assert_int_equal(c.block_table[1], b.block_table[1]);
    tdm_kv_seq_release(kv, &c);
    tdm_kv_seq_release(kv, &a);
    tdm_kv_seq_release(kv, &b);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

// cache_salt (vLLM's): a sequence's chain root keys its blocks. Same tokens
// under another root (none, or another salt) never hit, even when every hash
// collides; the same root hits; a released seq keeps its root (a preempted
// request comes back with its salt).
static void admit_salted(struct tdm_kv_cache *kv, struct tdm_kv_seq *s, const int32_t *t, int n,
                         uint64_t root, int want_hit)
{
    tdm_kv_seq_init(s);
    s->root_hash = root;
    assert_int_equal(tdm_kv_match_prefix(kv, s, t, n), want_hit);
    assert_int_equal(tdm_kv_reserve(kv, s, n), TDM_OK);
    tdm_kv_commit(kv, s, t, n);
}

static void test_cache_salt(void **state)
{
    (void)state;
    assert_int_equal(tdm_kv_salt_hash(NULL, 0), 0);
    assert_int_equal(tdm_kv_salt_hash("x", 0), 0);
    uint64_t r1 = tdm_kv_salt_hash("tenant-a", 8), r2 = tdm_kv_salt_hash("tenant-b", 8);
    assert_true(r1 != 0 && r2 != 0 && r1 != r2);
    assert_true(r1 == tdm_kv_salt_hash("tenant-a", 8));
    assert_true(tdm_kv_salt_hash("tenant-a\0", 9) != r1); // the length counts
    for (int collide = 0; collide < 2; collide++) {
        struct tdm_kv_cache *kv = make_cache(1, 1, 2, 4, 64, true);
        if (collide)
            tdm_kv_set_hash_fn(kv, colliding_hash);
        int32_t t[9] = {5, 6, 7, 8, 9, 10, 11, 12, 13};
        struct tdm_kv_seq plain, a, b, a2, b2;
        admit_salted(kv, &plain, t, 9, 0, 0);
        admit_salted(kv, &a, t, 9, r1, 0);  // not the unsalted blocks
        admit_salted(kv, &b, t, 9, r2, 0);  // nor salt a's
        admit_salted(kv, &a2, t, 9, r1, 8); // salt a's own
        admit_salted(kv, &b2, t, 9, r2, 8);
        assert_int_equal(a2.block_table[0], a.block_table[0]);
        assert_int_equal(b2.block_table[1], b.block_table[1]);
        if (!collide) {
            assert_true(a.block_hashes[0] != plain.block_hashes[0]);
            assert_true(a.block_hashes[0] == tdm_kv_block_hash(r1, t, 4));
            assert_true(a.block_hashes[1] == tdm_kv_block_hash(a.block_hashes[0], t + 4, 4));
        }
        assert_consistent(kv);
        tdm_kv_seq_release(kv, &a2);
        assert_true(a2.root_hash == r1);
        assert_int_equal(tdm_kv_match_prefix(kv, &a2, t, 9), 8);
        struct tdm_kv_seq *all[] = {&plain, &a, &b, &a2, &b2};
        for (int i = 0; i < 5; i++)
            tdm_kv_seq_release(kv, all[i]);
        assert_consistent(kv);
        tdm_kv_free(kv);
    }
}

// ---- export / import -----------------------------------------------------------------------

static void fill_pool(struct tdm_kv_cache *kv, uint32_t seed)
{
    const struct tdm_kv_config *c = tdm_kv_config(kv);
    size_t nf = (size_t)c->num_kv_heads * (size_t)c->block_size * (size_t)c->head_dim;
    rng_state = seed;
    for (int l = 0; l < c->num_layers; l++)
        for (int b = 0; b < c->num_blocks; b++)
            for (size_t i = 0; i < nf; i++) {
                tdm_kv_k(kv, l, b)[i] = (float)rnd(100000) / 7.0f;
                tdm_kv_v(kv, l, b)[i] = -(float)rnd(100000) / 3.0f;
            }
}

static void test_export_import(void **state)
{
    int bs = (int)(intptr_t)*state;
    int L = 3, H = 2, D = 8;
    struct tdm_kv_cache *src = make_cache(L, H, D, bs, 12, true);
    struct tdm_kv_cache *dst = make_cache(L, H, D, bs, 12, true);
    fill_pool(src, 77);
    int ntok = 3 * bs - (bs > 1 ? 1 : 0);
    struct tdm_kv_seq s, pad, d;
    tdm_kv_seq_init(&pad);
    assert_int_equal(tdm_kv_reserve(src, &pad, 2 * bs), TDM_OK); // so block ids differ
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_reserve(src, &s, ntok), TDM_OK);
    assert_int_equal(s.num_blocks, 3);
    tdm_kv_seq_init(&d);
    assert_int_equal(tdm_kv_reserve(dst, &d, ntok), TDM_OK);
    assert_int_not_equal(d.block_table[0], s.block_table[0]);

    size_t lb = tdm_kv_layer_bytes(src, 3);
    size_t bb = (size_t)H * (size_t)bs * (size_t)D * sizeof(float);
    assert_int_equal(lb, 2 * 3 * bb);
    assert_int_equal(tdm_kv_layer_bytes(src, 0), 0);
    unsigned char *buf = malloc(lb);
    assert_non_null(buf);
    for (int l = 0; l < L; l++) {
        assert_int_equal(tdm_kv_export_layer(src, &s, l, 0, 3, buf, lb), TDM_OK);
        // Layout: K of the 3 blocks, then V of the 3 blocks.
        assert_memory_equal(buf + bb, tdm_kv_k(src, l, s.block_table[1]), bb);
        assert_memory_equal(buf + 3 * bb, tdm_kv_v(src, l, s.block_table[0]), bb);
        assert_int_equal(tdm_kv_import_layer(dst, &d, l, 0, 3, buf, lb), TDM_OK);
    }
    for (int l = 0; l < L; l++)
        for (int i = 0; i < 3; i++) {
            assert_memory_equal(tdm_kv_k(dst, l, d.block_table[i]),
                                tdm_kv_k(src, l, s.block_table[i]), bb);
            assert_memory_equal(tdm_kv_v(dst, l, d.block_table[i]),
                                tdm_kv_v(src, l, s.block_table[i]), bb);
        }
    // A sub-range, into a different cache state.
    fill_pool(src, 78);
    size_t lb2 = tdm_kv_layer_bytes(src, 2);
    assert_int_equal(tdm_kv_export_layer(src, &s, 2, 1, 2, buf, lb2), TDM_OK);
    assert_int_equal(tdm_kv_import_layer(dst, &d, 2, 1, 2, buf, lb2), TDM_OK);
    assert_memory_equal(tdm_kv_k(dst, 2, d.block_table[2]), tdm_kv_k(src, 2, s.block_table[2]), bb);
    assert_memory_equal(tdm_kv_v(dst, 2, d.block_table[1]), tdm_kv_v(src, 2, s.block_table[1]), bb);
    assert_memory_not_equal(tdm_kv_k(dst, 2, d.block_table[0]), tdm_kv_k(src, 2, s.block_table[0]),
                            bb);
    // Zero blocks is a valid, empty transfer.
    assert_int_equal(tdm_kv_export_layer(src, &s, 0, 3, 0, NULL, 0), TDM_OK);

    // Bad ranges and lengths.
    int bad[][3] = {{-1, 0, 3}, {3, 0, 3}, {0, -1, 3}, {0, 0, 4}, {0, 1, 3}, {0, 3, 1}, {0, 0, -1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        size_t len = bad[i][2] >= 0 ? tdm_kv_layer_bytes(src, bad[i][2]) : 0;
        assert_int_equal(tdm_kv_export_layer(src, &s, bad[i][0], bad[i][1], bad[i][2], buf, len),
                         TDM_EINVAL);
        assert_int_equal(tdm_kv_import_layer(dst, &d, bad[i][0], bad[i][1], bad[i][2], buf, len),
                         TDM_EINVAL);
    }
    assert_int_equal(tdm_kv_export_layer(src, &s, 0, 0, 3, buf, lb - 1), TDM_EINVAL);
    assert_non_null(strstr(tdm_kv_errmsg(src), "bytes"));
    assert_int_equal(tdm_kv_import_layer(dst, &d, 0, 0, 3, buf, lb + 1), TDM_EINVAL);
    assert_int_equal(tdm_kv_import_layer(dst, &d, 0, 0, 3, NULL, lb), TDM_EINVAL);
    assert_int_equal(tdm_kv_export_layer(src, NULL, 0, 0, 3, buf, lb), TDM_EINVAL);
    assert_int_equal(tdm_kv_export_layer(NULL, &s, 0, 0, 3, buf, lb), TDM_EINVAL);

    // Import never writes into a block the prefix cache or another seq holds.
    int32_t toks[128];
    seq_tokens(toks, 128, 5);
    tdm_kv_commit(dst, &d, toks, ntok);
    struct tdm_kv_seq e;
    tdm_kv_seq_init(&e);
    assert_int_equal(tdm_kv_match_prefix(dst, &e, toks, ntok), 2 * bs);
    assert_int_equal(tdm_kv_reserve(dst, &e, ntok), TDM_OK);
    size_t lb1 = tdm_kv_layer_bytes(dst, 1);
    assert_int_equal(tdm_kv_import_layer(dst, &e, 0, 0, 1, buf, lb1), TDM_EINVAL);
    assert_non_null(strstr(tdm_kv_errmsg(dst), "prefix-cached"));
    assert_int_equal(tdm_kv_import_layer(dst, &e, 0, 2, 1, buf, lb1), TDM_OK);
    tdm_kv_seq_release(dst, &e);
    assert_consistent(dst);
    assert_consistent(src);

    free(buf);
    tdm_kv_seq_release(src, &s);
    tdm_kv_seq_release(src, &pad);
    tdm_kv_seq_release(dst, &d);
    tdm_kv_free(src);
    tdm_kv_free(dst);
}

static void test_header(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(4, 2, 64, 16, 8, true);
    struct tdm_kv_header h, x;
    char err[256];
    assert_int_equal(sizeof h, 96);
    tdm_kv_header_fill(kv, "Qwen/Qwen2.5-0.5B-Instruct", &h);
    assert_int_equal(h.magic, TDM_KV_MAGIC);
    assert_int_equal(h.version, 1);
    assert_string_equal(h.model, "Qwen/Qwen2.5-0.5B-Instruct");
    assert_int_equal(h.num_layers, 4);
    assert_int_equal(h.head_dim, 64);
    assert_int_equal(h.dtype, 0);
    h.num_tokens = 40;
    h.first_block = 0;
    h.num_blocks = 3;
    // Through bytes, as a transport would send it.
    unsigned char wire[96];
    memcpy(wire, &h, sizeof wire);
    memcpy(&x, wire, sizeof x);
    assert_int_equal(tdm_kv_header_check(kv, "Qwen/Qwen2.5-0.5B-Instruct", &x, err, sizeof err),
                     TDM_OK);
    assert_memory_equal(wire, "TKV1", 4); // magic reads "TKV1" little-endian

    struct {
        size_t off;
        int32_t value;
        const char *msg;
    } cases[] = {
        {offsetof(struct tdm_kv_header, magic), 0x12345678, "magic"},
        {offsetof(struct tdm_kv_header, version), 2, "version 2 != 1"},
        {offsetof(struct tdm_kv_header, num_layers), 5, "num_layers 5 != 4"},
        {offsetof(struct tdm_kv_header, num_kv_heads), 1, "num_kv_heads 1 != 2"},
        {offsetof(struct tdm_kv_header, head_dim), 128, "head_dim 128 != 64"},
        {offsetof(struct tdm_kv_header, block_size), 32, "block_size 32 != 16"},
        {offsetof(struct tdm_kv_header, dtype), 7, "dtype 7 is not"},
        {offsetof(struct tdm_kv_header, num_tokens), -1, "negative"},
        {offsetof(struct tdm_kv_header, first_block), -2, "negative"},
        {offsetof(struct tdm_kv_header, num_blocks), -3, "negative"},
        {offsetof(struct tdm_kv_header, num_blocks), 9, "exceed"},
        {offsetof(struct tdm_kv_header, num_tokens), 49, "num_tokens 49"},
        {offsetof(struct tdm_kv_header, reserved), 1, "reserved"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        x = h;
        memcpy((char *)&x + cases[i].off, &cases[i].value, sizeof(int32_t));
        err[0] = 0;
        assert_int_equal(tdm_kv_header_check(kv, "Qwen/Qwen2.5-0.5B-Instruct", &x, err, sizeof err),
                         TDM_EPROTO);
        if (!strstr(err, cases[i].msg))
            fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err, cases[i].msg);
    }
    assert_int_equal(tdm_kv_header_check(kv, "other-model", &h, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "model"));
    x = h;
    memset(x.model, 'a', sizeof x.model);
    assert_int_equal(tdm_kv_header_check(kv, "Qwen/Qwen2.5-0.5B-Instruct", &x, err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "NUL"));
    // Long names are truncated the same way on both sides.
    char longname[80];
    memset(longname, 'm', sizeof longname - 1);
    longname[79] = 0;
    tdm_kv_header_fill(kv, longname, &x);
    assert_int_equal(tdm_kv_header_check(kv, longname, &x, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kv_header_check(NULL, "m", &x, err, sizeof err), TDM_EINVAL);
    // A peer of the other known dtype is fine (import converts).
    x = h;
    x.dtype = TDM_KV_BF16;
    assert_int_equal(tdm_kv_header_check(kv, "Qwen/Qwen2.5-0.5B-Instruct", &x, err, sizeof err),
                     TDM_OK);
    tdm_kv_free(kv);
}

// ---- bf16 pools -------------------------------------------------------------------------

static struct tdm_kv_cache *make_cache_dt(int layers, int heads, int head_dim, int bs,
                                          int nblocks, enum tdm_kv_dtype dt)
{
    struct tdm_kv_config cfg = {.num_layers = layers,
                                .num_kv_heads = heads,
                                .head_dim = head_dim,
                                .block_size = bs,
                                .num_blocks = nblocks,
                                .enable_prefix_caching = true,
                                .dtype = dt};
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    if (tdm_kv_new(&kv, &cfg, err, sizeof err) != TDM_OK)
        fail_msg("tdm_kv_new: %s", err);
    return kv;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void test_dtype_parse_convert(void **state)
{
    (void)state;
    enum tdm_kv_dtype d = TDM_KV_F32;
    char err[256];
    assert_int_equal(tdm_kv_dtype_parse("auto", &d, err, sizeof err), TDM_OK);
    assert_int_equal(d, TDM_KV_BF16);
    assert_int_equal(tdm_kv_dtype_parse("f32", &d, err, sizeof err), TDM_OK);
    assert_int_equal(d, TDM_KV_F32);
    assert_int_equal(tdm_kv_dtype_parse("bfloat16", &d, err, sizeof err), TDM_OK);
    assert_int_equal(d, TDM_KV_BF16);
    assert_int_equal(tdm_kv_dtype_parse("float32", &d, err, sizeof err), TDM_OK);
    assert_int_equal(d, TDM_KV_F32);
    assert_int_equal(tdm_kv_dtype_parse("fp8", &d, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "expected auto (bf16), bf16 or f32"));
    assert_int_equal(tdm_kv_dtype_parse(NULL, &d, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_kv_dtype_size(TDM_KV_F32), 4);
    assert_int_equal(tdm_kv_dtype_size(TDM_KV_BF16), 2);
    assert_int_equal(tdm_kv_dtype_size(2), 0);
    assert_string_equal(tdm_kv_dtype_name(TDM_KV_BF16), "bf16");

    // Round to nearest even: 1 + 2^-8 is the tie between 1 and 1 + 2^-7 (-> 1,
    // even); 1 + 3 * 2^-8 the tie between 1 + 2^-7 and 1 + 2^-6 (-> 1 + 2^-6);
    // just above a tie rounds up; inf stays inf; a NaN stays a NaN.
    float in[7] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, -2.5f,
                   bits_f32(0x7f800000u), bits_f32(0x7fc00001u), 0.0f};
    uint16_t out[7];
    tdm_kv_convert(out, TDM_KV_BF16, in, TDM_KV_F32, 7);
    assert_int_equal(out[0], 0x3f80);
    assert_int_equal(out[1], 0x3f82);
    assert_int_equal(out[2], 0x3f81);
    assert_int_equal(out[3], 0xc020);
    assert_int_equal(out[4], 0x7f80);
    assert_true((out[5] & 0x7f80) == 0x7f80 && (out[5] & 0x007f) != 0);
    assert_int_equal(out[6], 0);
    float back[7];
    tdm_kv_convert(back, TDM_KV_F32, out, TDM_KV_BF16, 7);
    assert_true(back[0] == 1.0f && back[1] == 1.0f + 0x1p-6f && back[3] == -2.5f);
    uint16_t same[7];
    tdm_kv_convert(same, TDM_KV_BF16, out, TDM_KV_BF16, 7);
    assert_memory_equal(same, out, sizeof out);
    // At odd byte offsets both ways (a KvData frame's payload): the same bits.
    // Under UBSan (the sanitizer build) a misaligned access aborts here.
    unsigned char odd_out[1 + sizeof out], odd_in[1 + sizeof in], odd_back[1 + sizeof back];
    memcpy(odd_in + 1, in, sizeof in);
    tdm_kv_convert(odd_out + 1, TDM_KV_BF16, odd_in + 1, TDM_KV_F32, 7);
    assert_memory_equal(odd_out + 1, out, sizeof out);
    tdm_kv_convert(odd_back + 1, TDM_KV_F32, odd_out + 1, TDM_KV_BF16, 7);
    assert_memory_equal(odd_back + 1, back, sizeof back);

    // Config: an unknown dtype is refused; bf16 halves the block.
    struct tdm_kv_config cfg = {.num_layers = 2,
                                .num_kv_heads = 2,
                                .head_dim = 8,
                                .block_size = 16,
                                .num_blocks = 4};
    size_t f32_bytes = tdm_kv_block_bytes(&cfg);
    cfg.dtype = TDM_KV_BF16;
    assert_int_equal(tdm_kv_block_bytes(&cfg) * 2, f32_bytes);
    cfg.dtype = (enum tdm_kv_dtype)5;
    assert_int_equal(tdm_kv_block_bytes(&cfg), 0);
    struct tdm_kv_cache *kv;
    assert_int_equal(tdm_kv_new(&kv, &cfg, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "dtype=5"));
}

static void test_bf16_pool(void **state)
{
    (void)state;
    int L = 2, H = 2, D = 8, bs = 4;
    struct tdm_kv_cache *b = make_cache_dt(L, H, D, bs, 8, TDM_KV_BF16);
    struct tdm_kv_cache *f = make_cache_dt(L, H, D, bs, 8, TDM_KV_F32);
    assert_int_equal(tdm_kv_dtype(b), TDM_KV_BF16);
    assert_null(tdm_kv_k(b, 0, 0)); // not f32
    assert_null(tdm_kv_k_bf16(f, 0, 0));
    assert_null(tdm_kv_v_bf16(b, 0, 8));
    uint16_t *k0 = tdm_kv_k_bf16(b, 1, 2);
    assert_non_null(k0);
    assert_ptr_equal(tdm_kv_k_bf16(b, 1, 3), k0 + H * bs * D);
    assert_int_equal((uintptr_t)tdm_kv_v_bf16(b, 0, 0) % 64, 0);
    size_t bf = (size_t)H * bs * D;
    assert_int_equal(tdm_kv_layer_bytes(b, 2), 2 * 2 * bf * 2);
    assert_int_equal(tdm_kv_layer_bytes(f, 2), 2 * tdm_kv_layer_bytes(b, 2));
    assert_int_equal(tdm_kv_layer_bytes_as(f, 2, TDM_KV_BF16), tdm_kv_layer_bytes(b, 2));
    assert_int_equal(tdm_kv_layer_bytes_as(f, 2, 9), 0);

    struct tdm_kv_seq sf, sb;
    tdm_kv_seq_init(&sf);
    tdm_kv_seq_init(&sb);
    assert_int_equal(tdm_kv_reserve(f, &sf, 2 * bs), TDM_OK);
    assert_int_equal(tdm_kv_reserve(b, &sb, 2 * bs), TDM_OK);
    rng_state = 5;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < 2; i++)
            for (size_t e = 0; e < bf; e++) {
                tdm_kv_k(f, l, sf.block_table[i])[e] = (float)rnd(100000) / 7.0f - 5000.0f;
                tdm_kv_v(f, l, sf.block_table[i])[e] = -(float)rnd(100000) / 3.0f;
            }
    // f32 -> bf16 peer: a bf16 payload (exported with conversion, half the
    // bytes), imported as it is; equals rounding every element.
    size_t lbb = tdm_kv_layer_bytes(b, 2), lbf = tdm_kv_layer_bytes(f, 2);
    uint8_t *pb = malloc(lbb), *pf = malloc(lbf), *pf2 = malloc(lbf);
    assert_non_null(pb);
    assert_non_null(pf);
    assert_non_null(pf2);
    for (int l = 0; l < L; l++) {
        assert_int_equal(tdm_kv_export_layer_as(f, &sf, l, 0, 2, TDM_KV_BF16, pb, lbb), TDM_OK);
        assert_int_equal(tdm_kv_import_layer(b, &sb, l, 0, 2, pb, lbb), TDM_OK);
        for (int i = 0; i < 2; i++)
            for (size_t e = 0; e < bf; e++) {
                assert_int_equal(tdm_kv_k_bf16(b, l, sb.block_table[i])[e],
                                 f32_to_bf16_ref(tdm_kv_k(f, l, sf.block_table[i])[e]));
                assert_int_equal(tdm_kv_v_bf16(b, l, sb.block_table[i])[e],
                                 f32_to_bf16_ref(tdm_kv_v(f, l, sf.block_table[i])[e]));
            }
        // The same through an f32 payload converted on import.
        assert_int_equal(tdm_kv_export_layer(f, &sf, l, 0, 2, pf, lbf), TDM_OK);
        uint8_t *pb2 = malloc(lbb);
        assert_non_null(pb2);
        assert_int_equal(tdm_kv_export_layer(b, &sb, l, 0, 2, pb2, lbb), TDM_OK);
        assert_memory_equal(pb2, pb, lbb);
        assert_int_equal(tdm_kv_import_layer_as(b, &sb, l, 0, 2, TDM_KV_F32, pf, lbf), TDM_OK);
        assert_int_equal(tdm_kv_export_layer(b, &sb, l, 0, 2, pb2, lbb), TDM_OK);
        assert_memory_equal(pb2, pb, lbb);
        free(pb2);
        // bf16 -> f32 peer: widened exactly, either way.
        assert_int_equal(tdm_kv_export_layer_as(b, &sb, l, 0, 2, TDM_KV_F32, pf2, lbf), TDM_OK);
        assert_int_equal(tdm_kv_import_layer_as(f, &sf, l, 0, 2, TDM_KV_BF16, pb, lbb), TDM_OK);
        assert_int_equal(tdm_kv_export_layer(f, &sf, l, 0, 2, pf, lbf), TDM_OK);
        assert_memory_equal(pf, pf2, lbf);
        for (size_t e = 0; e < 4 * bf; e++)
            assert_true(((const float *)pf)[e] == bf16_to_f32_ref(((const uint16_t *)pb)[e]));
        // The off-thread copy reads the same bytes.
        assert_int_equal(tdm_kv_read_blocks(b, l, sb.block_table, 2, TDM_KV_F32, pf), TDM_OK);
        assert_memory_equal(pf, pf2, lbf);
    }
    // Payload length and dtype are checked against each other.
    assert_int_equal(tdm_kv_import_layer_as(b, &sb, 0, 0, 2, TDM_KV_F32, pb, lbb), TDM_EINVAL);
    assert_non_null(strstr(tdm_kv_errmsg(b), "bytes"));
    assert_int_equal(tdm_kv_export_layer_as(b, &sb, 0, 0, 2, 3, pb, lbb), TDM_EINVAL);
    assert_non_null(strstr(tdm_kv_errmsg(b), "dtype 3"));
    assert_int_equal(tdm_kv_read_blocks(b, 0, sb.block_table, 2, 3, pf), TDM_EINVAL);
    int badblk = 8;
    assert_int_equal(tdm_kv_read_blocks(b, 0, &badblk, 1, TDM_KV_BF16, pb), TDM_EINVAL);

    // The block hash does not depend on the dtype: same tokens, same hashes.
    int32_t toks[8];
    seq_tokens(toks, 8, 3);
    tdm_kv_commit(f, &sf, toks, 8);
    tdm_kv_commit(b, &sb, toks, 8);
    assert_int_equal(sf.block_hashes[0], sb.block_hashes[0]);
    assert_int_equal(sf.block_hashes[1], sb.block_hashes[1]);
    assert_int_equal(sb.block_hashes[1], tdm_kv_block_hash(sb.block_hashes[0], toks + bs, bs));
    struct tdm_kv_header h;
    tdm_kv_header_fill(b, "m", &h);
    assert_int_equal(h.dtype, TDM_KV_BF16);
    free(pb);
    free(pf);
    free(pf2);
    tdm_kv_seq_release(f, &sf);
    tdm_kv_seq_release(b, &sb);
    assert_consistent(b);
    tdm_kv_free(f);
    tdm_kv_free(b);
}

// ---- the block hash's known values ------------------------------------------------------
// The router's prefix index and the KV events key blocks by tdm_kv_block_hash, so
// it must not change by accident: these values pin it (a deliberate change
// updates them, the router and every worker together).
static void test_block_hash_known_values(void **state)
{
    (void)state;
    int32_t t16[16];
    for (int i = 0; i < 16; i++)
        t16[i] = i * 7 + 1;
    const int32_t t3[3] = {151643, -1, 42};
    uint64_t first = tdm_kv_block_hash(0, t16, 16);
    assert_true(first == 0xf25906ab80cb1f67ull);
    assert_true(tdm_kv_block_hash(first, t16, 16) == 0x0147fdca1d4f4601ull); // chained
    assert_true(tdm_kv_block_hash(0, t3, 3) == 0x32a7433a3144bfd9ull);       // odd tail
    assert_true(tdm_kv_block_hash(0, t3, 0) == 0xf490368aba8bfeacull);       // empty
}

// ---- KV events ----------------------------------------------------------------------------

// Commit records STORED for exactly the newly full blocks (chained hashes as in
// the seq), eviction on reuse and reset record EVICTED, and a full ring is
// flagged as overflow with only the later events kept.
static void test_kv_events(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 4, 4, 4, true);
    struct tdm_kv_event ev[16];
    bool ovf = true;
    assert_int_equal(tdm_kv_events_take(kv, ev, 16, &ovf), 0); // off
    assert_false(ovf);
    assert_int_equal(tdm_kv_events_enable(kv, -1), TDM_EINVAL);
    assert_int_equal(tdm_kv_events_enable(kv, 8), TDM_OK);

    int32_t t[16];
    seq_tokens(t, 10, 100); // 2 full blocks + 2 tokens
    struct tdm_kv_seq a;
    assert_int_equal(admit(kv, &a, t, 10, false), TDM_OK);
    assert_int_equal(tdm_kv_events_pending(kv), 2);
    int n = tdm_kv_events_take(kv, ev, 16, &ovf);
    assert_int_equal(n, 2);
    assert_false(ovf);
    assert_int_equal(ev[0].kind, TDM_KV_EVENT_STORED);
    assert_true(ev[0].hash == a.block_hashes[0]);
    assert_true(ev[0].hash == tdm_kv_block_hash(0, t, 4));
    assert_int_equal(ev[1].kind, TDM_KV_EVENT_STORED);
    assert_true(ev[1].hash == tdm_kv_block_hash(ev[0].hash, t + 4, 4));
    uint64_t h0 = ev[0].hash, h1 = ev[1].hash;
    // Committing the partial block again adds nothing; filling it stores one more.
    tdm_kv_commit(kv, &a, t, 10);
    assert_int_equal(tdm_kv_events_pending(kv), 0);
    tdm_kv_seq_release(kv, &a); // blocks stay cached: no event
    assert_int_equal(tdm_kv_events_pending(kv), 0);

    // A 16-token prompt needs all 4 blocks: both cached blocks are evicted (LRU).
    seq_tokens(t, 16, 500);
    struct tdm_kv_seq b;
    assert_int_equal(admit(kv, &b, t, 16, false), TDM_OK);
    n = tdm_kv_events_take(kv, ev, 16, &ovf);
    assert_false(ovf);
    int ev_h0 = 0, ev_h1 = 0, stored = 0;
    for (int i = 0; i < n; i++) {
        if (ev[i].kind == TDM_KV_EVENT_EVICTED) {
            ev_h0 += ev[i].hash == h0;
            ev_h1 += ev[i].hash == h1;
        } else {
            stored++;
        }
    }
    assert_int_equal(ev_h0, 1);
    assert_int_equal(ev_h1, 1);
    assert_int_equal(stored, 4);
    assert_int_equal(n, 6);
    tdm_kv_seq_release(kv, &b);
    tdm_kv_reset_prefix_cache(kv); // 4 cached blocks leave the map
    n = tdm_kv_events_take(kv, ev, 2, &ovf); // partial take
    assert_int_equal(n, 2);
    assert_int_equal(tdm_kv_events_pending(kv), 2);
    n = tdm_kv_events_take(kv, ev + 2, 16, &ovf);
    assert_int_equal(n, 2);
    for (int i = 0; i < 4; i++)
        assert_int_equal(ev[i].kind, TDM_KV_EVENT_EVICTED);

    // Overflow: 8 stored + 8 evicted > capacity 8 without a take.
    for (int r = 0; r < 2; r++) {
        seq_tokens(t, 16, 1000 + 100 * r);
        assert_int_equal(admit(kv, &b, t, 16, false), TDM_OK);
        tdm_kv_seq_release(kv, &b);
    }
    tdm_kv_reset_prefix_cache(kv);
    n = tdm_kv_events_take(kv, ev, 16, &ovf);
    assert_true(ovf);
    assert_true(n > 0 && n <= 8);
    assert_int_equal(ev[n - 1].kind, TDM_KV_EVENT_EVICTED); // the latest events survive
    assert_int_equal(tdm_kv_events_take(kv, ev, 16, &ovf), 0);
    assert_false(ovf); // reported once
    assert_consistent(kv);
    assert_int_equal(tdm_kv_events_enable(kv, 0), TDM_OK);
    assert_int_equal(tdm_kv_events_pending(kv), 0);
    tdm_kv_free(kv);
}

// ---- storage interface -------------------------------------------------------------------
// A storage that records what the cache asks of it, over a plain array: the
// cache must route export/import through export_blocks/import_blocks with the
// sequence's block ids, free it once, leave tdm_kv_k NULL (not host f32), and
// not take it when creation fails.
struct fake_storage {
    struct tdm_kv_storage base;
    float *pool; // [layers][num_blocks][block_floats], K and V alike (tests only)
    size_t block_floats;
    int num_blocks;
    int exports, imports, last_layer, last_blocks[4];
    int marks, waits, last_mark, last_wait;
    int *frees;
};

static void fake_free(struct tdm_kv_storage *st)
{
    struct fake_storage *f = (struct fake_storage *)st;
    (*f->frees)++;
    free(f->pool);
    free(f);
}

static void *fake_layer(struct tdm_kv_storage *st, int layer)
{
    struct fake_storage *f = (struct fake_storage *)st;
    return f->pool + (size_t)layer * f->num_blocks * f->block_floats;
}

static int fake_export(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                       float *k_out, float *v_out)
{
    struct fake_storage *f = (struct fake_storage *)st;
    f->exports++;
    f->last_layer = layer;
    for (int i = 0; i < nblocks; i++) {
        f->last_blocks[i % 4] = blocks[i];
        const float *b = (float *)fake_layer(st, layer) + (size_t)blocks[i] * f->block_floats;
        memcpy(k_out + (size_t)i * f->block_floats, b, f->block_floats * sizeof(float));
        for (size_t j = 0; j < f->block_floats; j++)
            v_out[(size_t)i * f->block_floats + j] = -b[j];
    }
    return layer == 2 ? TDM_EBACKEND : TDM_OK; // layer 2 plays a failed device copy
}

static int fake_import(struct tdm_kv_storage *st, int layer, const int *blocks, int nblocks,
                       const float *k_in, const float *v_in)
{
    struct fake_storage *f = (struct fake_storage *)st;
    (void)v_in;
    f->imports++;
    f->last_layer = layer;
    for (int i = 0; i < nblocks; i++) {
        f->last_blocks[i % 4] = blocks[i];
        memcpy((float *)fake_layer(st, layer) + (size_t)blocks[i] * f->block_floats,
               k_in + (size_t)i * f->block_floats, f->block_floats * sizeof(float));
    }
    return TDM_OK;
}

static int fake_mark(struct tdm_kv_storage *st, int layer)
{
    struct fake_storage *f = (struct fake_storage *)st;
    f->marks++;
    f->last_mark = layer;
    return TDM_OK;
}

static int fake_wait(struct tdm_kv_storage *st, int layer)
{
    struct fake_storage *f = (struct fake_storage *)st;
    f->waits++;
    f->last_wait = layer;
    return layer == 2 ? TDM_EBACKEND : TDM_OK;
}

static const struct tdm_kv_storage_ops fake_ops = {
    .free = fake_free,
    .layer_k = fake_layer,
    .layer_v = fake_layer,
    .export_blocks = fake_export,
    .import_blocks = fake_import,
    .mark_layer = fake_mark,
    .wait_layer = fake_wait,
};

static void test_storage_interface(void **state)
{
    (void)state;
    struct tdm_kv_config cfg = {
        .num_layers = 3, .num_kv_heads = 2, .head_dim = 4, .block_size = 4, .num_blocks = 8};
    int frees = 0;
    struct fake_storage *f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->base.ops = &fake_ops;
    f->base.host = false;
    f->base.dtype = TDM_KV_F32;
    f->block_floats = 2 * 4 * 4;
    f->num_blocks = 8;
    f->frees = &frees;
    f->pool = calloc(3 * 8 * f->block_floats, sizeof(float));
    for (size_t i = 0; i < 3 * 8 * f->block_floats; i++)
        f->pool[i] = (float)i;
    char err[256];
    struct tdm_kv_cache *kv;

    // A bad config fails without taking the storage.
    struct tdm_kv_config bad = cfg;
    bad.num_blocks = 0;
    assert_int_equal(tdm_kv_new_with_storage(&kv, &bad, &f->base, err, sizeof err), TDM_EINVAL);
    assert_int_equal(frees, 0);

    assert_int_equal(tdm_kv_new_with_storage(&kv, &cfg, &f->base, err, sizeof err), TDM_OK);
    assert_ptr_equal(tdm_kv_storage(kv), &f->base);
    assert_null(tdm_kv_k(kv, 0, 0)); // not host f32
    // Marks and waits reach the storage for layers in range, with its result.
    assert_int_equal(tdm_kv_mark_layer(kv, 1), TDM_OK);
    assert_int_equal(tdm_kv_wait_layer(kv, 1), TDM_OK);
    assert_int_equal(tdm_kv_wait_layer(kv, 2), TDM_EBACKEND);
    assert_int_equal(tdm_kv_mark_layer(kv, 3), TDM_EINVAL);
    assert_int_equal(tdm_kv_wait_layer(kv, -1), TDM_EINVAL);
    assert_int_equal(f->marks, 1);
    assert_int_equal(f->last_mark, 1);
    assert_int_equal(f->waits, 2);
    assert_int_equal(f->last_wait, 2);
    struct tdm_kv_seq pad, s;
    tdm_kv_seq_init(&pad);
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_reserve(kv, &pad, 4), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &s, 8), TDM_OK);
    size_t lb = tdm_kv_layer_bytes(kv, 2);
    float *buf = malloc(lb);
    assert_int_equal(tdm_kv_export_layer(kv, &s, 1, 0, 2, buf, lb), TDM_OK);
    assert_int_equal(f->exports, 1);
    assert_int_equal(f->last_layer, 1);
    assert_int_equal(f->last_blocks[0], s.block_table[0]);
    assert_int_equal(f->last_blocks[1], s.block_table[1]);
    // K of block 1 then V (the fake negates V) in the transfer layout.
    assert_true(buf[f->block_floats] == f->pool[(8 + (size_t)s.block_table[1]) * f->block_floats]);
    assert_true(buf[2 * f->block_floats] ==
                -f->pool[(8 + (size_t)s.block_table[0]) * f->block_floats]);
    // A storage failure is the call's error, with the detail.
    assert_int_equal(tdm_kv_export_layer(kv, &s, 2, 0, 2, buf, lb), TDM_EBACKEND);
    assert_non_null(strstr(tdm_kv_errmsg(kv), "storage failed"));
    // buf now holds layer 2's blocks (the failed export still copied): import
    // them into layer 0.
    assert_int_equal(tdm_kv_import_layer(kv, &s, 0, 0, 2, buf, lb), TDM_OK);
    assert_int_equal(f->imports, 1);
    assert_int_equal(f->last_layer, 0);
    assert_true(f->pool[(size_t)s.block_table[1] * f->block_floats] ==
                f->pool[(16 + (size_t)s.block_table[1]) * f->block_floats]);
    free(buf);
    tdm_kv_seq_release(kv, &s);
    tdm_kv_seq_release(kv, &pad);
    tdm_kv_free(kv);
    assert_int_equal(frees, 1);

    // A device storage of bf16 (its ops move f32, as the CUDA one's): the cache
    // takes the storage's dtype whatever cfg says, and its payload is bf16,
    // staged through f32 (exact for values a bf16 pool holds).
    f = calloc(1, sizeof *f);
    assert_non_null(f);
    f->base.ops = &fake_ops;
    f->base.host = false;
    f->base.dtype = TDM_KV_BF16;
    f->block_floats = 2 * 4 * 4;
    f->num_blocks = 8;
    f->frees = &frees;
    f->pool = calloc(3 * 8 * f->block_floats, sizeof(float));
    for (size_t i = 0; i < 3 * 8 * f->block_floats; i++)
        f->pool[i] = (float)(i % 97) * 0.5f; // exact in bf16 (at most 8 significant bits)
    assert_int_equal(tdm_kv_new_with_storage(&kv, &cfg, &f->base, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_kv_dtype(kv), TDM_KV_BF16);
    assert_null(tdm_kv_k_bf16(kv, 0, 0)); // not host memory
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_reserve(kv, &s, 8), TDM_OK);
    lb = tdm_kv_layer_bytes(kv, 2);
    assert_int_equal(lb, 2 * 2 * f->block_floats * 2);
    uint16_t *hb = malloc(lb);
    assert_non_null(hb);
    assert_int_equal(tdm_kv_export_layer(kv, &s, 1, 0, 2, hb, lb), TDM_OK);
    for (size_t j = 0; j < 2 * f->block_floats; j++)
        assert_true(bf16_to_f32_ref(hb[j]) ==
                    f->pool[(8 + (size_t)s.block_table[j / f->block_floats]) * f->block_floats +
                            j % f->block_floats]);
    assert_int_equal(tdm_kv_import_layer(kv, &s, 0, 0, 2, hb, lb), TDM_OK);
    assert_true(f->pool[(size_t)s.block_table[1] * f->block_floats + 3] ==
                f->pool[(8 + (size_t)s.block_table[1]) * f->block_floats + 3]);
    // read_blocks (the prefill job thread's unchecked copy) goes through the
    // storage too: the same bytes as the checked export.
    uint16_t *rb = malloc(lb);
    assert_non_null(rb);
    assert_int_equal(tdm_kv_export_layer(kv, &s, 1, 0, 2, hb, lb), TDM_OK);
    assert_int_equal(tdm_kv_read_blocks(kv, 1, s.block_table, 2, TDM_KV_BF16, rb), TDM_OK);
    assert_memory_equal(rb, hb, lb);
    assert_int_equal(tdm_kv_read_blocks(kv, 1, s.block_table, 2, 99, rb), TDM_EINVAL);
    free(rb);
    free(hb);
    tdm_kv_seq_release(kv, &s);
    tdm_kv_free(kv);
    assert_int_equal(frees, 2);
}

// tdm_kv_trim: a speculative step reserved blocks for draft tokens that were
// rejected; trimming to the accepted length frees exactly the blocks past it
// and keeps the committed ones (and their hashes) intact.
static void test_trim(void **state)
{
    (void)state;
    struct tdm_kv_cache *kv = make_cache(1, 1, 4, 4, 8, true);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    int32_t toks[16];
    for (int i = 0; i < 16; i++)
        toks[i] = i + 1;
    assert_int_equal(tdm_kv_reserve(kv, &seq, 5), TDM_OK);
    tdm_kv_commit(kv, &seq, toks, 5); // block 0 full (hashed), block 1 holds one token
    assert_int_equal(tdm_kv_reserve(kv, &seq, 14), TDM_OK); // 5 + 9 tokens of drafts: 4 blocks
    assert_int_equal(seq.num_blocks, 4);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 4);
    assert_int_equal(tdm_kv_trim(kv, &seq, 4), TDM_EINVAL); // below the committed 5
    assert_int_equal(seq.num_blocks, 4);
    assert_int_equal(tdm_kv_trim(kv, &seq, 7), TDM_OK); // two drafts accepted: 2 blocks
    assert_int_equal(seq.num_blocks, 2);
    assert_int_equal(tdm_kv_num_free_blocks(kv), 6);
    assert_true(seq.block_hashes[0] != 0);
    assert_consistent(kv);
    assert_int_equal(tdm_kv_trim(kv, &seq, 8), TDM_OK); // nothing past it: unchanged
    assert_int_equal(seq.num_blocks, 2);
    tdm_kv_commit(kv, &seq, toks, 8);
    assert_int_equal(tdm_kv_reserve(kv, &seq, 9), TDM_OK);
    assert_int_equal(seq.num_blocks, 3);
    tdm_kv_seq_release(kv, &seq);
    assert_consistent(kv);
    tdm_kv_free(kv);
}

int main(void)
{
    static const struct wl_param wl[] = {
        {.block_size = 4, .num_blocks = 60, .ops = 3000, .prefix = true},
        {.block_size = 1, .num_blocks = 240, .ops = 2000, .prefix = true},
        {.block_size = 32, .num_blocks = 14, .ops = 2000, .prefix = true},
        {.block_size = 16, .num_blocks = 20, .ops = 2000, .prefix = true},
        {.block_size = 4, .num_blocks = 60, .ops = 2000, .prefix = true, .hash = colliding_hash},
        {.block_size = 4, .num_blocks = 60, .ops = 1000, .prefix = false},
    };
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_validation),
        cmocka_unit_test(test_block_hash_known_values),
        cmocka_unit_test(test_pointers),
        cmocka_unit_test(test_accounting),
        cmocka_unit_test(test_reserve_all_or_nothing),
        cmocka_unit_test(test_usage),
        cmocka_unit_test_prestate(test_prefix_hit, (void *)(intptr_t)16),
        cmocka_unit_test_prestate(test_prefix_hit, (void *)(intptr_t)1),
        cmocka_unit_test_prestate(test_prefix_hit, (void *)(intptr_t)32),
        cmocka_unit_test_prestate(test_chained_hash, (void *)(intptr_t)16),
        cmocka_unit_test_prestate(test_chained_hash, (void *)(intptr_t)1),
        cmocka_unit_test_prestate(test_chained_hash, (void *)(intptr_t)32),
        cmocka_unit_test(test_twins),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_prefix_disabled),
        cmocka_unit_test(test_commit_bad_input),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[0]),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[1]),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[2]),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[3]),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[4]),
        cmocka_unit_test_prestate(test_random_workload, (void *)&wl[5]),
        cmocka_unit_test(test_forced_collisions),
        cmocka_unit_test(test_cache_salt),
        cmocka_unit_test_prestate(test_export_import, (void *)(intptr_t)4),
        cmocka_unit_test_prestate(test_export_import, (void *)(intptr_t)1),
        cmocka_unit_test_prestate(test_export_import, (void *)(intptr_t)32),
        cmocka_unit_test(test_header),
        cmocka_unit_test(test_kv_events),
        cmocka_unit_test(test_storage_interface),
        cmocka_unit_test(test_dtype_parse_convert),
        cmocka_unit_test(test_bf16_pool),
        cmocka_unit_test(test_trim),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
