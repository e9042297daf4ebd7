// load.c — building a pd_model from a Hugging Face folder (or dummy weights), and the KV cache.
//
// Every tensor is looked up by its HF name and its shape checked before conversion, so a wrong or
// truncated checkpoint fails at load with the tensor's name and the expected vs found shape,
// never as garbage logits. q/k/v and gate/up are concatenated into fused matrices here.
#include <stdio.h>
#include <string.h>

#include "model/model_impl.h"
#include "model/safetensors.h"

pd_model_params pd_model_params_default(void) {
    pd_model_params p = {0};
    p.seed = 1234;
    return p;
}

typedef struct loader {
    pd_model *m;
    const pd_st *st;
    const pd_model_params *p;
    size_t done, total;
    void *stage;  // host staging buffer (owned)
    size_t stage_cap;
    uint64_t dummy_seed;
    float out_scale;  // dummy: the factor on the current layer's residual writes (o_proj, down_proj)
    pd_err *err;
} loader;

static pd_status stage_reserve(loader *L, size_t n) {
    if (n <= L->stage_cap) return PD_OK;
    void *s = pd_realloc(L->stage, n);
    if (!s) return pd_err_set(L->err, PD_ERR_NOMEM, "out of memory staging %zu bytes of weights", n);
    L->stage = s;
    L->stage_cap = n;
    return PD_OK;
}

