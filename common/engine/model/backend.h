// SPDX-License-Identifier: Apache-2.0
// backend (internal to the model module): the compute operations a backend
// provides, as a table of function pointers. model.c expresses the transformer
// only through these; cpu/ implements them with threads and SIMD, cuda/ with
// CUDA kernels and cuBLASLt (a backend module loaded at run time). Activation buffers come from the
// backend's alloc (host memory for the CPU backend, device memory for CUDA).
//
// Activations are f32 except those that feed a matmul (its x: the outputs of
// rmsnorm, add_rmsnorm, silu_mul and attention), which are in the backend's
// matmul-input format: f32 on the CPU, bf16 (round to nearest even) on CUDA,
// where the op that produces them writes its GEMM's input type instead of a
// conversion pass. The model only passes them from op to op.
//
// Batch invariance contract: for every op, each output row depends only on the
// matching input rows and never on n (no split-K that depends on batch size, a
// fixed reduction order per output element); matmul too unless
// set_batch_invariant turned it off. A backend with matmul_runs keeps it per
// GEMM class: a row's numbers depend on the row and its class, never on n.
#ifndef TDM_BACKEND_H
#define TDM_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hf.h"
#include "kv_cache.h"

enum tdm_wtype {
    TDM_W_F32 = 0,   // float [rows][cols]
    TDM_W_BF16,      // uint16 [rows][cols] (possibly repacked: see the backend)
    TDM_W_Q8,        // int8 [rows][cols] + f32 scales[rows]
};

// A weight matrix in the backend's own memory and layout.
struct tdm_weight {
    enum tdm_wtype type;
    int rows;        // output features
    int cols;        // input features
    void *data;      // backend-owned
    float *scales;   // Q8 only: [rows]
    size_t nbytes;   // bytes a full read of this weight touches
    // data and scales point into memory the backend does not own (a mapped
    // packed-weight cache file, adopt_weight): release_weight frees nothing.
    bool borrowed;
};

// One source piece of a weight as stored in the checkpoint: `rows` rows of `cols`.
// prepare_weight stacks several pieces vertically (e.g. q, k, v into one qkv).
struct tdm_weight_src {
    const void *data;
    enum tdm_dtype dtype;
    int rows;
};

// A sequence's slice of the batch for attention and KV writes.
struct tdm_attn_seq {
    int row;              // first row of this sequence in the batch's activations
    int n_tokens;         // new tokens
    int start_pos;        // position of the first new token
    const int *block_table;
    bool pad; // a padding row of a graph bucket: no KV write, output unused
};

// Which of a weight's GEMM algorithms computes a row (matmul_runs). A prompt
// row is a token of its request's prompt; a decode row is any other
// (generated tokens, drafts being verified, generated tokens recomputed after
// a preemption). The class is what the row is, never how its step is made up
// (chunk sizes differ between a P/D prefill worker and a worker serving
// directly), so a row gets the same numbers in either.
enum tdm_gemm_class {
    TDM_GEMM_DECODE = 0, // the algorithm of decode batches (every row without matmul_runs)
    TDM_GEMM_PROMPT,     // the algorithm of long prompt chunks
};

// Rows [row, row + n) of a step's activations, all of one class.
struct tdm_row_run {
    int row;
    int n;
    enum tdm_gemm_class cls;
};

struct tdm_backend;
struct tdm_draw_params; // sample_draw.h (common/engine/sampling)
struct tdm_draw_adj;
struct tdm_draw_logprobs;

struct tdm_backend_ops {
    const char *name;
    // true: alloc returns host memory the model may read and write directly
    // (CPU); false: device memory, reached only through upload, download and
    // copy below (CUDA).
    bool host_memory;
    // device: which accelerator (cuda:N); ignored by the CPU backend.
    int (*create)(struct tdm_backend **out, int num_threads, int device, char *err, size_t errlen);
    void (*destroy)(struct tdm_backend *be);
    // Optional (NULL: every op is batch invariant at no cost, the CPU's case):
    // on (the default) keeps the contract below for matmul too; off lets
    // matmul take a faster path for small n whose rows depend on whether n is
    // small (CUDA: Tandem's GEMV for n <= 16, cuBLASLt above; rows are still
    // the same for every n within each range). Called once, right after
    // create, before any weight is prepared (model.h, enum
    // tdm_batch_invariance).
    void (*set_batch_invariant)(struct tdm_backend *be, bool on);
    // Optional: accelerators visible to this process (0 when none); NULL for
    // a backend that needs no device (CPU).
    int (*device_count)(void);

