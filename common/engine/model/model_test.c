// SPDX-License-Identifier: Apache-2.0
// Tests for the model and the runner on tiny random models written by mkmodel:
// chunked prefill equals one-shot and token-by-token prefill, prefix-cache hits
// equal misses, exported/imported KV continues identically, a request's logits
// are bitwise the same alone and inside a batch of 16 mixed requests (greedy
// and seeded sampling), int8 mostly agrees with bf16, the per-layer hook fires
// per layer in order after that layer's KV is written, bad batches and broken
// checkpoints are clean errors, and every KV block is free or cached at the end.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "test_skip.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "core.h"
#include "cpu_backend.h"
#include "kv_cache.h"
#include "mkmodel.h"
#include "model.h"
#include "runner.h"

static char model_dir[64];
static char llama_dir[64];

static int setup(void **state)
{
    (void)state;
    char err[256];
    struct tdm_mkmodel_spec s;
    strcpy(model_dir, "/tmp/tdm_model_testXXXXXX");
    strcpy(llama_dir, "/tmp/tdm_model_llamaXXXXXX");
    if (mkdtemp(model_dir) == NULL || mkdtemp(llama_dir) == NULL)
        return -1;
    tdm_mkmodel_preset(&s, "tiny");
    s.seed = 7;
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    tdm_mkmodel_preset(&s, "tiny");
    s.arch = TDM_ARCH_LLAMA;
    s.tie_word_embeddings = false;
    s.rope_llama3 = true;
    s.rope_original_max_pos = 64;
    s.rope_theta = 10000;
    s.seed = 8;
    if (tdm_mkmodel_write(&s, llama_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_mkmodel_remove(model_dir);
    tdm_mkmodel_remove(llama_dir);
    return 0;
}

static struct tdm_model *load(const char *dir, enum tdm_weight_mode mode, int max_seqs)
{
    struct tdm_model_opts o;
    struct tdm_model *m = NULL;
    char err[256];
    tdm_model_opts_default(&o);
    o.weights = mode;
    o.num_threads = 2;
    o.max_batch_tokens = 256;
    o.max_batch_seqs = max_seqs;
    int rc = tdm_model_load(&m, dir, &o, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "load: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    return m;
}

// KV element type of the caches new_kv makes (f32: the exact reference).
static enum tdm_kv_dtype kv_dtype = TDM_KV_F32;

static struct tdm_kv_cache *new_kv(struct tdm_model *m, int blocks, bool prefix)
{
    struct tdm_kv_config kc;
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    memset(&kc, 0, sizeof kc);
    tdm_model_kv_config(m, &kc);
    kc.block_size = 16;
    kc.num_blocks = blocks;
    kc.enable_prefix_caching = prefix;
    kc.dtype = kv_dtype;
    assert_int_equal(tdm_kv_new(&kv, &kc, err, sizeof err), TDM_OK);
    return kv;
}

// Every block must be free or cached again: nothing referenced, refcounts consistent.
static void check_kv_idle(struct tdm_kv_cache *kv)
{
    char err[256];
    int rc = tdm_kv_check(kv, err, sizeof err);
    if (rc != TDM_OK)
        fprintf(stderr, "kv check: %s\n", err);
    assert_int_equal(rc, TDM_OK);
    assert_int_equal(tdm_kv_num_referenced_blocks(kv), 0);
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

static float max_rel_diff(const float *a, const float *b, size_t n)
{
    double mean = 0, var = 0, md = 0;
    for (size_t i = 0; i < n; i++)
        mean += b[i];
    mean /= (double)n;
    for (size_t i = 0; i < n; i++) {
        var += (b[i] - mean) * (b[i] - mean);
        double d = fabs((double)a[i] - b[i]);
        if (d > md)
            md = d;
    }
    return (float)(md / sqrt(var / (double)n));
}

// Prefill `n` tokens in pieces of `chunk` with ALL logits into out[n][vocab].
static void prefill_all(struct tdm_model *m, const int32_t *ids, int n, int chunk, float *out)
{
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_cache *kv = new_kv(m, 16, false);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    for (int p = 0; p < n; p += chunk) {
        int take = n - p < chunk ? n - p : chunk;
        assert_int_equal(tdm_kv_reserve(kv, &seq, p + take), TDM_OK);
        struct tdm_batch_seq b = {.tokens = ids + p,
                                  .n_tokens = take,
                                  .start_pos = p,
                                  .block_table = seq.block_table,
                                  .logits = TDM_LOGITS_ALL};
        assert_int_equal(tdm_model_forward(m, kv, &b, 1, out + (size_t)p * vocab), TDM_OK);
        tdm_kv_commit(kv, &seq, ids, p + take);
    }
    tdm_kv_seq_release(kv, &seq);
    check_kv_idle(kv);
    tdm_kv_free(kv);
}

static void test_chunked_prefill(void **state)
{
    (void)state;
    const char *dirs[2] = {model_dir, llama_dir};
    for (int d = 0; d < 2; d++) {
        struct tdm_model *m = load(dirs[d], TDM_WEIGHTS_BF16, 4);
        int vocab = tdm_model_config(m)->vocab_size, n = 45;
        int32_t ids[45];
        make_prompt(ids, n, vocab, 42);
        float *one = malloc((size_t)n * vocab * sizeof(float));
        float *chunks = malloc((size_t)n * vocab * sizeof(float));
        float *single = malloc((size_t)n * vocab * sizeof(float));
        assert_non_null(one);
        assert_non_null(chunks);
        assert_non_null(single);
        prefill_all(m, ids, n, n, one);
        prefill_all(m, ids, n, 7, chunks);
        prefill_all(m, ids, n, 1, single);
        float d1 = max_rel_diff(chunks, one, (size_t)n * vocab);
        float d2 = max_rel_diff(single, one, (size_t)n * vocab);
        print_message("model %d: chunks of 7 vs one chunk max|d|/std %.2e, token-by-token %.2e\n",
                      d, (double)d1, (double)d2);
        assert_true(d1 <= 1e-4f);
        assert_true(d2 <= 1e-4f);
        for (int i = 0; i < n; i++)
            assert_int_equal(argmax(one + (size_t)i * vocab, vocab),
                             argmax(single + (size_t)i * vocab, vocab));
        free(one);
        free(chunks);
        free(single);
        tdm_model_free(m);
    }
}

static void init_req(struct tdm_gen_request *r, const int32_t *prompt, int n, int max_tokens,
                     int32_t *out)
{
    memset(r, 0, sizeof *r);
    r->prompt = prompt;
    r->n_prompt = n;
    r->max_tokens = max_tokens;
    tdm_sampling_params_default(&r->params);
    r->params.temperature = 0;
    r->params.ignore_eos = true;
    r->out_ids = out;
}

static void test_prefix_cache(void **state)
{
    (void)state;
    char err[256];
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 4);
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_cache *kv = new_kv(m, 32, true);
    int32_t prompt[40], miss[12], hit[12];
    make_prompt(prompt, 40, vocab, 5);
    struct tdm_gen_request r;
    struct tdm_gen_opts go;
    tdm_gen_opts_default(&go);
    go.chunk = 16;

    init_req(&r, prompt, 40, 12, miss);
    r.use_prefix_cache = true;
    assert_int_equal(tdm_gen_run(m, kv, &r, 1, &go, NULL, err, sizeof err), TDM_OK);
    assert_int_equal(r.num_cached_tokens, 0);
    check_kv_idle(kv);

    init_req(&r, prompt, 40, 12, hit);
    r.use_prefix_cache = true;
    assert_int_equal(tdm_gen_run(m, kv, &r, 1, &go, NULL, err, sizeof err), TDM_OK);
    assert_int_equal(r.num_cached_tokens, 32); // two full blocks of the 40-token prompt
    assert_memory_equal(miss, hit, sizeof miss);
    uint64_t q, h;
    tdm_kv_prefix_stats(kv, &q, &h);
    assert_true(h >= 32);
    check_kv_idle(kv);
    tdm_kv_free(kv);
    tdm_model_free(m);
}

// Greedy decode of `steps` tokens for a sequence whose first `pos` tokens are
// in seq; hist holds them and receives the new tokens.
static void greedy_continue(struct tdm_model *m, struct tdm_kv_cache *kv, struct tdm_kv_seq *seq,
                            int32_t *hist, int pos, int steps, float *logits)
{
    int vocab = tdm_model_config(m)->vocab_size;
    for (int s = 0; s < steps; s++) {
        assert_int_equal(tdm_kv_reserve(kv, seq, pos + 1), TDM_OK);
        struct tdm_batch_seq b = {.tokens = hist + pos,
                                  .n_tokens = 1,
                                  .start_pos = pos,
                                  .block_table = seq->block_table,
                                  .logits = TDM_LOGITS_LAST};
        float *row = logits + (size_t)s * vocab;
        assert_int_equal(tdm_model_forward(m, kv, &b, 1, row), TDM_OK);
        pos++;
        tdm_kv_commit(kv, seq, hist, pos);
        hist[pos] = argmax(row, vocab);
    }
}

static void test_export_import(void **state)
{
    (void)state;
    char err[256];
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 4);
    const struct tdm_model_config *c = tdm_model_config(m);
    int vocab = c->vocab_size, n = 37, steps = 10;
    struct tdm_kv_cache *a = new_kv(m, 16, false), *b = new_kv(m, 16, false);
    int32_t hist_a[64], hist_b[64];
    make_prompt(hist_a, n, vocab, 9);
    float *la = malloc((size_t)(steps + 1) * vocab * sizeof(float));
    float *lb = malloc((size_t)(steps + 1) * vocab * sizeof(float));
    assert_non_null(la);
    assert_non_null(lb);

    // Prefill in A; the prompt's last logits pick the first token.
    struct tdm_kv_seq sa, sb;
    tdm_kv_seq_init(&sa);
    tdm_kv_seq_init(&sb);
    assert_int_equal(tdm_kv_reserve(a, &sa, n), TDM_OK);
    struct tdm_batch_seq bs = {.tokens = hist_a,
                               .n_tokens = n,
                               .start_pos = 0,
                               .block_table = sa.block_table,
                               .logits = TDM_LOGITS_LAST};
    assert_int_equal(tdm_model_forward(m, a, &bs, 1, la), TDM_OK);
    tdm_kv_commit(a, &sa, hist_a, n);
    hist_a[n] = argmax(la, vocab);
    memcpy(hist_b, hist_a, sizeof hist_a);

    // Export every layer of A's blocks, import into a fresh sequence of B.
    int nblocks = sa.num_blocks;
    size_t bytes = tdm_kv_layer_bytes(a, nblocks);
    void *buf = malloc(bytes);
    assert_non_null(buf);
    assert_int_equal(tdm_kv_reserve(b, &sb, n), TDM_OK);
    for (int l = 0; l < c->num_hidden_layers; l++) {
        assert_int_equal(tdm_kv_export_layer(a, &sa, l, 0, nblocks, buf, bytes), TDM_OK);
        assert_int_equal(tdm_kv_import_layer(b, &sb, l, 0, nblocks, buf, bytes), TDM_OK);
    }
    tdm_kv_commit(b, &sb, hist_b, n);
    free(buf);

    greedy_continue(m, a, &sa, hist_a, n, steps, la);
    greedy_continue(m, b, &sb, hist_b, n, steps, lb);
    assert_memory_equal(hist_a, hist_b, (size_t)(n + steps + 1) * sizeof(int32_t));
    assert_memory_equal(la, lb, (size_t)steps * vocab * sizeof(float));
    tdm_kv_seq_release(a, &sa);
    tdm_kv_seq_release(b, &sb);
    check_kv_idle(a);
    check_kv_idle(b);
    assert_int_equal(tdm_kv_check(a, err, sizeof err), TDM_OK);
    tdm_kv_free(a);
    tdm_kv_free(b);
    free(la);
    free(lb);
    tdm_model_free(m);
}

#define NB 16
#define NB_TOKENS 12

// Runs the batch-invariance check on the CPU path named by isa (NULL = best).
static void batch_invariance_on(const char *isa)
{
    char err[256];
    if (isa != NULL)
        setenv("TANDEM_CPU_ISA", isa, 1);
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, NB);
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_cache *kv = new_kv(m, 128, false);
    static int32_t prompts[NB][80];
    static int32_t out_batch[NB][NB_TOKENS], out_alone[NB][NB_TOKENS];
    float *lg_batch = malloc((size_t)NB * NB_TOKENS * vocab * sizeof(float));
    float *lg_alone = malloc((size_t)NB_TOKENS * vocab * sizeof(float));
    assert_non_null(lg_batch);
    assert_non_null(lg_alone);
    struct tdm_gen_request reqs[NB];
    int lens[NB];
    for (int i = 0; i < NB; i++) {
        lens[i] = 1 + (i * 13) % 70;
        make_prompt(prompts[i], lens[i], vocab, 100u + (uint32_t)i);
        init_req(&reqs[i], prompts[i], lens[i], NB_TOKENS, out_batch[i]);
        reqs[i].join_step = (i * 3) % 7; // later joiners prefill while others decode
        reqs[i].logits_out = lg_batch + (size_t)i * NB_TOKENS * vocab;
        if (i % 2 == 1) {
            reqs[i].params.temperature = 0.8f;
            reqs[i].params.top_p = 0.9f;
            reqs[i].params.has_seed = true;
            reqs[i].params.seed = 1000u + (uint64_t)i;
        }
    }
    struct tdm_gen_opts go;
    tdm_gen_opts_default(&go);
    go.chunk = 8;
    struct tdm_gen_stats st;
    assert_int_equal(tdm_gen_run(m, kv, reqs, NB, &go, &st, err, sizeof err), TDM_OK);
    assert_true(st.steps > NB_TOKENS);
    check_kv_idle(kv);

    for (int i = 0; i < NB; i++) {
        struct tdm_gen_request r = reqs[i];
        r.join_step = 0;
        r.out_ids = out_alone[i];
        r.logits_out = lg_alone;
        assert_int_equal(tdm_gen_run(m, kv, &r, 1, &go, NULL, err, sizeof err), TDM_OK);
        assert_int_equal(r.n_out, NB_TOKENS);
        assert_memory_equal(out_alone[i], out_batch[i], sizeof out_alone[i]);
        assert_memory_equal(lg_alone, lg_batch + (size_t)i * NB_TOKENS * vocab,
                            (size_t)NB_TOKENS * vocab * sizeof(float));
    }
    check_kv_idle(kv);
    tdm_kv_free(kv);
    free(lg_batch);
    free(lg_alone);
    tdm_model_free(m);
    unsetenv("TANDEM_CPU_ISA");
}

static void test_batch_invariance(void **state)
{
    (void)state;
    // The default path (amx where the CPU has it), AVX-512 beside it on an AMX
    // host (the path it serves on without AMX), and the reference path.
    bool amx = tdm_cpu_isa_best() == TDM_CPU_ISA_AMX;
    batch_invariance_on(NULL);
    if (amx)
        batch_invariance_on("avx512");
    batch_invariance_on("portable"); // the reference path of the CPU backend
    // The bf16 KV cache: each stored element is rounded on its own, so batch
    // invariance holds bit for bit there too.
    kv_dtype = TDM_KV_BF16;
    batch_invariance_on(NULL);
    if (amx)
        batch_invariance_on("avx512");
    batch_invariance_on("portable");
    kv_dtype = TDM_KV_F32;
}

// The fused argmax LM head (TDM_LOGITS_ARGMAX): the same token as the argmax
// of the logits row the same forward gives in LAST mode, rows of both modes
// mixed in one batch (LAST rows' logits unchanged bitwise), on every ISA path
// and on bf16 and int8 weights; and a batch of equal logits picks row 0.
static void fused_argmax_on(const char *isa, enum tdm_weight_mode mode)
{
    enum { NS = 10, LEN = 7 };
    if (isa != NULL)
        setenv("TANDEM_CPU_ISA", isa, 1);
    struct tdm_model *m = load(model_dir, mode, NS);
    assert_true(tdm_model_fused_argmax(m));
    int vocab = tdm_model_config(m)->vocab_size;
    int32_t prompts[NS][LEN], got[NS];
    float *ref = malloc((size_t)NS * vocab * sizeof(float));
    float *mixed = malloc((size_t)NS * vocab * sizeof(float));
    assert_non_null(ref);
    assert_non_null(mixed);
    for (int pass = 0; pass < 2; pass++) {
        struct tdm_kv_cache *kv = new_kv(m, 64, false);
        struct tdm_kv_seq seqs[NS];
        struct tdm_batch_seq b[NS];
        for (int i = 0; i < NS; i++) {
            make_prompt(prompts[i], LEN, vocab, 300u + (uint32_t)i);
            tdm_kv_seq_init(&seqs[i]);
            assert_int_equal(tdm_kv_reserve(kv, &seqs[i], LEN), TDM_OK);
            bool arg = pass == 1 && i % 3 != 1; // pass 1: ARGMAX except every third row
            got[i] = -7;
            b[i] = (struct tdm_batch_seq){.tokens = prompts[i],
                                          .n_tokens = LEN,
                                          .start_pos = 0,
                                          .block_table = seqs[i].block_table,
                                          .logits = arg ? TDM_LOGITS_ARGMAX : TDM_LOGITS_LAST,
                                          .token_out = arg ? &got[i] : NULL};
        }
        assert_int_equal(tdm_model_forward(m, kv, b, NS, pass == 0 ? ref : mixed), TDM_OK);
        for (int i = 0; i < NS; i++)
            tdm_kv_seq_release(kv, &seqs[i]);
        tdm_kv_free(kv);
    }
    for (int i = 0, row = 0; i < NS; i++) {
        const float *r = ref + (size_t)i * vocab;
        if (i % 3 == 1) {
            assert_memory_equal(mixed + (size_t)row++ * vocab, r, (size_t)vocab * sizeof(float));
            assert_int_equal(got[i], -7); // untouched
        } else {
            assert_int_equal(got[i], argmax(r, vocab));
        }
    }
    free(ref);
    free(mixed);
    tdm_model_free(m);
    unsetenv("TANDEM_CPU_ISA");
}

static void test_fused_argmax(void **state)
{
    (void)state;
    fused_argmax_on(NULL, TDM_WEIGHTS_BF16);
    fused_argmax_on(NULL, TDM_WEIGHTS_INT8);
    if (tdm_cpu_isa_best() == TDM_CPU_ISA_AMX)
        fused_argmax_on("avx512", TDM_WEIGHTS_BF16);
    fused_argmax_on("portable", TDM_WEIGHTS_BF16);
    // A mode the backend lacks, or no output pointer: refused.
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 2);
    struct tdm_kv_cache *kv = new_kv(m, 8, false);
    struct tdm_kv_seq s;
    tdm_kv_seq_init(&s);
    int32_t ids[3] = {1, 2, 3};
    assert_int_equal(tdm_kv_reserve(kv, &s, 3), TDM_OK);
    struct tdm_batch_seq b = {.tokens = ids,
                              .n_tokens = 3,
                              .start_pos = 0,
                              .block_table = s.block_table,
                              .logits = TDM_LOGITS_ARGMAX};
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, NULL), TDM_EINVAL);
    tdm_kv_seq_release(kv, &s);
    tdm_kv_free(kv);
    tdm_model_free(m);
}

