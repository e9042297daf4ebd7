// silu_mul.cuh — launcher and parameters of the silu_mul kernel (out = silu(gate) * up). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_silu_mul_kparams {
    const void *gu;  // (n_rows, 2F) bf16: [gate | up]
    void *out;       // (n_rows, F) bf16
    int n_rows, F;
} pd_silu_mul_kparams;
void pd_cuda_silu_mul(const pd_silu_mul_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
