// cuda.c — the CUDA backend: device memory, one stream, and the C shim that turns each
// pd_*_params into a kernel launcher call (src/kernels). Weights, activations and the KV cache
// are bf16; accumulation is fp32; logits are f32 (matmul with out_f32).
//
// Design:
//   * One backend = one device + one non-blocking stream. Every op is enqueued on that stream;
//     upload is asynchronous (host memory must stay valid until the next sync), download
//     synchronises. Nothing here synchronises implicitly otherwise, so a sequence of ops can be
//     captured into a CUDA graph by the caller of the stream.
//   * cudaSetDevice is per thread and engines call ops from their own thread, not the one that
//     created the backend: every entry point first makes the backend's device current
//     (pd_cuda_bind, cached per thread), so several backends on several GPUs can coexist.
//   * Device memory comes from cudaMalloc (never managed memory). Scratch buffers (cuBLASLt
//     workspace, attention split-K partials, copy_blocks staging) belong to the backend and only
//     grow; growing is refused while the stream is being captured.
//   * Shared buffers (a decode worker's KV pool) are plain cudaMalloc allocations exported with
//     cudaIpcGetMemHandle; an importer maps them with cudaIpcOpenMemHandle and lazy peer access,
//     so a kernel on our GPU can store straight into a peer GPU's pool over NVLink (kv_copy).
//   * Graphs: graph_begin/graph_end capture the stream (thread-local mode) into an instantiated
//     CUDA graph that remembers the scratch generation; when a scratch buffer moves later, launch
//     refuses the stale graph and the caller captures again.
//   * Device messaging between processes (pd_comm_*, the nccl KV transport) is NCCL loaded at run
//     time, in nccl.c.
//   * Errors from the CUDA runtime are invariant violations: PD_CUDA_CHECK logs file:line and
//     aborts. The one expected failure, out of memory in dev_alloc, returns NULL.
#include "backend/cuda/cuda_impl.h"
#include "backend/cuda/nccl.h"
#include "kernels/attention.cuh"
#include "kernels/copy_blocks.cuh"
#include "kernels/embed.cuh"
#include "kernels/fill_normal.cuh"
#include "kernels/get_rows.cuh"
#include "kernels/kv_xfer.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope_kv.cuh"
#include "kernels/silu_mul.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void cuda_timer_mark(pd_backend *b, int i) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    if (!cb->timer[i]) PD_CUDA_CHECK(cudaEventCreate(&cb->timer[i]));
    PD_CUDA_CHECK(cudaEventRecord(cb->timer[i], cb->stream));
    cb->timer_set[i] = true;
}

static float cuda_timer_ms(pd_backend *b, int i, int j) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    if (!cb->timer_set[i] || !cb->timer_set[j]) return -1.0f;
    pd_cuda_bind(cb);
    PD_CUDA_CHECK(cudaEventSynchronize(cb->timer[j]));
    float ms = -1.0f;
    if (cudaEventElapsedTime(&ms, cb->timer[i], cb->timer[j]) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1.0f;
    }
    return ms;
}

// The op profiler's events (backend_impl.h prof_record / prof_ms): a pool that grows on demand
// and is kept for the next profile, so a profiled step after the first creates none.
static void cuda_prof_record(pd_backend *b, int i) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    if (i >= cb->n_prof_ev) {
        int n = PD_MAX(i + 1, PD_MAX(256, 2 * cb->n_prof_ev));
        cudaEvent_t *ev = pd_realloc(cb->prof_ev, sizeof *ev * (size_t)n);
        if (!ev) pd_abort(__FILE__, __LINE__, __func__, "out of memory for profiler events");
        for (int j = cb->n_prof_ev; j < n; j++) PD_CUDA_CHECK(cudaEventCreate(&ev[j]));
        cb->prof_ev = ev;
        cb->n_prof_ev = n;
    }
    PD_CUDA_CHECK(cudaEventRecord(cb->prof_ev[i], cb->stream));
}

static float cuda_prof_ms(pd_backend *b, int i, int j) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    if (i < 0 || j < 0 || i >= cb->n_prof_ev || j >= cb->n_prof_ev) return -1.0f;
    pd_cuda_bind(cb);
    PD_CUDA_CHECK(cudaEventSynchronize(cb->prof_ev[j]));
    float ms = -1.0f;
    if (cudaEventElapsedTime(&ms, cb->prof_ev[i], cb->prof_ev[j]) != cudaSuccess) {
        (void)cudaGetLastError();
        return -1.0f;
    }
    return ms;
}

