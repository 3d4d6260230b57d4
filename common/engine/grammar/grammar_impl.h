// SPDX-License-Identifier: Apache-2.0
// grammar internals shared by the builder (grammar_build.c), the compilers
// (grammar_regex.c, grammar_schema.c), the matcher (grammar_match.c) and the
// masks (grammar_mask.c).
//
// A grammar is rules; a rule is alternatives; an alternative is a run of
// elements in one flat array, ended by an EL_END. An element is a byte class
// (index into a table of 256-bit sets) or a reference to a rule. A matcher
// stack is a chain of nodes: the top node's pos is a class element to match
// next, each node below is the return point (a reference element) to resume
// after the callee's alternative ends. A reference followed directly by EL_END
// pushes nothing (tail call), so right recursion (x*) runs in constant depth.
#ifndef TDM_GRAMMAR_IMPL_H
#define TDM_GRAMMAR_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar.h"

enum gr_el_kind { EL_END = 0, EL_CLASS, EL_REF };

struct gr_el {
    uint8_t kind; // enum gr_el_kind
    int32_t arg;  // EL_CLASS: class index; EL_REF: rule id
};

struct gr_class {
    uint32_t bits[8]; // bit b set: byte b matches
};

// ---- builder (grammar_build.c) --------------------------------------------------
struct gb_seq {
    struct gr_el *v; // [n] elements, no EL_END
    size_t n, cap;
};

struct gb_rule {
    struct gb_seq *alts; // [n_alts]
    size_t n_alts, cap;
};

struct gb {
    struct gb_rule *rules; // [n_rules]
    size_t n_rules, cap_rules;
    struct gr_class *classes; // [n_classes]
    size_t n_classes, cap_classes;
    size_t n_elements; // running total, checked against TDM_GRAMMAR_MAX_ELEMENTS
    int err;           // first error (sticky); the message is in msg
    char msg[256];
};

