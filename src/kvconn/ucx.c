// ucx.c — the ucx KV transport (libucx): the prefill worker puts the request's rows straight into
// the decode worker's KV pool, registered with UCX as one region (ucp_mem_map). The decode side
// sends its UCX worker address, the pool's base address, size and packed rkey as the HELLO handle,
// i.e. only after the HMAC challenge of the kvconn control connection (xfer); the prefill side
// checks the announced size against the pool of HELLO's block count and our geometry, creates an
// endpoint, unpacks the rkey and, per layer, posts one put per contiguous run of blocks for K and
// one for V (coalesced: a prompt in consecutive blocks is 2 puts per layer, never one per block),
// checking its connection before each layer (the fence). ucp_ep_flush then waits for remote
// completion before PREFILL_DONE leaves, with the same per-layer checksums of the source rows as
// the direct transports (the decode side verifies over its own blocks). The same code runs over
// whatever UCX selects: tcp or shared memory here (UCX_TLS=tcp,self or sm,self), RDMA or
// cuda_ipc/cuda_copy on clusters. The decode side progresses its UCX worker on its own thread
// (the puts land there with software transports such as tcp).
//
// Limits: the HELLO handle is 256 bytes, enough for tcp/sm/self addresses (~100-250 bytes), not
// for every RDMA address; UCX's own endpoints (e.g. its tcp sockets) do not authenticate — the
// rkey and address are only ever sent over the authenticated connection, but a host that can reach
// the UCX port is trusted as far as UCX's transports trust it.
#include <poll.h>
#include <pthread.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include "kvconn/kvconn_impl.h"

#define UCX_MAGIC 0x31584355u  // "UCX1"

typedef struct ucx_blob_hdr {  // 24 bytes, then the worker address, then the packed rkey
    uint32_t magic;
    uint16_t addr_len, rkey_len;
    uint64_t remote_base, n_bytes;
} ucx_blob_hdr;

typedef struct ucx_state {
    ucp_context_h ctx;
    ucp_worker_h worker;
    // decode role
    ucp_mem_h memh;
    void *pool;
    size_t pool_bytes;
    pthread_t progress;
    bool has_thread;
    volatile int stop;
} ucx_state;

typedef struct ucx_peer {
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t remote_base;
    volatile int failed;  // the endpoint reported an error
} ucx_peer;

static pd_status ucx_fail(pd_err *err, const char *what, ucs_status_t s) {
    return pd_err_set(err, PD_ERR_IO, "ucx: %s: %s", what, ucs_status_string(s));
}

static ucx_state *state_new(pd_kvconn *c, pd_err *err) {
    if (c->tstate) return c->tstate;
    ucx_state *u = pd_calloc(1, sizeof *u);
    if (!u) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    ucp_config_t *cfg = NULL;
    ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
    if (s != UCS_OK) goto bad;
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
    s = ucp_init(&p, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK) goto bad;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_SINGLE};
    s = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (s != UCS_OK) goto bad;
    c->tstate = u;
    return u;
bad:
    ucx_fail(err, "init (UCX_TLS names the transports; e.g. UCX_TLS=tcp,self)", s);
    if (u->ctx) ucp_cleanup(u->ctx);
    pd_free(u);
    return NULL;
}

static void ucx_fini(pd_kvconn *c) {
    ucx_state *u = c->tstate;
    if (!u) return;
    if (u->has_thread) {
        __atomic_store_n(&u->stop, 1, __ATOMIC_RELEASE);  // (the progress thread reads it atomically)
        ucp_worker_signal(u->worker);
        pthread_join(u->progress, NULL);
    }
    if (u->memh) ucp_mem_unmap(u->ctx, u->memh);
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->ctx);
    pd_free(u);
    c->tstate = NULL;
}

// Decode role: the puts of software transports (tcp) are carried out by our worker's progress.
static void *progress_main(void *arg) {
    ucx_state *u = arg;
    int efd = -1;
    if (ucp_worker_get_efd(u->worker, &efd) != UCS_OK) efd = -1;
    while (!__atomic_load_n(&u->stop, __ATOMIC_ACQUIRE)) {
        while (ucp_worker_progress(u->worker)) {
        }
        if (efd < 0) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
            continue;
        }
        ucs_status_t s = ucp_worker_arm(u->worker);
        if (s == UCS_ERR_BUSY) continue;
        struct pollfd pf = {.fd = efd, .events = POLLIN};
        poll(&pf, 1, 100);
    }
    return NULL;
}

