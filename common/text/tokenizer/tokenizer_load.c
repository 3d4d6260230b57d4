// SPDX-License-Identifier: Apache-2.0
// tokenizer_load: builds a struct tdm_tokenizer from a Hugging Face
// tokenizer.json (and tokenizer_config.json when given). cJSON is used only
// here, at the edge; the loaded tokenizer holds plain arrays and hash tables:
// vocab string -> id, (left id, right id) -> (rank, merged id), the decoded
// bytes of every id, the added tokens in two leftmost-longest matching sets,
// and the compiled pre-tokenizer regexes. Anything outside the supported
// subset (byte-level BPE, see docs/tokenizer.md) is refused with a message
// naming the field, so a tokenizer never silently encodes differently from HF.
#include "tokenizer_impl.h"

#include "core.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define LOAD_ERR(code, ...) tdm_seterr(err, errlen, (code), __VA_ARGS__)
#define TOK_MAX_VOCAB (1 << 24)

// ---- hashing and maps ---------------------------------------------------------------

uint64_t tok_hash_bytes(const void *p, size_t n)
{
    // FNV-1a with a final avalanche; keys are short token strings.
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= s[i];
        h *= 0x100000001b3ULL;
    }
    h ^= h >> 32;
    h *= 0x9e3779b97f4a7c15ULL;
    h ^= h >> 29;
    return h | 1; // never 0: the word cache uses 0 for an empty slot
}

static int str_map_init(struct tok_str_map *m, size_t expected)
{
    size_t cap = 16;
    while (cap < expected * 2)
        cap <<= 1;
    m->slots = calloc(cap, sizeof *m->slots);
    if (!m->slots)
        return TDM_ENOMEM;
    m->cap = cap;
    m->count = 0;
    return TDM_OK;
}

// Inserts key -> id; an existing key keeps its first id unless replace is set.
static void str_map_put(struct tok_str_map *m, const char *key, uint32_t len, int32_t id,
                        bool replace)
{
    size_t mask = m->cap - 1;
    for (size_t i = tok_hash_bytes(key, len) & mask;; i = (i + 1) & mask) {
        struct tok_str_entry *e = &m->slots[i];
        if (!e->key) {
            e->key = key;
            e->len = len;
            e->id = id;
            m->count++;
            return;
        }
        if (e->len == len && memcmp(e->key, key, len) == 0) {
            if (replace)
                e->id = id;
            return;
        }
    }
}

int32_t tok_str_map_get(const struct tok_str_map *m, const char *key, size_t len)
{
    if (!m->slots)
        return -1;
    size_t mask = m->cap - 1;
    for (size_t i = tok_hash_bytes(key, len) & mask;; i = (i + 1) & mask) {
        const struct tok_str_entry *e = &m->slots[i];
        if (!e->key)
            return -1;
        if (e->len == len && memcmp(e->key, key, len) == 0)
            return e->id;
    }
}

// HF keeps the last rule for a duplicated pair (its HashMap is filled in order).
static void merge_put(struct tdm_tokenizer *tok, int32_t left, int32_t right, int32_t rank,
                      int32_t new_id)
{
    size_t mask = tok->merges_cap - 1;
    for (size_t i = tok_pair_hash(left, right) & mask;; i = (i + 1) & mask) {
        struct tok_merge_entry *e = &tok->merges[i];
        if (e->left < 0 || (e->left == left && e->right == right)) {
            e->left = left;
            e->right = right;
            e->rank = rank;
            e->new_id = new_id;
            return;
        }
    }
}

// ---- GPT-2 byte <-> unicode table ----------------------------------------------------

// bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68
// bytes are numbered from U+0100 upwards in byte order.
static void init_byte_table(struct tdm_tokenizer *tok)
{
    int next = 256;
    for (int i = 0; i < 324; i++)
        tok->char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
        int cp = printable ? b : next++;
        tok->byte_char[b] = (uint16_t)cp;
        tok->char_byte[cp] = (int16_t)b;
    }
}

// Bytes the ByteLevel decoder gives for a token string: each char mapped back
// to its byte when every char is in the table, else the string's own bytes.
// out must hold len bytes (decoding never grows). Returns the length.
static size_t byte_decode_piece(const struct tdm_tokenizer *tok, const char *s, size_t len,
                                char *out)
{
    size_t o = 0, i = 0;
    while (i < len) {
        size_t adv;
        if (tok_utf8_scan((const uint8_t *)s + i, len - i, &adv) != TOK_UTF8_VALID)
            goto raw;
        utf8proc_int32_t cp;
        utf8proc_iterate((const utf8proc_uint8_t *)s + i, (utf8proc_ssize_t)adv, &cp);
        if (cp < 0 || cp >= 324 || tok->char_byte[cp] < 0)
            goto raw;
        out[o++] = (char)tok->char_byte[cp];
        i += adv;
    }
    return o;
raw:
    memcpy(out, s, len);
    return len;
}

// ---- regex translation -----------------------------------------------------------------

