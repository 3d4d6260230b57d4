// SPDX-License-Identifier: Apache-2.0
// engine: the serving engine. One engine thread owns a loaded model (borrowed),
// the paged KV cache (owned), every request's sampler and the scheduler state,
// and runs continuous batching the way vLLM v1 does: each step gives running
// decodes one token each, continues partially prefilled prompts, then admits
// waiting requests first come first served, within a token budget
// (max_num_batched_tokens) and a sequence limit (max_num_seqs); long prompts
// are prefilled in chunks. When a running request cannot get a KV block, the
// most recently admitted one is preempted by recompute. docs/engine-scheduler.md
// describes the thread model, the request lifecycle and the metric definitions.
//
// Threads: every function here except tdm_engine_new/tdm_engine_free is safe to
// call from any thread. Other threads never touch the model or the cache; they
// submit, abort and read outputs through the engine's queues.
//
// Request lifetime: tdm_engine_submit returns a handle with two references, the
// caller's and the engine's. The engine drops its reference after it delivered
// the request's final output (and released any KV it held for the caller); the
// caller drops its own with tdm_engine_request_release at any time (before the
// finish too: the request keeps running unless aborted). The handle stays valid
// while the caller holds its reference.
#ifndef TDM_ENGINE_H
#define TDM_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h" // enum tdm_finish
#include "kv_cache.h"
#include "metrics.h"
#include "model.h"
#include "sampling.h"
#include "spec.h"

struct tdm_engine;
struct tdm_engine_request;
struct tdm_grammar;
struct tdm_grammar_vocab;

// A request's cache_salt, at most (the API's bound too: it travels on the P/D wire).
#define TDM_ENGINE_CACHE_SALT_MAX 1024

