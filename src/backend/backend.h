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
#include <stdio.h>

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
    PD_DTYPE_FP8_E4M3 = 4,  // OCP E4M3 (no infinities; max 448; 0x7f/0xff NaN): the fp8 KV cache
} pd_dtype;
size_t pd_dtype_size(pd_dtype t);
const char *pd_dtype_name(pd_dtype t);

typedef struct pd_backend pd_backend;

// E4M3 conversions on the host, as the device converts (round to nearest even, saturating to
// +-448; NaN -> 0x7f). The CPU backend's fp8 KV cache and the tests use them.
uint8_t pd_fp8_e4m3_from_f32(float x);
float pd_fp8_e4m3_to_f32(uint8_t v);

// KV-cache element formats. PD_KV_ACT: the backend's activation dtype (f32 on CPU, bf16 on CUDA).
// PD_KV_FP8: E4M3 with one f32 scale per (token, kv head) ("per-head" scales), quantised in the KV
// write: scale = amax / 448 over the head's head_dim values, q = e4m3(x * (448 / amax)) (all zero,
// scale 0, when amax is 0), x ~ q * scale. A cache slot's row, in K and in V alike, is
//   [n_kv_heads * head_dim e4m3 bytes | n_kv_heads f32 scales | zero padding to 16 bytes]
// so a row stays self-contained (block copies, KV handoffs and checksums move rows as bytes) and
// every head's data starts 16-byte aligned when head_dim % 16 == 0.
typedef enum pd_kv_dtype {
    PD_KV_ACT = 0,
    PD_KV_FP8 = 1,
} pd_kv_dtype;
// Bytes of one slot's K (or V) row of a layer: n_kv_heads * head_dim * act size for PD_KV_ACT.
size_t pd_kv_row_bytes(pd_backend *b, pd_kv_dtype t, int n_kv_heads, int head_dim);
// "auto" / "bf16" / "float32" (the act dtype) or "fp8" / "fp8_e4m3"; false for anything else.
bool pd_kv_dtype_parse(const char *s, pd_kv_dtype *out);
const char *pd_kv_dtype_name(pd_kv_dtype t);

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

// If add != NULL: x += add first (residual; in a 16-bit act dtype the sum is rounded and the rounded
// value normalised). Then out = w * (x / rms(x)), where in a 16-bit act dtype x / rms(x) is rounded
// before the multiplication (transformers' LlamaRMSNorm). out may alias add, never x.
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
//
// Fused forms (decode steps fold their norms, SwiGLU and residual adds into the GEMMs with them;
// pd_backend_fuses_matmul says where a backend runs them as one kernel). Each gives the values the
// unfused op sequence gives, rounding points included, up to the GEMM's summation order:
//   norm_w != NULL: the activation is pd_op_rmsnorm of a's rows (no add; weight norm_w (K), eps
//     norm_eps), not a itself. a is the raw residual stream (lda K or 0).
//   glu: w is (2N, K) [gate rows | up rows] and bias (2N) or NULL; out (M, N) = silu(g) * u where
//     g, u are the two halves of a . wT + bias, as pd_op_matmul into (M, 2N) then pd_op_silu_mul.
//     Not with accumulate, residual or out_f32.
//   residual: out += a . wT + bias, where in a 16-bit act dtype the branch is rounded before the
//     sum and the sum rounded (pd_op_rmsnorm's add): the residual add after attention / MLP. Not
//     with accumulate or out_f32.
//   rope != NULL: out is the qkv rows of rope (rope->qkv == out, rope->n_tokens == M, N the qkv
//     row width) and pd_op_rope_kv(rope) follows the GEMM: q and k rotated in out, k and v written
//     to the cache. Not with glu, residual, accumulate or out_f32.
typedef struct pd_rope_kv_params pd_rope_kv_params;
typedef struct pd_matmul_params {
    const void *a;     // (M, K), act dtype, row stride lda
    const void *w;     // (N, K), weight dtype ((2N, K) with glu)
    const void *bias;  // (N) or NULL, weight dtype ((2N) with glu)
    void *out;         // (M, N), act dtype or F32 if out_f32
    int M, N, K, lda;
    bool accumulate;
    bool out_f32;
    const void *norm_w;  // (K) weight dtype, or NULL: see "Fused forms"
    float norm_eps;
    bool glu;
    bool residual;
    const pd_rope_kv_params *rope;  // host struct, read during the call
} pd_matmul_params;