// HF compiles these patterns with Oniguruma, where \s is the Unicode White_Space
// property; PCRE2's UCP \s lacks U+0085 (NEL). Spelling \s out keeps the two equal.
#define WS_ITEMS                                                                                   \
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"       \
    "\\x{202F}\\x{205F}\\x{3000}"

static char *translate_regex(const char *pat, size_t len)
{
    // Each input byte yields at most one class of white space plus brackets.
    size_t cap = len * (sizeof(WS_ITEMS) + 4) + 16;
    char *out = malloc(cap);
    if (!out)
        return NULL;
    size_t o = 0;
    bool in_class = false;
#define EMIT(str)                                                                                  \
    do {                                                                                           \
        size_t l_ = strlen(str);                                                                   \
        memcpy(out + o, str, l_);                                                                  \
        o += l_;                                                                                   \
    } while (0)
    for (size_t i = 0; i < len; i++) {
        char c = pat[i];
        if (c == '\\' && i + 1 < len) {
            char n = pat[i + 1];
            if (n == 's')
                EMIT(in_class ? WS_ITEMS : "[" WS_ITEMS "]");
            else if (n == 'S' && !in_class)
                EMIT("[^" WS_ITEMS "]");
            else {
                out[o++] = c;
                out[o++] = n;
            }
            i++;
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            out[o++] = c;
            // "[]" and "[^]" open a class whose first member is a literal ']'.
            if (i + 1 < len && pat[i + 1] == '^')
                out[o++] = pat[++i];
            if (i + 1 < len && pat[i + 1] == ']')
                out[o++] = pat[++i];
            continue;
        }
        if (in_class && c == '[' && i + 1 < len && pat[i + 1] == ':') {
            // POSIX class inside a class: copy through ":]".
            const char *end = strstr(pat + i + 2, ":]");
            size_t stop = end ? (size_t)(end - pat) + 2 : len;
            while (i < stop && i < len)
                out[o++] = pat[i++];
            i--;
            continue;
        }
        if (in_class && c == ']')
            in_class = false;
        out[o++] = c;
    }
#undef EMIT
    out[o] = 0;
    return out;
}

static int compile_regex(pcre2_code **out, const char *pat, size_t len, bool literal, char *err,
                         size_t errlen)
{
    char *translated = NULL;
    uint32_t opts = PCRE2_UTF | PCRE2_UCP;
    if (literal)
        opts |= PCRE2_LITERAL;
    else if (!(translated = translate_regex(pat, len)))
        return TDM_ENOMEM;
    int ecode;
    PCRE2_SIZE eoff;
    pcre2_code *re =
        pcre2_compile((PCRE2_SPTR)(literal ? pat : translated),
                      literal ? len : PCRE2_ZERO_TERMINATED, opts, &ecode, &eoff, NULL);
    free(translated);
    if (!re) {
        PCRE2_UCHAR msg[160];
        pcre2_get_error_message(ecode, msg, sizeof msg);
        return LOAD_ERR(TDM_EINVAL,
                        "tokenizer.json: pre_tokenizer regex does not compile at %zu: %s",
                        (size_t)eoff, (const char *)msg);
    }
    // JIT is an optimisation only: without it pcre2_match interprets the pattern.
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
    *out = re;
    return TDM_OK;
}

// The GPT-2 pattern ByteLevel{use_regex: true} splits with.
static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// ---- JSON helpers -------------------------------------------------------------------------

const char *tdm_tok_config_chat_template(const cJSON *cfg)
{
    const cJSON *tpl = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    const char *text = NULL;
    if (cJSON_IsString(tpl)) {
        text = tpl->valuestring;
    } else if (cJSON_IsArray(tpl)) {
        // Named templates: [{"name": "default", "template": "..."}, ...].
        const cJSON *it;
        cJSON_ArrayForEach(it, tpl)
        {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(it, "name");
            const cJSON *body = cJSON_GetObjectItemCaseSensitive(it, "template");
            if (cJSON_IsString(name) && strcmp(name->valuestring, "default") == 0)
                text = cJSON_IsString(body) ? body->valuestring : NULL;
        }
    }
    return text;
}

static const char *json_str(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool json_bool(const cJSON *obj, const char *key, bool dflt)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (cJSON_IsBool(v))
        return cJSON_IsTrue(v);
    return dflt;
}

static bool json_is_null_or_absent(const cJSON *obj, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    return !v || cJSON_IsNull(v);
}

// A JSON integer in [0, INT32_MAX) or -1.
static int32_t json_id(const cJSON *v)
{
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble >= 2147483647.0 ||
        v->valuedouble != (double)(int64_t)v->valuedouble)
        return -1;
    return (int32_t)v->valuedouble;
}

static cJSON *parse_json_file(const char *path, char *err, size_t errlen, int *rc)
{
    char *text;
    size_t len;
    *rc = tdm_read_file(path, &text, &len, err, errlen);
    if (*rc)
        return NULL;
    char depth_err[96];
    if (tdm_json_check_depth(text, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err)) {
        *rc = LOAD_ERR(TDM_EPROTO, "%s: %s", path, depth_err);
        free(text);
        return NULL;
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        size_t off = (at && at >= text && at <= text + len) ? (size_t)(at - text) : 0;
        *rc = LOAD_ERR(TDM_EPROTO, "%s: invalid JSON near byte %zu", path, off);
    }
    free(text);
    return root;
}

