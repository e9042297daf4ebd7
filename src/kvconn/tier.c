// tier.c — the tier connector: the KV tiers below the device pool (kvtier/: host DRAM, local disk,
// Redis) behind the connector interface (kvconn.h, "KV tiers"). The engine calls only this file's
// pd_kvconn_tiers_* functions; every tier operation runs on the tier chain's own thread
// (kvtier/tiers.c), so the engine thread only copies a block's rows into an offload job, probes
// the tiers' in-memory indexes without waiting (pd_kvt_tiers_probe) and queues loads. A load
// decodes straight into the blocks the scheduler reserved for it (LOADING_TIER: nothing else reads
// or writes them until the TIER_LOADED event is handled on the engine thread).
//
// The DRAM tier's pages live in one host allocation from the backend interface
// (pd_backend_host_alloc: pinned on CUDA, plain on the CPU backend), cut into page slots.
//
// Pool memory, two paths:
//   direct   a host-resident f32 cache (the cpu backend): its blocks are the pages' own layout
//            (block_size rows of n_kv_heads x head_dim floats per layer, K then V); offload copies
//            the rows into the job, loads decode straight into the reserved blocks.
//   staged   a device cache (CUDA, bf16; or f32 with PDSERVE_KV_TIER_STAGING=1, the test hook that
//            runs this path on the cpu backend): a ring of block slots in pinned host memory laid
//            out like a cache (per layer K and V bases, slot = block index), moved by
//            pd_op_kv_copy_xfer on the backend's transfer stream. Offload: the blocks saved by one
//            drain go in ONE copy (every layer, every block) device -> slots, then a fence
//            (pd_backend_xfer_fence: the compute stream waits for the copy on the device, so the
//            blocks may be reused at once); pd_kvconn_tiers_poll hands the finished slots to the
//            tier thread, which converts bf16 -> f32, encodes and writes, then frees the slot.
//            Load: the tier thread decodes each block into an f32 scratch block and converts it
//            into a slot; at TIER_LOADED the engine thread enqueues ONE copy slots -> reserved
//            blocks and a fence (the next step's compute runs after it; the host never waits),
//            and the slots are freed when the fence is reached. No slot free: the save is
//            dropped (counted) / the load is cut to the slots there are (the rest is computed).
//            An fp8 KV cache is refused (its rows carry their own scales; no page codec for them).
//   hot      a device cache with --kv-offload-dram (the default; PDSERVE_KV_TIER_HOT=0: off): the
//            DRAM tier is not in the chain but here, its pages being slots laid out like the cache
//            (see "the DRAM tier of a device cache" below): saves go device -> DRAM slots in the
//            one copy and DRAM hits come back in one copy per request on the engine thread; the
//            staging slots above serve only disk / Redis loads (and every save when hot is off).
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#include <string.h>
#include <xxhash.h>

#include "kvconn/kvconn.h"
#include "kvconn/kvconn_impl.h"
#include "kvtier/kvtier.h"

// The DRAM tier's page memory: one allocation from the backend (pinned host memory on CUDA, plain
// on the CPU backend) cut into fixed slots of one page each (every DRAM page has the same size:
// one dtype, one geometry). One slot more than the capacity holds: a put allocates its copy before the
// policy evicts to make room.
typedef struct page_arena {
    pd_backend *backend;
    uint8_t *base;
    size_t slot, n_slots;
    int32_t *free_list;  // stack of free slot indexes
    size_t n_free;
    pthread_mutex_t mu;
} page_arena;

static void *arena_alloc(void *ud, size_t n) {
    page_arena *a = ud;
    void *p = NULL;
    pthread_mutex_lock(&a->mu);
    if (n <= a->slot && a->n_free > 0) p = a->base + (size_t)a->free_list[--a->n_free] * a->slot;
    pthread_mutex_unlock(&a->mu);
    return p;
}

static void arena_free(void *ud, void *p) {
    page_arena *a = ud;
    size_t i = (size_t)((uint8_t *)p - a->base) / a->slot;
    PD_ASSERT((uint8_t *)p >= a->base && i < a->n_slots && (uint8_t *)p == a->base + i * a->slot);
    pthread_mutex_lock(&a->mu);
    PD_ASSERT(a->n_free < a->n_slots);
    a->free_list[a->n_free++] = (int32_t)i;
    pthread_mutex_unlock(&a->mu);
}

static void arena_fini(page_arena *a) {
    if (!a->base) return;
    pd_backend_host_free(a->backend, a->base);
    pd_free(a->free_list);
    pthread_mutex_destroy(&a->mu);
    a->base = NULL;
}

static pd_status arena_init(page_arena *a, pd_backend *b, size_t slot, uint64_t capacity, pd_err *err) {
    a->backend = b;
    a->slot = slot;
    a->n_slots = (size_t)(capacity / slot) + 1;
    if (a->n_slots > INT32_MAX || a->n_slots > SIZE_MAX / slot)
        return pd_err_set(err, PD_ERR_INVALID, "--kv-offload-dram: %llu bytes is too large", (unsigned long long)capacity);
    a->base = pd_backend_host_alloc(b, a->n_slots * slot);
    a->free_list = pd_malloc(a->n_slots * sizeof *a->free_list);
    if (!a->base || !a->free_list) {
        pd_backend_host_free(b, a->base);
        pd_free(a->free_list);
        a->base = NULL;
        return pd_err_set(err, PD_ERR_NOMEM, "--kv-offload-dram: cannot allocate %zu bytes of %s host memory",
                          a->n_slots * slot, pd_backend_host_is_pinned(b) ? "pinned" : "plain");
    }
    for (size_t i = 0; i < a->n_slots; i++) a->free_list[i] = (int32_t)(a->n_slots - 1 - i);
    a->n_free = a->n_slots;
    pthread_mutex_init(&a->mu, NULL);
    return PD_OK;
}

// Pinned staging for a device cache (the staged path): n_slots block slots, laid out like a cache.
typedef struct stage {
    uint8_t *base;
    int n_slots;
    void **k, **v;          // (n_layers) layer bases: k[l] = base + 2l * n_slots * block_bytes
    bool is_bf16;           // the cache's element type (else f32)
    int32_t *free_list;
    int n_free;
    pthread_mutex_t mu;     // slots are freed on the tier thread too
} stage;

// ---- the DRAM tier of a device cache ("hot"): pages that ARE the staged device-layout rows ----
// A device cache with --kv-offload-dram keeps its DRAM tier here, not in the kvtier chain: one
// pinned allocation laid out like a cache (per layer K and V bases, slot = block index), so
//   offload  = the one batched device -> slot copy (pd_op_kv_copy_xfer on the transfer stream);
//              at its fence the slot becomes the page (no encode, no memcpy, no tier worker);
//   load     = one batched slot -> reserved blocks copy per request on the transfer stream,
//              enqueued on the engine thread at start_load (no decode, no staging slot);
//   lower    = disk / Redis (the kvtier chain) are fed from these pages by the tier workers
//              (encode there, off the hot path): at a DRAM eviction (write-back, a victim cache),
//              or at once when Redis (the cluster pool) is in the chain. A page being encoded is
//              pinned (refs) and its slot freed when the last user lets go.
// The pages are process-private pinned memory: no checksum (disk and Redis pages keep theirs).
// Policy: S3-FIFO over block hashes (kvtier's policy), capacity = the configured bytes / page.
// PDSERVE_KV_TIER_HOT=0 turns it off (the DRAM tier goes back into the chain: encoded pages).
enum { HOT_FREE = 0, HOT_FILLING = 1, HOT_RESIDENT = 2, HOT_EVICTED = 3 };

typedef struct hot_slot {
    pd_hash128 hash, parent;
    int32_t refs;           // copies enqueued from it, lower-tier encodes of it
    uint8_t state;
} hot_slot;

typedef struct hot {
    uint8_t *base;
    int n_slots, cap_blocks;  // slots (capacity + headroom for copies in flight), policy capacity
    void **k, **v;          // (n_layers) layer bases
    hot_slot *s;
    int32_t *free_list;
    int n_free;
    int32_t *map;           // open addressing, linear probing: hash -> slot (-1 empty)
    uint32_t map_mask;
    pd_kvt_policy *pol;
    pthread_mutex_t mu;     // slots are unpinned on tier workers too
    int64_t hits, misses, puts, evictions, bytes_in, bytes_out, offloads, loads, load_blocks, drops;
    int n_lower_pinned, max_lower_pinned;  // slots pinned by lower-tier writes, and the cap on them
    int64_t lower_skipped;  // lower-tier writes not offered: that cap reached (the slots go to saves)
    int64_t load_hist[24];
    double us_per_block;    // measured (enqueue -> fence reached), EWMA
    pd_kvconn_tier_event ev[4096];
    int ev_head, ev_n;
} hot;

static uint32_t hot_h(const hot *h, pd_hash128 k) { return (uint32_t)(k.lo ^ (k.hi * 0x9E3779B97F4A7C15ull)) & h->map_mask; }

static int hot_find(const hot *h, pd_hash128 k) {
    for (uint32_t i = hot_h(h, k);; i = (i + 1) & h->map_mask) {
        int32_t s = h->map[i];
        if (s < 0) return -1;
        if (h->s[s].hash.lo == k.lo && h->s[s].hash.hi == k.hi) return s;
    }
}

static void hot_map_add(hot *h, int slot) {
    uint32_t i = hot_h(h, h->s[slot].hash);
    while (h->map[i] >= 0) i = (i + 1) & h->map_mask;
    h->map[i] = slot;
}

