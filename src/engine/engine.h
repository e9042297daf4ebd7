// engine — the serving engine: one model, one paged KV cache, a continuous-batching scheduler and
// the step loop (plan → forward → sample → update) on its own thread.
//
// Threads: pd_engine_new loads the model and tokenizer; pd_engine_start starts the engine thread,
// which owns the backend and all device memory. Any thread may call pd_engine_submit /
// pd_engine_abort / pd_engine_stats (they only touch the request queue, under its mutex). Results
// come back as events: the engine appends them to an outgoing queue and makes pd_engine_event_fd
// readable; the consumer (the HTTP event loop) drains them with pd_engine_poll. This queue is the
// one thread boundary of the server (engine/queue.c).
//
// Request lifecycle seen from outside:
//   submit ──► (waiting) ──► TOKEN events, one per generated token ──► a FINISHED event (last)
//   abort(id) at any time ──► a FINISHED event with reason ABORT (unless it had already finished);
//   every submitted request gets exactly one FINISHED event, after which its id is forgotten.
//
// The engine knows token ids only: stop *strings*, detokenization and HTTP live in api/. It stops
// on EOS (unless ignore_eos), on stop_ids and at max_tokens.
#pragma once
#include "base/base.h"
#include "model/model.h"
#include "model/sample.h"
#include "tok/tok.h"
#include "wire/control.h"
#include "wire/kv.h"
#include "wire/link.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_engine pd_engine;

typedef enum pd_sched_policy_kind {
    PD_POLICY_FCFS = 0,      // first come, first served (priority still orders first)
    PD_POLICY_SRPT = 1,      // shortest remaining prefill first (device prefix and tier hits cost nothing), with aging
} pd_sched_policy_kind;

// Disaggregation roles: BOTH serves requests start to end (colocated). DECODE owns requests and
// asks prefill workers (over xfer/) for the KV of long uncached prompts, prefilling locally when
// the uncached part is short, no prefill worker is healthy, or a handoff fails. PREFILL serves
// only KV-prefill requests from decode workers (no OpenAI clients of its own).
typedef enum pd_engine_role {
    PD_ROLE_BOTH = 0,
    PD_ROLE_PREFILL = 1,
    PD_ROLE_DECODE = 2,
} pd_engine_role;
const char *pd_engine_role_name(pd_engine_role r);

