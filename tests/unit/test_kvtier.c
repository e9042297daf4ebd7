// test_kvtier.c — the KV tier layer: page codec (every dtype, exhaustive fp8 code check, every
// single-byte corruption, truncation, foreign pages), the S3-FIFO / LRU policy (exact byte capacity
// under a random workload, every eviction counted, the hit rate of both on a multi-turn chat trace),
// and the DRAM and disk stores (restart rebuilds the index, flipped bytes and truncated files are
// misses, files of another model are refused, evictions unlink files).
#include "test.h"

#include <dirent.h>
#include <pthread.h>
#include <fcntl.h>
#include <unistd.h>

#include "base/hash.h"
#include "kvtier/kvtier.h"

static const pd_kvt_geom G = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 8, .block_size = 4};
#define ROW (2 * 8)
#define BLK (4 * ROW)

static uint64_t rng_state = 0x1234567;
static uint64_t rnd(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static float frand(float a) {
    return ((float)(rnd() % 2000001) / 1000000.0f - 1.0f) * a;
}

typedef struct blockdata {
    float k[2][BLK], v[2][BLK];
} blockdata;

static void fill(blockdata *b, float amp) {
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < BLK; i++) {
            b->k[l][i] = frand(amp * (float)(1 + i % 3));
            b->v[l][i] = frand(amp);
        }
}

static size_t encode(pd_kvt_dtype d, uint64_t fp, pd_hash128 h, pd_hash128 parent, blockdata *b, uint8_t **out) {
    size_t n = pd_kvt_page_bytes(&G, d);
    *out = malloc(n);
    const float *k[2] = {b->k[0], b->k[1]}, *v[2] = {b->v[0], b->v[1]};
    PD_CHECK_EQ(pd_kvt_page_encode(&G, d, fp, h, parent, k, v, *out, n), PD_OK);
    return n;
}

static pd_kvt_bad decode(const uint8_t *page, size_t n, uint64_t fp, pd_hash128 h, blockdata *o) {
    float *k[2] = {o->k[0], o->k[1]}, *v[2] = {o->v[0], o->v[1]};
    return pd_kvt_page_decode(page, n, fp, &G, h, k, v);
}

// Largest |a-b| relative to the head's amax, over every head of every layer.
static double max_rel_err(const blockdata *a, const blockdata *b) {
    double worst = 0;
    for (int l = 0; l < 2; l++)
        for (int kv = 0; kv < 2; kv++)
            for (int h = 0; h < 2; h++) {
                const float *x = kv ? a->v[l] : a->k[l], *y = kv ? b->v[l] : b->k[l];
                double amax = 0, e = 0;
                for (int t = 0; t < 4; t++)
                    for (int i = 0; i < 8; i++) {
                        int j = t * ROW + h * 8 + i;
                        if (fabs(x[j]) > amax) amax = fabs(x[j]);
                        if (fabs(x[j] - y[j]) > e) e = fabs(x[j] - y[j]);
                    }
                if (amax > 0 && e / amax > worst) worst = e / amax;
            }
    return worst;
}

PD_TEST(page_roundtrip_every_dtype) {
    pd_hash128 h = pd_hash_block(NULL, (const int32_t[]){1, 2, 3, 4}, 4), parent = pd_hash_root(0);
    struct { pd_kvt_dtype d; double tol; } cases[] = {
        {PD_KVT_F32, 0}, {PD_KVT_BF16, 1.0 / 128}, {PD_KVT_FP8, 1.0 / 16 + 1e-6}, {PD_KVT_INT8, 0.5 / 127 + 1e-6}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        for (int rep = 0; rep < 20; rep++) {
            blockdata in, out;
            fill(&in, rep == 0 ? 0.0f : (float)(rep * 3.7));
            uint8_t *page;
            size_t n = encode(cases[c].d, 42, h, parent, &in, &page);
            pd_kvt_page_info info;
            PD_CHECK_EQ(pd_kvt_page_check(page, n, 42, &G, &h, &info), PD_KVT_PAGE_OK);
            PD_CHECK(pd_hash128_eq(info.parent, parent));
            PD_CHECK_EQ(info.dtype, cases[c].d);
            PD_CHECK_EQ(decode(page, n, 42, h, &out), PD_KVT_PAGE_OK);
            double e = max_rel_err(&in, &out);
            PD_CHECK_MSG(e <= cases[c].tol, "%s: rel err %g > %g", pd_kvt_dtype_name(cases[c].d), e, cases[c].tol);
            if (cases[c].d == PD_KVT_F32) PD_CHECK(memcmp(&in, &out, sizeof in) == 0);
            free(page);
        }
    }
    PD_CHECK_EQ(pd_kvt_page_bytes(&G, PD_KVT_BF16), (size_t)PD_KVT_HDR_BYTES + 2 * 2 * 2 * (4 + 4 * 8 * 2));
    PD_CHECK_EQ(pd_kvt_dtype_parse("int8"), PD_KVT_INT8);
    PD_CHECK_EQ(pd_kvt_dtype_parse("fp16"), 0);
}