static void hot_map_del(hot *h, int slot) {  // backward-shift deletion
    uint32_t i = hot_h(h, h->s[slot].hash);
    while (h->map[i] != slot) i = (i + 1) & h->map_mask;
    for (uint32_t j = i;;) {
        h->map[i] = -1;
        for (;;) {
            j = (j + 1) & h->map_mask;
            if (h->map[j] < 0) return;
            uint32_t home = hot_h(h, h->s[h->map[j]].hash);
            // j's entry may move to i when its home is not cyclically in (i, j]
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) break;
        }
        h->map[i] = h->map[j];
        i = j;
    }
}

static void hot_event(hot *h, bool stored, pd_hash128 hash, pd_hash128 parent) {
    if (h->ev_n == 4096) {
        h->ev_head = (h->ev_head + 1) % 4096;
        h->ev_n--;
    }
    h->ev[(h->ev_head + h->ev_n) % 4096] = (pd_kvconn_tier_event){.kind = PD_KVCONN_TIER_DRAM, .is_stored = stored,
                                                                 .hash = hash, .parent = parent};
    h->ev_n++;
}

static void hot_release_locked(hot *h, int slot) {
    PD_ASSERT(h->s[slot].refs > 0);
    if (--h->s[slot].refs == 0 && h->s[slot].state == HOT_EVICTED) {
        h->s[slot].state = HOT_FREE;
        h->free_list[h->n_free++] = slot;
    }
}


typedef struct pending_save {  // saved since the last poll (engine thread)
    int32_t block;
    pd_hash128 hash, parent;
} pending_save;

typedef struct inflight {  // a slot whose copy is enqueued, by fence (engine thread)
    uint64_t fence;
    int32_t slot;
    bool is_save;           // true: hand to the tier thread; false: a load's slot, free it
    uint8_t kind;           // FLY_STAGE (a staging slot, as is_save says) or a hot slot's save / load
    int n_load;             // FLY_HOT_LOAD, first block of a load: its block count and enqueue time
    int64_t t0;
    pd_hash128 hash, parent;
} inflight;
enum { FLY_STAGE = 0, FLY_HOT_SAVE = 1, FLY_HOT_LOAD = 2 };

typedef struct lw_copy {  // a same-step load's block, queued for pd_kvconn_tiers_load_now_commit
    int32_t slot, dst;
    int n_load;             // the load's first block: its block count and queue time (else 0)
    int64_t t0;
} lw_copy;

struct pd_kvconn_tiers {
    pd_kvconn_tier_params p;
    // Same-step loads (pd_kvconn_tiers_load_now): pinned there, copied at the step's commit.
    int lw_group;           // layers a copy covers at a layer-wise commit (PDSERVE_KV_TIER_LAYERWISE)
    lw_copy *lw;
    int n_lw, cap_lw;
    int lw_marked, lw_waited;  // layers of the last layer-wise commit, and how many were waited for
    int64_t lw_commits, lw_layered, lw_fallbacks;  // commits, of them layer-wise, and fenced at step end
    uint64_t save_fence;                           // the last saves' copy (0: none yet)
    // Just-in-time layer-wise commit (PDSERVE_KV_TIER_JIT=1): the commit enqueues the first layer
    // group only; pd_kvconn_tiers_layer_wait(l) enqueues the groups up to l's as the forward's
    // launch reaches them, and step_end the rest. The copies' host cost then overlaps the device
    // running the earlier layers instead of preceding the forward.
    bool lw_jit;
    bool jit_open;               // a commit whose groups are not all enqueued yet
    int jit_next;                // first layer not enqueued
    int32_t *jit_src, *jit_dst, *jit_rows;
    int jit_n;
    int64_t lw_saves_pending;                      // commits made while that copy still ran
    bool is_staged;
    stage st;
    pending_save *pend;
    int n_pend, cap_pend;
    inflight *fly;          // FIFO (fences complete in order)
    int n_fly, cap_fly;
    int64_t staged_drops;   // saves dropped for want of a slot
    int64_t load_cuts;      // loads cut short for want of slots
    int64_t staged_resident;  // saves skipped: the (DRAM-only) chain already held the block
    int n_tiers;
    page_arena arena;     // the DRAM tier's pages (the chain's DRAM store: host cache, or hot off)
    hot hot;              // a device cache's DRAM tier (use_hot): pages = staged rows
    bool use_hot;
    uint32_t hot_lower_on_evict, hot_lower_at_insert;  // chain tiers fed from DRAM (bit i: chain tier i)
    pd_kvt_tiers *t;      // the kvtier chain; NULL when hot is the only tier
    pd_kvt_geom geom;
    size_t block_bytes;   // one block, one layer, K or V
    char remote[128];     // the Redis URL (for /status), "" without
    char disk_dir[512];
    pd_kvt_dtype dtype;   // lower tiers' pages
};

typedef struct tier_load {  // one load in flight: the destination row pointers (owned)
    pd_kvconn_tiers *c;
    int n;
    int n_pre;               // leading blocks already uploaded from the hot DRAM tier
    int32_t *slots, *dst;    // staged: (n) the slots and the reserved blocks
    float *scratch;          // staged: one block of f32 rows (every dk[i] / dv[i] points here)
    uint16_t ***bk, ***bv;   // staged bf16: (n) per block, the slot's K / V rows of each layer
    uint16_t **brows;        // (2 * n * n_layers) the pointer storage behind bk / bv
    float ***dk, ***dv;      // (n) blocks x (n_layers) rows
    float **rows;            // (2 * n * n_layers) the pointer storage behind dk / dv
} tier_load;

static void tier_load_free(tier_load *l) {
    if (!l) return;
    pd_free(l->dk);
    pd_free(l->dv);
    pd_free(l->rows);
    pd_free(l->slots);
    pd_free(l->dst);
    pd_free(l->scratch);
    pd_free(l->bk);
    pd_free(l->bv);
    pd_free(l->brows);
    pd_free(l);
}

void kvc_tier_load_free(void *l) { tier_load_free(l); }

// ---- staging slots ----
static size_t block_bytes_all(const pd_kvconn_tiers *c) { return 2 * (size_t)c->geom.n_layers * c->block_bytes; }

static int slot_get(stage *s) {
    pthread_mutex_lock(&s->mu);
    int i = s->n_free > 0 ? s->free_list[--s->n_free] : -1;
    pthread_mutex_unlock(&s->mu);
    return i;
}

static void slot_put(stage *s, int i) {
    pthread_mutex_lock(&s->mu);
    PD_ASSERT(i >= 0 && i < s->n_slots && s->n_free < s->n_slots);
    s->free_list[s->n_free++] = i;
    pthread_mutex_unlock(&s->mu);
}

// A pinned slot arena laid out like the device cache (layer-major: K of every slot, then V): the
// per-layer bases into base, and every slot on the free list.
static void slots_layout(const pd_kvconn_tiers *c, uint8_t *base, size_t n, void **k, void **v, int32_t *free_list) {
    for (int l = 0; l < c->geom.n_layers; l++) {
        k[l] = base + (size_t)(2 * l) * n * c->block_bytes;
        v[l] = base + (size_t)(2 * l + 1) * n * c->block_bytes;
    }
    for (size_t i = 0; i < n; i++) free_list[i] = (int32_t)(n - 1 - i);
}

static pd_status stage_init(pd_kvconn_tiers *c, pd_err *err) {
    stage *s = &c->st;
    size_t per = block_bytes_all(c);
    // 1 GiB of pinned staging, 64 .. 1024 slots (a 2000-token prompt of Llama-3-8B is 125 blocks).
    size_t n = ((size_t)1 << 30) / per;
    n = n < 64 ? 64 : n > 1024 ? 1024 : n;
    s->n_slots = (int)n;
    int L = c->geom.n_layers;
    s->base = pd_backend_host_alloc(c->p.backend, n * per);
    s->k = pd_calloc((size_t)L, sizeof *s->k);
    s->v = pd_calloc((size_t)L, sizeof *s->v);
    s->free_list = pd_malloc(n * sizeof *s->free_list);
    if (!s->base || !s->k || !s->v || !s->free_list) {
        pd_backend_host_free(c->p.backend, s->base);
        pd_free(s->k), pd_free(s->v), pd_free(s->free_list);
        memset(s, 0, sizeof *s);
        return pd_err_set(err, PD_ERR_NOMEM, "kv tiers: cannot allocate %zu bytes of host staging", n * per);
    }
    slots_layout(c, s->base, n, s->k, s->v, s->free_list);
    s->n_free = (int)n;
    pthread_mutex_init(&s->mu, NULL);
    return PD_OK;
}

static void stage_fini(pd_kvconn_tiers *c) {
    stage *s = &c->st;
    if (!s->base) return;
    pd_backend_host_free(c->p.backend, s->base);
    pd_free(s->k), pd_free(s->v), pd_free(s->free_list);
    pthread_mutex_destroy(&s->mu);
    memset(s, 0, sizeof *s);
}

// Slot rows <-> f32 block rows (per layer K then V, block_floats each).
// (On the tier thread. A bf16 cache's offloads skip slot_to_f32: on_save_release.)
static void slot_to_f32(pd_kvconn_tiers *c, int slot, float *rows) {
    size_t nf = c->block_bytes / (c->st.is_bf16 ? 2 : 4);
    for (int lk = 0; lk < 2 * c->geom.n_layers; lk++) {
        int l = lk / 2, kv = lk % 2;
            const uint8_t *src = (const uint8_t *)(kv ? c->st.v[l] : c->st.k[l]) + (size_t)slot * c->block_bytes;
            float *dst = rows + (size_t)(2 * l + kv) * nf;
            if (!c->st.is_bf16) {
                memcpy(dst, src, c->block_bytes);
                continue;
            }
            const uint16_t *h = (const uint16_t *)src;
            for (size_t i = 0; i < nf; i++) dst[i] = pd_bf16_to_f32(h[i]);
        }
}

