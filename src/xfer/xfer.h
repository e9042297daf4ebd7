// xfer — the KV connector's session layer: authenticated, bounded connections between a decode
// worker (client) and a prefill worker (server) speaking wire/kv.h (docs/kv-wire-format.md).
// Transports and the engine-facing interface live in src/kvconn; this module only moves frames.
//
//   * pd_xfer_client — decode side. Holds a connection to each prefill worker, sends PREFILL_REQ
//     (prompt, first position wanted, the decode blocks reserved for it) and reports one result per
//     request: DONE (first token + per-layer checksums; with the tcp transport the KV rows arrived
//     as KV_SLAB frames and were read straight into the reserved blocks), or a failure (the worker
//     said FAIL, died, stopped answering pings, or the request timed out).
//   * pd_xfer_server — prefill side. Accepts decode workers, authenticates them, checks their
//     fingerprint, and hands their PREFILL_REQ / CANCEL / disconnects to the engine; the engine
//     answers through pd_xfer_server_send, which only queues.
//
// Authentication (xfer/auth.h): the first frame on every connection is the server's
// AUTH_CHALLENGE; nothing but a correct AUTH_PROOF (HMAC-SHA256 of the shared secret over both
// nonces, read within 5 s, 88 bytes at most) is read before it, and the client checks the
// server's AUTH_OK before it sends anything about itself (fingerprint, pool). A peer that fails
// learns nothing and is disconnected; the failure is counted.
//
// Bounds: every frame's size is capped per type before it is read (wire/kv.h); a KV_SLAB payload
// must match, byte for byte, the geometry of the request it names, and is read straight into that
// request's reserved blocks (never buffered); every read and write has a deadline.
//
// Threads and locks: per connection one reader thread (frames in, events out through the callback)
// and one writer thread draining an outbound queue. The engine thread only queues (no socket I/O),
// and no lock is ever held across a blocking call. A queue over its byte cap (a peer that does not
// read) fails the send (the engine fails that request) and a write that makes no progress for
// stall_ms closes the connection.
//
// shm transport: the connection runs over the prefill worker's abstract unix socket
// "@pdserve-kv-<kv port>" (same host), and the decode pool is an anonymous memfd passed with
// SCM_RIGHTS in HELLO (after authentication): nothing in /dev/shm, no name to open.
//
// Fencing (per-connection epoch): blocks lent to a connection (a request's destination blocks)
// are handed back only when the writer acknowledged (DONE / FAIL), or when the connection is
// fenced off. tcp and nccl writes happen on this side (nothing lands once the connection is gone);
// for direct writes (shm, cuda-ipc) the prefill worker checks, before each layer, that the
// connection still exists, and the decode side waits fence_ms after the loss (or until the peer
// process has exited: pidfd from SO_PEERCRED on the unix socket) before failing the requests, so
// a late write never lands in blocks given to another request.
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

#define PD_XFER_API_VERSION 3  // 3: auth secret, queued sends, memfd pools, fences, recycled slots
#define PD_XFER_MAX_WORKERS 16
#define PD_XFER_MAX_CONNS 256                      // prefill side: concurrent decode connections
#define PD_XFER_CONN_SLOT(id) ((id) & (PD_XFER_MAX_CONNS - 1))

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
    int fd;                    // HELLO: the decode pool's memfd (shm), owned by the event; else -1
    pd_kvw_prefill_req req;    // REQUEST: tokens/dst_blocks point into owned
    int32_t *owned;
} pd_xfer_event;
void pd_xfer_event_fini(pd_xfer_event *ev);  // frees owned, closes fd

