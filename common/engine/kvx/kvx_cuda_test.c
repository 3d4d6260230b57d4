// SPDX-License-Identifier: Apache-2.0
// kvx_cuda_test (label gpu): the real CUDA/NCCL table on a GPU.
//  1 CUDA IPC through the cache: a child process (forked before CUDA starts in
//    the parent) allocates a buffer, sends its cudaIpcMemHandle over a pipe;
//    the parent opens it with tdm_kvx_ipc_cache_get, fills it with
//    cudaMemset, closes it; the child reads the bytes back and reports.
//  2 NCCL: a decode-side link with no peer times out after its 1 s init
//    deadline and aborts, returning within 5 s (a missing peer never wedges
//    a worker).
// Exit 77 (SKIPPED) when no GPU is visible; 0 pass; 1 fail.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "backend_module.h"
#include "core.h"
#include "kvx.h"

#define BYTES (1 << 20)

static const struct tdm_kvx_ops *table; // the CUDA module's (tdm_backend_module_kvx)

static int fail(const char *what)
{
    fprintf(stderr, "FAIL %s\n", what);
    return 1;
}

// The child: owns the buffer, hands out its handle, checks what the parent wrote.
static int child(int to_parent, int from_parent)
{
    void *buf = NULL;
    cudaIpcMemHandle_t h;
    if (cudaMalloc(&buf, BYTES) != cudaSuccess || cudaMemset(buf, 0, BYTES) != cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess || cudaIpcGetMemHandle(&h, buf) != cudaSuccess)
        return 2;
    if (write(to_parent, &h, sizeof h) != (ssize_t)sizeof h)
        return 3;
    char done;
    if (read(from_parent, &done, 1) != 1 || done != 'w')
        return 4;
    static unsigned char host[BYTES];
    if (cudaMemcpy(host, buf, BYTES, cudaMemcpyDeviceToHost) != cudaSuccess)
        return 5;
    for (int i = 0; i < BYTES; i++)
        if (host[i] != 0x5a)
            return 6;
    cudaFree(buf);
    return 0;
}

static int test_ipc(void)
{
    int c2p[2], p2c[2];
    if (pipe(c2p) != 0 || pipe(p2c) != 0)
        return fail("pipe");
    pid_t pid = fork();
    if (pid < 0)
        return fail("fork");
    if (pid == 0)
        _exit(child(c2p[1], p2c[0]));
    uint8_t handle[TDM_KVX_IPC_HANDLE_BYTES];
    if (read(c2p[0], handle, sizeof handle) != (ssize_t)sizeof handle)
        return fail("no handle from the child");
    struct tdm_kvx_ipc_cache *cache;
    char err[256];
    void *ptr = NULL, *again = NULL;
    if (tdm_kvx_ipc_cache_new(&cache, table, 4) != TDM_OK)
        return fail("cache_new");
    if (tdm_kvx_ipc_cache_get(cache, "child", 1, handle, &ptr, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "%s\n", err);
        return fail("open the child's handle");
    }
    if (tdm_kvx_ipc_cache_get(cache, "child", 1, handle, &again, err, sizeof err) != TDM_OK ||
        again != ptr)
        return fail("a second get of the same instance must reuse the mapping");
    if (cudaMemset(ptr, 0x5a, BYTES) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess)
        return fail("write through the mapping");
    tdm_kvx_ipc_cache_free(cache); // closes the mapping
    if (write(p2c[1], "w", 1) != 1)
        return fail("signal the child");
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "child status %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
        return fail("the child did not see the bytes written over CUDA IPC");
    }
    printf("ok   CUDA IPC: opened a peer's pool handle once, wrote 1 MiB through it\n");
    return 0;
}

static int test_nccl_timeout(void)
{
    struct tdm_kvx_link *l;
    uint8_t id[TDM_KVX_NCCL_ID_BYTES];
    char err[256];
    if (tdm_kvx_link_new(&l, table, TDM_KVX_DECODE, 1.0) != TDM_OK)
        return fail("link_new");
    double t0 = tdm_now();
    if (tdm_kvx_link_create(l, 1, t0, id, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "%s\n", err);
        return fail("non-blocking NCCL init did not start");
    }
    int rc;
    while ((rc = tdm_kvx_link_poll(l, tdm_now(), err, sizeof err)) == TDM_EBUSY &&
           tdm_now() - t0 < 10)
        usleep(10000);
    double took = tdm_now() - t0;
    tdm_kvx_link_free(l);
    if (rc != TDM_ETIMEDOUT || took > 5) {
        fprintf(stderr, "rc %d after %.1f s: %s\n", rc, took, err);
        return fail("NCCL init without a peer must time out and abort within 5 s");
    }
    printf("ok   NCCL: init without a peer aborted after %.2f s (%s)\n", took, err);
    return 0;
}

int main(void)
{
    // Probe for a GPU in a child, so the parent's CUDA is not started before fork.
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        _exit(cudaGetDeviceCount(&n) == cudaSuccess && n > 0 ? 0 : 77);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        printf("SKIPPED: no GPU visible\n");
        return 77;
    }
    char err[1024];
    if (tdm_backend_module_kvx(&table, err, sizeof err) != TDM_OK || table == NULL) {
        fprintf(stderr, "%s\n", err);
        return fail("the CUDA backend module's device transfer table");
    }
    int failed = test_ipc();
    failed |= test_nccl_timeout();
    return failed;
}