static void fmt_shape(char *buf, size_t n, const int64_t *shape, int nd) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int i = 0; i < nd && o < n; i++) o += (size_t)snprintf(buf + o, n - o, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

// Converts tensor `name` (expected shape rows x cols; cols == 0 for a vector) into dst at element
// offset `off` of a device buffer. In dummy mode fills it with N(mean, std) instead.
static pd_status load_into(loader *L, pd_buffer *dst, size_t off, const char *name, int64_t rows, int64_t cols,
                           float mean, float std) {
    pd_model *m = L->m;
    size_t esz = pd_dtype_size(m->wdt);
    size_t n = (size_t)rows * (size_t)(cols ? cols : 1);
    char *dptr = (char *)pd_buffer_ptr(dst) + off * esz;
    if (L->p->dummy) {
        pd_op_fill_normal(m->backend, dptr, m->wdt, n, L->dummy_seed++, mean, std);
        return PD_OK;
    }
    const pd_st_tensor *t = pd_st_find(L->st, name);
    if (!t) return pd_err_set(L->err, PD_ERR_NOTFOUND, "missing tensor '%s'", name);
    int64_t want[2] = {rows, cols};
    int want_nd = cols ? 2 : 1;
    if (t->n_dims != want_nd || t->shape[0] != rows || (cols && t->shape[1] != cols)) {
        char a[96], b[96];
        fmt_shape(a, sizeof a, want, want_nd);
        fmt_shape(b, sizeof b, t->shape, t->n_dims);
        return pd_err_set(L->err, PD_ERR_INVALID, "tensor '%s' has shape %s, expected %s", name, b, a);
    }
    if (t->dtype == PD_ST_OTHER)
        return pd_err_set(L->err, PD_ERR_UNSUPPORTED, "tensor '%s' has unsupported dtype %s (supported: BF16, F16, F32)", name,
                          t->dtype_name);
    pd_status s = stage_reserve(L, n * esz);
    if (s) return s;
    s = m->wdt == PD_DTYPE_F32 ? pd_st_to_f32(t, L->stage) : pd_st_to_bf16(t, L->stage);
    if (s) return pd_err_set(L->err, s, "tensor '%s': cannot convert %s to %s", name, t->dtype_name, pd_dtype_name(m->wdt));
    pd_backend_upload(m->backend, dptr, L->stage, n * esz);
    pd_backend_sync(m->backend);  // the staging buffer is reused by the next tensor
    L->done += t->n_bytes;
    if (L->p->progress) L->p->progress(L->p->progress_ud, L->done, L->total);
    return PD_OK;
}

static pd_buffer *walloc(loader *L, size_t n_elems, const char *what) {
    pd_buffer *b = pd_buffer_alloc(L->m->backend, n_elems * pd_dtype_size(L->m->wdt));
    if (!b) pd_err_set(L->err, PD_ERR_DEVICE, "out of device memory allocating %s (%zu elements)", what, n_elems);
    else L->m->weight_bytes += n_elems * pd_dtype_size(L->m->wdt);
    return b;
}

#define TRY(x) do { pd_status s_ = (x); if (s_) return s_; } while (0)
#define ALLOC(dst, n, what) do { if (!((dst) = walloc(L, (n), (what)))) return PD_ERR_DEVICE; } while (0)

static pd_status load_layer(loader *L, int i) {
    const pd_model_config *c = &L->m->cfg;
    pd_layer_weights *w = &L->m->layers[i];
    int64_t D = c->hidden_size, F = c->intermediate_size, hd = c->head_dim;
    int64_t nq = c->n_heads * hd, nkv = c->n_kv_heads * hd;
    float sd = 0.02f;
    char nm[256];
#define NAME(fmt) (snprintf(nm, sizeof nm, "model.layers.%d." fmt, i), nm)
    ALLOC(w->attn_norm, (size_t)D, "attn_norm");
    TRY(load_into(L, w->attn_norm, 0, NAME("input_layernorm.weight"), D, 0, 1.0f, 0.0f));
    ALLOC(w->wqkv, (size_t)((nq + 2 * nkv) * D), "wqkv");
    TRY(load_into(L, w->wqkv, 0, NAME("self_attn.q_proj.weight"), nq, D, 0, sd));
    TRY(load_into(L, w->wqkv, (size_t)(nq * D), NAME("self_attn.k_proj.weight"), nkv, D, 0, sd));
    TRY(load_into(L, w->wqkv, (size_t)((nq + nkv) * D), NAME("self_attn.v_proj.weight"), nkv, D, 0, sd));
    if (c->attention_bias) {
        ALLOC(w->bqkv, (size_t)(nq + 2 * nkv), "bqkv");
        TRY(load_into(L, w->bqkv, 0, NAME("self_attn.q_proj.bias"), nq, 0, 0, sd));
        TRY(load_into(L, w->bqkv, (size_t)nq, NAME("self_attn.k_proj.bias"), nkv, 0, 0, sd));
        TRY(load_into(L, w->bqkv, (size_t)(nq + nkv), NAME("self_attn.v_proj.bias"), nkv, 0, 0, sd));
    }
    float so = sd * L->out_scale;  // 1 unless --dummy-residual-scale covers this layer
    ALLOC(w->wo, (size_t)(D * nq), "wo");
    TRY(load_into(L, w->wo, 0, NAME("self_attn.o_proj.weight"), D, nq, 0, so));
    if (c->attention_bias && c->arch != PD_ARCH_QWEN2) {  // Qwen2's o_proj has no bias
        ALLOC(w->bo, (size_t)D, "bo");
        TRY(load_into(L, w->bo, 0, NAME("self_attn.o_proj.bias"), D, 0, 0, so));
    }
    ALLOC(w->mlp_norm, (size_t)D, "mlp_norm");
    TRY(load_into(L, w->mlp_norm, 0, NAME("post_attention_layernorm.weight"), D, 0, 1.0f, 0.0f));
    ALLOC(w->wgu, (size_t)(2 * F * D), "wgu");
    TRY(load_into(L, w->wgu, 0, NAME("mlp.gate_proj.weight"), F, D, 0, sd));
    TRY(load_into(L, w->wgu, (size_t)(F * D), NAME("mlp.up_proj.weight"), F, D, 0, sd));
    ALLOC(w->wdown, (size_t)(D * F), "wdown");
    TRY(load_into(L, w->wdown, 0, NAME("mlp.down_proj.weight"), D, F, 0, so));
    if (c->mlp_bias) {
        ALLOC(w->bgu, (size_t)(2 * F), "bgu");
        TRY(load_into(L, w->bgu, 0, NAME("mlp.gate_proj.bias"), F, 0, 0, sd));
        TRY(load_into(L, w->bgu, (size_t)F, NAME("mlp.up_proj.bias"), F, 0, 0, sd));
        ALLOC(w->bdown, (size_t)D, "bdown");
        TRY(load_into(L, w->bdown, 0, NAME("mlp.down_proj.bias"), D, 0, 0, so));
    }
#undef NAME
    return PD_OK;
}

// n_full: the config's layer count; m->cfg.n_layers may be fewer (dummy_num_layers), in which case
// the seeds the dropped layers would have used are skipped, so the final norm and lm_head get the
// same seeds (hence values) as in the full model. Every layer draws the same number of seeds.
static pd_status load_all(loader *L, int n_full) {
    pd_model *m = L->m;
    const pd_model_config *c = &m->cfg;
    int64_t D = c->hidden_size, V = c->vocab_size;
    ALLOC(m->embed, (size_t)(V * D), "embed_tokens");
    TRY(load_into(L, m->embed, 0, "model.embed_tokens.weight", V, D, 0, 1.0f));
    uint64_t per_layer = 0;
    for (int i = 0; i < c->n_layers; i++) {
        uint64_t s0 = L->dummy_seed;
        int from = L->p->dummy_scale_from;
        L->out_scale = (from > 0 && i >= from) || from == PD_DUMMY_SCALE_ALL ? L->p->dummy_scale_eps : 1.0f;
        TRY(load_layer(L, i));
        per_layer = L->dummy_seed - s0;
    }
    L->dummy_seed += per_layer * (uint64_t)(n_full - c->n_layers);
    ALLOC(m->final_norm, (size_t)D, "norm");
    TRY(load_into(L, m->final_norm, 0, "model.norm.weight", D, 0, 1.0f, 0.0f));
    if (!c->tie_word_embeddings) {
        ALLOC(m->lm_head, (size_t)(V * D), "lm_head");
        TRY(load_into(L, m->lm_head, 0, "lm_head.weight", V, D, 0, 0.02f));
    }
    m->inv_freq = pd_buffer_alloc(m->backend, sizeof(float) * (size_t)(c->head_dim / 2));
    if (!m->inv_freq) return pd_err_set(L->err, PD_ERR_DEVICE, "out of device memory");
    float inv[512];
    pd_model_config_inv_freq(c, inv);
    pd_backend_upload(m->backend, pd_buffer_ptr(m->inv_freq), inv, sizeof(float) * (size_t)(c->head_dim / 2));
    pd_backend_sync(m->backend);
    return PD_OK;
}

// The benchmark fixture's knobs (model.h): dummy weights only, and within the config's shape.
static pd_status check_fixture(const pd_model_params *p, int n_layers, pd_err *err) {
    if (!p->dummy_num_layers && !p->dummy_scale_from) return PD_OK;
    if (!p->dummy)
        return pd_err_set(err, PD_ERR_INVALID,
                          "--dummy-num-layers and --dummy-residual-scale are benchmark fixtures: they need --load-format dummy");
    if (p->dummy_num_layers < 0 || p->dummy_num_layers > n_layers)
        return pd_err_set(err, PD_ERR_INVALID, "--dummy-num-layers %d: the config has %d layers (1..%d)", p->dummy_num_layers, n_layers,
                          n_layers);
    int n = p->dummy_num_layers > 0 ? p->dummy_num_layers : n_layers;
    if (p->dummy_scale_from && p->dummy_scale_from != PD_DUMMY_SCALE_ALL && (p->dummy_scale_from < 1 || p->dummy_scale_from >= n))
        return pd_err_set(err, PD_ERR_INVALID, "--dummy-residual-scale FROM:EPS: FROM %d must be 1..%d (the model has %d layers)",
                          p->dummy_scale_from, n - 1, n);
    if (p->dummy_scale_from && !(p->dummy_scale_eps >= 0.0f && p->dummy_scale_eps <= 1.0f))
        return pd_err_set(err, PD_ERR_INVALID, "--dummy-residual-scale FROM:EPS: EPS %g must be in [0, 1]", (double)p->dummy_scale_eps);
    return PD_OK;
}

pd_model *pd_model_load(const pd_model_params *p, pd_err *err) {
    pd_model *m = pd_calloc(1, sizeof *m);
    pd_st *st = NULL;
    loader L = {0};
    if (!m) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    m->backend = p->backend;
    m->wdt = pd_backend_weight_dtype(p->backend);
    m->adt = pd_backend_act_dtype(p->backend);
    m->kv_dtype = p->kv_dtype;
    if (pd_model_config_load(p->dir, &m->cfg, err)) goto fail;
    int n_full = m->cfg.n_layers;
    if (check_fixture(p, n_full, err)) goto fail;
    if (p->dummy_num_layers > 0) m->cfg.n_layers = p->dummy_num_layers;
    m->kv_row_bytes = pd_kv_row_bytes(p->backend, m->kv_dtype, m->cfg.n_kv_heads, m->cfg.head_dim);
    if (m->kv_dtype == PD_KV_FP8 && m->cfg.head_dim % 16) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "--kv-cache-dtype fp8 needs head_dim %% 16 == 0 (head_dim %d)", m->cfg.head_dim);
        goto fail;
    }
    m->layers = pd_calloc((size_t)m->cfg.n_layers, sizeof *m->layers);
    if (!m->layers) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (!p->dummy) {
        st = pd_st_open_dir(p->dir, err);
        if (!st) goto fail;
        for (int i = 0; i < pd_st_n_tensors(st); i++) L.total += pd_st_get(st, i)->n_bytes;
    }
    L.m = m;
    L.st = st;
    L.p = p;
    L.err = err;
    L.dummy_seed = p->seed;
    if (load_all(&L, n_full)) goto fail;
    pd_free(L.stage);
    pd_st_free(st);  // weights were copied/converted; the mapping can go
    return m;
