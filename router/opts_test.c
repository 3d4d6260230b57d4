// SPDX-License-Identifier: Apache-2.0
// tandem-router's command line: --policy with --decode/--prefill builds the
// short-form config tandem up writes (issue 14: a router without a config
// file), checked by the config parser; the conflicts and bad endpoint lists
// are one-line errors.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "core.h"
#include "router.h"

static int parse(struct tdm_router_opts *o, char *err, size_t errlen, int argc, char **argv)
{
    tdm_router_opts_default(o);
    return tdm_router_opts_parse_args(o, argc, argv, err, errlen);
}

static void test_policy_short_form(void **state)
{
    (void)state;
    struct tdm_router_opts o;
    char err[512];
    char *argv[] = {"tandem-router", "--model", "m", "--policy", "round_robin", "--decode",
                    "127.0.0.1:8001,[::1]:8101:9301", "--prefill", "127.0.0.1:8002",
                    "--pd-threshold", "64", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 11, argv), TDM_OK);
    assert_true(o.generated_dir[0] != '\0');
    struct tdm_router_config *cfg = NULL;
    assert_int_equal(tdm_router_config_load(&cfg, o.config, err, sizeof err), TDM_OK);
    char *json = tdm_router_config_to_json(cfg, 0);
    assert_non_null(strstr(json, "round_robin"));
    assert_non_null(strstr(json, "9301"));     // the given nng port
    assert_non_null(strstr(json, "9001"));     // the default, HTTP port + 1000
    assert_non_null(strstr(json, "9002"));     // the prefill worker's
    free(json);
    tdm_router_config_unref(cfg);
    unlink(o.config);
    rmdir(o.generated_dir);
}

static void test_policy_errors(void **state)
{
    (void)state;
    struct tdm_router_opts o;
    char err[512];
    char *both[] = {"r", "--model", "m", "--config", "x.yaml", "--policy", "random", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, both), TDM_EINVAL);
    assert_non_null(strstr(err, "not both"));
    char *none[] = {"r", "--model", "m", "--policy", "random", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 5, none), TDM_EINVAL);
    assert_non_null(strstr(err, "--policy needs --decode"));
    char *bad[] = {"r", "--model", "m", "--policy", "random", "--decode", "host-without-port",
                   NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, bad), TDM_EINVAL);
    assert_non_null(strstr(err, "is not HOST:PORT"));
    char *unknown[] = {"r", "--model", "m", "--policy", "fastest", "--decode", "h:1", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, unknown), TDM_EINVAL);
    assert_non_null(strstr(err, "--policy"));
    char *missing[] = {"r", "--model", "m", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 3, missing), TDM_EINVAL);
    assert_non_null(strstr(err, "--config FILE"));
}

// vLLM's tool flags: auto tool choice needs a parser, and a known one.
static void test_tool_flags(void **state)
{
    (void)state;
    struct tdm_router_opts o;
    char err[512];
    char *ok[] = {"r", "--model", "m", "--config", "x.yaml", "--enable-auto-tool-choice",
                  "--tool-call-parser", "llama3_json", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 8, ok), TDM_OK);
    assert_true(o.enable_auto_tool_choice);
    assert_string_equal(o.tool_call_parser, "llama3_json");
    char *alone[] = {"r", "--model", "m", "--config", "x.yaml", "--enable-auto-tool-choice", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 6, alone), TDM_EINVAL);
    assert_non_null(strstr(err, "--enable-auto-tool-choice requires --tool-call-parser"));
    char *unknown[] = {"r", "--model", "m", "--config", "x.yaml", "--enable-auto-tool-choice",
                       "--tool-call-parser", "pythonic", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 8, unknown), TDM_EINVAL);
    assert_non_null(strstr(err, "unknown parser \"pythonic\""));
    // --max-model-len with vLLM's suffixes, as on the workers (issue 28, item 5).
    char *len[] = {"r", "--model", "m", "--config", "x.yaml", "--max-model-len", "32K", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, len), TDM_OK);
    assert_int_equal(o.max_model_len, 32768);
}