static void f32_to_slot(pd_kvconn_tiers *c, const float *rows, int slot) {
    size_t nf = c->block_bytes / (c->st.is_bf16 ? 2 : 4);
    for (int lk = 0; lk < 2 * c->geom.n_layers; lk++) {
        int l = lk / 2, kv = lk % 2;
            uint8_t *dst = (uint8_t *)(kv ? c->st.v[l] : c->st.k[l]) + (size_t)slot * c->block_bytes;
            const float *src = rows + (size_t)(2 * l + kv) * nf;
            if (!c->st.is_bf16) {
                memcpy(dst, src, c->block_bytes);
                continue;
            }
            uint16_t *h = (uint16_t *)dst;
            for (size_t i = 0; i < nf; i++) h[i] = pd_f32_to_bf16(src[i]);
        }
}

typedef struct save_fill {
    pd_kvconn_tiers *c;
    int slot;
} save_fill;

// A bf16 cache's save: the tier thread encodes bf16 pages straight from the slot's rows
// (pd_kvt_tiers_offload_bf16), then frees the slot here.
typedef struct save_bf16 {
    pd_kvconn_tiers *c;
    int slot;
    const uint16_t **rows;  // (2 * n_layers): K of each layer, then V of each layer
} save_bf16;

static void on_save_release(void *ud) {
    save_bf16 *f = ud;
    slot_put(&f->c->st, f->slot);
    pd_free(f->rows);
    pd_free(f);
}

static pd_status offload_slot_bf16(pd_kvconn_tiers *c, const inflight *x) {
    int L = c->geom.n_layers;
    save_bf16 *f = pd_malloc(sizeof *f);
    const uint16_t **rows = pd_malloc(sizeof *rows * 2 * (size_t)L);
    if (!f || !rows) {
        pd_free(f);
        pd_free(rows);
        return PD_ERR_NOMEM;
    }
    for (int l = 0; l < L; l++) {
        rows[l] = (const uint16_t *)((const uint8_t *)c->st.k[l] + (size_t)x->slot * c->block_bytes);
        rows[L + l] = (const uint16_t *)((const uint8_t *)c->st.v[l] + (size_t)x->slot * c->block_bytes);
    }
    *f = (save_bf16){.c = c, .slot = x->slot, .rows = rows};
    pd_status st = pd_kvt_tiers_offload_bf16(c->t, x->hash, x->parent, rows, rows + L, on_save_release, f);
    if (st != PD_OK) {
        pd_free(rows);
        pd_free(f);
    }
    return st;
}

// On the tier thread: the slot's copy has finished (its fence was reached).
static bool on_save_fill(void *ud, float *rows) {
    save_fill *f = ud;
    if (rows) slot_to_f32(f->c, f->slot, rows);
    slot_put(&f->c->st, f->slot);
    pd_free(f);
    return rows != NULL;
}

static bool fly_push(pd_kvconn_tiers *c, inflight x) {
    if (c->n_fly == c->cap_fly) {
        int cap = c->cap_fly ? 2 * c->cap_fly : 256;
        inflight *n = pd_realloc(c->fly, sizeof *n * (size_t)cap);
        if (!n) return false;
        c->fly = n;
        c->cap_fly = cap;
    }
    c->fly[c->n_fly++] = x;
    return true;
}

typedef struct hot_lower {  // a page being written to the lower tiers by a tier worker
    pd_kvconn_tiers *c;
    int slot;
    const uint16_t **rows;  // bf16: (2 * n_layers) K of each layer, then V
} hot_lower;

static void hot_lower_release(void *ud) {
    hot_lower *x = ud;
    hot *h = (&x->c->hot);
    pthread_mutex_lock(&h->mu);
    h->n_lower_pinned--;
    hot_release_locked(h, x->slot);
    pthread_mutex_unlock(&h->mu);
    pd_free(x->rows);
    pd_free(x);
}

static bool hot_lower_fill(void *ud, float *rows) {  // an f32 cache (the cpu test hook): copy out
    hot_lower *x = ud;
    if (rows) {
        size_t bb = x->c->block_bytes;
        hot *h = (&x->c->hot);
        for (int l = 0; l < x->c->geom.n_layers; l++) {
            memcpy((uint8_t *)rows + (size_t)(2 * l) * bb, (uint8_t *)h->k[l] + (size_t)x->slot * bb, bb);
            memcpy((uint8_t *)rows + (size_t)(2 * l + 1) * bb, (uint8_t *)h->v[l] + (size_t)x->slot * bb, bb);
        }
    }
    hot_lower_release(x);
    return rows != NULL;
}

// Under h->mu: hand slot's page to the lower tiers (pinned until a tier worker is done with it).
static void hot_offer_lower(pd_kvconn_tiers *c, int slot, uint32_t only) {
    hot *h = (&c->hot);
    int L = c->geom.n_layers;
    size_t bb = c->block_bytes;
    if (h->n_lower_pinned >= h->max_lower_pinned) {  // disk behind: DRAM's own saves come first
        h->lower_skipped++;
        return;
    }
    hot_lower *x = pd_malloc(sizeof *x);
    if (!x) return;
    *x = (hot_lower){.c = c, .slot = slot};
    h->s[slot].refs++;
    pd_status st;
    if (c->st.is_bf16) {
        x->rows = pd_malloc(sizeof *x->rows * 2 * (size_t)L);
        if (!x->rows) {
            h->s[slot].refs--;
            pd_free(x);
            return;
        }
        for (int l = 0; l < L; l++) {
            x->rows[l] = (const uint16_t *)((const uint8_t *)h->k[l] + (size_t)slot * bb);
            x->rows[L + l] = (const uint16_t *)((const uint8_t *)h->v[l] + (size_t)slot * bb);
        }
        st = pd_kvt_tiers_offload_bf16_to(c->t, only, h->s[slot].hash, h->s[slot].parent, x->rows, x->rows + L,
                                       hot_lower_release, x);
    } else
        st = pd_kvt_tiers_offload_fill_to(c->t, only, h->s[slot].hash, h->s[slot].parent, hot_lower_fill, x);
    if (st != PD_OK) {  // queue full (counted by the chain) or no memory
        h->s[slot].refs--;
        pd_free(x->rows);
        pd_free(x);
    } else
        h->n_lower_pinned++;
}

// Called by the policy (inside pd_kvt_policy_put, under h->mu) for every page it pushes out.
static void hot_on_evict(void *ud, pd_hash128 key, uint64_t bytes) {
    (void)bytes;
    pd_kvconn_tiers *c = ud;
    hot *h = (&c->hot);
    int s = hot_find(h, key);
    if (s < 0) return;
    hot_map_del(h, s);
    h->s[s].state = HOT_EVICTED;
    h->evictions++;
    hot_event(h, false, h->s[s].hash, h->s[s].parent);
    if (c->hot_lower_on_evict) hot_offer_lower(c, s, c->hot_lower_on_evict);  // write-back to disk
    if (h->s[s].refs == 0) {
        h->s[s].state = HOT_FREE;
        h->free_list[h->n_free++] = s;
    }
}

static pd_status hot_init(pd_kvconn_tiers *c, uint64_t bytes, pd_err *err) {
    hot *h = &c->hot;
    int L = c->geom.n_layers;
    size_t per = block_bytes_all(c);
    uint64_t cap = bytes / per;
    if (cap < 1) return pd_err_set(err, PD_ERR_INVALID, "--kv-offload-dram: %llu bytes hold no %zu-byte block",
                                   (unsigned long long)bytes, per);
    if (cap > (1u << 26)) return pd_err_set(err, PD_ERR_INVALID, "--kv-offload-dram: %llu bytes is too large",
                                            (unsigned long long)bytes);
    // Headroom beyond the capacity for copies in flight (one drain can save hundreds of blocks)
    // and pages pinned by lower-tier writes (at most a quarter of it).
    uint64_t head = cap / 4 < 64 ? 64 : cap / 4 > 1024 ? 1024 : cap / 4;
    h->max_lower_pinned = (int)(head / 4);
    h->cap_blocks = (int)cap;
    h->n_slots = (int)(cap + head);
    uint32_t m = 1;
    while (m < 2u * (uint32_t)h->n_slots) m <<= 1;
    h->map_mask = m - 1;
    h->base = pd_backend_host_alloc(c->p.backend, (size_t)h->n_slots * per);
    h->k = pd_calloc((size_t)L, sizeof *h->k);
    h->v = pd_calloc((size_t)L, sizeof *h->v);
    h->s = pd_calloc((size_t)h->n_slots, sizeof *h->s);
    h->free_list = pd_malloc(sizeof *h->free_list * (size_t)h->n_slots);
    h->map = pd_malloc(sizeof *h->map * (size_t)m);
    h->pol = pd_kvt_policy_new(PD_KVT_S3FIFO, cap, hot_on_evict, c);
    if (!h->base || !h->k || !h->v || !h->s || !h->free_list || !h->map || !h->pol) {
        pd_backend_host_free(c->p.backend, h->base);
        pd_free(h->k), pd_free(h->v), pd_free(h->s), pd_free(h->free_list), pd_free(h->map);
        pd_kvt_policy_free(h->pol);
        memset(h, 0, sizeof *h);
        return pd_err_set(err, PD_ERR_NOMEM, "--kv-offload-dram: cannot allocate %zu bytes of %s host memory",
                          (size_t)(cap + head) * per, pd_backend_host_is_pinned(c->p.backend) ? "pinned" : "plain");
    }
    slots_layout(c, h->base, (size_t)h->n_slots, h->k, h->v, h->free_list);
    h->n_free = h->n_slots;
    memset(h->map, 0xff, sizeof *h->map * (size_t)m);
    pthread_mutex_init(&h->mu, NULL);
    return PD_OK;
}

