// SPDX-License-Identifier: Apache-2.0
// bench_serve command line: the flags of `tandem-bench` (with vLLM's spellings
// accepted where they differ: --random-input-len, --metric-percentiles, ...),
// then dataset -> run -> report -> JSON. Bad flags are one line on stderr and
// exit 2, before anything is sent; the --json file is opened before the run so
// a long benchmark cannot be lost to a bad path. Exit 1 only when no request
// succeeded (or the run could not start at all).
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bench_serve_impl.h"
#include "core.h"
#include "hub.h"
#include "tokenizer.h"

void tdm_bench_config_init(struct tdm_bench_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->base_url = "http://127.0.0.1:8000";
    cfg->endpoint = "/v1/completions";
    cfg->num_prompts = 1000;
    cfg->request_rate = INFINITY;
    cfg->burstiness = 1.0;
    cfg->temperature = 0.0;
    cfg->timeout_s = 600.0;
    cfg->percentiles[0] = 50;
    cfg->percentiles[1] = 90;
    cfg->percentiles[2] = 99;
    cfg->n_percentiles = 3;
    cfg->dataset_name = "random";
}

bool tdm_bench_config_has_slo(const struct tdm_bench_config *cfg)
{
    return cfg->slo_ttft_ms > 0 || cfg->slo_tpot_ms > 0 || cfg->slo_e2el_ms > 0;
}

struct bench_args {
    struct tdm_bench_config cfg;
    const char *host, *port, *tokenizer_dir, *json_path, *dataset_path, *backend;
    const char *served_name; // --served-model-name: the "model" sent; --model names the model then
    char tokenizer_buf[4096]; // the folder --model resolved to (no --tokenizer)
    bool random_dataset;
    int input_len, output_len;
    double range_ratio;
    int ignore_eos; // -1 = the dataset's default
    bool endpoint_given;
    char base_url_buf[512];
};

// ---- flags that need more than a type and a range ---------------------------------------------
static int parse_double(const char *flag, const char *v, double *out, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || isnan(x))
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: \"%s\" is not a number", flag, v);
    *out = x;
    return TDM_OK;
}

static int set_endpoint(void *o, const char *v, char *err, size_t errlen)
{
    (void)err;
    (void)errlen;
    struct bench_args *a = o;
    a->cfg.endpoint = v;
    a->endpoint_given = true;
    return TDM_OK;
}

static int set_dataset(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    if (!strcmp(v, "random")) {
        a->random_dataset = true;
    } else if (!strncmp(v, "file:", 5) && v[5]) {
        a->random_dataset = false;
        a->dataset_path = v + 5;
    } else {
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--dataset: \"%s\" is neither random nor file:PATH", v);
    }
    a->cfg.dataset_name = v;
    return TDM_OK;
}

static int set_range_ratio(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--range-ratio", v, &a->range_ratio, err, errlen);
    if (rc == TDM_OK && !(a->range_ratio >= 0 && a->range_ratio < 1))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--range-ratio must be in [0, 1)");
    return rc;
}

static int set_request_rate(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--request-rate", v, &a->cfg.request_rate, err, errlen);
    if (rc == TDM_OK && !(a->cfg.request_rate > 0))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--request-rate must be > 0 (or inf)");
    return rc;
}

static int set_burstiness(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--burstiness", v, &a->cfg.burstiness, err, errlen);
    if (rc == TDM_OK && (!(a->cfg.burstiness > 0) || isinf(a->cfg.burstiness)))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--burstiness must be a finite number > 0");
    return rc;
}

static int set_temperature(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--temperature", v, &a->cfg.temperature, err, errlen);
    if (rc == TDM_OK && (!(a->cfg.temperature >= 0) || isinf(a->cfg.temperature)))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--temperature must be >= 0");
    return rc;
}

static int set_timeout(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--timeout", v, &a->cfg.timeout_s, err, errlen);
    if (rc == TDM_OK && (!(a->cfg.timeout_s > 0) || a->cfg.timeout_s > 1e6))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--timeout must be in (0, 1e6] seconds");
    return rc;
}

