// SPDX-License-Identifier: Apache-2.0
// cuda_launch.cuh: the tdm_cuk_* entry points of cuda_kernels.h: argument
// checks, launch shapes and the dispatch on KV type and head_dim, plus the host
// planning of an attention call. Included once by cuda_kernels.cu (nvcc) and
// once by emu/cuda_kernels_emu.cpp (g++ + emulator), so both builds launch the
// same kernels with the same shapes. Include cuda_compat.h first.
#ifndef TDM_CUDA_LAUNCH_CUH
#define TDM_CUDA_LAUNCH_CUH

#include <stdarg.h>
#include <stdio.h>

#include "cuda_kernels.cuh"

namespace tdm_cuk
{
static thread_local char errbuf[256];

static int fail(int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(errbuf, sizeof errbuf, fmt, ap);
    va_end(ap);
    return code;
}

// After a launch: the launch's own error (bad configuration, no device).
static int launched(const char *what)
{
#ifdef __CUDACC__
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fail(TDM_CUK_ELAUNCH, "%s: %s", what, cudaGetErrorString(e));
#else
    (void)what;
#endif
    return TDM_CUK_OK;
}

static unsigned grid_for(size_t count, unsigned block)
{
    size_t g = (count + block - 1) / block;
    return g > 65535 ? 65535u : (unsigned)(g ? g : 1);
}

// Prefill: f32 KV on CUDA cores (the precision mode), bf16 KV on tensor cores.
template <int HD>
static void prefill_launch(void *stream, const tdm_cuk_attn_args *a, const float *)
{
    TDM_CUDA_LAUNCH((attn_prefill_kernel<float, HD>),
                    dim3((unsigned)a->n_tiles, (unsigned)a->n_heads), dim3(128), 0, stream, a->q,
                    a->q_stride, (const float *)a->k_cache, (const float *)a->v_cache, a->seqs,
                    a->block_tables, a->bt_stride, a->prefill_tiles, a->out, a->out_bf16,
                    a->n_heads, a->n_kv_heads, a->block_size, a->scale);
}

template <int HD>
static void prefill_launch(void *stream, const tdm_cuk_attn_args *a, const uint16_t *)
{
    TDM_CUDA_LAUNCH((attn_prefill_mma_kernel<HD>), dim3((unsigned)a->n_tiles, (unsigned)a->n_heads),
                    dim3(128), 0, stream, a->q, a->q_stride, (const uint16_t *)a->k_cache,
                    (const uint16_t *)a->v_cache, a->seqs, a->block_tables, a->bt_stride,
                    a->prefill_tiles, a->out, a->out_bf16, a->n_heads, a->n_kv_heads, a->block_size,
                    a->scale);
}

template <class KV, int HD> static int attention_typed(void *stream, const tdm_cuk_attn_args *a)
{
    if (a->n_tiles > 0) {
        prefill_launch<HD>(stream, a, (const KV *)nullptr);
        int rc = launched("attention prefill");
        if (rc != TDM_CUK_OK)
            return rc;
    }
    if (a->n_decode > 0) {
        int group = a->n_heads / a->n_kv_heads;
        int units = a->n_kv_heads * ((group + TDM_CUK_DECODE_GROUP - 1) / TDM_CUK_DECODE_GROUP);
        dim3 grid((unsigned)a->n_decode, (unsigned)units, (unsigned)a->max_splits);
        TDM_CUDA_LAUNCH((attn_decode_kernel<KV, HD>), grid, dim3(TDM_CUK_DECODE_THREADS), 0, stream,
                        a->q, a->q_stride, (const KV *)a->k_cache, (const KV *)a->v_cache, a->seqs,
                        a->block_tables, a->bt_stride, a->decode_seqs, a->max_splits, a->part_o,
                        a->part_ml, a->part_done, a->out, a->out_bf16, a->inv_freq, a->slots,
                        (KV *)a->k_cache, (KV *)a->v_cache, a->n_heads, a->n_kv_heads,
                        a->block_size, a->scale);
        return launched("attention decode");
    }
    return TDM_CUK_OK;
}

template <class KV> static int attention_kv(void *stream, const tdm_cuk_attn_args *a)
{
    switch (a->head_dim) {
    case 16: // the tiny test models
        return attention_typed<KV, 16>(stream, a);
    case 32:
        return attention_typed<KV, 32>(stream, a);
    case 64:
        return attention_typed<KV, 64>(stream, a);
    case 128:
        return attention_typed<KV, 128>(stream, a);
    default:
        return fail(TDM_CUK_EINVAL, "attention: head_dim %d (supported: 16, 32, 64, 128)",
                    a->head_dim);
    }
}
} // namespace tdm_cuk

