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
    // \u0000 inside a string, not an escaped backslash followed by "u0000".
    assert_true(tdm_json_has_nul_escape("{\"p\":\"a\\u0000b\"}", 15));
    assert_false(tdm_json_has_nul_escape("{\"p\":\"a\\\\u0000b\"}", 16));
    assert_false(tdm_json_has_nul_escape("{\"p\":\"a\\u0001b\"}", 15));
    assert_false(tdm_json_has_nul_escape("{\"p\":1} \\u0000", 14));
    // Only len bytes are read: a deep tail past len is not seen.
    assert_int_equal(tdm_json_check_depth(deep, 128, TDM_JSON_MAX_DEPTH, NULL, 0), TDM_OK);
}

static void test_finish_name(void **state)
{
    (void)state;
    assert_null(tdm_finish_name(TDM_FINISH_NONE));
    assert_string_equal(tdm_finish_name(TDM_FINISH_STOP), "stop");
    assert_string_equal(tdm_finish_name(TDM_FINISH_LENGTH), "length");
    assert_string_equal(tdm_finish_name(TDM_FINISH_ABORT), "abort");
    assert_string_equal(tdm_finish_name(TDM_FINISH_ERROR), "error");
    assert_null(tdm_finish_name(TDM_FINISH_COUNT));
    assert_null(tdm_finish_name((enum tdm_finish)-1));
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

// A detached thread runs its function; nobody joins it. The waker is static:
// the thread may still be leaving pthread_mutex_unlock when the test goes on.
static void test_thread_start_detached(void **state)
{
    (void)state;
    static struct waker w = {.mu = PTHREAD_MUTEX_INITIALIZER, .flag = 0};
    assert_int_equal(tdm_cond_init(&w.cv), TDM_OK);
    pthread_mutex_lock(&w.mu);
    assert_int_equal(tdm_thread_start_detached(wake_later, &w), TDM_OK);
    while (!w.flag)
        assert_true(tdm_cond_wait_for(&w.cv, &w.mu, 10.0));
    pthread_mutex_unlock(&w.mu);
}

// A thread whose work ended takes the next piece (no new thread), and
// pieces started together all run at once: none waits behind a busy thread
// (each here waits until all have started).
struct meet {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived, want;
};

static void *note_self(void *arg)
{
    struct meet *m = arg;
    pthread_mutex_lock(&m->mu);
    m->arrived++;
    pthread_cond_broadcast(&m->cv);
    while (m->arrived < m->want)
        if (!tdm_cond_wait_for(&m->cv, &m->mu, 10.0))
            break;
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

static void wait_arrived(struct meet *m, int n)
{
    pthread_mutex_lock(&m->mu);
    while (m->arrived < n)
        assert_true(tdm_cond_wait_for(&m->cv, &m->mu, 10.0));
    pthread_mutex_unlock(&m->mu);
}

static void wait_idle(int n)
{
    double end = tdm_now() + 10;
    while (tdm_thread_idle() < n && tdm_now() < end) {
        struct timespec d = {0, 1000 * 1000};
        nanosleep(&d, NULL);
    }
    assert_true(tdm_thread_idle() >= n);
}

static void test_thread_reuse(void **state)
{
    (void)state;
    static struct meet a = {.mu = PTHREAD_MUTEX_INITIALIZER, .want = 1};
    static struct meet b = {.mu = PTHREAD_MUTEX_INITIALIZER, .want = 1};
    assert_int_equal(tdm_cond_init(&a.cv), TDM_OK);
    assert_int_equal(tdm_cond_init(&b.cv), TDM_OK);
    assert_int_equal(tdm_thread_start_detached(note_self, &a), TDM_OK);
    wait_arrived(&a, 1);
    wait_idle(1); // a's thread waits for more work
    int idle = tdm_thread_idle();
    assert_int_equal(tdm_thread_start_detached(note_self, &b), TDM_OK);
    wait_arrived(&b, 1);
    wait_idle(idle);
    struct timespec settle = {0, 20 * 1000 * 1000};
    nanosleep(&settle, NULL);
    assert_int_equal(tdm_thread_idle(), idle); // a new thread would have made one more
    static struct meet all = {.mu = PTHREAD_MUTEX_INITIALIZER, .want = 8};
    assert_int_equal(tdm_cond_init(&all.cv), TDM_OK);
    for (int i = 0; i < 8; i++)
        assert_int_equal(tdm_thread_start_detached(note_self, &all), TDM_OK);
    wait_arrived(&all, 8);
    wait_idle(8);
}

// ---- flags ----
struct opts {
    char name[8];
    const char *path;
    int n;
    double rate;
    float temp;
    size_t bytes;
    bool on, watch;
    int fn_calls;
    const char *fn_value;
};

static int set_mode(void *o, const char *v, char *err, size_t errlen)
{
    struct opts *op = o;
    if (strcmp(v, "fast") != 0 && strcmp(v, "slow") != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--mode: expected fast or slow, got \"%s\"", v);
    op->fn_calls++;
    op->fn_value = v;
    return TDM_OK;
}

static int check_path(const char *v, char *err, size_t errlen)
{
    return strstr(v, "..") ? tdm_seterr(err, errlen, TDM_EINVAL, "--path: no \"..\" in \"%s\"", v)
                           : TDM_OK;
}

static const struct tdm_flag opt_flags[] = {
    {.name = "name",
     .kind = TDM_FLAG_STR,
     .offset = offsetof(struct opts, name),
     .size = sizeof((struct opts *)0)->name,
     .metavar = "NAME",
     .help = "a name"},
    {.name = "path",
     .kind = TDM_FLAG_PTR,
     .offset = offsetof(struct opts, path),
     .metavar = "DIR",
     .help = "a folder\nsecond line",
     .empty_ok = true,
     .check = check_path},
    {.name = "num-things",
     .kind = TDM_FLAG_INT,
     .offset = offsetof(struct opts, n),
     .min = 0,
     .max = 100,
     .metavar = "N",
     .help = "how many"},
    {.name = "rate",
     .kind = TDM_FLAG_DOUBLE,
     .offset = offsetof(struct opts, rate),
     .min = 0.5,
     .max = 2,
     .metavar = "R"},
    {.name = "temp",
     .kind = TDM_FLAG_FLOAT,
     .offset = offsetof(struct opts, temp),
     .min = 0,
     .max = 2,
     .metavar = "T"},
    {.name = "mem",
     .kind = TDM_FLAG_BYTES,
     .offset = offsetof(struct opts, bytes),
     .min = 1024,
     .max = 1e12,
     .metavar = "BYTES"},
    {.name = "on", .kind = TDM_FLAG_BOOL, .offset = offsetof(struct opts, on), .help = "on"},
    {.name = "no-watch", .kind = TDM_FLAG_NOT, .offset = offsetof(struct opts, watch)},
    {.name = "mode", .kind = TDM_FLAG_FN, .fn = set_mode, .metavar = "fast|slow"},
    {.name = "speed", .kind = TDM_FLAG_FN, .fn = set_mode, .hidden = true},
};
static const struct tdm_flags opt_table = {"usage: prog [options] [FILE]\n", opt_flags,
                                           sizeof opt_flags / sizeof opt_flags[0], "footer\n"};

static int parse_opts(struct opts *o, char **rest, int *n_rest, char *err, size_t errlen, int argc,
                      ...)
{
    char *argv[32] = {"prog"};
    va_list ap;
    va_start(ap, argc);
    for (int i = 1; i < argc; i++)
        argv[i] = va_arg(ap, char *);
    va_end(ap);
    memset(o, 0, sizeof *o);
    o->watch = true;
    return tdm_flags_parse(&opt_table, o, argc, argv, rest, 1, n_rest, err, errlen);
}

static void test_flags_parse(void **state)
{
    (void)state;
    struct opts o;
    char err[256];
    char *rest[1];
    int n_rest = -1;
    // Both value forms, '_' for '-', a boolean without a value, a bare argument.
    assert_int_equal(parse_opts(&o, rest, &n_rest, err, sizeof err, 13, "--name", "abc",
                                "--path=", "--num_things", "7", "--rate=1.5", "--temp", "0.25",
                                "--on", "file.txt", "--mem", "2KiB"),
                     TDM_OK);
    assert_string_equal(o.name, "abc");
    assert_string_equal(o.path, "");
    assert_int_equal(o.n, 7);
    assert_true(o.rate == 1.5);
    assert_true(o.temp == 0.25f);
    assert_true(o.on);
    assert_int_equal(o.bytes, 2048);
    assert_int_equal(n_rest, 1);
    assert_string_equal(rest[0], "file.txt");
    assert_true(o.watch);
    assert_int_equal(
        parse_opts(&o, NULL, NULL, err, sizeof err, 4, "--no-watch", "--on=false", "--mode=fast"),
        TDM_OK);
    assert_false(o.watch);
    assert_false(o.on);
    assert_int_equal(o.fn_calls, 1);
    assert_string_equal(o.fn_value, "fast");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--speed", "slow"), TDM_OK);
    assert_string_equal(o.fn_value, "slow");
    // --help anywhere, even after a bad flag.
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--bogus", "-h"), 1);
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--help"), 1);
    // One-line errors.
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--bogus=1"), TDM_EINVAL);
    assert_string_equal(err, "unknown option \"--bogus\"");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--name"), TDM_EINVAL);
    assert_string_equal(err, "--name: missing value");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--num-things", "101"),
                     TDM_EINVAL);
    assert_string_equal(err, "--num-things: expected an integer in [0, 100], got \"101\"");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--rate", "x"), TDM_EINVAL);
    assert_string_equal(err, "--rate: expected a number in [0.5, 2], got \"x\"");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--name", "toolongname"),
                     TDM_EINVAL);
    assert_string_equal(err, "--name: value longer than 7 bytes");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--name", ""), TDM_EINVAL);
    assert_string_equal(err, "--name: expected a non-empty value");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 3, "--mem", "1000"), TDM_EINVAL);
    assert_non_null(strstr(err, "--mem: expected a byte size"));
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--on=maybe"), TDM_EINVAL);
    assert_string_equal(err, "--on: expected true or false, got \"maybe\"");
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--mode=medium"), TDM_EINVAL);
    assert_string_equal(err, "--mode: expected fast or slow, got \"medium\"");
    // A check runs for a kept pointer too.
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "--path=../x"), TDM_EINVAL);
    assert_string_equal(err, "--path: no \"..\" in \"../x\"");
    assert_null(o.path);
    assert_int_equal(parse_opts(&o, NULL, NULL, err, sizeof err, 2, "stray"), TDM_EINVAL);
    assert_string_equal(err, "unexpected argument \"stray\"");
    assert_int_equal(parse_opts(&o, rest, &n_rest, err, sizeof err, 3, "a", "b"), TDM_EINVAL);
    assert_string_equal(err, "unexpected argument \"b\"");
    // By name, as a config file does.
    memset(&o, 0, sizeof o);
    assert_int_equal(tdm_flags_set(&opt_table, &o, "num_things", "3", err, sizeof err), TDM_OK);
    assert_int_equal(o.n, 3);
    assert_int_equal(tdm_flags_set(&opt_table, &o, "what", "3", err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "unknown option \"--what\"");
}

