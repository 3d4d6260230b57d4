// SPDX-License-Identifier: Apache-2.0
// tokenizer tests. Expected ids come from outside this C code: the Qwen2 ones
// were looked up by hand in vocab.json (a Python one-liner applying GPT-2's
// byte map, then a dict lookup) or taken from the JavaScript reference
// (ref/bpe_ref.mjs); the expected U+FFFD replacements are Python's
// bytes.decode('utf-8', 'replace'). A tiny synthetic tokenizer.json, written
// by the test itself, covers what Qwen2 does not use (merges as pairs,
// ignore_merges, TemplateProcessing BOS, lstrip/rstrip/single_word/normalized
// added tokens, ByteLevel prefix space, no decoder) with ids derived by hand
// in the comments. Tests needing the shared Qwen2 files skip when absent.
#include "tokenizer.h"
#include "tokenizer_impl.h"

#include "core.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_skip.h"

#define QWEN_DIR TANDEM_SHARED_DIR "/models/qwen2-tokenizer"
#define CORPUS TANDEM_SOURCE_DIR "/common/text/tokenizer/ref/corpus.jsonl"

static struct tdm_tokenizer *qwen;

static struct tdm_tokenizer *need_qwen(void)
{
    if (!qwen) {
        char err[256];
        if (access(QWEN_DIR "/tokenizer.json", R_OK) != 0)
            return NULL;
        int rc = tdm_tok_load(&qwen, QWEN_DIR, err, sizeof err);
        if (rc)
            fail_msg("load: %s", err);
    }
    return qwen;
}

#define NEED_QWEN(tok)                                                                             \
    struct tdm_tokenizer *tok = need_qwen();                                                       \
    if (!tok) {                                                                                    \
        TDM_SKIP("the Qwen2 tokenizer in ../shared/models is absent");                          \
        return;                                                                                    \
    }

static void expect_ids(const struct tdm_tokenizer *tok, unsigned flags, const char *text,
                       size_t len, const int32_t *want, size_t n_want)
{
    int32_t *ids;
    size_t n;
    assert_int_equal(tdm_tok_encode_ex(tok, text, len, flags, &ids, &n), TDM_OK);
    if (n != n_want || memcmp(ids, want, n * sizeof *ids) != 0) {
        char got[512] = "";
        size_t o = 0;
        for (size_t i = 0; i < n && o + 16 < sizeof got; i++)
            o += (size_t)snprintf(got + o, sizeof got - o, "%d ", (int)ids[i]);
        free(ids);
        fail_msg("encode(\"%.*s\") = [%s], want %zu ids", (int)len, text, got, n_want);
    }
    free(ids);
}

#define EXPECT(tok, flags, text, ...)                                                              \
    do {                                                                                           \
        static const int32_t want_[] = {__VA_ARGS__};                                              \
        expect_ids(tok, flags, text, sizeof(text) - 1, want_, sizeof want_ / sizeof want_[0]);     \
    } while (0)

// Decoded text may hold NUL (the token of byte 0); *len_out gets the length.
static char *decode_len(const struct tdm_tokenizer *tok, const int32_t *ids, size_t n, bool skip,
                        size_t *len_out)
{
    char *s;
    assert_int_equal(tdm_tok_decode(tok, ids, n, skip, &s, len_out), TDM_OK);
    assert_int_equal(s[*len_out], 0);
    return s;
}

static char *decode_str(const struct tdm_tokenizer *tok, const int32_t *ids, size_t n, bool skip)
{
    size_t len;
    char *s = decode_len(tok, ids, n, skip, &len);
    assert_int_equal(strlen(s), len);
    return s;
}

// ---- Qwen2: hand-derived ids ----------------------------------------------------------

