// xfer.c — the CUDA backend's transfer stream (pd_backend_xfer_mark and friends, backend.h): a
// second non-blocking stream on the backend's device for KV exports that overlap with compute.
//   * A mark records an event on the compute stream and makes the transfer stream wait for it;
//     two events in a ring, and a mark first waits on the host for the previous one, so the host
//     never runs more than one mark ahead of the compute it depends on (the fence's bound).
//   * Descriptors are staged through a pinned host buffer mirrored by a device buffer, bump-
//     allocated and reset at each xfer_sync: pinned uploads are truly asynchronous (a pageable
//     upload may synchronise with the stream, which waits on compute) and no region is reused
//     before the stream has consumed it. Growing drains the stream first.
//   * Checksums are computed into the device buffer and copied back into the pinned one; the
//     caller's sums are filled from there at xfer_sync (the pending list).
//   * A kv_copy with host memory on one side runs on 16 CTAs striding over it (PD_CUDA_KV_COPY_CTAS,
//     pd_cuda_xfer_of): PCIe, not the SMs, bounds it, and the compute stream keeps the other SMs.
//   * PD_CUDA_KV_DMA=1: a copy with host memory on one side (the KV tiers' pinned DRAM pages,
//     either direction) goes to the copy engines, one cudaMemcpyBatchAsync of every (layer, K/V,
//     run of blocks contiguous on both sides), instead of the kv_copy kernel, which holds SM slots
//     for the whole PCIe transfer beside the compute stream's GEMMs; 2: every copy (measurement).
//     Off by default (0): on an H100 the copy engines move scattered 32 KiB block rows at ~34 GB/s
//     against the kernel's ~51 GB/s (host->device 55 GB/s), and the tier benchmark's steps were no
//     shorter with them (docs/benchmarks.md, KV tiers, session 10).
#include <stdatomic.h>
#include <string.h>
#include "backend/cuda/cuda_impl.h"
#include "kernels/kv_xfer.cuh"

typedef struct xfer_pending {
    uint64_t *dst;  // the caller's sums
    size_t off;     // in the pinned buffer
    int n;
} xfer_pending;

struct pd_cuda_xfer {
    cudaStream_t stream;
    cudaEvent_t ev[2];
    cudaEvent_t fence_ev;              // pd_cuda_xfer_fence: the compute stream waits on it
    uint64_t n_fences;                 // issued (host thread)
    _Atomic uint64_t n_fences_done;    // bumped by a host function on the transfer stream, in order
    uint64_t n_marks;
    cudaEvent_t *layer_ev;             // pd_cuda_xfer_layer_ready: (n_layer_ev) one per layer
    int n_layer_ev;
    char *host, *dev;  // pinned staging and its device mirror, cap bytes each
    size_t cap, used;
    xfer_pending *pending;
    int n_pending, cap_pending;
    int dma;                           // PD_CUDA_KV_DMA (see the head of this file)
    int copy_ctas;                     // PD_CUDA_KV_COPY_CTAS: the kv_copy kernel's CTA cap (0: none)
    void **dma_dst;                    // cudaMemcpyBatchAsync's host arrays, grown as needed
    const void **dma_src;
    size_t *dma_size, dma_cap;
};

static void xfer_drain(pd_cuda_xfer *x) {
    PD_CUDA_CHECK(cudaStreamSynchronize(x->stream));
    for (int i = 0; i < x->n_pending; i++)
        memcpy(x->pending[i].dst, x->host + x->pending[i].off, sizeof(uint64_t) * (size_t)x->pending[i].n);
    x->n_pending = 0;
    x->used = 0;
}