// ---- configuration -------------------------------------------------------------------
struct tdm_engine_config {
    int block_size;                   // KV tokens per block; default 16
    int num_blocks;                   // KV pool size in blocks; 0 = from kv_memory_bytes
    size_t kv_memory_bytes;           // pool budget when num_blocks == 0; default 256 MiB
    bool enable_prefix_caching;       // default true
    enum tdm_kv_dtype kv_dtype;       // KV pool element type; default f32 (the exact
                                      // reference; the workers' --kv-cache-dtype auto is bf16)
    int max_num_batched_tokens;       // token budget of one step; default 2048, capped by the
                                      // model's max_batch_tokens (its activation workspace)
    int max_num_seqs;                 // running requests at most; default 64, capped by the
                                      // model's max_batch_seqs and max_num_batched_tokens
    int max_model_len;                // prompt + generated tokens; 0 = the model's context
    int max_waiting;                  // bounded waiting queue: submit returns TDM_EBUSY when this
                                      // many requests wait; default 1024
    int prompt_logprob_rows;          // prompt rows a step computes with their logits for
                                      // requests asking prompt logprobs (their chunks), kept
                                      // on the host at the first such request; 0 = as many
                                      // as 128 MiB hold (220 for a 151 936 vocabulary), at
                                      // least 32; capped by max_num_batched_tokens
    struct tdm_metrics_vllm *metrics; // vLLM metric handles to update; NULL = none
    // tandem:num_prompt_tokens_waiting (stats.num_prompt_tokens_waiting) to
    // update; NULL = none
    struct tdm_metrics_gauge *prompt_tokens_waiting;
    // tandem:engine_steps_ahead_total and tandem:engine_list_rows_total
    // (stats.num_async_steps, stats.num_device_list_rows) to advance with the
    // stats; NULL = none
    struct tdm_metrics_counter *steps_ahead;
    struct tdm_metrics_counter *list_rows;
    // tandem:engine_thread_seconds_total{phase} (stats.phase_seconds): a
    // counter family with the one variable label "phase"; NULL = none
    struct tdm_metrics_counter *thread_seconds;
    int kv_event_capacity;            // > 0: record KV events (tdm_engine_take_kv_events) in
                                      // buffers of this many events; default 0 = off
    // Structured outputs: the tokenizer's token trie (tdm_grammar_vocab_from_tokenizer),
    // borrowed, must outlive the engine. NULL: constrained requests are refused.
    const struct tdm_grammar_vocab *grammar_vocab;
    int mask_threads; // threads filling a step's masks beside the forward (started at the first
                      // constrained step); 0 = a quarter of the online cores, 1 to 4
    // Speculative decoding by n-gram prompt lookup (vLLM's --speculative-config
    // method "ngram"; docs/speculative-decoding.md): num_speculative_tokens 0 =
    // off (default). Resolved with tdm_spec_config_resolve at creation (a bad
    // one is TDM_EINVAL). Output is unchanged by it: greedy and seeded requests
    // produce the same tokens with and without it. Constrained requests do not
    // speculate.
    struct tdm_spec_config spec;
    struct tdm_metrics_spec *spec_metrics; // vLLM's spec_decode counters to update; NULL = none
    // On a device backend rows are drawn where their logits are (the
    // sampler's own draw: the same tokens); true keeps every row's sampling on
    // the host, as before it (tests compare the two, benches measure the
    // difference). Default false.
    bool host_sampling;
    // Async scheduling (vLLM's --async-scheduling; issue 26 item 1), on a
    // backend whose forwards run behind the host (a device's): while a step
    // is on the device, the engine thread builds and issues the next one,
    // each decode row one position further with the token the device chose
    // for it (tdm_model_forward_issue, from_prev), prompts' next chunks, and
    // requests admitted meanwhile, then takes the first step's tokens. A
    // step goes ahead only when every row of the one in flight may: a prompt
    // chunk with more to come, or a row whose token is chosen on the device
    // (greedy or sampled; a repetition, presence or frequency penalty's part
    // of the token before it is merged into the draw on the device; a
    // structured-output mask computed once that token is taken, while the
    // layers run), no speculative decoding, no push hook, and room for
    // another token; and only while no abort or control is pending and no KV
    // block is missing. A row whose request finished by the token before it
    // is discarded. Output is the same either way. true turns it off: every
    // step waits for its tokens before the next is scheduled.
    bool sync_scheduling;
    // vLLM's --scheduling-policy priority: the waiting queue runs in order of
    // (priority, arrival), the lowest first (a request that arrives with a
    // lower value goes ahead of those waiting, never ahead of running ones),
    // and when a running request needs a KV block that is not free, the
    // running request of the highest (priority, arrival) is preempted (fcfs:
    // the one admitted last), and waits in that order again. false (fcfs,
    // the default): a request's priority must be 0 (TDM_EINVAL, vLLM's "Got
    // priority N but Priority scheduling is not enabled.").
    bool priority_scheduling;
};
// Fills the defaults above.
void tdm_engine_config_default(struct tdm_engine_config *cfg);

// Creates the KV cache from cfg and the model's geometry and starts the engine
// thread. model must outlive the engine and is used by no other thread
// meanwhile. cfg may be NULL (defaults). TDM_EINVAL (err names the field) for a
// bad config, TDM_ENOMEM, or the KV cache's error.
int tdm_engine_new(struct tdm_engine **out, struct tdm_model *model,
                   const struct tdm_engine_config *cfg, char *err, size_t errlen);
// Stops accepting requests, aborts every unfinished one (each still gets its
// final output; importing ones too, so stop importers first), releases held KV,
// joins the thread and frees the engine and its cache. Request handles the caller still holds stay
// valid (release them afterwards). Accepts NULL.
void tdm_engine_free(struct tdm_engine *e);
// Stops accepting requests (submit returns TDM_ECLOSED from now on) and waits up
// to timeout_s seconds (< 0: no limit) for running and waiting requests to
// finish; the rest are then aborted and the call waits until they got their
// final output. Returns TDM_OK when all finished on their own, TDM_ETIMEDOUT
// when some were aborted. The engine thread keeps running (for held KV) until
// tdm_engine_free.
int tdm_engine_drain(struct tdm_engine *e, double timeout_s);

// KV events (common/engine/kv: STORED / EVICTED block hashes of the prefix cache) when
// cfg.kv_event_capacity > 0: the engine thread moves them after every step into
// a buffer any thread can take from. Moves up to cap of the oldest into out and
// returns how many (0 when off). *overflow (may be NULL) is true when events
// were lost since the previous take (the KV cache's ring or this buffer was
// full): the consumer must forget what it knows of this cache, then apply out.
int tdm_engine_take_kv_events(struct tdm_engine *e, struct tdm_kv_event *out, int cap,
                              bool *overflow);

