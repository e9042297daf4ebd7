// nccl.c — the CUDA backend's device messaging (pd_comm_*, backend.h) over NCCL.
//
// Design:
//   * NCCL is loaded with dlopen("libnccl.so.2") on first use and only the functions used here are
//     looked up: a CUDA build still runs where NCCL is not installed, and the nccl transport then
//     fails clearly ("nccl transport unavailable: <dlerror>"). nccl.h is included for its types and
//     the config initializer only; nothing links against libnccl.
//   * Communicators are non-blocking (config.blocking = 0): init, send and recv return at once and
//     every wait polls ncclCommGetAsyncError and cudaStreamQuery against a deadline, so a dead or
//     hung peer ends in ncclCommAbort (which also ends NCCL kernels waiting for it), never in a hang.
//   * Each comm owns a stream on the backend's device. A send is ordered after the work already on
//     the backend's stream through an event (its data was produced there), or after the transfer
//     stream's (pd_comm_send_after_xfer: a layer gathered there); receives and the scatter
//     (kv_copy, with descriptors staged in the comm's own scratch) never touch the backend's stream,
//     so the compute stream never waits for the other side's progress.
#include <dlfcn.h>
#include <nccl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "backend/cuda/nccl.h"
#include "kernels/kv_xfer.cuh"

_Static_assert(sizeof(ncclUniqueId) == PD_COMM_ID_BYTES, "ncclUniqueId does not fit pd_comm_id");

static struct {
    ncclResult_t (*get_unique_id)(ncclUniqueId *id);
    ncclResult_t (*init_rank_config)(ncclComm_t *comm, int n, ncclUniqueId id, int rank, ncclConfig_t *cfg);
    ncclResult_t (*async_error)(ncclComm_t comm, ncclResult_t *r);
    ncclResult_t (*abort)(ncclComm_t comm);
    ncclResult_t (*send)(const void *buf, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
    ncclResult_t (*recv)(void *buf, size_t n, ncclDataType_t t, int peer, ncclComm_t comm, cudaStream_t s);
    const char *(*error_string)(ncclResult_t r);
    ncclResult_t (*get_version)(int *v);
    bool ok;
    char why[256];
} nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;

static void nccl_load(void) {
    void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(nccl.why, sizeof nccl.why, "%s", e ? e : "dlopen(libnccl.so.2) failed");
        return;
    }
    struct {
        void **fn;
        const char *name;
    } syms[] = {
        {(void **)&nccl.get_unique_id, "ncclGetUniqueId"}, {(void **)&nccl.init_rank_config, "ncclCommInitRankConfig"},
        {(void **)&nccl.async_error, "ncclCommGetAsyncError"}, {(void **)&nccl.abort, "ncclCommAbort"},
        {(void **)&nccl.send, "ncclSend"}, {(void **)&nccl.recv, "ncclRecv"},
        {(void **)&nccl.error_string, "ncclGetErrorString"}, {(void **)&nccl.get_version, "ncclGetVersion"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(syms); i++) {
        *syms[i].fn = dlsym(h, syms[i].name);
        if (!*syms[i].fn) {
            snprintf(nccl.why, sizeof nccl.why, "libnccl.so.2 has no %s", syms[i].name);
            return;
        }
    }
    int v = 0;
    nccl.get_version(&v);
    PD_LOG_I("cuda: NCCL %d.%d.%d loaded", v / 10000, v / 100 % 100, v % 100);
    nccl.ok = true;
}

static bool nccl_ready(pd_err *err) {
    pthread_once(&nccl_once, nccl_load);
    if (!nccl.ok) pd_err_set(err, PD_ERR_UNSUPPORTED, "nccl transport unavailable: %s", nccl.why);
    return nccl.ok;
}

#define POST_MS 20000  // bound on enqueuing one send / receive (incl. connecting to the peer)

typedef struct nccl_comm {
    pd_cuda_backend *cb;  // borrowed
    ncclComm_t comm;      // NULL once aborted
    cudaStream_t stream;
    cudaEvent_t ev;       // send: "the backend stream has produced the data"
    void *kv_dev;         // kv_copy descriptors (device)
    size_t kv_dev_bytes;
} nccl_comm;

static void nap(void) {
    struct timespec ts = {0, 20000};  // 20 us: transfers of interest take milliseconds
    nanosleep(&ts, NULL);
}

// Aborts the communicator and fills err. Later calls fail with "aborted".
static pd_status comm_fail(nccl_comm *c, pd_status st, pd_err *err, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->comm) nccl.abort(c->comm);
    c->comm = NULL;
    return pd_err_set(err, st, "nccl: %s", msg);
}