static void hot_fini(pd_kvconn_tiers *c) {
    hot *h = &c->hot;
    if (!h->base) return;
    pd_backend_host_free(c->p.backend, h->base);
    pd_free(h->k), pd_free(h->v), pd_free(h->s), pd_free(h->free_list), pd_free(h->map);
    pd_kvt_policy_free(h->pol);
    pthread_mutex_destroy(&h->mu);
    memset(h, 0, sizeof *h);
}

// Leading blocks of hashes[0..n) whose pages are in (RESIDENT), under h->mu.
static int hot_lead_locked(hot *h, const pd_hash128 *hashes, int n) {
    int k = 0;
    for (; k < n; k++) {
        int s = hot_find(h, hashes[k]);
        if (s < 0 || h->s[s].state != HOT_RESIDENT) break;
    }
    return k;
}

static void hot_save_done(pd_kvconn_tiers *c, int s);

// The saves of one drain: device -> free slots in ONE copy, a fence; resident at the fence.
static void hot_start_saves(pd_kvconn_tiers *c) {
    hot *h = &c->hot;
    int n = 0;
    int32_t src[1024], dst[1024], rows[1024];
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < c->n_pend; i++) {
        int s = hot_find(h, c->pend[i].hash);
        if (s >= 0) {  // held already (or on its way): a reuse, nothing to copy
            if (h->s[s].state == HOT_RESIDENT) (void)pd_kvt_policy_get(h->pol, c->pend[i].hash);
            c->staged_resident++;
            continue;
        }
        if (n == 1024 || h->n_free == 0) {
            h->drops++;
            continue;
        }
        s = h->free_list[--h->n_free];
        h->s[s] = (hot_slot){.hash = c->pend[i].hash, .parent = c->pend[i].parent, .state = HOT_FILLING};
        hot_map_add(h, s);
        src[n] = c->pend[i].block, dst[n] = s, rows[n] = c->p.cache.block_size;
        n++;
    }
    pthread_mutex_unlock(&h->mu);
    c->n_pend = 0;
    if (!n) return;
    pd_backend_xfer_mark(c->p.backend);  // after the compute that wrote the blocks
    pd_kv_copy_params kp = {.src_k = c->p.cache.k, .src_v = c->p.cache.v, .dst_k = h->k, .dst_v = h->v,
                            .src_blocks = src, .dst_blocks = dst, .n_rows = rows, .n_blocks = n, .layer_begin = 0,
                            .layer_end = c->geom.n_layers, .block_size = c->p.cache.block_size,
                            .row_bytes = c->p.cache.row_bytes};
    pd_op_kv_copy_xfer(c->p.backend, &kp);
    uint64_t f = pd_backend_xfer_fence(c->p.backend);
    c->save_fence = f;
    for (int i = 0; i < n; i++)
        if (!fly_push(c, (inflight){.fence = f, .slot = dst[i], .kind = FLY_HOT_SAVE})) {
            pd_backend_xfer_sync(c->p.backend);  // (out of memory: wait for the copy, then take it in)
            hot_save_done(c, dst[i]);
        }
}

// A save's copy finished: the slot is the page now.
static void hot_save_done(pd_kvconn_tiers *c, int s) {
    hot *h = &c->hot;
    pthread_mutex_lock(&h->mu);
    h->s[s].state = HOT_RESIDENT;
    h->s[s].refs++;  // (the policy may evict it at once: then freed below, not inside put)
    pd_status st = pd_kvt_policy_put(h->pol, h->s[s].hash, 1);
    if (st == PD_OK) {
        h->puts++;
        h->offloads++;
        h->bytes_in += (int64_t)block_bytes_all(c);
        hot_event(h, true, h->s[s].hash, h->s[s].parent);
        if (c->hot_lower_at_insert) hot_offer_lower(c, s, c->hot_lower_at_insert);  // the pool: every block, now
    } else {
        hot_map_del(h, s);
        h->s[s].state = HOT_EVICTED;
        h->drops++;
    }
    hot_release_locked(h, s);
    pthread_mutex_unlock(&h->mu);
}

static bool lw_push(pd_kvconn_tiers *c, lw_copy x) {
    if (c->n_lw == c->cap_lw) {
        int cap = c->cap_lw ? 2 * c->cap_lw : 256;
        lw_copy *n = pd_realloc(c->lw, sizeof *n * (size_t)cap);
        if (!n) return false;
        c->lw = n;
        c->cap_lw = cap;
    }
    c->lw[c->n_lw++] = x;
    return true;
}

// A load's leading blocks held here: pinned, then ONE copy slots -> the reserved blocks on the
// transfer stream (ordered before the next step's compute by the fence). Returns how many; with
// all: n, or 0 (nothing done) unless every block is held. queue (with all): pinned and queued for
// pd_kvconn_tiers_load_now_commit instead of copied now.
static int hot_start_load(pd_kvconn_tiers *c, const pd_hash128 *hashes, const int32_t *dst_blocks, int n, bool all,
                          bool queue) {
    hot *h = &c->hot;
    int32_t *slots = pd_malloc(sizeof *slots * (size_t)n), *rows = pd_malloc(sizeof *rows * (size_t)n);
    if (!slots || !rows) {
        pd_free(slots), pd_free(rows);
        return 0;
    }
    if (queue && c->n_lw + n > c->cap_lw) {  // room first: a queued block must not fail later
        int cap = PD_MAX(c->n_lw + n, c->cap_lw ? 2 * c->cap_lw : 256);
        lw_copy *nl = pd_realloc(c->lw, sizeof *nl * (size_t)cap);
        if (!nl) {
            pd_free(slots), pd_free(rows);
            return 0;
        }
        c->lw = nl;
        c->cap_lw = cap;
    }
    pthread_mutex_lock(&h->mu);
    int k = hot_lead_locked(h, hashes, n);
    if (all && k < n) {
        pthread_mutex_unlock(&h->mu);
        pd_free(slots), pd_free(rows);
        return 0;
    }
    for (int i = 0; i < k; i++) {
        slots[i] = hot_find(h, hashes[i]);
        h->s[slots[i]].refs++;
        (void)pd_kvt_policy_get(h->pol, hashes[i]);
        rows[i] = c->p.cache.block_size;
    }
    h->hits += k;
    h->misses += k < n ? 1 : 0;
    if (k) {
        h->loads++;
        h->load_blocks += k;
        h->bytes_out += (int64_t)k * (int64_t)block_bytes_all(c);
    }
    pthread_mutex_unlock(&h->mu);
    if (k && queue) {
        int64_t t0 = pd_time_us();
        for (int i = 0; i < k; i++)
            PD_ASSERT(lw_push(c, (lw_copy){.slot = slots[i], .dst = dst_blocks[i], .n_load = i ? 0 : k, .t0 = i ? 0 : t0}));
    } else if (k) {
        pd_backend_xfer_mark(c->p.backend);  // (after whatever compute last used the blocks)
        pd_kv_copy_params kp = {.src_k = h->k, .src_v = h->v, .dst_k = c->p.cache.k, .dst_v = c->p.cache.v,
                                .src_blocks = slots, .dst_blocks = dst_blocks, .n_rows = rows, .n_blocks = k,
                                .layer_begin = 0, .layer_end = c->geom.n_layers, .block_size = c->p.cache.block_size,
                                .row_bytes = c->p.cache.row_bytes};
        int64_t t0 = pd_time_us();
        pd_op_kv_copy_xfer(c->p.backend, &kp);
        uint64_t f = pd_backend_xfer_fence(c->p.backend);
        for (int i = 0; i < k; i++)
            if (!fly_push(c, (inflight){.fence = f, .slot = slots[i], .kind = FLY_HOT_LOAD, .t0 = i ? 0 : t0,
                                        .n_load = i ? 0 : k})) {
                pd_backend_xfer_sync(c->p.backend);
                pthread_mutex_lock(&h->mu);
                hot_release_locked(h, slots[i]);
                pthread_mutex_unlock(&h->mu);
            }
    }
    pd_free(slots), pd_free(rows);
    return k;
}

static void hot_load_done(pd_kvconn_tiers *c, const inflight *x) {
    hot *h = &c->hot;
    pthread_mutex_lock(&h->mu);
    if (x->t0) {  // the load's first block: its latency (enqueue -> fence reached, as polled)
        double per = (double)(pd_time_us() - x->t0) / (double)(x->n_load > 0 ? x->n_load : 1);
        h->us_per_block = h->us_per_block > 0 ? 0.8 * h->us_per_block + 0.2 * per : per;
        int b = 0;
        while (b < 23 && ((int64_t)1 << b) <= (int64_t)per) b++;
        h->load_hist[b] += x->n_load;
    }
    hot_release_locked(h, x->slot);
    pthread_mutex_unlock(&h->mu);
}

