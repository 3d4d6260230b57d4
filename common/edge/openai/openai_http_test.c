// SPDX-License-Identifier: Apache-2.0
// Tests of openai_http (the OpenAI API over common/edge/http) against a real server
// on 127.0.0.1, driven by raw sockets (common/edge/http/http_test_client): OpenAI
// error answers (Retry-After on 503), a miniature completions endpoint over the
// request parser and response builders, and the call path both roles share,
// over a scripted token source and a small tokenizer from tools/mkmodel:
// role/echo opening chunks, per-choice chunks with continuous usage, stop
// strings, an error event after the stream started, the idle probe, a client
// that leaves (the stream says so), rejected and echo-only requests, /tokenize
// and /detokenize; and the error -> status table.

#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <cmocka.h>

#include "chat.h"
#include "core.h"
#include "http.h"
#include "http_test_client.h"
#include "mkmodel.h"
#include "openai_http.h"
#include "tokenizer.h"

// ---- handlers ---------------------------------------------------------------------------------
static void h_queue_full(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_fail(c, TDM_EBUSY, "the waiting queue is full (--max-waiting 1)");
}

static void h_busy(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_errorf(c, 503, NULL, "queue full (%d waiting)", 7);
}

// A miniature completions endpoint over both modules: parse, then either an
// OpenAI error or a stream of chunks built by the openai builders.
static void h_completions(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    static const struct tdm_oai_model_info info = {
        .served_name = "qwen", .vocab_size = 100, .max_model_len = 64};
    size_t len;
    const char *body = tdm_http_body(c, &len);
    struct tdm_oai_request req;
    struct tdm_oai_error e;
    if (tdm_oai_request_parse(&req, TDM_OAI_COMPLETION, body, len, &info, &e) != TDM_OK) {
        tdm_oai_http_error(c, &e);
        return;
    }
    struct tdm_oai_response r;
    tdm_oai_response_init(&r, TDM_OAI_COMPLETION, "qwen", req.request_id);
    static const char *const words[] = {" Paris", " is", " nice", "."};
    if (!req.stream) {
        struct tdm_oai_choice ch = {
            .text = " Paris", .text_len = 6, .finish = TDM_FINISH_LENGTH, .stop_token = -1};
        struct tdm_oai_usage u = {3, 1};
        char *json = tdm_oai_body(&r, &ch, 1, &u);
        tdm_http_respond_json(c, 200, json);
        free(json);
        tdm_oai_request_fini(&req);
        return;
    }
    tdm_http_sse_start(c);
    for (int i = 0; i < 4; i++) {
        struct tdm_oai_choice ch = {.text = words[i],
                                    .text_len = strlen(words[i]),
                                    .finish = i == 3 ? TDM_FINISH_STOP : TDM_FINISH_NONE,
                                    .stop_token = -1};
        char *json = tdm_oai_chunk(&r, &ch, 1, NULL);
        tdm_http_sse_event(c, json, strlen(json));
        free(json);
    }
    if (req.include_usage) {
        struct tdm_oai_usage u = {3, 4};
        char *json = tdm_oai_usage_chunk(&r, &u);
        tdm_http_sse_event(c, json, strlen(json));
        free(json);
    }
    tdm_http_sse_end(c, true);
    tdm_oai_request_fini(&req);
}

// ---- OpenAI routes over a scripted token source ---------------------------------------------
static char oai_dir[] = "/tmp/tdm_oai_http_XXXXXX";
static struct tdm_tokenizer *oai_tok;
static struct tdm_chat_template *oai_chat;
static struct tdm_oai_model_info oai_info;
static const char oai_text[] = "The quick brown fox jumps over the lazy dog.";

// What the last generating handler saw (written before it returns).
struct oai_probe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool finished;
    int rc;    // tdm_oai_http_stream's result
    int stops; // stop strings the assemblers reported to the source
    int pumps;
};

// Each pump gives every unfinished choice the next token of oai_text, then
// finishes it with "length". fail: choice 0 fails after two tokens (a lost
// worker); idle: the first pumps bring nothing; forever: the text repeats.
struct script {
    struct tdm_oai_call *k;
    int32_t *ids;
    size_t n_ids;
    size_t pos[8];
    bool fail, idle, forever;
    int pumps, stops;
};

