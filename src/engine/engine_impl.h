// engine_impl.h — the engine's internal state, shared by engine.c (the step loop) and disagg.c
// (remote prefill on the decode side, KV export on the prefill side). Engine thread only, except
// where a field says otherwise.
#pragma once
#include "engine/engine.h"
#include "engine/queue.h"
#include "kv/kv.h"
#include "sched/sched.h"
#include "kvconn/kvconn.h"
#include "base/buf.h"
#include "base/map.h"

typedef struct ereq {
    uint64_t id;
    pd_sampler *sampler;  // owned
    int n_prompt;
    // decode role: remote prefill
    bool is_remote;       // admitted with is_remote_prefill
    bool is_loading;      // PREFILL_REQ sent (or being sent), result pending
    bool is_aborted;      // aborted while loading: the result only frees the blocks
    int32_t *prompt;      // owned copy (the PREFILL_REQ needs it after submit)
    int32_t load_start;   // first position asked for (block-aligned)
    int32_t *load_blocks; // owned: decode blocks of positions [load_start, n_prompt)
    int32_t n_load_blocks;
    int64_t load_t0_us;
    pd_sampling_params sampling;
    // TTFT breakdown (pd_engine_event) and tracing
    int64_t t_arrival_us, t_sched_us, t_kv_ready_us, remote_queue_us, remote_compute_us;
    bool is_first_sent, is_kv_remote;
    int kv_worker;        // decode: the prefill worker the link model chose (-1: least loaded)
    char traceparent[56];
    // prefill role: this request computes KV for a decode worker
    bool is_export;
    int conn_id;
    uint64_t peer_req_id;
    int32_t export_start;
    int32_t *dst_blocks;  // owned (n_dst_blocks)
    int32_t n_dst_blocks;
    pd_kvconn_save *save;  // the save in progress (its last prompt chunk is in the current step)
    struct sreq *spec;    // owned: speculative decoding state (engine/spec.c), NULL when off
    // KV tiers (engine/tiers.c)
    pd_hash128 *tier_hashes;  // owned: the prompt's chained block hashes (n_tier_hashes full blocks)
    int n_tier_hashes;
    bool is_tier_loading;     // a tier load is in flight (its blocks are reserved)
    int64_t tier_t0_us;
    int n_tier_loaded;        // prompt tokens loaded from tiers
} ereq;

typedef struct step_bufs {
    int32_t *tokens, *q_indptr, *kv_lens, *bt_indptr, *bt_indices, *logit_rows, *logit_seq;
    size_t cap_tokens, cap_seqs, cap_bt;  // PD_ARRAY_RESERVE (base/buf.h) capacities
    float *logits;  // (cap_seqs, vocab)
    pd_step_output *outputs;
    pd_sample_result *results;  // by plan seq index
    pd_engine_event *events;
    size_t cap_events;
    // device sampling (pd_op_sample): rows and results (cap_srows), penalty entries (cap_spens)
    int sample_mode;  // 0: not decided yet, 1: on the device, 2: on the host
    pd_sample_row *srows;
    pd_sample_out *souts;
    pd_sample_pen *spens;
    size_t cap_srows, cap_spens;
    uint32_t *smasks;            // token masks of the constrained rows (cap_smasks words)
    size_t cap_smasks;
} step_bufs;

