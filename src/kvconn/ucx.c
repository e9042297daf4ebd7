// ucx.c — the ucx KV transport (libucx), two data paths chosen by the decode worker and announced
// in its HELLO handle (sent only after the HMAC challenge of the kvconn control connection, xfer):
//
// put (one-sided, host pools by default): the decode side registers its whole pool (ucp_mem_map)
// and sends its UCX worker address, the pool's base address, size and packed rkey; the prefill
// side checks the announced size against the pool of HELLO's block count and our geometry, creates
// an endpoint, unpacks the rkey and, per layer, posts one put per contiguous run of blocks for K
// and one for V (coalesced: a prompt in consecutive blocks is 2 puts per layer, never one per
// block), checking its connection before each layer (the fence). ucp_ep_flush then waits for
// remote completion before PREFILL_DONE leaves.
//
// tag (two-sided, device pools by default; PD_UCX_PATH=tag|put on the decode worker overrides):
// UCX 1.13 cannot put into another process's device memory (device_rma_ok), but its tag
// rendezvous moves device buffers with cuda_ipc get_zcopy (measured on an H100: 1.1-1.4 TB/s for
// 64 MiB-1 GiB messages between two processes, docs/benchmarks.md). Before a load's request leaves,
// the decode worker posts one ucp_tag_recv_nbx per layer, K and V, and contiguous run of its
// destination blocks (full blocks, consecutive ids; the last may be partial), straight into its
// registered pool (memh), under a tag of (request id, layer, K|V, run) with a full mask, so no
// message can land in another request's or layer's buffer. The prefill worker sends each run with
// ucp_tag_send_nbx from its registered KV cache (memh), layer-wise: at layer l's hook the transfer
// mark has waited for layer l-1's compute, so layers < l go out while the forward pass goes on,
// the rest after it. A save with a run whose source blocks are not consecutive sends everything at
// the end from a device staging copy of the request (gathered with one kv copy). It waits for
// every send (bounded by the load timeout; a
// peer that does not take them in time is cut off: its endpoint is force-closed, so nothing reads
// our rows afterwards, and its later requests fail over to local prefill until it reconnects),
// then PREFILL_DONE leaves with the same per-layer checksums of the source rows as every
// transport. On the decode side the RESULT waits (bounded) for every posted receive and checks
// each one's status and length against what was posted (a truncated or short message fails the
// load: the request is prefilled locally, nothing else is touched); a failed load's receives are
// cancelled before its LOAD_DONE, so its blocks are free when the engine sees it. A message no
// receive matches (a late send for a load that already failed) is taken and dropped by the
// progress thread (received into 0 bytes: UCX reports it truncated and releases the sender).
// The decode side progresses its UCX worker on its own thread (it drives the rendezvous gets:
// busy while receives are posted, on the worker's event fd otherwise); the worker is
// UCS_THREAD_MODE_MULTI (the engine thread posts, the session's I/O thread completes).
//
// The same code runs over whatever UCX selects: tcp or shared memory here, RDMA or
// cuda_ipc/cuda_copy on GPUs. Endpoints use peer error handling (UCP_ERR_HANDLING_MODE_PEER),
// which needs an active-message transport that reports peer failure: in UCX 1.13 tcp does, the
// shared-memory transports only with UCX_POSIX_ERROR_HANDLING=y / UCX_SYSV_ERROR_HANDLING=y, and
// cuda_ipc / cuda_copy carry no active messages at all — so UCX_TLS=cuda_ipc,cuda_copy,sm,self
// alone gives "Destination is unreachable" ("no active messages transport ... no peer failure
// handler"): add tcp (UCX_TLS=cuda_ipc,cuda_copy,tcp,self) or set those two variables.
//
// GPU pools (CUDA backend): both pools are registered with memory type CUDA. This needs a UCX
// built with CUDA (libuct_cuda / libucm_cuda: NVIDIA's HPC-X or DOCA ucx-cuda packages,
// conda-forge's ucx; tools/gpu/ucx_cuda.sh builds UCX 1.13.1 from Debian's source with CUDA):
// with Debian's libucx0 alone, registering a device pool fails with a clear error.
//
// Limits: the HELLO handle is PD_KVW_HANDLE_MAX (1024) bytes, enough for tcp/sm/self/cuda
// addresses plus a cuda_ipc rkey (~120 bytes); tags hold 32 bits of the request id (ids 2^32
// apart could meet only if one load outlived four billion others), layers < 1024, runs < 2^21;
// UCX's own endpoints (e.g. its tcp sockets) do not authenticate — the address is only ever sent
// over the authenticated connection, but a host that can reach the UCX port is trusted as far as
// UCX's transports trust it.
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#include "kvconn/kvconn_impl.h"

#define UCX_MAGIC_PUT 0x31584355u  // "UCX1": one-sided path (an rkey follows the address)
#define UCX_MAGIC_TAG 0x32584355u  // "UCX2": two-sided path (no rkey)
#define UCX_MAX_LAYERS 1024
#define UCX_MAX_RUNS (1 << 21)

typedef struct ucx_blob_hdr {  // 24 bytes, then the worker address, then the packed rkey (put)
    uint32_t magic;
    uint16_t addr_len, rkey_len;
    uint64_t remote_base, n_bytes;
} ucx_blob_hdr;

