// SPDX-License-Identifier: Apache-2.0
// router config: parses the router's YAML/JSON config into struct
// tdm_router_config. libyaml loads the text into a node graph (anchors and
// aliases resolved, line numbers kept); the walkers below check every key
// against the keys its mapping allows, so a typo is an error naming its key
// path ("plugins[2].parameters.nonCachedTokns: unknown key"), never a silent
// default. The short form (`policy: least_loaded`) expands into the same
// plugins and profiles the llm-d form would spell out, so the policy code only
// knows one shape. The text is kept in the config so that a reload of
// identical bytes is recognised and skipped.
#include "config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <yaml.h>

#include "config_impl.h"
#include "core.h"
#include "plugins/plugins.h"

#define MOD "router-config"
#define PATH_MAX_ 256

// snprintf through a va_list: key paths are truncated on purpose when absurdly
// deep, which gcc's -Wformat-truncation would flag at every call.
static int pathf(char *dst, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int pathf(char *dst, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
    return n;
}

// ---- names ---------------------------------------------------------------------------------

static const char *const role_names[TDM_ROUTER_ROLE_COUNT] = {
    [TDM_ROUTER_ROLE_NONE] = "",
    [TDM_ROUTER_ROLE_PREFILL] = "prefill",
    [TDM_ROUTER_ROLE_DECODE] = "decode",
    [TDM_ROUTER_ROLE_PREFILL_DECODE] = "prefill-decode",
};

const char *tdm_router_role_name(enum tdm_router_role role)
{
    if ((int)role < 0 || role >= TDM_ROUTER_ROLE_COUNT)
        return NULL;
    return role_names[role];
}

bool tdm_router_role_can_decode(enum tdm_router_role role)
{
    // llm-d's decode-filter keeps unlabelled pods (allowsNoLabel).
    return role == TDM_ROUTER_ROLE_DECODE || role == TDM_ROUTER_ROLE_PREFILL_DECODE ||
           role == TDM_ROUTER_ROLE_NONE;
}

bool tdm_router_role_can_prefill(enum tdm_router_role role)
{
    return role == TDM_ROUTER_ROLE_PREFILL || role == TDM_ROUTER_ROLE_PREFILL_DECODE;
}

// ---- parse context and scalar readers --------------------------------------------------------

struct pctx {
    yaml_document_t *doc;
    char *err;
    size_t errlen;
};

static yaml_node_t *node_at(struct pctx *c, int idx)
{
    return yaml_document_get_node(c->doc, idx);
}

static int line_of(const yaml_node_t *n)
{
    return n ? (int)n->start_mark.line + 1 : 0;
}

static const char *node_kind(const yaml_node_t *n)
{
    if (!n)
        return "nothing";
    switch (n->type) {
    case YAML_SCALAR_NODE:
        return "a scalar";
    case YAML_SEQUENCE_NODE:
        return "a list";
    case YAML_MAPPING_NODE:
        return "a mapping";
    default:
        return "nothing";
    }
}

static int perr(struct pctx *c, const char *path, const yaml_node_t *n, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int perr(struct pctx *c, const char *path, const yaml_node_t *n, const char *fmt, ...)
{
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n)
        return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: %s (line %d)", path, msg, line_of(n));
    return tdm_seterr(c->err, c->errlen, TDM_EINVAL, "%s: %s", path, msg);
}

static const char *scalar(const yaml_node_t *n)
{
    return n && n->type == YAML_SCALAR_NODE ? (const char *)n->data.scalar.value : NULL;
}

static bool is_plain(const yaml_node_t *n)
{
    return n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE ||
           n->data.scalar.style == YAML_ANY_SCALAR_STYLE;
}

static int read_int(struct pctx *c, const char *path, yaml_node_t *n, int *out, long long min,
                    long long max)
{
    const char *s = scalar(n);
    if (!s)
        return perr(c, path, n, "expected an integer, got %s", node_kind(n));
    errno = 0;
    char *end = NULL;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || !is_plain(n))
        return perr(c, path, n, "expected an integer, got '%s'", s);
    if (v < min || v > max)
        return perr(c, path, n, "%lld is out of range [%lld, %lld]", v, min, max);
    *out = (int)v;
    return TDM_OK;
}

static int read_double(struct pctx *c, const char *path, yaml_node_t *n, double *out, double min,
                       double max)
{
    const char *s = scalar(n);
    if (!s)
        return perr(c, path, n, "expected a number, got %s", node_kind(n));
    errno = 0;
    char *end = NULL;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !is_plain(n) || !isfinite(v))
        return perr(c, path, n, "expected a number, got '%s'", s);
    if (v < min || v > max)
        return perr(c, path, n, "%g is out of range [%g, %g]", v, min, max);
    *out = v;
    return TDM_OK;
}

static int read_bool(struct pctx *c, const char *path, yaml_node_t *n, bool *out)
{
    const char *s = scalar(n);
    if (s && is_plain(n)) {
        if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "TRUE")) {
            *out = true;
            return TDM_OK;
        }
        if (!strcmp(s, "false") || !strcmp(s, "False") || !strcmp(s, "FALSE")) {
            *out = false;
            return TDM_OK;
        }
    }
    return perr(c, path, n, "expected true or false, got %s%s%s", s ? "'" : "",
                s ? s : node_kind(n), s ? "'" : "");
}

// A non-empty string; replaces *out (freed first).
static int read_string(struct pctx *c, const char *path, yaml_node_t *n, char **out)
{
    const char *s = scalar(n);
    if (!s)
        return perr(c, path, n, "expected a string, got %s", node_kind(n));
    if (!*s)
        return perr(c, path, n, "must not be empty");
    char *d = strdup(s);
    if (!d)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "%s: out of memory", path);
    free(*out);
    *out = d;
    return TDM_OK;
}

static int set_string(struct pctx *c, char **out, const char *s)
{
    char *d = s ? strdup(s) : NULL;
    if (s && !d)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
    free(*out);
    *out = d;
    return TDM_OK;
}

// Checks that every key of mapping n is a scalar in allowed (NULL-terminated)
// and appears once.
static int check_keys(struct pctx *c, const char *path, yaml_node_t *n, const char *const *allowed)
{
    if (!n || n->type != YAML_MAPPING_NODE)
        return perr(c, path, n, "expected a mapping, got %s", node_kind(n));
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(c, p->key);
        const char *ks = scalar(k);
        if (!ks)
            return perr(c, path, k, "mapping keys must be strings");
        bool ok = false;
        for (const char *const *a = allowed; *a; a++)
            if (!strcmp(*a, ks))
                ok = true;
        if (!ok) {
            char known[256] = "";
            size_t off = 0;
            for (const char *const *a = allowed; *a && off < sizeof known; a++)
                off += (size_t)pathf(known + off, sizeof known - off, "%s%s",
                                     a == allowed ? "" : ", ", *a);
            char kp[PATH_MAX_];
            pathf(kp, sizeof kp, "%s%s%s", path, *path ? "." : "", ks);
            return perr(c, kp, k, "unknown key (known: %s)", known);
        }
        for (yaml_node_pair_t *q = n->data.mapping.pairs.start; q < p; q++) {
            const char *qs = scalar(node_at(c, q->key));
            if (qs && !strcmp(qs, ks)) {
                char kp[PATH_MAX_];
                pathf(kp, sizeof kp, "%s%s%s", path, *path ? "." : "", ks);
                return perr(c, kp, k, "duplicate key");
            }
        }
    }
    return TDM_OK;
}

// The value of key in mapping n, or NULL.
static yaml_node_t *map_get(struct pctx *c, yaml_node_t *n, const char *key)
{
    if (!n || n->type != YAML_MAPPING_NODE)
        return NULL;
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        const char *ks = scalar(node_at(c, p->key));
        if (ks && !strcmp(ks, key))
            return node_at(c, p->value);
    }
    return NULL;
}

static bool is_null(const yaml_node_t *n)
{
    const char *s = scalar(n);
    return s && n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE &&
           (!*s || !strcmp(s, "null") || !strcmp(s, "~"));
}

static size_t seq_len(const yaml_node_t *n)
{
    return (size_t)(n->data.sequence.items.top - n->data.sequence.items.start);
}

static void join(char *dst, size_t cap, const char *base, const char *key)
{
    pathf(dst, cap, "%s%s%s", base, *base ? "." : "", key);
}

// ---- config lifetime -------------------------------------------------------------------------

static void config_free(struct tdm_router_config *cfg)
{
    if (!cfg)
        return;
    for (size_t i = 0; i < cfg->n_plugins; i++) {
        free(cfg->plugins[i].name);
        tdm_router_plugin_params_fini(&cfg->plugins[i].params, cfg->plugins[i].type);
    }
    free(cfg->plugins);
    for (size_t i = 0; i < cfg->n_profiles; i++) {
        free(cfg->profiles[i].name);
        free(cfg->profiles[i].refs);
    }
    free(cfg->profiles);
    for (size_t i = 0; i < cfg->n_static; i++)
        free(cfg->static_endpoints[i].host);
    free(cfg->static_endpoints);
    for (size_t i = 0; i < cfg->n_dns; i++)
        free(cfg->dns_endpoints[i].name);
    free(cfg->dns_endpoints);
    free(cfg->health.path);
    free(cfg->session_header);
    for (size_t i = 0; i < cfg->flow.n_objectives; i++)
        free(cfg->flow.objectives[i].name);
    free(cfg->flow.objectives);
    free(cfg->source_path);
    free(cfg->api_version);
    free(cfg->short_policy);
    free(cfg->text_);
    free(cfg);
}

struct tdm_router_config *tdm_router_config_ref(struct tdm_router_config *cfg)
{
    if (cfg)
        atomic_fetch_add(&cfg->refs_, 1);
    return cfg;
}

void tdm_router_config_unref(struct tdm_router_config *cfg)
{
    if (cfg && atomic_fetch_sub(&cfg->refs_, 1) == 1)
        config_free(cfg);
}

size_t tdm_router_config_find_plugin(const struct tdm_router_config *cfg, const char *name)
{
    for (size_t i = 0; cfg && name && i < cfg->n_plugins; i++)
        if (!strcmp(cfg->plugins[i].name, name))
            return i;
    return SIZE_MAX;
}

static size_t find_profile(const struct tdm_router_config *cfg, const char *name)
{
    for (size_t i = 0; name && i < cfg->n_profiles; i++)
        if (!strcmp(cfg->profiles[i].name, name))
            return i;
    return SIZE_MAX;
}

static void config_defaults(struct tdm_router_config *cfg)
{
    cfg->decode_profile = SIZE_MAX;
    cfg->prefill_profile = SIZE_MAX;
    cfg->pd_mode = TDM_ROUTER_PD_NEVER;
    cfg->pd_threshold_tokens = 0;
    cfg->dns_refresh_seconds = 10.0;
    cfg->health.interval_seconds = 2.0;
    cfg->health.timeout_seconds = 1.0;
    cfg->health.failure_threshold = 3;
    cfg->health.success_threshold = 1;
    cfg->load_stale_seconds = 2.0;
    cfg->request_deadline_seconds = 600.0;
    cfg->prefill_retries = 1;
    cfg->block_size_tokens = 16;
    cfg->max_prefix_blocks_to_match = 256;
    cfg->lru_capacity_per_server = 31250;
}

