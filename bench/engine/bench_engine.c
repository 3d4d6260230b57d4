// SPDX-License-Identifier: Apache-2.0
// tandem-bench-engine: the whole forward (not single kernels) measured against
// this machine's limits in one run, for bf16 and int8 weights:
//   decode b1 / weight read   one decode step at batch 1 / the time to stream
//                             tdm_model_weight_bytes once at the probed read
//                             bandwidth (goal <= 1.3)
//   decode b8, b32 speedup    decode tokens/s at batch 8 and 32 / at batch 1
//                             (goal >= 10 at 32)
//   prefill 512 / FMA peak    FLOP/s of one 512-token prefill (matmuls + attention
//                             + one lm_head row) / the probed f32 FMA peak (goal >= 0.5);
//                             also / the bf16 dot-product peak, the real limit of
//                             the AVX-512 BF16 path (vdpbf16ps)
//   decode at long context    tokens/s at --long-context tokens (4096) per KV cache
//                             dtype and the ratio bf16/f32 (goal >= 1.3 where the
//                             KV read dominates), steps of both caches alternating
//   KV capacity               blocks and tokens --kv-cache-memory holds per dtype
//                             (goal: bf16 2x f32)
//   engine loop (--engine-loop) per decode batch: the serving engine's step
//                             (scheduler, sampling with Qwen2.5's generation_config,
//                             streaming) / the forward alone at that batch (mean
//                             against mean, the same positions), and
//                             the engine thread's CPU time per step and share of
//                             the wall (issue 26 item 1: on a device backend that
//                             thread is all the host's work; on the CPU it also
//                             computes a share of the forward), and the steps
//                             issued ahead (async scheduling; a device only)
// plus tokens/s for decode and prefill and the peak RSS, and on the CPU the
// matmul path of each mode (ISA and kernel: AMX tiles, vdpbf16ps, VNNI...),
// which is the same for every batch size and the prefill (with AMX tiles
// pf/bf16 can pass 1: that peak is vdpbf16ps's). Without --model it writes
// the Qwen2.5-0.5B-shaped random model into the build folder once and reuses it.
// --batches and --prefill choose other decode batch sizes (up to 256) and prefill
// chunks (up to 4096 tokens; the table above needs the defaults 1,8,32 and 512,
// otherwise one line per point is printed); --json FILE also writes the first
// mode's figures for bench/gpu/check.sh (tandem-gpu-report reads them).
// --peer FILE reads llama.cpp's figures on this machine (bench/peer/llamacpp.sh
// measures them: bench_peer.h) and prints them with Tandem's ratios to them
// from this run; without it a line says how to get them (no figure of the peer
// is written here). A missing or malformed FILE is refused before anything runs.
// Usage: tandem-bench-engine [--model DIR] [--threads N] [--steps N] [--bf16-only]
//                            [--batches LIST] [--prefill LIST] [--json FILE]
//                            [--kv-cache-dtype auto|bf16|f32] [--long-context N]
//                            [--long-batches LIST] [--kv-cache-memory BYTES]
//                            [--engine-loop] [--peer FILE]
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include "bench_peer.h"
#include "core.h"
#include "cpu_backend.h"
#include "engine.h"
#include "cpu_probe.h"
#include "kv_cache.h"
#include "mkmodel.h"
#include "model.h"

#ifndef TANDEM_BENCH_MODEL_DIR
#define TANDEM_BENCH_MODEL_DIR "qwen2.5-0.5b-random"
#endif

#define PROMPT 32   // context of every decoding sequence
#define PREFILL 512 // the default prefill chunk, and the token budget of prompt steps
#define MAX_BATCH 256 // issue 26: the served table goes to 256 streams
#define MAX_PREFILL 4096
#define MAX_POINTS 8

// What to measure: decode batch sizes and prefill chunk lengths.
struct plan {
    int batches[MAX_POINTS], n_batches;
    int prefill[MAX_POINTS], n_prefill;
    int long_ctx;                      // --long-context: tokens of context (0 = skip)
    int long_batches[MAX_POINTS], n_long; // --long-batches
    size_t kv_memory;                  // --kv-cache-memory: the capacity line's budget
    enum tdm_kv_dtype kv_dtype;        // --kv-cache-dtype of the main table (default bf16)
    bool engine_loop;                  // --engine-loop: the serving engine at each batch
};

// KV cache element types compared at long context (the first is the reference).
#define N_KV_DTYPES 2
static const enum tdm_kv_dtype kv_dtypes[N_KV_DTYPES] = {TDM_KV_F32, TDM_KV_BF16};
static const char *const kv_dtype_names[N_KV_DTYPES] = {"f32", "bf16"};

struct result {
    double decode_s[MAX_POINTS];  // seconds per decode step at plan.batches[i]
    double decode_mean_s[MAX_POINTS]; // the same steps' mean (the engine loop's reference)
    double prefill_s[MAX_POINTS]; // seconds for one prefill of plan.prefill[i] tokens
    double prefill_flops[MAX_POINTS];
    size_t weight_bytes;
    // Decode at long context (bf16 weights only): seconds per step at
    // long_batches[i] sequences of a.long_ctx tokens each, per KV cache dtype.
    double long_s[2][MAX_POINTS];
    double short_s[2]; // batch 1 at PROMPT tokens of context, per KV cache dtype (alternating)
    struct tdm_kv_config kc; // the model's KV geometry (block_size 16)
    const char *long_skip;   // why the long-context figures were not measured (NULL: measured)
    // --engine-loop (bf16 only), per decode batch: seconds per engine step,
    // the engine thread's CPU seconds per step, tokens drawn on the device.
    double loop_s[MAX_POINTS], loop_cpu_s[MAX_POINTS], loop_share[MAX_POINTS];
    unsigned long long loop_drawn[MAX_POINTS], loop_tokens[MAX_POINTS];
    // ... engine steps, and those issued while the step before them was in
    // flight (async scheduling: the engine thread's work beside the device's).
    unsigned long long loop_steps[MAX_POINTS], loop_async[MAX_POINTS], loop_list[MAX_POINTS];
    // ... the engine thread's wall seconds per step by phase over the run
    // (tdm_engine_stats.phase_seconds: where the host's share goes).
    double loop_phase[MAX_POINTS][TDM_ENGINE_PHASES];
    // The engine loop's KV cache dtype, asked of the engine it made (the
    // decode and prefill rows use the plan's).
    enum tdm_kv_dtype loop_kv_dtype;
    char device[32]; // the backend the model ran on (tdm_model_opts.backend)
    bool batch_invariant; // the model's GEMM mode as resolved (tdm_model_opts.batch_invariant)
    struct tdm_model_load_info load; // load time, checkpoint bytes, weight cache use
};

