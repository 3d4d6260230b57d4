// SPDX-License-Identifier: Apache-2.0
// tokenizer internals shared by tokenizer_load.c (parsing tokenizer.json and
// tokenizer_config.json), tokenizer_encode.c (added tokens, normalizer,
// pre-tokenizer, BPE) and tokenizer_decode.c (decode and the streaming
// detokenizer). Everything here is immutable after load except the word cache,
// whose slots are guarded by striped mutexes.
#ifndef TDM_TOKENIZER_IMPL_H
#define TDM_TOKENIZER_IMPL_H

#include "tokenizer.h"

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

// ---- small string -> id map (open addressing, keys point into the owner's storage) ----
struct tok_str_entry {
    const char *key; // NULL when the slot is empty
    uint32_t len;
    int32_t id;
};
struct tok_str_map {
    struct tok_str_entry *slots; // [cap], cap a power of two, at most half full
    size_t cap;
    size_t count;
};

// ---- merge map: (left id, right id) -> (rank, merged id) ----
struct tok_merge_entry {
    int32_t left; // -1 when the slot is empty
    int32_t right;
    int32_t rank;
    int32_t new_id;
};

// ---- added tokens (HF AddedVocabulary) ----
struct tok_added {
    char *content; // heap, as written in tokenizer.json (NFC-normalized copy in match_text)
    size_t len;
    char *match_text; // what is searched for: content, normalized when `normalized` is set
    size_t match_len;
    int32_t id;
    bool special, lstrip, rstrip, single_word, normalized;
};

// One matching set (HF builds one trie for non-normalized tokens, one for normalized).
// Leftmost-longest search: candidates sorted by first byte, then by length descending.
struct tok_added_set {
    const struct tok_added **tokens; // [n] borrowed from tdm_tokenizer.added
    size_t n;
    uint32_t first_begin[256]; // tokens[first_begin[b]..first_end[b]) start with byte b
    uint32_t first_end[256];
};

// ---- normalizer steps (applied in order) ----
enum tok_norm { TOK_NORM_NFC = 1, TOK_NORM_NFD, TOK_NORM_NFKC, TOK_NORM_NFKD };
#define TOK_MAX_NORM 4

// ---- pre-tokenizer stages (applied in order, each to every piece of the previous) ----
enum tok_stage_kind { TOK_STAGE_SPLIT = 1, TOK_STAGE_BYTELEVEL };
enum tok_split_behavior { TOK_SPLIT_ISOLATED = 1, TOK_SPLIT_REMOVED };
struct tok_stage {
    enum tok_stage_kind kind;
    pcre2_code *re; // compiled split regex (NULL for ByteLevel without regex)
    enum tok_split_behavior behavior;
    bool add_prefix_space; // ByteLevel only
};
#define TOK_MAX_STAGES 6

// ---- word cache ----
#define TOK_CACHE_WORD_MAX 40 // longer words are not cached
#define TOK_CACHE_IDS_MAX 12
#define TOK_CACHE_SLOTS 65536 // power of two
#define TOK_CACHE_STRIPES 64  // power of two; slot i is guarded by lock i % STRIPES
struct tok_cache_slot {
    uint64_t hash; // 0 when empty
    uint8_t word_len;
    uint8_t n_ids;
    char word[TOK_CACHE_WORD_MAX];
    int32_t ids[TOK_CACHE_IDS_MAX];
};

enum { TOK_ID_ADDED = 1, TOK_ID_SPECIAL = 2 };

struct tdm_tokenizer {
    int32_t vocab_size;       // max id + 1 over the model vocab and added tokens
    const char **pieces;      // [vocab_size] token string per id (added content wins); NULL in gaps
    uint32_t *piece_lens;     // [vocab_size]
    const char **dec_bytes;   // [vocab_size] bytes the ByteLevel decoder gives for the id
    uint32_t *dec_lens;       // [vocab_size]
    uint8_t *id_flags;        // [vocab_size] TOK_ID_* bits
    char *arena;              // storage for model vocab strings and decoded bytes
    struct tok_str_map vocab; // model vocab string -> id

    struct tok_merge_entry *merges; // [merges_cap], power of two
    size_t merges_cap;
    bool ignore_merges;
    int32_t byte_id[256];    // id of the byte-level char of each byte, -1 if absent
    uint16_t byte_char[256]; // GPT-2 bytes_to_unicode code point of each byte
    int16_t char_byte[324];  // inverse for code points < 324, -1 elsewhere

    enum tok_norm norm[TOK_MAX_NORM];
    size_t n_norm;

    struct tok_added *added; // [n_added]
    size_t n_added;
    struct tok_added_set raw_set;  // normalized == false, matched on the raw text
    struct tok_added_set norm_set; // normalized == true, matched after normalization

    struct tok_stage stages[TOK_MAX_STAGES];
    size_t n_stages;

    int32_t *prefix_ids; // post-processor additions before the sequence [n_prefix]
    size_t n_prefix;
    int32_t *suffix_ids; // and after it [n_suffix]
    size_t n_suffix;

    bool has_decoder; // false: decode joins the token strings with spaces

    int32_t bos_id, eos_id, pad_id;
    char *chat_template;

    struct tok_cache_slot *cache; // [TOK_CACHE_SLOTS]
    pthread_mutex_t cache_locks[TOK_CACHE_STRIPES];
};

// ---- helpers shared between the files ----

// UTF-8 scanning by the Unicode "maximal subpart" rule (what Python's
// errors='replace' and Rust's from_utf8_lossy do).
enum tok_utf8 { TOK_UTF8_VALID = 0, TOK_UTF8_INVALID, TOK_UTF8_TRUNCATED };
// Classifies the sequence at s (n >= 1 bytes): VALID with *adv its length;
// INVALID with *adv the maximal subpart to replace by one U+FFFD; TRUNCATED when
// all n bytes are a proper prefix of a valid character (*adv = n).
enum tok_utf8 tok_utf8_scan(const uint8_t *s, size_t n, size_t *adv);
// Replaces ill-formed subsequences of s by U+FFFD. *out is NULL when s was valid
// (nothing allocated), else a heap copy (caller frees) of *out_len bytes.
int tok_utf8_sanitize(const char *s, size_t n, char **out, size_t *out_len);
// True for the Unicode White_Space property (Rust char::is_whitespace).
bool tok_is_white_space(int32_t cp);

uint64_t tok_hash_bytes(const void *p, size_t n);
int32_t tok_str_map_get(const struct tok_str_map *m, const char *key, size_t len);

static inline uint64_t tok_pair_hash(int32_t left, int32_t right)
{
    uint64_t h = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    return h;
}

// The merge of (left, right), or NULL when the pair never merges.
static inline const struct tok_merge_entry *tok_merge_find(const struct tdm_tokenizer *tok,
                                                           int32_t left, int32_t right)
{
    size_t mask = tok->merges_cap - 1;
    for (size_t i = tok_pair_hash(left, right) & mask;; i = (i + 1) & mask) {
        const struct tok_merge_entry *e = &tok->merges[i];
        if (e->left < 0)
            return NULL;
        if (e->left == left && e->right == right)
            return e;
    }
}

// Applies the normalizer steps to s (tokenizer_load.c); *out is heap, NUL-terminated.
int tok_normalize(const struct tdm_tokenizer *tok, const char *s, size_t len, char **out,
                  size_t *out_len);

#endif
