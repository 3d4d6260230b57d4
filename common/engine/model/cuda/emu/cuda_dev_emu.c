// SPDX-License-Identifier: Apache-2.0
// cuda_dev_emu: cuda_dev.h for the emulator tests. Device memory is host
// memory, copies are memcpy, streams and events are the emulator's (kernels
// finish before their launch returns, unless a test turned on the emulator's
// deferred mode: tdm_emu_defer), and the GEMM is a plain loop:
// each output element accumulates bf16(w) * bf16(x) in f32 over k in order,
// the arithmetic cuBLASLt's bf16 GEMM does in another order. Test tool only.
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "cuda_dev.h"
#include "cuda_dev_held.h"
#include "cuda_emu_api.h"

struct tdm_cuda_dev {
    int ordinal;
    struct held_list held; // what tdm_cuda_dev_alloc handed out
    char errmsg[128];
};

// Host <-> device copies and sync are not stream work CUDA can capture.
static int not_while_capturing(struct tdm_cuda_dev *d, const char *what)
{
    if (!tdm_emu_capturing())
        return TDM_OK;
    snprintf(d->errmsg, sizeof d->errmsg, "%s while capturing a graph", what);
    return TDM_EBACKEND;
}

struct copy_work {
    void *dst;
    const void *src;
    size_t bytes;
    int byte; // memset value; -1 for a copy
};

static void run_copy(void *arg)
{
    struct copy_work *w = arg;
    if (w->byte >= 0)
        memset(w->dst, w->byte, w->bytes);
    else if (w->bytes)
        memmove(w->dst, w->src, w->bytes);
}

// Devices the emulator presents: 1, or TANDEM_EMU_DEVICES (1 to 8) so that
// tests can put a model on cuda:1. Each thread's current device starts at 0,
// as CUDA's does; tdm_cuda_dev_bind moves it, and every launch-like call
// checks it, failing as a kernel launched on the wrong GPU would be wrong.
static _Thread_local int emu_current;

int tdm_cuda_dev_count(void)
{
    const char *s = getenv("TANDEM_EMU_DEVICES");
    int n = s ? atoi(s) : 1;
    return n >= 1 && n <= 8 ? n : 1;
}

int tdm_cuda_dev_bind(struct tdm_cuda_dev *d)
{
    emu_current = d->ordinal;
    return TDM_OK;
}

static int on_device(struct tdm_cuda_dev *d, const char *what)
{
    if (emu_current == d->ordinal)
        return TDM_OK;
    snprintf(d->errmsg, sizeof d->errmsg,
             "%s for device %d from a thread whose current device is %d (not bound)", what,
             d->ordinal, emu_current);
    return TDM_EBACKEND;
}

int tdm_cuda_dev_open(struct tdm_cuda_dev **out, int ordinal, char *err, size_t errlen)
{
    *out = NULL;
    int n = tdm_cuda_dev_count();
    if (ordinal < 0 || ordinal >= n)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "cuda: device %d requested, %d visible (emulator)", ordinal, n);
    struct tdm_cuda_dev *d = calloc(1, sizeof *d);
    if (d == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    d->ordinal = ordinal;
    emu_current = ordinal; // cudaSetDevice in the real open
    held_init(&d->held);
    *out = d;
    return TDM_OK;
}

void tdm_cuda_dev_close(struct tdm_cuda_dev *d)
{
    if (d == NULL)
        return;
    held_fini(&d->held);
    free(d);
}

const char *tdm_cuda_dev_name(const struct tdm_cuda_dev *d)
{
    (void)d;
    return "emulator";
}

void *tdm_cuda_dev_stream(struct tdm_cuda_dev *d)
{
    (void)d;
    return NULL;
}

int tdm_cuda_dev_mem_info(struct tdm_cuda_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    // A pretend device of 1 GiB that this process alone uses, so
    // --gpu-memory-utilization has something to take a fraction of in tests.
    size_t total = (size_t)1 << 30, held = held_total(&d->held);
    *total_bytes = total;
    *free_bytes = held < total ? total - held : 0;
    return TDM_OK;
}

void *tdm_cuda_dev_alloc(struct tdm_cuda_dev *d, size_t bytes)
{
    tdm_cuda_dev_bind(d); // as the real one does
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0)
        return NULL;
    if (!held_add(&d->held, p, bytes)) {
        free(p);
        return NULL;
    }
    return p;
}

void tdm_cuda_dev_free(struct tdm_cuda_dev *d, void *p)
{
    if (p)
        held_remove(&d->held, p);
    free(p);
}

size_t tdm_cuda_dev_held(struct tdm_cuda_dev *d)
{
    return held_total(&d->held);
}

// Calls that wait on the host for the device stream (h2d, d2h, sync, event
// sync): a test's count of a step's round trips (cuda_emu_api.h).
static _Atomic unsigned long long host_waits;

