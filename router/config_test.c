// SPDX-License-Identifier: Apache-2.0
// Tests of the router config: every example in deploy/config/ parses into what
// its comments promise, the short form expands as documented, every class of
// error names its key path, and the JSON view round-trips through cJSON.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <dirent.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "config.h"
#include "core.h"

static struct tdm_router_config *load_example(const char *name)
{
    char path[512], err[512] = "";
    snprintf(path, sizeof path, "%s/deploy/config/%s", TANDEM_SOURCE_DIR, name);
    struct tdm_router_config *cfg = NULL;
    int rc = tdm_router_config_load(&cfg, path, err, sizeof err);
    if (rc)
        fail_msg("%s: %s", name, err);
    return cfg;
}

static struct tdm_router_config *parse_ok(const char *text)
{
    char err[512] = "";
    struct tdm_router_config *cfg = NULL;
    int rc = tdm_router_config_parse(&cfg, text, strlen(text), NULL, err, sizeof err);
    if (rc)
        fail_msg("unexpected error: %s\n--- text:\n%s", err, text);
    return cfg;
}

// Parses text expecting TDM_EINVAL with an error containing want.
static void parse_err(const char *text, const char *want)
{
    char err[512] = "";
    struct tdm_router_config *cfg = NULL;
    int rc = tdm_router_config_parse(&cfg, text, strlen(text), NULL, err, sizeof err);
    if (rc == TDM_OK) {
        tdm_router_config_unref(cfg);
        fail_msg("parsed, expected error '%s'\n--- text:\n%s", want, text);
    }
    assert_int_equal(rc, TDM_EINVAL);
    assert_null(cfg);
    if (!strstr(err, want))
        fail_msg("error '%s' lacks '%s'", err, want);
}

static const char *ref_name(const struct tdm_router_config *c, size_t profile, size_t i)
{
    return c->plugins[c->profiles[profile].refs[i].plugin].name;
}

// Weight of the scorer of this type in the profile, or -1.
static double weight_of(const struct tdm_router_config *c, size_t profile,
                        enum tdm_router_plugin_type type)
{
    const struct tdm_router_profile *p = &c->profiles[profile];
    for (size_t i = 0; i < p->n_refs; i++)
        if (c->plugins[p->refs[i].plugin].type == type)
            return p->refs[i].weight;
    return -1;
}

static enum tdm_router_plugin_type picker_of(const struct tdm_router_config *c, size_t profile)
{
    const struct tdm_router_profile *p = &c->profiles[profile];
    assert_true(p->picker < p->n_refs);
    return c->plugins[p->refs[p->picker].plugin].type;
}

// ---- examples ------------------------------------------------------------------------------

static void test_example_round_robin(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("round-robin.yaml");
    assert_string_equal(c->short_policy, "round_robin");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 256);
    assert_int_equal(c->n_static, 4);
    assert_string_equal(c->static_endpoints[0].host, "127.0.0.1");
    assert_int_equal(c->static_endpoints[0].http_port, 8101);
    assert_int_equal(c->static_endpoints[0].nng_port, 9101); // http + 1000
    assert_int_equal(c->static_endpoints[0].role, TDM_ROUTER_ROLE_PREFILL);
    assert_int_equal(c->static_endpoints[3].role, TDM_ROUTER_ROLE_DECODE);
    assert_int_equal(picker_of(c, c->decode_profile), TDM_ROUTER_ROUND_ROBIN_PICKER);
    assert_int_equal(picker_of(c, c->prefill_profile), TDM_ROUTER_ROUND_ROBIN_PICKER);
    assert_string_equal(c->profiles[c->decode_profile].name, "decode");
    assert_string_equal(ref_name(c, c->decode_profile, 0), "decode-filter");
    assert_string_equal(ref_name(c, c->prefill_profile, 0), "prefill-filter");
    // defaults
    assert_true(c->health.interval_seconds == 2.0);
    assert_int_equal(c->health.failure_threshold, 3);
    assert_string_equal(c->health.path, "/health");
    assert_true(c->load_stale_seconds == 2.0);
    assert_int_equal(c->block_size_tokens, 16);
    assert_string_equal(c->session_header, "x-session-token");
    tdm_router_config_unref(c);
}

static void test_example_least_loaded(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("least-loaded.yaml");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_NEVER);
    assert_int_equal(c->n_static, 3);
    assert_int_equal(c->static_endpoints[0].http_port, 8001);
    assert_int_equal(c->static_endpoints[2].http_port, 8005);
    assert_int_equal(c->static_endpoints[2].nng_port, 9005);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_QUEUE_SCORER) == 2.0);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_RUNNING_SCORER) == 1.0);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_KV_CACHE_UTIL_SCORER) == 1.0);
    assert_int_equal(picker_of(c, c->decode_profile), TDM_ROUTER_MAX_SCORE_PICKER);
    assert_true(c->health.interval_seconds == 1.0);
    assert_true(c->health.timeout_seconds == 0.5);
    assert_int_equal(c->health.failure_threshold, 2);
    assert_true(c->request_deadline_seconds == 300.0);
    tdm_router_config_unref(c);
}

