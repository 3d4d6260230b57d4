// SPDX-License-Identifier: Apache-2.0
// grammar_match: the pushdown automaton. A state is a set of stacks (node chains
// in an arena, see grammar_impl.h) plus "accepted"; one byte advances every
// stack whose top class holds it and expands the next element until each new
// stack again has a class on top (rule references push their return point, or
// nothing when they are a tail call; an alternative's end pops). This is a
// breadth-first simulation, so no regex or schema can make it backtrack.
// Bounds: a chain deeper than TDM_GRAMMAR_MAX_STACK is dropped (nesting beyond
// it is refused), a state keeps at most TDM_GRAMMAR_MAX_STACKS stacks, and
// equal stacks are merged (hash, then chain compare), so ambiguity cannot grow.
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar_impl.h"

#define EXPAND_MAX_RECURSION 20000
// Expansion steps per matcher step: a grammar whose empty paths multiply
// (nested optional loops) ends with TDM_ECAPACITY instead of running for
// ever; real schemas and regexes take a few hundred.
#define EXPAND_MAX_WORK 20000
// Distinct (reference, return chain) pairs one step may visit: the visited
// list is scanned linearly, so it is bounded too.
#define EXPAND_MAX_VISITED 1024

// ---- sets and arena ----------------------------------------------------------------
void gr_set_fini(struct gr_set *s)
{
    free(s->tops);
    memset(s, 0, sizeof *s);
}

static int set_push(struct gr_set *s, int32_t top)
{
    if (tdm_grow(&s->tops, &s->cap, s->n + 1, sizeof *s->tops, 16) != TDM_OK)
        return TDM_ENOMEM;
    s->tops[s->n++] = top;
    return TDM_OK;
}

int gr_set_copy(struct gr_set *dst, const struct gr_set *src)
{
    dst->n = 0;
    for (size_t i = 0; i < src->n; i++)
        if (set_push(dst, src->tops[i]))
            return TDM_ENOMEM;
    dst->accepted = src->accepted;
    dst->escaped = src->escaped;
    dst->base_depth = src->base_depth;
    return TDM_OK;
}

static int32_t arena_push(struct gr_arena *a, int32_t pos, int32_t parent)
{
    if (tdm_grow(&a->nodes, &a->cap, a->n + 1, sizeof *a->nodes, 256) != TDM_OK)
        return -1;
    uint32_t ph = parent >= 0 ? a->nodes[parent].hash : 0x9e3779b9u;
    struct gr_node *n = &a->nodes[a->n];
    n->pos = pos;
    n->parent = parent;
    n->hash = (ph ^ ((uint32_t)pos * 0x85ebca6bu)) * 0xc2b2ae35u + 0x27d4eb2fu;
    n->depth = parent >= 0 ? a->nodes[parent].depth + 1 : parent == GR_BASE ? a->base_depth + 1 : 1;
    return (int32_t)a->n++;
}

static bool chain_equal(const struct gr_arena *a, int32_t x, int32_t y)
{
    while (x != y) {
        if (x < 0 || y < 0)
            return false;
        const struct gr_node *nx = &a->nodes[x], *ny = &a->nodes[y];
        if (nx->pos != ny->pos || nx->hash != ny->hash)
            return false;
        x = nx->parent;
        y = ny->parent;
    }
    return true;
}

// ---- expansion ---------------------------------------------------------------------
struct expand_ctx {
    const struct tdm_grammar *g;
    struct gr_arena *a;
    struct gr_set *out;
    int32_t *visited; // pairs (ref pos, parent) expanded in this step
    size_t n_visited, cap_visited;
    size_t work; // expand calls in this step (EXPAND_MAX_WORK)
    int err;
};

// Charges units of work to the mask fill in progress, if any: false (and
// TDM_ECAPACITY) once its budget is spent.
static bool charge(struct expand_ctx *c, uint64_t units)
{
    uint64_t *b = c->a->budget;
    if (b == NULL)
        return true;
    if (*b < units) {
        *b = 0;
        c->err = TDM_ECAPACITY;
        return false;
    }
    *b -= units;
    return true;
}