static void cuda_free(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    if (cb->stream) cudaStreamSynchronize(cb->stream);
    pd_cuda_gemm_fini(cb);
    pd_cuda_sample_fini(cb);
    pd_cuda_xfer_fini(cb);
    if (cb->attn_ws) cudaFree(cb->attn_ws);
    if (cb->fuse_ws) cudaFree(cb->fuse_ws);
    if (cb->attn_cnt) cudaFree(cb->attn_cnt);
    if (cb->gemv_ws) cudaFree(cb->gemv_ws);
    if (cb->bgemm_ws) cudaFree(cb->bgemm_ws);
    if (cb->cb_dev) cudaFree(cb->cb_dev);
    if (cb->kv_dev) cudaFree(cb->kv_dev);
    for (int i = 0; i < 8; i++)
        if (cb->timer[i]) cudaEventDestroy(cb->timer[i]);
    for (int i = 0; i < cb->n_prof_ev; i++) cudaEventDestroy(cb->prof_ev[i]);
    pd_free(cb->prof_ev);
    if (cb->stream) cudaStreamDestroy(cb->stream);
    pd_free(cb);
}

static void cuda_mem_info(pd_backend *b, size_t *free_bytes, size_t *total_bytes) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    size_t f = 0, t = 0;
    PD_CUDA_CHECK(cudaMemGetInfo(&f, &t));
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
}

static void *cuda_dev_alloc(pd_backend *b, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
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
    pd_cuda_bind(pd_cuda_backend_of(b));
    if (p) PD_CUDA_CHECK(cudaFree(p));
}

static void cuda_upload(pd_backend *b, void *dst, const void *src, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, pd_cuda_backend_of(b)->stream));
}

static void cuda_download(pd_backend *b, void *dst, const void *src, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, cb->stream));
    PD_CUDA_CHECK(cudaStreamSynchronize(cb->stream));
}

// Pinned host memory (page-locked, portable across devices): staging and the host DRAM KV tier.
static void *cuda_host_alloc(pd_backend *b, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    void *p = NULL;
    return cudaHostAlloc(&p, n, cudaHostAllocPortable) == cudaSuccess ? p : NULL;
}

static void cuda_host_free(pd_backend *b, void *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaFreeHost(p));
}

static void cuda_memset(pd_backend *b, void *dst, int v, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaMemsetAsync(dst, v, n, pd_cuda_backend_of(b)->stream));
}

static void cuda_sync(pd_backend *b) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaStreamSynchronize(pd_cuda_backend_of(b)->stream));
}

// cudaSetDevice initialises the device's primary context and makes it current (CUDA >= 12).
static void cuda_bind_thread(pd_backend *b) { pd_cuda_bind(pd_cuda_backend_of(b)); }

static void cuda_copy_d2d(pd_backend *b, void *dst, const void *src, size_t n) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, pd_cuda_backend_of(b)->stream));
}

// The device current in this thread as far as this backend knows (cudaSetDevice is per thread,
// and the engine thread is not the thread that created the backend). Every entry point binds.
static _Thread_local int tl_device = -1;
int pd_cuda_env_int(const char *name, int dflt, int lo, int hi) {
    int v;
    pd_err err = {0};
    if (pd_env_int(name, dflt, lo, hi, &v, &err)) {
        PD_LOG_E("%s", err.msg);
        pd_abort(__FILE__, __LINE__, __func__, "bad CUDA knob in the environment");
    }
    return v;
}

void pd_cuda_bind(pd_cuda_backend *cb) {
    if (tl_device == cb->device) return;
    PD_CUDA_CHECK(cudaSetDevice(cb->device));
    tl_device = cb->device;
}

void pd_cuda_scratch_reserve(pd_cuda_backend *cb, void **ptr, size_t *cur_bytes, size_t need_bytes, bool in_graphs) {
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
    // Only buffers that captured kernels point at make graphs stale: the KV-transfer staging
    // (kv_copy, kv_checksum, copy_blocks) is never captured, and it grows with each longer prompt
    // a decode worker verifies, which used to force a recapture of every decode graph.
    if (in_graphs) cb->scratch_gen++;
}