// The effective limits after defaults and caps.
const struct tdm_engine_config *tdm_engine_get_config(const struct tdm_engine *e);
// The engine's KV cache (borrowed; the engine thread owns its bookkeeping):
// for reading its storage's device pool description (P/D device transfers).
struct tdm_kv_cache *tdm_engine_kv(struct tdm_engine *e);

// ---- requests ------------------------------------------------------------------------

enum tdm_engine_kind {
    TDM_ENGINE_REQ_GENERATE = 0, // normal request: prefill, then decode until it finishes
    TDM_ENGINE_REQ_PREFILL_ONLY, // P/D prefill worker: computes the prompt's KV, samples the
                                 // first token, finishes (stop/length as usual) and keeps its
                                 // KV blocks until tdm_engine_release_kv (see below)
    TDM_ENGINE_REQ_IMPORT_KV,    // P/D decode worker: the prompt's KV comes from a prefill
                                 // worker; the engine reserves blocks, the caller imports and
                                 // hands over the first token sampled there
                                 // (tdm_engine_import_done), then it decodes on
};

struct tdm_engine_output;
// Called ON THE ENGINE THREAD for each new token and for the finish; it must be
// cheap (copy what it needs, push to the caller's queue, signal) and must not
// call back into the engine except tdm_engine_abort / tdm_engine_release_kv.
typedef void (*tdm_engine_output_fn)(void *ctx, const struct tdm_engine_output *out);
// PREFILL_ONLY push hook: called ON THE ENGINE THREAD during the forward step
// that computes the final chunk of r's prompt, once per layer in order (0 ..
// num_layers-1), right after that layer's KV was written. From then on the
// layer's KV of the whole prompt is final and tdm_engine_export_layer may copy
// it from any thread while the engine computes the later layers (earlier
// chunks' layers become exportable with it). Runs inside the forward: it must
// be cheap and never block (signal a sender thread); it may call
// tdm_engine_export_layer itself, at the cost of the copy on the engine thread.
typedef void (*tdm_engine_layer_fn)(void *ctx, struct tdm_engine_request *r, int layer);

