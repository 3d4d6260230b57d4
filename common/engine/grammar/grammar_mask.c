// SPDX-License-Identifier: Apache-2.0
// grammar_mask: the vocabulary trie and the per-step token mask. The trie holds
// every ordinary token's bytes in preorder (built once per vocabulary from the
// tokens sorted by bytes); a mask walks it depth first, advancing the matcher's
// state one byte per trie edge and skipping a whole subtree as soon as no stack
// survives, so shared prefixes are matched once. Masks are cached per matcher
// state (the exact stack set, serialised), which serves every step spent inside
// a string or a repeated structure without a walk. Special tokens are never in
// the trie; EOS is allowed exactly where the state is accepting.
#include <math.h>
#include <stdio.h>
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

static void dfa_free_set(struct gr_dfa *d, size_t i)
{
    gr_set_fini(&d->sets[i]);
    free(d->keys[i]);
    free(d->rel_mask[i]);
    free(d->rel_escapes[i]);
}

void gr_dfa_fini(struct gr_dfa *d)
{
    for (size_t i = 0; i < d->n; i++)
        dfa_free_set(d, i);
    free(d->rel_mask);
    free(d->rel_escapes);
    free(d->n_rel_escapes);
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
    for (size_t i = 0; i < d->n; i++)
        dfa_free_set(d, i);
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
        uint32_t **rm = realloc(d->rel_mask, nc * sizeof *rm);
        if (rm)
            d->rel_mask = rm;
        int32_t **re = realloc(d->rel_escapes, nc * sizeof *re);
        if (re)
            d->rel_escapes = re;
        size_t *rn = realloc(d->n_rel_escapes, nc * sizeof *rn);
        if (rn)
            d->n_rel_escapes = rn;
        if (!sets || !keys || !lens || !trans || !rm || !re || !rn)
            return -3;
        d->cap = nc;
    }
    size_t id = d->n;
    memset(&d->sets[id], 0, sizeof d->sets[id]);
    d->rel_mask[id] = NULL;
    d->rel_escapes[id] = NULL;
    d->n_rel_escapes[id] = 0;
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

