// SPDX-License-Identifier: Apache-2.0
// cuda_kernels.cuh: the CUDA backend's own kernels, written once and compiled
// both by nvcc (cuda_kernels.cu) and, against the execution-model emulator, by
// g++ (emu/cuda_kernels_emu.cpp). Include cuda_compat.h first.
//
// Only the CUDA subset the emulator models is used: threadIdx/blockIdx/
// blockDim/gridDim, static __shared__ arrays, __syncthreads, full-warp
// __shfl_xor_sync, atomics, __threadfence, __ldcg, aligned 16-byte loads
// (ld16; __ldg, __ldcs of a uint4) and the warp-level matrix instructions of
// cuda_mma.cuh (mma.sync m16n8k16 bf16, ldmatrix x4). Blocks are
// one-dimensional and a multiple of 32 threads.
//
// Reductions run in a fixed order set by the block shape (never by the batch):
// a strided per-thread partial, a butterfly inside each warp, then warps in
// index order. The CPU backend sums in another fixed order, so the two agree
// within rounding (cuda_ops_test states the tolerances), not bitwise.
#ifndef TDM_CUDA_KERNELS_CUH
#define TDM_CUDA_KERNELS_CUH

#include "cuda_kernels.h"
#include "cuda_mma.cuh"

namespace tdm_cuk
{

// ---- scalar helpers ------------------------------------------------------------------------
__device__ __forceinline__ float bf16_to_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// Round to nearest even; NaN stays a quiet NaN (the CPU backend's rounding).
__device__ __forceinline__ uint16_t f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float kv_load(const float *p)
{
    return *p;
}
__device__ __forceinline__ float kv_load(const uint16_t *p)
{
    return bf16_to_f32(*p);
}
__device__ __forceinline__ void kv_put(float *p, float v)
{
    *p = v;
}
__device__ __forceinline__ void kv_put(uint16_t *p, float v)
{
    *p = f32_to_bf16(v);
}

// An activation that feeds a GEMM: f32, or bf16 (the CUDA backend's GEMM
// input) written by the kernel that produces it instead of a conversion pass.
__device__ __forceinline__ void act_put(void *out, size_t i, float v, int bf16)
{
    if (bf16)
        ((uint16_t *)out)[i] = f32_to_bf16(v);
    else
        ((float *)out)[i] = v;
}

// Rotate-half RoPE of the pair (x1, x2) = (v[i], v[i + half]) at position p.
// The angle is the f32 product p * inv_freq (as HF computes it), its cos/sin
// evaluated in double and rounded once, as the CPU backend does; the products
// are rounded apart (__fmul_rn: never contracted into an FMA), so every kernel
// that rotates (rope, rope_kv_store, the decode attention that ropes its own
// query) gives the same bits.
// rope_cs and rope_apply are its two halves, for a kernel that computes a
// position's cos/sin table once and rotates many pairs with it.
__device__ __forceinline__ void rope_cs(float p, float inv_freq, float *c, float *s)
{
    float ang = p * inv_freq;
    *c = (float)cos((double)ang);
    *s = (float)sin((double)ang);
}

__device__ __forceinline__ void rope_apply(float x1, float x2, float c, float s, float *o1,
                                           float *o2)
{
    *o1 = __fmul_rn(x1, c) - __fmul_rn(x2, s);
    *o2 = __fmul_rn(x2, c) + __fmul_rn(x1, s);
}

__device__ __forceinline__ void rope_rot(float x1, float x2, float p, float inv_freq, float *o1,
                                         float *o2)
{
    float c, s;
    rope_cs(p, inv_freq, &c, &s);
    rope_apply(x1, x2, c, s, o1, o2);
}

__device__ __forceinline__ float warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum / max returned to every thread; red is __shared__ [32].
__device__ __forceinline__ float block_sum(float v, float *red)
{
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = 0.0f;
    for (unsigned w = 0; w < blockDim.x / 32; w++)
        t += red[w];
    __syncthreads();
    return t;
}

__device__ __forceinline__ float block_max(float v, float *red)
{
    v = warp_max(v);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = v;
    __syncthreads();
    float t = -INFINITY;
    for (unsigned w = 0; w < blockDim.x / 32; w++)
        t = fmaxf(t, red[w]);
    __syncthreads();
    return t;
}

// ---- row-wise ops ------------------------------------------------------------------------
// grid (n), any block: one row of the table per block.
__global__ void embed_kernel(const uint16_t *table, int rows, int cols, const int32_t *ids,
                             float *out)
{
    int r = ids[blockIdx.x];
    float *o = out + (size_t)blockIdx.x * cols;
    for (int k = threadIdx.x; k < cols; k += blockDim.x)
        o[k] = (r >= 0 && r < rows) ? bf16_to_f32(table[(size_t)r * cols + k]) : 0.0f;
}

// grid (n), block 256: the residual add (when y is not NULL: x += y, each
// element rounded once, written back) and the RMSNorm of the sum in one pass;
// sum of squares in the block's fixed order. out may equal x when it is f32
// (each thread reads back only what it wrote).
__global__ void add_rmsnorm_kernel(float *x, const float *y, const float *weight, float eps,
                                   void *out, int out_bf16, int dim)
{
    __shared__ float red[32];
    float *xr = x + (size_t)blockIdx.x * dim;
    const float *yr = y ? y + (size_t)blockIdx.x * dim : NULL;
    size_t o0 = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        if (yr) {
            v += yr[i];
            xr[i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = block_sum(ss, red);
    float inv = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        act_put(out, o0 + i, xr[i] * inv * weight[i], out_bf16);
}

// grid (n), any block: each thread rotates (head, i) pairs (rope_rot).
__global__ void rope_kernel(float *x, int row_stride, int n_heads, int head_dim, const int32_t *pos,
                            const float *inv_freq)
{
    int half = head_dim / 2;
    float *xr = x + (size_t)blockIdx.x * row_stride;
    float p = (float)pos[blockIdx.x];
    for (int idx = threadIdx.x; idx < n_heads * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float *v = xr + (size_t)h * head_dim;
        rope_rot(v[i], v[i + half], p, inv_freq[i], &v[i], &v[i + half]);
    }
}

// grid (n, ceil(inter / blockDim)).
__global__ void silu_mul_kernel(const float *gate_up, void *out, int out_bf16, int inter)
{
    int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter)
        return;
    const float *gu = gate_up + (size_t)blockIdx.x * 2 * inter;
    float g = gu[i];
    act_put(out, (size_t)blockIdx.x * inter + i, g / (1.0f + expf(-g)) * gu[inter + i], out_bf16);
}

// Element-wise over count, grid-stride.
__global__ void add_kernel(float *x, const float *y, size_t count)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

// ids[pairs[2i]] = src[pairs[2i + 1]], i < n, grid-stride: a row whose token is
// the previous forward's chosen token, taken where that forward left it.
__global__ void gather_ids_kernel(int32_t *ids, const int32_t *src, const int32_t *pairs, int n)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        ids[pairs[2 * i]] = src[pairs[2 * i + 1]];
}

// grid (n rows), block TDM_CUK_RESOLVE_THREADS: a row whose last adjustment is
// PENDING (sample_draw.h) gets its token, src[that entry's row] (the previous
// forward's chosen ids), resolved into its entries: the block searches the
// token's entry among the row's others, one thread merges
// (tdm_draw_merge_pending) and fixes the row's n_adj. Other rows: nothing.
__global__ void __launch_bounds__(TDM_CUK_RESOLVE_THREADS)
    resolve_pending_kernel(tdm_draw_params *params, tdm_draw_adj *adj, const int32_t *src)
{
    __shared__ int32_t found[1];
    tdm_draw_params *d = &params[blockIdx.x];
    int32_t n = d->n_adj;
    tdm_draw_adj *a = adj + d->adj_off;
    if (n <= 0 || !(a[n - 1].flags & TDM_DRAW_ADJ_PENDING)) // the same for the whole block
        return;
    int32_t token = src[a[n - 1].token];
    if (threadIdx.x == 0)
        found[0] = -1;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n - 1; i += blockDim.x)
        if (a[i].token == token) // a row's tokens are unique: one writer at most
            found[0] = i;
    __syncthreads();
    if (threadIdx.x == 0)
        tdm_draw_merge_pending(a, &d->n_adj, token, found[0]);
}

// grid (n rows), block TDM_CUK_RESOLVE_THREADS: a row with a device list
// (params' list > 0, sample_draw.h) gets its entries there, at entry lists_at[row] of adj:
// list_load, the row's n_adj entries at adj_off copied there and the list's
// count set; else the count the list has. Then the row's adj_off and n_adj
// name the list's entries. Other rows: nothing.
__global__ void __launch_bounds__(TDM_CUK_RESOLVE_THREADS)
    list_bind_kernel(tdm_draw_params *params, tdm_draw_adj *adj, const int32_t *lists_at,
                     int32_t *list_n)
{
    tdm_draw_params *d = &params[blockIdx.x];
    int32_t list = d->list - 1, at = lists_at[blockIdx.x];
    if (list < 0) // the same for the whole block
        return;
    if (d->list_load) {
        for (int32_t i = threadIdx.x; i < d->n_adj; i += blockDim.x)
            adj[at + i] = adj[d->adj_off + i]; // the step's entries and the list do not overlap
        __syncthreads();                       // every thread read d before thread 0 writes it
        if (threadIdx.x == 0) {
            list_n[list] = d->n_adj;
            d->adj_off = at;
        }
    } else if (threadIdx.x == 0) {
        d->n_adj = list_n[list];
        d->adj_off = at;
    }
}

// grid (n rows), block TDM_CUK_RESOLVE_THREADS: a row with a device list gets
// its drawn token ids[row] recorded into it (tdm_draw_record with the row's
// rec_flags and rec_count; the block searches the token's entry), and the
// list's count set. Other rows: nothing.
__global__ void __launch_bounds__(TDM_CUK_RESOLVE_THREADS)
    list_record_kernel(const tdm_draw_params *params, tdm_draw_adj *adj, const int32_t *ids,
                       int32_t *list_n)
{
    __shared__ int32_t found[1];
    const tdm_draw_params *d = &params[blockIdx.x];
    if (d->list <= 0)
        return;
    int32_t n = d->n_adj, token = ids[blockIdx.x];
    tdm_draw_adj *a = adj + d->adj_off;
    if (threadIdx.x == 0)
        found[0] = -1;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < n; i += blockDim.x)
        if (a[i].token == token) // a list's tokens are unique: one writer at most
            found[0] = i;
    __syncthreads();
    if (threadIdx.x == 0) {
        tdm_draw_record(a, &n, token, d->rec_flags, d->rec_count, found[0]);
        list_n[d->list - 1] = n;
    }
}

// ---- KV cache ----------------------------------------------------------------------------
// grid (n), any block: row blockIdx.x goes to its flat slot.
template <class KV>
__global__ void kv_store_kernel(const float *k, const float *v, int stride, const int32_t *slots,
                                KV *k_cache, KV *v_cache, int n_kv_heads, int head_dim,
                                int block_size)
{
    int slot = slots[blockIdx.x];
    if (slot < 0)
        return;
    int blk = slot / block_size, off = slot % block_size;
    const float *kr = k + (size_t)blockIdx.x * stride;
    const float *vr = v + (size_t)blockIdx.x * stride;
    for (int idx = threadIdx.x; idx < n_kv_heads * head_dim; idx += blockDim.x) {
        int h = idx / head_dim, d = idx % head_dim;
        size_t dst = (((size_t)blk * n_kv_heads + h) * block_size + off) * head_dim + d;
        kv_put(&k_cache[dst], kr[idx]);
        kv_put(&v_cache[dst], vr[idx]);
    }
}

// grid (n), any block: RoPE of row blockIdx.x's n_q query heads and n_kv key
// heads in place (heads side by side from qkv's row start: q, then k, then v),
// then its k and v into its flat slot (a negative slot: rotated, not stored):
// rope_kernel then kv_store_kernel in one launch, bitwise the same.
template <class KV>
__global__ void rope_kv_store_kernel(float *qkv, int stride, int n_q, int n_kv, int head_dim,
                                     const int32_t *pos, const float *inv_freq,
                                     const int32_t *slots, KV *k_cache, KV *v_cache, int block_size)
{
    int half = head_dim / 2;
    float *xr = qkv + (size_t)blockIdx.x * stride;
    float p = (float)pos[blockIdx.x];
    for (int idx = threadIdx.x; idx < (n_q + n_kv) * half; idx += blockDim.x) {
        int h = idx / half, i = idx % half;
        float *v = xr + (size_t)h * head_dim;
        rope_rot(v[i], v[i + half], p, inv_freq[i], &v[i], &v[i + half]);
    }
    __syncthreads(); // the rotated k, read below by other threads
    int slot = slots[blockIdx.x];
    if (slot < 0)
        return;
    int blk = slot / block_size, off = slot % block_size;
    const float *kr = xr + (size_t)n_q * head_dim, *vr = kr + (size_t)n_kv * head_dim;
    for (int idx = threadIdx.x; idx < n_kv * head_dim; idx += blockDim.x) {
        int h = idx / head_dim, d = idx % head_dim;
        size_t dst = (((size_t)blk * n_kv + h) * block_size + off) * head_dim + d;
        kv_put(&k_cache[dst], kr[idx]);
        kv_put(&v_cache[dst], vr[idx]);
    }
}