static bool visited_add(struct expand_ctx *c, int32_t pos, int32_t parent)
{
    if (!charge(c, c->n_visited / 128))
        return false;
    for (size_t i = 0; i < c->n_visited; i += 2)
        if (c->visited[i] == pos && c->visited[i + 1] == parent)
            return false;
    if (c->n_visited / 2 >= EXPAND_MAX_VISITED) {
        c->err = TDM_ECAPACITY; // a grammar this ambiguous is refused, not run for ever
        return false;
    }
    if (tdm_grow(&c->visited, &c->cap_visited, c->n_visited + 2, sizeof *c->visited, 32) !=
        TDM_OK) {
        c->err = TDM_ENOMEM;
        return false;
    }
    c->visited[c->n_visited++] = pos;
    c->visited[c->n_visited++] = parent;
    return true;
}

static void add_top(struct expand_ctx *c, int32_t pos, int32_t parent)
{
    if (c->out->n >= TDM_GRAMMAR_MAX_STACKS)
        return;
    if (parent >= 0 && c->a->nodes[parent].depth >= TDM_GRAMMAR_MAX_STACK)
        return;
    if (!charge(c, c->out->n / 64))
        return;
    int32_t id = arena_push(c->a, pos, parent);
    if (id < 0) {
        c->err = TDM_ENOMEM;
        return;
    }
    uint32_t h = c->a->nodes[id].hash;
    for (size_t i = 0; i < c->out->n; i++) {
        int32_t t = c->out->tops[i];
        if (c->a->nodes[t].hash == h && chain_equal(c->a, t, id)) {
            c->a->n--; // a duplicate: drop the node just made
            return;
        }
    }
    if (set_push(c->out, id))
        c->err = TDM_ENOMEM;
}

// Continues at element pos with return chain parent until a class is on top.
static void expand(struct expand_ctx *c, int32_t pos, int32_t parent, int recursion)
{
    const struct tdm_grammar *g = c->g;
    if (recursion > EXPAND_MAX_RECURSION)
        return;
    if (++c->work > EXPAND_MAX_WORK) {
        c->err = TDM_ECAPACITY;
        return;
    }
    if (!charge(c, 1))
        return;
    for (;;) {
        if (c->err)
            return;
        const struct gr_el *el = &g->els[pos];
        if (el->kind == EL_END) {
            if (parent < 0) {
                if (parent == GR_BASE)
                    c->out->escaped = true;
                else
                    c->out->accepted = true;
                return;
            }
            const struct gr_node *p = &c->a->nodes[parent];
            pos = p->pos + 1;
            parent = p->parent;
            continue;
        }
        if (el->kind == EL_CLASS) {
            add_top(c, pos, parent);
            return;
        }
        // EL_REF: a tail call keeps parent as the return point.
        int32_t ret = parent;
        if (g->els[pos + 1].kind != EL_END) {
            if (parent >= 0 && c->a->nodes[parent].depth >= TDM_GRAMMAR_MAX_STACK)
                return;
            ret = arena_push(c->a, pos, parent);
            if (ret < 0) {
                c->err = TDM_ENOMEM;
                return;
            }
        } else if (!visited_add(c, pos, parent)) {
            return; // already expanded with this exact return chain (an ε-loop)
        }
        int32_t r = el->arg;
        for (int32_t a = g->rule_first[r]; a < g->rule_first[r + 1]; a++)
            expand(c, g->alt_start[a], ret, recursion + 1);
        return;
    }
}

static void ctx_init(struct expand_ctx *c, const struct tdm_grammar *g, struct gr_arena *a,
                     struct gr_set *out)
{
    memset(c, 0, sizeof *c);
    c->g = g;
    c->a = a;
    c->out = out;
    c->visited = a->visited;
    c->cap_visited = a->visited_cap;
    out->n = 0;
    out->accepted = false;
    out->escaped = false;
}

static int ctx_done(struct expand_ctx *c)
{
    c->a->visited = c->visited;
    c->a->visited_cap = c->cap_visited;
    return c->err;
}

