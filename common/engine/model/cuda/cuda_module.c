// SPDX-License-Identifier: Apache-2.0
// cuda_module: the registration of the CUDA backend module
// (backend_module.h). Compiled twice, as the rest of the backend's host code:
//   libtandem-cuda.so      (TDM_CUDA_MODULE_REAL) the backend over cudart and
//                          cuBLASLt, and the device KV transfer table
//                          (kvx_cuda_ops.c: CUDA IPC and NCCL);
//   libtandem-cuda-emu.so  the same backend over the CUDA execution-model
//                          emulator, with no device KV transfer (a fake table
//                          stands in for it in the tests that need one).
// Only tdm_backend_module_init is exported (the link's version script); the
// module's own copy of core forwards its log lines to the binary's log.
#include <stdio.h>

#include "backend.h"
#include "backend_module.h"
#include "core.h"
#include "cuda_backend.h"

#ifdef TDM_CUDA_MODULE_REAL
#include <cuda_runtime_api.h>
#include <nccl.h>

#include "kvx.h"

#define STR_(x) #x
#define STR(x) STR_(x)
#define MODULE_NAME "cuda"
#define MODULE_OPS tdm_cuda_backend_ops
#define MODULE_SUMMARY                                                                             \
    "cudart " STR(CUDART_VERSION) ", cuBLASLt, NCCL " STR(NCCL_MAJOR) "." STR(NCCL_MINOR) "." STR( \
        NCCL_PATCH)
#else
#define MODULE_NAME "cuda-emu"
#define MODULE_OPS tdm_cuda_emu_backend_ops
#define MODULE_SUMMARY "the CUDA execution-model emulator, no device KV transfer"
#endif

static struct tdm_backend_module module = {
    .api = TDM_BACKEND_MODULE_API,
    .name = MODULE_NAME,
    .summary = MODULE_SUMMARY,
    .backend = &MODULE_OPS,
};

__attribute__((visibility("default"))) const struct tdm_backend_module *
tdm_backend_module_init(const struct tdm_backend_host *host, char *err, size_t errlen);

const struct tdm_backend_module *tdm_backend_module_init(const struct tdm_backend_host *host,
                                                         char *err, size_t errlen)
{
    if (host == NULL || host->api != TDM_BACKEND_MODULE_API) {
        tdm_seterr(err, errlen, TDM_EINVAL,
                   "the module is backend module API %d, the binary API %u (install the module "
                   "built with this binary)",
                   TDM_BACKEND_MODULE_API, host ? host->api : 0u);
        return NULL;
    }
    if (host->backend_ops_bytes != sizeof(struct tdm_backend_ops)) {
        tdm_seterr(err, errlen, TDM_EINVAL,
                   "the backend ops table is %zu bytes here and %u in the binary: they were "
                   "built from different sources",
                   sizeof(struct tdm_backend_ops), host->backend_ops_bytes);
        return NULL;
    }
    if (host->log != NULL) {
        // The binary filters by its own level, which may change later.
        tdm_log_set_sink(host->log);
        atomic_store(&tdm_log_level, TDM_LOG_LEVEL_DEBUG);
    }
#ifdef TDM_CUDA_MODULE_REAL
    module.kvx = tdm_kvx_cuda_table();
#endif
    return &module;
}
