// test_sched.c — the continuous-batching scheduler, driven by a fake deterministic "model".
//
// The fake engine keeps a shadow of the device KV cache: each step writes the plan's tokens into
// the slots their block tables name, and a sampled token is a hash of the KV *read back through the
// block table* for positions 0..end. So a wrong block table, position, prefix hit or recompute
// changes the output, and every request's output is compared with a reference computed directly
// from its tokens (next = f(all previous tokens)). pd_sched_check runs after every step.
#include "test.h"

#include "sched/sched.h"

// ---- the fake engine -----------------------------------------------------------------------------

#define FE_MAX_REQS 512
#define FE_MAX_OUT 256
#define FE_MAX_BLOCKS 1024
#define FE_BS_MAX 16

typedef struct fe_req {
    bool used, finished, aborted, held;
    int32_t prompt[256];
    int32_t n_prompt;
    int32_t n_out;
    int32_t out[FE_MAX_OUT];
    pd_finish_reason finish;
    int32_t stop_token, n_cached, n_preemptions;
    int64_t finish_step;
} fe_req;

typedef struct fe {
    pd_kv_mgr *kv;
    pd_sched *s;
    pd_sched_params sp;
    int32_t bs;
    int32_t shadow[FE_MAX_BLOCKS][FE_BS_MAX];
    fe_req r[FE_MAX_REQS];
    int64_t now_us, step;
    int64_t n_plan_tokens_max, n_plan_seqs_max;
    int32_t stop_string_after;  // a request whose n_out reaches this reports a stop string (0 = off)
    pd_step_plan last_plan;
    int32_t n_finished_in_plan;
    pd_rng *mid_abort_rng;  // when set, sometimes aborts a planned request before update
    int32_t n_mid_aborts;
    // Remote prefill: KV loads in flight (the "transfer" writes the prompt into the shadow KV).
    pd_step_kv_load loads[FE_MAX_REQS];
    int32_t n_loads;
    pd_rng *load_rng;       // when set, loads finish at random times and fail 20% of the time
    bool is_load_failing;   // without load_rng: every load fails (fallback to recompute)
    int32_t n_loads_done, n_loads_failed, n_released;
    // Tier loads in flight: the "tier" writes the prompt's KV of whole blocks, all of them or a
    // leading part (tier_rng: random timing and length; else all at once, tier_lose_all: none).
    pd_step_kv_load tloads[FE_MAX_REQS];
    int32_t n_tloads;
    pd_rng *tier_rng;
    bool is_tier_losing;
    bool is_tier_paused;    // tier loads stay in flight
    bool is_tier_now;       // tier loads end inside their step (pd_sched_tier_loaded_now: hot DRAM)
    pd_rng *tier_now_rng;   // when set, half of them do
    int32_t n_tier_now, n_tier_now_joined;
    int32_t n_tier_done, n_tier_partial, n_tier_tokens_loaded;
    uint64_t held[FE_MAX_REQS];  // finished is_hold_blocks requests, released next step
    int32_t n_held;
    // Speculation: when set, every lookahead slot gets a draft token (right with probability
    // spec_p_right, else a wrong one), written into the shadow KV like the forward writes it; the
    // "target" verifies drafts against f over the KV read back, as the engine does.
    pd_rng *spec_rng;
    double spec_p_right;
    int64_t n_spec_slots, n_spec_drafted, n_spec_accepted, n_events_multi;
} fe;

static uint32_t f_next(const int32_t *toks, int32_t n) {
    uint32_t h = 2166136261u;
    for (int32_t i = 0; i < n; i++) h = (h ^ (uint32_t)toks[i]) * 16777619u;
    return 1 + h % 97;  // tokens 1..97
}

static bool fe_caching = true;  // prefix caching for the next fe_new

static fe *fe_new(int32_t n_blocks, int32_t bs, const pd_sched_params *sp) {
    static fe E;  // one at a time: tests are sequential
    memset(&E, 0, sizeof E);
    pd_kv_params kp = pd_kv_params_default();
    kp.n_blocks = n_blocks;
    kp.block_size = bs;
    kp.enable_prefix_caching = fe_caching;
    E.kv = pd_kv_mgr_new(&kp, NULL);
    E.sp = *sp;
    E.s = pd_sched_new(sp, E.kv, NULL);
    E.bs = bs;
    PD_CHECK(E.kv && E.s);
    memset(E.shadow, 0xff, sizeof E.shadow);
    return &E;
}

static void fe_free(fe *e) {
    pd_sched_free(e->s);
    pd_kv_mgr_free(e->kv);
}

static pd_status fe_add_rp(fe *e, const pd_sched_req_params *rp) {
    pd_err err = {0};
    pd_status st = pd_sched_add(e->s, rp, e->now_us, &err);
    if (st == PD_OK) {
        fe_req *q = &e->r[rp->req_id];
        q->used = true;
        q->n_prompt = PD_MIN(rp->n_prompt, 256);
        memcpy(q->prompt, rp->prompt, (size_t)q->n_prompt * sizeof(int32_t));
    }
    return st;
}

static pd_status fe_add_full(fe *e, uint64_t id, const int32_t *prompt, int32_t n, int32_t max_tokens,
                             int32_t priority, const int32_t *stops, int32_t n_stops) {
    pd_sched_req_params rp = {.req_id = id, .prompt = prompt, .n_prompt = n, .max_tokens = max_tokens,
                              .priority = priority, .stop_ids = stops, .n_stop_ids = n_stops};
    return fe_add_rp(e, &rp);
}

static pd_status fe_add(fe *e, uint64_t id, const int32_t *prompt, int32_t n, int32_t max_tokens) {
    return fe_add_full(e, id, prompt, n, max_tokens, 0, NULL, 0);
}

static void fe_event(fe *e, const pd_sched_event *ev) {
    PD_REQUIRE(ev->req_id < FE_MAX_REQS);
    fe_req *q = &e->r[ev->req_id];
    PD_CHECK(q->used && !q->finished);
    if (ev->token >= 0) {
        PD_REQUIRE(q->n_out < FE_MAX_OUT);
        q->out[q->n_out++] = ev->token;
        PD_CHECK_EQ(ev->n_output_tokens, q->n_out);
    }
    if (ev->finish != PD_FINISH_NONE && ev->n_blocks > 0) {  // held for a KV transfer
        PD_CHECK(ev->n_blocks * e->bs >= q->n_prompt);
        for (int32_t i = 0; i < ev->n_blocks; i++) PD_CHECK(pd_kv_block_ref(e->kv, ev->block_ids[i]) >= 1);
        q->held = true;
        e->held[e->n_held++] = ev->req_id;
    }
    if (ev->finish != PD_FINISH_NONE) {
        q->finished = true;
        q->finish = ev->finish;
        q->stop_token = ev->stop_token;
        q->finish_step = e->step;
    }
    q->n_cached = ev->n_cached_tokens;
    q->n_preemptions = ev->n_preemptions;
}

// Finishes KV loads: the "transfer" writes the prompt's KV, the "prefill worker" sampled
// f(prompt) as the first token.
static void fe_service_loads(fe *e) {
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_loads; i++) {
        pd_step_kv_load *l = &e->loads[i];
        if (e->load_rng && pd_rng_uniform(e->load_rng) < 0.5) {
            e->loads[n++] = *l;  // still in flight
            continue;
        }
        bool ok = e->load_rng ? pd_rng_uniform(e->load_rng) < 0.8 : !e->is_load_failing;
        fe_req *q = &e->r[l->req_id];
        PD_CHECK(l->n_blocks * e->bs >= l->n_tokens);
        PD_CHECK_EQ(l->n_tokens, q->n_prompt);
        for (int32_t p = l->n_tokens_local; ok && p < l->n_tokens; p++) {
            int32_t b = l->block_ids[p / e->bs];
            PD_CHECK_EQ(pd_kv_block_ref(e->kv, b), 1);
            e->shadow[b][p % e->bs] = q->prompt[p];
        }
        pd_sched_event ev;
        pd_status st = pd_sched_kv_loaded(e->s, l->req_id, ok, (int32_t)f_next(q->prompt, q->n_prompt), &ev);
        if (q->aborted) {
            PD_CHECK_EQ(st, PD_ERR_CLOSED);
            continue;
        }
        PD_CHECK_EQ(st, PD_OK);
        e->n_loads_done++;
        if (ok) fe_event(e, &ev);
        else {
            PD_CHECK_EQ(ev.token, -1);
            e->n_loads_failed++;
        }
    }
    e->n_loads = n;
}

// The "tier" writes the KV of the first got blocks of a tier load.
static void fe_tier_write(fe *e, const pd_step_kv_load *l, int32_t got) {
    fe_req *q = &e->r[l->req_id];
    for (int32_t p = l->n_tokens_local; p < l->n_tokens_local + got * e->bs && !q->aborted; p++) {
        int32_t b = l->block_ids[p / e->bs];
        PD_CHECK_EQ(pd_kv_block_ref(e->kv, b), 1);
        PD_REQUIRE(p < q->n_prompt);
        e->shadow[b][p % e->bs] = q->prompt[p];
    }
}

// Tier loads that end inside their step (hot DRAM): written now, the request joins the plan.
static void fe_tier_loads_now(fe *e, pd_step_plan *plan) {
    for (int32_t i = 0; i < plan->n_tier_loads; i++) {
        pd_step_kv_load l = plan->tier_loads[i];
        if (!(e->tier_now_rng ? pd_rng_uniform(e->tier_now_rng) < 0.5 : e->is_tier_now)) {
            e->tloads[e->n_tloads++] = l;
            continue;
        }
        int32_t nb = (l.n_tokens - l.n_tokens_local) / e->bs;
        pd_rng *g = e->tier_now_rng ? e->tier_now_rng : e->tier_rng;
        int32_t got = g ? (int32_t)(pd_rng_next(g) % (uint64_t)(nb + 1)) : e->is_tier_losing ? 0 : nb;
        fe_tier_write(e, &l, got);
        int32_t n0 = plan->n_seqs, t0 = plan->n_tokens;
        PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, plan, l.req_id, got * e->bs + 1), PD_ERR_INVALID);
        PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, plan, l.req_id, got * e->bs), PD_OK);
        PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, plan, l.req_id, 0), PD_ERR_NOTFOUND);
        PD_CHECK(plan->n_seqs == n0 || plan->n_seqs == n0 + 1);
        if (plan->n_seqs == n0 + 1) {
            const pd_step_seq *q = &plan->seqs[n0];
            PD_CHECK_EQ(q->req_id, l.req_id);
            PD_CHECK_EQ(q->pos_start, l.n_tokens_local + got * e->bs);
            PD_CHECK_EQ(plan->n_tokens, t0 + q->n_tokens);
            e->n_tier_now_joined++;
        }
        e->n_tier_now++;
        e->n_tier_done++;
        e->n_tier_partial += got < nb;
        e->n_tier_tokens_loaded += got * e->bs;
    }
}

