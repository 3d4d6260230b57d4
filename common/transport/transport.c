// SPDX-License-Identifier: Apache-2.0
// transport: frames and the nng inbox/outbox (see transport.h). The inbox is a
// PULL listener; the outbox keeps one PUSH dialer per peer URL, created on first
// use and kept for the process's life, so reconnects after a peer restart are
// nng's job (bounded redial interval), and nothing here remembers a connection:
// the peer's identity lives in the messages (instance ids), not in the socket.
#include "transport.h"

#include <nng/nng.h>
#include <nng/protocol/pipeline0/pull.h>
#include <nng/protocol/pipeline0/push.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "core.h"

#define MOD "transport"

static const char *const type_names[] = {
    "?",      "generate", "prefill",    "prefill_result", "kv_pull",   "kv_data",
    "tokens", "cancel",   "load_query", "load_report",    "kv_events",
};

const char *tdm_net_type_name(int type)
{
    if (type < 1 || type > TDM_NET_TYPE_MAX)
        return "?";
    return type_names[type];
}

// ---- frames ----------------------------------------------------------------------------
static void put_u32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static void put_u16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}

static uint32_t get_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint16_t get_u16(const uint8_t *p)
{
    return (uint16_t)(p[0] | p[1] << 8);
}

size_t tdm_net_frame_size(size_t msg_len, size_t payload_len)
{
    if (msg_len > TDM_NET_MAX_FRAME || payload_len > TDM_NET_MAX_FRAME ||
        msg_len + payload_len > TDM_NET_MAX_FRAME - TDM_NET_HEADER_BYTES)
        return 0;
    return TDM_NET_HEADER_BYTES + msg_len + payload_len;
}

void tdm_net_frame_header(uint8_t dst[TDM_NET_HEADER_BYTES], int type, size_t msg_len,
                          size_t payload_len)
{
    put_u32(dst, TDM_NET_MAGIC);
    put_u16(dst + 4, TDM_NET_VERSION);
    put_u16(dst + 6, (uint16_t)type);
    put_u32(dst + 8, (uint32_t)msg_len);
    put_u32(dst + 12, (uint32_t)payload_len);
}

int tdm_net_frame_parse(const void *buf, size_t len, struct tdm_net_frame *out, char *err,
                        size_t errlen)
{
    const uint8_t *b = buf;
    memset(out, 0, sizeof *out);
    if (b == NULL || len < TDM_NET_HEADER_BYTES)
        return tdm_seterr(err, errlen, TDM_EPROTO,
                          "frame: %zu bytes, shorter than the %d-byte header", len,
                          TDM_NET_HEADER_BYTES);
    uint32_t magic = get_u32(b);
    if (magic != TDM_NET_MAGIC)
        return tdm_seterr(err, errlen, TDM_EPROTO, "frame: bad magic 0x%08x", magic);
    unsigned version = get_u16(b + 4);
    if (version != TDM_NET_VERSION)
        return tdm_seterr(err, errlen, TDM_EPROTO, "frame: version %u, expected %d", version,
                          TDM_NET_VERSION);
    int type = get_u16(b + 6);
    if (type < 1 || type > TDM_NET_TYPE_MAX)
        return tdm_seterr(err, errlen, TDM_EPROTO, "frame: unknown type %d", type);
    uint64_t msg_len = get_u32(b + 8), payload_len = get_u32(b + 12);
    uint64_t want = TDM_NET_HEADER_BYTES + msg_len + payload_len;
    if (want != len)
        return tdm_seterr(err, errlen, TDM_EPROTO, "frame: header says %llu bytes, got %zu",
                          (unsigned long long)want, len);
    out->type = type;
    out->msg = b + TDM_NET_HEADER_BYTES;
    out->msg_len = (size_t)msg_len;
    out->payload = payload_len ? b + TDM_NET_HEADER_BYTES + msg_len : NULL;
    out->payload_len = (size_t)payload_len;
    return TDM_OK;
}

uint64_t tdm_net_new_instance_id(void)
{
    uint64_t id = 0;
    if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t x = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
        x ^= (uint64_t)getpid() << 32;
        id = tdm_splitmix64(&x);
    }
    return id ? id : 1;
}

static int nng_to_tdm(int rv)
{
    switch (rv) {
    case 0:
        return TDM_OK;
    case NNG_ENOMEM:
        return TDM_ENOMEM;
    case NNG_ETIMEDOUT:
    case NNG_EAGAIN:
        return TDM_ETIMEDOUT;
    case NNG_ECLOSED:
        return TDM_ECLOSED;
    case NNG_EINVAL:
    case NNG_EADDRINVAL:
    case NNG_ENOTSUP:
        return TDM_EINVAL;
    default:
        return TDM_ETRANSPORT;
    }
}

