// SPDX-License-Identifier: Apache-2.0
// mkmodel: random-weights model folders (see mkmodel.h for the weight scales).
//
// The tokenizer it writes is a real byte-level BPE in the layout Qwen2 uses
// (NFC normalizer, Split regex + ByteLevel pre-tokenizer, ByteLevel decoder,
// BPE model, three special tokens as the last ids) so that the tokenizer,
// chat and server code run on these models unchanged. Its merges are learned
// from a built-in English text (most frequent adjacent pair first, ties broken
// by the smaller pair of ids), then filled up with further merges "token +
// byte" in id order until the vocabulary has exactly vocab_size - 3 entries.
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include "core.h"
#include "mkmodel.h"

// ---- presets and validation -----------------------------------------------------------

static void spec_base(struct tdm_mkmodel_spec *s)
{
    memset(s, 0, sizeof *s);
    s->arch = TDM_ARCH_QWEN2;
    s->attention_bias = -1;
    s->tie_word_embeddings = true;
    s->rope_theta = 1e6;
    s->rms_norm_eps = 1e-6f;
    s->rope_factor = 8.0f;
    s->rope_low_freq_factor = 1.0f;
    s->rope_high_freq_factor = 4.0f;
    s->rope_original_max_pos = 8192;
    s->dtype = TDM_DTYPE_BF16;
    s->seed = 1;
}

int tdm_mkmodel_preset(struct tdm_mkmodel_spec *s, const char *name)
{
    spec_base(s);
    if (strcmp(name, "tiny") == 0) {
        s->hidden_size = 64;
        s->intermediate_size = 128;
        s->num_layers = 2;
        s->num_heads = 4;
        s->num_kv_heads = 2;
        s->vocab_size = 512;
        s->max_position_embeddings = 4096;
        return TDM_OK;
    }
    if (strcmp(name, "demo") == 0) {
        // `tandem up`'s demo model: small enough to load in well under a second
        // and stream quickly on two cores, big enough (4 layers, a 4096-token
        // vocabulary, 4k context) to exercise every part of the stack.
        s->hidden_size = 256;
        s->intermediate_size = 768;
        s->num_layers = 4;
        s->num_heads = 4;
        s->num_kv_heads = 2;
        s->vocab_size = 4096;
        s->max_position_embeddings = 4096;
        s->seed = 20261202;
        return TDM_OK;
    }
    if (strcmp(name, "qwen2.5-0.5b") == 0) {
        s->hidden_size = 896;
        s->intermediate_size = 4864;
        s->num_layers = 24;
        s->num_heads = 14;
        s->num_kv_heads = 2;
        s->vocab_size = 151936;
        s->max_position_embeddings = 32768;
        return TDM_OK;
    }
    return TDM_EINVAL;
}

static int spec_head_dim(const struct tdm_mkmodel_spec *s)
{
    return s->head_dim > 0 ? s->head_dim : s->hidden_size / s->num_heads;
}

static bool spec_bias(const struct tdm_mkmodel_spec *s)
{
    if (s->arch == TDM_ARCH_QWEN2)
        return true; // Qwen2Attention always carries q/k/v biases
    return s->attention_bias == 1;
}

int tdm_mkmodel_validate(const struct tdm_mkmodel_spec *s, char *err, size_t errlen)
{
    if (s->hidden_size <= 0 || s->intermediate_size <= 0 || s->num_layers <= 0 ||
        s->num_heads <= 0 || s->num_kv_heads <= 0 || s->vocab_size <= 0 ||
        s->max_position_embeddings <= 0 || s->head_dim < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "mkmodel: every size must be positive");
    if (s->num_heads % s->num_kv_heads != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: num_kv_heads=%d does not divide num_heads=%d", s->num_kv_heads,
                          s->num_heads);
    if (s->head_dim == 0 && s->hidden_size % s->num_heads != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: num_heads=%d does not divide hidden_size=%d (give --head-dim)",
                          s->num_heads, s->hidden_size);
    if (spec_head_dim(s) % 2 != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "mkmodel: head_dim=%d must be even",
                          spec_head_dim(s));
    if (s->tokenizer_from == NULL && s->vocab_size < 259)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: vocab_size=%d leaves no room for 256 byte tokens and 3 "
                          "special tokens (need >= 259)",
                          s->vocab_size);
    if (s->rope_theta <= 0 || !(s->rms_norm_eps > 0))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: rope_theta and rms_norm_eps must be > 0");
    if (s->rope_llama3 &&
        (s->rope_factor <= 0 || s->rope_low_freq_factor <= 0 ||
         s->rope_high_freq_factor <= s->rope_low_freq_factor || s->rope_original_max_pos <= 0))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: llama3 rope scaling needs factor > 0, 0 < low_freq_factor < "
                          "high_freq_factor and original_max_position_embeddings > 0");
    return TDM_OK;
}

