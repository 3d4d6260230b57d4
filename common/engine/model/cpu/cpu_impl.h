// SPDX-License-Identifier: Apache-2.0
// cpu_impl: internals shared by the CPU backend's files: the backend object,
// the thread pool, the packed weight layout and the per-ISA kernel table.
//
// Packed weight layout (every dtype, every ISA path): rows are grouped in
// blocks of CPU_BLOCK_ROWS = 64 rows = 4 panels of 16 rows; the last block keeps
// only the panels it needs (G = ceil(rows_left / 16)), padding rows are zero.
// Inside a block the reduction index is outermost, so one k step of all G
// panels is a contiguous G * 64-byte run:
//   BF16: [kp = ceil(cols/2)][G][16 rows][2] bf16  (a k pair per 32-bit lane, as
//         vdpbf16ps consumes it; odd cols padded with a zero)
//   Q8:   [kq = ceil(cols/32)*8][G][16 rows][4] int8 (a k quad per 32-bit lane,
//         as vpdpbusd consumes it; cols padded with zeros to a multiple of 32),
//         scales [nblocks*64] f32 (0 for padding rows)
//   F32:  [cols][G][16 rows] f32
// A 16-lane vector therefore holds one k (pair) of 16 output rows: every
// output element accumulates in its own lane over k in order and no
// horizontal reduction exists, so the result of an element depends on its row
// and its token only, never on the tile or batch it is computed in.
#ifndef TDM_CPU_IMPL_H
#define TDM_CPU_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "backend.h"
#include "cpu_backend.h"

// Version of the packed layout above and of the Q8 quantization: bump it on
// any change to what prepare_weight writes, so packed-weight cache files of
// the old layout (common/engine/model/weight_cache.h) are never used.
#define CPU_LAYOUT_VERSION 1
#define CPU_PANEL_ROWS 16
#define CPU_BLOCK_PANELS 4
#define CPU_BLOCK_ROWS (CPU_PANEL_ROWS * CPU_BLOCK_PANELS)
// Tokens converted and multiplied per pass of matmul (bounds the scratch).
#define CPU_MM_CHUNK_TOKENS 512
// Bytes ahead of a weight stream that a kernel reading it without the next-
// block prefetch (decode, small batches) prefetches into L2, a line per line
// it reads, on Intel CPUs (cpu_mm_args.stream_prefetch). On Sapphire Rapids
// the hardware prefetchers alone kept one core's stream at ~75% of the read
// probe's rate (a 272 MB GEMV at n = 1 on one core: 11.4 GB/s against the
// probe's 15.4; 13.4-14.1 with 1-2 KiB, 14.7 with 4 KiB, 14.3-14.6 with 6-8
// KiB); on Zen 4 the stream ran at the probe's rate without it, and a
// software prefetch 8 KiB ahead into L1 measured slower there. The AMX
// kernel, which takes a whole 4 KiB chunk per tile pass, prefetches from half
// of this past the next chunk (15.0-15.2 GB/s there; 13.5 at the next
// chunk's start, 13.2-13.5 a whole chunk further).
#define CPU_STREAM_PREFETCH 4096
// Positions scored together in attention (a chunk never crosses a KV block).
#define CPU_ATTN_CHUNK 16
// Query tokens per attention task in prefill.
#define CPU_ATTN_TASK_TOKENS 16
// Query heads of one GQA group handled together: the group shares each K/V
// chunk, read once from L2 into L1 for all of them.
#define CPU_ATTN_MAX_GROUP 8
// Keys per online-softmax step: positions [k * CPU_ATTN_SPAN, (k + 1) *
// CPU_ATTN_SPAN) are scored, then rescaled, exponentiated and accumulated
// together (one rescale and one exp of the running max per span).
#define CPU_ATTN_SPAN 128
// Largest head_dim the tile attention (cpu_kernels.attn_tile) takes; a larger
// one runs the per-query kernels on every path.
#define CPU_ATTN_TILE_MAX_HD 256

// ---- thread pool ---------------------------------------------------------------------
// fn runs once on every thread (tid 0 is the caller) and returns before
// cpu_pool_run does. The pool is driven by one thread at a time.
typedef void (*cpu_task_fn)(void *arg, int tid, int nthreads);
struct cpu_pool;
int cpu_pool_new(struct cpu_pool **out, int nthreads);
void cpu_pool_free(struct cpu_pool *p);
void cpu_pool_run(struct cpu_pool *p, cpu_task_fn fn, void *arg);
int cpu_pool_size(const struct cpu_pool *p);