struct pd_engine {
    pd_engine_params params;
    int max_num_seqs;  // in force: the params value or the backend default (reported to routers)
    char model_name[256];
    pd_backend *backend;
    pd_model *model;
    pd_tok *tok;
    pd_model_cache *cache;
    pd_kv_mgr *kv;
    pd_sched *sched;
    int max_model_len;
    pd_queue q;
    pthread_t thread;
    bool started;
    pd_map reqs;  // request id -> ereq * (req_entry in engine.c); reserved before each insert
    step_bufs sb;
    int64_t n_prefill_computed, n_generated, n_prompt_tokens, n_finished;
    // disaggregation
    pd_kvconn *kc;        // the KV connector (decode or prefill role); NULL colocated
    ereq **saves;         // prefill role: requests whose save runs in the current step
    int n_saves;
    size_t cap_saves;
    uint64_t next_internal_id;
    bool last_step_empty;  // the last schedule produced nothing to run
    // Where the engine thread's time goes, summed over steps that ran a plan (logged at exit):
    // gap = the previous step's end -> this step's start (commands, stats, idle waits); pre = the
    // schedule and the loads' start; run = the forward and the sampling (the host waits for the
    // device there); post = the update, the offloads' enqueue and the events to the HTTP loop.
    int64_t prof_steps, prof_seqs, prof_tokens, prof_gap_us, prof_pre_us, prof_run_us, prof_post_us, prof_last_end_us, prof_launch_us;
    // The same on the device (backend timer marks around the forward, when the backend has them):
    // the forward's device time, and the device time from the previous step's forward end to this
    // one's start (host work between steps, and waits enqueued before the forward: fences).
    bool tm_marked, tm_have_prev;
    int tm_end;  // timer index of this step's forward end (1 or 2; the other is the previous end)
    int64_t prof_gpu_n, prof_gpu_between_n;
    double prof_gpu_fwd_ms, prof_gpu_between_ms;
    pd_wire_kv_log *kv_log;  // KV events for routers; guarded by q.mu
    uint64_t instance;       // random per process (routers detect restarts)
    double ema_prefill_tps, ema_decode_ms;  // guarded by q.mu when read
    pd_link_fit step_fit;   // step µs over tokens in the step (the local step-time model); q.mu
    int64_t n_decide_local, n_decide_remote;  // link-aware decisions (decode role), engine thread
    int64_t n_running_now;  // requests running at the last step (the model's rows per step)
    int64_t n_debug_steps;  // debug_fail_step_every
    int64_t n_exports, n_handoffs, n_fallbacks[PD_FALLBACK_N], n_local_short, handoff_bytes, handoff_us;
    int64_t export_bytes, export_copy_us;  // prefill role: direct-write KV copies (bytes, time)
    void **layer_k, **layer_v;  // (n_layers) this engine's cache layer bases (owned arrays)
    struct espec *spec;         // owned: speculative decoding (engine/spec.c), NULL when off
    pd_kvconn_tiers *tiers;     // the KV tiers below the pool (engine/tiers.c), NULL when off
    int64_t n_tier_hit_tokens, n_tier_loads_done, tier_load_us;
    bool tier_same_step;      // hot DRAM loads end inside the admitting step (PDSERVE_KV_TIER_SAMESTEP=0: off)
    int64_t n_tier_loads_now; // of n_tier_loads_done: ended inside the admitting step
};



// engine.c helpers used by disagg.c
ereq *pd_engine_req_find(pd_engine *e, uint64_t id);
// Room for one more request: call before anything else changes, then the insert cannot fail.
pd_status pd_engine_req_reserve(pd_engine *e);
void pd_engine_req_insert(pd_engine *e, ereq *q);
// The i-th slot of the request table (i < pd_engine_req_cap), or NULL when empty.
size_t pd_engine_req_cap(const pd_engine *e);
ereq *pd_engine_req_at(const pd_engine *e, size_t i);
void pd_engine_req_remove(pd_engine *e, uint64_t id);
void pd_engine_emit_finished(pd_engine *e, uint64_t id, pd_engine_finish f, int n_prompt, int n_cached, int n_out);
// results[i]: what was sampled for plan->seqs[i] (read where needs_logits); NULL when plan is.
void pd_engine_push_sched_events(pd_engine *e, const pd_step_plan *plan, const pd_sample_result *results,
                                 const pd_sched_event *ev, int n);