void pd_cuda_scratch_reserve_zeroed(pd_cuda_backend *cb, void **ptr, size_t *cur_bytes, size_t need_bytes) {
    size_t before = *cur_bytes;  // (not the pointer: cudaMalloc may hand back the freed address)
    pd_cuda_scratch_reserve(cb, ptr, cur_bytes, need_bytes, true);
    if (*cur_bytes != before) PD_CUDA_CHECK(cudaMemsetAsync(*ptr, 0, *cur_bytes, cb->stream));
}

// ---- op shims ----------------------------------------------------------------------------------

static void cuda_embed(pd_backend *b, const pd_embed_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_embed_kparams k = {.ids = p->ids, .table = p->table, .out = p->out, .n_tokens = p->n_tokens,
                          .dim = p->dim, .vocab = p->vocab};
    pd_cuda_embed(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_ASSERT(!(p->add && p->x == p->out));
    pd_rmsnorm_kparams k = {.x = p->x, .add = p->add, .w = p->w, .out = p->out, .n_rows = p->n_rows,
                            .dim = p->dim, .eps = p->eps};
    pd_cuda_rmsnorm(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_rope_kv(pd_backend *b, const pd_rope_kv_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_ASSERT(p->head_dim % 2 == 0);
    pd_rope_kv_kparams k = {.qkv = p->qkv, .positions = p->positions, .inv_freq = p->inv_freq,
                            .slot_mapping = p->slot_mapping, .k_cache = p->k_cache, .v_cache = p->v_cache,
                            .n_tokens = p->n_tokens, .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads,
                            .head_dim = p->head_dim, .attn_scaling = p->attn_scaling,
                            .kv_fp8 = p->kv_dtype == PD_KV_FP8,
                            .row_bytes = pd_kv_row_bytes(b, p->kv_dtype, p->n_kv_heads, p->head_dim)};
    pd_cuda_rope_kv(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_attention(pd_backend *b, const pd_attention_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    PD_ASSERT(pd_cuda_attention_supported(p->head_dim, p->n_heads, p->n_kv_heads));
    PD_ASSERT(p->q_stride % 8 == 0);
    size_t ws = pd_cuda_attention_workspace_bytes(p->n_tokens, p->n_seqs, p->n_heads, p->n_kv_heads, p->head_dim,
                                                  p->max_kv_len);
    pd_cuda_scratch_reserve(cb, (void **)&cb->attn_ws, &cb->attn_ws_bytes, ws, true);
    pd_cuda_scratch_reserve_zeroed(cb, (void **)&cb->attn_cnt, &cb->attn_cnt_bytes,
                                   pd_cuda_attention_counter_bytes(p->n_seqs, p->n_kv_heads, p->head_dim, p->max_kv_len));
    pd_attention_kparams k = {.q = p->q, .k_cache = p->k_cache, .v_cache = p->v_cache, .out = p->out,
                              .q_indptr = p->q_indptr, .kv_lens = p->kv_lens, .bt_indptr = p->bt_indptr,
                              .bt_indices = p->bt_indices, .n_tokens = p->n_tokens, .n_seqs = p->n_seqs,
                              .n_heads = p->n_heads, .n_kv_heads = p->n_kv_heads, .head_dim = p->head_dim,
                              .block_size = p->block_size, .q_stride = p->q_stride, .max_q_len = p->max_q_len,
                              .max_kv_len = p->max_kv_len, .scale = p->scale, .workspace = cb->attn_ws,
                              .workspace_bytes = cb->attn_ws_bytes, .counters = cb->attn_cnt,
                              .kv_fp8 = p->kv_dtype == PD_KV_FP8,
                              .row_bytes = pd_kv_row_bytes(b, p->kv_dtype, p->n_kv_heads, p->head_dim),
                              .n_new = p->n_new};
    pd_cuda_attention(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_silu_mul(pd_backend *b, const pd_silu_mul_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_silu_mul_kparams k = {.gu = p->gu, .out = p->out, .n_rows = p->n_rows, .F = p->F};
    pd_cuda_silu_mul(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_get_rows(pd_backend *b, const pd_get_rows_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_get_rows_kparams k = {.x = p->x, .idx = p->idx, .out = p->out, .n_rows = p->n_rows, .dim = p->dim};
    pd_cuda_get_rows(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

// Stages the cache pointers and block pairs in device scratch, then one kernel copies them all.
static void cuda_copy_blocks(pd_backend *b, const pd_copy_blocks_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
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
    pd_cuda_scratch_reserve(cb, &cb->cb_dev, &cb->cb_dev_bytes, need, false);
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

// ---- shared buffers (CUDA IPC) -----------------------------------------------------------------

static void *cuda_alloc_shared(pd_backend *b, size_t n, pd_buffer_handle *h, pd_err *err) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n);
    if (e != cudaSuccess) {
        cudaGetLastError();
        pd_err_set(err, PD_ERR_NOMEM, "cuda: cannot allocate a %zu-byte shared buffer: %s", n, cudaGetErrorString(e));
        return NULL;
    }
    cudaIpcMemHandle_t ih;
    _Static_assert(sizeof ih <= sizeof h->ipc, "cudaIpcMemHandle_t does not fit pd_buffer_handle.ipc");
    e = cudaIpcGetMemHandle(&ih, p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        cudaFree(p);
        pd_err_set(err, PD_ERR_DEVICE, "cuda: cudaIpcGetMemHandle failed: %s", cudaGetErrorString(e));
        return NULL;
    }
    memset(h, 0, sizeof *h);
    snprintf(h->kind, sizeof h->kind, "cuda");
    memcpy(h->ipc, &ih, sizeof ih);
    h->n_bytes = n;
    h->device = cb->device;
    h->pid = (int32_t)getpid();
    return p;
}

static void cuda_free_shared(pd_backend *b, void *p, const pd_buffer_handle *h) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    if (p) PD_CUDA_CHECK(cudaFree(p));
}

// Maps another process's buffer on our device. The exporter's GPU may be a peer: lazy peer
// access lets our kernels read and write it directly (NVLink / PCIe P2P).
static void *cuda_import(pd_backend *b, const pd_buffer_handle *h, pd_err *err) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    if (strncmp(h->kind, "cuda", sizeof h->kind)) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "the cuda backend cannot import a '%.8s' buffer", h->kind);
        return NULL;
    }
    if (h->pid == (int32_t)getpid()) {
        pd_err_set(err, PD_ERR_INVALID, "a CUDA IPC handle cannot be opened by the process that exported it (pid %d)",
                   (int)h->pid);
        return NULL;
    }
    int n_dev = 0, can = 1;
    if (cudaGetDeviceCount(&n_dev) == cudaSuccess && h->device != cb->device && h->device >= 0 && h->device < n_dev &&
        cudaDeviceCanAccessPeer(&can, cb->device, h->device) == cudaSuccess && !can)
        PD_LOG_W("cuda: device %d reports no peer access to device %d; the KV copy may fail or be slow", cb->device,
                 (int)h->device);
    cudaGetLastError();
    cudaIpcMemHandle_t ih;
    memcpy(&ih, h->ipc, sizeof ih);
    void *p = NULL;
    cudaError_t e = cudaIpcOpenMemHandle(&p, ih, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
        cudaGetLastError();
        pd_err_set(err, PD_ERR_DEVICE, "cuda: cannot open the IPC handle of pid %d device %d (%llu bytes): %s", (int)h->pid,
                   (int)h->device, (unsigned long long)h->n_bytes, cudaGetErrorString(e));
        return NULL;
    }
    // The size a peer announces is checked against the allocation really behind the handle
    // (cuMemGetAddressRange through the runtime's driver entry point: no libcuda link needed).
    typedef int (*range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);
    void *fn = NULL;
    enum cudaDriverEntryPointQueryResult qr;
    unsigned long long rb = 0;
    size_t rs = 0;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
        !fn || ((range_fn)fn)(&rb, &rs, (unsigned long long)(uintptr_t)p) != 0 || rb != (unsigned long long)(uintptr_t)p ||
        rs < h->n_bytes) {
        cudaGetLastError();
        cudaIpcCloseMemHandle(p);
        cudaGetLastError();
        pd_err_set(err, PD_ERR_INVALID, "cuda: the IPC buffer of pid %d holds %zu bytes, %llu announced", (int)h->pid, rs,
                   (unsigned long long)h->n_bytes);
        return NULL;
    }
    return p;
}

static void cuda_unimport(pd_backend *b, void *p, const pd_buffer_handle *h) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    if (!p) return;
    cudaError_t e = cudaIpcCloseMemHandle(p);
    if (e != cudaSuccess) {
        cudaGetLastError();
        PD_LOG_W("cuda: cudaIpcCloseMemHandle: %s", cudaGetErrorString(e));
    }
}

// ---- KV handoff --------------------------------------------------------------------------------

char *pd_cuda_stage(cudaStream_t s, void **dev, size_t *dev_bytes, char *host, size_t n, size_t n_tail) {
    if (n + n_tail > *dev_bytes) {
        PD_CUDA_CHECK(cudaStreamSynchronize(s));
        if (*dev) PD_CUDA_CHECK(cudaFree(*dev));
        *dev = NULL;
        *dev_bytes = 0;
        size_t want = n + n_tail + (n + n_tail) / 4;
        PD_CUDA_CHECK(cudaMalloc(dev, want));
        *dev_bytes = want;
    }
    PD_CUDA_CHECK(cudaMemcpyAsync(*dev, host, n, cudaMemcpyHostToDevice, s));
    pd_free(host);
    return *dev;
}

// The KV-transfer staging (kv_copy, kv_checksum) is never captured: it may grow at any time.
static char *kv_stage(pd_cuda_backend *cb, char *host, size_t n, size_t n_tail) {
    return pd_cuda_stage(cb->stream, &cb->kv_dev, &cb->kv_dev_bytes, host, n, n_tail);
}

char *pd_cuda_kv_copy_pack(const pd_kv_copy_params *p, size_t *desc_off, size_t *n_bytes) {
    int nl = p->layer_end - p->layer_begin;
    PD_ASSERT(p->row_bytes % 8 == 0 && p->block_size > 0);
    size_t pb = sizeof(void *) * 4 * (size_t)nl, db = sizeof(pd_kv_block_desc) * (size_t)p->n_blocks;
    char *host = pd_calloc(1, pb + db);
    PD_ASSERT(host);
    void **ptrs = (void **)host;
    pd_kv_block_desc *d = (pd_kv_block_desc *)(host + pb);
    for (int l = 0; l < nl; l++) {
        int g = p->layer_begin + l;
        ptrs[4 * l] = p->src_k[g], ptrs[4 * l + 1] = p->src_v[g];
        ptrs[4 * l + 2] = p->dst_k[g], ptrs[4 * l + 3] = p->dst_v[g];
    }
    for (int i = 0; i < p->n_blocks; i++) {
        PD_ASSERT(p->n_rows[i] >= 0 && p->n_rows[i] <= p->block_size);
        d[i] = (pd_kv_block_desc){.src_block = p->src_blocks[i], .dst_block = p->dst_blocks[i], .n_rows = p->n_rows[i]};
    }
    *desc_off = pb;
    *n_bytes = pb + db;
    return host;
}

static void cuda_kv_copy(pd_backend *b, const pd_kv_copy_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    int nl = p->layer_end - p->layer_begin;
    if (p->n_blocks <= 0 || nl <= 0) return;
    size_t off, n;
    char *host = pd_cuda_kv_copy_pack(p, &off, &n);  // sets n: not in kv_stage's argument list
    char *dev = kv_stage(cb, host, n, 0);
    pd_kv_copy_kparams k = {.ptrs = (void *const *)dev, .blocks = (const pd_kv_block_desc *)(dev + off),
                            .n_blocks = p->n_blocks, .n_layers = nl, .block_size = p->block_size,
                            .row_bytes = p->row_bytes};
    pd_cuda_kv_copy(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
}

static void cuda_kv_checksum(pd_backend *b, const pd_kv_checksum_params *p) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    int nl = p->layer_end - p->layer_begin;
    if (nl <= 0) return;
    PD_ASSERT(p->row_bytes % 8 == 0 && p->block_size > 0);
    size_t pb = sizeof(void *) * 2 * (size_t)nl, db = sizeof(pd_kv_block_desc) * (size_t)(p->n_blocks > 0 ? p->n_blocks : 0);
    char *host = pd_calloc(1, pb + db);  // pb > 0: nl > 0
    PD_ASSERT(host);
    void **ptrs = (void **)host;
    pd_kv_block_desc *d = (pd_kv_block_desc *)(host + pb);
    for (int l = 0; l < nl; l++) ptrs[2 * l] = p->k[p->layer_begin + l], ptrs[2 * l + 1] = p->v[p->layer_begin + l];
    uint64_t words = 0;
    for (int i = 0; i < p->n_blocks; i++) {
        PD_ASSERT(p->n_rows[i] >= 0 && p->n_rows[i] <= p->block_size);
        d[i] = (pd_kv_block_desc){.src_block = p->blocks[i], .n_rows = p->n_rows[i], .word0 = words};
        words += (uint64_t)p->n_rows[i] * p->row_bytes / 8;
    }
    char *dev = kv_stage(cb, host, pb + db, sizeof(uint64_t) * (size_t)nl);
    void *dsums = dev + pb + db;
    pd_kv_checksum_kparams k = {.ptrs = (void **)dev, .blocks = (pd_kv_block_desc *)(dev + pb), .sums = dsums,
                                .n_blocks = p->n_blocks, .n_layers = nl, .block_size = p->block_size,
                                .row_bytes = p->row_bytes, .k_words = words};
    pd_cuda_kv_checksum(&k, cb->stream);
    PD_CUDA_CHECK_LAUNCH();
    cuda_download(b, p->sums, dsums, sizeof(uint64_t) * (size_t)nl);
}

static void cuda_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std) {
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_ASSERT(dtype == PD_DTYPE_F32 || dtype == PD_DTYPE_BF16 || dtype == PD_DTYPE_FP8_E4M3);
    pd_fill_normal_kparams k = {.dst = dst, .is_f32 = dtype == PD_DTYPE_F32, .is_fp8 = dtype == PD_DTYPE_FP8_E4M3,
                                .n = n, .seed = seed, .mean = mean, .std = std};
    pd_cuda_fill_normal(&k, pd_cuda_backend_of(b)->stream);
    PD_CUDA_CHECK_LAUNCH();
}

// ---- CUDA graphs -------------------------------------------------------------------------------

// An instantiated graph and the scratch generation its kernels' pointers belong to.
typedef struct cuda_graph {
    cudaGraphExec_t exec;
    uint64_t gen;
} cuda_graph;

static void cuda_graph_begin(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    // Thread-local mode: other threads (another engine) may use the runtime meanwhile.
    PD_CUDA_CHECK(cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal));
}

// A kernel node's function name (cuBLASLt's kernels are driver launches: the driver API names
// them all), or "?".
typedef struct drv_kparams {  // CUDA_KERNEL_NODE_PARAMS_v2 (cuda.h), without the driver header
    void *func;
    unsigned grid[3], block[3], smem;
    void **params, **extra;
    void *kern, *ctx;
} drv_kparams;
static const char *graph_node_name(cudaGraphNode_t n, drv_kparams *kp) {
    static void *get_params, *func_name, *kernel_name;
    static bool looked;
    enum cudaDriverEntryPointQueryResult qr;
    if (!looked) {  // (a symbol the driver lacks comes back as success with a NULL pointer)
        looked = true;
        if (cudaGetDriverEntryPointByVersion("cuGraphKernelNodeGetParams", &get_params, 12000, cudaEnableDefault, &qr) != cudaSuccess ||
            qr != cudaDriverEntryPointSuccess)
            get_params = NULL;
        if (cudaGetDriverEntryPointByVersion("cuFuncGetName", &func_name, 12030, cudaEnableDefault, &qr) != cudaSuccess ||
            qr != cudaDriverEntryPointSuccess)
            func_name = NULL;
        if (cudaGetDriverEntryPointByVersion("cuKernelGetName", &kernel_name, 12030, cudaEnableDefault, &qr) != cudaSuccess ||
            qr != cudaDriverEntryPointSuccess)
            kernel_name = NULL;
        cudaGetLastError();
    }
    memset(kp, 0, sizeof *kp);
    const char *name = NULL;
    if (!get_params || ((int (*)(cudaGraphNode_t, drv_kparams *))get_params)(n, kp) != 0) return "?";
    if (kp->func && func_name) ((int (*)(const char **, void *))func_name)(&name, kp->func);
    else if (kp->kern && kernel_name) ((int (*)(const char **, void *))kernel_name)(&name, kp->kern);
    return name ? name : "?";
}

// PD_CUDA_GRAPH_DUMP=1 (graph_end): every captured graph's nodes to stderr in capture order (type,
// kernel name, grid, block, dynamic shared memory, incoming edges: P programmatic, C programmatic
// from the launch-completion port, D ordinary), then the counts. A measurement / debug tool.
static void graph_dump(cudaGraph_t g, const void *lt_ws) {
    size_t n = 0, ne = 0;
    PD_CUDA_CHECK(cudaGraphGetNodes(g, NULL, &n));
    PD_CUDA_CHECK(cudaGraphGetEdges(g, NULL, NULL, NULL, &ne));
    cudaGraphNode_t *nodes = pd_calloc(n + 1, sizeof *nodes), *from = pd_calloc(ne + 1, sizeof *from);
    cudaGraphNode_t *to = pd_calloc(ne + 1, sizeof *to);
    cudaGraphEdgeData *ed = pd_calloc(ne + 1, sizeof *ed);
    PD_ASSERT(nodes && from && to && ed);
    PD_CUDA_CHECK(cudaGraphGetNodes(g, nodes, &n));
    PD_CUDA_CHECK(cudaGraphGetEdges(g, from, to, ed, &ne));
    size_t n_kern = 0, n_other = 0, n_prog = 0, n_lc = 0, n_def = 0;
    fprintf(stderr, "graph: %zu nodes, %zu edges (cuBLASLt workspace at %p)\n", n, ne, lt_ws);
    for (size_t i = 0; i < n; i++) {
        enum cudaGraphNodeType t;
        PD_CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &t));
        char in[64] = "";
        size_t k = 0;
        for (size_t j = 0; j < ne && k + 2 < sizeof in; j++)
            if (to[j] == nodes[i])
                in[k++] = ed[j].type != cudaGraphDependencyTypeProgrammatic ? 'D'
                          : ed[j].from_port == cudaGraphKernelNodePortLaunchCompletion ? 'C' : 'P';
        in[k] = 0;
        if (t == cudaGraphNodeTypeKernel) {
            drv_kparams kp;
            const char *name = graph_node_name(nodes[i], &kp);
            n_kern++;
            fprintf(stderr, "graph node %3zu kernel grid %u,%u,%u block %u smem %u in %-3s %.160s\n", i, kp.grid[0], kp.grid[1],
                    kp.grid[2], kp.block[0] * kp.block[1] * kp.block[2], kp.smem, in, name);
        } else if (t == cudaGraphNodeTypeMemset) {
            struct cudaMemsetParams mp;
            n_other++;
            PD_CUDA_CHECK(cudaGraphMemsetNodeGetParams(nodes[i], &mp));
            fprintf(stderr, "graph node %3zu memset %zu bytes at %p (value %u) in %s\n", i,
                    mp.width * mp.height * mp.elementSize, mp.dst, mp.value, in);
        } else {
            n_other++;
            fprintf(stderr, "graph node %3zu type %d in %s\n", i, (int)t, in);
        }
    }
    for (size_t j = 0; j < ne; j++) {
        if (ed[j].type != cudaGraphDependencyTypeProgrammatic) n_def++;
        else if (ed[j].from_port == cudaGraphKernelNodePortLaunchCompletion) n_lc++;
        else n_prog++;
    }
    fprintf(stderr, "graph: %zu kernels, %zu other nodes; edges %zu programmatic, %zu launch-completion, %zu ordinary\n",
            n_kern, n_other, n_prog, n_lc, n_def);
    pd_free(nodes), pd_free(from), pd_free(to), pd_free(ed);
}

