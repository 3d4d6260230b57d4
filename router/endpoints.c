// SPDX-License-Identifier: Apache-2.0
// router endpoints: the registry of workers (see endpoints.h for the model).
//
// Invariants: every field of struct endpoint and of the registry is guarded by
// reg->mu, except the configuration pointer's referent (immutable). No I/O
// happens under the mutex: DNS resolution and health checks copy what they
// need, work unlocked, then apply their results under the lock. An endpoint
// leaves the table only when it is draining and has no request in flight, so a
// request holding an id can always report on it (a report for a removed id is
// ignored). Endpoints present when the registry is created start healthy (the
// router serves before the first check); endpoints that appear later (DNS, a
// reload) start unhealthy and are checked at once, as a pod is only routed to
// once it is ready; such a new endpoint joins at its first successful check,
// while a failed one needs success_threshold. A turn from unhealthy to healthy clears the
// endpoint's prefix index: the worker most likely restarted with an empty cache.
//
// The request path enters mu twice per attempt: attempt_begin (snapshot, the
// caller's pick on the copy, hold and record what was picked: no endpoint can
// leave between the snapshot and the hold, so there is no retry loop) and
// attempt_end (report, release). The pick runs under mu: it is a policy over
// the copy (pure, no I/O), as cheap as the copy itself. reg->entries counts
// every entry by kind, for tests.
//
// The prefix index is an LRU set of 64-bit block hashes per endpoint: a node
// array linked twice (a hash chain per bucket, and the recency list), grown
// by doubling up to lru_capacity_per_server, evicting the least recently
// routed block beyond that. A hash's bucket is its low bits: tdm_kv_block_hash
// ends with an avalanche step (fmix64), so they are already uniform.
#include "endpoints.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>

#include "core.h"
#include "kv_cache.h"
#include "router_metrics.h"

#define MOD "router-endpoints"
#define NIL UINT32_MAX
#define MAX_DNS_ADDRS 256

// ---- block hashes (common/engine/kv's chained hash, so the index keys what workers cache) -------
size_t tdm_router_block_hashes(const int32_t *tokens, size_t n, int block_size, uint64_t root,
                               uint64_t *out, size_t cap)
{
    if (block_size <= 0 || !tokens)
        return 0;
    size_t nb = n / (size_t)block_size;
    uint64_t h = root;
    for (size_t i = 0; i < nb && i < cap; i++) {
        h = tdm_kv_block_hash(h, tokens + i * (size_t)block_size, block_size);
        out[i] = h;
    }
    return nb;
}

// ---- prefix LRU -------------------------------------------------------------------------------

struct lru_node {
    uint64_t hash;
    uint32_t prev, next; // recency list (prev toward the head = most recent)
    uint32_t chain;      // next node in the same bucket
};

struct prefix_lru {
    struct lru_node *nodes; // [alloc]
    uint32_t *buckets;      // [nbuckets] head node of each chain
    uint32_t alloc, n, cap, nbuckets;
    uint32_t head, tail, free_list;
};

static void lru_init(struct prefix_lru *l, uint32_t cap)
{
    memset(l, 0, sizeof *l);
    l->cap = cap;
    l->head = l->tail = l->free_list = NIL;
}

static void lru_fini(struct prefix_lru *l)
{
    free(l->nodes);
    free(l->buckets);
    lru_init(l, l->cap);
}

static uint32_t lru_find(const struct prefix_lru *l, uint64_t h)
{
    if (!l->nbuckets)
        return NIL;
    for (uint32_t i = l->buckets[h & (l->nbuckets - 1)]; i != NIL; i = l->nodes[i].chain)
        if (l->nodes[i].hash == h)
            return i;
    return NIL;
}

static void list_unlink(struct prefix_lru *l, uint32_t i)
{
    struct lru_node *n = &l->nodes[i];
    if (n->prev != NIL)
        l->nodes[n->prev].next = n->next;
    else
        l->head = n->next;
    if (n->next != NIL)
        l->nodes[n->next].prev = n->prev;
    else
        l->tail = n->prev;
}

static void list_push_head(struct prefix_lru *l, uint32_t i)
{
    l->nodes[i].prev = NIL;
    l->nodes[i].next = l->head;
    if (l->head != NIL)
        l->nodes[l->head].prev = i;
    l->head = i;
    if (l->tail == NIL)
        l->tail = i;
}

static void chain_unlink(struct prefix_lru *l, uint32_t i)
{
    uint32_t *p = &l->buckets[l->nodes[i].hash & (l->nbuckets - 1)];
    while (*p != i)
        p = &l->nodes[*p].chain;
    *p = l->nodes[i].chain;
}

static void lru_remove_node(struct prefix_lru *l, uint32_t i)
{
    chain_unlink(l, i);
    list_unlink(l, i);
    l->nodes[i].chain = l->free_list;
    l->free_list = i;
    l->n--;
}

static void lru_remove(struct prefix_lru *l, uint64_t h)
{
    uint32_t i = lru_find(l, h);
    if (i != NIL)
        lru_remove_node(l, i);
}

// Grows the node array (and the buckets with it); false on ENOMEM.
static bool lru_grow(struct prefix_lru *l)
{
    uint32_t na = l->alloc ? l->alloc * 2 : 64;
    if (na > l->cap)
        na = l->cap;
    struct lru_node *nn = realloc(l->nodes, (size_t)na * sizeof *nn);
    if (!nn)
        return false;
    l->nodes = nn;
    for (uint32_t i = na; i > l->alloc; i--) {
        nn[i - 1].chain = l->free_list;
        l->free_list = i - 1;
    }
    l->alloc = na;
    uint32_t nb = 1;
    while (nb < na)
        nb <<= 1;
    if (nb > l->nbuckets) {
        uint32_t *b = malloc((size_t)nb * sizeof *b);
        if (!b)
            return l->nbuckets > 0; // old buckets still work, only longer chains
        for (uint32_t i = 0; i < nb; i++)
            b[i] = NIL;
        for (uint32_t i = l->head; i != NIL; i = nn[i].next) {
            uint32_t s = (uint32_t)(nn[i].hash & (nb - 1));
            nn[i].chain = b[s];
            b[s] = i;
        }
        free(l->buckets);
        l->buckets = b;
        l->nbuckets = nb;
    }
    return true;
}

static void lru_insert(struct prefix_lru *l, uint64_t h)
{
    if (l->cap == 0)
        return;
    uint32_t i = lru_find(l, h);
    if (i != NIL) {
        list_unlink(l, i);
        list_push_head(l, i);
        return;
    }
    if (l->n >= l->cap)
        lru_remove_node(l, l->tail);
    if (l->free_list == NIL && !lru_grow(l))
        return; // out of memory: the index is approximate anyway
    i = l->free_list;
    l->free_list = l->nodes[i].chain;
    l->nodes[i].hash = h;
    uint32_t s = (uint32_t)(h & (l->nbuckets - 1));
    l->nodes[i].chain = l->buckets[s];
    l->buckets[s] = i;
    list_push_head(l, i);
    l->n++;
}

