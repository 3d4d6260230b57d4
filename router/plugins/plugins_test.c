// SPDX-License-Identifier: Apache-2.0
// Tests of the plugin tables, walked generically so that every table entry is
// covered: for each plugin type an unknown key is refused naming its path,
// every number out of its range (and every fixed value) is refused, defaults
// come from the table, and the /v1/router/config view of a plugin's
// parameters parses back into the same parameters. Plus the parameters whose
// action lives outside the policy loop (hashBlockSize, maxNumOfEndpoints).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "config.h"
#include "core.h"
#include "plugins.h"

// A config holding a plugin of type t with the given parameters (JSON flow
// text, or NULL for none), referenced by a profile when its kind allows.
static void config_text(enum tdm_router_plugin_type t, const char *params, char *out, size_t cap)
{
    const char *name = tdm_router_plugin_type_name(t);
    char plugin[1024];
    if (params)
        snprintf(plugin, sizeof plugin, "- {type: %s, parameters: %s}\n", name, params);
    else
        snprintf(plugin, sizeof plugin, "- {type: %s}\n", name);
    switch (tdm_router_plugin_type_kind(t)) {
    case TDM_ROUTER_PLUGIN_FILTER:
    case TDM_ROUTER_PLUGIN_SCORER:
    case TDM_ROUTER_PLUGIN_PICKER:
        snprintf(out, cap,
                 "plugins:\n%sschedulingProfiles:\n- {name: a, plugins: [{pluginRef: %s}]}\n",
                 plugin, name);
        break;
    case TDM_ROUTER_PLUGIN_PROFILE_HANDLER:
        snprintf(out, cap,
                 "plugins:\n%s- {name: dec, type: always-disagg-pd-decider}\n"
                 "schedulingProfiles:\n- {name: decode, plugins: []}\n"
                 "%s",
                 plugin,
                 t == TDM_ROUTER_DISAGG_PROFILE_HANDLER
                     ? "- {name: prefill, plugins: []}\n- {name: dd, plugins: []}\n"
                       "- {name: pp, plugins: []}\n"
                     : "");
        break;
    default: // deciders, producers: top level, not in a profile
        snprintf(out, cap,
                 "plugins:\n%s- {type: queue-scorer}\n"
                 "schedulingProfiles:\n- {name: a, plugins: [{pluginRef: queue-scorer}]}\n",
                 plugin);
        break;
    }
}

static int parse(enum tdm_router_plugin_type t, const char *params, struct tdm_router_config **c,
                 char *err, size_t errlen)
{
    char text[2048];
    config_text(t, params, text, sizeof text);
    *c = NULL;
    return tdm_router_config_parse(c, text, strlen(text), NULL, err, errlen);
}

static struct tdm_router_config *parse_ok(enum tdm_router_plugin_type t, const char *params)
{
    char err[512] = "";
    struct tdm_router_config *c = NULL;
    if (parse(t, params, &c, err, sizeof err))
        fail_msg("%s %s: %s", tdm_router_plugin_type_name(t), params ? params : "-", err);
    return c;
}

static void expect_err(enum tdm_router_plugin_type t, const char *params, const char *want)
{
    char err[512] = "";
    struct tdm_router_config *c = NULL;
    int rc = parse(t, params, &c, err, sizeof err);
    if (rc == TDM_OK) {
        tdm_router_config_unref(c);
        fail_msg("%s %s: parsed, expected '%s'", tdm_router_plugin_type_name(t), params, want);
    }
    assert_int_equal(rc, TDM_EINVAL);
    if (!strstr(err, want))
        fail_msg("%s %s: error '%s' lacks '%s'", tdm_router_plugin_type_name(t), params, err, want);
}

// {"a": v} or {"a": {"b": v}} for key "a.b", with v already JSON.
static void params_one(const char *key, const char *value, char *out, size_t cap)
{
    const char *dot = strchr(key, '.');
    if (dot)
        snprintf(out, cap, "{\"%.*s\": {\"%s\": %s}}", (int)(dot - key), key, dot + 1, value);
    else
        snprintf(out, cap, "{\"%s\": %s}", key, value);
}

static void test_unknown_key(void **state)
{
    (void)state;
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++) {
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(t);
        assert_non_null(ops);
        if (ops->n_params == 0) {
            expect_err(t, "{noSuchKey: 1}", "takes no parameters");
            continue;
        }
        expect_err(t, "{noSuchKey: 1}", "plugins[0].parameters.noSuchKey: unknown key");
        for (size_t i = 0; i < ops->n_params; i++) {
            const char *dot = strchr(ops->params[i].key, '.');
            if (!dot)
                continue;
            char p[256], k[128];
            snprintf(k, sizeof k, "%.*s.noSuchKey", (int)(dot - ops->params[i].key),
                     ops->params[i].key);
            params_one(k, "1", p, sizeof p);
            char want[160];
            snprintf(want, sizeof want, "parameters.%s: unknown key", k);
            expect_err(t, p, want);
        }
    }
}

