// SPDX-License-Identifier: Apache-2.0
// hub_http: the two libcurl transfers the Hub download protocol needs.
//
// HEAD {endpoint}/{repo}/resolve/{rev}/{file} answers with X-Repo-Commit, the
// ETag (X-Linked-Etag for LFS files: their sha256) and the size (X-Linked-Size,
// else Content-Length); LFS files answer 302 to a CDN. Like huggingface_hub, the
// HEAD follows only relative redirects (renamed repos) and treats an absolute
// one as "the bytes are over there". The GET then follows every redirect.
//
// Redirects are followed by hand, not by CURLOPT_FOLLOWLOCATION, so the rule
// "the token goes only to the endpoint's origin" is ours and visible: a CDN
// never sees HF_TOKEN. A GET appends to the partial file and asks for
// `Range: bytes=N-`; a 206 must start at N, a 200 (Range ignored) truncates and
// restarts. Dropped connections, stalls and 5xx/429 are retried with doubling
// backoff; a retry that made progress does not count against the budget, so a
// flaky link still finishes a large file while a dead one fails after
// max_retries.
#include <ctype.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <curl/curl.h>

#include "core.h"
#include "hub_impl.h"

#define MAX_HOPS 10
#define MAX_TOTAL_ATTEMPTS 200 // hard stop even when every retry makes progress

static pthread_once_t g_curl_once = PTHREAD_ONCE_INIT;
static CURLcode g_curl_init_rc = CURLE_FAILED_INIT;

static void curl_init_once(void)
{
    g_curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT);
}

// ---- URLs -------------------------------------------------------------------------

int tdm_hub_url_origin(const char *url, char *out, size_t cap)
{
    int rc = -1;
    char *scheme = NULL, *host = NULL, *port = NULL;
    CURLU *u = curl_url();
    if (!u)
        return -1;
    if (curl_url_set(u, CURLUPART_URL, url, 0) != CURLUE_OK)
        goto done;
    if (curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK ||
        curl_url_get(u, CURLUPART_HOST, &host, 0) != CURLUE_OK ||
        curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) != CURLUE_OK)
        goto done;
    for (char *p = host; *p; p++)
        *p = (char)tolower((unsigned char)*p);
    if ((size_t)snprintf(out, cap, "%s://%s:%s", scheme, host, port) < cap)
        rc = 0;
done:
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
    curl_url_cleanup(u);
    return rc;
}

static bool same_origin(const char *origin, const char *url)
{
    char o[512];
    return origin && tdm_hub_url_origin(url, o, sizeof o) == 0 && strcmp(o, origin) == 0;
}

// ---- one request ------------------------------------------------------------------

struct progress {
    const char *label;
    enum tdm_hub_progress mode;
    long long total;   // expected size, -1 unknown
    long long base;    // bytes on disk when the current request started
    long long fetched; // bytes received over the network, all attempts
    double t0, last_draw;
    bool drawn;
};

struct resp {
    long status;
    char *location;     // raw Location header
    char *redirect_url; // Location resolved against the request URL (3xx only)
    char commit[64];
    char etag[160];
    char linked_etag[160];
    long long linked_size, content_length;
    long long range_start; // from Content-Range, -1 if none
    char error_code[64];   // X-Error-Code
    // download side (fp == NULL for HEAD)
    FILE *fp;
    long long resume_from;
    long long received; // body bytes written by this request
    bool restarted;     // a 200 answered our Range: file truncated
    bool bad_range;     // a 206 that does not start where we asked
    bool write_failed;
    struct progress *pg;
};

static void resp_reset(struct resp *r)
{
    free(r->location);
    free(r->redirect_url);
    r->location = r->redirect_url = NULL;
    r->status = 0;
    r->commit[0] = r->etag[0] = r->linked_etag[0] = r->error_code[0] = '\0';
    r->linked_size = r->content_length = r->range_start = -1;
}

