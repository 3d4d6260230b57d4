// SPDX-License-Identifier: Apache-2.0
// model: loads a Qwen2/Llama model folder onto a compute backend and runs one
// batched forward step over the paged KV cache. One step may mix sequences in
// prefill (many new tokens, a chunk of the prompt) and in decode (one new
// token); each brings its own positions and block table. A sequence's results
// never depend on which other sequences share the step (fixed reduction order
// per output element). All activation memory is allocated at load for
// max_batch_tokens tokens: the forward allocates nothing.
#ifndef TDM_MODEL_H
#define TDM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hf.h"
#include "kv_cache.h"

enum tdm_weight_mode {
    TDM_WEIGHTS_BF16 = 0,  // as stored (f32/f16 checkpoints are rounded to bf16)
    TDM_WEIGHTS_INT8,      // int8 with one f32 scale per output row, quantized at load
};

// Whether a row's numbers may depend on the batch it is computed in (vLLM's
// VLLM_BATCH_INVARIANT; --batch-invariant / --no-batch-invariant). Only the
// CUDA backend has a choice: its GEMMs go to cuBLASLt with one algorithm per
// weight shape whatever the batch (ON), or, for steps of up to 16 rows (decode
// batches), to Tandem's split-K GEMV, which reads the weights at the
// bandwidth, and to cuBLASLt above (OFF: a row's logits are the same in every
// step of up to 16 rows and in every step of more, but the two differ). The
// CPU backend is batch invariant either way. DEFAULT is ON until a GPU run
// measures the cost (docs/gpu.md: invariance stays the default only if it
// costs at most 10 % at batch 1 and 64).
enum tdm_batch_invariance {
    TDM_BATCH_INVARIANT_DEFAULT = 0, // tdm_model_load resolves it (today: ON)
    TDM_BATCH_INVARIANT_ON,
    TDM_BATCH_INVARIANT_OFF,
};

struct tdm_model_opts {
    enum tdm_weight_mode weights;
    int num_threads;       // compute threads; 0 = one per online core
    int max_batch_tokens;  // tokens per forward step (activation workspace); default 512
    int max_batch_seqs;    // sequences per forward step; default 64
    const char *backend;   // "cpu" (default) or "cuda" when built with TANDEM_CUDA
    int device;            // accelerator ordinal for "cuda" (--device cuda:N); default 0
    bool enforce_eager;    // --enforce-eager: no CUDA graphs (vLLM's flag); default false
    // --[no-]batch-invariant; DEFAULT until tdm_model_load resolves it (then
    // ON or OFF in tdm_model_opts of the model).
    enum tdm_batch_invariance batch_invariant;
    // Packed-weight cache (docs/cpu-backend.md "Cold start"): NULL = none (the
    // default), "auto" = $TANDEM_CACHE/packed, else $XDG_CACHE_HOME/tandem/packed,
    // else ~/.cache/tandem/packed ($TANDEM_CACHE=off: none), else the folder.
    // Used only by a backend with a cacheable layout (the CPU) and for
    // checkpoints of at least weight_cache_min_bytes (default 64 MiB).
    const char *weight_cache_dir;
    size_t weight_cache_min_bytes;
    // On a miss, write the entry on a background thread (at nice 10) after
    // tdm_model_load returns, so the first start is not delayed by it; the
    // model can serve meanwhile and tdm_model_free waits for it. Default
    // false: written before tdm_model_load returns.
    bool weight_cache_background;
};
void tdm_model_opts_default(struct tdm_model_opts *o);
// Sets o->backend and o->device from a --device value (vLLM's flag): "cpu",
// "cuda", "cuda:N" (the CUDA backend module, libtandem-cuda.so), "cuda-emu",
// "cuda-emu:N" (the same backend on the CUDA emulator: checks without a GPU),
// or NULL / "" / "auto" for the default: "cuda" when its module loads and a
// GPU is visible, else "cpu" (one INFO line per process says why). TDM_EINVAL
// with err saying why for anything else, for cuda when its module cannot load
// (the missing file or library named), and for cuda when no GPU (or not GPU
// N) is visible: asking for a GPU that is not there is a startup error, never
// a silent fallback to the CPU.
int tdm_model_opts_set_device(struct tdm_model_opts *o, const char *spec, char *err, size_t errlen);