pd_status pd_cuda_comm_id_new(pd_backend *b, pd_comm_id *out, pd_err *err) {
    if (!nccl_ready(err)) return PD_ERR_UNSUPPORTED;
    if (!out) return PD_OK;
    pd_cuda_bind(pd_cuda_backend_of(b));
    ncclUniqueId id;
    ncclResult_t r = nccl.get_unique_id(&id);
    if (r != ncclSuccess) return pd_err_set(err, PD_ERR_DEVICE, "nccl: ncclGetUniqueId: %s", nccl.error_string(r));
    memcpy(out->bytes, &id, sizeof id);
    return PD_OK;
}

void pd_cuda_comm_free(pd_backend *b, void *p) {
    nccl_comm *c = p;
    if (!c) return;
    pd_cuda_bind(c->cb);
    if (c->comm) nccl.abort(c->comm);  // also ends operations still waiting for the peer
    if (c->stream) cudaStreamSynchronize(c->stream);
    if (c->kv_dev) cudaFree(c->kv_dev);
    if (c->ev) cudaEventDestroy(c->ev);
    if (c->stream) cudaStreamDestroy(c->stream);
    cudaGetLastError();
    pd_free(c);
}

// Polls until nothing is in progress and the comm's stream is idle, or the deadline.
static pd_status comm_drain(nccl_comm *c, int64_t deadline_us, const char *what, pd_err *err) {
    for (;;) {
        ncclResult_t r = ncclInProgress, q = nccl.async_error(c->comm, &r);
        if (q != ncclSuccess) r = q;
        if (r != ncclSuccess && r != ncclInProgress) return comm_fail(c, PD_ERR_DEVICE, err, "%s: %s", what, nccl.error_string(r));
        if (r == ncclSuccess) {
            cudaError_t e = cudaStreamQuery(c->stream);
            if (e == cudaSuccess) return PD_OK;
            if (e != cudaErrorNotReady) {
                cudaGetLastError();
                return comm_fail(c, PD_ERR_DEVICE, err, "%s: %s", what, cudaGetErrorString(e));
            }
        }
        if (pd_time_us() > deadline_us) return comm_fail(c, PD_ERR_TIMEOUT, err, "%s: the peer did not take part in time", what);
        nap();
    }
}

void *pd_cuda_comm_new(pd_backend *b, const pd_comm_id *id, int n_ranks, int rank, int timeout_ms, pd_err *err) {
    if (!nccl_ready(err)) return NULL;
    pd_cuda_backend *cb = pd_cuda_backend_of(b);
    pd_cuda_bind(cb);
    nccl_comm *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    c->cb = cb;
    cudaError_t e = cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking);
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&c->ev, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        pd_err_set(err, PD_ERR_DEVICE, "nccl: stream: %s", cudaGetErrorString(e));
        pd_cuda_comm_free(b, c);
        return NULL;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclUniqueId uid;
    memcpy(&uid, id->bytes, sizeof uid);
    int64_t deadline = pd_time_us() + (int64_t)timeout_ms * 1000;
    ncclResult_t r = nccl.init_rank_config(&c->comm, n_ranks, uid, rank, &cfg);
    pd_status st = PD_OK;
    if (r != ncclSuccess && r != ncclInProgress) st = comm_fail(c, PD_ERR_DEVICE, err, "init: %s", nccl.error_string(r));
    else st = comm_drain(c, deadline, "joining the communicator", err);
    if (st) {
        pd_cuda_comm_free(b, c);
        return NULL;
    }
    return c;
}

