// SPDX-License-Identifier: Apache-2.0
// hub: `--model` resolution and the huggingface_hub cache layout (see hub.h).
//
// Resolution is cache first: when refs/<revision> (or a commit given as the
// revision) names a snapshot holding every needed file, that snapshot is the
// answer and nothing touches the network - whoever wrote the cache. Otherwise
// (and unless offline) each needed file goes through hf_hub_download's steps:
// HEAD the resolve URL for commit, etag and size; write refs/<revision>; if
// blobs/<etag> is missing, download it under the flock huggingface_hub also
// uses (.locks/models--X/<etag>.lock) into blobs/<etag>.incomplete, check its
// size and (LFS etag = sha256) its hash, rename it into place; then point
// snapshots/<commit>/<file> at ../../blobs/<etag>. After the first HEAD the
// commit hash replaces the branch name in URLs, so every file comes from one
// commit even if the branch moves meanwhile. A 404 for an optional file leaves
// an empty .no_exist/<commit>/<file> marker, as huggingface_hub does.
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cJSON.h"
#include "core.h"
#include "hub_impl.h"

#define DEFAULT_ENDPOINT "https://huggingface.co"

// ---- small helpers -------------------------------------------------------------------

static bool env_true(const char *name)
{
    const char *v = getenv(name);
    if (!v)
        return false;
    return strcasecmp(v, "1") == 0 || strcasecmp(v, "on") == 0 || strcasecmp(v, "yes") == 0 ||
           strcasecmp(v, "true") == 0;
}

static const char *env_nonempty(const char *name)
{
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

static bool is_commit_hash(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!isxdigit((unsigned char)s[n]) || isupper((unsigned char)s[n]))
            return false;
    return n == 40;
}

static bool is_sha256_hex(const char *s)
{
    size_t n = 0;
    for (; s[n]; n++)
        if (!isxdigit((unsigned char)s[n]))
            return false;
    return n == 64;
}

static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return NULL;
    char *s = malloc((size_t)n + 1);
    if (!s)
        return NULL;
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    return s;
}

// A temporary name beside path, unique across processes (pid) and threads
// (counter), for write-then-rename.
static char *tmp_name(const char *path)
{
    static atomic_uint seq;
    return str_printf("%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&seq, 1));
}

// A file name the server gave us (index shards) must stay inside the snapshot.
static bool safe_relpath(const char *f)
{
    size_t n = strlen(f);
    if (n == 0 || n > 1024 || f[0] == '/' || f[n - 1] == '/')
        return false;
    for (const char *seg = f; *seg;) {
        const char *end = strchr(seg, '/');
        size_t len = end ? (size_t)(end - seg) : strlen(seg);
        if (len == 0 || (len == 1 && seg[0] == '.') || (len == 2 && seg[0] == '.' && seg[1] == '.'))
            return false;
        for (size_t i = 0; i < len; i++)
            if ((unsigned char)seg[i] < 0x20 || seg[i] == '\\')
                return false;
        seg += len + (end ? 1 : 0);
    }
    return true;
}

// An etag becomes a file name under blobs/.
static bool safe_etag(const char *e)
{
    if (!*e || strcmp(e, ".") == 0 || strcmp(e, "..") == 0 || strlen(e) > 128)
        return false;
    for (; *e; e++)
        if (!isalnum((unsigned char)*e) && *e != '-' && *e != '_' && *e != '.')
            return false;
    return true;
}

// Percent-encodes s for a URL path; '/' is kept when keep_slash.
static char *url_encode(const char *s, bool keep_slash)
{
    char *out = malloc(strlen(s) * 3 + 1), *o = out;
    if (!out)
        return NULL;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/'))
            *o++ = (char)c;
        else
            o += sprintf(o, "%%%02X", c);
    }
    *o = '\0';
    return out;
}

// ---- settings -----------------------------------------------------------------------------

static int hf_home(char *out, size_t cap, char *err, size_t errlen)
{
    const char *h = env_nonempty("HF_HOME");
    int n;
    if (h) {
        n = snprintf(out, cap, "%s", h);
    } else {
        const char *home = env_nonempty("HOME");
        if (!home)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "neither HF_HOME nor HOME is set: cannot place the model cache");
        const char *xdg = env_nonempty("XDG_CACHE_HOME");
        n = xdg ? snprintf(out, cap, "%s/huggingface", xdg)
                : snprintf(out, cap, "%s/.cache/huggingface", home);
    }
    if (n < 0 || (size_t)n >= cap)
        return tdm_seterr(err, errlen, TDM_EINVAL, "HF_HOME path too long");
    return TDM_OK;
}

