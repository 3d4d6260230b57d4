// SPDX-License-Identifier: Apache-2.0
// tokenizer_encode: text -> ids in the order HF `tokenizers` applies its steps:
//   1. ill-formed UTF-8 becomes U+FFFD (our documented choice; HF takes &str);
//   2. added tokens with normalized=false are cut out of the raw text
//      (leftmost-longest, with lstrip/rstrip/single_word as AddedVocabulary);
//   3. each remaining segment is normalized (NFC for Qwen2), then added tokens
//      with normalized=true are cut out of it;
//   4. the pre-tokenizer stages split every segment (Split regex, ByteLevel
//      prefix space / GPT-2 regex); empty pieces are dropped;
//   5. every piece is BPE-merged in byte space: the initial symbols are the ids
//      of the byte-level characters of its bytes, merges are applied lowest rank
//      first (leftmost on ties) from a binary heap over a linked list of symbols;
//   6. the post-processor's ids (Llama 3 BOS) are added when asked.
// Frequent pieces hit a fixed-size word cache (no allocation; striped locks).
// Scratch buffers live in one struct per call, so encode allocates per call and
// per segment, never per word.
#include "tokenizer_impl.h"

#include "core.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

// ---- UTF-8 ------------------------------------------------------------------------------

enum tok_utf8 tok_utf8_scan(const uint8_t *s, size_t n, size_t *adv)
{
    uint8_t c = s[0];
    if (c < 0x80) {
        *adv = 1;
        return TOK_UTF8_VALID;
    }
    size_t need;
    uint8_t lo = 0x80, hi = 0xbf; // allowed range of the second byte (Unicode Table 3-7)
    if (c >= 0xc2 && c <= 0xdf)
        need = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        need = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        need = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else {
        *adv = 1;
        return TOK_UTF8_INVALID;
    }
    for (size_t k = 1; k < need; k++) {
        if (k >= n) {
            *adv = n;
            return TOK_UTF8_TRUNCATED;
        }
        uint8_t b = s[k];
        bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xbf);
        if (!ok) {
            *adv = k;
            return TOK_UTF8_INVALID;
        }
    }
    *adv = need;
    return TOK_UTF8_VALID;
}