// Decode role, tag path: one load's posted receives (until its RESULT).
typedef struct ucx_rx {
    uint64_t req_id;
    int n;
    void **reqs;   // (n) UCX requests, NULL once freed
    size_t *want;  // (n) bytes each receive was posted for
    struct ucx_rx *next;
} ucx_rx;

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
    bool is_tag;            // decode role: our data path is two-sided
    pthread_mutex_t rx_mu;  // guards rx (engine thread posts, I/O thread completes)
    pthread_mutex_t wk_mu;  // held around every progress of the worker and every receive cancel (wk_progress)
    ucx_rx *rx;
    int n_rx;               // loads with receives posted (atomic; the progress thread spins while > 0)
    int64_t n_stale;        // messages no receive matched, dropped (atomic)
    int64_t n_gathers;      // prefill role: tag saves sent from a staging copy
    bool is_gather_forced;  // test hook (prefill role): PD_UCX_FORCE_GATHER=1 sends every tag save from staging
    int debug_length;       // test hook (prefill role): PD_UCX_DEBUG_LENGTH=short|long (-1|1): every 3rd tag
                            // save sends its first message one row short / long (the decode side must refuse it)
    int64_t n_tag_saves;
    uint8_t scratch[8];     // where those are "received" (0 bytes)
} ucx_state;

typedef struct ucx_peer {
    ucp_ep_h ep;
    ucp_rkey_h rkey;
    uint64_t remote_base, remote_bytes;  // the registered region the peer announced
    volatile int failed;  // the endpoint reported an error (or we cut it off)
    bool is_tag;          // the peer asked for the two-sided path
} ucx_peer;

// The tag of one message: (request id, layer, K|V, run), matched with a full mask.
static uint64_t kv_tag(uint64_t req_id, int layer, int kv, int run) {
    return (req_id & 0xffffffffull) << 32 | (uint64_t)layer << 22 | (uint64_t)kv << 21 | (uint64_t)run;
}

// The run of destination blocks that starts at i: consecutive ids, every block but the last full.
// Both sides cut runs with this (the decode side knows only its own blocks). Returns its last index.
static int run_end(const int32_t *dst, const int32_t *rows, int n, int bs, int i) {
    int j = i;
    while (j + 1 < n && rows[j] == bs && dst[j + 1] == dst[j] + 1) j++;
    return j;
}

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
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_RMA | UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP};
    s = ucp_init(&p, cfg, &u->ctx);
    ucp_config_release(cfg);
    if (s != UCS_OK) goto bad;
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE, .thread_mode = UCS_THREAD_MODE_MULTI};
    s = ucp_worker_create(u->ctx, &wp, &u->worker);
    if (s != UCS_OK) goto bad;
    ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE};
    if (ucp_worker_query(u->worker, &wa) != UCS_OK || wa.thread_mode != UCS_THREAD_MODE_MULTI) {
        ucp_worker_destroy(u->worker);
        ucp_cleanup(u->ctx);
        pd_free(u);
        pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: this UCX has no multi-threaded workers (built without --enable-mt)");
        return NULL;
    }
    pthread_mutex_init(&u->rx_mu, NULL);
    pthread_mutex_init(&u->wk_mu, NULL);
    const char *fg = getenv("PD_UCX_FORCE_GATHER");
    u->is_gather_forced = fg && !strcmp(fg, "1");
    const char *dl = getenv("PD_UCX_DEBUG_LENGTH");
    u->debug_length = dl && !strcmp(dl, "short") ? -1 : dl && !strcmp(dl, "long") ? 1 : 0;
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

// Every progress of our worker, on any thread (the progress thread, the I/O thread in load_end, the
// engine thread when a post fails), goes through wk_mu, and so does every cancel (rx_cancel).
// UCX 1.13's ucp_request_cancel tests the request's COMPLETED flag *before* it takes the worker's
// lock, then, under the lock, removes the request from the expected queue and asserts
// (ucp_tag_exp_remove, tag_match.c:92, "!(req->flags & UCP_REQUEST_FLAG_COMPLETED)") if it was
// no longer there. A receive whose message another thread's ucp_worker_progress completed in
// between (typically while the cancel waited for the lock that progress held) aborted the whole
// process: the decode worker died and every client connection with it, whenever a failed load's
// other receives were cancelled while their messages still arrived (test_disagg_ucx's
// ucx_len_short / ucx_len_long cases: 4 runs of 10 failed, on the ucxtag branch as on the merged
// tree). Under wk_mu nothing completes a receive between our test and the cancel: receives
// complete in progress (UCX 1.13's async thread, as we read it, only schedules work for the next
// progress; the tag cases have run 30+ times clean since, ASan and TSan included).
// UCX's cuda transports (cuda_ipc's handle cache, cuda_copy) call the driver API with the calling
// thread's current context: with the prefill and decode pools on different GPUs, a thread that never
// made the pool's device current failed every rendezvous get ("cuCtxGetDevice() failed: invalid
// device context" in cuda_ipc_cache.c, the decode worker then aborted: H100 x2, session 9). So every
// thread binds our backend's device (its primary context) before its UCX calls on a CUDA pool
// (pd_backend_bind_thread: no wait, so it is safe while another thread captures a graph).
static void ucx_bind(ucx_state *u) {  // (cheap when bound: the backend remembers the thread's device)
    if (u->mem_type == UCS_MEMORY_TYPE_CUDA && u->backend) pd_backend_bind_thread(u->backend);
}

