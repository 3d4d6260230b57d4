// SPDX-License-Identifier: Apache-2.0
// safetensors: maps safetensors files read-only and indexes their tensors by
// name; writes new files. Layout: an 8-byte little-endian header length N, N
// bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
// "__metadata__": {...}}, then the data; offsets count from byte 8 + N.
//
// The header is untrusted. Before a tensor pointer is handed out we know: the
// header fits in the file, every data range lies inside the data area, ranges
// of different tensors do not overlap, shape x dtype size equals the range
// length (without overflow), the data is aligned to its element size, and every
// name is unique across all shards. Gaps between tensors are allowed.
//
// A folder's shards (model.safetensors.index.json) are each mapped once; the
// tensors of all shards live in one array (shard by shard, by offset within a
// shard) with an open-addressing hash table over it for tdm_st_find.
#include "hf.h"

#include "core.h"
#include "hf_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// The reference implementation refuses headers above 100 MB; so do we, which
// also bounds the JSON we hand to the parser.
#define ST_MAX_HEADER 100000000ull
// Offsets are JSON numbers (doubles): beyond 2^53 they are not exact.
#define ST_MAX_OFFSET 9007199254740992.0

struct st_file {
    char *path;
    void *map;   // whole file, PROT_READ
    size_t size; // bytes mapped
};

struct st_entry {
    struct tdm_tensor t; // first, so &entry->t is what tdm_st_at returns
    size_t file;         // index into files
    uint64_t begin;      // data_offsets[0], for ordering and overlap checks
};

struct tdm_safetensors {
    struct st_file *files;
    size_t nfiles;
    struct st_entry *entries;
    size_t n, cap;
    uint32_t *slots; // [nslots] entry index + 1; 0 = empty. nslots a power of two
    size_t nslots;
};

// ---- name hash ------------------------------------------------------------------------

static uint64_t name_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull; // FNV-1a
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

// Builds the table over all entries; a name seen twice is an error.
static int build_index(struct tdm_safetensors *st, char *err, size_t errlen)
{
    size_t want = 16;
    while (want < st->n * 2)
        want *= 2;
    st->slots = calloc(want, sizeof(*st->slots));
    if (!st->slots)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "safetensors: out of memory");
    st->nslots = want;
    for (size_t i = 0; i < st->n; i++) {
        const char *name = st->entries[i].t.name;
        size_t s = name_hash(name) & (want - 1);
        while (st->slots[s]) {
            const struct st_entry *o = &st->entries[st->slots[s] - 1];
            if (strcmp(o->t.name, name) == 0)
                return tdm_seterr(
                    err, errlen, TDM_EPROTO, "%s: tensor \"%s\" appears twice (also in %s)",
                    st->files[st->entries[i].file].path, name, st->files[o->file].path);
            s = (s + 1) & (want - 1);
        }
        st->slots[s] = (uint32_t)(i + 1);
    }
    return TDM_OK;
}

static const struct st_entry *find_entry(const struct tdm_safetensors *st, const char *name)
{
    if (!st || !name || !st->nslots)
        return NULL;
    size_t s = name_hash(name) & (st->nslots - 1);
    while (st->slots[s]) {
        const struct st_entry *e = &st->entries[st->slots[s] - 1];
        if (strcmp(e->t.name, name) == 0)
            return e;
        s = (s + 1) & (st->nslots - 1);
    }
    return NULL;
}

// ---- one file -------------------------------------------------------------------------

static int parse_dtype_name(const char *s, enum tdm_dtype *dt)
{
    if (strcmp(s, "F32") == 0)
        *dt = TDM_DTYPE_F32;
    else if (strcmp(s, "F16") == 0)
        *dt = TDM_DTYPE_F16;
    else if (strcmp(s, "BF16") == 0)
        *dt = TDM_DTYPE_BF16;
    else
        return -1;
    return 0;
}

static int cmp_entry_offset(const void *a, const void *b)
{
    const struct st_entry *x = a, *y = b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    // Same start: the empty one first, so a non-empty neighbour is compared next.
    if (x->t.nbytes != y->t.nbytes)
        return x->t.nbytes < y->t.nbytes ? -1 : 1;
    return strcmp(x->t.name, y->t.name);
}

