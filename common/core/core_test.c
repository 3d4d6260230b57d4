// SPDX-License-Identifier: Apache-2.0
// Tests for core: error strings, file reading and path joining.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

static void test_strerror(void **state)
{
    (void)state;
    assert_string_equal(tdm_strerror(TDM_OK), "ok");
    assert_string_equal(tdm_strerror(TDM_ECAPACITY), "out of capacity");
    assert_string_equal(tdm_strerror(9999), "unknown error");
}

static void test_seterr(void **state)
{
    (void)state;
    char err[32];
    assert_int_equal(tdm_seterr(err, sizeof err, TDM_EINVAL, "x=%d", 3), TDM_EINVAL);
    assert_string_equal(err, "x=3");
    assert_int_equal(tdm_seterr(NULL, 0, TDM_EIO, "ignored"), TDM_EIO);
}

static void test_read_file(void **state)
{
    (void)state;
    char path[] = "/tmp/tdm_core_testXXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "hello\0world", 11), 11);
    close(fd);
    char *buf;
    size_t len;
    char err[256];
    assert_int_equal(tdm_read_file(path, &buf, &len, err, sizeof err), TDM_OK);
    assert_int_equal(len, 11);
    assert_memory_equal(buf, "hello\0world", 11);
    assert_int_equal(buf[11], 0);
    free(buf);
    unlink(path);
    assert_int_equal(tdm_read_file(path, &buf, &len, err, sizeof err), TDM_ENOTFOUND);
    assert_null(buf);
    assert_non_null(strstr(err, path));
}

static void test_path_join(void **state)
{
    (void)state;
    char *p = tdm_path_join("/a/b", "c.json");
    assert_string_equal(p, "/a/b/c.json");
    free(p);
    p = tdm_path_join("/a/b/", "c.json");
    assert_string_equal(p, "/a/b/c.json");
    free(p);
}

static void test_log_level(void **state)
{
    (void)state;
    assert_int_equal(tdm_log_set_level_name("debug"), TDM_OK);
    assert_int_equal(tdm_log_level, TDM_LOG_LEVEL_DEBUG);
    assert_int_equal(tdm_log_set_level_name("loud"), TDM_EINVAL);
    assert_int_equal(tdm_log_set_level_name("info"), TDM_OK);
}

// Expected values computed separately (a Python transcription of the published
// xoshiro256** and splitmix64 algorithms), seed 42.
static void test_rng(void **state)
{
    (void)state;
    struct tdm_rng r;
    tdm_rng_seed(&r, 42);
    assert_true(tdm_rng_next(&r) == 0x15780b2e0c2ec716ull);
    assert_true(tdm_rng_next(&r) == 0x6104d9866d113a7eull);
    assert_true(tdm_rng_next(&r) == 0xae17533239e499a1ull);
    for (int i = 0; i < 1000; i++) {
        double u = tdm_rng_uniform(&r);
        assert_true(u >= 0.0 && u < 1.0);
    }
}

// The nesting scan: arrays and objects count, brackets inside strings (escaped
// quotes included) do not, the limit is inclusive, and the error names it.
static int depth_ok(const char *s, int max)
{
    return tdm_json_check_depth(s, strlen(s), max, NULL, 0);
}

static void test_json_depth(void **state)
{
    (void)state;
    assert_int_equal(depth_ok("", 1), TDM_OK);
    assert_int_equal(depth_ok("{\"a\":[1,{\"b\":[]}]}", 4), TDM_OK);
    assert_int_equal(depth_ok("{\"a\":[1,{\"b\":[]}]}", 3), TDM_EINVAL);
    assert_int_equal(depth_ok("[[[]]]", 3), TDM_OK);
    assert_int_equal(depth_ok("[[[[]]]]", 3), TDM_EINVAL);
    // Siblings do not add up: depth is the deepest path, not the bracket count.
    assert_int_equal(depth_ok("[[],[],[],[[]]]", 3), TDM_OK);
    // Brackets in strings, an escaped quote and an escaped backslash before a quote.
    assert_int_equal(depth_ok("[\"[[[[\"]", 1), TDM_OK);
    assert_int_equal(depth_ok("[\"\\\"[[[[\"]", 1), TDM_OK);
    assert_int_equal(depth_ok("[\"\\\\\",[[]]]", 2), TDM_EINVAL);
    // Stray closers never go below zero, so they cannot buy extra depth.
    assert_int_equal(depth_ok("]]]][[", 1), TDM_EINVAL);
    char err[96];
    char deep[2001];
    memset(deep, '[', 2000);
    deep[2000] = '\0';
    assert_int_equal(tdm_json_check_depth(deep, 2000, TDM_JSON_MAX_DEPTH, err, sizeof err),
                     TDM_EINVAL);
    assert_string_equal(err, "JSON nests deeper than 128 levels (at byte 128)");
    // Only len bytes are read: a deep tail past len is not seen.
    assert_int_equal(tdm_json_check_depth(deep, 128, TDM_JSON_MAX_DEPTH, NULL, 0), TDM_OK);
}

// ---- timed waits on the monotonic clock ----
struct waker {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int flag;
};

static void *wake_later(void *arg)
{
    struct waker *w = arg;
    struct timespec d = {0, 30 * 1000 * 1000};
    nanosleep(&d, NULL);
    pthread_mutex_lock(&w->mu);
    w->flag = 1;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static void test_cond_wait(void **state)
{
    (void)state;
    struct waker w = {.flag = 0};
    pthread_mutex_init(&w.mu, NULL);
    assert_int_equal(tdm_cond_init(&w.cv), TDM_OK);
    pthread_mutex_lock(&w.mu);
    // Times out after about the asked time, on the monotonic clock.
    double t0 = tdm_now();
    assert_false(tdm_cond_wait_for(&w.cv, &w.mu, 0.05));
    double took = tdm_now() - t0;
    assert_true(took >= 0.049 && took < 1.0);
    // A deadline already passed (or zero time) returns at once.
    t0 = tdm_now();
    assert_false(tdm_cond_wait_until(&w.cv, &w.mu, tdm_now() - 1.0));
    assert_false(tdm_cond_wait_for(&w.cv, &w.mu, 0));
    assert_true(tdm_now() - t0 < 0.01);
    // A signal ends the wait well before its deadline.
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, wake_later, &w), 0);
    t0 = tdm_now();
    while (!w.flag && tdm_cond_wait_for(&w.cv, &w.mu, 10.0))
        ;
    assert_int_equal(w.flag, 1);
    assert_true(tdm_now() - t0 < 5.0);
    pthread_mutex_unlock(&w.mu);
    pthread_join(th, NULL);
    // No deadline: waits for the signal.
    w.flag = 0;
    pthread_mutex_lock(&w.mu);
    assert_int_equal(pthread_create(&th, NULL, wake_later, &w), 0);
    while (!w.flag)
        assert_true(tdm_cond_wait_until(&w.cv, &w.mu, -1));
    pthread_mutex_unlock(&w.mu);
    pthread_join(th, NULL);
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strerror),   cmocka_unit_test(test_seterr),
        cmocka_unit_test(test_read_file),  cmocka_unit_test(test_path_join),
        cmocka_unit_test(test_log_level),  cmocka_unit_test(test_rng),
        cmocka_unit_test(test_json_depth), cmocka_unit_test(test_cond_wait),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
