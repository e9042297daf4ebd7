// schedule.c — pd_sched_schedule: one step as a sequence of named phases (vLLM schedule()):
//
//   plan_release      drop the previous plan if it was never applied
//   grow_running(1)   running requests with one token left (decodes), most important first
//   grow_lookahead    speculation: lookahead slots for the decodes just scheduled, while budget
//                     lasts, never preempting (a slot that needs a block the pool lacks is cut)
//   grow_running(0)   running requests mid-prompt (prefill chunks)
//   admit_waiting     new and preempted requests in policy order, while budget, seats and blocks
//                     last; skipped in a step that had to preempt (there is no room anyway).
//                     A remote-prefill request takes a seat and blocks but no budget: it goes
//                     to LOADING_KV and into plan->kv_loads; a request a tier holds more of
//                     than the prefix cache does, likewise to LOADING_TIER and plan->tier_loads
//   emit_plan         fill the pd_step_plan from the scheduled requests
//
// Token budget: each scheduled request costs the tokens it computes (1 for a decode). Seats: at
// most max_num_seqs running requests. Blocks: pd_kv_alloc_slots is all-or-nothing; when a running
// request gets PD_NOSPACE, the least important running request not yet scheduled in this step is
// preempted and the allocation retried (preempt_until_fits). Scheduled requests are never victims,
// so a plan never loses blocks it already counts on, and the current request is the last resort.
// Because the victim is the least important, the most important request always progresses: no
// livelock. Admission never preempts (vLLM does the same): a waiting request waits for room.
#include "sched/sched_impl.h"

#include <stdlib.h>

typedef enum fit_result {
    FIT_OK = 0,         // blocks allocated: schedule it
    FIT_PREEMPTED = 1,  // the request itself was preempted (or finished): it left running
    FIT_SKIP = 2,       // could not allocate for another reason (OOM): try next step
} fit_result;

static void mark_scheduled(pd_sched *s, pd_sched_req *r, int32_t n_new, int32_t *budget, int32_t *n_sched) {
    r->n_scheduled = n_new;
    s->scheduled[(*n_sched)++] = r;
    *budget -= n_new;
}

// Finishes r with PD_FINISH_ERROR from inside schedule; the event goes into the plan.
static void finish_error(pd_sched *s, pd_sched_req *r) {
    pd_sched_event ev = pd_sched_req_event(r);
    ev.finish = PD_FINISH_ERROR;
    s->plan_finished[s->n_plan_finished++] = ev;
    s->stats.n_finished++;
    pd_sched_req_finish(s, r);
}

static fit_result preempt_until_fits(pd_sched *s, pd_sched_req *r, int32_t n_new, int32_t *n_preempted) {
    if (PD_NEVER(pd_kv_n_blocks_for(s->kv, r->n_computed + n_new) > pd_kv_n_blocks(s->kv))) {
        finish_error(s, r);  // cannot happen while n_tokens <= max_len; never loop on it
        return FIT_PREEMPTED;
    }
    for (;;) {
        pd_status st = pd_kv_alloc_slots(s->kv, &r->kv, r->n_computed, n_new);
        if (st == PD_OK) return FIT_OK;
        if (st != PD_NOSPACE) return FIT_SKIP;
        // The least important running request that is not in the plan yet; r qualifies. A
        // request loading KV is no candidate: a transfer is writing its blocks.
        pd_sched_req *victim = NULL;
        for (int32_t j = s->n_running - 1; j >= 0 && !victim; j--)
            if (s->running[j]->n_scheduled == 0 && s->running[j]->state == PD_SCHED_RUNNING)
                victim = s->running[j];
        PD_ASSERT(victim);
        s->preempted_ids[(*n_preempted)++] = victim->id;
        pd_sched_req_preempt(s, victim);
        if (victim == r) return FIT_PREEMPTED;
    }
}

