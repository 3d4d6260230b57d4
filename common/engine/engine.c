// SPDX-License-Identifier: Apache-2.0
// engine: the engine thread and its scheduler (see engine.h and
// docs/engine-scheduler.md).
//
// Invariants, per request (engine-thread state):
//   hist[0 .. n_tokens) = prompt + generated ids; n_tokens = n_prompt + n_gen;
//   `computed` of them have KV written and committed in seq (0 while waiting);
//   a request is schedulable when computed < n_tokens: it gets up to
//   n_tokens - computed new tokens and, when they reach n_tokens, a logits row
//   from which the next token is sampled. A decode is the case n_tokens -
//   computed == 1, a preempted request that comes back re-prefills prompt and
//   generated tokens the same way and samples only new ones.
//   Generated tokens, logprobs and top-N are append-only: index i is written
//   before n_gen becomes i + 1 under the request's mutex, so stream readers read
//   published indices without a lock.
// Lock order: engine mu, then a request's mu; never the other way round.
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "engine.h"
#include "grammar.h"
#include "sample_draw.h"

#define MOD "engine"

enum req_state {
    REQ_NEW = 0,   // in the inbox (not yet seen by the engine thread)
    REQ_WAITING,   // in the waiting queue, no KV
    REQ_RUNNING,   // in the running set, owns seq
    REQ_IMPORTING, // IMPORT_KV: blocks reserved, the caller imports the prompt's KV
    REQ_HELD,      // finished PREFILL_ONLY, seq kept for export
    REQ_DONE,      // final output delivered, no KV
};

struct tdm_engine_request {
    atomic_int refs;
    struct tdm_engine *engine;
    char id[64];
    enum tdm_engine_kind kind;
    tdm_engine_output_fn on_output;
    void *ctx;
    tdm_engine_layer_fn on_layer; // PREFILL_ONLY push hook (NULL = none)
    void *layer_ctx;
    double arrival;
    int priority; // cfg.priority_scheduling's rank: (priority, arrival), lowest first
    int n_prompt;
    // Prompt tokens proper: n_prompt less the resumed stream's output it ends
    // with (n_resume). Their rows are the model's prompt rows (the GEMM class
    // of model.h's prompt_len); the resumed output's are decode rows, as the
    // uninterrupted run's and a preempted request's recomputed tokens are.
    int n_own_prompt;
    int max_gen;    // generated tokens allowed: min(max_tokens, max_model_len - n_prompt)
    int max_tokens; // as requested (0 = up to the context); metrics observe max_gen
    int params_n;
    int params_index;
    int num_top;        // top-N logprobs per token (0 when none)
    bool want_logprobs; // logprobs >= 0
    // Prompt logprobs (params.want_prompt_logprobs): positions [1, plp_done)
    // are filled as the prompt's rows are computed, in order, each chunk's
    // rows with their logits (TDM_LOGITS_ALL); all n_prompt of them before
    // the first token is published, never written after (so readers may hold
    // them). While pending the request takes no prefix-cache hit.
    bool want_plp;
    int plp_top;
    int plp_done;
    float *plp;                         // [n_prompt]
    int32_t *plp_rank;                  // [n_prompt]
    struct tdm_token_logprob *plp_tops; // [n_prompt][plp_top]
    struct tdm_prompt_logprobs plp_view;

    // Structured output (NULL gm: unconstrained). gm and gmask are written by
    // the mask thread during a step's forward and by the engine thread
    // otherwise (the step's post/wait orders them); gend: the ids that end the
    // request (EOS, stop ids), allowed only where the grammar accepts.
    struct tdm_grammar_matcher *gm;
    uint32_t *gmask; // [engine mask_words]
    int gmask_rc;    // fill_mask's result this step
    bool gmask_eos;  // accepts_eos this step
    double gmask_s;  // time of this step's mask
    int32_t gend[TDM_MAX_EOS + TDM_MAX_STOP_IDS];
    int n_gend;

    // Engine-thread state.
    enum req_state state;
    struct tdm_sampler *sampler;
    struct tdm_kv_seq seq;
    int32_t *hist;                 // [n_prompt + max_gen] prompt then generated ids
    float *lp;                     // [max_gen] chosen-token logprobs, NULL unless want_logprobs
    struct tdm_token_logprob *top; // [max_gen][num_top], NULL unless num_top > 0
    int n_tokens;                  // n_prompt + n_gen
    int computed;                  // tokens with committed KV
    int n_gen;
    int num_cached; // prefix-cache hit at first admission
    bool admitted_once;
    struct tdm_engine_request *prev, *next; // waiting queue links
    int sched_take;                         // tokens scheduled this step (0 = not scheduled)
    // Speculative decoding: n_draft draft tokens proposed this step, written
    // at hist[n_tokens .. n_tokens + n_draft) (past the published tokens, so
    // stream readers never see them) and scheduled after the last token.
    bool spec_ok; // speculation on, request unconstrained and not PREFILL_ONLY
    int n_draft;
    struct tdm_spec_adapt spec_adapt; // adaptive off (spec.h)
    // Its device list (engine's list_*; 0: none): valid for the draw at
    // output index list_pos while list_epoch is the engine's; loaded with
    // the min_tokens masks (list_masked: loaded again once they go).
    int adj_list;
    int list_pos;
    bool list_masked;
    uint64_t list_epoch;
    uint64_t ahead_mark; // the engine's ahead_marks when it had rows in the step in flight
    double t_first_sched, t_first_token, t_last_token;

    // Guarded by engine->mu.
    struct tdm_engine_request *inbox_next;
    struct tdm_engine_request *ctl_next; // control list (abort, KV release, import done)
    bool ctl_queued;
    enum tdm_finish ctl_abort; // NONE = no abort asked
    bool ctl_release;                 // release held KV
    bool ctl_import_done, ctl_import_ok;
    // The same, copied by the engine thread when it takes the list.
    struct tdm_engine_request *ctl_exec_next;
    enum tdm_finish ctl_exec_abort;
    bool ctl_exec_release, ctl_exec_import, ctl_exec_import_ok;

    // IMPORT_KV (engine thread; first_token is written by import_done before it
    // queues the control that makes the engine thread read it).
    int32_t first_token;
    bool imported;                        // the KV arrived; from now on a normal request
    enum tdm_finish abort_pending; // abort asked while importing

    // Guarded by mu: what the stream reader sees.
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int pub_gen;
    bool pub_finished;
    bool fin_returned;
    int read_pos;
    enum tdm_finish reason;
    int32_t stop_token;
    int error;
    char message[160];
    bool kv_held; // written by the engine thread only, read after pub_finished
    bool kv_release_asked;
    // Exports from other threads (tdm_engine_export_layer): layers [0, layers_final)
    // are final (the push hook reported them); `exporting` copies are running;
    // kv_gone: the engine released (or is releasing) the blocks, exports refused.
    int layers_final;
    int exporting;
    bool kv_gone;
    bool import_ready; // blocks reserved: import_first_block, import_num_blocks valid
    bool import_done_called;
    int import_first_block, import_num_blocks;
};

// A prompt logprob to compute: prompt token pos of r from the logits row
// before it.
struct plp_row {
    struct tdm_engine_request *r;
    int pos;
    const float *row;
};

struct sched_item {
    struct tdm_engine_request *r;
    int start; // the position of its first row (the request's computed, or past
               // its rows of the step in flight: schedule_ahead)
    int take;
    bool logits;
    bool plp;          // prompt rows of a request whose prompt logprobs are pending:
                       // every row's logits (TDM_LOGITS_ALL; the last one samples
                       // when logits is set too)
    bool fused;        // this step's token comes from the model (its fused
                       // argmax, or its device's draw: drawn)
    bool drawn;        // ... its device's draw (TDM_LOGITS_SAMPLE) with draw
    int32_t fused_tok; // ... written here by the forward
    struct tdm_draw_params draw;
    int adj_off; // drawn: its logit adjustments in the engine's adj array
    struct tdm_draw_logprobs lp; // drawn with draw.logprobs: written by the forward
    // A decode with drafts whose rows are all drawn on the device
    // (TDM_LOGITS_DRAW_ALL): its 1 + n_draft rows' draws, tokens and
    // logprobs at v_off in the engine's verification arrays.
    bool verify_drawn;
    int v_off;
    // Async scheduling: a row of the step built while the step before it is
    // in flight (schedule_ahead), one position past that step's row of the
    // request, its token that row's chosen one (the model's from_prev, row
    // prev_row of that step).
    bool ahead;
    int prev_row;
};

struct tdm_engine {
    struct tdm_engine_config cfg; // effective values
    struct tdm_model *model;
    struct tdm_kv_cache *kv;
    struct tdm_metrics_vllm *m;
    int vocab;
    int32_t model_eos[TDM_MAX_EOS];
    int num_model_eos;

    // Engine-thread state.
    struct tdm_engine_request **running; // [max_num_seqs] in admission order
    int num_running;
    struct tdm_engine_request *wait_head, *wait_tail;
    int num_waiting_local;
    int num_held;
    struct tdm_engine_request *held_head;   // PREFILL_ONLY requests keeping KV for export
    struct tdm_engine_request *import_head; // IMPORT_KV requests waiting for their KV
    int num_importing;
    bool abort_all_applied;
    struct sched_item *items;    // [max_num_seqs] this step's schedule
    // Async scheduling (issue 26 item 1; off: cfg.sync_scheduling, or a
    // backend whose forwards end at issue): a step whose rows may all go on
    // without their tokens (ahead_row) stays in flight, its items in
    // fl_items (fl_n of them; 0: none), while the engine thread builds and
    // issues the next one in items (the two arrays swap), then takes its
    // tokens. Steps issued while another was in flight: async_steps.
    struct sched_item *fl_items;
    int fl_n;
    uint64_t ahead_marks; // schedule_ahead's calls (a request's ahead_mark)
    bool async;
    uint64_t async_steps;
    uint64_t ahead_refused;      // steps ahead_step allowed whose schedule_ahead found none
    struct tdm_batch_seq *batch; // [max_num_seqs]
    float *logits;               // [max_num_seqs][vocab]
    // One step's plain samples (sample_rows): taken by the backend's host
    // threads by sample_next, then appended in batch order.
    struct sample_job *sjobs;           // [max_num_seqs]
    struct tdm_sample_result *sjob_res; // [max_num_seqs] logprobs of the jobs that want them
    int n_sjobs;
    atomic_int sample_next;
    bool fused_argmax;              // the model's backend has the fused argmax LM head
    uint64_t fused_rows;            // tokens taken from it (plain greedy rows)
    bool device_sampling;           // the model draws sampled tokens on its device
    uint64_t drawn_rows;            // tokens drawn there (rows without logprobs)
    struct tdm_draw_adj *adj;       // [adj_cap] the drawn rows' logit adjustments, this step
    int adj_cap;
    // Device lists (tdm_draw_params.list): a drawn request with a
    // repetition, presence or frequency penalty keeps its entries on the
    // device between steps (list_load once, then read there: list_rows), so
    // a row's upload is O(1) instead of its history's distinct tokens. Ids
    // 1 .. n_lists, freed ones on list_free (n_list_free); a failed step
    // makes every list stale (list_epoch).
    int *list_free;
    int n_list_free, list_free_cap, n_lists;
    uint64_t list_epoch;
    uint64_t list_rows;
    uint32_t *allow;    // [max_num_seqs][allow_words] drawn constrained rows' allow bitmaps
    size_t allow_words; // ceil(vocab / 32)
    bool masks_posted;  // this step's masks went to the mask threads
    bool masks_waited;  // ... and were waited for (by the choose hook or after the forward)
    // The step whose masks are the jobs (its items' array), and whether they
    // wait for the step in flight before it: a step built ahead with a
    // constrained row of a request in that step (its grammar follows that
    // step's token) computes them in the choose hook, once that step was
    // taken and finished there (fl_taken).
    const struct sched_item *mask_items;
    bool masks_deferred;
    bool fl_taken;
    uint64_t parallel_sample_steps; // steps whose rows were sampled on several threads
    // Speculative decoding: draft_rows logits rows past the first max_num_seqs
    // bound the draft tokens of one step (draft_rows_left: this step's);
    // spec_out/spec_res: one verification's tokens and logprobs.
    int draft_rows, draft_rows_left;
    // Prompt logprobs: e->logits grows by plp_rows rows at the first such
    // request (0 until then); a step's prompt-logprob chunks take at most
    // that many rows together (plp_rows_left). Their rows' logprobs are
    // computed on the backend's host threads, prow_next handing them out.
    int plp_rows, plp_rows_left;
    struct plp_row *prow; // [plp_rows]
    int n_prow;
    atomic_int prow_next;
    int32_t spec_out[TDM_SPEC_MAX_TOKENS + 1];
    struct tdm_sample_result *spec_res; // [num_speculative_tokens + 1]; NULL when off
    // Verification rows drawn on the device ([max_num_seqs + draft_rows] each,
    // a step's; NULL when speculation is off): each row's draw (its drafts
    // before it ahead of the history), token and logprobs.
    struct tdm_draw_params *vdraw;
    int32_t *vtok;
    struct tdm_draw_logprobs *vlp;
    uint64_t drawn_verify_rows; // rows verified there
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted;
    uint64_t spec_per_pos[TDM_SPEC_MAX_TOKENS];
    uint64_t prefix_queries, prefix_hits, preemptions, steps, finished;
    // The engine thread's time by phase (phase_enter): phase_s[p] seconds
    // charged, `phase` the one running since phase_t; phase_ctr the
    // thread_seconds family's series (NULL: none).
    double phase_s[TDM_ENGINE_PHASES], phase_t;
    int phase;
    struct tdm_metrics_counter *phase_ctr[TDM_ENGINE_PHASES];

    // Structured output: mask threads fill the step's masks while the engine
    // thread runs the forward (started at the first constrained step). A post
    // bumps mask_gen; each thread takes jobs by mask_next until none is left,
    // and the last one done (mask_busy 0) wakes the engine thread.
    size_t mask_words;
    struct tdm_engine_request **mask_jobs; // [max_num_seqs]
    int n_mask_jobs;
    int n_step_items;        // the step's items (the choose hook reads items[] and batch[])
    pthread_t *mask_threads; // [cfg.mask_threads]
    int n_mask_threads;      // started
    bool mask_tried, mask_quit;
    uint64_t mask_gen;
    atomic_int mask_next;
    int mask_busy;
    pthread_mutex_t mask_mu;
    pthread_cond_t mask_cv;
    uint64_t num_masks;
    double mask_seconds, mask_wait_seconds;

    // Shared, guarded by mu.
    pthread_mutex_t mu;
    pthread_cond_t wake;    // engine thread waits here when idle
    pthread_cond_t idle_cv; // drain/check waiters
    struct tdm_engine_request *inbox_head, *inbox_tail;
    struct tdm_engine_request *ctl_head;
    int num_queued; // inbox + waiting (the bounded queue)
    int num_active; // inbox + waiting + running, as of the last step
    bool closed;    // submit refused
    bool abort_all; // abort everything unfinished
    bool stop;      // thread exits once nothing is active or held
    bool check_req;
    bool check_done;
    int check_rc;
    char check_err[256];
    struct tdm_engine_stats stats;
    struct tdm_kv_event *kv_ev; // [cfg.kv_event_capacity] taken from the cache, oldest first
    int kv_ev_count;
    bool kv_ev_overflow;
    pthread_t thread;
};

// ---- small helpers ------------------------------------------------------------------------
void tdm_engine_config_default(struct tdm_engine_config *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->block_size = 16;
    cfg->kv_memory_bytes = (size_t)256 << 20;
    cfg->enable_prefix_caching = true;
    cfg->max_num_batched_tokens = 2048;
    cfg->max_num_seqs = 64;
    cfg->max_waiting = 1024;
}

void tdm_engine_request_params_default(struct tdm_engine_request_params *p)
{
    memset(p, 0, sizeof *p);
    tdm_sampling_params_default(&p->sampling);
}

static int blocks_for(const struct tdm_engine *e, int tokens)
{
    return (tokens + e->cfg.block_size - 1) / e->cfg.block_size;
}

// Prompt logprobs (engine.h): the host memory kept for their rows when
// cfg.prompt_logprob_rows is 0; each row costs vocab floats (0.6 MB for
// Qwen2.5's vocabulary). Fewer rows mean smaller prompt chunks for such
// requests, each step reading the weights again: with 32 rows a 1024-token
// prompt took 3.2x its plain prefill on the Qwen2.5-0.5B shape.
#define ENGINE_PLP_BYTES ((size_t)128 << 20)
#define ENGINE_PLP_MIN_ROWS 32

static bool plp_pending(const struct tdm_engine_request *r)
{
    return r->want_plp && r->plp_done < r->n_prompt;
}

// The prompt logprobs that go with output index i: all of them with the
// first token, when asked.
static const struct tdm_prompt_logprobs *plp_with(const struct tdm_engine_request *r, int i)
{
    return i == 0 && r->want_plp && r->plp_done >= r->n_prompt ? &r->plp_view : NULL;
}

static void req_free(struct tdm_engine_request *r)
{
    tdm_grammar_matcher_free(r->gm);
    free(r->gmask);
    tdm_sampler_free(r->sampler);
    free(r->hist);
    free(r->lp);
    free(r->top);
    free(r->plp);
    free(r->plp_rank);
    free(r->plp_tops);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

static void req_unref(struct tdm_engine_request *r)
{
    if (r != NULL && atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) == 1)
        req_free(r);
}

void tdm_engine_request_release(struct tdm_engine_request *r)
{
    req_unref(r);
}

