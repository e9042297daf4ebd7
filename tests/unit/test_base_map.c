// test_base_map.c — base/map: random operations against a reference (a plain array), with good,
// poor and constant hashes (long probe runs, wrap-around, hash 0), deletion by backward shift,
// remove_if visiting each entry exactly once, reserve-then-put never failing, and every
// allocation failure leaving the map as it was.
#include "test.h"

#include "base/map.h"

typedef struct ent {
    uint64_t key;
    uint64_t val;
} ent;

#define REF_MAX 4096
typedef struct ref {
    uint64_t key[REF_MAX], val[REF_MAX];
    int n;
} ref;

static int ref_find(const ref *r, uint64_t k) {
    for (int i = 0; i < r->n; i++)
        if (r->key[i] == k) return i;
    return -1;
}

typedef uint64_t (*hash_fn)(uint64_t);
static uint64_t h_good(uint64_t k) { return pd_map_mix64(k); }
static uint64_t h_poor(uint64_t k) { return k % 13; }  // long runs, hash 0 included
static uint64_t h_const(uint64_t k) { return 0x5555; }  // every key in one run

// The map's full contents equal the reference (and n agrees).
static bool same(const pd_map *m, const ref *r, hash_fn h) {
    if (pd_map_len(m) != (size_t)r->n) return false;
    for (int i = 0; i < r->n; i++) {
        const ent *e = pd_map_find(m, h(r->key[i]), &r->key[i]);
        if (!e || e->key != r->key[i] || e->val != r->val[i]) return false;
    }
    size_t seen = 0;
    for (size_t i = 0; i < m->cap; i++) {
        const ent *e = pd_map_slot(m, i);
        if (!e) continue;
        seen++;
        int j = ref_find(r, e->key);
        if (j < 0 || r->val[j] != e->val) return false;
    }
    return seen == (size_t)r->n;
}

static void run_random(hash_fn h, uint64_t seed, int n_ops, uint64_t key_range, int load) {
    pd_map m;
    PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = sizeof(ent), .key_size = 8,
                                                 .max_load_pct = load}) == PD_OK);
    static ref r;
    r.n = 0;
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    for (int op = 0; op < n_ops; op++) {
        uint64_t k = pd_rng_next(&rng) % key_range;
        int j = ref_find(&r, k);
        switch (pd_rng_next(&rng) % 4) {
        case 0:
        case 1: {  // put (new or existing)
            if (j < 0 && r.n == REF_MAX) break;
            bool existed;
            ent *e = pd_map_put(&m, h(k), &k, &existed);
            PD_REQUIRE(e);
            PD_CHECK(existed == (j >= 0));
            PD_CHECK(e->key == k);
            if (!existed) PD_CHECK(e->val == 0);  // a new entry is zeroed past its key
            e->val = pd_rng_next(&rng);
            if (j < 0) j = r.n++;
            r.key[j] = k;
            r.val[j] = e->val;
            break;
        }
        case 2: {  // delete
            PD_CHECK(pd_map_del(&m, h(k), &k) == (j >= 0));
            if (j >= 0) {
                r.key[j] = r.key[r.n - 1];
                r.val[j] = r.val[r.n - 1];
                r.n--;
            }
            break;
        }
        default: {  // find
            ent *e = pd_map_find(&m, h(k), &k);
            PD_CHECK((e != NULL) == (j >= 0));
            if (e && j >= 0) PD_CHECK(e->val == r.val[j]);
        }
        }
        if (op % 97 == 0 || op == n_ops - 1) PD_CHECK(same(&m, &r, h));
        if (m.cap) PD_CHECK(m.n * 100 <= m.cap * (size_t)(load ? load : 50));
    }
    pd_map_fini(&m);
}

PD_TEST(map_random_good_hash) {
    for (uint64_t s = 1; s <= 4; s++) run_random(h_good, s, 20000, 3000, 0);
    run_random(h_good, 9, 20000, 1u << 20, 90);
    run_random(h_good, 10, 20000, 64, 25);
}