static unsigned wk_progress(ucx_state *u) {
    ucx_bind(u);
    pthread_mutex_lock(&u->wk_mu);
    unsigned n = ucp_worker_progress(u->worker);
    pthread_mutex_unlock(&u->wk_mu);
    return n;
}

static void rx_cancel(ucx_state *u, void *r) {
    ucx_bind(u);
    pthread_mutex_lock(&u->wk_mu);
    if (ucp_request_check_status(r) == UCS_INPROGRESS) ucp_request_cancel(u->worker, r);
    pthread_mutex_unlock(&u->wk_mu);
}

// Cancels the receives of rx still in progress and waits for them until deadline_us (a receive
// whose rendezvous get already runs completes first); frees them. Returns how many had not ended.
static int rx_drain(ucx_state *u, ucx_rx *rx, int64_t deadline_us) {
    for (int i = 0; i < rx->n; i++)
        if (rx->reqs[i]) rx_cancel(u, rx->reqs[i]);
    int left = 0;
    for (int i = 0; i < rx->n; i++) {
        if (!rx->reqs[i]) continue;
        while (ucp_request_check_status(rx->reqs[i]) == UCS_INPROGRESS && pd_time_us() < deadline_us)
            wk_progress(u);
        if (ucp_request_check_status(rx->reqs[i]) == UCS_INPROGRESS) left++;
        ucp_request_free(rx->reqs[i]);  // (one still in progress is released when it completes)
        rx->reqs[i] = NULL;
    }
    return left;
}

static void rx_free(ucx_rx *rx) {
    if (!rx) return;
    pd_free(rx->reqs);
    pd_free(rx->want);
    pd_free(rx);
}

static void ucx_fini(pd_kvconn *c) {
    ucx_state *u = c->tstate;
    if (!u) return;
    if (u->has_thread) {
        __atomic_store_n(&u->stop, 1, __ATOMIC_RELEASE);  // (the progress thread reads it atomically)
        ucp_worker_signal(u->worker);
        pthread_join(u->progress, NULL);
    }
    while (u->rx) {  // loads dropped with the connector: their receives end before the pool goes
        ucx_rx *rx = u->rx;
        u->rx = rx->next;
        rx_drain(u, rx, pd_time_us() + 1000000);
        rx_free(rx);
    }
    pthread_mutex_destroy(&u->rx_mu);
    pthread_mutex_destroy(&u->wk_mu);
    if (u->memh) ucp_mem_unmap(u->ctx, u->memh);
    if (u->src_memh) ucp_mem_unmap(u->ctx, u->src_memh);
    ucp_worker_destroy(u->worker);
    ucp_cleanup(u->ctx);
    pd_free(u);
    c->tstate = NULL;
}

// Decode role, tag path: a message no posted receive matched (a late send of a load that already
// failed, or one we never asked for) is received into 0 bytes: UCX completes it as truncated and
// releases the sender (rendezvous: without reading its data).
static void drop_stale(ucx_state *u) {
    ucp_tag_recv_info_t info;
    ucp_tag_message_h m;
    while ((m = ucp_tag_probe_nb(u->worker, 0, 0, 1, &info)) != NULL) {
        ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE, .memory_type = UCS_MEMORY_TYPE_HOST};
        void *r = ucp_tag_msg_recv_nbx(u->worker, u->scratch, 0, m, &rp);
        if (r && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
        int64_t n = __atomic_add_fetch(&u->n_stale, 1, __ATOMIC_RELAXED);
        if (n <= 16 || (n & (n - 1)) == 0)
            PD_LOG_W("kvconn: ucx: dropped a KV message no load waits for (request %llu, layer %llu, %zu bytes; %lld so far)",
                     (unsigned long long)(info.sender_tag >> 32), (unsigned long long)(info.sender_tag >> 22 & 1023),
                     info.length, (long long)n);
    }
}

