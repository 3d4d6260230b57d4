// SPDX-License-Identifier: Apache-2.0
// grammar: the engine behind structured outputs. A JSON Schema, "any JSON
// object", a regex or a list of exact choices compiles into one grammar over
// BYTES (rules of alternatives of byte classes and rule references, run as a
// pushdown automaton: a set of stacks, as llama.cpp's grammar does). A matcher
// follows one sequence through it token by token and fills the step's token
// mask (a bitset over the vocabulary) by walking a trie of the vocabulary's
// token bytes against the automaton; masks are cached per matcher state.
//
// Objects and threads:
//   struct tdm_grammar         compiled, immutable, reference counted (atomic):
//                              share one between threads and requests.
//   struct tdm_grammar_vocab   the token trie of one tokenizer, immutable after
//                              tdm_grammar_vocab_new*: build once, share freely.
//   struct tdm_grammar_matcher one sequence's state; one thread at a time. It
//                              holds a reference to its grammar and borrows the
//                              vocab (which must outlive it).
// Limits (hostile input fails with TDM_EINVAL and a message, in bounded time
// and memory) are the TDM_GRAMMAR_MAX_* values below; docs/structured-outputs.md
// lists what each compiler supports.
#ifndef TDM_GRAMMAR_H
#define TDM_GRAMMAR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h" // enum tdm_constraint_kind

struct tdm_tokenizer;
struct tdm_grammar;
struct tdm_grammar_vocab;
struct tdm_grammar_matcher;

#define TDM_GRAMMAR_MAX_SCHEMA_BYTES (1u << 20) // JSON Schema text
#define TDM_GRAMMAR_MAX_REGEX_BYTES (64u << 10) // a regex, a pattern or one choice
#define TDM_GRAMMAR_MAX_REPEAT 10000            // m, n of {m,n}; minItems/maxItems/...Length
#define TDM_GRAMMAR_MAX_ELEMENTS (1u << 21)     // elements of a compiled grammar
#define TDM_GRAMMAR_MAX_STACK 1024              // nesting depth a sequence may reach
#define TDM_GRAMMAR_MAX_STACKS 4096             // live stacks (ambiguity) in one state
#define TDM_GRAMMAR_MAX_GBNF_BYTES (1u << 20)   // GBNF text
#define TDM_GRAMMAR_MAX_WS 4       // whitespace bytes allowed at each JSON structural place
#define TDM_GRAMMAR_MAX_END_IDS 64 // ending ids (EOS + stop ids) tdm_grammar_mask_apply keeps

// ---- compile -------------------------------------------------------------------
// Each returns TDM_OK and a grammar with one reference in *out, or an error code
// (TDM_EINVAL: unsupported or malformed input, TDM_ENOMEM) with a message in err.

// JSON Schema text (len bytes). Output is JSON with object properties in schema
// order, at most TDM_GRAMMAR_MAX_WS bytes of [ \t\n] between structural tokens.
int tdm_grammar_compile_json_schema(struct tdm_grammar **out, const char *schema, size_t len,
                                    char *err, size_t errlen);
// Any JSON object (response_format {"type":"json_object"}).
int tdm_grammar_compile_json_object(struct tdm_grammar **out, char *err, size_t errlen);
// A regex matched against the whole output (implicit ^...$).
int tdm_grammar_compile_regex(struct tdm_grammar **out, const char *pattern, size_t len, char *err,
                              size_t errlen);
// A GBNF grammar (llama.cpp's syntax: `name ::= ...` rules, "strings", [classes],
// '.', ( groups ), |, ? * + {m,n}, # comments; start rule `root`). Left
// recursion and undefined rules are refused.
int tdm_grammar_compile_gbnf(struct tdm_grammar **out, const char *text, size_t len, char *err,
                             size_t errlen);
// Exactly one of n byte strings choices[i] (lens[i] bytes each).
int tdm_grammar_compile_choice(struct tdm_grammar **out, const char *const *choices,
                               const size_t *lens, size_t n, char *err, size_t errlen);

// A request's constraint (enum tdm_constraint_kind in core.h) by its kind:
// JSON_SCHEMA, REGEX, GRAMMAR (GBNF) compile text as above, JSON_OBJECT ignores
// text, CHOICE takes text as a JSON array of strings. TDM_EINVAL for NONE or an
// unknown kind.
int tdm_grammar_compile_constraint(struct tdm_grammar **out, enum tdm_constraint_kind kind,
                                   const char *text, size_t len, char *err, size_t errlen);
// The same through a process-wide cache keyed by (kind, text) (64 grammars, 16
// MiB of text, least recently used evicted; texts over 1 MiB and failed
// compiles are not kept): *out is a new reference either way. Thread safe.
int tdm_grammar_compile_cached(struct tdm_grammar **out, enum tdm_constraint_kind kind,
                               const char *text, size_t len, char *err, size_t errlen);
// Cache counters (any may be NULL) and a way to empty it (tests).
void tdm_grammar_cache_stats(uint64_t *hits, uint64_t *misses, int *entries);
void tdm_grammar_cache_clear(void);

struct tdm_grammar *tdm_grammar_ref(struct tdm_grammar *g); // returns g
void tdm_grammar_unref(struct tdm_grammar *g);              // frees at zero; NULL is fine

