// test_kv.c — the KV block manager: free queue link by link, the prefix map, the block hash,
// ref counts, prefix hits, LRU eviction, collision safety, events, and a 10k-operation property
// test that checks every invariant after every operation and models the device KV content so that a
// prefix hit returning wrong tokens is caught.
#include "test.h"

#include <xxhash.h>

#include "base/hash.h"
#include "kv/kv_impl.h"

// ---- helpers ---------------------------------------------------------------------------------------

static pd_kv_mgr *mk(int32_t n_blocks, int32_t bs, bool caching, int32_t n_events,
                     pd_kv_hash_fn fn) {
    pd_kv_params p = pd_kv_params_default();
    p.n_blocks = n_blocks;
    p.block_size = bs;
    p.enable_prefix_caching = caching;
    p.n_events_max = n_events;
    p.hash_fn = fn;
    pd_err err = {0};
    pd_kv_mgr *m = pd_kv_mgr_new(&p, &err);
    PD_CHECK_MSG(m != NULL, "pd_kv_mgr_new: %s", err.msg);
    return m;
}

#define CHECK_KV(m)                                                       \
    do {                                                                  \
        pd_err e_ = {0};                                                  \
        pd_status s_ = pd_kv_check((m), &e_);                             \
        PD_CHECK_MSG(s_ == PD_OK, "pd_kv_check: %s", e_.msg);             \
    } while (0)

// Runs a whole prompt through a seq as the engine would: prefix lookup, allocation, "compute" all,
// cache. Returns the hit in tokens, or -1 when the pool had no room (the seq is then released).
static int32_t run_prompt(pd_kv_mgr *m, pd_kv_seq *seq, const int32_t *toks, int32_t n) {
    int32_t hit = -1;
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, seq, toks, n, &hit), PD_OK);
    pd_status st = pd_kv_alloc_slots(m, seq, hit, n - hit);
    if (st != PD_OK) {
        pd_kv_free_request(m, seq);
        return -1;
    }
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, seq, toks, n), PD_OK);
    return hit;
}

static void seq_done(pd_kv_mgr *m, pd_kv_seq *seq) {
    pd_kv_free_request(m, seq);
    pd_kv_seq_fini(seq);
}

// ---- free queue ------------------------------------------------------------------------------------

// Checks the exact link structure: sentinel -> ids[0] -> ... -> ids[n-1] -> sentinel, both ways.
static void expect_queue(const pd_kv_freeq *q, const int32_t *ids, int32_t n) {
    const pd_kv_block *b = q->blocks;
    int32_t s = q->sentinel;
    PD_CHECK_EQ(q->n, n);
    int32_t prev = s;
    for (int32_t i = 0; i < n; i++) {
        PD_CHECK_EQ(b[prev].next, ids[i]);
        PD_CHECK_EQ(b[ids[i]].prev, prev);
        prev = ids[i];
    }
    PD_CHECK_EQ(b[prev].next, s);
    PD_CHECK_EQ(b[s].prev, prev);
    PD_CHECK_EQ(pd_kv_freeq_head(q), n ? ids[0] : -1);
    PD_CHECK_EQ(pd_kv_freeq_tail(q), n ? ids[n - 1] : -1);
}

PD_TEST(freeq_link_by_link) {
    pd_kv_block blocks[6];
    memset(blocks, 0x55, sizeof blocks);
    pd_kv_freeq q;
    pd_kv_freeq_init(&q, blocks, 5);
    expect_queue(&q, (int32_t[]){0, 1, 2, 3, 4}, 5);
    PD_CHECK_EQ(pd_kv_freeq_next(&q, 0), 1);
    PD_CHECK_EQ(pd_kv_freeq_next(&q, 4), -1);

    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), 0);
    PD_CHECK_EQ(blocks[0].prev, -1);
    PD_CHECK_EQ(blocks[0].next, -1);
    expect_queue(&q, (int32_t[]){1, 2, 3, 4}, 4);

    pd_kv_freeq_remove(&q, 3);  // middle
    PD_CHECK_EQ(blocks[3].prev, -1);
    expect_queue(&q, (int32_t[]){1, 2, 4}, 3);
    pd_kv_freeq_remove(&q, 4);  // tail
    expect_queue(&q, (int32_t[]){1, 2}, 2);
    pd_kv_freeq_push_tail(&q, 0);
    expect_queue(&q, (int32_t[]){1, 2, 0}, 3);
    pd_kv_freeq_remove(&q, 1);  // head
    expect_queue(&q, (int32_t[]){2, 0}, 2);
    pd_kv_freeq_push_tail(&q, 3);
    pd_kv_freeq_push_tail(&q, 4);
    expect_queue(&q, (int32_t[]){2, 0, 3, 4}, 4);
    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), 2);
    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), 0);
    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), 3);
    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), 4);
    expect_queue(&q, NULL, 0);
    PD_CHECK_EQ(pd_kv_freeq_pop_head(&q), -1);  // empty stays well-formed
    expect_queue(&q, NULL, 0);
    pd_kv_freeq_push_tail(&q, 1);
    expect_queue(&q, (int32_t[]){1}, 1);
}