static void lru_set_cap(struct prefix_lru *l, uint32_t cap)
{
    l->cap = cap;
    while (l->n > cap)
        lru_remove_node(l, l->tail);
}

// ---- registry -----------------------------------------------------------------------------------

struct endpoint {
    uint64_t id;
    char name[TDM_ROUTER_NAME_MAX];
    char host[TDM_ROUTER_NAME_MAX];
    int http_port, nng_port;
    enum tdm_router_role role;
    bool wanted; // scratch for reconciliation
    bool healthy, draining;
    bool fresh;       // added after startup and never checked: its first success suffices
    double added_at;  // tdm_now() when it was added (startup grace)
    bool answered;    // an active check succeeded at least once
    bool grace_noted; // the "not answered within the grace" warning was logged
    bool busy;        // its last active check timed out while its load reports stayed fresh
    bool auth_failed; // its nng inbox refuses the router's control-plane handshake
    bool auth_logged; // the ERROR about it was logged (once until the handshake passes)
    bool link_down;   // the load poller's link to its inbox is down (set_link_down)
    int fails, succs; // consecutive failed / successful checks
    uint64_t health_epoch;
    int inflight;          // requests held (acquire .. release)
    int sent_since_report; // of those, held since the last report: <= inflight (release
                           // clamps it; a report resets it), the view's `unreported`
    struct tdm_router_load load;
    double load_at; // tdm_now() of the last report: load age and liveness
    bool has_load;
    double q_first, q_second; // send times of the first two queries since the last report
    uint64_t instance; // the worker's instance id from its last report (0: none)
    uint64_t kv_batch; // KvEvents.batch of the last report with events (0: none yet)
    struct prefix_lru lru;
};

// Last good resolution of one DNS name.
struct dns_state {
    char *name;
    int n;                              // addresses; -1 = never resolved
    char (*addrs)[TDM_ROUTER_NAME_MAX]; // [n]
};

struct tdm_router_endpoints {
    pthread_mutex_t mu;
    struct tdm_router_config *cfg; // reference
    struct tdm_router_metrics *metrics;
    struct endpoint **eps; // [n] by ascending id
    size_t n, cap;
    uint64_t next_id;
    uint64_t pick_seq;
    uint64_t rng;
    struct dns_state *dns; // [n_dns], parallel to cfg->dns_endpoints
    size_t n_dns;
    tdm_router_resolve_fn resolve;
    void *resolve_arg;
    bool health_due; // a new endpoint wants a check now

    struct tdm_router_lock_entries entries; // entries into mu by kind (lock_entries)

    pthread_mutex_t check_mu; // one health round / DNS refresh at a time

    pthread_t thread;
    bool running, stop;
    pthread_cond_t cv;
};