// Appends a plugin (name copied; defaults for params). Returns its index or SIZE_MAX.
static size_t add_plugin(struct pctx *c, struct tdm_router_config *cfg, const char *name,
                         enum tdm_router_plugin_type type)
{
    struct tdm_router_plugin *np = realloc(cfg->plugins, (cfg->n_plugins + 1) * sizeof *np);
    if (!np) {
        tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
        return SIZE_MAX;
    }
    cfg->plugins = np;
    struct tdm_router_plugin *p = &np[cfg->n_plugins];
    memset(p, 0, sizeof *p);
    p->type = type;
    tdm_router_plugin_params_init(&p->params, type);
    p->name = strdup(name);
    if (!p->name) {
        tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
        return SIZE_MAX;
    }
    return cfg->n_plugins++;
}

static struct tdm_router_profile *add_profile(struct pctx *c, struct tdm_router_config *cfg,
                                              const char *name)
{
    struct tdm_router_profile *np = realloc(cfg->profiles, (cfg->n_profiles + 1) * sizeof *np);
    if (!np) {
        tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
        return NULL;
    }
    cfg->profiles = np;
    struct tdm_router_profile *pr = &np[cfg->n_profiles];
    memset(pr, 0, sizeof *pr);
    pr->picker = SIZE_MAX;
    pr->name = strdup(name);
    if (!pr->name) {
        tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
        return NULL;
    }
    cfg->n_profiles++;
    return pr;
}

static int profile_add_ref(struct pctx *c, struct tdm_router_profile *pr, size_t plugin,
                           double weight)
{
    struct tdm_router_profile_ref *nr = realloc(pr->refs, (pr->n_refs + 1) * sizeof *nr);
    if (!nr)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
    pr->refs = nr;
    nr[pr->n_refs].plugin = plugin;
    nr[pr->n_refs].weight = weight;
    pr->n_refs++;
    return TDM_OK;
}

// ---- plugins -------------------------------------------------------------------------------

// Reads one table parameter from node v into its field (or only validates it).
static int read_param(struct pctx *c, const char *path, yaml_node_t *v,
                      const struct tdm_router_param *d, struct tdm_router_plugin_params *p)
{
    char *field = d->offset == TDM_ROUTER_PARAM_NO_FIELD ? NULL : (char *)p + d->offset;
    // A note replaces the plain range message: the parse then accepts any
    // value of the type and checks the range itself.
    double lo = d->range_note ? -1e300 : d->min, hi = d->range_note ? 1e300 : d->max;
    double num = 0;
    int rc = TDM_OK;
    switch (d->type) {
    case TDM_ROUTER_PARAM_INT: {
        int iv = 0;
        long long ilo = d->range_note ? INT_MIN : (long long)lo;
        long long ihi = d->range_note ? INT_MAX : (long long)hi;
        if ((rc = read_int(c, path, v, &iv, ilo, ihi)))
            return rc;
        num = iv;
        if (field && !(d->range_note && (num < d->min || num > d->max)))
            *(int *)(void *)field = iv;
        break;
    }
    case TDM_ROUTER_PARAM_DOUBLE:
        if ((rc = read_double(c, path, v, &num, lo, hi)))
            return rc;
        if (field && !(d->range_note && (num < d->min || num > d->max)))
            *(double *)(void *)field = num;
        break;
    case TDM_ROUTER_PARAM_BOOL: {
        bool b = false;
        if ((rc = read_bool(c, path, v, &b)))
            return rc;
        num = b ? 1 : 0;
        if (field && !(num < d->min || num > d->max))
            *(bool *)(void *)field = b;
        break;
    }
    case TDM_ROUTER_PARAM_STRING:
        if (!field)
            return perr(c, path, v, "not stored"); // a table bug: strings always have a field
        if ((rc = read_string(c, path, v, (char **)(void *)field)))
            return rc;
        if (d->flags & TDM_ROUTER_PARAM_LOWER)
            for (char *q = *(char **)(void *)field; *q; q++)
                if (*q >= 'A' && *q <= 'Z')
                    *q = (char)(*q - 'A' + 'a');
        break;
    }
    if (d->type != TDM_ROUTER_PARAM_STRING && (num < d->min || num > d->max))
        return perr(c, path, v, "%s", d->range_note);
    if (d->given_offset != TDM_ROUTER_PARAM_NO_FIELD)
        *(bool *)(void *)((char *)p + d->given_offset) = true;
    return TDM_OK;
}

#define MAX_PARAM_KEYS 16

// The distinct first components of the table's keys ("profiles" of
// "profiles.decode"), or with prefix set, the second components under it.
static size_t param_keys(const struct tdm_router_plugin_ops *ops, const char *prefix,
                         char (*buf)[64], const char **keys)
{
    size_t n = 0, plen = prefix ? strlen(prefix) : 0;
    for (size_t i = 0; i < ops->n_params && n < MAX_PARAM_KEYS; i++) {
        const char *k = ops->params[i].key;
        if (prefix && (strncmp(k, prefix, plen) || k[plen] != '.'))
            continue;
        const char *start = prefix ? k + plen + 1 : k;
        size_t len = strcspn(start, ".");
        pathf(buf[n], sizeof buf[n], "%.*s", (int)len, start);
        bool dup = false;
        for (size_t j = 0; j < n; j++)
            dup |= !strcmp(keys[j], buf[n]);
        if (!dup) {
            keys[n] = buf[n];
            n++;
        }
    }
    keys[n] = NULL;
    return n;
}

// Checks the keys of the parameters mapping (and of its nested mappings)
// against the type's table.
static int check_param_keys(struct pctx *c, const char *path, yaml_node_t *n,
                            const struct tdm_router_plugin_ops *ops)
{
    char buf[MAX_PARAM_KEYS][64], sub[MAX_PARAM_KEYS][64];
    const char *keys[MAX_PARAM_KEYS + 1], *subkeys[MAX_PARAM_KEYS + 1];
    size_t nk = param_keys(ops, NULL, buf, keys);
    int rc = check_keys(c, path, n, keys);
    for (size_t i = 0; !rc && i < nk; i++) {
        yaml_node_t *v = map_get(c, n, keys[i]);
        if (v && param_keys(ops, keys[i], sub, subkeys) > 0) {
            char pp[PATH_MAX_];
            join(pp, sizeof pp, path, keys[i]);
            rc = check_keys(c, pp, v, subkeys);
        }
    }
    return rc;
}

// The node of a (possibly dotted) table key in mapping n, or NULL.
static yaml_node_t *param_node(struct pctx *c, yaml_node_t *n, const char *key)
{
    const char *dot = strchr(key, '.');
    if (!dot)
        return map_get(c, n, key);
    char head[64];
    pathf(head, sizeof head, "%.*s", (int)(dot - key), key);
    return map_get(c, map_get(c, n, head), dot + 1);
}

// A plugin's `parameters`, walked through its type's table in table order
// (so an alias written after its key wins, as the keys are documented).
static int parse_params(struct pctx *c, const char *path, yaml_node_t *n,
                        struct tdm_router_plugin *pl)
{
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(pl->type);
    if (is_null(n))
        return TDM_OK;
    if (ops->n_params == 0) {
        if (n->type == YAML_MAPPING_NODE &&
            n->data.mapping.pairs.top == n->data.mapping.pairs.start)
            return TDM_OK;
        return perr(c, path, n, "%s takes no parameters", ops->name);
    }
    int rc = check_param_keys(c, path, n, ops);
    for (size_t i = 0; !rc && i < ops->n_params; i++) {
        yaml_node_t *v = param_node(c, n, ops->params[i].key);
        char kp[PATH_MAX_];
        join(kp, sizeof kp, path, ops->params[i].key);
        if (v)
            rc = read_param(c, kp, v, &ops->params[i], &pl->params);
    }
    return rc;
}

static int parse_plugins(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    if (n->type != YAML_SEQUENCE_NODE)
        return perr(c, "plugins", n, "expected a list, got %s", node_kind(n));
    for (size_t i = 0; i < seq_len(n); i++) {
        yaml_node_t *it = node_at(c, n->data.sequence.items.start[i]);
        char path[PATH_MAX_], kp[PATH_MAX_];
        pathf(path, sizeof path, "plugins[%zu]", i);
        static const char *const keys[] = {"name", "type", "parameters", NULL};
        int rc = check_keys(c, path, it, keys);
        if (rc)
            return rc;
        yaml_node_t *tn = map_get(c, it, "type");
        if (!tn)
            return perr(c, path, it, "missing key 'type'");
        const char *ts = scalar(tn);
        join(kp, sizeof kp, path, "type");
        if (!ts)
            return perr(c, kp, tn, "expected a string, got %s", node_kind(tn));
        int type = tdm_router_plugin_lookup(ts);
        if (type < 0)
            return perr(c, kp, tn,
                        "unknown plugin type '%s' (see docs/router-config.md for the catalog)", ts);
        const char *name = ts;
        yaml_node_t *nn = map_get(c, it, "name");
        if (nn) {
            join(kp, sizeof kp, path, "name");
            name = scalar(nn);
            if (!name || !*name)
                return perr(c, kp, nn, "expected a non-empty string");
        }
        if (tdm_router_config_find_plugin(cfg, name) != SIZE_MAX) {
            join(kp, sizeof kp, path, nn ? "name" : "type");
            return perr(c, kp, nn ? nn : tn, "a plugin named '%s' is already defined%s", name,
                        nn ? "" : " (give this one a name)");
        }
        size_t idx = add_plugin(c, cfg, name, (enum tdm_router_plugin_type)type);
        if (idx == SIZE_MAX)
            return TDM_ENOMEM;
        yaml_node_t *pn = map_get(c, it, "parameters");
        if (pn) {
            join(kp, sizeof kp, path, "parameters");
            if ((rc = parse_params(c, kp, pn, &cfg->plugins[idx])))
                return rc;
        }
    }
    return TDM_OK;
}