// ---- prefix map ----------------------------------------------------------------------------------

PD_TEST(prefix_map_probe_and_delete) {
    pd_kv_prefix p;
    PD_REQUIRE(pd_kv_prefix_init(&p, 8) == PD_OK);  // 16 slots
    PD_CHECK_EQ(p.map.cap, 16);
    // Keys 0..5 share home slot 3 (a forced pile-up), keys 6, 7 have homes inside that run.
    pd_hash128 k[8];
    for (int i = 0; i < 6; i++) k[i] = (pd_hash128){3 + 16 * (uint64_t)i, (uint64_t)i};
    k[6] = (pd_hash128){4, 100};
    k[7] = (pd_hash128){15, 101};  // wraps: home 15, run continues at 0
    for (int i = 0; i < 8; i++) pd_kv_prefix_insert(&p, k[i], i);
    PD_CHECK_EQ(p.n, 8);
    for (int i = 0; i < 8; i++) PD_CHECK_EQ(pd_kv_prefix_find(&p, k[i]), i);
    PD_CHECK_EQ(pd_kv_prefix_find(&p, (pd_hash128){3, 99}), -1);
    // Delete from the front, the middle and the end of runs; everything else must stay findable.
    int order[8] = {0, 3, 6, 7, 5, 1, 4, 2};
    for (int d = 0; d < 8; d++) {
        pd_kv_prefix_remove(&p, k[order[d]]);
        for (int i = 0; i < 8; i++) {
            bool gone = false;
            for (int e = 0; e <= d; e++) gone |= order[e] == i;
            PD_CHECK_EQ(pd_kv_prefix_find(&p, k[i]), gone ? -1 : i);
        }
    }
    PD_CHECK_EQ(p.n, 0);
    for (size_t i = 0; i < p.map.cap; i++) PD_CHECK(pd_map_slot(&p.map, i) == NULL);
    pd_kv_prefix_fini(&p);
}

// ---- the block hash ------------------------------------------------------------------------------

PD_TEST(hash_definition) {
    int32_t toks[3] = {1, -2, 70000};
    pd_hash128 parent = {0x0123456789abcdefull, 0xfedcba9876543210ull};
    // The definition in hash.h, spelled out byte by byte.
    uint8_t buf[16 + 12];
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(parent.lo >> (8 * i));
    for (int i = 0; i < 8; i++) buf[8 + i] = (uint8_t)(parent.hi >> (8 * i));
    for (int t = 0; t < 3; t++)
        for (int i = 0; i < 4; i++) buf[16 + 4 * t + i] = (uint8_t)((uint32_t)toks[t] >> (8 * i));
    XXH128_hash_t want = XXH3_128bits(buf, sizeof buf);
    pd_hash128 got = pd_hash_block(&parent, toks, 3);
    PD_CHECK(got.lo == want.low64 && got.hi == want.high64);

    pd_hash128 root0 = pd_hash_root(0), root7 = pd_hash_root(7);
    PD_CHECK(pd_hash128_eq(pd_hash_block(NULL, toks, 3), pd_hash_block(&root0, toks, 3)));
    PD_CHECK(!pd_hash128_eq(pd_hash_block(&root7, toks, 3), pd_hash_block(&root0, toks, 3)));
    PD_CHECK(!pd_hash128_eq(pd_hash_root(1), pd_hash_root(2)));
    // Chaining: the parent matters, and so does the token order.
    pd_hash128 h1 = pd_hash_block(NULL, toks, 2);
    PD_CHECK(!pd_hash128_eq(pd_hash_block(&h1, toks, 2), pd_hash_block(NULL, toks, 2)));
    int32_t swapped[2] = {toks[1], toks[0]};
    PD_CHECK(!pd_hash128_eq(pd_hash_block(NULL, swapped, 2), h1));
    // Long blocks go through the staging buffer in several pieces; compare with a one-shot hash.
    int32_t big[600];
    uint8_t bigbuf[16 + 4 * 600] = {0};
    for (int i = 0; i < 600; i++) {
        big[i] = i * 7919;
        for (int j = 0; j < 4; j++) bigbuf[16 + 4 * i + j] = (uint8_t)((uint32_t)big[i] >> (8 * j));
    }
    want = XXH3_128bits(bigbuf, sizeof bigbuf);
    got = pd_hash_block(NULL, big, 600);
    PD_CHECK(got.lo == want.low64 && got.hi == want.high64);
}

// ---- params --------------------------------------------------------------------------------------