static void test_example_prefix_cache(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("prefix-cache.yaml");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 512);
    assert_int_equal(c->n_static, 0);
    assert_int_equal(c->n_dns, 2);
    assert_string_equal(c->dns_endpoints[0].name, "tandem-prefill.tandem.svc.cluster.local");
    assert_int_equal(c->dns_endpoints[0].role, TDM_ROUTER_ROLE_PREFILL);
    assert_int_equal(c->dns_endpoints[1].role, TDM_ROUTER_ROLE_DECODE);
    assert_int_equal(c->dns_endpoints[1].http_port, 8001);
    assert_int_equal(c->dns_endpoints[1].nng_port, 9001);
    assert_true(c->dns_refresh_seconds == 5.0);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_PREFIX_CACHE_SCORER) == 3.0);
    assert_int_equal(c->max_prefix_blocks_to_match, 256);
    tdm_router_config_unref(c);
}

static void test_example_session_affinity(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("session-affinity.yaml");
    assert_string_equal(c->session_header, "x-session-token"); // lower-cased
    assert_int_equal(c->prefill_retries, 2);
    assert_int_equal(c->n_static, 5);
    assert_int_equal(c->static_endpoints[4].http_port, 8002);
    assert_int_equal(c->static_endpoints[4].nng_port, 9102);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_SESSION_AFFINITY_SCORER) == 10.0);
    // the prefill profile balances by load instead
    assert_true(weight_of(c, c->prefill_profile, TDM_ROUTER_SESSION_AFFINITY_SCORER) < 0);
    assert_true(weight_of(c, c->prefill_profile, TDM_ROUTER_QUEUE_SCORER) == 2.0);
    tdm_router_config_unref(c);
}

static void test_example_pd_llm_d(void **state)
{
    (void)state;
    // A file without apiVersion shows the documented default.
    struct tdm_router_config *plain = parse_ok("policy: random\n");
    char *pv = tdm_router_config_to_json(plain, 0);
    assert_non_null(strstr(pv, "\"llm-d.ai/v1alpha1\""));
    assert_null(strstr(pv, "\"llm-d.ai/v1\""));
    free(pv);
    tdm_router_config_unref(plain);
    struct tdm_router_config *c = load_example("pd-llm-d.yaml");
    assert_null(c->short_policy);
    assert_string_equal(c->api_version, "llm-d.ai/v1alpha1");
    assert_int_equal(c->n_plugins, 11);
    assert_int_equal(c->n_profiles, 2);
    assert_true(weight_of(c, c->prefill_profile, TDM_ROUTER_COLOCATION_SCORER) == 4.0);
    assert_string_equal(c->profiles[c->decode_profile].name, "decode");
    assert_string_equal(c->profiles[c->prefill_profile].name, "prefill");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 256);
    size_t u = tdm_router_config_find_plugin(c, "utilization-detector");
    assert_true(u != SIZE_MAX);
    assert_int_equal(c->plugins[u].params.utilization.queue_depth_threshold, 8);
    assert_true(c->plugins[u].params.utilization.kv_cache_util_threshold == 0.9);
    size_t la = tdm_router_config_find_plugin(c, "load-aware-scorer");
    assert_int_equal(c->plugins[la].params.load_aware.threshold, 64);
    assert_true(weight_of(c, c->decode_profile, TDM_ROUTER_PREFIX_CACHE_SCORER) == 2.0);
    assert_true(weight_of(c, c->prefill_profile, TDM_ROUTER_PREFIX_CACHE_SCORER) < 0);
    assert_int_equal(picker_of(c, c->decode_profile), TDM_ROUTER_MAX_SCORE_PICKER);
    assert_int_equal(c->n_dns, 2);
    assert_int_equal(c->prefill_retries, 1);
    tdm_router_config_unref(c);
}

static void test_example_random_json(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("random.json");
    assert_string_equal(c->short_policy, "random");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_ALWAYS);
    assert_int_equal(picker_of(c, c->decode_profile), TDM_ROUTER_RANDOM_PICKER);
    assert_int_equal(c->n_static, 3);
    tdm_router_config_unref(c);
}