static int set_duration(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    int rc = parse_double("--duration", v, &a->cfg.duration_s, err, errlen);
    if (rc == TDM_OK && (!(a->cfg.duration_s > 0) || a->cfg.duration_s > 1e7))
        return tdm_seterr(err, errlen, TDM_EINVAL, "--duration must be in (0, 1e7] seconds");
    return rc;
}

static int set_seed(void *o, const char *v, char *err, size_t errlen)
{
    struct bench_args *a = o;
    char *end;
    errno = 0;
    unsigned long long s = strtoull(v, &end, 10);
    if (end == v || *end || errno || v[0] == '-')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--seed: \"%s\" is not an integer >= 0", v);
    a->cfg.seed = s;
    return TDM_OK;
}

static int set_ignore_eos(void *o, const char *v, char *err, size_t errlen)
{
    if (v)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--ignore-eos takes no value");
    ((struct bench_args *)o)->ignore_eos = 1;
    return TDM_OK;
}

static int set_no_ignore_eos(void *o, const char *v, char *err, size_t errlen)
{
    if (v)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--no-ignore-eos takes no value");
    ((struct bench_args *)o)->ignore_eos = 0;
    return TDM_OK;
}

static int set_percentiles(void *o, const char *v, char *err, size_t errlen)
{
    return bench_parse_percentiles(&((struct bench_args *)o)->cfg, v, err, errlen);
}

static int set_goodput(void *o, const char *v, char *err, size_t errlen)
{
    return bench_parse_slo(&((struct bench_args *)o)->cfg, v, err, errlen);
}

// vLLM's --goodput takes one or more KEY:MS words after the flag; they are
// taken out of argv here (into cfg) so the table parser sees none of them.
static int take_goodput(struct bench_args *a, int *argc, char **argv, char *err, size_t errlen)
{
    int w = 1, rc;
    for (int i = 1; i < *argc; i++) {
        const char *arg = argv[i];
        if (strcmp(arg, "--goodput") != 0 && strncmp(arg, "--goodput=", 10) != 0) {
            argv[w++] = argv[i];
            continue;
        }
        int terms = 0;
        if (arg[9] == '=') {
            if ((rc = bench_parse_slo(&a->cfg, arg + 10, err, errlen)))
                return rc;
            terms++;
        }
        while (i + 1 < *argc && strncmp(argv[i + 1], "--", 2) && strchr(argv[i + 1], ':')) {
            if ((rc = bench_parse_slo(&a->cfg, argv[++i], err, errlen)))
                return rc;
            terms++;
        }
        if (!terms)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--goodput needs KEY:MS terms (ttft:MS tpot:MS e2el:MS)");
    }
    argv[w] = NULL;
    *argc = w;
    return TDM_OK;
}

#define PTR(n, field, mv, h)                                                                       \
    TDM_FLAG_FIELD(struct bench_args, n, TDM_FLAG_PTR, field, .metavar = mv, .help = h,         \
                   .empty_ok = true)
#define COUNT(n, field, mv, h, hide)                                                               \
    TDM_FLAG_FIELD(struct bench_args, n, TDM_FLAG_INT, field, .min = 1, .max = 100000000,       \
                   .metavar = mv, .help = h, .hidden = hide)
#define FN(n, f, mv, h, hide)                                                                      \
    {.name = n, .kind = TDM_FLAG_FN, .fn = f, .metavar = mv, .help = h, .hidden = hide}
#define OFF(field) offsetof(struct bench_args, field)