pd_status pd_cuda_comm_post(pd_backend *b, void *p, void *buf, size_t n, int peer, int op, pd_err *err) {
    nccl_comm *c = p;
    if (!c->comm) return pd_err_set(err, PD_ERR_DEVICE, "nccl: the communicator was aborted");
    pd_cuda_bind(c->cb);
    bool is_send = op != PD_COMM_OP_RECV;
    if (is_send) {  // after the stream that produced the data (the compute or the transfer stream)
        cudaStream_t after = op == PD_COMM_OP_SEND_XFER ? pd_cuda_xfer_stream(c->cb) : c->cb->stream;
        PD_CUDA_CHECK(cudaEventRecord(c->ev, after));
        PD_CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->ev, 0));
    }
    ncclResult_t r = is_send ? nccl.send(buf, n, ncclUint8, peer, c->comm, c->stream)
                             : nccl.recv(buf, n, ncclUint8, peer, c->comm, c->stream);
    if (r != ncclSuccess && r != ncclInProgress)
        return comm_fail(c, PD_ERR_DEVICE, err, "%s: %s", is_send ? "send" : "recv", nccl.error_string(r));
    // ncclInProgress: the non-blocking comm is still enqueuing it (the first operation with a peer
    // also connects to it). The next call on the comm must wait until that is done, so it is
    // waited for here (bounded: a peer that never connects aborts the comm); the transfer itself
    // is not (pd_cuda_comm_wait).
    int64_t deadline = pd_time_us() + POST_MS * 1000;
    while (r == ncclInProgress) {
        ncclResult_t q = nccl.async_error(c->comm, &r);
        if (q != ncclSuccess) r = q;
        if (r != ncclSuccess && r != ncclInProgress)
            return comm_fail(c, PD_ERR_DEVICE, err, "%s: %s", is_send ? "send" : "recv", nccl.error_string(r));
        if (r == ncclInProgress && pd_time_us() > deadline)
            return comm_fail(c, PD_ERR_TIMEOUT, err, "%s: not enqueued within %d ms", is_send ? "send" : "recv", POST_MS);
        if (r == ncclInProgress) nap();
    }
    return PD_OK;
}

pd_status pd_cuda_comm_wait(pd_backend *b, void *p, int timeout_ms, pd_err *err) {
    nccl_comm *c = p;
    if (!c->comm) return pd_err_set(err, PD_ERR_DEVICE, "nccl: the communicator was aborted");
    pd_cuda_bind(c->cb);
    return comm_drain(c, pd_time_us() + (int64_t)timeout_ms * 1000, "transfer", err);
}

// Same as the backend's kv_copy, on the comm's stream with the comm's descriptor scratch.
void pd_cuda_comm_kv_copy(pd_backend *b, void *p, const pd_kv_copy_params *kp) {
    nccl_comm *c = p;
    int nl = kp->layer_end - kp->layer_begin;
    if (!c->comm || kp->n_blocks <= 0 || nl <= 0) return;
    pd_cuda_bind(c->cb);
    size_t off, n;
    char *host = pd_cuda_kv_copy_pack(kp, &off, &n);  // sets n: not in pd_cuda_stage's argument list
    char *dev = pd_cuda_stage(c->stream, &c->kv_dev, &c->kv_dev_bytes, host, n, 0);
    pd_kv_copy_kparams k = {.ptrs = (void *const *)dev, .blocks = (const pd_kv_block_desc *)(dev + off),
                            .n_blocks = kp->n_blocks, .n_layers = nl, .block_size = kp->block_size, .row_bytes = kp->row_bytes};
    pd_cuda_kv_copy(&k, c->stream);
    PD_CUDA_CHECK_LAUNCH();
}