int tdm_hub_cache_dir(const struct tdm_hub_opts *opts, char *out, size_t cap, char *err,
                      size_t errlen)
{
    const char *dir = opts && opts->cache_dir && *opts->cache_dir ? opts->cache_dir
                                                                  : env_nonempty("HF_HUB_CACHE");
    if (!dir)
        dir = env_nonempty("HUGGINGFACE_HUB_CACHE"); // the older name huggingface_hub still reads
    int n;
    if (dir) {
        n = snprintf(out, cap, "%s", dir);
    } else {
        char home[4096];
        int rc = hf_home(home, sizeof home, err, errlen);
        if (rc != TDM_OK)
            return rc;
        n = snprintf(out, cap, "%s/hub", home);
    }
    if (n < 0 || (size_t)n >= cap)
        return tdm_seterr(err, errlen, TDM_EINVAL, "cache path does not fit %zu bytes", cap);
    while (n > 1 && out[n - 1] == '/')
        out[--n] = '\0';
    return TDM_OK;
}

// HF_TOKEN, else the token file huggingface_hub's `hf auth login` writes.
static char *find_token(const struct tdm_hub_opts *opts)
{
    if (opts && opts->token)
        return *opts->token ? strdup(opts->token) : NULL;
    const char *t = env_nonempty("HF_TOKEN");
    if (!t)
        t = env_nonempty("HUGGING_FACE_HUB_TOKEN"); // the older name
    if (t)
        return strdup(t);
    char path[4200], home[4096];
    const char *tp = env_nonempty("HF_TOKEN_PATH");
    if (tp)
        snprintf(path, sizeof path, "%s", tp);
    else if (hf_home(home, sizeof home, NULL, 0) == TDM_OK)
        snprintf(path, sizeof path, "%s/token", home);
    else
        return NULL;
    char *buf = NULL;
    size_t len = 0;
    if (tdm_read_file(path, &buf, &len, NULL, 0) != TDM_OK)
        return NULL;
    while (len > 0 && isspace((unsigned char)buf[len - 1]))
        buf[--len] = '\0';
    size_t skip = 0;
    while (buf[skip] && isspace((unsigned char)buf[skip]))
        skip++;
    memmove(buf, buf + skip, len - skip + 1);
    if (!*buf) {
        free(buf);
        return NULL;
    }
    return buf;
}

static void client_fini(struct tdm_hub_client *c)
{
    free(c->endpoint);
    free(c->token);
    free(c->auth_origin);
    memset(c, 0, sizeof *c);
}

static int client_init(struct tdm_hub_client *c, const struct tdm_hub_opts *o, char *err,
                       size_t errlen)
{
    memset(c, 0, sizeof *c);
    const char *ep = o && o->endpoint && *o->endpoint ? o->endpoint : env_nonempty("HF_ENDPOINT");
    c->endpoint = strdup(ep ? ep : DEFAULT_ENDPOINT);
    if (!c->endpoint)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    size_t n = strlen(c->endpoint);
    while (n > 0 && c->endpoint[n - 1] == '/')
        c->endpoint[--n] = '\0';
    char origin[512];
    if (tdm_hub_url_origin(c->endpoint, origin, sizeof origin) != 0) {
        int rc = tdm_seterr(err, errlen, TDM_EINVAL, "HF_ENDPOINT '%s' is not a URL", c->endpoint);
        client_fini(c);
        return rc;
    }
    c->auth_origin = strdup(origin);
    c->token = find_token(o);
    if (!c->auth_origin) {
        client_fini(c);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    }
    c->offline = (o && o->offline) || env_true("HF_HUB_OFFLINE");
    c->progress = o ? o->progress : TDM_HUB_PROGRESS_AUTO;
    if (c->progress == TDM_HUB_PROGRESS_AUTO)
        c->progress = isatty(STDERR_FILENO) ? TDM_HUB_PROGRESS_BAR : TDM_HUB_PROGRESS_LOG;
    c->max_retries = !o || o->max_retries == 0 ? 5 : (o->max_retries < 0 ? 0 : o->max_retries);
    c->retry_base_s = o && o->retry_base_s > 0 ? o->retry_base_s : 1.0;
    c->connect_timeout_s = o && o->connect_timeout_s > 0 ? o->connect_timeout_s : 10.0;
    c->stall_timeout_s = o && o->stall_timeout_s > 0 ? o->stall_timeout_s : 30.0;
    return TDM_OK;
}

