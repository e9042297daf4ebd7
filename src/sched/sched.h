// sched — the continuous-batching scheduler (vLLM v1 style). Each step is one forward of a mixed
// batch: pd_sched_schedule() decides which requests compute which tokens and returns a pd_step_plan;
// the engine runs the forward, samples, and hands the sampled tokens to pd_sched_update(), which
// appends them, applies the stop rules and reports token / finished events.
//
// "Schedule tokens, not phases" (vLLM NOTE(woosuk)): a request only has n_tokens (prompt + sampled
// outputs) and n_tokens_computed (tokens whose KV is in its blocks). A step gives each request as
// many of its remaining tokens as the budget allows, so chunked prefill, decode, prefix-cache hits
// (n_tokens_computed starts at the hit) and recompute after preemption are one mechanism. Order of
// a step: running decodes, then running prefill chunks, then admission of waiting requests (FCFS by
// default, or shortest-uncached-prefill-first with aging; higher priority always first), bounded
// by max_num_batched_tokens and max_num_seqs.
//
// Request states:
//
//   pd_sched_add                 admitted: prefix hit,                 stop / length / error
//   ─────────────► WAITING ───── blocks, slot ──────────► RUNNING ─────────────────────► FINISHED
//                     ▲                                   │   │                    (event, freed)
//                     │ re-admitted like a new request,   │   │ pd_sched_abort (any state):
//                     │ outputs appended to its prompt    │   └───────────────────────► FINISHED
//                     │                                   │ no KV room for a more important
//                 PREEMPTED ◄──── blocks freed, ──────────┘ request (the least important and
//                 (queued with     n_tokens_computed = 0      youngest running one is chosen)
//                  WAITING)
//
// Preemption recomputes: the victim's blocks go back to the pool (where its full blocks stay
// cached, so readmission is often a prefix hit) and it keeps its sampled tokens. A request that can
// never fit (more blocks than the pool, or a prompt over the budget with chunking off) finishes
// with PD_FINISH_ERROR instead of waiting forever.
//
// Disaggregation hooks (prefill and decode in different workers), both optional per request:
//
//   decode side, is_remote_prefill:  WAITING ── admitted: blocks for the whole prompt, a slot,
//        no token budget ──► LOADING_KV (plan->kv_loads asks the engine to fetch the prompt's KV)
//        ── pd_sched_kv_loaded(ok, first_token) ──► RUNNING (decodes next step)
//        ── pd_sched_kv_loaded(!ok) ──► RUNNING from the prefix-cache hit: recompute locally.
//        An abort while LOADING_KV frees the slot but keeps the blocks until kv_loaded is called
//        (a transfer may still be writing them).
//   tier side, n_tier_tokens > the prefix-cache hit (KV that left the device pool for a tier
//        below it, kvtier/): WAITING ── admitted: blocks for positions [hit, tier_end), a seat, no
//        token budget ──► LOADING_TIER (plan->tier_loads asks the engine to load those blocks)
//        ── pd_sched_tier_loaded(n) ──► RUNNING with n more tokens computed (0..all of them: a
//        tier may have lost blocks since); the loaded blocks join the prefix cache. An abort while
//        LOADING_TIER behaves as one while LOADING_KV (blocks kept until pd_sched_tier_loaded).
//        tier_end = min(n_tier_tokens, the last whole block before the last token): at least one
//        token is always computed (the logits need a forward).
//   prefill side, is_hold_blocks: on finish the request leaves RUNNING for HELD, keeping its
//        blocks (listed in its finished event) until pd_sched_release, once the KV was sent.
//
// Pure: no I/O, no locks, no clock reads (time comes in as now_us), no device calls. One thread (the
// engine's) owns a pd_sched. The scheduler borrows a pd_kv_mgr and assumes it is the only user of
// its blocks (pd_sched_check relies on that).
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"
#include "kv/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_sched pd_sched;

// Why a request finished. Crosses process boundaries: only append.
typedef enum pd_finish_reason {
    PD_FINISH_NONE = 0,    // still running
    PD_FINISH_STOP = 1,    // stop or EOS token, or the engine saw a stop string
    PD_FINISH_LENGTH = 2,  // max_tokens, or the context limit (max_model_len / the KV pool)
    PD_FINISH_ABORT = 3,   // pd_sched_abort
    PD_FINISH_ERROR = 4,   // can never be scheduled (does not fit the KV pool / the token budget)
} pd_finish_reason;

const char *pd_finish_reason_str(pd_finish_reason r);  // "stop", "length", "abort", "error", "none"

typedef enum pd_sched_policy {
    PD_SCHED_FCFS = 0,  // arrival order
    PD_SCHED_SRPT = 1,  // fewest prompt tokens left to compute first (prefix- and tier-aware), with aging
} pd_sched_policy;