// Decode role: the pool must be one region laid out as kvc_pool_bytes says (K0 V0 K1 V1 ...).
static pd_status ucx_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err) {
    (void)h;
    const pd_kvconn_cache *k = &c->p.cache;
    size_t stride = (size_t)k->n_blocks * (size_t)k->block_size * k->row_bytes;
    char *base = k->k[0];
    for (int l = 0; l < k->n_layers; l++)
        if ((char *)k->k[l] != base + (size_t)(2 * l) * stride || (char *)k->v[l] != base + (size_t)(2 * l + 1) * stride)
            return pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: the KV pool is not one contiguous region");
    ucx_state *u = state_new(c, err);
    if (!u) return err ? err->status : PD_ERR_IO;
    u->pool = base;
    u->pool_bytes = kvc_pool_bytes(c, k->n_blocks);
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = u->pool, .length = u->pool_bytes};
    ucs_status_t s = ucp_mem_map(u->ctx, &mp, &u->memh);
    if (s != UCS_OK) return ucx_fail(err, "registering the KV pool", s);
    return PD_OK;  // the progress thread starts in ucx_hello_blob, once the worker's address is out

}

static pd_status ucx_hello_blob(pd_kvconn *c, uint8_t *blob, uint32_t *len, pd_err *err) {
    ucx_state *u = c->tstate;
    ucp_address_t *addr = NULL;
    size_t alen = 0, rlen = 0;
    void *rkey = NULL;
    ucs_status_t s = ucp_worker_get_address(u->worker, &addr, &alen);
    if (s != UCS_OK) return ucx_fail(err, "worker address", s);
    s = ucp_rkey_pack(u->ctx, u->memh, &rkey, &rlen);
    pd_status st = PD_OK;
    if (s != UCS_OK) st = ucx_fail(err, "packing the pool's rkey", s);
    else if (sizeof(ucx_blob_hdr) + alen + rlen > 256)
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: address (%zu bytes) and rkey (%zu) do not fit the HELLO handle; "
                        "narrow UCX_TLS", alen, rlen);
    else {
        ucx_blob_hdr hd = {.magic = UCX_MAGIC, .addr_len = (uint16_t)alen, .rkey_len = (uint16_t)rlen,
                           .remote_base = (uint64_t)(uintptr_t)u->pool, .n_bytes = u->pool_bytes};
        memcpy(blob, &hd, sizeof hd);
        memcpy(blob + sizeof hd, addr, alen);
        memcpy(blob + sizeof hd + alen, rkey, rlen);
        *len = (uint32_t)(sizeof hd + alen + rlen);
    }
    if (rkey) ucp_rkey_buffer_release(rkey);
    ucp_worker_release_address(u->worker, addr);
    // From here on the worker belongs to the progress thread (UCS_THREAD_MODE_SINGLE).
    if (st == PD_OK && !u->has_thread) {
        if (pthread_create(&u->progress, NULL, progress_main, u)) return pd_err_set(err, PD_ERR_IO, "ucx: no progress thread");
        u->has_thread = true;
    }
    return st;
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    (void)status;
    __atomic_store_n(&((ucx_peer *)arg)->failed, 1, __ATOMIC_RELEASE);
}

// Waits for a request (NULL: done at once) with our worker's progress, until deadline_us.
static ucs_status_t wait_req(ucx_state *u, void *req, int64_t deadline_us) {
    if (req == NULL) return UCS_OK;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    ucs_status_t s;
    while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        ucp_worker_progress(u->worker);
        if (pd_time_us() > deadline_us) break;
    }
    ucp_request_free(req);
    return s;
}

static void ucx_detach(pd_kvconn *c, kvc_peer *p) {
    ucx_peer *q = p->tpriv;
    ucx_state *u = c->tstate;
    if (!q) return;
    if (q->rkey) ucp_rkey_destroy(q->rkey);
    if (q->ep && u) {
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
        wait_req(u, ucp_ep_close_nbx(q->ep, &rp), pd_time_us() + 2000000);
    }
    pd_free(q);
    p->tpriv = NULL;
}

// Prefill role: the peer's HELLO handle, checked against what it announced and our geometry.
static pd_status ucx_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, pd_err *err) {
    if (fd >= 0) close(fd);
    ucx_blob_hdr hd;
    if (h->handle_len < sizeof hd || h->handle_len > sizeof h->handle) return pd_err_set(err, PD_ERR_PROTO, "ucx: short handle");
    memcpy(&hd, h->handle, sizeof hd);
    if (hd.magic != UCX_MAGIC || !hd.addr_len || !hd.rkey_len ||
        (uint64_t)hd.addr_len + hd.rkey_len != h->handle_len - sizeof hd)
        return pd_err_set(err, PD_ERR_PROTO, "ucx: malformed handle");
    if (p->n_blocks <= 0 || hd.n_bytes != kvc_pool_bytes(c, p->n_blocks))
        return pd_err_set(err, PD_ERR_PROTO, "ucx: pool of %d blocks announced in %llu bytes (%zu expected)", p->n_blocks,
                          (unsigned long long)hd.n_bytes, kvc_pool_bytes(c, p->n_blocks));
    if (hd.remote_base + hd.n_bytes < hd.remote_base) return pd_err_set(err, PD_ERR_PROTO, "ucx: pool wraps around");
    ucx_state *u = state_new(c, err);
    if (!u) return err ? err->status : PD_ERR_IO;
    ucx_peer *q = pd_calloc(1, sizeof *q);
    if (!q) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    p->tpriv = q;
    q->remote_base = hd.remote_base;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)(h->handle + sizeof hd),
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_error, .arg = q}};
    ucs_status_t s = ucp_ep_create(u->worker, &ep, &q->ep);
    if (s != UCS_OK) {
        q->ep = NULL;
        ucx_detach(c, p);
        return ucx_fail(err, "endpoint to the decode worker", s);
    }
    s = ucp_ep_rkey_unpack(q->ep, h->handle + sizeof hd + hd.addr_len, &q->rkey);
    if (s != UCS_OK) {
        q->rkey = NULL;
        ucx_detach(c, p);
        return ucx_fail(err, "unpacking the pool's rkey", s);
    }
    return PD_OK;
}