static void sleep_ms(long ms)
{
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

static int script_pump(void *arg)
{
    struct script *sc = arg;
    if (sc->idle && ++sc->pumps <= 6) {
        sleep_ms(20);
        return 0;
    }
    if (sc->forever)
        sleep_ms(1);
    int progressed = 0;
    for (size_t i = 0; i < sc->k->n_choices && i < 8; i++) {
        struct tdm_oai_asm *a = &sc->k->choices[i];
        if (a->done)
            continue;
        bool stopped = false;
        int rc = TDM_OK;
        if (sc->fail && i == 0 && a->completion_tokens == 2)
            tdm_oai_asm_fail(a, TDM_ETRANSPORT, "decode worker d1 stopped answering");
        else if (sc->pos[i] < sc->n_ids || sc->forever)
            rc = tdm_oai_asm_token(a, sc->ids[sc->pos[i]++ % sc->n_ids], -0.25f, NULL, 0, false,
                                   &stopped);
        else
            rc = tdm_oai_asm_finish(a, TDM_FINISH_LENGTH, -1, 0, NULL, &stopped);
        if (rc != TDM_OK)
            return -1;
        sc->stops += stopped;
        progressed++;
    }
    return progressed;
}

static void h_oai_generate(struct tdm_http_conn *c, struct oai_probe *p, enum tdm_oai_kind kind)
{
    struct tdm_oai_call k;
    int rc = -1;
    struct script sc = {.k = &k};
    if (tdm_oai_http_call_start(c, &k, kind, &oai_info, oai_tok, oai_chat, "none")) {
        const char *q = tdm_http_query(c) ? tdm_http_query(c) : "";
        sc.fail = strstr(q, "fail") != NULL;
        sc.idle = strstr(q, "idle") != NULL;
        sc.forever = strstr(q, "forever") != NULL;
        const char *iv = strstr(q, "interval=");
        k.stream_interval = iv ? atoi(iv + 9) : 0; // a server's --stream-interval
        if (tdm_tok_encode(oai_tok, oai_text, strlen(oai_text), false, &sc.ids, &sc.n_ids) !=
            TDM_OK) {
            tdm_oai_http_errorf(c, 500, NULL, "tokenizer");
        } else if (k.req.stream) {
            rc = tdm_oai_http_stream(c, &k, script_pump, &sc, sc.idle ? 0.05 : 0);
        } else {
            while (!tdm_oai_call_done(&k) && script_pump(&sc) >= 0)
                ;
            tdm_http_respond_json_owned(c, 200, tdm_oai_call_body(&k));
        }
    }
    free(sc.ids);
    tdm_oai_call_fini(&k);
    pthread_mutex_lock(&p->mu);
    p->rc = rc;
    p->stops = sc.stops;
    p->pumps = sc.pumps;
    p->finished = true;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

static void h_oai_completions(struct tdm_http_conn *c, void *arg)
{
    h_oai_generate(c, arg, TDM_OAI_COMPLETION);
}

static void h_oai_chat(struct tdm_http_conn *c, void *arg)
{
    h_oai_generate(c, arg, TDM_OAI_CHAT);
}

static void h_oai_tokenize(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_tokenize(c, &oai_info, oai_tok, oai_chat, "none", oai_info.max_model_len);
}

static void h_oai_detokenize(struct tdm_http_conn *c, void *arg)
{
    (void)arg;
    tdm_oai_http_detokenize(c, &oai_info, oai_tok);
}

struct fixture {
    struct tdm_http_server *srv;
    struct oai_probe oai;
    int port;
};

static int setup(void **state)
{
    struct fixture *f = calloc(1, sizeof *f);
    pthread_mutex_init(&f->oai.mu, NULL);
    tdm_cond_init(&f->oai.cv);
    char tok_err[256];
    if (mkdtemp(oai_dir) == NULL ||
        tdm_mkmodel_write_tokenizer(1000, oai_dir, tok_err, sizeof tok_err) != TDM_OK ||
        tdm_tok_load(&oai_tok, oai_dir, tok_err, sizeof tok_err) != TDM_OK ||
        tdm_chat_template_new(&oai_chat, tdm_tok_chat_template(oai_tok), NULL, tok_err,
                              sizeof tok_err) != TDM_OK) {
        fprintf(stderr, "tokenizer: %s\n", tok_err);
        return -1;
    }
    oai_info.served_name = "tiny";
    oai_info.vocab_size = tdm_tok_vocab_size(oai_tok);
    oai_info.max_model_len = 512;
    struct tdm_http_config cfg = {.host = "127.0.0.1",
                                  .port = 0,
                                  .num_threads = 8,
                                  .max_body_bytes = 1024,
                                  .error_body = tdm_oai_http_error_body};
    char err[256];
    if (tdm_http_server_new(&f->srv, &cfg, err, sizeof err) != TDM_OK)
        return -1;
    tdm_http_route(f->srv, "GET", "/busy", h_busy, NULL);
    tdm_http_route(f->srv, "GET", "/queue-full", h_queue_full, NULL);
    tdm_http_route(f->srv, "POST", "/v1/completions", h_completions, NULL);
    tdm_http_route(f->srv, "POST", "/oai/completions", h_oai_completions, &f->oai);
    tdm_http_route(f->srv, "POST", "/oai/chat", h_oai_chat, &f->oai);
    tdm_http_route(f->srv, "POST", "/oai/tokenize", h_oai_tokenize, NULL);
    tdm_http_route(f->srv, "POST", "/oai/detokenize", h_oai_detokenize, NULL);
    if (tdm_http_server_port(f->srv) != 0)
        return -1;
    if (tdm_http_server_start(f->srv, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "%s\n", err);
        return -1;
    }
    f->port = tdm_http_server_port(f->srv);
    *state = f;
    return f->port > 0 ? 0 : -1;
}

static int teardown(void **state)
{
    struct fixture *f = *state;
    tdm_http_server_free(f->srv);
    pthread_mutex_destroy(&f->oai.mu);
    pthread_cond_destroy(&f->oai.cv);
    tdm_chat_template_free(oai_chat);
    tdm_tok_free(oai_tok);
    tdm_mkmodel_remove(oai_dir);
    free(f);
    return 0;
}

// ---- tests ------------------------------------------------------------------------------------
static void test_error_answers(void **state)
{
    struct fixture *f = *state;
    // Every 503 error carries Retry-After; errorf formats the message.
    char *r = roundtrip(f->port, "GET /busy HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_int_equal(status_of(r), 503);
    char hv[32];
    assert_non_null(header_of(r, "Retry-After", hv, sizeof hv));
    assert_string_equal(hv, "1");
    assert_non_null(strstr(body_of(r), "queue full (7 waiting)"));
    assert_oai_error(r, 503, "ServiceUnavailableError");
    free(r);
    // The server's own errors through the hook.
    r = roundtrip(f->port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 404, "NotFoundError");
    assert_null(header_of(r, "Retry-After", hv, sizeof hv));
    free(r);
}

static void test_openai_over_http(void **state)
{
    struct fixture *f = *state;
    // Validation errors reach the client as vLLM's error bodies.
    char *r = post(f->port, "/v1/completions", "{\"prompt\":\"x\",\"temperature\":5}");
    assert_oai_error(r, 400, "BadRequestError");
    cJSON *j = cJSON_Parse(body_of(r));
    const cJSON *err = cJSON_GetObjectItem(j, "error");
    assert_string_equal(cJSON_GetObjectItem(err, "message")->valuestring,
                        "temperature must be in [0, 2], got 5.0.");
    assert_string_equal(cJSON_GetObjectItem(err, "param")->valuestring, "temperature");
    cJSON_Delete(j);
    free(r);
    r = post(f->port, "/v1/completions", "{\"model\":\"gpt-4\",\"prompt\":\"x\"}");
    assert_oai_error(r, 404, "NotFoundError");
    free(r);

    r = post(f->port, "/v1/completions", "{\"prompt\":\"x\",\"request_id\":\"abc\"}");
    assert_int_equal(status_of(r), 200);
    j = cJSON_Parse(body_of(r));
    assert_non_null(j);
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-abc");
    cJSON_Delete(j);
    free(r);

    // A stream: every event is one JSON chunk, same id throughout, then usage, then [DONE].
    r = post(f->port, "/v1/completions",
             "{\"prompt\":\"x\",\"stream\":true,\"stream_options\":{\"include_usage\":true}}");
    assert_int_equal(status_of(r), 200);
    char events[8192];
    dechunk(body_of(r), events, sizeof events);
    char text[64] = "", id[96] = "";
    int n_events = 0;
    bool done = false, usage = false;
    for (char *ev = events; *ev;) {
        assert_memory_equal(ev, "data: ", 6);
        char *end = strstr(ev, "\n\n");
        assert_non_null(end);
        *end = '\0';
        const char *data = ev + 6;
        if (strcmp(data, "[DONE]") == 0) {
            done = true;
            assert_string_equal(end + 2, "");
        } else {
            assert_false(done);
            cJSON *c = cJSON_Parse(data);
            assert_non_null(c);
            const char *cid = cJSON_GetObjectItem(c, "id")->valuestring;
            if (!id[0])
                snprintf(id, sizeof id, "%s", cid);
            assert_string_equal(cid, id);
            const cJSON *choices = cJSON_GetObjectItem(c, "choices");
            if (cJSON_GetArraySize(choices) == 0) {
                usage = true;
                assert_int_equal(
                    cJSON_GetObjectItem(cJSON_GetObjectItem(c, "usage"), "total_tokens")->valueint,
                    7);
            } else {
                strcat(text,
                       cJSON_GetObjectItem(cJSON_GetArrayItem(choices, 0), "text")->valuestring);
            }
            cJSON_Delete(c);
            n_events++;
        }
        ev = end + 2;
    }
    assert_true(done && usage);
    assert_int_equal(n_events, 5);
    assert_string_equal(text, " Paris is nice.");
    free(r);
}

// ---- OpenAI routes ---------------------------------------------------------------------------
static void oai_reset(struct fixture *f)
{
    pthread_mutex_lock(&f->oai.mu);
    f->oai.finished = false;
    pthread_mutex_unlock(&f->oai.mu);
}

// Waits (up to 10 s) for the generating handler to return; its probe.
static struct oai_probe oai_wait(struct fixture *f)
{
    pthread_mutex_lock(&f->oai.mu);
    while (!f->oai.finished) {
        if (!tdm_cond_wait_for(&f->oai.cv, &f->oai.mu, 10.0))
            break;
    }
    struct oai_probe p = {
        .finished = f->oai.finished, .rc = f->oai.rc, .stops = f->oai.stops, .pumps = f->oai.pumps};
    pthread_mutex_unlock(&f->oai.mu);
    assert_true(p.finished);
    return p;
}
// The events of the last oai_events call (pointers into oai_buf).
static char oai_buf[65536];
static char *oai_ev[256];

// Posts a streamed request, checks the SSE response, waits for the handler
// and splits the events into oai_ev. Returns the count; *p gets the handler's
// probe (stream result, stops seen, pumps).
static int oai_events(struct fixture *f, const char *path, const char *json, struct oai_probe *p)
{
    oai_reset(f);
    char *r = post(f->port, path, json);
    assert_int_equal(status_of(r), 200);
    char v[64];
    assert_string_equal(header_of(r, "Content-Type", v, sizeof v),
                        "text/event-stream; charset=utf-8");
    dechunk(body_of(r), oai_buf, sizeof oai_buf);
    free(r);
    *p = oai_wait(f);
    int n = sse_events(oai_buf, oai_ev, 256);
    assert_true(n > 0);
    assert_string_equal(oai_ev[n - 1], "[DONE]");
    return n;
}

static int int_of(const cJSON *o, const char *a, const char *b)
{
    const cJSON *x = cJSON_GetObjectItem(cJSON_GetObjectItem(o, a), b);
    assert_true(cJSON_IsNumber(x));
    return x->valueint;
}

static void test_oai_stream_chat(void **state)
{
    struct fixture *f = *state;
    struct oai_probe p;
    int n = oai_events(f, "/oai/chat",
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"n\":2,"
                       "\"max_tokens\":100,\"stream\":true,\"stream_options\":{"
                       "\"include_usage\":true,\"continuous_usage_stats\":true}}",
                       &p);
    assert_int_equal(p.rc, TDM_OK);
    char text[2][256] = {"", ""}, id[96] = "";
    int finishes[2] = {0, 0}, last_tokens[2] = {0, 0}, prompt_tokens = -1;
    for (int i = 0; i < n - 1; i++) {
        cJSON *c = cJSON_Parse(oai_ev[i]);
        assert_non_null(c);
        if (!id[0])
            snprintf(id, sizeof id, "%s", cJSON_GetObjectItem(c, "id")->valuestring);
        assert_string_equal(cJSON_GetObjectItem(c, "id")->valuestring, id);
        assert_string_equal(cJSON_GetObjectItem(c, "object")->valuestring, "chat.completion.chunk");
        const cJSON *cs = cJSON_GetObjectItem(c, "choices");
        if (i == n - 2) { // the usage chunk: both choices' tokens
            assert_int_equal(cJSON_GetArraySize(cs), 0);
            assert_int_equal(int_of(c, "usage", "completion_tokens"),
                             last_tokens[0] + last_tokens[1]);
            assert_int_equal(int_of(c, "usage", "prompt_tokens"), prompt_tokens);
            cJSON_Delete(c);
            continue;
        }
        const cJSON *ch = cJSON_GetArrayItem(cs, 0);
        int idx = cJSON_GetObjectItem(ch, "index")->valueint;
        assert_true(idx == 0 || idx == 1);
        const cJSON *delta = cJSON_GetObjectItem(ch, "delta");
        if (i < 2) { // the opening chunks name the role, one per choice
            assert_int_equal(idx, i);
            assert_string_equal(cJSON_GetObjectItem(delta, "role")->valuestring, "assistant");
            cJSON_Delete(c);
            continue;
        }
        const cJSON *content = cJSON_GetObjectItem(delta, "content");
        if (cJSON_IsString(content))
            strcat(text[idx], content->valuestring);
        const cJSON *fr = cJSON_GetObjectItem(ch, "finish_reason");
        if (cJSON_IsString(fr)) {
            assert_string_equal(fr->valuestring, "length");
            finishes[idx]++;
        }
        // continuous_usage_stats: the prompt and this choice's tokens so far.
        int pt = int_of(c, "usage", "prompt_tokens"), ct = int_of(c, "usage", "completion_tokens");
        assert_true(prompt_tokens == -1 || pt == prompt_tokens);
        prompt_tokens = pt;
        assert_true(ct >= last_tokens[idx]);
        last_tokens[idx] = ct;
        cJSON_Delete(c);
    }
    assert_true(prompt_tokens > 0);
    for (int i = 0; i < 2; i++) {
        assert_string_equal(text[i], oai_text);
        assert_int_equal(finishes[i], 1);
    }
}

static void test_oai_stream_echo_and_stop(void **state)
{
    struct fixture *f = *state;
    struct oai_probe p;
    int n = oai_events(f, "/oai/completions",
                       "{\"prompt\":\"Say:\",\"echo\":true,\"stop\":[\" fox\"],"
                       "\"return_token_ids\":true,\"max_tokens\":100,\"stream\":true}",
                       &p);
    assert_int_equal(p.rc, TDM_OK);
    assert_int_equal(p.stops, 1); // the source heard of the stop string once
    char text[256] = "";
    for (int i = 0; i < n - 1; i++) {
        cJSON *c = cJSON_Parse(oai_ev[i]);
        assert_non_null(c);
        assert_null(cJSON_GetObjectItem(c, "usage")); // no include_usage, no usage chunk
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(c, "choices"), 0);
        assert_non_null(ch);
        if (i == 0) { // the echoed prompt alone, with the prompt's ids
            assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, "Say:");
            assert_true(cJSON_GetArraySize(cJSON_GetObjectItem(ch, "prompt_token_ids")) > 0);
            assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(ch, "token_ids")), 0);
        } else {
            assert_null(cJSON_GetObjectItem(ch, "prompt_token_ids"));
        }
        strcat(text, cJSON_GetObjectItem(ch, "text")->valuestring);
        const cJSON *fr = cJSON_GetObjectItem(ch, "finish_reason");
        if (i == n - 2) {
            assert_string_equal(fr->valuestring, "stop");
            assert_string_equal(cJSON_GetObjectItem(ch, "stop_reason")->valuestring, " fox");
        } else {
            assert_true(cJSON_IsNull(fr));
        }
        cJSON_Delete(c);
    }
    assert_string_equal(text, "Say:The quick brown");
}

