// SPDX-License-Identifier: Apache-2.0
// tandem-router: the router's command line. Parses flags, blocks SIGTERM,
// SIGINT and SIGHUP in every thread so this one takes them with sigwait: SIGHUP
// reloads the routing config (the old one stays when the new is invalid), the
// first SIGTERM/SIGINT drains (/health 503, new requests 503, open streams
// finish within --drain-timeout; the rest end with an error event and are
// cancelled upstream) and exits 0.
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core.h"
#include "router.h"

int main(int argc, char **argv)
{
    struct tdm_router_opts o;
    char err[1024];
    tdm_router_opts_default(&o);
    int prc = tdm_router_opts_parse_args(&o, argc, argv, err, sizeof err);
    if (prc == 1) {
        tdm_flags_help(tdm_router_flags(), stdout);
        return 0;
    }
    if (prc != TDM_OK) {
        fprintf(stderr, "tandem-router: %s (see --help)\n", err);
        return 2;
    }
    tdm_log_set_role("router");
    if (tdm_log_set_level_name(o.log_level) != TDM_OK) {
        fprintf(stderr, "tandem-router: --log-level: unknown level \"%s\"\n", o.log_level);
        return 2;
    }

    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    sigaddset(&sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    double t0 = tdm_now();
    struct tdm_router_server *s = NULL;
    if (tdm_router_server_new(&s, &o, err, sizeof err) != TDM_OK) {
        TDM_LOG_ERR("router", "%s", err);
        if (o.generated_dir[0]) {
            unlink(o.config);
            rmdir(o.generated_dir);
        }
        return 1;
    }
    TDM_LOG_INFO("router", "ready config=%s model=%s listening=http://%s:%d nng=%s startup_s=%.3f",
                 o.config, o.model, o.host, tdm_router_server_port(s), tdm_router_server_nng_url(s),
                 tdm_now() - t0);
    for (;;) {
        int sig = 0;
        sigwait(&sigs, &sig);
        if (sig == SIGHUP) {
            if (tdm_router_server_reload(s, err, sizeof err) != TDM_OK)
                TDM_LOG_WARN("router", "SIGHUP reload failed, old config kept: %s", err);
            else
                TDM_LOG_INFO("router", "SIGHUP: config reloaded");
            continue;
        }
        TDM_LOG_INFO("router", "signal=%d draining (up to %g s)", sig, o.drain_timeout);
        break;
    }
    // As the workers do: no new requests, open streams finish within
    // --drain-timeout, the rest end with an error event when the server stops.
    tdm_router_server_drain(s, o.drain_timeout);
    TDM_LOG_INFO("router", "stopping");
    tdm_router_server_free(s);
    if (o.generated_dir[0]) { // --policy's config, written for this run
        unlink(o.config);
        rmdir(o.generated_dir);
    }
    return 0;
}