extern "C" {

const char *tdm_cuk_errmsg(void)
{
    return tdm_cuk::errbuf;
}

int tdm_cuk_decode_splits(int kv_len)
{
    return kv_len <= 0 ? 0 : (kv_len + TDM_CUK_DECODE_PART - 1) / TDM_CUK_DECODE_PART;
}

int tdm_cuk_attn_plan(const int32_t *row, const int32_t *n_tokens, const int32_t *start_pos,
                      int n_seqs, int n_heads, int head_dim, struct tdm_cuk_seq *seqs,
                      int32_t *decode_seqs, int32_t *prefill_tiles, int tiles_cap,
                      struct tdm_cuk_plan *plan)
{
    plan->n_decode = plan->n_tiles = plan->max_splits = 0;
    plan->part_floats = plan->part_counts = 0;
    for (int s = 0; s < n_seqs; s++) {
        if (n_tokens[s] < 1 || start_pos[s] < 0 || row[s] < 0)
            return tdm_cuk::fail(TDM_CUK_EINVAL,
                                 "attention plan: sequence %d has n_tokens %d, "
                                 "start_pos %d, row %d",
                                 s, n_tokens[s], start_pos[s], row[s]);
        seqs[s].row = row[s];
        seqs[s].n_tokens = n_tokens[s];
        seqs[s].start_pos = start_pos[s];
        seqs[s].reserved = 0;
        if (n_tokens[s] == 1) {
            decode_seqs[plan->n_decode++] = s;
            int ns = tdm_cuk_decode_splits(start_pos[s] + 1);
            if (ns > plan->max_splits)
                plan->max_splits = ns;
            continue;
        }
        for (int i0 = 0; i0 < n_tokens[s]; i0 += TDM_CUK_PREFILL_BQ) {
            if (plan->n_tiles >= tiles_cap)
                return tdm_cuk::fail(TDM_CUK_EINVAL, "attention plan: more than %d tiles",
                                     tiles_cap);
            prefill_tiles[2 * plan->n_tiles] = s;
            prefill_tiles[2 * plan->n_tiles + 1] = i0;
            plan->n_tiles++;
        }
    }
    plan->part_counts = (size_t)plan->n_decode * (size_t)n_heads;
    plan->part_floats = plan->part_counts * (size_t)plan->max_splits * (size_t)head_dim;
    return TDM_CUK_OK;
}

int tdm_cuk_embed(void *stream, const uint16_t *table, int rows, int cols, const int32_t *ids,
                  int n, float *out)
{
    if (n <= 0 || rows <= 0 || cols <= 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "embed: n %d, table %dx%d", n, rows, cols);
    TDM_CUDA_LAUNCH(tdm_cuk::embed_kernel, dim3((unsigned)n), dim3(128), 0, stream, table, rows,
                    cols, ids, out);
    return tdm_cuk::launched("embed");
}

int tdm_cuk_add_rmsnorm(void *stream, float *x, const float *y, const float *weight, float eps,
                        void *out, int out_bf16, int n, int dim)
{
    if (n <= 0 || dim <= 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "rmsnorm: n %d, dim %d", n, dim);
    TDM_CUDA_LAUNCH(tdm_cuk::add_rmsnorm_kernel, dim3((unsigned)n), dim3(256), 0, stream, x, y,
                    weight, eps, out, out_bf16, dim);
    return tdm_cuk::launched(y ? "add_rmsnorm" : "rmsnorm");
}

int tdm_cuk_rope(void *stream, float *x, int n, int row_stride, int n_heads, int head_dim,
                 const int32_t *pos, const float *inv_freq)
{
    if (n <= 0 || n_heads <= 0 || head_dim < 2 || head_dim % 2 || row_stride < n_heads * head_dim)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "rope: n %d, %d heads of %d in rows of %d", n, n_heads,
                             head_dim, row_stride);
    TDM_CUDA_LAUNCH(tdm_cuk::rope_kernel, dim3((unsigned)n), dim3(128), 0, stream, x, row_stride,
                    n_heads, head_dim, pos, inv_freq);
    return tdm_cuk::launched("rope");
}

