// SPDX-License-Identifier: Apache-2.0
// kvx_cuda_ops: the real struct tdm_kvx_ops, over cudart (IPC handles) and
// NCCL (communicators). Compiled into the CUDA backend module
// (libtandem-cuda.so, cuda_module.c registers it), the only file of kvx that
// includes CUDA or NCCL headers. The caller has made the worker's
// device current (cudaSetDevice) on the calling thread. NCCL communicators are
// created non-blocking (ncclConfig_t.blocking = 0), so init and abort return
// at once and progress is read with ncclCommGetAsyncError. Copies, NCCL
// send/recv and events go on one stream of the table's own, created on first
// use as cudaStreamNonBlocking so that it never waits for the engine's stream
// (the copy of layer group i overlaps the forward of group i+1).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
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

// ---- data path -------------------------------------------------------------------------------
static pthread_once_t stream_once = PTHREAD_ONCE_INIT;
static cudaStream_t kvx_stream;
static cudaError_t stream_err = cudaSuccess;

static void stream_make(void)
{
    stream_err = cudaStreamCreateWithFlags(&kvx_stream, cudaStreamNonBlocking);
}

static cudaStream_t stream_get(char *err, size_t errlen)
{
    pthread_once(&stream_once, stream_make);
    if (stream_err != cudaSuccess) {
        snprintf(err, errlen, "cudaStreamCreateWithFlags: %s", cudaGetErrorString(stream_err));
        return NULL;
    }
    return kvx_stream;
}

static int ipc_export(void *ctx, void *dev_ptr, uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES],
                      char *err, size_t errlen)
{
    (void)ctx;
    cudaIpcMemHandle_t h;
    cudaError_t e = cudaIpcGetMemHandle(&h, dev_ptr);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaIpcGetMemHandle: %s", cudaGetErrorString(e));
        return -1;
    }
    memcpy(handle, &h, sizeof h);
    return 0;
}

static int copy_async(void *ctx, void *dst, const void *src, size_t bytes, char *err,
                      size_t errlen)
{
    (void)ctx;
    cudaStream_t s = stream_get(err, errlen);
    if (s == NULL)
        return -1;
    cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaMemcpyAsync: %s", cudaGetErrorString(e));
        return -1;
    }
    return 0;
}

static int event_record(void *ctx, void **event, char *err, size_t errlen)
{
    (void)ctx;
    *event = NULL;
    cudaStream_t s = stream_get(err, errlen);
    if (s == NULL)
        return -1;
    cudaEvent_t ev;
    cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
    if (e == cudaSuccess) {
        e = cudaEventRecord(ev, s);
        if (e != cudaSuccess)
            cudaEventDestroy(ev);
    }
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaEventRecord: %s", cudaGetErrorString(e));
        return -1;
    }
    *event = ev;
    return 0;
}

static int event_query(void *ctx, void *event)
{
    (void)ctx;
    cudaError_t e = cudaEventQuery((cudaEvent_t)event);
    return e == cudaSuccess ? 1 : e == cudaErrorNotReady ? 0 : -1;
}

static void event_free(void *ctx, void *event)
{
    (void)ctx;
    cudaEventDestroy((cudaEvent_t)event);
}

static int nccl_xfer(void *comm, void *buf, size_t bytes, int peer, bool send, char *err,
                     size_t errlen)
{
    cudaStream_t s = stream_get(err, errlen);
    if (s == NULL)
        return -1;
    ncclResult_t r = ncclGroupStart();
    if (r == ncclSuccess)
        r = send ? ncclSend(buf, bytes, ncclUint8, peer, (ncclComm_t)comm, s)
                 : ncclRecv(buf, bytes, ncclUint8, peer, (ncclComm_t)comm, s);
    ncclResult_t g = ncclGroupEnd();
    if (r == ncclSuccess)
        r = g;
    if (r != ncclSuccess && r != ncclInProgress) {
        snprintf(err, errlen, "%s: %s", send ? "ncclSend" : "ncclRecv", ncclGetErrorString(r));
        return -1;
    }
    return 0;
}

static int nccl_send(void *ctx, void *comm, const void *buf, size_t bytes, int peer, char *err,
                     size_t errlen)
{
    (void)ctx;
    return nccl_xfer(comm, (void *)buf, bytes, peer, true, err, errlen);
}

static int nccl_recv(void *ctx, void *comm, void *buf, size_t bytes, int peer, char *err,
                     size_t errlen)
{
    (void)ctx;
    return nccl_xfer(comm, buf, bytes, peer, false, err, errlen);
}

static int nccl_group(void *ctx, bool begin, char *err, size_t errlen)
{
    (void)ctx;
    ncclResult_t r = begin ? ncclGroupStart() : ncclGroupEnd();
    if (r != ncclSuccess && r != ncclInProgress) { // non-blocking communicators: in progress
        snprintf(err, errlen, "%s: %s", begin ? "ncclGroupStart" : "ncclGroupEnd",
                 ncclGetErrorString(r));
        return -1;
    }
    return 0;
}

static int dev_alloc(void *ctx, size_t bytes, void **dev_ptr, char *err, size_t errlen)
{
    (void)ctx;
    cudaError_t e = cudaMalloc(dev_ptr, bytes);
    if (e != cudaSuccess) {
        snprintf(err, errlen, "cudaMalloc(%zu): %s", bytes, cudaGetErrorString(e));
        *dev_ptr = NULL;
        return -1;
    }
    return 0;
}

static void dev_free(void *ctx, void *dev_ptr)
{
    (void)ctx;
    cudaFree(dev_ptr);
}

static int use_device_of(void *ctx, const void *dev_ptr, char *err, size_t errlen)
{
    (void)ctx;
    struct cudaPointerAttributes a;
    cudaError_t e = cudaPointerGetAttributes(&a, dev_ptr);
    if (e == cudaSuccess && a.type == cudaMemoryTypeDevice)
        e = cudaSetDevice(a.device);
    else if (e == cudaSuccess)
        e = cudaErrorInvalidDevicePointer;
    if (e != cudaSuccess) {
        snprintf(err, errlen, "the KV pool's device: %s", cudaGetErrorString(e));
        return -1;
    }
    return 0;
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
    .ipc_export = ipc_export,
    .copy_async = copy_async,
    .event_record = event_record,
    .event_query = event_query,
    .event_free = event_free,
    .nccl_send = nccl_send,
    .nccl_recv = nccl_recv,
    .nccl_group = nccl_group,
    .dev_alloc = dev_alloc,
    .dev_free = dev_free,
    .use_device_of = use_device_of,
};

const struct tdm_kvx_ops *tdm_kvx_cuda_table(void)
{
    return &CUDA_OPS;
}
