// xfer — moving a prompt's KV cache from a prefill worker into a decode worker (the KV connector).
//
// Two halves that share only the wire protocol (wire/kv.h, docs/kv-wire-format.md):
//   * pd_xfer_client — decode side. Holds a connection to each prefill worker, sends PREFILL_REQ
//     (prompt, first position wanted, the decode blocks reserved for it) and reports one result per
//     request: DONE (first token + per-layer checksums; with the tcp transport the KV rows arrived
//     as KV_SLAB frames and were written into the reserved blocks), or a failure (the worker said
//     FAIL, died, stopped answering pings, or the request timed out).
//   * pd_xfer_server — prefill side. Accepts decode workers, checks their fingerprint, and hands
//     their PREFILL_REQ / CANCEL / disconnects to the engine; the engine answers through
//     pd_xfer_server_send.
//
// Transports (pd_kvw_transport): tcp sends KV rows inline; shm and cuda-ipc let the prefill
// worker write straight into the decode worker's pool (exported once, in HELLO), so only control
// frames cross the socket; nccl moves each request's KV as one slab through a 2-rank NCCL
// communicator (GPU to GPU, same host or not). In every case the decode side verifies the
// checksums on its own blocks before decoding from them (disagg.c), so corrupt or partial KV falls
// back to a local prefill.
//
// nccl: the decode side makes an NCCL unique id per connection and sends it in HELLO; after
// HELLO_ACK both I/O threads join the communicator (decode rank 0, prefill rank 1; bounded wait).
// The prefill engine gathers a request's rows into a device staging slab on its stream, announces
// it on the socket (KV_NCCL: request, geometry, bytes) and ncclSends it on the communicator's own
// stream; the decode I/O thread posts the matching ncclRecv in announcement order (so both sides
// post in the same order), then scatters the slab into the reserved blocks on the same stream.
// Every wait is bounded: on a timeout the communicator is aborted and the connection dropped, so
// in-flight requests fail (local prefill) and the next connection bootstraps a new communicator.
//
// Timeouts never free blocks a worker may still write: a request whose deadline passes is
// cancelled (CANCEL) but stays registered — its destination blocks stay reserved — until the
// worker answers (DONE or FAIL, reported as a timeout) or the connection dies; a worker that does
// not answer within cancel_grace_ms is treated as dead (connection dropped). KV_SLAB / KV_NCCL data
// for a timed-out request is never written into its blocks.
//
// Threads: each connection has one I/O thread that reads frames (blocking, with a poll timeout for
// pings and deadlines). Sends take a per-connection mutex, so the engine thread may send while the
// I/O thread reads. Results and requests are delivered through a callback on the I/O thread; the
// engine copies them into its command queue (engine/queue.c) and acts on its own thread.
//
// What is deliberately not here: tcp into a GPU pool (the I/O thread would have
// to upload into device memory it does not own): tcp is for CPU pools; GPUs use cuda-ipc.
#pragma once
#include "backend/backend.h"
#include "base/base.h"
#include "wire/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_XFER_API_VERSION 2  // 2: nccl transport, backend + cancel_grace_ms params
#define PD_XFER_MAX_WORKERS 16

typedef enum pd_xfer_event_kind {
    PD_XFER_EV_RESULT = 1,   // client: a prefill request ended (ok or not)
    PD_XFER_EV_HELLO = 2,    // server: a decode worker connected (hello filled)
    PD_XFER_EV_REQUEST = 3,  // server: PREFILL_REQ (req owned by the event: pd_xfer_event_fini)
    PD_XFER_EV_CANCEL = 4,   // server: CANCEL
    PD_XFER_EV_CLOSED = 5,   // server: the decode worker went away
} pd_xfer_event_kind;

typedef struct pd_xfer_event {
    pd_xfer_event_kind kind;
    int conn_id;             // server: which decode worker; client: which prefill worker
    uint64_t req_id;
    pd_status status;        // RESULT: PD_OK, PD_ERR_CLOSED, PD_ERR_TIMEOUT, PD_ERR_PROTO, PD_ERR_INVALID
    char reason[160];        // RESULT when not OK
    pd_kvw_prefill_done done;  // RESULT ok
    pd_kvw_hello hello;        // HELLO
    pd_kvw_prefill_req req;    // REQUEST: tokens/dst_blocks point into owned
    int32_t *owned;
} pd_xfer_event;
void pd_xfer_event_fini(pd_xfer_event *ev);