static void copy_trim(char *dst, size_t cap, const char *v, size_t n)
{
    while (n > 0 && (v[n - 1] == '\r' || v[n - 1] == '\n' || v[n - 1] == ' ' || v[n - 1] == '\t'))
        n--;
    while (n > 0 && (*v == ' ' || *v == '\t'))
        v++, n--;
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, v, n);
    dst[n] = '\0';
}

static bool header_is(const char *line, size_t n, const char *name, const char **val, size_t *vlen)
{
    size_t k = strlen(name);
    if (n <= k || line[k] != ':' || strncasecmp(line, name, k) != 0)
        return false;
    *val = line + k + 1;
    *vlen = n - k - 1;
    return true;
}

static long long parse_ll(const char *v, size_t n)
{
    char tmp[32];
    copy_trim(tmp, sizeof tmp, v, n);
    char *end;
    errno = 0;
    long long x = strtoll(tmp, &end, 10);
    if (errno || end == tmp || *end || x < 0)
        return -1;
    return x;
}

static size_t on_header(char *line, size_t size, size_t nitems, void *ud)
{
    struct resp *r = ud;
    size_t n = size * nitems;
    const char *v;
    size_t vn;
    if (n >= 5 && strncmp(line, "HTTP/", 5) == 0) {
        resp_reset(r); // a new response (after 1xx): forget the previous headers
        const char *sp = memchr(line, ' ', n);
        if (sp)
            r->status = strtol(sp + 1, NULL, 10);
    } else if (n <= 2 && (line[0] == '\r' || line[0] == '\n')) {
        // End of headers: decide how the body lands in the partial file.
        if (r->fp && r->status == 200 && r->resume_from > 0) {
            if (ftruncate(fileno(r->fp), 0) != 0)
                r->write_failed = true;
            r->resume_from = 0;
            r->restarted = true;
            if (r->pg)
                r->pg->base = 0;
        } else if (r->fp && r->status == 206 && r->range_start != r->resume_from) {
            r->bad_range = true;
            return 0; // abort: appending would corrupt the file
        }
    } else if (header_is(line, n, "Location", &v, &vn)) {
        char tmp[4096];
        copy_trim(tmp, sizeof tmp, v, vn);
        free(r->location);
        r->location = strdup(tmp);
    } else if (header_is(line, n, "X-Repo-Commit", &v, &vn)) {
        copy_trim(r->commit, sizeof r->commit, v, vn);
    } else if (header_is(line, n, "X-Linked-Etag", &v, &vn)) {
        copy_trim(r->linked_etag, sizeof r->linked_etag, v, vn);
    } else if (header_is(line, n, "ETag", &v, &vn)) {
        copy_trim(r->etag, sizeof r->etag, v, vn);
    } else if (header_is(line, n, "X-Linked-Size", &v, &vn)) {
        r->linked_size = parse_ll(v, vn);
    } else if (header_is(line, n, "Content-Length", &v, &vn)) {
        r->content_length = parse_ll(v, vn);
    } else if (header_is(line, n, "X-Error-Code", &v, &vn)) {
        copy_trim(r->error_code, sizeof r->error_code, v, vn);
    } else if (header_is(line, n, "Content-Range", &v, &vn)) {
        char tmp[96];
        copy_trim(tmp, sizeof tmp, v, vn);
        long long a;
        r->range_start = sscanf(tmp, "bytes %lld-", &a) == 1 ? a : -1;
    }
    return n;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *ud)
{
    struct resp *r = ud;
    size_t n = size * nmemb;
    if (!r->fp || r->status < 200 || r->status >= 300)
        return n; // redirect or error bodies are not file content
    if (fwrite(data, 1, n, r->fp) != n) {
        r->write_failed = true;
        return 0;
    }
    r->received += (long long)n;
    if (r->pg)
        r->pg->fetched += (long long)n;
    return n;
}