// --device where the CUDA backend module is not to be found (main points
// TANDEM_BACKEND_PATH at an empty folder, in either build): cpu and auto give
// cpu, any cuda is a clear error naming the missing module, never a silent
// CPU fallback.
static char empty_dir[] = "/tmp/tdm_model_test_nomod_XXXXXX";
static void test_device_flag(void **state)
{
    (void)state;
    struct tdm_model_opts o;
    char err[512];
    tdm_model_opts_default(&o);
    assert_int_equal(tdm_model_opts_set_device(&o, "", err, sizeof err), TDM_OK);
    assert_string_equal(o.backend, "cpu");
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda", err, sizeof err), TDM_EINVAL);
    char want[256];
    snprintf(want, sizeof want,
             "--device cuda: no CUDA backend: libtandem-cuda.so not found (looked in %s; "
             "TANDEM_BACKEND_PATH names its folder)",
             empty_dir);
    assert_string_equal(err, want);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda:2", err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_model_opts_set_device(&o, "cuda:", err, sizeof err), TDM_EINVAL);
    assert_int_equal(tdm_model_opts_set_device(&o, "CPU", err, sizeof err), TDM_EINVAL);
}

static void test_runner_errors(void **state)
{
    (void)state;
    char err[256];
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 4);
    int vocab = tdm_model_config(m)->vocab_size;
    struct tdm_kv_cache *kv = new_kv(m, 4, false); // 64 tokens
    int32_t prompt[80], out[8];
    make_prompt(prompt, 80, vocab, 77);
    struct tdm_gen_request r[2];
    init_req(&r[0], prompt, 40, 8, out);
    init_req(&r[1], prompt, 80, 8, out);
    assert_int_equal(tdm_gen_run(m, kv, &r[1], 1, NULL, NULL, err, sizeof err), TDM_ECAPACITY);
    assert_non_null(strstr(err, "KV blocks"));
    check_kv_idle(kv); // the failed run released what it held
    assert_int_equal(tdm_gen_run(m, kv, r, 1, NULL, NULL, err, sizeof err), TDM_OK);
    prompt[3] = vocab;
    assert_int_equal(tdm_gen_run(m, kv, r, 1, NULL, NULL, err, sizeof err), TDM_EINVAL);
    assert_non_null(strstr(err, "outside the vocabulary"));
    prompt[3] = 1;
    r[0].max_tokens = 0;
    assert_int_equal(tdm_gen_run(m, kv, r, 1, NULL, NULL, err, sizeof err), TDM_EINVAL);
    r[0].max_tokens = 8;
    r[0].params.temperature = -1;
    assert_int_equal(tdm_gen_run(m, kv, r, 1, NULL, NULL, err, sizeof err), TDM_EINVAL);
    check_kv_idle(kv);
    tdm_kv_free(kv);
    tdm_model_free(m);
}