static int grow_entries(struct tdm_safetensors *st, size_t extra)
{
    if (st->n + extra > UINT32_MAX / 2) // entries are counted in 32 bits
        return -1;
    int rc = tdm_grow(&st->entries, &st->cap, st->n + extra, sizeof *st->entries, 64);
    return rc == TDM_OK ? 0 : -1;
}

// Checks one header entry and appends it. Errors name the file and the tensor.
static int add_entry(struct tdm_safetensors *st, size_t fi, const cJSON *item, const uint8_t *data,
                     uint64_t data_len, char *err, size_t errlen)
{
    const char *path = st->files[fi].path;
    const char *name = item->string;
    if (!cJSON_IsObject(item))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": entry is not an object",
                          path, name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!dt || !shape || !offs)
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": missing \"%s\"", path, name,
                          !dt      ? "dtype"
                          : !shape ? "shape"
                                   : "data_offsets");
    if (!cJSON_IsString(dt))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": dtype is not a string", path,
                          name);
    enum tdm_dtype dtype;
    if (parse_dtype_name(dt->valuestring, &dtype))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "%s: tensor \"%s\": unsupported dtype \"%.20s\" (supported: F32, F16, "
                          "BF16)",
                          path, name, dt->valuestring);
    if (!cJSON_IsArray(shape))
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": shape is not a list", path,
                          name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > TDM_ST_MAX_DIMS)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "%s: tensor \"%s\": %d dimensions (at most %d are supported)", path, name,
                          ndim, TDM_ST_MAX_DIMS);
    int64_t dims[TDM_ST_MAX_DIMS] = {0};
    uint64_t count = 1;
    int k = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, shape)
    {
        if (!cJSON_IsNumber(d) || !isfinite(d->valuedouble) ||
            d->valuedouble != floor(d->valuedouble))
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "%s: tensor \"%s\": shape[%d] is not an integer", path, name, k);
        if (d->valuedouble < 0)
            return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": shape[%d] is negative",
                              path, name, k);
        if (d->valuedouble >= ST_MAX_OFFSET)
            return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": shape[%d] is too large",
                              path, name, k);
        uint64_t v = (uint64_t)d->valuedouble;
        if (v != 0 && count > UINT64_MAX / v)
            return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": element count overflows",
                              path, name);
        count *= v;
        dims[k++] = (int64_t)v;
    }
    uint64_t esize = tdm_dtype_size(dtype);
    if (count > UINT64_MAX / esize)
        return tdm_seterr(err, errlen, TDM_EPROTO, "%s: tensor \"%s\": byte count overflows", path,
                          name);
    uint64_t nbytes = count * esize;

    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: tensor \"%s\": data_offsets is not a list of two integers", path,
                          name);
    const cJSON *ob = cJSON_GetArrayItem(offs, 0), *oe = cJSON_GetArrayItem(offs, 1);
    for (int i = 0; i < 2; i++) {
        const cJSON *o = i ? oe : ob;
        if (!cJSON_IsNumber(o) || !isfinite(o->valuedouble) ||
            o->valuedouble != floor(o->valuedouble) || o->valuedouble < 0)
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "%s: tensor \"%s\": data_offsets[%d] is not a non-negative integer",
                              path, name, i);
        if (o->valuedouble > (double)data_len)
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "%s: tensor \"%s\": data_offsets [%.0f, %.0f] out of range: the data "
                              "area is %" PRIu64 " bytes",
                              path, name, ob->valuedouble, oe->valuedouble, data_len);
    }
    uint64_t begin = (uint64_t)ob->valuedouble, end = (uint64_t)oe->valuedouble;
    if (end < begin)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: tensor \"%s\": data_offsets end %" PRIu64
                          " is before begin %" PRIu64,
                          path, name, end, begin);
    if (end - begin != nbytes)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: tensor \"%s\": shape and dtype %s make %" PRIu64
                          " bytes but data_offsets span %" PRIu64,
                          path, name, tdm_dtype_name(dtype), nbytes, end - begin);
    const uint8_t *p = data + begin;
    if (nbytes && ((uintptr_t)p % esize) != 0)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: tensor \"%s\": data at file offset %zu is not aligned to %" PRIu64
                          " bytes",
                          path, name, (size_t)(p - (const uint8_t *)st->files[fi].map), esize);

    if (grow_entries(st, 1))
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    char *copy = strdup(name);
    if (!copy)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    struct st_entry *e = &st->entries[st->n++];
    memset(e, 0, sizeof(*e));
    e->t.name = copy;
    e->t.dtype = dtype;
    e->t.ndim = ndim;
    memcpy(e->t.shape, dims, sizeof(dims));
    e->t.data = p;
    e->t.nbytes = (size_t)nbytes;
    e->file = fi;
    e->begin = begin;
    return TDM_OK;
}

