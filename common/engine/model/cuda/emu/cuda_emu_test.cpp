// SPDX-License-Identifier: Apache-2.0
// Tests of the CUDA execution-model emulator itself: every (block, thread) of a
// 3-D grid runs once with the right coordinates; __syncthreads orders shared
// memory writes before reads across the block; __shfl_xor_sync and
// __shfl_down_sync exchange between the right lanes; mma.sync m16n8k16 and
// ldmatrix x4 (plain and .trans) hand every lane the elements the PTX ISA's
// fragment layouts give it, written out here register by register; kernel
// bugs the emulator promises to catch (a barrier some threads skip, a shuffle
// or mma with exited lanes, a block size that is not a multiple of 32, a
// misaligned 16-byte load or ldmatrix row) abort the process (checked in a
// child).
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
#include "cuda_mma.cuh"

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

// ---- warp-level matrix instructions --------------------------------------------------------
// Small distinct integers: every element tells where it came from, and
// A B + C is exact in f32 whatever the summation order.
static float mma_a_val(int row, int k)
{
    return (float)(row * 16 + k - 128);
}
static float mma_b_val(int k, int n)
{
    return (float)(k * 8 + n - 63);
}
static float mma_c_val(int row, int n)
{
    return (float)(row * 8 + n) * 1024.0f + 0.5f;
}

static uint32_t bf16_pair(float lo, float hi)
{
    uint32_t a, b;
    memcpy(&a, &lo, 4);
    memcpy(&b, &hi, 4);
    return (a >> 16) | (b >> 16) << 16; // exact: the values are small integers
}

// Each lane's registers built from the PTX ISA's layout, spelt out.
static __global__ void mma_kernel(float *d_out)
{
    int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    uint32_t a[4] = {bf16_pair(mma_a_val(g, 2 * t), mma_a_val(g, 2 * t + 1)),
                     bf16_pair(mma_a_val(g + 8, 2 * t), mma_a_val(g + 8, 2 * t + 1)),
                     bf16_pair(mma_a_val(g, 2 * t + 8), mma_a_val(g, 2 * t + 9)),
                     bf16_pair(mma_a_val(g + 8, 2 * t + 8), mma_a_val(g + 8, 2 * t + 9))};
    uint32_t b[2] = {bf16_pair(mma_b_val(2 * t, g), mma_b_val(2 * t + 1, g)),
                     bf16_pair(mma_b_val(2 * t + 8, g), mma_b_val(2 * t + 9, g))};
    float c[4] = {mma_c_val(g, 2 * t), mma_c_val(g, 2 * t + 1), mma_c_val(g + 8, 2 * t),
                  mma_c_val(g + 8, 2 * t + 1)};
    float d[4];
    tdm_mma_bf16_16816(d, a, b, c);
    for (int e = 0; e < 4; e++)
        d_out[threadIdx.x * 4 + e] = d[e];
}

static void test_mma_layout(void **state)
{
    (void)state;
    float d[64 * 4];
    TDM_CUDA_LAUNCH(mma_kernel, dim3(1), dim3(64), 0, nullptr, d);
    for (int lane = 0; lane < 64; lane++) {
        int g = lane % 32 / 4, t = lane % 4;
        for (int e = 0; e < 4; e++) {
            int row = g + (e / 2) * 8, col = 2 * t + e % 2;
            double want = mma_c_val(row, col);
            for (int k = 0; k < 16; k++)
                want += (double)mma_a_val(row, k) * mma_b_val(k, col);
            if (d[lane * 4 + e] != (float)want)
                fail_msg("lane %d d%d (row %d col %d): %g, want %g", lane, e, row, col,
                         (double)d[lane * 4 + e], want);
        }
    }
}

// Four 8 x 8 matrices of b16 value m * 64 + row * 8 + col, rows 24 elements
// (48 bytes) apart, matrix m at rows 8 * perm[m]: the lanes' row addresses are
// what places them.
static const int ldm_perm[4] = {2, 0, 3, 1};

static __global__ void ldmatrix_kernel(const uint16_t *rows, uint32_t *plain, uint32_t *trans)
{
    int lane = threadIdx.x % 32, m = lane / 8, i = lane % 8;
    const uint16_t *row = rows + (size_t)(ldm_perm[m] * 8 + i) * 24;
    uint32_t r[4], rt[4];
    tdm_ldmatrix_x4(r, row);
    tdm_ldmatrix_x4_trans(rt, row);
    for (int k = 0; k < 4; k++) {
        plain[threadIdx.x * 4 + k] = r[k];
        trans[threadIdx.x * 4 + k] = rt[k];
    }
}

static void test_ldmatrix(void **state)
{
    (void)state;
    alignas(16) static uint16_t rows[32 * 24];
    for (int m = 0; m < 4; m++)
        for (int i = 0; i < 8; i++)
            for (int j = 0; j < 8; j++)
                rows[(ldm_perm[m] * 8 + i) * 24 + j] = (uint16_t)(m * 64 + i * 8 + j);
    uint32_t plain[64 * 4], trans[64 * 4];
    TDM_CUDA_LAUNCH(ldmatrix_kernel, dim3(1), dim3(64), 0, nullptr, rows, plain, trans);
    for (int lane = 0; lane < 64; lane++)
        for (int m = 0; m < 4; m++) {
            int l = lane % 32, r = l / 4, c = 2 * (l % 4);
            uint32_t want = (uint32_t)(m * 64 + r * 8 + c) | (uint32_t)(m * 64 + r * 8 + c + 1)
                                                                 << 16;
            uint32_t want_t = (uint32_t)(m * 64 + c * 8 + r) | (uint32_t)(m * 64 + (c + 1) * 8 + r)
                                                                   << 16;
            if (plain[lane * 4 + m] != want || trans[lane * 4 + m] != want_t)
                fail_msg("lane %d r%d: %#x / %#x (.trans), want %#x / %#x", lane, m,
                         plain[lane * 4 + m], trans[lane * 4 + m], want, want_t);
        }
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

static __global__ void half_warp_mma_kernel(int *x)
{
    if (threadIdx.x % 32 >= 16)
        return;
    uint32_t a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    float c[4] = {0, 0, 0, 0}, d[4];
    tdm_mma_bf16_16816(d, a, b, c);
    x[threadIdx.x] = (int)d[0];
}

static __global__ void misaligned_ldmatrix_kernel(int *x)
{
    uint32_t r[4];
    tdm_ldmatrix_x4(r, (const uint16_t *)x + 4 * (threadIdx.x == 9));
    x[threadIdx.x] = (int)r[0];
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
        else if (which == 3)
            TDM_CUDA_LAUNCH(misaligned_load_kernel, dim3(1), dim3(32), 0, nullptr, buf);
        else if (which == 4)
            TDM_CUDA_LAUNCH(half_warp_mma_kernel, dim3(1), dim3(32), 0, nullptr, buf);
        else
            TDM_CUDA_LAUNCH(misaligned_ldmatrix_kernel, dim3(1), dim3(32), 0, nullptr, buf);
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
    assert_int_equal(child_signal(4), SIGABRT);
    assert_int_equal(child_signal(5), SIGABRT);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_coords),        cmocka_unit_test(test_syncthreads),
        cmocka_unit_test(test_shuffles),      cmocka_unit_test(test_atomics),
        cmocka_unit_test(test_mma_layout),    cmocka_unit_test(test_ldmatrix),
        cmocka_unit_test(test_bug_detection),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