// Every file in deploy/config/ parses, so a new example cannot slip in broken
// (the ones listed also have their own tests above).
static void test_every_example_parses(void **state)
{
    (void)state;
    static const char *const tested[] = {
        "round-robin.yaml", "least-loaded.yaml", "prefix-cache.yaml", "session-affinity.yaml",
        "pd-llm-d.yaml",    "random.json",       "flow-control.yaml"};
    char dir[512];
    snprintf(dir, sizeof dir, "%s/deploy/config", TANDEM_SOURCE_DIR);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));) {
        size_t len = strlen(e->d_name);
        bool yaml = len > 5 && !strcmp(e->d_name + len - 5, ".yaml");
        bool json = len > 5 && !strcmp(e->d_name + len - 5, ".json");
        if (!yaml && !json)
            continue;
        struct tdm_router_config *c = load_example(e->d_name);
        tdm_router_config_unref(c);
        for (size_t i = 0; i < sizeof tested / sizeof *tested; i++)
            n += !strcmp(tested[i], e->d_name);
    }
    closedir(d);
    assert_int_equal(n, (int)(sizeof tested / sizeof *tested)); // the tested ones are all there
}

// ---- llm-d form details -------------------------------------------------------------------

static void test_llmd_single_profile_defaults(void **state)
{
    (void)state;
    struct tdm_router_config *c = parse_ok("apiVersion: llm-d.ai/v1\n"
                                           "kind: EndpointPickerConfig\n"
                                           "plugins:\n"
                                           "- type: queue-scorer\n"
                                           "- type: kv-cache-utilization-scorer\n"
                                           "schedulingProfiles:\n"
                                           "- name: default\n"
                                           "  plugins:\n"
                                           "  - pluginRef: queue-scorer\n"
                                           "  - pluginRef: kv-cache-utilization-scorer\n"
                                           "    weight: 0.5\n");
    assert_int_equal(c->n_profiles, 1);
    assert_int_equal(c->decode_profile, 0);
    assert_true(c->prefill_profile == SIZE_MAX);
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_NEVER);
    // default picker added
    assert_int_equal(picker_of(c, 0), TDM_ROUTER_MAX_SCORE_PICKER);
    assert_true(weight_of(c, 0, TDM_ROUTER_QUEUE_SCORER) == 1.0);
    assert_true(weight_of(c, 0, TDM_ROUTER_KV_CACHE_UTIL_SCORER) == 0.5);
    tdm_router_config_unref(c);
}

static void test_llmd_deciders(void **state)
{
    (void)state;
    const char *base = "plugins:\n"
                       "- type: disagg-profile-handler\n"
                       "%s"
                       "%s"
                       "schedulingProfiles:\n"
                       "- {name: prefill, plugins: [{pluginRef: random-picker}]}\n"
                       "- {name: decode, plugins: [{pluginRef: random-picker}]}\n";
    char text[1024];
    // always-disagg
    snprintf(text, sizeof text, base, "",
             "- type: random-picker\n- type: always-disagg-pd-decider\n");
    struct tdm_router_config *c = parse_ok(text);
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_ALWAYS);
    tdm_router_config_unref(c);
    // no decider at all: always disaggregate
    snprintf(text, sizeof text, base, "", "- type: random-picker\n");
    c = parse_ok(text);
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_ALWAYS);
    tdm_router_config_unref(c);
    // nonCachedTokens 0 disables (llm-d)
    snprintf(text, sizeof text, base, "",
             "- type: random-picker\n- type: prefix-based-pd-decider\n"
             "  parameters: {nonCachedTokens: 0}\n");
    c = parse_ok(text);
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_NEVER);
    tdm_router_config_unref(c);
    // deprecated pd-profile-handler threshold
    c = parse_ok("plugins:\n"
                 "- type: pd-profile-handler\n"
                 "  parameters: {threshold: 100, hashBlockSize: 16}\n"
                 "- type: random-picker\n"
                 "schedulingProfiles:\n"
                 "- {name: prefill, plugins: [{pluginRef: random-picker}]}\n"
                 "- {name: decode, plugins: [{pluginRef: random-picker}]}\n");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 100);
    tdm_router_config_unref(c);
    // custom profile names
    c = parse_ok("plugins:\n"
                 "- type: disagg-profile-handler\n"
                 "  parameters: {profiles: {decode: d, prefill: p}}\n"
                 "- {name: dec, type: prefix-based-pd-decider, parameters: {nonCachedTokens: 8}}\n"
                 "schedulingProfiles:\n"
                 "- {name: p, plugins: []}\n"
                 "- {name: d, plugins: []}\n");
    assert_string_equal(c->profiles[c->decode_profile].name, "d");
    assert_string_equal(c->profiles[c->prefill_profile].name, "p");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 8);
    tdm_router_config_unref(c);
}

