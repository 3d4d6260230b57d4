// SPDX-License-Identifier: Apache-2.0
// pd_service: the P/D roles' shared nng service (see pd.h): the inbox, the
// outbox, the instance id and the dispatch of each frame by type to the role's
// handlers, on the inbox's reader thread of the connection it came on.
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
    if (f->type == TDM_NET_LOAD_QUERY && c->fill_load) {
        // One answer at a time: fill_load may hand out buffers of the role's
        // (the decode worker's KV events) that stay in use until the report
        // is sent, and queries come on several connections at once.
        pthread_mutex_lock(&s->load_mu);
        tdm_pd_answer_load_query(s->liveness, f, c->fill_load, c->arg);
        pthread_mutex_unlock(&s->load_mu);
    } else if (h)
        h(c->arg, f);
    else
        TDM_LOG_DEBUG(c->module, "ignored %s frame", tdm_net_type_name(f->type));
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
    tdm_net_outbox_set_stall(s->outbox, cfg->stall_s);
    rc = tdm_net_outbox_new(&s->liveness, 100, err, errlen);
    if (rc != TDM_OK)
        goto fail_outbox;
    rc = tdm_net_inbox_new(&s->inbox, cfg->url, err, errlen);
    if (rc != TDM_OK)
        goto fail_outbox;
    pthread_mutex_init(&s->load_mu, NULL);
    // No receive thread: each frame is handled on the reader of its
    // connection (no queue, no hand-off), so a handler that waits (a send to a
    // slow peer) holds only its own connection's frames, never another peer's.
    tdm_net_inbox_handle_on_readers(s->inbox, service_frame, s);
    return TDM_OK;
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
    tdm_net_inbox_close(s->inbox); // returns once every reader, and its handler, has left
}

void tdm_pd_service_fini(struct tdm_pd_service *s)
{
    if (s->inbox)
        pthread_mutex_destroy(&s->load_mu); // made with the inbox; no handler runs any more
    tdm_net_inbox_free(s->inbox);
    tdm_net_outbox_free(s->outbox);
    tdm_net_outbox_free(s->liveness);
    s->inbox = NULL;
    s->outbox = NULL;
    s->liveness = NULL;
}