// Every finite e4m3 value survives encode(decode(code)) (scale 1: a head whose amax is 448).
PD_TEST(page_fp8_codes_exhaustive) {
    pd_kvt_geom g1 = {.n_layers = 1, .n_kv_heads = 1, .head_dim = 256, .block_size = 1};
    float vals[256], back[256];
    int n = 0;
    uint8_t codes[256];
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;  // NaN
        if (c == 0x80) continue;           // -0 encodes as +0
        int e = (c >> 3) & 0xf, m = c & 7;
        float v = e == 0 ? (float)m / 512.0f : ldexpf(1.0f + (float)m / 8.0f, e - 7);
        vals[n] = (c & 0x80) ? -v : v;
        codes[n++] = (uint8_t)c;
    }
    vals[n] = 448.0f;  // pin the scale to exactly 1
    codes[n++] = 0x7e;
    for (int i = n; i < 256; i++) vals[i] = 0;
    size_t bytes = pd_kvt_page_bytes(&g1, PD_KVT_FP8);
    uint8_t *page = malloc(bytes);
    const float *k[1] = {vals}, *v[1] = {vals};
    pd_hash128 h = {1, 2};
    PD_REQUIRE(pd_kvt_page_encode(&g1, PD_KVT_FP8, 7, h, h, k, v, page, bytes) == PD_OK);
    const uint8_t *q = page + PD_KVT_HDR_BYTES + 4;
    for (int i = 0; i < n; i++) PD_CHECK_MSG(q[i] == codes[i], "code 0x%02x encoded as 0x%02x", codes[i], q[i]);
    float *kb[1] = {back}, *vb[1] = {back};
    PD_CHECK_EQ(pd_kvt_page_decode(page, bytes, 7, &g1, h, kb, vb), PD_KVT_PAGE_OK);
    for (int i = 0; i < n; i++) PD_CHECK_MSG(back[i] == vals[i], "value %g came back as %g", vals[i], back[i]);
    free(page);
}

PD_TEST(page_corruption_truncation_foreign_are_refused) {
    pd_hash128 h = {0x1111, 0x2222}, parent = {0x3333, 0x4444};
    blockdata in;
    fill(&in, 2.0f);
    uint8_t *page;
    size_t n = encode(PD_KVT_INT8, 99, h, parent, &in, &page);
    blockdata out, sentinel;
    memset(&sentinel, 0x5a, sizeof sentinel);
    // Every single-byte change anywhere in the page is refused and nothing is written.
    for (size_t i = 0; i < n; i++) {
        for (int bit = 0; bit < 8; bit += 7) {
            page[i] ^= (uint8_t)(1u << bit);
            out = sentinel;
            pd_kvt_bad bad = decode(page, n, 99, h, &out);
            PD_CHECK_MSG(bad != PD_KVT_PAGE_OK, "flip of byte %zu bit %d accepted", i, bit);
            PD_CHECK(memcmp(&out, &sentinel, sizeof out) == 0);
            page[i] ^= (uint8_t)(1u << bit);
        }
    }
    PD_CHECK_EQ(decode(page, n, 99, h, &out), PD_KVT_PAGE_OK);
    PD_CHECK_EQ(decode(page, n - 1, 99, h, &out), PD_KVT_BAD_TRUNCATED);
    PD_CHECK_EQ(decode(page, 10, 99, h, &out), PD_KVT_BAD_TRUNCATED);
    PD_CHECK_EQ(decode(page, n, 98, h, &out), PD_KVT_BAD_FOREIGN);  // another model
    pd_hash128 other = {0x1111, 0x2223};
    PD_CHECK_EQ(decode(page, n, 99, other, &out), PD_KVT_BAD_FOREIGN);  // another block
    pd_kvt_geom g2 = G;
    g2.block_size = 8;
    PD_CHECK_EQ(pd_kvt_page_check(page, n, 99, &g2, &h, NULL), PD_KVT_BAD_FOREIGN);
    uint8_t *longer = calloc(1, n + 1);
    memcpy(longer, page, n);
    PD_CHECK_EQ(decode(longer, n + 1, 99, h, &out), PD_KVT_BAD_TRUNCATED);
    free(longer);
    free(page);
}

// ---- policy -----------------------------------------------------------------------------------------
static int64_t n_evicted_cb;
static void count_evict(void *ud, pd_hash128 key, uint64_t bytes) {
    (void)ud;
    (void)key;
    (void)bytes;
    n_evicted_cb++;
}

PD_TEST(policy_capacity_exact_and_evictions_counted) {
    for (int kind = PD_KVT_LRU; kind <= PD_KVT_S3FIFO; kind++) {
        n_evicted_cb = 0;
        const uint64_t cap = 10000;
        pd_kvt_policy *p = pd_kvt_policy_new(kind, cap, count_evict, NULL);
        PD_REQUIRE(p);
        int64_t removed = 0;
        for (int i = 0; i < 20000; i++) {
            pd_hash128 k = {rnd() % 600, 0};
            uint64_t sz = 1 + rnd() % 700;
            int op = (int)(rnd() % 10);
            if (op < 5) {
                pd_kvt_policy_get(p, k);
            } else if (op < 9) {
                PD_CHECK_EQ(pd_kvt_policy_put(p, k, sz), PD_OK);
                PD_CHECK(pd_kvt_policy_contains(p, k));
            } else {
                removed += pd_kvt_policy_remove(p, k);
            }
            pd_kvt_policy_stats st;
            pd_kvt_policy_stats_get(p, &st);
            PD_CHECK(st.bytes_used <= cap);
            PD_CHECK_EQ(st.evictions, n_evicted_cb);
            PD_CHECK_EQ(st.inserts - st.evictions - removed, st.n_items);
        }
        PD_CHECK_EQ(pd_kvt_policy_put(p, (pd_hash128){1, 1}, cap + 1), PD_NOSPACE);
        PD_CHECK_EQ(pd_kvt_policy_put(p, (pd_hash128){1, 1}, cap), PD_OK);  // empties everything else
        pd_kvt_policy_stats st;
        pd_kvt_policy_stats_get(p, &st);
        PD_CHECK_EQ(st.n_items, 1);
        PD_CHECK_EQ(st.bytes_used, cap);
        PD_CHECK(n_evicted_cb > 0);
        pd_kvt_policy_free(p);
    }
}