static int parse_profiles(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    if (n->type != YAML_SEQUENCE_NODE)
        return perr(c, "schedulingProfiles", n, "expected a list, got %s", node_kind(n));
    for (size_t i = 0; i < seq_len(n); i++) {
        yaml_node_t *it = node_at(c, n->data.sequence.items.start[i]);
        char path[PATH_MAX_], kp[PATH_MAX_];
        pathf(path, sizeof path, "schedulingProfiles[%zu]", i);
        static const char *const keys[] = {"name", "plugins", NULL};
        int rc = check_keys(c, path, it, keys);
        if (rc)
            return rc;
        yaml_node_t *nn = map_get(c, it, "name");
        if (!nn)
            return perr(c, path, it, "missing key 'name'");
        join(kp, sizeof kp, path, "name");
        const char *name = scalar(nn);
        if (!name || !*name)
            return perr(c, kp, nn, "expected a non-empty string");
        if (find_profile(cfg, name) != SIZE_MAX)
            return perr(c, kp, nn, "a profile named '%s' is already defined", name);
        struct tdm_router_profile *pr = add_profile(c, cfg, name);
        if (!pr)
            return TDM_ENOMEM;
        yaml_node_t *pl = map_get(c, it, "plugins");
        join(kp, sizeof kp, path, "plugins");
        if (!pl)
            return perr(c, path, it, "missing key 'plugins'");
        if (pl->type != YAML_SEQUENCE_NODE)
            return perr(c, kp, pl, "expected a list, got %s", node_kind(pl));
        for (size_t j = 0; j < seq_len(pl); j++) {
            yaml_node_t *r = node_at(c, pl->data.sequence.items.start[j]);
            char rp[PATH_MAX_], rk[PATH_MAX_];
            pathf(rp, sizeof rp, "%s.plugins[%zu]", path, j);
            static const char *const rkeys[] = {"pluginRef", "weight", NULL};
            if ((rc = check_keys(c, rp, r, rkeys)))
                return rc;
            yaml_node_t *refn = map_get(c, r, "pluginRef");
            if (!refn)
                return perr(c, rp, r, "missing key 'pluginRef'");
            join(rk, sizeof rk, rp, "pluginRef");
            const char *ref = scalar(refn);
            if (!ref)
                return perr(c, rk, refn, "expected a string, got %s", node_kind(refn));
            size_t pi = tdm_router_config_find_plugin(cfg, ref);
            if (pi == SIZE_MAX)
                return perr(c, rk, refn, "no plugin named '%s'", ref);
            enum tdm_router_plugin_kind kind = tdm_router_plugin_type_kind(cfg->plugins[pi].type);
            if (kind == TDM_ROUTER_PLUGIN_DECIDER || kind == TDM_ROUTER_PLUGIN_PROFILE_HANDLER ||
                kind == TDM_ROUTER_PLUGIN_PRODUCER || kind == TDM_ROUTER_PLUGIN_FLOW_POLICY)
                return perr(c, rk, refn,
                            "'%s' is a %s: it is configured at the top level, not in a profile",
                            ref,
                            kind == TDM_ROUTER_PLUGIN_DECIDER           ? "decider"
                            : kind == TDM_ROUTER_PLUGIN_PROFILE_HANDLER ? "profile handler"
                            : kind == TDM_ROUTER_PLUGIN_PRODUCER        ? "producer"
                                                                        : "flow control policy");
            for (size_t k = 0; k < pr->n_refs; k++)
                if (pr->refs[k].plugin == pi)
                    return perr(c, rk, refn, "'%s' is listed twice in this profile", ref);
            double weight = 1.0;
            yaml_node_t *wn = map_get(c, r, "weight");
            if (wn) {
                join(rk, sizeof rk, rp, "weight");
                if (kind != TDM_ROUTER_PLUGIN_SCORER)
                    return perr(c, rk, wn, "a weight applies to scorers only ('%s' is not one)",
                                ref);
                if ((rc = read_double(c, rk, wn, &weight, 0, 1e6)))
                    return rc;
            }
            if (kind == TDM_ROUTER_PLUGIN_PICKER) {
                if (pr->picker != SIZE_MAX)
                    return perr(c, rk, refn, "a profile takes one picker ('%s' and '%s')",
                                cfg->plugins[pr->refs[pr->picker].plugin].name, ref);
                pr->picker = pr->n_refs;
            }
            if ((rc = profile_add_ref(c, pr, pi, weight)))
                return rc;
        }
    }
    return TDM_OK;
}

// A profile without a picker gets max-score-picker (llm-d's default).
static int default_pickers(struct pctx *c, struct tdm_router_config *cfg)
{
    for (size_t i = 0; i < cfg->n_profiles; i++) {
        struct tdm_router_profile *pr = &cfg->profiles[i];
        if (pr->picker != SIZE_MAX)
            continue;
        size_t pi = SIZE_MAX;
        for (size_t k = 0; k < cfg->n_plugins; k++)
            if (cfg->plugins[k].type == TDM_ROUTER_MAX_SCORE_PICKER)
                pi = k;
        if (pi == SIZE_MAX) {
            const char *nm = "max-score-picker";
            if (tdm_router_config_find_plugin(cfg, nm) != SIZE_MAX)
                nm = "tandem-default-max-score-picker";
            pi = add_plugin(c, cfg, nm, TDM_ROUTER_MAX_SCORE_PICKER);
            if (pi == SIZE_MAX)
                return TDM_ENOMEM;
        }
        pr = &cfg->profiles[i];
        pr->picker = pr->n_refs;
        int rc = profile_add_ref(c, pr, pi, 1.0);
        if (rc)
            return rc;
    }
    return TDM_OK;
}

// Finds the profile handler and deciders and sets decode/prefill profiles and pd_*.
static int resolve_handler(struct pctx *c, yaml_node_t *root, struct tdm_router_config *cfg)
{
    size_t handler = SIZE_MAX;
    for (size_t i = 0; i < cfg->n_plugins; i++) {
        if (tdm_router_plugin_type_kind(cfg->plugins[i].type) != TDM_ROUTER_PLUGIN_PROFILE_HANDLER)
            continue;
        if (handler != SIZE_MAX) {
            char p[PATH_MAX_];
            pathf(p, sizeof p, "plugins[%zu]", i);
            return perr(c, p, NULL, "only one profile handler may be configured ('%s' and '%s')",
                        cfg->plugins[handler].name, cfg->plugins[i].name);
        }
        handler = i;
    }
    if (cfg->n_profiles == 0)
        return perr(c, "schedulingProfiles", map_get(c, root, "schedulingProfiles"),
                    "at least one scheduling profile is required");
    char hp[PATH_MAX_];
    pathf(hp, sizeof hp, "plugins[%zu].parameters", handler);
    if (handler == SIZE_MAX || cfg->plugins[handler].type == TDM_ROUTER_SINGLE_PROFILE_HANDLER) {
        if (cfg->n_profiles != 1)
            return perr(c, "schedulingProfiles", map_get(c, root, "schedulingProfiles"),
                        "%zu profiles need a disagg-profile-handler (the single-profile handler "
                        "runs exactly one)",
                        cfg->n_profiles);
        cfg->decode_profile = 0;
        cfg->pd_mode = TDM_ROUTER_PD_NEVER;
        return TDM_OK;
    }
    struct tdm_router_plugin_params *hpar = &cfg->plugins[handler].params;
    const char *dname =
        hpar->disagg_handler.decode_profile ? hpar->disagg_handler.decode_profile : "decode";
    const char *pname =
        hpar->disagg_handler.prefill_profile ? hpar->disagg_handler.prefill_profile : "prefill";
    char kp[PATH_MAX_];
    cfg->decode_profile = find_profile(cfg, dname);
    if (cfg->decode_profile == SIZE_MAX) {
        join(kp, sizeof kp, hp, "profiles.decode");
        return perr(c, kp, NULL, "no scheduling profile named '%s'", dname);
    }
    cfg->prefill_profile = find_profile(cfg, pname);
    if (cfg->prefill_profile == SIZE_MAX) {
        join(kp, sizeof kp, hp, "profiles.prefill");
        return perr(c, kp, NULL, "no scheduling profile named '%s'", pname);
    }
    if (cfg->decode_profile == cfg->prefill_profile) {
        join(kp, sizeof kp, hp, "profiles");
        return perr(c, kp, NULL, "decode and prefill must be different profiles");
    }
    if (hpar->disagg_handler.threshold_set) {
        // Deprecated pd-profile-handler `threshold`: a prefix decider of its own.
        struct tdm_router_plugin_params own;
        tdm_router_plugin_params_init(&own, TDM_ROUTER_PREFIX_PD_DECIDER);
        own.prefix_decider.non_cached_tokens = hpar->disagg_handler.threshold;
        cfg->pd_mode = tdm_router_prefix_pd_decider_ops.decide(&own, &cfg->pd_threshold_tokens);
        return TDM_OK;
    }
    size_t decider = SIZE_MAX;
    const char *dn = hpar->disagg_handler.prefill_decider;
    if (dn) {
        decider = tdm_router_config_find_plugin(cfg, dn);
        join(kp, sizeof kp, hp, "deciders.prefill");
        if (decider == SIZE_MAX)
            return perr(c, kp, NULL, "no plugin named '%s'", dn);
        if (tdm_router_plugin_type_kind(cfg->plugins[decider].type) != TDM_ROUTER_PLUGIN_DECIDER)
            return perr(c, kp, NULL, "'%s' is not a decider", dn);
    } else {
        // No decider named: the only decider plugin if there is exactly one,
        // else always disaggregate (llm-d's handler without a decider).
        size_t found = 0;
        for (size_t i = 0; i < cfg->n_plugins; i++)
            if (tdm_router_plugin_type_kind(cfg->plugins[i].type) == TDM_ROUTER_PLUGIN_DECIDER) {
                decider = i;
                found++;
            }
        if (found > 1) {
            join(kp, sizeof kp, hp, "deciders.prefill");
            return perr(c, kp, NULL, "%zu decider plugins: name the one to use", found);
        }
    }
    // No decider: llm-d's handler without one always disaggregates.
    const struct tdm_router_plugin_ops *dops =
        decider == SIZE_MAX ? &tdm_router_always_disagg_decider_ops
                            : tdm_router_plugin_ops_of(cfg->plugins[decider].type);
    cfg->pd_mode = dops->decide(decider == SIZE_MAX ? hpar : &cfg->plugins[decider].params,
                                &cfg->pd_threshold_tokens);
    return TDM_OK;
}

// ---- the short form -----------------------------------------------------------------------------

struct short_ref {
    enum tdm_router_plugin_type type;
    double weight;
};

static size_t get_or_add(struct pctx *c, struct tdm_router_config *cfg,
                         enum tdm_router_plugin_type type)
{
    for (size_t i = 0; i < cfg->n_plugins; i++)
        if (cfg->plugins[i].type == type)
            return i;
    return add_plugin(c, cfg, tdm_router_plugin_type_name(type), type);
}

static int short_profile(struct pctx *c, struct tdm_router_config *cfg, const char *name,
                         enum tdm_router_plugin_type role_filter, const struct short_ref *refs,
                         size_t n)
{
    size_t fi = get_or_add(c, cfg, role_filter);
    if (fi == SIZE_MAX)
        return TDM_ENOMEM;
    struct tdm_router_profile *pr = add_profile(c, cfg, name);
    if (!pr)
        return TDM_ENOMEM;
    size_t prof = cfg->n_profiles - 1;
    int rc = profile_add_ref(c, pr, fi, 1.0);
    for (size_t i = 0; !rc && i < n; i++) {
        size_t pi = get_or_add(c, cfg, refs[i].type);
        if (pi == SIZE_MAX)
            return TDM_ENOMEM;
        pr = &cfg->profiles[prof];
        if (tdm_router_plugin_type_kind(refs[i].type) == TDM_ROUTER_PLUGIN_PICKER)
            pr->picker = pr->n_refs;
        rc = profile_add_ref(c, pr, pi, refs[i].weight);
    }
    return rc;
}