static void test_qwen_known_ids(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    // vocab.json: "Hello" 9707, "Ġworld" 1879, "!" 0, "user" 872, "Ċ" 198, "Hi" 13048.
    EXPECT(tok, 0, "Hello world", 9707, 1879);
    EXPECT(tok, 0, "Hello world!", 9707, 1879, 0);
    // Qwen2 splits every digit: "1".."5" are 16..20.
    EXPECT(tok, 0, "12345", 16, 17, 18, 19, 20);
    // Special tokens are cut out before BPE: <|im_start|> 151644, <|im_end|> 151645.
    EXPECT(tok, 0, "<|im_start|>user\nHi<|im_end|>", 151644, 872, 198, 13048, 151645);
    // "你好" 108386, "，" 3837, "世界" 99489 (byte-level strings looked up in vocab.json).
    EXPECT(tok, 0, "你好，世界", 108386, 3837, 99489);
    // NFC: e + U+0301 becomes é, "Ã©" 963; the JS reference gives the same.
    EXPECT(tok, 0, "e\xcc\x81", 963);
    EXPECT(tok, 0, "\xc3\xa9", 963);
    // Qwen2's post-processor adds nothing, with or without add_special_tokens.
    EXPECT(tok, TDM_TOK_ADD_SPECIAL, "Hello world", 9707, 1879);
    // split_special: the text of <|im_end|> is BPE'd like any other text.
    int32_t *ids;
    size_t n;
    assert_int_equal(tdm_tok_encode_ex(tok, "<|im_end|>", 10, TDM_TOK_SPLIT_SPECIAL, &ids, &n),
                     TDM_OK);
    assert_true(n > 1);
    for (size_t i = 0; i < n; i++)
        assert_true(ids[i] < 151643);
    free(ids);
    // The empty string has no ids and a heap array all the same.
    assert_int_equal(tdm_tok_encode(tok, "", 0, true, &ids, &n), TDM_OK);
    assert_int_equal(n, 0);
    free(ids);
}

static void test_qwen_metadata(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    assert_int_equal(tdm_tok_vocab_size(tok), 151665);
    assert_int_equal(tdm_tok_eos_id(tok), 151645); // <|im_end|>
    assert_int_equal(tdm_tok_pad_id(tok), 151643); // <|endoftext|>
    assert_int_equal(tdm_tok_bos_id(tok), -1);     // bos_token is null
    assert_non_null(tdm_tok_chat_template(tok));
    assert_non_null(strstr(tdm_tok_chat_template(tok), "You are Qwen, created by Alibaba Cloud."));
    assert_int_equal(tdm_tok_piece_to_id(tok, "Hello"), 9707);
    assert_int_equal(tdm_tok_piece_to_id(tok, "<|im_end|>"), 151645);
    assert_int_equal(tdm_tok_piece_to_id(tok, "no such piece"), -1);
    assert_string_equal(tdm_tok_id_to_piece(tok, 1879), "\xc4\xa0world");
    assert_string_equal(tdm_tok_id_to_piece(tok, 151644), "<|im_start|>");
    assert_null(tdm_tok_id_to_piece(tok, 151665));
    assert_null(tdm_tok_id_to_piece(tok, -1));
    assert_true(tdm_tok_is_special(tok, 151645));
    assert_false(tdm_tok_is_special(tok, 151657)); // <tool_call> is special=false
    assert_false(tdm_tok_is_special(tok, 9707));
}

// ---- invalid UTF-8 ------------------------------------------------------------------------

struct bad_utf8 {
    const char *in;
    size_t len;
    const char *python; // bytes.decode('utf-8', 'replace').encode()
};

#define R "\xef\xbf\xbd"
static const struct bad_utf8 bad_cases[] = {
    {"a\xff"
     "b",
     3, "a" R "b"},
    {"\xe4\xbd", 2, R},
    {"\xe4\xbd\xe4\xbd", 4, R R},
    {"x\xc0\xafy", 4, "x" R R "y"},
    {"\xed\xa0\x80", 3, R R R},
    {"\xf4\x90\x80\x80", 4, R R R R},
    {"\xf0\x9f\x98", 3, R},
    {"\xf0\x9f\x98"
     "A",
     4, R "A"},
    {"\xe0\x80\x80", 3, R R R},
    {"\x80\x80", 2, R R},
    {"ok\xc3", 3, "ok" R},
    {"\xc3\xa9\xa9", 3, "\xc3\xa9" R},
    {"\xf8\x88\x80\x80\x80", 5, R R R R R},
};