int tdm_cuk_silu_mul(void *stream, const float *gate_up, void *out, int out_bf16, int n, int inter)
{
    if (n <= 0 || inter <= 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "silu_mul: n %d, inter %d", n, inter);
    dim3 grid((unsigned)n, (unsigned)((inter + 255) / 256));
    TDM_CUDA_LAUNCH(tdm_cuk::silu_mul_kernel, grid, dim3(256), 0, stream, gate_up, out, out_bf16,
                    inter);
    return tdm_cuk::launched("silu_mul");
}

int tdm_cuk_add(void *stream, float *x, const float *y, size_t count)
{
    if (count == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::add_kernel, dim3(tdm_cuk::grid_for(count, 256)), dim3(256), 0, stream,
                    x, y, count);
    return tdm_cuk::launched("add");
}

int tdm_cuk_gather_ids(void *stream, int32_t *ids, const int32_t *src, const int32_t *pairs, int n)
{
    if (n < 0 || (n > 0 && (ids == NULL || src == NULL || pairs == NULL)))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "gather_ids: n %d", n);
    if (n == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::gather_ids_kernel, dim3(tdm_cuk::grid_for((size_t)n, 128)), dim3(128),
                    0, stream, ids, src, pairs, n);
    return tdm_cuk::launched("gather_ids");
}

int tdm_cuk_resolve_pending(void *stream, struct tdm_draw_params *params, struct tdm_draw_adj *adj,
                            const int32_t *src, int n)
{
    if (n < 0 || n > 65535 || (n > 0 && (params == NULL || adj == NULL || src == NULL)))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "resolve_pending: n %d", n);
    if (n == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::resolve_pending_kernel, dim3((unsigned)n),
                    dim3(TDM_CUK_RESOLVE_THREADS), 0, stream, params, adj, src);
    return tdm_cuk::launched("resolve_pending");
}

int tdm_cuk_list_bind(void *stream, struct tdm_draw_params *params, struct tdm_draw_adj *adj,
                      const int32_t *lists_at, int32_t *list_n, int n)
{
    if (n < 0 || n > 65535 ||
        (n > 0 && (params == NULL || adj == NULL || lists_at == NULL || list_n == NULL)))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "list_bind: n %d", n);
    if (n == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::list_bind_kernel, dim3((unsigned)n), dim3(TDM_CUK_RESOLVE_THREADS), 0,
                    stream, params, adj, lists_at, list_n);
    return tdm_cuk::launched("list_bind");
}

int tdm_cuk_list_record(void *stream, const struct tdm_draw_params *params,
                        struct tdm_draw_adj *adj, const int32_t *ids, int32_t *list_n, int n)
{
    if (n < 0 || n > 65535 ||
        (n > 0 && (params == NULL || adj == NULL || ids == NULL || list_n == NULL)))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "list_record: n %d", n);
    if (n == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::list_record_kernel, dim3((unsigned)n), dim3(TDM_CUK_RESOLVE_THREADS),
                    0, stream, params, adj, ids, list_n);
    return tdm_cuk::launched("list_record");
}

