// attention_prefill.cuh — the sm_90a (wgmma, warp-specialised) prefill attention kernel; see
// attention_prefill.cu. Called by pd_cuda_attention (attention.cu) for the q_len > 1 sequences.
#pragma once
#include "kernels/attention.cuh"

#ifdef __cplusplus
extern "C" {
#endif

// Launches the prefill part of p (every sequence with q_len > 1) and returns 1, or returns 0
// without launching when the case is not covered (fp8 cache, head_dim other than 64/128,
// PD_CUDA_ATTN_PREFILL=0): the caller then runs k_attn_prefill.
int pd_cuda_attn_prefill_fa3(const pd_attention_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
