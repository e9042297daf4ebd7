// wire/kv.c — see kv.h. Field encoders write little-endian scalars; the reader keeps a cursor and
// a failure flag, so a short or lying body fails once at the end instead of at every field.
#include "wire/kv.h"

#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "base/buf.h"

const char *pd_kvw_transport_name(pd_kvw_transport t) {
    switch (t) {
    case PD_KVW_TRANSPORT_TCP: return "tcp";
    case PD_KVW_TRANSPORT_SHM: return "shm";
    case PD_KVW_TRANSPORT_CUDA_IPC: return "cuda-ipc";
    case PD_KVW_TRANSPORT_NCCL: return "nccl";
    case PD_KVW_TRANSPORT_UCX: return "ucx";
    }
    return "unknown";
}

const char *pd_kvw_fingerprint_diff(const pd_kvw_fingerprint *a, const pd_kvw_fingerprint *b) {
    static __thread char buf[128];
#define CMP(f) if (a->f != b->f) { snprintf(buf, sizeof buf, #f " %llu != %llu", (unsigned long long)a->f, (unsigned long long)b->f); return buf; }
    CMP(arch) CMP(n_layers) CMP(n_heads) CMP(n_kv_heads) CMP(head_dim) CMP(hidden) CMP(vocab) CMP(kv_dtype)
    CMP(block_size) CMP(weights_hash)
#undef CMP
    return "";
}

bool pd_kvw_kv_nccl_valid(const pd_kvw_kv_nccl *s) {
    if (s->n_layers <= 0 || s->n_layers > PD_KVW_MAX_LAYERS || s->layer < 0 || s->layer >= s->n_layers ||
        s->n_blocks <= 0 || s->block_size <= 0 ||
        s->block_size > 4096 || s->n_rows_last <= 0 || s->n_rows_last > s->block_size || s->row_bytes == 0 ||
        s->row_bytes % 8 || s->row_bytes > (1u << 20))
        return false;
    // one layer's slab, within the payload cap (2 * n_blocks * block_size < 2^44: no overflow)
    uint64_t rows = 2u * (uint64_t)s->n_blocks * (uint64_t)s->block_size;
    return rows <= PD_KVW_MAX_PAYLOAD / s->row_bytes &&
           pd_kvw_kv_nccl_layer_bytes(s->n_blocks, s->block_size, s->row_bytes) == s->bytes;
}

uint64_t pd_kvw_kv_nccl_layer_bytes(int n_blocks, int block_size, uint64_t row_bytes) {
    return 2u * (uint64_t)n_blocks * (uint64_t)block_size * row_bytes;
}

void pd_kvw_kv_nccl_split(const pd_kvw_kv_nccl *s, void *base, void **k, void **v) {
    *k = base;
    *v = (char *)base + (size_t)s->n_blocks * (size_t)s->block_size * (size_t)s->row_bytes;
}

// ---- writer ------------------------------------------------------------------------------------
void pd_kvw_buf_fini(pd_kvw_buf *b) {
    pd_free(b->data);
    memset(b, 0, sizeof *b);
}
void pd_kvw_buf_reset(pd_kvw_buf *b) {
    b->len = 0;
    b->oom = false;
}

static void put(pd_kvw_buf *b, const void *p, size_t n) {
    if (b->oom) return;
    if (n > SIZE_MAX - b->len || PD_ARRAY_RESERVE(b->data, b->cap, b->len + n)) {
        b->oom = true;
        return;
    }
    memcpy(b->data + b->len, p, n);
    b->len += n;
}
static void put_u32(pd_kvw_buf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    put(b, x, 4);
}
static void put_u64(pd_kvw_buf *b, uint64_t v) {
    put_u32(b, (uint32_t)v);
    put_u32(b, (uint32_t)(v >> 32));
}
static void put_i32(pd_kvw_buf *b, int32_t v) { put_u32(b, (uint32_t)v); }
static void put_f32(pd_kvw_buf *b, float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    put_u32(b, u);
}
static void put_i32s(pd_kvw_buf *b, const int32_t *v, int n) {
    for (int i = 0; i < n; i++) put_i32(b, v[i]);
}
static void put_str(pd_kvw_buf *b, const char *s, size_t max) {
    size_t n = strnlen(s, max);
    put_u32(b, (uint32_t)n);
    put(b, s, n);
}

