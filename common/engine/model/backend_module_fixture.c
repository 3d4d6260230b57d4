// SPDX-License-Identifier: Apache-2.0
// backend_module_fixture: broken backend modules for backend_module_test,
// one per FIXTURE_* definition:
//   FIXTURE_BADVER  registers itself as API TDM_BACKEND_MODULE_API + 1;
//   FIXTURE_NOINIT  exports no init;
//   FIXTURE_DEP     needs a library that is not installed beside it
//                   (libtandem-fixture-gone.so, FIXTURE_GONE);
//   FIXTURE_EMPTY   registers no backend.
#include <stddef.h>

#ifdef FIXTURE_GONE
int tdm_fixture_gone(void);
__attribute__((visibility("default"))) int tdm_fixture_gone(void)
{
    return 1;
}
#else
#include "backend.h"
#include "backend_module.h"

static const struct tdm_backend_ops ops = {.name = "fixture"};
#ifdef FIXTURE_DEP
int tdm_fixture_gone(void);
#endif
static struct tdm_backend_module module = {
    .api = TDM_BACKEND_MODULE_API,
    .name = "fixture",
    .summary = "a test fixture",
    .backend = &ops,
};

#ifdef FIXTURE_NOINIT
#define INIT_NAME tdm_backend_module_start
#else
#define INIT_NAME tdm_backend_module_init
#endif
__attribute__((visibility("default"))) const struct tdm_backend_module *
INIT_NAME(const struct tdm_backend_host *host, char *err, size_t errlen);
const struct tdm_backend_module *INIT_NAME(const struct tdm_backend_host *host, char *err,
                                           size_t errlen)
{
    (void)host, (void)err, (void)errlen;
#ifdef FIXTURE_BADVER
    module.api = TDM_BACKEND_MODULE_API + 1;
#endif
#ifdef FIXTURE_DEP
    if (tdm_fixture_gone() != 1)
        return NULL;
#endif
#ifdef FIXTURE_EMPTY
    module.backend = NULL;
#endif
    return &module;
}
#endif