typedef struct pd_engine_params {
    pd_engine_role role;
    // decode role
    int n_prefill_addrs;
    const char *prefill_addrs[16];  // "host:port" of prefill workers' KV ports (borrowed for the call)
    pd_kvw_transport kv_transport;  // default shm on cpu, cuda-ipc on cuda
    int disagg_min_tokens;        // prefill locally when fewer uncached prompt tokens (default 64)
    int disagg_timeout_ms;        // a handoff slower than this falls back (default 30000)
    // cluster mode's prefill work queue (decode role): remote prefills are queued for whichever
    // prefill worker claims them (pd_engine_prefill_claim) instead of sent to one; on_prefill_enqueue
    // publishes the job (engine thread; must not block). NULL: off.
    void (*on_prefill_enqueue)(void *ud, uint64_t req_id, int n_tokens);
    void *prefill_enqueue_ud;
    bool disagg_link_aware;       // decide local vs remote with the link model (wire/link.h; default false:
                                  // the length threshold alone; `serve --control` turns it on)
    // prefill role
    const char *kv_host;          // bind address of the KV port (default 127.0.0.1)
    int kv_port;                  // 0 = any free port (pd_engine_kv_port tells)
    int debug_corrupt_every;      // test hook (--debug-hooks): corrupt every Nth KV transfer
    int debug_export_delay_ms;    // test hook: a slow prefill worker (sleeps before each KV export)
    int debug_fail_step_every;    // test hook: every Nth step fails as if out of memory
    bool debug_refuse_kv_pools;   // test hook (prefill): refuse every decode worker's KV pool
    const char *debug_kv_pause;   // test hook: stop (until killed) at "hello_ack" | "mid_slab" | "before_done"
    const char *kv_secret;        // shared secret of the KV connections (required for the prefill
                                  // role and for a decode role with prefill workers)

    const char *model_dir;        // borrowed for the call
    const char *device;           // "cpu", "cuda", "auto" (default)
    int device_id;
    bool dummy_weights;           // --load-format dummy
    // benchmark fixture (dummy weights only; model.h pd_model_params): the target keeps its first
    // dummy_num_layers layers (0: all); layers dummy_scale_from.. write into the residual stream
    // scaled by dummy_scale_eps (--dummy-residual-scale FROM:EPS; 0: off)
    int dummy_num_layers;
    int dummy_scale_from;
    float dummy_scale_eps;
    int block_size;               // tokens per KV block (default 16)
    pd_kv_dtype kv_cache_dtype;   // --kv-cache-dtype: PD_KV_ACT (default) or PD_KV_FP8 (E4M3, per-head scales)
    int n_blocks;                 // KV blocks; 0 = sized from kv_cache_bytes or memory_utilization
    size_t kv_cache_bytes;        // --kv-cache-memory; 0 = sized by default (size_kv_blocks):
                                  //   cuda: memory_utilization of the free device memory;
                                  //   cpu: what the limits can use (decode/both: max_num_seqs full
                                  //   contexts; prefill: 2 steps + one full context), at most
                                  //   1/32 of the host's memory and 512 MiB
    float memory_utilization;     // fraction of free device memory for KV (default 0.9)
    int max_num_seqs;             // default 256 (cuda) / 64 (cpu)
    int max_num_batched_tokens;   // token budget per step (default 2048)
    int max_model_len;            // 0 = the model's max_position_embeddings
    bool enable_prefix_caching;   // default true
    bool enable_chunked_prefill;  // default true
    pd_sched_policy_kind policy;  // default FCFS
    int max_waiting;              // queue limit; submit returns PD_NOSPACE beyond it (default 4096)
    // speculative decoding (roles both and decode; see docs/design.md "Speculative decoding")
    int spec_method;              // spec/spec.h pd_spec_method: 0 none, 1 draft, 2 ngram, 3 lookahead
    const char *spec_model_dir;   // draft: a model with the target's tokenizer (borrowed for the call)
    int spec_k;                   // --num-speculative-tokens: drafts per step at most (default 4)
    int spec_ngram_min, spec_ngram_max;  // ngram: match lengths tried (default 1..3)
    int spec_lookahead_w, spec_lookahead_n;  // lookahead: window width, n-gram size (default 8, 4)
    bool spec_fixed;              // true: always speculate k (no adaptive length); default false
    int spec_dummy_num_layers;    // draft, dummy weights: the draft is spec_model_dir's config cut to
                                  // its first K layers with the target's seed, so it shares the
                                  // target's embeddings, first K layers, final norm and lm_head
                                  // (--speculative-dummy-layers K); 0: an independent draft (seed 7)
    int n_threads;                // OpenMP threads of the engine (CPU compute); 0 = OpenMP's default
    // KV tiers below the device pool (docs/design.md "KV tiers"); all off by default
    uint64_t kv_offload_dram_bytes;   // --kv-offload-dram SIZE: host DRAM tier
    const char *kv_offload_disk_dir;  // --kv-offload-disk DIR (borrowed for the call)
    uint64_t kv_offload_disk_bytes;   // --kv-offload-disk-size SIZE
    const char *kv_remote_url;        // --kv-remote redis://HOST:PORT: the pool shared by workers
    const char *kv_offload_dtype;     // --kv-offload-dtype: disk / Redis pages (NULL: f32, lossless)
} pd_engine_params;
pd_engine_params pd_engine_params_default(void);

// Loads model + tokenizer and sizes the KV cache. NULL with err on failure.
pd_engine *pd_engine_new(const pd_engine_params *p, pd_err *err);
// Starts the engine thread. PD_OK or PD_ERR_IO.
pd_status pd_engine_start(pd_engine *e);
// Stops the thread (finishing nothing: running requests get ABORT events) and frees everything.
void pd_engine_free(pd_engine *e);

const pd_tok *pd_engine_tok(const pd_engine *e);            // valid until pd_engine_free
const pd_model_config *pd_engine_config(const pd_engine *e);
int pd_engine_max_model_len(const pd_engine *e);
const char *pd_engine_model_name(const pd_engine *e);        // folder basename

typedef struct pd_engine_request {
    uint64_t id;                  // caller-chosen, unique among live requests
    const int32_t *prompt;        // copied by submit
    int n_prompt;
    int max_tokens;               // > 0
    bool ignore_eos;
    const int32_t *stop_ids;      // copied (n_stop_ids <= 16)
    int n_stop_ids;
    pd_sampling_params sampling;
    int priority;                 // higher runs first (default 0)
    int64_t arrival_us;           // 0 = now
    char traceparent[56];         // "" or the caller's span as W3C traceparent (sent on to a prefill worker)
    // Logit bias and token mask (constrained decoding), or NULL. Owned by the engine once submit
    // returns PD_OK (the request's sampler frees it); on an error the caller still owns it. Its
    // mask source is then called on the engine thread only. A request with a ctl is prefilled by
    // its decode worker (a prefill worker would sample the first token without it).
    pd_sample_ctl *ctl;
} pd_engine_request;

