// SPDX-License-Identifier: Apache-2.0
// router_opts: tandem-router's flags (the OpenAI front's shared ones from
// common/edge/openai/openai_front.h and the router's own) and the --policy short
// form, written to a private routing config file.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "core.h"
#include "openai.h"
#include "openai_front.h"
#include "router.h"

// ---- options --------------------------------------------------------------------------------
void tdm_router_opts_default(struct tdm_router_opts *o)
{
    memset(o, 0, sizeof *o);
    snprintf(o->host, sizeof o->host, "0.0.0.0");
    o->port = 8000;
    snprintf(o->nng_url, sizeof o->nng_url, "tcp://127.0.0.1:0");
    o->http_threads = 256;
    o->stream_interval = 1;
    o->max_logprobs = TDM_MAX_LOGPROBS;
    o->max_body_bytes = 16u << 20;
    o->http_header_timeout = 10.0;
    o->http_body_timeout = 30.0;
    o->max_large_requests = 4;
    o->http_memory_budget_mib = 2048;
    snprintf(o->log_level, sizeof o->log_level, "info");
    o->watch = true;
    o->stream_migration = true;
    o->liveness_timeout = 1.0;
    o->load_interval = 0.2;
    o->drain_timeout = 30;
}

#define STR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct tdm_router_opts, n, TDM_FLAG_STR, field, .metavar = mv, .help = h,       \
                   .empty_ok = true)
#define NUM(n, k, field, lo, hi, mv, h)                                                            \
    TDM_FLAG_FIELD(struct tdm_router_opts, n, k, field, .min = lo, .max = hi, .metavar = mv,       \
                   .help = h)
#define OFF(field) offsetof(struct tdm_router_opts, field)
// Strings may be empty, as before the table (an empty --api-key means none).

static const struct tdm_flag router_flags[] = {
    STR("config", config, "FILE", "routing config (docs/router-config.md); hot reloaded"),
    STR("policy", policy, "NAME",
        "instead of --config: round_robin, random, least_loaded,\nprefix_cache or session_affinity "
        "over the workers below\n(the short form tandem up writes)"),
    STR("decode", decode_eps, "H:P[:N],...",
        "with --policy: decode workers (HTTP port P, nng port N,\ndefault P+1000)"),
    STR("prefill", prefill_eps, "H:P[:N],...", "with --policy: prefill workers (P/D on)"),
    NUM("pd-threshold", TDM_FLAG_INT, pd_threshold, 0, 100000000, "N",
        "with --policy and --prefill: uncached prompt tokens above\nwhich to prefill remotely "
        "(default 256)"),
    STR("model", model, "DIR", "model folder for the tokenizer, chat template, config.json"),
    STR("nng-url", nng_url, "URL", "the router's nng inbox (default tcp://127.0.0.1:0)"),
    NUM("http-threads", TDM_FLAG_INT, http_threads, 1, 4096, "N",
        "concurrent HTTP requests (default 256)"),
    NUM("liveness-timeout", TDM_FLAG_DOUBLE, liveness_timeout, 0.05, 3600, "S",
        "worker silent this long mid-stream = lost (default 1)"),
    NUM("load-interval", TDM_FLAG_DOUBLE, load_interval, 0.01, 60, "S",
        "load query period (default 0.2)"),
    {.name = "watch-config",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(watch),
     .help = "reload the config when its file changes (default)"},
    {.name = "no-watch-config",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(watch),
     .help = "reload only on SIGHUP"},
    {.name = "stream-migration",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(stream_migration),
     .help = "a stream whose decode worker is lost continues on another,\nwith the tokens "
             "already sent (default)"},
    {.name = "no-stream-migration",
     .kind = TDM_FLAG_NOT,
     .offset = OFF(stream_migration),
     .help = "a lost decode worker ends its streams with an error event"},
    {.name = "debug-headers",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(debug_headers),
     .help = "answer with x-tandem-decode (the worker's address) and\nx-tandem-phases (phase "
             "times); off by default: internals\nare not told to clients"},
    TDM_OAI_FRONT_FLAGS(struct tdm_router_opts,
                        "HTTP listen port (default 8000; 0 = any free port)"),
};

static const struct tdm_flags router_table = {
    .usage = "usage: tandem-router --config FILE --model DIR [options]\n",
    .flags = router_flags,
    .n = sizeof router_flags / sizeof router_flags[0],
};

const struct tdm_flags *tdm_router_flags(void)
{
    return &router_table;
}

