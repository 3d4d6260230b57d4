// SPDX-License-Identifier: Apache-2.0
// Tests of the streaming stop-string matcher: stops split across many deltas,
// overlapping candidates, false starts, include_stop_str_in_output, flush,
// multibyte UTF-8 fed byte by byte, and a randomized comparison against a
// whole-text reference that also checks nothing past the final cut is ever
// emitted.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "core.h"
#include "openai.h"

// Feeds text in pieces of the given sizes (cycled); returns the stop index (or
// -1) and the concatenated emitted text in out (with flush when no match).
static int run(const char *const *stops, size_t n, bool include, const char *text,
               const size_t *sizes, size_t n_sizes, char *out, size_t cap)
{
    struct tdm_oai_stop *s;
    assert_int_equal(tdm_oai_stop_new(&s, stops, n, include), 0);
    size_t len = strlen(text), pos = 0, o = 0, k = 0;
    int hit = -1;
    while (pos < len) {
        size_t step = sizes[k++ % n_sizes];
        if (step > len - pos)
            step = len - pos;
        const char *emit;
        size_t elen;
        int r = tdm_oai_stop_feed(s, text + pos, step, &emit, &elen);
        assert_true(r >= -1);
        assert_true(o + elen < cap);
        memcpy(out + o, emit, elen);
        o += elen;
        if (r >= 0) {
            assert_int_equal(hit, -1);
            hit = r;
            assert_true(tdm_oai_stop_done(s));
        }
        pos += step;
    }
    const char *emit;
    size_t elen;
    tdm_oai_stop_flush(s, &emit, &elen);
    if (hit >= 0)
        assert_int_equal(elen, 0);
    memcpy(out + o, emit, elen);
    o += elen;
    out[o] = '\0';
    tdm_oai_stop_free(s);
    return hit;
}

static void test_no_stops_pass_through(void **state)
{
    (void)state;
    struct tdm_oai_stop *s;
    assert_int_equal(tdm_oai_stop_new(&s, NULL, 0, false), 0);
    const char *emit;
    size_t len;
    assert_int_equal(tdm_oai_stop_feed(s, "Hello", 5, &emit, &len), -1);
    assert_int_equal(len, 5);
    assert_memory_equal(emit, "Hello", 5);
    tdm_oai_stop_free(s);
}

static void test_split_across_deltas(void **state)
{
    (void)state;
    const char *stops[] = {"<|stop|>"};
    size_t one[] = {1}, three[] = {3, 1, 2};
    char out[256];
    assert_int_equal(run(stops, 1, false, "Hello<|stop|>world", one, 1, out, sizeof out), 0);
    assert_string_equal(out, "Hello");
    assert_int_equal(run(stops, 1, false, "Hello<|stop|>world", three, 3, out, sizeof out), 0);
    assert_string_equal(out, "Hello");
    assert_int_equal(run(stops, 1, true, "Hello<|stop|>world", one, 1, out, sizeof out), 0);
    assert_string_equal(out, "Hello<|stop|>");
}

static void test_hold_back_then_release(void **state)
{
    (void)state;
    const char *stops[] = {"END"};
    struct tdm_oai_stop *s;
    assert_int_equal(tdm_oai_stop_new(&s, stops, 1, false), 0);
    const char *emit;
    size_t len;
    assert_int_equal(tdm_oai_stop_feed(s, "the E", 5, &emit, &len), -1);
    assert_int_equal(len, 4); // "E" may start "END": held
    assert_memory_equal(emit, "the ", 4);
    assert_int_equal(tdm_oai_stop_feed(s, "N", 1, &emit, &len), -1);
    assert_int_equal(len, 0);
    assert_int_equal(tdm_oai_stop_feed(s, "D", 1, &emit, &len), 0);
    assert_int_equal(len, 0);
    assert_int_equal(tdm_oai_stop_feed(s, "more", 4, &emit, &len), -1); // done: nothing
    assert_int_equal(len, 0);
    tdm_oai_stop_free(s);

    // A false start is released as soon as it cannot be a stop any more.
    assert_int_equal(tdm_oai_stop_new(&s, stops, 1, false), 0);
    assert_int_equal(tdm_oai_stop_feed(s, "EN", 2, &emit, &len), -1);
    assert_int_equal(len, 0);
    assert_int_equal(tdm_oai_stop_feed(s, "x", 1, &emit, &len), -1);
    assert_int_equal(len, 3);
    assert_memory_equal(emit, "ENx", 3);
    // Flush at the end hands back the held tail.
    assert_int_equal(tdm_oai_stop_feed(s, " EN", 3, &emit, &len), -1);
    assert_int_equal(len, 1);
    tdm_oai_stop_flush(s, &emit, &len);
    assert_int_equal(len, 2);
    assert_memory_equal(emit, "EN", 2);
    tdm_oai_stop_free(s);
}