// disagg.c
pd_status pd_disagg_init(pd_engine *e, pd_err *err);  // after the model and cache exist
void pd_disagg_fini(pd_engine *e);
// *worker: the prefill worker the link model chose (-1: the least loaded).
bool pd_disagg_want_remote(pd_engine *e, const int32_t *prompt, int n_prompt, int *worker);
void pd_disagg_start_loads(pd_engine *e, const pd_step_plan *plan);
void pd_disagg_handle(pd_engine *e, pd_kvconn_event *ev);  // a connector event, on the engine thread
// Prefill role, before a step runs: starts the saves of requests whose last prompt chunk is in the
// plan and sets batch->on_layer so each layer ships as soon as it is computed.
void pd_disagg_step_begin(pd_engine *e, const pd_step_plan *plan, pd_batch *batch);
// The step failed: every save of the step fails now (PREFILL_FAIL), its requests are released.
void pd_disagg_step_failed(pd_engine *e, uint64_t req_id);
// Prefill role: a held request finished its prefill: send its KV and first token, release blocks.
void pd_disagg_export(pd_engine *e, ereq *q, const pd_sched_event *ev, const pd_sample_result *first);
// An abort of a request that is loading (decode) or exporting (prefill).
void pd_disagg_abort(pd_engine *e, ereq *q);
void pd_disagg_req_fini(ereq *q);  // frees the disaggregation fields

// tiers.c — the KV tiers below the device pool (NULL e->tiers: every call is a no-op / 0).
pd_status pd_tiers_init(pd_engine *e, pd_kvw_fingerprint fp, pd_err *err);  // after the cache exists
void pd_tiers_fini(pd_engine *e);                   // before the cache and the queue go
void pd_tiers_req_fini(ereq *q);
// Computes the prompt's block hashes into q and probes the tiers: the n_tier_tokens to submit.
int32_t pd_tiers_req_init(pd_engine *e, ereq *q, const int32_t *prompt, int n_prompt);
void pd_tiers_start_loads(pd_engine *e, pd_step_plan *plan);
// Before the step's compute: the step's same-step tier copies go on the transfer stream. batch:
// layer-wise, batch->before_layer makes each layer wait for its copy; NULL (a step that runs
// without the hook): one copy, fenced. After the compute was enqueued (or the step failed or had
// no sequences): pd_tiers_step_end closes it.
void pd_tiers_step_begin(pd_engine *e, pd_batch *batch);
void pd_tiers_step_end(pd_engine *e);
void pd_tiers_handle(pd_engine *e, pd_kvconn_event *ev);  // TIER_LOADED, on the engine thread
void pd_tiers_drain_kv_events(pd_engine *e);  // offload newly cached blocks; router's KV log
void pd_tiers_stats(pd_engine *e, pd_engine_stats *o);
pd_kvw_fingerprint pd_disagg_fingerprint(pd_engine *e);

// spec.c — speculative decoding in the step loop (NULL e->spec: every call is a no-op / false).
pd_status pd_engine_spec_load(pd_engine *e, pd_err *err);  // after the target loads: checks, draft weights
size_t pd_engine_spec_kv_bytes_per_block(const pd_engine *e);  // the draft's KV per block (0 without)
pd_status pd_engine_spec_init(pd_engine *e, pd_sched_params *sp, pd_err *err);  // before pd_sched_new
pd_status pd_engine_spec_warmup(pd_engine *e, pd_err *err);                     // after the target's
void pd_engine_spec_fini(pd_engine *e);
pd_status pd_engine_spec_req_init(pd_engine *e, ereq *q, const pd_engine_request *r);
void pd_engine_spec_req_fini(ereq *q);
// Runs the plan's step with speculation (draft forwards, one verify forward, the acceptance rule)
// when it has lookahead slots or draft work; *handled false = run it the plain way.
pd_status pd_engine_spec_run_plan(pd_engine *e, const pd_step_plan *plan, bool *handled);
// After pd_sched_update: token history, lookahead asks for the next step, cost model.
void pd_engine_spec_after_update(pd_engine *e, const pd_step_plan *plan, int64_t step_us, bool was_spec);
void pd_engine_spec_push_token(ereq *q, int32_t token);  // every token the request gets, in order
// The result of out_index of plan seq seq_index in the last speculative step, or NULL.
const pd_sample_result *pd_engine_spec_result(pd_engine *e, int seq_index, int out_index);
void pd_engine_spec_fill_finished(pd_engine *e, const ereq *q, pd_engine_event *o);
void pd_engine_spec_stats(pd_engine *e, pd_engine_stats *o);
