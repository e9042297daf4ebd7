// add_bias.cu — out (M, N) f32 += bias (N) bf16, grid-stride.
#include "kernels/add_bias.cuh"
#include "kernels/common.cuh"

static __global__ void k_add_bias(float *out, const __nv_bfloat16 *bias, int M, int N) {
    size_t n = (size_t)M * N;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] += __bfloat162float(bias[i % N]);
}

extern "C" void pd_cuda_add_bias(const pd_add_bias_kparams *p, cudaStream_t s) {
    size_t n = (size_t)p->M * p->N, blocks = (n + 255) / 256;
    if (n == 0) return;
    k_add_bias<<<(int)(blocks < 4096 ? blocks : 4096), 256, 0, s>>>(p->out, (const __nv_bfloat16 *)p->bias, p->M, p->N);
}
