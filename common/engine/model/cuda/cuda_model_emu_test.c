// SPDX-License-Identifier: Apache-2.0
// The whole CUDA backend (cuda_backend.c's host code, the kernels, the KV
// storage in "device" memory) on the execution-model emulator, driven by the
// real model code (model.c) on tiny random models from mkmodel, against the
// CPU backend:
//   - greedy tokens equal the CPU backend's, and so does the argmax of every
//     logits row of a second prefill chunk (at offset 150 or 21) and of 12
//     decode steps: a 270-token prompt on the tiny preset (head_dim 16) with
//     f32 KV (decode at positions 270 to 281: 9 flash-decoding splits), and
//     45-token prompts (2 splits) with bf16 KV (the product default) and on
//     a Qwen2-style model with head_dim 64 and GQA 7 (7 query heads, 1 KV
//     head);
//   - batch invariance: two sequences in one forward get bitwise the logits
//     they get alone;
//   - KV export/import through the storage interface: export from the device
//     pool equals the CPU pool's export of the same prefill (within f32
//     rounding), and a sequence imported into a fresh device cache continues
//     with the same greedy tokens;
//   - clean errors: int8 weights on cuda, a host KV cache handed to a cuda model.
// The GEMM is the emulated device API's loop (cuBLASLt itself runs only on a
// GPU: cuda_ops_gpu_test).
//
// Built twice: cuda_model_emu_test (the emulator, label unit) and, with
// TANDEM_CUDA, cuda_model_gpu_test (TDM_CUDA_TEST_GPU: the real backend
// loaded as "cuda" from its module, libtandem-cuda.so; label gpu, exit 77
// without a GPU), where the same comparisons also check cuBLASLt's GEMM and
// its batch invariance.
// The device-flag and memory-arithmetic tests assume the emulator's one
// pretend 1 GiB device and run on it only; the GPU build adds the 0.5B shape
// vs the CPU backend and batch-of-32 invariance (too slow to emulate).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_skip.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "backend.h"
#include "core.h"
#include "cpu_backend.h"
#include "cuda_backend.h"
#include "kv_cache.h"
#include "mkmodel.h"
#include "model.h"
#include "sample_draw.h"
#include "sampling.h"

static char tiny_dir[64], gqa7_dir[64];

#define MAX_PROMPT 270
#define STEPS 12

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    strcpy(tiny_dir, "/tmp/tdm_cuda_tinyXXXXXX");
    strcpy(gqa7_dir, "/tmp/tdm_cuda_gqa7XXXXXX");
    if (mkdtemp(tiny_dir) == NULL || mkdtemp(gqa7_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    s.seed = 11;
    if (tdm_mkmodel_write(&s, tiny_dir, err, sizeof err) != TDM_OK)
        goto fail;
    tdm_mkmodel_preset(&s, "tiny");
    s.hidden_size = 7 * 64;
    s.num_heads = 7;
    s.num_kv_heads = 1;
    s.head_dim = 64;
    s.intermediate_size = 256;
    s.seed = 12;
    if (tdm_mkmodel_write(&s, gqa7_dir, err, sizeof err) != TDM_OK)
        goto fail;
#ifdef TDM_CUDA_TEST_GPU
    return 0;
#else
    return tdm_backend_register(&tdm_cuda_emu_backend_ops) == TDM_OK ? 0 : -1;
#endif
fail:
    fprintf(stderr, "mkmodel: %s\n", err);
    return -1;
}

static int teardown(void **state)
{
    (void)state;
    tdm_mkmodel_remove(tiny_dir);
    tdm_mkmodel_remove(gqa7_dir);
    return 0;
}

static struct tdm_model *load_mode(const char *dir, const char *backend, const char *kv_dtype,
                                   bool eager, enum tdm_batch_invariance bi)
{
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.backend = backend;
    o.enforce_eager = eager;
    o.batch_invariant = bi;
    o.num_threads = 1;
    o.max_batch_tokens = 256;
    o.max_batch_seqs = 4;
    setenv("TANDEM_CUDA_KV_DTYPE", kv_dtype, 1);
    int rc = tdm_model_load(&m, dir, &o, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("load %s on %s: %s", dir, backend, err);
    return m;
}

static struct tdm_model *load_opts(const char *dir, const char *backend, const char *kv_dtype,
                                   bool eager)
{
    return load_mode(dir, backend, kv_dtype, eager, TDM_BATCH_INVARIANT_DEFAULT);
}

static struct tdm_model *load(const char *dir, const char *backend, const char *kv_dtype)
{
    return load_opts(dir, backend, kv_dtype, false);
}

static struct tdm_kv_cache *new_kv(struct tdm_model *m)
{
    struct tdm_kv_config kc;
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = 64;
    if (tdm_model_kv_new(m, &kc, &kv, err, sizeof err) != TDM_OK)
        fail_msg("kv: %s", err);
    return kv;
}

static void make_prompt(int32_t *ids, int n, int vocab, uint32_t seed)
{
    for (int i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        ids[i] = (int32_t)((seed >> 8) % (uint32_t)(vocab - 3));
    }
}

static int argmax(const float *x, int n)
{
    int b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    return b;
}

// One forward of n tokens of one sequence at pos, of a request whose prompt
// is prompt_len tokens (its rows below it prompt rows; 0: all decode rows);
// the last row's logits (all n rows' with `all`) into out.
static void step_in(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                    int32_t *hist, int pos, int n, float *out, bool all, int prompt_len)
{
    assert_int_equal(tdm_kv_reserve(kv, seq, pos + n), TDM_OK);
    struct tdm_batch_seq b = {.tokens = hist + pos,
                              .n_tokens = n,
                              .start_pos = pos,
                              .block_table = seq->block_table,
                              .prompt_len = prompt_len,
                              .logits = all ? TDM_LOGITS_ALL : TDM_LOGITS_LAST};
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, out), TDM_OK);
    tdm_kv_commit(kv, seq, hist, pos + n);
}

static void step_mode(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                      int32_t *hist, int pos, int n, float *out, bool all)
{
    step_in(m, kv, seq, hist, pos, n, out, all, 0);
}

static void step(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                 int32_t *hist, int pos, int n, float *out)
{
    step_mode(m, kv, seq, hist, pos, n, out, false);
}

// Prefill in two chunks (logits of every row of the second) then greedy
// decode, the prompt's rows marked as such (on a GPU: the prompt class's GEMM
// algorithm, then the decode class's); hist gets the STEPS + 1 new tokens
// after the prompt, logits [prompt - chunk1 + STEPS][vocab]: the second
// chunk's rows, then each step's.
static void greedy(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                   int32_t *hist, int prompt, int chunk1, float *logits)
{
    int vocab = tdm_model_config(m)->vocab_size, n2 = prompt - chunk1;
    step_in(m, kv, seq, hist, 0, chunk1, logits, false, prompt);
    step_in(m, kv, seq, hist, chunk1, n2, logits, true, prompt);
    hist[prompt] = argmax(logits + (size_t)(n2 - 1) * vocab, vocab);
    for (int s = 0; s < STEPS; s++) {
        float *row = logits + (size_t)(n2 + s) * vocab;
        step_in(m, kv, seq, hist, prompt + s, 1, row, false, prompt);
        hist[prompt + s + 1] = argmax(row, vocab);
    }
}

// The CPU reference computes attention in f32, as the CUDA kernels do: on an
// AMX host, whose best path runs attention on bf16 tiles (q, K, V and the
// softmax weights rounded; docs/cpu-backend.md), the reference models take
// the AVX-512 path (matmul activations rounded to bf16 as there, f32
// attention). TANDEM_CPU_ISA, where set, still chooses.
static void cpu_reference_path(void)
{
    if (getenv("TANDEM_CPU_ISA") == NULL && tdm_cpu_isa_best() == TDM_CPU_ISA_AMX)
        setenv("TANDEM_CPU_ISA", "avx512", 1);
}

// Whether the CPU backend's bf16 matmuls round activations to bf16 as the
// CUDA kernels do (cuBLASLt takes bf16 operands): the AVX-512 path does
// (vdpbf16ps); the AVX2 and portable paths keep activations in f32, so on a
// host without AVX-512 BF16 (Zen 3, say) the two backends differ by that
// rounding: KV values by ~1e-2, logits by ~1e-2, enough to flip a near tie.
static bool cpu_rounds_like_gpu(void)
{
    enum tdm_cpu_isa isa = tdm_cpu_isa_best();
    const char *force = getenv("TANDEM_CPU_ISA");
    if (force && tdm_cpu_isa_parse(force, &isa) != TDM_OK)
        isa = tdm_cpu_isa_best();
    return isa == TDM_CPU_ISA_AVX512 || isa == TDM_CPU_ISA_AMX;
}

// The CPU's and the emulated CUDA backend's greedy tokens, and the argmax of
// every logits row (the next token at each position of the second chunk and
// each step) must agree, except near-ties: rows where the CPU's logits of the
// two picks are within tie_tol (0 with f32 KV: no exception; bf16 KV rounds
// the cache the CPU keeps in f32, which moves logits by up to ~0.1 here).
// On a host whose CPU path keeps activations in f32 (cpu_rounds_like_gpu false)
// the tolerance is bf16 KV's (0.25) whatever the KV dtype, and a near-tie flip
// in a row that picks a generated token ends the comparison there: from the
// next step on, the two backends decode different histories. Every logit of
// the rows compared is within TDM_LOGIT_DIFF_BOUND of the CPU's.
#define TDM_LOGIT_DIFF_BOUND 0.25f
static void compare_greedy_mode(const char *dir, const char *kv_dtype, int prompt, int chunk1,
                                float tie_tol, enum tdm_batch_invariance bi)
{
    bool strict = cpu_rounds_like_gpu();
    if (!strict && tie_tol < 0.25f)
        tie_tol = 0.25f;
    struct tdm_model *mc = load(dir, "cpu", kv_dtype);
    struct tdm_model *mg = load_mode(dir, "cuda", kv_dtype, false, bi);
    int vocab = tdm_model_config(mc)->vocab_size;
    struct tdm_kv_cache *kc = new_kv(mc), *kg = new_kv(mg);
    int32_t hc[MAX_PROMPT + STEPS + 1], hg[MAX_PROMPT + STEPS + 1];
    make_prompt(hc, prompt, vocab, 5);
    memcpy(hg, hc, sizeof hc);
    int rows = prompt - chunk1 + STEPS;
    size_t nl = (size_t)rows * vocab;
    float *lc = malloc(nl * sizeof *lc), *lg = malloc(nl * sizeof *lg);
    struct tdm_kv_seq sc, sg;
    tdm_kv_seq_init(&sc);
    tdm_kv_seq_init(&sg);
    greedy(mc, kc, &sc, hc, prompt, chunk1, lc);
    greedy(mg, kg, &sg, hg, prompt, chunk1, lg);
    float worst = 0.0f, scale = 0.0f;
    for (size_t i = 0; i < nl; i++)
        scale = fabsf(lc[i]) > scale ? fabsf(lc[i]) : scale;
    int distinct = 0, ties = 0, prev = -1, same_tokens = STEPS + 1;
    for (int r = 0; r < rows; r++) {
        const float *rc = lc + (size_t)r * vocab;
        int a = argmax(rc, vocab), b = argmax(lg + (size_t)r * vocab, vocab);
        for (int i = 0; i < vocab; i++) // rows of the same history only
            worst = fabsf(rc[i] - lg[(size_t)r * vocab + i]) > worst
                        ? fabsf(rc[i] - lg[(size_t)r * vocab + i])
                        : worst;
        if (a != b) {
            if (!(rc[a] - rc[b] <= tie_tol))
                fail_msg("row %d: cpu picks %d, cuda %d (cpu logits %g vs %g)", r, a, b, rc[a],
                         rc[b]);
            ties++;
            if (!strict && r >= prompt - chunk1 - 1) { // row r picks token r - (n2 - 1)
                same_tokens = r - (prompt - chunk1 - 1);
                break;
            }
        }
        distinct += a != prev;
        prev = a;
    }
    printf("%s kv %s%s, prompt %d: max |logit diff| %g (max |logit| %g); %d rows, %d argmax "
           "changes, %d near-tie flips%s; generated:",
           dir, kv_dtype, bi == TDM_BATCH_INVARIANT_OFF ? ", --no-batch-invariant" : "", prompt,
           worst, scale, rows, distinct, ties,
           strict ? "" : " (CPU path without bf16 activations: compared up to the first flip)");
    for (int i = prompt; i <= prompt + STEPS; i++)
        printf(" %d", hg[i]);
    printf("\n");
    // The random models pick the same token step after step, so the argmax
    // alone would miss a wrong decode GEMM: every logit of the rows compared
    // is within TDM_LOGIT_DIFF_BOUND too (measured 0.03 to 0.08 either mode).
    assert_true(worst <= TDM_LOGIT_DIFF_BOUND);
    if (same_tokens > 0)
        assert_memory_equal(hc + prompt, hg + prompt, (size_t)same_tokens * sizeof(int32_t));
    tdm_kv_seq_release(kc, &sc);
    tdm_kv_seq_release(kg, &sg);
    free(lc), free(lg);
    tdm_kv_free(kc), tdm_kv_free(kg);
    tdm_model_free(mc), tdm_model_free(mg);
}

static void compare_greedy(const char *dir, const char *kv_dtype, int prompt, int chunk1,
                           float tie_tol)
{
    compare_greedy_mode(dir, kv_dtype, prompt, chunk1, tie_tol, TDM_BATCH_INVARIANT_DEFAULT);
}

static void test_greedy_tiny_f32(void **state)
{
    (void)state;
    // Decode past position 256: two flash-decoding splits.
    compare_greedy(tiny_dir, "f32", MAX_PROMPT, 150, 0.0f);
}

static void test_greedy_tiny_bf16(void **state)
{
    (void)state;
    compare_greedy(tiny_dir, "bf16", 45, 21, 0.25f);
}

static void test_greedy_gqa7_f32(void **state)
{
    (void)state;
    compare_greedy(gqa7_dir, "f32", 45, 21, 0.0f);
}

