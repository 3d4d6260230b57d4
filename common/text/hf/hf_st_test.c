// SPDX-License-Identifier: Apache-2.0
// Tests for safetensors: write/read round trip, sharded folders through
// model.safetensors.index.json, every malformed-header case (error code and
// message), shape checks in tdm_st_get, and a deterministic mutation loop over a
// valid file that must never crash or read out of bounds (run it under ASan).
#include "hf.h"

#include "core.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

static char tmpdir[64];

static int setup_dir(void **state)
{
    (void)state;
    snprintf(tmpdir, sizeof(tmpdir), "/tmp/tdm_hf_st_XXXXXX");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static int remove_dir(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmpdir);
    return system(cmd) == 0 ? 0 : -1;
}

static char *tpath(const char *name)
{
    static char buf[4][256];
    static int k;
    k = (k + 1) % 4;
    snprintf(buf[k], sizeof(buf[k]), "%s/%s", tmpdir, name);
    return buf[k];
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n)
        assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static void write_text(const char *path, const char *s)
{
    write_bytes(path, s, strlen(s));
}

// A file with the given header length field, header text and data_len data bytes
// (a sparse zero area made by truncate, so big tensors cost no disk).
static void write_raw_len(const char *path, uint64_t hlen, const char *header, size_t data_len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t lb[8];
    for (int i = 0; i < 8; i++)
        lb[i] = (uint8_t)(hlen >> (8 * i));
    assert_int_equal(fwrite(lb, 1, 8, f), 8);
    size_t n = strlen(header);
    assert_int_equal(fwrite(header, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
    assert_int_equal(truncate(path, (off_t)(8 + n + data_len)), 0);
}

static void write_raw(const char *path, const char *header, size_t data_len)
{
    write_raw_len(path, strlen(header), header, data_len);
}

// Pads the header with spaces so the data starts 8-aligned, as real writers do.
static void write_raw_padded(const char *path, const char *header, size_t data_len)
{
    char hdr[1024];
    size_t n = strlen(header);
    assert_true(n + 8 < sizeof(hdr));
    snprintf(hdr, sizeof(hdr), "%s%.*s", header, (int)((8 - n % 8) % 8), "        ");
    write_raw(path, hdr, data_len);
}

// ---- round trip --------------------------------------------------------------------------

static void test_round_trip(void **state)
{
    (void)state;
    uint16_t wq[2 * 3];
    float norm[4] = {1.0f, -2.5f, 3.25f, 1e-3f};
    uint16_t scalar = tdm_f32_to_f16(0.5f);
    for (int i = 0; i < 6; i++)
        wq[i] = tdm_f32_to_bf16((float)i - 2.0f);
    struct tdm_tensor in[] = {
        {.name = "model.layers.0.self_attn.q_proj.weight",
         .dtype = TDM_DTYPE_BF16,
         .ndim = 2,
         .shape = {2, 3},
         .data = wq,
         .nbytes = sizeof(wq)},
        {.name = "model.norm.weight",
         .dtype = TDM_DTYPE_F32,
         .ndim = 1,
         .shape = {4},
         .data = norm,
         .nbytes = sizeof(norm)},
        {.name = "empty",
         .dtype = TDM_DTYPE_F32,
         .ndim = 2,
         .shape = {0, 5},
         .data = NULL,
         .nbytes = 0},
        {.name = "scale \"q\"\\", .dtype = TDM_DTYPE_F16, .ndim = 0, .data = &scalar, .nbytes = 2},
    };
    char err[512] = "";
    const char *p = tpath("rt.safetensors");
    assert_int_equal(tdm_st_write(p, in, 4, err, sizeof(err)), TDM_OK);

    // Byte layout: header length multiple of 8, metadata first, space padding.
    char *raw;
    size_t len;
    assert_int_equal(tdm_read_file(p, &raw, &len, err, sizeof(err)), TDM_OK);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | (uint8_t)raw[i];
    assert_int_equal(hlen % 8, 0);
    assert_int_equal(len, 8 + hlen + sizeof(wq) + sizeof(norm) + 2);
    assert_memory_equal(raw + 8, "{\"__metadata__\":{\"format\":\"pt\"},", 32);
    assert_non_null(strstr(raw + 8, "\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[4],"
                                    "\"data_offsets\":[12,28]}"));
    assert_non_null(strstr(raw + 8, "\"scale \\\"q\\\"\\\\\":{\"dtype\":\"F16\",\"shape\":[]"));
    size_t close_brace = 8;
    while (raw[close_brace] != '\0' && close_brace < 8 + hlen)
        close_brace++;
    for (size_t i = 8 + hlen - 1; raw[i] == ' '; i--)
        assert_true(i > 8);
    assert_int_equal(raw[8 + hlen - 1] == ' ' || raw[8 + hlen - 1] == '}', 1);
    free(raw);

    struct tdm_safetensors *st;
    assert_int_equal(tdm_st_open(&st, p, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_count(st), 4);
    // file order (by offset); the empty tensor sorts where its offset is
    const struct tdm_tensor *t0 = tdm_st_at(st, 0);
    assert_string_equal(t0->name, "model.layers.0.self_attn.q_proj.weight");
    assert_int_equal(t0->dtype, TDM_DTYPE_BF16);
    assert_int_equal(t0->ndim, 2);
    assert_int_equal(t0->shape[0], 2);
    assert_int_equal(t0->shape[1], 3);
    assert_int_equal(t0->nbytes, sizeof(wq));
    assert_memory_equal(t0->data, wq, sizeof(wq));
    assert_null(tdm_st_at(st, 4));

    const struct tdm_tensor *n = tdm_st_find(st, "model.norm.weight");
    assert_non_null(n);
    assert_int_equal(n->dtype, TDM_DTYPE_F32);
    assert_memory_equal(n->data, norm, sizeof(norm));
    assert_int_equal((uintptr_t)n->data % 4, 0);
    const struct tdm_tensor *e = tdm_st_find(st, "empty");
    assert_non_null(e);
    assert_int_equal(e->nbytes, 0);
    assert_int_equal(e->shape[1], 5);
    const struct tdm_tensor *s = tdm_st_find(st, "scale \"q\"\\");
    assert_non_null(s);
    assert_int_equal(s->ndim, 0);
    assert_true(tdm_f16_to_f32(*(const uint16_t *)s->data) == 0.5f);
    assert_null(tdm_st_find(st, "model.norm"));
    assert_null(tdm_st_find(st, ""));

    const struct tdm_tensor *got;
    int64_t want_ok[2] = {2, 3}, want_bad[2] = {2, 4};
    assert_int_equal(tdm_st_get(st, "model.layers.0.self_attn.q_proj.weight", 2, want_ok, &got, err,
                                sizeof(err)),
                     TDM_OK);
    assert_ptr_equal(got, t0);
    assert_int_equal(tdm_st_get(st, "model.layers.0.self_attn.q_proj.weight", 2, want_bad, &got,
                                err, sizeof(err)),
                     TDM_EINVAL);
    assert_null(got);
    assert_string_equal(err, "model.layers.0.self_attn.q_proj.weight: shape [2, 3] does not "
                             "match the config's [2, 4]");
    assert_int_equal(tdm_st_get(st, "model.norm.weight", 2, want_ok, &got, err, sizeof(err)),
                     TDM_EINVAL);
    assert_string_equal(err, "model.norm.weight: shape [4] does not match the config's [2, 3]");
    assert_int_equal(tdm_st_get(st, "lm_head.weight", 2, want_ok, &got, err, sizeof(err)),
                     TDM_ENOTFOUND);
    assert_string_equal(err, "lm_head.weight: no such tensor");
    tdm_st_free(st);
    tdm_st_free(NULL);

    // A folder holding model.safetensors opens too.
    char dir[256];
    snprintf(dir, sizeof(dir), "%s/single", tmpdir);
    assert_int_equal(mkdir(dir, 0755), 0);
    char file[300];
    snprintf(file, sizeof(file), "%s/model.safetensors", dir);
    assert_int_equal(tdm_st_write(file, in, 2, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_open(&st, dir, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_count(st), 2);
    tdm_st_free(st);

    // An empty file list is a valid file.
    assert_int_equal(tdm_st_write(tpath("none.safetensors"), NULL, 0, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_open(&st, tpath("none.safetensors"), err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_count(st), 0);
    assert_null(tdm_st_find(st, "x"));
    tdm_st_free(st);
}

// Names needing JSON escapes (control bytes, quotes, backslash, UTF-8) survive.
static void test_name_escapes(void **state)
{
    (void)state;
    static const char *names[] = {"tab\there", "ctl\x01\x1f", "caf\xc3\xa9.weight", "q\"\\/",
                                  "__metadata__x"};
    float v = 1.0f;
    struct tdm_tensor t[5];
    for (int i = 0; i < 5; i++)
        t[i] = (struct tdm_tensor){.name = names[i],
                                   .dtype = TDM_DTYPE_F32,
                                   .ndim = 1,
                                   .shape = {1},
                                   .data = &v,
                                   .nbytes = 4};
    char err[256];
    const char *p = tpath("names.safetensors");
    assert_int_equal(tdm_st_write(p, t, 5, err, sizeof(err)), TDM_OK);
    struct tdm_safetensors *st;
    assert_int_equal(tdm_st_open(&st, p, err, sizeof(err)), TDM_OK);
    for (int i = 0; i < 5; i++) {
        assert_non_null(tdm_st_find(st, names[i]));
        assert_string_equal(tdm_st_at(st, (size_t)i)->name, names[i]);
    }
    tdm_st_free(st);
}

// The exact message format from hf.h, on a big (sparse) tensor.
static void test_get_message(void **state)
{
    (void)state;
    const char *p = tpath("big.safetensors");
    write_raw(p,
              "{\"model.layers.0.mlp.up_proj.weight\":{\"dtype\":\"BF16\",\"shape\":[4864,895],"
              "\"data_offsets\":[0,8706560]}}      ",
              8706560);
    struct tdm_safetensors *st;
    char err[256];
    assert_int_equal(tdm_st_open(&st, p, err, sizeof(err)), TDM_OK);
    const struct tdm_tensor *t;
    int64_t want[2] = {4864, 896};
    assert_int_equal(
        tdm_st_get(st, "model.layers.0.mlp.up_proj.weight", 2, want, &t, err, sizeof(err)),
        TDM_EINVAL);
    assert_string_equal(err, "model.layers.0.mlp.up_proj.weight: shape [4864, 895] does not "
                             "match the config's [4864, 896]");
    tdm_st_free(st);
}

static void test_write_errors(void **state)
{
    (void)state;
    float v[2] = {1, 2};
    char err[256];
    struct tdm_tensor dup[] = {
        {.name = "a", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v, .nbytes = 8},
        {.name = "b", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v, .nbytes = 8},
        {.name = "a", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {2}, .data = v, .nbytes = 8},
    };
    assert_int_equal(tdm_st_write(tpath("w.safetensors"), dup, 3, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, "tensor \"a\" given twice"));
    struct tdm_tensor badn = {
        .name = "a", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {3}, .data = v, .nbytes = 8};
    assert_int_equal(tdm_st_write(tpath("w.safetensors"), &badn, 1, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, "nbytes 8 does not match shape and dtype"));
    struct tdm_tensor meta = {.name = "__metadata__",
                              .dtype = TDM_DTYPE_F32,
                              .ndim = 1,
                              .shape = {2},
                              .data = v,
                              .nbytes = 8};
    assert_int_equal(tdm_st_write(tpath("w.safetensors"), &meta, 1, err, sizeof(err)), TDM_EINVAL);
    struct tdm_tensor nodata = {
        .name = "a", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {2}, .nbytes = 8};
    assert_int_equal(tdm_st_write(tpath("w.safetensors"), &nodata, 1, err, sizeof(err)),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "no data"));
    struct tdm_tensor neg = {
        .name = "a", .dtype = TDM_DTYPE_F32, .ndim = 1, .shape = {-2}, .data = v, .nbytes = 8};
    assert_int_equal(tdm_st_write(tpath("w.safetensors"), &neg, 1, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, "shape[0] is negative"));
    assert_int_equal(
        tdm_st_write("/nonexistent-tandem-dir/x.safetensors", dup, 1, err, sizeof(err)), TDM_EIO);
    assert_non_null(strstr(err, "/nonexistent-tandem-dir/x.safetensors"));
    // nothing was left behind by the failed writes
    assert_int_equal(access(tpath("w.safetensors"), F_OK), -1);
}

// ---- sharded folders ---------------------------------------------------------------------

static void make_shard(const char *dir, const char *file, const char *const *names, size_t n,
                       float base)
{
    float vals[8][3];
    struct tdm_tensor t[8];
    for (size_t i = 0; i < n; i++) {
        for (int k = 0; k < 3; k++)
            vals[i][k] = base + (float)(i * 3 + (size_t)k);
        t[i] = (struct tdm_tensor){.name = names[i],
                                   .dtype = TDM_DTYPE_F32,
                                   .ndim = 1,
                                   .shape = {3},
                                   .data = vals[i],
                                   .nbytes = sizeof(vals[i])};
    }
    char path[512], err[256];
    snprintf(path, sizeof(path), "%s/%s", dir, file);
    assert_int_equal(tdm_st_write(path, t, n, err, sizeof(err)), TDM_OK);
}

static void make_dir(char *out, size_t outlen, const char *name)
{
    snprintf(out, outlen, "%s/%s", tmpdir, name);
    assert_int_equal(mkdir(out, 0755), 0);
}

static void write_index(const char *dir, const char *json)
{
    char path[512];
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", dir);
    write_text(path, json);
}

static const char *shard1[] = {"model.embed_tokens.weight",
                               "model.layers.0.input_layernorm.weight"};
static const char *shard2[] = {"model.norm.weight"};
#define S1 "model-00001-of-00002.safetensors"
#define S2 "model-00002-of-00002.safetensors"

static void expect_open_error(const char *path, int code, const char *msg)
{
    struct tdm_safetensors *st = (struct tdm_safetensors *)1;
    char err[1024] = "";
    int rc = tdm_st_open(&st, path, err, sizeof(err));
    if (rc != code || !strstr(err, msg) || st != NULL) {
        print_error("%s: rc=%d (want %d) err=\"%s\" (want substring \"%s\")\n", path, rc, code, err,
                    msg);
        fail();
    }
}

static void test_sharded(void **state)
{
    (void)state;
    char dir[256], err[512];
    make_dir(dir, sizeof(dir), "sharded");
    make_shard(dir, S1, shard1, 2, 0.0f);
    make_shard(dir, S2, shard2, 1, 100.0f);
    write_index(dir, "{\"metadata\":{\"total_size\":36},\"weight_map\":{"
                     "\"model.embed_tokens.weight\":\"" S1 "\","
                     "\"model.norm.weight\":\"" S2 "\","
                     "\"model.layers.0.input_layernorm.weight\":\"" S1 "\"}}");
    struct tdm_safetensors *st;
    assert_int_equal(tdm_st_open(&st, dir, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_count(st), 3);
    const struct tdm_tensor *t = tdm_st_find(st, "model.norm.weight");
    assert_non_null(t);
    assert_true(((const float *)t->data)[0] == 100.0f);
    assert_true(((const float *)t->data)[2] == 102.0f);
    t = tdm_st_find(st, "model.layers.0.input_layernorm.weight");
    assert_non_null(t);
    assert_true(((const float *)t->data)[0] == 3.0f);
    // shard order: first seen in weight_map
    assert_string_equal(tdm_st_at(st, 0)->name, "model.embed_tokens.weight");
    assert_string_equal(tdm_st_at(st, 2)->name, "model.norm.weight");
    tdm_st_free(st);

    // the index path itself opens too
    char idx[512];
    snprintf(idx, sizeof(idx), "%s/model.safetensors.index.json", dir);
    assert_int_equal(tdm_st_open(&st, idx, err, sizeof(err)), TDM_OK);
    assert_int_equal(tdm_st_count(st), 3);
    tdm_st_free(st);
}

static void test_sharded_errors(void **state)
{
    (void)state;
    char dir[256];

    make_dir(dir, sizeof(dir), "missing_shard");
    make_shard(dir, S1, shard1, 2, 0.0f);
    write_index(dir, "{\"weight_map\":{\"model.embed_tokens.weight\":\"" S1 "\","
                     "\"model.norm.weight\":\"" S2 "\"}}");
    expect_open_error(dir, TDM_ENOTFOUND, "shard \"" S2 "\" is missing");

    make_dir(dir, sizeof(dir), "lacks");
    make_shard(dir, S1, shard1, 2, 0.0f);
    make_shard(dir, S2, shard2, 1, 0.0f);
    write_index(dir, "{\"weight_map\":{\"model.embed_tokens.weight\":\"" S1 "\","
                     "\"lm_head.weight\":\"" S2 "\"}}");
    expect_open_error(dir, TDM_ENOTFOUND,
                      "tensor \"lm_head.weight\" is mapped to shard \"" S2 "\", which lacks it");

    make_dir(dir, sizeof(dir), "wrong_shard");
    make_shard(dir, S1, shard1, 2, 0.0f);
    make_shard(dir, S2, shard2, 1, 0.0f);
    write_index(dir, "{\"weight_map\":{\"model.embed_tokens.weight\":\"" S2 "\","
                     "\"model.norm.weight\":\"" S1 "\"}}");
    expect_open_error(dir, TDM_ENOTFOUND, "is mapped to shard");

    make_dir(dir, sizeof(dir), "dup");
    make_shard(dir, S1, shard1, 2, 0.0f);
    make_shard(dir, S2, shard1, 1, 0.0f); // embed_tokens in both shards
    write_index(dir, "{\"weight_map\":{\"model.embed_tokens.weight\":\"" S1 "\","
                     "\"model.layers.0.input_layernorm.weight\":\"" S2 "\"}}");
    expect_open_error(dir, TDM_EPROTO, "tensor \"model.embed_tokens.weight\" appears twice");

    make_dir(dir, sizeof(dir), "no_map");
    write_index(dir, "{\"metadata\":{}}");
    expect_open_error(dir, TDM_EPROTO, "\"weight_map\" is missing or not an object");

    make_dir(dir, sizeof(dir), "empty_map");
    write_index(dir, "{\"weight_map\":{}}");
    expect_open_error(dir, TDM_EPROTO, "weight_map is empty");

    make_dir(dir, sizeof(dir), "traversal");
    write_index(dir, "{\"weight_map\":{\"a\":\"../x.safetensors\"}}");
    expect_open_error(dir, TDM_EPROTO, "tensor \"a\" maps to an invalid shard file name");
    write_index(dir, "{\"weight_map\":{\"a\":3}}");
    expect_open_error(dir, TDM_EPROTO, "invalid shard file name");
    write_index(dir, "{\"weight_map\":{\"a\":\"..\"}}");
    expect_open_error(dir, TDM_EPROTO, "invalid shard file name");
    write_index(dir, "{\"weight_map\":");
    expect_open_error(dir, TDM_EPROTO, "model.safetensors.index.json: not valid JSON");

    make_dir(dir, sizeof(dir), "bad_shard");
    write_raw(tpath("bad_shard/" S1),
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],"
              "\"data_offsets\":[0,4]}}",
              8);
    write_index(dir, "{\"weight_map\":{\"a\":\"" S1 "\"}}");
    expect_open_error(dir, TDM_EPROTO, S1 ": tensor \"a\": shape and dtype F32 make 8 bytes");

    // a FIFO where a shard should be fails instead of blocking
    make_dir(dir, sizeof(dir), "fifo");
    assert_int_equal(mkfifo(tpath("fifo/" S1), 0644), 0);
    write_index(dir, "{\"weight_map\":{\"a\":\"" S1 "\"}}");
    expect_open_error(dir, TDM_EIO, "not a regular file");
    expect_open_error(tpath("fifo/" S1), TDM_EIO, "not a regular file or folder");

    make_dir(dir, sizeof(dir), "nothing");
    expect_open_error(dir, TDM_ENOTFOUND, "no model.safetensors or model.safetensors.index.json");
    expect_open_error(tpath("does-not-exist.safetensors"), TDM_ENOTFOUND, "does-not-exist");
}

// ---- malformed single files ----------------------------------------------------------------

static void test_bad_files(void **state)
{
    (void)state;
    const char *p = tpath("bad.safetensors");

    write_bytes(p, "", 0);
    expect_open_error(p, TDM_EPROTO, "0 bytes is too short");
    write_bytes(p, "\x10\0\0\0\0", 5);
    expect_open_error(p, TDM_EPROTO, "5 bytes is too short");

    write_raw_len(p, 1000, "{}", 0);
    expect_open_error(p, TDM_EPROTO, "header length 1000 runs past the end of the 10-byte file");
    write_raw_len(p, 3, "{}", 0);
    expect_open_error(p, TDM_EPROTO, "header length 3 runs past the end");
    write_raw_len(p, (uint64_t)1 << 40, "{}", 0);
    expect_open_error(p, TDM_EPROTO, "larger than the 100 MB limit");
    write_raw_len(p, UINT64_MAX, "{}", 0);
    expect_open_error(p, TDM_EPROTO, "larger than the 100 MB limit");
    write_raw_len(p, 0, "", 16);
    expect_open_error(p, TDM_EPROTO, "header: not valid JSON");

    static const struct {
        const char *header;
        size_t data_len;
        int code;
        const char *msg;
    } cases[] = {
        {"{\"a\":", 0, TDM_EPROTO, "bad.safetensors: header: not valid JSON"},
        {"not json at all", 0, TDM_EPROTO, "header: not valid JSON"},
        {"[1,2,3]", 0, TDM_EPROTO, "header: top level is not a JSON object"},
        {"\"str\"", 0, TDM_EPROTO, "header: top level is not a JSON object"},
        {"{} x", 0, TDM_EPROTO, "trailing data"},
        {"{\"a\":5}", 0, TDM_EPROTO, "tensor \"a\": entry is not an object"},
        {"{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "bad.safetensors: tensor \"a\": missing \"dtype\""},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "tensor \"a\": missing \"shape\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, TDM_EPROTO,
         "tensor \"a\": missing \"data_offsets\""},
        {"{\"a\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "dtype is not a string"},
        {"{\"a\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, TDM_EINVAL,
         "tensor \"a\": unsupported dtype \"I64\""},
        {"{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[1],\"data_offsets\":[0,1]}}", 1, TDM_EINVAL,
         "unsupported dtype \"F8_E4M3\""},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":3,\"data_offsets\":[0,12]}}", 12, TDM_EPROTO,
         "shape is not a list"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, TDM_EINVAL,
         "tensor \"a\": 5 dimensions (at most 4 are supported)"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "tensor \"a\": shape[0] is negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,-2],\"data_offsets\":[0,16]}}", 16, TDM_EPROTO,
         "shape[1] is negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "shape[0] is not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"4\"],\"data_offsets\":[0,16]}}", 16, TDM_EPROTO,
         "shape[0] is not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}", 4, TDM_EPROTO,
         "shape[0] is too large"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
         "\"data_offsets\":[0,4]}}",
         4, TDM_EPROTO, "tensor \"a\": element count overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,8388608],\"data_offsets\":[0,4]}}", 4,
         TDM_EPROTO, "tensor \"a\": byte count overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}", 24, TDM_EPROTO,
         "tensor \"a\": shape and dtype F32 make 24 bytes but data_offsets span 20"},
        {"{\"a\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[0,2]}}", 2, TDM_EPROTO,
         "make 0 bytes but data_offsets span 2"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 4, TDM_EPROTO,
         "tensor \"a\": data_offsets [0, 8] out of range: the data area is 4 bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[5,5]}}", 4, TDM_EPROTO,
         "out of range"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[1e300,4]}}", 4, TDM_EPROTO,
         "out of range"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8, TDM_EPROTO,
         "tensor \"a\": data_offsets end 4 is before begin 8"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 8, TDM_EPROTO,
         "data_offsets[0] is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 8, TDM_EPROTO,
         "data_offsets is not a list of two integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 8, TDM_EPROTO,
         "data_offsets is not a list of two integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":{\"0\":4}}}", 8, TDM_EPROTO,
         "data_offsets is not a list of two integers"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,\"4\"]}}", 8, TDM_EPROTO,
         "data_offsets[1] is not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         16, TDM_EPROTO, "tensors \"a\" [0, 8) and \"b\" [4, 12) overlap"},
        {"{\"b\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         16, TDM_EPROTO, "overlap"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, TDM_EPROTO, "tensor \"a\" appears twice"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[2,6]}}", 8, TDM_EPROTO,
         "tensor \"a\": data at file offset"},
        {"{\"__metadata__\":[1],\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         TDM_EPROTO, "__metadata__ is not an object"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        // Data 8-aligned, like real writers, so only the intended fault shows.
        write_raw_padded(p, cases[i].header, cases[i].data_len);
        expect_open_error(p, cases[i].code, cases[i].msg);
    }

    // Valid edge cases: gaps between tensors, zero-size tensors at the end,
    // a scalar, metadata with strings.
    write_raw_padded(p,
                     "{\"__metadata__\":{\"format\":\"pt\"},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                     "\"z\":{\"dtype\":\"F16\",\"shape\":[0,3],\"data_offsets\":[16,16]},"
                     "\"s\":{\"dtype\":\"BF16\",\"shape\":[],\"data_offsets\":[0,2]}}",
                     16);
    struct tdm_safetensors *st;
    char err[256] = "";
    int rc = tdm_st_open(&st, p, err, sizeof(err));
    if (rc != TDM_OK)
        print_error("%s\n", err);
    assert_int_equal(rc, TDM_OK);
    assert_int_equal(tdm_st_count(st), 3);
    assert_string_equal(tdm_st_at(st, 0)->name, "s");
    assert_string_equal(tdm_st_at(st, 1)->name, "a");
    assert_string_equal(tdm_st_at(st, 2)->name, "z");
    tdm_st_free(st);
}

// ---- mutation loop -------------------------------------------------------------------------

static int open_and_touch(const char *path, uint64_t *sum)
{
    struct tdm_safetensors *st;
    char err[512];
    int rc = tdm_st_open(&st, path, err, sizeof(err));
    if (rc != TDM_OK) {
        assert_null(st);
        assert_true(err[0] != '\0'); // every failure says why
        return rc;
    }
    // Read every byte of every tensor: ASan catches a pointer past the mapping.
    for (size_t i = 0; i < tdm_st_count(st); i++) {
        const struct tdm_tensor *t = tdm_st_at(st, i);
        const uint8_t *d = t->data;
        for (size_t k = 0; k < t->nbytes; k++)
            *sum += d[k];
        assert_ptr_equal(tdm_st_find(st, t->name), t);
    }
    tdm_st_free(st);
    return rc;
}

static void test_mutations(void **state)
{
    (void)state;
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[4] = {1, 2, 3, 4};
    float c[1] = {7};
    struct tdm_tensor in[] = {
        {.name = "a", .dtype = TDM_DTYPE_F32, .ndim = 2, .shape = {2, 3}, .data = a, .nbytes = 24},
        {.name = "bb", .dtype = TDM_DTYPE_BF16, .ndim = 1, .shape = {4}, .data = b, .nbytes = 8},
        {.name = "c", .dtype = TDM_DTYPE_F32, .ndim = 0, .data = c, .nbytes = 4},
    };
    char err[256];
    const char *good = tpath("good.safetensors");
    assert_int_equal(tdm_st_write(good, in, 3, err, sizeof(err)), TDM_OK);
    char *orig;
    size_t len;
    assert_int_equal(tdm_read_file(good, &orig, &len, err, sizeof(err)), TDM_OK);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | (uint8_t)orig[i];

    const char *mp = tpath("mut.safetensors");
    char *buf = malloc(len + 16);
    assert_non_null(buf);
    uint64_t sum = 0;
    int variants = 0, opened = 0;
    static const char subst[] = {'0', '9', '-', '"',  '{',    '}',
                                 ',', ']', ' ', '\0', '\x7f', (char)0xff};

    // 1. every header byte replaced by each of a few JSON-significant bytes
    for (size_t pos = 8; pos < 8 + hlen; pos++) {
        for (size_t s = 0; s < sizeof(subst); s += (pos % 3) + 1) {
            if (orig[pos] == subst[s])
                continue;
            memcpy(buf, orig, len);
            buf[pos] = subst[s];
            write_bytes(mp, buf, len);
            opened += open_and_touch(mp, &sum) == TDM_OK;
            variants++;
        }
    }
    // 2. the length field: off by small amounts, bit flips, and each byte maxed
    int64_t deltas[] = {-9, -8, -1, 1, 2, 7, 8, 64, 1000};
    for (size_t d = 0; d < sizeof(deltas) / sizeof(deltas[0]); d++) {
        memcpy(buf, orig, len);
        uint64_t h = hlen + (uint64_t)deltas[d];
        for (int i = 0; i < 8; i++)
            buf[i] = (char)(h >> (8 * i));
        write_bytes(mp, buf, len);
        opened += open_and_touch(mp, &sum) == TDM_OK;
        variants++;
    }
    for (int bit = 0; bit < 64; bit++) {
        memcpy(buf, orig, len);
        buf[bit / 8] ^= (char)(1 << (bit % 8));
        write_bytes(mp, buf, len);
        opened += open_and_touch(mp, &sum) == TDM_OK;
        variants++;
    }
    // 3. truncations and extensions of the whole file
    for (size_t cut = 0; cut <= len + 8; cut += 3) {
        memcpy(buf, orig, len);
        memset(buf + len, 0, 16);
        write_bytes(mp, buf, cut);
        opened += open_and_touch(mp, &sum) == TDM_OK;
        variants++;
    }
    // 4. digits in the header changed to other digits (offsets and shapes shift)
    for (size_t pos = 8; pos < 8 + hlen; pos++) {
        if (orig[pos] < '0' || orig[pos] > '9')
            continue;
        for (char dgt = '0'; dgt <= '9'; dgt++) {
            if (dgt == orig[pos])
                continue;
            memcpy(buf, orig, len);
            buf[pos] = dgt;
            write_bytes(mp, buf, len);
            opened += open_and_touch(mp, &sum) == TDM_OK;
            variants++;
        }
    }
    // 5. deterministic pseudo-random multi-byte corruption (LCG)
    uint32_t seed = 12345;
    for (int r = 0; r < 300; r++) {
        memcpy(buf, orig, len);
        int flips = 1 + r % 4;
        for (int f = 0; f < flips; f++) {
            seed = seed * 1103515245u + 12345u;
            size_t pos = (seed >> 8) % (8 + hlen);
            seed = seed * 1103515245u + 12345u;
            buf[pos] = (char)(seed >> 16);
        }
        write_bytes(mp, buf, len);
        opened += open_and_touch(mp, &sum) == TDM_OK;
        variants++;
    }
    print_message("mutations: %d variants, %d opened cleanly, %d rejected\n", variants, opened,
                  variants - opened);
    assert_true(variants >= 500);
    assert_true(opened > 0);              // some mutations hit only padding or digits in data
    assert_true(variants - opened > 100); // most are caught
    free(buf);
    free(orig);
}

// Many tensors (Llama 3 70B has 723, 405B 1137; use 8000): every one is found
// by name, and lookups stay O(1) on average.
static void test_find_many(void **state)
{
    (void)state;
    enum { N = 8000 };
    struct tdm_tensor *t = calloc(N, sizeof(*t));
    char(*names)[48] = calloc(N, sizeof(*names));
    float *vals = calloc(N, sizeof(float));
    assert_non_null(t);
    assert_non_null(names);
    assert_non_null(vals);
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof(names[i]), "model.layers.%d.mlp.w%d.weight", i / 10, i % 10);
        vals[i] = (float)i;
        t[i] = (struct tdm_tensor){.name = names[i],
                                   .dtype = TDM_DTYPE_F32,
                                   .ndim = 1,
                                   .shape = {1},
                                   .data = &vals[i],
                                   .nbytes = 4};
    }
    char err[256];
    const char *p = tpath("many.safetensors");
    assert_int_equal(tdm_st_write(p, t, N, err, sizeof(err)), TDM_OK);
    double t0 = tdm_now();
    struct tdm_safetensors *st;
    assert_int_equal(tdm_st_open(&st, p, err, sizeof(err)), TDM_OK);
    double t1 = tdm_now();
    assert_int_equal(tdm_st_count(st), N);
    int rounds = 20;
    for (int r = 0; r < rounds; r++) {
        for (int i = 0; i < N; i++) {
            const struct tdm_tensor *f = tdm_st_find(st, names[i]);
            assert_non_null(f);
            assert_true(*(const float *)f->data == (float)i);
        }
    }
    double t2 = tdm_now();
    assert_null(tdm_st_find(st, "model.layers.0.mlp.w10.weight"));
    print_message("find_many: open %d tensors %.2f ms, %.0f ns per lookup\n", N, (t1 - t0) * 1e3,
                  (t2 - t1) * 1e9 / ((double)rounds * N));
    tdm_st_free(st);
    free(vals);
    free(names);
    free(t);
}

int main(void)
{
    // clang-format off
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_name_escapes),
        cmocka_unit_test(test_get_message),
        cmocka_unit_test(test_write_errors),
        cmocka_unit_test(test_sharded),
        cmocka_unit_test(test_sharded_errors),
        cmocka_unit_test(test_bad_files),
        cmocka_unit_test(test_mutations),
        cmocka_unit_test(test_find_many),
    };
    // clang-format on
    return cmocka_run_group_tests(tests, setup_dir, remove_dir);
}