static int ms_of(double seconds)
{
    if (seconds < 0)
        return NNG_DURATION_INFINITE;
    double ms = seconds * 1000.0;
    if (ms > 1e9)
        return 1000000000;
    int v = (int)ms;
    return v < 1 && seconds > 0 ? 1 : v;
}

// ---- inbox -----------------------------------------------------------------------------
struct tdm_net_inbox {
    nng_socket sock;
    nng_listener listener;
    atomic_bool closed;
    char url[256]; // the URL peers dial (bound port filled in)
};

struct tdm_net_msg {
    nng_msg *msg;
    struct tdm_net_frame frame;
};

int tdm_net_inbox_new(struct tdm_net_inbox **out, const char *url, char *err, size_t errlen)
{
    *out = NULL;
    if (url == NULL || strlen(url) >= 200)
        return tdm_seterr(err, errlen, TDM_EINVAL, "inbox: bad url");
    struct tdm_net_inbox *in = calloc(1, sizeof *in);
    if (in == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "inbox: out of memory");
    int rv = nng_pull0_open(&in->sock);
    if (rv != 0) {
        free(in);
        return tdm_seterr(err, errlen, nng_to_tdm(rv), "inbox: nng_pull0_open: %s",
                          nng_strerror(rv));
    }
    nng_socket_set_size(in->sock, NNG_OPT_RECVMAXSZ, TDM_NET_MAX_FRAME);
    rv = nng_listener_create(&in->listener, in->sock, url);
    if (rv == 0)
        rv = nng_listener_set_size(in->listener, NNG_OPT_RECVMAXSZ, TDM_NET_MAX_FRAME);
    if (rv == 0)
        rv = nng_listener_start(in->listener, 0);
    if (rv != 0) {
        nng_close(in->sock);
        free(in);
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "inbox: cannot listen on %s: %s", url,
                          nng_strerror(rv));
    }
    snprintf(in->url, sizeof in->url, "%s", url);
    size_t n = strlen(url);
    if (strncmp(url, "tcp://", 6) == 0 && n >= 2 && strcmp(url + n - 2, ":0") == 0) {
        int port = 0;
        if (nng_listener_get_int(in->listener, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
            snprintf(in->url, sizeof in->url, "%.*s:%d", (int)(n - 2), url, port);
    }
    *out = in;
    return TDM_OK;
}

void tdm_net_inbox_close(struct tdm_net_inbox *in)
{
    if (in == NULL || atomic_exchange(&in->closed, true))
        return;
    nng_close(in->sock);
}

void tdm_net_inbox_free(struct tdm_net_inbox *in)
{
    if (in == NULL)
        return;
    tdm_net_inbox_close(in);
    free(in);
}

const char *tdm_net_inbox_url(const struct tdm_net_inbox *in)
{
    return in->url;
}

int tdm_net_inbox_recv(struct tdm_net_inbox *in, double timeout_s, struct tdm_net_msg **out,
                       char *err, size_t errlen)
{
    *out = NULL;
    if (atomic_load(&in->closed))
        return tdm_seterr(err, errlen, TDM_ECLOSED, "inbox: closed");
    nng_socket_set_ms(in->sock, NNG_OPT_RECVTIMEO, ms_of(timeout_s));
    nng_msg *m = NULL;
    int rv = nng_recvmsg(in->sock, &m, timeout_s == 0 ? NNG_FLAG_NONBLOCK : 0);
    if (rv != 0) {
        int code = nng_to_tdm(rv);
        return tdm_seterr(err, errlen, code, "inbox: recv: %s", nng_strerror(rv));
    }
    struct tdm_net_msg *r = calloc(1, sizeof *r);
    if (r == NULL) {
        nng_msg_free(m);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "inbox: out of memory");
    }
    r->msg = m;
    int rc = tdm_net_frame_parse(nng_msg_body(m), nng_msg_len(m), &r->frame, err, errlen);
    if (rc != TDM_OK) {
        tdm_net_msg_free(r);
        return rc;
    }
    *out = r;
    return TDM_OK;
}