// Counters of what the session layer refused or dropped (monotonic; any thread).
typedef struct pd_xfer_counters {
    int64_t auth_failures;     // peers that did not prove the secret (or sent anything else first)
    int64_t proto_errors;      // connections closed for a malformed or out-of-bounds frame
    int64_t conns_accepted, conns_closed;
    int64_t slow_peer_drops;   // sends refused (queue over its cap) or connections closed for a stall
    int64_t fenced;            // requests failed only after their connection was fenced off
} pd_xfer_counters;

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
    const char *secret;                      // shared secret (copied); required
    pd_buffer_handle pool_handle;            // shm / cuda-ipc: the exported decode pool (shm: .fd)
    uint8_t hello_blob[PD_KVW_HANDLE_MAX];   // ucx: the HELLO handle bytes (worker address, rkey, pool)
    uint32_t hello_blob_len;
    pd_xfer_pool pool;                       // tcp, nccl: where slabs land (nccl: device pointers)
    pd_backend *backend;                     // nccl: the decode pool's backend (borrowed)
    int timeout_ms;                          // per request (default 30000)
    int cancel_grace_ms;                     // after a timeout, wait this long for the worker's answer
                                             // before dropping the connection (default 10000)
    int ping_ms;                             // heartbeat period (default 500); dead after 4 missed
    int max_inflight;                        // per worker before it counts as saturated (default 64)
    int fence_ms;                            // shm / cuda-ipc: after a lost connection, wait this long
                                             // (or until the peer exited) before its blocks return (2000)
    pd_xfer_event_fn on_event;
    void *ud;
    // Cluster mode's prefill work queue (PD_XFER_QUEUE below): called (on the caller's thread, no
    // lock held) when a request is queued, to publish the job. NULL: no queueing.
    void (*on_enqueue)(void *ud, uint64_t req_id, int n_tokens);
    void *enqueue_ud;
} pd_xfer_client_params;

typedef struct pd_xfer_client pd_xfer_client;
// Starts connecting (in the background). NULL with err on bad params.
pd_xfer_client *pd_xfer_client_new(const pd_xfer_client_params *p, pd_err *err);
void pd_xfer_client_free(pd_xfer_client *c);  // fails nothing: pending requests are dropped
void pd_xfer_client_counters(pd_xfer_client *c, pd_xfer_counters *out);
// Sends (queues) a prefill request to the least-loaded healthy worker.
//   PD_OK       sent; exactly one RESULT event will follow
//   PD_NOSPACE  no worker is connected, or all are saturated (prefill locally instead)
pd_status pd_xfer_client_prefill(pd_xfer_client *c, const pd_kvw_prefill_req *req);
// The same, to worker worker_idx (-1: the least loaded). PD_NOSPACE if that one is unhealthy or saturated.
// worker_idx PD_XFER_QUEUE: queued for whichever prefill worker claims it (cluster mode's work
// queue): registered without a worker (its blocks stay reserved), on_enqueue publishes the job,
// and pd_xfer_client_claim later sends the PREFILL_REQ to the claimer; unclaimed at its deadline
// it ends with a timeout RESULT (nobody wrote its blocks). Exactly one RESULT follows either way.
pd_status pd_xfer_client_prefill_on(pd_xfer_client *c, int worker_idx, const pd_kvw_prefill_req *req);
// The link model's numbers per prefill worker (wire/link.h), in worker order. Returns the count.
struct pd_link_stats;
int pd_xfer_client_links(pd_xfer_client *c, struct pd_link_stats *out, int max);
// Asks the worker to drop a request. Its RESULT still comes (FAIL "cancelled", or DONE if the KV was
// already written, or a failure): only then are the destination blocks safe to reuse.
void pd_xfer_client_cancel(pd_xfer_client *c, uint64_t req_id);
#define PD_XFER_QUEUE (-2)
// A prefill worker (by the KV address we dial, "host:port") claims queued request req_id: the
// PREFILL_REQ goes to it now. PD_OK; PD_ERR_NOTFOUND (not queued: answered, timed out, cancelled);
// PD_NOSPACE (we have no healthy connection to that worker: let another one take it); PD_ERR_INVALID
// (worker_addr is none of the workers we dial: nothing is sent, the request stays queued). Any thread.
pd_status pd_xfer_client_claim(pd_xfer_client *c, uint64_t req_id, const char *worker_addr);
int pd_xfer_client_n_healthy(pd_xfer_client *c);
// tcp, nccl: layers landed so far for an in-flight request (KV_SLAB / KV_NCCL layers in place); -1 if
// it is not in flight.
int pd_xfer_client_layers_landed(pd_xfer_client *c, uint64_t req_id);