fail:
    pd_free(L.stage);
    pd_st_free(st);
    pd_model_free(m);
    return NULL;
}

static void ws_free(pd_model_ws *ws) {
    pd_buffer *bufs[] = {ws->x, ws->h, ws->qkv, ws->attn, ws->gu, ws->mlp, ws->sel, ws->sel_add, ws->logits, ws->meta};
    for (size_t i = 0; i < PD_ARRAY_LEN(bufs); i++) pd_buffer_free(bufs[i]);
    pd_free(ws->meta_host);
    memset(ws, 0, sizeof *ws);
}

void pd_model_free(pd_model *m) {
    if (!m) return;
    if (m->layers) {
        for (int i = 0; i < m->cfg.n_layers; i++) {
            pd_layer_weights *w = &m->layers[i];
            pd_buffer *bufs[] = {w->attn_norm, w->wqkv, w->bqkv, w->wo, w->bo, w->mlp_norm, w->wgu, w->bgu, w->wdown, w->bdown};
            for (size_t j = 0; j < PD_ARRAY_LEN(bufs); j++) pd_buffer_free(bufs[j]);
        }
        pd_free(m->layers);
    }
    pd_buffer_free(m->embed);
    pd_buffer_free(m->final_norm);
    pd_buffer_free(m->lm_head);
    pd_buffer_free(m->inv_freq);
    pd_model_graphs_free(m);
    ws_free(&m->ws);
    pd_free(m);
}