// grid (nblocks), any block: whole blocks of one layer's pool to or from f32
// rows in block-list order (the KV transfer layout: export and import).
template <class KV>
__global__ void kv_gather_kernel(const KV *pool, const int32_t *blocks, size_t block_elems,
                                 float *out)
{
    const KV *src = pool + (size_t)blocks[blockIdx.x] * block_elems;
    float *dst = out + (size_t)blockIdx.x * block_elems;
    for (size_t i = threadIdx.x; i < block_elems; i += blockDim.x)
        dst[i] = kv_load(&src[i]);
}

// Greedy sampling on the device: the index of the first largest of a row by
// `>` (NaN never wins; 0 when nothing is above -inf), the sampler's argmax. A
// row runs in chunks of TDM_CUK_ARGMAX_CHUNK columns, one CTA each (batch 1
// over a 151 936-token vocabulary: 149 CTAs, not one), then one CTA per row
// merges the chunks' winners; a row of one chunk is finished by its CTA. Each
// thread keeps the first largest of its strided elements (its indices
// ascend); the tree then keeps the larger value, the lower index on a tie: the
// same index whatever the batch.
#define TDM_CUK_ARGMAX_THREADS 256

// The block's (value, index) winner from each thread's (bv, bi); bi -1: none.
__device__ __forceinline__ void argmax_tree(float bv, int bi, float *out_v, int *out_i)
{
    __shared__ float sv[TDM_CUK_ARGMAX_THREADS];
    __shared__ int si[TDM_CUK_ARGMAX_THREADS];
    sv[threadIdx.x] = bv;
    si[threadIdx.x] = bi;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            float ov = sv[threadIdx.x + s], mv = sv[threadIdx.x];
            int oi = si[threadIdx.x + s], mi = si[threadIdx.x];
            if (oi >= 0 && (mi < 0 || ov > mv || (ov == mv && oi < mi))) {
                sv[threadIdx.x] = ov;
                si[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    *out_v = sv[0];
    *out_i = si[0];
    __syncthreads(); // sv/si reused by the next call
}

// The block's first largest of r[c0, c1) (index -1: nothing above -inf). Each
// thread keeps the first largest of its strided elements (ascending indices).
__device__ __forceinline__ void chunk_first_largest(const float *r, int c0, int c1, float *out_v,
                                                    int *out_i)
{
    float bv = -INFINITY;
    int bi = -1;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float v = r[c];
        if (v > bv) {
            bv = v;
            bi = c;
        }
    }
    argmax_tree(bv, bi, out_v, out_i);
}

// The block's winner of a row's chunk winners pv/pi[0, chunks) (ascending
// chunks hold ascending indices, so `>` keeps the first on a tie).
__device__ __forceinline__ void merge_winners(const float *pv, const int32_t *pi, int chunks,
                                              float *out_v, int *out_i)
{
    float bv = -INFINITY;
    int bi = -1;
    for (int z = threadIdx.x; z < chunks; z += blockDim.x)
        if (pi[z] >= 0 && (bi < 0 || pv[z] > bv)) {
            bv = pv[z];
            bi = pi[z];
        }
    argmax_tree(bv, bi, out_v, out_i);
}

// grid (n, chunks), block 256: chunk blockIdx.y of row blockIdx.x. One chunk:
// ids[row]; else the chunk's winner to part_v/part_i[row][chunk].
__global__ void argmax_chunk_kernel(const float *x, int cols, float *part_v, int32_t *part_i,
                                    int32_t *ids)
{
    const float *r = x + (size_t)blockIdx.x * cols;
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    float wv;
    int wi;
    chunk_first_largest(r, c0, c1, &wv, &wi);
    if (threadIdx.x != 0)
        return;
    if (gridDim.y == 1) {
        ids[blockIdx.x] = wi < 0 ? 0 : wi;
    } else {
        part_v[(size_t)blockIdx.x * gridDim.y + blockIdx.y] = wv;
        part_i[(size_t)blockIdx.x * gridDim.y + blockIdx.y] = wi;
    }
}

// grid (n), block 256: the winner of a row's chunks.
__global__ void argmax_merge_kernel(const float *part_v, const int32_t *part_i, int chunks,
                                    int32_t *ids)
{
    float wv;
    int wi;
    merge_winners(part_v + (size_t)blockIdx.x * chunks, part_i + (size_t)blockIdx.x * chunks,
                  chunks, &wv, &wi);
    if (threadIdx.x == 0)
        ids[blockIdx.x] = wi < 0 ? 0 : wi;
}

// ---- sampling on the device (sample_draw.h's draw) -------------------------------------
// Row i's token by the draw the CPU sampler makes (common/engine/sampling/
// sample_draw.h), so the same row gives the same token. Every sum is an
// integer (exact in any order) and every threshold is found by a radix walk
// of counts or masses, 8 bits at a time from the top (4 passes of a 256-bin
// histogram), so no result depends on the order threads or CTAs add in. The
// row is overwritten with the tokens' integer weights (it is scratch: nobody
// reads these rows after). Launches (tdm_cuk_sample_rows), every (rows x
// chunks) grid with a CTA per TDM_CUK_ARGMAX_CHUNK columns:
//   sample_chunk_kernel (rows x chunks): the request's logit adjustments, the
//     structured-output mask, the chunk's first largest and top_k's fast-path
//     candidates;
//   sample_rows_kernel (rows): the row's first largest from its chunks'
//     (greedy rows and rows without a finite maximum end there); a row with
//     0 < top_k <= TDM_CUK_SAMPLE_KMAX draws over its chunks' candidates (at
//     most chunks x TDM_CUK_SAMPLE_CAP entries) in this CTA; every other
//     sampled row (top_k 0 or > KMAX: the split path) gets its state here;
//   sample_top_k_kernel x 4 (rows x chunks; a step with a top_k > KMAX
//     row): the k-th largest finite logit, a 256-bin count histogram of each
//     chunk added to the row's, a pass each;
//   sample_weights_kernel (rows x chunks): each token's weight (0 below
//     top_k's threshold) written over its logit, the chunk's total and
//     top_p's first mass histogram; with top_p 1 the row's last CTA draws;
//   sample_top_p_kernel x 4 (rows x chunks; a step with a top_p < 1 split
//     row): passes 1 to 3 of top_p's walk by mass (the floor: the smallest
//     kept weight), then each chunk's kept weight, and the row's last CTA
//     draws.
// The draw: the chunks' kept weights, in chunk order, pick the chunk holding
// the target; the CTA then scans that chunk only (at most
// TDM_CUK_ARGMAX_CHUNK weights). What still runs in one CTA a row: the merge
// of the chunks' winners and the walks' bin choices (256 bins, redone by
// every CTA of the next launch from the row's histogram), the draw over
// top_k's candidates (fast path), and the chosen chunk's scan. One case walks
// the whole row in one CTA, as before: a row with 0 < top_k <= KMAX whose
// chunk holds more ties at its k-th place than its TDM_CUK_SAMPLE_CAP slots
// (draw_over on the row, in sample_rows_kernel). The histogram passes add a
// thread's run of one bin once (a shared atomic per change of bin), so a row
// whose values share a few top bits does not serialise on one shared address.
__device__ __forceinline__ uint32_t draw_key_of(float v)
{
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float draw_value_of(uint32_t k)
{
    uint32_t u = (k & 0x80000000u) ? (k & 0x7fffffffu) : ~k;
    float v;
    memcpy(&v, &u, 4);
    return v;
}

// One radix pass's counts: each value of row[c0, c1) above -inf (with_ninf:
// -inf too; NaN never) whose key matches prefix under mask, added to the bin
// of its key's 8 bits at shift in hist (shared; the caller zeroes it and
// syncs after). A thread's values mostly share their top bits (logits of
// one row span a few binades), so it counts a run of one bin in a register
// and adds the run once: a shared atomic per change of bin, not per element
// (one address took every element before).
__device__ __forceinline__ void draw_count_pass(const float *row, int c0, int c1, bool with_ninf,
                                                uint32_t mask, uint32_t prefix, int shift,
                                                unsigned int *hist)
{
    int run_bin = -1;
    unsigned int run = 0;
    for (int c = c0 + (int)threadIdx.x; c < c1; c += (int)blockDim.x) {
        float v = row[c];
        if (with_ninf ? v != v : !(v > -INFINITY))
            continue;
        uint32_t key = draw_key_of(v);
        if ((key & mask) != prefix)
            continue;
        int bin = (int)((key >> shift) & 255u);
        if (bin != run_bin) {
            if (run)
                atomicAdd(&hist[run_bin], run);
            run_bin = bin;
            run = 0;
        }
        run++;
    }
    if (run)
        atomicAdd(&hist[run_bin], run);
}

// The k-th largest value of row[0..cols) above -inf (with_ninf: -inf
// counted too; NaN never), or -inf when fewer than k are. k >= 1.
__device__ float draw_kth_largest(const float *row, int cols, int k, bool with_ninf = false)
{
    __shared__ unsigned int hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int s_left;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_left = k;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            hist[b] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix;
        uint32_t mask = shift == 24 ? 0u : ~0u << (shift + 8);
        draw_count_pass(row, 0, cols, with_ninf, mask, prefix, shift, hist);
        __syncthreads();
        if (threadIdx.x == 0) {
            int left = s_left;
            unsigned long long seen = 0;
            int b = 255;
            for (; b >= 0; b--) {
                if (seen + hist[b] >= (unsigned long long)left)
                    break;
                seen += hist[b];
            }
            if (b < 0) {
                s_left = -1; // fewer than k: no threshold
            } else {
                s_left = left - (int)seen;
                s_prefix = prefix | ((uint32_t)b << shift);
            }
        }
        __syncthreads();
        if (s_left < 0)
            return -INFINITY;
    }
    return draw_value_of(s_prefix);
}

// One radix pass's masses: each weight of q[c0, c1) above 0 whose bits match
// prefix under mask, added to the bin of its 8 bits at shift in mass (shared;
// the caller zeroes it and syncs after). Runs of one bin summed in a
// register, as draw_count_pass does (most weights of a row fall in bin 0 of
// the first pass). Integer sums: the same masses in any grouping.
__device__ __forceinline__ void draw_mass_pass(const uint32_t *q, int c0, int c1, uint32_t mask,
                                               uint32_t prefix, int shift, unsigned long long *mass)
{
    int run_bin = -1;
    unsigned long long run = 0;
    for (int c = c0 + (int)threadIdx.x; c < c1; c += (int)blockDim.x) {
        uint32_t w = q[c];
        if (w == 0 || (w & mask) != prefix)
            continue;
        int bin = (int)((w >> shift) & 255u);
        if (bin != run_bin) {
            if (run_bin >= 0)
                atomicAdd(&mass[run_bin], run);
            run_bin = bin;
            run = 0;
        }
        run += w;
    }
    if (run_bin >= 0)
        atomicAdd(&mass[run_bin], run);
}

// The smallest kept weight of top_p: the smallest v with mass(q > v) < bound.
__device__ uint32_t draw_top_p_floor(const uint32_t *q, int cols, double bound)
{
    __shared__ unsigned long long mass[256];
    __shared__ uint32_t s_prefix;
    __shared__ unsigned long long s_above;
    if (threadIdx.x == 0) {
        s_prefix = 0;
        s_above = 0;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += blockDim.x)
            mass[b] = 0;
        __syncthreads();
        uint32_t prefix = s_prefix;
        uint32_t mask = shift == 24 ? 0u : ~0u << (shift + 8);
        draw_mass_pass(q, 0, cols, mask, prefix, shift, mass);
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long above = s_above;
            int b = 255;
            for (; b > 0; b--) {
                if ((double)(above + mass[b]) >= bound)
                    break;
                above += mass[b];
            }
            s_above = above;
            s_prefix = prefix | ((uint32_t)b << shift);
        }
        __syncthreads();
    }
    return s_prefix;
}

