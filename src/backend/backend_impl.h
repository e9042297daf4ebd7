// backend_impl.h — the vtable behind pd_backend. Only backend implementations include this.
// One level of vtable: each backend fills a pd_backend_iface and embeds pd_backend first in its
// own struct. Methods marked (optional) may be NULL; the generic path in backend.c is used then.
#pragma once
#include "backend/backend.h"

enum { PD_COMM_OP_RECV = 0, PD_COMM_OP_SEND = 1, PD_COMM_OP_SEND_XFER = 2 };  // comm_post

typedef struct pd_backend_iface {
    int api_version;  // PD_BACKEND_API_VERSION
    const char *name;
    void (*free)(pd_backend *b);
    const char *(*device_name)(pd_backend *b);  // (optional) NULL: the backend's name
    pd_dtype weight_dtype, act_dtype;
    void (*mem_info)(pd_backend *b, size_t *free_bytes, size_t *total_bytes);
    void *(*dev_alloc)(pd_backend *b, size_t n_bytes);  // NULL on failure
    void (*dev_free)(pd_backend *b, void *p);
    void (*upload)(pd_backend *b, void *dst, const void *src, size_t n);
    void (*download)(pd_backend *b, void *dst, const void *src, size_t n);
    void (*memset)(pd_backend *b, void *dst, int v, size_t n);
    void (*sync)(pd_backend *b);
    void (*bind_thread)(pd_backend *b);  // optional (NULL: nothing to bind)
    void (*embed)(pd_backend *b, const pd_embed_params *p);
    void (*rmsnorm)(pd_backend *b, const pd_rmsnorm_params *p);
    void (*matmul)(pd_backend *b, const pd_matmul_params *p);
    bool (*fuses_matmul)(pd_backend *b, int M);  // (optional) NULL: never (pd_backend_fuses_matmul)
    bool (*fuses_epilogues)(pd_backend *b, int M);  // (optional) NULL: never (pd_backend_fuses_epilogues)
    void (*rope_kv)(pd_backend *b, const pd_rope_kv_params *p);
    void (*attention)(pd_backend *b, const pd_attention_params *p);
    void (*silu_mul)(pd_backend *b, const pd_silu_mul_params *p);
    void (*get_rows)(pd_backend *b, const pd_get_rows_params *p);
    // (optional) NULL: per-layer device-to-device copies through `copy_d2d`.
    void (*copy_blocks)(pd_backend *b, const pd_copy_blocks_params *p);
    void (*copy_d2d)(pd_backend *b, void *dst, const void *src, size_t n);
    // (optional) shared buffers: NULL means the backend cannot export/import.
    void *(*dev_alloc_shared)(pd_backend *b, size_t n_bytes, pd_buffer_handle *h, pd_err *err);
    void (*dev_free_shared)(pd_backend *b, void *p, const pd_buffer_handle *h);
    void *(*import)(pd_backend *b, const pd_buffer_handle *h, pd_err *err);
    void (*unimport)(pd_backend *b, void *p, const pd_buffer_handle *h);
    // (optional) NULL: generic per-block copy_d2d loops / download + CPU checksum in backend.c.
    void (*kv_copy)(pd_backend *b, const pd_kv_copy_params *p);
    void (*kv_checksum)(pd_backend *b, const pd_kv_checksum_params *p);
    // (optional) transfer stream: NULL means none (see pd_backend_xfer_mark); all four or none.
    void (*xfer_mark)(pd_backend *b);
    void (*kv_copy_xfer)(pd_backend *b, const pd_kv_copy_params *p);
    void (*kv_checksum_xfer)(pd_backend *b, const pd_kv_checksum_params *p);
    void (*xfer_sync)(pd_backend *b);
    // (optional) NULL: fences are done at once (pd_backend_xfer_fence).
    uint64_t (*xfer_fence)(pd_backend *b);
    bool (*xfer_fence_done)(pd_backend *b, uint64_t fence);
    // (optional, with xfer_fence) layer fences: NULL means pd_backend_xfer_layer_ready does
    // nothing, pd_backend_xfer_layer_wait does nothing and pd_backend_xfer_fence_host is
    // pd_backend_xfer_fence (the compute waits for everything: correct, no overlap).
    void (*xfer_layer_ready)(pd_backend *b, int layer);
    void (*xfer_layer_wait)(pd_backend *b, int layer);
    uint64_t (*xfer_fence_host)(pd_backend *b);
    void (*fill_normal)(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std);
    // (optional) graphs: NULL means every op runs eagerly. See pd_backend_graph_begin.
    void (*graph_begin)(pd_backend *b);
    void *(*graph_end)(pd_backend *b);             // NULL when the capture failed
    bool (*graph_launch)(pd_backend *b, void *g);  // false: stale (device scratch moved since capture)
    void (*graph_free)(pd_backend *b, void *g);
    // (optional) device timing: NULL means none. See pd_backend_timer_mark.
    void (*timer_mark)(pd_backend *b, int i);
    float (*timer_ms)(pd_backend *b, int i, int j);
    // (optional, both or neither) the op profiler's events (prof.c): prof_record(b, i) records
    // event i of a pool that grows as needed on the compute stream; prof_ms(b, i, j) = device
    // milliseconds from event i to event j once both completed (< 0: unknown).
    void (*prof_record)(pd_backend *b, int i);
    float (*prof_ms)(pd_backend *b, int i, int j);
    // (optional) NULL: no device sampling; the caller samples on the host. See pd_op_sample.
    void (*sample)(pd_backend *b, const pd_sample_params *p);
    // (optional) device messaging (pd_comm_*): NULL means none. c is what comm_new returned.
    pd_status (*comm_id_new)(pd_backend *b, pd_comm_id *out, pd_err *err);
    void *(*comm_new)(pd_backend *b, const pd_comm_id *id, int n_ranks, int rank, int timeout_ms, pd_err *err);
    void (*comm_free)(pd_backend *b, void *c);
    // op: PD_COMM_OP_RECV, PD_COMM_OP_SEND (after the backend's stream), PD_COMM_OP_SEND_XFER (after
    // its transfer stream)
    pd_status (*comm_post)(pd_backend *b, void *c, void *buf, size_t n, int peer, int op, pd_err *err);
    void (*comm_kv_copy)(pd_backend *b, void *c, const pd_kv_copy_params *p);
    pd_status (*comm_wait)(pd_backend *b, void *c, int timeout_ms, pd_err *err);
    // (optional) host memory the device can DMA from / to (CUDA: pinned). NULL: plain pd_malloc.
    void *(*host_alloc)(pd_backend *b, size_t n_bytes);
    void (*host_free)(pd_backend *b, void *p);
} pd_backend_iface;

// prof.c: the op profiler's brackets (backend.c calls them around every op; -1 / no-op when no
// profile of b is in progress). The key (printf format) names the op and its shape; flops: 0
// unless a GEMM.
int pd_backend_prof_op_begin(pd_backend *b, double flops, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
void pd_backend_prof_op_end(pd_backend *b, int i);

struct pd_backend {
    const pd_backend_iface *iface;
};

struct pd_buffer {
    pd_backend *backend;  // borrowed
    void *ptr;            // owned device memory
    size_t n_bytes;
    bool is_shared;       // allocated by dev_alloc_shared; handle describes it
    pd_buffer_handle handle;
};

// Constructors of the compiled-in backends (registry.c calls them).
pd_backend *pd_backend_cuda_new(int device, pd_err *err);
bool pd_backend_cuda_available(void);