static void die(const char *what, const char *err)
{
    fprintf(stderr, "tandem-bench-engine: %s: %s\n", what, err);
    exit(1);
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

// Prefills `batch` sequences of PROMPT tokens, then times `steps` decode steps
// of all of them together; returns the best seconds per step (the machine is
// shared: the minimum is the least disturbed).
static double time_decode(struct tdm_model *m, struct tdm_kv_cache *kv, int batch, int steps,
                          float *logits, double *mean)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    struct tdm_kv_seq seqs[MAX_BATCH];
    struct tdm_batch_seq b[MAX_BATCH];
    static int32_t hist[MAX_BATCH][PROMPT + 64];
    for (int s = 0; s < batch; s++) {
        tdm_kv_seq_init(&seqs[s]);
        for (int i = 0; i < PROMPT; i++)
            hist[s][i] = (int32_t)((s * 7919 + i * 104729) % (c->vocab_size - 3));
        if (tdm_kv_reserve(kv, &seqs[s], PROMPT + steps + 2) != TDM_OK)
            die("kv", "cache too small");
        b[s] = (struct tdm_batch_seq){.tokens = hist[s],
                                      .n_tokens = PROMPT,
                                      .start_pos = 0,
                                      .block_table = seqs[s].block_table,
                                      .prompt_len = PROMPT,
                                      .logits = TDM_LOGITS_LAST};
    }
    // Prompts in groups that fit the step's token budget (PREFILL tokens).
    for (int s0 = 0; s0 < batch; s0 += PREFILL / PROMPT) {
        int ns = batch - s0 < PREFILL / PROMPT ? batch - s0 : PREFILL / PROMPT;
        if (tdm_model_forward(m, kv, b + s0, ns, logits) != TDM_OK)
            die("forward", "prefill failed");
        for (int s = 0; s < ns; s++)
            hist[s0 + s][PROMPT] = argmax(logits + (size_t)s * c->vocab_size, c->vocab_size);
    }
    double best = 1e30, sum = 0;
    for (int step = 0; step <= steps; step++) { // step 0 warms up
        int pos = PROMPT + step;
        for (int s = 0; s < batch; s++)
            b[s] = (struct tdm_batch_seq){.tokens = hist[s] + pos,
                                          .n_tokens = 1,
                                          .start_pos = pos,
                                          .block_table = seqs[s].block_table,
                                          .prompt_len = PROMPT,
                                          .logits = TDM_LOGITS_LAST};
        double t0 = tdm_now();
        if (tdm_model_forward(m, kv, b, batch, logits) != TDM_OK)
            die("forward", "decode failed");
        double dt = tdm_now() - t0;
        if (step > 0 && dt < best)
            best = dt;
        if (step > 0)
            sum += dt;
        for (int s = 0; s < batch; s++)
            hist[s][pos + 1] = argmax(logits + (size_t)s * c->vocab_size, c->vocab_size);
    }
    for (int s = 0; s < batch; s++)
        tdm_kv_seq_release(kv, &seqs[s]);
    *mean = sum / steps;
    return best;
}

// Decode steps of `batch` sequences that already hold ctx tokens of KV, in each
// of the n caches kvs (one per KV dtype): the context's KV is written straight
// into the caches (the same deterministic values in [-1, 1], through
// tdm_kv_import_layer_as from f32) instead of prefilling it, which would take
// minutes at 4096 tokens on a small machine; a decode step costs the same
// either way (it reads every position's K and V). The caches take turns step
// by step, so a disturbance of the shared machine hits them alike. best[d]:
// the best seconds per step of kvs[d].
static void time_long(struct tdm_model *m, struct tdm_kv_cache **kvs, int n, int batch, int ctx,
                      int steps, float *logits, double *best)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    const struct tdm_kv_config *kc = tdm_kv_config(kvs[0]);
    static struct tdm_kv_seq seqs[N_KV_DTYPES][MAX_BATCH];
    struct tdm_batch_seq b[MAX_BATCH];
    static int32_t tok[N_KV_DTYPES][MAX_BATCH];
    int nb = (ctx + kc->block_size - 1) / kc->block_size;
    size_t lb = tdm_kv_layer_bytes_as(kvs[0], nb, TDM_KV_F32);
    size_t nf = lb / sizeof(float);
    float *buf = malloc(lb);
    if (buf == NULL)
        die("kv", "out of memory for the context fill");
    uint32_t x = 12345;
    for (size_t i = 0; i < nf; i++) {
        x = x * 1664525u + 1013904223u;
        buf[i] = (float)(x >> 8) / 8388608.0f - 1.0f;
    }
    for (int d = 0; d < n; d++) {
        best[d] = 1e30;
        for (int s = 0; s < batch; s++) {
            tdm_kv_seq_init(&seqs[d][s]);
            if (tdm_kv_reserve(kvs[d], &seqs[d][s], ctx + steps + 2) != TDM_OK)
                die("kv", "cache too small for the long context");
            for (int l = 0; l < kc->num_layers; l++)
                if (tdm_kv_import_layer_as(kvs[d], &seqs[d][s], l, 0, nb, TDM_KV_F32, buf, lb) !=
                    TDM_OK)
                    die("kv import", tdm_kv_errmsg(kvs[d]));
            tok[d][s] = (int32_t)((s * 7919 + 17) % (c->vocab_size - 3));
        }
    }
    free(buf);
    for (int step = 0; step <= steps; step++) { // step 0 warms up
        for (int d = 0; d < n; d++) {
            for (int s = 0; s < batch; s++)
                b[s] = (struct tdm_batch_seq){.tokens = &tok[d][s],
                                              .n_tokens = 1,
                                              .start_pos = ctx + step,
                                              .block_table = seqs[d][s].block_table,
                                              .prompt_len = ctx,
                                              .logits = TDM_LOGITS_LAST};
            double t0 = tdm_now();
            if (tdm_model_forward(m, kvs[d], b, batch, logits) != TDM_OK)
                die("forward", "long-context decode failed");
            double dt = tdm_now() - t0;
            if (step > 0 && dt < best[d])
                best[d] = dt;
            for (int s = 0; s < batch; s++)
                tok[d][s] = argmax(logits + (size_t)s * c->vocab_size, c->vocab_size);
        }
    }
    for (int d = 0; d < n; d++)
        for (int s = 0; s < batch; s++)
            tdm_kv_seq_release(kvs[d], &seqs[d][s]);
}