PD_TEST(map_random_poor_hash) {
    for (uint64_t s = 1; s <= 3; s++) run_random(h_poor, s, 8000, 600, 0);
    run_random(h_poor, 7, 8000, 600, 90);
}

PD_TEST(map_random_constant_hash) { run_random(h_const, 3, 3000, 200, 75); }

static bool drop_odd_and_bump(void *entry, void *ctx) {
    ent *e = entry;
    int *calls = ctx;
    calls[e->key]++;
    e->val += 1000;  // value bytes may change
    return e->key & 1;
}

PD_TEST(map_remove_if_visits_each_entry_once) {
    hash_fn hs[] = {h_good, h_poor, h_const};
    for (size_t hi = 0; hi < PD_ARRAY_LEN(hs); hi++) {
        for (int n = 0; n < 300; n += 37) {
            pd_map m;
            PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = sizeof(ent), .key_size = 8,
                                                         .max_load_pct = 90}) == PD_OK);
            for (uint64_t k = 0; k < (uint64_t)n; k++) {
                ent *e = pd_map_put(&m, hs[hi](k), &k, NULL);
                PD_REQUIRE(e);
                e->val = k;
            }
            static int calls[300];
            memset(calls, 0, sizeof calls);
            size_t removed = pd_map_remove_if(&m, drop_odd_and_bump, calls);
            PD_CHECK_EQ(removed, n / 2);
            PD_CHECK_EQ(pd_map_len(&m), n - n / 2);
            for (uint64_t k = 0; k < (uint64_t)n; k++) {
                PD_CHECK_EQ(calls[k], 1);
                ent *e = pd_map_find(&m, hs[hi](k), &k);
                PD_CHECK((e != NULL) == !(k & 1));
                if (e) PD_CHECK_EQ(e->val, k + 1000);
            }
            pd_map_fini(&m);
        }
    }
}

PD_TEST(map_del_entry_and_clear) {
    pd_map m;
    PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = sizeof(ent), .key_size = 8}) == PD_OK);
    for (uint64_t k = 0; k < 100; k++) PD_REQUIRE(pd_map_put(&m, h_poor(k), &k, NULL));
    for (uint64_t k = 0; k < 100; k += 3) {
        ent *e = pd_map_find(&m, h_poor(k), &k);
        PD_REQUIRE(e);
        pd_map_del_entry(&m, e);
    }
    for (uint64_t k = 0; k < 100; k++) PD_CHECK((pd_map_find(&m, h_poor(k), &k) != NULL) == (k % 3 != 0));
    size_t cap = m.cap;
    pd_map_clear(&m);
    PD_CHECK_EQ(pd_map_len(&m), 0);
    PD_CHECK_EQ(m.cap, cap);
    uint64_t k = 5;
    PD_CHECK(!pd_map_find(&m, h_poor(k), &k));
    pd_map_fini(&m);
}

// Keys kept outside the map (the tokenizer's layout): the entry is an index into a string pool.
typedef struct skey {
    const char *s;
    size_t n;
} skey;

static bool str_eq(const void *entry, const void *key, void *ctx) {
    const char *const *pool = ctx;
    const skey *k = key;
    int32_t v;
    memcpy(&v, entry, sizeof v);
    return strlen(pool[v]) == k->n && memcmp(pool[v], k->s, k->n) == 0;
}

static uint64_t str_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

PD_TEST(map_external_keys) {
    static char words[500][12];
    const char *pool[500];
    for (int i = 0; i < 500; i++) {
        snprintf(words[i], sizeof words[i], "w%d", i * 7919 % 100003);
        pool[i] = words[i];
    }
    pd_map m;
    PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = 4, .eq = str_eq, .eq_ctx = pool}) == PD_OK);
    for (int32_t i = 0; i < 500; i++) {
        skey k = {pool[i], strlen(pool[i])};
        bool existed;
        int32_t *e = pd_map_put(&m, str_hash(k.s, k.n), &k, &existed);
        PD_REQUIRE(e);
        PD_CHECK(!existed && *e == 0);
        *e = i;
    }
    for (int32_t i = 0; i < 500; i++) {
        skey k = {pool[i], strlen(pool[i])};
        int32_t *e = pd_map_find(&m, str_hash(k.s, k.n), &k);
        PD_CHECK(e && *e == i);
    }
    skey miss = {"nope", 4};
    PD_CHECK(!pd_map_find(&m, str_hash(miss.s, miss.n), &miss));
    pd_map_fini(&m);
}