static void *cuda_graph_end(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(cb->stream, &g);
    if (e != cudaSuccess || !g) {
        cudaGetLastError();
        PD_LOG_W("cuda: graph capture failed: %s", cudaGetErrorString(e));
        return NULL;
    }
    if (cb->graph_dump) graph_dump(g, cb->lt_ws);
    cuda_graph *cg = pd_calloc(1, sizeof *cg);
    e = cg ? cudaGraphInstantiate(&cg->exec, g, 0) : cudaErrorMemoryAllocation;
    cudaGraphDestroy(g);
    if (e != cudaSuccess) {
        cudaGetLastError();
        PD_LOG_W("cuda: graph instantiation failed: %s", cudaGetErrorString(e));
        pd_free(cg);
        return NULL;
    }
    cg->gen = cb->scratch_gen;
    return cg;
}

static bool cuda_graph_launch(pd_backend *b, void *g) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    cuda_graph *cg = g;
    if (cg->gen != cb->scratch_gen) return false;
    pd_cuda_bind(cb);
    PD_CUDA_CHECK(cudaGraphLaunch(cg->exec, cb->stream));
    return true;
}

static void cuda_graph_free(pd_backend *b, void *g) {
    cuda_graph *cg = g;
    pd_cuda_bind(pd_cuda_backend_of(b));
    PD_CUDA_CHECK(cudaGraphExecDestroy(cg->exec));
    pd_free(cg);
}