// ---- sections of tokenizer.json -----------------------------------------------------------

static int load_normalizer(struct tdm_tokenizer *tok, const cJSON *n, char *err, size_t errlen)
{
    if (!n || cJSON_IsNull(n))
        return TDM_OK;
    const char *type = json_str(n, "type");
    if (!type)
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: normalizer has no type");
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, "normalizers");
        if (!cJSON_IsArray(list))
            return LOAD_ERR(TDM_EPROTO, "tokenizer.json: normalizer Sequence without normalizers");
        const cJSON *it;
        cJSON_ArrayForEach(it, list)
        {
            int rc = load_normalizer(tok, it, err, errlen);
            if (rc)
                return rc;
        }
        return TDM_OK;
    }
    enum tok_norm kind;
    if (strcmp(type, "NFC") == 0)
        kind = TOK_NORM_NFC;
    else if (strcmp(type, "NFD") == 0)
        kind = TOK_NORM_NFD;
    else if (strcmp(type, "NFKC") == 0)
        kind = TOK_NORM_NFKC;
    else if (strcmp(type, "NFKD") == 0)
        kind = TOK_NORM_NFKD;
    else
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: normalizer %s is not supported", type);
    if (tok->n_norm == TOK_MAX_NORM)
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: more than %d normalizers", TOK_MAX_NORM);
    tok->norm[tok->n_norm++] = kind;
    return TDM_OK;
}

static int load_pre_tokenizer(struct tdm_tokenizer *tok, const cJSON *p, char *err, size_t errlen)
{
    if (!p || cJSON_IsNull(p))
        return TDM_OK;
    const char *type = json_str(p, "type");
    if (!type)
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: pre_tokenizer has no type");
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(p, "pretokenizers");
        if (!cJSON_IsArray(list))
            return LOAD_ERR(TDM_EPROTO,
                            "tokenizer.json: pre_tokenizer Sequence without pretokenizers");
        const cJSON *it;
        cJSON_ArrayForEach(it, list)
        {
            int rc = load_pre_tokenizer(tok, it, err, errlen);
            if (rc)
                return rc;
        }
        return TDM_OK;
    }
    if (tok->n_stages == TOK_MAX_STAGES)
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: more than %d pre-tokenizers", TOK_MAX_STAGES);
    struct tok_stage *st = &tok->stages[tok->n_stages];
    memset(st, 0, sizeof *st);
    if (strcmp(type, "Split") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(p, "pattern");
        const char *regex = json_str(pat, "Regex");
        const char *literal = json_str(pat, "String");
        if (!regex && !literal)
            return LOAD_ERR(TDM_EPROTO, "tokenizer.json: Split pre_tokenizer without a pattern");
        if (json_bool(p, "invert", false))
            return LOAD_ERR(TDM_EINVAL, "tokenizer.json: Split with invert=true is not supported");
        const char *behavior = json_str(p, "behavior");
        if (behavior && strcmp(behavior, "Isolated") == 0)
            st->behavior = TOK_SPLIT_ISOLATED;
        else if (behavior && strcmp(behavior, "Removed") == 0)
            st->behavior = TOK_SPLIT_REMOVED;
        else
            return LOAD_ERR(TDM_EINVAL, "tokenizer.json: Split behavior %s is not supported",
                            behavior ? behavior : "(missing)");
        const char *src = regex ? regex : literal;
        int rc = compile_regex(&st->re, src, strlen(src), !regex, err, errlen);
        if (rc)
            return rc;
        st->kind = TOK_STAGE_SPLIT;
    } else if (strcmp(type, "ByteLevel") == 0) {
        st->kind = TOK_STAGE_BYTELEVEL;
        st->behavior = TOK_SPLIT_ISOLATED;
        st->add_prefix_space = json_bool(p, "add_prefix_space", true);
        if (json_bool(p, "use_regex", true)) {
            int rc = compile_regex(&st->re, gpt2_pattern, strlen(gpt2_pattern), false, err, errlen);
            if (rc)
                return rc;
        }
    } else {
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: pre_tokenizer %s is not supported", type);
    }
    tok->n_stages++;
    return TDM_OK;
}

