// attention.cuh — paged causal attention with GQA over a mixed batch (prefill chunks and decodes
// in one launch sequence). C-compatible: the CUDA backend shim includes it.
//
// Paged KV: k_cache/v_cache are (n_blocks, block_size, n_kv_heads, head_dim) bf16, or with kv_fp8
// rows of row_bytes holding e4m3 values then per-head f32 scales (backend.h, PD_KV_FP8); sequence s
// owns block ids bt_indices[bt_indptr[s] .. bt_indptr[s+1]) and query rows [q_indptr[s],
// q_indptr[s+1]); query row i sits at position kv_lens[s] - q_len + i.
//
// Two kernels share the work: sequences with q_len > 1 go to the prefill kernel (tensor cores,
// online softmax, 64 query rows x one head per block); sequences with q_len == 1 go to the decode
// kernel (all query heads of a KV group together, the context split into partitions, partial
// results merged by a third kernel, or in place when the grid is small: see attention.cu). Both read per-sequence data on the device only, so the
// launch shape depends only on (n_seqs, max_q_len, max_kv_len): a graph captured with upper
// bounds replays for any batch within them.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_attention_kparams {
    const void *q;                      // (n_tokens, q_stride) bf16; head h at h*head_dim
    const void *k_cache, *v_cache;      // (n_blocks, block_size, n_kv_heads, head_dim) bf16
    void *out;                          // (n_tokens, n_heads*head_dim) bf16
    const int32_t *q_indptr;            // (n_seqs + 1)
    const int32_t *kv_lens;             // (n_seqs)
    const int32_t *bt_indptr;           // (n_seqs + 1)
    const int32_t *bt_indices;          // block ids
    int n_tokens, n_seqs, n_heads, n_kv_heads, head_dim, block_size, q_stride;
    int max_q_len, max_kv_len;          // upper bounds over the batch
    float scale;
    float *workspace;                   // split-K partials; see pd_cuda_attention_workspace_bytes
    size_t workspace_bytes;
    int *counters;                      // (n_seqs * n_kv_heads) zero on entry, left zero; see
                                        // pd_cuda_attention_counter_bytes
    int kv_fp8;                         // 1: caches hold E4M3 rows with per-head f32 scales
    size_t row_bytes;                   // fp8 only: bytes per slot row (pd_kv_row_bytes)
    int n_new;                          // > 0: only the last n_new rows of each sequence's context may
                                        // be written by the kernels before this one since the last full
                                        // completion of the stream (a graph step's own KV writes), so the
                                        // decode kernel loads the others before its PDL wait; 0: unknown
} pd_attention_kparams;

// True when head_dim and the GQA group size are supported (head_dim 32/64/128, group <= 8), for
// bf16 and fp8 caches alike.
int pd_cuda_attention_supported(int head_dim, int n_heads, int n_kv_heads);
// Workspace bytes the launch with these bounds needs (0 when no split is needed).
size_t pd_cuda_attention_workspace_bytes(int n_tokens, int n_seqs, int n_heads, int n_kv_heads, int head_dim,
                                         int max_kv_len);
// Bytes of the counters (zeroed once by the caller) for these bounds (0 when no split is needed).
size_t pd_cuda_attention_counter_bytes(int n_seqs, int n_kv_heads, int head_dim, int max_kv_len);
void pd_cuda_attention(const pd_attention_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