static void test_greedy_gqa7_bf16(void **state)
{
    (void)state;
    compare_greedy(gqa7_dir, "bf16", 45, 21, 0.25f);
}

// The fast mode (--no-batch-invariant: decode steps' GEMMs on the GEMV,
// prefill chunks' on the GEMM) against the CPU backend by the same rules:
// greedy tokens equal, every row's argmax equal but near-ties (f32 KV: none
// allowed where the CPU rounds activations as the GPU does).
static void test_greedy_fast(void **state)
{
    (void)state;
    compare_greedy_mode(tiny_dir, "f32", MAX_PROMPT, 150, 0.0f, TDM_BATCH_INVARIANT_OFF);
    compare_greedy_mode(gqa7_dir, "f32", 45, 21, 0.0f, TDM_BATCH_INVARIANT_OFF);
    compare_greedy_mode(gqa7_dir, "bf16", 45, 21, 0.25f, TDM_BATCH_INVARIANT_OFF);
}

// Two sequences (a 40-token prefill and a decode at position 20) in one
// forward get bitwise the logits they get alone: the prompt rows on the prompt
// class's GEMM algorithm and the decode row on the decode class's in both (in
// one step, a GEMM a class: the decode row's at an offset of 40 rows).
static void test_batch_invariance(void **state)
{
    (void)state;
    struct tdm_model *m = load(gqa7_dir, "cuda", "bf16");
    int vocab = tdm_model_config(m)->vocab_size;
    int32_t a[64], b[64];
    make_prompt(a, 40, vocab, 1);
    make_prompt(b, 21, vocab, 2);
    float *alone = malloc(2 * (size_t)vocab * sizeof(float));
    float *both = malloc(2 * (size_t)vocab * sizeof(float));
    for (int round = 0; round < 2; round++) {
        struct tdm_kv_cache *kv = new_kv(m);
        struct tdm_kv_seq sa, sb;
        tdm_kv_seq_init(&sa);
        tdm_kv_seq_init(&sb);
        // b's first 20 tokens are in the cache before the measured step.
        float scratch[4096];
        assert_true(vocab <= 4096);
        step(m, kv, &sb, b, 0, 20, scratch);
        assert_int_equal(tdm_kv_reserve(kv, &sa, 40), TDM_OK);
        assert_int_equal(tdm_kv_reserve(kv, &sb, 21), TDM_OK);
        struct tdm_batch_seq bs[2] = {
            {.tokens = a,
             .n_tokens = 40,
             .start_pos = 0,
             .block_table = sa.block_table,
             .prompt_len = 40,
             .logits = TDM_LOGITS_LAST},
            {.tokens = b + 20,
             .n_tokens = 1,
             .start_pos = 20,
             .block_table = sb.block_table,
             .prompt_len = 20,
             .logits = TDM_LOGITS_LAST},
        };
        if (round == 0) {
            assert_int_equal(tdm_model_forward(m, kv, &bs[0], 1, alone), TDM_OK);
            assert_int_equal(tdm_model_forward(m, kv, &bs[1], 1, alone + vocab), TDM_OK);
        } else {
            assert_int_equal(tdm_model_forward(m, kv, bs, 2, both), TDM_OK);
        }
        tdm_kv_seq_release(kv, &sa);
        tdm_kv_seq_release(kv, &sb);
        tdm_kv_free(kv);
    }
    assert_memory_equal(alone, both, 2 * (size_t)vocab * sizeof(float));
    free(alone), free(both);
    tdm_model_free(m);
}

// The fast mode's batch invariance, as far as it goes: 16 sequences decoding
// one token each in one step (every GEMM on the GEMV) get bitwise the logits
// each gets alone; one of them decoding in a step with a 20-token prefill
// whose rows all want logits (21 rows: every GEMM, the head's included, on
// cuBLASLt, the emulator's loop here) does not, which is what
// --no-batch-invariant gives up. (With only the last rows' logits the head
// runs on the GEMV in both, and the layers' few-ulp differences rarely
// survive the bf16 rounding of the head's input: the logits came out equal.)
static void test_batch_invariance_fast(void **state)
{
    (void)state;
    enum { NS = 16 }; // the GEMV's most rows (TDM_CUK_GEMV_MAX_N)
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.backend = "cuda";
    o.enforce_eager = true;
    o.batch_invariant = TDM_BATCH_INVARIANT_OFF;
    o.num_threads = 1;
    o.max_batch_tokens = 256;
    o.max_batch_seqs = NS + 1;
    setenv("TANDEM_CUDA_KV_DTYPE", "bf16", 1);
    if (tdm_model_load(&m, gqa7_dir, &o, err, sizeof err) != TDM_OK)
        fail_msg("load: %s", err);
    assert_int_equal(tdm_model_opts(m)->batch_invariant, TDM_BATCH_INVARIANT_OFF);
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = 2 * (NS + 1) + 4;
    struct tdm_kv_cache *kv = NULL;
    assert_int_equal(tdm_model_kv_new(m, &kc, &kv, err, sizeof err), TDM_OK);
    static int32_t h[NS + 1][32];
    struct tdm_kv_seq sq[NS + 1];
    float *alone = malloc((size_t)NS * vocab * sizeof(float));
    float *both = malloc((size_t)(NS + 21) * vocab * sizeof(float));
    struct tdm_batch_seq b[NS + 1], pre[NS];
    for (int s = 0; s <= NS; s++) {
        int len = s < NS ? 4 + s : 20;
        make_prompt(h[s], len + 1, vocab, 60 + (uint32_t)s);
        tdm_kv_seq_init(&sq[s]);
        if (s < NS) { // the decoders' prompts go into the cache first, in one forward
            assert_int_equal(tdm_kv_reserve(kv, &sq[s], len + 1), TDM_OK);
            pre[s] = (struct tdm_batch_seq){.tokens = h[s],
                                            .n_tokens = len,
                                            .start_pos = 0,
                                            .block_table = sq[s].block_table,
                                            .logits = TDM_LOGITS_NONE};
            b[s] = (struct tdm_batch_seq){.tokens = h[s] + len,
                                          .n_tokens = 1,
                                          .start_pos = len,
                                          .block_table = sq[s].block_table,
                                          .logits = TDM_LOGITS_LAST};
        } else {
            assert_int_equal(tdm_kv_reserve(kv, &sq[s], len), TDM_OK);
            b[s] = (struct tdm_batch_seq){.tokens = h[s],
                                          .n_tokens = len,
                                          .start_pos = 0,
                                          .block_table = sq[s].block_table,
                                          .logits = TDM_LOGITS_LAST};
        }
    }
    assert_int_equal(tdm_model_forward(m, kv, pre, NS, both), TDM_OK);
    // (Rewriting a position's KV with the same values each time.)
    for (int s = 0; s < NS; s++)
        assert_int_equal(tdm_model_forward(m, kv, &b[s], 1, alone + (size_t)s * vocab), TDM_OK);
    assert_int_equal(tdm_model_forward(m, kv, b, NS, both), TDM_OK);
    assert_memory_equal(both, alone, (size_t)NS * vocab * sizeof(float));
    // Sequence 0 beside a prefill: 21 rows, past the GEMV.
    struct tdm_batch_seq mixed[2] = {b[0], b[NS]};
    mixed[1].logits = TDM_LOGITS_ALL; // the head too: 21 rows
    assert_int_equal(tdm_model_forward(m, kv, mixed, 2, both), TDM_OK);
    float worst = 0.0f;
    for (int i = 0; i < vocab; i++)
        worst = fabsf(both[i] - alone[i]) > worst ? fabsf(both[i] - alone[i]) : worst;
    printf("--no-batch-invariant: 16 decodes together = each alone, bitwise; a decode beside a "
           "20-token prefill differs from it alone by up to %g\n",
           worst);
    assert_true(memcmp(both, alone, (size_t)vocab * sizeof(float)) != 0);
    for (int s = 0; s <= NS; s++)
        tdm_kv_seq_release(kv, &sq[s]);
    tdm_kv_free(kv);
    free(alone), free(both);
    tdm_model_free(m);
}

// Export from the device pool vs the CPU pool after the same prefill; import
// into a fresh device cache continues with the same greedy tokens.
static void test_export_import(void **state)
{
    (void)state;
    struct tdm_model *mc = load(tiny_dir, "cpu", "f32"), *mg = load(tiny_dir, "cuda", "f32");
    int vocab = tdm_model_config(mc)->vocab_size, layers = tdm_model_config(mc)->num_hidden_layers;
    int n = 37;
    struct tdm_kv_cache *kc = new_kv(mc), *kg = new_kv(mg), *kg2 = new_kv(mg);
    int32_t h[64], h2[64];
    make_prompt(h, n, vocab, 3);
    float *l = malloc(8 * (size_t)vocab * sizeof(float));
    struct tdm_kv_seq sc, sg, sg2;
    tdm_kv_seq_init(&sc), tdm_kv_seq_init(&sg), tdm_kv_seq_init(&sg2);
    step(mc, kc, &sc, h, 0, n, l);
    step(mg, kg, &sg, h, 0, n, l);
    int nb = sg.num_blocks;
    size_t bytes = tdm_kv_layer_bytes(kg, nb);
    float *ec = malloc(bytes), *eg = malloc(bytes);
    assert_int_equal(tdm_kv_reserve(kg2, &sg2, n), TDM_OK);
    float worst = 0.0f;
    for (int layer = 0; layer < layers; layer++) {
        assert_int_equal(tdm_kv_export_layer(kc, &sc, layer, 0, nb, ec, bytes), TDM_OK);
        assert_int_equal(tdm_kv_export_layer(kg, &sg, layer, 0, nb, eg, bytes), TDM_OK);
        // Positions past the prompt are never written: compare the prompt's rows only.
        size_t per_block = bytes / sizeof(float) / 2 / (size_t)nb; // heads * 16 * head_dim
        size_t row = per_block / 16 / (size_t)tdm_model_config(mc)->num_key_value_heads;
        for (size_t i = 0; i < bytes / sizeof(float); i++) {
            size_t in_block = i % per_block, blk = (i / per_block) % (size_t)nb;
            size_t slot = (in_block / row) % 16;
            if (blk * 16 + slot >= (size_t)n)
                continue;
            float e = fabsf(ec[i] - eg[i]);
            worst = e > worst ? e : worst;
        }
        assert_int_equal(tdm_kv_import_layer(kg2, &sg2, layer, 0, nb, eg, bytes), TDM_OK);
    }
    // f32 KV: equal but for summation order where the CPU rounds activations as
    // the GPU does; within bf16 rounding of the activations elsewhere.
    bool strict = cpu_rounds_like_gpu();
    printf("export cpu vs cuda(emu): max |kv diff| %g (bound %g)\n", worst, strict ? 1e-4 : 5e-2);
    assert_true(worst < (strict ? 1e-4f : 5e-2f));
    tdm_kv_commit(kg2, &sg2, h, n);
    h[n] = argmax(l, vocab);
    memcpy(h2, h, sizeof h);
    for (int s = 0; s < 6; s++) {
        step(mg, kg, &sg, h, n + s, 1, l);
        h[n + s + 1] = argmax(l, vocab);
        step(mg, kg2, &sg2, h2, n + s, 1, l + vocab);
        h2[n + s + 1] = argmax(l + vocab, vocab);
        assert_memory_equal(l, l + vocab, (size_t)vocab * sizeof(float));
    }
    assert_memory_equal(h, h2, sizeof h);
    tdm_kv_seq_release(kc, &sc), tdm_kv_seq_release(kg, &sg), tdm_kv_seq_release(kg2, &sg2);
    tdm_kv_free(kc), tdm_kv_free(kg), tdm_kv_free(kg2);
    free(ec), free(eg), free(l);
    tdm_model_free(mc), tdm_model_free(mg);
}

// The emulator's own tests (not registered in the GPU variant, whose device
// and memory are real). --device with the emulated CUDA backend registered:
// one GPU visible.
#ifndef TDM_CUDA_TEST_GPU
// The emulator's deferred mode (the device runs behind the host: work runs
// only when something waits for it) and its launch log: emu/cuda_emu_api.h.
#include "emu/cuda_emu_api.h"

// Launches of one eager batch-1 decode step of a model with `layers` layers
// (tiny preset otherwise) in batch invariance mode bi; the log's entries into
// out.
static size_t decode_step_launches(int layers, enum tdm_batch_invariance bi,
                                   struct tdm_emu_launch *out, size_t cap)
{
    char dir[64], err[256];
    strcpy(dir, "/tmp/tdm_cuda_launchXXXXXX");
    assert_non_null(mkdtemp(dir));
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    s.num_layers = layers;
    s.seed = 31;
    assert_int_equal(tdm_mkmodel_write(&s, dir, err, sizeof err), TDM_OK);
    struct tdm_model *m = load_mode(dir, "cuda", "bf16", true, bi);
    struct tdm_kv_cache *kv = new_kv(m);
    int vocab = tdm_model_config(m)->vocab_size;
    int32_t h[16];
    make_prompt(h, 9, vocab, 4);
    float *l = malloc((size_t)vocab * sizeof(float));
    struct tdm_kv_seq q;
    tdm_kv_seq_init(&q);
    step(m, kv, &q, h, 0, 8, l);
    tdm_emu_launch_log(1);
    step(m, kv, &q, h, 8, 1, l);
    size_t n = tdm_emu_launches(out, cap);
    tdm_emu_launch_log(0);
    tdm_kv_seq_release(kv, &q);
    tdm_kv_free(kv);
    free(l);
    tdm_model_free(m);
    tdm_mkmodel_remove(dir);
    return n;
}

