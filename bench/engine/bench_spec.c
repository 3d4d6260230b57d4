// SPDX-License-Identifier: Apache-2.0
// tandem-bench-spec: what speculative decoding by n-gram prompt lookup
// (docs/speculative-decoding.md) buys at batch 1. Decode tokens/s of the
// whole engine (scheduler, forward, sampler, proposer) with
// num_speculative_tokens K against the same engine without it, on the
// Qwen2.5-0.5B shape with random weights (the model tandem-bench-engine
// writes), for three workloads:
//   repetitive  the prompt is a random text T followed by the model's own
//               greedy continuation C of T, then T again: the continuation
//               of the final T repeats C (what "edit / summarise this text"
//               looks like to a real model: the output copies the prompt).
//               Greedy decoding.
//   random      random prompts, greedy decoding: whatever the random model
//               makes of them (it tends to settle into loops, which lookup
//               then predicts).
//   sampled     random prompts, seeded sampling at temperature 1: almost
//               nothing repeats, so drafts are rare and mostly rejected
//               (the adaptive pause's case).
// Every request runs without and with speculation back to back, each on a
// fresh engine, the order alternating (the machine is shared: load from other
// processes then hits both sides alike), --repeat rounds; decode tokens/s is
// the sum of (tokens - 1) over the sum of (last token - first token) of the
// requests, steps are the engines' forward passes (prefills included). Prints
// the ratio (goal >= 2 on repetitive, >= 0.95 on the others) and the
// acceptance: accepted drafts / draft tokens and tokens per verification step.
// Usage: tandem-bench-spec [--model DIR] [--threads N] [--tokens N] [--k K]
//                          [--requests N] [--repeat N]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "core.h"
#include "engine.h"
#include "mkmodel.h"
#include "model.h"

#ifndef TANDEM_BENCH_MODEL_DIR
#define TANDEM_BENCH_MODEL_DIR "qwen2.5-0.5b-random"
#endif
#define TEXT 48 // tokens of the random text T
#define MAX_TOKENS 1024
#define MAX_REQ 16

enum workload { W_REPETITIVE, W_RANDOM, W_SAMPLED, W_COUNT };
static const char *const wl_name[W_COUNT] = {"repetitive", "random", "sampled"};

struct run {
    double tok_s; // decode tokens/s
    uint64_t drafts, draft_tokens, accepted, steps;
};

static void die(const char *what, const char *err)
{
    fprintf(stderr, "tandem-bench-spec: %s: %s\n", what, err);
    exit(1);
}

static struct tdm_engine *engine_for(struct tdm_model *m, int k)
{
    struct tdm_engine_config c;
    struct tdm_engine *e = NULL;
    char err[256];
    tdm_engine_config_default(&c);
    c.kv_memory_bytes = (size_t)256 << 20;
    c.max_num_seqs = 4;
    c.spec.num_speculative_tokens = k;
    // vLLM's usual n-gram settings: 3-grams down to 1... 2-grams here keep
    // single-token coincidences of the random prompts out.
    c.spec.prompt_lookup_max = 4;
    c.spec.prompt_lookup_min = 2;
    if (tdm_engine_new(&e, m, &c, err, sizeof err) != TDM_OK)
        die("engine", err);
    return e;
}

static void random_text(int32_t *ids, int n, uint32_t seed, int vocab)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)(vocab - 300)); // clear of special ids
    }
}

