// SPDX-License-Identifier: Apache-2.0
// Tests for gpu_report (check.sh's summary), all on the CPU: the probe, engine
// and P/D documents parse, each missing or bad field is refused with its name,
// the ratios are the stated formulas on hand-computed numbers, the summary
// marks each goal met, MISSED or not measured, and the cost of batch
// invariance between two engine runs decides the default by issue 26's rule.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "gpu_report.h"

// An H200-like probe: 4000 GB/s read, 7000 GB/s copy and d2d, 700 TFLOP/s.
static const char *PROBE =
    "{\"device\": {\"name\": \"NVIDIA H200\", \"cc\": \"9.0\", \"sms\": 132, "
    "\"mem_bytes\": 150000000000, \"index\": 0}, \"buffer_bytes\": 1073741824, \"reps\": 5,"
    " \"read_gbs\": 4000.0, \"copy_gbs\": 7000.0, \"d2d_gbs\": 7000.0,"
    " \"gemm\": {\"m\": 8192, \"n\": 8192, \"k\": 8192, \"dtype\": \"bf16\"},"
    " \"bf16_tflops\": 700.0}";

// 1 GB of weights: b1 0.5 ms (2 GB/s of weights = half the read bw), b64 2 ms
// (32 000 tok/s); prefill 2048 of 2.8e14 FLOP in 1 s = 280 TFLOP/s = 0.4 of peak.
static const char *ENGINE =
    "{\"device\": \"cuda\", \"weight_bytes\": 1000000000,"
    " \"decode\": [{\"batch\": 1, \"seconds\": 0.0005}, {\"batch\": 8, \"seconds\": 0.0006},"
    "  {\"batch\": 64, \"seconds\": 0.002}],"
    " \"prefill\": [{\"tokens\": 512, \"seconds\": 0.1, \"flops\": 7e12},"
    "  {\"tokens\": 2048, \"seconds\": 1.0, \"flops\": 2.8e14}]}";

// 2048 tokens: exposed 1 ms of a 100 ms TTFT (0.01); 0.35 GB in 0.2 ms:
// 2 * 0.35e9 / 2e-4 = 3500 GB/s = 0.5 of d2d.
static const char *PD =
    "{\"transport\": \"cuda-ipc\", \"sizes\": ["
    " {\"tokens\": 512, \"ttft_direct_s\": 0.02, \"ttft_pd_s\": 0.03,"
    "  \"transfer_s\": 0.0005},"
    " {\"tokens\": 2048, \"ttft_direct_s\": 0.09, \"ttft_pd_s\": 0.1,"
    "  \"transfer_s\": 0.001, \"kv_bytes\": 350000000, \"kv_window_s\": 0.0002}]}";

static void test_parse_probe(void **state)
{
    (void)state;
    struct tdm_gpu_probe p;
    char err[256];
    assert_int_equal(tdm_gpu_report_parse_probe(&p, PROBE, err, sizeof err), TDM_OK);
    assert_string_equal(p.device, "NVIDIA H200");
    assert_int_equal(p.cc_major, 9);
    assert_int_equal(p.cc_minor, 0);
    assert_int_equal(p.sm_count, 132);
    assert_true(p.read_gbs == 4000.0 && p.copy_gbs == 7000.0 && p.d2d_gbs == 7000.0);
    assert_true(p.bf16_tflops == 700.0);
    assert_int_equal(p.gemm_k, 8192);
}

