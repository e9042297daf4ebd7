// test_router_core.c — the router's pure parts: the prefix index (against a brute-force model
// under random churn), prompt hashing (same chain as kv/), the routing cost and pick, TTFT/TPOT
// prediction, QoS config / class selection / reserved capacity, and the token bucket.
#include "router/core_impl.h"
#include "test.h"

// ---- prefix index ---------------------------------------------------------------------------------
PD_TEST(prefix_add_remove_match) {
    pd_router_prefix *p = pd_router_prefix_new(1000);
    PD_REQUIRE(p);
    int32_t toks[64];
    for (int i = 0; i < 64; i++) toks[i] = i * 7 + 1;
    pd_hash128 h[4];
    PD_CHECK_EQ(pd_router_hash_prompt(toks, 64, 16, h), 4);
    PD_CHECK_EQ(pd_router_hash_prompt(toks, 63, 16, h), 3);  // only full blocks
    pd_router_hash_prompt(toks, 64, 16, h);
    // worker 0 holds 3 blocks, worker 5 holds 1, worker 9 holds blocks 1..3 but not 0
    for (int i = 0; i < 3; i++) PD_CHECK_EQ(pd_router_prefix_add(p, h[i], 0), PD_OK);
    pd_router_prefix_add(p, h[0], 5);
    for (int i = 1; i < 4; i++) pd_router_prefix_add(p, h[i], 9);
    PD_CHECK_EQ(pd_router_prefix_n_entries(p), 4);
    int32_t nb[64];
    pd_router_prefix_match(p, h, 4, ~0ull, nb);
    PD_CHECK_EQ(nb[0], 3);
    PD_CHECK_EQ(nb[5], 1);
    PD_CHECK_EQ(nb[9], 0);  // chained: without block 0 nothing counts
    PD_CHECK_EQ(nb[1], 0);
    pd_router_prefix_match(p, h, 4, 1ull << 5, nb);  // mask restricts
    PD_CHECK_EQ(nb[0], 0);
    PD_CHECK_EQ(nb[5], 1);
    pd_router_prefix_remove(p, h[1], 0);
    pd_router_prefix_match(p, h, 4, ~0ull, nb);
    PD_CHECK_EQ(nb[0], 1);
    pd_router_prefix_clear_worker(p, 9);
    PD_CHECK_EQ(pd_router_prefix_get(p, h[3]), 0);
    PD_CHECK_EQ(pd_router_prefix_get(p, h[0]), (1ull << 0) | (1ull << 5));
    PD_CHECK_EQ(pd_router_prefix_n_entries(p), 2);  // h0 (0,5), h2 (0)
    pd_router_prefix_free(p);
    pd_router_prefix_free(NULL);
}

PD_TEST(prefix_hashes_match_kv_chain) {
    // h_0 = H(root(0) || block 0), h_i = H(h_{i-1} || block i): what kv/ publishes in its events
    int32_t toks[48];
    for (int i = 0; i < 48; i++) toks[i] = 1000 - i;
    pd_hash128 h[3];
    pd_router_hash_prompt(toks, 48, 16, h);
    pd_hash128 root = pd_hash_root(0);
    pd_hash128 e0 = pd_hash_block(&root, toks, 16);
    pd_hash128 e1 = pd_hash_block(&e0, toks + 16, 16);
    PD_CHECK(pd_hash128_eq(h[0], e0));
    PD_CHECK(pd_hash128_eq(h[1], e1));
}

