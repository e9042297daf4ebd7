// tiers.c — the tier chain: one thread runs offloads (encode + write-back) and loads (read,
// verify, decode, promote); the engine thread only queues and matches. See kvtier.h.
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvtier/kvtier.h"

#define EV_CAP 4096

typedef struct job {
    struct job *next;
    int kind;  // 1 offload, 2 load
    // offload
    pd_hash128 hash, parent;
    float *rows;  // (n_layers * 2 * block rows)
    pd_kvt_fill_fn fill;  // offload_fill: fills rows on the tier thread
    void *fill_ud;
    const uint16_t *const *bk, *const *bv;  // offload_bf16: the borrowed bf16 rows
    void (*release)(void *ud);
    uint32_t only;  // offload: nonzero = exactly these tiers (bit i: tier i), no admission test
    // load
    uint64_t req_id;
    pd_hash128 *hashes;
    int n;
    float *const *const *dst_k;
    float *const *const *dst_v;
    pd_kvt_load_fn done;
    pd_kvt_block_fn block_done;  // (may be NULL) after each block is in dst
    uint16_t *const *const *dst_bk;  // (may be NULL) bf16 destinations: bf16 pages go there directly
    uint16_t *const *const *dst_bv;
    void *ud;
} job;

struct pd_kvt_tiers {
    pd_kvt_tiers_params p;
    size_t block_floats;  // per layer per K or V
    pthread_t threads[PD_KVT_MAX_WORKERS];
    int n_threads;
    int n_running;             // jobs in progress (guarded by mu)
    pthread_mutex_t mu;
    pthread_cond_t cv, idle_cv;
    job *head, *tail;          // offloads, FIFO
    job *lhead, *ltail;        // loads, FIFO: served before any offload (a request waits on them)
    int n_queued_offloads;
    bool busy, stop;
    pd_kvt_tiers_stats st;     // guarded by mu
    pd_kvt_store_stats snap[PD_KVT_MAX_TIERS];  // the stores' stats as of the last job, guarded by mu
    double bw_bytes_per_us[PD_KVT_MAX_TIERS];  // measured load bandwidth (EMA), guarded by mu
    uint8_t *pages[PD_KVT_MAX_WORKERS];  // each worker's scratch
    size_t page_cap;
    pd_kvt_event ev[EV_CAP];   // ring of tier events, guarded by ev_mu (taken inside store locks)
    int ev_head, ev_n;
    int64_t ev_dropped;
    pthread_mutex_t ev_mu;
    int evict_tier[PD_KVT_MAX_TIERS];  // the evict hooks' user data: tier indexes
};



// The calling tier worker's page scratch (t->page_cap bytes; set at the worker's start).
static _Thread_local uint8_t *tl_page;

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

// Host DRAM keeps pages exact (f32); disk and Redis use the configured dtype.
static pd_kvt_dtype tier_dtype(const pd_kvt_tiers *t, int i) {
    if (!strcmp(pd_kvt_store_name(t->p.stores[i]), "dram")) return t->p.dram_dtype ? t->p.dram_dtype : PD_KVT_F32;
    return t->p.dtype;
}

static void push_event(pd_kvt_tiers *t, int tier, bool stored, pd_hash128 h, pd_hash128 parent) {
    pthread_mutex_lock(&t->ev_mu);
    if (t->ev_n == EV_CAP) {  // drop the oldest
        t->ev_head = (t->ev_head + 1) % EV_CAP;
        t->ev_n--;
        t->ev_dropped++;
    }
    t->ev[(t->ev_head + t->ev_n) % EV_CAP] = (pd_kvt_event){.tier = tier, .is_stored = stored, .hash = h, .parent = parent};
    t->ev_n++;
    pthread_mutex_unlock(&t->ev_mu);
}

static void put_tier(pd_kvt_tiers *t, int i, pd_hash128 h, pd_hash128 parent, const float *const *k,
                     const float *const *v) {
    size_t n = pd_kvt_page_bytes(&t->p.geom, tier_dtype(t, i));
    if (pd_kvt_page_encode(&t->p.geom, tier_dtype(t, i), t->p.fingerprint, h, parent, k, v, tl_page, n) != PD_OK)
        return;
    if (pd_kvt_store_put(t->p.stores[i], h, tl_page, n) == PD_OK) push_event(t, i, true, h, parent);
}