static void grow_running(pd_sched *s, bool decodes, int32_t *budget, int32_t *n_sched,
                         int32_t *n_preempted) {
    for (int32_t i = 0; i < s->n_running && *budget > 0;) {
        pd_sched_req *r = s->running[i];
        int32_t remaining = r->n_tokens - r->n_computed;
        if (r->state != PD_SCHED_RUNNING || r->n_scheduled > 0 || PD_NEVER(remaining <= 0) ||
            (remaining == 1) != decodes) {
            i++;
            continue;
        }
        int32_t n_new = PD_MIN(remaining, *budget);
        if (!decodes && s->params.max_prefill_chunk > 0) n_new = PD_MIN(n_new, s->params.max_prefill_chunk);
        if (!s->params.enable_chunked_prefill && n_new < remaining) {
            i++;
            continue;
        }
        fit_result fr = preempt_until_fits(s, r, n_new, n_preempted);
        if (fr == FIT_OK) mark_scheduled(s, r, n_new, budget, n_sched);
        if (fr != FIT_PREEMPTED) i++;  // else r left the array and i already names the next one
    }
}

// Lookahead slots (draft positions) for the decodes scheduled so far, most important first. A
// decode's lookahead is capped so the step's last token still fits max_len and max_tokens, and so
// its draft positions never need a block the pool cannot give right now: lookahead is an
// optimisation, it must never preempt or block anyone.
static void grow_lookahead(pd_sched *s, int32_t n_sched, int32_t *budget) {
    int32_t bs = pd_kv_block_size(s->kv);
    for (int32_t i = 0; i < n_sched && *budget > 0; i++) {
        pd_sched_req *r = s->scheduled[i];
        if (r->n_lookahead_want <= 0 || r->n_computed + r->n_scheduled != r->n_tokens) continue;
        // Positions n_tokens .. n_tokens + n - 1: at most max_len - n_tokens of them (the KV must
        // fit) and max_tokens - outputs - 1 (each accepted draft is an output, then the target's).
        int32_t n_out = r->n_tokens - r->n_prompt;
        int32_t n = PD_MIN(r->n_lookahead_want, *budget);
        n = PD_MIN(n, s->max_len - r->n_tokens);
        n = PD_MIN(n, r->max_tokens - n_out - 1);
        if (n <= 0) continue;
        // New blocks only with a block of headroom per running request left in the pool, so the
        // prefill chunks and admissions after this phase do not preempt for want of them.
        int32_t need = pd_kv_n_blocks_for(s->kv, r->n_tokens + n) - r->kv.n_blocks;
        if (need > 0 && (pd_kv_n_free(s->kv) - need < s->n_running ||
                         pd_kv_alloc_slots(s->kv, &r->kv, r->n_tokens, n) != PD_OK)) {
            int32_t room = r->kv.n_blocks * bs - r->n_tokens;  // what its blocks already hold
            n = PD_MIN(n, room);
            if (n <= 0) continue;
        }
        r->n_lookahead = n;
        *budget -= n;
    }
}

// ---- admission -----------------------------------------------------------------------------------

typedef enum admit_result {
    ADMIT_OK = 0,
    ADMIT_FAILED = 1,   // finished with PD_FINISH_ERROR: can never run
    ADMIT_BLOCKED = 2,  // not now (budget, blocks, memory): stop admitting, keep the order
} admit_result;

// Remote prefill: blocks for the whole prompt and a seat, no token budget; the engine loads the KV.
static admit_result admit_remote(pd_sched *s, pd_sched_req *r, int32_t hit) {
    if (pd_kv_alloc_slots(s->kv, &r->kv, hit, r->n_tokens - hit) != PD_OK) {
        pd_kv_free_request(s->kv, &r->kv);
        return ADMIT_BLOCKED;
    }
    if (r->n_cached_tokens < 0) r->n_cached_tokens = hit;
    r->n_computed = hit;
    r->is_dequeued = true;
    pd_sched_running_insert(s, r);
    r->state = PD_SCHED_LOADING_KV;
    s->n_loading++;
    s->loads[s->n_plan_loads++] = r;
    return ADMIT_OK;
}