// A multi-turn chat trace at block granularity: C conversations sharing a system prompt of S
// blocks; turn t of a conversation reads its whole history (prefix blocks) and appends new blocks;
// between turns, one-off requests (RAG-like unique documents) stream through. Each access is a
// lookup; a miss inserts the block (the tier receives what the device pool offloads).
static double trace_hit_rate(pd_kvt_policy_kind kind, uint64_t cap_blocks, uint64_t seed) {
    pd_kvt_policy *p = pd_kvt_policy_new(kind, cap_blocks, NULL, NULL);
    enum { C = 200, TURNS = 8, SYS = 8, PER_TURN = 6, ONEOFF = 12 };
    uint64_t s = seed;
    int len[C] = {0};
    int64_t hits = 0, total = 0;
    uint64_t oneoff_id = 1;
    for (int round = 0; round < C * TURNS; round++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        int c = (int)((s >> 33) % C);
        if (len[c] >= TURNS * PER_TURN) continue;
        len[c] += PER_TURN;
        for (int b = 0; b < SYS + len[c]; b++) {
            pd_hash128 k = b < SYS ? (pd_hash128){(uint64_t)b, 1} : (pd_hash128){(uint64_t)c << 20 | (uint64_t)b, 2};
            total++;
            if (pd_kvt_policy_get(p, k)) hits++;
            else pd_kvt_policy_put(p, k, 1);
        }
        for (int b = 0; b < ONEOFF; b++) {
            pd_hash128 k = {oneoff_id++, 3};
            if (!pd_kvt_policy_get(p, k)) pd_kvt_policy_put(p, k, 1);
        }
    }
    pd_kvt_policy_free(p);
    return total ? (double)hits / (double)total : 0;
}

PD_TEST(policy_s3fifo_vs_lru_multiturn_trace) {
    // Working set: 200 conversations x up to 48 blocks + the shared 8 = ~9.6k blocks, plus the
    // one-off stream. Capacities well below it.
    uint64_t caps[] = {1000, 2000, 4000};
    for (size_t i = 0; i < 3; i++) {
        double lru = 0, s3 = 0;
        for (uint64_t seed = 1; seed <= 3; seed++) {
            lru += trace_hit_rate(PD_KVT_LRU, caps[i], seed) / 3;
            s3 += trace_hit_rate(PD_KVT_S3FIFO, caps[i], seed) / 3;
        }
        printf("    multi-turn trace, capacity %4llu blocks: hit rate LRU %.3f, S3-FIFO %.3f\n",
               (unsigned long long)caps[i], lru, s3);
        PD_CHECK_MSG(s3 >= lru, "S3-FIFO %.3f below LRU %.3f at capacity %llu", s3, lru,
                     (unsigned long long)caps[i]);
    }
}

// ---- stores ------------------------------------------------------------------------------------------
static pd_kvt_store_params sparams(uint64_t cap, uint64_t fp, const char *dir) {
    pd_kvt_store_params p = {.geom = G, .fingerprint = fp, .capacity = cap, .policy = PD_KVT_S3FIFO, .dir = dir};
    return p;
}

PD_TEST(store_dram_put_get_capacity) {
    pd_err err = {0};
    size_t pb = pd_kvt_page_bytes(&G, PD_KVT_BF16);
    pd_kvt_store_params sp = sparams(pb * 3, 5, NULL);
    pd_kvt_store *s = pd_kvt_dram_new(&sp, &err);
    PD_REQUIRE(s);
    blockdata in;
    fill(&in, 1.0f);
    uint8_t *pages[5];
    for (int i = 0; i < 5; i++) {
        pd_hash128 h = {(uint64_t)i + 1, 9};
        encode(PD_KVT_BF16, 5, h, pd_hash_root(0), &in, &pages[i]);
        PD_CHECK_EQ(pd_kvt_store_put(s, h, pages[i], pb), PD_OK);
    }
    pd_kvt_store_stats st;
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 3);
    PD_CHECK_EQ(st.evictions, 2);
    PD_CHECK(st.bytes_used <= sp.capacity);
    uint8_t *buf = malloc(pb);
    size_t n = 0;
    PD_CHECK_EQ(pd_kvt_store_get(s, (pd_hash128){5, 9}, buf, pb, &n), PD_OK);
    PD_CHECK_EQ(n, pb);
    PD_CHECK(memcmp(buf, pages[4], pb) == 0);
    PD_CHECK_EQ(pd_kvt_store_get(s, (pd_hash128){1, 9}, buf, pb, &n), PD_ERR_NOTFOUND);
    // A page under the wrong key, or of another model, is refused at put.
    PD_CHECK_EQ(pd_kvt_store_put(s, (pd_hash128){77, 9}, pages[0], pb), PD_ERR_INVALID);
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.hits, 1);
    PD_CHECK_EQ(st.misses, 1);
    PD_CHECK_EQ(st.bytes_out, (int64_t)pb);
    PD_CHECK_EQ(st.bytes_in, (int64_t)(5 * pb));
    for (int i = 0; i < 5; i++) free(pages[i]);
    free(buf);
    pd_kvt_store_free(s);
}