// Runs one request to the end; returns its generated tokens (into out when
// not NULL) and adds its decode time and tokens.
static int generate(struct tdm_engine *e, const int32_t *prompt, int n, int max_tokens,
                    bool sampled, uint64_t seed, int32_t *out, double *decode_s, long *decode_tok)
{
    struct tdm_engine_request_params p;
    struct tdm_engine_request *r = NULL;
    char err[256];
    tdm_engine_request_params_default(&p);
    p.id = "bench";
    p.prompt = prompt;
    p.n_prompt = n;
    p.max_tokens = max_tokens;
    p.sampling.ignore_eos = true;
    p.sampling.temperature = sampled ? 1.0f : 0.0f;
    p.sampling.has_seed = true;
    p.sampling.seed = seed;
    if (tdm_engine_submit(e, &p, &r, err, sizeof err) != TDM_OK)
        die("submit", err);
    int got = 0;
    struct tdm_engine_chunk c;
    for (;;) {
        if (tdm_engine_stream_next(r, -1, &c) != TDM_OK)
            die("stream", "no output");
        for (int i = 0; i < c.n && out; i++)
            out[got + i] = c.tokens[i];
        got += c.n;
        if (c.finished)
            break;
    }
    struct tdm_engine_times t;
    tdm_engine_request_times(r, &t);
    if (got > 1) {
        *decode_s += t.last_token - t.first_token;
        *decode_tok += got - 1;
    }
    tdm_engine_request_release(r);
    return got;
}

struct bench_args {
    const char *model;
    int threads, tokens, k, requests, repeat;
};

#define FLAG(n, k, field, ...) TDM_FLAG_FIELD(struct bench_args, n, k, field, __VA_ARGS__)
static const struct tdm_flag bench_flags[] = {
    FLAG("model", TDM_FLAG_PTR, model, .metavar = "DIR",
         .help = "the model (default: a qwen2.5-0.5b-shaped random one, written once)"),
    FLAG("threads", TDM_FLAG_INT, threads, .min = 0, .max = 1024, .metavar = "N",
         .help = "compute threads (default 2; 0: one per core)"),
    FLAG("tokens", TDM_FLAG_INT, tokens, .min = 8, .max = MAX_TOKENS, .metavar = "N",
         .help = "tokens generated per request (default 256)"),
    FLAG("k", TDM_FLAG_INT, k, .min = 1, .max = TDM_SPEC_MAX_TOKENS, .metavar = "K",
         .help = "speculative tokens per step (default 4)"),
    FLAG("requests", TDM_FLAG_INT, requests, .min = 1, .max = MAX_REQ, .metavar = "N",
         .help = "requests per workload (default 3)"),
    FLAG("repeat", TDM_FLAG_INT, repeat, .min = 1, .max = 100, .metavar = "N",
         .help = "rounds, the best kept (default 3)"),
};
static const struct tdm_flags bench_table = {
    .usage = "usage: tandem-bench-spec [--model DIR] [--threads N] [--tokens N] [--k K] "
             "[--requests N] [--repeat N]\n",
    .flags = bench_flags,
    .n = sizeof bench_flags / sizeof bench_flags[0],
};

