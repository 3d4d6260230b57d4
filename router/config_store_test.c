// SPDX-License-Identifier: Apache-2.0
// Tests of config hot reload: an explicit reload (what SIGHUP calls), the
// inotify watcher seeing an atomic rename and a Kubernetes ConfigMap style
// symlink swap, an invalid file keeping the old config (failure counted, the
// error shown in the JSON), identical bytes not counted, and a reader's
// reference surviving the swap.
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "config.h"
#include "core.h"
#include "router_metrics.h"

struct tmpdir {
    char path[256];
};

static void mk_tmpdir(struct tmpdir *t)
{
    snprintf(t->path, sizeof t->path, "%s/router-cfg-XXXXXX", TANDEM_BINARY_DIR);
    assert_non_null(mkdtemp(t->path));
}

static void rm_rf(const char *path)
{
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    assert_int_equal(system(cmd), 0);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(text, 1, strlen(text), f), strlen(text));
    assert_int_equal(fclose(f), 0);
}

// Writes dir/.name.tmp then renames it over dir/name (how editors and tools
// replace a file atomically).
static void replace_file(const char *dir, const char *name, const char *text)
{
    char tmp[512], dst[512];
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp", dir, name);
    snprintf(dst, sizeof dst, "%s/%s", dir, name);
    write_file(tmp, text);
    assert_int_equal(rename(tmp, dst), 0);
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

// The active config's short policy ("" for the plugin form).
static bool policy_is(struct tdm_router_config_store *st, const char *want)
{
    struct tdm_router_config *c = tdm_router_config_store_get(st, NULL);
    bool eq = c->short_policy && !strcmp(c->short_policy, want);
    tdm_router_config_unref(c);
    return eq;
}

static bool wait_policy(struct tdm_router_config_store *st, const char *want, int ms)
{
    for (int waited = 0; waited <= ms; waited += 20) {
        if (policy_is(st, want))
            return true;
        sleep_ms(20);
    }
    return false;
}

struct reload_seen {
    atomic_int calls;
    char old_policy[32], new_policy[32];
};

static void on_reload(const struct tdm_router_config *n, const struct tdm_router_config *o,
                      void *arg)
{
    struct reload_seen *s = arg;
    snprintf(s->old_policy, sizeof s->old_policy, "%s", o->short_policy ? o->short_policy : "");
    snprintf(s->new_policy, sizeof s->new_policy, "%s", n->short_policy ? n->short_policy : "");
    atomic_fetch_add(&s->calls, 1);
}

static void test_explicit_reload(void **state)
{
    (void)state;
    struct tmpdir t;
    mk_tmpdir(&t);
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/router.yaml", t.path);
    write_file(path, "policy: round_robin\n");

    struct tdm_metrics_registry *mreg = NULL;
    struct tdm_router_metrics m;
    assert_int_equal(tdm_metrics_registry_new(&mreg, NULL, 0, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_router_metrics_register(&m, mreg, err, sizeof err), TDM_OK);
    struct tdm_router_config_store *st = NULL;
    assert_int_equal(tdm_router_config_store_new(&st, path, &m, err, sizeof err), TDM_OK);
    struct reload_seen seen = {0};
    tdm_router_config_store_on_reload(st, on_reload, &seen);
    double t0 = 0;
    struct tdm_router_config *held = tdm_router_config_store_get(st, &t0);
    assert_true(t0 > 1e9);
    assert_true(tdm_metrics_gauge_value(m.config_last_success) == t0);

    // Valid change.
    write_file(path, "policy: least_loaded\n");
    assert_int_equal(tdm_router_config_store_reload(st, err, sizeof err), TDM_OK);
    assert_true(policy_is(st, "least_loaded"));
    assert_int_equal(atomic_load(&seen.calls), 1);
    assert_string_equal(seen.old_policy, "round_robin");
    assert_string_equal(seen.new_policy, "least_loaded");
    // The reader's snapshot is untouched.
    assert_string_equal(held->short_policy, "round_robin");
    tdm_router_config_unref(held);

    // Same bytes: nothing happens, nothing counted.
    assert_int_equal(tdm_router_config_store_reload(st, err, sizeof err), TDM_OK);
    uint64_t ok = 0, bad = 0;
    tdm_router_config_store_counts(st, &ok, &bad);
    assert_int_equal(ok, 1);
    assert_int_equal(bad, 0);
    assert_int_equal(atomic_load(&seen.calls), 1);

    // Invalid: old kept, failure counted, error named.
    write_file(path, "policy: least_loaded\nhealth: {failure_threshold: zero}\n");
    assert_int_equal(tdm_router_config_store_reload(st, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "health.failure_threshold: expected an integer"));
    assert_non_null(strstr(err, "router.yaml"));
    assert_true(policy_is(st, "least_loaded"));
    // Missing file: also a failure, old kept.
    assert_int_equal(unlink(path), 0);
    assert_int_equal(tdm_router_config_store_reload(st, err, sizeof err), TDM_ENOTFOUND);
    assert_true(policy_is(st, "least_loaded"));
    tdm_router_config_store_counts(st, &ok, &bad);
    assert_int_equal(ok, 1);
    assert_int_equal(bad, 2);
    assert_true(tdm_metrics_counter_value(m.config_reload_success) == 1.0);
    assert_true(tdm_metrics_counter_value(m.config_reload_failure) == 2.0);

    // JSON: the active config, counts and the last error.
    char *json = tdm_router_config_store_json(st);
    assert_non_null(json);
    cJSON *o = cJSON_Parse(json);
    assert_non_null(o);
    assert_string_equal(cJSON_GetObjectItem(o, "policy")->valuestring, "least_loaded");
    cJSON *r = cJSON_GetObjectItem(o, "reloads");
    assert_int_equal(cJSON_GetObjectItem(r, "success")->valueint, 1);
    assert_int_equal(cJSON_GetObjectItem(r, "failure")->valueint, 2);
    assert_true(cJSON_IsString(cJSON_GetObjectItem(o, "last_error")));
    assert_true(cJSON_IsString(cJSON_GetObjectItem(o, "loaded_at")));
    assert_string_equal(cJSON_GetObjectItem(o, "source")->valuestring, path);
    cJSON_Delete(o);
    free(json);

    // Restoring the active config's exact bytes after a rejected edit clears
    // last_error too (issue 14), without counting a reload.
    write_file(path, "policy: nonsense\n");
    assert_int_not_equal(tdm_router_config_store_reload(st, NULL, 0), TDM_OK);
    struct tdm_router_config *act = tdm_router_config_store_get(st, NULL);
    write_file(path, act->text_);
    tdm_router_config_unref(act);
    assert_int_equal(tdm_router_config_store_reload(st, NULL, 0), TDM_OK);
    json = tdm_router_config_store_json(st);
    o = cJSON_Parse(json);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(o, "last_error")));
    assert_int_equal(cJSON_GetObjectItem(cJSON_GetObjectItem(o, "reloads"), "success")->valueint, 1);
    cJSON_Delete(o);
    free(json);

    // A good file again clears last_error.
    write_file(path, "policy: random\n");
    assert_int_equal(tdm_router_config_store_reload(st, NULL, 0), TDM_OK);
    json = tdm_router_config_store_json(st);
    o = cJSON_Parse(json);
    assert_true(cJSON_IsNull(cJSON_GetObjectItem(o, "last_error")));
    cJSON_Delete(o);
    free(json);

    tdm_router_config_store_free(st);
    tdm_metrics_registry_free(mreg);
    rm_rf(t.path);
}