// Expands `policy: NAME` into plugins and the decode/prefill profiles
// (docs/router-config.md lists each expansion).
static int expand_short(struct pctx *c, yaml_node_t *pn, struct tdm_router_config *cfg)
{
    static const struct short_ref rr[] = {{TDM_ROUTER_ROUND_ROBIN_PICKER, 1}};
    static const struct short_ref rnd[] = {{TDM_ROUTER_RANDOM_PICKER, 1}};
    static const struct short_ref ll[] = {{TDM_ROUTER_QUEUE_SCORER, 2},
                                          {TDM_ROUTER_RUNNING_SCORER, 1},
                                          {TDM_ROUTER_KV_CACHE_UTIL_SCORER, 1},
                                          {TDM_ROUTER_MAX_SCORE_PICKER, 1}};
    static const struct short_ref pc[] = {{TDM_ROUTER_PREFIX_CACHE_SCORER, 3},
                                          {TDM_ROUTER_QUEUE_SCORER, 1},
                                          {TDM_ROUTER_KV_CACHE_UTIL_SCORER, 1},
                                          {TDM_ROUTER_MAX_SCORE_PICKER, 1}};
    static const struct short_ref sa[] = {{TDM_ROUTER_SESSION_AFFINITY_SCORER, 10},
                                          {TDM_ROUTER_QUEUE_SCORER, 1},
                                          {TDM_ROUTER_KV_CACHE_UTIL_SCORER, 1},
                                          {TDM_ROUTER_MAX_SCORE_PICKER, 1}};
    const char *pol = scalar(pn);
    const struct short_ref *d = NULL, *p = NULL;
    size_t nd = 0, np = 0;
#define SET(a, b) (d = (a), nd = sizeof(a) / sizeof *(a), p = (b), np = sizeof(b) / sizeof *(b))
    if (!pol)
        return perr(c, "policy", pn, "expected a string, got %s", node_kind(pn));
    if (!strcmp(pol, "round_robin"))
        SET(rr, rr);
    else if (!strcmp(pol, "random"))
        SET(rnd, rnd);
    else if (!strcmp(pol, "least_loaded"))
        SET(ll, ll);
    else if (!strcmp(pol, "prefix_cache"))
        SET(pc, pc);
    else if (!strcmp(pol, "session_affinity"))
        SET(sa, ll); // prefill has no session: balance it by load
    else
        return perr(c, "policy", pn,
                    "unknown policy '%s' (known: round_robin, random, least_loaded, "
                    "prefix_cache, session_affinity)",
                    pol);
#undef SET
    int rc;
    if ((rc = set_string(c, &cfg->short_policy, pol)))
        return rc;
    if ((rc = short_profile(c, cfg, "decode", TDM_ROUTER_DECODE_FILTER, d, nd)))
        return rc;
    if ((rc = short_profile(c, cfg, "prefill", TDM_ROUTER_PREFILL_FILTER, p, np)))
        return rc;
    cfg->decode_profile = 0;
    cfg->prefill_profile = 1;
    return TDM_OK;
}

// ---- Tandem sections ----------------------------------------------------------------------------

// "host", "host:port", "[v6]" or "[v6]:port" into host (heap) and *port (unchanged
// when absent).
static int split_host_port(struct pctx *c, const char *path, yaml_node_t *n, const char *s,
                           char **host, int *port)
{
    const char *h = s, *he, *ps = NULL;
    if (*s == '[') {
        he = strchr(s, ']');
        if (!he)
            return perr(c, path, n, "'%s': missing ']' after an IPv6 address", s);
        h = s + 1;
        if (he[1] == ':')
            ps = he + 2;
        else if (he[1])
            return perr(c, path, n, "'%s': expected ':port' after ']'", s);
    } else {
        const char *colon = strchr(s, ':');
        if (colon && strchr(colon + 1, ':'))
            return perr(c, path, n, "'%s': write an IPv6 address as [addr]:port", s);
        he = colon ? colon : s + strlen(s);
        if (colon)
            ps = colon + 1;
    }
    if (he == h)
        return perr(c, path, n, "'%s': empty host", s);
    if ((size_t)(he - h) >= TDM_ROUTER_NAME_MAX - 8)
        return perr(c, path, n, "'%s': host too long", s);
    if (ps) {
        char *end = NULL;
        errno = 0;
        long v = strtol(ps, &end, 10);
        if (!*ps || *end || errno || v < 1 || v > 65535)
            return perr(c, path, n, "'%s': port must be an integer in [1, 65535]", s);
        *port = (int)v;
    }
    *host = strndup(h, (size_t)(he - h));
    if (!*host)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
    return TDM_OK;
}

static int add_static(struct pctx *c, struct tdm_router_config *cfg, char *host, int http_port,
                      int nng_port, enum tdm_router_role role)
{
    struct tdm_router_static_endpoint *ns =
        realloc(cfg->static_endpoints, (cfg->n_static + 1) * sizeof *ns);
    if (!ns) {
        free(host);
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
    }
    cfg->static_endpoints = ns;
    ns[cfg->n_static++] = (struct tdm_router_static_endpoint){host, http_port, nng_port, role};
    return TDM_OK;
}

static int add_dns(struct pctx *c, struct tdm_router_config *cfg, char *name, int http_port,
                   int nng_port, enum tdm_router_role role)
{
    struct tdm_router_dns_endpoint *nd = realloc(cfg->dns_endpoints, (cfg->n_dns + 1) * sizeof *nd);
    if (!nd) {
        free(name);
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "out of memory");
    }
    cfg->dns_endpoints = nd;
    nd[cfg->n_dns++] = (struct tdm_router_dns_endpoint){name, http_port, nng_port, role};
    return TDM_OK;
}

// One entry of a static or dns list: "host[:port]" or {host|name, http_port, nng_port}.
static int parse_entry(struct pctx *c, const char *path, yaml_node_t *n, bool dns, int def_http,
                       int def_nng, enum tdm_router_role role, struct tdm_router_config *cfg)
{
    char *host = NULL;
    int http = def_http, nng = def_nng, rc;
    bool nng_given = def_nng > 0;
    const char *s = scalar(n);
    if (s) {
        if ((rc = split_host_port(c, path, n, s, &host, &http)))
            return rc;
    } else {
        static const char *const skeys[] = {"host", "http_port", "nng_port", NULL};
        static const char *const dkeys[] = {"name", "http_port", "nng_port", NULL};
        if ((rc = check_keys(c, path, n, dns ? dkeys : skeys)))
            return rc;
        const char *hk = dns ? "name" : "host";
        yaml_node_t *hn = map_get(c, n, hk);
        char kp[PATH_MAX_];
        if (!hn)
            return perr(c, path, n, "missing key '%s'", hk);
        join(kp, sizeof kp, path, hk);
        const char *hs = scalar(hn);
        if (!hs || !*hs)
            return perr(c, kp, hn, "expected a non-empty string");
        if ((rc = split_host_port(c, kp, hn, hs, &host, &http)))
            return rc;
        yaml_node_t *v;
        if ((v = map_get(c, n, "http_port")) &&
            (rc = read_int(c, (join(kp, sizeof kp, path, "http_port"), kp), v, &http, 1, 65535)))
            goto fail;
        if ((v = map_get(c, n, "nng_port"))) {
            if ((rc = read_int(c, (join(kp, sizeof kp, path, "nng_port"), kp), v, &nng, 1, 65535)))
                goto fail;
            nng_given = true;
        }
    }
    if (!nng_given) {
        // Convention (docs/router-config.md): the worker's nng port is its HTTP port + 1000.
        if (http + 1000 > 65535) {
            rc = perr(c, path, n, "nng_port must be given when http_port + 1000 > 65535");
            goto fail;
        }
        nng = http + 1000;
    }
    return dns ? add_dns(c, cfg, host, http, nng, role) : add_static(c, cfg, host, http, nng, role);
fail:
    free(host);
    return rc;
}

static int parse_role_endpoints(struct pctx *c, const char *path, yaml_node_t *n,
                                enum tdm_router_role role, struct tdm_router_config *cfg)
{
    int def_http = 8001, def_nng = 0, rc;
    yaml_node_t *stat = NULL, *dns = NULL;
    char kp[PATH_MAX_];
    if (n->type == YAML_SEQUENCE_NODE) {
        stat = n;
    } else {
        static const char *const keys[] = {"http_port", "nng_port", "static", "dns", NULL};
        if ((rc = check_keys(c, path, n, keys)))
            return rc;
        yaml_node_t *v;
        if ((v = map_get(c, n, "http_port")) &&
            (rc =
                 read_int(c, (join(kp, sizeof kp, path, "http_port"), kp), v, &def_http, 1, 65535)))
            return rc;
        if ((v = map_get(c, n, "nng_port")) &&
            (rc = read_int(c, (join(kp, sizeof kp, path, "nng_port"), kp), v, &def_nng, 1, 65535)))
            return rc;
        stat = map_get(c, n, "static");
        dns = map_get(c, n, "dns");
    }
    for (int pass = 0; pass < 2; pass++) {
        yaml_node_t *list = pass ? dns : stat;
        if (!list || is_null(list))
            continue;
        char lp[PATH_MAX_];
        if (list == n)
            pathf(lp, sizeof lp, "%s", path);
        else
            join(lp, sizeof lp, path, pass ? "dns" : "static");
        if (list->type != YAML_SEQUENCE_NODE)
            return perr(c, lp, list, "expected a list, got %s", node_kind(list));
        for (size_t i = 0; i < seq_len(list); i++) {
            char ep[PATH_MAX_];
            pathf(ep, sizeof ep, "%s[%zu]", lp, i);
            if ((rc = parse_entry(c, ep, node_at(c, list->data.sequence.items.start[i]), pass == 1,
                                  def_http, def_nng, role, cfg)))
                return rc;
        }
    }
    return TDM_OK;
}

static int parse_endpoints(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"prefill", "decode", "prefill-decode", "dns_refresh_seconds",
                                       NULL};
    int rc = check_keys(c, "endpoints", n, keys);
    if (rc)
        return rc;
    static const struct {
        const char *key;
        enum tdm_router_role role;
    } roles[] = {{"prefill", TDM_ROUTER_ROLE_PREFILL},
                 {"decode", TDM_ROUTER_ROLE_DECODE},
                 {"prefill-decode", TDM_ROUTER_ROLE_PREFILL_DECODE}};
    for (size_t i = 0; i < 3; i++) {
        yaml_node_t *v = map_get(c, n, roles[i].key);
        char kp[PATH_MAX_];
        join(kp, sizeof kp, "endpoints", roles[i].key);
        if (v && !is_null(v) && (rc = parse_role_endpoints(c, kp, v, roles[i].role, cfg)))
            return rc;
    }
    yaml_node_t *v = map_get(c, n, "dns_refresh_seconds");
    if (v && (rc = read_double(c, "endpoints.dns_refresh_seconds", v, &cfg->dns_refresh_seconds,
                               0.1, 86400)))
        return rc;
    // The same endpoint twice would be scored twice.
    for (size_t i = 0; i < cfg->n_static; i++)
        for (size_t j = 0; j < i; j++)
            if (!strcmp(cfg->static_endpoints[i].host, cfg->static_endpoints[j].host) &&
                cfg->static_endpoints[i].http_port == cfg->static_endpoints[j].http_port)
                return perr(c, "endpoints", n, "%s:%d is listed twice",
                            cfg->static_endpoints[i].host, cfg->static_endpoints[i].http_port);
    return TDM_OK;
}

