// add_bias.cuh — out (M, N) f32 += bias (N) bf16. Used after cuBLASLt for f32-output GEMMs with
// a bias (the bias epilogue of cuBLASLt takes no bf16 bias with an f32 output).
#pragma once
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_add_bias_kparams {
    float *out;        // (M, N) f32
    const void *bias;  // (N) bf16
    int M, N;
} pd_add_bias_kparams;
void pd_cuda_add_bias(const pd_add_bias_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