static void draw_bar(struct progress *pg, bool final)
{
    double now = tdm_now();
    if (!final && now - pg->last_draw < 0.1)
        return;
    pg->last_draw = now;
    double el = now - pg->t0 > 1e-6 ? now - pg->t0 : 1e-6;
    double rate = (double)pg->fetched / el / 1e6;
    long long done = pg->base;
    const char *name = pg->label;
    size_t ln = strlen(name);
    if (ln > 40)
        name += ln - 40;
    if (pg->total > 0) {
        double pct = 100.0 * (double)done / (double)pg->total;
        int w = 24, fillc = (int)(pct / 100.0 * w + 0.5);
        char bar[32];
        for (int i = 0; i < w; i++)
            bar[i] = i < fillc ? '#' : '.';
        bar[w] = '\0';
        fprintf(stderr, "\r%-40s [%s] %8.1f/%.1f MB %5.1f%% %7.2f MB/s", name, bar, done / 1e6,
                pg->total / 1e6, pct, rate);
    } else {
        fprintf(stderr, "\r%-40s %8.1f MB %7.2f MB/s", name, done / 1e6, rate);
    }
    if (final)
        fputc('\n', stderr);
    fflush(stderr);
    pg->drawn = true;
}

static int on_progress(void *ud, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow)
{
    (void)dltotal, (void)ultotal, (void)ulnow;
    struct resp *r = ud;
    struct progress *pg = r->pg;
    if (pg && pg->mode == TDM_HUB_PROGRESS_BAR && r->status >= 200 && r->status < 300) {
        long long save = pg->base;
        pg->base = r->resume_from + (long long)dlnow;
        draw_bar(pg, false);
        pg->base = save;
    }
    return 0;
}

// One request, no redirects followed. Returns the curl code; r holds the answer.
static CURLcode perform(const struct tdm_hub_client *c, const char *url, bool head, struct resp *r)
{
    CURL *h = curl_easy_init();
    if (!h)
        return CURLE_FAILED_INIT;
    struct curl_slist *hdrs = NULL, *tmp;
    char line[4096 + 32];
    bool ok = true;
#define ADD_HDR(s)                                                                                 \
    do {                                                                                           \
        if (ok && (tmp = curl_slist_append(hdrs, (s))) != NULL)                                    \
            hdrs = tmp;                                                                            \
        else                                                                                       \
            ok = false;                                                                            \
    } while (0)
    // identity: the sizes we verify are those of the raw bytes.
    ADD_HDR("Accept-Encoding: identity");
    if (c->token && same_origin(c->auth_origin, url)) {
        snprintf(line, sizeof line, "Authorization: Bearer %s", c->token);
        ADD_HDR(line);
    }
    if (!head && r->resume_from > 0) {
        snprintf(line, sizeof line, "Range: bytes=%lld-", r->resume_from);
        ADD_HDR(line);
    }
#undef ADD_HDR
    if (!ok) {
        curl_slist_free_all(hdrs);
        curl_easy_cleanup(h);
        return CURLE_OUT_OF_MEMORY;
    }
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(h, CURLOPT_USERAGENT, "tandem/0.1 (hub; libcurl)");
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, (long)(c->connect_timeout_s * 1000));
    // Stall detection: under 1 byte/s for stall_timeout_s aborts (then we resume).
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, (long)(c->stall_timeout_s + 0.999));
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, r);
    if (head)
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    if (r->pg && r->pg->mode == TDM_HUB_PROGRESS_BAR) {
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, on_progress);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, r);
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
    }
    CURLcode rc = curl_easy_perform(h);
    if (rc == CURLE_OK && r->status == 0) {
        long code = 0;
        curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &code);
        r->status = code;
    }
    // Resolve a redirect against this URL (curl knows relative-reference rules).
    if (rc == CURLE_OK && r->status >= 300 && r->status < 400) {
        char *abs = NULL;
        curl_easy_getinfo(h, CURLINFO_REDIRECT_URL, &abs);
        if (abs && r->location)
            r->redirect_url = strdup(abs); // NULL on ENOMEM: treated as "no redirect"
    }
    curl_slist_free_all(hdrs);
    curl_easy_cleanup(h);
    return rc;
}