// Appends the ids a TemplateProcessing item names to *ids (heap, grown).
static int template_side(struct tdm_tokenizer *tok, const cJSON *pp, bool before_seq, int32_t **ids,
                         size_t *n, char *err, size_t errlen)
{
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(pp, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(pp, "special_tokens");
    if (!cJSON_IsArray(single))
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: TemplateProcessing without a single template");
    bool seen_seq = false;
    const cJSON *it;
    cJSON_ArrayForEach(it, single)
    {
        if (cJSON_GetObjectItemCaseSensitive(it, "Sequence")) {
            seen_seq = true;
            continue;
        }
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
        const char *name = json_str(sp, "id");
        if (!name)
            return LOAD_ERR(TDM_EPROTO, "tokenizer.json: TemplateProcessing item is neither "
                                        "Sequence nor SpecialToken");
        if (seen_seq == before_seq)
            continue;
        const cJSON *def = cJSON_GetObjectItemCaseSensitive(specials, name);
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(def, "ids");
        if (!cJSON_IsArray(list))
            return LOAD_ERR(TDM_EPROTO,
                            "tokenizer.json: TemplateProcessing special token %s "
                            "has no ids",
                            name);
        const cJSON *idv;
        cJSON_ArrayForEach(idv, list)
        {
            int32_t id = json_id(idv);
            if (id < 0 || id >= tok->vocab_size)
                return LOAD_ERR(TDM_EPROTO,
                                "tokenizer.json: TemplateProcessing special token %s "
                                "has an id outside the vocabulary",
                                name);
            int32_t *grown = realloc(*ids, (*n + 1) * sizeof **ids);
            if (!grown)
                return TDM_ENOMEM;
            *ids = grown;
            (*ids)[(*n)++] = id;
        }
    }
    return TDM_OK;
}

static int load_post_processor(struct tdm_tokenizer *tok, const cJSON *pp, char *err, size_t errlen)
{
    if (!pp || cJSON_IsNull(pp))
        return TDM_OK;
    const char *type = json_str(pp, "type");
    if (!type)
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: post_processor has no type");
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(pp, "processors");
        const cJSON *it;
        cJSON_ArrayForEach(it, list)
        {
            int rc = load_post_processor(tok, it, err, errlen);
            if (rc)
                return rc;
        }
        return TDM_OK;
    }
    if (strcmp(type, "ByteLevel") == 0)
        return TDM_OK; // only trims offsets; ids are unchanged
    if (strcmp(type, "TemplateProcessing") == 0) {
        int rc = template_side(tok, pp, true, &tok->prefix_ids, &tok->n_prefix, err, errlen);
        if (!rc)
            rc = template_side(tok, pp, false, &tok->suffix_ids, &tok->n_suffix, err, errlen);
        return rc;
    }
    return LOAD_ERR(TDM_EINVAL, "tokenizer.json: post_processor %s is not supported", type);
}

static int load_decoder(struct tdm_tokenizer *tok, const cJSON *d, char *err, size_t errlen)
{
    if (!d || cJSON_IsNull(d)) {
        tok->has_decoder = false;
        return TDM_OK;
    }
    const char *type = json_str(d, "type");
    if (!type || strcmp(type, "ByteLevel") != 0)
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: decoder %s is not supported (only ByteLevel)",
                        type ? type : "(no type)");
    tok->has_decoder = true;
    return TDM_OK;
}

// ---- added tokens --------------------------------------------------------------------------

static int add_token(struct tdm_tokenizer *tok, size_t *cap, const char *content, int32_t id,
                     bool special, bool lstrip, bool rstrip, bool single_word, bool normalized)
{
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].id == id)
            return TDM_OK; // tokenizer.json wins over tokenizer_config.json
    if (tdm_grow(&tok->added, cap, tok->n_added + 1, sizeof *tok->added, 32) != TDM_OK)
        return TDM_ENOMEM;
    struct tok_added *a = &tok->added[tok->n_added];
    memset(a, 0, sizeof *a);
    a->len = strlen(content);
    if (!(a->content = strdup(content)))
        return TDM_ENOMEM;
    a->id = id;
    a->special = special;
    a->lstrip = lstrip;
    a->rstrip = rstrip;
    a->single_word = single_word;
    a->normalized = normalized;
    tok->n_added++;
    return TDM_OK;
}

static int load_added_list(struct tdm_tokenizer *tok, size_t *cap, const cJSON *list,
                           bool from_config, char *err, size_t errlen)
{
    const cJSON *it;
    cJSON_ArrayForEach(it, list)
    {
        const char *content = json_str(it, "content");
        int32_t id = from_config ? -1 : json_id(cJSON_GetObjectItemCaseSensitive(it, "id"));
        if (from_config && it->string) {
            char *end;
            long v = strtol(it->string, &end, 10);
            if (*end == 0 && end != it->string && v >= 0 && v < 2147483647L)
                id = (int32_t)v;
        }
        if (!content || id < 0)
            return LOAD_ERR(TDM_EPROTO, "%s: an added token lacks content or a valid id",
                            from_config ? "tokenizer_config.json" : "tokenizer.json");
        if (content[0] == 0)
            return LOAD_ERR(TDM_EPROTO, "%s: added token %d has empty content",
                            from_config ? "tokenizer_config.json" : "tokenizer.json", (int)id);
        bool special = json_bool(it, "special", false);
        int rc = add_token(tok, cap, content, id, special, json_bool(it, "lstrip", false),
                           json_bool(it, "rstrip", false), json_bool(it, "single_word", false),
                           json_bool(it, "normalized", !special));
        if (rc)
            return rc;
    }
    return TDM_OK;
}