int gr_set_continue(const struct tdm_grammar *g, struct gr_arena *a, int32_t base,
                    struct gr_set *out)
{
    struct expand_ctx c;
    ctx_init(&c, g, a, out);
    a->base_depth = 0;
    out->base_depth = 0;
    expand(&c, a->nodes[base].pos + 1, a->nodes[base].parent, 0);
    return ctx_done(&c);
}

int gr_set_start(const struct tdm_grammar *g, struct gr_arena *a, struct gr_set *out)
{
    struct expand_ctx c;
    ctx_init(&c, g, a, out);
    a->base_depth = 0;
    out->base_depth = 0;
    for (int32_t alt = g->rule_first[g->root]; alt < g->rule_first[g->root + 1]; alt++)
        expand(&c, g->alt_start[alt], -1, 0);
    return ctx_done(&c);
}

int gr_set_advance(const struct tdm_grammar *g, struct gr_arena *a, const struct gr_set *in,
                   uint8_t byte, struct gr_set *out)
{
    struct expand_ctx c;
    ctx_init(&c, g, a, out);
    a->base_depth = in->base_depth;
    out->base_depth = in->base_depth;
    for (size_t i = 0; i < in->n && !c.err; i++) {
        const struct gr_node *n = &a->nodes[in->tops[i]];
        if (!gr_class_has(&g->classes[g->els[n->pos].arg], byte))
            continue;
        c.n_visited = 0;
        int32_t pos = n->pos + 1, parent = n->parent;
        expand(&c, pos, parent, 0);
    }
    return ctx_done(&c);
}

size_t gr_set_key(const struct gr_arena *a, const struct gr_set *s, uint32_t **key, size_t *cap)
{
    size_t need = 2;
    for (size_t i = 0; i < s->n; i++)
        need += 1 + (size_t)a->nodes[s->tops[i]].depth;
    if (need > (1u << 16))
        return 0;
    if (need > *cap) {
        uint32_t *k = realloc(*key, need * sizeof *k);
        if (!k)
            return 0;
        *key = k;
        *cap = need;
    }
    uint32_t *k = *key;
    size_t n = 0;
    k[n++] = (uint32_t)s->accepted | (uint32_t)s->escaped << 1 | (uint32_t)s->base_depth << 2;
    k[n++] = (uint32_t)s->n;
    for (size_t i = 0; i < s->n; i++) {
        int32_t t = s->tops[i];
        k[n++] = (uint32_t)a->nodes[t].depth;
        for (; t >= 0; t = a->nodes[t].parent)
            k[n++] = (uint32_t)a->nodes[t].pos;
    }
    return n;
}

// ---- matcher -------------------------------------------------------------------------
// Appends the chains of s from src to dst, rewriting s's tops.
int gr_copy_chains(struct gr_arena *dst, const struct gr_arena *src, struct gr_set *s)
{
    int32_t *map = malloc((src->n ? src->n : 1) * sizeof *map);
    int32_t path[TDM_GRAMMAR_MAX_STACK + 1];
    if (!map)
        return TDM_ENOMEM;
    memset(map, 0xff, (src->n ? src->n : 1) * sizeof *map);
    for (size_t i = 0; i < s->n; i++) {
        int np = 0;
        for (int32_t t = s->tops[i]; t >= 0 && map[t] < 0; t = src->nodes[t].parent)
            path[np++] = t;
        while (np-- > 0) {
            int32_t old = path[np];
            int32_t par = src->nodes[old].parent;
            int32_t id = arena_push(dst, src->nodes[old].pos, par >= 0 ? map[par] : -1);
            if (id < 0) {
                free(map);
                return TDM_ENOMEM;
            }
            map[old] = id;
        }
        s->tops[i] = map[s->tops[i]];
    }
    free(map);
    return TDM_OK;
}

// Copies the chains of s from src into dst (dst emptied), rewriting s's tops.
static int compact(struct gr_arena *dst, const struct gr_arena *src, struct gr_set *s)
{
    dst->n = 0;
    return gr_copy_chains(dst, src, s);
}

