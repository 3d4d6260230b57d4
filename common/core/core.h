// SPDX-License-Identifier: Apache-2.0
// core: what every module shares. The error enum and its strerror, the log
// macros (which check the level before formatting anything), a monotonic clock,
// timed waits on condition variables over that clock, starting a detached
// thread, whole-file reading and the "fill err/errlen" helper used by
// slow-path APIs.
#ifndef TDM_CORE_H
#define TDM_CORE_H

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// ---- errors -------------------------------------------------------------------
enum tdm_err {
    TDM_OK = 0,
    TDM_ENOMEM,     // allocation failed
    TDM_EINVAL,     // bad argument or bad input
    TDM_ETIMEDOUT,  // deadline passed
    TDM_ECLOSED,    // object closed or shutting down
    TDM_EBUSY,      // try again later (queue full)
    TDM_EPROTO,     // peer or file broke the protocol/format
    TDM_ENOTFOUND,  // no such name (tensor, file, token)
    TDM_ECAPACITY,  // out of a fixed resource (KV blocks)
    TDM_EBACKEND,   // compute backend failure
    TDM_ETRANSPORT, // network transport failure
    TDM_EIO,        // file system error
};

// Returns a static, human-readable string for an enum tdm_err value.
const char *tdm_strerror(int err);

