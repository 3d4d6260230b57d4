// SPDX-License-Identifier: Apache-2.0
// cuda_dev (internal to the CUDA backend): the thin device API the backend's
// host code is written against: device discovery, memory, copies, one stream
// and the bf16 GEMM. Two implementations:
//   cuda_dev.c           cudart + cuBLASLt, for the GPU (TANDEM_CUDA=ON);
//   emu/cuda_dev_emu.c   host memory and a plain f32-accumulating loop for the
//                        GEMM, for the emulator tests (never in a product).
// So the backend's host code and the op tests run unchanged on both.
//
// Ownership: a tdm_cuda_dev owns its stream and GEMM handle; memory from
// tdm_cuda_dev_alloc belongs to the caller until tdm_cuda_dev_free. Copies and
// kernels run in stream order; d2h and sync wait for the stream. Not
// thread-safe: one engine thread drives a device.
#ifndef TDM_CUDA_DEV_H
#define TDM_CUDA_DEV_H

#include <stddef.h>
#include <stdint.h>

struct tdm_cuda_dev;

// Devices visible to this process (0 without a GPU or a working driver; the
// emulator reports 1).
int tdm_cuda_dev_count(void);
// Opens device `ordinal`: TDM_EINVAL (err says how many exist) for an ordinal
// that is not visible, TDM_EBACKEND when the runtime fails.
int tdm_cuda_dev_open(struct tdm_cuda_dev **out, int ordinal, char *err, size_t errlen);
void tdm_cuda_dev_close(struct tdm_cuda_dev *d); // NULL is fine
// "NVIDIA H200" or "emulator"; valid while d is open.
const char *tdm_cuda_dev_name(const struct tdm_cuda_dev *d);
// The stream every copy and kernel of this device runs on (a cudaStream_t).
void *tdm_cuda_dev_stream(struct tdm_cuda_dev *d);
// Makes d the calling thread's current device (cudaSetDevice) unless it is
// already. The device API binds itself on every call that is not per layer
// (memory, copies, sync, graphs), and the backend at each forward's start
// (begin_forward, graph_begin), so the engine's thread, a KV receive thread or
// a prefill job thread each run on d, whichever thread opened it: only the
// loading thread did before, so --device cuda:1 could launch the engine's
// kernels on GPU 0. TDM_OK or TDM_EBACKEND.
int tdm_cuda_dev_bind(struct tdm_cuda_dev *d);
// Free and total bytes of device memory.
int tdm_cuda_dev_mem_info(struct tdm_cuda_dev *d, size_t *free_bytes, size_t *total_bytes);

// Device memory, 256-byte aligned; NULL when out of memory.
void *tdm_cuda_dev_alloc(struct tdm_cuda_dev *d, size_t bytes);
void tdm_cuda_dev_free(struct tdm_cuda_dev *d, void *p); // NULL is fine
// Bytes of device memory this process holds through tdm_cuda_dev_alloc (and the
// GEMM workspace): weights, buffers, the KV pool. cudaMemGetInfo counts every
// process on the device; this is this instance's own share.
size_t tdm_cuda_dev_held(struct tdm_cuda_dev *d);

// Copies: TDM_OK or TDM_EBACKEND. h2d returns once src may be reused; d2h
// returns once dst holds the data.
int tdm_cuda_dev_h2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes);
int tdm_cuda_dev_d2h(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes);
int tdm_cuda_dev_d2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes);
int tdm_cuda_dev_memset(struct tdm_cuda_dev *d, void *dst, int byte, size_t bytes);
// Pinned host memory (cudaHostAlloc), which the asynchronous copies below
// read and write; NULL when out of memory.
void *tdm_cuda_dev_host_alloc(struct tdm_cuda_dev *d, size_t bytes);
void tdm_cuda_dev_host_free(struct tdm_cuda_dev *d, void *p); // NULL is fine
// Stream-ordered copies that return at once, without waiting for the stream:
// src (h2d) or dst (d2h) is pinned memory from tdm_cuda_dev_host_alloc, which
// the caller leaves untouched until the stream has run the copy (a sync, or
// a d2h, says so). Errors while capturing, as h2d and d2h.
int tdm_cuda_dev_h2d_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes);
int tdm_cuda_dev_d2h_async(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes);
// Waits for the stream; TDM_EBACKEND (detail in tdm_cuda_dev_errmsg) when a
// kernel failed.
int tdm_cuda_dev_sync(struct tdm_cuda_dev *d);

// A GEMM's algorithm class (backend.h, enum tdm_gemm_class): each weight
// shape has one algorithm per class.
enum tdm_cuda_gemm_class {
    TDM_CUDA_GEMM_DECODE = 0, // decode rows: the heuristic's pick for 64 rows
    TDM_CUDA_GEMM_PROMPT,     // prompt rows: its pick for 2048 rows
};