// --stream-interval 4: the first token in an event of its own (time to first
// token), then 4 per event, the rest with the finish; the text and the token
// ids are all there, in order. Without it every pump's token is an event.
static void test_oai_stream_interval(void **state)
{
    struct fixture *f = *state;
    int32_t *want = NULL;
    size_t n_want = 0;
    assert_int_equal(tdm_tok_encode(oai_tok, oai_text, strlen(oai_text), false, &want, &n_want),
                     TDM_OK);
    assert_true(n_want > 9); // room for 1 + 4 + 4 + a rest
    for (int interval = 1; interval <= 4; interval += 3) {
        char path[64];
        snprintf(path, sizeof path, "/oai/completions?interval=%d", interval);
        struct oai_probe p;
        int n = oai_events(f, path,
                           "{\"prompt\":\"x\",\"return_token_ids\":true,\"max_tokens\":100,"
                           "\"stream\":true}",
                           &p);
        assert_int_equal(p.rc, TDM_OK);
        char text[256] = "";
        size_t got = 0;
        for (int i = 0; i < n - 1; i++) {
            cJSON *c = cJSON_Parse(oai_ev[i]);
            assert_non_null(c);
            const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(c, "choices"), 0);
            strcat(text, cJSON_GetObjectItem(ch, "text")->valuestring);
            const cJSON *ids = cJSON_GetObjectItem(ch, "token_ids");
            int m = cJSON_GetArraySize(ids);
            for (int t = 0; t < m; t++)
                assert_int_equal(cJSON_GetArrayItem(ids, t)->valueint, want[got + (size_t)t]);
            bool last = cJSON_IsString(cJSON_GetObjectItem(ch, "finish_reason"));
            if (i == 0)
                assert_int_equal(m, 1); // the first token at once
            else if (!last)
                assert_int_equal(m, interval);
            else
                assert_true(m <= interval);
            got += (size_t)m;
            cJSON_Delete(c);
        }
        assert_int_equal(got, n_want);
        assert_string_equal(text, oai_text);
        if (interval == 1)
            assert_int_equal(n - 1, (int)n_want + 1); // one event per token, then the finish
        else
            assert_true(n - 1 <= 2 + ((int)n_want - 1 + interval - 1) / interval);
    }
    free(want);
}

