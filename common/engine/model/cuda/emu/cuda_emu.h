// SPDX-License-Identifier: Apache-2.0
// cuda_emu: a small emulator of the CUDA execution model, so that the CUDA
// backend's kernel bodies (common/engine/model/cuda/cuda_kernels.cuh) also compile as
// host C++ and run in CI on a machine without a GPU. It is a test tool, never
// a product path: nothing in a served binary links it.
//
// What it models:
//   - threadIdx, blockIdx, blockDim, gridDim (one value per running fiber);
//   - a block's threads as cooperative fibers (ucontext) on the calling OS
//     thread; blocks run one after another, so a function-local `static`
//     array is exactly one block's __shared__ memory;
//   - __syncthreads: a fiber yields until every thread of its block is there;
//     a barrier some threads reach after others exited is reported as a bug;
//   - warp shuffles (__shfl_xor_sync, __shfl_down_sync) with a full mask: the
//     32 lanes of a warp meet at a warp barrier, exchange through a slot per
//     lane, and meet again before the slots are reused;
//   - atomics: fibers never run at the same time, so a plain read-modify-write
//     is atomic; __threadfence and __ldcg (an L2 load) are therefore plain;
//   - the warp-level matrix instructions mma.sync m16n8k16 (bf16 in, f32
//     accumulate) and ldmatrix m8n8.x4 (plain and .trans): every lane gives
//     its fragment registers or row address at a warp barrier and gets the
//     elements the PTX ISA's fragment layouts give it;
//   - 16-byte vector loads (tdm_emu_ld16, __ldg, __ldcs of a uint4), which
//     must be 16-byte aligned.
// What it does not model: timing, memory spaces (device memory is host memory),
// races between threads (a fiber runs until it waits), partial-warp masks.
// Kernel bugs it detects (deadlock, a shuffle or matrix instruction with
// exited lanes, a barrier with exited threads, a block size that is not a
// multiple of 32, a misaligned 16-byte load or ldmatrix row) abort with a
// message: the emulator runs only in tests, where that is the useful outcome.
#ifndef TDM_CUDA_EMU_H
#define TDM_CUDA_EMU_H

#ifdef __CUDACC__
#error "cuda_emu.h is the host emulator; nvcc builds use the real CUDA headers"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_)
    {
    }
};

namespace tdm_emu
{
// The running fiber's coordinates (set by the scheduler at every switch).
extern dim3 cur_thread_idx, cur_block_idx, cur_block_dim, cur_grid_dim;

// Runs body once per thread of every block of grid (blocks in x, y, z order).
// shmem (dynamic shared memory) must be 0: kernels size their __shared__
// arrays statically (template parameters), which both compilers accept.
// `stream` as tdm_emu_stream_work's; `name` the kernel's (the launch log).
void launch(void *stream, const char *name, dim3 grid, dim3 block, size_t shmem,
            const std::function<void()> &body);
// Block barrier and warp barrier of the running fiber.
void syncthreads();
// Exchanges a 64-bit value among the running fiber's warp: every lane stores
// `mine`, and gets the value lane `src` stored (its own when src is outside
// the warp).
uint64_t warp_exchange(uint64_t mine, int src);
// Lane of the running fiber in its warp.
int lane_id();
// A warp collective wider than a shuffle: every lane stores `bytes` (at most
// 32) from `mine`, and `all` gets the 32 lanes' bytes in lane order.
void warp_gather(const void *mine, size_t bytes, void *all);
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 and
// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16 of the PTX ISA, as warp
// collectives over warp_gather (cuda_mma.cuh has their fragment layouts).
void mma_m16n8k16_bf16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]);
void ldmatrix_x4(uint32_t r[4], const void *row, bool trans);
// Blocks launched since the process started (tests check that work happened).
unsigned long long blocks_run();
// Aborts naming a kernel bug the emulator found outside the scheduler (a
// misaligned vector load).
[[noreturn]] void kernel_bug(const char *what);

// A kernel and its arguments evaluated now (by value), for launch or capture.
template <class F, class... A> std::function<void()> bind_args(F f, A... a)
{
    return [=]() { f(a...); };
}
} // namespace tdm_emu