static int cmp_added_for_match(const void *pa, const void *pb)
{
    const struct tok_added *a = *(const struct tok_added *const *)pa;
    const struct tok_added *b = *(const struct tok_added *const *)pb;
    uint8_t fa = (uint8_t)a->match_text[0], fb = (uint8_t)b->match_text[0];
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (a->match_len != b->match_len)
        return a->match_len > b->match_len ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

static int build_added_set(struct tdm_tokenizer *tok, struct tok_added_set *set, bool normalized)
{
    size_t n = 0;
    for (size_t i = 0; i < tok->n_added; i++)
        n += tok->added[i].normalized == normalized && tok->added[i].match_len > 0;
    set->tokens = calloc(n ? n : 1, sizeof *set->tokens);
    if (!set->tokens)
        return TDM_ENOMEM;
    set->n = 0;
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].normalized == normalized && tok->added[i].match_len > 0)
            set->tokens[set->n++] = &tok->added[i];
    qsort(set->tokens, set->n, sizeof *set->tokens, cmp_added_for_match);
    for (int b = 0; b < 256; b++)
        set->first_begin[b] = set->first_end[b] = 0;
    for (size_t i = set->n; i-- > 0;) {
        uint8_t b = (uint8_t)set->tokens[i]->match_text[0];
        if (set->first_end[b] == 0)
            set->first_end[b] = (uint32_t)i + 1;
        set->first_begin[b] = (uint32_t)i;
    }
    return TDM_OK;
}

// Normalizes s with the tokenizer's normalizer steps (utf8proc) into a heap,
// NUL-terminated string (*out, caller frees). TDM_EINVAL when utf8proc rejects
// the text, TDM_ENOMEM.
int tok_normalize(const struct tdm_tokenizer *tok, const char *s, size_t len, char **out,
                  size_t *out_len)
{
    *out = NULL;
    *out_len = 0;
    char *norm = NULL;
    const char *cur = s;
    size_t cur_len = len;
    for (size_t i = 0; i < tok->n_norm; i++) {
        int opts = UTF8PROC_STABLE;
        switch (tok->norm[i]) {
        case TOK_NORM_NFC:
            opts |= UTF8PROC_COMPOSE;
            break;
        case TOK_NORM_NFD:
            opts |= UTF8PROC_DECOMPOSE;
            break;
        case TOK_NORM_NFKC:
            opts |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
            break;
        case TOK_NORM_NFKD:
            opts |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
            break;
        }
        utf8proc_uint8_t *next = NULL;
        utf8proc_ssize_t r = utf8proc_map((const utf8proc_uint8_t *)cur, (utf8proc_ssize_t)cur_len,
                                          &next, (utf8proc_option_t)opts);
        free(norm);
        if (r < 0)
            return r == UTF8PROC_ERROR_NOMEM ? TDM_ENOMEM : TDM_EINVAL;
        norm = (char *)next;
        cur = norm;
        cur_len = (size_t)r;
    }
    if (!norm) { // no normalizer: a plain copy
        norm = malloc(len + 1);
        if (!norm)
            return TDM_ENOMEM;
        memcpy(norm, s, len);
        norm[len] = 0;
    }
    *out = norm;
    *out_len = cur_len;
    return TDM_OK;
}

// ---- tokenizer_config.json -------------------------------------------------------------------

// A special token given as "string" or {"content": "string"}.
static const char *config_token(const cJSON *cfg, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    if (cJSON_IsObject(v))
        return json_str(v, "content");
    return NULL;
}

static int load_config_tokens(struct tdm_tokenizer *tok, const cJSON *cfg, char *err, size_t errlen)
{
    const char *names[3] = {config_token(cfg, "bos_token"), config_token(cfg, "eos_token"),
                            config_token(cfg, "pad_token")};
    int32_t *dst[3] = {&tok->bos_id, &tok->eos_id, &tok->pad_id};
    static const char *keys[3] = {"bos_token", "eos_token", "pad_token"};
    for (int i = 0; i < 3; i++) {
        if (!names[i])
            continue;
        *dst[i] = tdm_tok_piece_to_id(tok, names[i]);
        if (*dst[i] < 0)
            return LOAD_ERR(TDM_EPROTO, "tokenizer_config.json: %s %s is not in the vocabulary",
                            keys[i], names[i]);
    }
    const char *text = tdm_tok_config_chat_template(cfg);
    if (text && !(tok->chat_template = strdup(text)))
        return TDM_ENOMEM;
    return TDM_OK;
}

// ---- load ---------------------------------------------------------------------------------------

// Model options Tandem does not implement are refused rather than silently ignored.
static int check_bpe_options(struct tdm_tokenizer *tok, const cJSON *model, char *err,
                             size_t errlen)
{
    const char *type = json_str(model, "type");
    if (type && strcmp(type, "BPE") != 0)
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: model type %s is not supported (only BPE)",
                        type);
    if (!json_is_null_or_absent(model, "dropout")) {
        const cJSON *d = cJSON_GetObjectItemCaseSensitive(model, "dropout");
        if (!cJSON_IsNumber(d) || d->valuedouble != 0)
            return LOAD_ERR(TDM_EINVAL, "tokenizer.json: BPE dropout is not supported");
    }
    if (json_bool(model, "byte_fallback", false))
        return LOAD_ERR(TDM_EINVAL, "tokenizer.json: BPE byte_fallback is not supported");
    static const char *affixes[2] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const char *a = json_str(model, affixes[i]);
        if (a && a[0])
            return LOAD_ERR(TDM_EINVAL, "tokenizer.json: BPE %s is not supported", affixes[i]);
    }
    tok->ignore_merges = json_bool(model, "ignore_merges", false);
    return TDM_OK;
}