PD_TEST(map_bad_params) {
    pd_map m;
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 0, .key_size = 0}) == PD_ERR_INVALID);
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 8, .key_size = 9}) == PD_ERR_INVALID);
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 8, .key_size = 0}) == PD_ERR_INVALID);
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 8, .key_size = 8, .eq = str_eq}) == PD_ERR_INVALID);
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 8, .key_size = 8, .max_load_pct = 95}) == PD_ERR_INVALID);
    PD_CHECK(pd_map_init(&m, &(pd_map_params){.entry_size = 8, .key_size = 8}) == PD_OK);
    PD_CHECK(pd_map_reserve(&m, SIZE_MAX / 2) == PD_ERR_NOMEM);  // size overflow, not a crash
    PD_CHECK_EQ(m.cap, 0);
    pd_map_fini(&m);
}

PD_TEST(map_reserve_then_put_never_fails) {
    pd_map m;
    PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = sizeof(ent), .key_size = 8}) == PD_OK);
    PD_REQUIRE(pd_map_reserve(&m, 1000) == PD_OK);
    size_t room = m.cap / 2;  // load limit 1/2
    PD_REQUIRE(room >= 1000);
    pd_mem_fault_set(0, true);  // every allocation fails from here
    for (uint64_t k = 0; k < room; k++) PD_CHECK(pd_map_put(&m, h_good(k), &k, NULL) != NULL);
    uint64_t k = room;
    PD_CHECK(pd_map_put(&m, h_good(k), &k, NULL) == NULL);  // one more needs growth: fails cleanly
    PD_CHECK_EQ(pd_mem_fault_n_failed(), 1);
    pd_mem_fault_set(-1, false);
    PD_CHECK_EQ(pd_map_len(&m), room);
    for (uint64_t j = 0; j < room; j++) PD_CHECK(pd_map_find(&m, h_good(j), &j));
    PD_CHECK(pd_map_put(&m, h_good(k), &k, NULL) != NULL);
    pd_map_fini(&m);
}

// Every allocation failure during a run of puts leaves the map exactly as it was.
PD_TEST(map_allocation_failures) {
    for (long cd = 0; cd < 10; cd++) {  // 2000 entries at load 1/2: 9 growths (16 .. 4096 slots)
        pd_map m;
        PD_REQUIRE(pd_map_init(&m, &(pd_map_params){.entry_size = sizeof(ent), .key_size = 8}) == PD_OK);
        static ref r;
        r.n = 0;
        int n_null = 0;
        pd_mem_fault_set(cd, false);
        for (uint64_t k = 0; k < 2000; k++) {
            ent *e = pd_map_put(&m, h_good(k * 31), &(uint64_t){k * 31}, NULL);
            if (!e) {
                PD_CHECK(same(&m, &r, h_good));
                n_null++;
                continue;  // the next put retries the growth
            }
            e->val = k;
            r.key[r.n] = k * 31;
            r.val[r.n++] = k;
            if (r.n == REF_MAX) break;
        }
        PD_CHECK_EQ(pd_mem_fault_n_failed(), cd < 9 ? 1 : 0);
        pd_mem_fault_set(-1, false);
        PD_CHECK_EQ(n_null, cd < 9 ? 1 : 0);  // the one failed growth failed one put, no more
        PD_CHECK(same(&m, &r, h_good));
        PD_CHECK_EQ(r.n, 2000 - n_null);
        pd_map_fini(&m);
    }
}