int tdm_cuk_rope_kv_store(void *stream, int type, float *qkv, int stride, int n_q, int n_kv,
                          int head_dim, const int32_t *pos, const float *inv_freq,
                          const int32_t *slots, int n, void *k_cache, void *v_cache, int block_size)
{
    if (n <= 0 || n_q <= 0 || n_kv <= 0 || head_dim < 2 || head_dim % 2 || block_size <= 0 ||
        stride < (n_q + 2 * n_kv) * head_dim)
        return tdm_cuk::fail(TDM_CUK_EINVAL,
                             "rope_kv_store: n %d, %d+%d heads of %d, block %d, stride %d", n, n_q,
                             n_kv, head_dim, block_size, stride);
    if (type == TDM_CUK_KV_F32)
        TDM_CUDA_LAUNCH(tdm_cuk::rope_kv_store_kernel<float>, dim3((unsigned)n), dim3(128), 0,
                        stream, qkv, stride, n_q, n_kv, head_dim, pos, inv_freq, slots,
                        (float *)k_cache, (float *)v_cache, block_size);
    else if (type == TDM_CUK_KV_BF16)
        TDM_CUDA_LAUNCH(tdm_cuk::rope_kv_store_kernel<uint16_t>, dim3((unsigned)n), dim3(128), 0,
                        stream, qkv, stride, n_q, n_kv, head_dim, pos, inv_freq, slots,
                        (uint16_t *)k_cache, (uint16_t *)v_cache, block_size);
    else
        return tdm_cuk::fail(TDM_CUK_EINVAL, "rope_kv_store: unknown KV type %d", type);
    return tdm_cuk::launched("rope_kv_store");
}

int tdm_cuk_kv_store(void *stream, int type, const float *k, const float *v, int stride,
                     const int32_t *slots, int n, void *k_cache, void *v_cache, int n_kv_heads,
                     int head_dim, int block_size)
{
    if (n <= 0 || n_kv_heads <= 0 || head_dim <= 0 || block_size <= 0 ||
        stride < n_kv_heads * head_dim)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_store: n %d, %d heads of %d, block %d, stride %d",
                             n, n_kv_heads, head_dim, block_size, stride);
    if (type == TDM_CUK_KV_F32) {
        TDM_CUDA_LAUNCH(tdm_cuk::kv_store_kernel<float>, dim3((unsigned)n), dim3(128), 0, stream, k,
                        v, stride, slots, (float *)k_cache, (float *)v_cache, n_kv_heads, head_dim,
                        block_size);
    } else if (type == TDM_CUK_KV_BF16) {
        TDM_CUDA_LAUNCH(tdm_cuk::kv_store_kernel<uint16_t>, dim3((unsigned)n), dim3(128), 0, stream,
                        k, v, stride, slots, (uint16_t *)k_cache, (uint16_t *)v_cache, n_kv_heads,
                        head_dim, block_size);
    } else {
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_store: unknown KV type %d", (int)type);
    }
    return tdm_cuk::launched("kv_store");
}

