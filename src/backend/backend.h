// backend — the one interface between the model runtime and a compute device.
//
// A backend owns device memory (pd_buffer) and runs ops. Ops take raw device pointers and plain
// parameter structs (FlashInfer/ggml style): no tensor objects, no graph. The model layer
// (src/model/forward.c) drives the ops in order for one forward pass; the same sequence runs on
// the CPU backend (fp32, the reference) and the CUDA backend (bf16 storage, fp32 accumulation).
//
// Dtypes: each backend reports the dtype it wants weights, activations and the KV cache in
// (pd_backend_weight_dtype / pd_backend_act_dtype). The CPU backend uses F32 everywhere; CUDA uses
// BF16 for weights, activations and KV, and F32 for logits. Every op's pointers are in the
// backend's activation dtype unless the params say otherwise.
//
// Paged KV layout (shared by every backend, the engine and the KV transfer):
//   per layer l: k_cache[l], v_cache[l] each (n_blocks, block_size, n_kv_heads, head_dim)
//   A token's slot is block_id * block_size + offset_in_block.
//
// Batch description (pd_batch_dev): the tokens of several sequences are concatenated; sequence s
// owns query rows [q_indptr[s], q_indptr[s+1]) and, after this step, has kv_lens[s] tokens of
// context whose blocks are bt_indices[bt_indptr[s] .. bt_indptr[s+1]) (a CSR page table). The
// new tokens are the last q_len of the kv_len positions, so query row i of sequence s sits at
// position kv_lens[s] - q_len + i and attends causally to kv positions [0, that position].
//
// Threading: a backend is used by one thread at a time (the engine thread). Ops are enqueued in
// order on the backend's stream; pd_backend_sync waits for all of them. Copies to host
// (pd_backend_download) synchronize.
#pragma once
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_BACKEND_API_VERSION 1

typedef enum pd_dtype {
    PD_DTYPE_F32 = 0,
    PD_DTYPE_F16 = 1,
    PD_DTYPE_BF16 = 2,
    PD_DTYPE_I32 = 3,
} pd_dtype;
size_t pd_dtype_size(pd_dtype t);
const char *pd_dtype_name(pd_dtype t);

typedef struct pd_backend pd_backend;
typedef struct pd_buffer pd_buffer;
typedef struct pd_graph pd_graph;  // a captured op sequence (pd_backend_graph_*)

// ---- op parameters (all pointers are device pointers of the backend) ---------------------------

// out[i, :] = table[ids[i], :]
typedef struct pd_embed_params {
    const int32_t *ids;  // (n_tokens), i32
    const void *table;   // (vocab, dim), weight dtype
    void *out;           // (n_tokens, dim), act dtype
    int n_tokens, dim, vocab;
} pd_embed_params;

// If add != NULL: x += add first (residual). Then out = x / rms(x) * w.
// x may alias out only when add == NULL.
typedef struct pd_rmsnorm_params {
    void *x;          // (n_rows, dim), act dtype
    const void *add;  // (n_rows, dim) or NULL, act dtype
    const void *w;    // (dim), weight dtype
    void *out;        // (n_rows, dim), act dtype
    int n_rows, dim;
    float eps;
} pd_rmsnorm_params;

// out (M, N) = a (M, K) · wᵀ  [+ bias]  [+ out if accumulate]. w is (N, K) row-major (a HF
// Linear weight). a has row stride lda elements (>= K; 0 means K). out is act dtype unless
// out_f32 (logits), in which case it is F32 on every backend.
typedef struct pd_matmul_params {
    const void *a;     // (M, K), act dtype, row stride lda
    const void *w;     // (N, K), weight dtype
    const void *bias;  // (N) or NULL, weight dtype
    void *out;         // (M, N), act dtype or F32 if out_f32
    int M, N, K, lda;
    bool accumulate;
    bool out_f32;
} pd_matmul_params;

// RoPE (HF "rotate_half" layout: pairs (i, i + head_dim/2)) applied in place to the q and k parts
// of qkv rows, then k and v of each token are written to the paged cache at slot_mapping[i].
// qkv row layout: [q (n_heads*head_dim) | k (n_kv_heads*head_dim) | v (n_kv_heads*head_dim)].
typedef struct pd_rope_kv_params {
    void *qkv;                   // (n_tokens, (n_heads + 2*n_kv_heads) * head_dim), act dtype
    const int32_t *positions;    // (n_tokens)
    const float *inv_freq;       // (head_dim/2), f32: frequencies incl. llama3/linear scaling
    const int32_t *slot_mapping; // (n_tokens): block_id * block_size + offset; < 0: padding, no KV write
    void *k_cache, *v_cache;     // (n_blocks, block_size, n_kv_heads, head_dim), kv dtype
    int n_tokens, n_heads, n_kv_heads, head_dim;
    float attn_scaling;          // multiplies cos/sin (1.0 for llama/qwen2)
} pd_rope_kv_params;