static void test_utf8_sanitize(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        char *out;
        size_t len;
        assert_int_equal(tok_utf8_sanitize(bad_cases[i].in, bad_cases[i].len, &out, &len), TDM_OK);
        assert_non_null(out);
        assert_int_equal(len, strlen(bad_cases[i].python));
        assert_memory_equal(out, bad_cases[i].python, len);
        free(out);
    }
    char *out;
    size_t len;
    assert_int_equal(tok_utf8_sanitize("valid \xe4\xbd\xa0", 9, &out, &len), TDM_OK);
    assert_null(out); // valid input is not copied
    assert_int_equal(len, 9);
}

static void test_qwen_invalid_utf8(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    // "ï¿½" (U+FFFD) is 5691; two of them are 9973 (JS reference).
    EXPECT(tok, 0,
           "a\xff"
           "b",
           64, 5691, 65);
    EXPECT(tok, 0, "\xe4\xbd", 5691);
    EXPECT(tok, 0, "x\xc0\xafy", 87, 9973, 88);
    for (size_t i = 0; i < sizeof bad_cases / sizeof bad_cases[0]; i++) {
        int32_t *a, *b;
        size_t na, nb;
        assert_int_equal(tdm_tok_encode(tok, bad_cases[i].in, bad_cases[i].len, false, &a, &na),
                         TDM_OK);
        assert_int_equal(
            tdm_tok_encode(tok, bad_cases[i].python, strlen(bad_cases[i].python), false, &b, &nb),
            TDM_OK);
        assert_int_equal(na, nb);
        assert_memory_equal(a, b, na * sizeof *a);
        char *text = decode_str(tok, a, na, false);
        assert_string_equal(text, bad_cases[i].python);
        free(text);
        free(a);
        free(b);
    }
}

static void test_qwen_decode(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    // 160 "ä" = byte E4, 121 "½" = BD, 254 "ł" = A0: together "你" (E4 BD A0).
    int32_t ni[] = {160, 121, 254};
    char *s = decode_str(tok, ni, 3, false);
    assert_string_equal(s, "\xe4\xbd\xa0");
    free(s);
    s = decode_str(tok, ni, 2, false); // truncated: one U+FFFD, as Python/Rust
    assert_string_equal(s, R);
    free(s);
    int32_t odd[] = {121, 9707, 160};
    s = decode_str(tok, odd, 3, false);
    assert_string_equal(s, R "Hello" R);
    free(s);
    int32_t chat[] = {151644, 872, 198, 13048, 151645};
    s = decode_str(tok, chat, 5, false);
    assert_string_equal(s, "<|im_start|>user\nHi<|im_end|>");
    free(s);
    s = decode_str(tok, chat, 5, true);
    assert_string_equal(s, "user\nHi");
    free(s);
    int32_t tool[] = {151657, 151658}; // <tool_call> is not special: kept when skipping
    s = decode_str(tok, tool, 2, true);
    assert_string_equal(s, "<tool_call></tool_call>");
    free(s);
    int32_t bad[] = {9707, 151665};
    size_t len;
    assert_int_equal(tdm_tok_decode(tok, bad, 2, false, &s, &len), TDM_EINVAL);
    bad[1] = -3;
    assert_int_equal(tdm_tok_decode(tok, bad, 2, false, &s, &len), TDM_EINVAL);
}

// ---- detokenizer ----------------------------------------------------------------------------

// Streams ids through a detokenizer and checks deltas + flush == decode, and
// that every delta is valid UTF-8 on its own.
static void check_stream(const struct tdm_tokenizer *tok, const int32_t *ids, size_t n, bool skip)
{
    size_t want_len;
    char *want = decode_len(tok, ids, n, skip, &want_len);
    struct tdm_detok *d;
    assert_int_equal(tdm_detok_new(&d, tok, skip), TDM_OK);
    size_t cap = want_len * 2 + 16, len = 0;
    char *got = malloc(cap);
    assert_non_null(got);
    for (size_t i = 0; i <= n; i++) {
        const char *delta;
        size_t dl;
        if (i < n)
            assert_int_equal(tdm_detok_push(d, ids[i], &delta, &dl), TDM_OK);
        else
            assert_int_equal(tdm_detok_flush(d, &delta, &dl), TDM_OK);
        char *copy = NULL;
        size_t clen;
        assert_int_equal(tok_utf8_sanitize(delta, dl, &copy, &clen), TDM_OK);
        assert_null(copy); // each delta is complete, valid UTF-8
        assert_true(len + dl <= cap);
        memcpy(got + len, delta, dl);
        len += dl;
    }
    assert_int_equal(len, want_len);
    assert_memory_equal(got, want, len);
    free(got);
    free(want);
    tdm_detok_free(d);
}

