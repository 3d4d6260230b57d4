// SPDX-License-Identifier: Apache-2.0
// Tests of the router's call path (router_call.c: attempts under the retry
// budget of retry.c, migration of a lost decode worker's streams) through a
// real tdm_router_server on loopback, driven over HTTP, against fake decode
// workers written here. A fake has what the router talks to: an HTTP server
// whose /health answers 200 (the router's active health checks) and an inbox
// (common/edge/transport) that answers LoadQuery with LoadReport and a
// GenerateRequest with TokenChunks sent to the reply_to inbox it names, as
// decode/pd_receiver.c does. Its script: answer (tokens token_of(i) up to
// max_tokens, i counted from the resume tokens on, then a length finish),
// refuse as busy (EBUSY) or as closing (ECLOSED) before any token, be
// unreachable (/health answers, nothing listens on its nng port), or go
// silent after K tokens (no chunk, no load report: the router's liveness
// check declares it lost).
//
// Routing is deterministic: --policy round_robin over the --decode list of a
// fresh router. Its k-th pick (k from 0: the registry's pick sequence) takes
// candidate k mod the number of candidates, the candidates being the
// endpoints listed that are up (endpoints.h, not_up) and have not failed the
// request yet, in list order: so with A, B the first pick is A and a retry
// goes to B; with A, B, C, D the picks are A, then C (of B, C, D), then B (of
// B, D).
//
// Cases: a plain completion (text and usage the tokens imply); an unreachable
// decode worker (never heard from, nothing on its nng port) is no candidate:
// never tried, nothing counted against it, a candidate again once it listens,
// and alone it gets the no-route 503; a busy one retried on the next (one
// retry counted); three failures answered with the last worker's 503 error
// body while a healthy worker is never tried (3 routes in all); a
// stream whose worker goes silent mid-stream, migrated (every token once, in
// order; the second worker got the first one's tokens as resume_tokens; one
// migration counted) or, with --no-stream-migration, ended with an error event.
// Each case also counts the request's entries into the endpoint registry's
// lock (issue 27: one to route, one to give the route back, per attempt; a
// migration's reroute is one): 2 for a plain completion or stream (8 before),
// 4 for one retry (14 and 15 before), 1 for no route, 6 for the spent budget (21), 3 and 4 for
// one and two migrations (14 and 20), not counting the liveness checks of a
// stream that heard nothing for a wait (one entry each, 2 before; timing
// decides how many, so they are counted apart).
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "core.h"
#include "http.h"
#include "http_test_client.h"
#include "mkmodel.h"
#include "pd_codec.h"
#include "router.h"
#include "router_impl.h" // the server's control plane: its registry's lock entries
#include "tokenizer.h"
#include "transport.h"

#define MAX_FAKES 5
#define MAX_TOKENS 64

static char model_dir[] = "/tmp/tdm_router_call_XXXXXX";
static struct tdm_tokenizer *tok;

// The i-th generated token of every fake: plain merged tokens of the tiny
// tokenizer (vocab 512: ids 256..508 are merges, the last three special).
static int32_t token_of(int i)
{
    return 300 + i;
}

// ---- fake decode worker ------------------------------------------------------------------------
enum fake_mode {
    FAKE_ANSWER,      // tokens up to max_tokens, then a length finish
    FAKE_BUSY,        // an EBUSY error finish before any token (its waiting queue is full)
    FAKE_REFUSE,      // an ECLOSED error finish before any token (loading or draining)
    FAKE_UNREACHABLE, // /health answers; its nng port is bound but nothing listens
    FAKE_DIE,         // die_after tokens, then silent: no chunk, no load report, ever
    FAKE_GAP,         // every token but the one at die_after (lost in transit), then a
                      // length finish; it keeps answering load queries
};

struct fake {
    enum fake_mode mode;
    int die_after; // FAKE_DIE, FAKE_GAP
    uint64_t instance;
    struct tdm_http_server *http;
    struct tdm_net_inbox *inbox; // NULL when unreachable
    struct tdm_net_outbox *outbox;
    int hold_fd; // FAKE_UNREACHABLE: the socket holding its nng port (-1: none)
    int http_port, nng_port;
    atomic_bool silent;
    atomic_int waiting; // the waiting queue its load reports give

    pthread_mutex_t mu;  // what it was asked (below)
    int n_generates;     // GenerateRequests received
    int n_reports;       // LoadReports sent
    int32_t prompt[256]; // [n_prompt] of the last GenerateRequest
    size_t n_prompt;
    int32_t resume[MAX_TOKENS]; // [n_resume] its resume_tokens
    size_t n_resume;
    int max_tokens;
    int order[16]; // [n_order] the max_tokens of each GenerateRequest, in arrival order
    int n_order;
};

static void fake_on_health(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_http_respond(c, 200, "text/plain", "ok", 2);
}

static void fake_send_chunk(struct fake *f, const Tandem__GenerateRequest *g, Tandem__TokenChunk *m)
{
    char err[256];
    m->request_id = g->request_id;
    m->to_instance = g->reply_to->instance;
    m->from_instance = f->instance;
    m->prompt_tokens = (int32_t)g->n_prompt;
    if (m->stop_token == 0)
        m->stop_token = -1;
    tdm_pd_send(f->outbox, g->reply_to->url, TDM_NET_TOKENS, &m->base, NULL, 0, 1.0, err,
                sizeof err);
}