int tdm_cuk_kv_gather(void *stream, int type, const void *pool, const int32_t *blocks, int n,
                      size_t block_elems, float *out)
{
    if (n <= 0 || block_elems == 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_gather: %d blocks of %zu", n, block_elems);
    if (type == TDM_CUK_KV_F32)
        TDM_CUDA_LAUNCH(tdm_cuk::kv_gather_kernel<float>, dim3((unsigned)n), dim3(256), 0, stream,
                        (const float *)pool, blocks, block_elems, out);
    else if (type == TDM_CUK_KV_BF16)
        TDM_CUDA_LAUNCH(tdm_cuk::kv_gather_kernel<uint16_t>, dim3((unsigned)n), dim3(256), 0,
                        stream, (const uint16_t *)pool, blocks, block_elems, out);
    else
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_gather: unknown KV type %d", type);
    return tdm_cuk::launched("kv_gather");
}

size_t tdm_cuk_argmax_scratch(int n, int cols)
{
    int chunks = cols <= 0 ? 0 : (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
    if (n <= 0 || chunks <= 1)
        return 0;
    return (size_t)n * (size_t)chunks * (sizeof(float) + sizeof(int32_t));
}

int tdm_cuk_argmax_rows(void *stream, const float *x, int n, int cols, int32_t *ids, void *scratch)
{
    if (n <= 0 || cols <= 0 || n > 65535)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "argmax_rows: n %d, cols %d", n, cols);
    int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
    if (chunks > 1 && scratch == NULL)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "argmax_rows: %d chunks need scratch", chunks);
    float *pv = (float *)scratch;
    int32_t *pi = chunks > 1 ? (int32_t *)(pv + (size_t)n * chunks) : NULL;
    TDM_CUDA_LAUNCH(tdm_cuk::argmax_chunk_kernel, dim3((unsigned)n, (unsigned)chunks),
                    dim3(TDM_CUK_ARGMAX_THREADS), 0, stream, x, cols, pv, pi, ids);
    int rc = tdm_cuk::launched("argmax_rows");
    if (rc != TDM_CUK_OK || chunks == 1)
        return rc;
    TDM_CUDA_LAUNCH(tdm_cuk::argmax_merge_kernel, dim3((unsigned)n), dim3(TDM_CUK_ARGMAX_THREADS),
                    0, stream, pv, pi, chunks, ids);
    return tdm_cuk::launched("argmax_rows merge");
}

struct tdm_cuk_gemv_shape tdm_cuk_gemv_split(int rows, int cols)
{
    struct tdm_cuk_gemv_shape g = {0, 0, 0};
    if (rows <= 0 || cols <= 0)
        return g;
    int spans = (cols + TDM_CUK_GEMV_SPAN - 1) / TDM_CUK_GEMV_SPAN;
    g.tiles = (rows + TDM_CUK_GEMV_ROWS - 1) / TDM_CUK_GEMV_ROWS;
    // The fewest splits that reach TDM_CUK_GEMV_CTAS CTAs, at most one a span;
    // then as few as the spans per split need (no split left empty).
    int want = (TDM_CUK_GEMV_CTAS + g.tiles - 1) / g.tiles;
    int splits = want < spans ? want : spans;
    g.spans_per_split = (spans + splits - 1) / splits;
    g.splits = (spans + g.spans_per_split - 1) / g.spans_per_split;
    return g;
}

size_t tdm_cuk_gemv_part_bytes(int rows, int cols)
{
    struct tdm_cuk_gemv_shape g = tdm_cuk_gemv_split(rows, cols);
    if (g.splits <= 1)
        return 0;
    return (size_t)g.splits * TDM_CUK_GEMV_MAX_N * (size_t)rows * sizeof(float);
}

size_t tdm_cuk_gemv_count_bytes(int rows, int cols)
{
    struct tdm_cuk_gemv_shape g = tdm_cuk_gemv_split(rows, cols);
    return g.splits <= 1 ? 0 : (size_t)g.tiles * sizeof(int32_t);
}