PD_TEST(mgr_params) {
    pd_kv_params p = pd_kv_params_default();
    p.n_blocks = 0;
    pd_err err = {0};
    PD_CHECK(pd_kv_mgr_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    p = pd_kv_params_default();
    p.block_size = -1;
    PD_CHECK(pd_kv_mgr_new(&p, NULL) == NULL);
    pd_kv_mgr_free(NULL);
    // Allocation failure at every step of construction: NULL, nothing leaked.
    p = pd_kv_params_default();
    p.n_events_max = 8;
    for (long k = 0; k < 8; k++) {
        size_t n0 = pd_mem_n_allocs();
        pd_mem_fault_set(k, false);
        pd_kv_mgr *m = pd_kv_mgr_new(&p, NULL);
        pd_mem_fault_set(-1, false);
        pd_kv_mgr_free(m);
        PD_CHECK_EQ(pd_mem_n_allocs(), n0);
    }
    pd_mem_fault_n_failed();
}

// ---- ref counts, allocation, hits ----------------------------------------------------------------

PD_TEST(alloc_touch_free_refcounts) {
    pd_kv_mgr *m = mk(8, 4, true, 0, NULL);
    PD_REQUIRE(m);
    int32_t toks[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    pd_kv_seq a, b;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    PD_CHECK_EQ(run_prompt(m, &a, toks, 10), 0);  // 3 blocks, 2 full
    PD_CHECK_EQ(a.n_blocks, 3);
    PD_CHECK_EQ(pd_kv_n_used(m), 3);
    PD_CHECK_EQ(pd_kv_n_free(m), 5);
    for (int i = 0; i < 3; i++) PD_CHECK_EQ(pd_kv_block_ref(m, a.block_ids[i]), 1);
    // b shares the 2 full blocks: ref 2 on them, a private third block.
    PD_CHECK_EQ(run_prompt(m, &b, toks, 12), 8);
    PD_CHECK_EQ(b.n_blocks, 3);
    PD_CHECK_EQ(b.block_ids[0], a.block_ids[0]);
    PD_CHECK_EQ(b.block_ids[1], a.block_ids[1]);
    PD_CHECK(b.block_ids[2] != a.block_ids[2]);
    PD_CHECK_EQ(pd_kv_block_ref(m, a.block_ids[0]), 2);
    PD_CHECK_EQ(pd_kv_block_ref(m, a.block_ids[2]), 1);
    PD_CHECK_EQ(pd_kv_n_used(m), 4);
    CHECK_KV(m);
    pd_kv_free_request(m, &a);
    PD_CHECK_EQ(pd_kv_block_ref(m, b.block_ids[0]), 1);
    PD_CHECK_EQ(pd_kv_n_used(m), 3);
    PD_CHECK_EQ(pd_kv_n_cached(m), 0);  // a's partial block was never cached
    CHECK_KV(m);
    pd_kv_free_request(m, &b);
    PD_CHECK_EQ(pd_kv_n_free(m), 8);
    PD_CHECK_EQ(pd_kv_n_cached(m), 3);  // 2 shared full blocks + b's third (full at 12 tokens)
    CHECK_KV(m);
    // A NOSPACE allocation changes nothing.
    pd_kv_seq_fini(&a);
    pd_kv_seq_init(&a, 0);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 0, 33), PD_NOSPACE);
    PD_CHECK_EQ(a.n_blocks, 0);
    PD_CHECK_EQ(pd_kv_n_free(m), 8);
    PD_CHECK_EQ(pd_kv_n_cached(m), 3);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 0, 32), PD_OK);  // exactly the pool, evicting all 3
    PD_CHECK_EQ(pd_kv_n_free(m), 0);
    PD_CHECK_EQ(pd_kv_n_cached(m), 0);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_evictions, 3);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 30, 2), PD_OK);  // already covered: no allocation
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 32, 1), PD_NOSPACE);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, -1, 1), PD_ERR_INVALID);
    CHECK_KV(m);
    seq_done(m, &a);
    pd_kv_seq_fini(&b);
    pd_kv_mgr_free(m);
}

PD_TEST(prefix_hits_across_requests) {
    pd_kv_mgr *m = mk(64, 4, true, 0, NULL);
    PD_REQUIRE(m);
    int32_t base[40], other[40];
    for (int i = 0; i < 40; i++) base[i] = 1000 + i, other[i] = 1000 + i;
    other[22] = 7;  // diverges inside block 5
    pd_kv_seq a, b, c, d;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    pd_kv_seq_init(&c, 0);
    pd_kv_seq_init(&d, 0);
    PD_CHECK_EQ(run_prompt(m, &a, base, 40), 0);
    PD_CHECK_EQ(run_prompt(m, &b, other, 40), 20);  // blocks 0..4
    // The whole prompt cached: the last block is still recomputed (39 / 4 = 9 blocks).
    PD_CHECK_EQ(run_prompt(m, &c, base, 40), 36);
    // Shorter than one block: nothing to look up.
    PD_CHECK_EQ(run_prompt(m, &d, base, 4), 0);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_query_tokens, 40 + 40 + 40 + 4);
    PD_CHECK_EQ(st.n_hit_tokens, 20 + 36);
    PD_CHECK_EQ(st.n_query_blocks, 9 + 9 + 9 + 0);
    PD_CHECK_EQ(st.n_hit_blocks, 5 + 9);
    PD_CHECK_EQ(st.n_collisions, 0);
    // An extra key (LoRA id) separates caches.
    pd_kv_seq e;
    pd_kv_seq_init(&e, 42);
    PD_CHECK_EQ(run_prompt(m, &e, base, 40), 0);
    CHECK_KV(m);
    seq_done(m, &a);
    seq_done(m, &b);
    seq_done(m, &c);
    seq_done(m, &d);
    seq_done(m, &e);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

