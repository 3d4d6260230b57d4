// SPDX-License-Identifier: Apache-2.0
// kvx_nocuda: a build without CUDA has no device transfer table, so
// tdm_kvx_cuda_ops is NULL and --kv-transfer accepts only nng and auto. The
// TANDEM_CUDA build compiles kvx_cuda_ops.c in its place (CMakeLists.txt).
#include <stddef.h>

#include "kvx.h"

const struct tdm_kvx_ops *tdm_kvx_cuda_ops(void)
{
    return NULL;
}