static double time_prefill(struct tdm_model *m, struct tdm_kv_cache *kv, int n, int reps,
                           float *logits)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    static int32_t ids[MAX_PREFILL];
    for (int i = 0; i < n; i++)
        ids[i] = (int32_t)((i * 7919 + 13) % (c->vocab_size - 3));
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        struct tdm_kv_seq seq;
        tdm_kv_seq_init(&seq);
        if (tdm_kv_reserve(kv, &seq, n) != TDM_OK)
            die("kv", "cache too small");
        // A prompt: its GEMMs take the prompt class's algorithm (model.h).
        struct tdm_batch_seq b = {.tokens = ids,
                                  .n_tokens = n,
                                  .start_pos = 0,
                                  .block_table = seq.block_table,
                                  .prompt_len = n,
                                  .logits = TDM_LOGITS_LAST};
        double t0 = tdm_now();
        if (tdm_model_forward(m, kv, &b, 1, logits) != TDM_OK)
            die("forward", "prefill failed");
        double dt = tdm_now() - t0;
        if (dt < best)
            best = dt;
        tdm_kv_seq_release(kv, &seq);
    }
    return best;
}

// Multiply-adds of one n-token prefill from position 0, counted as 2 FLOP each:
// every linear layer per token, q.k and p.v over the causal context, and the
// lm_head for the one row that wants logits.
static double prefill_flops(const struct tdm_model_config *c, int n)
{
    double hd = c->head_dim, h = c->hidden_size, in = c->intermediate_size;
    double q = c->num_attention_heads * hd, kv = c->num_key_value_heads * hd;
    double per_token = h * (q + 2 * kv) + q * h + 3 * h * in;
    double attn_pairs = (double)n * (n + 1) / 2; // (query, key) pairs
    double per_layer = 2 * per_token * n + 2 * 2 * q * attn_pairs;
    return per_layer * c->num_hidden_layers + 2 * h * c->vocab_size;
}

// The CPU time of this process's thread named `comm` (the engine's
// "tdm-engine"), in seconds, from its schedstat (nanoseconds on a CPU); -1
// when there is none.
static double thread_cpu_s(const char *comm)
{
    char path[300], name[64];
    DIR *dir = opendir("/proc/self/task");
    if (dir == NULL)
        return -1;
    double out = -1;
    struct dirent *ent;
    while ((ent = readdir(dir)) != NULL && out < 0) {
        if (ent->d_name[0] == '.')
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", ent->d_name);
        FILE *f = fopen(path, "r");
        if (f == NULL)
            continue;
        bool match = fgets(name, sizeof name, f) != NULL &&
                     strncmp(name, comm, strlen(comm)) == 0 &&
                     (name[strlen(comm)] == '\n' || name[strlen(comm)] == 0);
        fclose(f);
        if (!match)
            continue;
        snprintf(path, sizeof path, "/proc/self/task/%s/schedstat", ent->d_name);
        unsigned long long ns;
        if ((f = fopen(path, "r")) != NULL) {
            if (fscanf(f, "%llu", &ns) == 1)
                out = (double)ns / 1e9;
            fclose(f);
        }
    }
    closedir(dir);
    return out;
}

// The serving engine (tdm_engine: its own thread, scheduler, sampling,
// streams) decoding `batch` requests of PROMPT-token prompts sampled with
// Qwen2.5's generation_config (T 0.7, top_k 20, top_p 0.8, repetition 1.1;
// seeded, EOS ignored) for steps + 1 tokens each: the step is each stream's
// mean gap between its first and last token (the engine's own timestamps, one
// token a stream a step), averaged over the streams the last prompt step
// started (the others' gaps also hold that step). Those steps decode the
// positions time_decode times, and its mean is the reference: mean against
// mean at the same context (a longer run's attention would cost more, and a
// best step is below a mean by the machine's noise). The engine thread's CPU
// time (its schedstat) over the run is divided by the engine's steps and by
// the run's wall time.
// The engine's pool has the KV dtype of the forward it is compared with
// (the plan's --kv-cache-dtype; the engine's own default is f32).
static void time_engine_loop(struct tdm_model *m, enum tdm_kv_dtype kv_dtype, int batch, int steps,
                             struct result *r, int i)
{
    const struct tdm_model_config *c = tdm_model_config(m);
    int max_tokens = steps + 1;
    struct tdm_engine_config ec;
    tdm_engine_config_default(&ec);
    ec.num_blocks = batch * ((PROMPT + max_tokens + 15) / 16 + 1) + 8;
    ec.max_num_seqs = batch;
    // Every prompt in the first step as far as the model's token limit per
    // forward allows (the engine clamps the budget to it); the gaps timed are
    // those of the streams the last prompt step started (below).
    ec.max_num_batched_tokens = batch * PROMPT > PREFILL ? batch * PROMPT : PREFILL;
    ec.max_waiting = batch;
    ec.kv_dtype = kv_dtype;
    char err[512];
    struct tdm_engine *e = NULL;
    if (tdm_engine_new(&e, m, &ec, err, sizeof err) != TDM_OK)
        die("engine", err);
    r->loop_kv_dtype = tdm_engine_kv_dtype(e);
    struct tdm_engine_request *reqs[MAX_BATCH];
    static int32_t prompts[MAX_BATCH][PROMPT];
    struct tdm_engine_stats st0, st1;
    tdm_engine_get_stats(e, &st0);
    // The engine's thread names itself when it starts.
    double cpu0 = thread_cpu_s("tdm-engine");
    for (double until = tdm_now() + 2.0; cpu0 < 0 && tdm_now() < until; tdm_sleep(0.001))
        cpu0 = thread_cpu_s("tdm-engine");
    double t0 = tdm_now();
    for (int s = 0; s < batch; s++) {
        for (int t = 0; t < PROMPT; t++)
            prompts[s][t] = (int32_t)((s * 7919 + t * 104729 + 17) % (c->vocab_size - 3));
        struct tdm_engine_request_params p;
        tdm_engine_request_params_default(&p);
        p.id = "bench";
        p.prompt = prompts[s];
        p.n_prompt = PROMPT;
        p.max_tokens = max_tokens;
        p.sampling.temperature = 0.7f;
        p.sampling.top_k = 20;
        p.sampling.top_p = 0.8f;
        p.sampling.repetition_penalty = 1.1f;
        p.sampling.ignore_eos = true;
        p.sampling.has_seed = true;
        p.sampling.seed = (uint64_t)s + 1;
        if (tdm_engine_submit(e, &p, &reqs[s], err, sizeof err) != TDM_OK)
            die("engine submit", err);
    }
    static struct tdm_engine_times times[MAX_BATCH];
    for (int s = 0; s < batch; s++) {
        struct tdm_engine_chunk ch;
        do {
            if (tdm_engine_stream_next(reqs[s], 600.0, &ch) != TDM_OK)
                die("engine", "a stream stalled");
        } while (!ch.finished);
        if (ch.error != TDM_OK || ch.first_index + ch.n != max_tokens)
            die("engine", "a request did not finish with all its tokens");
        tdm_engine_request_times(reqs[s], &times[s]);
    }
    // The streams whose first token came from the last prompt step: their
    // gaps hold decode steps only (an earlier stream's also hold the later
    // prompt steps, when the prompts did not fit one step). A step stamps
    // its tokens with one time.
    double last_first = 0, gap_sum = 0;
    int n_gaps = 0;
    for (int s = 0; s < batch; s++)
        last_first = times[s].first_token > last_first ? times[s].first_token : last_first;
    for (int s = 0; s < batch; s++)
        if (times[s].first_token >= last_first) {
            gap_sum += (times[s].last_token - times[s].first_token) / (max_tokens - 1);
            n_gaps++;
        }
    double wall = tdm_now() - t0, cpu = thread_cpu_s("tdm-engine") - cpu0;
    // Stats settle at the engine's next loop, which comes promptly.
    do {
        tdm_sleep(0.001);
        tdm_engine_get_stats(e, &st1);
    } while (st1.num_running > 0);
    uint64_t engine_steps = st1.num_steps - st0.num_steps;
    r->loop_s[i] = gap_sum / n_gaps;
    r->loop_cpu_s[i] = cpu0 >= 0 && engine_steps > 0 ? cpu / (double)engine_steps : -1;
    r->loop_share[i] = cpu0 >= 0 ? cpu / wall : -1;
    r->loop_drawn[i] = st1.num_device_drawn_tokens;
    r->loop_steps[i] = engine_steps;
    r->loop_async[i] = st1.num_async_steps - st0.num_async_steps;
    r->loop_list[i] = st1.num_device_list_rows - st0.num_device_list_rows;
    for (int p = 0; p < TDM_ENGINE_PHASES; p++)
        r->loop_phase[i][p] =
            engine_steps > 0 ? (st1.phase_seconds[p] - st0.phase_seconds[p]) / (double)engine_steps
                             : -1;
    r->loop_tokens[i] = (unsigned long long)batch * (unsigned long long)max_tokens;
    for (int s = 0; s < batch; s++)
        tdm_engine_request_release(reqs[s]);
    tdm_engine_free(e);
}