// A block given as bf16 rows: bf16 tiers get their page straight from them; the others from an
// f32 copy, made once if needed.
static bool put_tier_bf16(pd_kvt_tiers *t, int i, job *j) {
    int L = t->p.geom.n_layers;
    if (tier_dtype(t, i) == PD_KVT_BF16) {
        size_t n = pd_kvt_page_bytes(&t->p.geom, PD_KVT_BF16);
        if (pd_kvt_page_encode_bf16(&t->p.geom, t->p.fingerprint, j->hash, j->parent, j->bk, j->bv, tl_page, n) != PD_OK)
            return true;
        if (pd_kvt_store_put(t->p.stores[i], j->hash, tl_page, n) == PD_OK) push_event(t, i, true, j->hash, j->parent);
        return true;
    }
    if (!j->rows) {
        j->rows = pd_malloc((size_t)L * 2 * t->block_floats * sizeof(float));
        if (!j->rows) return false;
        for (int l = 0; l < L; l++)
            for (int kv = 0; kv < 2; kv++) {
                const uint16_t *src = kv ? j->bv[l] : j->bk[l];
                float *dst = j->rows + (size_t)(2 * l + kv) * t->block_floats;
                for (size_t e = 0; e < t->block_floats; e++) dst[e] = pd_bf16_to_f32(src[e]);
            }
    }
    const float *k[4096], *v[4096];
    for (int l = 0; l < L; l++) {
        k[l] = j->rows + (size_t)(2 * l) * t->block_floats;
        v[l] = j->rows + (size_t)(2 * l + 1) * t->block_floats;
    }
    put_tier(t, i, j->hash, j->parent, k, v);
    return true;
}

static void run_offload_bf16(pd_kvt_tiers *t, job *j) {
    bool seen = j->only || pd_kvt_store_seen_before(t->p.stores[0], j->hash);
    if (!j->only) put_tier_bf16(t, 0, j);
    int64_t adm = 0, ref = 0;
    for (int i = j->only ? 0 : 1; i < t->p.n_stores; i++) {
        if (j->only && !(j->only & (1u << i))) continue;
        bool is_pool = !strcmp(pd_kvt_store_name(t->p.stores[i]), "redis");
        if (!seen && !is_pool) {
            ref++;
            continue;
        }
        if (pd_kvt_store_contains(t->p.stores[i], j->hash)) continue;
        if (put_tier_bf16(t, i, j)) adm++;
    }
    j->release(j->fill_ud);
    pthread_mutex_lock(&t->mu);
    t->st.offloads_done++;
    t->st.admitted_lower += adm;
    t->st.refused_lower += ref;
    pthread_mutex_unlock(&t->mu);
}

static void run_offload(pd_kvt_tiers *t, job *j) {
    int L = t->p.geom.n_layers;
    if (j->bk) {
        run_offload_bf16(t, j);
        return;
    }
    if (j->fill) {  // staged rows (a device cache): converted here, off the engine thread
        j->rows = pd_malloc((size_t)L * 2 * t->block_floats * sizeof(float));
        bool ok = j->rows && j->fill(j->fill_ud, j->rows);
        if (!j->rows) j->fill(j->fill_ud, NULL);  // releases its staging all the same
        if (!ok) {
            pthread_mutex_lock(&t->mu);
            t->st.offloads_dropped++;
            pthread_mutex_unlock(&t->mu);
            return;
        }
    }
    const float *k[4096], *v[4096];
    for (int l = 0; l < L; l++) {
        k[l] = j->rows + (size_t)(2 * l) * t->block_floats;
        v[l] = j->rows + (size_t)(2 * l + 1) * t->block_floats;
    }
    // Admission to lower tiers: the block was seen before by tier 0 (second sighting, or its
    // ghost list remembers it); Redis, the shared pool, takes every block.
    bool seen = j->only || pd_kvt_store_seen_before(t->p.stores[0], j->hash);
    if (!j->only) put_tier(t, 0, j->hash, j->parent, k, v);
    int64_t adm = 0, ref = 0;
    for (int i = j->only ? 0 : 1; i < t->p.n_stores; i++) {
        if (j->only && !(j->only & (1u << i))) continue;
        bool is_pool = !strcmp(pd_kvt_store_name(t->p.stores[i]), "redis");
        if (!seen && !is_pool) {
            ref++;
            continue;
        }
        if (pd_kvt_store_contains(t->p.stores[i], j->hash)) continue;
        put_tier(t, i, j->hash, j->parent, k, v);
        adm++;
    }
    pthread_mutex_lock(&t->mu);
    t->st.offloads_done++;
    t->st.admitted_lower += adm;
    t->st.refused_lower += ref;
    pthread_mutex_unlock(&t->mu);
}