// Tier load: blocks for positions [hit, tier_end) and a seat, no token budget; the engine loads
// them from a tier below the device pool.
static admit_result admit_tier(pd_sched *s, pd_sched_req *r, int32_t hit, int32_t tier_end) {
    int32_t end = tier_end;
    if (s->params.tier_reserve_compute) {  // and the tokens its joining step computes
        int32_t n_new = PD_MIN(r->n_tokens - tier_end, s->params.max_num_batched_tokens);
        if (s->params.enable_chunked_prefill && s->params.max_prefill_chunk > 0)
            n_new = PD_MIN(n_new, s->params.max_prefill_chunk);
        end = tier_end + n_new;
    }
    if (pd_kv_alloc_slots(s->kv, &r->kv, hit, end - hit) != PD_OK) {
        pd_kv_free_request(s->kv, &r->kv);
        return ADMIT_BLOCKED;
    }
    if (r->n_cached_tokens < 0) r->n_cached_tokens = hit;
    r->n_computed = hit;
    r->tier_end = tier_end;
    r->is_dequeued = true;
    pd_sched_running_insert(s, r);
    r->state = PD_SCHED_LOADING_TIER;
    s->n_loading++;
    s->stats.n_tier_loading++;
    s->stats.n_tier_loads++;
    s->tier_reqs[s->n_plan_tier_loads++] = r;
    return ADMIT_OK;
}

// Where a tier load of r would end: the leading prompt tokens a tier holds, in whole blocks, never
// the last token (the logits need a forward). 0: nothing to load.
static int32_t tier_end_of(const pd_sched *s, const pd_sched_req *r) {
    int32_t bs = pd_kv_block_size(s->kv);
    int32_t tier_end = PD_MIN(r->n_tier_tokens, r->n_prompt);
    return PD_MIN(tier_end, (r->n_tokens - 1) / bs * bs) / bs * bs;
}

static admit_result try_admit(pd_sched *s, pd_sched_req *r, int32_t *budget, int32_t *n_sched) {
    if (r->n_tokens > s->max_len) {  // more KV than the whole pool (or model) can hold
        finish_error(s, r);
        return ADMIT_FAILED;
    }
    int32_t hit = 0;
    if (pd_kv_get_computed_blocks(s->kv, &r->kv, r->tokens, r->n_tokens, &hit) != PD_OK)
        return ADMIT_BLOCKED;
    if (r->is_remote_prefill) return admit_remote(s, r, hit);
    // A tier holds more of the prompt than the device pool: load it (whole blocks, and never the
    // last token: the logits need a forward).
    int32_t tier_end = tier_end_of(s, r);
    if (tier_end > hit) return admit_tier(s, r, hit, tier_end);
    int32_t remaining = r->n_tokens - hit, n_new = PD_MIN(remaining, *budget);
    if (!s->params.enable_chunked_prefill) {
        if (remaining > s->params.max_num_batched_tokens) {  // a preempted request grown too long
            finish_error(s, r);
            return ADMIT_FAILED;
        }
        if (remaining > *budget) n_new = 0;
    } else if (remaining > 1 && s->params.max_prefill_chunk > 0) {
        n_new = PD_MIN(n_new, s->params.max_prefill_chunk);
    }
    if (n_new <= 0 || pd_kv_alloc_slots(s->kv, &r->kv, hit, n_new) != PD_OK) {
        pd_kv_free_request(s->kv, &r->kv);
        return ADMIT_BLOCKED;
    }
    if (r->n_cached_tokens < 0) r->n_cached_tokens = hit;
    r->n_computed = hit;
    r->is_dequeued = true;
    pd_sched_running_insert(s, r);
    mark_scheduled(s, r, n_new, budget, n_sched);
    return ADMIT_OK;
}

static int srpt_cmp(const void *pa, const void *pb) {
    const pd_sched_req *a = *(pd_sched_req *const *)pa, *b = *(pd_sched_req *const *)pb;
    if (a->priority != b->priority) return a->priority > b->priority ? -1 : 1;
    if (a->srpt_key != b->srpt_key) return a->srpt_key < b->srpt_key ? -1 : 1;
    return a->arrival_seq < b->arrival_seq ? -1 : a->arrival_seq > b->arrival_seq;
}

