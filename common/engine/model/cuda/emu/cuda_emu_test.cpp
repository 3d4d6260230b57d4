// SPDX-License-Identifier: Apache-2.0
// Tests of the CUDA execution-model emulator itself: every (block, thread) of a
// 3-D grid runs once with the right coordinates; __syncthreads orders shared
// memory writes before reads across the block; __shfl_xor_sync and
// __shfl_down_sync exchange between the right lanes; kernel bugs the emulator
// promises to catch (a barrier some threads skip, a shuffle with exited lanes,
// a block size that is not a multiple of 32, a misaligned 16-byte load) abort
// the process (checked in a child).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
// Debian's cmocka.h has no extern "C" of its own.
extern "C" {
#include <cmocka.h>
}

#include <signal.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cuda_compat.h"

static __global__ void coords_kernel(int *hits, unsigned *seen_dims)
{
    unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    unsigned nt = blockDim.x * blockDim.y * blockDim.z;
    hits[b * nt + t] += 1;
    seen_dims[0] = gridDim.x * 100 + gridDim.y * 10 + gridDim.z;
    seen_dims[1] = blockDim.x * 100 + blockDim.y * 10 + blockDim.z;
}

static void test_coords(void **state)
{
    (void)state;
    static int hits[2 * 3 * 2 * 64];
    unsigned dims[2] = {0, 0};
    unsigned long long before = tdm_emu::blocks_run();
    TDM_CUDA_LAUNCH(coords_kernel, dim3(2, 3, 2), dim3(16, 2, 2), 0, nullptr, hits, dims);
    for (int i = 0; i < 2 * 3 * 2 * 64; i++)
        assert_int_equal(hits[i], 1);
    assert_int_equal(dims[0], 232);
    assert_int_equal(dims[1], 1622);
    assert_int_equal(tdm_emu::blocks_run() - before, 12);
}

// Each thread writes its slot, then reads its neighbour's: without a real
// barrier the first threads would read slots not yet written.
static __global__ void rotate_kernel(const int *in, int *out)
{
    __shared__ int s[256];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * blockDim.x + t] * 2;
    __syncthreads();
    int v = s[(t + 1) % blockDim.x];
    __syncthreads();
    s[t] = v + 1; // reuse after the second barrier must not disturb readers
    __syncthreads();
    out[blockIdx.x * blockDim.x + t] = s[(t + blockDim.x - 1) % blockDim.x];
}

static void test_syncthreads(void **state)
{
    (void)state;
    int in[2 * 256], out[2 * 256];
    for (int i = 0; i < 512; i++)
        in[i] = i * 7 + 3;
    TDM_CUDA_LAUNCH(rotate_kernel, dim3(2), dim3(256), 0, nullptr, in, out);
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < 256; t++) {
            int left = (t + 255) % 256;           // who wrote s[left] in phase 3
            int src = b * 256 + (left + 1) % 256; // what left had read
            assert_int_equal(out[b * 256 + t], in[src] * 2 + 1);
        }
}

static __global__ void shuffle_kernel(const float *in, float *xor_sum, float *down, int *lane_src)
{
    int t = threadIdx.x;
    float v = in[t];
    float s = v;
    for (int o = 16; o > 0; o >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, o);
    xor_sum[t] = s;
    down[t] = __shfl_down_sync(0xffffffffu, v, 3);
    lane_src[t] = __shfl_xor_sync(0xffffffffu, t, 5);
}

static void test_shuffles(void **state)
{
    (void)state;
    float in[64], xs[64], dn[64];
    int src[64];
    for (int i = 0; i < 64; i++)
        in[i] = (float)(i * i % 17);
    TDM_CUDA_LAUNCH(shuffle_kernel, dim3(1), dim3(64), 0, nullptr, in, xs, dn, src);
    for (int w = 0; w < 2; w++) {
        float total = 0;
        for (int l = 0; l < 32; l++)
            total += in[w * 32 + l];
        for (int l = 0; l < 32; l++) {
            int t = w * 32 + l;
            assert_true(xs[t] == total); // small integers: exact in any order
            assert_true(dn[t] == (l + 3 < 32 ? in[t + 3] : in[t]));
            assert_int_equal(src[t], w * 32 + (l ^ 5));
        }
    }
}

static __global__ void atomic_kernel(int *counter)
{
    atomicAdd(counter, 1);
}

static void test_atomics(void **state)
{
    (void)state;
    int c = 0;
    TDM_CUDA_LAUNCH(atomic_kernel, dim3(5), dim3(96), 0, nullptr, &c);
    assert_int_equal(c, 5 * 96);
}

// ---- bugs the emulator must refuse ----------------------------------------------------------
static __global__ void divergent_barrier_kernel(int *x)
{
    if (threadIdx.x >= 32)
        return;
    __syncthreads();
    x[threadIdx.x] = 1;
}

static __global__ void half_warp_shuffle_kernel(int *x)
{
    if (threadIdx.x % 32 >= 16)
        return;
    x[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static __global__ void plain_kernel(int *x)
{
    x[threadIdx.x] = 1;
}

// A 16-byte load 4 bytes past an aligned address (a fault on the GPU).
static __global__ void misaligned_load_kernel(int *x)
{
    uint4 v = tdm_emu_ld16(x + 1);
    x[threadIdx.x] = (int)v.x;
}

static int child_signal(int which)
{
    pid_t pid = fork();
    if (pid == 0) {
        alignas(16) static int buf[1024]; // so buf + 1 is misaligned for 16 bytes
        // The child's abort message is expected; keep the test log readable.
        (void)!freopen("/dev/null", "w", stderr);
        if (which == 0)
            TDM_CUDA_LAUNCH(divergent_barrier_kernel, dim3(1), dim3(64), 0, nullptr, buf);
        else if (which == 1)
            TDM_CUDA_LAUNCH(half_warp_shuffle_kernel, dim3(1), dim3(32), 0, nullptr, buf);
        else if (which == 2)
            TDM_CUDA_LAUNCH(plain_kernel, dim3(1), dim3(48), 0, nullptr, buf);
        else
            TDM_CUDA_LAUNCH(misaligned_load_kernel, dim3(1), dim3(32), 0, nullptr, buf);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFSIGNALED(st) ? WTERMSIG(st) : 0;
}

static void test_bug_detection(void **state)
{
    (void)state;
    assert_int_equal(child_signal(0), SIGABRT);
    assert_int_equal(child_signal(1), SIGABRT);
    assert_int_equal(child_signal(2), SIGABRT);
    assert_int_equal(child_signal(3), SIGABRT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_coords),        cmocka_unit_test(test_syncthreads),
        cmocka_unit_test(test_shuffles),      cmocka_unit_test(test_atomics),
        cmocka_unit_test(test_bug_detection),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
