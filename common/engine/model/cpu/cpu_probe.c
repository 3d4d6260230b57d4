// SPDX-License-Identifier: Apache-2.0
// cpu_probe: read bandwidth and compute peaks of this machine (see
// cpu_probe.h). Threads start together on a flag and the wall time from the
// first start to the last finish is what counts.
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "core.h"
#include "cpu_backend.h"
#include "cpu_probe.h"

enum probe_kind { PROBE_READ, PROBE_FMA, PROBE_BF16 };

struct probe_arg {
    enum probe_kind kind;
    const float *data;
    size_t count;    // floats in this thread's slice
    long iters;      // compute probes: loop iterations
    int isa;         // TDM_CPU_ISA_*
    _Atomic int *go; // 0: wait, 1: run, -1: abandon
    double t_start, t_end;
    volatile float sink;
};

#define PROBE_CHAINS 12

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
static float read_avx512(const float *p, size_t n)
{
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
        a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
        a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
        a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
    }
    float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    for (; i < n; i++)
        s += p[i];
    return s;
}

static float fma_avx512(long iters)
{
    __m512 acc[PROBE_CHAINS];
    for (int c = 0; c < PROBE_CHAINS; c++)
        acc[c] = _mm512_set1_ps((float)c * 1e-3f);
    const __m512 m = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < PROBE_CHAINS; c++)
            acc[c] = _mm512_fmadd_ps(acc[c], m, b);
    }
    __m512 s = acc[0];
    for (int c = 1; c < PROBE_CHAINS; c++)
        s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}

static float bf16_avx512(long iters)
{
    __m512 acc[PROBE_CHAINS];
    for (int c = 0; c < PROBE_CHAINS; c++)
        acc[c] = _mm512_setzero_ps();
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80),
                   b = (__m512bh)_mm512_set1_epi32(0x33d633d6);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < PROBE_CHAINS; c++)
            acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
    }
    __m512 s = acc[0];
    for (int c = 1; c < PROBE_CHAINS; c++)
        s = _mm512_add_ps(s, acc[c]);
    return _mm512_reduce_add_ps(s);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
static float fma_avx2(long iters)
{
    __m256 acc[PROBE_CHAINS];
    for (int c = 0; c < PROBE_CHAINS; c++)
        acc[c] = _mm256_set1_ps((float)c * 1e-3f);
    const __m256 m = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < PROBE_CHAINS; c++)
            acc[c] = _mm256_fmadd_ps(acc[c], m, b);
    }
    float out[8];
    __m256 s = acc[0];
    for (int c = 1; c < PROBE_CHAINS; c++)
        s = _mm256_add_ps(s, acc[c]);
    _mm256_storeu_ps(out, s);
    return out[0];
}
#pragma GCC pop_options
#endif

static float read_portable(const float *p, size_t n)
{
    float s[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            s[l] += p[i + l];
    for (; i < n; i++)
        s[0] += p[i];
    return s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7];
}

static void *probe_thread(void *p)
{
    struct probe_arg *a = p;
    float r = 0.0f;
    int go;
    while ((go = atomic_load(a->go)) == 0)
        sched_yield();
    if (go < 0)
        return NULL;
    a->t_start = tdm_now();
    switch (a->kind) {
    case PROBE_READ:
#if defined(__x86_64__)
        if (a->isa == TDM_CPU_ISA_AVX512) {
            r = read_avx512(a->data, a->count);
            break;
        }
#endif
        r = read_portable(a->data, a->count);
        break;
    case PROBE_FMA:
#if defined(__x86_64__)
        if (a->isa == TDM_CPU_ISA_AVX512)
            r = fma_avx512(a->iters);
        else if (a->isa == TDM_CPU_ISA_AVX2)
            r = fma_avx2(a->iters);
#endif
        break;
    case PROBE_BF16:
#if defined(__x86_64__)
        if (a->isa == TDM_CPU_ISA_AVX512)
            r = bf16_avx512(a->iters);
#endif
        break;
    }
    a->t_end = tdm_now();
    a->sink = r;
    return NULL;
}