// The saves queued since the last poll: one copy device -> slots, then a fence.
static void start_saves(pd_kvconn_tiers *c) {
    if (!c->n_pend) return;
    if (c->use_hot) {
        hot_start_saves(c);
        return;
    }
    int n = 0;
    int32_t src[1024], dst[1024], rows[1024];
    pending_save ps[1024];
    for (int i = 0; i < c->n_pend; i++) {
        // A DRAM-only chain that already holds the block (it was just loaded from there): nothing
        // to write. (With lower tiers the second sighting is what admits a block to them: offered.)
        int sure = 0;
        if (c->n_tiers == 1 && c->arena.base && pd_kvt_tiers_probe(c->t, &c->pend[i].hash, 1, &sure, NULL) == 1 && sure == 1) {
            c->staged_resident++;
            continue;
        }
        int s = n < 1024 ? slot_get(&c->st) : -1;
        if (s < 0) {
            c->staged_drops++;
            continue;
        }
        src[n] = c->pend[i].block, dst[n] = s, rows[n] = c->p.cache.block_size, ps[n] = c->pend[i];
        n++;
    }
    c->n_pend = 0;
    if (!n) return;
    pd_backend_xfer_mark(c->p.backend);  // after the compute that wrote the blocks
    pd_kv_copy_params kp = {.src_k = c->p.cache.k, .src_v = c->p.cache.v, .dst_k = c->st.k, .dst_v = c->st.v,
                            .src_blocks = src, .dst_blocks = dst, .n_rows = rows, .n_blocks = n, .layer_begin = 0,
                            .layer_end = c->geom.n_layers, .block_size = c->p.cache.block_size,
                            .row_bytes = c->p.cache.row_bytes};
    pd_op_kv_copy_xfer(c->p.backend, &kp);
    uint64_t f = pd_backend_xfer_fence(c->p.backend);
    for (int i = 0; i < n; i++)
        if (!fly_push(c, (inflight){.fence = f, .slot = dst[i], .is_save = true, .hash = ps[i].hash, .parent = ps[i].parent})) {
            slot_put(&c->st, dst[i]);  // (the copy into it is harmless: nothing reads it)
            c->staged_drops++;
        }
}

void pd_kvconn_tiers_poll(pd_kvconn_tiers *c) {
    if (!c || !c->is_staged) return;
    start_saves(c);
    int k = 0;
    while (k < c->n_fly && pd_backend_xfer_fence_done(c->p.backend, c->fly[k].fence)) {
        inflight *x = &c->fly[k++];
        if (x->kind == FLY_HOT_SAVE) {
            hot_save_done(c, x->slot);
            continue;
        }
        if (x->kind == FLY_HOT_LOAD) {
            hot_load_done(c, x);
            continue;
        }
        if (!x->is_save) {
            slot_put(&c->st, x->slot);
            continue;
        }
        if (c->st.is_bf16) {
            if (offload_slot_bf16(c, x) != PD_OK) slot_put(&c->st, x->slot);  // queue full (counted) or no memory
            continue;
        }
        save_fill *f = pd_malloc(sizeof *f);
        if (f) *f = (save_fill){.c = c, .slot = x->slot};
        if (!f || pd_kvt_tiers_offload_fill(c->t, x->hash, x->parent, on_save_fill, f) != PD_OK) {
            pd_free(f);  // queue full (counted there) or out of memory
            slot_put(&c->st, x->slot);
        }
    }
    if (k) memmove(c->fly, c->fly + k, sizeof *c->fly * (size_t)(c->n_fly - k));
    c->n_fly -= k;
}

uint64_t pd_kvconn_fingerprint64(const pd_kvw_fingerprint *f) {
    uint64_t v[] = {f->arch, f->n_layers, f->n_heads, f->n_kv_heads, f->head_dim, f->hidden, f->vocab,
                    f->kv_dtype, f->block_size, f->weights_hash};
    return XXH3_64bits(v, sizeof v);
}

pd_kvconn_tiers *pd_kvconn_tiers_new(const pd_kvconn_tier_params *p, pd_err *err) {
    if (!p->dram_bytes && !p->disk_dir && !p->remote_url) {
        pd_err_set(err, PD_ERR_INVALID, "kv tiers: no tier configured");
        return NULL;
    }
    size_t row_el = (size_t)p->fp.n_kv_heads * p->fp.head_dim;
    if (!p->backend || p->cache.n_layers <= 0 || p->cache.n_layers > 4096 || p->cache.n_layers != (int)p->fp.n_layers) {
        pd_err_set(err, PD_ERR_INVALID, "kv tiers: no backend or a bad layer count");
        return NULL;
    }
    bool is_cpu = !strcmp(pd_backend_name(p->backend), "cpu");
    bool is_f32 = p->fp.kv_dtype == PD_DTYPE_F32 && p->cache.row_bytes == row_el * 4;
    bool is_bf16 = p->fp.kv_dtype == PD_DTYPE_BF16 && p->cache.row_bytes == row_el * 2;
    const char *force = getenv("PDSERVE_KV_TIER_STAGING");  // test hook: the staged path on the cpu backend
    bool staged = !is_cpu || (force && !strcmp(force, "1"));
    if (!(is_cpu && !staged ? is_f32 : (is_f32 || is_bf16))) {
        pd_err_set(err, PD_ERR_UNSUPPORTED,
                   "--kv-offload-* / --kv-remote need a KV cache of the activation dtype (--kv-cache-dtype auto: f32 on "
                   "cpu, bf16 on cuda); the %s backend's cache here has %zu-byte rows of dtype %s",
                   pd_backend_name(p->backend), p->cache.row_bytes, pd_dtype_name((pd_dtype)p->fp.kv_dtype));
        return NULL;
    }
    if (p->remote_url && (!p->secret || !*p->secret)) {
        pd_err_set(err, PD_ERR_INVALID, "--kv-remote needs --auth-token-file: the Redis pool moves KV, so it authenticates "
                                        "(its requirepass is that secret)");
        return NULL;
    }
    if (p->disk_dir && !p->disk_bytes) {
        pd_err_set(err, PD_ERR_INVALID, "--kv-offload-disk needs --kv-offload-disk-size SIZE");
        return NULL;
    }
    pd_kvt_dtype dt = p->dtype && *p->dtype ? pd_kvt_dtype_parse(p->dtype) : PD_KVT_F32;
    if (!dt) {
        pd_err_set(err, PD_ERR_INVALID, "--kv-offload-dtype: '%s' is not one of bf16, fp8, int8, f32", p->dtype);
        return NULL;
    }
    pd_kvconn_tiers *c = pd_calloc(1, sizeof *c);
    if (!c) {
        pd_err_set(err, PD_ERR_NOMEM, "kv tiers: out of memory");
        return NULL;
    }
    c->p = *p;
    c->dtype = dt;
    c->geom = (pd_kvt_geom){.n_layers = (int)p->fp.n_layers, .n_kv_heads = (int)p->fp.n_kv_heads,
                            .head_dim = (int)p->fp.head_dim, .block_size = p->cache.block_size};
    c->block_bytes = (size_t)p->cache.block_size * p->cache.row_bytes;
    c->is_staged = staged;
    c->st.is_bf16 = is_bf16;
    if (staged && stage_init(c, err)) {
        pd_free(c);
        return NULL;
    }
    // The DRAM tier keeps pages exact: f32 for an f32 cache, bf16 (half the bytes) for a bf16 one.
    pd_kvt_tiers_params tp = {.geom = c->geom, .fingerprint = pd_kvconn_fingerprint64(&p->fp), .dtype = dt,
                              .dram_dtype = is_bf16 ? PD_KVT_BF16 : PD_KVT_F32, .queue_max = p->queue_max};
    // Tier workers: a GPU's prefill completes ~2000 Llama-3-8B blocks a second and one worker
    // encodes ~1000; on a host with cores to spare several run in parallel (loads first).
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    tp.n_threads = ncpu >= 16 ? 4 : ncpu >= 8 ? 2 : 1;
    pd_kvt_store_params sp = {.geom = c->geom, .fingerprint = tp.fingerprint, .policy = PD_KVT_S3FIFO};
    bool hot_on;  // PDSERVE_KV_TIER_HOT=0: a device cache's DRAM tier in the chain
    if (pd_env_switch("PDSERVE_KV_TIER_HOT", true, &hot_on, err)) {
        stage_fini(c);
        pd_free(c);
        return NULL;
    }
    c->use_hot = staged && p->dram_bytes && hot_on;
    if (c->use_hot) {
        if (hot_init(c, p->dram_bytes, err)) {
            stage_fini(c);
            pd_free(c);
            return NULL;
        }
        // Same-step loads copy layer group by layer group (the compute of layer l waits for its
        // group only): PDSERVE_KV_TIER_LAYERWISE=N layers a copy (default 1), 0: one copy, one fence.
        const char *lw_env = getenv("PDSERVE_KV_TIER_LAYERWISE");
        c->lw_group = 1;
        if (lw_env && *lw_env) {
            char *end;
            long g = strtol(lw_env, &end, 10);
            if (*end || g < 0 || g > 4096) {
                pd_err_set(err, PD_ERR_INVALID, "PDSERVE_KV_TIER_LAYERWISE=%s: want 0 (off) or layers a copy", lw_env);
                hot_fini(c);
                stage_fini(c);
                pd_free(c);
                return NULL;
            }
            c->lw_group = (int)g;
        }
        if (pd_env_switch("PDSERVE_KV_TIER_JIT", false, &c->lw_jit, err)) {  // 1: just-in-time layer-wise commits
            hot_fini(c);
            stage_fini(c);
            pd_free(c);
            return NULL;
        }
        // The chain below is [disk][redis]: the disk gets DRAM's victims (write-back), Redis (the
        // cluster pool) every block as soon as DRAM holds it.
        c->hot_lower_on_evict = p->disk_dir ? 1u : 0u;
        c->hot_lower_at_insert = p->remote_url ? 1u << (p->disk_dir ? 1 : 0) : 0u;
    } else if (p->dram_bytes) {
        if (arena_init(&c->arena, p->backend, pd_kvt_page_bytes(&c->geom, tp.dram_dtype ? tp.dram_dtype : PD_KVT_F32),
                       p->dram_bytes, err)) {
            stage_fini(c);
            pd_free(c);
            return NULL;
        }
        sp.capacity = p->dram_bytes;
        sp.page_alloc = arena_alloc;
        sp.page_free = arena_free;
        sp.page_ud = &c->arena;
        if (!(tp.stores[tp.n_stores++] = pd_kvt_dram_new(&sp, err))) goto fail;
        sp.page_alloc = NULL;
        sp.page_free = NULL;
        sp.page_ud = NULL;
    }
    if (p->disk_dir) {
        sp.capacity = p->disk_bytes;
        sp.dir = p->disk_dir;
        if (!(tp.stores[tp.n_stores++] = pd_kvt_disk_new(&sp, err))) goto fail;
        snprintf(c->disk_dir, sizeof c->disk_dir, "%s", p->disk_dir);
        sp.dir = NULL;
    }
    if (p->remote_url) {
        sp.secret = p->secret;
        if (!(tp.stores[tp.n_stores++] = pd_kvt_redis_new(&sp, p->remote_url, err))) goto fail;
        snprintf(c->remote, sizeof c->remote, "%s", p->remote_url);
    }
    c->n_tiers = tp.n_stores + (c->use_hot ? 1 : 0);
    if (tp.n_stores > 0) {
        c->t = pd_kvt_tiers_new(&tp, err);
        if (!c->t) goto fail_stores;
    }
    c->p.disk_dir = c->p.remote_url = c->p.dtype = c->p.secret = NULL;  // borrowed for the call
    return c;
fail:
    tp.n_stores--;  // the failed one is NULL
fail_stores:
    for (int i = 0; i < tp.n_stores; i++) pd_kvt_store_free(tp.stores[i]);
    arena_fini(&c->arena);
    hot_fini(c);
    stage_fini(c);
    pd_free(c);
    return NULL;
}

