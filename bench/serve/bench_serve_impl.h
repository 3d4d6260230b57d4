// SPDX-License-Identifier: Apache-2.0
// bench_serve internals shared by its files and its test: the seeded random
// generator, arrival times, percentiles, and the SSE stream parser that turns
// the bytes of one streaming response into timestamps, text and usage.
#ifndef TDM_BENCH_SERVE_IMPL_H
#define TDM_BENCH_SERVE_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bench_serve.h"
#include "core.h"

// ---- random numbers (core's tdm_rng: xoshiro256**, seeded by splitmix64) -------------------
// Gamma(shape, scale) (Marsaglia-Tsang); shape > 0.
double bench_rng_gamma(struct tdm_rng *r, double shape, double scale);

// Arrival offsets in seconds for n requests, as vLLM schedules them: the first
// at 0, then gaps drawn from Gamma(burstiness, 1/(rate*burstiness)) (exponential,
// i.e. a Poisson process, when burstiness is 1); all 0 when rate is infinite.
void bench_arrival_times(double *out, size_t n, double rate, double burstiness, uint64_t seed);

// The same schedule one arrival at a time, without a bound on the count (a
// --duration run): bench_arrivals_next returns the offsets bench_arrival_times
// would, in order.
struct bench_arrivals {
    struct tdm_rng rng;
    double t, rate, burstiness;
};
void bench_arrivals_init(struct bench_arrivals *a, double rate, double burstiness, uint64_t seed);
double bench_arrivals_next(struct bench_arrivals *a);

// numpy.percentile with linear interpolation over sorted[n]; p in [0, 100].
double bench_percentile(const double *sorted, size_t n, double p);

// Parses "50,90,99" into cfg->percentiles. TDM_EINVAL with a message otherwise.
int bench_parse_percentiles(struct tdm_bench_config *cfg, const char *text, char *err,
                            size_t errlen);
// Parses one "ttft:MS" / "tpot:MS" / "e2el:MS" goodput term into cfg.
int bench_parse_slo(struct tdm_bench_config *cfg, const char *term, char *err, size_t errlen);

// ---- SSE stream parser ------------------------------------------------------------------
// Fed with the body of one streaming response in arbitrary pieces. Each event is
// `data: <json>` lines ended by a blank line; `data: [DONE]` ends the stream.
// Content chunks (non-empty choices[0].text, or choices[0].delta.content for
// chat) are timestamped with the time of the feed that completed them.
struct bench_stream {
    bool chat;
    double t_start;   // send time (monotonic seconds)
    double t_last;    // the last content chunk's time
    double t_done;    // when [DONE] arrived; 0 before
    double ttft;      // seconds; valid when n_content > 0
    size_t n_content; // content chunks seen
    double *itl;      // [itl_cap] gaps between content chunks, seconds
    size_t n_itl, itl_cap;
    char *text; // [text_cap] generated text, NUL-terminated
    size_t text_len, text_cap;
    int usage_completion; // the last usage.completion_tokens; -1 when none came
    int usage_prompt;     // the last usage.prompt_tokens; -1 when none came
    bool done;            // [DONE] seen
    bool failed;          // an error event or an unparsable chunk (what: error, reason)
    char reason[32];
    char error[256];
    char *line; // [line_cap] the current, incomplete line
    size_t line_len, line_cap;
    char *event; // [event_cap] data lines of the current event, joined by '\n'
    size_t event_len, event_cap;
    bool event_has_data;
    bool oom; // an allocation failed: the request is reported failed
};

// expect_tokens sizes the buffers so that a normal stream never reallocates.
int bench_stream_init(struct bench_stream *s, bool chat, size_t expect_tokens, double t_start);
void bench_stream_fini(struct bench_stream *s);
// Consumes len bytes received at time now. Returns TDM_OK, or TDM_ENOMEM.
int bench_stream_feed(struct bench_stream *s, const char *data, size_t len, double now);
// End of body: dispatches an event left without its blank line.
void bench_stream_finish(struct bench_stream *s, double now);

#endif
