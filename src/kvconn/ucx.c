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
// cuda_ipc/cuda_copy on GPUs. The decode side progresses its UCX worker on its own thread
// (the puts land there with software transports such as tcp).
//
// GPU pools (CUDA backend): both pools are registered with memory type CUDA — the decode
// worker's whole device pool as the one remote region, the prefill worker's whole device KV
// cache as the source region (its memh rides with every put, so UCX neither detects nor
// registers per put). The prefill side waits for its compute stream before the first put (UCX
// copies on its own CUDA streams). This needs a UCX built with CUDA (libuct_cuda / libucm_cuda:
// NVIDIA's HPC-X or DOCA ucx-cuda packages, conda-forge's ucx; tools/gpu/ucx_cuda.sh builds
// UCX 1.13.1 from Debian's source with CUDA): with Debian's libucx0 alone, registering a device
// pool fails with a clear error. Even with CUDA transports, UCX 1.13 cannot put into another
// process's device memory (see device_rma_ok), so device pools are refused unless
// PD_UCX_DEVICE_RMA=1 vouches for the UCX in use (untested: no such UCX here).
//
// Limits: the HELLO handle is PD_KVW_HANDLE_MAX (1024) bytes, enough for tcp/sm/self/cuda
// addresses plus a cuda_ipc rkey (~120 bytes); UCX's own endpoints (e.g. its tcp sockets) do not
// authenticate — the rkey and address are only ever sent over the authenticated connection, but a
// host that can reach the UCX port is trusted as far as UCX's transports trust it.
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
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
    ucs_memory_type_t mem_type;  // of our KV pool: host (cpu backend) or CUDA
    pd_backend *backend;
    // prefill role: our KV cache, registered once (the source of every put)
    ucp_mem_h src_memh;
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
    uint64_t remote_base, remote_bytes;  // the registered region the peer announced
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
    u->backend = c->p.backend;
    u->mem_type = c->p.backend && strcmp(pd_backend_name(c->p.backend), "cpu") ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
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
    if (u->src_memh) ucp_mem_unmap(u->ctx, u->src_memh);
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

// Both roles: our KV cache must be one region laid out as kvc_pool_bytes says (K0 V0 K1 V1 ...).
static pd_status pool_region(pd_kvconn *c, void **base, size_t *n, pd_err *err) {
    const pd_kvconn_cache *k = &c->p.cache;
    size_t stride = (size_t)k->n_blocks * (size_t)k->block_size * k->row_bytes;
    char *b = k->k[0];
    for (int l = 0; l < k->n_layers; l++)
        if ((char *)k->k[l] != b + (size_t)(2 * l) * stride || (char *)k->v[l] != b + (size_t)(2 * l + 1) * stride)
            return pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: the KV pool is not one contiguous region");
    *base = b;
    *n = kvc_pool_bytes(c, k->n_blocks);
    return PD_OK;
}

// Device pools: whether this UCX is trusted to put device memory into another process's device
// memory. UCX 1.13 (Debian's) is not: its RMA lanes must offer put_short / put_bcopy / get_bcopy,
// which cuda_ipc lacks (put/get zcopy only), so no RMA lane serves CUDA memory (ep_cfg
// "rma(sysv/memory posix/memory)"). Measured on an H100 with ucx_perftest ucp_put_bw -m cuda,cuda
// between two processes: the default protocols emulate the puts over active messages with CPU
// copies of the device pointers — SIGSEGV in uct_mm_ep_am_bcopy under ucp_put_nbx; with
// UCX_PROTO_ENABLE=y the puts complete at 97 MB/s (64 MiB puts), four orders of magnitude below
// the cuda-ipc connector. So device pools are refused unless PD_UCX_DEVICE_RMA=1 asserts a UCX
// whose puts reach device memory over zcopy lanes (cuda_ipc, GPUDirect RDMA): none is available
// here, so that path is unverified on GPUs (an opt-in run with UCX_TLS=cuda_ipc,cuda_copy,sm,self
// stopped earlier: the endpoint was "unreachable" in peer error mode, as sm,self is on the CPU).
static pd_status device_rma_ok(pd_err *err) {
    const char *e = getenv("PD_UCX_DEVICE_RMA");
    if (e && !strcmp(e, "1")) return PD_OK;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: UCX %s cannot put into another process's device memory (its RMA "
                      "lanes need put_short/bcopy, which cuda_ipc lacks; UCP would emulate the puts with CPU copies "
                      "of device pointers); use --kv-transport cuda-ipc or nccl on GPUs, or PD_UCX_DEVICE_RMA=1 with "
                      "a UCX whose puts use cuda_ipc / GPUDirect zcopy lanes (untested)", ucp_get_version_string());
}

static pd_status mem_map(ucx_state *u, void *base, size_t n, ucp_mem_h *memh, const char *what, pd_err *err) {
    *memh = NULL;
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    ucs_status_t s = ucp_context_query(u->ctx, &ca);
    if (u->mem_type == UCS_MEMORY_TYPE_CUDA && (s != UCS_OK || !(ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA))))
        return pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: %s is device memory and this UCX has no CUDA transports "
                          "(libuct_cuda: install a CUDA-enabled UCX, e.g. the one tools/gpu/ucx_cuda.sh builds, "
                          "through LD_LIBRARY_PATH) or UCX_TLS leaves them out (cuda_ipc,cuda_copy)", what);
    if (u->mem_type == UCS_MEMORY_TYPE_CUDA) {
        pd_status st = device_rma_ok(err);
        if (st) return st;
        // UCX's cuda memory domains use the driver API's current context: bind the backend's device
        // (its primary context) to this thread first (a prefill engine thread meets its first
        // decode worker before its first CUDA call).
        pd_backend_sync(u->backend);
    }
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                             UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                               .address = base, .length = n, .memory_type = u->mem_type};
    s = ucp_mem_map(u->ctx, &mp, memh);
    if (s == UCS_OK) return PD_OK;
    *memh = NULL;
    return pd_err_set(err, PD_ERR_IO, "ucx: registering %s (%zu bytes, %s memory): %s", what, n,
                      u->mem_type == UCS_MEMORY_TYPE_CUDA ? "device" : "host", ucs_status_string(s));
}