static void test_qwen_detok_split_char(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    struct tdm_detok *d;
    const char *delta;
    size_t dl;
    assert_int_equal(tdm_detok_new(&d, tok, true), TDM_OK);
    assert_int_equal(tdm_detok_push(d, 160, &delta, &dl), TDM_OK); // E4
    assert_int_equal(dl, 0);
    assert_int_equal(tdm_detok_push(d, 121, &delta, &dl), TDM_OK); // BD
    assert_int_equal(dl, 0);
    assert_int_equal(tdm_detok_push(d, 254, &delta, &dl), TDM_OK); // A0
    assert_int_equal(dl, 3);
    assert_memory_equal(delta, "\xe4\xbd\xa0", 3);
    assert_int_equal(tdm_detok_push(d, 151645, &delta, &dl), TDM_OK); // special, skipped
    assert_int_equal(dl, 0);
    assert_int_equal(tdm_detok_push(d, 9707, &delta, &dl), TDM_OK);
    assert_int_equal(dl, 5);
    assert_memory_equal(delta, "Hello", 5);
    assert_int_equal(tdm_detok_push(d, 160, &delta, &dl), TDM_OK);
    assert_int_equal(dl, 0);
    assert_int_equal(tdm_detok_push(d, 151665, &delta, &dl), TDM_EINVAL);
    // A held prefix followed by a byte that cannot continue it: U+FFFD then the byte.
    assert_int_equal(tdm_detok_push(d, 64, &delta, &dl), TDM_OK); // "a"
    assert_int_equal(dl, 4);
    assert_memory_equal(delta, R "a", 4);
    assert_int_equal(tdm_detok_push(d, 160, &delta, &dl), TDM_OK);
    assert_int_equal(tdm_detok_flush(d, &delta, &dl), TDM_OK);
    assert_int_equal(dl, 3);
    assert_memory_equal(delta, R, 3);
    tdm_detok_free(d);
    tdm_detok_free(NULL);
}

static char **read_corpus(size_t *n)
{
    char *text;
    size_t len;
    if (tdm_read_file(CORPUS, &text, &len, NULL, 0) != TDM_OK)
        fail_msg("cannot read %s", CORPUS);
    size_t cap = 1024, cnt = 0;
    char **lines = malloc(cap * sizeof *lines);
    char *save = NULL;
    for (char *l = strtok_r(text, "\n", &save); l; l = strtok_r(NULL, "\n", &save)) {
        cJSON *o = cJSON_Parse(l);
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "text");
        assert_true(cJSON_IsString(t));
        if (cnt == cap)
            lines = realloc(lines, (cap *= 2) * sizeof *lines);
        lines[cnt++] = strdup(t->valuestring);
        cJSON_Delete(o);
    }
    free(text);
    *n = cnt;
    return lines;
}

static void free_corpus(char **lines, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(lines[i]);
    free(lines);
}

static void test_qwen_detok_corpus(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    size_t n_lines;
    char **lines = read_corpus(&n_lines);
    assert_true(n_lines > 100);
    for (size_t i = 0; i < n_lines; i++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(tdm_tok_encode(tok, lines[i], strlen(lines[i]), false, &ids, &n), TDM_OK);
        check_stream(tok, ids, n, false);
        check_stream(tok, ids, n, true);
        free(ids);
    }
    free_corpus(lines, n_lines);
    // Random id sequences, biased towards single-byte tokens so characters are
    // split, broken and interleaved with special tokens in every way.
    uint64_t x = 88172645463325252ULL;
    for (int seq = 0; seq < 400; seq++) {
        int32_t ids[40];
        size_t n = 1 + (size_t)(seq % 40);
        for (size_t i = 0; i < n; i++) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            int kind = (int)(x % 10);
            if (kind < 6)
                ids[i] = (int32_t)((x >> 8) % 256); // ids 0..255 are the single-byte tokens
            else if (kind < 9)
                ids[i] = (int32_t)((x >> 8) % 151643);
            else
                ids[i] = 151643 + (int32_t)((x >> 8) % 22);
        }
        check_stream(tok, ids, n, false);
        check_stream(tok, ids, n, true);
    }
    // CJK and emoji whose bytes fall into separate tokens.
    int32_t emoji_bytes[8];
    const uint8_t smile[4] = {0xf0, 0x9f, 0x98, 0x80};
    for (int i = 0; i < 4; i++) {
        char piece[4];
        uint16_t cp = tok->byte_char[smile[i]];
        int l = cp < 0x80 ? 1 : 2;
        if (l == 1)
            piece[0] = (char)cp;
        else {
            piece[0] = (char)(0xc0 | (cp >> 6));
            piece[1] = (char)(0x80 | (cp & 0x3f));
        }
        piece[l] = 0;
        emoji_bytes[i] = tdm_tok_piece_to_id(tok, piece);
        assert_true(emoji_bytes[i] >= 0);
        emoji_bytes[4 + i] = emoji_bytes[i];
    }
    check_stream(tok, emoji_bytes, 8, false);
    check_stream(tok, emoji_bytes, 3, false);
}