static void test_overlapping_candidates(void **state)
{
    (void)state;
    char out[128];
    size_t one[] = {1}, all[] = {100};
    // "bc" completes before "abcd" could: it wins, fed byte by byte or at once.
    const char *s1[] = {"abcd", "bc"};
    assert_int_equal(run(s1, 2, false, "xabcd", one, 1, out, sizeof out), 1);
    assert_string_equal(out, "xa");
    assert_int_equal(run(s1, 2, false, "xabcd", all, 1, out, sizeof out), 1);
    assert_string_equal(out, "xa");
    // Same end: the longer one wins.
    const char *s2[] = {"c", "abc"};
    assert_int_equal(run(s2, 2, false, "zzabc", all, 1, out, sizeof out), 1);
    assert_string_equal(out, "zz");
    assert_int_equal(run(s2, 2, true, "zzabc", one, 1, out, sizeof out), 1);
    assert_string_equal(out, "zzabc");
    // Shared prefixes: "ab" is held until the third byte decides.
    const char *s3[] = {"abc", "abd"};
    assert_int_equal(run(s3, 2, false, "ababd!", one, 1, out, sizeof out), 1);
    assert_string_equal(out, "ab");
    // A stop string inside a repeated pattern ("aab" in "aaab").
    const char *s4[] = {"aab"};
    assert_int_equal(run(s4, 1, false, "aaab", one, 1, out, sizeof out), 0);
    assert_string_equal(out, "a");
}

static bool valid_utf8(const char *s, size_t len)
{
    size_t i = 0;
    while (i < len) {
        unsigned char c = (unsigned char)s[i];
        size_t need = c < 0x80 ? 1 : c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 0;
        if (!need || i + need > len)
            return false;
        for (size_t k = 1; k < need; k++)
            if (((unsigned char)s[i + k] & 0xC0) != 0x80)
                return false;
        i += need;
    }
    return true;
}

static void test_multibyte(void **state)
{
    (void)state;
    // Stop "é!" in "café!" fed byte by byte: every emitted piece is whole characters.
    const char *stops[] = {"\xC3\xA9!", "\xE2\x82\xAC\xE2\x82\xAC"}; // "é!", "€€"
    const char *text = "caf\xC3\xA9 \xE2\x82\xAC 10 \xE6\x97\xA5\xE6\x9C\xAC caf\xC3\xA9!rest";
    struct tdm_oai_stop *s;
    assert_int_equal(tdm_oai_stop_new(&s, stops, 2, false), 0);
    char out[128];
    size_t o = 0;
    int hit = -1;
    for (size_t i = 0; text[i] && hit < 0; i++) {
        const char *emit;
        size_t len;
        hit = tdm_oai_stop_feed(s, text + i, 1, &emit, &len);
        assert_true(valid_utf8(emit, len));
        memcpy(out + o, emit, len);
        o += len;
    }
    out[o] = '\0';
    assert_int_equal(hit, 0);
    assert_string_equal(out, "caf\xC3\xA9 \xE2\x82\xAC 10 \xE6\x97\xA5\xE6\x9C\xAC caf");
    tdm_oai_stop_free(s);

    // "€" alone is a held prefix of "€€"; a following "x" releases it.
    size_t one[] = {1};
    assert_int_equal(run(stops, 2, false,
                         "a\xE2\x82\xAC"
                         "x\xE2\x82\xAC\xE2\x82\xAC",
                         one, 1, out, sizeof out),
                     1);
    assert_string_equal(out, "a\xE2\x82\xAC"
                             "x");
}