// Formats into err (if err != NULL and errlen > 0); always returns code, so a
// caller can write `return tdm_seterr(err, errlen, TDM_EINVAL, "...", ...)`.
int tdm_seterr(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

// ---- finish reason ----------------------------------------------------------------
// Why a sequence stopped: one enum from the engine through the wire
// (TokenChunk.finish, the same numbers) to the metrics' finished_reason label
// and the OpenAI finish_reason; the names are vLLM's.
enum tdm_finish {
    TDM_FINISH_NONE = 0, // still running (finish_reason null)
    TDM_FINISH_STOP,     // EOS, a stop token id (stop_token says which) or a stop string
    TDM_FINISH_LENGTH,   // max_tokens generated or the context (max_model_len) is full
    TDM_FINISH_ABORT,    // cancelled: abort, client gone, drain timeout or shutdown
    TDM_FINISH_ERROR,    // failed (an error code and message say why)
    TDM_FINISH_COUNT,    // the number of values (not a reason)
};
// "stop", "length", "abort", "error"; NULL for NONE and values out of range.
const char *tdm_finish_name(enum tdm_finish reason);

// ---- structured-output constraint kind ------------------------------------------
// What a request's constraint text is (issue 12; docs/structured-outputs.md):
// the same numbers travel in SamplingParams.constraint_kind. common/engine/grammar
// compiles (kind, text) into a grammar (tdm_grammar_compile_constraint).
enum tdm_constraint_kind {
    TDM_CONSTRAINT_NONE = 0,    // unconstrained
    TDM_CONSTRAINT_JSON_SCHEMA, // text: a JSON Schema
    TDM_CONSTRAINT_JSON_OBJECT, // any JSON object (text unused)
    TDM_CONSTRAINT_REGEX,       // text: a regex matched against the whole output
    TDM_CONSTRAINT_CHOICE,      // text: a JSON array of strings, exactly one of them
    TDM_CONSTRAINT_GRAMMAR,     // text: a GBNF grammar
    TDM_CONSTRAINT_COUNT,       // the number of values (not a kind)
};
// "json_schema", "json_object", "regex", "choice", "grammar"; NULL for NONE and
// values out of range.
const char *tdm_constraint_kind_name(enum tdm_constraint_kind kind);

// ---- logging ------------------------------------------------------------------
enum tdm_log_level { TDM_LOG_LEVEL_ERR = 0, TDM_LOG_LEVEL_WARN, TDM_LOG_LEVEL_INFO, TDM_LOG_LEVEL_DEBUG };

// Current threshold; messages above it are not formatted. Atomic because any
// thread may read it while main lowers it around a quiet startup phase and
// restores it (decode/main.c); the log macros read it relaxed (a level change
// may show up a few lines late, never as a torn value or a data race).
extern _Atomic int tdm_log_level;

// Sets the role printed on every line ("router", "decode", ...); the string must
// outlive all logging. Sets the level from a name ("err","warn","info","debug");
// returns TDM_EINVAL for an unknown name.
void tdm_log_set_role(const char *role);
int tdm_log_set_level_name(const char *name);
// Whether tdm_log_set_level_name would accept name, without setting it: TDM_OK,
// or TDM_EINVAL with "--log-level: expected err, warn, info or debug, got ..."
// (a flag table's check for --log-level).
int tdm_log_check_level_name(const char *name, char *err, size_t errlen);

// One line to stderr: `ts level role module msg`, or the message to the
// sink when one is set.
void tdm_log_write(int level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
// Where tdm_log_write's messages go instead of stderr (NULL: stderr). A
// device module (backend_module.h) has its own copy of core: its init points
// that copy's sink at the binary's tdm_log_emit, so the module's lines carry
// the binary's role and obey its level.
void tdm_log_set_sink(void (*sink)(int level, const char *module, const char *msg));
// One formatted message as tdm_log_write writes it, when `level` passes the
// current threshold.
void tdm_log_emit(int level, const char *module, const char *msg);

#define TDM_LOG_(lvl, module, ...)                                                                 \
    do {                                                                                           \
        if ((lvl) <= atomic_load_explicit(&tdm_log_level, memory_order_relaxed))                  \
            tdm_log_write((lvl), (module), __VA_ARGS__);                                           \
    } while (0)
#define TDM_LOG_ERR(module, ...) TDM_LOG_(TDM_LOG_LEVEL_ERR, module, __VA_ARGS__)
#define TDM_LOG_WARN(module, ...) TDM_LOG_(TDM_LOG_LEVEL_WARN, module, __VA_ARGS__)
#define TDM_LOG_INFO(module, ...) TDM_LOG_(TDM_LOG_LEVEL_INFO, module, __VA_ARGS__)
#define TDM_LOG_DEBUG(module, ...) TDM_LOG_(TDM_LOG_LEVEL_DEBUG, module, __VA_ARGS__)

// ---- assertions (on in release builds; only for our own bugs) -------------------
void tdm_panic(const char *file, int line, const char *what) __attribute__((noreturn));
#define TDM_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            tdm_panic(__FILE__, __LINE__, #cond);                                                  \
    } while (0)

// ---- random numbers -----------------------------------------------------------------
// xoshiro256** seeded through splitmix64: small, fast and of good quality. A
// seed gives the same sequence on every machine (sampling seeds, benchmarks).
struct tdm_rng {
    uint64_t s[4];
};
void tdm_rng_seed(struct tdm_rng *r, uint64_t seed);
uint64_t tdm_rng_next(struct tdm_rng *r);
// Uniform in [0, 1) with 53 random bits.
double tdm_rng_uniform(struct tdm_rng *r);
// One splitmix64 step over *x (also a good 64-bit mixer).
uint64_t tdm_splitmix64(uint64_t *x);
// The 64-bit hashing steps the block hash (common/engine/kv) and the weight cache's
// checksum (common/engine/model) share: a left rotation by r (0 < r < 64), and
// murmur3's fmix64 avalanche. Their outputs are part of the block hashes the
// router mirrors and of the cached weight files' checksums: never change them.
static inline uint64_t tdm_rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}
static inline uint64_t tdm_fmix64(uint64_t h)
{
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

// ---- time and files -----------------------------------------------------------------
// Monotonic seconds (CLOCK_MONOTONIC).
double tdm_now(void);
// Wall-clock seconds since the epoch.
double tdm_wall_now(void);
// Sleeps about `seconds` (a short poll interval; interrupted sleeps resume).
void tdm_sleep(double seconds);

// Reads a whole file into a NUL-terminated heap buffer (*out, caller frees; *len
// excludes the NUL). Returns TDM_ENOTFOUND if it does not exist, TDM_EIO otherwise.
int tdm_read_file(const char *path, char **out, size_t *len, char *err, size_t errlen);

// ---- timed waits on the monotonic clock ------------------------------------------
// A condition variable whose timed waits run on CLOCK_MONOTONIC (the clock of
// tdm_now), so a step of the wall clock neither cuts a wait short nor
// stretches it. Every condition variable that is waited on with a timeout is
// made here. TDM_OK, or TDM_ENOMEM when pthread refuses.
int tdm_cond_init(pthread_cond_t *cv);
// Waits on cv (from tdm_cond_init; mu held, as for pthread_cond_wait) until it
// is signalled or tdm_now() reaches deadline (< 0: no deadline). Returns false
// when the deadline passed, true otherwise; wakeups may be spurious, so callers
// re-check their condition in a loop.
bool tdm_cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, double deadline);
// Same for at most seconds from now (a deadline of tdm_now() + seconds).
bool tdm_cond_wait_for(pthread_cond_t *cv, pthread_mutex_t *mu, double seconds);

