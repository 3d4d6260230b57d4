// SPDX-License-Identifier: Apache-2.0
// bench_serve run loop: one thread drives every request through a libcurl multi
// handle. Requests become due at their arrival offsets (Poisson/gamma or all at
// once) and are sent when due and when fewer than --max-concurrency are in
// flight, as vLLM's bench does with its semaphore (the send time, not the
// arrival time, starts a request's clock). Every request has a total timeout, so
// the loop always ends. Bodies are built before the clock starts, so client-side
// JSON work does not show up in the measured latencies.
// A request counts as successful only if it got a 2xx status, a stream with at
// least one content chunk, no error event, and `data: [DONE]`: a connection the
// server drops mid-stream therefore fails even when the HTTP framing hid it.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <curl/curl.h>

#include "bench_serve_impl.h"
#include "core.h"
#include "tokenizer.h"

#define POLL_MAX_MS 50   // the longest sleep between looks at the arrival schedule
#define ERRBODY_MAX 1024 // bytes kept of a non-2xx response body

struct tdm_bench_run {
    struct tdm_bench_request *reqs; // [n]
    size_t n;
    double duration_s;
    int max_concurrency;
};

// Per in-flight request state.
struct bench_req {
    CURL *easy;
    size_t index;
    bool started, finished;
    long http_status; // 0 until the first body byte
    struct bench_stream stream;
    char errbody[ERRBODY_MAX + 1];
    size_t errbody_len;
    char curl_err[CURL_ERROR_SIZE];
};

size_t tdm_bench_run_count(const struct tdm_bench_run *run)
{
    return run->n;
}

const struct tdm_bench_request *tdm_bench_run_request(const struct tdm_bench_run *run, size_t i)
{
    return i < run->n ? &run->reqs[i] : NULL;
}

double tdm_bench_run_duration(const struct tdm_bench_run *run)
{
    return run->duration_s;
}

int tdm_bench_run_max_concurrency(const struct tdm_bench_run *run)
{
    return run->max_concurrency;
}

void tdm_bench_run_free(struct tdm_bench_run *run)
{
    if (!run)
        return;
    for (size_t i = 0; i < run->n; i++) {
        free(run->reqs[i].itl_s);
        free(run->reqs[i].generated_text);
    }
    free(run->reqs);
    free(run);
}

// ---- request bodies -------------------------------------------------------------------------
// The body vLLM's openai / openai-chat bench backends send, minus fields the
// OpenAI API does not define (repetition_penalty), plus ignore_eos when asked.
static char *build_body(const struct tdm_bench_config *cfg, const struct tdm_bench_prompt *p)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    cJSON_AddStringToObject(o, "model", cfg->model);
    if (cfg->chat) {
        cJSON *msgs = cJSON_AddArrayToObject(o, "messages");
        cJSON *m = cJSON_CreateObject();
        cJSON_AddStringToObject(m, "role", "user");
        cJSON_AddStringToObject(m, "content", p->text);
        cJSON_AddItemToArray(msgs, m);
        cJSON_AddNumberToObject(o, "max_completion_tokens", p->output_len);
    } else {
        cJSON_AddStringToObject(o, "prompt", p->text);
        cJSON_AddNumberToObject(o, "max_tokens", p->output_len);
    }
    cJSON_AddNumberToObject(o, "temperature", cfg->temperature);
    if (cfg->ignore_eos)
        cJSON_AddBoolToObject(o, "ignore_eos", true);
    cJSON_AddBoolToObject(o, "stream", true);
    cJSON *so = cJSON_AddObjectToObject(o, "stream_options");
    cJSON_AddBoolToObject(so, "include_usage", true);
    char *body = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return body;
}

// ---- libcurl callbacks ------------------------------------------------------------------------
static size_t on_body(char *data, size_t size, size_t nmemb, void *userdata)
{
    struct bench_req *q = userdata;
    size_t len = size * nmemb;
    double now = tdm_now();
    if (q->http_status == 0)
        curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &q->http_status);
    if (q->http_status < 200 || q->http_status > 299) {
        size_t room = ERRBODY_MAX - q->errbody_len;
        size_t take = len < room ? len : room;
        memcpy(q->errbody + q->errbody_len, data, take);
        q->errbody_len += take;
        q->errbody[q->errbody_len] = '\0';
        return len;
    }
    if (bench_stream_feed(&q->stream, data, len, now))
        return 0; // out of memory: make libcurl abort this transfer
    return len;
}

