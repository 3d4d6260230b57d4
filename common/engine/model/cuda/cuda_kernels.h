// SPDX-License-Identifier: Apache-2.0
// cuda_kernels (internal to the CUDA backend): C entry points that launch the
// backend's own kernels, and the host-side planning of an attention call.
// The same declarations are implemented twice from one kernel source
// (cuda_kernels.cuh + cuda_launch.cuh): by nvcc for the GPU (cuda_kernels.cu)
// and by g++ against the execution-model emulator (emu/cuda_kernels_emu.cpp,
// tests only). No CUDA type appears here: a stream is a void * (a
// cudaStream_t, NULL for the default stream; ignored by the emulator).
//
// Every pointer argument of a tdm_cuk_* launcher is device memory (host memory
// on the emulator). Launchers return an enum tdm_cuk_status (the C++ side
// cannot include core.h; the backend maps it to enum tdm_err): TDM_CUK_EINVAL
// for a shape they do not support, TDM_CUK_ELAUNCH when the launch failed,
// with the detail in tdm_cuk_errmsg. They are asynchronous on the GPU.
//
// Layouts (row-major, f32 unless noted):
//   an activation that feeds a GEMM (the `out` of rmsnorm, silu_mul and
//   attention) is f32 or bf16 by the launcher's out_bf16 flag: the CUDA
//   backend's GEMMs take bf16, written by the kernel that produces it;
//   activations x[n][row_stride]; bf16 is uint16 raw bits (round to nearest even);
//   KV cache of one layer, K and V apart: [num_blocks][n_kv_heads][block_size][head_dim]
//   in f32 or bf16 (enum tdm_cuk_kv_type), the same layout as the host pool of
//   common/engine/kv, so a block's layer moves as one contiguous range.
//
// Batch invariance: every kernel maps an output row to blocks and threads by
// that row's own shape only (its sequence's length for attention), never by n
// or by the other sequences, and reduces in a fixed order; so a row's result
// is bitwise the same whatever else shares the launch.
#ifndef TDM_CUDA_KERNELS_H
#define TDM_CUDA_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "sample_draw.h" // struct tdm_draw_params: the draw the CPU sampler makes