// Block-wide sum of a 64-bit integer, to every thread.
__device__ __forceinline__ unsigned long long draw_block_sum(unsigned long long v)
{
    __shared__ unsigned long long s_sum;
    if (threadIdx.x == 0)
        s_sum = 0;
    __syncthreads();
    atomicAdd(&s_sum, v);
    __syncthreads();
    unsigned long long t = s_sum;
    __syncthreads();
    return t;
}

// Steps 2-5 over n entries: values vals[j] (token idx[j], or j when idx is
// NULL; -inf entries weigh nothing), lmax the row's largest logit: top_k's
// threshold, the weights written to q[j] (q may alias vals: each thread
// writes only the entries it read), top_p's floor, the draw; *out = the
// token.
__device__ void draw_over(const float *vals, const int32_t *idx, int n, uint32_t *q,
                          const tdm_draw_params &d, float lmax, int32_t *out)
{
    __shared__ unsigned long long span_sum[TDM_CUK_ARGMAX_THREADS];
    float thr = d.top_k > 0 ? draw_kth_largest(vals, n, d.top_k) : -INFINITY;
    unsigned long long part = 0;
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
        float v = vals[c];
        uint32_t w = v >= thr ? tdm_draw_weight(v, lmax, d.inv_t, d.min_p) : 0u;
        q[c] = w;
        part += w;
    }
    __syncthreads(); // every weight written before anyone reads them
    unsigned long long total = draw_block_sum(part);
    uint32_t floor_q = 1;
    if (d.top_p < 1.0f) {
        floor_q = draw_top_p_floor(q, n, tdm_draw_top_p_mass(d.top_p, total));
        floor_q = floor_q > 0 ? floor_q : 1;
    }
    int span = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    int c0 = (int)threadIdx.x * span, c1 = c0 + span < n ? c0 + span : n;
    unsigned long long mine = 0;
    for (int c = c0; c < c1; c++)
        mine += q[c] >= floor_q ? q[c] : 0u;
    span_sum[threadIdx.x] = mine;
    __syncthreads();
    unsigned long long before = 0, kept = 0;
    for (unsigned t = 0; t < blockDim.x; t++) {
        before += t < threadIdx.x ? span_sum[t] : 0ull;
        kept += span_sum[t];
    }
    unsigned long long target = tdm_draw_target(d.key, kept);
    if (target >= before && target < before + mine) {
        unsigned long long acc = before;
        for (int c = c0; c < c1; c++) {
            acc += q[c] >= floor_q ? q[c] : 0u;
            if (acc > target) {
                *out = idx ? idx[c] : c;
                break;
            }
        }
    }
    __syncthreads(); // span_sum reused by the next block of this launch
}

// ---- the split path: a sampled row's passes over its chunks ----
// A row's state between the launches (tdm_cuk_sample_rows' scratch): the walks'
// state entering each pass, [0] set by sample_rows_kernel, [p] (p >= 1) by
// chunk 0's CTA of the launch that chose pass p - 1's bin (every CTA of that
// launch chooses it from the row's histogram, the same way).
struct sample_split_state {
    unsigned long long p_above[5]; // top_p: the mass above the prefix's values
    uint32_t p_prefix[5];          // top_p: the floor's bits chosen so far
    uint32_t k_prefix[5];          // top_k: the threshold's key bits so far
    int32_t k_left[5];             // top_k: rank left inside the prefix; -1: fewer than k
    float lmax;                    // the row's largest logit (finite)
    int32_t split;                 // 1: the row takes the split path
    uint32_t done;                 // CTAs of the drawing launch arrived
};
#define TDM_CUK_SAMPLE_BINS 256
static_assert(TDM_CUK_ARGMAX_THREADS == TDM_CUK_SAMPLE_BINS, "a thread a bin");

// The bits of a value of radix pass p (0..3), from the top.
__device__ __forceinline__ int draw_shift(int pass)
{
    return 24 - 8 * pass;
}

// The block's count of threads where pred holds, to every thread.
__device__ __forceinline__ int draw_block_count(bool pred)
{
    __shared__ int s_n;
    if (threadIdx.x == 0)
        s_n = 0;
    __syncthreads();
    if (pred)
        atomicAdd(&s_n, 1);
    __syncthreads();
    int n = s_n;
    __syncthreads();
    return n;
}

// s[b] = the sum of s[b..255] (256 bins, a thread a bin; s written and
// synchronised before).
__device__ __forceinline__ void draw_suffix_sum(unsigned long long *s)
{
    for (int off = 1; off < TDM_CUK_SAMPLE_BINS; off <<= 1) {
        unsigned long long t =
            (int)threadIdx.x + off < TDM_CUK_SAMPLE_BINS ? s[threadIdx.x + off] : 0ull;
        __syncthreads();
        s[threadIdx.x] += t;
        __syncthreads();
    }
}

// draw_kth_largest's bin choice for the pass at shift, from the row's count
// histogram g: the highest bin whose count with all higher ones reaches the
// rank left (the thread-0 scan there, as a suffix sum and a count).
__device__ void draw_kth_step(const uint32_t *g, int shift, uint32_t *prefix, int32_t *left)
{
    __shared__ unsigned long long s[TDM_CUK_SAMPLE_BINS];
    int32_t l = *left;
    if (l < 0)
        return;
    s[threadIdx.x] = g[threadIdx.x];
    __syncthreads();
    draw_suffix_sum(s);
    int n = draw_block_count(s[threadIdx.x] >= (unsigned long long)l);
    if (n == 0) {
        *left = -1; // fewer than k
        return;
    }
    int b = n - 1; // the bins reaching the rank are 0..b
    unsigned long long seen = b + 1 < TDM_CUK_SAMPLE_BINS ? s[b + 1] : 0ull;
    *left = l - (int)seen;
    *prefix |= (uint32_t)b << shift;
    __syncthreads(); // s reused
}

// draw_top_p_floor's bin choice for the pass at shift, from the row's mass
// histogram g: the highest bin b >= 1 whose mass with all heavier ones and
// above reaches the bound, else 0.
__device__ void draw_top_p_step(const unsigned long long *g, int shift, double bound,
                                uint32_t *prefix, unsigned long long *above)
{
    __shared__ unsigned long long s[TDM_CUK_SAMPLE_BINS];
    s[threadIdx.x] = g[threadIdx.x];
    __syncthreads();
    draw_suffix_sum(s);
    unsigned long long a = *above;
    int b = draw_block_count(threadIdx.x >= 1 && (double)(a + s[threadIdx.x]) >= bound);
    *above = a + (b + 1 < TDM_CUK_SAMPLE_BINS ? s[b + 1] : 0ull);
    *prefix |= (uint32_t)b << shift;
    __syncthreads(); // s reused
}

// Adds the count histogram of the finite values of row[c0, c1) whose key
// matches prefix above the pass's bits to the row's g (draw_kth_largest's).
__device__ void draw_chunk_counts(const float *row, int c0, int c1, int shift, uint32_t prefix,
                                  uint32_t *g)
{
    __shared__ unsigned int hist[TDM_CUK_SAMPLE_BINS];
    hist[threadIdx.x] = 0;
    __syncthreads();
    uint32_t mask = shift == 24 ? 0u : ~0u << (shift + 8);
    draw_count_pass(row, c0, c1, false, mask, prefix, shift, hist);
    __syncthreads();
    if (hist[threadIdx.x])
        atomicAdd(&g[threadIdx.x], hist[threadIdx.x]);
    __syncthreads(); // hist reused
}

// Adds the mass histogram of the weights of q[c0, c1) above 0 matching prefix
// above the pass's bits to the row's g (draw_top_p_floor's).
__device__ void draw_chunk_masses(const uint32_t *q, int c0, int c1, int shift, uint32_t prefix,
                                  unsigned long long *g)
{
    __shared__ unsigned long long mass[TDM_CUK_SAMPLE_BINS];
    mass[threadIdx.x] = 0;
    __syncthreads();
    uint32_t mask = shift == 24 ? 0u : ~0u << (shift + 8);
    draw_mass_pass(q, c0, c1, mask, prefix, shift, mass);
    __syncthreads();
    if (mass[threadIdx.x])
        atomicAdd(&g[threadIdx.x], mass[threadIdx.x]);
    __syncthreads(); // mass reused
}

// After this CTA wrote its chunk's kept weight to seg[chunk]: the row's last
// CTA to arrive draws (the target t over the sum of seg, then the first token
// in id order whose running kept weight exceeds t): seg in chunk order picks
// the chunk holding t, then this CTA scans that chunk's q (>= floor_q kept).
// Other CTAs' writes are read through L2 (__ldcg).
__device__ void draw_by_last_chunk(const uint32_t *q, int cols, const unsigned long long *seg,
                                   int chunks, uint32_t floor_q, uint64_t key, uint32_t *done,
                                   int32_t *out)
{
    __shared__ unsigned long long span_sum[TDM_CUK_ARGMAX_THREADS];
    __shared__ int s_last, s_chunk;
    __shared__ unsigned long long s_base;
    __threadfence(); // this CTA's seg and weights visible before its arrival counts
    __syncthreads();
    if (threadIdx.x == 0)
        s_last = atomicAdd(done, 1u) == (uint32_t)chunks - 1u;
    __syncthreads();
    if (!s_last)
        return;
    __threadfence(); // the other CTAs' writes, after their counts
    if (threadIdx.x == 0) {
        s_chunk = 0; // kept 0 (never: the best token weighs 2^31) draws nothing
        s_base = 0;
    }
    int zspan = (chunks + (int)blockDim.x - 1) / (int)blockDim.x;
    int z0 = (int)threadIdx.x * zspan, z1 = z0 + zspan < chunks ? z0 + zspan : chunks;
    unsigned long long mine = 0;
    for (int z = z0; z < z1; z++)
        mine += __ldcg(&seg[z]);
    span_sum[threadIdx.x] = mine;
    __syncthreads();
    unsigned long long before = 0, kept = 0;
    for (unsigned t = 0; t < blockDim.x; t++) {
        before += t < threadIdx.x ? span_sum[t] : 0ull;
        kept += span_sum[t];
    }
    unsigned long long target = tdm_draw_target(key, kept);
    if (target >= before && target < before + mine) {
        unsigned long long acc = before;
        for (int z = z0; z < z1; z++) {
            unsigned long long w = __ldcg(&seg[z]);
            if (acc + w > target) {
                s_chunk = z;
                s_base = acc;
                break;
            }
            acc += w;
        }
    }
    __syncthreads();
    int c0 = s_chunk * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    int span = (c1 - c0 + (int)blockDim.x - 1) / (int)blockDim.x;
    int s0 = c0 + (int)threadIdx.x * span, s1 = s0 + span < c1 ? s0 + span : c1;
    mine = 0;
    for (int c = s0; c < s1; c++) {
        uint32_t w = __ldcg(&q[c]);
        mine += w >= floor_q ? w : 0u;
    }
    __syncthreads(); // everyone's chunk sums read
    span_sum[threadIdx.x] = mine;
    __syncthreads();
    before = s_base;
    for (unsigned t = 0; t < threadIdx.x; t++)
        before += span_sum[t];
    if (target >= before && target < before + mine) {
        unsigned long long acc = before;
        for (int c = s0; c < s1; c++) {
            uint32_t w = __ldcg(&q[c]);
            acc += w >= floor_q ? w : 0u;
            if (acc > target) {
                *out = c;
                break;
            }
        }
    }
    __syncthreads(); // span_sum reused by the next block of this launch
}

