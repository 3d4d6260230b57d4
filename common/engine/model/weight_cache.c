// SPDX-License-Identifier: Apache-2.0
// weight_cache: the packed-weight cache files (see weight_cache.h for the
// trust rules). File layout, all integers in host byte order (the byte order
// and pointer size are part of the identity, so a file never moves between
// machines that would read it differently):
//
//   struct file_header                      at 0
//   ident [ident_len] bytes                 the source description
//   struct file_entry [n_entries]           type, shape, span offsets/sizes
//   uint64 chunk_sum [n_chunks]             checksum of each 1 MiB data chunk
//   zero padding up to data_off (2 MiB aligned)
//   data: spans, each at a 4 KiB-aligned offset, zero gaps, to file_size
//
// header.meta_sum covers bytes [sizeof header, data_off) and header.header_sum
// the header itself (with header_sum zero), so no field is used before it has
// been checked. The checksum is a 4-lane multiply-rotate hash over 8-byte
// words (~10 GB/s per core): it detects truncation, zeroed or torn pages and
// bit flips, not tampering (the cache folder is the user's own).
#include "weight_cache.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core.h"

#define WC_MAGIC "TDMPACK"
#define WC_FORMAT 1
#define WC_BYTE_ORDER 0x01020304u
#define WC_ALIGN 4096u
#define WC_CHUNK ((size_t)1 << 20)
#define WC_STAGE ((size_t)2 << 20) // write unit and data_off alignment: one PMD
#define WC_SUFFIX ".tdmpack"

struct file_header {
    char magic[8];        // "TDMPACK\0"
    uint32_t format;      // WC_FORMAT
    uint32_t byte_order;  // WC_BYTE_ORDER as written
    uint64_t file_size;   // bytes of the whole file
    uint64_t data_off;    // first data byte, WC_ALIGN aligned
    uint32_t n_entries;
    uint32_t ident_len;   // bytes, no NUL
    uint64_t n_chunks;    // ceil((file_size - data_off) / WC_CHUNK)
    uint64_t meta_sum;    // checksum of [sizeof header, data_off)
    uint64_t header_sum;  // checksum of this header with header_sum = 0
};

struct file_entry {
    uint32_t type; // enum tdm_wtype
    int32_t rows, cols, nspans;
    uint64_t off[TDM_WCACHE_MAX_SPANS];   // from the start of the file
    uint64_t bytes[TDM_WCACHE_MAX_SPANS];
};

struct tdm_wcache {
    void *map;   // [file_size] read-only, shared
    size_t file_size;
    int n;
    struct tdm_wcache_entry *entries; // [n], pointers into map
};

// ---- checksum --------------------------------------------------------------------------
#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full

static uint64_t wc_sum(const void *data, size_t n)
{
    const uint8_t *p = data;
    uint64_t v[4] = {P1, P2, P1 ^ P2, ~P1};
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        for (int l = 0; l < 4; l++) {
            uint64_t w;
            memcpy(&w, p + i + 8 * l, 8);
            v[l] = tdm_rotl64(v[l] + w * P2, 31) * P1;
        }
    }
    uint64_t h =
        tdm_rotl64(v[0], 1) + tdm_rotl64(v[1], 7) + tdm_rotl64(v[2], 12) + tdm_rotl64(v[3], 18);
    for (; i < n; i++)
        h = tdm_rotl64(h ^ (p[i] * P1), 11) * P2;
    return tdm_fmix64(h ^ (uint64_t)n);
}