// Issue 26 item 2's rule for the decode attention at batch 1, on Qwen2.5-0.5B's
// attention (14 query heads, 2 KV heads, head_dim 64, bf16 KV, blocks of 16):
// at least as many CTAs as an H200 has SMs from TDM_ATTN_FILL_CONTEXT context
// tokens on, in one launch. A CTA serves one KV head's GQA group over a fixed
// split of 32 keys (TDM_CUK_DECODE_PART), so batch 1 runs 2 x ceil(L / 32)
// CTAs: 2 at 32 tokens, 64 at 1 024, and 132 from L = 32 x 65 + 1 = 2 081.
// 132 at 1 024 tokens would take splits of at most 15 keys, whose f32
// partials (7 heads x 66 floats a split) would be nearly half the bytes of
// the KV they summarise (docs/gpu-backend.md, decode attention). The kernel
// before (splits of 256 keys, a combine launch past one) ran 2 x 9 = 18 CTAs
// and a combine launch of 14 at 2 081 tokens: this test failed on it.
#define TDM_ATTN_FILL_CONTEXT 2081
#define TDM_H200_SMS 132

// The launches of one layer's attention of a batch-1 decode at `context`
// tokens with the 0.5B attention shape, through the emulated backend's ops as
// a decode step calls them (begin_forward, then rope_store_attention).
static size_t attention_launches(int context, struct tdm_emu_launch *out, size_t cap)
{
    enum { NH = 14, NKV = 2, HD = 64, QKV = (NH + 2 * NKV) * HD };
    const struct tdm_backend_ops *ops = &tdm_cuda_emu_backend_ops;
    struct tdm_backend *be = NULL;
    char err[256];
    setenv("TANDEM_CUDA_KV_DTYPE", "bf16", 1);
    if (ops->create(&be, 1, 0, err, sizeof err) != TDM_OK)
        fail_msg("cuda-emu backend: %s", err);
    struct tdm_kv_config kc = {.num_layers = 1,
                               .num_kv_heads = NKV,
                               .head_dim = HD,
                               .block_size = 16,
                               .num_blocks = (context + 15) / 16};
    struct tdm_kv_storage *st = NULL;
    struct tdm_kv_cache *kv = NULL;
    if (ops->kv_storage_new(be, &kc, &st, err, sizeof err) != TDM_OK ||
        tdm_kv_new_with_storage(&kv, &kc, st, err, sizeof err) != TDM_OK)
        fail_msg("kv: %s", err);
    struct tdm_kv_seq s;
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_reserve(kv, &s, context), TDM_OK);
    struct tdm_attn_seq a = {
        .row = 0, .n_tokens = 1, .start_pos = context - 1, .block_table = s.block_table};
    float inv_freq[HD / 2];
    for (int i = 0; i < HD / 2; i++)
        inv_freq[i] = (float)(1.0 / pow(1000000.0, (double)(2 * i) / HD));
    int32_t pos = context - 1;
    float *qkv = ops->alloc(be, QKV * sizeof(float)), *d_freq = ops->alloc(be, sizeof inv_freq);
    int32_t *d_pos = ops->alloc(be, sizeof pos);
    void *o = ops->alloc(be, NH * HD * sizeof(uint16_t));
    assert_true(qkv && d_freq && d_pos && o);
    assert_int_equal(ops->upload(be, d_freq, inv_freq, sizeof inv_freq), TDM_OK);
    assert_int_equal(ops->upload(be, d_pos, &pos, sizeof pos), TDM_OK);
    assert_int_equal(ops->begin_forward(be, kv, &a, 1), TDM_OK);
    tdm_emu_launch_log(1);
    ops->rope_store_attention(be, kv, 0, &a, 1, qkv, QKV, d_pos, d_freq, o, NH, NKV, HD,
                              1.0f / sqrtf((float)HD));
    size_t n = tdm_emu_launches(out, cap);
    tdm_emu_launch_log(0);
    assert_int_equal(ops->sync(be), TDM_OK);
    ops->release(be, qkv), ops->release(be, d_freq), ops->release(be, d_pos), ops->release(be, o);
    tdm_kv_seq_release(kv, &s);
    tdm_kv_free(kv);
    ops->destroy(be);
    return n;
}

// Issue 26 item 6, the launch budget of a batch-1 decode step on the emulated
// backend: launches per layer (from a 1- and a 3-layer model, so the step's
// embed and head cancel out), GEMMs included, and each kernel's CTA count
// against an H100/H200's 132 SMs. At most 8 launches a layer (item 4's
// fusions: 17 before them): add + RMSNorm with a bf16 output, the four GEMMs
// on bf16 inputs, RoPE + KV store + decode attention in one kernel (its
// combine only past one split), SiLU-mul with a bf16 output. In both modes:
// batch invariant (the GEMMs on cuBLASLt, whose grids its heuristic picks)
// and --no-batch-invariant (on the GEMV, one launch each: its CTAs are the
// tiny model's, 1 to 32; the 0.5B shape's are in cuda_ops_test's
// test_gemv_ctas, 224 to 9 496).
#define TDM_LAUNCHES_PER_LAYER_GOAL 8
static void launch_budget(enum tdm_batch_invariance bi)
{
    enum { CAP = 256 };
    struct tdm_emu_launch one[CAP], three[CAP];
    size_t n1 = decode_step_launches(1, bi, one, CAP), n3 = decode_step_launches(3, bi, three, CAP);
    assert_true(n1 <= CAP && n3 <= CAP && n3 > n1 && (n3 - n1) % 2 == 0);
    size_t per_layer = (n3 - n1) / 2, outside = n1 - per_layer;
    bool fast = bi == TDM_BATCH_INVARIANT_OFF;
    printf("batch-1 decode step%s: %zu launches per layer, %zu outside the layers "
           "(goal <= %d a layer: %s)\n",
           fast ? " (--no-batch-invariant)" : "", per_layer, outside, TDM_LAUNCHES_PER_LAYER_GOAL,
           per_layer <= TDM_LAUNCHES_PER_LAYER_GOAL ? "met" : "MISSED");
    size_t small = 0, gemms = 0, gemvs = 0;
    for (size_t i = 0; i < n1; i++) {
        bool gemm = strcmp(one[i].name, "gemm") == 0;
        bool gemv = strstr(one[i].name, "gemv_kernel") != NULL;
        gemms += gemm;
        gemvs += gemv;
        if (gemm)
            printf("  %-40.40s cuBLASLt: the grid of its heuristic\n", one[i].name);
        else
            printf("  %-40.40s %6llu CTAs%s\n", one[i].name, one[i].ctas,
                   one[i].ctas < 132 ? " (< 132 SMs)" : "");
        small += !gemm && one[i].ctas < 132;
    }
    printf("kernels on fewer CTAs than an H200 has SMs: %zu of %zu launches (batch 1)\n", small,
           n1);
    assert_true(per_layer <= TDM_LAUNCHES_PER_LAYER_GOAL);
    // The 1-layer step's GEMMs: qkv, o, gate_up, down and the head.
    assert_int_equal(fast ? gemvs : gemms, 5);
    assert_int_equal(fast ? gemms : gemvs, 0);
}

static void test_launch_budget(void **state)
{
    (void)state;
    launch_budget(TDM_BATCH_INVARIANT_DEFAULT);
    launch_budget(TDM_BATCH_INVARIANT_OFF);

    // Decode attention at batch 1, Qwen2.5-0.5B's attention shape (the rule above).
    enum { CAP = 256 };
    struct tdm_emu_launch one[CAP];
    const int contexts[] = {32, 1024, TDM_ATTN_FILL_CONTEXT - 1, TDM_ATTN_FILL_CONTEXT};
    unsigned long long fill_ctas = 0;
    for (size_t i = 0; i < sizeof contexts / sizeof contexts[0]; i++) {
        size_t n = attention_launches(contexts[i], one, CAP);
        unsigned long long ctas = 0;
        for (size_t j = 0; j < n && j < CAP; j++)
            ctas += one[j].ctas;
        printf("0.5B attention, batch 1, %4d tokens: %zu launch%s, %llu CTAs%s\n", contexts[i], n,
               n == 1 ? "" : "es", ctas, ctas < TDM_H200_SMS ? " (< 132 SMs)" : "");
        assert_int_equal(n, 1); // RoPE, KV store, the splits and their merge
        if (contexts[i] == TDM_ATTN_FILL_CONTEXT)
            fill_ctas = ctas;
    }
    assert_true(fill_ctas >= TDM_H200_SMS);
}

// ---- GEMM classes -------------------------------------------------------------------------------
// Issue 26 item 5: prompt rows (positions below their sequence's prompt_len)
// take the prompt class's GEMM algorithm, every other row the decode class's,
// whatever the step's make-up. The emulator's GEMM is one loop for both, so
// the launch log (its "gemm" and "gemm_prompt" entries and their rows) tells
// which class each GEMM asked for.

// The GEMMs of a launch log, by class: how many, and the rows of each.
struct gemm_tally {
    int prompt, decode; // GEMMs of each class
    int prompt_n[64];   // rows of each prompt-class GEMM, in launch order
    int decode_n[64];   // rows of each decode-class GEMM
    int other;          // kernel launches
    int gemv;           // of them, the fast mode's GEMV
};

static struct gemm_tally tally_forward(struct tdm_model *m, struct tdm_kv_cache *kv,
                                       const struct tdm_batch_seq *b, int n_seqs, float *logits)
{
    enum { CAP = 512 };
    static struct tdm_emu_launch log[CAP];
    tdm_emu_launch_log(1);
    assert_int_equal(tdm_model_forward(m, kv, b, n_seqs, logits), TDM_OK);
    size_t n = tdm_emu_launches(log, CAP);
    tdm_emu_launch_log(0);
    assert_true(n <= CAP);
    struct gemm_tally t = {0};
    for (size_t i = 0; i < n; i++) {
        if (strcmp(log[i].name, "gemm_prompt") == 0) {
            assert_true(t.prompt < 64);
            t.prompt_n[t.prompt++] = log[i].gemm_n;
        } else if (strcmp(log[i].name, "gemm") == 0) {
            assert_true(t.decode < 64);
            t.decode_n[t.decode++] = log[i].gemm_n;
        } else {
            t.other++;
            t.gemv += strstr(log[i].name, "gemv_kernel") != NULL;
        }
    }
    return t;
}

static struct tdm_batch_seq seq_chunk(int32_t *h, struct tdm_kv_seq *q, int pos, int n,
                                      int prompt_len, enum tdm_logits_mode lm)
{
    return (struct tdm_batch_seq){.tokens = h + pos,
                                  .n_tokens = n,
                                  .start_pos = pos,
                                  .block_table = q->block_table,
                                  .prompt_len = prompt_len,
                                  .logits = lm};
}

// Every GEMM of the tally's first `count` of a class has n rows.
static void assert_rows(const int *got, int count, int n)
{
    for (int i = 0; i < count; i++)
        assert_int_equal(got[i], n);
}

static void test_gemm_classes(void **state)
{
    (void)state;
    struct tdm_model *m = load(tiny_dir, "cuda", "bf16"); // graphs on
    int vocab = tdm_model_config(m)->vocab_size, L = tdm_model_config(m)->num_hidden_layers;
    assert_true(4 * L + 1 <= 64);
    struct tdm_kv_cache *kv = new_kv(m);
    static int32_t a[64], b[64], c[64];
    make_prompt(a, 40, vocab, 71);
    make_prompt(b, 40, vocab, 72);
    make_prompt(c, 40, vocab, 73);
    struct tdm_kv_seq sa, sb, sc;
    tdm_kv_seq_init(&sa), tdm_kv_seq_init(&sb), tdm_kv_seq_init(&sc);
    assert_int_equal(tdm_kv_reserve(kv, &sa, 40), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &sb, 40), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &sc, 40), TDM_OK);
    float *l1 = malloc(32 * (size_t)vocab * sizeof(float));
    float *l2 = malloc(32 * (size_t)vocab * sizeof(float));

    // A prompt chunk alone: its layers' GEMMs are prompt class; the head's
    // row is decode class (the head is, for every row).
    struct tdm_batch_seq q = seq_chunk(a, &sa, 0, 20, 20, TDM_LOGITS_LAST);
    struct gemm_tally t = tally_forward(m, kv, &q, 1, l1);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 20);
    assert_int_equal(t.decode, 1);
    assert_rows(t.decode_n, 1, 1);

    // A's decodes (positions 20 ..): decode class only, and as graphs (a
    // replayed step launches nothing the log sees).
    unsigned long long graphs0 = tdm_emu_graph_launches();
    for (int pos = 20; pos < 24; pos++) {
        q = seq_chunk(a, &sa, pos, 1, 20, TDM_LOGITS_LAST);
        t = tally_forward(m, kv, &q, 1, l1);
        assert_int_equal(t.prompt, 0);
    }
    assert_true(tdm_emu_graph_launches() > graphs0); // bucket 1's graph exists

    // A decode beside a prompt chunk: a GEMM a class per layer GEMM, the
    // decode row's numbers bitwise its numbers alone (x and y offset).
    q = seq_chunk(a, &sa, 24, 1, 20, TDM_LOGITS_LAST);
    assert_int_equal(tdm_model_forward(m, kv, &q, 1, l1), TDM_OK);
    struct tdm_batch_seq mixed[2] = {q, seq_chunk(b, &sb, 0, 12, 30, TDM_LOGITS_NONE)};
    t = tally_forward(m, kv, mixed, 2, l2);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 12);
    assert_int_equal(t.decode, 4 * L + 1);
    assert_rows(t.decode_n, t.decode, 1);
    assert_memory_equal(l1, l2, (size_t)vocab * sizeof(float));

    // The rest of B's prompt, its last token a chunk of its own: that row is
    // still a prompt row (not a graph of decode GEMMs, though it decodes one
    // token at the end of its sequence as a decode does).
    q = seq_chunk(b, &sb, 12, 17, 30, TDM_LOGITS_NONE);
    t = tally_forward(m, kv, &q, 1, NULL);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 17);
    graphs0 = tdm_emu_graph_launches();
    q = seq_chunk(b, &sb, 29, 1, 30, TDM_LOGITS_LAST);
    t = tally_forward(m, kv, &q, 1, l1);
    assert_int_equal(tdm_emu_graph_launches(), graphs0);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 1);
    assert_int_equal(t.decode, 1);

    // A chunk that runs past its prompt (a preempted request's recompute of
    // its 20 prompt tokens and 5 generated ones): 20 prompt rows, 5 decode
    // rows, every row's logits bitwise those of the chunk run as one class
    // (the emulator's loop is one: the runs' offsets are what is checked).
    q = seq_chunk(c, &sc, 0, 25, 20, TDM_LOGITS_ALL);
    t = tally_forward(m, kv, &q, 1, l1);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 20);
    assert_int_equal(t.decode, 4 * L + 1);
    assert_rows(t.decode_n, 4 * L, 5);
    assert_int_equal(t.decode_n[4 * L], 25); // the head: all 25 rows
    q.prompt_len = 0;                        // every row a decode row: one GEMM each
    t = tally_forward(m, kv, &q, 1, l2);
    assert_int_equal(t.prompt, 0);
    assert_int_equal(t.decode, 4 * L + 1);
    assert_memory_equal(l1, l2, 25 * (size_t)vocab * sizeof(float));

    tdm_kv_seq_release(kv, &sa), tdm_kv_seq_release(kv, &sb), tdm_kv_seq_release(kv, &sc);
    tdm_kv_free(kv);
    tdm_model_free(m);

    // --no-batch-invariant: the GEMV takes decode runs of up to 16 rows, never
    // prompt rows (a prompt row's numbers do not depend on its chunk's length
    // in either mode).
    m = load_mode(tiny_dir, "cuda", "bf16", true, TDM_BATCH_INVARIANT_OFF);
    kv = new_kv(m);
    tdm_kv_seq_init(&sa), tdm_kv_seq_init(&sb);
    assert_int_equal(tdm_kv_reserve(kv, &sa, 40), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &sb, 40), TDM_OK);
    q = seq_chunk(a, &sa, 0, 20, 20, TDM_LOGITS_NONE);
    assert_int_equal(tdm_model_forward(m, kv, &q, 1, NULL), TDM_OK);
    struct tdm_batch_seq fast[2] = {seq_chunk(a, &sa, 20, 1, 20, TDM_LOGITS_LAST),
                                    seq_chunk(b, &sb, 0, 3, 30, TDM_LOGITS_NONE)};
    t = tally_forward(m, kv, fast, 2, l1);
    assert_int_equal(t.prompt, 4 * L);
    assert_rows(t.prompt_n, t.prompt, 3);
    assert_int_equal(t.decode, 0);
    assert_int_equal(t.gemv, 4 * L + 1);
    tdm_kv_seq_release(kv, &sa), tdm_kv_seq_release(kv, &sb);
    tdm_kv_free(kv);
    tdm_model_free(m);
    free(l1), free(l2);
}

