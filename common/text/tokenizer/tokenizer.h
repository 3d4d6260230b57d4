// SPDX-License-Identifier: Apache-2.0
// tokenizer: Hugging Face tokenizer.json byte-level BPE (as Qwen2, Llama 3 and
// GPT-2 use it): NFC normalizer, Split regex pre-tokenizer (PCRE2, UTF+UCP),
// ByteLevel mapping, BPE merges by rank with a priority queue, added tokens
// matched before BPE. Encode/decode match the HF `tokenizers` library exactly.
// A loaded tokenizer is immutable apart from an internal word cache guarded by
// a lock, so one tokenizer may be shared by many threads.
#ifndef TDM_TOKENIZER_H
#define TDM_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct tdm_tokenizer;

// Loads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json.
int tdm_tok_load(struct tdm_tokenizer **out, const char *dir, char *err, size_t errlen);
// Same from explicit paths; config_path may be NULL.
int tdm_tok_load_files(struct tdm_tokenizer **out, const char *tokenizer_json_path,
                       const char *config_path, char *err, size_t errlen);
void tdm_tok_free(struct tdm_tokenizer *tok);

// Encodes len bytes of text. *ids is a heap array the caller frees, *n its length.
// add_special_tokens applies the post-processor's additions (none for Qwen2; the
// BOS for Llama 3). Invalid UTF-8 is not an error: see docs/tokenizer.md.
int tdm_tok_encode(const struct tdm_tokenizer *tok, const char *text, size_t len,
                   bool add_special_tokens, int32_t **ids, size_t *n);

// Flags for tdm_tok_encode_ex.
enum {
    // As add_special_tokens above.
    TDM_TOK_ADD_SPECIAL = 1,
    // Special-token strings in the text are plain text (HF split_special_tokens).
    TDM_TOK_SPLIT_SPECIAL = 2,
};
// tdm_tok_encode with flags; tdm_tok_encode(.., b, ..) is flags = b ? TDM_TOK_ADD_SPECIAL : 0.
int tdm_tok_encode_ex(const struct tdm_tokenizer *tok, const char *text, size_t len, unsigned flags,
                      int32_t **ids, size_t *n);

// Decodes ids to text (heap, NUL-terminated, caller frees; *len without the NUL).
// Ids outside the vocabulary are TDM_EINVAL. Bytes that do not form valid UTF-8
// become U+FFFD, as HF decode does.
int tdm_tok_decode(const struct tdm_tokenizer *tok, const int32_t *ids, size_t n,
                   bool skip_special_tokens, char **text, size_t *len);

int tdm_tok_vocab_size(const struct tdm_tokenizer *tok);          // max id + 1
const char *tdm_tok_id_to_piece(const struct tdm_tokenizer *tok, int32_t id); // raw token string or NULL
int32_t tdm_tok_piece_to_id(const struct tdm_tokenizer *tok, const char *piece); // -1 when absent
bool tdm_tok_is_special(const struct tdm_tokenizer *tok, int32_t id);
// The raw bytes id stands for in decoded text (the ByteLevel table applied; the
// piece itself without a decoder). *len gets their count; NULL for an unknown id.
// The bytes are owned by tok and are not NUL-terminated.
const char *tdm_tok_token_bytes(const struct tdm_tokenizer *tok, int32_t id, size_t *len);

// From tokenizer_config.json (or -1 / NULL when absent).
int32_t tdm_tok_bos_id(const struct tdm_tokenizer *tok);
int32_t tdm_tok_eos_id(const struct tdm_tokenizer *tok);
int32_t tdm_tok_pad_id(const struct tdm_tokenizer *tok);
const char *tdm_tok_chat_template(const struct tdm_tokenizer *tok);
// The chat template a parsed tokenizer_config.json holds, as the loader reads
// it: "chat_template" as a string, or the entry named "default" of a list of
// {"name", "template"}; NULL when there is none. Borrowed from cfg.
struct cJSON;
const char *tdm_tok_config_chat_template(const struct cJSON *cfg);

// ---- incremental detokenizer for streaming ------------------------------------------
// Emits text only in complete UTF-8 characters: bytes of a character split across
// tokens are held until the character completes. The concatenation of all deltas
// plus the flush equals tdm_tok_decode of all ids.
struct tdm_detok;
int tdm_detok_new(struct tdm_detok **out, const struct tdm_tokenizer *tok, bool skip_special_tokens);
void tdm_detok_free(struct tdm_detok *d);
// Adds one id; *delta points into the detokenizer (valid until the next call),
// *delta_len may be 0. TDM_EINVAL for an id outside the vocabulary.
int tdm_detok_push(struct tdm_detok *d, int32_t id, const char **delta, size_t *delta_len);
// Emits what is held (an incomplete character becomes U+FFFD).
int tdm_detok_flush(struct tdm_detok *d, const char **delta, size_t *delta_len);

#endif