// ---- identity --------------------------------------------------------------------------
int tdm_wcache_folder(const char *dir, char *out, size_t outlen)
{
    const char *env;
    int n;
    if (dir != NULL) {
        if (dir[0] == '\0' || strcmp(dir, "off") == 0)
            return TDM_ENOTFOUND;
        n = snprintf(out, outlen, "%s", dir);
    } else if ((env = getenv("TANDEM_CACHE")) != NULL && env[0] != '\0') {
        if (strcmp(env, "off") == 0)
            return TDM_ENOTFOUND;
        n = snprintf(out, outlen, "%s/packed", env);
    } else if ((env = getenv("XDG_CACHE_HOME")) != NULL && env[0] == '/') {
        n = snprintf(out, outlen, "%s/tandem/packed", env);
    } else if ((env = getenv("HOME")) != NULL && env[0] == '/') {
        n = snprintf(out, outlen, "%s/.cache/tandem/packed", env);
    } else {
        return TDM_ENOTFOUND;
    }
    return n > 0 && (size_t)n < outlen ? TDM_OK : TDM_EINVAL;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool ends_with(const char *s, const char *suffix)
{
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

// Appends "name size mtime_ns ino dev;" of dir/name (stat follows the HF
// cache's symlinks to the blobs) to id->ident at *len.
static int ident_add_file(struct tdm_wcache_id *id, size_t *len, const char *dir,
                          const char *name, char *err, size_t errlen)
{
    char path[PATH_MAX];
    struct stat sb;
    int n = snprintf(path, sizeof path, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= sizeof path)
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: path too long: %s/%s", dir,
                          name);
    if (stat(path, &sb) != 0)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND, "weight cache: %s: %s", path,
                          strerror(errno));
    n = snprintf(id->ident + *len, sizeof id->ident - *len, "%s %lld %lld.%09ld %llu %llu;", name,
                 (long long)sb.st_size, (long long)sb.st_mtim.tv_sec, (long)sb.st_mtim.tv_nsec,
                 (unsigned long long)sb.st_ino, (unsigned long long)sb.st_dev);
    if (n < 0 || (size_t)n >= sizeof id->ident - *len)
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: %s has too many files", dir);
    *len += (size_t)n;
    return TDM_OK;
}

int tdm_wcache_id_init(struct tdm_wcache_id *id, const char *folder, const char *model_dir,
                       const char *backend, uint32_t layout_version, const char *mode, char *err,
                       size_t errlen)
{
    char real[PATH_MAX];
    char **names = NULL;
    size_t n_names = 0, cap = 0;
    DIR *d = NULL;
    int rc;
    memset(id, 0, sizeof *id);
    if (realpath(model_dir, real) == NULL)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND, "weight cache: %s: %s", model_dir,
                          strerror(errno));
    int n = snprintf(id->folder, sizeof id->folder, "%s", folder);
    if (n < 0 || (size_t)n >= sizeof id->folder)
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: folder name too long");
    n = snprintf(id->ident, sizeof id->ident,
                 "tandem packed weights; backend=%s layout=%u mode=%s order=%08x ptr=%zu; dir=%s; ",
                 backend, layout_version, mode, WC_BYTE_ORDER, sizeof(void *), real);
    if (n < 0 || (size_t)n >= sizeof id->ident)
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: model path too long");
    size_t len = (size_t)n;
    // The prefix groups every version of this folder's entries (pruned on write).
    char group[PATH_MAX + 64];
    snprintf(group, sizeof group, "%s|%s|%u|%s", real, backend, layout_version, mode);
    const char *base = strrchr(real, '/');
    base = base && base[1] ? base + 1 : "model";
    char safe[16];
    size_t k = 0;
    for (; base[k] && k < sizeof safe - 1; k++) {
        char c = base[k];
        safe[k] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                          c == '.' || c == '_'
                      ? c
                      : '-';
    }
    safe[k] = '\0';
    snprintf(id->prefix, sizeof id->prefix, "%s-%s-%016llx-", safe, mode,
             (unsigned long long)wc_sum(group, strlen(group)));

    if ((rc = ident_add_file(id, &len, real, "config.json", err, errlen)) != TDM_OK)
        return rc;
    d = opendir(real);
    if (d == NULL)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND, "weight cache: %s: %s", real,
                          strerror(errno));
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (!ends_with(de->d_name, ".safetensors") &&
            !ends_with(de->d_name, ".safetensors.index.json"))
            continue;
        if (tdm_grow(&names, &cap, n_names + 1, sizeof *names, 16) != TDM_OK)
            goto fail_oom;
        if ((names[n_names] = strdup(de->d_name)) == NULL)
            goto fail_oom;
        n_names++;
    }
    closedir(d);
    d = NULL;
    if (n_names > 0)
        qsort(names, n_names, sizeof *names, cmp_names);
    rc = TDM_OK;
    for (size_t i = 0; i < n_names && rc == TDM_OK; i++)
        rc = ident_add_file(id, &len, real, names[i], err, errlen);
    for (size_t i = 0; i < n_names; i++)
        free(names[i]);
    free(names);
    if (rc != TDM_OK)
        return rc;
    n = snprintf(id->path, sizeof id->path, "%s/%s%016llx%s", id->folder, id->prefix,
                 (unsigned long long)wc_sum(id->ident, len), WC_SUFFIX);
    if (n < 0 || (size_t)n >= sizeof id->path)
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: folder name too long");
    return TDM_OK;