// grid (n, chunks of TDM_CUK_ARGMAX_CHUNK columns), block TDM_CUK_ARGMAX_THREADS:
// chunk blockIdx.y of row blockIdx.x. Applies the row's adjustments that fall
// in the chunk and its structured-output mask, writes the chunk's first largest to part_v/part_i,
// and for a sampled row with 0 < top_k <= TDM_CUK_SAMPLE_KMAX its candidates: every element >= the
// chunk's own k-th largest finite value (all its finite ones when it has fewer), in index order, to
// the chunk's TDM_CUK_SAMPLE_CAP slots of cand_v/cand_i, the rest -inf; cand_n[row][chunk] = how
// many, or -1 (no candidates: the row takes the full path; more than the slots hold: ties). The
// row's k largest values are among the union of the chunks' lists (a chunk's k-th largest is at
// most the row's), so the row's top_k set is.
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    sample_chunk_kernel(float *x, int cols, const tdm_draw_params *params, const tdm_draw_adj *adj,
                        const uint32_t *masks, float *part_v, int32_t *part_i, float *cand_v,
                        int32_t *cand_i, int32_t *cand_n)
{
    __shared__ int counts[TDM_CUK_ARGMAX_THREADS];
    float *row = x + (size_t)blockIdx.x * cols;
    const tdm_draw_params d = params[blockIdx.x];
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    for (int i = threadIdx.x; i < d.n_adj; i += blockDim.x) {
        tdm_draw_adj a = adj[d.adj_off + i];
        if (a.token >= c0 && a.token < c1)
            row[a.token] = tdm_draw_adjust(row[a.token], &d, &a);
    }
    __syncthreads();
    // The structured-output mask after the adjustments: -inf stays -inf
    // through every adjustment, so this is the CPU's mask-then-sample.
    if (d.n_mask_words > 0) {
        const uint32_t *mk = masks + d.mask_off;
        for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x)
            if ((c >> 5) >= d.n_mask_words || !((mk[c >> 5] >> (c & 31)) & 1u))
                row[c] = -INFINITY;
        __syncthreads();
    }
    float wv;
    int wi;
    chunk_first_largest(row, c0, c1, &wv, &wi);
    size_t slot = (size_t)blockIdx.x * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) {
        part_v[slot] = wv;
        part_i[slot] = wi;
    }
    if (d.inv_t == 0.0f || d.top_k <= 0 || d.top_k > TDM_CUK_SAMPLE_KMAX) {
        if (threadIdx.x == 0)
            cand_n[slot] = -1;
        return;
    }
    float t = draw_kth_largest(row + c0, c1 - c0, d.top_k);
    // Ordered compaction: each thread a contiguous span, offsets by the spans
    // before it.
    int len = c1 - c0, span = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    int s0 = c0 + (int)threadIdx.x * span, s1 = s0 + span < c1 ? s0 + span : c1;
    int mine = 0;
    for (int c = s0; c < s1; c++)
        mine += row[c] >= t && row[c] > -INFINITY;
    counts[threadIdx.x] = mine;
    __syncthreads();
    int before = 0, m = 0;
    for (unsigned u = 0; u < blockDim.x; u++) {
        before += u < threadIdx.x ? counts[u] : 0;
        m += counts[u];
    }
    float *cv = cand_v + slot * TDM_CUK_SAMPLE_CAP;
    int32_t *ci = cand_i + slot * TDM_CUK_SAMPLE_CAP;
    if (m <= TDM_CUK_SAMPLE_CAP) {
        int o = before;
        for (int c = s0; c < s1; c++)
            if (row[c] >= t && row[c] > -INFINITY) {
                cv[o] = row[c];
                ci[o++] = c;
            }
        for (int j = m + (int)threadIdx.x; j < TDM_CUK_SAMPLE_CAP; j += blockDim.x) {
            cv[j] = -INFINITY;
            ci[j] = c0;
        }
    }
    if (threadIdx.x == 0)
        cand_n[slot] = m <= TDM_CUK_SAMPLE_CAP ? m : -1;
    __syncthreads(); // counts reused by the next block
}

// grid (n), block TDM_CUK_ARGMAX_THREADS, after sample_chunk_kernel: row
// blockIdx.x's first largest from its chunks' (greedy rows and rows without a
// finite maximum end there), then for 0 < top_k <= TDM_CUK_SAMPLE_KMAX the
// draw over its chunks' candidates when every chunk has them (chunks x
// TDM_CUK_SAMPLE_CAP entries instead of the row), else over the whole row
// (one CTA: ties overflowing a chunk's slots). Every other sampled row takes
// the split path: its state st[row] (every row's split flag is written) and
// zeroed histograms kh[row][4][256] (top_k) and ph[row][4][256] (top_p).
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    sample_rows_kernel(float *x, int cols, const tdm_draw_params *params, const float *part_v,
                       const int32_t *part_i, float *cand_v, int32_t *cand_i, const int32_t *cand_n,
                       sample_split_state *st, uint32_t *kh, unsigned long long *ph, int32_t *ids)
{
    __shared__ int s_full;
    float *row = x + (size_t)blockIdx.x * cols;
    const tdm_draw_params d = params[blockIdx.x];
    sample_split_state *s = &st[blockIdx.x];
    int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
    size_t first = (size_t)blockIdx.x * chunks;
    float lmax;
    int imax;
    merge_winners(part_v + first, part_i + first, chunks, &lmax, &imax);
    bool sampled = d.inv_t != 0.0f && isfinite(lmax);
    bool split = sampled && (d.top_k <= 0 || d.top_k > TDM_CUK_SAMPLE_KMAX);
    if (threadIdx.x == 0) {
        s->split = split;
        s->lmax = lmax;
        s->done = 0;
        s->k_prefix[0] = 0;
        s->k_left[0] = d.top_k;
        s->p_prefix[0] = 0;
        s->p_above[0] = 0;
    }
    if (!sampled) {
        if (threadIdx.x == 0)
            ids[blockIdx.x] = imax < 0 ? 0 : imax;
        return;
    }
    if (split) {
        size_t h = (size_t)blockIdx.x * 4 * TDM_CUK_SAMPLE_BINS;
        for (int b = threadIdx.x; b < 4 * TDM_CUK_SAMPLE_BINS; b += blockDim.x) {
            kh[h + b] = 0;
            ph[h + b] = 0;
        }
        return;
    }
    if (threadIdx.x == 0)
        s_full = 0;
    __syncthreads();
    for (int z = threadIdx.x; z < chunks; z += blockDim.x)
        if (cand_n[first + z] < 0)
            atomicAdd(&s_full, 1);
    __syncthreads();
    if (s_full == 0) {
        float *cv = cand_v + first * TDM_CUK_SAMPLE_CAP;
        draw_over(cv, cand_i + first * TDM_CUK_SAMPLE_CAP, chunks * TDM_CUK_SAMPLE_CAP,
                  (uint32_t *)cv, d, lmax, &ids[blockIdx.x]);
    } else {
        draw_over(row, NULL, cols, (uint32_t *)row, d, lmax, &ids[blockIdx.x]);
    }
}

// grid (n, chunks), block TDM_CUK_ARGMAX_THREADS, after sample_rows_kernel,
// pass = 0..3 in turn: pass `pass` of top_k's walk (draw_kth_largest) for the
// split rows with top_k > 0: every CTA chooses pass - 1's bin from the row's
// kh[row][pass - 1] (chunk 0's CTA records it), then adds its chunk's counts
// under the new prefix to kh[row][pass].
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    sample_top_k_kernel(const float *x, int cols, const tdm_draw_params *params,
                        sample_split_state *st, uint32_t *kh, int pass)
{
    sample_split_state *s = &st[blockIdx.x];
    const tdm_draw_params d = params[blockIdx.x];
    if (!s->split || d.top_k <= 0)
        return;
    const float *row = x + (size_t)blockIdx.x * cols;
    uint32_t *g = kh + (size_t)blockIdx.x * 4 * TDM_CUK_SAMPLE_BINS;
    uint32_t prefix = s->k_prefix[pass > 0 ? pass - 1 : 0];
    int32_t left = s->k_left[pass > 0 ? pass - 1 : 0];
    if (pass > 0) {
        draw_kth_step(g + (pass - 1) * TDM_CUK_SAMPLE_BINS, draw_shift(pass - 1), &prefix, &left);
        if (blockIdx.y == 0 && threadIdx.x == 0) {
            s->k_prefix[pass] = prefix;
            s->k_left[pass] = left;
        }
    }
    if (left < 0)
        return;
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    draw_chunk_counts(row, c0, c1, draw_shift(pass), prefix, g + pass * TDM_CUK_SAMPLE_BINS);
}

// grid (n, chunks), block TDM_CUK_ARGMAX_THREADS, after the top_k passes: for
// the split rows, top_k's threshold (the last bin choice), each token's
// weight written over its logit, the chunk's total to tot[row][chunk]; with
// top_p < 1 the chunk's masses to ph[row][0] (top_p's pass 0), else the
// row's last CTA draws (every weight is kept).
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    sample_weights_kernel(float *x, int cols, const tdm_draw_params *params, sample_split_state *st,
                          const uint32_t *kh, unsigned long long *ph, unsigned long long *tot,
                          int32_t *ids)
{
    sample_split_state *s = &st[blockIdx.x];
    const tdm_draw_params d = params[blockIdx.x];
    if (!s->split)
        return;
    float *row = x + (size_t)blockIdx.x * cols;
    uint32_t *q = (uint32_t *)row;
    float thr = -INFINITY;
    if (d.top_k > 0) {
        uint32_t prefix = s->k_prefix[3];
        int32_t left = s->k_left[3];
        draw_kth_step(kh + ((size_t)blockIdx.x * 4 + 3) * TDM_CUK_SAMPLE_BINS, draw_shift(3),
                      &prefix, &left);
        thr = left < 0 ? -INFINITY : draw_value_of(prefix);
    }
    float lmax = s->lmax;
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    unsigned long long part = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float v = row[c];
        uint32_t w = v >= thr ? tdm_draw_weight(v, lmax, d.inv_t, d.min_p) : 0u;
        q[c] = w;
        part += w;
    }
    unsigned long long total = draw_block_sum(part); // synchronises: every weight written
    unsigned long long *seg = tot + (size_t)blockIdx.x * gridDim.y;
    if (threadIdx.x == 0)
        seg[blockIdx.y] = total;
    if (d.top_p < 1.0f)
        draw_chunk_masses(q, c0, c1, draw_shift(0), 0u,
                          ph + (size_t)blockIdx.x * 4 * TDM_CUK_SAMPLE_BINS);
    else
        draw_by_last_chunk(q, cols, seg, (int)gridDim.y, 1u, d.key, &s->done, &ids[blockIdx.x]);
}

// grid (n, chunks), block TDM_CUK_ARGMAX_THREADS, after sample_weights_kernel,
// pass = 1..4 in turn, for the split rows with top_p < 1: the bound top_p * Q
// (Q the sum of tot[row]), pass - 1's bin choice of top_p's walk
// (draw_top_p_floor) from ph[row][pass - 1] (chunk 0's CTA records it); then
// passes 1..3 add the chunk's masses under the new prefix to ph[row][pass],
// and pass 4 (the floor known) writes the chunk's kept weight to
// kept[row][chunk], and the row's last CTA draws.
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    sample_top_p_kernel(const float *x, int cols, const tdm_draw_params *params,
                        sample_split_state *st, unsigned long long *ph,
                        const unsigned long long *tot, unsigned long long *kept, int32_t *ids,
                        int pass)
{
    sample_split_state *s = &st[blockIdx.x];
    const tdm_draw_params d = params[blockIdx.x];
    if (!s->split || !(d.top_p < 1.0f))
        return;
    const uint32_t *q = (const uint32_t *)(x + (size_t)blockIdx.x * cols);
    unsigned long long *g = ph + (size_t)blockIdx.x * 4 * TDM_CUK_SAMPLE_BINS;
    const unsigned long long *t = tot + (size_t)blockIdx.x * gridDim.y;
    unsigned long long part = 0;
    for (int z = threadIdx.x; z < (int)gridDim.y; z += blockDim.x)
        part += t[z];
    double bound = tdm_draw_top_p_mass(d.top_p, draw_block_sum(part));
    uint32_t prefix = s->p_prefix[pass - 1];
    unsigned long long above = s->p_above[pass - 1];
    draw_top_p_step(g + (pass - 1) * TDM_CUK_SAMPLE_BINS, draw_shift(pass - 1), bound, &prefix,
                    &above);
    if (pass < 4 && blockIdx.y == 0 && threadIdx.x == 0) {
        s->p_prefix[pass] = prefix;
        s->p_above[pass] = above;
    }
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    if (pass < 4) {
        draw_chunk_masses(q, c0, c1, draw_shift(pass), prefix, g + pass * TDM_CUK_SAMPLE_BINS);
        return;
    }
    uint32_t floor_q = prefix > 0 ? prefix : 1u;
    unsigned long long mine = 0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x)
        mine += q[c] >= floor_q ? q[c] : 0u;
    unsigned long long k = draw_block_sum(mine);
    unsigned long long *seg = kept + (size_t)blockIdx.x * gridDim.y;
    if (threadIdx.x == 0)
        seg[blockIdx.y] = k;
    draw_by_last_chunk(q, cols, seg, (int)gridDim.y, floor_q, d.key, &s->done, &ids[blockIdx.x]);
}