PD_TEST(partial_block_never_cached) {
    pd_kv_mgr *m = mk(16, 4, true, 16, NULL);
    PD_REQUIRE(m);
    int32_t toks[11] = {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    pd_kv_seq a;
    pd_kv_seq_init(&a, 0);
    int32_t hit;
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &a, toks, 11, &hit), PD_OK);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 0, 6), PD_OK);  // a chunk of 6: 2 blocks
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &a, toks, 6), PD_OK);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_cached_total, 1);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 6, 5), PD_OK);
    PD_CHECK_EQ(a.n_blocks, 3);
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &a, toks, 11), PD_OK);
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_cached_total, 2);  // block 2 holds 3 of 4 tokens: not cached
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &a, toks, 11), PD_OK);  // idempotent
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &a, toks, 16), PD_ERR_INVALID);  // table too short
    pd_kv_event ev[16];
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 16), 2);
    PD_CHECK_EQ(ev[0].block_id, a.block_ids[0]);  // STORED names the block (tier offload reads it)
    PD_CHECK_EQ(ev[1].block_id, a.block_ids[1]);
    seq_done(m, &a);
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_cached, 2);
    PD_CHECK_EQ(st.n_free, 16);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

PD_TEST(eviction_lru_tail_first) {
    pd_kv_mgr *m = mk(4, 2, true, 32, NULL);
    PD_REQUIRE(m);
    int32_t toks[7] = {1, 2, 3, 4, 5, 6, 9};
    pd_kv_seq a, b, c;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    pd_kv_seq_init(&c, 0);
    PD_CHECK_EQ(run_prompt(m, &a, toks, 6), 0);  // blocks 0, 1, 2 (all full and cached)
    PD_CHECK_EQ(a.block_ids[0], 0);
    PD_CHECK_EQ(a.block_ids[2], 2);
    seq_done(m, &a);
    // Released last-first: the queue is [3 (never used), 2, 1, 0].
    expect_queue(&m->freeq, (int32_t[]){3, 2, 1, 0}, 4);
    PD_CHECK_EQ(pd_kv_n_cached(m), 3);
    CHECK_KV(m);
    pd_kv_event ev[32];
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 32), 3);
    // Two blocks for something unrelated: takes 3, then evicts 2 (the tail of a's sequence).
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &b, 0, 4), PD_OK);
    PD_CHECK_EQ(b.block_ids[0], 3);
    PD_CHECK_EQ(b.block_ids[1], 2);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 32), 1);
    PD_CHECK_EQ(ev[0].type, PD_KV_EVENT_REMOVED);
    pd_hash128 h0 = pd_hash_block(NULL, toks, 2), h1 = pd_hash_block(&h0, toks + 2, 2);
    pd_hash128 h2 = pd_hash_block(&h1, toks + 4, 2);
    PD_CHECK(pd_hash128_eq(ev[0].hash, h2));
    // The head of a's sequence is still there.
    // c hits blocks 0, 1 but finds no free block for its third: NOSPACE, and it lets go again.
    PD_CHECK_EQ(run_prompt(m, &c, toks, 7), -1);
    PD_CHECK_EQ(c.n_blocks, 0);
    PD_CHECK_EQ(pd_kv_n_cached(m), 2);
    CHECK_KV(m);
    seq_done(m, &b);
    PD_CHECK_EQ(run_prompt(m, &c, toks, 7), 4);  // released and retried: now it fits
    PD_CHECK_EQ(c.n_blocks, 4);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_evictions, 1);
    seq_done(m, &c);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

// ---- collisions ---------------------------------------------------------------------------------

// Degenerate hash functions for the collision hook.
static pd_hash128 hash_const(const pd_hash128 *parent, const int32_t *tokens, int n) {
    return (pd_hash128){42, 42};
}
static pd_hash128 hash_tokens_only(const pd_hash128 *parent, const int32_t *tokens, int n) {
    return pd_hash_block(NULL, tokens, n);  // ignores the parent: same block, any prefix collides
}
static pd_hash128 hash_sum_mod(const pd_hash128 *parent, const int32_t *tokens, int n) {
    uint64_t s = (parent ? parent->lo : 0);
    for (int i = 0; i < n; i++) s += (uint64_t)tokens[i];
    return (pd_hash128){s % 5, 0};  // five possible values: collisions everywhere
}