static const struct tdm_flag bench_flags[] = {
    PTR("base-url", cfg.base_url, "URL",
        "server (default http://127.0.0.1:8000); or --host H --port P"),
    PTR("host", host, "H", NULL),
    PTR("port", port, "P", NULL),
    FN("endpoint", set_endpoint, "PATH", "/v1/completions (default) or /v1/chat/completions",
       false),
    PTR("backend", backend, "NAME", "openai | vllm (completions) or openai-chat (chat)"),
    PTR("model", cfg.model, "NAME",
        "the model: the \"model\" field sent (required), and where the\ntokenizer comes from "
        "without --tokenizer (a folder, or a Hub id\nin the HF cache), as vllm bench does"),
    PTR("served-model-name", served_name, "NAME",
        "the \"model\" field sent when it differs from --model"),
    PTR("tokenizer", tokenizer_dir, "DIR",
        "folder with tokenizer.json (default: --model's)"),
    FN("dataset", set_dataset, "random|file:PATH",
       "random prompts of exact token lengths (default), or a file with\n"
       "one prompt per line / JSON lines {\"prompt\":..,\"output_len\":..}",
       false),
    FN("dataset-name", set_dataset, NULL, NULL, true),
    COUNT("input-len", input_len, "N", "random prompt length in tokens (default 1024)", false),
    COUNT("random-input-len", input_len, NULL, NULL, true),
    COUNT("output-len", output_len, "N", "max_tokens per request (default 128)", false),
    COUNT("random-output-len", output_len, NULL, NULL, true),
    FN("range-ratio", set_range_ratio, "R",
       "lengths uniform in [N*(1-R), N*(1+R)], 0 <= R < 1 (default 0)", false),
    FN("random-range-ratio", set_range_ratio, NULL, NULL, true),
    COUNT("num-prompts", cfg.num_prompts, "N", "requests to send (default 1000)", false),
    FN("request-rate", set_request_rate, "R",
       "mean requests/s, Poisson arrivals; inf = all at once (default)", false),
    FN("burstiness", set_burstiness, "B", "gamma shape of arrival gaps; 1 = Poisson (default 1)",
       false),
    COUNT("max-concurrency", cfg.max_concurrency, "C",
          "at most C requests in flight (default unlimited)", false),
    FN("seed", set_seed, "S", "prompts and arrival times (default 0)", false),
    {.name = "ignore-eos",
     .kind = TDM_FLAG_FN,
     .fn = set_ignore_eos,
     .no_value = true,
     .help = "send ignore_eos (default on for random, off for file datasets)"},
    {.name = "no-ignore-eos",
     .kind = TDM_FLAG_FN,
     .fn = set_no_ignore_eos,
     .no_value = true,
     .help = "do not send ignore_eos"},
    FN("temperature", set_temperature, "T", "sampling temperature sent (default 0)", false),
    FN("goodput", set_goodput, "KEY:MS ...",
       "SLOs for goodput: ttft:MS tpot:MS e2el:MS (one or more)", false),
    FN("percentiles", set_percentiles, "LIST", "percentiles reported, e.g. 50,90,99 (default)",
       false),
    FN("metric-percentiles", set_percentiles, NULL, NULL, true),
    PTR("json", json_path, "FILE", "also write the results as JSON (vLLM's key names)"),
    PTR("api-key", cfg.api_key, "KEY", "Authorization: Bearer KEY (default $OPENAI_API_KEY)"),
    FN("timeout", set_timeout, "S", "per-request timeout in seconds (default 600)", false),
    FN("duration", set_duration, "S",
       "send for S seconds, cycling through the --num-prompts prompts, then\n"
       "wait for the requests in flight (a soak; needs --max-concurrency)",
       false),
};

static const struct tdm_flags bench_table = {
    .usage = "usage: tandem-bench --model NAME [options]\n"
             "Benchmarks an OpenAI-compatible server with streaming requests (like vllm bench "
             "serve).\n\n",
    .flags = bench_flags,
    .n = sizeof bench_flags / sizeof bench_flags[0],
    .footer = "  -h, --help                    this text\n"
              "vLLM spellings accepted: --random-input-len, --random-output-len, "
              "--random-range-ratio,\n"
              "--metric-percentiles, --dataset-name random.\n"
              "Exit status: 0 done, 1 every request failed, 2 bad arguments.\n",
};