// Decode role: the puts of software transports (tcp) are carried out by our worker's progress, and
// the tag path's rendezvous gets are driven by it.
static void *progress_main(void *arg) {
    ucx_state *u = arg;
    ucx_bind(u);
    int efd = -1;
    if (ucp_worker_get_efd(u->worker, &efd) != UCS_OK) efd = -1;
    while (!__atomic_load_n(&u->stop, __ATOMIC_ACQUIRE)) {
        while (wk_progress(u)) {
        }
        if (u->is_tag) {
            pthread_mutex_lock(&u->wk_mu);
            drop_stale(u);
            pthread_mutex_unlock(&u->wk_mu);
            if (__atomic_load_n(&u->n_rx, __ATOMIC_ACQUIRE) > 0) {  // receives posted: poll, do not sleep
                sched_yield();
                continue;
            }
        }
        if (efd < 0) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
            continue;
        }
        pthread_mutex_lock(&u->wk_mu);  // (arm may run missed async events)
        ucs_status_t s = ucp_worker_arm(u->worker);
        pthread_mutex_unlock(&u->wk_mu);
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
// the cuda-ipc connector. So the put path refuses device pools unless PD_UCX_DEVICE_RMA=1 asserts a UCX
// whose puts reach device memory over zcopy lanes (cuda_ipc, GPUDirect RDMA): none is available
// here, so that path is unverified on GPUs; device pools take the tag path instead.
static pd_status device_rma_ok(pd_err *err) {
    const char *e = getenv("PD_UCX_DEVICE_RMA");
    if (e && !strcmp(e, "1")) return PD_OK;
    return pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: UCX %s cannot put into another process's device memory (its RMA "
                      "lanes need put_short/bcopy, which cuda_ipc lacks; UCP would emulate the puts with CPU copies "
                      "of device pointers); leave PD_UCX_PATH unset (device pools use the tag path), or PD_UCX_DEVICE_RMA=1 with "
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
        // UCX's cuda memory domains use the driver API's current context: bind the backend's device
        // (its primary context) to this thread first (a prefill engine thread meets its first
        // decode worker before its first CUDA call).
        ucx_bind(u);
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
    // The data path: tag for device pools, put for host pools, unless PD_UCX_PATH says otherwise.
    const char *path = getenv("PD_UCX_PATH");
    if (path && *path && strcmp(path, "tag") && strcmp(path, "put"))
        return pd_err_set(err, PD_ERR_INVALID, "ucx: PD_UCX_PATH=%s: tag or put expected", path);
    u->is_tag = path && *path ? !strcmp(path, "tag") : u->mem_type == UCS_MEMORY_TYPE_CUDA;
    if (!u->is_tag && u->mem_type == UCS_MEMORY_TYPE_CUDA && device_rma_ok(err)) return err ? err->status : PD_ERR_UNSUPPORTED;
    PD_LOG_I("kvconn: ucx: %s data path, %s pool of %zu bytes (%s)", u->is_tag ? "tag (two-sided)" : "put (one-sided)",
             u->mem_type == UCS_MEMORY_TYPE_CUDA ? "device" : "host", n, ucp_get_version_string());
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
    if (!u->is_tag) s = ucp_rkey_pack(u->ctx, u->memh, &rkey, &rlen);  // (the tag path needs none)
    pd_status st = PD_OK;
    if (s != UCS_OK) st = ucx_fail(err, "packing the pool's rkey", s);
    else if (sizeof(ucx_blob_hdr) + alen + rlen > PD_KVW_HANDLE_MAX)
        st = pd_err_set(err, PD_ERR_UNSUPPORTED, "ucx: address (%zu bytes) and rkey (%zu) do not fit the HELLO handle "
                        "(%d bytes); narrow UCX_TLS", alen, rlen, PD_KVW_HANDLE_MAX);
    else {
        ucx_blob_hdr hd = {.magic = u->is_tag ? UCX_MAGIC_TAG : UCX_MAGIC_PUT, .addr_len = (uint16_t)alen, .rkey_len = (uint16_t)rlen,
                           .remote_base = (uint64_t)(uintptr_t)u->pool, .n_bytes = u->pool_bytes};
        memcpy(blob, &hd, sizeof hd);
        memcpy(blob + sizeof hd, addr, alen);
        if (rlen) memcpy(blob + sizeof hd + alen, rkey, rlen);
        *len = (uint32_t)(sizeof hd + alen + rlen);
    }
    if (rkey) ucp_rkey_buffer_release(rkey);
    ucp_worker_release_address(u->worker, addr);
    // From here on the progress thread progresses the worker too (UCS_THREAD_MODE_MULTI; every progress
    // and cancel under wk_mu).
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
        wk_progress(u);
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
    bool is_tag = hd.magic == UCX_MAGIC_TAG;
    if ((hd.magic != UCX_MAGIC_PUT && !is_tag) || !hd.addr_len || (is_tag ? hd.rkey_len != 0 : !hd.rkey_len) ||
        (uint64_t)hd.addr_len + hd.rkey_len != h->handle_len - sizeof hd)
        return pd_err_set(err, PD_ERR_PROTO, "ucx: malformed handle");
    if (p->n_blocks <= 0 || hd.n_bytes != kvc_pool_bytes(c, p->n_blocks))
        return pd_err_set(err, PD_ERR_PROTO, "ucx: pool of %d blocks announced in %llu bytes (%zu expected)", p->n_blocks,
                          (unsigned long long)hd.n_bytes, kvc_pool_bytes(c, p->n_blocks));
    if (hd.remote_base + hd.n_bytes < hd.remote_base) return pd_err_set(err, PD_ERR_PROTO, "ucx: pool wraps around");
    ucx_state *u = state_new(c, err);
    if (!u) return err ? err->status : PD_ERR_IO;
    if (!is_tag && u->mem_type == UCS_MEMORY_TYPE_CUDA) {
        pd_status st = device_rma_ok(err);
        if (st) return st;
    }
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
    q->is_tag = is_tag;
    q->remote_base = hd.remote_base;
    q->remote_bytes = hd.n_bytes;
    ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                        UCP_EP_PARAM_FIELD_ERR_HANDLER,
                          .address = (const ucp_address_t *)(h->handle + sizeof hd),
                          .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                          .err_handler = {.cb = ep_error, .arg = q}};
    ucx_bind(u);
    ucs_status_t s = ucp_ep_create(u->worker, &ep, &q->ep);
    if (s != UCS_OK) {
        q->ep = NULL;
        ucx_detach(c, p);
        return ucx_fail(err, "endpoint to the decode worker", s);
    }
    if (is_tag) return PD_OK;
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

// ---- the tag path ------------------------------------------------------------------------------

// Decode role: the receives of load l, one per layer, K|V and run of its destination blocks, into
// our registered pool; posted before the request leaves (so a message can only meet its receive).
static pd_status ucx_load_post(pd_kvconn *c, const pd_kvconn_load *l) {
    ucx_state *u = c->tstate;
    if (!u || !u->is_tag) return PD_OK;
    const pd_kvconn_cache *k = &c->p.cache;
    int L = k->n_layers, bs = k->block_size, nb = l->n_dst_blocks;
    size_t bb = k->row_bytes * (size_t)bs;
    if (nb <= 0) return PD_OK;
    for (int i = 0; i < nb; i++)
        if (l->dst_blocks[i] < 0 || l->dst_blocks[i] >= k->n_blocks) return PD_ERR_INVALID;
    if (L >= UCX_MAX_LAYERS || nb >= UCX_MAX_RUNS || l->n_tokens <= l->start_pos ||
        (l->n_tokens - l->start_pos + bs - 1) / bs != nb) {
        PD_LOG_W("kvconn: ucx: load %llu does not fit the tag layout (%d layers, %d blocks, tokens %d..%d)",
                 (unsigned long long)l->req_id, L, nb, l->start_pos, l->n_tokens);
        return PD_ERR_UNSUPPORTED;
    }
    int32_t *rows = pd_malloc(sizeof(int32_t) * (size_t)nb);
    ucx_rx *rx = pd_calloc(1, sizeof *rx);
    if (!rows || !rx) {
        pd_free(rows);
        pd_free(rx);
        return PD_ERR_NOMEM;
    }
    for (int i = 0; i < nb; i++) rows[i] = PD_MIN(bs, l->n_tokens - (l->start_pos + i * bs));
    int n_runs = 0;
    for (int i = 0; i < nb; i = run_end(l->dst_blocks, rows, nb, bs, i) + 1) n_runs++;
    rx->req_id = l->req_id;
    ucx_bind(u);  // (receives into a CUDA pool: this thread's context)
    rx->reqs = pd_calloc((size_t)(2 * L * n_runs), sizeof(void *));
    rx->want = pd_calloc((size_t)(2 * L * n_runs), sizeof(size_t));
    pd_status st = rx->reqs && rx->want ? PD_OK : PD_ERR_NOMEM;
    for (int ly = 0; ly < L && st == PD_OK; ly++)
        for (int kv = 0; kv < 2 && st == PD_OK; kv++) {
            char *base = kv ? k->v[ly] : k->k[ly];
            int run = 0;
            for (int i = 0; i < nb && st == PD_OK; run++) {
                int j = run_end(l->dst_blocks, rows, nb, bs, i);
                size_t n = (size_t)(j - i) * bb + (size_t)rows[j] * k->row_bytes;
                ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH | UCP_OP_ATTR_FIELD_MEMORY_TYPE,
                                          .memh = u->memh, .memory_type = u->mem_type};
                void *r = ucp_tag_recv_nbx(u->worker, base + (size_t)l->dst_blocks[i] * bb, n,
                                           kv_tag(l->req_id, ly, kv, run), ~(ucp_tag_t)0, &rp);
                if (r == NULL || UCS_PTR_IS_ERR(r)) {
                    PD_LOG_W("kvconn: ucx: posting a receive for load %llu: %s", (unsigned long long)l->req_id,
                             r ? ucs_status_string(UCS_PTR_STATUS(r)) : "no request");
                    st = PD_ERR_IO;
                    break;
                }
                rx->reqs[rx->n] = r;
                rx->want[rx->n++] = n;
                i = j + 1;
            }
        }
    pd_free(rows);
    if (st) {
        rx_drain(u, rx, pd_time_us() + 1000000);
        rx_free(rx);
        return st;
    }
    pthread_mutex_lock(&u->rx_mu);
    rx->next = u->rx;
    u->rx = rx;
    __atomic_add_fetch(&u->n_rx, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&u->rx_mu);
    return PD_OK;
}