unsigned long long tdm_emu_host_waits(void)
{
    return atomic_load(&host_waits);
}

int tdm_cuda_dev_h2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "h2d copy") != TDM_OK)
        return TDM_EBACKEND;
    atomic_fetch_add(&host_waits, 1);
    tdm_emu_stream_sync(NULL); // stream order: after the work issued so far
    if (bytes)
        memcpy(dst, src, bytes);
    return TDM_OK;
}

int tdm_cuda_dev_d2h(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "d2h copy") != TDM_OK)
        return TDM_EBACKEND;
    atomic_fetch_add(&host_waits, 1);
    tdm_emu_stream_sync(NULL);
    if (bytes)
        memcpy(dst, src, bytes);
    return TDM_OK;
}

int tdm_cuda_dev_d2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    tdm_cuda_dev_bind(d);
    struct copy_work w = {.dst = dst, .src = src, .bytes = bytes, .byte = -1};
    tdm_emu_stream_work(NULL, run_copy, &w, sizeof w);
    return TDM_OK;
}

int tdm_cuda_dev_memset(struct tdm_cuda_dev *d, void *dst, int byte, size_t bytes)
{
    tdm_cuda_dev_bind(d);
    struct copy_work w = {.dst = dst, .src = NULL, .bytes = bytes, .byte = byte & 0xff};
    tdm_emu_stream_work(NULL, run_copy, &w, sizeof w);
    return TDM_OK;
}

// Pinned memory is host memory here; the asynchronous copies are stream
// work that reads (h2d) or writes (d2h) it when the stream runs them, so in
// deferred mode a caller that reuses it too early gets what CUDA would give.
void *tdm_cuda_dev_host_alloc(struct tdm_cuda_dev *d, size_t bytes)
{
    (void)d;
    return malloc(bytes ? bytes : 1);
}

void tdm_cuda_dev_host_free(struct tdm_cuda_dev *d, void *p)
{
    (void)d;
    free(p);
}

static int copy_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes,
                      const char *what)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, what) != TDM_OK)
        return TDM_EBACKEND;
    struct copy_work w = {.dst = dst, .src = src, .bytes = bytes, .byte = -1};
    tdm_emu_stream_work(NULL, run_copy, &w, sizeof w);
    return TDM_OK;
}

int tdm_cuda_dev_h2d_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy_async(d, dst, src, bytes, "h2d copy");
}

int tdm_cuda_dev_d2h_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return copy_async(d, dst, src, bytes, "d2h copy");
}

int tdm_cuda_dev_sync(struct tdm_cuda_dev *d)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "sync") != TDM_OK)
        return TDM_EBACKEND;
    atomic_fetch_add(&host_waits, 1);
    tdm_emu_stream_sync(NULL);
    return TDM_OK;
}

int tdm_cuda_dev_capture_begin(struct tdm_cuda_dev *d)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "capture_begin") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_capture_begin();
    return TDM_OK;
}

int tdm_cuda_dev_capture_end(struct tdm_cuda_dev *d, void **graph)
{
    *graph = tdm_emu_capture_end();
    if (*graph == NULL) {
        snprintf(d->errmsg, sizeof d->errmsg, "capture_end without capture_begin");
        return TDM_EBACKEND;
    }
    return TDM_OK;
}

int tdm_cuda_dev_graph_launch(struct tdm_cuda_dev *d, void *graph)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "graph launch") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_graph_launch(graph);
    return TDM_OK;
}

void tdm_cuda_dev_graph_free(struct tdm_cuda_dev *d, void *graph)
{
    (void)d;
    if (graph)
        tdm_emu_graph_free(graph);
}

static float bf16_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

struct gemm_work {
    const uint16_t *w, *x;
    const float *bias;
    float *y;
    int rows, cols, n;
};

static void run_gemm(void *arg)
{
    const struct gemm_work *g = arg;
    const uint16_t *w = g->w, *x = g->x;
    const float *bias = g->bias;
    float *y = g->y;
    int rows = g->rows, cols = g->cols, n = g->n;
    for (int t = 0; t < n; t++) {
        const uint16_t *xr = x + (size_t)t * cols;
        for (int r = 0; r < rows; r++) {
            const uint16_t *wr = w + (size_t)r * cols;
            float acc = 0.0f;
            for (int k = 0; k < cols; k++)
                acc += bf16_f32(wr[k]) * bf16_f32(xr[k]);
            y[(size_t)t * rows + r] = bias ? acc + bias[r] : acc;
        }
    }
}