// A GenerateRequest, answered on the inbox's reader thread as the script says.
static void fake_generate(struct fake *f, const struct tdm_net_frame *fr)
{
    Tandem__GenerateRequest *g = tandem__generate_request__unpack(NULL, fr->msg_len, fr->msg);
    if (g == NULL)
        return;
    pthread_mutex_lock(&f->mu);
    f->n_generates++;
    f->n_prompt = g->n_prompt < 256 ? g->n_prompt : 256;
    if (f->n_prompt > 0)
        memcpy(f->prompt, g->prompt, f->n_prompt * sizeof *f->prompt);
    f->n_resume = g->n_resume_tokens < MAX_TOKENS ? g->n_resume_tokens : MAX_TOKENS;
    if (f->n_resume > 0) // (an empty repeated field is NULL)
        memcpy(f->resume, g->resume_tokens, f->n_resume * sizeof *f->resume);
    f->max_tokens = g->max_tokens;
    if (f->n_order < 16)
        f->order[f->n_order++] = (int)g->max_tokens;
    pthread_mutex_unlock(&f->mu);
    if (g->reply_to == NULL || g->reply_to->url == NULL || !g->reply_to->url[0])
        goto out;
    Tandem__TokenChunk m = TANDEM__TOKEN_CHUNK__INIT;
    if (f->mode == FAKE_BUSY || f->mode == FAKE_REFUSE) {
        m.finished = true;
        m.finish = tdm_pd_finish_to_proto(TDM_FINISH_ERROR);
        m.error = f->mode == FAKE_BUSY ? TDM_EBUSY : TDM_ECLOSED;
        m.message = f->mode == FAKE_BUSY ? "fake: the waiting queue is full" : "fake: draining";
        fake_send_chunk(f, g, &m);
        goto out;
    }
    int max = g->max_tokens < MAX_TOKENS ? g->max_tokens : MAX_TOKENS;
    int first = (int)g->n_resume_tokens;
    for (int i = first; i < max; i++) {
        if (f->mode == FAKE_DIE && i == f->die_after) {
            atomic_store(&f->silent, true);
            break;
        }
        if (f->mode == FAKE_GAP && i == f->die_after && i + 1 < max)
            continue; // this chunk never reaches the router
        Tandem__TokenChunk c = TANDEM__TOKEN_CHUNK__INIT;
        int32_t t = token_of(i);
        c.first_index = i - first;
        c.tokens = &t;
        c.n_tokens = 1;
        if (i + 1 == max) {
            c.finished = true;
            c.finish = tdm_pd_finish_to_proto(TDM_FINISH_LENGTH);
        }
        fake_send_chunk(f, g, &c);
    }
out:
    tandem__generate_request__free_unpacked(g, NULL);
}

static void fake_load_query(struct fake *f, const struct tdm_net_frame *fr)
{
    Tandem__LoadQuery *q = tandem__load_query__unpack(NULL, fr->msg_len, fr->msg);
    if (q == NULL)
        return;
    if (q->reply_to && q->reply_to->url && q->reply_to->url[0]) {
        Tandem__LoadReport r = TANDEM__LOAD_REPORT__INIT;
        r.instance = f->instance;
        r.to_instance = q->reply_to->instance;
        r.role = "decode";
        r.model = "tiny";
        r.seq = q->seq;
        r.waiting = atomic_load(&f->waiting);
        r.url = (char *)tdm_net_inbox_url(f->inbox);
        char err[256];
        if (tdm_pd_send(f->outbox, q->reply_to->url, TDM_NET_LOAD_REPORT, &r.base, NULL, 0, 0.5,
                        err, sizeof err) == TDM_OK) {
            pthread_mutex_lock(&f->mu);
            f->n_reports++;
            pthread_mutex_unlock(&f->mu);
        }
    }
    tandem__load_query__free_unpacked(q, NULL);
}

static void fake_on_frame(void *arg, const struct tdm_net_frame *fr)
{
    struct fake *f = arg;
    if (atomic_load(&f->silent))
        return; // dead to the router: it hears nothing more from this worker
    if (fr->type == TDM_NET_GENERATE)
        fake_generate(f, fr);
    else if (fr->type == TDM_NET_LOAD_QUERY)
        fake_load_query(f, fr);
}

