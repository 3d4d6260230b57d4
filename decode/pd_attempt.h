// SPDX-License-Identifier: Apache-2.0
// pd_attempt: one remote-prefill attempt of the decode worker's P/D receiver
// as an explicit state machine, apart from the threads, sockets and engine it
// runs on, so that every edge can be unit-tested over a fake transport and a
// fake engine (pd_attempt_test.c).
//
//   SEND ──send ok──▶ AWAIT_RESULT ──result ok, checked──▶ AWAIT_KV ──all layers──▶ COMMITTED
//    │                  │  (KvData may come first)            │
//    └─send failed──▶ FAILED ◀── error result, KV failure, ◀──┘ KV failure, timeout,
//                             bad header, timeout, cancel,     cancel, disconnect
//                             disconnect
//
// A wait ends on the first of: its predicate holds (checked first), the job
// stops (cancel, shutdown, deadline), its own timeout (prefill_timeout from
// the send; transfer_timeout from the result), the prefill worker answering
// no LoadQuery for prefill_liveness (probes go out every probe_interval), or
// the transport staying disconnected for connect_grace. Every exit after the
// send retires the transfer first (no KvData touches the reserved blocks once
// ops->retire returned) and a failure after the send also cancels the prefill
// worker's job, so KV is freed on both sides. FAILED is the retry edge: the
// receiver moves on to the next listed prefill worker with the same reserved
// blocks (at most tdm_pd_attempt_budget of them), then to local prefill.
//
// Threads: tdm_pd_attempt_run runs on the job's thread; the ops are the
// caller's and may block (send, wait). Nothing here allocates.
#ifndef TDM_PD_ATTEMPT_H
#define TDM_PD_ATTEMPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

enum tdm_pd_attempt_state {
    TDM_PD_ATTEMPT_SEND = 0,     // the PrefillRequest is to be sent
    TDM_PD_ATTEMPT_AWAIT_RESULT, // waiting for the PrefillResult (KvData may come first)
    TDM_PD_ATTEMPT_AWAIT_KV,     // result checked; waiting for the layers still missing
    TDM_PD_ATTEMPT_COMMITTED,    // terminal: import finished with the first token, streamed
    TDM_PD_ATTEMPT_FAILED,       // terminal: this worker failed; the blocks stay reserved
};

// Why an attempt failed; tdm_pd_attempt_why_name gives the metric's reason label.
enum tdm_pd_attempt_why {
    TDM_PD_WHY_NONE = 0,
    TDM_PD_WHY_UNREACHABLE,   // the PrefillRequest could not be sent
    TDM_PD_WHY_PREFILL_ERROR, // the prefill worker answered with an error
    TDM_PD_WHY_TRANSFER,      // KV failed or did not complete
    TDM_PD_WHY_DISCONNECTED,  // the worker went silent or its connection dropped
    TDM_PD_WHY_TIMEOUT,       // no result within prefill_timeout (or the job stopped)
    TDM_PD_WHY_HEADER,        // the result does not fit this worker (KV header, first token)
};
const char *tdm_pd_attempt_why_name(enum tdm_pd_attempt_why why);

struct tdm_pd_attempt_config {
    double prefill_timeout;  // seconds from the send to the result
    double transfer_timeout; // seconds from the result to the last layer
    double connect_grace;    // a transport disconnected this long fails the attempt
    double prefill_liveness; // no LoadReport from the worker this long fails the attempt
    double probe_interval;   // seconds between LoadQuery probes while waiting (0.25)
    double poll;             // longest single ops->wait (0.05)
    double send_timeout;     // seconds the PrefillRequest may wait for its peer
    double dial_timeout;     // the same for a worker not connected yet (0.5; a dead one must
                             // not cost the full send timeout)
    int num_layers;          // layers of the model (the KV is complete at this count)
    double write_quarantine; // in-place writes: a prefill worker disconnected this long is gone
                             // with its device context (2)
};

// What the frame handlers recorded for the attempt, copied under its lock by ops->view.
struct tdm_pd_attempt_view {
    bool stop;        // the job must end: cancelled, the service stopping, deadline passed
    bool cancelled;   // the router cancelled (a failure is then not counted)
    bool has_result;  // a PrefillResult of this transfer arrived
    int result_error; // its error code (0 = ok)
    char result_message[256];
    uint64_t peer_instance; // the prefill worker's instance (result sender, else bound, else 0)
    bool kv_failed;         // a KvData frame was refused or reported an error
    char kv_err[256];
    int layers_done;      // layers imported (num_layers when no block is to be sent)
    size_t bytes_done;    // payload bytes imported
    double t_first_frame; // ops->now of the first frame, 0 = none yet
    double t_kv_done;     // ops->now of the last layer imported, 0 = not yet
    double prefill_heard; // ops->now of the worker's last LoadReport, 0 = none
    bool writes_open;     // the worker may still write the reserved blocks in place (offered a
                          // device pool, no closed frame yet)
    bool peer_restarted;  // a LoadReport of this attempt came from another instance
};

// The attempt's record: the state, and for a failure why and the detail to log.
struct tdm_pd_attempt {
    enum tdm_pd_attempt_state state;
    enum tdm_pd_attempt_why why;
    enum tdm_pd_attempt_state failed_in; // the state the failure happened in
    bool counted;                        // a failure to log and count (not a cancel)
    char detail[256];                    // the failure's message
    double t_sent, t_result;             // ops->now before the send / at the result
    double t_drained;                    // ops->now when in-place writes were known over
    bool writes_abandoned;               // known over by the worker's death, not its word
    struct tdm_pd_attempt_view last;     // the view the attempt ended on
};

// The caller's side. ctx is the caller's; every op is required.
struct tdm_pd_attempt_ops {
    double (*now)(void *ctx);
    // Sends the PrefillRequest; TDM_OK or the transport's error with err filled.
    int (*send_prefill)(void *ctx, double timeout_s, char *err, size_t errlen);
    bool (*connected)(void *ctx);  // the transport to the worker is up
    void (*send_probe)(void *ctx); // a LoadQuery the worker answers (prefill_heard)
    void (*send_cancel)(void *ctx, uint64_t instance); // cancel the worker's job
    void (*view)(void *ctx, struct tdm_pd_attempt_view *v);
    // Blocks until the view may have changed or seconds passed.
    void (*wait)(void *ctx, double seconds);
    // Checks the result against this worker (KV header, first token): TDM_OK or
    // TDM_EPROTO with err filled.
    int (*check_result)(void *ctx, char *err, size_t errlen);
    // Ends the transfer: once it returns no KvData touches the reserved blocks
    // and no message of this transfer is accepted.
    void (*retire)(void *ctx);
    // Finishes the import with the result's first token and streams the
    // request; a->last holds the final view (bytes, frame times).
    void (*commit)(void *ctx, const struct tdm_pd_attempt *a);
};

// Fills the defaults of the fields that have one (probe_interval, poll, dial_timeout).
void tdm_pd_attempt_config_default(struct tdm_pd_attempt_config *cfg);

// Runs one attempt from SEND to COMMITTED or FAILED (returned, also in a->state).
enum tdm_pd_attempt_state tdm_pd_attempt_run(struct tdm_pd_attempt *a,
                                             const struct tdm_pd_attempt_config *cfg,
                                             const struct tdm_pd_attempt_ops *ops, void *ctx);

// How many of n_listed prefill workers a request may try: max_attempts when
// it is > 0 and smaller (GenerateRequest.max_prefill_attempts), else all listed.
size_t tdm_pd_attempt_budget(size_t n_listed, int max_attempts);

#endif