static void run_mode(const char *dir, const struct tdm_model_opts *device,
                     enum tdm_weight_mode mode, int threads, int steps, const struct plan *pl,
                     bool weight_cache, struct result *r)
{
    int max_batch = 1, max_prefill = PREFILL;
    for (int i = 0; i < pl->n_batches; i++)
        max_batch = pl->batches[i] > max_batch ? pl->batches[i] : max_batch;
    for (int i = 0; i < pl->n_prefill; i++)
        max_prefill = pl->prefill[i] > max_prefill ? pl->prefill[i] : max_prefill;
    char err[512];
    struct tdm_model_opts o;
    struct tdm_model *m;
    tdm_model_opts_default(&o);
    o.backend = device->backend;
    o.device = device->device;
    o.enforce_eager = device->enforce_eager;
    o.batch_invariant = device->batch_invariant;
    o.weights = mode;
    o.num_threads = threads;
    o.max_batch_tokens = max_prefill;
    o.max_batch_seqs = max_batch < 32 ? 32 : max_batch;
    o.weight_cache_dir = weight_cache ? "auto" : NULL;
    if (tdm_model_load(&m, dir, &o, err, sizeof err) != TDM_OK)
        die("load", err);
    r->load = *tdm_model_load_info(m);
    snprintf(r->device, sizeof r->device, "%s", o.backend != NULL ? o.backend : "cpu");
    r->batch_invariant = tdm_model_opts(m)->batch_invariant == TDM_BATCH_INVARIANT_ON;
    const struct tdm_model_config *c = tdm_model_config(m);
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.dtype = pl->kv_dtype;
    kc.num_blocks = max_batch * ((PROMPT + steps + 2 + 15) / 16) + max_prefill / 16 + 8;
    struct tdm_kv_cache *kv;
    if (tdm_model_kv_new(m, &kc, &kv, err, sizeof err) != TDM_OK)
        die("kv", err);
    float *logits = malloc((size_t)o.max_batch_seqs * c->vocab_size * sizeof(float));
    if (logits == NULL)
        die("logits", "out of memory");

    r->weight_bytes = tdm_model_weight_bytes(m);
    r->kc = kc;
    for (int i = 0; i < pl->n_batches; i++)
        r->decode_s[i] = time_decode(m, kv, pl->batches[i], steps, logits, &r->decode_mean_s[i]);
    for (int i = 0; i < pl->n_prefill; i++) {
        r->prefill_s[i] = time_prefill(m, kv, pl->prefill[i], 2, logits);
        r->prefill_flops[i] = prefill_flops(c, pl->prefill[i]);
    }
    tdm_kv_free(kv);
    kv = NULL;
    if (mode == TDM_WEIGHTS_BF16 && pl->engine_loop)
        for (int i = 0; i < pl->n_batches; i++)
            time_engine_loop(m, pl->kv_dtype, pl->batches[i], steps, r, i);
    // Long context: a cache of each dtype just big enough for the largest batch.
    r->long_skip = NULL;
    if (strcmp(r->device, "cpu") != 0)
        r->long_skip = "the device backend chooses its own KV dtype (TANDEM_CUDA_KV_DTYPE)";
    else if (pl->long_ctx + steps + 2 > c->max_position_embeddings)
        r->long_skip = "the context exceeds the model's max_position_embeddings";
    if (mode == TDM_WEIGHTS_BF16 && pl->long_ctx > 0 && r->long_skip == NULL) {
        int lmax = 1;
        for (int i = 0; i < pl->n_long; i++)
            lmax = pl->long_batches[i] > lmax ? pl->long_batches[i] : lmax;
        struct tdm_kv_cache *kvs[N_KV_DTYPES];
        for (int d = 0; d < N_KV_DTYPES; d++) {
            struct tdm_kv_config lc = kc;
            lc.dtype = kv_dtypes[d];
            lc.num_blocks = lmax * ((pl->long_ctx + steps + 2 + 15) / 16);
            if (tdm_model_kv_new(m, &lc, &kvs[d], err, sizeof err) != TDM_OK)
                die("kv (long context)", err);
        }
        for (int i = 0; i < pl->n_long; i++) {
            double best[N_KV_DTYPES];
            time_long(m, kvs, N_KV_DTYPES, pl->long_batches[i], pl->long_ctx, steps, logits, best);
            for (int d = 0; d < N_KV_DTYPES; d++)
                r->long_s[d][i] = best[d];
        }
        // The short-context b1 step with either cache, alternating too: bf16
        // must not cost the bandwidth-bound step anything.
        time_long(m, kvs, N_KV_DTYPES, 1, PROMPT, steps, logits, r->short_s);
        for (int d = 0; d < N_KV_DTYPES; d++)
            tdm_kv_free(kvs[d]);
    }
    free(logits);
    tdm_model_free(m);
}