// Maps PATH and appends its tensors (sorted by offset, overlap-checked).
static int load_file(struct tdm_safetensors *st, const char *path, char *err, size_t errlen)
{
    int rc;
    struct st_file *files = realloc(st->files, (st->nfiles + 1) * sizeof(*files));
    if (!files)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    st->files = files;
    struct st_file *f = &st->files[st->nfiles];
    memset(f, 0, sizeof(*f));
    f->path = strdup(path);
    if (!f->path)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    st->nfiles++; // from here tdm_st_free releases f

    // O_NONBLOCK: a FIFO in place of a shard must fail below, not hang here.
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        int e = errno;
        return tdm_seterr(err, errlen, e == ENOENT ? TDM_ENOTFOUND : TDM_EIO, "%s: %s", path,
                          strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return tdm_seterr(err, errlen, TDM_EIO, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return tdm_seterr(err, errlen, TDM_EIO, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: %lld bytes is too short for a safetensors file (8-byte header "
                          "length missing)",
                          path, (long long)sb.st_size);
    }
    void *map = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return tdm_seterr(err, errlen, TDM_EIO, "%s: mmap: %s", path, strerror(map_errno));
    f->map = map;
    f->size = (size_t)sb.st_size;

    const uint8_t *bytes = map;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = (hlen << 8) | bytes[i];
    if (hlen > ST_MAX_HEADER)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: header length %" PRIu64 " is larger than the 100 MB limit", path,
                          hlen);
    if (hlen > f->size - 8)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "%s: header length %" PRIu64 " runs past the end of the %zu-byte file",
                          path, hlen, f->size);
    // cJSON gets a NUL-terminated private copy: no parser ever reads the mapping.
    char *text = malloc((size_t)hlen + 1);
    if (!text)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    memcpy(text, bytes + 8, (size_t)hlen);
    text[hlen] = '\0';
    char what[512];
    snprintf(what, sizeof(what), "%s: header", path);
    cJSON *root;
    rc = tdm_hf_json_object(what, text, (size_t)hlen, &root, err, errlen);
    free(text);
    if (rc)
        return rc;

    const uint8_t *data = bytes + 8 + hlen;
    uint64_t data_len = f->size - 8 - hlen;
    size_t first = st->n;
    const cJSON *item;
    cJSON_ArrayForEach(item, root)
    {
        if (!item->string) {
            rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: header entry without a name", path);
            goto fail_root;
        }
        if (strcmp(item->string, "__metadata__") == 0) {
            if (!cJSON_IsObject(item)) {
                rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: __metadata__ is not an object", path);
                goto fail_root;
            }
            continue;
        }
        if ((rc = add_entry(st, st->nfiles - 1, item, data, data_len, err, errlen)))
            goto fail_root;
    }
    cJSON_Delete(root);

    if (st->n > first)
        qsort(st->entries + first, st->n - first, sizeof(*st->entries), cmp_entry_offset);
    const struct st_entry *prev = NULL;
    for (size_t i = first; i < st->n; i++) {
        const struct st_entry *e = &st->entries[i];
        if (e->t.nbytes == 0)
            continue;
        if (prev && e->begin < prev->begin + prev->t.nbytes)
            return tdm_seterr(err, errlen, TDM_EPROTO,
                              "%s: tensors \"%s\" [%" PRIu64 ", %" PRIu64 ") and \"%s\" [%" PRIu64
                              ", %" PRIu64 ") overlap",
                              path, prev->t.name, prev->begin, prev->begin + prev->t.nbytes,
                              e->t.name, e->begin, e->begin + e->t.nbytes);
        prev = e;
    }
    return TDM_OK;

fail_root:
    cJSON_Delete(root);
    return rc;
}

