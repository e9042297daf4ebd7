// tcp.c — the tcp KV transport: each layer's K and V rows of the request travel inline as one
// KV_SLAB frame, K rows of every block in order, then V rows (the checksum's order). Layer-wise:
// the layer hook copies layer l's rows into a slab and queues it; the connection's writer thread
// sends it while the engine computes layer l+1. The decode side reads the payload straight into
// the reserved blocks (xfer). For CPU pools (the receiving I/O thread writes them with the CPU).
#include "base/checksum.h"
#include "kvconn/kvconn_impl.h"

static void tcp_save_layer(pd_kvconn *c, pd_kvconn_save *s, int l) {
    const pd_kvconn_cache *k = &c->p.cache;
    int64_t t0 = pd_time_us();
    size_t total_rows = 0;
    for (int i = 0; i < s->n_blocks; i++) total_rows += (size_t)s->rows[i];
    size_t len = 2 * total_rows * k->row_bytes, bb = k->row_bytes * (size_t)k->block_size;
    uint8_t *payload = pd_malloc(len);
    if (!payload) {
        s->st = PD_ERR_NOMEM;
        return;
    }
    uint8_t *o = payload;
    for (int kv = 0; kv < 2; kv++)
        for (int i = 0; i < s->n_blocks; i++) {
            size_t n = k->row_bytes * (size_t)s->rows[i];
            pd_backend_download(c->p.backend, o, (char *)(kv ? k->v[l] : k->k[l]) + (size_t)s->src[i] * bb, n);
            o += n;
        }
    uint64_t g = 0;
    s->sums[l] = 0;
    pd_checksum_run(&s->sums[l], &g, payload, len);
    if (s->is_corrupt && l == k->n_layers - 1) payload[len / 2] ^= 0x40;  // test hook: one flipped bit
    pd_kvw_msg m = {.type = PD_KVW_KV_SLAB};
    m.u.kv_slab = (pd_kvw_kv_slab){.req_id = s->peer_req_id, .layer = l, .n_blocks = s->n_blocks,
                                   .n_rows_last = s->rows[s->n_blocks - 1], .row_bytes = k->row_bytes, .payload_len = len};
    s->st = pd_xfer_server_send(c->xs, s->conn_id, &m, payload);  // queued; the payload is taken over
    s->copy_us += pd_time_us() - t0;
    if (l == k->n_layers / 2) kvc_debug_pause(c, "mid_slab");
}

static pd_status tcp_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    for (int l = s->n_layers_saved; l < c->p.cache.n_layers && !s->st; l++) {
        tcp_save_layer(c, s, l);
        if (!s->st) s->n_layers_saved = l + 1;
    }
    return s->st;
}

const kvc_transport kvc_tcp = {
    .id = PD_KVW_TRANSPORT_TCP,
    .name = "tcp",
    .is_layerwise = true,
    .needs_host_pool = true,
    .save_layer = tcp_save_layer,
    .save_rest = tcp_save_rest,
};
