// SPDX-License-Identifier: Apache-2.0
// router config store: the active config and its hot reload. Readers take a
// reference to the active immutable config under a short mutex, so a swap
// never disturbs a request holding the old one. Reloads (SIGHUP through
// tdm_router_config_store_reload, or the watcher thread) are serialised by a
// second mutex; a new file that fails to parse leaves the old config active,
// logs one WARN line and counts result="failure".
//
// Watching: inotify on the file's directory, not the file, because editors
// and Kubernetes replace files rather than write them: a ConfigMap volume
// holds `config.yaml -> ..data/config.yaml` and `..data -> ..<timestamp>/`, and
// an update renames a new `..data` symlink over the old one, which a watch on
// the file itself never sees. Any event in the directory arms a debounce timer
// (a burst of events reloads once); the reload compares the bytes with the
// active config's and does nothing when they are equal. As a safety net the
// watcher also stats the path (following symlinks) every second and reloads
// when its inode, size or mtime changed.
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "config_impl.h"
#include "core.h"
#include "router_metrics.h"

#define MOD "router-config"

struct file_sig {
    bool valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtime;
};

struct tdm_router_config_store {
    char *path;
    struct tdm_router_metrics *metrics; // may be NULL

    pthread_mutex_t mu; // guards the fields up to the next blank line
    struct tdm_router_config *active;
    double loaded_at; // wall seconds
    char last_error[512];
    uint64_t n_success, n_failure;
    char *last_failed_text; // bytes of the last invalid file (watcher dedup), or NULL

    pthread_mutex_t reload_mu; // one reload at a time
    tdm_router_config_reload_fn on_reload;
    void *on_reload_arg;

    // watcher
    bool watching;
    pthread_t thread;
    int inotify_fd;
    int wake_fd[2]; // written by free to stop the thread
    int debounce_ms;
    struct file_sig sig;
};

static struct file_sig stat_sig(const char *path)
{
    struct file_sig s = {0};
    struct stat st;
    if (stat(path, &st) == 0) {
        s.valid = true;
        s.dev = st.st_dev;
        s.ino = st.st_ino;
        s.size = st.st_size;
        s.mtime = st.st_mtim;
    }
    return s;
}

static bool sig_equal(const struct file_sig *a, const struct file_sig *b)
{
    return a->valid == b->valid && a->dev == b->dev && a->ino == b->ino && a->size == b->size &&
           a->mtime.tv_sec == b->mtime.tv_sec && a->mtime.tv_nsec == b->mtime.tv_nsec;
}

int tdm_router_config_store_new(struct tdm_router_config_store **out, const char *path,
                                struct tdm_router_metrics *metrics, char *err, size_t errlen)
{
    *out = NULL;
    if (!path)
        return tdm_seterr(err, errlen, TDM_EINVAL, "no config path");
    struct tdm_router_config_store *st = calloc(1, sizeof *st);
    if (!st)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    st->inotify_fd = -1;
    st->wake_fd[0] = st->wake_fd[1] = -1;
    st->metrics = metrics;
    int rc = TDM_ENOMEM;
    st->path = strdup(path);
    if (!st->path) {
        tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_st;
    }
    st->sig = stat_sig(path);
    rc = tdm_router_config_load(&st->active, path, err, errlen);
    if (rc)
        goto fail_path;
    pthread_mutex_init(&st->mu, NULL);
    pthread_mutex_init(&st->reload_mu, NULL);
    st->loaded_at = tdm_wall_now();
    if (metrics)
        tdm_metrics_gauge_set(metrics->config_last_success, st->loaded_at);
    *out = st;
    return TDM_OK;

fail_path:
    free(st->path);
fail_st:
    free(st);
    return rc;
}

static void stop_watch(struct tdm_router_config_store *st)
{
    if (!st->watching)
        return;
    char b = 1;
    ssize_t w;
    do {
        w = write(st->wake_fd[1], &b, 1);
    } while (w < 0 && errno == EINTR);
    pthread_join(st->thread, NULL);
    st->watching = false;
    close(st->inotify_fd);
    close(st->wake_fd[0]);
    close(st->wake_fd[1]);
    st->inotify_fd = st->wake_fd[0] = st->wake_fd[1] = -1;
}

void tdm_router_config_store_free(struct tdm_router_config_store *st)
{
    if (!st)
        return;
    stop_watch(st);
    tdm_router_config_unref(st->active);
    pthread_mutex_destroy(&st->mu);
    pthread_mutex_destroy(&st->reload_mu);
    free(st->last_failed_text);
    free(st->path);
    free(st);
}

void tdm_router_config_store_on_reload(struct tdm_router_config_store *st,
                                       tdm_router_config_reload_fn fn, void *arg)
{
    pthread_mutex_lock(&st->reload_mu);
    st->on_reload = fn;
    st->on_reload_arg = arg;
    pthread_mutex_unlock(&st->reload_mu);
}

