// SPDX-License-Identifier: Apache-2.0
// backend_module_test: device backends loaded as modules (backend_module.h).
//   - libtandem-cuda-emu.so loads from TANDEM_BACKEND_PATH, registers the
//     CUDA backend over the emulator, and a model on --device cuda-emu
//     computes bitwise what the same backend linked statically computes;
//   - its log lines reach the binary's log;
//   - broken modules fail with a message naming what is wrong: another API
//     version, no init, a library it needs missing, no backend, no file; a
//     name that could be a path is refused; the outcome is remembered;
//   - the module refuses a binary of another API version;
//   - the device KV transfer table is the CUDA module's (NULL without it).
// argv[1]: the fixtures' folder, argv[2]: the build's module folder.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "backend_module.h"
#include "core.h"
#include "cuda_backend.h"
#include "mkmodel.h"
#include "model.h"
#include "test_skip.h"

static const char *fixture_dir, *module_dir;
static char tiny_dir[64];

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    snprintf(tiny_dir, sizeof tiny_dir, "/tmp/tdm_modtest_XXXXXX");
    if (mkdtemp(tiny_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    s.seed = 5;
    if (tdm_mkmodel_write(&s, tiny_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    return tdm_backend_register(&tdm_cuda_emu_backend_ops) == TDM_OK ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    tdm_mkmodel_remove(tiny_dir);
    return 0;
}

static void test_emu_module_loads(void **state)
{
    (void)state;
    const struct tdm_backend_module *m;
    char err[1024];
    int rc = tdm_backend_module_load("cuda-emu", &m, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("cuda-emu: %s", err);
    assert_int_equal(m->api, TDM_BACKEND_MODULE_API);
    assert_string_equal(m->name, "cuda-emu");
    assert_null(m->kvx); // the emulator has no device KV transfer
    assert_non_null(m->backend);
    assert_string_equal(m->backend->name, "cuda");
    assert_false(m->backend->host_memory);
    assert_int_equal(m->backend->device_count(), 1);
    // Its own copy of the backend, not the one linked into this test.
    assert_ptr_not_equal(m->backend, &tdm_cuda_emu_backend_ops);
    const struct tdm_backend_ops *again;
    assert_int_equal(tdm_backend_lookup("cuda-emu", &again, err, sizeof err), TDM_OK);
    assert_ptr_equal(again, m->backend);
}

static struct tdm_model *load_on(const char *backend)
{
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[512];
    tdm_model_opts_default(&o);
    o.backend = backend;
    o.enforce_eager = true;
    o.num_threads = 1;
    o.max_batch_tokens = 64;
    o.max_batch_seqs = 2;
    if (tdm_model_load(&m, tiny_dir, &o, err, sizeof err) != TDM_OK)
        fail_msg("load on %s: %s", backend, err);
    return m;
}

// Prefill of 24 tokens, then 6 greedy steps; every row's logits into out.
static void run(struct tdm_model *m, float *out, int32_t *hist)
{
    struct tdm_kv_config kc;
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = 8;
    if (tdm_model_kv_new(m, &kc, &kv, err, sizeof err) != TDM_OK)
        fail_msg("kv: %s", err);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    int vocab = tdm_model_config(m)->vocab_size;
    for (int i = 0; i < 24; i++)
        hist[i] = (int32_t)((i * 7919 + 13) % (vocab - 3));
    int pos = 0, n = 24;
    for (int s = 0; s < 7; s++) {
        assert_int_equal(tdm_kv_reserve(kv, &seq, pos + n), TDM_OK);
        struct tdm_batch_seq b = {.tokens = hist + pos,
                                  .n_tokens = n,
                                  .start_pos = pos,
                                  .block_table = seq.block_table,
                                  .logits = TDM_LOGITS_LAST};
        float *row = out + (size_t)s * vocab;
        assert_int_equal(tdm_model_forward(m, kv, &b, 1, row), TDM_OK);
        tdm_kv_commit(kv, &seq, hist, pos + n);
        int best = 0;
        for (int v = 1; v < vocab; v++)
            if (row[v] > row[best])
                best = v;
        pos += n;
        hist[pos] = best;
        n = 1;
    }
    tdm_kv_seq_release(kv, &seq);
    tdm_kv_free(kv);
}

static char captured[4096];
static pthread_mutex_t captured_mu = PTHREAD_MUTEX_INITIALIZER;
static void capture(int level, const char *module, const char *msg)
{
    (void)level;
    pthread_mutex_lock(&captured_mu);
    size_t off = strlen(captured);
    snprintf(captured + off, sizeof captured - off, "%s: %s\n", module ? module : "-", msg);
    pthread_mutex_unlock(&captured_mu);
}

static void test_module_computes_as_linked(void **state)
{
    (void)state;
    captured[0] = '\0';
    tdm_log_set_sink(capture);
    struct tdm_model *a = load_on("cuda");     // the emulated backend linked in
    struct tdm_model *b = load_on("cuda-emu"); // the module's
    tdm_log_set_sink(NULL);
    // The module's own INFO line at backend creation came through this log.
    assert_non_null(strstr(captured, "cuda: backend device=0"));
    int vocab = tdm_model_config(a)->vocab_size;
    float *la = calloc((size_t)7 * vocab, sizeof *la), *lb = calloc((size_t)7 * vocab, sizeof *lb);
    int32_t ha[40], hb[40];
    assert_non_null(la);
    assert_non_null(lb);
    run(a, la, ha);
    run(b, lb, hb);
    assert_memory_equal(ha, hb, sizeof(int32_t) * 31);
    assert_memory_equal(la, lb, sizeof(float) * 7 * (size_t)vocab);
    free(la);
    free(lb);
    tdm_model_free(a);
    tdm_model_free(b);
}

static void test_device_flag(void **state)
{
    (void)state;
    struct tdm_model_opts o;
    char err[1024];
    tdm_model_opts_default(&o);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda-emu", err, sizeof err), TDM_OK);
    assert_string_equal(o.backend, "cuda-emu");
    assert_int_equal(o.device, 0);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda-emu:1", err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--device cuda-emu:1: 1 CUDA GPU visible");
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda-emu:x", err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--device cuda-emu:x: expected cuda-emu:N with N a GPU index");
}

static void expect_fail(const char *name, int code, const char *part)
{
    const struct tdm_backend_module *m = (const void *)1;
    char err[1024] = "";
    int rc = tdm_backend_module_load(name, &m, err, sizeof err);
    if (rc != code || strstr(err, part) == NULL)
        fail_msg("%s: rc %d (want %d), err \"%s\" (want \"%s\" in it)", name, rc, code, err, part);
    assert_null(m);
}

static void test_broken_modules(void **state)
{
    (void)state;
    char want[1024];
    snprintf(want, sizeof want,
             "%s/libtandem-fixture-badver.so is backend module API %d, this "
             "binary needs %d",
             fixture_dir, TDM_BACKEND_MODULE_API + 1, TDM_BACKEND_MODULE_API);
    expect_fail("fixture-badver", TDM_EBACKEND, want);
    expect_fail("fixture-noinit", TDM_EBACKEND,
                "is not a Tandem backend module (no tdm_backend_module_init)");
    // The dynamic linker's line, naming the library that is missing.
    expect_fail("fixture-dep", TDM_EBACKEND,
                "libtandem-fixture-gone.so: cannot open shared object");
    expect_fail("fixture-empty", TDM_EBACKEND, "libtandem-fixture-empty.so registered no backend");
    snprintf(want, sizeof want,
             "libtandem-nosuch.so not found (looked in %s, %s; "
             "TANDEM_BACKEND_PATH names its folder)",
             fixture_dir, module_dir);
    expect_fail("nosuch", TDM_ENOTFOUND, want);
    expect_fail("nosuch", TDM_ENOTFOUND, want); // remembered
    expect_fail("../lib/x", TDM_EINVAL, "'../lib/x' is not a backend module name");
    expect_fail("", TDM_EINVAL, "is not a backend module name");
    // The registry passes the reason on.
    const struct tdm_backend_ops *ops = (const void *)1;
    char err[1024];
    assert_int_equal(tdm_backend_lookup("fixture-noinit", &ops, err, sizeof err), TDM_EBACKEND);
    assert_null(ops);
    assert_null(tdm_backend_find("nosuch"));
}

static void test_module_refuses_other_api(void **state)
{
    (void)state;
    char path[1024], err[512] = "";
    snprintf(path, sizeof path, "%s/libtandem-cuda-emu.so", module_dir);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    assert_non_null(h);
    void *sym = dlsym(h, TDM_BACKEND_MODULE_INIT_SYMBOL);
    assert_non_null(sym);
    tdm_backend_module_init_fn init;
    memcpy(&init, &sym, sizeof init);
    struct tdm_backend_host host = {.api = 99, .backend_ops_bytes = sizeof(struct tdm_backend_ops)};
    assert_null(init(&host, err, sizeof err));
    snprintf(path, sizeof path, "the module is backend module API %d, the binary API 99",
             TDM_BACKEND_MODULE_API);
    assert_non_null(strstr(err, path));
    host.api = TDM_BACKEND_MODULE_API;
    host.backend_ops_bytes = 8;
    assert_null(init(&host, err, sizeof err));
    assert_non_null(strstr(err, "and 8 in the binary: they were built from different sources"));
    // Nothing but the init is exported.
    assert_null(dlsym(h, "tdm_cuda_emu_backend_ops"));
    assert_null(dlsym(h, "tdm_log_write"));
    dlclose(h);
}

// The device KV transfer table (tdm_backend_module_kvx) is the CUDA module's
// registration's: the real table where libtandem-cuda.so loads (a CUDA
// build), else NULL with the loader's reason, the same as a load's.
static void test_kvx_table(void **state)
{
    (void)state;
    const struct tdm_backend_module *m;
    const struct tdm_kvx_ops *kvx = (const void *)1;
    char err[1024] = "", why[1024] = "";
    int want = tdm_backend_module_load("cuda", &m, why, sizeof why);
    assert_int_equal(tdm_backend_module_kvx(&kvx, err, sizeof err), want);
    if (want == TDM_OK) {
        assert_non_null(kvx);
        assert_ptr_equal(kvx, m->kvx);
    } else {
        assert_null(kvx);
        assert_string_equal(err, why);
        assert_true(err[0] != '\0');
    }
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: backend_module_test FIXTURE_DIR MODULE_DIR\n");
        return 2;
    }
    fixture_dir = argv[1];
    module_dir = argv[2];
    char path[2048];
    snprintf(path, sizeof path, "%s:%s", fixture_dir, module_dir);
    setenv("TANDEM_BACKEND_PATH", path, 1);
    setenv("TANDEM_CUDA_KV_DTYPE", "f32", 1);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_emu_module_loads),
        cmocka_unit_test(test_module_computes_as_linked),
        cmocka_unit_test(test_device_flag),
        cmocka_unit_test(test_broken_modules),
        cmocka_unit_test(test_module_refuses_other_api),
        cmocka_unit_test(test_kvx_table),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, setup, teardown));
}