struct tdm_engine_request_params {
    const char *id;                      // for logs (copied, truncated to 63 bytes); NULL = "-"
    const int32_t *prompt;               // [n_prompt] token ids (copied)
    int n_prompt;                        // 1 .. max_model_len - 1
    struct tdm_sampling_params sampling; // temperature, seed, min_tokens, ignore_eos,
                                         // stop_token_ids, logprobs, ...
    int n_resume;           // the last n_resume ids of prompt are output a client already
                            // has (a stream resumed here after its worker was lost): the
                            // sampler counts them as generated (tdm_sampler_replay), so
                            // the continuation is the uninterrupted run's. 0 .. n_prompt-1
    // Prompt logprobs (vLLM's prompt_logprobs; completions echo + logprobs):
    // the logprob and rank of every prompt token given the ones before it,
    // and the top prompt_top_logprobs (0..TDM_MAX_LOGPROBS) alternatives,
    // from the raw logits (struct tdm_prompt_logprobs), delivered with the
    // first token. GENERATE requests without n_resume only. Every prompt row
    // is then computed with its logits (no prefix-cache hit), at most
    // cfg.prompt_logprob_rows such rows a step across requests.
    bool want_prompt_logprobs;
    int prompt_top_logprobs;
    int max_tokens;         // tokens to generate at most; 0 = up to the context. Generation
                            // also ends (length) when prompt + output reach max_model_len.
    const int32_t *eos_ids; // [num_eos] EOS ids; NULL = the model's config.json ones
    int num_eos;
    double arrival_time; // tdm_now() when the request arrived; 0 = at submit
    int priority;        // cfg.priority_scheduling: lower is served first; else must be 0
    const char *cache_salt; // vLLM's cache_salt (NULL or "" = none; at most
                            // TDM_ENGINE_CACHE_SALT_MAX bytes): the request's KV blocks
                            // are cached under tdm_kv_salt_hash of it, so prefix hits come
                            // only from requests with the same salt (docs/kv-cache.md)
    int params_n;        // the API request's n (this is one of its n sequences), for
                         // vllm:request_params_n; 0 = 1
    int params_index;    // which of the n sequences this is (0 .. n-1): only sequence 0
                         // observes vllm:request_params_n, so it counts API requests
    enum tdm_engine_kind kind;
    tdm_engine_output_fn on_output; // optional; the ready-made stream works either way
    void *ctx;                      // for on_output; must stay valid until the final output
    tdm_engine_layer_fn on_layer;   // PREFILL_ONLY only (TDM_EINVAL otherwise), optional: the
                                    // push hook above; NULL = export after the finish only
    void *layer_ctx;                // for on_layer; must stay valid until the final output
    // Structured output: sampling.constraint (kind, text) is compiled at submit
    // (tdm_grammar_compile_cached; a bad one is TDM_EINVAL with the grammar
    // engine's message), or `grammar`, when set, is used as is (the engine takes
    // its own reference; sampling.constraint is then ignored). Either needs
    // cfg.grammar_vocab. Each step's logits are masked to the tokens the
    // grammar allows (masks computed on a helper thread while the forward
    // runs); EOS and stop ids only where the output so far is complete. Where
    // nothing but them can follow, the next step samples one (the only tokens
    // left), so, as in vLLM, the ending token is generated and counted and the
    // request finishes STOP on it (LENGTH if max_tokens came first); only
    // where that draw could not end the request (ignore_eos, min_tokens not
    // reached) does it finish STOP at once, with no ending token (stop_token
    // -1). LENGTH at max_tokens mid-way.
    // An IMPORT_KV request's first token advances the grammar like a sampled
    // one, so a decode worker continues where its prefill worker began.
    struct tdm_grammar *grammar;
};
// Zeroes p and fills vLLM's default sampling params (tdm_sampling_params_default).
void tdm_engine_request_params_default(struct tdm_engine_request_params *p);

// One event of one request, as on_output sees it. Pointers are valid during the
// callback only.
struct tdm_engine_output {
    struct tdm_engine_request *request;
    const char *id;
    int index;     // index of token among the generated tokens; -1: no new token
    int32_t token; // the new token, -1 when none (finish-only output)
    float logprob; // chosen token's logprob when logprobs >= 0, else 0
    int num_top;   // top-N entries (sampling.logprobs when > 0)
    const struct tdm_token_logprob *top; // [num_top]
    // index 0 of a request with want_prompt_logprobs: its prompt's (valid
    // while the handle is held), else NULL
    const struct tdm_prompt_logprobs *prompt_logprobs;
    int num_prompt_tokens;
    int num_cached_tokens; // prompt tokens served by the prefix cache at first admission
    int num_generated;     // generated tokens so far, this one included
    // The finish (exactly one output per request has finished = true; it carries the
    // last token when a token ended the request).
    bool finished;
    enum tdm_finish reason;
    int32_t stop_token;  // the EOS/stop id for STOP by token, else -1
    int error;           // enum tdm_err for ERROR
    const char *message; // why, for ERROR and ABORT ("" otherwise)
    bool kv_held;        // PREFILL_ONLY: the KV stays pinned for export
};

// Admission of a group before any of it is submitted (n choices x prompts of
// one API request, issue 11): TDM_EINVAL when count exceeds the waiting-queue
// bound itself (it could never be admitted: err names the bound), TDM_EBUSY
// when the queue has not room for all count now, else TDM_OK. It reserves
// nothing: a racing submit can still fill the queue between this and the
// submits, which then fail as usual.
int tdm_engine_admit(struct tdm_engine *e, int count, char *err, size_t errlen);

// Validates and enqueues a request. On success *out is the caller's handle (see
// "Request lifetime" above). TDM_EINVAL (err says why) for an empty or too long
// prompt (> max_model_len - 1), a token outside the vocabulary, bad sampling
// params or a negative max_tokens; TDM_EBUSY when the waiting queue is full;
// TDM_ECLOSED after drain/free began; TDM_ENOMEM.
int tdm_engine_submit(struct tdm_engine *e, const struct tdm_engine_request_params *p,
                      struct tdm_engine_request **out, char *err, size_t errlen);
