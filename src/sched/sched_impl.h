// sched_impl.h — internals of sched/, shared by its .c files only.
//
//   sched.c     params, new/free, add, abort, queues, finishing a request     pd_sched_*
//   schedule.c  pd_sched_schedule: the phases of one step
//   update.c    pd_sched_update: sampled tokens, stop rules
//   reqmap.c    req_id -> request map                                         pd_sched_reqmap_*
//   check.c     pd_sched_check
#pragma once

#include "base/buf.h"
#include "base/map.h"
#include "sched/sched.h"

typedef enum pd_sched_state {
    PD_SCHED_WAITING = 0,
    PD_SCHED_RUNNING = 1,
    PD_SCHED_PREEMPTED = 2,  // in the waiting queue, with outputs to recompute
    PD_SCHED_FINISHED = 3,   // aborted while in the outstanding plan; freed at the next update
    PD_SCHED_LOADING_KV = 4, // remote prefill: blocks and slot held, waiting for pd_sched_kv_loaded
    PD_SCHED_HELD = 5,       // finished, blocks kept for a transfer until pd_sched_release
    PD_SCHED_LOADING_TIER = 6,  // loading from a KV tier: blocks and slot held, waiting for
                                // pd_sched_tier_loaded (no token budget, not a preemption victim)
} pd_sched_state;

// A request whose blocks a load may be writing (remote prefill or a tier).
static inline bool pd_sched_state_is_loading(pd_sched_state st) {
    return st == PD_SCHED_LOADING_KV || st == PD_SCHED_LOADING_TIER;
}

typedef struct pd_sched_req {
    uint64_t id;
    pd_sched_state state;
    int32_t *tokens;            // owned; (n_tokens) prompt then sampled outputs; append-only
    int32_t n_tokens;
    size_t cap_tokens;
    int32_t n_prompt;           // the original prompt
    int32_t n_computed;         // tokens whose KV is in kv's blocks
    int32_t max_tokens, min_tokens;
    int32_t *stop_ids;          // owned; (n_stop) stop ids, plus EOS ids unless ignore_eos
    int32_t n_stop;
    int32_t priority;
    int64_t arrival_us;
    uint64_t arrival_seq;       // tie-breaker: order of pd_sched_add
    int32_t n_cached_tokens;    // prefix hit at first admission; -1 before it
    int32_t n_preemptions;
    int32_t slot;               // -1 unless running
    int32_t n_scheduled;        // tokens in the outstanding step (0 = not scheduled)
    int32_t n_lookahead_want;   // speculation: lookahead slots asked for (pd_sched_set_lookahead)
    int32_t n_lookahead;        // lookahead slots granted in the outstanding step
    int64_t srpt_key;           // scratch for SRPT ordering
    bool is_dequeued;           // scratch: leaves the waiting queue at the end of admission
    bool is_remote_prefill;     // the prompt's KV is still to be loaded from a prefill worker
    bool is_hold_blocks;        // on finish: HELD instead of freeing the blocks
    int32_t n_tier_tokens;      // leading prompt tokens a tier may hold (pd_sched_req_params)
    int32_t tier_end;           // LOADING_TIER: the load covers positions [n_computed, tier_end)
    bool is_aborted;            // LOADING_KV / LOADING_TIER only: aborted, slot gone, blocks kept for the load
    pd_kv_seq kv;
} pd_sched_req;

// req_id -> request: a pd_map (base/map.h) of {id, request} hashed by the mixed id; grows at add
// time (reserve), so the insert that follows cannot fail.
typedef struct pd_sched_reqmap {
    pd_map map;  // of pd_sched_reqmap_entry; the requests are not owned
    int32_t n;
} pd_sched_reqmap;

pd_status pd_sched_reqmap_init(pd_sched_reqmap *m);
void pd_sched_reqmap_fini(pd_sched_reqmap *m);
pd_sched_req *pd_sched_reqmap_find(const pd_sched_reqmap *m, uint64_t id);
// Makes room for one more entry (may allocate). PD_OK or PD_ERR_NOMEM.
pd_status pd_sched_reqmap_reserve(pd_sched_reqmap *m);
// Inserts (after a successful reserve; the id must be absent).
void pd_sched_reqmap_insert(pd_sched_reqmap *m, pd_sched_req *r);
void pd_sched_reqmap_remove(pd_sched_reqmap *m, uint64_t id);
// Iteration over every live request: slots 0 .. pd_sched_reqmap_cap - 1, NULL for an empty one.
size_t pd_sched_reqmap_cap(const pd_sched_reqmap *m);
pd_sched_req *pd_sched_reqmap_at(const pd_sched_reqmap *m, size_t i);

