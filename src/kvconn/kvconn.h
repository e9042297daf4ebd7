// kvconn — the KV connector: the one interface through which the engine moves a prompt's KV cache
// between workers (docs/design.md, "Disaggregation"). The engine includes this header only, never
// a transport file or the session layer (tools/check_deps.sh enforces it).
//
// The split follows vLLM v1's KVConnector (scheduler side / worker side) and NIXL's
// register-memory / transfer / notify:
//
//   scheduler side   pd_kvconn_match: how many tokens of this prompt can be loaded, from which
//                    worker, at what predicted cost.
//   worker side      decode role (loads):  pd_kvconn_start_load → (the KV lands in the reserved
//                      blocks, by whichever transport) → a LOAD_DONE event → pd_kvconn_load_verify
//                      (per-layer checksums over our own blocks) → decode; pd_kvconn_wait_for_layer
//                      says whether a layer is in place; pd_kvconn_request_finished (abort, or a
//                      result consumed) — a request's blocks are reused only after its LOAD_DONE.
//                    prefill role (saves): SAVE_REQUEST event → pd_kvconn_check_request →
//                      pd_kvconn_save_begin when the request's last prompt chunk is scheduled →
//                      pd_kvconn_save_layer from the model's "layer done" hook (layer l ships
//                      while l+1 computes) → pd_kvconn_save_end with the first token (DONE) or
//                      pd_kvconn_save_fail (FAIL, at once: a failed step, an abort).
//   completion       events, delivered by a callback on connector threads (the engine copies
//                    them into its command queue and handles them on its own thread).
//
// Transports (src/kvconn/<name>.c, one file each, listed in registry.c): tcp (KV rows inline,
// layer-wise), shm (direct writes into the decode pool, a memfd passed over a unix socket),
// cuda-ipc (direct device writes), nccl (one slab per layer through a communicator). A new
// transport is one new file implementing kvc_transport (kvconn_impl.h) plus a registry entry.
//
// Guarantees: the engine thread does no socket I/O (sends are queued, see xfer); no lock is held
// across a blocking call; every operation has a deadline; every connection authenticates (HMAC
// challenge–response over a shared secret) before anything else is read.
#pragma once
#include "backend/backend.h"
#include "base/base.h"
#include "base/hash.h"
#include "wire/kv.h"
#include "wire/link.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_KVCONN_MAX_WORKERS 16

typedef struct pd_kvconn pd_kvconn;

typedef enum pd_kvconn_event_kind {
    PD_KVCONN_EV_LOAD_DONE = 1,     // decode: a load ended (status PD_OK: verify it; else a failure;
                                    // PD_ERR_UNSUPPORTED: the prefill worker refused our pool)
    PD_KVCONN_EV_PEER_UP = 2,       // prefill: a decode worker connected (hand to pd_kvconn_peer_up)
    PD_KVCONN_EV_SAVE_REQUEST = 3,  // prefill: compute and save this prompt's KV (req)
    PD_KVCONN_EV_CANCEL = 4,        // prefill: the decode worker cancelled req_id
    PD_KVCONN_EV_PEER_DOWN = 5,     // prefill: the decode worker went away (hand to pd_kvconn_peer_down)
    PD_KVCONN_EV_TIER_LOADED = 6,   // tiers: a load ended, n_blocks leading blocks are in place
} pd_kvconn_event_kind;

