// SPDX-License-Identifier: Apache-2.0
// kv_transport_impl.h: the worker-wide transport's fields, shared by the
// sender (kv_send.c) and the receiver (kv_recv.c) sides of the table.
#ifndef TDM_KV_TRANSPORT_IMPL_H
#define TDM_KV_TRANSPORT_IMPL_H

#include <pthread.h>

#include "kv_transport.h"

struct tdm_kv_transport {
    struct tdm_kv_transport_config c; // c.ops: the table in use (NULL: nng only)
    bool gpu;                         // a table and our pool is one device allocation
    bool nccl;                        // NCCL possible: gpu, the table's NCCL calls, the setting
    char host_id[96];
    pthread_mutex_t ipc_mu;        // guards ipc (job threads share it)
    struct tdm_kvx_ipc_cache *ipc; // decode pools opened, per peer instance
    struct tdm_kvx_links *links;   // one NCCL communicator per peer
    struct tdm_kvx_pairs *pairs;   // /health details
};

// The receiver side of the modes' tables (kv_recv.c): nng imports each
// frame's payload, CUDA IPC counts the layers its frames say are in place,
// NCCL runs its own receives and counts both.
int tdm_kv_nng_prepare(struct tdm_kv_recv *r, char *err, size_t errlen);
int tdm_kv_nng_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                     size_t errlen);
int tdm_kv_ipc_prepare(struct tdm_kv_recv *r, char *err, size_t errlen);
int tdm_kv_ipc_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                     size_t errlen);
int tdm_kv_nccl_prepare(struct tdm_kv_recv *r, char *err, size_t errlen);
int tdm_kv_nccl_frame(struct tdm_kv_recv *r, const struct tdm_kv_recv_frame *f, char *err,
                      size_t errlen);
int tdm_kv_nccl_complete(struct tdm_kv_recv *r, char *err, size_t errlen);
void tdm_kv_nccl_abort(struct tdm_kv_recv *r);

#endif