static void run_load(pd_kvt_tiers *t, job *j) {
    int64_t t0 = now_us();
    int L = t->p.geom.n_layers;
    int n_ok = 0;
    for (int b = 0; b < j->n; b++) {
        pd_hash128 h = j->hashes[b];
        bool ok = false;
        for (int i = 0; i < t->p.n_stores && !ok; i++) {
            int64_t tb = now_us();
            size_t len = 0;
            if (pd_kvt_store_get(t->p.stores[i], h, tl_page, t->page_cap, &len) != PD_OK) continue;
            float *k[4096], *v[4096];
            for (int l = 0; l < L; l++) {
                k[l] = j->dst_k[b][l];
                v[l] = j->dst_v[b][l];
            }
            // A bf16 page into bf16 destinations: copied as is (no float round trip), when a
            // promotion (to tier 0) can be written from bf16 rows too.
            pd_kvt_page_info hi = {0};
            bool direct = j->dst_bk && (i == 0 || tier_dtype(t, 0) == PD_KVT_BF16) &&
                          pd_kvt_page_check_header(tl_page, len, t->p.fingerprint, &t->p.geom, &h, &hi) == PD_KVT_PAGE_OK &&
                          hi.dtype == PD_KVT_BF16;
            if (direct) {
                if (pd_kvt_page_decode_bf16(tl_page, len, t->p.fingerprint, &t->p.geom, h, j->dst_bk[b], j->dst_bv[b]) !=
                    PD_KVT_PAGE_OK)
                    continue;
            } else if (pd_kvt_page_decode(tl_page, len, t->p.fingerprint, &t->p.geom, h, k, v) != PD_KVT_PAGE_OK)
                continue;
            ok = true;
            int64_t dt = now_us() - tb;
            pd_kvt_page_info info = {0};
            if (i > 0) pd_kvt_page_check_header(tl_page, len, t->p.fingerprint, &t->p.geom, &h, &info);  // the parent, to promote
            pthread_mutex_lock(&t->mu);
            int bucket = 0;
            while (bucket < 23 && ((int64_t)1 << bucket) <= dt) bucket++;
            t->st.tier[i].load_hist[bucket]++;
            double bw = (double)len / (double)(dt > 0 ? dt : 1);
            t->bw_bytes_per_us[i] = t->bw_bytes_per_us[i] > 0 ? 0.8 * t->bw_bytes_per_us[i] + 0.2 * bw : bw;
            pthread_mutex_unlock(&t->mu);
            if (i > 0 && direct) {  // promote from the bf16 rows (tier 0 keeps bf16 pages)
                size_t pn = pd_kvt_page_bytes(&t->p.geom, PD_KVT_BF16);
                if (pd_kvt_page_encode_bf16(&t->p.geom, t->p.fingerprint, h, info.parent,
                                            (const uint16_t *const *)j->dst_bk[b], (const uint16_t *const *)j->dst_bv[b],
                                            tl_page, pn) == PD_OK &&
                    pd_kvt_store_put(t->p.stores[0], h, tl_page, pn) == PD_OK)
                    push_event(t, 0, true, h, info.parent);
                pthread_mutex_lock(&t->mu);
                t->st.promotions++;
                pthread_mutex_unlock(&t->mu);
            } else if (i > 0) {  // promote: the next load of this block comes from DRAM
                const float *ck[4096], *cv[4096];
                for (int l = 0; l < L; l++) {
                    ck[l] = k[l];
                    cv[l] = v[l];
                }
                put_tier(t, 0, h, info.parent, ck, cv);
                pthread_mutex_lock(&t->mu);
                t->st.promotions++;
                pthread_mutex_unlock(&t->mu);
            }
            if (j->block_done) j->block_done(j->ud, b, direct);
        }
        if (!ok) break;  // the chain stops at the first block no tier can give
        n_ok++;
    }
    int64_t dt = now_us() - t0;
    pthread_mutex_lock(&t->mu);
    t->st.loads++;
    t->st.load_blocks += n_ok;
    if (n_ok < j->n) t->st.load_misses++;
    pthread_mutex_unlock(&t->mu);
    j->done(j->ud, j->req_id, n_ok, dt);
}