PD_TEST(collision_content_rejected) {
    pd_kv_mgr *m = mk(16, 2, true, 0, hash_const);
    PD_REQUIRE(m);
    int32_t x[5] = {1, 2, 3, 4, 0}, y[5] = {5, 6, 3, 4, 0};
    pd_kv_seq a, b;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    PD_CHECK_EQ(run_prompt(m, &a, x, 5), 0);
    PD_CHECK_EQ(run_prompt(m, &b, y, 5), 0);  // same hash, other tokens: no hit
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK(st.n_collisions >= 1);
    PD_CHECK_EQ(st.n_cached_total, 1);  // one entry per hash value
    CHECK_KV(m);
    seq_done(m, &a);
    seq_done(m, &b);
    // The extra key is compared exactly, even when the hash cannot tell keys apart.
    pd_kv_seq_init(&a, 1);
    pd_kv_seq_init(&b, 2);
    pd_kv_reset_prefix_cache(m);
    PD_CHECK_EQ(run_prompt(m, &a, x, 5), 0);
    PD_CHECK_EQ(run_prompt(m, &b, x, 5), 0);
    seq_done(m, &a);
    seq_done(m, &b);
    pd_kv_mgr_free(m);
}

PD_TEST(collision_parent_rejected) {
    // Hash of a block's tokens only: [1,2 | 5,6] and [3,4 | 5,6] collide on their second block.
    pd_kv_mgr *m = mk(16, 2, true, 0, hash_tokens_only);
    PD_REQUIRE(m);
    int32_t a_t[5] = {1, 2, 5, 6, 0}, c_t[5] = {3, 4, 7, 8, 0}, b_t[5] = {3, 4, 5, 6, 0};
    pd_kv_seq a, b, c;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    pd_kv_seq_init(&c, 0);
    PD_CHECK_EQ(run_prompt(m, &a, a_t, 5), 0);
    PD_CHECK_EQ(run_prompt(m, &c, c_t, 5), 0);  // caches [3,4] as a first block
    // b: block 0 [3,4] is c's (a true hit); block 1 [5,6] is found under its hash but hangs off
    // a's [1,2]: taking it would give b the KV of "1 2 5 6". Must stop at one block.
    PD_CHECK_EQ(run_prompt(m, &b, b_t, 5), 2);
    PD_CHECK_EQ(b.block_ids[0], c.block_ids[0]);
    PD_CHECK(b.block_ids[1] != a.block_ids[1]);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK(st.n_collisions >= 1);
    CHECK_KV(m);
    seq_done(m, &a);
    seq_done(m, &b);
    seq_done(m, &c);
    pd_kv_mgr_free(m);
}

PD_TEST(parent_generation_rejected) {
    // Parent evicted and its id reused for the same tokens: a stale child must not chain on.
    pd_kv_mgr *m = mk(3, 2, true, 0, NULL);
    PD_REQUIRE(m);
    int32_t t[5] = {1, 2, 3, 4, 0};
    pd_kv_seq a, b, c;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    pd_kv_seq_init(&c, 0);
    PD_CHECK_EQ(run_prompt(m, &a, t, 5), 0);  // blocks 0 [1,2] and 1 [3,4] cached, 2 partial
    pd_kv_free_request(m, &a);                 // queue [2, 1, 0]
    // Reorder to [0, 2, 1]: the parent becomes the LRU head, which the API never does (children
    // are always released first), so that its id is reused while its child is still cached.
    pd_kv_freeq_remove(&m->freeq, 2);
    pd_kv_freeq_push_tail(&m->freeq, 2);
    pd_kv_freeq_remove(&m->freeq, 1);
    pd_kv_freeq_push_tail(&m->freeq, 1);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &b, 0, 2), PD_OK);
    PD_CHECK_EQ(b.block_ids[0], 0);  // evicted and reallocated: a new generation
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &b, t, 2), PD_OK);  // same tokens, cached again
    // c: block 0 matches the new [1,2]; block 1 [3,4] is cached under the right hash but hangs
    // off (0, old generation), so it must not be taken.
    PD_CHECK_EQ(run_prompt(m, &c, t, 5), 2);
    PD_CHECK_EQ(c.block_ids[0], 0);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_collisions, 1);
    seq_done(m, &b);
    seq_done(m, &c);
    pd_kv_seq_fini(&a);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

