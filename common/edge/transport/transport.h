// SPDX-License-Identifier: Apache-2.0
// transport: Tandem's wire between router, prefill and decode processes, on
// nng byte streams (TCP). Every process listens on one address, its inbox; it
// reaches a peer through one connection to the peer's inbox URL, kept per URL
// in an outbox and redialed by a watcher thread, so a restarted peer is reached
// again within the reconnect interval. Every message is one frame: a 16-byte
// header, a protobuf-c message (proto/tandem.proto; packed and unpacked by the
// caller) and a raw payload (KV bytes), so KV never goes through repeated float
// fields. The header is the framing on the stream: a connection that sends a
// malformed header (bad magic or version, unknown type, over 1 GiB) is dropped,
// which costs only that connection.
//
// Frame layout (little-endian): u32 magic "TDMF", u16 version (1), u16 type,
// u32 message bytes, u32 payload bytes, then the message, then the payload.
// A frame whose lengths do not add up exactly to its size, whose magic or
// version differ, or whose type is unknown is rejected with TDM_EPROTO.
//
// Threads: an inbox is read by one thread (one reader thread per connection
// fills its bounded queue), or handled on those reader threads
// (tdm_net_inbox_handle_on_readers); an outbox may be used from any thread (frames to one
// URL are written whole, one at a time, in the order the senders got the turn).
#ifndef TDM_TRANSPORT_H
#define TDM_TRANSPORT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define TDM_NET_MAGIC 0x46444d54u // "TDMF"
#define TDM_NET_VERSION 1
#define TDM_NET_HEADER_BYTES 16
#define TDM_NET_MAX_FRAME (1u << 30) // 1 GiB: larger frames are refused on receive

// Message types (the protobuf message the frame carries).
enum tdm_net_type {
    TDM_NET_GENERATE = 1,       // tandem.GenerateRequest, router -> decode
    TDM_NET_PREFILL = 2,        // tandem.PrefillRequest, decode -> prefill
    TDM_NET_PREFILL_RESULT = 3, // tandem.PrefillResult, prefill -> decode
    TDM_NET_KV_PULL = 4,        // retired (the late pull of held KV): never sent; dropped
    TDM_NET_KV_DATA = 5,        // tandem.KvData + raw KV payload, prefill -> decode
    TDM_NET_TOKENS = 6,         // tandem.TokenChunk, decode -> router
    TDM_NET_CANCEL = 7,         // tandem.Cancel, router -> decode -> prefill
    TDM_NET_LOAD_QUERY = 8,     // tandem.LoadQuery, router -> worker
    TDM_NET_LOAD_REPORT = 9,    // tandem.LoadReport, worker -> router
    TDM_NET_KV_EVENTS = 10,     // tandem.KvEvents, worker -> router
    TDM_NET_TYPE_MAX = 10,
};
// "generate", "prefill", ...; "?" for an unknown value.
const char *tdm_net_type_name(int type);

// ---- frames (pure functions, no sockets) ----------------------------------------------
// A parsed frame: pointers into the buffer it was parsed from.
struct tdm_net_frame {
    int type;           // enum tdm_net_type
    const uint8_t *msg; // [msg_len] protobuf bytes
    size_t msg_len;
    const uint8_t *payload; // [payload_len] raw bytes (NULL when 0)
    size_t payload_len;
};

// Bytes of a frame holding msg_len + payload_len bytes; 0 when too large.
size_t tdm_net_frame_size(size_t msg_len, size_t payload_len);
// Writes the 16-byte header for (type, msg_len, payload_len) into dst.
void tdm_net_frame_header(uint8_t dst[TDM_NET_HEADER_BYTES], int type, size_t msg_len,
                          size_t payload_len);
// Parses buf[len]. TDM_OK with *out pointing into buf, or TDM_EPROTO with err
// saying why ("frame: 10 bytes, shorter than the 16-byte header", "frame: bad
// magic 0x...", "frame: version 2, expected 1", "frame: unknown type 99",
// "frame: header says 120 bytes, got 100").
int tdm_net_frame_parse(const void *buf, size_t len, struct tdm_net_frame *out, char *err,
                        size_t errlen);

// ---- instance ids -----------------------------------------------------------------------
// A random nonzero 64-bit id (getrandom, else time and pid mixed): drawn once per
// process start and carried in every message, so messages meant for an earlier
// incarnation of a peer are recognised and dropped.
uint64_t tdm_net_new_instance_id(void);

