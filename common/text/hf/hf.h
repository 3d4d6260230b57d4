// SPDX-License-Identifier: Apache-2.0
// hf: Hugging Face model folders. Parses config.json (Qwen2ForCausalLM,
// LlamaForCausalLM) and generation_config.json into plain structs with
// validation, and maps safetensors files (single or sharded through
// model.safetensors.index.json) read-only. Every byte of a safetensors header is
// untrusted: offsets, shapes and dtypes are checked against the file size before
// any tensor pointer is handed out. Also writes safetensors files (for
// tandem-mkmodel and tests).
#ifndef TDM_HF_H
#define TDM_HF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TDM_MAX_EOS 8

enum tdm_arch { TDM_ARCH_QWEN2 = 0, TDM_ARCH_LLAMA };

enum tdm_dtype {
    TDM_DTYPE_F32 = 0,
    TDM_DTYPE_F16,
    TDM_DTYPE_BF16,
};
// Bytes per element; "F32"/"F16"/"BF16" names as safetensors writes them.
size_t tdm_dtype_size(enum tdm_dtype dt);
const char *tdm_dtype_name(enum tdm_dtype dt);

enum tdm_rope_type { TDM_ROPE_DEFAULT = 0, TDM_ROPE_LLAMA3 };

struct tdm_rope_scaling {
    enum tdm_rope_type type;               // DEFAULT when rope_scaling is null/absent
    float factor;                          // llama3: e.g. 8.0 or 32.0
    float low_freq_factor;                 // llama3: e.g. 1.0
    float high_freq_factor;                // llama3: e.g. 4.0
    int original_max_position_embeddings;  // llama3: e.g. 8192
};

struct tdm_model_config {
    enum tdm_arch arch;                    // from "architectures"[0], else "model_type"
    char architecture[64];                 // the class name as written (from model_type:
                                           // the class transformers would use)
    int hidden_size;
    int intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;               // defaults to num_attention_heads
    int head_dim;                          // defaults to hidden_size / num_attention_heads
    int vocab_size;
    int max_position_embeddings;           // default 32768 (Qwen2) / 2048 (Llama)
    float rms_norm_eps;                    // default 1e-6
    double rope_theta;                     // default 10000
    struct tdm_rope_scaling rope_scaling;
    bool tie_word_embeddings;              // default false (Qwen2Config and LlamaConfig)
    bool attention_bias;                   // q/k/v biases: Qwen2 always; Llama when "attention_bias"
    bool use_sliding_window;               // Qwen2 field (false for Qwen2.5)
    int sliding_window;                    // 0 unless use_sliding_window (as transformers does)
    int max_window_layers;                 // layers >= this use the window; Qwen2 default 28
    int bos_token_id;                      // -1 when absent/null (a list: its first id)
    int eos_token_ids[TDM_MAX_EOS];        // int or list in the file; every id < vocab_size
    int num_eos_token_ids;                 // 0 when absent/null
    enum tdm_dtype torch_dtype;            // "dtype" or "torch_dtype"; BF16 when absent
};

// Parses and validates config.json text (len bytes; need not be NUL-terminated).
// On failure returns TDM_EINVAL (or TDM_EPROTO for malformed JSON or a top level
// that is not an object) and writes a precise message to err, e.g.
// "config.json: num_key_value_heads=3 does not divide num_attention_heads=14".
// On success head_dim and num_key_value_heads are filled in even when absent.
// Field list, defaults and checks: docs/model-folders.md.
int tdm_hf_config_parse(struct tdm_model_config *cfg, const char *json, size_t len, char *err,
                        size_t errlen);
// Reads DIR/config.json and parses it; TDM_ENOTFOUND/TDM_EIO when unreadable.
int tdm_hf_config_load(struct tdm_model_config *cfg, const char *dir, char *err, size_t errlen);

// Defaults from generation_config.json. A has_* flag is false when the file is
// silent; then vLLM's fallbacks apply (temperature 1, top_p 1, top_k off, ...).
struct tdm_generation_config {
    bool has_temperature;  float temperature;
    bool has_top_p;        float top_p;
    bool has_top_k;        int top_k;
    bool has_min_p;        float min_p;
    bool has_repetition_penalty; float repetition_penalty;
    bool has_max_new_tokens; int max_new_tokens;
    bool do_sample;        // informative only (vLLM ignores it)
    int eos_token_ids[TDM_MAX_EOS];
    int num_eos_token_ids;
    int pad_token_id;      // -1 when absent
    int bos_token_id;      // -1 when absent
};
// A missing DIR/generation_config.json is not an error: all has_* false, ids -1.
// Null values count as absent; out-of-range values (temperature < 0, top_p
// outside (0, 1], top_k < -1, ...) are TDM_EINVAL, bad JSON TDM_EPROTO.
int tdm_hf_generation_config_load(struct tdm_generation_config *gc, const char *dir, char *err,
                                  size_t errlen);