struct tdm_router_config *tdm_router_config_store_get(struct tdm_router_config_store *st,
                                                      double *loaded_at)
{
    pthread_mutex_lock(&st->mu);
    struct tdm_router_config *c = tdm_router_config_ref(st->active);
    if (loaded_at)
        *loaded_at = st->loaded_at;
    pthread_mutex_unlock(&st->mu);
    return c;
}

// The watcher passes from_watch: a file whose bytes already failed is not
// parsed, logged or counted again (one line per bad config, however many
// events its update makes).
static int reload(struct tdm_router_config_store *st, bool from_watch, char *err, size_t errlen)
{
    char detail[512] = "";
    char *text = NULL;
    size_t len = 0;
    pthread_mutex_lock(&st->reload_mu);
    st->sig = stat_sig(st->path);
    int rc = tdm_read_file(st->path, &text, &len, detail, sizeof detail);
    struct tdm_router_config *cur = tdm_router_config_store_get(st, NULL);
    struct tdm_router_config *next = NULL;
    if (!rc && cur->text_ && strlen(cur->text_) == len && memcmp(cur->text_, text, len) == 0) {
        // Same bytes: an editor's touch or one of several events of one update,
        // or the active config restored after a rejected edit. The file is what
        // runs, so no error stands (counters stay: nothing was loaded).
        tdm_router_config_unref(cur);
        free(text);
        free(st->last_failed_text);
        st->last_failed_text = NULL;
        pthread_mutex_lock(&st->mu);
        st->last_error[0] = '\0';
        pthread_mutex_unlock(&st->mu);
        pthread_mutex_unlock(&st->reload_mu);
        return TDM_OK;
    }
    if (!rc && from_watch && st->last_failed_text && strlen(st->last_failed_text) == len &&
        memcmp(st->last_failed_text, text, len) == 0) {
        tdm_router_config_unref(cur);
        free(text);
        pthread_mutex_unlock(&st->reload_mu);
        return TDM_EINVAL;
    }
    if (!rc) {
        char pdetail[480] = "";
        rc = tdm_router_config_parse(&next, text, len, st->path, pdetail, sizeof pdetail);
        if (rc) {
            snprintf(detail, sizeof detail, "%s: %s", st->path, pdetail);
            free(st->last_failed_text);
            st->last_failed_text = text; // kept for the dedup above
            text = NULL;
        }
    }
    free(text);
    double now = tdm_wall_now();
    if (rc) {
        pthread_mutex_lock(&st->mu);
        st->n_failure++;
        snprintf(st->last_error, sizeof st->last_error, "%s", detail);
        pthread_mutex_unlock(&st->mu);
        tdm_router_metrics_config_reload(st->metrics, false, now);
        TDM_LOG_WARN(MOD, "config reload failed, keeping the active config: %s", detail);
        tdm_router_config_unref(cur);
        pthread_mutex_unlock(&st->reload_mu);
        return tdm_seterr(err, errlen, rc, "%s", detail);
    }
    free(st->last_failed_text);
    st->last_failed_text = NULL;
    pthread_mutex_lock(&st->mu);
    struct tdm_router_config *old = st->active; // the store's reference moves to us
    st->active = next;
    st->loaded_at = now;
    st->n_success++;
    st->last_error[0] = '\0';
    pthread_mutex_unlock(&st->mu);
    tdm_router_metrics_config_reload(st->metrics, true, now);
    TDM_LOG_INFO(MOD, "config reloaded from %s: policy=%s profiles=%zu pd=%s threshold=%d",
                 st->path, next->short_policy ? next->short_policy : "plugins", next->n_profiles,
                 next->pd_mode == TDM_ROUTER_PD_PREFIX   ? "prefix"
                 : next->pd_mode == TDM_ROUTER_PD_ALWAYS ? "always"
                                                         : "never",
                 next->pd_threshold_tokens);
    if (st->on_reload)
        st->on_reload(next, old, st->on_reload_arg);
    tdm_router_config_unref(old);
    tdm_router_config_unref(cur);
    pthread_mutex_unlock(&st->reload_mu);
    return TDM_OK;
}

int tdm_router_config_store_reload(struct tdm_router_config_store *st, char *err, size_t errlen)
{
    return reload(st, false, err, errlen);
}

// Reads and discards pending inotify events; true when there were any.
static bool drain_inotify(int fd)
{
    char buf[4096] __attribute__((aligned(__alignof__(struct inotify_event))));
    bool any = false;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n <= 0)
            return any;
        any = true;
    }
}