// A TCP port bound on 127.0.0.1 without listening: a dial is refused, and no
// other socket takes the port while fd is open.
static int hold_port(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static void fake_start(struct fake *f, enum fake_mode mode, int die_after)
{
    char err[256];
    memset(f, 0, sizeof *f);
    f->mode = mode;
    f->die_after = die_after;
    f->hold_fd = -1;
    f->instance = tdm_net_new_instance_id();
    pthread_mutex_init(&f->mu, NULL);
    struct tdm_http_config hc = {.host = "127.0.0.1", .num_threads = 2};
    assert_int_equal(tdm_http_server_new(&f->http, &hc, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_http_route(f->http, "GET", "/health", fake_on_health, f), TDM_OK);
    assert_int_equal(tdm_http_server_start(f->http, err, sizeof err), TDM_OK);
    f->http_port = tdm_http_server_port(f->http);
    if (mode == FAKE_UNREACHABLE) {
        f->hold_fd = hold_port(&f->nng_port);
        return;
    }
    assert_int_equal(tdm_net_outbox_new(&f->outbox, 50, err, sizeof err), TDM_OK);
    assert_int_equal(tdm_net_inbox_new(&f->inbox, "tcp://127.0.0.1:0", err, sizeof err), TDM_OK);
    const char *url = tdm_net_inbox_url(f->inbox);
    f->nng_port = atoi(strrchr(url, ':') + 1);
    tdm_net_inbox_handle_on_readers(f->inbox, fake_on_frame, f);
}

// An unreachable fake starts listening on its nng port and answers from now on
// (a worker that was not up yet).
static void fake_come_up(struct fake *f)
{
    assert_int_equal(f->mode, FAKE_UNREACHABLE);
    char err[256], url[64];
    close(f->hold_fd);
    f->hold_fd = -1;
    f->mode = FAKE_ANSWER;
    snprintf(url, sizeof url, "tcp://127.0.0.1:%d", f->nng_port);
    assert_int_equal(tdm_net_outbox_new(&f->outbox, 50, err, sizeof err), TDM_OK);
    if (tdm_net_inbox_new(&f->inbox, url, err, sizeof err) != TDM_OK)
        fail_msg("fake inbox on %s: %s", url, err);
    tdm_net_inbox_handle_on_readers(f->inbox, fake_on_frame, f);
}

static void fake_stop(struct fake *f)
{
    if (f->inbox)
        tdm_net_inbox_close(f->inbox); // no handler runs past this
    tdm_net_inbox_free(f->inbox);
    tdm_net_outbox_free(f->outbox);
    tdm_http_server_free(f->http);
    if (f->hold_fd >= 0)
        close(f->hold_fd);
    pthread_mutex_destroy(&f->mu);
    memset(f, 0, sizeof *f);
}

static int fake_count(struct fake *f, const int *field)
{
    pthread_mutex_lock(&f->mu);
    int v = *field;
    pthread_mutex_unlock(&f->mu);
    return v;
}

// ---- the rig: fakes and a router over them -----------------------------------------------------
struct rig {
    struct fake fakes[MAX_FAKES];
    int n;
    struct tdm_router_opts o;
    struct tdm_router_server *router;
    int port; // the router's HTTP port
};

static struct rig rig;

static void sleep_ms(int ms)
{
    struct timespec ts = {0, (long)ms * 1000000L};
    nanosleep(&ts, NULL);
}

// Starts fakes of the given modes (the first FAKE_DIE one goes silent after
// die_after tokens, the j-th after (j + 1) * die_after) and a router listing
// them in that order, then waits until every reachable fake has answered the
// router's load queries.
static void rig_start_with(int n, const enum fake_mode *modes, int die_after, bool migration,
                           const char *config_fmt);

static void rig_start(int n, const enum fake_mode *modes, int die_after, bool migration)
{
    rig_start_with(n, modes, die_after, migration, NULL);
}

// config_fmt: a router config with one "%d %d" (the first fake's HTTP and nng
// ports) in place of --policy round_robin --decode.
static void rig_start_with(int n, const enum fake_mode *modes, int die_after, bool migration,
                           const char *config_fmt)
{
    assert_true(n <= MAX_FAKES);
    memset(&rig, 0, sizeof rig);
    for (int i = 0, dying = 0; i < n; i++) {
        dying += modes[i] == FAKE_DIE || modes[i] == FAKE_GAP;
        fake_start(&rig.fakes[i], modes[i], die_after * (dying ? dying : 1));
        rig.n = i + 1;
    }
    char decode[512] = "";
    for (int i = 0; i < n; i++) {
        size_t len = strlen(decode);
        snprintf(decode + len, sizeof decode - len, "%s127.0.0.1:%d:%d", i ? "," : "",
                 rig.fakes[i].http_port, rig.fakes[i].nng_port);
    }
    static char config_path[300];
    if (config_fmt) {
        snprintf(config_path, sizeof config_path, "%s/router.yaml", model_dir);
        FILE *cf = fopen(config_path, "w");
        assert_non_null(cf);
        fprintf(cf, config_fmt, rig.fakes[0].http_port, rig.fakes[0].nng_port);
        fclose(cf);
    }
    char *argv[] = {"router_call_test",
                    config_fmt ? "--config" : "--policy",
                    config_fmt ? config_path : "round_robin",
                    config_fmt ? "--decode" : "--decode",
                    config_fmt ? "" : decode,
                    "--model",
                    model_dir,
                    "--served-model-name",
                    "tiny",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--http-threads",
                    "8",
                    "--liveness-timeout",
                    "0.3",
                    "--load-interval",
                    "0.05",
                    "--no-watch-config",
                    migration ? "--stream-migration" : "--no-stream-migration"};
    char err[512];
    tdm_router_opts_default(&rig.o);
    int rc = tdm_router_opts_parse_args(&rig.o, (int)(sizeof argv / sizeof argv[0]), argv, err,
                                        sizeof err);
    if (rc != TDM_OK)
        fail_msg("router flags: %s", err);
    rc = tdm_router_server_new(&rig.router, &rig.o, err, sizeof err);
    if (rc != TDM_OK)
        fail_msg("router: %s", err);
    rig.port = tdm_router_server_port(rig.router);
    // Every reachable fake has been asked and has answered a few times: the
    // router knows its instance and its liveness counts from a fresh report.
    double until = tdm_now() + 5.0;
    for (int i = 0; i < n; i++) {
        struct fake *f = &rig.fakes[i];
        if (f->mode == FAKE_UNREACHABLE)
            continue;
        while (fake_count(f, &f->n_reports) < 3) {
            if (tdm_now() > until)
                fail_msg("fake %d never answered the router's load queries", i);
            sleep_ms(5);
        }
    }
}

// Stops everything: the router first (it cancels what is still upstream), then
// the fakes. (A server's stop takes milliseconds: tdm_http_server_stop wakes
// civetweb's listener.)
static int rig_stop(void **state)
{
    (void)state;
    tdm_router_server_free(rig.router);
    for (int i = 0; i < rig.n; i++)
        fake_stop(&rig.fakes[i]);
    if (rig.o.generated_dir[0]) { // --policy's config
        unlink(rig.o.config);
        rmdir(rig.o.generated_dir);
    }
    memset(&rig, 0, sizeof rig);
    return 0;
}

// The registry's lock entries so far, once no API call is running in the
// router (a call gives its route back after the client has the response).
static struct tdm_router_lock_entries lock_entries(void)
{
    double until = tdm_now() + 5.0;
    while (atomic_load(&rig.router->inflight) > 0 && tdm_now() < until)
        sleep_ms(1);
    assert_int_equal(atomic_load(&rig.router->inflight), 0);
    struct tdm_router_lock_entries e;
    tdm_router_endpoints_lock_entries(tdm_router_control_endpoints(rig.router->ctl), &e);
    return e;
}

// ---- client side -------------------------------------------------------------------------------
// The sum of a series' samples (every label set) in the router's /metrics.
static double metric(const char *name)
{
    char *r = roundtrip(rig.port, "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    size_t nl = strlen(name);
    double sum = 0;
    for (const char *p = body_of(r); p && *p;) {
        if (strncmp(p, name, nl) == 0 && (p[nl] == ' ' || p[nl] == '{')) {
            const char *v = strchr(p, ' ');
            if (p[nl] == '{') { // past the labels (values hold no '}')
                v = strchr(p, '}');
                v = v ? v + 1 : NULL;
            }
            if (v)
                sum += strtod(v, NULL);
        }
        p = strchr(p, '\n');
        p = p ? p + 1 : NULL;
    }
    free(r);
    return sum;
}

// The text of tokens token_of(0 .. n-1).
static char *expected_text(int n)
{
    int32_t ids[MAX_TOKENS];
    for (int i = 0; i < n; i++)
        ids[i] = token_of(i);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_tok_decode(tok, ids, (size_t)n, true, &text, &len), TDM_OK);
    assert_true(len > 0);
    return text;
}

// A non-streamed completion of `max_tokens` tokens: asserts 200, the text
// and usage the fakes' tokens imply and a length finish.
static void assert_completion(char *resp, int max_tokens)
{
    if (status_of(resp) != 200)
        fail_msg("expected 200, got: %s", resp);
    cJSON *j = cJSON_Parse(body_of(resp));
    assert_non_null(j);
    const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
    assert_non_null(c0);
    char *want = expected_text(max_tokens);
    assert_string_equal(cJSON_GetObjectItem(c0, "text")->valuestring, want);
    free(want);
    assert_string_equal(cJSON_GetObjectItem(c0, "finish_reason")->valuestring, "length");
    const cJSON *u = cJSON_GetObjectItem(j, "usage");
    assert_int_equal(cJSON_GetObjectItem(u, "completion_tokens")->valueint, max_tokens);
    cJSON_Delete(j);
}

static const char *completion_body =
    "{\"model\":\"tiny\",\"prompt\":\"hello world\",\"max_tokens\":8}";

// ---- cases -------------------------------------------------------------------------------------
// One fake answers: 200 with its tokens' text, usage and a length finish; the
// fake saw the router's tokenization of the prompt; nothing retried.
static void test_plain_completion(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start(1, modes, 0, true);
    uint64_t before = lock_entries().request;
    char *r = post(rig.port, "/v1/completions", completion_body);
    assert_completion(r, 8);
    assert_int_equal(lock_entries().request - before, 2); // route, route done (8 before)
    cJSON *j = cJSON_Parse(body_of(r));
    int prompt_tokens =
        cJSON_GetObjectItem(cJSON_GetObjectItem(j, "usage"), "prompt_tokens")->valueint;
    cJSON_Delete(j);
    free(r);
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tok_encode(tok, "hello world", strlen("hello world"), false, &ids, &n),
                     TDM_OK);
    struct fake *f = &rig.fakes[0];
    assert_int_equal(fake_count(f, &f->n_generates), 1);
    assert_int_equal(f->n_prompt, n);
    assert_memory_equal(f->prompt, ids, n * sizeof *ids);
    assert_int_equal(prompt_tokens, (int)n);
    assert_int_equal(f->n_resume, 0);
    assert_int_equal(f->max_tokens, 8);
    free(ids);
    assert_true(metric("tandem:router_retries_total") == 0);
}

// Whether the router holds fake i as not up (never heard from, its load
// poller's link down: no candidate), waiting up to 5 s for it to be `want`.
static void wait_not_up(int i, bool want)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", rig.fakes[i].http_port);
    struct tdm_router_endpoints *eps = tdm_router_control_endpoints(rig.router->ctl);
    struct tdm_router_endpoint_view v;
    double until = tdm_now() + 5.0;
    for (;;) {
        assert_int_equal(tdm_router_endpoints_find(eps, name, &v), TDM_OK);
        if (v.not_up == want)
            return;
        if (tdm_now() > until)
            fail_msg("fake %d: not_up stayed %d", i, v.not_up);
        sleep_ms(5);
    }
}