static uint64_t splitmix64(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Who enters the lock, for tdm_router_endpoints_lock_entries.
enum entry_kind { ENTRY_REQUEST, ENTRY_LIVENESS, ENTRY_OTHER };

// Takes reg->mu and counts the entry (under it: exact, no atomics).
static void reg_lock(struct tdm_router_endpoints *reg, enum entry_kind kind)
{
    pthread_mutex_lock(&reg->mu);
    if (kind == ENTRY_REQUEST)
        reg->entries.request++;
    else if (kind == ENTRY_LIVENESS)
        reg->entries.liveness++;
    else
        reg->entries.other++;
}

static void format_name(char *dst, const char *host, int port)
{
    if (strchr(host, ':'))
        snprintf(dst, TDM_ROUTER_NAME_MAX, "[%.*s]:%d", TDM_ROUTER_NAME_MAX - 10, host, port);
    else
        snprintf(dst, TDM_ROUTER_NAME_MAX, "%.*s:%d", TDM_ROUTER_NAME_MAX - 8, host, port);
}

static struct endpoint *find_by_name(struct tdm_router_endpoints *reg, const char *name)
{
    for (size_t i = 0; i < reg->n; i++)
        if (!strcmp(reg->eps[i]->name, name))
            return reg->eps[i];
    return NULL;
}

static struct endpoint *find_by_id(struct tdm_router_endpoints *reg, uint64_t id)
{
    // eps is sorted by id (ids grow, removal keeps the order): binary search.
    size_t lo = 0, hi = reg->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (reg->eps[mid]->id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < reg->n && reg->eps[lo]->id == id ? reg->eps[lo] : NULL;
}

// Why an endpoint is not healthy: NULL when it is.
static const char *unhealthy_reason(const struct endpoint *e, double now)
{
    if (e->healthy)
        return NULL;
    if (e->auth_failed)
        return "auth";
    if (!e->answered && now - e->added_at < TDM_ROUTER_STARTUP_GRACE_S)
        return "starting";
    return "health_check";
}

// The endpoint's health and reason series, as they stand (under mu).
static void publish_health(struct tdm_router_endpoints *reg, const struct endpoint *e)
{
    tdm_router_metrics_endpoint_health(reg->metrics, e->name, e->role, e->healthy,
                                       unhealthy_reason(e, tdm_now()));
}

static void fill_view(const struct tdm_router_endpoints *reg, const struct endpoint *e, double now,
                      struct tdm_router_endpoint_view *v);

// tandem:router_ready_endpoints{role}: the endpoints a policy can pick
// (tdm_router_endpoint_ready on their view), by role (under mu). Called
// wherever what it reads changes: health, draining, removal, the load
// poller's link (set_link_down) and a first report (not_up).
static void update_ready_gauges(struct tdm_router_endpoints *reg)
{
    if (!reg->metrics)
        return;
    size_t np = 0, nd = 0;
    double now = tdm_now();
    for (size_t i = 0; i < reg->n; i++) {
        struct tdm_router_endpoint_view v;
        fill_view(reg, reg->eps[i], now, &v);
        if (!tdm_router_endpoint_ready(&v))
            continue;
        if (tdm_router_role_can_prefill(v.role))
            np++;
        if (tdm_router_role_can_decode(v.role))
            nd++;
    }
    tdm_metrics_gauge_set(reg->metrics->ready_prefill, (double)np);
    tdm_metrics_gauge_set(reg->metrics->ready_decode, (double)nd);
}

// Adds an endpoint (under mu). NULL on ENOMEM.
static struct endpoint *add_endpoint(struct tdm_router_endpoints *reg, const char *host,
                                     int http_port, int nng_port, enum tdm_router_role role,
                                     bool healthy)
{
    if (tdm_grow(&reg->eps, &reg->cap, reg->n + 1, sizeof *reg->eps, 8) != TDM_OK)
        return NULL;
    struct endpoint *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->id = ++reg->next_id;
    snprintf(e->host, sizeof e->host, "%s", host);
    format_name(e->name, host, http_port);
    e->http_port = http_port;
    e->nng_port = nng_port;
    e->role = role;
    e->healthy = healthy;
    e->fresh = !healthy;
    e->added_at = tdm_now();
    e->health_epoch = 1;
    e->wanted = true;
    lru_init(&e->lru, (uint32_t)reg->cfg->lru_capacity_per_server);
    reg->eps[reg->n++] = e;
    if (!healthy)
        reg->health_due = true;
    publish_health(reg, e);
    TDM_LOG_INFO(MOD, "endpoint added: %s role=%s nng_port=%d", e->name,
                 role == TDM_ROUTER_ROLE_NONE ? "none" : tdm_router_role_name(role), nng_port);
    return e;
}

// Wants host:http_port in the registry (under mu): marks an existing one (and
// revives it from draining), or adds it.
static void want(struct tdm_router_endpoints *reg, const char *host, int http_port, int nng_port,
                 enum tdm_router_role role, bool healthy)
{
    char name[TDM_ROUTER_NAME_MAX];
    format_name(name, host, http_port);
    struct endpoint *e = find_by_name(reg, name);
    if (e) {
        e->wanted = true;
        e->nng_port = nng_port;
        e->role = role;
        if (e->draining) {
            e->draining = false;
            TDM_LOG_INFO(MOD, "endpoint %s is back", e->name);
        }
        return;
    }
    if (!add_endpoint(reg, host, http_port, nng_port, role, healthy))
        TDM_LOG_ERR(MOD, "out of memory adding endpoint %s", name);
}

static void reap(struct tdm_router_endpoints *reg);

// Rebuilds the wanted set from the config and the DNS results (under mu);
// endpoints no longer wanted start draining.
static void reconcile(struct tdm_router_endpoints *reg, bool initial)
{
    for (size_t i = 0; i < reg->n; i++)
        reg->eps[i]->wanted = false;
    const struct tdm_router_config *cfg = reg->cfg;
    for (size_t i = 0; i < cfg->n_static; i++) {
        const struct tdm_router_static_endpoint *s = &cfg->static_endpoints[i];
        want(reg, s->host, s->http_port, s->nng_port, s->role, initial);
    }
    for (size_t i = 0; i < reg->n_dns && i < cfg->n_dns; i++) {
        const struct tdm_router_dns_endpoint *d = &cfg->dns_endpoints[i];
        for (int k = 0; k < reg->dns[i].n; k++)
            want(reg, reg->dns[i].addrs[k], d->http_port, d->nng_port, d->role, false);
    }
    for (size_t i = 0; i < reg->n; i++) {
        struct endpoint *e = reg->eps[i];
        if (!e->wanted && !e->draining) {
            e->draining = true;
            TDM_LOG_INFO(MOD, "endpoint %s draining (%d in flight)", e->name, e->inflight);
        }
    }
    reap(reg);
    update_ready_gauges(reg);
}

// Removes drained endpoints with nothing in flight (under mu).
static void reap(struct tdm_router_endpoints *reg)
{
    size_t w = 0;
    bool changed = false;
    for (size_t i = 0; i < reg->n; i++) {
        struct endpoint *e = reg->eps[i];
        if (e->draining && e->inflight == 0) {
            TDM_LOG_INFO(MOD, "endpoint removed: %s", e->name);
            tdm_router_metrics_endpoint_health(reg->metrics, e->name, e->role, false, NULL);
            lru_fini(&e->lru);
            free(e);
            changed = true;
            continue;
        }
        reg->eps[w++] = e;
    }
    reg->n = w;
    if (changed)
        update_ready_gauges(reg);
}

// Makes reg->dns parallel to cfg->dns_endpoints, keeping results of names that
// stay (under mu). False on ENOMEM (the old table is kept).
static bool remap_dns(struct tdm_router_endpoints *reg, const struct tdm_router_config *cfg)
{
    struct dns_state *nd = calloc(cfg->n_dns ? cfg->n_dns : 1, sizeof *nd);
    if (!nd)
        return false;
    for (size_t i = 0; i < cfg->n_dns; i++) {
        nd[i].n = -1;
        for (size_t j = 0; j < reg->n_dns; j++)
            if (reg->dns[j].name && !strcmp(reg->dns[j].name, cfg->dns_endpoints[i].name)) {
                nd[i] = reg->dns[j];
                reg->dns[j].name = NULL;
                reg->dns[j].addrs = NULL;
                break;
            }
        if (!nd[i].name && !(nd[i].name = strdup(cfg->dns_endpoints[i].name))) {
            for (size_t k = 0; k <= i; k++) {
                free(nd[k].name);
                free(nd[k].addrs);
            }
            free(nd);
            return false;
        }
    }
    for (size_t j = 0; j < reg->n_dns; j++) {
        free(reg->dns[j].name);
        free(reg->dns[j].addrs);
    }
    free(reg->dns);
    reg->dns = nd;
    reg->n_dns = cfg->n_dns;
    return true;
}

int tdm_router_resolve_getaddrinfo(const char *name, char (*addrs)[TDM_ROUTER_NAME_MAX], int cap,
                                   void *arg)
{
    (void)arg;
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(name, NULL, &hints, &res) != 0)
        return -1;
    int n = 0;
    for (struct addrinfo *a = res; a && n < cap; a = a->ai_next) {
        char buf[INET6_ADDRSTRLEN];
        const void *src = a->ai_family == AF_INET
                              ? (const void *)&((struct sockaddr_in *)a->ai_addr)->sin_addr
                              : (const void *)&((struct sockaddr_in6 *)a->ai_addr)->sin6_addr;
        if ((a->ai_family != AF_INET && a->ai_family != AF_INET6) ||
            !inet_ntop(a->ai_family, src, buf, sizeof buf))
            continue;
        bool dup = false;
        for (int k = 0; k < n; k++)
            dup |= !strcmp(addrs[k], buf);
        if (!dup)
            snprintf(addrs[n++], TDM_ROUTER_NAME_MAX, "%s", buf);
    }
    freeaddrinfo(res);
    return n;
}

int tdm_router_endpoints_new(struct tdm_router_endpoints **out, const struct tdm_router_config *cfg,
                             struct tdm_router_metrics *metrics, char *err, size_t errlen)
{
    *out = NULL;
    if (!cfg)
        return tdm_seterr(err, errlen, TDM_EINVAL, "no config");
    struct tdm_router_endpoints *reg = calloc(1, sizeof *reg);
    if (!reg)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    pthread_mutex_init(&reg->mu, NULL);
    pthread_mutex_init(&reg->check_mu, NULL);
    tdm_cond_init(&reg->cv);
    reg->cfg = tdm_router_config_ref((struct tdm_router_config *)cfg);
    reg->metrics = metrics;
    reg->resolve = tdm_router_resolve_getaddrinfo;
    reg->rng = (uint64_t)(tdm_wall_now() * 1e9) ^ (uint64_t)(uintptr_t)reg;
    if (!remap_dns(reg, cfg)) {
        tdm_router_endpoints_free(reg);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    }
    reg_lock(reg, ENTRY_OTHER);
    reconcile(reg, true);
    reg->health_due = false;
    pthread_mutex_unlock(&reg->mu);
    *out = reg;
    return TDM_OK;
}

void tdm_router_endpoints_free(struct tdm_router_endpoints *reg)
{
    if (!reg)
        return;
    tdm_router_endpoints_stop(reg);
    for (size_t i = 0; i < reg->n; i++) {
        lru_fini(&reg->eps[i]->lru);
        free(reg->eps[i]);
    }
    free(reg->eps);
    for (size_t i = 0; i < reg->n_dns; i++) {
        free(reg->dns[i].name);
        free(reg->dns[i].addrs);
    }
    free(reg->dns);
    tdm_router_config_unref(reg->cfg);
    pthread_cond_destroy(&reg->cv);
    pthread_mutex_destroy(&reg->check_mu);
    pthread_mutex_destroy(&reg->mu);
    free(reg);
}

void tdm_router_endpoints_set_resolver(struct tdm_router_endpoints *reg, tdm_router_resolve_fn fn,
                                       void *arg)
{
    reg_lock(reg, ENTRY_OTHER);
    reg->resolve = fn ? fn : tdm_router_resolve_getaddrinfo;
    reg->resolve_arg = fn ? arg : NULL;
    pthread_mutex_unlock(&reg->mu);
}

void tdm_router_endpoints_set_seed(struct tdm_router_endpoints *reg, uint64_t seed)
{
    reg_lock(reg, ENTRY_OTHER);
    reg->rng = seed;
    pthread_mutex_unlock(&reg->mu);
}

int tdm_router_endpoints_refresh_dns(struct tdm_router_endpoints *reg)
{
    pthread_mutex_lock(&reg->check_mu);
    reg_lock(reg, ENTRY_OTHER);
    struct tdm_router_config *cfg = tdm_router_config_ref(reg->cfg);
    tdm_router_resolve_fn fn = reg->resolve;
    void *arg = reg->resolve_arg;
    pthread_mutex_unlock(&reg->mu);

    int rc = TDM_OK;
    char(*addrs)[TDM_ROUTER_NAME_MAX] = NULL;
    if (cfg->n_dns && !(addrs = malloc(MAX_DNS_ADDRS * sizeof *addrs)))
        rc = TDM_ENOMEM;
    for (size_t i = 0; !rc && i < cfg->n_dns; i++) {
        const char *name = cfg->dns_endpoints[i].name;
        int n = fn(name, addrs, MAX_DNS_ADDRS, arg);
        if (n < 0) {
            TDM_LOG_WARN(MOD, "dns name=%s does not resolve; keeping its endpoints", name);
            continue;
        }
        if (n > MAX_DNS_ADDRS)
            n = MAX_DNS_ADDRS;
        char(*copy)[TDM_ROUTER_NAME_MAX] = malloc((size_t)(n ? n : 1) * sizeof *copy);
        if (!copy) {
            rc = TDM_ENOMEM;
            break;
        }
        memcpy(copy, addrs, (size_t)n * sizeof *copy);
        reg_lock(reg, ENTRY_OTHER);
        // The config may have been swapped meanwhile: match by name.
        bool stored = false;
        for (size_t j = 0; j < reg->n_dns; j++)
            if (!strcmp(reg->dns[j].name, name)) {
                free(reg->dns[j].addrs);
                reg->dns[j].addrs = copy;
                reg->dns[j].n = n;
                stored = true;
                break;
            }
        pthread_mutex_unlock(&reg->mu);
        if (!stored)
            free(copy);
    }
    free(addrs);
    reg_lock(reg, ENTRY_OTHER);
    reconcile(reg, false);
    pthread_mutex_unlock(&reg->mu);
    tdm_router_config_unref(cfg);
    pthread_mutex_unlock(&reg->check_mu);
    return rc;
}

int tdm_router_endpoints_apply_config(struct tdm_router_endpoints *reg,
                                      const struct tdm_router_config *cfg)
{
    reg_lock(reg, ENTRY_OTHER);
    if (!remap_dns(reg, cfg)) {
        pthread_mutex_unlock(&reg->mu);
        return TDM_ENOMEM;
    }
    struct tdm_router_config *old = reg->cfg;
    reg->cfg = tdm_router_config_ref((struct tdm_router_config *)cfg);
    for (size_t i = 0; i < reg->n; i++)
        lru_set_cap(&reg->eps[i]->lru, (uint32_t)cfg->lru_capacity_per_server);
    reconcile(reg, false);
    pthread_cond_broadcast(&reg->cv);
    pthread_mutex_unlock(&reg->mu);
    tdm_router_config_unref(old);
    // New DNS names resolve now rather than at the next period.
    if (cfg->n_dns)
        return tdm_router_endpoints_refresh_dns(reg);
    return TDM_OK;
}

// ---- health
// --------------------------------------------------------------------------------------

// Applies one check result or passive report (under mu).
static void health_result(struct tdm_router_endpoints *reg, struct endpoint *e, bool ok,
                          bool active, const char *why)
{
    const struct tdm_router_health_config *h = &reg->cfg->health;
    if (ok) {
        e->fails = 0;
        if (!active)
            return; // a passive success does not revive an unhealthy endpoint
        e->succs++;
        e->answered = true;
        // success_threshold guards the return of a failed endpoint; a new one
        // (a pod that just became ready) joins at its first good check.
        bool fresh = e->fresh;
        e->fresh = false;
        // Its HTTP port answers, but the router cannot talk to its inbox: not healthy.
        if (!e->healthy && !e->auth_failed && (fresh || e->succs >= h->success_threshold)) {
            e->healthy = true;
            e->health_epoch++;
            lru_fini(&e->lru); // likely restarted: its prefix cache is empty
            TDM_LOG_INFO(MOD, "endpoint %s healthy (epoch %llu)", e->name,
                         (unsigned long long)e->health_epoch);
            publish_health(reg, e);
            update_ready_gauges(reg);
        }
        return;
    }
    if (active)
        e->fresh = false;
    e->succs = 0;
    e->fails++;
    bool starting = !e->answered && tdm_now() - e->added_at < TDM_ROUTER_STARTUP_GRACE_S;
    if (e->healthy && e->fails >= h->failure_threshold) {
        e->healthy = false;
        if (starting)
            TDM_LOG_DEBUG(MOD, "endpoint %s not answering yet (starting; last: %s)", e->name, why);
        else
            TDM_LOG_WARN(MOD, "endpoint %s unhealthy after %d failures (last: %s)", e->name,
                         e->fails, why);
        publish_health(reg, e);
        update_ready_gauges(reg);
    } else if (!e->healthy && !e->answered && !starting && !e->grace_noted) {
        // It never came up: say so once, when the grace runs out.
        TDM_LOG_WARN(MOD, "endpoint %s has not answered a health check in %.0f s (last: %s)",
                     e->name, TDM_ROUTER_STARTUP_GRACE_S, why);
    }
    if (!e->answered && !starting)
        e->grace_noted = true;
}

struct check {
    uint64_t id;
    char host[TDM_ROUTER_NAME_MAX];
    char name[TDM_ROUTER_NAME_MAX]; // host:port, the Host header
    int port;
    int fd;
    int state; // 0 connecting, 1 sending, 2 reading, 3 done
    bool ok;
    char why[64];
    char req[512]; // path <= 200 bytes (config), name < TDM_ROUTER_NAME_MAX
    size_t req_len, sent;
    char resp[64];
    size_t resp_len;
};

static void check_finish(struct check *c, bool ok, const char *why)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->state = 3;
    c->ok = ok;
    snprintf(c->why, sizeof c->why, "%s", why);
}

