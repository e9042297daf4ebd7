// bgemm.cuh — launcher of the batched-decode GEMM (17 <= M <= 64 rows: decode steps of batch 24-64,
// small verify steps): out (M, N) = a (M, K) . w^T (+bias) (+out), or with glu the SwiGLU of the
// two halves of w. C-compatible: the CUDA backend shim (src/backend/cuda/gemm.c) includes it.
// Pointers are device pointers; a, w and bias are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PD_BGEMM_MIN_M 17
#define PD_BGEMM_MAX_M 64

typedef struct pd_bgemm_kparams {
    const void *a;     // (M, K) bf16, row stride lda (elements)
    const void *w;     // (N, K) bf16 row-major; with glu (2N, K): gate rows then up rows
    const void *bias;  // (N) bf16 or NULL ((2N) with glu)
    void *out;         // (M, N) bf16, or f32 if out_f32
    int M, N, K, lda;
    int accumulate, out_f32;
    int glu;           // out = bf16(silu(g)) * u of g = a.w[:N]^T + bias[:N], u = a.w[N:]^T + bias[N:]
    // rope (head_dim 128, a bf16 cache): out is the qkv rows (N = (n_heads + 2 n_kv_heads) * 128); the
    // epilogue rotates q and k as rope_kv.cu does and writes k and v to the cache at slot_mapping
    // (< 0: no write)
    int rope;
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    void *k_cache, *v_cache;
    int n_heads, n_kv_heads;
    float attn_scaling;
    int per_sm;        // split-K sizing: blocks per SM the grid aims at (1 or 2; 0: 2)
    int stages;        // cp.async ring depth: 4 (0: 4; two blocks per SM) or 8 (one block per SM, per_sm 1)
    void *ws;          // split-K scratch of pd_cuda_bgemm_workspace_bytes(N, glu, per_sm), zero between launches
} pd_bgemm_kparams;

// True when the kernel handles this call: PD_BGEMM_MIN_M <= M <= PD_BGEMM_MAX_M (M >= 1 when
// any_m), K a multiple of 64, lda of 8, N (the output width) of 64, no f32 output with glu, a and w
// 16-byte aligned.
int pd_cuda_bgemm_supported(int M, int N, int K, int lda, int glu, int out_f32, const void *a, const void *w, int any_m);
// True when the rope epilogue handles this qkv layout (head_dim 128: one head per 128-row tile).
int pd_cuda_bgemm_rope_supported(int N, int n_heads, int n_kv_heads, int head_dim);
// Bytes of split-K scratch (f32 partial sums + tile counters) a call of this N needs.
size_t pd_cuda_bgemm_workspace_bytes(int N, int glu, int per_sm);  // (per_sm 2 covers 1)
void pd_cuda_bgemm(const pd_bgemm_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
