// SPDX-License-Identifier: Apache-2.0
// cuda_kernels.cuh: the CUDA backend's own kernels, written once and compiled
// both by nvcc (cuda_kernels.cu) and, against the execution-model emulator, by
// g++ (emu/cuda_kernels_emu.cpp). Include cuda_compat.h first.
//
// Only the CUDA subset the emulator models is used: threadIdx/blockIdx/
// blockDim/gridDim, static __shared__ arrays, __syncthreads, full-warp
// __shfl_xor_sync, atomicAdd, __threadfence, __ldcg and aligned 16-byte
// loads (ld16). Blocks are one-dimensional and a multiple of 32 threads.
//
// Reductions run in a fixed order set by the block shape (never by the batch):
// a strided per-thread partial, a butterfly inside each warp, then warps in
// index order. The CPU backend sums in another fixed order, so the two agree
// within rounding (cuda_ops_test states the tolerances), not bitwise.
#ifndef TDM_CUDA_KERNELS_CUH
#define TDM_CUDA_KERNELS_CUH

#include "cuda_kernels.h"

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

// grid (n, chunks), block 256: chunk blockIdx.y of row blockIdx.x. One chunk:
// ids[row]; else the chunk's winner to part_v/part_i[row][chunk].
__global__ void argmax_chunk_kernel(const float *x, int cols, float *part_v, int32_t *part_i,
                                    int32_t *ids)
{
    const float *r = x + (size_t)blockIdx.x * cols;
    int c0 = blockIdx.y * TDM_CUK_ARGMAX_CHUNK;
    int c1 = c0 + TDM_CUK_ARGMAX_CHUNK < cols ? c0 + TDM_CUK_ARGMAX_CHUNK : cols;
    float bv = -INFINITY;
    int bi = -1;
    for (int c = c0 + threadIdx.x; c < c1; c += blockDim.x) {
        float v = r[c];
        if (v > bv) {
            bv = v;
            bi = c;
        }
    }
    float wv;
    int wi;
    argmax_tree(bv, bi, &wv, &wi);
    if (threadIdx.x != 0)
        return;
    if (gridDim.y == 1) {
        ids[blockIdx.x] = wi < 0 ? 0 : wi;
    } else {
        part_v[(size_t)blockIdx.x * gridDim.y + blockIdx.y] = wv;
        part_i[(size_t)blockIdx.x * gridDim.y + blockIdx.y] = wi;
    }
}

// grid (n), block 256: the winner of a row's chunks (ascending chunks hold
// ascending indices, so `>` keeps the first on a tie).
__global__ void argmax_merge_kernel(const float *part_v, const int32_t *part_i, int chunks,
                                    int32_t *ids)
{
    const float *pv = part_v + (size_t)blockIdx.x * chunks;
    const int32_t *pi = part_i + (size_t)blockIdx.x * chunks;
    float bv = -INFINITY;
    int bi = -1;
    for (int z = threadIdx.x; z < chunks; z += blockDim.x)
        if (pi[z] >= 0 && (bi < 0 || pv[z] > bv)) {
            bv = pv[z];
            bi = pi[z];
        }
    float wv;
    int wi;
    argmax_tree(bv, bi, &wv, &wi);
    if (threadIdx.x == 0)
        ids[blockIdx.x] = wi < 0 ? 0 : wi;
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

// ---- prefill attention (FlashAttention-2 style) -------------------------------------------
// grid (n_tiles, n_heads), block 128. A tile is BQ query rows of one sequence
// for one head; it walks the key positions 0..(its last query's position) in
// tiles of BK staged in shared memory, with an online softmax per query row
// (running max m, sum l, output accumulator O rescaled by e^(m_old - m_new)).
// Rows past the sequence's end and keys past a row's own position are masked.
template <class KV, int HD>
__global__ void __launch_bounds__(128)
    attn_prefill_kernel(const float *q, int q_stride, const KV *k_cache, const KV *v_cache,
                        const tdm_cuk_seq *seqs, const int32_t *block_tables, int bt_stride,
                        const int32_t *tiles, void *out, int out_bf16, int n_heads, int n_kv_heads,
                        int block_size, float scale)
{
    constexpr int BQ = TDM_CUK_PREFILL_BQ, BK = TDM_CUK_PREFILL_BK;
    // Rows of q and k padded by one float: the score loop's threads read one
    // column of several rows at once, which would otherwise hit one bank.
    __shared__ float qs[BQ][HD + 1];
    __shared__ float ks[BK][HD + 1];
    __shared__ float vs[BK][HD];
    __shared__ float os[BQ][HD];
    __shared__ float sc[BQ][BK];
    __shared__ float m_s[BQ], l_s[BQ], corr_s[BQ];

    int si = tiles[2 * blockIdx.x], i0 = tiles[2 * blockIdx.x + 1];
    tdm_cuk_seq sq = seqs[si];
    int h = blockIdx.y;
    int kvh = h / (n_heads / n_kv_heads);
    int nq = sq.n_tokens - i0 < BQ ? sq.n_tokens - i0 : BQ;
    int q_pos0 = sq.start_pos + i0; // position of the tile's first query
    int kv_end = q_pos0 + nq;       // keys [0, kv_end) are visible to some row
    const int32_t *bt = block_tables + (size_t)si * bt_stride;

    for (int idx = threadIdx.x; idx < BQ * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD;
        qs[r][d] = r < nq ? q[(size_t)(sq.row + i0 + r) * q_stride + (size_t)h * HD + d] : 0.0f;
        os[r][d] = 0.0f;
    }
    if (threadIdx.x < BQ) {
        m_s[threadIdx.x] = -INFINITY;
        l_s[threadIdx.x] = 0.0f;
    }
    __syncthreads();

    for (int k0 = 0; k0 < kv_end; k0 += BK) {
        int nk = kv_end - k0 < BK ? kv_end - k0 : BK;
        for (int idx = threadIdx.x; idx < BK * HD; idx += blockDim.x) {
            int j = idx / HD, d = idx % HD;
            float kv_k = 0.0f, kv_v = 0.0f;
            if (j < nk) {
                kv_k = kv_load(&kv_row(k_cache, bt, k0 + j, n_kv_heads, kvh, block_size, HD)[d]);
                kv_v = kv_load(&kv_row(v_cache, bt, k0 + j, n_kv_heads, kvh, block_size, HD)[d]);
            }
            ks[j][d] = kv_k;
            vs[j][d] = kv_v;
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < BQ * BK; idx += blockDim.x) {
            int r = idx / BK, j = idx % BK;
            float s = -INFINITY;
            if (r < nq && j < nk && k0 + j <= q_pos0 + r) {
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
    for (int idx = threadIdx.x; idx < nq * HD; idx += blockDim.x) {
        int r = idx / HD, d = idx % HD;
        act_put(out, (size_t)(sq.row + i0 + r) * n_heads * HD + (size_t)h * HD + d,
                os[r][d] / l_s[r], out_bf16);
    }
}

} // namespace tdm_cuk

#endif
