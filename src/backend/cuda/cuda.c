// cuda.c — the CUDA backend: device memory, one stream, and the C shim that turns each
// pd_*_params into a kernel launcher call (src/kernels). Weights, activations and the KV cache
// are bf16; accumulation is fp32; logits are f32 (matmul with out_f32).
//
// Design:
//   * One backend = one device + one non-blocking stream. Every op is enqueued on that stream;
//     upload is asynchronous (host memory must stay valid until the next sync), download
//     synchronises. Nothing here synchronises implicitly otherwise, so a sequence of ops can be
//     captured into a CUDA graph by the caller of the stream.
//   * Device memory comes from cudaMalloc (never managed memory). Scratch buffers (cuBLASLt
//     workspace, attention split-K partials, copy_blocks staging) belong to the backend and only
//     grow; growing is refused while the stream is being captured.
//   * Errors from the CUDA runtime are invariant violations: PD_CUDA_CHECK logs file:line and
//     aborts. The one expected failure, out of memory in dev_alloc, returns NULL.
#include "backend/cuda/cuda_impl.h"
#include "kernels/attention.cuh"
#include "kernels/copy_blocks.cuh"
#include "kernels/embed.cuh"
#include "kernels/fill_normal.cuh"
#include "kernels/get_rows.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_kv.cuh"
#include "kernels/silu_mul.cuh"

#include <string.h>

static void cuda_free(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    cudaSetDevice(cb->device);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    pd_cuda_gemm_fini(cb);
    if (cb->attn_ws) cudaFree(cb->attn_ws);
    if (cb->cb_dev) cudaFree(cb->cb_dev);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    pd_free(cb);
}

static void cuda_mem_info(pd_backend *b, size_t *free_bytes, size_t *total_bytes) {
    size_t f = 0, t = 0;
    PD_CUDA_CHECK(cudaMemGetInfo(&f, &t));
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
}

static void *cuda_dev_alloc(pd_backend *b, size_t n) {
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {
        cudaGetLastError();  // clear the sticky-free error so later launch checks do not see it
        PD_LOG_E("cuda: cudaMalloc(%zu) failed: %s", n, cudaGetErrorString(e));
        return NULL;
    }
    return p;
}

static void cuda_dev_free(pd_backend *b, void *p) {
    if (p) PD_CUDA_CHECK(cudaFree(p));
}

static void cuda_upload(pd_backend *b, void *dst, const void *src, size_t n) {
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, pd_cuda_backend_of(b)->stream));
}

static void cuda_download(pd_backend *b, void *dst, const void *src, size_t n) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cb->stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));
}

static void cuda_memset(pd_backend *b, void *dst, int v, size_t n) {
    PD_CUDA_CHECK(cudaMemsetAsync(dst, v, n, pd_cuda_backend_of(b)->stream));
}

static void cuda_sync(pd_backend *b) { PD_CUDA_CHECK(cudaStreamSynchronize(pd_cuda_backend_of(b)->stream)); }

static void cuda_copy_d2d(pd_backend *b, void *dst, const void *src, size_t n) {
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, pd_cuda_backend_of(b)->stream));
}

void pd_cuda_scratch_reserve(pd_cuda_backend *cb, void **ptr, size_t *cur_bytes, size_t need_bytes) {
    if (need_bytes <= *cur_bytes) return;
    enum cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    PD_CUDA_CHECK(cudaStreamIsCapturing(cb->stream, &cs));
    if (cs != cudaStreamCaptureStatusNone) {
        PD_LOG_E("cuda: scratch buffer must grow to %zu bytes during graph capture: run the step once "
                 "uncaptured first (warm-up) with the same bounds", need_bytes);
        pd_abort(__FILE__, __LINE__, __func__, "scratch growth during capture");
    }
    size_t n = need_bytes + need_bytes / 4;
    PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));
    if (*ptr) PD_CUDA_CHECK(cudaFree(*ptr));
    *ptr = NULL;
    PD_CUDA_CHECK(cudaMalloc(ptr, n));
    *cur_bytes = n;
}

