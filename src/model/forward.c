// forward.c — one forward step of the decoder over a mixed batch (prefill chunks and decodes of
// several sequences), expressed as backend ops. See model.h for the sequence of ops.
//
// Per-step metadata (tokens, positions, slot mapping, CSR page table, ...) is validated on the
// host, packed into one int32 array and uploaded with a single copy, so a step costs one
// host-to-device transfer besides the logits coming back.
//
// Decode steps run as CUDA graphs where the backend has them (pd_backend_has_graphs; off with
// PD_CUDA_GRAPHS=0); so do speculative verify steps (a few query tokens per sequence) once
// pd_model_set_graph_q allowed them: see graph_step, pad_batch. A step whose every sequence has one query token is padded to a batch bucket
// B (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256) and a context bound kv_cap (256, 384,
// 512, 768, 1024, ...: powers of two and their 1.5x), and its metadata is packed in a layout
// fixed by (B, kv_cap) into the bucket's own device buffer. Padding sequences hold one token
// (id 0, position 0) with slot -1 (rope_kv writes no KV for it) and attend to one slot of block 0;
// their rows are computed and ignored. The first step of a bucket runs eagerly (it sizes the
// backend's scratch), the second is captured and launched, later ones only refresh the metadata
// and launch. Graphs go stale when the workspace moves (ws.gen), the backend's scratch moves
// (launch refuses) or another cache is used (kc_base): they are then captured again.
// pd_model_warmup (the engine calls it at start, graphs on) sizes the workspace for the largest
// step and captures every bucket up to the serving bounds, all rows padding, so no serving step pays a
// capture and nothing within those bounds makes the graphs stale.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/buf.h"
#include "model/model_impl.h"

// Offsets (in int32 elements) of each array inside the packed metadata.
typedef struct meta_layout {
    size_t tokens, positions, slots, token_seq, q_indptr, kv_lens, bt_indptr, bt_indices, logit_rows, total;
    // Verify graphs: attention sees every token as a sequence of its own (one query token, context
    // through its position, the page table of its sequence), so the decode attention kernel (KV
    // read once per KV head for the whole GQA group) serves verify steps; n_pseudo 0: not used.
    size_t n_pseudo, p_q_indptr, p_kv_lens, p_bt_indptr, p_token_seq;
} meta_layout;

// Packs the arrays back to back: T tokens, S sequences, n_bt page-table entries, n_logits rows.
static meta_layout layout_for(size_t T, size_t S, size_t n_bt, size_t n_logits) {
    meta_layout l;
    size_t o = 0;
    l.tokens = o; o += T;
    l.positions = o; o += T;
    l.slots = o; o += T;
    l.token_seq = o; o += T;
    l.q_indptr = o; o += S + 1;
    l.kv_lens = o; o += S;
    l.bt_indptr = o; o += S + 1;
    l.bt_indices = o; o += n_bt;
    l.logit_rows = o; o += n_logits;
    l.n_pseudo = 0;
    l.p_q_indptr = l.p_kv_lens = l.p_bt_indptr = l.p_token_seq = o;
    l.total = o;
    return l;
}

static meta_layout layout_of(const pd_batch *b) {
    return layout_for((size_t)b->n_tokens, (size_t)b->n_seqs, (size_t)b->bt_indptr[b->n_seqs], (size_t)b->n_logits);
}

static pd_status grow(pd_backend *be, pd_buffer **buf, size_t n_bytes) {
    return pd_buffer_reserve(be, buf, n_bytes) ? PD_OK : PD_ERR_DEVICE;
}

static pd_status ws_reserve(pd_model *m, int n_tokens, int n_logits, size_t n_meta) {
    pd_model_ws *ws = &m->ws;
    const pd_model_config *c = &m->cfg;
    size_t e = pd_dtype_size(m->adt), D = (size_t)c->hidden_size, F = (size_t)c->intermediate_size;
    size_t hd = (size_t)c->head_dim, H = (size_t)c->n_heads, Hkv = (size_t)c->n_kv_heads;
    if (n_tokens > ws->cap_tokens) {
        size_t T = (size_t)n_tokens;
        if (grow(m->backend, &ws->x, T * D * e) || grow(m->backend, &ws->h, T * D * e) ||
            grow(m->backend, &ws->qkv, T * (H + 2 * Hkv) * hd * e) || grow(m->backend, &ws->attn, T * H * hd * e) ||
            grow(m->backend, &ws->gu, T * 2 * F * e) || grow(m->backend, &ws->mlp, T * F * e))
            return PD_ERR_DEVICE;
        ws->cap_tokens = n_tokens;
        ws->gen++;
    }
    if (n_logits > ws->cap_logits) {
        size_t L = (size_t)n_logits;
        if (grow(m->backend, &ws->sel, L * D * e) || grow(m->backend, &ws->sel_add, L * D * e) ||
            grow(m->backend, &ws->logits, L * (size_t)c->vocab_size * 4))
            return PD_ERR_DEVICE;
        ws->cap_logits = n_logits;
        ws->gen++;
    }
    if (n_meta > (size_t)ws->cap_meta) {
        size_t cap = n_meta * 2;
        if (grow(m->backend, &ws->meta, cap * 4)) return PD_ERR_DEVICE;
        int32_t *h = pd_realloc(ws->meta_host, cap * 4);
        if (!h) return PD_ERR_NOMEM;
        ws->meta_host = h;
        ws->cap_meta = (int)cap;
    }
    return PD_OK;
}

