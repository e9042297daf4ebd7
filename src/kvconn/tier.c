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
// Pool memory: the cache must be host-resident f32 rows (the cpu backend): its blocks are the
// pages' own layout (block_size rows of n_kv_heads x head_dim floats per layer, K then V). A device
// cache (CUDA, bf16) would need a pinned staging copy on a transfer stream: refused with a clear
// error until that path exists.
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <xxhash.h>

#include "kvconn/kvconn.h"
#include "kvtier/kvtier.h"

// The DRAM tier's page memory: one allocation from the backend (pinned host memory on CUDA, plain
// on the CPU backend) cut into fixed slots of one page each (every DRAM page has the same size:
// f32, one geometry). One slot more than the capacity holds: a put allocates its copy before the
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

struct pd_kvconn_tiers {
    pd_kvconn_tier_params p;
    page_arena arena;     // the DRAM tier's pages
    pd_kvt_tiers *t;
    pd_kvt_geom geom;
    size_t block_bytes;   // one block, one layer, K or V
    char remote[128];     // the Redis URL (for /status), "" without
    char disk_dir[512];
    pd_kvt_dtype dtype;   // lower tiers' pages
};

typedef struct tier_load {  // one load in flight: the destination row pointers (owned)
    pd_kvconn_tiers *c;
    int n;
    float ***dk, ***dv;      // (n) blocks x (n_layers) rows
    float **rows;            // (2 * n * n_layers) the pointer storage behind dk / dv
} tier_load;

