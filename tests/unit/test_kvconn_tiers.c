// test_kvconn_tiers.c — the tier connector's staged path (kvconn/tier.c: pinned staging slots, one
// batched pd_op_kv_copy_xfer per poll / per load, transfer-stream fences) with a bf16 cache, the
// CUDA backend's KV layout, run on the cpu backend (PDSERVE_KV_TIER_STAGING=1; its copies are
// synchronous and its fences done at once). Blocks saved, then loaded back into other blocks of the
// pool: every row of every layer, K and V, must come back bit-exact — through the DRAM tier's bf16
// pages (no float round trip) and through a disk tier's f32 pages (the float path).
#include "test.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "backend/backend.h"
#include "kvconn/kvconn.h"

enum { L = 4, H = 2, D = 16, BS = 4, NB = 8 };
#define ROWB ((size_t)H * D * 2)
#define BLKB ((size_t)BS * ROWB)

typedef struct evbox {
    pthread_mutex_t mu;
    pd_kvconn_event *ev;
    int n_overwritten;  // events that arrived while one was still unread (checked on the main thread)
} evbox;

// Runs on the tier thread: no PD_CHECK here (the check counters belong to the main thread).
static void on_event(void *ud, pd_kvconn_event *ev) {
    evbox *b = ud;
    pthread_mutex_lock(&b->mu);
    if (b->ev) b->n_overwritten++;
    b->ev = ev;
    pthread_mutex_unlock(&b->mu);
}

static pd_kvconn_event *wait_event(evbox *b) {
    for (int i = 0; i < 5000; i++) {
        pthread_mutex_lock(&b->mu);
        pd_kvconn_event *ev = b->ev;
        int n_over = b->n_overwritten;
        b->ev = NULL;
        pthread_mutex_unlock(&b->mu);
        PD_CHECK_EQ(n_over, 0);
        if (ev) return ev;
        usleep(1000);
    }
    return NULL;
}

static pd_kvconn_event *wait_event_brief(evbox *b) {  // 50 ms
    for (int i = 0; i < 50; i++) {
        pthread_mutex_lock(&b->mu);
        pd_kvconn_event *ev = b->ev;
        b->ev = NULL;
        pthread_mutex_unlock(&b->mu);
        if (ev) return ev;
        usleep(1000);
    }
    return NULL;
}