// ---- small helpers --------------------------------------------------------------------

static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

// Writes s as a JSON string literal (quotes included).
static void json_str(FILE *f, const char *s)
{
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"':
            fputs("\\\"", f);
            break;
        case '\\':
            fputs("\\\\", f);
            break;
        case '\n':
            fputs("\\n", f);
            break;
        case '\r':
            fputs("\\r", f);
            break;
        case '\t':
            fputs("\\t", f);
            break;
        default:
            if (*p < 0x20)
                fprintf(f, "\\u%04x", *p);
            else
                fputc(*p, f);
        }
    }
    fputc('"', f);
}

static int close_file(FILE *f, const char *path, char *err, size_t errlen)
{
    int bad = ferror(f);
    if (fclose(f) != 0 || bad)
        return tdm_seterr(err, errlen, TDM_EIO, "%s: write failed", path);
    return TDM_OK;
}

static FILE *open_out(const char *dir, const char *name, char **path_out, char *err, size_t errlen)
{
    char *path = tdm_path_join(dir, name);
    if (path == NULL) {
        tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        return NULL;
    }
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        tdm_seterr(err, errlen, TDM_EIO, "%s: %s", path, strerror(errno));
        free(path);
        return NULL;
    }
    *path_out = path;
    return f;
}

// ---- tokenizer: byte-level BPE ---------------------------------------------------------

static const char builtin_text[] =
    "The quick brown fox jumps over the lazy dog. A language model reads text as a "
    "sequence of tokens and predicts the next one. When the model is served, many "
    "requests share the same machine: the server batches them together, keeps the keys "
    "and values of every token in a paged cache, and streams each new token back to the "
    "user as soon as it is ready. This is the story of a small town by the sea. In the "
    "morning the fishermen went out on their boats, and in the evening they came back "
    "with the catch of the day. The children played on the beach, the old men talked in "
    "the square, and the women sold bread and fruit at the market. Nothing ever seemed "
    "to change, and that was what the people of the town liked most about it. There is "
    "a time for every thing, and a season for every purpose under the heaven. Hello, "
    "world! How are you today? I am fine, thank you, and you? We would like to thank "
    "everyone who helped with this work, and all the people who tested it and reported "
    "what they found. Numbers like 1, 2, 3, 10, 42, 100 and 2024 appear in text too, as "
    "do dates, prices ($5.99), and lists: first, second, third. The weather will be "
    "sunny in the morning with some clouds in the afternoon, and rain is expected "
    "during the night. Please remember to bring your umbrella when you go out.\n"
    "def main():\n    print(\"hello\")\n    return 0\n";

// The GPT-2 byte <-> unicode mapping: printable bytes map to themselves, the
// others to U+0100 upwards in byte order.
static void byte_unicode_table(int cp[256])
{
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
        cp[b] = printable ? b : 256 + n++;
    }
}

static void utf8_put(char *out, int cp)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

struct vocab {
    char **str; // [cap] token strings (byte-level unicode, UTF-8)
    int n, cap;
    int *slots; // [nslots] open-addressing set of ids, -1 = empty
    size_t nslots;
    char **merges; // [nmerges] "a b"
    int nmerges, cap_merges;
};

static int vocab_find(const struct vocab *v, const char *s)
{
    size_t mask = v->nslots - 1;
    for (size_t i = fnv1a(s, strlen(s)) & mask;; i = (i + 1) & mask) {
        if (v->slots[i] < 0)
            return -1;
        if (strcmp(v->str[v->slots[i]], s) == 0)
            return v->slots[i];
    }
}

// Adds s (taking ownership) as the next id; the caller checked it is new.
static int vocab_add(struct vocab *v, char *s)
{
    if (v->n == v->cap)
        return TDM_ECAPACITY;
    size_t mask = v->nslots - 1;
    size_t i = fnv1a(s, strlen(s)) & mask;
    while (v->slots[i] >= 0)
        i = (i + 1) & mask;
    v->slots[i] = v->n;
    v->str[v->n++] = s;
    return TDM_OK;
}

static char *concat2(const char *a, const char *b, char sep)
{
    size_t la = strlen(a), lb = strlen(b);
    char *s = malloc(la + lb + 2);
    if (s == NULL)
        return NULL;
    memcpy(s, a, la);
    size_t k = la;
    if (sep)
        s[k++] = sep;
    memcpy(s + k, b, lb + 1);
    return s;
}