static void test_int8_agrees(void **state)
{
    (void)state;
    char err[256];
    struct tdm_model *bf = load(model_dir, TDM_WEIGHTS_BF16, 4);
    struct tdm_model *q8 = load(model_dir, TDM_WEIGHTS_INT8, 4);
    int vocab = tdm_model_config(bf)->vocab_size;
    int agree = 0, total = 0;
    for (int p = 0; p < 6; p++) {
        int n = 5 + 11 * p, steps = 16;
        int32_t hist[128], out[16];
        make_prompt(hist, n, vocab, 300u + (uint32_t)p);
        struct tdm_kv_cache *kv = new_kv(bf, 16, false);
        struct tdm_gen_request r;
        init_req(&r, hist, n, steps, out);
        assert_int_equal(tdm_gen_run(bf, kv, &r, 1, NULL, NULL, err, sizeof err), TDM_OK);
        memcpy(hist + n, out, sizeof out);
        // Teacher-forced int8 pass over the bf16 continuation: agreement per step.
        float *lg = malloc((size_t)(n + steps) * vocab * sizeof(float));
        assert_non_null(lg);
        prefill_all(q8, hist, n + steps - 1, 64, lg);
        for (int s = 0; s < steps; s++) {
            agree += argmax(lg + (size_t)(n - 1 + s) * vocab, vocab) == out[s];
            total++;
        }
        free(lg);
        check_kv_idle(kv);
        tdm_kv_free(kv);
    }
    print_message("int8 vs bf16 greedy: %d of %d steps agree (%.1f%%)\n", agree, total,
                  100.0 * agree / total);
    assert_true(agree * 10 >= total * 8);
    assert_true(tdm_model_weight_bytes(q8) < tdm_model_weight_bytes(bf));
    tdm_model_free(bf);
    tdm_model_free(q8);
}

