// SPDX-License-Identifier: Apache-2.0
// prefill: the prefill worker's P/D service (`tandem-prefill`). It is a role on
// the worker base (worker/worker.h's tdm_worker_parts: same engine, model and
// metrics registry, and the worker's HTTP surface: /health, /metrics and the
// OpenAI API) and listens
// on an nng inbox for PrefillRequests from decode workers. Each one names the
// block range the decode worker lacks (it reserved its blocks first) and
// becomes a PREFILL_ONLY engine request (batched and chunked with the others,
// prefix cache first) with a push hook: in the step that computes the prompt's
// final chunk, each group of layers whose KV is final is exported straight into
// a KvData frame and sent while the engine computes the later layers. The
// first token (sampled with the request's own sampler state) goes back in a
// PrefillResult as soon as it exists, between two frames at the latest; the KV
// stays pinned until the last frame is sent. A Cancel, a failed send, frames
// not all sent within hold_seconds of the finish, or the request's deadline
// release the KV as well, so no block outlives its request.
// docs/pd-protocol.md describes the protocol.
#ifndef TDM_PREFILL_H
#define TDM_PREFILL_H

#include <stddef.h>
#include <stdint.h>

struct tdm_worker;
struct tdm_prefill_service;
struct tdm_kvx_ops;

// The prefill worker's default HTTP port (/health, /metrics): its own, so a
// prefill and a decode worker (8001) on one host do not collide.
#define TDM_PREFILL_DEFAULT_PORT 8002

struct tdm_prefill_config {
    char nng_url[256];    // --nng-url: the inbox to listen on; default tcp://127.0.0.1:9002
    double hold_seconds;  // --kv-hold-seconds: release KV whose frames are not all sent this
                          // long after the prefill finished; default 30
    int layers_per_frame; // --layers-per-frame: upper bound on layers per KvData frame; default 4
    double send_timeout;  // seconds one frame may wait for the decode worker; default 5
    const struct tdm_kvx_ops *kvx_ops; // device copies; NULL = the CUDA module's table
                                       // (tdm_backend_module_kvx, looked up when the KV
                                       // pool is on a device; none in a CPU build: KV over
                                       // nng). Tests pass a fake table.
    double nccl_timeout; // NCCL: communicator init, and each layer group's send; default 10
};
void tdm_prefill_config_default(struct tdm_prefill_config *cfg);
// The worker-base defaults of a prefill worker: tdm_worker_config_default with
// port TDM_PREFILL_DEFAULT_PORT.
struct tdm_worker_config;
void tdm_prefill_worker_config_default(struct tdm_worker_config *cfg);
// Takes the prefill-only flags (--nng-url, --kv-hold-seconds, --layers-per-frame)
// out of argv (compacting it; *argc shrinks) so the rest can go to
// tdm_worker_config_parse_args. TDM_EINVAL with err for a bad value.
// The prefill flags' table (core's struct tdm_flags), the first part of
// `tandem-prefill --help`.
struct tdm_flags;
const struct tdm_flags *tdm_prefill_flags(void);
int tdm_prefill_config_take_args(struct tdm_prefill_config *cfg, int *argc, char **argv, char *err,
                                 size_t errlen);

// Starts the service on a loaded worker (tdm_worker_load done): opens
// the inbox, registers the tandem:* transfer metrics, starts handling frames.
// TDM_EBUSY when the server is not loaded, TDM_ETRANSPORT when it cannot listen.
int tdm_prefill_service_new(struct tdm_prefill_service **out, struct tdm_worker *server,
                            const struct tdm_prefill_config *cfg, char *err, size_t errlen);
// The URL decode workers dial (bound port filled in).
const char *tdm_prefill_service_url(const struct tdm_prefill_service *p);
// This process's instance id (in every message it sends).
uint64_t tdm_prefill_service_instance(const struct tdm_prefill_service *p);
// PrefillRequests in progress: jobs listed, from submit until their thread is
// about to free them (tests check that a refused request left none).
int tdm_prefill_service_num_jobs(struct tdm_prefill_service *p);
// Stops receiving, aborts every job (their KV is released) and waits for the job
// threads; call before tdm_worker_free. Accepts NULL.
void tdm_prefill_service_free(struct tdm_prefill_service *p);

#endif