// ---- finishing a request ------------------------------------------------------------------------
static void set_fail(struct tdm_bench_request *r, const char *reason, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_fail(struct tdm_bench_request *r, const char *reason, const char *fmt, ...)
{
    r->success = false;
    snprintf(r->reason, sizeof(r->reason), "%s", reason);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->error, sizeof(r->error), fmt, ap);
    va_end(ap);
}

// The message of an OpenAI error body ({"error":{"message"}} or the flat form),
// else the body itself.
static void http_error_detail(struct tdm_bench_request *r, long status, const char *body)
{
    cJSON *root = tdm_json_check_depth(body, strlen(body), TDM_JSON_MAX_DEPTH, NULL, 0)
                      ? NULL
                      : cJSON_Parse(body);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(root, "error");
    const cJSON *msg = cJSON_IsObject(e) ? cJSON_GetObjectItemCaseSensitive(e, "message") : e;
    if (!cJSON_IsString(msg))
        msg = cJSON_GetObjectItemCaseSensitive(root, "message");
    char reason[32];
    snprintf(reason, sizeof(reason), "HTTP %ld", status);
    if (cJSON_IsString(msg))
        set_fail(r, reason, "HTTP %ld: %s", status, msg->valuestring);
    else
        set_fail(r, reason, "HTTP %ld: %.200s", status, body);
    cJSON_Delete(root);
}

static void finish_request(struct tdm_bench_run *run, struct bench_req *q, CURLcode code,
                           double now, double t0, const struct tdm_bench_prompt *p,
                           const struct tdm_tokenizer *tok)
{
    struct tdm_bench_request *r = &run->reqs[q->index];
    struct bench_stream *s = &q->stream;
    if (q->http_status == 0) // no body arrived (an error status with an empty body)
        curl_easy_getinfo(q->easy, CURLINFO_RESPONSE_CODE, &q->http_status);
    bool http_ok = q->http_status >= 200 && q->http_status <= 299;
    if (http_ok)
        bench_stream_finish(s, now);
    r->start_s = s->t_start - t0;
    r->ttft_s = s->n_content ? s->ttft : 0.0;
    r->latency_s = (s->done ? s->t_done : now) - s->t_start;
    r->input_len = p->input_len >= 0 ? p->input_len : (s->usage_prompt >= 0 ? s->usage_prompt : 0);
    r->success = true;

    if (q->http_status && !http_ok)
        http_error_detail(r, q->http_status, q->errbody);
    else if (s->failed)
        set_fail(r, s->reason, "%s", s->error);
    else if (s->oom)
        set_fail(r, "out of memory", "out of memory while reading the stream");
    else if (code == CURLE_OPERATION_TIMEDOUT)
        set_fail(r, "timeout", "%s", q->curl_err[0] ? q->curl_err : curl_easy_strerror(code));
    else if (code != CURLE_OK)
        set_fail(r, "connection", "%s", q->curl_err[0] ? q->curl_err : curl_easy_strerror(code));
    else if (!s->done)
        set_fail(r, "incomplete stream", "the stream ended without data: [DONE]");
    else if (s->n_content == 0)
        set_fail(r, "no content", "the stream carried no text");

    // The text and the gaps move to the result (no copy).
    r->generated_text = s->text;
    s->text = NULL;
    r->itl_s = s->itl;
    r->n_itl = s->n_itl;
    s->itl = NULL;

    if (r->success) {
        r->error[0] = r->reason[0] = '\0';
        if (s->usage_completion >= 0) {
            r->output_tokens = s->usage_completion;
        } else if (tok) {
            int32_t *ids = NULL;
            size_t n = 0;
            if (tdm_tok_encode(tok, r->generated_text, strlen(r->generated_text), false, &ids,
                               &n) == TDM_OK)
                r->output_tokens = (int)n;
            else
                r->output_tokens = (int)s->n_content;
            free(ids);
        } else {
            // No usage and no tokenizer: one token per content chunk (what
            // vLLM's servers send when not batching chunks).
            r->output_tokens = (int)s->n_content;
        }
    } else {
        r->output_tokens = 0;
    }
    bench_stream_fini(s);
    q->finished = true;
}