// Decode role: the load's RESULT (session I/O thread). PD_OK: every receive must complete, OK and
// exactly as long as posted, before the deadline; anything else (or a failed load) cancels them.
static void ucx_load_end(pd_kvconn *c, uint64_t req_id, pd_status *status, char *reason, size_t reason_len) {
    ucx_state *u = c->tstate;
    if (!u || !u->is_tag) return;
    pthread_mutex_lock(&u->rx_mu);
    ucx_rx **pp = &u->rx;
    while (*pp && (*pp)->req_id != req_id) pp = &(*pp)->next;
    ucx_rx *rx = *pp;
    if (rx) *pp = rx->next;
    pthread_mutex_unlock(&u->rx_mu);
    if (!rx) return;
    if (*status == PD_OK) {
        // The sender's rendezvous sends ended before its DONE left (our gets were done): what is
        // left is progress, or eager messages still in flight. Bounded (this is an I/O thread).
        int64_t deadline = pd_time_us() + (int64_t)PD_MIN(c->p.timeout_ms, 5000) * 1000;
        for (int i = 0; i < rx->n && *status == PD_OK; i++) {
            ucp_tag_recv_info_t info = {0};
            ucs_status_t s;
            while ((s = ucp_tag_recv_request_test(rx->reqs[i], &info)) == UCS_INPROGRESS && pd_time_us() < deadline)
                wk_progress(u);
            if (s == UCS_OK && info.length == rx->want[i]) continue;
            // message i: layer i / (2 runs), K|V — i follows the posting order (layer, kv, run)
            *status = s == UCS_INPROGRESS ? PD_ERR_TIMEOUT : PD_ERR_PROTO;
            if (s == UCS_OK)
                snprintf(reason, reason_len, "ucx: KV message (tag %#llx) of %zu bytes, %zu posted",
                         (unsigned long long)info.sender_tag, info.length, rx->want[i]);
            else
                snprintf(reason, reason_len, "ucx: KV receive %d of %d: %s", i, rx->n, ucs_status_string(s));
            PD_LOG_W("kvconn: load %llu: %s", (unsigned long long)req_id, reason);
        }
    }
    int left = rx_drain(u, rx, pd_time_us() + 2000000);
    if (left) PD_LOG_E("kvconn: load %llu: %d ucx receives still running after cancel", (unsigned long long)req_id, left);
    __atomic_sub_fetch(&u->n_rx, 1, __ATOMIC_RELEASE);
    rx_free(rx);
}