void pd_kvconn_tiers_free(pd_kvconn_tiers *c) {
    if (!c) return;
    pd_kvconn_tiers_step_end(c);  // same-step loads still queued: copied (their pages unpinned below)
    if (c->is_staged) {
        pd_backend_xfer_sync(c->p.backend);  // every staged copy finished: hand the saves over
        pd_kvconn_tiers_poll(c);
    }
    if (c->use_hot) {
        hot *h = &c->hot;
        PD_LOG_I("kv tiers: DRAM (pages = staged rows): %lld pages written, %lld saves of held blocks skipped, %lld "
                 "dropped (no free slot), %lld evicted, %lld not written below (writes behind); %lld loads, %lld "
                 "blocks, %lld hit / %lld missed; %.1f us a block enqueue -> fence seen; same-step copies: %lld "
                 "commits, %lld layer-wise (%d layers a copy), %lld fenced at the step's end, %lld made while the "
                 "last saves' copy still ran",
                 (long long)h->puts, (long long)c->staged_resident, (long long)h->drops, (long long)h->evictions,
                 (long long)h->lower_skipped,
                 (long long)h->loads, (long long)h->load_blocks, (long long)h->hits, (long long)h->misses,
                 h->us_per_block, (long long)c->lw_commits, (long long)c->lw_layered, c->lw_group,
                 (long long)c->lw_fallbacks, (long long)c->lw_saves_pending);
    }
    if (c->t) pd_kvt_tiers_free(c->t);  // runs what is queued (loads end with their event), joins; frees the stores
    arena_fini(&c->arena);    // after the DRAM store gave its pages back
    hot_fini(c);              // after the tier workers let go of its pages
    stage_fini(c);            // (load events still queued for the engine keep their tier_load: freed there)
    pd_free(c->pend);
    pd_free(c->fly);
    pd_free(c->lw);
    pd_free(c);
}

static float *block_row(pd_kvconn_tiers *c, void *layer_base, int32_t block) {
    return (float *)((char *)layer_base + (size_t)block * c->block_bytes);
}

void pd_kvconn_tiers_save(pd_kvconn_tiers *c, int32_t block_id, pd_hash128 hash, pd_hash128 parent) {
    if (block_id < 0 || block_id >= c->p.cache.n_blocks) return;
    if (c->is_staged) {  // copied at the next poll (the engine polls right after its saves)
        if (c->n_pend == c->cap_pend) {
            int cap = c->cap_pend ? 2 * c->cap_pend : 256;
            pending_save *n = pd_realloc(c->pend, sizeof *n * (size_t)cap);
            if (!n) {
                c->staged_drops++;
                return;
            }
            c->pend = n;
            c->cap_pend = cap;
        }
        c->pend[c->n_pend++] = (pending_save){.block = block_id, .hash = hash, .parent = parent};
        return;
    }
    const float *k[4096], *v[4096];
    for (int l = 0; l < c->geom.n_layers; l++) {
        k[l] = block_row(c, c->p.cache.k[l], block_id);
        v[l] = block_row(c, c->p.cache.v[l], block_id);
    }
    (void)pd_kvt_tiers_offload(c->t, hash, parent, k, v);  // a full queue drops it (counted)
}

int pd_kvconn_tiers_match(pd_kvconn_tiers *c, const pd_hash128 *hashes, int n, int *n_sure, double *cost_us) {
    if (!c->use_hot) return pd_kvt_tiers_probe(c->t, hashes, n, n_sure, cost_us);
    pthread_mutex_lock(&c->hot.mu);
    int k = hot_lead_locked(&c->hot, hashes, n);
    // A prompt asking for these blocks is a reuse of each one, whichever tier ends up serving it:
    // the policy hears of it here. Else a prefix the device pool keeps serving (a shared system
    // prompt, the latest turns of a chat) is never hit in DRAM, ages out of S3-FIFO's small queue,
    // and every chain through it is lost (a match starts at the root), however hot its descendants.
    for (int i = 0; i < k; i++) (void)pd_kvt_policy_get(c->hot.pol, hashes[i]);
    double us = c->hot.us_per_block * k;
    pthread_mutex_unlock(&c->hot.mu);
    int sure = 0, m = 0;
    double cost = 0;
    if (k < n && c->t) m = pd_kvt_tiers_probe(c->t, hashes + k, n - k, &sure, &cost);
    if (n_sure) *n_sure = k + (k < n ? sure : 0);
    if (cost_us) *cost_us = us + cost;
    return k + m;
}

// On the tier thread: the load ended; hand it to the engine as an event.
static void on_loaded(void *ud, uint64_t req_id, int n_loaded, int64_t load_us) {
    tier_load *l = ud;
    pd_kvconn_tiers *c = l->c;
    pd_kvconn_event *ev = pd_calloc(1, sizeof *ev);
    for (int i = 0; i < 100 && !ev; i++) ev = pd_calloc(1, sizeof *ev);  // the blocks wait for it
    PD_ASSERT(ev);
    ev->kind = PD_KVCONN_EV_TIER_LOADED;
    ev->req_id = req_id;
    ev->status = PD_OK;
    ev->n_blocks = l->n_pre + n_loaded;
    ev->load_us = load_us;
    ev->tier_load = l;  // pd_kvconn_tiers_loaded (engine thread) uploads the slots and frees it
    c->p.on_event(c->p.ud, ev);
}

// On the tier thread: block b is in its slot already (a bf16 page into a bf16 cache's slot), or in
// the f32 scratch block: into its slot.
static void on_block_loaded(void *ud, int b, bool in_bf16) {
    tier_load *l = ud;
    if (!in_bf16) f32_to_slot(l->c, l->scratch, l->slots[b]);
}