// ---- threads -----------------------------------------------------------------------------
// Starts fn(arg) on a detached thread (nobody joins it: fn frees what it
// owns): one that finished earlier work and waits for more (up to 64 wait,
// each at most 30 s), else a new one. TDM_OK, or TDM_EBUSY when no thread
// could be started (pthread_create's EAGAIN: the process or user is out of
// threads, or of memory for a stack); arg then stays the caller's, which
// fails or retries that one piece of work (a frame handler must never run it
// inline instead: it would stop reading its connection for that long).
int tdm_thread_start_detached(void *(*fn)(void *), void *arg);
// Threads of tdm_thread_start_detached waiting for work now (for tests).
int tdm_thread_idle(void);

// A deep call: fn(arg) on a thread of TDM_DEEP_STACK_BYTES of stack, the
// caller waiting until it returns. Every recursive parser or compiler that a
// request's bytes reach (regex, JSON Schema, GBNF, the chat template renderer)
// is entered through it, because the thread a request arrives on may have far
// less: libcivetweb's workers have 100 KiB, shared with the static TLS of
// every loaded library, and leave a handler TDM_HTTP_HANDLER_STACK_BYTES
// (http.h). Each such parser's depth bound holds on this stack, not the
// caller's; openai_deep_test runs each past its bound from a thread with
// only the handler's stack.
// The deep threads are reused as tdm_thread_start_detached's are. TDM_OK once
// fn has returned; TDM_EBUSY (fn not run) when no thread could be started. On a
// deep thread already, fn runs at once.
#define TDM_DEEP_STACK_BYTES (8u << 20)
int tdm_call_deep(void (*fn)(void *), void *arg);
// pthread_create of a joinable thread with a TDM_DEEP_STACK_BYTES stack, for
// threads that run such parsers or the grammar matcher (whose expansion
// recurses per rule reference, up to its bound) themselves: the engine's step
// and mask threads. TDM_OK, or TDM_EBUSY when pthread refuses.
int tdm_thread_create_deep(pthread_t *th, void *(*fn)(void *), void *arg);

// ---- command-line flags (core_flags.c) ------------------------------------------
// One table per program (or per part of one) maps each flag to a field of an
// options struct, so parsing, range checks, error messages and --help come
// from one place and every binary behaves the same: "--name VALUE" or
// "--name=VALUE" ('_' in a name matches '-'), a boolean without a value,
// -h/--help (the caller prints tdm_flags_help and exits 0), and a one-line
// error (TDM_EINVAL, err filled) for an unknown flag, a missing or bad value or
// a stray argument. The same table can set a flag by name from a config file
// (tdm_flags_set). Tables are static const data; parsing writes only opts.
enum tdm_flag_kind {
    TDM_FLAG_STR,    // char[size] at offset: a copy of the value
    TDM_FLAG_PTR,    // const char * at offset: points at the value (in argv)
    TDM_FLAG_INT,    // int at offset: a base-10 integer in [min, max]
    TDM_FLAG_HINT,   // int at offset: as INT, also with vLLM's human-readable suffixes
                     // (tdm_parse_human_int: 4k = 4000, 32K = 32768)
    TDM_FLAG_DOUBLE, // double at offset: a number in [min, max]
    TDM_FLAG_FLOAT,  // float at offset: a number in [min, max]
    TDM_FLAG_BYTES,  // size_t at offset: a byte size ("2GiB", "512MiB", "4096") in [min, max]
    TDM_FLAG_BOOL,   // bool at offset: no value = true, else true/false/1/0/yes/no
    TDM_FLAG_NOT,    // bool at offset, inverted ("--no-x"): no value = false
    TDM_FLAG_FN,     // fn(opts, value, err, errlen); value NULL when no_value
};

