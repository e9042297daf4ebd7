// backend.c — inline-ish wrappers over the vtable, buffers, and the generic fallbacks for the
// optional methods.
#include "backend/backend_impl.h"

#include <math.h>
#include <string.h>

#include "base/checksum.h"
#include "kernels/sample_rng.h"

size_t pd_dtype_size(pd_dtype t) {
    switch (t) {
    case PD_DTYPE_F32: return 4;
    case PD_DTYPE_I32: return 4;
    case PD_DTYPE_F16: return 2;
    case PD_DTYPE_BF16: return 2;
    case PD_DTYPE_FP8_E4M3: return 1;
    }
    return 0;
}

const char *pd_dtype_name(pd_dtype t) {
    switch (t) {
    case PD_DTYPE_F32: return "float32";
    case PD_DTYPE_I32: return "int32";
    case PD_DTYPE_F16: return "float16";
    case PD_DTYPE_BF16: return "bfloat16";
    case PD_DTYPE_FP8_E4M3: return "float8_e4m3fn";
    }
    return "unknown";
}

uint8_t pd_fp8_e4m3_from_f32(float x) {
    if (isnan(x)) return 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0;
    float a = fabsf(x);
    if (a >= 464.0f) return sign | 0x7e;  // saturate (464 is the midpoint of 448 and the next step, 480)
    if (a < 0.015625f) {                  // below 2^-6: subnormal, steps of 2^-9
        int m = (int)nearbyintf(a * 512.0f);  // 0..8 (8 is the smallest normal, 0x08)
        return sign | (uint8_t)m;
    }
    int e;
    float f = frexpf(a, &e);  // a = f * 2^e, f in [0.5, 1)
    int m = (int)nearbyintf((f * 2.0f - 1.0f) * 8.0f);  // mantissa steps of 1/8, ties to even
    int be = e - 1 + 7;
    if (m == 8) m = 0, be++;
    if (be > 15 || (be == 15 && m > 6)) return sign | 0x7e;
    return sign | (uint8_t)(be << 3) | (uint8_t)m;
}

float pd_fp8_e4m3_to_f32(uint8_t v) {
    int e = (v >> 3) & 15, m = v & 7;
    float a;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) a = ldexpf((float)m, -9);
    else a = ldexpf(1.0f + (float)m / 8.0f, e - 7);
    return (v & 0x80) ? -a : a;
}

size_t pd_kv_row_bytes(pd_backend *b, pd_kv_dtype t, int n_kv_heads, int head_dim) {
    size_t n = (size_t)n_kv_heads * (size_t)head_dim;
    if (t == PD_KV_FP8) return (n + 4 * (size_t)n_kv_heads + 15) / 16 * 16;
    return n * pd_dtype_size(b->iface->act_dtype);
}

bool pd_kv_dtype_parse(const char *s, pd_kv_dtype *out) {
    if (!strcmp(s, "auto") || !strcmp(s, "bf16") || !strcmp(s, "bfloat16") || !strcmp(s, "float32")) *out = PD_KV_ACT;
    else if (!strcmp(s, "fp8") || !strcmp(s, "fp8_e4m3")) *out = PD_KV_FP8;
    else return false;
    return true;
}

const char *pd_kv_dtype_name(pd_kv_dtype t) { return t == PD_KV_FP8 ? "fp8_e4m3" : "auto"; }

void pd_backend_free(pd_backend *b) {
    if (b) b->iface->free(b);
}
const char *pd_backend_name(pd_backend *b) { return b->iface->name; }
const char *pd_backend_device_name(pd_backend *b) {
    return b->iface->device_name ? b->iface->device_name(b) : b->iface->name;
}
pd_dtype pd_backend_weight_dtype(pd_backend *b) { return b->iface->weight_dtype; }
pd_dtype pd_backend_act_dtype(pd_backend *b) { return b->iface->act_dtype; }
void pd_backend_mem_info(pd_backend *b, size_t *f, size_t *t) { b->iface->mem_info(b, f, t); }