// KV capacity of --kv-cache-memory per KV cache dtype, in blocks and tokens
// (what a worker's pool holds: tdm_kv_block_bytes of the model's geometry).
static void print_capacity(const struct tdm_kv_config *geo, const struct plan *pl)
{
    struct tdm_kv_config kc = *geo;
    kc.num_blocks = 1;
    printf("\nKV capacity of --kv-cache-memory %zu MiB:", pl->kv_memory >> 20);
    size_t tokens0 = 0;
    for (int d = 0; d < N_KV_DTYPES; d++) {
        kc.dtype = kv_dtypes[d];
        size_t bb = tdm_kv_block_bytes(&kc);
        size_t blocks = bb ? pl->kv_memory / bb : 0;
        if (d == 0)
            tokens0 = blocks * 16;
        printf("  %s %zu blocks = %zu tokens (%zu bytes/token)", kv_dtype_names[d], blocks,
               blocks * 16, bb / 16);
        if (d > 0 && tokens0 > 0)
            printf(" = %.2fx %s", (double)(blocks * 16) / (double)tokens0, kv_dtype_names[0]);
    }
    printf("\n");
}

// Parses "1,8,32" into out[] (each in [lo, hi], at most MAX_POINTS); false when bad.
static bool parse_list(const char *s, int lo, int hi, int *out, int *n)
{
    *n = 0;
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < lo || v > hi || *n == MAX_POINTS || (*end != ',' && *end != '\0'))
            return false;
        out[(*n)++] = (int)v;
        s = *end == ',' ? end + 1 : end;
    }
    return *n > 0;
}

// Index of size in list, or -1.
static int find(const int *list, int n, int size)
{
    for (int i = 0; i < n; i++)
        if (list[i] == size)
            return i;
    return -1;
}

// The first mode's figures as JSON (bench/gpu/gpu_report.h reads it).
static int write_json(const char *path, const char *mode, size_t threads, const struct plan *pl,
                      const struct result *r)
{
    FILE *f = fopen(path, "w");
    if (f == NULL)
        return -1;
    fprintf(f,
            "{\"device\": \"%s\", \"weights\": \"%s\", \"threads\": %zu, \"weight_bytes\": "
            "%zu, \"batch_invariant\": %s, \"kv_cache_dtype\": \"%s\",\n",
            r->device, mode, threads, r->weight_bytes, r->batch_invariant ? "true" : "false",
            tdm_kv_dtype_name(pl->kv_dtype));
    fprintf(f, " \"decode\": [");
    for (int i = 0; i < pl->n_batches; i++)
        fprintf(f, "%s{\"batch\": %d, \"seconds\": %.9g}", i ? ", " : "", pl->batches[i],
                r->decode_s[i]);
    fprintf(f, "],\n \"prefill\": [");
    for (int i = 0; i < pl->n_prefill; i++)
        fprintf(f, "%s{\"tokens\": %d, \"seconds\": %.9g, \"flops\": %.9g}", i ? ", " : "",
                pl->prefill[i], r->prefill_s[i], r->prefill_flops[i]);
    fprintf(f, "]");
    if (pl->engine_loop) {
        fprintf(f, ",\n \"engine_loop_kv_cache_dtype\": \"%s\",\n \"engine_loop\": [",
                tdm_kv_dtype_name(r->loop_kv_dtype));
        for (int i = 0; i < pl->n_batches; i++)
            fprintf(f,
                    "%s{\"batch\": %d, \"seconds\": %.9g, \"engine_cpu_seconds\": %.9g, "
                    "\"engine_share\": %.6g, \"drawn_tokens\": %llu, \"tokens\": %llu, "
                    "\"steps\": %llu, \"async_steps\": %llu, \"list_rows\": %llu, "
                    "\"forward_mean_seconds\": %.9g}",
                    i ? ", " : "", pl->batches[i], r->loop_s[i], r->loop_cpu_s[i], r->loop_share[i],
                    r->loop_drawn[i], r->loop_tokens[i], r->loop_steps[i], r->loop_async[i],
                    r->loop_list[i], r->decode_mean_s[i]);
        fprintf(f, "]");
        // Each batch's engine-thread phases (seconds a step), in the same order.
        fprintf(f, ",\n \"engine_loop_phases\": [");
        for (int i = 0; i < pl->n_batches; i++) {
            fprintf(f, "%s{\"batch\": %d", i ? ", " : "", pl->batches[i]);
            for (int p = 0; p < TDM_ENGINE_PHASES; p++)
                fprintf(f, ", \"%s_seconds\": %.9g", tdm_engine_phase_name(p), r->loop_phase[i][p]);
            fprintf(f, "}");
        }
        fprintf(f, "]");
    }
    fprintf(f, "}\n");
    return fclose(f) == 0 ? 0 : -1;
}

struct bench_args {
    const char *dir;  // --model DIR; NULL = a generated model of Qwen2.5-0.5B's shape
    const char *json; // --json FILE
    const char *peer; // --peer FILE: bench/peer/llamacpp.sh's figures; NULL = none given
    const char *device; // --device cpu|cuda|cuda:N; NULL = auto
    bool enforce_eager; // --enforce-eager
    int batch_invariant; // --[no-]batch-invariant: enum tdm_batch_invariance; 0 = the default
    bool weight_cache;  // --[no-]weight-cache (default on)
    int threads, steps;
    bool bf16_only;
    struct plan pl; // --batches, --prefill
};

static int set_batches(void *o, const char *v, char *err, size_t errlen)
{
    struct plan *pl = &((struct bench_args *)o)->pl;
    if (!parse_list(v, 1, MAX_BATCH, pl->batches, &pl->n_batches))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--batches wants up to %d sizes in [1, %d], comma-separated", MAX_POINTS,
                          MAX_BATCH);
    return TDM_OK;
}

static int set_prefill(void *o, const char *v, char *err, size_t errlen)
{
    struct plan *pl = &((struct bench_args *)o)->pl;
    if (!parse_list(v, 1, MAX_PREFILL, pl->prefill, &pl->n_prefill))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--prefill wants up to %d lengths in [1, %d], comma-separated",
                          MAX_POINTS, MAX_PREFILL);
    return TDM_OK;
}

static int set_long_batches(void *o, const char *v, char *err, size_t errlen)
{
    struct plan *pl = &((struct bench_args *)o)->pl;
    if (!parse_list(v, 1, MAX_BATCH, pl->long_batches, &pl->n_long))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--long-batches wants up to %d sizes in [1, %d], comma-separated",
                          MAX_POINTS, MAX_BATCH);
    return TDM_OK;
}