// Queues a request.
//   PD_OK           queued; events will follow
//   PD_NOSPACE      the waiting queue is full (HTTP 503 + Retry-After)
//   PD_ERR_INVALID  bad request: err says why (prompt + max_tokens beyond the context length,
//                   empty prompt, token id out of range, duplicate id, bad sampling params)
//   PD_ERR_NOMEM
pd_status pd_engine_submit(pd_engine *e, const pd_engine_request *r, pd_err *err);
// Aborts a request (client went away, stop string matched). Unknown ids are ignored.
void pd_engine_abort(pd_engine *e, uint64_t id);

typedef enum pd_engine_event_kind {
    PD_EV_TOKEN = 1,
    PD_EV_FINISHED = 2,
} pd_engine_event_kind;

typedef enum pd_engine_finish {
    PD_ENGINE_FINISH_LENGTH = 1,
    PD_ENGINE_FINISH_STOP = 2,    // EOS or a stop id
    PD_ENGINE_FINISH_ABORT = 3,
    PD_ENGINE_FINISH_ERROR = 4,   // could never fit in the KV cache, or a device error
} pd_engine_finish;

typedef struct pd_engine_event {
    pd_engine_event_kind kind;
    uint64_t id;
    pd_sample_result tok;         // TOKEN: token id, logprob and top alternatives
    pd_engine_finish finish;      // FINISHED
    int n_prompt_tokens;          // FINISHED and first TOKEN
    int n_cached_tokens;          // prompt tokens served from the prefix cache
    int n_output_tokens;          // FINISHED
    // The first TOKEN only: where the time to it went (pd_time_us; 0 = not reached). Local
    // prefill: t_sched_us = start of the first step that computed the prompt, t_kv_ready_us = end
    // of the step that completed it. Remote: t_sched_us = PREFILL_REQ sent, t_kv_ready_us = KV
    // verified, remote_*_us = the prefill worker's own queue and compute time.
    bool is_remote_prefill;
    int64_t t_arrival_us, t_sched_us, t_kv_ready_us, remote_queue_us, remote_compute_us;
    // FINISHED, speculative decoding: method (0 none), drafts verified, accepted, verify steps
    int spec_method;
    int n_spec_drafted, n_spec_accepted, n_spec_steps;
} pd_engine_event;

// File descriptor that becomes readable when events are pending (level-triggered: it stays
// readable until pd_engine_poll has drained everything).
int pd_engine_event_fd(const pd_engine *e);
// Moves up to max pending events into out; returns how many.
int pd_engine_poll(pd_engine *e, pd_engine_event *out, int max);

// The KV port a PREFILL engine listens on (after pd_engine_start), else 0.
int pd_engine_kv_port(const pd_engine *e);
// Decode role: prefill workers currently connected (0 otherwise).
int pd_engine_n_prefill_healthy(pd_engine *e);
pd_kvw_transport pd_engine_kv_transport(const pd_engine *e);

typedef enum pd_fallback_reason {
    PD_FALLBACK_UNAVAILABLE = 0,  // no healthy / unsaturated prefill worker
    PD_FALLBACK_TIMEOUT = 1,      // the handoff took longer than disagg_timeout_ms
    PD_FALLBACK_WORKER_DIED = 2,  // the prefill worker's connection was lost
    PD_FALLBACK_CHECKSUM = 3,     // KV arrived but failed verification (never decoded from)
    PD_FALLBACK_ERROR = 4,        // the prefill worker reported an error
    PD_FALLBACK_POOL_REFUSED = 5, // the prefill worker refused our KV pool (it could not map or check it)
    PD_FALLBACK_N = 6,
} pd_fallback_reason;
const char *pd_fallback_reason_name(pd_fallback_reason r);
// Speculative method names by pd_engine_stats.spec_method / event spec_method index ("none",
// "draft", "ngram", "lookahead"); PD_ENGINE_SPEC_N methods.
#define PD_ENGINE_SPEC_N 4
const char *pd_engine_spec_method_name(int m);

#define PD_ENGINE_MAX_TIERS 3
typedef struct pd_engine_tier_stats {
    char name[16];              // "dram", "disk", "redis"
    int64_t hits, misses, puts, put_failures, evictions, bad_pages, bytes_in, bytes_out, n_items;
    uint64_t bytes_used, capacity;
    int64_t load_hist[24];      // block loads served by this tier: bucket i < 2^i us
} pd_engine_tier_stats;

