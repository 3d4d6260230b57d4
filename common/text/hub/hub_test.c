// SPDX-License-Identifier: Apache-2.0
// Tests for hub: a small HTTP server thread (one connection at a time,
// Connection: close) speaks the Hub's resolve protocol for the fake repo
// test-org/tiny - small files answered directly with ETag/X-Repo-Commit, LFS
// files (safetensors) answered 302 to a /cdn/<sha256> URL on "another host"
// (localhost vs 127.0.0.1: the same socket, a different origin for the client).
// Knobs make it drop a connection mid-file, ignore Range, lie about sizes,
// corrupt bytes, demand a token, fail with 503, or rename the repo; counters
// record what the client sent. The model files come from mkmodel's "tiny".
#include "hub.h"
#include "hub_impl.h"

#include "core.h"
#include "mkmodel.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#define COMMIT "0123456789abcdef0123456789abcdef01234567"
#define REPO "test-org/tiny"

// ---- fake Hub ------------------------------------------------------------------------------

struct ffile {
    char name[128];
    unsigned char *data;
    size_t len;
    char sha[65]; // sha256 hex: the LFS etag and CDN path
    char git_etag[41];
    bool lfs;
};

struct srv {
    int fd, port;
    pthread_t th;
    atomic_int stop;
    struct ffile files[8];
    int nfiles;
    // knobs (set before the client runs)
    bool cdn_cross_host;     // LFS redirect to http://localhost:PORT (else 127.0.0.1)
    const char *rename_from; // repo id answered with a relative 307 to REPO
    const char *token;       // required as Bearer on /resolve/ when set
    atomic_int drop_after;   // >0: the next CDN body stops after this many bytes
    bool ignore_range;
    long long size_lie;  // added to X-Linked-Size
    bool corrupt;        // flip the first byte of CDN bodies
    atomic_int fail_503; // answer this many requests with 503 first
    // observations
    atomic_int n_req, n_range, n_cdn_auth, n_cdn, n_drops, n_hub_bearer;
    char last_range[64];
};

static void ffile_set(struct ffile *f, const char *name, const void *data, size_t len, bool lfs)
{
    snprintf(f->name, sizeof f->name, "%s", name);
    f->data = malloc(len ? len : 1);
    assert_non_null(f->data);
    memcpy(f->data, data, len);
    f->len = len;
    f->lfs = lfs;
    struct tdm_sha256 s;
    unsigned char d[32];
    tdm_sha256_init(&s);
    tdm_sha256_update(&s, data, len);
    tdm_sha256_final(&s, d);
    for (int i = 0; i < 32; i++)
        snprintf(f->sha + 2 * i, 3, "%02x", d[i]);
    // a git-blob-like 40-hex etag, distinct from the sha256
    for (int i = 0; i < 40; i++)
        f->git_etag[i] = "0123456789abcdef"[(d[31 - i % 32] + i) & 15];
    f->git_etag[40] = '\0';
}

static void srv_add(struct srv *s, const char *name, const void *data, size_t len, bool lfs)
{
    assert_true(s->nfiles < 8);
    ffile_set(&s->files[s->nfiles++], name, data, len, lfs);
}

static void srv_remove(struct srv *s, const char *name)
{
    for (int i = 0; i < s->nfiles; i++)
        if (strcmp(s->files[i].name, name) == 0) {
            free(s->files[i].data);
            s->files[i] = s->files[--s->nfiles];
            return;
        }
}

static struct ffile *srv_find(struct srv *s, const char *name)
{
    for (int i = 0; i < s->nfiles; i++)
        if (strcmp(s->files[i].name, name) == 0)
            return &s->files[i];
    return NULL;
}

static void send_all(int c, const void *p, size_t n)
{
    const char *q = p;
    while (n > 0) {
        ssize_t k = send(c, q, n, MSG_NOSIGNAL);
        if (k <= 0)
            return;
        q += k;
        n -= (size_t)k;
    }
}

static void reply(int c, const char *status, const char *extra_headers, const void *body,
                  size_t blen, bool with_body)
{
    char h[2048];
    int n =
        snprintf(h, sizeof h, "HTTP/1.1 %s\r\nConnection: close\r\n%sContent-Length: %zu\r\n\r\n",
                 status, extra_headers, blen);
    send_all(c, h, (size_t)n);
    if (with_body && blen)
        send_all(c, body, blen);
}

static const char *hdr_value(const char *req, const char *name, char *out, size_t cap)
{
    size_t k = strlen(name);
    for (const char *l = strstr(req, "\r\n"); l && l[2]; l = strstr(l + 2, "\r\n")) {
        const char *p = l + 2;
        if (strncasecmp(p, name, k) == 0 && p[k] == ':') {
            p += k + 1;
            while (*p == ' ')
                p++;
            const char *e = strstr(p, "\r\n");
            size_t n = e ? (size_t)(e - p) : strlen(p);
            if (n >= cap)
                n = cap - 1;
            memcpy(out, p, n);
            out[n] = '\0';
            return out;
        }
    }
    return NULL;
}

