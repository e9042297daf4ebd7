// silu_mul.cu — SwiGLU: out[r, i] = bf16(silu(gu[r, i])) * gu[r, F + i], fp32 math. The inner
// rounding is torch's (act_fn(gate) is a bf16 tensor before it multiplies up); PD_CUDA_HF_ROUNDING=0
// leaves it out. Grid-stride over 8-element vectors when F % 8 == 0. Launched with PDL.
#include "kernels/common.cuh"
#include "kernels/silu_mul.cuh"

static __global__ void k_silu_mul_vec(const uint4 *gu, uint4 *out, int n_rows, int fv, int hf) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    size_t n = (size_t)n_rows * fv;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / fv, c = i % fv;
        float g[8], u[8], o[8];
        pd_k_unpack8(gu[r * 2 * fv + c], g);
        pd_k_unpack8(gu[r * 2 * fv + fv + c], u);
#pragma unroll
        for (int k = 0; k < 8; k++) o[k] = (hf ? pd_k_bf16r(pd_k_silu(g[k])) : pd_k_silu(g[k])) * u[k];
        out[i] = pd_k_pack8(o);
    }
}

static __global__ void k_silu_mul_scalar(const __nv_bfloat16 *gu, __nv_bfloat16 *out, int n_rows, int F, int hf) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    size_t n = (size_t)n_rows * F;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / F, c = i % F;
        float g = __bfloat162float(gu[r * 2 * F + c]), u = __bfloat162float(gu[r * 2 * F + F + c]);
        out[i] = __float2bfloat16((hf ? pd_k_bf16r(pd_k_silu(g)) : pd_k_silu(g)) * u);
    }
}

extern "C" void pd_cuda_silu_mul(const pd_silu_mul_kparams *p, cudaStream_t s) {
    if (p->n_rows <= 0) return;
    if (p->F % 8 == 0) {
        size_t n = (size_t)p->n_rows * (p->F / 8);
        int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
        pd_k_launch(k_silu_mul_vec, dim3(blocks), dim3(256), 0, s, (const uint4 *)p->gu, (uint4 *)p->out, p->n_rows,
                    p->F / 8, pd_k_hf_rounding());
    } else {
        size_t n = (size_t)p->n_rows * p->F;
        int blocks = (int)((n + 255) / 256 < 4096 ? (n + 255) / 256 : 4096);
        pd_k_launch(k_silu_mul_scalar, dim3(blocks), dim3(256), 0, s, (const __nv_bfloat16 *)p->gu,
                    (__nv_bfloat16 *)p->out, p->n_rows, p->F, pd_k_hf_rounding());
    }
}
