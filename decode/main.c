// SPDX-License-Identifier: Apache-2.0
// tandem-decode: the decode worker's command line. Parses flags (and --config),
// blocks SIGTERM/SIGINT in every thread so that only this one receives them,
// starts the server (health 503 while loading), loads the model, logs one
// line, then waits for a signal: the first drains (running requests finish
// up to --drain-timeout) and exits 0; a second one during the drain exits at once.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "worker.h"
#include "pd_receiver.h"

int main(int argc, char **argv)
{
    struct tdm_worker_config cfg;
    char err[1024];
    tdm_worker_config_default(&cfg);
    // P/D flags (--nng-url, --pd-*) are taken out first (decode/pd_receiver.h).
    struct tdm_pd_receiver_config pdcfg;
    tdm_pd_receiver_config_default(&pdcfg);
    if (tdm_pd_receiver_take_args(&pdcfg, &argc, argv, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-decode: %s\n", err);
        return 2;
    }
    int prc = tdm_worker_config_parse_args(&cfg, argc, argv, err, sizeof err);
    if (prc == 1) {
        tdm_flags_help(tdm_worker_flags(), stdout);
        tdm_flags_help(tdm_pd_receiver_flags(), stdout);
        return 0;
    }
    if (prc != 0) {
        fprintf(stderr, "tandem-decode: %s\n", err);
        return 2;
    }
    tdm_log_set_role("decode");
    tdm_log_set_level_name(cfg.log_level);

    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); // inherited by civetweb's and the engine's threads
    signal(SIGPIPE, SIG_IGN);                // a client gone shows as a failed write

    double t0 = tdm_now();
    // The modules log their own startup details at info; the operator gets one
    // line from here (--log-level debug shows the rest). The HTTP threads are
    // up while this holds (health answers 503), so the level is atomic
    // (common/core) and restored below without a race.
    if (atomic_load(&tdm_log_level) == TDM_LOG_LEVEL_INFO)
        atomic_store(&tdm_log_level, TDM_LOG_LEVEL_WARN);
    struct tdm_worker *s = NULL;
    if (tdm_worker_new(&s, &cfg, err, sizeof err) != TDM_OK) {
        TDM_LOG_ERR("decode", "%s", err);
        return 1;
    }
    int rc = tdm_worker_load_unready(s, err, sizeof err);
    tdm_log_set_level_name(cfg.log_level);
    if (rc != TDM_OK) {
        TDM_LOG_ERR("decode", "loading %s: %s", cfg.model, err);
        tdm_worker_free(s);
        return 1;
    }
    struct tdm_pd_receiver *pd = NULL;
    if (pdcfg.nng_url[0] && tdm_pd_receiver_new(&pd, s, &pdcfg, err, sizeof err) != TDM_OK) {
        TDM_LOG_ERR("decode", "P/D receiver: %s", err);
        tdm_worker_free(s);
        return 1;
    }
    // Healthy only now that the nng inbox (when configured) accepts connections.
    tdm_worker_set_ready(s);
    if (pd)
        TDM_LOG_INFO("decode", "pd nng=%s instance=%016llx", tdm_pd_receiver_url(pd),
                     (unsigned long long)tdm_pd_receiver_instance(pd));
    TDM_LOG_INFO(
        "decode",
        "ready model=%s served_model_name=%s kv_capacity_tokens=%lld listening=http://%s:%d "
        "startup_s=%.3f device=%s",
        cfg.model, tdm_worker_model_name(s), (long long)tdm_worker_kv_capacity_tokens(s), cfg.host,
        tdm_worker_port(s), tdm_now() - t0, tdm_worker_device(s));

    int sig = 0;
    sigwait(&sigs, &sig);
    TDM_LOG_INFO("decode", "signal=%d draining timeout_s=%.1f", sig, cfg.drain_timeout);
    // A second signal during the drain ends the process at once.
    pthread_sigmask(SIG_UNBLOCK, &sigs, NULL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    int drc = tdm_worker_drain(s, cfg.drain_timeout);
    tdm_pd_receiver_free(pd);
    tdm_worker_free(s);
    TDM_LOG_INFO("decode", "stopped drained=%s", drc == TDM_OK ? "all" : "timeout");
    return 0;
}