static const char *loc_abs(const struct resp *r)
{
    return r->redirect_url;
}

static bool loc_is_relative(const struct resp *r)
{
    // huggingface_hub: a Location without a network location is relative.
    return r->location && !strstr(r->location, "://") &&
           !(r->location[0] == '/' && r->location[1] == '/');
}

// A host that does not resolve or refuses the connection will not do better a
// second later: no network, a wrong HF_ENDPOINT, a proxy that is not there.
// Those fail at once with what to do instead; retries are for timeouts, dropped
// links and 5xx answers.
static bool unreachable_curl(CURLcode rc)
{
    return rc == CURLE_COULDNT_RESOLVE_HOST || rc == CURLE_COULDNT_RESOLVE_PROXY ||
           rc == CURLE_COULDNT_CONNECT;
}

static const char *unreachable_hint(CURLcode rc)
{
    return unreachable_curl(rc)
               ? " (the Hub cannot be reached from here: serve a local folder with --model DIR, "
                 "set HF_HUB_OFFLINE=1 when the model is already in the HF cache, or run "
                 "tandem-download ORG/NAME where there is network and copy $HF_HOME over)"
               : "";
}

static bool retryable_curl(CURLcode rc)
{
    switch (rc) {
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_PARTIAL_FILE:
    case CURLE_GOT_NOTHING:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
        return true;
    default:
        return false;
    }
}

static void backoff(const struct tdm_hub_client *c, int attempt)
{
    double s = c->retry_base_s;
    for (int i = 0; i < attempt && s < 10.0; i++)
        s *= 2;
    if (s > 10.0)
        s = 10.0;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

// Error for a final non-2xx status. 401/403: the Hub answers 401 for private,
// gated and unknown repos alike, so the message covers all three.
static int status_error(const struct resp *r, const char *url, char *err, size_t errlen)
{
    if (r->status == 401 || r->status == 403)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "HTTP %ld for %s: the repo is private, gated or does not exist; set "
                          "HF_TOKEN to a token that has access%s%s%s",
                          r->status, url, r->error_code[0] ? " (" : "", r->error_code,
                          r->error_code[0] ? ")" : "");
    if (r->status == 404)
        return tdm_seterr(err, errlen, TDM_ENOTFOUND,
                          "model or file not found (HTTP 404): %s%s%s%s", url,
                          r->error_code[0] ? " (" : "", r->error_code, r->error_code[0] ? ")" : "");
    return tdm_seterr(err, errlen, TDM_EPROTO, "HTTP %ld for %s", r->status, url);
}

static bool retryable_status(long s)
{
    return s >= 500 || s == 429 || s == 408;
}

static void normalize_etag(char *e)
{
    // W/"abc" and "abc" -> abc (huggingface_hub's _normalize_etag)
    char *p = e;
    if (p[0] == 'W' && p[1] == '/')
        p += 2;
    size_t n = strlen(p);
    if (n >= 2 && p[0] == '"' && p[n - 1] == '"') {
        p++;
        n -= 2;
    }
    memmove(e, p, n);
    e[n] = '\0';
}

// ---- HEAD -----------------------------------------------------------------------------

