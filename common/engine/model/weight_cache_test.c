// SPDX-License-Identifier: Apache-2.0
// Tests for the packed-weight cache on tiny random models written by mkmodel:
// a miss writes an entry and the next load maps it (logits bitwise equal to a
// load without the cache, bf16 and int8); a changed checkpoint is a miss and
// its old entry is removed; a corrupt, truncated, emptied, foreign-header or
// misfitting entry is ignored and rewritten without a crash; concurrent loads
// from an empty folder all succeed and leave one valid entry and no temp
// file; the folder resolution follows $TANDEM_CACHE and "off"; an entry whose
// page cache is partly in small folios opens with its data intact (read again
// from disk where the filesystem has large folios).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core.h"
#include "kv_cache.h"
#include "mkmodel.h"
#include "model.h"
#include "weight_cache.h"

static char model_dir[64];
static char cache_dir[64];

#define N_TOKENS 9

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    strcpy(model_dir, "/tmp/tdm_wcache_modelXXXXXX");
    strcpy(cache_dir, "/tmp/tdm_wcache_cacheXXXXXX");
    if (mkdtemp(model_dir) == NULL || mkdtemp(cache_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    s.tie_word_embeddings = false; // an lm_head entry too
    s.seed = 11;
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    return 0;
}

// Removes every file of the cache folder (entries and temp files).
static void clear_cache(void)
{
    DIR *d = opendir(cache_dir);
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' && (de->d_name[1] == '\0' || strcmp(de->d_name, "..") == 0))
            continue;
        char p[512];
        snprintf(p, sizeof p, "%s/%s", cache_dir, de->d_name);
        unlink(p);
    }
    if (d)
        closedir(d);
}

static int teardown(void **state)
{
    (void)state;
    clear_cache();
    rmdir(cache_dir);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

// Files in the cache folder: entries (*.tdmpack) and anything else.
static void count_files(int *entries, int *others, char *entry_path, size_t len)
{
    *entries = *others = 0;
    DIR *d = opendir(cache_dir);
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0)
            continue;
        size_t n = strlen(de->d_name);
        if (n > 8 && strcmp(de->d_name + n - 8, ".tdmpack") == 0) {
            (*entries)++;
            if (entry_path)
                snprintf(entry_path, len, "%s/%s", cache_dir, de->d_name);
        } else {
            (*others)++;
        }
    }
    closedir(d);
}

static struct tdm_model *load(enum tdm_weight_mode mode, bool cache,
                              enum tdm_weight_cache_use expect)
{
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.weights = mode;
    o.num_threads = 2;
    o.max_batch_tokens = 64;
    o.max_batch_seqs = 2;
    o.weight_cache_dir = cache ? cache_dir : NULL;
    o.weight_cache_min_bytes = 0;
    int rc = tdm_model_load(&m, model_dir, &o, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "load: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    const struct tdm_model_load_info *li = tdm_model_load_info(m);
    if (li->weight_cache != expect)
        fprintf(stderr, "weight cache %s, expected %s\n",
                tdm_weight_cache_use_name(li->weight_cache), tdm_weight_cache_use_name(expect));
    assert_int_equal(li->weight_cache, expect);
    assert_true(li->checkpoint_bytes > 0);
    return m;
}

// Logits of all rows of a fixed prompt: out[N_TOKENS][vocab] (caller frees).
static float *run(struct tdm_model *m)
{
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_config kc;
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = 4;
    assert_int_equal(tdm_kv_new(&kv, &kc, err, sizeof err), TDM_OK);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    int32_t ids[N_TOKENS];
    for (int i = 0; i < N_TOKENS; i++)
        ids[i] = (int32_t)((i * 37 + 5) % (vocab - 3));
    assert_int_equal(tdm_kv_reserve(kv, &seq, N_TOKENS), TDM_OK);
    float *out = malloc((size_t)N_TOKENS * vocab * sizeof(float));
    assert_non_null(out);
    struct tdm_batch_seq b = {.tokens = ids,
                              .n_tokens = N_TOKENS,
                              .start_pos = 0,
                              .block_table = seq.block_table,
                              .logits = TDM_LOGITS_ALL};
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, out), TDM_OK);
    tdm_kv_seq_release(kv, &seq);
    tdm_kv_free(kv);
    return out;
}

// Loads in `mode` expecting `expect`, and checks the logits are bitwise those of
// a load without the cache.
static void check_load(enum tdm_weight_mode mode, enum tdm_weight_cache_use expect)
{
    struct tdm_model *ref = load(mode, false, TDM_WCACHE_OFF);
    struct tdm_model *m = load(mode, true, expect);
    size_t n = (size_t)N_TOKENS * tdm_model_config(m)->vocab_size;
    float *a = run(ref), *b = run(m);
    assert_memory_equal(a, b, n * sizeof(float));
    free(a);
    free(b);
    tdm_model_free(m);
    tdm_model_free(ref);
}

