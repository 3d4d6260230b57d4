// SPDX-License-Identifier: Apache-2.0
// bench_serve: the serving benchmark client behind `tandem-bench` (the Tandem
// counterpart of `vllm bench serve`). It builds a dataset of prompts (random
// token prompts of exact lengths, or a file), sends them to an OpenAI-compatible
// server as streaming requests from one thread (libcurl multi: many concurrent
// streams, Poisson or burst arrivals, an optional concurrency cap), timestamps
// every SSE chunk, and turns the measurements into the numbers vLLM reports:
// request/token throughput, goodput, and mean/median/std/percentiles of TTFT,
// TPOT, ITL and E2E latency (docs/benchmarking.md has the definitions).
// The core is a library so that tests drive it against a fake server; main.c
// only calls tdm_bench_main.
#ifndef TDM_BENCH_SERVE_H
#define TDM_BENCH_SERVE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

struct tdm_tokenizer;

#define TDM_BENCH_MAX_PERCENTILES 16

// ---- configuration ----------------------------------------------------------------------
// What to send and how; tdm_bench_config_init fills the defaults. Strings are
// borrowed and must outlive the run.
struct tdm_bench_config {
    const char *base_url; // "http://127.0.0.1:8000", no trailing '/'
    const char *endpoint; // "/v1/completions" or "/v1/chat/completions"
    bool chat;            // chat body (messages, delta.content) instead of prompt/text
    const char *model;    // the "model" field of every request
    const char *api_key;  // sent as "Authorization: Bearer KEY"; NULL = none
    int num_prompts;      // requests to send (the dataset must hold this many)
    double request_rate;  // mean arrivals per second; INFINITY = all at time 0
    double burstiness;    // gamma shape of the inter-arrival time; 1 = Poisson
    int max_concurrency;  // requests in flight at most; 0 = unlimited
    uint64_t seed;        // arrival times (and the random dataset) derive from it
    bool ignore_eos;      // send "ignore_eos": true
    double temperature;   // sampling temperature sent (vLLM's bench sends 0)
    double timeout_s;     // per request, from send to the end of the stream
    double duration_s;    // > 0: send for this long, cycling through the dataset's prompts
                          // (num_prompts is then the dataset's size, not a count), and
                          // wait for what is in flight; needs max_concurrency > 0
    double slo_ttft_ms;   // goodput SLOs; <= 0 when not given
    double slo_tpot_ms;
    double slo_e2el_ms;
    double percentiles[TDM_BENCH_MAX_PERCENTILES]; // in (0, 100], ascending as given
    int n_percentiles;
    // Only echoed in the report and the JSON file.
    const char *dataset_name; // "random" or "file:PATH"
    const char *tokenizer_id; // the --tokenizer folder, NULL when none
};

void tdm_bench_config_init(struct tdm_bench_config *cfg);
// True when any goodput SLO is set.
bool tdm_bench_config_has_slo(const struct tdm_bench_config *cfg);

// ---- datasets ---------------------------------------------------------------------------
struct tdm_bench_prompt {
    char *text;     // heap, NUL-terminated
    int input_len;  // prompt tokens by the bench's tokenizer; -1 when unknown (no tokenizer):
                    // the server's usage.prompt_tokens is used then
    int output_len; // max_tokens for this request (>= 1)
};

struct tdm_bench_dataset {
    struct tdm_bench_prompt *prompts; // [n], heap
    size_t n;
};

// Random prompts as vLLM's random dataset builds them: each input length is
// drawn uniformly from [input_len*(1-r), input_len*(1+r)] (likewise output_len),
// token ids are drawn uniformly from the vocabulary without the special tokens,
// decoded to text, and the text is re-encoded and trimmed/extended until it
// encodes to exactly that many tokens (input_len is then exact; in the rare case
// that 16 rounds do not converge, input_len holds the count the text really has).
// range_ratio in [0, 1). Deterministic for a seed.
int tdm_bench_dataset_random(struct tdm_bench_dataset *out, const struct tdm_tokenizer *tok,
                             int num_prompts, int input_len, int output_len, double range_ratio,
                             uint64_t seed, char *err, size_t errlen);

// Prompts from a file: one per line, or JSON lines {"prompt": "...",
// "output_len": N (optional)}; blank lines are skipped. Lines are used in
// order and repeated when the file holds fewer than num_prompts. tok may be
// NULL (input lengths unknown). output_len applies where a line names none.
int tdm_bench_dataset_file(struct tdm_bench_dataset *out, const char *path,
                           const struct tdm_tokenizer *tok, int num_prompts, int output_len,
                           char *err, size_t errlen);