// ---- ids ---------------------------------------------------------------------------------

static bool id_part_ok(const char *p, size_t n)
{
    if (n == 0 || p[0] == '-' || p[0] == '.' || p[n - 1] == '-' || p[n - 1] == '.')
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (!isalnum(c) && c != '-' && c != '_' && c != '.')
            return false;
        if (i > 0 && (c == '-' || c == '.') && p[i - 1] == c)
            return false; // "--" (the cache's separator) and ".."
    }
    return true;
}

int tdm_hub_validate_id(const char *model, char *err, size_t errlen)
{
    if (!model || !*model)
        return tdm_seterr(err, errlen, TDM_EINVAL, "empty model id");
    size_t n = strlen(model);
    const char *slash = strchr(model, '/');
    bool ok = n <= 96;
    if (slash)
        ok = ok && !strchr(slash + 1, '/') && id_part_ok(model, (size_t)(slash - model)) &&
             id_part_ok(slash + 1, n - (size_t)(slash - model) - 1);
    else
        ok = ok && id_part_ok(model, n);
    if (!ok)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "'%s' is neither an existing folder nor a valid Hugging Face model id "
                          "(ORG/NAME or NAME: letters, digits, '-', '_', '.'; no '--' or '..'; "
                          "not starting or ending with '-' or '.'; at most 96 characters)",
                          model);
    return TDM_OK;
}

// ---- the cache -------------------------------------------------------------------------------

struct repo {
    struct tdm_hub_client client;
    const char *id;
    const char *revision; // as asked ("main", a tag, a commit)
    char *repo_dir;       // CACHE/models--ORG--NAME
    char *lock_dir;       // CACHE/.locks/models--ORG--NAME
    char commit[64];      // "" until known
};

static char *snap_path(const struct repo *r, const char *file)
{
    return str_printf("%s/snapshots/%s/%s", r->repo_dir, r->commit, file);
}

static bool file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode); // follows the snapshot symlink
}

static bool in_snapshot(const struct repo *r, const char *file)
{
    char *p = snap_path(r, file);
    bool ok = p && file_exists(p);
    free(p);
    return ok;
}

static bool marked_absent(const struct repo *r, const char *file)
{
    char *p = str_printf("%s/.no_exist/%s/%s", r->repo_dir, r->commit, file);
    bool ok = p && file_exists(p);
    free(p);
    return ok;
}

// refs/<revision> -> r->commit (huggingface_hub writes the hash without newline).
static bool read_ref(struct repo *r)
{
    char *p = str_printf("%s/refs/%s", r->repo_dir, r->revision);
    char *buf = NULL;
    size_t len = 0;
    bool ok = p && tdm_read_file(p, &buf, &len, NULL, 0) == TDM_OK;
    free(p);
    if (!ok)
        return false;
    while (len > 0 && isspace((unsigned char)buf[len - 1]))
        buf[--len] = '\0';
    ok = is_commit_hash(buf);
    if (ok)
        snprintf(r->commit, sizeof r->commit, "%s", buf);
    free(buf);
    return ok;
}

static int write_file_atomic(const char *path, const char *content, char *err, size_t errlen)
{
    int rc = tdm_mkdir_p(path, true, err, errlen);
    if (rc != TDM_OK)
        return rc;
    char *tmp = tmp_name(path);
    if (!tmp)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    FILE *f = fopen(tmp, "wb");
    if (!f || fputs(content, f) < 0 || fclose(f) != 0 || rename(tmp, path) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: %s", path, strerror(errno));
        unlink(tmp);
    }
    free(tmp);
    return rc;
}