static int count_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".kvp")) n++;
    if (d) closedir(d);
    return n;
}

static void rm_dir(const char *dir) {
    DIR *d = opendir(dir);
    struct dirent *de;
    char path[512];
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        unlink(path);
    }
    if (d) closedir(d);
    rmdir(dir);
}

PD_TEST(store_disk_restart_corruption_foreign) {
    char dir[] = "/tmp/pd_kvtier_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_err err = {0};
    size_t pb = pd_kvt_page_bytes(&G, PD_KVT_INT8);
    size_t file_bytes = (pb + 4095) / 4096 * 4096;
    pd_kvt_store_params sp = sparams(file_bytes * 4, 11, dir);
    pd_kvt_store *s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    blockdata in[6];
    uint8_t *pages[6];
    for (int i = 0; i < 6; i++) {
        fill(&in[i], 1.0f + (float)i);
        pd_hash128 h = {(uint64_t)i + 100, 7};
        encode(PD_KVT_INT8, 11, h, pd_hash_root(0), &in[i], &pages[i]);
        PD_CHECK_EQ(pd_kvt_store_put(s, h, pages[i], pb), PD_OK);
    }
    pd_kvt_store_stats st;
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 4);
    PD_CHECK_EQ(st.evictions, 2);
    PD_CHECK_EQ(count_files(dir), 4);  // evicted pages' files are gone
    PD_CHECK(st.bytes_used == file_bytes * 4);
    pd_kvt_store_free(s);

    // Restart: the index comes back from the files.
    s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 4);
    uint8_t *buf = malloc(pb);
    size_t n = 0;
    int found = 0;
    for (int i = 0; i < 6; i++) {
        pd_hash128 h = {(uint64_t)i + 100, 7};
        if (!pd_kvt_store_contains(s, h)) continue;
        PD_CHECK_EQ(pd_kvt_store_get(s, h, buf, pb, &n), PD_OK);
        PD_CHECK(n == pb && memcmp(buf, pages[i], pb) == 0);
        found++;
    }
    PD_CHECK_EQ(found, 4);

    // Flip one payload byte in a file: the next read is a miss, the file goes.
    pd_hash128 victim = {0}, trunc = {0};
    int nv = 0;
    for (int i = 0; i < 6; i++) {
        pd_hash128 h = {(uint64_t)i + 100, 7};
        if (!pd_kvt_store_contains(s, h)) continue;
        if (nv == 0) victim = h;
        if (nv == 1) trunc = h;
        nv++;
    }
    char path[512];
    snprintf(path, sizeof path, "%s/%016llx%016llx.kvp", dir, (unsigned long long)victim.hi,
             (unsigned long long)victim.lo);
    int fd = open(path, O_RDWR);
    PD_REQUIRE(fd >= 0);
    uint8_t b;
    PD_CHECK_EQ(pread(fd, &b, 1, PD_KVT_HDR_BYTES + 17), 1);
    b ^= 0x40;
    PD_CHECK_EQ(pwrite(fd, &b, 1, PD_KVT_HDR_BYTES + 17), 1);
    close(fd);
    PD_CHECK_EQ(pd_kvt_store_get(s, victim, buf, pb, &n), PD_ERR_NOTFOUND);
    PD_CHECK(access(path, F_OK) != 0);
    // Truncate another: a miss too.
    snprintf(path, sizeof path, "%s/%016llx%016llx.kvp", dir, (unsigned long long)trunc.hi,
             (unsigned long long)trunc.lo);
    PD_CHECK_EQ(truncate(path, 4096 * 0 + 100), 0);
    PD_CHECK_EQ(pd_kvt_store_get(s, trunc, buf, pb, &n), PD_ERR_NOTFOUND);
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.bad_pages, 2);
    PD_CHECK_EQ(st.n_items, 2);
    pd_kvt_store_free(s);

    // Another model's store on the same directory refuses the files and leaves them alone.
    pd_kvt_store_params other = sparams(file_bytes * 4, 12, dir);
    s = pd_kvt_disk_new(&other, &err);
    PD_REQUIRE(s);
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 0);
    PD_CHECK_EQ(pd_kvt_disk_refused(s), 2);
    PD_CHECK_EQ(count_files(dir), 2);
    pd_kvt_store_free(s);

    for (int i = 0; i < 6; i++) free(pages[i]);
    free(buf);
    rm_dir(dir);
}

