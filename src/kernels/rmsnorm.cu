// rmsnorm.cu — fused residual add + RMSNorm. One block per row; the row (up to 16 vectors of 8
// per thread) stays in registers between the sum of squares and the scaling, so x is read once.
//   x += add (written back, bf16);  out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
// The inner rounding is transformers' (LlamaRMSNorm casts the normalised row to the input dtype
// before the weight multiplies it); PD_CUDA_HF_ROUNDING=0 leaves it out. Launched with PDL
// (common.cuh); the norm weight (never written by a kernel) is loaded before the wait.
#include "kernels/common.cuh"
#include "kernels/rmsnorm.cuh"

#define PD_K_RMS_MAX_VEC 8  // vectors of 8 per thread kept in registers: dim <= 8*8*blockDim

static __global__ void k_rmsnorm_vec(uint4 *x, const uint4 *add, const uint4 *w, uint4 *out, int nv, float eps,
                                     int hf, int early) {
    __shared__ float red[32];
    pd_k_pdl_trigger();
    int r = blockIdx.x;
    uint4 *xr = x + (size_t)r * nv;
    float v[PD_K_RMS_MAX_VEC][8];
    float ss = 0.0f;
    uint4 wv[PD_K_RMS_MAX_VEC];  // the norm weight (never written by a kernel): loaded before the wait
    if (!early) pd_k_pdl_wait();
#pragma unroll
    for (int j = 0; j < PD_K_RMS_MAX_VEC; j++) {
        int i = threadIdx.x + j * blockDim.x;
        wv[j] = i < nv ? w[i] : make_uint4(0, 0, 0, 0);
    }
    pd_k_pdl_wait();
#pragma unroll
    for (int j = 0; j < PD_K_RMS_MAX_VEC; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < nv) {
            pd_k_unpack8(xr[i], v[j]);
            if (add) {
                float a[8];
                pd_k_unpack8(add[(size_t)r * nv + i], a);
#pragma unroll
                for (int k = 0; k < 8; k++) v[j][k] += a[k];
                uint4 packed = pd_k_pack8(v[j]);
                xr[i] = packed;
                pd_k_unpack8(packed, v[j]);  // normalise the rounded residual, as a bf16 model does
            }
#pragma unroll
            for (int k = 0; k < 8; k++) ss += v[j][k] * v[j][k];
        }
    }
    ss = pd_k_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)(nv * 8) + eps);
#pragma unroll
    for (int j = 0; j < PD_K_RMS_MAX_VEC; j++) {
        int i = threadIdx.x + j * blockDim.x;
        if (i < nv) {
            float ww[8], o[8];
            pd_k_unpack8(wv[j], ww);
#pragma unroll
            for (int k = 0; k < 8; k++) o[k] = ww[k] * (hf ? pd_k_bf16r(v[j][k] * inv) : v[j][k] * inv);
            out[(size_t)r * nv + i] = pd_k_pack8(o);
        }
    }
}

// Any dim: two passes over global memory.
static __global__ void k_rmsnorm_scalar(__nv_bfloat16 *x, const __nv_bfloat16 *add, const __nv_bfloat16 *w,
                                        __nv_bfloat16 *out, int dim, float eps, int hf) {
    __shared__ float red[32];
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    size_t base = (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = __bfloat162float(x[base + i]);
        if (add) {
            v += __bfloat162float(add[base + i]);
            x[base + i] = __float2bfloat16(v);
            v = __bfloat162float(x[base + i]);
        }
        ss += v * v;
    }
    ss = pd_k_block_sum(ss, red);
    float inv = rsqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float n = __bfloat162float(x[base + i]) * inv;
        out[base + i] = __float2bfloat16(__bfloat162float(w[i]) * (hf ? pd_k_bf16r(n) : n));
    }
}

extern "C" void pd_cuda_rmsnorm(const pd_rmsnorm_kparams *p, cudaStream_t s) {
    if (p->n_rows <= 0) return;
    int nv = p->dim / 8;
    // PD_CUDA_RMS_THREADS=n (32..1024, a power of two): n threads per row for steps of >= 1024
    // rows (prefill; measurements), at least dim / 64 (the vectors a thread holds).
    static int big_threads = -2;
    if (big_threads == -2) {
        big_threads = pd_k_env_int("PD_CUDA_RMS_THREADS", 0, 0, 1024);
        if (big_threads & (big_threads - 1) || (big_threads && big_threads < 32)) {
            fprintf(stderr, "pdserve: PD_CUDA_RMS_THREADS must be 0 or a power of two from 32 to 1024\n");
            abort();
        }
    }
    if (p->dim % 8 == 0 && nv <= PD_K_RMS_MAX_VEC * 1024) {
        int threads = 32;
        while (threads < 1024 && (threads < nv / PD_K_RMS_MAX_VEC || threads * 2 <= nv) && threads < 256) threads *= 2;
        if (big_threads && p->n_rows >= 1024) threads = big_threads;
        while (threads * PD_K_RMS_MAX_VEC < nv) threads *= 2;
        pd_k_launch(k_rmsnorm_vec, dim3(p->n_rows), dim3(threads), 0, s, (uint4 *)p->x, (const uint4 *)p->add,
                    (const uint4 *)p->w, (uint4 *)p->out, nv, p->eps, pd_k_hf_rounding(), pd_k_early_loads());
    } else {
        pd_k_launch(k_rmsnorm_scalar, dim3(p->n_rows), dim3(256), 0, s, (__nv_bfloat16 *)p->x,
                    (const __nv_bfloat16 *)p->add, (const __nv_bfloat16 *)p->w, (__nv_bfloat16 *)p->out, p->dim,
                    p->eps, pd_k_hf_rounding());
    }
}