// Called on an I/O thread. The callee must copy what it keeps (it may move ev->owned: set it to
// NULL then). Must not block for long.
typedef void (*pd_xfer_event_fn)(void *ud, pd_xfer_event *ev);

// ---- decode side -------------------------------------------------------------------------------
// Where incoming tcp slabs are written: the decode worker's KV pool (host memory: CPU backend).
typedef struct pd_xfer_pool {
    int n_layers, n_blocks, block_size;
    size_t row_bytes;           // n_kv_heads * head_dim * elem
    void **k, **v;              // (n_layers) layer bases; borrowed
} pd_xfer_pool;

typedef struct pd_xfer_client_params {
    int n_workers;
    const char *addrs[PD_XFER_MAX_WORKERS];  // "host:port" of prefill workers (copied)
    pd_kvw_transport transport;
    pd_kvw_fingerprint fp;
    pd_buffer_handle pool_handle;            // shm / cuda-ipc: the exported decode pool
    pd_xfer_pool pool;                       // tcp, nccl: where slabs land (nccl: device pointers)
    pd_backend *backend;                     // nccl: the decode pool's backend (borrowed)
    int timeout_ms;                          // per request (default 30000)
    int cancel_grace_ms;                     // after a timeout, wait this long for the worker's answer
                                             // before dropping the connection (default 10000)
    int ping_ms;                             // heartbeat period (default 500); dead after 4 missed
    int max_inflight;                        // per worker before it counts as saturated (default 64)
    pd_xfer_event_fn on_event;
    void *ud;
} pd_xfer_client_params;

typedef struct pd_xfer_client pd_xfer_client;
// Starts connecting (in the background). NULL with err on bad params.
pd_xfer_client *pd_xfer_client_new(const pd_xfer_client_params *p, pd_err *err);
void pd_xfer_client_free(pd_xfer_client *c);  // fails nothing: pending requests are dropped
// Sends a prefill request to the least-loaded healthy worker.
//   PD_OK       sent; exactly one RESULT event will follow
//   PD_NOSPACE  no worker is connected, or all are saturated (prefill locally instead)
pd_status pd_xfer_client_prefill(pd_xfer_client *c, const pd_kvw_prefill_req *req);
// Asks the worker to drop a request. Its RESULT still comes (FAIL "cancelled", or DONE if the KV was
// already written, or a failure): only then are the destination blocks safe to reuse.
void pd_xfer_client_cancel(pd_xfer_client *c, uint64_t req_id);
int pd_xfer_client_n_healthy(pd_xfer_client *c);

// ---- prefill side ------------------------------------------------------------------------------
typedef struct pd_xfer_server_params {
    const char *host;   // bind address (default 127.0.0.1)
    int port;           // 0 = any free port (see pd_xfer_server_port)
    pd_kvw_fingerprint fp;
    pd_backend *backend;  // nccl: the prefill engine's backend (borrowed); NULL refuses nccl peers
    pd_xfer_event_fn on_event;
    void *ud;
} pd_xfer_server_params;

typedef struct pd_xfer_server pd_xfer_server;
pd_xfer_server *pd_xfer_server_new(const pd_xfer_server_params *p, pd_err *err);
void pd_xfer_server_free(pd_xfer_server *s);
int pd_xfer_server_port(const pd_xfer_server *s);
// Sends a message to a connected decode worker (and, for KV_SLAB, the payload bytes after it).
// Blocking; safe from any thread. PD_ERR_CLOSED if the connection is gone.
pd_status pd_xfer_server_send(pd_xfer_server *s, int conn_id, const pd_kvw_msg *m, const void *payload);
// nccl transport: fill(ud, dev) writes the slab (slab->bytes, layout in wire/kv.h) into the
// connection's device staging buffer on the backend's stream; then the slab is announced
// (KV_NCCL) and sent through the connection's communicator. Returns when the peer has it
// (PD_OK), or fails: PD_ERR_CLOSED (no such connection / communicator), PD_ERR_NOMEM, or a
// transfer that failed or took longer than timeout_ms — then the communicator is aborted and the
// connection closed (the decode worker reconnects with a new one). Engine thread; one at a time
// per connection.
typedef void (*pd_xfer_fill_fn)(void *ud, void *dev);
pd_status pd_xfer_server_send_nccl(pd_xfer_server *s, int conn_id, const pd_kvw_kv_nccl *slab, pd_xfer_fill_fn fill,
                                   void *ud, int timeout_ms, pd_err *err);

#ifdef __cplusplus
}
#endif
