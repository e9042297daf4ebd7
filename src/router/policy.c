// policy.c — the routing cost and the TTFT / TPOT predictions behind admission control.
//
// The cost is in "prefill-token equivalents" so that its terms add up meaningfully: a worker that
// must compute 500 more prompt tokens than another is worse by 500 × w_prefill, and a running or
// waiting request costs a fixed number of such tokens (it shares every step with us). The
// defaults were chosen so that a cached prefix of a few blocks beats a small load difference but
// a queue of waiting requests outweighs any prefix hit (cache affinity must not pile everything
// onto one worker). The predictions are deliberately simple, documented formulas over the load
// reports; they are estimates for admission, not promises.
#include "router/core_impl.h"

pd_router_cost_params pd_router_cost_params_default(void) {
    pd_router_cost_params p;
    p.w_prefill = 1.0;
    p.w_run = 16.0;
    p.w_wait = 64.0;
    p.w_inflight = 16.0;
    p.kv_low_frac = 0.1;
    p.kv_low_penalty = 4096.0;
    p.use_prefix = true;
    return p;
}

// A tier-hit token in prefill-token equivalents: its measured load time over its prefill time.
static double tier_ratio(const pd_router_cand *c) {
    if (c->tier_us_per_token <= 0 || c->prefill_tokens_per_s <= 0) return 1.0;
    double r = c->tier_us_per_token * c->prefill_tokens_per_s / 1e6;
    return r < 1.0 ? r : 1.0;
}

double pd_router_cost(const pd_router_cost_params *p, const pd_router_cand *c) {
    int32_t hit = p->use_prefix ? PD_MIN(c->n_hit_tokens, c->n_prompt_tokens) : 0;
    int32_t tier = p->use_prefix ? PD_MAX(0, PD_MIN(c->n_tier_hit_tokens, c->n_prompt_tokens - hit)) : 0;
    double uncached = (double)(c->n_prompt_tokens - hit - tier) + (double)tier * tier_ratio(c);
    if (c->has_prefill_pred && p->use_prefix && c->prefill_tokens_per_s > 0)
        uncached = c->prefill_pred_ms / 1000.0 * c->prefill_tokens_per_s;  // link-aware: in token equivalents
    double cost = p->w_prefill * (uncached + (double)c->n_queued_prefill_tokens) +
                  p->w_run * c->n_running + p->w_wait * c->n_waiting +
                  p->w_inflight * c->n_inflight;
    if (c->kv_free_frac < p->kv_low_frac) cost += p->kv_low_penalty;
    return cost;
}

int pd_router_pick(const pd_router_cost_params *p, const pd_router_cand *cands, int n,
                   unsigned tie_start) {
    int best = -1;
    double best_cost = 0;
    for (int k = 0; k < n; k++) {
        int i = (int)((tie_start + (unsigned)k) % (unsigned)n);
        double c = pd_router_cost(p, &cands[i]);
        if (best < 0 || c < best_cost) {
            best = i;
            best_cost = c;
        }
    }
    return best;
}

double pd_router_predict_ttft_ms(const pd_router_cand *c) {
    double rate = c->prefill_tokens_per_s > 0 ? c->prefill_tokens_per_s : 1.0;
    double step = c->decode_step_ms > 0 ? c->decode_step_ms : 0;
    int32_t hit = PD_MIN(c->n_hit_tokens, c->n_prompt_tokens);
    int32_t tier = PD_MAX(0, PD_MIN(c->n_tier_hit_tokens, c->n_prompt_tokens - hit));
    double own = (double)(c->n_prompt_tokens - hit - tier) + (double)tier * tier_ratio(c);
    int run = c->n_running > 0 ? c->n_running : 1;
    double step_joined = step * (double)(c->n_running + 1) / (double)run;
    double own_ms = c->has_prefill_pred ? c->prefill_pred_ms : own / rate * 1000.0;
    double model = (double)c->n_queued_prefill_tokens / rate * 1000.0 + own_ms + step_joined * (1.0 + c->n_waiting);
    // NOTE: the router's own observation wins when it has one: the worker's rates are averages
    // over the steps it last ran, so they go stale on an idle worker and carry no batch size.
    if (c->ttft_ms_per_inflight > 0) return c->ttft_ms_per_inflight * (double)(c->n_inflight + 1);
    return model;
}

int64_t pd_router_worker_capacity(int32_t max_seqs, int32_t max_waiting, int override) {
    if (override > 0) return override;
    if (max_seqs <= 0) return 0;
    return (int64_t)max_seqs + (max_waiting > 0 ? max_waiting : 0);
}

bool pd_router_has_room(const pd_router_cand *c) {
    if (c->n_kv_blocks_total > 0 && c->n_blocks_needed > c->n_kv_blocks_total) return false;
    if (c->n_capacity <= 0) return true;
    int64_t occupied = (int64_t)c->n_inflight + (c->n_foreign > 0 ? c->n_foreign : 0);
    return occupied < c->n_capacity;
}

double pd_router_predict_tpot_ms(const pd_router_cand *c) {
    double step = c->decode_step_ms > 0 ? c->decode_step_ms : 0;
    int run = c->n_running > 0 ? c->n_running : 1;
    return step * (double)(c->n_running + 1) / (double)run;
}