void tdm_net_inbox_serve(struct tdm_net_inbox *in, const atomic_bool *stopping,
                         tdm_net_frame_handler handle, void *arg, const char *module)
{
    char err[256];
    while (!atomic_load(stopping)) {
        struct tdm_net_msg *msg = NULL;
        int rc = tdm_net_inbox_recv(in, 0.2, &msg, err, sizeof err);
        if (rc == TDM_ETIMEDOUT)
            continue;
        if (rc == TDM_ECLOSED)
            break;
        if (rc != TDM_OK) {
            TDM_LOG_WARN(module, "dropped a frame: %s", err);
            continue;
        }
        handle(arg, tdm_net_msg_frame(msg));
        tdm_net_msg_free(msg);
    }
}

const struct tdm_net_frame *tdm_net_msg_frame(const struct tdm_net_msg *m)
{
    return &m->frame;
}

void tdm_net_msg_free(struct tdm_net_msg *m)
{
    if (m == NULL)
        return;
    if (m->msg)
        nng_msg_free(m->msg);
    free(m);
}

// ---- outbox ----------------------------------------------------------------------------
// One PUSH socket dialing one peer URL. pipes counts live connections (nng pipe
// events), so "connected" needs no probe.
struct peer {
    struct peer *next;
    char *url;
    nng_socket sock;
    nng_dialer dialer;
    atomic_int pipes;
};

struct tdm_net_outbox {
    pthread_mutex_t mu;
    struct peer *head;
    int reconnect_ms;
};

int tdm_net_outbox_new(struct tdm_net_outbox **out, int reconnect_ms, char *err, size_t errlen)
{
    *out = calloc(1, sizeof **out);
    if (*out == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "outbox: out of memory");
    pthread_mutex_init(&(*out)->mu, NULL);
    (*out)->reconnect_ms = reconnect_ms > 0 ? reconnect_ms : 100;
    return TDM_OK;
}

void tdm_net_outbox_free(struct tdm_net_outbox *ob)
{
    if (ob == NULL)
        return;
    struct peer *p = ob->head;
    while (p) {
        struct peer *next = p->next;
        nng_close(p->sock);
        free(p->url);
        free(p);
        p = next;
    }
    pthread_mutex_destroy(&ob->mu);
    free(ob);
}

static void on_pipe(nng_pipe pipe, nng_pipe_ev ev, void *arg)
{
    (void)pipe;
    struct peer *p = arg;
    if (ev == NNG_PIPE_EV_ADD_POST)
        atomic_fetch_add(&p->pipes, 1);
    else if (ev == NNG_PIPE_EV_REM_POST)
        atomic_fetch_sub(&p->pipes, 1);
}

// The peer for url, created (and dialing) on first use. NULL with err on failure.
static struct peer *peer_get(struct tdm_net_outbox *ob, const char *url, int *code, char *err,
                             size_t errlen)
{
    pthread_mutex_lock(&ob->mu);
    for (struct peer *p = ob->head; p; p = p->next) {
        if (strcmp(p->url, url) == 0) {
            pthread_mutex_unlock(&ob->mu);
            return p;
        }
    }
    struct peer *p = calloc(1, sizeof *p);
    int rv = NNG_ENOMEM;
    if (p == NULL || (p->url = strdup(url)) == NULL)
        goto fail;
    rv = nng_push0_open(&p->sock);
    if (rv != 0)
        goto fail;
    // A send queue so that many request threads sending small frames to one
    // peer do not each wait for the pipe to finish the previous write (a
    // serialisation that added ~100 ms at 100 concurrent streams). Sends still
    // wait for a connected peer first (see tdm_net_send_fill), so a dead peer
    // fails fast instead of filling the queue.
    nng_socket_set_int(p->sock, NNG_OPT_SENDBUF, 256);
    nng_pipe_notify(p->sock, NNG_PIPE_EV_ADD_POST, on_pipe, p);
    nng_pipe_notify(p->sock, NNG_PIPE_EV_REM_POST, on_pipe, p);
    rv = nng_dialer_create(&p->dialer, p->sock, url);
    if (rv != 0)
        goto fail_sock;
    nng_dialer_set_ms(p->dialer, NNG_OPT_RECONNMINT, ob->reconnect_ms / 2 + 1);
    nng_dialer_set_ms(p->dialer, NNG_OPT_RECONNMAXT, ob->reconnect_ms);
    // Nonblocking: a peer that is down now is redialed in the background.
    rv = nng_dialer_start(p->dialer, NNG_FLAG_NONBLOCK);
    if (rv != 0)
        goto fail_sock;
    p->next = ob->head;
    ob->head = p;
    pthread_mutex_unlock(&ob->mu);
    return p;
fail_sock:
    nng_close(p->sock);
fail:
    pthread_mutex_unlock(&ob->mu);
    if (p)
        free(p->url);
    free(p);
    *code = rv == NNG_ENOMEM ? TDM_ENOMEM : TDM_EINVAL;
    tdm_seterr(err, errlen, *code, "outbox: cannot dial %s: %s", url, nng_strerror(rv));
    return NULL;
}