// ---- sharded folders ----------------------------------------------------------------------

// A shard name from the untrusted index must stay inside the folder.
static bool shard_name_ok(const char *s)
{
    return s[0] != '\0' && strchr(s, '/') == NULL && strcmp(s, ".") != 0 && strcmp(s, "..") != 0;
}

static int load_index(struct tdm_safetensors *st, const char *index_path, char *err, size_t errlen)
{
    char *text = NULL, *dir = NULL;
    size_t len;
    const char **shards = NULL;
    size_t nshards = 0;
    cJSON *root = NULL;
    int rc = tdm_read_file(index_path, &text, &len, err, errlen);
    if (rc)
        return rc;
    rc = tdm_hf_json_object(index_path, text, len, &root, err, errlen);
    if (rc)
        goto out;
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(wm)) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: \"weight_map\" is missing or not an object",
                        index_path);
        goto out;
    }
    int nmap = cJSON_GetArraySize(wm);
    if (nmap == 0) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: weight_map is empty", index_path);
        goto out;
    }
    shards = calloc((size_t)nmap, sizeof(*shards));
    if (!shards) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", index_path);
        goto out;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, wm)
    {
        if (!cJSON_IsString(it) || !shard_name_ok(it->valuestring)) {
            rc = tdm_seterr(err, errlen, TDM_EPROTO,
                            "%s: tensor \"%s\" maps to an invalid shard file name", index_path,
                            it->string ? it->string : "");
            goto out;
        }
        // Shards are few (at most a few hundred): a linear scan keeps first-seen order.
        size_t j = 0;
        while (j < nshards && strcmp(shards[j], it->valuestring) != 0)
            j++;
        if (j == nshards)
            shards[nshards++] = it->valuestring;
    }

    // Shards live beside the index.
    dir = strdup(index_path);
    if (!dir) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", index_path);
        goto out;
    }
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        strcpy(dir, ".");
    for (size_t j = 0; j < nshards; j++) {
        char *p = tdm_path_join(dir, shards[j]);
        if (!p) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", index_path);
            goto out;
        }
        if (access(p, F_OK) != 0) {
            rc = tdm_seterr(err, errlen, TDM_ENOTFOUND, "%s: shard \"%s\" is missing (%s)",
                            index_path, shards[j], p);
            free(p);
            goto out;
        }
        rc = load_file(st, p, err, errlen);
        free(p);
        if (rc)
            goto out;
    }
    if ((rc = build_index(st, err, errlen)))
        goto out;
    // Every tensor the index promises must be in the shard it names.
    cJSON_ArrayForEach(it, wm)
    {
        const struct st_entry *e = find_entry(st, it->string);
        const char *base = NULL;
        if (e) {
            base = strrchr(st->files[e->file].path, '/');
            base = base ? base + 1 : st->files[e->file].path;
        }
        if (!e || strcmp(base, it->valuestring) != 0) {
            rc = tdm_seterr(err, errlen, TDM_ENOTFOUND,
                            "%s: tensor \"%s\" is mapped to shard \"%s\", which lacks it",
                            index_path, it->string, it->valuestring);
            goto out;
        }
    }
out:
    free(dir);
    free(shards);
    cJSON_Delete(root);
    free(text);
    return rc;
}

// ---- public API -----------------------------------------------------------------------------