PD_TEST(prefix_random_churn_vs_model) {
    // Small key space → long probe runs and many backward shifts; compare with a plain array.
    enum { K = 300, W = 6 };
    pd_router_prefix *p = pd_router_prefix_new(100000);
    PD_REQUIRE(p);
    static uint64_t model[K];
    memset(model, 0, sizeof model);
    pd_hash128 keys[K];
    pd_rng rng;
    pd_rng_seed(&rng, 42);
    for (int i = 0; i < K; i++) {
        keys[i].lo = pd_rng_next(&rng) & 0x3ff;  // collide on purpose in the low bits
        keys[i].hi = (uint64_t)i;
    }
    for (int step = 0; step < 20000; step++) {
        int k = (int)(pd_rng_next(&rng) % K), w = (int)(pd_rng_next(&rng) % W);
        int op = (int)(pd_rng_next(&rng) % 10);
        if (op < 6) {
            pd_router_prefix_add(p, keys[k], w);
            model[k] |= 1ull << w;
        } else if (op < 9) {
            pd_router_prefix_remove(p, keys[k], w);
            model[k] &= ~(1ull << w);
        } else if (step % 50 == 0) {
            pd_router_prefix_clear_worker(p, w);
            for (int i = 0; i < K; i++) model[i] &= ~(1ull << w);
        }
        if (step % 500 == 0 || step == 19999) {
            int64_t n = 0;
            bool ok = true;
            for (int i = 0; i < K; i++) {
                n += model[i] != 0;
                ok &= pd_router_prefix_get(p, keys[i]) == model[i];
            }
            PD_CHECK_MSG(ok, "index differs from model at step %d", step);
            PD_CHECK_EQ(pd_router_prefix_n_entries(p), n);
        }
    }
    pd_router_prefix_free(p);
}

PD_TEST(prefix_bounded) {
    pd_router_prefix *p = pd_router_prefix_new(2);
    pd_hash128 a = {1, 1}, b = {2, 2}, c = {3, 3};
    PD_CHECK_EQ(pd_router_prefix_add(p, a, 0), PD_OK);
    PD_CHECK_EQ(pd_router_prefix_add(p, b, 0), PD_OK);
    PD_CHECK_EQ(pd_router_prefix_add(p, c, 0), PD_NOSPACE);
    PD_CHECK_EQ(pd_router_prefix_add(p, a, 1), PD_OK);  // existing key: still fine
    PD_CHECK_EQ(pd_router_prefix_get(p, c), 0);
    pd_router_prefix_free(p);
}

// ---- cost, pick, predictions --------------------------------------------------------------------------
static pd_router_cand cand(int idx, int prompt, int hit, int run, int wait, int64_t queued) {
    pd_router_cand c = {.idx = idx, .n_prompt_tokens = prompt, .n_hit_tokens = hit, .n_running = run,
                        .n_waiting = wait, .n_queued_prefill_tokens = queued, .kv_free_frac = 0.5,
                        .prefill_tokens_per_s = 1000, .decode_step_ms = 10};
    return c;
}

PD_TEST(cost_formula) {
    pd_router_cost_params p = pd_router_cost_params_default();
    pd_router_cand c = cand(0, 500, 200, 2, 1, 100);
    c.n_inflight = 3;
    double want = 1.0 * (300 + 100) + 16 * 2 + 64 * 1 + 16 * 3;
    PD_CHECK_NEAR(pd_router_cost(&p, &c), want, 1e-9);
    c.kv_free_frac = 0.05;
    PD_CHECK_NEAR(pd_router_cost(&p, &c), want + 4096, 1e-9);
    p.use_prefix = false;  // "load" routing ignores hits
    c.kv_free_frac = 0.5;
    PD_CHECK_NEAR(pd_router_cost(&p, &c), want + 200, 1e-9);
    c.n_hit_tokens = 900;  // a hit longer than the prompt never makes the cost negative
    p.use_prefix = true;
    PD_CHECK(pd_router_cost(&p, &c) >= 0);
}