static void test_out_of_range(void **state)
{
    (void)state;
    size_t checked = 0;
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++) {
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(t);
        for (size_t i = 0; i < ops->n_params; i++) {
            const struct tdm_router_param *d = &ops->params[i];
            char p[256], v[64], want[512];
            switch (d->type) {
            case TDM_ROUTER_PARAM_INT:
            case TDM_ROUTER_PARAM_DOUBLE: {
                const char *fmt = d->type == TDM_ROUTER_PARAM_INT ? "%.0f" : "%g";
                for (int side = 0; side < 2; side++) {
                    snprintf(v, sizeof v, fmt, side ? d->min - 1 : d->max + 1);
                    params_one(d->key, v, p, sizeof p);
                    if (d->range_note)
                        snprintf(want, sizeof want, "parameters.%s: %s", d->key, d->range_note);
                    else
                        snprintf(want, sizeof want, "parameters.%s: %s is out of range", d->key, v);
                    expect_err(t, p, want);
                }
                params_one(d->key, "\"many\"", p, sizeof p);
                expect_err(t, p, "expected a");
                checked++;
                break;
            }
            case TDM_ROUTER_PARAM_BOOL:
                params_one(d->key, d->max < 1 ? "true" : "false", p, sizeof p);
                snprintf(want, sizeof want, "parameters.%s: %s", d->key,
                         d->range_note ? d->range_note : "");
                if (d->max < 1 || d->min > 0)
                    expect_err(t, p, want);
                checked++;
                break;
            case TDM_ROUTER_PARAM_STRING:
                params_one(d->key, "\"\"", p, sizeof p);
                expect_err(t, p, "must not be empty");
                checked++;
                break;
            }
        }
    }
    assert_true(checked >= 15);
}

static void test_defaults(void **state)
{
    (void)state;
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++) {
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(t);
        if (t == TDM_ROUTER_SINGLE_PROFILE_HANDLER)
            continue; // one profile only: covered by the other kinds' configs
        struct tdm_router_config *c = parse_ok(t, NULL);
        size_t pi = tdm_router_config_find_plugin(c, ops->name);
        assert_true(pi != SIZE_MAX);
        const struct tdm_router_plugin_params *p = &c->plugins[pi].params;
        for (size_t i = 0; i < ops->n_params; i++) {
            const struct tdm_router_param *d = &ops->params[i];
            if (d->offset == TDM_ROUTER_PARAM_NO_FIELD || (d->flags & TDM_ROUTER_PARAM_HIDDEN))
                continue;
            const char *f = (const char *)p + d->offset;
            if (d->type == TDM_ROUTER_PARAM_INT)
                assert_int_equal(*(const int *)(const void *)f, (int)d->def);
            else if (d->type == TDM_ROUTER_PARAM_DOUBLE)
                assert_true(*(const double *)(const void *)f == d->def);
            else if (d->type == TDM_ROUTER_PARAM_STRING)
                assert_null(*(char *const *)(const void *)f); // the view shows def_str
        }
        tdm_router_config_unref(c);
    }
    // The utilization detector's defaults act: waiting 6 > 5 is saturated.
    struct tdm_router_plugin_params par;
    tdm_router_plugin_params_init(&par, TDM_ROUTER_UTILIZATION_DETECTOR);
    struct tdm_router_endpoint_view v = {.has_load = true, .load = {.waiting = 6}};
    assert_true(tdm_router_policy_saturated(&par, &v));
    v.load.waiting = 5;
    assert_false(tdm_router_policy_saturated(&par, &v));
}

// A valid non-default JSON value for a shown parameter.
static void sample_value(const struct tdm_router_param *d, char *v, size_t cap)
{
    if (d->type == TDM_ROUTER_PARAM_STRING) {
        const char *s = !strcmp(d->key, "profiles.decode")    ? "dd"
                        : !strcmp(d->key, "profiles.prefill") ? "pp"
                        : !strcmp(d->key, "deciders.prefill") ? "dec"
                                                              : "x-my-session";
        snprintf(v, cap, "\"%s\"", s);
    } else if (d->type == TDM_ROUTER_PARAM_INT) {
        snprintf(v, cap, "%.0f", d->min != d->def ? d->min : d->max);
    } else {
        snprintf(v, cap, "%g", d->def != (d->min + d->max) / 2 ? (d->min + d->max) / 2 : d->max);
    }
}

static cJSON *view_params(const struct tdm_router_config *c, const char *name)
{
    char *s = tdm_router_config_to_json(c, 0);
    assert_non_null(s);
    cJSON *o = cJSON_Parse(s);
    free(s);
    cJSON *pl;
    cJSON *found = NULL;
    cJSON_ArrayForEach(pl, cJSON_GetObjectItem(o, "plugins"))
    {
        if (!strcmp(cJSON_GetObjectItem(pl, "name")->valuestring, name))
            found = cJSON_DetachItemFromObject(pl, "parameters");
    }
    cJSON_Delete(o);
    assert_non_null(found);
    return found;
}