PD_TEST(duplicate_blocks_chain_through_canonical) {
    pd_kv_mgr *m = mk(32, 2, true, 0, NULL);
    PD_REQUIRE(m);
    int32_t a_t[5] = {1, 2, 3, 4, 9}, b_t[7] = {1, 2, 3, 4, 5, 6, 9};
    pd_kv_seq a, b, c;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    pd_kv_seq_init(&c, 0);
    int32_t hit;
    // Both admitted before either computed anything: no hits, private blocks.
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &a, a_t, 5, &hit), PD_OK);
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &b, b_t, 7, &hit), PD_OK);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &a, 0, 5), PD_OK);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &b, 0, 7), PD_OK);
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &a, a_t, 5), PD_OK);
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &b, b_t, 7), PD_OK);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_cached_total, 3);  // a's 2 blocks + b's [5,6]; b's first two are duplicates
    seq_done(m, &a);
    // c = b's prompt: chains through a's canonical blocks into b's third block.
    PD_CHECK_EQ(run_prompt(m, &c, b_t, 7), 6);
    PD_CHECK_EQ(c.block_ids[2], b.block_ids[2]);
    CHECK_KV(m);
    seq_done(m, &b);
    seq_done(m, &c);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

// ---- modes, events, reset ------------------------------------------------------------------------

PD_TEST(no_prefix_caching) {
    pd_kv_mgr *m = mk(8, 2, false, 8, NULL);
    PD_REQUIRE(m);
    int32_t t[7] = {1, 2, 3, 4, 5, 6, 7};
    pd_kv_seq a, b;
    pd_kv_seq_init(&a, 0);
    pd_kv_seq_init(&b, 0);
    PD_CHECK_EQ(run_prompt(m, &a, t, 7), 0);
    PD_CHECK_EQ(run_prompt(m, &b, t, 7), 0);
    PD_CHECK_EQ(a.n_hashes, 0);  // nothing hashed at all
    PD_CHECK_EQ(pd_kv_n_used(m), 8);
    seq_done(m, &a);
    seq_done(m, &b);
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK_EQ(st.n_cached, 0);
    PD_CHECK_EQ(st.n_cached_total, 0);
    PD_CHECK_EQ(st.n_hit_tokens, 0);
    PD_CHECK(!pd_kv_is_prefix_caching(m));
    pd_kv_event ev[8];
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 0);
    PD_CHECK_EQ(pd_kv_reset_prefix_cache(m), 0);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

PD_TEST(events_stored_removed_overflow) {
    pd_kv_mgr *m = mk(4, 2, true, 4, NULL);
    PD_REQUIRE(m);
    int32_t t[7] = {1, 2, 3, 4, 5, 6, 7};
    pd_kv_seq a;
    pd_kv_seq_init(&a, 0);
    PD_CHECK_EQ(run_prompt(m, &a, t, 7), 0);
    pd_kv_event ev[8];
    pd_hash128 h0 = pd_hash_block(NULL, t, 2), h1 = pd_hash_block(&h0, t + 2, 2);
    pd_hash128 h2 = pd_hash_block(&h1, t + 4, 2);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 2), 2);  // partial drain
    PD_CHECK_EQ(ev[0].type, PD_KV_EVENT_STORED);
    PD_CHECK(pd_hash128_eq(ev[0].hash, h0));
    PD_CHECK(pd_hash128_eq(ev[0].parent_hash, pd_hash_root(0)));
    PD_CHECK_EQ(ev[0].n_tokens, 2);
    PD_CHECK(pd_hash128_eq(ev[1].hash, h1));
    PD_CHECK(pd_hash128_eq(ev[1].parent_hash, h0));
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 1);
    PD_CHECK(pd_hash128_eq(ev[0].hash, h2));
    PD_CHECK(pd_hash128_eq(ev[0].parent_hash, h1));
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 0);
    seq_done(m, &a);
    // Evict all three with one 8-token allocation: 3 REMOVED, oldest-released (h2) first.
    pd_kv_seq b;
    pd_kv_seq_init(&b, 0);
    PD_CHECK_EQ(pd_kv_alloc_slots(m, &b, 0, 8), PD_OK);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 3);
    PD_CHECK_EQ(ev[0].type, PD_KV_EVENT_REMOVED);
    PD_CHECK(pd_hash128_eq(ev[0].hash, h2));
    PD_CHECK(pd_hash128_eq(ev[1].hash, h1));
    PD_CHECK(pd_hash128_eq(ev[2].hash, h0));
    // Overflow: 4 stored events fit; the 5th replaces them with ALL_CLEARED + itself.
    int32_t u[9] = {10, 11, 12, 13, 14, 15, 16, 17, 0};
    PD_CHECK_EQ(pd_kv_cache_full_blocks(m, &b, u, 8), PD_OK);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 4);
    seq_done(m, &b);
    pd_kv_seq_init(&b, 0);
    int32_t v[9] = {20, 21, 22, 23, 24, 25, 26, 27, 0};
    PD_CHECK_EQ(run_prompt(m, &b, v, 9), -1);  // 5 blocks > 4: NOSPACE, nothing allocated
    // Evicts 4 (4 REMOVED fill the ring), then 4 STORED: the 1st overflows -> [CLEARED, S1], S2, S3
    // fill it again, S4 overflows -> [CLEARED, S4].
    PD_CHECK_EQ(run_prompt(m, &b, v, 8), 0);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 2);
    PD_CHECK_EQ(ev[0].type, PD_KV_EVENT_ALL_CLEARED);
    PD_CHECK_EQ(ev[1].type, PD_KV_EVENT_STORED);
    PD_CHECK(pd_hash128_eq(ev[1].hash, b.block_hashes[3]));
    pd_kv_stats st;
    pd_kv_stats_get(m, &st);
    PD_CHECK(st.n_events_dropped > 0);
    // Reset: cached entries go, one ALL_CLEARED, blocks in use keep working.
    PD_CHECK_EQ(pd_kv_reset_prefix_cache(m), 4);
    PD_CHECK_EQ(pd_kv_events_drain(m, ev, 8), 1);
    PD_CHECK_EQ(ev[0].type, PD_KV_EVENT_ALL_CLEARED);
    CHECK_KV(m);
    seq_done(m, &b);
    PD_CHECK_EQ(pd_kv_n_cached(m), 0);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

