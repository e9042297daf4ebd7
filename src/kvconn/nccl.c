// nccl.c — the nccl KV transport (GPU to GPU, any host), layer-wise: when layer l of the forward
// pass is computed (the layer hook), its K and V rows of the request are gathered into layer l's
// one-layer slab (wire/kv.h KV_NCCL layout) on the backend's transfer stream, after an event on
// the compute stream (pd_backend_xfer_mark, as cuda-ipc), together with the layer's checksum from
// the same source rows; then the slab is announced on the socket (KV_NCCL) and its ncclSend is
// posted on the connection's communicator stream, ordered after the transfer stream. Nothing
// waits: layer l travels while layer l+1 computes. The decode side's I/O thread posts one receive
// per announcement and scatters each layer into the reserved blocks (xfer). At the end of the
// step, save_rest ships the layers not yet shipped (all of them with PD_KV_OVERLAP=0), then waits
// for the transfer stream (the checksums) and for every posted send, bounded by the load timeout:
// a peer that does not receive in time aborts the communicator (ncclCommAbort) and closes the
// connection.
//
// Staging: each save owns a slab of n_layers one-layer slabs (layer l's at l * layer_bytes), taken
// from the connector's small pool of device buffers and given back only when none of its sends
// can still read it (they completed, or the communicator was aborted).
#include "kvconn/kvconn_impl.h"

#include <string.h>

pd_buffer *kvc_stage_take(pd_backend *b, kvc_stage_pool *pool, size_t bytes, size_t *cap) {
    int best = -1;  // the smallest free buffer that is large enough, else the largest (grown)
    for (int i = 0; i < pool->n_free; i++) {
        size_t sz = pool->sizes[i];
        if (best < 0) best = i;
        else if (sz >= bytes && (pool->sizes[best] < bytes || sz < pool->sizes[best])) best = i;
        else if (sz < bytes && pool->sizes[best] < bytes && sz > pool->sizes[best]) best = i;
    }
    pd_buffer *buf = NULL;
    size_t have = 0;
    if (best >= 0) {
        buf = pool->free[best];
        have = pool->sizes[best];
        pool->n_free--;
        pool->free[best] = pool->free[pool->n_free];
        pool->sizes[best] = pool->sizes[pool->n_free];
    }
    if (have < bytes) {
        pd_buffer_free(buf);  // (a growing buffer keeps nothing: a fresh allocation)
        buf = pd_buffer_alloc(b, bytes);
        have = bytes;
    }
    *cap = buf ? have : 0;
    return buf;
}

void kvc_stage_give(kvc_stage_pool *pool, pd_buffer *buf, size_t bytes) {
    if (!buf) return;
    if (pool->n_free == KVC_STAGE_POOL_MAX) {  // full: drop the smallest (this one, or a kept one)
        int small = 0;
        for (int i = 1; i < pool->n_free; i++)
            if (pool->sizes[i] < pool->sizes[small]) small = i;
        if (pool->sizes[small] >= bytes) {
            pd_buffer_free(buf);
            return;
        }
        pd_buffer_free(pool->free[small]);
        pool->free[small] = buf;
        pool->sizes[small] = bytes;
        return;
    }
    pool->free[pool->n_free] = buf;
    pool->sizes[pool->n_free++] = bytes;
}

void kvc_stage_fini(kvc_stage_pool *pool) {
    for (int i = 0; i < pool->n_free; i++) pd_buffer_free(pool->free[i]);
    pool->n_free = 0;
}

uint64_t kvc_nccl_layer_bytes(const pd_kvconn *c, const pd_kvconn_save *s) {
    const pd_kvconn_cache *k = &c->p.cache;
    return pd_kvw_kv_nccl_layer_bytes(s->n_blocks, k->block_size, k->row_bytes);
}

void kvc_nccl_header(const pd_kvconn *c, const pd_kvconn_save *s, int l, pd_kvw_kv_nccl *h) {
    const pd_kvconn_cache *k = &c->p.cache;
    *h = (pd_kvw_kv_nccl){.req_id = s->peer_req_id, .layer = l, .n_layers = k->n_layers, .n_blocks = s->n_blocks,
                          .block_size = k->block_size, .n_rows_last = s->rows[s->n_blocks - 1],
                          .row_bytes = k->row_bytes, .bytes = kvc_nccl_layer_bytes(c, s)};
}

void kvc_nccl_gather(pd_kvconn *c, pd_kvconn_save *s, int l, void *slab) {
    const pd_kvconn_cache *k = &c->p.cache;
    int nb = s->n_blocks;
    pd_kvw_kv_nccl h;
    kvc_nccl_header(c, s, l, &h);
    void **dk = s->dk, **dv = s->dv;  // (n_layers) slab bases; only [l] is read by a one-layer copy
    pd_kvw_kv_nccl_split(&h, slab, &dk[l], &dv[l]);
    int32_t *idx = s->dst_slab;  // slab block i = the request's i-th block
    pd_kv_copy_params kp = {.src_k = k->k, .src_v = k->v, .dst_k = dk, .dst_v = dv, .src_blocks = s->src,
                            .dst_blocks = idx, .n_rows = s->rows, .n_blocks = nb, .layer_begin = l,
                            .layer_end = l + 1, .block_size = k->block_size, .row_bytes = k->row_bytes};
    pd_op_kv_copy_xfer(c->p.backend, &kp);
    pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = s->src, .n_rows = s->rows, .n_blocks = nb,
                                .layer_begin = l, .layer_end = l + 1, .block_size = k->block_size,
                                .row_bytes = k->row_bytes, .sums = s->sums + l};
    pd_op_kv_checksum_xfer(c->p.backend, &cp);  // same stream: from the same source rows
}

