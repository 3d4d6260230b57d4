// SPDX-License-Identifier: Apache-2.0
// cuda_emu_api: the CUDA emulator's C-linkage API (emu/cuda_emu.cpp), shared by
// the C++ emulator header (cuda_emu.h), the emulated device API
// (cuda_dev_emu.c) and the C tests that drive deferred mode or read the
// launch log. Test tool only, as the emulator.
#ifndef TDM_CUDA_EMU_API_H
#define TDM_CUDA_EMU_API_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

// Stream capture (CUDA graphs) on the emulator: between begin and end, launches
// and the emulated device API's stream work are recorded instead of run; a
// graph replays them in order. C linkage for the emulated device API.
void tdm_emu_capture_begin(void);
// The recorded work as a graph (NULL if nothing was being captured).
void *tdm_emu_capture_end(void);
int tdm_emu_capturing(void);
// Stream work fn(arg copy) (arg_bytes copied now) on `stream`: NULL is the
// device stream (the one a capture records), else a tdm_emu_stream_new one.
// Recorded while capturing the device stream, queued in deferred mode, run at
// once otherwise.
void tdm_emu_stream_work(void *stream, void (*fn)(void *arg), const void *arg, size_t arg_bytes);
void tdm_emu_graph_launch(void *graph);
void tdm_emu_graph_free(void *graph);
// Graphs launched since the process started (tests check replays happened).
unsigned long long tdm_emu_graph_launches(void);

// Streams and events. By default the emulator runs stream work when it is
// issued, so every stream is always idle and every event complete. Deferred
// mode (tdm_emu_defer(1), for tests) models a device that runs behind the
// host, as far behind as the host allows: work issued on a stream is queued,
// and runs, in issue order, only when something waits for it: a sync of the
// stream or a host copy on it, an event sync, or queued work of another stream
// that waits for an event (tdm_emu_stream_wait_event) and is itself run. So a
// test sees exactly what a wait waited for: tdm_emu_pending tells how much of
// a stream's work is still queued.
void tdm_emu_defer(int on);
// Work items issued on `stream` (NULL: the device stream) and not yet run.
unsigned long long tdm_emu_pending(void *stream);
void *tdm_emu_stream_new(void);
void tdm_emu_stream_free(void *stream); // runs what is queued first
// Runs everything issued on `stream` so far (cudaStreamSynchronize).
void tdm_emu_stream_sync(void *stream);
// Events: record marks the work issued on `stream` so far; sync runs that
// stream up to the mark; wait_event makes `stream` run it up to the mark
// before its later work (cudaStreamWaitEvent). A never-recorded event is
// complete, as in CUDA.
void *tdm_emu_event_new(void);
void tdm_emu_event_free(void *event);
void tdm_emu_event_record(void *event, void *stream);
void tdm_emu_event_sync(void *event);
void tdm_emu_stream_wait_event(void *stream, void *event);

// The launch log (tests: issue 26's launch budget): while on, every kernel
// launch and every emulated GEMM (tdm_emu_log_gemm from the device API) is
// recorded with its grid's CTA count (0 for a GEMM: cuBLASLt picks its own).
struct tdm_emu_launch {
    // The kernel as written at the launch; a GEMM: "gemm" (the decode class's
    // algorithm) or "gemm_prompt" (the prompt class's: cuda_dev.h).
    const char *name;
    unsigned long long ctas;
    int gemm_n; // a GEMM's rows (its n); 0 for a kernel
};
void tdm_emu_launch_log(int on); // on clears the log
// Copies up to cap entries in launch order; returns how many were logged.
size_t tdm_emu_launches(struct tdm_emu_launch *out, size_t cap);
void tdm_emu_log_launch(const char *name, unsigned long long ctas);
// Host waits for the device stream through the emulated device API
// (cuda_dev_emu.c: h2d, d2h, sync, event sync) since the process started: a step's round
// trips between the host and the device (issue 26 item 1).
unsigned long long tdm_emu_host_waits(void);
void tdm_emu_log_gemm(const char *name, int n);

#ifdef __cplusplus
}
#endif

#endif