// ---- authentication ----------------------------------------------------------------------
// The control plane's shared secret. Every inbox and outbox takes the secret
// in force when it is created: the first creation reads it from
// TANDEM_INTERNAL_SECRET_FILE (a file's bytes, trailing newlines dropped: a
// mounted Kubernetes Secret) or TANDEM_INTERNAL_SECRET, unless
// tdm_net_set_secret came first. With a secret, a connection carries frames
// only after both ends proved they hold it (HMAC-SHA256 challenge-response,
// transport.c); a peer without it is dropped before any byte of a frame is
// read. Without one (neither variable set), connections are open as before.
// A secret must be 16 to 1024 bytes: a bad file or length is an error from
// tdm_net_inbox_new / tdm_net_outbox_new (err names the variable).
// tdm_net_set_secret(NULL, 0) turns authentication off.
int tdm_net_set_secret(const void *key, size_t len, char *err, size_t errlen);
// True when connections made now would be authenticated (the environment is read).
bool tdm_net_authenticated(void);
// The handshake binds a connection to the inbox's own endpoint (the local
// address it arrives at): a peer that dials another address (a relay, a
// proxy, destination NAT) is refused. Endpoints this process's inboxes are
// also reached at, deliberately (a TCP proxy in front of a worker, a published
// port), are listed as "IP:port" or "[IPv6]:port", comma-separated, in
// TANDEM_INTERNAL_ALIASES (read when the first inbox is made, unless this was
// called first; NULL or "" clears). TDM_EINVAL with err naming a bad entry;
// at most 16.
int tdm_net_set_aliases(const char *list, char *err, size_t errlen);
// Each handshake step's limit in seconds, for the connections handshaking
// from then on (default 2 s; step_s <= 0 restores it). For tests: one that
// tells a prompt refusal from a step run out raises it, so that a loaded
// machine cannot make the one look like the other.
void tdm_net_set_handshake_step(double step_s);

// ---- inbox: the address a process listens on --------------------------------------------
struct tdm_net_inbox;
struct tdm_net_msg; // one received frame (owns its bytes)

// Listens on url ("tcp://127.0.0.1:9101"; port 0 picks a free port; also
// "ipc:///tmp/x"). TDM_ETRANSPORT with err when it cannot listen.
int tdm_net_inbox_new(struct tdm_net_inbox **out, const char *url, char *err, size_t errlen);
// Closes the inbox and frees it (frames still queued are dropped). Accepts NULL.
void tdm_net_inbox_free(struct tdm_net_inbox *in);
// Stops listening and closes every connection but keeps the object (a thread
// blocked in recv returns TDM_ECLOSED within 0.2 s); for shutting down a
// receiving thread before freeing.
void tdm_net_inbox_close(struct tdm_net_inbox *in);
// Connections an inbox keeps open at once (each has a reader thread and a
// descriptor): at most this many, and at most a quarter of the process's
// open-file limit (RLIMIT_NOFILE; 16 at the least). A cluster's peers need a
// few each (an outbox and a liveness connection per process that talks to
// this one); beyond the limit a new connection is closed as soon as it is
// accepted (logged at most once a second).
#define TDM_NET_INBOX_MAX_CONNS 1024
// Changes that limit (n >= 1; tests use a small one).
void tdm_net_inbox_set_max_conns(struct tdm_net_inbox *in, int n);
// What the inbox holds now: connections open (each with its reader thread; one
// refused at the limit is never counted, one whose peer left is counted until
// its reader has seen it go) and frames queued for tdm_net_inbox_recv. A
// snapshot (it may change as soon as it is read): tests wait on it instead of
// sleeping for "long enough".
int tdm_net_inbox_conns(struct tdm_net_inbox *in);
size_t tdm_net_inbox_queued(struct tdm_net_inbox *in);
// The URL peers should dial: the listen URL with port 0 replaced by the bound port.
const char *tdm_net_inbox_url(const struct tdm_net_inbox *in);
// Waits up to timeout_s (< 0: no limit) for a frame. TDM_OK with *out (free with
// tdm_net_msg_free), TDM_ETIMEDOUT, TDM_ECLOSED after close. Malformed frames
// never reach recv: their connection is dropped (logged).
int tdm_net_inbox_recv(struct tdm_net_inbox *in, double timeout_s, struct tdm_net_msg **out,
                       char *err, size_t errlen);

// A frame handler: called with the frame, valid only during the call.
typedef void (*tdm_net_frame_handler)(void *arg, const struct tdm_net_frame *f);

// Event-driven receiving: from now on each frame is handed to handle(arg,
// frame) on the reader thread of the connection it came on, as soon as it is
// read, instead of being queued for tdm_net_inbox_recv (frames already queued
// are handled by this call, in order). Saves the hand-off to the thread that
// serves the inbox and the inbox queue's lock (the router's token path, the
// P/D workers' frames: common/edge/pd's service). handle
// runs on several threads at once (one per connection), must not block for
// long (a connection's next frame waits for it: back-pressure through TCP),
// and is never called once tdm_net_inbox_close has returned. The frame is
// valid only during the call. Liveness frames need no priority here: no queue
// holds them back.
void tdm_net_inbox_handle_on_readers(struct tdm_net_inbox *in, tdm_net_frame_handler handle,
                                     void *arg);

// The parsed frame of a received message; valid until tdm_net_msg_free.
const struct tdm_net_frame *tdm_net_msg_frame(const struct tdm_net_msg *m);
void tdm_net_msg_free(struct tdm_net_msg *m);