static void put_fp(pd_kvw_buf *b, const pd_kvw_fingerprint *f) {
    put_u32(b, f->arch), put_u32(b, f->n_layers), put_u32(b, f->n_heads), put_u32(b, f->n_kv_heads);
    put_u32(b, f->head_dim), put_u32(b, f->hidden), put_u32(b, f->vocab), put_u32(b, f->kv_dtype);
    put_u32(b, f->block_size), put_u64(b, f->weights_hash);
}

static void put_body(pd_kvw_buf *b, const pd_kvw_msg *m) {
    switch (m->type) {
    case PD_KVW_HELLO: {
        const pd_kvw_hello *h = &m->u.hello;
        put_fp(b, &h->fp);
        put_u32(b, h->transport), put_u32(b, h->pool_n_blocks), put_u32(b, h->handle_len);
        put(b, h->handle, PD_MIN(h->handle_len, sizeof h->handle));
        break;
    }
    case PD_KVW_HELLO_ACK:
        put_u32(b, m->u.hello_ack.ok);
        put_fp(b, &m->u.hello_ack.fp);
        put_str(b, m->u.hello_ack.error, sizeof m->u.hello_ack.error);
        break;
    case PD_KVW_PREFILL_REQ: {
        const pd_kvw_prefill_req *r = &m->u.prefill_req;
        const pd_kvw_sampling *s = &r->sampling;
        put_u64(b, r->req_id), put_i32(b, r->start_pos), put_i32(b, r->n_tokens);
        put_f32(b, s->temperature), put_f32(b, s->top_p), put_f32(b, s->min_p), put_f32(b, s->presence_penalty);
        put_f32(b, s->frequency_penalty), put_f32(b, s->repetition_penalty), put_i32(b, s->top_k);
        put_i32(b, s->n_logprobs), put_u64(b, s->seed), put_u32(b, s->has_seed);
        put_i32s(b, r->tokens, r->n_tokens);
        put_i32(b, r->n_dst_blocks);
        put_i32s(b, r->dst_blocks, r->n_dst_blocks);
        put_str(b, r->traceparent, sizeof r->traceparent);
        break;
    }
    case PD_KVW_KV_SLAB: {
        const pd_kvw_kv_slab *s = &m->u.kv_slab;
        put_u64(b, s->req_id), put_i32(b, s->layer), put_i32(b, s->n_blocks), put_i32(b, s->n_rows_last);
        put_u64(b, s->row_bytes);
        break;
    }
    case PD_KVW_KV_NCCL: {
        const pd_kvw_kv_nccl *s = &m->u.kv_nccl;
        put_u64(b, s->req_id), put_i32(b, s->layer), put_i32(b, s->n_layers), put_i32(b, s->n_blocks);
        put_i32(b, s->block_size);
        put_i32(b, s->n_rows_last), put_u64(b, s->row_bytes), put_u64(b, s->bytes);
        break;
    }
    case PD_KVW_PREFILL_DONE: {
        const pd_kvw_prefill_done *d = &m->u.done;
        put_u64(b, d->req_id), put_i32(b, d->first_token), put_f32(b, d->logprob), put_i32(b, d->n_top);
        for (int i = 0; i < d->n_top && i < PD_KVW_MAX_TOP; i++) put_i32(b, d->top_ids[i]), put_f32(b, d->top_logprobs[i]);
        put_i32(b, d->n_layers);
        for (int i = 0; i < d->n_layers && i < PD_KVW_MAX_LAYERS; i++) put_u64(b, d->checksums[i]);
        put_i32(b, d->n_tokens_computed);
        put_u64(b, d->n_draws);
        put_u64(b, (uint64_t)d->queue_us), put_u64(b, (uint64_t)d->compute_us);
        break;
    }
    case PD_KVW_PREFILL_FAIL:
        put_u64(b, m->u.fail.req_id);
        put_u32(b, m->u.fail.code);
        put_str(b, m->u.fail.reason, sizeof m->u.fail.reason);
        break;
    case PD_KVW_PING:
    case PD_KVW_PONG: put_u64(b, m->u.ping.nonce); break;
    case PD_KVW_CANCEL: put_u64(b, m->u.cancel.req_id); break;
    case PD_KVW_PROBE:
    case PD_KVW_PROBE_DATA:
        put_u64(b, m->u.probe.nonce);
        put_u32(b, m->u.probe.bytes);
        if (m->type == PD_KVW_PROBE_DATA)
            put_f32(b, m->u.probe.step_a_us), put_f32(b, m->u.probe.step_b_us), put_u32(b, m->u.probe.chunk_tokens);
        if (m->type == PD_KVW_PROBE_DATA && m->u.probe.bytes <= PD_KVW_PROBE_MAX && !b->oom) {  // filler
            if (PD_ARRAY_RESERVE(b->data, b->cap, b->len + m->u.probe.bytes)) {
                b->oom = true;
            } else {
                memset(b->data + b->len, 0x5a, m->u.probe.bytes);
                b->len += m->u.probe.bytes;
            }
        }
        break;
    case PD_KVW_AUTH_CHALLENGE: put(b, m->u.auth.nonce, PD_KVW_NONCE); break;
    case PD_KVW_AUTH_PROOF:
        put(b, m->u.auth.nonce, PD_KVW_NONCE);
        put(b, m->u.auth.mac, PD_KVW_MAC);
        break;
    case PD_KVW_AUTH_OK: put(b, m->u.auth.mac, PD_KVW_MAC); break;
    }
}