// SRPT order into s->order: priority desc, then starved requests (waited >= srpt_starvation_us)
// in arrival order, then fewest tokens left to compute: prefix-aware (cached blocks cost nothing)
// and tier-aware (blocks a tier below the device pool holds are loaded, not computed: a turn of a
// chat whose history is in host DRAM costs its new tokens only).
static void srpt_order(pd_sched *s, int64_t now_us) {
    for (int32_t i = 0; i < s->n_waiting; i++) {
        pd_sched_req *r = s->waiting[i];
        s->order[i] = r;
        if (now_us - r->arrival_us >= s->params.srpt_starvation_us) {
            r->srpt_key = -1;
            continue;
        }
        int32_t hit = pd_kv_peek_computed(s->kv, &r->kv, r->tokens, r->n_tokens);
        r->srpt_key = r->n_tokens - PD_MAX(PD_MAX(hit, 0), tier_end_of(s, r));
    }
    qsort(s->order, (size_t)s->n_waiting, sizeof *s->order, srpt_cmp);
}

static void admit_waiting(pd_sched *s, int64_t now_us, int32_t *budget, int32_t *n_sched) {
    if (s->n_waiting == 0) return;
    bool srpt = s->params.policy == PD_SCHED_SRPT;
    int32_t n_cand = s->n_waiting, n_blocked = 0;
    if (srpt) srpt_order(s, now_us);
    for (int32_t i = 0; i < n_cand; i++) {
        if (s->n_running >= s->params.max_num_seqs || *budget <= 0) break;
        if (s->n_plan_finished >= s->params.max_num_seqs) break;  // the rest next step
        pd_sched_req *r = srpt ? s->order[i] : s->waiting[i];
        admit_result a = try_admit(s, r, budget, n_sched);
        if (a == ADMIT_BLOCKED) {
            // Keep the order: nobody overtakes a blocked request, unless backfill is on and it
            // has waited less than backfill_max_wait_us (later requests that fit go first; an
            // admission this step takes blocks, which all come back as requests finish).
            if (!s->params.backfill || now_us - r->arrival_us >= s->params.backfill_max_wait_us) break;
            n_blocked++;
            continue;
        }
        if (a == ADMIT_OK && n_blocked) s->stats.n_backfill_passes++;
        if (a == ADMIT_FAILED && !srpt) {
            i--;  // it left s->waiting, which we are walking
            n_cand--;
        }
    }
    int32_t n = 0;  // drop the admitted from the waiting queue, keeping the order
    for (int32_t i = 0; i < s->n_waiting; i++) {
        pd_sched_req *r = s->waiting[i];
        if (r->is_dequeued) r->is_dequeued = false;
        else s->waiting[n++] = r;
    }
    s->n_waiting = n;
}

// ---- the step ------------------------------------------------------------------------------------

