// SPDX-License-Identifier: Apache-2.0
// transport: frames and the inbox/outbox (see transport.h), on nng's byte
// streams (nng_stream: TCP, IPC) with Tandem's own frame header as the
// framing. The inbox is a stream listener with a reader thread per connection;
// the outbox keeps one connection per peer URL, redialed by a watcher thread.
// Nothing here remembers a peer beyond its URL: the peer's identity lives in the
// messages (instance ids), not in the connection.
//
// Why not nng's PUSH/PULL sockets: in nng 1.5.2 (Debian bookworm) a PUSH pipe
// that closes while it is being started (a peer restarting just as the dialer
// reconnects) stays on the socket's ready list after it is freed, and the next
// send crashes (nng issue #1653, fixed upstream after 1.5.2). The transport test hit
// it about once in 60 runs. With streams the connection lifecycle is ours.
#include "transport.h"

#include <arpa/inet.h>
#include <nng/nng.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
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

static nng_duration ms_until(double deadline)
{
    if (deadline < 0)
        return NNG_DURATION_INFINITE;
    double ms = (deadline - tdm_now()) * 1000.0;
    if (ms > 1e9)
        return 1000000000;
    return ms < 1 ? 1 : (nng_duration)ms;
}

// The absolute time seconds_from_now on clock (CLOCK_MONOTONIC for the
// condition variables below, which are created with it; CLOCK_REALTIME for
// pthread_mutex_timedlock).
static struct timespec clock_at(clockid_t clock, double seconds_from_now)
{
    struct timespec ts;
    clock_gettime(clock, &ts);
    if (seconds_from_now < 0)
        seconds_from_now = 0;
    if (seconds_from_now > 1e6)
        seconds_from_now = 1e6;
    time_t whole = (time_t)seconds_from_now;
    ts.tv_sec += whole;
    ts.tv_nsec += (long)((seconds_from_now - (double)whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec += 1;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

// Every nng operation below runs on an aio of its own, allocated for the call
// and freed before its stream, listener or dialer can be freed: in nng 1.5 a
// timeout that fires just as the operation completes calls the provider's
// cancel routine after the caller already saw the completion, and only
// nng_aio_free waits for that call to end (freeing the stream first is a use
// after free inside nng).
static int aio_finish_wait(nng_aio *aio)
{
    nng_aio_wait(aio);
    return nng_aio_result(aio);
}

// Moves at least min and at most max bytes through s (send or receive), looping
// over partial transfers, until deadline (tdm_now() time; < 0: none); *moved
// (may be NULL) says how many. A receive also ends (NNG_ECLOSED) soon after
// *stop is set: it waits in 0.2 s slices, because an operation started just
// after nng_stream_close may never complete in nng 1.5. A timed-out receive
// consumes nothing, so the slices lose no bytes.
// Every transfer runs on its own aio, freed before the call returns (so before
// the stream can be freed): in nng 1.5 a timeout that fires as an operation
// completes calls the provider's cancel after the caller resumed, and an aio
// kept across transfers (tried for the router's per-token cost) let that late
// cancel lock a freed stream's mutex: "panic: pthread_mutex_lock: Invalid
// argument" in transport_test under ASan. 0 or an nng error.
static int stream_xfer(nng_stream *s, bool send, void *buf, size_t min, size_t max,
                       double deadline, const atomic_bool *stop, size_t *moved)
{
    if (moved)
        *moved = 0;
    nng_aio *aio = NULL;
    int rv = nng_aio_alloc(&aio, NULL, NULL);
    if (rv != 0)
        return rv;
    uint8_t *p = buf;
    size_t done_all = 0;
    while (done_all < min) {
        if (stop && atomic_load(stop)) {
            rv = NNG_ECLOSED;
            break;
        }
        nng_iov iov = {.iov_buf = p, .iov_len = max - done_all};
        rv = nng_aio_set_iov(aio, 1, &iov);
        if (rv != 0)
            break;
        nng_duration t = ms_until(deadline);
        bool sliced = !send && stop && (t == NNG_DURATION_INFINITE || t > 200);
        nng_aio_set_timeout(aio, sliced ? 200 : t);
        if (send)
            nng_stream_send(s, aio);
        else
            nng_stream_recv(s, aio);
        rv = aio_finish_wait(aio);
        if (rv == NNG_ETIMEDOUT && sliced)
            continue;
        if (rv != 0)
            break;
        size_t done = nng_aio_count(aio);
        if (done == 0 || done > max - done_all) {
            rv = NNG_ECLOSED;
            break;
        }
        p += done;
        done_all += done;
    }
    nng_aio_free(aio);
    if (moved)
        *moved = done_all;
    return rv;
}

// Moves exactly n bytes (stream_xfer).
static int stream_io(nng_stream *s, bool send, void *buf, size_t n, double deadline,
                     const atomic_bool *stop)
{
    return stream_xfer(s, send, buf, n, n, deadline, stop, NULL);
}

// ---- authentication ------------------------------------------------------------------------
// With a shared secret (TANDEM_INTERNAL_SECRET_FILE or TANDEM_INTERNAL_SECRET,
// or tdm_net_set_secret), every connection starts with a mutual proof of the
// secret before any frame is read, so a peer without it can neither submit
// work nor receive any (issue 11: the nng ports served anyone). Version 2
// (issue 29: version 1 could be relayed):
//   hello     dialer -> listener: u32 0x41444d54, u16 2, u16 0, nonce_d[16],
//                                 id_d u64, target[20]                       (52 bytes)
//   challenge listener -> dialer: u32 0x41444d54, u16 2, u16 0, nonce_l[16],
//                                 id_l u64                                   (32 bytes)
//   proof     dialer -> listener: HMAC(K, "D" | hello | challenge)           (32 bytes)
//   confirm   listener -> dialer: HMAC(K, "L" | hello | challenge)           (32 bytes)
// target is the listener's endpoint as the dialer's socket reaches it (the
// peer address after DNS: family, port, IP); the listener refuses a hello
// whose target is not the local endpoint the connection arrived at, before it
// answers. The dialer proves first and the listener signs nothing until that
// proof checks, so no inbox is a signing oracle; each MAC covers both nonces
// (fresh per connection: no replay), both process ids, the endpoint and its
// role letter (direction: a MAC is never reflected). A relay (a process that
// took a dead worker's port and forwards a redialing peer's handshake to
// another inbox) fails: the other inbox sees a target that is not its own, and
// a rewritten target breaks the dialer's MAC. Peers must therefore reach an
// inbox at the address it receives on (no destination NAT between Tandem
// processes: the manifests dial pod IPs). Each step has a 2 s limit, so a
// silent connection costs one reader thread for 2 s at most. Traffic is not
// encrypted: keep the ports on the pod network behind the NetworkPolicy
// (deploy/k8s) or loopback. docs/pd-protocol.md has the protocol and the
// attack it prevents.
#define AUTH_MAGIC 0x41444d54u // "TDMA"
#define AUTH_VERSION 2
#define AUTH_STEP_S 2.0 // each step's limit, unless tdm_net_set_handshake_step (tests)
#define AUTH_MIN_KEY 16
#define AUTH_MAX_KEY 1024
#define AUTH_HELLO 52
#define AUTH_CHALLENGE 32
// Integers little-endian like the frames, except the endpoint's port and
// address, which are in network order as the socket gives them.
#define AUTH_EP 20 // an endpoint: family (4, 6 or 0), 0, port u16 (network order), address[16]

static pthread_mutex_t g_auth_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_auth_set; // set explicitly or loaded from the environment
static unsigned char g_auth_key[AUTH_MAX_KEY];
static size_t g_auth_len; // 0: no secret, connections are not authenticated
static atomic_int g_auth_step_ms = (int)(AUTH_STEP_S * 1000); // each step's limit

static double auth_step(void)
{
    return atomic_load(&g_auth_step_ms) / 1000.0;
}

void tdm_net_set_handshake_step(double step_s)
{
    if (!(step_s > 0)) // also NaN
        step_s = AUTH_STEP_S;
    atomic_store(&g_auth_step_ms, (int)((step_s < 3600 ? step_s : 3600) * 1000));
}

int tdm_net_set_secret(const void *key, size_t len, char *err, size_t errlen)
{
    if (len > 0 && (len < AUTH_MIN_KEY || len > AUTH_MAX_KEY))
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "internal secret: %zu bytes, must be %d to %d", len, AUTH_MIN_KEY,
                          AUTH_MAX_KEY);
    pthread_mutex_lock(&g_auth_mu);
    if (len)
        memcpy(g_auth_key, key, len);
    g_auth_len = len;
    g_auth_set = true;
    pthread_mutex_unlock(&g_auth_mu);
    return TDM_OK;
}

// The secret from the environment, once, unless tdm_net_set_secret came first.
static int auth_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&g_auth_mu);
    bool done = g_auth_set;
    pthread_mutex_unlock(&g_auth_mu);
    if (done)
        return TDM_OK;
    const char *file = getenv("TANDEM_INTERNAL_SECRET_FILE");
    const char *val = getenv("TANDEM_INTERNAL_SECRET");
    if (file && *file) {
        char *text = NULL;
        size_t len = 0;
        char ferr[200];
        if (tdm_read_file(file, &text, &len, ferr, sizeof ferr) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL, "TANDEM_INTERNAL_SECRET_FILE: %s", ferr);
        while (len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r'))
            len--; // a trailing newline (echo > file, kubectl create secret --from-file)
        int rc = tdm_net_set_secret(text, len ? len : 1, err, errlen);
        free(text);
        return rc == TDM_OK ? TDM_OK
                            : tdm_seterr(err, errlen, rc,
                                         "TANDEM_INTERNAL_SECRET_FILE %s: the secret must be %d to "
                                         "%d bytes",
                                         file, AUTH_MIN_KEY, AUTH_MAX_KEY);
    }
    if (val && *val) {
        if (tdm_net_set_secret(val, strlen(val), err, errlen) != TDM_OK)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_INTERNAL_SECRET: the secret must be %d to %d bytes",
                              AUTH_MIN_KEY, AUTH_MAX_KEY);
        return TDM_OK;
    }
    return tdm_net_set_secret(NULL, 0, err, errlen);
}