static int resolve_threads(int nthreads)
{
    if (nthreads > 0)
        return nthreads > 256 ? 256 : nthreads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)(n < 256 ? n : 256) : 1;
}

// Runs one probe on n threads; returns wall seconds (or -1 on failure).
static double run_probe(struct probe_arg *proto, int n, const float *data, size_t total)
{
    struct probe_arg args[256];
    pthread_t th[256];
    _Atomic int go = 0;
    int started = 0;
    for (int i = 0; i < n; i++) {
        args[i] = *proto;
        args[i].go = &go;
        if (data) {
            // Slices of whole cache lines.
            size_t lo = total * (size_t)i / (size_t)n / 16 * 16;
            size_t hi = i == n - 1 ? total : total * (size_t)(i + 1) / (size_t)n / 16 * 16;
            args[i].data = data + lo;
            args[i].count = hi - lo;
        }
        if (pthread_create(&th[i], NULL, probe_thread, &args[i]) != 0)
            break;
        started++;
    }
    // Cannot start them all: let the started ones go home, measure nothing.
    atomic_store(&go, started == n ? 1 : -1);
    for (int i = 0; i < started; i++)
        pthread_join(th[i], NULL);
    if (started < n)
        return -1;
    // The span from the first thread's start to the last one's end.
    double t0 = args[0].t_start, t_end = args[0].t_end;
    for (int i = 1; i < n; i++) {
        t0 = args[i].t_start < t0 ? args[i].t_start : t0;
        t_end = args[i].t_end > t_end ? args[i].t_end : t_end;
    }
    return t_end - t0;
}

double tdm_cpu_probe_read_bw(size_t bytes, int nthreads, int reps)
{
    int n = resolve_threads(nthreads);
    size_t count = bytes / sizeof(float) / 64 * 64;
    if (count == 0)
        return 0;
    float *buf = NULL;
    if (posix_memalign((void **)&buf, 2u << 20, count * sizeof(float)) != 0)
        return 0;
#ifdef MADV_HUGEPAGE
    // Huge pages as the backend's weights get: TLB misses are not bandwidth.
    madvise(buf, count * sizeof(float), MADV_HUGEPAGE);
#endif
    memset(buf, 0, count * sizeof(float));
    struct probe_arg proto = {.kind = PROBE_READ,
                              .isa = tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512)
                                         ? TDM_CPU_ISA_AVX512
                                         : TDM_CPU_ISA_PORTABLE};
    double best = 0;
    for (int r = 0; r < (reps > 0 ? reps : 1); r++) {
        double s = run_probe(&proto, n, buf, count);
        if (s > 0 && (best == 0 || s < best))
            best = s;
    }
    free(buf);
    return best > 0 ? (double)(count * sizeof(float)) / best : 0;
}

static double compute_peak(enum probe_kind kind, int isa, double flop_per_iter_thread, int nthreads)
{
    int n = resolve_threads(nthreads);
    long iters = 1000000;
    double best = 0;
    for (int r = 0; r < 8; r++) {
        struct probe_arg proto = {.kind = kind, .iters = iters, .isa = isa};
        double s = run_probe(&proto, n, NULL, 0);
        if (s <= 0)
            continue;
        double rate = flop_per_iter_thread * (double)iters * n / s;
        if (rate > best)
            best = rate;
        if (s < 0.1)
            iters *= 2; // too short to time well
    }
    return best;
}

double tdm_cpu_probe_fma_peak(int nthreads)
{
    if (tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512))
        return compute_peak(PROBE_FMA, TDM_CPU_ISA_AVX512, PROBE_CHAINS * 16.0 * 2, nthreads);
    if (tdm_cpu_isa_supported(TDM_CPU_ISA_AVX2))
        return compute_peak(PROBE_FMA, TDM_CPU_ISA_AVX2, PROBE_CHAINS * 8.0 * 2, nthreads);
    return 0;
}

double tdm_cpu_probe_bf16_peak(int nthreads)
{
    if (!tdm_cpu_isa_supported(TDM_CPU_ISA_AVX512))
        return 0;
    return compute_peak(PROBE_BF16, TDM_CPU_ISA_AVX512, PROBE_CHAINS * 64.0, nthreads);
}