struct tdm_flag {
    const char *name;    // without the dashes: "max-num-seqs"
    enum tdm_flag_kind kind;
    size_t offset;       // offsetof(options struct, field); unused by FN
    size_t size;         // STR: sizeof the field (the value must be shorter)
    double min, max;     // INT, DOUBLE, FLOAT, BYTES: the accepted range
    const char *metavar; // the value's name in --help ("N", "DIR"); NULL = none shown
    const char *help;    // --help text; '\n' continues it on the next line
    int (*fn)(void *opts, const char *value, char *err, size_t errlen); // FN only
    bool no_value;       // FN: the flag takes no value
    bool empty_ok;       // STR, PTR: "" is accepted (else "expected a non-empty value")
    bool hidden;         // not listed by tdm_flags_help (another spelling of a listed flag)
    // STR, PTR: checks the value before it is kept; TDM_OK, or an error whose
    // message names the flag ("--log-level: expected ..."). NULL = any value.
    int (*check)(const char *value, char *err, size_t errlen);
};

// A table entry for field of the options struct T: name, kind, offset and size
// filled in; the rest (.metavar, .help, .min, .max, ...) given after field.
#define TDM_FLAG_FIELD(T, n, k, field, ...)                                                        \
    {.name = (n),                                                                                  \
     .kind = (k),                                                                                  \
     .offset = offsetof(T, field),                                                                 \
     .size = sizeof(((T *)0)->field),                                                              \
     __VA_ARGS__}

struct tdm_flags {
    const char *usage;            // --help's first lines, each ending in '\n'
    const struct tdm_flag *flags; // [n]
    size_t n;
    const char *footer;           // printed after the table (NULL = none)
};

// Sets flag name (with or without "--"; '_' matches '-') from value (NULL =
// given without one). TDM_EINVAL with "unknown option \"--name\"" or the flag's
// own message ("--port: expected an integer in [0, 65535], got \"x\"").
int tdm_flags_set(const struct tdm_flags *t, void *opts, const char *name, const char *value,
                  char *err, size_t errlen);
// Parses argv[1..argc) into opts. Bare arguments go to rest[0..max_rest) in
// order (*n_rest their count; rest may be NULL when none are allowed), more
// than max_rest is an error. Returns TDM_OK, 1 for -h/--help (anywhere), or
// TDM_EINVAL with a one-line message in err.
int tdm_flags_parse(const struct tdm_flags *t, void *opts, int argc, char **argv, char **rest,
                    int max_rest, int *n_rest, char *err, size_t errlen);
// Takes the flags of t (with their values) out of argv, applying them to opts,
// and keeps the rest in order (argv[*argc] = NULL): for a program whose flags
// come from several tables. TDM_OK or TDM_EINVAL ("--name: missing value", a
// bad value); -h/--help and unknown flags are left for the main table.
int tdm_flags_take(const struct tdm_flags *t, void *opts, int *argc, char **argv, char *err,
                   size_t errlen);
// Writes t's usage, one line per flag ("  --name METAVAR" padded, then its
// help), and its footer to f.
void tdm_flags_help(const struct tdm_flags *t, FILE *f);
// A main's whole argv step: tdm_flags_parse, then on --help the help on stdout
// (exit 0), on an error "prog: <message> (see --help)" on stderr (exit 2).
// Returns true when main should return *exit_code now.
bool tdm_flags_main(const struct tdm_flags *t, void *opts, int argc, char **argv, char **rest,
                    int max_rest, int *n_rest, const char *prog, int *exit_code);