static int parse_health(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"interval_seconds",
                                       "timeout_seconds",
                                       "failure_threshold",
                                       "success_threshold",
                                       "path",
                                       NULL};
    int rc = check_keys(c, "health", n, keys);
    yaml_node_t *v;
    if (rc)
        return rc;
    if ((v = map_get(c, n, "interval_seconds")) &&
        (rc = read_double(c, "health.interval_seconds", v, &cfg->health.interval_seconds, 0.05,
                          3600)))
        return rc;
    if ((v = map_get(c, n, "timeout_seconds")) &&
        (rc = read_double(c, "health.timeout_seconds", v, &cfg->health.timeout_seconds, 0.01, 600)))
        return rc;
    if ((v = map_get(c, n, "failure_threshold")) &&
        (rc = read_int(c, "health.failure_threshold", v, &cfg->health.failure_threshold, 1, 1000)))
        return rc;
    if ((v = map_get(c, n, "success_threshold")) &&
        (rc = read_int(c, "health.success_threshold", v, &cfg->health.success_threshold, 1, 1000)))
        return rc;
    if ((v = map_get(c, n, "path"))) {
        if ((rc = read_string(c, "health.path", v, &cfg->health.path)))
            return rc;
        if (cfg->health.path[0] != '/' || strpbrk(cfg->health.path, " \r\n"))
            return perr(c, "health.path", v, "must start with '/' and contain no spaces");
        if (strlen(cfg->health.path) > 200)
            return perr(c, "health.path", v, "longer than 200 bytes");
    }
    return TDM_OK;
}

static int parse_request(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"deadline_seconds", "prefill_retries", "session_header",
                                       NULL};
    int rc = check_keys(c, "request", n, keys);
    yaml_node_t *v;
    if (rc)
        return rc;
    if ((v = map_get(c, n, "deadline_seconds")) &&
        (rc = read_double(c, "request.deadline_seconds", v, &cfg->request_deadline_seconds, 0.1,
                          86400)))
        return rc;
    if ((v = map_get(c, n, "prefill_retries")) &&
        (rc = read_int(c, "request.prefill_retries", v, &cfg->prefill_retries, 0,
                       TDM_ROUTER_MAX_PREFILL_CANDIDATES - 1)))
        return rc;
    if ((v = map_get(c, n, "session_header"))) {
        if ((rc = read_string(c, "request.session_header", v, &cfg->session_header)))
            return rc;
        for (char *s = cfg->session_header; *s; s++)
            if (*s >= 'A' && *s <= 'Z')
                *s = (char)(*s - 'A' + 'a');
    }
    return TDM_OK;
}

static int parse_prefix_index(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"block_size_tokens", "max_prefix_blocks_to_match",
                                       "lru_capacity_per_server", NULL};
    int rc = check_keys(c, "prefix_index", n, keys);
    yaml_node_t *v;
    if (rc)
        return rc;
    if ((v = map_get(c, n, "block_size_tokens")) &&
        (rc = read_int(c, "prefix_index.block_size_tokens", v, &cfg->block_size_tokens, 1, 4096)))
        return rc;
    if ((v = map_get(c, n, "max_prefix_blocks_to_match")) &&
        (rc = read_int(c, "prefix_index.max_prefix_blocks_to_match", v,
                       &cfg->max_prefix_blocks_to_match, 1, 1000000)))
        return rc;
    if ((v = map_get(c, n, "lru_capacity_per_server")) &&
        (rc = read_int(c, "prefix_index.lru_capacity_per_server", v, &cfg->lru_capacity_per_server,
                       1, 100000000)))
        return rc;
    return TDM_OK;
}

// ---- the document ---------------------------------------------------------------------------

// Plugin parameters that configure the router as a whole: the prefix index
// (the deprecated handler's hashBlockSize, then the producer's, else the
// scorer's, when they differ from the table default) and the session header.
// ---- flow control: featureGates, flowControl, saturationDetector, objectives ------------------

// A Kubernetes quantity (llm-d's maxBytes, maxRequests): a whole number, or a
// number with a decimal (k M G T P E) or binary (Ki Mi Gi Ti Pi Ei) suffix or
// an exponent (1e9). Fractions round up, as Quantity.Value() does.
static int read_quantity(struct pctx *c, const char *path, yaml_node_t *n, long long *out)
{
    static const struct {
        const char *s;
        double m;
    } suf[] = {{"", 1},        {"k", 1e3},     {"M", 1e6},     {"G", 1e9},     {"T", 1e12},
               {"P", 1e15},    {"E", 1e18},    {"Ki", 1024.0}, {"Mi", 0x1p20}, {"Gi", 0x1p30},
               {"Ti", 0x1p40}, {"Pi", 0x1p50}, {"Ei", 0x1p60}};
    const char *s = scalar(n);
    if (!s)
        return perr(c, path, n, "expected a quantity, got %s", node_kind(n));
    errno = 0;
    char *end = NULL;
    double v = (*s >= '0' && *s <= '9') || *s == '.' ? strtod(s, &end) : NAN;
    double mult = 0;
    for (size_t i = 0; end && !isnan(v) && i < sizeof suf / sizeof suf[0]; i++)
        if (!strcmp(end, suf[i].s))
            mult = suf[i].m;
    if (errno || isnan(v) || mult == 0 || !isfinite(v * mult))
        return perr(c, path, n, "expected a quantity such as 1000, 500M or 1Gi, got '%s'", s);
    double q = ceil(v * mult);
    if (q > 0x1p62)
        return perr(c, path, n, "'%s' is out of range (at most 2^62)", s);
    *out = (long long)q;
    return TDM_OK;
}

// A Go duration (llm-d's defaultRequestTTL): "30s", "1m30s", "500ms", "1.5h",
// or 0. Units h, m, s, ms, us (µs), ns.
static int read_duration(struct pctx *c, const char *path, yaml_node_t *n, double *out, double max)
{
    static const struct {
        const char *u;
        double sec;
    } units[] = {{"ns", 1e-9}, {"us", 1e-6}, {"\xc2\xb5s", 1e-6}, {"ms", 1e-3},
                 {"s", 1},     {"m", 60},    {"h", 3600}};
    const char *s = scalar(n);
    if (!s)
        return perr(c, path, n, "expected a duration, got %s", node_kind(n));
    double total = 0;
    bool ok = *s != '\0';
    if (!strcmp(s, "0")) {
        *out = 0;
        return TDM_OK;
    }
    for (const char *p = s; ok && *p;) {
        if (!((*p >= '0' && *p <= '9') || *p == '.')) {
            ok = false;
            break;
        }
        char *end = NULL;
        errno = 0;
        double v = strtod(p, &end);
        if (errno || end == p) {
            ok = false;
            break;
        }
        size_t best = 0, best_len = 0; // the longest unit that matches ("ms" before "m")
        for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
            size_t l = strlen(units[i].u);
            if (l > best_len && !strncmp(end, units[i].u, l))
                best = i, best_len = l;
        }
        if (best_len == 0) {
            ok = false;
            break;
        }
        total += v * units[best].sec;
        p = end + best_len;
    }
    if (!ok || !isfinite(total))
        return perr(c, path, n, "expected a duration such as 30s, 500ms or 1m30s, got '%s'", s);
    if (total > max)
        return perr(c, path, n, "'%s' is longer than %gs", s, max);
    *out = total;
    return TDM_OK;
}

// A policy reference: a plugin's name (of the right type family), else a type
// name of that family itself (llm-d's defaults are referred to by type).
static int read_policy_ref(struct pctx *c, const char *path, yaml_node_t *n,
                           const struct tdm_router_config *cfg, bool fairness,
                           enum tdm_router_plugin_type *out)
{
    const char *ref = scalar(n);
    if (!ref)
        return perr(c, path, n, "expected a string, got %s", node_kind(n));
    const char *known = fairness ? "global-strict-fairness-policy, round-robin-fairness-policy"
                                 : "fcfs-ordering-policy";
    size_t pi = tdm_router_config_find_plugin(cfg, ref);
    int t = pi != SIZE_MAX ? (int)cfg->plugins[pi].type : tdm_router_plugin_lookup(ref);
    bool fits = fairness
                    ? t == TDM_ROUTER_GLOBAL_STRICT_FAIRNESS || t == TDM_ROUTER_ROUND_ROBIN_FAIRNESS
                    : t == TDM_ROUTER_FCFS_ORDERING;
    if (!fits)
        return perr(c, path, n, "'%s' is not %s policy (known: %s)", ref,
                    fairness ? "a fairness" : "an ordering", known);
    *out = (enum tdm_router_plugin_type)t;
    return TDM_OK;
}

// One band (with_priority: a priorityBands entry; else defaultPriorityBand).
static int parse_band(struct pctx *c, const char *path, yaml_node_t *n,
                      const struct tdm_router_config *cfg, bool with_priority,
                      struct tdm_router_flow_band *b)
{
    static const char *const keys[] = {"priority",          "maxRequests",       "maxBytes",
                                       "fairnessPolicyRef", "orderingPolicyRef", NULL};
    static const char *const dkeys[] = {"maxRequests", "maxBytes", "fairnessPolicyRef",
                                        "orderingPolicyRef", NULL};
    if (n->type != YAML_MAPPING_NODE)
        return perr(c, path, n, "expected a mapping, got %s", node_kind(n));
    int rc = check_keys(c, path, n, with_priority ? keys : dkeys);
    if (rc)
        return rc;
    char kp[PATH_MAX_];
    yaml_node_t *v;
    if (with_priority) {
        join(kp, sizeof kp, path, "priority");
        if (!(v = map_get(c, n, "priority")))
            return perr(c, kp, n, "missing");
        if ((rc = read_int(c, kp, v, &b->priority, -1000000000LL, 1000000000LL)))
            return rc;
    }
    join(kp, sizeof kp, path, "maxRequests");
    if ((v = map_get(c, n, "maxRequests")) && (rc = read_quantity(c, kp, v, &b->max_requests)))
        return rc;
    join(kp, sizeof kp, path, "maxBytes");
    if ((v = map_get(c, n, "maxBytes")) && (rc = read_quantity(c, kp, v, &b->max_bytes)))
        return rc;
    if (b->max_bytes == 0)
        b->max_bytes = TDM_ROUTER_FLOW_BAND_MAX_BYTES;
    join(kp, sizeof kp, path, "fairnessPolicyRef");
    if ((v = map_get(c, n, "fairnessPolicyRef")) &&
        (rc = read_policy_ref(c, kp, v, cfg, true, &b->fairness)))
        return rc;
    join(kp, sizeof kp, path, "orderingPolicyRef");
    if ((v = map_get(c, n, "orderingPolicyRef")) &&
        (rc = read_policy_ref(c, kp, v, cfg, false, &b->ordering)))
        return rc;
    return TDM_OK;
}