// cudaGetDeviceProperties' name, read once per backend.
static const char *cuda_device_name(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    if (!cb->device_name[0]) {
        struct cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, cb->device) == cudaSuccess) snprintf(cb->device_name, sizeof cb->device_name, "%s", prop.name);
        else snprintf(cb->device_name, sizeof cb->device_name, "cuda device %d", cb->device);
    }
    return cb->device_name;
}

static const pd_backend_iface cuda_iface = {
    .api_version = PD_BACKEND_API_VERSION,
    .name = "cuda",
    .free = cuda_free,
    .device_name = cuda_device_name,
    .weight_dtype = PD_DTYPE_BF16,
    .act_dtype = PD_DTYPE_BF16,
    .mem_info = cuda_mem_info,
    .dev_alloc = cuda_dev_alloc,
    .dev_free = cuda_dev_free,
    .upload = cuda_upload,
    .download = cuda_download,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .memset = cuda_memset,
    .sync = cuda_sync,
    .bind_thread = cuda_bind_thread,
    .embed = cuda_embed,
    .rmsnorm = cuda_rmsnorm,
    .matmul = pd_cuda_gemm_matmul,
    .fuses_matmul = pd_cuda_gemm_fuses,
    .fuses_epilogues = pd_cuda_gemm_fuses_epilogues,
    .rope_kv = cuda_rope_kv,
    .attention = cuda_attention,
    .silu_mul = cuda_silu_mul,
    .get_rows = cuda_get_rows,
    .copy_blocks = cuda_copy_blocks,
    .copy_d2d = cuda_copy_d2d,
    .dev_alloc_shared = cuda_alloc_shared,
    .dev_free_shared = cuda_free_shared,
    .import = cuda_import,
    .unimport = cuda_unimport,
    .kv_copy = cuda_kv_copy,
    .kv_checksum = cuda_kv_checksum,
    .xfer_mark = pd_cuda_xfer_mark,
    .kv_copy_xfer = pd_cuda_kv_copy_xfer,
    .kv_checksum_xfer = pd_cuda_kv_checksum_xfer,
    .xfer_sync = pd_cuda_xfer_sync,
    .xfer_fence = pd_cuda_xfer_fence,
    .xfer_fence_done = pd_cuda_xfer_fence_done,
    .xfer_layer_ready = pd_cuda_xfer_layer_ready,
    .xfer_layer_wait = pd_cuda_xfer_layer_wait,
    .xfer_fence_host = pd_cuda_xfer_fence_host,
    .graph_begin = cuda_graph_begin,
    .graph_end = cuda_graph_end,
    .graph_launch = cuda_graph_launch,
    .graph_free = cuda_graph_free,
    .timer_mark = cuda_timer_mark,
    .timer_ms = cuda_timer_ms,
    .prof_record = cuda_prof_record,
    .prof_ms = cuda_prof_ms,
    .fill_normal = cuda_fill_normal,
    .comm_id_new = pd_cuda_comm_id_new,
    .comm_new = pd_cuda_comm_new,
    .comm_free = pd_cuda_comm_free,
    .comm_post = pd_cuda_comm_post,
    .comm_kv_copy = pd_cuda_comm_kv_copy,
    .comm_wait = pd_cuda_comm_wait,
    .sample = pd_cuda_sample_op,
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
    if (e == cudaSuccess) tl_device = device;
    if (e == cudaSuccess) e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        pd_err_set(err, PD_ERR_DEVICE, "CUDA device %d: %s", device, cudaGetErrorString(e));
        pd_free(cb);
        return NULL;
    }
    pd_cuda_gemm_init(cb);
    cb->graph_dump = pd_cuda_env_int("PD_CUDA_GRAPH_DUMP", 0, 0, 1);
    return &cb->base;
}