// Graphs, streams, events and the launch log: the C API of emu/cuda_emu_api.h.
#include "cuda_emu_api.h"

#define threadIdx (::tdm_emu::cur_thread_idx)
#define blockIdx (::tdm_emu::cur_block_idx)
#define blockDim (::tdm_emu::cur_block_dim)
#define gridDim (::tdm_emu::cur_grid_dim)

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// One block runs at a time and its fibers share the calling OS thread, so a
// function-local static is that block's shared memory.
#define __shared__ static
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))

// The 16-byte vector types the kernels load (CUDA's are 16-byte aligned too).
struct __align__(16) uint4
{
    unsigned x, y, z, w;
};
struct __align__(16) float4
{
    float x, y, z, w;
};

// A 16-byte load: *(const uint4 *)p on the GPU, where an address that is not
// 16-byte aligned faults, so it is a kernel bug here too. Read through memcpy
// (the memory may hold any element type).
static inline uint4 tdm_emu_ld16(const void *p)
{
    if ((uintptr_t)p % 16 != 0)
        ::tdm_emu::kernel_bug("16-byte load from an address not 16-byte aligned");
    uint4 v;
    memcpy(&v, p, sizeof v);
    return v;
}

// Memory is the host's, one block runs at a time, and loads never see a stale
// cache: fences have nothing to order and an L2-only load is a load.
static inline void __threadfence(void)
{
}
template <class T> static inline T __ldcg(const T *p)
{
    return *p;
}

// A product rounded on its own (never contracted into an FMA).
static inline float __fmul_rn(float a, float b)
{
    volatile float p = a * b;
    return p;
}

static inline void __syncthreads(void)
{
    ::tdm_emu::syncthreads();
}

template <class T> static inline uint64_t tdm_emu_bits(T v)
{
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 64 bits");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}
template <class T> static inline T tdm_emu_from_bits(uint64_t u)
{
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}

// Full-warp shuffles only (mask 0xffffffff, width 32), which is all the
// kernels use.
template <class T>
static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32)
{
    (void)mask;
    (void)width;
    int src = ::tdm_emu::lane_id() ^ lane_mask;
    return tdm_emu_from_bits<T>(::tdm_emu::warp_exchange(tdm_emu_bits(v), src));
}
template <class T>
static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32)
{
    (void)mask;
    (void)width;
    int src = ::tdm_emu::lane_id() + (int)delta;
    return tdm_emu_from_bits<T>(::tdm_emu::warp_exchange(tdm_emu_bits(v), src));
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32)
{
    (void)mask;
    (void)width;
    return tdm_emu_from_bits<T>(::tdm_emu::warp_exchange(tdm_emu_bits(v), src_lane & 31));
}

// Fibers never run concurrently: read-modify-write is atomic by construction.
template <class T> static inline T atomicAdd(T *p, T v)
{
    T old = *p;
    *p = old + v;
    return old;
}
template <class T> static inline T atomicMax(T *p, T v)
{
    T old = *p;
    if (v > old)
        *p = v;
    return old;
}

// The GEMV's loads: __ldg (read-only path) and __ldcs (streaming) are plain
// copies here; a 16-byte one must be aligned, as on the GPU.
static inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w)
{
    return uint4{x, y, z, w};
}
template <class T> static inline T __ldg(const T *p)
{
    if (sizeof(T) == 16 && (uintptr_t)p % 16 != 0)
        ::tdm_emu::kernel_bug("16-byte load from an address not 16-byte aligned");
    T v;
    memcpy(&v, p, sizeof v);
    return v;
}
template <class T> static inline T __ldcs(const T *p)
{
    return __ldg(p);
}

static inline float __fdividef(float a, float b)
{
    return a / b;
}
static inline float rsqrtf(float x)
{
    return 1.0f / sqrtf(x);
}

#define TDM_CUDA_LAUNCH(kernel, grid, block, shmem, stream, ...)                                   \
    ::tdm_emu::launch((void *)(stream), #kernel, (grid), (block), (shmem),                         \
                      ::tdm_emu::bind_args(kernel, __VA_ARGS__))

#endif