// Paged causal attention with GQA for a mixed batch (prefill chunks and decodes together).
typedef struct pd_attention_params {
    const void *q;               // (n_tokens, n_heads, head_dim), act dtype, row stride q_stride elems
    const void *k_cache, *v_cache;  // (n_blocks, block_size, n_kv_heads, head_dim)
    void *out;                   // (n_tokens, n_heads * head_dim), act dtype
    const int32_t *q_indptr;     // (n_seqs + 1)
    const int32_t *kv_lens;      // (n_seqs)
    const int32_t *bt_indptr;    // (n_seqs + 1)
    const int32_t *bt_indices;   // (bt_indptr[n_seqs]) block ids
    const int32_t *token_seq;    // (n_tokens): sequence index of each query row
    int n_tokens, n_seqs, n_heads, n_kv_heads, head_dim, block_size, q_stride;
    int max_q_len, max_kv_len;   // upper bounds over the batch (for grid sizing)
    float scale;                 // 1/sqrt(head_dim)
} pd_attention_params;

// out (n, F) = silu(gu[:, :F]) * gu[:, F:]
typedef struct pd_silu_mul_params {
    const void *gu;  // (n_rows, 2F), act dtype
    void *out;       // (n_rows, F), act dtype
    int n_rows, F;
} pd_silu_mul_params;

// out[i, :] = x[idx[i], :]
typedef struct pd_get_rows_params {
    const void *x;        // (n_src, dim), act dtype
    const int32_t *idx;   // (n_rows)
    void *out;            // (n_rows, dim), act dtype
    int n_rows, dim;
} pd_get_rows_params;

// Copies whole KV blocks (all layers) src_blocks[i] -> dst_blocks[i] within one cache.
typedef struct pd_copy_blocks_params {
    void *const *k_caches, *const *v_caches;  // (n_layers) host arrays of device pointers
    const int32_t *src_blocks, *dst_blocks;   // host arrays (n)
    int n, n_layers;
    size_t block_bytes;
} pd_copy_blocks_params;

// Copies the first n_rows[i] token rows of KV block src_blocks[i] to block dst_blocks[i] of another
// cache with the same layout (a peer's imported KV pool, or a staging area laid out like a cache),
// for layers [layer_begin, layer_end). The KV handoff's data path.
typedef struct pd_kv_copy_params {
    void *const *src_k, *const *src_v;  // (n_layers) host arrays of device pointers: local layers
    void *const *dst_k, *const *dst_v;  // (n_layers) host arrays of destination layer bases
    const int32_t *src_blocks;          // host (n_blocks)
    const int32_t *dst_blocks;          // host (n_blocks)
    const int32_t *n_rows;              // host (n_blocks): rows from the block's start, <= block_size
    int n_blocks, layer_begin, layer_end, block_size;
    size_t row_bytes;                   // n_kv_heads * head_dim * kv elem size (multiple of 8)
} pd_kv_copy_params;

// The KV-transfer checksum (base/checksum.h) of each layer's slab: for l in [layer_begin,
// layer_end), the runs are the K rows of every listed block in order, then the V rows.
// sums: host (layer_end - layer_begin). Synchronizes.
typedef struct pd_kv_checksum_params {
    void *const *k, *const *v;   // (n_layers) host arrays of device pointers
    const int32_t *blocks;       // host (n_blocks)
    const int32_t *n_rows;       // host (n_blocks)
    int n_blocks, layer_begin, layer_end, block_size;
    size_t row_bytes;
    uint64_t *sums;              // out, host
} pd_kv_checksum_params;

// A handle that lets another process on the same host map a buffer: the decode worker exports its
// KV pool once and the prefill worker writes straight into it (shm on CPU, CUDA IPC on GPU).
typedef struct pd_buffer_handle {
    char kind[8];          // "shm" or "cuda"
    char shm_name[64];     // shm: POSIX shared-memory object name
    uint8_t ipc[64];       // cuda: cudaIpcMemHandle_t
    uint64_t n_bytes;
    int32_t device;
    int32_t pid;           // exporting process (cuda IPC cannot be opened by its own process)
} pd_buffer_handle;