// ---- vocabulary ------------------------------------------------------------------
// From explicit token bytes: token i is bytes[i][0..lens[i]); bytes[i] == NULL
// or is_special[i] marks a token never allowed by a mask except eos_id (which is
// allowed exactly where the grammar accepts). Copies what it needs.
int tdm_grammar_vocab_new(struct tdm_grammar_vocab **out, int32_t n_tokens,
                          const char *const *bytes, const size_t *lens, const bool *is_special,
                          int32_t eos_id, char *err, size_t errlen);
// From a loaded tokenizer (tdm_tok_token_bytes, tdm_tok_is_special, tdm_tok_eos_id;
// eos_id < 0 takes the tokenizer's).
int tdm_grammar_vocab_from_tokenizer(struct tdm_grammar_vocab **out,
                                     const struct tdm_tokenizer *tok, int32_t eos_id, char *err,
                                     size_t errlen);
void tdm_grammar_vocab_free(struct tdm_grammar_vocab *v);
int32_t tdm_grammar_vocab_size(const struct tdm_grammar_vocab *v);
int32_t tdm_grammar_vocab_eos_id(const struct tdm_grammar_vocab *v); // -1: none
// 32-bit words of a mask over v: (size + 31) / 32.
size_t tdm_grammar_mask_words(const struct tdm_grammar_vocab *v);

// ---- matcher -----------------------------------------------------------------------
// vocab may be NULL for a matcher driven by bytes only (no masks, no tokens).
int tdm_grammar_matcher_new(struct tdm_grammar_matcher **out, struct tdm_grammar *g,
                            const struct tdm_grammar_vocab *vocab);
// A copy of m's state (its mask cache starts empty).
int tdm_grammar_matcher_copy(struct tdm_grammar_matcher **out, const struct tdm_grammar_matcher *m);
void tdm_grammar_matcher_free(struct tdm_grammar_matcher *m);

// Advances by one token. TDM_OK; TDM_EINVAL when the grammar does not allow the
// token here (m unchanged); EOS is accepted only where tdm_grammar_matcher_accepts_eos,
// and after it is_done is true. TDM_ECAPACITY (m unchanged) when one byte's
// advance needs more expansion steps than a step may take: a grammar too
// ambiguous here. The mask may still have allowed the token (its walk reaches
// the same stacks in another order, from cached states), so a caller ends the
// request with tdm_grammar_accept_error's error, as for a mask.
int tdm_grammar_matcher_accept_token(struct tdm_grammar_matcher *m, int32_t id);
// Advances by raw bytes; all or nothing (TDM_EINVAL leaves m unchanged).
int tdm_grammar_matcher_accept_bytes(struct tdm_grammar_matcher *m, const char *bytes, size_t n);
// True when the output so far is a complete match (EOS may end it here).
bool tdm_grammar_matcher_accepts_eos(const struct tdm_grammar_matcher *m);
// True when nothing but EOS can follow (complete, no longer continuation possible).
bool tdm_grammar_matcher_is_done(const struct tdm_grammar_matcher *m);

// Fills mask[0..tdm_grammar_mask_words) with bit (id % 32) of word id / 32 set
// when token id may come next. No allocation once the matcher's scratch has grown
// to the grammar's needs. TDM_EINVAL without a vocab.
int tdm_grammar_matcher_fill_mask(struct tdm_grammar_matcher *m, uint32_t *mask, size_t words);
// For a request whose mask could not be filled (fill_mask's rc), or whose
// token could not be followed for its ambiguity (accept_token's TDM_ECAPACITY):
// the error to end it with, written into msg, and the code to report. A grammar too
// ambiguous at this point (TDM_ECAPACITY: the fill spent its work budget) is
// the request's fault, TDM_EINVAL (a 400, never retried on another worker,
// which would spend the same budget); anything else keeps its code.
int tdm_grammar_mask_error(int rc, char *msg, size_t msglen);
// For a request whose token tok the matcher refused (accept_token's rc): too
// ambiguous to follow (TDM_ECAPACITY) is tdm_grammar_mask_error's error; any
// other refusal "structured output: token <tok> is not allowed here". Both
// TDM_EINVAL, the message written into msg.
int tdm_grammar_accept_error(int rc, int32_t tok, char *msg, size_t msglen);

// Applies a step's mask to one row of logits[n_logits] (the model's vocabulary,
// which may be larger than the tokenizer's mask_tokens): tokens the mask leaves
// out, and ids >= mask_tokens, become -inf; the ending ids end_ids[0..n_end)
// (EOS, the request's stop ids; at most TDM_GRAMMAR_MAX_END_IDS, later ones are
// masked like any token) keep their logit only when allow_end (the matcher
// accepts_eos), whatever the mask says of them. mask NULL (the mask
// could not be filled) leaves nothing but the ending ids. The engine and the
// runner both apply masks through this, so their sampling agrees.
void tdm_grammar_mask_apply(const uint32_t *mask, int32_t mask_tokens, float *logits,
                            int32_t n_logits, const int32_t *end_ids, int n_end, bool allow_end);

// Counters for benches and tests: masks served from the cache / computed.
void tdm_grammar_matcher_cache_stats(const struct tdm_grammar_matcher *m, uint64_t *hits,
                                     uint64_t *misses);

#endif
