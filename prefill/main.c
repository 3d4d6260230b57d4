// SPDX-License-Identifier: Apache-2.0
// tandem-prefill: the prefill worker's command line, the worker base's main
// (tdm_worker_main) with the prefill role: its flags (--nng-url,
// --kv-hold-seconds, --layers-per-frame, ...; every other flag is the worker
// base's, as for tandem-decode), its worker defaults, the P/D prefill service
// and its words in the ready line. On the first signal the service stops
// first (held KV is released, its jobs abort), then the HTTP side drains.
#include <stdio.h>

#include "core.h"
#include "prefill.h"
#include "worker.h"

static int take_args(void *cfg, int *argc, char **argv, char *err, size_t errlen)
{
    return tdm_prefill_config_take_args(cfg, argc, argv, err, errlen);
}

static int start(void **svc, struct tdm_worker *s, void *cfg, char *err, size_t errlen)
{
    struct tdm_prefill_service *p = NULL;
    int rc = tdm_prefill_service_new(&p, s, cfg, err, errlen);
    *svc = p;
    return rc;
}

static void describe(void *svc, char *buf, size_t cap)
{
    const struct tdm_prefill_service *p = svc;
    snprintf(buf, cap, "nng=%s instance=%016llx", tdm_prefill_service_url(p),
             (unsigned long long)tdm_prefill_service_instance(p));
}

static void stop(void *svc)
{
    tdm_prefill_service_free(svc);
}

int main(int argc, char **argv)
{
    struct tdm_prefill_config pcfg;
    tdm_prefill_config_default(&pcfg);
    const struct tdm_worker_role role = {
        .name = "prefill",
        .flags = tdm_prefill_flags(),
        .cfg = &pcfg,
        .take_args = take_args,
        .worker_defaults = tdm_prefill_worker_config_default,
        .start = start,
        .describe = describe,
        .stop = stop,
        .stop_before_drain = true,
    };
    return tdm_worker_main(argc, argv, &role);
}