static void test_bad_batches(void **state)
{
    (void)state;
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 2);
    const struct tdm_model_config *c = tdm_model_config(m);
    struct tdm_kv_cache *kv = new_kv(m, 8, false);
    struct tdm_kv_seq seq;
    tdm_kv_seq_init(&seq);
    assert_int_equal(tdm_kv_reserve(kv, &seq, 4), TDM_OK);
    float *logits = malloc((size_t)4 * c->vocab_size * sizeof(float));
    int32_t ids[4] = {1, 2, 3, 4};
    struct tdm_batch_seq b = {.tokens = ids,
                              .n_tokens = 4,
                              .start_pos = 0,
                              .block_table = seq.block_table,
                              .logits = TDM_LOGITS_ALL};
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_OK);
    ids[2] = c->vocab_size;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    ids[2] = -1;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    ids[2] = 3;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, NULL), TDM_EINVAL);
    b.start_pos = c->max_position_embeddings - 2;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    b.start_pos = 0;
    b.n_tokens = 0;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    b.n_tokens = 4;
    b.prompt_len = -1;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    b.prompt_len = 4; // a prompt's rows: the same numbers on the CPU (one algorithm)
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_OK);
    struct tdm_batch_seq three[3] = {b, b, b};
    assert_int_equal(tdm_model_forward(m, kv, three, 3, logits), TDM_EINVAL); // max_batch_seqs 2
    int bad_table[1] = {999};
    b.block_table = bad_table;
    assert_int_equal(tdm_model_forward(m, kv, &b, 1, logits), TDM_EINVAL);
    tdm_kv_seq_release(kv, &seq);
    check_kv_idle(kv);
    tdm_kv_free(kv);
    free(logits);
    tdm_model_free(m);
}