const char *tdm_engine_request_id(const struct tdm_engine_request *r)
{
    return r ? r->id : "";
}

// The engine thread wrote these before it published the finish under r->mu;
// the reader took r->mu to see the finish, so the writes are visible.
void tdm_engine_request_times(const struct tdm_engine_request *r, struct tdm_engine_times *out)
{
    out->arrival = r->arrival;
    out->first_scheduled = r->admitted_once ? r->t_first_sched : 0;
    out->first_token = r->n_gen > 0 ? r->t_first_token : 0;
    out->last_token = r->n_gen > 0 ? r->t_last_token : 0;
}

const struct tdm_engine_config *tdm_engine_get_config(const struct tdm_engine *e)
{
    return &e->cfg;
}

// ---- waiting queue and running set (engine thread) ---------------------------------------
// Links r into the waiting queue after q (NULL: at the front).
static void wait_insert_after(struct tdm_engine *e, struct tdm_engine_request *q,
                              struct tdm_engine_request *r)
{
    r->prev = q;
    r->next = q ? q->next : e->wait_head;
    if (r->next)
        r->next->prev = r;
    else
        e->wait_tail = r;
    if (q)
        q->next = r;
    else
        e->wait_head = r;
    e->num_waiting_local++;
    r->state = REQ_WAITING;
}

// Priority scheduling's order: true when a is served after b, by (priority,
// arrival); equal ranks keep their order.
static bool ranks_after(const struct tdm_engine_request *a, const struct tdm_engine_request *b)
{
    return a->priority != b->priority ? a->priority > b->priority : a->arrival > b->arrival;
}

// Queues r: fcfs at the back (a preempted request at the front), priority
// scheduling behind the last waiting request it does not rank before.
static void wait_enqueue(struct tdm_engine *e, struct tdm_engine_request *r, bool preempted)
{
    struct tdm_engine_request *q = e->wait_tail;
    if (!e->cfg.priority_scheduling && preempted)
        q = NULL;
    while (e->cfg.priority_scheduling && q && ranks_after(q, r))
        q = q->prev;
    wait_insert_after(e, q, r);
}

static void wait_remove(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        e->wait_head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    else
        e->wait_tail = r->prev;
    r->prev = r->next = NULL;
    e->num_waiting_local--;
}

// The held and importing lists reuse the waiting links (such a request waits no more).
static void list_push(struct tdm_engine_request **head, struct tdm_engine_request *r)
{
    r->prev = NULL;
    r->next = *head;
    if (*head)
        (*head)->prev = r;
    *head = r;
}

static void list_unlink(struct tdm_engine_request **head, struct tdm_engine_request *r)
{
    if (r->prev)
        r->prev->next = r->next;
    else
        *head = r->next;
    if (r->next)
        r->next->prev = r->prev;
    r->prev = r->next = NULL;
}

static void running_remove(struct tdm_engine *e, struct tdm_engine_request *r)
{
    for (int i = 0; i < e->num_running; i++) {
        if (e->running[i] == r) {
            memmove(&e->running[i], &e->running[i + 1],
                    (size_t)(e->num_running - i - 1) * sizeof e->running[0]);
            e->num_running--;
            return;
        }
    }
    TDM_ASSERT(!"request not in the running set");
}

// ---- output delivery (engine thread) ------------------------------------------------------
static void fill_output(const struct tdm_engine_request *r, struct tdm_engine_output *o)
{
    memset(o, 0, sizeof *o);
    o->request = (struct tdm_engine_request *)r;
    o->id = r->id;
    o->index = -1;
    o->token = -1;
    o->stop_token = -1;
    o->num_prompt_tokens = r->n_prompt;
    o->num_cached_tokens = r->num_cached;
    o->num_generated = r->n_gen;
    o->message = "";
}

static void observe_finish(struct tdm_engine *e, struct tdm_engine_request *r,
                           enum tdm_finish reason, double now)
{
    struct tdm_metrics_vllm *m = e->m;
    if (m == NULL)
        return;
    tdm_metrics_counter_inc(m->request_success_by_reason[reason > TDM_FINISH_NONE && reason < TDM_FINISH_COUNT ? reason : TDM_FINISH_ERROR]);
    tdm_metrics_histogram_observe(m->request_prompt_tokens, r->n_prompt);
    tdm_metrics_histogram_observe(m->request_generation_tokens, r->n_gen);
    tdm_metrics_histogram_observe(m->request_max_num_generation_tokens, r->n_gen);
    if (r->params_index == 0)
        tdm_metrics_histogram_observe(m->request_params_n, r->params_n);
    tdm_metrics_histogram_observe(m->request_params_max_tokens, r->max_gen);
    tdm_metrics_histogram_observe(m->e2e_request_latency_seconds, now - r->arrival);
    if (r->admitted_once) {
        tdm_metrics_histogram_observe(m->request_queue_time_seconds, r->t_first_sched - r->arrival);
    }
    if (r->n_gen > 0) {
        // vLLM v1: prefill = first scheduled -> first token, decode = first -> last
        // token, inference = first scheduled -> last token.
        tdm_metrics_histogram_observe(m->request_prefill_time_seconds,
                                      r->t_first_token - r->t_first_sched);
        double decode = r->t_last_token - r->t_first_token;
        tdm_metrics_histogram_observe(m->request_decode_time_seconds, decode);
        tdm_metrics_histogram_observe(m->request_inference_time_seconds,
                                      r->t_last_token - r->t_first_sched);
        tdm_metrics_histogram_observe(m->request_time_per_output_token_seconds,
                                      r->n_gen > 1 ? decode / (r->n_gen - 1) : 0.0);
    }
}

// Releases r's KV blocks. A PREFILL_ONLY request's KV may be being copied by
// another thread (tdm_engine_export_layer): refuse new copies, wait for the
// running ones (a memcpy each, never a network wait), then release.
static void drop_kv(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (r->kind == TDM_ENGINE_REQ_PREFILL_ONLY) {
        pthread_mutex_lock(&r->mu);
        r->kv_gone = true;
        while (r->exporting > 0)
            pthread_cond_wait(&r->cv, &r->mu);
        pthread_mutex_unlock(&r->mu);
    }
    tdm_kv_seq_release(e->kv, &r->seq);
}

// r's device list id (a new one when it has none).
static int list_take(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (r->adj_list == 0)
        r->adj_list = e->n_list_free > 0 ? e->list_free[--e->n_list_free] : ++e->n_lists;
    return r->adj_list;
}

// r's list id back to the engine (r finished; the next request given it
// loads the list before reading it).
static void list_put(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (r->adj_list == 0)
        return;
    if (e->n_list_free == e->list_free_cap) {
        int cap = e->list_free_cap ? 2 * e->list_free_cap : 64;
        int *grown = realloc(e->list_free, (size_t)cap * sizeof *grown);
        if (grown == NULL)
            return; // the id is not reused
        e->list_free = grown;
        e->list_free_cap = cap;
    }
    e->list_free[e->n_list_free++] = r->adj_list;
    r->adj_list = 0;
}

// Publishes the finish to the stream and the callback, drops KV unless held, and
// drops the engine's reference unless the KV is held (then release_kv drops it).
// `with_token`: the finishing output carries the token just generated.
static void finish_request(struct tdm_engine *e, struct tdm_engine_request *r,
                           enum tdm_finish reason, int32_t stop_token, int error,
                           const char *message, bool with_token)
{
    double now = tdm_now();
    if (r->state == REQ_WAITING) {
        wait_remove(e, r);
        pthread_mutex_lock(&e->mu);
        e->num_queued--;
        pthread_mutex_unlock(&e->mu);
    } else if (r->state == REQ_RUNNING) {
        running_remove(e, r);
    } else if (r->state == REQ_IMPORTING) {
        list_unlink(&e->import_head, r);
        e->num_importing--;
    }
    list_put(e, r);
    bool hold = r->kind == TDM_ENGINE_REQ_PREFILL_ONLY && r->state == REQ_RUNNING &&
                (reason == TDM_FINISH_STOP || reason == TDM_FINISH_LENGTH);
    if (!hold)
        drop_kv(e, r);
    r->state = hold ? REQ_HELD : REQ_DONE;
    if (hold) {
        list_push(&e->held_head, r);
        e->num_held++;
    }
    r->kv_held = hold;
    e->finished++;
    observe_finish(e, r, reason, now);
    if (reason == TDM_FINISH_ERROR)
        TDM_LOG_WARN(MOD, "req=%s finished with error: %s", r->id, message ? message : "");
    else
        TDM_LOG_DEBUG(MOD, "req=%s finished reason=%s prompt=%d generated=%d", r->id,
                      tdm_finish_name(reason), r->n_prompt, r->n_gen);

    // The message is written before anyone can read it: the stream reads it only
    // after pub_finished, the callback below gets it directly.
    snprintf(r->message, sizeof r->message, "%s", message ? message : "");
    if (r->on_output) {
        struct tdm_engine_output o;
        fill_output(r, &o);
        if (with_token && r->n_gen > 0) {
            int i = r->n_gen - 1;
            o.index = i;
            o.token = r->hist[r->n_prompt + i];
            o.logprob = r->lp ? r->lp[i] : 0.0f;
            o.num_top = r->num_top;
            o.top = r->top ? r->top + (size_t)i * (size_t)r->num_top : NULL;
            o.prompt_logprobs = plp_with(r, i);
        }
        o.finished = true;
        o.reason = reason;
        o.stop_token = stop_token;
        o.error = error;
        o.message = r->message;
        o.kv_held = hold;
        r->on_output(r->ctx, &o);
    }
    // Stream last, so that a reader who saw the finish also saw every callback.
    pthread_mutex_lock(&r->mu);
    r->reason = reason;
    r->stop_token = stop_token;
    r->error = error;
    r->pub_gen = r->n_gen;
    r->pub_finished = true;
    pthread_mutex_unlock(&r->mu);
    // Woken after the unlock (our reference keeps r), so that the reader
    // does not wake only to wait for the mutex (a second futex call and
    // switch on every token).
    pthread_cond_broadcast(&r->cv);
    if (!hold)
        req_unref(r);
}

// A token that does not finish the request.
static void deliver_token(struct tdm_engine_request *r)
{
    if (r->on_output) {
        struct tdm_engine_output o;
        int i = r->n_gen - 1;
        fill_output(r, &o);
        o.index = i;
        o.token = r->hist[r->n_prompt + i];
        o.logprob = r->lp ? r->lp[i] : 0.0f;
        o.num_top = r->num_top;
        o.top = r->top ? r->top + (size_t)i * (size_t)r->num_top : NULL;
        o.prompt_logprobs = plp_with(r, i);
        r->on_output(r->ctx, &o);
    }
    pthread_mutex_lock(&r->mu);
    r->pub_gen = r->n_gen;
    pthread_mutex_unlock(&r->mu);
    pthread_cond_broadcast(&r->cv); // after the unlock, as in finish_request
}

static void release_held(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (r->state != REQ_HELD)
        return;
    list_unlink(&e->held_head, r);
    drop_kv(e, r);
    r->state = REQ_DONE;
    e->num_held--;
    req_unref(r);
}

// ---- stats and gauges -------------------------------------------------------------------
// Tokens r still has to prefill: the prompt (or, after a preemption, the
// prompt and generated tokens) beyond its committed KV; a decoding request's
// one new token per step is not prefill work.
static int64_t prefill_left(const struct tdm_engine_request *r)
{
    if (r->kind == TDM_ENGINE_REQ_IMPORT_KV && !r->imported)
        return 0; // its prompt's KV comes from a prefill worker
    int left = r->n_tokens - r->computed - (r->n_gen > 0 ? 1 : 0);
    return left > 0 ? left : 0;
}

// Walks the inbox (guarded by mu), the waiting queue and the running set
// (engine thread): called with mu held, on the engine thread or before it starts.
static int64_t prompt_tokens_waiting(const struct tdm_engine *e)
{
    int64_t n = 0;
    for (const struct tdm_engine_request *r = e->inbox_head; r; r = r->inbox_next)
        n += prefill_left(r);
    for (const struct tdm_engine_request *r = e->wait_head; r; r = r->next)
        n += prefill_left(r);
    for (int i = 0; i < e->num_running; i++)
        n += prefill_left(e->running[i]);
    return n;
}

static const char *const phase_names[TDM_ENGINE_PHASES] = {"schedule", "prepare", "forward", "wait",
                                                           "finish",   "other",   "idle"};

const char *tdm_engine_phase_name(int phase)
{
    return phase >= 0 && phase < TDM_ENGINE_PHASES ? phase_names[phase] : NULL;
}

// Charges the time since the last switch to the phase that ran and makes p
// the running one; returns the one it replaced (to go back to: phases nest,
// e.g. a step finished by the choose hook inside a forward).
static int phase_enter(struct tdm_engine *e, int p)
{
    double now = tdm_now();
    int prev = e->phase;
    e->phase_s[prev] += now - e->phase_t;
    e->phase_t = now;
    e->phase = p;
    return prev;
}

static void publish_stats(struct tdm_engine *e)
{
    // Called with e->mu held, on the engine thread (or before it starts).
    struct tdm_engine_stats *s = &e->stats;
    phase_enter(e, e->phase); // charged up to now
    for (int p = 0; p < TDM_ENGINE_PHASES; p++) {
        if (e->phase_ctr[p])
            tdm_metrics_counter_add(e->phase_ctr[p], e->phase_s[p] - s->phase_seconds[p]);
        s->phase_seconds[p] = e->phase_s[p];
    }
    s->num_running = e->num_running;
    s->num_waiting = e->num_queued;
    s->num_held = e->num_held;
    s->num_importing = e->num_importing;
    s->num_prompt_tokens_waiting = prompt_tokens_waiting(e);
    s->kv_usage = tdm_kv_usage(e->kv);
    s->num_free_blocks = tdm_kv_num_free_blocks(e->kv);
    s->num_total_blocks = e->cfg.num_blocks;
    s->block_size = e->cfg.block_size;
    s->prefix_queries = e->prefix_queries;
    s->prefix_hits = e->prefix_hits;
    s->num_preemptions = e->preemptions;
    s->num_steps = e->steps;
    s->num_parallel_sample_steps = e->parallel_sample_steps;
    s->num_fused_argmax_tokens = e->fused_rows;
    s->num_device_drawn_tokens = e->drawn_rows;
    s->num_device_verify_rows = e->drawn_verify_rows;
    // The counters advance by what the last snapshot lacked.
    tdm_metrics_counter_add(e->cfg.steps_ahead, (double)(e->async_steps - s->num_async_steps));
    tdm_metrics_counter_add(e->cfg.list_rows, (double)(e->list_rows - s->num_device_list_rows));
    s->num_async_steps = e->async_steps;
    s->num_ahead_refused = e->ahead_refused;
    s->num_device_list_rows = e->list_rows;
    s->num_finished = e->finished;
    s->num_masks = e->num_masks;
    s->mask_seconds = e->mask_seconds;
    s->mask_wait_seconds = e->mask_wait_seconds;
    s->spec_drafts = e->spec_drafts;
    s->spec_draft_tokens = e->spec_draft_tokens;
    s->spec_accepted_tokens = e->spec_accepted;
    memcpy(s->spec_accepted_per_pos, e->spec_per_pos, sizeof s->spec_accepted_per_pos);
    e->num_active = e->num_queued + e->num_running + e->num_importing;
    if (e->m) {
        tdm_metrics_gauge_set(e->m->num_requests_running, s->num_running);
        tdm_metrics_gauge_set(e->m->num_requests_waiting, s->num_waiting);
        tdm_metrics_gauge_set(e->m->kv_cache_usage_perc, s->kv_usage);
    }
    if (e->cfg.prompt_tokens_waiting)
        tdm_metrics_gauge_set(e->cfg.prompt_tokens_waiting, (double)s->num_prompt_tokens_waiting);
    if (e->num_active == 0)
        pthread_cond_broadcast(&e->idle_cv);
}

void tdm_engine_get_stats(struct tdm_engine *e, struct tdm_engine_stats *out)
{
    pthread_mutex_lock(&e->mu);
    *out = e->stats;
    pthread_mutex_unlock(&e->mu);
    out->max_waiting = e->cfg.max_waiting;
    out->max_running = e->cfg.max_num_seqs;
}

// ---- scheduling (engine thread) ------------------------------------------------------------
// Releases r's KV and puts it at the front of the waiting queue; its generated
// tokens and sampler state stay, so it resumes without re-sampling them.
static void preempt(struct tdm_engine *e, struct tdm_engine_request *r)
{
    running_remove(e, r);
    tdm_kv_seq_release(e->kv, &r->seq);
    r->computed = 0;
    r->sched_take = 0;
    r->n_draft = 0;
    wait_enqueue(e, r, true);
    pthread_mutex_lock(&e->mu);
    e->num_queued++;
    pthread_mutex_unlock(&e->mu);
    e->preemptions++;
    if (e->m)
        tdm_metrics_counter_inc(e->m->num_preemptions);
    TDM_LOG_DEBUG(MOD, "req=%s preempted generated=%d", r->id, r->n_gen);
}

static void unschedule(struct tdm_engine *e, int *n_items, int *budget,
                       struct tdm_engine_request *r)
{
    for (int i = 0; i < *n_items; i++) {
        if (e->items[i].r == r) {
            *budget += e->items[i].take;
            if (e->items[i].plp)
                e->plp_rows_left += e->items[i].take;
            e->draft_rows_left += r->n_draft;
            r->n_draft = 0;
            memmove(&e->items[i], &e->items[i + 1],
                    (size_t)(*n_items - i - 1) * sizeof e->items[0]);
            (*n_items)--;
            return;
        }
    }
}