// Records merge "a b" and, unless a+b is already a token, the new token.
// *added tells whether the vocabulary grew.
static int vocab_merge(struct vocab *v, int a, int b, int *merged_id, bool *added)
{
    char *tok = concat2(v->str[a], v->str[b], 0);
    char *m = concat2(v->str[a], v->str[b], ' ');
    if (tok == NULL || m == NULL || v->nmerges == v->cap_merges) {
        free(tok);
        free(m);
        return TDM_ENOMEM;
    }
    int id = vocab_find(v, tok);
    *added = id < 0;
    if (id < 0) {
        id = v->n;
        if (vocab_add(v, tok) != TDM_OK) {
            free(tok);
            free(m);
            return TDM_ECAPACITY;
        }
    } else {
        free(tok);
    }
    v->merges[v->nmerges++] = m;
    *merged_id = id;
    return TDM_OK;
}

static void vocab_fini(struct vocab *v)
{
    for (int i = 0; i < v->n; i++)
        free(v->str[i]);
    for (int i = 0; i < v->nmerges; i++)
        free(v->merges[i]);
    free(v->str);
    free(v->slots);
    free(v->merges);
}

// Splits the built-in text roughly as the Qwen2 regex does (a word with an
// optional leading space, single digits, punctuation runs with an optional
// leading space, whitespace runs); merges are learned inside these pieces.
static size_t next_piece(const char *s, size_t i, size_t n)
{
#define IS_ALPHA(ch) (((ch) >= 'a' && (ch) <= 'z') || ((ch) >= 'A' && (ch) <= 'Z'))
#define IS_DIGIT(ch) ((ch) >= '0' && (ch) <= '9')
#define IS_SPACE(ch) ((ch) == ' ' || (ch) == '\n' || (ch) == '\t' || (ch) == '\r')
    size_t j = i;
    if (IS_DIGIT(s[j]))
        return j + 1;
    if (s[j] == ' ' && j + 1 < n && !IS_SPACE(s[j + 1]) && !IS_DIGIT(s[j + 1]))
        j++;
    if (IS_ALPHA(s[j])) {
        while (j < n && IS_ALPHA(s[j]))
            j++;
        return j;
    }
    if (IS_SPACE(s[j])) {
        while (j < n && IS_SPACE(s[j]))
            j++;
        return j;
    }
    while (j < n && !IS_ALPHA(s[j]) && !IS_DIGIT(s[j]) && !IS_SPACE(s[j]))
        j++;
    return j;
#undef IS_ALPHA
#undef IS_DIGIT
#undef IS_SPACE
}

struct pair_count {
    int a, b;
    long count;
};

static int pair_cmp(const void *x, const void *y)
{
    const struct pair_count *p = x, *q = y;
    if (p->a != q->a)
        return p->a < q->a ? -1 : 1;
    if (p->b != q->b)
        return p->b < q->b ? -1 : 1;
    return 0;
}

struct word {
    int *sym; // current symbols
    int n;
    int count; // occurrences in the text
};

// The 256 byte tokens, ids 0..255, in GPT-2's byte-to-unicode spelling.
static int add_byte_tokens(struct vocab *v, char *err, size_t errlen)
{
    int cp[256];
    byte_unicode_table(cp);
    for (int b = 0; b < 256; b++) {
        char buf[4];
        utf8_put(buf, cp[b]);
        char *s = strdup(buf);
        if (s == NULL || vocab_add(v, s) != TDM_OK) {
            free(s);
            return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        }
    }
    return TDM_OK;
}

// Unique pieces of the built-in text with their counts, as byte symbols, into
// words[0..*nwords) (words has room for one per byte of the text). On failure
// *nwords still counts the words to free.
static int collect_words(struct word *words, int *nwords, char *err, size_t errlen)
{
    size_t n = strlen(builtin_text);
    for (size_t i = 0; i < n;) {
        size_t j = next_piece(builtin_text, i, n);
        int len = (int)(j - i);
        int w;
        for (w = 0; w < *nwords; w++) {
            if (words[w].n != len)
                continue;
            int k = 0;
            while (k < len && words[w].sym[k] == (unsigned char)builtin_text[i + k])
                k++;
            if (k == len)
                break;
        }
        if (w == *nwords) {
            words[w].sym = malloc((size_t)len * sizeof(int));
            if (words[w].sym == NULL)
                return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
            for (int k = 0; k < len; k++)
                words[w].sym[k] = (unsigned char)builtin_text[i + k];
            words[w].n = len;
            (*nwords)++;
        }
        words[w].count++;
        i = j;
    }
    return TDM_OK;
}