typedef struct pd_kvconn_event {
    pd_kvconn_event_kind kind;
    int peer;                  // prefill: the decode connection; decode: the prefill worker index
    uint64_t req_id;           // LOAD_DONE: ours; SAVE_REQUEST / CANCEL: the peer's
    pd_status status;          // LOAD_DONE: PD_OK, PD_ERR_CLOSED, PD_ERR_TIMEOUT, PD_ERR_PROTO, PD_ERR_INVALID,
                               // PD_ERR_UNSUPPORTED (our pool was refused)
    char reason[160];          // LOAD_DONE when not OK
    pd_kvw_prefill_done done;  // LOAD_DONE ok: first token, logprobs, checksums, n_draws
    pd_kvw_prefill_req req;    // SAVE_REQUEST: tokens / dst_blocks point into owned
    int32_t *owned;
    void *priv;                // PEER_UP: connector-private (owned)
    int n_blocks;              // TIER_LOADED: leading blocks loaded (0 .. asked)
    int64_t load_us;           // TIER_LOADED: time on the tier thread
    void *tier_load;           // TIER_LOADED: the connector's load (pd_kvconn_tiers_loaded ends it)
} pd_kvconn_event;
void pd_kvconn_event_fini(pd_kvconn_event *ev);

// Called on connector threads; the callee takes the event over (frees it with
// pd_kvconn_event_fini). Must not block for long.
typedef void (*pd_kvconn_event_fn)(void *ud, pd_kvconn_event *ev);

// The local KV cache, as both roles see it.
typedef struct pd_kvconn_cache {
    int n_layers, n_blocks, block_size;
    size_t row_bytes;        // n_kv_heads * head_dim * elem (a multiple of 8)
    void **k, **v;           // (n_layers) layer bases (device pointers; borrowed)
    pd_buffer *buffer;       // the whole pool (shm / cuda-ipc export it), borrowed
} pd_kvconn_cache;

typedef enum pd_kvconn_role { PD_KVCONN_DECODE = 1, PD_KVCONN_PREFILL = 2 } pd_kvconn_role;

typedef struct pd_kvconn_params {
    pd_kvconn_role role;
    pd_kvw_transport transport;          // decode role
    int n_workers;                       // decode role: prefill workers ("host:port", copied)
    const char *addrs[PD_KVCONN_MAX_WORKERS];
    const char *host;                    // prefill role: bind address of the KV port
    int port;                            // prefill role: 0 = any free port
    const char *secret;                  // shared secret (required)
    pd_kvw_fingerprint fp;
    pd_backend *backend;                 // borrowed
    pd_kvconn_cache cache;
    int timeout_ms;                      // a load slower than this is cancelled (default 30000)
    int corrupt_every;                   // test hook: corrupt every Nth save (0: off)
    const char *debug_pause;             // test hook (prefill): "hello_ack" | "mid_slab" | "before_done"
    bool debug_refuse_pools;             // test hook (prefill): refuse every decode pool (as if it did not check out)
    pd_kvconn_event_fn on_event;
    void *ud;
    // decode role, cluster mode: loads with worker PD_KVCONN_QUEUE go to the prefill work queue;
    // this publishes the job (called on the engine thread; must not block). NULL: no queue.
    void (*on_enqueue)(void *ud, uint64_t req_id, int n_tokens);
    void *enqueue_ud;
} pd_kvconn_params;

pd_kvconn *pd_kvconn_new(const pd_kvconn_params *p, pd_err *err);
void pd_kvconn_free(pd_kvconn *c);  // joins its threads; pending loads are dropped
int pd_kvconn_port(const pd_kvconn *c);  // prefill role: the KV port
int pd_kvconn_n_healthy(pd_kvconn *c);   // decode role: connected prefill workers
const char *pd_kvconn_transport_name(const pd_kvconn *c);

typedef struct pd_kvconn_stats {
    int64_t auth_failures, proto_errors, conns_accepted, conns_closed, slow_peer_drops, fenced;
    int64_t peers_refused;     // prefill: decode pools refused (size or handle did not check out)
    int64_t saves_layerwise;   // prefill: saves whose layers shipped during the forward pass
    int64_t saves_failed;      // prefill: requests refused or failed (PREFILL_FAIL sent), or saves dropped on abort
} pd_kvconn_stats;
void pd_kvconn_stats_get(pd_kvconn *c, pd_kvconn_stats *out);

