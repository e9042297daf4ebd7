// cuda_impl.h — internals shared by the CUDA backend's C files (backend.c, gemm.c). Only
// src/backend/cuda includes this.
#pragma once
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include "backend/backend_impl.h"

// Logs the failing call with file:line and aborts: device errors at this level are invariant
// violations (a bad launch, a lost device), never expected outcomes.
#define PD_CUDA_CHECK(x)                                                                         \
    do {                                                                                         \
        cudaError_t e_ = (x);                                                                    \
        if (e_ != cudaSuccess) pd_abort(__FILE__, __LINE__, __func__, cudaGetErrorString(e_));  \
    } while (0)
#define PD_CUBLAS_CHECK(x)                                                                       \
    do {                                                                                         \
        cublasStatus_t s_ = (x);                                                                 \
        if (s_ != CUBLAS_STATUS_SUCCESS) pd_abort(__FILE__, __LINE__, __func__, #x);             \
    } while (0)
// After every kernel launch.
#define PD_CUDA_CHECK_LAUNCH() PD_CUDA_CHECK(cudaGetLastError())

typedef struct pd_cuda_gemm_plan pd_cuda_gemm_plan;
typedef struct pd_cuda_sampler pd_cuda_sampler;
typedef struct pd_cuda_xfer pd_cuda_xfer;  // xfer.c: the transfer stream  // sample.c: pd_op_sample's staging buffers

typedef struct pd_cuda_backend {
    pd_backend base;
    int device;
    char device_name[256];  // cuda_device_name, filled on first use
    cudaStream_t stream;
    cudaEvent_t timer[8];   // pd_backend_timer_mark (PD_BACKEND_TIMERS), created at first use
    bool timer_set[8];
    cudaEvent_t *prof_ev;   // the op profiler's events (prof.c), created as needed, kept
    int n_prof_ev;
    // cuBLASLt
    cublasLtHandle_t lt;
    void *lt_ws;
    size_t lt_ws_bytes;
    pd_cuda_gemm_plan *plans;  // cached heuristics, one per (M, N, K, lda, flags)
    int n_plans;
    size_t cap_plans;
    int gemv_max_m;            // M <= this uses the skinny GEMM kernel (0 disables)
    void *gemv_ws;             // its split-K partials + tile counters; zero between launches
    size_t gemv_ws_bytes;
    int skinny;                // skinny kernels for M <= 16: 0 off, 1 per shape rule, 2 always
    int skinny_rows;           // its weight rows per block (2 or 4)
    int skinny_occ4;           // M = 5: its 128-register build (4 blocks per SM)
    int skinny_rule_max_m;     // the default rule's CUDA-core kernel up to this M (5)
    int skinny_async;          // its weights through shared memory (cp.async)
    int skinny_prewait;        // PD_CUDA_SKINNY_PREWAIT + 1: 0 all of a first tile's loads before the PDL wait
    int skinny_norm_pf;        // PD_CUDA_SKINNY_NORM_PF: the fused norm's weight prefetched before the PDL wait
    int skinny_mma;            // kernels/skinny_mma.cu (M <= 16): 0 never, 1/3 the measured rules, 2 always
    int skinny_mma_rows;       // its weight rows per block (16 or 32)
    int skinny_mma_pipe;       // its double-buffered weight loads: -1 the rule's choice, 0 off, 1 on
    int skinny_mma_loads;      // its weight loads in flight per thread (16 or 32)
    int skinny_fuse;           // pd_backend_fuses_matmul for 1 <= M <= this (0: never; PD_CUDA_SKINNY_FUSE)
    bool fuse_rope, fuse_glu;  // parts the skinny kernel does itself (PD_CUDA_FUSE_*)
    int fuse_norm_max_m;       // and the norm for M <= this (PD_CUDA_FUSE_NORM_MAX_M)
    int fuse_mma_min_m;        // fused forms on the tensor-core kernel for M >= this (0: never)
    int fuse_mma_forms;        // which forms (gemm.c FUSE_MMA_*; all above 8 rows)
    void *fuse_ws;             // the fused forms' unfused fallback (M > 8, unaligned): norm / gate_up
    size_t fuse_ws_bytes;
    int bgemm;                 // kernels/bgemm.cu for 17 <= M <= 64: 0 off, 1 on (PD_CUDA_BGEMM)
    int bgemm_per_sm;          // its split-K sizing: blocks per SM aimed at (PD_CUDA_BGEMM_PER_SM)
    int bgemm_stages;          // its cp.async ring depth, 4 or 8 (PD_CUDA_BGEMM_STAGES)
    int tune, tune_max_m, tune_algos;  // cuBLASLt tuning of decode shapes (gemm.c, PD_CUDA_GEMM_TUNE*)
    int tune_pf_min_m, tune_pf_algos;  // and of prefill shapes (gemm.c gemm_tune_pf, PD_CUDA_GEMM_TUNE_PF*)
    struct pd_cuda_pf_algo {           // their choices per (N, K, lda, flags, power-of-two bucket of M)
        int N, K, lda, flags, bucket;
        cublasLtMatmulAlgo_t algo;
    } pf_algos[64];
    int n_pf_algos;
    int pf_pick;                       // PD_CUDA_GEMM_PF_PICK (gemm.c): -1 the heuristic's first
    void *bgemm_ws;            // its split-K partials + tile counters; counters zero between launches
    size_t bgemm_ws_bytes;
    int graph_dump;            // PD_CUDA_GRAPH_DUMP: print each captured graph (cuda.c graph_dump)
    // attention split-K partials; grows outside graph capture only
    float *attn_ws;
    size_t attn_ws_bytes;
    int *attn_cnt;          // the decode attention's split counters (zeroed when allocated)
    size_t attn_cnt_bytes;
    // copy_blocks staging (device): cache pointers then (src, dst) pairs
    void *cb_dev;
    size_t cb_dev_bytes;
    // kv_copy / kv_checksum staging (device): layer pointers, block descriptors, layer sums
    void *kv_dev;
    size_t kv_dev_bytes;
    // bumped whenever a scratch buffer moves: graphs captured before then are stale
    uint64_t scratch_gen;
    pd_cuda_sampler *sampler;  // NULL until the first pd_op_sample
    pd_cuda_xfer *xfer;        // xfer.c: the transfer stream; NULL until the first use
} pd_cuda_backend;

static inline pd_cuda_backend *pd_cuda_backend_of(pd_backend *b) { return (pd_cuda_backend *)b; }

// Makes cb's device current in the calling thread (cached per thread). Every entry point calls it.
void pd_cuda_bind(pd_cuda_backend *cb);

// gemm.c
void pd_cuda_gemm_init(pd_cuda_backend *cb);
// Integer knob `name` of the environment (measurement switches): dflt when unset or empty; anything
// but an integer in [lo, hi] is a configuration error (logged, then abort), never the default.
int pd_cuda_env_int(const char *name, int dflt, int lo, int hi);
void pd_cuda_gemm_fini(pd_cuda_backend *cb);
void pd_cuda_gemm_matmul(pd_backend *b, const pd_matmul_params *p);
bool pd_cuda_gemm_fuses(pd_backend *b, int M);
bool pd_cuda_gemm_fuses_epilogues(pd_backend *b, int M);
// The host staging of a kv_copy (pd_malloc'ed; the caller uploads and frees it): 4 layer pointers
// per layer (src_k, src_v, dst_k, dst_v), then one pd_kv_block_desc per block at *desc_off;
// *n_bytes in all. Shared by the backend's kv_copy and the NCCL comm's scatter.
char *pd_cuda_kv_copy_pack(const pd_kv_copy_params *p, size_t *desc_off, size_t *n_bytes);
// Grows a device scratch buffer (synchronising first). Aborts if the stream is being captured.
// in_graphs: captured kernels may use the buffer, so growing it makes existing graphs stale.
void pd_cuda_scratch_reserve(pd_cuda_backend *cb, void **ptr, size_t *cur_bytes, size_t need_bytes, bool in_graphs);
// The same for counters / partials that must read zero when a kernel starts (the kernels leave
// them zero): the whole buffer is cleared whenever it is (re)allocated. Used by captured kernels.
void pd_cuda_scratch_reserve_zeroed(pd_cuda_backend *cb, void **ptr, size_t *cur_bytes, size_t need_bytes);
// Uploads n bytes of host staging (pd_malloc'ed, freed here) to the device scratch *dev on stream
// s, grown (after synchronising s) to hold them plus n_tail bytes; returns the device address.
// cudaMemcpyAsync has consumed pageable memory when it returns; s orders the scratch's reuse.
char *pd_cuda_stage(cudaStream_t s, void **dev, size_t *dev_bytes, char *host, size_t n, size_t n_tail);

// xfer.c: the transfer stream (backend.h pd_backend_xfer_mark and friends)
void pd_cuda_xfer_mark(pd_backend *b);
void pd_cuda_kv_copy_xfer(pd_backend *b, const pd_kv_copy_params *p);
void pd_cuda_kv_checksum_xfer(pd_backend *b, const pd_kv_checksum_params *p);
void pd_cuda_xfer_sync(pd_backend *b);
uint64_t pd_cuda_xfer_fence(pd_backend *b);
bool pd_cuda_xfer_fence_done(pd_backend *b, uint64_t fence);
void pd_cuda_xfer_layer_ready(pd_backend *b, int layer);
void pd_cuda_xfer_layer_wait(pd_backend *b, int layer);
uint64_t pd_cuda_xfer_fence_host(pd_backend *b);
void pd_cuda_xfer_fini(pd_cuda_backend *cb);
cudaStream_t pd_cuda_xfer_stream(pd_cuda_backend *cb);  // made on first use

// sample.c
void pd_cuda_sample_op(pd_backend *b, const pd_sample_params *p);
void pd_cuda_sample_fini(pd_cuda_backend *cb);