// The most frequent adjacent pair (count >= 2) over the words, into *ba, *bb
// (-1: none). pairs has room for every adjacent pair.
static void most_frequent_pair(const struct word *words, int nwords, struct pair_count *pairs,
                               int *ba, int *bb)
{
    // Every adjacent pair with its word's count, sorted; runs are summed.
    int np = 0;
    for (int w = 0; w < nwords; w++)
        for (int k = 0; k + 1 < words[w].n; k++)
            pairs[np++] = (struct pair_count){words[w].sym[k], words[w].sym[k + 1], words[w].count};
    qsort(pairs, (size_t)np, sizeof *pairs, pair_cmp);
    long best = 1;
    *ba = -1;
    *bb = -1;
    for (int i = 0; i < np;) {
        int j = i;
        long cnt = 0;
        while (j < np && pairs[j].a == pairs[i].a && pairs[j].b == pairs[i].b)
            cnt += pairs[j++].count;
        if (cnt > best) { // runs come in (a, b) order: ties keep the smaller pair
            best = cnt;
            *ba = pairs[i].a;
            *bb = pairs[i].b;
        }
        i = j;
    }
}

// Replaces every adjacent (a, b) in the words by id.
static void apply_merge(struct word *words, int nwords, int a, int b, int id)
{
    for (int w = 0; w < nwords; w++) {
        int o = 0;
        for (int k = 0; k < words[w].n; k++) {
            if (k + 1 < words[w].n && words[w].sym[k] == a && words[w].sym[k + 1] == b) {
                words[w].sym[o++] = id;
                k++;
            } else {
                words[w].sym[o++] = words[w].sym[k];
            }
        }
        words[w].n = o;
    }
}