// A copy of the secret (the inbox/outbox keep it: later changes do not move it).
static size_t auth_key(unsigned char key[AUTH_MAX_KEY])
{
    pthread_mutex_lock(&g_auth_mu);
    size_t n = g_auth_len;
    memcpy(key, g_auth_key, n);
    pthread_mutex_unlock(&g_auth_mu);
    return n;
}

bool tdm_net_authenticated(void)
{
    if (auth_load(NULL, 0) != TDM_OK)
        return false;
    pthread_mutex_lock(&g_auth_mu);
    bool on = g_auth_len > 0;
    pthread_mutex_unlock(&g_auth_mu);
    return on;
}

static void auth_nonce(unsigned char n[16])
{
    if (getrandom(n, 16, 0) != 16) {
        for (int i = 0; i < 2; i++) {
            uint64_t x = tdm_net_new_instance_id();
            memcpy(n + 8 * i, &x, 8);
        }
    }
}

// MAC of the transcript: role letter, hello, challenge.
static void auth_mac(const unsigned char *key, size_t klen, char role,
                     const unsigned char hello[AUTH_HELLO],
                     const unsigned char challenge[AUTH_CHALLENGE], unsigned char out[32])
{
    unsigned char msg[1 + AUTH_HELLO + AUTH_CHALLENGE];
    msg[0] = (unsigned char)role;
    memcpy(msg + 1, hello, AUTH_HELLO);
    memcpy(msg + 1 + AUTH_HELLO, challenge, AUTH_CHALLENGE);
    tdm_hmac_sha256(key, klen, msg, sizeof msg, out);
}

// This process's id in handshakes (drawn once).
static uint64_t auth_self_id(void)
{
    static _Atomic uint64_t id;
    uint64_t v = atomic_load(&id);
    if (v == 0) {
        uint64_t mine = tdm_net_new_instance_id() | 1;
        if (atomic_compare_exchange_strong(&id, &v, mine))
            v = mine;
    }
    return v;
}

static void put_u64(uint8_t *p, uint64_t v)
{
    put_u32(p, (uint32_t)v);
    put_u32(p + 4, (uint32_t)(v >> 32));
}

// The stream's local (NNG_OPT_LOCADDR) or remote endpoint as 20 bytes; an
// IPv4-mapped IPv6 address is written as IPv4 (a dual-stack listener sees
// ::ffff:a.b.c.d where the dialer saw a.b.c.d). Non-IP streams: family 0.
static void auth_endpoint(nng_stream *s, const char *which, unsigned char ep[AUTH_EP])
{
    memset(ep, 0, AUTH_EP);
    nng_sockaddr sa;
    if (nng_stream_get_addr(s, which, &sa) != 0)
        return;
    static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    if (sa.s_family == NNG_AF_INET) {
        ep[0] = 4;
        memcpy(ep + 2, &sa.s_in.sa_port, 2); // network order, as stored
        memcpy(ep + 4, &sa.s_in.sa_addr, 4);
    } else if (sa.s_family == NNG_AF_INET6 && memcmp(sa.s_in6.sa_addr, mapped, 12) == 0) {
        ep[0] = 4;
        memcpy(ep + 2, &sa.s_in6.sa_port, 2);
        memcpy(ep + 4, sa.s_in6.sa_addr + 12, 4);
    } else if (sa.s_family == NNG_AF_INET6) {
        ep[0] = 6;
        memcpy(ep + 2, &sa.s_in6.sa_port, 2);
        memcpy(ep + 4, sa.s_in6.sa_addr, 16);
    }
}

// "a.b.c.d:port" or "[v6]:port" of an endpoint, for messages.
static void auth_ep_text(const unsigned char ep[AUTH_EP], char *out, size_t n)
{
    unsigned port = ((unsigned)ep[2] << 8) | ep[3];
    if (ep[0] == 4) {
        snprintf(out, n, "%u.%u.%u.%u:%u", ep[4], ep[5], ep[6], ep[7], port);
    } else if (ep[0] == 6) {
        size_t at = (size_t)snprintf(out, n, "[");
        for (int i = 0; i < 16 && at < n; i += 2)
            at += (size_t)snprintf(out + at, n - at, "%s%x", i ? ":" : "",
                                   ((unsigned)ep[4 + i] << 8) | ep[5 + i]);
        if (at < n)
            snprintf(out + at, n - at, "]:%u", port);
    } else {
        snprintf(out, n, "(not an IP endpoint)");
    }
}

static void auth_header(unsigned char *p)
{
    put_u32(p, AUTH_MAGIC);
    put_u16(p + 4, AUTH_VERSION);
    put_u16(p + 6, 0);
}

// Logs at most one refused or dropped connection a second (a scanner or a
// misconfigured peer redialing every 100 ms must not flood the log).
static void warn_limited(const char *fmt, const char *where, const char *why)
{
    static _Atomic long long last_ms;
    long long now = (long long)(tdm_now() * 1000.0);
    long long prev = atomic_load(&last_ms);
    if (now - prev >= 1000 && atomic_compare_exchange_strong(&last_ms, &prev, now))
        TDM_LOG_WARN(MOD, fmt, where, why);
}

// ---- endpoint aliases -----------------------------------------------------------------------
#define AUTH_MAX_ALIASES 16
static pthread_mutex_t g_alias_mu = PTHREAD_MUTEX_INITIALIZER;
static bool g_alias_set;
static unsigned char g_alias[AUTH_MAX_ALIASES][AUTH_EP];
static int g_n_alias;