static pd_status start_load_staged(pd_kvconn_tiers *c, uint64_t req_id, const pd_hash128 *hashes,
                                   const int32_t *dst_blocks, int n, int n_pre) {
    int L = c->geom.n_layers;
    size_t nf = c->block_bytes / (c->st.is_bf16 ? 2 : 4);
    tier_load *l = pd_calloc(1, sizeof *l);
    if (!l) return PD_ERR_NOMEM;
    l->c = c;
    l->n_pre = n_pre;
    l->slots = pd_malloc(sizeof *l->slots * (size_t)n);
    l->dst = pd_malloc(sizeof *l->dst * (size_t)n);
    l->scratch = pd_malloc(sizeof(float) * nf * 2 * (size_t)L);
    l->dk = pd_calloc((size_t)n, sizeof *l->dk);
    l->dv = pd_calloc((size_t)n, sizeof *l->dv);
    l->rows = pd_calloc(2 * (size_t)L, sizeof *l->rows);
    if (!l->slots || !l->dst || !l->scratch || !l->dk || !l->dv || !l->rows) {
        tier_load_free(l);
        return PD_ERR_NOMEM;
    }
    for (int j = 0; j < L; j++) {  // dk[b][j] / dv[b][j]: the scratch block's K / V rows of layer j
        l->rows[j] = l->scratch + (size_t)(2 * j) * nf;
        l->rows[L + j] = l->scratch + (size_t)(2 * j + 1) * nf;
    }
    int m = 0;
    for (; m < n; m++) {  // the leading blocks there are slots for; the rest is computed
        int s = slot_get(&c->st);
        if (s < 0) break;
        l->slots[m] = s;
        l->dst[m] = dst_blocks[m];
        l->dk[m] = l->rows;
        l->dv[m] = l->rows + L;
    }
    if (m < n) c->load_cuts++;
    if (!m) {
        tier_load_free(l);
        return PD_NOSPACE;
    }
    l->n = m;
    if (c->st.is_bf16) {  // bf16 pages go straight into the slots
        l->bk = pd_calloc((size_t)m, sizeof *l->bk);
        l->bv = pd_calloc((size_t)m, sizeof *l->bv);
        l->brows = pd_calloc((size_t)m * 2 * (size_t)L, sizeof *l->brows);
        if (!l->bk || !l->bv || !l->brows) {
            for (int i = 0; i < m; i++) slot_put(&c->st, l->slots[i]);
            tier_load_free(l);
            return PD_ERR_NOMEM;
        }
        for (int i = 0; i < m; i++) {
            l->bk[i] = l->brows + (size_t)(2 * i) * (size_t)L;
            l->bv[i] = l->brows + (size_t)(2 * i + 1) * (size_t)L;
            for (int j = 0; j < L; j++) {
                l->bk[i][j] = (uint16_t *)((uint8_t *)c->st.k[j] + (size_t)l->slots[i] * c->block_bytes);
                l->bv[i][j] = (uint16_t *)((uint8_t *)c->st.v[j] + (size_t)l->slots[i] * c->block_bytes);
            }
        }
    }
    pd_status st = pd_kvt_tiers_load_ex(c->t, req_id, hashes, m, (float *const *const *)l->dk,
                                        (float *const *const *)l->dv, (uint16_t *const *const *)l->bk,
                                        (uint16_t *const *const *)l->bv, on_block_loaded, on_loaded, l);
    if (st != PD_OK) {
        for (int i = 0; i < m; i++) slot_put(&c->st, l->slots[i]);
        tier_load_free(l);
    }
    return st;
}

void pd_kvconn_tiers_loaded(pd_kvconn_tiers *c, pd_kvconn_event *ev) {
    tier_load *l = ev->tier_load;
    ev->tier_load = NULL;
    if (!l) return;
    if (!c || !c->is_staged) {
        tier_load_free(l);
        return;
    }
    int n = ev->n_blocks - l->n_pre < l->n ? ev->n_blocks - l->n_pre : l->n;
    if (n < 0) n = 0;
    uint64_t f = 0;
    if (n > 0) {  // one copy slots -> the reserved blocks, before the next step's compute
        int32_t *rows = pd_malloc(sizeof *rows * (size_t)n);
        PD_ASSERT(rows);
        for (int i = 0; i < n; i++) rows[i] = c->p.cache.block_size;
        pd_backend_xfer_mark(c->p.backend);  // (after whatever compute last used the blocks)
        pd_kv_copy_params kp = {.src_k = c->st.k, .src_v = c->st.v, .dst_k = c->p.cache.k, .dst_v = c->p.cache.v,
                                .src_blocks = l->slots, .dst_blocks = l->dst, .n_rows = rows, .n_blocks = n,
                                .layer_begin = 0, .layer_end = c->geom.n_layers, .block_size = c->p.cache.block_size,
                                .row_bytes = c->p.cache.row_bytes};
        pd_op_kv_copy_xfer(c->p.backend, &kp);
        f = pd_backend_xfer_fence(c->p.backend);
        pd_free(rows);
    }
    for (int i = 0; i < l->n; i++) {
        if (i < n && fly_push(c, (inflight){.fence = f, .slot = l->slots[i], .is_save = false})) continue;
        if (i < n) pd_backend_xfer_sync(c->p.backend);  // (out of memory: wait, then free)
        slot_put(&c->st, l->slots[i]);
    }
    tier_load_free(l);
}

pd_status pd_kvconn_tiers_start_load(pd_kvconn_tiers *c, uint64_t req_id, const pd_hash128 *hashes,
                                     const int32_t *dst_blocks, int n) {
    if (n <= 0) return PD_ERR_INVALID;
    for (int i = 0; i < n; i++)
        if (dst_blocks[i] < 0 || dst_blocks[i] >= c->p.cache.n_blocks) return PD_ERR_INVALID;
    int L = c->geom.n_layers;
    if (c->use_hot) {
        // The leading blocks DRAM holds: uploaded now (one copy); the rest from the lower tiers.
        int k = hot_start_load(c, hashes, dst_blocks, n, false, false);
        pd_status st = k < n && c->t ? start_load_staged(c, req_id, hashes + k, dst_blocks + k, n - k, k) : PD_NOSPACE;
        if (st == PD_OK) return PD_OK;
        if (k == 0) return st == PD_NOSPACE ? PD_NOSPACE : st;
        tier_load *l = pd_calloc(1, sizeof *l);  // the event for the DRAM part alone
        while (!l) l = pd_calloc(1, sizeof *l);  // (the blocks are being written: it must come)
        l->c = c;
        l->n_pre = k;
        double us = c->hot.us_per_block * k;
        on_loaded(l, req_id, 0, (int64_t)us);
        return PD_OK;
    }
    if (c->is_staged) return start_load_staged(c, req_id, hashes, dst_blocks, n, 0);
    tier_load *l = pd_calloc(1, sizeof *l);
    if (!l) return PD_ERR_NOMEM;
    l->c = c;
    l->n = n;
    l->dk = pd_calloc((size_t)n, sizeof *l->dk);
    l->dv = pd_calloc((size_t)n, sizeof *l->dv);
    l->rows = pd_calloc((size_t)n * 2 * (size_t)L, sizeof *l->rows);
    if (!l->dk || !l->dv || !l->rows) {
        tier_load_free(l);
        return PD_ERR_NOMEM;
    }
    for (int i = 0; i < n; i++) {
        l->dk[i] = l->rows + (size_t)(2 * i) * (size_t)L;
        l->dv[i] = l->rows + (size_t)(2 * i + 1) * (size_t)L;
        for (int j = 0; j < L; j++) {
            l->dk[i][j] = block_row(c, c->p.cache.k[j], dst_blocks[i]);
            l->dv[i][j] = block_row(c, c->p.cache.v[j], dst_blocks[i]);
        }
    }
    pd_status st = pd_kvt_tiers_load(c->t, req_id, hashes, n, (float *const *const *)l->dk,
                                     (float *const *const *)l->dv, on_loaded, l);
    if (st != PD_OK) tier_load_free(l);
    return st;
}

int pd_kvconn_tiers_load_now(pd_kvconn_tiers *c, const pd_hash128 *hashes, const int32_t *dst_blocks, int n) {
    // (Not while a just-in-time commit is open: its end releases every queued load's pins at its
    // own fence, and a load queued after it would be released before it was ever copied.)
    if (!c->use_hot || n <= 0 || c->jit_open) return 0;
    for (int i = 0; i < n; i++)
        if (dst_blocks[i] < 0 || dst_blocks[i] >= c->p.cache.n_blocks) return 0;
    return hot_start_load(c, hashes, dst_blocks, n, true, c->lw_group > 0);
}

// The pins of the committed loads' pages end when the host sees fence f; the queue empties.
static void lw_release_at(pd_kvconn_tiers *c, uint64_t f) {
    hot *h = &c->hot;
    for (int i = 0; i < c->n_lw; i++)
        if (!fly_push(c, (inflight){.fence = f, .slot = c->lw[i].slot, .kind = FLY_HOT_LOAD, .t0 = c->lw[i].t0,
                                    .n_load = c->lw[i].n_load})) {
            pd_backend_xfer_sync(c->p.backend);
            pthread_mutex_lock(&h->mu);
            hot_release_locked(h, c->lw[i].slot);
            pthread_mutex_unlock(&h->mu);
        }
    c->n_lw = 0;
}

// Just-in-time commit: the layer groups up to (not including) layer_end, then, once every layer is
// enqueued, the host fence that ends the pages' pins.
static void jit_enqueue_upto(pd_kvconn_tiers *c, int layer_end) {
    if (!c->jit_open) return;
    int L = c->geom.n_layers, g = PD_MAX(c->lw_group, 1);
    hot *h = &c->hot;
    pd_kv_copy_params kp = {.src_k = h->k, .src_v = h->v, .dst_k = c->p.cache.k, .dst_v = c->p.cache.v,
                            .src_blocks = c->jit_src, .dst_blocks = c->jit_dst, .n_rows = c->jit_rows,
                            .n_blocks = c->jit_n, .block_size = c->p.cache.block_size,
                            .row_bytes = c->p.cache.row_bytes};
    while (c->jit_next < PD_MIN(layer_end, L)) {
        kp.layer_begin = c->jit_next;
        kp.layer_end = PD_MIN(c->jit_next + g, L);
        pd_op_kv_copy_xfer(c->p.backend, &kp);
        for (int l = kp.layer_begin; l < kp.layer_end; l++) pd_backend_xfer_layer_ready(c->p.backend, l);
        c->jit_next = kp.layer_end;
    }
    if (c->jit_next < L) return;
    lw_release_at(c, pd_backend_xfer_fence_host(c->p.backend));
    pd_free(c->jit_src), pd_free(c->jit_dst), pd_free(c->jit_rows);
    c->jit_src = c->jit_dst = c->jit_rows = NULL;
    c->jit_open = false;
}

