// SPDX-License-Identifier: Apache-2.0
// grammar_constraint: a request's constraint, (enum tdm_constraint_kind, text),
// compiled by the compiler of its kind, and a small process-wide cache of the
// compiled grammars keyed by (kind, text), so that the router's validation, a
// worker's parse and every engine request of one API request (n choices) or of
// repeated requests with one schema compile once. The cache holds a reference
// to each grammar it keeps (grammars are immutable and atomically reference
// counted, so any thread may use a cached one); it is bounded in entries and
// in text bytes, evicts the least recently used entry, and never keeps a
// failed compile.
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "grammar.h"
#include "grammar_impl.h"

#define CACHE_ENTRIES 64
#define CACHE_TEXT_BYTES (16u << 20) // all cached texts together
#define CACHE_TEXT_MAX (1u << 20)    // a longer text is compiled, not cached

// choice: text is a JSON array of strings.
static int compile_choice_json(struct tdm_grammar **out, const char *text, size_t len, char *err,
                               size_t errlen)
{
    char depth_err[96];
    if (tdm_json_check_depth(text, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err))
        return tdm_seterr(err, errlen, TDM_EINVAL, "choice: %s", depth_err);
    cJSON *arr = cJSON_ParseWithLength(text, len);
    int rc = TDM_OK;
    const char **choices = NULL;
    size_t *lens = NULL;
    if (!cJSON_IsArray(arr)) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "choice: expected a list of strings");
        goto out;
    }
    size_t n = (size_t)cJSON_GetArraySize(arr);
    choices = calloc(n ? n : 1, sizeof *choices);
    lens = calloc(n ? n : 1, sizeof *lens);
    if (!choices || !lens) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "choice: out of memory");
        goto out;
    }
    size_t i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        if (!cJSON_IsString(it)) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "choice %zu: not a string", i);
            goto out;
        }
        choices[i] = it->valuestring;
        lens[i] = strlen(it->valuestring);
        i++;
    }
    rc = tdm_grammar_compile_choice(out, choices, lens, n, err, errlen);
out:
    free(choices);
    free(lens);
    cJSON_Delete(arr);
    return rc;
}

static int compile_now(struct tdm_grammar **out, enum tdm_constraint_kind kind, const char *text,
                       size_t len, char *err, size_t errlen)
{
    switch (kind) {
    case TDM_CONSTRAINT_JSON_SCHEMA:
        return gr_compile_json_schema(out, text, len, err, errlen);
    case TDM_CONSTRAINT_JSON_OBJECT:
        return gr_compile_json_object(out, err, errlen);
    case TDM_CONSTRAINT_REGEX:
        return gr_compile_regex(out, text, len, err, errlen);
    case TDM_CONSTRAINT_CHOICE:
        return compile_choice_json(out, text, len, err, errlen);
    case TDM_CONSTRAINT_GRAMMAR:
        return gr_compile_gbnf(out, text, len, err, errlen);
    default:
        return tdm_seterr(err, errlen, TDM_EINVAL, "unknown constraint kind %d", (int)kind);
    }
}

struct deep_compile {
    struct tdm_grammar **out;
    enum tdm_constraint_kind kind;
    const char *text;
    size_t len;
    char *err;
    size_t errlen;
    int rc;
};

static void compile_deep(void *arg)
{
    struct deep_compile *c = arg;
    c->rc = compile_now(c->out, c->kind, c->text, c->len, c->err, c->errlen);
    if (c->rc == TDM_OK && (c->rc = gr_start_check(*c->out, c->err, c->errlen)) != TDM_OK) {
        tdm_grammar_unref(*c->out);
        *c->out = NULL;
    }
}

// Every compile runs on a deep stack (core.h): the thread asking may be an
// HTTP worker with ~100 KiB of stack, and the compilers recurse per group or
// nesting level of the request's text.
int tdm_grammar_compile_constraint(struct tdm_grammar **out, enum tdm_constraint_kind kind,
                                   const char *text, size_t len, char *err, size_t errlen)
{
    *out = NULL;
    if (!text && kind != TDM_CONSTRAINT_JSON_OBJECT)
        return tdm_seterr(err, errlen, TDM_EINVAL, "constraint text missing");
    struct deep_compile c = {.out = out,
                             .kind = kind,
                             .text = text,
                             .len = len,
                             .err = err,
                             .errlen = errlen,
                             .rc = TDM_ENOMEM};
    if (tdm_call_deep(compile_deep, &c) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EBUSY,
                          "structured output: no thread to compile the grammar on");
    return c.rc;
}

int tdm_grammar_compile_json_schema(struct tdm_grammar **out, const char *schema, size_t len,
                                    char *err, size_t errlen)
{
    return tdm_grammar_compile_constraint(out, TDM_CONSTRAINT_JSON_SCHEMA, schema, len, err,
                                          errlen);
}

int tdm_grammar_compile_json_object(struct tdm_grammar **out, char *err, size_t errlen)
{
    return tdm_grammar_compile_constraint(out, TDM_CONSTRAINT_JSON_OBJECT, NULL, 0, err, errlen);
}