// "a.b.c.d:port" or "[v6]:port" -> an endpoint; false when malformed.
static bool parse_endpoint(const char *s, size_t n, unsigned char ep[AUTH_EP])
{
    char host[64];
    const char *colon;
    memset(ep, 0, AUTH_EP);
    if (n >= 2 && s[0] == '[') {
        const char *close = memchr(s, ']', n);
        if (close == NULL || close + 1 >= s + n || close[1] != ':' ||
            (size_t)(close - s - 1) >= sizeof host)
            return false;
        memcpy(host, s + 1, (size_t)(close - s - 1));
        host[close - s - 1] = '\0';
        colon = close + 1;
    } else {
        colon = NULL;
        for (size_t i = 0; i < n; i++)
            if (s[i] == ':')
                colon = s + i;
        if (colon == NULL || (size_t)(colon - s) >= sizeof host)
            return false;
        memcpy(host, s, (size_t)(colon - s));
        host[colon - s] = '\0';
    }
    unsigned long port = 0;
    size_t digits = 0;
    for (const char *p = colon + 1; p < s + n; p++, digits++) {
        if (*p < '0' || *p > '9' || port > 65535)
            return false;
        port = port * 10 + (unsigned long)(*p - '0');
    }
    if (digits == 0 || port == 0 || port > 65535)
        return false;
    ep[2] = (unsigned char)(port >> 8);
    ep[3] = (unsigned char)port;
    unsigned char a[16];
    if (inet_pton(AF_INET, host, a) == 1) {
        ep[0] = 4;
        memcpy(ep + 4, a, 4);
    } else if (inet_pton(AF_INET6, host, a) == 1) {
        static const unsigned char mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        bool v4 = memcmp(a, mapped, 12) == 0;
        ep[0] = v4 ? 4 : 6;
        memcpy(ep + 4, v4 ? a + 12 : a, v4 ? 4 : 16);
    } else {
        return false;
    }
    return true;
}

int tdm_net_set_aliases(const char *list, char *err, size_t errlen)
{
    unsigned char eps[AUTH_MAX_ALIASES][AUTH_EP];
    int n = 0;
    for (const char *p = list ? list : ""; *p;) {
        while (*p == ',' || *p == ' ')
            p++;
        if (!*p)
            break;
        size_t len = strcspn(p, ", ");
        if (n == AUTH_MAX_ALIASES)
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_INTERNAL_ALIASES: more than %d endpoints", AUTH_MAX_ALIASES);
        if (!parse_endpoint(p, len, eps[n]))
            return tdm_seterr(err, errlen, TDM_EINVAL,
                              "TANDEM_INTERNAL_ALIASES: '%.*s' is not IP:port or [IPv6]:port",
                              (int)(len > 80 ? 80 : len), p);
        n++;
        p += len;
    }
    pthread_mutex_lock(&g_alias_mu);
    memcpy(g_alias, eps, sizeof(eps[0]) * (size_t)n);
    g_n_alias = n;
    g_alias_set = true;
    pthread_mutex_unlock(&g_alias_mu);
    return TDM_OK;
}

// TANDEM_INTERNAL_ALIASES, once, unless tdm_net_set_aliases came first.
static int alias_load(char *err, size_t errlen)
{
    pthread_mutex_lock(&g_alias_mu);
    bool done = g_alias_set;
    pthread_mutex_unlock(&g_alias_mu);
    return done ? TDM_OK : tdm_net_set_aliases(getenv("TANDEM_INTERNAL_ALIASES"), err, errlen);
}

// True when ep is one of the aliases.
static bool alias_match(const unsigned char ep[AUTH_EP])
{
    bool hit = false;
    pthread_mutex_lock(&g_alias_mu);
    for (int i = 0; i < g_n_alias && !hit; i++)
        hit = memcmp(g_alias[i], ep, AUTH_EP) == 0;
    pthread_mutex_unlock(&g_alias_mu);
    return hit;
}

// The dialer's side. 0, or nonzero with why set.
static int auth_dialer(nng_stream *s, const unsigned char *key, size_t klen, char *why,
                       size_t wl)
{
    unsigned char hello[AUTH_HELLO], challenge[AUTH_CHALLENGE], mac[32], confirm[32];
    auth_header(hello);
    auth_nonce(hello + 8);
    put_u64(hello + 24, auth_self_id());
    auth_endpoint(s, NNG_OPT_REMADDR, hello + 32);
    if (stream_io(s, true, hello, sizeof hello, tdm_now() + auth_step(), NULL) != 0 ||
        stream_io(s, false, challenge, sizeof challenge, tdm_now() + auth_step(), NULL) != 0) {
        snprintf(why, wl,
                 "no handshake answer (does the peer have the same "
                 "TANDEM_INTERNAL_SECRET and version? does it receive on the "
                 "address dialed, with no NAT between?)");
        return -1;
    }
    if (get_u32(challenge) != AUTH_MAGIC || get_u16(challenge + 4) != AUTH_VERSION) {
        snprintf(why, wl,
                 "the peer answered no handshake of version %d (it runs without a "
                 "secret, or an older Tandem?)",
                 AUTH_VERSION);
        return -1;
    }
    auth_mac(key, klen, 'D', hello, challenge, mac);
    if (stream_io(s, true, mac, sizeof mac, tdm_now() + auth_step(), NULL) != 0 ||
        stream_io(s, false, confirm, sizeof confirm, tdm_now() + auth_step(), NULL) != 0) {
        snprintf(why, wl, "the peer refused the proof (a different TANDEM_INTERNAL_SECRET)");
        return -1;
    }
    auth_mac(key, klen, 'L', hello, challenge, mac);
    if (!tdm_ct_equal(mac, confirm, 32)) {
        snprintf(why, wl, "the peer's proof is wrong (a different TANDEM_INTERNAL_SECRET)");
        return -1;
    }
    return 0;
}

// The listener's side. 0, or nonzero with why set.
static int auth_listener(nng_stream *s, const unsigned char *key, size_t klen,
                         const atomic_bool *stop, char *why, size_t wl)
{
    unsigned char hello[AUTH_HELLO], challenge[AUTH_CHALLENGE], mac[32], proof[32];
    unsigned char self[AUTH_EP];
    int rv = stream_io(s, false, hello, 8, tdm_now() + auth_step(), stop);
    if (rv == NNG_ECLOSED || rv == NNG_ECONNRESET || rv == NNG_ECONNSHUT) {
        snprintf(why, wl, "closed before the handshake");
        return -2; // a port probe (a readiness check's connect and close): not worth a warning
    }
    if (rv != 0) {
        snprintf(why, wl, "no handshake within %.0f s", auth_step());
        return -1;
    }
    if (get_u32(hello) != AUTH_MAGIC) {
        snprintf(why, wl, "no handshake (magic 0x%08x): an unauthenticated peer or a peer "
                          "without TANDEM_INTERNAL_SECRET",
                 get_u32(hello));
        return -1;
    }
    if (get_u16(hello + 4) != AUTH_VERSION) {
        snprintf(why, wl, "handshake version %u, this process speaks %d (an older Tandem?)",
                 get_u16(hello + 4), AUTH_VERSION);
        return -1;
    }
    if (stream_io(s, false, hello + 8, sizeof hello - 8, tdm_now() + auth_step(), stop) != 0) {
        snprintf(why, wl, "no handshake within %.0f s", auth_step());
        return -1;
    }
    // Bound to this endpoint before anything is signed or even answered.
    auth_endpoint(s, NNG_OPT_LOCADDR, self);
    if (memcmp(self, hello + 32, AUTH_EP) != 0 && !alias_match(hello + 32)) {
        char dialed[48], here[48]; // "[8 groups]:port" fits
        auth_ep_text(hello + 32, dialed, sizeof dialed);
        auth_ep_text(self, here, sizeof here);
        snprintf(why, wl, "dialed %s, arrived at %s: a relay, or NAT between peers", dialed, here);
        return -1;
    }
    auth_header(challenge);
    auth_nonce(challenge + 8);
    put_u64(challenge + 24, auth_self_id());
    if (stream_io(s, true, challenge, sizeof challenge, tdm_now() + auth_step(), NULL) != 0 ||
        stream_io(s, false, proof, sizeof proof, tdm_now() + auth_step(), stop) != 0) {
        snprintf(why, wl, "the peer gave no proof (a different secret, or not a Tandem peer)");
        return -1;
    }
    auth_mac(key, klen, 'D', hello, challenge, mac);
    if (!tdm_ct_equal(mac, proof, 32)) {
        snprintf(why, wl, "the peer's proof is wrong (a different TANDEM_INTERNAL_SECRET)");
        return -1;
    }
    auth_mac(key, klen, 'L', hello, challenge, mac);
    if (stream_io(s, true, mac, sizeof mac, tdm_now() + auth_step(), NULL) != 0) {
        snprintf(why, wl, "the connection closed during the handshake");
        return -1;
    }
    return 0;
}

