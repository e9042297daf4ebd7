// fill_normal.cu — deterministic normal samples for dummy weights. Element i is a function of
// (seed, i) alone (a splitmix64-style hash of the pair index, Box-Muller on two 32-bit halves), so
// the result does not depend on the launch shape.
#include <cuda_fp8.h>

#include "kernels/common.cuh"
#include "kernels/fill_normal.cuh"

static __device__ __forceinline__ uint64_t pd_k_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static __global__ void k_fill_normal(void *dst, int is_f32, int is_fp8, size_t n, uint64_t seed, float mean, float std) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t h = pd_k_mix64(seed * 0x9e3779b97f4a7c15ull + pd_k_mix64(i >> 1) + 1);
        float u1 = ((uint32_t)(h >> 40) + 1.0f) * (1.0f / 16777217.0f);  // (0, 1]
        float u2 = (uint32_t)(h & 0xffffffu) * (1.0f / 16777216.0f);      // [0, 1)
        float r = sqrtf(-2.0f * logf(u1)), th = 6.283185307f * u2;
        float z = (i & 1) ? r * sinf(th) : r * cosf(th);
        float v = mean + std * z;
        if (is_fp8) ((__nv_fp8_storage_t *)dst)[i] = __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3);
        else if (is_f32) ((float *)dst)[i] = v;
        else ((__nv_bfloat16 *)dst)[i] = __float2bfloat16(v);
    }
}

extern "C" void pd_cuda_fill_normal(const pd_fill_normal_kparams *p, cudaStream_t s) {
    if (p->n == 0) return;
    size_t blocks = (p->n + 255) / 256;
    if (blocks > 8192) blocks = 8192;
    k_fill_normal<<<(int)blocks, 256, 0, s>>>(p->dst, p->is_f32, p->is_fp8, p->n, p->seed, p->mean, p->std);
}