static void test_oai_stream_error_and_probe(void **state)
{
    struct fixture *f = *state;
    struct oai_probe p;
    // A choice fails after the stream started: an error event, [DONE], no usage.
    int n = oai_events(f, "/oai/completions?fail",
                       "{\"prompt\":\"Hi\",\"n\":2,\"max_tokens\":100,\"stream\":true,"
                       "\"stream_options\":{\"include_usage\":true}}",
                       &p);
    assert_int_equal(p.rc, TDM_OK);
    assert_true(n >= 3);
    cJSON *c = cJSON_Parse(oai_ev[n - 2]);
    const cJSON *err = cJSON_GetObjectItem(c, "error");
    assert_non_null(err);
    assert_string_equal(cJSON_GetObjectItem(err, "message")->valuestring,
                        "decode worker d1 stopped answering");
    // The event carries the body the failure gets before a stream starts: a
    // lost worker (ETRANSPORT) is 502 everywhere (was 500 in the event only).
    assert_int_equal(cJSON_GetObjectItem(err, "code")->valueint, 502);
    cJSON_Delete(c);
    for (int i = 0; i < n - 2; i++)
        assert_null(strstr(oai_ev[i], "\"usage\""));

    // Nothing for a while: comments probe the client, then the stream goes on.
    n = oai_events(f, "/oai/completions?idle",
                   "{\"prompt\":\"Hi\",\"max_tokens\":100,\"stream\":true}", &p);
    assert_int_equal(p.rc, TDM_OK);
    assert_string_equal(oai_ev[0], ": waiting");
    assert_true(n > 2);
}

