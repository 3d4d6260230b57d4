// SPDX-License-Identifier: Apache-2.0
// core: errors, logging, clocks, monotonic timed waits, detached threads and
// file helpers shared by every module.
// Logging writes each event as one line with a single fprintf so lines from
// different threads never interleave.
#include "core.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

_Atomic int tdm_log_level = TDM_LOG_LEVEL_INFO;
static const char *log_role = "tandem";
static void (*_Atomic log_sink)(int level, const char *module, const char *msg);

const char *tdm_strerror(int err)
{
    switch (err) {
    case TDM_OK: return "ok";
    case TDM_ENOMEM: return "out of memory";
    case TDM_EINVAL: return "invalid argument";
    case TDM_ETIMEDOUT: return "timed out";
    case TDM_ECLOSED: return "closed";
    case TDM_EBUSY: return "busy";
    case TDM_EPROTO: return "protocol or format error";
    case TDM_ENOTFOUND: return "not found";
    case TDM_ECAPACITY: return "out of capacity";
    case TDM_EBACKEND: return "backend failure";
    case TDM_ETRANSPORT: return "transport failure";
    case TDM_EIO: return "i/o error";
    default: return "unknown error";
    }
}

int tdm_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
{
    if (err && errlen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

void tdm_log_set_role(const char *role)
{
    log_role = role ? role : "tandem";
}

// The level a name means ("err", "warn", "info", "debug" in any case, or
// "error"); -1 for none.
static int log_level_of_name(const char *name)
{
    static const char *names[] = {"err", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (strcasecmp(name, names[i]) == 0)
            return i;
    return strcasecmp(name, "error") == 0 ? TDM_LOG_LEVEL_ERR : -1;
}

int tdm_log_set_level_name(const char *name)
{
    int level = log_level_of_name(name);
    if (level < 0)
        return TDM_EINVAL;
    atomic_store_explicit(&tdm_log_level, level, memory_order_relaxed);
    return TDM_OK;
}

int tdm_log_check_level_name(const char *name, char *err, size_t errlen)
{
    if (log_level_of_name(name) < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--log-level: expected err, warn, info or debug, got \"%.64s\"", name);
    return TDM_OK;
}

void tdm_log_set_sink(void (*sink)(int level, const char *module, const char *msg))
{
    atomic_store(&log_sink, sink);
}

static void log_line(int level, const char *module, const char *msg)
{
    static const char *lv[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    char tbuf[32];
    strftime(tbuf, sizeof tbuf, "%Y-%m-%dT%H:%M:%S", &tm);
    if (level < 0)
        level = 0;
    if (level > 3)
        level = 3;
    fprintf(stderr, "%s.%03ldZ %s %s %s %s\n", tbuf, ts.tv_nsec / 1000000, lv[level], log_role,
            module ? module : "-", msg);
}

// One formatted message to the sink, or to stderr when none is set.
static void log_deliver(int level, const char *module, const char *msg)
{
    void (*sink)(int, const char *, const char *) = atomic_load(&log_sink);
    if (sink != NULL)
        sink(level, module, msg);
    else
        log_line(level, module, msg);
}

void tdm_log_write(int level, const char *module, const char *fmt, ...)
{
    char msg[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    log_deliver(level, module, msg);
}

void tdm_log_emit(int level, const char *module, const char *msg)
{
    if (level <= atomic_load_explicit(&tdm_log_level, memory_order_relaxed))
        log_deliver(level, module, msg ? msg : "");
}

void tdm_panic(const char *file, int line, const char *what)
{
    fprintf(stderr, "tandem: internal error at %s:%d: assertion failed: %s\n", file, line, what);
    abort();
}

uint64_t tdm_splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void tdm_rng_seed(struct tdm_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        r->s[i] = tdm_splitmix64(&seed);
}

uint64_t tdm_rng_next(struct tdm_rng *r)
{
    uint64_t *s = r->s;
    uint64_t result = tdm_rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = tdm_rotl64(s[3], 45);
    return result;
}

double tdm_rng_uniform(struct tdm_rng *r)
{
    return (double)(tdm_rng_next(r) >> 11) * 0x1.0p-53;
}

double tdm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void tdm_sleep(double seconds)
{
    if (!(seconds > 0))
        return;
    struct timespec ts = {(time_t)seconds, (long)((seconds - (double)(time_t)seconds) * 1e9)};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

double tdm_wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

const char *tdm_finish_name(enum tdm_finish reason)
{
    static const char *const names[TDM_FINISH_COUNT] = {NULL, "stop", "length", "abort", "error"};
    return (unsigned)reason < TDM_FINISH_COUNT ? names[reason] : NULL;
}

const char *tdm_constraint_kind_name(enum tdm_constraint_kind kind)
{
    static const char *const names[TDM_CONSTRAINT_COUNT] = {NULL,    "json_schema", "json_object",
                                                            "regex", "choice",      "grammar"};
    return (unsigned)kind < TDM_CONSTRAINT_COUNT ? names[kind] : NULL;
}

int tdm_cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a) != 0)
        return TDM_ENOMEM;
    int rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc == 0 ? TDM_OK : TDM_ENOMEM;
}

bool tdm_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double deadline)
{
    if (deadline < 0) {
        pthread_cond_wait(cv, mu);
        return true;
    }
    double rem = deadline - tdm_now();
    if (rem <= 0)
        return false;
    if (rem > 1e6) // keeps tv_sec far from overflow; the caller loops anyway
        rem = 1e6;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    time_t whole = (time_t)rem;
    ts.tv_sec += whole;
    ts.tv_nsec += (long)((rem - (double)whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return pthread_cond_timedwait(cv, mu, &ts) != ETIMEDOUT || tdm_now() < deadline;
}

bool tdm_cond_wait_for(pthread_cond_t *cv, pthread_mutex_t *mu, double seconds)
{
    return tdm_cond_wait_until(cv, mu, tdm_now() + (seconds > 0 ? seconds : 0));
}

// ---- detached threads, reused -----------------------------------------------------------
// A thread whose function returned waits up to THREAD_IDLE_SECONDS for the
// next one (at most THREAD_IDLE_MAX threads wait), so a request's job thread
// is usually a waiting one woken, not a clone() and a new stack on the
// request's path. A piece of work is only queued when a waiting thread is
// there to take it (idle > queued), never left behind a busy one. Two pools
// work this way: the job threads (the default stack) and the deep threads
// of tdm_call_deep (TDM_DEEP_STACK_BYTES each).
#define THREAD_IDLE_SECONDS 30.0
#define THREAD_IDLE_MAX 64

struct thread_work {
    void *(*fn)(void *);
    void *arg;
    struct thread_work *next;
};

struct pool {
    pthread_once_t once;
    pthread_mutex_t mu;
    pthread_cond_t cv; // work queued (monotonic)
    struct thread_work *head, *tail;
    int queued, idle;
    size_t stack; // bytes; 0: the default
};

static struct pool threads = {.once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER};
static struct pool deep = {
    .once = PTHREAD_ONCE_INIT, .mu = PTHREAD_MUTEX_INITIALIZER, .stack = TDM_DEEP_STACK_BYTES};

static void pool_init(struct pool *p)
{
    if (tdm_cond_init(&p->cv) != TDM_OK)
        pthread_cond_init(&p->cv, NULL); // waits then run on the wall clock
}
static void threads_init(void)
{
    pool_init(&threads);
}
static void deep_init(void)
{
    pool_init(&deep);
}

static _Thread_local bool on_deep_thread;

struct pool_start {
    struct pool *pool;
    struct thread_work *w;
};

static void *pool_main(void *arg)
{
    struct pool_start *st = arg;
    struct pool *p = st->pool;
    struct thread_work *w = st->w;
    free(st);
    on_deep_thread = p == &deep;
    for (;;) {
        void *(*fn)(void *) = w->fn;
        void *fa = w->arg;
        free(w);
        fn(fa);
        pthread_mutex_lock(&p->mu);
        if (p->idle >= THREAD_IDLE_MAX) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        p->idle++;
        double deadline = tdm_now() + THREAD_IDLE_SECONDS;
        while (p->head == NULL && tdm_cond_wait_until(&p->cv, &p->mu, deadline))
            ;
        p->idle--;
        w = p->head;
        if (w == NULL) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        p->head = w->next;
        if (p->head == NULL)
            p->tail = NULL;
        p->queued--;
        pthread_mutex_unlock(&p->mu);
    }
}

// pthread_create with a stack of `stack` bytes (0: the default), detached or
// joinable (th set): 0 or pthread's error. The pools' threads and the
// engine's deep threads are made here.
static int thread_create(pthread_t *th, bool detached, size_t stack, void *(*fn)(void *),
                         void *arg)
{
    pthread_attr_t attr;
    int rc = pthread_attr_init(&attr);
    if (rc != 0)
        return rc;
    pthread_t own;
    if (detached)
        rc = pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (rc == 0 && stack)
        rc = pthread_attr_setstacksize(&attr, stack);
    if (rc == 0)
        rc = pthread_create(th ? th : &own, &attr, fn, arg);
    pthread_attr_destroy(&attr);
    return rc;
}

static int pool_start(struct pool *p, void *(*fn)(void *), void *arg)
{
    struct thread_work *w = malloc(sizeof *w);
    if (w == NULL)
        return TDM_EBUSY;
    *w = (struct thread_work){.fn = fn, .arg = arg};
    pthread_mutex_lock(&p->mu);
    if (p->idle > p->queued) {
        if (p->tail)
            p->tail->next = w;
        else
            p->head = w;
        p->tail = w;
        p->queued++;
        pthread_mutex_unlock(&p->mu);
        pthread_cond_signal(&p->cv);
        return TDM_OK;
    }
    pthread_mutex_unlock(&p->mu);
    struct pool_start *st = malloc(sizeof *st);
    if (st == NULL) {
        free(w);
        return TDM_EBUSY;
    }
    *st = (struct pool_start){.pool = p, .w = w};
    if (thread_create(NULL, true, p->stack, pool_main, st) != 0) {
        free(st);
        free(w);
        return TDM_EBUSY;
    }
    return TDM_OK;
}

int tdm_thread_start_detached(void *(*fn)(void *), void *arg)
{
    pthread_once(&threads.once, threads_init);
    return pool_start(&threads, fn, arg);
}

int tdm_thread_idle(void)
{
    pthread_mutex_lock(&threads.mu);
    int n = threads.idle;
    pthread_mutex_unlock(&threads.mu);
    return n;
}

// ---- deep calls ------------------------------------------------------------------------
// The caller's thread (a civetweb worker, ~100 KiB of stack) waits while a
// deep thread runs the call; the call's state lives on the caller's stack.
struct deep_call {
    void (*fn)(void *);
    void *arg;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
};

static void *deep_main(void *arg)
{
    struct deep_call *c = arg;
    c->fn(c->arg);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

struct deep_start {
    void *(*fn)(void *);
    void *arg;
};

static void *deep_thread_main(void *arg)
{
    struct deep_start st = *(struct deep_start *)arg;
    free(arg);
    on_deep_thread = true;
    return st.fn(st.arg);
}

int tdm_thread_create_deep(pthread_t *th, void *(*fn)(void *), void *arg)
{
    struct deep_start *st = malloc(sizeof *st);
    if (st == NULL)
        return TDM_EBUSY;
    *st = (struct deep_start){.fn = fn, .arg = arg};
    if (thread_create(th, false, TDM_DEEP_STACK_BYTES, deep_thread_main, st) != 0) {
        free(st);
        return TDM_EBUSY;
    }
    return TDM_OK;
}

int tdm_call_deep(void (*fn)(void *), void *arg)
{
    if (on_deep_thread) {
        fn(arg);
        return TDM_OK;
    }
    pthread_once(&deep.once, deep_init);
    struct deep_call c = {.fn = fn, .arg = arg, .done = false};
    if (pthread_mutex_init(&c.mu, NULL) != 0)
        return TDM_EBUSY;
    if (pthread_cond_init(&c.cv, NULL) != 0) {
        pthread_mutex_destroy(&c.mu);
        return TDM_EBUSY;
    }
    int rc = pool_start(&deep, deep_main, &c);
    if (rc == TDM_OK) {
        pthread_mutex_lock(&c.mu);
        while (!c.done)
            pthread_cond_wait(&c.cv, &c.mu);
        pthread_mutex_unlock(&c.mu);
    }
    pthread_cond_destroy(&c.cv);
    pthread_mutex_destroy(&c.mu);
    return rc;
}

int tdm_read_file(const char *path, char **out, size_t *len, char *err, size_t errlen)
{
    *out = NULL;
    if (len)
        *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) {
        int e = errno;
        return tdm_seterr(err, errlen, e == ENOENT ? TDM_ENOTFOUND : TDM_EIO, "%s: %s", path,
                          strerror(e));
    }
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
    }
    for (;;) {
        if (cap - n < 2) {
            size_t ncap = cap * 2;
            char *nb = realloc(buf, ncap);
            if (!nb) {
                free(buf);
                fclose(f);
                return tdm_seterr(err, errlen, TDM_ENOMEM, "%s: out of memory", path);
            }
            buf = nb;
            cap = ncap;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) {
            if (ferror(f)) {
                int e = errno;
                free(buf);
                fclose(f);
                return tdm_seterr(err, errlen, TDM_EIO, "%s: read failed: %s", path, strerror(e));
            }
            break;
        }
    }
    fclose(f);
    buf[n] = '\0';
    *out = buf;
    if (len)
        *len = n;
    return TDM_OK;
}

int tdm_mkdir_p(const char *path, bool parent_only, char *err, size_t errlen)
{
    char *p = strdup(path);
    if (!p)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    if (parent_only) {
        char *slash = strrchr(p, '/');
        if (!slash) {
            free(p);
            return TDM_OK;
        }
        *slash = '\0';
    }
    for (char *q = p + 1;; q++) {
        if (*q == '/' || *q == '\0') {
            char c = *q;
            *q = '\0';
            if (mkdir(p, 0755) != 0 && errno != EEXIST) {
                int e = errno;
                int rc = tdm_seterr(err, errlen, TDM_EIO, "mkdir %s: %s", p, strerror(e));
                free(p);
                return rc;
            }
            *q = c;
            if (c == '\0')
                break;
        }
    }
    free(p);
    return TDM_OK;
}

char *tdm_path_join(const char *dir, const char *name)
{
    size_t a = strlen(dir), b = strlen(name);
    char *p = malloc(a + b + 2);
    if (!p)
        return NULL;
    memcpy(p, dir, a);
    size_t k = a;
    if (a > 0 && dir[a - 1] != '/')
        p[k++] = '/';
    memcpy(p + k, name, b + 1);
    return p;
}

// ---- UTF-8 -------------------------------------------------------------------------------------

size_t tdm_utf8_next(const char *str, size_t n, size_t i, uint32_t *cp)
{
    const unsigned char *s = (const unsigned char *)str;
    unsigned char c = s[i];
    size_t len;
    uint32_t v;
    if (c < 0x80) {
        *cp = c;
        return 1;
    } else if ((c & 0xE0) == 0xC0) {
        len = 2;
        v = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3;
        v = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4;
        v = c & 0x07;
    } else {
        *cp = 0xFFFD;
        return 1;
    }
    if (i + len > n) {
        *cp = 0xFFFD;
        return 1;
    }
    for (size_t k = 1; k < len; k++) {
        if ((s[i + k] & 0xC0) != 0x80) {
            *cp = 0xFFFD;
            return 1;
        }
        v = (v << 6) | (s[i + k] & 0x3F);
    }
    *cp = v;
    return len;
}

int tdm_utf8_encode(uint32_t cp, char out[4])
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | (cp >> 12));
        out[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | ((cp >> 18) & 0x07));
    out[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// ---- growable arrays ---------------------------------------------------------------------------

int tdm_grow_realloc(void *pp, size_t *cap, size_t need, size_t elem, size_t first)
{
    if (need <= *cap)
        return TDM_OK;
    size_t nc = *cap ? *cap : (first ? first : 1);
    while (nc < need && nc <= SIZE_MAX / 2)
        nc *= 2; // at least once when *cap > 0: need > *cap
    if (nc < need || elem == 0 || nc > SIZE_MAX / elem)
        return TDM_ENOMEM;
    // The array pointer is read and written through memcpy: pp may point to
    // any object pointer type (all have void *'s representation here).
    void *old;
    memcpy(&old, pp, sizeof old);
    void *p = realloc(old, nc * elem);
    if (p == NULL)
        return TDM_ENOMEM;
    memcpy(pp, &p, sizeof p);
    *cap = nc;
    return TDM_OK;
}

// ---- growable text buffer ----------------------------------------------------------------------

int tdm_strbuf_reserve(struct tdm_strbuf *b, size_t more)
{
    if (b->failed)
        return TDM_ENOMEM;
    if (b->over)
        return TDM_ECAPACITY;
    if (b->limit && (more > b->limit || b->len > b->limit - more)) {
        b->over = true;
        return TDM_ECAPACITY;
    }
    if (more > SIZE_MAX / 2 - b->len - 1) {
        b->failed = true;
        return TDM_ENOMEM;
    }
    if (b->p != NULL && b->len + more + 1 <= b->cap)
        return TDM_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->len + more + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (p == NULL) {
        b->failed = true;
        return TDM_ENOMEM;
    }
    p[b->len] = '\0';
    b->p = p;
    b->cap = cap;
    return TDM_OK;
}

int tdm_strbuf_add(struct tdm_strbuf *b, const void *s, size_t n)
{
    int rc = tdm_strbuf_reserve(b, n);
    if (rc != TDM_OK)
        return rc;
    if (n)
        memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
    return TDM_OK;
}

int tdm_strbuf_adds(struct tdm_strbuf *b, const char *s)
{
    return tdm_strbuf_add(b, s, strlen(s));
}

int tdm_strbuf_addc(struct tdm_strbuf *b, char c)
{
    return tdm_strbuf_add(b, &c, 1);
}

int tdm_strbuf_add_json_string(struct tdm_strbuf *b, const char *s, size_t n, bool ascii)
{
    static const char hex[] = "0123456789abcdef";
    tdm_strbuf_addc(b, '"');
    size_t run = 0; // start of the bytes not yet copied
    for (size_t i = 0; i < n;) {
        unsigned char ch = (unsigned char)s[i];
        uint32_t cp = ch;
        size_t len = 1;
        if (ch >= 0x80 && ascii)
            len = tdm_utf8_next(s, n, i, &cp);
        bool plain = cp >= 0x20 && cp != '"' && cp != '\\' && !(ascii && cp > 0x7E);
        if (plain) { // copied with its run
            i += len;
            continue;
        }
        tdm_strbuf_add(b, s + run, i - run);
        char esc[12] = {'\\', 0};
        size_t m = 2;
        switch (cp) {
        case '"':
        case '\\':
            esc[1] = (char)cp;
            break;
        case '\b':
            esc[1] = 'b';
            break;
        case '\f':
            esc[1] = 'f';
            break;
        case '\n':
            esc[1] = 'n';
            break;
        case '\r':
            esc[1] = 'r';
            break;
        case '\t':
            esc[1] = 't';
            break;
        default:
            m = 0;
            for (int k = 0; k < (cp >= 0x10000 ? 2 : 1); k++) {
                uint32_t u = cp < 0x10000 ? cp
                             : k == 0     ? 0xD800 + ((cp - 0x10000) >> 10)
                                          : 0xDC00 + ((cp - 0x10000) & 0x3FF);
                esc[m++] = '\\';
                esc[m++] = 'u';
                for (int sh = 12; sh >= 0; sh -= 4)
                    esc[m++] = hex[(u >> sh) & 15];
            }
        }
        tdm_strbuf_add(b, esc, m);
        i += len;
        run = i;
    }
    tdm_strbuf_add(b, s + run, n - run);
    return tdm_strbuf_addc(b, '"');
}

void tdm_strbuf_fini(struct tdm_strbuf *b)
{
    if (b == NULL)
        return;
    free(b->p);
    *b = (struct tdm_strbuf){0};
}