static void fail_unfit(struct tdm_engine *e, struct tdm_engine_request *r, int tokens)
{
    char msg[160];
    snprintf(msg, sizeof msg, "needs %d KV blocks for %d tokens; the pool has %d",
             blocks_for(e, tokens), tokens, e->cfg.num_blocks);
    finish_request(e, r, TDM_FINISH_ERROR, -1, TDM_ECAPACITY, msg, false);
}

// The running request a preemption takes: fcfs the one admitted last;
// priority scheduling the one of the highest (priority, arrival), the later
// admitted of equals.
static struct tdm_engine_request *preempt_victim(const struct tdm_engine *e)
{
    struct tdm_engine_request *v = e->running[e->num_running - 1];
    if (e->cfg.priority_scheduling)
        for (int i = e->num_running - 2; i >= 0; i--)
            if (ranks_after(e->running[i], v))
                v = e->running[i];
    return v;
}

// Schedules one running request's next tokens (take <= budget), preempting
// running requests (preempt_victim) while its blocks do not fit. Returns
// true when r was scheduled, false when r itself was preempted or failed. A
// decode's draft tokens (r->n_draft) ride along after its token.
static bool schedule_running(struct tdm_engine *e, struct tdm_engine_request *r, int *n_items,
                             int *budget, bool *preempted)
{
    int take = r->n_tokens + r->n_draft - r->computed;
    if (take > *budget)
        take = *budget;
    bool plp = plp_pending(r);
    if (plp && take > e->plp_rows_left)
        take = e->plp_rows_left;
    if (take < 1)
        return true; // the step's prompt-logprob rows are taken: the next step
    for (;;) {
        // A prompt chunk, and a decode's drafts, shrink to what the free blocks
        // hold before anyone is preempted for them; a decode token needs its block.
        int room =
            (r->seq.num_blocks + tdm_kv_num_free_blocks(e->kv)) * e->cfg.block_size - r->computed;
        int t = take < room ? take : room;
        if (t >= 1 && tdm_kv_reserve(e->kv, &r->seq, r->computed + t) == TDM_OK) {
            if (r->n_draft > 0 && r->computed + t < r->n_tokens + r->n_draft) {
                int keep = r->computed + t - r->n_tokens; // >= 0: t >= 1 covers the token
                e->draft_rows_left += r->n_draft - keep;
                r->n_draft = keep;
            }
            r->sched_take = t;
            if (plp)
                e->plp_rows_left -= t;
            e->items[*n_items] =
                (struct sched_item){.r = r,
                                    .start = r->computed,
                                    .take = t,
                                    .plp = plp,
                                    .logits = r->computed + t == r->n_tokens + r->n_draft};
            (*n_items)++;
            *budget -= t;
            return true;
        }
        struct tdm_engine_request *victim = preempt_victim(e);
        if (victim == r && blocks_for(e, r->computed + 1) > e->cfg.num_blocks) {
            fail_unfit(e, r, r->computed + 1);
            return false;
        }
        if (victim->sched_take > 0)
            unschedule(e, n_items, budget, victim);
        preempt(e, victim);
        *preempted = true;
        if (victim == r)
            return false;
    }
}

static void count_prefix(struct tdm_engine *e, int queried, int hit)
{
    if (!e->cfg.enable_prefix_caching)
        return;
    e->prefix_queries += (uint64_t)queried;
    e->prefix_hits += (uint64_t)hit;
    if (e->m) {
        tdm_metrics_counter_add(e->m->prefix_cache_queries, queried);
        tdm_metrics_counter_add(e->m->prefix_cache_hits, hit);
    }
}

// e->logits with room for the prompt-logprob rows (grown at the first
// request that asks for them; the engine thread only, between steps). False
// when out of memory.
static bool plp_rows_ready(struct tdm_engine *e)
{
    if (e->plp_rows > 0)
        return true;
    int n = e->cfg.prompt_logprob_rows;
    size_t rows = (size_t)e->cfg.max_num_seqs + (size_t)e->draft_rows + (size_t)n;
    struct plp_row *pr = calloc((size_t)n, sizeof *pr);
    float *l = pr ? realloc(e->logits, rows * (size_t)e->vocab * sizeof(float)) : NULL;
    if (l == NULL) {
        free(pr);
        return false;
    }
    e->logits = l;
    e->prow = pr;
    e->plp_rows = e->plp_rows_left = n;
    return true;
}

// Takes the waiting head off the queue as admitted (the caller sets its state).
static void admitted(struct tdm_engine *e, struct tdm_engine_request *r, int match)
{
    wait_remove(e, r);
    pthread_mutex_lock(&e->mu);
    e->num_queued--;
    pthread_mutex_unlock(&e->mu);
    if (!r->admitted_once) {
        r->admitted_once = true;
        r->num_cached = match;
        r->t_first_sched = tdm_now();
    }
}

// IMPORT_KV admission: reserve the prompt's blocks and let the importer in.
static bool admit_import(struct tdm_engine *e, struct tdm_engine_request *r)
{
    // The first decode step writes position n_prompt: that block must exist too.
    if (blocks_for(e, r->n_prompt + 1) > e->cfg.num_blocks) {
        fail_unfit(e, r, r->n_prompt + 1);
        return true;
    }
    int match = tdm_kv_match_prefix(e->kv, &r->seq, r->hist, r->n_prompt);
    if (tdm_kv_reserve(e->kv, &r->seq, r->n_prompt) != TDM_OK) {
        tdm_kv_seq_release(e->kv, &r->seq);
        return false;
    }
    count_prefix(e, r->n_prompt, match);
    admitted(e, r, match);
    r->state = REQ_IMPORTING;
    r->computed = match;
    list_push(&e->import_head, r);
    e->num_importing++;
    pthread_mutex_lock(&r->mu);
    r->import_ready = true;
    r->import_first_block = match / e->cfg.block_size;
    r->import_num_blocks = r->seq.num_blocks - r->import_first_block;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    TDM_LOG_DEBUG(MOD, "req=%s importing blocks=%d cached=%d", r->id, r->import_num_blocks, match);
    return true;
}

// Admits the waiting head if blocks and budget allow (or finishes it when it can
// never fit). Returns false to stop admitting: FCFS, nobody overtakes the head.
static bool admit_one(struct tdm_engine *e, int *n_items, int *budget)
{
    struct tdm_engine_request *r = e->wait_head;
    if (r->kind == TDM_ENGINE_REQ_IMPORT_KV && !r->imported)
        return admit_import(e, r);
    if (blocks_for(e, r->n_tokens) > e->cfg.num_blocks) {
        fail_unfit(e, r, r->n_tokens);
        return true;
    }
    // Prompt logprobs pending: every prompt row is computed (no prefix-cache
    // hit, as in vLLM), within the step's rows for them.
    bool plp = plp_pending(r);
    if (plp && !plp_rows_ready(e)) {
        finish_request(e, r, TDM_FINISH_ERROR, -1, TDM_ENOMEM,
                       "out of memory for the prompt logprobs' logits rows", false);
        return true;
    }
    if (plp && e->plp_rows_left < 1)
        return false;
    int match = plp ? 0 : tdm_kv_match_prefix(e->kv, &r->seq, r->hist, r->n_tokens);
    int take = r->n_tokens - match;
    if (take > *budget)
        take = *budget;
    if (plp && take > e->plp_rows_left)
        take = e->plp_rows_left;
    if (tdm_kv_reserve(e->kv, &r->seq, match + take) != TDM_OK) {
        tdm_kv_seq_release(e->kv, &r->seq); // drop the prefix references; retry later
        return false;
    }
    if (plp)
        e->plp_rows_left -= take;
    else
        count_prefix(e, r->n_tokens, match);
    admitted(e, r, match);
    r->state = REQ_RUNNING;
    r->computed = match;
    e->running[e->num_running++] = r;
    r->sched_take = take;
    e->items[*n_items] = (struct sched_item){
        .r = r, .start = match, .take = take, .plp = plp, .logits = match + take == r->n_tokens};
    (*n_items)++;
    *budget -= take;
    return true;
}

// ---- speculative decoding (engine thread) ----------------------------------------------------
// Writes r's drafts for this step after its known tokens (r->n_draft), within
// the step's token budget (the token itself needs one), the draft rows left,
// and the request's room (the last draft's successor must still fit max_gen).
static void propose(struct tdm_engine *e, struct tdm_engine_request *r, int budget)
{
    r->n_draft = 0;
    if (!r->spec_ok || !tdm_spec_adapt_step(&r->spec_adapt))
        return;
    int maxd = e->cfg.spec.num_speculative_tokens;
    if (maxd > r->max_gen - r->n_gen - 1)
        maxd = r->max_gen - r->n_gen - 1;
    if (maxd > budget - 1)
        maxd = budget - 1;
    if (maxd > e->draft_rows_left)
        maxd = e->draft_rows_left;
    if (maxd <= 0)
        return;
    // hist holds n_prompt + max_gen ids and n_tokens + maxd < n_prompt + max_gen.
    r->n_draft = tdm_spec_propose(&e->cfg.spec, r->hist, r->n_tokens, maxd, r->hist + r->n_tokens);
    e->draft_rows_left -= r->n_draft;
}

// Counts one verification (metrics, stats) and feeds the adaptive pause.
static void spec_count(struct tdm_engine *e, struct tdm_engine_request *r, int accepted)
{
    e->spec_drafts++;
    e->spec_draft_tokens += (uint64_t)r->n_draft;
    e->spec_accepted += (uint64_t)accepted;
    for (int i = 0; i < accepted; i++)
        e->spec_per_pos[i]++;
    struct tdm_metrics_spec *m = e->cfg.spec_metrics;
    if (m) {
        tdm_metrics_counter_inc(m->num_drafts);
        tdm_metrics_counter_add(m->num_draft_tokens, r->n_draft);
        tdm_metrics_counter_add(m->num_accepted_tokens, accepted);
        for (int i = 0; i < accepted && i < m->num_positions; i++)
            tdm_metrics_counter_inc(m->accepted_per_pos[i]);
    }
    if (tdm_spec_adapt_update(&r->spec_adapt, r->n_draft, accepted))
        TDM_LOG_DEBUG(MOD, "req=%s speculation paused for %d steps (low acceptance)", r->id,
                      r->spec_adapt.pause);
}

// Builds this step's schedule into e->items; returns the number of items.
static int schedule(struct tdm_engine *e)
{
    int n_items = 0;
    int budget = e->cfg.max_num_batched_tokens;
    bool preempted = false;
    for (int i = 0; i < e->num_running; i++) {
        e->running[i]->sched_take = 0;
        e->running[i]->n_draft = 0;
    }
    e->draft_rows_left = e->draft_rows;
    e->plp_rows_left = e->plp_rows;
    // Decodes first (one token each), then prompt chunks of running requests.
    // A preemption removes a request from `running` (fcfs its tail, priority
    // scheduling any): the pass starts over, the ones scheduled are skipped.
    for (int pass = 0; pass < 2; pass++) {
        for (int i = 0; i < e->num_running && budget > 0; i++) {
            struct tdm_engine_request *r = e->running[i];
            bool is_decode = r->n_tokens - r->computed == 1;
            if (r->sched_take > 0 || is_decode != (pass == 0))
                continue;
            if (is_decode)
                propose(e, r, budget);
            int before = e->num_running;
            (void)schedule_running(e, r, &n_items, &budget, &preempted);
            if (e->num_running != before)
                i = -1; // r or others left the running set (preempted or failed)
        }
    }
    // vLLM v1: no admissions in a step that had to preempt.
    while (!preempted && e->wait_head != NULL && budget > 0 &&
           e->num_running + e->num_importing < e->cfg.max_num_seqs) {
        if (!admit_one(e, &n_items, &budget))
            break;
    }
    return n_items;
}

// ---- one step (engine thread) -------------------------------------------------------------
// Appends a sampled token (res: its logprobs, or NULL), updates the token
// metrics, then finishes the request or delivers the token.
static void append_token(struct tdm_engine *e, struct tdm_engine_request *r, int32_t tok,
                         const struct tdm_sample_result *res, double now)
{
    struct tdm_metrics_vllm *m = e->m;
    int i = r->n_gen;
    r->hist[r->n_prompt + i] = tok;
    if (r->lp)
        r->lp[i] = res ? res->logprob : 0.0f;
    if (r->top && res)
        memcpy(r->top + (size_t)i * (size_t)r->num_top, res->top,
               (size_t)r->num_top * sizeof *r->top);
    r->n_gen++;
    r->n_tokens++;
    if (m) {
        tdm_metrics_counter_inc(m->generation_tokens);
        if (i == 0) {
            // vLLM v1 counts a request's prompt tokens when its first token comes.
            tdm_metrics_counter_add(m->prompt_tokens, r->n_prompt);
            tdm_metrics_histogram_observe(m->time_to_first_token_seconds, now - r->arrival);
        } else {
            tdm_metrics_histogram_observe(m->inter_token_latency_seconds, now - r->t_last_token);
        }
    }
    if (i == 0)
        r->t_first_token = now;
    r->t_last_token = now;
    bool stop = tdm_sampler_is_stop(r->sampler, tok);
    if (r->gm && !stop) {
        // The grammar follows every token that does not end the request. A
        // token it refuses can only be an ending id sampled where the output is
        // complete (ignore_eos), or the fallback draw when the mask left nothing
        // (min_tokens hiding the only allowed EOS): the output is complete
        // then, or the grammar and the token disagree (a P/D peer's token).
        int arc = tdm_grammar_matcher_accept_token(r->gm, tok);
        if (arc != TDM_OK) {
            if (tdm_grammar_matcher_accepts_eos(r->gm)) {
                finish_request(e, r, TDM_FINISH_STOP, -1, TDM_OK, NULL, true);
            } else {
                char msg[160];
                int code = tdm_grammar_accept_error(arc, tok, msg, sizeof msg);
                finish_request(e, r, TDM_FINISH_ERROR, -1, code, msg, true);
            }
            return;
        }
        // Nothing but an ending id can follow: as in vLLM (xgrammar's matcher
        // terminates only on the stop token), the next step samples it under
        // the mask, so it is generated and counted in completion_tokens. Only
        // where that draw could not end the request (ignore_eos, or min_tokens
        // hiding the ending ids) does the request stop here, without it.
        if (tdm_grammar_matcher_is_done(r->gm) && !tdm_sampler_eos_ends(r->sampler)) {
            finish_request(e, r, TDM_FINISH_STOP, -1, TDM_OK, NULL, true);
            return;
        }
    }
    if (stop)
        finish_request(e, r, TDM_FINISH_STOP, tok, TDM_OK, NULL, true);
    else if (r->n_gen >= r->max_gen)
        finish_request(e, r, TDM_FINISH_LENGTH, -1, TDM_OK, NULL, true);
    else
        deliver_token(r);
}

// import_done of an IMPORT_KV request: commit the imported prompt, replay the
// prefill worker's first token through the sampler and join the running set.
static void import_finish(struct tdm_engine *e, struct tdm_engine_request *r, bool ok)
{
    // An abort asked meanwhile wins: the caller gave up (cancel, fallback), the
    // transfer did not fail on its own.
    if (r->abort_pending != TDM_FINISH_NONE) {
        finish_request(e, r, r->abort_pending, -1, TDM_OK,
                       r->abort_pending == TDM_FINISH_ABORT ? "aborted" : NULL, false);
        return;
    }
    if (!ok) {
        finish_request(e, r, TDM_FINISH_ERROR, -1, TDM_ETRANSPORT, "KV import failed",
                       false);
        return;
    }
    list_unlink(&e->import_head, r);
    e->num_importing--;
    tdm_kv_commit(e->kv, &r->seq, r->hist, r->n_prompt);
    r->computed = r->n_prompt;
    r->imported = true;
    // A one-hot row: the sampler records the token and, when it samples, makes
    // the same single draw the prefill worker's sampler made for it.
    float *row = e->logits;
    for (int v = 0; v < e->vocab; v++)
        row[v] = -INFINITY;
    row[r->first_token] = 0.0f;
    int32_t got = tdm_sampler_sample(r->sampler, row, NULL);
    if (got != r->first_token)
        TDM_LOG_WARN(MOD, "req=%s first token %d is masked here (min_tokens?); kept", r->id,
                     (int)r->first_token);
    r->state = REQ_RUNNING;
    e->running[e->num_running++] = r;
    append_token(e, r, r->first_token, NULL, tdm_now());
}

// The forward's per-layer hook for the final prompt chunk of a PREFILL_ONLY
// request with a push hook: the layer is final from here on (exports of it are
// allowed), then the owner hears of it.
static void layer_done(void *arg, int layer)
{
    struct tdm_engine_request *r = arg;
    pthread_mutex_lock(&r->mu);
    r->layers_final = layer + 1;
    pthread_mutex_unlock(&r->mu);
    r->on_layer(r->layer_ctx, r, layer);
}

// ---- structured output: masks -------------------------------------------------------------
static void mask_compute(struct tdm_engine *e, struct tdm_engine_request *r)
{
    double t0 = tdm_now();
    r->gmask_rc = tdm_grammar_matcher_fill_mask(r->gm, r->gmask, e->mask_words);
    r->gmask_eos = tdm_grammar_matcher_accepts_eos(r->gm);
    r->gmask_s = tdm_now() - t0;
}

