// SPDX-License-Identifier: Apache-2.0
// grammar_mask: the vocabulary trie and the per-step token mask. The trie holds
// every ordinary token's bytes in preorder (built once per vocabulary from the
// tokens sorted by bytes); a mask walks it depth first, advancing the matcher's
// state one byte per trie edge and skipping a whole subtree as soon as no stack
// survives, so shared prefixes are matched once. Masks are cached per matcher
// state (the exact stack set, serialised), which serves every step spent inside
// a string or a repeated structure without a walk. Special tokens are never in
// the trie; EOS is allowed exactly where the state is accepting.
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"
#include "tokenizer.h"

#define MASK_CACHE_ENTRIES 32

// ---- vocabulary ---------------------------------------------------------------------
static const struct tdm_grammar_vocab *sort_vocab;

static int cmp_tokens(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    size_t la = sort_vocab->lens[a], lb = sort_vocab->lens[b];
    int c = memcmp(sort_vocab->bytes[a], sort_vocab->bytes[b], la < lb ? la : lb);
    if (c)
        return c;
    if (la != lb)
        return la < lb ? -1 : 1;
    return a < b ? -1 : a > b;
}

void tdm_grammar_vocab_free(struct tdm_grammar_vocab *v)
{
    if (!v)
        return;
    if (v->bytes)
        for (int32_t i = 0; i < v->n_tokens; i++)
            free(v->bytes[i]);
    free(v->bytes);
    free(v->lens);
    free(v->is_special);
    free(v->nodes);
    free(v->tok_ids);
    free(v);
}

static int build_trie(struct tdm_grammar_vocab *v)
{
    int32_t n = 0;
    for (int32_t i = 0; i < v->n_tokens; i++)
        if (!v->is_special[i] && v->bytes[i] && v->lens[i])
            n++;
    v->tok_ids = malloc((n ? n : 1) * sizeof *v->tok_ids);
    if (!v->tok_ids)
        return TDM_ENOMEM;
    n = 0;
    size_t total = 1;
    for (int32_t i = 0; i < v->n_tokens; i++)
        if (!v->is_special[i] && v->bytes[i] && v->lens[i]) {
            v->tok_ids[n++] = i;
            total += v->lens[i];
        }
    // qsort has no context argument in C11; the build is single-threaded per call,
    // guarded by a lock so concurrent builds stay correct.
    static pthread_mutex_t sort_lock = PTHREAD_MUTEX_INITIALIZER;
    pthread_mutex_lock(&sort_lock);
    sort_vocab = v;
    qsort(v->tok_ids, (size_t)n, sizeof *v->tok_ids, cmp_tokens);
    sort_vocab = NULL;
    pthread_mutex_unlock(&sort_lock);

    v->nodes = malloc(total * sizeof *v->nodes); // at most one node per byte + root
    int32_t *path = malloc((v->max_depth + 1) * sizeof *path);
    if (!v->nodes || !path) {
        free(path);
        return TDM_ENOMEM;
    }
    int32_t nn = 0;
    v->nodes[nn++] = (struct gr_trie_node){.byte = 0, .depth = 0, .tok_first = 0, .tok_count = 0};
    path[0] = 0;
    int depth = 0;           // nodes on path below the root
    const char *prev = NULL; // bytes of the path
    for (int32_t k = 0; k < n; k++) {
        int32_t id = v->tok_ids[k];
        const char *b = v->bytes[id];
        int len = (int)v->lens[id];
        int common = 0;
        while (common < depth && common < len && prev[common] == b[common])
            common++;
        while (depth > common) { // close the nodes that leave the path
            v->nodes[path[depth]].skip = nn;
            depth--;
        }
        while (depth < len) {
            struct gr_trie_node *t = &v->nodes[nn];
            t->byte = (uint8_t)b[depth];
            t->depth = (uint16_t)(depth + 1);
            t->tok_first = k;
            t->tok_count = 0;
            path[++depth] = nn++;
        }
        struct gr_trie_node *end = &v->nodes[path[depth]];
        if (end->tok_count == 0)
            end->tok_first = k;
        end->tok_count++;
        prev = b;
    }
    while (depth > 0) {
        v->nodes[path[depth]].skip = nn;
        depth--;
    }
    v->nodes[0].skip = nn;
    v->n_nodes = nn;
    free(path);
    return TDM_OK;
}