fail_oom:
    if (d)
        closedir(d);
    for (size_t i = 0; i < n_names; i++)
        free(names[i]);
    free(names);
    return tdm_seterr(err, errlen, TDM_ENOMEM, "weight cache: out of memory");
}

// ---- verification (parallel) -------------------------------------------------------------
struct verify_job {
    const uint8_t *data; // the data region
    size_t data_bytes;
    const uint8_t *sums; // uint64 [n_chunks] in the map, maybe unaligned: read with memcpy
    uint64_t n_chunks;
    atomic_ullong next;
    atomic_int bad; // 1 + index of a failing chunk, 0 when none so far
};

static void *verify_worker(void *arg)
{
    struct verify_job *j = arg;
    for (;;) {
        if (atomic_load_explicit(&j->bad, memory_order_relaxed))
            return NULL;
        uint64_t c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (c >= j->n_chunks)
            return NULL;
        size_t off = (size_t)c * WC_CHUNK;
        size_t len = j->data_bytes - off < WC_CHUNK ? j->data_bytes - off : WC_CHUNK;
        uint64_t want;
        memcpy(&want, j->sums + 8 * c, sizeof want);
        if (wc_sum(j->data + off, len) != want) {
            int zero = 0;
            atomic_compare_exchange_strong(&j->bad, &zero, (int)(c < INT_MAX - 1 ? c + 1 : 1));
        }
    }
}

// Checks every chunk on up to nthreads threads; returns 0 or 1 + a bad chunk.
static int verify_chunks(const uint8_t *data, size_t data_bytes, const uint8_t *sums,
                         uint64_t n_chunks, int nthreads)
{
    struct verify_job j = {.data = data, .data_bytes = data_bytes, .sums = sums,
                           .n_chunks = n_chunks};
    atomic_init(&j.next, 0);
    atomic_init(&j.bad, 0);
    pthread_t th[64];
    int started = 0;
    if (nthreads > 65)
        nthreads = 65;
    for (int i = 1; i < nthreads; i++)
        if (pthread_create(&th[started], NULL, verify_worker, &j) == 0)
            started++;
    verify_worker(&j);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    return atomic_load(&j.bad);
}

// ---- huge mappings ---------------------------------------------------------------------
// Bytes of the mapping that starts at addr mapped with PMD-sized (2 MiB)
// page-cache folios: its FilePmdMapped line in /proc/self/smaps. -1 when
// that is not known (no /proc, another kernel).
static long long pmd_mapped_bytes(const void *addr)
{
    FILE *f = fopen("/proc/self/smaps", "re");
    if (f == NULL)
        return -1;
    char line[PATH_MAX + 128]; // a mapping's line ends with its path
    bool mine = false;
    long long kb = -1;
    while (fgets(line, sizeof line, f) != NULL) {
        unsigned long long lo, hi;
        if (sscanf(line, "%llx-%llx ", &lo, &hi) == 2)
            mine = lo == (unsigned long long)(uintptr_t)addr; // a mapping's first line
        else if (mine && sscanf(line, "FilePmdMapped: %lld kB", &kb) == 1)
            break;
    }
    fclose(f);
    return kb < 0 ? -1 : kb * 1024;
}

// Whether c's map should be read again from disk to get 2 MiB folios: some
// of its data is PMD-mapped (the page cache has large folios here) but under
// 15/16 of what could be. A page cache left partly in small folios decoded
// batch 1 ~7% slower (744 of 990 MB PMD-mapped: 81.8 against 76.3 ms/step
// without the cache, medians, one thread; docs/cpu-backend.md); a map with no
// PMD mapping at all is a filesystem or kernel without large folios, which a
// re-read would not change.
static bool wants_reread(const struct tdm_wcache *c, uint64_t data_off, long long pmd)
{
    uint64_t huge = (c->file_size & ~(WC_STAGE - 1)) - data_off; // the data's whole 2 MiB pieces
    return pmd > 0 && (uint64_t)pmd < huge - huge / 16;
}

// ---- open ------------------------------------------------------------------------------
static uint64_t header_sum(const struct file_header *h)
{
    struct file_header c = *h;
    c.header_sum = 0;
    return wc_sum(&c, sizeof c);
}

