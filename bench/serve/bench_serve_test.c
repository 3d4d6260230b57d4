// SPDX-License-Identifier: Apache-2.0
// bench_serve tests. A fake OpenAI streaming server on plain sockets (one thread
// per connection, chunked SSE, a known TTFT and inter-chunk delay) stands in for
// Tandem, so the measured TTFT/ITL/TPOT/throughput can be checked against the
// injected delays. What the fake does is picked by the prompt text:
//   ok...     TTFT_MS, then max_tokens chunks ITL_MS apart, usage chunk, [DONE]
//   nousage   the same without the usage chunk (output counted from chunks)
//   fail500   HTTP 500 with an OpenAI error body
//   fail503   HTTP 503 with an empty body
//   drop      three chunks, then the connection closes mid-stream
//   errevent  two chunks, then data: {"error":...} and [DONE]
//   hang      headers, then silence (the client's timeout must end it)
// Chat requests get vLLM's opening role chunk (empty content) at once, which
// must not count as the first token. Bounds on times are loose on purpose: the
// build machine is shared and the ASan build is slow; they still fail when a
// delay is not measured (TTFT < 45 ms) or is measured wrongly (ITL far from 10).
// Pure parts (percentiles, SSE parsing, arrivals, datasets, flags) are tested
// directly.
#include "bench_serve.h"
#include "bench_serve_impl.h"
#include "core.h"
#include "mkmodel.h"
#include "tokenizer.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "test_skip.h"

#define QWEN_DIR TANDEM_SHARED_DIR "/models/qwen2-tokenizer"
#define TTFT_MS 50
#define ITL_MS 10
#define MAX_CONNS 256

// ---- fake server ----------------------------------------------------------------------------
struct fake_server {
    int listen_fd;
    int port;
    pthread_t acceptor;
    atomic_bool stop;
    pthread_mutex_t mu;
    pthread_t conns[MAX_CONNS];
    int n_conns;
    atomic_int active, max_active;
    atomic_int requests, saw_stream_usage, saw_ignore_eos, saw_api_key;
    atomic_int last_max_tokens;
};

struct fake_conn {
    struct fake_server *srv;
    int fd;
};

static void msleep(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int send_all(int fd, const char *buf, size_t len)
{
    while (len) {
        ssize_t k = send(fd, buf, len, MSG_NOSIGNAL);
        if (k <= 0)
            return -1;
        buf += k;
        len -= (size_t)k;
    }
    return 0;
}

// One HTTP/1.1 chunk holding one SSE event.
static int send_event(int fd, const char *json)
{
    char buf[2048];
    int body = snprintf(buf + 16, sizeof(buf) - 32, "data: %s\n\n", json);
    char head[16];
    int hl = snprintf(head, sizeof(head), "%x\r\n", body);
    memcpy(buf + 16 - hl, head, (size_t)hl);
    memcpy(buf + 16 + body, "\r\n", 2);
    return send_all(fd, buf + 16 - hl, (size_t)(hl + body + 2));
}

static int send_token(int fd, bool chat, int i, bool last)
{
    char json[512];
    if (chat)
        snprintf(json, sizeof(json),
                 "{\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,"
                 "\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" w%d\"},"
                 "\"logprobs\":null,\"finish_reason\":%s}]}",
                 i, last ? "\"length\"" : "null");
    else
        snprintf(json, sizeof(json),
                 "{\"id\":\"cmpl-t\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\","
                 "\"choices\":[{\"index\":0,\"text\":\" w%d\",\"logprobs\":null,"
                 "\"finish_reason\":%s,\"stop_reason\":null}]}",
                 i, last ? "\"length\"" : "null");
    return send_event(fd, json);
}

static const char stream_head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                  "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";

// *released is set when the request stops counting as active: just before the
// stream's last event, since the client may open its next connection as soon as
// it has read that, before this thread gets to close() (a race under load).
static void serve_request(struct fake_server *srv, int fd, const char *body, bool *released)
{
    cJSON *req = cJSON_Parse(body);
    const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(req, "prompt");
    const cJSON *msgs = cJSON_GetObjectItemCaseSensitive(req, "messages");
    bool chat = cJSON_IsArray(msgs);
    if (chat)
        prompt = cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(msgs, 0), "content");
    const cJSON *mt =
        cJSON_GetObjectItemCaseSensitive(req, chat ? "max_completion_tokens" : "max_tokens");
    const cJSON *so = cJSON_GetObjectItemCaseSensitive(req, "stream_options");
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(so, "include_usage")) &&
        cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(req, "stream")))
        atomic_fetch_add(&srv->saw_stream_usage, 1);
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(req, "ignore_eos")))
        atomic_fetch_add(&srv->saw_ignore_eos, 1);
    const char *p = cJSON_IsString(prompt) ? prompt->valuestring : "";
    int n = cJSON_IsNumber(mt) ? (int)mt->valuedouble : 16;
    atomic_store(&srv->last_max_tokens, n);

    if (!strncmp(p, "fail503", 7)) {
        const char *resp = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n"
                           "Connection: close\r\n\r\n";
        send_all(fd, resp, strlen(resp));
        goto out;
    }
    if (!strncmp(p, "fail500", 7)) {
        const char *err = "{\"error\":{\"message\":\"boom\",\"type\":\"InternalServerError\","
                          "\"param\":null,\"code\":500}}";
        char head[256];
        snprintf(head, sizeof(head),
                 "HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                 "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                 strlen(err));
        send_all(fd, head, strlen(head));
        send_all(fd, err, strlen(err));
        goto out;
    }
    if (send_all(fd, stream_head, strlen(stream_head)))
        goto out;
    if (!strncmp(p, "hang", 4)) {
        for (int i = 0; i < 150 && !atomic_load(&srv->stop); i++)
            msleep(20);
        goto out;
    }
    if (chat)
        send_event(fd, "{\"id\":\"chatcmpl-t\",\"object\":\"chat.completion.chunk\",\"created\":1,"
                       "\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":"
                       "\"assistant\",\"content\":\"\"},\"logprobs\":null,"
                       "\"finish_reason\":null}]}");
    msleep(TTFT_MS);
    int limit = n;
    if (!strncmp(p, "drop", 4))
        limit = 3;
    else if (!strncmp(p, "errevent", 8))
        limit = 2;
    for (int i = 0; i < limit; i++) {
        if (i)
            msleep(ITL_MS);
        if (send_token(fd, chat, i, i == n - 1))
            goto out;
    }
    if (!strncmp(p, "drop", 4))
        goto out; // no terminal chunk: the connection just closes
    if (!strncmp(p, "errevent", 8)) {
        send_event(fd, "{\"error\":{\"message\":\"engine died\",\"type\":\"InternalServerError\","
                       "\"param\":null,\"code\":500}}");
    } else if (strncmp(p, "nousage", 7)) {
        char usage[256];
        snprintf(usage, sizeof(usage),
                 "{\"id\":\"cmpl-t\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\","
                 "\"choices\":[],\"usage\":{\"prompt_tokens\":%zu,\"total_tokens\":%zu,"
                 "\"completion_tokens\":%d}}",
                 strlen(p), strlen(p) + (size_t)n, n);
        send_event(fd, usage);
    }
    atomic_fetch_sub(&srv->active, 1);
    *released = true;
    send_event(fd, "[DONE]");
    send_all(fd, "0\r\n\r\n", 5);