// ---- scheduler side ----------------------------------------------------------------------------
typedef struct pd_kvconn_match {
    int n_tokens;          // prompt tokens loadable remotely (from the block-aligned local hit on)
    int worker;            // which prefill worker would serve it (-1: none healthy)
    double cost_us;        // predicted time until the KV is in place (queue + transfer estimate)
} pd_kvconn_match;
// n_local_hit: prompt tokens already cached locally. Never blocks.
void pd_kvconn_match_tokens(pd_kvconn *c, int n_prompt, int n_local_hit, pd_kvconn_match *out);
// Link-aware disaggregation (wire/link.h): each prefill worker's link as measured (probe at
// connect, heartbeats, real transfers) and its compute model, in worker order (decode role; 0
// otherwise). Never blocks for long (per-worker mutexes).
int pd_kvconn_links(pd_kvconn *c, pd_link_stats *out, int max);
// Prefill role: this engine's step-time model and prefill budget, sent to decode workers with every
// link-probe answer. Any thread.
void pd_kvconn_set_step_model(pd_kvconn *c, double a_us, double b_us, int chunk_tokens);
// KV bytes one prompt token moves.
double pd_kvconn_bytes_per_token(const pd_kvconn *c);

// ---- worker side, decode role ------------------------------------------------------------------
typedef struct pd_kvconn_load {
    uint64_t req_id;
    const int32_t *tokens;
    int n_tokens;
    int start_pos;              // block-aligned: KV for [start_pos, n_tokens) is loaded
    const int32_t *dst_blocks;  // (n_dst_blocks) our blocks for those positions, in order
    int n_dst_blocks;
    pd_kvw_sampling sampling;   // the first token is drawn remotely with the same sampler state
    const char *traceparent;    // NULL / "" or the request's W3C traceparent (the prefill worker's spans)
    int worker;                 // the prefill worker to use (the link model's choice); -1: least loaded;
                                // PD_KVCONN_QUEUE: the work queue (whichever prefill worker claims it)
} pd_kvconn_load;
#define PD_KVCONN_QUEUE (-2)
// Cluster mode: the prefill worker at KV address worker_addr claims queued load req_id (its
// PREFILL_REQ is sent to it now). PD_OK, PD_ERR_NOTFOUND (no longer queued), PD_NOSPACE (not
// connected to that worker), PD_ERR_INVALID (none of the workers we dial). Any thread.
pd_status pd_kvconn_claim(pd_kvconn *c, uint64_t req_id, const char *worker_addr);
// PD_OK: exactly one LOAD_DONE event follows. PD_NOSPACE: no worker now (prefill locally).
// PD_ERR_INVALID: a block id outside our pool. Queues only.
pd_status pd_kvconn_start_load(pd_kvconn *c, const pd_kvconn_load *l);
// After a LOAD_DONE with status PD_OK: checks the per-layer checksums over our own blocks and the
// first token. false: never decode from this KV (prefill locally). bytes: the KV bytes verified.
// load_us: start_load → LOAD_DONE, which feeds the cost predicted by pd_kvconn_match_tokens.
bool pd_kvconn_load_verify(pd_kvconn *c, const pd_kvconn_event *ev, const int32_t *dst_blocks, int n_dst_blocks,
                           int start_pos, int n_tokens, int vocab, int64_t load_us, int64_t *bytes);
// Whether layer `layer` of a load is in place (tcp: its slab landed; other transports: when the
// load is done). Never blocks: PD_OK or PD_AGAIN.
pd_status pd_kvconn_wait_for_layer(pd_kvconn *c, uint64_t req_id, int layer);
// The request went away (abort) while loading: cancels it remotely. Its LOAD_DONE still comes;
// only then are its blocks free to reuse (the writer acknowledged or was fenced off).
void pd_kvconn_request_finished(pd_kvconn *c, uint64_t req_id);