static void test_short_form_variants(void **state)
{
    (void)state;
    struct tdm_router_config *c = parse_ok("policy: least_loaded\npd_threshold_tokens: 0\n");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_NEVER);
    tdm_router_config_unref(c);
    c = parse_ok("policy: prefix_cache\n");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 256);
    tdm_router_config_unref(c);
    c = parse_ok("policy: random\npd_mode: always\n");
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_ALWAYS);
    tdm_router_config_unref(c);
    c = parse_ok("policy: round_robin\nendpoints:\n  prefill-decode: ['[fd00::1]:8001', 'h']\n");
    assert_int_equal(c->n_static, 2);
    assert_string_equal(c->static_endpoints[0].host, "fd00::1");
    assert_int_equal(c->static_endpoints[0].role, TDM_ROUTER_ROLE_PREFILL_DECODE);
    assert_string_equal(c->static_endpoints[1].host, "h");
    assert_int_equal(c->static_endpoints[1].http_port, 8001);
    tdm_router_config_unref(c);
    // YAML anchors work
    c = parse_ok("policy: round_robin\nendpoints:\n  decode: {http_port: &p 8005, static: [a]}\n"
                 "  prefill: {http_port: *p, static: [b]}\n");
    assert_int_equal(c->n_static, 2);
    assert_int_equal(c->static_endpoints[0].http_port, 8005);
    assert_int_equal(c->static_endpoints[1].http_port, 8005);
    assert_int_equal(c->static_endpoints[0].role,
                     TDM_ROUTER_ROLE_PREFILL); // roles in order prefill, decode
    tdm_router_config_unref(c);
}

// ---- errors: every class names its key path --------------------------------------------------