static void test_oai_stream_client_gone(void **state)
{
    struct fixture *f = *state;
    oai_reset(f);
    int fd = connect_to(f->port);
    const char *json = "{\"prompt\":\"Hi\",\"max_tokens\":100,\"stream\":true}";
    char req[512];
    snprintf(req, sizeof req,
             "POST /oai/completions?forever HTTP/1.1\r\nHost: x\r\nContent-Type: "
             "application/json\r\nContent-Length: %zu\r\n\r\n%s",
             strlen(json), json);
    send_all(fd, req, strlen(req));
    char buf[4096];
    size_t total = 0;
    while (total < 2048) { // the stream flows
        ssize_t got = recv(fd, buf, sizeof buf, 0);
        assert_true(got > 0);
        total += (size_t)got;
    }
    close(fd);
    double t0 = tdm_now();
    struct oai_probe p = oai_wait(f);
    assert_int_equal(p.rc, TDM_ECLOSED); // the caller would cancel its generators now
    assert_true(tdm_now() - t0 < 5.0);
}

static void test_oai_start_answers(void **state)
{
    struct fixture *f = *state;
    // Rejected: the parser's OpenAI error; nothing generated.
    oai_reset(f);
    char *r = post(f->port, "/oai/completions", "{\"prompt\":\"x\",\"temperature\":5}");
    assert_oai_error(r, 400, "BadRequestError");
    free(r);
    struct oai_probe p = oai_wait(f);
    assert_int_equal(p.pumps, 0);
    oai_reset(f);
    r = post(f->port, "/oai/chat", "{\"messages\":[]}");
    assert_int_equal(status_of(r), 400);
    free(r);
    oai_wait(f);

    // Echo with max_tokens 0: the prompts back, one body.
    oai_reset(f);
    r = post(f->port, "/oai/completions",
             "{\"prompt\":\"Hello\",\"echo\":true,\"max_tokens\":0,\"n\":2,\"request_id\":\"e1\"}");
    assert_int_equal(status_of(r), 200);
    cJSON *j = cJSON_Parse(body_of(r));
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-e1");
    const cJSON *cs = cJSON_GetObjectItem(j, "choices");
    assert_int_equal(cJSON_GetArraySize(cs), 2);
    for (int i = 0; i < 2; i++) {
        const cJSON *ch = cJSON_GetArrayItem(cs, i);
        assert_int_equal(cJSON_GetObjectItem(ch, "index")->valueint, i);
        assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, "Hello");
        assert_string_equal(cJSON_GetObjectItem(ch, "finish_reason")->valuestring, "length");
    }
    assert_int_equal(int_of(j, "usage", "completion_tokens"), 0);
    cJSON_Delete(j);
    free(r);
    assert_int_equal(oai_wait(f).pumps, 0);

    // ... or as a stream: a chunk per choice, usage, [DONE].
    int n = oai_events(f, "/oai/completions",
                       "{\"prompt\":\"Hello\",\"echo\":true,\"max_tokens\":0,\"n\":2,"
                       "\"stream\":true,\"stream_options\":{\"include_usage\":true}}",
                       &p);
    assert_int_equal(p.pumps, 0);
    assert_int_equal(n, 4);
    for (int i = 0; i < 2; i++) {
        j = cJSON_Parse(oai_ev[i]);
        const cJSON *ch = cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0);
        assert_int_equal(cJSON_GetObjectItem(ch, "index")->valueint, i);
        assert_string_equal(cJSON_GetObjectItem(ch, "text")->valuestring, "Hello");
        cJSON_Delete(j);
    }
    j = cJSON_Parse(oai_ev[2]);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetObjectItem(j, "choices")), 0);
    assert_true(int_of(j, "usage", "prompt_tokens") > 0);
    cJSON_Delete(j);

    // The X-Request-Id header names a response whose body has no request_id.
    oai_reset(f);
    const char *json = "{\"prompt\":\"Hello\",\"max_tokens\":5}";
    char req[512];
    snprintf(req, sizeof req,
             "POST /oai/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: hdr-7\r\nContent-Length: "
             "%zu\r\nConnection: close\r\n\r\n%s",
             strlen(json), json);
    r = roundtrip(f->port, req);
    assert_int_equal(status_of(r), 200);
    j = cJSON_Parse(body_of(r));
    assert_string_equal(cJSON_GetObjectItem(j, "id")->valuestring, "cmpl-hdr-7");
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetArrayItem(cJSON_GetObjectItem(j, "choices"), 0), "text")
            ->valuestring,
        oai_text);
    cJSON_Delete(j);
    free(r);
    oai_wait(f);
}