// decode(encode(x)) == x for NFC text without special-token strings.
static void test_qwen_roundtrip(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    static const char *texts[] = {
        "Hello world",
        "  leading and trailing  ",
        "tabs\tand\nnewlines\r\n\r\n",
        "你好，世界 😀👨‍👩‍👧",
        "I'VE 'Ll 's",
        "code: for (i = 0; i < n; i++) {}\n",
        "\xc3\xa9t\xc3\xa9",
        "",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        int32_t *ids;
        size_t n;
        assert_int_equal(tdm_tok_encode(tok, texts[i], strlen(texts[i]), true, &ids, &n), TDM_OK);
        char *s = decode_str(tok, ids, n, true);
        assert_string_equal(s, texts[i]);
        free(s);
        free(ids);
    }
}

// ---- threads share one tokenizer ------------------------------------------------------------

struct thread_job {
    const struct tdm_tokenizer *tok;
    char **lines;
    size_t n_lines;
    int32_t **want;
    size_t *want_n;
    int failures;
};

static void *thread_main(void *arg)
{
    struct thread_job *j = arg;
    for (int round = 0; round < 3; round++) {
        for (size_t i = 0; i < j->n_lines; i++) {
            int32_t *ids;
            size_t n;
            if (tdm_tok_encode(j->tok, j->lines[i], strlen(j->lines[i]), false, &ids, &n) !=
                    TDM_OK ||
                n != j->want_n[i] || memcmp(ids, j->want[i], n * sizeof *ids) != 0)
                j->failures++;
            free(ids);
        }
    }
    return NULL;
}

static void test_qwen_threads(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    size_t n_lines;
    char **lines = read_corpus(&n_lines);
    int32_t **want = calloc(n_lines, sizeof *want);
    size_t *want_n = calloc(n_lines, sizeof *want_n);
    for (size_t i = 0; i < n_lines; i++)
        assert_int_equal(
            tdm_tok_encode(tok, lines[i], strlen(lines[i]), false, &want[i], &want_n[i]), TDM_OK);
    pthread_t th[4];
    struct thread_job jobs[4];
    for (int t = 0; t < 4; t++) {
        jobs[t] = (struct thread_job){tok, lines, n_lines, want, want_n, 0};
        assert_int_equal(pthread_create(&th[t], NULL, thread_main, &jobs[t]), 0);
    }
    for (int t = 0; t < 4; t++) {
        pthread_join(th[t], NULL);
        assert_int_equal(jobs[t].failures, 0);
    }
    for (size_t i = 0; i < n_lines; i++)
        free(want[i]);
    free(want);
    free(want_n);
    free_corpus(lines, n_lines);
}

// ---- long inputs ------------------------------------------------------------------------------

static void test_qwen_long_input(void **state)
{
    (void)state;
    NEED_QWEN(tok);
    // One 200 kB "word" and one 200 kB run of spaces: the regex and BPE must
    // cope without the JIT stack or quadratic blow-up failing the call.
    size_t n = 200000;
    char *s = malloc(n + 1);
    for (size_t i = 0; i < n; i++)
        s[i] = (char)('a' + (i * 7) % 26);
    s[n] = 0;
    int32_t *ids;
    size_t nid;
    assert_int_equal(tdm_tok_encode(tok, s, n, false, &ids, &nid), TDM_OK);
    char *back = decode_str(tok, ids, nid, false);
    assert_string_equal(back, s);
    free(back);
    free(ids);
    memset(s, ' ', n);
    assert_int_equal(tdm_tok_encode(tok, s, n, false, &ids, &nid), TDM_OK);
    back = decode_str(tok, ids, nid, false);
    assert_string_equal(back, s);
    free(back);
    free(ids);
    free(s);
}

