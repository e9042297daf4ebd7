// sched.c — the scheduler object, request intake and removal, and the two queues.
//
// Storage: every buffer a step needs (plan entries, preempted ids, events, slot stack, the running
// array) is sized by max_num_seqs at creation; the waiting array and the id map grow only in
// pd_sched_add, which reserves room for every live request, so preempting (running -> waiting)
// never allocates. Requests are heap objects; their token arrays grow as tokens are sampled.
//
// Queue order. Both queues are kept sorted by (priority desc, arrival asc), the "importance" order:
// the waiting queue is the FCFS admission order (preempted requests keep their arrival, so they go
// back ahead of later arrivals, as vLLM prepends them), and the running queue's tail is the
// preemption victim. Inserts are binary search + memmove: cheap next to a forward pass.
#include "sched/sched_impl.h"

#include <string.h>

const char *pd_finish_reason_str(pd_finish_reason r) {
    switch (r) {
    case PD_FINISH_NONE: return "none";
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_LENGTH: return "length";
    case PD_FINISH_ABORT: return "abort";
    case PD_FINISH_ERROR: return "error";
    }
    return "unknown";
}

pd_sched_params pd_sched_params_default(void) {
    pd_sched_params p = {
        .max_num_seqs = 256,
        .max_num_batched_tokens = 2048,
        .enable_chunked_prefill = true,
        .max_prefill_chunk = 0,
        .max_model_len = 0,
        .policy = PD_SCHED_FCFS,
        .srpt_starvation_us = 5 * 1000 * 1000,
        .max_lookahead_slots = 0,
        .backfill = false,
        .backfill_max_wait_us = 250 * 1000,
        .tier_reserve_compute = true,
    };
    return p;
}

pd_sched *pd_sched_new(const pd_sched_params *p, pd_kv_mgr *kv, pd_err *err) {
    if (!p || !kv || p->max_num_seqs <= 0 || p->max_num_batched_tokens <= 0 ||
        p->max_prefill_chunk < 0 || p->max_model_len < 0 || p->max_lookahead_slots < 0 ||
        p->max_lookahead_slots > 64 || p->backfill_max_wait_us < 0 ||
        (p->policy != PD_SCHED_FCFS && p->policy != PD_SCHED_SRPT)) {
        pd_err_set(err, PD_ERR_INVALID, "sched: bad params");
        return NULL;
    }
    pd_sched *s = pd_calloc(1, sizeof *s);
    if (!s) goto nomem;
    s->params = *p;
    s->kv = kv;
    int64_t pool = (int64_t)pd_kv_n_blocks(kv) * pd_kv_block_size(kv);
    s->max_len = (int32_t)PD_MIN(pool, (int64_t)INT32_MAX);
    if (p->max_model_len > 0) s->max_len = PD_MIN(s->max_len, p->max_model_len);
    size_t n = (size_t)p->max_num_seqs;
    s->running = pd_calloc(n, sizeof *s->running);
    s->free_slots = pd_calloc(n, sizeof *s->free_slots);
    s->scheduled = pd_calloc(n, sizeof *s->scheduled);
    s->plan_seqs = pd_calloc(n, sizeof *s->plan_seqs);
    s->preempted_ids = pd_calloc(n, sizeof *s->preempted_ids);
    s->plan_finished = pd_calloc(n, sizeof *s->plan_finished);
    s->zombies = pd_calloc(n, sizeof *s->zombies);
    s->plan_loads = pd_calloc(n, sizeof *s->plan_loads);
    s->loads = pd_calloc(n, sizeof *s->loads);
    s->plan_tier_loads = pd_calloc(n, sizeof *s->plan_tier_loads);
    s->tier_reqs = pd_calloc(n, sizeof *s->tier_reqs);
    s->events = pd_calloc(n * (size_t)(1 + p->max_lookahead_slots), sizeof *s->events);
    if (!s->running || !s->free_slots || !s->scheduled || !s->plan_seqs || !s->preempted_ids ||
        !s->plan_finished || !s->zombies || !s->events || !s->plan_loads || !s->loads ||
        !s->plan_tier_loads || !s->tier_reqs)
        goto nomem;
    if (pd_sched_reqmap_init(&s->reqs) != PD_OK) goto nomem;
    // Slot stack: pop gives 0 first.
    for (int32_t i = 0; i < p->max_num_seqs; i++) s->free_slots[i] = p->max_num_seqs - 1 - i;
    s->n_free_slots = p->max_num_seqs;
    return s;
nomem:
    pd_sched_free(s);
    pd_err_set(err, PD_ERR_NOMEM, "sched: out of memory");
    return NULL;
}