int pd_kvconn_tiers_load_now_commit(pd_kvconn_tiers *c, bool layerwise) {
    if (!c || c->n_lw == 0 || c->jit_open) return 0;
    PD_ASSERT(c->lw_marked == c->lw_waited);  // the last layer-wise commit was closed (step_end)
    int n = c->n_lw, L = c->geom.n_layers, bs = c->p.cache.block_size;
    int32_t *src = pd_malloc(sizeof *src * (size_t)n), *dst = pd_malloc(sizeof *dst * (size_t)n);
    int32_t *rows = pd_malloc(sizeof *rows * (size_t)n);
    while (!src || !dst || !rows) {  // (the pages are pinned and the blocks promised: it must happen)
        pd_free(src), pd_free(dst), pd_free(rows);
        src = pd_malloc(sizeof *src * (size_t)n), dst = pd_malloc(sizeof *dst * (size_t)n);
        rows = pd_malloc(sizeof *rows * (size_t)n);
    }
    for (int i = 0; i < n; i++) src[i] = c->lw[i].slot, dst[i] = c->lw[i].dst, rows[i] = bs;
    if (c->save_fence && !pd_backend_xfer_fence_done(c->p.backend, c->save_fence)) c->lw_saves_pending++;
    hot *h = &c->hot;
    pd_kv_copy_params kp = {.src_k = h->k, .src_v = h->v, .dst_k = c->p.cache.k, .dst_v = c->p.cache.v,
                            .src_blocks = src, .dst_blocks = dst, .n_rows = rows, .n_blocks = n,
                            .block_size = bs, .row_bytes = c->p.cache.row_bytes};
    pd_backend_xfer_mark(c->p.backend);  // (after whatever compute last used the blocks)
    uint64_t f;
    int marked = 0;
    if (layerwise && c->lw_jit) {
        // Just in time: the first group now, the others from layer_wait (jit_enqueue_upto).
        c->jit_src = src, c->jit_dst = dst, c->jit_rows = rows, c->jit_n = n;
        c->jit_next = 0;
        c->jit_open = true;
        c->lw_commits++;
        c->lw_layered++;
        c->lw_marked = L;
        c->lw_waited = 0;
        jit_enqueue_upto(c, 1);
        return L;
    }
    if (layerwise) {
        // Layer group by layer group, each marked ready: the compute of layer l waits only for
        // the copies up to l's group (pd_kvconn_tiers_layer_wait), the rest overlaps it.
        int g = PD_MAX(c->lw_group, 1);
        for (int l0 = 0; l0 < L; l0 += g) {
            kp.layer_begin = l0;
            kp.layer_end = PD_MIN(l0 + g, L);
            pd_op_kv_copy_xfer(c->p.backend, &kp);
            for (int l = l0; l < kp.layer_end; l++) pd_backend_xfer_layer_ready(c->p.backend, l);
        }
        f = pd_backend_xfer_fence_host(c->p.backend);  // the pages' pins end when the host sees it
        marked = L;
        c->lw_layered++;
    } else {
        kp.layer_begin = 0;
        kp.layer_end = L;
        pd_op_kv_copy_xfer(c->p.backend, &kp);
        f = pd_backend_xfer_fence(c->p.backend);  // compute enqueued from now on runs after it
    }
    c->lw_commits++;
    c->lw_marked = marked;
    c->lw_waited = 0;
    lw_release_at(c, f);
    pd_free(src), pd_free(dst), pd_free(rows);
    return marked;
}

void pd_kvconn_tiers_layer_wait(pd_kvconn_tiers *c, int layer) {
    if (!c || layer < 0 || layer >= c->lw_marked) return;
    jit_enqueue_upto(c, layer + 1);  // (just in time: this layer's group, if not enqueued yet)
    pd_backend_xfer_layer_wait(c->p.backend, layer);
    if (layer == c->lw_waited) c->lw_waited++;  // layers waited for in order, from 0
}

void pd_kvconn_tiers_step_end(pd_kvconn_tiers *c) {
    if (!c) return;
    jit_enqueue_upto(c, c->geom.n_layers);      // a just-in-time commit's groups not reached yet
    pd_kvconn_tiers_load_now_commit(c, false);  // queued and never committed: copied, fenced
    if (c->lw_waited < c->lw_marked) {
        // A layer-wise commit whose layers the compute did not all wait for (the step failed, or
        // ran without the hook): whatever compute comes next runs after every copy.
        (void)pd_backend_xfer_fence(c->p.backend);
        c->lw_fallbacks++;
    }
    c->lw_marked = c->lw_waited = 0;
}

void pd_kvconn_tiers_stats_get(pd_kvconn_tiers *c, pd_kvconn_tiers_stats *out) {
    pd_kvt_tiers_stats s = {0};
    if (c->t) pd_kvt_tiers_stats_get(c->t, &s);
    memset(out, 0, sizeof *out);
    int h0 = c->use_hot ? 1 : 0;  // the hot DRAM tier comes first
    out->n_tiers = s.n_tiers + h0;
    for (int i = 0; i < s.n_tiers && i + h0 < PD_KVCONN_MAX_TIERS; i++) {
        pd_kvconn_tier_stat *o = &out->tier[i + h0];
        const pd_kvt_tier_stats *t = &s.tier[i];
        snprintf(o->name, sizeof o->name, "%s", t->name);
        o->hits = t->store.hits;
        o->misses = t->store.misses;
        o->puts = t->store.puts;
        o->put_failures = t->store.put_failures;
        o->evictions = t->store.evictions;
        o->bad_pages = t->store.bad_pages;
        o->bytes_in = t->store.bytes_in;
        o->bytes_out = t->store.bytes_out;
        o->bytes_used = t->store.bytes_used;
        o->capacity = t->store.capacity;
        o->n_items = t->store.n_items;
        memcpy(o->load_hist, t->load_hist, sizeof o->load_hist);
    }
    out->offloads_queued = s.offloads_queued;
    out->offloads_dropped = s.offloads_dropped + c->staged_drops;
    out->offloads_done = s.offloads_done;
    out->loads = s.loads;
    out->load_blocks = s.load_blocks;
    out->load_misses = s.load_misses;
    out->promotions = s.promotions;
    snprintf(out->dtype, sizeof out->dtype, "%s", pd_kvt_dtype_name(c->dtype));
    out->dram_pinned = c->arena.base && pd_backend_host_is_pinned(c->p.backend);
    out->staging_slots = c->is_staged ? c->st.n_slots : 0;
    out->load_cuts = c->load_cuts;
    out->samestep_commits = c->lw_commits;
    out->samestep_layerwise = c->lw_layered;
    out->samestep_fenced = c->lw_fallbacks;
    out->samestep_saves_pending = c->lw_saves_pending;
    int64_t rn[PD_KVCONN_NOTIFY_N] = {s.remote_notify.evicted, s.remote_notify.expired, s.remote_notify.deleted,
                                      s.remote_notify.ignored, s.remote_notify.config_refused};
    memcpy(out->remote_notify, rn, sizeof rn);
    if (c->use_hot) {
        hot *h = &c->hot;
        pd_kvconn_tier_stat *o = &out->tier[0];
        pd_kvt_policy_stats ps;
        pthread_mutex_lock(&h->mu);
        pd_kvt_policy_stats_get(h->pol, &ps);
        snprintf(o->name, sizeof o->name, "dram");
        o->hits = h->hits;
        o->misses = h->misses;
        o->puts = h->puts;
        o->evictions = h->evictions;
        o->bytes_in = h->bytes_in;
        o->bytes_out = h->bytes_out;
        o->n_items = ps.n_items;
        o->bytes_used = (uint64_t)ps.n_items * block_bytes_all(c);
        o->capacity = (uint64_t)h->cap_blocks * block_bytes_all(c);
        memcpy(o->load_hist, h->load_hist, sizeof o->load_hist);
        out->offloads_queued += h->offloads + h->drops;
        out->offloads_done += h->offloads;
        out->offloads_dropped += h->drops;
        out->loads += h->loads;
        out->load_blocks += h->load_blocks;
        pthread_mutex_unlock(&h->mu);
        out->dram_pinned = pd_backend_host_is_pinned(c->p.backend);
    }
}

bool pd_kvconn_tiers_flush(pd_kvconn_tiers *c, int timeout_ms) {
    if (c->is_staged) {
        pd_backend_xfer_sync(c->p.backend);
        pd_kvconn_tiers_poll(c);
    }
    return c->t ? pd_kvt_tiers_flush(c->t, timeout_ms) : true;
}

int pd_kvconn_tiers_events_drain(pd_kvconn_tiers *c, pd_kvconn_tier_event *out, int n_max) {
    int n0 = 0;
    if (c->use_hot) {  // the DRAM tier's own events first
        pthread_mutex_lock(&c->hot.mu);
        while (n0 < n_max && c->hot.ev_n > 0) {
            out[n0++] = c->hot.ev[c->hot.ev_head];
            c->hot.ev_head = (c->hot.ev_head + 1) % 4096;
            c->hot.ev_n--;
        }
        pthread_mutex_unlock(&c->hot.mu);
        if (n0 == n_max || !c->t) return n0;
        out += n0;
        n_max -= n0;
    }
    pd_kvt_event ev[256];
    int n = pd_kvt_tiers_events_drain(c->t, ev, n_max < 256 ? n_max : 256);
    for (int i = 0; i < n; i++) {
        const char *nm = pd_kvt_tiers_name(c->t, ev[i].tier);
        out[i] = (pd_kvconn_tier_event){.kind = !strcmp(nm, "dram")   ? PD_KVCONN_TIER_DRAM
                                                : !strcmp(nm, "disk") ? PD_KVCONN_TIER_DISK
                                                                      : PD_KVCONN_TIER_REDIS,
                                        .is_stored = ev[i].is_stored, .hash = ev[i].hash, .parent = ev[i].parent};
    }
    return n0 + n;
}