static pd_cuda_xfer *xfer_of(pd_cuda_backend *cb) {
    pd_cuda_bind(cb);
    if (cb->xfer) return cb->xfer;
    pd_cuda_xfer *x = pd_calloc(1, sizeof *x);
    PD_ASSERT(x);
    PD_CUDA_CHECK(cudaStreamCreateWithFlags(&x->stream, cudaStreamNonBlocking));
    for (int i = 0; i < 2; i++) PD_CUDA_CHECK(cudaEventCreateWithFlags(&x->ev[i], cudaEventDisableTiming));
    PD_CUDA_CHECK(cudaEventCreateWithFlags(&x->fence_ev, cudaEventDisableTiming));
    x->dma = pd_cuda_env_int("PD_CUDA_KV_DMA", 0, 0, 2);
    // A transfer-stream kv_copy with host memory on one side runs 16 CTAs striding over the copy
    // (PD_CUDA_KV_COPY_CTAS=N: N; 0: one CTA per 16 KiB chunk, as before session 11). Such a copy is
    // bound by PCIe: on an H100, 16 CTAs move 256 scattered 2 MiB blocks at 50.65 GB/s against
    // 50.87 with one CTA a chunk (~600 a layer of a tier load), whose CTAs, parked on PCIe reads,
    // held SM slots the compute stream's GEMMs wanted: a DRAM tier step's forward took 27.96 ms of
    // device time against 25.07 ms capped (docs/benchmarks.md, KV tiers, session 11).
    // Device-to-device copies (handoffs over NVLink) keep every CTA.
    x->copy_ctas = pd_cuda_env_int("PD_CUDA_KV_COPY_CTAS", 16, 0, 65535);
    cb->xfer = x;
    return x;
}

// True when p points into host memory CUDA knows (pinned or registered): a copy from or to it
// crosses PCIe.
static bool xfer_is_host(const void *p) {
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    return a.type == cudaMemoryTypeHost;
}

// The copy on the copy engines (see the head of this file). Blocks listed one after another whose
// source and destination indexes both step by one, every one but the last full, make one run: one
// copy per (layer, K/V, run).
static void xfer_dma(pd_cuda_xfer *x, const pd_kv_copy_params *p) {
    int nl = p->layer_end - p->layer_begin;
    size_t block_bytes = p->row_bytes * (size_t)p->block_size;
    size_t need = 2 * (size_t)nl * (size_t)p->n_blocks;
    if (need > x->dma_cap) {
        size_t cap = PD_MAX(need, 2 * x->dma_cap);
        pd_free(x->dma_dst);
        pd_free((void *)x->dma_src);
        pd_free(x->dma_size);
        x->dma_dst = pd_malloc(sizeof(void *) * cap);
        x->dma_src = pd_malloc(sizeof(void *) * cap);
        x->dma_size = pd_malloc(sizeof(size_t) * cap);
        PD_ASSERT(x->dma_dst && x->dma_src && x->dma_size);
        x->dma_cap = cap;
    }
    size_t n = 0;
    for (int i = 0; i < p->n_blocks;) {
        int j = i;  // the run is [i, j]
        PD_ASSERT(p->n_rows[i] >= 0 && p->n_rows[i] <= p->block_size);
        while (j + 1 < p->n_blocks && p->n_rows[j] == p->block_size && p->src_blocks[j + 1] == p->src_blocks[j] + 1 &&
               p->dst_blocks[j + 1] == p->dst_blocks[j] + 1) {
            j++;
            PD_ASSERT(p->n_rows[j] >= 0 && p->n_rows[j] <= p->block_size);
        }
        size_t bytes = (size_t)(j - i) * block_bytes + (size_t)p->n_rows[j] * p->row_bytes;
        if (bytes > 0) {
            size_t so = (size_t)p->src_blocks[i] * block_bytes, d_o = (size_t)p->dst_blocks[i] * block_bytes;
            for (int l = p->layer_begin; l < p->layer_end; l++) {
                x->dma_src[n] = (const char *)p->src_k[l] + so, x->dma_dst[n] = (char *)p->dst_k[l] + d_o;
                x->dma_size[n++] = bytes;
                x->dma_src[n] = (const char *)p->src_v[l] + so, x->dma_dst[n] = (char *)p->dst_v[l] + d_o;
                x->dma_size[n++] = bytes;
            }
        }
        i = j + 1;
    }
    if (n == 0) return;
    struct cudaMemcpyAttributes attr;
    memset(&attr, 0, sizeof attr);
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // sources written by earlier stream work
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
    size_t attr_idx = 0;
    PD_CUDA_CHECK(cudaMemcpyBatchAsync(x->dma_dst, (const void *const *)x->dma_src, x->dma_size, n, &attr, &attr_idx,
                                       1, x->stream));
}