// ---- matmul arguments and weight geometry ------------------------------------------------
struct cpu_mm_args {
    const struct tdm_weight *w;
    const float *bias; // [rows] or NULL
    const float *x;    // [n][cols] f32
    // Activations converted by mm_prep_x, [n][xq_stride] uint32 per token:
    // BF16 weights: bf16 pairs; Q8 weights: int8 [kpad], then f32 scale and
    // int32 sum of each 32-k block. NULL when the path reads f32 x.
    const uint32_t *xq;
    size_t xq_stride;
    float *y; // [n][rows], or a tile of the rows (y_stride, y_row0)
    int n;
    // Where row r of token t goes: y + t * y_stride + (r - y_row0). 0 and 0 for
    // the whole output; the fused argmax has mm_blocks write each chunk of rows
    // into a small per-thread tile instead (y_row0 its first row).
    size_t y_stride;
    int y_row0;
    // Whether a kernel streaming a weight from memory (decode, small batches)
    // prefetches CPU_STREAM_PREFETCH ahead of its reads (tdm_backend's
    // stream_prefetch).
    bool stream_prefetch;
};

static inline float *cpu_mm_y(const struct cpu_mm_args *a, int t, int r0)
{
    size_t stride = a->y_stride ? a->y_stride : (size_t)a->w->rows;
    return a->y + (size_t)t * stride + (r0 - a->y_row0);
}

static inline int cpu_w_blocks(const struct tdm_weight *w)
{
    return (w->rows + CPU_BLOCK_ROWS - 1) / CPU_BLOCK_ROWS;
}

// Panels stored in block b.
static inline int cpu_w_block_panels(const struct tdm_weight *w, int b)
{
    int left = w->rows - b * CPU_BLOCK_ROWS;
    int g = (left + CPU_PANEL_ROWS - 1) / CPU_PANEL_ROWS;
    return g < CPU_BLOCK_PANELS ? g : CPU_BLOCK_PANELS;
}

// Bytes of one k step (BF16: one k pair) of one panel.
static inline size_t cpu_w_step_bytes(enum tdm_wtype t)
{
    (void)t;
    return 64;
}

// Activation quantization block of the AVX-512 Q8 path (one scale per 32 k).
#define CPU_Q8_BLOCK 32

// Columns of a Q8 row including the zero padding.
static inline int cpu_q8_kpad(int cols)
{
    return (cols + CPU_Q8_BLOCK - 1) / CPU_Q8_BLOCK * CPU_Q8_BLOCK;
}

// k steps per row: pairs for BF16, quads for Q8, columns for F32.
static inline int cpu_w_steps(const struct tdm_weight *w)
{
    return w->type == TDM_W_BF16 ? (w->cols + 1) / 2
           : w->type == TDM_W_Q8 ? cpu_q8_kpad(w->cols) / 4
                                 : w->cols;
}

// Start of block b inside w->data.
static inline const uint8_t *cpu_w_block(const struct tdm_weight *w, int b)
{
    size_t full = (size_t)cpu_w_steps(w) * CPU_BLOCK_PANELS * cpu_w_step_bytes(w->type);
    return (const uint8_t *)w->data + (size_t)b * full;
}

// ---- attention job ---------------------------------------------------------------------------
struct tdm_kv_cache;
struct tdm_attn_seq;
// One attention call (cpu_backend.c's cpu_attention), shared by its tasks.
struct cpu_attn_job {
    struct tdm_kv_cache *kv;
    const struct cpu_kernels *k;
    int layer;
    const struct tdm_attn_seq *seqs;
    int n_seqs;
    const float *q;
    int q_stride;
    float *out;
    int n_heads, n_kv_heads, head_dim;
    float scale;
    int block_size;
    bool bf16;             // the pool holds bf16 (else f32)
    const int *task_start; // [n_seqs + 1] prefix sums of tasks per sequence
    _Atomic int next;
    // attn_tile's per-thread scratch: cpu_attn_tile_scratch(head_dim) bytes a
    // thread, 64-aligned; NULL when the path has no attn_tile.
    uint8_t *tile_scratch;
};