static void *mask_main(void *arg)
{
    struct tdm_engine *e = arg;
    pthread_setname_np(pthread_self(), "tdm-mask");
    pthread_mutex_lock(&e->mask_mu);
    uint64_t seen = 0; // every thread starts before the first post (mask_gen 0 then)
    for (;;) {
        while (e->mask_gen == seen && !e->mask_quit)
            pthread_cond_wait(&e->mask_cv, &e->mask_mu);
        if (e->mask_quit)
            break;
        seen = e->mask_gen;
        int n = e->n_mask_jobs;
        pthread_mutex_unlock(&e->mask_mu);
        for (;;) {
            int i = atomic_fetch_add_explicit(&e->mask_next, 1, memory_order_relaxed);
            if (i >= n)
                break;
            mask_compute(e, e->mask_jobs[i]);
        }
        pthread_mutex_lock(&e->mask_mu);
        if (--e->mask_busy == 0)
            pthread_cond_broadcast(&e->mask_cv);
    }
    pthread_mutex_unlock(&e->mask_mu);
    return NULL;
}

// Hands this step's masks to the mask threads (started on first use; without
// any they are computed here, before the forward). True when posted.
static bool masks_post(struct tdm_engine *e)
{
    if (!e->mask_tried) {
        e->mask_tried = true;
        e->mask_threads = calloc((size_t)e->cfg.mask_threads, sizeof *e->mask_threads);
        for (int i = 0; e->mask_threads && i < e->cfg.mask_threads; i++) {
            if (tdm_thread_create_deep(&e->mask_threads[i], mask_main, e) != TDM_OK)
                break;
            e->n_mask_threads++;
        }
        if (e->n_mask_threads < e->cfg.mask_threads)
            TDM_LOG_WARN(MOD, "started %d of %d mask threads", e->n_mask_threads,
                         e->cfg.mask_threads);
    }
    if (e->n_mask_threads == 0) {
        for (int i = 0; i < e->n_mask_jobs; i++)
            mask_compute(e, e->mask_jobs[i]);
        return false;
    }
    pthread_mutex_lock(&e->mask_mu);
    atomic_store_explicit(&e->mask_next, 0, memory_order_relaxed);
    e->mask_busy = e->n_mask_threads;
    e->mask_gen++;
    pthread_cond_broadcast(&e->mask_cv);
    pthread_mutex_unlock(&e->mask_mu);
    return true;
}

static void masks_wait(struct tdm_engine *e, bool posted)
{
    if (posted) {
        double t0 = tdm_now();
        pthread_mutex_lock(&e->mask_mu);
        while (e->mask_busy > 0)
            pthread_cond_wait(&e->mask_cv, &e->mask_mu);
        pthread_mutex_unlock(&e->mask_mu);
        e->mask_wait_seconds += tdm_now() - t0;
    }
    for (int i = 0; i < e->n_mask_jobs; i++)
        e->mask_seconds += e->mask_jobs[i]->gmask_s;
    e->num_masks += (uint64_t)e->n_mask_jobs;
}

// The model's choose hook (tdm_model_set_choose_hook): before a step's tokens
// are drawn on the device, the masks the mask threads computed while the
// layers ran, as each drawn constrained row's allow bitmap over the model's
// vocabulary: tdm_grammar_mask_apply's rule (the mask's tokens, none past the
// grammar vocabulary, the ending ids as the matcher accepts the end).
static void step_finish(struct tdm_engine *e, struct sched_item *items, int n_items, int rc);

// tdm_model_forward_wait, its time charged to TDM_ENGINE_PHASE_WAIT.
static int forward_wait(struct tdm_engine *e)
{
    int prev = phase_enter(e, TDM_ENGINE_PHASE_WAIT);
    int rc = tdm_model_forward_wait(e->model);
    phase_enter(e, prev);
    return rc;
}

// allowed_token_ids (the sampler's 64-bit words) into row b's allow bitmap
// (32-bit words, bits past the vocabulary clear), or ANDed into one a grammar
// filled.
static void allow_fill(struct tdm_engine *e, int b, const struct tdm_sampler *s)
{
    const uint64_t *bits = tdm_sampler_allow_bits(s);
    uint32_t *a = e->allow + (size_t)b * e->allow_words;
    for (size_t w = 0; w < e->allow_words; w++)
        a[w] = (uint32_t)(bits[w / 2] >> (32 * (w % 2)));
}

static void allow_and(struct tdm_engine *e, uint32_t *a, const struct tdm_sampler *s)
{
    const uint64_t *bits = tdm_sampler_allow_bits(s);
    for (size_t w = 0; bits && w < e->allow_words; w++)
        a[w] &= (uint32_t)(bits[w / 2] >> (32 * (w % 2)));
}

static void choose_hook(void *arg)
{
    struct tdm_engine *e = arg;
    if (e->n_mask_jobs == 0)
        return;
    if (e->masks_deferred) {
        // A row of this step follows a token of the step in flight: that
        // step taken and finished first (its tokens recorded, the grammars
        // advanced by them) while this step's layers run, then the masks.
        int rc = forward_wait(e);
        int n = e->fl_n;
        e->fl_n = 0;
        e->fl_taken = true;
        step_finish(e, e->fl_items, n, rc);
        int k = 0; // a request that token ended has its row discarded: no mask
        for (int i = 0; i < e->n_mask_jobs; i++)
            if (e->mask_jobs[i]->state == REQ_RUNNING)
                e->mask_jobs[k++] = e->mask_jobs[i];
        e->n_mask_jobs = k;
        e->masks_posted = k > 0 && masks_post(e);
    }
    masks_wait(e, e->masks_posted);
    e->masks_waited = true;
    int32_t lim = tdm_grammar_vocab_size(e->cfg.grammar_vocab);
    lim = lim < e->vocab ? lim : e->vocab;
    for (int b = 0; b < e->n_step_items; b++) {
        struct tdm_engine_request *r = e->items[b].r;
        if (!e->items[b].drawn || r->gm == NULL || e->batch[b].allow == NULL)
            continue;
        uint32_t *a = e->allow + (size_t)b * e->allow_words;
        size_t full = r->gmask_rc == TDM_OK ? (size_t)lim / 32 : 0;
        if (full > 0)
            memcpy(a, r->gmask, full * sizeof *a);
        memset(a + full, 0, (e->allow_words - full) * sizeof *a);
        if (r->gmask_rc == TDM_OK && lim % 32) // the word the grammar vocabulary ends in
            a[full] = r->gmask[full] & ((1u << (lim % 32)) - 1u);
        for (int i = 0; i < r->n_gend && i < TDM_GRAMMAR_MAX_END_IDS; i++) {
            int32_t t = r->gend[i];
            if (t < 0 || t >= e->vocab)
                continue;
            if (r->gmask_eos)
                a[t / 32] |= 1u << (t % 32);
            else
                a[t / 32] &= ~(1u << (t % 32));
        }
        allow_and(e, a, r->sampler); // and allowed_token_ids, where given
    }
}

// Logits of tokens the grammar does not allow become -inf; the ending ids keep
// their logit only where the output is complete.
static void mask_apply(struct tdm_engine *e, struct tdm_engine_request *r, float *row)
{
    tdm_grammar_mask_apply(r->gmask, tdm_grammar_vocab_size(e->cfg.grammar_vocab), row, e->vocab,
                           r->gend, r->n_gend, r->gmask_eos);
}

// Takes the n tokens a verification gave (e->spec_out; res: their logprobs,
// or NULL): rolls the KV back to the accepted tokens (the rejected drafts'
// positions are simply overwritten later; blocks wholly past them go back to
// the pool) and appends the tokens. r->computed already counts the last known
// token only.
static void spec_accept(struct tdm_engine *e, struct tdm_engine_request *r, int n,
                        const struct tdm_sample_result *res, double now)
{
    const int32_t *draft = r->hist + r->n_tokens;
    int accepted = 0;
    while (accepted < n && accepted < r->n_draft && e->spec_out[accepted] == draft[accepted])
        accepted++;
    spec_count(e, r, accepted);
    // KV is valid for the last known token and the drafts before the last
    // sampled token: those equal the tokens now appended.
    r->computed += n - 1;
    tdm_kv_commit(e->kv, &r->seq, r->hist, r->computed);
    tdm_kv_trim(e->kv, &r->seq, r->computed + 1);
    r->n_draft = 0;
    for (int j = 0; j < n && r->state == REQ_RUNNING; j++)
        append_token(e, r, e->spec_out[j], res ? &res[j] : NULL, now);
}

// Verifies r's drafts against its 1 + n_draft logits rows (tdm_sampler_verify:
// exact for greedy and sampling) on the host.
static void spec_verify(struct tdm_engine *e, struct tdm_engine_request *r, float *rows, double now)
{
    const int32_t *draft = r->hist + r->n_tokens;
    struct tdm_sample_result *res = r->want_logprobs ? e->spec_res : NULL;
    int n = tdm_sampler_verify(r->sampler, rows, draft, r->n_draft, e->spec_out, res);
    spec_accept(e, r, n, res, now);
}

// The same verification from the rows' tokens drawn on the device, each with
// the drafts before it ahead of the history (tdm_sampler_draw_prepare_ahead):
// the tokens tdm_sampler_verify takes from the same rows, recorded as it
// records them, stopping where it stops.
static void spec_verify_drawn(struct tdm_engine *e, struct tdm_engine_request *r,
                              const struct sched_item *it, double now)
{
    const int32_t *draft = r->hist + r->n_tokens;
    const int32_t *tok = e->vtok + it->v_off;
    struct tdm_sample_result *res = r->want_logprobs ? e->spec_res : NULL;
    int n = 0;
    for (int j = 0; j <= r->n_draft; j++) {
        e->spec_out[n] = tok[j];
        if (res)
            tdm_sampler_draw_logprobs(&e->vlp[it->v_off + j], tok[j], &res[n]);
        n++;
        tdm_sampler_replay(r->sampler, &tok[j], 1);
        if (j == r->n_draft || tok[j] != draft[j] || tdm_sampler_is_stop(r->sampler, tok[j]))
            break;
    }
    e->drawn_verify_rows += (uint64_t)r->n_draft + 1;
    spec_accept(e, r, n, res, now);
}

// Sampling a step's rows: the engine thread alone took ~36 % of a decode
// worker at 64 streams of a 151 936-token vocabulary (issue 26), while the
// backend's compute threads waited for the next forward. Each row has its own
// sampler (state and scratch), so rows are independent: the threads take them
// one at a time, and the engine thread appends the tokens in batch order
// afterwards, so the output is the same whatever thread sampled a row.
// Below this many logits in all, waking the threads costs more than it saves.
#define TDM_PARALLEL_SAMPLE_MIN_LOGITS ((size_t)1 << 19)

struct sample_job {
    struct tdm_engine_request *r;
    float *row;
    int32_t tok;
};

static void sample_task(void *arg, int tid, int nthreads)
{
    struct tdm_engine *e = arg;
    (void)tid, (void)nthreads;
    for (;;) {
        int i = atomic_fetch_add(&e->sample_next, 1);
        if (i >= e->n_sjobs)
            return;
        struct sample_job *j = &e->sjobs[i];
        j->tok =
            tdm_sampler_sample(j->r->sampler, j->row, j->r->want_logprobs ? &e->sjob_res[i] : NULL);
    }
}

static void sample_rows(struct tdm_engine *e, double now)
{
    if (e->n_sjobs == 0)
        return;
    atomic_store(&e->sample_next, 0);
    if (e->n_sjobs >= 2 &&
        (size_t)e->n_sjobs * (size_t)e->vocab >= TDM_PARALLEL_SAMPLE_MIN_LOGITS) {
        tdm_model_host_parallel(e->model, sample_task, e);
        e->parallel_sample_steps++;
    } else {
        sample_task(e, 0, 1);
    }
    for (int i = 0; i < e->n_sjobs; i++) {
        struct sample_job *j = &e->sjobs[i];
        append_token(e, j->r, j->tok, j->r->want_logprobs ? &e->sjob_res[i] : NULL, now);
    }
    e->n_sjobs = 0;
}

// tdm_sampler_draw_prepare_pending when prev_row >= 0, else
// tdm_sampler_draw_prepare_ahead.
static int draw_prepare_at(const struct tdm_sampler *s, struct tdm_draw_params *d,
                           struct tdm_draw_adj *adj, int cap, const int32_t *ahead, int n_ahead,
                           int prev_row)
{
    return prev_row >= 0 ? tdm_sampler_draw_prepare_pending(s, d, adj, cap, prev_row)
                         : tdm_sampler_draw_prepare_ahead(s, d, adj, cap, ahead, n_ahead);
}

// A draw's parameters and adjustments on the device, its drafts' first
// n_ahead tokens ahead of the history (tdm_sampler_draw_prepare_ahead), or,
// prev_row >= 0, one token further whose token is chosen row prev_row of the
// step in flight (tdm_sampler_draw_prepare_pending: the device merges it in),
// at *used in the step's adj array (grown as needed; *used moves past them).
// False: the host samples the row.
static bool adj_prepare(struct tdm_engine *e, const struct tdm_sampler *s,
                        struct tdm_draw_params *d, const int32_t *ahead, int n_ahead, int prev_row,
                        int *used)
{
    int room = e->adj_cap - *used;
    int n = draw_prepare_at(s, d, e->adj + *used, room, ahead, n_ahead, prev_row);
    if (n < 0)
        return false;
    if (n > room) {
        int cap = *used + n + 1024;
        struct tdm_draw_adj *grown = realloc(e->adj, (size_t)cap * sizeof *grown);
        if (grown == NULL)
            return false;
        e->adj = grown;
        e->adj_cap = cap;
        (void)draw_prepare_at(s, d, e->adj + *used, n, ahead, n_ahead, prev_row);
    }
    d->adj_off = *used;
    *used += n;
    return true;
}

// A row's draw on the device, one token after the step in flight's when
// prev_row >= 0 (that step's chosen row prev_row). A request with a
// repetition, presence or frequency penalty keeps its entries on the device
// (its list): loaded with this row, or, where the list holds the entries of
// this very draw (its last draw was the token before this one's, and the
// min_tokens masks have not gone since its load, and the sampler's entries
// change only by the tokens drawn: no bad word of two tokens or more), read
// there: the row's parameters alone are prepared and uploaded. False: the
// host samples it.
static bool draw_prepare(struct tdm_engine *e, struct sched_item *it, int prev_row, int *used)
{
    struct tdm_engine_request *r = it->r;
    int pending = prev_row >= 0;
    int at = tdm_sampler_num_generated(r->sampler) + pending;
    bool masked = at < tdm_sampler_min_tokens(r->sampler);
    if (r->adj_list > 0 && r->list_epoch == e->list_epoch && r->list_pos == at &&
        (masked || !r->list_masked) &&
        tdm_sampler_draw_list_params(r->sampler, &it->draw, pending) == 0) {
        it->draw.list = r->adj_list;
        it->adj_off = 0;
        r->list_pos = at + 1;
        e->list_rows++;
        return true;
    }
    if (!adj_prepare(e, r->sampler, &it->draw, NULL, 0, prev_row, used))
        return false;
    it->adj_off = it->draw.adj_off;
    if (it->draw.rec_flags != 0 || it->draw.rec_count != 0) {
        it->draw.list = list_take(e, r);
        it->draw.list_load = 1;
        r->list_pos = at + 1;
        r->list_masked = masked;
        r->list_epoch = e->list_epoch;
    }
    return true;
}

// A decode with drafts verified on the device: each of its 1 + n_draft rows
// drawn with the drafts before it ahead of the history, the draws at *v_used
// in vdraw (adj_off: into the step's adj array). False: the rows come to the
// host (tdm_sampler_verify).
static bool verify_prepare(struct tdm_engine *e, struct sched_item *it, int *used, int *v_used)
{
    struct tdm_engine_request *r = it->r;
    const int32_t *draft = r->hist + r->n_tokens;
    int at = *used;
    if (tdm_sampler_allow_bits(r->sampler) != NULL)
        return false; // a verification's draws take no allow bitmap
    for (int j = 0; j <= r->n_draft; j++)
        if (!adj_prepare(e, r->sampler, &e->vdraw[*v_used + j], draft, j, -1, &at))
            return false;
    it->v_off = *v_used;
    *v_used += r->n_draft + 1;
    *used = at;
    return true;
}

