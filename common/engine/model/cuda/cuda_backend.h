// SPDX-License-Identifier: Apache-2.0
// cuda_backend (internal to the model module): the CUDA backend's ops tables.
// cuda_backend.c is compiled once per device API, and each build exports its
// table under its own name:
//   tdm_cuda_backend_ops      cudart + cuBLASLt, TANDEM_CUDA=ON, inside the
//                             module libtandem-cuda.so (cuda_module.c);
//   tdm_cuda_emu_backend_ops  the execution-model emulator: inside
//                             libtandem-cuda-emu.so, and linked into tests,
//                             which register it with tdm_backend_register and
//                             load models on "cuda" through it.
// The two never meet in one binary: the real one exists only in its module.
#ifndef TDM_CUDA_BACKEND_H
#define TDM_CUDA_BACKEND_H

#include "backend.h"

extern const struct tdm_backend_ops tdm_cuda_backend_ops;
extern const struct tdm_backend_ops tdm_cuda_emu_backend_ops;

// Device memory kept free beyond the KV pool for what grows after it is made
// (the GEMM input and attention scratch buffers, cuBLASLt's kernels).
#define TDM_CUDA_KV_HEADROOM ((size_t)256 << 20)

// The KV pool of one instance, in blocks of block_bytes, on a device of total_b
// bytes with free_b bytes free now, of which this process already holds held_b
// (weights, buffers: tdm_cuda_dev_held). --gpu-memory-utilization has vLLM's
// per-instance meaning: this instance may use utilization x total, whatever
// other processes hold, so two instances at 0.4 share one GPU. The pool gets
// utilization x total_b - held_b - TDM_CUDA_KV_HEADROOM. TDM_ECAPACITY with a
// message when that leaves no block, or when the device's free memory cannot
// hold the pool and the headroom (other processes took it: the message names
// both figures). Pure arithmetic, in both builds (tested on fake figures).
int tdm_cuda_kv_budget(size_t total_b, size_t free_b, size_t held_b, double utilization,
                       size_t block_bytes, int block_size, int *num_blocks, char *err,
                       size_t errlen);

#endif