// ---- the tier chain -------------------------------------------------------------------------------
typedef struct load_result {
    int calls, n_loaded;
} load_result;
static void on_loaded(void *ud, uint64_t req_id, int n_loaded, int64_t load_us) {
    load_result *r = ud;
    (void)req_id;
    (void)load_us;
    r->calls++;
    r->n_loaded = n_loaded;
}

PD_TEST(tiers_offload_admission_match_load_promote) {
    char dir[] = "/tmp/pd_kvtier_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_err err = {0};
    size_t f32b = pd_kvt_page_bytes(&G, PD_KVT_F32);
    pd_kvt_store_params dp = sparams(f32b * 4, 77, NULL);
    pd_kvt_store_params kp = sparams(4096 * 100, 77, dir);
    pd_kvt_tiers_params tp = {.geom = G, .fingerprint = 77, .dtype = PD_KVT_BF16, .n_stores = 2};
    tp.stores[0] = pd_kvt_dram_new(&dp, &err);
    tp.stores[1] = pd_kvt_disk_new(&kp, &err);
    PD_REQUIRE(tp.stores[0] && tp.stores[1]);
    pd_kvt_tiers *t = pd_kvt_tiers_new(&tp, &err);
    PD_REQUIRE(t);
    enum { NB = 6 };
    blockdata data[NB];
    pd_hash128 hs[NB], parent = pd_hash_root(0);
    for (int b = 0; b < NB; b++) {
        int32_t toks[4] = {b, b + 1, b + 2, 1000 + b};
        hs[b] = pd_hash_block(&parent, toks, 4);
        fill(&data[b], 1.0f + (float)b);
        parent = hs[b];
    }
    for (int pass = 0; pass < 2; pass++) {
        for (int b = 0; b < NB; b++) {
            const float *k[2] = {data[b].k[0], data[b].k[1]}, *v[2] = {data[b].v[0], data[b].v[1]};
            PD_CHECK_EQ(pd_kvt_tiers_offload(t, hs[b], b ? hs[b - 1] : pd_hash_root(0), k, v), PD_OK);
        }
        PD_CHECK(pd_kvt_tiers_flush(t, 10000));
        pd_kvt_tiers_stats st;
        pd_kvt_tiers_stats_get(t, &st);
        if (pass == 0) {  // first sighting: DRAM only (4 of 6 fit), nothing admitted to disk
            PD_CHECK_EQ(st.refused_lower, NB);
            PD_CHECK_EQ(st.tier[1].store.n_items, 0);
            PD_CHECK_EQ(st.tier[0].store.n_items, 4);
            PD_CHECK_EQ(st.tier[0].store.evictions, 2);
        } else {  // second sighting (resident or in the ghost list): admitted to disk
            PD_CHECK_EQ(st.admitted_lower, NB);
            PD_CHECK_EQ(st.tier[1].store.n_items, NB);
        }
    }
    int tier_of[NB];
    double cost = 0;
    PD_CHECK_EQ(pd_kvt_tiers_match(t, hs, NB, tier_of, &cost), NB);
    PD_CHECK(cost > 0);
    pd_hash128 unknown[2] = {hs[0], {1, 2}};
    PD_CHECK_EQ(pd_kvt_tiers_match(t, unknown, 2, NULL, NULL), 1);

    blockdata out[NB];
    memset(out, 0, sizeof out);
    float *kr[NB][2], *vr[NB][2];
    float *const *dk[NB], *const *dv[NB];
    for (int b = 0; b < NB; b++) {
        kr[b][0] = out[b].k[0];
        kr[b][1] = out[b].k[1];
        vr[b][0] = out[b].v[0];
        vr[b][1] = out[b].v[1];
        dk[b] = kr[b];
        dv[b] = vr[b];
    }
    load_result lr = {0};
    PD_CHECK_EQ(pd_kvt_tiers_load(t, 5, hs, NB, dk, dv, on_loaded, &lr), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 10000));
    PD_CHECK_EQ(lr.calls, 1);
    PD_CHECK_EQ(lr.n_loaded, NB);
    pd_kvt_tiers_stats st;
    pd_kvt_tiers_stats_get(t, &st);
    int64_t from_disk = 0, from_dram = 0;
    for (int i = 0; i < 24; i++) {
        from_dram += st.tier[0].load_hist[i];
        from_disk += st.tier[1].load_hist[i];
    }
    PD_CHECK_EQ(from_dram + from_disk, NB);
    PD_CHECK(from_disk >= 2);  // the blocks DRAM had evicted
    PD_CHECK_EQ(st.promotions, from_disk);
    for (int b = 0; b < NB; b++) PD_CHECK(max_rel_err(&data[b], &out[b]) <= 1.0 / 128);
    PD_CHECK(st.tier[1].store.bytes_out > 0 && st.tier[1].store.bytes_in > 0);

    // A load that starts with an unknown block loads nothing.
    lr = (load_result){0};
    PD_CHECK_EQ(pd_kvt_tiers_load(t, 6, unknown + 1, 1, dk, dv, on_loaded, &lr), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 10000));
    PD_CHECK_EQ(lr.n_loaded, 0);
    pd_kvt_tiers_free(t);
    rm_dir(dir);
}

