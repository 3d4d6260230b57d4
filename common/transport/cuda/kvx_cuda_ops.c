// SPDX-License-Identifier: Apache-2.0
// kvx_cuda_ops: the real struct tdm_kvx_ops, over cudart (IPC handles) and
// NCCL (communicators). Built only with TANDEM_CUDA; the only file of the kvx
// module that includes CUDA or NCCL headers. The caller has made the worker's
// device current (cudaSetDevice) on the calling thread. NCCL communicators are
// created non-blocking (ncclConfig_t.blocking = 0), so init and abort return
// at once and progress is read with ncclCommGetAsyncError.
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kvx.h"

_Static_assert(sizeof(cudaIpcMemHandle_t) == TDM_KVX_IPC_HANDLE_BYTES,
               "TDM_KVX_IPC_HANDLE_BYTES != sizeof(cudaIpcMemHandle_t)");
_Static_assert(sizeof(ncclUniqueId) == TDM_KVX_NCCL_ID_BYTES,
               "TDM_KVX_NCCL_ID_BYTES != sizeof(ncclUniqueId)");

static int ipc_open(void *ctx, const uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES], void **dev_ptr,
                    char *err, size_t errlen)
{
    (void)ctx;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    cudaError_t e = cudaIpcOpenMemHandle(dev_ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaIpcOpenMemHandle: %s", cudaGetErrorString(e));
        *dev_ptr = NULL;
        return -1;
    }
    return 0;
}

static int ipc_close(void *ctx, void *dev_ptr)
{
    (void)ctx;
    return cudaIpcCloseMemHandle(dev_ptr) == cudaSuccess ? 0 : -1;
}

static int nccl_unique_id(void *ctx, uint8_t id[TDM_KVX_NCCL_ID_BYTES], char *err, size_t errlen)
{
    (void)ctx;
    ncclUniqueId u;
    ncclResult_t r = ncclGetUniqueId(&u);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclGetUniqueId: %s", ncclGetErrorString(r));
        return -1;
    }
    memcpy(id, &u, sizeof u);
    return 0;
}

static int nccl_init_start(void *ctx, const uint8_t id[TDM_KVX_NCCL_ID_BYTES], int rank,
                           void **comm, char *err, size_t errlen)
{
    (void)ctx;
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclComm_t c = NULL;
    ncclResult_t r = ncclCommInitRankConfig(&c, 2, u, rank, &cfg);
    *comm = c;
    if (r != ncclSuccess && r != ncclInProgress) {
        snprintf(err, errlen, "ncclCommInitRankConfig: %s", ncclGetErrorString(r));
        return -1;
    }
    return 0;
}

static int nccl_state(void *ctx, void *comm, enum tdm_kvx_comm_state *state, char *err,
                      size_t errlen)
{
    (void)ctx;
    ncclResult_t async = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError((ncclComm_t)comm, &async);
    if (r != ncclSuccess) {
        snprintf(err, errlen, "ncclCommGetAsyncError: %s", ncclGetErrorString(r));
        return -1;
    }
    if (async == ncclInProgress) {
        *state = TDM_KVX_COMM_PENDING;
    } else if (async == ncclSuccess) {
        *state = TDM_KVX_COMM_READY;
    } else {
        snprintf(err, errlen, "%s (%s)", ncclGetErrorString(async),
                 ncclGetLastError((ncclComm_t)comm));
        *state = TDM_KVX_COMM_ERROR;
    }
    return 0;
}

static int nccl_abort(void *ctx, void *comm)
{
    (void)ctx;
    return ncclCommAbort((ncclComm_t)comm) == ncclSuccess ? 0 : -1;
}

static int nccl_destroy(void *ctx, void *comm)
{
    (void)ctx;
    return ncclCommDestroy((ncclComm_t)comm) == ncclSuccess ? 0 : -1;
}

static const struct tdm_kvx_ops CUDA_OPS = {
    .ctx = NULL,
    .ipc_open = ipc_open,
    .ipc_close = ipc_close,
    .nccl_unique_id = nccl_unique_id,
    .nccl_init_start = nccl_init_start,
    .nccl_state = nccl_state,
    .nccl_abort = nccl_abort,
    .nccl_destroy = nccl_destroy,
};

const struct tdm_kvx_ops *tdm_kvx_cuda_ops(void)
{
    return &CUDA_OPS;
}