PD_TEST(pick_prefers_cache_but_not_a_queue) {
    pd_router_cost_params p = pd_router_cost_params_default();
    pd_router_cand c[3] = {cand(0, 512, 0, 1, 0, 0), cand(1, 512, 448, 1, 0, 0), cand(2, 512, 0, 1, 0, 0)};
    PD_CHECK_EQ(pd_router_pick(&p, c, 3, 0), 1);  // the cached worker wins
    c[1].n_waiting = 10;                           // ... unless it has a queue
    PD_CHECK(pd_router_pick(&p, c, 3, 0) != 1);
    // ties rotate with tie_start
    pd_router_cand t[3] = {cand(0, 10, 0, 0, 0, 0), cand(1, 10, 0, 0, 0, 0), cand(2, 10, 0, 0, 0, 0)};
    PD_CHECK_EQ(pd_router_pick(&p, t, 3, 0), 0);
    PD_CHECK_EQ(pd_router_pick(&p, t, 3, 1), 1);
    PD_CHECK_EQ(pd_router_pick(&p, t, 3, 5), 2);
    PD_CHECK_EQ(pd_router_pick(&p, t, 0, 0), -1);
}

PD_TEST(predictions) {
    pd_router_cand c = cand(0, 600, 100, 4, 2, 1500);
    // (1500 + 500) / 1000 tok/s = 2000 ms, plus a 12.5 ms step (batch 4 → 5) × (1 + 2 waiting)
    PD_CHECK_NEAR(pd_router_predict_ttft_ms(&c), 2037.5, 1e-6);
    // 10 ms at batch 4 → 12.5 ms at batch 5
    PD_CHECK_NEAR(pd_router_predict_tpot_ms(&c), 12.5, 1e-9);
    c.n_running = 0;
    PD_CHECK_NEAR(pd_router_predict_tpot_ms(&c), 10, 1e-9);
    c = cand(0, 100, 100, 0, 0, 0);  // fully cached, idle: one step
    PD_CHECK_NEAR(pd_router_predict_ttft_ms(&c), 10, 1e-9);
    c.ttft_ms_per_inflight = 40;  // observed: 40 ms per request in flight
    c.n_inflight = 9;
    PD_CHECK_NEAR(pd_router_predict_ttft_ms(&c), 400, 1e-9);
    c.n_inflight = 0;
    PD_CHECK_NEAR(pd_router_predict_ttft_ms(&c), 40, 1e-9);  // the larger of the two
}

// ---- QoS -----------------------------------------------------------------------------------------------
PD_TEST(qos_parse_and_select) {
    pd_router_qos q;
    pd_err err = {0};
    const char *cfg = "{\"classes\":["
                      "{\"name\":\"premium\",\"priority\":10,\"reserved_fraction\":0.3,\"slo_ttft_ms\":200},"
                      "{\"name\":\"standard\",\"priority\":5},"
                      "{\"name\":\"free\",\"priority\":0,\"rate_limit_rps\":2}],"
                      "\"default_class\":\"free\",\"capacity_per_worker\":8,"
                      "\"api_keys\":{\"sk-gold\":\"premium\",\"sk-std\":{\"class\":\"standard\"}}}";
    PD_REQUIRE(pd_router_qos_parse(&q, cfg, 1000, 50, &err) == PD_OK);
    PD_CHECK_EQ(q.n_classes, 3);
    PD_CHECK_EQ(q.capacity_per_worker, 8);
    PD_CHECK_NEAR(q.classes[0].slo_ttft_ms, 200, 0);
    PD_CHECK_NEAR(q.classes[1].slo_ttft_ms, 1000, 0);  // inherited from the flags
    PD_CHECK_NEAR(q.classes[2].slo_tpot_ms, 50, 0);
    PD_CHECK_NEAR(q.classes[2].rate_burst, 2, 0);
    PD_CHECK_EQ(pd_router_qos_select(&q, NULL, NULL), 2);         // default
    PD_CHECK_EQ(pd_router_qos_select(&q, NULL, "sk-gold"), 0);    // by key
    PD_CHECK_EQ(pd_router_qos_select(&q, NULL, "sk-std"), 1);
    PD_CHECK_EQ(pd_router_qos_select(&q, "free", "sk-gold"), 2);  // header wins
    PD_CHECK_EQ(pd_router_qos_select(&q, "bogus", "sk-nope"), 2);
    const char *bad[] = {
        "{", "{\"classes\":[]}", "{\"classes\":[{\"priority\":1}]}",
        "{\"classes\":[{\"name\":\"a\",\"reserved_fraction\":0.7},{\"name\":\"b\",\"reserved_fraction\":0.7}]}",
        "{\"classes\":[{\"name\":\"a\"},{\"name\":\"a\"}]}",
        "{\"default_class\":\"gold\"}", "{\"api_keys\":{\"k\":\"gold\"}}", "{\"capacity_per_worker\":0}",
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++)
        PD_CHECK_MSG(pd_router_qos_parse(&q, bad[i], 0, 0, &err) == PD_ERR_INVALID, "accepted %s", bad[i]);
    pd_router_qos_default(&q, 0, 0);
    PD_CHECK_EQ(pd_router_qos_find(&q, "premium"), 0);
    PD_CHECK_EQ(pd_router_qos_select(&q, NULL, NULL), 1);  // standard
}