// Decode role: the whole pool is the one registered region peers put into.
static pd_status ucx_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err) {
    (void)h;
    void *base;
    size_t n;
    pd_status st = pool_region(c, &base, &n, err);
    if (st) return st;
    ucx_state *u = state_new(c, err);
    if (!u) return err ? err->status : PD_ERR_IO;
    u->pool = base;
    u->pool_bytes = n;
    return mem_map(u, base, n, &u->memh, "the KV pool", err);
    // the progress thread starts in ucx_hello_blob, once the worker's address is out
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
    else if (sizeof(ucx_blob_hdr) + alen + rlen > PD_KVW_HANDLE_MAX)
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: address (%zu bytes) and rkey (%zu) do not fit the HELLO handle "
                        "(%d bytes); narrow UCX_TLS", alen, rlen, PD_KVW_HANDLE_MAX);
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
    if (!u->src_memh) {  // our KV cache, registered once for every peer (device memory: cuda_ipc's source)
        void *base;
        size_t n;
        pd_status st = pool_region(c, &base, &n, err);
        if (!st) st = mem_map(u, base, n, &u->src_memh, "the prefill KV cache", err);
        if (st) return st;
    }
    ucx_peer *q = pd_calloc(1, sizeof *q);
    if (!q) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    p->tpriv = q;
    q->remote_base = hd.remote_base;
    q->remote_bytes = hd.n_bytes;
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

// One put of n bytes from our registered cache to offset off of the peer's region, checked against
// the region the peer announced (the block ids were checked against its pool already).
static void *put(const ucx_state *u, ucx_peer *q, const void *src, size_t n, uint64_t off) {
    if (off > q->remote_bytes || n > q->remote_bytes - off) return UCS_STATUS_PTR(UCS_ERR_INVALID_PARAM);
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                              .memh = u->src_memh, .memory_type = u->mem_type};
    return ucp_put_nbx(q->ep, src, n, q->remote_base + off, q->rkey, &rp);
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
    // The forward pass wrote the rows on the compute stream; UCX's copies run on its own streams.
    if (u->mem_type == UCS_MEMORY_TYPE_CUDA) pd_backend_sync(c->p.backend);
    // Test hook: one flipped bit in the last layer's V rows, put with the rest and restored after
    // the flush, before the checksums (the decode side must catch it).
    char *corrupt_at = s->is_corrupt ? (char *)k->v[L - 1] + (size_t)s->src[0] * bb : NULL;
    uint8_t corrupt_orig = 0;
    if (corrupt_at) {
        uint8_t x;
        pd_backend_download(c->p.backend, &x, corrupt_at, 1);
        corrupt_orig = x;
        x ^= 0x40;
        pd_backend_upload(c->p.backend, corrupt_at, &x, 1);
        pd_backend_sync(c->p.backend);
    }
    for (int l = l0; l < L && st == PD_OK; l++) {
        if (!pd_xfer_server_conn_alive(c->xs, s->conn_id) || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE)) {
            st = PD_ERR_CLOSED;
            break;
        }
        for (int kv = 0; kv < 2 && st == PD_OK; kv++) {
            const char *src = kv ? k->v[l] : k->k[l];
            uint64_t dbase = (uint64_t)(2 * l + kv) * stride;  // offset in the peer's region
            // Runs of blocks consecutive on both sides, full except possibly the last: one put each.
            for (int i = 0; i < s->n_blocks && st == PD_OK;) {
                int j = i;
                while (j + 1 < s->n_blocks && s->rows[j] == bs && s->src[j + 1] == s->src[j] + 1 && s->dst[j + 1] == s->dst[j] + 1) j++;
                size_t n = (size_t)(j - i) * bb + (size_t)s->rows[j] * k->row_bytes;
                void *r = put(u, q, src + (size_t)s->src[i] * bb, n, dbase + (uint64_t)s->dst[i] * bb);
                if (UCS_PTR_IS_ERR(r)) st = PD_ERR_IO;
                else if (r) ucp_request_free(r);  // completes in the background; the flush waits for it
                i = j + 1;
            }
        }
        ucp_worker_progress(u->worker);
        if (l == L / 2) kvc_debug_pause(c, "mid_slab");
    }
    {  // remote completion of every put posted (also after a failure: nothing may still read our rows)
        ucp_request_param_t rp = {0};
        ucs_status_t us = wait_req(u, ucp_ep_flush_nbx(q->ep, &rp), st == PD_OK ? deadline : pd_time_us() + 2000000);
        if (st == PD_OK && (us != UCS_OK || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE))) {
            PD_LOG_W("kvconn: request %llu: ucx flush failed: %s", (unsigned long long)s->peer_req_id, ucs_status_string(us));
            st = us == UCS_INPROGRESS ? PD_ERR_TIMEOUT : PD_ERR_IO;
        }
    }
    if (corrupt_at) {
        pd_backend_upload(c->p.backend, corrupt_at, &corrupt_orig, 1);
        pd_backend_sync(c->p.backend);
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
    .export_pool = ucx_export,
    .hello_blob = ucx_hello_blob,
    .attach = ucx_attach,
    .detach = ucx_detach,
    .save_rest = ucx_save_rest,
    .fini = ucx_fini,
};
