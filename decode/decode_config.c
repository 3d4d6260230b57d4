// SPDX-License-Identifier: Apache-2.0
// decode_config: tandem-decode's flags and config file. One table maps each
// option name to a setter, so the command line and the flat YAML file
// (vLLM's --config style: the same keys as the flags, "key: value") accept
// exactly the same things with the same checks and messages. Flags given on
// the command line override the file, as in vLLM.
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "decode.h"

void tdm_decode_config_default(struct tdm_decode_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    snprintf(cfg->host, sizeof cfg->host, "0.0.0.0");
    cfg->port = 8001;
    cfg->max_num_seqs = 64;
    cfg->max_num_batched_tokens = 512;
    cfg->block_size = 16;
    cfg->kv_cache_memory = (size_t)256 << 20;
    cfg->enable_prefix_caching = true;
    cfg->max_waiting = 1024;
    cfg->drain_timeout = 30.0;
    snprintf(cfg->log_level, sizeof cfg->log_level, "info");
    cfg->max_body_bytes = (size_t)16 << 20;
}

const char *tdm_decode_usage(void)
{
    return "usage: tandem-decode --model DIR [options]\n"
           "Serves an OpenAI-compatible API (vLLM's shapes) on one model.\n"
           "  --model DIR|ORG/NAME          model folder, or a Hugging Face id fetched into\n"
           "                                the HF cache (required; see docs/models.md)\n"
           "  --revision REV                branch, tag or commit of a Hub id (default main)\n"
           "  --host ADDR                   listen address (default 0.0.0.0)\n"
           "  --port N                      listen port (default 8001; 0 = any free port)\n"
           "  --served-model-name NAME      model name in the API and metrics\n"
           "                                (default: config.json _name_or_path, else the\n"
           "                                folder name)\n"
           "  --max-model-len N             context length (default: the model's)\n"
           "  --max-num-seqs N              running requests at most (default 64)\n"
           "  --max-num-batched-tokens N    tokens per engine step (default 512)\n"
           "  --block-size N                KV tokens per block (default 16)\n"
           "  --kv-cache-memory BYTES       KV pool size, e.g. 2GiB (default 256MiB)\n"
           "  --num-kv-blocks N             KV pool size in blocks (overrides the above)\n"
           "  --enable-prefix-caching       reuse cached prompt prefixes (default)\n"
           "  --no-enable-prefix-caching    turn prefix caching off\n"
           "  --api-key KEY                 require 'Authorization: Bearer KEY' on /v1/*\n"
           "  --threads N                   compute threads (default: one per core)\n"
           "  --dtype bf16|int8             weight format (default bf16)\n"
           "  --chat-template FILE          chat template overriding the tokenizer's\n"
           "  --max-waiting N               waiting-queue bound; beyond it 503 (default 1024)\n"
           "  --drain-timeout SECONDS       SIGTERM: time running requests get (default 30)\n"
           "  --log-level err|warn|info|debug  (default info)\n"
           "  --max-body-bytes BYTES        request body limit; beyond it 413 (default 16MiB)\n"
           "  --http-threads N              HTTP worker threads (default max-num-seqs +\n"
           "                                max-waiting, clamped to [16, 512])\n"
           "  --config FILE                 flat YAML 'key: value' file with these keys\n"
           "  --help                        this text\n";
}

int tdm_decode_parse_bytes(const char *text, size_t *out)
{
    static const struct {
        const char *suffix;
        double mul;
    } units[] = {
        {"", 1},
        {"B", 1},
        {"K", 1024.0},
        {"KiB", 1024.0},
        {"KB", 1e3},
        {"k", 1024.0},
        {"M", 1048576.0},
        {"MiB", 1048576.0},
        {"MB", 1e6},
        {"G", 1073741824.0},
        {"GiB", 1073741824.0},
        {"GB", 1e9},
        {"T", 1099511627776.0},
        {"TiB", 1099511627776.0},
        {"TB", 1e12},
    };
    if (text == NULL || *text < '0' || *text > '9')
        return TDM_EINVAL;
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno != 0 || !isfinite(v) || v < 0)
        return TDM_EINVAL;
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].suffix) == 0) {
            double b = v * units[i].mul;
            if (b >= 1.8e19 || b != floor(b))
                return TDM_EINVAL;
            *out = (size_t)b;
            return TDM_OK;
        }
    }
    return TDM_EINVAL;
}