static void band_defaults(struct tdm_router_flow_band *b)
{
    memset(b, 0, sizeof *b);
    b->max_bytes = TDM_ROUTER_FLOW_BAND_MAX_BYTES;
    b->fairness = TDM_ROUTER_GLOBAL_STRICT_FAIRNESS;
    b->ordering = TDM_ROUTER_FCFS_ORDERING;
}

static int parse_flow_control(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"maxBytes",      "maxRequests",         "defaultRequestTTL",
                                       "priorityBands", "defaultPriorityBand", NULL};
    struct tdm_router_flow_config *fc = &cfg->flow;
    if (n->type != YAML_MAPPING_NODE)
        return perr(c, "flowControl", n, "expected a mapping, got %s", node_kind(n));
    int rc = check_keys(c, "flowControl", n, keys);
    yaml_node_t *v;
    if (rc)
        return rc;
    if ((v = map_get(c, n, "maxBytes")) &&
        (rc = read_quantity(c, "flowControl.maxBytes", v, &fc->max_bytes)))
        return rc;
    if ((v = map_get(c, n, "maxRequests")) &&
        (rc = read_quantity(c, "flowControl.maxRequests", v, &fc->max_requests)))
        return rc;
    if ((v = map_get(c, n, "defaultRequestTTL")) &&
        (rc = read_duration(c, "flowControl.defaultRequestTTL", v, &fc->default_ttl, 86400)))
        return rc;
    if ((v = map_get(c, n, "defaultPriorityBand")) &&
        (rc = parse_band(c, "flowControl.defaultPriorityBand", v, cfg, false, &fc->default_band)))
        return rc;
    yaml_node_t *bands = map_get(c, n, "priorityBands");
    if (bands && !is_null(bands)) {
        if (bands->type != YAML_SEQUENCE_NODE)
            return perr(c, "flowControl.priorityBands", bands, "expected a list, got %s",
                        node_kind(bands));
        if (seq_len(bands) > TDM_ROUTER_FLOW_MAX_BANDS)
            return perr(c, "flowControl.priorityBands", bands, "more than %d bands",
                        TDM_ROUTER_FLOW_MAX_BANDS);
        for (size_t i = 0; i < seq_len(bands); i++) {
            char path[PATH_MAX_];
            pathf(path, sizeof path, "flowControl.priorityBands[%zu]", i);
            yaml_node_t *it = node_at(c, bands->data.sequence.items.start[i]);
            struct tdm_router_flow_band *b = &fc->bands[fc->n_bands];
            band_defaults(b);
            if ((rc = parse_band(c, path, it, cfg, true, b)))
                return rc;
            for (size_t j = 0; j < fc->n_bands; j++)
                if (fc->bands[j].priority == b->priority)
                    return perr(c, path, it, "priority %d is listed twice (also band %zu)",
                                b->priority, j);
            fc->n_bands++;
        }
    }
    return TDM_OK;
}

static int parse_saturation_detector(struct pctx *c, yaml_node_t *root,
                                     struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"pluginRef", NULL};
    yaml_node_t *n = map_get(c, root, "saturationDetector");
    const char *ref = "utilization-detector";
    yaml_node_t *refn = NULL;
    int rc;
    if (n && !is_null(n)) {
        if (n->type != YAML_MAPPING_NODE)
            return perr(c, "saturationDetector", n, "expected a mapping, got %s", node_kind(n));
        if ((rc = check_keys(c, "saturationDetector", n, keys)))
            return rc;
        if ((refn = map_get(c, n, "pluginRef")) && !(ref = scalar(refn)))
            return perr(c, "saturationDetector.pluginRef", refn, "expected a string, got %s",
                        node_kind(refn));
    }
    size_t pi = tdm_router_config_find_plugin(cfg, ref);
    struct tdm_router_plugin_params p;
    if (pi != SIZE_MAX && cfg->plugins[pi].type == TDM_ROUTER_UTILIZATION_DETECTOR) {
        p = cfg->plugins[pi].params;
    } else if (pi == SIZE_MAX && !strcmp(ref, "utilization-detector")) {
        tdm_router_plugin_params_init(&p, TDM_ROUTER_UTILIZATION_DETECTOR);
    } else if (pi != SIZE_MAX) {
        return perr(c, "saturationDetector.pluginRef", refn,
                    "'%s' is a %s, not a saturation detector (known: utilization-detector)", ref,
                    tdm_router_plugin_type_name(cfg->plugins[pi].type));
    } else {
        return perr(c, "saturationDetector.pluginRef", refn,
                    "no plugin named '%s' (known detector: utilization-detector)", ref);
    }
    cfg->flow.queue_depth_threshold = p.utilization.queue_depth_threshold;
    cfg->flow.kv_cache_util_threshold = p.utilization.kv_cache_util_threshold;
    return TDM_OK;
}

static int parse_objectives(struct pctx *c, yaml_node_t *n, struct tdm_router_config *cfg)
{
    if (is_null(n))
        return TDM_OK;
    if (n->type != YAML_MAPPING_NODE)
        return perr(c, "objectives", n, "expected a mapping of name: priority, got %s",
                    node_kind(n));
    size_t cnt = (size_t)(n->data.mapping.pairs.top - n->data.mapping.pairs.start);
    cfg->flow.objectives = calloc(cnt ? cnt : 1, sizeof *cfg->flow.objectives);
    if (!cfg->flow.objectives)
        return tdm_seterr(c->err, c->errlen, TDM_ENOMEM, "objectives: out of memory");
    for (yaml_node_pair_t *p = n->data.mapping.pairs.start; p < n->data.mapping.pairs.top; p++) {
        yaml_node_t *k = node_at(c, p->key);
        const char *name = scalar(k);
        char path[PATH_MAX_];
        pathf(path, sizeof path, "objectives.%.100s", name ? name : "?");
        if (!name || !*name || strlen(name) > 253)
            return perr(c, "objectives", k, "an objective name must be 1 to 253 bytes");
        for (size_t j = 0; j < cfg->flow.n_objectives; j++)
            if (!strcmp(cfg->flow.objectives[j].name, name))
                return perr(c, path, k, "listed twice");
        struct tdm_router_objective *o = &cfg->flow.objectives[cfg->flow.n_objectives];
        int rc = read_int(c, path, node_at(c, p->value), &o->priority, -1000000000LL, 1000000000LL);
        if (rc)
            return rc;
        if ((rc = set_string(c, &o->name, name)))
            return rc;
        cfg->flow.n_objectives++;
    }
    return TDM_OK;
}

static int parse_flow(struct pctx *c, yaml_node_t *root, struct tdm_router_config *cfg)
{
    int rc;
    yaml_node_t *v;
    band_defaults(&cfg->flow.default_band);
    if ((v = map_get(c, root, "featureGates")) && !is_null(v)) {
        if (v->type != YAML_SEQUENCE_NODE)
            return perr(c, "featureGates", v, "expected a list, got %s", node_kind(v));
        for (size_t i = 0; i < seq_len(v); i++) {
            char path[PATH_MAX_];
            pathf(path, sizeof path, "featureGates[%zu]", i);
            yaml_node_t *g = node_at(c, v->data.sequence.items.start[i]);
            const char *s = scalar(g);
            if (!s)
                return perr(c, path, g, "expected a string, got %s", node_kind(g));
            if (strcmp(s, "flowControl"))
                return perr(c, path, g, "unknown feature gate '%s' (known: flowControl)", s);
            cfg->flow.enabled = true;
        }
    }
    if ((v = map_get(c, root, "flowControl")) && !is_null(v) &&
        (rc = parse_flow_control(c, v, cfg)))
        return rc;
    if ((rc = parse_saturation_detector(c, root, cfg)))
        return rc;
    if ((v = map_get(c, root, "objectives")) && (rc = parse_objectives(c, v, cfg)))
        return rc;
    return TDM_OK;
}

const struct tdm_router_flow_band *tdm_router_flow_band_of(const struct tdm_router_flow_config *fc,
                                                           int priority)
{
    for (size_t i = 0; i < fc->n_bands; i++)
        if (fc->bands[i].priority == priority)
            return &fc->bands[i];
    return &fc->default_band;
}

int tdm_router_objective_priority(const struct tdm_router_flow_config *fc, const char *name)
{
    for (size_t i = 0; name && i < fc->n_objectives; i++)
        if (!strcmp(fc->objectives[i].name, name))
            return fc->objectives[i].priority;
    return 0;
}

static int apply_plugin_globals(struct pctx *c, struct tdm_router_config *cfg)
{
    struct tdm_router_plugin_params def;
    tdm_router_plugin_params_init(&def, TDM_ROUTER_APPROX_PREFIX_PRODUCER);
    for (size_t i = 0; i < cfg->n_plugins; i++) {
        const struct tdm_router_plugin *p = &cfg->plugins[i];
        if (p->type == TDM_ROUTER_DISAGG_PROFILE_HANDLER &&
            p->params.disagg_handler.hash_block_size)
            cfg->block_size_tokens = p->params.disagg_handler.hash_block_size;
    }
    for (size_t i = 0; i < cfg->n_plugins; i++) {
        const struct tdm_router_plugin *p = &cfg->plugins[i];
        if (p->type == TDM_ROUTER_APPROX_PREFIX_PRODUCER ||
            (p->type == TDM_ROUTER_PREFIX_CACHE_SCORER &&
             tdm_router_config_find_plugin(cfg, "approx-prefix-cache-producer") == SIZE_MAX)) {
            const struct tdm_router_prefix_index_params *x = &p->params.prefix_index;
            if (x->block_size_tokens != def.prefix_index.block_size_tokens)
                cfg->block_size_tokens = x->block_size_tokens;
            if (x->max_prefix_blocks_to_match != def.prefix_index.max_prefix_blocks_to_match)
                cfg->max_prefix_blocks_to_match = x->max_prefix_blocks_to_match;
            if (x->lru_capacity_per_server != def.prefix_index.lru_capacity_per_server)
                cfg->lru_capacity_per_server = x->lru_capacity_per_server;
        }
        int rc;
        const char *hn = p->params.session_affinity.header_name;
        if (p->type == TDM_ROUTER_SESSION_AFFINITY_SCORER && hn &&
            (rc = set_string(c, &cfg->session_header, hn)))
            return rc;
    }
    return TDM_OK;
}