// A decode-only step whose rows say their prompt length issues the launches
// of one that does not (no prompt-class GEMM, no launch more): the launch
// budget's step with prompt_len set, against the same step without.
static void test_gemm_classes_decode_launches(void **state)
{
    (void)state;
    enum { CAP = 256 };
    struct tdm_model *m = load_opts(tiny_dir, "cuda", "bf16", true);
    int vocab = tdm_model_config(m)->vocab_size;
    static struct tdm_emu_launch with[CAP], without[CAP];
    size_t n[2];
    for (int round = 0; round < 2; round++) {
        struct tdm_kv_cache *kv = new_kv(m);
        int32_t h[16];
        make_prompt(h, 9, vocab, 4);
        float *l = malloc((size_t)vocab * sizeof(float));
        struct tdm_kv_seq q;
        tdm_kv_seq_init(&q);
        assert_int_equal(tdm_kv_reserve(kv, &q, 9), TDM_OK);
        struct tdm_batch_seq pre = seq_chunk(h, &q, 0, 8, 8, TDM_LOGITS_LAST);
        assert_int_equal(tdm_model_forward(m, kv, &pre, 1, l), TDM_OK);
        struct tdm_batch_seq dec = seq_chunk(h, &q, 8, 1, round == 0 ? 8 : 0, TDM_LOGITS_LAST);
        tdm_emu_launch_log(1);
        assert_int_equal(tdm_model_forward(m, kv, &dec, 1, l), TDM_OK);
        n[round] = tdm_emu_launches(round == 0 ? with : without, CAP);
        tdm_emu_launch_log(0);
        tdm_kv_seq_release(kv, &q);
        tdm_kv_free(kv);
        free(l);
    }
    assert_true(n[0] <= CAP);
    assert_int_equal(n[0], n[1]);
    for (size_t i = 0; i < n[0]; i++) {
        assert_string_equal(with[i].name, without[i].name);
        assert_true(with[i].ctas == without[i].ctas && with[i].gemm_n == without[i].gemm_n);
        assert_true(strcmp(with[i].name, "gemm_prompt") != 0);
    }
    tdm_model_free(m);
}

// What a push hook sees during a prefill forward on a device that runs behind
// the host (issue 25, item 4): at layer l's hook, the storage exports layer l-1
// as a prefill job sending over nng does, waits for it as a CUDA IPC or NCCL
// lessee does, and imports another sequence's blocks as a KV receive thread
// does; none of these may wait for the layers the engine issued after l-1's
// stores (the old export ran on the engine's stream and synced it: on a GPU
// the whole prefill came first), and the export must still see l-1's writes
// (it waits for the layer's mark on the device).
struct defer_probe {
    struct tdm_kv_cache *kv;
    const int *blocks, *blocks2;
    int nb;
    size_t floats; // of one layer's export
    float *got;    // [layers][floats]
    const float *ref;
    unsigned long long pending_export[16], pending_wait[16], pending_import[16];
    int rc;
};

static void defer_hook(void *arg, int layer)
{
    struct defer_probe *p = arg;
    if (layer == 0)
        return;
    int l = layer - 1;
    // The export first: nothing else has run the engine's queue up to l-1 yet.
    p->rc |= tdm_kv_read_blocks(p->kv, l, p->blocks, p->nb, TDM_KV_F32, p->got + l * p->floats);
    p->pending_export[l] = tdm_emu_pending(NULL);
    p->rc |= tdm_kv_wait_layer(p->kv, l);
    p->pending_wait[l] = tdm_emu_pending(NULL);
    // The reference KV of layer l into the second sequence's blocks.
    struct tdm_kv_storage *st = tdm_kv_storage(p->kv);
    const float *k = p->ref + l * p->floats, *v = k + p->floats / 2;
    p->rc |= st->ops->import_blocks(st, l, p->blocks2, p->nb, k, v);
    p->pending_import[l] = tdm_emu_pending(NULL);
}

static void test_deferred_export_overlaps(void **state)
{
    (void)state;
    struct tdm_model *m = load(tiny_dir, "cuda", "f32");
    int vocab = tdm_model_config(m)->vocab_size, layers = tdm_model_config(m)->num_hidden_layers;
    assert_true(layers >= 2 && layers <= 16);
    int n = 37;
    int32_t h[64];
    make_prompt(h, n, vocab, 9);
    float *logits = malloc((size_t)vocab * sizeof(float));
    // The reference: the same prefill, run as issued, exported afterwards.
    struct tdm_kv_cache *kref = new_kv(m), *kv = new_kv(m);
    struct tdm_kv_seq sref, s, s2;
    tdm_kv_seq_init(&sref), tdm_kv_seq_init(&s), tdm_kv_seq_init(&s2);
    step(m, kref, &sref, h, 0, n, logits);
    int nb = sref.num_blocks;
    size_t bytes = tdm_kv_layer_bytes_as(kref, nb, TDM_KV_F32), floats = bytes / sizeof(float);
    float *ref = malloc(bytes * (size_t)layers), *got = calloc((size_t)layers, bytes);
    for (int l = 0; l < layers; l++)
        assert_int_equal(
            tdm_kv_read_blocks(kref, l, sref.block_table, nb, TDM_KV_F32, ref + l * floats),
            TDM_OK);

    assert_int_equal(tdm_kv_reserve(kv, &s, n), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &s2, n), TDM_OK);
    struct defer_probe p = {.kv = kv,
                            .blocks = s.block_table,
                            .blocks2 = s2.block_table,
                            .nb = nb,
                            .floats = floats,
                            .got = got,
                            .ref = ref};
    struct tdm_batch_seq b = {.tokens = h,
                              .n_tokens = n,
                              .start_pos = 0,
                              .block_table = s.block_table,
                              .logits = TDM_LOGITS_LAST,
                              .on_layer = defer_hook,
                              .layer_arg = &p};
    tdm_emu_defer(1);
    int rc = tdm_model_forward(m, kv, &b, 1, logits);
    tdm_emu_defer(0);
    assert_int_equal(rc, TDM_OK);
    assert_int_equal(p.rc, TDM_OK);
    assert_int_equal(tdm_emu_pending(NULL), 0); // the forward's logits copy ran it all
    for (int l = 0; l < layers - 1; l++) {
        printf("layer %d: engine work still queued after wait %llu, export %llu, import %llu\n", l,
               p.pending_wait[l], p.pending_export[l], p.pending_import[l]);
        // Layer l's attention and MLP and layer l+1's first kernels were
        // issued before the hook and had not run: nothing waited for them.
        assert_true(p.pending_wait[l] > 0);
        assert_true(p.pending_export[l] > 0);
        assert_true(p.pending_import[l] > 0);
        assert_memory_equal(got + l * floats, ref + l * floats, bytes);
    }
    // The imports landed: the second sequence's blocks hold the reference KV.
    for (int l = 0; l < layers - 1; l++) {
        assert_int_equal(
            tdm_kv_read_blocks(kv, l, s2.block_table, nb, TDM_KV_F32, got + l * floats), TDM_OK);
        assert_memory_equal(got + l * floats, ref + l * floats, bytes);
    }
    tdm_kv_seq_release(kref, &sref), tdm_kv_seq_release(kv, &s), tdm_kv_seq_release(kv, &s2);
    tdm_kv_free(kref), tdm_kv_free(kv);
    free(ref), free(got), free(logits);
    tdm_model_free(m);
}