int tdm_grammar_vocab_new(struct tdm_grammar_vocab **out, int32_t n_tokens,
                          const char *const *bytes, const size_t *lens, const bool *is_special,
                          int32_t eos_id, char *err, size_t errlen)
{
    *out = NULL;
    if (n_tokens <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "grammar vocab: no tokens");
    struct tdm_grammar_vocab *v = calloc(1, sizeof *v);
    if (!v)
        goto fail_nomem;
    v->n_tokens = n_tokens;
    v->eos_id = eos_id;
    v->bytes = calloc((size_t)n_tokens, sizeof *v->bytes);
    v->lens = calloc((size_t)n_tokens, sizeof *v->lens);
    v->is_special = calloc((size_t)n_tokens, 1);
    if (!v->bytes || !v->lens || !v->is_special)
        goto fail_nomem;
    for (int32_t i = 0; i < n_tokens; i++) {
        v->is_special[i] = (is_special && is_special[i]) || !bytes[i] || i == eos_id;
        if (!bytes[i])
            continue;
        if (lens[i] > 60000) {
            tdm_grammar_vocab_free(v);
            return tdm_seterr(err, errlen, TDM_EINVAL, "grammar vocab: token %d is %zu bytes",
                              (int)i, lens[i]);
        }
        v->bytes[i] = malloc(lens[i] ? lens[i] : 1);
        if (!v->bytes[i])
            goto fail_nomem;
        memcpy(v->bytes[i], bytes[i], lens[i]);
        v->lens[i] = lens[i];
        if (!v->is_special[i] && (int)lens[i] > v->max_depth)
            v->max_depth = (int)lens[i];
    }
    if (build_trie(v))
        goto fail_nomem;
    *out = v;
    return TDM_OK;
fail_nomem:
    tdm_grammar_vocab_free(v);
    return tdm_seterr(err, errlen, TDM_ENOMEM, "grammar vocab: out of memory");
}

int tdm_grammar_vocab_from_tokenizer(struct tdm_grammar_vocab **out,
                                     const struct tdm_tokenizer *tok, int32_t eos_id, char *err,
                                     size_t errlen)
{
    int32_t n = tdm_tok_vocab_size(tok);
    if (n <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "grammar vocab: empty tokenizer");
    const char **bytes = calloc((size_t)n, sizeof *bytes);
    size_t *lens = calloc((size_t)n, sizeof *lens);
    bool *special = calloc((size_t)n, sizeof *special);
    int rc;
    if (!bytes || !lens || !special) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "grammar vocab: out of memory");
        goto out;
    }
    for (int32_t i = 0; i < n; i++) {
        bytes[i] = tdm_tok_token_bytes(tok, i, &lens[i]);
        special[i] = tdm_tok_is_special(tok, i);
    }
    rc = tdm_grammar_vocab_new(out, n, bytes, lens, special,
                               eos_id >= 0 ? eos_id : tdm_tok_eos_id(tok), err, errlen);
out:
    free(bytes);
    free(lens);
    free(special);
    return rc;
}

int32_t tdm_grammar_vocab_size(const struct tdm_grammar_vocab *v)
{
    return v->n_tokens;
}

int32_t tdm_grammar_vocab_eos_id(const struct tdm_grammar_vocab *v)
{
    return v->eos_id >= 0 && v->eos_id < v->n_tokens ? v->eos_id : -1;
}

size_t tdm_grammar_mask_words(const struct tdm_grammar_vocab *v)
{
    return ((size_t)v->n_tokens + 31) / 32;
}

// ---- mask cache -------------------------------------------------------------------------
struct gr_mask_entry {
    uint32_t *key; // [n_key]
    size_t n_key;
    uint32_t hash;
    uint32_t *mask; // [words]
};

struct gr_mask_cache {
    size_t words, next;
    struct gr_mask_entry e[MASK_CACHE_ENTRIES];
};

static uint32_t key_hash(const uint32_t *k, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ k[i]) * 16777619u;
    return h;
}

int gr_mask_cache_new(struct gr_mask_cache **out, size_t words)
{
    *out = calloc(1, sizeof **out);
    if (!*out)
        return TDM_ENOMEM;
    (*out)->words = words;
    return TDM_OK;
}

void gr_mask_cache_clear(struct gr_mask_cache *c)
{
    for (int i = 0; i < MASK_CACHE_ENTRIES; i++) {
        free(c->e[i].key);
        free(c->e[i].mask);
        memset(&c->e[i], 0, sizeof c->e[i]);
    }
}

void gr_mask_cache_free(struct gr_mask_cache *c)
{
    if (!c)
        return;
    gr_mask_cache_clear(c);
    free(c);
}

bool gr_mask_cache_get(struct gr_mask_cache *c, const uint32_t *key, size_t n, uint32_t *mask)
{
    uint32_t h = key_hash(key, n);
    for (int i = 0; i < MASK_CACHE_ENTRIES; i++) {
        struct gr_mask_entry *e = &c->e[i];
        if (e->mask && e->hash == h && e->n_key == n && !memcmp(e->key, key, n * sizeof *key)) {
            memcpy(mask, e->mask, c->words * sizeof *mask);
            return true;
        }
    }
    return false;
}

