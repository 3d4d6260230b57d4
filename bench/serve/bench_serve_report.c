// SPDX-License-Identifier: Apache-2.0
// bench_serve metrics and reports, with vLLM's definitions (vllm/benchmarks/
// serve.py calculate_metrics): only completed requests enter the token totals
// and the latency distributions; TPOT = (E2EL - TTFT) / (output_tokens - 1) for
// requests with more than one output token; ITL pools every gap of every
// request; goodput counts requests meeting every given SLO (a request with one
// output token has TPOT 0 there); percentiles interpolate linearly as
// numpy.percentile does; std is the population deviation. The table on stdout
// copies the layout of `vllm bench serve`; the JSON file uses its key names.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "bench_serve_impl.h"
#include "core.h"

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Fills st from v[n] in seconds (sorted in place); the stat is in ms.
static void make_stat(struct tdm_bench_stat *st, double *v, size_t n,
                      const struct tdm_bench_config *cfg)
{
    memset(st, 0, sizeof(*st));
    st->n = n;
    if (n == 0)
        return;
    qsort(v, n, sizeof(double), cmp_double);
    double sum = 0.0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    double mean = sum / (double)n;
    double var = 0.0;
    for (size_t i = 0; i < n; i++)
        var += (v[i] - mean) * (v[i] - mean);
    st->mean = mean * 1000.0;
    st->std = sqrt(var / (double)n) * 1000.0;
    st->median = bench_percentile(v, n, 50.0) * 1000.0;
    for (int k = 0; k < cfg->n_percentiles; k++)
        st->p[k] = bench_percentile(v, n, cfg->percentiles[k]) * 1000.0;
}

int tdm_bench_compute_metrics(const struct tdm_bench_run *run, const struct tdm_bench_config *cfg,
                              struct tdm_bench_metrics *m)
{
    memset(m, 0, sizeof(*m));
    size_t n = tdm_bench_run_count(run);
    size_t n_itl = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_bench_request *r = tdm_bench_run_request(run, i);
        if (r->success)
            n_itl += r->n_itl;
    }
    double *ttft = malloc((n + 1) * sizeof(double));
    double *tpot = malloc((n + 1) * sizeof(double));
    double *e2el = malloc((n + 1) * sizeof(double));
    double *itl = malloc((n_itl + 1) * sizeof(double));
    if (!ttft || !tpot || !e2el || !itl) {
        free(ttft);
        free(tpot);
        free(e2el);
        free(itl);
        return TDM_ENOMEM;
    }
    size_t n_ok = 0, n_tpot = 0;
    n_itl = 0;
    double min_start = INFINITY, max_end = -INFINITY;
    for (size_t i = 0; i < n; i++) {
        const struct tdm_bench_request *r = tdm_bench_run_request(run, i);
        if (!r->success) {
            m->failed++;
            continue;
        }
        m->completed++;
        m->total_input += r->input_len;
        m->total_output += r->output_tokens;
        ttft[n_ok] = r->ttft_s;
        e2el[n_ok] = r->latency_s;
        n_ok++;
        double req_tpot = 0.0;
        if (r->output_tokens > 1) {
            req_tpot = (r->latency_s - r->ttft_s) / (double)(r->output_tokens - 1);
            tpot[n_tpot++] = req_tpot;
        }
        memcpy(itl + n_itl, r->itl_s, r->n_itl * sizeof(double));
        n_itl += r->n_itl;
        bool good = true;
        if (cfg->slo_ttft_ms > 0 && r->ttft_s * 1000.0 > cfg->slo_ttft_ms)
            good = false;
        if (cfg->slo_tpot_ms > 0 && req_tpot * 1000.0 > cfg->slo_tpot_ms)
            good = false;
        if (cfg->slo_e2el_ms > 0 && r->latency_s * 1000.0 > cfg->slo_e2el_ms)
            good = false;
        if (good && tdm_bench_config_has_slo(cfg))
            m->good_completed++;
        if (r->start_s < min_start)
            min_start = r->start_s;
        if (r->start_s + r->latency_s > max_end)
            max_end = r->start_s + r->latency_s;
    }
    m->duration_s = tdm_bench_run_duration(run);
    m->max_concurrent_requests = tdm_bench_run_max_concurrency(run);
    if (m->duration_s > 0) {
        m->request_throughput = m->completed / m->duration_s;
        m->request_goodput = m->good_completed / m->duration_s;
        m->output_throughput = (double)m->total_output / m->duration_s;
        m->total_token_throughput = (double)(m->total_input + m->total_output) / m->duration_s;
    }
    // Peak output tokens/s: content chunks per one-second bucket from the first
    // successful send, each chunk counted as one token (vLLM's approximation).
    if (n_ok) {
        size_t nb = (size_t)ceil(max_end - min_start) + 1;
        double *buckets = calloc(nb, sizeof(double));
        if (buckets) {
            for (size_t i = 0; i < n; i++) {
                const struct tdm_bench_request *r = tdm_bench_run_request(run, i);
                if (!r->success)
                    continue;
                double t = r->start_s + r->ttft_s - min_start;
                for (size_t k = 0;; k++) {
                    size_t b = (size_t)(t > 0 ? t : 0);
                    if (b < nb)
                        buckets[b] += 1.0;
                    if (k == r->n_itl)
                        break;
                    t += r->itl_s[k];
                }
            }
            for (size_t b = 0; b < nb; b++)
                if (buckets[b] > m->max_output_tokens_per_s)
                    m->max_output_tokens_per_s = buckets[b];
            free(buckets);
        }
    }
    make_stat(&m->ttft, ttft, n_ok, cfg);
    make_stat(&m->tpot, tpot, n_tpot, cfg);
    make_stat(&m->itl, itl, n_itl, cfg);
    make_stat(&m->e2el, e2el, n_ok, cfg);
    free(ttft);
    free(tpot);
    free(e2el);
    free(itl);
    return TDM_OK;
}