static void req_destroy(pd_sched *s, pd_sched_req *r) {
    pd_kv_free_request(s->kv, &r->kv);
    pd_kv_seq_fini(&r->kv);
    pd_free(r->tokens);
    pd_free(r->stop_ids);
    pd_free(r);
}

void pd_sched_free(pd_sched *s) {
    if (!s) return;
    // Every live request is in the map, whatever its state; zombies have left it.
    for (size_t i = 0; i < pd_sched_reqmap_cap(&s->reqs); i++)
        if (pd_sched_reqmap_at(&s->reqs, i)) req_destroy(s, pd_sched_reqmap_at(&s->reqs, i));
    for (int32_t i = 0; i < s->n_zombies; i++) req_destroy(s, s->zombies[i]);
    pd_sched_reqmap_fini(&s->reqs);
    pd_free(s->waiting);
    pd_free(s->order);
    pd_free(s->running);
    pd_free(s->free_slots);
    pd_free(s->scheduled);
    pd_free(s->plan_seqs);
    pd_free(s->preempted_ids);
    pd_free(s->plan_finished);
    pd_free(s->zombies);
    pd_free(s->events);
    pd_free(s->plan_loads);
    pd_free(s->loads);
    pd_free(s->plan_tier_loads);
    pd_free(s->tier_reqs);
    pd_free(s);
}

// ---- intake --------------------------------------------------------------------------------------

static pd_status validate(const pd_sched *s, const pd_sched_req_params *rp, pd_err *err) {
    if (!rp->prompt || rp->n_prompt < 1)
        return pd_err_set(err, PD_ERR_INVALID, "request %llu: empty prompt", (unsigned long long)rp->req_id);
    if (rp->max_tokens < 1 || rp->min_tokens < 0)
        return pd_err_set(err, PD_ERR_INVALID, "request %llu: max_tokens %d, min_tokens %d",
                          (unsigned long long)rp->req_id, rp->max_tokens, rp->min_tokens);
    if (rp->n_stop_ids < 0 || rp->n_eos_ids < 0 || (rp->n_stop_ids && !rp->stop_ids) ||
        (rp->n_eos_ids && !rp->eos_ids))
        return pd_err_set(err, PD_ERR_INVALID, "request %llu: bad stop ids", (unsigned long long)rp->req_id);
    if (s->params.max_model_len > 0 && rp->n_prompt > s->params.max_model_len)
        return pd_err_set(err, PD_ERR_INVALID, "request %llu: prompt of %d tokens exceeds max_model_len %d",
                          (unsigned long long)rp->req_id, rp->n_prompt, s->params.max_model_len);
    if (!s->params.enable_chunked_prefill && rp->n_prompt > s->params.max_num_batched_tokens)
        return pd_err_set(err, PD_ERR_INVALID,
                          "request %llu: prompt of %d tokens exceeds max_num_batched_tokens %d "
                          "(chunked prefill is off)",
                          (unsigned long long)rp->req_id, rp->n_prompt, s->params.max_num_batched_tokens);
    if (pd_sched_reqmap_find(&s->reqs, rp->req_id))
        return pd_err_set(err, PD_ERR_INVALID, "request %llu: duplicate id", (unsigned long long)rp->req_id);
    return PD_OK;
}

// Grows the waiting queue (and the SRPT scratch) to hold every live request plus one.
static pd_status reserve_waiting(pd_sched *s) {
    size_t need = (size_t)s->reqs.n + 1;
    pd_status st = PD_ARRAY_RESERVE(s->waiting, s->cap_waiting, need);
    return st == PD_OK ? PD_ARRAY_RESERVE(s->order, s->cap_order, need) : st;
}