// The stores' counters, read on the tier thread (a store's lock may be held across its I/O) and
// published under mu, so that a stats reader (the engine thread) never waits on a tier.
static void snapshot(pd_kvt_tiers *t) {
    pd_kvt_store_stats s[PD_KVT_MAX_TIERS];
    for (int i = 0; i < t->p.n_stores; i++) pd_kvt_store_stats_get(t->p.stores[i], &s[i]);
    pthread_mutex_lock(&t->mu);
    memcpy(t->snap, s, sizeof s);
    pthread_mutex_unlock(&t->mu);
}

typedef struct worker_arg {
    pd_kvt_tiers *t;
    int index;
} worker_arg;

// A tier worker: loads first (a request waits on them), then offloads. Several workers run jobs in
// parallel (stores are thread-safe; each worker has its own page scratch).
static void *tier_main(void *arg) {
    pd_kvt_tiers *t = ((worker_arg *)arg)->t;
    tl_page = t->pages[((worker_arg *)arg)->index];
    pd_free(arg);
    pthread_mutex_lock(&t->mu);
    for (;;) {
        while (!t->head && !t->lhead && !t->stop) {
            if (!t->n_running) {
                t->busy = false;
                pthread_cond_broadcast(&t->idle_cv);
            }
            pthread_cond_wait(&t->cv, &t->mu);
        }
        if (!t->head && !t->lhead && t->stop) break;
        job *j;
        if (t->lhead) {
            j = t->lhead;
            t->lhead = j->next;
            if (!t->lhead) t->ltail = NULL;
        } else {
            j = t->head;
            t->head = j->next;
            if (!t->head) t->tail = NULL;
        }
        if (j->kind == 1) t->n_queued_offloads--;
        t->busy = true;
        t->n_running++;
        pthread_mutex_unlock(&t->mu);
        if (j->kind == 1) run_offload(t, j);
        else run_load(t, j);
        pd_free(j->rows);
        pd_free(j->hashes);
        pd_free(j);
        snapshot(t);
        pthread_mutex_lock(&t->mu);
        t->n_running--;
    }
    if (!t->n_running) {
        t->busy = false;
        pthread_cond_broadcast(&t->idle_cv);
    }
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

static void on_store_evict(void *ud, pd_hash128 key) {
    int *tier = ud;
    // ud points at t->evict_tier[i]: step back to t.
    pd_kvt_tiers *t = (pd_kvt_tiers *)((char *)(tier - *tier) - offsetof(pd_kvt_tiers, evict_tier));
    push_event(t, *tier, false, key, (pd_hash128){0});
}

pd_kvt_tiers *pd_kvt_tiers_new(const pd_kvt_tiers_params *p, pd_err *err) {
    if (!p || p->n_stores < 1 || p->n_stores > PD_KVT_MAX_TIERS || !pd_kvt_page_bytes(&p->geom, p->dtype) ||
        p->geom.n_layers > 4096) {
        pd_err_set(err, PD_ERR_INVALID, "kvtier: bad tier parameters");
        return NULL;
    }
    for (int i = 0; i < p->n_stores; i++)
        if (!p->stores[i]) {
            pd_err_set(err, PD_ERR_INVALID, "kvtier: tier %d has no store", i);
            return NULL;
        }
    pd_kvt_tiers *t = pd_calloc(1, sizeof *t);
    if (!t) {
        pd_err_set(err, PD_ERR_NOMEM, "kvtier: out of memory");
        return NULL;
    }
    t->p = *p;
    if (t->p.queue_max <= 0) t->p.queue_max = 1024;
    t->block_floats = (size_t)p->geom.block_size * (size_t)p->geom.n_kv_heads * (size_t)p->geom.head_dim;
    t->page_cap = pd_kvt_page_bytes(&p->geom, PD_KVT_F32);  // the largest dtype
    t->n_threads = p->n_threads <= 0 ? 1 : p->n_threads > PD_KVT_MAX_WORKERS ? PD_KVT_MAX_WORKERS : p->n_threads;
    bool pages_ok = true;
    for (int w = 0; w < t->n_threads; w++) pages_ok = (t->pages[w] = pd_malloc(t->page_cap)) && pages_ok;
    pthread_mutex_init(&t->mu, NULL);
    pthread_mutex_init(&t->ev_mu, NULL);
    for (int i = 0; i < p->n_stores; i++) {
        t->evict_tier[i] = i;
        pd_kvt_store_set_evict_hook(p->stores[i], on_store_evict, &t->evict_tier[i]);
    }
    pthread_cond_init(&t->cv, NULL);
    pthread_cond_init(&t->idle_cv, NULL);
    t->st.n_tiers = p->n_stores;
    for (int i = 0; i < p->n_stores; i++)
        snprintf(t->st.tier[i].name, sizeof t->st.tier[i].name, "%s", pd_kvt_store_name(p->stores[i]));
    snapshot(t);
    int started = 0;
    for (; pages_ok && started < t->n_threads; started++) {
        worker_arg *wa = pd_malloc(sizeof *wa);
        if (wa) *wa = (worker_arg){.t = t, .index = started};
        if (!wa || pthread_create(&t->threads[started], NULL, tier_main, wa)) {
            pd_free(wa);
            break;
        }
    }
    if (started < t->n_threads) {
        pthread_mutex_lock(&t->mu);
        t->stop = true;
        pthread_cond_broadcast(&t->cv);
        pthread_mutex_unlock(&t->mu);
        for (int w = 0; w < started; w++) pthread_join(t->threads[w], NULL);
        for (int w = 0; w < t->n_threads; w++) pd_free(t->pages[w]);
        pd_free(t);
        pd_err_set(err, PD_ERR_NOMEM, "kvtier: cannot start the tier threads");
        return NULL;
    }
    return t;
}

void pd_kvt_tiers_free(pd_kvt_tiers *t) {
    if (!t) return;
    pthread_mutex_lock(&t->mu);
    t->stop = true;
    pthread_cond_broadcast(&t->cv);
    pthread_mutex_unlock(&t->mu);
    for (int w = 0; w < t->n_threads; w++) pthread_join(t->threads[w], NULL);
    for (int i = 0; i < t->p.n_stores; i++) pd_kvt_store_free(t->p.stores[i]);
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->ev_mu);
    pthread_cond_destroy(&t->cv);
    pthread_cond_destroy(&t->idle_cv);
    for (int w = 0; w < t->n_threads; w++) pd_free(t->pages[w]);
    pd_free(t);
}

