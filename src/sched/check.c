// check.c — pd_sched_check: every scheduler invariant, for tests and debug builds.
//
//   * the queues are sorted by importance; states match the queue a request is in;
//   * running requests own distinct slots, free slots + running = max_num_seqs;
//   * a running request's table covers its computed tokens (and its lookahead slots: decodes only,
//     within max_len and max_tokens) and it has a token left to compute;
//     a waiting one holds no blocks and has nothing computed;
//   * the id map holds exactly the queued requests;
//   * LOADING_KV, LOADING_TIER (whole blocks [n_computed, tier_end), tier_end < n_tokens) and HELD requests are counted, keep their blocks, and only loading ones a seat;
//   * each block's ref count equals the number of block tables holding it (the scheduler is the
//     pool's only user), and pd_kv_check passes.
#include "sched/sched_impl.h"

#include <string.h>

#define FAIL(...) return pd_err_set(err, PD_ERR_INVALID, "sched_check: " __VA_ARGS__)

static pd_status check_running(const pd_sched *s, pd_err *err) {
    if (s->n_running > s->params.max_num_seqs) FAIL("%d running > max_num_seqs", s->n_running);
    if (s->n_running + s->n_free_slots != s->params.max_num_seqs)
        FAIL("%d running + %d free slots != %d", s->n_running, s->n_free_slots, s->params.max_num_seqs);
    uint8_t seen[4096] = {0};  // slots seen, for max_num_seqs <= 4096 (else unchecked)
    bool track = s->params.max_num_seqs <= 4096;
    for (int32_t i = 0; i < s->n_free_slots; i++) {
        int32_t sl = s->free_slots[i];
        if (sl < 0 || sl >= s->params.max_num_seqs) FAIL("free slot %d out of range", sl);
        if (track && seen[sl]++) FAIL("slot %d free twice", sl);
    }
    for (int32_t i = 0; i < s->n_running; i++) {
        const pd_sched_req *r = s->running[i];
        bool loading = pd_sched_state_is_loading(r->state);
        if ((r->state != PD_SCHED_RUNNING && !loading) || r->is_aborted)
            FAIL("request %llu in running has state %d", (unsigned long long)r->id, r->state);
        int32_t load_end = r->state == PD_SCHED_LOADING_TIER ? r->tier_end : r->n_tokens;
        if (r->state == PD_SCHED_LOADING_TIER &&
            (r->tier_end <= r->n_computed || r->tier_end >= r->n_tokens || r->tier_end % pd_kv_block_size(s->kv) ||
             r->n_computed % pd_kv_block_size(s->kv)))
            FAIL("tier-loading request %llu: positions %d .. %d of %d", (unsigned long long)r->id, r->n_computed,
                 r->tier_end, r->n_tokens);
        if (loading && (r->n_scheduled || r->kv.n_blocks < pd_kv_n_blocks_for(s->kv, load_end)))
            FAIL("loading request %llu: scheduled %d, %d blocks", (unsigned long long)r->id,
                 r->n_scheduled, r->kv.n_blocks);
        if (i > 0 && !pd_sched_req_before(s->running[i - 1], r)) FAIL("running queue out of order at %d", i);
        if (r->slot < 0 || r->slot >= s->params.max_num_seqs) FAIL("request %llu: slot %d", (unsigned long long)r->id, r->slot);
        if (track && seen[r->slot]++) FAIL("slot %d used twice", r->slot);
        if (r->n_computed < 0 || r->n_computed >= r->n_tokens ||
            r->n_computed + r->n_scheduled > r->n_tokens)
            FAIL("request %llu: %d + %d of %d tokens computed", (unsigned long long)r->id,
                 r->n_computed, r->n_scheduled, r->n_tokens);
        if (r->kv.n_blocks < pd_kv_n_blocks_for(s->kv, r->n_computed + r->n_scheduled + r->n_lookahead))
            FAIL("request %llu: %d blocks for %d tokens + %d lookahead", (unsigned long long)r->id, r->kv.n_blocks,
                 r->n_computed + r->n_scheduled, r->n_lookahead);
        if (r->n_lookahead < 0 || r->n_lookahead > r->n_lookahead_want ||
            (r->n_lookahead > 0 && r->n_computed + r->n_scheduled != r->n_tokens))
            FAIL("request %llu: %d lookahead slots (asked %d) at %d + %d of %d tokens", (unsigned long long)r->id,
                 r->n_lookahead, r->n_lookahead_want, r->n_computed, r->n_scheduled, r->n_tokens);
        if (r->n_lookahead > 0 && (r->n_tokens + r->n_lookahead > s->max_len ||
                                   r->n_tokens - r->n_prompt + r->n_lookahead >= r->max_tokens))
            FAIL("request %llu: %d lookahead slots overrun max_len / max_tokens", (unsigned long long)r->id, r->n_lookahead);
        if (r->n_tokens > s->max_len) FAIL("request %llu: %d tokens > max_len %d", (unsigned long long)r->id, r->n_tokens, s->max_len);
    }
    return PD_OK;
}