// Validates the batch and fills the packed metadata. Every id and index is checked here, so the
// ops can treat them as invariants.
static pd_status pack_meta(pd_model *m, const pd_model_cache *kc, const pd_batch *b, const meta_layout *l,
                           int *max_q, int *max_kv) {
    int32_t *h = m->ws.meta_host;
    int V = m->cfg.vocab_size, bs = kc->block_size;
    if (b->q_indptr[0] != 0 || b->q_indptr[b->n_seqs] != b->n_tokens || b->bt_indptr[0] != 0) return PD_ERR_INVALID;
    *max_q = 0;
    *max_kv = 0;
    for (int s = 0; s < b->n_seqs; s++) {
        int q0 = b->q_indptr[s], q1 = b->q_indptr[s + 1], kv = b->kv_lens[s];
        int nb = b->bt_indptr[s + 1] - b->bt_indptr[s];
        if (q1 < q0 || kv < q1 - q0 || nb < 0 || (int64_t)nb * bs < kv) return PD_ERR_INVALID;
        if (kv > m->cfg.max_position_embeddings * 64) return PD_ERR_INVALID;  // positions must stay sane
        *max_q = PD_MAX(*max_q, q1 - q0);
        *max_kv = PD_MAX(*max_kv, kv);
        const int32_t *bt = b->bt_indices + b->bt_indptr[s];
        for (int j = 0; j < nb; j++)
            if (bt[j] < 0 || bt[j] >= kc->n_blocks) return PD_ERR_INVALID;
        for (int i = q0; i < q1; i++) {
            int pos = kv - (q1 - q0) + (i - q0);
            if (b->tokens[i] < 0 || b->tokens[i] >= V) return PD_ERR_INVALID;
            h[l->tokens + (size_t)i] = b->tokens[i];
            h[l->positions + (size_t)i] = pos;
            h[l->slots + (size_t)i] = bt[pos / bs] * bs + pos % bs;
            h[l->token_seq + (size_t)i] = s;
        }
        h[l->kv_lens + (size_t)s] = kv;
    }
    memcpy(h + l->q_indptr, b->q_indptr, sizeof(int32_t) * (size_t)(b->n_seqs + 1));
    memcpy(h + l->bt_indptr, b->bt_indptr, sizeof(int32_t) * (size_t)(b->n_seqs + 1));
    memcpy(h + l->bt_indices, b->bt_indices, sizeof(int32_t) * (size_t)b->bt_indptr[b->n_seqs]);
    for (int i = 0; i < b->n_logits; i++) {
        if (b->logit_rows[i] < 0 || b->logit_rows[i] >= b->n_tokens) return PD_ERR_INVALID;
        h[l->logit_rows + (size_t)i] = b->logit_rows[i];
    }
    return PD_OK;
}

static void *wp(pd_buffer *b) { return b ? pd_buffer_ptr(b) : NULL; }

