// SPDX-License-Identifier: Apache-2.0
// cuda_mma.cuh: the warp-level matrix instructions the kernels use, one
// spelling for both builds: inline PTX under nvcc (sm_80 and later), the
// emulator's warp collectives (emu/cuda_emu.cpp) in the host build. Every lane
// of the warp must call them together (.sync.aligned). Include cuda_compat.h
// first.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating
// point type"; groupID g = lane / 4, threadID_in_group t = lane % 4; a
// register of two bf16 holds the lower column or row index in its low half):
//   A (16 x 16, row-major) a[4]: a[0] = row g, columns 2t, 2t + 1;
//     a[1] = row g + 8, same columns; a[2] = row g, columns 2t + 8, 2t + 9;
//     a[3] = row g + 8, columns 2t + 8, 2t + 9.
//   B (16 x 8, "col": element (k, n) taken from row n of a row-major n x k
//     matrix) b[2]: b[0] = rows k 2t, 2t + 1 of column g; b[1] = rows
//     2t + 8, 2t + 9.
//   C, D (16 x 8, f32) c[4]: c[0], c[1] = row g, columns 2t, 2t + 1;
//     c[2], c[3] = row g + 8.
// ldmatrix x4: lane 8 m + i gives the shared address of row i (8 b16, 16
// bytes, 16-byte aligned) of matrix m; r[m] gets row lane / 4, elements
// 2 (lane % 4) + {0, 1} of matrix m: an A or B fragment register. With
// .trans it gets column lane / 4, rows 2 (lane % 4) + {0, 1}: a B fragment
// of a matrix stored k-major (V, whose rows are keys).
#ifndef TDM_CUDA_MMA_CUH
#define TDM_CUDA_MMA_CUH

#include <stdint.h>

// D = A B + C on bf16 A, B and f32 C, D.
__device__ __forceinline__ void tdm_mma_bf16_16816(float d[4], const uint32_t a[4],
                                                   const uint32_t b[2], const float c[4])
{
#ifdef __CUDACC__
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]),
                   "f"(c[1]), "f"(c[2]), "f"(c[3]));
#else
    ::tdm_emu::mma_m16n8k16_bf16(d, a, b, c);
#endif
}

// The memory clobber keeps the shared-memory stores before a __syncthreads
// on their side of it.
__device__ __forceinline__ void tdm_ldmatrix_x4(uint32_t r[4], const void *smem_row)
{
#ifdef __CUDACC__
    unsigned addr = (unsigned)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    ::tdm_emu::ldmatrix_x4(r, smem_row, false);
#endif
}

__device__ __forceinline__ void tdm_ldmatrix_x4_trans(uint32_t r[4], const void *smem_row)
{
#ifdef __CUDACC__
    unsigned addr = (unsigned)__cvta_generic_to_shared(smem_row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
#else
    ::tdm_emu::ldmatrix_x4(r, smem_row, true);
#endif
}

#endif