PD_TEST(qos_default_reserves_nothing) {
    // Without a --qos-config no class holds capacity back: a full pool of standard requests
    // may use every seat (issue 18: a 20% premium reserve refused load one worker handled).
    pd_router_qos q;
    pd_router_qos_default(&q, 0, 0);
    PD_CHECK_EQ(q.capacity_per_worker, 0);
    int inflight[PD_ROUTER_MAX_CLASSES] = {0};
    inflight[1] = 9;
    PD_CHECK(pd_router_qos_admit(&q, 1, inflight, 10));
    inflight[1] = 10;
    PD_CHECK(!pd_router_qos_admit(&q, 1, inflight, 10));
}

PD_TEST(worker_capacity_and_room) {
    PD_CHECK_EQ(pd_router_worker_capacity(64, 4096, 0), 4160);
    PD_CHECK_EQ(pd_router_worker_capacity(64, 0, 0), 64);
    PD_CHECK_EQ(pd_router_worker_capacity(0, 4096, 0), 0);  // no report: unknown
    PD_CHECK_EQ(pd_router_worker_capacity(64, 4096, 8), 8);  // the config's override
    pd_router_cand c = {0};
    PD_CHECK(pd_router_has_room(&c));  // unknown capacity refuses nothing
    c.n_capacity = 4;
    c.n_inflight = 3;
    PD_CHECK(pd_router_has_room(&c));
    c.n_inflight = 4;
    PD_CHECK(!pd_router_has_room(&c));
    c.n_inflight = 1;  // plus load from other clients (other routers, direct requests)
    c.n_foreign = 3;
    PD_CHECK(!pd_router_has_room(&c));
    c.n_foreign = 2;
    PD_CHECK(pd_router_has_room(&c));
    c.n_running = 50;  // a stale report of our own requests does not count
    c.n_waiting = 50;
    PD_CHECK(pd_router_has_room(&c));
    c.n_kv_blocks_total = 100;
    c.n_blocks_needed = 101;  // can never fit there
    PD_CHECK(!pd_router_has_room(&c));
    c.n_blocks_needed = 100;
    PD_CHECK(pd_router_has_room(&c));
}