// ---- inbox -----------------------------------------------------------------------------
// A stream listener; one acceptor thread; one reader thread per connection that
// reads whole frames into a bounded queue (a full queue stops the readers, so a
// slow consumer pushes back on senders through TCP instead of growing memory).
#define INBOX_QUEUE_FRAMES 4096
#define INBOX_QUEUE_BYTES ((size_t)512 << 20)
#define INBOX_PRIORITY_FRAMES 64 // liveness frames queued ahead of the rest at most

struct tdm_net_msg {
    struct tdm_net_msg *next;
    uint8_t *buf; // the whole frame, header included
    size_t len;
    bool prio; // queued ahead of the data frames (a liveness frame)
    struct tdm_net_frame frame;
};

// A connection's frames are cut out of bytes received in pieces as large as
// the socket has ready (up to READ_BUF_BYTES): a burst of small frames (a
// router's TokenChunks at 100 streams, a worker's requests) costs one receive
// (one aio, one readv) instead of two per frame, header and body. A frame
// larger than the buffer (KV payloads) takes what the buffer holds and reads
// the rest straight into its own memory.
#define READ_BUF_BYTES 65536

struct rbuf {
    uint8_t *b; // [READ_BUF_BYTES]
    size_t start, end; // unread bytes are b[start, end)
};

struct in_conn {
    struct in_conn *next;
    struct tdm_net_inbox *in;
    nng_stream *s;
    struct rbuf rb;
};

struct tdm_net_inbox {
    nng_stream_listener *listener;
    pthread_t acceptor;
    atomic_bool closing; // close() has begun (idempotence)
    pthread_mutex_t mu;
    pthread_cond_t cv; // queue or reader count changed
    bool closed;       // under mu: readers and recv stop
    struct tdm_net_msg *head, *tail;
    struct tdm_net_msg *ptail; // the last queued liveness frame (they sit at the front), or NULL
    size_t pqueued;            // liveness frames queued
    size_t queued, queued_bytes;
    struct in_conn *conns;
    int readers;
    int max_conns; // under mu: connections (readers) open at once at most
    tdm_net_frame_handler direct; // under mu: frames go to it on their reader (not queued)
    void *direct_arg;
    char url[256]; // the URL peers dial (bound port filled in)
    unsigned char key[AUTH_MAX_KEY]; // the shared secret at creation
    size_t key_len;                  // 0: connections are not authenticated
};

static void msg_free(struct tdm_net_msg *m)
{
    if (m == NULL)
        return;
    free(m->buf);
    free(m);
}

// Reads one frame. NULL at end of stream or on error; *why set for a frame
// that is malformed (then the connection must be dropped: it is out of step).
// Makes at least need (<= READ_BUF_BYTES) unread bytes available in r,
// receiving as many more as are ready. 0 or an nng error.
static int rbuf_fill(nng_stream *s, struct rbuf *r, size_t need, const atomic_bool *stop)
{
    size_t have = r->end - r->start;
    if (have >= need)
        return 0;
    if (r->start > 0) {
        memmove(r->b, r->b + r->start, have);
        r->start = 0;
        r->end = have;
    }
    size_t got = 0;
    int rv = stream_xfer(s, false, r->b + r->end, need - have, READ_BUF_BYTES - r->end, -1, stop,
                         &got);
    r->end += got;
    return rv;
}

static struct tdm_net_msg *read_frame(nng_stream *s, struct rbuf *rb, const atomic_bool *stop,
                                      char *why, size_t whylen)
{
    if (rbuf_fill(s, rb, TDM_NET_HEADER_BYTES, stop) != 0)
        return NULL;
    const uint8_t *hdr = rb->b + rb->start;
    uint32_t magic = get_u32(hdr);
    uint64_t msg_len = get_u32(hdr + 8), payload_len = get_u32(hdr + 12);
    uint64_t total = TDM_NET_HEADER_BYTES + msg_len + payload_len;
    if (magic == AUTH_MAGIC) {
        snprintf(why, whylen, "the peer sent an authentication handshake, but this process has "
                              "no TANDEM_INTERNAL_SECRET");
        return NULL;
    }
    if (magic != TDM_NET_MAGIC) {
        snprintf(why, whylen, "bad magic 0x%08x (not a Tandem peer)", magic);
        return NULL;
    }
    if (total > TDM_NET_MAX_FRAME) {
        snprintf(why, whylen, "frame of %llu bytes exceeds the %u-byte limit",
                 (unsigned long long)total, TDM_NET_MAX_FRAME);
        return NULL;
    }
    struct tdm_net_msg *m = calloc(1, sizeof *m);
    if (m == NULL || (m->buf = malloc((size_t)total)) == NULL) {
        snprintf(why, whylen, "out of memory for a %llu-byte frame", (unsigned long long)total);
        free(m);
        return NULL;
    }
    m->len = (size_t)total;
    // A frame that fits the buffer is completed there (reading ahead into
    // the next ones); a larger one takes what is buffered, then the rest
    // straight into its memory.
    int rv = m->len <= READ_BUF_BYTES ? rbuf_fill(s, rb, m->len, stop) : 0;
    size_t take = rb->end - rb->start < m->len ? rb->end - rb->start : m->len;
    if (rv == 0) {
        memcpy(m->buf, rb->b + rb->start, take);
        rb->start += take;
        if (take < m->len)
            rv = stream_io(s, false, m->buf + take, m->len - take, -1, stop);
    }
    if (rv != 0) {
        msg_free(m);
        return NULL;
    }
    char err[200];
    if (tdm_net_frame_parse(m->buf, m->len, &m->frame, err, sizeof err) != TDM_OK) {
        snprintf(why, whylen, "%s", err);
        msg_free(m);
        return NULL;
    }
    return m;
}

static void *inbox_reader(void *arg)
{
    struct in_conn *c = arg;
    struct tdm_net_inbox *in = c->in;
    char awhy[200];
    int arv = in->key_len ? auth_listener(c->s, in->key, in->key_len, &in->closing, awhy,
                                          sizeof awhy)
                          : 0;
    if (arv == -1) {
        warn_limited("inbox %s: refused a connection: %s", in->url, awhy);
    } else if (arv != 0) {
        TDM_LOG_DEBUG(MOD, "inbox %s: %s", in->url, awhy);
    } else if ((c->rb.b = malloc(READ_BUF_BYTES)) == NULL) {
        warn_limited("inbox %s: dropped a connection: %s", in->url,
                     "out of memory for its read buffer");
    } else {
        for (;;) {
            char why[256] = "";
            struct tdm_net_msg *m = read_frame(c->s, &c->rb, &in->closing, why, sizeof why);
            if (m == NULL) {
                if (why[0])
                    warn_limited("inbox %s: dropped a connection: %s", in->url, why);
                break;
            }
            // Liveness frames (LoadQuery, LoadReport) go ahead of the data
            // frames, in their own order, and do not wait for room: a worker
            // busy with a backlog of requests or a router with one of tokens
            // still answers and hears liveness within its deadline (busy is
            // not dead, issue 11). A few only: beyond INBOX_PRIORITY_FRAMES
            // they queue like the rest.
            bool prio = (m->frame.type == TDM_NET_LOAD_QUERY ||
                         m->frame.type == TDM_NET_LOAD_REPORT);
            pthread_mutex_lock(&in->mu);
            if (prio && in->pqueued >= INBOX_PRIORITY_FRAMES)
                prio = false;
            while (!prio && !in->closed && in->queued > 0 &&
                   (in->queued >= INBOX_QUEUE_FRAMES ||
                    in->queued_bytes + m->len > INBOX_QUEUE_BYTES))
                pthread_cond_wait(&in->cv, &in->mu);
            if (in->closed) {
                pthread_mutex_unlock(&in->mu);
                msg_free(m);
                break;
            }
            // Handled right here when the owner asked so (no queue, no hand-off
            // to the thread that serves the inbox); a slow handler holds this
            // connection's reads, which pushes back on its sender through TCP.
            if (in->direct) {
                tdm_net_frame_handler direct = in->direct;
                void *direct_arg = in->direct_arg;
                pthread_mutex_unlock(&in->mu);
                direct(direct_arg, &m->frame);
                msg_free(m);
                continue;
            }
            if (prio) {
                struct tdm_net_msg **at = in->ptail ? &in->ptail->next : &in->head;
                m->next = *at;
                *at = m;
                if (in->tail == NULL || in->tail == in->ptail)
                    in->tail = m;
                in->ptail = m;
                in->pqueued++;
                m->prio = true;
            } else if (in->tail) {
                in->tail->next = m;
                in->tail = m;
            } else {
                in->head = m;
                in->tail = m;
            }
            in->queued++;
            in->queued_bytes += m->len;
            pthread_cond_broadcast(&in->cv);
            pthread_mutex_unlock(&in->mu);
        }
    }
    pthread_mutex_lock(&in->mu);
    for (struct in_conn **pp = &in->conns; *pp; pp = &(*pp)->next) {
        if (*pp == c) {
            *pp = c->next;
            break;
        }
    }
    in->readers--;
    pthread_cond_broadcast(&in->cv);
    pthread_mutex_unlock(&in->mu);
    nng_stream_close(c->s);
    nng_stream_free(c->s);
    free(c->rb.b);
    free(c);
    return NULL;
}

