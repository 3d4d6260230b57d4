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

#include "bench_serve_impl.h"
#include "core.h"
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

static const char usage_text[] =
    "usage: tandem-bench --model NAME [options]\n"
    "Benchmarks an OpenAI-compatible server with streaming requests (like vllm bench serve).\n"
    "\n"
    "  --base-url URL          server (default http://127.0.0.1:8000); or --host H --port P\n"
    "  --endpoint PATH         /v1/completions (default) or /v1/chat/completions\n"
    "  --backend NAME          openai | vllm (completions) or openai-chat (chat)\n"
    "  --model NAME            the \"model\" field sent (required)\n"
    "  --tokenizer DIR         folder with tokenizer.json (required for --dataset random)\n"
    "  --dataset random|file:PATH\n"
    "                          random prompts of exact token lengths (default), or a file with\n"
    "                          one prompt per line / JSON lines {\"prompt\":..,\"output_len\":..}\n"
    "  --input-len N           random prompt length in tokens (default 1024)\n"
    "  --output-len N          max_tokens per request (default 128)\n"
    "  --range-ratio R         lengths uniform in [N*(1-R), N*(1+R)], 0 <= R < 1 (default 0)\n"
    "  --num-prompts N         requests to send (default 1000)\n"
    "  --request-rate R        mean requests/s, Poisson arrivals; inf = all at once (default)\n"
    "  --burstiness B          gamma shape of arrival gaps; 1 = Poisson (default 1)\n"
    "  --max-concurrency C     at most C requests in flight (default unlimited)\n"
    "  --seed S                prompts and arrival times (default 0)\n"
    "  --ignore-eos            send ignore_eos (default on for random, off for file datasets)\n"
    "  --no-ignore-eos         do not send ignore_eos\n"
    "  --temperature T         sampling temperature sent (default 0)\n"
    "  --goodput KEY:MS ...    SLOs for goodput: ttft:MS tpot:MS e2el:MS (one or more)\n"
    "  --percentiles LIST      percentiles reported, e.g. 50,90,99 (default)\n"
    "  --json FILE             also write the results as JSON (vLLM's key names)\n"
    "  --api-key KEY           Authorization: Bearer KEY (default $OPENAI_API_KEY)\n"
    "  --timeout S             per-request timeout in seconds (default 600)\n"
    "  -h, --help              this text\n"
    "vLLM spellings accepted: --random-input-len, --random-output-len, --random-range-ratio,\n"
    "--metric-percentiles, --dataset-name random.\n"
    "Exit status: 0 done, 1 every request failed, 2 bad arguments.\n";

struct bench_args {
    struct tdm_bench_config cfg;
    const char *host, *port, *tokenizer_dir, *json_path, *dataset_path;
    bool random_dataset;
    int input_len, output_len;
    double range_ratio;
    int ignore_eos; // -1 = the dataset's default
    bool endpoint_given, help;
    char base_url_buf[512];
};

static int parse_int(const char *flag, const char *v, int lo, int *out, char *err, size_t errlen)
{
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lo || x > 100000000)
        return tdm_seterr(err, errlen, TDM_EINVAL, "%s: \"%s\" is not an integer >= %d", flag, v,
                          lo);
    *out = (int)x;
    return TDM_OK;
}

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

static bool is_flag(const char *arg, const char *name)
{
    return !strcmp(arg, name);
}