// Issue 26 item 1: a step is one round trip between the host and the device.
// What a forward sends (token ids, positions, the attention metadata, the
// draws' parameters, adjustments, masks and logprob rows) goes through pinned
// staging without a wait; what comes back (logits rows, or the chosen ids and
// logprobs) comes at its end, in one wait. On the emulator's deferred device
// (nothing runs until the host waits, so every staged copy runs after the
// host issued the whole step) the logits and tokens equal those of a
// reference run as issued: no staging is reused before the device read it.
static void test_host_waits(void **state)
{
    (void)state;
    struct tdm_model *mg = load(tiny_dir, "cuda", "bf16");
    struct tdm_model *me = load_opts(tiny_dir, "cuda", "bf16", true);
    int vocab = tdm_model_config(mg)->vocab_size;
    size_t words = ((size_t)vocab + 31) / 32;
    struct tdm_kv_cache *kg = new_kv(mg), *ke = new_kv(me);
    enum { NS = 3, STEPS_W = 9 };
    const int start[NS] = {40, 17, 5};
    int32_t h[NS][64];
    struct tdm_kv_seq sg[NS], se[NS];
    float *lg = malloc((size_t)NS * vocab * sizeof(float));
    float *le = malloc((size_t)NS * vocab * sizeof(float));
    float *work = malloc((size_t)vocab * sizeof(float));
    uint32_t *allow = malloc(words * sizeof *allow);
    assert_true(lg && le && work && allow);
    for (size_t w = 0; w < words; w++)
        allow[w] = 0x6db6db6du; // tokens t % 3 != 0 of every word (t = 32w + bit)
    unsigned long long w0;
    for (int s = 0; s < NS; s++) {
        make_prompt(h[s], start[s], vocab, 70 + (uint32_t)s);
        tdm_kv_seq_init(&sg[s]);
        tdm_kv_seq_init(&se[s]);
        // The prompt in two chunks: the first wants no logits (it ends with a
        // sync), the second its last row's.
        int c1 = start[s] - 3;
        assert_int_equal(tdm_kv_reserve(kg, &sg[s], start[s]), TDM_OK);
        for (int c = 0; c < 2; c++) {
            struct tdm_batch_seq b = {.tokens = h[s] + (c ? c1 : 0),
                                      .n_tokens = c ? start[s] - c1 : c1,
                                      .start_pos = c ? c1 : 0,
                                      .block_table = sg[s].block_table,
                                      .prompt_len = start[s],
                                      .logits = c ? TDM_LOGITS_LAST : TDM_LOGITS_NONE};
            tdm_emu_defer(1);
            w0 = tdm_emu_host_waits();
            int rc = tdm_model_forward(mg, kg, &b, 1, lg);
            unsigned long long waits = tdm_emu_host_waits() - w0;
            tdm_emu_defer(0);
            assert_int_equal(rc, TDM_OK);
            printf("prompt %d chunk %d: %llu host waits\n", s, c, waits);
            assert_int_equal(waits, 1);
            assert_int_equal(tdm_emu_pending(NULL), 0);
        }
        tdm_kv_commit(kg, &sg[s], h[s], start[s]);
        step(me, ke, &se[s], h[s], 0, start[s], le);
        assert_memory_equal(lg, le, (size_t)vocab * sizeof(float));
        h[s][start[s]] = argmax(le, vocab);
    }
    // Decode steps, three kinds in turn: every row's argmax (a graph), rows
    // 1 and 2 drawn with penalties and a logit bias (row 2 with a structured-
    // output mask and logprobs) beside row 0's argmax (a graph, tokens taken
    // after it), and a LAST row beside a drawn and an argmax row (eager).
    for (int t = 0; t < STEPS_W; t++) {
        int kind = t % 3;
        struct tdm_batch_seq bg[NS], be[NS];
        int32_t ids[NS] = {-1, -1, -1};
        struct tdm_draw_params dp[NS];
        struct tdm_draw_adj adj[NS][96];
        struct tdm_draw_logprobs lp[NS];
        struct tdm_sampler *smp[NS] = {NULL, NULL, NULL};
        for (int s = 0; s < NS; s++) {
            int pos = start[s] + t;
            bool draw = kind != 0 && s > 0 && !(kind == 2 && s == 2);
            bool last = kind == 2 && s == 0;
            assert_int_equal(tdm_kv_reserve(kg, &sg[s], pos + 1), TDM_OK);
            assert_int_equal(tdm_kv_reserve(ke, &se[s], pos + 1), TDM_OK);
            if (draw) {
                struct tdm_sampling_params p;
                tdm_sampling_params_default(&p);
                p.temperature = 0.9f;
                p.top_p = 0.95f;
                p.repetition_penalty = 1.3f;
                p.frequency_penalty = 0.5f;
                p.presence_penalty = 0.25f;
                p.logit_bias[0] = (struct tdm_logit_bias){.token = 7, .bias = 3.0f};
                p.num_logit_bias = 1;
                p.has_seed = true;
                p.seed = 90u + (uint64_t)s;
                p.logprobs = s == 2 ? 2 : -1;
                assert_int_equal(
                    tdm_sampler_new(&smp[s], &p, vocab, h[s], (size_t)start[s], NULL, 0), TDM_OK);
                tdm_sampler_replay(smp[s], h[s] + start[s], (size_t)t);
                int n_adj = tdm_sampler_draw_prepare(smp[s], &dp[s], adj[s], 96);
                assert_true(n_adj > 1 && n_adj <= 96);
            }
            bg[s] = (struct tdm_batch_seq){.tokens = h[s] + pos,
                                           .n_tokens = 1,
                                           .start_pos = pos,
                                           .block_table = sg[s].block_table,
                                           .prompt_len = start[s],
                                           .logits = last   ? TDM_LOGITS_LAST
                                                     : draw ? TDM_LOGITS_SAMPLE
                                                            : TDM_LOGITS_ARGMAX,
                                           .token_out = last ? NULL : &ids[s],
                                           .draw = draw ? &dp[s] : NULL,
                                           .adj = draw ? adj[s] : NULL,
                                           .allow = draw && s == 2 ? allow : NULL,
                                           .logprobs_out = draw ? &lp[s] : NULL};
            be[s] = (struct tdm_batch_seq){.tokens = h[s] + pos,
                                           .n_tokens = 1,
                                           .start_pos = pos,
                                           .block_table = se[s].block_table,
                                           .prompt_len = start[s],
                                           .logits = TDM_LOGITS_LAST};
        }
        tdm_emu_defer(1);
        w0 = tdm_emu_host_waits();
        int rc = tdm_model_forward(mg, kg, bg, NS, lg);
        unsigned long long waits = tdm_emu_host_waits() - w0;
        tdm_emu_defer(0);
        assert_int_equal(rc, TDM_OK);
        printf("decode step %d (kind %d): %llu host waits\n", t, kind, waits);
        // A step with LAST rows beside chosen ones: the logits rows' copy
        // waits for the stream, after which the ids have landed too (one
        // wait; two while the ids had a wait of their own).
        assert_int_equal(waits, 1);
        assert_int_equal(tdm_emu_pending(NULL), 0);
        assert_int_equal(tdm_model_forward(me, ke, be, NS, le), TDM_OK);
        for (int s = 0; s < NS; s++) {
            const float *want = le + (size_t)s * vocab;
            if (bg[s].logits == TDM_LOGITS_LAST) {
                assert_memory_equal(lg, want, (size_t)vocab * sizeof(float));
            } else if (bg[s].logits == TDM_LOGITS_ARGMAX) {
                assert_int_equal(ids[s], argmax(want, vocab));
            } else {
                memcpy(work, want, (size_t)vocab * sizeof(float));
                if (bg[s].allow)
                    for (int v = 0; v < vocab; v++)
                        if (!((allow[v / 32] >> (v % 32)) & 1u))
                            work[v] = -INFINITY;
                struct tdm_sample_result res;
                int32_t tok = tdm_sampler_sample(smp[s], work, &res);
                assert_int_equal(ids[s], tok);
                if (dp[s].logprobs) {
                    assert_int_equal(lp[s].num_top, 2);
                    assert_int_equal(lp[s].top_token[0], res.top[0].token);
                    assert_true(fabsf(lp[s].logprob - res.logprob) <=
                                2e-6f * fmaxf(1.0f, fabsf(res.logprob)));
                }
                tdm_sampler_free(smp[s]);
            }
        }
        for (int s = 0; s < NS; s++) {
            int pos = start[s] + t;
            tdm_kv_commit(kg, &sg[s], h[s], pos + 1);
            tdm_kv_commit(ke, &se[s], h[s], pos + 1);
            h[s][pos + 1] = argmax(le + (size_t)s * vocab, vocab);
        }
    }
    for (int s = 0; s < NS; s++) {
        tdm_kv_seq_release(kg, &sg[s]);
        tdm_kv_seq_release(ke, &se[s]);
    }
    tdm_kv_free(kg), tdm_kv_free(ke);
    free(lg), free(le), free(work), free(allow);
    tdm_model_free(mg), tdm_model_free(me);
}

// Two forwards in flight (tdm_model_forward_issue / _wait): a prompt batch,
// then decode steps each issued before the step before it was waited for,
// its rows' tokens the previous step's chosen ones taken on the device
// (from_prev): an argmax row, a seeded drawn row and a drawn row with
// logprobs, on the emulator's deferred device. Their tokens and logprobs
// equal those of the same model stepping synchronously with the tokens
// given; after each issue the step before it has not run yet, and each wait
// is one host wait. On the CPU backend from_prev takes the last forward's
// token on the host, with the same result. Refusals: a third forward in
// flight, prev_row out of range, from_prev after a forward without chosen
// rows.
enum { AS_NS = 3, AS_STEPS = 6 };

struct async_run {
    int32_t tok[AS_STEPS + 1][AS_NS];
    struct tdm_draw_logprobs lp[AS_STEPS + 1][AS_NS];
};

// The batch of step t (0: the prompts) of sequence s.
static struct tdm_batch_seq async_seq(int t, int s, const int32_t *prompt, const int *start,
                                      const struct tdm_kv_seq *q, const int32_t *tokens,
                                      struct tdm_draw_params *dp, struct async_run *out,
                                      bool from_prev)
{
    struct tdm_batch_seq b = {.tokens = t == 0 ? prompt : tokens,
                              .n_tokens = t == 0 ? start[s] : 1,
                              .start_pos = t == 0 ? 0 : start[s] + t - 1,
                              .block_table = q->block_table,
                              .prompt_len = start[s],
                              .logits = s == 0 ? TDM_LOGITS_ARGMAX : TDM_LOGITS_SAMPLE,
                              .token_out = &out->tok[t][s],
                              .draw = s == 0 ? NULL : dp,
                              .logprobs_out = &out->lp[t][s],
                              .from_prev = from_prev && t > 0,
                              .prev_row = s};
    return b;
}

static void async_model(struct tdm_model *m, bool async, struct async_run *out)
{
    int vocab = tdm_model_config(m)->vocab_size;
    const int start[AS_NS] = {37, 16, 5};
    int32_t prompt[AS_NS][64];
    struct tdm_kv_cache *kv = new_kv(m);
    struct tdm_kv_seq q[AS_NS];
    struct tdm_draw_params dp[AS_NS];
    for (int s = 0; s < AS_NS; s++) {
        make_prompt(prompt[s], start[s], vocab, 300 + (uint32_t)s);
        tdm_kv_seq_init(&q[s]);
        assert_int_equal(tdm_kv_reserve(kv, &q[s], start[s] + AS_STEPS), TDM_OK);
        // Seeded draws without penalties: the key is (seed, output
        // position), known before the token before it is.
        dp[s] = (struct tdm_draw_params){.inv_t = 1.0f / 0.8f,
                                         .top_p = 0.9f,
                                         .repetition = 1.0f,
                                         .logprobs = s == 2,
                                         .top_logprobs = 2};
    }
    memset(out, 0xff, sizeof *out);
    struct tdm_batch_seq b[AS_STEPS + 1][AS_NS];
    for (int t = 0; t <= AS_STEPS; t++) {
        for (int s = 0; s < AS_NS; s++) {
            dp[s].key = tdm_draw_key(1234u + (uint64_t)s, (uint64_t)t);
            b[t][s] = async_seq(t, s, prompt[s], start, &q[s], t > 0 ? &out->tok[t - 1][s] : NULL,
                                &dp[s], out, async);
        }
        // The draws' parameters are read at issue: each step its own copy.
        struct tdm_draw_params *copy = malloc(AS_NS * sizeof *copy);
        assert_non_null(copy);
        memcpy(copy, dp, sizeof dp);
        for (int s = 1; s < AS_NS; s++)
            b[t][s].draw = &copy[s];
        if (!async) {
            assert_int_equal(tdm_model_forward(m, kv, b[t], AS_NS, NULL), TDM_OK);
            free(copy);
            continue;
        }
        if (tdm_model_device_sampling(m)) {
            tdm_emu_defer(1);
            unsigned long long w0 = tdm_emu_host_waits();
            assert_int_equal(tdm_model_forward_issue(m, kv, b[t], AS_NS, NULL), TDM_OK);
            if (t > 0) {
                // Issued from the step before's tokens, which the host has
                // not seen: that step is still queued on the device.
                assert_int_equal(tdm_model_forward_pending(m), 2);
                assert_true(tdm_emu_pending(NULL) > 0);
                assert_int_equal(out->tok[t - 1][0], -1);
                // A third forward is refused; the two in flight go on.
                assert_int_equal(tdm_model_forward_issue(m, kv, b[t], AS_NS, NULL), TDM_EINVAL);
                assert_int_equal(tdm_model_forward_wait(m), TDM_OK);
                assert_true(out->tok[t - 1][0] >= 0);
                if (t > 2) // the buckets' graphs captured and every buffer sized
                    assert_int_equal(tdm_emu_host_waits() - w0, 1);
            }
            tdm_emu_defer(0);
        } else {
            assert_int_equal(tdm_model_forward_issue(m, kv, b[t], AS_NS, NULL), TDM_OK);
            assert_int_equal(tdm_model_forward_pending(m), 0); // host memory: done at issue
        }
        free(copy);
    }
    if (async) {
        assert_int_equal(tdm_model_forward_wait(m), TDM_OK);
        assert_int_equal(tdm_model_forward_pending(m), 0);
        assert_int_equal(tdm_model_forward_wait(m), TDM_OK); // none in flight
        // prev_row past the last forward's chosen rows; from_prev after a
        // forward without chosen rows.
        int32_t tok = 0;
        struct tdm_batch_seq bad = {.tokens = &tok,
                                    .n_tokens = 1,
                                    .start_pos = start[0] + AS_STEPS,
                                    .block_table = q[0].block_table,
                                    .logits = TDM_LOGITS_NONE,
                                    .from_prev = true,
                                    .prev_row = AS_NS};
        assert_int_equal(tdm_kv_reserve(kv, &q[0], start[0] + AS_STEPS + 1), TDM_OK);
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL);
        bad.prev_row = 0;
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_OK);
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL);
    }
    for (int s = 0; s < AS_NS; s++)
        tdm_kv_seq_release(kv, &q[s]);
    tdm_kv_free(kv);
}

static void async_compare(const struct async_run *a, const struct async_run *want)
{
    for (int t = 0; t <= AS_STEPS; t++)
        for (int s = 0; s < AS_NS; s++) {
            assert_int_equal(a->tok[t][s], want->tok[t][s]);
            if (s == 2)
                assert_memory_equal(&a->lp[t][s], &want->lp[t][s], sizeof a->lp[t][s]);
        }
}

static void test_forward_async(void **state)
{
    (void)state;
    struct async_run *sync_run = malloc(sizeof *sync_run), *async_run = malloc(sizeof *async_run);
    assert_true(sync_run && async_run);
    struct tdm_model *m = load(tiny_dir, "cuda", "bf16");
    async_model(m, false, sync_run);
    async_model(m, true, async_run);
    async_compare(async_run, sync_run);
    tdm_model_free(m);
    // The CPU backend: from_prev from the host (argmax rows only: it draws
    // nothing itself).
    m = load(tiny_dir, "cpu", "f32");
    struct tdm_kv_cache *kv = new_kv(m);
    struct tdm_kv_seq q;
    int32_t prompt[8] = {5, 9, 2, 7, 1, 3, 8, 4}, tok[3] = {-1, -1, -1};
    tdm_kv_seq_init(&q);
    assert_int_equal(tdm_kv_reserve(kv, &q, 11), TDM_OK);
    for (int t = 0; t < 3; t++) {
        int32_t given = t > 0 ? tok[t - 1] : 0;
        struct tdm_batch_seq b = {.tokens = t == 0 ? prompt : &given,
                                  .n_tokens = t == 0 ? 8 : 1,
                                  .start_pos = t == 0 ? 0 : 7 + t,
                                  .block_table = q.block_table,
                                  .logits = TDM_LOGITS_ARGMAX,
                                  .token_out = &tok[t]};
        assert_int_equal(tdm_model_forward(m, kv, &b, 1, NULL), TDM_OK);
        sync_run->tok[t][0] = tok[t];
    }
    for (int t = 0; t < 3; t++) {
        int32_t wrong = 1;
        struct tdm_batch_seq b = {.tokens = t == 0 ? prompt : &wrong,
                                  .n_tokens = t == 0 ? 8 : 1,
                                  .start_pos = t == 0 ? 0 : 7 + t,
                                  .block_table = q.block_table,
                                  .logits = TDM_LOGITS_ARGMAX,
                                  .token_out = &tok[t],
                                  .from_prev = t > 0};
        assert_int_equal(tdm_model_forward_issue(m, kv, &b, 1, NULL), TDM_OK);
        assert_int_equal(tdm_model_forward_wait(m), TDM_OK);
        assert_int_equal(tok[t], sync_run->tok[t][0]);
    }
    tdm_kv_seq_release(kv, &q);
    tdm_kv_free(kv);
    tdm_model_free(m);
    free(sync_run), free(async_run);
}

