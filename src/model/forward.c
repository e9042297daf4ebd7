// forward.c — one forward step of the decoder over a mixed batch (prefill chunks and decodes of
// several sequences), expressed as backend ops. See model.h for the sequence of ops.
//
// Per-step metadata (tokens, positions, slot mapping, CSR page table, ...) is validated on the
// host, packed into one int32 array and uploaded with a single copy, so a step costs one
// host-to-device transfer besides the logits coming back.
#include <math.h>
#include <string.h>

#include "model/model_impl.h"

// Offsets (in int32 elements) of each array inside the packed metadata.
typedef struct meta_layout {
    size_t tokens, positions, slots, token_seq, q_indptr, kv_lens, bt_indptr, bt_indices, logit_rows, total;
} meta_layout;

static meta_layout layout_of(const pd_batch *b) {
    meta_layout l;
    size_t o = 0, T = (size_t)b->n_tokens, S = (size_t)b->n_seqs;
    l.tokens = o; o += T;
    l.positions = o; o += T;
    l.slots = o; o += T;
    l.token_seq = o; o += T;
    l.q_indptr = o; o += S + 1;
    l.kv_lens = o; o += S;
    l.bt_indptr = o; o += S + 1;
    l.bt_indices = o; o += (size_t)b->bt_indptr[b->n_seqs];
    l.logit_rows = o; o += (size_t)b->n_logits;
    l.total = o;
    return l;
}

static pd_status grow(pd_backend *be, pd_buffer **buf, size_t n_bytes) {
    if (*buf && pd_buffer_size(*buf) >= n_bytes) return PD_OK;
    pd_buffer_free(*buf);
    *buf = pd_buffer_alloc(be, n_bytes);
    return *buf ? PD_OK : PD_ERR_DEVICE;
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
    }
    if (n_logits > ws->cap_logits) {
        size_t L = (size_t)n_logits;
        if (grow(m->backend, &ws->sel, L * D * e) || grow(m->backend, &ws->logits, L * (size_t)c->vocab_size * 4))
            return PD_ERR_DEVICE;
        ws->cap_logits = n_logits;
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

static void run_layer(pd_model *m, pd_model_cache *kc, int li, int T, const int32_t *dmeta, const meta_layout *l,
                      int n_seqs, int max_q, int max_kv) {
    const pd_model_config *c = &m->cfg;
    pd_backend *be = m->backend;
    pd_layer_weights *w = &m->layers[li];
    pd_model_ws *ws = &m->ws;
    int D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim, H = c->n_heads, Hkv = c->n_kv_heads;
    int nqkv = (H + 2 * Hkv) * hd;

    pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->x), .w = wp(w->attn_norm), .out = wp(ws->h), .n_rows = T, .dim = D,
                                           .eps = c->rms_norm_eps});
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->h), .w = wp(w->wqkv), .bias = wp(w->bqkv), .out = wp(ws->qkv), .M = T,
                                         .N = nqkv, .K = D});
    pd_op_rope_kv(be, &(pd_rope_kv_params){.qkv = wp(ws->qkv), .positions = dmeta + l->positions,
                                           .inv_freq = wp(m->inv_freq), .slot_mapping = dmeta + l->slots,
                                           .k_cache = pd_model_cache_k(kc, li), .v_cache = pd_model_cache_v(kc, li),
                                           .n_tokens = T, .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                           .attn_scaling = 1.0f});
    pd_op_attention(be, &(pd_attention_params){.q = wp(ws->qkv), .k_cache = pd_model_cache_k(kc, li),
                                               .v_cache = pd_model_cache_v(kc, li), .out = wp(ws->attn),
                                               .q_indptr = dmeta + l->q_indptr, .kv_lens = dmeta + l->kv_lens,
                                               .bt_indptr = dmeta + l->bt_indptr, .bt_indices = dmeta + l->bt_indices,
                                               .token_seq = dmeta + l->token_seq, .n_tokens = T, .n_seqs = n_seqs,
                                               .n_heads = H, .n_kv_heads = Hkv, .head_dim = hd,
                                               .block_size = kc->block_size, .q_stride = nqkv, .max_q_len = max_q,
                                               .max_kv_len = max_kv, .scale = 1.0f / sqrtf((float)hd)});
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->attn), .w = wp(w->wo), .bias = wp(w->bo), .out = wp(ws->x), .M = T,
                                         .N = D, .K = H * hd, .accumulate = true});
    pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->x), .w = wp(w->mlp_norm), .out = wp(ws->h), .n_rows = T, .dim = D,
                                           .eps = c->rms_norm_eps});
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->h), .w = wp(w->wgu), .bias = wp(w->bgu), .out = wp(ws->gu), .M = T,
                                         .N = 2 * F, .K = D});
    pd_op_silu_mul(be, &(pd_silu_mul_params){.gu = wp(ws->gu), .out = wp(ws->mlp), .n_rows = T, .F = F});
    pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->mlp), .w = wp(w->wdown), .bias = wp(w->bdown), .out = wp(ws->x), .M = T,
                                         .N = D, .K = F, .accumulate = true});
}

pd_status pd_model_forward_dev(pd_model *m, pd_model_cache *kc, const pd_batch *b, const float **logits_dev) {
    if (b->n_tokens <= 0 || b->n_seqs <= 0 || b->n_logits < 0 || b->n_logits > b->n_tokens || kc->model != m)
        return PD_ERR_INVALID;
    meta_layout l = layout_of(b);
    pd_status st = ws_reserve(m, b->n_tokens, PD_MAX(b->n_logits, 1), l.total);
    if (st) return st;
    int max_q, max_kv;
    st = pack_meta(m, kc, b, &l, &max_q, &max_kv);
    if (st) return st;
    pd_backend *be = m->backend;
    pd_model_ws *ws = &m->ws;
    const pd_model_config *c = &m->cfg;
    int T = b->n_tokens, D = c->hidden_size;
    pd_backend_upload(be, wp(ws->meta), ws->meta_host, l.total * sizeof(int32_t));
    const int32_t *dmeta = wp(ws->meta);

    pd_op_embed(be, &(pd_embed_params){.ids = dmeta + l.tokens, .table = wp(m->embed), .out = wp(ws->x), .n_tokens = T,
                                       .dim = D, .vocab = c->vocab_size});
    for (int li = 0; li < c->n_layers; li++) run_layer(m, kc, li, T, dmeta, &l, b->n_seqs, max_q, max_kv);

    if (b->n_logits > 0) {
        pd_op_get_rows(be, &(pd_get_rows_params){.x = wp(ws->x), .idx = dmeta + l.logit_rows, .out = wp(ws->sel),
                                                 .n_rows = b->n_logits, .dim = D});
        pd_op_rmsnorm(be, &(pd_rmsnorm_params){.x = wp(ws->sel), .w = wp(m->final_norm), .out = wp(ws->sel),
                                               .n_rows = b->n_logits, .dim = D, .eps = c->rms_norm_eps});
        pd_op_matmul(be, &(pd_matmul_params){.a = wp(ws->sel), .w = wp(m->lm_head ? m->lm_head : m->embed),
                                             .out = wp(ws->logits), .M = b->n_logits, .N = c->vocab_size, .K = D,
                                             .out_f32 = true});
    }
    if (logits_dev) *logits_dev = wp(ws->logits);
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