// Prefill role: the peer did not take our sends in time: force-close its endpoint (its requests
// end with an error, so nothing reads our rows afterwards); its later saves fail at once.
static void cut_off(ucx_state *u, ucx_peer *q) {
    __atomic_store_n(&q->failed, 1, __ATOMIC_RELEASE);
    if (!q->ep) return;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    wait_req(u, ucp_ep_close_nbx(q->ep, &rp), pd_time_us() + 2000000);
    q->ep = NULL;
}

// Waits for n send requests until deadline_us (freeing each as it ends); the first failure in *st.
static int sends_wait(ucx_state *u, ucx_peer *q, void **reqs, int n, int64_t deadline_us, ucs_status_t *st) {
    int left = n;
    while (left > 0) {
        wk_progress(u);
        left = 0;
        for (int i = 0; i < n; i++) {
            if (!reqs[i]) continue;
            ucs_status_t s = ucp_request_check_status(reqs[i]);
            if (s == UCS_INPROGRESS) {
                left++;
                continue;
            }
            if (s != UCS_OK && *st == UCS_OK) *st = s;
            ucp_request_free(reqs[i]);
            reqs[i] = NULL;
        }
        if (left && (pd_time_us() > deadline_us || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE))) break;
    }
    return left;
}

// Prefill role, tag path: one save's sends.
typedef struct ucx_tx {
    void **reqs;          // (cap) posted sends not yet ended
    int n_req, cap, n_runs;
    int layers_sent;      // layers [0, layers_sent) are posted
    bool gather;          // a run's source blocks are not consecutive: everything goes from a staging copy
    int debug_length;     // test hook: the first message is this many rows longer (PD_UCX_DEBUG_LENGTH)
    pd_buffer *stage;
    size_t stage_cap;
    char *sbase;          // the staging copy (gather), block i of the request at i: K0 V0 K1 V1 ...
} ucx_tx;

static ucx_tx *tx_of(pd_kvconn *c, pd_kvconn_save *s) {
    if (s->tsave) return s->tsave;
    const pd_kvconn_cache *k = &c->p.cache;
    int L = k->n_layers, nb = s->n_blocks;
    if (L >= UCX_MAX_LAYERS || nb <= 0 || nb >= UCX_MAX_RUNS) return NULL;
    ucx_tx *tx = pd_calloc(1, sizeof *tx);
    if (!tx) return NULL;
    for (int i = 0; i < nb;) {  // runs as the decode side cut them
        int j = run_end(s->dst, s->rows, nb, k->block_size, i);
        for (int m = i; m < j; m++) tx->gather |= s->src[m + 1] != s->src[m] + 1;
        tx->n_runs++;
        i = j + 1;
    }
    ucx_state *u = c->tstate;
    if (u->is_gather_forced) tx->gather = true;
    if (u->debug_length && ++u->n_tag_saves % 3 == 0) tx->debug_length = u->debug_length;
    tx->cap = 2 * L * tx->n_runs;
    tx->reqs = pd_calloc((size_t)tx->cap, sizeof(void *));
    if (!tx->reqs) {
        pd_free(tx);
        return NULL;
    }
    s->tsave = tx;
    return tx;
}

// Posts the sends of layers [tx->layers_sent, l_end), checking the connection before each layer
// (the fence: a writer whose connection ended stops there). Their rows must be computed.
static pd_status tx_send_layers(pd_kvconn *c, pd_kvconn_save *s, ucx_state *u, ucx_peer *q, ucx_tx *tx, int l_end) {
    const pd_kvconn_cache *k = &c->p.cache;
    int bs = k->block_size, nb = s->n_blocks;
    size_t bb = k->row_bytes * (size_t)bs, lbytes = (size_t)nb * bb;
    ucx_bind(u);  // (sends from a CUDA pool: this thread's context)
    for (int ly = tx->layers_sent; ly < l_end; ly++) {
        if (!q->ep || !pd_xfer_server_conn_alive(c->xs, s->conn_id) || __atomic_load_n(&q->failed, __ATOMIC_ACQUIRE))
            return PD_ERR_CLOSED;
        for (int kv = 0; kv < 2; kv++) {
            const char *src = kv ? k->v[ly] : k->k[ly];
            int run = 0;
            for (int i = 0; i < nb; run++) {
                int j = run_end(s->dst, s->rows, nb, bs, i);
                size_t n = (size_t)(j - i) * bb + (size_t)s->rows[j] * k->row_bytes;
                if (tx->debug_length && ly == 0 && kv == 0 && run == 0 && n > k->row_bytes)  // (K0 is followed by V0:
                    n = tx->debug_length > 0 ? n + k->row_bytes : n - k->row_bytes;          // one more row is readable)
                const char *from = tx->sbase ? tx->sbase + (size_t)(2 * ly + kv) * lbytes + (size_t)i * bb
                                             : src + (size_t)s->src[i] * bb;
                ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMORY_TYPE | (tx->sbase ? 0 : UCP_OP_ATTR_FIELD_MEMH),
                                          .memh = u->src_memh, .memory_type = u->mem_type};
                void *r = ucp_tag_send_nbx(q->ep, from, n, kv_tag(s->peer_req_id, ly, kv, run), &rp);
                if (UCS_PTR_IS_ERR(r)) {
                    PD_LOG_W("kvconn: request %llu: ucx send: %s", (unsigned long long)s->peer_req_id,
                             ucs_status_string(UCS_PTR_STATUS(r)));
                    return PD_ERR_IO;
                }
                if (r) tx->reqs[tx->n_req++] = r;
                i = j + 1;
            }
        }
        tx->layers_sent = ly + 1;
        wk_progress(u);
        if (ly == k->n_layers / 2) kvc_debug_pause(c, "mid_slab");
    }
    return PD_OK;
}