// RoPE (HF "rotate_half" layout: pairs (i, i + head_dim/2)) applied in place to the q and k parts
// of qkv rows, then k and v of each token are written to the paged cache at slot_mapping[i]. In a
// 16-bit act dtype cos and sin are rounded to it and each product and the sum are rounded, as
// transformers' apply_rotary_pos_emb computes them in bf16.
// qkv row layout: [q (n_heads*head_dim) | k (n_kv_heads*head_dim) | v (n_kv_heads*head_dim)].
struct pd_rope_kv_params {
    void *qkv;                   // (n_tokens, (n_heads + 2*n_kv_heads) * head_dim), act dtype
    // positions, inv_freq and slot_mapping are host-uploaded and never written by a kernel (the
    // CUDA kernel reads them before its PDL wait, as decode attention reads its batch metadata)
    const int32_t *positions;    // (n_tokens)
    const float *inv_freq;       // (head_dim/2), f32: frequencies incl. llama3/linear scaling
    const int32_t *slot_mapping; // (n_tokens): block_id * block_size + offset; < 0: padding, no KV write
    void *k_cache, *v_cache;     // (n_blocks, block_size, rows of pd_kv_row_bytes), kv_dtype
    int n_tokens, n_heads, n_kv_heads, head_dim;
    float attn_scaling;          // multiplies cos/sin (1.0 for llama/qwen2)
    pd_kv_dtype kv_dtype;        // PD_KV_FP8: k and v are quantised as they are written
};

// Paged causal attention with GQA for a mixed batch (prefill chunks and decodes together).
typedef struct pd_attention_params {
    const void *q;               // (n_tokens, n_heads, head_dim), act dtype, row stride q_stride elems
    const void *k_cache, *v_cache;  // (n_blocks, block_size, rows of pd_kv_row_bytes), kv_dtype
    void *out;                   // (n_tokens, n_heads * head_dim), act dtype
    const int32_t *q_indptr;     // (n_seqs + 1)
    const int32_t *kv_lens;      // (n_seqs)
    const int32_t *bt_indptr;    // (n_seqs + 1)
    const int32_t *bt_indices;   // (bt_indptr[n_seqs]) block ids
    const int32_t *token_seq;    // (n_tokens): sequence index of each query row
    int n_tokens, n_seqs, n_heads, n_kv_heads, head_dim, block_size, q_stride;
    int max_q_len, max_kv_len;   // upper bounds over the batch (for grid sizing)
    float scale;                 // 1/sqrt(head_dim)
    pd_kv_dtype kv_dtype;        // PD_KV_FP8: K/V are dequantised (q * scale) as they are read
    int n_new;                   // > 0: since the stream last completed, only this op's step wrote
                                 // the cache, and only each sequence's last n_new context rows (a
                                 // backend may read the other rows early); 0: unknown
} pd_attention_params;

// out (n, F) = silu(gu[:, :F]) * gu[:, F:]; in a 16-bit act dtype silu(g) is rounded before the
// product (as torch computes act_fn(gate) * up).
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

// Sampling on the device (optional op, pd_backend_has_sample): one token per row of f32 logits,
// with exactly the semantics of the CPU sampler (src/model/sample.h): token mask → penalties and
// logit bias → temperature → top-k → top-p → min-p → draw; greedy ties go to the lowest id; logprobs are those of the raw
// (unprocessed) logits. A random draw uses pd_sample_uniform(seed, draw_idx) and walks the
// surviving tokens in id order, as the CPU sampler does, so a seeded row draws the same token on
// either backend (up to float rounding at a boundary). Only the results cross to the host.
#define PD_SAMPLE_MAX_TOP 20