out:
    cJSON_Delete(req);
}

static void *conn_main(void *arg)
{
    struct fake_conn *c = arg;
    struct fake_server *srv = c->srv;
    int now_active = atomic_fetch_add(&srv->active, 1) + 1;
    int prev = atomic_load(&srv->max_active);
    while (now_active > prev && !atomic_compare_exchange_weak(&srv->max_active, &prev, now_active))
        ;
    char buf[65536];
    size_t len = 0;
    size_t need = 0;
    bool released = false;
    for (;;) {
        ssize_t k = recv(c->fd, buf + len, sizeof(buf) - 1 - len, 0);
        if (k <= 0)
            goto done;
        len += (size_t)k;
        buf[len] = '\0';
        char *end = strstr(buf, "\r\n\r\n");
        if (!end)
            continue;
        size_t head_len = (size_t)(end - buf) + 4;
        size_t cl = 0;
        for (char *l = buf; l < end; l = strstr(l, "\r\n") + 2)
            if (!strncasecmp(l, "Content-Length:", 15))
                cl = strtoul(l + 15, NULL, 10);
        need = head_len + cl;
        if (len >= need || need >= sizeof(buf)) {
            atomic_fetch_add(&srv->requests, 1);
            if (memmem(buf, head_len, "\r\nAuthorization: Bearer sk-test\r\n", 33))
                atomic_fetch_add(&srv->saw_api_key, 1);
            serve_request(srv, c->fd, buf + head_len, &released);
            break;
        }
    }
done:
    close(c->fd);
    if (!released)
        atomic_fetch_sub(&srv->active, 1);
    free(c);
    return NULL;
}

static void *acceptor_main(void *arg)
{
    struct fake_server *srv = arg;
    while (!atomic_load(&srv->stop)) {
        struct pollfd pfd = {.fd = srv->listen_fd, .events = POLLIN};
        if (poll(&pfd, 1, 20) <= 0)
            continue;
        int fd = accept(srv->listen_fd, NULL, NULL);
        if (fd < 0)
            continue;
        // No cmocka asserts off the main thread (they longjmp into it).
        struct fake_conn *c = malloc(sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->srv = srv;
        c->fd = fd;
        pthread_mutex_lock(&srv->mu);
        if (srv->n_conns < MAX_CONNS &&
            pthread_create(&srv->conns[srv->n_conns], NULL, conn_main, c) == 0) {
            srv->n_conns++;
        } else {
            close(fd);
            free(c);
        }
        pthread_mutex_unlock(&srv->mu);
    }
    return NULL;
}

static int listen_loopback(int *port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = 0};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(fd, 128), 0);
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &al), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

static struct fake_server *fake_start(void)
{
    struct fake_server *srv = calloc(1, sizeof(*srv));
    assert_non_null(srv);
    pthread_mutex_init(&srv->mu, NULL);
    srv->listen_fd = listen_loopback(&srv->port);
    assert_int_equal(pthread_create(&srv->acceptor, NULL, acceptor_main, srv), 0);
    return srv;
}

static void fake_stop(struct fake_server *srv)
{
    atomic_store(&srv->stop, true);
    pthread_join(srv->acceptor, NULL);
    for (int i = 0; i < srv->n_conns; i++)
        pthread_join(srv->conns[i], NULL);
    close(srv->listen_fd);
    pthread_mutex_destroy(&srv->mu);
    free(srv);
}

// ---- helpers -----------------------------------------------------------------------------------
struct tmp_dir {
    char path[64];
};

static void tmp_make(struct tmp_dir *t)
{
    snprintf(t->path, sizeof(t->path), "/tmp/bench_serve_test.XXXXXX");
    assert_non_null(mkdtemp(t->path));
}

static void tmp_file(const struct tmp_dir *t, const char *name, const char *content, char *out,
                     size_t outlen)
{
    snprintf(out, outlen, "%s/%s", t->path, name);
    if (content) {
        FILE *f = fopen(out, "w");
        assert_non_null(f);
        fputs(content, f);
        fclose(f);
    }
}

static void tmp_remove(const struct tmp_dir *t, const char *const *names, size_t n)
{
    char p[128];
    for (size_t i = 0; i < n; i++) {
        snprintf(p, sizeof(p), "%s/%s", t->path, names[i]);
        unlink(p);
    }
    rmdir(t->path);
}