static void test_flags_take_and_help(void **state)
{
    (void)state;
    struct opts o;
    memset(&o, 0, sizeof o);
    char err[256];
    char *argv[] = {"prog", "--model", "m", "--num-things", "5", "--other=1", "--on", "x", NULL};
    int argc = 8;
    assert_int_equal(tdm_flags_take(&opt_table, &o, &argc, argv, err, sizeof err), TDM_OK);
    assert_int_equal(argc, 5);
    assert_string_equal(argv[1], "--model");
    assert_string_equal(argv[2], "m");
    assert_string_equal(argv[3], "--other=1");
    assert_string_equal(argv[4], "x");
    assert_null(argv[5]);
    assert_int_equal(o.n, 5);
    assert_true(o.on);
    // "=" form; a longer name that starts like a known one stays; a bad value stops.
    char *eq[] = {"prog", "--num-things=9", "--num-thingsx", "1", NULL};
    argc = 4;
    assert_int_equal(tdm_flags_take(&opt_table, &o, &argc, eq, err, sizeof err), TDM_OK);
    assert_int_equal(o.n, 9);
    assert_int_equal(argc, 3);
    assert_string_equal(eq[1], "--num-thingsx");
    char *none[] = {"prog", NULL};
    argc = 1;
    assert_int_equal(tdm_flags_take(&opt_table, &o, &argc, none, err, sizeof err), TDM_OK);
    assert_int_equal(argc, 1);
    assert_null(none[1]);
    char *badval[] = {"prog", "--rate=x", "--name", "n", NULL};
    argc = 4;
    assert_int_equal(tdm_flags_take(&opt_table, &o, &argc, badval, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--rate: expected a number in [0.5, 2], got \"x\"");
    char *bad[] = {"prog", "--num-things", NULL};
    argc = 2;
    assert_int_equal(tdm_flags_take(&opt_table, &o, &argc, bad, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--num-things: missing value");

    char buf[2048] = "";
    FILE *f = fmemopen(buf, sizeof buf, "w");
    assert_non_null(f);
    tdm_flags_help(&opt_table, f);
    fclose(f);
    assert_non_null(strstr(buf, "usage: prog [options] [FILE]\n"));
    assert_non_null(strstr(buf, "  --num-things N                how many\n"));
    assert_non_null(strstr(buf, "  --path DIR                    a folder\n"
                                "                                second line\n"));
    assert_non_null(strstr(buf, "  --on                          on\n"));
    assert_non_null(strstr(buf, "  --mode fast|slow\n"));
    assert_non_null(strstr(buf, "footer\n"));
    assert_null(strstr(buf, "--speed")); // hidden: another spelling of --mode

    size_t b;
    long long b_ll;
    assert_int_equal(tdm_parse_bytes("512MiB", &b), TDM_OK);
    assert_int_equal(b, (size_t)512 << 20);
    assert_int_equal(tdm_parse_bytes("1.5GB", &b), TDM_OK);
    assert_int_equal(b, 1500000000u);
    assert_int_equal(tdm_parse_bytes("1.5", &b), TDM_EINVAL);
    assert_int_equal(tdm_parse_bytes("GiB", &b), TDM_EINVAL);

    // vLLM's human_readable_int (--max-model-len 4k), value for value.
    static const struct {
        const char *text;
        long long want; // -1: refused
    } hints[] = {
        {"4096", 4096},    {"4k", 4000},    {"4K", 4096},       {"32K", 32768}, {"25.6k", 25600},
        {"1.5m", 1500000}, {"2M", 2097152}, {"1g", 1000000000}, {"0.001k", 1},  {"25.6K", -1},
        {"k", -1},         {"4kk", -1},     {"4.k", -1},        {"-4", -1},     {"4 k", -1},
        {"4t", -1},        {"", -1},        {"0x10", -1},
    };
    char why[160];
    for (size_t i = 0; i < sizeof hints / sizeof hints[0]; i++) {
        long long v = -7;
        int rc = tdm_parse_human_int(hints[i].text, &v, why, sizeof why);
        if (hints[i].want < 0 ? rc == TDM_OK : (rc != TDM_OK || v != hints[i].want))
            fail_msg("\"%s\": rc %d value %lld, want %lld", hints[i].text, rc, v, hints[i].want);
    }
    assert_int_equal(tdm_parse_human_int("25.6K", &b_ll, why, sizeof why), TDM_EINVAL);
    assert_string_equal(why, "decimals are not allowed with binary suffixes like K; did you mean "
                             "25.6k?");
}

// RFC 4231 test cases 2 (short key) and 6 (a key longer than the block).
static void hex_of(const unsigned char *d, char *hex)
{
    for (int i = 0; i < 32; i++)
        snprintf(hex + 2 * i, 3, "%02x", d[i]);
}

static void test_hmac_sha256(void **state)
{
    (void)state;
    unsigned char mac[32];
    char hex[65];
    const char *m2 = "what do ya want for nothing?";
    tdm_hmac_sha256("Jefe", 4, m2, strlen(m2), mac);
    hex_of(mac, hex);
    assert_string_equal(hex, "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
    unsigned char key[131];
    memset(key, 0xaa, sizeof key);
    const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
    tdm_hmac_sha256(key, sizeof key, m6, strlen(m6), mac);
    hex_of(mac, hex);
    assert_string_equal(hex, "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
    assert_true(tdm_ct_equal("abc", "abc", 3));
    assert_false(tdm_ct_equal("abc", "abd", 3));
}

// The growable text buffer: empty when zeroed, NUL-terminated, doubling, and
// failed for good once a size cannot be allocated.
static void test_strbuf(void **state)
{
    (void)state;
    struct tdm_strbuf b = {0};
    assert_null(b.p);
    assert_int_equal(tdm_strbuf_add(&b, "", 0), TDM_OK);
    assert_non_null(b.p);
    assert_string_equal(b.p, "");
    for (int i = 0; i < 1000; i++)
        assert_int_equal(tdm_strbuf_add(&b, "abc", 3), TDM_OK);
    assert_int_equal(b.len, 3000);
    assert_true(b.cap >= 3001 && b.cap < 2 * 3001 + 64);
    assert_int_equal(strlen(b.p), 3000);
    assert_memory_equal(b.p + 2997, "abc", 4);
    tdm_strbuf_fini(&b);
    assert_null(b.p);
    assert_int_equal(b.len, 0);
    assert_int_equal(tdm_strbuf_reserve(&b, 10), TDM_OK);
    assert_string_equal(b.p, ""); // reserved: already a string
    assert_int_equal(tdm_strbuf_reserve(&b, SIZE_MAX - 8), TDM_ENOMEM);
    assert_true(b.failed);
    assert_int_equal(tdm_strbuf_add(&b, "x", 1), TDM_ENOMEM); // sticky
    assert_int_equal(b.len, 0);
    tdm_strbuf_fini(&b);
    assert_false(b.failed);

    // A limit: an add past it is dropped whole, and the buffer stays over.
    b = (struct tdm_strbuf){.limit = 5};
    assert_int_equal(tdm_strbuf_adds(&b, "abcd"), TDM_OK);
    assert_int_equal(tdm_strbuf_add(&b, "ef", 2), TDM_ECAPACITY);
    assert_true(b.over);
    assert_string_equal(b.p, "abcd");
    assert_int_equal(tdm_strbuf_addc(&b, 'e'), TDM_ECAPACITY); // would fit, but sticky
    assert_int_equal(b.len, 4);
    tdm_strbuf_fini(&b);
    b = (struct tdm_strbuf){.limit = 5};
    assert_int_equal(tdm_strbuf_adds(&b, "abcde"), TDM_OK);            // exactly the limit
    assert_int_equal(tdm_strbuf_reserve(&b, SIZE_MAX), TDM_ECAPACITY); // no overflow
    tdm_strbuf_fini(&b);

    // The one JSON string escaper: cJSON's and Python's forms.
    static const struct {
        const char *in;
        size_t n;
        bool ascii;
        const char *out;
    } js[] = {
        {"plain", 5, false, "\"plain\""},
        {"a\"b\\c", 5, false, "\"a\\\"b\\\\c\""},
        {"\b\f\n\r\t", 5, false, "\"\\b\\f\\n\\r\\t\""},
        {"\x01\x1f", 2, false, "\"\\u0001\\u001f\""},
        {"nul\0x", 5, false, "\"nul\\u0000x\""},
        {"caf\xc3\xa9 \xf0\x9f\x98\x80", 10, false, "\"caf\xc3\xa9 \xf0\x9f\x98\x80\""},
        {"caf\xc3\xa9 \xf0\x9f\x98\x80", 10, true, "\"caf\\u00e9 \\ud83d\\ude00\""},
        {"\x7f~", 2, true, "\"\\u007f~\""},
        {"\x7f~", 2, false, "\"\x7f~\""},
        {"\xff\xc3", 2, true, "\"\\ufffd\\ufffd\""},
        {"\xff", 1, false, "\"\xff\""},
        {"", 0, true, "\"\""},
    };
    for (size_t i = 0; i < sizeof js / sizeof js[0]; i++) {
        b = (struct tdm_strbuf){0};
        assert_int_equal(tdm_strbuf_add_json_string(&b, js[i].in, js[i].n, js[i].ascii), TDM_OK);
        assert_string_equal(b.p, js[i].out);
        tdm_strbuf_fini(&b);
    }
    tdm_strbuf_fini(NULL);
}

// tdm_grow: first capacity, doubling until need fits, nothing done when there
// is room, contents kept, and an overflowing size refused with the array left
// as it was.
static void test_grow(void **state)
{
    (void)state;
    struct {
        uint64_t *v;
        size_t n, cap;
    } a = {0};
    assert_int_equal(tdm_grow(&a.v, &a.cap, 0, sizeof *a.v, 8), TDM_OK);
    assert_null(a.v); // no room asked, none made
    assert_int_equal(tdm_grow(&a.v, &a.cap, 1, sizeof *a.v, 8), TDM_OK);
    assert_non_null(a.v);
    assert_int_equal(a.cap, 8);
    for (a.n = 0; a.n < 8; a.n++)
        a.v[a.n] = a.n * 3;
    uint64_t *before = a.v;
    assert_int_equal(tdm_grow(&a.v, &a.cap, 8, sizeof *a.v, 8), TDM_OK);
    assert_ptr_equal(a.v, before); // room already there
    assert_int_equal(tdm_grow(&a.v, &a.cap, 9, sizeof *a.v, 8), TDM_OK);
    assert_int_equal(a.cap, 16);
    assert_int_equal(tdm_grow(&a.v, &a.cap, 100, sizeof *a.v, 8), TDM_OK);
    assert_int_equal(a.cap, 128); // 16 doubled until 100 fits
    for (size_t i = 0; i < 8; i++)
        assert_true(a.v[i] == i * 3);
    before = a.v;
    assert_int_equal(tdm_grow(&a.v, &a.cap, SIZE_MAX / 4, sizeof *a.v, 8), TDM_ENOMEM);
    assert_int_equal(tdm_grow(&a.v, &a.cap, SIZE_MAX, 1, 8), TDM_ENOMEM);
    assert_ptr_equal(a.v, before);
    assert_int_equal(a.cap, 128);
    assert_true(a.v[7] == 21);
    free(a.v);
    // first 0 starts at one element.
    char *c = NULL;
    size_t cc = 0;
    assert_int_equal(tdm_grow(&c, &cc, 1, 1, 0), TDM_OK);
    assert_int_equal(cc, 1);
    free(c);
}

// tdm_utf8_encode at each length's first and last code point.
static void test_utf8_encode(void **state)
{
    (void)state;
    static const struct {
        uint32_t cp;
        const char *utf8;
    } cases[] = {
        {0x00, "\x00"},
        {0x41, "A"},
        {0x7F, "\x7f"},
        {0x80, "\xc2\x80"},
        {0x7FF, "\xdf\xbf"},
        {0x800, "\xe0\xa0\x80"},
        {0x20AC, "\xe2\x82\xac"},
        {0xFFFF, "\xef\xbf\xbf"},
        {0x10000, "\xf0\x90\x80\x80"},
        {0x1F600, "\xf0\x9f\x98\x80"},
        {0x10FFFF, "\xf4\x8f\xbf\xbf"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char out[4];
        size_t want = cases[i].cp ? strlen(cases[i].utf8) : 1;
        assert_int_equal(tdm_utf8_encode(cases[i].cp, out), (int)want);
        assert_memory_equal(out, cases[i].utf8, want);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strerror),
        cmocka_unit_test(test_seterr),
        cmocka_unit_test(test_read_file),
        cmocka_unit_test(test_path_join),
        cmocka_unit_test(test_log_level),
        cmocka_unit_test(test_rng),
        cmocka_unit_test(test_json_depth),
        cmocka_unit_test(test_hmac_sha256),
        cmocka_unit_test(test_cond_wait),
        cmocka_unit_test(test_thread_start_detached),
        cmocka_unit_test(test_thread_reuse),
        cmocka_unit_test(test_finish_name),
        cmocka_unit_test(test_flags_parse),
        cmocka_unit_test(test_flags_take_and_help),
        cmocka_unit_test(test_strbuf),
        cmocka_unit_test(test_grow),
        cmocka_unit_test(test_utf8_encode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