static void roundtrip(const char *label, uint64_t dram, const char *disk_dir, const char *dtype) {
    setenv("PDSERVE_KV_TIER_STAGING", "1", 1);
    pd_backend *be = pd_backend_cpu_new(1);
    PD_REQUIRE(be);
    void *k[L], *v[L];
    for (int l = 0; l < L; l++) {
        k[l] = calloc(NB, BLKB);
        v[l] = calloc(NB, BLKB);
        uint16_t *kk = k[l], *vv = v[l];
        for (size_t i = 0; i < NB * BLKB / 2; i++) {  // random finite bf16 values
            kk[i] = pd_f32_to_bf16((float)((int)(rand() % 20001) - 10000) * 1e-3f);
            vv[i] = pd_f32_to_bf16((float)((int)(rand() % 20001) - 10000) * 7e-4f);
        }
    }
    evbox box = {.mu = PTHREAD_MUTEX_INITIALIZER};
    pd_kvconn_tier_params p = {.dram_bytes = dram, .disk_dir = disk_dir, .disk_bytes = disk_dir ? 1 << 20 : 0,
                               .dtype = dtype, .backend = be, .on_event = on_event, .ud = &box};
    p.fp = (pd_kvw_fingerprint){.arch = 1, .n_layers = L, .n_heads = 4, .n_kv_heads = H, .head_dim = D, .hidden = 64,
                                .vocab = 100, .kv_dtype = PD_DTYPE_BF16, .block_size = BS, .weights_hash = 42};
    p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NB, .block_size = BS, .row_bytes = ROWB, .k = k, .v = v};
    pd_err err = {0};
    pd_kvconn_tiers *c = pd_kvconn_tiers_new(&p, &err);
    PD_REQUIRE(c);
    pd_kvconn_tiers_stats st;
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK(st.staging_slots > 0);
    // Blocks 0, 1, 2 (a chain) saved in one batch; then loaded into blocks 5, 6, 7.
    pd_hash128 hs[3];
    pd_hash128 prev = pd_hash_root(0);
    for (int b = 0; b < 3; b++) {
        int32_t toks[BS] = {b, b + 1, b + 2, b + 3};
        hs[b] = pd_hash_block(b ? &prev : NULL, toks, BS);
        pd_kvconn_tiers_save(c, b, hs[b], prev);
        prev = hs[b];
    }
    pd_kvconn_tiers_poll(c);
    PD_CHECK(pd_kvconn_tiers_flush(c, 10000));
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK_EQ(st.offloads_done, 3);
    PD_CHECK_EQ(st.offloads_dropped, 0);
    PD_CHECK_EQ(pd_kvconn_tiers_match(c, hs, 3, NULL, NULL), 3);
    int32_t dst[3] = {5, 6, 7};
    PD_CHECK_EQ(pd_kvconn_tiers_start_load(c, 9, hs, dst, 3), PD_OK);
    pd_kvconn_event *ev = wait_event(&box);
    PD_REQUIRE(ev);
    PD_CHECK_EQ(ev->kind, PD_KVCONN_EV_TIER_LOADED);
    PD_CHECK_EQ(ev->req_id, 9);
    PD_CHECK_EQ(ev->n_blocks, 3);
    pd_kvconn_tiers_loaded(c, ev);  // the upload (synchronous here), its slots freed at the next poll
    pd_kvconn_event_fini(ev);
    pd_free(ev);
    pd_kvconn_tiers_poll(c);
    for (int b = 0; b < 3; b++)
        for (int l = 0; l < L; l++) {
            PD_CHECK(memcmp((char *)k[l] + (size_t)b * BLKB, (char *)k[l] + (size_t)dst[b] * BLKB, BLKB) == 0);
            PD_CHECK(memcmp((char *)v[l] + (size_t)b * BLKB, (char *)v[l] + (size_t)dst[b] * BLKB, BLKB) == 0);
        }
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK_EQ(st.load_blocks, 3);
    // Loaded within the step (pd_kvconn_tiers_load_now): only from the hot DRAM tier and only whole:
    // a chain with a block no tier holds does nothing; the held chain is one copy, no event.
    const char *hot_env = getenv("PDSERVE_KV_TIER_HOT");
    int hot = dram && !(hot_env && !strcmp(hot_env, "0")) ? 3 : 0;
    pd_hash128 hs4[4] = {hs[0], hs[1], hs[2], pd_hash_block(&hs[2], (int32_t[BS]){77, 78, 79, 80}, BS)};
    int32_t dst4[4] = {3, 4, 5, 6}, bad[3] = {3, NB, 5};
    for (int b = 0; b < 4; b++)
        for (int l = 0; l < L; l++) {
            memset((char *)k[l] + (size_t)dst4[b] * BLKB, 0, BLKB);
            memset((char *)v[l] + (size_t)dst4[b] * BLKB, 0, BLKB);
        }
    PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs4, dst4, 4), 0);
    PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, bad, 3), 0);  // a block outside the pool
    PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, dst4, 3), hot);
    // Layer-wise (the default): queued, copied at the step's commit, one layer at a time.
    const char *lw_env = getenv("PDSERVE_KV_TIER_LAYERWISE");
    bool lw = hot && !(lw_env && !strcmp(lw_env, "0"));
    if (lw) {
        uint8_t zero[BLKB];
        memset(zero, 0, sizeof zero);
        PD_CHECK(memcmp((char *)k[0] + (size_t)dst4[0] * BLKB, zero, BLKB) == 0);  // not copied yet
    }
    PD_CHECK_EQ(pd_kvconn_tiers_load_now_commit(c, true), lw ? L : 0);
    const char *jit_env = getenv("PDSERVE_KV_TIER_JIT");
    const char *grp_env = getenv("PDSERVE_KV_TIER_LAYERWISE");
    int grp = grp_env && atoi(grp_env) > 0 ? atoi(grp_env) : 1;
    if (lw && jit_env && !strcmp(jit_env, "1") && grp < L) {
        // Just in time: the commit copied the first layer group only; each wait copies up to its layer.
        uint8_t zero[BLKB];
        memset(zero, 0, sizeof zero);
        PD_CHECK(memcmp((char *)k[0] + (size_t)dst4[0] * BLKB, (char *)k[0], BLKB) == 0);
        PD_CHECK(memcmp((char *)k[grp] + (size_t)dst4[0] * BLKB, zero, BLKB) == 0);
        // No same-step load joins an open just-in-time commit (it would be unpinned uncopied).
        PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, (int32_t[3]){0, 1, 2}, 3), 0);
        pd_kvconn_tiers_layer_wait(c, grp - 1);
        PD_CHECK(memcmp((char *)v[grp] + (size_t)dst4[0] * BLKB, zero, BLKB) == 0);
        pd_kvconn_tiers_layer_wait(c, grp);
        PD_CHECK(memcmp((char *)v[grp] + (size_t)dst4[0] * BLKB, (char *)v[grp], BLKB) == 0);
    }
    for (int l = 0; l < L; l++) pd_kvconn_tiers_layer_wait(c, l);
    pd_kvconn_tiers_step_end(c);
    PD_CHECK_EQ(pd_kvconn_tiers_load_now_commit(c, true), 0);  // nothing queued any more
    pd_kvconn_tiers_poll(c);
    for (int b = 0; b < hot; b++)
        for (int l = 0; l < L; l++) {
            PD_CHECK(memcmp((char *)k[l] + (size_t)b * BLKB, (char *)k[l] + (size_t)dst4[b] * BLKB, BLKB) == 0);
            PD_CHECK(memcmp((char *)v[l] + (size_t)b * BLKB, (char *)v[l] + (size_t)dst4[b] * BLKB, BLKB) == 0);
        }
    PD_CHECK(wait_event_brief(&box) == NULL);  // no event for a load ended at once
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK_EQ(st.load_blocks, 3 + hot);
    PD_CHECK_EQ(st.samestep_layerwise, lw ? 1 : 0);
    PD_CHECK_EQ(st.samestep_fenced, 0);
    if (hot) {
        // A layer-wise commit the compute did not wait for in full (a step that failed after layer
        // 0): fenced at the step's end. A hookless step (layerwise false): one copy, one fence.
        PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, dst4, 3), 3);
        PD_CHECK_EQ(pd_kvconn_tiers_load_now_commit(c, true), lw ? L : 0);
        pd_kvconn_tiers_layer_wait(c, 0);
        pd_kvconn_tiers_layer_wait(c, L - 1);  // (out of order: not counted)
        pd_kvconn_tiers_step_end(c);
        PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, dst4 + 1, 3), 3);
        PD_CHECK_EQ(pd_kvconn_tiers_load_now_commit(c, false), 0);
        pd_kvconn_tiers_step_end(c);
        PD_CHECK_EQ(pd_kvconn_tiers_load_now(c, hs, dst4, 3), 3);  // never committed: at step end
        pd_kvconn_tiers_step_end(c);
        pd_kvconn_tiers_poll(c);
        for (int b = 0; b < 3; b++)
            for (int l = 0; l < L; l++)
                PD_CHECK(memcmp((char *)v[l] + (size_t)b * BLKB, (char *)v[l] + (size_t)dst4[b] * BLKB, BLKB) == 0);
        pd_kvconn_tiers_stats_get(c, &st);
        PD_CHECK_EQ(st.samestep_commits, lw ? 4 : 0);
        PD_CHECK_EQ(st.samestep_layerwise, lw ? 2 : 0);
        PD_CHECK_EQ(st.samestep_fenced, lw && L > 1 ? 1 : 0);
        PD_CHECK_EQ(st.load_blocks, 3 + 4 * hot);
    }
    printf("  %s: 3 blocks saved and loaded back bit-exact (%d staging slots), %d loaded within the step\n", label,
           st.staging_slots, hot);
    pd_kvconn_tiers_free(c);
    for (int l = 0; l < L; l++) free(k[l]), free(v[l]);
    pd_backend_free(be);
    unsetenv("PDSERVE_KV_TIER_STAGING");
}