// Runs tdm_bench_main with a NULL-terminated argument list; stdout/stderr of the
// tool land in *out / *err (heap, caller frees; may be NULL to discard).
static int run_main(char **out, char **err, ...)
{
    char *argv[64];
    int argc = 0;
    argv[argc++] = "tandem-bench";
    va_list ap;
    va_start(ap, err);
    for (char *a; (a = va_arg(ap, char *)) != NULL;)
        argv[argc++] = a;
    va_end(ap);
    argv[argc] = NULL;
    char *obuf = NULL, *ebuf = NULL;
    size_t olen = 0, elen = 0;
    FILE *of = open_memstream(&obuf, &olen);
    FILE *ef = open_memstream(&ebuf, &elen);
    assert_non_null(of);
    assert_non_null(ef);
    int rc = tdm_bench_main(argc, argv, of, ef);
    fclose(of);
    fclose(ef);
    if (out)
        *out = obuf;
    else
        free(obuf);
    if (err)
        *err = ebuf;
    else
        free(ebuf);
    return rc;
}

static cJSON *read_json(const char *path)
{
    char *text = NULL;
    size_t len = 0;
    assert_int_equal(tdm_read_file(path, &text, &len, NULL, 0), TDM_OK);
    cJSON *o = cJSON_Parse(text);
    free(text);
    assert_non_null(o);
    return o;
}

static double jnum(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(v))
        fail_msg("JSON key %s missing or not a number", key);
    return v->valuedouble;
}

static void check_range(const char *what, double v, double lo, double hi)
{
    if (!(v >= lo && v <= hi))
        fail_msg("%s = %g, expected within [%g, %g]", what, v, lo, hi);
}