int main(int argc, char **argv)
{
    struct bench_args args = {.threads = 2, .tokens = 256, .k = 4, .requests = 3, .repeat = 3};
    int exit_code = 0;
    if (tdm_flags_main(&bench_table, &args, argc, argv, NULL, 0, NULL, "tandem-bench-spec",
                       &exit_code))
        return exit_code;
    const char *dir = args.model;
    int threads = args.threads, tokens = args.tokens, k = args.k, nreq = args.requests,
        repeat = args.repeat;
    tdm_log_set_level_name("warn");
    char err[512];
    struct stat sb;
    char path[1024];
    if (dir == NULL) {
        dir = TANDEM_BENCH_MODEL_DIR;
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        if (stat(path, &sb) != 0) {
            struct tdm_mkmodel_spec s;
            tdm_mkmodel_preset(&s, "qwen2.5-0.5b");
            printf("writing the qwen2.5-0.5b-shaped random model to %s ...\n", dir);
            fflush(stdout);
            if (tdm_mkmodel_write(&s, dir, err, sizeof err) != TDM_OK)
                die("mkmodel", err);
        }
    }
    struct tdm_model_opts o;
    tdm_model_opts_default(&o);
    o.num_threads = threads;
    struct tdm_model *m = NULL;
    if (tdm_model_load(&m, dir, &o, err, sizeof err) != TDM_OK)
        die("load", err);
    int vocab = tdm_model_config(m)->vocab_size;

    // The prompts: per request a random text T; repetitive adds T's greedy
    // continuation C (computed here without speculation) and T again.
    static int32_t prompts[W_COUNT][MAX_REQ][2 * TEXT + MAX_TOKENS];
    int plen[W_COUNT][MAX_REQ];
    struct tdm_engine *e0 = engine_for(m, 0);
    for (int i = 0; i < nreq; i++) {
        for (int w = 0; w < W_COUNT; w++) {
            random_text(prompts[w][i], TEXT, 1000u * (uint32_t)w + (uint32_t)i + 1, vocab);
            plen[w][i] = TEXT;
        }
        int32_t *rp = prompts[W_REPETITIVE][i];
        double ds = 0;
        long dt = 0;
        int n = generate(e0, rp, TEXT, tokens, false, 0, rp + TEXT, &ds, &dt);
        memcpy(rp + TEXT + n, rp, TEXT * sizeof *rp);
        plen[W_REPETITIVE][i] = 2 * TEXT + n;
    }
    tdm_engine_free(e0);

    // Each request runs once without and once with speculation, back to back
    // (the order alternating), each on a fresh engine, so that load from
    // other processes hits both sides alike; figures sum over all runs.
    struct run best[W_COUNT][2];
    double sum_s[W_COUNT][2] = {{0}};
    long sum_tok[W_COUNT][2] = {{0}};
    memset(best, 0, sizeof best);
    for (int rep = 0; rep < repeat; rep++) {
        for (int w = 0; w < W_COUNT; w++) {
            for (int i = 0; i < nreq; i++) {
                for (int side = 0; side < 2; side++) {
                    int with = (rep + i + side) % 2;
                    struct tdm_engine *e = engine_for(m, with ? k : 0);
                    generate(e, prompts[w][i], plen[w][i], tokens, w == W_SAMPLED, 77 + (uint64_t)i,
                             NULL, &sum_s[w][with], &sum_tok[w][with]);
                    struct tdm_engine_stats st;
                    tdm_engine_get_stats(e, &st);
                    struct run *b = &best[w][with];
                    b->drafts += st.spec_drafts;
                    b->draft_tokens += st.spec_draft_tokens;
                    b->accepted += st.spec_accepted_tokens;
                    b->steps += st.num_steps;
                    tdm_engine_free(e);
                }
            }
        }
    }
    for (int w = 0; w < W_COUNT; w++)
        for (int with = 0; with < 2; with++)
            best[w][with].tok_s =
                sum_s[w][with] > 0 ? (double)sum_tok[w][with] / sum_s[w][with] : 0;
    printf("speculative decoding, n-gram lookup 4..2, K=%d, batch 1, %d threads, %d requests x "
           "%d tokens, %d rounds\n",
           k, threads, nreq, tokens, repeat);
    printf("%-11s %10s %10s %7s %6s %9s %9s %10s %11s\n", "workload", "off tok/s", "on tok/s",
           "ratio", "goal", "drafts", "accepted", "tok/verify", "steps off/on");
    for (int w = 0; w < W_COUNT; w++) {
        const struct run *a = &best[w][0], *b = &best[w][1];
        double ratio = a->tok_s > 0 ? b->tok_s / a->tok_s : 0;
        double goal = w == W_REPETITIVE ? 2.0 : 0.95;
        double acc = b->draft_tokens ? (double)b->accepted / (double)b->draft_tokens : 0;
        double per = b->drafts ? 1.0 + (double)b->accepted / (double)b->drafts : 0;
        printf("%-11s %10.1f %10.1f %6.2fx %5.2fx %9llu %8.0f%% %10.2f %5llu/%-5llu %s\n",
               wl_name[w], a->tok_s, b->tok_s, ratio, goal, (unsigned long long)b->drafts,
               100 * acc, per, (unsigned long long)a->steps, (unsigned long long)b->steps,
               ratio >= goal ? "met" : "MISSED");
    }
    tdm_model_free(m);
    return 0;
}