int tdm_hub_http_head(const struct tdm_hub_client *c, const char *url, struct tdm_hub_meta *m,
                      char *err, size_t errlen)
{
    pthread_once(&g_curl_once, curl_init_once);
    if (g_curl_init_rc != CURLE_OK)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "curl_global_init failed");
    memset(m, 0, sizeof *m);
    m->size = -1;
    struct resp r = {0};
    resp_reset(&r);
    char *cur = strdup(url);
    if (!cur)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    int rc = TDM_OK, attempt = 0, hops = 0;
    for (;;) {
        resp_reset(&r);
        CURLcode cr = perform(c, cur, true, &r);
        if (cr != CURLE_OK || retryable_status(r.status)) {
            if ((cr == CURLE_OK || retryable_curl(cr)) && attempt < c->max_retries) {
                TDM_LOG_WARN("hub", "HEAD %s failed (%s), retry %d/%d", cur,
                             cr != CURLE_OK ? curl_easy_strerror(cr) : "server error", attempt + 1,
                             c->max_retries);
                backoff(c, attempt++);
                continue;
            }
            rc = cr != CURLE_OK
                     ? tdm_seterr(err, errlen, TDM_ETRANSPORT, "HEAD %s: %s (after %d retries)%s",
                                  cur, curl_easy_strerror(cr), attempt, unreachable_hint(cr))
                     : status_error(&r, cur, err, errlen);
            goto done;
        }
        if (r.status >= 300 && r.status < 400 && loc_abs(&r)) {
            if (loc_is_relative(&r)) {
                if (++hops > MAX_HOPS) {
                    rc = tdm_seterr(err, errlen, TDM_EPROTO, "too many redirects from %s", url);
                    goto done;
                }
                char *next = strdup(loc_abs(&r));
                if (!next) {
                    rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
                    goto done;
                }
                free(cur);
                cur = next;
                continue;
            }
            m->location = strdup(loc_abs(&r));
        } else if (r.status >= 200 && r.status < 300) {
            m->location = strdup(cur);
        } else {
            rc = status_error(&r, cur, err, errlen);
            goto done;
        }
        if (!m->location) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto done;
        }
        snprintf(m->commit, sizeof m->commit, "%s", r.commit);
        snprintf(m->etag, sizeof m->etag, "%s", r.linked_etag[0] ? r.linked_etag : r.etag);
        normalize_etag(m->etag);
        m->size = r.linked_size >= 0 ? r.linked_size : r.content_length;
        break;
    }
done:
    free(cur);
    free(r.location);
    free(r.redirect_url);
    if (rc != TDM_OK) {
        free(m->location);
        m->location = NULL;
    }
    return rc;
}

// ---- GET into a partial file --------------------------------------------------------------

// One download's state across its attempts.
struct download {
    const struct tdm_hub_client *c;
    const char *url;         // the resolve URL every attempt starts at
    const char *dest;        // the partial file
    const char *label;       // the file's name in logs and the progress bar
    long long expected_size; // -1 unknown
    struct progress pg;
    struct resp r;      // r.pg points at pg
    char *cur;          // the URL of the attempt's last request (heap) or NULL
    int attempt;        // retries since the last attempt that made progress
    int total_attempts; // all attempts, bounded by MAX_TOTAL_ATTEMPTS
    int rc;             // the result once an attempt ends in ATTEMPT_FAILED
    char *err;
    size_t errlen;
};

// How an attempt ended: the file is whole, try again (after a backoff, already waited), or give
// up with d->rc and err filled.
enum attempt_end { ATTEMPT_COMPLETE, ATTEMPT_RETRY, ATTEMPT_FAILED };

// Opens dest to append what an earlier attempt or run left (emptied first when it is longer
// than expected) and sets d->cur to the resolve URL. Sets *whole, opening nothing, when the file
// already has every byte. Returns TDM_OK, TDM_EIO or TDM_ENOMEM.
static int start_attempt(struct download *d, bool *whole)
{
    struct stat st;
    long long have = stat(d->dest, &st) == 0 ? (long long)st.st_size : 0;
    if (d->expected_size >= 0 && have > d->expected_size) {
        if (truncate(d->dest, 0) != 0)
            return tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: %s", d->dest, strerror(errno));
        have = 0;
    }
    if (d->expected_size >= 0 && have == d->expected_size && have > 0) {
        *whole = true; // an earlier run got every byte
        return TDM_OK;
    }
    d->r.fp = fopen(d->dest, "ab");
    if (!d->r.fp)
        return tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: %s", d->dest, strerror(errno));
    d->r.resume_from = have;
    d->r.received = 0;
    d->r.restarted = d->r.bad_range = d->r.write_failed = false;
    d->pg.base = have;
    free(d->cur);
    d->cur = strdup(d->url); // every attempt starts at the resolve URL: CDN links expire
    if (!d->cur) {
        fclose(d->r.fp);
        return tdm_seterr(d->err, d->errlen, TDM_ENOMEM, "out of memory");
    }
    return TDM_OK;
}