static int set_kv_dtype(void *o, const char *v, char *err, size_t errlen)
{
    struct plan *pl = &((struct bench_args *)o)->pl;
    char e[200];
    if (tdm_kv_dtype_parse(v, &pl->kv_dtype, e, sizeof e) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "--kv-cache-dtype: %s", e);
    return TDM_OK;
}

// --batch-invariant / --no-batch-invariant (the workers' flags: model.h).
static int set_invariant(void *o, const char *v, bool negate, const char *flag, char *err,
                         size_t errlen)
{
    enum tdm_batch_invariance b;
    int rc = tdm_batch_invariance_parse(flag, negate, v, &b, err, errlen);
    if (rc == TDM_OK)
        ((struct bench_args *)o)->batch_invariant = b;
    return rc;
}

static int set_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return set_invariant(o, v, false, "batch-invariant", err, errlen);
}

static int set_no_batch_invariant(void *o, const char *v, char *err, size_t errlen)
{
    return set_invariant(o, v, true, "no-batch-invariant", err, errlen);
}

static const struct tdm_flag bench_flags[] = {
    {.name = "model",
     .kind = TDM_FLAG_PTR,
     .offset = offsetof(struct bench_args, dir),
     .metavar = "DIR",
     .help = "model folder (default: a generated model of Qwen2.5-0.5B's shape)"},
    {.name = "threads",
     .kind = TDM_FLAG_INT,
     .offset = offsetof(struct bench_args, threads),
     .min = 1,
     .max = 1024,
     .metavar = "N",
     .help = "compute threads (default 2)"},
    {.name = "steps",
     .kind = TDM_FLAG_INT,
     .offset = offsetof(struct bench_args, steps),
     .min = 1,
     .max = 48,
     .metavar = "N",
     .help = "decode steps measured (default 8)"},
    {.name = "bf16-only",
     .kind = TDM_FLAG_BOOL,
     .offset = offsetof(struct bench_args, bf16_only),
     .help = "skip the int8 weights"},
    {.name = "batches",
     .kind = TDM_FLAG_FN,
     .fn = set_batches,
     .metavar = "LIST",
     .help = "decode batch sizes, comma-separated (default 1,8,32)"},
    {.name = "prefill",
     .kind = TDM_FLAG_FN,
     .fn = set_prefill,
     .metavar = "LIST",
     .help = "prefill lengths in tokens, comma-separated (default 512)"},
    {.name = "long-context",
     .kind = TDM_FLAG_INT,
     .offset = offsetof(struct bench_args, pl.long_ctx),
     .min = 0,
     .max = 32768,
     .metavar = "N",
     .help = "decode at N tokens of context, per KV cache dtype (default 4096; 0 skips)"},
    {.name = "long-batches",
     .kind = TDM_FLAG_FN,
     .fn = set_long_batches,
     .metavar = "LIST",
     .help = "batch sizes decoded at --long-context (default 1,8)"},
    {.name = "kv-cache-memory",
     .kind = TDM_FLAG_BYTES,
     .offset = offsetof(struct bench_args, pl.kv_memory),
     .metavar = "BYTES",
     .help = "budget of the KV capacity line (default 256MiB, the workers' default)"},
    {.name = "kv-cache-dtype",
     .kind = TDM_FLAG_FN,
     .fn = set_kv_dtype,
     .metavar = "auto|bf16|f32",
     .help = "KV cache of the main table (default auto = bf16, the workers' default)"},
    {.name = "engine-loop",
     .kind = TDM_FLAG_BOOL,
     .offset = offsetof(struct bench_args, pl.engine_loop),
     .help = "also run the serving engine at each decode batch (Qwen2.5's sampling): its step "
             "/ the forward's, and the engine thread's CPU time per step"},
    {.name = "json",
     .kind = TDM_FLAG_PTR,
     .offset = offsetof(struct bench_args, json),
     .metavar = "FILE",
     .help = "also write the first mode's figures as JSON"},
    {.name = "peer",
     .kind = TDM_FLAG_PTR,
     .offset = offsetof(struct bench_args, peer),
     .metavar = "FILE",
     .help = "llama.cpp's figures on this machine (bench/peer/llamacpp.sh LLAMA_SRC writes\n"
             "build/peer/llamacpp.json): print them and Tandem's ratios to them"},
    {.name = "device",
     .kind = TDM_FLAG_PTR,
     .offset = offsetof(struct bench_args, device),
     .metavar = "cpu|cuda|cuda:N",
     .help = "where the model computes (default cuda when built with CUDA and a GPU is visible, "
             "else cpu); cuda runs bf16 only"},
    {.name = "enforce-eager",
     .kind = TDM_FLAG_BOOL,
     .offset = offsetof(struct bench_args, enforce_eager),
     .help = "no CUDA graphs for decode steps"},
    {.name = "batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_batch_invariant,
     .no_value = true,
     .help = "every GEMM on cuBLASLt, one algorithm per weight shape and row class (the "
             "default)"},
    {.name = "no-batch-invariant",
     .kind = TDM_FLAG_FN,
     .fn = set_no_batch_invariant,
     .no_value = true,
     .help = "on cuda: decode GEMMs of up to 16 rows on Tandem's split-K GEMV (check.sh "
             "measures both)"},
    {.name = "no-weight-cache",
     .kind = TDM_FLAG_NOT,
     .offset = offsetof(struct bench_args, weight_cache),
     .help = "pack the checkpoint at every load (default: the packed-weight cache,\n"
             "$TANDEM_CACHE/packed or ~/.cache/tandem/packed)"},
};
static const struct tdm_flags bench_table = {
    .usage = "usage: tandem-bench-engine [--model DIR] [--threads N] [--steps N] [--bf16-only] "
             "[--batches LIST] [--prefill LIST] [--json FILE] [--device cpu|cuda|cuda:N]\n"
             "       [--enforce-eager] [--kv-cache-dtype auto|bf16|f32] [--long-context N] "
             "[--long-batches LIST] [--kv-cache-memory BYTES] [--no-weight-cache]\n"
             "       [--engine-loop] [--batch-invariant | --no-batch-invariant] [--peer FILE]\n",
    .flags = bench_flags,
    .n = sizeof bench_flags / sizeof bench_flags[0],
};

