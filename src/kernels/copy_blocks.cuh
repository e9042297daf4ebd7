// copy_blocks.cuh — launcher and parameters of the copy_blocks kernel (copies whole KV blocks src->dst in every layer, one launch). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_copy_blocks_kparams {
    void *const *caches;           // (n_caches) device array of device pointers (k and v of every layer)
    const int32_t *pairs;          // (n, 2) device array: src block, dst block
    int n, n_caches;
    size_t block_bytes;            // multiple of 16
} pd_copy_blocks_kparams;
void pd_cuda_copy_blocks(const pd_copy_blocks_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