// Async scheduling with penalties: a drawn row prepared before the token
// before it is known (tdm_sampler_draw_prepare_pending: its last entry
// TDM_DRAW_ADJ_PENDING, naming the previous forward's chosen row) on a
// from_prev row, the token merged in on the device before the draw. Rows:
// repetition 1.05 alone (Qwen2.5-Instruct's default), presence + frequency
// + repetition, and a greedy draw with repetition 2 and frequency 0.5 (it
// would repeat without them), with logprobs; each step issued before the
// one before it ran (deferred device). Tokens and logprobs equal those of
// synchronous forwards drawn with the rows prepared after the real token.
// Refusals: a pending entry on a row not from_prev, naming a row past the
// last forward's chosen ones, not last, with a flag besides SEEN.
enum { PP_NS = 3, PP_STEPS = 10, PP_CAP = 512 };

struct pending_run {
    int32_t tok[PP_STEPS + 1][PP_NS];
    struct tdm_draw_logprobs lp[PP_STEPS + 1][PP_NS];
    int n_pending; // rows issued with a pending entry
    int n_list;    // rows read from their device list, without entries
    int n0;        // row 0's entries at its first step
};

static void pending_samplers(struct tdm_sampler **smp, int vocab, int32_t (*prompt)[64],
                             const int *start)
{
    for (int s = 0; s < PP_NS; s++) {
        struct tdm_sampling_params p;
        tdm_sampling_params_default(&p);
        p.temperature = s == 2 ? 0.0f : 0.8f;
        p.repetition_penalty = s == 0 ? 1.05f : s == 1 ? 1.3f : 2.0f;
        p.presence_penalty = s == 1 ? 1.5f : 0.0f;
        p.frequency_penalty = s == 1 ? 1.0f : s == 2 ? 0.5f : 0.0f;
        p.logprobs = s == 2 ? 2 : s == 0 ? 0 : -1;
        p.has_seed = true;
        p.seed = 900u + (uint64_t)s;
        // Row 0: a logit bias of 240 tokens, so that its list (with the
        // prompt's and the output's tokens) outgrows the device's first
        // region of 256 entries midway.
        for (int i = 0; s == 0 && i < 240; i++)
            p.logit_bias[p.num_logit_bias++] =
                (struct tdm_logit_bias){.token = 2 * i + 1, .bias = 0.02f * (float)(i % 7 - 3)};
        assert_int_equal(tdm_sampler_new(&smp[s], &p, vocab, prompt[s], (size_t)start[s], NULL, 0),
                         TDM_OK);
    }
}

// lists: each row's entries kept on the device (tdm_draw_params.list):
// loaded at the first step (and row 1's again at step 5, from a pending
// entry when async), else read from the list as the step before left it.
static void pending_model(struct tdm_model *m, bool async, bool lists, struct pending_run *out)
{
    int vocab = tdm_model_config(m)->vocab_size;
    const int start[PP_NS] = {21, 9, 14};
    int32_t prompt[PP_NS][64];
    struct tdm_kv_cache *kv = new_kv(m);
    struct tdm_kv_seq q[PP_NS];
    struct tdm_sampler *smp[PP_NS];
    static struct tdm_draw_adj adj[PP_NS][PP_CAP];
    for (int s = 0; s < PP_NS; s++) {
        make_prompt(prompt[s], start[s], vocab, 700 + (uint32_t)s);
        tdm_kv_seq_init(&q[s]);
        assert_int_equal(tdm_kv_reserve(kv, &q[s], start[s] + PP_STEPS), TDM_OK);
    }
    pending_samplers(smp, vocab, prompt, start);
    memset(out, 0xff, sizeof *out);
    out->n_pending = 0;
    out->n_list = 0;
    if (async)
        tdm_emu_defer(1);
    for (int t = 0; t <= PP_STEPS; t++) {
        struct tdm_batch_seq b[PP_NS];
        struct tdm_draw_params dp[PP_NS];
        int32_t given[PP_NS];
        for (int s = 0; s < PP_NS; s++) {
            bool ahead = async && t > 0;
            bool from_list = lists && t > 0 && !(s == 1 && t == 5);
            int n = from_list ? tdm_sampler_draw_list_params(smp[s], &dp[s], ahead)
                    : ahead   ? tdm_sampler_draw_prepare_pending(smp[s], &dp[s], adj[s], PP_CAP, s)
                              : tdm_sampler_draw_prepare(smp[s], &dp[s], adj[s], PP_CAP);
            assert_true(n >= 0 && n <= PP_CAP);
            if (t == 0 && s == 0)
                out->n0 = n;
            if (ahead && !from_list) {
                assert_true(adj[s][n - 1].flags & TDM_DRAW_ADJ_PENDING);
                out->n_pending++;
            }
            if (lists) {
                dp[s].list = s + 1;
                dp[s].list_load = !from_list;
                out->n_list += from_list;
            }
            given[s] = t > 0 && !async ? out->tok[t - 1][s] : 0;
            b[s] = (struct tdm_batch_seq){.tokens = t == 0 ? prompt[s] : &given[s],
                                          .n_tokens = t == 0 ? start[s] : 1,
                                          .start_pos = t == 0 ? 0 : start[s] + t - 1,
                                          .block_table = q[s].block_table,
                                          .prompt_len = start[s],
                                          .logits = TDM_LOGITS_SAMPLE,
                                          .token_out = &out->tok[t][s],
                                          .draw = &dp[s],
                                          .adj = adj[s],
                                          .logprobs_out = &out->lp[t][s],
                                          .from_prev = ahead,
                                          .prev_row = s};
        }
        if (!async) {
            assert_int_equal(tdm_model_forward(m, kv, b, PP_NS, NULL), TDM_OK);
            for (int s = 0; s < PP_NS; s++)
                tdm_sampler_replay(smp[s], &out->tok[t][s], 1);
            continue;
        }
        // Issued before step t - 1 ran; then step t - 1's tokens recorded.
        assert_int_equal(tdm_model_forward_issue(m, kv, b, PP_NS, NULL), TDM_OK);
        if (t > 0) {
            assert_int_equal(tdm_model_forward_pending(m), 2);
            assert_int_equal(out->tok[t - 1][0], -1);
            assert_int_equal(tdm_model_forward_wait(m), TDM_OK);
            for (int s = 0; s < PP_NS; s++)
                tdm_sampler_replay(smp[s], &out->tok[t - 1][s], 1);
        }
    }
    if (async) {
        assert_int_equal(tdm_model_forward_wait(m), TDM_OK);
        tdm_emu_defer(0);
    }
    if (async) {
        // Refusals, after a forward of PP_NS chosen rows.
        struct tdm_draw_params d;
        int n = tdm_sampler_draw_prepare_pending(smp[0], &d, adj[0], PP_CAP, 0);
        int32_t tok = 0, got = -1;
        struct tdm_draw_logprobs lp;
        struct tdm_batch_seq bad = {.tokens = &tok,
                                    .n_tokens = 1,
                                    .start_pos = start[0] + PP_STEPS,
                                    .block_table = q[0].block_table,
                                    .logits = TDM_LOGITS_SAMPLE,
                                    .token_out = &got,
                                    .draw = &d,
                                    .adj = adj[0],
                                    .logprobs_out = &lp,
                                    .from_prev = false,
                                    .prev_row = 0};
        assert_int_equal(tdm_kv_reserve(kv, &q[0], start[0] + PP_STEPS + 1), TDM_OK);
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL); // not from_prev
        bad.from_prev = true;
        adj[0][n - 1].token = PP_NS;
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL); // past the rows
        adj[0][n - 1].token = 0;
        adj[0][n - 1].flags |= TDM_DRAW_ADJ_BIAS;
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL); // a bias
        adj[0][n - 1].flags &= ~TDM_DRAW_ADJ_BIAS;
        d.n_adj = n + 1;
        adj[0][n] = (struct tdm_draw_adj){.token = 3};
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL); // not last
        d.n_adj = n;
        assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_OK);
        assert_true(got >= 0 && got < vocab);
        if (lists) {
            // A list row with entries of its own (the model), a list never
            // loaded and two rows of one list (the backend), then a good one.
            struct tdm_draw_params dl;
            assert_int_equal(tdm_sampler_draw_list_params(smp[0], &dl, 0), 0);
            dl.list = 1;
            dl.n_adj = 1;
            bad.from_prev = false;
            bad.draw = &dl;
            assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL);
            dl.n_adj = 0;
            dl.list = 77;
            assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_EINVAL);
            dl.list = 1;
            int32_t got1 = -1;
            struct tdm_batch_seq two[2] = {bad, bad};
            two[1].block_table = q[1].block_table;
            two[1].start_pos = start[1] + PP_STEPS;
            two[1].token_out = &got1;
            assert_int_equal(tdm_kv_reserve(kv, &q[1], start[1] + PP_STEPS + 1), TDM_OK);
            assert_int_equal(tdm_model_forward(m, kv, two, 2, NULL), TDM_EINVAL);
            got = -1;
            assert_int_equal(tdm_model_forward(m, kv, &bad, 1, NULL), TDM_OK);
            assert_true(got >= 0 && got < vocab);
        }
    }
    for (int s = 0; s < PP_NS; s++) {
        tdm_sampler_free(smp[s]);
        tdm_kv_seq_release(kv, &q[s]);
    }
    tdm_kv_free(kv);
}

static void test_forward_pending_penalties(void **state)
{
    (void)state;
    struct pending_run *sync_run = malloc(sizeof *sync_run), *async_run = malloc(sizeof *async_run);
    assert_true(sync_run && async_run);
    struct tdm_model *m = load(tiny_dir, "cuda", "bf16");
    pending_model(m, false, false, sync_run);
    int repeats = 0;
    for (int mode = 0; mode < 3; mode++) {
        // Async with pending entries; lists synchronous; lists async.
        bool async = mode != 1, lists = mode > 0;
        pending_model(m, async, lists, async_run);
        assert_int_equal(async_run->n_pending, !async ? 0 : lists ? 1 : PP_STEPS * PP_NS);
        assert_int_equal(async_run->n_list, lists ? PP_STEPS * PP_NS - 1 : 0);
        for (int t = 0; t <= PP_STEPS; t++)
            for (int s = 0; s < PP_NS; s++) {
                if (async_run->tok[t][s] != sync_run->tok[t][s])
                    fail_msg("mode %d step %d row %d: %d, sync %d", mode, t, s,
                             async_run->tok[t][s], sync_run->tok[t][s]);
                if (s != 1)
                    assert_memory_equal(&async_run->lp[t][s], &sync_run->lp[t][s],
                                        sizeof async_run->lp[t][s]);
                repeats += mode == 0 && t > 0 && sync_run->tok[t][s] == sync_run->tok[t - 1][s];
            }
    }
    // Row 0's list outgrew its first region of 256 entries (moved midway).
    assert_true(sync_run->n0 + 1 <= 256 && sync_run->n0 + 1 + PP_STEPS > 256);
    printf("rows with a pending token and rows read from device lists equal to synchronous "
           "forwards (%d repeats; row 0: %d entries at first)\n",
           repeats, sync_run->n0);
    tdm_model_free(m);
    free(sync_run), free(async_run);
}

static void test_device_flag(void **state)
{
    (void)state;
    struct tdm_model_opts o;
    char err[256];
    tdm_model_opts_default(&o);
    assert_int_equal(tdm_model_opts_set_device(&o, NULL, err, sizeof err), TDM_OK);
    assert_string_equal(o.backend, "cuda"); // auto: a GPU is visible
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda:0", err, sizeof err), TDM_OK);
    assert_string_equal(o.backend, "cuda");
    assert_int_equal(o.device, 0);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda:1", err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--device cuda:1: 1 CUDA GPU visible");
    assert_int_equal(tdm_model_opts_set_device(&o, "cpu", err, sizeof err), TDM_OK);
    assert_string_equal(o.backend, "cpu");
}