static void enqueue(pd_kvt_tiers *t, job *j) {
    j->next = NULL;
    job **head = j->kind == 2 ? &t->lhead : &t->head, **tail = j->kind == 2 ? &t->ltail : &t->tail;
    if (*tail) (*tail)->next = j;
    else *head = j;
    *tail = j;
    t->busy = true;
    pthread_cond_signal(&t->cv);
}

// Write-back admission: false (and one more drop counted) when the offload queue is full.
static bool offload_queue_full(pd_kvt_tiers *t) {
    pthread_mutex_lock(&t->mu);
    bool full = t->n_queued_offloads >= t->p.queue_max;
    if (full) t->st.offloads_dropped++;
    pthread_mutex_unlock(&t->mu);
    return full;
}

// Queues offload job j for the tier workers.
static void offload_submit(pd_kvt_tiers *t, job *j) {
    pthread_mutex_lock(&t->mu);
    t->n_queued_offloads++;
    t->st.offloads_queued++;
    enqueue(t, j);
    pthread_mutex_unlock(&t->mu);
}

pd_status pd_kvt_tiers_offload(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, const float *const *k,
                               const float *const *v) {
    if (offload_queue_full(t)) return PD_NOSPACE;
    job *j = pd_calloc(1, sizeof *j);
    size_t L = (size_t)t->p.geom.n_layers;
    float *rows = j ? pd_malloc(L * 2 * t->block_floats * sizeof(float)) : NULL;
    if (!rows) {
        pd_free(j);
        return PD_ERR_NOMEM;
    }
    for (size_t l = 0; l < L; l++) {
        memcpy(rows + (2 * l) * t->block_floats, k[l], t->block_floats * sizeof(float));
        memcpy(rows + (2 * l + 1) * t->block_floats, v[l], t->block_floats * sizeof(float));
    }
    j->kind = 1;
    j->hash = hash;
    j->parent = parent;
    j->rows = rows;
    offload_submit(t, j);
    return PD_OK;
}