// Pages longer than the 4 KiB block the index rebuild reads (every real model's pages): the
// rebuild judges the header alone and reads nothing past it (ASan / TSan caught a read of the whole
// page's length from the one-block buffer); the pages come back and load.
PD_TEST(store_disk_restart_large_pages) {
    char dir[] = "/tmp/pd_kvtier_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_kvt_geom g = {.n_layers = 2, .n_kv_heads = 2, .head_dim = 64, .block_size = 16};
    size_t pb = pd_kvt_page_bytes(&g, PD_KVT_F32);
    PD_REQUIRE(pb > 4 * 4096);
    static float rows[2][2][16 * 2 * 64];
    const float *k[2], *v[2];
    for (int l = 0; l < 2; l++) {
        for (int i = 0; i < 16 * 2 * 64; i++) rows[l][0][i] = (float)(i % 97) / 13.0f - (float)l, rows[l][1][i] = (float)(i % 31) / 7.0f;
        k[l] = rows[l][0];
        v[l] = rows[l][1];
    }
    pd_kvt_store_params sp = {.geom = g, .fingerprint = 77, .capacity = 64u << 20, .policy = PD_KVT_S3FIFO, .dir = dir};
    pd_err err = {0};
    pd_kvt_store *s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    uint8_t *page = malloc(pb), *buf = malloc(pb);
    for (int i = 0; i < 3; i++) {
        pd_hash128 h = {(uint64_t)i + 1, 99};
        PD_REQUIRE(pd_kvt_page_encode(&g, PD_KVT_F32, 77, h, pd_hash_root(0), k, v, page, pb) == PD_OK);
        PD_CHECK_EQ(pd_kvt_store_put(s, h, page, pb), PD_OK);
    }
    pd_kvt_store_free(s);
    s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    pd_kvt_store_stats st;
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 3);
    size_t got = 0;
    PD_CHECK_EQ(pd_kvt_store_get(s, (pd_hash128){2, 99}, buf, pb, &got), PD_OK);
    PD_CHECK_EQ(got, pb);
    pd_kvt_store_free(s);
    sp.fingerprint = 78;  // another model: all three refused at start
    s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    pd_kvt_store_stats_get(s, &st);
    PD_CHECK_EQ(st.n_items, 0);
    PD_CHECK_EQ(pd_kvt_disk_refused(s), 3);
    pd_kvt_store_free(s);
    free(page);
    free(buf);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    PD_CHECK_EQ(system(cmd), 0);
}

// The engine thread's probe of a disk store never waits for the store's I/O and never answers
// "unknown" for it: while another thread keeps the store busy writing pages (its lock held across
// each write), probes still say exactly which pages are held. (A busy store used to answer "unknown",
// and a match counted a chain of unknowns as held: the load then found nothing.)
typedef struct busy_writer {
    pd_kvt_store *s;
    size_t pb;
    int n;
    pd_kvt_geom g;
    const float *const *k, *const *v;
} busy_writer;

static void *busy_write(void *arg) {
    busy_writer *w = arg;
    uint8_t *page = malloc(w->pb);
    for (int i = 0; page && i < w->n; i++) {
        pd_hash128 h = {(uint64_t)i + 1000, 5};
        if (pd_kvt_page_encode(&w->g, PD_KVT_F32, 79, h, pd_hash_root(0), w->k, w->v, page, w->pb) == PD_OK)
            (void)pd_kvt_store_put(w->s, h, page, w->pb);
    }
    free(page);
    return NULL;
}

PD_TEST(store_disk_probe_answers_while_writing) {
    char dir[] = "/tmp/pd_kvtier_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_kvt_geom g = {.n_layers = 4, .n_kv_heads = 2, .head_dim = 64, .block_size = 16};
    size_t pb = pd_kvt_page_bytes(&g, PD_KVT_F32);
    static float rows[4][2][16 * 2 * 64];
    const float *k[4], *v[4];
    for (int l = 0; l < 4; l++) {
        for (int i = 0; i < 16 * 2 * 64; i++) rows[l][0][i] = (float)(i % 89) / 11.0f, rows[l][1][i] = (float)(i % 23) / 5.0f;
        k[l] = rows[l][0];
        v[l] = rows[l][1];
    }
    pd_kvt_store_params sp = {.geom = g, .fingerprint = 79, .capacity = 256u << 20, .policy = PD_KVT_S3FIFO, .dir = dir};
    pd_err err = {0};
    pd_kvt_store *s = pd_kvt_disk_new(&sp, &err);
    PD_REQUIRE(s);
    uint8_t *page = malloc(pb);
    PD_REQUIRE(page);
    pd_hash128 held = {1, 5}, absent = {2, 5};
    PD_REQUIRE(pd_kvt_page_encode(&g, PD_KVT_F32, 79, held, pd_hash_root(0), k, v, page, pb) == PD_OK);
    PD_CHECK_EQ(pd_kvt_store_put(s, held, page, pb), PD_OK);
    busy_writer w = {.s = s, .pb = pb, .n = 400, .g = g, .k = k, .v = v};
    pthread_t th;
    PD_REQUIRE(pthread_create(&th, NULL, busy_write, &w) == 0);
    int n_probe = 0, n_wrong = 0;
    int64_t t0 = pd_time_us();
    while (n_probe < 200000 && pd_time_us() - t0 < 3000000) {  // while the writer runs (bounded)
        n_wrong += pd_kvt_store_probe(s, held) != 1;
        n_wrong += pd_kvt_store_probe(s, absent) != 0;
        n_probe += 2;
        if (pthread_tryjoin_np(th, NULL) == 0) {
            th = 0;
            break;
        }
    }
    if (th) pthread_join(th, NULL);
    PD_CHECK(n_probe > 10);
    PD_CHECK_EQ(n_wrong, 0);
    pd_kvt_store_stats st;
    pd_kvt_store_stats_get(s, &st);
    printf("  disk store: %d probes while another thread wrote %lld pages, %d wrong or unknown\n", n_probe,
           (long long)st.puts - 1, n_wrong);
    pd_kvt_store_free(s);
    free(page);
    char cmd[64];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    PD_CHECK_EQ(system(cmd), 0);
}