// Builds the batch of the step scheduled in e->items[0 .. n_items) and
// issues it: on a device backend its chosen tokens may still be on their way
// on return (the step's finish waits for them). Each item holds a reference
// to its request until then. adj_used: the step's adjustments already in
// e->adj (schedule_ahead's). The issue's result.
static int step_issue(struct tdm_engine *e, int n_items, int adj_used)
{
    struct tdm_metrics_vllm *m = e->m;
    int prev = phase_enter(e, TDM_ENGINE_PHASE_PREPARE);
    int total = 0, v_used = 0;
    for (int b = 0; b < n_items; b++) {
        struct sched_item *it = &e->items[b];
        struct tdm_engine_request *r = it->r;
        atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
        if (it->ahead) {
            // The row after the in-flight step's, its token that step's
            // choice (no token of it read here).
            e->batch[b] =
                (struct tdm_batch_seq){.tokens = &it->fused_tok,
                                       .n_tokens = 1,
                                       .start_pos = it->start,
                                       .block_table = r->seq.block_table,
                                       .prompt_len = r->n_own_prompt,
                                       .logits = it->drawn ? TDM_LOGITS_SAMPLE : TDM_LOGITS_ARGMAX,
                                       .token_out = &it->fused_tok,
                                       .draw = it->drawn ? &it->draw : NULL,
                                       .logprobs_out = &it->lp,
                                       .from_prev = true,
                                       .prev_row = it->prev_row};
            total++;
            continue;
        }
        // A PREFILL_ONLY request's logits row comes with its final chunk: only
        // then is each layer's KV of the whole prompt complete.
        bool push = r->on_layer != NULL && it->logits;
        // A decode with drafts wants a row for its token and for each draft. A
        // plain greedy token (no penalty, bias, mask or logprobs) is the
        // model's fused argmax: its logits row is never written (151 936
        // floats a row; 39 MB a step at 64 rows, issue 26).
        // On a device backend every other token of such a row (penalties,
        // bias and min_tokens masks included: the request's adjustments go
        // with it) is drawn where the head wrote its row, by the sampler's
        // own draw (sample_draw.h): only its id comes back, and the logprobs
        // a request asked (176 bytes instead of the row).
        // A constrained row is drawn there too, its structured-output mask
        // with it (filled by the choose hook once the mask threads are done).
        bool plain_row = it->logits && r->n_draft == 0 && !it->plp;
        it->fused =
            plain_row && r->gm == NULL && e->fused_argmax && tdm_sampler_plain_greedy(r->sampler);
        it->drawn = plain_row && !it->fused && e->device_sampling &&
                    (r->gm == NULL || e->allow != NULL) && draw_prepare(e, it, -1, &adj_used);
        it->fused |= it->drawn;
        // A decode with drafts on a device backend: every row drawn there,
        // with the drafts before it ahead of the history, and only the
        // tokens back (its 1 + n_draft logits rows stay there).
        it->verify_drawn = it->logits && r->n_draft > 0 && it->take == r->n_draft + 1 &&
                           e->device_sampling && e->vdraw != NULL &&
                           verify_prepare(e, it, &adj_used, &v_used);
        enum tdm_logits_mode lm = it->plp            ? TDM_LOGITS_ALL
                                  : !it->logits      ? TDM_LOGITS_NONE
                                  : it->drawn        ? TDM_LOGITS_SAMPLE
                                  : it->verify_drawn ? TDM_LOGITS_DRAW_ALL
                                  : it->fused        ? TDM_LOGITS_ARGMAX
                                  : r->n_draft > 0   ? TDM_LOGITS_ALL
                                                     : TDM_LOGITS_LAST;
        int32_t *tok_out = it->fused          ? &it->fused_tok
                           : it->verify_drawn ? e->vtok + it->v_off
                                              : NULL;
        const struct tdm_draw_params *draw = it->drawn          ? &it->draw
                                             : it->verify_drawn ? e->vdraw + it->v_off
                                                                : NULL;
        struct tdm_draw_logprobs *lp_out = it->drawn && it->draw.logprobs ? &it->lp
                                           : it->verify_drawn             ? e->vlp + it->v_off
                                                                          : NULL;
        e->batch[b] = (struct tdm_batch_seq){.tokens = r->hist + it->start,
                                             .n_tokens = it->take,
                                             .start_pos = it->start,
                                             .block_table = r->seq.block_table,
                                             .prompt_len = r->n_own_prompt,
                                             .logits = lm,
                                             .on_layer = push ? layer_done : NULL,
                                             .layer_arg = push ? r : NULL,
                                             .token_out = tok_out,
                                             .draw = draw,
                                             .logprobs_out = lp_out};
        total += it->take;
    }
    // The adjustments' array settled (it may have grown), each drawn row's
    // (a verification's rows: at their offsets from its start).
    for (int b = 0; b < n_items; b++) {
        if (e->items[b].verify_drawn)
            e->batch[b].adj = e->adj;
        if (e->items[b].drawn) {
            struct tdm_engine_request *r = e->items[b].r;
            e->batch[b].adj = e->adj + e->items[b].adj_off;
            if ((r->gm || tdm_sampler_allow_bits(r->sampler)) && e->allow)
                e->batch[b].allow = e->allow + (size_t)b * e->allow_words;
            if (!r->gm && e->batch[b].allow) // allowed_token_ids alone: static
                allow_fill(e, b, r->sampler);
        }
    }
    // Masks of the constrained sequences that sample this step: computed on
    // the mask thread while the forward runs. Nothing at all when none is.
    // A step built ahead with a row whose grammar follows the step in
    // flight's token: computed in the choose hook after that step.
    e->n_mask_jobs = 0;
    e->masks_deferred = false;
    for (int b = 0; b < n_items; b++)
        if (e->items[b].logits && e->items[b].r->gm) {
            e->mask_jobs[e->n_mask_jobs++] = e->items[b].r;
            e->masks_deferred |= e->items[b].ahead;
        }
    e->mask_items = e->items;
    e->masks_posted = e->n_mask_jobs > 0 && !e->masks_deferred && masks_post(e);
    e->masks_waited = false;
    e->n_step_items = n_items;
    phase_enter(e, TDM_ENGINE_PHASE_FORWARD);
    int rc = tdm_model_forward_issue(e->model, e->kv, e->batch, n_items, e->logits);
    phase_enter(e, prev);
    e->steps++;
    if (m)
        tdm_metrics_histogram_observe(m->iteration_tokens_total, total);
    return rc;
}

// Prompt logprobs from a chunk's rows (TDM_LOGITS_ALL), queued: row j is
// the distribution after position it->start + j, so prompt token
// it->start + j + 1's. Positions filled before a preemption are not queued
// again (the same values: a row's logits do not depend on its chunk).
// plp_run computes them before the step's tokens go out.
static void plp_from_rows(struct tdm_engine *e, struct tdm_engine_request *r,
                          const struct sched_item *it, const float *rows)
{
    for (int j = 0; j < it->take; j++) {
        int p = it->start + j + 1;
        if (p >= r->n_prompt)
            break;
        if (p < r->plp_done)
            continue;
        e->prow[e->n_prow++] = (struct plp_row){r, p, rows + (size_t)j * (size_t)e->vocab};
        r->plp_done = p + 1;
    }
}

static void plp_task(void *arg, int tid, int nthreads)
{
    struct tdm_engine *e = arg;
    (void)tid, (void)nthreads;
    struct tdm_sample_result res;
    for (;;) {
        int i = atomic_fetch_add(&e->prow_next, 1);
        if (i >= e->n_prow)
            return;
        const struct plp_row *q = &e->prow[i];
        struct tdm_engine_request *r = q->r;
        memset(&res, 0, sizeof res);
        tdm_logprobs_of_row(q->row, e->vocab, r->hist[q->pos], r->plp_top, &res,
                            &r->plp_rank[q->pos]);
        r->plp[q->pos] = res.logprob;
        if (r->plp_top > 0)
            memcpy(r->plp_tops + (size_t)q->pos * (size_t)r->plp_top, res.top,
                   (size_t)r->plp_top * sizeof *res.top);
    }
}

// The queued prompt logprobs, on the backend's host threads when there are
// enough (each row is its own, written to its own position).
static void plp_run(struct tdm_engine *e)
{
    if (e->n_prow == 0)
        return;
    atomic_store(&e->prow_next, 0);
    if (e->n_prow >= 2)
        tdm_model_host_parallel(e->model, plp_task, e);
    else
        plp_task(e, 0, 1);
    e->n_prow = 0;
}

// Takes a step's results (items[0 .. n_items), rc: its forward's result,
// issued and waited for): records each request's tokens, finishes requests,
// samples the rows that came to the host, and drops the items' references. A
// request no longer running (aborted while the step was in flight, or
// finished by the token before it) has its row discarded.
static void step_results(struct tdm_engine *e, struct sched_item *items, int n_items, int rc)
{
    // The masks posted last, when they are this step's (not those of a step
    // issued after it, ahead).
    if (e->mask_items == items && e->n_mask_jobs > 0 && !e->masks_waited) {
        masks_wait(e, e->masks_posted);
        e->masks_waited = true;
    }
    if (rc != TDM_OK) {
        char msg[96];
        e->list_epoch++; // what the device lists hold is not known
        snprintf(msg, sizeof msg, "model forward failed: %s", tdm_strerror(rc));
        TDM_LOG_ERR(MOD, "step %llu: %s (%d sequences)", (unsigned long long)e->steps, msg,
                    n_items);
        for (int b = 0; b < n_items; b++)
            if (items[b].r->state == REQ_RUNNING)
                finish_request(e, items[b].r, TDM_FINISH_ERROR, -1, rc, msg, false);
        for (int b = 0; b < n_items; b++)
            req_unref(items[b].r);
        return;
    }
    double now = tdm_now();
    int row = 0;
    for (int b = 0; b < n_items; b++) {
        struct sched_item *it = &items[b];
        struct tdm_engine_request *r = it->r;
        if (r->state != REQ_RUNNING) // an async step's row of a finished request
            continue;
        if (it->verify_drawn) {
            r->computed += 1; // the last known token; spec_accept adds the accepted drafts
            spec_verify_drawn(e, r, it, now);
            continue;
        }
        if (it->logits && r->n_draft > 0) {
            float *rows = e->logits + (size_t)row * (size_t)e->vocab;
            row += 1 + r->n_draft;
            r->computed += 1; // the last known token; spec_verify adds the accepted drafts
            spec_verify(e, r, rows, now);
            continue;
        }
        r->computed += it->take;
        tdm_kv_commit(e->kv, &r->seq, r->hist, r->computed);
        if (it->plp) {
            // Every row's logits; the last one samples below when the
            // chunk ends the prompt.
            plp_from_rows(e, r, it, e->logits + (size_t)row * (size_t)e->vocab);
            row += it->take - (it->logits ? 1 : 0);
        }
        if (!it->logits)
            continue;
        if (r->gm && r->gmask_rc != TDM_OK) {
            // No mask for this token (a grammar too ambiguous here, or memory
            // ran out): the request ends with an error naming why instead of
            // sampling unconstrained (a token drawn on the device is dropped).
            row += !it->fused;
            char msg[160];
            int code = tdm_grammar_mask_error(r->gmask_rc, msg, sizeof msg);
            finish_request(e, r, TDM_FINISH_ERROR, -1, code, msg, false);
            continue;
        }
        if (it->fused) {
            // What tdm_sampler_sample would have recorded (the token, and the
            // output position that keys the next draw).
            tdm_sampler_replay(r->sampler, &it->fused_tok, 1);
            if (it->drawn)
                e->drawn_rows++;
            else
                e->fused_rows++;
            struct tdm_sample_result res = {0};
            if (it->drawn && it->draw.logprobs)
                tdm_sampler_draw_logprobs(&it->lp, it->fused_tok, &res);
            append_token(e, r, it->fused_tok, it->drawn && it->draw.logprobs ? &res : NULL, now);
            continue;
        }
        float *lrow = e->logits + (size_t)row++ * (size_t)e->vocab;
        if (r->gm) {
            double t0 = tdm_now();
            mask_apply(e, r, lrow);
            e->mask_wait_seconds += tdm_now() - t0;
        }
        e->sjobs[e->n_sjobs++] = (struct sample_job){.r = r, .row = lrow};
    }
    plp_run(e); // before any token of theirs goes out
    sample_rows(e, now);
    for (int b = 0; b < n_items; b++)
        req_unref(items[b].r);
}

// step_results, its time charged to TDM_ENGINE_PHASE_FINISH.
static void step_finish(struct tdm_engine *e, struct sched_item *items, int n_items, int rc)
{
    int prev = phase_enter(e, TDM_ENGINE_PHASE_FINISH);
    step_results(e, items, n_items, rc);
    phase_enter(e, prev);
}

// Whether the rows of `it` may go on without its token (async scheduling):
// a prompt chunk with more of the prompt after it (its successor's tokens
// are known), or a row whose token is chosen on the device (greedy, or
// drawn: a penalty's dependence on that token is merged in on the device,
// tdm_sampler_draw_prepare_pending, or recorded into its device list) of a
// request with room for the token after it: a decode row, or a prompt's
// last chunk. Not for drafts, grammar (its mask needs the token), or a push
// hook.
static bool ahead_row(const struct sched_item *it)
{
    const struct tdm_engine_request *r = it->r;
    if (it->verify_drawn || r->n_draft != 0 || r->on_layer != NULL || it->plp)
        return false;
    if (!it->logits)
        return true;
    // A drawn row whose next draw cannot be prepared before this token is
    // known (a bad word of two tokens or more) waits for it.
    if (it->drawn && !tdm_sampler_draw_ahead_ok(r->sampler))
        return false;
    return it->fused && !r->spec_ok && (r->gm == NULL || it->drawn) && r->n_gen + 2 <= r->max_gen;
}

// Whether the step after the one in flight may be issued before its tokens
// are known: every row may go on, and nothing waits for the engine thread
// (a control, an abort, a shutdown, a check). Requests waiting for
// admission join it (schedule_ahead).
static bool ahead_step(struct tdm_engine *e, const struct sched_item *items, int n_items)
{
    if (!e->async)
        return false;
    for (int b = 0; b < n_items; b++)
        if (!ahead_row(&items[b]))
            return false;
    pthread_mutex_lock(&e->mu);
    bool quiet = e->ctl_head == NULL && !e->check_req && !e->stop &&
                 !(e->abort_all && !e->abort_all_applied);
    pthread_mutex_unlock(&e->mu);
    return quiet;
}

// An item for r's rows [start, end) within *budget (its first rows when
// the budget is short), at e->items[*n]; none when no budget is left (r
// waits, as in schedule()). Its last row chooses a token when it reaches
// end. False: a block could not be had without preempting.
static bool ahead_item(struct tdm_engine *e, int *n, int *budget, struct tdm_engine_request *r,
                       int start, int end)
{
    int take = end - start < *budget ? end - start : *budget;
    if (take < 1)
        return true;
    if (tdm_kv_reserve(e->kv, &r->seq, start + take) != TDM_OK)
        return false;
    *budget -= take;
    e->items[(*n)++] =
        (struct sched_item){.r = r, .start = start, .take = take, .logits = start + take == end};
    return true;
}

// The step after the one in flight (fl_items), into e->items, as schedule()
// builds one: decode rows first, then prompt chunks, then admissions. Each
// request with rows in flight gets its next rows past them: its next decode
// row, whose token is the in-flight row's (chosen row k of that step: the
// model takes it on the device), or its prompt's next chunk; a running
// request without rows in flight (a chunk the budget did not reach, a
// request whose imported KV arrived meanwhile) gets its next rows from its
// history; a request the budget does not reach waits, as in schedule().
// Then, with the token budget and sequence slots left, requests waiting for
// admission. Returns the items (0: none, a block could not be had without
// preempting, or a draw was not prepared: the caller waits for the step in
// flight and schedules as usual).
// *adj_used: the draws' adjustments put in e->adj.
static int schedule_ahead(struct tdm_engine *e, int *adj_used)
{
    int n = 0, budget = e->cfg.max_num_batched_tokens;
    uint64_t mark = ++e->ahead_marks;
    *adj_used = 0;
    for (int b = 0; b < e->fl_n; b++)
        e->fl_items[b].r->ahead_mark = mark; // rows in flight: scheduled past them below
    for (int pass = 0; pass < 2; pass++) {
        for (int b = 0, k = 0; b < e->fl_n; b++) {
            const struct sched_item *f = &e->fl_items[b];
            struct tdm_engine_request *r = f->r;
            int prev_row = f->logits ? k++ : -1; // its chosen row in the step in flight
            // Aborted while in flight, or not this pass's (decodes first).
            if (r->state != REQ_RUNNING || f->logits != (pass == 0))
                continue;
            // Past its rows in flight: the prompt's next chunk, or one decode
            // row (the in-flight row's token is not in its history yet).
            int at = f->start + f->take, added = n;
            if (!ahead_item(e, &n, &budget, r, at, f->logits ? at + 1 : r->n_tokens))
                return 0;
            if (!f->logits || n == added)
                continue; // a chunk, or no budget: it waits for the step in flight
            struct sched_item *it = &e->items[added];
            it->fused = true;
            it->drawn = f->drawn;
            it->ahead = true;
            it->prev_row = prev_row;
            // Prepared as after one token more: the key and min_tokens by
            // the count; the penalties' part of that token merged in on the
            // device, or recorded there into the request's list by that
            // step's draw.
            if (it->drawn && !draw_prepare(e, it, prev_row, adj_used))
                return 0;
        }
        for (int i = 0; i < e->num_running; i++) {
            struct tdm_engine_request *r = e->running[i];
            bool decode = r->n_tokens - r->computed == 1;
            if (r->ahead_mark == mark || decode != (pass == 0) || r->n_tokens <= r->computed)
                continue;
            if (plp_pending(r))
                return 0; // its rows' logits go to e->logits: a step of its own
            if (!ahead_item(e, &n, &budget, r, r->computed, r->n_tokens))
                return 0;
        }
    }
    while (e->wait_head != NULL && budget > 0 &&
           e->num_running + e->num_importing < e->cfg.max_num_seqs) {
        if (plp_pending(e->wait_head))
            return 0; // admitted by a step of its own (schedule)
        if (!admit_one(e, &n, &budget))
            break;
    }
    return n;
}

// The step just issued (e->items[0 .. n)) becomes the step in flight; its
// items' array is the next step's no more (the two arrays swap).
static void put_in_flight(struct tdm_engine *e, int n)
{
    struct sched_item *t = e->fl_items;
    e->fl_items = e->items;
    e->items = t;
    e->fl_n = n;
}

// Waits for the step in flight, the one issued before it if any, and takes
// its results; rc: a failed issue since (every step in flight failed with it).
static void finish_inflight(struct tdm_engine *e, int rc)
{
    if (rc == TDM_OK)
        rc = forward_wait(e);
    int n = e->fl_n;
    e->fl_n = 0;
    step_finish(e, e->fl_items, n, rc);
}

