// SPDX-License-Identifier: Apache-2.0
// pd_service: the P/D roles' shared nng service (see pd.h): the inbox, the
// outbox, the instance id and the receive thread that dispatches frames by
// type to the role's handlers.
#include "pd.h"

#include <stdio.h>
#include <string.h>

#include "core.h"
#include "engine.h"
#include "metrics.h"

// ---- the service -------------------------------------------------------------------------
static void service_frame(void *arg, const struct tdm_net_frame *f)
{
    struct tdm_pd_service *s = arg;
    const struct tdm_pd_service_config *c = &s->cfg;
    tdm_net_frame_handler h = f->type > 0 && f->type <= TDM_NET_TYPE_MAX ? c->on[f->type] : NULL;
    if (f->type == TDM_NET_LOAD_QUERY && c->fill_load)
        tdm_pd_answer_load_query(s->liveness, f, c->fill_load, c->arg);
    else if (h)
        h(c->arg, f);
    else
        TDM_LOG_DEBUG(c->module, "ignored %s frame", tdm_net_type_name(f->type));
}

static void *service_main(void *arg)
{
    struct tdm_pd_service *s = arg;
    tdm_net_inbox_serve(s->inbox, &s->stopping, service_frame, s, s->cfg.module);
    return NULL;
}

int tdm_pd_service_init(struct tdm_pd_service *s, const struct tdm_pd_service_config *cfg,
                        char *err, size_t errlen)
{
    memset(s, 0, sizeof *s);
    atomic_init(&s->stopping, false);
    s->cfg = *cfg;
    s->instance = tdm_net_new_instance_id();
    int rc = tdm_net_outbox_new(&s->outbox, 100, err, errlen);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_net_outbox_new(&s->liveness, 100, err, errlen);
    if (rc != TDM_OK)
        goto fail_outbox;
    rc = tdm_net_inbox_new(&s->inbox, cfg->url, err, errlen);
    if (rc != TDM_OK)
        goto fail_outbox;
    if (pthread_create(&s->rx_thread, NULL, service_main, s) != 0) {
        rc =
            tdm_seterr(err, errlen, TDM_ENOMEM, "%s: cannot start the receive thread", cfg->module);
        goto fail_inbox;
    }
    return TDM_OK;
fail_inbox:
    tdm_net_inbox_free(s->inbox);
    s->inbox = NULL;
fail_outbox:
    tdm_net_outbox_free(s->liveness);
    tdm_net_outbox_free(s->outbox);
    s->liveness = NULL;
    s->outbox = NULL;
    return rc;
}

const char *tdm_pd_service_url(const struct tdm_pd_service *s)
{
    return tdm_net_inbox_url(s->inbox);
}

void tdm_pd_service_stop(struct tdm_pd_service *s)
{
    atomic_store(&s->stopping, true);
    tdm_net_inbox_close(s->inbox);
    pthread_join(s->rx_thread, NULL);
}

void tdm_pd_service_fini(struct tdm_pd_service *s)
{
    tdm_net_inbox_free(s->inbox);
    tdm_net_outbox_free(s->outbox);
    tdm_net_outbox_free(s->liveness);
    s->inbox = NULL;
    s->outbox = NULL;
    s->liveness = NULL;
}