static void *put(ucx_peer *q, const void *src, size_t n, uint64_t dst) {
    ucp_request_param_t rp = {0};
    return ucp_put_nbx(q->ep, src, n, dst, q->rkey, &rp);
}

static pd_status ucx_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    const pd_kvconn_cache *k = &c->p.cache;
    ucx_state *u = c->tstate;
    kvc_peer *p = s->peer;
    ucx_peer *q = p->tpriv;
    if (!u || !q) return PD_ERR_CLOSED;
    int L = k->n_layers, bs = k->block_size, l0 = s->n_layers_saved;
    size_t bb = k->row_bytes * (size_t)bs, stride = (size_t)p->n_blocks * bb;
    int64_t t0 = pd_time_us(), deadline = t0 + (int64_t)c->p.timeout_ms * 1000;
    pd_status st = PD_OK;
    for (int l = l0; l < L && st == PD_OK; l++) {
        if (!pd_xfer_server_conn_alive(c->xs, s->conn_id) || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE)) {
            st = PD_ERR_CLOSED;
            break;
        }
        for (int kv = 0; kv < 2 && st == PD_OK; kv++) {
            const char *src = kv ? k->v[l] : k->k[l];
            uint64_t dbase = q->remote_base + (uint64_t)(2 * l + kv) * stride;
            // Runs of blocks consecutive on both sides, full except possibly the last: one put each.
            for (int i = 0; i < s->n_blocks && st == PD_OK;) {
                int j = i;
                while (j + 1 < s->n_blocks && s->rows[j] == bs && s->src[j + 1] == s->src[j] + 1 && s->dst[j + 1] == s->dst[j] + 1) j++;
                size_t n = (size_t)(j - i) * bb + (size_t)s->rows[j] * k->row_bytes;
                void *r = put(q, src + (size_t)s->src[i] * bb, n, dbase + (uint64_t)s->dst[i] * bb);
                if (UCS_PTR_IS_ERR(r)) st = PD_ERR_IO;
                else if (r) ucp_request_free(r);  // completes in the background; the flush waits for it
                i = j + 1;
            }
        }
        ucp_worker_progress(u->worker);
        if (l == L / 2) kvc_debug_pause(c, "mid_slab");
    }
    if (st == PD_OK && s->is_corrupt) {  // test hook: one flipped bit in the last layer's V rows, remotely
        uint8_t x = *((const uint8_t *)k->v[L - 1] + (size_t)s->src[0] * bb) ^ 0x40;
        void *r = put(q, &x, 1, q->remote_base + (uint64_t)(2 * L - 1) * stride + (uint64_t)s->dst[0] * bb);
        if (wait_req(u, r, deadline) != UCS_OK) st = PD_ERR_IO;
    }
    if (st == PD_OK) {  // remote completion of every put before PREFILL_DONE leaves
        ucp_request_param_t rp = {0};
        ucs_status_t us = wait_req(u, ucp_ep_flush_nbx(q->ep, &rp), deadline);
        if (us != UCS_OK || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE)) {
            PD_LOG_W("kvconn: request %llu: ucx flush failed: %s", (unsigned long long)s->peer_req_id, ucs_status_string(us));
            st = us == UCS_INPROGRESS ? PD_ERR_TIMEOUT : PD_ERR_IO;
        }
    }
    if (st == PD_OK) {
        pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = s->src, .n_rows = s->rows, .n_blocks = s->n_blocks,
                                    .layer_begin = l0, .layer_end = L, .block_size = bs, .row_bytes = k->row_bytes,
                                    .sums = s->sums + l0};
        pd_op_kv_checksum(c->p.backend, &cp);
        s->n_layers_saved = L;
    }
    s->copy_us += pd_time_us() - t0;
    return st;
}

const kvc_transport kvc_ucx = {
    .id = PD_KVW_TRANSPORT_UCX,
    .name = "ucx",
    .needs_host_pool = true,  // puts from/to host pointers until device memory is registered (cuda_copy)
    .export_pool = ucx_export,
    .hello_blob = ucx_hello_blob,
    .attach = ucx_attach,
    .detach = ucx_detach,
    .save_rest = ucx_save_rest,
    .fini = ucx_fini,
};