// ---- outbox: connections to peers, one per URL -----------------------------------------
struct tdm_net_outbox;

// reconnect_ms: the longest wait between redials of a peer that is down
// (<= 0: 100 ms); a lost connection is redialed at once.
int tdm_net_outbox_new(struct tdm_net_outbox **out, int reconnect_ms, char *err, size_t errlen);
void tdm_net_outbox_free(struct tdm_net_outbox *ob);
// Sends one frame to url, dialing on first use. Waits up to timeout_s for a
// connected peer and for the frame to be written (0: only if a connection is up
// now). TDM_OK once the whole frame is in the connection (delivery is not
// confirmed: protocols above time out); TDM_ETIMEDOUT when no peer was
// connected in time; TDM_EBUSY when one was but took no byte of the frame in
// time (its reader is behind, or the frames ahead of this one still wait):
// backpressure, not a failure: nothing of the frame was written and the
// connection stays, so the caller may send it again; TDM_EINVAL for a bad URL
// or type; TDM_ENOMEM; TDM_ETRANSPORT when the connection failed (the peer
// closed it, part of the frame was out when timeout_s ran out, or the peer
// took no byte for the stall limit below): it is then dropped and redialed,
// err says why. With a stall limit the call may return up to that long after
// timeout_s (only while part of its frame is out).
int tdm_net_send(struct tdm_net_outbox *ob, const char *url, int type, const void *msg,
                 size_t msg_len, const void *payload, size_t payload_len, double timeout_s,
                 char *err, size_t errlen);
// Like tdm_net_send, but the payload is written in place: fill is called once
// with the frame's payload area of payload_len bytes (so KV layers are exported
// straight into the outgoing frame, with no extra copy). A nonzero return from
// fill aborts the send and is returned.
typedef int (*tdm_net_fill_fn)(void *arg, uint8_t *payload, size_t payload_len);
int tdm_net_send_fill(struct tdm_net_outbox *ob, const char *url, int type, const void *msg,
                      size_t msg_len, size_t payload_len, tdm_net_fill_fn fill, void *arg,
                      double timeout_s, char *err, size_t errlen);
// A frame partly written when its send's timeout runs out cannot be taken
// back: by default its connection is dropped then (the peer's reader drops
// the partial frame with it), and the frames the caller sends again go on a
// new connection. With a stall limit stall_s > 0 such a frame is finished
// instead, however long the peer takes, as long as it keeps taking bytes;
// and a connection that takes no byte for stall_s while frames wait for it
// is dropped (the peer is gone: TDM_ETRANSPORT), whichever send sees it.
// Until then a slow peer only makes senders wait (TDM_EBUSY). The decode
// worker's outbox has one (--pd-router-liveness): a router that stops
// reading slows its token streams and never cuts a frame. stall_s <= 0
// restores the default. Any thread, any time (read at each send).
void tdm_net_outbox_set_stall(struct tdm_net_outbox *ob, double stall_s);

// True when the outbox has a live connection to url now.
bool tdm_net_connected(struct tdm_net_outbox *ob, const char *url);

// What the outbox knows of its link to url: UNKNOWN (never dialed: no send to
// it yet, or the first dial is under way), UP (connected now), DOWN (not
// connected: refused, unreachable, or connected and lost), AUTH (the last
// TDM_NET_AUTH_FAILS dials in a row reached the peer and its control-plane
// handshake failed: the peer has another TANDEM_INTERNAL_SECRET, none, or is
// not a Tandem inbox; why gets the last failure's reason). One failed
// handshake is not enough: a peer that closes while it stops looks the same.
#define TDM_NET_AUTH_FAILS 2
enum tdm_net_link { TDM_NET_LINK_UNKNOWN, TDM_NET_LINK_UP, TDM_NET_LINK_DOWN, TDM_NET_LINK_AUTH };
enum tdm_net_link tdm_net_link_state(struct tdm_net_outbox *ob, const char *url, char *why,
                                     size_t whylen);

// Bounds on the peers (URLs) an outbox keeps, each a connection and a watcher
// thread that redials it: a peer unused for TDM_NET_PEER_IDLE_S is closed, and
// a new URL beyond TDM_NET_MAX_PEERS evicts the least recently used idle one
// (a send to a new URL with every peer busy is TDM_ECAPACITY). So frames that
// name ever new reply addresses cannot grow threads and dials without bound.
// A closed peer is dialed again on its next send.
#define TDM_NET_MAX_PEERS 256
#define TDM_NET_PEER_IDLE_S 300.0
// Changes the bounds (<= 0 restores a default); for tests and tuning.
void tdm_net_outbox_set_limits(struct tdm_net_outbox *ob, int max_peers, double idle_s);
// Peers (URLs) the outbox holds now.
int tdm_net_outbox_peers(struct tdm_net_outbox *ob);

#endif
