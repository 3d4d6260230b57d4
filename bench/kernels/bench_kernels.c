// SPDX-License-Identifier: Apache-2.0
// tandem-bench-kernels: measures, in one run, the machine's limits (read
// bandwidth of a 1 GiB buffer, f32 FMA and bf16 dot-product peaks) and the CPU
// backend's matmul against them, printing one line per ratio:
//   gemv_bf16_vs_read   a decode step's matmuls over Qwen2.5-0.5B-shaped bf16
//                       weights (~990 MB) / the time to read those bytes (goal <= 1.3)
//   gemv_q8_vs_read     the same with int8 weights
//   gemm512_<shape>     n = 512 FLOP/s / bf16 dot-product peak (goal >= 0.5)
//   batch32_speedup     tokens/s at n = 32 / tokens/s at n = 1 over the whole
//                       weight set (goal >= 10)
//   attn4096_b32_*      decode attention at 4096 tokens of context, batch 32, per
//                       KV cache dtype, against its FLOP and byte bounds
// Usage: tandem-bench-kernels [--threads N] [--isa portable|avx2|avx512|amx] [--quick]
// [--attention-only] (--quick: a 4-layer model, for smoke runs). Absolute numbers change with
// the host; the ratios within one run are what this bench is for.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "core.h"
#include "cpu_backend.h"
#include "cpu_probe.h"
#include "kv_cache.h"

// Qwen2.5-0.5B: hidden 896, intermediate 4864, 14 + 2 + 2 heads of 64.
#define HIDDEN 896
#define INTER 4864
#define QKV_ROWS (896 + 2 * 128)
#define VOCAB 151936

static const struct tdm_backend_ops *ops = &tdm_cpu_backend_ops;

struct model_set {
    int n;                // matrices
    struct tdm_weight *w; // [n]
    size_t bytes;         // sum of nbytes
};

static void die(const char *what, const char *err)
{
    fprintf(stderr, "tandem-bench-kernels: %s: %s\n", what, err);
    exit(1);
}

static void prepare(struct tdm_backend *be, struct tdm_weight *w, const uint16_t *src, int rows,
                    int cols, enum tdm_wtype t)
{
    struct tdm_weight_src part = {.data = src, .dtype = TDM_DTYPE_BF16, .rows = rows};
    char err[256];
    if (ops->prepare_weight(be, w, &part, 1, cols, t, err, sizeof err) != TDM_OK)
        die("prepare_weight", err);
}

static void build_set(struct tdm_backend *be, struct model_set *m, int layers, const uint16_t *src,
                      enum tdm_wtype t)
{
    m->n = layers * 4 + 1;
    m->w = calloc((size_t)m->n, sizeof(*m->w));
    m->bytes = 0;
    if (!m->w)
        die("calloc", "out of memory");
    for (int l = 0; l < layers; l++) {
        prepare(be, &m->w[4 * l + 0], src, QKV_ROWS, HIDDEN, t);
        prepare(be, &m->w[4 * l + 1], src, HIDDEN, HIDDEN, t);
        prepare(be, &m->w[4 * l + 2], src, 2 * INTER, HIDDEN, t);
        prepare(be, &m->w[4 * l + 3], src, HIDDEN, INTER, t);
    }
    prepare(be, &m->w[m->n - 1], src, VOCAB, HIDDEN, t);
    for (int i = 0; i < m->n; i++)
        m->bytes += m->w[i].nbytes;
}

static void free_set(struct tdm_backend *be, struct model_set *m)
{
    for (int i = 0; i < m->n; i++)
        ops->release_weight(be, &m->w[i]);
    free(m->w);
}

// Seconds for one pass of every matrix of the set at batch n (best of reps).
static double time_set(struct tdm_backend *be, const struct model_set *m, const float *x, float *y,
                       int n, int reps)
{
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = tdm_now();
        for (int i = 0; i < m->n; i++)
            ops->matmul(be, &m->w[i], NULL, x, y, n);
        double s = tdm_now() - t0;
        if (s < best)
            best = s;
    }
    return best;
}