static void *inbox_acceptor(void *arg)
{
    struct tdm_net_inbox *in = arg;
    while (!atomic_load(&in->closing)) {
        nng_aio *aio = NULL;
        if (nng_aio_alloc(&aio, NULL, NULL) != 0) {
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        nng_aio_set_timeout(aio, 200); // slices, so closing is seen (see stream_io)
        nng_stream_listener_accept(in->listener, aio);
        int rv = aio_finish_wait(aio);
        nng_stream *s = rv == 0 ? nng_aio_get_output(aio, 0) : NULL;
        nng_aio_free(aio);
        if (rv == NNG_ETIMEDOUT)
            continue;
        if (rv == NNG_ECLOSED || rv == NNG_ECANCELED)
            break;
        if (rv != 0) { // e.g. out of file descriptors: wait a little, keep serving
            TDM_LOG_WARN(MOD, "inbox %s: accept: %s", in->url, nng_strerror(rv));
            struct timespec ts = {0, 50 * 1000 * 1000};
            nanosleep(&ts, NULL);
            continue;
        }
        struct in_conn *c = calloc(1, sizeof *c);
        if (c == NULL) {
            nng_stream_free(s);
            continue;
        }
        c->in = in;
        c->s = s;
        pthread_mutex_lock(&in->mu);
        if (in->closed) {
            pthread_mutex_unlock(&in->mu);
            nng_stream_free(s);
            free(c);
            break;
        }
        if (in->readers >= in->max_conns) {
            // A flood of connections (a scanner, a peer in a reconnect loop, a
            // hostile host) would otherwise cost a thread each, without bound.
            int open = in->readers;
            pthread_mutex_unlock(&in->mu);
            nng_stream_close(s);
            nng_stream_free(s);
            free(c);
            char why[64];
            snprintf(why, sizeof why, "%d connections are open (the limit)", open);
            warn_limited("inbox %s: refused a connection: %s", in->url, why);
            continue;
        }
        c->next = in->conns;
        in->conns = c;
        in->readers++;
        if (tdm_thread_start_detached(inbox_reader, c) != TDM_OK) {
            in->conns = c->next;
            in->readers--;
            pthread_mutex_unlock(&in->mu);
            TDM_LOG_WARN(MOD, "inbox %s: cannot start a reader thread", in->url);
            nng_stream_free(s);
            free(c);
            continue;
        }
        pthread_mutex_unlock(&in->mu);
    }
    return NULL;
}

int tdm_net_inbox_new(struct tdm_net_inbox **out, const char *url, char *err, size_t errlen)
{
    *out = NULL;
    if (url == NULL || strlen(url) >= 200)
        return tdm_seterr(err, errlen, TDM_EINVAL, "inbox: bad url");
    int arc = auth_load(err, errlen);
    if (arc == TDM_OK)
        arc = alias_load(err, errlen);
    if (arc != TDM_OK)
        return arc;
    struct tdm_net_inbox *in = calloc(1, sizeof *in);
    if (in == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "inbox: out of memory");
    in->key_len = auth_key(in->key);
    in->max_conns = TDM_NET_INBOX_MAX_CONNS;
    // Each connection is a descriptor: a flood must not take the ones the
    // HTTP server, the model files and the outbox need (a shell's 1024 limit).
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY &&
        rl.rlim_cur / 4 < (rlim_t)in->max_conns)
        in->max_conns = rl.rlim_cur / 4 < 16 ? 16 : (int)(rl.rlim_cur / 4);
    int rv = nng_stream_listener_alloc(&in->listener, url);
    if (rv == 0)
        rv = nng_stream_listener_listen(in->listener);
    if (rv != 0) {
        nng_stream_listener_free(in->listener);
        free(in);
        // Both roles set their inbox with --nng-url: a port in use names it
        // (issue 28, item 6).
        return tdm_seterr(err, errlen, TDM_ETRANSPORT, "inbox: cannot listen on %s: %s%s", url,
                          rv == NNG_EADDRINUSE ? "Address already in use" : nng_strerror(rv),
                          rv == NNG_EADDRINUSE ? " (choose another port with --nng-url)" : "");
    }
    snprintf(in->url, sizeof in->url, "%s", url);
    size_t n = strlen(url);
    if (strncmp(url, "tcp://", 6) == 0 && n >= 2 && strcmp(url + n - 2, ":0") == 0) {
        int port = 0;
        if (nng_stream_listener_get_int(in->listener, NNG_OPT_TCP_BOUND_PORT, &port) == 0)
            snprintf(in->url, sizeof in->url, "%.*s:%d", (int)(n - 2), url, port);
    }
    pthread_mutex_init(&in->mu, NULL);
    tdm_cond_init(&in->cv);
    if (pthread_create(&in->acceptor, NULL, inbox_acceptor, in) != 0) {
        nng_stream_listener_free(in->listener);
        pthread_cond_destroy(&in->cv);
        pthread_mutex_destroy(&in->mu);
        free(in);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "inbox: cannot start the acceptor thread");
    }
    if (in->key_len == 0)
        TDM_LOG_WARN(MOD,
                     "inbox %s: no TANDEM_INTERNAL_SECRET: any process that reaches this port "
                     "(any local process, at least) can submit work and receive results; set "
                     "TANDEM_INTERNAL_SECRET_FILE (tandem up and the manifests do)",
                     in->url);
    *out = in;
    return TDM_OK;
}

void tdm_net_inbox_close(struct tdm_net_inbox *in)
{
    if (in == NULL || atomic_exchange(&in->closing, true))
        return;
    nng_stream_listener_close(in->listener); // the acceptor's accept fails: it returns
    pthread_join(in->acceptor, NULL);
    pthread_mutex_lock(&in->mu);
    in->closed = true;
    for (struct in_conn *c = in->conns; c; c = c->next)
        nng_stream_close(c->s); // its reader's receive fails: it unlinks and frees c
    pthread_cond_broadcast(&in->cv);
    while (in->readers > 0)
        pthread_cond_wait(&in->cv, &in->mu);
    pthread_mutex_unlock(&in->mu);
}

void tdm_net_inbox_free(struct tdm_net_inbox *in)
{
    if (in == NULL)
        return;
    tdm_net_inbox_close(in);
    while (in->head) {
        struct tdm_net_msg *m = in->head;
        in->head = m->next;
        msg_free(m);
    }
    nng_stream_listener_free(in->listener);
    pthread_cond_destroy(&in->cv);
    pthread_mutex_destroy(&in->mu);
    free(in);
}