static int write_ref(const struct repo *r, char *err, size_t errlen)
{
    if (strcmp(r->revision, r->commit) == 0)
        return TDM_OK;
    char *p = str_printf("%s/refs/%s", r->repo_dir, r->revision);
    if (!p)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    int rc = write_file_atomic(p, r->commit, err, errlen);
    free(p);
    return rc;
}

// The shard names of snapshots/<commit>/model.safetensors.index.json (distinct,
// in order of first use) as a cJSON array; *out NULL on error.
static int read_index_shards(const struct repo *r, cJSON **out, char *err, size_t errlen)
{
    *out = NULL;
    char *p = snap_path(r, "model.safetensors.index.json");
    if (!p)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    char *buf = NULL;
    size_t len = 0;
    int rc = tdm_read_file(p, &buf, &len, err, errlen);
    if (rc != TDM_OK) {
        free(p);
        return rc;
    }
    char depth_err[96];
    cJSON *root = tdm_json_check_depth(buf, len, TDM_JSON_MAX_DEPTH, depth_err, sizeof depth_err)
                      ? NULL
                      : cJSON_ParseWithLength(buf, len);
    free(buf);
    cJSON *map = root ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    cJSON *names = cJSON_CreateArray();
    if (!names) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }
    if (!cJSON_IsObject(map)) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: not JSON with a \"weight_map\" object", p);
        goto out;
    }
    const cJSON *it;
    cJSON_ArrayForEach(it, map)
    {
        if (!cJSON_IsString(it) || !safe_relpath(it->valuestring)) {
            rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: weight_map[\"%s\"] is not a file name", p,
                            it->string ? it->string : "?");
            goto out;
        }
        bool seen = false;
        const cJSON *s;
        cJSON_ArrayForEach(s, names) seen = seen || strcmp(s->valuestring, it->valuestring) == 0;
        if (!seen && !cJSON_AddItemToArray(names, cJSON_CreateString(it->valuestring))) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto out;
        }
    }
    if (cJSON_GetArraySize(names) == 0) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: weight_map names no shard", p);
        goto out;
    }
    *out = names;
    names = NULL;
out:
    cJSON_Delete(names);
    cJSON_Delete(root);
    free(p);
    return rc;
}

static const char *const REQUIRED[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};

// TDM_OK when snapshots/<commit> holds every needed file; else TDM_ENOTFOUND with
// the first missing one in missing (or another code for a broken index).
static int snapshot_complete(const struct repo *r, char *missing, size_t mcap, char *err,
                             size_t errlen)
{
    for (size_t i = 0; i < sizeof REQUIRED / sizeof *REQUIRED; i++)
        if (!in_snapshot(r, REQUIRED[i])) {
            snprintf(missing, mcap, "%s", REQUIRED[i]);
            return TDM_ENOTFOUND;
        }
    if (in_snapshot(r, "model.safetensors"))
        return TDM_OK;
    if (!in_snapshot(r, "model.safetensors.index.json")) {
        snprintf(missing, mcap, "model.safetensors (or model.safetensors.index.json)");
        return TDM_ENOTFOUND;
    }
    cJSON *shards;
    int rc = read_index_shards(r, &shards, err, errlen);
    if (rc != TDM_OK)
        return rc;
    const cJSON *s;
    cJSON_ArrayForEach(s, shards) if (rc == TDM_OK && !in_snapshot(r, s->valuestring))
    {
        snprintf(missing, mcap, "%s", s->valuestring);
        rc = TDM_ENOTFOUND;
    }
    cJSON_Delete(shards);
    return rc;
}

// snapshots/<commit>/<file> -> ../../blobs/<etag> (one more ../ per folder in file).
static int link_pointer(const struct repo *r, const char *file, const char *etag, char *err,
                        size_t errlen)
{
    int rc = TDM_OK;
    char *ptr = snap_path(r, file), *tmp = NULL, *target = NULL;
    size_t depth = 0;
    for (const char *c = file; *c; c++)
        depth += *c == '/';
    target = malloc(6 + 3 * depth + 6 + strlen(etag) + 1);
    if (!ptr || !target) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }
    strcpy(target, "../../");
    for (size_t i = 0; i < depth; i++)
        strcat(target, "../");
    strcat(target, "blobs/");
    strcat(target, etag);
    rc = tdm_mkdir_p(ptr, true, err, errlen);
    if (rc != TDM_OK)
        goto out;
    tmp = tmp_name(ptr);
    if (!tmp) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }
    unlink(tmp);
    // symlink then rename: a reader sees the old pointer or the new one, never none.
    if (symlink(target, tmp) != 0 || rename(tmp, ptr) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "symlink %s: %s", ptr, strerror(errno));
        unlink(tmp);
    }
