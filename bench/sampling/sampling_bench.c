// SPDX-License-Identifier: Apache-2.0
// sampling_bench: time per tdm_sampler_sample call at the Qwen2.5 vocabulary
// (151936) for the common settings. The logits are a fixed pseudo-random row
// (Gumbel-like spread, as real logits have a few large values and a long tail),
// copied fresh before each call as the engine would hand a new row.
//
//   sampling_bench [iterations]      (reports CPU time per call)
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "sample_draw.h"
#include "sampling.h"

enum { VOCAB = 151936 };

// CPU time of this process: the build machine is shared, so wall time would
// mostly measure the other jobs.
static double cpu_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t bench_rng = 99;
static double uniform01(void)
{
    uint64_t z = (bench_rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) * 0x1.0p-53;
}

static void run(const char *name, const struct tdm_sampling_params *p, const float *row,
                float *work, int iters)
{
    struct tdm_sampler *s = NULL;
    if (tdm_sampler_new(&s, p, VOCAB, NULL, 0, NULL, 0) != TDM_OK) {
        fprintf(stderr, "%s: bad parameters\n", name);
        exit(1);
    }
    // The copy is timed separately so the number is the sampler's own cost.
    double t0 = cpu_now();
    for (int i = 0; i < iters; i++)
        memcpy(work, row, sizeof(float) * VOCAB);
    double copy = cpu_now() - t0;
    struct tdm_sample_result res;
    t0 = cpu_now();
    long sum = 0;
    for (int i = 0; i < iters; i++) {
        memcpy(work, row, sizeof(float) * VOCAB);
        sum += tdm_sampler_sample(s, work, &res);
    }
    double dt = cpu_now() - t0 - copy;
    printf("%-44s %8.1f us/sample  (checksum %ld)\n", name, dt / iters * 1e6, sum % 1000);
    tdm_sampler_free(s);
}

// A device draw's host side (tdm_sampler_draw_prepare): the row's parameters
// and its adjustments, rebuilt from the request's history. With a repetition
// penalty (Qwen2.5's generation_config has 1.1) every token of the prompt is
// an entry. The engine sends them once, when it loads the request's device
// list, and from then on only the parameters (tdm_sampler_draw_list_params):
// the second line of each pair, and the ratio of the two.
static void run_prepare(int prompt_len, int iters)
{
    int32_t *prompt = malloc((size_t)prompt_len * sizeof *prompt);
    struct tdm_draw_adj *adj = malloc((size_t)(prompt_len + 256) * sizeof *adj);
    if (!prompt || !adj)
        exit(1);
    for (int i = 0; i < prompt_len; i++)
        prompt[i] = (int32_t)(uniform01() * VOCAB);
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.temperature = 0.7f;
    p.top_k = 20;
    p.top_p = 0.8f;
    p.repetition_penalty = 1.1f;
    struct tdm_sampler *s = NULL;
    if (tdm_sampler_new(&s, &p, VOCAB, prompt, (size_t)prompt_len, NULL, 0) != TDM_OK)
        exit(1);
    tdm_sampler_replay(s, prompt, prompt_len < 128 ? (size_t)prompt_len : 128); // 128 generated
    struct tdm_draw_params d;
    int n = 0;
    double t0 = cpu_now();
    for (int i = 0; i < iters * 10; i++)
        n = tdm_sampler_draw_prepare(s, &d, adj, prompt_len + 256);
    double dt = (cpu_now() - t0) / (iters * 10);
    char name[64];
    snprintf(name, sizeof name, "draw_prepare, %d-token prompt, rep 1.1", prompt_len);
    printf("%-44s %8.2f us/row   (%d entries, %.1f KB a row)\n", name, dt * 1e6, n,
           (double)n * sizeof *adj / 1024.0);
    long keys = 0;
    t0 = cpu_now();
    for (int i = 0; i < iters * 100; i++) {
        keys += tdm_sampler_draw_list_params(s, &d, i & 1);
        keys += (long)(d.key & 1);
    }
    double dl = (cpu_now() - t0) / (iters * 100);
    printf("%-44s %8.3f us/row   (0 entries: %.0fx less host time; checksum %ld)\n",
           "  the same from its device list", dl * 1e6, dl > 0 ? dt / dl : 0.0, keys % 7);
    tdm_sampler_free(s);
    free(prompt);
    free(adj);
}

struct bench_args {
    int iters;
};

static const struct tdm_flag bench_flags[] = {
    {.name = "iters",
     .kind = TDM_FLAG_INT,
     .offset = offsetof(struct bench_args, iters),
     .min = 1,
     .max = 1000000000,
     .metavar = "N",
     .help = "samples per case (default 200)"},
};
static const struct tdm_flags bench_table = {
    .usage = "usage: sampling_bench [ITERS | --iters N]\n",
    .flags = bench_flags,
    .n = sizeof bench_flags / sizeof bench_flags[0],
};

int main(int argc, char **argv)
{
    struct bench_args a = {.iters = 200};
    char *rest[1];
    int n_rest = 0, exit_code = 0;
    if (tdm_flags_main(&bench_table, &a, argc, argv, rest, 1, &n_rest, "sampling_bench",
                       &exit_code))
        return exit_code;
    // The count as a bare argument too (docs/sampling.md runs `sampling_bench 500`).
    if (n_rest > 0 && tdm_flags_set(&bench_table, &a, "iters", rest[0], NULL, 0) != TDM_OK) {
        fprintf(stderr, "sampling_bench: ITERS must be an integer >= 1, got \"%s\"\n", rest[0]);
        return 2;
    }
    int iters = a.iters;
    float *row = malloc(sizeof(float) * VOCAB), *work = malloc(sizeof(float) * VOCAB);
    if (!row || !work)
        return 1;
    for (int i = 0; i < VOCAB; i++)
        row[i] = (float)(-log(-log(uniform01())) * 2.0); // Gumbel(0, 2)
    struct tdm_sampling_params p;
    tdm_sampling_params_default(&p);
    p.has_seed = true;
    p.seed = 1;
    p.temperature = 0.0f;
    run("greedy", &p, row, work, iters);
    p.temperature = 0.7f;
    p.top_k = 20;
    p.top_p = 0.8f;
    run("T=0.7 top_k=20 top_p=0.8 (Qwen2.5 default)", &p, row, work, iters);
    p.repetition_penalty = 1.1f;
    run("  + repetition_penalty 1.1, 0 history", &p, row, work, iters);
    p.repetition_penalty = 1.0f;
    p.top_k = 0;
    run("T=0.7 top_p=0.8 (no top_k)", &p, row, work, iters);
    p.top_p = 1.0f;
    run("T=0.7, no filters", &p, row, work, iters);
    p.top_k = 20;
    p.top_p = 0.8f;
    p.logprobs = 5;
    run("T=0.7 top_k=20 top_p=0.8 logprobs=5", &p, row, work, iters);
    run_prepare(128, iters);
    run_prepare(2000, iters);
    free(row);
    free(work);
    return 0;
}