static void test_errors(void **state)
{
    (void)state;
    const char *pd = "plugins:\n"
                     "- type: queue-scorer\n"
                     "- type: max-score-picker\n"
                     "schedulingProfiles:\n"
                     "- name: decode\n"
                     "  plugins: [{pluginRef: queue-scorer}]\n"
                     "- name: prefill\n"
                     "  plugins: [{pluginRef: queue}]\n";
    parse_err(pd, "schedulingProfiles[1].plugins[0].pluginRef: no plugin named 'queue'");
    // YAML syntax
    parse_err("policy: [round_robin\n", "line ");
    parse_err("", "empty");
    parse_err("- a\n- b\n", "(top level): expected a mapping, got a list");
    // unknown keys at each level
    parse_err("polcy: round_robin\n", "polcy: unknown key");
    parse_err("policy: round_robin\nhealth: {interval: 3}\n", "health.interval: unknown key");
    parse_err("policy: round_robin\nendpoints: {decode: {statik: []}}\n",
              "endpoints.decode.statik: unknown key");
    parse_err("plugins:\n- type: prefix-based-pd-decider\n  parameters: {nonCachedTokns: 3}\n"
              "schedulingProfiles: [{name: a, plugins: []}]\n",
              "plugins[0].parameters.nonCachedTokns: unknown key");
    // duplicate key
    parse_err("policy: round_robin\npolicy: random\n", "policy: duplicate key");
    // wrong types and ranges
    parse_err("policy: round_robin\npd_threshold_tokens: many\n",
              "pd_threshold_tokens: expected an integer, got 'many'");
    parse_err("policy: round_robin\npd_threshold_tokens: '12'\n",
              "pd_threshold_tokens: expected an integer, got '12'");
    parse_err("policy: round_robin\nhealth: {failure_threshold: 0}\n",
              "health.failure_threshold: 0 is out of range [1, 1000]");
    parse_err("policy: round_robin\nhealth: {timeout_seconds: 5}\n",
              "health.timeout_seconds: 5 is longer than interval_seconds 2");
    parse_err("policy: round_robin\nhealth: {path: health}\n", "health.path: must start with '/'");
    parse_err("policy: round_robin\nendpoints: {decode: ['h:99999']}\n",
              "endpoints.decode[0]: 'h:99999': port must be an integer in [1, 65535]");
    parse_err("policy: round_robin\nendpoints: {decode: ['fd00::1']}\n",
              "endpoints.decode[0]: 'fd00::1': write an IPv6 address as [addr]:port");
    parse_err("policy: round_robin\nendpoints: {decode: [{http_port: 1}]}\n",
              "endpoints.decode[0]: missing key 'host'");
    parse_err("policy: round_robin\nendpoints: {decode: {dns: [{host: x}]}}\n",
              "endpoints.decode.dns[0].host: unknown key");
    parse_err("policy: round_robin\nendpoints: {decode: ['a:1', 'a:1']}\n", "a:1 is listed twice");
    parse_err("policy: round_robin\nendpoints: {decode: {http_port: 65000, static: [a]}}\n",
              "nng_port must be given");
    parse_err("policy: round_robin\nrequest: {prefill_retries: 9}\n",
              "request.prefill_retries: 9 is out of range [0, 7]");
    parse_err("policy: round_robin\nload_stale_seconds: true\n",
              "load_stale_seconds: expected a number, got 'true'");
    // short form
    parse_err("policy: fastest\n", "policy: unknown policy 'fastest'");
    parse_err("policy: {a: 1}\n", "policy: expected a string, got a mapping");
    parse_err("policy: random\npd_mode: sometimes\n", "pd_mode: expected prefix, always or never");
    parse_err("policy: random\nplugins: []\n", "either the short form");
    parse_err("endpoints: {}\n", "no routing configured");
    parse_err("apiVersion: v1\npolicy: random\n",
              "apiVersion: 'v1' is not an EndpointPickerConfig");
    parse_err("kind: Deployment\npolicy: random\n", "kind: expected EndpointPickerConfig");
    // llm-d form
    parse_err("plugins:\n- type: queue-scorer\n", "schedulingProfiles: missing");
    parse_err("plugins:\n- type: fastest-scorer\nschedulingProfiles: []\n",
              "plugins[0].type: unknown plugin type 'fastest-scorer'");
    parse_err("plugins:\n- name: x\nschedulingProfiles: []\n", "plugins[0]: missing key 'type'");
    parse_err("plugins:\n- type: queue-scorer\n- type: queue-scorer\nschedulingProfiles: []\n",
              "plugins[1].type: a plugin named 'queue-scorer' is already defined");
    parse_err("plugins:\n- type: queue-scorer\n  parameters: {x: 1}\nschedulingProfiles: []\n",
              "plugins[0].parameters: queue-scorer takes no parameters");
    parse_err("plugins:\n- type: utilization-detector\n  parameters: {kvCacheUtilThreshold: 2}\n"
              "schedulingProfiles: []\n",
              "plugins[0].parameters.kvCacheUtilThreshold: 2 is out of range [0, 1]");
    parse_err("plugins:\n- type: prefix-cache-scorer\n  parameters: {autoTune: true}\n"
              "schedulingProfiles: []\n",
              "plugins[0].parameters.autoTune: not supported");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles: []\n",
              "schedulingProfiles: at least one scheduling profile is required");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- {name: a, plugins: []}\n"
              "- {name: a, plugins: []}\n",
              "schedulingProfiles[1].name: a profile named 'a' is already defined");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles:\n- {name: a, plugins: []}\n"
              "- {name: b, plugins: []}\n",
              "2 profiles need a disagg-profile-handler");
    parse_err("plugins: [{type: random-picker}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: random-picker, weight: 2}]}\n",
              "schedulingProfiles[0].plugins[0].weight: a weight applies to scorers only");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: queue-scorer, weight: -1}]}\n",
              "schedulingProfiles[0].plugins[0].weight: -1 is out of range");
    parse_err("plugins: [{type: random-picker}, {type: max-score-picker}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: random-picker}, {pluginRef: max-score-picker}]}\n",
              "schedulingProfiles[0].plugins[1].pluginRef: a profile takes one picker");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: queue-scorer}, {pluginRef: queue-scorer}]}\n",
              "'queue-scorer' is listed twice");
    parse_err("plugins: [{type: always-disagg-pd-decider}]\nschedulingProfiles:\n"
              "- {name: a, plugins: [{pluginRef: always-disagg-pd-decider}]}\n",
              "'always-disagg-pd-decider' is a decider");
    parse_err("plugins: [{type: disagg-profile-handler}]\nschedulingProfiles:\n"
              "- {name: decode, plugins: []}\n",
              "plugins[0].parameters.profiles.prefill: no scheduling profile named 'prefill'");
    parse_err(
        "plugins:\n- type: disagg-profile-handler\n  parameters: {deciders: {prefill: x}}\n"
        "schedulingProfiles:\n- {name: decode, plugins: []}\n- {name: prefill, plugins: []}\n",
        "plugins[0].parameters.deciders.prefill: no plugin named 'x'");
    parse_err(
        "plugins:\n- type: disagg-profile-handler\n"
        "  parameters: {deciders: {prefill: queue-scorer}}\n- type: queue-scorer\n"
        "schedulingProfiles:\n- {name: decode, plugins: []}\n- {name: prefill, plugins: []}\n",
        "'queue-scorer' is not a decider");
    parse_err("plugins:\n- type: disagg-profile-handler\n- type: single-profile-handler\n"
              "schedulingProfiles:\n- {name: decode, plugins: []}\n",
              "only one profile handler");
    parse_err(
        "plugins:\n- type: disagg-profile-handler\n- type: always-disagg-pd-decider\n"
        "- {name: d2, type: prefix-based-pd-decider}\n"
        "schedulingProfiles:\n- {name: decode, plugins: []}\n- {name: prefill, plugins: []}\n",
        "2 decider plugins: name the one to use");
    parse_err("policy: round_robin\npd_threshold_tokens: 3\nplugins: []\n",
              "either the short form");
    parse_err("plugins: [{type: queue-scorer}]\nschedulingProfiles: [{name: a, plugins: []}]\n"
              "pd_threshold_tokens: 3\n",
              "pd_threshold_tokens: short-form key");
}

