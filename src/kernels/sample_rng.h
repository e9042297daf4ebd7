// sample_rng.h — the counter-based uniform behind every random draw of the sampler, on the CPU
// (src/model/sample.c, through pd_sample_uniform in backend.c) and on the GPU (sample.cu). A
// draw is a pure function of (seed, draw index): no generator state to carry between steps or
// devices, so a seeded request draws the same numbers whichever backend samples it, and a CUDA
// graph can replay a draw from a counter in device memory. Plain C (no CUDA headers): the
// `PD_SAMPLE_HD` qualifier becomes __host__ __device__ under nvcc.
#pragma once
#include <stdint.h>

#ifdef __CUDACC__
#define PD_SAMPLE_HD static __host__ __device__ __forceinline__
#else
#define PD_SAMPLE_HD static inline
#endif

// splitmix64's finaliser: a bijection of 64-bit words with full avalanche.
PD_SAMPLE_HD uint64_t pd_sample_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1) with 53 random bits: draw number `idx` of the stream `seed`. Two rounds of the
// mixer so that nearby seeds and nearby indices give unrelated values.
PD_SAMPLE_HD double pd_sample_uniform_of(uint64_t seed, uint64_t idx) {
    uint64_t h = pd_sample_mix64(seed ^ pd_sample_mix64(idx * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull));
    return (double)(h >> 11) * (1.0 / 9007199254740992.0);
}
