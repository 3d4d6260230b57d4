// SPDX-License-Identifier: Apache-2.0
// worker_main: the command line both worker roles run (worker.h,
// tdm_worker_main). One sequence for tandem-decode and tandem-prefill, so the
// two cannot drift: the role's flags out of argv first, then the worker's;
// SIGTERM/SIGINT blocked in every thread so only this one receives them; the
// server up at once (health 503 while loading); the load with the modules'
// startup lines at debug only (the operator gets the ready line); the role's
// P/D side; ready; then the first signal stops and drains, a second one during
// the drain ends the process at once.
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>

#include "core.h"
#include "worker.h"

// Parses argv into *cfg: 0, 1 after --help (printed), 2 on a bad flag (said).
static int parse(const struct tdm_worker_role *r, struct tdm_worker_config *cfg, int *argc,
                 char **argv)
{
    char err[1024];
    if (r->take_args(r->cfg, argc, argv, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-%s: %s\n", r->name, err);
        return 2;
    }
    if (r->worker_defaults)
        r->worker_defaults(cfg);
    else
        tdm_worker_config_default(cfg);
    int prc = tdm_worker_config_parse_args(cfg, *argc, argv, err, sizeof err);
    if (prc == 1) {
        tdm_flags_help(tdm_worker_flags(), stdout);
        tdm_flags_help(r->flags, stdout);
        return 1;
    }
    if (prc != 0) {
        fprintf(stderr, "tandem-%s: %s\n", r->name, err);
        return 2;
    }
    return 0;
}

// Starts the worker and the role on it; NULL (logged) when either fails.
static struct tdm_worker *start(const struct tdm_worker_role *r,
                                const struct tdm_worker_config *cfg, void **svc)
{
    char err[1024];
    double t0 = tdm_now();
    // The modules log their own startup details at info; the operator gets one
    // line from here (--log-level debug shows the rest). The HTTP threads are
    // up while this holds (health answers 503), so the level is atomic
    // (common/core) and restored below without a race.
    if (atomic_load(&tdm_log_level) == TDM_LOG_LEVEL_INFO)
        atomic_store(&tdm_log_level, TDM_LOG_LEVEL_WARN);
    struct tdm_worker *s = NULL;
    if (tdm_worker_new(&s, cfg, err, sizeof err) != TDM_OK) {
        tdm_log_set_level_name(cfg->log_level);
        TDM_LOG_ERR(r->name, "%s", err);
        return NULL;
    }
    int rc = tdm_worker_load_unready(s, err, sizeof err);
    tdm_log_set_level_name(cfg->log_level);
    if (rc != TDM_OK) {
        TDM_LOG_ERR(r->name, "loading %s: %s", cfg->model, err);
        tdm_worker_free(s);
        return NULL;
    }
    *svc = NULL;
    if (r->start(svc, s, r->cfg, err, sizeof err) != TDM_OK) {
        TDM_LOG_ERR(r->name, "%s", err);
        tdm_worker_free(s);
        return NULL;
    }
    // Healthy only now that the role's nng inbox (when it has one) accepts
    // connections.
    tdm_worker_set_ready(s);
    char words[256] = "";
    if (*svc && r->describe)
        r->describe(*svc, words, sizeof words);
    TDM_LOG_INFO(r->name,
                 "ready model=%s served_model_name=%s%s%s kv_capacity_tokens=%lld "
                 "listening=http://%s:%d startup_s=%.3f device=%s",
                 cfg->model, tdm_worker_model_name(s), words[0] ? " " : "", words,
                 (long long)tdm_worker_kv_capacity_tokens(s), cfg->host, tdm_worker_port(s),
                 tdm_now() - t0, tdm_worker_device(s));
    return s;
}

int tdm_worker_main(int argc, char **argv, const struct tdm_worker_role *r)
{
    struct tdm_worker_config cfg;
    int prc = parse(r, &cfg, &argc, argv);
    if (prc != 0)
        return prc == 1 ? 0 : 2;
    tdm_log_set_role(r->name);
    tdm_log_set_level_name(cfg.log_level);

    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL); // inherited by civetweb's and the engine's threads
    signal(SIGPIPE, SIG_IGN);                // a client gone shows as a failed write

    void *svc = NULL;
    struct tdm_worker *s = start(r, &cfg, &svc);
    if (s == NULL)
        return 1;
    int sig = 0;
    sigwait(&sigs, &sig);
    TDM_LOG_INFO(r->name, "signal=%d draining timeout_s=%.1f", sig, cfg.drain_timeout);
    // A second signal during the drain ends the process at once.
    pthread_sigmask(SIG_UNBLOCK, &sigs, NULL);
    signal(SIGTERM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    if (r->stop_before_drain && svc)
        r->stop(svc);
    int drc = tdm_worker_drain(s, cfg.drain_timeout);
    if (!r->stop_before_drain && svc)
        r->stop(svc);
    tdm_worker_free(s);
    TDM_LOG_INFO(r->name, "stopped drained=%s", drc == TDM_OK ? "all" : "timeout");
    return 0;
}
