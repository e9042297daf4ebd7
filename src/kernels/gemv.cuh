// gemv.cuh — launcher and parameters of the gemv kernel (skinny GEMM for decode: out (M, N) =
// a (M, K) . w^T (+bias) (+out), M <= 16). C-compatible: the CUDA backend shim (src/backend/cuda)
// includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_gemv_kparams {
    const void *a;     // (M, K) bf16, row stride lda
    const void *w;     // (N, K) bf16
    const void *bias;  // (N) bf16 or NULL
    void *out;         // (M, N) bf16, or f32 if out_f32
    int M, N, K, lda;
    int accumulate, out_f32;
    // split-K scratch of pd_cuda_gemv_workspace_bytes(N) bytes, all zero before the first launch;
    // every launch leaves it all zero again (so graphs replay without a reset)
    void *workspace;
} pd_gemv_kparams;
// True when the kernel handles this shape (M <= 16, K % 8 == 0, lda % 8 == 0).
int pd_cuda_gemv_supported(int M, int K, int lda);
size_t pd_cuda_gemv_workspace_bytes(int N);
void pd_cuda_gemv(const pd_gemv_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