// ---- op shims ----------------------------------------------------------------------------------

static void cuda_embed(pd_backend *b, const pd_embed_params *p) {
    pd_embed_kparams k = {.ids = p->ids, .table = p->table, .out = p->out, .n_tokens = p->n_tokens,
                          .dim = p->dim, .vocab = p->vocab};
    pd_cuda_embed(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p) {
    PD_ASSERT(!(p->add && p->x == p->out));
    pd_rmsnorm_kparams k = {.x = p->x, .add = p->add, .w = p->w, .out = p->out, .n_rows = p->n_rows,
                            .dim = p->dim, .eps = p->eps};
    pd_cuda_rmsnorm(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_rope_kv(pd_backend *b, const pd_rope_kv_params *p) {
    PD_ASSERT(p->head_dim % 2 == 0);
    pd_rope_kv_kparams k = {.qkv = p->qkv, .positions = p->positions, .inv_freq = p->inv_freq,
                            .slot_mapping = p->slot_mapping, .k_cache = p->k_cache, .v_cache = p->v_cache,
                            .n_tokens = p->n_tokens, .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads,
                            .head_dim = p->head_dim, .attn_scaling = p->attn_scaling};
    pd_cuda_rope_kv(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_attention(pd_backend *b, const pd_attention_params *p) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    PD_ASSERT(pd_cuda_attention_supported(p->head_dim, p->n_heads, p->n_kv_heads));
    PD_ASSERT(p->q_stride % 8 == 0);
    size_t ws = pd_cuda_attention_workspace_bytes(p->n_tokens, p->n_seqs, p->n_heads, p->n_kv_heads, p->head_dim,
                                                  p->max_kv_len);
    pd_cuda_scratch_reserve(cb, (void **)&cb->attn_ws, &cb->attn_ws_bytes, ws);
    pd_attention_kparams k = {.q = p->q, .k_cache = p->k_cache, .v_cache = p->v_cache, .out = p->out,
                              .q_indptr = p->q_indptr, .kv_lens = p->kv_lens, .bt_indptr = p->bt_indptr,
                              .bt_indices = p->bt_indices, .n_tokens = p->n_tokens, .n_seqs = p->n_seqs,
                              .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads, .head_dim = p->head_dim,
                              .block_size = p->block_size, .q_stride = p->q_stride, .max_q_len = p->max_q_len,
                              .max_kv_len = p->max_kv_len, .scale = p->scale, .workspace = cb->attn_ws,
                              .workspace_bytes = cb->attn_ws_bytes};
    pd_cuda_attention(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_silu_mul(pd_backend *b, const pd_silu_mul_params *p) {
    pd_silu_mul_kparams k = {.gu = p->gu, .out = p->out, .n_rows = p->n_rows, .F = p->F};
    pd_cuda_silu_mul(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_get_rows(pd_backend *b, const pd_get_rows_params *p) {
    pd_get_rows_kparams k = {.x = p->x, .idx = p->idx, .out = p->out, .n_rows = p->n_rows, .dim = p->dim};
    pd_cuda_get_rows(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

// Stages the cache pointers and block pairs in device scratch, then one kernel copies them all.
static void cuda_copy_blocks(pd_backend *b, const pd_copy_blocks_params *p) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    if (p->n <= 0 || p->n_layers <= 0) return;
    if (p->block_bytes % 16) {  // odd geometry: plain copies
        for (int l = 0; l < p->n_layers; l++)
            for (int i = 0; i < p->n; i++) {
                size_t so = (size_t)p->src_blocks[i] * p->block_bytes, dof = (size_t)p->dst_blocks[i] * p->block_bytes;
                cuda_copy_d2d(b, (char *)p->k_caches[l] + dof, (char *)p->k_caches[l] + so, p->block_bytes);
                cuda_copy_d2d(b, (char *)p->v_caches[l] + dof, (char *)p->v_caches[l] + so, p->block_bytes);
            }
        return;
    }
    int n_caches = 2 * p->n_layers;
    size_t ptr_bytes = sizeof(void *) * (size_t)n_caches, pair_bytes = sizeof(int32_t) * 2 * (size_t)p->n;
    size_t need = ptr_bytes + pair_bytes;
    char *host = pd_malloc(need);
    PD_ASSERT(host);
    void **ptrs = (void **)host;
    int32_t *pairs = (int32_t *)(host + ptr_bytes);
    for (int l = 0; l < p->n_layers; l++) {
        ptrs[2 * l] = p->k_caches[l];
        ptrs[2 * l + 1] = p->v_caches[l];
    }
    for (int i = 0; i < p->n; i++) {
        pairs[2 * i] = p->src_blocks[i];
        pairs[2 * i + 1] = p->dst_blocks[i];
    }
    pd_cuda_scratch_reserve(cb, &cb->cb_dev, &cb->cb_dev_bytes, need);
    // Pageable source: the copy is staged before cudaMemcpyAsync returns, so `host` may go now.
    PD_CUDA_CHECK(cudaMemcpyAsync(cb->cb_dev, host, need, cudaMemcpyHostToDevice, cb->stream));
    pd_copy_blocks_kparams k = {.caches = (void *const *)cb->cb_dev,
                                .pairs = (const int32_t *)((char *)cb->cb_dev + ptr_bytes), .n = p->n,
                                .n_caches = n_caches, .block_bytes = p->block_bytes};
    pd_cuda_copy_blocks(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
    PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));  // the staging buffer is reused next call
    pd_free(host);
}

static void cuda_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std) {
    PD_ASSERT(dtype == PD_DTYPE_F32 || dtype == PD_DTYPE_BF16);
    pd_fill_normal_kparams k = {.dst = dst, .is_f32 = dtype == PD_DTYPE_F32, .n = n, .seed = seed, .mean = mean,
                                .std = std};
    pd_cuda_fill_normal(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static const pd_backend_iface cuda_iface = {
    .api_version = PD_BACKEND_API_VERSION,
    .name = "cuda",
    .free = cuda_free,
    .weight_dtype = PD_DTYPE_BF16,
    .act_dtype = PD_DTYPE_BF16,
    .mem_info = cuda_mem_info,
    .dev_alloc = cuda_dev_alloc,
    .dev_free = cuda_dev_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .memset = cuda_memset,
    .sync = cuda_sync,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .matmul = pd_cuda_gemm_matmul,
    .rope_kv = cuda_rope_kv,
    .attention = cuda_attention,
    .silu_mul = cuda_silu_mul,
    .get_rows = cuda_get_rows,
    .copy_blocks = cuda_copy_blocks,
    .copy_d2d = cuda_copy_d2d,
    .fill_normal = cuda_fill_normal,
};

bool pd_backend_cuda_available(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        cudaGetLastError();
        return false;
    }
    return n > 0;
}

pd_backend *pd_backend_cuda_new(int device, pd_err *err) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        cudaGetLastError();
        pd_err_set(err, PD_ERR_DEVICE, "no CUDA device is visible");
        return NULL;
    }
    if (device < 0 || device >= n) {
        pd_err_set(err, PD_ERR_INVALID, "CUDA device %d does not exist (%d visible)", device, n);
        return NULL;
    }
    pd_cuda_backend *cb = pd_calloc(1, sizeof *cb);
    if (!cb) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory creating the CUDA backend");
        return NULL;
    }
    cb->base.iface = &cuda_iface;
    cb->device = device;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        pd_err_set(err, PD_ERR_DEVICE, "CUDA device %d: %s", device, cudaGetErrorString(e));
        pd_free(cb);
        return NULL;
    }
    pd_cuda_gemm_init(cb);
    return &cb->base;
}