// Learn merges: most frequent adjacent pair (count >= 2) first, until the
// vocabulary holds target tokens or no pair repeats.
static int learn_merges(struct vocab *v, int target, struct word *words, int nwords, char *err,
                        size_t errlen)
{
    int total_syms = 0;
    for (int w = 0; w < nwords; w++)
        total_syms += words[w].n;
    struct pair_count *pairs = malloc((size_t)(total_syms + 1) * sizeof *pairs);
    if (pairs == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
    int rc = TDM_OK;
    while (v->n < target) {
        int ba, bb;
        most_frequent_pair(words, nwords, pairs, &ba, &bb);
        if (ba < 0)
            break;
        int id;
        bool added;
        if ((rc = vocab_merge(v, ba, bb, &id, &added)) != TDM_OK) {
            rc = tdm_seterr(err, errlen, rc, "mkmodel: out of memory");
            break;
        }
        apply_merge(words, nwords, ba, bb, id);
    }
    free(pairs);
    return rc;
}

// Fill up with merges token + byte (letters first), in id order.
static int fill_byte_merges(struct vocab *v, int target, char *err, size_t errlen)
{
    static const char order[] = "etaoinshrdlcumwfgypbvkjxqzETAOINSHRDLCUMWFGYPBVKJXQZ";
    int byte_order[256], nb = 0;
    bool used[256] = {false};
    for (const char *p = order; *p; p++) {
        byte_order[nb++] = (unsigned char)*p;
        used[(unsigned char)*p] = true;
    }
    for (int b = 0; b < 256; b++)
        if (!used[b])
            byte_order[nb++] = b;
    for (int i = 0; v->n < target && i < v->n; i++) {
        for (int k = 0; k < 256 && v->n < target; k++) {
            int b = byte_order[k];
            char *cand = concat2(v->str[i], v->str[b], 0);
            if (cand == NULL)
                return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
            bool exists = vocab_find(v, cand) >= 0;
            free(cand);
            if (exists)
                continue;
            int id;
            bool added;
            int rc = vocab_merge(v, i, b, &id, &added);
            if (rc != TDM_OK)
                return tdm_seterr(err, errlen, rc, "mkmodel: out of memory");
        }
    }
    return TDM_OK;
}

static int build_vocab(struct vocab *v, int target, char *err, size_t errlen)
{
    int rc = add_byte_tokens(v, err, errlen);
    if (rc != TDM_OK)
        return rc;
    struct word *words = calloc(strlen(builtin_text), sizeof *words);
    if (words == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
    int nwords = 0;
    rc = collect_words(words, &nwords, err, errlen);
    if (rc == TDM_OK)
        rc = learn_merges(v, target, words, nwords, err, errlen);
    if (rc == TDM_OK)
        rc = fill_byte_merges(v, target, err, errlen);
    for (int w = 0; w < nwords; w++)
        free(words[w].sym);
    free(words);
    return rc;
}

static const char *const special_tokens[3] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};

// ChatML, and with tools the Hermes convention Qwen2.5 uses (written here, not
// copied): the tools' signatures in a system block, assistant calls as
// <tool_call>{"name", "arguments"}</tool_call>, tool results as a user turn in
// <tool_response> tags. Without tools it renders exactly the plain ChatML of
// earlier demo models. `tandem up` reads "<tool_call>" in it and turns on tool
// choice "auto" with the hermes parser (issue 28, item 3).
static const char chatml_template[] =
    "{%- if tools %}{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}"
    "{% endif %}"
    "{{ '# Tools\\n\\nThese functions are available; call any of them when it helps the user. "
    "Their signatures, in <tools></tools> tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nTo call one, write its name and a JSON object of arguments in "
    "<tool_call></tool_call> tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{ '<|im_start|>assistant' }}{% if message['content'] %}"
    "{{ '\\n' + message['content'] }}{% endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{% set f = call['function'] if call['function'] is defined else call %}"
    "{{ '\\n<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{ f['arguments'] }}{% else %}"
    "{{ f['arguments'] | tojson }}{% endif %}{{ '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{%- elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endif %}{%- endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

static const char split_regex[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
    "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

int tdm_mkmodel_write_tokenizer(int vocab_size, const char *dir, char *err, size_t errlen)
{
    if (vocab_size < 259)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "mkmodel: vocab_size=%d is below 259 (256 bytes + 3 special tokens)",
                          vocab_size);
    int target = vocab_size - 3;
    struct vocab v = {0};
    int rc;
    char *path = NULL;
    v.cap = target;
    v.cap_merges = target;
    v.nslots = 1;
    while (v.nslots < (size_t)target * 2)
        v.nslots <<= 1;
    v.str = calloc((size_t)v.cap, sizeof *v.str);
    v.merges = calloc((size_t)v.cap_merges, sizeof *v.merges);
    v.slots = malloc(v.nslots * sizeof *v.slots);
    if (!v.str || !v.merges || !v.slots) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        goto out;
    }
    memset(v.slots, 0xff, v.nslots * sizeof *v.slots);
    if ((rc = build_vocab(&v, target, err, errlen)) != TDM_OK)
        goto out;
    if (v.n != target) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "mkmodel: could only build %d of %d tokens", v.n,
                        target);
        goto out;
    }

    FILE *f = open_out(dir, "tokenizer.json", &path, err, errlen);
    if (f == NULL) {
        rc = TDM_EIO;
        goto out;
    }
    fputs("{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n"
          "  \"added_tokens\": [",
          f);
    for (int i = 0; i < 3; i++)
        fprintf(f,
                "%s\n    {\"id\": %d, \"content\": \"%s\", \"single_word\": false, "
                "\"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}",
                i ? "," : "", target + i, special_tokens[i]);
    fputs("\n  ],\n  \"normalizer\": {\"type\": \"NFC\"},\n"
          "  \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [\n"
          "    {\"type\": \"Split\", \"pattern\": {\"Regex\": ",
          f);
    json_str(f, split_regex);
    fputs("}, \"behavior\": \"Isolated\", \"invert\": false},\n"
          "    {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, "
          "\"use_regex\": false}]},\n"
          "  \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
          "\"trim_offsets\": false, \"use_regex\": false},\n"
          "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
          "\"trim_offsets\": false, \"use_regex\": false},\n"
          "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
          "\"continuing_subword_prefix\": \"\", \"end_of_word_suffix\": \"\", "
          "\"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n"
          "    \"vocab\": {",
          f);
    for (int i = 0; i < v.n; i++) {
        fputs(i ? ", " : "", f);
        json_str(f, v.str[i]);
        fprintf(f, ": %d", i);
    }
    fputs("},\n    \"merges\": [", f);
    for (int i = 0; i < v.nmerges; i++) {
        fputs(i ? ", " : "", f);
        json_str(f, v.merges[i]);
    }
    fputs("]\n  }\n}\n", f);
    if ((rc = close_file(f, path, err, errlen)) != TDM_OK)
        goto out;
    free(path);
    path = NULL;

    f = open_out(dir, "tokenizer_config.json", &path, err, errlen);
    if (f == NULL) {
        rc = TDM_EIO;
        goto out;
    }
    fputs("{\n  \"add_bos_token\": false,\n  \"add_prefix_space\": false,\n"
          "  \"added_tokens_decoder\": {",
          f);
    for (int i = 0; i < 3; i++)
        fprintf(f,
                "%s\n    \"%d\": {\"content\": \"%s\", \"lstrip\": false, \"normalized\": false, "
                "\"rstrip\": false, \"single_word\": false, \"special\": true}",
                i ? "," : "", target + i, special_tokens[i]);
    fputs("\n  },\n  \"additional_special_tokens\": [\"<|im_start|>\", \"<|im_end|>\"],\n"
          "  \"bos_token\": null,\n  \"chat_template\": ",
          f);
    json_str(f, chatml_template);
    fputs(",\n  \"clean_up_tokenization_spaces\": false,\n  \"eos_token\": \"<|im_end|>\",\n"
          "  \"errors\": \"replace\",\n  \"model_max_length\": 32768,\n"
          "  \"pad_token\": \"<|endoftext|>\",\n  \"split_special_tokens\": false,\n"
          "  \"tokenizer_class\": \"Qwen2Tokenizer\",\n  \"unk_token\": null\n}\n",
          f);
    rc = close_file(f, path, err, errlen);
out:
    free(path);
    vocab_fini(&v);
    return rc;
}