// The value of --batch-invariant[=BOOL] (negate false) or
// --no-batch-invariant[=BOOL] (negate true), the flags of the workers,
// tandem-bench-engine and tandem-generate (vLLM's VLLM_BATCH_INVARIANT as a
// flag): v NULL is true. TDM_EINVAL with "--FLAG: expected true or false"
// for anything but a boolean.
int tdm_batch_invariance_parse(const char *flag, bool negate, const char *v,
                               enum tdm_batch_invariance *out, char *err, size_t errlen);
// Why the last "--device auto" chose the CPU ("no CUDA GPU visible", "no
// CUDA backend: ..."); "" when it chose a GPU or auto was never asked.
const char *tdm_model_device_auto_note(void);

struct tdm_model;

int tdm_model_load(struct tdm_model **out, const char *dir, const struct tdm_model_opts *opts,
                   char *err, size_t errlen);
void tdm_model_free(struct tdm_model *m);

// How a load went (the packed-weight cache, tandem-bench-engine's ratio).
enum tdm_weight_cache_use {
    TDM_WCACHE_OFF = 0, // not asked for, not supported by the backend, or too small
    TDM_WCACHE_HIT,     // weights mapped from a verified entry
    TDM_WCACHE_MISS,    // no entry: weights prepared and an entry written
    TDM_WCACHE_REBUILT, // an entry was stale, truncated or corrupt: ignored and rewritten
    TDM_WCACHE_FAILED,  // weights prepared; writing the entry failed (logged)
};
struct tdm_model_load_info {
    double seconds;            // tdm_model_load's wall time
    size_t checkpoint_bytes;   // tensor bytes of the checkpoint
    enum tdm_weight_cache_use weight_cache;
    double cache_write_seconds; // part of seconds spent writing the entry (MISS, REBUILT;
                                // 0 when written in the background: its result is logged)
};
const struct tdm_model_load_info *tdm_model_load_info(const struct tdm_model *m);
// "off", "hit", "miss", "rebuilt", "failed".
const char *tdm_weight_cache_use_name(enum tdm_weight_cache_use u);
const struct tdm_model_config *tdm_model_config(const struct tdm_model *m);
const struct tdm_model_opts *tdm_model_opts(const struct tdm_model *m);
// Bytes of weights one decode step reads (all matrices + the lm_head once).
size_t tdm_model_weight_bytes(const struct tdm_model *m);
// The KV geometry this model needs (num_layers, num_kv_heads, head_dim); the
// caller fills block_size, num_blocks and enable_prefix_caching.
void tdm_model_kv_config(const struct tdm_model *m, struct tdm_kv_config *cfg);
// KV blocks of cfg's geometry (block_size set) that fit in `utilization` of
// the device's memory after what the model already holds there (vLLM's
// --gpu-memory-utilization). TDM_ENOTFOUND on a backend without device memory
// (the CPU: size the pool from a byte budget instead); TDM_ECAPACITY with err
// saying how much is missing when not even one block fits; TDM_EINVAL for a
// utilization outside (0, 1].
int tdm_model_kv_capacity(struct tdm_model *m, const struct tdm_kv_config *cfg, double utilization,
                          int *num_blocks, char *err, size_t errlen);
// A KV cache for cfg whose pool lives where this model's backend computes
// (host f32 for the CPU backend, device memory for CUDA): what tdm_kv_new is
// for a host pool. Same errors as tdm_kv_new, plus the backend's (TDM_ENOMEM
// when device memory cannot hold the pool, TDM_EBACKEND).
int tdm_model_kv_new(struct tdm_model *m, const struct tdm_kv_config *cfg,
                     struct tdm_kv_cache **out, char *err, size_t errlen);