// Sizes the id range from the vocab and the added tokens (already loaded) and allocates the
// dense per-id tables, the arena for pieces and decoded bytes, and the vocab map.
static int alloc_id_tables(struct tdm_tokenizer *tok, const cJSON *vocab, char *err, size_t errlen)
{
    int32_t max_id = -1;
    size_t n_vocab = 0, arena_size = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab)
    {
        int32_t id = json_id(it);
        if (id < 0 || !it->string)
            return LOAD_ERR(TDM_EPROTO, "tokenizer.json: vocab entry %s has an invalid id",
                            it->string ? it->string : "?");
        if (id > max_id)
            max_id = id;
        n_vocab++;
        arena_size += 2 * (strlen(it->string) + 1);
    }
    for (size_t i = 0; i < tok->n_added; i++) {
        if (tok->added[i].id > max_id)
            max_id = tok->added[i].id;
        arena_size += tok->added[i].len + 1;
    }
    if (max_id < 0)
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: empty vocabulary");
    // Per-id tables are dense, so a stray huge id would cost gigabytes.
    if (max_id >= TOK_MAX_VOCAB)
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: token id %d is above the supported %d",
                        (int)max_id, TOK_MAX_VOCAB - 1);
    tok->vocab_size = max_id + 1;
    size_t vs = (size_t)tok->vocab_size;
    tok->pieces = calloc(vs, sizeof *tok->pieces);
    tok->piece_lens = calloc(vs, sizeof *tok->piece_lens);
    tok->dec_bytes = calloc(vs, sizeof *tok->dec_bytes);
    tok->dec_lens = calloc(vs, sizeof *tok->dec_lens);
    tok->id_flags = calloc(vs, 1);
    tok->arena = malloc(arena_size + 1);
    if (!tok->pieces || !tok->piece_lens || !tok->dec_bytes || !tok->dec_lens || !tok->id_flags ||
        !tok->arena)
        return TDM_ENOMEM;
    return str_map_init(&tok->vocab, n_vocab);
}

// Fills the tables alloc_id_tables sized: pieces into the arena and the vocab map, added tokens
// and their flags, each id's byte-decoded form, and the id of each raw byte's piece.
static void fill_id_tables(struct tdm_tokenizer *tok, const cJSON *vocab)
{
    char *a = tok->arena;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab)
    {
        int32_t id = json_id(it);
        size_t len = strlen(it->string);
        memcpy(a, it->string, len + 1);
        str_map_put(&tok->vocab, a, (uint32_t)len, id, true);
        tok->pieces[id] = a;
        tok->piece_lens[id] = (uint32_t)len;
        a += len + 1;
    }
    for (size_t i = 0; i < tok->n_added; i++) {
        struct tok_added *ad = &tok->added[i];
        tok->pieces[ad->id] = ad->content;
        tok->piece_lens[ad->id] = (uint32_t)ad->len;
        tok->id_flags[ad->id] |= TOK_ID_ADDED | (ad->special ? TOK_ID_SPECIAL : 0);
    }
    size_t vs = (size_t)tok->vocab_size;
    for (size_t id = 0; id < vs; id++) {
        if (!tok->pieces[id])
            continue;
        size_t dl = byte_decode_piece(tok, tok->pieces[id], tok->piece_lens[id], a);
        tok->dec_bytes[id] = a;
        tok->dec_lens[id] = (uint32_t)dl;
        a[dl] = 0;
        a += dl + 1;
    }
    for (int b = 0; b < 256; b++) {
        char ch[4];
        int l = (int)utf8proc_encode_char(tok->byte_char[b], (utf8proc_uint8_t *)ch);
        tok->byte_id[b] = tok_str_map_get(&tok->vocab, ch, (size_t)l);
    }
}

// Splits merge `rank` ("left right" or [left, right]) into its two symbols, which point into
// the JSON. Returns TDM_EPROTO with the detail in err when it is neither form.
static int merge_symbols(const cJSON *it, int32_t rank, const char **l, size_t *ll, const char **r,
                         size_t *rl, char *err, size_t errlen)
{
    if (cJSON_IsString(it)) {
        const char *sp = strchr(it->valuestring, ' ');
        if (!sp || strchr(sp + 1, ' '))
            return LOAD_ERR(TDM_EPROTO, "tokenizer.json: merge %d \"%s\" is not two symbols",
                            (int)rank, it->valuestring);
        *l = it->valuestring;
        *ll = (size_t)(sp - *l);
        *r = sp + 1;
        *rl = strlen(*r);
        return TDM_OK;
    }
    if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
        cJSON_IsString(cJSON_GetArrayItem(it, 0)) && cJSON_IsString(cJSON_GetArrayItem(it, 1))) {
        *l = cJSON_GetArrayItem(it, 0)->valuestring;
        *r = cJSON_GetArrayItem(it, 1)->valuestring;
        *ll = strlen(*l);
        *rl = strlen(*r);
        return TDM_OK;
    }
    return LOAD_ERR(TDM_EPROTO, "tokenizer.json: merge %d is neither a string nor a pair",
                    (int)rank);
}