static void test_view_round_trip(void **state)
{
    (void)state;
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++) {
        const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(t);
        if (t == TDM_ROUTER_SINGLE_PROFILE_HANDLER)
            continue;
        // Every shown key set to a non-default value.
        cJSON *given = cJSON_CreateObject();
        for (size_t i = 0; i < ops->n_params; i++) {
            const struct tdm_router_param *d = &ops->params[i];
            if ((d->flags & TDM_ROUTER_PARAM_HIDDEN) || d->offset == TDM_ROUTER_PARAM_NO_FIELD)
                continue;
            char v[64];
            sample_value(d, v, sizeof v);
            cJSON *dst = given;
            const char *key = d->key, *dot = strchr(key, '.');
            if (dot) {
                char head[64];
                snprintf(head, sizeof head, "%.*s", (int)(dot - key), key);
                if (!(dst = cJSON_GetObjectItem(given, head)))
                    dst = cJSON_AddObjectToObject(given, head);
                key = dot + 1;
            }
            cJSON_AddItemToObject(dst, key, cJSON_Parse(v));
        }
        char *text = cJSON_PrintUnformatted(given);
        struct tdm_router_config *c = parse_ok(t, text);
        cJSON *view = view_params(c, ops->name);
        if (!cJSON_Compare(view, given, true)) {
            char *vs = cJSON_PrintUnformatted(view);
            fail_msg("%s: gave %s, view shows %s", ops->name, text, vs);
        }
        // The view parses back into the same view.
        char *vtext = cJSON_PrintUnformatted(view);
        struct tdm_router_config *c2 = parse_ok(t, vtext);
        cJSON *view2 = view_params(c2, ops->name);
        assert_true(cJSON_Compare(view, view2, true));
        cJSON_Delete(view2);
        cJSON_Delete(view);
        cJSON_Delete(given);
        free(vtext);
        free(text);
        tdm_router_config_unref(c2);
        tdm_router_config_unref(c);
    }
}

// Parameters that act outside the policy loop.
static void test_parameters_act(void **state)
{
    (void)state;
    // hashBlockSize (deprecated handler spelling) sets the prefix index block size.
    struct tdm_router_config *c =
        parse_ok(TDM_ROUTER_DISAGG_PROFILE_HANDLER, "{hashBlockSize: 32, threshold: 100}");
    assert_int_equal(c->block_size_tokens, 32);
    assert_int_equal(c->pd_mode, TDM_ROUTER_PD_PREFIX);
    assert_int_equal(c->pd_threshold_tokens, 100);
    tdm_router_config_unref(c);
    // A producer's blockSizeTokens wins over hashBlockSize.
    const char *both =
        "plugins:\n- {type: disagg-profile-handler, parameters: {hashBlockSize: 32}}\n"
        "- {type: approx-prefix-cache-producer, parameters: {blockSizeTokens: 64}}\n"
        "schedulingProfiles:\n- {name: decode, plugins: []}\n"
        "- {name: prefill, plugins: []}\n";
    char err[512] = "";
    assert_int_equal(tdm_router_config_parse(&c, both, strlen(both), NULL, err, sizeof err), 0);
    assert_int_equal(c->block_size_tokens, 64);
    tdm_router_config_unref(c);
    // maxNumOfEndpoints: the router's behaviour (1) is accepted, anything else refused.
    c = parse_ok(TDM_ROUTER_MAX_SCORE_PICKER, "{maxNumOfEndpoints: 1}");
    tdm_router_config_unref(c);
    expect_err(TDM_ROUTER_RANDOM_PICKER, "{maxNumOfEndpoints: 3}", "only 1 is supported");
    // headerName is lower-cased and becomes the session header.
    c = parse_ok(TDM_ROUTER_SESSION_AFFINITY_SCORER, "{headerName: X-User}");
    assert_string_equal(c->session_header, "x-user");
    tdm_router_config_unref(c);
    // Every type has a name that looks itself up, and the deprecated alias works.
    for (int t = 0; t < TDM_ROUTER_PLUGIN_TYPE_COUNT; t++)
        assert_int_equal(tdm_router_plugin_lookup(tdm_router_plugin_type_name(t)), t);
    assert_int_equal(tdm_router_plugin_lookup("pd-profile-handler"),
                     TDM_ROUTER_DISAGG_PROFILE_HANDLER);
    assert_int_equal(tdm_router_plugin_lookup("fastest-scorer"), -1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unknown_key),    cmocka_unit_test(test_out_of_range),
        cmocka_unit_test(test_defaults),       cmocka_unit_test(test_view_round_trip),
        cmocka_unit_test(test_parameters_act),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