static void test_error_line_numbers_and_file(void **state)
{
    (void)state;
    char err[512];
    struct tdm_router_config *c = NULL;
    const char *text = "policy: round_robin\n"
                       "health:\n"
                       "  interval_seconds: fast\n";
    assert_int_equal(tdm_router_config_parse(&c, text, strlen(text), "x.yaml", err, sizeof err),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "health.interval_seconds: expected a number, got 'fast' (line 3)"));
    assert_int_equal(tdm_router_config_load(&c, "/nonexistent/router.yaml", err, sizeof err),
                     TDM_ENOTFOUND);
    assert_null(c);
    // NUL inside the text
    assert_int_equal(tdm_router_config_parse(&c, "policy: random\0x", 16, NULL, err, sizeof err),
                     TDM_EINVAL);
    // Nesting past the limit is refused before libyaml loads the document
    // (its scanner is quadratic in flow nesting); at the limit it parses.
    static char deep[2 * 200000 + 32];
    int n = snprintf(deep, sizeof deep, "policy: ");
    for (int i = 0; i < 200000; i++)
        deep[n++] = '[';
    for (int i = 0; i < 200000; i++)
        deep[n++] = ']';
    deep[n] = '\0';
    parse_err(deep, "line 1: the config nests deeper than 128 levels");
    n = snprintf(deep, sizeof deep, "policy: random\nx: ");
    for (int i = 0; i < 127; i++) // 127 + the top-level mapping = 128
        deep[n++] = '[';
    for (int i = 0; i < 127; i++)
        deep[n++] = ']';
    deep[n] = '\0';
    parse_err(deep, "x: unknown key");
}

static void test_json_view(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("pd-llm-d.yaml");
    char *s = tdm_router_config_to_json(c, 1767225600.25);
    assert_non_null(s);
    cJSON *o = cJSON_Parse(s);
    assert_non_null(o);
    assert_string_equal(cJSON_GetObjectItem(o, "loaded_at")->valuestring,
                        "2026-01-01T00:00:00.250Z");
    assert_string_equal(cJSON_GetObjectItem(o, "kind")->valuestring, "EndpointPickerConfig");
    cJSON *pl = cJSON_GetObjectItem(o, "plugins");
    assert_int_equal(cJSON_GetArraySize(pl), 11);
    cJSON *pd = cJSON_GetObjectItem(o, "pd");
    assert_string_equal(cJSON_GetObjectItem(pd, "mode")->valuestring, "prefix");
    assert_int_equal(cJSON_GetObjectItem(pd, "threshold_tokens")->valueint, 256);
    cJSON *dec = cJSON_GetArrayItem(cJSON_GetObjectItem(o, "schedulingProfiles"), 1);
    assert_string_equal(cJSON_GetObjectItem(dec, "name")->valuestring, "decode");
    cJSON *r = cJSON_GetArrayItem(cJSON_GetObjectItem(dec, "plugins"), 2);
    assert_string_equal(cJSON_GetObjectItem(r, "pluginRef")->valuestring, "prefix-cache-scorer");
    assert_true(cJSON_GetObjectItem(r, "weight")->valuedouble == 2.0);
    cJSON_Delete(o);
    free(s);
    tdm_router_config_unref(c);
}

