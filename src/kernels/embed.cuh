// embed.cuh — launcher and parameters of the embed kernel (out[i] = table[ids[i]]). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_embed_kparams {
    const int32_t *ids;  // (n_tokens)
    const void *table;   // (vocab, dim) bf16
    void *out;           // (n_tokens, dim) bf16
    int n_tokens, dim, vocab;
} pd_embed_kparams;
void pd_cuda_embed(const pd_embed_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