// The per-layer hook: called once per layer in order for the sequence that set
// it only, after that layer's KV is written and before the next layer's is.
struct layer_probe {
    struct tdm_kv_cache *kv;
    int block;      // the probed sequence's (only) block
    int calls;      // hook calls so far
    bool in_order;  // layer == calls at every call
    bool written;   // layer l's K was nonzero at its call
    bool next_zero; // layer l+1's K was still zero at layer l's call
    int floats;     // floats of one block of one layer (K)
};

static bool block_nonzero(const float *p, int n)
{
    for (int i = 0; i < n; i++)
        if (p[i] != 0.0f)
            return true;
    return false;
}

static void probe_layer(void *arg, int layer)
{
    struct layer_probe *pr = arg;
    const struct tdm_kv_config *kc = tdm_kv_config(pr->kv);
    pr->in_order &= layer == pr->calls;
    pr->calls++;
    pr->written &= block_nonzero(tdm_kv_k(pr->kv, layer, pr->block), pr->floats);
    if (layer + 1 < kc->num_layers)
        pr->next_zero &= !block_nonzero(tdm_kv_k(pr->kv, layer + 1, pr->block), pr->floats);
}

static void test_layer_hook(void **state)
{
    (void)state;
    struct tdm_model *m = load(model_dir, TDM_WEIGHTS_BF16, 2);
    const struct tdm_model_config *c = tdm_model_config(m);
    struct tdm_kv_cache *kv = new_kv(m, 8, false);
    struct tdm_kv_seq a, b;
    tdm_kv_seq_init(&a);
    tdm_kv_seq_init(&b);
    assert_int_equal(tdm_kv_reserve(kv, &a, 5), TDM_OK);
    assert_int_equal(tdm_kv_reserve(kv, &b, 7), TDM_OK);
    int32_t ids[7] = {1, 2, 3, 4, 5, 6, 7};
    struct layer_probe pr = {.kv = kv,
                             .block = b.block_table[0],
                             .in_order = true,
                             .written = true,
                             .next_zero = true,
                             .floats = c->num_key_value_heads * 16 * c->head_dim};
    struct tdm_batch_seq batch[2] = {
        {.tokens = ids, .n_tokens = 5, .block_table = a.block_table, .logits = TDM_LOGITS_LAST},
        {.tokens = ids,
         .n_tokens = 7,
         .block_table = b.block_table,
         .logits = TDM_LOGITS_LAST,
         .on_layer = probe_layer,
         .layer_arg = &pr}};
    float *logits = malloc((size_t)2 * c->vocab_size * sizeof(float));
    assert_int_equal(tdm_model_forward(m, kv, batch, 2, logits), TDM_OK);
    assert_int_equal(pr.calls, c->num_hidden_layers);
    assert_true(pr.in_order);
    assert_true(pr.written);
    assert_true(pr.next_zero);
    // A batch the forward refuses calls no hook.
    pr.calls = 0;
    batch[1].n_tokens = 0;
    assert_int_equal(tdm_model_forward(m, kv, batch, 2, logits), TDM_EINVAL);
    assert_int_equal(pr.calls, 0);
    tdm_kv_seq_release(kv, &a);
    tdm_kv_seq_release(kv, &b);
    tdm_kv_free(kv);
    free(logits);
    tdm_model_free(m);
}