static void test_miss_then_hit(void **state)
{
    (void)state;
    clear_cache();
    int entries, others;
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
    count_files(&entries, &others, NULL, 0);
    assert_int_equal(entries, 1);
    assert_int_equal(others, 0);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
    // int8 is another entry beside the bf16 one.
    check_load(TDM_WEIGHTS_INT8, TDM_WCACHE_MISS);
    check_load(TDM_WEIGHTS_INT8, TDM_WCACHE_HIT);
    count_files(&entries, &others, NULL, 0);
    assert_int_equal(entries, 2);
    assert_int_equal(others, 0);
}

// Written on a background thread after the load returned: the model serves
// meanwhile (bitwise the same logits) and tdm_model_free waits for the entry.
static void test_background_write(void **state)
{
    (void)state;
    clear_cache();
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.num_threads = 2;
    o.max_batch_tokens = 64;
    o.max_batch_seqs = 2;
    o.weight_cache_dir = cache_dir;
    o.weight_cache_min_bytes = 0;
    o.weight_cache_background = true;
    assert_int_equal(tdm_model_load(&m, model_dir, &o, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_model_load_info(m)->weight_cache, TDM_WCACHE_MISS);
    struct tdm_model *ref = load(TDM_WEIGHTS_BF16, false, TDM_WCACHE_OFF);
    float *a = run(ref), *b = run(m);
    assert_memory_equal(a, b, (size_t)N_TOKENS * tdm_model_config(m)->vocab_size * sizeof(float));
    free(a);
    free(b);
    tdm_model_free(ref);
    tdm_model_free(m);
    int entries, others;
    count_files(&entries, &others, NULL, 0);
    assert_int_equal(entries, 1);
    assert_int_equal(others, 0);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
}

// A temp file left by a writer that was killed is removed by the next write;
// one of a live writer is left alone.
static void test_dead_writer_temp(void **state)
{
    (void)state;
    clear_cache();
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
    char path[512], dead[600], live[600];
    int entries, others;
    count_files(&entries, &others, path, sizeof path);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0)
        _exit(0);
    waitpid(child, NULL, 0); // a pid that is surely gone
    snprintf(dead, sizeof dead, "%s.tmp.%ld.0", path, (long)child);
    snprintf(live, sizeof live, "%s.tmp.%ld.0", path, (long)getppid());
    FILE *f = fopen(dead, "w");
    assert_non_null(f);
    fclose(f);
    assert_non_null(f = fopen(live, "w"));
    fclose(f);
    assert_int_equal(truncate(path, 0), 0); // forces a rewrite
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_REBUILT);
    assert_int_not_equal(access(dead, F_OK), 0);
    assert_int_equal(access(live, F_OK), 0);
    unlink(live);
}

static void test_stale_checkpoint(void **state)
{
    (void)state;
    clear_cache();
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
    char old_entry[512], new_entry[512];
    int entries, others;
    count_files(&entries, &others, old_entry, sizeof old_entry);
    assert_int_equal(entries, 1);
    // New weights in the same folder (another seed): the old entry must not
    // be used (logits compared with a fresh no-cache load) and is removed.
    struct tdm_mkmodel_spec s;
    char err[256];
    tdm_mkmodel_preset(&s, "tiny");
    s.tie_word_embeddings = false;
    s.seed = 12;
    assert_int_equal(tdm_mkmodel_write(&s, model_dir, err, sizeof err), TDM_OK);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
    count_files(&entries, &others, new_entry, sizeof new_entry);
    assert_int_equal(entries, 1);
    assert_string_not_equal(old_entry, new_entry);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
    // Only the mtime changes (same size, same bytes): still a different source.
    struct timespec ts[2] = {{.tv_sec = 1000000000, .tv_nsec = 0},
                             {.tv_sec = 1000000000, .tv_nsec = 0}};
    char st_path[256];
    snprintf(st_path, sizeof st_path, "%s/model.safetensors", model_dir);
    assert_int_equal(utimensat(AT_FDCWD, st_path, ts, 0), 0);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
}

// Damages the one entry with fn, then a load must ignore it, rebuild it and
// the next load must hit.
static void damage_and_check(void (*fn)(const char *path))
{
    clear_cache();
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_MISS);
    char path[512];
    int entries, others;
    count_files(&entries, &others, path, sizeof path);
    assert_int_equal(entries, 1);
    fn(path);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_REBUILT);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
}