int tdm_cuk_gemv(void *stream, const uint16_t *w, int rows, int cols, const uint16_t *x, int n,
                 const float *bias, float *y, float *part, int32_t *counts)
{
    if (n < 1 || n > TDM_CUK_GEMV_MAX_N || rows <= 0 || cols <= 0 || cols % 8 != 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL,
                             "gemv: n %d (1 to %d), %d x %d weight (columns a multiple of 8)", n,
                             TDM_CUK_GEMV_MAX_N, rows, cols);
    if (((uintptr_t)w | (uintptr_t)x) % 16 != 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "gemv: w %p and x %p must be 16-byte aligned",
                             (const void *)w, (const void *)x);
    struct tdm_cuk_gemv_shape g = tdm_cuk_gemv_split(rows, cols);
    if (g.splits > 65535)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "gemv: %d splits of %d columns", g.splits, cols);
    if (g.splits > 1 && (part == NULL || counts == NULL))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "gemv: %d x %d runs in %d splits: needs scratch", rows,
                             cols, g.splits);
    TDM_CUDA_LAUNCH(tdm_cuk::gemv_kernel, dim3((unsigned)g.tiles, (unsigned)g.splits),
                    dim3(TDM_CUK_GEMV_THREADS), 0, stream, w, rows, cols, g.spans_per_split, x, n,
                    bias, y, part, counts);
    return tdm_cuk::launched("gemv");
}

