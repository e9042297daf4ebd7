// skinny.cuh — launcher of the row-streaming skinny GEMM for decode (M <= 8): out (M, N) =
// a (M, K) . w^T (+bias) (+out), and its fused forms (RMSNorm prologue; SwiGLU, residual and
// RoPE + KV-write epilogues). C-compatible: the CUDA backend shim (src/backend/cuda/gemm.c)
// includes it. Pointers are device pointers; a, w and bias are bf16.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PD_SKINNY_MAX_M 8

// The rope form's RoPE + KV write (both skinny kernels): positions and cache slots per row (slot
// -1: no write), the rotation's inverse frequencies and scaling, the bf16 caches, the qkv layout.
typedef struct pd_skinny_rope {
    const int32_t *positions, *slot_mapping;
    const float *inv_freq;
    void *k_cache, *v_cache;
    int n_heads, n_kv_heads, head_dim;
    float attn_scaling;
} pd_skinny_rope;

typedef struct pd_skinny_kparams {
    const void *a;     // (M, K) bf16, row stride lda (elements)
    const void *w;     // (N, K) bf16, row-major (the backend's weight layout)
    const void *bias;  // (N) bf16 or NULL
    void *out;         // (M, N) bf16, or f32 if out_f32
    int M, N, K, lda;
    int accumulate, out_f32;
    int rows;          // weight rows per thread block: 2 or 4 (0: the default, 4); 4 with the fused forms
    int occ4;          // M = 5: the build bounded to 128 registers (4 blocks per SM instead of 3)
    int async;         // the weights through shared memory (cp.async) instead of registers
    // prewait: 0 every weight load of a block's first batch before the PDL wait, u + 1 only the
    // first u of its U load batches (skinny.cu "Prewait"; a measurement knob)
    int prewait;
    // norm_pf: with norm_w, its chunks of a block's first load batch are prefetched before the PDL
    // wait: 0 no, 1 into L1, 2 into L2 (skinny.cu "Norm prefetch"; PD_CUDA_SKINNY_NORM_PF)
    int norm_pf;
    // Fused forms (backend.h, pd_matmul_params): norm_w: the activation is rmsnorm(a) (weight
    // norm_w, eps norm_eps; lda == K); glu: w is (2N, K), out (M, N) = silu(gate) * up; residual:
    // out = bf16(out + bf16(a . w^T + bias)). glu and residual exclude accumulate and out_f32.
    const void *norm_w;
    float norm_eps;
    int glu, residual;
    // rope: out holds the qkv rows ((H + 2 Hkv) hd wide); q and k are rotated as kernels/rope_kv.cu
    // does (bf16 cache only) and k, v written to the cache slots. The block layout pairs rows i
    // and i + hd/2 of each q / k head, so head_dim % 4 == 0 is required.
    int rope;
    pd_skinny_rope rope_kv;
} pd_skinny_kparams;

// True when the kernel handles this call: 1 <= M <= 8, K and lda multiples of 8 and a, w 16-byte
// aligned (every load is 16 bytes).
int pd_cuda_skinny_supported(int M, int K, int lda, const void *a, const void *w);
void pd_cuda_skinny(const pd_skinny_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