// LAST: the last token's logits row; ALL: every new token's row; ARGMAX: no
// row, but the index of the last token's largest logit (the first largest by
// `>`: what greedy sampling picks) in *token_out, computed without writing the
// logits (the backend's fused LM head; only where tdm_model_fused_argmax);
// SAMPLE: no row, but the token sample_draw.h's draw takes from the last
// token's logits with *draw, in *token_out, drawn where the logits are (only
// where tdm_model_device_sampling): the token the CPU sampler would draw from
// that row.
enum tdm_logits_mode {
    TDM_LOGITS_NONE = 0,
    TDM_LOGITS_LAST,
    TDM_LOGITS_ALL,
    TDM_LOGITS_ARGMAX,
    TDM_LOGITS_SAMPLE,
    // SAMPLE on every row (a speculative step's verification rows, drafts
    // ahead: tdm_sampler_draw_prepare_ahead): row i drawn with draw[i] and
    // adj[draw[i].adj_off ..][0 .. draw[i].n_adj), its token to token_out[i]
    // and, when draw[i].logprobs, its logprobs to logprobs_out[i]; no
    // structured-output mask (allow NULL). A device backend only.
    TDM_LOGITS_DRAW_ALL
};

// Called inside tdm_model_forward, on the calling thread, right after layer
// `layer` of this sequence's new tokens was written into the KV cache (layers
// 0 .. num_layers-1 in order, once each per forward). From then on that layer's
// KV of positions [0, start_pos + n_tokens) is final for this step: another
// thread may copy it out while the forward computes later layers (the forward
// writes only later layers of the cache). Must be cheap and must not block.
typedef void (*tdm_layer_done_fn)(void *arg, int layer);

struct tdm_draw_params; // sample_draw.h (common/engine/sampling)
struct tdm_draw_adj;
struct tdm_draw_logprobs;

struct tdm_batch_seq {
    const int32_t *tokens;     // [n_tokens] the new tokens this step
    int n_tokens;
    int start_pos;             // position of tokens[0] = tokens already in the KV cache
    const int *block_table;    // covers positions [0, start_pos + n_tokens)
    // The request's prompt length: rows at positions below it are prompt rows,
    // the rest decode rows (backend.h, enum tdm_gemm_class), whatever the
    // chunk. 0 (a caller that does not say): every row is a decode row.
    int prompt_len;
    enum tdm_logits_mode logits;
    tdm_layer_done_fn on_layer; // optional per-layer hook (NULL: none, no cost)
    void *layer_arg;            // for on_layer
    int32_t *token_out;         // ARGMAX, SAMPLE: where the token goes (host)
    const struct tdm_draw_params *draw; // SAMPLE: the draw's parameters (sample_draw.h)
    // SAMPLE: its draw->n_adj logit adjustments; on a from_prev row of a
    // device backend the last may be TDM_DRAW_ADJ_PENDING (sample_draw.h),
    // naming a chosen row of the forward before: its token merged in on the
    // device before the draw (tdm_sampler_draw_prepare_pending). With
    // draw->list (device sampling only; sample_draw.h) the entries are kept
    // on the device in that list between steps: loaded from these
    // (list_load), or, without entries here (n_adj 0), as the list's last
    // draw left them, each draw's token recorded into it (rec_flags,
    // rec_count); not on DRAW_ALL rows.
    const struct tdm_draw_adj *adj;
    // SAMPLE, structured output: NULL, or the tokens allowed, a bit each
    // (ceil(vocab_size / 32) words; token t: bit t % 32 of word t / 32), read
    // when the step's tokens are chosen: after the choose hook
    // (tdm_model_set_choose_hook), which may fill it while the layers run.
    const uint32_t *allow;
    // SAMPLE with draw->logprobs: where the row's logprobs go (host), the CPU
    // sampler's for the same row (tdm_sampler_draw_logprobs makes its result).
    struct tdm_draw_logprobs *logprobs_out;
    // from_prev: tokens[0] is not read; the row's token is the one chosen for
    // chosen row prev_row (batch order of the ARGMAX, SAMPLE and DRAW_ALL
    // rows, as their token_out are written) of the forward issued last before
    // this one, which had it (TDM_EINVAL otherwise). On a device it is taken
    // where that forward left it, so it need not have reached the host yet:
    // step N + 1 issued before step N's tokens are known (vLLM's async
    // scheduling, SGLang's overlap scheduler).
    bool from_prev;
    int prev_row;
};