int tdm_cuda_dev_gemm_bf16(struct tdm_cuda_dev *d, const uint16_t *w, int rows, int cols,
                           const uint16_t *x, int n, const float *bias, float *y,
                           enum tdm_cuda_gemm_class cls)
{
    if (rows <= 0 || cols <= 0 || n <= 0) {
        snprintf(d->errmsg, sizeof d->errmsg, "gemm: %d x %d weight, n %d", rows, cols, n);
        return TDM_EINVAL;
    }
    if (on_device(d, "gemm") != TDM_OK) // a per-layer launch: bound by begin_forward
        return TDM_EBACKEND;
    struct gemm_work g = {.w = w, .x = x, .bias = bias, .y = y, .rows = rows, .cols = cols, .n = n};
    // The loop is the same for both classes; the log tells the tests which
    // class (cuBLASLt algorithm on a GPU) each GEMM asked for, and its rows.
    tdm_emu_log_gemm(cls == TDM_CUDA_GEMM_PROMPT ? "gemm_prompt" : "gemm", n);
    tdm_emu_stream_work(NULL, run_gemm, &g, sizeof g);
    return TDM_OK;
}

const char *tdm_cuda_dev_errmsg(const struct tdm_cuda_dev *d)
{
    return d->errmsg;
}

// ---- events and side streams ----------------------------------------------------------------
int tdm_cuda_dev_event_new(struct tdm_cuda_dev *d, void **event)
{
    (void)d;
    *event = tdm_emu_event_new();
    return TDM_OK;
}

void tdm_cuda_dev_event_free(struct tdm_cuda_dev *d, void *event)
{
    (void)d;
    if (event)
        tdm_emu_event_free(event);
}

int tdm_cuda_dev_event_record(struct tdm_cuda_dev *d, void *event)
{
    if (on_device(d, "event record") != TDM_OK || not_while_capturing(d, "event record") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_event_record(event, NULL);
    return TDM_OK;
}

int tdm_cuda_dev_event_sync(struct tdm_cuda_dev *d, void *event)
{
    tdm_cuda_dev_bind(d);
    if (not_while_capturing(d, "event sync") != TDM_OK)
        return TDM_EBACKEND;
    atomic_fetch_add(&host_waits, 1);
    tdm_emu_event_sync(event); // the device stream up to the mark only
    return TDM_OK;
}

struct tdm_cuda_side {
    struct tdm_cuda_dev *d;
    void *stream;
    void *host;
    size_t host_bytes;
    char errmsg[128];
};

int tdm_cuda_side_new(struct tdm_cuda_dev *d, struct tdm_cuda_side **out, char *err, size_t errlen)
{
    struct tdm_cuda_side *s = calloc(1, sizeof *s);
    if (s == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    s->d = d;
    s->stream = tdm_emu_stream_new();
    *out = s;
    return TDM_OK;
}

void tdm_cuda_side_free(struct tdm_cuda_side *s)
{
    if (s == NULL)
        return;
    tdm_emu_stream_free(s->stream);
    free(s->host);
    free(s);
}

void *tdm_cuda_side_stream(struct tdm_cuda_side *s)
{
    return s->stream;
}

void *tdm_cuda_side_host(struct tdm_cuda_side *s, size_t bytes)
{
    if (bytes <= s->host_bytes)
        return s->host;
    free(s->host);
    s->host = malloc(bytes);
    s->host_bytes = s->host ? bytes : 0;
    return s->host;
}

// The side's calls check the calling thread's device as the device's do.
static int side_bound(struct tdm_cuda_side *s, const char *what)
{
    tdm_cuda_dev_bind(s->d);
    if (on_device(s->d, what) == TDM_OK)
        return TDM_OK;
    snprintf(s->errmsg, sizeof s->errmsg, "%s", s->d->errmsg);
    return TDM_EBACKEND;
}

static int side_copy(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes)
{
    if (side_bound(s, "side copy") != TDM_OK)
        return TDM_EBACKEND;
    struct copy_work w = {.dst = dst, .src = src, .bytes = bytes, .byte = -1};
    tdm_emu_stream_work(s->stream, run_copy, &w, sizeof w);
    return TDM_OK;
}

int tdm_cuda_side_h2d(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes)
{
    return side_copy(s, dst, src, bytes);
}

int tdm_cuda_side_d2h(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes)
{
    return side_copy(s, dst, src, bytes);
}

int tdm_cuda_side_wait_event(struct tdm_cuda_side *s, void *event)
{
    if (side_bound(s, "side wait") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_stream_wait_event(s->stream, event);
    return TDM_OK;
}

int tdm_cuda_side_event_sync(struct tdm_cuda_side *s, void *event)
{
    if (side_bound(s, "event sync") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_event_sync(event);
    return TDM_OK;
}

int tdm_cuda_side_sync(struct tdm_cuda_side *s)
{
    if (side_bound(s, "side sync") != TDM_OK)
        return TDM_EBACKEND;
    tdm_emu_stream_sync(s->stream);
    return TDM_OK;
}

const char *tdm_cuda_side_errmsg(const struct tdm_cuda_side *s)
{
    return s->errmsg;
}