// Finishes tier loads: the "tier" writes the KV of a leading run of the asked blocks.
static void fe_service_tier_loads(fe *e) {
    int32_t n = 0;
    for (int32_t i = 0; i < e->n_tloads; i++) {
        pd_step_kv_load *l = &e->tloads[i];
        if (e->is_tier_paused || (e->tier_rng && pd_rng_uniform(e->tier_rng) < 0.5)) {
            e->tloads[n++] = *l;  // still loading
            continue;
        }
        fe_req *q = &e->r[l->req_id];
        int32_t nb = (l->n_tokens - l->n_tokens_local) / e->bs;
        PD_CHECK(nb >= 1 && l->n_tokens_local % e->bs == 0 && l->n_tokens % e->bs == 0);
        PD_CHECK(l->n_tokens < q->n_prompt + FE_MAX_OUT);
        PD_CHECK(l->n_blocks * e->bs >= l->n_tokens);
        int32_t got = e->tier_rng ? (int32_t)(pd_rng_next(e->tier_rng) % (uint64_t)(nb + 1)) : e->is_tier_losing ? 0 : nb;
        fe_tier_write(e, l, got);
        PD_CHECK_EQ(pd_sched_tier_loaded(e->s, l->req_id, got * e->bs + 1), PD_ERR_INVALID);  // not block-aligned
        PD_CHECK_EQ(pd_sched_tier_loaded(e->s, l->req_id, (nb + 1) * e->bs), PD_ERR_INVALID);  // beyond the load
        pd_status st = pd_sched_tier_loaded(e->s, l->req_id, got * e->bs);
        if (q->aborted) {
            PD_CHECK_EQ(st, PD_ERR_CLOSED);
            continue;
        }
        PD_CHECK_EQ(st, PD_OK);
        PD_CHECK_EQ(pd_sched_tier_loaded(e->s, l->req_id, 0), PD_ERR_NOTFOUND);
        e->n_tier_done++;
        e->n_tier_partial += got < nb;
        e->n_tier_tokens_loaded += got * e->bs;
    }
    e->n_tloads = n;
}

// One step: schedule, check the plan, run the fake forward, update. Returns the plan's n_seqs.
static int32_t fe_step(fe *e) {
    pd_step_plan plan;
    pd_sched_schedule(e->s, e->now_us, &plan);
    fe_tier_loads_now(e, &plan);  // before the forward, as the engine does
    e->last_plan = plan;
    PD_CHECK(plan.n_tokens <= e->sp.max_num_batched_tokens);
    PD_CHECK(plan.n_seqs <= e->sp.max_num_seqs);
    e->n_plan_tokens_max = PD_MAX(e->n_plan_tokens_max, plan.n_tokens);
    e->n_plan_seqs_max = PD_MAX(e->n_plan_seqs_max, plan.n_seqs);
    for (int32_t i = 0; i < plan.n_finished; i++) {
        e->n_finished_in_plan++;
        fe_event(e, &plan.finished[i]);
    }
    if (e->mid_abort_rng && plan.n_seqs > 0 && pd_rng_uniform(e->mid_abort_rng) < 0.03) {
        uint64_t id = plan.seqs[pd_rng_next(e->mid_abort_rng) % (uint64_t)plan.n_seqs].req_id;
        PD_CHECK_EQ(pd_sched_abort(e->s, id), PD_OK);  // client gone while its step runs
        e->r[id].aborted = true;
        e->n_mid_aborts++;
    }
    pd_step_output outs[FE_MAX_REQS];
    int32_t sum = 0;
    int32_t ctx[FE_MAX_BLOCKS * FE_BS_MAX];
    for (int32_t i = 0; i < plan.n_seqs; i++) {
        const pd_step_seq *q = &plan.seqs[i];
        PD_CHECK(q->n_tokens >= 1);
        PD_CHECK(q->n_blocks * e->bs >= q->pos_start + q->n_tokens);
        for (int32_t j = 0; j < i; j++) PD_CHECK(plan.seqs[j].slot != q->slot);
        sum += q->n_tokens + q->n_lookahead;
        outs[i] = (pd_step_output){.token = -1};
        if (e->r[q->req_id].aborted) continue;  // its blocks are already back in the pool
        for (int32_t k = 0; k < q->n_tokens; k++) {
            int32_t p = q->pos_start + k, b = q->block_ids[p / e->bs];
            PD_CHECK_EQ(pd_kv_block_ref(e->kv, b), 1);  // never write a shared block
            e->shadow[b][p % e->bs] = q->tokens[k];
        }
        PD_CHECK(q->n_lookahead == 0 || (q->needs_logits && q->n_tokens == 1));
        PD_CHECK(q->n_blocks * e->bs >= q->pos_start + q->n_tokens + q->n_lookahead);
        if (!q->needs_logits) continue;
        int32_t end = q->pos_start + q->n_tokens;
        for (int32_t p = 0; p < end; p++) ctx[p] = e->shadow[q->block_ids[p / e->bs]][p % e->bs];
        outs[i].token = (int32_t)f_next(ctx, end);
        e->n_spec_slots += q->n_lookahead;
        if (e->spec_rng && q->n_lookahead > 0) {
            // Drafts: d_k right (= f of the context with the drafts before it) or wrong, written
            // into their lookahead slots; then verified left to right against the shadow KV.
            int32_t n_d = (int32_t)(pd_rng_next(e->spec_rng) % (uint64_t)(q->n_lookahead + 1));
            static int32_t drafts[FE_MAX_REQS][64];
            int32_t *d = drafts[i];
            for (int32_t k = 0; k < n_d; k++) {
                int32_t want = (int32_t)f_next(ctx, end + k);
                d[k] = pd_rng_uniform(e->spec_rng) < e->spec_p_right ? want : 1 + (want % 97);
                ctx[end + k] = d[k];
                int32_t p = end + k, b = q->block_ids[p / e->bs];
                PD_CHECK_EQ(pd_kv_block_ref(e->kv, b), 1);  // lookahead slots are private too
                e->shadow[b][p % e->bs] = d[k];
            }
            int32_t acc = 0;
            for (int32_t p = 0; p < end + n_d; p++) ctx[p] = e->shadow[q->block_ids[p / e->bs]][p % e->bs];
            while (acc < n_d && (int32_t)f_next(ctx, end + acc) == d[acc]) acc++;
            outs[i].token = (int32_t)f_next(ctx, end + acc);
            outs[i].n_accepted = acc;
            outs[i].accepted = d;
            e->n_spec_drafted += n_d;
            e->n_spec_accepted += acc;
        }
        fe_req *r = &e->r[q->req_id];
        outs[i].is_stop_string_hit = e->stop_string_after > 0 && r->n_out + 1 >= e->stop_string_after;
    }
    PD_CHECK_EQ(sum, plan.n_tokens);
    const pd_sched_event *ev;
    int32_t n_ev;
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, outs, e->now_us, &ev, &n_ev), PD_OK);
    for (int32_t i = 0; i < n_ev; i++) {
        PD_CHECK(ev[i].seq_index >= 0 && ev[i].seq_index < plan.n_seqs);
        PD_CHECK(ev[i].out_index >= 0 && ev[i].out_index <= outs[ev[i].seq_index].n_accepted);
        e->n_events_multi += ev[i].out_index > 0;
        fe_event(e, &ev[i]);
    }
    for (int32_t i = 0; i < e->n_held; i++) {  // the KV was "sent"
        PD_CHECK_EQ(pd_sched_release(e->s, e->held[i]), PD_OK);
        e->n_released++;
    }
    e->n_held = 0;
    for (int32_t i = 0; i < plan.n_kv_loads; i++) e->loads[e->n_loads++] = plan.kv_loads[i];
    fe_service_loads(e);
    fe_service_tier_loads(e);  // the ones fe_tier_loads_now queued
    pd_err err = {0};
    pd_status st = pd_sched_check(e->s, &err);
    PD_CHECK_MSG(st == PD_OK, "step %lld: %s", (long long)e->step, err.msg);
    e->step++;
    e->now_us += 1000;
    return plan.n_seqs;
}

static int64_t fe_run(fe *e, int64_t max_steps) {
    int64_t n = 0;
    while (pd_sched_has_work(e->s) && n < max_steps && !pd_test_failed_) {
        fe_step(e);
        n++;
    }
    return n;
}

// Reference generation: next = f(prompt + outputs), stopping like the scheduler.
static int32_t ref_gen(const int32_t *prompt, int32_t n, int32_t max_tokens, const int32_t *stops,
                       int32_t n_stops, int32_t max_len, int32_t *out) {
    int32_t toks[FE_MAX_BLOCKS * FE_BS_MAX];
    memcpy(toks, prompt, (size_t)n * sizeof *toks);
    int32_t n_out = 0;
    for (;;) {
        int32_t t = (int32_t)f_next(toks, n);
        toks[n++] = t;
        out[n_out++] = t;
        if (n_out >= max_tokens || n >= max_len) return n_out;
        for (int32_t i = 0; i < n_stops; i++)
            if (stops[i] == t) return n_out;
    }
}

static void expect_ref(fe *e, uint64_t id, const int32_t *prompt, int32_t n, int32_t max_tokens) {
    int32_t want[FE_MAX_OUT];
    int32_t n_want = ref_gen(prompt, n, max_tokens, NULL, 0, 1 << 30, want);
    fe_req *q = &e->r[id];
    PD_CHECK_MSG(q->finished, "request %llu did not finish", (unsigned long long)id);
    PD_CHECK_EQ(q->n_out, n_want);
    for (int32_t i = 0; i < PD_MIN(q->n_out, n_want); i++)
        PD_CHECK_MSG(q->out[i] == want[i], "request %llu token %d: %d != %d", (unsigned long long)id, i,
                     q->out[i], want[i]);
}