// "99" for 99.0, "99.9" for 99.9: the spelling of vLLM's p<word> keys.
static void percentile_word(char *buf, size_t len, double p)
{
    if (p == floor(p))
        snprintf(buf, len, "%d", (int)p);
    else
        snprintf(buf, len, "%g", p);
}

// ---- the table ---------------------------------------------------------------------------------
static void banner(FILE *f, const char *title, char fill)
{
    int len = (int)strlen(title);
    int left = (50 - len) / 2, right = 50 - len - left;
    for (int i = 0; i < left; i++)
        fputc(fill, f);
    fputs(title, f);
    for (int i = 0; i < right; i++)
        fputc(fill, f);
    fputc('\n', f);
}

static void row_f(FILE *f, const char *label, double v)
{
    fprintf(f, "%-40s %-10.2f\n", label, v);
}

static void row_i(FILE *f, const char *label, long long v)
{
    fprintf(f, "%-40s %-10lld\n", label, v);
}

static void stat_rows(FILE *f, const struct tdm_bench_config *cfg, const char *title,
                      const char *name, const struct tdm_bench_stat *st)
{
    char label[64], word[32];
    banner(f, title, '-');
    snprintf(label, sizeof(label), "Mean %s (ms):", name);
    row_f(f, label, st->mean);
    snprintf(label, sizeof(label), "Median %s (ms):", name);
    row_f(f, label, st->median);
    for (int k = 0; k < cfg->n_percentiles; k++) {
        percentile_word(word, sizeof(word), cfg->percentiles[k]);
        snprintf(label, sizeof(label), "P%s %s (ms):", word, name);
        row_f(f, label, st->p[k]);
    }
}

// Failure categories in first-seen order, with a count and the first detail.
struct reason_count {
    const char *reason;
    const char *example;
    int count;
};

static size_t count_reasons(const struct tdm_bench_run *run, struct reason_count *rc, size_t cap)
{
    size_t nr = 0;
    for (size_t i = 0; i < tdm_bench_run_count(run); i++) {
        const struct tdm_bench_request *r = tdm_bench_run_request(run, i);
        if (r->success)
            continue;
        size_t k = 0;
        while (k < nr && strcmp(rc[k].reason, r->reason))
            k++;
        if (k == nr) {
            if (nr == cap)
                continue;
            rc[nr++] = (struct reason_count){.reason = r->reason, .example = r->error, .count = 0};
        }
        rc[k].count++;
    }
    return nr;
}

