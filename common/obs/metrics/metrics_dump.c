// SPDX-License-Identifier: Apache-2.0
// metrics_dump: prints the standard vLLM metric set, after some activity, in the
// text exposition format, plus a tandem: family with awkward label values, so
// `metrics_dump | promtool check metrics` (the metrics_promtool ctest) checks
// what services will serve. Not installed; a test helper.
#include "metrics.h"

#include <stdio.h>
#include <stdlib.h>

int main(void)
{
    char err[256] = "";
    struct tdm_metrics_registry *reg = NULL;
    struct tdm_metrics_vllm v;
    struct tdm_metrics_counter *errors = NULL;
    struct tdm_metrics_label extra[] = {{"prefix_caching_hash_algo", "sha256"}};
    struct tdm_metrics_vllm_config cfg = {
        .model_name = "Qwen/Qwen2.5-0.5B-Instruct",
        .max_model_len = 32768,
        .cache = {.block_size = 16,
                  .num_gpu_blocks = 1024,
                  .num_cpu_blocks = -1,
                  .gpu_memory_utilization = 0.9,
                  .enable_prefix_caching = true,
                  .extra = extra,
                  .n_extra = 1},
    };
    if (tdm_metrics_registry_new(&reg, NULL, 0, err, sizeof err) != 0 ||
        tdm_metrics_vllm_register(&v, reg, &cfg, err, sizeof err) != 0) {
        fprintf(stderr, "metrics_dump: %s\n", err);
        tdm_metrics_registry_free(reg);
        return 1;
    }
    static const char *const upstream_labels[] = {"upstream", "code"};
    struct tdm_metrics_opts o = {.name = "tandem:upstream_errors_total",
                                 .help =
                                     "Upstream errors by target.\nSecond line \\ with backslash.",
                                 .label_names = upstream_labels,
                                 .n_label_names = 2};
    if (tdm_metrics_counter_register(&errors, reg, &o, err, sizeof err) != 0) {
        fprintf(stderr, "metrics_dump: %s\n", err);
        tdm_metrics_registry_free(reg);
        return 1;
    }
    tdm_metrics_counter_add(tdm_metrics_counter_labels(errors, "10.0.0.1:8200", "503"), 3);
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(errors, "odd \"host\"\\\nname", "000"));

    tdm_metrics_gauge_set(v.num_requests_running, 3);
    tdm_metrics_gauge_set(v.num_requests_waiting, 1);
    tdm_metrics_gauge_set(v.kv_cache_usage_perc, 0.4375);
    tdm_metrics_counter_add(v.prompt_tokens, 1234567);
    tdm_metrics_counter_add(v.generation_tokens, 4096);
    tdm_metrics_counter_inc(v.request_success_by_reason[TDM_FINISH_STOP]);
    tdm_metrics_counter_inc(v.request_success_by_reason[TDM_FINISH_LENGTH]);
    for (int i = 0; i < 100; i++) {
        tdm_metrics_histogram_observe(v.time_to_first_token_seconds, 0.013 * i);
        tdm_metrics_histogram_observe(v.inter_token_latency_seconds, 0.0071 * i);
        tdm_metrics_histogram_observe(v.e2e_request_latency_seconds, 0.37 * i);
        tdm_metrics_histogram_observe(v.request_prompt_tokens, 17 * i);
        tdm_metrics_histogram_observe(v.iteration_tokens_total, 64 * i);
    }
    char *text = NULL;
    size_t len = 0;
    if (tdm_metrics_render(reg, &text, &len) != 0) {
        fprintf(stderr, "metrics_dump: render failed\n");
        tdm_metrics_registry_free(reg);
        return 1;
    }
    fwrite(text, 1, len, stdout);
    free(text);
    tdm_metrics_registry_free(reg);
    return 0;
}