// ---- bf16 rows (a bf16 device cache's staged block) ---------------------------------------------
static void to_bf16_block(const blockdata *b, uint16_t k[2][BLK], uint16_t v[2][BLK], blockdata *as_f32) {
    for (int l = 0; l < 2; l++)
        for (int i = 0; i < BLK; i++) {
            k[l][i] = pd_f32_to_bf16(b->k[l][i]);
            v[l][i] = pd_f32_to_bf16(b->v[l][i]);
            as_f32->k[l][i] = pd_bf16_to_f32(k[l][i]);
            as_f32->v[l][i] = pd_bf16_to_f32(v[l][i]);
        }
}

PD_TEST(page_encode_bf16_rows_equals_float_encode) {
    pd_hash128 h = pd_hash_block(NULL, (const int32_t[]){5, 6, 7, 8}, 4), parent = pd_hash_root(0);
    for (int rep = 0; rep < 20; rep++) {
        blockdata b, f, out;
        fill(&b, rep ? 3.0f : 0.0f);
        uint16_t bk[2][BLK], bv[2][BLK];
        to_bf16_block(&b, bk, bv, &f);
        uint8_t *ref;
        size_t n = encode(PD_KVT_BF16, 99, h, parent, &f, &ref);
        uint8_t *got = malloc(n);
        const uint16_t *k[2] = {bk[0], bk[1]}, *v[2] = {bv[0], bv[1]};
        PD_CHECK_EQ(pd_kvt_page_encode_bf16(&G, 99, h, parent, k, v, got, n), PD_OK);
        PD_CHECK(memcmp(ref, got, n) == 0);  // byte for byte, checksum included
        PD_CHECK_EQ(decode(got, n, 99, h, &out), PD_KVT_PAGE_OK);
        PD_CHECK(memcmp(&out, &f, sizeof f) == 0);  // exact: bf16 values survive a bf16 page
        PD_CHECK_EQ(pd_kvt_page_encode_bf16(&G, 99, h, parent, k, v, got, n - 1), PD_ERR_INVALID);
        free(ref);
        free(got);
    }
}

static void count_release(void *ud) { (*(int *)ud)++; }
static void count_release_atomic(void *ud) { __atomic_add_fetch((int *)ud, 1, __ATOMIC_SEQ_CST); }

PD_TEST(tiers_offload_bf16_rows_dram_bf16_and_disk_f32) {
    char dir[] = "/tmp/pd_kvtier_XXXXXX";
    PD_REQUIRE(mkdtemp(dir));
    pd_err err = {0};
    // DRAM keeps bf16 pages (written straight from the rows); the disk tier f32 (from a copy).
    pd_kvt_store_params dp = sparams(pd_kvt_page_bytes(&G, PD_KVT_BF16) * 8, 77, NULL);
    pd_kvt_store_params kp = sparams(4096 * 100, 77, dir);
    pd_kvt_tiers_params tp = {.geom = G, .fingerprint = 77, .dtype = PD_KVT_F32, .dram_dtype = PD_KVT_BF16, .n_stores = 2};
    tp.stores[0] = pd_kvt_dram_new(&dp, &err);
    tp.stores[1] = pd_kvt_disk_new(&kp, &err);
    PD_REQUIRE(tp.stores[0] && tp.stores[1]);
    pd_kvt_tiers *t = pd_kvt_tiers_new(&tp, &err);
    PD_REQUIRE(t);
    blockdata b, f;
    fill(&b, 2.0f);
    uint16_t bk[2][BLK], bv[2][BLK];
    to_bf16_block(&b, bk, bv, &f);
    const uint16_t *k[2] = {bk[0], bk[1]}, *v[2] = {bv[0], bv[1]};
    pd_hash128 h = pd_hash_block(NULL, (const int32_t[]){9, 9, 9, 9}, 4), parent = pd_hash_root(0);
    int released = 0;
    PD_CHECK_EQ(pd_kvt_tiers_offload_bf16(t, h, parent, k, v, count_release, &released), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 10000));
    PD_CHECK_EQ(released, 1);
    PD_CHECK_EQ(pd_kvt_tiers_offload_bf16(t, h, parent, k, v, count_release, &released), PD_OK);  // 2nd sighting: disk too
    PD_CHECK(pd_kvt_tiers_flush(t, 10000));
    PD_CHECK_EQ(released, 2);
    pd_kvt_tiers_stats st;
    pd_kvt_tiers_stats_get(t, &st);
    PD_CHECK_EQ(st.tier[0].store.n_items, 1);
    PD_CHECK_EQ(st.tier[1].store.n_items, 1);
    PD_CHECK_EQ(st.tier[0].store.bytes_used, pd_kvt_page_bytes(&G, PD_KVT_BF16));
    PD_CHECK(st.tier[1].store.bytes_used >= pd_kvt_page_bytes(&G, PD_KVT_F32));  // (disk: 4 KiB aligned)
    // Loaded back from DRAM: exactly the bf16 values.
    blockdata o;
    memset(&o, 0, sizeof o);
    float *ok[2] = {o.k[0], o.k[1]}, *ov[2] = {o.v[0], o.v[1]};
    float *const *dk[1] = {ok}, *const *dv[1] = {ov};
    load_result r = {0};
    PD_CHECK_EQ(pd_kvt_tiers_load(t, 1, &h, 1, dk, dv, on_loaded, &r), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 10000));
    PD_CHECK_EQ(r.calls, 1);
    PD_CHECK_EQ(r.n_loaded, 1);
    PD_CHECK(memcmp(&o, &f, sizeof f) == 0);
    // And from disk (its f32 page, made from the same values) once DRAM has lost it.
    size_t got = 0;
    uint8_t *page = malloc(pd_kvt_page_bytes(&G, PD_KVT_F32));
    PD_CHECK_EQ(pd_kvt_store_get(tp.stores[1], h, page, pd_kvt_page_bytes(&G, PD_KVT_F32), &got), PD_OK);
    memset(&o, 0, sizeof o);
    PD_CHECK_EQ(pd_kvt_page_decode(page, got, 77, &G, h, ok, ov), PD_KVT_PAGE_OK);
    PD_CHECK(memcmp(&o, &f, sizeof f) == 0);
    free(page);
    PD_CHECK_EQ(pd_kvt_tiers_offload_bf16(t, h, parent, NULL, v, count_release, &released), PD_ERR_INVALID);
    pd_kvt_tiers_free(t);
    PD_CHECK_EQ(released, 2);
    rm_dir(dir);
}