static void test_oai_tokenize_routes(void **state)
{
    struct fixture *f = *state;
    char *r = post(f->port, "/oai/tokenize", "{\"prompt\":\"Hello world\"}");
    assert_int_equal(status_of(r), 200);
    cJSON *j = cJSON_Parse(body_of(r));
    const cJSON *toks = cJSON_GetObjectItem(j, "tokens");
    assert_int_equal(cJSON_GetObjectItem(j, "count")->valueint, cJSON_GetArraySize(toks));
    assert_int_equal(cJSON_GetObjectItem(j, "max_model_len")->valueint, 512);
    char body[256] = "{\"tokens\":[";
    for (int i = 0; i < cJSON_GetArraySize(toks); i++)
        snprintf(body + strlen(body), sizeof body - strlen(body), "%s%d", i ? "," : "",
                 cJSON_GetArrayItem(toks, i)->valueint);
    strcat(body, "]}");
    cJSON_Delete(j);
    free(r);
    r = post(f->port, "/oai/detokenize", body);
    assert_int_equal(status_of(r), 200);
    assert_string_equal(body_of(r), "{\"prompt\":\"Hello world\"}");
    free(r);
    r = post(f->port, "/oai/detokenize", "{\"tokens\":[-5]}");
    assert_oai_error(r, 400, "BadRequestError");
    free(r);
    r = post(f->port, "/oai/tokenize", "{\"prompt\":3}");
    assert_oai_error(r, 400, "BadRequestError");
    free(r);
}

