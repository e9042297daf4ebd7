// embed.cu — token embedding lookup: out[i, :] = table[ids[i], :]. One block per token; 16-byte
// copies when dim % 8 == 0, scalar otherwise. Launched with PDL (common.cuh).
#include "kernels/common.cuh"
#include "kernels/embed.cuh"

static __global__ void k_embed_vec(const int32_t *ids, const uint4 *table, uint4 *out, int n_vec) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int t = blockIdx.x;
    const uint4 *src = table + (size_t)ids[t] * n_vec;
    uint4 *dst = out + (size_t)t * n_vec;
    for (int i = threadIdx.x; i < n_vec; i += blockDim.x) dst[i] = src[i];
}

static __global__ void k_embed_scalar(const int32_t *ids, const uint16_t *table, uint16_t *out, int dim) {
    pd_k_pdl_trigger();
    pd_k_pdl_wait();
    int t = blockIdx.x;
    const uint16_t *src = table + (size_t)ids[t] * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) out[(size_t)t * dim + i] = src[i];
}

extern "C" void pd_cuda_embed(const pd_embed_kparams *p, cudaStream_t s) {
    if (p->n_tokens <= 0) return;
    if (p->dim % 8 == 0) {
        int n_vec = p->dim / 8;
        pd_k_launch(k_embed_vec, dim3(p->n_tokens), dim3(n_vec < 256 ? ((n_vec + 31) / 32) * 32 : 256), 0, s,
                    p->ids, (const uint4 *)p->table, (uint4 *)p->out, n_vec);
    } else {
        pd_k_launch(k_embed_scalar, dim3(p->n_tokens), dim3(256), 0, s, p->ids, (const uint16_t *)p->table,
                    (uint16_t *)p->out, p->dim);
    }
}