static bool ends_with(const char *s, const char *suffix)
{
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

static bool is_file(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

int tdm_st_open(struct tdm_safetensors **out, const char *path, char *err, size_t errlen)
{
    *out = NULL;
    struct tdm_safetensors *st = calloc(1, sizeof(*st));
    if (!st)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    int rc;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        int e = errno;
        rc = tdm_seterr(err, errlen, e == ENOENT ? TDM_ENOTFOUND : TDM_EIO, "%s: %s", path,
                        strerror(e));
        goto fail;
    }
    if (!S_ISDIR(sb.st_mode) && !S_ISREG(sb.st_mode)) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: not a regular file or folder", path);
        goto fail;
    }
    if (S_ISDIR(sb.st_mode)) {
        // transformers looks for the single file first, then the index.
        char *single = tdm_path_join(path, "model.safetensors");
        char *index = tdm_path_join(path, "model.safetensors.index.json");
        if (!single || !index) {
            free(single);
            free(index);
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
            goto fail;
        }
        if (is_file(single)) {
            rc = load_file(st, single, err, errlen);
            if (!rc)
                rc = build_index(st, err, errlen);
        } else if (is_file(index)) {
            rc = load_index(st, index, err, errlen);
        } else {
            rc = tdm_seterr(err, errlen, TDM_ENOTFOUND,
                            "%s: no model.safetensors or model.safetensors.index.json", path);
        }
        free(single);
        free(index);
    } else if (ends_with(path, ".json")) {
        rc = load_index(st, path, err, errlen);
    } else {
        rc = load_file(st, path, err, errlen);
        if (!rc)
            rc = build_index(st, err, errlen);
    }
    if (rc)
        goto fail;
    *out = st;
    return TDM_OK;
fail:
    tdm_st_free(st);
    return rc;
}

void tdm_st_free(struct tdm_safetensors *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->n; i++)
        free((char *)st->entries[i].t.name);
    free(st->entries);
    for (size_t i = 0; i < st->nfiles; i++) {
        if (st->files[i].map)
            munmap(st->files[i].map, st->files[i].size);
        free(st->files[i].path);
    }
    free(st->files);
    free(st->slots);
    free(st);
}

size_t tdm_st_count(const struct tdm_safetensors *st)
{
    return st ? st->n : 0;
}

const struct tdm_tensor *tdm_st_at(const struct tdm_safetensors *st, size_t i)
{
    return (st && i < st->n) ? &st->entries[i].t : NULL;
}

const struct tdm_tensor *tdm_st_find(const struct tdm_safetensors *st, const char *name)
{
    const struct st_entry *e = find_entry(st, name);
    return e ? &e->t : NULL;
}

static void format_shape(char *buf, size_t len, int ndim, const int64_t *shape)
{
    size_t at = 0;
    at += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%" PRId64, i ? ", " : "", shape[i]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
}

int tdm_st_get(const struct tdm_safetensors *st, const char *name, int ndim, const int64_t *shape,
               const struct tdm_tensor **out, char *err, size_t errlen)
{
    *out = NULL;
    const struct tdm_tensor *t = tdm_st_find(st, name);
    if (!t)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND, "%s: no such tensor", name ? name : "(null)");
    bool same = t->ndim == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = t->shape[i] == shape[i];
    if (!same) {
        char have[128], want[128];
        format_shape(have, sizeof(have), t->ndim, t->shape);
        format_shape(want, sizeof(want), ndim > TDM_ST_MAX_DIMS ? TDM_ST_MAX_DIMS : ndim, shape);
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: shape %s does not match the config's %s",
                          name, have, want);
    }
    *out = t;
    return TDM_OK;
}

// ---- writer -----------------------------------------------------------------------------------

static int cmp_name_ptr(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int check_write_args(const char *path, const struct tdm_tensor *tensors, size_t n, char *err,
                            size_t errlen)
{
    for (size_t i = 0; i < n; i++) {
        const struct tdm_tensor *t = &tensors[i];
        if (!t->name || !t->name[0] || strcmp(t->name, "__metadata__") == 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: tensor %zu has no usable name", path,
                              i);
        if (tdm_dtype_size(t->dtype) == 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: tensor \"%s\": bad dtype %d", path,
                              t->name, (int)t->dtype);
        if (t->ndim < 0 || t->ndim > TDM_ST_MAX_DIMS)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: tensor \"%s\": ndim %d", path, t->name,
                              t->ndim);
        uint64_t count = 1;
        for (int k = 0; k < t->ndim; k++) {
            if (t->shape[k] < 0)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "%s: tensor \"%s\": shape[%d] is negative", path, t->name, k);
            uint64_t v = (uint64_t)t->shape[k];
            if (v != 0 && count > UINT64_MAX / v)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "%s: tensor \"%s\": element count overflows", path, t->name);
            count *= v;
        }
        uint64_t esize = tdm_dtype_size(t->dtype);
        if (count > UINT64_MAX / esize || count * esize != (uint64_t)t->nbytes)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "%s: tensor \"%s\": nbytes %zu does not match shape and dtype", path,
                              t->name, t->nbytes);
        if (t->nbytes && !t->data)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: tensor \"%s\": no data", path, t->name);
    }
    if (n < 2)
        return TDM_OK;
    const char **names = malloc(n * sizeof(*names));
    if (!names)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++)
        names[i] = tensors[i].name;
    qsort(names, n, sizeof(*names), cmp_name_ptr);
    int rc = TDM_OK;
    for (size_t i = 1; i < n; i++) {
        if (strcmp(names[i - 1], names[i]) == 0) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s: tensor \"%s\" given twice", path,
                            names[i]);
            break;
        }
    }
    free(names);
    return rc;
}

