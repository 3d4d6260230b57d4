// SPDX-License-Identifier: Apache-2.0
// pd_service: the P/D roles' shared nng service, transfer metrics and the
// --nng-url check (see pd_service.h).
#include "pd_service.h"

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
        tdm_pd_answer_load_query(s->outbox, f, c->fill_load, c->arg);
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
    tdm_net_outbox_free(s->outbox);
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
    s->inbox = NULL;
    s->outbox = NULL;
}

void tdm_pd_service_load(const struct tdm_pd_service *s, const struct tdm_engine_stats *st,
                         const char *role, const char *model, struct tdm_pd_load *load)
{
    load->instance = s->instance;
    load->role = role;
    load->model = model;
    load->running = st->num_running;
    load->waiting = st->num_waiting;
    load->kv_usage = st->kv_usage;
    load->free_blocks = st->num_free_blocks;
    load->total_blocks = st->num_total_blocks;
    load->block_size = st->block_size;
    load->url = tdm_net_inbox_url(s->inbox);
}

// ---- transfer metrics --------------------------------------------------------------------
int tdm_pd_metrics_register(struct tdm_pd_metrics *m, struct tdm_metrics_registry *reg,
                            const struct tdm_pd_metric_names *names, char *err, size_t errlen)
{
    memset(m, 0, sizeof *m);
    struct tdm_metrics_opts o;
    memset(&o, 0, sizeof o);
    o.name = names->bytes.name;
    o.help = names->bytes.help;
    int rc = tdm_metrics_counter_register(&m->bytes, reg, &o, err, errlen);
    o.name = names->blocks.name;
    o.help = names->blocks.help;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->blocks, reg, &o, err, errlen);
    o.name = names->requests.name;
    o.help = names->requests.help;
    o.label_names = names->requests_label ? &names->requests_label : NULL;
    o.n_label_names = names->requests_label ? 1 : 0;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->requests, reg, &o, err, errlen);
    static const char *const reason[] = {"reason"};
    o.name = names->failures.name;
    o.help = names->failures.help;
    o.label_names = reason;
    o.n_label_names = 1;
    if (rc == TDM_OK)
        rc = tdm_metrics_counter_register(&m->failures, reg, &o, err, errlen);
    o.label_names = NULL;
    o.n_label_names = 0;
    static const double bounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                    0.1,    0.25,  0.5,    1,     2.5,  5,     10};
    o.name = names->seconds.name;
    o.help = names->seconds.help;
    if (rc == TDM_OK)
        rc = tdm_metrics_histogram_register(&m->seconds, reg, &o, bounds,
                                            sizeof bounds / sizeof bounds[0], err, errlen);
    return rc;
}

void tdm_pd_metrics_fail(const struct tdm_pd_metrics *m, const char *reason)
{
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(m->failures, reason));
}

// ---- flags -------------------------------------------------------------------------------
int tdm_pd_flag_url(char *dst, size_t dst_size, const char *value, bool allow_empty, char *err,
                    size_t errlen)
{
    if (strlen(value) >= dst_size || ((value[0] || !allow_empty) && strstr(value, "://") == NULL))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "--nng-url: expected tcp://HOST:PORT, got \"%s\"", value);
    snprintf(dst, dst_size, "%s", value);
    return TDM_OK;
}