// Drops the caller's reference. Accepts NULL.
void tdm_engine_request_release(struct tdm_engine_request *r);
const char *tdm_engine_request_id(const struct tdm_engine_request *r);

// A request's phase times on the tdm_now() clock (0 where the phase did not
// happen), the ones vLLM's metrics and traces use: queue = arrival ->
// first_scheduled (admitted, blocks reserved), prefill = first_scheduled ->
// first_token, decode = first_token -> last_token. Read only after the finish
// was returned by tdm_engine_stream_next (the engine thread writes them).
struct tdm_engine_times {
    double arrival;
    double first_scheduled;
    double first_token;
    double last_token;
};
void tdm_engine_request_times(const struct tdm_engine_request *r, struct tdm_engine_times *out);

// Finishes the request with reason (ABORT, or STOP when the API layer matched a
// stop string, or LENGTH) at the engine's next step, which comes promptly even
// when idle; its KV is released then. A finished request is left alone (TDM_OK).
// A held PREFILL_ONLY request gets its KV released. TDM_EINVAL for another reason.
int tdm_engine_abort(struct tdm_engine *e, struct tdm_engine_request *r,
                     enum tdm_finish reason);

// ---- the ready-made output stream (for HTTP threads) ---------------------------------
// New outputs of one request since the previous call. The arrays point into the
// request (append-only, never moved): valid while the caller holds the handle.
struct tdm_engine_chunk {
    int first_index;                     // index of tokens[0] among the generated tokens
    int n;                               // new tokens (may be 0 with finished)
    const int32_t *tokens;               // [n]
    const float *logprobs;               // [n], NULL unless logprobs >= 0
    const struct tdm_token_logprob *top; // [n][num_top], NULL unless logprobs > 0
    int num_top;
    // With the chunk of first_index 0 (n >= 1) of a request with
    // want_prompt_logprobs: its prompt's (valid while the handle is held);
    // else NULL (also when it ended before its first token)
    const struct tdm_prompt_logprobs *prompt_logprobs;
    int num_prompt_tokens;
    int num_cached_tokens;
    bool finished; // the request is over; later calls return TDM_ECLOSED
    enum tdm_finish reason;
    int32_t stop_token;
    int error;
    const char *message; // valid while the caller holds the handle
    bool kv_held;
};
// Waits up to timeout_s (< 0: no limit, 0: poll) for new tokens or the finish.
// TDM_OK with out filled (n >= 1 or finished); TDM_ETIMEDOUT when nothing came;
// TDM_ECLOSED when the finish was already returned. Only one thread may read a
// given request's stream.
int tdm_engine_stream_next(struct tdm_engine_request *r, double timeout_s,
                           struct tdm_engine_chunk *out);

// ---- P/D hooks: exporting a PREFILL_ONLY request's KV --------------------------------
// After a PREFILL_ONLY request finished with kv_held, its blocks stay referenced
// (nothing writes or reuses them), so any thread may copy them out with
// tdm_engine_export_layer (same layout and checks as tdm_kv_export_layer; the
// KV covers the prompt, num_prompt_tokens tokens). With an on_layer hook a
// layer may be exported as soon as the hook reported it, while the request
// still computes (see tdm_engine_layer_fn). tdm_engine_kv_header fills a
// transfer header for the whole prompt (after the finish). tdm_engine_release_kv
// hands the blocks back (at the engine's next step; also done by abort and
// free); the engine frees them only once no export is copying from them, and
// refuses exports from the moment they are released or their release was asked.
// TDM_EINVAL when the request holds no (final) KV for that layer or the
// range/length is wrong.
int tdm_engine_kv_header(struct tdm_engine *e, struct tdm_engine_request *r, const char *model,
                         struct tdm_kv_header *h);
int tdm_engine_export_layer(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                            int first_block, int nblocks, void *dst, size_t dst_len);
// The same with the payload in dtype (tdm_kv_export_layer_as: converted when it
// is not the pool's, e.g. for a P/D peer whose pool is of the other dtype).
int tdm_engine_export_layer_as(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                               int first_block, int nblocks, int dtype, void *dst,
                               size_t dst_len);