typedef struct pd_sample_row {
    float temperature;         // 0: greedy
    int32_t top_k;             // <= 0 or >= vocab: off
    float top_p;               // >= 1: off
    float min_p;               // <= 0: off
    float presence_penalty, frequency_penalty, repetition_penalty;
    uint64_t seed;
    uint64_t draw_idx;         // which draw of the seed's stream this one is
    int32_t n_logprobs;        // -1: none; 0: the token's; N <= PD_SAMPLE_MAX_TOP: and the top N
    int32_t pen_begin, n_pens; // this row's entries in pd_sample_params.pens
    int32_t mask_row;          // -1: no mask; else the row's allowed-token bitmask in
                               // pd_sample_params.masks (constrained decoding)
} pd_sample_row;

// A token of a row that a penalty applies to. Tokens are unique within a row.
typedef struct pd_sample_pen {
    int32_t token;
    int32_t count;             // times generated: presence / frequency penalties when > 0
    int32_t is_seen;           // in the prompt or generated: the repetition penalty applies
    float bias;                // logit_bias, added after the penalties; <= PD_SAMPLE_BIAS_BAN: -inf
} pd_sample_pen;
#define PD_SAMPLE_BIAS_BAN (-100.0f)

typedef struct pd_sample_out {
    int32_t token;
    float logprob;             // raw log-softmax of token (n_logprobs >= 0)
    int32_t n_top;
    int32_t top_ids[PD_SAMPLE_MAX_TOP];       // descending, ties by lower id
    float top_logprobs[PD_SAMPLE_MAX_TOP];
} pd_sample_out;

typedef struct pd_sample_params {
    float *logits;                 // device (n_rows, vocab) f32; the op applies penalties in place
                                   // and restores the original values before it returns
    int n_rows, vocab;             // n_rows <= 256 per call is what the CUDA op is tuned for
    const pd_sample_row *rows;     // host (n_rows)
    const pd_sample_pen *pens;     // host (n_pens), each row's entries contiguous
    int n_pens;
    pd_sample_out *out;            // host (n_rows)
    // Token masks (optional): n_masks bitmasks of mask_words 32-bit words each (bit t set = token
    // t may be drawn); a row with mask_row >= 0 treats every other token as -inf (greedy,
    // truncation and draw; the raw logprobs are those of the unmasked logits). Masks are not
    // written into the logits, which stay unchanged.
    const uint32_t *masks;         // host (n_masks * mask_words)
    int n_masks, mask_words;
} pd_sample_params;

