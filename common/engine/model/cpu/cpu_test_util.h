// SPDX-License-Identifier: Apache-2.0
// cpu_test_util: what the CPU backend's tests share (cpu_backend_test,
// cpu_amx_test): a seeded random fill, bf16 rounding as weights get it, and a
// backend made or the test failed. Tests only; include after cmocka.h. A test
// defines CPU_TEST_SEED before including it for its own sequence.
#ifndef TDM_CPU_TEST_UTIL_H
#define TDM_CPU_TEST_UTIL_H

#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "core.h"
#include "cpu_impl.h"
#include "hf.h"

#ifndef CPU_TEST_SEED
#define CPU_TEST_SEED 0x9e3779b97f4a7c15ull
#endif

static uint64_t cpu_test_rng = CPU_TEST_SEED;

// Uniform in [-1, 1).
static inline float frand(void)
{
    cpu_test_rng = cpu_test_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((double)(cpu_test_rng >> 40) / (double)(1ull << 23) - 1.0);
}

static inline void fill(float *x, size_t n, float amp)
{
    for (size_t i = 0; i < n; i++)
        x[i] = frand() * amp;
}

// f rounded to the nearest bf16 (ties to even), as an f32.
static inline float bf16_round(float f)
{
    return tdm_bf16_to_f32(tdm_f32_to_bf16(f));
}

static inline struct tdm_backend *make_backend(const struct tdm_backend_ops *ops, int threads)
{
    struct tdm_backend *be = NULL;
    char err[256] = "";
    if (ops->create(&be, threads, 0, err, sizeof err) != TDM_OK)
        fail_msg("create: %s", err);
    return be;
}

#endif
