// model — a Llama-family decoder (Llama 2/3, Mistral, Qwen2) on a pd_backend, over a paged KV
// cache. Knows nothing of requests, scheduling, HTTP or processes: a caller describes a batch of
// token spans (pd_batch), and pd_model_forward computes them, writes their K/V into the cache
// blocks the caller chose, and returns logits for the rows the caller asked for.
//
// Weights: loaded from a Hugging Face folder (config.json + safetensors, single or sharded) and
// converted to the backend's weight dtype (f32 on CPU, bf16 on CUDA); or, with `dummy`, filled
// with seeded random values from config.json alone (vLLM's --load-format dummy) so large shapes can
// be benchmarked without files. q/k/v are fused into one (H+2*Hkv)*hd x D matrix and gate/up into
// one 2F x D matrix at load, so each layer runs 4 GEMMs.
//
// Forward pass per layer (x is the residual stream, act dtype):
//   h = rmsnorm(x += h) ; qkv = h·Wqkvᵀ (+b) ; rope(q,k) + write k,v to cache ; a = attention(q, cache)
//   h = a·Woᵀ ; h = rmsnorm(x += h) ; gu = h·Wguᵀ ; m = silu(g)*u ; h = m·Wdownᵀ
// (layer 0 adds nothing: x is the embedding), then logits = rmsnorm(x[rows] + h[rows])·Wlmᵀ (f32).
// Each branch output is rounded to the activation dtype before it is added, and the sum after,
// as transformers and vLLM do in bf16.
//
// Threading: a model and its caches are used by one thread at a time. The model keeps a
// workspace that grows to the largest batch seen (no allocation once warm).
#pragma once
#include "backend/backend.h"
#include "base/base.h"
#include "model/config.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_model pd_model;
typedef struct pd_model_cache pd_model_cache;

typedef void (*pd_model_progress_fn)(void *ud, size_t bytes_done, size_t bytes_total);

typedef struct pd_model_params {
    const char *dir;          // borrowed: Hugging Face model folder
    pd_backend *backend;      // borrowed: must outlive the model
    bool dummy;               // --load-format dummy: random weights from config.json alone
    uint64_t seed;            // for dummy weights
    pd_model_progress_fn progress;  // (optional) called while weights load
    void *progress_ud;
    pd_kv_dtype kv_dtype;     // the KV caches' format (--kv-cache-dtype): PD_KV_ACT or PD_KV_FP8
    // Benchmark fixtures, dummy weights only (refused otherwise), for a draft/target pair with a
    // controlled acceptance (docs/benchmarks.md "a controlled-acceptance fixture"):
    // dummy_num_layers K > 0 keeps the config's first K layers and skips the seeds of the others,
    // so every kept tensor (embeddings, layers 0..K-1, final norm, lm_head) equals the full model's
    // of the same seed. dummy_scale_from F > 0 scales the tensors that write into the residual
    // stream (o_proj, down_proj and their biases) of layers F.. by dummy_scale_eps (0..1): the
    // weights are still all there and all read, only their values shrink. F = PD_DUMMY_SCALE_ALL
    // scales every layer, layer 0 too: at EPS 0 the last hidden state is the last token's
    // embedding, so each next token is a function of the last one alone (a Markov target: the
    // copy workload of bench-spec's --copy-chain; the step still reads every weight).
    int dummy_num_layers;
    int dummy_scale_from;
    float dummy_scale_eps;
} pd_model_params;
#define PD_DUMMY_SCALE_ALL (-1)  // pd_model_params.dummy_scale_from: every layer
pd_model_params pd_model_params_default(void);

// Loads a model. NULL with err naming the problem (unknown architecture, unsupported dtype,
// missing or mis-shaped tensor by name and shape, truncated file, bad JSON, device OOM).
pd_model *pd_model_load(const pd_model_params *p, pd_err *err);
void pd_model_free(pd_model *m);
const pd_model_config *pd_model_get_config(const pd_model *m);
pd_backend *pd_model_backend(const pd_model *m);
size_t pd_model_weight_bytes(const pd_model *m);  // device bytes of weights
// Device bytes of weights one step reads for n_tokens tokens: every matrix and norm, plus one
// embedding row per token (the table itself is not read; with tied embeddings it is, as lm_head).
size_t pd_model_weight_bytes_read(const pd_model *m, int n_tokens);
pd_kv_dtype pd_model_kv_dtype(const pd_model *m);
// Bytes of one token's K (or V) row of one layer in this model's caches (pd_kv_row_bytes).
size_t pd_model_kv_row_bytes(const pd_model *m);