void tdm_net_inbox_set_max_conns(struct tdm_net_inbox *in, int n)
{
    pthread_mutex_lock(&in->mu);
    in->max_conns = n > 0 ? n : 1;
    pthread_mutex_unlock(&in->mu);
}

int tdm_net_inbox_conns(struct tdm_net_inbox *in)
{
    pthread_mutex_lock(&in->mu);
    int n = in->readers;
    pthread_mutex_unlock(&in->mu);
    return n;
}

size_t tdm_net_inbox_queued(struct tdm_net_inbox *in)
{
    pthread_mutex_lock(&in->mu);
    size_t n = in->queued;
    pthread_mutex_unlock(&in->mu);
    return n;
}

const char *tdm_net_inbox_url(const struct tdm_net_inbox *in)
{
    return in->url;
}

int tdm_net_inbox_recv(struct tdm_net_inbox *in, double timeout_s, struct tdm_net_msg **out,
                       char *err, size_t errlen)
{
    *out = NULL;
    struct timespec until = clock_at(CLOCK_MONOTONIC, timeout_s);
    pthread_mutex_lock(&in->mu);
    while (!in->closed && in->head == NULL && timeout_s != 0) {
        if (timeout_s < 0)
            pthread_cond_wait(&in->cv, &in->mu);
        else if (pthread_cond_timedwait(&in->cv, &in->mu, &until) != 0)
            break;
    }
    if (in->closed) {
        pthread_mutex_unlock(&in->mu);
        return tdm_seterr(err, errlen, TDM_ECLOSED, "inbox: closed");
    }
    struct tdm_net_msg *m = in->head;
    if (m == NULL) {
        pthread_mutex_unlock(&in->mu);
        return tdm_seterr(err, errlen, TDM_ETIMEDOUT, "inbox: recv: timed out");
    }
    in->head = m->next;
    if (in->head == NULL)
        in->tail = NULL;
    if (m == in->ptail)
        in->ptail = NULL;
    if (m->prio)
        in->pqueued--;
    in->queued--;
    in->queued_bytes -= m->len;
    m->next = NULL;
    pthread_cond_broadcast(&in->cv); // room for a waiting reader
    pthread_mutex_unlock(&in->mu);
    *out = m;
    return TDM_OK;
}

void tdm_net_inbox_handle_on_readers(struct tdm_net_inbox *in, tdm_net_frame_handler handle,
                                     void *arg)
{
    pthread_mutex_lock(&in->mu);
    in->direct = handle;
    in->direct_arg = arg;
    // Frames queued before now are handled here, in their order.
    struct tdm_net_msg *queued = in->head;
    in->head = in->tail = in->ptail = NULL;
    in->queued = in->pqueued = in->queued_bytes = 0;
    pthread_cond_broadcast(&in->cv); // readers waiting for room go on
    pthread_mutex_unlock(&in->mu);
    while (queued) {
        struct tdm_net_msg *next = queued->next;
        handle(arg, &queued->frame);
        msg_free(queued);
        queued = next;
    }
}

const struct tdm_net_frame *tdm_net_msg_frame(const struct tdm_net_msg *m)
{
    return &m->frame;
}

void tdm_net_msg_free(struct tdm_net_msg *m)
{
    msg_free(m);
}

// ---- outbox ----------------------------------------------------------------------------
// One stream dialer per peer URL and a watcher thread that keeps one connection
// up: it dials (bounded), publishes the connection, then waits on a receive that
// only ends when the connection does (an inbox never writes back), unpublishes
// it and redials. Writers take send_mu for a whole frame, so frames never
// interleave; the watcher frees a connection only while holding send_mu, so a
// writer's connection stays valid while it writes. A peer that takes no byte
// of a frame in time leaves its connection as it is (nothing of the frame went
// out: the writer says busy); a write that fails, or stops with part of its
// frame out, closes the connection (the peer's reader drops the partial frame
// with it), unless the outbox's stall limit lets the frame finish.
struct peer {
    struct peer *next;
    char *url;
    int reconnect_ms;
    nng_stream_dialer *dialer;
    pthread_t watcher;
    pthread_mutex_t mu; // s, stopping
    pthread_cond_t cv;  // s or stopping changed
    nng_stream *s; // the live connection; NULL while down
    bool stopping;
    atomic_bool drop; // the current connection is finished (a writer failed on it, or
                      // stopping): ends the watcher's receive (stream_io's stop)
    pthread_mutex_t send_mu;
    // Under send_mu (writers only): since when stuck_conn has taken no byte
    // while a frame waited for it (0: it took the last bytes offered).
    double stuck_since;
    nng_stream *stuck_conn;
    const unsigned char *key; // the outbox's secret (key_len 0: no handshake)
    size_t key_len;
    int users;        // under the outbox's mu: sends using this peer now
    double last_used; // under the outbox's mu: tdm_now() when the last send ended
    // Under mu: dials in a row that reached the peer and failed its handshake
    // (a dial that does not connect, or a handshake that passes, resets it),
    // and the last such failure's reason (tdm_net_link_state).
    int auth_fails;
    char auth_why[200];
    bool dialed; // a dial has finished (connected or not)
};

struct tdm_net_outbox {
    pthread_mutex_t mu;
    struct peer *head;
    int reconnect_ms;
    unsigned char key[AUTH_MAX_KEY]; // the shared secret at creation
    size_t key_len;
    int n_peers;    // under mu
    int max_peers;  // more distinct URLs evict the least recently used idle peer
    double idle_s;  // a peer unused this long is closed (its watcher stops redialing)
    _Atomic double stall_s; // a connection taking no byte this long while frames wait is
                            // dropped; a partly written frame waits for it (0: no limit,
                            // such a frame is cut at its deadline)
};

int tdm_net_outbox_new(struct tdm_net_outbox **out, int reconnect_ms, char *err, size_t errlen)
{
    *out = NULL;
    int arc = auth_load(err, errlen);
    if (arc != TDM_OK)
        return arc;
    *out = calloc(1, sizeof **out);
    if (*out == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "outbox: out of memory");
    (*out)->key_len = auth_key((*out)->key);
    (*out)->max_peers = TDM_NET_MAX_PEERS;
    (*out)->idle_s = TDM_NET_PEER_IDLE_S;
    atomic_init(&(*out)->stall_s, 0.0);
    pthread_mutex_init(&(*out)->mu, NULL);
    (*out)->reconnect_ms = reconnect_ms > 0 ? reconnect_ms : 100;
    return TDM_OK;
}

// Sleeps up to ms unless the peer is stopping. True when stopping.
static bool peer_nap(struct peer *p, int ms)
{
    struct timespec until = clock_at(CLOCK_MONOTONIC, ms / 1000.0);
    pthread_mutex_lock(&p->mu);
    while (!p->stopping && pthread_cond_timedwait(&p->cv, &p->mu, &until) == 0) {
    }
    bool stop = p->stopping;
    pthread_mutex_unlock(&p->mu);
    return stop;
}