static int parse_root(struct pctx *c, yaml_node_t *root, struct tdm_router_config *cfg)
{
    static const char *const keys[] = {"apiVersion",
                                       "kind",
                                       "plugins",
                                       "schedulingProfiles",
                                       "policy",
                                       "pd_threshold_tokens",
                                       "pd_mode",
                                       "endpoints",
                                       "health",
                                       "load_stale_seconds",
                                       "request",
                                       "prefix_index",
                                       "featureGates",
                                       "flowControl",
                                       "saturationDetector",
                                       "objectives",
                                       NULL};
    int rc;
    if (!root || root->type != YAML_MAPPING_NODE)
        return perr(c, "(top level)", root, "expected a mapping, got %s", node_kind(root));
    if ((rc = check_keys(c, "", root, keys)))
        return rc;
    yaml_node_t *v;
    if ((v = map_get(c, root, "apiVersion"))) {
        if ((rc = read_string(c, "apiVersion", v, &cfg->api_version)))
            return rc;
        if (strncmp(cfg->api_version, "llm-d.ai/", 9) &&
            strncmp(cfg->api_version, "inference.networking.x-k8s.io/", 30) &&
            strncmp(cfg->api_version, "tandem/", 7))
            return perr(c, "apiVersion", v,
                        "'%s' is not an EndpointPickerConfig version (llm-d.ai/v1alpha1, "
                        "llm-d.ai/v1)",
                        cfg->api_version);
    }
    if ((v = map_get(c, root, "kind"))) {
        const char *k = scalar(v);
        if (!k || strcmp(k, "EndpointPickerConfig"))
            return perr(c, "kind", v, "expected EndpointPickerConfig, got %s%s%s", k ? "'" : "",
                        k ? k : node_kind(v), k ? "'" : "");
    }
    yaml_node_t *policy = map_get(c, root, "policy");
    yaml_node_t *plugins = map_get(c, root, "plugins");
    yaml_node_t *profiles = map_get(c, root, "schedulingProfiles");
    yaml_node_t *pdt = map_get(c, root, "pd_threshold_tokens");
    yaml_node_t *pdm = map_get(c, root, "pd_mode");
    if (policy && (plugins || profiles))
        return perr(c, "policy", policy,
                    "use either the short form (policy) or plugins/schedulingProfiles, not both");
    if (!policy && !plugins)
        return perr(c, "(top level)", root,
                    "no routing configured: give 'policy' (short form) or 'plugins' and "
                    "'schedulingProfiles'");
    if (!policy && (pdt || pdm))
        return perr(c, pdt ? "pd_threshold_tokens" : "pd_mode", pdt ? pdt : pdm,
                    "short-form key: with plugins, set the prefix-based-pd-decider's "
                    "nonCachedTokens instead");

    if (policy) {
        if ((rc = expand_short(c, policy, cfg)))
            return rc;
        int threshold = 256; // default: prompts above 256 uncached tokens go to prefill
        if (pdt && (rc = read_int(c, "pd_threshold_tokens", pdt, &threshold, 0, 100000000)))
            return rc;
        cfg->pd_threshold_tokens = threshold;
        cfg->pd_mode = threshold > 0 ? TDM_ROUTER_PD_PREFIX : TDM_ROUTER_PD_NEVER;
        if (pdm) {
            const char *m = scalar(pdm);
            if (m && !strcmp(m, "prefix"))
                cfg->pd_mode = threshold > 0 ? TDM_ROUTER_PD_PREFIX : TDM_ROUTER_PD_NEVER;
            else if (m && !strcmp(m, "always"))
                cfg->pd_mode = TDM_ROUTER_PD_ALWAYS;
            else if (m && !strcmp(m, "never"))
                cfg->pd_mode = TDM_ROUTER_PD_NEVER;
            else
                return perr(c, "pd_mode", pdm, "expected prefix, always or never, got %s%s%s",
                            m ? "'" : "", m ? m : node_kind(pdm), m ? "'" : "");
        }
    } else {
        if ((rc = parse_plugins(c, plugins, cfg)))
            return rc;
        if (!profiles)
            return perr(c, "schedulingProfiles", root, "missing (plugins need profiles)");
        if ((rc = parse_profiles(c, profiles, cfg)))
            return rc;
        if ((rc = resolve_handler(c, root, cfg)))
            return rc;
    }
    if ((rc = default_pickers(c, cfg)))
        return rc;

    if ((v = map_get(c, root, "endpoints")) && (rc = parse_endpoints(c, v, cfg)))
        return rc;
    if ((v = map_get(c, root, "health")) && (rc = parse_health(c, v, cfg)))
        return rc;
    if ((v = map_get(c, root, "load_stale_seconds")) &&
        (rc = read_double(c, "load_stale_seconds", v, &cfg->load_stale_seconds, 0.01, 3600)))
        return rc;
    if ((v = map_get(c, root, "request")) && (rc = parse_request(c, v, cfg)))
        return rc;
    if ((v = map_get(c, root, "prefix_index")) && (rc = parse_prefix_index(c, v, cfg)))
        return rc;
    if (cfg->health.timeout_seconds > cfg->health.interval_seconds)
        return perr(c, "health.timeout_seconds", map_get(c, root, "health"),
                    "%g is longer than interval_seconds %g", cfg->health.timeout_seconds,
                    cfg->health.interval_seconds);
    if (!cfg->health.path && (rc = set_string(c, &cfg->health.path, "/health")))
        return rc;

    if ((rc = apply_plugin_globals(c, cfg)))
        return rc;
    if ((rc = parse_flow(c, root, cfg)))
        return rc;
    if (!cfg->session_header && (rc = set_string(c, &cfg->session_header, "x-session-token")))
        return rc;
    return TDM_OK;
}

// Refuses a config nested deeper than TDM_JSON_MAX_DEPTH before libyaml builds
// the document: its loader is fine with depth, but its scanner is quadratic in
// flow-collection nesting (a 200 000-deep `{a: {a: ...}}` took minutes of CPU
// and ignored SIGTERM meanwhile). The event pass stops at the first level too
// deep, so a hostile file costs only the prefix up to that level.
static int check_yaml_depth(const char *text, size_t len, char *err, size_t errlen)
{
    yaml_parser_t p;
    if (!yaml_parser_initialize(&p))
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    yaml_parser_set_input_string(&p, (const unsigned char *)text, len);
    int depth = 0, rc = TDM_OK;
    for (;;) {
        yaml_event_t ev;
        if (!yaml_parser_parse(&p, &ev))
            break; // a syntax error: yaml_parser_load reports it with its position
        yaml_event_type_t type = ev.type;
        int line = (int)ev.start_mark.line + 1;
        yaml_event_delete(&ev);
        if (type == YAML_STREAM_END_EVENT)
            break;
        if (type == YAML_SEQUENCE_START_EVENT || type == YAML_MAPPING_START_EVENT) {
            if (++depth > TDM_JSON_MAX_DEPTH) {
                rc = tdm_seterr(err, errlen, TDM_EINVAL,
                                "line %d: the config nests deeper than %d levels", line,
                                TDM_JSON_MAX_DEPTH);
                break;
            }
        } else if (type == YAML_SEQUENCE_END_EVENT || type == YAML_MAPPING_END_EVENT) {
            depth--;
        }
    }
    yaml_parser_delete(&p);
    return rc;
}

int tdm_router_config_parse(struct tdm_router_config **out, const char *text, size_t len,
                            const char *path, char *err, size_t errlen)
{
    *out = NULL;
    if (!text)
        return tdm_seterr(err, errlen, TDM_EINVAL, "no config text");
    struct tdm_router_config *cfg = calloc(1, sizeof *cfg);
    if (!cfg)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    atomic_init(&cfg->refs_, 1);
    config_defaults(cfg);
    int rc = TDM_ENOMEM;
    cfg->text_ = strndup(text, len);
    if (!cfg->text_ || (path && !(cfg->source_path = strdup(path)))) {
        tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_cfg;
    }
    if (strlen(cfg->text_) != len) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "config contains a NUL byte");
        goto fail_cfg;
    }

    if ((rc = check_yaml_depth(text, len, err, errlen)) != TDM_OK)
        goto fail_cfg;
    yaml_parser_t parser;
    yaml_document_t doc;
    if (!yaml_parser_initialize(&parser)) {
        tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_cfg;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "line %d column %d: %s%s%s",
                        (int)parser.problem_mark.line + 1, (int)parser.problem_mark.column + 1,
                        parser.problem ? parser.problem : "YAML syntax error",
                        parser.context ? " " : "", parser.context ? parser.context : "");
        yaml_parser_delete(&parser);
        goto fail_cfg;
    }
    struct pctx c = {&doc, err, errlen};
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root)
        rc = tdm_seterr(err, errlen, TDM_EINVAL, "the config is empty");
    else
        rc = parse_root(&c, root, cfg);
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    if (rc)
        goto fail_cfg;
    *out = cfg;
    return TDM_OK;

fail_cfg:
    config_free(cfg);
    return rc;
}

int tdm_router_config_load(struct tdm_router_config **out, const char *path, char *err,
                           size_t errlen)
{
    char *text = NULL;
    size_t len = 0;
    *out = NULL;
    int rc = tdm_read_file(path, &text, &len, err, errlen);
    if (rc)
        return rc;
    char detail[512] = "";
    rc = tdm_router_config_parse(out, text, len, path, detail, sizeof detail);
    free(text);
    if (rc)
        return tdm_seterr(err, errlen, rc, "%s: %s", path, detail);
    return TDM_OK;
}

// ---- JSON view ------------------------------------------------------------------------------

// The plugin's parameters as its table lists them (hidden keys left out;
// "a.b" keys nested; an unset string shows the table's def_str, if any).
static void add_params_json(cJSON *o, const struct tdm_router_plugin *pl)
{
    const struct tdm_router_plugin_ops *ops = tdm_router_plugin_ops_of(pl->type);
    for (size_t i = 0; i < ops->n_params; i++) {
        const struct tdm_router_param *d = &ops->params[i];
        if ((d->flags & TDM_ROUTER_PARAM_HIDDEN) || d->offset == TDM_ROUTER_PARAM_NO_FIELD)
            continue;
        const char *field = (const char *)&pl->params + d->offset;
        const char *str = NULL;
        if (d->type == TDM_ROUTER_PARAM_STRING) {
            str = *(char *const *)(const void *)field;
            if (!str && !(str = d->def_str))
                continue;
        }
        cJSON *dst = o;
        const char *key = d->key, *dot = strchr(key, '.');
        if (dot) {
            char head[64];
            pathf(head, sizeof head, "%.*s", (int)(dot - key), key);
            dst = cJSON_GetObjectItemCaseSensitive(o, head);
            if (!dst && !(dst = cJSON_AddObjectToObject(o, head)))
                return;
            key = dot + 1;
        }
        switch (d->type) {
        case TDM_ROUTER_PARAM_INT:
            cJSON_AddNumberToObject(dst, key, *(const int *)(const void *)field);
            break;
        case TDM_ROUTER_PARAM_DOUBLE:
            cJSON_AddNumberToObject(dst, key, *(const double *)(const void *)field);
            break;
        case TDM_ROUTER_PARAM_BOOL:
            cJSON_AddBoolToObject(dst, key, *(const bool *)(const void *)field);
            break;
        case TDM_ROUTER_PARAM_STRING:
            cJSON_AddStringToObject(dst, key, str);
            break;
        }
    }
}

static void add_band_json(cJSON *b, const struct tdm_router_flow_band *fb)
{
    cJSON_AddNumberToObject(b, "maxRequests", (double)fb->max_requests);
    cJSON_AddNumberToObject(b, "maxBytes", (double)fb->max_bytes);
    cJSON_AddStringToObject(b, "fairnessPolicyRef", tdm_router_plugin_type_name(fb->fairness));
    cJSON_AddStringToObject(b, "orderingPolicyRef", tdm_router_plugin_type_name(fb->ordering));
}

