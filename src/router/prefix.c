// prefix.c — the router's global prefix index: block hash → bitmask of the workers that hold it.
//
// Design: one pd_map (base/map.h: open addressing, backward-shift deletion, so lookups never
// degrade after churn) keyed by the 128-bit chained block hash, valued by a 64-bit worker mask. It
// grows at 1/2 load and never shrinks. The hash's low word is already uniformly mixed (XXH3), so it
// is the map hash.
//
// The index is a *prediction*: it is fed by workers' STORED/REMOVED/ALL_CLEARED events (and by the
// router's own optimistic inserts after routing), so it may lag the truth by a heartbeat. Routing
// only uses it to rank workers; correctness never depends on it.
#include <string.h>

#include "base/map.h"
#include "router/core_impl.h"

typedef struct entry {
    pd_hash128 h;
    uint64_t mask;       // workers whose device pool holds it
    uint64_t tier_mask;  // workers with it in a KV tier below the pool: OR of tmask
    uint64_t tmask[3];   // per tier (pd_wire_tier 1..3): workers with it there
} entry;                 // never both masks 0: an entry whose last worker leaves is deleted

struct pd_router_prefix {
    pd_map map;  // of entry
    int64_t max_entries;
};

pd_router_prefix *pd_router_prefix_new(int64_t max_entries) {
    if (max_entries <= 0) return NULL;
    pd_router_prefix *p = pd_calloc(1, sizeof *p);
    if (!p) return NULL;
    p->max_entries = max_entries;
    if (pd_map_init(&p->map, &(pd_map_params){.entry_size = sizeof(entry), .key_size = sizeof(pd_hash128)}) != PD_OK ||
        pd_map_reserve(&p->map, 512) != PD_OK) {
        pd_free(p);
        return NULL;
    }
    return p;
}

void pd_router_prefix_free(pd_router_prefix *p) {
    if (!p) return;
    pd_map_fini(&p->map);
    pd_free(p);
}

pd_status pd_router_prefix_add(pd_router_prefix *p, pd_hash128 h, int w) {
    PD_ASSERT(w >= 0 && w < 64);
    entry *e = pd_map_find(&p->map, h.lo, &h);
    if (!e) {
        if ((int64_t)pd_map_len(&p->map) >= p->max_entries) return PD_NOSPACE;
        e = pd_map_put(&p->map, h.lo, &h, NULL);
        if (!e) return PD_ERR_NOMEM;
    }
    e->mask |= 1ull << w;
    return PD_OK;
}

void pd_router_prefix_remove(pd_router_prefix *p, pd_hash128 h, int w) {
    entry *e = pd_map_find(&p->map, h.lo, &h);
    if (!e) return;
    e->mask &= ~(1ull << w);
    if (!e->mask && !e->tier_mask) pd_map_del_entry(&p->map, e);
}

pd_status pd_router_prefix_add_tier(pd_router_prefix *p, pd_hash128 h, int w, int tier) {
    PD_ASSERT(w >= 0 && w < 64 && tier >= 1 && tier <= 3);
    entry *e = pd_map_find(&p->map, h.lo, &h);
    if (!e) {
        if ((int64_t)pd_map_len(&p->map) >= p->max_entries) return PD_NOSPACE;
        e = pd_map_put(&p->map, h.lo, &h, NULL);
        if (!e) return PD_ERR_NOMEM;
    }
    e->tmask[tier - 1] |= 1ull << w;
    e->tier_mask |= 1ull << w;
    return PD_OK;
}

void pd_router_prefix_remove_tier(pd_router_prefix *p, pd_hash128 h, int w, int tier) {
    PD_ASSERT(w >= 0 && w < 64 && tier >= 1 && tier <= 3);
    entry *e = pd_map_find(&p->map, h.lo, &h);
    if (!e) return;
    e->tmask[tier - 1] &= ~(1ull << w);
    e->tier_mask = e->tmask[0] | e->tmask[1] | e->tmask[2];
    if (!e->mask && !e->tier_mask) pd_map_del_entry(&p->map, e);
}

static bool clear_bit(void *ent, void *ctx) {
    entry *e = ent;
    uint64_t bit = *(const uint64_t *)ctx;
    e->mask &= ~bit;
    for (int t = 0; t < 3; t++) e->tmask[t] &= ~bit;
    e->tier_mask &= ~bit;
    return e->mask == 0 && e->tier_mask == 0;
}

void pd_router_prefix_clear_worker(pd_router_prefix *p, int w) {
    uint64_t bit = 1ull << w;
    pd_map_remove_if(&p->map, clear_bit, &bit);
}

uint64_t pd_router_prefix_get(const pd_router_prefix *p, pd_hash128 h) {
    const entry *e = pd_map_find(&p->map, h.lo, &h);
    return e ? e->mask : 0;
}

void pd_router_prefix_count(const pd_router_prefix *p, int64_t out[64][4]) {
    memset(out, 0, 64 * sizeof out[0]);
    for (size_t i = 0; i < p->map.cap; i++) {
        const entry *e = pd_map_slot(&p->map, i);
        if (!e) continue;
        uint64_t m[4] = {e->mask, e->tmask[0], e->tmask[1], e->tmask[2]};
        for (int k = 0; k < 4; k++)
            for (uint64_t b = m[k]; b; b &= b - 1) out[__builtin_ctzll(b)][k]++;
    }
}

uint64_t pd_router_prefix_get_tiers(const pd_router_prefix *p, pd_hash128 h) {
    const entry *e = pd_map_find(&p->map, h.lo, &h);
    return e ? e->tier_mask : 0;
}

void pd_router_prefix_match_tiers(const pd_router_prefix *p, const pd_hash128 *hashes, int n, uint64_t workers,
                                  int32_t out_n_blocks[64]) {
    memset(out_n_blocks, 0, 64 * sizeof *out_n_blocks);
    uint64_t alive = workers;
    for (int i = 0; i < n && alive; i++) {
        const entry *e = pd_map_find(&p->map, hashes[i].lo, &hashes[i]);
        alive &= e ? (e->mask | e->tier_mask) : 0;
        for (uint64_t a = alive; a; a &= a - 1) out_n_blocks[__builtin_ctzll(a)] = i + 1;
    }
}

int64_t pd_router_prefix_n_entries(const pd_router_prefix *p) { return (int64_t)pd_map_len(&p->map); }

void pd_router_prefix_match(const pd_router_prefix *p, const pd_hash128 *hashes, int n,
                            uint64_t workers, int32_t out_n_blocks[64]) {
    memset(out_n_blocks, 0, 64 * sizeof *out_n_blocks);
    uint64_t alive = workers;
    for (int i = 0; i < n && alive; i++) {
        alive &= pd_router_prefix_get(p, hashes[i]);
        for (uint64_t a = alive; a; a &= a - 1) out_n_blocks[__builtin_ctzll(a)] = i + 1;
    }
}

int pd_router_hash_prompt(const int32_t *tokens, int n_tokens, int block_size, pd_hash128 *out) {
    if (block_size <= 0) return 0;
    int n = n_tokens / block_size;
    for (int i = 0; i < n; i++)
        out[i] = pd_hash_block(i ? &out[i - 1] : NULL, tokens + (size_t)i * (size_t)block_size,
                               block_size);
    return n;
}