typedef struct pd_engine_stats {
    int n_running, n_waiting;
    int n_blocks_total, n_blocks_free, n_blocks_used, n_blocks_cached;
    int64_t n_prompt_tokens, n_generation_tokens;   // totals
    int64_t n_prefix_query_tokens, n_prefix_hit_tokens;
    int64_t n_prefill_tokens_computed;              // prompt tokens actually run through the model
    int64_t n_preemptions, n_steps;
    int64_t n_requests_finished;
    // disaggregation (decode role)
    int64_t n_kv_handoffs;                     // prompts whose KV came from a prefill worker
    int64_t n_kv_fallbacks[PD_FALLBACK_N];     // prompts prefilled locally after a failed handoff
    int64_t n_kv_local_short;                  // prompts prefilled locally because they were short
    int64_t n_kv_handoff_bytes;
    int64_t kv_handoff_us_total;               // request sent → KV verified, summed
    int64_t n_disagg_decide_local, n_disagg_decide_remote;  // link-aware decisions (above min tokens)
    // prefill role
    int64_t n_kv_exports;
    int64_t n_kv_export_bytes;                 // KV bytes written into decode pools (cuda-ipc / shm)
    int64_t kv_export_copy_us_total;           // time of those copies alone (pd_op_kv_copy + sync), summed
    // the KV connector (either role): what it refused, dropped or fenced
    int64_t n_kv_auth_failures;                // peers that did not prove the shared secret
    int64_t n_kv_proto_errors;                 // connections closed for a malformed / out-of-bounds frame
    int64_t n_kv_conns_accepted;               // prefill role: KV connections accepted (lifetime)
    int64_t n_kv_slow_peer_drops;              // sends refused or connections closed: a peer not reading
    int64_t n_kv_fenced;                       // decode: loads failed only after their writer was fenced off
    int64_t n_kv_peers_refused;                // prefill: decode pools refused (size / handle did not check out)
    int64_t n_kv_saves_layerwise;              // prefill: exports whose layers shipped during the forward pass
    int64_t n_kv_saves_failed;                 // prefill: PREFILL_FAIL sent
    // speculative decoding, by method (index = pd_spec_method): draft tokens verified, accepted,
    // tokens emitted by verify steps (accepted + the target's own), sequence-steps that verified
    int spec_method;
    int64_t spec_drafted[4], spec_accepted[4], spec_emitted[4], spec_steps[4];
    // per draft position j (0-based, all methods): verify rows that reached draft j (drafts 0..j-1
    // accepted) and of those, accepted: the per-position acceptance is accepted[j] / reached[j]
    int64_t spec_pos_reached[16], spec_pos_accepted[16];
    // KV tiers (n_tiers 0 when off)
    int n_tiers;
    pd_engine_tier_stats tiers[PD_ENGINE_MAX_TIERS];
    char tier_dtype[8];
    int64_t tier_offloads, tier_offloads_dropped, tier_loads, tier_load_blocks, tier_promotions;
    int64_t n_tier_hit_tokens;                 // prompt tokens loaded from a tier instead of computed
    int64_t n_tier_loads_done, tier_load_us_total;
    int64_t tier_remote_notify[5];             // Redis keyspace notifications: evicted, expired, deleted,
                                               // ignored (malformed / foreign), CONFIG SET refused
} pd_engine_stats;
void pd_engine_stats_get(pd_engine *e, pd_engine_stats *out);
// A measurement tool (bench-spec's "paused" mode): while paused, a speculative engine's steps skip
// the speculation hooks and run as without speculation (its state, tables and draft model are kept);
// the same engine timed paused and not gives the policy's cost without the engine-to-engine
// spread (two engines of one configuration differ by up to ~1% on an H100: memory placement).
// Any thread; meant between runs (a step in flight finishes as it started). No-op without speculation.
void pd_engine_spec_pause(pd_engine *e, bool paused);

// What a router polls (GET /internal/state): load (queue, KV usage, measured prefill tokens/s and
// decode step time) and the KV events (blocks stored in / evicted from the prefix cache) with
// sequence numbers >= since, at most max_events. out->events is owned by out
// (pd_wire_state_fini). Any thread. PD_OK or PD_ERR_NOMEM.
pd_status pd_engine_state(pd_engine *e, uint64_t since, int max_events, pd_wire_state *out);

// The link-aware disaggregation model (wire/link.h) of a decode worker now: its step-time model
// and each prefill link's measured latency, bandwidth and compute model. Any thread.
void pd_engine_disagg_model(pd_engine *e, pd_disagg_model *out);
// Cluster mode (decode role): the prefill worker whose KV address is worker_addr claims queued
// request req_id. PD_OK (its PREFILL_REQ is on the way), PD_ERR_NOTFOUND (not queued any more),
// PD_NOSPACE (not connected to that worker), PD_ERR_INVALID (not a worker we dial: nothing sent).
// Any thread.
pd_status pd_engine_prefill_claim(pd_engine *e, uint64_t req_id, const char *worker_addr);

#ifdef __cplusplus
}
#endif