static void test_first_load_must_be_valid(void **state)
{
    (void)state;
    struct tmpdir t;
    mk_tmpdir(&t);
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/router.yaml", t.path);
    write_file(path, "policy: nope\n");
    struct tdm_router_config_store *st = NULL;
    assert_int_equal(tdm_router_config_store_new(&st, path, NULL, err, sizeof err), TDM_EINVAL);
    assert_null(st);
    assert_non_null(strstr(err, "policy: unknown policy 'nope'"));
    snprintf(path, sizeof path, "%s/absent.yaml", t.path);
    assert_int_equal(tdm_router_config_store_new(&st, path, NULL, err, sizeof err), TDM_ENOTFOUND);
    tdm_router_config_store_free(NULL);
    rm_rf(t.path);
}

static void test_watch_rename(void **state)
{
    (void)state;
    struct tmpdir t;
    mk_tmpdir(&t);
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/router.yaml", t.path);
    write_file(path, "policy: round_robin\n");
    struct tdm_router_config_store *st = NULL;
    assert_int_equal(tdm_router_config_store_new(&st, path, NULL, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_router_config_store_watch(st, 30, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_router_config_store_watch(st, 30, err, sizeof err), TDM_OK); // idempotent

    replace_file(t.path, "router.yaml", "policy: random\n");
    assert_true(wait_policy(st, "random", 3000));
    // An unrelated file in the directory changes nothing.
    char other[512];
    snprintf(other, sizeof other, "%s/notes.txt", t.path);
    write_file(other, "hello");
    sleep_ms(150);
    uint64_t ok = 0, bad = 0;
    tdm_router_config_store_counts(st, &ok, &bad);
    assert_int_equal(ok, 1);
    assert_int_equal(bad, 0);
    // An invalid replacement: kept, counted once.
    replace_file(t.path, "router.yaml", "policy: [random\n");
    for (int i = 0; i < 150 && bad == 0; i++) {
        sleep_ms(20);
        tdm_router_config_store_counts(st, &ok, &bad);
    }
    assert_int_equal(bad, 1);
    assert_true(policy_is(st, "random"));
    // In-place write (no rename) is seen too.
    write_file(path, "policy: least_loaded\n");
    assert_true(wait_policy(st, "least_loaded", 3000));
    tdm_router_config_store_free(st);
    rm_rf(t.path);
}

// Kubernetes mounts a ConfigMap as:
//   dir/config.yaml -> ..data/config.yaml
//   dir/..data -> ..2026_01_01_00_00_00.1
//   dir/..2026_01_01_00_00_00.1/config.yaml
// and updates it by writing a new timestamped folder, pointing ..data_tmp at it
// and renaming ..data_tmp over ..data.
static void configmap_update(const char *dir, const char *stamp, const char *text)
{
    char sub[512], file[600], tmp_link[512], data[512];
    snprintf(sub, sizeof sub, "%s/%s", dir, stamp);
    assert_int_equal(mkdir(sub, 0755), 0);
    snprintf(file, sizeof file, "%s/config.yaml", sub);
    write_file(file, text);
    snprintf(tmp_link, sizeof tmp_link, "%s/..data_tmp", dir);
    snprintf(data, sizeof data, "%s/..data", dir);
    assert_int_equal(symlink(stamp, tmp_link), 0);
    assert_int_equal(rename(tmp_link, data), 0);
}

static void test_watch_configmap_symlink_swap(void **state)
{
    (void)state;
    struct tmpdir t;
    mk_tmpdir(&t);
    configmap_update(t.path, "..2026_01_01_00_00_00.1", "policy: round_robin\n");
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/config.yaml", t.path);
    assert_int_equal(symlink("..data/config.yaml", path), 0);
    struct tdm_router_config_store *st = NULL;
    assert_int_equal(tdm_router_config_store_new(&st, path, NULL, err, sizeof err), TDM_OK);
    assert_true(policy_is(st, "round_robin"));
    assert_int_equal(tdm_router_config_store_watch(st, 30, err, sizeof err), TDM_OK);
    configmap_update(t.path, "..2026_01_01_00_01_00.2", "policy: prefix_cache\n");
    assert_true(wait_policy(st, "prefix_cache", 3000));
    // A broken update keeps the old one.
    configmap_update(t.path, "..2026_01_01_00_02_00.3", "policy: prefix_cache\nbogus: 1\n");
    uint64_t ok = 0, bad = 0;
    for (int i = 0; i < 150 && bad == 0; i++) {
        sleep_ms(20);
        tdm_router_config_store_counts(st, &ok, &bad);
    }
    assert_int_equal(bad, 1);
    assert_true(policy_is(st, "prefix_cache"));
    configmap_update(t.path, "..2026_01_01_00_03_00.4", "policy: session_affinity\n");
    assert_true(wait_policy(st, "session_affinity", 3000));
    tdm_router_config_store_free(st);
    rm_rf(t.path);
}

// Readers take references while a writer reloads in a loop: every reader sees
// a whole config, and every reference is released (ASan checks the frees).
static void test_concurrent_readers(void **state)
{
    (void)state;
    struct tmpdir t;
    mk_tmpdir(&t);
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/router.yaml", t.path);
    write_file(path, "policy: round_robin\n");
    struct tdm_router_config_store *st = NULL;
    assert_int_equal(tdm_router_config_store_new(&st, path, NULL, err, sizeof err), TDM_OK);
    struct tdm_router_config *held[64];
    for (int i = 0; i < 64; i++) {
        held[i] = tdm_router_config_store_get(st, NULL);
        write_file(path, i % 2 ? "policy: round_robin\n" : "policy: random\n");
        assert_int_equal(tdm_router_config_store_reload(st, NULL, 0), TDM_OK);
    }
    for (int i = 0; i < 64; i++) {
        assert_string_equal(held[i]->short_policy, i % 2 ? "random" : "round_robin");
        tdm_router_config_unref(held[i]);
    }
    tdm_router_config_store_free(st);
    rm_rf(t.path);
}

int main(void)
{
    tdm_log_level = TDM_LOG_LEVEL_ERR;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_explicit_reload),
        cmocka_unit_test(test_first_load_must_be_valid),
        cmocka_unit_test(test_watch_rename),
        cmocka_unit_test(test_watch_configmap_symlink_swap),
        cmocka_unit_test(test_concurrent_readers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