static void serve_cdn(struct srv *s, int c, bool head, const char *sha, const char *req)
{
    struct ffile *f = NULL;
    for (int i = 0; i < s->nfiles; i++)
        if (strcmp(s->files[i].sha, sha) == 0)
            f = &s->files[i];
    if (!f) {
        reply(c, "404 Not Found", "", "", 0, false);
        return;
    }
    atomic_fetch_add(&s->n_cdn, 1);
    char tmp[256];
    if (hdr_value(req, "Authorization", tmp, sizeof tmp))
        atomic_fetch_add(&s->n_cdn_auth, 1);
    unsigned char *body = malloc(f->len ? f->len : 1);
    memcpy(body, f->data, f->len);
    if (s->corrupt && f->len)
        body[0] ^= 0xff;
    size_t from = 0;
    char range[64], extra[256] = "";
    if (hdr_value(req, "Range", range, sizeof range)) {
        atomic_fetch_add(&s->n_range, 1);
        snprintf(s->last_range, sizeof s->last_range, "%s", range);
        long long a;
        if (!s->ignore_range && sscanf(range, "bytes=%lld-", &a) == 1 && a >= 0 &&
            (size_t)a < f->len) {
            from = (size_t)a;
            snprintf(extra, sizeof extra, "Content-Range: bytes %zu-%zu/%zu\r\n", from, f->len - 1,
                     f->len);
        }
    }
    const char *status = extra[0] ? "206 Partial Content" : "200 OK";
    int drop = atomic_exchange(&s->drop_after, 0);
    if (drop > 0 && !head && (size_t)drop < f->len - from) {
        // Promise the whole length, deliver part of it, hang up.
        reply(c, status, extra, body + from, f->len - from, false);
        send_all(c, body + from, (size_t)drop);
        atomic_fetch_add(&s->n_drops, 1);
    } else {
        reply(c, status, extra, body + from, f->len - from, !head);
    }
    free(body);
}

static void serve_resolve(struct srv *s, int c, bool head, const char *repo, const char *rev,
                          const char *file, const char *req)
{
    char tmp[512], extra[1024];
    if (s->rename_from && strcmp(repo, s->rename_from) == 0) {
        snprintf(extra, sizeof extra, "Location: /%s/resolve/%s/%s\r\n", REPO, rev, file);
        reply(c, "307 Temporary Redirect", extra, "", 0, false);
        return;
    }
    if (strcmp(repo, REPO) != 0) {
        reply(c, "401 Unauthorized", "X-Error-Code: RepoNotFound\r\n", "", 0, false);
        return;
    }
    if (s->token) {
        char want[256];
        snprintf(want, sizeof want, "Bearer %s", s->token);
        if (!hdr_value(req, "Authorization", tmp, sizeof tmp) || strcmp(tmp, want) != 0) {
            reply(c, "401 Unauthorized", "X-Error-Code: GatedRepo\r\n", "", 0, false);
            return;
        }
        atomic_fetch_add(&s->n_hub_bearer, 1);
    }
    if (strcmp(rev, "main") != 0 && strcmp(rev, COMMIT) != 0) {
        reply(c, "404 Not Found", "X-Error-Code: RevisionNotFound\r\n", "", 0, false);
        return;
    }
    struct ffile *f = srv_find(s, file);
    if (!f) {
        reply(c, "404 Not Found", "X-Error-Code: EntryNotFound\r\nX-Repo-Commit: " COMMIT "\r\n",
              "", 0, false);
        return;
    }
    if (f->lfs) {
        snprintf(extra, sizeof extra,
                 "X-Repo-Commit: %s\r\nETag: \"%s\"\r\nX-Linked-Etag: \"%s\"\r\n"
                 "X-Linked-Size: %lld\r\nLocation: http://%s:%d/cdn/%s\r\n",
                 COMMIT, f->git_etag, f->sha, (long long)f->len + s->size_lie,
                 s->cdn_cross_host ? "localhost" : "127.0.0.1", s->port, f->sha);
        reply(c, "302 Found", extra, "", 0, false);
        return;
    }
    snprintf(extra, sizeof extra, "X-Repo-Commit: %s\r\nETag: W/\"%s\"\r\n", COMMIT, f->git_etag);
    reply(c, "200 OK", extra, f->data, f->len, !head);
}