// ---- worker side, prefill role -----------------------------------------------------------------
void pd_kvconn_peer_up(pd_kvconn *c, pd_kvconn_event *ev);    // maps the peer's pool (direct transports)
void pd_kvconn_peer_down(pd_kvconn *c, pd_kvconn_event *ev);  // unmaps it
// Validates a SAVE_REQUEST against the peer (its pool is mapped, every destination block exists
// in what it really mapped, the span is block-aligned). NULL if fine, else why (send it back
// with pd_kvconn_send_fail).
const char *pd_kvconn_check_request(pd_kvconn *c, const pd_kvconn_event *ev, int vocab);
void pd_kvconn_send_fail(pd_kvconn *c, int peer, uint64_t peer_req_id, const char *why);

typedef struct pd_kvconn_save pd_kvconn_save;
// The request's last prompt chunk is in this step: src_blocks are its local blocks for positions
// [start_pos, n_tokens) (copied), dst_blocks the peer's (copied). NULL on OOM (send a fail).
pd_kvconn_save *pd_kvconn_save_begin(pd_kvconn *c, int peer, uint64_t peer_req_id, const int32_t *src_blocks,
                                     const int32_t *dst_blocks, int n_blocks, int start_pos, int n_tokens);
// Layer `layer` of the step is computed: ship it if the transport is layer-wise (engine thread;
// tcp copies the rows into a queued slab and returns: the send runs while the next layer computes).
// cuda-ipc (and shm) enqueue layer l's copy and checksum on the backend's transfer stream after
// an event on the compute stream (pd_backend_xfer_mark), checking the fence first; nccl enqueues
// there the gather into a one-layer slab and its checksum, then announces the layer and posts
// its send on the communicator's stream, ordered after the transfer stream. Call
// pd_kvconn_layer_begin once per layer before the step's saves (it arms that mark).
// PD_KV_OVERLAP=0 in the environment turns layer-wise shipping off (everything ships at the end).
void pd_kvconn_layer_begin(pd_kvconn *c, int layer);
void pd_kvconn_save_layer(pd_kvconn *c, pd_kvconn_save *s, int layer);
// The step finished: ship what is left, then PREFILL_DONE with the first token (first->token;
// n_draws: the request's sampler draws so far). Frees s. PD_OK, or the failure (FAIL was sent).
typedef struct pd_kvconn_first {
    int32_t token;
    float logprob;
    int n_top;
    const int32_t *top_ids;
    const float *top_logprobs;
    uint64_t n_draws;
    int64_t queue_us, compute_us;  // the prefill worker's own queue and compute time (TTFT breakdown)
} pd_kvconn_first;
// copy_us (may be NULL): time spent moving bytes on this thread (copies, gathers, waits).
pd_status pd_kvconn_save_end(pd_kvconn *c, pd_kvconn_save *s, const pd_kvconn_first *first, int64_t *copy_us);
// The save cannot complete (step failed, request aborted): PREFILL_FAIL now (unless the peer is
// gone or cancelled: silent is fine), frees s.
void pd_kvconn_save_fail(pd_kvconn *c, pd_kvconn_save *s, const char *why, bool tell_peer);

// ---- KV tiers below the device pool (kvconn/tier.c over kvtier/) ------------------------------
// Host DRAM (--kv-offload-dram), local disk (--kv-offload-disk, persists across restarts) and a
// Redis pool shared by every worker of the model (--kv-remote), fastest first. Write-back: a block
// that became full and cached in the device pool is offered (pd_kvconn_tiers_save copies its rows
// and returns; encoding and writes run on the tier thread). Lookup by the chained block hash
// (pd_kvconn_tiers_match never waits: no Redis round trip on the caller's thread); a load decodes
// into reserved blocks on the tier thread and ends with one TIER_LOADED event (on_event, from the
// tier thread). A corrupted, truncated or foreign page is a miss: the load stops before it.
#define PD_KVCONN_MAX_TIERS 3
typedef struct pd_kvconn_tiers pd_kvconn_tiers;