static bool fake_healthy(int i)
{
    char name[64];
    snprintf(name, sizeof name, "127.0.0.1:%d", rig.fakes[i].http_port);
    struct tdm_router_endpoint_view v;
    assert_int_equal(
        tdm_router_endpoints_find(tdm_router_control_endpoints(rig.router->ctl), name, &v), TDM_OK);
    return v.healthy;
}

// The first decode worker listed cannot be reached: the router never heard
// from it and its load poller's dials to it fail, so it is no candidate.
// Every request goes to the second at once: no retry, no fallback, no
// upstream error, nothing counted against the first's health (before, every
// other route went to it, was refused and failed over, and three such
// refusals made it unhealthy). Once it listens it is a candidate again and
// takes its share.
static void test_not_up_not_a_candidate(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_UNREACHABLE, FAKE_ANSWER};
    rig_start(2, modes, 0, true);
    wait_not_up(0, true);
    uint64_t before = lock_entries().request;
    for (int i = 0; i < 4; i++) {
        char *r = post(rig.port, "/v1/completions", completion_body);
        assert_completion(r, 8);
        free(r);
    }
    assert_int_equal(lock_entries().request - before, 8); // 4 requests of 1 attempt of 2
    struct fake *ok = &rig.fakes[1];
    assert_int_equal(fake_count(ok, &ok->n_generates), 4);
    assert_true(metric("tandem:router_retries_total") == 0);
    assert_true(metric("tandem:router_endpoint_fallbacks_total") == 0);
    assert_true(metric("tandem:router_upstream_errors_total") == 0);
    assert_true(fake_healthy(0));

    fake_come_up(&rig.fakes[0]);
    wait_not_up(0, false);
    for (int i = 0; i < 2; i++) { // round robin over both again
        char *r = post(rig.port, "/v1/completions", completion_body);
        assert_completion(r, 8);
        free(r);
    }
    assert_int_equal(fake_count(&rig.fakes[0], &rig.fakes[0].n_generates), 1);
    assert_int_equal(fake_count(ok, &ok->n_generates), 5);
    assert_true(metric("tandem:router_retries_total") == 0);
    assert_true(metric("tandem:router_upstream_errors_total") == 0);
}