static void test_status_mapping(void **state)
{
    (void)state;
    assert_int_equal(tdm_oai_status_for_err(TDM_OK), 200);
    assert_int_equal(tdm_oai_status_for_err(TDM_EINVAL), 400);
    assert_int_equal(tdm_oai_status_for_err(TDM_ENOTFOUND), 404);
    // A full waiting queue is 503 with Retry-After, as vLLM answers it (was
    // 429, which the router gave for the same failure while decode gave 503).
    assert_int_equal(tdm_oai_status_for_err(TDM_EBUSY), 503);
    assert_int_equal(tdm_oai_status_for_err(TDM_ECAPACITY), 503);
    assert_int_equal(tdm_oai_status_for_err(TDM_ECLOSED), 503);
    assert_int_equal(tdm_oai_status_for_err(TDM_ETIMEDOUT), 504);
    assert_int_equal(tdm_oai_status_for_err(TDM_EPROTO), 502);
    assert_int_equal(tdm_oai_status_for_err(TDM_ETRANSPORT), 502);
    assert_int_equal(tdm_oai_status_for_err(TDM_ENOMEM), 500);
    assert_int_equal(tdm_oai_status_for_err(TDM_EBACKEND), 500);
    assert_int_equal(tdm_oai_status_for_err(TDM_EIO), 500);
    assert_int_equal(tdm_oai_status_for_err(999), 500);
    assert_string_equal(tdm_http_reason(413), "Payload Too Large");

    // The failure's answer: status, type and message from one function.
    struct tdm_oai_error e;
    assert_int_equal(
        tdm_oai_error_from_err(&e, TDM_EBUSY, "the waiting queue is full (--max-waiting 1)"),
        TDM_EPROTO);
    assert_int_equal(e.status, 503);
    assert_string_equal(e.type, "ServiceUnavailableError");
    assert_string_equal(e.message, "The server is overloaded: the waiting queue is full "
                                   "(--max-waiting 1). Retry later.");
    assert_int_equal(tdm_oai_error_from_err(&e, TDM_EINVAL, "bad"), TDM_EINVAL);
    assert_int_equal(e.status, 400);
    assert_string_equal(e.message, "bad");
    tdm_oai_error_from_err(&e, TDM_ETRANSPORT, "decode worker d1 stopped answering");
    assert_int_equal(e.status, 502);
    assert_string_equal(e.type, "InternalServerError");
    tdm_oai_error_from_err(&e, TDM_ETIMEDOUT, NULL);
    assert_int_equal(e.status, 504);
    assert_string_equal(e.message, tdm_strerror(TDM_ETIMEDOUT));
    tdm_oai_error_from_err(&e, TDM_OK, "no code"); // a failure without a code
    assert_int_equal(e.status, 500);
}