static void *peer_watcher(void *arg)
{
    struct peer *p = arg;
    // A dial may take up to 2 s (an address that drops SYNs would otherwise hold
    // the watcher for the kernel's connect timeout).
    int dial_ms = p->reconnect_ms * 20 < 2000 ? 2000 : p->reconnect_ms * 20;
    int backoff = p->reconnect_ms / 2 + 1;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        bool stop = p->stopping;
        pthread_mutex_unlock(&p->mu);
        if (stop)
            break;
        nng_aio *aio = NULL;
        int rv = nng_aio_alloc(&aio, NULL, NULL);
        nng_stream *s = NULL;
        if (rv == 0) {
            nng_aio_set_timeout(aio, dial_ms);
            nng_stream_dialer_dial(p->dialer, aio);
            rv = aio_finish_wait(aio);
            if (rv == 0)
                s = nng_aio_get_output(aio, 0);
            nng_aio_free(aio);
        }
        if (rv != 0) {
            pthread_mutex_lock(&p->mu);
            p->dialed = true;
            p->auth_fails = 0; // not reachable: down, which says nothing about the secret
            pthread_mutex_unlock(&p->mu);
            if (peer_nap(p, backoff))
                break;
            backoff = backoff * 2 > p->reconnect_ms ? p->reconnect_ms : backoff * 2;
            continue;
        }
        nng_stream_set_bool(s, NNG_OPT_TCP_NODELAY, true);
        nng_stream_set_bool(s, NNG_OPT_TCP_KEEPALIVE, true);
        char awhy[200];
        if (p->key_len && auth_dialer(s, p->key, p->key_len, awhy, sizeof awhy) != 0) {
            warn_limited("outbox: %s refused: %s", p->url, awhy);
            pthread_mutex_lock(&p->mu);
            p->dialed = true;
            p->auth_fails++;
            snprintf(p->auth_why, sizeof p->auth_why, "%s", awhy);
            pthread_mutex_unlock(&p->mu);
            nng_stream_close(s);
            nng_stream_free(s);
            if (peer_nap(p, backoff))
                break;
            backoff = backoff * 2 > p->reconnect_ms ? p->reconnect_ms : backoff * 2;
            continue;
        }
        backoff = p->reconnect_ms / 2 + 1;
        pthread_mutex_lock(&p->mu);
        if (p->stopping) {
            pthread_mutex_unlock(&p->mu);
            nng_stream_free(s);
            break;
        }
        p->s = s;
        p->dialed = true;
        p->auth_fails = 0;
        atomic_store(&p->drop, false);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);

        // Ends only when the connection does (or the peer talks, which an inbox
        // never does: either way the connection is finished).
        uint8_t byte;
        stream_io(s, false, &byte, 1, -1, &p->drop);

        pthread_mutex_lock(&p->mu);
        p->s = NULL;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        nng_stream_close(s); // a writer blocked on it returns now
        pthread_mutex_lock(&p->send_mu);
        pthread_mutex_unlock(&p->send_mu);
        nng_stream_free(s);
    }
    return NULL;
}

static void peer_free(struct peer *p)
{
    pthread_mutex_lock(&p->mu);
    p->stopping = true;
    atomic_store(&p->drop, true);
    if (p->s)
        nng_stream_close(p->s);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    nng_stream_dialer_close(p->dialer); // a pending dial fails now
    pthread_join(p->watcher, NULL);
    nng_stream_dialer_free(p->dialer);
    pthread_mutex_destroy(&p->send_mu);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->url);
    free(p);
}

void tdm_net_outbox_free(struct tdm_net_outbox *ob)
{
    if (ob == NULL)
        return;
    struct peer *p = ob->head;
    while (p) {
        struct peer *next = p->next;
        peer_free(p);
        p = next;
    }
    pthread_mutex_destroy(&ob->mu);
    free(ob);
}

// Unlinks idle peers (under ob->mu): every peer unused for idle_s, then, while
// the outbox is full, the least recently used one nobody is sending on. The
// caller frees the returned list outside the lock (freeing joins a watcher).
static struct peer *peers_evict(struct tdm_net_outbox *ob, double now)
{
    struct peer *freed = NULL;
    for (struct peer **pp = &ob->head; *pp;) {
        struct peer *p = *pp;
        if (p->users == 0 && now - p->last_used > ob->idle_s) {
            *pp = p->next;
            p->next = freed;
            freed = p;
            ob->n_peers--;
        } else {
            pp = &p->next;
        }
    }
    while (ob->n_peers >= ob->max_peers) {
        struct peer **lru = NULL;
        for (struct peer **pp = &ob->head; *pp; pp = &(*pp)->next)
            if ((*pp)->users == 0 && (!lru || (*pp)->last_used < (*lru)->last_used))
                lru = pp;
        if (!lru)
            break;
        struct peer *p = *lru;
        *lru = p->next;
        p->next = freed;
        freed = p;
        ob->n_peers--;
    }
    return freed;
}

static void peers_free(struct peer *list)
{
    while (list) {
        struct peer *next = list->next;
        TDM_LOG_DEBUG(MOD, "outbox: closed idle peer %s", list->url);
        peer_free(list);
        list = next;
    }
}

// The peer for url, created (its watcher dialing) on first use, with one more
// user (release with peer_put). A new URL first evicts idle peers, so a flood
// of reply addresses cannot grow threads and dials without bound. NULL with
// err on failure (TDM_ECAPACITY when every peer is busy and the outbox full).
static struct peer *peer_get(struct tdm_net_outbox *ob, const char *url, int *code, char *err,
                             size_t errlen)
{
    pthread_mutex_lock(&ob->mu);
    for (struct peer *p = ob->head; p; p = p->next) {
        if (strcmp(p->url, url) == 0) {
            p->users++;
            pthread_mutex_unlock(&ob->mu);
            return p;
        }
    }
    struct peer *evicted = peers_evict(ob, tdm_now());
    if (ob->n_peers >= ob->max_peers) {
        pthread_mutex_unlock(&ob->mu);
        peers_free(evicted);
        *code = TDM_ECAPACITY;
        tdm_seterr(err, errlen, TDM_ECAPACITY, "outbox: %d peers busy, cannot add %s",
                   ob->max_peers, url);
        return NULL;
    }
    struct peer *p = calloc(1, sizeof *p);
    int rv = NNG_ENOMEM;
    if (p == NULL || (p->url = strdup(url)) == NULL)
        goto fail;
    rv = nng_stream_dialer_alloc(&p->dialer, url);
    if (rv != 0)
        goto fail;
    p->reconnect_ms = ob->reconnect_ms;
    p->key = ob->key;
    p->key_len = ob->key_len;
    p->users = 1;
    p->last_used = tdm_now();
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->send_mu, NULL);
    tdm_cond_init(&p->cv);
    if (pthread_create(&p->watcher, NULL, peer_watcher, p) != 0) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->send_mu);
        pthread_mutex_destroy(&p->mu);
        rv = NNG_ENOMEM;
        goto fail;
    }
    p->next = ob->head;
    ob->head = p;
    ob->n_peers++;
    pthread_mutex_unlock(&ob->mu);
    peers_free(evicted);
    return p;
fail:
    pthread_mutex_unlock(&ob->mu);
    peers_free(evicted);
    if (p) {
        if (p->dialer)
            nng_stream_dialer_free(p->dialer);
        free(p->url);
        free(p);
    }
    *code = rv == NNG_ENOMEM ? TDM_ENOMEM : TDM_EINVAL;
    tdm_seterr(err, errlen, *code, "outbox: cannot dial %s: %s", url, nng_strerror(rv));
    return NULL;
}

static void peer_put(struct tdm_net_outbox *ob, struct peer *p)
{
    pthread_mutex_lock(&ob->mu);
    p->users--;
    p->last_used = tdm_now();
    pthread_mutex_unlock(&ob->mu);
}

void tdm_net_outbox_set_stall(struct tdm_net_outbox *ob, double stall_s)
{
    atomic_store(&ob->stall_s, stall_s > 0 ? stall_s : 0);
}

void tdm_net_outbox_set_limits(struct tdm_net_outbox *ob, int max_peers, double idle_s)
{
    pthread_mutex_lock(&ob->mu);
    ob->max_peers = max_peers > 0 ? max_peers : TDM_NET_MAX_PEERS;
    ob->idle_s = idle_s > 0 ? idle_s : TDM_NET_PEER_IDLE_S;
    pthread_mutex_unlock(&ob->mu);
}

int tdm_net_outbox_peers(struct tdm_net_outbox *ob)
{
    pthread_mutex_lock(&ob->mu);
    int n = ob->n_peers;
    pthread_mutex_unlock(&ob->mu);
    return n;
}

// True when p has a connection a frame can go on (under p->mu): one a writer
// dropped is done, though p->s keeps it until the watcher has seen it end.
static bool peer_up(struct peer *p)
{
    return p->s != NULL && !atomic_load(&p->drop);
}

bool tdm_net_connected(struct tdm_net_outbox *ob, const char *url)
{
    pthread_mutex_lock(&ob->mu);
    bool up = false;
    for (struct peer *p = ob->head; p; p = p->next) {
        if (strcmp(p->url, url) == 0) {
            pthread_mutex_lock(&p->mu);
            up = peer_up(p);
            pthread_mutex_unlock(&p->mu);
        }
    }
    pthread_mutex_unlock(&ob->mu);
    return up;
}