// ---- prefill side ------------------------------------------------------------------------------
typedef struct pd_xfer_server_params {
    const char *host;   // bind address (default 127.0.0.1)
    int port;           // 0 = any free port (see pd_xfer_server_port)
    pd_kvw_fingerprint fp;
    const char *secret;   // shared secret (copied); required
    pd_backend *backend;  // nccl: the prefill engine's backend (borrowed); NULL refuses nccl peers
    size_t max_queued_bytes;  // per connection, queued KV bytes before sends are refused (default 1 GiB)
    int stall_ms;             // a write making no progress this long closes the connection (10000)
    const char *debug_pause;  // test hook: "hello_ack" stops (sleeps forever, after logging) before
                              // sending HELLO_ACK; NULL: off
    pd_xfer_event_fn on_event;
    void *ud;
} pd_xfer_server_params;

typedef struct pd_xfer_server pd_xfer_server;
pd_xfer_server *pd_xfer_server_new(const pd_xfer_server_params *p, pd_err *err);
void pd_xfer_server_free(pd_xfer_server *s);
int pd_xfer_server_port(const pd_xfer_server *s);
void pd_xfer_server_counters(pd_xfer_server *s, pd_xfer_counters *out);
// Queues a message to a connected decode worker; for KV_SLAB, payload (pd_malloc'd,
// m->u.kv_slab.payload_len bytes) is taken over and freed once sent. Never blocks. PD_ERR_CLOSED if
// the connection is gone, PD_NOSPACE if its queue is over max_queued_bytes (a slow reader).
// Connection ids are slot | generation << 8: an id of a closed connection never reaches a new one.
pd_status pd_xfer_server_send(pd_xfer_server *s, int conn_id, const pd_kvw_msg *m, void *payload);
// The prefill engine's measured step-time model (µs per step and per token; < 0 unknown) and its
// prefill budget per step: sent to decode workers with every link-probe answer (PROBE_DATA), so
// their link model predicts remote prefill time with it. Any thread.
void pd_xfer_server_set_step_model(pd_xfer_server *s, double a_us, double b_us, int chunk_tokens);
// Whether the connection still exists (direct writers check before each layer). Any thread.
bool pd_xfer_server_conn_alive(pd_xfer_server *s, int conn_id);
// nccl transport, layer-wise. nccl_post announces one layer's slab (KV_NCCL, hdr; layout in
// wire/kv.h) and posts its send of hdr->bytes at dev (device memory) on the connection's
// communicator, ordered after the work on the backend's transfer stream (the gather that filled
// dev), and returns without waiting for the peer. nccl_wait waits until every send posted on the
// connection has completed (the peer received it). Both: PD_ERR_CLOSED if there is no such
// connection or communicator; a post that fails, or a wait that fails or takes longer than
// timeout_ms, aborts the communicator and closes the connection (the decode worker reconnects
// with a new one; pd_comm_free on close ends every send still in flight, so its device memory is
// free again). Engine thread: announcements and sends keep the same order on a connection.
pd_status pd_xfer_server_nccl_post(pd_xfer_server *s, int conn_id, const pd_kvw_kv_nccl *hdr, const void *dev,
                                   pd_err *err);
pd_status pd_xfer_server_nccl_wait(pd_xfer_server *s, int conn_id, int timeout_ms, pd_err *err);

#ifdef __cplusplus
}
#endif