// The paged KV cache: n_blocks blocks of block_size tokens for every layer, in one device buffer
// laid out (n_layers, 2 [k, v], n_blocks, block_size, row), a row being n_kv_heads * head_dim
// act-dtype values, or with kv_dtype PD_KV_FP8 e4m3 bytes and per-head scales (backend.h).
pd_model_cache *pd_model_cache_new(pd_model *m, int n_blocks, int block_size, pd_err *err);
// Same, in an exportable buffer (pd_buffer_export) so a peer process can write KV into it.
pd_model_cache *pd_model_cache_new_shared(pd_model *m, int n_blocks, int block_size, pd_err *err);
void pd_model_cache_free(pd_model_cache *c);
int pd_model_cache_n_blocks(const pd_model_cache *c);
int pd_model_cache_block_size(const pd_model_cache *c);
size_t pd_model_cache_block_bytes(const pd_model_cache *c);  // one block, one layer, K or V
void *pd_model_cache_k(pd_model_cache *c, int layer);        // device pointer
void *pd_model_cache_v(pd_model_cache *c, int layer);        // device pointer
pd_buffer *pd_model_cache_buffer(pd_model_cache *c);         // the whole cache (for transfer)

// One forward step over several sequences (host arrays, borrowed for the call).
// Sequence s computes tokens[q_indptr[s] .. q_indptr[s+1]); after the step it has kv_lens[s]
// tokens of context stored in blocks bt_indices[bt_indptr[s] .. bt_indptr[s+1]) (enough blocks
// for kv_lens[s] tokens). The new tokens are the last q_len of those positions.
typedef struct pd_batch {
    int n_tokens;
    const int32_t *tokens;      // (n_tokens)
    int n_seqs;
    const int32_t *q_indptr;    // (n_seqs + 1)
    const int32_t *kv_lens;     // (n_seqs)
    const int32_t *bt_indptr;   // (n_seqs + 1)
    const int32_t *bt_indices;  // (bt_indptr[n_seqs])
    int n_logits;
    const int32_t *logit_rows;  // (n_logits) token rows whose logits are wanted
    // Optional "layer done" hook: called on the calling thread after layer l's ops (its K/V writes
    // included) were issued on the backend stream — on the CPU backend they have completed. A step
    // with a hook never runs as a captured graph.
    void (*on_layer)(void *ud, int layer);
    void *on_layer_ud;
    // Optional "layer start" hook: called on the calling thread before layer l's ops are issued
    // (the KV tiers' layer-wise loads make the compute wait there for layer l's copy). A step with
    // a hook never runs as a captured graph.
    void (*before_layer)(void *ud, int layer);
    void *before_layer_ud;
} pd_batch;

// Runs the step. logits: host (n_logits, vocab) f32, may be NULL when n_logits == 0.
// PD_ERR_INVALID for an inconsistent batch (ids out of range, too few blocks, ...);
// PD_ERR_NOMEM / PD_ERR_DEVICE if the workspace cannot grow.
pd_status pd_model_forward(pd_model *m, pd_model_cache *c, const pd_batch *b, float *logits);
// Same, but leaves the logits on the device: *logits_dev (n_logits, vocab) f32, valid until the
// next forward call. The caller may run device-side sampling on it.
pd_status pd_model_forward_dev(pd_model *m, pd_model_cache *c, const pd_batch *b, const float **logits_dev);
// Prepares decode graphs for serving steps of up to max_tokens tokens and max_seqs sequences of up
// to max_len positions: on a backend with graphs, sizes the activation workspace for the largest
// step and captures the decode graph of every (batch bucket, context bucket) pair up to those
// bounds, so no step pays a capture (tens of ms) and no later growth makes the graphs stale.
// Nothing to do without graphs or with max_seqs 0 (a prefill worker). Writes no KV (every warm-up
// row is padding). *n_graphs: graphs captured.
pd_status pd_model_warmup(pd_model *m, pd_model_cache *c, int max_tokens, int max_seqs, int max_len, int *n_graphs);
// Lets steps of up to max_q query tokens per sequence (speculative verify steps: the last token and
// the drafts; a draft model's catch-up) run as graphs too: each sequence is padded to a query
// bucket Q (2, 3, 5, 9, 13, 17) and the batch to a batch bucket of at most 64 sequences and 512
// padded tokens (larger steps are compute-bound: eager). Call it before pd_model_warmup, which
// then captures those buckets as well and sizes the workspace for them. max_q <= 1: decode only
// (the default).
void pd_model_set_graph_q(pd_model *m, int max_q);
// The tokens a step of n_seqs sequences, the longest with max_q query tokens, n_tokens in all,
// really computes: the padded size (batch bucket x query bucket) when it would run as a graph,
// else n_tokens. What a step-cost model should be fed (speculative decoding's adaptive length).
int pd_model_step_tokens(pd_model *m, int n_seqs, int max_q, int n_tokens);

#ifdef __cplusplus
}
#endif