void gb_init(struct gb *b);
void gb_fini(struct gb *b);
int gb_fail(struct gb *b, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
int gb_rule_new(struct gb *b);                                      // -1 on error
void gb_rule_add(struct gb *b, int rule, const struct gb_seq *alt); // copies alt
void gb_seq_free(struct gb_seq *s);
void gb_seq_class(struct gb *b, struct gb_seq *s, const struct gr_class *c);
void gb_seq_byte(struct gb *b, struct gb_seq *s, uint8_t byte);
void gb_seq_lit(struct gb *b, struct gb_seq *s, const char *bytes, size_t n);
void gb_seq_ref(struct gb *b, struct gb_seq *s, int rule);
void gb_seq_cat(struct gb *b, struct gb_seq *s, const struct gb_seq *t);
// Rules built from a sequence x: x?  x*  x{min,max} (max < 0: unbounded).
int gb_opt(struct gb *b, const struct gb_seq *x);
int gb_star(struct gb *b, const struct gb_seq *x);
void gb_seq_repeat(struct gb *b, struct gb_seq *s, const struct gb_seq *x, long min, long max);
// One rule: a single well-formed UTF-8 character of 2..4 bytes.
int gb_utf8_multibyte(struct gb *b);
void gr_class_range(struct gr_class *c, unsigned lo, unsigned hi);
static inline bool gr_class_has(const struct gr_class *c, unsigned byte)
{
    return (c->bits[byte >> 5] >> (byte & 31)) & 1u;
}

// Finishes b into *out with root as the start rule: drops alternatives that can
// never complete; TDM_EINVAL when the root accepts no string at all.
int gb_finish(struct gb *b, int root, struct tdm_grammar **out, char *err, size_t errlen);
// The least fixpoint of "some alternative of rule r has every element passing"
// over b's rules, in time linear in the grammar's size (a pass-until-stable loop
// is quadratic on a chain of rules): a reference passes when its rule is
// marked; a class passes when classes_pass and it is not empty. Marks rules in
// mark[n_rules], which starts zeroed. TDM_OK or TDM_ENOMEM.
// Productive rules: classes_pass true; nullable rules: false.
int gb_mark_rules(const struct gb *b, bool classes_pass, uint8_t *mark);

// Regex into b: appends to seq. json_string: the regex describes the decoded
// contents of a JSON string (quote, backslash and control bytes are escaped).
// Bounds of a JSON number (grammar_range.c); lo/hi are integers, closed
// unless *_open. The caller checks that some value fits (the regexes assume it).
struct gr_bounds {
    bool has_lo, has_hi, lo_open, hi_open;
    long long lo, hi; // |lo|, |hi| <= TDM_GRAMMAR_MAX_BOUND
    int frac_digits;  // numbers: at most this many fraction digits (multipleOf 10^-p); 0 = any
};
// multipleOf k over a wide range: the values of up to this many digits (all
// within +-TDM_GRAMMAR_MULTIPLE_SPAN, inside JavaScript's safe integers).
#define TDM_GRAMMAR_MULTIPLE_DIGITS 15
#define TDM_GRAMMAR_MULTIPLE_SPAN 999999999999999LL
#define TDM_GRAMMAR_MAX_BOUND 1000000000000000000LL // 1e18
// Integer digits where a side is unbounded: every value parses to a finite double.
#define TDM_GRAMMAR_MAX_INT_DIGITS 300
// Fraction digits of a JSON number the grammar writes: a double holds 17
// significant digits, so more add nothing (and a weak model under a constraint
// could otherwise write digits until max_tokens).
#define TDM_GRAMMAR_MAX_FRAC_DIGITS 20
// A regex for the integers in [lo, hi] (inclusive; lo_open/hi_open ignored),
// canonical JSON text; heap, NULL on ENOMEM.
char *gr_int_range_regex(const struct gr_bounds *r);
// A regex for the decimal values within r (integral bounds, open or closed),
// sign, integer part and an optional fraction; heap, NULL on ENOMEM.
char *gr_number_range_regex(const struct gr_bounds *r);
int gr_regex_compile(struct gb *b, struct gb_seq *seq, const char *pat, size_t len,
                     bool json_string);

// A regex character class ("[...]") or "." at *p (within start..end) appended to
// seq; *p moves past it. For GBNF, whose classes follow the same syntax.
int gr_regex_piece(struct gb *b, struct gb_seq *seq, const char *start, const char **p,
                   const char *end);

// The compilers behind tdm_grammar_compile_*, run on the caller's stack; the
// public entries reach them through tdm_grammar_compile_constraint, which runs
// them on a deep stack (tdm_call_deep): their recursion (regex groups,
// schema nesting, GBNF groups) is bounded for that stack, not a small one.
int gr_compile_json_schema(struct tdm_grammar **out, const char *schema, size_t len, char *err,
                           size_t errlen);
int gr_compile_json_object(struct tdm_grammar **out, char *err, size_t errlen);
int gr_compile_regex(struct tdm_grammar **out, const char *pattern, size_t len, char *err,
                     size_t errlen);
int gr_compile_gbnf(struct tdm_grammar **out, const char *text, size_t len, char *err,
                    size_t errlen);
// A compiled grammar's start expanded once: TDM_EINVAL with a message naming
// the limit when it takes more than a matcher step may (an enum of 50 000
// strings, nested optional groups), so that the request is refused as it is
// parsed (a 400), never when a worker makes its matcher.
int gr_start_check(const struct tdm_grammar *g, char *err, size_t errlen);

// ---- compiled grammar ------------------------------------------------------------
struct tdm_grammar {
    atomic_int refs;
    struct gr_el *els; // [n_els] all alternatives, each ended by EL_END
    size_t n_els;
    int32_t *alt_start;  // [n_alts] element index of each alternative's first element
    int32_t *rule_first; // [n_rules + 1] alternatives of rule r: rule_first[r]..[r+1]
    int32_t n_rules, root;
    struct gr_class *classes; // [n_classes]
    size_t n_classes;
};

// ---- vocabulary trie (grammar_mask.c) -----------------------------------------------
struct gr_trie_node {
    uint8_t byte;      // the byte that leads here from the parent
    uint16_t depth;    // bytes from the root (the root's children are depth 1)
    int32_t skip;      // index of the first node after this node's subtree
    int32_t tok_first; // tokens whose bytes end here: tok_ids[tok_first..+tok_count)
    int32_t tok_count;
};

struct tdm_grammar_vocab {
    int32_t n_tokens, eos_id;
    struct gr_trie_node *nodes; // [n_nodes] preorder, nodes[0] the root (empty prefix)
    int32_t n_nodes;
    int32_t *tok_ids;    // [n_tok_ids]
    uint8_t *is_special; // [n_tokens]
    char **bytes;        // [n_tokens] each token's bytes (NULL: none)
    size_t *lens;        // [n_tokens]
    int max_depth;
};

// ---- matcher state (grammar_match.c) -----------------------------------------------
struct gr_node {
    int32_t pos;    // element index: a class (top) or a reference (return point)
    int32_t parent; // node below, -1 at the bottom
    uint32_t hash;  // of the chain of pos values
    int32_t depth;  // nodes in the chain
};

// A set of stacks: tops[] (node indices into the arena) plus "accepted" (the root
// rule completed exactly here).
struct gr_arena {
    struct gr_node *nodes; // [n] (cap allocated)
    size_t n, cap;
    int32_t *visited; // expansion scratch: (ref pos, parent) pairs seen in one step
    size_t visited_cap;
    int32_t base_depth; // depth below a GR_BASE bottom (set per advance from the input set)
    uint64_t *budget;   // work units left for the mask fill in progress (NULL: no fill;
                        // each advance still has its own EXPAND_MAX_WORK)
};

// A chain bottom standing for a stack base B cut off (relative sets, see
// grammar_mask.c): popping into it sets "escaped" instead of "accepted".
#define GR_BASE (-2)

struct gr_set {
    int32_t *tops;
    size_t n, cap;
    bool accepted;
    bool escaped;       // relative sets: some stack popped into the cut-off base
    int32_t base_depth; // relative sets: the depth of the cut-off base; 0 otherwise
};

// Expands the start of g's root into (arena, set). 0 or TDM_ENOMEM.
int gr_set_start(const struct tdm_grammar *g, struct gr_arena *a, struct gr_set *out);
// out = the stacks of in after one byte (out is cleared first). 0 or TDM_ENOMEM.
int gr_set_advance(const struct tdm_grammar *g, struct gr_arena *a, const struct gr_set *in,
                   uint8_t byte, struct gr_set *out);
// out = the stacks that continue after the return point base (a node of a).
int gr_set_continue(const struct tdm_grammar *g, struct gr_arena *a, int32_t base,
                    struct gr_set *out);
void gr_set_fini(struct gr_set *s);
// Appends the chains of s from src to dst, rewriting s's tops. 0 or TDM_ENOMEM.
int gr_copy_chains(struct gr_arena *dst, const struct gr_arena *src, struct gr_set *s);
struct gr_dfa;
void gr_dfa_fini(struct gr_dfa *d);
int gr_set_copy(struct gr_set *dst, const struct gr_set *src);

struct gr_mask_cache;

// Lazily built DFA over stack sets for the mask walk (subset construction on
// demand): each distinct set met is interned once with a 256-entry transition
// row, so walking the trie inside a string costs a table lookup per node.
struct gr_dfa {
    struct gr_arena arena; // nodes of every interned set
    struct gr_set *sets;   // [n] interned sets (tops in arena)
    uint32_t **keys;       // [n] serialised sets (gr_set_key)
    size_t *key_lens;      // [n]
    int32_t *trans;        // [n][256] next set id; -1 not computed, -2 dead
    uint32_t **rel_mask;   // [n] relative sets: the mask of tokens that stay above the base
    int32_t **rel_escapes; // [n] trie nodes where a stack pops into the base
    size_t *n_rel_escapes; // [n]
    size_t n, cap;
    int32_t *table; // [table_cap] open addressing over keys: set id or -1
    size_t table_cap;
    struct gr_set tmp;
};

struct tdm_grammar_matcher {
    struct tdm_grammar *g;
    const struct tdm_grammar_vocab *vocab;
    struct gr_arena arena; // live nodes of cur
    struct gr_set cur;
    bool done;          // EOS accepted
    struct gr_set next; // scratch for accept_bytes
    // mask walk scratch (nodes go into arena above cur's, then are dropped)
    struct gr_set *levels; // [vocab->max_depth + 2] the state after each trie depth
    size_t *level_mark;    // [vocab->max_depth + 2] arena.n before computing each level
    uint32_t *key;         // cache key scratch
    size_t key_cap;
    struct gr_mask_cache *cache;
    uint64_t hits, misses;
    struct gr_dfa dfa;
    int32_t *level_id; // [vocab->max_depth + 2] DFA set after each trie depth
    bool no_dfa;       // tests: walk with the plain set advance only
    uint64_t fill_budget;    // work units a fill may spend (GR_FILL_MAX_WORK; tests lower it)
    uint64_t last_fill_work; // work units the last fill_mask spent
};

// Work units one fill_mask may spend over all its set advances (an expansion
// step is one unit; scans of the visited list and of the state's stacks
// count one unit per 64 entries). A grammar that needs more for one token's
// mask is refused at that step (TDM_ECAPACITY) instead of holding every
// request of the batch: a ~300-byte regex of nested empty alternatives spent
// over two minutes on one mask of the Qwen2 vocabulary before this bound.
// Real schemas and regexes spend well under a hundredth of it (grammar_test).
#define GR_FILL_MAX_WORK 4000000u

int gr_mask_cache_new(struct gr_mask_cache **out, size_t words);
void gr_mask_cache_free(struct gr_mask_cache *c);
void gr_mask_cache_clear(struct gr_mask_cache *c);
// key[0..n) is a serialised state (grammar_match.c: gr_set_key).
bool gr_mask_cache_get(struct gr_mask_cache *c, const uint32_t *key, size_t n, uint32_t *mask);
void gr_mask_cache_put(struct gr_mask_cache *c, const uint32_t *key, size_t n,
                       const uint32_t *mask);
// Writes the state as a key into *key (grown as needed); its length, or 0 when
// the state is too large to cache or memory ran out.
size_t gr_set_key(const struct gr_arena *a, const struct gr_set *s, uint32_t **key, size_t *cap);

#endif
