// SPDX-License-Identifier: Apache-2.0
// cuda_dev_emu: cuda_dev.h for the emulator tests. Device memory is host
// memory, copies are memcpy, the stream is the calling thread (kernels of the
// emulator finish before their launch returns), and the GEMM is a plain loop:
// each output element accumulates bf16(w) * bf16(x) in f32 over k in order,
// the arithmetic cuBLASLt's bf16 GEMM does in another order. Test tool only.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"
#include "cuda_dev.h"

struct tdm_cuda_dev {
    int ordinal;
    char errmsg[128];
};

int tdm_cuda_dev_count(void)
{
    return 1;
}

int tdm_cuda_dev_open(struct tdm_cuda_dev **out, int ordinal, char *err, size_t errlen)
{
    *out = NULL;
    if (ordinal != 0)
        return tdm_seterr(err, errlen, TDM_EINVAL,
                          "cuda: device %d requested, 1 visible (emulator)", ordinal);
    struct tdm_cuda_dev *d = calloc(1, sizeof *d);
    if (d == NULL)
        return tdm_seterr(err, errlen, TDM_ENOMEM, "cuda: out of memory");
    *out = d;
    return TDM_OK;
}

void tdm_cuda_dev_close(struct tdm_cuda_dev *d)
{
    free(d);
}

const char *tdm_cuda_dev_name(const struct tdm_cuda_dev *d)
{
    (void)d;
    return "emulator";
}

void *tdm_cuda_dev_stream(struct tdm_cuda_dev *d)
{
    (void)d;
    return NULL;
}

int tdm_cuda_dev_mem_info(struct tdm_cuda_dev *d, size_t *free_bytes, size_t *total_bytes)
{
    (void)d;
    // A fixed pretend device of 1 GiB, so --gpu-memory-utilization has
    // something to take a fraction of in tests.
    *free_bytes = *total_bytes = (size_t)1 << 30;
    return TDM_OK;
}

void *tdm_cuda_dev_alloc(struct tdm_cuda_dev *d, size_t bytes)
{
    (void)d;
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0)
        return NULL;
    return p;
}

void tdm_cuda_dev_free(struct tdm_cuda_dev *d, void *p)
{
    (void)d;
    free(p);
}

int tdm_cuda_dev_h2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    (void)d;
    if (bytes)
        memcpy(dst, src, bytes);
    return TDM_OK;
}

int tdm_cuda_dev_d2h(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    return tdm_cuda_dev_h2d(d, dst, src, bytes);
}

int tdm_cuda_dev_d2d(struct tdm_cuda_dev *d, void *dst, const void *src, size_t bytes)
{
    (void)d;
    if (bytes)
        memmove(dst, src, bytes);
    return TDM_OK;
}

int tdm_cuda_dev_memset(struct tdm_cuda_dev *d, void *dst, int byte, size_t bytes)
{
    (void)d;
    memset(dst, byte, bytes);
    return TDM_OK;
}

int tdm_cuda_dev_sync(struct tdm_cuda_dev *d)
{
    (void)d;
    return TDM_OK;
}

static float bf16_f32(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int tdm_cuda_dev_gemm_bf16(struct tdm_cuda_dev *d, const uint16_t *w, int rows, int cols,
                           const uint16_t *x, int n, const float *bias, float *y)
{
    if (rows <= 0 || cols <= 0 || n <= 0) {
        snprintf(d->errmsg, sizeof d->errmsg, "gemm: %d x %d weight, n %d", rows, cols, n);
        return TDM_EINVAL;
    }
    for (int t = 0; t < n; t++) {
        const uint16_t *xr = x + (size_t)t * cols;
        for (int r = 0; r < rows; r++) {
            const uint16_t *wr = w + (size_t)r * cols;
            float acc = 0.0f;
            for (int k = 0; k < cols; k++)
                acc += bf16_f32(wr[k]) * bf16_f32(xr[k]);
            y[(size_t)t * rows + r] = bias ? acc + bias[r] : acc;
        }
    }
    return TDM_OK;
}

const char *tdm_cuda_dev_errmsg(const struct tdm_cuda_dev *d)
{
    return d->errmsg;
}