static void test_load_errors(void **state)
{
    (void)state;
    char dir[] = "/tmp/tdm_model_badXXXXXX";
    char err[256];
    struct tdm_mkmodel_spec s;
    struct tdm_model *m = NULL;
    assert_non_null(mkdtemp(dir));
    tdm_mkmodel_preset(&s, "tiny");
    assert_int_equal(tdm_mkmodel_write(&s, dir, err, sizeof err), TDM_OK);
    // A config that disagrees with the checkpoint: shapes are checked by name.
    char path[128];
    snprintf(path, sizeof path, "%s/config.json", dir);
    char *text;
    size_t len;
    assert_int_equal(tdm_read_file(path, &text, &len, err, sizeof err), TDM_OK);
    char *p = strstr(text, "\"intermediate_size\": 128");
    assert_non_null(p);
    memcpy(p, "\"intermediate_size\": 120", 24);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fwrite(text, 1, len, f);
    fclose(f);
    assert_int_equal(tdm_model_load(&m, dir, NULL, err, sizeof err), TDM_EINVAL);
    assert_null(m);
    assert_non_null(strstr(err, "mlp"));
    // An untied config over a tied checkpoint: lm_head.weight is missing.
    memcpy(p, "\"intermediate_size\": 128", 24);
    char *t = strstr(text, "\"tie_word_embeddings\": true");
    assert_non_null(t);
    memcpy(t, "\"tie_word_embeddings\":false", 27);
    f = fopen(path, "w");
    assert_non_null(f);
    fwrite(text, 1, len, f);
    fclose(f);
    assert_int_equal(tdm_model_load(&m, dir, NULL, err, sizeof err), TDM_ENOTFOUND);
    assert_non_null(strstr(err, "lm_head"));
    free(text);
    struct tdm_model_opts o;
    tdm_model_opts_default(&o);
    o.backend = "no-such-backend";
    assert_int_equal(tdm_model_load(&m, dir, &o, err, sizeof err), TDM_EINVAL);
    tdm_mkmodel_remove(dir);
    assert_int_equal(tdm_model_load(&m, dir, NULL, err, sizeof err) != TDM_OK, 1);
}

int main(void)
{
    // No device module is found, whatever was built (test_device_flag).
    if (mkdtemp(empty_dir) == NULL || setenv("TANDEM_BACKEND_PATH", empty_dir, 1) != 0)
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_prefill), cmocka_unit_test(test_prefix_cache),
        cmocka_unit_test(test_export_import),   cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_int8_agrees),     cmocka_unit_test(test_bad_batches),
        cmocka_unit_test(test_load_errors),     cmocka_unit_test(test_layer_hook),
        cmocka_unit_test(test_runner_errors),   cmocka_unit_test(test_device_flag),
        cmocka_unit_test(test_fused_argmax),
    };
    int rc = tdm_test_exit(cmocka_run_group_tests(tests, setup, teardown));
    rmdir(empty_dir);
    return rc;
}