// n bytes (16-aligned) of staging: host and device addresses at the same offset.
static size_t xfer_alloc(pd_cuda_xfer *x, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (x->used + n > x->cap) {
        xfer_drain(x);
        if (n > x->cap) {
            if (x->host) PD_CUDA_CHECK(cudaFreeHost(x->host));
            if (x->dev) PD_CUDA_CHECK(cudaFree(x->dev));
            size_t want = PD_MAX(n, PD_MAX(x->cap * 2, (size_t)1 << 20));
            PD_CUDA_CHECK(cudaMallocHost((void **)&x->host, want));
            PD_CUDA_CHECK(cudaMalloc((void **)&x->dev, want));
            x->cap = want;
        }
    }
    size_t off = x->used;
    x->used += n;
    return off;
}

void pd_cuda_xfer_mark(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    enum cudaStreamCaptureStatus cs;
    PD_CUDA_CHECK(cudaStreamIsCapturing(cb->stream, &cs));
    PD_ASSERT(cs == cudaStreamCaptureStatusNone);
    cudaEvent_t ev = x->ev[x->n_marks & 1];
    if (x->n_marks > 0) PD_CUDA_CHECK(cudaEventSynchronize(x->ev[(x->n_marks - 1) & 1]));  // bounded run-ahead
    x->n_marks++;
    PD_CUDA_CHECK(cudaEventRecord(ev, cb->stream));
    PD_CUDA_CHECK(cudaStreamWaitEvent(x->stream, ev, 0));
}

void pd_cuda_kv_copy_xfer(pd_backend *b, const pd_kv_copy_params *p) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    int nl = p->layer_end - p->layer_begin;
    if (p->n_blocks <= 0 || nl <= 0) return;
    // Host memory on one side: the copy crosses PCIe (the KV tiers' pinned DRAM pages).
    bool host = (x->dma == 1 || x->copy_ctas > 0) &&
                (xfer_is_host(p->src_k[p->layer_begin]) || xfer_is_host(p->dst_k[p->layer_begin]));
    if (x->dma == 2 || (x->dma == 1 && host)) {
        xfer_dma(x, p);
        return;
    }
    size_t off, n;
    char *packed = pd_cuda_kv_copy_pack(p, &off, &n);
    size_t at = xfer_alloc(x, n);
    memcpy(x->host + at, packed, n);
    pd_free(packed);
    PD_CUDA_CHECK(cudaMemcpyAsync(x->dev + at, x->host + at, n, cudaMemcpyHostToDevice, x->stream));
    pd_kv_copy_kparams k = {.ptrs = (void *const *)(x->dev + at), .blocks = (const pd_kv_block_desc *)(x->dev + at + off),
                            .n_blocks = p->n_blocks, .n_layers = nl, .block_size = p->block_size, .row_bytes = p->row_bytes,
                            .max_ctas = host ? x->copy_ctas : 0};
    pd_cuda_kv_copy(&k, x->stream);
    PD_CUDA_CHECK_LAUNCH();
}

void pd_cuda_kv_checksum_xfer(pd_backend *b, const pd_kv_checksum_params *p) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    int nl = p->layer_end - p->layer_begin;
    if (nl <= 0) return;
    PD_ASSERT(p->row_bytes % 8 == 0 && p->block_size > 0);
    int nb = PD_MAX(p->n_blocks, 0);
    size_t pb = sizeof(void *) * 2 * (size_t)nl, db = sizeof(pd_kv_block_desc) * (size_t)nb;
    size_t sb = sizeof(uint64_t) * (size_t)nl, sums_off = (pb + db + 15) & ~(size_t)15;
    size_t at = xfer_alloc(x, sums_off + sb);
    void **ptrs = (void **)(x->host + at);
    pd_kv_block_desc *d = (pd_kv_block_desc *)(x->host + at + pb);
    for (int l = 0; l < nl; l++) ptrs[2 * l] = p->k[p->layer_begin + l], ptrs[2 * l + 1] = p->v[p->layer_begin + l];
    uint64_t words = 0;
    for (int i = 0; i < nb; i++) {
        PD_ASSERT(p->n_rows[i] >= 0 && p->n_rows[i] <= p->block_size);
        d[i] = (pd_kv_block_desc){.src_block = p->blocks[i], .n_rows = p->n_rows[i], .word0 = words};
        words += (uint64_t)p->n_rows[i] * p->row_bytes / 8;
    }
    PD_CUDA_CHECK(cudaMemcpyAsync(x->dev + at, x->host + at, pb + db, cudaMemcpyHostToDevice, x->stream));
    pd_kv_checksum_kparams k = {.ptrs = (void **)(x->dev + at), .blocks = (pd_kv_block_desc *)(x->dev + at + pb),
                                .sums = (uint64_t *)(x->dev + at + sums_off), .n_blocks = nb, .n_layers = nl,
                                .block_size = p->block_size, .row_bytes = p->row_bytes, .k_words = words};
    pd_cuda_kv_checksum(&k, x->stream);
    PD_CUDA_CHECK_LAUNCH();
    PD_CUDA_CHECK(cudaMemcpyAsync(x->host + at + sums_off, x->dev + at + sums_off, sb, cudaMemcpyDeviceToHost, x->stream));
    if (x->n_pending == x->cap_pending) {
        int cap = PD_MAX(16, 2 * x->cap_pending);
        xfer_pending *np = pd_realloc(x->pending, sizeof *np * (size_t)cap);
        PD_ASSERT(np);
        x->pending = np;
        x->cap_pending = cap;
    }
    x->pending[x->n_pending++] = (xfer_pending){.dst = p->sums, .off = at + sums_off, .n = nl};
}