// Walks trie nodes [first, end) through the DFA from set start (the state
// before node first's byte), setting mask bits. With esc, the nodes where a
// stack pops into the cut-off base are appended to *esc. TDM_OK, or -3 when
// the DFA cannot hold the walk.
static int dfa_walk(struct tdm_grammar_matcher *m, uint32_t *mask, int32_t start, int32_t first,
                    int32_t end, int32_t **esc, size_t *n_esc)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    struct gr_dfa *d = &m->dfa;
    const struct gr_trie_node *nodes = v->nodes;
    size_t cap_esc = esc ? *n_esc : 0;
    if (first >= end)
        return TDM_OK;
    m->level_id[nodes[first].depth - 1] = start;
    for (int32_t i = first; i < end;) {
        const struct gr_trie_node *t = &nodes[i];
        int32_t from = m->level_id[t->depth - 1];
        int32_t to = d->trans[(size_t)from * 256 + t->byte];
        if (to == -1) {
            size_t mark = d->arena.n;
            if (gr_set_advance(m->g, &d->arena, &d->sets[from], t->byte, &d->tmp))
                return -3;
            if (d->tmp.n == 0 && !d->tmp.accepted && !d->tmp.escaped) {
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
        if (esc && d->sets[to].escaped) {
            if (tdm_grow(esc, &cap_esc, *n_esc + 1, sizeof **esc, 64) != TDM_OK)
                return -3;
            (*esc)[(*n_esc)++] = i;
        }
        m->level_id[t->depth] = to;
        i = d->sets[to].n ? i + 1 : t->skip;
    }
    return TDM_OK;
}

// The deepest node below every top of s (a return point all stacks share), or -1.
static int32_t common_base(const struct gr_arena *a, const struct gr_set *s)
{
    if (s->n == 0 || s->n > 64 || s->accepted)
        return -1;
    for (int32_t c = a->nodes[s->tops[0]].parent; c >= 0; c = a->nodes[c].parent) {
        int32_t dc = a->nodes[c].depth;
        bool all = true;
        for (size_t i = 1; i < s->n && all; i++) {
            int32_t t = s->tops[i];
            while (t >= 0 && a->nodes[t].depth > dc)
                t = a->nodes[t].parent;
            all = t == c;
        }
        if (all)
            return c;
    }
    return -1;
}

// The mask walk through the DFA. When every stack shares a base B, the walk runs
// on the stacks cut at B (relative: its result, the tokens that stay above B,
// is kept per relative set, so every string field of a schema shares it), and
// only the subtrees after a pop into B are walked from B's continuation.
// TDM_OK, or -3 when the DFA cannot hold the walk (the caller falls back).
static int walk_dfa(struct tdm_grammar_matcher *m, uint32_t *mask)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    struct gr_dfa *d = &m->dfa;
    if (d->n > DFA_KEEP_SETS || d->arena.n > DFA_KEEP_NODES)
        dfa_reset(d);
    size_t mark = d->arena.n;
    int32_t base = common_base(&m->arena, &m->cur);
    if (base < 0) {
        if (gr_set_copy(&d->tmp, &m->cur) || gr_copy_chains(&d->arena, &m->arena, &d->tmp))
            return -3;
        int32_t root = dfa_intern(d, mark, &m->key, &m->key_cap);
        if (root < 0)
            return -3;
        return dfa_walk(m, mask, root, 1, v->n_nodes, NULL, NULL);
    }
    // The relative set: each chain copied up to (not including) base.
    const struct gr_arena *a = &m->arena;
    d->tmp.n = 0;
    d->tmp.accepted = d->tmp.escaped = false;
    d->tmp.base_depth = a->nodes[base].depth;
    d->arena.base_depth = d->tmp.base_depth;
    for (size_t i = 0; i < m->cur.n; i++) {
        int32_t path[TDM_GRAMMAR_MAX_STACK + 1];
        int np = 0;
        for (int32_t t = m->cur.tops[i]; t != base; t = a->nodes[t].parent)
            path[np++] = t;
        int32_t parent = GR_BASE;
        while (np-- > 0) {
            if (tdm_grow(&d->arena.nodes, &d->arena.cap, d->arena.n + 1, sizeof *d->arena.nodes,
                         256) != TDM_OK)
                return -3;
            const struct gr_node *src = &a->nodes[path[np]];
            struct gr_node *dst = &d->arena.nodes[d->arena.n];
            uint32_t ph = parent >= 0 ? d->arena.nodes[parent].hash : 0x9e3779b9u;
            dst->pos = src->pos;
            dst->parent = parent;
            dst->hash = (ph ^ ((uint32_t)src->pos * 0x85ebca6bu)) * 0xc2b2ae35u + 0x27d4eb2fu;
            dst->depth = src->depth;
            parent = (int32_t)d->arena.n++;
        }
        int32_t top = parent;
        if (tdm_grow(&d->tmp.tops, &d->tmp.cap, d->tmp.n + 1, sizeof *d->tmp.tops, 16) != TDM_OK)
            return -3;
        d->tmp.tops[d->tmp.n++] = top;
    }
    int32_t rel = dfa_intern(d, mark, &m->key, &m->key_cap);
    if (rel < 0)
        return -3;
    size_t words = tdm_grammar_mask_words(v);
    if (!d->rel_mask[rel]) {
        uint32_t *rm = calloc(words, sizeof *rm);
        int32_t *esc = NULL;
        size_t n_esc = 0;
        if (!rm)
            return -3;
        if (dfa_walk(m, rm, rel, 1, v->n_nodes, &esc, &n_esc)) {
            free(rm);
            free(esc);
            return -3;
        }
        d->rel_mask[rel] = rm;
        d->rel_escapes[rel] = esc;
        d->n_rel_escapes[rel] = n_esc;
    }
    memcpy(mask, d->rel_mask[rel], words * sizeof *mask);
    if (!d->n_rel_escapes[rel])
        return TDM_OK;
    // B's continuation, interned, then each subtree after a pop into B.
    mark = d->arena.n;
    int32_t b_copy = base; // becomes B's index in the DFA's arena
    struct gr_set b_only = {.tops = &b_copy, .n = 1, .cap = 1};
    if (gr_copy_chains(&d->arena, &m->arena, &b_only))
        return -3;
    if (gr_set_continue(m->g, &d->arena, b_copy, &d->tmp))
        return -3;
    if (d->tmp.n == 0 && !d->tmp.accepted)
        return TDM_OK;
    int32_t cont = dfa_intern(d, mark, &m->key, &m->key_cap);
    if (cont < 0)
        return -3;
    const int32_t *esc = d->rel_escapes[rel];
    for (size_t k = 0; k < d->n_rel_escapes[rel]; k++) {
        int32_t i = esc[k];
        if (dfa_walk(m, mask, cont, i + 1, v->nodes[i].skip, NULL, NULL))
            return -3;
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
    // One budget for the whole fill (both walks and the DFA's interning).
    uint64_t budget = m->fill_budget;
    m->arena.budget = m->dfa.arena.budget = &budget;
    int rc = -3;
    if (m->cur.n && !m->no_dfa)
        rc = walk_dfa(m, mask);
    if (rc == -3 && budget == 0)
        rc = TDM_ECAPACITY; // the DFA walk spent it: no plain walk after it
    if (rc == -3) {
        memset(mask, 0, words * sizeof *mask);
        dfa_reset(&m->dfa);
        rc = walk_plain(m, mask);
    }
    m->arena.budget = m->dfa.arena.budget = NULL;
    m->last_fill_work = m->fill_budget - budget;
    if (rc) {
        // A spent budget leaves the DFA with sets of a walk that never ended.
        dfa_reset(&m->dfa);
        return rc;
    }
    if (m->cur.accepted && v->eos_id >= 0 && v->eos_id < v->n_tokens)
        mask[v->eos_id >> 5] |= 1u << (v->eos_id & 31);
    // walk_dfa used m->key as scratch: key the cache entry again.
    n_key = gr_set_key(&m->arena, &m->cur, &m->key, &m->key_cap);
    if (n_key)
        gr_mask_cache_put(m->cache, m->key, n_key, mask);
    return TDM_OK;
}

int tdm_grammar_mask_error(int rc, char *msg, size_t msglen)
{
    if (rc == TDM_ECAPACITY) {
        snprintf(msg, msglen, "structured output: the grammar is too ambiguous at this point "
                              "(following it needs more work than one step may take)");
        return TDM_EINVAL;
    }
    snprintf(msg, msglen, "structured output: computing the token mask failed: %s",
             tdm_strerror(rc));
    return rc;
}

int tdm_grammar_accept_error(int rc, int32_t tok, char *msg, size_t msglen)
{
    if (rc == TDM_ECAPACITY)
        return tdm_grammar_mask_error(rc, msg, msglen);
    snprintf(msg, msglen, "structured output: token %d is not allowed here", (int)tok);
    return TDM_EINVAL;
}

// ---- applying a mask ----------------------------------------------------------------
void tdm_grammar_mask_apply(const uint32_t *mask, int32_t mask_tokens, float *logits,
                            int32_t n_logits, const int32_t *end_ids, int n_end, bool allow_end)
{
    float keep[TDM_GRAMMAR_MAX_END_IDS];
    if (n_end > TDM_GRAMMAR_MAX_END_IDS)
        n_end = TDM_GRAMMAR_MAX_END_IDS;
    for (int i = 0; i < n_end; i++)
        keep[i] = end_ids[i] >= 0 && end_ids[i] < n_logits ? logits[end_ids[i]] : -INFINITY;
    int32_t lim = mask != NULL ? (mask_tokens < n_logits ? mask_tokens : n_logits) : 0;
    for (int32_t w = 0; w * 32 < lim; w++) {
        uint32_t m = mask[w];
        if (m == 0xffffffffu)
            continue;
        int32_t base = w * 32;
        int32_t end = base + 32 < lim ? base + 32 : lim;
        for (int32_t v = base; v < end; v++)
            if (!(m >> (v - base) & 1u))
                logits[v] = -INFINITY;
    }
    for (int32_t v = lim; v < n_logits; v++) // ids the tokenizer lacks, or no mask
        logits[v] = -INFINITY;
    for (int i = 0; i < n_end; i++)
        if (end_ids[i] >= 0 && end_ids[i] < n_logits)
            logits[end_ids[i]] = allow_end ? keep[i] : -INFINITY;
}
