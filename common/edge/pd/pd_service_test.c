// SPDX-License-Identifier: Apache-2.0
// pd_service tests: the service dispatches frames by type to the role's
// handlers (with its arg), answers a LoadQuery with the role's load (the common
// fields from tdm_pd_service_load, held and KV events) and drops a malformed
// one, ignores frames without a handler and runs no handler after stop; a
// handler that waits holds back only its own connection's frames; a URL
// it cannot listen on fails cleanly; the transfer metrics render with the
// role's names and help texts, the requests label or none, the reason label
// and the fixed buckets, and a second registration of the same names is
// refused; an --nng-url value needs
// a scheme and must fit ("" only where allowed).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "core.h"
#include "engine.h"
#include "metrics.h"
#include "pd.h"
#include "pd_codec.h"

// ---- the service -------------------------------------------------------------------------
struct role {
    struct tdm_pd_service svc;
    atomic_int cancels;     // CANCEL frames handed to on_cancel with this role as arg
    atomic_int load_frames; // LOAD_QUERY frames handed to a handler (must stay 0)
    atomic_int loads;       // fill_load calls
};

static void on_cancel(void *arg, const struct tdm_net_frame *f)
{
    struct role *r = arg;
    if (f->type == TDM_NET_CANCEL && f->msg_len == 3 && memcmp(f->msg, "abc", 3) == 0)
        atomic_fetch_add(&r->cancels, 1);
}

static void on_load_query(void *arg, const struct tdm_net_frame *f)
{
    (void)f;
    struct role *r = arg;
    atomic_fetch_add(&r->load_frames, 1);
}

static void role_load(void *arg, struct tdm_pd_load *load)
{
    struct role *r = arg;
    atomic_fetch_add(&r->loads, 1);
    struct tdm_engine_stats st;
    memset(&st, 0, sizeof st);
    st.num_running = 3;
    st.num_waiting = 4;
    st.kv_usage = 0.25f;
    st.num_free_blocks = 5;
    st.num_total_blocks = 6;
    st.block_size = 16;
    st.num_held = 7;
    tdm_pd_service_load(&r->svc, &st, "prefill", "m", load);
    load->held = st.num_held;
    static const uint64_t stored[] = {11, 22}, evicted[] = {33};
    load->has_kv_events = true;
    load->kv_cleared = true;
    load->kv_batch = 5;
    load->kv_stored = stored;
    load->n_kv_stored = 2;
    load->kv_evicted = evicted;
    load->n_kv_evicted = 1;
}

