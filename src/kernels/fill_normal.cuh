// fill_normal.cuh — launcher and parameters of the fill_normal kernel (counter-based normal samples: element i depends only on (seed, i)). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_fill_normal_kparams {
    void *dst;
    int is_f32;  // 1: f32 elements, 0: bf16 (or e4m3 when is_fp8)
    int is_fp8;  // 1: e4m3 bytes (round to nearest even, saturating)
    size_t n;
    uint64_t seed;
    float mean, std;
} pd_fill_normal_kparams;
void pd_cuda_fill_normal(const pd_fill_normal_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