// y[n][rows] = x[n][cols] . w[rows][cols]^T (+ bias[rows] when not NULL):
// bf16 inputs, f32 accumulation and output. The algorithm is chosen once per
// weight shape (rows, cols), bias use and class, and cached, never per n, so
// a row of y does not depend on n (the backend's batch invariance; see
// docs/gpu-backend.md for what cuBLASLt guarantees). x and y are activation
// buffers of the backend, or such a buffer offset by whole rows (a step's run
// of one class): the algorithm is one that every row offset's alignment
// allows.
int tdm_cuda_dev_gemm_bf16(struct tdm_cuda_dev *d, const uint16_t *w, int rows, int cols,
                           const uint16_t *x, int n, const float *bias, float *y,
                           enum tdm_cuda_gemm_class cls);

// CUDA graphs: between capture_begin and capture_end the stream's work
// (kernels, d2d copies, memsets, GEMMs) is recorded into a graph instead of
// run; graph_launch runs it as one unit. h2d, d2h and sync are errors while
// capturing. Pointers and sizes are fixed at capture: the caller replays a
// graph only while every buffer it used is unchanged. TDM_OK or TDM_EBACKEND.
int tdm_cuda_dev_capture_begin(struct tdm_cuda_dev *d);
int tdm_cuda_dev_capture_end(struct tdm_cuda_dev *d, void **graph);
int tdm_cuda_dev_graph_launch(struct tdm_cuda_dev *d, void *graph);
void tdm_cuda_dev_graph_free(struct tdm_cuda_dev *d, void *graph); // NULL is fine

// The detail of the last failed call on d.
const char *tdm_cuda_dev_errmsg(const struct tdm_cuda_dev *d);

// ---- events on the device stream -------------------------------------------------------------
// An event marks the work issued on d's stream so far (cudaEventRecord; timing
// off); a side waits for it on the device or on the host. A never-recorded event
// is complete. Recording is the device stream's owner's call (never while
// capturing); waiting may come from any thread. TDM_OK or TDM_EBACKEND.
int tdm_cuda_dev_event_new(struct tdm_cuda_dev *d, void **event);
void tdm_cuda_dev_event_free(struct tdm_cuda_dev *d, void *event); // NULL is fine
int tdm_cuda_dev_event_record(struct tdm_cuda_dev *d, void *event);
// The host waits for `event` as it was last recorded (cudaEventSynchronize):
// the device stream's work up to the mark, not what was issued after it.
int tdm_cuda_dev_event_sync(struct tdm_cuda_dev *d, void *event);

// ---- a side stream ---------------------------------------------------------------------------
// A second stream of d with a pinned host buffer, for copies that must not queue
// behind the device stream's work nor land in a graph it is capturing: the KV
// storage's exports and imports, which a prefill job thread or a KV receive
// thread issues while the engine's thread computes on the device stream. Its
// calls bind d to the calling thread. One thread uses a side at a time (the
// caller locks); each call returns TDM_OK or TDM_EBACKEND with the detail in
// tdm_cuda_side_errmsg.
struct tdm_cuda_side;
int tdm_cuda_side_new(struct tdm_cuda_dev *d, struct tdm_cuda_side **out, char *err, size_t errlen);
void tdm_cuda_side_free(struct tdm_cuda_side *s); // waits for its work; NULL is fine
// The side's stream, for kernel launches on it (a cudaStream_t).
void *tdm_cuda_side_stream(struct tdm_cuda_side *s);
// The side's pinned host buffer, at least `bytes` long (grown when shorter: its
// contents are then lost); NULL when pinned memory cannot be had. Valid until
// the next call that grows it or tdm_cuda_side_free; the caller must not grow
// it while a copy issued from it may still run.
void *tdm_cuda_side_host(struct tdm_cuda_side *s, size_t bytes);
// Asynchronous copies on the side stream between device memory and the side's
// host buffer (cudaMemcpyAsync from pinned memory: truly asynchronous).
int tdm_cuda_side_h2d(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes);
int tdm_cuda_side_d2h(struct tdm_cuda_side *s, void *dst, const void *src, size_t bytes);
// The side stream's later work waits on the device for `event` (of d) as it
// is recorded now (cudaStreamWaitEvent): the host does not wait.
int tdm_cuda_side_wait_event(struct tdm_cuda_side *s, void *event);
// The host waits for `event` as it is recorded now (cudaEventSynchronize).
int tdm_cuda_side_event_sync(struct tdm_cuda_side *s, void *event);
// The host waits for everything issued on the side stream.
int tdm_cuda_side_sync(struct tdm_cuda_side *s);
const char *tdm_cuda_side_errmsg(const struct tdm_cuda_side *s);

#endif