int gr_start_check(const struct tdm_grammar *g, char *err, size_t errlen)
{
    struct gr_arena a = {0};
    struct gr_set s = {0};
    int rc = gr_set_start(g, &a, &s);
    gr_set_fini(&s);
    free(a.nodes);
    free(a.visited);
    if (rc == TDM_ECAPACITY)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "the grammar is too ambiguous at its start: its first position takes "
                          "more than %d expansion steps (at most %d distinct paths), as an enum "
                          "or a list of choices of about that many entries, or nested optional "
                          "groups, would",
                          EXPAND_MAX_WORK, EXPAND_MAX_VISITED);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "the grammar's start: %s", tdm_strerror(rc));
    return TDM_OK;
}

// The matcher's expansion recurses per rule reference (up to
// EXPAND_MAX_RECURSION), so its entry points run on a deep stack: the engine's
// threads are deep already (tdm_thread_create_deep: tdm_call_deep runs the
// call in place there); a request's HTTP thread, which makes the matcher at
// submit and replays a resumed stream's tokens, hands it over.
struct deep_new {
    struct tdm_grammar_matcher **out;
    struct tdm_grammar *g;
    const struct tdm_grammar_vocab *vocab;
    int rc;
};

static int matcher_new_now(struct tdm_grammar_matcher **out, struct tdm_grammar *g,
                           const struct tdm_grammar_vocab *vocab);

static void new_deep(void *arg)
{
    struct deep_new *d = arg;
    d->rc = matcher_new_now(d->out, d->g, d->vocab);
}

int tdm_grammar_matcher_new(struct tdm_grammar_matcher **out, struct tdm_grammar *g,
                            const struct tdm_grammar_vocab *vocab)
{
    *out = NULL;
    struct deep_new d = {out, g, vocab, TDM_ENOMEM};
    if (tdm_call_deep(new_deep, &d) != TDM_OK)
        return TDM_EBUSY;
    return d.rc;
}

static int matcher_new_now(struct tdm_grammar_matcher **out, struct tdm_grammar *g,
                           const struct tdm_grammar_vocab *vocab)
{
    *out = NULL;
    struct tdm_grammar_matcher *m = calloc(1, sizeof *m);
    if (!m)
        return TDM_ENOMEM;
    m->g = tdm_grammar_ref(g);
    m->vocab = vocab;
    m->fill_budget = GR_FILL_MAX_WORK;
    if (vocab) {
        size_t levels = (size_t)vocab->max_depth + 2;
        m->levels = calloc(levels, sizeof *m->levels);
        m->level_mark = calloc(levels, sizeof *m->level_mark);
        m->level_id = calloc(levels, sizeof *m->level_id);
        if (!m->levels || !m->level_mark || !m->level_id ||
            gr_mask_cache_new(&m->cache, tdm_grammar_mask_words(vocab)))
            goto fail;
    }
    int rc = gr_set_start(g, &m->arena, &m->cur);
    if (rc != TDM_OK) {
        tdm_grammar_matcher_free(m);
        return rc; // TDM_ECAPACITY: too ambiguous a start (gr_start_check refuses at compile)
    }
    *out = m;
    return TDM_OK;
fail:
    tdm_grammar_matcher_free(m);
    return TDM_ENOMEM;
}

int tdm_grammar_matcher_copy(struct tdm_grammar_matcher **out, const struct tdm_grammar_matcher *m)
{
    struct tdm_grammar_matcher *c;
    int rc = tdm_grammar_matcher_new(&c, m->g, m->vocab);
    if (rc)
        return rc;
    struct gr_set s = {0};
    if (gr_set_copy(&s, &m->cur) || compact(&c->arena, &m->arena, &s)) {
        gr_set_fini(&s);
        free(c->arena.visited);
        c->arena.visited = NULL;
        tdm_grammar_matcher_free(c);
        return TDM_ENOMEM;
    }
    gr_set_fini(&c->cur);
    c->cur = s;
    c->done = m->done;
    *out = c;
    return TDM_OK;
}

