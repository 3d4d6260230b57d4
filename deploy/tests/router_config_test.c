// SPDX-License-Identifier: Apache-2.0
// deploy_router_config_test: the router config that the Kubernetes ConfigMap
// carries (deploy/k8s/base/router-config.yaml) must load with the router's own
// parser, discover both roles through DNS (the headless Services; deploy_k8s
// checks the names and ports against the rendered manifests), and enable
// prefill/decode disaggregation. A corrupted copy must be rejected, so the
// load check is not vacuous.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "config.h"
#include "core.h"

#define K8S_ROUTER_CONFIG TANDEM_SOURCE_DIR "/deploy/k8s/base/router-config.yaml"

static void test_k8s_config_loads(void **state)
{
    (void)state;
    char err[512] = "";
    struct tdm_router_config *cfg = NULL;
    int rc = tdm_router_config_load(&cfg, K8S_ROUTER_CONFIG, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("%s: %s", K8S_ROUTER_CONFIG, err);
    assert_non_null(cfg);

    bool seen[TDM_ROUTER_ROLE_COUNT] = {false};
    for (size_t i = 0; i < cfg->n_dns; i++) {
        const struct tdm_router_dns_endpoint *e = &cfg->dns_endpoints[i];
        assert_true(e->role == TDM_ROUTER_ROLE_PREFILL || e->role == TDM_ROUTER_ROLE_DECODE);
        assert_true(e->http_port > 0 && e->http_port < 65536);
        if (e->role == TDM_ROUTER_ROLE_PREFILL)
            assert_true(e->nng_port > 0 && e->nng_port < 65536);
        seen[e->role] = true;
    }
    assert_true(seen[TDM_ROUTER_ROLE_PREFILL]);
    assert_true(seen[TDM_ROUTER_ROLE_DECODE]);
    // Pods come and go: nothing listed statically, DNS re-resolved.
    assert_int_equal(cfg->n_static, 0);
    assert_true(cfg->dns_refresh_seconds > 0);
    assert_int_not_equal(cfg->pd_mode, TDM_ROUTER_PD_NEVER);
    assert_string_equal(cfg->health.path, "/health");
    tdm_router_config_unref(cfg);
}

static void test_corrupted_copy_rejected(void **state)
{
    (void)state;
    char err[512] = "";
    size_t len = 0;
    char *text = NULL;
    int rc = tdm_read_file(K8S_ROUTER_CONFIG, &text, &len, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("%s: %s", K8S_ROUTER_CONFIG, err);
    // An unknown key where the endpoints section starts.
    char *at = strstr(text, "\nendpoints:");
    assert_non_null(at);
    memcpy(at + 1, "endpointz", 9);
    struct tdm_router_config *cfg = NULL;
    rc = tdm_router_config_parse(&cfg, text, len, "corrupted", err, sizeof err);
    assert_int_equal(rc, TDM_EINVAL);
    assert_null(cfg);
    assert_non_null(strstr(err, "endpointz"));
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_k8s_config_loads),
        cmocka_unit_test(test_corrupted_copy_rejected),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
