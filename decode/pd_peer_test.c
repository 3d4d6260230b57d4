// SPDX-License-Identifier: Apache-2.0
// pd_peer_test: the decode worker's P/D receiver against a prefill worker
// that breaks the protocol. A decode worker runs in this process on the CPU
// backend with a tiny random model; the test plays both the router (it sends
// the GenerateRequest and reads the TokenChunks) and the one prefill worker
// the request lists (it reads the PrefillRequest and answers by hand), on
// one inbox of its own.
//   - KvData over a transport no mode has ("carrier-pigeon"), with a payload
//     exactly as nng would carry it, then a good PrefillResult: the frame is
//     refused, never imported (it went to nng's table before, and its zeros
//     were decoded as the prompt's KV), the attempt fails as a transfer
//     failure and the prefill worker gets a Cancel, the request falls back to
//     a local prefill and streams the decode worker's own tokens; a request
//     after it is unaffected.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "kv_cache.h"
#include "metrics.h"
#include "mkmodel.h"
#include "pd_codec.h"
#include "pd_receiver.h"
#include "tandem.pb-c.h"
#include "transport.h"
#include "worker.h"

#define PROMPT 40
#define MAX_TOKENS 8

static char model_dir[] = "/tmp/pd_peer_test_XXXXXX";
static struct tdm_worker *dw;
static struct tdm_pd_receiver *rx;
static struct tdm_net_inbox *peer_in; // the router's and the prefill worker's inbox
static struct tdm_net_outbox *peer_out;
static const uint64_t peer_instance = 0x5eed;