// Parses an integer as vLLM's human_readable_int does (--max-model-len 4k):
// digits, or digits with a decimal suffix k/m/g (x 1e3/1e6/1e9, a fraction
// allowed: 25.6k = 25600) or a binary one K/M/G (x 2^10/2^20/2^30, whole numbers
// only). TDM_OK, or TDM_EINVAL with the reason in err (a fraction with a binary
// suffix names the decimal one: "did you mean 25.6k?").
int tdm_parse_human_int(const char *text, long long *out, char *err, size_t errlen);
// Parses a flag's boolean value as TDM_FLAG_BOOL does: true, True, 1, yes /
// false, False, 0, no. TDM_OK or TDM_EINVAL (*out untouched).
int tdm_parse_bool(const char *v, bool *out);
// Parses a byte size: digits with an optional fraction and a unit B, K/KiB/k,
// KB, M/MiB, MB, G/GiB, GB, T/TiB, TB (binary unless it ends in "B" after a
// decimal prefix). TDM_OK or TDM_EINVAL (not a whole number of bytes).
int tdm_parse_bytes(const char *text, size_t *out);

// Joins dir and name with one '/' into a heap string (caller frees); NULL on ENOMEM.
char *tdm_path_join(const char *dir, const char *name);
// mkdir -p (mode 0755) of the folder part of path (everything before the last
// '/') when parent_only, else of path itself. TDM_OK, TDM_EIO or TDM_ENOMEM.
int tdm_mkdir_p(const char *path, bool parent_only, char *err, size_t errlen);

// ---- growable text buffer (core.c) -----------------------------------------------------
// Bytes that grow by doubling, NUL-terminated once anything was reserved or
// added. Zeroed storage is an empty buffer. A failed allocation makes the
// buffer failed for good: later adds do nothing and return TDM_ENOMEM, so a
// writer of many pieces may check once at the end (b->failed). With a limit,
// an add that would take the buffer past it is dropped and makes the buffer
// over for good (later adds return TDM_ECAPACITY): the chat template's output
// bounds.
struct tdm_strbuf {
    char *p;      // [cap] heap bytes, p[len] == '\0'; NULL until the first reserve/add
    size_t len;   // bytes written, the NUL not counted
    size_t cap;   // bytes allocated
    bool failed;  // an allocation failed
    size_t limit; // 0: none; else len never exceeds it
    bool over;    // an add was dropped for the limit
};
// Room for `more` bytes after len (and the NUL). TDM_OK, TDM_ENOMEM or TDM_ECAPACITY.
int tdm_strbuf_reserve(struct tdm_strbuf *b, size_t more);
// Appends n bytes of s (n may be 0: the buffer then exists, ""). TDM_OK,
// TDM_ENOMEM or TDM_ECAPACITY (nothing appended).
int tdm_strbuf_add(struct tdm_strbuf *b, const void *s, size_t n);
// Appends the string s, or the byte c.
int tdm_strbuf_adds(struct tdm_strbuf *b, const char *s);
int tdm_strbuf_addc(struct tdm_strbuf *b, char c);
// Appends s[0..n) as a JSON string literal, the one escaper of the project:
// '"' and '\\' escaped, \b \f \n \r \t, other bytes below 0x20 as \u00xx
// (lowercase hex, as cJSON and Python's json print them); other bytes as they
// are, or with ascii (Python's ensure_ascii) every code point above 0x7E as
// \uxxxx (a surrogate pair above 0xFFFF; a byte that starts no valid UTF-8
// sequence as \ufffd).
int tdm_strbuf_add_json_string(struct tdm_strbuf *b, const char *s, size_t n, bool ascii);
// Frees the bytes and zeroes the buffer (reusable; a NULL b is harmless).
void tdm_strbuf_fini(struct tdm_strbuf *b);