// --otlp-traces-endpoint (vLLM's flag): kept when it is an http(s) URL, a
// one-line error naming the flag otherwise.
static void test_otlp_endpoint(void **state)
{
    (void)state;
    struct tdm_router_opts o;
    char err[512];
    char *ok[] = {"r", "--config", "c.yaml", "--model", "m", "--otlp-traces-endpoint",
                  "http://collector:4318", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, ok), TDM_OK);
    assert_string_equal(o.otlp_traces_endpoint, "http://collector:4318");
    char *bad[] = {"r", "--config", "c.yaml", "--model", "m", "--otlp-traces-endpoint",
                   "collector:4318", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 7, bad), TDM_EINVAL);
    assert_non_null(strstr(err, "--otlp-traces-endpoint: expected an http:// or https:// URL"));
}

// The flags every OpenAI front takes (common/edge/openai/openai_front.h) mean the
// same on the workers: worker/worker_config_test.c checks the same cases, word
// for word (issue 27, part B: the two copies had drifted; the router checked
// --log-level only in main, after parsing).
static void test_front_flags(void **state)
{
    (void)state;
    struct tdm_router_opts o;
    char err[256];
    char *ok[] = {"r",     "--model",          "m",   "--config", "x.yaml", "--log-level",
                  "DEBUG", "--max-body-bytes", "1TB", NULL};
    assert_int_equal(parse(&o, err, sizeof err, 9, ok), TDM_OK);
    assert_int_equal(o.max_body_bytes, (size_t)1000000000000ull);
    assert_string_equal(o.log_level, "DEBUG");
    char *kw[] = {"r",
                  "--model",
                  "m",
                  "--config",
                  "x.yaml",
                  "--default-chat-template-kwargs",
                  "{\"enable_thinking\": false}",
                  "--trust-request-chat-template",
                  NULL};
    assert_int_equal(parse(&o, err, sizeof err, 8, kw), TDM_OK);
    assert_string_equal(o.default_chat_template_kwargs, "{\"enable_thinking\": false}");
    assert_true(o.trust_request_chat_template);
    assert_int_equal(o.max_logprobs, 20);
    static const char *const bad[][3] = {
        {"--max-logprobs", "21", "--max-logprobs: expected an integer in [0, 20], got \"21\""},
        {"--default-chat-template-kwargs", "{\"tokenize\": true}",
         "--default-chat-template-kwargs: Found unexpected chat template kwargs from request: "
         "{'tokenize'}"},
        {"--default-chat-template-kwargs", "[1]",
         "--default-chat-template-kwargs: chat_template_kwargs: Input should be a valid "
         "dictionary"},
        {"--max-body-bytes", "2TB",
         "--max-body-bytes: expected a byte size like 2GiB or 512MiB in [1024, 1000000000000], "
         "got \"2TB\""},
        {"--drain-timeout", "100000",
         "--drain-timeout: expected a number in [0, 86400], got \"100000\""},
        {"--log-level", "loud", "--log-level: expected err, warn, info or debug, got \"loud\""},
        {"--served-model-name", "", "--served-model-name: expected a non-empty value"},
        {"--otlp-traces-endpoint", "collector:4318",
         "--otlp-traces-endpoint: expected an http:// or https:// URL, got \"collector:4318\""},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *argv[] = {
            "r", "--model", "m", "--config", "x.yaml", (char *)bad[i][0], (char *)bad[i][1], NULL};
        assert_int_equal(parse(&o, err, sizeof err, 7, argv), TDM_EINVAL);
        assert_string_equal(err, bad[i][2]);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_policy_short_form), cmocka_unit_test(test_tool_flags),
        cmocka_unit_test(test_policy_errors),     cmocka_unit_test(test_otlp_endpoint),
        cmocka_unit_test(test_front_flags),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