PD_TEST(qos_reserved_capacity) {
    pd_router_qos q;
    pd_router_qos_default(&q, 0, 0);
    q.classes[0].reserved_frac = 0.2;  // as a --qos-config would set it
    int inflight[PD_ROUTER_MAX_CLASSES] = {0};
    // capacity 10: premium keeps 2 slots, so free/standard may fill 8
    inflight[2] = 7;
    PD_CHECK(pd_router_qos_admit(&q, 2, inflight, 10));
    inflight[2] = 8;
    PD_CHECK(!pd_router_qos_admit(&q, 2, inflight, 10));  // lower classes rejected first
    PD_CHECK(!pd_router_qos_admit(&q, 1, inflight, 10));
    PD_CHECK(pd_router_qos_admit(&q, 0, inflight, 10));   // premium still gets in
    inflight[0] = 1;
    PD_CHECK(pd_router_qos_admit(&q, 0, inflight, 10));
    inflight[0] = 2;
    PD_CHECK(!pd_router_qos_admit(&q, 0, inflight, 10));  // the pool is full
    // premium using its share frees nothing for others; premium beyond its share competes
    inflight[0] = 5;
    inflight[2] = 4;
    PD_CHECK(pd_router_qos_admit(&q, 2, inflight, 10));
}

PD_TEST(token_bucket) {
    pd_router_bucket b = {0};
    int64_t t = 1000000;
    int n = 0;
    for (int i = 0; i < 10; i++) n += pd_router_bucket_take(&b, 2, 3, t);
    PD_CHECK_EQ(n, 3);  // the burst
    PD_CHECK(!pd_router_bucket_take(&b, 2, 3, t + 100000));  // 0.2 tokens refilled
    PD_CHECK(pd_router_bucket_take(&b, 2, 3, t + 600000));   // 1.2
    PD_CHECK(!pd_router_bucket_take(&b, 2, 3, t + 600000));
    PD_CHECK(pd_router_bucket_take(&b, 2, 3, t + 100000000));  // capped at burst, not 200
    PD_CHECK(pd_router_bucket_take(&b, 2, 3, t + 100000000));
    PD_CHECK(pd_router_bucket_take(&b, 2, 3, t + 100000000));
    PD_CHECK(!pd_router_bucket_take(&b, 2, 3, t + 100000000));
    PD_CHECK(pd_router_bucket_take(&b, 0, 0, t));  // unlimited
}