PD_TEST(staged_bf16_cache_dram_bf16_pages) { roundtrip("dram (bf16 pages)", 1 << 20, NULL, NULL); }

PD_TEST(staged_bf16_cache_disk_f32_pages) {
    char dir[] = "/tmp/pd_kvconn_tiers_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    roundtrip("disk (f32 pages)", 0, dir, "f32");
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    PD_CHECK_EQ(system(cmd), 0);
}

PD_TEST(staged_refuses_an_fp8_cache) {
    setenv("PDSERVE_KV_TIER_STAGING", "1", 1);
    pd_backend *be = pd_backend_cpu_new(1);
    PD_REQUIRE(be);
    void *k[L] = {0}, *v[L] = {0};
    pd_kvconn_tier_params p = {.dram_bytes = 1 << 20, .backend = be, .on_event = on_event};
    p.fp = (pd_kvw_fingerprint){.n_layers = L, .n_kv_heads = H, .head_dim = D, .kv_dtype = PD_DTYPE_FP8_E4M3, .block_size = BS};
    p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NB, .block_size = BS, .row_bytes = 48, .k = k, .v = v};
    pd_err err = {0};
    PD_CHECK(pd_kvconn_tiers_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_UNSUPPORTED);
    PD_CHECK(strstr(err.msg, "--kv-offload") != NULL);
    pd_backend_free(be);
    unsetenv("PDSERVE_KV_TIER_STAGING");
}