bool tdm_net_connected(struct tdm_net_outbox *ob, const char *url)
{
    pthread_mutex_lock(&ob->mu);
    bool up = false;
    for (struct peer *p = ob->head; p; p = p->next)
        if (strcmp(p->url, url) == 0)
            up = atomic_load(&p->pipes) > 0;
    pthread_mutex_unlock(&ob->mu);
    return up;
}

int tdm_net_send_fill(struct tdm_net_outbox *ob, const char *url, int type, const void *msg,
                      size_t msg_len, size_t payload_len, tdm_net_fill_fn fill, void *arg,
                      double timeout_s, char *err, size_t errlen)
{
    if (url == NULL || url[0] == '\0')
        return tdm_seterr(err, errlen, TDM_EINVAL, "send: no url");
    if (type < 1 || type > TDM_NET_TYPE_MAX)
        return tdm_seterr(err, errlen, TDM_EINVAL, "send: unknown type %d", type);
    size_t size = tdm_net_frame_size(msg_len, payload_len);
    if (size == 0)
        return tdm_seterr(err, errlen, TDM_EINVAL, "send: frame too large (%zu + %zu bytes)",
                          msg_len, payload_len);
    int code = TDM_OK;
    struct peer *p = peer_get(ob, url, &code, err, errlen);
    if (p == NULL)
        return code;
    nng_msg *m = NULL;
    int rv = nng_msg_alloc(&m, size);
    if (rv != 0)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "send: out of memory (%zu bytes)", size);
    uint8_t *body = nng_msg_body(m);
    tdm_net_frame_header(body, type, msg_len, payload_len);
    if (msg_len)
        memcpy(body + TDM_NET_HEADER_BYTES, msg, msg_len);
    if (fill && payload_len) {
        int frc = fill(arg, body + TDM_NET_HEADER_BYTES + msg_len, payload_len);
        if (frc != 0) {
            nng_msg_free(m);
            return tdm_seterr(err, errlen, frc, "send: payload fill failed: %s", tdm_strerror(frc));
        }
    }
    // Wait (bounded) for a connected peer: with a send queue nng would accept the
    // frame with nobody there.
    double until = tdm_now() + (timeout_s > 0 ? timeout_s : 0);
    while (atomic_load(&p->pipes) <= 0 && tdm_now() < until) {
        struct timespec ts = {0, 2 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (atomic_load(&p->pipes) <= 0) {
        rv = NNG_ETIMEDOUT;
    } else {
        // One aio per send: its timeout is per call (no shared socket option).
        nng_aio *aio = NULL;
        rv = nng_aio_alloc(&aio, NULL, NULL);
        if (rv == 0) {
            double left = until - tdm_now();
            nng_aio_set_msg(aio, m);
            nng_aio_set_timeout(aio, left > 0.001 ? ms_of(left) : 1);
            nng_send_aio(p->sock, aio);
            nng_aio_wait(aio);
            rv = nng_aio_result(aio);
            nng_aio_free(aio);
        }
    }
    if (rv != 0) {
        nng_msg_free(m); // a send takes the message only on success
        code = nng_to_tdm(rv);
        return tdm_seterr(err, errlen, code, "send %s to %s: %s", tdm_net_type_name(type), url,
                          rv == NNG_ETIMEDOUT || rv == NNG_EAGAIN ? "no connected peer"
                                                                  : nng_strerror(rv));
    }
    return TDM_OK;
}

struct copy_arg {
    const void *src;
};

static int copy_fill(void *arg, uint8_t *payload, size_t payload_len)
{
    memcpy(payload, ((struct copy_arg *)arg)->src, payload_len);
    return 0;
}

int tdm_net_send(struct tdm_net_outbox *ob, const char *url, int type, const void *msg,
                 size_t msg_len, const void *payload, size_t payload_len, double timeout_s,
                 char *err, size_t errlen)
{
    struct copy_arg a = {payload};
    return tdm_net_send_fill(ob, url, type, msg, msg_len, payload ? payload_len : 0,
                             payload ? copy_fill : NULL, &a, timeout_s, err, errlen);
}