// The only decode worker is not up: the request gets the no-route answer
// (503, OpenAI error body saying why) at once, in one registry entry, with
// no send timeout waited for and nothing counted against the worker.
static void test_none_up_no_route(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_UNREACHABLE};
    rig_start(1, modes, 0, true);
    wait_not_up(0, true);
    uint64_t before = lock_entries().request;
    double t0 = tdm_now();
    char *r = post(rig.port, "/v1/completions", completion_body);
    double took = tdm_now() - t0;
    if (status_of(r) != 503)
        fail_msg("expected 503, got: %s", r);
    assert_oai_error(r, 503, "ServiceUnavailableError");
    cJSON *j = cJSON_Parse(body_of(r));
    const char *msg = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message")->valuestring;
    if (!strstr(msg, "no healthy decode endpoint (1 configured, 1 healthy); 1 not up yet"))
        fail_msg("message: %s", msg);
    cJSON_Delete(j);
    free(r);
    if (took >= 0.9) // the send timeout is 1.0 s
        fail_msg("the request took %.2f s", took);
    assert_int_equal(lock_entries().request - before, 1); // the failed route alone
    assert_true(metric("tandem:router_requests_total{status=\"no_endpoint\"}") == 1);
    assert_true(metric("tandem:router_upstream_errors_total") == 0);
    assert_true(metric("tandem:router_endpoint_fallbacks_total") == 0);
    assert_true(fake_healthy(0));
}

// The first refuses as busy before any token: retried on the second, the
// client sees only the second's answer; one retry counted.
static void test_busy_retried(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_BUSY, FAKE_ANSWER};
    rig_start(2, modes, 0, true);
    uint64_t before = lock_entries().request;
    char *r = post(rig.port, "/v1/completions", completion_body);
    assert_completion(r, 8);
    free(r);
    assert_int_equal(lock_entries().request - before, 4); // 2 attempts of 2 (15 before)
    for (int i = 0; i < 2; i++)
        assert_int_equal(fake_count(&rig.fakes[i], &rig.fakes[i].n_generates), 1);
    assert_true(metric("tandem:router_retries_total") == 1);
}

// Refused (closing), refused again, then busy (the picks B, D, C of the
// candidates B, C, D, E: A is not up, so no candidate): the budget's 3 routes
// are spent and the client gets the last worker's answer (503, OpenAI error
// body, its message) while the fifth, healthy worker and the unreachable
// first are never tried.
static void test_budget_spent(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_UNREACHABLE, FAKE_REFUSE, FAKE_BUSY, FAKE_REFUSE,
                                    FAKE_ANSWER};
    rig_start(5, modes, 0, true);
    wait_not_up(0, true);
    uint64_t before = lock_entries().request;
    char *r = post(rig.port, "/v1/completions", completion_body);
    assert_int_equal(lock_entries().request - before, 6); // 3 attempts of 2 (21 before)
    if (status_of(r) != 503)
        fail_msg("expected 503, got: %s", r);
    assert_oai_error(r, 503, "ServiceUnavailableError");
    cJSON *j = cJSON_Parse(body_of(r));
    const char *msg = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message")->valuestring;
    assert_non_null(strstr(msg, "fake: the waiting queue is full"));
    cJSON_Delete(j);
    free(r);
    for (int i = 1; i <= 3; i++)
        assert_int_equal(fake_count(&rig.fakes[i], &rig.fakes[i].n_generates), 1);
    assert_int_equal(fake_count(&rig.fakes[4], &rig.fakes[4].n_generates), 0);
    // The first two were retried away from; the third ended the budget.
    assert_true(metric("tandem:router_retries_total") == 2);
}

// What the client saw of a streamed completion.
struct stream_result {
    char text[4096];         // the events' text, concatenated
    int error_events;        // events carrying an "error" object
    char error_message[256]; // the first one's message
    int completion_tokens;   // the usage event's (-1: none)
    char finish[32];         // the last finish_reason seen
    bool done;               // [DONE] arrived
};

// Streams a completion of 12 tokens (with the usage event) and reads it whole.