// The element type of the engine's KV pool (what export/import payloads hold).
enum tdm_kv_dtype tdm_engine_kv_dtype(const struct tdm_engine *e);
int tdm_engine_release_kv(struct tdm_engine *e, struct tdm_engine_request *r);
// For a device-to-device transfer whose copies the caller issues itself (CUDA
// IPC, issue 10): when layers [0, layer_end) of r are exportable (as for
// export_layer), takes an export lease (the blocks stay referenced, exactly
// as during an export_layer call, until tdm_engine_export_unlease: keep it
// until the copies are known complete) and fills ids[nblocks] with the
// physical block ids of prompt blocks [first_block, first_block + nblocks).
// On TDM_OK the leased layers' KV has been written in the pool's memory, so
// copies on any stream of the device read it final (the engine's queued
// kernels up to the call have run: a device pool waits for them here). TDM_OK,
// TDM_EINVAL, or TDM_EBACKEND / TDM_ENOMEM when that wait failed (nothing
// leased in each case).
int tdm_engine_export_lease(struct tdm_engine *e, struct tdm_engine_request *r, int layer_end,
                            int first_block, int nblocks, int *ids);
void tdm_engine_export_unlease(struct tdm_engine *e, struct tdm_engine_request *r);

// ---- P/D hooks: a request whose prompt KV is imported (IMPORT_KV) ----------------------
// The engine admits an IMPORT_KV request like any other (FCFS, blocks for the
// prompt reserved all or nothing, local prefix cache first) but computes nothing:
// tdm_engine_import_wait returns once the blocks are reserved, with the block
// range [*first_block, *first_block + *num_blocks) of the prompt the caller must
// import (blocks before first_block were found in the local prefix cache), so
// the caller knows the range before the prompt is even prefilled elsewhere. The
// caller then imports layer by layer from any thread (tdm_engine_import_layer:
// same layout and checks as tdm_kv_import_layer; the blocks are this request's
// alone, nothing else touches them) and finally MUST call tdm_engine_import_done
// (ok = false when the transfer failed: the request finishes with error
// TDM_ETRANSPORT, or with the abort's reason when one was asked meanwhile). On
// import_done(ok) the engine commits the KV, replays first_token (sampled by
// the prefill worker) through the sampler (so its history and RNG position
// equal the prefill worker's), delivers it as output 0 and decodes on. An
// abort while importing takes effect at import_done (the blocks may be in use
// by the importer); drain waits for it, free does not (stop importing before
// tdm_engine_free).
// import_wait: TDM_OK, TDM_ETIMEDOUT, or TDM_ECLOSED when the request finished
// before its blocks were reserved (too long for the pool, abort, shutdown) or is
// not IMPORT_KV. import_layer / import_done: TDM_EINVAL outside that window, for
// a bad range/length, or (ok) a first_token outside the vocabulary.
int tdm_engine_import_wait(struct tdm_engine_request *r, double timeout_s, int *first_block,
                           int *num_blocks);
int tdm_engine_import_layer(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                            int first_block, int nblocks, const void *src, size_t src_len);
int tdm_engine_import_done(struct tdm_engine *e, struct tdm_engine_request *r, int32_t first_token,
                           bool ok);
// The physical ids of blocks [first_block, first_block + nblocks) (inside the
// import range) of an IMPORT_KV request in its import window, for a peer that
// writes them in place (CUDA IPC). They stay this request's until
// import_done: the caller must not call it while a peer's copy may still land
// (docs/pd-protocol.md, memory safety). TDM_OK or TDM_EINVAL.
int tdm_engine_import_block_ids(struct tdm_engine *e, struct tdm_engine_request *r,
                                int first_block, int nblocks, int *ids);

