// rope_kv.cuh — launcher and parameters of the rope_kv kernel (rotate q,k in place (HF rotate_half), write k,v to the paged cache). C-compatible: the CUDA backend shim
// (src/backend/cuda) includes it. Pointers are device pointers; activations are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_rope_kv_kparams {
    void *qkv;                    // (n_tokens, (n_heads + 2*n_kv_heads) * head_dim) bf16
    const int32_t *positions;     // (n_tokens)
    const float *inv_freq;        // (head_dim/2)
    const int32_t *slot_mapping;  // (n_tokens); a negative slot skips the cache write
    void *k_cache, *v_cache;      // (n_slots, n_kv_heads, head_dim) bf16, or fp8 rows of row_bytes
    int n_tokens, n_heads, n_kv_heads, head_dim;
    float attn_scaling;
    int kv_fp8;                   // 1: E4M3 rows with per-head f32 scales (backend.h, PD_KV_FP8)
    size_t row_bytes;             // fp8 only: bytes per slot row (pd_kv_row_bytes)
} pd_rope_kv_kparams;
void pd_cuda_rope_kv(const pd_rope_kv_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