static pd_status check_waiting(const pd_sched *s, pd_err *err) {
    for (int32_t i = 0; i < s->n_waiting; i++) {
        const pd_sched_req *r = s->waiting[i];
        if (r->state != PD_SCHED_WAITING && r->state != PD_SCHED_PREEMPTED)
            FAIL("request %llu in waiting has state %d", (unsigned long long)r->id, r->state);
        if (i > 0 && !pd_sched_req_before(s->waiting[i - 1], r)) FAIL("waiting queue out of order at %d", i);
        if (r->kv.n_blocks != 0 || r->n_computed != 0 || r->slot != -1 || r->n_scheduled != 0)
            FAIL("waiting request %llu holds %d blocks, %d computed, slot %d", (unsigned long long)r->id,
                 r->kv.n_blocks, r->n_computed, r->slot);
        if ((r->state == PD_SCHED_PREEMPTED) != (r->n_preemptions > 0))
            FAIL("request %llu: state %d after %d preemptions", (unsigned long long)r->id, r->state, r->n_preemptions);
    }
    if (s->reqs.n != s->n_waiting + s->n_running + s->n_loading_aborted + s->n_held)
        FAIL("map holds %d requests, queues %d + %d + detached %d + %d", s->reqs.n, s->n_waiting,
             s->n_running, s->n_loading_aborted, s->n_held);
    int32_t n_held = 0, n_aborted = 0, n_loading = 0, n_tier = 0;
    for (size_t i = 0; i < pd_sched_reqmap_cap(&s->reqs); i++) {
        const pd_sched_req *r = pd_sched_reqmap_at(&s->reqs, i);
        if (!r) continue;
        if (pd_sched_reqmap_find(&s->reqs, r->id) != r) FAIL("map entry %llu unreachable", (unsigned long long)r->id);
        if (r->state == PD_SCHED_FINISHED) FAIL("finished request %llu in the map", (unsigned long long)r->id);
        n_held += r->state == PD_SCHED_HELD;
        n_loading += pd_sched_state_is_loading(r->state);
        n_tier += r->state == PD_SCHED_LOADING_TIER;
        n_aborted += pd_sched_state_is_loading(r->state) && r->is_aborted;
        if ((r->state == PD_SCHED_HELD || r->is_aborted) && r->slot != -1)
            FAIL("detached request %llu keeps slot %d", (unsigned long long)r->id, r->slot);
    }
    if (n_held != s->n_held || n_aborted != s->n_loading_aborted || n_loading != s->n_loading)
        FAIL("held %d / %d, loading %d / %d, aborted while loading %d / %d", n_held, s->n_held,
             n_loading, s->n_loading, n_aborted, s->n_loading_aborted);
    if (n_tier != s->stats.n_tier_loading) FAIL("loading from a tier %d / %d", n_tier, s->stats.n_tier_loading);
    return PD_OK;
}

static pd_status check_refs(const pd_sched *s, pd_err *err) {
    int32_t n = pd_kv_n_blocks(s->kv);
    int32_t *want = pd_calloc((size_t)n, sizeof *want);
    if (!want) FAIL("out of memory");
    pd_status st = PD_OK;
    for (size_t i = 0; i < pd_sched_reqmap_cap(&s->reqs); i++) {  // every live request, in any state
        if (!pd_sched_reqmap_at(&s->reqs, i)) continue;
        const pd_kv_seq *q = &pd_sched_reqmap_at(&s->reqs, i)->kv;
        for (int32_t j = 0; j < q->n_blocks; j++) want[q->block_ids[j]]++;
    }
    for (int32_t b = 0; b < n && st == PD_OK; b++)
        if (pd_kv_block_ref(s->kv, b) != want[b])
            st = pd_err_set(err, PD_ERR_INVALID, "sched_check: block %d has ref %d, tables hold it %d times",
                            b, pd_kv_block_ref(s->kv, b), want[b]);
    pd_free(want);
    return st;
}

pd_status pd_sched_check(const pd_sched *s, pd_err *err) {
    pd_status st = check_running(s, err);
    if (st == PD_OK) st = check_waiting(s, err);
    if (st == PD_OK) st = check_refs(s, err);
    if (st == PD_OK) st = pd_kv_check(s->kv, err);
    return st;
}