// Each broken copy of PROBE is refused, naming the field.
static void test_probe_errors(void **state)
{
    (void)state;
    static const struct {
        const char *from, *to, *msg;
    } cases[] = {
        {"\"read_gbs\": 4000.0", "\"read_gbs\": 0", "read_gbs"},
        {"\"read_gbs\": 4000.0", "\"read_gb\": 4000.0", "read_gbs"},
        {"\"d2d_gbs\": 7000.0", "\"d2d_gbs\": \"fast\"", "d2d_gbs"},
        {"\"bf16_tflops\": 700.0", "\"bf16_tflops\": -1", "bf16_tflops"},
        {"\"cc\": \"9.0\"", "\"cc\": 9", "device.cc"},
        {"\"sms\": 132", "\"sms\": 13.5", "device.sms"},
        {"\"k\": 8192", "\"k\": 0", "gemm"},
        {"{\"device\": {", "[{\"device\": {", "not a JSON object"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char bad[2048], err[256] = "";
        const char *at = strstr(PROBE, cases[i].from);
        assert_non_null(at);
        snprintf(bad, sizeof bad, "%.*s%s%s", (int)(at - PROBE), PROBE, cases[i].to,
                 at + strlen(cases[i].from));
        struct tdm_gpu_probe p;
        assert_int_equal(tdm_gpu_report_parse_probe(&p, bad, err, sizeof err), TDM_EPROTO);
        if (strstr(err, cases[i].msg) == NULL)
            fail_msg("case %zu: error '%s' does not name '%s'", i, err, cases[i].msg);
    }
    char err[256];
    struct tdm_gpu_probe p;
    assert_int_equal(tdm_gpu_report_parse_probe(&p, "{\"device\": ", err, sizeof err), TDM_EPROTO);
    // Nesting deeper than TDM_JSON_MAX_DEPTH is refused before cJSON recurses into it.
    static char deep[2 * 200 + 1];
    memset(deep, '[', 200);
    memset(deep + 200, ']', 200);
    assert_int_equal(tdm_gpu_report_parse_probe(&p, deep, err, sizeof err), TDM_EPROTO);
    assert_non_null(strstr(err, "128"));
    assert_int_equal(tdm_gpu_report_parse_probe(&p, NULL, err, sizeof err), TDM_EPROTO);
}

static void test_parse_engine_and_pd(void **state)
{
    (void)state;
    struct tdm_gpu_engine e;
    struct tdm_gpu_pd d;
    char err[256];
    assert_int_equal(tdm_gpu_report_parse_engine(&e, ENGINE, err, sizeof err), TDM_OK);
    assert_string_equal(e.device, "cuda");
    assert_int_equal(e.n_decode, 3);
    assert_int_equal(e.n_prefill, 2);
    assert_int_equal(e.decode[2].size, 64);
    assert_true(e.prefill[1].flops == 2.8e14);
    assert_int_equal(tdm_gpu_report_parse_pd(&d, PD, err, sizeof err), TDM_OK);
    assert_string_equal(d.transport, "cuda-ipc");
    assert_int_equal(d.n, 2);
    assert_true(d.points[0].kv_bytes == 0); // optional, absent
    assert_true(d.points[1].kv_window_s == 0.0002);

    // A prefill without flops, a decode step of 0 s, a missing array, a bad P/D size.
    assert_int_equal(tdm_gpu_report_parse_engine(
                         &e,
                         "{\"weight_bytes\": 1, \"decode\": [], \"prefill\": [{\"tokens\": 2, "
                         "\"seconds\": 1}]}",
                         err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "prefill[0]"));
    assert_int_equal(tdm_gpu_report_parse_engine(
                         &e,
                         "{\"weight_bytes\": 1, \"decode\": [{\"batch\": 1, \"seconds\": 0}], "
                         "\"prefill\": []}",
                         err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "decode[0]"));
    assert_int_equal(
        tdm_gpu_report_parse_engine(&e, "{\"weight_bytes\": 1, \"prefill\": []}", err, sizeof err),
        TDM_EPROTO);
    assert_non_null(strstr(err, "decode missing"));
    assert_int_equal(tdm_gpu_report_parse_pd(&d,
                                             "{\"sizes\": [{\"tokens\": 8, \"ttft_direct_s\": 1, "
                                             "\"ttft_pd_s\": 1, \"transfer_s\": -1}]}",
                                             err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "sizes[0]"));
    assert_int_equal(tdm_gpu_report_parse_pd(&d, "{\"sizes\": []}", err, sizeof err), TDM_EPROTO);
}

static void test_ratios(void **state)
{
    (void)state;
    struct tdm_gpu_probe p;
    char err[256];
    assert_int_equal(tdm_gpu_report_parse_probe(&p, PROBE, err, sizeof err), TDM_OK);
    // 1e9 bytes in 0.5 ms = 2000 GB/s of 4000.
    assert_true(fabs(tdm_gpu_report_decode_bw_util(&p, 1e9, 0.0005) - 0.5) < 1e-12);
    // 2.8e14 FLOP in 1 s of a 700 TFLOP/s peak.
    assert_true(fabs(tdm_gpu_report_prefill_util(&p, 2.8e14, 1.0) - 0.4) < 1e-12);
    struct tdm_gpu_pd_point pt = {.tokens = 2048, .kv_bytes = 3.5e8, .kv_window_s = 2e-4};
    assert_true(fabs(tdm_gpu_report_ipc_util(&p, &pt) - 0.5) < 1e-12);
    // Missing inputs give 0, never a division by zero.
    assert_true(tdm_gpu_report_decode_bw_util(&p, 1e9, 0) == 0);
    assert_true(tdm_gpu_report_prefill_util(NULL, 1, 1) == 0);
    pt.kv_window_s = 0;
    assert_true(tdm_gpu_report_ipc_util(&p, &pt) == 0);
}

static void test_format_goals(void **state)
{
    (void)state;
    struct tdm_gpu_probe p;
    struct tdm_gpu_engine e;
    struct tdm_gpu_pd d;
    char err[256], out[8192];
    assert_int_equal(tdm_gpu_report_parse_probe(&p, PROBE, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_gpu_report_parse_engine(&e, ENGINE, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_gpu_report_parse_pd(&d, PD, err, sizeof err), TDM_OK);

    // Every goal met (each at or inside its bound).
    assert_int_equal(tdm_gpu_report_format(&p, &e, &d, out, sizeof out), 0);
    assert_non_null(strstr(out, "NVIDIA H200 (sm_90, 132 SMs"));
    assert_non_null(strstr(out, "decode batch 1, ms per token"));
    assert_null(strstr(out, "MISSED"));
    assert_null(strstr(out, "not measured"));
    // The b1 row: 0.500 ms, 2000 tok/s, weight-read utilisation 0.500.
    assert_non_null(strstr(out, "0.500         2000          0.500"));

    // A slower GPU: b1 at 1.2 ms and prefill-2048 at 1.2 s miss their goals.
    e.decode[0].seconds = 0.0012;
    e.prefill[1].seconds = 1.2;
    assert_int_equal(tdm_gpu_report_format(&p, &e, &d, out, sizeof out), 2);
    assert_non_null(strstr(out, "MISSED"));

    // Engine figures from the CPU backend are shown but never judged as the GPU's.
    snprintf(e.device, sizeof e.device, "cpu");
    assert_int_equal(tdm_gpu_report_format(&p, &e, &d, out, sizeof out), 0);
    assert_non_null(
        strstr(out, "(ran on cpu, not a GPU: the decode and prefill goals are not judged)"));
    assert_non_null(strstr(out, "decode batch 1, ms per token                 not measured"));
    snprintf(e.device, sizeof e.device, "cuda:0");

    // Over nng the P/D figures are shown but issue 10's CUDA IPC goals are not judged.
    snprintf(d.transport, sizeof d.transport, "nng");
    assert_int_equal(tdm_gpu_report_format(&p, &e, &d, out, sizeof out), 2);
    assert_non_null(strstr(out, "--kv-transfer nng (the P/D goals are for cuda-ipc: not judged)"));
    assert_non_null(strstr(out, "P/D 2048, exposed transfer / TTFT            not measured"));

    // Without the engine and P/D steps every goal is "not measured", none missed.
    assert_int_equal(tdm_gpu_report_format(&p, NULL, NULL, out, sizeof out), 0);
    assert_non_null(strstr(out, "engine  not measured"));
    assert_non_null(strstr(out, "pd      not measured"));
    const char *s = out;
    int n = 0;
    while ((s = strstr(s, "not measured\n")) != NULL) {
        n++;
        s++;
    }
    assert_int_equal(n, 5); // the five goal lines

    // A tiny buffer is truncated, still terminated.
    char tiny[16];
    tdm_gpu_report_format(&p, &e, &d, tiny, sizeof tiny);
    assert_int_equal(strlen(tiny), 15);
}

// The cost of batch invariance: ENGINE as the invariant run, a fast run 0.4 ms
// at batch 1 (cost +25 %) and 2 ms at 64 (0 %); the rule then says to make
// --no-batch-invariant the default; at 0.46 ms (+8.7 %) it keeps invariance.
static void test_format_invariance(void **state)
{
    (void)state;
    struct tdm_gpu_engine inv, fast;
    char err[256], out[4096];
    assert_int_equal(tdm_gpu_report_parse_engine(&inv, ENGINE, err, sizeof err), TDM_OK);
    assert_int_equal(inv.batch_invariant, -1); // absent: an older bench
    static const char *FAST =
        "{\"device\": \"cuda\", \"batch_invariant\": false, \"weight_bytes\": 1000000000,"
        " \"decode\": [{\"batch\": 1, \"seconds\": 0.0004}, {\"batch\": 16, \"seconds\": 0.001},"
        "  {\"batch\": 64, \"seconds\": 0.002}], \"prefill\": []}";
    assert_int_equal(tdm_gpu_report_parse_engine(&fast, FAST, err, sizeof err), TDM_OK);
    assert_int_equal(fast.batch_invariant, 0);
    assert_int_equal(tdm_gpu_report_format_invariance(&inv, &fast, out, sizeof out), 1);
    printf("%s", out);
    assert_non_null(strstr(out, "1                       0.500      0.400   +25.0%"));
    assert_non_null(strstr(out, "64                      2.000      2.000    +0.0%"));
    assert_null(strstr(out, "\n  8 ")); // batch 8: not in the fast run
    assert_non_null(strstr(out, "make --no-batch-invariant the default"));
    fast.decode[0].seconds = 0.00046;
    assert_int_equal(tdm_gpu_report_format_invariance(&inv, &fast, out, sizeof out), 0);
    assert_non_null(strstr(out, "+8.7% at batch 1 and +0.0% at batch 64"));
    assert_non_null(strstr(out, "keep --batch-invariant the default"));
    // Batch 64 missing from a run, or a run missing: not judged.
    fast.n_decode = 2;
    assert_int_equal(tdm_gpu_report_format_invariance(&inv, &fast, out, sizeof out), -1);
    assert_non_null(strstr(out, "not judged"));
    assert_int_equal(tdm_gpu_report_format_invariance(NULL, &fast, out, sizeof out), -1);
    assert_non_null(strstr(out, "not measured"));
    // batch_invariant must be a boolean when present.
    assert_int_equal(tdm_gpu_report_parse_engine(&fast,
                                                 "{\"batch_invariant\": 1, \"weight_bytes\": 1, "
                                                 "\"decode\": [], \"prefill\": []}",
                                                 err, sizeof err),
                     TDM_EPROTO);
    assert_non_null(strstr(err, "batch_invariant"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_probe),         cmocka_unit_test(test_probe_errors),
        cmocka_unit_test(test_parse_engine_and_pd), cmocka_unit_test(test_ratios),
        cmocka_unit_test(test_format_goals),        cmocka_unit_test(test_format_invariance),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