static void stream_request(struct stream_result *out)
{
    memset(out, 0, sizeof *out);
    out->completion_tokens = -1;
    char *r = post(rig.port, "/v1/completions",
                   "{\"model\":\"tiny\",\"prompt\":\"hello world\",\"max_tokens\":12,"
                   "\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    if (status_of(r) != 200)
        fail_msg("expected 200, got: %s", r);
    size_t cap = strlen(r) + 1;
    char *body = malloc(cap);
    assert_non_null(body);
    dechunk(body_of(r), body, cap);
    free(r);
    char *ev[256];
    int n = sse_events(body, ev, 256);
    for (int i = 0; i < n; i++) {
        if (ev[i][0] == ':')
            continue;
        if (strcmp(ev[i], "[DONE]") == 0) {
            out->done = true;
            continue;
        }
        cJSON *j = cJSON_Parse(ev[i]);
        assert_non_null(j);
        const cJSON *e = cJSON_GetObjectItem(j, "error");
        if (e && out->error_events++ == 0) {
            const cJSON *m = cJSON_GetObjectItem(e, "message");
            snprintf(out->error_message, sizeof out->error_message, "%s",
                     cJSON_IsString(m) ? m->valuestring : "");
        }
        const cJSON *c0 = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        const cJSON *t = c0 ? cJSON_GetObjectItem(c0, "text") : NULL;
        if (cJSON_IsString(t)) {
            size_t len = strlen(out->text);
            snprintf(out->text + len, sizeof out->text - len, "%s", t->valuestring);
        }
        const cJSON *fr = c0 ? cJSON_GetObjectItem(c0, "finish_reason") : NULL;
        if (cJSON_IsString(fr))
            snprintf(out->finish, sizeof out->finish, "%s", fr->valuestring);
        const cJSON *u = cJSON_GetObjectItem(j, "usage");
        if (cJSON_IsObject(u))
            out->completion_tokens = cJSON_GetObjectItem(u, "completion_tokens")->valueint;
        cJSON_Delete(j);
    }
    free(body);
}

// A plain stream on one worker: all 12 tokens, and the registry entered
// twice, as a non-streamed completion (8 times before).
static void test_plain_stream(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start(1, modes, 0, true);
    uint64_t before = lock_entries().request;
    struct stream_result s;
    stream_request(&s);
    assert_int_equal(lock_entries().request - before, 2);
    char *want = expected_text(12);
    assert_string_equal(s.text, want);
    free(want);
    assert_int_equal(s.error_events, 0);
    assert_int_equal(s.completion_tokens, 12);
    assert_true(s.done);
}

// The stream's worker goes silent after 4 tokens: the router declares it
// lost (--liveness-timeout) and continues the stream on the second worker,
// which gets the 4 tokens as resume_tokens; the client sees all 12 once, in
// order, with a length finish; one migration counted, no loss.
static void test_stream_migrated(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_DIE, FAKE_ANSWER};
    rig_start(2, modes, 4, true);
    struct tdm_router_lock_entries before = lock_entries();
    struct stream_result s;
    stream_request(&s);
    struct tdm_router_lock_entries after = lock_entries();
    // Route, reroute (report A, hold B, release A), route done (14 before).
    assert_int_equal(after.request - before.request, 3);
    assert_true(after.liveness > before.liveness); // A's silence was checked
    char *want = expected_text(12);
    assert_string_equal(s.text, want);
    free(want);
    assert_int_equal(s.error_events, 0);
    assert_string_equal(s.finish, "length");
    assert_int_equal(s.completion_tokens, 12);
    assert_true(s.done);
    struct fake *a = &rig.fakes[0], *b = &rig.fakes[1];
    assert_int_equal(fake_count(a, &a->n_generates), 1);
    assert_int_equal(fake_count(b, &b->n_generates), 1);
    pthread_mutex_lock(&b->mu);
    assert_int_equal(b->n_resume, 4);
    for (int i = 0; i < 4; i++)
        assert_int_equal(b->resume[i], token_of(i));
    assert_int_equal(b->n_prompt, a->n_prompt); // the same prompt, resumed after its tokens
    assert_memory_equal(b->prompt, a->prompt, a->n_prompt * sizeof *a->prompt);
    assert_int_equal(b->max_tokens, 12);
    pthread_mutex_unlock(&b->mu);
    assert_true(metric("tandem:router_stream_migrations_total") == 1);
    assert_true(metric("tandem:router_decode_lost_total") == 0);
}

// Two losses in one stream: A goes silent after 4 tokens, the stream moves to
// B (round robin's second pick of C, B), B goes silent after 8; the second
// move avoids both lost workers and so takes C (the third pick of C alone;
// avoiding only B it would be A of A, C, which never answers), which ends the
// stream: 12 tokens once each, two migrations counted.
static void test_stream_migrated_twice(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_DIE, FAKE_ANSWER, FAKE_DIE};
    rig_start(3, modes, 4, true);
    uint64_t before = lock_entries().request;
    struct stream_result s;
    stream_request(&s);
    assert_int_equal(lock_entries().request - before, 4); // 1 + 2 reroutes + 1 (20 before)
    char *want = expected_text(12);
    assert_string_equal(s.text, want);
    free(want);
    assert_int_equal(s.error_events, 0);
    assert_string_equal(s.finish, "length");
    struct fake *a = &rig.fakes[0], *c = &rig.fakes[1], *b = &rig.fakes[2];
    assert_int_equal(fake_count(a, &a->n_generates), 1);
    assert_int_equal(fake_count(b, &b->n_generates), 1);
    assert_int_equal(fake_count(c, &c->n_generates), 1);
    pthread_mutex_lock(&c->mu);
    assert_int_equal(c->n_resume, 8);
    pthread_mutex_unlock(&c->mu);
    assert_true(metric("tandem:router_stream_migrations_total") == 2);
    assert_true(metric("tandem:router_decode_lost_total") == 0);
}

// The same with --no-stream-migration: the client has the 4 tokens, then an
// error event; the second worker is never asked; the loss is counted.
static void test_stream_lost_without_migration(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_DIE, FAKE_ANSWER};
    rig_start(2, modes, 4, false);
    uint64_t before = lock_entries().request;
    struct stream_result s;
    stream_request(&s);
    assert_int_equal(lock_entries().request - before, 2); // route, route done (8 before)
    char *want = expected_text(4);
    assert_string_equal(s.text, want);
    free(want);
    assert_int_equal(s.error_events, 1);
    assert_non_null(strstr(s.error_message, "stopped answering"));
    struct fake *b = &rig.fakes[1];
    assert_int_equal(fake_count(b, &b->n_generates), 0);
    assert_true(metric("tandem:router_stream_migrations_total") == 0);
    assert_true(metric("tandem:router_decode_lost_total") == 1);
}