// Returns TDM_OK, 1 for --help, or TDM_EINVAL with a one-line err.
static int parse_args(struct bench_args *a, int argc, char **argv, char *err, size_t errlen)
{
    memset(a, 0, sizeof(*a));
    tdm_bench_config_init(&a->cfg);
    struct tdm_bench_config *cfg = &a->cfg;
    a->random_dataset = true;
    a->input_len = 1024;
    a->output_len = 128;
    a->ignore_eos = -1;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return 1;
    char **args = calloc((size_t)argc + 1, sizeof *args); // take_goodput compacts this copy
    if (args == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
    memcpy(args, argv, (size_t)argc * sizeof *args);
    int rc = take_goodput(a, &argc, args, err, errlen);
    if (rc == TDM_OK)
        rc = tdm_flags_parse(&bench_table, a, argc, args, NULL, 0, NULL, err, errlen);
    free(args); // the values point into argv, not into this copy
    if (rc != TDM_OK)
        return rc == TDM_ENOMEM ? TDM_EINVAL : rc;
    const char *backend = a->backend;

    if (backend) {
        if (!strcmp(backend, "openai-chat")) {
            cfg->chat = true;
            if (!a->endpoint_given)
                cfg->endpoint = "/v1/chat/completions";
        } else if (strcmp(backend, "openai") && strcmp(backend, "vllm")) {
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "--backend: \"%s\" is not openai, vllm or openai-chat", backend);
        }
    }
    size_t el = strlen(cfg->endpoint);
    if (cfg->endpoint[0] != '/')
        return tdm_seterr(err, errlen, TDM_EINVAL, "--endpoint must start with '/'");
    if (el >= 16 && !strcmp(cfg->endpoint + el - 16, "chat/completions"))
        cfg->chat = true;
    else if (backend && cfg->chat)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--backend openai-chat needs a .../chat/completions endpoint");
    if (a->host || a->port) {
        snprintf(a->base_url_buf, sizeof(a->base_url_buf), "http://%s:%s",
                 a->host ? a->host : "127.0.0.1", a->port ? a->port : "8000");
        cfg->base_url = a->base_url_buf;
    }
    if (strncmp(cfg->base_url, "http://", 7) && strncmp(cfg->base_url, "https://", 8))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--base-url: \"%.100s\" must start with http:// or https://",
                          cfg->base_url);
    if (!cfg->model)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--model is required");
    if (cfg->duration_s > 0 && cfg->max_concurrency <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--duration needs --max-concurrency (the streams kept in flight)");
    if (!a->tokenizer_dir) {
        // As vllm bench serve: the tokenizer is --model's, a folder or a Hub id
        // already in the HF cache (never downloaded from here).
        struct stat st;
        char tj[4200];
        snprintf(tj, sizeof tj, "%s/tokenizer.json", cfg->model);
        struct tdm_hub_opts hub = {.offline = true, .progress = TDM_HUB_PROGRESS_QUIET};
        char herr[256];
        if (stat(tj, &st) == 0) {
            snprintf(a->tokenizer_buf, sizeof a->tokenizer_buf, "%s", cfg->model);
            a->tokenizer_dir = a->tokenizer_buf;
        } else if (strchr(cfg->model, '/') &&
                   tdm_hub_resolve_model(cfg->model, NULL, &hub, a->tokenizer_buf,
                                         sizeof a->tokenizer_buf, herr, sizeof herr) == TDM_OK) {
            a->tokenizer_dir = a->tokenizer_buf;
        }
    }
    if (a->random_dataset && !a->tokenizer_dir)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--dataset random needs a tokenizer to build exact-length prompts: "
                          "--tokenizer DIR, or --model naming a model folder or a Hub id in the "
                          "HF cache (with --served-model-name for the name the server serves)");
    if (a->served_name)
        cfg->model = a->served_name;
    cfg->ignore_eos = a->ignore_eos < 0 ? a->random_dataset : a->ignore_eos;
    if (!cfg->api_key) {
        const char *env = getenv("OPENAI_API_KEY");
        if (env && *env)
            cfg->api_key = env;
    }
    cfg->tokenizer_id = a->tokenizer_dir;
    return TDM_OK;
}