pd_status pd_kvw_encode(pd_kvw_buf *out, const pd_kvw_msg *m) {
    size_t start = out->len;
    uint8_t hdr[PD_KVW_HDR] = {0};
    put(out, hdr, sizeof hdr);
    put_body(out, m);
    if (out->oom) return PD_ERR_NOMEM;
    size_t body_len = out->len - start - PD_KVW_HDR;
    uint64_t payload = m->type == PD_KVW_KV_SLAB ? m->u.kv_slab.payload_len : 0;
    uint8_t *h = out->data + start;
    pd_kvw_buf hb = {0};
    put_u32(&hb, PD_KVW_MAGIC);
    uint8_t vt[4] = {PD_KVW_VERSION & 0xff, PD_KVW_VERSION >> 8, (uint8_t)m->type, (uint8_t)(m->type >> 8)};
    put(&hb, vt, 4);
    put_u32(&hb, (uint32_t)body_len);
    put_u32(&hb, XXH32(h + PD_KVW_HDR, body_len, 0));
    put_u64(&hb, payload);
    if (hb.oom) return PD_ERR_NOMEM;
    memcpy(h, hb.data, PD_KVW_HDR);
    pd_kvw_buf_fini(&hb);
    return PD_OK;
}

// ---- reader ------------------------------------------------------------------------------------
typedef struct rd {
    const uint8_t *p;
    size_t n, off;
    bool bad;
} rd;