// The step just issued (e->items[0 .. n), rc: its issue's result) waited
// for and finished.
static void step_wait_finish(struct tdm_engine *e, int n, int rc)
{
    while (rc == TDM_OK && tdm_model_forward_pending(e->model) > 0)
        rc = forward_wait(e);
    step_finish(e, e->items, n, rc);
}

// The step in flight's successor issued ahead of its tokens where it may be
// (then it is the step in flight on return), and the step in flight finished.
static void step_ahead(struct tdm_engine *e)
{
    int adj_used, n = 0;
    bool tried = ahead_step(e, e->fl_items, e->fl_n);
    if (tried) {
        int prev = phase_enter(e, TDM_ENGINE_PHASE_SCHEDULE);
        n = schedule_ahead(e, &adj_used);
        phase_enter(e, prev);
    }
    if (n == 0) {
        e->ahead_refused += tried;
        finish_inflight(e, TDM_OK);
        return;
    }
    int rc = step_issue(e, n, adj_used);
    e->async_steps++;
    // The step in flight taken by the choose hook already (a constrained row
    // followed its token).
    bool taken = e->fl_taken;
    e->fl_taken = false;
    if (rc != TDM_OK) {
        // The model ended every forward in flight with the failed one.
        if (!taken)
            finish_inflight(e, rc);
        step_finish(e, e->items, n, rc);
        return;
    }
    bool pending = tdm_model_forward_pending(e->model) > (taken ? 0 : 1);
    if (!taken)
        finish_inflight(e, TDM_OK);
    // In flight only when its tokens are all it brings back: a row sampled
    // on the host has its logits in e->logits, which the loop's controls
    // may write (an import's first token) before the step is finished.
    bool chosen_only = true;
    for (int b = 0; b < n; b++)
        chosen_only &= (!e->items[b].logits || e->items[b].fused || e->items[b].verify_drawn) &&
                       !e->items[b].plp;
    if (pending && chosen_only) {
        put_in_flight(e, n);
        return;
    }
    // Finished now (prompt chunks alone: the forward ended at issue).
    step_wait_finish(e, n, rc);
}

// Runs the step scheduled in e->items: its results taken, or, where its rows
// may go on without their tokens, left in flight (fl_items) for step_ahead.
static void run_step(struct tdm_engine *e, int n_items)
{
    int rc = step_issue(e, n_items, 0);
    if (rc == TDM_OK && tdm_model_forward_pending(e->model) > 0 &&
        ahead_step(e, e->items, n_items)) {
        put_in_flight(e, n_items);
        return;
    }
    step_wait_finish(e, n_items, rc);
}

// Takes the inbox and the control list; applies aborts and releases.
static void take_control(struct tdm_engine *e, bool *abort_all, bool *stop)
{
    pthread_mutex_lock(&e->mu);
    struct tdm_engine_request *in = e->inbox_head;
    struct tdm_engine_request *ctl = e->ctl_head;
    e->inbox_head = e->inbox_tail = NULL;
    e->ctl_head = NULL;
    // Copy the flags under the lock, so that controls queued from now on go to a
    // fresh entry.
    for (struct tdm_engine_request *c = ctl; c; c = c->ctl_next) {
        c->ctl_exec_next = c->ctl_next; // ctl_next is reused once ctl_queued is false
        c->ctl_queued = false;
        c->ctl_exec_abort = c->ctl_abort;
        c->ctl_exec_release = c->ctl_release;
        c->ctl_exec_import = c->ctl_import_done;
        c->ctl_exec_import_ok = c->ctl_import_ok;
        c->ctl_abort = TDM_FINISH_NONE;
        c->ctl_release = c->ctl_import_done = false;
    }
    *abort_all = e->abort_all;
    *stop = e->stop;
    pthread_mutex_unlock(&e->mu);

    while (in) {
        struct tdm_engine_request *next = in->inbox_next;
        in->inbox_next = NULL;
        wait_enqueue(e, in, false);
        in = next;
    }
    // The control list is LIFO; order does not matter for aborts.
    while (ctl) {
        struct tdm_engine_request *next = ctl->ctl_exec_next;
        enum tdm_finish reason = ctl->ctl_exec_abort;
        // An abort queued with (or before) import_done is seen before it.
        if (reason != TDM_FINISH_NONE && ctl->state == REQ_IMPORTING &&
            ctl->abort_pending == TDM_FINISH_NONE)
            ctl->abort_pending = reason; // the importer may be writing its blocks
        if (ctl->ctl_exec_import && ctl->state == REQ_IMPORTING)
            import_finish(e, ctl, ctl->ctl_exec_import_ok);
        if (reason != TDM_FINISH_NONE) {
            if (ctl->state == REQ_WAITING || ctl->state == REQ_RUNNING)
                finish_request(e, ctl, reason, -1, TDM_OK,
                               reason == TDM_FINISH_ABORT ? "aborted" : NULL, false);
            else if (ctl->state == REQ_HELD)
                release_held(e, ctl);
        }
        if (ctl->ctl_exec_release && ctl->state == REQ_HELD)
            release_held(e, ctl);
        req_unref(ctl); // the list's reference
        ctl = next;
    }
    if (*abort_all && !e->abort_all_applied) {
        e->abort_all_applied = true;
        for (struct tdm_engine_request *r = e->import_head; r; r = r->next)
            if (r->abort_pending == TDM_FINISH_NONE)
                r->abort_pending = TDM_FINISH_ABORT;
        while (e->num_running > 0)
            finish_request(e, e->running[e->num_running - 1], TDM_FINISH_ABORT, -1, TDM_OK,
                           "engine shutting down", false);
        while (e->wait_head)
            finish_request(e, e->wait_head, TDM_FINISH_ABORT, -1, TDM_OK,
                           "engine shutting down", false);
    }
}

// Moves the cache's KV events into the shared buffer (caller holds mu). A full
// buffer or a cache ring that overflowed makes the older events useless (the
// consumer resyncs), so they are dropped and the overflow is passed on.
static void drain_kv_events(struct tdm_engine *e)
{
    if (!e->kv_ev)
        return;
    for (;;) {
        if (e->kv_ev_count == e->cfg.kv_event_capacity) {
            if (tdm_kv_events_pending(e->kv) == 0)
                return;
            e->kv_ev_count = 0;
            e->kv_ev_overflow = true;
        }
        bool ovf = false;
        int room = e->cfg.kv_event_capacity - e->kv_ev_count;
        int n = tdm_kv_events_take(e->kv, e->kv_ev + e->kv_ev_count, room, &ovf);
        if (ovf) {
            memmove(e->kv_ev, e->kv_ev + e->kv_ev_count, (size_t)n * sizeof *e->kv_ev);
            e->kv_ev_count = 0;
            e->kv_ev_overflow = true;
        }
        e->kv_ev_count += n;
        if (n < room)
            return;
    }
}

int tdm_engine_take_kv_events(struct tdm_engine *e, struct tdm_kv_event *out, int cap,
                              bool *overflow)
{
    if (overflow)
        *overflow = false;
    if (!e || !e->kv_ev || !out || cap <= 0)
        return 0;
    pthread_mutex_lock(&e->mu);
    int n = e->kv_ev_count < cap ? e->kv_ev_count : cap;
    memcpy(out, e->kv_ev, (size_t)n * sizeof *out);
    memmove(e->kv_ev, e->kv_ev + n, (size_t)(e->kv_ev_count - n) * sizeof *out);
    e->kv_ev_count -= n;
    if (overflow)
        *overflow = e->kv_ev_overflow;
    e->kv_ev_overflow = false;
    pthread_mutex_unlock(&e->mu);
    return n;
}

static void *engine_main(void *arg)
{
    struct tdm_engine *e = arg;
    pthread_setname_np(pthread_self(), "tdm-engine");
    bool progressed = true;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        if (e->check_req) {
            e->check_rc = tdm_kv_check(e->kv, e->check_err, sizeof e->check_err);
            e->check_req = false;
            e->check_done = true;
            pthread_cond_broadcast(&e->idle_cv);
        }
        publish_stats(e);
        drain_kv_events(e);
        // Sleep when nothing can move: no step in flight, no new requests, no
        // control, and either no active request or the last step could
        // schedule nothing (blocks held).
        while (e->fl_n == 0 && e->inbox_head == NULL && e->ctl_head == NULL && !e->check_req &&
               !(e->abort_all && !e->abort_all_applied) && !e->stop &&
               (e->num_active == 0 || !progressed)) {
            int prev = phase_enter(e, TDM_ENGINE_PHASE_IDLE);
            pthread_cond_wait(&e->wake, &e->mu);
            phase_enter(e, prev);
        }
        bool exit_now = e->stop && e->fl_n == 0 && e->num_active == 0 && e->num_held == 0 &&
                        e->inbox_head == NULL && e->ctl_head == NULL;
        bool checking = e->check_req;
        pthread_mutex_unlock(&e->mu);
        if (exit_now)
            break;
        if (checking)
            continue;

        bool abort_all, stop;
        take_control(e, &abort_all, &stop);
        if (stop) {
            // Shutdown: nobody may export or import any more.
            while (e->held_head)
                release_held(e, e->held_head);
            while (e->import_head)
                finish_request(e, e->import_head, TDM_FINISH_ABORT, -1, TDM_OK,
                               "engine shutting down", false);
        }
        if (e->fl_n > 0) {
            // A step in flight: its successor issued before its tokens are
            // known where it may be (and the loop comes back here), else it
            // is finished and the step after it scheduled as usual.
            step_ahead(e);
            progressed = true;
            if (e->fl_n > 0)
                continue;
        }
        int prev = phase_enter(e, TDM_ENGINE_PHASE_SCHEDULE);
        int n_items = schedule(e);
        phase_enter(e, prev);
        progressed = n_items > 0;
        if (n_items > 0)
            run_step(e, n_items);
    }
    pthread_mutex_lock(&e->mu);
    publish_stats(e);
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

// ---- creation and shutdown ----------------------------------------------------------------

// Checks cfg and resolves its defaults and the model's bounds in place
// (mask_threads, the speculative config, max_model_len, the batch limits).
static int engine_config_check(struct tdm_engine_config *cfg, struct tdm_model *model, char *err,
                               size_t errlen)
{
    const struct tdm_model_config *mc = tdm_model_config(model);
    const struct tdm_model_opts *mo = tdm_model_opts(model);
    if (cfg->block_size <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: block_size must be > 0, got %d",
                          cfg->block_size);
    if (cfg->num_blocks < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: num_blocks must be >= 0, got %d",
                          cfg->num_blocks);
    if (cfg->max_num_batched_tokens <= 0 || cfg->max_num_seqs <= 0 || cfg->max_waiting <= 0 ||
        cfg->max_model_len < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "engine: max_num_batched_tokens, max_num_seqs and max_waiting must be "
                          "> 0 and max_model_len >= 0");
    if (cfg->kv_event_capacity < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: kv_event_capacity must be >= 0, got %d",
                          cfg->kv_event_capacity);
    if (cfg->mask_threads < 0 || cfg->mask_threads > 64)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "engine: mask_threads must be in [0, 64], got %d", cfg->mask_threads);
    if (cfg->mask_threads == 0) { // a quarter of the cores, 1 to 4: the forward keeps the rest
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        cfg->mask_threads = cores >= 16 ? 4 : cores >= 8 ? (int)(cores / 4) : 1;
    }
    char serr[160];
    if (tdm_spec_config_resolve(&cfg->spec, serr, sizeof serr) != TDM_OK)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: speculative config: %s", serr);
    if (cfg->max_model_len == 0)
        cfg->max_model_len = mc->max_position_embeddings;
    if (cfg->max_model_len > mc->max_position_embeddings || cfg->max_model_len < 2)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "engine: max_model_len %d outside [2, %d] (the model's context)",
                          cfg->max_model_len, mc->max_position_embeddings);
    if (cfg->max_num_batched_tokens > mo->max_batch_tokens)
        cfg->max_num_batched_tokens = mo->max_batch_tokens;
    if (cfg->max_num_seqs > mo->max_batch_seqs)
        cfg->max_num_seqs = mo->max_batch_seqs;
    // Every running request must get its decode token in every step, or the
    // tail of the running set would starve (vLLM requires the same).
    if (cfg->max_num_seqs > cfg->max_num_batched_tokens)
        cfg->max_num_seqs = cfg->max_num_batched_tokens;
    if (cfg->prompt_logprob_rows < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "engine: prompt_logprob_rows must be >= 0, got %d",
                          cfg->prompt_logprob_rows);
    if (cfg->prompt_logprob_rows == 0) {
        size_t rows = ENGINE_PLP_BYTES / ((size_t)mc->vocab_size * sizeof(float));
        cfg->prompt_logprob_rows = rows < ENGINE_PLP_MIN_ROWS ? ENGINE_PLP_MIN_ROWS
                                   : rows > (size_t)INT32_MAX ? INT32_MAX
                                                              : (int)rows;
    }
    if (cfg->prompt_logprob_rows > cfg->max_num_batched_tokens)
        cfg->prompt_logprob_rows = cfg->max_num_batched_tokens;
    return TDM_OK;
}

// The KV cache's config for cfg; sizes cfg->num_blocks from kv_memory_bytes
// when it is 0.
static int engine_kv_config(struct tdm_kv_config *kc, struct tdm_engine_config *cfg,
                            struct tdm_model *model, char *err, size_t errlen)
{
    memset(kc, 0, sizeof *kc);
    tdm_model_kv_config(model, kc);
    kc->block_size = cfg->block_size;
    kc->enable_prefix_caching = cfg->enable_prefix_caching;
    kc->dtype = cfg->kv_dtype;
    if (cfg->num_blocks == 0) {
        kc->num_blocks = 1;
        size_t bb = tdm_kv_block_bytes(kc);
        size_t nb = bb ? cfg->kv_memory_bytes / bb : 0;
        if (nb < 1)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "engine: kv_memory_bytes %zu holds no block of %zu bytes",
                              cfg->kv_memory_bytes, bb);
        cfg->num_blocks =
            nb > (size_t)(INT32_MAX / cfg->block_size) ? INT32_MAX / cfg->block_size : (int)nb;
    }
    kc->num_blocks = cfg->num_blocks;
    return TDM_OK;
}

// The KV event buffer and the per-step arrays, sized by e->cfg. On failure the
// caller frees what was allocated (engine_free_arrays).
static int engine_alloc_arrays(struct tdm_engine *e, char *err, size_t errlen)
{
    const struct tdm_engine_config *cfg = &e->cfg;
    if (cfg->kv_event_capacity > 0) {
        e->kv_ev = calloc((size_t)cfg->kv_event_capacity, sizeof *e->kv_ev);
        if (!e->kv_ev || tdm_kv_events_enable(e->kv, cfg->kv_event_capacity) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: out of memory for %d KV events",
                              cfg->kv_event_capacity);
    }
    size_t ns = (size_t)cfg->max_num_seqs;
    // Speculation: draft rows past the max_num_seqs decode rows, K per
    // sequence up to 64 in all (a step rarely verifies more; beyond, drafts
    // shrink, which changes speed, never output), and one verification's results.
    int k = cfg->spec.num_speculative_tokens;
    e->draft_rows =
        k * cfg->max_num_seqs < (k > 64 ? k : 64) ? k * cfg->max_num_seqs : (k > 64 ? k : 64);
    if (k > 0) {
        size_t vrows = ns + (size_t)e->draft_rows;
        e->spec_res = calloc((size_t)k + 1, sizeof *e->spec_res);
        e->vdraw = calloc(vrows, sizeof *e->vdraw);
        e->vtok = calloc(vrows, sizeof *e->vtok);
        e->vlp = calloc(vrows, sizeof *e->vlp);
    }
    e->running = calloc(ns, sizeof *e->running);
    e->items = calloc(ns, sizeof *e->items);
    e->fl_items = calloc(ns, sizeof *e->fl_items);
    e->batch = calloc(ns, sizeof *e->batch);
    e->logits = malloc((ns + (size_t)e->draft_rows) * (size_t)e->vocab * sizeof(float));
    e->mask_jobs = calloc(ns, sizeof *e->mask_jobs);
    e->sjobs = calloc(ns, sizeof *e->sjobs);
    e->sjob_res = calloc(ns, sizeof *e->sjob_res);
    if (cfg->grammar_vocab)
        e->mask_words = tdm_grammar_mask_words(cfg->grammar_vocab);
    if (!e->running || !e->items || !e->fl_items || !e->batch || !e->logits || !e->mask_jobs ||
        !e->sjobs || !e->sjob_res || (k > 0 && (!e->spec_res || !e->vdraw || !e->vtok || !e->vlp)))
        return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: out of memory");
    return TDM_OK;
}

static void engine_free_arrays(struct tdm_engine *e)
{
    free(e->running);
    free(e->items);
    free(e->fl_items);
    free(e->batch);
    free(e->logits);
    free(e->prow);
    free(e->adj);
    free(e->list_free);
    free(e->allow);
    free(e->spec_res);
    free(e->vdraw);
    free(e->vtok);
    free(e->vlp);
    free(e->sjobs);
    free(e->sjob_res);
    free(e->mask_jobs);
    free(e->kv_ev);
}