static void check_start(struct check *c, const char *path)
{
    c->fd = -1;
    c->state = 0;
    char port[16];
    snprintf(port, sizeof port, "%d", c->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM};
    struct addrinfo *res = NULL;
    if (getaddrinfo(c->host, port, &hints, &res) != 0 || !res) {
        check_finish(c, false, "does not resolve");
        return;
    }
    c->fd = socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0) {
        freeaddrinfo(res);
        check_finish(c, false, "socket failed");
        return;
    }
    int r = connect(c->fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (r < 0 && errno != EINPROGRESS) {
        check_finish(c, false, strerror(errno));
        return;
    }
    int n = snprintf(c->req, sizeof c->req,
                     "GET %s HTTP/1.0\r\nHost: %s\r\nUser-Agent: tandem-router\r\n"
                     "Connection: close\r\n\r\n",
                     path, c->name);
    c->req_len = n > 0 && (size_t)n < sizeof c->req ? (size_t)n : 0;
    c->state = 1; // POLLOUT signals the connect's end
}

static void check_step(struct check *c, short revents)
{
    if (c->state == 1) {
        int e = 0;
        socklen_t len = sizeof e;
        if (getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &e, &len) < 0 || e) {
            check_finish(c, false, e ? strerror(e) : "connect failed");
            return;
        }
        ssize_t w = send(c->fd, c->req + c->sent, c->req_len - c->sent, MSG_NOSIGNAL);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            check_finish(c, false, strerror(errno));
            return;
        }
        if (w > 0)
            c->sent += (size_t)w;
        if (c->sent == c->req_len)
            c->state = 2;
        return;
    }
    if (c->state == 2 && (revents & (POLLIN | POLLHUP | POLLERR))) {
        ssize_t r = recv(c->fd, c->resp + c->resp_len, sizeof c->resp - 1 - c->resp_len, 0);
        if (r < 0 && (errno == EAGAIN || errno == EINTR))
            return;
        if (r > 0)
            c->resp_len += (size_t)r;
        c->resp[c->resp_len] = '\0';
        // "HTTP/1.x NNN ..." is all we need.
        if (c->resp_len >= 12 || r <= 0) {
            int status = 0;
            if (sscanf(c->resp, "HTTP/%*d.%*d %d", &status) != 1) {
                check_finish(c, false, r <= 0 ? "connection closed" : "not HTTP");
                return;
            }
            char why[32];
            snprintf(why, sizeof why, "HTTP %d", status);
            check_finish(c, status >= 200 && status < 300, why);
        }
    }
}