int tok_utf8_sanitize(const char *s, size_t n, char **out, size_t *out_len)
{
    *out = NULL;
    *out_len = n;
    size_t i = 0, adv;
    const uint8_t *u = (const uint8_t *)s;
    while (i < n && tok_utf8_scan(u + i, n - i, &adv) == TOK_UTF8_VALID)
        i += adv;
    if (i == n)
        return TDM_OK;
    // Each replaced subpart (>= 1 byte) grows to at most 3 bytes.
    char *buf = malloc(n * 3 + 1);
    if (!buf)
        return TDM_ENOMEM;
    memcpy(buf, s, i);
    size_t o = i;
    while (i < n) {
        if (tok_utf8_scan(u + i, n - i, &adv) == TOK_UTF8_VALID) {
            memcpy(buf + o, s + i, adv);
            o += adv;
        } else {
            memcpy(buf + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
        i += adv;
    }
    buf[o] = 0;
    *out = buf;
    *out_len = o;
    return TDM_OK;
}

bool tok_is_white_space(int32_t cp)
{
    return (cp >= 0x09 && cp <= 0x0d) || cp == 0x20 || cp == 0x85 || cp == 0xa0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
           cp == 0x205f || cp == 0x3000;
}

// ---- per-call state ------------------------------------------------------------------------

struct bpe_sym {
    int32_t id;
    int32_t prev, next; // indices into the symbol array, -1 at the ends
    bool alive;         // false once merged into its left neighbour
};

struct bpe_item {
    int32_t rank;
    int32_t pos; // index of the left symbol of the pair
    int32_t new_id;
};

struct enc {
    const struct tdm_tokenizer *tok;
    unsigned flags;
    int32_t *ids; // [cap] output
    size_t n, cap;
    pcre2_match_data *md;           // shared by the stages: each copies its match before recursing
    char *prefixed[TOK_MAX_STAGES]; // piece with the ByteLevel prefix space, per stage
    size_t prefixed_cap[TOK_MAX_STAGES];
    struct bpe_sym *syms; // [syms_cap]
    size_t syms_cap;
    struct bpe_item *heap; // [heap_cap]
    size_t heap_cap;
    char *mapped; // byte-level string of a piece (ignore_merges lookups)
    size_t mapped_cap;
};

static int push_ids(struct enc *e, const int32_t *ids, size_t n)
{
    if (n == 0)
        return TDM_OK;
    int rc = tdm_grow(&e->ids, &e->cap, e->n + n, sizeof *e->ids, 64);
    if (rc)
        return rc;
    memcpy(e->ids + e->n, ids, n * sizeof *ids);
    e->n += n;
    return TDM_OK;
}

// ---- BPE -------------------------------------------------------------------------------------

static bool item_less(const struct bpe_item *a, const struct bpe_item *b)
{
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(struct bpe_item *h, size_t *n, struct bpe_item it)
{
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!item_less(&it, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = it;
}

static struct bpe_item heap_pop(struct bpe_item *h, size_t *n)
{
    struct bpe_item top = h[0];
    struct bpe_item last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && item_less(&h[c + 1], &h[c]))
            c++;
        if (!item_less(&h[c], &last))
            break;
        h[i] = h[c];
        i = c;
    }
    if (*n > 0)
        h[i] = last;
    return top;
}

static void push_pair(const struct tdm_tokenizer *tok, struct enc *e, size_t *hn, int32_t pos)
{
    const struct bpe_sym *l = &e->syms[pos];
    if (l->next < 0)
        return;
    const struct tok_merge_entry *m = tok_merge_find(tok, l->id, e->syms[l->next].id);
    if (m)
        heap_push(e->heap, hn, (struct bpe_item){m->rank, pos, m->new_id});
}

static bool cache_get(const struct tdm_tokenizer *tok, uint64_t h, const char *w, size_t n,
                      struct enc *e, int *rc)
{
    size_t slot = h & (TOK_CACHE_SLOTS - 1);
    pthread_mutex_t *lock = (pthread_mutex_t *)&tok->cache_locks[slot & (TOK_CACHE_STRIPES - 1)];
    int32_t ids[TOK_CACHE_IDS_MAX];
    size_t n_ids = 0;
    bool hit = false;
    pthread_mutex_lock(lock);
    const struct tok_cache_slot *c = &tok->cache[slot];
    if (c->hash == h && c->word_len == n && memcmp(c->word, w, n) == 0) {
        n_ids = c->n_ids;
        memcpy(ids, c->ids, n_ids * sizeof *ids);
        hit = true;
    }
    pthread_mutex_unlock(lock);
    if (hit)
        *rc = push_ids(e, ids, n_ids);
    return hit;
}

static void cache_put(const struct tdm_tokenizer *tok, uint64_t h, const char *w, size_t n,
                      const int32_t *ids, size_t n_ids)
{
    size_t slot = h & (TOK_CACHE_SLOTS - 1);
    pthread_mutex_t *lock = (pthread_mutex_t *)&tok->cache_locks[slot & (TOK_CACHE_STRIPES - 1)];
    pthread_mutex_lock(lock);
    // The cache is the one mutable part of a shared tokenizer (see tokenizer.h).
    struct tok_cache_slot *c = (struct tok_cache_slot *)&tok->cache[slot];
    c->hash = h;
    c->word_len = (uint8_t)n;
    c->n_ids = (uint8_t)n_ids;
    memcpy(c->word, w, n);
    memcpy(c->ids, ids, n_ids * sizeof *ids);
    pthread_mutex_unlock(lock);
}

// BPE of one pre-tokenized piece given as raw bytes.
static int bpe_word(struct enc *e, const char *w, size_t n)
{
    const struct tdm_tokenizer *tok = e->tok;
    int rc;
    if (tok->ignore_merges) {
        // Llama 3: a piece that is itself a vocabulary entry is emitted whole.
        if ((rc = tdm_grow(&e->mapped, &e->mapped_cap, n * 2, 1, 64)))
            return rc;
        size_t m = 0;
        for (size_t i = 0; i < n; i++)
            m += (size_t)utf8proc_encode_char(tok->byte_char[(uint8_t)w[i]],
                                              (utf8proc_uint8_t *)e->mapped + m);
        int32_t id = tok_str_map_get(&tok->vocab, e->mapped, m);
        if (id >= 0)
            return push_ids(e, &id, 1);
    }
    uint64_t h = 0;
    bool cacheable = n <= TOK_CACHE_WORD_MAX;
    if (cacheable) {
        h = tok_hash_bytes(w, n);
        rc = TDM_OK;
        if (cache_get(tok, h, w, n, e, &rc))
            return rc;
    }
    if ((rc = tdm_grow(&e->syms, &e->syms_cap, n, sizeof *e->syms, 64)) ||
        (rc = tdm_grow(&e->heap, &e->heap_cap, 3 * n + 1, sizeof *e->heap, 64)))
        return rc;
    // Bytes whose character is not in the vocabulary are dropped (HF without unk_token).
    int32_t ns = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = tok->byte_id[(uint8_t)w[i]];
        if (id < 0)
            continue;
        e->syms[ns] = (struct bpe_sym){id, ns - 1, -1, true};
        if (ns > 0)
            e->syms[ns - 1].next = ns;
        ns++;
    }
    size_t hn = 0;
    for (int32_t i = 0; i + 1 < ns; i++)
        push_pair(tok, e, &hn, i);
    while (hn > 0) {
        struct bpe_item top = heap_pop(e->heap, &hn);
        struct bpe_sym *l = &e->syms[top.pos];
        if (!l->alive || l->next < 0)
            continue;
        struct bpe_sym *r = &e->syms[l->next];
        // A stale entry: the pair at pos changed since it was queued. HF compares
        // the merged id only, and so do we.
        const struct tok_merge_entry *m = tok_merge_find(tok, l->id, r->id);
        if (!m || m->new_id != top.new_id)
            continue;
        l->id = top.new_id;
        r->alive = false;
        l->next = r->next;
        if (r->next >= 0)
            e->syms[r->next].prev = top.pos;
        if (l->prev >= 0)
            push_pair(tok, e, &hn, l->prev);
        push_pair(tok, e, &hn, top.pos);
    }
    size_t start = e->n;
    for (int32_t i = 0; i < ns; i++) {
        if (!e->syms[i].alive)
            continue;
        if ((rc = push_ids(e, &e->syms[i].id, 1)))
            return rc;
    }
    if (cacheable && e->n - start <= TOK_CACHE_IDS_MAX)
        cache_put(tok, h, w, n, e->ids + start, e->n - start);
    return TDM_OK;
}

// ---- pre-tokenizer
// -------------------------------------------------------------------------------

static size_t utf8_len_at(const char *s, size_t n)
{
    size_t adv;
    tok_utf8_scan((const uint8_t *)s, n, &adv);
    return adv;
}

static int regex_next(const pcre2_code *re, const char *s, size_t n, size_t pos,
                      pcre2_match_data *md, size_t *ms, size_t *me)
{
    int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT) // the interpreter keeps its backtrack state on the heap
        rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, NULL);
    if (rc == PCRE2_ERROR_NOMATCH)
        return 1;
    if (rc < 0)
        return rc == PCRE2_ERROR_NOMEMORY ? -TDM_ENOMEM : -TDM_EINVAL;
    const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
    *ms = ov[0];
    *me = ov[1];
    return 0;
}