// tdm_oai_http_fail answers a failure as every server does: the same status,
// Retry-After and body whichever path (direct, routed, streamed or not) met it.
static void test_fail_answer(void **state)
{
    struct fixture *f = *state;
    char *r =
        roundtrip(f->port, "GET /queue-full HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 503, "ServiceUnavailableError");
    char hv[32];
    assert_string_equal(header_of(r, "Retry-After", hv, sizeof hv), "1");
    cJSON *j = cJSON_Parse(body_of(r));
    assert_string_equal(
        cJSON_GetObjectItem(cJSON_GetObjectItem(j, "error"), "message")->valuestring,
        "The server is overloaded: the waiting queue is full (--max-waiting 1). "
        "Retry later.");
    cJSON_Delete(j);
    free(r);
}
// tdm_oai_front_serve: the API every server answers, its own routes beside it,
// the front's settings (the key, the body limit, the OpenAI error body), and a
// missing handler refused before anything listens.
static void front_answer(struct tdm_http_conn *c, void *arg)
{
    char body[128];
    snprintf(body, sizeof body, "{\"handler\":\"%s\",\"arg\":%d}", tdm_http_path(c), *(int *)arg);
    tdm_http_respond(c, 200, "application/json", body, strlen(body));
}

static void test_front_serve(void **state)
{
    (void)state;
    struct tdm_oai_route own[] = {{"GET", "/v1/own", front_answer}};
    struct tdm_oai_front_routes routes = {
        .health = front_answer,
        .metrics = front_answer,
        .version = front_answer,
        .models = front_answer,
        .completions = front_answer,
        .chat = front_answer,
        .tokenize = front_answer,
        .detokenize = front_answer,
        .extra = own,
        .n_extra = 1,
    };
    struct {
        char host[16], api_key[16];
        int port, http_max_conns_per_ip, max_large_requests, http_memory_budget_mib;
        size_t max_body_bytes;
        double http_header_timeout, http_body_timeout;
    } o = {"127.0.0.1", "k", 0, 0, 4, 64, 2048, 10, 30};
    struct tdm_oai_front_http fh = TDM_OAI_FRONT_HTTP(&o, 4);
    int arg = 7;
    struct tdm_http_server *s = (struct tdm_http_server *)&arg;
    char err[256];
    assert_int_equal(tdm_oai_front_serve(&s, &fh, &routes, &arg, err, sizeof err), TDM_OK);
    int port = tdm_http_server_port(s);
    assert_true(port > 0);
    static const char *const gets[] = {"/health", "/ping", "/metrics", "/version"};
    for (size_t i = 0; i < sizeof gets / sizeof gets[0]; i++) {
        char req[128];
        snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                 gets[i]);
        char *r = roundtrip(port, req);
        assert_int_equal(status_of(r), 200); // served without the key
        assert_non_null(strstr(body_of(r), "\"arg\":7"));
        free(r);
    }
    char *r = roundtrip(port, "GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 401, "AuthenticationError");
    free(r);
    static const char *const keyed[][2] = {
        {"GET", "/v1/models"}, {"POST", "/v1/completions"}, {"POST", "/v1/chat/completions"},
        {"POST", "/tokenize"}, {"POST", "/detokenize"},     {"GET", "/v1/own"},
    };
    for (size_t i = 0; i < sizeof keyed / sizeof keyed[0]; i++) {
        char req[256];
        snprintf(req, sizeof req,
                 "%s %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                 "Content-Length: 2\r\nConnection: close\r\n\r\n{}",
                 keyed[i][0], keyed[i][1]);
        r = roundtrip(port, req);
        assert_int_equal(status_of(r), 200);
        char want[64];
        snprintf(want, sizeof want, "\"handler\":\"%s\"", keyed[i][1]);
        assert_non_null(strstr(body_of(r), want));
        free(r);
    }
    // The body limit from the settings, answered in the OpenAI format.
    r = roundtrip(port, "POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n"
                        "Content-Length: 4096\r\nConnection: close\r\n\r\n");
    assert_oai_error(r, 413, "RequestTooLargeError");
    free(r);
    tdm_http_server_free(s);
    // A route without a handler: refused, nothing to free.
    routes.chat = NULL;
    s = (struct tdm_http_server *)&arg;
    assert_int_equal(tdm_oai_front_serve(&s, &fh, &routes, &arg, err, sizeof err), TDM_EINVAL);
    assert_null(s);
    assert_string_equal(err, "no handler for POST /v1/chat/completions");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_answers),
        cmocka_unit_test(test_openai_over_http),
        cmocka_unit_test(test_oai_stream_chat),
        cmocka_unit_test(test_oai_stream_echo_and_stop),
        cmocka_unit_test(test_oai_stream_interval),
        cmocka_unit_test(test_oai_stream_error_and_probe),
        cmocka_unit_test(test_oai_stream_client_gone),
        cmocka_unit_test(test_oai_start_answers),
        cmocka_unit_test(test_oai_tokenize_routes),
        cmocka_unit_test(test_status_mapping),
        cmocka_unit_test(test_fail_answer),
        cmocka_unit_test(test_front_serve),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