// Several tier workers: 40 blocks offloaded at once, every one stored once and loaded back exact,
// loads and offloads interleaved (TSan runs this too).
PD_TEST(tiers_several_workers_offload_and_load) {
    pd_err err = {0};
    pd_kvt_store_params dp = sparams(pd_kvt_page_bytes(&G, PD_KVT_BF16) * 64, 77, NULL);
    pd_kvt_tiers_params tp = {.geom = G, .fingerprint = 77, .dtype = PD_KVT_F32, .dram_dtype = PD_KVT_BF16,
                              .n_stores = 1, .n_threads = 3};
    tp.stores[0] = pd_kvt_dram_new(&dp, &err);
    PD_REQUIRE(tp.stores[0]);
    pd_kvt_tiers *t = pd_kvt_tiers_new(&tp, &err);
    PD_REQUIRE(t);
    enum { N = 40 };
    static blockdata f[N];
    static uint16_t bk[N][2][BLK], bv[N][2][BLK];
    const uint16_t *k[N][2], *v[N][2];
    pd_hash128 hs[N];
    int released = 0;
    for (int i = 0; i < N; i++) {
        blockdata b;
        fill(&b, 1.5f);
        to_bf16_block(&b, bk[i], bv[i], &f[i]);
        k[i][0] = bk[i][0], k[i][1] = bk[i][1], v[i][0] = bv[i][0], v[i][1] = bv[i][1];
        hs[i] = (pd_hash128){(uint64_t)i + 1, 1234};
    }
    // (released is bumped from several workers: count under a lock-free add)
    for (int i = 0; i < N; i++)
        PD_CHECK_EQ(pd_kvt_tiers_offload_bf16(t, hs[i], pd_hash_root(0), k[i], v[i], count_release_atomic, &released), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 20000));
    PD_CHECK_EQ(__atomic_load_n(&released, __ATOMIC_SEQ_CST), N);
    pd_kvt_tiers_stats st;
    pd_kvt_tiers_stats_get(t, &st);
    PD_CHECK_EQ(st.offloads_done, N);
    PD_CHECK_EQ(st.tier[0].store.n_items, N);
    static blockdata o[N];
    float *ok[N][2], *ov[N][2];
    float *const *dk[N], *const *dv[N];
    for (int i = 0; i < N; i++) {
        ok[i][0] = o[i].k[0], ok[i][1] = o[i].k[1], ov[i][0] = o[i].v[0], ov[i][1] = o[i].v[1];
        dk[i] = ok[i], dv[i] = ov[i];
    }
    load_result r[4] = {{0}};
    for (int q = 0; q < 4; q++)  // four loads of 10 blocks each, possibly on different workers
        PD_CHECK_EQ(pd_kvt_tiers_load(t, (uint64_t)q, hs + 10 * q, 10, dk + 10 * q, dv + 10 * q, on_loaded, &r[q]), PD_OK);
    PD_CHECK(pd_kvt_tiers_flush(t, 20000));
    for (int q = 0; q < 4; q++) {
        PD_CHECK_EQ(r[q].calls, 1);
        PD_CHECK_EQ(r[q].n_loaded, 10);
    }
    for (int i = 0; i < N; i++) PD_CHECK(memcmp(&o[i], &f[i], sizeof f[i]) == 0);
    pd_kvt_tiers_free(t);
}
