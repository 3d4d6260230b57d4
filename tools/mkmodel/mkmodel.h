// SPDX-License-Identifier: Apache-2.0
// mkmodel: writes a Hugging Face model folder with random weights of any
// Qwen2/Llama shape (config.json, model.safetensors, generation_config.json,
// tokenizer.json, tokenizer_config.json). Used by tandem-mkmodel, the model
// tests and the engine bench, so the engine can be exercised at real shapes
// without downloading weights.
//
// Weights are deterministic in (seed, tensor name): each tensor draws from its
// own splitmix64 stream, uniform with the standard deviations below, so that a
// model's logits are well separated (greedy decoding does not hinge on ties):
//   embed_tokens, lm_head   std 4/sqrt(hidden): after the final RMSNorm (rows of
//                           RMS ~1) logits have std ~4, so the expected gap
//                           between the top two of V logits is ~4/sqrt(2 ln V)
//                           (about 1, i.e. ~0.3 std) and a gap below 1e-2 std
//                           occurs in only ~3% of steps.
//   q/k/v/o/gate/up/down    std 1/sqrt(fan_in): every sublayer adds ~unit RMS.
//   q/k/v biases            std 0.5 (Qwen2 has them; they make RoPE'd q/k offsets matter).
//   RMSNorm weights         1 + uniform noise of std 0.1.
#ifndef TDM_MKMODEL_H
#define TDM_MKMODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "hf.h"

struct tdm_mkmodel_spec {
    enum tdm_arch arch; // Qwen2ForCausalLM or LlamaForCausalLM
    int hidden_size;
    int intermediate_size;
    int num_layers;
    int num_heads;
    int num_kv_heads;
    int head_dim;   // 0 = hidden_size / num_heads
    int vocab_size; // >= 259 (256 bytes + 3 special tokens) for the own tokenizer
    int max_position_embeddings;
    bool tie_word_embeddings;
    int attention_bias; // -1 = by arch (Qwen2 yes, Llama no), 0 / 1 forced
    double rope_theta;
    float rms_norm_eps;
    bool rope_llama3;  // write rope_scaling {"rope_type":"llama3", ...}
    float rope_factor; // llama3 scaling parameters
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int rope_original_max_pos;
    enum tdm_dtype dtype; // of model.safetensors
    uint64_t seed;
    const char
        *tokenizer_from; // folder with tokenizer.json (+ tokenizer_config.json) to copy, or NULL
};

// Fills s with a preset: "tiny", "demo" (tandem up's demo model) or "qwen2.5-0.5b".
// TDM_EINVAL for an unknown name.
int tdm_mkmodel_preset(struct tdm_mkmodel_spec *s, const char *name);

// Checks the shape fields (positive, heads divisible, vocab room for the tokenizer).
int tdm_mkmodel_validate(const struct tdm_mkmodel_spec *s, char *err, size_t errlen);

// Writes the folder out_dir (created if missing; existing files are replaced).
int tdm_mkmodel_write(const struct tdm_mkmodel_spec *s, const char *out_dir, char *err,
                      size_t errlen);

// Writes only DIR/tokenizer.json and DIR/tokenizer_config.json: a byte-level BPE
// with exactly vocab_size tokens (256 bytes, merges learned from a built-in
// English text then filled with further valid merges, and <|endoftext|>,
// <|im_start|>, <|im_end|> as the last three ids), ChatML chat template.
int tdm_mkmodel_write_tokenizer(int vocab_size, const char *dir, char *err, size_t errlen);

// Removes the files tdm_mkmodel_write writes from dir, then dir itself when it is
// empty (for tests and tools that make throwaway models). Missing files are fine.
void tdm_mkmodel_remove(const char *dir);

#endif