// Parses "HOST:PORT[:NNG],..." into eps (hosts point into buf, which is
// modified). IPv6 hosts in brackets: "[::1]:8001".
static int parse_eps(const char *flag, char *buf, struct tdm_router_short_endpoint *eps, size_t cap,
                     size_t *n, char *err, size_t errlen)
{
    *n = 0;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        if (*n == cap)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: more than %zu workers", flag, cap);
        char *host = tok, *rest;
        if (*tok == '[') {
            char *close = strchr(tok, ']');
            if (!close || close[1] != ':')
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s: bad address \"%s\"", flag, tok);
            host = tok + 1;
            *close = '\0';
            rest = close + 2;
        } else {
            char *colon = strchr(tok, ':');
            if (!colon)
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s: \"%s\" is not HOST:PORT[:NNG_PORT]",
                                  flag, tok);
            *colon = '\0';
            rest = colon + 1;
        }
        char *end = NULL;
        long http = strtol(rest, &end, 10), nng = http + 1000;
        if (end && *end == ':')
            nng = strtol(end + 1, &end, 10);
        if (!*host || !end || *end || http < 1 || http > 65535 || nng < 1 || nng > 65535)
            return tdm_seterr(err, errlen, TDM_EINVAL, "%s: bad ports in \"%s\"", flag, rest);
        eps[(*n)++] = (struct tdm_router_short_endpoint){host, (int)http, (int)nng};
    }
    return TDM_OK;
}

// --policy: builds the short-form config tandem up writes, checks it with the
// parser, and writes it into a private folder that --config then names (the
// file is the router's as any config file: /v1/router/config shows it).
static int write_short_config(struct tdm_router_opts *o, char *err, size_t errlen)
{
    char dbuf[sizeof o->decode_eps], pbuf[sizeof o->prefill_eps];
    snprintf(dbuf, sizeof dbuf, "%s", o->decode_eps);
    snprintf(pbuf, sizeof pbuf, "%s", o->prefill_eps);
    struct tdm_router_short_endpoint dec[64], pre[64];
    size_t nd = 0, np = 0;
    int rc;
    if ((rc = parse_eps("--decode", dbuf, dec, 64, &nd, err, errlen)) ||
        (rc = parse_eps("--prefill", pbuf, pre, 64, &np, err, errlen)))
        return rc;
    if (nd == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy needs --decode HOST:PORT[,...]");
    char text[16384];
    if (tdm_router_config_short_text("Built from tandem-router --policy.", o->policy, "prefix",
                                     o->pd_threshold > 0 ? o->pd_threshold : 256, pre, np, dec, nd,
                                     text, sizeof text) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy: too many workers");
    struct tdm_router_config *cfg = NULL;
    char perr[512];
    if (tdm_router_config_parse(&cfg, text, strlen(text), NULL, perr, sizeof perr) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--policy: %s", perr);
    tdm_router_config_unref(cfg);
    const char *tmp = getenv("TMPDIR");
    snprintf(o->generated_dir, sizeof o->generated_dir, "%s/tandem-router-XXXXXX",
             tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(o->generated_dir)) {
        o->generated_dir[0] = '\0';
        return tdm_seterr(err, errlen, TDM_EIO, "--policy: cannot create a folder: %s",
                          strerror(errno));
    }
    snprintf(o->config, sizeof o->config, "%s/router.yaml", o->generated_dir);
    FILE *f = fopen(o->config, "w");
    if (!f || fputs(text, f) == EOF || fclose(f) != 0) {
        if (f)
            fclose(f);
        return tdm_seterr(err, errlen, TDM_EIO, "--policy: cannot write %s", o->config);
    }
    return TDM_OK;
}

int tdm_router_opts_parse_args(struct tdm_router_opts *o, int argc, char **argv, char *err,
                               size_t errlen)
{
    int rc = tdm_flags_parse(&router_table, o, argc, argv, NULL, 0, NULL, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (o->config[0] && o->policy[0])
        return tdm_seterr(err, errlen, TDM_EINVAL, "give --config FILE or --policy NAME, not both");
    if (o->config[0] == '\0' && o->policy[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--config FILE (or --policy NAME --decode ...) is required");
    if (o->policy[0] && (rc = write_short_config(o, err, errlen)) != TDM_OK)
        return rc;
    if (o->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model DIR is required");
    enum tdm_oai_tool_parser tp;
    return tdm_oai_tool_parser_config(o->enable_auto_tool_choice, o->tool_call_parser, &tp, err,
                                      errlen);
}
