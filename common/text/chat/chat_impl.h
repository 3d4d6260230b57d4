// SPDX-License-Identifier: Apache-2.0
// chat_impl.h: internals of the Jinja renderer behind chat.h. One concept per file:
//   chat_value.c    arena, values, Python str()/repr()/==/< and truthiness
//   chat_json.c     JSON text -> values (ints stay ints), tojson as Python json.dumps
//   chat_lex.c      template text -> tokens, with HF's whitespace rules applied
//   chat_parse.c    tokens -> AST (struct node), unsupported constructs refused here
//   chat_eval.c     AST -> output, scopes, loops, macros, limits
//   chat_builtins.c filters, tests, globals and the str/dict methods templates call
//
// Memory: a template's AST lives in the template's own arena (freed with it); every
// value made while rendering lives in the render's arena, freed in one go when the
// render ends, so values need no reference counts. The render arena has a byte cap,
// which is what bounds string and list blow-up (docs/chat-templates.md, "Limits").
#ifndef TDM_CHAT_IMPL_H
#define TDM_CHAT_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "sanitizer.h"

// ---- limits (stated in docs/chat-templates.md) -----------------------------------
#define CHAT_MAX_OUTPUT (8u << 20)             // bytes of rendered prompt
#define CHAT_MAX_STRING (8u << 20)             // bytes of any one string value
#define CHAT_MAX_ARENA (128u << 20)            // bytes of values made by one render
#define CHAT_MAX_ITERATIONS 200000             // loop iterations in one render, all loops
#define CHAT_MAX_CALL_DEPTH 64                 // nested macro / caller() calls
#define CHAT_MAX_NEST 128                      // nesting of template blocks and expressions
#define CHAT_MAX_JSON_DEPTH TDM_JSON_MAX_DEPTH // nesting of messages/tools JSON (core.h)
// Bytes of C stack one render may use; sanitizer builds have frames about twice
// as large, so they get twice the budget.
#if TDM_SANITIZE_ADDRESS
#define CHAT_MAX_STACK (96u << 10)
#else
#define CHAT_MAX_STACK (48u << 10)
#endif
#define CHAT_MAX_WORK 100000000ull // node evaluations + weighted bytes scanned/copied

// ---- arena -------------------------------------------------------------------------
struct arena_chunk;
struct arena {
    struct arena_chunk *head; // newest chunk first; heap
    size_t used;              // bytes handed out, all chunks
    size_t cap;               // 0: unlimited
};
void *chat_arena_alloc(struct arena *a, size_t n); // zeroed, 16-aligned; NULL past cap or OOM
char *chat_arena_strndup(struct arena *a, const char *s, size_t n);
void chat_arena_free(struct arena *a);

// Text is built in core's struct tdm_strbuf, its limit set to the bound of
// the string being built (CHAT_MAX_STRING, CHAT_MAX_OUTPUT).

// ---- values ------------------------------------------------------------------------
enum vkind {
    V_UNDEF = 0, // jinja2.Undefined: prints "", iterates empty, fails on use
    V_NONE,
    V_BOOL,
    V_INT,
    V_FLOAT,
    V_STR,
    V_LIST,   // list or tuple
    V_DICT,   // dict (insertion ordered)
    V_NS,     // namespace(): a dict whose attributes can be set
    V_MACRO,  // a macro, or the caller of a call block
    V_FUNC,   // a global function (namespace, range, raise_exception, ...)
    V_METHOD, // a bound str/dict/list method: self + name
    V_LOOP,   // the loop object of a for loop
};

struct vlist;
struct vdict;
struct node;
struct loopinfo;

struct val {
    enum vkind kind;
    bool markup; // V_STR: a markupsafe.Markup (|safe, |escape); '+' escapes the other side
    union {
        bool b;
        int64_t i;
        double f;
        struct {
            const char *s; // arena or static; not NUL-terminated in general
            size_t n;
        } str;
        struct vlist *list;
        struct vdict *dict;
        const struct node *macro;
        int func; // enum of chat_builtins.c
        struct {
            struct val *self; // arena
            const char *name; // static
        } method;
        struct loopinfo *loop;
        const char *undef_name; // V_UNDEF: the missing name, for errors (may be NULL)
    } u;
    struct scope *closure; // V_MACRO: the scope a caller() body reads
};