int main(int argc, char **argv)
{
    struct bench_args a = {
        .threads = 2,
        .steps = 8,
        .weight_cache = true,
        .pl = {.batches = {1, 8, 32},
               .n_batches = 3,
               .prefill = {PREFILL},
               .n_prefill = 1,
               .long_ctx = 4096,
               .long_batches = {1, 8},
               .n_long = 2,
               .kv_memory = (size_t)256 << 20,
               .kv_dtype = TDM_KV_BF16},
    };
    int exit_code = 0;
    if (tdm_flags_main(&bench_table, &a, argc, argv, NULL, 0, NULL, "tandem-bench-engine",
                       &exit_code))
        return exit_code;
    const char *dir = a.dir, *json = a.json;
    int threads = a.threads, steps = a.steps;
    bool bf16_only = a.bf16_only;
    struct plan pl = a.pl;
    char err[512];
    struct tdm_bench_peer peer;
    if (a.peer != NULL && tdm_bench_peer_load(&peer, a.peer, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-bench-engine: --peer %s\n", err);
        return 2;
    }
    struct tdm_model_opts dev_opts;
    tdm_model_opts_default(&dev_opts);
    dev_opts.enforce_eager = a.enforce_eager;
    dev_opts.batch_invariant = (enum tdm_batch_invariance)a.batch_invariant;
    if (tdm_model_opts_set_device(&dev_opts, a.device, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-bench-engine: %s\n", err);
        return 2;
    }
    if (strcmp(dev_opts.backend, "cpu") != 0)
        bf16_only = true; // int8 weight-only is CPU-only
    tdm_log_set_level_name("warn");

    struct stat sb;
    char cfg_path[1024];
    if (dir == NULL) {
        dir = TANDEM_BENCH_MODEL_DIR;
        snprintf(cfg_path, sizeof cfg_path, "%s/model.safetensors", dir);
        if (stat(cfg_path, &sb) != 0) {
            struct tdm_mkmodel_spec s;
            tdm_mkmodel_preset(&s, "qwen2.5-0.5b");
            printf("writing the qwen2.5-0.5b-shaped random model to %s ...\n", dir);
            fflush(stdout);
            if (tdm_mkmodel_write(&s, dir, err, sizeof err) != TDM_OK)
                die("mkmodel", err);
        }
    }

    // The machine is shared: probe before and after the model runs and keep the
    // best of each limit, so a disturbed probe cannot flatter the ratios.
    double bw = tdm_cpu_probe_read_bw((size_t)1 << 30, threads, 3);
    double fma = tdm_cpu_probe_fma_peak(threads);
    double bf16_peak = tdm_cpu_probe_bf16_peak(threads);
    static const char *const names[2] = {"bf16", "int8"};
    struct result res[2];
    int nmodes = bf16_only ? 1 : 2;
    for (int mode = 0; mode < nmodes; mode++)
        run_mode(dir, &dev_opts, mode == 0 ? TDM_WEIGHTS_BF16 : TDM_WEIGHTS_INT8, threads, steps,
                 &pl, a.weight_cache, &res[mode]);
    double bw2 = tdm_cpu_probe_read_bw((size_t)1 << 30, threads, 3);
    double fma2 = tdm_cpu_probe_fma_peak(threads);
    double bf16_peak2 = tdm_cpu_probe_bf16_peak(threads);
    bw = bw2 > bw ? bw2 : bw;
    fma = fma2 > fma ? fma2 : fma;
    bf16_peak = bf16_peak2 > bf16_peak ? bf16_peak2 : bf16_peak;

    printf("model %s, %d threads, KV cache %s, batch invariant %s\n", dir, threads,
           tdm_kv_dtype_name(pl.kv_dtype), res[0].batch_invariant ? "on" : "off");
    // Which kernels computed each mode's matmuls (the same for every batch
    // size and the prefill: the CPU backend never picks a path by n).
    const char *paths[2] = {res[0].device, res[nmodes - 1].device};
    enum tdm_cpu_isa isa = TDM_CPU_ISA_PORTABLE;
    if (strcmp(res[0].device, "cpu") == 0 && tdm_cpu_isa_default(&isa, err, sizeof err) == TDM_OK) {
        paths[0] = tdm_cpu_isa_matmul_path(isa, TDM_W_BF16);
        paths[1] = tdm_cpu_isa_matmul_path(isa, TDM_W_Q8);
        printf("cpu isa %s: matmuls of bf16 weights on %s, of int8 weights on %s (every row "
               "below)\n",
               tdm_cpu_isa_name(isa), paths[0], paths[1]);
    }
    printf("machine (best of 2 probes): read %.2f GB/s, f32 FMA peak %.1f GFLOP/s, bf16 dot "
           "peak %.1f GFLOP/s\n\n",
           bw / 1e9, fma / 1e9, bf16_peak / 1e9);
    int i1 = find(pl.batches, pl.n_batches, 1), i8 = find(pl.batches, pl.n_batches, 8);
    int i32 = find(pl.batches, pl.n_batches, 32), ip = find(pl.prefill, pl.n_prefill, PREFILL);
    if (i1 >= 0 && i8 >= 0 && i32 >= 0 && ip >= 0) {
        printf("%-5s %8s %8s %7s %8s %8s %9s %6s %6s %9s %7s %7s  %s\n", "mode", "weights",
               "b1 step", "b1/read", "b1 tok/s", "b8 tok/s", "b32 tok/s", "b8/b1", "b32/b1",
               "pf tok/s", "pf/FMA", "pf/bf16", "matmul path");
        for (int mode = 0; mode < nmodes; mode++) {
            const struct result *r = &res[mode];
            double read_s = (double)r->weight_bytes / bw;
            double b1 = 1.0 / r->decode_s[i1], b8 = 8.0 / r->decode_s[i8];
            double b32 = 32.0 / r->decode_s[i32];
            double pf = r->prefill_flops[ip] / r->prefill_s[ip];
            printf("%-5s %6.0fMB %6.1fms %7.2f %8.1f %8.1f %9.1f %6.2f %6.2f %9.1f %7.3f %7.3f  "
                   "%s\n",
                   names[mode], r->weight_bytes / 1e6, r->decode_s[i1] * 1e3,
                   r->decode_s[i1] / read_s, b1, b8, b32, b8 / b1, b32 / b1,
                   PREFILL / r->prefill_s[ip], pf / fma, bf16_peak > 0 ? pf / bf16_peak : 0.0,
                   paths[mode]);
        }
    } else {
        for (int mode = 0; mode < nmodes; mode++) {
            const struct result *r = &res[mode];
            for (int i = 0; i < pl.n_batches; i++)
                printf("%-5s decode batch %-4d %9.2f ms/step %10.1f tok/s  [%s]\n", names[mode],
                       pl.batches[i], r->decode_s[i] * 1e3, pl.batches[i] / r->decode_s[i],
                       paths[mode]);
            for (int i = 0; i < pl.n_prefill; i++)
                printf("%-5s prefill %-4d      %9.2f ms      %10.1f tok/s %7.3f of FMA peak  "
                       "[%s]\n",
                       names[mode], pl.prefill[i], r->prefill_s[i] * 1e3,
                       pl.prefill[i] / r->prefill_s[i], r->prefill_flops[i] / r->prefill_s[i] / fma,
                       paths[mode]);
        }
    }
    // Load time against one read of the checkpoint at the probed bandwidth:
    // packing costs several reads, a weight-cache hit about one (verification).
    for (int mode = 0; mode < nmodes; mode++) {
        const struct tdm_model_load_info *li = &res[mode].load;
        double read_s = (double)li->checkpoint_bytes / bw;
        printf("%-5s load %.3f s (weight cache %s%s), checkpoint %.0f MB read once %.3f s: "
               "load/read %.1f\n",
               names[mode], li->seconds, tdm_weight_cache_use_name(li->weight_cache),
               li->cache_write_seconds > 0 ? ", entry written" : "", li->checkpoint_bytes / 1e6,
               read_s, li->seconds / read_s);
    }
    if (pl.long_ctx > 0 && res[0].long_skip != NULL) {
        printf("\ndecode at %d tokens of context: not measured (%s)\n", pl.long_ctx,
               res[0].long_skip);
    } else if (pl.long_ctx > 0) {
        printf("\ndecode at %d tokens of context (bf16 weights), by KV cache dtype:\n",
               pl.long_ctx);
        for (int i = 0; i < pl.n_long; i++) {
            printf("  batch %-3d", pl.long_batches[i]);
            for (int d = 0; d < N_KV_DTYPES; d++)
                printf("  %s %8.1f tok/s (%6.1f ms/step)", kv_dtype_names[d],
                       pl.long_batches[i] / res[0].long_s[d][i], res[0].long_s[d][i] * 1e3);
            for (int d = 1; d < N_KV_DTYPES; d++)
                printf("  %s/%s %.2f", kv_dtype_names[d], kv_dtype_names[0],
                       res[0].long_s[0][i] / res[0].long_s[d][i]);
            printf("\n");
        }
        printf("  b1 at %d tokens: f32 %6.1f ms/step, bf16 %6.1f ms/step, bf16/f32 %.2f (b1 "
               "step / weight read with bf16: %.2f)\n",
               PROMPT, res[0].short_s[0] * 1e3, res[0].short_s[1] * 1e3,
               res[0].short_s[0] / res[0].short_s[1],
               res[0].short_s[1] / ((double)res[0].weight_bytes / bw));
    }
    if (pl.engine_loop) {
        printf("\nengine loop (%s weights, KV cache %s; Qwen2.5's sampling: T 0.7, top_k 20, top_p "
               "0.8, repetition 1.1), by decode batch:\n",
               names[0], tdm_kv_dtype_name(res[0].loop_kv_dtype));
        for (int i = 0; i < pl.n_batches; i++) {
            const struct result *r = &res[0];
            printf("  batch %-4d step %8.2f ms  forward alone (mean) %8.2f ms  loop/forward %5.2f  "
                   "engine thread CPU %7.2f ms/step (%.2f of the wall)  drawn on the device "
                   "%llu of %llu tokens (%llu from device lists)  issued ahead %llu of %llu "
                   "steps\n",
                   pl.batches[i], r->loop_s[i] * 1e3, r->decode_mean_s[i] * 1e3,
                   r->loop_s[i] / r->decode_mean_s[i], r->loop_cpu_s[i] * 1e3, r->loop_share[i],
                   r->loop_drawn[i], r->loop_tokens[i], r->loop_list[i], r->loop_async[i],
                   r->loop_steps[i]);
            printf("             engine thread per step (prompt steps included):");
            for (int p = 0; p < TDM_ENGINE_PHASES; p++)
                printf(" %s %.3f ms", tdm_engine_phase_name(p), r->loop_phase[i][p] * 1e3);
            printf("\n");
        }
    }
    print_capacity(&res[0].kc, &pl);
    if (json != NULL && write_json(json, names[0], (size_t)threads, &pl, &res[0]) != 0) {
        fprintf(stderr, "tandem-bench-engine: --json %s: cannot write\n", json);
        return 1;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    // The goals, each with this run's figure of the first mode (bf16) and a
    // verdict: batch 1 at most 1.10 x one read of the weights and b32/b1 at
    // least 16 (issue 30), prefill at least 1.4 x the f32 FMA peak (issue 26's
    // CPU bar), bf16 KV at least 1.3 x f32 at long context where decode is
    // bound by the KV reads (the largest --long-batches here), KV capacity 2x.
    printf("\ngoals (%s, this run):", names[0]);
    if (i1 >= 0) {
        double v = res[0].decode_s[i1] / ((double)res[0].weight_bytes / bw);
        printf(" b1/read %.2f <= 1.10: %s;", v, v <= 1.10 ? "met" : "MISSED");
    }
    if (i1 >= 0 && i32 >= 0) {
        double v = 32.0 * res[0].decode_s[i1] / res[0].decode_s[i32];
        printf(" b32/b1 %.2f >= 16: %s;", v, v >= 16 ? "met" : "MISSED");
    }
    if (ip >= 0) {
        double v = res[0].prefill_flops[ip] / res[0].prefill_s[ip] / fma;
        printf(" pf/FMA %.2f >= 1.4 (prefill of %d tokens): %s;", v, PREFILL,
               v >= 1.4 ? "met" : "MISSED");
    }
    if (pl.long_ctx > 0 && res[0].long_skip == NULL && pl.n_long > 0) {
        int i = pl.n_long - 1;
        double v = res[0].long_s[0][i] / res[0].long_s[1][i];
        printf(" long context bf16/f32 %.2f >= 1.3 (batch %d at %d tokens; KV-bound batches): "
               "%s;",
               v, pl.long_batches[i], pl.long_ctx, v >= 1.3 ? "met" : "MISSED");
    }
    printf(" KV capacity bf16 = 2x f32 (above)\n");
    // Tandem's side of the peer ratios: bf16 and int8 at batch 1 and prefill-512.
    struct tdm_bench_peer_tandem mine = {0};
    if (i1 >= 0) {
        mine.bf16_b1 = 1.0 / res[0].decode_s[i1];
        mine.int8_b1 = nmodes > 1 ? 1.0 / res[1].decode_s[i1] : 0;
    }
    if (ip >= 0) {
        mine.bf16_prefill512 = PREFILL / res[0].prefill_s[ip];
        mine.int8_prefill512 = nmodes > 1 ? PREFILL / res[1].prefill_s[ip] : 0;
    }
    char peer_lines[640];
    tdm_bench_peer_format(a.peer != NULL ? &peer : NULL, &mine, peer_lines, sizeof peer_lines);
    fputs(peer_lines, stdout);
    printf("peak RSS %.0f MB\n", ru.ru_maxrss / 1024.0);
    return 0;
}
