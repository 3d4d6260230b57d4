// SPDX-License-Identifier: Apache-2.0
// tandem-bench-transport: what one received frame costs the inbox's reader
// thread, the path every TokenChunk takes into the router (and every request
// into a worker). One outbox sends --frames frames of --bytes message bytes
// (default 60, a one-token TokenChunk) over loopback TCP to an inbox whose
// frames are handled on the reader thread (tdm_net_inbox_handle_on_readers, as
// the router does); --senders threads share the outbox, as a decode worker's
// many requests share its one connection to the router. Prints frames per
// second and the reader thread's CPU time per frame (CLOCK_THREAD_CPUTIME_ID,
// read on that thread at a warm-up frame and at the last one).
//   tandem-bench-transport [--frames N] [--bytes B] [--senders S]
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core.h"
#include "transport.h"

static struct {
    long frames;
    size_t bytes;
    int senders;
    atomic_long seen;
    atomic_bool warm;
    double cpu0, cpu1; // the reader thread's CPU time at the warm-up frame and the last
    double last_at;
} b = {.frames = 200000, .bytes = 60, .senders = 4};

static double thread_cpu_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

// The warm-up frame (a 1-byte message) starts the reader's CPU clock.
static void on_frame(void *arg, const struct tdm_net_frame *f)
{
    (void)arg;
    if (f->msg_len == 1) {
        b.cpu0 = thread_cpu_s();
        atomic_store(&b.warm, true);
        return;
    }
    if (atomic_fetch_add(&b.seen, 1) + 1 == b.frames) {
        b.cpu1 = thread_cpu_s();
        b.last_at = tdm_now();
    }
}

struct sender {
    struct tdm_net_outbox *ob;
    const char *url;
    long n;
    int failed;
};

static void *send_frames(void *arg)
{
    struct sender *s = arg;
    char *msg = malloc(b.bytes);
    memset(msg, 'x', b.bytes);
    char err[256];
    for (long i = 0; i < s->n; i++)
        if (tdm_net_send(s->ob, s->url, TDM_NET_TOKENS, msg, b.bytes, NULL, 0, 10.0, err,
                         sizeof err) != TDM_OK) {
            fprintf(stderr, "tandem-bench-transport: send: %s\n", err);
            s->failed = 1;
            break;
        }
    free(msg);
    return NULL;
}

int main(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(argv[i], "--frames") == 0 && v)
            b.frames = atol(v), i++;
        else if (strcmp(argv[i], "--bytes") == 0 && v)
            b.bytes = (size_t)atol(v), i++;
        else if (strcmp(argv[i], "--senders") == 0 && v)
            b.senders = atoi(v), i++;
        else {
            fprintf(stderr, "usage: tandem-bench-transport [--frames N] [--bytes B] "
                            "[--senders S]\n");
            return 2;
        }
    }
    if (b.frames < 1 || b.bytes < 2 || b.bytes > (1u << 20) || b.senders < 1 ||
        b.senders > 64) {
        fprintf(stderr, "tandem-bench-transport: --frames >= 1, --bytes 2..1048576, "
                        "--senders 1..64\n");
        return 2;
    }
    char err[256];
    struct tdm_net_inbox *in = NULL;
    struct tdm_net_outbox *ob = NULL;
    if (tdm_net_inbox_new(&in, "tcp://127.0.0.1:0", err, sizeof err) != TDM_OK ||
        tdm_net_outbox_new(&ob, 50, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-bench-transport: %s\n", err);
        return 1;
    }
    tdm_net_inbox_handle_on_readers(in, on_frame, NULL);
    const char *url = tdm_net_inbox_url(in);
    // Connected (and the reader thread started) before the clock starts.
    if (tdm_net_send(ob, url, TDM_NET_TOKENS, "w", 1, NULL, 0, 10.0, err, sizeof err) != TDM_OK) {
        fprintf(stderr, "tandem-bench-transport: %s\n", err);
        return 1;
    }
    while (!atomic_load(&b.warm))
        tdm_sleep(0.001);
    pthread_t t[64];
    struct sender s[64];
    double t0 = tdm_now();
    for (int i = 0; i < b.senders; i++) {
        s[i] = (struct sender){.ob = ob, .url = url,
                               .n = b.frames / b.senders + (i < b.frames % b.senders)};
        pthread_create(&t[i], NULL, send_frames, &s[i]);
    }
    int failed = 0;
    for (int i = 0; i < b.senders; i++) {
        pthread_join(t[i], NULL);
        failed |= s[i].failed;
    }
    double sent_at = tdm_now();
    while (!failed && atomic_load(&b.seen) < b.frames && tdm_now() - sent_at < 30)
        tdm_sleep(0.001);
    long seen = atomic_load(&b.seen);
    tdm_net_outbox_free(ob);
    tdm_net_inbox_free(in);
    if (failed || seen < b.frames) {
        fprintf(stderr, "tandem-bench-transport: %ld of %ld frames arrived\n", seen, b.frames);
        return 1;
    }
    double wall = b.last_at - t0;
    printf("frames %ld of %zu message bytes, %d senders\n", b.frames, b.bytes, b.senders);
    printf("frames_per_s %.0f\n", (double)b.frames / wall);
    printf("reader_cpu_us_per_frame %.3f\n", 1e6 * (b.cpu1 - b.cpu0) / (double)b.frames);
    return 0;
}