// GETs d->cur into d->r.fp, following up to MAX_HOPS redirects (d->cur becomes the last URL);
// *cr is the last request's curl code. On failure closes d->r.fp and returns TDM_EPROTO or
// TDM_ENOMEM.
static int get_following_redirects(struct download *d, CURLcode *cr)
{
    for (int hops = 0;; hops++) {
        resp_reset(&d->r);
        *cr = perform(d->c, d->cur, false, &d->r);
        if (*cr != CURLE_OK || d->r.status < 300 || d->r.status >= 400 || !loc_abs(&d->r))
            return TDM_OK;
        if (hops >= MAX_HOPS) {
            fclose(d->r.fp);
            return tdm_seterr(d->err, d->errlen, TDM_EPROTO, "too many redirects from %s", d->url);
        }
        char *next = strdup(loc_abs(&d->r));
        if (!next) {
            fclose(d->r.fp);
            return tdm_seterr(d->err, d->errlen, TDM_ENOMEM, "out of memory");
        }
        free(d->cur);
        d->cur = next;
    }
}

// The file could not be written. A 206 for another range than asked starts the file over and
// retries; anything else is a write error.
static enum attempt_end after_write_failure(struct download *d)
{
    if (d->r.bad_range) {
        // A 206 from elsewhere than we asked: start the file over.
        if (truncate(d->dest, 0) != 0) {
            d->rc = tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: %s", d->dest, strerror(errno));
            return ATTEMPT_FAILED;
        }
        if (d->attempt < d->c->max_retries && d->total_attempts < MAX_TOTAL_ATTEMPTS) {
            TDM_LOG_WARN("hub", "%s: server answered an unexpected range, restarting", d->label);
            backoff(d->c, d->attempt++);
            return ATTEMPT_RETRY;
        }
        d->rc = tdm_seterr(d->err, d->errlen, TDM_EPROTO,
                           "%s: server keeps answering the wrong "
                           "byte range",
                           d->cur);
        return ATTEMPT_FAILED;
    }
    d->rc =
        tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: write failed: %s", d->dest, strerror(errno));
    return ATTEMPT_FAILED;
}