// Per-save state, made at the first layer: the staging slab and the layer-base arrays.
static bool nccl_save_prepare(pd_kvconn *c, pd_kvconn_save *s) {
    if (s->stage) return true;
    int L = c->p.cache.n_layers;
    size_t need = (size_t)kvc_nccl_layer_bytes(c, s) * (size_t)L;
    s->dk = pd_calloc((size_t)L, sizeof(void *));
    s->dv = pd_calloc((size_t)L, sizeof(void *));
    s->dst_slab = pd_malloc(sizeof(int32_t) * (size_t)s->n_blocks);
    if (s->dk && s->dv && s->dst_slab) s->stage = kvc_stage_take(c->p.backend, &c->nccl_stage, need, &s->stage_bytes);
    if (!s->stage) {
        s->st = PD_ERR_NOMEM;
        PD_LOG_W("kvconn: request %llu: no device memory for a %zu-byte nccl staging slab",
                 (unsigned long long)s->peer_req_id, need);
        return false;
    }
    for (int i = 0; i < s->n_blocks; i++) s->dst_slab[i] = i;
    return true;
}

static void nccl_save_layer(pd_kvconn *c, pd_kvconn_save *s, int l) {
    const pd_kvconn_cache *k = &c->p.cache;
    if (!nccl_save_prepare(c, s)) return;
    if (c->is_mark_due) {  // after layer l's KV write on the compute stream (bounded run-ahead)
        pd_backend_xfer_mark(c->p.backend);
        c->is_mark_due = false;
    }
    int64_t t0 = pd_time_us();
    char *slab = (char *)pd_buffer_ptr(s->stage) + (size_t)l * (size_t)kvc_nccl_layer_bytes(c, s);
    kvc_nccl_gather(c, s, l, slab);
    s->is_xfer_pending = true;
    if (s->is_corrupt && l == k->n_layers - 1) {  // test hook: flip one bit of the last layer's V rows in the slab
        pd_backend_xfer_sync(c->p.backend);
        uint8_t x;
        char *at = (char *)s->dv[l];
        pd_backend_download(c->p.backend, &x, at, 1);
        x ^= 0x40;
        pd_backend_upload(c->p.backend, at, &x, 1);
        pd_backend_sync(c->p.backend);
    }
    pd_kvw_kv_nccl h;
    kvc_nccl_header(c, s, l, &h);
    pd_err err = {0};
    s->st = pd_xfer_server_nccl_post(c->xs, s->conn_id, &h, slab, &err);
    if (!s->st) s->n_sends++;
    else PD_LOG_W("kvconn: request %llu: nccl layer %d: %s", (unsigned long long)s->peer_req_id, l, err.msg);
    s->copy_us += pd_time_us() - t0;
    if (l == k->n_layers / 2) kvc_debug_pause(c, "mid_slab");
}

// Waits for this save's sends (and whatever was posted before them on the connection).
static pd_status nccl_wait_sends(pd_kvconn *c, pd_kvconn_save *s) {
    if (!s->n_sends) return PD_OK;
    pd_err err = {0};
    pd_status st = pd_xfer_server_nccl_wait(c->xs, s->conn_id, c->p.timeout_ms, &err);
    s->n_sends = 0;  // completed, or the communicator is aborted (nothing reads the slab any more)
    if (st && st != PD_ERR_CLOSED)
        PD_LOG_W("kvconn: request %llu: nccl KV export failed: %s", (unsigned long long)s->peer_req_id, err.msg);
    return st;
}

static pd_status nccl_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    int L = c->p.cache.n_layers;
    if (s->n_layers_saved < L) c->is_mark_due = true;  // the forward pass is over: depend on all of it
    for (int l = s->n_layers_saved; l < L && !s->st; l++) {
        nccl_save_layer(c, s, l);
        if (!s->st) s->n_layers_saved = l + 1;
    }
    int64_t t0 = pd_time_us();
    if (s->is_xfer_pending) pd_backend_xfer_sync(c->p.backend);  // the gathers ran, s->sums filled
    s->is_xfer_pending = false;
    pd_status st = nccl_wait_sends(c, s);
    if (!s->st) s->st = st;
    s->copy_us += pd_time_us() - t0;
    return s->st;
}

// The save ends (done or failed): its staging goes back to the pool once nothing can read it.
static void nccl_save_free(pd_kvconn *c, pd_kvconn_save *s) {
    if (s->is_xfer_pending) pd_backend_xfer_sync(c->p.backend);
    s->is_xfer_pending = false;
    // Sends still posted (a failed step, an abort): wait for them (bounded). If the connection is
    // gone, closing it freed its communicator, which aborted them: the slab is free either way.
    nccl_wait_sends(c, s);
    if (s->stage) kvc_stage_give(&c->nccl_stage, s->stage, s->stage_bytes);
    s->stage = NULL;
    pd_free(s->dst_slab);
    s->dst_slab = NULL;
}

// Decode role: nothing to export (the communicator is made per connection), but the backend must
// be able to make one.
static pd_status nccl_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err) {
    (void)h;
    return pd_comm_id_new(c->p.backend, NULL, err);
}

static void nccl_fini(pd_kvconn *c) { kvc_stage_fini(&c->nccl_stage); }

const kvc_transport kvc_nccl = {
    .id = PD_KVW_TRANSPORT_NCCL,
    .name = "nccl",
    .is_layerwise = true,
    .export_pool = nccl_export,
    .save_layer = nccl_save_layer,
    .save_rest = nccl_save_rest,
    .save_free = nccl_save_free,
    .fini = nccl_fini,
};