static void tier_load_free(tier_load *l) {
    if (!l) return;
    pd_free(l->dk);
    pd_free(l->dv);
    pd_free(l->rows);
    pd_free(l);
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
    size_t row_f32 = (size_t)p->fp.n_kv_heads * p->fp.head_dim * sizeof(float);
    if (!p->backend || strcmp(pd_backend_name(p->backend), "cpu") || p->cache.row_bytes != row_f32 ||
        p->fp.kv_dtype != PD_DTYPE_F32) {
        pd_err_set(err, PD_ERR_UNSUPPORTED,
                   "--kv-offload-* / --kv-remote need a host-resident f32 KV cache (the cpu backend, --kv-cache-dtype auto); "
                   "this build has no device staging path for the %s backend yet",
                   p->backend ? pd_backend_name(p->backend) : "?");
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
    pd_kvt_tiers_params tp = {.geom = c->geom, .fingerprint = pd_kvconn_fingerprint64(&p->fp), .dtype = dt,
                              .queue_max = p->queue_max};
    pd_kvt_store_params sp = {.geom = c->geom, .fingerprint = tp.fingerprint, .policy = PD_KVT_S3FIFO};
    if (p->dram_bytes) {
        if (arena_init(&c->arena, p->backend, pd_kvt_page_bytes(&c->geom, PD_KVT_F32), p->dram_bytes, err)) {
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
    c->t = pd_kvt_tiers_new(&tp, err);
    if (!c->t) goto fail_stores;
    c->p.disk_dir = c->p.remote_url = c->p.dtype = c->p.secret = NULL;  // borrowed for the call
    return c;
fail:
    tp.n_stores--;  // the failed one is NULL
fail_stores:
    for (int i = 0; i < tp.n_stores; i++) pd_kvt_store_free(tp.stores[i]);
    arena_fini(&c->arena);
    pd_free(c);
    return NULL;
}

void pd_kvconn_tiers_free(pd_kvconn_tiers *c) {
    if (!c) return;
    pd_kvt_tiers_free(c->t);  // runs what is queued (loads end with their event), joins; frees the stores
    arena_fini(&c->arena);    // after the DRAM store gave its pages back
    pd_free(c);
}

static float *block_row(pd_kvconn_tiers *c, void *layer_base, int32_t block) {
    return (float *)((char *)layer_base + (size_t)block * c->block_bytes);
}

void pd_kvconn_tiers_save(pd_kvconn_tiers *c, int32_t block_id, pd_hash128 hash, pd_hash128 parent) {
    if (block_id < 0 || block_id >= c->p.cache.n_blocks) return;
    const float *k[4096], *v[4096];
    for (int l = 0; l < c->geom.n_layers; l++) {
        k[l] = block_row(c, c->p.cache.k[l], block_id);
        v[l] = block_row(c, c->p.cache.v[l], block_id);
    }
    (void)pd_kvt_tiers_offload(c->t, hash, parent, k, v);  // a full queue drops it (counted)
}

int pd_kvconn_tiers_match(pd_kvconn_tiers *c, const pd_hash128 *hashes, int n, int *n_sure, double *cost_us) {
    return pd_kvt_tiers_probe(c->t, hashes, n, n_sure, cost_us);
}

// On the tier thread: the load ended; hand it to the engine as an event.
static void on_loaded(void *ud, uint64_t req_id, int n_loaded, int64_t load_us) {
    tier_load *l = ud;
    pd_kvconn_tiers *c = l->c;
    tier_load_free(l);
    pd_kvconn_event *ev = pd_calloc(1, sizeof *ev);
    for (int i = 0; i < 100 && !ev; i++) ev = pd_calloc(1, sizeof *ev);  // the blocks wait for it
    PD_ASSERT(ev);
    ev->kind = PD_KVCONN_EV_TIER_LOADED;
    ev->req_id = req_id;
    ev->status = PD_OK;
    ev->n_blocks = n_loaded;
    ev->load_us = load_us;
    c->p.on_event(c->p.ud, ev);
}

pd_status pd_kvconn_tiers_start_load(pd_kvconn_tiers *c, uint64_t req_id, const pd_hash128 *hashes,
                                     const int32_t *dst_blocks, int n) {
    if (n <= 0) return PD_ERR_INVALID;
    for (int i = 0; i < n; i++)
        if (dst_blocks[i] < 0 || dst_blocks[i] >= c->p.cache.n_blocks) return PD_ERR_INVALID;
    int L = c->geom.n_layers;
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

void pd_kvconn_tiers_stats_get(pd_kvconn_tiers *c, pd_kvconn_tiers_stats *out) {
    pd_kvt_tiers_stats s;
    pd_kvt_tiers_stats_get(c->t, &s);
    memset(out, 0, sizeof *out);
    out->n_tiers = s.n_tiers;
    for (int i = 0; i < s.n_tiers && i < PD_KVCONN_MAX_TIERS; i++) {
        pd_kvconn_tier_stat *o = &out->tier[i];
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
    out->offloads_dropped = s.offloads_dropped;
    out->offloads_done = s.offloads_done;
    out->loads = s.loads;
    out->load_blocks = s.load_blocks;
    out->load_misses = s.load_misses;
    out->promotions = s.promotions;
    snprintf(out->dtype, sizeof out->dtype, "%s", pd_kvt_dtype_name(c->dtype));
    out->dram_pinned = c->arena.base && pd_backend_host_is_pinned(c->p.backend);
}

bool pd_kvconn_tiers_flush(pd_kvconn_tiers *c, int timeout_ms) {
    return pd_kvt_tiers_flush(c->t, timeout_ms);
}

int pd_kvconn_tiers_events_drain(pd_kvconn_tiers *c, pd_kvconn_tier_event *out, int n_max) {
    pd_kvt_event ev[256];
    int n = pd_kvt_tiers_events_drain(c->t, ev, n_max < 256 ? n_max : 256);
    for (int i = 0; i < n; i++) {
        const char *nm = pd_kvt_tiers_name(c->t, ev[i].tier);
        out[i] = (pd_kvconn_tier_event){.kind = !strcmp(nm, "dram")   ? PD_KVCONN_TIER_DRAM
                                                : !strcmp(nm, "disk") ? PD_KVCONN_TIER_DISK
                                                                      : PD_KVCONN_TIER_REDIS,
                                        .is_stored = ev[i].is_stored, .hash = ev[i].hash, .parent = ev[i].parent};
    }
    return n;
}