// Flow control: the example's gate, limits, bands, policy refs, detector
// thresholds and objectives; the defaults without it; every error class.
static void test_flow_control(void **state)
{
    (void)state;
    struct tdm_router_config *c = load_example("flow-control.yaml");
    const struct tdm_router_flow_config *fc = &c->flow;
    assert_true(fc->enabled);
    assert_int_equal(fc->max_requests, 2000);
    assert_int_equal(fc->max_bytes, 0);
    assert_true(fc->default_ttl == 60.0);
    assert_int_equal(fc->n_bands, 2);
    assert_int_equal(fc->bands[0].priority, 100);
    assert_int_equal(fc->bands[0].max_requests, 200);
    assert_int_equal(fc->bands[0].max_bytes, TDM_ROUTER_FLOW_BAND_MAX_BYTES);
    assert_int_equal(fc->bands[0].fairness, TDM_ROUTER_ROUND_ROBIN_FAIRNESS);
    assert_int_equal(fc->bands[0].ordering, TDM_ROUTER_FCFS_ORDERING);
    assert_int_equal(fc->bands[1].priority, -10);
    assert_int_equal(fc->bands[1].max_bytes, 50LL << 20);
    assert_int_equal(fc->bands[1].fairness, TDM_ROUTER_GLOBAL_STRICT_FAIRNESS);
    assert_int_equal(fc->default_band.max_bytes, 200LL << 20);
    assert_int_equal(fc->queue_depth_threshold, 4);
    assert_true(fc->kv_cache_util_threshold == 0.85);
    assert_int_equal(tdm_router_objective_priority(fc, "interactive"), 100);
    assert_int_equal(tdm_router_objective_priority(fc, "batch"), -10);
    assert_int_equal(tdm_router_objective_priority(fc, "nope"), 0);
    assert_int_equal(tdm_router_objective_priority(fc, NULL), 0);
    assert_ptr_equal(tdm_router_flow_band_of(fc, -10), &fc->bands[1]);
    assert_ptr_equal(tdm_router_flow_band_of(fc, 5), &fc->default_band);
    char *s = tdm_router_config_to_json(c, 0);
    cJSON *o = cJSON_Parse(s);
    assert_string_equal(cJSON_GetArrayItem(cJSON_GetObjectItem(o, "featureGates"), 0)->valuestring,
                        "flowControl");
    cJSON *f = cJSON_GetObjectItem(o, "flowControl");
    assert_string_equal(cJSON_GetObjectItem(f, "defaultRequestTTL")->valuestring, "60s");
    cJSON *b0 = cJSON_GetArrayItem(cJSON_GetObjectItem(f, "priorityBands"), 0);
    assert_string_equal(cJSON_GetObjectItem(b0, "fairnessPolicyRef")->valuestring,
                        "round-robin-fairness-policy");
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "objectives"), "batch")->valueint,
                     -10);
    cJSON_Delete(o);
    free(s);
    tdm_router_config_unref(c);

    // Off by default; the detector's defaults, or a utilization-detector's own parameters.
    c = parse_ok("policy: round_robin\n");
    assert_false(c->flow.enabled);
    assert_int_equal(c->flow.queue_depth_threshold, 5);
    assert_true(c->flow.kv_cache_util_threshold == 0.8);
    assert_int_equal(c->flow.default_band.max_bytes, TDM_ROUTER_FLOW_BAND_MAX_BYTES);
    tdm_router_config_unref(c);
    const char *base =
        "plugins:\n- {type: utilization-detector, parameters: {queueDepthThreshold: 9}}\n"
        "- {name: rr, type: round-robin-fairness-policy}\n"
        "- {type: queue-scorer}\n"
        "schedulingProfiles: [{name: a, plugins: [{pluginRef: queue-scorer}]}]\n";
    char text[1024];
    snprintf(text, sizeof text,
             "%sfeatureGates: [flowControl]\nflowControl:\n  maxBytes: 1.5G\n  maxRequests: 2k\n"
             "  defaultRequestTTL: 1m30.5s\n"
             "  priorityBands: [{priority: 1, fairnessPolicyRef: round-robin-fairness-policy}]\n",
             base);
    c = parse_ok(text);
    assert_int_equal(c->flow.max_bytes, 1500000000LL);
    assert_int_equal(c->flow.max_requests, 2000);
    assert_true(c->flow.default_ttl == 90.5);
    assert_int_equal(c->flow.bands[0].fairness, TDM_ROUTER_ROUND_ROBIN_FAIRNESS);
    assert_int_equal(c->flow.queue_depth_threshold, 9); // the plugin named utilization-detector
    tdm_router_config_unref(c);

    // Errors.
    parse_err("policy: round_robin\nfeatureGates: [flowControll]\n",
              "featureGates[0]: unknown feature gate 'flowControll' (known: flowControl)");
    parse_err("policy: round_robin\nfeatureGates: flowControl\n", "featureGates: expected a list");
    parse_err("policy: round_robin\nflowControl: {maxBytes: 1Gb}\n",
              "flowControl.maxBytes: expected a quantity such as 1000, 500M or 1Gi, got '1Gb'");
    parse_err("policy: round_robin\nflowControl: {maxRequests: -3}\n",
              "flowControl.maxRequests: expected a quantity");
    parse_err("policy: round_robin\nflowControl: {defaultRequestTTL: 30}\n",
              "flowControl.defaultRequestTTL: expected a duration such as 30s, 500ms or 1m30s, "
              "got '30'");
    parse_err("policy: round_robin\nflowControl: {defaultRequestTTL: 2d}\n",
              "flowControl.defaultRequestTTL: expected a duration");
    parse_err("policy: round_robin\nflowControl: {defaultRequestTTL: 25h}\n",
              "flowControl.defaultRequestTTL: '25h' is longer than 86400s");
    parse_err("policy: round_robin\nflowControl: {maxReqs: 3}\n",
              "flowControl.maxReqs: unknown key");
    parse_err("policy: round_robin\nflowControl: {priorityBands: [{maxRequests: 3}]}\n",
              "flowControl.priorityBands[0].priority: missing");
    parse_err("policy: round_robin\nflowControl: {priorityBands: [{priority: 1}, {priority: 1}]}\n",
              "flowControl.priorityBands[1]: priority 1 is listed twice (also band 0)");
    parse_err("policy: round_robin\nflowControl: {defaultPriorityBand: {priority: 1}}\n",
              "flowControl.defaultPriorityBand.priority: unknown key");
    parse_err(
        "policy: round_robin\nflowControl: {priorityBands: [{priority: 1, "
        "fairnessPolicyRef: fcfs-ordering-policy}]}\n",
        "flowControl.priorityBands[0].fairnessPolicyRef: 'fcfs-ordering-policy' is not a "
        "fairness policy (known: global-strict-fairness-policy, round-robin-fairness-policy)");
    parse_err("policy: round_robin\nflowControl: {priorityBands: [{priority: 1, "
              "orderingPolicyRef: edf-ordering-policy}]}\n",
              "'edf-ordering-policy' is not an ordering policy (known: fcfs-ordering-policy)");
    snprintf(text, sizeof text,
             "%sflowControl: {priorityBands: [{priority: 2, orderingPolicyRef: rr}]}\n", base);
    parse_err(text, "orderingPolicyRef: 'rr' is not an ordering policy");
    snprintf(text, sizeof text, "%ssaturationDetector: {pluginRef: queue-scorer}\n", base);
    parse_err(text, "saturationDetector.pluginRef: 'queue-scorer' is a queue-scorer, not a "
                    "saturation detector (known: utilization-detector)");
    parse_err("policy: round_robin\nsaturationDetector: {pluginRef: concurrency-detector}\n",
              "saturationDetector.pluginRef: no plugin named 'concurrency-detector'");
    parse_err("policy: round_robin\nobjectives: [a, b]\n",
              "objectives: expected a mapping of name: priority");
    parse_err("policy: round_robin\nobjectives: {gold: high}\n",
              "objectives.gold: expected an integer, got 'high'");
    snprintf(text, sizeof text, "%s  - {pluginRef: rr}\n",
             "plugins: [{name: rr, type: round-robin-fairness-policy}, "
             "{type: queue-scorer}]\nschedulingProfiles:\n- name: a\n  plugins:\n");
    parse_err(text, "'rr' is a flow control policy: it is configured at the top level, not in a "
                    "profile");
}

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(tdm_router_role_name(TDM_ROUTER_ROLE_PREFILL_DECODE), "prefill-decode");
    assert_null(tdm_router_role_name(TDM_ROUTER_ROLE_COUNT));
    assert_true(tdm_router_role_can_decode(TDM_ROUTER_ROLE_NONE));
    assert_false(tdm_router_role_can_prefill(TDM_ROUTER_ROLE_NONE));
    assert_true(tdm_router_role_can_prefill(TDM_ROUTER_ROLE_PREFILL_DECODE));
    assert_false(tdm_router_role_can_decode(TDM_ROUTER_ROLE_PREFILL));
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++)
        assert_non_null(tdm_router_plugin_type_name((enum tdm_router_plugin_type)t));
    assert_int_equal(tdm_router_plugin_type_kind(TDM_ROUTER_QUEUE_SCORER),
                     TDM_ROUTER_PLUGIN_SCORER);
}

int main(void)
{
    tdm_log_level = TDM_LOG_LEVEL_ERR;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_example_round_robin),
        cmocka_unit_test(test_example_least_loaded),
        cmocka_unit_test(test_example_prefix_cache),
        cmocka_unit_test(test_example_session_affinity),
        cmocka_unit_test(test_example_pd_llm_d),
        cmocka_unit_test(test_example_random_json),
        cmocka_unit_test(test_every_example_parses),
        cmocka_unit_test(test_llmd_single_profile_defaults),
        cmocka_unit_test(test_llmd_deciders),
        cmocka_unit_test(test_short_form_variants),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_error_line_numbers_and_file),
        cmocka_unit_test(test_json_view),
        cmocka_unit_test(test_flow_control),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