// fn(arg) runs in every tdm_model_forward that chooses tokens on the device
// (TDM_LOGITS_SAMPLE rows), on the calling thread, after the forward's work
// was issued and before the tokens are chosen: the engine waits there for the
// structured-output masks its mask threads compute meanwhile and fills the
// rows' allow bitmaps. It may take the forward in flight before this one
// (tdm_model_forward_wait: its tokens, which a mask may follow); this
// forward's chosen rows are issued after it returns. NULL: none.
void tdm_model_set_choose_hook(struct tdm_model *m, void (*fn)(void *arg), void *arg);

// Whether m's backend has the fused argmax LM head (TDM_LOGITS_ARGMAX).
bool tdm_model_fused_argmax(const struct tdm_model *m);
// Whether m's backend draws sampled tokens where the logits are
// (TDM_LOGITS_SAMPLE): a device backend with sample_rows; the CPU samples on
// the host, where its logits are anyway.
bool tdm_model_device_sampling(const struct tdm_model *m);

// Runs one step: writes the new tokens' K/V into the cache and, per sequence,
// logits rows into logits in batch order (n_tokens rows for ALL, 1 for LAST, 0
// for NONE and ARGMAX), each vocab_size floats; ARGMAX sequences get their
// token in *token_out (TDM_EINVAL where the backend has no fused argmax). TDM_EINVAL when the
// batch exceeds max_batch_tokens/max_batch_seqs or a position exceeds the context. Runs fn(arg,
// tid, nthreads) once on each host compute thread of m's backend (tid 0 on the caller) and returns
// when all have: the CPU backend's compute threads, idle between forwards; a backend without host
// threads runs fn(arg, 0, 1). Only from the thread that runs m's forwards, between them.
void tdm_model_host_parallel(struct tdm_model *m, void (*fn)(void *arg, int tid, int nthreads),
                             void *arg);

int tdm_model_forward(struct tdm_model *m, struct tdm_kv_cache *kv,
                      const struct tdm_batch_seq *seqs, int n_seqs, float *logits);

// A forward in two halves (issue 26 item 1: the host's work for step N + 1
// beside the device's step N). tdm_model_forward_issue issues it as
// tdm_model_forward runs it, and on a device backend returns without waiting
// when its chosen rows' tokens (ARGMAX, SAMPLE, DRAW_ALL) are all it brings
// back: they, and their logprobs, are written by the tdm_model_forward_wait
// that takes it (their destinations, and everything the seqs point to that the
// forward reads, must stay valid until then; the host may reuse the rest on
// return). Anything else (LAST and ALL logits rows, KV written for a push
// hook) is done on return, as is every forward on a host-memory backend.
// At most two forwards are in flight (a third issue: TDM_EINVAL). A failed
// issue ends every forward in flight with it: their tokens are not written.
int tdm_model_forward_issue(struct tdm_model *m, struct tdm_kv_cache *kv,
                            const struct tdm_batch_seq *seqs, int n_seqs, float *logits);
// Waits for the oldest forward in flight and writes its tokens; TDM_OK
// at once when none is. Its error, or TDM_OK.
int tdm_model_forward_wait(struct tdm_model *m);
// Forwards in flight (0, 1 or 2).
int tdm_model_forward_pending(const struct tdm_model *m);
// Whether m's forwards may be in flight after tdm_model_forward_issue (a
// device backend that takes chosen tokens asynchronously) and take from_prev
// rows; false: every forward ends at issue (the CPU backend).
bool tdm_model_forward_async(const struct tdm_model *m);

#endif
