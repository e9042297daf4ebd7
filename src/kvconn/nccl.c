// nccl.c — the nccl KV transport (GPU to GPU, any host): the request's rows are gathered into one
// staging slab on the compute stream (laid out like a cache of n_blocks blocks, wire/kv.h
// KV_NCCL), announced on the socket and sent with ncclSend on the connection's communicator; the
// decode side's I/O thread receives it and scatters it into the reserved blocks. Not layer-wise:
// one slab per request, after the forward pass (the prefill engine thread waits for the send,
// bounded by the load timeout).
#include "kvconn/kvconn_impl.h"

typedef struct gather_ctx {
    pd_kvconn *c;
    pd_kvconn_save *s;
    const pd_kvw_kv_nccl *slab;
} gather_ctx;

// Runs on the compute stream; the send waits for it on the device.
static void gather_slab(void *ud, void *dev) {
    gather_ctx *g = ud;
    const pd_kvconn_cache *k = &g->c->p.cache;
    const pd_kvw_kv_nccl *s = g->slab;
    int L = s->n_layers, nb = s->n_blocks;
    void **dk = pd_malloc(sizeof(void *) * 2 * (size_t)L);
    int32_t *idx = pd_malloc(sizeof(int32_t) * (size_t)nb);
    PD_ASSERT(dk && idx);
    pd_kvw_kv_nccl_layers(s, dev, dk, dk + L);
    for (int i = 0; i < nb; i++) idx[i] = i;
    pd_kv_copy_params kp = {.src_k = k->k, .src_v = k->v, .dst_k = dk, .dst_v = dk + L, .src_blocks = g->s->src,
                            .dst_blocks = idx, .n_rows = g->s->rows, .n_blocks = nb, .layer_begin = 0, .layer_end = L,
                            .block_size = s->block_size, .row_bytes = (size_t)s->row_bytes};
    pd_op_kv_copy(g->c->p.backend, &kp);
    if (g->s->is_corrupt) {  // test hook: flip one bit of the last layer's V rows in the slab
        uint8_t x;
        char *at = (char *)dk[2 * L - 1];
        pd_backend_download(g->c->p.backend, &x, at, 1);
        x ^= 0x40;
        pd_backend_upload(g->c->p.backend, at, &x, 1);
    }
    pd_free(dk);
    pd_free(idx);
}

static pd_status nccl_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    const pd_kvconn_cache *k = &c->p.cache;
    int L = k->n_layers;
    pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = s->src, .n_rows = s->rows, .n_blocks = s->n_blocks,
                                .layer_begin = 0, .layer_end = L, .block_size = k->block_size, .row_bytes = k->row_bytes,
                                .sums = s->sums};
    pd_op_kv_checksum(c->p.backend, &cp);
    pd_kvw_kv_nccl slab = {.req_id = s->peer_req_id, .n_layers = L, .n_blocks = s->n_blocks, .block_size = k->block_size,
                           .n_rows_last = s->rows[s->n_blocks - 1], .row_bytes = k->row_bytes};
    slab.bytes = (uint64_t)L * 2u * (uint64_t)s->n_blocks * (uint64_t)k->block_size * k->row_bytes;
    gather_ctx g = {.c = c, .s = s, .slab = &slab};
    pd_err err = {0};
    int64_t t0 = pd_time_us();
    pd_status st = pd_xfer_server_send_nccl(c->xs, s->conn_id, &slab, gather_slab, &g, c->p.timeout_ms, &err);
    s->copy_us += pd_time_us() - t0;
    if (st) PD_LOG_W("kvconn: request %llu: nccl KV export failed: %s", (unsigned long long)s->peer_req_id, err.msg);
    else s->n_layers_saved = L;
    return st;
}

// Decode role: nothing to export (the communicator is made per connection), but the backend must
// be able to make one.
static pd_status nccl_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err) {
    (void)h;
    return pd_comm_id_new(c->p.backend, NULL, err);
}

const kvc_transport kvc_nccl = {
    .id = PD_KVW_TRANSPORT_NCCL,
    .name = "nccl",
    .export_pool = nccl_export,
    .save_rest = nccl_save_rest,
};