// ---- setters ------------------------------------------------------------------------------
static int set_int(int *dst, const char *flag, const char *v, long lo, long hi, char *err,
                   size_t errlen)
{
    char *end;
    errno = 0;
    long x = v ? strtol(v, &end, 10) : 0;
    if (v == NULL || *v == '\0' || *end != '\0' || errno != 0 || x < lo || x > hi)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--%s: expected an integer in [%ld, %ld], got \"%s\"", flag, lo, hi,
                          v ? v : "");
    *dst = (int)x;
    return TDM_OK;
}

static int set_str(char *dst, size_t cap, const char *flag, const char *v, bool allow_empty,
                   char *err, size_t errlen)
{
    if (v == NULL || (!allow_empty && *v == '\0'))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected a non-empty value", flag);
    if (strlen(v) >= cap)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: value longer than %zu bytes", flag,
                          cap - 1);
    memcpy(dst, v, strlen(v) + 1);
    return TDM_OK;
}

static int parse_bool(const char *v, bool *out)
{
    if (v == NULL || strcmp(v, "true") == 0 || strcmp(v, "True") == 0 || strcmp(v, "1") == 0 ||
        strcmp(v, "yes") == 0) {
        *out = true;
        return TDM_OK;
    }
    if (strcmp(v, "false") == 0 || strcmp(v, "False") == 0 || strcmp(v, "0") == 0 ||
        strcmp(v, "no") == 0) {
        *out = false;
        return TDM_OK;
    }
    return TDM_EINVAL;
}

// Normalizes "max_num_seqs" to "max-num-seqs" into buf.
static void norm_name(char *buf, size_t cap, const char *name)
{
    size_t i = 0;
    for (; name[i] && i + 1 < cap; i++)
        buf[i] = name[i] == '_' ? '-' : name[i];
    buf[i] = '\0';
}