static void flip_byte_at(const char *path, off_t off)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    unsigned char c;
    assert_int_equal(pread(fd, &c, 1, off), 1);
    c ^= 0x10;
    assert_int_equal(pwrite(fd, &c, 1, off), 1);
    close(fd);
}

static off_t file_size(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return sb.st_size;
}

static void flip_last_data_byte(const char *path)
{
    flip_byte_at(path, file_size(path) - 1);
}

static void flip_header_byte(const char *path)
{
    flip_byte_at(path, 20);
}

static void flip_table_byte(const char *path)
{
    flip_byte_at(path, 100); // inside the source description
}

static void truncate_half(const char *path)
{
    assert_int_equal(truncate(path, file_size(path) / 2), 0);
}

static void truncate_header(const char *path)
{
    assert_int_equal(truncate(path, 10), 0);
}

static void empty_file(const char *path)
{
    assert_int_equal(truncate(path, 0), 0);
}

static void garbage_file(const char *path)
{
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    for (int i = 0; i < 100000; i++)
        fputc((i * 7919) & 0xff, f);
    fclose(f);
}

static void test_corrupt_entries(void **state)
{
    (void)state;
    damage_and_check(flip_last_data_byte);
    damage_and_check(flip_header_byte);
    damage_and_check(flip_table_byte);
    damage_and_check(truncate_half);
    damage_and_check(truncate_header);
    damage_and_check(empty_file);
    damage_and_check(garbage_file);
}

// The cache identity of the test model's bf16 weights on the CPU backend
// (malloc'd: the caller frees it).
static struct tdm_wcache_id *cpu_bf16_id(void)
{
    struct tdm_wcache_id *id = malloc(sizeof *id);
    assert_non_null(id);
    char err[256];
    const struct tdm_backend_ops *ops = tdm_backend_find("cpu");
    assert_int_equal(tdm_wcache_id_init(id, cache_dir, model_dir, "cpu", ops->layout_version,
                                        "bf16", err, sizeof err),
                     TDM_OK);
    return id;
}

// A well-formed entry (right source, valid checksums) whose weights do not
// fit the model: the load redoes the weights without it and rewrites it.
static void test_misfit_entry(void **state)
{
    (void)state;
    clear_cache();
    struct tdm_wcache_id *id = cpu_bf16_id();
    char err[256];
    static _Alignas(64) uint8_t blob[64 * 64 * 2];
    struct tdm_wcache_entry e = {.type = TDM_W_BF16, .rows = 64, .cols = 64, .nspans = 1};
    e.ptr[0] = blob;
    e.bytes[0] = sizeof blob;
    assert_int_equal(tdm_wcache_write(id, &e, 1, err, sizeof err), TDM_OK);
    struct tdm_wcache *c = NULL;
    assert_int_equal(tdm_wcache_open(&c, id, 2, err, sizeof err), TDM_OK); // valid as a file
    assert_int_equal(tdm_wcache_count(c), 1);
    tdm_wcache_free(c);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_REBUILT);
    check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
    free(id);
}

// An entry whose page cache is partly in 4 KiB folios (the file's pages
// dropped, then every 4th 2 MiB piece read with readahead off) opens with
// its data intact: where the filesystem has large folios (ext4, kernel 6.18)
// the open drops the data's pages and reads them again (the re-read under
// test), elsewhere it is a plain hit; either way every byte is the entry's.
static void test_partly_small_page_cache(void **state)
{
    (void)state;
    clear_cache();
    struct tdm_wcache_id *id = cpu_bf16_id();
    char err[256];
    enum { ROWS = 2048, COLS = 2048 }; // 8 MiB of bf16 per entry
    const size_t bytes = (size_t)ROWS * COLS * 2;
    uint8_t *blob = aligned_alloc(64, 2 * bytes); // [2][ROWS][COLS] bf16
    assert_non_null(blob);
    for (size_t i = 0; i < 2 * bytes; i++)
        blob[i] = (uint8_t)((i * 2654435761u) >> 13);
    struct tdm_wcache_entry e[2];
    for (int k = 0; k < 2; k++) {
        e[k] =
            (struct tdm_wcache_entry){.type = TDM_W_BF16, .rows = ROWS, .cols = COLS, .nspans = 1};
        e[k].ptr[0] = blob + (size_t)k * bytes;
        e[k].bytes[0] = bytes;
    }
    assert_int_equal(tdm_wcache_write(id, e, 2, err, sizeof err), TDM_OK);
    for (int round = 0; round < 2; round++) {
        if (round == 0) {
            int fd = open(id->path, O_RDONLY);
            assert_true(fd >= 0);
            struct stat sb;
            assert_int_equal(fstat(fd, &sb), 0);
            assert_int_equal(fdatasync(fd), 0); // DONTNEED keeps dirty pages
            (void)posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
            (void)posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
            char byte;
            for (off_t piece = 0; piece < sb.st_size; piece += (off_t)8 << 20)
                for (off_t off = piece; off < piece + ((off_t)2 << 20) && off < sb.st_size;
                     off += 4096)
                    assert_int_equal(pread(fd, &byte, 1, off), 1);
            close(fd);
        }
        struct tdm_wcache *c = NULL;
        assert_int_equal(tdm_wcache_open(&c, id, 2, err, sizeof err), TDM_OK);
        assert_int_equal(tdm_wcache_count(c), 2);
        for (int k = 0; k < 2; k++) {
            const struct tdm_wcache_entry *got = tdm_wcache_get(c, k);
            assert_int_equal(got->bytes[0], bytes);
            assert_memory_equal(got->ptr[0], blob + (size_t)k * bytes, bytes);
        }
        tdm_wcache_free(c);
    }
    free(blob);
    free(id);
}

