// SPDX-License-Identifier: Apache-2.0
// cuda_kernels_emu: the CUDA backend's kernels and launchers compiled by g++
// against the execution-model emulator (cuda_emu.h), so CI runs every kernel
// body without a GPU. Test builds only; the same source is compiled by nvcc in
// cuda_kernels.cu.
#include "../cuda_compat.h"

#include "../cuda_launch.cuh"