// The stream's worker loses its fifth chunk in transit and sends the rest: the
// router takes none of the chunks after the hole (the client never sees a
// stream with a token missing), counts the worker lost and continues the
// stream on the second one from the 4 tokens it has; the client sees all 12
// once, in order. Without migration: the 4 tokens, then an error event naming
// the gap, never a finish as if nothing were missing.
static void test_stream_gap(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_GAP, FAKE_ANSWER};
    for (int migration = 1; migration >= 0; migration--) {
        rig_start(2, modes, 4, migration);
        struct stream_result s;
        stream_request(&s);
        struct fake *b = &rig.fakes[1];
        if (migration) {
            char *want = expected_text(12);
            assert_string_equal(s.text, want);
            free(want);
            assert_int_equal(s.error_events, 0);
            assert_string_equal(s.finish, "length");
            assert_int_equal(s.completion_tokens, 12);
            pthread_mutex_lock(&b->mu);
            assert_int_equal(b->n_resume, 4);
            pthread_mutex_unlock(&b->mu);
            assert_true(metric("tandem:router_stream_migrations_total") == 1);
        } else {
            char *want = expected_text(4);
            assert_string_equal(s.text, want);
            free(want);
            assert_int_equal(s.error_events, 1);
            assert_non_null(strstr(s.error_message, "tokens were lost"));
            assert_int_equal(fake_count(b, &b->n_generates), 0);
        }
        if (migration)
            rig_stop(NULL); // the second round starts its own rig (the teardown stops it)
    }
}

// ---- flow control ------------------------------------------------------------------------------
// A completion of max_tokens tokens with extra header lines (each ending "\r\n").
static char *post_with(const char *headers, int max_tokens)
{
    char body[160], req[1024];
    snprintf(body, sizeof body, "{\"model\":\"tiny\",\"prompt\":\"hello world\",\"max_tokens\":%d}",
             max_tokens);
    snprintf(req, sizeof req,
             "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
             "Content-Type: application/json\r\n%sContent-Length: %zu\r\n\r\n%s",
             headers, strlen(body), body);
    return roundtrip(rig.port, req);
}

struct bg_call {
    pthread_t th;
    const char *headers;
    int max_tokens;
    char *resp;
};

static void *bg_call_main(void *arg)
{
    struct bg_call *b = arg;
    b->resp = post_with(b->headers, b->max_tokens);
    return NULL;
}

// Waits until the router's flow-control queue holds n requests (5 s at most).
static void wait_queued(double n)
{
    double until = tdm_now() + 5.0;
    while (metric("tandem:router_flow_control_queue_size") != n) {
        if (tdm_now() > until)
            fail_msg("the flow-control queue never held %g (holds %g)", n,
                     metric("tandem:router_flow_control_queue_size"));
        sleep_ms(10);
    }
}

static void unlink_config(void)
{
    char path[300];
    snprintf(path, sizeof path, "%s/router.yaml", model_dir);
    unlink(path);
}

static const char *flow_config = "featureGates: [flowControl]\n"
                                 "policy: round_robin\n"
                                 "flowControl:\n"
                                 "  priorityBands: [{priority: 10, maxRequests: 1}]\n"
                                 "objectives: {gold: 10}\n"
                                 "endpoints:\n"
                                 "  decode: [{host: 127.0.0.1, http_port: %d, nng_port: %d}]\n";

// With the flowControl gate, a saturated pool (its one worker reports 10
// waiting, twice queueDepthThreshold 5) holds requests in the router: a
// standard one (priority 0) and then a gold one (priority 10) wait; a second
// gold one finds its band full (maxRequests 1): 429 with llm-d's message and
// dropped-reason header. When the worker reports an empty queue, the gold
// request reaches it first, then the standard one, and both complete.
static void test_flow_control_priority(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start_with(1, modes, 0, true, flow_config);
    struct fake *f = &rig.fakes[0];
    atomic_store(&f->waiting, 10);
    sleep_ms(200); // a report with the queue
    struct bg_call std = {.headers = "", .max_tokens = 5};
    struct bg_call gold = {.headers = "x-gateway-inference-objective: gold\r\n", .max_tokens = 3};
    assert_int_equal(pthread_create(&std.th, NULL, bg_call_main, &std), 0);
    wait_queued(1);
    assert_int_equal(pthread_create(&gold.th, NULL, bg_call_main, &gold), 0);
    wait_queued(2);
    char *r = post_with("x-gateway-inference-objective: gold\r\n", 4);
    assert_int_equal(status_of(r), 429);
    assert_non_null(strstr(r, "request rejected pre-queue: queue at capacity"));
    assert_non_null(strstr(r, "x-llm-d-request-dropped-reason: rejected-saturated"));
    assert_non_null(strstr(r, "Retry-After: 1"));
    assert_non_null(strstr(r, "\"type\":\"RateLimitError\""));
    free(r);
    assert_true(metric("tandem:router_flow_control_pool_saturation") >= 1.0);
    assert_int_equal(fake_count(f, &f->n_generates), 0);
    atomic_store(&f->waiting, 0);
    pthread_join(gold.th, NULL);
    pthread_join(std.th, NULL);
    assert_completion(gold.resp, 3);
    assert_completion(std.resp, 5);
    free(gold.resp);
    free(std.resp);
    pthread_mutex_lock(&f->mu);
    assert_int_equal(f->n_order, 2);
    assert_int_equal(f->order[0], 3); // gold first
    assert_int_equal(f->order[1], 5);
    pthread_mutex_unlock(&f->mu);
    assert_true(metric("tandem:router_flow_control_queue_size") == 0);
    // Dispatched (2) and RejectedCapacity (1) are counted by priority and outcome.
    assert_true(metric("tandem:router_flow_control_request_queue_duration_seconds_count") == 3);
    unlink_config();
}