static void fill(int32_t *t, int32_t n, int32_t seed) {
    for (int32_t i = 0; i < n; i++) t[i] = 100 + (seed * 31 + i * 7) % 1000;
}

static pd_sched_params sp_make(int32_t max_seqs, int32_t budget) {
    pd_sched_params p = pd_sched_params_default();
    p.max_num_seqs = max_seqs;
    p.max_num_batched_tokens = budget;
    return p;
}

// ---- basics --------------------------------------------------------------------------------------

PD_TEST(single_request_matches_reference) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[10];
    fill(p, 10, 1);
    PD_CHECK_EQ(fe_add(e, 1, p, 10, 5), PD_OK);
    PD_CHECK_EQ(fe_run(e, 100), 6 - 1);  // 1 prefill step, then 4 decodes
    expect_ref(e, 1, p, 10, 5);
    PD_CHECK_EQ(e->r[1].finish, PD_FINISH_LENGTH);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 64);
    PD_CHECK_EQ(pd_kv_n_cached(e->kv), 3);  // 14 computed tokens: 3 full blocks
    fe_free(e);
}

PD_TEST(add_validation) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[100] = {0};
    pd_err err = {0};
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 0, .max_tokens = 1};
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "empty prompt");
    rp.n_prompt = 3;
    rp.max_tokens = 0;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_ERR_INVALID);
    rp.max_tokens = 1;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_OK);
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "duplicate");
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_OK);
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_OK);  // the id is free again
    fe_free(e);  // frees the waiting request too
    // Chunking off: a prompt over the budget can never be admitted.
    sp.enable_chunked_prefill = false;
    sp.max_model_len = 50;
    e = fe_new(64, 4, &sp);
    rp.n_prompt = 65;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_ERR_INVALID);
    rp.n_prompt = 51;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, &err), PD_ERR_INVALID);
    PD_CHECK_CONTAINS(err.msg, "max_model_len");
    fe_free(e);
    sp = sp_make(0, 64);
    PD_CHECK(pd_sched_new(&sp, e->kv, NULL) == NULL);
}

PD_TEST(add_out_of_memory_is_clean) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int n_ok = 0;
    for (long k = 0; k < 6; k++) {
        pd_mem_fault_set(k, false);
        pd_status st = fe_add(e, (uint64_t)(10 + k), p, 8, 3);
        pd_mem_fault_set(-1, false);
        PD_CHECK(st == PD_OK || st == PD_ERR_NOMEM);
        n_ok += st == PD_OK;
        pd_err err = {0};
        PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    }
    pd_mem_fault_n_failed();
    fe_run(e, 100);
    for (int k = 0; k < 6; k++)
        if (e->r[10 + k].used) expect_ref(e, (uint64_t)(10 + k), p, 8, 3);
    PD_CHECK(n_ok >= 1);
    fe_free(e);
}

// ---- budgets and chunking ------------------------------------------------------------------------

PD_TEST(chunked_prefill_splits_exactly) {
    pd_sched_params sp = sp_make(4, 16);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[50];
    fill(p, 50, 2);
    PD_CHECK_EQ(fe_add(e, 1, p, 50, 2), PD_OK);
    int32_t want_pos[4] = {0, 16, 32, 48}, want_n[4] = {16, 16, 16, 2};
    for (int k = 0; k < 4; k++) {
        fe_step(e);
        PD_REQUIRE(e->last_plan.n_seqs == 1);
        const pd_step_seq *q = &e->last_plan.seqs[0];
        PD_CHECK_EQ(q->pos_start, want_pos[k]);
        PD_CHECK_EQ(q->n_tokens, want_n[k]);
        PD_CHECK_EQ(q->needs_logits, k == 3);
    }
    PD_CHECK_EQ(e->r[1].n_out, 1);
    fe_run(e, 10);
    expect_ref(e, 1, p, 50, 2);
    fe_free(e);
    // With a chunk cap below the budget.
    sp.max_prefill_chunk = 10;
    sp.max_num_batched_tokens = 64;
    e = fe_new(64, 4, &sp);
    PD_CHECK_EQ(fe_add(e, 1, p, 50, 2), PD_OK);
    for (int k = 0; k < 5; k++) {
        fe_step(e);
        PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 10);
        PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 10 * k);
    }
    fe_run(e, 10);
    expect_ref(e, 1, p, 50, 2);
    fe_free(e);
}

PD_TEST(budgets_respected_and_decodes_first) {
    pd_sched_params sp = sp_make(3, 8);
    fe *e = fe_new(128, 4, &sp);
    int32_t a[3], b[3], c[40], d[5];
    fill(a, 3, 3);
    fill(b, 3, 4);
    fill(c, 40, 5);
    fill(d, 5, 6);
    PD_CHECK_EQ(fe_add(e, 1, a, 3, 20), PD_OK);
    PD_CHECK_EQ(fe_add(e, 2, b, 3, 20), PD_OK);
    fe_step(e);  // both prefills (6 tokens)
    PD_CHECK_EQ(e->last_plan.n_seqs, 2);
    PD_CHECK_EQ(fe_add(e, 3, c, 40, 3), PD_OK);
    PD_CHECK_EQ(fe_add(e, 4, d, 5, 3), PD_OK);  // no seat: max_num_seqs = 3
    fe_step(e);
    // Two decodes first, then 6 prompt tokens of request 3.
    PD_REQUIRE(e->last_plan.n_seqs == 3);
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 1);
    PD_CHECK_EQ(e->last_plan.seqs[1].n_tokens, 1);
    PD_CHECK_EQ(e->last_plan.seqs[2].req_id, 3);
    PD_CHECK_EQ(e->last_plan.seqs[2].n_tokens, 6);
    PD_CHECK_EQ(e->last_plan.n_tokens, 8);
    fe_step(e);  // a running prefill chunk comes after the decodes too
    PD_REQUIRE(e->last_plan.n_seqs == 3);
    PD_CHECK_EQ(e->last_plan.seqs[2].req_id, 3);
    PD_CHECK_EQ(e->last_plan.seqs[2].pos_start, 6);
    fe_run(e, 200);
    PD_CHECK_EQ(e->n_plan_seqs_max, 3);
    PD_CHECK_EQ(e->n_plan_tokens_max, 8);
    expect_ref(e, 1, a, 3, 20);
    expect_ref(e, 2, b, 3, 20);
    expect_ref(e, 3, c, 40, 3);
    expect_ref(e, 4, d, 5, 3);
    fe_free(e);
}