// A 2xx must leave the file at the expected size; another answer is retried (after a backoff)
// while it is retryable and the retries last.
static enum attempt_end judge_answer(struct download *d, CURLcode cr)
{
    const struct resp *r = &d->r;
    if (r->status == 416) {
        // What we hold does not fit the remote file: start over.
        if (truncate(d->dest, 0) != 0) {
            d->rc = tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: %s", d->dest, strerror(errno));
            return ATTEMPT_FAILED;
        }
    }
    if (r->restarted)
        TDM_LOG_INFO("hub", "%s: server ignored the Range request, downloading from the start",
                     d->label);
    bool ok2xx = cr == CURLE_OK && r->status >= 200 && r->status < 300;
    if (ok2xx) {
        struct stat st;
        if (stat(d->dest, &st) != 0) {
            d->rc = tdm_seterr(d->err, d->errlen, TDM_EIO, "%s: %s", d->dest, strerror(errno));
            return ATTEMPT_FAILED;
        }
        if (d->expected_size >= 0 && (long long)st.st_size != d->expected_size) {
            // A complete answer of the wrong length: not a dropped link.
            unlink(d->dest);
            d->rc = tdm_seterr(d->err, d->errlen, TDM_EPROTO,
                               "%s: size mismatch: got %lld bytes, the Hub reported %lld (%s); "
                               "partial file deleted",
                               d->label, (long long)st.st_size, d->expected_size, d->cur);
            return ATTEMPT_FAILED;
        }
        return ATTEMPT_COMPLETE;
    }
    bool retry =
        cr != CURLE_OK ? retryable_curl(cr) : (retryable_status(r->status) || r->status == 416);
    if (!retry) {
        d->rc = cr != CURLE_OK ? tdm_seterr(d->err, d->errlen, TDM_ETRANSPORT, "GET %s: %s%s",
                                            d->cur, curl_easy_strerror(cr), unreachable_hint(cr))
                               : status_error(r, d->cur, d->err, d->errlen);
        return ATTEMPT_FAILED;
    }
    if (r->received > 0)
        d->attempt = 0; // progress was made: the link works, just not for long
    if (d->attempt >= d->c->max_retries || d->total_attempts >= MAX_TOTAL_ATTEMPTS) {
        d->rc = tdm_seterr(
            d->err, d->errlen, TDM_ETRANSPORT, "GET %s: %s (gave up after %d attempts)", d->cur,
            cr != CURLE_OK ? curl_easy_strerror(cr) : "server error", d->total_attempts);
        return ATTEMPT_FAILED;
    }
    if (d->pg.drawn) {
        fputc('\n', stderr);
        d->pg.drawn = false;
    }
    TDM_LOG_WARN("hub", "%s: %s after %lld bytes, resuming (retry %d/%d)", d->label,
                 cr != CURLE_OK ? curl_easy_strerror(cr) : "server error",
                 r->resume_from + r->received, d->attempt + 1, d->c->max_retries);
    backoff(d->c, d->attempt++);
    return ATTEMPT_RETRY;
}

// One GET (with its redirects) that appends to the partial file.
static enum attempt_end run_attempt(struct download *d)
{
    bool whole = false;
    if ((d->rc = start_attempt(d, &whole)) != TDM_OK)
        return ATTEMPT_FAILED;
    if (whole)
        return ATTEMPT_COMPLETE;
    CURLcode cr = CURLE_OK;
    if ((d->rc = get_following_redirects(d, &cr)) != TDM_OK)
        return ATTEMPT_FAILED;
    bool flush_failed = fclose(d->r.fp) != 0;
    d->r.fp = NULL;
    d->total_attempts++;
    if (d->r.write_failed || flush_failed || cr == CURLE_WRITE_ERROR)
        return after_write_failure(d);
    return judge_answer(d, cr);
}

int tdm_hub_http_download(const struct tdm_hub_client *c, const char *url, const char *dest,
                          long long expected_size, const char *label, char *err, size_t errlen)
{
    pthread_once(&g_curl_once, curl_init_once);
    if (g_curl_init_rc != CURLE_OK)
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "curl_global_init failed");
    struct download d = {
        .c = c,
        .url = url,
        .dest = dest,
        .label = label,
        .expected_size = expected_size,
        .pg = {.label = label, .mode = c->progress, .total = expected_size, .t0 = tdm_now()},
        .rc = TDM_OK,
        .err = err,
        .errlen = errlen,
    };
    resp_reset(&d.r);
    d.r.pg = &d.pg;
    enum attempt_end end;
    do
        end = run_attempt(&d);
    while (end == ATTEMPT_RETRY);
    if (end == ATTEMPT_COMPLETE && d.pg.mode == TDM_HUB_PROGRESS_BAR) {
        struct stat st;
        d.pg.base = stat(dest, &st) == 0 ? (long long)st.st_size : 0;
        draw_bar(&d.pg, true);
    }
    if (d.rc != TDM_OK && d.pg.drawn)
        fputc('\n', stderr);
    free(d.cur);
    free(d.r.location);
    free(d.r.redirect_url);
    return d.rc;
}