// Merges: "left right" strings or [left, right] pairs; the rank is the index. Needs the vocab
// map filled, since each merge's two symbols and their join must be tokens.
static int load_merges(struct tdm_tokenizer *tok, const cJSON *merges, char *err, size_t errlen)
{
    size_t n_merges = merges ? (size_t)cJSON_GetArraySize(merges) : 0;
    tok->merges_cap = 16;
    while (tok->merges_cap < n_merges * 2)
        tok->merges_cap <<= 1;
    tok->merges = malloc(tok->merges_cap * sizeof *tok->merges);
    if (!tok->merges)
        return TDM_ENOMEM;
    for (size_t i = 0; i < tok->merges_cap; i++)
        tok->merges[i].left = -1;
    char *joined = NULL;
    size_t joined_cap = 0;
    int32_t rank = 0;
    int rc = TDM_OK;
    const cJSON *it;
    cJSON_ArrayForEach(it, merges)
    {
        const char *l = NULL, *r = NULL;
        size_t ll = 0, rl = 0;
        if ((rc = merge_symbols(it, rank, &l, &ll, &r, &rl, err, errlen)))
            break;
        int32_t lid = tok_str_map_get(&tok->vocab, l, ll);
        int32_t rid = tok_str_map_get(&tok->vocab, r, rl);
        if (ll + rl > joined_cap) {
            joined_cap = (ll + rl) * 2;
            char *g = realloc(joined, joined_cap);
            if (!g) {
                rc = TDM_ENOMEM;
                break;
            }
            joined = g;
        }
        memcpy(joined, l, ll);
        memcpy(joined + ll, r, rl);
        int32_t nid = tok_str_map_get(&tok->vocab, joined, ll + rl);
        if (lid < 0 || rid < 0 || nid < 0) {
            rc = LOAD_ERR(TDM_EPROTO,
                          "tokenizer.json: merge %d (%.*s %.*s) uses a token that is "
                          "not in the vocabulary",
                          (int)rank, (int)ll, l, (int)rl, r);
            break;
        }
        merge_put(tok, lid, rid, rank, nid);
        rank++;
    }
    free(joined);
    return rc;
}

static int load_vocab_and_merges(struct tdm_tokenizer *tok, const cJSON *model, size_t *added_cap,
                                 const cJSON *root, const cJSON *cfg, char *err, size_t errlen)
{
    int rc = check_bpe_options(tok, model, err, errlen);
    if (rc)
        return rc;
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsObject(vocab))
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: model.vocab is missing or not an object");
    if (merges && !cJSON_IsArray(merges))
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: model.merges is not an array");

    // Added tokens first: their ids extend the id range.
    rc = load_added_list(tok, added_cap, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"),
                         false, err, errlen);
    if (!rc && cfg)
        rc = load_added_list(tok, added_cap,
                             cJSON_GetObjectItemCaseSensitive(cfg, "added_tokens_decoder"), true,
                             err, errlen);
    if (!rc)
        rc = alloc_id_tables(tok, vocab, err, errlen);
    if (rc)
        return rc;
    fill_id_tables(tok, vocab);
    return load_merges(tok, merges, err, errlen);
}

static int load_from_json(struct tdm_tokenizer *tok, const cJSON *root, const cJSON *cfg, char *err,
                          size_t errlen)
{
    size_t added_cap = 0;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return LOAD_ERR(TDM_EPROTO, "tokenizer.json: no model object");
    int rc = load_vocab_and_merges(tok, model, &added_cap, root, cfg, err, errlen);
    if (!rc)
        rc =
            load_normalizer(tok, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), err, errlen);
    if (!rc)
        rc = load_pre_tokenizer(tok, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), err,
                                errlen);
    if (!rc)
        rc = load_post_processor(tok, cJSON_GetObjectItemCaseSensitive(root, "post_processor"), err,
                                 errlen);
    if (!rc)
        rc = load_decoder(tok, cJSON_GetObjectItemCaseSensitive(root, "decoder"), err, errlen);
    if (rc)
        return rc;
    bool byte_level = false;
    for (size_t i = 0; i < tok->n_stages; i++)
        byte_level |= tok->stages[i].kind == TOK_STAGE_BYTELEVEL;
    if (!byte_level)
        return LOAD_ERR(TDM_EINVAL,
                        "tokenizer.json: only byte-level BPE is supported (no ByteLevel "
                        "pre_tokenizer)");

    // Normalized added tokens are searched for in normalized text, so normalize them too.
    for (size_t i = 0; i < tok->n_added; i++) {
        struct tok_added *ad = &tok->added[i];
        if (ad->normalized && tok->n_norm) {
            if ((rc = tok_normalize(tok, ad->content, ad->len, &ad->match_text, &ad->match_len)))
                return rc;
        } else {
            if (!(ad->match_text = strdup(ad->content)))
                return TDM_ENOMEM;
            ad->match_len = ad->len;
        }
    }
    if ((rc = build_added_set(tok, &tok->raw_set, false)) ||
        (rc = build_added_set(tok, &tok->norm_set, true)))
        return rc;
    if (cfg && (rc = load_config_tokens(tok, cfg, err, errlen)))
        return rc;
    return TDM_OK;
}