// Waits for every posted send of the save (rendezvous: the peer's get of our rows is done) until
// deadline_us; a peer that does not take them in time is cut off.
static pd_status tx_wait(ucx_state *u, ucx_peer *q, ucx_tx *tx, uint64_t req_id, int64_t deadline_us) {
    if (!tx->n_req) return PD_OK;
    ucs_status_t us = UCS_OK;
    int left = sends_wait(u, q, tx->reqs, tx->n_req, deadline_us, &us);
    pd_status st = PD_OK;
    if (left) {
        PD_LOG_W("kvconn: request %llu: %d of %d ucx sends not taken in time: cutting the decode worker off",
                 (unsigned long long)req_id, left, tx->n_req);
        cut_off(u, q);
        sends_wait(u, q, tx->reqs, tx->n_req, pd_time_us() + 2000000, &us);
        for (int i = 0; i < tx->n_req; i++)
            if (tx->reqs[i]) ucp_request_free(tx->reqs[i]);
        st = PD_ERR_TIMEOUT;
    } else if (us != UCS_OK) {
        PD_LOG_W("kvconn: request %llu: ucx send failed: %s", (unsigned long long)req_id, ucs_status_string(us));
        st = PD_ERR_IO;
    }
    tx->n_req = 0;
    return st;
}

static bool ucx_layerwise(pd_kvconn *c, pd_kvconn_save *s) {
    const ucx_peer *q = s->peer ? s->peer->tpriv : NULL;
    return q && q->is_tag;
}

// Tag path, layer l's hook (engine thread; l's KV write is enqueued on the compute stream): the
// mark waits until layer l-1's compute is done (bounded run-ahead, backend.h), so layers < l are
// sent now and travel while the forward pass goes on. A save that needs a gather sends at the end.
static void ucx_save_layer(pd_kvconn *c, pd_kvconn_save *s, int l) {
    ucx_state *u = c->tstate;
    ucx_peer *q = s->peer->tpriv;
    ucx_tx *tx = tx_of(c, s);
    if (!tx) {
        s->st = PD_ERR_NOMEM;
        return;
    }
    if (tx->gather) return;
    if (c->is_mark_due) {
        pd_backend_xfer_mark(c->p.backend);
        c->is_mark_due = false;
    }
    int64_t t0 = pd_time_us();
    s->st = tx_send_layers(c, s, u, q, tx, l);
    s->copy_us += pd_time_us() - t0;
}

// The corrupted-handoff test hook (kvconn params corrupt_every): flips one bit of the byte at
// `at` in the sender's device or host cache and returns its old value (restored after the send).
static uint8_t flip_test_bit(pd_kvconn *c, char *at) {
    uint8_t x, orig;
    pd_backend_download(c->p.backend, &x, at, 1);
    orig = x;
    x ^= 0x40;
    pd_backend_upload(c->p.backend, at, &x, 1);
    pd_backend_sync(c->p.backend);
    return orig;
}