// The residual stream x is updated by the rmsnorm that follows each branch (x += h, rounded to the
// activation dtype, then normalised), not by the branch's GEMM: in bf16 this rounds the branch
// output and then the sum, as transformers and vLLM do, so a bf16 model gives their numbers. On
// entry h holds the previous layer's MLP output (none for layer 0, whose x is the embedding).
// fused (small decode steps where pd_backend_fuses_matmul): the same values through pd_op_matmul's
// fused forms — the o and down GEMMs add their (rounded) output into x themselves, the qkv and
// gate_up GEMMs normalise x as they read it, qkv applies RoPE and writes the KV cache, gate_up
// applies SwiGLU — so x is complete after every layer and h is not used: 5 kernels per layer
// (qkv, attention, o, gate_up, down) instead of 9.
// n_new: pd_attention_params.n_new (graph steps: Q; eager steps 0).
static void run_layer(pd_model *m, pd_model_cache *kc, int li, int T, const int32_t *dmeta, const meta_layout *l,
                      int n_seqs, int max_q, int max_kv, bool fused, bool rg, int n_new) {
    const pd_model_config *c = &m->cfg;
    pd_backend *be = m->backend;
    pd_layer_weights *w = &m->layers[li];
    pd_model_ws *ws = &m->ws;
    int D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim, H = c->n_heads, Hkv = c->n_kv_heads;
    int nqkv = (H + 2 * Hkv) * hd;

    pd_rope_kv_params rope = {.qkv = wp(ws->qkv), .positions = dmeta + l->positions, .inv_freq = wp(m->inv_freq),
                              .slot_mapping = dmeta + l->slots, .k_cache = pd_model_cache_k(kc, li),
                              .v_cache = pd_model_cache_v(kc, li), .n_tokens = T, .n_heads = H, .n_kv_heads = Hkv,
                              .head_dim = hd, .attn_scaling = 1.0f, .kv_dtype = m->kv_dtype};
    if (fused) {  // x is the whole residual stream: the norm, RoPE and KV write go into the qkv GEMM
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->x), .w = wp(w->wqkv), .bias = wp(w->bqkv), .out = wp(ws->qkv),
                                             .M = T, .N = nqkv, .K = D, .norm_w = wp(w->attn_norm),
                                             .norm_eps = c->rms_norm_eps, .rope = &rope});
    } else {
        pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->x), .add = li > 0 && !rg ? wp(ws->h) : NULL, .w = wp(w->attn_norm),
                                               .out = wp(ws->h), .n_rows = T, .dim = D, .eps = c->rms_norm_eps});
        bool epi = pd_backend_fuses_epilogues(be, T);  // RoPE + KV write in the qkv GEMM (batched decode on CUDA)
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->h), .w = wp(w->wqkv), .bias = wp(w->bqkv), .out = wp(ws->qkv),
                                             .M = T, .N = nqkv, .K = D, .rope = epi ? &rope : NULL});
        if (!epi) pd_op_rope_kv(be, &rope);
    }
    bool ps = l->n_pseudo > 0;
    if (ps) n_seqs = (int)l->n_pseudo, max_q = 1;
    pd_op_attention(be, &(pd_attention_params){.q = wp(ws->qkv), .k_cache = pd_model_cache_k(kc, li),
                                               .v_cache = pd_model_cache_v(kc, li), .out = wp(ws->attn),
                                               .q_indptr = dmeta + (ps ? l->p_q_indptr : l->q_indptr),
                                               .kv_lens = dmeta + (ps ? l->p_kv_lens : l->kv_lens),
                                               .bt_indptr = dmeta + (ps ? l->p_bt_indptr : l->bt_indptr),
                                               .bt_indices = dmeta + l->bt_indices,
                                               .token_seq = dmeta + (ps ? l->p_token_seq : l->token_seq), .n_tokens = T, .n_seqs = n_seqs,
                                               .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                               .block_size = kc->block_size, .q_stride = nqkv, .max_q_len = max_q,
                                               .max_kv_len = max_kv, .scale = 1.0f / sqrtf((float)hd),
                                               .kv_dtype = m->kv_dtype, .n_new = n_new});
    if (fused) {  // x += o(attn); mlp = silu(gate) * up of norm(x); x += down(mlp)
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->attn), .w = wp(w->wo), .bias = wp(w->bo), .out = wp(ws->x),
                                             .M = T, .N = D, .K = H * hd, .residual = true});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->x), .w = wp(w->wgu), .bias = wp(w->bgu), .out = wp(ws->mlp),
                                             .M = T, .N = F, .K = D, .norm_w = wp(w->mlp_norm),
                                             .norm_eps = c->rms_norm_eps, .glu = true});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->mlp), .w = wp(w->wdown), .bias = wp(w->bdown), .out = wp(ws->x),
                                             .M = T, .N = D, .K = F, .residual = true});
        return;
    }
    // rg: the residual adds in the o and down GEMMs (accumulate into x), x complete after each
    // layer, the norms read x alone (resid_gemm_step)
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->attn), .w = wp(w->wo), .bias = wp(w->bo),
                                         .out = rg ? wp(ws->x) : wp(ws->h), .M = T, .N = D, .K = H * hd,
                                         .accumulate = rg});
    pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->x), .add = rg ? NULL : wp(ws->h), .w = wp(w->mlp_norm),
                                           .out = wp(ws->h), .n_rows = T, .dim = D, .eps = c->rms_norm_eps});
    if (pd_backend_fuses_epilogues(be, T)) {  // gate_up and SwiGLU as one kernel
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->h), .w = wp(w->wgu), .bias = wp(w->bgu), .out = wp(ws->mlp),
                                             .M = T, .N = F, .K = D, .glu = true});
    } else {
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->h), .w = wp(w->wgu), .bias = wp(w->bgu), .out = wp(ws->gu),
                                             .M = T, .N = 2 * F, .K = D});
        pd_op_silu_mul(be, &(pd_silu_mul_params){.gu = wp(ws->gu), .out = wp(ws->mlp), .n_rows = T, .F = F});
    }
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->mlp), .w = wp(w->wdown), .bias = wp(w->bdown),
                                         .out = rg ? wp(ws->x) : wp(ws->h), .M = T, .N = D, .K = F, .accumulate = rg});
}

// Whether a step of T tokens uses the fused forms (run_layer): where the backend runs them as
// single kernels; PD_MODEL_FUSE=1 forces them on any backend (tests: the CPU reference then checks
// the fused wiring), =0 turns them off. Read once per model.
static bool fuse_step(pd_model *m, int T) {
    if (m->ws.fuse_mode == 0) {
        const char *e = getenv("PD_MODEL_FUSE");
        m->ws.fuse_mode = !e || !*e ? 1 : !strcmp(e, "0") ? 2 : 3;
    }
    if (m->ws.fuse_mode == 2) return false;
    return m->ws.fuse_mode == 3 || pd_backend_fuses_matmul(m->backend, T);
}