int tdm_st_write(const char *path, const struct tdm_tensor *tensors, size_t n, char *err,
                 size_t errlen)
{
    int rc = check_write_args(path, tensors, n, err, errlen);
    if (rc)
        return rc;

    struct tdm_strbuf hdr = {0};
    tdm_strbuf_adds(&hdr, "{\"__metadata__\":{\"format\":\"pt\"}");
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_tensor *t = &tensors[i];
        char num[64];
        tdm_strbuf_add(&hdr, ",", 1);
        tdm_strbuf_add_json_string(&hdr, t->name, strlen(t->name), false);
        tdm_strbuf_adds(&hdr, ":{\"dtype\":\"");
        tdm_strbuf_adds(&hdr, tdm_dtype_name(t->dtype));
        tdm_strbuf_adds(&hdr, "\",\"shape\":[");
        for (int k = 0; k < t->ndim; k++) {
            snprintf(num, sizeof(num), "%s%" PRId64, k ? "," : "", t->shape[k]);
            tdm_strbuf_adds(&hdr, num);
        }
        snprintf(num, sizeof(num), "],\"data_offsets\":[%" PRIu64 ",%" PRIu64 "]}", off,
                 off + t->nbytes);
        tdm_strbuf_adds(&hdr, num);
        off += t->nbytes;
    }
    tdm_strbuf_add(&hdr, "}", 1);
    // Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    while (!hdr.failed && hdr.len % 8 != 0)
        tdm_strbuf_add(&hdr, " ", 1);
    if (hdr.failed) {
        tdm_strbuf_fini(&hdr);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    }

    // Write a temporary file beside PATH and rename it: readers never see half a file.
    size_t plen = strlen(path);
    char *tmp = malloc(plen + 16);
    if (!tmp) {
        tdm_strbuf_fini(&hdr);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    }
    snprintf(tmp, plen + 16, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(tmp);
    if (fd < 0) {
        int e = errno;
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: cannot create: %s", tmp, strerror(e));
        goto fail_tmp;
    }
    FILE *f = fdopen(fd, "wb");
    if (!f) {
        int e = errno;
        close(fd);
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: %s", tmp, strerror(e));
        goto fail_unlink;
    }
    uint8_t lenbytes[8];
    for (int i = 0; i < 8; i++)
        lenbytes[i] = (uint8_t)((uint64_t)hdr.len >> (8 * i));
    bool ok = fwrite(lenbytes, 1, 8, f) == 8 && fwrite(hdr.p, 1, hdr.len, f) == hdr.len;
    for (size_t i = 0; ok && i < n; i++)
        ok = tensors[i].nbytes == 0 ||
             fwrite(tensors[i].data, 1, tensors[i].nbytes, f) == tensors[i].nbytes;
    int e = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (!ok) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: write failed: %s", path, strerror(e));
        goto fail_unlink;
    }
    // mkstemp creates 0600; model files are meant to be readable like any other.
    chmod(tmp, 0644);
    if (rename(tmp, path) != 0) {
        e = errno;
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: rename: %s", path, strerror(e));
        goto fail_unlink;
    }
    free(tmp);
    tdm_strbuf_fini(&hdr);
    return TDM_OK;

fail_unlink:
    unlink(tmp);
fail_tmp:
    free(tmp);
    tdm_strbuf_fini(&hdr);
    return rc;
}