static int run_stage(struct enc *e, size_t k, const char *s, size_t n)
{
    const struct tdm_tokenizer *tok = e->tok;
    if (n == 0)
        return TDM_OK;
    if (k == tok->n_stages)
        return bpe_word(e, s, n);
    const struct tok_stage *st = &tok->stages[k];
    int rc;
    if (st->kind == TOK_STAGE_BYTELEVEL && st->add_prefix_space && s[0] != ' ') {
        if ((rc = tdm_grow(&e->prefixed[k], &e->prefixed_cap[k], n + 1, 1, 64)))
            return rc;
        e->prefixed[k][0] = ' ';
        memcpy(e->prefixed[k] + 1, s, n);
        s = e->prefixed[k];
        n++;
    }
    if (!st->re)
        return run_stage(e, k + 1, s, n);
    size_t pos = 0, last = 0;
    while (pos < n) {
        size_t ms, me;
        int r = regex_next(st->re, s, n, pos, e->md, &ms, &me);
        if (r < 0)
            return -r;
        if (r > 0)
            break;
        if (me == ms) { // an empty match yields no piece
            if (ms >= n)
                break;
            pos = ms + utf8_len_at(s + ms, n - ms);
            continue;
        }
        if (ms > last && (rc = run_stage(e, k + 1, s + last, ms - last)))
            return rc;
        if (st->behavior == TOK_SPLIT_ISOLATED && (rc = run_stage(e, k + 1, s + ms, me - ms)))
            return rc;
        last = pos = me;
    }
    if (last < n)
        return run_stage(e, k + 1, s + last, n - last);
    return TDM_OK;
}

