// kvconn_impl.h — what a transport implements (one file per transport, listed in registry.c) and
// the connector state the transports share. Not for the engine: it includes kvconn/kvconn.h only.
#pragma once
#include "kvconn/kvconn.h"
#include "xfer/xfer.h"

typedef struct kvc_peer {  // prefill role: one decode connection
    int conn_id;           // xfer connection id (slot | generation << 8); 0 when unused
    pd_kvw_transport transport;
    bool is_ready;         // the pool checked out (direct) or nothing to map (tcp, nccl)
    int n_blocks;          // the peer's pool size, in blocks (direct: what is really mapped)
    pd_buffer_handle handle;
    void *base;            // direct transports: the mapped pool
    void *tpriv;           // the transport's own per-peer state (ucx: endpoint, rkey)
    char refused[160];     // why its pool was refused ("" unless refused): every request of the
                           // connection then fails with PD_KVW_FAIL_POOL_REFUSED and this text
} kvc_peer;

struct pd_kvconn_save {
    kvc_peer *peer;        // borrowed (valid while the connection's PEER_DOWN is not handled)
    const struct kvc_transport *t;  // the peer's transport when the save began (NULL: none)
    int conn_id;
    uint64_t peer_req_id;
    int n_blocks, start_pos, n_tokens;
    int32_t *src, *dst, *rows;  // owned (n_blocks each)
    uint64_t *sums;             // owned (n_layers): per-layer checksums of the source slab
    int n_layers_saved;         // layers shipped so far (layer-wise transports)
    void **dk, **dv;            // direct transports: the peer's layer bases (n_layers each), lazily;
                                // nccl: the staging slab's (layer l's set when it is gathered)
    pd_buffer *stage;           // nccl: this save's staging (n_layers one-layer slabs), from the pool
    size_t stage_bytes;         // its real size
    int32_t *dst_slab;          // nccl: 0 .. n_blocks-1 (slab block i = the request's i-th block)
    int n_sends;                // nccl: layer sends posted and not yet waited for
    bool is_xfer_pending;       // transfer-stream work may still write sums / the peer's pool
    bool is_corrupt;            // test hook: flip one bit of this save's KV
    void *tsave;                // the transport's own per-save state (ucx tag path: posted sends), freed by save_free
    pd_status st;               // first failure
    int64_t copy_us;
};

// nccl.c (also ucx.c's gathers): a small pool of device staging buffers (engine thread), so a save does not allocate
// (and a growing buffer does not free, which synchronises the device) on every request.
#define KVC_STAGE_POOL_MAX 4
typedef struct kvc_stage_pool {
    pd_buffer *free[KVC_STAGE_POOL_MAX];
    size_t sizes[KVC_STAGE_POOL_MAX];
    int n_free;
} kvc_stage_pool;

typedef struct kvc_transport {
    pd_kvw_transport id;
    const char *name;
    bool is_layerwise;   // save_layer ships layers during the forward pass
    // optional: decides is_layerwise per save (ucx: its tag path ships layer-wise, its put path not)
    bool (*layerwise)(pd_kvconn *c, pd_kvconn_save *s);
    bool needs_host_pool;  // tcp: the decode side's I/O thread writes the pool with the CPU
    // decode role: describe our pool to peers (fills *h); NULL: nothing to export.
    pd_status (*export_pool)(pd_kvconn *c, pd_buffer_handle *h, pd_err *err);
    // prefill role: a peer said HELLO: make its pool writable (fd: shm's memfd, taken over)
    pd_status (*attach)(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, pd_err *err);
    void (*detach)(pd_kvconn *c, kvc_peer *p);
    // one layer (layer-wise transports, from the layer hook) or, at the end, every layer not yet
    // shipped (save_rest); must leave s->sums[l] set for each layer it shipped.
    void (*save_layer)(pd_kvconn *c, pd_kvconn_save *s, int layer);
    pd_status (*save_rest)(pd_kvconn *c, pd_kvconn_save *s);
    // optional: the save ends (after save_rest, or failed): release the transport's per-save state
    // once nothing can still read it (nccl: waits for posted sends, gives back the staging).
    void (*save_free)(pd_kvconn *c, pd_kvconn_save *s);
    // decode role (optional, two-sided transports): before a load's request goes out, post the
    // receives of its KV into our blocks (l->dst_blocks; checked against the pool first). Not
    // PD_OK: no request is sent (PD_ERR_INVALID: a block outside the pool; else prefill locally).
    pd_status (*load_post)(pd_kvconn *c, const pd_kvconn_load *l);
    // decode role (optional, with load_post): the load's RESULT, on the session's I/O thread before
    // the event goes out: waits (bounded) for the posted receives, checks every length, or cancels
    // them when the load failed; may turn ev->status into a failure (with ev->reason). After it,
    // nothing of this load writes our pool any more.
    void (*load_end)(pd_kvconn *c, uint64_t req_id, pd_status *status, char *reason, size_t reason_len);
    // decode role (optional): the HELLO handle bytes, after export_pool (ucx: address + rkey)
    pd_status (*hello_blob)(pd_kvconn *c, uint8_t *blob, uint32_t *len, pd_err *err);
    void (*fini)(pd_kvconn *c);  // optional: frees c->tstate (both roles; after the session layer stopped)
} kvc_transport;