// Reference: the occurrence that ends first in the whole text (longer at a tie).
static int reference(const char *const *stops, size_t n, bool include, const char *text, char *out)
{
    size_t len = strlen(text);
    for (size_t end = 1; end <= len; end++) {
        int best = -1;
        size_t best_len = 0;
        for (size_t i = 0; i < n; i++) {
            size_t l = strlen(stops[i]);
            if (l <= end && memcmp(text + end - l, stops[i], l) == 0 && l > best_len) {
                best = (int)i;
                best_len = l;
            }
        }
        if (best >= 0) {
            size_t cut = include ? end : end - best_len;
            memcpy(out, text, cut);
            out[cut] = '\0';
            return best;
        }
    }
    strcpy(out, text);
    return -1;
}

static void test_randomized_against_reference(void **state)
{
    (void)state;
    uint64_t x = 0x9E3779B97F4A7C15ULL;
#define NEXT() (x ^= x << 13, x ^= x >> 7, x ^= x << 17, x)
    for (int iter = 0; iter < 3000; iter++) {
        char stop_buf[4][8];
        const char *stops[4];
        size_t n = 1 + NEXT() % 4;
        for (size_t i = 0; i < n; i++) {
            size_t l = 1 + NEXT() % 5;
            for (size_t k = 0; k < l; k++)
                stop_buf[i][k] = (char)('a' + NEXT() % 3);
            stop_buf[i][l] = '\0';
            stops[i] = stop_buf[i];
        }
        char text[64];
        size_t len = NEXT() % 40;
        for (size_t k = 0; k < len; k++)
            text[k] = (char)('a' + NEXT() % 4);
        text[len] = '\0';
        bool include = NEXT() & 1;
        char expect[64];
        int want = reference(stops, n, include, text, expect);

        struct tdm_oai_stop *s;
        assert_int_equal(tdm_oai_stop_new(&s, stops, n, include), 0);
        char got[128];
        size_t o = 0, pos = 0;
        int hit = -1;
        while (pos < len) {
            size_t step = 1 + NEXT() % 6;
            if (step > len - pos)
                step = len - pos;
            const char *emit;
            size_t elen;
            int r = tdm_oai_stop_feed(s, text + pos, step, &emit, &elen);
            memcpy(got + o, emit, elen);
            o += elen;
            // Never ahead of the final answer: what was sent is a prefix of it.
            assert_true(o <= strlen(expect));
            assert_memory_equal(got, expect, o);
            if (r >= 0)
                hit = r;
            pos += step;
        }
        const char *emit;
        size_t elen;
        tdm_oai_stop_flush(s, &emit, &elen);
        memcpy(got + o, emit, elen);
        o += elen;
        got[o] = '\0';
        tdm_oai_stop_free(s);
        if (want >= 0)
            assert_string_equal(stops[hit], stops[want]);
        else
            assert_int_equal(hit, -1);
        assert_string_equal(got, expect);
    }
#undef NEXT
}

static void test_min_tokens_window(void **state)
{
    (void)state;
    const char *stops[] = {"END", "N"};
    struct tdm_oai_stop *s;
    assert_int_equal(tdm_oai_stop_new(&s, stops, 2, false), 0);
    const char *emit;
    size_t len;
    // Before min_tokens: "END" completes but may not match; "E" of a new
    // candidate is still held back.
    assert_int_equal(tdm_oai_stop_feed_ex(s, "xEND E", 6, false, &emit, &len), -1);
    assert_int_equal(len, 5);
    assert_memory_equal(emit, "xEND ", 5);
    // Matching allowed again: "EN" completes "N" first (a stop must end in the new bytes).
    assert_int_equal(tdm_oai_stop_feed_ex(s, "ND", 2, true, &emit, &len), 1);
    assert_int_equal(len, 1);
    assert_memory_equal(emit, "E", 1);
    tdm_oai_stop_free(s);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    struct tdm_oai_stop *s = (struct tdm_oai_stop *)1;
    const char *empty[] = {""};
    assert_int_equal(tdm_oai_stop_new(&s, empty, 1, false), TDM_EINVAL);
    assert_null(s);
    assert_int_equal(tdm_oai_stop_new(&s, NULL, 2, false), TDM_EINVAL);
    tdm_oai_stop_free(NULL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_stops_pass_through),
        cmocka_unit_test(test_split_across_deltas),
        cmocka_unit_test(test_hold_back_then_release),
        cmocka_unit_test(test_overlapping_candidates),
        cmocka_unit_test(test_multibyte),
        cmocka_unit_test(test_randomized_against_reference),
        cmocka_unit_test(test_min_tokens_window),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