// --gpu-memory-utilization on the emulated device (a pretend 1 GiB that this
// process alone uses): (F * 1 GiB - what the model holds - 256 MiB headroom) /
// bf16 block bytes; the CPU backend has no device memory to size from.
static void test_kv_capacity(void **state)
{
    (void)state;
    struct tdm_model *m = load(tiny_dir, "cuda", "bf16"), *mc = load(tiny_dir, "cpu", "f32");
    struct tdm_kv_config kc;
    char err[256];
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    size_t block = 2 * 2 * (size_t)kc.num_layers * kc.num_kv_heads * 16 * kc.head_dim;
    int nb = 0;
    assert_int_equal(tdm_model_kv_capacity(m, &kc, 0.5, &nb, err, sizeof err), TDM_OK);
    // The tiny model's weights and buffers (a few MB) come off the budget.
    int all = (int)((((size_t)512 << 20) - ((size_t)256 << 20)) / block);
    assert_true(nb < all && nb > all - (int)(((size_t)64 << 20) / block));
    assert_int_equal(tdm_model_kv_capacity(m, &kc, 0.2, &nb, err, sizeof err), TDM_ECAPACITY);
    assert_non_null(strstr(err, "leaves no room"));
    assert_int_equal(tdm_model_kv_capacity(m, &kc, 0.0, &nb, err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_model_kv_capacity(mc, &kc, 0.5, &nb, err, sizeof err), TDM_ENOTFOUND);
    tdm_model_free(m);
    tdm_model_free(mc);
}
#endif

// CUDA graphs vs --enforce-eager: three sequences (a bucket of 4 with one
// padding row) decode 12 steps, crossing a block boundary and split
// boundaries (position 256: 9 splits of 32, rounded up to 16, a new graph
// key); logits bitwise equal every step,
// and graphs were replayed. Then a batch of 1 (bucket 1) on the same model.
static void graphs_vs_eager(const char *dir, enum tdm_batch_invariance bi)
{
    struct tdm_model *mg = load_mode(dir, "cuda", "bf16", false, bi);
    struct tdm_model *me = load_mode(dir, "cuda", "bf16", true, bi);
    int vocab = tdm_model_config(mg)->vocab_size;
    struct tdm_kv_cache *kg = new_kv(mg), *ke = new_kv(me);
    enum { NS = 3, STEPS_G = 12 };
    const int start[NS] = {250, 30, 7};
    int32_t h[NS][300];
    struct tdm_kv_seq sg[NS], se[NS];
    float *lg = malloc((size_t)NS * vocab * sizeof(float));
    float *le = malloc((size_t)NS * vocab * sizeof(float));
    for (int s = 0; s < NS; s++) {
        make_prompt(h[s], start[s], vocab, 20 + (uint32_t)s);
        tdm_kv_seq_init(&sg[s]);
        tdm_kv_seq_init(&se[s]);
        step(mg, kg, &sg[s], h[s], 0, start[s], lg);
        step(me, ke, &se[s], h[s], 0, start[s], le);
        h[s][start[s]] = argmax(le, vocab);
    }
#ifndef TDM_CUDA_TEST_GPU
    unsigned long long launches0 = tdm_emu_graph_launches();
#endif
    // Tokens the model chooses: greedy rows' ids from the device argmax
    // (TDM_LOGITS_ARGMAX) and sampled rows' from the device's draw
    // (TDM_LOGITS_SAMPLE, issue 26 item 1). Every third step all rows (row 0
    // greedy, rows 1 and 2 sampled: still a graph, the tokens are taken after
    // it), every third step the middle row only, sampled (a mixed batch runs
    // eager). The ids equal the argmax of the eager model's logits, the drawn
    // tokens what the CPU sampler draws from them with the same seed at the
    // same position; the LAST rows' logits stay bitwise. Row 2 asks logprobs
    // (top 3): the device's equal the CPU sampler's from the same logits.
    float *work = malloc((size_t)vocab * sizeof(float));
    assert_non_null(work);
    for (int t = 0; t < STEPS_G; t++) {
        struct tdm_batch_seq bg[NS], be[NS];
        int32_t ids[NS] = {-1, -1, -1}, drawn_want[NS] = {-1, -1, -1};
        struct tdm_draw_params dp[NS];
        struct tdm_draw_logprobs lp[NS];
        struct tdm_sampler *smp[NS] = {NULL, NULL, NULL};
        for (int s = 0; s < NS; s++) {
            int pos = start[s] + t;
            bool chosen = t % 3 == 1 || (t % 3 == 2 && s == 1);
            bool draw = chosen && s > 0;
            assert_int_equal(tdm_kv_reserve(kg, &sg[s], pos + 1), TDM_OK);
            assert_int_equal(tdm_kv_reserve(ke, &se[s], pos + 1), TDM_OK);
            if (draw) {
                struct tdm_sampling_params p;
                tdm_sampling_params_default(&p);
                p.temperature = 0.8f;
                p.top_k = s == 1 ? 0 : 40;
                p.top_p = 0.9f;
                p.has_seed = true;
                p.seed = 50u + (uint64_t)s;
                p.logprobs = s == 2 ? 3 : -1;
                assert_int_equal(tdm_sampler_new(&smp[s], &p, vocab, NULL, 0, NULL, 0), TDM_OK);
                tdm_sampler_replay(smp[s], h[s] + start[s], (size_t)t); // position t
                assert_int_equal(tdm_sampler_draw_prepare(smp[s], &dp[s], NULL, 0), 0);
                assert_int_equal(dp[s].logprobs, s == 2);
            }
            bg[s] = (struct tdm_batch_seq){.tokens = h[s] + pos,
                                           .n_tokens = 1,
                                           .start_pos = pos,
                                           .block_table = sg[s].block_table,
                                           .logits = draw     ? TDM_LOGITS_SAMPLE
                                                     : chosen ? TDM_LOGITS_ARGMAX
                                                              : TDM_LOGITS_LAST,
                                           .token_out = chosen ? &ids[s] : NULL,
                                           .draw = draw ? &dp[s] : NULL,
                                           .logprobs_out = draw ? &lp[s] : NULL};
            be[s] = bg[s];
            be[s].block_table = se[s].block_table;
            be[s].logits = TDM_LOGITS_LAST;
            be[s].token_out = NULL;
            be[s].draw = NULL;
        }
        if (bg[2].logits == TDM_LOGITS_SAMPLE) {
            // Logprobs asked and nowhere to put them: refused, nothing run.
            bg[2].logprobs_out = NULL;
            assert_int_equal(tdm_model_forward(mg, kg, bg, NS, lg), TDM_EINVAL);
            bg[2].logprobs_out = &lp[2];
        }
        assert_int_equal(tdm_model_forward(mg, kg, bg, NS, lg), TDM_OK);
        assert_int_equal(tdm_model_forward(me, ke, be, NS, le), TDM_OK);
        for (int s = 0, row = 0; s < NS; s++) {
            const float *want = le + (size_t)s * vocab;
            if (bg[s].logits == TDM_LOGITS_ARGMAX) {
                assert_int_equal(ids[s], argmax(want, vocab));
            } else if (bg[s].logits == TDM_LOGITS_SAMPLE) {
                memcpy(work, want, (size_t)vocab * sizeof(float));
                struct tdm_sample_result res;
                drawn_want[s] = tdm_sampler_sample(smp[s], work, &res);
                assert_int_equal(ids[s], drawn_want[s]);
                if (dp[s].logprobs) {
                    assert_int_equal(lp[s].num_top, 3);
                    assert_true(fabsf(lp[s].logprob - res.logprob) <=
                                2e-6f * fmaxf(1.0f, fabsf(res.logprob)));
                    for (int j = 0; j < 3; j++) {
                        assert_int_equal(lp[s].top_token[j], res.top[j].token);
                        assert_true(fabsf(lp[s].top_logprob[j] - res.top[j].logprob) <=
                                    2e-6f * fmaxf(1.0f, fabsf(res.top[j].logprob)));
                    }
                }
                tdm_sampler_free(smp[s]);
            } else {
                assert_memory_equal(lg + (size_t)row++ * vocab, want,
                                    (size_t)vocab * sizeof(float));
            }
        }
        for (int s = 0; s < NS; s++) {
            int pos = start[s] + t;
            tdm_kv_commit(kg, &sg[s], h[s], pos + 1);
            tdm_kv_commit(ke, &se[s], h[s], pos + 1);
            h[s][pos + 1] = argmax(le + (size_t)s * vocab, vocab);
        }
    }
    // Batch of one (bucket 1), three steps: warm-up, capture, replay.
    for (int t = 0; t < 3; t++) {
        int pos = start[2] + STEPS_G + t;
        assert_int_equal(tdm_kv_reserve(kg, &sg[2], pos + 1), TDM_OK);
        assert_int_equal(tdm_kv_reserve(ke, &se[2], pos + 1), TDM_OK);
        struct tdm_batch_seq b = {.tokens = h[2] + pos,
                                  .n_tokens = 1,
                                  .start_pos = pos,
                                  .block_table = sg[2].block_table,
                                  .logits = TDM_LOGITS_LAST};
        assert_int_equal(tdm_model_forward(mg, kg, &b, 1, lg), TDM_OK);
        b.block_table = se[2].block_table;
        assert_int_equal(tdm_model_forward(me, ke, &b, 1, le), TDM_OK);
        assert_memory_equal(lg, le, (size_t)vocab * sizeof(float));
        tdm_kv_commit(kg, &sg[2], h[2], pos + 1);
        tdm_kv_commit(ke, &se[2], h[2], pos + 1);
        h[2][pos + 1] = argmax(lg, vocab);
    }
    free(work);
#ifndef TDM_CUDA_TEST_GPU
    unsigned long long launches = tdm_emu_graph_launches() - launches0;
    printf("graph launches: %llu of %d steps\n", launches, STEPS_G + 3);
    // 12 steps of bucket 4, 4 of them mixed (eager): the first warms up, and
    // the split count passing 8 at 256 changes the key once (warm-up again);
    // bucket 1: one warm-up.
    assert_true(launches >= STEPS_G + 3 - 4 - 4);
#endif
    for (int s = 0; s < NS; s++) {
        tdm_kv_seq_release(kg, &sg[s]);
        tdm_kv_seq_release(ke, &se[s]);
    }
    tdm_kv_free(kg), tdm_kv_free(ke);
    free(lg), free(le);
    tdm_model_free(mg), tdm_model_free(me);
}

static void test_graphs_vs_eager(void **state)
{
    (void)state;
    graphs_vs_eager(tiny_dir, TDM_BATCH_INVARIANT_DEFAULT);
}

// The same with every decode step's GEMMs on the GEMV (the tiny model's run
// in one split; split GEMVs launched again and again, as a replay does, are
// cuda_ops_test's and test_greedy_fast's on the GQA-7 model: on it this test
// took 12 s of the emulator, 3 min under ASan).
static void test_graphs_vs_eager_fast(void **state)
{
    (void)state;
    graphs_vs_eager(tiny_dir, TDM_BATCH_INVARIANT_OFF);
}

// bf16 device pools: export -> import into a fresh cache -> export gives the
// same bytes. The cache takes the storage's dtype, so the payload is bf16 (half
// the bytes of f32), staged through the storage's f32 copies exactly.
static void test_export_import_bf16(void **state)
{
    (void)state;
    struct tdm_model *m = load(gqa7_dir, "cuda", "bf16");
    int vocab = tdm_model_config(m)->vocab_size, layers = tdm_model_config(m)->num_hidden_layers;
    struct tdm_kv_cache *a = new_kv(m), *b = new_kv(m);
    int32_t h[64];
    make_prompt(h, 40, vocab, 4);
    float *l = malloc((size_t)vocab * sizeof(float));
    struct tdm_kv_seq sa, sb;
    tdm_kv_seq_init(&sa), tdm_kv_seq_init(&sb);
    step(m, a, &sa, h, 0, 40, l);
    assert_int_equal(tdm_kv_reserve(b, &sb, 40), TDM_OK);
    size_t bytes = tdm_kv_layer_bytes(a, sa.num_blocks);
    assert_int_equal(tdm_kv_dtype(a), TDM_KV_BF16);
    assert_int_equal(bytes * 2, tdm_kv_layer_bytes_as(a, sa.num_blocks, TDM_KV_F32));
    unsigned char *x = malloc(bytes), *y = malloc(bytes);
    for (int layer = 0; layer < layers; layer++) {
        assert_int_equal(tdm_kv_export_layer(a, &sa, layer, 0, sa.num_blocks, x, bytes), TDM_OK);
        assert_int_equal(tdm_kv_import_layer(b, &sb, layer, 0, sb.num_blocks, x, bytes), TDM_OK);
        assert_int_equal(tdm_kv_export_layer(b, &sb, layer, 0, sb.num_blocks, y, bytes), TDM_OK);
        assert_memory_equal(x, y, bytes);
    }
    tdm_kv_seq_release(a, &sa), tdm_kv_seq_release(b, &sb);
    tdm_kv_free(a), tdm_kv_free(b);
    free(x), free(y), free(l);
    tdm_model_free(m);
}

// The per-instance budget (vLLM's meaning of --gpu-memory-utilization) on fake
// device figures: two instances at 0.4 share one device, 0.6 + 0.6 do not (the
// second is refused naming the pool it wants and the memory free), a process
// that holds more than its fraction gets no pool. Each instance holds 1 GiB of
// weights before it sizes its pool (so free already lacks them). Pure
// arithmetic, so the emulator's build alone runs it (the GPU build reaches
// the backend only through its module, which exports nothing else).
#ifndef TDM_CUDA_TEST_GPU
static void test_kv_budget_shared_device(void **state)
{
    (void)state;
    const size_t GB = (size_t)1 << 30, total = 100 * GB, block = 1 << 20, weights = GB;
    char err[400];
    for (int k = 0; k < 2; k++) {
        double u = k == 0 ? 0.4 : 0.6;
        size_t free_b = total - weights; // the first instance, its weights loaded
        int nb1 = 0, nb2 = 0;
        assert_int_equal(
            tdm_cuda_kv_budget(total, free_b, weights, u, block, 16, &nb1, err, sizeof err),
            TDM_OK);
        size_t want = (size_t)(u * (double)total) - weights - TDM_CUDA_KV_HEADROOM;
        assert_int_equal(nb1, (int)(want / block));
        // The second instance starts once the first holds its pool.
        free_b -= (size_t)nb1 * block + weights;
        int rc = tdm_cuda_kv_budget(total, free_b, weights, u, block, 16, &nb2, err, sizeof err);
        if (k == 0) {
            assert_int_equal(rc, TDM_OK);
            assert_int_equal(nb2, nb1);
        } else {
            assert_int_equal(rc, TDM_ECAPACITY);
            printf("0.6 + 0.6: %s\n", err);
            assert_non_null(strstr(err, "gives this instance a KV pool of 58.75 GiB"));
            assert_non_null(strstr(err, "the device has 39.25 GiB free"));
        }
    }
    int nb = 0;
    assert_int_equal(tdm_cuda_kv_budget(total, total - 50 * GB, 50 * GB, 0.4, block, 16, &nb, err,
                                        sizeof err),
                     TDM_ECAPACITY);
    assert_non_null(strstr(err, "leaves no room for one KV block"));
    assert_non_null(strstr(err, "this instance already holds 50.00 GiB"));
}
#endif

// Two (emulated) GPUs, a model on cuda:1, and forwards from threads other than
// the loading one (the engine's thread never bound its device: its launches
// went to GPU 0). Each forward binds the calling thread to the model's device;
// the emulator fails any launch from a thread whose current device is another
// (issue 25, item 1). The emulator's own (TANDEM_EMU_DEVICES).
#ifndef TDM_CUDA_TEST_GPU
struct forward_job {
    struct tdm_model *m;
    int rc;
};

static void *forward_thread(void *arg)
{
    struct forward_job *j = arg;
    struct tdm_kv_cache *kv = new_kv(j->m);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    int vocab = tdm_model_config(j->m)->vocab_size;
    int32_t hist[24];
    make_prompt(hist, 20, vocab, 7);
    float *out = malloc((size_t)vocab * sizeof *out);
    j->rc = tdm_kv_reserve(kv, &seq, 20);
    struct tdm_batch_seq b = {.tokens = hist,
                              .n_tokens = 20,
                              .start_pos = 0,
                              .block_table = seq.block_table,
                              .logits = TDM_LOGITS_LAST};
    if (j->rc == TDM_OK)
        j->rc = tdm_model_forward(j->m, kv, &b, 1, out);
    free(out);
    tdm_kv_seq_release(kv, &seq);
    tdm_kv_free(kv);
    return NULL;
}

static void test_device_bound_per_thread(void **state)
{
    (void)state;
    setenv("TANDEM_EMU_DEVICES", "2", 1);
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda:1", err, sizeof err), TDM_OK);
    assert_int_equal(o.device, 1);
    o.num_threads = 1;
    o.enforce_eager = true;
    setenv("TANDEM_CUDA_KV_DTYPE", "bf16", 1);
    assert_int_equal(tdm_model_load(&m, tiny_dir, &o, err, sizeof err), TDM_OK);
    for (int t = 0; t < 2; t++) { // two fresh threads, current device 0 each
        struct forward_job j = {.m = m, .rc = -1};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, forward_thread, &j), 0);
        pthread_join(th, NULL);
        assert_int_equal(j.rc, TDM_OK);
    }
    tdm_model_free(m);
    unsetenv("TANDEM_EMU_DEVICES");
}
#endif

