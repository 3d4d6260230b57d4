// SPDX-License-Identifier: Apache-2.0
// tandem-prefill: the prefill worker's command line. Takes the prefill flags
// (--nng-url, --kv-hold-seconds, --layers-per-frame) and passes every other flag
// to the worker base's parser (same model, engine and HTTP flags as
// tandem-decode), loads the model, starts the P/D prefill service, logs one
// line and waits for SIGTERM/SIGINT: then it stops the service (held KV is
// released) and drains the HTTP side.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "worker.h"
#include "prefill.h"

int main(int argc, char **argv)
{
    char err[1024];
    struct tdm_prefill_config pcfg;
    tdm_prefill_config_default(&pcfg);
    if (tdm_prefill_config_take_args(&pcfg, &argc, argv, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-prefill: %s\n", err);
        return 2;
    }
    struct tdm_worker_config cfg;
    tdm_prefill_worker_config_default(&cfg);
    int prc = tdm_worker_config_parse_args(&cfg, argc, argv, err, sizeof err);
    if (prc == 1) {
        tdm_flags_help(tdm_prefill_flags(), stdout);
        tdm_flags_help(tdm_worker_flags(), stdout);
        return 0;
    }
    if (prc != 0) {
        fprintf(stderr, "tandem-prefill: %s\n", err);
        return 2;
    }
    tdm_log_set_role("prefill");
    tdm_log_set_level_name(cfg.log_level);

    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    double t0 = tdm_now();
    // The level is set once, before any thread starts: the HTTP threads read it.
    struct tdm_worker *s = NULL;
    if (tdm_worker_new(&s, &cfg, err, sizeof err) != TDM_OK) {
        TDM_LOG_ERR("prefill", "%s", err);
        return 1;
    }
    int rc = tdm_worker_load_unready(s, err, sizeof err);
    if (rc != TDM_OK) {
        TDM_LOG_ERR("prefill", "loading %s: %s", cfg.model, err);
        tdm_worker_free(s);
        return 1;
    }
    struct tdm_prefill_service *p = NULL;
    rc = tdm_prefill_service_new(&p, s, &pcfg, err, sizeof err);
    if (rc != TDM_OK) {
        TDM_LOG_ERR("prefill", "%s", err);
        tdm_worker_free(s);
        return 1;
    }
    // Healthy only now that the nng inbox accepts connections.
    tdm_worker_set_ready(s);
    TDM_LOG_INFO("prefill",
                 "ready model=%s served_model_name=%s nng=%s instance=%016llx http=http://%s:%d "
                 "startup_s=%.3f device=%s",
                 cfg.model, tdm_worker_model_name(s), tdm_prefill_service_url(p),
                 (unsigned long long)tdm_prefill_service_instance(p), cfg.host, tdm_worker_port(s),
                 tdm_now() - t0, tdm_worker_device(s));

    int sig = 0;
    sigwait(&sigs, &sig);
    TDM_LOG_INFO("prefill", "signal=%d stopping", sig);
    pthread_sigmask(SIG_UNBLOCK, &sigs, NULL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    tdm_prefill_service_free(p);
    tdm_worker_drain(s, cfg.drain_timeout);
    tdm_worker_free(s);
    return 0;
}
