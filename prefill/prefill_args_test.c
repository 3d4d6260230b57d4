// SPDX-License-Identifier: Apache-2.0
// tandem-prefill's P/D flags: taken out of argv (both "--flag value" and
// "--flag=value"), the rest left in order for the worker base's parser, bad
// values refused with a message.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "core.h"
#include "prefill.h"
#include "worker.h"

static void test_prefill_args(void **state)
{
    (void)state;
    char *argv[] = {"tandem-prefill",     "--model", "m", "--nng-url",
                    "tcp://127.0.0.1:9",  "--port",  "1", "--kv-hold-seconds=2.5",
                    "--layers-per-frame", "8",       NULL};
    int argc = 10;
    struct tdm_prefill_config cfg;
    tdm_prefill_config_default(&cfg);
    char err[256];
    assert_int_equal(tdm_prefill_config_take_args(&cfg, &argc, argv, err, sizeof err), TDM_OK);
    assert_int_equal(argc, 5);
    assert_string_equal(argv[1], "--model");
    assert_string_equal(argv[2], "m");
    assert_string_equal(argv[3], "--port");
    assert_string_equal(argv[4], "1");
    assert_null(argv[5]);
    assert_string_equal(cfg.nng_url, "tcp://127.0.0.1:9");
    // Defaults: loopback inbox (issue 11), its own HTTP port (issue 14).
    struct tdm_prefill_config d;
    tdm_prefill_config_default(&d);
    assert_string_equal(d.nng_url, "tcp://127.0.0.1:9002");
    struct tdm_worker_config wc;
    tdm_prefill_worker_config_default(&wc);
    assert_int_equal(wc.port, 8002);
    assert_true(cfg.hold_seconds == 2.5);
    assert_int_equal(cfg.layers_per_frame, 8);

    char *bad1[] = {"p", "--kv-hold-seconds", "x", NULL};
    argc = 3;
    assert_int_equal(tdm_prefill_config_take_args(&cfg, &argc, bad1, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "--kv-hold-seconds"));
    char *bad2[] = {"p", "--nng-url", "localhost:9", NULL};
    argc = 3;
    assert_int_equal(tdm_prefill_config_take_args(&cfg, &argc, bad2, err, sizeof err), TDM_EINVAL);
    char *bad3[] = {"p", "--nng-url", NULL};
    argc = 2;
    assert_int_equal(tdm_prefill_config_take_args(&cfg, &argc, bad3, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "missing value"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prefill_args),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