// ---- copying a real tokenizer -----------------------------------------------------------

static int copy_file(const char *src_dir, const char *dst_dir, const char *name, bool required,
                     char *err, size_t errlen)
{
    char *src = tdm_path_join(src_dir, name), *dst = tdm_path_join(dst_dir, name);
    char *buf = NULL;
    size_t len;
    int rc;
    if (src == NULL || dst == NULL) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        goto out;
    }
    rc = tdm_read_file(src, &buf, &len, err, errlen);
    if (rc == TDM_ENOTFOUND && !required) {
        rc = TDM_OK;
        goto out;
    }
    if (rc != TDM_OK)
        goto out;
    FILE *f = fopen(dst, "w");
    if (f == NULL) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: %s", dst, strerror(errno));
        goto out;
    }
    fwrite(buf, 1, len, f);
    rc = close_file(f, dst, err, errlen);
out:
    free(src);
    free(dst);
    free(buf);
    return rc;
}

// Finds the largest id in tokenizer.json text and the ids of known special tokens.
// The scan is textual ("content": "<|...|>" next to "id": N within one object),
// enough for the HF layout and without a JSON dependency in this tool.
static int scan_tokenizer(const char *json, int *max_id, int *eos, int *num_eos, int *bos)
{
    *max_id = -1;
    *num_eos = 0;
    *bos = -1;
    // Every vocab entry ends with ": N" and every added token has "id": N.
    for (const char *p = json; (p = strchr(p, ':')) != NULL; p++) {
        const char *q = p + 1;
        while (*q == ' ')
            q++;
        if (*q < '0' || *q > '9')
            continue;
        long id = strtol(q, NULL, 10);
        if (id > *max_id && id < 100000000)
            *max_id = (int)id;
    }
    static const char *const eos_names[] = {"<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                                            "<|end_of_text|>"};
    for (int k = 0; k < 4; k++) {
        char pat[64];
        snprintf(pat, sizeof pat, "\"content\": \"%s\"", eos_names[k]);
        const char *hit = strstr(json, pat);
        if (hit == NULL)
            continue;
        // Walk back to this object's "id".
        const char *obj = hit;
        while (obj > json && *obj != '{')
            obj--;
        const char *idp = strstr(obj, "\"id\":");
        if (idp == NULL || idp > hit + 200)
            continue;
        int id = (int)strtol(idp + 5, NULL, 10);
        if (*num_eos < TDM_MAX_EOS)
            eos[(*num_eos)++] = id;
        if (k == 1 || k == 3)
            *bos = id;
    }
    return TDM_OK;
}

// ---- weights ---------------------------------------------------------------------------

struct tensor_list {
    struct tdm_tensor *t; // [cap]
    char **names;         // owned names
    int n, cap;
};

// Appends a tensor of shape [d0] or [d0][d1] drawn uniformly with mean `mean`
// and standard deviation `std` (uniform on mean +- sqrt(3) std), seeded by the
// name so every tensor is the same whatever the others are.
static int add_tensor(struct tensor_list *tl, const struct tdm_mkmodel_spec *s, const char *name,
                      int64_t d0, int64_t d1, float mean, float std)
{
    if (tl->n == tl->cap)
        return TDM_ECAPACITY;
    size_t count = (size_t)d0 * (size_t)(d1 > 0 ? d1 : 1);
    size_t esz = tdm_dtype_size(s->dtype);
    void *data = malloc(count * esz);
    char *nm = strdup(name);
    if (data == NULL || nm == NULL) {
        free(data);
        free(nm);
        return TDM_ENOMEM;
    }
    uint64_t state = s->seed * 0x9e3779b97f4a7c15ull ^ fnv1a(name, strlen(name));
    float half_width = sqrtf(3.0f) * std;
    for (size_t i = 0; i < count; i++) {
        // 24 random bits -> uniform in [-1, 1).
        float u = (float)(splitmix64(&state) >> 40) * (1.0f / 8388608.0f) - 1.0f;
        float x = mean + half_width * u;
        switch (s->dtype) {
        case TDM_DTYPE_F32:
            ((float *)data)[i] = x;
            break;
        case TDM_DTYPE_F16:
            ((uint16_t *)data)[i] = tdm_f32_to_f16(x);
            break;
        case TDM_DTYPE_BF16:
        default:
            ((uint16_t *)data)[i] = tdm_f32_to_bf16(x);
            break;
        }
    }
    struct tdm_tensor *t = &tl->t[tl->n];
    memset(t, 0, sizeof *t);
    t->name = nm;
    t->dtype = s->dtype;
    t->ndim = d1 > 0 ? 2 : 1;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->data = data;
    t->nbytes = count * esz;
    tl->names[tl->n] = nm;
    tl->n++;
    return TDM_OK;
}

static int write_weights(const struct tdm_mkmodel_spec *s, const char *dir, char *err,
                         size_t errlen)
{
    int hd = spec_head_dim(s);
    int64_t H = s->hidden_size, I = s->intermediate_size, V = s->vocab_size;
    int64_t Q = (int64_t)s->num_heads * hd, KV = (int64_t)s->num_kv_heads * hd;
    struct tensor_list tl = {0};
    tl.cap = 3 + 12 * s->num_layers;
    tl.t = calloc((size_t)tl.cap, sizeof *tl.t);
    tl.names = calloc((size_t)tl.cap, sizeof *tl.names);
    char *path = tdm_path_join(dir, "model.safetensors");
    int rc = TDM_OK;
    if (!tl.t || !tl.names || !path) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        goto out;
    }
    float head_std = 4.0f / sqrtf((float)H);
    char nm[128];
#define ADD(name, d0, d1, mean, std)                                                               \
    do {                                                                                           \
        if ((rc = add_tensor(&tl, s, name, d0, d1, mean, std)) != TDM_OK) {                        \
            rc = tdm_seterr(err, errlen, rc, "mkmodel: out of memory for %s", name);               \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)
#define LADD(suffix, d0, d1, mean, std)                                                            \
    do {                                                                                           \
        snprintf(nm, sizeof nm, "model.layers.%d.%s", l, suffix);                                  \
        ADD(nm, d0, d1, mean, std);                                                                \
    } while (0)
    ADD("model.embed_tokens.weight", V, H, 0.0f, head_std);
    for (int l = 0; l < s->num_layers; l++) {
        float in_std = 1.0f / sqrtf((float)H);
        LADD("input_layernorm.weight", H, 0, 1.0f, 0.1f);
        LADD("self_attn.q_proj.weight", Q, H, 0.0f, in_std);
        LADD("self_attn.k_proj.weight", KV, H, 0.0f, in_std);
        LADD("self_attn.v_proj.weight", KV, H, 0.0f, in_std);
        if (spec_bias(s)) {
            LADD("self_attn.q_proj.bias", Q, 0, 0.0f, 0.5f);
            LADD("self_attn.k_proj.bias", KV, 0, 0.0f, 0.5f);
            LADD("self_attn.v_proj.bias", KV, 0, 0.0f, 0.5f);
        }
        LADD("self_attn.o_proj.weight", H, Q, 0.0f, 1.0f / sqrtf((float)Q));
        LADD("post_attention_layernorm.weight", H, 0, 1.0f, 0.1f);
        LADD("mlp.gate_proj.weight", I, H, 0.0f, in_std);
        LADD("mlp.up_proj.weight", I, H, 0.0f, in_std);
        LADD("mlp.down_proj.weight", H, I, 0.0f, 1.0f / sqrtf((float)I));
    }
    ADD("model.norm.weight", H, 0, 1.0f, 0.1f);
    if (!s->tie_word_embeddings)
        ADD("lm_head.weight", V, H, 0.0f, head_std);
#undef LADD
#undef ADD
    rc = tdm_st_write(path, tl.t, (size_t)tl.n, err, errlen);
out:
    for (int i = 0; i < tl.n; i++) {
        free((void *)tl.t[i].data);
        free(tl.names[i]);
    }
    free(tl.t);
    free(tl.names);
    free(path);
    return rc;
}

// ---- config files ------------------------------------------------------------------------

static int write_configs(const struct tdm_mkmodel_spec *s, const char *dir, const int *eos,
                         int num_eos, int bos, char *err, size_t errlen)
{
    char *path = NULL;
    bool qwen = s->arch == TDM_ARCH_QWEN2;
    FILE *f = open_out(dir, "config.json", &path, err, errlen);
    if (f == NULL)
        return TDM_EIO;
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n",
            qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM", qwen ? "qwen2" : "llama");
    fprintf(f,
            "  \"hidden_act\": \"silu\",\n  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n"
            "  \"num_hidden_layers\": %d,\n  \"num_attention_heads\": %d,\n"
            "  \"num_key_value_heads\": %d,\n",
            s->hidden_size, s->intermediate_size, s->num_layers, s->num_heads, s->num_kv_heads);
    if (s->head_dim > 0 || !qwen)
        fprintf(f, "  \"head_dim\": %d,\n", spec_head_dim(s));
    if (!qwen)
        fprintf(f, "  \"attention_bias\": %s,\n  \"mlp_bias\": false,\n",
                spec_bias(s) ? "true" : "false");
    fprintf(f,
            "  \"vocab_size\": %d,\n  \"max_position_embeddings\": %d,\n"
            "  \"rms_norm_eps\": %.7g,\n  \"rope_theta\": %.17g,\n",
            s->vocab_size, s->max_position_embeddings, (double)s->rms_norm_eps, s->rope_theta);
    if (s->rope_llama3)
        fprintf(f,
                "  \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": %.9g, "
                "\"low_freq_factor\": %.9g, \"high_freq_factor\": %.9g, "
                "\"original_max_position_embeddings\": %d},\n",
                (double)s->rope_factor, (double)s->rope_low_freq_factor,
                (double)s->rope_high_freq_factor, s->rope_original_max_pos);
    else
        fputs("  \"rope_scaling\": null,\n", f);
    fprintf(f, "  \"tie_word_embeddings\": %s,\n", s->tie_word_embeddings ? "true" : "false");
    if (qwen)
        fprintf(f,
                "  \"use_sliding_window\": false,\n  \"sliding_window\": %d,\n"
                "  \"max_window_layers\": %d,\n",
                s->max_position_embeddings, s->num_layers);
    if (bos >= 0)
        fprintf(f, "  \"bos_token_id\": %d,\n", bos);
    if (num_eos > 0)
        fprintf(f, "  \"eos_token_id\": %d,\n", eos[0]);
    fprintf(f,
            "  \"attention_dropout\": 0.0,\n  \"initializer_range\": 0.02,\n"
            "  \"use_cache\": true,\n  \"torch_dtype\": \"%s\",\n"
            "  \"transformers_version\": \"4.49.0\",\n  \"_tandem_mkmodel_seed\": %llu\n}\n",
            s->dtype == TDM_DTYPE_F32 ? "float32"
                                      : (s->dtype == TDM_DTYPE_F16 ? "float16" : "bfloat16"),
            (unsigned long long)s->seed);
    int rc = close_file(f, path, err, errlen);
    free(path);
    path = NULL;
    if (rc != TDM_OK)
        return rc;

    f = open_out(dir, "generation_config.json", &path, err, errlen);
    if (f == NULL)
        return TDM_EIO;
    fputs("{\n", f);
    if (bos >= 0)
        fprintf(f, "  \"bos_token_id\": %d,\n  \"pad_token_id\": %d,\n", bos, bos);
    fputs("  \"eos_token_id\": [", f);
    for (int i = 0; i < num_eos; i++)
        fprintf(f, "%s%d", i ? ", " : "", eos[i]);
    fputs("],\n  \"do_sample\": false,\n  \"transformers_version\": \"4.49.0\"\n}\n", f);
    rc = close_file(f, path, err, errlen);
    free(path);
    return rc;
}

int tdm_mkmodel_write(const struct tdm_mkmodel_spec *s, const char *out_dir, char *err,
                      size_t errlen)
{
    int rc = tdm_mkmodel_validate(s, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (mkdir(out_dir, 0755) != 0 && errno != EEXIST)
        return tdm_seterr(err, errlen, TDM_EIO, "%s: %s", out_dir, strerror(errno));

    int eos[TDM_MAX_EOS], num_eos = 0, bos = -1;
    if (s->tokenizer_from != NULL) {
        char *tj = tdm_path_join(s->tokenizer_from, "tokenizer.json");
        char *json = NULL;
        size_t len;
        if (tj == NULL)
            return tdm_seterr(err, errlen, TDM_ENOMEM, "mkmodel: out of memory");
        rc = tdm_read_file(tj, &json, &len, err, errlen);
        free(tj);
        if (rc != TDM_OK)
            return rc;
        int max_id;
        scan_tokenizer(json, &max_id, eos, &num_eos, &bos);
        free(json);
        if (max_id >= s->vocab_size)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "mkmodel: the tokenizer in %s has ids up to %d, more than "
                              "vocab_size=%d holds",
                              s->tokenizer_from, max_id, s->vocab_size);
        if ((rc = copy_file(s->tokenizer_from, out_dir, "tokenizer.json", true, err, errlen)) ||
            (rc = copy_file(s->tokenizer_from, out_dir, "tokenizer_config.json", false, err,
                            errlen)))
            return rc;
    } else {
        if ((rc = tdm_mkmodel_write_tokenizer(s->vocab_size, out_dir, err, errlen)) != TDM_OK)
            return rc;
        int base = s->vocab_size - 3;
        eos[0] = base + 2; // <|im_end|>
        eos[1] = base;     // <|endoftext|>
        num_eos = 2;
        bos = base;
    }
    if ((rc = write_configs(s, out_dir, eos, num_eos, bos, err, errlen)) != TDM_OK)
        return rc;
    return write_weights(s, out_dir, err, errlen);
}

void tdm_mkmodel_remove(const char *dir)
{
    static const char *const files[] = {"config.json", "model.safetensors",
                                        "generation_config.json", "tokenizer.json",
                                        "tokenizer_config.json"};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        char *p = tdm_path_join(dir, files[i]);
        if (p)
            unlink(p);
        free(p);
    }
    rmdir(dir);
}