// Reads and checks fd's header against the file's size (never through a map:
// a file shorter than its header or than it says it is raises no SIGBUS).
static int read_header(int fd, const struct tdm_wcache_id *id, struct file_header *h, char *err,
                       size_t errlen)
{
    struct stat sb;
    if (fstat(fd, &sb) != 0)
        return tdm_seterr(err, errlen, TDM_EIO, "weight cache: %s: %s", id->path, strerror(errno));
    if (sb.st_size < (off_t)sizeof *h || pread(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h)
        return tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %s: truncated header", id->path);
    if (memcmp(h->magic, WC_MAGIC, sizeof WC_MAGIC) != 0 || h->format != WC_FORMAT ||
        h->byte_order != WC_BYTE_ORDER || header_sum(h) != h->header_sum)
        return tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %s: bad header", id->path);
    if (h->file_size != (uint64_t)sb.st_size)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "weight cache: %s: %lld bytes, its header says %llu (truncated?)",
                          id->path, (long long)sb.st_size, (unsigned long long)h->file_size);
    uint64_t meta = sizeof *h + (uint64_t)h->ident_len +
                    (uint64_t)h->n_entries * sizeof(struct file_entry) + h->n_chunks * 8;
    if (h->data_off % WC_ALIGN != 0 || h->data_off < meta || h->data_off > h->file_size ||
        h->n_entries > (1u << 20) || h->ident_len > sizeof id->ident ||
        h->n_chunks != (h->file_size - h->data_off + WC_CHUNK - 1) / WC_CHUNK)
        return tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %s: inconsistent header",
                          id->path);
    return TDM_OK;
}

// c's entries from the mapped table tab, each span checked to lie in the
// data region.
static int read_entries(struct tdm_wcache *c, const struct file_header *h, const uint8_t *tab,
                        const struct tdm_wcache_id *id, char *err, size_t errlen)
{
    const uint8_t *base = c->map;
    c->n = (int)h->n_entries;
    c->entries = calloc(h->n_entries ? h->n_entries : 1, sizeof *c->entries);
    if (c->entries == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "weight cache: out of memory");
    for (int i = 0; i < c->n; i++) {
        struct file_entry fe;
        memcpy(&fe, tab + (size_t)i * sizeof fe, sizeof fe);
        struct tdm_wcache_entry *e = &c->entries[i];
        if (fe.nspans < 1 || fe.nspans > TDM_WCACHE_MAX_SPANS)
            return tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %s: entry %d has %d spans",
                              id->path, i, fe.nspans);
        e->type = (enum tdm_wtype)fe.type;
        e->rows = fe.rows;
        e->cols = fe.cols;
        e->nspans = fe.nspans;
        for (int s = 0; s < fe.nspans; s++) {
            if (fe.off[s] < h->data_off || fe.off[s] % 64 != 0 || fe.bytes[s] > h->file_size ||
                fe.off[s] > h->file_size - fe.bytes[s])
                return tdm_seterr(err, errlen, TDM_EPROTO,
                                  "weight cache: %s: entry %d span %d outside the file", id->path,
                                  i, s);
            e->ptr[s] = base + fe.off[s];
            e->bytes[s] = (size_t)fe.bytes[s];
        }
    }
    return TDM_OK;
}

int tdm_wcache_open(struct tdm_wcache **out, const struct tdm_wcache_id *id, int nthreads,
                    char *err, size_t errlen)
{
    struct tdm_wcache *c = NULL;
    struct file_header h;
    int rc;
    *out = NULL;
    int fd = open(id->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        if (errno == ENOENT)
            return tdm_seterr(err, errlen, TDM_ENOTFOUND, "weight cache: no entry %s", id->path);
        return tdm_seterr(err, errlen, TDM_EIO, "weight cache: %s: %s", id->path,
                          strerror(errno));
    }
    if ((rc = read_header(fd, id, &h, err, errlen)) != TDM_OK)
        goto fail;
    c = calloc(1, sizeof *c);
    if (c == NULL) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "weight cache: out of memory");
        goto fail;
    }
    c->file_size = (size_t)h.file_size;
    c->map = mmap(NULL, c->file_size, PROT_READ, MAP_SHARED, fd, 0);
    if (c->map == MAP_FAILED) {
        c->map = NULL;
        rc = tdm_seterr(err, errlen, TDM_EIO, "weight cache: mmap %s: %s", id->path,
                        strerror(errno));
        goto fail;
    }
