// model_impl.h — the model's internal structs, shared by load.c and forward.c only.
#pragma once
#include "model/model.h"

typedef struct pd_layer_weights {
    pd_buffer *attn_norm;  // (D)
    pd_buffer *wqkv;       // ((H + 2*Hkv) * hd, D)
    pd_buffer *bqkv;       // ((H + 2*Hkv) * hd) or NULL
    pd_buffer *wo;         // (D, H * hd)
    pd_buffer *bo;         // (D) or NULL (llama attention_bias)
    pd_buffer *mlp_norm;   // (D)
    pd_buffer *wgu;        // (2F, D): gate rows then up rows
    pd_buffer *bgu;        // (2F) or NULL
    pd_buffer *wdown;      // (D, F)
    pd_buffer *bdown;      // (D) or NULL
} pd_layer_weights;

// One captured decode or verify step (forward.c, CUDA graphs): B padded sequences of Q query tokens
// each (Q 1: a decode step; Q > 1: a speculative verify step, or a draft's catch-up), context at
// most kv_cap, on one KV cache. The graph bakes in the workspace and cache pointers, and reads
// its metadata from its own device buffer, refreshed before every launch.
typedef struct pd_graph_entry {
    int B, Q, kv_cap, bt_cap;
    const void *kc_base;  // pd_buffer_ptr of the cache the graph writes (identity of the cache)
    uint64_t ws_gen;      // pd_model_ws.gen when captured
    pd_graph *g;          // NULL until captured: the first step of a bucket runs eagerly (warm-up)
    pd_buffer *meta;      // (fixed layout of B, Q, bt_cap) i32
    bool is_warm;         // ran eagerly once with these bounds: device scratch is sized
    bool is_eager_only;   // capture failed once: this bucket stays eager
    uint64_t last_use;
} pd_graph_entry;
#define PD_MODEL_MAX_GRAPHS 1024

// Forward workspace, grown on demand. Activations in act dtype.
typedef struct pd_model_ws {
    int cap_tokens, cap_logits, cap_meta;
    pd_buffer *x;       // (cap_tokens, D) residual stream (without the last branch output, see h)
    pd_buffer *h;       // (cap_tokens, D) normed input of a GEMM, or a branch output the next rmsnorm adds to x
    pd_buffer *qkv;     // (cap_tokens, (H + 2Hkv) * hd)
    pd_buffer *attn;    // (cap_tokens, H * hd)
    pd_buffer *gu;      // (cap_tokens, 2F)
    pd_buffer *mlp;     // (cap_tokens, F)
    pd_buffer *sel;     // (cap_logits, D)
    pd_buffer *sel_add; // (cap_logits, D) the last MLP output of the logit rows
    pd_buffer *logits;  // (cap_logits, V) f32
    pd_buffer *meta;    // (cap_meta) i32: packed per-step metadata
    int32_t *meta_host; // (cap_meta) owned staging
    float *logits_host_unused;
    uint64_t gen;        // bumped whenever an activation / logits buffer moves (graphs go stale)
    // decode graphs
    int graphs_mode;     // 0 undecided, 1 on, 2 off (no backend support, or PD_CUDA_GRAPHS=0)
    int resid_gemm_min;  // 0 undecided, -1 off, else steps of >= this many tokens (forward.c resid_gemm_step)
    int fuse_mode;       // 0 undecided, 1 per backend (pd_backend_fuses_matmul), 2 off, 3 forced (PD_MODEL_FUSE)
    int rows_mode;       // 0 undecided, 1 a one-token step's lm_head reads x itself, 2 always gathers (PD_MODEL_ROWS_DIRECT=0)
    int graph_q_max;     // steps of up to this many query tokens per sequence may run as graphs (0/1: decode only)
    pd_graph_entry graphs[PD_MODEL_MAX_GRAPHS];
    int n_graphs;
    uint64_t use_clock;
    int32_t *pad_host;   // (cap_pad) the padded decode batch's host arrays
    size_t cap_pad;
} pd_model_ws;

// forward.c: frees the captured graphs and their buffers (pd_model_free calls it).
void pd_model_graphs_free(pd_model *m);

struct pd_model {
    pd_model_config cfg;
    pd_backend *backend;  // borrowed
    pd_dtype wdt, adt;
    pd_kv_dtype kv_dtype;
    size_t kv_row_bytes;  // pd_kv_row_bytes of the model's KV format
    pd_buffer *embed;     // (V, D)
    pd_buffer *final_norm;  // (D)
    pd_buffer *lm_head;   // (V, D), NULL when tied (embed is used)
    pd_buffer *inv_freq;  // (hd/2) f32
    pd_layer_weights *layers;  // owned (n_layers)
    size_t weight_bytes;
    pd_model_ws ws;
};

struct pd_model_cache {
    pd_model *model;  // borrowed
    pd_buffer *buf;   // (n_layers, 2, n_blocks, block_size, Hkv, hd), act dtype
    int n_blocks, block_size;
    size_t block_bytes;  // block_size * kv_row_bytes
};
