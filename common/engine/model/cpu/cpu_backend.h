// SPDX-License-Identifier: Apache-2.0
// cpu_backend: public extras of the CPU compute backend beyond the ops table in
// backend.h. The backend picks a SIMD path at create from the CPU's features
// (AMX tiles for bf16 matmuls, AVX-512 with BF16/VNNI, AVX2/FMA, or portable
// C); TANDEM_CPU_ISA=portable|avx2|avx512|amx forces one. Tests and benches switch paths on a live
// backend with tdm_cpu_backend_set_isa: the weight layout is the same for every path, so a switch
// needs no re-preparation.
#ifndef TDM_CPU_BACKEND_H
#define TDM_CPU_BACKEND_H

#include "backend.h"

enum tdm_cpu_isa {
    TDM_CPU_ISA_PORTABLE = 0, // plain C (whatever the compiler vectorises for baseline x86-64)
    TDM_CPU_ISA_AVX2,         // AVX2 + FMA
    TDM_CPU_ISA_AVX512,       // AVX-512 F/BW/VL/DQ + BF16 (vdpbf16ps) + VNNI
    TDM_CPU_ISA_AMX,          // AVX-512 above + AMX-TILE/AMX-BF16 for bf16 matmuls (every n)
    TDM_CPU_ISA_COUNT,
};

// "portable", "avx2", "avx512", "amx"; NULL for an out-of-range value.
const char *tdm_cpu_isa_name(enum tdm_cpu_isa isa);
// Parses a name as above; TDM_EINVAL for an unknown one.
int tdm_cpu_isa_parse(const char *name, enum tdm_cpu_isa *out);
// Whether this CPU (and OS) can run the path.
int tdm_cpu_isa_supported(enum tdm_cpu_isa isa);
// The best supported path.
enum tdm_cpu_isa tdm_cpu_isa_best(void);
// The path a new backend takes: TANDEM_CPU_ISA when set, else the best
// (amx where the CPU has AMX).
// TDM_EINVAL (err says why) for an unknown name or one this CPU cannot run.
int tdm_cpu_isa_default(enum tdm_cpu_isa *out, char *err, size_t errlen);
// What computes matmuls of weights of type `type` on path isa, for every
// batch size (the choice never depends on n): "amx-bf16 tiles",
// "avx512 vdpbf16ps", "avx512 vnni", "avx512 fma", "avx2 fma", "portable C".
const char *tdm_cpu_isa_matmul_path(enum tdm_cpu_isa isa, enum tdm_wtype type);

// Switches the SIMD path of a backend; TDM_EINVAL when the CPU cannot run it.
int tdm_cpu_backend_set_isa(struct tdm_backend *be, enum tdm_cpu_isa isa);
enum tdm_cpu_isa tdm_cpu_backend_isa(const struct tdm_backend *be);
// Compute threads of the backend (the caller thread counts as one).
int tdm_cpu_backend_num_threads(const struct tdm_backend *be);

#endif