pd_status pd_kvt_tiers_offload_fill(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, pd_kvt_fill_fn fill,
                                    void *ud) {
    return pd_kvt_tiers_offload_fill_to(t, 0, hash, parent, fill, ud);
}

pd_status pd_kvt_tiers_offload_fill_to(pd_kvt_tiers *t, uint32_t only, pd_hash128 hash, pd_hash128 parent,
                                       pd_kvt_fill_fn fill, void *ud) {
    if (!fill || only >> t->p.n_stores) return PD_ERR_INVALID;
    if (offload_queue_full(t)) return PD_NOSPACE;
    job *j = pd_calloc(1, sizeof *j);
    if (!j) return PD_ERR_NOMEM;
    j->kind = 1;
    j->hash = hash;
    j->parent = parent;
    j->fill = fill;
    j->fill_ud = ud;
    j->only = only;
    offload_submit(t, j);
    return PD_OK;
}

pd_status pd_kvt_tiers_offload_bf16(pd_kvt_tiers *t, pd_hash128 hash, pd_hash128 parent, const uint16_t *const *k,
                                    const uint16_t *const *v, void (*release)(void *ud), void *ud) {
    return pd_kvt_tiers_offload_bf16_to(t, 0, hash, parent, k, v, release, ud);
}

pd_status pd_kvt_tiers_offload_bf16_to(pd_kvt_tiers *t, uint32_t only, pd_hash128 hash, pd_hash128 parent,
                                       const uint16_t *const *k, const uint16_t *const *v, void (*release)(void *ud),
                                       void *ud) {
    if (!k || !v || !release || only >> t->p.n_stores) return PD_ERR_INVALID;
    if (offload_queue_full(t)) return PD_NOSPACE;
    job *j = pd_calloc(1, sizeof *j);
    if (!j) return PD_ERR_NOMEM;
    j->kind = 1;
    j->hash = hash;
    j->parent = parent;
    j->bk = k;
    j->bv = v;
    j->release = release;
    j->fill_ud = ud;
    j->only = only;
    offload_submit(t, j);
    return PD_OK;
}

int pd_kvt_tiers_match(pd_kvt_tiers *t, const pd_hash128 *hashes, int n, int *tier_of, double *cost_us) {
    int m = 0;
    double cost = 0;
    for (; m < n; m++) {
        int found = -1;
        for (int i = 0; i < t->p.n_stores && found < 0; i++)
            if (pd_kvt_store_contains(t->p.stores[i], hashes[m])) found = i;
        if (found < 0) break;
        if (tier_of) tier_of[m] = found;
        pthread_mutex_lock(&t->mu);
        double bw = t->bw_bytes_per_us[found];
        pthread_mutex_unlock(&t->mu);
        size_t bytes = pd_kvt_page_bytes(&t->p.geom, tier_dtype(t, found));
        cost += bw > 0 ? (double)bytes / bw : 100.0;  // unmeasured: 100 us per block
    }
    if (cost_us) *cost_us = cost;
    return m;
}

int pd_kvt_tiers_probe(pd_kvt_tiers *t, const pd_hash128 *hashes, int n, int *n_sure, double *cost_us) {
    int m = 0, sure = 0;
    double cost = 0;
    for (; m < n; m++) {
        int found = -1;
        bool maybe = false;
        for (int i = 0; i < t->p.n_stores && found < 0; i++) {
            int r = pd_kvt_store_probe(t->p.stores[i], hashes[m]);
            if (r > 0) found = i;
            else if (r < 0 && !maybe) {
                maybe = true;
                found = -2 - i;  // the first tier that may hold it
            }
            if (maybe) break;
        }
        if (found == -1) break;
        int tier = found >= 0 ? found : -2 - found;
        if (found >= 0 && sure == m) sure++;
        pthread_mutex_lock(&t->mu);
        double bw = t->bw_bytes_per_us[tier];
        pthread_mutex_unlock(&t->mu);
        size_t bytes = pd_kvt_page_bytes(&t->p.geom, tier_dtype(t, tier));
        cost += bw > 0 ? (double)bytes / bw : 100.0;
    }
    if (n_sure) *n_sure = sure;
    if (cost_us) *cost_us = cost;
    return m;
}

