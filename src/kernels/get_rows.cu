// get_rows.cu — row gather: out[i, :] = x[idx[i], :]. One block per output row. Launched with PDL.
#include "kernels/common.cuh"
#include "kernels/get_rows.cuh"

static __global__ void k_get_rows_vec(const uint4 *x, const int32_t *idx, uint4 *out, int n_vec) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int r = blockIdx.x;
    const uint4 *src = x + (size_t)idx[r] * n_vec;
    for (int i = threadIdx.x; i < n_vec; i += blockDim.x) out[(size_t)r * n_vec + i] = src[i];
}

static __global__ void k_get_rows_scalar(const uint16_t *x, const int32_t *idx, uint16_t *out, int dim) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int r = blockIdx.x;
    const uint16_t *src = x + (size_t)idx[r] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)r * dim + i] = src[i];
}

extern "C" void pd_cuda_get_rows(const pd_get_rows_kparams *p, cudaStream_t s) {
    if (p->n_rows <= 0) return;
    if (p->dim % 8 == 0) {
        int n_vec = p->dim / 8;
        pd_k_launch(k_get_rows_vec, dim3(p->n_rows), dim3(n_vec < 256 ? ((n_vec + 31) / 32) * 32 : 256), 0, s,
                    (const uint4 *)p->x, p->idx, (uint4 *)p->out, n_vec);
    } else {
        pd_k_launch(k_get_rows_scalar, dim3(p->n_rows), dim3(256), 0, s, (const uint16_t *)p->x, p->idx,
                    (uint16_t *)p->out, p->dim);
    }
}