// ---- synthetic tokenizer.json -------------------------------------------------------------------

struct tiny {
    bool merges_as_pairs;
    bool ignore_merges;
    bool prefix_space; // ByteLevel add_prefix_space
    bool no_decoder;
    const char *model_type;
    const char *normalizer;  // JSON
    const char *extra_merge; // appended to merges (JSON)
    const char *extra_added; // appended to added_tokens (JSON)
};

// GPT-2 byte map, written again here so the test does not trust the library's.
static unsigned byte_cp(int b)
{
    int n = 0;
    for (int x = 0; x < 256; x++) {
        bool printable = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
        if (x == b)
            return printable ? (unsigned)x : 256u + (unsigned)n;
        if (!printable)
            n++;
    }
    return 0;
}

// vocab: ids 0..255 are the byte chars of bytes 0..255; 256 "he", 257 "ll",
// 258 "hell", 259 "hello", 260 "\u0120h", 261 "abc". Merges, by rank: h e,
// l l, he ll, hell o, \u0120 h. Added: 300 <s> (special), 301 <mask> (special,
// lstrip, rstrip), 302 hi (single_word), 303 é (normalized), 304 <|x|> (not special).
static char *write_tiny(const struct tiny *t)
{
    size_t cap = 1 << 16, o = 0;
    char *j = malloc(cap);
#define P(...) (o += (size_t)snprintf(j + o, cap - o, __VA_ARGS__))
    P("{\"version\":\"1.0\",\"added_tokens\":["
      "{\"id\":300,\"content\":\"<s>\",\"special\":true,\"normalized\":false},"
      "{\"id\":301,\"content\":\"<mask>\",\"special\":true,\"lstrip\":true,\"rstrip\":true,"
      "\"normalized\":false},"
      "{\"id\":302,\"content\":\"hi\",\"special\":false,\"single_word\":true,\"normalized\":false},"
      "{\"id\":303,\"content\":\"\\u00e9\",\"special\":false,\"normalized\":true},"
      "{\"id\":304,\"content\":\"<|x|>\",\"special\":false,\"normalized\":false}");
    if (t->extra_added)
        P(",%s", t->extra_added);
    P("],");
    P("\"normalizer\":%s,", t->normalizer ? t->normalizer : "{\"type\":\"NFC\"}");
    P("\"pre_tokenizer\":{\"type\":\"ByteLevel\",\"add_prefix_space\":%s,\"use_regex\":true},",
      t->prefix_space ? "true" : "false");
    P("\"post_processor\":{\"type\":\"TemplateProcessing\",\"single\":[{\"SpecialToken\":{\"id\":"
      "\"<s>\","
      "\"type_id\":0}},{\"Sequence\":{\"id\":\"A\",\"type_id\":0}}],\"pair\":[],\"special_tokens\":"
      "{\"<s>\":{\"id\":\"<s>\",\"ids\":[300],\"tokens\":[\"<s>\"]}}},");
    P("\"decoder\":%s,", t->no_decoder ? "null" : "{\"type\":\"ByteLevel\"}");
    P("\"model\":{\"type\":\"%s\",\"ignore_merges\":%s,\"vocab\":{",
      t->model_type ? t->model_type : "BPE", t->ignore_merges ? "true" : "false");
    for (int b = 0; b < 256; b++)
        P("\"\\u%04x\":%d,", byte_cp(b), b);
    P("\"he\":256,\"ll\":257,\"hell\":258,\"hello\":259,\"\\u0120h\":260,\"abc\":261},\"merges\":"
      "[");
    if (t->merges_as_pairs)
        P("[\"h\",\"e\"],[\"l\",\"l\"],[\"he\",\"ll\"],[\"hell\",\"o\"],[\"\\u0120\",\"h\"]");
    else
        P("\"h e\",\"l l\",\"he ll\",\"hell o\",\"\\u0120 h\"");
    if (t->extra_merge)
        P(",%s", t->extra_merge);
    P("]}}");
#undef P
    assert_true(o < cap);
    char path[] = "/tmp/tdm_tok_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, j, o), (ssize_t)o);
    close(fd);
    free(j);
    return strdup(path);
}

