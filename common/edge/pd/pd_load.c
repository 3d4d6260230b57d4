// SPDX-License-Identifier: Apache-2.0
// pd_load: the load report a P/D worker answers a LoadQuery with (see pd.h):
// the common fields from the engine's stats, and the LoadReport sent back
// without blocking, so a router that went away cannot stall the reader thread
// that answers.
#include <string.h>

#include "engine.h"
#include "pd.h"
#include "pd_codec.h"

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
    load->max_waiting = st->max_waiting;
    load->max_running = st->max_running;
    load->url = tdm_net_inbox_url(s->inbox);
}

void tdm_pd_answer_load_query(struct tdm_net_outbox *ob, const struct tdm_net_frame *f,
                              tdm_pd_load_fn fill, void *arg)
{
    Tandem__LoadQuery *q = tandem__load_query__unpack(NULL, f->msg_len, f->msg);
    if (q == NULL)
        return;
    if (q->reply_to && q->reply_to->url && q->reply_to->url[0]) {
        struct tdm_pd_load load;
        memset(&load, 0, sizeof load);
        fill(arg, &load);
        Tandem__LoadReport r = TANDEM__LOAD_REPORT__INIT;
        r.instance = load.instance;
        r.to_instance = q->reply_to->instance;
        r.role = (char *)(load.role ? load.role : "");
        r.model = (char *)(load.model ? load.model : "");
        r.running = load.running;
        r.waiting = load.waiting;
        r.kv_usage = load.kv_usage;
        r.free_blocks = load.free_blocks;
        r.total_blocks = load.total_blocks;
        r.block_size = load.block_size;
        r.held = load.held;
        r.max_waiting = load.max_waiting;
        r.max_running = load.max_running;
        r.seq = q->seq;
        r.url = (char *)(load.url ? load.url : "");
        Tandem__KvEvents kev = TANDEM__KV_EVENTS__INIT;
        if (load.has_kv_events) {
            kev.instance = load.instance;
            kev.stored = (uint64_t *)load.kv_stored;
            kev.n_stored = load.kv_stored ? load.n_kv_stored : 0;
            kev.evicted = (uint64_t *)load.kv_evicted;
            kev.n_evicted = load.kv_evicted ? load.n_kv_evicted : 0;
            kev.cleared = load.kv_cleared;
            kev.batch = load.kv_batch;
            r.kv_events = &kev;
        }
        char err[256];
        tdm_pd_send(ob, q->reply_to->url, TDM_NET_LOAD_REPORT, &r.base, NULL, 0, 0, err,
                    sizeof err);
    }
    tandem__load_query__free_unpacked(q, NULL);
}