// The engine's mutexes and condition variables; on failure none is left.
static int engine_sync_init(struct tdm_engine *e, char *err, size_t errlen)
{
    int rc;
    if (pthread_mutex_init(&e->mu, NULL) != 0)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: mutex init failed");
    if (tdm_cond_init(&e->wake) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: condvar init failed");
        goto fail_mu;
    }
    if (tdm_cond_init(&e->idle_cv) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: condvar init failed");
        goto fail_wake;
    }
    if (pthread_mutex_init(&e->mask_mu, NULL) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: mutex init failed");
        goto fail_idle;
    }
    if (tdm_cond_init(&e->mask_cv) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: condvar init failed");
        goto fail_mask_mu;
    }
    return TDM_OK;

fail_mask_mu:
    pthread_mutex_destroy(&e->mask_mu);
fail_idle:
    pthread_cond_destroy(&e->idle_cv);
fail_wake:
    pthread_cond_destroy(&e->wake);
fail_mu:
    pthread_mutex_destroy(&e->mu);
    return rc;
}

static void engine_sync_destroy(struct tdm_engine *e)
{
    pthread_cond_destroy(&e->mask_cv);
    pthread_mutex_destroy(&e->mask_mu);
    pthread_cond_destroy(&e->idle_cv);
    pthread_cond_destroy(&e->wake);
    pthread_mutex_destroy(&e->mu);
}

int tdm_engine_new(struct tdm_engine **out, struct tdm_model *model,
                   const struct tdm_engine_config *cfg_in, char *err, size_t errlen)
{
    struct tdm_engine_config cfg;
    struct tdm_kv_config kc;
    int rc;
    *out = NULL;
    if (model == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: no model");
    if (cfg_in)
        cfg = *cfg_in;
    else
        tdm_engine_config_default(&cfg);
    if ((rc = engine_config_check(&cfg, model, err, errlen)) != TDM_OK)
        return rc;
    if ((rc = engine_kv_config(&kc, &cfg, model, err, errlen)) != TDM_OK)
        return rc;

    const struct tdm_model_config *mc = tdm_model_config(model);
    struct tdm_engine *e = calloc(1, sizeof *e);
    if (e == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: out of memory");
    e->cfg = cfg;
    e->model = model;
    e->fused_argmax = tdm_model_fused_argmax(model);
    e->device_sampling = tdm_model_device_sampling(model) && !cfg.host_sampling;
    e->async = tdm_model_forward_async(model) && !cfg.sync_scheduling;
    if (e->device_sampling) {
        // Drawn rows' allow bitmaps: structured-output masks (filled by the
        // choose hook) and allowed_token_ids (filled at issue).
        e->allow_words = ((size_t)mc->vocab_size + 31) / 32;
        e->allow = calloc((size_t)cfg.max_num_seqs * e->allow_words, sizeof *e->allow);
        if (e->allow == NULL) { // such rows then sample on the host
            TDM_LOG_WARN(MOD, "no memory for device masks: constrained rows and "
                              "allowed_token_ids sample on the host");
            e->allow_words = 0;
        } else if (cfg.grammar_vocab) {
            tdm_model_set_choose_hook(model, choose_hook, e);
        }
    }
    e->m = cfg.metrics;
    e->vocab = mc->vocab_size;
    e->num_model_eos = mc->num_eos_token_ids;
    for (int i = 0; i < mc->num_eos_token_ids; i++)
        e->model_eos[i] = mc->eos_token_ids[i];
    rc = tdm_model_kv_new(model, &kc, &e->kv, err, errlen);
    if (rc != TDM_OK)
        goto fail_engine;
    if ((rc = engine_alloc_arrays(e, err, errlen)) != TDM_OK)
        goto fail_arrays;
    if ((rc = engine_sync_init(e, err, errlen)) != TDM_OK)
        goto fail_arrays;
    e->phase = TDM_ENGINE_PHASE_OTHER;
    e->phase_t = tdm_now();
    for (int p = 0; e->cfg.thread_seconds && p < TDM_ENGINE_PHASES; p++)
        e->phase_ctr[p] = tdm_metrics_counter_labels(e->cfg.thread_seconds, phase_names[p]);
    pthread_mutex_lock(&e->mu);
    publish_stats(e);
    pthread_mutex_unlock(&e->mu);
    if (tdm_thread_create_deep(&e->thread, engine_main, e) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: cannot start the engine thread");
        goto fail_sync;
    }
    TDM_LOG_INFO(MOD,
                 "started blocks=%d block_size=%d prefix_caching=%d max_num_batched_tokens=%d "
                 "max_num_seqs=%d max_model_len=%d",
                 cfg.num_blocks, cfg.block_size, (int)cfg.enable_prefix_caching,
                 cfg.max_num_batched_tokens, cfg.max_num_seqs, cfg.max_model_len);
    *out = e;
    return TDM_OK;

fail_sync:
    engine_sync_destroy(e);
fail_arrays:
    engine_free_arrays(e);
    tdm_kv_free(e->kv);
fail_engine:
    free(e);
    return rc;
}

int tdm_engine_drain(struct tdm_engine *e, double timeout_s)
{
    int rc = TDM_OK;
    double deadline = timeout_s < 0 ? -1.0 : tdm_now() + timeout_s;
    pthread_mutex_lock(&e->mu);
    e->closed = true;
    while (e->num_active > 0 || e->inbox_head != NULL) {
        if (!tdm_cond_wait_until(&e->idle_cv, &e->mu, deadline))
            break;
    }
    if (e->num_active > 0 || e->inbox_head != NULL) {
        rc = TDM_ETIMEDOUT;
        e->abort_all = true;
        pthread_cond_signal(&e->wake);
        while (e->num_active > 0 || e->inbox_head != NULL)
            pthread_cond_wait(&e->idle_cv, &e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return rc;
}

void tdm_engine_free(struct tdm_engine *e)
{
    if (e == NULL)
        return;
    // Not drain(0): that would wait for importers, who may never call import_done.
    pthread_mutex_lock(&e->mu);
    e->closed = true;
    e->abort_all = true;
    e->stop = true;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    if (e->allow != NULL)
        tdm_model_set_choose_hook(e->model, NULL, NULL); // the model may serve another engine
    pthread_mutex_lock(&e->mask_mu);
    e->mask_quit = true;
    pthread_cond_broadcast(&e->mask_cv);
    pthread_mutex_unlock(&e->mask_mu);
    for (int i = 0; i < e->n_mask_threads; i++)
        pthread_join(e->mask_threads[i], NULL);
    free(e->mask_threads);
    pthread_cond_destroy(&e->mask_cv);
    pthread_mutex_destroy(&e->mask_mu);
    TDM_LOG_INFO(MOD,
                 "stopped steps=%llu finished=%llu preemptions=%llu fused_argmax_tokens=%llu "
                 "device_drawn_tokens=%llu parallel_sample_steps=%llu",
                 (unsigned long long)e->steps, (unsigned long long)e->finished,
                 (unsigned long long)e->preemptions, (unsigned long long)e->fused_rows,
                 (unsigned long long)e->drawn_rows, (unsigned long long)e->parallel_sample_steps);
    pthread_cond_destroy(&e->idle_cv);
    pthread_cond_destroy(&e->wake);
    pthread_mutex_destroy(&e->mu);
    engine_free_arrays(e);
    tdm_kv_free(e->kv);
    free(e);
}

// ---- submit, abort, stream ------------------------------------------------------------------
// Whether `count` more requests may queue now: TDM_ECLOSED while shutting
// down, TDM_EBUSY when the waiting queue has no room for them (one message for
// tdm_engine_admit and tdm_engine_submit, so every path answers alike). Under e->mu.
static int queue_room_locked(struct tdm_engine *e, int count, char *err, size_t errlen)
{
    if (e->closed)
        return tdm_seterr(err, errlen, TDM_ECLOSED, "engine: shutting down");
    if (e->num_queued + count > e->cfg.max_waiting)
        return tdm_seterr(err, errlen, TDM_EBUSY, "the waiting queue is full (--max-waiting %d)",
                          e->cfg.max_waiting);
    return TDM_OK;
}

int tdm_engine_admit(struct tdm_engine *e, int count, char *err, size_t errlen)
{
    if (count > e->cfg.max_waiting)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "%d sequences (n x prompts) exceed the waiting-queue bound "
                          "(--max-waiting %d)",
                          count, e->cfg.max_waiting);
    pthread_mutex_lock(&e->mu);
    int rc = queue_room_locked(e, count, err, errlen);
    pthread_mutex_unlock(&e->mu);
    return rc;
}

// A constrained request's matcher (on the compiled grammar: the caller's, or
// the constraint text's from the process-wide cache), mask buffer and ending ids.
static int grammar_setup(struct tdm_engine *e, struct tdm_engine_request *r,
                         const struct tdm_engine_request_params *p, const int32_t *eos,
                         int num_eos, char *err, size_t errlen)
{
    const struct tdm_grammar_vocab *v = e->cfg.grammar_vocab;
    if (!v)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "req=%s: structured outputs need the tokenizer, which this engine "
                          "was not given",
                          r->id);
    struct tdm_grammar *g = NULL;
    int rc;
    if (p->grammar) {
        g = tdm_grammar_ref(p->grammar);
    } else {
        char gerr[256] = "";
        rc = tdm_grammar_compile_cached(&g, p->sampling.constraint, p->sampling.constraint_text,
                                        p->sampling.constraint_len, gerr, sizeof gerr);
        if (rc != TDM_OK)
            return tdm_seterr(err, errlen, rc, "%s", gerr);
    }
    rc = tdm_grammar_matcher_new(&r->gm, g, v);
    tdm_grammar_unref(g); // the matcher holds its own
    if (rc != TDM_OK && rc != TDM_ENOMEM) { // too ambiguous a start: the request's fault
        char msg[256];
        rc = tdm_grammar_mask_error(rc, msg, sizeof msg);
        return tdm_seterr(err, errlen, rc, "req=%s: %s", r->id, msg);
    }
    r->gmask = malloc(e->mask_words * sizeof *r->gmask);
    if (rc != TDM_OK || !r->gmask)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: out of memory");
    for (int i = 0; i < num_eos; i++)
        r->gend[r->n_gend++] = eos[i];
    for (int i = 0; i < p->sampling.num_stop_token_ids; i++)
        r->gend[r->n_gend++] = p->sampling.stop_token_ids[i];
    return TDM_OK;
}

// Checks a submitted request against the engine (id: the request's, for the
// messages); sets *eos and *num_eos to the ids that end it (the request's own,
// else the model's).
static int submit_validate(const struct tdm_engine *e, const struct tdm_engine_request_params *p,
                           const char *id, const int32_t **eos, int *num_eos, char *err,
                           size_t errlen)
{
    int max_len = e->cfg.max_model_len;
    if (p->prompt == NULL || p->n_prompt <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: empty prompt", id);
    if (p->n_prompt > max_len - 1)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "req=%s: prompt of %d tokens is longer than max_model_len - 1 (%d)", id,
                          p->n_prompt, max_len - 1);
    if (p->params_index < 0 || (p->params_n > 0 && p->params_index >= p->params_n))
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: params_index %d outside [0, n=%d)", id,
                          p->params_index, p->params_n > 0 ? p->params_n : 1);
    if (p->max_tokens < 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: max_tokens must be >= 0, got %d", id,
                          p->max_tokens);
    if (p->cache_salt && strlen(p->cache_salt) > TDM_ENGINE_CACHE_SALT_MAX)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: cache_salt over %d bytes", id,
                          TDM_ENGINE_CACHE_SALT_MAX);
    if (p->priority != 0 && !e->cfg.priority_scheduling)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "Got priority %d but Priority scheduling is not enabled.", p->priority);
    if (p->n_resume < 0 || p->n_resume >= p->n_prompt)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: n_resume %d outside [0, %d)", id,
                          p->n_resume, p->n_prompt);
    if (p->kind != TDM_ENGINE_REQ_GENERATE && p->kind != TDM_ENGINE_REQ_PREFILL_ONLY &&
        p->kind != TDM_ENGINE_REQ_IMPORT_KV)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: unknown request kind %d", id,
                          (int)p->kind);
    for (int i = 0; i < p->n_prompt; i++)
        if (p->prompt[i] < 0 || p->prompt[i] >= e->vocab)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "req=%s: prompt token %d (at %d) outside the vocabulary of %d", id,
                              (int)p->prompt[i], i, e->vocab);
    if (p->want_prompt_logprobs &&
        (p->kind != TDM_ENGINE_REQ_GENERATE || p->n_resume != 0 || p->prompt_top_logprobs < 0 ||
         p->prompt_top_logprobs > TDM_MAX_LOGPROBS))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "req=%s: prompt logprobs need a GENERATE request without resumed "
                          "output and a top count in [0, %d]",
                          id, TDM_MAX_LOGPROBS);
    if (p->on_layer != NULL && p->kind != TDM_ENGINE_REQ_PREFILL_ONLY)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "req=%s: on_layer is for PREFILL_ONLY requests only", id);
    *eos = p->eos_ids ? p->eos_ids : e->model_eos;
    *num_eos = p->eos_ids ? p->num_eos : e->num_model_eos;
    if (*num_eos < 0 || *num_eos > TDM_MAX_EOS)
        return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: num_eos %d outside [0, %d]", id,
                          *num_eos, TDM_MAX_EOS);
    for (int i = 0; i < *num_eos; i++)
        if ((*eos)[i] < 0 || (*eos)[i] >= e->vocab)
            return tdm_seterr(err, errlen, TDM_EINVAL, "req=%s: EOS id %d outside the vocabulary",
                              id, (int)(*eos)[i]);
    char verr[160];
    int rc = tdm_sampling_params_validate(&p->sampling, e->vocab, verr, sizeof verr);
    if (rc != TDM_OK)
        return tdm_seterr(err, errlen, rc, "req=%s: %s", id, verr);
    return TDM_OK;
}

// Frees a request that never reached the engine (no sampler, mutex or condvar).
static void request_discard(struct tdm_engine_request *r)
{
    tdm_grammar_matcher_free(r->gm);
    free(r->gmask);
    free(r->hist);
    free(r->lp);
    free(r->top);
    free(r->plp);
    free(r->plp_rank);
    free(r->plp_tops);
    free(r);
}

// A new request for p holding two references (the caller's and the engine's),
// its fields, history (prompt copied in) and logprob buffers; NULL when out of
// memory.
static struct tdm_engine_request *request_new(struct tdm_engine *e,
                                              const struct tdm_engine_request_params *p,
                                              const char *id, int max_gen)
{
    struct tdm_engine_request *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    atomic_init(&r->refs, 2);
    r->engine = e;
    snprintf(r->id, sizeof r->id, "%s", id);
    r->kind = p->kind;
    r->first_token = -1;
    r->on_output = p->on_output;
    r->ctx = p->ctx;
    r->on_layer = p->on_layer;
    r->layer_ctx = p->layer_ctx;
    r->arrival = p->arrival_time > 0 ? p->arrival_time : tdm_now();
    r->priority = p->priority;
    r->n_prompt = p->n_prompt;
    r->n_own_prompt = p->n_prompt - p->n_resume;
    r->max_gen = max_gen;
    r->max_tokens = p->max_tokens;
    r->params_n = p->params_n > 0 ? p->params_n : 1;
    r->params_index = p->params_index;
    r->want_logprobs = p->sampling.logprobs >= 0;
    r->num_top = tdm_sampling_top_entries(&p->sampling);
    r->n_tokens = p->n_prompt;
    r->stop_token = -1;
    tdm_kv_seq_init(&r->seq);
    if (p->cache_salt)
        r->seq.root_hash = tdm_kv_salt_hash(p->cache_salt, strlen(p->cache_salt));
    r->hist = malloc(((size_t)p->n_prompt + (size_t)max_gen) * sizeof *r->hist);
    if (r->want_logprobs)
        r->lp = calloc((size_t)max_gen, sizeof *r->lp);
    if (r->num_top > 0)
        r->top = calloc((size_t)max_gen * (size_t)r->num_top, sizeof *r->top);
    r->want_plp = p->want_prompt_logprobs;
    r->plp_top = r->want_plp ? p->prompt_top_logprobs : 0;
    r->plp_done = 1; // position 0 has none
    if (r->want_plp) {
        r->plp = calloc((size_t)p->n_prompt, sizeof *r->plp);
        r->plp_rank = calloc((size_t)p->n_prompt, sizeof *r->plp_rank);
        if (r->plp_top > 0)
            r->plp_tops = calloc((size_t)p->n_prompt * (size_t)r->plp_top, sizeof *r->plp_tops);
        r->plp_view = (struct tdm_prompt_logprobs){.n = p->n_prompt,
                                                   .num_top = r->plp_top,
                                                   .logprob = r->plp,
                                                   .rank = r->plp_rank,
                                                   .top = r->plp_tops};
    }
    if (r->hist == NULL || (r->want_logprobs && r->lp == NULL) || (r->num_top > 0 && !r->top) ||
        (r->want_plp && (!r->plp || !r->plp_rank || (r->plp_top > 0 && !r->plp_tops)))) {
        request_discard(r);
        return NULL;
    }
    memcpy(r->hist, p->prompt, (size_t)p->n_prompt * sizeof *r->hist);
    return r;
}