out:
    free(ptr);
    free(tmp);
    free(target);
    return rc;
}

// Downloads blobs/<etag> unless present, under the per-blob flock.
// The GET starts at the resolve URL, not at the CDN link the HEAD saw: each
// attempt then gets a freshly signed link (they expire during long downloads).
static int fetch_blob(struct repo *r, const char *file, const char *url,
                      const struct tdm_hub_meta *m, char *err, size_t errlen)
{
    int rc = TDM_OK, lock_fd = -1;
    char *blob = str_printf("%s/blobs/%s", r->repo_dir, m->etag);
    char *part = str_printf("%s/blobs/%s.incomplete", r->repo_dir, m->etag);
    char *lock = str_printf("%s/%s.lock", r->lock_dir, m->etag);
    if (!blob || !part || !lock) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }
    if (file_exists(blob))
        goto out;
    if ((rc = tdm_mkdir_p(blob, true, err, errlen)) != TDM_OK ||
        (rc = tdm_mkdir_p(lock, true, err, errlen)) != TDM_OK)
        goto out;
    lock_fd = open(lock, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (lock_fd < 0 || flock(lock_fd, LOCK_EX) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "lock %s: %s", lock, strerror(errno));
        goto out;
    }
    if (file_exists(blob)) // another process finished it while we waited
        goto out;
    double t0 = tdm_now();
    rc = tdm_hub_http_download(&r->client, url, part, m->size, file, err, errlen);
    if (rc != TDM_OK)
        goto out;
    if (is_sha256_hex(m->etag)) {
        char hex[65];
        rc = tdm_sha256_file(part, hex, err, errlen);
        if (rc != TDM_OK)
            goto out;
        if (strcasecmp(hex, m->etag) != 0) {
            unlink(part);
            rc = tdm_seterr(err, errlen, TDM_EPROTO,
                            "%s: sha256 mismatch: the Hub reported %s, the download hashes to %s; "
                            "partial file deleted",
                            file, m->etag, hex);
            goto out;
        }
    }
    if (rename(part, blob) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EIO, "rename %s: %s", part, strerror(errno));
        goto out;
    }
    if (r->client.progress == TDM_HUB_PROGRESS_LOG) {
        double dt = tdm_now() - t0;
        struct stat st;
        long long bytes = stat(blob, &st) == 0 ? (long long)st.st_size : -1;
        TDM_LOG_INFO("hub", "downloaded %s/%s bytes=%lld s=%.2f MB/s=%.2f", r->id, file, bytes, dt,
                     dt > 0 ? (double)bytes / dt / 1e6 : 0.0);
    }
out:
    if (lock_fd >= 0)
        close(lock_fd); // releases the flock; the lock file stays, like huggingface_hub's
    free(blob);
    free(part);
    free(lock);
    return rc;
}