static void emit_plan(pd_sched *s, int32_t n_sched, int32_t n_preempted, pd_step_plan *out) {
    int32_t n_tokens = 0;
    for (int32_t i = 0; i < n_sched; i++) {
        pd_sched_req *r = s->scheduled[i];
        pd_step_seq *e = &s->plan_seqs[i];
        e->req_id = r->id;
        e->slot = r->slot;
        e->pos_start = r->n_computed;
        e->n_tokens = r->n_scheduled;
        e->tokens = r->tokens + r->n_computed;
        e->needs_logits = r->n_computed + r->n_scheduled == r->n_tokens;
        e->block_ids = r->kv.block_ids;
        e->n_blocks = r->kv.n_blocks;
        e->n_lookahead = r->n_lookahead;
        n_tokens += r->n_scheduled + r->n_lookahead;
    }
    out->step_id = s->step_id;
    out->n_seqs = n_sched;
    out->seqs = s->plan_seqs;
    out->n_tokens = n_tokens;
    out->n_preempted = n_preempted;
    out->preempted_ids = s->preempted_ids;
    out->n_finished = s->n_plan_finished;
    out->finished = s->plan_finished;
    for (int32_t i = 0; i < s->n_plan_loads; i++) {
        pd_sched_req *r = s->loads[i];
        s->plan_loads[i] = (pd_step_kv_load){
            .req_id = r->id,
            .slot = r->slot,
            .n_tokens_local = r->n_computed,
            .n_tokens = r->n_tokens,
            .block_ids = r->kv.block_ids,
            .n_blocks = r->kv.n_blocks,
        };
    }
    out->n_kv_loads = s->n_plan_loads;
    out->kv_loads = s->plan_loads;
    for (int32_t i = 0; i < s->n_plan_tier_loads; i++) {
        pd_sched_req *r = s->tier_reqs[i];
        s->plan_tier_loads[i] = (pd_step_kv_load){
            .req_id = r->id,
            .slot = r->slot,
            .n_tokens_local = r->n_computed,
            .n_tokens = r->tier_end,
            .block_ids = r->kv.block_ids,
            .n_blocks = pd_kv_n_blocks_for(s->kv, r->tier_end),
        };
    }
    out->n_tier_loads = s->n_plan_tier_loads;
    out->tier_loads = s->plan_tier_loads;
}

void pd_sched_schedule(pd_sched *s, int64_t now_us, pd_step_plan *out) {
    pd_sched_plan_release(s);
    s->step_id++;
    s->has_plan = true;
    s->n_plan_finished = 0;
    s->n_plan_loads = 0;
    s->n_plan_tier_loads = 0;
    int32_t budget = s->params.max_num_batched_tokens, n_sched = 0, n_preempted = 0;
    grow_running(s, true, &budget, &n_sched, &n_preempted);
    if (s->params.max_lookahead_slots > 0) grow_lookahead(s, n_sched, &budget);
    grow_running(s, false, &budget, &n_sched, &n_preempted);
    if (n_preempted == 0) admit_waiting(s, now_us, &budget, &n_sched);
    emit_plan(s, n_sched, n_preempted, out);
    s->plan_n_sched = n_sched;
    s->plan_budget = budget;
    if (n_sched > 0) s->stats.n_steps++;
}

// A tier load ended inside the step (pd_sched_tier_loaded_now): r (RUNNING, not scheduled) takes
// its next tokens in the outstanding plan, as try_admit would give them, without preempting.
void pd_sched_join_plan(pd_sched *s, pd_sched_req *r, pd_step_plan *out) {
    int32_t remaining = r->n_tokens - r->n_computed, n_new = PD_MIN(remaining, s->plan_budget);
    if (PD_NEVER(remaining <= 0)) return;
    if (!s->params.enable_chunked_prefill) {
        if (remaining > s->plan_budget) {
            s->stats.n_join_short++;
            return;
        }
    } else if (remaining > 1 && s->params.max_prefill_chunk > 0) {
        n_new = PD_MIN(n_new, s->params.max_prefill_chunk);
    }
    if (n_new <= 0 || pd_kv_alloc_slots(s->kv, &r->kv, r->n_computed, n_new) != PD_OK) {
        s->stats.n_join_short++;
        return;
    }
    int32_t n_sched = s->plan_n_sched;
    mark_scheduled(s, r, n_new, &s->plan_budget, &n_sched);
    s->plan_n_sched = n_sched;
    pd_step_seq *e = &s->plan_seqs[n_sched - 1];
    *e = (pd_step_seq){.req_id = r->id, .slot = r->slot, .pos_start = r->n_computed, .n_tokens = n_new,
                       .tokens = r->tokens + r->n_computed, .needs_logits = r->n_computed + n_new == r->n_tokens,
                       .block_ids = r->kv.block_ids, .n_blocks = r->kv.n_blocks, .n_lookahead = 0};
    if (out->n_seqs == 0) s->stats.n_steps++;
    out->n_seqs = n_sched;
    out->n_tokens += n_new;
}