int tdm_decode_config_set(struct tdm_decode_config *cfg, const char *name, const char *value,
                          char *err, size_t errlen)
{
    char n[64];
    norm_name(n, sizeof n, name);
    const char *v = value;
    if (strcmp(n, "model") == 0)
        return set_str(cfg->model, sizeof cfg->model, n, v, false, err, errlen);
    if (strcmp(n, "revision") == 0)
        return set_str(cfg->revision, sizeof cfg->revision, n, v, false, err, errlen);
    if (strcmp(n, "host") == 0)
        return set_str(cfg->host, sizeof cfg->host, n, v, false, err, errlen);
    if (strcmp(n, "port") == 0)
        return set_int(&cfg->port, n, v, 0, 65535, err, errlen);
    if (strcmp(n, "served-model-name") == 0)
        return set_str(cfg->served_model_name, sizeof cfg->served_model_name, n, v, false, err,
                       errlen);
    if (strcmp(n, "max-model-len") == 0)
        return set_int(&cfg->max_model_len, n, v, 2, INT_MAX / 2, err, errlen);
    if (strcmp(n, "max-num-seqs") == 0)
        return set_int(&cfg->max_num_seqs, n, v, 1, 65536, err, errlen);
    if (strcmp(n, "max-num-batched-tokens") == 0)
        return set_int(&cfg->max_num_batched_tokens, n, v, 1, 1 << 20, err, errlen);
    if (strcmp(n, "block-size") == 0) {
        int rc = set_int(&cfg->block_size, n, v, 1, 1024, err, errlen);
        if (rc == TDM_OK && (cfg->block_size & (cfg->block_size - 1)) != 0)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--block-size: expected a power of two, got \"%s\"", v);
        return rc;
    }
    if (strcmp(n, "kv-cache-memory") == 0) {
        size_t b;
        if (tdm_decode_parse_bytes(v, &b) != TDM_OK || b == 0)
            return tdm_seterr(
                err, errlen, TDM_EINVAL,
                "--kv-cache-memory: expected a byte size like 2GiB or 512MiB, got \"%s\"",
                v ? v : "");
        cfg->kv_cache_memory = b;
        return TDM_OK;
    }
    if (strcmp(n, "num-kv-blocks") == 0)
        return set_int(&cfg->num_kv_blocks, n, v, 1, INT_MAX / 1024, err, errlen);
    if (strcmp(n, "enable-prefix-caching") == 0 || strcmp(n, "no-enable-prefix-caching") == 0) {
        bool b;
        if (parse_bool(v, &b) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected true or false, got \"%s\"",
                              n, v);
        cfg->enable_prefix_caching = n[0] == 'n' ? !b : b;
        return TDM_OK;
    }
    if (strcmp(n, "api-key") == 0)
        return set_str(cfg->api_key, sizeof cfg->api_key, n, v, false, err, errlen);
    if (strcmp(n, "threads") == 0)
        return set_int(&cfg->threads, n, v, 0, 1024, err, errlen);
    if (strcmp(n, "dtype") == 0) {
        if (v && (strcmp(v, "bf16") == 0 || strcmp(v, "bfloat16") == 0 || strcmp(v, "auto") == 0))
            cfg->int8 = false;
        else if (v && strcmp(v, "int8") == 0)
            cfg->int8 = true;
        else
            return tdm_seterr(err, errlen, TDM_EINVAL, "--dtype: expected bf16 or int8, got \"%s\"",
                              v ? v : "");
        return TDM_OK;
    }
    if (strcmp(n, "chat-template") == 0)
        return set_str(cfg->chat_template, sizeof cfg->chat_template, n, v, false, err, errlen);
    if (strcmp(n, "max-waiting") == 0)
        return set_int(&cfg->max_waiting, n, v, 0, 1 << 20, err, errlen);
    if (strcmp(n, "drain-timeout") == 0) {
        char *end;
        double x = v ? strtod(v, &end) : NAN;
        if (v == NULL || *v == '\0' || *end != '\0' || !isfinite(x) || x < 0)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--drain-timeout: expected seconds >= 0, got \"%s\"", v ? v : "");
        cfg->drain_timeout = x;
        return TDM_OK;
    }
    if (strcmp(n, "log-level") == 0) {
        if (v == NULL || (strcmp(v, "err") != 0 && strcmp(v, "warn") != 0 &&
                          strcmp(v, "info") != 0 && strcmp(v, "debug") != 0))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--log-level: expected err, warn, info or debug, got \"%s\"",
                              v ? v : "");
        snprintf(cfg->log_level, sizeof cfg->log_level, "%s", v);
        return TDM_OK;
    }
    if (strcmp(n, "max-body-bytes") == 0) {
        size_t b;
        if (tdm_decode_parse_bytes(v, &b) != TDM_OK || b < 1024)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--max-body-bytes: expected a byte size >= 1024, got \"%s\"",
                              v ? v : "");
        cfg->max_body_bytes = b;
        return TDM_OK;
    }
    if (strcmp(n, "http-threads") == 0)
        return set_int(&cfg->http_threads, n, v, 0, 4096, err, errlen);
    return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option \"--%s\"", n);
}

// ---- the config file -----------------------------------------------------------------------
static char *trim(char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r'))
        s[--n] = '\0';
    return s;
}