// ---- growable arrays (core.c) ------------------------------------------------------------
// Room for need elements of elem bytes in a heap array: pp is the address of
// the array's pointer (&s->items, any element type; NULL while empty), *cap its
// capacity in elements. When need > *cap the array is reallocated to *cap
// (first while empty) doubled until need fits. TDM_OK, or
// TDM_ENOMEM when the byte size would overflow or realloc fails (the array and
// *cap are then unchanged and still valid). Inline when there is room (hot
// loops push through it); tdm_grow_realloc does the growing.
int tdm_grow_realloc(void *pp, size_t *cap, size_t need, size_t elem, size_t first);
static inline int tdm_grow(void *pp, size_t *cap, size_t need, size_t elem, size_t first)
{
    return need <= *cap ? TDM_OK : tdm_grow_realloc(pp, cap, need, elem, first);
}

// ---- UTF-8 (core.c) ------------------------------------------------------------------------
// Writes code point cp (< 0x200000) as 1-4 UTF-8 bytes to out; returns how many.
// Callers that take text from outside check the range (<= 0x10FFFF, no
// surrogates) first; this only encodes.
int tdm_utf8_encode(uint32_t cp, char out[4]);
// Decodes the code point at s[i] (i < n) into *cp and returns its length in
// bytes; a byte that starts no complete sequence decodes as U+FFFD, length 1.
// Overlong forms and surrogates are not checked (the chat template's strings
// count characters this way, as its tests pin).
size_t tdm_utf8_next(const char *s, size_t n, size_t i, uint32_t *cp);

// ---- JSON nesting -------------------------------------------------------------------
// The deepest array/object nesting accepted in any JSON text (request bodies,
// config and model files, Hub answers). cJSON recurses about three frames per
// level on the calling thread's stack; 128 levels take ~20 KiB, well inside
// the ~100 KiB stacks of civetweb's worker threads (the old crash was at ~600).
#define TDM_JSON_MAX_DEPTH 128

// Scans text[0..len) without parsing (string contents and escapes skipped):
// TDM_OK when no array or object nests deeper than max_depth, else TDM_EINVAL
// with err "JSON nests deeper than N levels (at byte B)". Call it before
// cJSON_Parse* on any text that came from outside the process.
int tdm_json_check_depth(const char *text, size_t len, int max_depth, char *err, size_t errlen);

// tdm_json_check_depth that also gives, in the same scan, *values: how many
// values cJSON builds for the text (the root, every array element and every
// object member), for its memory: about TDM_JSON_NODE_BYTES each.
int tdm_json_check_depth_count(const char *text, size_t len, int max_depth, size_t *values,
                               char *err, size_t errlen);
#define TDM_JSON_NODE_BYTES 80 // a cJSON node (64 bytes) and its allocation's header

// True when a string in the JSON text holds a \u0000 escape (or a raw NUL):
// cJSON's strings end there, so the rest would be silently dropped.
bool tdm_json_has_nul_escape(const char *text, size_t len);

// ---- SHA-256 and HMAC-SHA256 (FIPS 180-4, RFC 2104) ---------------------------------------
// Streaming SHA-256 (LFS download checks in hub, the control plane's
// connection handshake in transport).
struct tdm_sha256 {
    uint32_t h[8];
    uint64_t total;          // bytes hashed so far
    unsigned char block[64]; // pending partial block
    size_t fill;             // bytes in block
};
void tdm_sha256_init(struct tdm_sha256 *s);
void tdm_sha256_update(struct tdm_sha256 *s, const void *data, size_t len);
void tdm_sha256_final(struct tdm_sha256 *s, unsigned char out[32]);
// Hashes a whole file; hex gets 64 lowercase hex digits + NUL. TDM_EIO on errors.
int tdm_sha256_file(const char *path, char hex[65], char *err, size_t errlen);
// out = HMAC-SHA256(key, msg); any key length.
void tdm_hmac_sha256(const void *key, size_t key_len, const void *msg, size_t msg_len,
                     unsigned char out[32]);
// Compares n bytes in time independent of where they differ (MAC checks).
bool tdm_ct_equal(const void *a, const void *b, size_t n);

#endif
