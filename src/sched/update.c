// update.c — pd_sched_update: applies a computed step. For each scheduled request: its computed
// count advances, newly filled blocks go into the prefix cache, and if it produced logits the
// sampled token is appended and the stop rules run, in vLLM's order:
//
//   1. the engine saw a stop string          -> STOP
//   2. max_tokens outputs, or the context    -> LENGTH   (n_tokens >= max_len: the pool or
//      limit reached                                      max_model_len cannot hold another)
//   3. fewer than min_tokens outputs          -> go on
//   4. a stop id (or EOS unless ignore_eos)   -> STOP, stop_token = it
//
// With speculation a step appends the accepted draft tokens first, one by one, each checked like a
// sampled token (a stop id among them ends the request there, the rest is dropped), then the
// target's token; n_computed advances over the accepted drafts only.
//
// A finished request frees its blocks (after caching its full ones, which happened just above) and
// its slot at once, so the next pd_sched_schedule can reuse them, unless it was added with
// is_hold_blocks (prefill side of disaggregation): then it is HELD until pd_sched_release.
// pd_sched_kv_loaded (remote prefill done) lands here too: its first token is like a sampled one.
#include "sched/sched_impl.h"

#include <string.h>

static pd_status append_token(pd_sched_req *r, int32_t token) {
    pd_status st = PD_ARRAY_RESERVE(r->tokens, r->cap_tokens, (size_t)r->n_tokens + 1);
    if (st != PD_OK) return st;
    r->tokens[r->n_tokens++] = token;
    return PD_OK;
}

static pd_finish_reason check_stop(const pd_sched *s, const pd_sched_req *r, const pd_step_output *o,
                                   int32_t *stop_token) {
    int32_t n_out = r->n_tokens - r->n_prompt, tok = r->tokens[r->n_tokens - 1];
    if (o->is_stop_string_hit) return PD_FINISH_STOP;
    if (n_out >= r->max_tokens || r->n_tokens >= s->max_len) return PD_FINISH_LENGTH;
    if (n_out < r->min_tokens) return PD_FINISH_NONE;
    for (int32_t i = 0; i < r->n_stop; i++) {
        if (r->stop_ids[i] == tok) {
            *stop_token = tok;
            return PD_FINISH_STOP;
        }
    }
    return PD_FINISH_NONE;
}

// A finished request frees everything, or keeps its blocks for a transfer (HELD).
static void end_if_finished(pd_sched *s, pd_sched_req *r, pd_sched_event *ev) {
    if (ev->finish == PD_FINISH_NONE) return;
    s->stats.n_finished++;
    if (r->is_hold_blocks) pd_sched_req_hold(s, r, ev);
    else pd_sched_req_finish(s, r);
}

// Appends one output token and runs the stop rules; *ev describes it. Returns the finish reason.
static pd_finish_reason append_and_check(pd_sched *s, pd_sched_req *r, int32_t token, const pd_step_output *o,
                                         pd_sched_event *ev) {
    pd_finish_reason why;
    int32_t stop_token = -1;
    if (append_token(r, token) != PD_OK) {
        why = PD_FINISH_ERROR;
        *ev = pd_sched_req_event(r);
    } else {
        why = check_stop(s, r, o, &stop_token);
        *ev = pd_sched_req_event(r);
        ev->token = token;
    }
    ev->finish = why;
    ev->stop_token = stop_token;
    return why;
}

// Applies plan entry e (seq index i) to r; returns the number of events written to ev.
static int32_t apply_one(pd_sched *s, pd_sched_req *r, int32_t i, const pd_step_seq *e, const pd_step_output *o,
                         pd_sched_event *ev) {
    PD_ASSERT(e->pos_start == r->n_computed && r->n_computed + e->n_tokens <= r->n_tokens);
    r->n_computed += e->n_tokens;
    r->n_scheduled = 0;
    r->n_lookahead = 0;
    int32_t n_ev = 0;
    if (e->needs_logits) {
        // Accepted drafts: each one's KV was computed in its lookahead slot, so it is computed as
        // soon as it is appended; then the target's own token (not computed yet).
        static const pd_step_output plain = {.token = -1};
        pd_finish_reason why = PD_FINISH_NONE;
        for (int32_t k = 0; k < o->n_accepted && why == PD_FINISH_NONE; k++) {
            why = append_and_check(s, r, o->accepted[k], &plain, &ev[n_ev]);
            r->n_computed++;
            ev[n_ev].seq_index = i;
            ev[n_ev++].out_index = k;
        }
        if (why == PD_FINISH_NONE) {
            why = append_and_check(s, r, o->token, o, &ev[n_ev]);
            ev[n_ev].seq_index = i;
            ev[n_ev++].out_index = o->n_accepted;
        }
    }
    // Only computed positions are cached: a block holding rejected drafts is never registered.
    // NOMEM here only delays caching: the next call registers the blocks it missed.
    (void)pd_kv_cache_full_blocks(s->kv, &r->kv, r->tokens, r->n_computed);
    if (n_ev > 0) end_if_finished(s, r, &ev[n_ev - 1]);
    return n_ev;
}

