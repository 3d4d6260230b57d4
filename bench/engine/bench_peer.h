// SPDX-License-Identifier: Apache-2.0
// bench_peer: llama.cpp's figures on this machine, measured by
// bench/peer/llamacpp.sh, read by tandem-bench-engine --peer FILE and related
// to Tandem's figures from the same run. The peer is built from a llama.cpp
// source folder the user gives the script; nothing of it is in this repository
// and no figure of it is written in the code (docs/engine.md, "llama.cpp on
// this machine").
//
// The file (llamacpp.sh writes it; tokens/s as llama-bench reports them, -t as
// "threads"; other keys, such as the serve figures, are ignored here):
//   {"commit": "81ff7abe5...", "threads": 2,
//    "bf16": {"pp512": 340.1, "tg128": 33.0}, "q8_0": {"pp512": 227.0, "tg128": 40.2}}
// The ratios printed are Tandem / llama.cpp, so above 1 is Tandem faster:
//   decode    Tandem's batch-1 tok/s / tg128 (llama-bench's 128-token decode)
//   prefill   Tandem's prefill-512 tok/s / pp512 (one 512-token prompt)
// bf16 weights against llama.cpp's bf16 GGUF, Tandem's int8 weights against
// Q8_0 (both 8-bit weights with a scale per block or row).
//
// Every type here is caller storage; nothing allocates beyond the call.
#ifndef TDM_BENCH_PEER_H
#define TDM_BENCH_PEER_H

#include <stddef.h>

// One weight format's llama-bench figures, tokens/s.
struct tdm_bench_peer_figures {
    double pp512; // prompt processing of 512 tokens
    double tg128; // text generation of 128 tokens (batch 1)
};

struct tdm_bench_peer {
    char commit[48]; // llama.cpp commit the peer was built from (as written; shortened on print)
    int threads;     // llama-bench -t (0 when the file does not say)
    struct tdm_bench_peer_figures bf16, q8_0;
};

// Tandem's figures from this run, tokens/s; 0 = not measured (the run's
// --batches or --prefill did not include 1 or 512, or --bf16-only).
struct tdm_bench_peer_tandem {
    double bf16_b1, bf16_prefill512;
    double int8_b1, int8_prefill512;
};

// Reads the document in `json` (NUL-terminated). Returns TDM_OK, or TDM_EPROTO
// with err naming the bad field ("bf16.tg128 missing or not a positive number").
// `out` is written on TDM_OK only.
int tdm_bench_peer_parse(struct tdm_bench_peer *out, const char *json, char *err, size_t errlen);

// tdm_bench_peer_parse of the file at `path`; err also names the file
// ("peer.json: not a JSON object", "x.json: No such file or directory").
int tdm_bench_peer_load(struct tdm_bench_peer *out, const char *path, char *err, size_t errlen);

// The two lines tandem-bench-engine prints: llama.cpp's figures, then the
// ratios of Tandem's to them ("not measured" where `t` has 0). `p` NULL: one
// line saying no peer figures were given and how to measure them. Always
// NUL-terminates buf when buflen > 0.
void tdm_bench_peer_format(const struct tdm_bench_peer *p, const struct tdm_bench_peer_tandem *t,
                           char *buf, size_t buflen);

#endif