PD_TEST(no_chunking_admits_whole_prompts) {
    pd_sched_params sp = sp_make(4, 10);
    sp.enable_chunked_prefill = false;
    fe *e = fe_new(64, 4, &sp);
    int32_t a[4], b[9];
    fill(a, 4, 7);
    fill(b, 9, 8);
    PD_CHECK_EQ(fe_add(e, 1, a, 4, 5), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(fe_add(e, 2, b, 9, 2), PD_OK);
    fe_step(e);  // 1 decode leaves 9 tokens of budget: b fits whole
    PD_CHECK_EQ(e->last_plan.n_seqs, 2);
    PD_CHECK_EQ(e->last_plan.seqs[1].n_tokens, 9);
    fe_free(e);
    e = fe_new(64, 4, &sp);
    int32_t c[10];
    fill(c, 10, 9);
    PD_CHECK_EQ(fe_add(e, 1, a, 4, 5), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(fe_add(e, 2, c, 10, 2), PD_OK);
    fe_step(e);  // 1 decode leaves 9 < 10: c waits, not chunked
    PD_CHECK_EQ(e->last_plan.n_seqs, 1);
    fe_run(e, 100);
    expect_ref(e, 1, a, 4, 5);
    expect_ref(e, 2, c, 10, 2);
    fe_free(e);
}

// ---- ordering ------------------------------------------------------------------------------------

PD_TEST(fcfs_order) {
    pd_sched_params sp = sp_make(1, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[3][6];
    for (int i = 0; i < 3; i++) fill(p[i], 6 - i * 2, 10 + i);  // later ones are shorter
    for (int i = 0; i < 3; i++) PD_CHECK_EQ(fe_add(e, (uint64_t)(1 + i), p[i], 6 - i * 2, 3), PD_OK);
    fe_run(e, 100);
    PD_CHECK(e->r[1].finish_step < e->r[2].finish_step);
    PD_CHECK(e->r[2].finish_step < e->r[3].finish_step);
    for (int i = 0; i < 3; i++) expect_ref(e, (uint64_t)(1 + i), p[i], 6 - i * 2, 3);
    fe_free(e);
}

// Head of line: r holds 5 of 8 blocks, b (4 blocks) is blocked, sm (1 block) would fit. Without
// backfill (FCFS) sm must not overtake b; with backfill a request whose blocks do not fit is passed
// by a later one that fits while it has waited less than backfill_max_wait_us, and past that nobody
// overtakes it. mode 0: FCFS, 1: backfill with a fresh head, 2: backfill with an aged head.
PD_TEST(head_of_line_fcfs_and_backfill) {
    for (int mode = 0; mode < 3; mode++) {
        bool passes = mode == 1;
        pd_sched_params sp = sp_make(4, 64);
        sp.backfill = mode > 0;
        sp.backfill_max_wait_us = mode == 2 ? 0 : 1000000;
        fe *e = fe_new(8, 4, &sp);  // 32 slots
        int32_t r[20], b[16], sm[4];
        fill(r, 20, 13);
        fill(b, 16, 14);
        fill(sm, 4, 15);
        PD_CHECK_EQ(fe_add(e, 1, r, 20, 3), PD_OK);
        fe_step(e);                                  // r holds 5 blocks
        PD_CHECK_EQ(fe_add(e, 2, b, 16, 2), PD_OK);  // needs 4 blocks: only 2 left after r's decode
        PD_CHECK_EQ(fe_add(e, 3, sm, 4, 2), PD_OK);  // fits: passes b only with a fresh backfill head
        fe_step(e);
        pd_sched_stats st;
        pd_sched_stats_get(e->s, &st);
        PD_CHECK_EQ(e->last_plan.n_seqs, passes ? 2 : 1);
        PD_CHECK_EQ(e->last_plan.seqs[0].req_id, 1);
        PD_CHECK_EQ(st.n_backfill_passes, passes ? 1 : 0);
        if (passes) PD_CHECK_EQ(e->last_plan.seqs[1].req_id, 3);
        fe_run(e, 100);
        if (!passes) PD_CHECK(e->r[2].finish_step <= e->r[3].finish_step);
        expect_ref(e, 1, r, 20, 3);
        expect_ref(e, 2, b, 16, 2);
        expect_ref(e, 3, sm, 4, 2);
        fe_free(e);
    }
}

// tier_reserve_compute: a tier load's admission also takes the blocks of the tokens computed after
// it, so a load that ends inside its step always has room to compute there.
PD_TEST(tier_reserve_compute_takes_the_new_blocks) {
    for (int reserve = 0; reserve < 2; reserve++) {
        pd_sched_params sp = sp_make(4, 64);
        sp.tier_reserve_compute = reserve;
        fe *e = fe_new(16, 4, &sp);
        int32_t p[30];
        fill(p, 30, 21);
        pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 30, .max_tokens = 2, .n_tier_tokens = 28};
        PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
        int32_t free0 = pd_kv_n_free(e->kv);
        e->is_tier_paused = true;  // the load stays in flight: see what admission took
        fe_step(e);
        PD_REQUIRE(e->last_plan.n_tier_loads == 1);
        PD_CHECK_EQ(e->last_plan.tier_loads[0].n_blocks, 7);         // positions [0, 28): the load
        PD_CHECK_EQ(free0 - pd_kv_n_free(e->kv), reserve ? 8 : 7);  // + [28, 30) when reserving
        e->is_tier_paused = false;
        fe_run(e, 100);
        expect_ref(e, 1, p, 30, 2);
        PD_CHECK_EQ(pd_kv_n_free(e->kv), free0);
        fe_free(e);
    }
}

PD_TEST(priority_first) {
    pd_sched_params sp = sp_make(1, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[6];
    fill(p, 6, 20);
    PD_CHECK_EQ(fe_add_full(e, 1, p, 6, 2, 0, NULL, 0), PD_OK);
    PD_CHECK_EQ(fe_add_full(e, 2, p, 6, 2, 0, NULL, 0), PD_OK);
    PD_CHECK_EQ(fe_add_full(e, 3, p, 6, 2, 5, NULL, 0), PD_OK);
    PD_CHECK_EQ(fe_add_full(e, 4, p, 6, 2, -1, NULL, 0), PD_OK);
    fe_run(e, 100);
    PD_CHECK(e->r[3].finish_step < e->r[1].finish_step);
    PD_CHECK(e->r[1].finish_step < e->r[2].finish_step);
    PD_CHECK(e->r[2].finish_step < e->r[4].finish_step);
    fe_free(e);
}

PD_TEST(srpt_prefers_short_then_ages) {
    for (int aging = 0; aging < 2; aging++) {
        pd_sched_params sp = sp_make(1, 1000);
        sp.policy = PD_SCHED_SRPT;
        sp.srpt_starvation_us = aging ? 20000 : INT64_MAX / 2;
        fe *e = fe_new(256, 4, &sp);
        int32_t big[200], small[5];
        fill(big, 200, 30);
        PD_CHECK_EQ(fe_add(e, 1, big, 200, 1), PD_OK);
        uint64_t next = 2;
        // A new short request arrives every step: pure SRPT would starve the long one.
        for (int st = 0; st < 60 && !pd_test_failed_; st++) {
            fill(small, 5, (int32_t)next);
            PD_CHECK_EQ(fe_add(e, next, small, 5, 1), PD_OK);
            next++;
            fe_step(e);
            if (st == 0) PD_CHECK_EQ(e->last_plan.seqs[0].req_id, 2);  // short first
        }
        if (aging) {
            PD_CHECK(e->r[1].finished);
            PD_CHECK(e->r[1].finish_step >= 19 && e->r[1].finish_step <= 22);
            expect_ref(e, 1, big, 200, 1);
        } else {
            PD_CHECK(!e->r[1].finished);
        }
        fe_free(e);
    }
}

PD_TEST(srpt_is_prefix_aware) {
    pd_sched_params sp = sp_make(1, 1000);
    sp.policy = PD_SCHED_SRPT;
    fe *e = fe_new(256, 4, &sp);
    int32_t a[68], y[20];
    fill(a, 68, 40);
    fill(y, 20, 41);
    PD_CHECK_EQ(fe_add(e, 1, a, 64, 1), PD_OK);
    fe_run(e, 10);  // a's first 64 tokens are now cached
    PD_CHECK_EQ(fe_add(e, 2, y, 20, 1), PD_OK);  // 20 uncached tokens, arrives first
    PD_CHECK_EQ(fe_add(e, 3, a, 68, 1), PD_OK);  // 68 tokens, but only 4 uncached
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.seqs[0].req_id, 3);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 64);
    fe_run(e, 10);
    PD_CHECK_EQ(e->r[3].n_cached, 64);
    expect_ref(e, 3, a, 68, 1);
    expect_ref(e, 2, y, 20, 1);
    fe_free(e);
}

// SRPT counts what a tier below the device pool holds as loaded, not computed: a long prompt whose
// history a tier holds goes before a shorter uncached one (FCFS: arrival order), and its load ends
// in the admitting step like a prefix hit.
PD_TEST(srpt_is_tier_aware) {
    for (int srpt = 0; srpt < 2; srpt++) {
        pd_sched_params sp = sp_make(1, 1000);
        sp.policy = srpt ? PD_SCHED_SRPT : PD_SCHED_FCFS;
        fe *e = fe_new(256, 4, &sp);
        e->is_tier_now = true;
        int32_t a[68], y[20];
        fill(a, 68, 42);
        fill(y, 20, 43);
        PD_CHECK_EQ(fe_add(e, 2, y, 20, 1), PD_OK);  // 20 tokens to compute, arrives first
        pd_sched_req_params rp = {.req_id = 3, .prompt = a, .n_prompt = 68, .max_tokens = 1, .n_tier_tokens = 64};
        PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);  // 68 tokens, 64 of them in a tier: 4 to compute
        fe_step(e);
        PD_REQUIRE(e->last_plan.n_seqs == 1);
        PD_CHECK_EQ(e->last_plan.seqs[0].req_id, srpt ? 3u : 2u);
        if (srpt) {
            PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 64);  // loaded in this step, 4 computed
            PD_CHECK_EQ(e->n_tier_now, 1);
            PD_CHECK(e->r[3].finished);  // its first (only) token from the admitting step
        }
        fe_run(e, 20);
        expect_ref(e, 2, y, 20, 1);
        expect_ref(e, 3, a, 68, 1);
        fe_free(e);
    }
}

// Tier hits never starve a long uncached prompt: a stream of requests that are cheap because a tier
// holds them overtakes it only until it has waited srpt_starvation_us (20 steps here).
PD_TEST(srpt_tier_hits_then_ages) {
    for (int aging = 0; aging < 2; aging++) {
        pd_sched_params sp = sp_make(1, 1000);
        sp.policy = PD_SCHED_SRPT;
        sp.srpt_starvation_us = aging ? 20000 : INT64_MAX / 2;
        fe *e = fe_new(256, 4, &sp);
        e->is_tier_now = true;
        int32_t big[100], hot[120];
        fill(big, 100, 500);  // (no hot prompt below equals it: fill's seeds differ mod 1000)
        PD_CHECK_EQ(fe_add(e, 1, big, 100, 1), PD_OK);
        uint64_t next = 2;
        for (int st = 0; st < 60 && !pd_test_failed_; st++) {
            fill(hot, 120, 1000 + (int32_t)next);  // longer than big, but a tier holds all but 4
            pd_sched_req_params rp = {.req_id = next, .prompt = hot, .n_prompt = 120, .max_tokens = 1,
                                      .n_tier_tokens = 116};
            PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
            next++;
            fe_step(e);
            if (st == 0) PD_CHECK_EQ(e->last_plan.seqs[0].req_id, 2u);  // the tier hit first
        }
        if (aging) {
            PD_CHECK(e->r[1].finished);
            PD_CHECK(e->r[1].finish_step >= 19 && e->r[1].finish_step <= 22);
            expect_ref(e, 1, big, 100, 1);
        } else {
            PD_CHECK(!e->r[1].finished);
        }
        fe_run(e, 200);
        for (uint64_t id = 2; id < next && !pd_test_failed_; id++) PD_CHECK(e->r[id].finished);
        fe_free(e);
    }
}

// ---- prefix cache, preemption, stops, aborts -----------------------------------------------------

PD_TEST(cached_tokens_reported) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[30];
    fill(p, 30, 50);
    PD_CHECK_EQ(fe_add(e, 1, p, 30, 3), PD_OK);
    fe_run(e, 10);
    PD_CHECK_EQ(e->r[1].n_cached, 0);
    PD_CHECK_EQ(fe_add(e, 2, p, 30, 3), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 28);  // 7 cached blocks
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 2);
    fe_run(e, 10);
    PD_CHECK_EQ(e->r[2].n_cached, 28);
    expect_ref(e, 2, p, 30, 3);
    fe_free(e);
}

PD_TEST(preemption_victim_is_least_important) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(4, 4, &sp);  // 16 token slots in all
    int32_t a[4], b[4];
    fill(a, 4, 60);
    fill(b, 4, 61);
    PD_CHECK_EQ(fe_add_full(e, 1, b, 4, 10, 0, NULL, 0), PD_OK);  // older, but less important
    PD_CHECK_EQ(fe_add_full(e, 2, a, 4, 10, 1, NULL, 0), PD_OK);
    uint64_t first_victim = 0;
    while (pd_sched_has_work(e->s) && e->step < 200 && !pd_test_failed_) {
        fe_step(e);
        if (!first_victim && e->last_plan.n_preempted) first_victim = e->last_plan.preempted_ids[0];
    }
    PD_CHECK_EQ(first_victim, 1);
    PD_CHECK(e->r[1].n_preemptions >= 1);
    PD_CHECK_EQ(e->r[2].n_preemptions, 0);
    PD_CHECK(e->r[2].finish_step < e->r[1].finish_step);
    expect_ref(e, 1, b, 4, 10);  // recomputed from scratch, same tokens
    expect_ref(e, 2, a, 4, 10);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 4);
    fe_free(e);
}