int tdm_decode_config_load_file(struct tdm_decode_config *cfg, const char *path, char *err,
                                size_t errlen)
{
    char *text = NULL;
    size_t len = 0;
    int rc = tdm_read_file(path, &text, &len, err, errlen);
    if (rc != TDM_OK)
        return rc;
    if (strlen(text) != len) {
        free(text);
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: contains a NUL byte", path);
    }
    int lineno = 0;
    rc = TDM_OK;
    char *p = text;
    while (p != NULL && rc == TDM_OK) {
        char *nl = strchr(p, '\n');
        if (nl)
            *nl = '\0';
        lineno++;
        char *line = p;
        p = nl ? nl + 1 : NULL;
        // A '#' starts a comment unless it is inside quotes.
        char quote = 0;
        for (char *c = line; *c; c++) {
            if (quote) {
                if (*c == quote)
                    quote = 0;
            } else if (*c == '"' || *c == '\'') {
                quote = *c;
            } else if (*c == '#' && (c == line || c[-1] == ' ' || c[-1] == '\t')) {
                *c = '\0';
                break;
            }
        }
        line = trim(line);
        if (*line == '\0' || strcmp(line, "---") == 0)
            continue;
        char *colon = strchr(line, ':');
        if (colon == NULL) {
            rc =
                tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: expected \"key: value\"", path, lineno);
            break;
        }
        *colon = '\0';
        char *key = trim(line);
        char *val = trim(colon + 1);
        size_t vl = strlen(val);
        if (vl >= 2 && (val[0] == '"' || val[0] == '\'') && val[vl - 1] == val[0]) {
            val[vl - 1] = '\0';
            val++;
        }
        if (*key == '\0') {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: empty key", path, lineno);
            break;
        }
        char n[64];
        norm_name(n, sizeof n, key);
        if (strcmp(n, "config") == 0) {
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: config files do not nest", path,
                            lineno);
            break;
        }
        char detail[384];
        if (tdm_decode_config_set(cfg, key, val, detail, sizeof detail) != TDM_OK)
            rc = tdm_seterr(err, errlen, TDM_EINVAL, "%s:%d: %s", path, lineno, detail);
    }
    free(text);
    return rc;
}

// ---- argv ------------------------------------------------------------------------------------
int tdm_decode_config_parse_args(struct tdm_decode_config *cfg, int argc, char **argv, char *err,
                                 size_t errlen)
{
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0)
            return 1;
    // The file first, so that flags override it whatever their order.
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--config") == 0 || strncmp(a, "--config=", 9) == 0) {
            const char *path = a[8] == '=' ? a + 9 : (i + 1 < argc ? argv[i + 1] : NULL);
            if (path == NULL || *path == '\0')
                return tdm_seterr(err, errlen, TDM_EINVAL, "--config: expected a file");
            int rc = tdm_decode_config_load_file(cfg, path, err, errlen);
            if (rc != TDM_OK)
                return TDM_EINVAL;
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0)
            return tdm_seterr(err, errlen, TDM_EINVAL, "unexpected argument \"%s\"", a);
        char name[64];
        const char *eq = strchr(a, '=');
        size_t nl = eq ? (size_t)(eq - a - 2) : strlen(a + 2);
        if (nl == 0 || nl >= sizeof name)
            return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option \"%s\"", a);
        memcpy(name, a + 2, nl);
        name[nl] = '\0';
        char norm[64];
        norm_name(norm, sizeof norm, name);
        const char *value;
        if (strcmp(norm, "enable-prefix-caching") == 0 ||
            strcmp(norm, "no-enable-prefix-caching") == 0) {
            value = eq ? eq + 1 : NULL; // a boolean flag takes no separate value
        } else if (eq) {
            value = eq + 1;
        } else {
            if (i + 1 >= argc)
                return tdm_seterr(err, errlen, TDM_EINVAL, "--%s: expected a value", name);
            value = argv[++i];
        }
        if (strcmp(norm, "config") == 0)
            continue; // applied above
        if (tdm_decode_config_set(cfg, name, value, err, errlen) != TDM_OK)
            return TDM_EINVAL;
    }
    if (cfg->model[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model DIR is required");
    return TDM_OK;
}