// (f) Decode attention at long context: ATTN_BATCH sequences of ATTN_CTX
// tokens each, Qwen2.5-0.5B's heads (14 query heads on 2 KV heads of 64), one
// query token per sequence, over ATTN_LAYERS layers of a paged pool whose
// blocks interleave the sequences (as concurrent decodes allocate them). Its
// bounds: the FLOPs (q.k and p.v, 4 per head, dim and key) at the f32 FMA
// peak, and the pool's bytes at the read bandwidth. Returns seconds per layer.
#define ATTN_HEADS 14
#define ATTN_KV_HEADS 2
#define ATTN_HD 64
#define ATTN_LAYERS 4
static double time_attention(struct tdm_backend *be, enum tdm_kv_dtype dtype, int batch, int ctx,
                             int reps)
{
    int bs = 16, per_seq = (ctx + bs - 1) / bs;
    struct tdm_kv_config c = {.num_layers = ATTN_LAYERS,
                              .num_kv_heads = ATTN_KV_HEADS,
                              .head_dim = ATTN_HD,
                              .block_size = bs,
                              .num_blocks = batch * per_seq,
                              .dtype = dtype};
    struct tdm_kv_cache *kv = NULL;
    char err[256];
    if (tdm_kv_new(&kv, &c, err, sizeof err) != TDM_OK)
        die("kv", err);
    int *tables = malloc(sizeof(int) * (size_t)batch * per_seq);
    struct tdm_attn_seq *seqs = calloc((size_t)batch, sizeof *seqs);
    size_t qn = (size_t)batch * ATTN_HEADS * ATTN_HD;
    float *q = malloc(sizeof(float) * qn), *out = malloc(sizeof(float) * qn);
    float *row = malloc(sizeof(float) * (size_t)bs * ATTN_HD);
    if (!tables || !seqs || !q || !out || !row)
        die("malloc", "out of memory");
    uint64_t r = 0x9e3779b97f4a7c15ull;
#define NEXT_RAND() (r ^= r << 13, r ^= r >> 7, r ^= r << 17, (float)(r >> 40) / 16777216.0f - 0.5f)
    for (size_t i = 0; i < qn; i++)
        q[i] = NEXT_RAND();
    for (int b = 0; b < c.num_blocks; b++)
        for (int l = 0; l < ATTN_LAYERS; l++)
            for (int kvv = 0; kvv < 2; kvv++)
                for (int h = 0; h < ATTN_KV_HEADS; h++) {
                    for (int i = 0; i < bs * ATTN_HD; i++)
                        row[i] = NEXT_RAND();
                    size_t off = (size_t)h * bs * ATTN_HD;
                    void *dst = dtype == TDM_KV_BF16
                                    ? (void *)((kvv ? tdm_kv_v_bf16(kv, l, b) : tdm_kv_k_bf16(kv, l, b)) + off)
                                    : (void *)((kvv ? tdm_kv_v(kv, l, b) : tdm_kv_k(kv, l, b)) + off);
                    tdm_kv_convert(dst, dtype, row, TDM_KV_F32, (size_t)bs * ATTN_HD);
                }
#undef NEXT_RAND
    for (int s = 0; s < batch; s++) {
        for (int i = 0; i < per_seq; i++)
            tables[s * per_seq + i] = i * batch + s;
        seqs[s] = (struct tdm_attn_seq){
            .row = s, .n_tokens = 1, .start_pos = ctx - 1, .block_table = tables + s * per_seq};
    }
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = tdm_now();
        for (int l = 0; l < ATTN_LAYERS; l++)
            ops->attention(be, kv, l, seqs, batch, q, ATTN_HEADS * ATTN_HD, out, ATTN_HEADS,
                           ATTN_KV_HEADS, ATTN_HD, 0.125f);
        double t = (tdm_now() - t0) / ATTN_LAYERS;
        best = t < best ? t : best;
    }
    free(tables), free(seqs), free(q), free(out), free(row);
    tdm_kv_free(kv);
    return best;
}

// (f) Long-context decode attention against its bounds, per KV dtype (fma in
// FLOP/s, bw in bytes/s, from the probes).
static void report_attention(struct tdm_backend *be, bool quick, double fma, double bw)
{
    int batch = quick ? 8 : 32, ctx = 4096;
    double ta[2] = {1e30, 1e30};
    for (int rr = 0; rr < (quick ? 1 : 3); rr++)
        for (int d = 0; d < 2; d++) {
            double t = time_attention(be, d ? TDM_KV_BF16 : TDM_KV_F32, batch, ctx, 3);
            ta[d] = t < ta[d] ? t : ta[d];
        }
    double flops = 4.0 * ATTN_HEADS * ATTN_HD * (double)ctx * batch;
    for (int d = 0; d < 2; d++) {
        double bytes = 2.0 * ATTN_KV_HEADS * ATTN_HD * (double)ctx * batch * (d ? 2 : 4);
        double bound = flops / fma > bytes / bw ? flops / fma : bytes / bw;
        printf("attn%d_b%d_%s_ms_per_layer %.3f GFLOPs %.1f vs_fma_peak %.3f vs_read %.3f "
               "vs_bound %.2f\n",
               ctx, batch, d ? "bf16" : "f32", ta[d] * 1e3, flops / ta[d] / 1e9,
               flops / ta[d] / fma, bytes / bw / ta[d], ta[d] / bound);
    }
    printf("attn%d_b%d_bf16_vs_f32_speedup %.2f\n", ctx, batch, ta[0] / ta[1]);
}

