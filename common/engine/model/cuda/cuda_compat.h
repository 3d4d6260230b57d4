// SPDX-License-Identifier: Apache-2.0
// cuda_compat: what a kernel file includes instead of the CUDA headers. Under
// nvcc (__CUDACC__) it is the real CUDA runtime and TDM_CUDA_LAUNCH is a
// <<<grid, block, shmem, stream>>> launch; in a host C++ build it is the
// execution-model emulator of emu/cuda_emu.h (a test tool), whose launch runs
// the kernel's blocks on the calling thread. Kernel bodies are therefore written
// once and compiled by both.
#ifndef TDM_CUDA_COMPAT_H
#define TDM_CUDA_COMPAT_H

#ifdef __CUDACC__
#include <cuda_runtime.h>
#include <stdint.h>
#define TDM_CUDA_LAUNCH(kernel, grid, block, shmem, stream, ...)                                   \
    kernel<<<(grid), (block), (shmem), (cudaStream_t)(stream)>>>(__VA_ARGS__)
#else
#include "emu/cuda_emu.h"
#endif

#endif