pd_buffer *pd_buffer_alloc(pd_backend *b, size_t n_bytes) {
    pd_buffer *buf = pd_calloc(1, sizeof *buf);
    if (!buf) return NULL;
    buf->backend = b;
    buf->n_bytes = n_bytes;
    buf->ptr = b->iface->dev_alloc(b, n_bytes ? n_bytes : 1);
    if (!buf->ptr) {
        PD_LOG_E("%s: failed to allocate %zu bytes of device memory", b->iface->name, n_bytes);
        pd_free(buf);
        return NULL;
    }
    return buf;
}
void pd_buffer_free(pd_buffer *buf) {
    if (!buf) return;
    if (buf->is_shared) buf->backend->iface->dev_free_shared(buf->backend, buf->ptr, &buf->handle);
    else buf->backend->iface->dev_free(buf->backend, buf->ptr);
    pd_free(buf);
}

pd_buffer *pd_buffer_alloc_shared(pd_backend *b, size_t n_bytes, pd_err *err) {
    if (!b->iface->dev_alloc_shared) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "the %s backend cannot share buffers between processes", b->iface->name);
        return NULL;
    }
    pd_buffer *buf = pd_calloc(1, sizeof *buf);
    if (!buf) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    buf->backend = b;
    buf->n_bytes = n_bytes;
    buf->is_shared = true;
    buf->ptr = b->iface->dev_alloc_shared(b, n_bytes ? n_bytes : 1, &buf->handle, err);
    if (!buf->ptr) {
        pd_free(buf);
        return NULL;
    }
    return buf;
}

pd_status pd_buffer_export(pd_buffer *buf, pd_buffer_handle *out) {
    if (!buf->is_shared) return PD_ERR_UNSUPPORTED;
    *out = buf->handle;
    return PD_OK;
}

void *pd_backend_import(pd_backend *b, const pd_buffer_handle *h, pd_err *err) {
    if (!b->iface->import) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "the %s backend cannot import buffers", b->iface->name);
        return NULL;
    }
    return b->iface->import(b, h, err);
}

void pd_backend_unimport(pd_backend *b, void *p, const pd_buffer_handle *h) {
    if (p && b->iface->unimport) b->iface->unimport(b, p, h);
}

void pd_op_kv_copy(pd_backend *b, const pd_kv_copy_params *p) {
    if (b->iface->kv_copy) {
        b->iface->kv_copy(b, p);
        return;
    }
    size_t bb = p->row_bytes * (size_t)p->block_size;
    for (int l = p->layer_begin; l < p->layer_end; l++)
        for (int i = 0; i < p->n_blocks; i++) {
            size_t n = p->row_bytes * (size_t)p->n_rows[i];
            size_t so = (size_t)p->src_blocks[i] * bb, dof = (size_t)p->dst_blocks[i] * bb;
            b->iface->copy_d2d(b, (char *)p->dst_k[l] + dof, (char *)p->src_k[l] + so, n);
            b->iface->copy_d2d(b, (char *)p->dst_v[l] + dof, (char *)p->src_v[l] + so, n);
        }
}

void *pd_backend_host_alloc(pd_backend *b, size_t n) {
    if (!n) return NULL;
    return b->iface->host_alloc ? b->iface->host_alloc(b, n) : pd_malloc(n);
}

void pd_backend_host_free(pd_backend *b, void *p) {
    if (!p) return;
    if (b->iface->host_free) b->iface->host_free(b, p);
    else pd_free(p);
}

bool pd_backend_host_is_pinned(pd_backend *b) { return b->iface->host_alloc != NULL; }

bool pd_backend_has_xfer_stream(pd_backend *b) { return b->iface->kv_copy_xfer != NULL; }

void pd_backend_xfer_mark(pd_backend *b) {
    if (b->iface->xfer_mark) b->iface->xfer_mark(b);
}

void pd_op_kv_copy_xfer(pd_backend *b, const pd_kv_copy_params *p) {
    if (b->iface->kv_copy_xfer) b->iface->kv_copy_xfer(b, p);
    else pd_op_kv_copy(b, p);
}

