// SPDX-License-Identifier: Apache-2.0
// pd: the P/D runtime that both P/D worker roles run, the decode worker's P/D
// receiver (decode/pd_receiver.c) and the prefill worker (prefill/prefill.c).
// One concern per file: pd_service.c, an inbox and an outbox
// (common/edge/transport), this process's instance id, the dispatch of each frame
// to the role's handler for its type (on the inbox's reader thread of the
// connection it came on) and the answer to LoadQuery, and the stop (flag,
// inbox closed, readers gone) the roles do before they wait for their job
// threads; pd_load.c, the load report a
// LoadQuery is answered with; pd_metrics.c, the shape of the transfer metrics
// both roles keep (bytes, blocks, requests, failures by reason, seconds per
// transfer; each role its own names); pd_flags.c, the check of an --nng-url
// value (the flags themselves are core flag tables, tdm_flags_take). The wire
// conversions (protobuf-c types) are pd_codec.h's, not this header's.
//
// Invariants: the handlers run on the inbox's reader threads, one per peer
// connection: frames of one connection in their order, frames of different
// connections at the same time (handlers lock what they share); a handler that
// waits holds back only its own connection's frames. fill_load runs one call
// at a time (and the report it fills is sent before the next). None runs after
// tdm_pd_service_stop returned; the outbox stays usable from any thread until
// tdm_pd_service_fini (job threads still send after stop).
#ifndef TDM_PD_H
#define TDM_PD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "transport.h"

struct tdm_engine_stats;
struct tdm_metrics_counter;
struct tdm_metrics_histogram;
struct tdm_metrics_registry;

// ---- load reports ------------------------------------------------------------------------
// A worker's load, as it answers a LoadQuery (LoadReport fields; strings borrowed).
struct tdm_pd_load {
    uint64_t instance; // this process's instance id
    const char *role;  // "prefill" or "decode"
    const char *model; // served model name
    int running, waiting;
    float kv_usage; // referenced KV blocks / all
    int free_blocks, total_blocks, block_size;
    int held;        // prefill: KV held for export; decode: imports in progress
    int max_waiting; // the waiting-queue bound (the router admits n x prompts against it)
    int max_running; // the running batch's bound (--max-num-seqs: the router's flow control
                     // counts requests sent beyond it as waiting)
    const char *url; // this worker's inbox URL
    // KV events (decode workers): has_kv_events false = none sent, the router
    // keeps only its approximate index. Arrays borrowed, a hash in at most one.
    bool has_kv_events;
    bool kv_cleared;   // events were lost since the previous report
    uint64_t kv_batch; // 1, 2, ... per report filled
    const uint64_t *kv_stored, *kv_evicted;
    size_t n_kv_stored, n_kv_evicted;
};
// Fills *load (called only for a query that can be answered).
typedef void (*tdm_pd_load_fn)(void *arg, struct tdm_pd_load *load);
// Answers a LOAD_QUERY frame f: unpacks it and, when it names a reply_to inbox,
// sends a LoadReport (fill's load, to_instance and seq from the query) there
// without blocking, so a router that went away cannot stall the caller's
// thread. A malformed query or a failed send is dropped (the asker retries).
void tdm_pd_answer_load_query(struct tdm_net_outbox *ob, const struct tdm_net_frame *f,
                              tdm_pd_load_fn fill, void *arg);

// ---- the service -------------------------------------------------------------------------
struct tdm_pd_service_config {
    const char *url;    // the inbox to listen on ("tcp://127.0.0.1:9002"; port 0 picks one)
    const char *module; // log module and error prefix ("pd", "prefill"); borrowed, static
    // The role's handler by frame type, called with arg; NULL: the frame is
    // ignored (logged at DEBUG). LOAD_QUERY is answered with fill_load instead.
    tdm_net_frame_handler on[TDM_NET_TYPE_MAX + 1];
    tdm_pd_load_fn fill_load; // the load reported to a LoadQuery (tdm_pd_answer_load_query)
    void *arg;                // for the handlers and fill_load
    double stall_s; // the outbox's stall limit (tdm_net_outbox_set_stall): a peer that takes
                    // no byte this long while frames wait is gone, and a frame partly
                    // written is finished until then; 0: none (such a frame is cut at its
                    // send's timeout)
};