void pd_cuda_xfer_sync(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    if (cb->xfer) xfer_drain(cb->xfer);
}

static void CUDART_CB fence_reached(void *ud) {
    pd_cuda_xfer *x = ud;
    atomic_fetch_add(&x->n_fences_done, 1);  // the stream runs host functions in order
}

uint64_t pd_cuda_xfer_fence(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    PD_CUDA_CHECK(cudaEventRecord(x->fence_ev, x->stream));
    PD_CUDA_CHECK(cudaStreamWaitEvent(cb->stream, x->fence_ev, 0));  // later compute runs after the copies
    PD_CUDA_CHECK(cudaLaunchHostFunc(x->stream, fence_reached, x));
    return ++x->n_fences;
}

bool pd_cuda_xfer_fence_done(pd_backend *b, uint64_t fence) {
    pd_cuda_xfer *x = pd_cuda_backend_of(b)->xfer;
    return !x || atomic_load(&x->n_fences_done) >= fence;
}

void pd_cuda_xfer_layer_ready(pd_backend *b, int layer) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    if (layer >= x->n_layer_ev) {
        int n = PD_MAX(layer + 1, 2 * x->n_layer_ev);
        cudaEvent_t *ev = pd_realloc(x->layer_ev, sizeof *ev * (size_t)n);
        PD_ASSERT(ev);
        for (int i = x->n_layer_ev; i < n; i++) PD_CUDA_CHECK(cudaEventCreateWithFlags(&ev[i], cudaEventDisableTiming));
        x->layer_ev = ev;
        x->n_layer_ev = n;
    }
    PD_CUDA_CHECK(cudaEventRecord(x->layer_ev[layer], x->stream));
}

void pd_cuda_xfer_layer_wait(pd_backend *b, int layer) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = cb->xfer;
    if (!x || layer >= x->n_layer_ev) return;  // never marked: nothing to wait for
    pd_cuda_bind(cb);
    PD_CUDA_CHECK(cudaStreamWaitEvent(cb->stream, x->layer_ev[layer], 0));
}

uint64_t pd_cuda_xfer_fence_host(pd_backend *b) {
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_xfer *x = xfer_of(cb);
    PD_CUDA_CHECK(cudaLaunchHostFunc(x->stream, fence_reached, x));  // the compute stream does not wait
    return ++x->n_fences;
}

cudaStream_t pd_cuda_xfer_stream(pd_cuda_backend *cb) { return xfer_of(cb)->stream; }

void pd_cuda_xfer_fini(pd_cuda_backend *cb) {
    pd_cuda_xfer *x = cb->xfer;
    if (!x) return;
    cudaStreamSynchronize(x->stream);
    for (int i = 0; i < 2; i++) cudaEventDestroy(x->ev[i]);
    cudaEventDestroy(x->fence_ev);
    for (int i = 0; i < x->n_layer_ev; i++) cudaEventDestroy(x->layer_ev[i]);
    pd_free(x->layer_ev);
    cudaStreamDestroy(x->stream);
    if (x->host) cudaFreeHost(x->host);
    if (x->dev) cudaFree(x->dev);
    pd_free(x->pending);
    pd_free(x->dma_dst);
    pd_free((void *)x->dma_src);
    pd_free(x->dma_size);
    pd_free(x);
    cb->xfer = NULL;
}