// hf_hub_download for one file. *found = false for a 404 of an optional file.
static int fetch_file(struct repo *r, const char *file, bool optional, bool *found, char *err,
                      size_t errlen)
{
    *found = true;
    if (r->commit[0] && in_snapshot(r, file))
        return TDM_OK;
    if (r->commit[0] && optional && marked_absent(r, file)) {
        *found = false;
        return TDM_OK;
    }
    struct tdm_hub_meta m = {0};
    char *rev = url_encode(r->commit[0] ? r->commit : r->revision, false);
    char *fenc = url_encode(file, true);
    char *url = rev && fenc
                    ? str_printf("%s/%s/resolve/%s/%s", r->client.endpoint, r->id, rev, fenc)
                    : NULL;
    int rc = TDM_OK;
    if (!url) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }
    rc = tdm_hub_http_head(&r->client, url, &m, err, errlen);
    if (rc == TDM_ENOTFOUND && optional) {
        *found = false;
        rc = TDM_OK;
        if (r->commit[0]) {
            char *mark = str_printf("%s/.no_exist/%s/%s", r->repo_dir, r->commit, file);
            if (mark) // best effort, as in huggingface_hub: only saves a HEAD next time
                write_file_atomic(mark, "", NULL, 0);
            free(mark);
        }
        goto out;
    }
    if (rc != TDM_OK)
        goto out;
    if (!is_commit_hash(m.commit)) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO,
                        "%s: no valid X-Repo-Commit header in the answer: is HF_ENDPOINT=%s a "
                        "Hugging Face Hub?",
                        url, r->client.endpoint);
        goto out;
    }
    if (!safe_etag(m.etag)) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: missing or unusable ETag '%s'", url, m.etag);
        goto out;
    }
    if (!r->commit[0]) {
        snprintf(r->commit, sizeof r->commit, "%s", m.commit);
        if ((rc = write_ref(r, err, errlen)) != TDM_OK)
            goto out;
    } else if (strcmp(r->commit, m.commit) != 0) {
        rc = tdm_seterr(err, errlen, TDM_EPROTO, "%s: answered for commit %s, expected %s", url,
                        m.commit, r->commit);
        goto out;
    }
    if ((rc = fetch_blob(r, file, url, &m, err, errlen)) != TDM_OK)
        goto out;
    rc = link_pointer(r, file, m.etag, err, errlen);
out:
    free(m.location);
    free(url);
    free(rev);
    free(fenc);
    return rc;
}

static int download_model(struct repo *r, char *err, size_t errlen)
{
    bool found;
    int rc = fetch_file(r, "config.json", false, &found, err, errlen);
    if (rc == TDM_OK)
        rc = fetch_file(r, "generation_config.json", true, &found, err, errlen);
    for (size_t i = 1; rc == TDM_OK && i < sizeof REQUIRED / sizeof *REQUIRED; i++)
        rc = fetch_file(r, REQUIRED[i], false, &found, err, errlen);
    if (rc == TDM_OK)
        rc = fetch_file(r, "model.safetensors", true, &found, err, errlen);
    if (rc != TDM_OK || found)
        return rc;
    rc = fetch_file(r, "model.safetensors.index.json", true, &found, err, errlen);
    if (rc == TDM_OK && !found)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND,
                          "%s@%s has neither model.safetensors nor model.safetensors.index.json "
                          "(only safetensors weights are supported)",
                          r->id, r->revision);
    cJSON *shards = NULL;
    if (rc == TDM_OK)
        rc = read_index_shards(r, &shards, err, errlen);
    const cJSON *s;
    cJSON_ArrayForEach(s, shards) if (rc == TDM_OK) rc =
        fetch_file(r, s->valuestring, false, &found, err, errlen);
    cJSON_Delete(shards);
    return rc;
}

// ---- entry point --------------------------------------------------------------------------------

static int put_path(const char *path, char *out, size_t cap, char *err, size_t errlen)
{
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/')
        n--;
    if (n >= cap)
        return tdm_seterr(err, errlen, TDM_EINVAL, "model path does not fit %zu bytes: %s", cap,
                          path);
    memcpy(out, path, n);
    out[n] = '\0';
    return TDM_OK;
}

static int resolve_id(const char *model, const char *revision, struct tdm_hub_opts *opts,
                      char *path_out, size_t cap, char *err, size_t errlen);

int tdm_hub_resolve_model(const char *model, const char *revision, struct tdm_hub_opts *opts,
                          char *path_out, size_t cap, char *err, size_t errlen)
{
    if (!model || !*model || !path_out || cap == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "no model given");
    struct stat st;
    if (stat(model, &st) == 0) {
        if (S_ISDIR(st.st_mode))
            return put_path(model, path_out, cap, err, errlen);
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "'%s' is a file; --model takes a model folder or a Hugging Face id",
                          model);
    }
    int rc = resolve_id(model, revision, opts, path_out, cap, err, errlen);
    if (rc != TDM_OK && rc != TDM_ENOMEM && err && errlen) {
        // Either reading may be the one meant (a relative folder that is not
        // here is also a valid id, "models/Qwen2.5-0.5B-Instruct"): say both
        // (issue 28, item 4).
        char why[1200], cwd[512];
        snprintf(why, sizeof why, "%s", err);
        if (!getcwd(cwd, sizeof cwd))
            snprintf(cwd, sizeof cwd, ".");
        tdm_seterr(err, errlen, rc,
                   "there is no folder '%s' here (from %s), and as a Hugging Face id: %s", model,
                   model[0] == '/' ? "/" : cwd, why);
    }
    return rc;
}