void gr_mask_cache_put(struct gr_mask_cache *c, const uint32_t *key, size_t n, const uint32_t *mask)
{
    struct gr_mask_entry *e = &c->e[c->next];
    c->next = (c->next + 1) % MASK_CACHE_ENTRIES;
    uint32_t *k = realloc(e->key, n * sizeof *k);
    if (!k)
        return;
    e->key = k;
    if (!e->mask && !(e->mask = malloc(c->words * sizeof *e->mask))) {
        e->n_key = 0;
        return;
    }
    memcpy(e->key, key, n * sizeof *key);
    memcpy(e->mask, mask, c->words * sizeof *mask);
    e->n_key = n;
    e->hash = key_hash(key, n);
}

// ---- DFA over stack sets ----------------------------------------------------------------
#define DFA_KEEP_SETS 1024 // reset before a walk once more sets than this are held
#define DFA_MAX_SETS 16384 // a walk that needs more falls back to plain advances
#define DFA_KEEP_NODES (1u << 20)

void gr_dfa_fini(struct gr_dfa *d)
{
    for (size_t i = 0; i < d->n; i++) {
        gr_set_fini(&d->sets[i]);
        free(d->keys[i]);
    }
    free(d->sets);
    free(d->keys);
    free(d->key_lens);
    free(d->trans);
    free(d->table);
    free(d->arena.nodes);
    free(d->arena.visited);
    gr_set_fini(&d->tmp);
    memset(d, 0, sizeof *d);
}

static void dfa_reset(struct gr_dfa *d)
{
    for (size_t i = 0; i < d->n; i++) {
        gr_set_fini(&d->sets[i]);
        free(d->keys[i]);
    }
    d->n = 0;
    d->arena.n = 0;
    if (d->table)
        memset(d->table, 0xff, d->table_cap * sizeof *d->table);
}

static int dfa_table_grow(struct gr_dfa *d)
{
    size_t cap = d->table_cap ? d->table_cap * 2 : 1024;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t)
        return TDM_ENOMEM;
    memset(t, 0xff, cap * sizeof *t);
    for (size_t i = 0; i < d->n; i++) {
        size_t h = key_hash(d->keys[i], d->key_lens[i]) & (cap - 1);
        while (t[h] >= 0)
            h = (h + 1) & (cap - 1);
        t[h] = (int32_t)i;
    }
    free(d->table);
    d->table = t;
    d->table_cap = cap;
    return TDM_OK;
}

// The id of the set d->tmp (its new nodes start at arena index mark), interning
// it when new. -3: too large to key, or out of memory (the caller falls back).
static int32_t dfa_intern(struct gr_dfa *d, size_t mark, uint32_t **key, size_t *key_cap)
{
    size_t n = gr_set_key(&d->arena, &d->tmp, key, key_cap);
    if (!n || d->n >= DFA_MAX_SETS)
        return -3;
    uint32_t h32 = key_hash(*key, n);
    if (d->table_cap) {
        size_t h = h32 & (d->table_cap - 1);
        for (; d->table[h] >= 0; h = (h + 1) & (d->table_cap - 1)) {
            int32_t id = d->table[h];
            if (d->key_lens[id] == n && !memcmp(d->keys[id], *key, n * sizeof **key)) {
                d->arena.n = mark; // an existing set: drop the nodes just made
                return id;
            }
        }
    }
    if ((d->n + 1) * 2 > d->table_cap && dfa_table_grow(d))
        return -3;
    if (d->n == d->cap) {
        size_t nc = d->cap ? d->cap * 2 : 64;
        struct gr_set *sets = realloc(d->sets, nc * sizeof *sets);
        if (sets)
            d->sets = sets;
        uint32_t **keys = realloc(d->keys, nc * sizeof *keys);
        if (keys)
            d->keys = keys;
        size_t *lens = realloc(d->key_lens, nc * sizeof *lens);
        if (lens)
            d->key_lens = lens;
        int32_t *trans = realloc(d->trans, nc * 256 * sizeof *trans);
        if (trans)
            d->trans = trans;
        if (!sets || !keys || !lens || !trans)
            return -3;
        d->cap = nc;
    }
    size_t id = d->n;
    memset(&d->sets[id], 0, sizeof d->sets[id]);
    d->keys[id] = malloc(n * sizeof **key);
    if (!d->keys[id] || gr_set_copy(&d->sets[id], &d->tmp)) {
        free(d->keys[id]);
        gr_set_fini(&d->sets[id]);
        return -3;
    }
    memcpy(d->keys[id], *key, n * sizeof **key);
    d->key_lens[id] = n;
    memset(&d->trans[id * 256], 0xff, 256 * sizeof *d->trans);
    d->n++;
    size_t h = h32 & (d->table_cap - 1);
    while (d->table[h] >= 0)
        h = (h + 1) & (d->table_cap - 1);
    d->table[h] = (int32_t)id;
    return (int32_t)id;
}