int tdm_tok_load_files(struct tdm_tokenizer **out, const char *tokenizer_json_path,
                       const char *config_path, char *err, size_t errlen)
{
    *out = NULL;
    int rc;
    cJSON *cfg = NULL;
    cJSON *root = parse_json_file(tokenizer_json_path, err, errlen, &rc);
    if (!root)
        return rc;
    if (config_path && !(cfg = parse_json_file(config_path, err, errlen, &rc)))
        goto fail_root;
    struct tdm_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) {
        rc = TDM_ENOMEM;
        goto fail_cfg;
    }
    tok->bos_id = tok->eos_id = tok->pad_id = -1;
    tok->has_decoder = true;
    init_byte_table(tok);
    for (int i = 0; i < TOK_CACHE_STRIPES; i++)
        pthread_mutex_init(&tok->cache_locks[i], NULL);
    tok->cache = calloc(TOK_CACHE_SLOTS, sizeof *tok->cache);
    if (!tok->cache) {
        rc = TDM_ENOMEM;
        goto fail_tok;
    }
    rc = load_from_json(tok, root, cfg, err, errlen);
    if (rc)
        goto fail_tok;
    cJSON_Delete(cfg);
    cJSON_Delete(root);
    *out = tok;
    return TDM_OK;

fail_tok:
    if (rc == TDM_ENOMEM)
        LOAD_ERR(TDM_ENOMEM, "out of memory loading %s", tokenizer_json_path);
    tdm_tok_free(tok);
fail_cfg:
    cJSON_Delete(cfg);
fail_root:
    cJSON_Delete(root);
    return rc;
}

int tdm_tok_load(struct tdm_tokenizer **out, const char *dir, char *err, size_t errlen)
{
    *out = NULL;
    char *json = tdm_path_join(dir, "tokenizer.json");
    char *cfg = tdm_path_join(dir, "tokenizer_config.json");
    int rc = TDM_ENOMEM;
    if (json && cfg) {
        FILE *f = fopen(cfg, "rb");
        if (f)
            fclose(f);
        rc = tdm_tok_load_files(out, json, f ? cfg : NULL, err, errlen);
    }
    free(json);
    free(cfg);
    return rc;
}

void tdm_tok_free(struct tdm_tokenizer *tok)
{
    if (!tok)
        return;
    for (size_t i = 0; i < tok->n_stages; i++)
        pcre2_code_free(tok->stages[i].re);
    for (size_t i = 0; i < tok->n_added; i++) {
        free(tok->added[i].content);
        free(tok->added[i].match_text);
    }
    free(tok->added);
    free(tok->raw_set.tokens);
    free(tok->norm_set.tokens);
    free(tok->pieces);
    free(tok->piece_lens);
    free(tok->dec_bytes);
    free(tok->dec_lens);
    free(tok->id_flags);
    free(tok->arena);
    free(tok->vocab.slots);
    free(tok->merges);
    free(tok->prefix_ids);
    free(tok->suffix_ids);
    free(tok->chat_template);
    if (tok->cache) {
        for (int i = 0; i < TOK_CACHE_STRIPES; i++)
            pthread_mutex_destroy(&tok->cache_locks[i]);
        free(tok->cache);
    }
    free(tok);
}

// ---- accessors
// ------------------------------------------------------------------------------------

int tdm_tok_vocab_size(const struct tdm_tokenizer *tok)
{
    return tok->vocab_size;
}

const char *tdm_tok_id_to_piece(const struct tdm_tokenizer *tok, int32_t id)
{
    if (id < 0 || id >= tok->vocab_size)
        return NULL;
    return tok->pieces[id];
}

int32_t tdm_tok_piece_to_id(const struct tdm_tokenizer *tok, const char *piece)
{
    size_t len = strlen(piece);
    for (size_t i = 0; i < tok->n_added; i++)
        if (tok->added[i].len == len && memcmp(tok->added[i].content, piece, len) == 0)
            return tok->added[i].id;
    return tok_str_map_get(&tok->vocab, piece, len);
}

bool tdm_tok_is_special(const struct tdm_tokenizer *tok, int32_t id)
{
    return id >= 0 && id < tok->vocab_size && (tok->id_flags[id] & TOK_ID_SPECIAL);
}

int32_t tdm_tok_bos_id(const struct tdm_tokenizer *tok)
{
    return tok->bos_id;
}
int32_t tdm_tok_eos_id(const struct tdm_tokenizer *tok)
{
    return tok->eos_id;
}
int32_t tdm_tok_pad_id(const struct tdm_tokenizer *tok)
{
    return tok->pad_id;
}
const char *tdm_tok_chat_template(const struct tdm_tokenizer *tok)
{
    return tok->chat_template;
}
