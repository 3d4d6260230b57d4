// SPDX-License-Identifier: Apache-2.0
// cuda_backend (internal to the model module): the CUDA backend's ops tables.
// cuda_backend.c is compiled once per device API, and each build exports its
// table under its own name:
//   tdm_cuda_backend_ops      cudart + cuBLASLt, TANDEM_CUDA=ON; backend.c
//                             registers it as "cuda";
//   tdm_cuda_emu_backend_ops  the execution-model emulator (tests only); a
//                             test registers it with tdm_backend_register and
//                             loads models on "cuda" through it.
// The two are never linked into one binary.
#ifndef TDM_CUDA_BACKEND_H
#define TDM_CUDA_BACKEND_H

#include "backend.h"

extern const struct tdm_backend_ops tdm_cuda_backend_ops;
extern const struct tdm_backend_ops tdm_cuda_emu_backend_ops;

#endif