const pd_model_config *pd_model_get_config(const pd_model *m) { return &m->cfg; }
pd_backend *pd_model_backend(const pd_model *m) { return m->backend; }
size_t pd_model_weight_bytes(const pd_model *m) { return m->weight_bytes; }
size_t pd_model_weight_bytes_read(const pd_model *m, int n_tokens) {
    if (m->cfg.tie_word_embeddings) return m->weight_bytes;  // the table is read whole, as lm_head
    size_t row = (size_t)m->cfg.hidden_size * pd_dtype_size(m->wdt);
    size_t rows = PD_MIN((size_t)n_tokens, (size_t)m->cfg.vocab_size);
    return m->weight_bytes - row * (size_t)m->cfg.vocab_size + row * rows;
}
pd_kv_dtype pd_model_kv_dtype(const pd_model *m) { return m->kv_dtype; }
size_t pd_model_kv_row_bytes(const pd_model *m) { return m->kv_row_bytes; }

static pd_model_cache *cache_new(pd_model *m, int n_blocks, int block_size, bool shared, pd_err *err) {
    if (n_blocks <= 0 || block_size <= 0) {
        pd_err_set(err, PD_ERR_INVALID, "KV cache needs n_blocks > 0 and block_size > 0");
        return NULL;
    }
    const pd_model_config *c = &m->cfg;
    pd_model_cache *kc = pd_calloc(1, sizeof *kc);
    if (!kc) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    kc->model = m;
    kc->n_blocks = n_blocks;
    kc->block_size = block_size;
    kc->block_bytes = (size_t)block_size * m->kv_row_bytes;
    size_t total = kc->block_bytes * (size_t)n_blocks * 2 * (size_t)c->n_layers;
    kc->buf = shared ? pd_buffer_alloc_shared(m->backend, total, err) : pd_buffer_alloc(m->backend, total);
    if (!kc->buf) {
        pd_err_set(err, PD_ERR_DEVICE, "out of device memory for a %zu-byte KV cache (%d blocks of %d tokens)", total, n_blocks,
                   block_size);
        pd_free(kc);
        return NULL;
    }
    // Zeroed so a stray read of an unwritten slot is deterministic (never NaN garbage).
    pd_backend_memset(m->backend, pd_buffer_ptr(kc->buf), 0, total);
    return kc;
}

pd_model_cache *pd_model_cache_new(pd_model *m, int n_blocks, int block_size, pd_err *err) {
    return cache_new(m, n_blocks, block_size, false, err);
}
pd_model_cache *pd_model_cache_new_shared(pd_model *m, int n_blocks, int block_size, pd_err *err) {
    return cache_new(m, n_blocks, block_size, true, err);
}

void pd_model_cache_free(pd_model_cache *c) {
    if (!c) return;
    pd_buffer_free(c->buf);
    pd_free(c);
}
int pd_model_cache_n_blocks(const pd_model_cache *c) { return c->n_blocks; }
int pd_model_cache_block_size(const pd_model_cache *c) { return c->block_size; }
size_t pd_model_cache_block_bytes(const pd_model_cache *c) { return c->block_bytes; }
pd_buffer *pd_model_cache_buffer(pd_model_cache *c) { return c->buf; }
void *pd_model_cache_k(pd_model_cache *c, int layer) {
    return (char *)pd_buffer_ptr(c->buf) + (size_t)(2 * layer) * c->block_bytes * (size_t)c->n_blocks;
}
void *pd_model_cache_v(pd_model_cache *c, int layer) {
    return (char *)pd_buffer_ptr(c->buf) + (size_t)(2 * layer + 1) * c->block_bytes * (size_t)c->n_blocks;
}
