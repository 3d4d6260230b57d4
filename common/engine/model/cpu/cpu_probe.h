// SPDX-License-Identifier: Apache-2.0
// cpu_probe: machine limits measured on the spot, so benches can report
// kernels as a fraction of what this machine can do rather than in absolute
// numbers that change with the host. Each probe takes about a second.
#ifndef TDM_CPU_PROBE_H
#define TDM_CPU_PROBE_H

#include <stddef.h>

// Read bandwidth in bytes/s: nthreads threads (0 = online cores) sum disjoint
// slices of one `bytes` buffer (touched beforehand), best of `reps` passes.
// Returns 0 when the buffer cannot be allocated.
double tdm_cpu_probe_read_bw(size_t bytes, int nthreads, int reps);

// Peak f32 FMA rate in FLOP/s (2 per lane per FMA) of nthreads threads running
// independent register-only FMA chains (AVX-512 when present, else AVX2, else
// scalar).
double tdm_cpu_probe_fma_peak(int nthreads);

// Peak bf16 dot-product rate in FLOP/s (vdpbf16ps: 2 multiply-adds per f32
// lane = 64 FLOP per zmm instruction); 0 without AVX512_BF16.
double tdm_cpu_probe_bf16_peak(int nthreads);

#endif