PD_TEST(preemption_tiny_pool_completes_all) {
    pd_sched_params sp = sp_make(8, 32);
    fe *e = fe_new(12, 4, &sp);  // 48 slots for 8 requests of up to 30 tokens
    int32_t p[8][14];
    for (int i = 0; i < 8; i++) {
        fill(p[i], 6 + i, 70 + i);
        PD_CHECK_EQ(fe_add(e, (uint64_t)(1 + i), p[i], 6 + i, 16), PD_OK);
    }
    fe_run(e, 2000);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK(st.n_preemptions > 0);
    PD_CHECK_EQ(st.n_finished, 8);
    for (int i = 0; i < 8; i++) expect_ref(e, (uint64_t)(1 + i), p[i], 6 + i, 16);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 12);
    fe_free(e);
}

PD_TEST(never_fits_finishes_with_error) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(4, 4, &sp);  // 16 slots
    int32_t big[20], ok[5];
    fill(big, 20, 80);
    fill(ok, 5, 81);
    PD_CHECK_EQ(fe_add(e, 1, big, 20, 5), PD_OK);
    PD_CHECK_EQ(fe_add(e, 2, ok, 5, 20), PD_OK);  // will reach the pool limit: LENGTH
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.n_finished, 1);
    PD_CHECK(e->r[1].finished);
    PD_CHECK_EQ(e->r[1].finish, PD_FINISH_ERROR);
    PD_CHECK_EQ(e->r[1].n_out, 0);
    fe_run(e, 100);
    PD_CHECK(e->r[2].finished);
    PD_CHECK_EQ(e->r[2].finish, PD_FINISH_LENGTH);
    PD_CHECK_EQ(e->r[2].n_out, 16 - 5);  // 16 tokens in all: the last one is never computed
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 4);
    fe_free(e);
    // Chunking off: a preempted request whose prompt + outputs outgrew the budget. Without the
    // prefix cache it has to recompute all of them in one step, which it never can.
    sp = sp_make(4, 8);
    sp.enable_chunked_prefill = false;
    fe_caching = false;
    e = fe_new(4, 4, &sp);  // 16 slots
    fe_caching = true;
    int32_t a[4], b[4];
    fill(a, 4, 82);
    fill(b, 4, 83);
    PD_CHECK_EQ(fe_add_full(e, 1, a, 4, 12, 1, NULL, 0), PD_OK);
    PD_CHECK_EQ(fe_add_full(e, 2, b, 4, 12, 0, NULL, 0), PD_OK);
    fe_run(e, 100);
    PD_CHECK(e->r[1].finished && e->r[2].finished);
    expect_ref(e, 1, a, 4, 12);
    PD_CHECK_EQ(e->r[2].n_preemptions, 1);
    PD_CHECK_EQ(e->r[2].finish, PD_FINISH_ERROR);  // preempted at 4 + 5 tokens > 8
    PD_CHECK_EQ(e->r[2].n_out, 5);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 4);
    fe_free(e);
}

PD_TEST(stop_rules) {
    pd_sched_params sp = sp_make(8, 64);
    sp.max_model_len = 12;
    fe *e = fe_new(64, 4, &sp);
    int32_t p[6], want[64];
    fill(p, 6, 90);
    int32_t n = ref_gen(p, 6, 64, NULL, 0, 1 << 30, want);
    PD_REQUIRE(n == 64);
    // Stop id = the 3rd generated token (it is emitted, then the request stops).
    int32_t stop = want[2];
    PD_CHECK_EQ(fe_add_full(e, 1, p, 6, 5, 0, &stop, 1), PD_OK);
    // EOS ignored, and min_tokens: the stop id does not count before 4 outputs.
    pd_sched_req_params rp = {.req_id = 2, .prompt = p, .n_prompt = 6, .max_tokens = 5,
                              .eos_ids = &stop, .n_eos_ids = 1, .ignore_eos = true};
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, NULL), PD_OK);
    e->r[2].used = true;
    rp.req_id = 3;
    rp.ignore_eos = false;
    rp.min_tokens = 4;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, NULL), PD_OK);
    e->r[3].used = true;
    rp.req_id = 4;
    rp.min_tokens = 0;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, NULL), PD_OK);  // EOS honoured
    e->r[4].used = true;
    PD_CHECK_EQ(fe_add(e, 5, p, 6, 50), PD_OK);  // max_model_len 12: 6 outputs
    fe_run(e, 100);
    PD_CHECK_EQ(e->r[1].finish, PD_FINISH_STOP);
    PD_CHECK_EQ(e->r[1].n_out, 3);
    PD_CHECK_EQ(e->r[1].stop_token, stop);
    PD_CHECK_EQ(e->r[2].finish, PD_FINISH_LENGTH);
    PD_CHECK_EQ(e->r[2].n_out, 5);
    PD_CHECK_EQ(e->r[3].finish, PD_FINISH_LENGTH);  // want[2] ignored; 5 = max_tokens
    PD_CHECK_EQ(e->r[4].finish, PD_FINISH_STOP);
    PD_CHECK_EQ(e->r[4].n_out, 3);
    PD_CHECK_EQ(e->r[5].finish, PD_FINISH_LENGTH);
    PD_CHECK_EQ(e->r[5].n_out, 6);
    fe_free(e);
    // The engine's stop-string flag.
    sp.max_model_len = 0;
    e = fe_new(64, 4, &sp);
    e->stop_string_after = 2;
    PD_CHECK_EQ(fe_add(e, 1, p, 6, 10), PD_OK);
    fe_run(e, 100);
    PD_CHECK_EQ(e->r[1].finish, PD_FINISH_STOP);
    PD_CHECK_EQ(e->r[1].n_out, 2);
    PD_CHECK_EQ(e->r[1].stop_token, -1);
    fe_free(e);
}

PD_TEST(abort_frees_everything) {
    pd_sched_params sp = sp_make(4, 8);
    fe *e = fe_new(32, 4, &sp);
    int32_t p[20];
    fill(p, 20, 95);
    PD_CHECK_EQ(fe_add(e, 1, p, 20, 30), PD_OK);
    PD_CHECK_EQ(fe_add(e, 2, p, 10, 30), PD_OK);
    fe_step(e);  // 1 runs (8 tokens), 2 waits (no budget)
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 2);
    PD_CHECK_EQ(pd_sched_abort(e->s, 2), PD_OK);  // waiting
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_OK);  // running
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 0);
    PD_CHECK(!pd_sched_has_work(e->s));
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    // Abort between schedule and update: update skips it, the plan's memory stays valid.
    PD_CHECK_EQ(fe_add(e, 3, p, 6, 30), PD_OK);
    PD_CHECK_EQ(fe_add(e, 4, p, 7, 30), PD_OK);
    pd_step_plan plan;
    pd_sched_schedule(e->s, 0, &plan);
    PD_REQUIRE(plan.n_seqs == 2);
    PD_CHECK_EQ(pd_sched_abort(e->s, 3), PD_OK);
    PD_CHECK_EQ(plan.seqs[0].tokens[0], p[plan.seqs[0].pos_start]);  // still readable (ASan)
    PD_CHECK_EQ(pd_sched_abort(e->s, 3), PD_ERR_NOTFOUND);
    pd_step_output outs[2] = {{.token = 5}, {.token = 6}};
    const pd_sched_event *ev;
    int32_t n_ev;
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, outs, 0, &ev, &n_ev), PD_OK);
    PD_CHECK_EQ(n_ev, 1);
    PD_CHECK_EQ(ev[0].req_id, 4);
    PD_CHECK_EQ(ev[0].token, 6);
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, outs, 0, &ev, &n_ev), PD_ERR_INVALID);  // spent
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    PD_CHECK_EQ(pd_sched_abort(e->s, 4), PD_OK);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 32);
    // A plan that is never applied is simply dropped by the next schedule.
    PD_CHECK_EQ(fe_add(e, 5, p, 6, 2), PD_OK);
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(pd_sched_abort(e->s, 5), PD_OK);
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(plan.n_seqs, 0);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_aborted, 5);
    fe_free(e);
}

PD_TEST(many_requests_map_and_queue_grow) {
    pd_sched_params sp = sp_make(16, 256);
    fe *e = fe_new(256, 4, &sp);
    int32_t p[8];
    fill(p, 8, 103);
    // Sparse, colliding-looking ids exercise the id map's probing, growth and deletion.
    for (uint64_t i = 0; i < 400; i++) {
        pd_sched_req_params rp = {.req_id = i * 4096 + 7, .prompt = p, .n_prompt = 8, .max_tokens = 2};
        PD_REQUIRE(pd_sched_add(e->s, &rp, 0, NULL) == PD_OK);
    }
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    for (uint64_t i = 0; i < 400; i += 2) PD_CHECK_EQ(pd_sched_abort(e->s, i * 4096 + 7), PD_OK);
    for (uint64_t i = 0; i < 400; i += 2) PD_CHECK_EQ(pd_sched_abort(e->s, i * 4096 + 7), PD_ERR_NOTFOUND);
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_waiting, 200);
    int64_t n = 0;
    while (pd_sched_has_work(e->s) && n++ < 1000) {
        pd_step_plan plan;
        pd_sched_schedule(e->s, 0, &plan);
        PD_CHECK(plan.n_seqs <= 16);
        pd_step_output outs[16];
        for (int32_t i = 0; i < plan.n_seqs; i++) outs[i] = (pd_step_output){.token = 1};
        const pd_sched_event *ev;
        int32_t n_ev;
        PD_CHECK_EQ(pd_sched_update(e->s, &plan, outs, 0, &ev, &n_ev), PD_OK);
        PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    }
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_finished, 200);
    PD_CHECK_EQ(st.n_aborted, 200);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 256);
    fe_free(e);
}

// ---- disaggregation hooks ------------------------------------------------------------------------

