// rmsnorm.cuh — launcher and parameters of the rmsnorm kernel (x += add; out = w * bf16(x / rms(x)), fp32 math). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_rmsnorm_kparams {
    void *x;          // (n_rows, dim) bf16; updated in place when add != NULL
    const void *add;  // (n_rows, dim) bf16 or NULL
    const void *w;    // (dim) bf16
    void *out;        // (n_rows, dim) bf16
    int n_rows, dim;
    float eps;
} pd_rmsnorm_kparams;
void pd_cuda_rmsnorm(const pd_rmsnorm_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