// A handle that lets another process on the same host map a buffer: the decode worker exports its
// KV pool once and the prefill worker writes straight into it (shm on CPU, CUDA IPC on GPU).
typedef struct pd_buffer_handle {
    char kind[8];          // "memfd" or "cuda"
    char shm_name[64];     // unused (was: a POSIX shared-memory name; pools are memfds now)
    uint8_t ipc[64];       // cuda: cudaIpcMemHandle_t
    uint64_t n_bytes;
    int32_t device;
    int32_t pid;           // exporting process (cuda IPC cannot be opened by its own process)
    int32_t fd;            // memfd: a descriptor of the pool in THIS process (the exporter's own, or
                           // one received with SCM_RIGHTS); never meaningful across processes
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
// The device's marketing name ("NVIDIA H100 80GB HBM3"; "cpu" on the CPU backend).
const char *pd_backend_device_name(pd_backend *b);
pd_dtype pd_backend_weight_dtype(pd_backend *b);
pd_dtype pd_backend_act_dtype(pd_backend *b);
// Free and total device memory in bytes (for KV sizing). CPU: available RAM.
void pd_backend_mem_info(pd_backend *b, size_t *free_bytes, size_t *total_bytes);

// Device memory. alloc returns NULL on failure (logged with size). free(NULL) is a no-op.
pd_buffer *pd_buffer_alloc(pd_backend *b, size_t n_bytes);
// Grow-only scratch: makes *buf hold at least n_bytes, replacing it (contents lost) when smaller.
// false on failure, with *buf NULL.
bool pd_buffer_reserve(pd_backend *b, pd_buffer **buf, size_t n_bytes);
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

// Host memory for staging and for host-side KV tiers: page-locked (pinned) on CUDA, so copies to
// and from it run at full DMA bandwidth; plain memory on the CPU backend. NULL on failure. Any
// thread. pd_backend_host_is_pinned says which.
void *pd_backend_host_alloc(pd_backend *b, size_t n_bytes);
void pd_backend_host_free(pd_backend *b, void *p);  // NULL is a no-op
bool pd_backend_host_is_pinned(pd_backend *b);

// Host <-> device copies. upload is ordered on the backend stream (host memory must stay valid
// until the next sync); download synchronizes.
void pd_backend_upload(pd_backend *b, void *dst_dev, const void *src_host, size_t n_bytes);
void pd_backend_download(pd_backend *b, void *dst_host, const void *src_dev, size_t n_bytes);
void pd_backend_memset(pd_backend *b, void *dst_dev, int value, size_t n_bytes);
void pd_backend_sync(pd_backend *b);
// Makes this backend's device current in the calling thread without waiting for anything (CUDA: its
// primary context), for libraries that use the driver API's current context on threads the backend
// never ran on (UCX's cuda transports). Nothing on the CPU backend.
void pd_backend_bind_thread(pd_backend *b);

// Ops. Invalid parameters are invariant violations (asserted), not recoverable errors.
void pd_op_embed(pd_backend *b, const pd_embed_params *p);
void pd_op_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p);
void pd_op_matmul(pd_backend *b, const pd_matmul_params *p);
// Whether the backend runs pd_op_matmul's fused forms (norm_w, glu, residual, rope) as single kernels for
// M rows, so that a step of M tokens should use them instead of separate rmsnorm / silu_mul ops
// (every backend computes the fused forms; this says only where they are the faster sequence).
// CUDA: M <= 4 (PD_CUDA_SKINNY_FUSE_MAX_M; PD_CUDA_SKINNY_FUSE=0: never); CPU: never.
bool pd_backend_fuses_matmul(pd_backend *b, int M);
// Whether pd_op_matmul's glu and rope forms on their own (without norm_w or residual) run as one
// kernel each for M rows where the whole set of fused forms does not pay (pd_backend_fuses_matmul
// false): the model then asks for them instead of the GEMM + pd_op_silu_mul and GEMM +
// pd_op_rope_kv pairs, and keeps its rmsnorm kernels. CUDA: 17 <= M <= 64 (the batched-decode GEMM,
// kernels/bgemm.cu; PD_CUDA_BGEMM=0: never; rope there only for head_dim 128 and a bf16 cache,
// else rope_kv runs after the GEMM); CPU: never.
bool pd_backend_fuses_epilogues(pd_backend *b, int M);
void pd_op_rope_kv(pd_backend *b, const pd_rope_kv_params *p);
void pd_op_attention(pd_backend *b, const pd_attention_params *p);
void pd_op_silu_mul(pd_backend *b, const pd_silu_mul_params *p);
void pd_op_get_rows(pd_backend *b, const pd_get_rows_params *p);
void pd_op_copy_blocks(pd_backend *b, const pd_copy_blocks_params *p);
void pd_op_kv_copy(pd_backend *b, const pd_kv_copy_params *p);
void pd_op_kv_checksum(pd_backend *b, const pd_kv_checksum_params *p);