void tdm_router_endpoints_check_health(struct tdm_router_endpoints *reg)
{
    pthread_mutex_lock(&reg->check_mu);
    reg_lock(reg, ENTRY_OTHER);
    struct tdm_router_config *cfg = tdm_router_config_ref(reg->cfg);
    size_t n = reg->n;
    struct check *cs = calloc(n ? n : 1, sizeof *cs);
    for (size_t i = 0; cs && i < n; i++) {
        cs[i].id = reg->eps[i]->id;
        memcpy(cs[i].host, reg->eps[i]->host, sizeof cs[i].host);
        memcpy(cs[i].name, reg->eps[i]->name, sizeof cs[i].name);
        cs[i].port = reg->eps[i]->http_port;
    }
    reg->health_due = false;
    pthread_mutex_unlock(&reg->mu);
    if (!cs) {
        TDM_LOG_ERR(MOD, "out of memory for health checks");
        goto done;
    }
    struct pollfd *pfd = calloc(n ? n : 1, sizeof *pfd);
    if (!pfd) {
        free(cs);
        goto done;
    }
    for (size_t i = 0; i < n; i++)
        check_start(&cs[i], cfg->health.path);
    double deadline = tdm_now() + cfg->health.timeout_seconds;
    for (;;) {
        size_t np = 0;
        for (size_t i = 0; i < n; i++) {
            if (cs[i].state == 3)
                continue;
            pfd[np].fd = cs[i].fd;
            pfd[np].events = cs[i].state == 1 ? POLLOUT : POLLIN;
            pfd[np].revents = 0;
            np++;
        }
        double left = deadline - tdm_now();
        if (np == 0 || left <= 0)
            break;
        int r = poll(pfd, np, (int)(left * 1000.0) + 1);
        if (r < 0 && errno != EINTR)
            break;
        size_t k = 0;
        for (size_t i = 0; i < n; i++) {
            if (cs[i].state == 3)
                continue;
            short ev = pfd[k++].revents;
            if (ev)
                check_step(&cs[i], ev);
        }
    }
    for (size_t i = 0; i < n; i++)
        if (cs[i].state != 3)
            check_finish(&cs[i], false, "timeout");
    reg_lock(reg, ENTRY_OTHER);
    double now = tdm_now();
    for (size_t i = 0; i < n; i++) {
        struct endpoint *e = find_by_id(reg, cs[i].id);
        if (e == NULL)
            continue;
        // Busy is not dead: a worker whose HTTP threads are all taken (or whose
        // CPU is saturated) lets the check time out, but its nng load reports,
        // answered off the engine and HTTP threads, still arrive. A timeout with
        // a report younger than load_stale_seconds counts as neither success nor
        // failure; a refused connection or an error status still fails.
        bool timed_out = !cs[i].ok && strcmp(cs[i].why, "timeout") == 0;
        if (timed_out && e->has_load && now - e->load_at <= cfg->load_stale_seconds) {
            if (!e->busy)
                TDM_LOG_INFO(MOD,
                             "endpoint %s busy: health check timed out, load report %.2f s old",
                             e->name, now - e->load_at);
            e->busy = true;
            continue;
        }
        e->busy = false;
        health_result(reg, e, cs[i].ok, true, cs[i].why);
        publish_health(reg, e); // the reason may change without a turn (starting's grace ends)
    }
    pthread_mutex_unlock(&reg->mu);
    free(pfd);
    free(cs);
done:
    tdm_router_config_unref(cfg);
    pthread_mutex_unlock(&reg->check_mu);
}

// ---- background thread
// ----------------------------------------------------------------------------