    // Builds w (rows = sum of parts' rows) in type `want` from checkpoint data.
    int (*prepare_weight)(struct tdm_backend *be, struct tdm_weight *w,
                          const struct tdm_weight_src *parts, int nparts, int cols,
                          enum tdm_wtype want, char *err, size_t errlen);
    void (*release_weight)(struct tdm_backend *be, struct tdm_weight *w);
    // Optional (0 / NULL: prepared weights are not cached): the packed-weight
    // cache (weight_cache.h) stores prepared weights as raw bytes and maps them
    // back on the next start. layout_version names the prepared layout: any
    // change to what prepare_weight writes must bump it (old files then miss).
    uint32_t layout_version;
    // The memory a prepared w consists of, in order (CPU: the packed data,
    // then the Q8 row scales): writes up to 2 spans, returns how many.
    int (*weight_spans)(const struct tdm_weight *w, const void *ptr[2], size_t bytes[2]);
    // Makes w a weight of (type, rows, cols) over spans laid out as
    // weight_spans gives them, without copying: the memory stays the
    // caller's and must outlive w (w->borrowed). TDM_EINVAL when the span
    // count or a size is not what (type, rows, cols) needs, or a span is not
    // 64-byte aligned.
    int (*adopt_weight)(struct tdm_backend *be, struct tdm_weight *w, enum tdm_wtype type,
                        int rows, int cols, const void *const ptr[2], const size_t bytes[2],
                        int nspans, char *err, size_t errlen);
    // Activation memory (aligned to 64 bytes); free with release.
    void *(*alloc)(struct tdm_backend *be, size_t bytes);
    void (*release)(struct tdm_backend *be, void *p);
    // Host -> backend memory (returns once src may be reused; a device backend
    // may still have the copy queued, in order with its ops), backend -> host
    // (returns once dst holds the data, after every op issued before it), and
    // inside backend memory (no overlap). TDM_OK, or the first error of any op
    // since the last download or sync (ops themselves return nothing; a
    // backend whose launches can fail keeps the first failure until then).
    int (*upload)(struct tdm_backend *be, void *dst, const void *src, size_t bytes);
    int (*download)(struct tdm_backend *be, void *dst, const void *src, size_t bytes);
    int (*copy)(struct tdm_backend *be, void *dst, const void *src, size_t bytes);
    // Waits for every op issued; returns the first error since the last sync or
    // download. NULL when ops are synchronous and cannot fail (CPU).
    int (*sync)(struct tdm_backend *be);

    // Optional (NULL: the pool is sized by the caller's host memory budget):
    // how many KV blocks of cfg's geometry fit in `utilization` (vLLM's
    // --gpu-memory-utilization: a fraction of the device's total memory) given
    // what the process already holds on the device (weights, activations).
    int (*kv_capacity)(struct tdm_backend *be, const struct tdm_kv_config *cfg, double utilization,
                       int *num_blocks, char *err, size_t errlen);
    // Optional (NULL: the default host f32 pool): a KV storage for cfg in this
    // backend's memory; the caller hands it to tdm_kv_new_with_storage.
    int (*kv_storage_new)(struct tdm_backend *be, const struct tdm_kv_config *cfg,
                          struct tdm_kv_storage **out, char *err, size_t errlen);
    // Optional: called once per forward, before the first layer, with the
    // batch's sequences (host block tables); the backend may stage in its own
    // memory what kv_store and attention need for every layer of this
    // forward, which then receive the same seqs.
    int (*begin_forward)(struct tdm_backend *be, struct tdm_kv_cache *kv,
                         const struct tdm_attn_seq *seqs, int n_seqs);
    // Optional (NULL: every step runs eagerly): CUDA graphs for decode steps.
    // The model calls graph_begin instead of begin_forward for a step whose
    // sequences all decode one token, padded to a bucket of n_seqs (1, 2, 4,
    // 8, ... rows, padding rows marked pad). *replay true: a graph of this
    // bucket is ready and the model skips its ops up to graph_end, which
    // launches it; false: the model issues its ops as usual (recorded into a
    // new graph, or run eagerly the first time a bucket is seen, which sizes
    // the buffers the graph will use), then graph_end.
    int (*graph_begin)(struct tdm_backend *be, struct tdm_kv_cache *kv,
                       const struct tdm_attn_seq *seqs, int n_seqs, bool *replay);
    int (*graph_end)(struct tdm_backend *be);