// ---- the loop -------------------------------------------------------------------------------
static int start_request(CURLM *multi, struct bench_req *q, const char *url, const char *body,
                         struct curl_slist *headers, const struct tdm_bench_config *cfg,
                         size_t expect_tokens)
{
    q->easy = curl_easy_init();
    if (!q->easy)
        return TDM_ENOMEM;
    if (bench_stream_init(&q->stream, cfg->chat, expect_tokens, 0.0)) {
        curl_easy_cleanup(q->easy);
        q->easy = NULL;
        return TDM_ENOMEM;
    }
    CURL *e = q->easy;
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(body));
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, q);
    curl_easy_setopt(e, CURLOPT_PRIVATE, q);
    curl_easy_setopt(e, CURLOPT_ERRORBUFFER, q->curl_err);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)ceil(cfg->timeout_s * 1000.0));
    curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    // A benchmark measures the server, not a proxy from the environment.
    curl_easy_setopt(e, CURLOPT_PROXY, "");
    q->started = true;
    // The clock starts as the request is handed to libcurl; the connect is part
    // of TTFT, as in vLLM's client.
    q->stream.t_start = tdm_now();
    if (curl_multi_add_handle(multi, e) != CURLM_OK) {
        bench_stream_fini(&q->stream);
        curl_easy_cleanup(e);
        q->easy = NULL;
        return TDM_ETRANSPORT;
    }
    return TDM_OK;
}

// Room for request `i` in run->reqs (a --duration run grows it as it sends).
static int reqs_reserve(struct tdm_bench_run *run, size_t *cap, size_t i)
{
    size_t old = *cap;
    if (tdm_grow(&run->reqs, cap, i + 1, sizeof *run->reqs, 64) != TDM_OK)
        return TDM_ENOMEM;
    memset(run->reqs + old, 0, (*cap - old) * sizeof *run->reqs); // new slots zeroed
    return TDM_OK;
}