static void handle(struct srv *s, int c)
{
    char req[8192];
    size_t n = 0;
    while (n < sizeof req - 1) {
        ssize_t k = recv(c, req + n, sizeof req - 1 - n, 0);
        if (k <= 0)
            return;
        n += (size_t)k;
        req[n] = '\0';
        if (strstr(req, "\r\n\r\n"))
            break;
    }
    atomic_fetch_add(&s->n_req, 1);
    if (atomic_load(&s->fail_503) > 0) {
        atomic_fetch_sub(&s->fail_503, 1);
        reply(c, "503 Service Unavailable", "", "", 0, false);
        return;
    }
    char method[8], path[1024];
    if (sscanf(req, "%7s %1023s", method, path) != 2) {
        reply(c, "400 Bad Request", "", "", 0, false);
        return;
    }
    bool head = strcmp(method, "HEAD") == 0;
    if (strncmp(path, "/cdn/", 5) == 0) {
        serve_cdn(s, c, head, path + 5, req);
        return;
    }
    // /ORG/NAME/resolve/REV/FILE...
    char *org = path + 1, *name = strchr(org, '/'), *kw, *rev, *file;
    if (!name || !(kw = strchr(name + 1, '/')) || strncmp(kw, "/resolve/", 9) != 0 ||
        !(file = strchr(kw + 9, '/'))) {
        reply(c, "404 Not Found", "", "", 0, false);
        return;
    }
    rev = kw + 9;
    *kw = '\0';
    *file++ = '\0';
    serve_resolve(s, c, head, org, rev, file, req);
}

static void *srv_main(void *arg)
{
    struct srv *s = arg;
    while (!atomic_load(&s->stop)) {
        struct pollfd p = {.fd = s->fd, .events = POLLIN};
        if (poll(&p, 1, 20) <= 0)
            continue;
        int c = accept(s->fd, NULL, NULL);
        if (c < 0)
            continue;
        handle(s, c);
        shutdown(c, SHUT_WR);
        close(c);
    }
    return NULL;
}

static struct srv *srv_start(void)
{
    struct srv *s = calloc(1, sizeof *s);
    assert_non_null(s);
    s->fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(s->fd >= 0);
    int one = 1;
    setsockopt(s->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(s->fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(s->fd, 16), 0);
    socklen_t al = sizeof a;
    getsockname(s->fd, (struct sockaddr *)&a, &al);
    s->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&s->th, NULL, srv_main, s), 0);
    return s;
}

// Stops the thread and closes the socket (the port then refuses connections).
static void srv_stop(struct srv *s)
{
    if (s->fd < 0)
        return;
    atomic_store(&s->stop, 1);
    pthread_join(s->th, NULL);
    close(s->fd);
    s->fd = -1;
}

static void srv_free(struct srv *s)
{
    if (!s)
        return;
    srv_stop(s);
    for (int i = 0; i < s->nfiles; i++)
        free(s->files[i].data);
    free(s);
}

// ---- fixture ---------------------------------------------------------------------------------

struct fx {
    char dir[64];      // temp root
    char cache[128];   // dir/hub
    char endpoint[64]; // http://127.0.0.1:PORT
    struct srv *s;
    struct tdm_hub_opts o;
};

static void add_tiny_model(struct srv *s, const char *dir)
{
    struct tdm_mkmodel_spec spec;
    char err[256], src[128];
    assert_int_equal(tdm_mkmodel_preset(&spec, "tiny"), TDM_OK);
    spec.seed = 7;
    snprintf(src, sizeof src, "%s/src", dir);
    assert_int_equal(tdm_mkmodel_write(&spec, src, err, sizeof err), TDM_OK);
    static const char *const names[] = {"config.json", "generation_config.json", "tokenizer.json",
                                        "tokenizer_config.json", "model.safetensors"};
    for (int i = 0; i < 5; i++) {
        char p[256], *buf;
        size_t len;
        snprintf(p, sizeof p, "%s/%s", src, names[i]);
        assert_int_equal(tdm_read_file(p, &buf, &len, err, sizeof err), TDM_OK);
        srv_add(s, names[i], buf, len, i == 4);
        free(buf);
    }
}

static int rm_entry(const char *p, const struct stat *st, int flag, struct FTW *ftw)
{
    (void)st, (void)flag, (void)ftw;
    return remove(p);
}

static int fx_setup(void **state)
{
    struct fx *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    snprintf(f->dir, sizeof f->dir, "/tmp/tdm_hub_XXXXXX");
    if (!mkdtemp(f->dir))
        return -1;
    snprintf(f->cache, sizeof f->cache, "%s/hub", f->dir);
    unsetenv("HF_HUB_OFFLINE");
    unsetenv("HF_TOKEN");
    unsetenv("HF_HUB_CACHE");
    unsetenv("HF_ENDPOINT");
    unsetenv("HF_TOKEN_PATH");
    unsetenv("HUGGINGFACE_HUB_CACHE");
    unsetenv("HUGGING_FACE_HUB_TOKEN");
    setenv("HF_HOME", f->dir, 1); // also keeps a real ~/.cache/huggingface/token out
    f->s = srv_start();
    snprintf(f->endpoint, sizeof f->endpoint, "http://127.0.0.1:%d", f->s->port);
    f->o.cache_dir = f->cache;
    f->o.endpoint = f->endpoint;
    f->o.progress = TDM_HUB_PROGRESS_QUIET;
    f->o.max_retries = 3;
    f->o.retry_base_s = 0.01;
    f->o.stall_timeout_s = 5;
    *state = f;
    return 0;
}

