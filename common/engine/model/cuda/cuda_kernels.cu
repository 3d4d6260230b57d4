// SPDX-License-Identifier: Apache-2.0
// cuda_kernels.cu: the CUDA backend's kernels and launchers for the GPU (nvcc).
// The kernel bodies and launch shapes live in cuda_kernels.cuh and
// cuda_launch.cuh, shared with the emulator build (emu/cuda_kernels_emu.cpp).
#include "cuda_compat.h"

#include "cuda_launch.cuh"