static void *bg_main(void *arg)
{
    struct tdm_router_endpoints *reg = arg;
    double next_dns = tdm_now(), next_health = tdm_now();
    reg_lock(reg, ENTRY_OTHER);
    while (!reg->stop) {
        double now = tdm_now();
        bool dns = reg->cfg->n_dns && now >= next_dns;
        bool health = now >= next_health || reg->health_due;
        if (dns)
            next_dns = now + reg->cfg->dns_refresh_seconds;
        if (health)
            next_health = now + reg->cfg->health.interval_seconds;
        if (dns || health) {
            pthread_mutex_unlock(&reg->mu);
            if (dns)
                tdm_router_endpoints_refresh_dns(reg);
            if (health)
                tdm_router_endpoints_check_health(reg);
            reg_lock(reg, ENTRY_OTHER);
            continue;
        }
        reap(reg);
        // Wake at most every 100 ms (reaping drained endpoints), sooner on stop
        // or a config change.
        double wake = next_health < now + 0.1 ? next_health : now + 0.1;
        if (reg->cfg->n_dns && next_dns < wake)
            wake = next_dns;
        tdm_cond_wait_for(&reg->cv, &reg->mu, wake - now);
    }
    pthread_mutex_unlock(&reg->mu);
    return NULL;
}

int tdm_router_endpoints_start(struct tdm_router_endpoints *reg)
{
    reg_lock(reg, ENTRY_OTHER);
    if (reg->running) {
        pthread_mutex_unlock(&reg->mu);
        return TDM_OK;
    }
    reg->stop = false;
    int r = pthread_create(&reg->thread, NULL, bg_main, reg);
    reg->running = r == 0;
    pthread_mutex_unlock(&reg->mu);
    return r == 0 ? TDM_OK : TDM_ENOMEM;
}

void tdm_router_endpoints_stop(struct tdm_router_endpoints *reg)
{
    reg_lock(reg, ENTRY_OTHER);
    if (!reg->running) {
        pthread_mutex_unlock(&reg->mu);
        return;
    }
    reg->stop = true;
    pthread_cond_broadcast(&reg->cv);
    pthread_mutex_unlock(&reg->mu);
    pthread_join(reg->thread, NULL);
    reg_lock(reg, ENTRY_OTHER);
    reg->running = false;
    pthread_mutex_unlock(&reg->mu);
}

// ---- snapshots and lookups
// ------------------------------------------------------------------------

static void fill_view(const struct tdm_router_endpoints *reg, const struct endpoint *e, double now,
                      struct tdm_router_endpoint_view *v)
{
    memset(v, 0, sizeof *v);
    v->id = e->id;
    memcpy(v->name, e->name, sizeof v->name);
    memcpy(v->host, e->host, sizeof v->host);
    v->http_port = e->http_port;
    v->nng_port = e->nng_port;
    v->role = e->role;
    v->healthy = e->healthy;
    v->starting = !e->answered && now - e->added_at < TDM_ROUTER_STARTUP_GRACE_S;
    v->draining = e->draining;
    v->busy = e->busy;
    v->unhealthy_reason = unhealthy_reason(e, now);
    v->health_epoch = e->health_epoch;
    v->instance = e->instance;
    v->inflight = e->inflight;
    v->unreported = e->sent_since_report;
    v->load = e->load;
    v->has_load = e->has_load;
    v->load_age_seconds = e->has_load ? now - e->load_at : -1.0;
    v->load_stale = !e->has_load || v->load_age_seconds > reg->cfg->load_stale_seconds;
    v->heard_at = e->has_load ? e->load_at : 0;
    v->not_up = tdm_router_endpoint_not_up(v->heard_at, e->link_down);
}

// The snapshot of tdm_router_endpoints_snapshot (under mu). TDM_ENOMEM.
static int snapshot_locked(struct tdm_router_endpoints *reg, const uint64_t *block_hashes,
                           size_t n_blocks, struct tdm_router_snapshot *snap)
{
    memset(snap, 0, sizeof *snap);
    size_t n = 0;
    for (size_t i = 0; i < reg->n; i++)
        n += !reg->eps[i]->draining;
    snap->eps = calloc(n ? n : 1, sizeof *snap->eps);
    if (!snap->eps)
        return TDM_ENOMEM;
    double now = tdm_now();
    size_t max_match = (size_t)reg->cfg->max_prefix_blocks_to_match;
    if (!block_hashes)
        n_blocks = 0;
    size_t k = 0;
    for (size_t i = 0; i < reg->n; i++) {
        const struct endpoint *e = reg->eps[i];
        if (e->draining)
            continue;
        struct tdm_router_endpoint_view *v = &snap->eps[k++];
        fill_view(reg, e, now, v);
        int m = 0;
        for (size_t b = 0; b < n_blocks && b < max_match; b++) {
            if (lru_find(&e->lru, block_hashes[b]) == NIL)
                break;
            m++;
        }
        v->prefix_match_blocks = m;
    }
    snap->n = k;
    snap->n_request_blocks = n_blocks;
    snap->seq = reg->pick_seq++;
    snap->seed = splitmix64(&reg->rng);
    snap->now = now;
    return TDM_OK;
}