// A constrained request's grammar state, advanced over its resumed tokens
// (the prompt's last n_resume ids, from n_own on).
static int request_grammar(struct tdm_engine *e, struct tdm_engine_request *r,
                           const struct tdm_engine_request_params *p, const char *id,
                           const int32_t *eos, int num_eos, size_t n_own, char *err, size_t errlen)
{
    int rc;
    if ((rc = grammar_setup(e, r, p, eos, num_eos, err, errlen)) != TDM_OK)
        return rc;
    // A resumed stream's tokens were sampled under this constraint: the
    // matcher follows them as it followed them on the first worker.
    for (int i = 0; i < p->n_resume; i++) {
        int32_t tok = p->prompt[n_own + (size_t)i];
        int arc = tdm_grammar_matcher_accept_token(r->gm, tok);
        if (arc != TDM_OK) {
            char msg[160];
            rc = tdm_grammar_accept_error(arc, tok, msg, sizeof msg);
            return tdm_seterr(err, errlen, rc, "req=%s: resumed token at %d: %s", id, i, msg);
        }
    }
    return TDM_OK;
}

// Appends r to the engine's inbox and wakes the engine thread, unless the
// engine is shutting down or its waiting queue is full.
static int submit_enqueue(struct tdm_engine *e, struct tdm_engine_request *r, char *err,
                          size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    int rc = queue_room_locked(e, 1, err, errlen);
    if (rc != TDM_OK) {
        pthread_mutex_unlock(&e->mu);
        return rc;
    }
    r->state = REQ_NEW;
    if (e->inbox_tail)
        e->inbox_tail->inbox_next = r;
    else
        e->inbox_head = r;
    e->inbox_tail = r;
    e->num_queued++;
    e->num_active++;
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
    return TDM_OK;
}

int tdm_engine_submit(struct tdm_engine *e, const struct tdm_engine_request_params *p,
                      struct tdm_engine_request **out, char *err, size_t errlen)
{
    *out = NULL;
    if (e == NULL || p == NULL)
        return tdm_seterr(err, errlen, TDM_EINVAL, "engine: no engine or params");
    const char *id = p->id ? p->id : "-";
    const int32_t *eos = NULL;
    int num_eos = 0;
    int rc = submit_validate(e, p, id, &eos, &num_eos, err, errlen);
    if (rc != TDM_OK)
        return rc;

    int max_gen = e->cfg.max_model_len - p->n_prompt;
    if (p->max_tokens > 0 && p->max_tokens < max_gen)
        max_gen = p->max_tokens;
    if (p->kind == TDM_ENGINE_REQ_PREFILL_ONLY)
        max_gen = 1;

    struct tdm_engine_request *r = request_new(e, p, id, max_gen);
    if (r == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "engine: out of memory");
    size_t n_own = (size_t)(p->n_prompt - p->n_resume); // the prompt proper
    if (p->grammar || p->sampling.constraint != TDM_CONSTRAINT_NONE) {
        rc = request_grammar(e, r, p, id, eos, num_eos, n_own, err, errlen);
        if (rc != TDM_OK)
            goto fail_request;
    }
    rc = tdm_sampler_new(&r->sampler, &p->sampling, e->vocab, p->prompt, n_own, eos, num_eos);
    if (rc == TDM_OK) // drawn rows take allowed_token_ids as their allow bitmap (step_issue)
        tdm_sampler_set_device_allow(r->sampler, e->allow != NULL);
    if (rc != TDM_OK) {
        rc = tdm_seterr(err, errlen, rc, "req=%s: sampler: %s", id, tdm_strerror(rc));
        goto fail_request;
    }
    tdm_sampler_replay(r->sampler, p->prompt + n_own, (size_t)p->n_resume);
    // Constrained requests do not speculate: their masks follow one token per step.
    r->spec_ok = e->cfg.spec.num_speculative_tokens > 0 && r->gm == NULL &&
                 r->kind != TDM_ENGINE_REQ_PREFILL_ONLY;
    tdm_spec_adapt_init(&r->spec_adapt);
    if (pthread_mutex_init(&r->mu, NULL) != 0) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: mutex init failed");
        goto fail_sampler;
    }
    if (tdm_cond_init(&r->cv) != TDM_OK) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "engine: condvar init failed");
        goto fail_mu;
    }
    if ((rc = submit_enqueue(e, r, err, errlen)) != TDM_OK)
        goto fail_cv;
    TDM_LOG_DEBUG(MOD, "req=%s submitted prompt=%d max_gen=%d", r->id, r->n_prompt, max_gen);
    *out = r;
    return TDM_OK;

fail_cv:
    pthread_cond_destroy(&r->cv);
fail_mu:
    pthread_mutex_destroy(&r->mu);
fail_sampler:
    tdm_sampler_free(r->sampler);
    r->sampler = NULL;
fail_request:
    request_discard(r);
    return rc;
}

// Queues a control for r (abort with reason, or NONE: release held KV).
enum ctl_kind { CTL_ABORT, CTL_RELEASE, CTL_IMPORT_OK, CTL_IMPORT_FAILED };

// Queues a control for r; the list holds a reference until the engine took it.
static void queue_control(struct tdm_engine *e, struct tdm_engine_request *r, enum ctl_kind kind,
                          enum tdm_finish reason)
{
    pthread_mutex_lock(&e->mu);
    if (!r->ctl_queued) {
        r->ctl_queued = true;
        atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
        r->ctl_next = e->ctl_head;
        e->ctl_head = r;
    }
    switch (kind) {
    case CTL_ABORT:
        if (r->ctl_abort == TDM_FINISH_NONE)
            r->ctl_abort = reason;
        break;
    case CTL_RELEASE:
        r->ctl_release = true;
        break;
    case CTL_IMPORT_OK:
    case CTL_IMPORT_FAILED:
        r->ctl_import_done = true;
        r->ctl_import_ok = kind == CTL_IMPORT_OK;
        break;
    }
    pthread_cond_signal(&e->wake);
    pthread_mutex_unlock(&e->mu);
}

int tdm_engine_abort(struct tdm_engine *e, struct tdm_engine_request *r,
                     enum tdm_finish reason)
{
    if (e == NULL || r == NULL || r->engine != e ||
        (reason != TDM_FINISH_ABORT && reason != TDM_FINISH_STOP &&
         reason != TDM_FINISH_LENGTH))
        return TDM_EINVAL;
    queue_control(e, r, CTL_ABORT, reason);
    return TDM_OK;
}

int tdm_engine_release_kv(struct tdm_engine *e, struct tdm_engine_request *r)
{
    if (e == NULL || r == NULL || r->engine != e)
        return TDM_EINVAL;
    pthread_mutex_lock(&r->mu);
    bool ok = r->pub_finished && r->kv_held && !r->kv_release_asked;
    if (ok)
        r->kv_release_asked = true;
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        return TDM_EINVAL;
    queue_control(e, r, CTL_RELEASE, TDM_FINISH_NONE);
    return TDM_OK;
}

// True when r holds KV the caller may read (finished PREFILL_ONLY, not released).
static bool kv_readable(struct tdm_engine_request *r)
{
    pthread_mutex_lock(&r->mu);
    bool ok = r->pub_finished && r->kv_held && !r->kv_release_asked && !r->kv_gone;
    pthread_mutex_unlock(&r->mu);
    return ok;
}

int tdm_engine_kv_header(struct tdm_engine *e, struct tdm_engine_request *r, const char *model,
                         struct tdm_kv_header *h)
{
    if (e == NULL || r == NULL || h == NULL || r->engine != e || !kv_readable(r))
        return TDM_EINVAL;
    tdm_kv_header_fill(e->kv, model ? model : "", h);
    h->num_tokens = r->n_prompt;
    h->first_block = 0;
    h->num_blocks = r->seq.num_blocks;
    return TDM_OK;
}

int tdm_engine_export_layer_as(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                               int first_block, int nblocks, int dtype, void *dst,
                               size_t dst_len)
{
    if (e == NULL || r == NULL || dst == NULL || r->engine != e)
        return TDM_EINVAL;
    // Final KV of this layer, not released: held after the finish, or reported
    // by the push hook during the final step. The seq's block table does not
    // change from the final step on, so reading it here is safe.
    pthread_mutex_lock(&r->mu);
    bool ok = !r->kv_gone && !r->kv_release_asked &&
              ((r->pub_finished && r->kv_held) || layer < r->layers_final);
    if (ok)
        r->exporting++; // drop_kv waits for us
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        return TDM_EINVAL;
    // Validated here and copied by tdm_kv_read_blocks, in tdm_kv_export_layer's
    // layout (K then V, each [nblocks][heads][block_size][head_dim]), rather
    // than through tdm_kv_export_layer: its checks read block refcounts and
    // write the cache's error text, both the engine thread's, which keeps
    // running meanwhile. The lease keeps these blocks referenced, and nothing
    // writes a final layer of them.
    const struct tdm_kv_config *kc = tdm_kv_config(e->kv);
    int rc = TDM_EINVAL;
    if (layer >= 0 && layer < kc->num_layers && first_block >= 0 && nblocks >= 0 &&
        first_block <= r->seq.num_blocks && nblocks <= r->seq.num_blocks - first_block &&
        tdm_kv_dtype_size(dtype) > 0 && dst_len == tdm_kv_layer_bytes_as(e->kv, nblocks, dtype))
        rc = tdm_kv_read_blocks(e->kv, layer, r->seq.block_table + first_block, nblocks, dtype,
                                dst);
    pthread_mutex_lock(&r->mu);
    if (--r->exporting == 0)
        pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int tdm_engine_export_layer(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                            int first_block, int nblocks, void *dst, size_t dst_len)
{
    if (e == NULL)
        return TDM_EINVAL;
    return tdm_engine_export_layer_as(e, r, layer, first_block, nblocks, tdm_kv_dtype(e->kv), dst,
                                      dst_len);
}

enum tdm_kv_dtype tdm_engine_kv_dtype(const struct tdm_engine *e)
{
    return e ? tdm_kv_dtype(e->kv) : TDM_KV_F32;
}

struct tdm_kv_cache *tdm_engine_kv(struct tdm_engine *e)
{
    return e->kv;
}

// The leased layers' KV in device memory before the caller's own copies read
// it. The push hook reports a layer once its kv_store is issued; on a GPU the
// engine thread runs layers ahead of the device, and a lessee copies on a
// stream of its own (CUDA IPC, NCCL) that does not wait for the engine's, so
// without this a copy could read a block before the kernel writing it ran
// (issue 25 item 3: a decode worker's prefix cache kept such KV). The forward
// marked each layer as its stores were issued (tdm_kv_mark_layer): the host
// waits for the last leased layer's mark only, not for the layers the engine
// issued since (item 4). After the finish the forward has synced: done at once.
// Host storage: its writes are done.
static int kv_fence(struct tdm_engine *e, int layer)
{
    return tdm_kv_wait_layer(e->kv, layer);
}

int tdm_engine_export_lease(struct tdm_engine *e, struct tdm_engine_request *r, int layer_end,
                            int first_block, int nblocks, int *ids)
{
    if (e == NULL || r == NULL || ids == NULL || r->engine != e || layer_end < 1 ||
        layer_end > tdm_kv_config(e->kv)->num_layers)
        return TDM_EINVAL;
    pthread_mutex_lock(&r->mu);
    bool ok = !r->kv_gone && !r->kv_release_asked &&
              ((r->pub_finished && r->kv_held) || layer_end <= r->layers_final) &&
              first_block >= 0 && nblocks >= 0 && first_block <= r->seq.num_blocks &&
              nblocks <= r->seq.num_blocks - first_block;
    if (ok) {
        r->exporting++; // drop_kv waits for the unlease
        // The block table does not change from the final step on.
        for (int i = 0; i < nblocks; i++)
            ids[i] = r->seq.block_table[first_block + i];
    }
    pthread_mutex_unlock(&r->mu);
    if (!ok)
        return TDM_EINVAL;
    int rc = nblocks > 0 ? kv_fence(e, layer_end - 1) : TDM_OK;
    if (rc != TDM_OK)
        tdm_engine_export_unlease(e, r);
    return rc;
}

void tdm_engine_export_unlease(struct tdm_engine *e, struct tdm_engine_request *r)
{
    (void)e;
    pthread_mutex_lock(&r->mu);
    if (r->exporting > 0 && --r->exporting == 0)
        pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

int tdm_engine_import_block_ids(struct tdm_engine *e, struct tdm_engine_request *r,
                                int first_block, int nblocks, int *ids)
{
    if (e == NULL || r == NULL || ids == NULL || r->engine != e)
        return TDM_EINVAL;
    pthread_mutex_lock(&r->mu);
    bool open = r->import_ready && !r->import_done_called;
    int lo = r->import_first_block, hi = r->import_first_block + r->import_num_blocks;
    bool ok = open && first_block >= lo && nblocks >= 0 && nblocks <= hi - first_block;
    if (ok)
        for (int i = 0; i < nblocks; i++)
            ids[i] = r->seq.block_table[first_block + i];
    pthread_mutex_unlock(&r->mu);
    return ok ? TDM_OK : TDM_EINVAL;
}

int tdm_engine_import_wait(struct tdm_engine_request *r, double timeout_s, int *first_block,
                           int *num_blocks)
{
    if (r == NULL || r->kind != TDM_ENGINE_REQ_IMPORT_KV)
        return TDM_ECLOSED;
    double deadline = timeout_s < 0 ? -1.0 : tdm_now() + timeout_s;
    int rc = TDM_OK;
    pthread_mutex_lock(&r->mu);
    while (!r->import_ready && !r->pub_finished) {
        if (!tdm_cond_wait_until(&r->cv, &r->mu, deadline)) {
            rc = TDM_ETIMEDOUT;
            break;
        }
    }
    if (rc == TDM_OK && (!r->import_ready || r->import_done_called))
        rc = TDM_ECLOSED;
    if (rc == TDM_OK) {
        if (first_block)
            *first_block = r->import_first_block;
        if (num_blocks)
            *num_blocks = r->import_num_blocks;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

int tdm_engine_import_layer(struct tdm_engine *e, struct tdm_engine_request *r, int layer,
                            int first_block, int nblocks, const void *src, size_t src_len)
{
    if (e == NULL || r == NULL || src == NULL || r->engine != e)
        return TDM_EINVAL;
    pthread_mutex_lock(&r->mu);
    bool open = r->import_ready && !r->import_done_called;
    int lo = r->import_first_block, hi = r->import_first_block + r->import_num_blocks;
    pthread_mutex_unlock(&r->mu);
    // Validated here so that the cache's import cannot fail (and write its error
    // text, which the engine thread owns) when called from another thread.
    const struct tdm_kv_config *kc = tdm_kv_config(e->kv);
    if (!open || layer < 0 || layer >= kc->num_layers || first_block < lo || nblocks < 0 ||
        nblocks > hi - first_block || src_len != tdm_kv_layer_bytes(e->kv, nblocks))
        return TDM_EINVAL;
    return tdm_kv_import_layer(e->kv, &r->seq, layer, first_block, nblocks, src, src_len);
}

int tdm_engine_import_done(struct tdm_engine *e, struct tdm_engine_request *r, int32_t first_token,
                           bool ok)
{
    if (e == NULL || r == NULL || r->engine != e ||
        (ok && (first_token < 0 || first_token >= e->vocab)))
        return TDM_EINVAL;
    pthread_mutex_lock(&r->mu);
    bool open = r->import_ready && !r->import_done_called;
    if (open) {
        r->import_done_called = true;
        r->first_token = ok ? first_token : -1; // read by the engine thread after the control
    }
    pthread_mutex_unlock(&r->mu);
    if (!open)
        return TDM_EINVAL;
    queue_control(e, r, ok ? CTL_IMPORT_OK : CTL_IMPORT_FAILED, TDM_FINISH_NONE);
    return TDM_OK;
}

int tdm_engine_stream_next(struct tdm_engine_request *r, double timeout_s,
                           struct tdm_engine_chunk *out)
{
    memset(out, 0, sizeof *out);
    double deadline = timeout_s < 0 ? -1.0 : tdm_now() + timeout_s;
    pthread_mutex_lock(&r->mu);
    if (r->fin_returned) {
        pthread_mutex_unlock(&r->mu);
        return TDM_ECLOSED;
    }
    while (r->read_pos == r->pub_gen && !r->pub_finished) {
        if (!tdm_cond_wait_until(&r->cv, &r->mu, deadline)) {
            pthread_mutex_unlock(&r->mu);
            return TDM_ETIMEDOUT;
        }
    }
    int i = r->read_pos;
    out->first_index = i;
    out->n = r->pub_gen - i;
    out->tokens = r->hist + r->n_prompt + i;
    out->logprobs = r->lp ? r->lp + i : NULL;
    out->top = r->top ? r->top + (size_t)i * (size_t)r->num_top : NULL;
    out->num_top = r->num_top;
    out->prompt_logprobs = out->n > 0 ? plp_with(r, i) : NULL;
    out->num_prompt_tokens = r->n_prompt;
    out->num_cached_tokens = r->num_cached;
    out->stop_token = -1;
    out->message = "";
    r->read_pos = r->pub_gen;
    if (r->pub_finished) {
        r->fin_returned = true;
        out->finished = true;
        out->reason = r->reason;
        out->stop_token = r->stop_token;
        out->error = r->error;
        out->message = r->message;
        out->kv_held = r->kv_held;
    }
    pthread_mutex_unlock(&r->mu);
    return TDM_OK;
}

int tdm_engine_check_kv(struct tdm_engine *e, char *err, size_t errlen)
{
    pthread_mutex_lock(&e->mu);
    e->check_req = true;
    e->check_done = false;
    pthread_cond_signal(&e->wake);
    while (!e->check_done)
        pthread_cond_wait(&e->idle_cv, &e->mu);
    int rc = e->check_rc;
    if (rc != TDM_OK)
        tdm_seterr(err, errlen, rc, "%s", e->check_err);
    pthread_mutex_unlock(&e->mu);
    return rc;
}