// Transfer stream (optional; CUDA: a second stream of the same device). KV exports that overlap
// with compute: pd_backend_xfer_mark records the compute stream's progress (an event) and makes
// the transfer stream wait for it; pd_op_kv_copy_xfer / pd_op_kv_checksum_xfer enqueued after a
// mark run on the transfer stream after everything enqueued on the compute stream before that
// mark, so layer l ships while layer l+1 computes. Bounded run-ahead: a mark first waits (on the
// host) until the previous mark's compute work is done, so a check made right after a mark (the
// cuda-ipc fence) is at most one layer old when the copies run. The checksums land in p->sums
// only at pd_backend_xfer_sync, which waits for everything on the transfer stream (p->sums must
// stay valid until then). Never during a graph capture (prefill steps run eagerly). Backends
// without a second stream: marks do nothing, the ops run as pd_op_kv_copy / pd_op_kv_checksum,
// and pd_backend_xfer_sync is pd_backend_sync.
bool pd_backend_has_xfer_stream(pd_backend *b);
void pd_backend_xfer_mark(pd_backend *b);
void pd_op_kv_copy_xfer(pd_backend *b, const pd_kv_copy_params *p);
void pd_op_kv_checksum_xfer(pd_backend *b, const pd_kv_checksum_params *p);
void pd_backend_xfer_sync(pd_backend *b);
// A fence on the transfer stream (the KV tiers' staging copies): everything enqueued there so far
// (pd_op_kv_copy_xfer) completes before any op enqueued on the compute stream after this call
// (a device-side wait: the host does not block), so a block copied out may be reused, and a block
// copied in may be read, by the next step. Returns an id for pd_backend_xfer_fence_done, which
// says without waiting whether those copies finished (their host memory may then be reused).
// Backends without a transfer stream copy synchronously: every fence is done at once.
uint64_t pd_backend_xfer_fence(pd_backend *b);
bool pd_backend_xfer_fence_done(pd_backend *b, uint64_t fence);
// Layer fences (the KV tiers' layer-wise loads: layer l's copy overlaps the compute of the layers
// before it). pd_backend_xfer_layer_ready(b, l): the copies enqueued on the transfer stream so far
// are what layer l of the coming compute needs (CUDA: an event of layer l recorded on the transfer
// stream). pd_backend_xfer_layer_wait(b, l): compute enqueued on the compute stream after this call
// waits (on the device) for layer l's latest ready mark; call it before layer l's ops read the
// blocks (pd_batch.before_layer). Neither makes the compute wait for anything else, so a caller
// that marks layers must make the compute wait for every one of them (or fence) before it reads
// the copied blocks. pd_backend_xfer_fence_host: a fence id for pd_backend_xfer_fence_done (the
// host learns when the copies so far finished) that the compute stream does NOT wait on. Backends
// without a transfer stream copy synchronously: ready / wait do nothing, fences are done at once;
// one with a transfer stream but no layer fences: fence_host is pd_backend_xfer_fence.
void pd_backend_xfer_layer_ready(pd_backend *b, int layer);
void pd_backend_xfer_layer_wait(pd_backend *b, int layer);
uint64_t pd_backend_xfer_fence_host(pd_backend *b);
// Device sampling (optional): NULL in the vtable means the caller samples on the host (download
// the logits, src/model/sample.c). pd_op_sample synchronises: p->out is filled on return.
bool pd_backend_has_sample(pd_backend *b);
void pd_op_sample(pd_backend *b, const pd_sample_params *p);
// The sampler's uniform in [0, 1): draw number draw_idx of stream seed (counter-based: the same
// function runs on the device).
double pd_sample_uniform(uint64_t seed, uint64_t draw_idx);
// Graphs (optional; CUDA graphs on the CUDA backend): the ops enqueued between graph_begin and
// graph_end are recorded, not run, and pd_backend_graph_launch replays them with the same
// pointers and parameters (device memory they read may change between launches). Between begin
// and end nothing may synchronise (no download, no sync) and no device memory may be allocated:
// run the same sequence once eagerly first so scratch buffers are sized. launch returns false
// when the graph is stale (the backend moved a scratch buffer it uses): free it and capture again.
bool pd_backend_has_graphs(pd_backend *b);
// Device timing (optional; CUDA events on the compute stream): pd_backend_timer_mark(b, i) records
// mark i (0 <= i < PD_BACKEND_TIMERS) where the compute stream's enqueued work ends now;
// pd_backend_timer_ms(b, i, j) = device milliseconds from mark i to mark j, waiting for j to be
// reached; < 0 when the backend has no timer or a mark was never recorded. For measurements only.
#define PD_BACKEND_TIMERS 8
bool pd_backend_has_timer(pd_backend *b);
void pd_backend_timer_mark(pd_backend *b, int i);
float pd_backend_timer_ms(pd_backend *b, int i, int j);
// Op profiler (measurements only; bench-engine's PD_CUDA_PROF=1): between pd_backend_prof_begin(b)
// and pd_backend_prof_end(b, out, title) every pd_op_* and pd_backend_upload on b is bracketed by
// device events (where the backend has them: prof_record) and host clock readings. end waits for
// the device and prints to out, per op and shape: calls, device time (sum, min / median / max,
// first / last call), the device's idle time before the ops (host behind, or work outside the
// ops), the host's time in the calls; then the totals: host time from begin to the first op (the
// caller's preparation), device time from begin to the last op's end, the ops' sum and the gaps.
// One profile at a time in the process; not inside a graph capture. begin returns false (and
// records nothing) when the backend has no events. out NULL: nothing printed.
bool pd_backend_prof_begin(pd_backend *b);
void pd_backend_prof_end(pd_backend *b, FILE *out, const char *title);
void pd_backend_graph_begin(pd_backend *b);
pd_graph *pd_backend_graph_end(pd_backend *b);  // NULL when the capture failed
bool pd_backend_graph_launch(pd_backend *b, pd_graph *g);
void pd_backend_graph_free(pd_backend *b, pd_graph *g);  // NULL is a no-op