// KV tiers below a worker's pool: a block in a tier extends the worker's match (tiers only add
// to the device hit), is dropped when that tier evicts it (not when another tier or the device
// pool does), and the cost prices those tokens at the measured load time.
PD_TEST(prefix_tiers_and_cost) {
    pd_router_prefix *p = pd_router_prefix_new(1000);
    PD_REQUIRE(p);
    pd_hash128 h[4];
    int32_t tk[64];
    for (int i = 0; i < 64; i++) tk[i] = i + 7;
    PD_CHECK_EQ(pd_router_hash_prompt(tk, 64, 16, h), 4);
    PD_CHECK_EQ(pd_router_prefix_add(p, h[0], 1), PD_OK);        // device: block 0
    for (int i = 0; i < 3; i++) PD_CHECK_EQ(pd_router_prefix_add_tier(p, h[i], 1, 1), PD_OK);  // dram: 0..2
    PD_CHECK_EQ(pd_router_prefix_add_tier(p, h[2], 1, 2), PD_OK);  // and block 2 on disk too
    PD_CHECK_EQ(pd_router_prefix_add_tier(p, h[0], 2, 3), PD_OK);  // worker 2: block 0 in Redis
    int32_t dev[64], any[64];
    pd_router_prefix_match(p, h, 4, ~0ull, dev);
    pd_router_prefix_match_tiers(p, h, 4, ~0ull, any);
    PD_CHECK_EQ(dev[1], 1);
    PD_CHECK_EQ(any[1], 3);
    PD_CHECK_EQ(dev[2], 0);
    PD_CHECK_EQ(any[2], 1);
    static int64_t cnt[64][4];
    pd_router_prefix_count(p, cnt);  // what /status.json shows per worker
    PD_CHECK(cnt[1][0] == 1 && cnt[1][1] == 3 && cnt[1][2] == 1 && cnt[1][3] == 0);
    PD_CHECK(cnt[2][0] == 0 && cnt[2][1] == 0 && cnt[2][2] == 0 && cnt[2][3] == 1);
    PD_CHECK(cnt[0][0] + cnt[0][1] + cnt[0][2] + cnt[0][3] + cnt[63][0] == 0);
    pd_router_prefix_remove_tier(p, h[0], 2, 3);  // Redis evicted it (keyspace notification)
    pd_router_prefix_count(p, cnt);
    PD_CHECK(cnt[2][3] == 0 && cnt[1][1] == 3);
    PD_CHECK_EQ(pd_router_prefix_add_tier(p, h[0], 2, 3), PD_OK);
    pd_router_prefix_remove_tier(p, h[2], 1, 1);  // DRAM evicted block 2: still on disk
    pd_router_prefix_match_tiers(p, h, 4, ~0ull, any);
    PD_CHECK_EQ(any[1], 3);
    pd_router_prefix_remove_tier(p, h[2], 1, 2);  // and the disk: gone
    pd_router_prefix_match_tiers(p, h, 4, ~0ull, any);
    PD_CHECK_EQ(any[1], 2);
    pd_router_prefix_remove(p, h[0], 1);  // the device pool evicted block 0: the tier still has it
    pd_router_prefix_match_tiers(p, h, 4, ~0ull, any);
    PD_CHECK_EQ(any[1], 2);
    PD_CHECK_EQ(pd_router_prefix_get(p, h[0]), 0);
    PD_CHECK_EQ(pd_router_prefix_get_tiers(p, h[0]), (1ull << 1) | (1ull << 2));
    pd_router_prefix_clear_worker(p, 1);
    pd_router_prefix_clear_worker(p, 2);
    PD_CHECK_EQ(pd_router_prefix_n_entries(p), 0);  // nothing left: every entry deleted
    pd_router_prefix_free(p);

    // Cost: 512 prompt tokens, 128 on the device, 256 in a tier. Prefill at 10,000 tokens/s (100
    // us a token), loads at 10 us a token: a tier token costs 0.1 of a computed one.
    pd_router_cost_params cp = pd_router_cost_params_default();
    pd_router_cand c = {.n_prompt_tokens = 512, .n_hit_tokens = 128, .n_tier_hit_tokens = 256,
                        .kv_free_frac = 1, .prefill_tokens_per_s = 10000, .tier_us_per_token = 10};
    PD_CHECK_NEAR(pd_router_cost(&cp, &c), 128 + 256 * 0.1, 1e-9);
    c.tier_us_per_token = 0;  // unmeasured: priced as computing, never free
    PD_CHECK_NEAR(pd_router_cost(&cp, &c), 384, 1e-9);
    c.tier_us_per_token = 500;  // slower than computing: capped at computing
    PD_CHECK_NEAR(pd_router_cost(&cp, &c), 384, 1e-9);
    c.tier_us_per_token = 10;
    c.n_tier_hit_tokens = 1000;  // longer than the rest of the prompt: clamped
    PD_CHECK_NEAR(pd_router_cost(&cp, &c), 384 * 0.1, 1e-9);
    // A worker with the prefix in DRAM beats one that must compute it, but not one holding it on
    // the device.
    pd_router_cand w[3] = {
        {.idx = 0, .n_prompt_tokens = 512, .kv_free_frac = 1, .prefill_tokens_per_s = 10000},
        {.idx = 1, .n_prompt_tokens = 512, .n_tier_hit_tokens = 496, .kv_free_frac = 1, .prefill_tokens_per_s = 10000,
         .tier_us_per_token = 10},
        {.idx = 2, .n_prompt_tokens = 512, .n_hit_tokens = 496, .kv_free_frac = 1, .prefill_tokens_per_s = 10000},
    };
    PD_CHECK_EQ(pd_router_pick(&cp, w, 2, 0), 1);
    PD_CHECK_EQ(pd_router_pick(&cp, w, 3, 0), 2);
    PD_CHECK(pd_router_predict_ttft_ms(&w[1]) < pd_router_predict_ttft_ms(&w[0]));
}