// Bytes of attn_tile's scratch for one thread: [tiles][2][hdp / 2][16] Q pairs,
// [tiles][hdp][16] f32 accumulators, [tiles][16] running max and sum, the
// span's keys [SPAN][hdp] and transposed values [hdp][SPAN] in bf16, its
// scores [SPAN][16] f32, weights [2][SPAN / 2][16] pairs and one parked set of
// 4 C tiles; hdp: head_dim rounded up to 32.
static inline size_t cpu_attn_tile_scratch(int head_dim)
{
    size_t hdp = ((size_t)head_dim + 31) / 32 * 32;
    size_t tiles = CPU_ATTN_TASK_TOKENS * CPU_ATTN_MAX_GROUP / 16;
    return tiles * hdp * 64 + tiles * hdp * 64 + tiles * 2 * 64 + 2 * CPU_ATTN_SPAN * hdp * 2 +
           CPU_ATTN_SPAN * 64 + CPU_ATTN_SPAN * 64 + 4 * 1024;
}

// ---- per-ISA kernels -----------------------------------------------------------------------
struct cpu_kernels {
    const char *name;
    // Converts x rows [t0, t1) into a->xq for BF16/Q8 weights; NULL when the
    // path reads f32 x.
    void (*mm_prep_x)(const struct cpu_mm_args *a, int t0, int t1);
    // y rows of blocks [b0, b1) for all a->n tokens.
    void (*mm_blocks)(const struct cpu_mm_args *a, int b0, int b1);
    // out[i] = silu(gate[i]) * up[i] for i < inter.
    void (*silu_mul_row)(const float *gate, const float *up, float *out, int inter);
    // s[j] = scale * q . k[j] for j < nk (1 <= nk <= CPU_ATTN_CHUNK); k rows are
    // head_dim apart. Returns max_j s[j].
    float (*attn_scores)(const float *q, const float *k, int nk, int head_dim, float scale,
                         float *s);
    // s[j] = exp(s[j] - m) for j < nk (s[j] <= m); returns their sum (in a
    // fixed order).
    float (*attn_exp)(float *s, int nk, float m);
    // acc = acc * corr + sum_j p[j] * v[j] (j ascending).
    void (*attn_accum)(float *acc, float corr, const float *p, const float *v, int nk,
                       int head_dim);
    // The same two reading a bf16 pool: each element widened exactly to f32
    // (a 16-bit shift), then the f32 arithmetic of the f32 kernels, so the
    // result equals the f32 kernel on the widened keys and values.
    float (*attn_scores_bf16)(const float *q, const uint16_t *k, int nk, int head_dim, float scale,
                              float *s);
    void (*attn_accum_bf16)(float *acc, float corr, const float *p, const uint16_t *v, int nk,
                            int head_dim);
    // attn_accum for heads g < nh of one GQA group sharing a span of value
    // rows given as nrun runs (nv[r] rows at v[r], f32 or, with bf16, bf16
    // widened exactly); acc rows and p rows (p_stride apart, j counting on
    // across runs) per head, corr[g] per head. Each head's result is bit for
    // bit attn_accum's (attn_accum_bf16's) called per run with corr[g] on the
    // first and 1 on the others. NULL: the backend does exactly that.
    void (*attn_accum_span)(float *acc, const float *corr, const float *p, int p_stride,
                            const void *const *v, const int *nv, int nrun, bool bf16, int nh,
                            int head_dim);
    // dst[i] = src[i] widened exactly to f32, i < n.
    void (*widen_bf16)(const uint16_t *src, float *dst, size_t n);
    // The largest of x[0..n) by `>` (NaN never wins; -inf when nothing is
    // above it): the fused argmax's scan of a tile row. NULL: a scalar loop.
    float (*row_max)(const float *x, int n);
    // Attention on AMX tiles (cpu_amx_attn_body.h; bf16 pools) of query tokens [i0, i1)
    // (at most CPU_ATTN_TASK_TOKENS) of sequence sq, query heads h0..h0+nh-1
    // (nh <= CPU_ATTN_MAX_GROUP) of KV head kvh, head_dim <=
    // CPU_ATTN_TILE_MAX_HD; scratch: the thread's cpu_attn_tile_scratch bytes.
    // Each query's result depends on its position, its q and the cache only,
    // as the per-query kernels'. NULL: those (attn_query per token).
    void (*attn_tile)(const struct cpu_attn_job *j, const struct tdm_attn_seq *sq, int i0, int i1,
                      int kvh, int h0, int nh, uint8_t *scratch);
};