// Per row and chunk: the chunk's maximum (value, index), its candidate count,
// TDM_CUK_SAMPLE_CAP candidate slots (value, index), and the split path's
// total and kept weight; per row the split path's state and its walks'
// histograms (4 passes of 256 counts and 256 masses); per row asking
// logprobs, its masked copy and per chunk its maximum, sum of exponentials
// and TDM_DRAW_MAX_LOGPROBS top slots (value, index) with their count. Each
// array starts 16-byte aligned.
namespace tdm_cuk
{
struct sample_scratch {
    float *cand_v, *part_v, *raw, *lp_m, *lp_cv;
    int32_t *cand_i, *part_i, *cand_n, *lp_ci, *lp_cn;
    double *lp_s;
    sample_split_state *st;
    uint32_t *kh;
    unsigned long long *ph, *tot, *kept;
};

static size_t sample_layout(int n, int n_lp, int cols, char *base, sample_scratch *s)
{
    size_t chunks = (size_t)((cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK);
    size_t slots = (size_t)n * chunks, lp_slots = (size_t)n_lp * chunks, off = 0;
    size_t bins = (size_t)n * 4 * TDM_CUK_SAMPLE_BINS;
    auto take = [&](size_t bytes) {
        char *p = base ? base + off : nullptr;
        off += (bytes + 15) / 16 * 16;
        return (void *)p;
    };
    s->lp_s = (double *)take(lp_slots * sizeof(double));
    s->ph = (unsigned long long *)take(bins * sizeof(unsigned long long));
    s->tot = (unsigned long long *)take(slots * sizeof(unsigned long long));
    s->kept = (unsigned long long *)take(slots * sizeof(unsigned long long));
    s->st = (sample_split_state *)take((size_t)n * sizeof(sample_split_state));
    s->kh = (uint32_t *)take(bins * sizeof(uint32_t));
    s->cand_v = (float *)take(slots * TDM_CUK_SAMPLE_CAP * sizeof(float));
    s->cand_i = (int32_t *)take(slots * TDM_CUK_SAMPLE_CAP * sizeof(int32_t));
    s->part_v = (float *)take(slots * sizeof(float));
    s->part_i = (int32_t *)take(slots * sizeof(int32_t));
    s->cand_n = (int32_t *)take(slots * sizeof(int32_t));
    s->raw = (float *)take((size_t)n_lp * (size_t)cols * sizeof(float));
    s->lp_m = (float *)take(lp_slots * sizeof(float));
    s->lp_cv = (float *)take(lp_slots * TDM_DRAW_MAX_LOGPROBS * sizeof(float));
    s->lp_ci = (int32_t *)take(lp_slots * TDM_DRAW_MAX_LOGPROBS * sizeof(int32_t));
    s->lp_cn = (int32_t *)take(lp_slots * sizeof(int32_t));
    return off;
}
} // namespace tdm_cuk

size_t tdm_cuk_sample_scratch(int n, int n_lp, int cols)
{
    if (n <= 0 || cols <= 0 || n_lp < 0)
        return 0;
    tdm_cuk::sample_scratch s;
    return tdm_cuk::sample_layout(n, n_lp, cols, nullptr, &s);
}

int tdm_cuk_sample_rows(void *stream, float *x, int n, int cols,
                        const struct tdm_draw_params *params,
                        const struct tdm_draw_params *params_host, const struct tdm_draw_adj *adj,
                        const uint32_t *masks, int32_t *ids, const int32_t *lp_rows, int n_lp,
                        struct tdm_draw_logprobs *lp_out, void *scratch)
{
    if (n <= 0 || cols <= 0 || n > 65535 || scratch == NULL || n_lp < 0 || n_lp > n ||
        (n_lp > 0 && (lp_rows == NULL || lp_out == NULL)))
        return tdm_cuk::fail(TDM_CUK_EINVAL, "sample_rows: n %d, cols %d, %d asking logprobs%s", n,
                             cols, n_lp, scratch == NULL ? ", no scratch" : "");
    int chunks = (cols + TDM_CUK_ARGMAX_CHUNK - 1) / TDM_CUK_ARGMAX_CHUNK;
    tdm_cuk::sample_scratch s;
    tdm_cuk::sample_layout(n, n_lp, cols, (char *)scratch, &s);
    // The split path's launches that some row may need (all without the
    // host's copy of the params): a sampled row with top_k 0 or > KMAX takes
    // it, its top_k walk when top_k > 0, its top_p walk when top_p < 1.
    bool split = params_host == NULL, walk_k = split, walk_p = split;
    for (int i = 0; params_host != NULL && i < n; i++) {
        const struct tdm_draw_params *p = &params_host[i];
        if (p->inv_t == 0.0f || (p->top_k > 0 && p->top_k <= TDM_CUK_SAMPLE_KMAX))
            continue;
        split = true;
        walk_k = walk_k || p->top_k > 0;
        walk_p = walk_p || p->top_p < 1.0f;
    }
    dim3 grid((unsigned)n, (unsigned)chunks), block(TDM_CUK_ARGMAX_THREADS);
    int rc;
    if (n_lp > 0) {
        TDM_CUDA_LAUNCH(tdm_cuk::logprob_chunk_kernel, dim3((unsigned)n_lp, (unsigned)chunks),
                        block, 0, stream, (const float *)x, cols, params, masks, lp_rows, s.raw,
                        s.lp_m, s.lp_s, s.lp_cv, s.lp_ci, s.lp_cn);
        if ((rc = tdm_cuk::launched("sample_rows logprobs chunks")) != TDM_CUK_OK)
            return rc;
    }
    TDM_CUDA_LAUNCH(tdm_cuk::sample_chunk_kernel, grid, block, 0, stream, x, cols, params, adj,
                    masks, s.part_v, s.part_i, s.cand_v, s.cand_i, s.cand_n);
    if ((rc = tdm_cuk::launched("sample_rows chunks")) != TDM_CUK_OK)
        return rc;
    TDM_CUDA_LAUNCH(tdm_cuk::sample_rows_kernel, dim3((unsigned)n), block, 0, stream, x, cols,
                    params, (const float *)s.part_v, (const int32_t *)s.part_i, s.cand_v, s.cand_i,
                    (const int32_t *)s.cand_n, s.st, s.kh, s.ph, ids);
    if ((rc = tdm_cuk::launched("sample_rows")) != TDM_CUK_OK)
        return rc;
    for (int pass = 0; walk_k && pass < 4; pass++) {
        TDM_CUDA_LAUNCH(tdm_cuk::sample_top_k_kernel, grid, block, 0, stream, (const float *)x,
                        cols, params, s.st, s.kh, pass);
        if ((rc = tdm_cuk::launched("sample_rows top_k")) != TDM_CUK_OK)
            return rc;
    }
    if (split) {
        TDM_CUDA_LAUNCH(tdm_cuk::sample_weights_kernel, grid, block, 0, stream, x, cols, params,
                        s.st, (const uint32_t *)s.kh, s.ph, s.tot, ids);
        if ((rc = tdm_cuk::launched("sample_rows weights")) != TDM_CUK_OK)
            return rc;
    }
    for (int pass = 1; walk_p && pass <= 4; pass++) {
        TDM_CUDA_LAUNCH(tdm_cuk::sample_top_p_kernel, grid, block, 0, stream, (const float *)x,
                        cols, params, s.st, s.ph, (const unsigned long long *)s.tot, s.kept, ids,
                        pass);
        if ((rc = tdm_cuk::launched("sample_rows top_p")) != TDM_CUK_OK)
            return rc;
    }
    if (n_lp == 0)
        return TDM_CUK_OK;
    TDM_CUDA_LAUNCH(tdm_cuk::logprob_rows_kernel, dim3((unsigned)n_lp), block, 0, stream, cols,
                    params, lp_rows, (const float *)s.raw, (const float *)s.lp_m,
                    (const double *)s.lp_s, (const float *)s.lp_cv, s.lp_ci,
                    (const int32_t *)s.lp_cn, (const int32_t *)ids, lp_out);
    return tdm_cuk::launched("sample_rows logprobs");
}

int tdm_cuk_kv_scatter(void *stream, int type, void *pool, const int32_t *blocks, int n,
                       size_t block_elems, const float *in)
{
    if (n <= 0 || block_elems == 0)
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_scatter: %d blocks of %zu", n, block_elems);
    if (type == TDM_CUK_KV_F32)
        TDM_CUDA_LAUNCH(tdm_cuk::kv_scatter_kernel<float>, dim3((unsigned)n), dim3(256), 0, stream,
                        (float *)pool, blocks, block_elems, in);
    else if (type == TDM_CUK_KV_BF16)
        TDM_CUDA_LAUNCH(tdm_cuk::kv_scatter_kernel<uint16_t>, dim3((unsigned)n), dim3(256), 0,
                        stream, (uint16_t *)pool, blocks, block_elems, in);
    else
        return tdm_cuk::fail(TDM_CUK_EINVAL, "kv_scatter: unknown KV type %d", type);
    return tdm_cuk::launched("kv_scatter");
}

int tdm_cuk_attention(void *stream, const struct tdm_cuk_attn_args *a)
{
    if (a->n_kv_heads <= 0 || a->n_heads % a->n_kv_heads != 0 || a->block_size <= 0 ||
        a->n_decode < 0 || a->n_tiles < 0 ||
        (a->n_decode > 0 && (a->max_splits <= 0 || a->max_splits > 65535)))
        return tdm_cuk::fail(TDM_CUK_EINVAL,
                             "attention: heads %d/%d, block %d, %d decode, "
                             "%d splits, %d tiles",
                             a->n_heads, a->n_kv_heads, a->block_size, a->n_decode, a->max_splits,
                             a->n_tiles);
    if (a->n_decode > 0 && a->max_splits > 1 && (!a->part_o || !a->part_ml || !a->part_done))
        return tdm_cuk::fail(TDM_CUK_EINVAL,
                             "attention: %d decode splits need part_o, part_ml and part_done",
                             a->max_splits);
    if (a->inv_freq && (a->n_tiles > 0 || a->slots == NULL))
        return tdm_cuk::fail(TDM_CUK_EINVAL,
                             "attention: RoPE in attention serves decode-only "
                             "batches with slots (%d prefill tiles)",
                             a->n_tiles);
    if (a->kv_type == TDM_CUK_KV_F32)
        return tdm_cuk::attention_kv<float>(stream, a);
    if (a->kv_type == TDM_CUK_KV_BF16)
        return tdm_cuk::attention_kv<uint16_t>(stream, a);
    return tdm_cuk::fail(TDM_CUK_EINVAL, "attention: unknown KV type %d", (int)a->kv_type);
}

} // extern "C"

#endif
