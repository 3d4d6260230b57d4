// SPDX-License-Identifier: Apache-2.0
// backend registry: maps a backend name ("cpu", "cuda") to its ops table. This
// is the only place in the project where TANDEM_CUDA decides what is compiled
// in, so the rest of the model code never mentions a particular backend.
#include <string.h>

#include "backend.h"
#include "core.h"

#ifdef TANDEM_CUDA
#include "cuda_backend.h"
#endif

static const struct tdm_backend_ops *const backends[] = {
    &tdm_cpu_backend_ops,
#ifdef TANDEM_CUDA
    &tdm_cuda_backend_ops,
#endif
};

// Backends added at run time (tdm_backend_register), searched after the built-in ones.
#define MAX_REGISTERED 4
static const struct tdm_backend_ops *registered[MAX_REGISTERED];
static int num_registered;

const struct tdm_backend_ops *tdm_backend_find(const char *name)
{
    if (name == NULL || name[0] == '\0')
        name = "cpu";
    for (size_t i = 0; i < sizeof backends / sizeof backends[0]; i++)
        if (strcmp(backends[i]->name, name) == 0)
            return backends[i];
    for (int i = 0; i < num_registered; i++)
        if (strcmp(registered[i]->name, name) == 0)
            return registered[i];
    return NULL;
}

int tdm_backend_register(const struct tdm_backend_ops *ops)
{
    if (ops == NULL || ops->name == NULL)
        return TDM_EINVAL;
    if (num_registered == MAX_REGISTERED)
        return TDM_ECAPACITY;
    registered[num_registered++] = ops;
    return TDM_OK;
}