extern const struct cpu_kernels cpu_kernels_portable;
extern const struct cpu_kernels cpu_kernels_avx2;
extern const struct cpu_kernels cpu_kernels_avx512;
// The AMX path's table (cpu_kernels_amx.c): the AVX-512 table with the BF16
// matmul on AMX tiles; emulated: the portable table with the same tile kernel
// on the software tile model (cpu_amx_emu.h), for tests on any host.
void cpu_kernels_amx_fill(struct cpu_kernels *k, bool emulated);
// CPUID says AMX-TILE and AMX-BF16 and Linux granted this process the tile
// state (asked once).
bool cpu_amx_available(void);

// ---- the backend object ------------------------------------------------------------------------
struct tdm_backend {
    enum tdm_cpu_isa isa;
    const struct cpu_kernels *k;
    struct cpu_kernels k_amx; // the AMX table k points to on that path (cpu_kernels_amx_fill)
    struct cpu_pool *pool;
    int nthreads;
    bool stream_prefetch; // cpu_mm_args.stream_prefetch: an Intel CPU
    uint32_t *xq;         // [CPU_MM_CHUNK_TOKENS][xq_stride] converted activations (see
                          // cpu_mm_args), host; grows in prepare_weight
    size_t xq_stride;     // uint32 per token: enough for the widest weight prepared
    // The fused argmax's per-thread scratch (cpu_matmul_argmax), grown on use:
    // [nthreads][CPU_ARGMAX_CHUNK_ROWS * CPU_MM_CHUNK_TOKENS] tiles and
    // [nthreads][CPU_MM_CHUNK_TOKENS] best value and index so far.
    float *am_tiles;
    float *am_best;
    int32_t *am_idx;
    // cpu_matmul_silu_mul's per-thread gate and up tiles, grown on use:
    // [nthreads][2][CPU_MM_CHUNK_TOKENS * CPU_BLOCK_ROWS].
    float *sm_tiles;
    // attn_tile's per-thread scratch, grown on use: [nthreads][attn_scratch_bytes].
    uint8_t *attn_scratch;
    size_t attn_scratch_bytes;
    // rope's cos/sin of the last call's positions, [rope_n][2 * rope_half]
    // (cos then sin), reused while a call has the same positions and
    // inv_freq values (the layers of one forward); grown on use.
    float *rope_cs;
    int32_t *rope_pos;              // [rope_n] the positions the table holds
    float *rope_inv;                // [rope_half] the inv_freq values it was made with
    size_t rope_cap, rope_half_cap; // tokens and half head_dims the buffers hold
    int rope_n, rope_half;          // 0, 0: no table
};
// Tests: runs the emulated AMX table (cpu_kernels_amx_fill(.., true)) on be
// until the next tdm_cpu_backend_set_isa.
void cpu_backend_use_amx_emu(struct tdm_backend *be);

// Tokens from which matmul_silu_mul fuses: a smaller batch's product
// ([n][2 * inter] f32, 2.5 MB at 64 tokens of Qwen2.5-0.5B) stays in cache
// anyway, and matmul's chunking of small batches keeps the weight streams long.
#define CPU_SILU_FUSE_MIN_TOKENS 64

// Rows of the weight one fused-argmax task multiplies into its tile (4 blocks:
// a tile of 64 tokens is 64 KiB, in L2; the full logits of 64 rows of a
// 151 936-token vocabulary are 39 MB).
#define CPU_ARGMAX_CHUNK_BLOCKS 4
#define CPU_ARGMAX_CHUNK_ROWS (CPU_ARGMAX_CHUNK_BLOCKS * CPU_BLOCK_ROWS)

static inline float cpu_bf16_to_f32(uint16_t h)
{
    union {
        uint32_t u;
        float f;
    } v = {.u = (uint32_t)h << 16};
    return v.f;
}

// A float's bits and back.
static inline uint32_t cpu_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float cpu_bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#endif