static int setup(void **state)
{
    (void)state;
    char err[512];
    if (mkdtemp(model_dir) == NULL)
        return -1;
    struct tdm_mkmodel_spec s;
    tdm_mkmodel_preset(&s, "tiny");
    if (tdm_mkmodel_write(&s, model_dir, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "mkmodel: %s\n", err);
        return -1;
    }
    struct tdm_worker_config c;
    tdm_worker_config_default(&c);
    snprintf(c.model, sizeof c.model, "%s", model_dir);
    snprintf(c.host, sizeof c.host, "127.0.0.1");
    snprintf(c.device, sizeof c.device, "cpu");
    c.port = 0;
    c.num_kv_blocks = 32;
    c.block_size = 16;
    c.enable_prefix_caching = false; // every request imports or computes its whole prompt
    c.max_num_seqs = 4;
    c.threads = 1;
    c.http_threads = 2;
    struct tdm_pd_receiver_config rc;
    tdm_pd_receiver_config_default(&rc);
    snprintf(rc.nng_url, sizeof rc.nng_url, "tcp://127.0.0.1:0");
    rc.prefill_liveness = 60; // the fake prefill worker answers no LoadQuery
    if (tdm_worker_new(&dw, &c, err, sizeof err) != TDM_OK ||
        tdm_worker_load(dw, err, sizeof err) != TDM_OK ||
        tdm_pd_receiver_new(&rx, dw, &rc, err, sizeof err) != TDM_OK ||
        tdm_net_inbox_new(&peer_in, "tcp://127.0.0.1:0", err, sizeof err) != TDM_OK ||
        tdm_net_outbox_new(&peer_out, 50, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "setup: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_net_outbox_free(peer_out);
    tdm_net_inbox_free(peer_in);
    tdm_pd_receiver_free(rx);
    tdm_worker_free(dw);
    tdm_mkmodel_remove(model_dir);
    return 0;
}

static void send_generate(const char *id, bool remote)
{
    int32_t prompt[PROMPT];
    for (int i = 0; i < PROMPT; i++)
        prompt[i] = 3 + (i * 37 + 11) % 250;
    Tandem__SamplingParams sp = TANDEM__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.0f;
    sp.top_p = 1.0f;
    sp.repetition_penalty = 1.0f;
    sp.ignore_eos = true;
    sp.logprobs = -1;
    Tandem__GenerateRequest g = TANDEM__GENERATE_REQUEST__INIT;
    Tandem__Peer me = TANDEM__PEER__INIT;
    me.url = (char *)tdm_net_inbox_url(peer_in);
    me.instance = peer_instance;
    Tandem__PrefillTarget t = TANDEM__PREFILL_TARGET__INIT;
    t.url = (char *)tdm_net_inbox_url(peer_in); // the prefill worker: this test too
    Tandem__PrefillTarget *tp = &t;
    g.request_id = (char *)id;
    g.reply_to = &me;
    g.to_instance = tdm_pd_receiver_instance(rx);
    g.prompt = prompt;
    g.n_prompt = PROMPT;
    g.sampling = &sp;
    g.max_tokens = MAX_TOKENS;
    g.deadline_unix = (double)time(NULL) + 120;
    g.local_fallback = true;
    if (remote) {
        g.n_prefill = 1;
        g.prefill = &tp;
        g.max_prefill_attempts = 1;
    }
    char err[256];
    assert_int_equal(tdm_pd_send(peer_out, tdm_pd_receiver_url(rx), TDM_NET_GENERATE, &g.base, NULL,
                                 0, 5.0, err, sizeof err),
                     TDM_OK);
}

// What came back to the test's inbox for one request.
struct seen {
    Tandem__PrefillRequest *prefill; // the PrefillRequest (owned), NULL until it came
    bool cancelled;                  // a Cancel of its transfer came
    int32_t tokens[MAX_TOKENS + 1];
    int n_tokens;
    bool finished;
    int finish, error;
};

// Reads frames for id until done(s) holds; fails after timeout_s.
static void read_until(const char *id, struct seen *s, bool (*done)(const struct seen *),
                       double timeout_s)
{
    double end = tdm_now() + timeout_s;
    while (!done(s)) {
        assert_true(tdm_now() < end);
        struct tdm_net_msg *msg = NULL;
        char err[256];
        if (tdm_net_inbox_recv(peer_in, 0.1, &msg, err, sizeof err) != TDM_OK)
            continue;
        const struct tdm_net_frame *f = tdm_net_msg_frame(msg);
        if (f->type == TDM_NET_PREFILL) {
            Tandem__PrefillRequest *p = tandem__prefill_request__unpack(NULL, f->msg_len, f->msg);
            assert_non_null(p);
            if (strcmp(p->request_id, id) == 0 && s->prefill == NULL)
                s->prefill = p;
            else
                tandem__prefill_request__free_unpacked(p, NULL);
        } else if (f->type == TDM_NET_CANCEL) {
            Tandem__Cancel *c = tandem__cancel__unpack(NULL, f->msg_len, f->msg);
            assert_non_null(c);
            if (s->prefill && c->transfer_id == s->prefill->transfer_id)
                s->cancelled = true;
            tandem__cancel__free_unpacked(c, NULL);
        } else if (f->type == TDM_NET_TOKENS) {
            Tandem__TokenChunk *c = tandem__token_chunk__unpack(NULL, f->msg_len, f->msg);
            assert_non_null(c);
            if (strcmp(c->request_id, id) == 0) {
                for (size_t i = 0; i < c->n_tokens && s->n_tokens <= MAX_TOKENS; i++)
                    s->tokens[s->n_tokens++] = c->tokens[i];
                if (c->finished) {
                    s->finished = true;
                    s->finish = c->finish;
                    s->error = c->error;
                }
            }
            tandem__token_chunk__free_unpacked(c, NULL);
        }
        tdm_net_msg_free(msg);
    }
}

static bool got_prefill(const struct seen *s)
{
    return s->prefill != NULL;
}

static bool got_finish(const struct seen *s)
{
    return s->finished;
}

static bool metric_has(const char *line)
{
    struct tdm_worker_parts parts;
    assert_int_equal(tdm_worker_parts(dw, &parts), TDM_OK);
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_metrics_render(parts.reg, &text, &len), TDM_OK);
    bool found = strstr(text, line) != NULL;
    free(text);
    return found;
}

static void test_unknown_transport(void **state)
{
    (void)state;
    // The decode worker's own tokens for the prompt: a request prefilled here.
    struct seen local;
    memset(&local, 0, sizeof local);
    send_generate("local-1", false);
    read_until("local-1", &local, got_finish, 60);
    assert_int_equal(local.error, 0);
    assert_int_equal(local.n_tokens, MAX_TOKENS);

    struct seen s;
    memset(&s, 0, sizeof s);
    send_generate("pigeon-1", true);
    read_until("pigeon-1", &s, got_prefill, 30);
    const Tandem__PrefillRequest *p = s.prefill;
    struct tdm_kv_header h;
    assert_int_equal(p->kv_header.len, sizeof h);
    memcpy(&h, p->kv_header.data, sizeof h);
    assert_true(p->num_blocks > 0);
    // Every layer in one frame, the payload exactly as nng carries it (K then
    // V, [num_blocks][num_kv_heads][block_size][head_dim] of the header's
    // dtype), zeros: nng's table would take it.
    size_t layer_bytes = 2 * (size_t)p->num_blocks * (size_t)h.num_kv_heads * (size_t)h.block_size *
                         (size_t)h.head_dim * (h.dtype == 1 ? 2 : 4);
    size_t payload_len = layer_bytes * (size_t)h.num_layers;
    uint8_t *payload = calloc(1, payload_len);
    assert_non_null(payload);
    const uint64_t prefill_instance = 0x9ef11;
    Tandem__KvData d = TANDEM__KV_DATA__INIT;
    d.transfer_id = p->transfer_id;
    d.to_instance = p->reply_to->instance;
    d.from_instance = prefill_instance;
    d.first_layer = 0;
    d.num_layers = h.num_layers;
    d.first_block = p->first_block;
    d.num_blocks = p->num_blocks;
    d.transport = "carrier-pigeon";
    char err[256];
    assert_int_equal(tdm_pd_send(peer_out, p->reply_to->url, TDM_NET_KV_DATA, &d.base, payload,
                                 payload_len, 5.0, err, sizeof err),
                     TDM_OK);
    free(payload);
    Tandem__PrefillResult r = TANDEM__PREFILL_RESULT__INIT;
    r.transfer_id = p->transfer_id;
    r.to_instance = p->reply_to->instance;
    r.from_instance = prefill_instance;
    r.first_token = 7;
    r.num_prompt_tokens = PROMPT;
    r.kv_header = p->kv_header; // the whole prompt, as asked
    assert_int_equal(tdm_pd_send(peer_out, p->reply_to->url, TDM_NET_PREFILL_RESULT, &r.base, NULL,
                                 0, 5.0, err, sizeof err),
                     TDM_OK);

    // The attempt fails: a Cancel to the prefill worker; then the fallback's
    // local prefill streams the decode worker's own tokens.
    read_until("pigeon-1", &s, got_finish, 60);
    assert_true(s.cancelled);
    assert_int_equal(s.error, 0);
    assert_int_equal(s.finish, TANDEM__FINISH_REASON__FINISH_LENGTH);
    assert_int_equal(s.n_tokens, MAX_TOKENS);
    assert_memory_equal(s.tokens, local.tokens, sizeof local.tokens[0] * MAX_TOKENS);
    assert_true(metric_has("tandem:pd_prefill_failures_total{reason=\"transfer\"} 1"));
    assert_true(metric_has("tandem:pd_requests_total{prefill=\"fallback\"} 1"));
    tandem__prefill_request__free_unpacked(s.prefill, NULL);

    // The next request is unaffected.
    memset(&s, 0, sizeof s);
    send_generate("local-2", false);
    read_until("local-2", &s, got_finish, 60);
    assert_int_equal(s.error, 0);
    assert_memory_equal(s.tokens, local.tokens, sizeof local.tokens[0] * MAX_TOKENS);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unknown_transport),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