// ---- stats -----------------------------------------------------------------------------
// Where the engine thread's time goes (tdm_engine_stats.phase_seconds,
// tandem:engine_thread_seconds_total{phase}); each instant counts in one.
enum tdm_engine_phase {
    TDM_ENGINE_PHASE_SCHEDULE, // choosing the step's rows and admitting requests
    TDM_ENGINE_PHASE_PREPARE,  // the step's batch: rows, draws' parameters, masks posted
    TDM_ENGINE_PHASE_FORWARD,  // tdm_model_forward_issue: the whole forward on the CPU
                               // (the engine thread is compute thread 0), the launches on
                               // a device
    TDM_ENGINE_PHASE_WAIT,     // tdm_model_forward_wait: for the device (0 on the CPU)
    TDM_ENGINE_PHASE_FINISH,   // a step's results: host sampling, tokens, outputs
    TDM_ENGINE_PHASE_OTHER,    // the loop's bookkeeping: controls, stats, KV events
    TDM_ENGINE_PHASE_IDLE,     // asleep: nothing to run
    TDM_ENGINE_PHASES
};

struct tdm_engine_stats {
    int num_running;     // requests in the running set
    int num_waiting;     // submitted or preempted, not running
    int num_held;        // PREFILL_ONLY requests holding KV for export
    int num_importing;   // IMPORT_KV requests with reserved blocks, waiting for import_done
    // Prefill backlog: prompt tokens (and tokens a preempted request must
    // recompute) not yet computed, of the submitted, waiting and running
    // requests; IMPORT_KV requests (their KV comes from a prefill worker) excluded.
    int64_t num_prompt_tokens_waiting;
    float kv_usage;      // referenced blocks / total blocks, [0, 1]
    int num_free_blocks; // free + evictable (prefix-cached, unreferenced)
    int num_total_blocks;
    int block_size;
    int max_waiting;         // the waiting-queue bound (config)
    int max_running;         // the running batch's bound (config max_num_seqs)
    uint64_t prefix_queries; // prompt tokens looked up in the prefix cache at admission
    uint64_t prefix_hits;    // of those, tokens found
    uint64_t num_preemptions;
    uint64_t num_steps;    // forward passes run
    uint64_t num_parallel_sample_steps; // steps whose rows were sampled on the backend's
                                        // host threads (enough rows and logits to pay)
    uint64_t num_fused_argmax_tokens;   // plain greedy tokens taken from the model's fused
                                        // argmax LM head (no logits row written)
    uint64_t num_device_drawn_tokens;   // plain sampled tokens drawn on the model's device
                                        // (TDM_LOGITS_SAMPLE: only their ids to the host)
    uint64_t num_device_verify_rows;    // speculative verification rows drawn there
                                        // (TDM_LOGITS_DRAW_ALL: their logits stay there)
    uint64_t num_async_steps;           // steps issued while the step before them was still
                                        // on the device (async scheduling)
    uint64_t num_ahead_refused;         // steps in flight whose successor was built ahead and
                                        // then refused (a block, a draw not preparable):
                                        // wasted scheduling, the step waited for instead
    uint64_t num_device_list_rows;      // drawn rows whose penalties' entries the device kept
                                        // from the step before (no upload: a device list)
    uint64_t num_finished; // requests finished (any reason)
    // The engine thread's wall time by phase since its start (enum
    // tdm_engine_phase), as of the last snapshot: their sum is its lifetime.
    double phase_seconds[TDM_ENGINE_PHASES];
    uint64_t num_masks;       // structured output: token masks computed
    double mask_seconds;      // time computing them (on the mask thread, overlapping the forward)
    double mask_wait_seconds; // engine-thread time on masks: waiting for them after the
                              // forward, then applying them to the logits (the exposed cost)
    // Speculative decoding (as the vllm:spec_decode_* counters): verification
    // steps that carried drafts, draft tokens proposed, drafts accepted, and
    // accepted drafts by position (0 .. num_speculative_tokens-1).
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t spec_accepted_per_pos[TDM_SPEC_MAX_TOKENS];
};
// A consistent snapshot as of the end of the engine's last step (or idle point).
void tdm_engine_get_stats(struct tdm_engine *e, struct tdm_engine_stats *out);
// The phase's name ("schedule", ...), the label of
// tandem:engine_thread_seconds_total; NULL for a value out of range.
const char *tdm_engine_phase_name(int phase);

// For tests: runs tdm_kv_check on the engine's cache at the engine's next idle
// point (or between steps) and returns its result.
int tdm_engine_check_kv(struct tdm_engine *e, char *err, size_t errlen);

#endif