void tdm_bench_dataset_fini(struct tdm_bench_dataset *ds);

// ---- running ----------------------------------------------------------------------------
// One request's measurements (times in seconds).
struct tdm_bench_request {
    bool success;
    double start_s;    // when it was sent, from the benchmark start
    double ttft_s;     // send -> first chunk with non-empty text
    double latency_s;  // send -> end of the stream ([DONE])
    int input_len;     // prompt tokens (dataset count, else the server's usage)
    int output_tokens; // usage.completion_tokens, else the re-tokenized text, else chunks
    double *itl_s;     // [n_itl] gaps between consecutive content chunks, heap
    size_t n_itl;
    char *generated_text; // heap, NUL-terminated ("" when nothing arrived)
    char reason[32];      // failures: a category ("HTTP 500", "timeout", "error event",
                          // "connection", "incomplete stream", "no content", "bad chunk")
    char error[256];      // failures: the detail a person needs; "" on success
};

struct tdm_bench_run;

// Sends cfg->num_prompts requests (prompt i = ds->prompts[i]) and waits for all
// of them; every request ends (per-request timeout), so this always returns.
// With cfg->duration_s > 0 it sends request i with prompt i % ds->n until that
// much time has passed (the run's count is then what was sent), as a soak does.
// tok (may be NULL) counts output tokens when the server reports no usage.
// Failed requests are results, not errors: TDM_EINVAL only for a bad config
// (dataset too small, bad URL), TDM_ENOMEM, TDM_ETRANSPORT if libcurl cannot start.
int tdm_bench_run(struct tdm_bench_run **out, const struct tdm_bench_config *cfg,
                  const struct tdm_bench_dataset *ds, const struct tdm_tokenizer *tok, char *err,
                  size_t errlen);
void tdm_bench_run_free(struct tdm_bench_run *run);
size_t tdm_bench_run_count(const struct tdm_bench_run *run);
const struct tdm_bench_request *tdm_bench_run_request(const struct tdm_bench_run *run, size_t i);
// Benchmark start -> the last request's end, seconds.
double tdm_bench_run_duration(const struct tdm_bench_run *run);
// The most requests that were in flight at one instant.
int tdm_bench_run_max_concurrency(const struct tdm_bench_run *run);

// ---- metrics and reports ----------------------------------------------------------------
// One latency distribution in milliseconds (0 when there are no samples, as vLLM).
struct tdm_bench_stat {
    double mean, median, std;            // std: population (numpy's default)
    double p[TDM_BENCH_MAX_PERCENTILES]; // the config's percentiles, linear interpolation
    size_t n;                            // samples
};

struct tdm_bench_metrics {
    int completed, failed;
    double duration_s;
    long long total_input;     // prompt tokens of completed requests
    long long total_output;    // output tokens of completed requests
    double request_throughput; // completed / duration
    double request_goodput;    // requests meeting every SLO / duration; 0 without SLOs
    int good_completed;
    double output_throughput;       // total_output / duration
    double total_token_throughput;  // (total_input + total_output) / duration
    double max_output_tokens_per_s; // busiest one-second bucket of content chunks (vLLM)
    int max_concurrent_requests;    // the most in flight at one instant
    struct tdm_bench_stat ttft, tpot, itl, e2el;
};

int tdm_bench_compute_metrics(const struct tdm_bench_run *run, const struct tdm_bench_config *cfg,
                              struct tdm_bench_metrics *m);

// The human table (the layout of vllm bench serve's) plus a failure summary.
void tdm_bench_print_report(FILE *f, const struct tdm_bench_config *cfg,
                            const struct tdm_bench_run *run, const struct tdm_bench_metrics *m);

// The same numbers as JSON, keys named as in vLLM's result file (completed,
// duration, request_throughput, mean_ttft_ms, p99_itl_ms, ...) plus per-request
// arrays (input_lens, output_lens, ttfts, itls, errors) and failure_reasons.
int tdm_bench_write_json(FILE *f, const struct tdm_bench_config *cfg,
                         const struct tdm_bench_run *run, const struct tdm_bench_metrics *m,
                         char *err, size_t errlen);

// ---- command line -----------------------------------------------------------------------
// The whole tool: parses argv (see --help), builds the dataset, runs, prints the
// report to out and writes --json. Returns the exit status: 0, 1 when every
// request failed (or a run could not start), 2 on bad arguments (one line on err).
int tdm_bench_main(int argc, char **argv, FILE *out, FILE *err);

#endif
