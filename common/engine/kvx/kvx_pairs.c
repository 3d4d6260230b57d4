// SPDX-License-Identifier: Apache-2.0
// kvx_pairs: which transport each (this worker, peer) pair got, for /health
// details and the tandem:kv_transfers_total{transport} metric's companion
// view; and the node identity the same-host test compares. A small array
// under a mutex: job threads note a transfer, the HTTP thread renders it.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "kvx.h"

struct pair {
    char peer[256];
    enum tdm_kvx_mode mode;
    char why[160];
    uint64_t transfers;
    uint64_t used;
};

struct tdm_kvx_pairs {
    pthread_mutex_t mu;
    int capacity;
    uint64_t tick;
    struct pair *p; // [capacity]; peer "" = free
};

int tdm_kvx_pairs_new(struct tdm_kvx_pairs **out, int capacity)
{
    *out = NULL;
    if (capacity < 1)
        return TDM_EINVAL;
    struct tdm_kvx_pairs *ps = calloc(1, sizeof *ps);
    if (ps == NULL)
        return TDM_ENOMEM;
    ps->p = calloc((size_t)capacity, sizeof *ps->p);
    if (ps->p == NULL) {
        free(ps);
        return TDM_ENOMEM;
    }
    ps->capacity = capacity;
    pthread_mutex_init(&ps->mu, NULL);
    *out = ps;
    return TDM_OK;
}

void tdm_kvx_pairs_free(struct tdm_kvx_pairs *ps)
{
    if (ps == NULL)
        return;
    pthread_mutex_destroy(&ps->mu);
    free(ps->p);
    free(ps);
}

void tdm_kvx_pairs_note(struct tdm_kvx_pairs *ps, const char *peer, enum tdm_kvx_mode m,
                        const char *why)
{
    if (ps == NULL || peer == NULL || peer[0] == '\0')
        return;
    pthread_mutex_lock(&ps->mu);
    struct pair *e = NULL, *lru = &ps->p[0];
    for (int i = 0; i < ps->capacity && e == NULL; i++) {
        if (strncmp(ps->p[i].peer, peer, sizeof ps->p[i].peer - 1) == 0 && ps->p[i].peer[0])
            e = &ps->p[i];
        if (ps->p[i].used < lru->used)
            lru = &ps->p[i];
    }
    if (e == NULL) {
        e = lru; // a free slot has used 0, so it is the least recent
        memset(e, 0, sizeof *e);
        snprintf(e->peer, sizeof e->peer, "%s", peer);
    }
    e->mode = m;
    snprintf(e->why, sizeof e->why, "%s", why ? why : "");
    e->transfers++;
    e->used = ++ps->tick;
    pthread_mutex_unlock(&ps->mu);
}

int tdm_kvx_pairs_get(struct tdm_kvx_pairs *ps, const char *peer, enum tdm_kvx_mode *m)
{
    int rc = -1;
    pthread_mutex_lock(&ps->mu);
    for (int i = 0; i < ps->capacity; i++) {
        if (ps->p[i].peer[0] && strcmp(ps->p[i].peer, peer) == 0) {
            *m = ps->p[i].mode;
            rc = 0;
            break;
        }
    }
    pthread_mutex_unlock(&ps->mu);
    return rc;
}

// Appends s as a JSON string body (quotes and backslashes escaped, controls dropped).
static size_t put_str(char *buf, size_t len, size_t at, const char *s)
{
    for (; *s && at + 3 < len; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch < 0x20)
            continue;
        if (ch == '"' || ch == '\\')
            buf[at++] = '\\';
        buf[at++] = (char)ch;
    }
    buf[at] = '\0';
    return at;
}

void tdm_kvx_pairs_json(struct tdm_kvx_pairs *ps, enum tdm_kvx_mode setting, char *buf,
                        size_t len)
{
    if (len < 64) {
        if (len > 0)
            buf[0] = '\0';
        return;
    }
    size_t at = (size_t)snprintf(buf, len, "\"kv_transfer\":{\"setting\":\"%s\",\"pairs\":[",
                                 tdm_kvx_mode_name(setting));
    size_t keep = len - 4; // room for "]}" and the NUL
    pthread_mutex_lock(&ps->mu);
    bool first = true;
    for (int i = 0; i < ps->capacity; i++) {
        const struct pair *e = &ps->p[i];
        if (e->peer[0] == '\0')
            continue;
        char one[768];
        size_t n = (size_t)snprintf(one, sizeof one, "%s{\"peer\":\"", first ? "" : ",");
        n = put_str(one, sizeof one, n, e->peer);
        n += (size_t)snprintf(one + n, sizeof one - n,
                              "\",\"transport\":\"%s\",\"transfers\":%llu,\"why\":\"",
                              tdm_kvx_mode_name(e->mode), (unsigned long long)e->transfers);
        if (n < sizeof one)
            n = put_str(one, sizeof one, n, e->why);
        if (n + 3 >= sizeof one || at + n + 2 > keep)
            break; // truncated: fewer pairs, still valid JSON
        memcpy(buf + at, one, n);
        memcpy(buf + at + n, "\"}", 3);
        at += n + 2;
        first = false;
    }
    pthread_mutex_unlock(&ps->mu);
    snprintf(buf + at, len - at, "]}");
}

void tdm_kvx_host_id(char *buf, size_t len)
{
    if (len == 0)
        return;
    buf[0] = '\0';
    const char *env = getenv("TANDEM_HOST_ID");
    if (env && env[0]) {
        snprintf(buf, len, "%s", env);
        return;
    }
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f == NULL)
        return;
    if (fgets(buf, (int)len, f) == NULL)
        buf[0] = '\0';
    fclose(f);
    buf[strcspn(buf, "\r\n")] = '\0';
}