static int parse_args(struct bench_args *a, int argc, char **argv, char *err, size_t errlen)
{
    memset(a, 0, sizeof(*a));
    tdm_bench_config_init(&a->cfg);
    struct tdm_bench_config *cfg = &a->cfg;
    a->random_dataset = true;
    a->input_len = 1024;
    a->output_len = 128;
    a->ignore_eos = -1;
    const char *backend = NULL;
    int rc;
    for (int i = 1; i < argc; i++) {
        char *arg = argv[i];
        const char *val = NULL;
        char name[64];
        // --flag=value is the same as --flag value.
        char *eq = strncmp(arg, "--", 2) ? NULL : strchr(arg, '=');
        if (eq) {
            size_t nl = (size_t)(eq - arg);
            if (nl >= sizeof(name))
                return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option %.60s", arg);
            memcpy(name, arg, nl);
            name[nl] = '\0';
            val = eq + 1;
        } else {
            snprintf(name, sizeof(name), "%s", arg);
        }
        if (is_flag(name, "-h") || is_flag(name, "--help")) {
            a->help = true;
            return TDM_OK;
        }
        if (is_flag(name, "--ignore-eos") || is_flag(name, "--no-ignore-eos")) {
            if (val)
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s takes no value", name);
            a->ignore_eos = is_flag(name, "--ignore-eos");
            continue;
        }
        if (is_flag(name, "--goodput")) {
            // vLLM's form: one or more KEY:MS words after the flag.
            int terms = 0;
            if (val) {
                if ((rc = bench_parse_slo(cfg, val, err, errlen)))
                    return rc;
                terms++;
            }
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2) && strchr(argv[i + 1], ':')) {
                if ((rc = bench_parse_slo(cfg, argv[++i], err, errlen)))
                    return rc;
                terms++;
            }
            if (!terms)
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "--goodput needs KEY:MS terms (ttft:MS tpot:MS e2el:MS)");
            continue;
        }
        if (strncmp(name, "--", 2))
            return tdm_seterr(err, errlen, TDM_EINVAL, "unexpected argument \"%.60s\"", arg);
        if (!val) {
            if (i + 1 >= argc)
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s needs a value", name);
            val = argv[++i];
        }
        if (is_flag(name, "--base-url")) {
            cfg->base_url = val;
        } else if (is_flag(name, "--host")) {
            a->host = val;
        } else if (is_flag(name, "--port")) {
            a->port = val;
        } else if (is_flag(name, "--endpoint")) {
            cfg->endpoint = val;
            a->endpoint_given = true;
        } else if (is_flag(name, "--backend")) {
            backend = val;
        } else if (is_flag(name, "--model")) {
            cfg->model = val;
        } else if (is_flag(name, "--tokenizer")) {
            a->tokenizer_dir = val;
        } else if (is_flag(name, "--dataset") || is_flag(name, "--dataset-name")) {
            if (!strcmp(val, "random")) {
                a->random_dataset = true;
            } else if (!strncmp(val, "file:", 5) && val[5]) {
                a->random_dataset = false;
                a->dataset_path = val + 5;
            } else {
                return tdm_seterr(err, errlen, TDM_EINVAL,
                                  "%s: \"%s\" is neither random nor file:PATH", name, val);
            }
            cfg->dataset_name = val;
        } else if (is_flag(name, "--input-len") || is_flag(name, "--random-input-len")) {
            if ((rc = parse_int(name, val, 1, &a->input_len, err, errlen)))
                return rc;
        } else if (is_flag(name, "--output-len") || is_flag(name, "--random-output-len")) {
            if ((rc = parse_int(name, val, 1, &a->output_len, err, errlen)))
                return rc;
        } else if (is_flag(name, "--range-ratio") || is_flag(name, "--random-range-ratio")) {
            if ((rc = parse_double(name, val, &a->range_ratio, err, errlen)))
                return rc;
            if (!(a->range_ratio >= 0 && a->range_ratio < 1))
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s must be in [0, 1)", name);
        } else if (is_flag(name, "--num-prompts")) {
            if ((rc = parse_int(name, val, 1, &cfg->num_prompts, err, errlen)))
                return rc;
        } else if (is_flag(name, "--request-rate")) {
            if ((rc = parse_double(name, val, &cfg->request_rate, err, errlen)))
                return rc;
            if (!(cfg->request_rate > 0))
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s must be > 0 (or inf)", name);
        } else if (is_flag(name, "--burstiness")) {
            if ((rc = parse_double(name, val, &cfg->burstiness, err, errlen)))
                return rc;
            if (!(cfg->burstiness > 0) || isinf(cfg->burstiness))
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s must be a finite number > 0", name);
        } else if (is_flag(name, "--max-concurrency")) {
            if ((rc = parse_int(name, val, 1, &cfg->max_concurrency, err, errlen)))
                return rc;
        } else if (is_flag(name, "--seed")) {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(val, &end, 10);
            if (end == val || *end || errno || val[0] == '-')
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s: \"%s\" is not an integer >= 0",
                                  name, val);
            cfg->seed = s;
        } else if (is_flag(name, "--temperature")) {
            if ((rc = parse_double(name, val, &cfg->temperature, err, errlen)))
                return rc;
            if (!(cfg->temperature >= 0) || isinf(cfg->temperature))
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s must be >= 0", name);
        } else if (is_flag(name, "--percentiles") || is_flag(name, "--metric-percentiles")) {
            if ((rc = bench_parse_percentiles(cfg, val, err, errlen)))
                return rc;
        } else if (is_flag(name, "--json")) {
            a->json_path = val;
        } else if (is_flag(name, "--api-key")) {
            cfg->api_key = val;
        } else if (is_flag(name, "--timeout")) {
            if ((rc = parse_double(name, val, &cfg->timeout_s, err, errlen)))
                return rc;
            if (!(cfg->timeout_s > 0) || cfg->timeout_s > 1e6)
                return tdm_seterr(err, errlen, TDM_EINVAL, "%s must be in (0, 1e6] seconds", name);
        } else {
            return tdm_seterr(err, errlen, TDM_EINVAL, "unknown option %.60s (see --help)", name);
        }
    }

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
    if (a->random_dataset && !a->tokenizer_dir)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--dataset random needs --tokenizer DIR (to build exact-length prompts)");
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
    fflush(out);
}

int tdm_bench_main(int argc, char **argv, FILE *out, FILE *errf)
{
    struct bench_args a;
    char err[512] = "";
    if (parse_args(&a, argc, argv, err, sizeof(err))) {
        fprintf(errf, "tandem-bench: %s\n", err);
        return 2;
    }
    if (a.help) {
        fputs(usage_text, out);
        return 0;
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
