// kv_xfer.cuh — launchers of the KV-handoff kernels: kv_copy (the listed token rows of KV blocks,
// every layer, from one cache into another that may live on a peer GPU) and kv_checksum (the
// base/checksum.h sum of each layer's slab). C-compatible: the CUDA backend shim includes it.
// Every pointer is a device pointer; the descriptor arrays are staged by the caller.
#pragma once
#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One listed KV block: its rows [0, n_rows) move from src_block to dst_block (kv_copy), or are
// hashed as the run that starts at global word index word0 of the K half of the slab (checksum;
// the V half starts at the total K word count).
typedef struct pd_kv_block_desc {
    int32_t src_block, dst_block, n_rows, pad_;
    uint64_t word0;
} pd_kv_block_desc;

typedef struct pd_kv_copy_kparams {
    void *const *ptrs;              // (n_layers, 4) device: src_k, src_v, dst_k, dst_v per layer
    const pd_kv_block_desc *blocks; // (n_blocks) device
    int n_blocks, n_layers, block_size;
    size_t row_bytes;               // multiple of 8; 16-byte vectors when a multiple of 16
    int max_ctas;                   // > 0: at most this many CTAs, each looping over the chunks
                                    // (a PCIe-bound copy then holds few SMs); 0: one CTA a chunk
} pd_kv_copy_kparams;
void pd_cuda_kv_copy(const pd_kv_copy_kparams *p, cudaStream_t s);

typedef struct pd_kv_checksum_kparams {
    void *const *ptrs;              // (n_layers, 2) device: k, v per layer
    const pd_kv_block_desc *blocks; // (n_blocks) device: src_block, n_rows, word0
    uint64_t *sums;                 // (n_layers) device, zeroed by the launcher
    int n_blocks, n_layers, block_size;
    size_t row_bytes;               // multiple of 8
    uint64_t k_words;               // words in the K half of one layer's slab
} pd_kv_checksum_kparams;
void pd_cuda_kv_checksum(const pd_kv_checksum_kparams *p, cudaStream_t s);

#ifdef __cplusplus
}
#endif