// Whether a one-token step's lm_head reads x in place of a gathered copy (PD_MODEL_ROWS_DIRECT=0:
// it gathers, as every other step does; measurements; 1 or unset: reads x). Read once per model.
static bool rows_direct(pd_model *m) {
    if (m->ws.rows_mode == 0) {
        const char *e = getenv("PD_MODEL_ROWS_DIRECT");
        if (e && *e && strcmp(e, "0") && strcmp(e, "1")) {
            PD_LOG_E("model: PD_MODEL_ROWS_DIRECT=%s: expected 0 or 1", e);
            pd_abort(__FILE__, __LINE__, __func__, "bad PD_MODEL_ROWS_DIRECT");
        }
        m->ws.rows_mode = e && !strcmp(e, "0") ? 2 : 1;
    }
    return m->ws.rows_mode == 1;
}

// Whether an unfused step of T tokens folds the residual adds into the o and down GEMMs
// (run_layer's rg: pd_op_matmul accumulate into x, so each sum is rounded once, branch and
// residual together in f32, instead of the branch first; within a bf16 ulp of the transformers
// rounding, as the fused decode forms on cuBLASLt already are). It saves the norms' read and write
// of the branch output h (2 of their 4 passes over (T, D)) but makes the two GEMMs read x: measured
// on an H100 (session 11, tools/gpu/NOTES.md pf11-1/2) per 8192-token layer the norms 119 -> 90 us
// each, o 375 -> 395 and down 1310 -> 1361 (op_bench pfl), and bench-engine --only prefill within
// its run-to-run noise (8192 tokens: 229.2 ms without vs 229.5 with; 2048: 50.8 vs 50.0). No
// measured gain and transformers' rounding points lost: off by default. PD_MODEL_RESID_GEMM=N
// turns it on for steps of at least N tokens (1: every unfused step), 0 off. Read once per model.
#define PD_MODEL_RESID_GEMM_DEFAULT 0
static bool resid_gemm_step(pd_model *m, int T) {
    if (m->ws.resid_gemm_min == 0) {
        const char *e = getenv("PD_MODEL_RESID_GEMM");
        char *end = NULL;
        long v = e && *e ? strtol(e, &end, 10) : PD_MODEL_RESID_GEMM_DEFAULT;
        if (e && *e && (*end || v < 0 || v > (1 << 30))) {
            PD_LOG_E("model: PD_MODEL_RESID_GEMM=%s is not a token count (0 off, 1 every step, N from N tokens)", e);
            pd_abort(__FILE__, __LINE__, __func__, "bad PD_MODEL_RESID_GEMM");
        }
        m->ws.resid_gemm_min = v == 0 ? -1 : (int)v;
    }
    return m->ws.resid_gemm_min > 0 && T >= m->ws.resid_gemm_min;
}

// The whole op sequence of one step over packed metadata at dmeta (layout l).
// n_new: see run_layer.
static void run_step(pd_model *m, pd_model_cache *kc, const int32_t *dmeta, const meta_layout *l, int T, int n_seqs,
                     int n_logits, int max_q, int max_kv, const pd_batch *hook, int n_new) {
    pd_backend *be = m->backend;
    pd_model_ws *ws = &m->ws;
    const pd_model_config *c = &m->cfg;
    int D = c->hidden_size;
    pd_op_embed(be, &(pd_embed_params){.ids = dmeta + l->tokens, .table = wp(m->embed), .out = wp(ws->x), .n_tokens = T,
                                       .dim = D, .vocab = c->vocab_size});
    bool fused = fuse_step(m, T), rg = !fused && resid_gemm_step(m, T);
    for (int li = 0; li < c->n_layers; li++) {
        if (hook && hook->before_layer) hook->before_layer(hook->before_layer_ud, li);
        run_layer(m, kc, li, T, dmeta, l, n_seqs, max_q, max_kv, fused, rg, n_new);
        if (hook && hook->on_layer) hook->on_layer(hook->on_layer_ud, li);
    }
    if (n_logits > 0 && fused) {  // x is complete: the final norm goes into the lm_head GEMM
        pd_buffer *head = m->lm_head ? m->lm_head : m->embed;
        // One token, one logit row: that row is row 0 (pack_meta checks logit rows < T), so the
        // lm_head reads x itself and the gather kernel is not launched.
        bool direct = T == 1 && n_logits == 1 && rows_direct(m);
        if (!direct)
            pd_op_get_rows(be, &(pd_get_rows_params){.x = wp(ws->x), .idx = dmeta + l->logit_rows, .out = wp(ws->sel),
                                                     .n_rows = n_logits, .dim = D});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(direct ? ws->x : ws->sel), .w = wp(head), .out = wp(ws->logits), .M = n_logits,
                                             .N = c->vocab_size, .K = D, .out_f32 = true, .norm_w = wp(m->final_norm),
                                             .norm_eps = c->rms_norm_eps});
    } else if (n_logits > 0 && rg) {  // x is complete: norm the logit rows
        pd_buffer *head = m->lm_head ? m->lm_head : m->embed;
        pd_op_get_rows(be, &(pd_get_rows_params){.x = wp(ws->x), .idx = dmeta + l->logit_rows, .out = wp(ws->sel),
                                                 .n_rows = n_logits, .dim = D});
        pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->sel), .w = wp(m->final_norm), .out = wp(ws->sel_add),
                                               .n_rows = n_logits, .dim = D, .eps = c->rms_norm_eps});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->sel_add), .w = wp(head),
                                             .out = wp(ws->logits), .M = n_logits, .N = c->vocab_size, .K = D,
                                             .out_f32 = true});
    } else if (n_logits > 0) {
        // Only the logit rows: the last MLP output (in h) is added to them here, not to all of x.
        pd_buffer *head = m->lm_head ? m->lm_head : m->embed;
        pd_op_get_rows(be, &(pd_get_rows_params){.x = wp(ws->x), .idx = dmeta + l->logit_rows, .out = wp(ws->sel),
                                                 .n_rows = n_logits, .dim = D});
        pd_op_get_rows(be, &(pd_get_rows_params){.x = wp(ws->h), .idx = dmeta + l->logit_rows, .out = wp(ws->sel_add),
                                                 .n_rows = n_logits, .dim = D});
        pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->sel), .add = wp(ws->sel_add), .w = wp(m->final_norm),
                                               .out = wp(ws->sel_add), .n_rows = n_logits, .dim = D,
                                               .eps = c->rms_norm_eps});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->sel_add), .w = wp(head),
                                             .out = wp(ws->logits), .M = n_logits, .N = c->vocab_size, .K = D,
                                             .out_f32 = true});
    }
}

