// kv_xfer.cu — the KV handoff's two kernels.
//
// kv_copy: grid (listed block, 16 KiB chunk of the block, layer x {K, V}); each CTA issues all of
// its loads (4 vectors of 16 bytes per thread) before its stores, so many requests are in flight
// per SM — the destination is usually a peer GPU's memory mapped through CUDA IPC, and NVLink
// latency is hidden only by volume. Only rows [0, n_rows) of a block move; the rest of the
// destination block is left as it was.
//
// kv_checksum: the same grid over the source rows; each thread mixes 8 words
// (pd_mix64(w_g + g * C), base/checksum.h), the CTA reduces in registers and shared memory and
// adds its partial to the layer's sum with one 64-bit atomicAdd. Addition mod 2^64 is associative
// and commutative, so the result is bit-identical to the CPU's sequential loop.
#include "kernels/common.cuh"
#include "kernels/kv_xfer.cuh"

#define PD_K_KV_THREADS 256
#define PD_K_KV_COPY_UNROLL 4
#define PD_K_KV_SUM_UNROLL 8

// One CTA's part of a copy: chunk y (PD_K_KV_THREADS x PD_K_KV_COPY_UNROLL vectors) of block d's
// rows, layer l, K (kv 0) or V (1); every load is issued before the first store.
template <typename V>
static __device__ __forceinline__ void pd_k_kv_copy_chunk(void *const *ptrs, const pd_kv_block_desc d, int l, int kv,
                                                          size_t block_bytes, size_t row_bytes, unsigned y) {
    const size_t chunk = (size_t)PD_K_KV_THREADS * PD_K_KV_COPY_UNROLL;
    size_t n_vec = (size_t)d.n_rows * row_bytes / sizeof(V);
    size_t begin = (size_t)y * chunk;
    if (begin >= n_vec) return;
    const V *src = (const V *)((const char *)ptrs[4 * l + kv] + (size_t)d.src_block * block_bytes) + begin;
    V *dst = (V *)((char *)ptrs[4 * l + 2 + kv] + (size_t)d.dst_block * block_bytes) + begin;
    size_t n = min(chunk, n_vec - begin);
    V r[PD_K_KV_COPY_UNROLL];
#pragma unroll
    for (int u = 0; u < PD_K_KV_COPY_UNROLL; u++) {
        size_t j = (size_t)u * PD_K_KV_THREADS + threadIdx.x;
        if (j < n) r[u] = src[j];
    }
#pragma unroll
    for (int u = 0; u < PD_K_KV_COPY_UNROLL; u++) {
        size_t j = (size_t)u * PD_K_KV_THREADS + threadIdx.x;
        if (j < n) dst[j] = r[u];
    }
}

// The same work split (chunk y of listed block x, layer z / 2, K or V), a fixed number of CTAs
// striding over it: a copy bound by PCIe keeps the bandwidth with a few CTAs in flight, and the
// compute stream's kernels keep the other SMs (pd_kv_copy_kparams.max_ctas).
template <typename V>
static __global__ void __launch_bounds__(PD_K_KV_THREADS)
    k_kv_copy_strided(void *const *ptrs, const pd_kv_block_desc *blocks, size_t block_bytes, size_t row_bytes,
                      unsigned n_x, unsigned n_y, unsigned n_z) {
    size_t total = (size_t)n_x * n_y * n_z;
    for (size_t item = blockIdx.x; item < total; item += gridDim.x) {
        unsigned x = (unsigned)(item % n_x), y = (unsigned)((item / n_x) % n_y), z = (unsigned)(item / ((size_t)n_x * n_y));
        pd_k_kv_copy_chunk<V>(ptrs, blocks[x], (int)(z >> 1), (int)(z & 1), block_bytes, row_bytes, y);
    }
}

template <typename V>
static __global__ void __launch_bounds__(PD_K_KV_THREADS)
    k_kv_copy(void *const *ptrs, const pd_kv_block_desc *blocks, size_t block_bytes, size_t row_bytes) {
    pd_k_kv_copy_chunk<V>(ptrs, blocks[blockIdx.x], blockIdx.z >> 1, blockIdx.z & 1, block_bytes, row_bytes, blockIdx.y);
}