void pd_op_kv_checksum_xfer(pd_backend *b, const pd_kv_checksum_params *p) {
    if (b->iface->kv_checksum_xfer) b->iface->kv_checksum_xfer(b, p);
    else pd_op_kv_checksum(b, p);
}

void pd_backend_xfer_sync(pd_backend *b) {
    if (b->iface->xfer_sync) b->iface->xfer_sync(b);
    else pd_backend_sync(b);
}

uint64_t pd_backend_xfer_fence(pd_backend *b) { return b->iface->xfer_fence ? b->iface->xfer_fence(b) : 0; }

bool pd_backend_xfer_fence_done(pd_backend *b, uint64_t fence) {
    return b->iface->xfer_fence_done ? b->iface->xfer_fence_done(b, fence) : true;
}

void pd_backend_xfer_layer_ready(pd_backend *b, int layer) {
    PD_ASSERT(layer >= 0);
    if (b->iface->xfer_layer_ready) b->iface->xfer_layer_ready(b, layer);
}

void pd_backend_xfer_layer_wait(pd_backend *b, int layer) {
    PD_ASSERT(layer >= 0);
    if (b->iface->xfer_layer_wait) b->iface->xfer_layer_wait(b, layer);
}

uint64_t pd_backend_xfer_fence_host(pd_backend *b) {
    return b->iface->xfer_fence_host ? b->iface->xfer_fence_host(b) : pd_backend_xfer_fence(b);
}

// Generic checksum: bring each run to the host (free on the CPU backend, where download is a
// memcpy) and hash it there.
void pd_op_kv_checksum(pd_backend *b, const pd_kv_checksum_params *p) {
    if (b->iface->kv_checksum) {
        b->iface->kv_checksum(b, p);
        return;
    }
    size_t bb = p->row_bytes * (size_t)p->block_size;
    unsigned char *tmp = pd_malloc(bb);
    PD_ASSERT(tmp);
    for (int l = p->layer_begin; l < p->layer_end; l++) {
        uint64_t sum = 0, g = 0;
        for (int kv = 0; kv < 2; kv++) {
            void *const *base = kv ? p->v : p->k;
            for (int i = 0; i < p->n_blocks; i++) {
                size_t n = p->row_bytes * (size_t)p->n_rows[i];
                b->iface->download(b, tmp, (char *)base[l] + (size_t)p->blocks[i] * bb, n);
                pd_checksum_run(&sum, &g, tmp, n);
            }
        }
        p->sums[l - p->layer_begin] = sum;
    }
    pd_free(tmp);
}
void *pd_buffer_ptr(pd_buffer *buf) { return buf->ptr; }
size_t pd_buffer_size(pd_buffer *buf) { return buf->n_bytes; }

bool pd_buffer_reserve(pd_backend *b, pd_buffer **buf, size_t n_bytes) {
    if (*buf && (*buf)->n_bytes >= n_bytes) return true;
    pd_buffer_free(*buf);
    *buf = pd_buffer_alloc(b, n_bytes);
    return *buf != NULL;
}

void pd_backend_upload(pd_backend *b, void *d, const void *s, size_t n) {
    if (!n) return;
    int pi = pd_backend_prof_op_begin(b, 0, "upload %zu B", n);
    b->iface->upload(b, d, s, n);
    pd_backend_prof_op_end(b, pi);
}
void pd_backend_download(pd_backend *b, void *d, const void *s, size_t n) { if (n) b->iface->download(b, d, s, n); }
void pd_backend_memset(pd_backend *b, void *d, int v, size_t n) { if (n) b->iface->memset(b, d, v, n); }
void pd_backend_sync(pd_backend *b) { b->iface->sync(b); }
void pd_backend_bind_thread(pd_backend *b) {
    if (b->iface->bind_thread) b->iface->bind_thread(b);
}