PD_TEST(seq_oom_is_clean) {
    pd_kv_mgr *m = mk(64, 4, true, 0, NULL);
    PD_REQUIRE(m);
    int32_t t[100];
    for (int i = 0; i < 100; i++) t[i] = i;
    pd_kv_seq a, b;
    pd_kv_seq_init(&a, 0);
    PD_CHECK_EQ(run_prompt(m, &a, t, 100), 0);
    // get_computed_blocks must fail before touching anything.
    pd_kv_seq_init(&b, 0);
    pd_mem_fault_set(0, true);
    int32_t hit = -1;
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &b, t, 100, &hit), PD_ERR_NOMEM);
    pd_mem_fault_set(-1, false);
    PD_CHECK_EQ(b.n_blocks, 0);
    PD_CHECK_EQ(pd_kv_n_used(m), 25);
    CHECK_KV(m);
    // Hashes computed, table allocation fails.
    pd_mem_fault_set(1, false);
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &b, t, 100, &hit), PD_ERR_NOMEM);
    pd_mem_fault_set(-1, false);
    PD_CHECK_EQ(b.n_blocks, 0);
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &b, t, 100, &hit), PD_OK);
    PD_CHECK_EQ(hit, 96);
    PD_CHECK_EQ(pd_kv_get_computed_blocks(m, &b, t, 100, &hit), PD_ERR_INVALID);  // not empty
    pd_mem_fault_n_failed();
    seq_done(m, &a);
    seq_done(m, &b);
    CHECK_KV(m);
    pd_kv_mgr_free(m);
}

// ---- property test ---------------------------------------------------------------------------------

// A model of the engine on top of kv: requests with token histories, a shadow of the device KV
// (what token each block slot holds), and the expected ref count of every block.
#define P_REQS 24
#define P_BS 4
#define P_BLOCKS 48
#define P_MAXTOK 96

typedef struct preq {
    bool live;
    pd_kv_seq seq;
    int32_t toks[P_MAXTOK];
    int32_t n_toks, n_computed;
} preq;

typedef struct pmodel {
    pd_kv_mgr *m;
    preq r[P_REQS];
    int32_t shadow[P_BLOCKS][P_BS];  // token computed into each slot, -1 = garbage
    int32_t bases[4][P_MAXTOK];      // shared prefixes
    pd_rng rng;
    int n_hits, n_nospace;
} pmodel;

static int32_t rnd(pmodel *pm, int32_t n) { return (int32_t)(pd_rng_next(&pm->rng) % (uint64_t)n); }

// Blocks referenced by live requests must have exactly that many refs.
static void check_refs(pmodel *pm) {
    int32_t want[P_BLOCKS] = {0};
    for (int i = 0; i < P_REQS; i++)
        if (pm->r[i].live)
            for (int32_t j = 0; j < pm->r[i].seq.n_blocks; j++) want[pm->r[i].seq.block_ids[j]]++;
    for (int32_t b = 0; b < P_BLOCKS; b++) PD_CHECK_EQ(pd_kv_block_ref(pm->m, b), want[b]);
}