// featureGates, flowControl (the TTL as a Go duration in seconds), the
// saturation detector's thresholds, the objectives.
static void add_flow_json(cJSON *o, const struct tdm_router_flow_config *fc)
{
    cJSON *g = cJSON_AddArrayToObject(o, "featureGates");
    if (g && fc->enabled)
        cJSON_AddItemToArray(g, cJSON_CreateString("flowControl"));
    cJSON *f = cJSON_AddObjectToObject(o, "flowControl");
    if (f) {
        cJSON_AddNumberToObject(f, "maxRequests", (double)fc->max_requests);
        cJSON_AddNumberToObject(f, "maxBytes", (double)fc->max_bytes);
        char ttl[48];
        snprintf(ttl, sizeof ttl, "%gs", fc->default_ttl);
        cJSON_AddStringToObject(f, "defaultRequestTTL", ttl);
        cJSON *bands = cJSON_AddArrayToObject(f, "priorityBands");
        for (size_t i = 0; bands && i < fc->n_bands; i++) {
            cJSON *b = cJSON_CreateObject();
            if (!b)
                break;
            cJSON_AddItemToArray(bands, b);
            cJSON_AddNumberToObject(b, "priority", fc->bands[i].priority);
            add_band_json(b, &fc->bands[i]);
        }
        cJSON *d = cJSON_AddObjectToObject(f, "defaultPriorityBand");
        if (d)
            add_band_json(d, &fc->default_band);
    }
    cJSON *sd = cJSON_AddObjectToObject(o, "saturationDetector");
    if (sd) {
        cJSON_AddNumberToObject(sd, "queueDepthThreshold", fc->queue_depth_threshold);
        cJSON_AddNumberToObject(sd, "kvCacheUtilThreshold", fc->kv_cache_util_threshold);
    }
    cJSON *ob = cJSON_AddObjectToObject(o, "objectives");
    for (size_t i = 0; ob && i < fc->n_objectives; i++)
        cJSON_AddNumberToObject(ob, fc->objectives[i].name, fc->objectives[i].priority);
}

static void format_rfc3339(double t, char buf[40])
{
    time_t s = (time_t)t;
    struct tm tm;
    gmtime_r(&s, &tm);
    int ms = (int)((t - (double)s) * 1000.0);
    if (ms < 0)
        ms = 0;
    if (ms > 999)
        ms = 999;
    pathf(buf, 40, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1,
          tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
}

static const char *pd_mode_name(enum tdm_router_pd_mode m)
{
    return m == TDM_ROUTER_PD_PREFIX ? "prefix" : m == TDM_ROUTER_PD_ALWAYS ? "always" : "never";
}

cJSON *tdm_router_config_json_object_(const struct tdm_router_config *cfg, double loaded_at)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    if (cfg->source_path)
        cJSON_AddStringToObject(o, "source", cfg->source_path);
    if (loaded_at > 0) {
        char ts[40];
        format_rfc3339(loaded_at, ts);
        cJSON_AddStringToObject(o, "loaded_at", ts);
        cJSON_AddNumberToObject(o, "loaded_at_unix", loaded_at);
    }
    cJSON_AddStringToObject(o, "apiVersion", cfg->api_version ? cfg->api_version : TDM_ROUTER_DEFAULT_API_VERSION);
    cJSON_AddStringToObject(o, "kind", "EndpointPickerConfig");
    if (cfg->short_policy)
        cJSON_AddStringToObject(o, "policy", cfg->short_policy);
    cJSON *pl = cJSON_AddArrayToObject(o, "plugins");
    for (size_t i = 0; pl && i < cfg->n_plugins; i++) {
        cJSON *p = cJSON_CreateObject();
        if (!p)
            break;
        cJSON_AddItemToArray(pl, p);
        cJSON_AddStringToObject(p, "name", cfg->plugins[i].name);
        cJSON_AddStringToObject(p, "type", tdm_router_plugin_type_name(cfg->plugins[i].type));
        cJSON *par = cJSON_AddObjectToObject(p, "parameters");
        if (par)
            add_params_json(par, &cfg->plugins[i]);
    }
    cJSON *prs = cJSON_AddArrayToObject(o, "schedulingProfiles");
    for (size_t i = 0; prs && i < cfg->n_profiles; i++) {
        cJSON *p = cJSON_CreateObject();
        if (!p)
            break;
        cJSON_AddItemToArray(prs, p);
        cJSON_AddStringToObject(p, "name", cfg->profiles[i].name);
        cJSON *refs = cJSON_AddArrayToObject(p, "plugins");
        for (size_t j = 0; refs && j < cfg->profiles[i].n_refs; j++) {
            const struct tdm_router_profile_ref *r = &cfg->profiles[i].refs[j];
            cJSON *ro = cJSON_CreateObject();
            if (!ro)
                break;
            cJSON_AddItemToArray(refs, ro);
            cJSON_AddStringToObject(ro, "pluginRef", cfg->plugins[r->plugin].name);
            if (tdm_router_plugin_type_kind(cfg->plugins[r->plugin].type) ==
                TDM_ROUTER_PLUGIN_SCORER)
                cJSON_AddNumberToObject(ro, "weight", r->weight);
        }
    }
    cJSON *pd = cJSON_AddObjectToObject(o, "pd");
    if (pd) {
        cJSON_AddStringToObject(pd, "decode_profile", cfg->profiles[cfg->decode_profile].name);
        if (cfg->prefill_profile != SIZE_MAX)
            cJSON_AddStringToObject(pd, "prefill_profile",
                                    cfg->profiles[cfg->prefill_profile].name);
        else
            cJSON_AddNullToObject(pd, "prefill_profile");
        cJSON_AddStringToObject(pd, "mode", pd_mode_name(cfg->pd_mode));
        cJSON_AddNumberToObject(pd, "threshold_tokens", cfg->pd_threshold_tokens);
    }
    cJSON *eps = cJSON_AddObjectToObject(o, "endpoints");
    if (eps) {
        cJSON *st = cJSON_AddArrayToObject(eps, "static");
        for (size_t i = 0; st && i < cfg->n_static; i++) {
            const struct tdm_router_static_endpoint *e = &cfg->static_endpoints[i];
            cJSON *eo = cJSON_CreateObject();
            if (!eo)
                break;
            cJSON_AddItemToArray(st, eo);
            cJSON_AddStringToObject(eo, "host", e->host);
            cJSON_AddNumberToObject(eo, "http_port", e->http_port);
            cJSON_AddNumberToObject(eo, "nng_port", e->nng_port);
            cJSON_AddStringToObject(eo, "role", role_names[e->role]);
        }
        cJSON *dn = cJSON_AddArrayToObject(eps, "dns");
        for (size_t i = 0; dn && i < cfg->n_dns; i++) {
            const struct tdm_router_dns_endpoint *e = &cfg->dns_endpoints[i];
            cJSON *eo = cJSON_CreateObject();
            if (!eo)
                break;
            cJSON_AddItemToArray(dn, eo);
            cJSON_AddStringToObject(eo, "name", e->name);
            cJSON_AddNumberToObject(eo, "http_port", e->http_port);
            cJSON_AddNumberToObject(eo, "nng_port", e->nng_port);
            cJSON_AddStringToObject(eo, "role", role_names[e->role]);
        }
        cJSON_AddNumberToObject(eps, "dns_refresh_seconds", cfg->dns_refresh_seconds);
    }
    cJSON *h = cJSON_AddObjectToObject(o, "health");
    if (h) {
        cJSON_AddNumberToObject(h, "interval_seconds", cfg->health.interval_seconds);
        cJSON_AddNumberToObject(h, "timeout_seconds", cfg->health.timeout_seconds);
        cJSON_AddNumberToObject(h, "failure_threshold", cfg->health.failure_threshold);
        cJSON_AddNumberToObject(h, "success_threshold", cfg->health.success_threshold);
        cJSON_AddStringToObject(h, "path", cfg->health.path);
    }
    cJSON_AddNumberToObject(o, "load_stale_seconds", cfg->load_stale_seconds);
    cJSON *rq = cJSON_AddObjectToObject(o, "request");
    if (rq) {
        cJSON_AddNumberToObject(rq, "deadline_seconds", cfg->request_deadline_seconds);
        cJSON_AddNumberToObject(rq, "prefill_retries", cfg->prefill_retries);
        cJSON_AddStringToObject(rq, "session_header", cfg->session_header);
    }
    cJSON *px = cJSON_AddObjectToObject(o, "prefix_index");
    if (px) {
        cJSON_AddNumberToObject(px, "block_size_tokens", cfg->block_size_tokens);
        cJSON_AddNumberToObject(px, "max_prefix_blocks_to_match", cfg->max_prefix_blocks_to_match);
        cJSON_AddNumberToObject(px, "lru_capacity_per_server", cfg->lru_capacity_per_server);
    }
    add_flow_json(o, &cfg->flow);
    return o;
}

char *tdm_router_config_to_json(const struct tdm_router_config *cfg, double loaded_at)
{
    if (!cfg)
        return NULL;
    cJSON *o = tdm_router_config_json_object_(cfg, loaded_at);
    if (!o)
        return NULL;
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

// ---- the short form ------------------------------------------------------------------------------
int tdm_router_config_short_text(const char *comment, const char *policy, const char *pd_mode,
                                 int pd_threshold, const struct tdm_router_short_endpoint *prefill,
                                 size_t n_prefill, const struct tdm_router_short_endpoint *decode,
                                 size_t n_decode, char *buf, size_t cap)
{
    size_t len = 0;
#define PUT(...)                                                                                   \
    do {                                                                                           \
        int w_ = snprintf(buf + len, cap - len, __VA_ARGS__);                                      \
        if (w_ < 0 || (size_t)w_ >= cap - len)                                                     \
            return TDM_ECAPACITY;                                                                  \
        len += (size_t)w_;                                                                         \
    } while (0)
    if (cap == 0)
        return TDM_ECAPACITY;
    buf[0] = '\0';
    if (comment)
        PUT("# %s\n", comment);
    PUT("policy: %s\n", policy);
    if (n_prefill == 0)
        PUT("pd_mode: never\n");
    else
        PUT("pd_threshold_tokens: %d\npd_mode: %s\n", pd_threshold, pd_mode);
    PUT("endpoints:\n");
    for (int pass = 0; pass < 2; pass++) {
        const struct tdm_router_short_endpoint *eps = pass ? decode : prefill;
        size_t n = pass ? n_decode : n_prefill;
        if (n)
            PUT("  %s:\n", pass ? "decode" : "prefill");
        for (size_t i = 0; i < n; i++) {
            const char *h = eps[i].host;
            bool v6 = strchr(h, ':') && h[0] != '[';
            PUT("    - {host: \"%s%s%s\", http_port: %d, nng_port: %d}\n", v6 ? "[" : "", h,
                v6 ? "]" : "", eps[i].http_port, eps[i].nng_port);
        }
    }
    PUT("health:\n  interval_seconds: 1\n  timeout_seconds: 1\n  failure_threshold: 2\n");
#undef PUT
    return TDM_OK;
}
