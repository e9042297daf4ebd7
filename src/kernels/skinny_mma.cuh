// skinny_mma.cuh — launcher of the tensor-core skinny GEMM for decode and speculative verify
// (M <= 16): out (M, N) = a (M, K) . w^T (+bias) (+out). C-compatible: the CUDA backend shim
// (src/backend/cuda/gemm.c) includes it. Pointers are device pointers; a, w and bias are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/skinny.cuh"  // pd_skinny_rope

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SKINNY_MMA_MAX_M 16

typedef struct pd_skinny_mma_kparams {
    const void *a;     // (M, K) bf16, row stride lda (elements)
    const void *w;     // (N, K) bf16, row-major (the backend's weight layout)
    const void *bias;  // (N) bf16 or NULL
    void *out;         // (M, N) bf16, or f32 if out_f32
    int M, N, K, lda;
    int accumulate, out_f32;
    int rows;          // weight rows per thread block: 16 or 32 (0: the default, 16)
    int pipe;          // 1: two register sets, the next batch's loads issued before this batch's MMAs
    int loads;         // 16-byte weight loads in flight per thread: 16 (0: the default) or 32 (16 rows, M <= 8,
                       // single-buffered only; else 16)
    // Fused epilogues (backend.h pd_matmul_params; the norm is not folded here: the caller
    // normalises first). 16 weight rows per block with any of them. glu: w is (2N, K), out (M, N)
    // = silu(gate) * up, a block's 16 rows are 8 gate rows and the matching 8 up rows; residual:
    // out = bf16(out + bf16(a . w^T + bias)); rope: out holds the qkv rows ((H + 2 Hkv) hd wide),
    // q and k rotated as kernels/rope_kv.cu does and k, v written to the (bf16) cache slots; a
    // rotation block's 16 rows are rows i0..i0+7 and i0+hd/2..i0+hd/2+7 of one q / k head, so
    // head_dim % 16 == 0 is required. glu and residual exclude accumulate and out_f32.
    int glu, residual, rope;
    pd_skinny_rope rope_kv;
} pd_skinny_mma_kparams;

// True when the kernel handles this call: 1 <= M <= 16, K and lda multiples of 8 and a, w 16-byte
// aligned (every load is 16 bytes).
int pd_cuda_skinny_mma_supported(int M, int K, int lda, const void *a, const void *w);
void pd_cuda_skinny_mma(const pd_skinny_mma_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