PD_TEST(remote_prefill_decode_side) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[22];
    fill(p, 22, 100);
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 22, .max_tokens = 6,
                              .is_remote_prefill = true};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    pd_step_plan plan;
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(plan.n_seqs, 0);  // nothing computed here
    PD_REQUIRE(plan.n_kv_loads == 1);
    PD_CHECK_EQ(plan.kv_loads[0].n_tokens_local, 0);
    PD_CHECK_EQ(plan.kv_loads[0].n_tokens, 22);
    PD_CHECK_EQ(plan.kv_loads[0].n_blocks, 6);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_loading, 1);
    PD_CHECK_EQ(st.n_running, 1);  // it has a seat
    const pd_sched_event *ev;
    int32_t n_ev;
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, NULL, 0, &ev, &n_ev), PD_OK);
    pd_sched_schedule(e->s, 0, &plan);  // still loading: not scheduled, not a victim
    PD_CHECK_EQ(plan.n_seqs, 0);
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, NULL, 0, &ev, &n_ev), PD_OK);
    // Client gone while loading: the seat goes at once, the blocks only when the load ends.
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_OK);
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_ERR_NOTFOUND);
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_running, 0);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 6);
    PD_CHECK(pd_sched_has_work(e->s));  // the engine must still end the load
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    pd_sched_event le;
    PD_CHECK_EQ(pd_sched_kv_loaded(e->s, 1, true, 5, &le), PD_ERR_CLOSED);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 0);
    PD_CHECK(!pd_sched_has_work(e->s));
    // Again, through the harness, which plays the transfer and the prefill worker.
    memset(&e->r[1], 0, sizeof e->r[1]);
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_run(e, 50);
    expect_ref(e, 1, p, 22, 6);  // first token from the "prefill worker", then local decodes
    // A second remote request with the same prompt: the cached prefix is not loaded again.
    rp.req_id = 2;
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_REQUIRE(e->last_plan.n_kv_loads == 1);
    PD_CHECK_EQ(e->last_plan.kv_loads[0].n_tokens_local, 20);
    fe_run(e, 50);
    expect_ref(e, 2, p, 22, 6);
    PD_CHECK_EQ(e->r[2].n_cached, 20);
    // max_tokens 1: the first token finishes it inside pd_sched_kv_loaded.
    rp.req_id = 3;
    rp.max_tokens = 1;
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_run(e, 50);
    PD_CHECK_EQ(e->r[3].finish, PD_FINISH_LENGTH);
    expect_ref(e, 3, p, 22, 1);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 64);
    PD_CHECK_EQ(pd_sched_kv_loaded(e->s, 3, true, 1, &le), PD_ERR_NOTFOUND);
    fe_free(e);
}

// Tier loads (KV that left the device pool for DRAM / disk / Redis): LOADING_TIER takes a seat and
// blocks but no budget, is never a preemption victim, keeps its blocks through an abort until the
// load ends, and runs on from whatever part of the blocks the tier delivered.
PD_TEST(tier_load_state) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[22];
    fill(p, 22, 300);
    // The tier claims 24 tokens, more than the prompt can load (the last token is computed):
    // the load covers positions [0, 20).
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 22, .max_tokens = 5, .n_tier_tokens = 24};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    pd_step_plan plan;
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(plan.n_seqs, 0);
    PD_CHECK_EQ(plan.n_kv_loads, 0);
    PD_REQUIRE(plan.n_tier_loads == 1);
    PD_CHECK_EQ(plan.tier_loads[0].n_tokens_local, 0);
    PD_CHECK_EQ(plan.tier_loads[0].n_tokens, 20);
    PD_CHECK_EQ(plan.tier_loads[0].n_blocks, 5);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_loading, 1);
    PD_CHECK_EQ(st.n_tier_loading, 1);
    PD_CHECK_EQ(st.n_running, 1);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 6);  // the load's 5 blocks and the one its 2 computed tokens need
    const pd_sched_event *ev;
    int32_t n_ev;
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, NULL, 0, &ev, &n_ev), PD_OK);
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    PD_CHECK_EQ(pd_sched_kv_loaded(e->s, 1, true, 5, &(pd_sched_event){0}), PD_ERR_NOTFOUND);  // not a remote load
    // Aborted while loading: seat gone now, blocks when the load ends.
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_OK);
    PD_CHECK_EQ(pd_sched_abort(e->s, 1), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 6);
    PD_CHECK(pd_sched_has_work(e->s));
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    PD_CHECK_EQ(pd_sched_tier_loaded(e->s, 1, 8), PD_ERR_CLOSED);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 0);
    PD_CHECK(!pd_sched_has_work(e->s));
    // Through the harness: the whole load lands, the request computes only the rest.
    memset(&e->r[1], 0, sizeof e->r[1]);
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->n_tier_done, 1);
    PD_CHECK_EQ(e->n_tier_tokens_loaded, 20);
    fe_step(e);
    PD_REQUIRE(e->last_plan.n_seqs == 1);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 20);  // only the 2 uncached tokens
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 2);
    fe_run(e, 50);
    expect_ref(e, 1, p, 22, 5);
    // The loaded blocks joined the prefix cache: the same prompt now hits the device pool (no
    // tier load: the tier holds nothing beyond the hit).
    rp.req_id = 2;
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.n_tier_loads, 0);
    fe_run(e, 50);
    expect_ref(e, 2, p, 22, 5);
    PD_CHECK_EQ(e->r[2].n_cached, 20);
    // A tier that lost everything: the request computes its whole prompt, output unchanged.
    int32_t p2[30];
    fill(p2, 30, 301);
    e->is_tier_losing = true;
    rp = (pd_sched_req_params){.req_id = 3, .prompt = p2, .n_prompt = 30, .max_tokens = 3, .n_tier_tokens = 28};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->n_tier_done, 2);
    fe_step(e);
    PD_REQUIRE(e->last_plan.n_seqs == 1);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 0);
    fe_run(e, 50);
    expect_ref(e, 3, p2, 30, 3);
    // A one-token prompt and a tier claim of less than the hit: no tier load.
    rp = (pd_sched_req_params){.req_id = 4, .prompt = p, .n_prompt = 1, .max_tokens = 2, .n_tier_tokens = 4};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.n_tier_loads, 0);
    fe_run(e, 50);
    rp = (pd_sched_req_params){.req_id = 5, .prompt = p, .n_prompt = 22, .max_tokens = 2, .n_tier_tokens = 8};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.n_tier_loads, 0);  // the device pool already holds 20
    fe_run(e, 50);
    expect_ref(e, 5, p, 22, 2);
    // A remote-prefill request ignores the tier.
    rp = (pd_sched_req_params){.req_id = 6, .prompt = p2, .n_prompt = 30, .max_tokens = 2, .n_tier_tokens = 28,
                               .is_remote_prefill = true};
    e->is_tier_losing = false;
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);
    PD_CHECK_EQ(e->last_plan.n_tier_loads, 0);
    fe_run(e, 50);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 64);
    fe_free(e);
}

// A tier load that ends inside its step (the hot DRAM tier: the copy is enqueued before the step's
// compute): the request joins that same plan from the loaded position on, like a prefix-cache
// hit; no budget left / a partial load / chunking work as at admission.
PD_TEST(tier_load_now) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(64, 4, &sp);
    int32_t p[22];
    fill(p, 22, 310);
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 22, .max_tokens = 5, .n_tier_tokens = 24};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    pd_step_plan plan;
    pd_sched_schedule(e->s, 0, &plan);
    PD_REQUIRE(plan.n_tier_loads == 1 && plan.n_seqs == 0);
    pd_step_plan stale = plan;
    stale.step_id--;
    PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, &stale, 1, 20), PD_ERR_INVALID);  // not the outstanding plan
    PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, &plan, 1, 24), PD_ERR_INVALID);   // beyond the load
    fe_tier_write(e, &plan.tier_loads[0], 5);
    PD_CHECK_EQ(pd_sched_tier_loaded_now(e->s, &plan, 1, 20), PD_OK);
    PD_REQUIRE(plan.n_seqs == 1);
    PD_CHECK_EQ(plan.seqs[0].req_id, 1);
    PD_CHECK_EQ(plan.seqs[0].pos_start, 20);
    PD_CHECK_EQ(plan.seqs[0].n_tokens, 2);
    PD_CHECK(plan.seqs[0].needs_logits);
    PD_CHECK_EQ(plan.n_tokens, 2);
    PD_CHECK_EQ(pd_sched_tier_loaded(e->s, 1, 0), PD_ERR_NOTFOUND);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_loading, 0);
    PD_CHECK_EQ(st.n_tier_loading, 0);
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    // (the plan is abandoned: the next schedule drops it and plans those 2 tokens again)
    // Through the harness: the whole load lands in the step that admits it; the first token comes
    // from that step, and the output is the reference.
    e->is_tier_now = true;
    fe_run(e, 50);
    expect_ref(e, 1, p, 22, 5);
    int32_t p2[40];
    fill(p2, 40, 311);
    rp = (pd_sched_req_params){.req_id = 2, .prompt = p2, .n_prompt = 40, .max_tokens = 3, .n_tier_tokens = 40};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    PD_CHECK_EQ(fe_step(e), 1);
    PD_CHECK_EQ(e->n_tier_now, 1);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 36);
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 4);
    PD_CHECK_EQ(e->r[2].n_out, 1);  // its first token in the admitting step
    fe_run(e, 50);
    expect_ref(e, 2, p2, 40, 3);
    // A tier that lost everything: computed from the hit, still in the same step.
    int32_t p3[30];
    fill(p3, 30, 312);
    e->is_tier_losing = true;
    rp = (pd_sched_req_params){.req_id = 3, .prompt = p3, .n_prompt = 30, .max_tokens = 2, .n_tier_tokens = 28};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    PD_CHECK_EQ(fe_step(e), 1);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 0);
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 30);
    fe_run(e, 50);
    expect_ref(e, 3, p3, 30, 2);
    e->is_tier_losing = false;
    // One token of budget left in the step (a 63-token prompt took the rest): the loaded request
    // computes a one-token chunk in it, the last token next step.
    int32_t p4[63], p5[30];
    fill(p4, 63, 313);
    fill(p5, 30, 314);
    rp = (pd_sched_req_params){.req_id = 4, .prompt = p4, .n_prompt = 63, .max_tokens = 2};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    rp = (pd_sched_req_params){.req_id = 5, .prompt = p5, .n_prompt = 30, .max_tokens = 2, .n_tier_tokens = 28};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    PD_CHECK_EQ(fe_step(e), 2);
    PD_CHECK_EQ(e->last_plan.n_tier_loads, 1);
    PD_CHECK_EQ(e->last_plan.seqs[1].req_id, 5);
    PD_CHECK_EQ(e->last_plan.seqs[1].pos_start, 28);
    PD_CHECK_EQ(e->last_plan.seqs[1].n_tokens, 1);
    PD_CHECK(!e->last_plan.seqs[1].needs_logits);
    PD_CHECK_EQ(e->last_plan.n_tokens, 64);
    fe_run(e, 50);
    expect_ref(e, 4, p4, 63, 2);
    expect_ref(e, 5, p5, 30, 2);
    PD_CHECK(!pd_sched_has_work(e->s));
    fe_free(e);
}