static int load_tiny(const struct tiny *t, struct tdm_tokenizer **tok, char *err, size_t errlen)
{
    char *path = write_tiny(t);
    int rc = tdm_tok_load_files(tok, path, NULL, err, errlen);
    unlink(path);
    free(path);
    return rc;
}

static void test_tiny_bpe(void **state)
{
    (void)state;
    for (int pairs = 0; pairs < 2; pairs++) {
        struct tiny t = {.merges_as_pairs = pairs};
        struct tdm_tokenizer *tok;
        char err[256];
        assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
        assert_int_equal(tdm_tok_vocab_size(tok), 305);
        // h e l l o: he (rank 0), ll (1), hell (2), hello (3).
        EXPECT(tok, 0, "hello", 259);
        // " hello": \u0120 h is leftmost but rank 4; h e (rank 0) wins and
        // the \u0120 h pair disappears: \u0120 + hello.
        EXPECT(tok, 0, "hello hello", 259, 32, 259);
        // " there": \u0120 t h e r e, only h e merges.
        EXPECT(tok, 0, "hi there", 302, 32, 116, 256, 114, 101);
        // single_word: "hi" inside "this" is not the added token.
        EXPECT(tok, 0, "this", 116, 104, 105, 115);
        // Word characters are letters, digits and '_': punctuation around
        // "hi" lets it match, '_' and digits do not.
        EXPECT(tok, 0, ".hi.", 46, 302, 46);
        EXPECT(tok, 0, "_hi_", 95, 104, 105, 95);
        EXPECT(tok, 0, "1hi", 49, 104, 105);
        // lstrip/rstrip eat the white space around <mask>, tabs included, but
        // never what an earlier token already took.
        EXPECT(tok, 0, "a <mask> b", 97, 301, 98);
        EXPECT(tok, 0, "a\t<mask>\tb", 97, 301, 98);
        EXPECT(tok, 0, "<mask> <mask>", 301, 301);
        EXPECT(tok, 0, "a  <s>", 97, 32, 32, 300); // no lstrip on <s>
        // normalized added token é matches after NFC of e + U+0301.
        EXPECT(tok, 0, "cafe\xcc\x81", 99, 97, 102, 303);
        // abc is in the vocab but no merge reaches it.
        EXPECT(tok, 0, "abc", 97, 98, 99);
        // TemplateProcessing adds <s> only with add_special_tokens.
        EXPECT(tok, TDM_TOK_ADD_SPECIAL, "hello", 300, 259);
        EXPECT(tok, 0, "<s>", 300);
        EXPECT(tok, TDM_TOK_SPLIT_SPECIAL, "<s>", 60, 115, 62);
        EXPECT(tok, TDM_TOK_SPLIT_SPECIAL, "<|x|>", 304); // not special: still matched

        int32_t ids[] = {300, 259, 304, 301};
        char *s = decode_str(tok, ids, 4, false);
        assert_string_equal(s, "<s>hello<|x|><mask>");
        free(s);
        s = decode_str(tok, ids, 4, true);
        assert_string_equal(s, "hello<|x|>");
        free(s);
        int32_t gap[] = {280};
        size_t len;
        assert_int_equal(tdm_tok_decode(tok, gap, 1, false, &s, &len), TDM_EINVAL);
        assert_true(tdm_tok_is_special(tok, 300));
        assert_false(tdm_tok_is_special(tok, 302));
        assert_int_equal(tdm_tok_piece_to_id(tok, "hello"), 259);
        assert_int_equal(tdm_tok_piece_to_id(tok, "<mask>"), 301);
        assert_int_equal(tdm_tok_bos_id(tok), -1); // no tokenizer_config.json
        assert_null(tdm_tok_chat_template(tok));
        tdm_tok_free(tok);
    }
}