// Every op below is bracketed for the op profiler (prof.c; a call and a branch when none runs).
void pd_op_embed(pd_backend *b, const pd_embed_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "embed T=%d", p->n_tokens);
    b->iface->embed(b, p);
    pd_backend_prof_op_end(b, pi);
}
void pd_op_rmsnorm(pd_backend *b, const pd_rmsnorm_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "rmsnorm%s rows=%d", p->add ? "+add" : "", p->n_rows);
    b->iface->rmsnorm(b, p);
    pd_backend_prof_op_end(b, pi);
}
void pd_op_matmul(pd_backend *b, const pd_matmul_params *p) {
    PD_ASSERT(!p->glu || (!p->accumulate && !p->residual && !p->out_f32));
    PD_ASSERT(!p->residual || (!p->accumulate && !p->out_f32));
    PD_ASSERT(!p->norm_w || !p->lda || p->lda == p->K);
    PD_ASSERT(!p->rope || (!p->glu && !p->residual && !p->accumulate && !p->out_f32 && p->rope->qkv == p->out &&
                           p->rope->n_tokens == p->M &&
                           p->N == (p->rope->n_heads + 2 * p->rope->n_kv_heads) * p->rope->head_dim));
    int pi = pd_backend_prof_op_begin(b, 2.0 * p->M * (double)p->N * p->K, "matmul M=%d N=%d K=%d%s%s%s%s%s%s", p->M, p->N,
                                      p->K, p->accumulate ? " acc" : "", p->out_f32 ? " f32" : "", p->norm_w ? " norm" : "",
                                      p->glu ? " glu" : "", p->residual ? " res" : "", p->rope ? " rope" : "");
    b->iface->matmul(b, p);
    pd_backend_prof_op_end(b, pi);
}
bool pd_backend_fuses_matmul(pd_backend *b, int M) { return b->iface->fuses_matmul && b->iface->fuses_matmul(b, M); }
bool pd_backend_fuses_epilogues(pd_backend *b, int M) { return b->iface->fuses_epilogues && b->iface->fuses_epilogues(b, M); }
void pd_op_rope_kv(pd_backend *b, const pd_rope_kv_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "rope_kv T=%d", p->n_tokens);
    b->iface->rope_kv(b, p);
    pd_backend_prof_op_end(b, pi);
}
void pd_op_attention(pd_backend *b, const pd_attention_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "attention T=%d seqs=%d max_q=%d max_kv=%d", p->n_tokens, p->n_seqs,
                                      p->max_q_len, p->max_kv_len);
    b->iface->attention(b, p);
    pd_backend_prof_op_end(b, pi);
}
void pd_op_silu_mul(pd_backend *b, const pd_silu_mul_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "silu_mul rows=%d", p->n_rows);
    b->iface->silu_mul(b, p);
    pd_backend_prof_op_end(b, pi);
}
void pd_op_get_rows(pd_backend *b, const pd_get_rows_params *p) {
    int pi = pd_backend_prof_op_begin(b, 0, "get_rows rows=%d", p->n_rows);
    b->iface->get_rows(b, p);
    pd_backend_prof_op_end(b, pi);
}

void pd_op_copy_blocks(pd_backend *b, const pd_copy_blocks_params *p) {
    if (b->iface->copy_blocks) {
        b->iface->copy_blocks(b, p);
        return;
    }
    for (int l = 0; l < p->n_layers; l++) {
        for (int i = 0; i < p->n; i++) {
            size_t so = (size_t)p->src_blocks[i] * p->block_bytes, dof = (size_t)p->dst_blocks[i] * p->block_bytes;
            b->iface->copy_d2d(b, (char *)p->k_caches[l] + dof, (char *)p->k_caches[l] + so, p->block_bytes);
            b->iface->copy_d2d(b, (char *)p->v_caches[l] + dof, (char *)p->v_caches[l] + so, p->block_bytes);
        }
    }
}