// ---- added tokens
// ------------------------------------------------------------------------------------

static int32_t cp_before(const char *s, size_t end)
{
    if (end == 0)
        return -1;
    size_t i = end - 1;
    while (i > 0 && ((uint8_t)s[i] & 0xc0) == 0x80)
        i--;
    utf8proc_int32_t cp = -1;
    utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)(end - i), &cp);
    return cp;
}

static int32_t cp_at(const char *s, size_t n, size_t pos)
{
    if (pos >= n)
        return -1;
    utf8proc_int32_t cp = -1;
    utf8proc_iterate((const utf8proc_uint8_t *)s + pos, (utf8proc_ssize_t)(n - pos), &cp);
    return cp;
}

static bool is_word_char(int32_t cp)
{
    if (cp < 0)
        return false;
    if (cp == '_')
        return true;
    utf8proc_category_t c = utf8proc_category(cp);
    return (c >= UTF8PROC_CATEGORY_LU && c <= UTF8PROC_CATEGORY_LO) ||
           (c >= UTF8PROC_CATEGORY_ND && c <= UTF8PROC_CATEGORY_NO);
}

typedef int (*text_fn)(struct enc *e, const char *s, size_t n);

// Cuts the tokens of set out of s (leftmost-longest, non-overlapping, as HF's
// Aho-Corasick search) and hands the text between them to on_text.
static int split_added(struct enc *e, const struct tok_added_set *set, const char *s, size_t n,
                       text_fn on_text)
{
    size_t start_offset = 0, i = 0;
    int rc;
    bool skip_special = e->flags & TDM_TOK_SPLIT_SPECIAL;
    while (set->n > 0 && i < n) {
        uint8_t b = (uint8_t)s[i];
        uint32_t lo = set->first_begin[b], hi = set->first_end[b];
        const struct tok_added *hit = NULL;
        for (uint32_t j = lo; j < hi; j++) {
            const struct tok_added *t = set->tokens[j];
            if (t->match_len <= n - i && memcmp(s + i, t->match_text, t->match_len) == 0) {
                hit = t;
                break;
            }
        }
        if (!hit) {
            i++;
            continue;
        }
        size_t start = i, stop = i + hit->match_len;
        i = stop; // the search resumes after the match even when it is rejected below
        if (skip_special && hit->special)
            continue;
        if (hit->single_word &&
            (is_word_char(cp_before(s, start)) || is_word_char(cp_at(s, n, stop))))
            continue;
        if (hit->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t p = ns - 1;
                while (p > 0 && ((uint8_t)s[p] & 0xc0) == 0x80)
                    p--;
                if (!tok_is_white_space(cp_at(s, n, p)))
                    break;
                ns = p;
            }
            start = ns > start_offset ? ns : start_offset;
        }
        if (hit->rstrip) {
            while (stop < n && tok_is_white_space(cp_at(s, n, stop)))
                stop += utf8_len_at(s + stop, n - stop);
        }
        if (start_offset < start && (rc = on_text(e, s + start_offset, start - start_offset)))
            return rc;
        if ((rc = push_ids(e, &hit->id, 1)))
            return rc;
        if (stop > start_offset)
            start_offset = stop;
    }
    if (start_offset < n)
        return on_text(e, s + start_offset, n - start_offset);
    return TDM_OK;
}

