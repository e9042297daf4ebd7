// gemv.cu — skinny GEMM for decode (M <= 16): out (M, N) = a (M, K) . w(N, K)^T, bandwidth-bound
// on the weight. Tensor cores do the arithmetic (mma m16n8k16, the M rows padded to 16), which
// leaves the CUDA cores free and makes M = 16 cost the same as M = 1.
//
// Layout trick: a dot product does not care about the order of k, so lane (g = lane/4, t =
// lane%4) loads 16 *consecutive* k values of weight row n0+g with two 16-byte loads (coalesced:
// 4 lanes cover 128 contiguous bytes of a row), and the same 16 k values of activation rows g and
// g+8. Those registers are fed to 4 mma k16 steps as if they were the standard fragments; A and B
// agree on the permutation of k, so the products are exact.
//
// Block: 4 warps on one n8 tile of output columns; warp w takes k chunks w, w+4, ... (64 k each),
// with PD_K_GEMV_UNROLL chunks of loads in flight; partial tiles are summed through shared memory.
#include "kernels/common.cuh"
#include "kernels/gemv.cuh"

#define PD_K_GEMV_WARPS 4
#define PD_K_GEMV_UNROLL 4

static __device__ __forceinline__ uint4 pd_k_ldg_stream(const uint4 *p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

static __global__ void __launch_bounds__(PD_K_GEMV_WARPS * 32)
    k_gemv(const __nv_bfloat16 *a, const __nv_bfloat16 *w, const __nv_bfloat16 *bias, void *out, int M, int N,
           int K, int lda, int accumulate, int out_f32) {
    __shared__ float part[PD_K_GEMV_WARPS][32][4];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    int n0 = blockIdx.x * 8, n = n0 + g;
    bool row_ok = n < N, a0_ok = g < M, a1_ok = g + 8 < M;
    const __nv_bfloat16 *wr = w + (size_t)(row_ok ? n : 0) * K;
    const __nv_bfloat16 *ar0 = a + (size_t)(a0_ok ? g : 0) * lda, *ar1 = a + (size_t)(a1_ok ? g + 8 : 0) * lda;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
    int n_chunks = (K + 63) / 64;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    for (int ch = warp; ch < n_chunks; ch += PD_K_GEMV_WARPS * PD_K_GEMV_UNROLL) {
        uint4 wv[PD_K_GEMV_UNROLL][2], av[PD_K_GEMV_UNROLL][2], bv[PD_K_GEMV_UNROLL][2];
#pragma unroll
        for (int u = 0; u < PD_K_GEMV_UNROLL; u++) {
            int cu = ch + u * PD_K_GEMV_WARPS;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int k = cu * 64 + t * 16 + h * 8;
                bool k_ok = cu < n_chunks && k < K;
                wv[u][h] = (k_ok && row_ok) ? pd_k_ldg_stream((const uint4 *)(wr + k)) : zero;
                av[u][h] = (k_ok && a0_ok) ? __ldg((const uint4 *)(ar0 + k)) : zero;
                bv[u][h] = (k_ok && a1_ok) ? __ldg((const uint4 *)(ar1 + k)) : zero;
            }
        }
#pragma unroll
        for (int u = 0; u < PD_K_GEMV_UNROLL; u++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint32_t fa[4] = {av[u][h].x, bv[u][h].x, av[u][h].y, bv[u][h].y};
                pd_k_mma_bf16(c, fa, wv[u][h].x, wv[u][h].y);
                uint32_t fb[4] = {av[u][h].z, bv[u][h].z, av[u][h].w, bv[u][h].w};
                pd_k_mma_bf16(c, fb, wv[u][h].z, wv[u][h].w);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) part[warp][lane][i] = c[i];
    __syncthreads();
    if (warp != 0) return;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        float v = 0.f;
#pragma unroll
        for (int ww = 0; ww < PD_K_GEMV_WARPS; ww++) v += part[ww][lane][i];
        // c0,c1: row g, cols 2t, 2t+1; c2,c3: row g+8
        int m = g + (i >= 2 ? 8 : 0), col = n0 + 2 * t + (i & 1);
        if (m >= M || col >= N) continue;
        if (bias) v += __bfloat162float(bias[col]);
        size_t o = (size_t)m * N + col;
        if (out_f32) {
            float *of = (float *)out;
            of[o] = accumulate ? of[o] + v : v;
        } else {
            __nv_bfloat16 *ob = (__nv_bfloat16 *)out;
            ob[o] = __float2bfloat16(accumulate ? __bfloat162float(ob[o]) + v : v);
        }
    }
}

extern "C" int pd_cuda_gemv_supported(int M, int K, int lda) { return M >= 1 && M <= 16 && K % 8 == 0 && lda % 8 == 0; }

extern "C" void pd_cuda_gemv(const pd_gemv_kparams *p, cudaStream_t s) {
    int lda = p->lda ? p->lda : p->K;
    k_gemv<<<(p->N + 7) / 8, PD_K_GEMV_WARPS * 32, 0, s>>>((const __nv_bfloat16 *)p->a, (const __nv_bfloat16 *)p->w,
                                                          (const __nv_bfloat16 *)p->bias, p->out, p->M, p->N, p->K,
                                                          lda, p->accumulate, p->out_f32);
}