// The DRAM tier of a device cache is "hot" (kvconn/tier.c): its pages are the staged rows
// themselves. PDSERVE_KV_TIER_HOT=0 puts it back into the kvtier chain (encoded bf16 pages).
PD_TEST(staged_bf16_cache_dram_in_chain_when_hot_off) {
    setenv("PDSERVE_KV_TIER_HOT", "0", 1);
    roundtrip("dram in the chain (hot off)", 1 << 20, NULL, NULL);
    unsetenv("PDSERVE_KV_TIER_HOT");
}

// A small hot DRAM tier (4 blocks) over a disk tier: 12 blocks saved in 3 drains; DRAM keeps at
// most 4 and writes every page it evicts back to disk (pinned while a tier worker encodes it,
// freed after). Every block then loads back bit-exact from whichever tier holds it; repeated
// saves of a held block copy nothing.
PD_TEST(staged_hot_dram_writes_back_to_disk) {
    setenv("PDSERVE_KV_TIER_STAGING", "1", 1);
    enum { NP = 16, NS = 12 };
    char dir[] = "/tmp/pd_kvconn_hot_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_backend *be = pd_backend_cpu_new(1);
    PD_REQUIRE(be);
    void *k[L], *v[L];
    for (int l = 0; l < L; l++) {
        k[l] = calloc(NP, BLKB);
        v[l] = calloc(NP, BLKB);
        uint16_t *kk = k[l], *vv = v[l];
        for (size_t i = 0; i < NP * BLKB / 2; i++) {
            kk[i] = pd_f32_to_bf16((float)((int)(rand() % 20001) - 10000) * 1e-3f);
            vv[i] = pd_f32_to_bf16((float)((int)(rand() % 20001) - 10000) * 7e-4f);
        }
    }
    evbox box = {.mu = PTHREAD_MUTEX_INITIALIZER};
    size_t per = 2 * (size_t)L * BLKB;
    pd_kvconn_tier_params p = {.dram_bytes = 4 * per, .disk_dir = dir, .disk_bytes = 1 << 20, .dtype = "bf16",
                               .backend = be, .on_event = on_event, .ud = &box};
    p.fp = (pd_kvw_fingerprint){.arch = 1, .n_layers = L, .n_heads = 4, .n_kv_heads = H, .head_dim = D, .hidden = 64,
                                .vocab = 100, .kv_dtype = PD_DTYPE_BF16, .block_size = BS, .weights_hash = 42};
    p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NP, .block_size = BS, .row_bytes = ROWB, .k = k, .v = v};
    pd_err err = {0};
    pd_kvconn_tiers *c = pd_kvconn_tiers_new(&p, &err);
    PD_REQUIRE(c);
    pd_hash128 hs[NS], par[NS];
    pd_hash128 prev = pd_hash_root(0);
    for (int b = 0; b < NS; b++) {
        int32_t toks[BS] = {b, b + 1, b + 2, b + 3};
        hs[b] = pd_hash_block(b ? &prev : NULL, toks, BS);
        par[b] = prev;
        prev = hs[b];
    }
    for (int d = 0; d < 3; d++) {
        for (int b = 4 * d; b < 4 * d + 4; b++) pd_kvconn_tiers_save(c, b, hs[b], par[b]);
        pd_kvconn_tiers_poll(c);  // (the cpu backend's copies are done at once: resident here)
        pd_kvconn_tiers_poll(c);
    }
    pd_kvconn_tiers_save(c, 11, hs[11], par[11]);  // held: nothing copied
    pd_kvconn_tiers_poll(c);
    PD_CHECK(pd_kvconn_tiers_flush(c, 10000));
    pd_kvconn_tiers_stats st;
    pd_kvconn_tiers_stats_get(c, &st);
    PD_REQUIRE(st.n_tiers == 2);
    PD_CHECK(strcmp(st.tier[0].name, "dram") == 0 && strcmp(st.tier[1].name, "disk") == 0);
    PD_CHECK_EQ(st.tier[0].puts, NS);
    PD_CHECK(st.tier[0].n_items <= 4);
    PD_CHECK_EQ(st.tier[0].evictions, NS - st.tier[0].n_items);
    PD_CHECK_EQ(st.tier[1].puts, st.tier[0].evictions);  // every victim written back
    PD_CHECK_EQ(st.offloads_dropped, 0);
    int n_stored = 0, n_removed = 0;
    pd_kvconn_tier_event tev[64];
    int ne;
    while ((ne = pd_kvconn_tiers_events_drain(c, tev, 64)) > 0)
        for (int i = 0; i < ne; i++) {
            if (tev[i].kind == PD_KVCONN_TIER_DRAM) *(tev[i].is_stored ? &n_stored : &n_removed) += 1;
        }
    PD_CHECK_EQ(n_stored, NS);
    PD_CHECK_EQ(n_removed, st.tier[0].evictions);
    // Every block, one load each, into block 12 + b % 4: bit-exact from DRAM or disk.
    for (int b = 0; b < NS; b++) {
        PD_CHECK_EQ(pd_kvconn_tiers_match(c, &hs[b], 1, NULL, NULL), 1);
        int32_t dst = 12 + b % 4;
        PD_REQUIRE(pd_kvconn_tiers_start_load(c, 100 + (uint64_t)b, &hs[b], &dst, 1) == PD_OK);
        pd_kvconn_event *ev = wait_event(&box);
        PD_REQUIRE(ev);
        PD_CHECK_EQ(ev->n_blocks, 1);
        pd_kvconn_tiers_loaded(c, ev);
        pd_kvconn_event_fini(ev);
        pd_free(ev);
        pd_kvconn_tiers_poll(c);
        for (int l = 0; l < L; l++) {
            PD_CHECK(memcmp((char *)k[l] + (size_t)b * BLKB, (char *)k[l] + (size_t)dst * BLKB, BLKB) == 0);
            PD_CHECK(memcmp((char *)v[l] + (size_t)b * BLKB, (char *)v[l] + (size_t)dst * BLKB, BLKB) == 0);
        }
    }
    // The whole chain: DRAM's leading blocks, then the disk's, in one load.
    int m = pd_kvconn_tiers_match(c, hs, NS, NULL, NULL);
    PD_CHECK(m >= 1);
    int32_t dst4[4] = {12, 13, 14, 15};
    int nl = m < 4 ? m : 4;
    PD_REQUIRE(pd_kvconn_tiers_start_load(c, 200, hs, dst4, nl) == PD_OK);
    pd_kvconn_event *ev = wait_event(&box);
    PD_REQUIRE(ev);
    PD_CHECK_EQ(ev->n_blocks, nl);
    pd_kvconn_tiers_loaded(c, ev);
    pd_kvconn_event_fini(ev);
    pd_free(ev);
    pd_kvconn_tiers_poll(c);
    for (int b = 0; b < nl; b++)
        for (int l = 0; l < L; l++) {
            PD_CHECK(memcmp((char *)k[l] + (size_t)b * BLKB, (char *)k[l] + (size_t)dst4[b] * BLKB, BLKB) == 0);
            PD_CHECK(memcmp((char *)v[l] + (size_t)b * BLKB, (char *)v[l] + (size_t)dst4[b] * BLKB, BLKB) == 0);
        }
    pd_kvconn_tiers_stats_get(c, &st);
    printf("  hot DRAM (4 blocks) + disk: %lld DRAM evictions written back, %lld DRAM hits, %lld disk hits; "
           "a %d-block chain matched\n",
           (long long)st.tier[0].evictions, (long long)st.tier[0].hits, (long long)st.tier[1].hits, m);
    PD_CHECK(st.tier[0].hits > 0 && st.tier[1].hits > 0);
    pd_kvconn_tiers_free(c);
    for (int l = 0; l < L; l++) free(k[l]), free(v[l]);
    pd_backend_free(be);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    PD_CHECK_EQ(system(cmd), 0);
    unsetenv("PDSERVE_KV_TIER_STAGING");
}