static void test_service_dispatch(void **state)
{
    (void)state;
    char err[256];
    struct role *r = calloc(1, sizeof *r);
    assert_non_null(r);
    struct tdm_pd_service_config cfg = {
        .url = "tcp://127.0.0.1:0",
        .module = "pd-service-test",
        .on = {[TDM_NET_CANCEL] = on_cancel, [TDM_NET_LOAD_QUERY] = on_load_query},
        .fill_load = role_load,
        .arg = r,
    };
    assert_int_equal(tdm_pd_service_init(&r->svc, &cfg, err, sizeof err), TDM_OK);
    assert_true(r->svc.instance != 0);
    assert_false(atomic_load(&r->svc.stopping));
    const char *url = tdm_pd_service_url(&r->svc);
    assert_non_null(strstr(url, "tcp://127.0.0.1:"));
    assert_null(strstr(url, ":0")); // the bound port, not 0

    struct tdm_net_inbox *asker = NULL;
    struct tdm_net_outbox *ob = NULL;
    assert_int_equal(tdm_net_inbox_new(&asker, "tcp://127.0.0.1:0", err, sizeof err), TDM_OK);
    assert_int_equal(tdm_net_outbox_new(&ob, 50, err, sizeof err), TDM_OK);
    // A handled frame, one without a handler (ignored), a handled one again.
    assert_int_equal(tdm_net_send(ob, url, TDM_NET_CANCEL, "abc", 3, NULL, 0, 2.0, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_net_send(ob, url, TDM_NET_TOKENS, "abc", 3, NULL, 0, 2.0, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_net_send(ob, url, TDM_NET_CANCEL, "abc", 3, NULL, 0, 2.0, err, sizeof err),
                     TDM_OK);
    // A malformed LoadQuery is dropped (no load asked, no report).
    assert_int_equal(
        tdm_net_send(ob, url, TDM_NET_LOAD_QUERY, "\xff\xff", 2, NULL, 0, 2.0, err, sizeof err),
        TDM_OK);
    // The LoadQuery comes after them on the same connection: by its report
    // they were handled. The report is a nonblocking send, so ask again until
    // the service's outbox has connected to the asker.
    Tandem__Peer peer = TANDEM__PEER__INIT;
    peer.url = (char *)tdm_net_inbox_url(asker);
    peer.instance = 99;
    Tandem__LoadQuery q = TANDEM__LOAD_QUERY__INIT;
    q.reply_to = &peer;
    q.seq = 42;
    struct tdm_net_msg *msg = NULL;
    int rc = TDM_ETIMEDOUT, sent = 0;
    for (; sent < 50 && rc == TDM_ETIMEDOUT; sent++) {
        assert_int_equal(
            tdm_pd_send(ob, url, TDM_NET_LOAD_QUERY, &q.base, NULL, 0, 2.0, err, sizeof err),
            TDM_OK);
        rc = tdm_net_inbox_recv(asker, 0.1, &msg, err, sizeof err);
    }
    assert_int_equal(rc, TDM_OK);
    const struct tdm_net_frame *f = tdm_net_msg_frame(msg);
    assert_int_equal(f->type, TDM_NET_LOAD_REPORT);
    Tandem__LoadReport *rep = tandem__load_report__unpack(NULL, f->msg_len, f->msg);
    assert_non_null(rep);
    assert_true(rep->instance == r->svc.instance);
    assert_true(rep->to_instance == 99 && rep->seq == 42);
    assert_string_equal(rep->role, "prefill");
    assert_string_equal(rep->model, "m");
    assert_int_equal(rep->running, 3);
    assert_int_equal(rep->waiting, 4);
    assert_true(rep->kv_usage == 0.25f);
    assert_int_equal(rep->free_blocks, 5);
    assert_int_equal(rep->total_blocks, 6);
    assert_int_equal(rep->block_size, 16);
    assert_int_equal(rep->held, 7);
    assert_string_equal(rep->url, url);
    assert_non_null(rep->kv_events);
    assert_true(rep->kv_events->instance == r->svc.instance);
    assert_true(rep->kv_events->cleared && rep->kv_events->batch == 5);
    assert_int_equal(rep->kv_events->n_stored, 2);
    assert_true(rep->kv_events->stored[0] == 11 && rep->kv_events->stored[1] == 22);
    assert_int_equal(rep->kv_events->n_evicted, 1);
    assert_true(rep->kv_events->evicted[0] == 33);
    tandem__load_report__free_unpacked(rep, NULL);
    tdm_net_msg_free(msg);
    assert_int_equal(atomic_load(&r->cancels), 2);
    assert_int_equal(atomic_load(&r->load_frames), 0); // answered by the service, not handed on
    // Every well-formed query asked for the load once; the malformed one did not.
    for (int i = 0; i < 50 && atomic_load(&r->loads) < sent; i++)
        usleep(20000);
    assert_int_equal(atomic_load(&r->loads), sent);

    // After stop no handler runs; the outbox still sends.
    tdm_pd_service_stop(&r->svc);
    assert_true(atomic_load(&r->svc.stopping));
    tdm_net_send(ob, url, TDM_NET_CANCEL, "abc", 3, NULL, 0, 0.3, err, sizeof err);
    assert_int_equal(atomic_load(&r->cancels), 2);
    assert_int_equal(tdm_net_send(r->svc.outbox, tdm_net_inbox_url(asker), TDM_NET_TOKENS, "x", 1,
                                  NULL, 0, 2.0, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_net_inbox_recv(asker, 2.0, &msg, err, sizeof err), TDM_OK);
    while (tdm_net_msg_frame(msg)->type == TDM_NET_LOAD_REPORT) { // late answers to the retries
        tdm_net_msg_free(msg);
        assert_int_equal(tdm_net_inbox_recv(asker, 2.0, &msg, err, sizeof err), TDM_OK);
    }
    assert_int_equal(tdm_net_msg_frame(msg)->type, TDM_NET_TOKENS);
    tdm_net_msg_free(msg);
    tdm_pd_service_fini(&r->svc);

    tdm_net_outbox_free(ob);
    tdm_net_inbox_free(asker);
    free(r);
}

// A handler that waits (a send to a slow peer, a big import) holds back only
// the frames of its own connection: another peer's frames are handled
// meanwhile, and the waiting connection's next frame right after it.
struct slow_role {
    struct tdm_pd_service svc;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool release;     // under mu: the waiting handler may return
    int waiting;      // under mu: handlers inside the wait
    atomic_int quick; // "quick" frames handled
    atomic_int after; // "after" frames handled (they follow "wait" on its connection)
};

static void on_slow_cancel(void *arg, const struct tdm_net_frame *f)
{
    struct slow_role *r = arg;
    if (f->msg_len == 4 && memcmp(f->msg, "wait", 4) == 0) {
        pthread_mutex_lock(&r->mu);
        r->waiting++;
        pthread_cond_broadcast(&r->cv);
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 10; // bounded, so a broken service fails the test instead of hanging it
        while (!r->release && pthread_cond_timedwait(&r->cv, &r->mu, &until) == 0)
            ;
        r->waiting--;
        pthread_mutex_unlock(&r->mu);
    } else if (f->msg_len == 5 && memcmp(f->msg, "quick", 5) == 0) {
        atomic_fetch_add(&r->quick, 1);
    } else if (f->msg_len == 5 && memcmp(f->msg, "after", 5) == 0) {
        atomic_fetch_add(&r->after, 1);
    }
}

static void test_service_waiting_handler(void **state)
{
    (void)state;
    char err[256];
    struct slow_role *r = calloc(1, sizeof *r);
    assert_non_null(r);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    struct tdm_pd_service_config cfg = {
        .url = "tcp://127.0.0.1:0",
        .module = "pd-service-test",
        .on = {[TDM_NET_CANCEL] = on_slow_cancel},
        .arg = r,
    };
    assert_int_equal(tdm_pd_service_init(&r->svc, &cfg, err, sizeof err), TDM_OK);
    const char *url = tdm_pd_service_url(&r->svc);
    // Two peers: two outboxes, so two connections.
    struct tdm_net_outbox *slow = NULL, *other = NULL;
    assert_int_equal(tdm_net_outbox_new(&slow, 50, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_net_outbox_new(&other, 50, err, sizeof err), TDM_OK);
    assert_int_equal(
        tdm_net_send(slow, url, TDM_NET_CANCEL, "wait", 4, NULL, 0, 2.0, err, sizeof err), TDM_OK);
    assert_int_equal(
        tdm_net_send(slow, url, TDM_NET_CANCEL, "after", 5, NULL, 0, 2.0, err, sizeof err), TDM_OK);
    pthread_mutex_lock(&r->mu);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    while (r->waiting == 0 && pthread_cond_timedwait(&r->cv, &r->mu, &until) == 0)
        ;
    assert_int_equal(r->waiting, 1);
    pthread_mutex_unlock(&r->mu);
    // The other peer is heard while the first connection's handler waits.
    assert_int_equal(
        tdm_net_send(other, url, TDM_NET_CANCEL, "quick", 5, NULL, 0, 2.0, err, sizeof err),
        TDM_OK);
    for (int i = 0; i < 250 && atomic_load(&r->quick) == 0; i++)
        usleep(20000);
    assert_int_equal(atomic_load(&r->quick), 1);
    assert_int_equal(atomic_load(&r->after), 0); // its own connection's next frame waits
    pthread_mutex_lock(&r->mu);
    r->release = true;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    for (int i = 0; i < 250 && atomic_load(&r->after) == 0; i++)
        usleep(20000);
    assert_int_equal(atomic_load(&r->after), 1);
    tdm_pd_service_stop(&r->svc);
    tdm_pd_service_fini(&r->svc);
    tdm_net_outbox_free(slow);
    tdm_net_outbox_free(other);
    pthread_cond_destroy(&r->cv);
    pthread_mutex_destroy(&r->mu);
    free(r);
}

static void test_service_init_fails(void **state)
{
    (void)state;
    char err[256] = "";
    struct tdm_pd_service a, b;
    struct tdm_pd_service_config cfg = {.url = "tcp://127.0.0.1:0", .module = "pd-service-test"};
    assert_int_equal(tdm_pd_service_init(&a, &cfg, err, sizeof err), TDM_OK);
    // The address is taken: the second service cannot listen, nothing stays open.
    cfg.url = tdm_pd_service_url(&a);
    assert_int_equal(tdm_pd_service_init(&b, &cfg, err, sizeof err), TDM_ETRANSPORT);
    assert_true(err[0] != '\0');
    assert_null(b.inbox);
    assert_null(b.outbox);
    err[0] = '\0';
    cfg.url = "no-scheme";
    assert_int_not_equal(tdm_pd_service_init(&b, &cfg, err, sizeof err), TDM_OK);
    assert_true(err[0] != '\0');
    tdm_pd_service_stop(&a);
    tdm_pd_service_fini(&a);
}

// ---- transfer metrics --------------------------------------------------------------------
static const struct tdm_pd_metric_names names_plain = {
    .bytes = {"t:x_bytes_total", "Bytes."},
    .blocks = {"t:x_blocks_total", "Blocks."},
    .requests = {"t:x_requests_total", "Requests."},
    .failures = {"t:x_failures_total", "Failures by reason."},
    .seconds = {"t:x_seconds", "Seconds."},
};

static const struct tdm_pd_metric_names names_labelled = {
    .bytes = {"t:y_bytes_total", "Bytes y."},
    .blocks = {"t:y_blocks_total", "Blocks y."},
    .requests = {"t:y_requests_total", "Requests y."},
    .requests_label = "prefill",
    .failures = {"t:y_failures_total", "Failures y."},
    .seconds = {"t:y_seconds", "Seconds y."},
};

static void test_metrics(void **state)
{
    (void)state;
    char err[256] = "";
    struct tdm_metrics_registry *reg = NULL;
    assert_int_equal(tdm_metrics_registry_new(&reg, NULL, 0, err, sizeof err), TDM_OK);
    struct tdm_pd_metrics m, l;
    assert_int_equal(tdm_pd_metrics_register(&m, reg, &names_plain, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_pd_metrics_register(&l, reg, &names_labelled, err, sizeof err), TDM_OK);
    tdm_metrics_counter_add(m.bytes, 4096);
    tdm_metrics_counter_add(m.blocks, 2);
    tdm_metrics_counter_inc(m.requests);
    tdm_pd_metrics_fail(&m, "send");
    tdm_pd_metrics_fail(&m, "send");
    tdm_metrics_histogram_observe(m.seconds, 0.003);
    tdm_metrics_counter_inc(tdm_metrics_counter_labels(l.requests, "remote"));
    tdm_pd_metrics_fail(&l, "timeout");
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(reg, &text, &len), TDM_OK);
    static const char expect_plain[] = "# HELP t:x_bytes_total Bytes.\n"
                                       "# TYPE t:x_bytes_total counter\n"
                                       "t:x_bytes_total 4096\n"
                                       "# HELP t:x_blocks_total Blocks.\n"
                                       "# TYPE t:x_blocks_total counter\n"
                                       "t:x_blocks_total 2\n"
                                       "# HELP t:x_requests_total Requests.\n"
                                       "# TYPE t:x_requests_total counter\n"
                                       "t:x_requests_total 1\n"
                                       "# HELP t:x_failures_total Failures by reason.\n"
                                       "# TYPE t:x_failures_total counter\n"
                                       "t:x_failures_total{reason=\"send\"} 2\n"
                                       "# HELP t:x_seconds Seconds.\n"
                                       "# TYPE t:x_seconds histogram\n"
                                       "t:x_seconds_bucket{le=\"0.0005\"} 0\n"
                                       "t:x_seconds_bucket{le=\"0.001\"} 0\n"
                                       "t:x_seconds_bucket{le=\"0.0025\"} 0\n"
                                       "t:x_seconds_bucket{le=\"0.005\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.01\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.025\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.05\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.1\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.25\"} 1\n"
                                       "t:x_seconds_bucket{le=\"0.5\"} 1\n"
                                       "t:x_seconds_bucket{le=\"1.0\"} 1\n"
                                       "t:x_seconds_bucket{le=\"2.5\"} 1\n"
                                       "t:x_seconds_bucket{le=\"5.0\"} 1\n"
                                       "t:x_seconds_bucket{le=\"10.0\"} 1\n"
                                       "t:x_seconds_bucket{le=\"+Inf\"} 1\n"
                                       "t:x_seconds_count 1\n";
    assert_non_null(strstr(text, expect_plain));
    assert_non_null(strstr(text, "t:x_seconds_sum 0.003\n"));
    assert_non_null(strstr(text, "# HELP t:y_requests_total Requests y.\n"
                                 "# TYPE t:y_requests_total counter\n"
                                 "t:y_requests_total{prefill=\"remote\"} 1\n"));
    assert_non_null(strstr(text, "t:y_failures_total{reason=\"timeout\"} 1\n"));
    assert_non_null(strstr(text, "# TYPE t:y_seconds histogram\n"));
    free(text);
    // The same names again: refused, with the reason.
    err[0] = '\0';
    struct tdm_pd_metrics again;
    assert_int_equal(tdm_pd_metrics_register(&again, reg, &names_plain, err, sizeof err),
                     TDM_EINVAL);
    assert_non_null(strstr(err, "t:x_bytes"));
    tdm_metrics_registry_free(reg);
}

// ---- flags -------------------------------------------------------------------------------
static void test_flag_url(void **state)
{
    (void)state;
    char url[16] = "keep";
    char err[256];
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "tcp://h:1", false, err, sizeof err), TDM_OK);
    assert_string_equal(url, "tcp://h:1");
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "h:1", true, err, sizeof err), TDM_EINVAL);
    assert_string_equal(err, "--nng-url: expected tcp://HOST:PORT, got \"h:1\"");
    assert_string_equal(url, "tcp://h:1");
    // 16 bytes do not fit in 16 (the NUL).
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "tcp://host:12345", true, err, sizeof err),
                     TDM_EINVAL);
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "tcp://host:1234", true, err, sizeof err),
                     TDM_OK);
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "", false, err, sizeof err), TDM_EINVAL);
    assert_string_equal(url, "tcp://host:1234");
    assert_int_equal(tdm_pd_flag_url(url, sizeof url, "", true, err, sizeof err), TDM_OK);
    assert_string_equal(url, "");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_service_dispatch),
        cmocka_unit_test(test_service_waiting_handler),
        cmocka_unit_test(test_service_init_fails),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_flag_url),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