enum tdm_net_link tdm_net_link_state(struct tdm_net_outbox *ob, const char *url, char *why,
                                     size_t whylen)
{
    enum tdm_net_link st = TDM_NET_LINK_UNKNOWN;
    if (why && whylen)
        why[0] = '\0';
    pthread_mutex_lock(&ob->mu);
    for (struct peer *p = ob->head; p; p = p->next) {
        if (strcmp(p->url, url) != 0)
            continue;
        pthread_mutex_lock(&p->mu);
        if (peer_up(p))
            st = TDM_NET_LINK_UP;
        else if (p->auth_fails >= TDM_NET_AUTH_FAILS)
            st = TDM_NET_LINK_AUTH;
        else if (p->dialed)
            st = TDM_NET_LINK_DOWN;
        if (st == TDM_NET_LINK_AUTH && why && whylen)
            snprintf(why, whylen, "%s", p->auth_why);
        pthread_mutex_unlock(&p->mu);
    }
    pthread_mutex_unlock(&ob->mu);
    return st;
}

// How peer_write ends besides 0 (the whole frame is in the connection),
// NNG_ETIMEDOUT (no connection came up by the deadline) and the nng error of
// a connection that failed (negative: never an nng error).
enum write_end {
    WRITE_BUSY = -1,    // connected, but the peer took no byte of the frame by the deadline (or
                        // the frames ahead of it still wait): nothing of it went out, the
                        // connection stays
    WRITE_CUT = -2,     // part of the frame went out by the deadline and no stall limit lets it
                        // finish: the connection is dropped
    WRITE_STALLED = -3, // the connection took no byte for the stall limit while frames waited:
                        // the peer is gone, the connection is dropped
};
#define WRITE_SLICE_S 0.25 // a write waits in slices this long, so a stall is seen as it grows

// Writes one whole frame to p: waits until deadline for a connection, then
// for the writers ahead of it and for the peer to take the frame's first
// byte. A frame whose first bytes went out cannot be taken back: without a
// stall limit (stall_s 0) its connection is dropped at the deadline (the
// peer's reader drops the partial frame with it); with one the frame is
// finished however long the peer takes, as long as it keeps taking bytes. A
// connection that takes no byte for stall_s while frames wait for it is
// dropped whoever writes (the stall counts across writers: stuck_since). 0,
// NNG_ETIMEDOUT, a WRITE_* code or the nng error that dropped the connection.
static int peer_write(struct peer *p, const uint8_t *buf, size_t size, double deadline,
                      double stall_s)
{
    for (;;) {
        // Wait (bounded) for a connection (peer_up: not one a writer dropped,
        // which the watcher, a thread that may run late, has yet to clear; a
        // write to it would only time out and say "busy, the connection stays").
        struct timespec until = clock_at(CLOCK_MONOTONIC, deadline - tdm_now());
        pthread_mutex_lock(&p->mu);
        while (!peer_up(p) && !p->stopping && tdm_now() < deadline)
            if (pthread_cond_timedwait(&p->cv, &p->mu, &until) != 0)
                break;
        bool up = peer_up(p);
        pthread_mutex_unlock(&p->mu);
        if (!up)
            return NNG_ETIMEDOUT;

        // One writer at a time, bounded by the same deadline: the peer is
        // slow to take the frames ahead of this one, not gone.
        struct timespec rt = clock_at(CLOCK_REALTIME, deadline - tdm_now());
        if (pthread_mutex_timedlock(&p->send_mu, &rt) != 0)
            return WRITE_BUSY;
        pthread_mutex_lock(&p->mu);
        nng_stream *s = peer_up(p) ? p->s : NULL;
        pthread_mutex_unlock(&p->mu);
        if (s == NULL) { // lost while waiting for the writer ahead: wait again
            pthread_mutex_unlock(&p->send_mu);
            if (tdm_now() >= deadline)
                return NNG_ETIMEDOUT;
            continue;
        }
        if (p->stuck_conn != s) { // a new connection: no stall yet
            p->stuck_conn = s;
            p->stuck_since = 0;
        }
        size_t done = 0;
        int rv;
        for (;;) {
            double t0 = tdm_now();
            double end = t0 + WRITE_SLICE_S;
            if (done == 0 && end > deadline)
                end = deadline; // nothing out yet: the caller's deadline holds
            size_t moved = 0;
            rv = stream_xfer(s, true, (void *)(buf + done), size - done, size - done, end, NULL,
                             &moved);
            done += moved;
            if (moved > 0)
                p->stuck_since = 0;
            if (rv != NNG_ETIMEDOUT)
                break; // written, or the connection failed
            double now = tdm_now();
            if (moved == 0 && p->stuck_since == 0)
                p->stuck_since = t0;
            if (stall_s > 0 && p->stuck_since > 0 && now - p->stuck_since >= stall_s) {
                rv = WRITE_STALLED;
                break;
            }
            if (now < deadline)
                continue;
            if (done == 0) {
                rv = WRITE_BUSY;
                break;
            }
            if (stall_s <= 0) {
                rv = WRITE_CUT;
                break;
            }
            // Part of the frame is out and the limit lets it finish: go on.
        }
        if (rv != 0 && rv != WRITE_BUSY) { // half a frame may be out: the connection is done
            atomic_store(&p->drop, true);
            nng_stream_close(s);
            p->stuck_since = 0;
        }
        pthread_mutex_unlock(&p->send_mu);
        return rv;
    }
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
    uint8_t *body = malloc(size);
    if (body == NULL) {
        peer_put(ob, p);
        return tdm_seterr(err, errlen, TDM_ENOMEM, "send: out of memory (%zu bytes)", size);
    }
    tdm_net_frame_header(body, type, msg_len, payload_len);
    if (msg_len)
        memcpy(body + TDM_NET_HEADER_BYTES, msg, msg_len);
    if (fill && payload_len) {
        int frc = fill(arg, body + TDM_NET_HEADER_BYTES + msg_len, payload_len);
        if (frc != 0) {
            free(body);
            peer_put(ob, p);
            return tdm_seterr(err, errlen, frc, "send: payload fill failed: %s", tdm_strerror(frc));
        }
    } else if (payload_len) {
        memset(body + TDM_NET_HEADER_BYTES + msg_len, 0, payload_len);
    }
    // timeout 0 means "only to a peer connected now"; the write itself still
    // gets a moment (a small frame goes straight into the socket buffer).
    double now = tdm_now();
    double deadline = now + (timeout_s > 0 ? timeout_s : 0);
    int rv = 0;
    double stall_s = atomic_load(&ob->stall_s);
    if (timeout_s <= 0 && !tdm_net_connected(ob, url))
        rv = NNG_ETIMEDOUT;
    else
        rv = peer_write(p, body, size, timeout_s > 0 ? deadline : now + 0.5, stall_s);
    free(body);
    peer_put(ob, p);
    const char *what = tdm_net_type_name(type);
    switch (rv) {
    case 0:
        return TDM_OK;
    case NNG_ETIMEDOUT:
        return tdm_seterr(err, errlen, TDM_ETIMEDOUT, "send %s to %s: no connected peer", what,
                          url);
    case WRITE_BUSY:
        return tdm_seterr(err, errlen, TDM_EBUSY,
                          "send %s to %s: the peer took none of it in %.2f s (its reader is "
                          "behind); nothing was written, the connection stays",
                          what, url, tdm_now() - now);
    case WRITE_CUT:
        return tdm_seterr(err, errlen, TDM_ETRANSPORT,
                          "send %s to %s: timed out with part of it written: connection dropped",
                          what, url);
    case WRITE_STALLED:
        return tdm_seterr(err, errlen, TDM_ETRANSPORT,
                          "send %s to %s: the peer took no byte for %.1f s: connection dropped",
                          what, url, stall_s);
    default:
        return tdm_seterr(err, errlen, nng_to_tdm(rv), "send %s to %s: %s", what, url,
                          nng_strerror(rv));
    }
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