    // y[n][w->rows] = x[n][w->cols] . w^T (+ bias[w->rows] when bias != NULL);
    // x in the matmul-input format.
    void (*matmul)(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                   const void *x, float *y, int n);
    // Optional (NULL: one algorithm serves every row, the CPU's case): matmul
    // over the rows of runs[0 .. n_runs) (ascending, disjoint; rows outside
    // them are left alone), each run with its class's algorithm, which is the
    // same for every run of that class and weight whatever its row count or
    // offset. matmul is the decode class's. The model calls it for the layers'
    // GEMMs of steps that have prompt rows, and matmul otherwise.
    void (*matmul_runs)(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                        const void *x, float *y, const struct tdm_row_run *runs, int n_runs);
    // out[n][w->cols] = rows ids[i] of the embedding matrix w.
    void (*embed)(struct tdm_backend *be, const struct tdm_weight *w, const int32_t *ids, int n,
                  float *out);
    // out[n][dim] = x / rms(x) * weight, in the matmul-input format (out may
    // equal x when that is f32).
    void (*rmsnorm)(struct tdm_backend *be, const float *x, const float *weight, float eps,
                    void *out, int n, int dim);
    // Optional (NULL: add, then rmsnorm): x += y, then rmsnorm of x into out
    // (which overlaps neither), in one pass: a sublayer's residual add and the
    // next sublayer's norm.
    void (*add_rmsnorm)(struct tdm_backend *be, float *x, const float *y, const float *weight,
                        float eps, void *out, int n, int dim);
    // Rotate-half RoPE in place on x[n][row_stride], heads at x + h*head_dim for
    // h < n_heads; pos[n] positions; inv_freq[head_dim/2].
    void (*rope)(struct tdm_backend *be, float *x, int n, int row_stride, int n_heads,
                 int head_dim, const int32_t *pos, const float *inv_freq);
    // Writes k/v rows ([rows][kv_dim], row stride `stride` floats) of every
    // sequence's new tokens into their blocks of layer `layer`.
    void (*kv_store)(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                     const struct tdm_attn_seq *seqs, int n_seqs, const float *k, const float *v,
                     int stride);
    // Causal GQA attention over the paged cache (new tokens already stored):
    // out[row][n_heads*head_dim] (matmul-input format) from q[row][...] with
    // row stride q_stride.
    void (*attention)(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                      const struct tdm_attn_seq *seqs, int n_seqs, const float *q, int q_stride,
                      void *out, int n_heads, int n_kv_heads, int head_dim, float scale);
    // Optional (NULL: rope, kv_store, attention): the three for a batch's qkv
    // rows ([rows][qkv_stride]: n_heads query heads, n_kv_heads key heads, then
    // as many value heads; qkv may be rotated in place), with the same result;
    // a backend fuses what it can (CUDA: one launch for a decode-only batch).
    void (*rope_store_attention)(struct tdm_backend *be, struct tdm_kv_cache *kv, int layer,
                                 const struct tdm_attn_seq *seqs, int n_seqs, float *qkv,
                                 int qkv_stride, const int32_t *pos, const float *inv_freq,
                                 void *out, int n_heads, int n_kv_heads, int head_dim, float scale);
    // out[n][inter] = silu(gate_up[n][0:inter]) * gate_up[n][inter:2*inter]
    // (matmul-input format).
    void (*silu_mul)(struct tdm_backend *be, const float *gate_up, void *out, int n, int inter);
    // Optional (NULL, or false returned: matmul into a [n][w->rows] buffer,
    // then silu_mul): silu_mul of x . w^T (w: inter gate rows, then inter up
    // rows; inter = w->rows / 2) into out[n][inter] without writing the
    // product out, with the bits of the two ops. A backend returns false for
    // a shape or batch it does not fuse; it has then written nothing.
    bool (*matmul_silu_mul)(struct tdm_backend *be, const struct tdm_weight *w, const void *x,
                            void *out, int n);
    // x[i] += y[i] for i < count.
    void (*add)(struct tdm_backend *be, float *x, const float *y, size_t count);
    // Optional: runs fn(arg, tid, nthreads) once on each of the backend's host
    // compute threads (tid 0 is the caller) and returns when every one has;
    // only between forwards, from the thread that runs them. NULL: no host
    // threads (tdm_model_host_parallel then runs fn(arg, 0, 1)).
    void (*host_parallel)(struct tdm_backend *be, void (*fn)(void *arg, int tid, int nthreads),
                          void *arg);
    // Optional: ids[t] = the index of the first largest element of row t of
    // x[n][cols] . w^T (+ bias), by `>` (ties: the lowest index; NaN never
    // wins; 0 when nothing is above -inf), as matmul's output would give it,
    // without writing that output (the LM head of greedy rows). ids is host
    // memory. TDM_OK or TDM_ENOMEM.
    int (*matmul_argmax)(struct tdm_backend *be, const struct tdm_weight *w, const float *bias,
                         const float *x, int n, int32_t *ids);
    // Optional, for a backend whose memory is a device's: chosen ids[i] = the
    // index of the first largest of x[i][0..cols) (device rows, as matmul wrote
    // them), by the same rule, i < n: the greedy rows' logits stay on the
    // device and only their ids come back, through take_results. Ends the
    // forward without a wait; TDM_OK or the backend's error.
    int (*argmax_rows)(struct tdm_backend *be, const float *x, int n, int cols);
    // Optional, for a backend whose memory is a device's: chosen ids[i] = the
    // token sample_draw.h's draw takes from x[i][0..cols) (device rows, as
    // matmul wrote them; overwritten) after the adjustments adj[params[i].
    // adj_off ..][0..n_adj) (host, n_adj entries in all) and the mask
    // masks[params[i].mask_off ..][0..n_mask_words) (host, mask_words words in
    // all), with params[i] (host), i < n: the same token the CPU sampler draws
    // from the same row, masked alike (inv_t 0: argmax_rows'). A row whose
    // params ask logprobs also gets its logprobs: the CPU sampler's of the same
    // row (tdm_draw_logprobs). Both come through take_results. A row whose
    // params name a list (tdm_draw_params.list) takes its entries from the
    // backend's list (list_load: its own entries are loaded into it first;
    // else adj_off and n_adj are not read), and its drawn token is recorded
    // there (tdm_draw_record); a list read before its first load, or two rows
    // of one list in a call, are refused (TDM_EINVAL). Ends the forward
    // without a wait (the host arrays may be reused on return); TDM_OK or the
    // backend's error.
    int (*sample_rows)(struct tdm_backend *be, float *x, int n, int cols,
                       const struct tdm_draw_params *params, const struct tdm_draw_adj *adj,
                       int n_adj, const uint32_t *masks, size_t mask_words);
    // With argmax_rows and sample_rows: the oldest of their results not yet
    // taken (two forwards may be in flight; a third's are refused), once the
    // device has them: ids[n] (host) and, for each row i whose params asked,
    // lp[i] (host; other entries are not written). Waits for that forward
    // only, not for one issued after it. TDM_OK or the backend's error.
    int (*take_results)(struct tdm_backend *be, int32_t *ids, struct tdm_draw_logprobs *lp);
    // With argmax_rows: ids[pairs[2i]] (device, a forward's token ids) = the
    // chosen id pairs[2i + 1] of the last argmax_rows or sample_rows issued,
    // i < n (pairs: host), read on the device in stream order: the token a
    // step feeds back need not have reached the host. TDM_OK or the backend's
    // error.
    int (*gather_ids)(struct tdm_backend *be, int32_t *ids, const int32_t *pairs, int n);
};

// The backend called `name`: "cpu" (built in), one a test registered, else
// the device module libtandem-NAME.so (backend_module.h), loaded on first
// use. TDM_OK, or the module loader's code with err saying what is missing.
int tdm_backend_lookup(const char *name, const struct tdm_backend_ops **out, char *err,
                       size_t errlen);
// tdm_backend_lookup without the reason: NULL when there is no such backend.
const struct tdm_backend_ops *tdm_backend_find(const char *name);
// Adds a backend under ops->name for this process (tests: the CUDA backend on
// the execution-model emulator). TDM_ECAPACITY when the table is full.
int tdm_backend_register(const struct tdm_backend_ops *ops);
extern const struct tdm_backend_ops tdm_cpu_backend_ops;

#endif
