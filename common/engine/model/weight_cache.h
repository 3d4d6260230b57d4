// SPDX-License-Identifier: Apache-2.0
// weight_cache (internal to the model module): the packed-weight cache. A
// backend that declares a layout_version (backend.h) has its prepared weights
// written, once, into one file per (model folder, backend, layout, weight
// mode) in a cache folder ($TANDEM_CACHE/packed, else
// $XDG_CACHE_HOME/tandem/packed, else ~/.cache/tandem/packed); the next start
// maps that file read-only and adopts the weights in place instead of
// repacking the checkpoint (docs/cpu-backend.md, "Cold start").
//
// Trust: an entry is used only when its header names exactly the source it was
// built from (the model folder's real path; config.json's and every
// *.safetensors file's size, mtime in ns, inode and device), the backend, its
// layout version, the weight mode and this machine's byte order and pointer
// size; and when its size matches the header and every 1 MiB chunk of data
// matches the checksum written with it (verified on all load threads, which
// also faults the pages in). A stale, truncated or corrupt entry is reported
// as TDM_EPROTO and rebuilt by the caller; nothing in a file is trusted before
// its checks.
//
// Writes are atomic: a temp file in the same folder, renamed over the entry
// (concurrent writers each rename a complete file; the last one wins; a
// process that has the old file mapped keeps it). After the rename the other
// entries of the same model folder, backend and mode are removed (a changed
// checkpoint leaves no stale gigabyte behind). No fsync: a file cut short by a
// crash fails its checksums on the next start and is rebuilt.
#ifndef TDM_WEIGHT_CACHE_H
#define TDM_WEIGHT_CACHE_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"

#define TDM_WCACHE_MAX_SPANS 2

// One prepared weight as raw memory (backend.h weight_spans / adopt_weight).
struct tdm_wcache_entry {
    enum tdm_wtype type;
    int rows, cols;
    int nspans;                             // 1..TDM_WCACHE_MAX_SPANS
    const void *ptr[TDM_WCACHE_MAX_SPANS];  // [bytes[i]], 64-byte aligned
    size_t bytes[TDM_WCACHE_MAX_SPANS];
};

// Where an entry lives and what it must have been built from.
struct tdm_wcache_id {
    char folder[2048]; // the cache folder
    char path[2560];   // folder/<prefix><key>.tdmpack
    char prefix[40];   // file-name prefix of every entry of this model folder, backend and mode
    char ident[8192];  // source description, stored in the file and compared verbatim
};

// Resolves the cache folder: `dir` when set ("off" or "": disabled), else
// $TANDEM_CACHE/packed ($TANDEM_CACHE=off disables), else
// $XDG_CACHE_HOME/tandem/packed, else $HOME/.cache/tandem/packed. TDM_OK,
// TDM_ENOTFOUND when disabled or no home is known, TDM_EINVAL when too long.
int tdm_wcache_folder(const char *dir, char *out, size_t outlen);

// Fills id for model_dir's checkpoint in folder. mode names the weight
// preparation ("bf16", "int8"). TDM_ENOTFOUND when model_dir or its
// config.json is missing, TDM_EINVAL when a path does not fit.
int tdm_wcache_id_init(struct tdm_wcache_id *id, const char *folder, const char *model_dir,
                       const char *backend, uint32_t layout_version, const char *mode, char *err,
                       size_t errlen);

struct tdm_wcache;

// Maps id->path read-only and verifies it (checksums on up to nthreads
// threads). When the verified map is only partly mapped with 2 MiB pages (the
// page cache held the entry partly in small folios), its data pages that no
// other process maps are dropped from the page cache and read again from disk,
// once (logged at INFO): decode streams the weights from this map.
// TDM_ENOTFOUND when there is no entry; TDM_EPROTO with err saying what is
// wrong when it is stale, truncated or corrupt; TDM_EIO, TDM_ENOMEM.
int tdm_wcache_open(struct tdm_wcache **out, const struct tdm_wcache_id *id, int nthreads,
                    char *err, size_t errlen);
// Entries in the order they were written; the memory stays mapped until
// tdm_wcache_free (weights adopted from them must be released first).
int tdm_wcache_count(const struct tdm_wcache *c);
const struct tdm_wcache_entry *tdm_wcache_get(const struct tdm_wcache *c, int i);
size_t tdm_wcache_file_bytes(const struct tdm_wcache *c);
void tdm_wcache_free(struct tdm_wcache *c);

// Writes entries[n] as id->path (temp file + rename; creates the folder),
// then removes the other entries with id->prefix. TDM_OK, or TDM_EIO /
// TDM_EINVAL with err (no partial entry is ever left under id->path).
int tdm_wcache_write(const struct tdm_wcache_id *id, const struct tdm_wcache_entry *entries, int n,
                     char *err, size_t errlen);

#endif