bool pd_backend_has_graphs(pd_backend *b) { return b->iface->graph_begin != NULL; }
bool pd_backend_has_timer(pd_backend *b) { return b->iface->timer_mark != NULL; }
void pd_backend_timer_mark(pd_backend *b, int i) {
    if (b->iface->timer_mark && i >= 0 && i < PD_BACKEND_TIMERS) b->iface->timer_mark(b, i);
}
float pd_backend_timer_ms(pd_backend *b, int i, int j) {
    if (!b->iface->timer_ms || i < 0 || j < 0 || i >= PD_BACKEND_TIMERS || j >= PD_BACKEND_TIMERS) return -1.0f;
    return b->iface->timer_ms(b, i, j);
}
void pd_backend_graph_begin(pd_backend *b) {
    PD_ASSERT(b->iface->graph_begin);
    b->iface->graph_begin(b);
}
pd_graph *pd_backend_graph_end(pd_backend *b) { return (pd_graph *)b->iface->graph_end(b); }
bool pd_backend_graph_launch(pd_backend *b, pd_graph *g) { return b->iface->graph_launch(b, g); }
void pd_backend_graph_free(pd_backend *b, pd_graph *g) {
    if (g) b->iface->graph_free(b, g);
}

void pd_op_fill_normal(pd_backend *b, void *dst, pd_dtype dtype, size_t n, uint64_t seed, float mean, float std) {
    if (n) b->iface->fill_normal(b, dst, dtype, n, seed, mean, std);
}

bool pd_backend_has_sample(pd_backend *b) { return b->iface->sample != NULL; }
void pd_op_sample(pd_backend *b, const pd_sample_params *p) {
    PD_ASSERT(b->iface->sample);
    if (p->n_rows > 0) b->iface->sample(b, p);
}
double pd_sample_uniform(uint64_t seed, uint64_t draw_idx) { return pd_sample_uniform_of(seed, draw_idx); }

// ---- device messaging --------------------------------------------------------------------------
struct pd_comm {
    pd_backend *b;  // borrowed
    void *impl;     // the backend's communicator
};

pd_status pd_comm_id_new(pd_backend *b, pd_comm_id *out, pd_err *err) {
    if (!b->iface->comm_id_new)
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "the %s backend has no device-to-device transport (nccl needs cuda)",
                          b->iface->name);
    return b->iface->comm_id_new(b, out, err);
}

pd_comm *pd_comm_new(pd_backend *b, const pd_comm_id *id, int n_ranks, int rank, int timeout_ms, pd_err *err) {
    if (!b->iface->comm_new) {
        pd_err_set(err, PD_ERR_UNSUPPORTED, "the %s backend has no device-to-device transport", b->iface->name);
        return NULL;
    }
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks) {
        pd_err_set(err, PD_ERR_INVALID, "comm: rank %d of %d", rank, n_ranks);
        return NULL;
    }
    pd_comm *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->b = b;
    c->impl = b->iface->comm_new(b, id, n_ranks, rank, timeout_ms, err);
    if (!c->impl) {
        pd_free(c);
        return NULL;
    }
    return c;
}

void pd_comm_free(pd_comm *c) {
    if (!c) return;
    c->b->iface->comm_free(c->b, c->impl);
    pd_free(c);
}

pd_status pd_comm_send(pd_comm *c, const void *buf, size_t n, int peer, pd_err *err) {
    return c->b->iface->comm_post(c->b, c->impl, (void *)buf, n, peer, PD_COMM_OP_SEND, err);
}
pd_status pd_comm_send_after_xfer(pd_comm *c, const void *buf, size_t n, int peer, pd_err *err) {
    int op = c->b->iface->kv_copy_xfer ? PD_COMM_OP_SEND_XFER : PD_COMM_OP_SEND;
    return c->b->iface->comm_post(c->b, c->impl, (void *)buf, n, peer, op, err);
}
pd_status pd_comm_recv(pd_comm *c, void *buf, size_t n, int peer, pd_err *err) {
    return c->b->iface->comm_post(c->b, c->impl, buf, n, peer, PD_COMM_OP_RECV, err);
}
void pd_comm_kv_copy(pd_comm *c, const pd_kv_copy_params *p) { c->b->iface->comm_kv_copy(c->b, c->impl, p); }
pd_status pd_comm_wait(pd_comm *c, int timeout_ms, pd_err *err) {
    return c->b->iface->comm_wait(c->b, c->impl, timeout_ms, err);
}