struct pd_sched {
    pd_sched_params params;
    pd_kv_mgr *kv;                // borrowed
    int32_t max_len;              // min(max_model_len, KV pool tokens): LENGTH at this many tokens
    pd_sched_reqmap reqs;         // every live request (waiting, running, zombie)
    pd_sched_req **waiting;       // owned array; (n_waiting) sorted by (priority desc, arrival)
    int32_t n_waiting;
    size_t cap_waiting;
    pd_sched_req **order;         // owned scratch; (cap_order >= live requests) SRPT admission order
    size_t cap_order;
    pd_sched_req **running;       // owned; (max_num_seqs) sorted by (priority desc, arrival)
    int32_t n_running;
    int32_t *free_slots;          // owned; (max_num_seqs) stack of unused slots
    int32_t n_free_slots;
    uint64_t next_arrival_seq;
    // The outstanding plan and its storage.
    bool has_plan;
    uint64_t step_id;
    pd_sched_req **scheduled;     // owned; (max_num_seqs) in plan order
    pd_step_seq *plan_seqs;       // owned; (max_num_seqs)
    uint64_t *preempted_ids;      // owned; (max_num_seqs)
    pd_sched_event *plan_finished;  // owned; (max_num_seqs)
    int32_t n_plan_finished;
    pd_step_kv_load *plan_loads;  // owned; (max_num_seqs)
    pd_sched_req **loads;         // owned; (max_num_seqs) requests behind plan_loads
    int32_t n_plan_loads;
    pd_step_kv_load *plan_tier_loads;  // owned; (max_num_seqs)
    pd_sched_req **tier_reqs;          // owned; (max_num_seqs) requests behind plan_tier_loads
    int32_t n_plan_tier_loads;
    int32_t plan_n_sched;         // the outstanding plan: requests in scheduled[] / plan_seqs[]
    int32_t plan_budget;          //   and the token budget it left (pd_sched_tier_loaded_now)
    int32_t n_loading;            // LOADING_KV and LOADING_TIER requests (in running, or aborted: detached)
    int32_t n_loading_aborted;    // detached: in the map only, blocks kept until kv_loaded
    int32_t n_held;               // detached: HELD requests
    pd_sched_req **zombies;       // owned; (max_num_seqs) aborted while in the plan
    int32_t n_zombies;
    pd_sched_event *events;       // owned; (max_num_seqs * (1 + max_lookahead_slots)) update's output
    pd_sched_stats stats;
};

// ---- sched.c -------------------------------------------------------------------------------------
// True when a must be served before b (priority desc, then arrival).
static inline bool pd_sched_req_before(const pd_sched_req *a, const pd_sched_req *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->arrival_seq < b->arrival_seq;
}
void pd_sched_waiting_insert(pd_sched *s, pd_sched_req *r);  // capacity reserved at add
void pd_sched_running_insert(pd_sched *s, pd_sched_req *r);
void pd_sched_running_remove(pd_sched *s, pd_sched_req *r);
// Fills the event fields describing r (no token, no finish).
pd_sched_event pd_sched_req_event(const pd_sched_req *r);
// Releases r's blocks and slot, takes it out of its queue and the map, and frees it (or parks it as
// a zombie if the outstanding plan points into it). r must be running or waiting.
void pd_sched_req_finish(pd_sched *s, pd_sched_req *r);
// Running -> HELD: slot released, blocks kept; the event gets the block ids.
void pd_sched_req_hold(pd_sched *s, pd_sched_req *r, pd_sched_event *ev);
// Frees a request that is in no queue (held, aborted while loading): map, blocks, memory.
void pd_sched_req_drop(pd_sched *s, pd_sched_req *r);
// Running -> PREEMPTED (blocks freed, recompute later), recorded in the plan.
void pd_sched_req_preempt(pd_sched *s, pd_sched_req *r);
// Ends the outstanding plan (applied or abandoned): clears every n_scheduled, frees the zombies.
void pd_sched_plan_release(pd_sched *s);
// ---- schedule.c ----------------------------------------------------------------------------------
// Adds r (RUNNING, unscheduled) to the outstanding plan within the budget it left, if it fits.
void pd_sched_join_plan(pd_sched *s, pd_sched_req *r, pd_step_plan *out);
