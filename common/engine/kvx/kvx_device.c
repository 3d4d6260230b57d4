// SPDX-License-Identifier: Apache-2.0
// kvx_device: the device KV transfer table comes from the CUDA backend module
// (libtandem-cuda.so, backend_module.h), which holds the cudart and NCCL
// calls (kvx_cuda_ops.c is compiled into it): no binary links CUDA or NCCL.
// Where the module cannot load, tdm_kvx_cuda_ops is NULL and --kv-transfer
// accepts only nng and auto.
#include <stddef.h>

#include "backend_module.h"
#include "core.h"
#include "kvx.h"

const struct tdm_kvx_ops *tdm_kvx_cuda_ops(void)
{
    const struct tdm_backend_module *m;
    if (tdm_backend_module_load("cuda", &m, NULL, 0) != TDM_OK)
        return NULL;
    return m->kvx;
}

int tdm_kvx_check_setting(enum tdm_kvx_mode m, char *err, size_t errlen)
{
    if (m == TDM_KVX_AUTO || m == TDM_KVX_NNG)
        return 0;
    const struct tdm_backend_module *mod;
    char why[1024];
    if (tdm_backend_module_load("cuda", &mod, why, sizeof why) != TDM_OK) {
        snprintf(err, errlen,
                 "--kv-transfer %s needs the CUDA backend module (%s); without it KV moves over "
                 "nng only: use nng or auto",
                 tdm_kvx_mode_name(m), why);
        return -1;
    }
    if (mod->kvx == NULL) {
        snprintf(err, errlen, "--kv-transfer %s: the CUDA backend module has no device transfer",
                 tdm_kvx_mode_name(m));
        return -1;
    }
    return 0;
}