static void test_errors(void **state)
{
    (void)state;
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.backend = "cuda";
    o.weights = TDM_WEIGHTS_INT8;
    assert_int_equal(tdm_model_load(&m, tiny_dir, &o, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "only bf16 weights"));
    o.weights = TDM_WEIGHTS_BF16;
    o.device = 1;
    assert_int_equal(tdm_model_load(&m, tiny_dir, &o, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "device 1 requested"));

    // A host KV cache handed to a cuda model: a clean TDM_EINVAL, no write.
    m = load(tiny_dir, "cuda", "bf16");
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = 8;
    struct tdm_kv_cache *host_kv;
    assert_int_equal(tdm_kv_new(&host_kv, &kc, err, sizeof err), TDM_OK);
    struct tdm_kv_seq s;
    tdm_kv_seq_init(&s);
    assert_int_equal(tdm_kv_reserve(host_kv, &s, 4), TDM_OK);
    int32_t ids[4] = {1, 2, 3, 4};
    float logits[4096];
    struct tdm_batch_seq b = {.tokens = ids,
                              .n_tokens = 4,
                              .start_pos = 0,
                              .block_table = s.block_table,
                              .logits = TDM_LOGITS_LAST};
    assert_int_equal(tdm_model_forward(m, host_kv, &b, 1, logits), TDM_EINVAL);
    // The model still works on its own cache afterwards.
    struct tdm_kv_cache *kv = new_kv(m);
    struct tdm_kv_seq s2;
    tdm_kv_seq_init(&s2);
    assert_int_equal(tdm_kv_reserve(kv, &s2, 4), TDM_OK);
    b.block_table = s2.block_table;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_OK);

    // Every row drawn (TDM_LOGITS_DRAW_ALL, a speculative step's
    // verification): greedy draws give each row's argmax of the ALL logits;
    // a missing token_out, a mask, an adjustment out of the vocabulary or a
    // CPU model are refused.
    int vocab = tdm_model_config(m)->vocab_size;
    float *all = malloc(4 * (size_t)vocab * sizeof(float));
    assert_non_null(all);
    struct tdm_batch_seq ba = b;
    ba.logits = TDM_LOGITS_ALL;
    assert_int_equal(tdm_model_forward(m, kv, &ba, 1, all), TDM_OK);
    struct tdm_draw_params dp[4] = {{0}};
    struct tdm_draw_adj adj[1] = {{.token = vocab, .flags = TDM_DRAW_ADJ_BIAS, .bias = 1.0f}};
    int32_t tok[4] = {-1, -1, -1, -1};
    uint32_t allow[1] = {~0u};
    struct tdm_batch_seq bd = b;
    bd.logits = TDM_LOGITS_DRAW_ALL;
    bd.draw = dp;
    bd.adj = adj;
    assert_int_equal(tdm_model_forward(m, kv, &bd, 1, NULL), TDM_EINVAL); // no token_out
    bd.token_out = tok;
    bd.allow = allow;
    assert_int_equal(tdm_model_forward(m, kv, &bd, 1, NULL), TDM_EINVAL);
    bd.allow = NULL;
    dp[2].n_adj = 1;
    assert_int_equal(tdm_model_forward(m, kv, &bd, 1, NULL), TDM_EINVAL);
    dp[2].n_adj = 0;
    assert_int_equal(tdm_model_forward(m, kv, &bd, 1, NULL), TDM_OK);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tok[i], argmax(all + (size_t)i * vocab, vocab));
    struct tdm_model *cpu = load(tiny_dir, "cpu", "bf16");
    struct tdm_kv_cache *ckv = new_kv(cpu);
    struct tdm_kv_seq s3;
    tdm_kv_seq_init(&s3);
    assert_int_equal(tdm_kv_reserve(ckv, &s3, 4), TDM_OK);
    bd.block_table = s3.block_table;
    assert_int_equal(tdm_model_forward(cpu, ckv, &bd, 1, NULL), TDM_EINVAL);
    tdm_kv_seq_release(ckv, &s3);
    tdm_kv_free(ckv);
    tdm_model_free(cpu);
    free(all);
    tdm_kv_seq_release(host_kv, &s);
    tdm_kv_seq_release(kv, &s2);
    tdm_kv_free(host_kv);
    tdm_kv_free(kv);
    tdm_model_free(m);
}

#ifdef TDM_CUDA_TEST_GPU
// ---- GPU only: the Qwen2.5-0.5B shape ------------------------------------------------------
// Too slow for the emulator. The random model is written once (about 1 GB)
// into TANDEM_TEST_WORKDIR, else the build folder when it exists, else the
// working folder (a relocated pack, bench/gpu/pack.sh, has no build folder).
static char big_dir[1024];

static void ensure_big_model(void)
{
    char path[1100], err[256];
    struct stat sb;
    const char *base = getenv("TANDEM_TEST_WORKDIR");
    if (base == NULL || base[0] == '\0')
        base = stat(TANDEM_BINARY_DIR, &sb) == 0 ? TANDEM_BINARY_DIR : ".";
    snprintf(big_dir, sizeof big_dir, "%s/qwen2.5-0.5b-random-gpu-test", base);
    snprintf(path, sizeof path, "%s/model.safetensors", big_dir);
    if (stat(path, &sb) == 0)
        return;
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "qwen2.5-0.5b");
    if (tdm_mkmodel_write(&s, big_dir, err, sizeof err) != TDM_OK)
        fail_msg("mkmodel: %s", err);
}

// The 0.5B shape (14 heads / 2 KV heads, head_dim 64) on the GPU vs the CPU
// backend: the argmax of every row of a 64-token prefill's second chunk
// agrees (near-ties within 0.25 excepted), its rows prompt rows (the prompt
// class's GEMM algorithm).
static void test_big_prefill_vs_cpu(void **state)
{
    (void)state;
    ensure_big_model();
    struct tdm_model *mc = load(big_dir, "cpu", "bf16"), *mg = load(big_dir, "cuda", "bf16");
    int vocab = tdm_model_config(mc)->vocab_size, n = 64, c1 = 40;
    struct tdm_kv_cache *kc = new_kv(mc), *kg = new_kv(mg);
    int32_t h[64];
    make_prompt(h, n, vocab, 77);
    float *lc = malloc((size_t)(n - c1) * vocab * sizeof(float));
    float *lg = malloc((size_t)(n - c1) * vocab * sizeof(float));
    struct tdm_kv_seq sc, sg;
    tdm_kv_seq_init(&sc), tdm_kv_seq_init(&sg);
    step_in(mc, kc, &sc, h, 0, c1, lc, false, n);
    step_in(mg, kg, &sg, h, 0, c1, lg, false, n);
    step_in(mc, kc, &sc, h, c1, n - c1, lc, true, n);
    step_in(mg, kg, &sg, h, c1, n - c1, lg, true, n);
    int ties = 0;
    float worst = 0.0f;
    for (int r = 0; r < n - c1; r++) {
        const float *rc = lc + (size_t)r * vocab, *rg = lg + (size_t)r * vocab;
        int a = argmax(rc, vocab), b = argmax(rg, vocab);
        for (int i = 0; i < vocab; i++)
            worst = fabsf(rc[i] - rg[i]) > worst ? fabsf(rc[i] - rg[i]) : worst;
        if (a != b) {
            if (!(rc[a] - rc[b] <= 0.25f))
                fail_msg("row %d: cpu picks %d, cuda %d (cpu logits %g vs %g)", r, a, b, rc[a],
                         rc[b]);
            ties++;
        }
    }
    printf("0.5B shape: max |logit diff| %g over %d rows, %d near-tie flips\n", worst, n - c1,
           ties);
    tdm_kv_seq_release(kc, &sc), tdm_kv_seq_release(kg, &sg);
    tdm_kv_free(kc), tdm_kv_free(kg);
    free(lc), free(lg);
    tdm_model_free(mc), tdm_model_free(mg);
}

// Batch invariance on the GPU: sequence 0's decode logits alone (graph
// bucket 1) and inside a batch of B (bucket B), bitwise: B = 32 batch
// invariant (cuBLASLt), B = 16 with --no-batch-invariant (the GEMV).
static void big_batch_invariance(enum tdm_batch_invariance bi, int B)
{
    ensure_big_model();
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.backend = "cuda";
    o.batch_invariant = bi;
    o.max_batch_tokens = 512;
    o.max_batch_seqs = B;
    setenv("TANDEM_CUDA_KV_DTYPE", "bf16", 1);
    if (tdm_model_load(&m, big_dir, &o, err, sizeof err) != TDM_OK)
        fail_msg("load: %s", err);
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_config kc;
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = B * 4 + 8;
    struct tdm_kv_cache *kv;
    assert_int_equal(tdm_model_kv_new(m, &kc, &kv, err, sizeof err), TDM_OK);
    static int32_t h[32][64];
    struct tdm_kv_seq sq[32];
    assert_true(B <= 32);
    float *l = malloc((size_t)B * vocab * sizeof(float));
    float *alone = malloc((size_t)vocab * sizeof(float));
    for (int s = 0; s < B; s++) {
        int len = 10 + s;
        make_prompt(h[s], len + 1, vocab, 100 + (uint32_t)s);
        tdm_kv_seq_init(&sq[s]);
        step(m, kv, &sq[s], h[s], 0, len, l);
    }
    struct tdm_batch_seq b[32];
    for (int s = 0; s < B; s++) {
        int pos = 10 + s;
        assert_int_equal(tdm_kv_reserve(kv, &sq[s], pos + 1), TDM_OK);
        b[s] = (struct tdm_batch_seq){.tokens = h[s] + pos,
                                      .n_tokens = 1,
                                      .start_pos = pos,
                                      .block_table = sq[s].block_table,
                                      .logits = TDM_LOGITS_LAST};
    }
    // Alone three times (warm-up, capture, replay), then the batch three times;
    // rewriting a position's KV with the same values each time.
    for (int i = 0; i < 3; i++)
        assert_int_equal(tdm_model_forward(m, kv, &b[0], 1, alone), TDM_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(tdm_model_forward(m, kv, b, B, l), TDM_OK);
        assert_memory_equal(l, alone, (size_t)vocab * sizeof(float));
    }
    printf("0.5B shape, %s: decode logits alone = in a batch of %d, bitwise\n",
           bi == TDM_BATCH_INVARIANT_OFF ? "--no-batch-invariant" : "batch invariant", B);
    for (int s = 0; s < B; s++)
        tdm_kv_seq_release(kv, &sq[s]);
    tdm_kv_free(kv);
    free(l), free(alone);
    tdm_model_free(m);
}

static void test_big_batch32_invariance(void **state)
{
    (void)state;
    big_batch_invariance(TDM_BATCH_INVARIANT_ON, 32);
}

static void test_big_batch16_fast(void **state)
{
    (void)state;
    big_batch_invariance(TDM_BATCH_INVARIANT_OFF, 16);
}
#endif

int main(int argc, char **argv)
{
    tdm_test_filters(argc, argv); // --only / --skip PATTERN (tdm_test's SPLIT)
    cpu_reference_path();
#ifdef TDM_CUDA_TEST_GPU
    struct tdm_model_opts probe;
    char err[256];
    tdm_model_opts_default(&probe);
    if (tdm_model_opts_set_device(&probe, "cuda", err, sizeof err) != TDM_OK) {
        printf("cuda_model_gpu_test: %s; skipped\n", err);
        return 77;
    }
#endif
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_tiny_f32),
        cmocka_unit_test(test_greedy_tiny_bf16),
        cmocka_unit_test(test_greedy_gqa7_f32),
        cmocka_unit_test(test_greedy_gqa7_bf16),
        cmocka_unit_test(test_greedy_fast),
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_batch_invariance_fast),
        cmocka_unit_test(test_export_import),
        cmocka_unit_test(test_export_import_bf16),
        cmocka_unit_test(test_graphs_vs_eager),
        cmocka_unit_test(test_graphs_vs_eager_fast),
#ifndef TDM_CUDA_TEST_GPU
        cmocka_unit_test(test_device_flag),
        cmocka_unit_test(test_kv_capacity),
        cmocka_unit_test(test_deferred_export_overlaps),
        cmocka_unit_test(test_host_waits),
        cmocka_unit_test(test_forward_async),
        cmocka_unit_test(test_forward_pending_penalties),
        cmocka_unit_test(test_launch_budget),
        cmocka_unit_test(test_gemm_classes),
        cmocka_unit_test(test_gemm_classes_decode_launches),
#endif
        cmocka_unit_test(test_errors),
#ifndef TDM_CUDA_TEST_GPU
        cmocka_unit_test(test_kv_budget_shared_device),
        cmocka_unit_test(test_device_bound_per_thread),
#endif
#ifdef TDM_CUDA_TEST_GPU
        cmocka_unit_test(test_big_prefill_vs_cpu),
        cmocka_unit_test(test_big_batch32_invariance),
        cmocka_unit_test(test_big_batch16_fast),
#endif
    };
    return tdm_test_exit(tdm_run_group_tests(tests, setup, teardown));
}