// The hot DRAM tier hears of every reuse a match reports, not only of its own loads: a root block
// that requests keep asking for (served by the device pool, so never loaded from DRAM) stays while
// blocks nobody asks for again are evicted around it (S3-FIFO would drop it first: it is the oldest,
// never hit). Without that, every chain through the root would be lost to a match.
PD_TEST(staged_hot_dram_match_counts_as_reuse) {
    setenv("PDSERVE_KV_TIER_STAGING", "1", 1);
    enum { NP = 8, NX = 12 };
    pd_backend *be = pd_backend_cpu_new(1);
    PD_REQUIRE(be);
    void *k[L], *v[L];
    for (int l = 0; l < L; l++) k[l] = calloc(NP, BLKB), v[l] = calloc(NP, BLKB);
    evbox box = {.mu = PTHREAD_MUTEX_INITIALIZER};
    size_t per = 2 * (size_t)L * BLKB;
    pd_kvconn_tier_params p = {.dram_bytes = 4 * per, .backend = be, .on_event = on_event, .ud = &box};
    p.fp = (pd_kvw_fingerprint){.arch = 1, .n_layers = L, .n_heads = 4, .n_kv_heads = H, .head_dim = D, .hidden = 64,
                                .vocab = 100, .kv_dtype = PD_DTYPE_BF16, .block_size = BS, .weights_hash = 42};
    p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NP, .block_size = BS, .row_bytes = ROWB, .k = k, .v = v};
    pd_err err = {0};
    pd_kvconn_tiers *c = pd_kvconn_tiers_new(&p, &err);
    PD_REQUIRE(c);
    pd_hash128 root = pd_hash_root(0), asked, unasked, x[NX];
    asked = pd_hash_block(NULL, (int32_t[BS]){1, 2, 3, 4}, BS);
    unasked = pd_hash_block(NULL, (int32_t[BS]){5, 6, 7, 8}, BS);
    pd_kvconn_tiers_save(c, 0, asked, root);
    pd_kvconn_tiers_save(c, 1, unasked, root);
    pd_kvconn_tiers_poll(c);
    pd_kvconn_tiers_poll(c);
    pd_kvconn_tiers_stats st;
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK_EQ(st.tier[0].n_items, 2);  // both held (not matched: a match is a reuse)
    for (int i = 0; i < NX; i++) {  // new blocks, each followed by a request that reuses "asked"
        x[i] = pd_hash_block(NULL, (int32_t[BS]){100 + i, 0, 0, 0}, BS);
        pd_kvconn_tiers_save(c, 2 + i % 6, x[i], root);
        pd_kvconn_tiers_poll(c);
        pd_kvconn_tiers_poll(c);
        PD_CHECK_EQ(pd_kvconn_tiers_match(c, &asked, 1, NULL, NULL), 1);
    }
    PD_CHECK_EQ(pd_kvconn_tiers_match(c, &unasked, 1, NULL, NULL), 0);  // never asked for: gone
    pd_kvconn_tiers_stats_get(c, &st);
    PD_CHECK(st.tier[0].n_items <= 4);
    PD_CHECK_EQ(st.tier[0].evictions, NX + 2 - st.tier[0].n_items);
    printf("  hot DRAM (4 blocks): a block asked for by every request survived %d newer ones (%lld evictions)\n", NX,
           (long long)st.tier[0].evictions);
    pd_kvconn_tiers_free(c);
    for (int l = 0; l < L; l++) free(k[l]), free(v[l]);
    pd_backend_free(be);
    unsetenv("PDSERVE_KV_TIER_STAGING");
}