typedef struct pd_sched_params {
    int32_t max_num_seqs;            // running requests at most (slots 0..max_num_seqs-1); 256
    int32_t max_num_batched_tokens;  // tokens per step; 2048
    bool enable_chunked_prefill;     // false: a prompt is admitted only whole; true
    int32_t max_prefill_chunk;       // a prefill chunk has at most this many tokens; 0 = no limit
    int32_t max_model_len;           // prompt + outputs limit (LENGTH); 0 = only the KV pool limits
    pd_sched_policy policy;          // PD_SCHED_FCFS
    int64_t srpt_starvation_us;      // SRPT: waited longer than this = served in arrival order
                                     // ahead of shorter ones; 5 s
    int32_t max_lookahead_slots;     // speculation: at most this many draft positions per decode
                                     // (pd_sched_set_lookahead); 0 = none
    bool backfill;                   // admission: a waiting request whose blocks do not fit now is
                                     // passed by later ones that fit (EASY-style backfill), while it
                                     // has waited less than backfill_max_wait_us; then strict order
                                     // (nobody overtakes it) until it is admitted. false
    int64_t backfill_max_wait_us;    // 250 ms
    bool tier_reserve_compute;       // a tier load also reserves the blocks of the tokens computed
                                     // after it (those its joining step takes), so the load cannot
                                     // end without room to compute; true
} pd_sched_params;

pd_sched_params pd_sched_params_default(void);

// kv: borrowed, must outlive the scheduler. NULL (err set: PD_ERR_INVALID, PD_ERR_NOMEM) on failure.
// out: owned by caller (pd_sched_free).
pd_sched *pd_sched_new(const pd_sched_params *p, pd_kv_mgr *kv, pd_err *err);
// Frees every request still inside (their blocks go back to the pool). NULL is a no-op.
void pd_sched_free(pd_sched *s);

typedef struct pd_sched_req_params {
    uint64_t req_id;           // unique among live requests
    const int32_t *prompt;     // borrowed for the call (copied); n_prompt >= 1
    int32_t n_prompt;
    int32_t max_tokens;        // >= 1
    int32_t min_tokens;        // stop and EOS tokens are ignored before this many outputs
    const int32_t *stop_ids;   // borrowed for the call (copied): always stop
    int32_t n_stop_ids;
    const int32_t *eos_ids;    // borrowed for the call (copied): stop unless ignore_eos
    int32_t n_eos_ids;
    bool ignore_eos;
    int32_t priority;          // higher is served first; 0 by default
    uint64_t cache_key;        // prefix-cache separation (LoRA id, cache salt); 0 = none
    bool is_remote_prefill;    // decode side: the prompt's KV and first token come from elsewhere
    bool is_hold_blocks;       // prefill side: keep the blocks after finish until pd_sched_release
    int32_t n_tier_tokens;     // leading prompt tokens whose KV a tier below the device pool may
                               // hold (a multiple of the block size; 0: none). Ignored with
                               // is_remote_prefill.
} pd_sched_req_params;

// Queues a request (WAITING).
//   PD_OK
//   PD_ERR_INVALID  duplicate id, empty prompt, max_tokens < 1, prompt over max_model_len, or (with
//                   chunked prefill off) a prompt over max_num_batched_tokens; err says which
//   PD_ERR_NOMEM
pd_status pd_sched_add(pd_sched *s, const pd_sched_req_params *rp, int64_t now_us, pd_err *err);

// Finishes a request in any state (client gone): its blocks and slot are freed now (a request
// loading KV keeps its blocks until pd_sched_kv_loaded; a held one is released). No event is
// emitted (the caller knows). If the request is in the outstanding plan, the plan's pointers stay
// valid and pd_sched_update skips it. PD_OK, or PD_ERR_NOTFOUND for an unknown / finished id.
pd_status pd_sched_abort(pd_sched *s, uint64_t req_id);

// Speculation: asks for n lookahead slots (draft positions) after each future decode token of the
// request, 0 <= n <= max_lookahead_slots (clamped). Sticky until changed. A step grants them after
// every decode got its token, while the budget lasts and without preempting anyone (a grant that
// needs a block the pool cannot give shrinks to what the request's blocks already hold), and never
// beyond max_len or max_tokens (the last token of a step always comes from the target).
// PD_OK, or PD_ERR_NOTFOUND for an unknown id.
pd_status pd_sched_set_lookahead(pd_sched *s, uint64_t req_id, int32_t n);

// ---- one step ------------------------------------------------------------------------------------