static void *watch_main(void *arg)
{
    struct tdm_router_config_store *st = arg;
    double pending_at = -1; // monotonic time a debounced reload is due; < 0 = none
    double next_stat = tdm_now() + 1.0;
    for (;;) {
        double now = tdm_now();
        double due = pending_at >= 0 && pending_at < next_stat ? pending_at : next_stat;
        int timeout_ms = due > now ? (int)((due - now) * 1000.0) + 1 : 0;
        struct pollfd pfd[2] = {{st->inotify_fd, POLLIN, 0}, {st->wake_fd[0], POLLIN, 0}};
        int n = poll(pfd, 2, timeout_ms);
        if (n < 0 && errno != EINTR)
            break;
        if (n > 0 && pfd[1].revents)
            break;
        now = tdm_now();
        if (n > 0 && (pfd[0].revents & POLLIN) && drain_inotify(st->inotify_fd))
            pending_at = now + st->debounce_ms / 1000.0;
        bool want = false;
        if (pending_at >= 0 && now >= pending_at) {
            pending_at = -1;
            want = true;
        }
        if (now >= next_stat) {
            next_stat = now + 1.0;
            struct file_sig s = stat_sig(st->path);
            pthread_mutex_lock(&st->reload_mu); // st->sig is written by reloads
            if (s.valid && !sig_equal(&s, &st->sig))
                want = true;
            pthread_mutex_unlock(&st->reload_mu);
        }
        if (want) {
            // A half-swapped ConfigMap may briefly lack the file: that is a
            // failed reload (old config kept) and the next event retries.
            (void)reload(st, true, NULL, 0);
        }
    }
    return NULL;
}

int tdm_router_config_store_watch(struct tdm_router_config_store *st, int debounce_ms, char *err,
                                  size_t errlen)
{
    if (st->watching)
        return TDM_OK;
    st->debounce_ms = debounce_ms > 0 ? debounce_ms : 100;
    char *dup = strdup(st->path);
    if (!dup)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    const char *dir = dirname(dup);
    int rc = TDM_EIO;
    st->inotify_fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (st->inotify_fd < 0) {
        tdm_seterr(err, errlen, TDM_EIO, "inotify_init1: %s", strerror(errno));
        goto fail_dup;
    }
    if (inotify_add_watch(st->inotify_fd, dir,
                          IN_CLOSE_WRITE | IN_MOVED_TO | IN_MOVED_FROM | IN_CREATE | IN_DELETE |
                              IN_MODIFY | IN_ATTRIB) < 0) {
        tdm_seterr(err, errlen, TDM_EIO, "inotify watch on %s: %s", dir, strerror(errno));
        goto fail_fd;
    }
    if (pipe2(st->wake_fd, O_CLOEXEC | O_NONBLOCK) < 0) {
        tdm_seterr(err, errlen, TDM_EIO, "pipe: %s", strerror(errno));
        goto fail_fd;
    }
    if (pthread_create(&st->thread, NULL, watch_main, st) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "cannot start the config watcher thread");
        goto fail_pipe;
    }
    st->watching = true;
    TDM_LOG_INFO(MOD, "watching %s for config changes", st->path);
    free(dup);
    return TDM_OK;

fail_pipe:
    close(st->wake_fd[0]);
    close(st->wake_fd[1]);
    st->wake_fd[0] = st->wake_fd[1] = -1;
fail_fd:
    close(st->inotify_fd);
    st->inotify_fd = -1;
fail_dup:
    free(dup);
    return rc;
}

void tdm_router_config_store_counts(struct tdm_router_config_store *st, uint64_t *success,
                                    uint64_t *failure)
{
    pthread_mutex_lock(&st->mu);
    if (success)
        *success = st->n_success;
    if (failure)
        *failure = st->n_failure;
    pthread_mutex_unlock(&st->mu);
}

cJSON *tdm_router_config_store_json_object_(struct tdm_router_config_store *st)
{
    pthread_mutex_lock(&st->mu);
    struct tdm_router_config *cfg = tdm_router_config_ref(st->active);
    double loaded_at = st->loaded_at;
    uint64_t ns = st->n_success, nf = st->n_failure;
    char last_error[sizeof st->last_error];
    memcpy(last_error, st->last_error, sizeof last_error);
    pthread_mutex_unlock(&st->mu);

    cJSON *o = tdm_router_config_json_object_(cfg, loaded_at);
    if (o) {
        cJSON *r = cJSON_AddObjectToObject(o, "reloads");
        if (r) {
            cJSON_AddNumberToObject(r, "success", (double)ns);
            cJSON_AddNumberToObject(r, "failure", (double)nf);
        }
        if (last_error[0])
            cJSON_AddStringToObject(o, "last_error", last_error);
        else
            cJSON_AddNullToObject(o, "last_error");
    }
    tdm_router_config_unref(cfg);
    return o;
}

char *tdm_router_config_store_json(struct tdm_router_config_store *st)
{
    cJSON *o = tdm_router_config_store_json_object_(st);
    if (!o)
        return NULL;
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}