int tdm_router_endpoints_snapshot(struct tdm_router_endpoints *reg, const uint64_t *block_hashes,
                                  size_t n_blocks, struct tdm_router_snapshot *snap)
{
    reg_lock(reg, ENTRY_REQUEST);
    int rc = snapshot_locked(reg, block_hashes, n_blocks, snap);
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

void tdm_router_snapshot_free(struct tdm_router_snapshot *snap)
{
    if (!snap)
        return;
    free(snap->eps);
    snap->eps = NULL;
    snap->n = 0;
}

int tdm_router_endpoints_get(struct tdm_router_endpoints *reg, uint64_t id,
                             struct tdm_router_endpoint_view *out)
{
    reg_lock(reg, ENTRY_REQUEST);
    struct endpoint *e = find_by_id(reg, id);
    if (e)
        fill_view(reg, e, tdm_now(), out);
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

int tdm_router_endpoints_find(struct tdm_router_endpoints *reg, const char *name,
                              struct tdm_router_endpoint_view *out)
{
    reg_lock(reg, ENTRY_REQUEST);
    struct endpoint *e = name ? find_by_name(reg, name) : NULL;
    if (e)
        fill_view(reg, e, tdm_now(), out);
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

bool tdm_router_endpoint_not_up(double heard_at, bool link_down)
{
    return heard_at == 0 && link_down;
}

bool tdm_router_endpoint_ready(const struct tdm_router_endpoint_view *v)
{
    return v->healthy && !v->not_up && !v->draining;
}

static size_t count_auth_failed_locked(const struct tdm_router_endpoints *reg)
{
    size_t n = 0;
    for (size_t i = 0; i < reg->n; i++)
        n += !reg->eps[i]->draining && reg->eps[i]->auth_failed;
    return n;
}

size_t tdm_router_endpoints_count_auth_failed(struct tdm_router_endpoints *reg)
{
    reg_lock(reg, ENTRY_REQUEST);
    size_t n = count_auth_failed_locked(reg);
    pthread_mutex_unlock(&reg->mu);
    return n;
}

static void count_locked(const struct tdm_router_endpoints *reg, bool decode, size_t *total,
                         size_t *healthy)
{
    size_t t = 0, h = 0;
    for (size_t i = 0; i < reg->n; i++) {
        const struct endpoint *e = reg->eps[i];
        if (e->draining)
            continue;
        if (decode ? !tdm_router_role_can_decode(e->role) : !tdm_router_role_can_prefill(e->role))
            continue;
        t++;
        h += e->healthy;
    }
    *total = t;
    *healthy = h;
}

void tdm_router_endpoints_count(struct tdm_router_endpoints *reg, bool decode, size_t *total,
                                size_t *healthy)
{
    size_t t, h;
    reg_lock(reg, ENTRY_REQUEST);
    count_locked(reg, decode, &t, &h);
    pthread_mutex_unlock(&reg->mu);
    if (total)
        *total = t;
    if (healthy)
        *healthy = h;
}

size_t tdm_router_endpoints_list(struct tdm_router_endpoints *reg,
                                 struct tdm_router_endpoint_view *out, size_t cap)
{
    reg_lock(reg, ENTRY_OTHER);
    double now = tdm_now();
    size_t n = reg->n;
    for (size_t i = 0; i < n && i < cap; i++)
        fill_view(reg, reg->eps[i], now, &out[i]);
    pthread_mutex_unlock(&reg->mu);
    return n;
}

// ---- request path hooks -------------------------------------------------------------------------
// Each step under mu, so an attempt's two entries (attempt_begin, attempt_end)
// and the one-step calls do exactly the same.

static struct endpoint *acquire_locked(struct tdm_router_endpoints *reg, uint64_t id)
{
    struct endpoint *e = find_by_id(reg, id);
    if (e) {
        e->inflight++;
        e->sent_since_report++; // not in the worker's load until its next report
    }
    return e;
}

static void release_locked(struct tdm_router_endpoints *reg, uint64_t id)
{
    struct endpoint *e = find_by_id(reg, id);
    if (e && e->inflight > 0)
        e->inflight--;
    // A request that finished is in neither the last report nor the worker's
    // queue now. Which one finished is not known: the count sent since the
    // report stays an upper bound of those still in flight.
    if (e && e->sent_since_report > e->inflight)
        e->sent_since_report = e->inflight;
    if (e && e->draining && e->inflight == 0)
        reap(reg); // the last request on a vanished endpoint: it goes now
}

static void report_locked(struct tdm_router_endpoints *reg, uint64_t id,
                          enum tdm_router_outcome outcome)
{
    struct endpoint *e = find_by_id(reg, id);
    if (e)
        health_result(reg, e, outcome == TDM_ROUTER_OUTCOME_SUCCESS, false,
                      outcome == TDM_ROUTER_OUTCOME_TIMEOUT ? "request timeout" : "request error");
}

static void record_prefix_locked(struct endpoint *e, const uint64_t *block_hashes, size_t n_blocks)
{
    // Insert deepest first so the prompt's first block ends most recent: the
    // shared prefix is what later requests match, so it should outlive the tail.
    for (size_t i = n_blocks; e && block_hashes && i > 0; i--)
        lru_insert(&e->lru, block_hashes[i - 1]);
}

int tdm_router_endpoints_acquire(struct tdm_router_endpoints *reg, uint64_t id)
{
    reg_lock(reg, ENTRY_REQUEST);
    struct endpoint *e = acquire_locked(reg, id);
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

void tdm_router_endpoints_release(struct tdm_router_endpoints *reg, uint64_t id)
{
    reg_lock(reg, ENTRY_REQUEST);
    release_locked(reg, id);
    pthread_mutex_unlock(&reg->mu);
}

void tdm_router_endpoints_report(struct tdm_router_endpoints *reg, uint64_t id,
                                 enum tdm_router_outcome outcome)
{
    reg_lock(reg, ENTRY_REQUEST);
    report_locked(reg, id, outcome);
    pthread_mutex_unlock(&reg->mu);
}

// Holds snap's endpoint i (in-flight + 1) and records the prompt's blocks in
// its prefix index (under mu). Every snapshot endpoint is still in the table
// while mu has stayed held since the snapshot: none was reaped.
static void hold_locked(struct tdm_router_endpoints *reg, const struct tdm_router_snapshot *snap,
                        size_t i, const uint64_t *block_hashes, size_t n_blocks)
{
    struct endpoint *e = acquire_locked(reg, snap->eps[i].id);
    TDM_ASSERT(e != NULL);
    record_prefix_locked(e, block_hashes, n_blocks);
}

static void attempt_end_locked(struct tdm_router_endpoints *reg,
                               const struct tdm_router_give_back *end, bool release)
{
    if (end->report)
        report_locked(reg, end->report, end->outcome);
    for (size_t i = 0; release && i < 2; i++)
        if (end->release[i])
            release_locked(reg, end->release[i]);
}

int tdm_router_endpoints_attempt_begin(struct tdm_router_endpoints *reg,
                                       const uint64_t *block_hashes, size_t n_blocks,
                                       tdm_router_pick_fn pick, void *arg,
                                       const struct tdm_router_give_back *prev,
                                       struct tdm_router_snapshot *snap,
                                       struct tdm_router_held *held)
{
    memset(held, 0, sizeof *held);
    held->decode = held->prefill = SIZE_MAX;
    reg_lock(reg, ENTRY_REQUEST);
    if (prev)
        attempt_end_locked(reg, prev, false); // its report counts before the pick
    int rc = snapshot_locked(reg, block_hashes, n_blocks, snap);
    if (rc == TDM_OK)
        rc = pick(arg, snap, held);
    if (rc == TDM_OK && held->decode >= snap->n)
        rc = TDM_EBUSY; // (a pick that says OK without an endpoint: none)
    if (rc == TDM_OK) {
        hold_locked(reg, snap, held->decode, block_hashes, n_blocks);
        if (held->prefill < snap->n)
            hold_locked(reg, snap, held->prefill, block_hashes, n_blocks);
        else
            held->prefill = SIZE_MAX;
        if (prev)
            attempt_end_locked(reg, prev, true); // released after the new hold
    } else if (rc == TDM_EBUSY) {
        held->decode = held->prefill = SIZE_MAX;
        count_locked(reg, true, &held->n_decode, &held->n_decode_healthy);
        held->n_auth_failed = count_auth_failed_locked(reg);
        for (size_t i = 0; i < snap->n; i++) {
            const struct tdm_router_endpoint_view *v = &snap->eps[i];
            held->n_decode_not_up += v->healthy && v->not_up && tdm_router_role_can_decode(v->role);
        }
    }
    pthread_mutex_unlock(&reg->mu);
    return rc;
}

void tdm_router_endpoints_attempt_end(struct tdm_router_endpoints *reg,
                                      const struct tdm_router_give_back *end)
{
    reg_lock(reg, ENTRY_REQUEST);
    attempt_end_locked(reg, end, true);
    pthread_mutex_unlock(&reg->mu);
}

void tdm_router_endpoints_lock_entries(struct tdm_router_endpoints *reg,
                                       struct tdm_router_lock_entries *out)
{
    reg_lock(reg, ENTRY_OTHER);
    *out = reg->entries;
    pthread_mutex_unlock(&reg->mu);
}

// A report's load, timestamped now (under mu): it shows every request the
// router sent before it, so none is unreported any more, and it answers the
// load poller's queries. A first one makes a worker not up ready.
static void take_load_locked(struct tdm_router_endpoints *reg, struct endpoint *e,
                             const struct tdm_router_load *load)
{
    bool first = !e->has_load;
    e->load = *load;
    e->load_at = tdm_now();
    e->has_load = true;
    e->sent_since_report = 0;
    e->q_first = e->q_second = 0;
    if (first)
        update_ready_gauges(reg);
}

int tdm_router_endpoints_set_load(struct tdm_router_endpoints *reg, uint64_t id,
                                  const struct tdm_router_load *load)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e)
        take_load_locked(reg, e, load);
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

int tdm_router_endpoints_on_report(struct tdm_router_endpoints *reg, uint64_t id,
                                   const struct tdm_router_report *r, bool *restarted,
                                   bool *resynced)
{
    bool re = false, resync = false;
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e) {
        re = r->instance != 0 && e->instance != 0 && e->instance != r->instance;
        if (r->instance != 0)
            e->instance = r->instance;
        take_load_locked(reg, e, &r->load);
        if (re)
            lru_fini(&e->lru); // a new process: its prefix cache is empty
        if (r->has_kv_events) {
            // A lost report (batch gap) or a worker-side overflow lost events.
            resync = !re && (r->kv_cleared || (e->kv_batch != 0 && r->kv_batch != e->kv_batch + 1));
            if (resync)
                lru_fini(&e->lru);
            e->kv_batch = r->kv_batch;
            for (size_t i = 0; r->stored && i < r->n_stored; i++)
                lru_insert(&e->lru, r->stored[i]);
            for (size_t i = 0; r->evicted && i < r->n_evicted; i++)
                lru_remove(&e->lru, r->evicted[i]);
        }
    }
    pthread_mutex_unlock(&reg->mu);
    if (restarted)
        *restarted = re;
    if (resynced)
        *resynced = resync;
    return e ? TDM_OK : TDM_ENOTFOUND;
}

void tdm_router_endpoints_note_query(struct tdm_router_endpoints *reg, uint64_t id, double now)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e && e->q_first == 0)
        e->q_first = now;
    else if (e && e->q_second == 0)
        e->q_second = now;
    pthread_mutex_unlock(&reg->mu);
}