struct pd_kvconn {
    pd_kvconn_params p;
    const kvc_transport *t;  // decode role: ours
    pd_xfer_client *xc;
    pd_xfer_server *xs;
    kvc_peer peers[PD_XFER_MAX_CONNS];  // prefill role, by connection slot (engine thread)
    int n_saves;                       // for corrupt_every
    bool is_overlap_off;               // PD_KV_OVERLAP=0: no layer-wise shipping
    bool is_mark_due;                  // a layer finished: the next direct save_layer marks it
    int64_t peers_refused, saves_layerwise, saves_failed;  // engine thread; read racily by stats
    void *tstate;                      // the transport's own connector state (ucx: context, worker)
    int64_t ema_load_us;               // decode: recent load time per token, in ns (match cost)
    kvc_stage_pool nccl_stage;         // prefill (nccl): free staging slabs (engine thread)
};

// registry.c
const kvc_transport *kvc_transport_find(pd_kvw_transport id);
extern const kvc_transport kvc_tcp, kvc_shm, kvc_cuda_ipc, kvc_nccl, kvc_ucx;

// kvconn.c helpers for transports
kvc_peer *kvc_peer_of(pd_kvconn *c, int conn_id);
size_t kvc_pool_bytes(const pd_kvconn *c, int n_blocks);  // a pool of n_blocks with our geometry
void kvc_debug_pause(pd_kvconn *c, const char *step);
// Direct transports: enqueues layer l of s into the peer's mapped pool on the backend's transfer
// stream (and its source checksum), checking first that the connection is still alive (a
// fenced-off writer stops). save_rest ships the layers not yet shipped, then waits for the
// transfer stream: the KV is in place and s->sums filled.
void kvc_direct_save_layer(pd_kvconn *c, pd_kvconn_save *s, int l);
pd_status kvc_direct_save_rest(pd_kvconn *c, pd_kvconn_save *s);
pd_status kvc_direct_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, const char *kind, pd_err *err);
void kvc_direct_detach(pd_kvconn *c, kvc_peer *p);
pd_status kvc_direct_export(pd_kvconn *c, pd_buffer_handle *h, pd_err *err);

// nccl.c, exposed for tests (tests/unit/test_kvconn_nccl.c).
// A buffer of at least bytes: the smallest free one that fits, else a fresh allocation (a free one
// too small is released); *cap: its real size. NULL when out of memory.
pd_buffer *kvc_stage_take(pd_backend *b, kvc_stage_pool *pool, size_t bytes, size_t *cap);
// Back to the pool (bytes: its real size, *cap of the take); a full pool keeps the largest buffers.
void kvc_stage_give(kvc_stage_pool *pool, pd_buffer *buf, size_t bytes);
void kvc_stage_fini(kvc_stage_pool *pool);
uint64_t kvc_nccl_layer_bytes(const pd_kvconn *c, const pd_kvconn_save *s);
// The KV_NCCL announcement of layer l of s.
void kvc_nccl_header(const pd_kvconn *c, const pd_kvconn_save *s, int l, pd_kvw_kv_nccl *h);
// Enqueues, on the backend's transfer stream, the gather of layer l of s into the one-layer slab at
// slab (s->dk, s->dv: n_layers entries; s->dst_slab: 0 .. n_blocks-1) and the layer's checksum
// into s->sums[l] (filled at pd_backend_xfer_sync).
void kvc_nccl_gather(pd_kvconn *c, pd_kvconn_save *s, int l, void *slab);
// tier.c: frees a TIER_LOADED event's load (pd_kvconn_event_fini, for an event the engine never
// handled, e.g. at shutdown); its staging slots are not touched (the connector may be gone).
void kvc_tier_load_free(void *l);