void tdm_bench_print_report(FILE *f, const struct tdm_bench_config *cfg,
                            const struct tdm_bench_run *run, const struct tdm_bench_metrics *m)
{
    banner(f, " Serving Benchmark Result ", '=');
    row_i(f, "Successful requests:", m->completed);
    row_i(f, "Failed requests:", m->failed);
    if (cfg->max_concurrency > 0)
        row_i(f, "Maximum request concurrency:", cfg->max_concurrency);
    if (!isinf(cfg->request_rate))
        row_f(f, "Request rate configured (RPS):", cfg->request_rate);
    row_f(f, "Benchmark duration (s):", m->duration_s);
    row_i(f, "Total input tokens:", m->total_input);
    row_i(f, "Total generated tokens:", m->total_output);
    row_f(f, "Request throughput (req/s):", m->request_throughput);
    if (tdm_bench_config_has_slo(cfg))
        row_f(f, "Request goodput (req/s):", m->request_goodput);
    row_f(f, "Output token throughput (tok/s):", m->output_throughput);
    row_f(f, "Peak output token throughput (tok/s):", m->max_output_tokens_per_s);
    row_i(f, "Peak concurrent requests:", m->max_concurrent_requests);
    row_f(f, "Total Token throughput (tok/s):", m->total_token_throughput);
    stat_rows(f, cfg, "Time to First Token", "TTFT", &m->ttft);
    stat_rows(f, cfg, "Time per Output Token (excl. 1st token)", "TPOT", &m->tpot);
    stat_rows(f, cfg, "Inter-token Latency", "ITL", &m->itl);
    stat_rows(f, cfg, "End-to-end Latency", "E2EL", &m->e2el);
    if (m->failed) {
        struct reason_count rc[32];
        size_t nr = count_reasons(run, rc, 32);
        banner(f, "Failures", '-');
        for (size_t k = 0; k < nr; k++)
            fprintf(f, "%-40s %-10d e.g. %s\n", rc[k].reason, rc[k].count, rc[k].example);
    }
    banner(f, "", '=');
}

// ---- JSON ----------------------------------------------------------------------------------
static void add_stat(cJSON *o, const struct tdm_bench_config *cfg, const char *name,
                     const struct tdm_bench_stat *st)
{
    char key[64], word[32];
    snprintf(key, sizeof(key), "mean_%s_ms", name);
    cJSON_AddNumberToObject(o, key, st->mean);
    snprintf(key, sizeof(key), "median_%s_ms", name);
    cJSON_AddNumberToObject(o, key, st->median);
    snprintf(key, sizeof(key), "std_%s_ms", name);
    cJSON_AddNumberToObject(o, key, st->std);
    for (int k = 0; k < cfg->n_percentiles; k++) {
        percentile_word(word, sizeof(word), cfg->percentiles[k]);
        snprintf(key, sizeof(key), "p%s_%s_ms", word, name);
        cJSON_AddNumberToObject(o, key, st->p[k]);
    }
}