static void print_setup(FILE *out, const struct bench_args *a)
{
    const struct tdm_bench_config *cfg = &a->cfg;
    fprintf(out, "Target: %s%s (model %s, %s)\n", cfg->base_url, cfg->endpoint, cfg->model,
            cfg->chat ? "chat" : "completions");
    if (a->random_dataset)
        fprintf(out, "Dataset: random, input %d output %d tokens, range ratio %g, %d prompts\n",
                a->input_len, a->output_len, a->range_ratio, cfg->num_prompts);
    else
        fprintf(out, "Dataset: %s, %d prompts\n", cfg->dataset_name, cfg->num_prompts);
    if (isinf(cfg->request_rate))
        fprintf(out, "Traffic request rate: inf\n");
    else
        fprintf(out, "Traffic request rate: %g\n", cfg->request_rate);
    fprintf(out, "Burstiness factor: %g (%s)\n", cfg->burstiness,
            cfg->burstiness == 1.0 ? "Poisson process" : "Gamma distribution");
    if (cfg->max_concurrency > 0)
        fprintf(out, "Maximum request concurrency: %d\n", cfg->max_concurrency);
    else
        fprintf(out, "Maximum request concurrency: None\n");
    if (cfg->duration_s > 0)
        fprintf(out, "Duration: %g s (prompts reused in turn)\n", cfg->duration_s);
    fflush(out);
}

int tdm_bench_main(int argc, char **argv, FILE *out, FILE *errf)
{
    struct bench_args a;
    char err[512] = "";
    int prc = parse_args(&a, argc, argv, err, sizeof(err));
    if (prc == 1) {
        tdm_flags_help(&bench_table, out);
        return 0;
    }
    if (prc != TDM_OK) {
        fprintf(errf, "tandem-bench: %s\n", err);
        return 2;
    }
    struct tdm_bench_config *cfg = &a.cfg;
    int status = 2;
    struct tdm_tokenizer *tok = NULL;
    struct tdm_bench_dataset ds = {0};
    struct tdm_bench_run *run = NULL;
    FILE *json = NULL;

    if (a.tokenizer_dir && tdm_tok_load(&tok, a.tokenizer_dir, err, sizeof(err))) {
        fprintf(errf, "tandem-bench: --tokenizer %s: %s\n", a.tokenizer_dir, err);
        goto done;
    }
    if (a.json_path && !(json = fopen(a.json_path, "w"))) {
        fprintf(errf, "tandem-bench: --json %s: %s\n", a.json_path, strerror(errno));
        goto done;
    }
    int rc = a.random_dataset
                 ? tdm_bench_dataset_random(&ds, tok, cfg->num_prompts, a.input_len, a.output_len,
                                            a.range_ratio, cfg->seed, err, sizeof(err))
                 : tdm_bench_dataset_file(&ds, a.dataset_path, tok, cfg->num_prompts, a.output_len,
                                          err, sizeof(err));
    if (rc) {
        fprintf(errf, "tandem-bench: dataset: %s\n", err);
        goto done;
    }
    print_setup(out, &a);
    status = 1;
    if (tdm_bench_run(&run, cfg, &ds, tok, err, sizeof(err))) {
        fprintf(errf, "tandem-bench: %s\n", err);
        goto done;
    }
    struct tdm_bench_metrics m;
    if (tdm_bench_compute_metrics(run, cfg, &m)) {
        fprintf(errf, "tandem-bench: out of memory computing the metrics\n");
        goto done;
    }
    tdm_bench_print_report(out, cfg, run, &m);
    fflush(out);
    status = m.completed > 0 ? 0 : 1;
    if (json && tdm_bench_write_json(json, cfg, run, &m, err, sizeof(err))) {
        fprintf(errf, "tandem-bench: --json %s: %s\n", a.json_path, err);
        status = 1;
    }
    if (status == 1 && m.completed == 0)
        fprintf(errf, "tandem-bench: every request failed\n");
done:
    if (json && fclose(json) && status == 0) {
        fprintf(errf, "tandem-bench: --json %s: %s\n", a.json_path, strerror(errno));
        status = 1;
    }
    tdm_bench_run_free(run);
    tdm_bench_dataset_fini(&ds);
    tdm_tok_free(tok);
    return status;
}