static int fx_teardown(void **state)
{
    struct fx *f = *state;
    srv_free(f->s);
    nftw(f->dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    free(f);
    return 0;
}

static char *path_in(const struct fx *f, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static char *path_in(const struct fx *f, const char *fmt, ...)
{
    static char buf[4][640];
    static int k;
    char rel[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rel, sizeof rel, fmt, ap);
    va_end(ap);
    char *b = buf[k++ & 3];
    snprintf(b, 640, "%s/%s", f->cache, rel);
    return b;
}

static bool exists(const char *p)
{
    struct stat st;
    return lstat(p, &st) == 0;
}

static void assert_same_bytes(const char *path, const struct ffile *ff)
{
    char *buf, err[256];
    size_t len;
    assert_int_equal(tdm_read_file(path, &buf, &len, err, sizeof err), TDM_OK);
    assert_int_equal(len, ff->len);
    assert_memory_equal(buf, ff->data, len);
    free(buf);
}

static int resolve(struct fx *f, const char *id, const char *rev, char *out, char *err)
{
    err[0] = '\0';
    int rc = tdm_hub_resolve_model(id, rev, &f->o, out, 1024, err, 512);
    if (rc != TDM_OK) // the message a user would see, for the test log
        fprintf(stderr, "  resolve(%s, %s) -> %s: %s\n", id, rev ? rev : "NULL", tdm_strerror(rc),
                err);
    return rc;
}

// ---- tests -----------------------------------------------------------------------------------

static void test_sha256_vectors(void **state)
{
    (void)state;
    struct {
        const char *msg;
        const char *hex;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
    };
    for (size_t i = 0; i < sizeof v / sizeof *v; i++) {
        struct tdm_sha256 s;
        unsigned char d[32];
        char hex[65];
        tdm_sha256_init(&s);
        // feed in odd pieces so the partial-block path is exercised
        size_t n = strlen(v[i].msg);
        for (size_t j = 0; j < n; j += 7)
            tdm_sha256_update(&s, v[i].msg + j, n - j < 7 ? n - j : 7);
        tdm_sha256_final(&s, d);
        for (int k = 0; k < 32; k++)
            snprintf(hex + 2 * k, 3, "%02x", d[k]);
        assert_string_equal(hex, v[i].hex);
    }
    // one million 'a' (FIPS 180-2 appendix B.3)
    struct tdm_sha256 s;
    unsigned char d[32], chunk[1000];
    char hex[65];
    memset(chunk, 'a', sizeof chunk);
    tdm_sha256_init(&s);
    for (int i = 0; i < 1000; i++)
        tdm_sha256_update(&s, chunk, sizeof chunk);
    tdm_sha256_final(&s, d);
    for (int k = 0; k < 32; k++)
        snprintf(hex + 2 * k, 3, "%02x", d[k]);
    assert_string_equal(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

static void test_validate_id(void **state)
{
    (void)state;
    char err[512];
    const char *good[] = {"Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "test-org/tiny", "a_b/c.d"};
    const char *bad[] = {"",   "a/b/c", "-x/y",  "x/y-",      "a--b/c",    "a/b..c",
                         "a/", "/b",    "a b/c", "org/na$me", "./models/x"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++)
        assert_int_equal(tdm_hub_validate_id(good[i], err, sizeof err), TDM_OK);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(tdm_hub_validate_id(bad[i], err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "./models/x"));
    assert_non_null(strstr(err, "neither an existing folder"));
    char long_id[120];
    memset(long_id, 'a', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    assert_int_equal(tdm_hub_validate_id(long_id, err, sizeof err), TDM_EINVAL);
}

static void test_local_folder(void **state)
{
    struct fx *f = *state;
    char out[1024], err[512];
    assert_int_equal(resolve(f, f->dir, NULL, out, err), TDM_OK);
    assert_string_equal(out, f->dir);
    assert_int_equal(atomic_load(&f->s->n_req), 0);
}

// Full download into $HF_HOME/hub (env, no cache_dir), layout checked, then
// the same call with the server gone, and offline.
static void test_download_layout_then_cache(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    f->o.cache_dir = NULL; // from HF_HOME
    f->o.endpoint = NULL;
    setenv("HF_ENDPOINT", f->endpoint, 1);
    char out[1024], err[512];
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_string_equal(out, path_in(f, "models--test-org--tiny/snapshots/" COMMIT));

    char *buf;
    size_t len;
    assert_int_equal(
        tdm_read_file(path_in(f, "models--test-org--tiny/refs/main"), &buf, &len, err, sizeof err),
        TDM_OK);
    assert_string_equal(buf, COMMIT);
    free(buf);
    for (int i = 0; i < f->s->nfiles; i++) {
        struct ffile *ff = &f->s->files[i];
        char *ptr = path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/%s", ff->name);
        struct stat st;
        assert_int_equal(lstat(ptr, &st), 0);
        assert_true(S_ISLNK(st.st_mode));
        char target[256] = "", want[256];
        assert_true(readlink(ptr, target, sizeof target - 1) > 0);
        snprintf(want, sizeof want, "../../blobs/%s", ff->lfs ? ff->sha : ff->git_etag);
        assert_string_equal(target, want);
        assert_same_bytes(ptr, ff);
        assert_false(exists(path_in(f, "models--test-org--tiny/blobs/%s.incomplete", want + 12)));
    }
    assert_true(exists(path_in(f, ".locks/models--test-org--tiny/%s.lock",
                               srv_find(f->s, "model.safetensors")->sha)));
    // no token configured: nothing sent to the CDN
    assert_int_equal(atomic_load(&f->s->n_cdn_auth), 0);

    // Server gone: the cache answers, no network.
    srv_stop(f->s);
    char out2[1024];
    assert_int_equal(resolve(f, REPO, NULL, out2, err), TDM_OK);
    assert_string_equal(out2, out);
    setenv("HF_HUB_OFFLINE", "1", 1);
    assert_int_equal(resolve(f, REPO, "main", out2, err), TDM_OK);
    assert_string_equal(out2, out);
    assert_int_equal(resolve(f, REPO, COMMIT, out2, err), TDM_OK);
    assert_string_equal(out2, out);
}

static void test_offline_errors(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    setenv("HF_HUB_OFFLINE", "1", 1);
    char out[1024], err[512];
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_ENOTFOUND);
    assert_non_null(strstr(err, "HF_HUB_OFFLINE"));
    assert_non_null(strstr(err, REPO));
    assert_int_equal(atomic_load(&f->s->n_req), 0);

    // Download, then lose one blob: offline names the missing file.
    unsetenv("HF_HUB_OFFLINE");
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    int before = atomic_load(&f->s->n_req);
    assert_int_equal(unlink(path_in(f, "models--test-org--tiny/blobs/%s",
                                    srv_find(f->s, "tokenizer.json")->git_etag)),
                     0);
    f->o.offline = true;
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_ENOTFOUND);
    assert_non_null(strstr(err, "tokenizer.json"));
    assert_non_null(strstr(err, "HF_HUB_OFFLINE"));
    assert_int_equal(atomic_load(&f->s->n_req), before);
    // Online again: only the missing file is fetched back.
    f->o.offline = false;
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_true(atomic_load(&f->s->n_req) > before);
    assert_same_bytes(path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/tokenizer.json"),
                      srv_find(f->s, "tokenizer.json"));
}

// A renamed repo answers a relative 307 (followed by the HEAD, token kept);
// the LFS file's absolute 302 to the same origin keeps the token too.
static void test_redirects_same_host(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    f->s->rename_from = "test-org/tiny-old";
    f->s->token = "s3cret";
    f->o.token = "s3cret";
    char out[1024], err[512];
    assert_int_equal(resolve(f, "test-org/tiny-old", NULL, out, err), TDM_OK);
    assert_string_equal(out, path_in(f, "models--test-org--tiny-old/snapshots/" COMMIT));
    assert_same_bytes(
        path_in(f, "models--test-org--tiny-old/snapshots/" COMMIT "/model.safetensors"),
        srv_find(f->s, "model.safetensors"));
    assert_true(atomic_load(&f->s->n_cdn) >= 1);
    assert_int_equal(atomic_load(&f->s->n_cdn_auth), atomic_load(&f->s->n_cdn));
}

// HF_TOKEN goes to the Hub as Bearer, never to another host after a redirect.
static void test_token_not_sent_cross_host(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    f->s->token = "hf_abc";
    f->s->cdn_cross_host = true;
    setenv("HF_TOKEN", "hf_abc", 1);
    char out[1024], err[512];
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_true(atomic_load(&f->s->n_hub_bearer) >= 5);
    assert_true(atomic_load(&f->s->n_cdn) >= 1);
    assert_int_equal(atomic_load(&f->s->n_cdn_auth), 0);
    assert_same_bytes(path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/model.safetensors"),
                      srv_find(f->s, "model.safetensors"));
}

// Without HF_TOKEN, the token file `hf auth login` writes ($HF_HOME/token).
static void test_token_file(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    f->s->token = "hf_from_file";
    char p[256], out[1024], err[512];
    snprintf(p, sizeof p, "%s/token", f->dir);
    FILE *fp = fopen(p, "wb");
    assert_non_null(fp);
    fputs("  hf_from_file\n", fp);
    fclose(fp);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_true(atomic_load(&f->s->n_hub_bearer) >= 5);
    // "" in opts means: send none, whatever the environment says
    nftw(f->cache, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    f->o.token = "";
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_EPROTO);
    assert_non_null(strstr(err, "HF_TOKEN"));
}

static void test_401_and_404(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    char out[1024], err[512];
    // unknown repo: the Hub says 401
    assert_int_equal(resolve(f, "test-org/other", NULL, out, err), TDM_EPROTO);
    assert_non_null(strstr(err, "HF_TOKEN"));
    assert_non_null(strstr(err, "401"));
    // wrong token for a gated repo
    f->s->token = "right";
    f->o.token = "wrong";
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_EPROTO);
    assert_non_null(strstr(err, "HF_TOKEN"));
    f->s->token = NULL;
    f->o.token = NULL;
    // unknown revision
    assert_int_equal(resolve(f, REPO, "v9", out, err), TDM_ENOTFOUND);
    assert_non_null(strstr(err, "not found"));
    assert_non_null(strstr(err, "/test-org/tiny/resolve/v9/config.json"));
    // a required file the repo lacks
    srv_remove(f->s, "tokenizer.json");
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_ENOTFOUND);
    assert_non_null(strstr(err, "/resolve/" COMMIT "/tokenizer.json"));
}

static void test_resume_after_drop(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    struct ffile *w = srv_find(f->s, "model.safetensors");
    int half = (int)(w->len / 2);
    atomic_store(&f->s->drop_after, half);
    char out[1024], err[512], want[64];
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_int_equal(atomic_load(&f->s->n_drops), 1);
    snprintf(want, sizeof want, "bytes=%d-", half);
    assert_string_equal(f->s->last_range, want);
    assert_same_bytes(path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/model.safetensors"),
                      w);
}

// A partial file left by an earlier run is resumed; with a server that ignores
// Range (200), the garbage prefix must be thrown away.
static void test_resume_across_runs_and_ignored_range(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    struct ffile *w = srv_find(f->s, "model.safetensors");
    char out[1024], err[512], want[64];
    char *part = path_in(f, "models--test-org--tiny/blobs/%s.incomplete", w->sha);
    char dir[512];
    snprintf(dir, sizeof dir, "%s/models--test-org--tiny/blobs", f->cache);
    assert_int_equal(mkdir(f->cache, 0755), 0);
    assert_int_equal(mkdir(path_in(f, "models--test-org--tiny"), 0755), 0);
    assert_int_equal(mkdir(dir, 0755), 0);
    FILE *fp = fopen(part, "wb");
    assert_non_null(fp);
    fwrite(w->data, 1, 1000, fp);
    fclose(fp);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_string_equal(f->s->last_range, "bytes=1000-");
    assert_same_bytes(path_in(f, "models--test-org--tiny/blobs/%s", w->sha), w);

    // Same with a Range-ignoring server and a wrong prefix.
    nftw(f->cache, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    assert_int_equal(mkdir(f->cache, 0755), 0);
    assert_int_equal(mkdir(path_in(f, "models--test-org--tiny"), 0755), 0);
    assert_int_equal(mkdir(dir, 0755), 0);
    fp = fopen(part, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 777; i++)
        fputc('x', fp);
    fclose(fp);
    f->s->ignore_range = true;
    int ranges = atomic_load(&f->s->n_range);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_int_equal(atomic_load(&f->s->n_range), ranges + 1);
    snprintf(want, sizeof want, "bytes=%d-", 777);
    assert_string_equal(f->s->last_range, want);
    assert_same_bytes(path_in(f, "models--test-org--tiny/blobs/%s", w->sha), w);
}

static void test_size_and_sha_mismatch(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    struct ffile *w = srv_find(f->s, "model.safetensors");
    char out[1024], err[512];
    f->s->size_lie = 5;
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_EPROTO);
    assert_non_null(strstr(err, "size mismatch"));
    assert_non_null(strstr(err, "model.safetensors"));
    assert_false(exists(path_in(f, "models--test-org--tiny/blobs/%s", w->sha)));
    assert_false(exists(path_in(f, "models--test-org--tiny/blobs/%s.incomplete", w->sha)));
    assert_false(
        exists(path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/model.safetensors")));

    f->s->size_lie = 0;
    f->s->corrupt = true;
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_EPROTO);
    assert_non_null(strstr(err, "sha256 mismatch"));
    assert_non_null(strstr(err, w->sha));
    assert_false(exists(path_in(f, "models--test-org--tiny/blobs/%s", w->sha)));
    assert_false(exists(path_in(f, "models--test-org--tiny/blobs/%s.incomplete", w->sha)));

    f->s->corrupt = false;
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
}

static void test_retry_5xx_and_give_up(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    char out[1024], err[512];
    atomic_store(&f->s->fail_503, 2);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_int_equal(atomic_load(&f->s->fail_503), 0);

    // A dead endpoint (connection refused): no retry at all, a transport error
    // at once that says what to do instead (issue 14: no network used to retry
    // for 26 s). The backoff is raised so that a single retry would show.
    nftw(f->cache, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    srv_stop(f->s);
    f->o.retry_base_s = 2.0;
    double t0 = tdm_now();
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_ETRANSPORT);
    assert_true(tdm_now() - t0 < 1.5);
    assert_non_null(strstr(err, "config.json"));
    assert_non_null(strstr(err, "(after 0 retries)"));
    assert_non_null(strstr(err, "HF_HUB_OFFLINE=1"));
    // Both readings of the name in one message (issue 28, item 4): a relative
    // folder that is not here, and a Hub id the Hub could not give.
    assert_non_null(strstr(err, "there is no folder '" REPO "' here (from "));
    assert_non_null(strstr(err, "and as a Hugging Face id: HEAD"));
    f->o.retry_base_s = 0.01;
}

// Runs resolve with stderr sent to a file; returns that file's text (caller frees).
static char *resolve_capturing_stderr(struct fx *f, char *out, char *err)
{
    char path[128];
    snprintf(path, sizeof path, "%s/stderr.txt", f->dir);
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    FILE *cap = fopen(path, "wb");
    assert_non_null(cap);
    dup2(fileno(cap), STDERR_FILENO);
    int rc = tdm_hub_resolve_model(REPO, NULL, &f->o, out, 1024, err, 512);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    fclose(cap);
    assert_int_equal(rc, TDM_OK);
    char *text;
    size_t len;
    assert_int_equal(tdm_read_file(path, &text, &len, err, 512), TDM_OK);
    return text;
}

static void test_progress_output(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    char out[1024], err[512];
    // The bar: file name, MB, percent, rate; it survives a resume.
    f->o.progress = TDM_HUB_PROGRESS_BAR;
    atomic_store(&f->s->drop_after, 50000);
    char *text = resolve_capturing_stderr(f, out, err);
    assert_non_null(strstr(text, "model.safetensors"));
    assert_non_null(strstr(text, "100.0%"));
    assert_non_null(strstr(text, "MB/s"));
    assert_non_null(strstr(text, "resuming"));
    free(text);
    // Not a terminal: one log line per downloaded file.
    nftw(f->cache, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    f->o.progress = TDM_HUB_PROGRESS_LOG;
    text = resolve_capturing_stderr(f, out, err);
    assert_non_null(strstr(text, "downloaded test-org/tiny/model.safetensors bytes="));
    assert_non_null(strstr(text, "downloaded test-org/tiny/config.json bytes="));
    assert_null(strstr(text, "100.0%"));
    free(text);
}

struct racer {
    struct fx *f;
    int rc;
    char out[1024], err[512];
};

static void *race_main(void *arg)
{
    struct racer *r = arg;
    r->rc =
        tdm_hub_resolve_model(REPO, NULL, &r->f->o, r->out, sizeof r->out, r->err, sizeof r->err);
    return NULL;
}

// Two resolvers sharing one cache (a prefill and a decode worker starting
// together): the per-blob flock makes one download each blob, both succeed.
static void test_concurrent_resolves(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    struct racer a = {.f = f}, b = {.f = f};
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, race_main, &a), 0);
    assert_int_equal(pthread_create(&tb, NULL, race_main, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_int_equal(a.rc, TDM_OK);
    assert_int_equal(b.rc, TDM_OK);
    assert_string_equal(a.out, b.out);
    assert_int_equal(atomic_load(&f->s->n_cdn), 1);
    for (int i = 0; i < f->s->nfiles; i++)
        assert_same_bytes(
            path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/%s", f->s->files[i].name),
            &f->s->files[i]);
}

static void test_sharded(void **state)
{
    struct fx *f = *state;
    struct srv *s = f->s;
    static const char cfg[] = "{\"architectures\":[\"Qwen2ForCausalLM\"]}";
    static const char tok[] = "{\"model\":{}}";
    static const char idx[] = "{\"metadata\":{\"total_size\":300},\"weight_map\":{"
                              "\"a.weight\":\"model-00001-of-00002.safetensors\","
                              "\"b.weight\":\"model-00002-of-00002.safetensors\","
                              "\"c.weight\":\"model-00001-of-00002.safetensors\"}}";
    unsigned char s1[3000], s2[1700];
    for (size_t i = 0; i < sizeof s1; i++)
        s1[i] = (unsigned char)(i * 7);
    for (size_t i = 0; i < sizeof s2; i++)
        s2[i] = (unsigned char)(i * 13 + 1);
    srv_add(s, "config.json", cfg, strlen(cfg), false);
    srv_add(s, "tokenizer.json", tok, strlen(tok), false);
    srv_add(s, "tokenizer_config.json", tok, strlen(tok), false);
    srv_add(s, "model.safetensors.index.json", idx, strlen(idx), false);
    srv_add(s, "model-00001-of-00002.safetensors", s1, sizeof s1, true);
    srv_add(s, "model-00002-of-00002.safetensors", s2, sizeof s2, true);
    s->cdn_cross_host = true;
    char out[1024], err[512];
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    for (int i = 0; i < s->nfiles; i++)
        assert_same_bytes(
            path_in(f, "models--test-org--tiny/snapshots/" COMMIT "/%s", s->files[i].name),
            &s->files[i]);
    assert_true(
        exists(path_in(f, "models--test-org--tiny/.no_exist/" COMMIT "/model.safetensors")));
    assert_true(
        exists(path_in(f, "models--test-org--tiny/.no_exist/" COMMIT "/generation_config.json")));
    assert_int_equal(atomic_load(&s->n_cdn), 2);

    // A second resolve is served by the cache.
    int n = atomic_load(&s->n_req);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_int_equal(atomic_load(&s->n_req), n);
    // Losing a shard: only it is fetched again (by commit, no HEAD for the rest).
    assert_int_equal(unlink(path_in(f, "models--test-org--tiny/blobs/%s",
                                    srv_find(s, "model-00002-of-00002.safetensors")->sha)),
                     0);
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_OK);
    assert_int_equal(atomic_load(&s->n_cdn), 3);
}

static void write_text(const char *path, const char *text)
{
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
}

static void mkdirs(const char *path)
{
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(tmp, 0755);
            *p = '/';
        }
    mkdir(tmp, 0755);
}

// A cache as huggingface_hub writes it (by hand here, with HF_HUB_CACHE): used
// as is, nothing asked of the server.
static void test_foreign_cache_reused(void **state)
{
    struct fx *f = *state;
    add_tiny_model(f->s, f->dir);
    const char *commit = "fedcba9876543210fedcba9876543210fedcba98";
    char base[256], p[512], t[512];
    snprintf(base, sizeof base, "%s/other-cache/models--Qwen--Qwen2.5-0.5B-Instruct", f->dir);
    snprintf(p, sizeof p, "%s/blobs", base);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/snapshots/%s", base, commit);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/refs", base);
    mkdirs(p);
    snprintf(p, sizeof p, "%s/refs/main", base);
    write_text(p, commit);
    for (int i = 0; i < f->s->nfiles; i++) {
        struct ffile *ff = &f->s->files[i];
        const char *etag = ff->lfs ? ff->sha : ff->git_etag;
        snprintf(p, sizeof p, "%s/blobs/%s", base, etag);
        FILE *fp = fopen(p, "wb");
        assert_non_null(fp);
        fwrite(ff->data, 1, ff->len, fp);
        fclose(fp);
        snprintf(p, sizeof p, "%s/snapshots/%s/%s", base, commit, ff->name);
        snprintf(t, sizeof t, "../../blobs/%s", etag);
        assert_int_equal(symlink(t, p), 0);
    }
    snprintf(p, sizeof p, "%s/other-cache", f->dir);
    setenv("HF_HUB_CACHE", p, 1);
    f->o.cache_dir = NULL;
    char out[1024], err[512], want[512];
    assert_int_equal(resolve(f, "Qwen/Qwen2.5-0.5B-Instruct", NULL, out, err), TDM_OK);
    snprintf(want, sizeof want, "%s/snapshots/%s", base, commit);
    assert_string_equal(out, want);
    assert_int_equal(atomic_load(&f->s->n_req), 0);
    char cache[512];
    assert_int_equal(tdm_hub_cache_dir(NULL, cache, sizeof cache, err, sizeof err), TDM_OK);
    assert_string_equal(cache, p);
    // by commit too; an unknown branch needs the network (which says 401 here)
    assert_int_equal(resolve(f, "Qwen/Qwen2.5-0.5B-Instruct", commit, out, err), TDM_OK);
    assert_int_equal(atomic_load(&f->s->n_req), 0);
    assert_int_equal(resolve(f, "Qwen/Qwen2.5-0.5B-Instruct", "dev", out, err), TDM_EPROTO);
    assert_true(atomic_load(&f->s->n_req) > 0);
}

static void test_bad_inputs(void **state)
{
    struct fx *f = *state;
    char out[1024], err[512];
    assert_int_equal(resolve(f, "no/such/folder", NULL, out, err), TDM_EINVAL);
    assert_non_null(strstr(err, "no/such/folder"));
    assert_int_equal(resolve(f, REPO, "../x", out, err), TDM_EINVAL);
    char file[128];
    snprintf(file, sizeof file, "%s/model.gguf", f->dir);
    write_text(file, "x");
    assert_int_equal(resolve(f, file, NULL, out, err), TDM_EINVAL);
    assert_non_null(strstr(err, "is a file"));
    assert_int_equal(tdm_hub_resolve_model(f->dir, NULL, &f->o, out, 4, err, sizeof err),
                     TDM_EINVAL);
    f->o.endpoint = "not a url";
    assert_int_equal(resolve(f, REPO, NULL, out, err), TDM_EINVAL);
    assert_non_null(strstr(err, "HF_ENDPOINT"));
    assert_int_equal(atomic_load(&f->s->n_req), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sha256_vectors),
        cmocka_unit_test(test_validate_id),
#define T(fn) cmocka_unit_test_setup_teardown(fn, fx_setup, fx_teardown)
        T(test_local_folder),
        T(test_download_layout_then_cache),
        T(test_offline_errors),
        T(test_redirects_same_host),
        T(test_token_not_sent_cross_host),
        T(test_token_file),
        T(test_401_and_404),
        T(test_resume_after_drop),
        T(test_resume_across_runs_and_ignored_range),
        T(test_size_and_sha_mismatch),
        T(test_retry_5xx_and_give_up),
        T(test_progress_output),
        T(test_concurrent_resolves),
        T(test_sharded),
        T(test_foreign_cache_reused),
        T(test_bad_inputs),
#undef T
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