static const uint8_t *take(rd *r, size_t n) {
    if (r->bad || n > r->n - r->off) {
        r->bad = true;
        return NULL;
    }
    const uint8_t *p = r->p + r->off;
    r->off += n;
    return p;
}
static uint32_t get_u32(rd *r) {
    const uint8_t *p = take(r, 4);
    return p ? (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24 : 0;
}
static uint64_t get_u64(rd *r) {
    uint64_t lo = get_u32(r);
    return lo | (uint64_t)get_u32(r) << 32;
}
static int32_t get_i32(rd *r) { return (int32_t)get_u32(r); }
static float get_f32(rd *r) {
    uint32_t u = get_u32(r);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static void get_str(rd *r, char *dst, size_t cap) {
    uint32_t n = get_u32(r);
    const uint8_t *p = take(r, n);
    size_t k = p ? PD_MIN((size_t)n, cap - 1) : 0;
    if (p) memcpy(dst, p, k);
    dst[k] = 0;
}
static void get_fp(rd *r, pd_kvw_fingerprint *f) {
    f->arch = get_u32(r), f->n_layers = get_u32(r), f->n_heads = get_u32(r), f->n_kv_heads = get_u32(r);
    f->head_dim = get_u32(r), f->hidden = get_u32(r), f->vocab = get_u32(r), f->kv_dtype = get_u32(r);
    f->block_size = get_u32(r), f->weights_hash = get_u64(r);
}
// Reads n int32s into an owned array (the frame may be unaligned).
static const int32_t *get_i32s(rd *r, int32_t n, pd_kvw_msg *m) {
    if (n < 0 || (size_t)n > (r->n - r->off) / 4) {
        r->bad = true;
        return NULL;
    }
    int32_t *a = pd_realloc(m->owned_i32, sizeof(int32_t) * (size_t)(n + 1));
    if (!a) {
        r->bad = true;
        return NULL;
    }
    m->owned_i32 = a;
    for (int i = 0; i < n; i++) a[i] = get_i32(r);
    return a;
}

uint32_t pd_kvw_max_body(pd_kvw_type t) {
    switch (t) {
    case PD_KVW_HELLO: return 60 + 16 + PD_KVW_HANDLE_MAX;
    case PD_KVW_HELLO_ACK: return 4 + 44 + 4 + 256;
    case PD_KVW_PREFILL_REQ: return PD_KVW_MAX_BODY;  // tokens + blocks: bounded by the body cap
    case PD_KVW_KV_SLAB: return 28;
    case PD_KVW_KV_NCCL: return 44;
    case PD_KVW_PREFILL_DONE: return 20 + 8 * PD_KVW_MAX_TOP + 4 + 8 * PD_KVW_MAX_LAYERS + 28;
    case PD_KVW_PREFILL_FAIL: return 16 + 256;
    case PD_KVW_PING:
    case PD_KVW_PONG:
    case PD_KVW_CANCEL: return 8;
    case PD_KVW_PROBE: return 12;
    case PD_KVW_PROBE_DATA: return 24 + PD_KVW_PROBE_MAX;
    case PD_KVW_AUTH_CHALLENGE: return PD_KVW_NONCE;
    case PD_KVW_AUTH_PROOF: return PD_KVW_NONCE + PD_KVW_MAC;
    case PD_KVW_AUTH_OK: return PD_KVW_MAC;
    }
    return 0;
}

pd_kvw_type pd_kvw_peek_type(const uint8_t *h) {
    if (!pd_kvw_peek_len(h)) return 0;
    return (pd_kvw_type)(h[6] | h[7] << 8);
}

uint64_t pd_kvw_peek_len(const uint8_t *h) {
    rd r = {h, PD_KVW_HDR, 0, false};
    uint32_t magic = get_u32(&r);
    const uint8_t *vt = take(&r, 4);
    uint32_t body = get_u32(&r);
    get_u32(&r);
    uint64_t payload = get_u64(&r);
    pd_kvw_type t = (pd_kvw_type)(vt[2] | vt[3] << 8);
    if (magic != PD_KVW_MAGIC || (vt[0] | vt[1] << 8) != PD_KVW_VERSION || body > pd_kvw_max_body(t) ||
        payload > PD_KVW_MAX_PAYLOAD || (payload && t != PD_KVW_KV_SLAB))
        return 0;
    return PD_KVW_HDR + (uint64_t)body + payload;
}

static pd_status decode_body(rd *r, pd_kvw_msg *m, uint64_t payload_len, const uint8_t *payload, pd_err *err) {
    switch (m->type) {
    case PD_KVW_HELLO: {
        pd_kvw_hello *h = &m->u.hello;
        get_fp(r, &h->fp);
        h->transport = get_u32(r), h->pool_n_blocks = get_u32(r), h->handle_len = get_u32(r);
        if (h->handle_len > sizeof h->handle) return pd_err_set(err, PD_ERR_PROTO, "HELLO: handle too long");
        const uint8_t *p = take(r, h->handle_len);
        if (p) memcpy(h->handle, p, h->handle_len);
        break;
    }
    case PD_KVW_HELLO_ACK:
        m->u.hello_ack.ok = get_u32(r);
        get_fp(r, &m->u.hello_ack.fp);
        get_str(r, m->u.hello_ack.error, sizeof m->u.hello_ack.error);
        break;
    case PD_KVW_PREFILL_REQ: {
        pd_kvw_prefill_req *q = &m->u.prefill_req;
        pd_kvw_sampling *s = &q->sampling;
        q->req_id = get_u64(r), q->start_pos = get_i32(r), q->n_tokens = get_i32(r);
        s->temperature = get_f32(r), s->top_p = get_f32(r), s->min_p = get_f32(r), s->presence_penalty = get_f32(r);
        s->frequency_penalty = get_f32(r), s->repetition_penalty = get_f32(r), s->top_k = get_i32(r);
        s->n_logprobs = get_i32(r), s->seed = get_u64(r), s->has_seed = get_u32(r);
        if (q->n_tokens <= 0 || q->start_pos < 0 || q->start_pos >= q->n_tokens)
            return pd_err_set(err, PD_ERR_PROTO, "PREFILL_REQ: bad span [%d, %d)", q->start_pos, q->n_tokens);
        const int32_t *toks = get_i32s(r, q->n_tokens, m);
        if (!toks) break;
        // tokens and blocks share one owned array: copy the tokens aside first.
        int32_t *all = pd_malloc(sizeof(int32_t) * (size_t)q->n_tokens);
        if (!all) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        memcpy(all, toks, sizeof(int32_t) * (size_t)q->n_tokens);
        q->n_dst_blocks = get_i32(r);
        const int32_t *blks = get_i32s(r, q->n_dst_blocks, m);
        if (!blks && q->n_dst_blocks) {
            pd_free(all);
            break;
        }
        int32_t *joined = pd_malloc(sizeof(int32_t) * (size_t)(q->n_tokens + q->n_dst_blocks + 1));
        if (!joined) {
            pd_free(all);
            return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        }
        memcpy(joined, all, sizeof(int32_t) * (size_t)q->n_tokens);
        if (q->n_dst_blocks) memcpy(joined + q->n_tokens, blks, sizeof(int32_t) * (size_t)q->n_dst_blocks);
        pd_free(all);
        pd_free(m->owned_i32);
        m->owned_i32 = joined;
        q->tokens = joined;
        q->dst_blocks = joined + q->n_tokens;
        get_str(r, q->traceparent, sizeof q->traceparent);
        break;
    }
    case PD_KVW_KV_SLAB: {
        pd_kvw_kv_slab *s = &m->u.kv_slab;
        s->req_id = get_u64(r), s->layer = get_i32(r), s->n_blocks = get_i32(r), s->n_rows_last = get_i32(r);
        s->row_bytes = get_u64(r);
        if (r->bad) break;
        if (s->layer < 0 || s->layer >= PD_KVW_MAX_LAYERS || s->n_blocks <= 0 || s->n_rows_last <= 0 || s->row_bytes == 0 ||
            s->row_bytes % 8)
            return pd_err_set(err, PD_ERR_PROTO, "KV_SLAB: bad geometry");
        s->payload = payload;
        s->payload_len = payload_len;
        break;
    }
    case PD_KVW_KV_NCCL: {
        pd_kvw_kv_nccl *s = &m->u.kv_nccl;
        s->req_id = get_u64(r), s->layer = get_i32(r), s->n_layers = get_i32(r), s->n_blocks = get_i32(r);
        s->block_size = get_i32(r);
        s->n_rows_last = get_i32(r), s->row_bytes = get_u64(r), s->bytes = get_u64(r);
        if (r->bad) break;
        if (!pd_kvw_kv_nccl_valid(s)) return pd_err_set(err, PD_ERR_PROTO, "KV_NCCL: bad geometry");
        break;
    }
    case PD_KVW_PREFILL_DONE: {
        pd_kvw_prefill_done *d = &m->u.done;
        d->req_id = get_u64(r), d->first_token = get_i32(r), d->logprob = get_f32(r), d->n_top = get_i32(r);
        if (d->n_top < 0 || d->n_top > PD_KVW_MAX_TOP) return pd_err_set(err, PD_ERR_PROTO, "PREFILL_DONE: bad n_top");
        for (int i = 0; i < d->n_top; i++) d->top_ids[i] = get_i32(r), d->top_logprobs[i] = get_f32(r);
        d->n_layers = get_i32(r);
        if (d->n_layers < 0 || d->n_layers > PD_KVW_MAX_LAYERS) return pd_err_set(err, PD_ERR_PROTO, "PREFILL_DONE: bad n_layers");
        for (int i = 0; i < d->n_layers; i++) d->checksums[i] = get_u64(r);
        d->n_tokens_computed = get_i32(r);
        d->n_draws = get_u64(r);
        d->queue_us = (int64_t)get_u64(r), d->compute_us = (int64_t)get_u64(r);
        if (d->queue_us < 0 || d->compute_us < 0) d->queue_us = d->compute_us = 0;  // only used for timings
        break;
    }
    case PD_KVW_PREFILL_FAIL:
        m->u.fail.req_id = get_u64(r);
        m->u.fail.code = get_u32(r);
        if (m->u.fail.code > PD_KVW_FAIL_POOL_REFUSED) m->u.fail.code = PD_KVW_FAIL_ERROR;  // unknown: a plain error
        get_str(r, m->u.fail.reason, sizeof m->u.fail.reason);
        break;
    case PD_KVW_PING:
    case PD_KVW_PONG: m->u.ping.nonce = get_u64(r); break;
    case PD_KVW_CANCEL: m->u.cancel.req_id = get_u64(r); break;
    case PD_KVW_PROBE:
    case PD_KVW_PROBE_DATA:
        m->u.probe.nonce = get_u64(r);
        m->u.probe.bytes = get_u32(r);
        if (m->u.probe.bytes > PD_KVW_PROBE_MAX || m->u.probe.bytes % 4) return pd_err_set(err, PD_ERR_PROTO, "PROBE: bad size");
        if (m->type == PD_KVW_PROBE_DATA) {
            m->u.probe.step_a_us = get_f32(r), m->u.probe.step_b_us = get_f32(r), m->u.probe.chunk_tokens = get_u32(r);
            if (!(m->u.probe.step_a_us < 1e9f) || !(m->u.probe.step_b_us < 1e9f)) m->u.probe.step_a_us = m->u.probe.step_b_us = -1;
            take(r, m->u.probe.bytes);
        }
        break;
    case PD_KVW_AUTH_CHALLENGE:
    case PD_KVW_AUTH_PROOF:
    case PD_KVW_AUTH_OK: {
        const uint8_t *p = m->type != PD_KVW_AUTH_OK ? take(r, PD_KVW_NONCE) : NULL;
        if (p) memcpy(m->u.auth.nonce, p, PD_KVW_NONCE);
        p = m->type != PD_KVW_AUTH_CHALLENGE ? take(r, PD_KVW_MAC) : NULL;
        if (p) memcpy(m->u.auth.mac, p, PD_KVW_MAC);
        break;
    }
    default: return pd_err_set(err, PD_ERR_PROTO, "unknown message type %d", (int)m->type);
    }
    if (r->bad) return pd_err_set(err, PD_ERR_PROTO, "message type %d: body too short", (int)m->type);
    if (r->off != r->n) return pd_err_set(err, PD_ERR_PROTO, "message type %d: %zu trailing bytes", (int)m->type, r->n - r->off);
    if (m->type != PD_KVW_KV_SLAB && payload_len) return pd_err_set(err, PD_ERR_PROTO, "unexpected payload");
    return PD_OK;
}

pd_status pd_kvw_decode(const uint8_t *buf, size_t len, pd_kvw_msg *m, size_t *consumed, pd_err *err) {
    memset(m, 0, sizeof *m);
    *consumed = 0;
    if (len < PD_KVW_HDR) return PD_AGAIN;
    rd h = {buf, PD_KVW_HDR, 0, false};
    uint32_t magic = get_u32(&h);
    uint32_t ver = get_u32(&h);
    uint32_t body_len = get_u32(&h), crc = get_u32(&h);
    uint64_t payload_len = get_u64(&h);
    if (magic != PD_KVW_MAGIC) return pd_err_set(err, PD_ERR_PROTO, "bad magic 0x%08x", magic);
    if ((ver & 0xffff) != PD_KVW_VERSION) return pd_err_set(err, PD_ERR_PROTO, "unsupported version %u", ver & 0xffff);
    if (body_len > PD_KVW_MAX_BODY || payload_len > PD_KVW_MAX_PAYLOAD) return pd_err_set(err, PD_ERR_PROTO, "frame too large");
    if (!pd_kvw_max_body((pd_kvw_type)(ver >> 16))) return pd_err_set(err, PD_ERR_PROTO, "unknown message type %u", ver >> 16);
    if (body_len > pd_kvw_max_body((pd_kvw_type)(ver >> 16)))
        return pd_err_set(err, PD_ERR_PROTO, "message type %u: body of %u bytes over its cap", ver >> 16, body_len);
    uint64_t total = PD_KVW_HDR + (uint64_t)body_len + payload_len;
    if (len < total) {
        *consumed = (size_t)total;
        return PD_AGAIN;
    }
    const uint8_t *body = buf + PD_KVW_HDR;
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION  // lets the fuzzer reach the field decoders
    if (XXH32(body, body_len, 0) != crc) return pd_err_set(err, PD_ERR_PROTO, "body checksum mismatch");
#else
    (void)crc;
#endif
    m->type = (pd_kvw_type)(ver >> 16);
    rd r = {body, body_len, 0, false};
    pd_status st = decode_body(&r, m, payload_len, body + body_len, err);
    if (st) {
        pd_kvw_msg_fini(m);
        return st;
    }
    *consumed = (size_t)total;
    return PD_OK;
}

void pd_kvw_msg_fini(pd_kvw_msg *m) {
    pd_free(m->owned_i32);
    m->owned_i32 = NULL;
}