pd_status pd_sched_update(pd_sched *s, const pd_step_plan *plan, const pd_step_output *outputs,
                          int64_t now_us, const pd_sched_event **events, int32_t *n_events) {
    *events = s->events;
    *n_events = 0;
    if (!s->has_plan || !plan || plan->step_id != s->step_id || plan->seqs != s->plan_seqs)
        return PD_ERR_INVALID;
    int32_t n_seqs = plan->n_seqs, n_ev = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const pd_step_seq *e = &s->plan_seqs[i];
        if (e->needs_logits && !outputs) return PD_ERR_INVALID;
        if (outputs && (outputs[i].n_accepted < 0 || outputs[i].n_accepted > e->n_lookahead ||
                        (outputs[i].n_accepted > 0 && (!outputs[i].accepted || !e->needs_logits))))
            return PD_ERR_INVALID;
    }
    // Walk our own record of the plan: an aborted request is a zombie there (still valid memory).
    for (int32_t i = 0; i < n_seqs; i++) {
        pd_sched_req *r = s->scheduled[i];
        if (r->state != PD_SCHED_RUNNING) continue;
        n_ev += apply_one(s, r, i, &s->plan_seqs[i], outputs ? &outputs[i] : NULL, &s->events[n_ev]);
    }
    pd_sched_plan_release(s);
    *n_events = n_ev;
    return PD_OK;
}

pd_status pd_sched_kv_loaded(pd_sched *s, uint64_t req_id, bool ok, int32_t first_token,
                             pd_sched_event *ev) {
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (!r || r->state != PD_SCHED_LOADING_KV) return PD_ERR_NOTFOUND;
    if (r->is_aborted) {
        pd_sched_req_drop(s, r);
        return PD_ERR_CLOSED;
    }
    s->n_loading--;
    r->is_remote_prefill = false;
    r->state = PD_SCHED_RUNNING;
    *ev = pd_sched_req_event(r);
    if (!ok) return PD_OK;  // fall back: a running prefill from the prefix-cache hit on
    // The remote worker computed the whole prompt and sampled the first token: like an update.
    r->n_computed = r->n_tokens;
    (void)pd_kv_cache_full_blocks(s->kv, &r->kv, r->tokens, r->n_computed);
    pd_step_output o = {.token = first_token};
    pd_finish_reason why = PD_FINISH_ERROR;
    int32_t stop_token = -1;
    if (append_token(r, first_token) == PD_OK) {
        why = check_stop(s, r, &o, &stop_token);
        ev->token = first_token;
    }
    ev->n_output_tokens = r->n_tokens - r->n_prompt;
    ev->finish = why;
    ev->stop_token = stop_token;
    end_if_finished(s, r, ev);
    return PD_OK;
}

pd_status pd_sched_tier_loaded(pd_sched *s, uint64_t req_id, int32_t n_loaded) {
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (!r || r->state != PD_SCHED_LOADING_TIER) return PD_ERR_NOTFOUND;
    if (n_loaded < 0 || n_loaded > r->tier_end - r->n_computed || n_loaded % pd_kv_block_size(s->kv))
        return PD_ERR_INVALID;
    if (r->is_aborted) {
        pd_sched_req_drop(s, r);
        return PD_ERR_CLOSED;
    }
    s->n_loading--;
    s->stats.n_tier_loading--;
    r->state = PD_SCHED_RUNNING;
    r->n_computed += n_loaded;
    // The loaded blocks are computed KV like any other: later prompts hit them in the device pool.
    (void)pd_kv_cache_full_blocks(s->kv, &r->kv, r->tokens, r->n_computed);
    return PD_OK;
}

pd_status pd_sched_tier_loaded_now(pd_sched *s, pd_step_plan *plan, uint64_t req_id, int32_t n_loaded) {
    if (!s->has_plan || !plan || plan->step_id != s->step_id || plan->seqs != s->plan_seqs) return PD_ERR_INVALID;
    pd_status st = pd_sched_tier_loaded(s, req_id, n_loaded);
    if (st != PD_OK) return st;
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (PD_NEVER(!r || r->state != PD_SCHED_RUNNING)) return PD_OK;
    pd_sched_join_plan(s, r, plan);
    return PD_OK;
}