int tdm_grammar_compile_regex(struct tdm_grammar **out, const char *pattern, size_t len, char *err,
                              size_t errlen)
{
    return tdm_grammar_compile_constraint(out, TDM_CONSTRAINT_REGEX, pattern, len, err, errlen);
}

int tdm_grammar_compile_gbnf(struct tdm_grammar **out, const char *text, size_t len, char *err,
                             size_t errlen)
{
    return tdm_grammar_compile_constraint(out, TDM_CONSTRAINT_GRAMMAR, text, len, err, errlen);
}

// ---- the cache ------------------------------------------------------------------------
struct cache_entry {
    struct tdm_grammar *g; // NULL: empty slot
    enum tdm_constraint_kind kind;
    uint64_t hash;
    char *text;
    size_t len;
    uint64_t used; // LRU clock
};

static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct cache_entry cache[CACHE_ENTRIES];
static size_t cache_bytes;
static uint64_t cache_clock, cache_hits, cache_misses;

static uint64_t fnv1a(enum tdm_constraint_kind kind, const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull ^ (uint64_t)kind;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

static void entry_clear(struct cache_entry *c)
{
    tdm_grammar_unref(c->g);
    cache_bytes -= c->len;
    free(c->text);
    memset(c, 0, sizeof *c);
}

// With cache_mu held: a new reference to the cached grammar, or NULL.
static struct tdm_grammar *lookup(enum tdm_constraint_kind kind, uint64_t h, const char *text,
                                  size_t len)
{
    for (int i = 0; i < CACHE_ENTRIES; i++) {
        struct cache_entry *c = &cache[i];
        if (c->g && c->kind == kind && c->hash == h && c->len == len &&
            (len == 0 || memcmp(c->text, text, len) == 0)) {
            c->used = ++cache_clock;
            return tdm_grammar_ref(c->g);
        }
    }
    return NULL;
}

// With cache_mu held: keeps g (takes a new reference) unless it is already there.
static void insert(enum tdm_constraint_kind kind, uint64_t h, const char *text, size_t len,
                   struct tdm_grammar *g)
{
    struct tdm_grammar *have = lookup(kind, h, text, len);
    if (have) { // another thread compiled it meanwhile
        tdm_grammar_unref(have);
        return;
    }
    char *copy = malloc(len + 1);
    if (!copy)
        return;
    if (len)
        memcpy(copy, text, len);
    copy[len] = '\0';
    for (;;) {
        int free_slot = -1, lru = -1;
        for (int i = 0; i < CACHE_ENTRIES; i++) {
            if (!cache[i].g) {
                if (free_slot < 0)
                    free_slot = i;
            } else if (lru < 0 || cache[i].used < cache[lru].used) {
                lru = i;
            }
        }
        if (free_slot >= 0 && cache_bytes + len <= CACHE_TEXT_BYTES) {
            cache[free_slot] = (struct cache_entry){.g = tdm_grammar_ref(g),
                                                    .kind = kind,
                                                    .hash = h,
                                                    .text = copy,
                                                    .len = len,
                                                    .used = ++cache_clock};
            cache_bytes += len;
            return;
        }
        if (lru < 0) { // empty yet no room: cannot happen (len <= CACHE_TEXT_MAX)
            free(copy);
            return;
        }
        entry_clear(&cache[lru]);
    }
}

int tdm_grammar_compile_cached(struct tdm_grammar **out, enum tdm_constraint_kind kind,
                               const char *text, size_t len, char *err, size_t errlen)
{
    *out = NULL;
    if (kind == TDM_CONSTRAINT_JSON_OBJECT) // the text plays no part
        len = 0;
    bool cacheable = (text || len == 0) && len <= CACHE_TEXT_MAX;
    uint64_t h = 0;
    if (cacheable) {
        h = fnv1a(kind, text, len);
        pthread_mutex_lock(&cache_mu);
        *out = lookup(kind, h, text, len);
        if (*out)
            cache_hits++;
        else
            cache_misses++;
        pthread_mutex_unlock(&cache_mu);
        if (*out)
            return TDM_OK;
    }
    int rc = tdm_grammar_compile_constraint(out, kind, text, len, err, errlen);
    if (rc != TDM_OK || !cacheable)
        return rc;
    pthread_mutex_lock(&cache_mu);
    insert(kind, h, text, len, *out);
    pthread_mutex_unlock(&cache_mu);
    return TDM_OK;
}

void tdm_grammar_cache_stats(uint64_t *hits, uint64_t *misses, int *entries)
{
    pthread_mutex_lock(&cache_mu);
    if (hits)
        *hits = cache_hits;
    if (misses)
        *misses = cache_misses;
    if (entries) {
        int n = 0;
        for (int i = 0; i < CACHE_ENTRIES; i++)
            n += cache[i].g != NULL;
        *entries = n;
    }
    pthread_mutex_unlock(&cache_mu);
}

void tdm_grammar_cache_clear(void)
{
    pthread_mutex_lock(&cache_mu);
    for (int i = 0; i < CACHE_ENTRIES; i++)
        if (cache[i].g)
            entry_clear(&cache[i]);
    pthread_mutex_unlock(&cache_mu);
}