typedef struct pd_kvconn_tier_params {
    uint64_t dram_bytes;       // 0: no DRAM tier
    const char *disk_dir;      // NULL: no disk tier (borrowed for the call)
    uint64_t disk_bytes;       // required with disk_dir
    const char *remote_url;    // "redis://HOST:PORT" or NULL
    const char *secret;        // required with remote_url: the Redis AUTH password (borrowed)
    const char *dtype;         // disk / Redis pages: "bf16" | "fp8" | "int8" | "f32"; NULL: f32 (lossless)
    int queue_max;             // pending offloads before new ones are dropped (0: 1024)
    pd_kvw_fingerprint fp;     // pages of another model are refused
    pd_backend *backend;       // borrowed
    pd_kvconn_cache cache;     // the pool the blocks live in
    pd_kvconn_event_fn on_event;
    void *ud;
} pd_kvconn_tier_params;

typedef struct pd_kvconn_tier_stat {
    char name[16];             // "dram", "disk", "redis"
    int64_t hits, misses, puts, put_failures, evictions, bad_pages;
    int64_t bytes_in, bytes_out;  // written to the tier / read back from it
    uint64_t bytes_used, capacity;
    int64_t n_items;
    int64_t load_hist[24];     // block loads served, by latency: bucket i < 2^i us
} pd_kvconn_tier_stat;

enum { PD_KVCONN_NOTIFY_EVICTED, PD_KVCONN_NOTIFY_EXPIRED, PD_KVCONN_NOTIFY_DELETED, PD_KVCONN_NOTIFY_IGNORED,
       PD_KVCONN_NOTIFY_CONFIG_REFUSED, PD_KVCONN_NOTIFY_N };
typedef struct pd_kvconn_tiers_stats {
    int n_tiers;
    pd_kvconn_tier_stat tier[PD_KVCONN_MAX_TIERS];
    int64_t offloads_queued, offloads_dropped, offloads_done;
    int64_t loads, load_blocks, load_misses, promotions;
    char dtype[8];
    bool dram_pinned;          // the DRAM tier's pages are page-locked host memory (CUDA)
    int staging_slots;         // a device cache: pinned staging slots (0: the direct host path)
    int64_t load_cuts;         // loads cut short for want of a free staging slot
    // Same-step loads' commits (pd_kvconn_tiers_load_now_commit), those copied layer by layer,
    // and layer-wise ones whose layers were not all waited for (fenced at the step's end).
    int64_t samestep_commits, samestep_layerwise, samestep_fenced;
    // Commits made while the device -> DRAM copies of the previous saves were still running (the
    // step's compute and its first load then wait for them on the device).
    int64_t samestep_saves_pending;
    // The Redis tier's keyspace notifications (kvtier/notify.c): keys removed by the server
    // (evicted, expired, deleted), messages ignored (malformed / foreign), CONFIG SET refusals.
    int64_t remote_notify[PD_KVCONN_NOTIFY_N];
} pd_kvconn_tiers_stats;

// The 64-bit model fingerprint that tier pages and Redis keys carry.
uint64_t pd_kvconn_fingerprint64(const pd_kvw_fingerprint *f);
pd_kvconn_tiers *pd_kvconn_tiers_new(const pd_kvconn_tier_params *p, pd_err *err);
void pd_kvconn_tiers_free(pd_kvconn_tiers *c);  // runs queued work (each load's event comes), joins
// A block became full and cached: offer it to the tiers (a host-resident cache: rows copied before
// return; a device cache: queued for the next pd_kvconn_tiers_poll, which must come before the
// block can be reallocated).
void pd_kvconn_tiers_save(pd_kvconn_tiers *c, int32_t block_id, pd_hash128 hash, pd_hash128 parent);
// Leading blocks of hashes[0..n) some tier holds or may hold (Redis is asked by the load itself);
// *n_sure: leading blocks known held; *cost_us: the predicted load time (measured bandwidth).
int pd_kvconn_tiers_match(pd_kvconn_tiers *c, const pd_hash128 *hashes, int n, int *n_sure, double *cost_us);
// Loads blocks hashes[0..n) into our blocks dst_blocks[0..n), which nothing else may touch until
// the TIER_LOADED event. PD_OK: exactly one event follows. PD_ERR_INVALID: a block outside the pool.
pd_status pd_kvconn_tiers_start_load(pd_kvconn_tiers *c, uint64_t req_id, const pd_hash128 *hashes,
                                     const int32_t *dst_blocks, int n);