// ---- the backend -------------------------------------------------------------------------------

// A CPU backend using n_threads (0: all cores). Never NULL except on OOM.
pd_backend *pd_backend_cpu_new(int n_threads);
// Creates a backend by name: "cpu", "cuda", "auto" (cuda if compiled in and a device exists).
// NULL with err set when unavailable. out: owned by caller (pd_backend_free).
pd_backend *pd_backend_new(const char *name, int device, pd_err *err);
bool pd_backend_has_cuda(void);  // compiled in and a device is visible
void pd_backend_free(pd_backend *b);

const char *pd_backend_name(pd_backend *b);
pd_dtype pd_backend_weight_dtype(pd_backend *b);
pd_dtype pd_backend_act_dtype(pd_backend *b);
// Free and total device memory in bytes (for KV sizing). CPU: available RAM.
void pd_backend_mem_info(pd_backend *b, size_t *free_bytes, size_t *total_bytes);

// Device memory. alloc returns NULL on failure (logged with size). free(NULL) is a no-op.
pd_buffer *pd_buffer_alloc(pd_backend *b, size_t n_bytes);
void pd_buffer_free(pd_buffer *buf);
void *pd_buffer_ptr(pd_buffer *buf);  // device pointer, valid until pd_buffer_free
size_t pd_buffer_size(pd_buffer *buf);

// An exportable buffer (pd_buffer_export works on it). NULL with err when the backend cannot.
pd_buffer *pd_buffer_alloc_shared(pd_backend *b, size_t n_bytes, pd_err *err);
// Fills out for a buffer from pd_buffer_alloc_shared. PD_ERR_UNSUPPORTED otherwise.
pd_status pd_buffer_export(pd_buffer *buf, pd_buffer_handle *out);
// Maps a buffer exported by another process; returns a device pointer for this backend's ops, or
// NULL with err. Unmap with pd_backend_unimport.
void *pd_backend_import(pd_backend *b, const pd_buffer_handle *h, pd_err *err);
void pd_backend_unimport(pd_backend *b, void *ptr, const pd_buffer_handle *h);

// Host <-> device copies. upload is ordered on the backend stream (host memory must stay valid
// until the next sync); download synchronizes.
void pd_backend_upload(pd_backend *b, void *dst_dev, const void *src_host, size_t n_bytes);
void pd_backend_download(pd_backend *b, void *dst_host, const void *src_dev, size_t n_bytes);
void pd_backend_memset(pd_backend *b, void *dst_dev, int value, size_t n_bytes);
void pd_backend_sync(pd_backend *b);

// Ops. Invalid parameters are invariant violations (asserted), not recoverable errors.
void pd_op_embed(pd_backend *b, const pd_embed_params *p);
void pd_op_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p);
void pd_op_matmul(pd_backend *b, const pd_matmul_params *p);
void pd_op_rope_kv(pd_backend *b, const pd_rope_kv_params *p);
void pd_op_attention(pd_backend *b, const pd_attention_params *p);
void pd_op_silu_mul(pd_backend *b, const pd_silu_mul_params *p);
void pd_op_get_rows(pd_backend *b, const pd_get_rows_params *p);
void pd_op_copy_blocks(pd_backend *b, const pd_copy_blocks_params *p);
void pd_op_kv_copy(pd_backend *b, const pd_kv_copy_params *p);
void pd_op_kv_checksum(pd_backend *b, const pd_kv_checksum_params *p);
// Graphs (optional; CUDA graphs on the CUDA backend): the ops enqueued between graph_begin and
// graph_end are recorded, not run, and pd_backend_graph_launch replays them with the same
// pointers and parameters (device memory they read may change between launches). Between begin
// and end nothing may synchronise (no download, no sync) and no device memory may be allocated:
// run the same sequence once eagerly first so scratch buffers are sized. launch returns false
// when the graph is stale (the backend moved a scratch buffer it uses): free it and capture again.
bool pd_backend_has_graphs(pd_backend *b);
void pd_backend_graph_begin(pd_backend *b);
pd_graph *pd_backend_graph_end(pd_backend *b);  // NULL when the capture failed
bool pd_backend_graph_launch(pd_backend *b, pd_graph *g);
void pd_backend_graph_free(pd_backend *b, pd_graph *g);  // NULL is a no-op

// Fills n elements of `dtype` at dst with mean + std * N(0,1) from a counter-based generator
// seeded by `seed` (dummy weights: --load-format dummy). Deterministic per backend.
void pd_op_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std);

#ifdef __cplusplus
}
#endif