struct bench_args {
    int threads;
    const char *isa_name;
    bool quick;
    bool attention_only;
};

#define OFF(field) offsetof(struct bench_args, field)
static const struct tdm_flag bench_flags[] = {
    {.name = "threads",
     .kind = TDM_FLAG_INT,
     .offset = OFF(threads),
     .min = 0,
     .max = 1024,
     .metavar = "N",
     .help = "compute threads (default 0: one per core)"},
    {.name = "isa",
     .kind = TDM_FLAG_PTR,
     .offset = OFF(isa_name),
     .metavar = "portable|avx2|avx512|amx",
     .help = "kernel set (default: the best this CPU has)"},
    {.name = "quick", .kind = TDM_FLAG_BOOL, .offset = OFF(quick), .help = "fewer repetitions"},
    {.name = "attention-only",
     .kind = TDM_FLAG_BOOL,
     .offset = OFF(attention_only),
     .help = "only the long-context attention lines (and the probes they need)"},
};
static const struct tdm_flags bench_table = {
    .usage = "usage: tandem-bench-kernels [--threads N] [--isa portable|avx2|avx512|amx] [--quick] "
             "[--attention-only]\n",
    .flags = bench_flags,
    .n = sizeof bench_flags / sizeof bench_flags[0],
};

int main(int argc, char **argv)
{
    struct bench_args a = {.threads = 0};
    int exit_code = 0;
    if (tdm_flags_main(&bench_table, &a, argc, argv, NULL, 0, NULL, "tandem-bench-kernels",
                       &exit_code))
        return exit_code;
    int threads = a.threads, quick = a.quick;
    const char *isa_name = a.isa_name;
    tdm_log_set_level_name("warn");
    struct tdm_backend *be = NULL;
    char err[256];
    if (ops->create(&be, threads, 0, err, sizeof err) != TDM_OK)
        die("create", err);
    if (isa_name) {
        enum tdm_cpu_isa isa;
        if (tdm_cpu_isa_parse(isa_name, &isa) != TDM_OK ||
            tdm_cpu_backend_set_isa(be, isa) != TDM_OK)
            die("--isa", "unknown or unsupported on this CPU");
    }
    int nt = tdm_cpu_backend_num_threads(be);
    printf("isa %s threads %d\n", tdm_cpu_isa_name(tdm_cpu_backend_isa(be)), nt);
    if (a.attention_only) {
        double bw = 0, fma = 0;
        for (int r = 0; r < 2; r++) {
            double b = tdm_cpu_probe_read_bw((size_t)1 << 30, nt, 1), f = tdm_cpu_probe_fma_peak(nt);
            bw = b > bw ? b : bw;
            fma = f > fma ? f : fma;
        }
        printf("read_bw_GBps %.2f fma_peak_GFLOPs %.1f\n", bw / 1e9, fma / 1e9);
        report_attention(be, a.quick, fma, bw);
        ops->destroy(be);
        return 0;
    }

    // Random bf16 weights in [-0.5, 0.5) for the largest matrix, shared by all.
    size_t src_n = (size_t)VOCAB * HIDDEN;
    uint16_t *src = malloc(src_n * sizeof(uint16_t));
    float *x = malloc(sizeof(float) * 512 * INTER);
    float *y = malloc(sizeof(float) * 512 * (size_t)VOCAB);
    if (!src || !x || !y)
        die("malloc", "out of memory");
    uint64_t s = 88172645463325252ull;
    for (size_t i = 0; i < src_n; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        float f = (float)((double)(s >> 40) / (double)(1ull << 24) - 0.5);
        uint32_t u;
        memcpy(&u, &f, 4);
        src[i] = (uint16_t)(u >> 16);
    }
    for (size_t i = 0; i < (size_t)512 * INTER; i++)
        x[i] = (float)((i * 2654435761u) % 1000) / 500.0f - 1.0f;

    // The machine may be shared with other work: each limit and each kernel is
    // measured in interleaved rounds and the best of each is kept, so a busy
    // moment hits both sides of a ratio alike instead of one of them.
    int rounds = quick ? 3 : 8;
    int layers = quick ? 4 : 24;
    double bw = 0;

    // (a) read bandwidth vs (c) decode GEMV over the same bytes; (e) batch 32.
    struct model_set m;
    build_set(be, &m, layers, src, TDM_W_BF16);
    double t1 = 1e30, t32 = 1e30;
    for (int r = 0; r < rounds; r++) {
        double b = tdm_cpu_probe_read_bw((size_t)1 << 30, nt, 1);
        bw = b > bw ? b : bw;
        double t = time_set(be, &m, x, y, 1, 2);
        t1 = t < t1 ? t : t1;
        if (r < rounds / 2 + 1) {
            t = time_set(be, &m, x, y, 32, 1);
            t32 = t < t32 ? t : t32;
        }
    }
    printf("read_bw_GBps %.2f\n", bw / 1e9);
    double t_read = (double)m.bytes / bw;
    printf("gemv_bf16_MB %.0f time_ms %.2f read_time_ms %.2f\n", m.bytes / 1e6, t1 * 1e3,
           t_read * 1e3);
    printf("gemv_bf16_vs_read %.3f (goal <= 1.3)\n", t1 / t_read);
    printf("batch32_time_ms %.2f batch1_time_ms %.2f\n", t32 * 1e3, t1 * 1e3);
    printf("batch32_speedup %.2f (goal >= 10)\n", 32.0 * t1 / t32);
    free_set(be, &m);

    build_set(be, &m, layers, src, TDM_W_Q8);
    double tq = 1e30;
    for (int r = 0; r < rounds; r++) {
        double b = tdm_cpu_probe_read_bw((size_t)1 << 30, nt, 1);
        bw = b > bw ? b : bw;
        double t = time_set(be, &m, x, y, 1, 2);
        tq = t < tq ? t : tq;
    }
    t_read = (double)m.bytes / bw;
    printf("gemv_q8_MB %.0f time_ms %.2f read_time_ms %.2f (read_bw_GBps %.2f)\n", m.bytes / 1e6,
           tq * 1e3, t_read * 1e3, bw / 1e9);
    printf("gemv_q8_vs_read %.3f\n", tq / t_read);
    free_set(be, &m);

    // (b) compute peaks vs (d) prefill-sized GEMM, probed before and after.
    static const int shapes[2][2] = {{INTER, HIDDEN}, {HIDDEN, INTER}};
    struct tdm_weight w[2];
    double best[2] = {1e30, 1e30};
    for (int i = 0; i < 2; i++) {
        prepare(be, &w[i], src, shapes[i][0], shapes[i][1], TDM_W_BF16);
        ops->matmul(be, &w[i], NULL, x, y, 512); // warm
    }
    double fma = 0, bf16 = 0;
    for (int r = 0; r < 2; r++) {
        double f = tdm_cpu_probe_fma_peak(nt), b = tdm_cpu_probe_bf16_peak(nt);
        fma = f > fma ? f : fma;
        bf16 = b > bf16 ? b : bf16;
        for (int k = 0; k < (quick ? 2 : 3); k++) {
            for (int i = 0; i < 2; i++) {
                double t0 = tdm_now();
                ops->matmul(be, &w[i], NULL, x, y, 512);
                double dt = tdm_now() - t0;
                best[i] = dt < best[i] ? dt : best[i];
            }
        }
    }
    printf("fma_peak_GFLOPs %.1f\n", fma / 1e9);
    printf("bf16_dot_peak_GFLOPs %.1f\n", bf16 / 1e9);
    for (int i = 0; i < 2; i++) {
        double flops = 2.0 * 512 * shapes[i][0] * shapes[i][1] / best[i];
        printf("gemm512_%dx%d_GFLOPs %.1f\n", shapes[i][0], shapes[i][1], flops / 1e9);
        printf("gemm512_%dx%d_vs_bf16_peak %.3f (goal >= 0.5)\n", shapes[i][0], shapes[i][1],
               bf16 > 0 ? flops / bf16 : 0.0);
        printf("gemm512_%dx%d_vs_fma_peak %.3f\n", shapes[i][0], shapes[i][1],
               fma > 0 ? flops / fma : 0.0);
        ops->release_weight(be, &w[i]);
    }
    report_attention(be, quick, fma, bw);
    free(src), free(x), free(y);
    ops->destroy(be);
    return 0;
}