// ---- decode graphs -----------------------------------------------------------------------------

static const int GRAPH_BUCKETS[] = {1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256};
// Query tokens per sequence of a verify graph (the last token + k drafts, + a Jacobi window).
static const int Q_BUCKETS[] = {1, 2, 3, 5, 9, 13, 17};
#define VERIFY_MAX_B 64         // verify graphs up to this batch bucket
#define VERIFY_MAX_TOKENS 512   // and this many padded tokens (B * Q): beyond, steps are compute-bound

static bool graphs_on(pd_model *m) {
    if (m->ws.graphs_mode == 0) {
        const char *env = getenv("PD_CUDA_GRAPHS");
        m->ws.graphs_mode = pd_backend_has_graphs(m->backend) && !(env && !strcmp(env, "0")) ? 1 : 2;
    }
    return m->ws.graphs_mode == 1;
}

// 256, 384, 512, 768, 1024, 1536, ...: the smallest >= kv.
static int kv_bucket(int kv) {
    int p = 256;
    while (p < kv) {
        if (p + p / 2 >= kv) return p + p / 2;
        p *= 2;
    }
    return p;
}

static int q_bucket(int q) {
    for (size_t i = 0; i < PD_ARRAY_LEN(Q_BUCKETS); i++)
        if (Q_BUCKETS[i] >= q) return Q_BUCKETS[i];
    return 0;
}

void pd_model_set_graph_q(pd_model *m, int max_q) {
    int last = Q_BUCKETS[PD_ARRAY_LEN(Q_BUCKETS) - 1];
    m->ws.graph_q_max = max_q <= 1 ? 1 : q_bucket(PD_MIN(max_q, last));
}

// The metadata layout of a padded step: B sequences of Q rows, bt_cap page-table entries, logits
// at every row.
static meta_layout layout_fixed(int B, int Q, int bt_cap) {
    size_t T = (size_t)B * (size_t)Q;
    meta_layout l = layout_for(T, (size_t)B, (size_t)bt_cap, T);
    if (Q > 1) {  // the per-token view of attention (see meta_layout)
        size_t o = l.total;
        l.n_pseudo = T;
        l.p_q_indptr = o; o += T + 1;
        l.p_kv_lens = o; o += T;
        l.p_bt_indptr = o; o += T + 1;
        l.p_token_seq = o; o += T;
        l.total = o;
    }
    return l;
}

static void graph_entry_free(pd_model *m, pd_graph_entry *ge) {
    pd_backend_graph_free(m->backend, ge->g);
    pd_buffer_free(ge->meta);
    memset(ge, 0, sizeof *ge);
}

void pd_model_graphs_free(pd_model *m) {
    for (int i = 0; i < m->ws.n_graphs; i++) graph_entry_free(m, &m->ws.graphs[i]);
    m->ws.n_graphs = 0;
    pd_free(m->ws.pad_host);
    m->ws.pad_host = NULL;
    m->ws.cap_pad = 0;
}

// The bucket's entry, created (evicting the least recently used one when full) if needed.
static pd_graph_entry *graph_entry_get(pd_model *m, const void *kc_base, int B, int Q, int kv_cap, int bt_cap,
                                       size_t n_meta) {
    pd_model_ws *ws = &m->ws;
    pd_graph_entry *ge = NULL;
    for (int i = 0; i < ws->n_graphs && !ge; i++)
        if (ws->graphs[i].B == B && ws->graphs[i].Q == Q && ws->graphs[i].kv_cap == kv_cap && ws->graphs[i].kc_base == kc_base)
            ge = &ws->graphs[i];
    if (!ge) {
        if (ws->n_graphs < PD_MODEL_MAX_GRAPHS) {
            ge = &ws->graphs[ws->n_graphs++];
        } else {
            ge = &ws->graphs[0];
            for (int i = 1; i < ws->n_graphs; i++)
                if (ws->graphs[i].last_use < ge->last_use) ge = &ws->graphs[i];
            graph_entry_free(m, ge);
        }
        *ge = (pd_graph_entry){.B = B, .Q = Q, .kv_cap = kv_cap, .bt_cap = bt_cap, .kc_base = kc_base};
        ge->meta = pd_buffer_alloc(m->backend, n_meta * sizeof(int32_t));
        if (!ge->meta) {
            *ge = ws->graphs[--ws->n_graphs];  // drop it again (the last entry moves here)
            return NULL;
        }
    }
    ge->last_use = ++ws->use_clock;
    return ge;
}