static int on_normalized_text(struct enc *e, const char *s, size_t n)
{
    return run_stage(e, 0, s, n);
}

// True when NFC leaves s unchanged without looking closer: every code point
// below U+0300 (lead bytes below 0xCC) is NFC-stable and composes with nothing before it.
static bool nfc_trivially_stable(const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if ((uint8_t)s[i] >= 0xcc)
            return false;
    return true;
}

static int on_raw_text(struct enc *e, const char *s, size_t n)
{
    const struct tdm_tokenizer *tok = e->tok;
    bool all_nfc = tok->n_norm > 0;
    for (size_t i = 0; i < tok->n_norm; i++)
        all_nfc &= tok->norm[i] == TOK_NORM_NFC;
    if (tok->n_norm == 0 || (all_nfc && nfc_trivially_stable(s, n)))
        return split_added(e, &tok->norm_set, s, n, on_normalized_text);
    char *norm;
    size_t norm_len;
    int rc = tok_normalize(tok, s, n, &norm, &norm_len);
    if (rc != TDM_OK)
        return rc;
    rc = split_added(e, &tok->norm_set, norm, norm_len, on_normalized_text);
    free(norm);
    return rc;
}

// ---- public
// ----------------------------------------------------------------------------------------------

int tdm_tok_encode_ex(const struct tdm_tokenizer *tok, const char *text, size_t len, unsigned flags,
                      int32_t **ids, size_t *n)
{
    *ids = NULL;
    *n = 0;
    if (!tok || (!text && len > 0))
        return TDM_EINVAL;
    struct enc e = {.tok = tok, .flags = flags};
    char *clean = NULL;
    size_t clean_len = len;
    int rc = tok_utf8_sanitize(text ? text : "", len, &clean, &clean_len);
    if (rc)
        return rc;
    const char *s = clean ? clean : (text ? text : "");
    if (!(e.md = pcre2_match_data_create(1, NULL))) {
        rc = TDM_ENOMEM;
        goto fail;
    }
    // Typical English is ~4 bytes per token; start there to avoid regrowth.
    if ((rc = tdm_grow(&e.ids, &e.cap, clean_len / 3 + 8, sizeof *e.ids, 64)))
        goto fail;
    if ((flags & TDM_TOK_ADD_SPECIAL) && (rc = push_ids(&e, tok->prefix_ids, tok->n_prefix)))
        goto fail;
    if ((rc = split_added(&e, &tok->raw_set, s, clean_len, on_raw_text)))
        goto fail;
    if ((flags & TDM_TOK_ADD_SPECIAL) && (rc = push_ids(&e, tok->suffix_ids, tok->n_suffix)))
        goto fail;
    *ids = e.ids;
    *n = e.n;
    e.ids = NULL;
fail:
    free(e.ids);
    for (size_t i = 0; i < TOK_MAX_STAGES; i++)
        free(e.prefixed[i]);
    free(e.syms);
    free(e.heap);
    free(e.mapped);
    pcre2_match_data_free(e.md);
    free(clean);
    return rc;
}

int tdm_tok_encode(const struct tdm_tokenizer *tok, const char *text, size_t len,
                   bool add_special_tokens, int32_t **ids, size_t *n)
{
    return tdm_tok_encode_ex(tok, text, len, add_special_tokens ? TDM_TOK_ADD_SPECIAL : 0, ids, n);
}
