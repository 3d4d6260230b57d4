// SPDX-License-Identifier: Apache-2.0
// tandem-decode: the decode worker's command line, the worker base's main
// (tdm_worker_main) with the decode role's P/D side: its flags (--nng-url,
// --pd-*; without --nng-url it serves its own port only), the receiver of
// GenerateRequests and KV, and its words in the ready line. On the first
// signal the running requests finish (up to --drain-timeout) before the
// receiver stops.
#include <stdio.h>

#include "core.h"
#include "pd_receiver.h"
#include "worker.h"

static int take_args(void *cfg, int *argc, char **argv, char *err, size_t errlen)
{
    return tdm_pd_receiver_take_args(cfg, argc, argv, err, errlen);
}

static int start(void **svc, struct tdm_worker *s, void *cfg, char *err, size_t errlen)
{
    const struct tdm_pd_receiver_config *pd = cfg;
    if (!pd->nng_url[0])
        return TDM_OK;
    struct tdm_pd_receiver *rx = NULL;
    int rc = tdm_pd_receiver_new(&rx, s, pd, err, errlen);
    if (rc != TDM_OK) {
        char why[1024];
        snprintf(why, sizeof why, "P/D receiver: %s", err);
        snprintf(err, errlen, "%s", why);
        return rc;
    }
    *svc = rx;
    return TDM_OK;
}

static void describe(void *svc, char *buf, size_t cap)
{
    const struct tdm_pd_receiver *rx = svc;
    snprintf(buf, cap, "nng=%s instance=%016llx", tdm_pd_receiver_url(rx),
             (unsigned long long)tdm_pd_receiver_instance(rx));
}

static void stop(void *svc)
{
    tdm_pd_receiver_free(svc);
}

int main(int argc, char **argv)
{
    struct tdm_pd_receiver_config pd;
    tdm_pd_receiver_config_default(&pd);
    const struct tdm_worker_role role = {
        .name = "decode",
        .flags = tdm_pd_receiver_flags(),
        .cfg = &pd,
        .take_args = take_args,
        .start = start,
        .describe = describe,
        .stop = stop,
        .stop_before_drain = false,
    };
    return tdm_worker_main(argc, argv, &role);
}