static void *concurrent_load(void *arg)
{
    (void)arg;
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.num_threads = 1;
    o.max_batch_tokens = 64;
    o.max_batch_seqs = 2;
    o.weight_cache_dir = cache_dir;
    o.weight_cache_min_bytes = 0;
    int rc = tdm_model_load(&m, model_dir, &o, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "concurrent load: %s\n", err);
    tdm_model_free(m);
    return (void *)(intptr_t)rc;
}

static void test_concurrent_starts(void **state)
{
    (void)state;
    for (int round = 0; round < 3; round++) {
        clear_cache();
        pthread_t th[6];
        for (int i = 0; i < 6; i++)
            assert_int_equal(pthread_create(&th[i], NULL, concurrent_load, NULL), 0);
        for (int i = 0; i < 6; i++) {
            void *rc;
            pthread_join(th[i], &rc);
            assert_int_equal((int)(intptr_t)rc, TDM_OK);
        }
        int entries, others;
        count_files(&entries, &others, NULL, 0);
        assert_int_equal(entries, 1); // one complete entry, no temp file left
        assert_int_equal(others, 0);
        check_load(TDM_WEIGHTS_BF16, TDM_WCACHE_HIT);
    }
}

static void test_folder_resolution(void **state)
{
    (void)state;
    char out[512];
    char *saved = getenv("TANDEM_CACHE") ? strdup(getenv("TANDEM_CACHE")) : NULL;
    assert_int_equal(tdm_wcache_folder("/x/y", out, sizeof out), TDM_OK);
    assert_string_equal(out, "/x/y");
    assert_int_equal(tdm_wcache_folder("off", out, sizeof out), TDM_ENOTFOUND);
    assert_int_equal(tdm_wcache_folder("", out, sizeof out), TDM_ENOTFOUND);
    setenv("TANDEM_CACHE", "/c", 1);
    assert_int_equal(tdm_wcache_folder(NULL, out, sizeof out), TDM_OK);
    assert_string_equal(out, "/c/packed");
    setenv("TANDEM_CACHE", "off", 1);
    assert_int_equal(tdm_wcache_folder(NULL, out, sizeof out), TDM_ENOTFOUND);
    unsetenv("TANDEM_CACHE");
    setenv("XDG_CACHE_HOME", "/xdg", 1);
    assert_int_equal(tdm_wcache_folder(NULL, out, sizeof out), TDM_OK);
    assert_string_equal(out, "/xdg/tandem/packed");
    assert_int_equal(tdm_wcache_folder(NULL, out, 8), TDM_EINVAL);
    unsetenv("XDG_CACHE_HOME");
    if (saved) {
        setenv("TANDEM_CACHE", saved, 1);
        free(saved);
    }
    // Below weight_cache_min_bytes nothing is cached.
    clear_cache();
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.num_threads = 1;
    o.max_batch_tokens = 16;
    o.max_batch_seqs = 1;
    o.weight_cache_dir = cache_dir;
    assert_int_equal(tdm_model_load(&m, model_dir, &o, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_model_load_info(m)->weight_cache, TDM_WCACHE_OFF);
    tdm_model_free(m);
    int entries, others;
    count_files(&entries, &others, NULL, 0);
    assert_int_equal(entries + others, 0);
}

int main(void)
{
    tdm_log_set_level_name("err");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_miss_then_hit),           cmocka_unit_test(test_stale_checkpoint),
        cmocka_unit_test(test_corrupt_entries),         cmocka_unit_test(test_misfit_entry),
        cmocka_unit_test(test_concurrent_starts),       cmocka_unit_test(test_folder_resolution),
        cmocka_unit_test(test_background_write),        cmocka_unit_test(test_dead_writer_temp),
        cmocka_unit_test(test_partly_small_page_cache),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