// One request's share of a step. Positions pos_start .. pos_start + n_tokens - 1 are computed and
// written into the request's blocks: token p lives in block_ids[p / block_size], slot p % block_size.
typedef struct pd_step_seq {
    uint64_t req_id;
    int32_t slot;              // 0..max_num_seqs-1, stable while the request runs
    int32_t pos_start;         // = tokens already computed
    int32_t n_tokens;          // >= 1
    const int32_t *tokens;     // (n_tokens) valid until the next pd_sched_update
    bool needs_logits;         // the chunk reaches the last token: sample one token from it
    const int32_t *block_ids;  // (n_blocks) the whole block table, covering pos_start + n_tokens
    int32_t n_blocks;          //   + n_lookahead tokens; valid until the next pd_sched_update
    int32_t n_lookahead;       // speculation (decodes only): positions pos_start + n_tokens ..
                               //   + n_lookahead - 1 are reserved for draft tokens the engine may
                               //   compute in the same forward; 0 otherwise. They count against the
                               //   token budget (plan->n_tokens includes them).
} pd_step_seq;

// A KV load the engine must start (remote prefill): fetch the KV of prompt positions
// n_tokens_local .. n_tokens - 1 into the blocks, then call pd_sched_kv_loaded.
typedef struct pd_step_kv_load {
    uint64_t req_id;
    int32_t slot;
    int32_t n_tokens_local;    // prefix-cache hit: these positions are already here
    int32_t n_tokens;          // the prompt
    const int32_t *block_ids;  // (n_blocks) covering n_tokens; valid until pd_sched_kv_loaded
    int32_t n_blocks;
} pd_step_kv_load;

typedef struct pd_sched_event pd_sched_event;

// The step plan: a plain value the engine reads. All arrays are owned by the scheduler and valid
// until the next pd_sched_schedule.
typedef struct pd_step_plan {
    uint64_t step_id;
    int32_t n_seqs;                   // 0 when there is nothing to do
    const pd_step_seq *seqs;          // (n_seqs) running decodes, running prefill chunks, then
                                      //   newly admitted requests
    int32_t n_tokens;                 // sum of seqs[i].n_tokens (<= max_num_batched_tokens)
    int32_t n_preempted;              // requests preempted by this step (slots released)
    const uint64_t *preempted_ids;    // (n_preempted)
    int32_t n_finished;               // requests finished by this step without computing (ERROR)
    const pd_sched_event *finished;   // (n_finished) report them like pd_sched_update's events
    int32_t n_kv_loads;               // remote-prefill requests admitted by this step
    const pd_step_kv_load *kv_loads;  // (n_kv_loads)
    int32_t n_tier_loads;             // requests admitted to LOADING_TIER by this step: load
    const pd_step_kv_load *tier_loads;  // positions n_tokens_local .. n_tokens - 1 (whole blocks)
                                      //   into block_ids, then call pd_sched_tier_loaded
} pd_step_plan;

// Builds the next step. Never fails: an empty plan means no work (or none possible right now).
void pd_sched_schedule(pd_sched *s, int64_t now_us, pd_step_plan *out);

// What the engine sampled for plan->seqs[i] (only read where needs_logits). With speculation, the
// first n_accepted draft tokens the engine computed in the lookahead slots were accepted: they are
// appended (their KV is computed) before token, the target's own token (correction or bonus).
// Rejected draft positions are simply not counted: their KV slots are overwritten later, and no
// block holding them is ever registered in the prefix cache (only computed positions are).
typedef struct pd_step_output {
    int32_t token;
    bool is_stop_string_hit;  // the detokenized text now contains a stop string: finish (STOP)
    int32_t n_accepted;        // 0 .. seq.n_lookahead
    const int32_t *accepted;   // (n_accepted) the accepted draft tokens, in order; borrowed
} pd_step_output;

struct pd_sched_event {
    uint64_t req_id;
    int32_t token;                // the sampled token, -1 if none (PD_FINISH_ERROR from schedule)
    pd_finish_reason finish;      // PD_FINISH_NONE while the request goes on
    int32_t stop_token;           // the stop / EOS token that finished it, else -1
    int32_t n_prompt_tokens;      // the original prompt
    int32_t n_output_tokens;      // sampled so far, this token included
    int32_t n_cached_tokens;      // prompt tokens served by the prefix cache at first admission
    int32_t n_preemptions;
    const int32_t *block_ids;     // is_hold_blocks and finished: the held blocks (n_blocks),
    int32_t n_blocks;             //   valid until pd_sched_release; else NULL, 0
    int32_t seq_index;            // pd_sched_update: the plan seq it came from; else -1
    int32_t out_index;            // pd_sched_update: 0 .. n_accepted (the token's place in the
                                  //   step's output of that seq: accepted drafts, then token)
};

