// copy_blocks.cu — copies KV blocks (src -> dst pairs) in every cache (k and v of every layer) in
// one launch: grid (pair, cache, chunk of 64 KiB), 16-byte copies. Used by prefix-cache
// copy-on-write, and (one huge block) to measure the card's copy bandwidth.
#include "kernels/common.cuh"
#include "kernels/copy_blocks.cuh"

#define PD_K_CB_CHUNK_VEC 4096  // 64 KiB per CUDA block

static __global__ void k_copy_blocks(void *const *caches, const int32_t *pairs, size_t block_vec) {
    int i = blockIdx.x, c = blockIdx.y;
    uint4 *base = (uint4 *)caches[c];
    const uint4 *src = base + (size_t)pairs[2 * i] * block_vec;
    uint4 *dst = base + (size_t)pairs[2 * i + 1] * block_vec;
    size_t end = min(block_vec, (size_t)(blockIdx.z + 1) * PD_K_CB_CHUNK_VEC);
    for (size_t j = (size_t)blockIdx.z * PD_K_CB_CHUNK_VEC + threadIdx.x; j < end; j += blockDim.x) dst[j] = src[j];
}

extern "C" void pd_cuda_copy_blocks(const pd_copy_blocks_kparams *p, cudaStream_t s) {
    if (p->n <= 0 || p->n_caches <= 0) return;
    size_t block_vec = p->block_bytes / 16;
    dim3 grid(p->n, p->n_caches, (unsigned)((block_vec + PD_K_CB_CHUNK_VEC - 1) / PD_K_CB_CHUNK_VEC));
    k_copy_blocks<<<grid, 256, 0, s>>>(p->caches, p->pairs, p->block_bytes / 16);
}