// While a tier load runs, other requests keep stepping, and a loading request is no preemption
// victim even when the pool runs dry.
PD_TEST(tier_load_others_step) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(12, 4, &sp);
    int32_t a[9], b[26];
    fill(a, 9, 310);
    fill(b, 26, 311);
    PD_CHECK_EQ(fe_add(e, 1, a, 9, 12), PD_OK);
    fe_step(e);
    pd_sched_req_params rp = {.req_id = 2, .prompt = b, .n_prompt = 26, .max_tokens = 4, .n_tier_tokens = 24};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    e->is_tier_paused = true;
    fe_step(e);
    PD_REQUIRE(e->last_plan.n_tier_loads == 1);
    PD_CHECK_EQ(e->last_plan.n_seqs, 1);  // request 1 decodes in the same step
    for (int i = 0; i < 6; i++) {
        int32_t n0 = e->r[1].n_out;
        fe_step(e);
        PD_CHECK(e->r[1].n_out > n0);  // request 1 keeps going (never preempted for the loader)
        pd_sched_stats st;
        pd_sched_stats_get(e->s, &st);
        PD_CHECK_EQ(st.n_tier_loading, 1);
    }
    e->is_tier_paused = false;
    fe_run(e, 100);
    PD_CHECK(e->r[1].finished);
    expect_ref(e, 2, b, 26, 4);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 12);
    fe_free(e);
}

PD_TEST(remote_prefill_failure_recomputes) {
    pd_sched_params sp = sp_make(4, 8);
    fe *e = fe_new(64, 4, &sp);
    e->is_load_failing = true;
    int32_t p[22];
    fill(p, 22, 101);
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 22, .max_tokens = 4,
                              .is_remote_prefill = true};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    fe_step(e);  // admitted, load fails at once
    PD_CHECK_EQ(e->n_loads_failed, 1);
    fe_step(e);  // now a local prefill chunk
    PD_REQUIRE(e->last_plan.n_seqs == 1);
    PD_CHECK_EQ(e->last_plan.seqs[0].pos_start, 0);
    PD_CHECK_EQ(e->last_plan.seqs[0].n_tokens, 8);
    fe_run(e, 50);
    expect_ref(e, 1, p, 22, 4);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), 64);
    fe_free(e);
}

PD_TEST(hold_blocks_prefill_side) {
    pd_sched_params sp = sp_make(4, 64);
    fe *e = fe_new(16, 4, &sp);
    int32_t p[10];
    fill(p, 10, 102);
    pd_sched_req_params rp = {.req_id = 1, .prompt = p, .n_prompt = 10, .max_tokens = 1,
                              .is_hold_blocks = true};
    PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
    pd_step_plan plan;
    pd_sched_schedule(e->s, 0, &plan);
    PD_REQUIRE(plan.n_seqs == 1);
    pd_step_output out = {.token = 7};
    const pd_sched_event *ev;
    int32_t n_ev;
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, &out, 0, &ev, &n_ev), PD_OK);
    PD_REQUIRE(n_ev == 1);
    PD_CHECK_EQ(ev[0].finish, PD_FINISH_LENGTH);
    PD_CHECK_EQ(ev[0].n_blocks, 3);
    int32_t b0 = ev[0].block_ids[0];
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 3);  // still held for the transfer
    PD_CHECK_EQ(pd_kv_block_ref(e->kv, b0), 1);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    PD_CHECK_EQ(st.n_held, 1);
    PD_CHECK_EQ(st.n_running, 0);  // the seat is free
    PD_CHECK(!pd_sched_has_work(e->s));
    pd_err err = {0};
    PD_CHECK_MSG(pd_sched_check(e->s, &err) == PD_OK, "%s", err.msg);
    PD_CHECK_EQ(pd_sched_release(e->s, 2), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_sched_release(e->s, 1), PD_OK);
    PD_CHECK_EQ(pd_sched_release(e->s, 1), PD_ERR_NOTFOUND);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 0);
    PD_CHECK_EQ(pd_kv_n_cached(e->kv), 2);  // full blocks stay in the prefix cache
    // Abort of a held request releases it too; pd_sched_free releases any still held.
    rp.req_id = 2;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, NULL), PD_OK);
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, &out, 0, &ev, &n_ev), PD_OK);
    PD_CHECK_EQ(pd_sched_abort(e->s, 2), PD_OK);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 0);
    rp.req_id = 3;
    PD_CHECK_EQ(pd_sched_add(e->s, &rp, 0, NULL), PD_OK);
    pd_sched_schedule(e->s, 0, &plan);
    PD_CHECK_EQ(pd_sched_update(e->s, &plan, &out, 0, &ev, &n_ev), PD_OK);
    PD_CHECK_EQ(pd_kv_n_used(e->kv), 3);  // its 3 blocks (2 prefix hits) are held; fe_free frees
    fe_free(e);
}

// ---- property test ---------------------------------------------------------------------------------

typedef struct preq_info {
    int32_t prompt[64];
    int32_t n, max_tokens, stop;
} preq_info;

static int64_t prop_preemptions, prop_aborts;

static int64_t prop_spec_accepted, prop_spec_drafted, prop_spec_multi;

static bool prop_backfill, prop_reserve;  // the admission options under test (property_backfill_reserve)
static int64_t prop_passes;

static void prop_sched_spec(uint64_t seed, pd_sched_policy policy, bool chunked, bool caching, int32_t lookahead) {
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    pd_sched_params sp = sp_make(1 + (int32_t)(pd_rng_next(&rng) % 8), 8 + (int32_t)(pd_rng_next(&rng) % 64));
    sp.max_lookahead_slots = lookahead;
    sp.backfill = prop_backfill;
    sp.backfill_max_wait_us = 30000;  // 30 steps of the harness
    sp.tier_reserve_compute = prop_reserve;
    sp.policy = policy;
    sp.enable_chunked_prefill = chunked;
    sp.srpt_starvation_us = 50000;
    if (!chunked) sp.max_num_batched_tokens = 64;
    fe_caching = caching;
    fe *e = fe_new(16 + (int32_t)(pd_rng_next(&rng) % 32), 4, &sp);
    pd_rng mid, loads;
    pd_rng_seed(&mid, seed + 1000);
    pd_rng_seed(&loads, seed + 2000);
    e->mid_abort_rng = &mid;
    e->load_rng = &loads;
    e->tier_rng = &loads;
    pd_rng tnow;
    pd_rng_seed(&tnow, seed + 4000);
    e->tier_now_rng = &tnow;
    pd_rng spec;
    pd_rng_seed(&spec, seed + 3000);
    if (lookahead > 0) {
        e->spec_rng = &spec;
        e->spec_p_right = 0.3 + 0.6 * pd_rng_uniform(&spec);
    }
    fe_caching = true;
    int32_t n_free0 = pd_kv_n_free(e->kv);
    static preq_info info[FE_MAX_REQS];
    int32_t shared[64];
    for (int i = 0; i < 64; i++) shared[i] = 1 + (int32_t)(pd_rng_next(&rng) % 97);
    uint64_t next = 1;
    for (int st = 0; st < 600 && !pd_test_failed_; st++) {
        if (next < FE_MAX_REQS && pd_rng_uniform(&rng) < 0.4) {
            preq_info *q = &info[next];
            q->n = 1 + (int32_t)(pd_rng_next(&rng) % 40);
            int32_t n_shared = (int32_t)(pd_rng_next(&rng) % (uint64_t)(q->n + 1));
            for (int i = 0; i < q->n; i++) q->prompt[i] = i < n_shared ? shared[i] : 1 + (int32_t)(pd_rng_next(&rng) % 97);
            q->max_tokens = 1 + (int32_t)(pd_rng_next(&rng) % 20);
            q->stop = 1 + (int32_t)(pd_rng_next(&rng) % 97);
            uint64_t kind = pd_rng_next(&rng) % 8;  // 1 in 8 remote prefill, 1 in 8 held, 2 in 8 tier
            int32_t n_tier = (kind == 2 || kind == 3) ? (int32_t)(pd_rng_next(&rng) % (uint64_t)(q->n / 4 + 2)) * 4 : 0;
            pd_sched_req_params rp = {.req_id = next, .prompt = q->prompt, .n_prompt = q->n,
                                      .max_tokens = q->max_tokens,
                                      .priority = (int32_t)(pd_rng_next(&rng) % 3),
                                      .stop_ids = &q->stop, .n_stop_ids = 1,
                                      .is_remote_prefill = kind == 0, .is_hold_blocks = kind == 1,
                                      .n_tier_tokens = n_tier};
            pd_status s = fe_add_rp(e, &rp);
            PD_CHECK_EQ(s, PD_OK);
            if (lookahead > 0) PD_CHECK_EQ(pd_sched_set_lookahead(e->s, next, (int32_t)(pd_rng_next(&spec) % (uint64_t)(lookahead + 2))), PD_OK);
            next++;
        }
        if (next > 1 && pd_rng_uniform(&rng) < 0.05) {
            uint64_t id = 1 + pd_rng_next(&rng) % (next - 1);
            if (pd_sched_abort(e->s, id) == PD_OK) e->r[id].aborted = true;
        }
        if (lookahead > 0 && next > 1 && pd_rng_uniform(&spec) < 0.2)  // the policy changes its mind
            (void)pd_sched_set_lookahead(e->s, 1 + pd_rng_next(&spec) % (next - 1), (int32_t)(pd_rng_next(&spec) % (uint64_t)(lookahead + 1)));
        fe_step(e);
    }
    fe_run(e, 5000);
    PD_CHECK(!pd_sched_has_work(e->s));
    int n_done = 0;
    for (uint64_t id = 1; id < next; id++) {
        fe_req *r = &e->r[id];
        if (r->aborted) continue;
        PD_CHECK_MSG(r->finished, "request %llu never finished", (unsigned long long)id);
        if (r->finish == PD_FINISH_ERROR) continue;  // chunking off and outgrew the budget
        n_done++;
        int32_t want[FE_MAX_OUT];
        preq_info *q = &info[id];
        int32_t max_len = pd_kv_n_blocks(e->kv) * 4;
        int32_t n_want = ref_gen(q->prompt, q->n, q->max_tokens, &q->stop, 1, max_len, want);
        PD_CHECK_EQ(r->n_out, n_want);
        for (int32_t i = 0; i < PD_MIN(r->n_out, n_want); i++) PD_CHECK_EQ(r->out[i], want[i]);
    }
    PD_CHECK(n_done > 50);
    PD_CHECK_EQ(pd_kv_n_free(e->kv), n_free0);
    pd_sched_stats st;
    pd_sched_stats_get(e->s, &st);
    prop_spec_accepted += e->n_spec_accepted;
    prop_spec_drafted += e->n_spec_drafted;
    prop_spec_multi += e->n_events_multi;
    if (lookahead == 0) PD_CHECK_EQ(e->n_spec_slots, 0);
    prop_preemptions += st.n_preemptions;
    prop_aborts += st.n_aborted;
    prop_passes += st.n_backfill_passes;
    if (!sp.backfill) PD_CHECK_EQ(st.n_backfill_passes, 0);
    if (getenv("PD_TEST_VERBOSE"))
        fprintf(stderr, "  seed %llu: seqs %d budget %d blocks %d: %lld steps, %d done, %lld preempted, %lld aborted\n",
                (unsigned long long)seed, sp.max_num_seqs, sp.max_num_batched_tokens, pd_kv_n_blocks(e->kv),
                (long long)st.n_steps, n_done, (long long)st.n_preemptions, (long long)st.n_aborted);
    PD_CHECK(e->n_mid_aborts > 0);
    PD_CHECK(e->n_loads_done > 5 && e->n_loads_failed > 0 && e->n_released > 5);
    PD_CHECK_EQ(e->n_loads, 0);
    PD_CHECK_EQ(e->n_tloads, 0);
    PD_CHECK(e->n_tier_done > 5 && e->n_tier_partial > 0 && e->n_tier_tokens_loaded > 0);
    PD_CHECK(e->n_tier_now > 0 && e->n_tier_now_joined > 0);
    PD_CHECK_EQ(st.n_held, 0);
    PD_CHECK_EQ(st.n_loading, 0);
    PD_CHECK_EQ(st.n_tier_loading, 0);
    fe_free(e);
}