pd_status pd_sched_add(pd_sched *s, const pd_sched_req_params *rp, int64_t now_us, pd_err *err) {
    pd_status st = validate(s, rp, err);
    if (st != PD_OK) return st;
    if (reserve_waiting(s) != PD_OK || pd_sched_reqmap_reserve(&s->reqs) != PD_OK)
        return pd_err_set(err, PD_ERR_NOMEM, "sched: out of memory");
    pd_sched_req *r = pd_calloc(1, sizeof *r);
    if (!r) return pd_err_set(err, PD_ERR_NOMEM, "sched: out of memory");
    int32_t n_stop = rp->n_stop_ids + (rp->ignore_eos ? 0 : rp->n_eos_ids);
    r->cap_tokens = (size_t)rp->n_prompt + (size_t)PD_MIN(rp->max_tokens, 64);
    r->tokens = pd_malloc(r->cap_tokens * sizeof *r->tokens);
    r->stop_ids = pd_malloc((size_t)(n_stop > 0 ? n_stop : 1) * sizeof *r->stop_ids);
    if (!r->tokens || !r->stop_ids) {
        pd_free(r->tokens);
        pd_free(r->stop_ids);
        pd_free(r);
        return pd_err_set(err, PD_ERR_NOMEM, "sched: out of memory");
    }
    memcpy(r->tokens, rp->prompt, (size_t)rp->n_prompt * sizeof *r->tokens);
    if (rp->n_stop_ids) memcpy(r->stop_ids, rp->stop_ids, (size_t)rp->n_stop_ids * sizeof(int32_t));
    if (!rp->ignore_eos && rp->n_eos_ids)
        memcpy(r->stop_ids + rp->n_stop_ids, rp->eos_ids, (size_t)rp->n_eos_ids * sizeof(int32_t));
    r->id = rp->req_id;
    r->state = PD_SCHED_WAITING;
    r->n_tokens = r->n_prompt = rp->n_prompt;
    r->max_tokens = rp->max_tokens;
    r->min_tokens = rp->min_tokens;
    r->n_stop = n_stop;
    r->priority = rp->priority;
    r->arrival_us = now_us;
    r->arrival_seq = s->next_arrival_seq++;
    r->n_cached_tokens = -1;
    r->slot = -1;
    r->is_remote_prefill = rp->is_remote_prefill;
    r->is_hold_blocks = rp->is_hold_blocks;
    r->n_tier_tokens = rp->is_remote_prefill ? 0 : PD_MAX(rp->n_tier_tokens, 0);
    pd_kv_seq_init(&r->kv, rp->cache_key);
    pd_sched_reqmap_insert(&s->reqs, r);
    pd_sched_waiting_insert(s, r);
    return PD_OK;
}

// ---- queues --------------------------------------------------------------------------------------