// Builds the padded batch (B sequences of Q tokens) in ws->pad_host. A real sequence of q <= Q
// tokens gets Q - q padding tokens (id 0) after its own, so its context grows by Q - q positions
// that no real row attends to (causal); it keeps only the blocks attention reads, and block 0
// stands in for blocks the padding positions lack. The requested logit rows are mapped to their
// padded rows, in order (logits rows 0 .. n_logits - 1 are the caller's). Returns 0, 1 when out
// of host memory, 2 when the batch does not fit the layout (the eager path reports it).
static int pad_batch(pd_model *m, const pd_batch *b, int B, int Q, int bs, pd_batch *pb) {
    int n = b->n_seqs, n_bt = 0, T = B * Q;
    for (int s = 0; s < n; s++) {
        int q = b->q_indptr[s + 1] - b->q_indptr[s];
        n_bt += (b->kv_lens[s] + Q - q + bs - 1) / bs;
    }
    n_bt += (B - n) * ((Q + bs - 1) / bs);
    size_t need = (size_t)T + (size_t)(B + 1) + (size_t)B + (size_t)(B + 1) + (size_t)n_bt + (size_t)T;
    pd_model_ws *ws = &m->ws;
    if (PD_ARRAY_RESERVE(ws->pad_host, ws->cap_pad, need) != PD_OK) return 1;
    int32_t *tok = ws->pad_host, *qi = tok + T, *kvl = qi + B + 1, *bti = kvl + B, *bt = bti + B + 1;
    int32_t *lr = bt + n_bt;
    int k = 0;
    bti[0] = 0;
    for (int s = 0; s < B; s++) {
        qi[s] = s * Q;
        if (s < n) {
            int q0 = b->q_indptr[s], q = b->q_indptr[s + 1] - q0;
            for (int i = 0; i < Q; i++) tok[s * Q + i] = i < q ? b->tokens[q0 + i] : 0;
            kvl[s] = b->kv_lens[s] + Q - q;
            int need_b = (kvl[s] + bs - 1) / bs, have = b->bt_indptr[s + 1] - b->bt_indptr[s];
            int nb = PD_MIN(have, need_b);
            memcpy(bt + k, b->bt_indices + b->bt_indptr[s], sizeof(int32_t) * (size_t)nb);
            for (int j = nb; j < need_b; j++) bt[k + j] = 0;
            k += need_b;
        } else {  // padding: Q tokens 0 at positions 0 .. Q - 1 over block 0 (slots set to -1 later)
            for (int i = 0; i < Q; i++) tok[s * Q + i] = 0;
            kvl[s] = Q;
            for (int j = 0; j < (Q + bs - 1) / bs; j++) bt[k++] = 0;
        }
        bti[s + 1] = k;
    }
    qi[B] = T;
    int s = 0;
    for (int i = 0; i < T; i++) {
        if (i >= b->n_logits) {
            lr[i] = 0;
            continue;
        }
        int t = b->logit_rows[i];
        if (t < 0 || t >= b->n_tokens) return 2;
        if (t < b->q_indptr[s] || t >= b->q_indptr[s + 1]) {  // rows usually ascend: search only when not
            int lo = 0, hi = n - 1;
            while (lo < hi) {
                int mid = (lo + hi + 1) / 2;
                if (b->q_indptr[mid] <= t) lo = mid;
                else hi = mid - 1;
            }
            s = lo;
        }
        lr[i] = s * Q + (t - b->q_indptr[s]);
    }
    *pb = (pd_batch){.n_tokens = T, .tokens = tok, .n_seqs = B, .q_indptr = qi, .kv_lens = kvl, .bt_indptr = bti,
                     .bt_indices = bt, .n_logits = T, .logit_rows = lr};
    return 0;
}