static void prop_sched(uint64_t seed, pd_sched_policy policy, bool chunked, bool caching) {
    prop_sched_spec(seed, policy, chunked, caching, 0);
}

// Speculation: lookahead slots, drafts written into them, partial acceptance (rollback by not
// counting the rejected positions) — outputs must still equal the reference token for token,
// with preemption, aborts mid-step, remote prefill, prefix caching on and off.
PD_TEST(property_speculative) {
    prop_preemptions = prop_aborts = prop_spec_accepted = prop_spec_drafted = prop_spec_multi = 0;
    for (uint64_t seed = 41; seed <= 48 && !pd_test_failed_; seed++)
        prop_sched_spec(seed, seed % 2 ? PD_SCHED_FCFS : PD_SCHED_SRPT, seed % 4 != 0, seed % 3 != 0, 1 + (int32_t)(seed % 7));
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
    PD_CHECK(prop_spec_accepted > 100 && prop_spec_accepted < prop_spec_drafted);
    PD_CHECK(prop_spec_multi > 100);
    if (getenv("PD_TEST_VERBOSE"))
        fprintf(stderr, "  speculative: %lld drafted, %lld accepted, %lld multi-token events\n", (long long)prop_spec_drafted,
                (long long)prop_spec_accepted, (long long)prop_spec_multi);
}

PD_TEST(property_fcfs) {
    prop_preemptions = prop_aborts = 0;
    for (uint64_t seed = 1; seed <= 6 && !pd_test_failed_; seed++) prop_sched(seed, PD_SCHED_FCFS, true, true);
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
}
PD_TEST(property_srpt) {
    prop_preemptions = prop_aborts = 0;
    for (uint64_t seed = 11; seed <= 16 && !pd_test_failed_; seed++) prop_sched(seed, PD_SCHED_SRPT, true, true);
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
}
// The step each request of the last plan was first admitted in (computed, or a tier load started).
static void note_admitted(const fe *e, int64_t *admit) {
    const pd_step_plan *pl = &e->last_plan;
    for (int32_t i = 0; i < pl->n_seqs; i++)
        if (admit[pl->seqs[i].req_id] < 0) admit[pl->seqs[i].req_id] = e->step - 1;
    for (int32_t i = 0; i < pl->n_tier_loads; i++)
        if (admit[pl->tier_loads[i].req_id] < 0) admit[pl->tier_loads[i].req_id] = e->step - 1;
}

// SRPT's no-starvation bound with tier hits in the mix: random arrivals, four in five cheap because a
// tier holds most of the prompt (loaded in the admitting step), the rest computed whole. Once a
// request has waited srpt_starvation_us (S steps) it is served in arrival order, so it waits at most
// S + (Q + 1) * D + 1 steps: Q requests were waiting before it when it arrived, and each request in
// the seat ahead of it keeps it at most D = max_tokens steps (one seat, no preemption: the pool
// holds every live request). And the tier hits do go first: on average they wait less.
PD_TEST(property_srpt_tier_no_starvation) {
    for (uint64_t seed = 51; seed <= 56 && !pd_test_failed_; seed++) {
        pd_rng rng;
        pd_rng_seed(&rng, seed);
        pd_sched_params sp = sp_make(1, 64);
        sp.policy = PD_SCHED_SRPT;
        sp.srpt_starvation_us = 20000;  // 20 steps of the harness (1 ms each)
        const int64_t S = 20, D = 3;
        fe *e = fe_new(256, 4, &sp);
        e->is_tier_now = true;
        static preq_info info[FE_MAX_REQS];
        static int64_t arrive[FE_MAX_REQS], admit[FE_MAX_REQS], queued[FE_MAX_REQS];
        static bool is_hit[FE_MAX_REQS];
        uint64_t next = 1;
        int64_t n_late = 0;
        for (int st = 0; st < 400 && !pd_test_failed_; st++) {
            if (next < FE_MAX_REQS && pd_rng_uniform(&rng) < 0.45) {
                preq_info *q = &info[next];
                is_hit[next] = pd_rng_uniform(&rng) < 0.8;
                q->n = is_hit[next] ? 8 + (int32_t)(pd_rng_next(&rng) % 33) : 20 + (int32_t)(pd_rng_next(&rng) % 21);
                for (int i = 0; i < q->n; i++) q->prompt[i] = 1 + (int32_t)(pd_rng_next(&rng) % 97);
                q->max_tokens = 1 + (int32_t)(pd_rng_next(&rng) % D);
                q->stop = 0;  // (tokens are 1..97: never stops early)
                int32_t waiting = 0;
                for (uint64_t id = 1; id < next; id++) waiting += admit[id] < 0;
                pd_sched_req_params rp = {.req_id = next, .prompt = q->prompt, .n_prompt = q->n,
                                          .max_tokens = q->max_tokens, .stop_ids = &q->stop, .n_stop_ids = 1,
                                          .n_tier_tokens = is_hit[next] ? q->n / 4 * 4 : 0};
                PD_CHECK_EQ(fe_add_rp(e, &rp), PD_OK);
                arrive[next] = e->step, admit[next] = -1, queued[next] = waiting;
                next++;
            }
            fe_step(e);
            note_admitted(e, admit);
        }
        for (int st = 0; st < 2000 && pd_sched_has_work(e->s) && !pd_test_failed_; st++) {
            fe_step(e);
            note_admitted(e, admit);
        }
        int64_t hit_wait = 0, miss_wait = 0, n_hit = 0, n_miss = 0;
        for (uint64_t id = 1; id < next && !pd_test_failed_; id++) {
            preq_info *q = &info[id];
            PD_REQUIRE(admit[id] >= 0);
            int64_t wait = admit[id] - arrive[id];
            PD_CHECK_MSG(wait <= S + (queued[id] + 1) * D + 1, "seed %llu request %llu waited %lld steps (%lld ahead)",
                         (unsigned long long)seed, (unsigned long long)id, (long long)wait, (long long)queued[id]);
            n_late += wait > S;
            if (is_hit[id]) hit_wait += wait, n_hit++;
            else miss_wait += wait, n_miss++;
            expect_ref(e, id, q->prompt, q->n, q->max_tokens);
        }
        PD_CHECK(n_hit > 50 && n_miss > 10);
        PD_CHECK(hit_wait * n_miss < miss_wait * n_hit);  // mean wait: tier hits first
        if (getenv("PD_TEST_VERBOSE"))
            fprintf(stderr, "  seed %llu: %llu requests, mean wait hit %.2f / computed %.2f steps, %lld past S\n",
                    (unsigned long long)seed, (unsigned long long)(next - 1), (double)hit_wait / (double)n_hit,
                    (double)miss_wait / (double)n_miss, (long long)n_late);
        fe_free(e);
    }
}
// Backfill admission and tier loads that reserve their computed part, under the same random
// workload (preemption, aborts, remote prefill, held blocks, tier loads async and same-step): every
// output still equals the reference, the pool comes back whole, and backfill did pass blocked ones.
PD_TEST(property_backfill_reserve) {
    prop_preemptions = prop_aborts = prop_passes = 0;
    for (uint64_t seed = 61; seed <= 66 && !pd_test_failed_; seed++) {
        prop_backfill = seed % 4 != 3;
        prop_reserve = seed % 4 != 2;
        prop_sched(seed, seed % 2 ? PD_SCHED_FCFS : PD_SCHED_SRPT, seed % 3 != 0, true);
    }
    prop_backfill = prop_reserve = false;
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
    PD_CHECK(prop_passes > 0);
}
PD_TEST(property_no_chunking) {
    prop_preemptions = prop_aborts = 0;
    for (uint64_t seed = 21; seed <= 24 && !pd_test_failed_; seed++) prop_sched(seed, PD_SCHED_FCFS, false, true);
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
}
PD_TEST(property_no_prefix_caching) {
    prop_preemptions = prop_aborts = 0;
    for (uint64_t seed = 31; seed <= 34 && !pd_test_failed_; seed++) prop_sched(seed, PD_SCHED_SRPT, true, false);
    PD_CHECK(prop_preemptions > 0);
    PD_CHECK(prop_aborts > 0);
}