// ---- pure parts ------------------------------------------------------------------------------
static void test_percentiles(void **state)
{
    (void)state;
    double v[5] = {1, 2, 3, 4, 5};
    // numpy.percentile([1,2,3,4,5], p): 50 -> 3, 90 -> 4.6, 99 -> 4.96, 25 -> 2.
    assert_float_equal(bench_percentile(v, 5, 50), 3.0, 1e-12);
    assert_float_equal(bench_percentile(v, 5, 90), 4.6, 1e-12);
    assert_float_equal(bench_percentile(v, 5, 99), 4.96, 1e-12);
    assert_float_equal(bench_percentile(v, 5, 25), 2.0, 1e-12);
    assert_float_equal(bench_percentile(v, 5, 100), 5.0, 1e-12);
    assert_float_equal(bench_percentile(v, 5, 0), 1.0, 1e-12);
    assert_float_equal(bench_percentile(v, 1, 99), 1.0, 1e-12);
    assert_float_equal(bench_percentile(v, 0, 99), 0.0, 1e-12);

    struct tdm_bench_config cfg;
    tdm_bench_config_init(&cfg);
    assert_int_equal(bench_parse_percentiles(&cfg, "50,99.9", NULL, 0), TDM_OK);
    assert_int_equal(cfg.n_percentiles, 2);
    assert_float_equal(cfg.percentiles[1], 99.9, 1e-12);
    assert_int_equal(bench_parse_percentiles(&cfg, "0", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_percentiles(&cfg, "50;90", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_percentiles(&cfg, "", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_percentiles(&cfg, "101", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_slo(&cfg, "ttft:200", NULL, 0), TDM_OK);
    assert_float_equal(cfg.slo_ttft_ms, 200, 1e-12);
    assert_int_equal(bench_parse_slo(&cfg, "tpot:-1", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_slo(&cfg, "itl:5", NULL, 0), TDM_EINVAL);
    assert_int_equal(bench_parse_slo(&cfg, "e2el", NULL, 0), TDM_EINVAL);
}

static const char sample_stream[] =
    ": keep-alive comment\r\n"
    "\r\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n"
    "\r\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n"
    "event: message\n"
    "data: {\"choices\":[{\"index\":0,\n"
    "data: \"delta\":{\"content\":\"lo \\u00e9\"}}]}\n\n"
    "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
    "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,"
    "\"total_tokens\":9}}\n\n"
    "data: [DONE]\n\n";

static void check_sample(const struct bench_stream *s)
{
    assert_false(s->failed);
    assert_false(s->oom);
    assert_true(s->done);
    assert_int_equal(s->n_content, 2); // the role chunk and the finish chunk carry no text
    assert_int_equal(s->n_itl, 1);
    assert_string_equal(s->text, "Hello \xc3\xa9");
    assert_int_equal(s->usage_completion, 2);
    assert_int_equal(s->usage_prompt, 7);
}

static void test_sse_parser(void **state)
{
    (void)state;
    struct bench_stream s;
    // Whole.
    assert_int_equal(bench_stream_init(&s, true, 4, 0.0), TDM_OK);
    assert_int_equal(bench_stream_feed(&s, sample_stream, strlen(sample_stream), 1.0), TDM_OK);
    bench_stream_finish(&s, 1.0);
    check_sample(&s);
    bench_stream_fini(&s);
    // One byte at a time, the clock advancing: the first content chunk is
    // complete at its last byte, which fixes TTFT and the gap.
    assert_int_equal(bench_stream_init(&s, true, 0, 0.0), TDM_OK);
    size_t len = strlen(sample_stream);
    for (size_t i = 0; i < len; i++)
        assert_int_equal(bench_stream_feed(&s, sample_stream + i, 1, (double)i), TDM_OK);
    bench_stream_finish(&s, (double)len);
    check_sample(&s);
    const char *first_end = strstr(sample_stream, "\"Hel\"}}]}\n\n") + strlen("\"Hel\"}}]}\n\n");
    assert_float_equal(s.ttft, (double)(first_end - sample_stream - 1), 1e-9);
    assert_true(s.itl[0] > 0);
    bench_stream_fini(&s);

    // Completions text, an error event, then more data: the error sticks.
    const char *err_stream = "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
                             "data: {\"error\":{\"message\":\"engine died\",\"code\":500}}\n\n"
                             "data: [DONE]\n\n";
    assert_int_equal(bench_stream_init(&s, false, 4, 0.0), TDM_OK);
    assert_int_equal(bench_stream_feed(&s, err_stream, strlen(err_stream), 0.5), TDM_OK);
    assert_true(s.failed);
    assert_string_equal(s.reason, "error event");
    assert_non_null(strstr(s.error, "engine died"));
    assert_int_equal(s.n_content, 1);
    assert_float_equal(s.ttft, 0.5, 1e-12);
    bench_stream_fini(&s);

    // The older flat error form and an unparsable chunk; a last event with no blank line.
    const char *flat = "data: {\"object\":\"error\",\"message\":\"bad\",\"code\":400}";
    assert_int_equal(bench_stream_init(&s, false, 4, 0.0), TDM_OK);
    assert_int_equal(bench_stream_feed(&s, flat, strlen(flat), 0.1), TDM_OK);
    assert_false(s.failed);
    bench_stream_finish(&s, 0.2);
    assert_true(s.failed);
    assert_string_equal(s.reason, "error event");
    bench_stream_fini(&s);
    const char *junk = "data: {not json\n\n";
    assert_int_equal(bench_stream_init(&s, false, 4, 0.0), TDM_OK);
    assert_int_equal(bench_stream_feed(&s, junk, strlen(junk), 0.1), TDM_OK);
    assert_true(s.failed);
    assert_string_equal(s.reason, "bad chunk");
    bench_stream_fini(&s);

    // Growth past the expected size (more chunks than expected, a long line).
    assert_int_equal(bench_stream_init(&s, false, 0, 0.0), TDM_OK);
    char big[3000];
    memset(big, 'x', sizeof(big));
    for (int i = 0; i < 50; i++) {
        char ev[3100];
        int n = snprintf(ev, sizeof(ev), "data: {\"choices\":[{\"text\":\"%.*s\"}]}\n\n",
                         i == 7 ? 2900 : 1, big);
        assert_int_equal(bench_stream_feed(&s, ev, (size_t)n, 0.01 * i), TDM_OK);
    }
    assert_int_equal(s.n_content, 50);
    assert_int_equal(s.n_itl, 49);
    assert_int_equal(s.text_len, 49 + 2900);
    bench_stream_fini(&s);
}

static void test_arrivals(void **state)
{
    (void)state;
    enum { N = 20001 };
    double *t = malloc(N * sizeof(double));
    assert_non_null(t);
    bench_arrival_times(t, N, INFINITY, 1.0, 1);
    for (int i = 0; i < N; i++)
        assert_true(t[i] == 0.0);
    // Poisson at 10/s: mean gap 0.1 s, and gaps exponential (std = mean).
    bench_arrival_times(t, N, 10.0, 1.0, 42);
    assert_true(t[0] == 0.0);
    double mean = t[N - 1] / (N - 1), var = 0;
    for (int i = 1; i < N; i++) {
        assert_true(t[i] >= t[i - 1]);
        double g = t[i] - t[i - 1] - mean;
        var += g * g;
    }
    check_range("poisson mean gap", mean, 0.098, 0.102);
    check_range("poisson gap std", sqrt(var / (N - 1)), 0.096, 0.104);
    // Burstiness 0.25 (gamma shape < 1): same mean, std = mean / sqrt(0.25) = 0.2.
    bench_arrival_times(t, N, 10.0, 0.25, 42);
    mean = t[N - 1] / (N - 1);
    var = 0;
    for (int i = 1; i < N; i++) {
        double g = t[i] - t[i - 1] - mean;
        var += g * g;
    }
    check_range("gamma(0.25) mean gap", mean, 0.096, 0.104);
    check_range("gamma(0.25) gap std", sqrt(var / (N - 1)), 0.19, 0.21);
    // Same seed, same schedule.
    double a[4], b[4];
    bench_arrival_times(a, 4, 3.0, 1.0, 9);
    bench_arrival_times(b, 4, 3.0, 1.0, 9);
    assert_memory_equal(a, b, sizeof(a));
    free(t);
}

static void test_args(void **state)
{
    (void)state;
    char *err = NULL, *out = NULL;
    struct {
        const char *a[6];
        const char *needle;
    } bad[] = {
        // The wording of core's one flag parser, shared by every binary (was
        // "unknown option --bogus" and "--num-prompts needs a value" here).
        {{"--bogus", "--model", "m"}, "unknown option \"--bogus\""},
        {{"--dataset", "file:/x"}, "--model is required"},
        {{"--model", "m", "--num-prompts", "0"}, "--num-prompts"},
        {{"--model", "m", "--num-prompts"}, "--num-prompts: missing value"},
        {{"--model", "m", "--request-rate", "-1"}, "--request-rate"},
        {{"--model", "m", "--goodput", "ttft"}, "--goodput"},
        {{"--model", "m", "--goodput"}, "--goodput needs"},
        {{"--model", "m", "--percentiles", "0,50"}, "--percentiles"},
        {{"--model", "m"}, "needs a tokenizer"},
        {{"--model", "m", "--dataset", "sharegpt"}, "neither random"},
        {{"--model", "m", "--range-ratio", "1"}, "--range-ratio"},
        {{"--model", "m", "--base-url", "ftp://x"}, "http://"},
        {{"--model", "m", "--endpoint", "v1/completions"}, "--endpoint"},
        {{"--model", "m", "--timeout", "0"}, "--timeout"},
        {{"--model", "m", "--backend", "tgi"}, "--backend"},
        {{"--model", "m", "--dataset", "file:/nonexistent/prompts.txt"}, "dataset"},
        {{"--model", "m", "--tokenizer", "/nonexistent", "--dataset", "file:/x"}, "--tokenizer"},
        {{"stray", "--model", "m"}, "unexpected argument"},
        {{"--model", "m", "--duration", "0"}, "--duration must be"},
        {{"--model", "m", "--duration", "5", "--dataset", "file:/x"}, "needs --max-concurrency"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        const char **a = bad[i].a;
        int rc = run_main(&out, &err, a[0], a[1], a[2], a[3], a[4], a[5], NULL);
        if (rc != 2 || !strstr(err, bad[i].needle) || strchr(err, '\n') != err + strlen(err) - 1)
            fail_msg("case %zu: rc %d, stderr \"%s\" (want exit 2, one line with \"%s\")", i, rc,
                     err, bad[i].needle);
        assert_string_equal(out, "");
        free(out);
        free(err);
    }
    assert_int_equal(run_main(&out, &err, "--model", "m", "--help", NULL), 0);
    assert_non_null(strstr(out, "--max-concurrency"));
    assert_string_equal(err, "");
    free(out);
    free(err);
}

static void test_file_dataset(void **state)
{
    (void)state;
    struct tmp_dir t;
    tmp_make(&t);
    char p1[128], p2[128], p3[128];
    tmp_file(&t, "a.txt",
             "first prompt\n\n{\"prompt\": \"second \\\"q\\\"\", \"output_len\": 7}\r\n  \nthird\n",
             p1, sizeof(p1));
    tmp_file(&t, "b.txt", "ok\n{\"text\": \"no prompt\"}\n", p2, sizeof(p2));
    tmp_file(&t, "c.txt", "\n \n", p3, sizeof(p3));
    struct tdm_bench_dataset ds;
    char err[256];
    assert_int_equal(tdm_bench_dataset_file(&ds, p1, NULL, 5, 3, err, sizeof(err)), TDM_OK);
    assert_int_equal(ds.n, 5);
    assert_string_equal(ds.prompts[0].text, "first prompt");
    assert_string_equal(ds.prompts[1].text, "second \"q\"");
    assert_int_equal(ds.prompts[1].output_len, 7);
    assert_int_equal(ds.prompts[0].output_len, 3);
    assert_string_equal(ds.prompts[2].text, "third");
    assert_string_equal(ds.prompts[3].text, "first prompt"); // cycles
    assert_int_equal(ds.prompts[0].input_len, -1);
    tdm_bench_dataset_fini(&ds);
    assert_int_equal(tdm_bench_dataset_file(&ds, p2, NULL, 2, 3, err, sizeof(err)), TDM_EINVAL);
    assert_non_null(strstr(err, ":2:"));
    assert_int_equal(tdm_bench_dataset_file(&ds, p3, NULL, 2, 3, err, sizeof(err)), TDM_EINVAL);
    assert_int_equal(tdm_bench_dataset_file(&ds, "/nonexistent/x", NULL, 2, 3, err, sizeof(err)),
                     TDM_ENOTFOUND);
    assert_int_equal(tdm_bench_dataset_random(&ds, NULL, 2, 3, 3, 0, 0, err, sizeof(err)),
                     TDM_EINVAL);
    const char *names[] = {"a.txt", "b.txt", "c.txt"};
    tmp_remove(&t, names, 3);
}

// Every random prompt re-encodes to exactly its length (issue 14: with the
// demo model's tokenizer, --input-len 256 over 120 prompts reached the server
// as 30 799 tokens, not 30 720). Uses tandem-mkmodel's tokenizer, so it never
// skips, and the real Qwen2.5 one when ../shared is there.
static void check_exact_lengths(const char *dir, int num, int len)
{
    struct tdm_tokenizer *tok = NULL;
    char err[256];
    assert_int_equal(tdm_tok_load(&tok, dir, err, sizeof(err)), TDM_OK);
    struct tdm_bench_dataset ds;
    assert_int_equal(tdm_bench_dataset_random(&ds, tok, num, len, 4, 0.0, 3, err, sizeof(err)),
                     TDM_OK);
    long total = 0;
    for (size_t i = 0; i < ds.n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(
            tdm_tok_encode(tok, ds.prompts[i].text, strlen(ds.prompts[i].text), false, &ids, &n),
            TDM_OK);
        free(ids);
        if ((int)n != len || ds.prompts[i].input_len != len)
            fail_msg("%s: prompt %zu encodes to %zu tokens (reported %d), wanted %d", dir, i, n,
                     ds.prompts[i].input_len, len);
        total += (long)n;
    }
    assert_int_equal(total, (long)num * len);
    tdm_bench_dataset_fini(&ds);
    tdm_tok_free(tok);
}

static void test_random_dataset_exact_lengths(void **state)
{
    (void)state;
    char dir[] = "/tmp/tandem-bench-tok-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char err[256];
    assert_int_equal(tdm_mkmodel_write_tokenizer(2048, dir, err, sizeof(err)), TDM_OK);
    check_exact_lengths(dir, 120, 256);
    check_exact_lengths(dir, 20, 7);
    tdm_mkmodel_remove(dir);
    struct stat st;
    if (stat(QWEN_DIR "/tokenizer.json", &st) == 0)
        check_exact_lengths(QWEN_DIR, 40, 256);
}

static void test_random_dataset(void **state)
{
    (void)state;
    struct stat st;
    if (stat(QWEN_DIR "/tokenizer.json", &st) != 0)
        TDM_SKIP("%s/tokenizer.json is absent (../shared)", QWEN_DIR);
    struct tdm_tokenizer *tok = NULL;
    char err[256];
    assert_int_equal(tdm_tok_load(&tok, QWEN_DIR, err, sizeof(err)), TDM_OK);
    struct tdm_bench_dataset a, b, c;
    assert_int_equal(tdm_bench_dataset_random(&a, tok, 12, 48, 16, 0.0, 7, err, sizeof(err)),
                     TDM_OK);
    for (size_t i = 0; i < a.n; i++) {
        int32_t *ids = NULL;
        size_t n = 0;
        assert_int_equal(
            tdm_tok_encode(tok, a.prompts[i].text, strlen(a.prompts[i].text), false, &ids, &n),
            TDM_OK);
        assert_int_equal(n, 48); // the server sees exactly input_len tokens
        for (size_t k = 0; k < n; k++)
            assert_false(tdm_tok_is_special(tok, ids[k]));
        free(ids);
        assert_int_equal(a.prompts[i].input_len, 48);
        assert_int_equal(a.prompts[i].output_len, 16);
    }
    assert_int_equal(tdm_bench_dataset_random(&b, tok, 12, 48, 16, 0.0, 7, err, sizeof(err)),
                     TDM_OK);
    assert_int_equal(tdm_bench_dataset_random(&c, tok, 12, 48, 16, 0.5, 8, err, sizeof(err)),
                     TDM_OK);
    bool all_same = true;
    for (size_t i = 0; i < a.n; i++) {
        assert_string_equal(a.prompts[i].text, b.prompts[i].text); // seeded
        all_same = all_same && !strcmp(a.prompts[i].text, c.prompts[i].text);
        check_range("input_len with range 0.5", c.prompts[i].input_len, 24, 72);
        check_range("output_len with range 0.5", c.prompts[i].output_len, 8, 24);
    }
    assert_false(all_same);
    // Seed 101 once drew a token that decodes to a NUL byte: the text was cut
    // there (541 of 2048 tokens reached the server). No prompt may hold a NUL.
    struct tdm_bench_dataset d;
    assert_int_equal(tdm_bench_dataset_random(&d, tok, 1, 2048, 16, 0.0, 101, err, sizeof(err)),
                     TDM_OK);
    int32_t *dids = NULL;
    size_t dn = 0;
    assert_int_equal(
        tdm_tok_encode(tok, d.prompts[0].text, strlen(d.prompts[0].text), false, &dids, &dn),
        TDM_OK);
    assert_int_equal(dn, 2048);
    free(dids);
    tdm_bench_dataset_fini(&d);
    tdm_bench_dataset_fini(&a);
    tdm_bench_dataset_fini(&b);
    tdm_bench_dataset_fini(&c);
    tdm_tok_free(tok);
}

// ---- against the fake server -------------------------------------------------------------------
static const char *const metric_keys[] = {
    "completed",
    "failed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "mean_ttft_ms",
    "median_ttft_ms",
    "std_ttft_ms",
    "p50_ttft_ms",
    "p90_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
};

static void test_stream_completions(void **state)
{
    (void)state;
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64];
    tmp_file(&t, "p.txt", "ok one\nok two\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    char dataset[160];
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *out = NULL, *err = NULL;
    int rc = run_main(&out, &err, "--base-url", url, "--model", "m", "--dataset", dataset,
                      "--output-len", "20", "--num-prompts", "8", "--json", json, "--goodput",
                      "ttft:5000", "tpot:1000", "--timeout", "10", NULL);
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    assert_non_null(strstr(out, "Successful requests:                     8"));
    assert_non_null(strstr(out, "Mean TTFT (ms):"));
    assert_non_null(strstr(out, "P90 ITL (ms):"));
    assert_non_null(strstr(out, "Request goodput (req/s):"));
    assert_int_equal(atomic_load(&srv->requests), 8);
    assert_int_equal(atomic_load(&srv->saw_stream_usage), 8);
    assert_int_equal(atomic_load(&srv->saw_ignore_eos), 0); // file dataset: off by default
    assert_int_equal(atomic_load(&srv->last_max_tokens), 20);

    cJSON *o = read_json(json);
    for (size_t i = 0; i < sizeof(metric_keys) / sizeof(metric_keys[0]); i++)
        (void)jnum(o, metric_keys[i]);
    assert_int_equal((int)jnum(o, "completed"), 8);
    assert_int_equal((int)jnum(o, "failed"), 0);
    assert_int_equal((int)jnum(o, "total_output_tokens"), 160);  // usage.completion_tokens
    assert_int_equal((int)jnum(o, "total_input_tokens"), 8 * 6); // usage.prompt_tokens
    assert_int_equal((int)jnum(o, "max_concurrent_requests"), 8);
    double dur = jnum(o, "duration");
    // Each stream takes TTFT + 19 gaps = 240 ms; all 8 run at once.
    check_range("duration", dur, 0.235, 3.0);
    check_range("mean_ttft_ms", jnum(o, "mean_ttft_ms"), 45, 400);
    check_range("median_itl_ms", jnum(o, "median_itl_ms"), 7, 40);
    check_range("mean_itl_ms", jnum(o, "mean_itl_ms"), 7, 60);
    check_range("mean_tpot_ms", jnum(o, "mean_tpot_ms"), 7, 60);
    check_range("mean_e2el_ms", jnum(o, "mean_e2el_ms"), 235, 2500);
    assert_true(jnum(o, "p99_ttft_ms") >= jnum(o, "median_ttft_ms"));
    assert_float_equal(jnum(o, "request_throughput"), 8 / dur, 1e-9 * 8 / dur);
    assert_float_equal(jnum(o, "output_throughput"), 160 / dur, 1e-9 * 160 / dur);
    assert_float_equal(jnum(o, "total_token_throughput"), 208 / dur, 1e-9 * 208 / dur);
    assert_float_equal(jnum(o, "request_goodput"), 8 / dur, 1e-9 * 8 / dur);
    check_range("max_output_tokens_per_s", jnum(o, "max_output_tokens_per_s"), 1, 160);
    const cJSON *itls = cJSON_GetObjectItemCaseSensitive(o, "itls");
    assert_int_equal(cJSON_GetArraySize(itls), 8);
    assert_int_equal(cJSON_GetArraySize(cJSON_GetArrayItem(itls, 0)), 19);
    const cJSON *texts = cJSON_GetObjectItemCaseSensitive(o, "generated_texts");
    assert_true(cJSON_IsString(cJSON_GetArrayItem(texts, 3)));
    assert_non_null(strstr(cJSON_GetArrayItem(texts, 3)->valuestring, " w0 w1 w2"));
    cJSON_Delete(o);
    free(out);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

static void test_stream_chat(void **state)
{
    (void)state;
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "ok chat\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d/", srv->port); // a trailing '/' is fine
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *err = NULL;
    int rc =
        run_main(NULL, &err, "--base-url", url, "--endpoint", "/v1/chat/completions", "--model",
                 "m", "--dataset", dataset, "--output-len", "6", "--num-prompts", "3", "--json",
                 json, "--ignore-eos", "--percentiles", "99.9", "--api-key", "sk-test", NULL);
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    assert_int_equal(atomic_load(&srv->saw_ignore_eos), 3);
    assert_int_equal(atomic_load(&srv->saw_api_key), 3);
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 3);
    assert_int_equal((int)jnum(o, "total_output_tokens"), 18);
    // The role chunk arrives at once with empty content: TTFT still waits for text.
    check_range("chat mean_ttft_ms", jnum(o, "mean_ttft_ms"), 45, 400);
    (void)jnum(o, "p99.9_itl_ms");
    assert_null(cJSON_GetObjectItemCaseSensitive(o, "p99_itl_ms"));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(o, "backend")->valuestring, "openai-chat");
    cJSON_Delete(o);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

static void test_failures(void **state)
{
    (void)state;
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "ok\nfail500\ndrop\nerrevent\nhang\nnousage\nfail503\n", prompts,
             sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *out = NULL, *err = NULL;
    double t0 = tdm_now();
    int rc = run_main(&out, &err, "--base-url", url, "--model", "m", "--dataset", dataset,
                      "--output-len", "10", "--num-prompts", "7", "--json", json, "--timeout",
                      "0.6", "--goodput", "ttft:1", NULL);
    double took = tdm_now() - t0;
    if (rc != 0)
        fail_msg("exit %d (some requests succeeded), stderr: %s", rc, err);
    check_range("wall time with a hanging request", took, 0.55, 3.0); // the timeout ended it
    assert_non_null(strstr(out, "Failed requests:                         5"));
    assert_non_null(strstr(out, "HTTP 500"));
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 2);
    assert_int_equal((int)jnum(o, "failed"), 5);
    // nousage: no usage and no tokenizer, so one token per content chunk.
    assert_int_equal((int)jnum(o, "total_output_tokens"), 20);
    assert_float_equal(jnum(o, "request_goodput"), 0.0, 0.0); // TTFT >= 50 ms > 1 ms
    const cJSON *reasons = cJSON_GetObjectItemCaseSensitive(o, "failure_reasons");
    assert_int_equal((int)jnum(reasons, "HTTP 500"), 1);
    assert_int_equal((int)jnum(reasons, "connection"), 1);
    assert_int_equal((int)jnum(reasons, "error event"), 1);
    assert_int_equal((int)jnum(reasons, "timeout"), 1);
    assert_int_equal((int)jnum(reasons, "HTTP 503"), 1); // an error status with no body
    const cJSON *errors = cJSON_GetObjectItemCaseSensitive(o, "errors");
    assert_string_equal(cJSON_GetArrayItem(errors, 0)->valuestring, "");
    assert_non_null(strstr(cJSON_GetArrayItem(errors, 1)->valuestring, "boom"));
    assert_non_null(strstr(cJSON_GetArrayItem(errors, 3)->valuestring, "engine died"));
    const cJSON *out_lens = cJSON_GetObjectItemCaseSensitive(o, "output_lens");
    assert_int_equal(cJSON_GetArrayItem(out_lens, 2)->valueint, 0);
    cJSON_Delete(o);
    free(out);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

static void test_max_concurrency(void **state)
{
    (void)state;
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "ok\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *err = NULL;
    int rc = run_main(NULL, &err, "--base-url", url, "--model", "m", "--dataset", dataset,
                      "--output-len", "5", "--num-prompts", "6", "--json", json,
                      "--max-concurrency", "2", NULL);
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 6);
    assert_int_equal((int)jnum(o, "max_concurrent_requests"), 2);
    assert_int_equal((int)jnum(o, "max_concurrency"), 2);
    assert_true(atomic_load(&srv->max_active) <= 2);
    // Three waves of TTFT + 4 gaps (90 ms) one after the other.
    check_range("duration at concurrency 2", jnum(o, "duration"), 0.26, 4.0);
    // The semaphore wait is not latency: TTFT stays near the injected 50 ms.
    check_range("mean_ttft_ms at concurrency 2", jnum(o, "mean_ttft_ms"), 45, 400);
    cJSON_Delete(o);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

// --duration (a soak): requests keep going out, prompts reused in turn, at the
// concurrency bound until the time is up; then the run waits for those in flight.
static void test_duration(void **state)
{
    (void)state;
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "ok a\nok b\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *out = NULL, *err = NULL;
    double t0 = tdm_now();
    int rc = run_main(&out, &err, "--base-url", url, "--model", "m", "--dataset", dataset,
                      "--output-len", "3", "--num-prompts", "2", "--json", json,
                      "--max-concurrency", "3", "--duration", "0.8", NULL);
    double took = tdm_now() - t0;
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    assert_non_null(strstr(out, "Duration: 0.8 s"));
    cJSON *o = read_json(json);
    int completed = (int)jnum(o, "completed");
    // Each request takes TTFT + 2 gaps (70 ms): about 3 x 0.8 / 0.07 = 34 of them;
    // far fewer on a slow machine, but more than the 2 prompts.
    if (completed < 6)
        fail_msg("only %d requests in 0.8 s at concurrency 3", completed);
    assert_int_equal((int)jnum(o, "failed"), 0);
    assert_int_equal(atomic_load(&srv->requests), completed);
    assert_true(atomic_load(&srv->max_active) <= 3);
    assert_int_equal((int)jnum(o, "max_concurrent_requests"), 3);
    assert_float_equal(jnum(o, "duration_limit"), 0.8, 1e-12);
    // Nothing is sent after the duration; what was in flight then finished.
    const cJSON *starts = cJSON_GetObjectItemCaseSensitive(o, "start_times");
    assert_int_equal(cJSON_GetArraySize(starts), completed);
    for (int i = 0; i < completed; i++)
        assert_true(cJSON_GetArrayItem(starts, i)->valuedouble < 0.8);
    check_range("duration", jnum(o, "duration"), 0.8, 5.0);
    check_range("wall time", took, 0.8, 6.0);
    const cJSON *texts = cJSON_GetObjectItemCaseSensitive(o, "generated_texts");
    assert_int_equal(cJSON_GetArraySize(texts), completed);
    cJSON_Delete(o);
    free(out);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

static void test_all_fail(void **state)
{
    (void)state;
    int port;
    int fd = listen_loopback(&port);
    close(fd); // nothing listens there now: every connect is refused
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "ok\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", port);
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *err = NULL;
    int rc = run_main(NULL, &err, "--base-url", url, "--model", "m", "--dataset", dataset,
                      "--num-prompts", "3", "--json", json, "--request-rate", "100", NULL);
    assert_int_equal(rc, 1);
    assert_non_null(strstr(err, "every request failed"));
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 0);
    assert_int_equal((int)jnum(o, "failed"), 3);
    assert_float_equal(jnum(o, "mean_ttft_ms"), 0.0, 0.0);
    const cJSON *reasons = cJSON_GetObjectItemCaseSensitive(o, "failure_reasons");
    assert_int_equal((int)jnum(reasons, "connection"), 3);
    cJSON_Delete(o);
    free(err);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

// No usage chunk but a tokenizer: output tokens are the generated text re-encoded,
// input tokens the prompt encoded locally.
static void test_count_with_tokenizer(void **state)
{
    (void)state;
    struct stat st;
    if (stat(QWEN_DIR "/tokenizer.json", &st) != 0)
        TDM_SKIP("%s/tokenizer.json is absent (../shared)", QWEN_DIR);
    struct tdm_tokenizer *tok = NULL;
    char e[256];
    assert_int_equal(tdm_tok_load(&tok, QWEN_DIR, e, sizeof(e)), TDM_OK);
    const char *generated = " w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11";
    int32_t *ids = NULL;
    size_t n_out = 0, n_in = 0;
    assert_int_equal(tdm_tok_encode(tok, generated, strlen(generated), false, &ids, &n_out), 0);
    free(ids);
    assert_int_equal(tdm_tok_encode(tok, "nousage please", 14, false, &ids, &n_in), 0);
    free(ids);
    tdm_tok_free(tok);
    assert_true(n_out != 12); // else this would not tell re-encoding from chunk counting

    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char prompts[128], json[128], url[64], dataset[160];
    tmp_file(&t, "p.txt", "nousage please\n", prompts, sizeof(prompts));
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    snprintf(dataset, sizeof(dataset), "file:%s", prompts);
    char *err = NULL;
    int rc =
        run_main(NULL, &err, "--base-url", url, "--model", "m", "--dataset", dataset, "--tokenizer",
                 QWEN_DIR, "--output-len", "12", "--num-prompts", "2", "--json", json, NULL);
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 2);
    assert_int_equal((int)jnum(o, "total_output_tokens"), 2 * (int)n_out);
    assert_int_equal((int)jnum(o, "total_input_tokens"), 2 * (int)n_in);
    cJSON_Delete(o);
    free(err);
    fake_stop(srv);
    const char *names[] = {"p.txt", "r.json"};
    tmp_remove(&t, names, 2);
}

// Without --tokenizer the random dataset takes --model's tokenizer (a model
// folder here), and --served-model-name is the "model" sent, as vllm bench
// serve does (issue 14).
static void test_tokenizer_from_model(void **state)
{
    (void)state;
    char dir[] = "/tmp/tandem-bench-model-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char e[256];
    assert_int_equal(tdm_mkmodel_write_tokenizer(2048, dir, e, sizeof(e)), TDM_OK);
    struct fake_server *srv = fake_start();
    struct tmp_dir t;
    tmp_make(&t);
    char json[128], url[64];
    tmp_file(&t, "r.json", NULL, json, sizeof(json));
    snprintf(url, sizeof(url), "http://127.0.0.1:%d", srv->port);
    char *err = NULL;
    int rc = run_main(NULL, &err, "--base-url", url, "--model", dir, "--served-model-name",
                      "served", "--input-len", "32", "--output-len", "4", "--num-prompts", "3",
                      "--json", json, NULL);
    if (rc != 0)
        fail_msg("exit %d, stderr: %s", rc, err);
    cJSON *o = read_json(json);
    assert_int_equal((int)jnum(o, "completed"), 3);
    assert_int_equal((int)jnum(o, "total_input_tokens"), 3 * 32);
    assert_string_equal(cJSON_GetObjectItem(o, "model_id")->valuestring, "served");
    cJSON_Delete(o);
    free(err);
    fake_stop(srv);
    const char *names[] = {"r.json"};
    tmp_remove(&t, names, 1);
    tdm_mkmodel_remove(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_percentiles),        cmocka_unit_test(test_sse_parser),
        cmocka_unit_test(test_arrivals),           cmocka_unit_test(test_args),
        cmocka_unit_test(test_file_dataset),       cmocka_unit_test(test_random_dataset),
        cmocka_unit_test(test_random_dataset_exact_lengths),
        cmocka_unit_test(test_stream_completions), cmocka_unit_test(test_stream_chat),
        cmocka_unit_test(test_failures),           cmocka_unit_test(test_max_concurrency),
        cmocka_unit_test(test_duration),
        cmocka_unit_test(test_all_fail),           cmocka_unit_test(test_count_with_tokenizer),
        cmocka_unit_test(test_tokenizer_from_model),
    };
    return tdm_test_exit(cmocka_run_group_tests(tests, NULL, NULL));
}