// One padded step of the real sequences in b (possibly none: a warm-up) through the (B, Q,
// kv_cap) bucket's graph: launched when captured; otherwise run eagerly the first time (it sizes
// cuBLASLt plans and scratch, which must not grow during capture) and captured the second time.
// *handled false: no room for the bucket (the caller runs the step eagerly).
static pd_status graph_step(pd_model *m, pd_model_cache *kc, const pd_batch *b, int B, int Q, int kv_cap, bool *handled) {
    int n = b->n_seqs, bs = kc->block_size, bt_cap = B * ((kv_cap + bs - 1) / bs), T = B * Q;
    meta_layout l = layout_fixed(B, Q, bt_cap);
    pd_batch pb;
    *handled = false;
    int pr = pad_batch(m, b, B, Q, bs, &pb);
    if (pr == 1) return PD_ERR_NOMEM;
    if (pr == 2) return PD_OK;
    pd_status st = ws_reserve(m, T, T, l.total);
    if (st) return st;
    int max_q, mkv;
    st = pack_meta(m, kc, &pb, &l, &max_q, &mkv);
    *handled = true;
    if (st) return st;
    // Padding rows write no KV: every row of a padding sequence, and a real sequence's tail.
    int32_t *h = m->ws.meta_host;
    for (int s = 0; s < B; s++) {
        int q = s < n ? b->q_indptr[s + 1] - b->q_indptr[s] : 0;
        for (int i = q; i < Q; i++) h[l.slots + (size_t)(s * Q + i)] = -1;
    }
    for (size_t t = 0; t < l.n_pseudo; t++) {  // token t: one query at its position, over its sequence's blocks
        h[l.p_q_indptr + t] = (int32_t)t;
        h[l.p_kv_lens + t] = h[l.positions + t] + 1;
        h[l.p_bt_indptr + t] = h[l.bt_indptr + (size_t)h[l.token_seq + t]];
        h[l.p_token_seq + t] = (int32_t)t;
    }
    if (l.n_pseudo) {
        h[l.p_q_indptr + l.n_pseudo] = (int32_t)l.n_pseudo;
        h[l.p_bt_indptr + l.n_pseudo] = h[l.bt_indptr + (size_t)B];
    }
    // The fixed layout's unused page-table tail (fewer blocks than bt_cap) is never read.
    pd_graph_entry *ge = graph_entry_get(m, pd_buffer_ptr(kc->buf), B, Q, kv_cap, bt_cap, l.total);
    if (!ge) {
        *handled = false;  // no room for the bucket's metadata: eager
        return PD_OK;
    }
    pd_backend *be = m->backend;
    const int32_t *dmeta = wp(ge->meta);
    // Every run of the step (eager, captured, launched) follows this upload, which waits for all
    // earlier work on the stream: within the step only its own rope_kv writes KV, the last Q rows of
    // each sequence's context, so attention may read the others early (n_new = Q).
    pd_backend_upload(be, wp(ge->meta), m->ws.meta_host, l.total * sizeof(int32_t));
    if (ge->g && (ge->ws_gen != m->ws.gen || !pd_backend_graph_launch(be, ge->g))) {
        pd_backend_graph_free(be, ge->g);  // stale: capture again below
        ge->g = NULL;
    }
    if (ge->g) return PD_OK;
    if (!ge->is_warm || ge->is_eager_only) {
        run_step(m, kc, dmeta, &l, T, B, T, Q, kv_cap, NULL, Q);
        ge->is_warm = true;
        return PD_OK;
    }
    pd_backend_graph_begin(be);
    run_step(m, kc, dmeta, &l, T, B, T, Q, kv_cap, NULL, Q);
    ge->g = pd_backend_graph_end(be);
    ge->ws_gen = m->ws.gen;
    if (ge->g && pd_backend_graph_launch(be, ge->g)) return PD_OK;
    PD_LOG_W("model: graph for batch %d x %d tokens, context %d unavailable; running it eagerly", B, Q, kv_cap);
    pd_backend_graph_free(be, ge->g);
    ge->g = NULL;
    ge->is_eager_only = true;
    run_step(m, kc, dmeta, &l, T, B, T, Q, kv_cap, NULL, Q);
    return PD_OK;
}

static int graph_bucket(int n) {
    for (size_t i = 0; i < PD_ARRAY_LEN(GRAPH_BUCKETS); i++)
        if (GRAPH_BUCKETS[i] >= n) return GRAPH_BUCKETS[i];
    return 0;
}

// Whether (B, Q) steps run as graphs: decode steps up to the largest batch bucket; steps of
// several tokens per sequence only where pd_model_set_graph_q allowed them, and small.
static bool graph_shape_ok(const pd_model *m, int B, int Q) {
    if (!B || !Q) return false;
    if (Q == 1) return true;
    return Q <= m->ws.graph_q_max && B <= VERIFY_MAX_B && B * Q <= VERIFY_MAX_TOKENS;
}

int pd_model_step_tokens(pd_model *m, int n_seqs, int max_q, int n_tokens) {
    if (n_seqs < 1 || max_q < 1 || !graphs_on(m)) return n_tokens;
    int B = graph_bucket(n_seqs), Q = q_bucket(max_q);
    return graph_shape_ok(m, B, Q) ? B * Q : n_tokens;
}

// A decode or verify step through the bucket's graph. *handled false: not a graph step (run it
// eagerly).
static pd_status forward_graph(pd_model *m, pd_model_cache *kc, const pd_batch *b, bool *handled) {
    *handled = false;
    int n = b->n_seqs, B = graph_bucket(n), max_q = 0;
    if (b->n_logits <= 0 || b->bt_indptr[0] != 0 || b->q_indptr[0] != 0 || b->q_indptr[n] != b->n_tokens) return PD_OK;
    for (int s = 0; s < n; s++) {
        int q = b->q_indptr[s + 1] - b->q_indptr[s];
        if (q < 1) return PD_OK;
        max_q = PD_MAX(max_q, q);
    }
    int Q = q_bucket(max_q);
    if (!graph_shape_ok(m, B, Q)) return PD_OK;
    int bs = kc->block_size, max_kv = 0;
    for (int s = 0; s < n; s++) {
        int nb = b->bt_indptr[s + 1] - b->bt_indptr[s], q = b->q_indptr[s + 1] - b->q_indptr[s];
        if (b->kv_lens[s] < q || nb < 0 || (int64_t)nb * bs < b->kv_lens[s]) return PD_OK;  // eager path reports it
        max_kv = PD_MAX(max_kv, b->kv_lens[s] + Q - q);
    }
    return graph_step(m, kc, b, B, Q, kv_bucket(max_kv), handled);
}

