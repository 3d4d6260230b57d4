// SPDX-License-Identifier: Apache-2.0
// Tests for bench_peer (tandem-bench-engine --peer): the fixture in the format
// bench/peer/llamacpp.sh writes parses, each missing or bad field is refused
// with its name, a missing file names the file, and the two printed lines are
// the figures and the ratios Tandem / llama.cpp on hand-computed numbers, "not
// measured" where the run skipped a point; without a file, the line that says
// how to get the figures (and no figure).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <string.h>

#include "bench_peer.h"
#include "core.h"

#define FIXTURE TANDEM_SOURCE_DIR "/bench/engine/testdata/llamacpp.json"

static void test_load_fixture(void **state)
{
    (void)state;
    struct tdm_bench_peer p;
    char err[256] = "";
    assert_int_equal(tdm_bench_peer_load(&p, FIXTURE, err, sizeof err), TDM_OK);
    assert_string_equal(p.commit, "0123456789abcdef0123456789abcdef01234567");
    assert_int_equal(p.threads, 2);
    assert_true(p.bf16.pp512 == 300.0 && p.bf16.tg128 == 30.0);
    assert_true(p.q8_0.pp512 == 200.0 && p.q8_0.tg128 == 40.0);
}

static void test_errors(void **state)
{
    (void)state;
    static const struct {
        const char *json, *want;
    } cases[] = {
        {"[1, 2]", "not a JSON object"},
        {"{\"commit\": \"abc\", \"bf16\": {\"pp512\": 1, \"tg128\": 1}", "not a JSON object"},
        {"{\"bf16\": {\"pp512\": 1, \"tg128\": 1}, \"q8_0\": {\"pp512\": 1, \"tg128\": 1}}",
         "commit missing"},
        {"{\"commit\": 7, \"bf16\": {\"pp512\": 1, \"tg128\": 1}, \"q8_0\": {\"pp512\": 1, "
         "\"tg128\": 1}}",
         "commit missing"},
        {"{\"commit\": \"abc\", \"threads\": 1.5, \"bf16\": {\"pp512\": 1, \"tg128\": 1}, "
         "\"q8_0\": {\"pp512\": 1, \"tg128\": 1}}",
         "threads not a positive integer"},
        {"{\"commit\": \"abc\", \"q8_0\": {\"pp512\": 1, \"tg128\": 1}}",
         "bf16 missing or not an object"},
        {"{\"commit\": \"abc\", \"bf16\": {\"tg128\": 1}, \"q8_0\": {\"pp512\": 1, \"tg128\": 1}}",
         "bf16.pp512 missing or not a positive number"},
        {"{\"commit\": \"abc\", \"bf16\": {\"pp512\": 1, \"tg128\": 0}, \"q8_0\": {\"pp512\": 1, "
         "\"tg128\": 1}}",
         "bf16.tg128 missing or not a positive number"},
        {"{\"commit\": \"abc\", \"bf16\": {\"pp512\": 1, \"tg128\": 1}, \"q8_0\": {\"pp512\": "
         "\"fast\", \"tg128\": 1}}",
         "q8_0.pp512 missing or not a positive number"},
        {"{\"commit\": \"abc\", \"bf16\": {\"pp512\": 1, \"tg128\": 1}}",
         "q8_0 missing or not an object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct tdm_bench_peer p;
        memset(&p, 0x5a, sizeof p);
        char err[256] = "";
        assert_int_equal(tdm_bench_peer_parse(&p, cases[i].json, err, sizeof err), TDM_EPROTO);
        if (strstr(err, cases[i].want) == NULL)
            fail_msg("case %zu: err \"%s\", want \"%s\"", i, err, cases[i].want);
        assert_int_equal((unsigned char)p.commit[0], 0x5a); // untouched on failure
    }
    // Nesting deeper than TDM_JSON_MAX_DEPTH is refused before cJSON sees it.
    char deep[2 * TDM_JSON_MAX_DEPTH + 8];
    size_t n = 0;
    for (int i = 0; i <= TDM_JSON_MAX_DEPTH; i++)
        deep[n++] = '[';
    for (int i = 0; i <= TDM_JSON_MAX_DEPTH; i++)
        deep[n++] = ']';
    deep[n] = '\0';
    struct tdm_bench_peer p;
    char err[256] = "";
    assert_int_equal(tdm_bench_peer_parse(&p, deep, err, sizeof err), TDM_EPROTO);

    assert_int_not_equal(
        tdm_bench_peer_load(&p, TANDEM_BINARY_DIR "/no-such-peer.json", err, sizeof err), TDM_OK);
    assert_non_null(strstr(err, "no-such-peer.json"));
}

static void test_format(void **state)
{
    (void)state;
    struct tdm_bench_peer p;
    char err[256] = "", buf[640];
    assert_int_equal(tdm_bench_peer_load(&p, FIXTURE, err, sizeof err), TDM_OK);
    // Tandem: bf16 b1 15 tok/s (0.5 of 30), prefill 450 (1.5 of 300); int8 20 / 100.
    struct tdm_bench_peer_tandem t = {
        .bf16_b1 = 15.0, .bf16_prefill512 = 450.0, .int8_b1 = 20.0, .int8_prefill512 = 100.0};
    tdm_bench_peer_format(&p, &t, buf, sizeof buf);
    assert_string_equal(
        buf, "llama.cpp 0123456789ab on this machine (bench/peer/llamacpp.sh, 2 threads): bf16 "
             "30.0 tok/s decode (tg128), 300.0 tok/s prefill-512 (pp512); Q8_0 40.0 / 200.0\n"
             "Tandem / llama.cpp, this run: bf16 decode b1 0.50x tg128, prefill-512 1.50x pp512; "
             "int8 vs Q8_0 decode b1 0.50x tg128, prefill-512 0.50x pp512\n");

    // --bf16-only and no prefill of 512: the int8 and prefill ratios are not measured.
    struct tdm_bench_peer_tandem bf16_only = {.bf16_b1 = 60.0};
    p.threads = 0;
    tdm_bench_peer_format(&p, &bf16_only, buf, sizeof buf);
    assert_non_null(strstr(buf, "(bench/peer/llamacpp.sh): bf16 30.0"));
    assert_non_null(strstr(buf, "bf16 decode b1 2.00x tg128, prefill-512 not measured; int8 vs "
                                "Q8_0 decode b1 not measured, prefill-512 not measured\n"));

    // No --peer: one line saying how to measure, no figure.
    tdm_bench_peer_format(NULL, &t, buf, sizeof buf);
    assert_non_null(strstr(buf, "no peer figures given"));
    assert_non_null(strstr(buf, "bench/peer/llamacpp.sh"));
    assert_null(strstr(buf, "tok/s"));
    assert_ptr_equal(strchr(buf, '\n'), buf + strlen(buf) - 1); // one line

    // A short buffer is cut and still terminated.
    char small[16];
    tdm_bench_peer_format(&p, &t, small, sizeof small);
    assert_int_equal(strlen(small), sizeof small - 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_load_fixture),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_format),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