// First index in arr[0..n) whose request r must come before (binary search on importance).
static int32_t insert_pos(pd_sched_req *const *arr, int32_t n, const pd_sched_req *r) {
    int32_t lo = 0, hi = n;
    while (lo < hi) {
        int32_t mid = lo + (hi - lo) / 2;
        if (pd_sched_req_before(r, arr[mid])) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

static void array_insert(pd_sched_req **arr, int32_t *n, pd_sched_req *r) {
    int32_t i = insert_pos(arr, *n, r);
    memmove(arr + i + 1, arr + i, (size_t)(*n - i) * sizeof *arr);
    arr[i] = r;
    (*n)++;
}

static void array_remove(pd_sched_req **arr, int32_t *n, pd_sched_req *r) {
    int32_t i = 0;
    while (i < *n && arr[i] != r) i++;
    PD_ASSERT(i < *n);
    memmove(arr + i, arr + i + 1, (size_t)(*n - i - 1) * sizeof *arr);
    (*n)--;
}

void pd_sched_waiting_insert(pd_sched *s, pd_sched_req *r) {
    PD_ASSERT((size_t)s->n_waiting < s->cap_waiting);
    array_insert(s->waiting, &s->n_waiting, r);
}

void pd_sched_running_insert(pd_sched *s, pd_sched_req *r) {
    PD_ASSERT(s->n_running < s->params.max_num_seqs && s->n_free_slots > 0);
    r->slot = s->free_slots[--s->n_free_slots];
    r->state = PD_SCHED_RUNNING;
    array_insert(s->running, &s->n_running, r);
}

void pd_sched_running_remove(pd_sched *s, pd_sched_req *r) {
    array_remove(s->running, &s->n_running, r);
    s->free_slots[s->n_free_slots++] = r->slot;
    r->slot = -1;
}

// ---- leaving -------------------------------------------------------------------------------------

pd_sched_event pd_sched_req_event(const pd_sched_req *r) {
    pd_sched_event ev = {
        .req_id = r->id,
        .token = -1,
        .finish = PD_FINISH_NONE,
        .stop_token = -1,
        .n_prompt_tokens = r->n_prompt,
        .n_output_tokens = r->n_tokens - r->n_prompt,
        .n_cached_tokens = PD_MAX(r->n_cached_tokens, 0),
        .n_preemptions = r->n_preemptions,
        .seq_index = -1,
    };
    return ev;
}

void pd_sched_req_finish(pd_sched *s, pd_sched_req *r) {
    if (r->state == PD_SCHED_RUNNING) pd_sched_running_remove(s, r);
    else array_remove(s->waiting, &s->n_waiting, r);
    pd_sched_reqmap_remove(&s->reqs, r->id);
    pd_kv_free_request(s->kv, &r->kv);
    if (s->has_plan && r->n_scheduled > 0) {
        // The outstanding plan points at r's tokens and block table: free it at the next update.
        r->state = PD_SCHED_FINISHED;
        s->zombies[s->n_zombies++] = r;
        return;
    }
    req_destroy(s, r);
}

void pd_sched_req_hold(pd_sched *s, pd_sched_req *r, pd_sched_event *ev) {
    pd_sched_running_remove(s, r);
    r->state = PD_SCHED_HELD;
    s->n_held++;
    ev->block_ids = r->kv.block_ids;
    ev->n_blocks = r->kv.n_blocks;
}

void pd_sched_req_drop(pd_sched *s, pd_sched_req *r) {
    if (r->state == PD_SCHED_HELD) s->n_held--;
    else {
        PD_ASSERT(pd_sched_state_is_loading(r->state) && r->is_aborted);
        s->stats.n_tier_loading -= r->state == PD_SCHED_LOADING_TIER;
        s->n_loading_aborted--;
        s->n_loading--;
    }
    pd_sched_reqmap_remove(&s->reqs, r->id);
    req_destroy(s, r);
}

pd_status pd_sched_release(pd_sched *s, uint64_t req_id) {
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (!r || r->state != PD_SCHED_HELD) return PD_ERR_NOTFOUND;
    pd_sched_req_drop(s, r);
    return PD_OK;
}

void pd_sched_req_preempt(pd_sched *s, pd_sched_req *r) {
    PD_ASSERT(r->state == PD_SCHED_RUNNING && r->n_scheduled == 0);
    pd_sched_running_remove(s, r);
    pd_kv_free_request(s->kv, &r->kv);
    r->n_computed = 0;
    r->state = PD_SCHED_PREEMPTED;
    r->n_preemptions++;
    s->stats.n_preemptions++;
    pd_sched_waiting_insert(s, r);
}

void pd_sched_plan_release(pd_sched *s) {
    for (int32_t i = 0; i < s->n_running; i++) s->running[i]->n_scheduled = s->running[i]->n_lookahead = 0;
    for (int32_t i = 0; i < s->n_zombies; i++) req_destroy(s, s->zombies[i]);
    s->n_zombies = 0;
    s->has_plan = false;
}

pd_status pd_sched_set_lookahead(pd_sched *s, uint64_t req_id, int32_t n) {
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (!r) return PD_ERR_NOTFOUND;
    r->n_lookahead_want = PD_MAX(0, PD_MIN(n, s->params.max_lookahead_slots));
    return PD_OK;
}

pd_status pd_sched_abort(pd_sched *s, uint64_t req_id) {
    pd_sched_req *r = pd_sched_reqmap_find(&s->reqs, req_id);
    if (!r) return PD_ERR_NOTFOUND;
    if (r->state == PD_SCHED_HELD) {
        pd_sched_req_drop(s, r);  // the transfer is off: same as a release
    } else if (pd_sched_state_is_loading(r->state)) {
        if (r->is_aborted) return PD_ERR_NOTFOUND;
        // NOTE: the blocks stay until pd_sched_kv_loaded: a transfer may still be writing them.
        pd_sched_running_remove(s, r);
        r->is_aborted = true;
        s->n_loading_aborted++;
    } else {
        pd_sched_req_finish(s, r);
    }
    s->stats.n_aborted++;
    return PD_OK;
}

// ---- inspection ----------------------------------------------------------------------------------

void pd_sched_stats_get(const pd_sched *s, pd_sched_stats *out) {
    *out = s->stats;
    out->n_waiting = s->n_waiting;
    out->n_running = s->n_running;
    out->n_loading = s->n_loading;
    out->n_held = s->n_held;
}

bool pd_sched_has_work(const pd_sched *s) {
    return s->n_waiting + s->n_running + s->n_loading_aborted > 0;
}
