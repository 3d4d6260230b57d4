// SPDX-License-Identifier: Apache-2.0
// tandem-decode's P/D flags: taken out of argv (both "--flag value" and
// "--flag=value"), the rest left in order for the worker base's parser, bad
// values refused with a message, and --help lists every P/D flag it takes.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "pd_receiver.h"

static void test_decode_pd_args(void **state)
{
    (void)state;
    char *argv[] = {"tandem-decode",
                    "--nng-url=tcp://0.0.0.0:9301",
                    "--model",
                    "m",
                    "--pd-prefill-timeout",
                    "5",
                    "--pd-prefill-liveness",
                    "0.5",
                    "--pd-router-liveness=12",
                    NULL};
    int argc = 9;
    struct tdm_pd_receiver_config cfg;
    tdm_pd_receiver_config_default(&cfg);
    assert_string_equal(cfg.nng_url, ""); // P/D off unless asked for
    assert_true(cfg.router_liveness == 30);
    char err[256];
    assert_int_equal(tdm_pd_receiver_take_args(&cfg, &argc, argv, err, sizeof err), TDM_OK);
    assert_int_equal(argc, 3);
    assert_string_equal(argv[1], "--model");
    assert_string_equal(cfg.nng_url, "tcp://0.0.0.0:9301");
    assert_true(cfg.prefill_timeout == 5);
    assert_true(cfg.prefill_liveness == 0.5);
    assert_true(cfg.router_liveness == 12);
    // --layers-per-frame is the prefill worker's spelling too (issue 14); the
    // old --pd-layers-per-frame still parses (hidden from --help).
    char *alias[] = {"d", "--pd-layers-per-frame", "6", NULL};
    argc = 3;
    assert_int_equal(tdm_pd_receiver_take_args(&cfg, &argc, alias, err, sizeof err), TDM_OK);
    assert_int_equal(cfg.layers_per_frame, 6);
    char *bad[] = {"d", "--pd-transfer-timeout", "-1", NULL};
    argc = 3;
    assert_int_equal(tdm_pd_receiver_take_args(&cfg, &argc, bad, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "--pd-transfer-timeout"));
}

static void test_decode_pd_usage(void **state)
{
    (void)state;
    char u[4096] = "";
    FILE *f = fmemopen(u, sizeof u, "w");
    assert_non_null(f);
    tdm_flags_help(tdm_pd_receiver_flags(), f);
    fclose(f);
    static const char *const flags[] = {
        "--nng-url",          "--pd-prefill-timeout",  "--pd-transfer-timeout",
        "--layers-per-frame", "--pd-prefill-liveness", "--pd-router-liveness"};
    for (size_t i = 0; i < sizeof flags / sizeof *flags; i++) {
        assert_non_null(strstr(u, flags[i]));
        // each one is really taken out of argv
        char val[] = "1";
        char *argv[] = {"tandem-decode", (char *)flags[i], i == 0 ? "tcp://127.0.0.1:1" : val,
                        NULL};
        int argc = 3;
        struct tdm_pd_receiver_config cfg;
        tdm_pd_receiver_config_default(&cfg);
        char err[256];
        assert_int_equal(tdm_pd_receiver_take_args(&cfg, &argc, argv, err, sizeof err), TDM_OK);
        assert_int_equal(argc, 1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_pd_args),
        cmocka_unit_test(test_decode_pd_usage),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