// Caller storage (embedded in the role's object); fields read-only to the role.
struct tdm_pd_service {
    uint64_t instance;             // this process's id, in every message it sends
    struct tdm_net_inbox *inbox;   // owned
    struct tdm_net_outbox *outbox; // owned; any thread may send until fini
    struct tdm_net_outbox *liveness; // owned: load reports only, on connections of their
                                     // own, so they never wait behind the token writes of
                                     // busy job threads (busy is not dead)
    atomic_bool stopping;          // set by tdm_pd_service_stop; job threads watch it too
    struct tdm_pd_service_config cfg;
    pthread_mutex_t load_mu; // one LoadQuery answer at a time (fill_load's buffers)
};

// Draws the instance id, opens the outbox (100 ms reconnect) and the inbox on
// cfg->url, whose readers hand frames to the handlers from now on. Errors as
// tdm_net_outbox_new and tdm_net_inbox_new (TDM_ETRANSPORT when it cannot
// listen); on error nothing is left open.
int tdm_pd_service_init(struct tdm_pd_service *s, const struct tdm_pd_service_config *cfg,
                        char *err, size_t errlen);
// The URL peers dial (the bound port filled in).
const char *tdm_pd_service_url(const struct tdm_pd_service *s);
// Sets stopping and closes the inbox, which waits for its readers: no handler
// runs after it returns. The outbox is still open.
void tdm_pd_service_stop(struct tdm_pd_service *s);
// Frees the inbox and the outbox; after stop and after every thread that sends
// has left.
void tdm_pd_service_fini(struct tdm_pd_service *s);

// Fills a load report's common fields: instance and url from s, role, model,
// and the queue and block counts from the engine's stats st. held and KV
// events are the role's.
void tdm_pd_service_load(const struct tdm_pd_service *s, const struct tdm_engine_stats *st,
                         const char *role, const char *model, struct tdm_pd_load *load);

// ---- transfer metrics --------------------------------------------------------------------
struct tdm_pd_metric_text {
    const char *name, *help;
};
// Each role's names and help texts for the five families.
struct tdm_pd_metric_names {
    struct tdm_pd_metric_text bytes, blocks, requests;
    const char *requests_label; // requests' variable label ("prefill"); NULL: none
    struct tdm_pd_metric_text failures, seconds;
};
// Handles from the registry (valid while it lives).
struct tdm_pd_metrics {
    struct tdm_metrics_counter *bytes;     // KV bytes moved
    struct tdm_metrics_counter *blocks;    // KV blocks moved
    struct tdm_metrics_counter *requests;  // requests handled (labelled: update children)
    struct tdm_metrics_counter *failures;  // failures by "reason" (tdm_pd_metrics_fail)
    struct tdm_metrics_histogram *seconds; // seconds per transfer; buckets 0.5 ms .. 10 s
};
// Registers the five families in this order (bytes, blocks, requests,
// failures, seconds). Errors as tdm_metrics_counter_register (a name already
// registered: TDM_EINVAL); the families registered before the error stay.
int tdm_pd_metrics_register(struct tdm_pd_metrics *m, struct tdm_metrics_registry *reg,
                            const struct tdm_pd_metric_names *names, char *err, size_t errlen);
// Counts one failure with label reason="<reason>".
void tdm_pd_metrics_fail(const struct tdm_pd_metrics *m, const char *reason);

// ---- flags -------------------------------------------------------------------------------
// Copies an --nng-url value into dst[dst_size]. TDM_EINVAL "--nng-url: expected
// tcp://HOST:PORT, got \"VALUE\"" (dst unchanged) when it does not fit or has no
// "://"; "" is taken when allow_empty (the decode worker's "P/D off").
int tdm_pd_flag_url(char *dst, size_t dst_size, const char *value, bool allow_empty, char *err,
                    size_t errlen);

#endif