// Fills n elements of `dtype` at dst with mean + std * N(0,1) from a counter-based generator
// seeded by `seed` (dummy weights: --load-format dummy). Deterministic per backend.
void pd_op_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std);

// ---- device messaging between processes (optional; NCCL on the CUDA backend) -----------------
// A pd_comm is one rank of a communicator of n_ranks processes, each with its own backend (the KV
// handoff's nccl transport uses 2: decode rank 0, prefill rank 1). Bootstrap: one rank makes an id
// (pd_comm_id_new) and sends it to the others out of band (the KV control socket); every rank calls
// pd_comm_new with it, which returns once all have joined, or fails after timeout_ms.
// Sends and receives run on the comm's own stream (never the backend's), in the order posted; the
// peers must post matching operations in the same order. pd_comm_wait bounds every wait: a dead or
// hung peer makes it abort the communicator (every later call fails: free it, bootstrap anew).
// A comm may be used from any thread, one thread at a time.
#define PD_COMM_ID_BYTES 128
typedef struct pd_comm_id {
    uint8_t bytes[PD_COMM_ID_BYTES];
} pd_comm_id;
typedef struct pd_comm pd_comm;
// PD_ERR_UNSUPPORTED with err saying why when the backend has no device messaging (CPU backend, or
// NCCL not installed: "nccl transport unavailable: <dlerror>"). out NULL: only checks that.
pd_status pd_comm_id_new(pd_backend *b, pd_comm_id *out, pd_err *err);
pd_comm *pd_comm_new(pd_backend *b, const pd_comm_id *id, int n_ranks, int rank, int timeout_ms, pd_err *err);
void pd_comm_free(pd_comm *c);  // aborts what is still in flight; NULL is a no-op
// Posts a send (receive) of n bytes of device memory to (from) rank peer. A send first waits, on the
// device, for the work already enqueued on the backend's stream (which produced its data).
pd_status pd_comm_send(pd_comm *c, const void *buf, size_t n, int peer, pd_err *err);
// A send ordered instead after the work already enqueued on the backend's transfer stream
// (pd_op_kv_copy_xfer gathered its data there, after a pd_backend_xfer_mark): layer l of a KV
// export leaves while layer l+1 computes. Backends without a transfer stream: as pd_comm_send.
pd_status pd_comm_send_after_xfer(pd_comm *c, const void *buf, size_t n, int peer, pd_err *err);
pd_status pd_comm_recv(pd_comm *c, void *buf, size_t n, int peer, pd_err *err);
// pd_op_kv_copy on the comm's stream, ordered after its receives (scatters a received slab).
void pd_comm_kv_copy(pd_comm *c, const pd_kv_copy_params *p);
// Waits until everything posted has completed: PD_OK, PD_ERR_TIMEOUT after timeout_ms, or
// PD_ERR_DEVICE (NCCL reported an error). On failure the communicator has been aborted.
pd_status pd_comm_wait(pd_comm *c, int timeout_ms, pd_err *err);

#ifdef __cplusplus
}
#endif
