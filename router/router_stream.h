// SPDX-License-Identifier: Apache-2.0
// router_stream: what the router does with one choice's upstream stream, as
// pure functions (no locks, no I/O, no clock of their own) that router.c's
// pump calls and router_stream_test.c checks: a TokenChunk from the decode
// worker into the choice (common/edge/openai's shared step, tdm_oai_call_take,
// after the checks a peer's bytes need), the verdict on the decode worker's
// liveness, and whether a failed attempt may be retried on another worker.
// protobuf-c types appear here because this is the router's side of the wire
// (router/ is a role, not common/).
#ifndef TDM_ROUTER_STREAM_H
#define TDM_ROUTER_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "hf.h"
#include "openai.h"
#include "tandem.pb-c.h"

// What one TokenChunk did to its choice.
struct tdm_router_take {
    bool stopped;       // a stop string ended the choice: cancel the decode worker's request
    bool upstream_done; // the decode worker sent its finish (nothing to cancel any more)
    bool refused;       // it refused the request before any token (loading or draining,
                        // ECLOSED): another decode worker can take the call
    bool busy;          // it refused the request before any token because its waiting
                        // queue was full or it had no thread for it (EBUSY): overload,
                        // not death; another decode worker can take the call
};

// Feeds TokenChunk m into choice i of k. Untrusted fields are made safe
// first: logprobs are used only when there is one per token, top logprobs only
// when there are num_top per token (and at most TDM_MAX_TOP_ENTRIES of them), a
// finished chunk without a known reason is an error finish, and an error
// finish without a code is TDM_ETRANSPORT. tok_eos and gen decide which stop
// token the response names (tdm_oai_call_take). TDM_OK / TDM_ENOMEM.
int tdm_router_take_chunk(struct tdm_oai_call *k, size_t i, const Tandem__TokenChunk *m,
                          int32_t tok_eos, const struct tdm_generation_config *gen,
                          struct tdm_router_take *out);

enum tdm_router_upstream {
    TDM_ROUTER_UPSTREAM_ALIVE = 0,
    TDM_ROUTER_UPSTREAM_SILENT,    // no load report within liveness_timeout
    TDM_ROUTER_UPSTREAM_RESTARTED, // it reports another instance than the stream's
};
// The decode worker of a stream is alive when it answered a load query within
// liveness_timeout, counted from the later of the stream's start and its last
// report (times in tdm_now() seconds; last_report 0 = never), and, when both
// instances are known, reports the instance the stream talks to. A report
// older than the stream may predate a restart the stream already talks to
// (its first chunk can beat the new instance's first report), so only a
// report newer than the stream's start can say "restarted". router_resumed is
// when the router itself last came back from a stall (0 = never): reports it
// did not read while it was stopped say nothing of the worker, so silence is
// counted from no earlier than that either. unanswered_since: when the router
// sent the second load query the worker has not answered
// (tdm_router_endpoints_unanswered_since; 0 = fewer than two): silent also
// needs that query older than the timeout, so a stall of the router shorter
// than its stall detector (its queries not sent, its reports not read) never
// makes a live worker silent.
enum tdm_router_upstream tdm_router_upstream_check(double now, double stream_started,
                                                   double last_report, double liveness_timeout,
                                                   uint64_t reported_instance,
                                                   uint64_t stream_instance, double router_resumed,
                                                   double unanswered_since);

// True when no choice of k has produced a token yet, so a retry on another
// decode worker is invisible to the client.
bool tdm_router_call_retryable(const struct tdm_oai_call *k);

#endif