// The mask walk through the DFA. TDM_OK, or -3 when the DFA cannot hold the
// walk (the caller redoes it with plain advances).
static int walk_dfa(struct tdm_grammar_matcher *m, uint32_t *mask)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    struct gr_dfa *d = &m->dfa;
    if (d->n > DFA_KEEP_SETS || d->arena.n > DFA_KEEP_NODES)
        dfa_reset(d);
    // The current state, copied into the DFA's arena and interned.
    size_t mark = d->arena.n;
    if (gr_set_copy(&d->tmp, &m->cur) || gr_copy_chains(&d->arena, &m->arena, &d->tmp))
        return -3;
    int32_t root = dfa_intern(d, mark, &m->key, &m->key_cap);
    if (root < 0)
        return -3;
    m->level_id[0] = root;
    const struct gr_trie_node *nodes = v->nodes;
    for (int32_t i = 1; i < v->n_nodes;) {
        const struct gr_trie_node *t = &nodes[i];
        int32_t from = m->level_id[t->depth - 1];
        int32_t to = d->trans[(size_t)from * 256 + t->byte];
        if (to == -1) {
            mark = d->arena.n;
            if (gr_set_advance(m->g, &d->arena, &d->sets[from], t->byte, &d->tmp))
                return -3;
            if (d->tmp.n == 0 && !d->tmp.accepted) {
                d->arena.n = mark;
                to = -2;
            } else {
                to = dfa_intern(d, mark, &m->key, &m->key_cap);
                if (to < 0)
                    return -3;
            }
            d->trans[(size_t)from * 256 + t->byte] = to;
        }
        if (to == -2) {
            i = t->skip;
            continue;
        }
        for (int32_t k = 0; k < t->tok_count; k++) {
            int32_t id = v->tok_ids[t->tok_first + k];
            mask[id >> 5] |= 1u << (id & 31);
        }
        m->level_id[t->depth] = to;
        i = d->sets[to].n ? i + 1 : t->skip;
    }
    return TDM_OK;
}

// The mask walk with plain set advances (nodes above cur's, dropped after).
static int walk_plain(struct tdm_grammar_matcher *m, uint32_t *mask)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    int rc = TDM_OK;
    size_t base = m->arena.n;
    m->level_mark[1] = base;
    const struct gr_trie_node *nodes = v->nodes;
    for (int32_t i = 1; i < v->n_nodes && m->cur.n;) {
        const struct gr_trie_node *t = &nodes[i];
        int d = t->depth;
        const struct gr_set *prev = d == 1 ? &m->cur : &m->levels[d - 1];
        struct gr_set *here = &m->levels[d];
        m->arena.n = m->level_mark[d];
        rc = gr_set_advance(m->g, &m->arena, prev, t->byte, here);
        if (rc)
            break;
        m->level_mark[d + 1] = m->arena.n;
        if (here->n == 0 && !here->accepted) {
            i = t->skip;
            continue;
        }
        for (int32_t k = 0; k < t->tok_count; k++) {
            int32_t id = v->tok_ids[t->tok_first + k];
            mask[id >> 5] |= 1u << (id & 31);
        }
        i = here->n ? i + 1 : t->skip;
    }
    m->arena.n = base;
    return rc;
}

// ---- mask --------------------------------------------------------------------------------
int tdm_grammar_matcher_fill_mask(struct tdm_grammar_matcher *m, uint32_t *mask, size_t words)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    if (!v || words < tdm_grammar_mask_words(v))
        return TDM_EINVAL;
    words = tdm_grammar_mask_words(v);
    memset(mask, 0, words * sizeof *mask);
    if (m->done)
        return TDM_OK;
    size_t n_key = gr_set_key(&m->arena, &m->cur, &m->key, &m->key_cap);
    if (n_key && gr_mask_cache_get(m->cache, m->key, n_key, mask)) {
        m->hits++;
        return TDM_OK;
    }
    m->misses++;
    int rc = -3;
    if (m->cur.n && !m->no_dfa)
        rc = walk_dfa(m, mask);
    if (rc == -3) {
        memset(mask, 0, words * sizeof *mask);
        dfa_reset(&m->dfa);
        rc = walk_plain(m, mask);
    }
    if (rc)
        return rc;
    if (m->cur.accepted && v->eos_id >= 0 && v->eos_id < v->n_tokens)
        mask[v->eos_id >> 5] |= 1u << (v->eos_id & 31);
    // walk_dfa used m->key as scratch: key the cache entry again.
    n_key = gr_set_key(&m->arena, &m->cur, &m->key, &m->key_cap);
    if (n_key)
        gr_mask_cache_put(m->cache, m->key, n_key, mask);
    return TDM_OK;
}