pd_status pd_kvt_tiers_load(pd_kvt_tiers *t, uint64_t req_id, const pd_hash128 *hashes, int n,
                            float *const *const *dst_k, float *const *const *dst_v, pd_kvt_load_fn done, void *ud) {
    return pd_kvt_tiers_load_ex(t, req_id, hashes, n, dst_k, dst_v, NULL, NULL, NULL, done, ud);
}

pd_status pd_kvt_tiers_load_ex(pd_kvt_tiers *t, uint64_t req_id, const pd_hash128 *hashes, int n,
                               float *const *const *dst_k, float *const *const *dst_v, uint16_t *const *const *dst_bk,
                               uint16_t *const *const *dst_bv, pd_kvt_block_fn block_done, pd_kvt_load_fn done,
                               void *ud) {
    if (!dst_bk != !dst_bv) return PD_ERR_INVALID;
    if (n < 0 || !done || (n > 0 && (!hashes || !dst_k || !dst_v))) return PD_ERR_INVALID;
    job *j = pd_calloc(1, sizeof *j);
    pd_hash128 *hs = j && n ? pd_malloc((size_t)n * sizeof *hs) : NULL;
    if (!j || (n && !hs)) {
        pd_free(j);
        pd_free(hs);
        return PD_ERR_NOMEM;
    }
    if (n) memcpy(hs, hashes, (size_t)n * sizeof *hs);
    j->kind = 2;
    j->req_id = req_id;
    j->hashes = hs;
    j->n = n;
    j->dst_k = dst_k;
    j->dst_v = dst_v;
    j->done = done;
    j->block_done = block_done;
    j->dst_bk = dst_bk;
    j->dst_bv = dst_bv;
    j->ud = ud;
    pthread_mutex_lock(&t->mu);
    enqueue(t, j);
    pthread_mutex_unlock(&t->mu);
    return PD_OK;
}

int pd_kvt_tiers_events_drain(pd_kvt_tiers *t, pd_kvt_event *out, int n_max) {
    pthread_mutex_lock(&t->ev_mu);
    int n = t->ev_n < n_max ? t->ev_n : n_max;
    for (int i = 0; i < n; i++) out[i] = t->ev[(t->ev_head + i) % EV_CAP];
    t->ev_head = (t->ev_head + n) % EV_CAP;
    t->ev_n -= n;
    pthread_mutex_unlock(&t->ev_mu);
    return n;
}

const char *pd_kvt_tiers_name(pd_kvt_tiers *t, int tier) {
    return tier >= 0 && tier < t->p.n_stores ? pd_kvt_store_name(t->p.stores[tier]) : "?";
}

bool pd_kvt_tiers_flush(pd_kvt_tiers *t, int timeout_ms) {
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += timeout_ms / 1000;
    dl.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
    if (dl.tv_nsec >= 1000000000) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000;
    }
    pthread_mutex_lock(&t->mu);
    while ((t->head || t->lhead || t->busy || t->n_running) && pthread_cond_timedwait(&t->idle_cv, &t->mu, &dl) == 0) {
    }
    bool idle = !t->head && !t->lhead && !t->busy && !t->n_running;
    pthread_mutex_unlock(&t->mu);
    return idle;
}

void pd_kvt_tiers_stats_get(pd_kvt_tiers *t, pd_kvt_tiers_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->st;
    for (int i = 0; i < t->p.n_stores; i++) out->tier[i].store = t->snap[i];
    pthread_mutex_unlock(&t->mu);
    // Redis's own evictions arrive on their thread, not with a tier job: read them now (lock-free).
    for (int i = 0; i < t->p.n_stores; i++)
        if (!strcmp(pd_kvt_store_name(t->p.stores[i]), "redis")) {
            pd_kvt_redis_notify_stats(t->p.stores[i], &out->remote_notify);
            out->tier[i].store.evictions = out->remote_notify.evicted + out->remote_notify.expired;
        }
    pthread_mutex_lock(&t->ev_mu);
    out->events_dropped = t->ev_dropped;
    pthread_mutex_unlock(&t->ev_mu);
}