// ---- logprobs on the device (the CPU sampler's fill_logprobs) -----------------------------
// A row asking logprobs gets, with its token, the log-softmax of its logits as
// the model gave them (after the structured-output mask, before adjustments
// and temperature: the row the CPU sampler copies as raw) at the token, and
// the top_logprobs largest (ties to the lower id, NaN never): the 16 + 160
// bytes it needs come back instead of its 600 KB row. Two launches around the
// draw, over the rows that ask only (lp_rows[j] = the row of the j-th):
//   before: a CTA per (row, chunk of TDM_CUK_ARGMAX_CHUNK columns) copies the
//   chunk, masked, to raw (the draw overwrites the row), and writes the
//   chunk's maximum m, its sum of expf(l - m) (a fixed reduction tree, in
//   double) and its top_logprobs first entries in (value desc, id asc) order,
//   unsorted: every entry above the chunk's k-th largest, then the lowest
//   ids of those equal to it;
//   after: a CTA per row merges them: lse = max + log(sum_c s_c e^(m_c -
//   max)), the top entries picked one at a time from the chunks' lists, and
//   the drawn token's raw value. The host sums expf(l - max) over the row in
//   id order instead: the same value within a few units of the last place.

// The deterministic block sum of a double (a fixed tree), to every thread.
__device__ __forceinline__ double lp_block_sum(double v)
{
    __shared__ double red[TDM_CUK_ARGMAX_THREADS];
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            red[threadIdx.x] += red[threadIdx.x + s];
        __syncthreads();
    }
    double t = red[0];
    __syncthreads();
    return t;
}

// The logit the CPU sampler copies as raw: -inf where the row's
// structured-output mask leaves the token out (the engine masks the row
// before the sampler sees it).
__device__ __forceinline__ float lp_raw(const float *row, int c, const tdm_draw_params &d,
                                        const uint32_t *masks)
{
    if (d.n_mask_words > 0) {
        const uint32_t *mk = masks + d.mask_off;
        if ((c >> 5) >= d.n_mask_words || !((mk[c >> 5] >> (c & 31)) & 1u))
            return -INFINITY;
    }
    return row[c];
}

// The exponent's shift of a chunk whose maximum is m: m, or 0 when m is not
// finite (a chunk of -inf sums 0; a +inf makes the row's sum NaN, as the
// host's inf - inf does).
__device__ __forceinline__ float lp_shift(float m)
{
    return isfinite(m) ? m : 0.0f;
}

// grid (rows asking, chunks), block TDM_CUK_ARGMAX_THREADS; before
// sample_chunk_kernel. Scratch per (asking row, chunk): lp_m, lp_s, and
// TDM_DRAW_MAX_LOGPROBS slots of lp_cv/lp_ci (lp_cn of them used).
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    logprob_chunk_kernel(const float *x, int cols, const tdm_draw_params *params,
                         const uint32_t *masks, const int32_t *lp_rows, float *raw, float *lp_m,
                         double *lp_s, float *lp_cv, int32_t *lp_ci, int32_t *lp_cn)
{
    __shared__ int gt_n[TDM_CUK_ARGMAX_THREADS], eq_n[TDM_CUK_ARGMAX_THREADS];
    int row = lp_rows[blockIdx.x];
    const tdm_draw_params d = params[row];
    const float *r = x + (size_t)row * cols;
    float *rr = raw + (size_t)blockIdx.x * cols;
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x)
        rr[c] = lp_raw(r, c, d, masks);
    __syncthreads();
    float m;
    int mi;
    chunk_first_largest(rr, c0, c1, &m, &mi); // -inf when nothing is above it
    float sh = lp_shift(m);
    double part = 0.0;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x)
        part += (double)expf(rr[c] - sh);
    double s = lp_block_sum(part);
    size_t slot = (size_t)blockIdx.x * gridDim.y + blockIdx.y;
    if (threadIdx.x == 0) {
        lp_m[slot] = m;
        lp_s[slot] = s;
    }
    int k = d.top_logprobs;
    if (k <= 0) {
        if (threadIdx.x == 0)
            lp_cn[slot] = 0;
        return;
    }
    float t = draw_kth_largest(rr + c0, c1 - c0, k, true);
    // Ordered spans: a thread's entries above t at the offset of the spans
    // before it, then the lowest ids equal to t after all of those, while
    // fewer than k are taken (fewer than k are above t by t's definition).
    int len = c1 - c0, span = (len + (int)blockDim.x - 1) / (int)blockDim.x;
    int s0 = c0 + (int)threadIdx.x * span, s1 = s0 + span < c1 ? s0 + span : c1;
    int gt = 0, eq = 0;
    for (int c = s0; c < s1; c++) {
        gt += rr[c] > t;
        eq += rr[c] == t;
    }
    gt_n[threadIdx.x] = gt;
    eq_n[threadIdx.x] = eq;
    __syncthreads();
    int gt_before = 0, eq_before = 0, g = 0, e = 0;
    for (unsigned u = 0; u < blockDim.x; u++) {
        gt_before += u < threadIdx.x ? gt_n[u] : 0;
        eq_before += u < threadIdx.x ? eq_n[u] : 0;
        g += gt_n[u];
        e += eq_n[u];
    }
    float *cv = lp_cv + slot * TDM_DRAW_MAX_LOGPROBS;
    int32_t *ci = lp_ci + slot * TDM_DRAW_MAX_LOGPROBS;
    int og = gt_before, oe = g + eq_before;
    for (int c = s0; c < s1; c++) {
        float v = rr[c];
        if (v > t) {
            cv[og] = v;
            ci[og++] = c;
        } else if (v == t && oe < k) {
            cv[oe] = v;
            ci[oe++] = c;
        }
    }
    if (threadIdx.x == 0)
        lp_cn[slot] = g + e < k ? g + e : k;
    __syncthreads(); // gt_n/eq_n reused by the next block
}

// grid (rows asking), block TDM_CUK_ARGMAX_THREADS; after sample_rows_kernel
// (ids holds the drawn tokens). out[j]: the j-th asking row's logprobs.
__global__ void __launch_bounds__(TDM_CUK_ARGMAX_THREADS)
    logprob_rows_kernel(int cols, const tdm_draw_params *params, const int32_t *lp_rows,
                        const float *raw, const float *lp_m, const double *lp_s, const float *lp_cv,
                        int32_t *lp_ci, const int32_t *lp_cn, const int32_t *ids,
                        tdm_draw_logprobs *out)
{
    __shared__ double s_lse;
    int row = lp_rows[blockIdx.x];
    const tdm_draw_params d = params[row];
    int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
    size_t first = (size_t)blockIdx.x * chunks;
    const float *rr = raw + (size_t)blockIdx.x * cols;
    // The row's maximum (the chunks' are never NaN), then the sum of every
    // chunk's exponentials rescaled to it, in chunk order.
    if (threadIdx.x == 0) {
        float lmax = -INFINITY;
        for (int z = 0; z < chunks; z++)
            lmax = lp_m[first + z] > lmax ? lp_m[first + z] : lmax;
        double tot = 0.0;
        for (int z = 0; z < chunks; z++) {
            double s = lp_s[first + z];
            tot += s == 0.0 ? 0.0 : s * exp((double)lp_shift(lp_m[first + z]) - (double)lmax);
        }
        s_lse = (double)lmax + log(tot);
    }
    __syncthreads();
    double lse = s_lse;
    tdm_draw_logprobs *o = &out[blockIdx.x];
    int32_t tok = ids[row];
    if (threadIdx.x == 0)
        o->logprob = (float)((double)rr[tok] - lse);
    // The top entries, one a round: the largest value left, the lower id on a
    // tie; taken entries' ids become -1.
    int k = d.top_logprobs, n_top = 0;
    for (int z = 0; z < chunks; z++)
        n_top += lp_cn[first + z];
    n_top = n_top < k ? n_top : k;
    int n_slots = chunks * TDM_DRAW_MAX_LOGPROBS;
    const float *cv = lp_cv + first * TDM_DRAW_MAX_LOGPROBS;
    int32_t *ci = lp_ci + first * TDM_DRAW_MAX_LOGPROBS;
    for (int j = 0; j < n_top; j++) {
        float v = -INFINITY;
        int id = -1, at = -1;
        for (int q = threadIdx.x; q < n_slots; q += blockDim.x) {
            int z = q / TDM_DRAW_MAX_LOGPROBS;
            if (q % TDM_DRAW_MAX_LOGPROBS >= lp_cn[first + z] || ci[q] < 0)
                continue;
            if (id < 0 || cv[q] > v || (cv[q] == v && ci[q] < id)) {
                v = cv[q];
                id = ci[q];
                at = q;
            }
        }
        float wv;
        int wi;
        argmax_tree(v, id, &wv, &wi);
        if (id >= 0 && id == wi)
            ci[at] = -1;
        if (threadIdx.x == 0) {
            o->top_token[j] = wi;
            o->top_logprob[j] = (float)((double)wv - lse);
        }
        __syncthreads(); // the taken entry marked before the next round
    }
    if (threadIdx.x == 0)
        o->num_top = n_top;
}

template <class KV>
__global__ void kv_scatter_kernel(KV *pool, const int32_t *blocks, size_t block_elems,
                                  const float *in)
{
    KV *dst = pool + (size_t)blocks[blockIdx.x] * block_elems;
    const float *src = in + (size_t)blockIdx.x * block_elems;
    for (size_t i = threadIdx.x; i < block_elems; i += blockDim.x)
        kv_put(&dst[i], src[i]);
}

// ---- small-batch GEMM (GEMV with a fixed K-split) on tensor cores ------------------------
// grid (tiles, splits), block TDM_CUK_GEMV_THREADS: CTA (t, s) computes
// y[m][row] for the TDM_CUK_GEMV_ROWS = 16 rows of tile t over split s's
// columns, m < n <= 16, with mma.sync m16n8k16: A = the tile's 16 weight rows
// x 16 columns, B = the same 16 columns of x for 8 decode rows (a second
// mma for rows 8 .. 15 when n > 8), f32 accumulators in registers.
//
// Loads: warp w takes the 32 columns at w * 32 of each 256-column span;
// lane (g = lane / 4, t = lane % 4) loads 16 bytes (8 bf16, columns 8t ..
// 8t + 7 of the warp's 32) of weight rows g and g + 8, and of x rows g (and
// g + 8), so each weight element is loaded once for all n rows and the
// registers are the fragments as loaded (no shuffles, no shared memory).
// A lane issues UNROLL spans' loads before using them (bytes in flight).
//
// The k permutation: with word i of a 16-byte load holding columns 8t + 2i,
// 8t + 2i + 1 (low half first), the fragment layouts (cuda_mma.cuh) give
//   mma 0: logical k 2t, 2t + 1 -> columns 8t, 8t + 1 (a[0], a[1], b[0]: word 0)
//          logical k 2t + 8, 2t + 9 -> columns 8t + 2, 8t + 3 (a[2], a[3], b[1]: word 1)
//   mma 1: the same with words 2 and 3 (columns 8t + 4 .. 8t + 7).
// A and B take the same words of the same columns, so each mma sums 16
// products w[row][c] x[m][c] over 16 distinct columns, and the two mmas
// cover 8t .. 8t + 7 for t = 0 .. 3: all 32 columns, each once.
//
// Fixed summation order, nothing of it depends on n: per (row, m) the warp
// chains its mmas (span by span, mma 0 then 1; inside an mma the hardware's
// order, the emulator's exact sum rounded once), then the 8 warps' sums are
// added in warp order through shared memory, then the splits in index order
// by the tile's last CTA. Column m of an mma's D depends on column m of B
// alone (each element of D is a dot product of a row of A and a column of
// B), and the columns of decode rows >= n are zeros (never loaded): so a
// row's result is bitwise the same for every n <= 16, including whether the
// second mma runs. Past the split's end (cols a multiple of 8) a lane's A
// and B are zeros; a warp whose 32 columns all lie past it skips the span
// (shape-only, so again independent of n).
#define TDM_CUK_GEMV_THREADS 256
#define TDM_CUK_GEMV_WARPS (TDM_CUK_GEMV_THREADS / 32)
#define TDM_CUK_GEMV_UNROLL 4

