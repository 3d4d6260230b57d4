// SPDX-License-Identifier: Apache-2.0
// pd_receiver: the decode worker's P/D side. It listens on an nng inbox for the
// router's GenerateRequests and runs each one on the worker's engine (the
// decode role on the worker base, worker/worker.h):
// with a list of prefill workers it first reserves the prompt's blocks (an
// IMPORT_KV engine request; its own prefix-cache match comes first), then asks
// the first prefill worker for a prefill that pushes exactly the missing block
// range (PrefillRequest), imports the KvData frames layer group by layer group
// as they arrive (while the prefill worker still computes later layers), and
// once it has every layer and the PrefillResult (the first token the prefill
// worker sampled) finishes the import and decodes on; tokens go back to the
// router as TokenChunks. A prefill worker that fails, disconnects or is slow is
// replaced by the next listed one (same reserved blocks; at most the request's
// max_prefill_attempts of them; one attempt is decode/pd_attempt.h's state
// machine), then by a local prefill (the router asks for that fallback),
// before any token reached the router, so the client never sees a retry. Every wait is bounded (request
// deadline, prefill and transfer timeouts); a Cancel from the router aborts the
// engine request and cancels the prefill worker's job, so KV is freed on both
// sides. docs/pd-protocol.md describes the protocol.
#ifndef TDM_PD_RECEIVER_H
#define TDM_PD_RECEIVER_H

#include <stddef.h>
#include <stdint.h>

struct tdm_worker;
struct tdm_pd_receiver;
struct tdm_kvx_ops;

struct tdm_pd_receiver_config {
    char nng_url[256];       // --nng-url: inbox; "" = P/D off. e.g. tcp://0.0.0.0:9300
    double prefill_timeout;  // --pd-prefill-timeout: seconds for a PrefillResult; default 60
    double transfer_timeout; // --pd-transfer-timeout: seconds for the KvData still missing
                             // after the PrefillResult; default 30
    double connect_grace;    // a prefill worker disconnected this long counts as failed; 1
    double prefill_liveness; // --pd-prefill-liveness: a prefill worker that answers no
                             // LoadQuery (sent every 0.25 s while waiting on it) this long
                             // counts as failed (hung, stopped); default 2
    int layers_per_frame;    // asked of the prefill worker; default 4
    double send_timeout;     // seconds a frame may wait for its peer; default 2
    double router_liveness;  // --pd-router-liveness: a router connected but taking no byte of
                             // our TokenChunks this long counts as gone; default 30
    double write_quarantine; // in-place KV writes: a prefill worker disconnected this long is
                             // gone with its device context, its blocks are safe (default 2)
    const struct tdm_kvx_ops *kvx_ops; // device copies; NULL = the CUDA module's table
                                       // (tdm_backend_module_kvx, looked up when the KV
                                       // pool is on a device; none in a CPU build: KV over
                                       // nng). Tests pass a fake table.
    double nccl_timeout; // NCCL: communicator init (from the prefill worker's go), and each
                         // layer group's receive; default 10
};
void tdm_pd_receiver_config_default(struct tdm_pd_receiver_config *cfg);
// Takes --nng-url, --pd-prefill-timeout, --pd-transfer-timeout,
// --pd-layers-per-frame and --pd-prefill-liveness out of argv (compacting it) before the decode
// parser sees it. TDM_EINVAL with err for a bad value.
int tdm_pd_receiver_take_args(struct tdm_pd_receiver_config *cfg, int *argc, char **argv, char *err,
                              size_t errlen);
// The P/D flags' table (core's struct tdm_flags): `tandem-decode --help` lists
// it after the decode flags (tdm_flags_help); tdm_pd_receiver_take_args takes
// exactly these.
struct tdm_flags;
const struct tdm_flags *tdm_pd_receiver_flags(void);

// Starts the receiver on a loaded server. TDM_EBUSY before load,
// TDM_ETRANSPORT when it cannot listen.
int tdm_pd_receiver_new(struct tdm_pd_receiver **out, struct tdm_worker *server,
                        const struct tdm_pd_receiver_config *cfg, char *err, size_t errlen);
const char *tdm_pd_receiver_url(const struct tdm_pd_receiver *r);
uint64_t tdm_pd_receiver_instance(const struct tdm_pd_receiver *r);
// GenerateRequests in progress: jobs listed, from accepted until their thread
// is about to free them (tests check that a refused request left none).
int tdm_pd_receiver_num_jobs(struct tdm_pd_receiver *r);
// Stops receiving, aborts every request (each still sends its final chunk when
// the router is reachable) and waits for their threads. Accepts NULL.
void tdm_pd_receiver_free(struct tdm_pd_receiver *r);

#endif