// The same, completed within the step when the hot DRAM tier (a device cache's pinned device-layout
// pages) holds every one of the n blocks: the pages are pinned and their copy pages -> dst_blocks
// queued; returns n and no event follows. Otherwise returns 0 and nothing happened (no hot tier, a
// block not held there, a block outside the pool): use pd_kvconn_tiers_start_load. The queued
// copies are enqueued on the transfer stream by pd_kvconn_tiers_load_now_commit, which must come
// before the step's compute (PDSERVE_KV_TIER_LAYERWISE=0: enqueued here at once, one copy and a
// fence per load, as a commit with layerwise false).
int pd_kvconn_tiers_load_now(pd_kvconn_tiers *c, const pd_hash128 *hashes, const int32_t *dst_blocks, int n);
// The engine thread, before the step's compute is enqueued: the copies pd_kvconn_tiers_load_now
// queued, every load of the step together. layerwise: one copy per group of layers, each layer
// marked ready on the transfer stream (pd_backend_xfer_layer_ready); returns the number of layers
// the compute must then wait for, each through pd_kvconn_tiers_layer_wait(c, l) before layer l's
// ops (pd_batch.before_layer), so the copy of later layers overlaps the compute of earlier ones.
// Not layerwise (a step that runs without that hook, e.g. speculative decoding's): one copy and a
// fence every later compute waits on; returns 0. Returns 0 too when nothing was queued.
int pd_kvconn_tiers_load_now_commit(pd_kvconn_tiers *c, bool layerwise);
void pd_kvconn_tiers_layer_wait(pd_kvconn_tiers *c, int layer);
// The engine thread, after the step's compute was enqueued (whether it ran or failed): copies
// still queued are committed with a fence, and a layer-wise commit whose layers were not all
// waited for in order gets a fence (compute enqueued later runs after every copy).
void pd_kvconn_tiers_step_end(pd_kvconn_tiers *c);
// The engine thread, on a TIER_LOADED event, before it lets the request read the blocks: a device
// cache gets the staged rows uploaded on the transfer stream (ordered before the next step's
// compute; the host does not wait). Always call it once per TIER_LOADED event.
void pd_kvconn_tiers_loaded(pd_kvconn_tiers *c, pd_kvconn_event *ev);
// The engine thread, after a batch of pd_kvconn_tiers_save calls (and at any time): starts the
// device-to-host copies of the blocks saved since (one batched copy) and hands the copies that
// finished to the tier thread. Never waits. A host-resident cache needs nothing: a no-op.
void pd_kvconn_tiers_poll(pd_kvconn_tiers *c);
void pd_kvconn_tiers_stats_get(pd_kvconn_tiers *c, pd_kvconn_tiers_stats *out);
// What the tiers now hold, for routers: a page written to / evicted from a tier.
typedef enum pd_kvconn_tier_kind { PD_KVCONN_TIER_DRAM = 1, PD_KVCONN_TIER_DISK = 2, PD_KVCONN_TIER_REDIS = 3 } pd_kvconn_tier_kind;
typedef struct pd_kvconn_tier_event {
    pd_kvconn_tier_kind kind;
    bool is_stored;            // else evicted
    pd_hash128 hash, parent;
} pd_kvconn_tier_event;
int pd_kvconn_tiers_events_drain(pd_kvconn_tiers *c, pd_kvconn_tier_event *out, int n_max);
bool pd_kvconn_tiers_flush(pd_kvconn_tiers *c, int timeout_ms);  // tests: every queued job ran

#ifdef __cplusplus
}
#endif
