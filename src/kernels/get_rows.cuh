// get_rows.cuh — launcher and parameters of the get_rows kernel (out[i] = x[idx[i]]). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_get_rows_kparams {
    const void *x;       // (n_src, dim) bf16
    const int32_t *idx;  // (n_rows)
    void *out;           // (n_rows, dim) bf16
    int n_rows, dim;
} pd_get_rows_kparams;
void pd_cuda_get_rows(const pd_get_rows_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