pd_status pd_model_warmup(pd_model *m, pd_model_cache *kc, int max_tokens, int max_seqs, int max_len, int *n_graphs) {
    if (n_graphs) *n_graphs = 0;
    if (kc->model != m || max_tokens < 1 || max_seqs < 0 || max_len < 1) return PD_ERR_INVALID;
    int b_max = max_seqs > 0 && graphs_on(m) ? graph_bucket(PD_MIN(max_seqs, GRAPH_BUCKETS[PD_ARRAY_LEN(GRAPH_BUCKETS) - 1])) : 0;
    if (!b_max) return PD_OK;  // no graphs: the workspace may as well grow with the steps
    int n_b = 0, n_kv = 0, kvs[32], n_q = 0, t_max = b_max;
    for (size_t i = 0; i < PD_ARRAY_LEN(GRAPH_BUCKETS) && GRAPH_BUCKETS[i] <= b_max; i++) n_b++;
    for (size_t j = 0; j < PD_ARRAY_LEN(Q_BUCKETS) && Q_BUCKETS[j] <= PD_MAX(m->ws.graph_q_max, 1); j++) n_q++;
    for (int i = 0; i < n_b; i++)
        for (int j = 1; j < n_q; j++)
            if (graph_shape_ok(m, GRAPH_BUCKETS[i], Q_BUCKETS[j])) t_max = PD_MAX(t_max, GRAPH_BUCKETS[i] * Q_BUCKETS[j]);
    // The activations and logits for the largest step first: growing them later would make every
    // graph stale.
    pd_status st = ws_reserve(m, PD_MAX(max_tokens, t_max), PD_MAX(max_seqs, t_max), 0);
    if (st) return st;
    for (int kv = 1; n_kv < (int)PD_ARRAY_LEN(kvs); kv = kvs[n_kv - 1] + 1) {
        kvs[n_kv++] = kv_bucket(kv);
        if (kvs[n_kv - 1] >= max_len) break;
    }
    int n_shapes = 0;
    for (int i = 0; i < n_b; i++)
        for (int j = 0; j < n_q; j++) n_shapes += graph_shape_ok(m, GRAPH_BUCKETS[i], Q_BUCKETS[j]);
    n_kv = PD_MIN(n_kv, PD_MODEL_MAX_GRAPHS / n_shapes);  // the shortest contexts when the table is short
    // Two passes: every shape runs eagerly once (sizing cuBLASLt plans and the backend's scratch
    // to the largest need: the attention scratch depends on the sequences and the context, and
    // growing it later would stale every graph), then every shape is captured. Largest first.
    int32_t zero = 0;
    pd_batch none = {.q_indptr = &zero, .bt_indptr = &zero};  // no real sequence: all rows padding
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < n_q; j++)
            for (int i = n_b - 1; i >= 0; i--) {
                if (!graph_shape_ok(m, GRAPH_BUCKETS[i], Q_BUCKETS[j])) continue;
                for (int k = n_kv - 1; k >= 0; k--) {
                    bool handled;
                    st = graph_step(m, kc, &none, GRAPH_BUCKETS[i], Q_BUCKETS[j], kvs[k], &handled);
                    if (st) return st;
                    if (handled && pass == 1 && n_graphs) (*n_graphs)++;
                }
            }
    pd_backend_sync(m->backend);
    return PD_OK;
}

pd_status pd_model_forward_dev(pd_model *m, pd_model_cache *kc, const pd_batch *b, const float **logits_dev) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->n_logits < 0 || b->n_logits > b->n_tokens || kc->model != m)
        return PD_ERR_INVALID;
    if (graphs_on(m) && !b->on_layer && !b->before_layer) {
        bool handled;
        pd_status st = forward_graph(m, kc, b, &handled);
        if (handled || st) {
            if (!st && logits_dev) *logits_dev = wp(m->ws.logits);
            return st;
        }
    }
    meta_layout l = layout_of(b);
    pd_status st = ws_reserve(m, b->n_tokens, PD_MAX(b->n_logits, 1), l.total);
    if (st) return st;
    int max_q, max_kv;
    st = pack_meta(m, kc, b, &l, &max_q, &max_kv);
    if (st) return st;
    pd_backend_upload(m->backend, wp(m->ws.meta), m->ws.meta_host, l.total * sizeof(int32_t));
    run_step(m, kc, wp(m->ws.meta), &l, b->n_tokens, b->n_seqs, b->n_logits, max_q, max_kv, b, 0);
    if (logits_dev) *logits_dev = wp(m->ws.logits);
    return PD_OK;
}

pd_status pd_model_forward(pd_model *m, pd_model_cache *kc, const pd_batch *b, float *logits) {
    const float *dl = NULL;
    pd_status st = pd_model_forward_dev(m, kc, b, &dl);
    if (st) return st;
    if (b->n_logits > 0 && logits)
        pd_backend_download(m->backend, logits, dl, sizeof(float) * (size_t)b->n_logits * (size_t)m->cfg.vocab_size);
    else
        pd_backend_sync(m->backend);
    return PD_OK;
}