#ifdef __cplusplus
extern "C" {
#endif

enum tdm_cuk_status { TDM_CUK_OK = 0, TDM_CUK_EINVAL = 1, TDM_CUK_ELAUNCH = 2 };

enum tdm_cuk_kv_type { TDM_CUK_KV_F32 = 0, TDM_CUK_KV_BF16 = 1 };

// Positions of one decode split (flash-decoding): a sequence of L cached
// positions runs in ceil(L / TDM_CUK_DECODE_PART) splits, a function of L alone
// (a fixed size, so a row never depends on the batch). 32 keys: at batch 1 a
// KV head's keys spread over ceil(L / 32) blocks (64 blocks for Qwen2.5-0.5B's
// 2 KV heads at 1 024 tokens, 132 from 2 081), each reading 8 KiB of bf16 K
// and V at head_dim 64 in two 16-byte loads of each per lane; smaller splits
// would make the f32 partials (GQA group x (head_dim + 2) floats a split)
// nearly as many bytes as the KV they summarise. docs/gpu-backend.md ("Decode
// attention") has the arithmetic.
#define TDM_CUK_DECODE_PART 32
// Query heads of one KV head a decode block serves (reading K/V once for all).
#define TDM_CUK_DECODE_GROUP 8
// Query rows per prefill tile (FlashAttention-2 style): with bf16 KV four
// warps of 16 rows on tensor cores over key tiles of TDM_CUK_PREFILL_MMA_BK;
// with f32 KV the CUDA-core kernel runs the tile as sub-tiles of
// TDM_CUK_PREFILL_F32_BQ rows over key tiles of TDM_CUK_PREFILL_BK (its f32
// rows in shared memory would not fit 48 KiB at 64 rows of head_dim 128).
#define TDM_CUK_PREFILL_BQ 64
#define TDM_CUK_PREFILL_F32_BQ 16
#define TDM_CUK_PREFILL_BK 16
#define TDM_CUK_PREFILL_MMA_BK 64

// One sequence of an attention launch (device memory, 16 bytes).
struct tdm_cuk_seq {
    int32_t row;       // first row of the sequence in q and out
    int32_t n_tokens;  // new tokens (rows)
    int32_t start_pos; // position of the first new token; it attends 0..start_pos+i
    int32_t reserved;  // 0
};

// The host-built description of one attention call. `seqs`, `block_tables`,
// `decode_seqs`, `prefill_tiles`, `part_o`, `part_ml` and `part_done` are device
// memory laid out by tdm_cuk_attn_plan (the part_* only when max_splits > 1);
// q, out and the caches as in the header comment.
struct tdm_cuk_attn_args {
    int kv_type;    // enum tdm_cuk_kv_type (an int: C++ may not hold other values in the enum)
    const float *q; // [rows][q_stride], heads at h * head_dim
    int q_stride;
    void *out; // [rows][n_heads * head_dim], f32 or (out_bf16) bf16
    int out_bf16;
    // Decode-only batches (n_tiles 0) may fuse RoPE and the KV store: with
    // inv_freq [head_dim / 2] set, q is the un-rotated qkv row (k of the new
    // token at q + n_heads * head_dim, v after it, same stride), position
    // start_pos; the decode blocks rope the query and store the new k and v at
    // slots[row] (flat block * block_size + offset; negative: padding, not
    // stored) before reading the cache: tdm_cuk_rope_kv_store then attention,
    // bitwise, in one launch. NULL: q is rotated and the new KV stored.
    const float *inv_freq;
    const int32_t *slots;
    const void *k_cache, *v_cache;  // this layer's pool
    const struct tdm_cuk_seq *seqs; // [n_seqs]
    const int32_t *block_tables;    // [n_seqs][bt_stride]
    int bt_stride;
    const int32_t *decode_seqs; // [n_decode] seq indices with n_tokens == 1
    int n_decode;
    int max_splits;               // max over decode seqs of their split count
    float *part_o;                // [n_decode][n_heads][max_splits][head_dim] scratch
    float *part_ml;               // [n_decode][n_heads][max_splits][2] scratch (max, sum)
    int32_t *part_done;           // [n_decode][n_heads] split counts: zero before a
                                  // launch, and the launch leaves them zero
    const int32_t *prefill_tiles; // [n_tiles][2] (seq index, first row in the seq)
    int n_tiles;
    int n_heads, n_kv_heads, head_dim, block_size;
    float scale;
};

// The host half of an attention call: which kernel serves each sequence
// (n_tokens == 1: decode kernel, else prefill tiles), how many splits, and the
// scratch it needs. Fills host arrays the caller then copies to the device:
//   seqs[n_seqs], decode_seqs[<= n_seqs], prefill_tiles[<= 2 * tiles];
// returns the counts through the out-params. tiles_cap is the capacity of
// prefill_tiles in tiles. TDM_CUK_EINVAL for a sequence with n_tokens < 1,
// start_pos < 0 or too many tiles.
struct tdm_cuk_plan {
    int n_decode;
    int n_tiles;
    int max_splits;
    size_t part_floats; // floats part_o needs (part_ml needs 2 / head_dim of it)
    size_t part_counts; // int32 counters part_done needs (n_decode * n_heads)
};
int tdm_cuk_attn_plan(const int32_t *row, const int32_t *n_tokens, const int32_t *start_pos,
                      int n_seqs, int n_heads, int head_dim, struct tdm_cuk_seq *seqs,
                      int32_t *decode_seqs, int32_t *prefill_tiles, int tiles_cap,
                      struct tdm_cuk_plan *plan);
// Splits of a decode over kv_len cached positions (kv_len >= 1).
int tdm_cuk_decode_splits(int kv_len);

// out[n][cols] = f32 of bf16 rows ids[i] of table[rows][cols]; ids outside
// [0, rows) give zero rows.
int tdm_cuk_embed(void *stream, const uint16_t *table, int rows, int cols, const int32_t *ids,
                  int n, float *out);
// The residual add and the norm of the next sublayer in one launch (one CTA
// per row): with y, x += y first (written back); then out[n][dim] = x /
// rms(x) * weight, f32 or (out_bf16) bf16. out may equal x when f32.
int tdm_cuk_add_rmsnorm(void *stream, float *x, const float *y, const float *weight, float eps,
                        void *out, int out_bf16, int n, int dim);
// Rotate-half RoPE in place on x[n][row_stride], heads at h * head_dim for h < n_heads.
int tdm_cuk_rope(void *stream, float *x, int n, int row_stride, int n_heads, int head_dim,
                 const int32_t *pos, const float *inv_freq);
// out[n][inter] = silu(gate_up[n][0:inter]) * gate_up[n][inter:2*inter], f32
// or (out_bf16) bf16.
int tdm_cuk_silu_mul(void *stream, const float *gate_up, void *out, int out_bf16, int n, int inter);
// x[i] += y[i] for i < count.
int tdm_cuk_add(void *stream, float *x, const float *y, size_t count);
// RoPE of each row's n_q query and n_kv key heads in place (qkv rows of
// `stride` floats: q heads, k heads, v heads side by side), then the row's k
// and v into flat slot slots[i] as tdm_cuk_kv_store does (negative: not
// stored): tdm_cuk_rope then tdm_cuk_kv_store, bitwise, in one launch.
int tdm_cuk_rope_kv_store(void *stream, int type, float *qkv, int stride, int n_q, int n_kv,
                          int head_dim, const int32_t *pos, const float *inv_freq,
                          const int32_t *slots, int n, void *k_cache, void *v_cache,
                          int block_size);
// Writes rows i < n of k and v (row stride `stride` floats, n_kv_heads *
// head_dim each) into flat slot slots[i] = block * block_size + offset of this
// layer's caches; a negative slot skips the row (padding).
int tdm_cuk_kv_store(void *stream, int type, const float *k, const float *v, int stride,
                     const int32_t *slots, int n, void *k_cache, void *v_cache, int n_kv_heads,
                     int head_dim, int block_size);
// ids[pairs[2i]] = src[pairs[2i + 1]] for i < n (device memory, one launch):
// the rows of a forward whose token is a chosen token of the forward before,
// read where that forward's argmax or draw wrote it.
int tdm_cuk_gather_ids(void *stream, int32_t *ids, const int32_t *src, const int32_t *pairs, int n);
// Rows i < n of a draw (tdm_cuk_sample_rows' params and adj, device) whose
// last adjustment is TDM_DRAW_ADJ_PENDING: that entry resolved with token
// src[its token field] (the previous forward's chosen ids, device) by
// tdm_draw_merge_pending, params[i].n_adj fixed; one launch, a CTA a row,
// before the draw. Other rows are left as they are.
#define TDM_CUK_RESOLVE_THREADS 128
int tdm_cuk_resolve_pending(void *stream, struct tdm_draw_params *params, struct tdm_draw_adj *adj,
                            const int32_t *src, int n);
// Adjustment lists kept on the device between a request's steps
// (tdm_draw_params.list): before a draw, rows i < n with a list get their
// entries there, at entry lists_at[i] of adj (a list_load row's own entries,
// at its adj_off, copied there first, and list_n[list - 1] set), adj_off and
// n_adj naming them (list_bind, one launch, a CTA a row, before
// tdm_cuk_resolve_pending); after it, each such row's drawn token ids[i]
// recorded into its list by tdm_draw_record and list_n updated
// (list_record). All device memory; other rows are left as they are.
int tdm_cuk_list_bind(void *stream, struct tdm_draw_params *params, struct tdm_draw_adj *adj,
                      const int32_t *lists_at, int32_t *list_n, int n);
int tdm_cuk_list_record(void *stream, const struct tdm_draw_params *params,
                        struct tdm_draw_adj *adj, const int32_t *ids, int32_t *list_n, int n);
// ids[i] = the index of the first largest of x[i][0..cols) by `>` (ties: the
// lowest index; NaN never wins; 0 when nothing is above -inf), i < n: greedy
// sampling on the device, a CTA per chunk of TDM_CUK_ARGMAX_CHUNK columns of a
// row, then (rows of several chunks) a merge launch. scratch: device memory of
// tdm_cuk_argmax_scratch(n, cols) bytes (0: NULL is fine). ids is device memory.
#define TDM_CUK_ARGMAX_CHUNK 1024
size_t tdm_cuk_argmax_scratch(int n, int cols);
int tdm_cuk_argmax_rows(void *stream, const float *x, int n, int cols, int32_t *ids, void *scratch);
// ids[i] = the token sample_draw.h's draw takes from x[i][0..cols), adjusted
// by adj[params[i].adj_off ..][0..params[i].n_adj) and masked by masks[params[i].
// mask_off ..][0..n_mask_words) (structured output), with params[i] (inv_t 0:
// the first largest, as tdm_cuk_argmax_rows), i < n: the same token the CPU
// sampler draws from the same row. x is overwritten. Launches (every one but
// the second a CTA per TDM_CUK_ARGMAX_CHUNK columns of each row): the
// adjustments, the chunk's maximum and, for 0 < top_k <= TDM_CUK_SAMPLE_KMAX,
// the chunk's top_k candidates in up to TDM_CUK_SAMPLE_CAP slots; then a CTA
// per row (greedy rows; the draw over the candidates, or over the whole row
// when a chunk's ties overflow its slots). A step with a sampled row of top_k
// 0 or > KMAX (the split path) adds: 4 passes of top_k's threshold when one
// such row has top_k > 0, the weights (and with top_p 1 the draw), and 4
// passes of top_p's floor and the draw when one such row has top_p < 1: 2, 3,
// 7 or 11 launches. params_host: the host's copy of params[0..n), which
// picks the launches (NULL: all of them). scratch: device memory of
// tdm_cuk_sample_scratch(n, n_lp, cols) bytes. params, adj, masks, ids:
// device. Rows asking logprobs (params' logprobs; their indices in
// lp_rows[0..n_lp), device) get them in lp_out[0..n_lp) (device), in that
// order: the CPU sampler's (fill_logprobs) from the same row, two more
// launches.
#define TDM_CUK_SAMPLE_KMAX 40
#define TDM_CUK_SAMPLE_CAP 64
size_t tdm_cuk_sample_scratch(int n, int n_lp, int cols);
int tdm_cuk_sample_rows(void *stream, float *x, int n, int cols,
                        const struct tdm_draw_params *params,
                        const struct tdm_draw_params *params_host, const struct tdm_draw_adj *adj,
                        const uint32_t *masks, int32_t *ids, const int32_t *lp_rows, int n_lp,
                        struct tdm_draw_logprobs *lp_out, void *scratch);
// Small-batch GEMM: y[n][rows] = x[n][cols] . w[rows][cols]^T (+ bias[rows]
// when not NULL), bf16 w and x, f32 accumulation and y, for n <=
// TDM_CUK_GEMV_MAX_N (decode steps): the CUDA backend's fast mode
// (--no-batch-invariant) instead of a cuBLASLt call. Each weight element is
// read once, in 16-byte loads, for all n rows, and multiplied on tensor cores
// (mma.sync m16n8k16). A CTA serves TDM_CUK_GEMV_ROWS weight rows over one
// K-split: whole spans of TDM_CUK_GEMV_SPAN columns (8 warps x 32). The split count is a function
// of the weight shape alone (tdm_cuk_gemv_split), never of n: the fewest splits that give at least
// TDM_CUK_GEMV_CTAS CTAs (two per SM of an H100/H200's 132), capped at one span per split. Splits'
// partial sums go to `part`, and the CTA of a row tile that arrives last (an integer count in
// `counts`, reset by that CTA) adds them in split order, then the bias: no float atomics, so a
// row's result is bitwise the same for every n <= TDM_CUK_GEMV_MAX_N (not
// the same as cuBLASLt's, which sums in another order). cols must be a
// multiple of 8, w and x 16-byte aligned. part: tdm_cuk_gemv_part_bytes,
// counts: tdm_cuk_gemv_count_bytes of device memory, counts zeroed once
// before the first launch (each launch leaves them zero); both NULL is fine
// when the shape has one split. All device memory; one launch.
#define TDM_CUK_GEMV_MAX_N 16
#define TDM_CUK_GEMV_ROWS 16
#define TDM_CUK_GEMV_SPAN 256
#define TDM_CUK_GEMV_CTAS 264
struct tdm_cuk_gemv_shape {
    int tiles;           // row tiles: ceil(rows / TDM_CUK_GEMV_ROWS)
    int splits;          // K-splits
    int spans_per_split; // TDM_CUK_GEMV_SPAN-column spans in each split (the last may be short)
};
// The launch shape of a (rows, cols) weight: CTAs = tiles * splits at every n.
struct tdm_cuk_gemv_shape tdm_cuk_gemv_split(int rows, int cols);
// Scratch bytes of a weight shape (0 when it has one split): partial sums for
// TDM_CUK_GEMV_MAX_N rows, and the row tiles' arrival counts.
size_t tdm_cuk_gemv_part_bytes(int rows, int cols);
size_t tdm_cuk_gemv_count_bytes(int rows, int cols);
int tdm_cuk_gemv(void *stream, const uint16_t *w, int rows, int cols, const uint16_t *x, int n,
                 const float *bias, float *y, float *part, int32_t *counts);
// out[i][block_elems] = f32 of pool block blocks[i], i < n (export), and the
// reverse: pool block blocks[i] = in[i] rounded to the pool's type (import).
// block_elems = n_kv_heads * block_size * head_dim.
int tdm_cuk_kv_gather(void *stream, int type, const void *pool, const int32_t *blocks, int n,
                      size_t block_elems, float *out);
int tdm_cuk_kv_scatter(void *stream, int type, void *pool, const int32_t *blocks, int n,
                       size_t block_elems, const float *in);
// Causal GQA attention over the paged cache (see struct tdm_cuk_attn_args);
// head_dim 16, 32, 64 or 128 (Qwen2.5 and Llama 3 use 64 and 128; 16 and 32
// serve the tiny test models), any n_heads divisible by n_kv_heads.
int tdm_cuk_attention(void *stream, const struct tdm_cuk_attn_args *a);

// The detail of the last failed tdm_cuk_* call of this thread.
const char *tdm_cuk_errmsg(void);

#ifdef __cplusplus
}
#endif

#endif