int tdm_bench_run(struct tdm_bench_run **out, const struct tdm_bench_config *cfg,
                  const struct tdm_bench_dataset *ds, const struct tdm_tokenizer *tok, char *err,
                  size_t errlen)
{
    *out = NULL;
    if (cfg->num_prompts < 1 || ds->n < (size_t)cfg->num_prompts)
        return tdm_seterr(err, errlen, TDM_EINVAL, "the dataset holds %zu prompts, %d needed",
                          ds->n, cfg->num_prompts);
    if (!cfg->base_url || !cfg->endpoint || !cfg->model)
        return tdm_seterr(err, errlen, TDM_EINVAL, "base_url, endpoint and model are required");
    if (!(cfg->timeout_s > 0.0))
        return tdm_seterr(err, errlen, TDM_EINVAL, "the timeout must be > 0");
    bool timed = cfg->duration_s > 0.0;
    if (timed && cfg->max_concurrency <= 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "a run with a duration needs a concurrency bound (--max-concurrency)");
    size_t nb = (size_t)cfg->num_prompts; // bodies, one per prompt
    // Requests to send: nb, or unbounded (until the duration) when timed.
    // Slots hold the in-flight requests' state (libcurl keeps pointers to them).
    size_t nslots = cfg->max_concurrency > 0 && (timed || (size_t)cfg->max_concurrency < nb)
                        ? (size_t)cfg->max_concurrency
                        : nb;
    size_t reqs_cap = timed ? (nb > nslots * 4 ? nb : nslots * 4) : nb;
    int rc = TDM_OK;

    struct tdm_bench_run *run = calloc(1, sizeof(*run));
    struct bench_req *qs = calloc(nslots, sizeof(*qs));
    size_t *free_slots = calloc(nslots, sizeof(*free_slots));
    char **bodies = calloc(nb, sizeof(*bodies));
    size_t url_len = strlen(cfg->base_url) + strlen(cfg->endpoint) + 1;
    char *url = malloc(url_len);
    if (run)
        run->reqs = calloc(reqs_cap, sizeof(*run->reqs));
    if (!run || !qs || !free_slots || !bodies || !url || !run->reqs) {
        rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
        goto fail_alloc;
    }
    size_t nfree = nslots;
    for (size_t i = 0; i < nslots; i++)
        free_slots[i] = nslots - 1 - i;
    size_t base_len = strlen(cfg->base_url);
    while (base_len && cfg->base_url[base_len - 1] == '/')
        base_len--;
    snprintf(url, url_len, "%.*s%s", (int)base_len, cfg->base_url, cfg->endpoint);
    for (size_t i = 0; i < nb; i++) {
        bodies[i] = build_body(cfg, &ds->prompts[i]);
        if (!bodies[i]) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto fail_alloc;
        }
    }
    struct bench_arrivals arr;
    bench_arrivals_init(&arr, cfg->request_rate, cfg->burstiness, cfg->seed);

    if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK) {
        rc = tdm_seterr(err, errlen, TDM_ETRANSPORT, "curl_global_init failed");
        goto fail_alloc;
    }
    struct curl_slist *headers = NULL;
    char auth[512];
    snprintf(auth, sizeof(auth), "Authorization: Bearer %s", cfg->api_key ? cfg->api_key : "");
    // "Expect:" drops the 100-continue round trip libcurl adds before long bodies.
    const char *lines[] = {"Content-Type: application/json", "Accept: text/event-stream",
                           "Expect:", cfg->api_key ? auth : NULL};
    for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]) && lines[i]; i++) {
        struct curl_slist *h = curl_slist_append(headers, lines[i]);
        if (!h) {
            rc = tdm_seterr(err, errlen, TDM_ENOMEM, "out of memory");
            goto fail_curl;
        }
        headers = h;
    }
    CURLM *multi = curl_multi_init();
    if (!multi) {
        rc = tdm_seterr(err, errlen, TDM_ETRANSPORT, "libcurl initialisation failed");
        goto fail_curl;
    }

    size_t next = 0, done = 0; // requests sent, requests finished
    int inflight = 0;
    bool sending = true; // false once every request is sent (or the duration is over)
    double t0 = tdm_now(), t_end = t0;
    double next_arrival = bench_arrivals_next(&arr);
    for (;;) {
        double now = tdm_now();
        if (timed ? now - t0 >= cfg->duration_s : next == nb)
            sending = false;
        while (sending && t0 + next_arrival <= now && nfree > 0) {
            if (timed && reqs_reserve(run, &reqs_cap, next) != TDM_OK) {
                sending = false; // out of memory for results: end the run early
                break;
            }
            size_t slot = free_slots[--nfree];
            struct bench_req *q = &qs[slot];
            memset(q, 0, sizeof(*q));
            q->index = next;
            int src = start_request(multi, q, url, bodies[next % nb], headers, cfg,
                                    (size_t)ds->prompts[next % nb].output_len);
            next++;
            next_arrival = bench_arrivals_next(&arr);
            if (!timed && next == nb)
                sending = false;
            if (src) {
                struct tdm_bench_request *r = &run->reqs[q->index];
                r->start_s = tdm_now() - t0;
                r->generated_text = strdup("");
                set_fail(r, "client", "could not start the request: %s", tdm_strerror(src));
                q->finished = true;
                free_slots[nfree++] = slot;
                done++;
                continue;
            }
            inflight++;
            if (inflight > run->max_concurrency)
                run->max_concurrency = inflight;
        }
        int running = 0;
        curl_multi_perform(multi, &running);
        CURLMsg *msg;
        int left;
        while ((msg = curl_multi_info_read(multi, &left))) {
            if (msg->msg != CURLMSG_DONE)
                continue;
            CURL *e = msg->easy_handle;
            CURLcode code = msg->data.result;
            struct bench_req *q = NULL;
            curl_easy_getinfo(e, CURLINFO_PRIVATE, (char **)&q);
            double tdone = tdm_now();
            finish_request(run, q, code, tdone, t0, &ds->prompts[q->index % nb], tok);
            curl_multi_remove_handle(multi, e);
            curl_easy_cleanup(e);
            q->easy = NULL;
            free_slots[nfree++] = (size_t)(q - qs);
            inflight--;
            done++;
            t_end = tdone;
        }
        if (!sending && done == next)
            break;
        long wait_ms = POLL_MAX_MS;
        if (sending && nfree > 0) {
            double dt = t0 + next_arrival - tdm_now();
            if (timed && t0 + cfg->duration_s - tdm_now() < dt)
                dt = t0 + cfg->duration_s - tdm_now();
            wait_ms = dt <= 0 ? 0 : (long)ceil(dt * 1000.0);
            if (wait_ms > POLL_MAX_MS)
                wait_ms = POLL_MAX_MS;
        }
        if (wait_ms > 0 || running > 0)
            curl_multi_poll(multi, NULL, 0, (int)wait_ms, NULL);
    }
    run->n = next;
    run->duration_s = t_end - t0;
    curl_multi_cleanup(multi);
    curl_slist_free_all(headers);
    curl_global_cleanup();
    for (size_t i = 0; i < nb; i++)
        free(bodies[i]);
    free(bodies);
    free(free_slots);
    free(url);
    free(qs);
    *out = run;
    return TDM_OK;

fail_curl:
    curl_slist_free_all(headers);
    curl_global_cleanup();
fail_alloc:
    if (bodies)
        for (size_t i = 0; i < nb; i++)
            free(bodies[i]);
    free(bodies);
    free(free_slots);
    free(url);
    free(qs);
    tdm_bench_run_free(run);
    return rc;
}
