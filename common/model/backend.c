// SPDX-License-Identifier: Apache-2.0
// backend registry: maps a backend name ("cpu", "cuda") to its ops table. This
// is the only place in the project where TANDEM_CUDA decides what is compiled
// in, so the rest of the model code never mentions a particular backend.
#include <string.h>

#include "backend.h"

#ifdef TANDEM_CUDA
extern const struct tdm_backend_ops tdm_cuda_backend_ops;
#endif

static const struct tdm_backend_ops *const backends[] = {
    &tdm_cpu_backend_ops,
#ifdef TANDEM_CUDA
    &tdm_cuda_backend_ops,
#endif
};

const struct tdm_backend_ops *tdm_backend_find(const char *name)
{
    if (name == NULL || name[0] == '\0')
        name = "cpu";
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    return NULL;
}