__global__ void __launch_bounds__(TDM_CUK_GEMV_THREADS)
    gemv_kernel(const uint16_t *w, int rows, int cols, int spans, const uint16_t *x, int n,
                const float *bias, float *y, float *part, int32_t *counts)
{
    constexpr int U = TDM_CUK_GEMV_UNROLL, SPAN = TDM_CUK_GEMV_SPAN;
    constexpr int ROWS = TDM_CUK_GEMV_ROWS, WARPS = TDM_CUK_GEMV_WARPS, NMAX = TDM_CUK_GEMV_MAX_N;
    static_assert(ROWS == 16 && NMAX == 16 && SPAN == WARPS * 32,
                  "one m16n8k16 A tile a CTA, two n8 halves, 32 columns a warp");
    __shared__ float red[WARPS][NMAX][ROWS]; // each warp's sums, added in warp order
    __shared__ int last;
    int tile = (int)blockIdx.x, split = (int)blockIdx.y, splits = (int)gridDim.y;
    int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int ra = tile * ROWS + g, rb = ra + 8;
    int kw = split * spans * SPAN + warp * 32; // the warp's first column in the split's first span
    int k1 = (split + 1) * spans * SPAN < cols ? (split + 1) * spans * SPAN : cols;
    int halves = n > 8 ? 2 : 1;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float acc[2][4];
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 4; e++)
            acc[h][e] = 0.0f;
    for (int j0 = 0; j0 < spans; j0 += U) {
        uint4 wa[U], wb[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int k = kw + (j0 + u) * SPAN + t * 8;
            bool in = j0 + u < spans && k < k1;
            wa[u] = in && ra < rows ? __ldcs((const uint4 *)(w + (size_t)ra * cols + k)) : zero;
            wb[u] = in && rb < rows ? __ldcs((const uint4 *)(w + (size_t)rb * cols + k)) : zero;
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            // Warp-uniform: every lane of the warp runs the mmas or none does.
            if (j0 + u >= spans || kw + (j0 + u) * SPAN >= k1)
                break; // past the split's end (so are the later spans)
            int k = kw + (j0 + u) * SPAN + t * 8;
            uint32_t a0[4] = {wa[u].x, wb[u].x, wa[u].y, wb[u].y};
            uint32_t a1[4] = {wa[u].z, wb[u].z, wa[u].w, wb[u].w};
#pragma unroll
            for (int h = 0; h < 2; h++) {
                if (h < halves) {
                    int m = h * 8 + g;
                    uint4 xv =
                        m < n && k < k1 ? __ldg((const uint4 *)(x + (size_t)m * cols + k)) : zero;
                    uint32_t b0[2] = {xv.x, xv.y}, b1[2] = {xv.z, xv.w};
                    tdm_mma_bf16_16816(acc[h], a0, b0, acc[h]);
                    tdm_mma_bf16_16816(acc[h], a1, b1, acc[h]);
                }
            }
        }
    }
    // D: acc[h][0], [1] = row g, decode rows 8h + 2t, 2t + 1; [2], [3] = row g + 8.
    // Unrolled: acc stays in registers (a runtime index put it on the stack).
#pragma unroll
    for (int h = 0; h < 2; h++)
        if (h < halves)
            for (int e = 0; e < 4; e++)
                red[warp][h * 8 + 2 * t + e % 2][g + (e / 2) * 8] = acc[h][e];
    __syncthreads();
    bool one = splits == 1;
    {
        int i = (int)threadIdx.x, m = i / ROWS, r = i % ROWS, row = tile * ROWS + r;
        static_assert(TDM_CUK_GEMV_THREADS == NMAX * ROWS, "a thread per (x row, weight row)");
        if (m < n && row < rows) {
            float s = red[0][m][r];
            for (int v = 1; v < WARPS; v++)
                s += red[v][m][r];
            if (one)
                y[(size_t)m * rows + row] = bias ? s + bias[row] : s;
            else
                part[((size_t)split * n + m) * rows + row] = s;
        }
    }
    if (one)
        return;
    // The last CTA of the row tile to arrive adds the splits' partials in
    // split order (whichever CTA that is, the sum is the same).
    __threadfence(); // this CTA's partials visible before its arrival counts
    __syncthreads();
    if (threadIdx.x == 0)
        last = atomicAdd(&counts[tile], 1) == splits - 1;
    __syncthreads();
    if (!last)
        return;
    if (threadIdx.x == 0)
        counts[tile] = 0; // every split has arrived: ready for the next launch
    for (int i = (int)threadIdx.x; i < n * ROWS; i += (int)blockDim.x) {
        int m = i / ROWS, row = tile * ROWS + i % ROWS;
        if (row >= rows)
            continue;
        // volatile: other CTAs wrote these; read them from L2, not a stale L1 line.
        const volatile float *p = part + (size_t)m * rows + row;
        float s = p[0];
        for (int z = 1; z < splits; z++)
            s += p[(size_t)z * n * rows];
        y[(size_t)m * rows + row] = bias ? s + bias[row] : s;
    }
}

// Address of position pos of KV head kvh in a paged layer.
template <class KV>
__device__ __forceinline__ const KV *kv_row(const KV *cache, const int32_t *bt, int pos,
                                            int n_kv_heads, int kvh, int block_size, int head_dim)
{
    int blk = bt[pos / block_size];
    return cache + (((size_t)blk * n_kv_heads + kvh) * block_size + pos % block_size) * head_dim;
}

// ---- decode attention (flash-decoding) ---------------------------------------------------
#define TDM_CUK_DECODE_THREADS 128

#ifdef __CUDACC__
#define TDM_CUK_UNROLL _Pragma("unroll")
#else
#define TDM_CUK_UNROLL
#endif

// A 16-byte load; p must be 16-byte aligned (global or shared memory).
__device__ __forceinline__ uint4 ld16(const void *p)
{
#ifdef __CUDACC__
    return *(const uint4 *)p;
#else
    return tdm_emu_ld16(p);
#endif
}

__device__ __forceinline__ float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// The elements of a 16-byte chunk of a KV row as f32: 4 f32, or 8 bf16 (the
// low half of each word first: little-endian). The last argument picks the
// pool's type.
__device__ __forceinline__ void kv_unpack(uint4 c, float *o, const float *)
{
    o[0] = bits_f32(c.x);
    o[1] = bits_f32(c.y);
    o[2] = bits_f32(c.z);
    o[3] = bits_f32(c.w);
}
__device__ __forceinline__ void kv_unpack(uint4 c, float *o, const uint16_t *)
{
    const uint32_t w[4] = {c.x, c.y, c.z, c.w};
    for (int i = 0; i < 4; i++) {
        o[2 * i] = bits_f32(w[i] << 16);
        o[2 * i + 1] = bits_f32(w[i] & 0xffff0000u);
    }
}