double tdm_router_endpoints_unanswered_since(struct tdm_router_endpoints *reg, uint64_t id)
{
    reg_lock(reg, ENTRY_REQUEST);
    struct endpoint *e = find_by_id(reg, id);
    double t = e ? e->q_second : 0;
    pthread_mutex_unlock(&reg->mu);
    return t;
}

int tdm_router_endpoints_liveness(struct tdm_router_endpoints *reg, uint64_t id,
                                  struct tdm_router_liveness *out)
{
    reg_lock(reg, ENTRY_LIVENESS);
    struct endpoint *e = find_by_id(reg, id);
    out->instance = e ? e->instance : 0;
    out->heard_at = e && e->has_load ? e->load_at : 0;
    out->unanswered_since = e ? e->q_second : 0;
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

void tdm_router_endpoints_record_prefix(struct tdm_router_endpoints *reg, uint64_t id,
                                        const uint64_t *block_hashes, size_t n_blocks)
{
    reg_lock(reg, ENTRY_REQUEST);
    record_prefix_locked(find_by_id(reg, id), block_hashes, n_blocks);
    pthread_mutex_unlock(&reg->mu);
}

int tdm_router_endpoints_apply_kv_event(struct tdm_router_endpoints *reg, uint64_t id,
                                        const uint64_t *stored, size_t n_stored,
                                        const uint64_t *evicted, size_t n_evicted)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e) {
        for (size_t i = 0; stored && i < n_stored; i++)
            lru_insert(&e->lru, stored[i]);
        for (size_t i = 0; evicted && i < n_evicted; i++)
            lru_remove(&e->lru, evicted[i]);
    }
    pthread_mutex_unlock(&reg->mu);
    return e ? TDM_OK : TDM_ENOTFOUND;
}

void tdm_router_endpoints_clear_prefix(struct tdm_router_endpoints *reg, uint64_t id)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e)
        lru_fini(&e->lru);
    pthread_mutex_unlock(&reg->mu);
}

size_t tdm_router_endpoints_prefix_size(struct tdm_router_endpoints *reg, uint64_t id)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    size_t n = e ? e->lru.n : 0;
    pthread_mutex_unlock(&reg->mu);
    return n;
}

void tdm_router_endpoints_set_auth(struct tdm_router_endpoints *reg, uint64_t id, bool failed,
                                   const char *why)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e == NULL || e->auth_failed == failed) {
        pthread_mutex_unlock(&reg->mu);
        return;
    }
    e->auth_failed = failed;
    if (failed) {
        if (!e->auth_logged)
            TDM_LOG_ERR(MOD,
                        "endpoint %s refuses the router's control-plane handshake (%s): it is "
                        "not routed to. Start it with the same TANDEM_INTERNAL_SECRET (or "
                        "TANDEM_INTERNAL_SECRET_FILE) as this router; `tandem up` prints its "
                        "secret file",
                        e->name, why && *why ? why : "authentication failed");
        e->auth_logged = true;
        e->healthy = false;
        e->succs = 0;
        update_ready_gauges(reg);
    } else {
        // The handshake passes now (restarted with the secret), or its inbox
        // is down (the HTTP checks judge it then): its next good check
        // brings it in, as a new pod's first one does.
        TDM_LOG_INFO(MOD, "endpoint %s: no longer refusing the handshake (%s)", e->name,
                     why && *why ? why : "link changed");
        e->auth_logged = false;
        e->fresh = true;
        reg->health_due = true;
    }
    publish_health(reg, e);
    pthread_mutex_unlock(&reg->mu);
}

void tdm_router_endpoints_set_link_down(struct tdm_router_endpoints *reg, uint64_t id, bool down)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e && e->link_down != down) {
        e->link_down = down;
        update_ready_gauges(reg);
    }
    pthread_mutex_unlock(&reg->mu);
}

void tdm_router_endpoints_set_healthy(struct tdm_router_endpoints *reg, uint64_t id, bool healthy)
{
    reg_lock(reg, ENTRY_OTHER);
    struct endpoint *e = find_by_id(reg, id);
    if (e && e->healthy != healthy) {
        e->healthy = healthy;
        e->fails = e->succs = 0;
        if (healthy)
            e->health_epoch++;
        publish_health(reg, e);
        update_ready_gauges(reg);
    }
    pthread_mutex_unlock(&reg->mu);
}