struct vlist {
    size_t n, cap;
    struct val *items; // [cap], arena
    bool tuple;
    // A generator (what map/select/items/reverse return in Jinja2): iterable once,
    // always true, no len(), not JSON. A view (dict.keys()/values()/items()): has
    // len() and truthiness, but is not JSON and not subscriptable.
    bool gen, view, consumed;
};

struct vdict {
    size_t n, cap;
    struct val *keys; // [cap], arena; strings in practice
    struct val *vals; // [cap], arena
};

struct loopinfo {
    int64_t index0, length;
    struct val prev, next; // V_UNDEF at the ends
    int64_t depth0;
};

// ---- render context ----------------------------------------------------------------
struct scope {
    struct scope *parent;
    struct vdict vars;
};

struct render {
    struct arena arena;    // every value of this render
    struct tdm_strbuf *out; // where output goes now (a capture swaps it)
    struct scope *globals; // render variables + top-level sets
    char *err;             // message buffer (the caller's)
    size_t errlen;
    int rc;             // first error; TDM_OK while rendering
    int line;           // line of the statement being run, for errors
    int64_t iterations; // loop iterations so far (CHAT_MAX_ITERATIONS)
    int call_depth;
    uint64_t work;        // CHAT_MAX_WORK
    int loop_ctl;         // 1: break, 2: continue pending
    uintptr_t stack_base; // frame address where the render started
};

// Fails the render once its recursion has used CHAT_MAX_STACK bytes of C stack:
// renders run on HTTP worker threads, whose stacks are small (about 100 KiB).
bool chat_stack_ok(struct render *r);