static void test_tiny_variants(void **state)
{
    (void)state;
    struct tdm_tokenizer *tok;
    char err[256];
    struct tiny t = {.ignore_merges = true};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
    EXPECT(tok, 0, "abc", 261); // a vocabulary word is taken whole
    EXPECT(tok, 0, "hello", 259);
    tdm_tok_free(tok);

    t = (struct tiny){.prefix_space = true};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
    EXPECT(tok, 0, "hello", 32, 259);
    EXPECT(tok, 0, " hello", 32, 259);
    tdm_tok_free(tok);

    t = (struct tiny){.no_decoder = true};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
    int32_t ids[] = {259, 32, 300};
    char *s = decode_str(tok, ids, 3, false); // HF joins the token strings with spaces
    assert_string_equal(s, "hello \xc4\xa0 <s>");
    free(s);
    s = decode_str(tok, ids, 3, true);
    assert_string_equal(s, "hello \xc4\xa0");
    free(s);
    struct tdm_detok *d;
    const char *delta;
    size_t dl;
    assert_int_equal(tdm_detok_new(&d, tok, false), TDM_OK);
    assert_int_equal(tdm_detok_push(d, 259, &delta, &dl), TDM_OK);
    assert_int_equal(tdm_detok_push(d, 32, &delta, &dl), TDM_OK);
    assert_int_equal(dl, 3);
    assert_memory_equal(delta, " \xc4\xa0", 3);
    tdm_detok_free(d);
    tdm_tok_free(tok);

    // A pair listed twice keeps its last rank (HF fills a map in order): with
    // h e moved to rank 5, " hello" merges l l (1), then \u0120 h (4), and
    // \u0120h e has no merge.
    t = (struct tiny){.extra_merge = "\"h e\""};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
    EXPECT(tok, 0, "hello hello", 259, 260, 101, 257, 111);
    tdm_tok_free(tok);

    t = (struct tiny){.normalizer = "null"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_OK);
    EXPECT(tok, 0, "e\xcc\x81", 101, 204, 129); // no NFC: e, then the bytes CC 81
    tdm_tok_free(tok);
}

static void test_load_errors(void **state)
{
    (void)state;
    struct tdm_tokenizer *tok = (struct tdm_tokenizer *)1;
    char err[256] = "";
    assert_int_equal(tdm_tok_load(&tok, "/nonexistent/tokenizer/dir", err, sizeof err),
                     TDM_ENOTFOUND);
    assert_null(tok);

    struct tiny t = {.model_type = "WordPiece"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "WordPiece"));
    t = (struct tiny){.normalizer = "{\"type\":\"Lowercase\"}"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "Lowercase"));
    t = (struct tiny){.extra_merge = "\"zz qq\""};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "merge 5"));
    t = (struct tiny){.extra_merge = "\"a b c\""};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);
    t = (struct tiny){.extra_merge = "42"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);
    t = (struct tiny){.extra_added = "{\"id\":2000000000,\"content\":\"<big>\"}"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "2000000000"));
    t = (struct tiny){.extra_added = "{\"id\":305,\"content\":\"\"}"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);
    t = (struct tiny){.extra_added = "{\"content\":\"<noid>\"}"};
    assert_int_equal(load_tiny(&t, &tok, err, sizeof err), TDM_EPROTO);

    char path[] = "/tmp/tdm_tok_bad_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "{\"model\": {\"vocab\": ", 20), 20);
    close(fd);
    assert_int_equal(tdm_tok_load_files(&tok, path, NULL, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "invalid JSON"));
    unlink(path);
    tdm_tok_free(NULL);
}

static int teardown_all(void **state)
{
    (void)state;
    tdm_tok_free(qwen);
    qwen = NULL;
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_utf8_sanitize),         cmocka_unit_test(test_tiny_bpe),
        cmocka_unit_test(test_tiny_variants),         cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_qwen_known_ids),        cmocka_unit_test(test_qwen_metadata),
        cmocka_unit_test(test_qwen_invalid_utf8),     cmocka_unit_test(test_qwen_decode),
        cmocka_unit_test(test_qwen_detok_split_char), cmocka_unit_test(test_qwen_detok_corpus),
        cmocka_unit_test(test_qwen_roundtrip),        cmocka_unit_test(test_qwen_threads),
        cmocka_unit_test(test_qwen_long_input),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, NULL, teardown_all));
}