int tdm_hf_generation_config_parse(struct tdm_generation_config *gc, const char *json, size_t len,
                                   char *err, size_t errlen);

// Sampling values a request set; NULL means "not given in the request".
struct tdm_sampling_request {
    const float *temperature;
    const float *top_p;
    const int *top_k;                      // -1 or 0: off
    const float *min_p;
    const float *repetition_penalty;
    const int *max_tokens;                 // <= 0 counts as not given
};
// The values a request runs with.
struct tdm_sampling_resolved {
    float temperature;                     // 0 (or tiny) = greedy, as in vLLM
    float top_p;
    int top_k;                             // 0 = off
    float min_p;
    float repetition_penalty;
    int max_tokens;                        // -1 when nothing bounds it
};
// Resolves sampling values the way vLLM (--generation-config auto, its default)
// does: a value set in the request wins; else generation_config.json's value;
// else vLLM's fallback (temperature 1, top_p 1, top_k off, min_p 0,
// repetition_penalty 1). A file top_k of exactly 50 is ignored, as in vLLM (it
// reads the file through GenerationConfig.to_diff_dict(), which drops
// transformers' defaults). max_tokens is the smallest of the request's
// max_tokens, the file's max_new_tokens and max_tokens_limit (pass
// max_model_len - prompt_len; <= 0 = unknown). gc and req may be NULL. The
// eos_token_ids of gc are not applied here: vLLM treats them as extra stop
// token ids (see docs/model-folders.md).
void tdm_hf_sampling_resolve(const struct tdm_generation_config *gc,
                             const struct tdm_sampling_request *req, int max_tokens_limit,
                             struct tdm_sampling_resolved *out);

// ---- safetensors ------------------------------------------------------------------
#define TDM_ST_MAX_DIMS 4

struct tdm_tensor {
    const char *name;                      // owned by the tdm_safetensors
    enum tdm_dtype dtype;
    int ndim;
    int64_t shape[TDM_ST_MAX_DIMS];
    const void *data;                      // into the read-only mmap
    size_t nbytes;
};

struct tdm_safetensors;

// Opens PATH: a .safetensors file, a model.safetensors.index.json file, or a
// model folder holding model.safetensors (preferred, as in transformers) or
// model.safetensors.index.json (+ its shards). Maps each file read-only, once.
// Errors: TDM_ENOTFOUND (no such file/folder, a shard the index names is
// missing, a tensor the index names is not in its shard), TDM_EPROTO (malformed
// header or index: bad lengths, offsets, shapes, overlaps, duplicate names),
// TDM_EINVAL (valid but unsupported: dtype other than F32/F16/BF16, more than 4
// dims), TDM_EIO; err names the file and the tensor. *out is NULL on failure.
// Tensor data is aligned to its element size. The files must not be truncated
// while open (that would fault, as with any mmap).
int tdm_st_open(struct tdm_safetensors **out, const char *path, char *err, size_t errlen);
void tdm_st_free(struct tdm_safetensors *st);

// Tensors are ordered shard by shard (in order of first mention in the index),
// by data offset within a shard. tdm_st_at returns NULL past the end.
size_t tdm_st_count(const struct tdm_safetensors *st);
const struct tdm_tensor *tdm_st_at(const struct tdm_safetensors *st, size_t i);
// Hash lookup; NULL when absent.
const struct tdm_tensor *tdm_st_find(const struct tdm_safetensors *st, const char *name);
// Finds NAME and checks its shape (ndim entries of shape); TDM_ENOTFOUND or
// TDM_EINVAL with "model.layers.0.mlp.up_proj.weight: shape [4864, 895] does not
// match the config's [4864, 896]".
int tdm_st_get(const struct tdm_safetensors *st, const char *name, int ndim, const int64_t *shape,
               const struct tdm_tensor **out, char *err, size_t errlen);

// Writes a safetensors file with the given tensors (data copied from each
// tensor's data pointer), header keys in the order given, offsets in order,
// __metadata__ {"format":"pt"} first, the header padded with spaces to a
// multiple of 8 bytes. Written to PATH.tmp.XXXXXX then renamed over PATH.
// TDM_EINVAL for bad tensors (duplicate name, nbytes not shape x dtype size,
// NULL data with nbytes > 0), TDM_EIO for file errors (no partial file left).
int tdm_st_write(const char *path, const struct tdm_tensor *tensors, size_t n, char *err,
                 size_t errlen);

// bf16/f16 <-> f32 conversions. f32 -> bf16/f16 round to nearest, ties to even;
// overflow gives inf; NaN stays NaN (sign and top payload bits kept, quiet bit
// set); f16 subnormals are exact both ways.
float tdm_bf16_to_f32(uint16_t h);
uint16_t tdm_f32_to_bf16(float f);
float tdm_f16_to_f32(uint16_t h);
uint16_t tdm_f32_to_f16(float f);

#endif