#ifdef MADV_HUGEPAGE
    // Huge mappings of the page cache's 2 MiB folios, and (for a file read
    // back from disk) PMD-sized readahead on the verification's faults.
    // MADV_WILLNEED is not used: its readahead ignores the mapping's huge
    // hint and fills the page cache with small folios.
    (void)madvise(c->map, c->file_size, MADV_HUGEPAGE);
#endif
    const uint8_t *base = c->map;
    if (wc_sum(base + sizeof h, (size_t)h.data_off - sizeof h) != h.meta_sum) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "weight cache: %s: bad table checksum",
                        id->path);
        goto fail;
    }
    size_t ident_len = strlen(id->ident);
    if (h.ident_len != ident_len || memcmp(base + sizeof h, id->ident, ident_len) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO,
                        "weight cache: %s was built from another checkpoint (stale)", id->path);
        goto fail;
    }
    const uint8_t *tab = base + sizeof h + h.ident_len;
    if ((rc = read_entries(c, &h, tab, id, err, errlen)) != TDM_OK)
        goto fail;
    int bad = verify_chunks(base + h.data_off, (size_t)(h.file_size - h.data_off),
                            tab + (size_t)c->n * sizeof(struct file_entry),
                            h.n_chunks, nthreads);
    long long pmd = pmd_mapped_bytes(c->map);
    if (!bad && wants_reread(c, h.data_off, pmd)) {
        // The data's page tables go (MAP_SHARED: the pages stay cached),
        // the pages no other process maps leave the page cache, and the
        // second verification faults them back through the MADV_HUGEPAGE
        // mapping, whose readahead builds 2 MiB folios. The table (before
        // data_off) stays as checked. Advice only: pages that stay (another
        // process maps them) hold the same data.
        (void)madvise((uint8_t *)c->map + h.data_off, c->file_size - h.data_off, MADV_DONTNEED);
        (void)posix_fadvise(fd, (off_t)h.data_off, 0, POSIX_FADV_DONTNEED);
        bad = verify_chunks(base + h.data_off, (size_t)(h.file_size - h.data_off),
                            tab + (size_t)c->n * sizeof(struct file_entry), h.n_chunks, nthreads);
        TDM_LOG_INFO("model",
                     "weight cache: %s had %.0f of %.0f MB mapped with 2 MiB pages; read "
                     "again from disk: %.0f MB",
                     id->path, pmd / 1e6, c->file_size / 1e6, pmd_mapped_bytes(c->map) / 1e6);
    }
    if (bad) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO,
                        "weight cache: %s: checksum of data chunk %d does not match (corrupt)",
                        id->path, bad - 1);
        goto fail;
    }
    close(fd);
    *out = c;
    return TDM_OK;

fail:
    if (fd >= 0)
        close(fd);
    tdm_wcache_free(c);
    return rc;
}

int tdm_wcache_count(const struct tdm_wcache *c)
{
    return c->n;
}

const struct tdm_wcache_entry *tdm_wcache_get(const struct tdm_wcache *c, int i)
{
    return i >= 0 && i < c->n ? &c->entries[i] : NULL;
}

size_t tdm_wcache_file_bytes(const struct tdm_wcache *c)
{
    return c->file_size;
}

void tdm_wcache_free(struct tdm_wcache *c)
{
    if (c == NULL)
        return;
    if (c->map != NULL)
        munmap(c->map, c->file_size);
    free(c->entries);
    free(c);
}