void tdm_grammar_matcher_free(struct tdm_grammar_matcher *m)
{
    if (!m)
        return;
    if (m->levels)
        for (int i = 0; i < m->vocab->max_depth + 2; i++)
            gr_set_fini(&m->levels[i]);
    free(m->levels);
    free(m->level_mark);
    free(m->level_id);
    gr_dfa_fini(&m->dfa);
    free(m->key);
    gr_mask_cache_free(m->cache);
    gr_set_fini(&m->cur);
    gr_set_fini(&m->next);
    free(m->arena.nodes);
    free(m->arena.visited);
    tdm_grammar_unref(m->g);
    free(m);
}

struct deep_accept {
    struct tdm_grammar_matcher *m;
    const char *bytes;
    size_t n;
    int rc;
};

static int accept_bytes_now(struct tdm_grammar_matcher *m, const char *bytes, size_t n);

static void accept_deep(void *arg)
{
    struct deep_accept *d = arg;
    d->rc = accept_bytes_now(d->m, d->bytes, d->n);
}

int tdm_grammar_matcher_accept_bytes(struct tdm_grammar_matcher *m, const char *bytes, size_t n)
{
    struct deep_accept d = {m, bytes, n, TDM_ENOMEM};
    if (tdm_call_deep(accept_deep, &d) != TDM_OK)
        return TDM_EBUSY;
    return d.rc;
}

static int accept_bytes_now(struct tdm_grammar_matcher *m, const char *bytes, size_t n)
{
    if (m->done)
        return n ? TDM_EINVAL : TDM_OK;
    size_t mark = m->arena.n;
    struct gr_set tmp = {0}, *in = &m->cur, *out = &m->next;
    int rc = gr_set_copy(&tmp, &m->cur);
    if (rc)
        goto out;
    in = &tmp;
    for (size_t i = 0; i < n; i++) {
        rc = gr_set_advance(m->g, &m->arena, in, (uint8_t)bytes[i], out);
        if (rc)
            goto out;
        if (out->n == 0 && !out->accepted) {
            rc = TDM_EINVAL;
            goto out;
        }
        if (i + 1 < n && out->n == 0) { // completed, yet more bytes follow
            rc = TDM_EINVAL;
            goto out;
        }
        struct gr_set *t = in;
        in = out;
        out = t;
    }
    // in holds the new state; move it into cur and drop dead nodes.
    struct gr_arena fresh = {0};
    rc = compact(&fresh, &m->arena, in);
    if (rc) {
        free(fresh.nodes);
        goto out;
    }
    free(m->arena.nodes);
    fresh.visited = m->arena.visited;
    fresh.visited_cap = m->arena.visited_cap;
    m->arena = fresh;
    rc = gr_set_copy(&m->cur, in);
    gr_set_fini(&tmp);
    return rc;
out:
    m->arena.n = mark;
    gr_set_fini(&tmp);
    return rc;
}

int tdm_grammar_matcher_accept_token(struct tdm_grammar_matcher *m, int32_t id)
{
    const struct tdm_grammar_vocab *v = m->vocab;
    if (!v || id < 0 || id >= v->n_tokens || m->done)
        return TDM_EINVAL;
    if (id == v->eos_id) {
        if (!m->cur.accepted)
            return TDM_EINVAL;
        m->done = true;
        return TDM_OK;
    }
    if (v->is_special[id] || !v->bytes[id] || v->lens[id] == 0)
        return TDM_EINVAL;
    return tdm_grammar_matcher_accept_bytes(m, v->bytes[id], v->lens[id]);
}

bool tdm_grammar_matcher_accepts_eos(const struct tdm_grammar_matcher *m)
{
    return !m->done && m->cur.accepted;
}

bool tdm_grammar_matcher_is_done(const struct tdm_grammar_matcher *m)
{
    return m->done || (m->cur.accepted && m->cur.n == 0);
}

void tdm_grammar_matcher_cache_stats(const struct tdm_grammar_matcher *m, uint64_t *hits,
                                     uint64_t *misses)
{
    *hits = m->hits;
    *misses = m->misses;
}