static __device__ __forceinline__ uint64_t pd_k_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static __global__ void __launch_bounds__(PD_K_KV_THREADS)
    k_kv_checksum(void *const *ptrs, const pd_kv_block_desc *blocks, unsigned long long *sums, size_t block_bytes,
                  size_t row_bytes, uint64_t k_words) {
    __shared__ unsigned long long red[PD_K_KV_THREADS / PD_K_WARP];
    const pd_kv_block_desc d = blocks[blockIdx.x];
    int l = blockIdx.z >> 1, kv = blockIdx.z & 1;
    size_t n_words = (size_t)d.n_rows * row_bytes / 8;
    const size_t chunk = (size_t)PD_K_KV_THREADS * PD_K_KV_SUM_UNROLL;
    size_t begin = (size_t)blockIdx.y * chunk;
    if (begin >= n_words) return;  // uniform over the CTA
    const uint64_t *w = (const uint64_t *)((const char *)ptrs[2 * l + kv] + (size_t)d.src_block * block_bytes) + begin;
    uint64_t g0 = (kv ? k_words : 0) + d.word0 + begin;
    size_t n = min(chunk, n_words - begin);
    uint64_t x[PD_K_KV_SUM_UNROLL];
#pragma unroll
    for (int u = 0; u < PD_K_KV_SUM_UNROLL; u++) {
        size_t j = (size_t)u * PD_K_KV_THREADS + threadIdx.x;
        x[u] = j < n ? w[j] : 0;
    }
    unsigned long long acc = 0;
#pragma unroll
    for (int u = 0; u < PD_K_KV_SUM_UNROLL; u++) {
        size_t j = (size_t)u * PD_K_KV_THREADS + threadIdx.x;
        if (j < n) acc += pd_k_mix64(x[u] + (g0 + j) * 0x9E3779B97F4A7C15ull);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) red[warp] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long s = 0;
        for (int i = 0; i < PD_K_KV_THREADS / PD_K_WARP; i++) s += red[i];
        atomicAdd(&sums[l], s);
    }
}

extern "C" void pd_cuda_kv_copy(const pd_kv_copy_kparams *p, cudaStream_t s) {
    if (p->n_blocks <= 0 || p->n_layers <= 0) return;
    size_t block_bytes = p->row_bytes * (size_t)p->block_size;
    bool v16 = p->row_bytes % 16 == 0;
    size_t vec = v16 ? 16 : 8, chunk = (size_t)PD_K_KV_THREADS * PD_K_KV_COPY_UNROLL * vec;
    dim3 grid((unsigned)p->n_blocks, (unsigned)((block_bytes + chunk - 1) / chunk), (unsigned)(2 * p->n_layers));
    size_t total = (size_t)grid.x * grid.y * grid.z;
    if (p->max_ctas > 0 && total > (size_t)p->max_ctas) {
        unsigned g = (unsigned)p->max_ctas;
        if (v16) k_kv_copy_strided<uint4><<<g, PD_K_KV_THREADS, 0, s>>>(p->ptrs, p->blocks, block_bytes, p->row_bytes, grid.x, grid.y, grid.z);
        else k_kv_copy_strided<uint2><<<g, PD_K_KV_THREADS, 0, s>>>(p->ptrs, p->blocks, block_bytes, p->row_bytes, grid.x, grid.y, grid.z);
        return;
    }
    if (v16) k_kv_copy<uint4><<<grid, PD_K_KV_THREADS, 0, s>>>(p->ptrs, p->blocks, block_bytes, p->row_bytes);
    else k_kv_copy<uint2><<<grid, PD_K_KV_THREADS, 0, s>>>(p->ptrs, p->blocks, block_bytes, p->row_bytes);
}

extern "C" void pd_cuda_kv_checksum(const pd_kv_checksum_kparams *p, cudaStream_t s) {
    if (p->n_layers <= 0) return;
    cudaMemsetAsync(p->sums, 0, sizeof(uint64_t) * (size_t)p->n_layers, s);
    if (p->n_blocks <= 0) return;
    size_t block_bytes = p->row_bytes * (size_t)p->block_size;
    size_t chunk = (size_t)PD_K_KV_THREADS * PD_K_KV_SUM_UNROLL * 8;
    dim3 grid((unsigned)p->n_blocks, (unsigned)((block_bytes + chunk - 1) / chunk), (unsigned)(2 * p->n_layers));
    k_kv_checksum<<<grid, PD_K_KV_THREADS, 0, s>>>(p->ptrs, p->blocks, (unsigned long long *)p->sums, block_bytes,
                                                  p->row_bytes, p->k_words);
}