PD_TEST(staged_hot_dram_load_now_layer_groups_and_off) {
    // Same-step loads copied 2 layers at a time, and with the layer-wise path off (one copy and
    // one fence per load at load_now): the same bit-exact blocks either way.
    setenv("PDSERVE_KV_TIER_LAYERWISE", "2", 1);
    roundtrip("dram, 2 layers a copy", 1 << 20, NULL, NULL);
    setenv("PDSERVE_KV_TIER_LAYERWISE", "0", 1);
    roundtrip("dram, layer-wise off", 1 << 20, NULL, NULL);
    // Just-in-time commits (PDSERVE_KV_TIER_JIT=1), one and two layers a copy: the same blocks,
    // each group copied when its layer's wait comes (or at the step's end).
    setenv("PDSERVE_KV_TIER_JIT", "1", 1);
    setenv("PDSERVE_KV_TIER_LAYERWISE", "1", 1);
    roundtrip("dram, just in time", 1 << 20, NULL, NULL);
    setenv("PDSERVE_KV_TIER_LAYERWISE", "2", 1);
    roundtrip("dram, just in time, 2 layers a copy", 1 << 20, NULL, NULL);
    unsetenv("PDSERVE_KV_TIER_JIT");
    // A value that is not a layer count is refused, not ignored.
    setenv("PDSERVE_KV_TIER_LAYERWISE", "fast", 1);
    setenv("PDSERVE_KV_TIER_STAGING", "1", 1);
    pd_backend *be = pd_backend_cpu_new(1);
    PD_REQUIRE(be);
    void *k[L] = {0}, *v[L] = {0};
    pd_kvconn_tier_params p = {.dram_bytes = 1 << 20, .backend = be, .on_event = on_event};
    p.fp = (pd_kvw_fingerprint){.arch = 1, .n_layers = L, .n_heads = 4, .n_kv_heads = H, .head_dim = D, .hidden = 64,
                                .vocab = 100, .kv_dtype = PD_DTYPE_BF16, .block_size = BS, .weights_hash = 42};
    p.cache = (pd_kvconn_cache){.n_layers = L, .n_blocks = NB, .block_size = BS, .row_bytes = ROWB, .k = k, .v = v};
    pd_err err = {0};
    PD_CHECK(pd_kvconn_tiers_new(&p, &err) == NULL);
    PD_CHECK_EQ(err.status, PD_ERR_INVALID);
    PD_CHECK(strstr(err.msg, "PDSERVE_KV_TIER_LAYERWISE") != NULL);
    pd_backend_free(be);
    unsetenv("PDSERVE_KV_TIER_STAGING");
    unsetenv("PDSERVE_KV_TIER_LAYERWISE");
}