static cJSON *build_json(const struct tdm_bench_config *cfg, const struct tdm_bench_run *run,
                         const struct tdm_bench_metrics *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    char date[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(date, sizeof(date), "%Y%m%d-%H%M%S", &tm);
    cJSON_AddStringToObject(o, "date", date);
    cJSON_AddStringToObject(o, "backend", cfg->chat ? "openai-chat" : "openai");
    cJSON_AddStringToObject(o, "label", "tandem-bench");
    cJSON_AddStringToObject(o, "model_id", cfg->model ? cfg->model : "");
    if (cfg->tokenizer_id)
        cJSON_AddStringToObject(o, "tokenizer_id", cfg->tokenizer_id);
    else
        cJSON_AddNullToObject(o, "tokenizer_id");
    cJSON_AddStringToObject(o, "base_url", cfg->base_url ? cfg->base_url : "");
    cJSON_AddStringToObject(o, "endpoint", cfg->endpoint ? cfg->endpoint : "");
    cJSON_AddStringToObject(o, "dataset_name", cfg->dataset_name ? cfg->dataset_name : "");
    cJSON_AddNumberToObject(o, "num_prompts", cfg->num_prompts);
    if (isinf(cfg->request_rate))
        cJSON_AddStringToObject(o, "request_rate", "inf");
    else
        cJSON_AddNumberToObject(o, "request_rate", cfg->request_rate);
    cJSON_AddNumberToObject(o, "burstiness", cfg->burstiness);
    if (cfg->max_concurrency > 0)
        cJSON_AddNumberToObject(o, "max_concurrency", cfg->max_concurrency);
    else
        cJSON_AddNullToObject(o, "max_concurrency");
    if (cfg->duration_s > 0)
        cJSON_AddNumberToObject(o, "duration_limit", cfg->duration_s);
    else
        cJSON_AddNullToObject(o, "duration_limit");
    cJSON_AddNumberToObject(o, "seed", (double)cfg->seed);
    cJSON_AddBoolToObject(o, "ignore_eos", cfg->ignore_eos);
    cJSON_AddNumberToObject(o, "temperature", cfg->temperature);

    cJSON_AddNumberToObject(o, "duration", m->duration_s);
    cJSON_AddNumberToObject(o, "completed", m->completed);
    cJSON_AddNumberToObject(o, "failed", m->failed);
    cJSON_AddNumberToObject(o, "total_input_tokens", (double)m->total_input);
    cJSON_AddNumberToObject(o, "total_output_tokens", (double)m->total_output);
    cJSON_AddNumberToObject(o, "request_throughput", m->request_throughput);
    if (tdm_bench_config_has_slo(cfg)) {
        cJSON_AddNumberToObject(o, "request_goodput", m->request_goodput);
        cJSON *slo = cJSON_AddObjectToObject(o, "goodput_slo_ms");
        if (cfg->slo_ttft_ms > 0)
            cJSON_AddNumberToObject(slo, "ttft", cfg->slo_ttft_ms);
        if (cfg->slo_tpot_ms > 0)
            cJSON_AddNumberToObject(slo, "tpot", cfg->slo_tpot_ms);
        if (cfg->slo_e2el_ms > 0)
            cJSON_AddNumberToObject(slo, "e2el", cfg->slo_e2el_ms);
    } else {
        cJSON_AddNullToObject(o, "request_goodput");
    }
    cJSON_AddNumberToObject(o, "output_throughput", m->output_throughput);
    cJSON_AddNumberToObject(o, "total_token_throughput", m->total_token_throughput);
    cJSON_AddNumberToObject(o, "max_output_tokens_per_s", m->max_output_tokens_per_s);
    cJSON_AddNumberToObject(o, "max_concurrent_requests", m->max_concurrent_requests);

    cJSON *input_lens = cJSON_AddArrayToObject(o, "input_lens");
    cJSON *output_lens = cJSON_AddArrayToObject(o, "output_lens");
    cJSON *ttfts = cJSON_AddArrayToObject(o, "ttfts");
    cJSON *itls = cJSON_AddArrayToObject(o, "itls");
    cJSON *starts = cJSON_AddArrayToObject(o, "start_times");
    cJSON *texts = cJSON_AddArrayToObject(o, "generated_texts");
    cJSON *errors = cJSON_AddArrayToObject(o, "errors");
    for (size_t i = 0; i < tdm_bench_run_count(run); i++) {
        const struct tdm_bench_request *r = tdm_bench_run_request(run, i);
        cJSON_AddItemToArray(input_lens, cJSON_CreateNumber(r->input_len));
        cJSON_AddItemToArray(output_lens, cJSON_CreateNumber(r->output_tokens));
        cJSON_AddItemToArray(ttfts, cJSON_CreateNumber(r->ttft_s));
        cJSON_AddItemToArray(starts, cJSON_CreateNumber(r->start_s));
        cJSON *gaps = cJSON_CreateArray();
        for (size_t k = 0; gaps && k < r->n_itl; k++)
            cJSON_AddItemToArray(gaps, cJSON_CreateNumber(r->itl_s[k]));
        cJSON_AddItemToArray(itls, gaps);
        cJSON_AddItemToArray(texts, cJSON_CreateString(r->generated_text ? r->generated_text : ""));
        cJSON_AddItemToArray(errors, cJSON_CreateString(r->error));
    }
    struct reason_count rc[32];
    size_t nr = count_reasons(run, rc, 32);
    cJSON *reasons = cJSON_AddObjectToObject(o, "failure_reasons");
    for (size_t k = 0; k < nr; k++)
        cJSON_AddNumberToObject(reasons, rc[k].reason, rc[k].count);

    add_stat(o, cfg, "ttft", &m->ttft);
    add_stat(o, cfg, "tpot", &m->tpot);
    add_stat(o, cfg, "itl", &m->itl);
    add_stat(o, cfg, "e2el", &m->e2el);
    return o;
}

int tdm_bench_write_json(FILE *f, const struct tdm_bench_config *cfg,
                         const struct tdm_bench_run *run, const struct tdm_bench_metrics *m,
                         char *err, size_t errlen)
{
    cJSON *o = build_json(cfg, run, m);
    char *text = o ? cJSON_Print(o) : NULL;
    cJSON_Delete(o);
    if (!text)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory building the JSON result");
    size_t len = strlen(text);
    int rc = TDM_OK;
    if (fwrite(text, 1, len, f) != len || fputc('\n', f) == EOF || fflush(f))
        rc = tdm_seterr(err, errlen, TDM_EIO, "writing the JSON result failed");
    free(text);
    return rc;
}