// ---- write -----------------------------------------------------------------------------
static int pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
    const uint8_t *p = buf;
    while (n > 0) {
        size_t step = n < ((size_t)1 << 30) ? n : ((size_t)1 << 30);
        ssize_t w = pwrite(fd, p, step, (off_t)off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

static uint64_t align_up(uint64_t x, uint64_t a)
{
    return (x + a - 1) / a * a;
}

// Removes the entries with id->prefix other than id->path, and their temp
// files whose writer process is gone (killed while writing); leaves
// everything else in the folder alone.
static void prune(const struct tdm_wcache_id *id)
{
    DIR *d = opendir(id->folder);
    if (d == NULL)
        return;
    const char *mine = strrchr(id->path, '/') + 1;
    size_t plen = strlen(id->prefix);
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (strncmp(de->d_name, id->prefix, plen) != 0 || strcmp(de->d_name, mine) == 0)
            continue;
        const char *tmp = strstr(de->d_name, WC_SUFFIX ".tmp.");
        if (tmp != NULL) {
            long pid = strtol(tmp + strlen(WC_SUFFIX ".tmp."), NULL, 10);
            if (pid <= 0 || pid == (long)getpid() || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
                continue;
        } else if (!ends_with(de->d_name, WC_SUFFIX)) {
            continue;
        }
        char path[sizeof id->folder + 256];
        snprintf(path, sizeof path, "%s/%s", id->folder, de->d_name);
        if (unlink(path) == 0)
            TDM_LOG_INFO("model", "weight cache: removed the stale entry %s", path);
    }
    closedir(d);
}

// The file's entry table for entries, span offsets relative to the data
// region (4 KiB-aligned, in order); sets *data_bytes to the region's size.
static int layout_entries(const struct tdm_wcache_entry *entries, int n, struct file_entry *fe,
                          uint64_t *data_bytes, char *err, size_t errlen)
{
    uint64_t bytes = 0;
    for (int i = 0; i < n; i++) {
        const struct tdm_wcache_entry *e = &entries[i];
        if (e->nspans < 1 || e->nspans > TDM_WCACHE_MAX_SPANS)
            return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: entry %d has %d spans", i,
                              e->nspans);
        fe[i].type = (uint32_t)e->type;
        fe[i].rows = e->rows;
        fe[i].cols = e->cols;
        fe[i].nspans = e->nspans;
        for (int s = 0; s < e->nspans; s++) {
            bytes = align_up(bytes, WC_ALIGN);
            fe[i].off[s] = bytes;
            fe[i].bytes[s] = e->bytes[s];
            bytes += e->bytes[s];
        }
    }
    *data_bytes = bytes;
    return TDM_OK;
}

// The header's layout fields (not its checksums) for n entries and
// data_bytes of data; shifts fe's offsets past data_off.
static void layout_header(struct file_header *h, const struct tdm_wcache_id *id,
                          struct file_entry *fe, int n, uint64_t data_bytes)
{
    memcpy(h->magic, WC_MAGIC, sizeof WC_MAGIC);
    h->format = WC_FORMAT;
    h->byte_order = WC_BYTE_ORDER;
    h->n_entries = (uint32_t)n;
    h->ident_len = (uint32_t)strlen(id->ident);
    h->n_chunks = (data_bytes + WC_CHUNK - 1) / WC_CHUNK;
    size_t meta_len = (size_t)h->ident_len + (size_t)n * sizeof *fe + (size_t)h->n_chunks * 8;
    h->data_off = align_up(sizeof *h + meta_len, WC_STAGE);
    h->file_size = h->data_off + data_bytes;
    for (int i = 0; i < n; i++)
        for (int s = 0; s < fe[i].nspans; s++)
            fe[i].off[s] += h->data_off;
}

// Writes the data region in WC_STAGE pieces through stage ([WC_STAGE]) and
// takes each chunk's checksum into sums; -1 (errno set) when a write fails.
//
// The pieces sit at WC_STAGE-aligned file offsets (spans copied into the
// zeroed staging buffer, gaps included), so the page cache builds 2 MiB folios
// that a read-only map of the file gets as PMD mappings: decode then streams
// the weights at the speed of anonymous huge pages. Written 4 KiB-aligned span
// by span instead, a third of the file was mapped with 4 KiB pages and
// streamed at ~0.6x.
static int write_data(int fd, const struct tdm_wcache_entry *entries, const struct file_entry *fe,
                      int n, const struct file_header *h, uint64_t data_bytes, uint8_t *stage,
                      uint64_t *sums)
{
    int si = 0, ss = 0; // first span that may still overlap the piece
    for (uint64_t p0 = 0; p0 < data_bytes; p0 += WC_STAGE) {
        uint64_t p1 = data_bytes - p0 < WC_STAGE ? data_bytes : p0 + WC_STAGE;
        memset(stage, 0, (size_t)(p1 - p0));
        for (int i = si, s0 = ss; i < n; i++, s0 = 0) {
            bool past = false;
            for (int sp = s0; sp < fe[i].nspans; sp++) {
                uint64_t a = fe[i].off[sp] - h->data_off, b = a + fe[i].bytes[sp];
                if (a >= p1) {
                    past = true;
                    break;
                }
                if (b <= p0) { // wholly before this piece: never needed again
                    si = i;
                    ss = sp + 1;
                    continue;
                }
                uint64_t lo = a > p0 ? a : p0, hi = b < p1 ? b : p1;
                memcpy(stage + (lo - p0), (const uint8_t *)entries[i].ptr[sp] + (lo - a),
                       (size_t)(hi - lo));
            }
            if (past)
                break;
        }
        for (uint64_t c0 = p0; c0 < p1; c0 += WC_CHUNK) {
            size_t len = p1 - c0 < WC_CHUNK ? (size_t)(p1 - c0) : WC_CHUNK;
            sums[c0 / WC_CHUNK] = wc_sum(stage + (c0 - p0), len);
        }
        if (pwrite_all(fd, stage, (size_t)(p1 - p0), h->data_off + p0) != 0)
            return -1;
    }
    return 0;
}

// Fills meta ([data_off - sizeof header]: ident, entry table, chunk sums,
// zero padding) and h's checksums, then writes both; -1 (errno set) when a
// write fails.
static int write_meta(int fd, const struct tdm_wcache_id *id, const struct file_entry *fe, int n,
                      const uint64_t *sums, uint8_t *meta, struct file_header *h)
{
    memcpy(meta, id->ident, h->ident_len);
    memcpy(meta + h->ident_len, fe, (size_t)n * sizeof *fe);
    memcpy(meta + h->ident_len + (size_t)n * sizeof *fe, sums, (size_t)h->n_chunks * 8);
    h->meta_sum = wc_sum(meta, (size_t)(h->data_off - sizeof *h));
    h->header_sum = header_sum(h);
    if (pwrite_all(fd, meta, (size_t)(h->data_off - sizeof *h), sizeof *h) != 0 ||
        pwrite_all(fd, h, sizeof *h, 0) != 0)
        return -1;
    return 0;
}

int tdm_wcache_write(const struct tdm_wcache_id *id, const struct tdm_wcache_entry *entries, int n,
                     char *err, size_t errlen)
{
    static atomic_uint seq;
    struct file_entry *fe = NULL;
    uint64_t *sums = NULL;
    uint8_t *meta = NULL, *stage = NULL;
    char tmp[sizeof id->path + 64];
    struct file_header h;
    uint64_t data_bytes = 0;
    int fd = -1, rc;
    tmp[0] = '\0';
    memset(&h, 0, sizeof h);
    if (n < 1 || n > (1 << 20))
        return tdm_seterr(err, errlen, TDM_EINVAL, "weight cache: %d entries", n);
    if ((rc = tdm_mkdir_p(id->folder, false, err, errlen)) != TDM_OK)
        return rc;
    fe = calloc((size_t)n, sizeof *fe);
    if (fe == NULL)
        goto fail_oom;
    if ((rc = layout_entries(entries, n, fe, &data_bytes, err, errlen)) != TDM_OK)
        goto fail;
    layout_header(&h, id, fe, n, data_bytes);

    snprintf(tmp, sizeof tmp, "%s.tmp.%ld.%u", id->path, (long)getpid(),
             atomic_fetch_add(&seq, 1));
    fd = open(tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "weight cache: %s: %s", tmp, strerror(errno));
        tmp[0] = '\0'; // not ours to remove
        goto fail;
    }
    // The chunk checksums are taken from the staging buffer.
    sums = calloc(h.n_chunks ? h.n_chunks : 1, sizeof *sums);
    stage = malloc(WC_STAGE);
    if (sums == NULL || stage == NULL)
        goto fail_oom;
    if (write_data(fd, entries, fe, n, &h, data_bytes, stage, sums) != 0)
        goto fail_io;
    meta = calloc(1, (size_t)(h.data_off - sizeof h));
    if (meta == NULL)
        goto fail_oom;
    if (write_meta(fd, id, fe, n, sums, meta, &h) != 0)
        goto fail_io;
    if (close(fd) != 0) {
        fd = -1;
        goto fail_io;
    }
    fd = -1;
    if (rename(tmp, id->path) != 0)
        goto fail_io;
    free(fe);
    free(sums);
    free(meta);
    free(stage);
    prune(id);
    return TDM_OK;

fail_io:
    rc = tdm_seterr(err, errlen, TDM_EIO, "weight cache: writing %s: %s", tmp, strerror(errno));
    goto fail;
fail_oom:
    rc = tdm_seterr(err, errlen, TDM_ENOMEM, "weight cache: out of memory");
fail:
    free(stage);
    if (fd >= 0)
        close(fd);
    if (tmp[0] != '\0')
        unlink(tmp);
    free(fe);
    free(sums);
    free(meta);
    return rc;
}