// Waiting requests hold HTTP threads: with --http-threads 8 (a reserve of 2),
// six wait and the seventh is refused at once (429), so /health still
// answers; when the pool has room the six complete.
static void test_flow_control_thread_reserve(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start_with(1, modes, 0, true,
                   "featureGates: [flowControl]\npolicy: round_robin\n"
                   "endpoints:\n  decode: [{host: 127.0.0.1, http_port: %d, nng_port: %d}]\n");
    struct fake *f = &rig.fakes[0];
    atomic_store(&f->waiting, 10);
    sleep_ms(200);
    struct bg_call calls[6];
    for (int i = 0; i < 6; i++) {
        calls[i] = (struct bg_call){.headers = "", .max_tokens = 2};
        assert_int_equal(pthread_create(&calls[i].th, NULL, bg_call_main, &calls[i]), 0);
        wait_queued(i + 1);
    }
    char *r = post_with("", 2);
    assert_int_equal(status_of(r), 429);
    assert_non_null(strstr(r, "queue at capacity"));
    free(r);
    r = roundtrip(rig.port, "GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 200);
    free(r);
    atomic_store(&f->waiting, 0);
    for (int i = 0; i < 6; i++) {
        pthread_join(calls[i].th, NULL);
        assert_completion(calls[i].resp, 2);
        free(calls[i].resp);
    }
    unlink_config();
}

// A request waits at most defaultRequestTTL: 503 with llm-d's message and
// header, and the worker never saw it.
static void test_flow_control_ttl(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start_with(1, modes, 0, true,
                   "featureGates: [flowControl]\npolicy: round_robin\n"
                   "flowControl: {defaultRequestTTL: 300ms}\n"
                   "endpoints:\n  decode: [{host: 127.0.0.1, http_port: %d, nng_port: %d}]\n");
    struct fake *f = &rig.fakes[0];
    atomic_store(&f->waiting, 6);
    sleep_ms(200);
    double t0 = tdm_now();
    char *r = post_with("", 4);
    double took = tdm_now() - t0;
    assert_int_equal(status_of(r), 503);
    assert_non_null(strstr(r, "request TTL expired"));
    assert_non_null(strstr(r, "x-llm-d-request-dropped-reason: rejected-ttl-expired"));
    free(r);
    assert_true(took >= 0.29 && took < 5);
    assert_int_equal(fake_count(f, &f->n_generates), 0);
    unlink_config();
}

// Without the gate, nothing waits: a sheddable request (negative priority)
// is refused while the pool is saturated (429, llm-d's message), any other
// goes through; with room, the sheddable one goes through too.
static void test_flow_control_off_sheds(void **state)
{
    (void)state;
    const enum fake_mode modes[] = {FAKE_ANSWER};
    rig_start_with(1, modes, 0, true,
                   "policy: round_robin\nobjectives: {batch: -1}\n"
                   "endpoints:\n  decode: [{host: 127.0.0.1, http_port: %d, nng_port: %d}]\n");
    struct fake *f = &rig.fakes[0];
    atomic_store(&f->waiting, 10);
    sleep_ms(200);
    char *r = post_with("x-gateway-inference-objective: batch\r\n", 4);
    assert_int_equal(status_of(r), 429);
    assert_non_null(strstr(r, "system saturated, sheddable request dropped"));
    free(r);
    r = post_with("", 4);
    assert_completion(r, 4);
    free(r);
    atomic_store(&f->waiting, 0);
    sleep_ms(200);
    r = post_with("x-gateway-inference-objective: batch\r\n", 4);
    assert_completion(r, 4);
    free(r);
    assert_int_equal(fake_count(f, &f->n_generates), 2);
    unlink_config();
}

// ---- main --------------------------------------------------------------------------------------
static int setup(void **state)
{
    (void)state;
    char err[256];
    if (mkdtemp(model_dir) == NULL)
        return -1;
    struct tdm_mkmodel_spec spec;
    if (tdm_mkmodel_preset(&spec, "tiny") != TDM_OK ||
        tdm_mkmodel_write(&spec, model_dir, err, sizeof err) != TDM_OK ||
        tdm_tok_load(&tok, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "model: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_tok_free(tok);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_plain_completion, rig_stop),
        cmocka_unit_test_teardown(test_not_up_not_a_candidate, rig_stop),
        cmocka_unit_test_teardown(test_none_up_no_route, rig_stop),
        cmocka_unit_test_teardown(test_busy_retried, rig_stop),
        cmocka_unit_test_teardown(test_budget_spent, rig_stop),
        cmocka_unit_test_teardown(test_plain_stream, rig_stop),
        cmocka_unit_test_teardown(test_stream_migrated, rig_stop),
        cmocka_unit_test_teardown(test_stream_migrated_twice, rig_stop),
        cmocka_unit_test_teardown(test_stream_lost_without_migration, rig_stop),
        cmocka_unit_test_teardown(test_stream_gap, rig_stop),
        cmocka_unit_test_teardown(test_flow_control_priority, rig_stop),
        cmocka_unit_test_teardown(test_flow_control_ttl, rig_stop),
        cmocka_unit_test_teardown(test_flow_control_thread_reserve, rig_stop),
        cmocka_unit_test_teardown(test_flow_control_off_sheds, rig_stop),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
