// SPDX-License-Identifier: Apache-2.0
// hub: turns a `--model` argument into a local model folder. A path to an
// existing folder is returned as is; anything else is a Hugging Face model id
// (`org/name` or `name`) fetched into the cache layout huggingface_hub uses, so
// caches are shared both ways with Python tools:
//
//   $HF_HUB_CACHE (default $HF_HOME/hub, HF_HOME default ~/.cache/huggingface)
//     models--ORG--NAME/
//       blobs/<etag>                    file contents (etag = sha256 for LFS files)
//       blobs/<etag>.incomplete         a download in progress (resumed with Range)
//       snapshots/<commit>/<file>       relative symlink to ../../blobs/<etag>
//       refs/<revision>                 the commit a branch/tag pointed to
//       .no_exist/<commit>/<file>       empty marker: the file is not in the repo
//     .locks/models--ORG--NAME/<etag>.lock   flock held while a blob is written
//
// A snapshot that already holds every needed file is used without touching the
// network (whoever wrote it). The needed files are config.json, tokenizer.json,
// tokenizer_config.json and the weights (model.safetensors, or
// model.safetensors.index.json and every shard it names); generation_config.json
// is fetched when present in the repo. Environment: HF_HOME, HF_HUB_CACHE,
// HF_ENDPOINT, HF_TOKEN (else the file $HF_TOKEN_PATH or $HF_HOME/token),
// HF_HUB_OFFLINE. See docs/models.md.
#ifndef TDM_HUB_H
#define TDM_HUB_H

#include <stdbool.h>
#include <stddef.h>

enum tdm_hub_progress {
    TDM_HUB_PROGRESS_AUTO = 0, // a bar when stderr is a terminal, else one log line per file
    TDM_HUB_PROGRESS_LOG,      // one INFO log line per downloaded file
    TDM_HUB_PROGRESS_BAR,      // always draw the bar on stderr
    TDM_HUB_PROGRESS_QUIET,    // nothing
};

// Options; a zeroed struct (or NULL) means "from the environment, else defaults".
struct tdm_hub_opts {
    const char *cache_dir; // hub cache folder (holds models--*); NULL = $HF_HUB_CACHE,
                           // else $HF_HOME/hub, else ~/.cache/huggingface/hub
    const char *endpoint;  // NULL = $HF_ENDPOINT, else https://huggingface.co
    const char *token;     // NULL = $HF_TOKEN, else the token file; "" = send no token
    bool offline;          // true: never use the network; false: $HF_HUB_OFFLINE decides
    enum tdm_hub_progress progress;
    int max_retries;          // per file, on dropped connections and 5xx; 0 = 5, <0 = none
    double retry_base_s;      // first backoff, doubled per retry (capped at 10 s); 0 = 1 s
    double connect_timeout_s; // 0 = 10 s
    double stall_timeout_s;   // abort a transfer idle this long (then retried); 0 = 30 s
};

// Resolves `model` (a folder, or a model id) to a local folder written into
// path_out (NUL-terminated, no trailing '/'). revision: branch, tag or 40-hex
// commit; NULL = "main". opts may be NULL. Returns TDM_OK; TDM_EINVAL for a
// malformed id or a path that does not fit cap; TDM_ENOTFOUND for a repo, file
// or revision the Hub does not have (404), or a file missing from the cache when
// offline; TDM_EPROTO for a bad server answer (401/403 - err mentions HF_TOKEN -,
// size or sha256 mismatch, missing headers); TDM_ETRANSPORT when retries ran
// out; TDM_EIO for file system errors. err gets the detail. Thread-safe.
int tdm_hub_resolve_model(const char *model, const char *revision, struct tdm_hub_opts *opts,
                          char *path_out, size_t cap, char *err, size_t errlen);

// Checks a model id the way huggingface_hub does: `name` or `org/name`, each
// part of [A-Za-z0-9_.-], not starting or ending with '-' or '.', no "--" or
// "..", at most 96 characters. TDM_EINVAL with a message otherwise.
int tdm_hub_validate_id(const char *model, char *err, size_t errlen);

// Writes the hub cache folder that resolve would use for opts (see cache_dir).
int tdm_hub_cache_dir(const struct tdm_hub_opts *opts, char *out, size_t cap, char *err,
                      size_t errlen);

#endif