static pd_status tag_save_rest(pd_kvconn *c, pd_kvconn_save *s, ucx_state *u, ucx_peer *q) {
    const pd_kvconn_cache *k = &c->p.cache;
    int L = k->n_layers, bs = k->block_size, nb = s->n_blocks;
    size_t bb = k->row_bytes * (size_t)bs, lbytes = (size_t)nb * bb;
    int64_t t0 = pd_time_us(), deadline = t0 + (int64_t)c->p.timeout_ms * 1000;
    ucx_tx *tx = tx_of(c, s);
    if (!tx) return PD_ERR_NOMEM;
    // The forward pass wrote the rows on the compute stream; UCX's copies run on its own streams.
    pd_backend_sync(c->p.backend);
    // test hook: one flipped bit in the last layer's V rows (sent here), restored after
    char *corrupt_at = s->is_corrupt ? (char *)k->v[L - 1] + (size_t)s->src[0] * bb : NULL;
    uint8_t corrupt_orig = corrupt_at ? flip_test_bit(c, corrupt_at) : 0;
    pd_status st = PD_OK;
    if (tx->gather) {  // the request's rows into a staging copy, then every run from there
        int64_t n_g = __atomic_add_fetch(&u->n_gathers, 1, __ATOMIC_RELAXED);
        if (n_g <= 4 || (n_g & (n_g - 1)) == 0)
            PD_LOG_I("kvconn: request %llu: source blocks not consecutive, sent from a staging copy (%lld such saves)",
                     (unsigned long long)s->peer_req_id, (long long)n_g);
        tx->stage = kvc_stage_take(c->p.backend, &c->nccl_stage, 2 * (size_t)L * lbytes, &tx->stage_cap);
        void **dk = pd_malloc(sizeof(void *) * (size_t)L), **dv = pd_malloc(sizeof(void *) * (size_t)L);
        int32_t *idx = pd_malloc(sizeof(int32_t) * (size_t)nb);
        if (!tx->stage || !dk || !dv || !idx) st = PD_ERR_NOMEM;
        else {
            tx->sbase = pd_buffer_ptr(tx->stage);
            for (int ly = 0; ly < L; ly++) {
                dk[ly] = tx->sbase + (size_t)(2 * ly) * lbytes;
                dv[ly] = tx->sbase + (size_t)(2 * ly + 1) * lbytes;
            }
            for (int i = 0; i < nb; i++) idx[i] = i;
            pd_kv_copy_params kp = {.src_k = k->k, .src_v = k->v, .dst_k = dk, .dst_v = dv, .src_blocks = s->src,
                                    .dst_blocks = idx, .n_rows = s->rows, .n_blocks = nb, .layer_begin = 0,
                                    .layer_end = L, .block_size = bs, .row_bytes = k->row_bytes};
            pd_op_kv_copy(c->p.backend, &kp);
            pd_backend_sync(c->p.backend);
        }
        pd_free(dk);
        pd_free(dv);
        pd_free(idx);
    }
    if (st == PD_OK) st = tx_send_layers(c, s, u, q, tx, L);
    pd_status ws = tx_wait(u, q, tx, s->peer_req_id, st == PD_OK ? deadline : pd_time_us() + 2000000);
    if (st == PD_OK) st = ws;
    if (corrupt_at) {
        pd_backend_upload(c->p.backend, corrupt_at, &corrupt_orig, 1);
        pd_backend_sync(c->p.backend);
    }
    if (st == PD_OK) {
        pd_kv_checksum_params cp = {.k = k->k, .v = k->v, .blocks = s->src, .n_rows = s->rows, .n_blocks = nb,
                                    .layer_begin = 0, .layer_end = L, .block_size = bs, .row_bytes = k->row_bytes,
                                    .sums = s->sums};
        pd_op_kv_checksum(c->p.backend, &cp);
        s->n_layers_saved = L;
    }
    s->copy_us += pd_time_us() - t0;
    return st;
}

// The save ends (done or failed): sends still posted (a step that failed after layer-wise sends)
// end first, or the peer is cut off, so nothing reads our rows or the staging copy afterwards.
static void ucx_save_free(pd_kvconn *c, pd_kvconn_save *s) {
    ucx_tx *tx = s->tsave;
    if (!tx) return;
    ucx_state *u = c->tstate;
    kvc_peer *p = kvc_peer_of(c, s->conn_id);
    ucx_peer *q = p && p == s->peer ? p->tpriv : NULL;
    if (tx->n_req && u && q) tx_wait(u, q, tx, s->peer_req_id, pd_time_us() + 2000000);
    else  // the peer is gone: detaching it force-closed its endpoint, which ended these sends
        for (int i = 0; i < tx->n_req; i++)
            if (tx->reqs[i]) ucp_request_free(tx->reqs[i]);
    if (tx->stage) kvc_stage_give(&c->nccl_stage, tx->stage, tx->stage_cap);
    pd_free(tx->reqs);
    pd_free(tx);
    s->tsave = NULL;
}

static pd_status ucx_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    const pd_kvconn_cache *k = &c->p.cache;
    ucx_state *u = c->tstate;
    kvc_peer *p = s->peer;
    ucx_peer *q = p->tpriv;
    if (!u || !q) return PD_ERR_CLOSED;
    if (q->is_tag) return tag_save_rest(c, s, u, q);
    int L = k->n_layers, bs = k->block_size, l0 = s->n_layers_saved;
    size_t bb = k->row_bytes * (size_t)bs, stride = (size_t)p->n_blocks * bb;
    int64_t t0 = pd_time_us(), deadline = t0 + (int64_t)c->p.timeout_ms * 1000;
    pd_status st = PD_OK;
    // The forward pass wrote the rows on the compute stream; UCX's copies run on its own streams.
    if (u->mem_type == UCS_MEMORY_TYPE_CUDA) pd_backend_sync(c->p.backend);
    // Test hook: one flipped bit in the last layer's V rows, put with the rest and restored after
    // the flush, before the checksums (the decode side must catch it).
    char *corrupt_at = s->is_corrupt ? (char *)k->v[L - 1] + (size_t)s->src[0] * bb : NULL;
    uint8_t corrupt_orig = corrupt_at ? flip_test_bit(c, corrupt_at) : 0;
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
        wk_progress(u);
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
    .layerwise = ucx_layerwise,
    .save_layer = ucx_save_layer,
    .save_rest = ucx_save_rest,
    .save_free = ucx_save_free,
    .load_post = ucx_load_post,
    .load_end = ucx_load_end,
    .fini = ucx_fini,
};