int chat_rerr(struct render *r, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
bool chat_charge(struct render *r, uint64_t units); // false (and an error) past CHAT_MAX_WORK

struct val chat_v_undef(const char *name);
struct val chat_v_none(void);
struct val chat_v_bool(bool b);
struct val chat_v_int(int64_t i);
struct val chat_v_float(double f);
struct val chat_v_strn(const char *s, size_t n); // s must outlive the render
int chat_v_str_copy(struct render *r, const char *s, size_t n, struct val *out);
int chat_v_list_new(struct render *r, size_t cap, struct val *out);
int chat_v_list_push(struct render *r, struct vlist *l, struct val v);
int chat_v_dict_new(struct render *r, struct val *out);
int chat_v_dict_set(struct render *r, struct vdict *d, struct val key, struct val v);
bool chat_v_dict_get(const struct vdict *d, const char *key, size_t n, struct val *out);
bool chat_v_dict_find(const struct vdict *d, struct val key, struct val *out);

bool chat_v_truthy(struct val v);
bool chat_v_equal(struct val a, struct val b);
int chat_v_compare(struct render *r, struct val a, struct val b, int *cmp); // Python <
const char *chat_v_type_name(struct val v);
// Python str(v) appended to b (jinja's soft_str); TDM_EINVAL for values with no text.
int chat_v_to_text(struct render *r, struct val v, struct tdm_strbuf *b);
int chat_v_repr(struct render *r, struct val v, struct tdm_strbuf *b);
int chat_v_stringify(struct render *r, struct val v, struct val *out); // str(v) as a V_STR
void chat_py_float_repr(double f, char *buf, size_t n);
size_t chat_utf8_len(const char *s, size_t n); // code points; invalid bytes count one each
void chat_utf8_put(struct tdm_strbuf *b, uint32_t cp);
bool chat_py_isspace(uint32_t cp);
void chat_html_escape(struct tdm_strbuf *b, const char *s, size_t n);

// Takes a strbuf's bytes into the arena as a string value and resets the buffer.
int chat_sb_to_val(struct render *r, struct tdm_strbuf *b, struct val *out);

// ---- JSON --------------------------------------------------------------------------
int chat_json_to_val(struct render *r, const char *text, size_t len, const char *what,
                     struct val *out);
struct tojson_opts {
    int indent;             // -1: none
    const char *indent_str; // when indent is a string (NULL otherwise)
    const char *item_sep, *key_sep;
    bool sort_keys;
    bool ensure_ascii;
};
int chat_val_to_json(struct render *r, struct val v, const struct tojson_opts *o,
                     struct tdm_strbuf *b);

// ---- lexer -------------------------------------------------------------------------
enum tok_kind {
    T_EOF = 0,
    T_DATA,        // template text, whitespace control applied
    T_VAR_BEGIN,   // {{
    T_VAR_END,     // }}
    T_BLOCK_BEGIN, // {%
    T_BLOCK_END,   // %}
    T_NAME,
    T_STRING, // value decoded
    T_INT,
    T_FLOAT,
    T_OP, // text in op[]
};
struct token {
    enum tok_kind kind;
    int line;
    const char *s; // T_DATA/T_STRING/T_NAME: bytes (template arena); not NUL-terminated
    size_t n;
    char op[4];
    int64_t i;
    double f;
};
int chat_lex(struct arena *a, const char *src, struct token **toks, size_t *ntoks, char *err,
             size_t errlen);

// ---- AST ---------------------------------------------------------------------------
enum node_kind {
    // statements
    N_BODY,         // kids: statements
    N_TEXT,         // s
    N_OUTPUT,       // a: expression
    N_IF,           // a: cond, b: then (N_BODY), c: else (body or N_IF) or NULL
    N_FOR,          // targets in names; a: iterable, b: body, c: else, d: filter condition
    N_SET,          // names/ a: target (name or N_GETATTR on a namespace); b: value
    N_SET_BLOCK,    // s: name; b: body; d: filter chain applied (or NULL)
    N_MACRO,        // s: name; names: params; kids: defaults (or NULL per param); b: body
    N_CALL_BLOCK,   // a: the call; names: caller params; b: body
    N_FILTER_BLOCK, // d: filter chain (N_FILTER with a == NULL at the bottom); b: body
    N_BREAK,
    N_CONTINUE,
    // expressions
    N_CONST,   // v
    N_NAME,    // s
    N_GETATTR, // a . s
    N_GETITEM, // a [ b ]
    N_SLICE,   // a [ b : c : d ] (any of b c d may be NULL)
    N_CALL,    // a ( kids ) ; names[i] != NULL: keyword argument
    N_FILTER,  // s: filter name; a: input (NULL: the block's text); kids/names: args
    N_TEST,    // s: test name; a: input; kids/names: args; neg
    N_UNARY,   // s: "not" "-" "+"; a
    N_BINARY,  // s: operator; a b
    N_COMPARE, // a: first operand; kids: operands; names: operators (chained)
    N_COND,    // a if b else c
    N_LIST,    // kids
    N_TUPLE,   // kids
    N_DICT,    // kids: key, value, key, value...
};

struct node {
    enum node_kind kind;
    int line;
    const char *s;
    size_t sn;
    struct node *a, *b, *c, *d;
    struct node **kids; // [nkids]
    size_t nkids;
    const char **names; // [nnames] NUL-terminated strings; (N_CALL: per kid, NULL = positional)
    size_t nnames;
    bool neg;
    bool recursive;
    struct val v; // N_CONST
    int builtin;  // N_FILTER/N_TEST: index into the builtin tables
};

int chat_parse(struct arena *a, const struct token *toks, size_t ntoks, struct node **root,
               char *err, size_t errlen);

// ---- builtins ----------------------------------------------------------------------
int chat_builtin_filter_index(const char *name); // -1 when unknown
int chat_builtin_test_index(const char *name);
int chat_builtin_global(const char *name, struct val *out); // V_FUNC for known globals
// args[nargs] with names[nargs] (NULL: positional).
int chat_builtin_filter(struct render *r, int idx, struct val in, const struct val *args,
                        const char *const *names, size_t nargs, struct val *out);
int chat_builtin_test(struct render *r, int idx, struct val in, const struct val *args,
                      size_t nargs, bool *out);
int chat_builtin_call(struct render *r, struct val fn, const struct val *args,
                      const char *const *names, size_t nargs, struct val *out);
// Attribute lookup as Jinja's sandboxed getattr (methods first, then items).
int chat_get_attr(struct render *r, struct val obj, const char *name, size_t n, struct val *out);
int chat_get_item(struct render *r, struct val obj, struct val key, struct val *out);
// Python `needle in hay` (str: substring; list: ==; dict: key; Undefined: false).
int chat_v_contains(struct render *r, struct val hay, struct val needle, bool *out);
// Iteration: a list of the items `for` would see (dict: keys; str: characters).
int chat_v_iterate(struct render *r, struct val v, struct val *out_list);
// Macro invocation lives in chat_eval.c.
int chat_eval_macro_call(struct render *r, struct val macro, const struct val *args,
                         const char *const *names, size_t nargs, struct val *caller,
                         struct val *out);

// ---- evaluation --------------------------------------------------------------------
int chat_eval_render(struct render *r, const struct node *root);

#endif