// grid (n_decode, n_kv_heads * ceil(group / GMAX), max_splits), block 128.
// Block (s, u, z) serves up to GMAX query heads of one KV head (a GQA group,
// or a slice of a larger one) over the keys [z * PART, min(L, (z + 1) * PART))
// of decode sequence s (L = start_pos + 1), and reads each K and V element of
// them once, in one 16-byte load, for all those heads:
//   - a lane holds one 16-byte chunk of a key row (VEC elements) and the same
//     chunk of every head's query; LPK lanes make a row, so a warp reads KPW =
//     32 / LPK rows a round and the 4 warps take the split's rows in turns
//     (bf16, head_dim 64: 8 lanes a row, 16 rows a round, 2 rounds: every lane
//     of every warp has keys at PART = 32, and issues its two K and two V
//     loads before anything waits for them);
//   - a key's score is its LPK lanes' partial dots summed by a butterfly; each
//     warp keeps its own softmax (max, sum of exponentials) and its output sum
//     over its keys, computed in the layout of the loads (P.V as parallel as
//     the scores: no loop over keys in one thread);
//   - after one barrier the warps merge in index order, rescaled by
//     e^(m_w - M), into the split's (max M, sum, unnormalised output) per head.
// A sequence of one split (L <= PART) is finished here: output = sum / sum of
// exponentials. With several, each block writes its split's partial to
// part_o/part_ml and counts itself done in part_done[s][first head of the
// unit]; the block that counts last merges the sequence's splits in split
// order (so the result does not depend on which block came last), writes the
// output and sets the counter back to zero for the next launch: no combine
// launch. Blocks of splits beyond the sequence's own count exit at once. Each
// head's arithmetic is the same whatever shares the block or the launch, so a
// row depends on its own sequence only.
//
// With inv_freq (a decode-only batch: RoPE, KV store and attention in one
// launch), q is the un-rotated qkv row: the block ropes its query heads in
// shared memory, and the block of the last split ropes the new token's key
// (at q + n_heads * HD in the row; v after it) and stores it and its value at
// slots[row] (a negative slot: padding, nothing stored), all with the
// arithmetic of rope_kv_store_kernel (cos and sin from one table per block),
// and reads that row back from shared memory as stored instead of from the
// cache. Blocks of one KV head that split a large group (> GMAX heads) each
// store the same values.
template <class KV, int HD>
__global__ void __launch_bounds__(TDM_CUK_DECODE_THREADS)
    attn_decode_kernel(const float *q, int q_stride, const KV *k_cache, const KV *v_cache,
                       const tdm_cuk_seq *seqs, const int32_t *block_tables, int bt_stride,
                       const int32_t *decode_seqs, int max_splits, float *part_o, float *part_ml,
                       int32_t *part_done, void *out, int out_bf16, const float *inv_freq,
                       const int32_t *slots, KV *k_store, KV *v_store, int n_heads, int n_kv_heads,
                       int block_size, float scale)
{
    constexpr int PART = TDM_CUK_DECODE_PART, GMAX = TDM_CUK_DECODE_GROUP;
    constexpr int NW = TDM_CUK_DECODE_THREADS / 32;
    constexpr int VEC = 16 / (int)sizeof(KV);             // elements of a 16-byte load
    constexpr int LPK = HD / VEC;                         // lanes per key row
    constexpr int KPW = 32 / LPK;                         // rows a warp reads per round
    constexpr int R = (PART + NW * KPW - 1) / (NW * KPW); // rounds
    constexpr int HALF = HD / 2;
    static_assert(HD % VEC == 0 && LPK >= 1 && LPK <= 32 && 32 % LPK == 0,
                  "a key row is a power-of-two count of 16-byte chunks, at most 32");
    static_assert(HD <= TDM_CUK_DECODE_THREADS, "a thread per element of the new token's row");
    __shared__ float qs[GMAX][HD];
    __shared__ float rope_c[HALF], rope_s[HALF];
    __shared__ __align__(16) KV kv_new[2][HD];            // the new token's k and v as stored
    __shared__ __align__(16) float po[NW][KPW][GMAX][HD]; // each row slot's output sum
    __shared__ float wm[NW][GMAX], wl[NW][GMAX];          // each warp's max and sum
    __shared__ int last_s;

    int si = decode_seqs[blockIdx.x];
    tdm_cuk_seq sq = seqs[si];
    int split = blockIdx.z;
    int kv_len = sq.start_pos + 1;
    int p0 = split * PART;
    if (p0 >= kv_len)
        return;
    int nk = kv_len - p0 < PART ? kv_len - p0 : PART;
    int ns = (kv_len + PART - 1) / PART;
    int group = n_heads / n_kv_heads;
    int subs = (group + GMAX - 1) / GMAX;
    int kvh = blockIdx.y / subs;
    int h0 = kvh * group + (blockIdx.y % subs) * GMAX;
    int ng = kvh * group + group - h0 < GMAX ? kvh * group + group - h0 : GMAX;
    const int32_t *bt = block_tables + (size_t)si * bt_stride;
    const float *qrow = q + (size_t)sq.row * q_stride;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int seg = lane / LPK, c = lane % LPK; // the lane's row of a round, its chunk of the row
    // This block stores the new token: RoPE fused, not padding, its split.
    int slot = inv_freq ? slots[sq.row] : -1;
    bool store = slot >= 0 && p0 + nk == kv_len;

    // Every K and V load of the split first; the stored row comes later from
    // shared memory.
    const uint4 zero = {0u, 0u, 0u, 0u};
    uint4 kc[R], vc[R];
    TDM_CUK_UNROLL
    for (int r = 0; r < R; r++) {
        int j = (r * NW + warp) * KPW + seg;
        kc[r] = vc[r] = zero;
        if (j < nk && !(store && p0 + j == kv_len - 1)) {
            int pos = p0 + j;
            size_t row =
                ((size_t)bt[pos / block_size] * n_kv_heads + kvh) * block_size + pos % block_size;
            kc[r] = ld16(k_cache + row * HD + c * VEC);
            vc[r] = ld16(v_cache + row * HD + c * VEC);
        }
    }

    for (int idx = threadIdx.x; idx < ng * HD; idx += blockDim.x)
        qs[idx / HD][idx % HD] = qrow[(size_t)h0 * HD + idx];
    int t = threadIdx.x;
    float kn1 = 0.0f, kn2 = 0.0f, vn = 0.0f; // the new token's k pair (t, t + HALF), v[t]
    if (inv_freq) {
        if (t < HALF)
            rope_cs((float)sq.start_pos, inv_freq[t], &rope_c[t], &rope_s[t]);
        if (store) {
            const float *kr = qrow + (size_t)(n_heads + kvh) * HD;
            if (t < HALF) {
                kn1 = kr[t];
                kn2 = kr[t + HALF];
            }
            if (t < HD)
                vn = kr[(size_t)n_kv_heads * HD + t];
        }
    }
    __syncthreads(); // qs and the cos/sin table
    if (inv_freq) {
        for (int idx = t; idx < ng * HALF; idx += blockDim.x) {
            int g = idx / HALF, i = idx % HALF;
            rope_apply(qs[g][i], qs[g][i + HALF], rope_c[i], rope_s[i], &qs[g][i],
                       &qs[g][i + HALF]);
        }
        if (store) {
            size_t dst = (((size_t)(slot / block_size) * n_kv_heads + kvh) * block_size +
                          slot % block_size) *
                         HD;
            if (t < HALF) {
                float k1, k2;
                rope_apply(kn1, kn2, rope_c[t], rope_s[t], &k1, &k2);
                kv_put(&k_store[dst + t], k1);
                kv_put(&k_store[dst + t + HALF], k2);
                kv_put(&kv_new[0][t], k1);
                kv_put(&kv_new[0][t + HALF], k2);
            }
            if (t < HD) {
                kv_put(&v_store[dst + t], vn);
                kv_put(&kv_new[1][t], vn);
            }
        }
        __syncthreads(); // the rotated queries and the stored row
        if (store) {
            TDM_CUK_UNROLL
            for (int r = 0; r < R; r++)
                if (p0 + (r * NW + warp) * KPW + seg == kv_len - 1) {
                    kc[r] = ld16(&kv_new[0][c * VEC]);
                    vc[r] = ld16(&kv_new[1][c * VEC]);
                }
        }
    }

    // The lane's chunk of every head's query.
    float qv[GMAX][VEC];
    TDM_CUK_UNROLL
    for (int g = 0; g < GMAX; g++) {
        TDM_CUK_UNROLL
        for (int e = 0; e < VEC; e++)
            qv[g][e] = g < ng ? qs[g][c * VEC + e] : 0.0f;
    }

    // Scores, then this warp's softmax over its rows: p holds exponentials.
    float p[R][GMAX];
    TDM_CUK_UNROLL
    for (int r = 0; r < R; r++) {
        float kf[VEC];
        kv_unpack(kc[r], kf, k_cache);
        bool valid = (r * NW + warp) * KPW + seg < nk;
        TDM_CUK_UNROLL
        for (int g = 0; g < GMAX; g++) {
            p[r][g] = -INFINITY;
            if (g >= ng)
                continue;
            float dot = 0.0f;
            TDM_CUK_UNROLL
            for (int e = 0; e < VEC; e++)
                dot += qv[g][e] * kf[e];
            TDM_CUK_UNROLL
            for (int o = LPK / 2; o > 0; o >>= 1)
                dot += __shfl_xor_sync(0xffffffffu, dot, o);
            if (valid)
                p[r][g] = dot * scale;
        }
    }
    float wmax[GMAX], wsum[GMAX];
    TDM_CUK_UNROLL
    for (int g = 0; g < GMAX; g++) {
        wmax[g] = -INFINITY;
        wsum[g] = 0.0f;
        if (g >= ng)
            continue;
        float mx = -INFINITY;
        TDM_CUK_UNROLL
        for (int r = 0; r < R; r++)
            mx = fmaxf(mx, p[r][g]);
        TDM_CUK_UNROLL
        for (int o = LPK; o < 32; o <<= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float sum = 0.0f;
        TDM_CUK_UNROLL
        for (int r = 0; r < R; r++) {
            float e = p[r][g] == -INFINITY ? 0.0f : expf(p[r][g] - mx);
            p[r][g] = e;
            sum += e;
        }
        TDM_CUK_UNROLL
        for (int o = LPK; o < 32; o <<= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
        wmax[g] = mx;
        wsum[g] = sum;
    }
    // P.V over the lane's rows, in the lane's chunk.
    float acc[GMAX][VEC];
    TDM_CUK_UNROLL
    for (int g = 0; g < GMAX; g++) {
        TDM_CUK_UNROLL
        for (int e = 0; e < VEC; e++)
            acc[g][e] = 0.0f;
    }
    TDM_CUK_UNROLL
    for (int r = 0; r < R; r++) {
        float vf[VEC];
        kv_unpack(vc[r], vf, v_cache);
        TDM_CUK_UNROLL
        for (int g = 0; g < GMAX; g++) {
            TDM_CUK_UNROLL
            for (int e = 0; e < VEC; e++)
                acc[g][e] += p[r][g] * vf[e];
        }
    }
    TDM_CUK_UNROLL
    for (int g = 0; g < GMAX; g++) {
        if (g >= ng)
            continue;
        TDM_CUK_UNROLL
        for (int e = 0; e < VEC; e++)
            po[warp][seg][g][c * VEC + e] = acc[g][e];
        if (lane == 0) {
            wm[warp][g] = wmax[g];
            wl[warp][g] = wsum[g];
        }
    }
    __syncthreads();

    // The warps merged in index order (a warp without keys of this split adds nothing).
    bool single = ns == 1;
    size_t unit0 = (size_t)blockIdx.x * n_heads + h0; // the unit's first row of part_*
    for (int idx = t; idx < ng * HD; idx += blockDim.x) {
        int g = idx / HD, d = idx % HD;
        float mx = -INFINITY;
        for (int w = 0; w < NW; w++)
            mx = fmaxf(mx, wm[w][g]);
        float o = 0.0f, l = 0.0f;
        for (int w = 0; w < NW; w++) {
            if (wm[w][g] == -INFINITY)
                continue;
            float f = expf(wm[w][g] - mx), a = 0.0f;
            for (int k = 0; k < KPW; k++)
                a += po[w][k][g][d];
            o += a * f;
            l += wl[w][g] * f;
        }
        if (single) {
            act_put(out, ((size_t)sq.row * n_heads + h0 + g) * HD + d, o / l, out_bf16);
        } else {
            size_t z = (unit0 + g) * max_splits + split;
            part_o[z * HD + d] = o;
            if (d == 0) {
                part_ml[z * 2] = mx;
                part_ml[z * 2 + 1] = l;
            }
        }
    }
    if (single)
        return;

    // Count this split done; the last block of the unit merges every split.
    __threadfence(); // this block's partials, before its count
    __syncthreads();
    if (t == 0)
        last_s = atomicAdd(&part_done[unit0], 1) == ns - 1;
    __syncthreads();
    if (!last_s)
        return;
    __threadfence(); // the other blocks' partials, after their counts
    if (t == 0)
        part_done[unit0] = 0;
    for (int idx = t; idx < ng * HD; idx += blockDim.x) {
        int g = idx / HD, d = idx % HD;
        size_t base = (unit0 + g) * max_splits;
        float mx = -INFINITY;
        for (int z = 0; z < ns; z++)
            mx = fmaxf(mx, __ldcg(&part_ml[(base + z) * 2]));
        float o = 0.0f, l = 0.0f;
        for (int z = 0; z < ns; z++) {
            float f = expf(__ldcg(&part_ml[(base + z) * 2]) - mx);
            l += __ldcg(&part_ml[(base + z) * 2 + 1]) * f;
            o += __ldcg(&part_o[(base + z) * HD + d]) * f;
        }
        act_put(out, ((size_t)sq.row * n_heads + h0 + g) * HD + d, o / l, out_bf16);
    }
}

// ---- prefill attention: one tile ---------------------------------------------------------
// What both prefill kernels know of their tile before any work: query rows
// i0 .. i0 + nq of sequence si for query head h (the grid's y), the KV head it
// reads, the positions its rows see and the sequence's block table.
struct prefill_tile {
    tdm_cuk_seq sq;    // the sequence
    int h, kvh;        // query head, and the KV head of its group
    int nq;            // real query rows: at most the tile's rows, fewer at the sequence's end
    int q_pos0;        // position of the tile's first query
    int kv_end;        // keys [0, kv_end) are visible to some row
    const int32_t *bt; // [bt_stride] the sequence's block table
};

// The tile of bq query rows starting at row i0 of sequence si, for head blockIdx.y.
__device__ __forceinline__ prefill_tile prefill_tile_of(const tdm_cuk_seq *seqs,
                                                        const int32_t *block_tables, int bt_stride,
                                                        int si, int i0, int bq, int n_heads,
                                                        int n_kv_heads)
{
    prefill_tile t;
    t.sq = seqs[si];
    t.h = blockIdx.y;
    t.kvh = t.h / (n_heads / n_kv_heads);
    t.nq = t.sq.n_tokens - i0 < bq ? t.sq.n_tokens - i0 : bq;
    t.q_pos0 = t.sq.start_pos + i0;
    t.kv_end = t.q_pos0 + t.nq;
    t.bt = block_tables + (size_t)si * bt_stride;
    return t;
}

// ---- prefill attention (FlashAttention-2 style) -------------------------------------------
// f32 KV, on CUDA cores: f32 KV is the precision mode, and tensor cores would
// round its K and V (and the query) to bf16.
// grid (n_tiles, n_heads), block 128. A tile is TDM_CUK_PREFILL_BQ query rows
// of one sequence for one head, run as sub-tiles of BQ rows; each walks the
// key positions 0..(its last query's position) in tiles of BK staged in
// shared memory, with an online softmax per query row (running max m, sum l,
// output accumulator O rescaled by e^(m_old - m_new)). Rows past the
// sequence's end and keys past a row's own position are masked.
// attn_prefill_f32_rows: query rows i0 .. i0 + TDM_CUK_PREFILL_F32_BQ of sequence si, one head.
template <class KV, int HD>
__device__ __forceinline__ void
attn_prefill_f32_rows(const float *q, int q_stride, const KV *k_cache, const KV *v_cache,
                      const tdm_cuk_seq *seqs, const int32_t *block_tables, int bt_stride, int si,
                      int i0, void *out, int out_bf16, int n_heads, int n_kv_heads, int block_size,
                      float scale)
{
    constexpr int BQ = TDM_CUK_PREFILL_F32_BQ, BK = TDM_CUK_PREFILL_BK;
    // Rows of q and k padded by one float: the score loop's threads read one
    // column of several rows at once, which would otherwise hit one bank.
    __shared__ float qs[BQ][HD + 1];
    __shared__ float ks[BK][HD + 1];
    __shared__ float vs[BK][HD];
    __shared__ float os[BQ][HD];
    __shared__ float sc[BQ][BK];
    __shared__ float m_s[BQ], l_s[BQ], corr_s[BQ];

    const prefill_tile tile =
        prefill_tile_of(seqs, block_tables, bt_stride, si, i0, BQ, n_heads, n_kv_heads);

    for (int idx = threadIdx.x; idx < BQ * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD;
        qs[r][d] = r < tile.nq
                       ? q[(size_t)(tile.sq.row + i0 + r) * q_stride + (size_t)tile.h * HD + d]
                       : 0.0f;
        os[r][d] = 0.0f;
    }
    if (threadIdx.x < BQ) {
        m_s[threadIdx.x] = -INFINITY;
        l_s[threadIdx.x] = 0.0f;
    }
    __syncthreads();

    for (int k0 = 0; k0 < tile.kv_end; k0 += BK) {
        int nk = tile.kv_end - k0 < BK ? tile.kv_end - k0 : BK;
        for (int idx = threadIdx.x; idx < BK * HD; idx += blockDim.x) {
            int j = idx / HD, d = idx % HD;
            float kv_k = 0.0f, kv_v = 0.0f;
            if (j < nk) {
                kv_k = kv_load(
                    &kv_row(k_cache, tile.bt, k0 + j, n_kv_heads, tile.kvh, block_size, HD)[d]);
                kv_v = kv_load(
                    &kv_row(v_cache, tile.bt, k0 + j, n_kv_heads, tile.kvh, block_size, HD)[d]);
            }
            ks[j][d] = kv_k;
            vs[j][d] = kv_v;
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < BQ * BK; idx += blockDim.x) {
            int r = idx / BK, j = idx % BK;
            float s = -INFINITY;
            if (r < tile.nq && j < nk && k0 + j <= tile.q_pos0 + r) {
                float dot = 0.0f;
                for (int d = 0; d < HD; d++)
                    dot += qs[r][d] * ks[j][d];
                s = dot * scale;
            }
            sc[r][j] = s;
        }
        __syncthreads();
        if (threadIdx.x < BQ) {
            int r = threadIdx.x;
            float mx = m_s[r];
            for (int j = 0; j < BK; j++)
                mx = fmaxf(mx, sc[r][j]);
            float corr = 1.0f, sum = 0.0f;
            if (mx == -INFINITY) { // nothing visible yet (a padding row)
                for (int j = 0; j < BK; j++)
                    sc[r][j] = 0.0f;
            } else {
                corr = m_s[r] == -INFINITY ? 0.0f : expf(m_s[r] - mx);
                for (int j = 0; j < BK; j++) {
                    float p = sc[r][j] == -INFINITY ? 0.0f : expf(sc[r][j] - mx);
                    sc[r][j] = p;
                    sum += p;
                }
            }
            l_s[r] = l_s[r] * corr + sum;
            m_s[r] = mx;
            corr_s[r] = corr;
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < BQ * HD; idx += blockDim.x) {
            int r = idx / HD, d = idx % HD;
            float a = os[r][d] * corr_s[r];
            for (int j = 0; j < nk; j++)
                a += sc[r][j] * vs[j][d];
            os[r][d] = a;
        }
        __syncthreads();
    }
    for (int idx = threadIdx.x; idx < tile.nq * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD;
        act_put(out, (size_t)(tile.sq.row + i0 + r) * n_heads * HD + (size_t)tile.h * HD + d,
                os[r][d] / l_s[r], out_bf16);
    }
}

template <class KV, int HD>
__global__ void __launch_bounds__(128)
    attn_prefill_kernel(const float *q, int q_stride, const KV *k_cache, const KV *v_cache,
                        const tdm_cuk_seq *seqs, const int32_t *block_tables, int bt_stride,
                        const int32_t *tiles, void *out, int out_bf16, int n_heads, int n_kv_heads,
                        int block_size, float scale)
{
    for (int sub = 0; sub < TDM_CUK_PREFILL_BQ; sub += TDM_CUK_PREFILL_F32_BQ) {
        if (tiles[2 * blockIdx.x + 1] + sub >= seqs[tiles[2 * blockIdx.x]].n_tokens)
            break;
        attn_prefill_f32_rows<KV, HD>(q, q_stride, k_cache, v_cache, seqs, block_tables, bt_stride,
                                      tiles[2 * blockIdx.x], tiles[2 * blockIdx.x + 1] + sub, out,
                                      out_bf16, n_heads, n_kv_heads, block_size, scale);
        __syncthreads(); // the next sub-tile reuses the shared arrays
    }
}

// ---- prefill attention on tensor cores (bf16 KV) -----------------------------------------
// grid (n_tiles, n_heads), block 128: warp w holds query rows 16 w .. 16 w + 15
// of the tile. The query is rounded to bf16 once, as mma A fragments in
// registers. Key tiles of BK positions start at multiples of BK from position 0
// and are staged in shared memory (K and V rows of bf16, as stored); per tile
// a warp computes S = Q K^T (mma, B fragments by ldmatrix of K rows), masks
// and scales it, updates each row's running max m (a max over the row's four
// lanes, exact), rescales its accumulator O and partial sums l by
// e^(m_old - m_new), rounds P = e^(S - m) to bf16 and adds P V (mma, B
// fragments by ldmatrix .trans of V rows). l sums the rounded P, the weights
// P V used. A row's output therefore depends on its own query and keys only:
// every mma element is one row's dot product, a tile of keys none of a row's
// sees leaves its m, l and O unchanged (corr = e^0 = 1, P = 0), so neither the
// other rows of its tile, nor the chunking of its prompt, nor the batch moves
// a bit. A row with no visible key yet (a padding row) keeps m = -inf,
// corr = 1 and P = 0: no NaN; it is never written.
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi)
{
    return (uint32_t)f32_to_bf16(lo) | (uint32_t)f32_to_bf16(hi) << 16;
}

__device__ __forceinline__ void st16(void *p, uint4 v)
{
#ifdef __CUDACC__
    *(uint4 *)p = v;
#else
    if ((uintptr_t)p % 16 != 0)
        ::tdm_emu::kernel_bug("16-byte store to an address not 16-byte aligned");
    memcpy(p, &v, sizeof v);
#endif
}

template <int HD>
__global__ void __launch_bounds__(128)
    attn_prefill_mma_kernel(const float *q, int q_stride, const uint16_t *k_cache,
                            const uint16_t *v_cache, const tdm_cuk_seq *seqs,
                            const int32_t *block_tables, int bt_stride, const int32_t *tiles,
                            void *out, int out_bf16, int n_heads, int n_kv_heads, int block_size,
                            float scale)
{
    constexpr int BQ = TDM_CUK_PREFILL_BQ, BK = TDM_CUK_PREFILL_MMA_BK;
    constexpr int KS = HD / 16; // k-steps of Q K^T
    constexpr int NT = BK / 8;  // 8-key column tiles of S
    constexpr int DT = HD / 8;  // 8-wide column tiles of O
    // Rows 16 bytes longer than HD: ldmatrix's 8 rows of one matrix then fall
    // on distinct banks; still 16-byte aligned.
    constexpr int LD = HD + 8;
    static_assert(BQ == 4 * 16 && HD % 16 == 0 && BK % 16 == 0, "tile shape");
    __shared__ __align__(16) uint16_t ks[BK * LD];
    __shared__ __align__(16) uint16_t vs[BK * LD];

    int si = tiles[2 * blockIdx.x], i0 = tiles[2 * blockIdx.x + 1];
    const prefill_tile tile =
        prefill_tile_of(seqs, block_tables, bt_stride, si, i0, BQ, n_heads, n_kv_heads);
    int warp = (int)threadIdx.x / 32, lane = (int)threadIdx.x % 32, g = lane / 4, t = lane % 4;
    int rw = warp * 16;               // the warp's first row in the tile
    int rr[2] = {rw + g, rw + g + 8}; // this lane's two rows (c0/c1 and c2/c3)
    bool idle = rw >= tile.nq;        // warp-uniform: no row of the warp is real
    int last_pos = tile.q_pos0 + (rw + 15 < tile.nq ? rw + 15 : tile.nq - 1); // the warp's last row

    uint32_t qa[KS][4];
    TDM_CUK_UNROLL
    for (int kk = 0; kk < KS; kk++) {
        TDM_CUK_UNROLL
        for (int f = 0; f < 4; f++) {
            int r = rr[f % 2], d = kk * 16 + 2 * t + (f / 2) * 8;
            const float *qr =
                q + (size_t)(tile.sq.row + i0 + r) * q_stride + (size_t)tile.h * HD + d;
            qa[kk][f] = r < tile.nq ? bf16x2(qr[0], qr[1]) : 0u;
        }
    }
    float o[DT][4];
    TDM_CUK_UNROLL
    for (int dt = 0; dt < DT; dt++)
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

    for (int k0 = 0; k0 < tile.kv_end; k0 += BK) {
        int nk = tile.kv_end - k0 < BK ? tile.kv_end - k0 : BK;
        __syncthreads(); // every warp is done with the previous tile
        for (int idx = (int)threadIdx.x; idx < BK * (HD / 8); idx += (int)blockDim.x) {
            int j = idx / (HD / 8), c = idx % (HD / 8);
            uint4 kc = make_uint4(0, 0, 0, 0), vc = make_uint4(0, 0, 0, 0);
            if (j < nk) {
                kc = ld16(kv_row(k_cache, tile.bt, k0 + j, n_kv_heads, tile.kvh, block_size, HD) +
                          c * 8);
                vc = ld16(kv_row(v_cache, tile.bt, k0 + j, n_kv_heads, tile.kvh, block_size, HD) +
                          c * 8);
            }
            st16(&ks[j * LD + c * 8], kc);
            st16(&vs[j * LD + c * 8], vc);
        }
        __syncthreads();
        if (idle || k0 > last_pos)
            continue; // no row of this warp sees a key of the tile: it would change nothing

        float sc[NT][4];
        TDM_CUK_UNROLL
        for (int nt = 0; nt < NT; nt++)
            sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
        TDM_CUK_UNROLL
        for (int kk = 0; kk < KS; kk++) {
            TDM_CUK_UNROLL
            for (int np = 0; np < NT / 2; np++) {
                // Matrices: keys np*16 + {0..7, 8..15} x dims kk*16 + {0..7, 8..15};
                // r[0], r[1] = B of key tile 2 np, r[2], r[3] = of 2 np + 1.
                uint32_t b[4];
                tdm_ldmatrix_x4(b, &ks[(np * 16 + (lane / 16) * 8 + lane % 8) * LD + kk * 16 +
                                       ((lane / 8) % 2) * 8]);
                tdm_mma_bf16_16816(sc[2 * np], qa[kk], &b[0], sc[2 * np]);
                tdm_mma_bf16_16816(sc[2 * np + 1], qa[kk], &b[2], sc[2 * np + 1]);
            }
        }

        float mx[2] = {m[0], m[1]};
        TDM_CUK_UNROLL
        for (int nt = 0; nt < NT; nt++) {
            TDM_CUK_UNROLL
            for (int e = 0; e < 4; e++) {
                int r = rr[e / 2], key = k0 + nt * 8 + 2 * t + e % 2;
                float v = r < tile.nq && key <= tile.q_pos0 + r ? sc[nt][e] * scale : -INFINITY;
                sc[nt][e] = v;
                mx[e / 2] = fmaxf(mx[e / 2], v);
            }
        }
        float corr[2];
        TDM_CUK_UNROLL
        for (int i = 0; i < 2; i++) {
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
            corr[i] = mx[i] == -INFINITY ? 1.0f : expf(m[i] - mx[i]);
            m[i] = mx[i];
        }
        // P as A fragments of P V: keys kb*16 + 2t (+8) are S's tiles 2 kb, 2 kb + 1.
        uint32_t pa[BK / 16][4];
        float ps[2] = {0.0f, 0.0f};
        TDM_CUK_UNROLL
        for (int nt = 0; nt < NT; nt++) {
            TDM_CUK_UNROLL
            for (int hf = 0; hf < 2; hf++) {
                float p2[2];
                TDM_CUK_UNROLL
                for (int e = 0; e < 2; e++) {
                    float v = sc[nt][hf * 2 + e];
                    p2[e] = v == -INFINITY ? 0.0f : bf16_to_f32(f32_to_bf16(expf(v - m[hf])));
                    ps[hf] += p2[e];
                }
                pa[nt / 2][hf + 2 * (nt % 2)] = bf16x2(p2[0], p2[1]);
            }
        }
        TDM_CUK_UNROLL
        for (int i = 0; i < 2; i++)
            l[i] = l[i] * corr[i] + ps[i];
        TDM_CUK_UNROLL
        for (int dt = 0; dt < DT; dt++) {
            o[dt][0] *= corr[0];
            o[dt][1] *= corr[0];
            o[dt][2] *= corr[1];
            o[dt][3] *= corr[1];
        }
        TDM_CUK_UNROLL
        for (int kb = 0; kb < BK / 16; kb++) {
            TDM_CUK_UNROLL
            for (int dp = 0; dp < DT / 2; dp++) {
                // Matrices: keys kb*16 + {0..7, 8..15} x dims dp*16 + {0..7, 8..15}
                // transposed; r[0], r[1] = B of dims tile 2 dp, r[2], r[3] = of 2 dp + 1.
                uint32_t b[4];
                tdm_ldmatrix_x4_trans(b, &vs[(kb * 16 + ((lane / 8) % 2) * 8 + lane % 8) * LD +
                                             dp * 16 + (lane / 16) * 8]);
                tdm_mma_bf16_16816(o[2 * dp], pa[kb], &b[0], o[2 * dp]);
                tdm_mma_bf16_16816(o[2 * dp + 1], pa[kb], &b[2], o[2 * dp + 1]);
            }
        }
    }
    if (idle)
        return;
    TDM_CUK_UNROLL
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    }
    TDM_CUK_UNROLL
    for (int dt = 0; dt < DT; dt++) {
        TDM_CUK_UNROLL
        for (int e = 0; e < 4; e++) {
            int r = rr[e / 2];
            if (r < tile.nq)
                act_put(out,
                        (size_t)(tile.sq.row + i0 + r) * n_heads * HD + (size_t)tile.h * HD +
                            dt * 8 + 2 * t + e % 2,
                        o[dt][e] / l[e / 2], out_bf16);
        }
    }
}
} // namespace tdm_cuk

#endif