static int resolve_id(const char *model, const char *revision, struct tdm_hub_opts *opts,
                      char *path_out, size_t cap, char *err, size_t errlen)
{
    int rc = tdm_hub_validate_id(model, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (!revision || !*revision)
        revision = "main";
    if (!safe_relpath(revision) || strlen(revision) > 255)
        return tdm_seterr(err, errlen, TDM_EINVAL, "bad revision '%s'", revision);

    struct repo r = {.id = model, .revision = revision};
    char cache[4096], missing[1100] = "";
    if ((rc = tdm_hub_cache_dir(opts, cache, sizeof cache, err, errlen)) != TDM_OK)
        return rc;
    if ((rc = client_init(&r.client, opts, err, errlen)) != TDM_OK)
        return rc;
    char folder[128] = "models--";
    for (const char *c = model; *c; c++)
        strncat(folder, *c == '/' ? "--" : (char[]){*c, '\0'}, sizeof folder - strlen(folder) - 1);
    r.repo_dir = str_printf("%s/%s", cache, folder);
    r.lock_dir = str_printf("%s/.locks/%s", cache, folder);
    if (!r.repo_dir || !r.lock_dir) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto out;
    }

    // 1. The cache, whoever wrote it: no network when it is complete.
    bool have_commit = is_commit_hash(revision)
                           ? (snprintf(r.commit, sizeof r.commit, "%s", revision), true)
                           : read_ref(&r);
    if (have_commit) {
        rc = snapshot_complete(&r, missing, sizeof missing, err, errlen);
        if (rc == TDM_OK)
            goto found;
        if (rc != TDM_ENOTFOUND && r.client.offline)
            goto out;
    }
    if (r.client.offline) {
        if (have_commit)
            rc = tdm_seterr(err, errlen, TDM_ENOTFOUND,
                            "%s@%s: %s is not in the cache (%s/snapshots/%s) and HF_HUB_OFFLINE "
                            "is set, so it cannot be downloaded: unset HF_HUB_OFFLINE or fetch "
                            "it first (tandem-download %s)",
                            model, revision, missing, r.repo_dir, r.commit, model);
        else
            rc = tdm_seterr(err, errlen, TDM_ENOTFOUND,
                            "%s@%s is not in the cache (no %s/refs/%s) and HF_HUB_OFFLINE is "
                            "set, so config.json and the other files cannot be downloaded: unset "
                            "HF_HUB_OFFLINE or fetch it first (tandem-download %s)",
                            model, revision, r.repo_dir, revision, model);
        goto out;
    }

    // 2. The Hub. A branch may have moved: ask, unless the revision is a commit.
    if (!is_commit_hash(revision))
        r.commit[0] = '\0';
    TDM_LOG_INFO("hub", "fetching %s@%s from %s into %s", model, revision, r.client.endpoint,
                 r.repo_dir);
    if ((rc = download_model(&r, err, errlen)) != TDM_OK) {
        // The very first request failed: maybe a mistyped local path.
        if (!r.commit[0] && (rc == TDM_ENOTFOUND || rc == TDM_EPROTO) && err && errlen > 0) {
            size_t l = strlen(err);
            if (l + 1 < errlen)
                snprintf(err + l, errlen - l, "; '%s' is not a local folder either", model);
        }
        goto out;
    }
    rc = snapshot_complete(&r, missing, sizeof missing, err, errlen);
    if (rc == TDM_ENOTFOUND)
        rc = tdm_seterr(err, errlen, TDM_EIO, "%s: %s missing after download", r.repo_dir, missing);
    if (rc != TDM_OK)
        goto out;
found:;
    char *snap = str_printf("%s/snapshots/%s", r.repo_dir, r.commit);
    rc = snap ? put_path(snap, path_out, cap, err, errlen)
              : tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    free(snap);
out:
    free(r.repo_dir);
    free(r.lock_dir);
    client_fini(&r.client);
    return rc;
}