// Applies a step's results. plan must be the one from the last pd_sched_schedule, and outputs has
// plan->n_seqs entries (NULL is allowed when no seq needs logits). Computed blocks are cached,
// sampled tokens appended (accepted drafts first, one at a time, each followed by the stop rules:
// a request that stops mid-way drops the rest), stop rules applied; finished requests free their
// blocks and slots. *events (owned by the scheduler, valid until the next call) gets one event per
// appended token.
//   PD_OK
//   PD_ERR_INVALID  plan is not the outstanding one, or an output accepts more drafts than its
//                   seq's n_lookahead (nothing applied)
pd_status pd_sched_update(pd_sched *s, const pd_step_plan *plan, const pd_step_output *outputs,
                          int64_t now_us, const pd_sched_event **events, int32_t *n_events);

// ---- disaggregation -------------------------------------------------------------------------------

// Ends a KV load listed in a plan's kv_loads. ok: the prompt's KV is in the blocks and first_token
// was sampled remotely; it is appended and the stop rules run, *ev describes it (it may finish the
// request). !ok: the request computes its prompt locally from its prefix-cache hit on; *ev has
// token -1 and no finish.
//   PD_OK
//   PD_ERR_CLOSED    the request was aborted while loading: its blocks are freed now, no event
//   PD_ERR_NOTFOUND  no request with this id is loading
pd_status pd_sched_kv_loaded(pd_sched *s, uint64_t req_id, bool ok, int32_t first_token,
                             pd_sched_event *ev);

// Ends a tier load listed in a plan's tier_loads: n_loaded tokens from its n_tokens_local on are in
// its blocks (a multiple of the block size, 0 .. n_tokens - n_tokens_local; a tier stops at its
// first missing block). The request runs on from there (its next chunk computes the rest); the
// loaded full blocks join the prefix cache.
//   PD_OK
//   PD_ERR_CLOSED    the request was aborted while loading: its blocks are freed now
//   PD_ERR_NOTFOUND  no request with this id is loading from a tier
//   PD_ERR_INVALID   n_loaded out of range or not block-aligned (nothing changed)
pd_status pd_sched_tier_loaded(pd_sched *s, uint64_t req_id, int32_t n_loaded);

// The same, for a tier load the engine completed within this step (the KV tiers' hot DRAM: the
// copy is enqueued on the transfer stream with a fence the step's compute waits on), called after
// pd_sched_schedule and before the plan is run: the request also joins this plan like a request
// admitted with a prefix-cache hit of n_tokens_local + n_loaded tokens, computing its next tokens
// within the budget the step left (never preempting; no budget, blocks or chunk fits: it runs
// from the next step). plan->seqs / n_seqs / n_tokens grow by it; the tier_loads entry's
// block_ids may no longer be read (the request's block table may have grown).
//   as pd_sched_tier_loaded, and PD_ERR_INVALID for a plan that is not the outstanding one
pd_status pd_sched_tier_loaded_now(pd_sched *s, pd_step_plan *plan, uint64_t req_id, int32_t n_loaded);

// Frees the blocks of a finished is_hold_blocks request (its KV has been sent). PD_OK, or
// PD_ERR_NOTFOUND if no request with this id is held.
pd_status pd_sched_release(pd_sched *s, uint64_t req_id);

// ---- inspection ----------------------------------------------------------------------------------
typedef struct pd_sched_stats {
    int32_t n_waiting;           // includes preempted requests waiting for readmission
    int32_t n_running;
    int64_t n_steps;
    int64_t n_preemptions;
    int64_t n_finished;          // by update or schedule (not aborts)
    int64_t n_aborted;
    int32_t n_loading;           // remote-prefill and tier requests waiting for their KV (incl. aborted)
    int32_t n_tier_loading;      // of which loading from a tier
    int64_t n_tier_loads;        // tier loads started (lifetime)
    int32_t n_held;              // finished requests holding blocks for a transfer
    int64_t n_backfill_passes;   // admissions that passed a blocked request (backfill)
    int64_t n_join_short;        // tier loads that ended in their step without room or budget to
                                 // compute in it (they compute from the next step on)
} pd_sched_stats;

void pd_sched_stats_get(const pd_sched *s, pd_sched_stats *out);
bool pd_sched_has_work(const pd_sched *s);  // any waiting, running or loading request

// Checks every invariant (queues, slots, states, block ref counts against the block tables, and
// pd_kv_check). PD_OK or PD_ERR_INVALID with the first violation in err. O(requests + blocks).
pd_status pd_sched_check(const pd_sched *s, pd_err *err);

#ifdef __cplusplus
}
#endif