static void op_new(pmodel *pm, preq *q) {
    q->n_toks = 1 + rnd(pm, 48);
    const int32_t *base = pm->bases[rnd(pm, 4)];
    int32_t shared = rnd(pm, q->n_toks + 1);
    for (int32_t i = 0; i < q->n_toks; i++) q->toks[i] = i < shared ? base[i] : rnd(pm, 6);
    pd_kv_seq_init(&q->seq, (uint64_t)rnd(pm, 2));
    int32_t hit = -1;
    PD_CHECK_EQ(pd_kv_get_computed_blocks(pm->m, &q->seq, q->toks, q->n_toks, &hit), PD_OK);
    PD_CHECK(hit >= 0 && hit < q->n_toks && hit % P_BS == 0);
    // A hit must hand back blocks whose device content is exactly this request's tokens.
    for (int32_t p = 0; p < hit; p++)
        PD_CHECK_EQ(pm->shadow[q->seq.block_ids[p / P_BS]][p % P_BS], q->toks[p]);
    pm->n_hits += hit > 0;
    q->n_computed = hit;
    q->live = true;
}

// Computes a chunk (prefill) or the pending token, then possibly samples one more token.
static void op_step(pmodel *pm, preq *q) {
    int32_t remaining = q->n_toks - q->n_computed;
    if (remaining == 0) {
        if (q->n_toks == P_MAXTOK) return;
        q->toks[q->n_toks++] = rnd(pm, 6);  // a sampled token, not yet computed
        return;
    }
    int32_t n_new = 1 + rnd(pm, remaining);
    pd_status st = pd_kv_alloc_slots(pm->m, &q->seq, q->n_computed, n_new);
    if (st == PD_NOSPACE) {
        pm->n_nospace++;
        return;
    }
    PD_CHECK_EQ(st, PD_OK);
    for (int32_t p = q->n_computed; p < q->n_computed + n_new; p++) {
        int32_t b = q->seq.block_ids[p / P_BS];
        PD_CHECK_EQ(pd_kv_block_ref(pm->m, b), 1);  // never write into a shared block
        pm->shadow[b][p % P_BS] = q->toks[p];
    }
    q->n_computed += n_new;
    PD_CHECK_EQ(pd_kv_cache_full_blocks(pm->m, &q->seq, q->toks, q->n_computed), PD_OK);
}

static void prop_run(pd_kv_hash_fn fn, bool caching, uint64_t seed) {
    static pmodel pm;
    memset(&pm, 0, sizeof pm);
    memset(pm.shadow, 0xff, sizeof pm.shadow);
    pd_rng_seed(&pm.rng, seed);
    pm.m = mk(P_BLOCKS, P_BS, caching, 16, fn);
    PD_REQUIRE(pm.m);
    for (int b = 0; b < 4; b++)
        for (int i = 0; i < P_MAXTOK; i++) pm.bases[b][i] = rnd(&pm, 6);
    pd_kv_event ev[16];
    for (int it = 0; it < 10000; it++) {
        preq *q = &pm.r[rnd(&pm, P_REQS)];
        int32_t op = rnd(&pm, 10);
        if (!q->live) {
            op_new(&pm, q);
        } else if (op < 7) {
            op_step(&pm, q);
        } else if (op < 9) {
            pd_kv_free_request(pm.m, &q->seq);  // finish, or preemption
            if (op == 8) {
                pd_kv_seq_fini(&q->seq);
                q->live = false;
            } else {
                int32_t hit = -1;  // re-admission of a preempted request
                PD_CHECK_EQ(pd_kv_get_computed_blocks(pm.m, &q->seq, q->toks, q->n_toks, &hit), PD_OK);
                for (int32_t p = 0; p < hit; p++)
                    PD_CHECK_EQ(pm.shadow[q->seq.block_ids[p / P_BS]][p % P_BS], q->toks[p]);
                q->n_computed = hit;
            }
        } else if (rnd(&pm, 50) == 0) {
            pd_kv_reset_prefix_cache(pm.m);
        } else {
            pd_kv_events_drain(pm.m, ev, 1 + rnd(&pm, 16));
        }
        pd_err err = {0};
        if (pd_kv_check(pm.m, &err) != PD_OK) {
            PD_FAIL_("op %d: %s", it, err.msg);
            break;
        }
        check_refs(&pm);
        if (pd_test_failed_) break;
    }
    for (int i = 0; i < P_REQS; i++)
        if (pm.r[i].live) seq_done(pm.m, &pm.r[i].seq);
    PD_CHECK_EQ(pd_kv_n_free(pm.m), P_BLOCKS);
    CHECK_KV(pm.m);
    if (caching) PD_CHECK_MSG(pm.n_hits > 100, "only %d requests hit the cache", pm.n_hits);
    PD_CHECK_MSG(pm.n_nospace > 10, "pool never ran out (%d)", pm.n_nospace);
    pd_kv_mgr_free(pm.m);
}

PD_TEST(property_random_ops) { prop_run(NULL, true, 1); }
PD_TEST(property_random_ops_colliding_hash) { prop_run(hash_sum_mod, true, 2); }
PD_TEST(property_random_ops_tokens_only_hash) { prop_run(hash_tokens_only, true, 3); }
PD_TEST(property_random_ops_no_caching) { prop_run(NULL, false, 4); }
